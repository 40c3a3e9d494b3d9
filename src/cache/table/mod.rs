//! The table side of a resource's cache: the rows kube-apiserver's printers compute for each
//! object version (`as=Table`, what `kubectl get` asks for), kept beside the cache so Table
//! reads are answered from memory with the apiserver's own cells.
//!
//! Rows come from one upstream WATCH per resource in Table form (`reflector::table`), started
//! by the resource's first Table reader; this module holds what it delivers (`read::table`
//! assembles responses from it). Nothing here computes a cell from an object except the cells that
//! change with the clock alone (below): built-in printers live in the apiserver, and a custom
//! resource's columns follow its CRD, so the apiserver's rows are the only exact source.
//!
//! **Rows** are kept by object key and resourceVersion ([`TableStore::attach`]), so a snapshot
//! at any resourceVersion finds the row of each of its object versions; a version the JSON
//! side has since replaced or deleted keeps its row for [`TableStore::reconcile`]'s
//! retention (the life of a paginated walk's snapshot), then gives it back.
//!
//! **Columns**: the first event of every upstream watch carries the resource's
//! `columnDefinitions`. When they change (a CRD's `additionalPrinterColumns` were edited)
//! every row held is of the old columns: they are dropped, the side is no longer synced, and
//! the upstream watch starts over with initial events to fetch the rows again.
//!
//! **Cells that change with the clock**: kube-apiserver prints ages relative to the moment it
//! encodes (`duration.HumanDuration(time.Since(creationTimestamp))`, "5m", "3d2h"). A row is
//! the apiserver's for an object version *and a moment*; the cache re-renders the columns
//! it knows to be an object's age at the moment it answers ([`Columns::age`]): a built-in's
//! `Age` column (described as `creationTimestamp`), a custom resource's `date` column of
//! `.metadata.creationTimestamp` (its default `Age` column included). A column that depends
//! on the clock otherwise makes the resource's Tables the apiserver's: a custom resource's
//! other `date` columns, and the built-ins whose printers print other relative times
//! ([`CLOCK_PRINTERS`]); a built-in row with a cell like `"2 (5m ago)"` (pods' restarts)
//! is not served either. Every age cell received is checked against the clock as it
//! arrives: a cell that is not the age the cache would print makes its row unservable.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use parking_lot::RwLock;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::cache::ObjectKey;
use crate::cache::proto_budget::ProtoBudget;

mod clock;
mod image;
pub use clock::{human_duration, now_ms, parse_time};
use clock::{pod_finished_times, put_age_cell, split_restarts};
pub use image::TableImage;

/// Built-in resources (group, resource) whose printers print a relative time other than the
/// object's age that the cache does not re-render (k8s.io/kubernetes
/// `pkg/printers/internalversion/printers.go` at the pinned version): an Event's first and
/// last seen, a ResourcePoolStatusRequest's completion, a DeviceTaintRule's time added.
/// Their Tables are the apiserver's. (A Job's duration and a CronJob's last schedule are
/// re-rendered: [`ClockKind`].)
pub const CLOCK_PRINTERS: &[(&str, &str)] = &[
    ("", "events"),
    ("events.k8s.io", "events"),
    ("resource.k8s.io", "resourcepoolstatusrequests"),
    ("resource.k8s.io", "devicetaintrules"),
];

/// `metav1.ObjectMeta`'s documentation of `creationTimestamp`: the description of every
/// built-in printer's `Age` column and of a CRD's default one.
pub const CREATION_DOC: &str = "CreationTimestamp is a timestamp representing the server time when this object was created. It is not guaranteed to be set in happens-before order across separate operations. Clients may not set this value. It is represented in RFC3339 form and is in UTC.\n\nPopulated by the system. Read-only. Null for lists. More info: https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#metadata";

/// A CRD printer column's description when its author gave none
/// (apiextensions-apiserver `tableconvertor.New`), for `.metadata.creationTimestamp`.
const CRD_CREATION_DESC: &str =
    "Custom resource definition column (in JSONPath format): .metadata.creationTimestamp";

/// A Table column after `Name`, as a CRD declares it and a Table describes it: (name, type,
/// format, description, priority).
pub type ColumnSig = (String, String, String, String, i64);

/// One of a CRD version's `additionalPrinterColumns`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PrinterColumn {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: String,
    #[serde(default)]
    pub format: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub priority: i64,
    #[serde(default)]
    pub json_path: String,
}

/// The columns after `Name` that the apiserver's Tables of a CRD version carry
/// (apiextensions-apiserver `tableconvertor.New`; a version without printer columns gets the
/// default `Age` of its creation timestamp, `serveDefaultColumnsIfEmpty`).
pub fn crd_columns(declared: &[PrinterColumn]) -> Vec<ColumnSig> {
    if declared.is_empty() {
        return vec![(
            "Age".into(),
            "date".into(),
            String::new(),
            CREATION_DOC.into(),
            0,
        )];
    }
    declared
        .iter()
        .map(|c| {
            let desc = if c.description.is_empty() {
                format!(
                    "Custom resource definition column (in JSONPath format): {}",
                    c.json_path
                )
            } else {
                c.description.clone()
            };
            (
                c.name.clone(),
                c.ty.clone(),
                c.format.clone(),
                desc,
                c.priority,
            )
        })
        .collect()
}

