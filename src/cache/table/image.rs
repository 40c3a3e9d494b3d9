//! The table side across a warm restart: its columns, every row it holds (by object key and
//! resourceVersion, as received, with the moment each arrived) and its bookmark row, saved
//! with the cache's state (`cache::persist`) and loaded back, so a restarted proxy answers
//! Tables at once and its side resumes its upstream watch from where it stopped rather than
//! fetch every row again (one Table LIST's worth of the apiserver's printing per resource
//! and restart: 9.6 CPU-s for `kubectl get pods -A` over 100,000 pods).
//!
//! Rows are facts about object versions, so a restored row stays right whatever happened
//! meanwhile: versions written while the proxy was down get theirs from the resumed watch
//! (or its initial events after a 410), and columns that changed (an edited CRD) arrive with
//! the resumed watch's first event, which drops every row as it always does.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use serde::{Deserialize, Serialize};

use super::{ClockCell, ClockKind, Row, TableStore};
use crate::cache::ObjectKey;

/// A table side's state, as saved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableImage {
    /// The `columnDefinitions` the rows were printed under.
    pub columns: String,
    /// The resourceVersion the side's stream had passed: it resumes from there.
    pub progress: u64,
    /// The row its bookmarks showed, if one came.
    pub bookmark: Option<RowImage>,
    /// Every row held, oldest version first per key.
    pub rows: Vec<KeyedRow>,
}

/// One object version's row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyedRow {
    pub namespace: String,
    pub name: String,
    pub rv: u64,
    pub row: RowImage,
}

/// A row as received: cells' and conditions' JSON text, the creation time its age cells
/// print from, and when it arrived (its clock-relative cells were printed then).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowImage {
    pub cells: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<i64>,
    #[serde(default)]
    pub clock_bound: bool,
    /// A cell printed relative to the clock: (index, kind, a pod's restarts' `N (`, as
    /// printed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_cell: Option<(usize, ClockKind, String, String)>,
    /// A custom resource's date cells of other fields: (index, as printed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dates: Vec<(usize, String)>,
    pub received_ms: i64,
}

impl RowImage {
    fn of(r: &Row) -> RowImage {
        RowImage {
            cells: r.cells.iter().map(|c| c.to_string()).collect(),
            conditions: r.conditions.as_deref().map(str::to_string),
            created: r.created,
            clock_bound: r.clock_bound,
            clock_cell: r
                .clock_cell
                .as_ref()
                .map(|x| (x.index, x.kind, x.prefix.to_string(), x.printed.to_string())),
            dates: r.dates.iter().map(|(i, p)| (*i, p.to_string())).collect(),
            received_ms: r.received_ms,
        }
    }

    /// The row under the columns of `generation`; `None` when its cells are not JSON values
    /// (a file is refused whole for one, by the caller).
    fn row(self, generation: u64) -> Option<Row> {
        let json = |s: &str| serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok();
        if !self.cells.iter().all(|c| json(c)) || !self.conditions.as_deref().is_none_or(json) {
            return None;
        }
        if self.dates.iter().any(|(i, _)| *i >= self.cells.len()) {
            return None;
        }
        let clock_cell = match self.clock_cell {
            Some((index, kind, prefix, printed)) if index < self.cells.len() => Some(ClockCell {
                index,
                kind,
                prefix: prefix.into(),
                printed: printed.into(),
            }),
            Some(_) => return None,
            None => None,
        };
        Some(Row {
            cells: self.cells.into_iter().map(Box::from).collect(),
            conditions: self.conditions.map(Box::from),
            created: self.created,
            generation,
            clock_bound: self.clock_bound,
            clock_cell,
            dates: self.dates.into_iter().map(|(i, p)| (i, p.into())).collect(),
            received_ms: self.received_ms,
        })
    }
}

impl TableStore {
    /// The side's state for a warm restart: `None` unless it has synced (a side that never
    /// did has nothing a restarted proxy could serve) and holds servable columns.
    pub fn image(&self) -> Option<TableImage> {
        if self.shed.is_cancelled() {
            return None;
        }
        let s = self.state.read();
        let cols = s.columns.as_ref().filter(|c| c.unservable.is_none())?;
        if !s.synced {
            return None;
        }
        let mut rows = Vec::with_capacity(s.count);
        for (key, versions) in &s.rows {
            for (rv, row, _) in versions
                .iter()
                .filter(|(_, r, _)| r.generation == cols.generation)
            {
                rows.push(KeyedRow {
                    namespace: key.namespace.to_string(),
                    name: key.name.to_string(),
                    rv: *rv,
                    row: RowImage::of(row),
                });
            }
        }
        // In key order: the same side saves the same image.
        rows.sort_by(|a, b| (&a.namespace, &a.name, a.rv).cmp(&(&b.namespace, &b.name, b.rv)));
        Some(TableImage {
            columns: cols.raw.to_string(),
            progress: self.progress.load(Relaxed),
            bookmark: s
                .bookmark
                .as_ref()
                .filter(|b| b.generation == cols.generation)
                .map(|b| RowImage::of(b)),
            rows,
        })
    }