/// A resource's column definitions, as its Tables carry them.
#[derive(Debug)]
pub struct Columns {
    /// The `columnDefinitions` array, as the apiserver wrote it.
    pub raw: Box<str>,
    /// The indexes of the columns that print the object's age (re-rendered when served).
    pub age: Vec<usize>,
    /// Why this resource's Tables cannot be served from the cache (a column that depends on
    /// the clock otherwise); `None` when they can.
    pub unservable: Option<&'static str>,
    /// Empty lists have `"rows":null` (the apiserver's default table convertor, for resources
    /// without printers: its columns are `Name` and `Created At`) rather than `[]`.
    pub null_when_empty: bool,
    /// Bumped whenever the definitions change: rows of another generation are not used.
    pub generation: u64,
    /// The columns after `Name` (compared with a CRD's declared ones).
    pub sig: Vec<ColumnSig>,
    /// Every column's name.
    pub names: Vec<String>,
    /// A custom resource's `date` columns of another field than its creation timestamp, by
    /// index, with their JSONPath's segments (`.status.lastSeen`: printed as the time since
    /// that field's timestamp, re-rendered when served: [`Row::cells_now`]).
    pub dates: Vec<(usize, Box<[Box<str>]>)>,
}

/// The prefix of the description apiextensions gives a CRD's printer column that has none
/// of its own, before the column's JSONPath.
const CRD_COLUMN_DESC: &str = "Custom resource definition column (in JSONPath format): ";

/// `.a.b.c` (field names only) as its segments; `None` for anything else (a JSONPath with
/// filters, indexes, quoting or wildcards is not evaluated here).
fn simple_path(path: &str) -> Option<Box<[Box<str>]>> {
    let rest = path.strip_prefix('.')?;
    let segs: Vec<Box<str>> = rest.split('.').map(Box::from).collect();
    let plain = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    segs.iter().all(|s| plain(s)).then(|| segs.into())
}

#[derive(Deserialize)]
struct ColumnDef<'a> {
    #[serde(borrow)]
    name: std::borrow::Cow<'a, str>,
    #[serde(borrow, rename = "type")]
    ty: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    format: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    description: std::borrow::Cow<'a, str>,
    #[serde(default)]
    priority: i64,
}

impl Columns {
    /// Reads `raw` (a `columnDefinitions` array) for a resource: `custom` for custom
    /// resources, `group`/`resource` for [`CLOCK_PRINTERS`]. `None` when it cannot be read.
    pub fn parse(
        raw: &str,
        custom: bool,
        group: &str,
        resource: &str,
        generation: u64,
    ) -> Option<Columns> {
        let defs: Vec<ColumnDef<'_>> = serde_json::from_str(raw).ok()?;
        let mut age = Vec::new();
        let mut dates = Vec::new();
        let mut unservable = None;
        for (i, d) in defs.iter().enumerate() {
            if custom {
                if d.ty == "date" {
                    if d.description == CREATION_DOC || d.description == CRD_CREATION_DESC {
                        age.push(i);
                    } else if let Some(path) = d
                        .description
                        .strip_prefix(CRD_COLUMN_DESC)
                        .and_then(simple_path)
                    {
                        dates.push((i, path));
                    } else {
                        unservable = Some("table: a date column of a path not read here");
                    }
                }
            } else if d.name == "Age" && d.ty == "string" && d.description == CREATION_DOC {
                age.push(i);
            }
        }
        if !custom && CLOCK_PRINTERS.contains(&(group, resource)) {
            unservable = Some("table: a printer of relative times");
        }
        let null_when_empty = !custom
            && defs.len() == 2
            && defs[0].name == "Name"
            && defs[1].name == "Created At"
            && defs[1].ty == "date";
        let sig = defs
            .iter()
            .skip(1)
            .map(|d| {
                (
                    d.name.to_string(),
                    d.ty.to_string(),
                    d.format.to_string(),
                    d.description.to_string(),
                    d.priority,
                )
            })
            .collect();
        Some(Columns {
            raw: raw.into(),
            age,
            unservable,
            null_when_empty,
            generation,
            sig,
            names: defs.iter().map(|d| d.name.to_string()).collect(),
            dates,
        })
    }
}

/// One object version's row (without its object, which the cache writes from its own copy).
#[derive(Debug, PartialEq, Eq)]
pub struct Row {
    /// Each cell's JSON, as the apiserver wrote it (age cells are re-rendered when served).
    pub cells: Box<[Box<str>]>,
    /// The row's `conditions` array, when it has one.
    pub conditions: Option<Box<str>>,
    /// `metadata.creationTimestamp`, seconds since the epoch.
    pub created: Option<i64>,
    /// The columns' generation it was computed under.
    pub generation: u64,
    /// A cell that depends on the clock in a way the cache cannot re-render: not served.
    pub clock_bound: bool,
    /// A pod's restarts cell printed relative to the clock (`"2 (5m ago)"`), a Job's
    /// duration or a CronJob's last schedule, re-rendered when served
    /// ([`Row::clock_cell_now`]).
    pub clock_cell: Option<ClockCell>,
    /// A custom resource's date cells of other fields than its creation ([`Columns::dates`]),
    /// by index, as printed: re-rendered when served ([`Row::cells_now`]).
    pub dates: Box<[(usize, Box<str>)]>,
    /// When the row arrived (milliseconds since the epoch): the moment its clock-relative
    /// cells were printed, give or take the way from the apiserver.
    pub received_ms: i64,
}