    /// Loads a saved side into a store that has not started: its Tables are served at once
    /// and its side, started now, resumes from the saved progress
    /// ([`TableStore::take_resume`]). Nothing is loaded when the bound is off or the saved
    /// columns or a row do not read; rows beyond the bound shed the resource as they would
    /// have arriving.
    pub fn restore(&self, image: TableImage) -> Result<(), &'static str> {
        if !self.budget.enabled() || self.shed.is_cancelled() {
            return Ok(());
        }
        {
            let s = self.state.read();
            if s.columns.is_some() || !s.rows.is_empty() {
                return Err("the table side already holds rows");
            }
        }
        self.set_columns(&image.columns)
            .ok_or("the table columns do not read")?;
        let cols = self.columns().ok_or("the table columns do not read")?;
        if cols.unservable.is_some() {
            return Ok(());
        }
        let g = cols.generation;
        let bookmark = match image.bookmark {
            Some(b) => Some(Arc::new(b.row(g).ok_or("a table bookmark row")?)),
            None => None,
        };
        let mut rows = std::collections::HashMap::<ObjectKey, super::Versions>::new();
        let mut bytes = 0usize;
        let mut count = 0usize;
        for k in image.rows {
            let row = k.row.row(g).ok_or("a table row")?;
            let key = ObjectKey::new(&k.namespace, &k.name);
            bytes += row.bytes() + key.name.len() + key.namespace.len();
            let v = rows.entry(key).or_default();
            if v.iter().any(|(r, _, _)| *r == k.rv) {
                return Err("a table row twice");
            }
            v.push((k.rv, Arc::new(row), None));
            count += 1;
        }
        for v in rows.values_mut() {
            v.sort_by_key(|(r, _, _)| *r);
        }
        {
            let mut s = self.state.write();
            s.rows = rows;
            s.bookmark = bookmark;
            s.bytes = bytes;
            s.count = count;
            s.synced = true;
        }
        self.charged.fetch_add(bytes as u64, Relaxed);
        if !self.budget.charge(bytes as u64) {
            self.shed_rows();
            return Ok(());
        }
        self.progress.fetch_max(image.progress, Relaxed);
        *self.resume.lock() = Some(image.progress);
        self.want();
        self.changed.notify_waiters();
        Ok(())
    }

    /// Where the side resumes its upstream watch after a warm restart
    /// ([`TableStore::restore`]); `None` afterwards, and for a side that starts afresh.
    pub fn take_resume(&self) -> Option<u64> {
        self.resume.lock().take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::proto_budget::ProtoBudget;
    use crate::cache::table::{
        CREATION_DOC, human_duration, now_ms, parse_table_event, parse_time,
    };

    fn columns() -> String {
        let q = serde_json::to_string(CREATION_DOC).unwrap();
        format!(
            r#"[{{"name":"Name","type":"string","format":"name","description":"n","priority":0}},{{"name":"Age","type":"string","format":"","description":{q},"priority":0}}]"#
        )
    }

    fn store(budget: u64) -> TableStore {
        TableStore::new(false, "", "configmaps", Arc::new(ProtoBudget::new(budget)))
    }

    const CREATED: &str = "2026-12-07T11:00:00Z";

    /// A row whose age cell is the one the clock gives now (as the apiserver printed it).
    fn row(name: &str, rv: u64) -> String {
        let age = human_duration(now_ms() - parse_time(CREATED).unwrap() * 1000);
        format!(
            r#"{{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{{"resourceVersion":"{rv}"}},"rows":[{{"cells":["{name}","{age}"],"object":{{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{{"name":"{name}","namespace":"ns","resourceVersion":"{rv}","creationTimestamp":"{CREATED}"}}}}}}]}}"#
        )
    }

    fn filled() -> TableStore {
        let s = store(u64::MAX);
        s.set_columns(&columns()).unwrap();
        for (name, rv) in [("a", 5), ("a", 7), ("b", 6)] {
            for r in parse_table_event(&row(name, rv)).unwrap().rows {
                s.attach(r.key, r.rv, r.row, now_ms());
            }
        }
        let bookmark = r#"{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{"resourceVersion":"8"},"rows":[{"cells":["",null],"object":{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{"resourceVersion":"8"}}}]}"#;
        for r in parse_table_event(bookmark).unwrap().rows {
            s.set_bookmark_row(r.row);
        }
        s.advance(8);
        s
    }

    #[test]
    fn a_synced_side_is_restored_with_its_rows_and_resumes_where_it_stopped() {
        let s = filled();
        assert_eq!(s.image(), None, "not before it synced");
        s.set_synced(true);
        let image = s.image().unwrap();
        assert_eq!(image.rows.len(), 3);
        assert_eq!(image.progress, 8);
        let t = store(u64::MAX);
        t.restore(image.clone()).unwrap();
        assert!(t.ready(), "Tables are served at once");
        assert_eq!(t.take_resume(), Some(8));
        assert_eq!(t.take_resume(), None);
        let cols = t.columns().unwrap();
        let a = ObjectKey::new("ns", "a");
        for rv in [5, 7] {
            let (was, is) = (
                s.row(&a, rv, s.columns().unwrap().generation).unwrap(),
                t.row(&a, rv, cols.generation).unwrap(),
            );
            assert_eq!(was.cells, is.cells);
            assert_eq!(
                was.received_ms, is.received_ms,
                "as received, not re-checked"
            );
        }
        assert!(t.row_before(&a, 7, cols.generation).is_some());
        assert!(t.bookmarks_servable());
        assert_eq!(t.image(), Some(image.clone()), "the same side, saved again");
        // Into a side that already started: refused.
        assert!(t.restore(image.clone()).is_err());
        // A cell that is not JSON: the whole side is refused.
        let mut bad = image.clone();
        bad.rows[1].row.cells[0] = "not json".into();
        assert!(store(u64::MAX).restore(bad).is_err());
        // Beyond the bound: shed, as rows arriving would be.
        let small = store(10);
        small.restore(image).unwrap();
        assert!(small.shed.is_cancelled());
        assert!(!small.ready());
    }
}