/// A cell bound to the clock that the cache cannot re-render exactly: the apiserver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a table cell bound to the clock cannot be re-rendered exactly")]
pub struct NotRerendered;

/// What a cell printed relative to the clock shows, and where its time comes from in the
/// object version the row is of (k8s.io/kubernetes `pkg/printers/internalversion`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ClockKind {
    /// A pod's restarts `"N (X ago)"` (`printPod`): X is the time since the latest
    /// `lastState.terminated.finishedAt` of the containers it counts, which depend on the
    /// pod's initialization.
    PodRestarts,
    /// A Job's `Duration` (`printJob`): the time since `status.startTime` while it runs; once
    /// complete, `completionTime - startTime`, which the clock does not move.
    JobDuration,
    /// A CronJob's `Last Schedule` (`printCronJob`): the time since
    /// `status.lastScheduleTime`, `<none>` without one.
    CronJobLastSchedule,
}

/// A cell printed relative to the clock, re-rendered when served from the object version
/// the row is of ([`Row::clock_cell_now`]).
#[derive(Debug, PartialEq, Eq)]
pub struct ClockCell {
    /// The cell's index.
    pub index: usize,
    pub kind: ClockKind,
    /// A pod's restarts' `N (`: the count, which does not change with the clock.
    pub prefix: Box<str>,
    /// `X`, as printed when the row arrived.
    pub printed: Box<str>,
}

impl Row {
    /// The clock cell's JSON at `now_ms` for the object version `object` (its JSON):
    /// `Ok(None)` when the row has none or its cell does not move with the clock; `Err` when
    /// it cannot be re-rendered exactly. The time it counts from must print as the cell did
    /// when the row arrived. A pod's restarts count from one of its `finishedAt`s that does;
    /// when those that do would print differently now, the cell is not re-rendered (the
    /// printer's choice among them is not repeated here).
    pub fn clock_cell_now(
        &self,
        object: &[u8],
        now_ms: i64,
    ) -> Result<Option<String>, NotRerendered> {
        let Some(r) = &self.clock_cell else {
            return Ok(None);
        };
        let printed_then = |t: i64| self.printed_on_arrival(t, &r.printed);
        let since = |t: i64| {
            let x = human_duration(now_ms - t * 1000);
            if x.starts_with('<') {
                Err(NotRerendered)
            } else {
                Ok(Some(format!("\"{x}\"")))
            }
        };
        let from = match r.kind {
            ClockKind::PodRestarts => None,
            ClockKind::JobDuration => match clock::job_times(object).ok_or(NotRerendered)? {
                (Some(start), None) => Some(start),
                // Not started (an empty cell), or complete (a fixed duration).
                _ => return Ok(None),
            },
            ClockKind::CronJobLastSchedule => {
                match clock::last_schedule(object).ok_or(NotRerendered)? {
                    Some(t) => Some(t),
                    None => return Ok(None),
                }
            }
        };
        if let Some(t) = from {
            return if printed_then(t) {
                since(t)
            } else {
                Err(NotRerendered)
            };
        }
        let times = pod_finished_times(object).ok_or(NotRerendered)?;
        let mut now: Option<String> = None;
        for t in times.into_iter().filter(|t| printed_then(*t)) {
            let x = human_duration(now_ms - t * 1000);
            if now.as_ref().is_some_and(|n| *n != x) {
                return Err(NotRerendered);
            }
            now = Some(x);
        }
        let x = now.ok_or(NotRerendered)?;
        if x.starts_with('<') {
            return Err(NotRerendered);
        }
        Ok(Some(format!("\"{}{x} ago)\"", r.prefix)))
    }

    /// Whether the time since `t` printed as `printed` when the row arrived (give or take
    /// the way from the apiserver).
    fn printed_on_arrival(&self, t: i64, printed: &str) -> bool {
        (-2..=1).any(|ds: i64| human_duration(self.received_ms + ds * 1000 - t * 1000) == printed)
    }

    /// Every cell re-rendered at `now_ms` for the object version `object` but the ages
    /// (which `put` prints): (index, the cell's JSON). `Err` when one cannot be re-rendered
    /// exactly: the apiserver answers.
    pub fn cells_now(
        &self,
        cols: &Columns,
        object: &[u8],
        now_ms: i64,
    ) -> Result<Vec<(usize, String)>, NotRerendered> {
        let mut out = Vec::new();
        if let (Some(c), Some(x)) = (&self.clock_cell, self.clock_cell_now(object, now_ms)?) {
            out.push((c.index, x));
        }
        if self.dates.is_empty() {
            return Ok(out);
        }
        let v: serde_json::Value = serde_json::from_slice(object).map_err(|_| NotRerendered)?;
        for (i, printed) in &self.dates {
            let (_, path) = cols
                .dates
                .iter()
                .find(|(c, _)| c == i)
                .ok_or(NotRerendered)?;
            let t = path
                .iter()
                .try_fold(&v, |v, seg| v.get(&**seg))
                .and_then(serde_json::Value::as_str)
                .and_then(parse_time)
                .filter(|t| self.printed_on_arrival(*t, printed))
                .ok_or(NotRerendered)?;
            let x = human_duration(now_ms - t * 1000);
            if x.starts_with('<') {
                return Err(NotRerendered);
            }
            out.push((*i, format!("\"{x}\"")));
        }
        Ok(out)
    }

    fn bytes(&self) -> usize {
        self.cells.iter().map(|c| c.len() + 16).sum::<usize>()
            + self.conditions.as_ref().map_or(0, |c| c.len())
            + 64
    }

    /// Writes the row: `{"cells":[..],"conditions":..,"object":..}` with `object` written by
    /// `object` (`null` for includeObject=None), its age cells at `now_ms`.
    pub fn put(
        &self,
        b: &mut BytesMut,
        cols: &Columns,
        now_ms: i64,
        replaced: &[(usize, String)],
        object: impl FnOnce(&mut BytesMut),
    ) {
        self.put_cells(b, Some((&cols.age, now_ms)), replaced, object);
    }

    /// The row with its cells as received: a bookmark's (its empty object has no age; a
    /// custom resource's date column of it is `null`, a built-in's `<unknown>`).
    pub fn put_as_received(&self, b: &mut BytesMut, object: impl FnOnce(&mut BytesMut)) {
        self.put_cells(b, None, &[], object);
    }

    fn put_cells(
        &self,
        b: &mut BytesMut,
        ages: Option<(&[usize], i64)>,
        replaced: &[(usize, String)],
        object: impl FnOnce(&mut BytesMut),
    ) {
        b.put_slice(b"{\"cells\":[");
        for (i, c) in self.cells.iter().enumerate() {
            if i > 0 {
                b.put_u8(b',');
            }
            if let Some((age, now_ms)) = ages
                && age.contains(&i)
            {
                put_age_cell(b, self.created, now_ms);
            } else if let Some((_, cell)) = replaced.iter().find(|(j, _)| *j == i) {
                b.put_slice(cell.as_bytes());
            } else {
                b.put_slice(c.as_bytes());
            }
        }
        b.put_u8(b']');
        if let Some(c) = &self.conditions {
            b.put_slice(b",\"conditions\":");
            b.put_slice(c.as_bytes());
        }
        b.put_slice(b",\"object\":");
        object(b);
        b.put_u8(b'}');
    }
}

/// What one row of an upstream Table event says.
#[derive(Debug)]
pub struct RowIn {
    pub key: ObjectKey,
    pub rv: u64,
    pub row: Row,
    /// The row's object carried the `k8s.io/initial-events-end` annotation (a bookmark).
    pub initial_events_end: bool,
}

#[derive(Deserialize)]
struct TableIn<'a> {
    #[serde(borrow)]
    kind: std::borrow::Cow<'a, str>,
    #[serde(borrow, rename = "columnDefinitions", default)]
    columns: Option<&'a RawValue>,
    #[serde(borrow, default)]
    rows: Option<Vec<RowWire<'a>>>,
}

#[derive(Deserialize)]
struct RowWire<'a> {
    #[serde(borrow)]
    cells: Vec<&'a RawValue>,
    #[serde(borrow, default)]
    conditions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    object: Option<ObjectWire<'a>>,
}

#[derive(Deserialize)]
struct ObjectWire<'a> {
    #[serde(borrow, default)]
    metadata: Option<MetaWire<'a>>,
}

#[derive(Deserialize)]
struct MetaWire<'a> {
    #[serde(borrow, default)]
    name: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    namespace: std::borrow::Cow<'a, str>,
    #[serde(borrow, default, rename = "resourceVersion")]
    resource_version: std::borrow::Cow<'a, str>,
    #[serde(borrow, default, rename = "creationTimestamp")]
    creation: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    annotations: Option<HashMap<std::borrow::Cow<'a, str>, std::borrow::Cow<'a, str>>>,
}

/// A Table as an upstream watch event carries it (`includeObject=Metadata`): its column
/// definitions (the first event of a watch; `null` after) and its rows.
#[derive(Debug)]
pub struct TableEvent {
    pub columns: Option<String>,
    pub rows: Vec<RowIn>,
}

/// Reads the Table of one watch event (`object` of the event line).
///
/// # Errors
/// When it is not a Table with rows whose objects carry their metadata.
pub fn parse_table_event(object: &str) -> Result<TableEvent, &'static str> {
    // serde reads a struct from an array too: a Table is an object.
    if !object.trim_start().starts_with('{') {
        return Err("table event: not a Table");
    }
    let t: TableIn<'_> = serde_json::from_str(object).map_err(|_| "table event: not a Table")?;
    if t.kind != "Table" {
        return Err("table event: not a Table");
    }
    let columns = t
        .columns
        .map(|c| c.get())
        .filter(|c| *c != "null")
        .map(str::to_string);
    let mut rows = Vec::new();
    for r in t.rows.unwrap_or_default() {
        let m = r
            .object
            .and_then(|o| o.metadata)
            .ok_or("table event: a row without its object's metadata")?;
        let initial_events_end = m.annotations.as_ref().is_some_and(|a| {
            a.get("k8s.io/initial-events-end")
                .is_some_and(|v| v == "true")
        });
        let rv = if m.resource_version.is_empty() {
            0
        } else {
            m.resource_version
                .parse()
                .map_err(|_| "table event: resourceVersion")?
        };
        let clock_bound = r
            .cells
            .iter()
            .any(|c| c.get().starts_with('"') && c.get().ends_with(" ago)\""));
        let ago: Vec<usize> = (0..r.cells.len())
            .filter(|&i| r.cells[i].get().ends_with(" ago)\""))
            .collect();
        let restarts = match ago.as_slice() {
            [i] => split_restarts(r.cells[*i].get()).map(|(prefix, printed)| ClockCell {
                index: *i,
                kind: ClockKind::PodRestarts,
                prefix: prefix.into(),
                printed: printed.into(),
            }),
            _ => None,
        };
        rows.push(RowIn {
            key: ObjectKey::new(&m.namespace, &m.name),
            rv,
            row: Row {
                cells: r.cells.iter().map(|c| Box::from(c.get())).collect(),
                conditions: r.conditions.map(|c| Box::from(c.get())),
                created: m.creation.as_deref().and_then(parse_time),
                generation: 0,
                clock_bound,
                clock_cell: restarts,
                dates: Box::default(),
                received_ms: 0,
            },
            initial_events_end,
        });
    }
    Ok(TableEvent { columns, rows })
}

/// One key's row versions, oldest first, each with when the JSON side was seen past it.
type Versions = Vec<(u64, Arc<Row>, Option<Instant>)>;

#[derive(Debug, Default)]
struct State {
    columns: Option<Arc<Columns>>,
    rows: HashMap<ObjectKey, Versions>,
    /// The side's initial state has come whole, under the current columns.
    synced: bool,
    /// The row the apiserver prints for a bookmark (its empty object) under the current
    /// columns, as the side's last bookmark showed it: cache-served Table watches write
    /// their bookmarks with it.
    bookmark: Option<Arc<Row>>,
    bytes: usize,
    count: usize,
}

/// Counters of the table side and of Table reads (read by the metrics collector).
#[derive(Debug, Default)]
pub struct TableStats {
    /// Table responses the cache wrote.
    pub served: AtomicU64,
    /// Table reads handed to the apiserver (a row missing, the side not synced, a column
    /// that depends on the clock).
    pub passed_through: AtomicU64,
    /// Rows received from the upstream Table watch.
    pub rows_in: AtomicU64,
    /// Rows received whose age cell was not the age the cache prints (kept unservable).
    pub age_mismatches: AtomicU64,
    /// Column definition changes (each drops the rows and fetches them again).
    pub column_changes: AtomicU64,
}

/// The table side's rows and columns for one resource (see the module docs).
#[derive(Debug)]
pub struct TableStore {
    custom: bool,
    group: String,
    resource: String,
    state: RwLock<State>,
    wanted_tx: tokio::sync::watch::Sender<bool>,
    wanted_at: OnceLock<Instant>,
    /// Woken when rows attach or the side syncs (reads waiting for a row).
    changed: tokio::sync::Notify,
    /// The process-wide bound of rows' bytes (`cache.tableMaxBytes`).
    budget: Arc<ProtoBudget>,
    charged: AtomicU64,
    /// Set when the bound shed this resource: its Tables are the apiserver's until restart.
    pub shed: tokio_util::sync::CancellationToken,
    /// Asked by the store when the columns change: the upstream watch starts over.
    pub restart: AtomicBool,
    /// The columns a custom resource's CRD declares (`None` for built-ins, or before the CRD
    /// was read): Tables are served only while the side's columns are these.
    expected: parking_lot::Mutex<Option<Vec<ColumnSig>>>,
    /// Woken when the declared columns differ from the side's: its watch starts again.
    kick: tokio::sync::Notify,
    /// The resourceVersion the side's stream has passed (its synced events and bookmarks):
    /// every row of a version at or before it has come.
    progress: AtomicU64,
    /// Where the side resumes after a warm restart (`image::restore`), taken at its start.
    resume: parking_lot::Mutex<Option<u64>>,
    pub stats: TableStats,
}

/// How long a replaced version's row is kept for walks over older snapshots: as long as a
/// paginated list's snapshot may be retained (`StoreConfig::snapshot_max_age`'s default).
pub const SUPERSEDED_KEPT: Duration = Duration::from_secs(600);

impl TableStore {
    pub fn new(custom: bool, group: &str, resource: &str, budget: Arc<ProtoBudget>) -> TableStore {
        TableStore {
            custom,
            group: group.to_string(),
            resource: resource.to_string(),
            state: RwLock::default(),
            wanted_tx: tokio::sync::watch::Sender::new(false),
            wanted_at: OnceLock::new(),
            changed: tokio::sync::Notify::new(),
            budget,
            charged: AtomicU64::new(0),
            shed: tokio_util::sync::CancellationToken::new(),
            restart: AtomicBool::new(false),
            progress: AtomicU64::new(0),
            resume: parking_lot::Mutex::new(None),
            expected: parking_lot::Mutex::new(None),
            kick: tokio::sync::Notify::new(),
            stats: TableStats::default(),
        }
    }

    /// A Table reader came: the registry starts the side once (bound enabled, not shed).
    pub fn want(&self) {
        if !self.budget.enabled() || self.shed.is_cancelled() {
            return;
        }
        // Their Tables are the apiserver's whatever the side would hold.
        if !self.custom && CLOCK_PRINTERS.contains(&(self.group.as_str(), self.resource.as_str())) {
            return;
        }
        if self.wanted_at.set(Instant::now()).is_ok() {
            self.wanted_tx.send_replace(true);
        }
    }

    /// Resolves once a Table reader has come.
    pub async fn wanted(&self) {
        let mut rx = self.wanted_tx.subscribe();
        let _ = rx.wait_for(|w| *w).await;
    }

    /// Whether the side started less than `bound` ago and has not synced: reads may wait.
    pub fn coming(&self, bound: Duration) -> bool {
        !self.shed.is_cancelled()
            && self.wanted_at.get().is_some_and(|t| t.elapsed() < bound)
            && !self.ready()
            && self
                .state
                .read()
                .columns
                .as_ref()
                .is_none_or(|c| c.unservable.is_none())
    }

    /// Whether Table reads can be answered: synced, not shed, columns servable and, for a
    /// custom resource, the ones its CRD declares.
    pub fn ready(&self) -> bool {
        let s = self.state.read();
        s.synced
            && !self.shed.is_cancelled()
            && s.columns.as_ref().is_some_and(|c| c.unservable.is_none())
            && self.columns_expected_locked(&s)
    }

    fn columns_expected_locked(&self, s: &State) -> bool {
        match (&*self.expected.lock(), &s.columns) {
            (None, _) => true,
            (Some(e), Some(c)) => *e == c.sig,
            (Some(_), None) => false,
        }
    }

    /// Whether the side's columns are the ones the CRD declares (always, for built-ins).
    pub fn columns_expected(&self) -> bool {
        self.columns_expected_locked(&self.state.read())
    }

    /// The columns the resource's CRD declares now (the registry follows CRDs): when the
    /// side's differ, Tables go to the apiserver and the side's watch starts again, until
    /// the apiserver's Tables carry them.
    pub fn expect_columns(&self, sig: Vec<ColumnSig>) {
        let changed = self.expected.lock().replace(sig.clone()) != Some(sig);
        if changed && !self.columns_expected() {
            // A permit if the side is not waiting right now: its next wait ends at once.
            self.kick.notify_one();
            self.changed.notify_waiters();
        }
    }

    /// Resolves when the declared columns changed away from the side's ([`Self::expect_columns`]).
    pub async fn kicked(&self) {
        self.kick.notified().await;
    }

    /// Why this resource's Tables are the apiserver's now, if they are.
    pub fn not_ready_reason(&self) -> Option<&'static str> {
        if !self.custom && CLOCK_PRINTERS.contains(&(self.group.as_str(), self.resource.as_str())) {
            return Some("table: a printer of relative times");
        }
        if self.shed.is_cancelled() {
            return Some("table side shed for its memory bound");
        }
        let s = self.state.read();
        if let Some(why) = s.columns.as_ref().and_then(|c| c.unservable) {
            return Some(why);
        }
        if !self.columns_expected_locked(&s) {
            return Some("table columns not yet the CRD's");
        }
        (!s.synced).then_some("table side not synced")
    }

    /// The current columns.
    pub fn columns(&self) -> Option<Arc<Columns>> {
        self.state.read().columns.clone()
    }

    /// Whether the row of `key` at `rv` has come but cannot be served (a cell bound to the
    /// clock): waiting for it is pointless.
    pub fn row_unservable(&self, key: &ObjectKey, rv: u64, generation: u64) -> bool {
        let s = self.state.read();
        s.rows.get(key).is_some_and(|v| {
            v.iter()
                .any(|(r, row, _)| *r == rv && row.generation == generation && row.clock_bound)
        })
    }

    /// The row of `key` at `rv` under the current columns, when servable.
    pub fn row(&self, key: &ObjectKey, rv: u64, generation: u64) -> Option<Arc<Row>> {
        let s = self.state.read();
        s.rows
            .get(key)?
            .iter()
            .find(|(r, _, _)| *r == rv)
            .map(|(_, row, _)| row.clone())
            .filter(|r| r.generation == generation && !r.clock_bound)
    }

    /// The row of the last version of `key` before `rv` under the columns of `generation`
    /// (what a deletion at `rv`, or a watch event leaving a selection at `rv`, shows: the
    /// printers print a deleted object's last state), once the side has passed `rv`.
    pub fn row_before(&self, key: &ObjectKey, rv: u64, generation: u64) -> Option<Arc<Row>> {
        if self.progress.load(Relaxed) < rv {
            return None;
        }
        let s = self.state.read();
        s.rows
            .get(key)?
            .iter()
            .rev()
            .find(|(r, _, _)| *r < rv)
            .map(|(_, row, _)| row.clone())
            .filter(|r| r.generation == generation && !r.clock_bound)
    }

    /// The side's stream has passed `rv` (a synced stream's event or bookmark).
    pub fn advance(&self, rv: u64) {
        if self.progress.fetch_max(rv, Relaxed) < rv {
            self.changed.notify_waiters();
        }
    }

    /// Waits, at most `bound`, until `f` holds; re-checked whenever rows attach.
    pub async fn wait_until(&self, bound: Duration, f: impl Fn() -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let n = self.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if f() {
                return true;
            }
            if tokio::time::timeout_at(deadline, n).await.is_err() {
                return f();
            }
        }
    }

    /// The columns of a watch's first event. Different ones drop every row held and ask
    /// the upstream watch to start over (`restart`); `None` when they cannot be read.
    pub fn set_columns(&self, raw: &str) -> Option<()> {
        let mut s = self.state.write();
        if s.columns.as_ref().is_some_and(|c| &*c.raw == raw) {
            return Some(());
        }
        let generation = s.columns.as_ref().map_or(1, |c| c.generation + 1);
        let cols = Columns::parse(raw, self.custom, &self.group, &self.resource, generation)?;
        let had = s.columns.replace(Arc::new(cols)).is_some();
        if had {
            self.stats.column_changes.fetch_add(1, Relaxed);
            s.rows.clear();
            s.synced = false;
            s.bookmark = None;
            let freed = std::mem::take(&mut s.bytes);
            s.count = 0;
            drop(s);
            self.release(freed as u64);
            self.restart.store(true, Relaxed);
            self.changed.notify_waiters();
        }
        Some(())
    }

    /// One object version's row, received at `now_ms`. Age cells are checked against the
    /// clock: one that is not the age the cache prints keeps the row from being served.
    pub fn attach(&self, key: ObjectKey, rv: u64, mut row: Row, now_ms: i64) {
        if self.shed.is_cancelled() {
            return;
        }
        self.stats.rows_in.fetch_add(1, Relaxed);
        let mut s = self.state.write();
        let Some(cols) = s.columns.clone() else {
            return;
        };
        row.generation = cols.generation;
        row.received_ms = now_ms;
        // Pods' restarts, Jobs' durations and CronJobs' last schedules are re-rendered when
        // served (`Row::clock_cell_now`); elsewhere a cell relative to the clock is the
        // apiserver's.
        let pods = !self.custom && self.group.is_empty() && self.resource == "pods";
        let timed = match (self.custom, self.group.as_str(), self.resource.as_str()) {
            (false, "batch", "jobs") => Some((ClockKind::JobDuration, "Duration")),
            (false, "batch", "cronjobs") => Some((ClockKind::CronJobLastSchedule, "Last Schedule")),
            _ => None,
        };
        if pods
            && row.clock_bound
            && row
                .clock_cell
                .as_ref()
                .is_some_and(|r| cols.names.get(r.index).is_some_and(|n| n == "Restarts"))
        {
            row.clock_bound = false;
        } else if let Some((kind, column)) = timed {
            row.clock_cell = cols
                .names
                .iter()
                .position(|n| n == column)
                .and_then(|index| {
                    let printed: String = serde_json::from_str(row.cells.get(index)?).ok()?;
                    Some(ClockCell {
                        index,
                        kind,
                        prefix: "".into(),
                        printed: printed.into(),
                    })
                });
            row.clock_bound |= row.clock_cell.is_none();
        } else {
            row.clock_cell = None;
        }
        // A custom resource's dates of other fields: printed durations move with the clock,
        // `<invalid>` and `<unknown>` do not.
        row.dates = if self.custom {
            cols.dates
                .iter()
                .filter_map(|(i, _)| {
                    let printed: String = serde_json::from_str(row.cells.get(*i)?).ok()?;
                    (!printed.starts_with('<')).then(|| (*i, printed.into()))
                })
                .collect()
        } else {
            Box::default()
        };
        if !row.clock_bound && !ages_agree(&row, &cols, now_ms) {
            self.stats.age_mismatches.fetch_add(1, Relaxed);
            row.clock_bound = true;
        }
        let n = row.bytes() + key.name.len() + key.namespace.len();
        let v = s.rows.entry(key).or_default();
        if v.iter().any(|(r, _, _)| *r == rv) {
            return;
        }
        v.push((rv, Arc::new(row), None));
        v.sort_by_key(|(r, _, _)| *r);
        s.bytes += n;
        s.count += 1;
        drop(s);
        self.charged.fetch_add(n as u64, Relaxed);
        if !self.budget.charge(n as u64) {
            self.shed_rows();
        }
        self.changed.notify_waiters();
    }

    /// A bookmark's row, as the upstream Table watch printed it: the row of the resource's
    /// empty object (no name; a built-in's age `<unknown>`, a custom resource's date `null`),
    /// the same for every bookmark under one set of columns, served as received.
    pub fn set_bookmark_row(&self, mut row: Row) {
        if self.shed.is_cancelled() {
            return;
        }
        let mut s = self.state.write();
        let Some(cols) = s.columns.clone() else {
            return;
        };
        row.generation = cols.generation;
        if s.bookmark.as_ref().is_some_and(|b| {
            b.generation == row.generation && b.cells == row.cells && b.conditions == row.conditions
        }) {
            return;
        }
        s.bookmark = Some(Arc::new(row));
        drop(s);
        self.changed.notify_waiters();
    }

    /// The row a bookmark shows under the columns of `generation`, once a bookmark came.
    pub fn bookmark_row(&self, generation: u64) -> Option<Arc<Row>> {
        let s = self.state.read();
        s.bookmark
            .clone()
            .filter(|b| b.generation == generation && !b.clock_bound)
    }

    /// Whether a cache-served Table watch can write bookmarks now: the side is synced under
    /// servable columns and a bookmark's row came.
    pub fn bookmarks_servable(&self) -> bool {
        let s = self.state.read();
        s.synced
            && s.columns.as_ref().is_some_and(|c| {
                c.unservable.is_none()
                    && s.bookmark
                        .as_ref()
                        .is_some_and(|b| b.generation == c.generation && !b.clock_bound)
            })
    }

    /// The initial state has come whole: reads are served.
    pub fn set_synced(&self, synced: bool) {
        self.state.write().synced = synced;
        self.changed.notify_waiters();
    }

    /// Drops rows of versions the JSON side replaced or deleted more than
    /// [`SUPERSEDED_KEPT`] ago; `current(key)` is the JSON side's current version of a key,
    /// `cache_rv` its resourceVersion. Called periodically while the side runs.
    pub fn reconcile(&self, cache_rv: u64, current: impl Fn(&ObjectKey) -> Option<u64>) {
        let now = Instant::now();
        let mut s = self.state.write();
        let mut freed = 0usize;
        let mut dropped = 0usize;
        s.rows.retain(|k, versions| {
            let cur = current(k);
            versions.retain_mut(|(rv, row, since)| {
                let passed = *rv <= cache_rv && cur != Some(*rv);
                if !passed {
                    *since = None;
                    return true;
                }
                let t = *since.get_or_insert(now);
                if now.duration_since(t) < SUPERSEDED_KEPT {
                    return true;
                }
                freed += row.bytes() + k.name.len() + k.namespace.len();
                dropped += 1;
                false
            });
            !versions.is_empty()
        });
        s.bytes -= freed.min(s.bytes);
        s.count -= dropped.min(s.count);
        drop(s);
        self.release(freed as u64);
    }

    fn release(&self, n: u64) {
        let n = n.min(self.charged.load(Relaxed));
        self.charged.fetch_sub(n, Relaxed);
        self.budget.release(n);
    }

    /// Sheds the rows (the bound was reached): the side stops, Tables go to the apiserver.
    pub fn shed_rows(&self) {
        if self.shed.is_cancelled() {
            return;
        }
        self.shed.cancel();
        tracing::warn!(
            resource = %self.resource,
            used = self.budget.used(),
            max = self.budget.max(),
            "the table side reached cache.tableMaxBytes: this resource's Tables go to the apiserver"
        );
        let mut s = self.state.write();
        s.rows.clear();
        s.synced = false;
        s.bookmark = None;
        s.bytes = 0;
        s.count = 0;
        drop(s);
        self.release(self.charged.load(Relaxed));
        self.changed.notify_waiters();
    }

    /// Rows held and their bytes.
    pub fn size(&self) -> (usize, usize) {
        let s = self.state.read();
        (s.count, s.bytes)
    }

    /// The process-wide bound this store charges.
    pub fn budget(&self) -> &ProtoBudget {
        &self.budget
    }

    /// Whether a Table reader has started the side.
    pub fn started(&self) -> bool {
        self.wanted_at.get().is_some()
    }
}

/// Whether each age cell of `row` is an age the cache would print within two seconds of
/// `now_ms` (the apiserver encoded it a moment before it arrived; HumanDuration's seconds).
fn ages_agree(row: &Row, cols: &Columns, now_ms: i64) -> bool {
    cols.age.iter().all(|&i| {
        let Some(cell) = row.cells.get(i) else {
            return false;
        };
        (-2..=1).any(|ds: i64| {
            let mut b = BytesMut::new();
            put_age_cell(&mut b, row.created, now_ms + ds * 1000);
            b.as_ref() == cell.as_bytes()
        })
    })
}

/// What a Table row carries as its object (`includeObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncludeObject {
    None,
    /// `PartialObjectMetadata` of the Table's group version (the default).
    Metadata,
    Object,
}

impl IncludeObject {
    /// The query value as the apiserver reads it (`TableOptions`); `None` for a value it
    /// refuses (its 400 is its own to write).
    pub fn parse(v: &str) -> Option<IncludeObject> {
        match v {
            "None" => Some(IncludeObject::None),
            "" | "Metadata" => Some(IncludeObject::Metadata),
            "Object" => Some(IncludeObject::Object),
            _ => None,
        }
    }
}

/// A Table read's form: the group version of its Table (and of its rows'
/// `PartialObjectMetadata`), and what its rows carry as their object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableForm {
    pub io: IncludeObject,
    /// meta.k8s.io/v1beta1 rather than v1 (kube-apiserver still serves both).
    pub v1beta1: bool,
}

impl TableForm {
    pub fn api_version(&self) -> &'static str {
        if self.v1beta1 {
            "meta.k8s.io/v1beta1"
        } else {
            "meta.k8s.io/v1"
        }
    }
}

/// A Table's opening up to its rows: `{"kind":"Table","apiVersion":"meta.k8s.io/v1",
/// "metadata":{..},"columnDefinitions":..,"rows":`; `list_meta` is the inside of `metadata`.
pub fn put_head(b: &mut BytesMut, api_version: &str, list_meta: &str, columns: &str) {
    b.put_slice(b"{\"kind\":\"Table\",\"apiVersion\":\"");
    b.put_slice(api_version.as_bytes());
    b.put_slice(b"\",\"metadata\":{");
    b.put_slice(list_meta.as_bytes());
    b.put_slice(b"},\"columnDefinitions\":");
    b.put_slice(columns.as_bytes());
    b.put_slice(b",\"rows\":");
}

#[cfg(test)]
mod tests;
