//! Table responses (`as=Table;v=v1;g=meta.k8s.io`, what `kubectl get` asks for) written from
//! the cache: the objects a GET or a LIST page selects, exactly as for JSON, each shown by
//! the row the apiserver's printers computed for that object version (`cache::table`),
//! its age cells at the moment of answering, and its object as `includeObject` asks.
//!
//! kube-apiserver's Table (k8s.io/apiserver `handlers.asTable` over a `TableConvertor`):
//! `metadata` is the list's (`resourceVersion`, `continue`, `remainingItemCount`) or, for one
//! object, its resourceVersion; `columnDefinitions` the resource's, every column (priority
//! ones too: `-o wide` is kubectl's filter); `rows` one per object (`[]` when empty, `null`
//! for the default convertor of resources without printers); a row's `object` is `null`
//! (`None`), `PartialObjectMetadata` of meta.k8s.io/v1 (`Metadata`, the default) or the
//! object (`Object`). A version whose row has not come is not invented: the read waits for
//! it, bounded, and then is the apiserver's.

use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};

use crate::cache::event::{Encoding, put_object};
use crate::cache::table::{Columns, IncludeObject, Row, TableForm, now_ms, put_head};
use crate::cache::{CachedObject, ResourceCache};
use crate::read::{Served, delegate};

/// Why a Table read goes to the apiserver: a row of a version it shows has not come.
pub const NO_ROW: &str = "table row of an object version not cached";

/// The columns and the rows of `items`, waiting at most `bound` for rows not there yet;
/// `None` when the columns are not servable or a row did not come.
pub async fn rows_of(
    cache: &ResourceCache,
    items: &[&Arc<CachedObject>],
    bound: Duration,
) -> Option<(Arc<Columns>, Vec<Arc<Row>>)> {
    let t = &cache.table;
    let collect = || -> Option<(Arc<Columns>, Vec<Arc<Row>>)> {
        let cols = t.columns().filter(|c| c.unservable.is_none())?;
        let rows = items
            .iter()
            .map(|o| t.row(&o.key(), o.meta.resource_version, cols.generation))
            .collect::<Option<Vec<_>>>()?;
        Some((cols, rows))
    };
    if let Some(r) = collect() {
        return Some(r);
    }
    // A row that came but cannot be served does not come in another form: no wait.
    let unservable = t.columns().is_some_and(|cols| {
        items
            .iter()
            .any(|o| t.row_unservable(&o.key(), o.meta.resource_version, cols.generation))
    });
    if unservable || !t.wait_until(bound, || collect().is_some()).await {
        return None;
    }
    collect()
}

/// A row's object as `includeObject` asks, `object` being the object's JSON with or without
/// its type meta (`PartialObjectMetadata` is of the Table's group version).
fn put_row_object(
    b: &mut BytesMut,
    object: &[u8],
    form: TableForm,
    whole: impl FnOnce(&mut BytesMut),
) {
    match form.io {
        IncludeObject::None => b.put_slice(b"null"),
        IncludeObject::Metadata => {
            b.put_slice(b"{\"kind\":\"PartialObjectMetadata\",\"apiVersion\":\"");
            b.put_slice(form.api_version().as_bytes());
            b.put_slice(b"\",\"metadata\":");
            b.put_slice(crate::cache::event::metadata_of(object).as_bytes());
            b.put_u8(b'}');
        }
        IncludeObject::Object => whole(b),
    }
}

/// A Table body: `list_meta` is the inside of its `metadata`; `None` when a row's cell bound
/// to the clock cannot be re-rendered exactly (the apiserver answers).
pub fn body(
    cache: &ResourceCache,
    cols: &Columns,
    list_meta: &str,
    items: &[&Arc<CachedObject>],
    rows: &[Arc<Row>],
    form: TableForm,
) -> Option<Bytes> {
    let now = now_ms();
    let per_row = if form.io == IncludeObject::Object {
        1024
    } else {
        256
    };
    let mut b = BytesMut::with_capacity(cols.raw.len() + 128 + items.len() * per_row);
    put_head(&mut b, form.api_version(), list_meta, &cols.raw);
    if items.is_empty() && cols.null_when_empty {
        b.put_slice(b"null}");
        return Some(b.freeze());
    }
    b.put_u8(b'[');
    for (i, (o, row)) in items.iter().zip(rows).enumerate() {
        if i > 0 {
            b.put_u8(b',');
        }
        let replaced = row.cells_now(cols, &o.body, now).ok()?;
        row.put(&mut b, cols, now, &replaced, |b| {
            put_row_object(b, &o.body, form, |b| {
                put_object(b, &cache.resource, &o.body, Encoding::Json)
            })
        });
    }
    b.put_slice(b"]}");
    Some(b.freeze())
}

/// One object's Table (a GET), or the apiserver's when its row does not come within `bound`.
pub async fn get(
    cache: &ResourceCache,
    o: &Arc<CachedObject>,
    form: TableForm,
    bound: Duration,
) -> Served<Bytes> {
    let Some((cols, rows)) = rows_of(cache, &[o], bound).await else {
        return delegate(NO_ROW);
    };
    let meta = format!("\"resourceVersion\":\"{}\"", o.meta.resource_version);
    match body(cache, &cols, &meta, &[o], &rows, form) {
        Some(b) => Ok(b),
        None => delegate(NO_ROW),
    }
}

/// How long a Table watch waits for an event's row (the protobuf watchers' bound for their
/// envelopes): then the stream ends cleanly and the client watches again from its last
/// resourceVersion.
pub const WATCH_ROW_WAIT: Duration = Duration::from_secs(10);

#[derive(serde::Deserialize)]
struct EventLine<'a> {
    #[serde(borrow, rename = "type")]
    ty: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    object: &'a serde_json::value::RawValue,
}

#[derive(serde::Deserialize)]
struct EventObject<'a> {
    #[serde(borrow)]
    metadata: EventMeta<'a>,
}

#[derive(serde::Deserialize)]
struct EventMeta<'a> {
    #[serde(borrow, default)]
    name: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    namespace: std::borrow::Cow<'a, str>,
    #[serde(borrow, default, rename = "resourceVersion")]
    resource_version: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    annotations:
        Option<std::collections::HashMap<std::borrow::Cow<'a, str>, std::borrow::Cow<'a, str>>>,
}

impl EventMeta<'_> {
    /// A WatchList's last bookmark (`k8s.io/initial-events-end: "true"`).
    fn initial_events_end(&self) -> bool {
        self.annotations
            .as_ref()
            .and_then(|a| a.get("k8s.io/initial-events-end"))
            .is_some_and(|v| v == "true")
    }
}

/// What a Table watch has written so far.
pub struct TableWatch {
    cache: Arc<ResourceCache>,
    form: TableForm,
    /// kube-apiserver's watch encoder writes `columnDefinitions` on the first event only
    /// (`NoHeaders` after it, whatever that event was).
    first: bool,
}

impl TableWatch {
    pub fn new(cache: Arc<ResourceCache>, form: TableForm) -> TableWatch {
        TableWatch {
            cache,
            form,
            first: true,
        }
    }

    /// Counts the watch as a Table the cache writes.
    pub fn count_served(&self) {
        self.cache
            .table
            .stats
            .served
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// One JSON watch event line (without its newline) as the apiserver writes it for a
    /// Table watch: ADDED and MODIFIED show their version's row, DELETED the last version
    /// before it (a deleted object, or a state leaving the selection, printed as it was);
    /// ERROR events are not transformed (a `Status`). `None` when the row did not come
    /// within [`WATCH_ROW_WAIT`] or the line cannot be read: the stream ends there.
    pub async fn event(&mut self, line: &[u8]) -> Option<Bytes> {
        let l: EventLine<'_> = serde_json::from_slice(line).ok()?;
        if l.ty == "ERROR" {
            self.first = false;
            let mut b = BytesMut::with_capacity(line.len() + 1);
            b.put_slice(line);
            b.put_u8(b'\n');
            return Some(b.freeze());
        }
        let m: EventObject<'_> = serde_json::from_str(l.object.get()).ok()?;
        let rv: u64 = m.metadata.resource_version.parse().ok()?;
        let key = crate::cache::ObjectKey::new(&m.metadata.namespace, &m.metadata.name);
        let t = &self.cache.table;
        let deleted = match &*l.ty {
            "ADDED" | "MODIFIED" => false,
            "DELETED" => true,
            // The apiserver prints a bookmark's object (empty but for its resourceVersion
            // and annotations) like any other: the row the table side's own bookmarks
            // showed, its object as `includeObject` asks.
            // `includeObject=None` keeps the initial-events-end bookmark's metadata (its
            // annotation is what the client waits for: `handlers.asTable`).
            "BOOKMARK" => {
                let cols = t.columns().filter(|c| c.unservable.is_none())?;
                let row = t.bookmark_row(cols.generation)?;
                let object = l.object.get().as_bytes();
                let form = self.form;
                if form.io == IncludeObject::None && m.metadata.initial_events_end() {
                    self.form.io = IncludeObject::Metadata;
                }
                let b = self.write(&l.ty, rv, object, &cols, &row, None);
                self.form = form;
                return Some(b);
            }
            _ => return None,
        };
        let find = || {
            let cols = t.columns().filter(|c| c.unservable.is_none())?;
            let row = if deleted {
                t.row_before(&key, rv, cols.generation)
            } else {
                t.row(&key, rv, cols.generation)
            }?;
            Some((cols, row))
        };
        let (cols, row) = match find() {
            Some(r) => r,
            // Come, but not servable (a cell bound to the clock): no wait.
            None if !deleted
                && t.columns()
                    .is_some_and(|c| t.row_unservable(&key, rv, c.generation)) =>
            {
                return None;
            }
            None => {
                t.wait_until(WATCH_ROW_WAIT, || find().is_some()).await;
                find()?
            }
        };
        let object = l.object.get().as_bytes();
        let now = now_ms();
        let replaced = row.cells_now(&cols, object, now).ok()?;
        Some(self.write(&l.ty, rv, object, &cols, &row, Some((now, &replaced))))
    }

    /// One event line: a Table of one row, `columnDefinitions` on the watch's first event;
    /// `clock` is the moment its ages print at and its other cells re-rendered then
    /// (`None`: a bookmark's row, its cells as received).
    fn write(
        &mut self,
        ty: &str,
        rv: u64,
        object: &[u8],
        cols: &Columns,
        row: &Row,
        clock: Option<(i64, &[(usize, String)])>,
    ) -> Bytes {
        let columns = if std::mem::take(&mut self.first) {
            &*cols.raw
        } else {
            "null"
        };
        let mut b = BytesMut::with_capacity(256 + object.len() + columns.len());
        b.put_slice(b"{\"type\":\"");
        b.put_slice(ty.as_bytes());
        b.put_slice(b"\",\"object\":");
        put_head(
            &mut b,
            self.form.api_version(),
            &format!("\"resourceVersion\":\"{rv}\""),
            columns,
        );
        b.put_u8(b'[');
        let form = self.form;
        let object = |b: &mut BytesMut| put_row_object(b, object, form, |b| b.put_slice(object));
        match clock {
            Some((now, replaced)) => row.put(&mut b, cols, now, replaced, object),
            None => row.put_as_received(&mut b, object),
        }
        b.put_slice(b"]}}\n");
        b.freeze()
    }
}

/// A JSON watch's body as a Table watch: each event line rewritten by [`TableWatch::event`];
/// the stream ends (cleanly) at the first event whose row does not come.
pub fn watch_body(inner: crate::http::body::Body, w: TableWatch) -> crate::http::body::Body {
    use http_body_util::BodyExt as _;
    let stream = futures_util::stream::unfold(
        (Some(inner), w, BytesMut::new()),
        |(inner, mut w, mut carry)| async move {
            let mut inner = inner?;
            loop {
                let frame = match inner.frame().await {
                    None => return None,
                    Some(Err(e)) => return Some((Err(e), (None, w, carry))),
                    Some(Ok(f)) => f,
                };
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                carry.extend_from_slice(&data);
                let mut out = BytesMut::new();
                while let Some(i) = carry.iter().position(|b| *b == b'\n') {
                    let line = carry.split_to(i + 1);
                    let line = &line[..i];
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    match w.event(line).await {
                        Some(ev) => out.extend_from_slice(&ev),
                        None => {
                            // What was rewritten before the missing row still goes out.
                            if out.is_empty() {
                                return None;
                            }
                            let f = http_body::Frame::data(out.freeze());
                            return Some((Ok(f), (None, w, carry)));
                        }
                    }
                }
                if !out.is_empty() {
                    let f = http_body::Frame::data(out.freeze());
                    return Some((Ok(f), (Some(inner), w, carry)));
                }
            }
        },
    );
    crate::http::body::boxed(http_body_util::StreamBody::new(stream))
}

/// The inside of a list's `metadata`, as the JSON list writes it.
pub fn list_meta(list_rv: u64, meta: Option<&(String, Option<u64>)>) -> String {
    let mut m = format!("\"resourceVersion\":\"{list_rv}\"");
    if let Some((token, remaining)) = meta {
        m.push_str(",\"continue\":\"");
        m.push_str(token);
        m.push('"');
        if let Some(n) = remaining {
            m.push_str(&format!(",\"remainingItemCount\":{n}"));
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::proto_budget::ProtoBudget;
    use crate::cache::table::{CREATION_DOC, TableStore, parse_table_event, parse_time};
    use crate::cache::{ReflectorSink, Resource, StoreConfig};

    const NONE: TableForm = TableForm {
        io: IncludeObject::None,
        v1beta1: false,
    };

    fn cm(name: &str, rv: u64) -> CachedObject {
        let raw = Bytes::from(format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"ns","uid":"u-{name}","resourceVersion":"{rv}","creationTimestamp":"2026-12-07T11:00:00Z"}},"data":{{"a":"b"}}}}"#
        ));
        CachedObject::parse(raw, &Resource::core("configmaps", "ConfigMap", true)).unwrap()
    }

    fn columns() -> String {
        let q = serde_json::to_string(CREATION_DOC).unwrap();
        format!(
            r#"[{{"name":"Name","type":"string","format":"name","description":"n","priority":0}},{{"name":"Data","type":"string","format":"","description":"d","priority":0}},{{"name":"Age","type":"string","format":"","description":{q},"priority":0}}]"#
        )
    }

    fn row_event(name: &str, rv: u64, age: &str) -> String {
        format!(
            r#"{{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{{"resourceVersion":"{rv}"}},"columnDefinitions":null,"rows":[{{"cells":["{name}",1,"{age}"],"object":{{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{{"name":"{name}","namespace":"ns","resourceVersion":"{rv}","creationTimestamp":"2026-12-07T11:00:00Z"}}}}}}]}}"#
        )
    }

    fn cache() -> Arc<ResourceCache> {
        let cfg = StoreConfig {
            table_budget: Arc::new(ProtoBudget::new(u64::MAX)),
            ..StoreConfig::default()
        };
        ResourceCache::new(Resource::core("configmaps", "ConfigMap", true), cfg)
    }

    fn attach(c: &ResourceCache, name: &str, rv: u64) {
        // The age the clock says now, as the apiserver would have printed it on arrival.
        let created = parse_time("2026-12-07T11:00:00Z").unwrap();
        let age = crate::cache::table::human_duration(now_ms() - created * 1000);
        let ev = parse_table_event(&row_event(name, rv, &age)).unwrap();
        for r in ev.rows {
            c.table.attach(r.key, r.rv, r.row, now_ms());
        }
    }

    #[tokio::test]
    async fn a_table_of_cached_objects_carries_their_rows_and_objects_as_asked() {
        let c = cache();
        c.replace(vec![cm("a", 5), cm("b", 6)], 6);
        c.table.set_columns(&columns()).unwrap();
        attach(&c, "a", 5);
        attach(&c, "b", 6);
        let snap = c.current();
        let items: Vec<_> = snap.objects.values().collect();
        let (cols, rows) = rows_of(&c, &items, Duration::ZERO).await.unwrap();
        let beta = TableForm {
            io: IncludeObject::Metadata,
            v1beta1: true,
        };
        let v: serde_json::Value =
            serde_json::from_slice(&body(&c, &cols, "", &items, &rows, beta).unwrap()).unwrap();
        assert_eq!(v["apiVersion"], "meta.k8s.io/v1beta1");
        assert_eq!(v["rows"][0]["object"]["apiVersion"], "meta.k8s.io/v1beta1");
        for io in [
            IncludeObject::None,
            IncludeObject::Metadata,
            IncludeObject::Object,
        ] {
            let meta = list_meta(6, Some(&("tok".into(), Some(3))));
            let form = TableForm { io, v1beta1: false };
            let b = body(&c, &cols, &meta, &items, &rows, form).unwrap();
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(v["kind"], "Table");
            assert_eq!(v["apiVersion"], "meta.k8s.io/v1");
            assert_eq!(
                v["metadata"],
                serde_json::json!({"resourceVersion":"6","continue":"tok","remainingItemCount":3})
            );
            assert_eq!(v["columnDefinitions"].as_array().unwrap().len(), 3);
            let r = v["rows"].as_array().unwrap();
            assert_eq!(r.len(), 2);
            assert_eq!(r[0]["cells"][0], "a");
            assert_eq!(r[1]["cells"][1], 1);
            let obj = &r[1]["object"];
            match io {
                IncludeObject::None => assert!(obj.is_null()),
                IncludeObject::Metadata => {
                    assert_eq!(obj["kind"], "PartialObjectMetadata");
                    assert_eq!(obj["apiVersion"], "meta.k8s.io/v1");
                    assert_eq!(obj["metadata"]["resourceVersion"], "6");
                    assert!(obj.get("data").is_none());
                }
                IncludeObject::Object => {
                    assert_eq!(obj["kind"], "ConfigMap");
                    assert_eq!(obj["apiVersion"], "v1");
                    assert_eq!(obj["data"]["a"], "b");
                }
            }
        }
    }

    #[tokio::test]
    async fn a_version_without_its_row_is_not_invented() {
        let c = cache();
        c.replace(vec![cm("a", 5)], 5);
        c.table.set_columns(&columns()).unwrap();
        attach(&c, "a", 4);
        let snap = c.current();
        let o = snap.objects.values().next().unwrap().clone();
        assert!(matches!(
            get(&c, &o, NONE, Duration::ZERO).await,
            Err(crate::read::NotServed::Delegate(NO_ROW))
        ));
        attach(&c, "a", 5);
        let b = get(&c, &o, NONE, Duration::ZERO).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["metadata"], serde_json::json!({"resourceVersion":"5"}));
        assert_eq!(v["rows"][0]["cells"][0], "a");
    }

    #[tokio::test]
    async fn a_table_watch_shows_each_event_by_its_versions_row_and_the_columns_once() {
        let c = cache();
        c.replace(vec![cm("a", 5)], 5);
        c.table.set_columns(&columns()).unwrap();
        attach(&c, "a", 5);
        attach(&c, "a", 7);
        let mut w = TableWatch::new(
            c.clone(),
            TableForm {
                io: IncludeObject::Metadata,
                v1beta1: false,
            },
        );
        let line = |ty: &str, rv: u64| {
            format!(
                r#"{{"type":"{ty}","object":{{"kind":"ConfigMap","apiVersion":"v1","metadata":{{"name":"a","namespace":"ns","resourceVersion":"{rv}","creationTimestamp":"2026-12-07T11:00:00Z"}},"data":{{"a":"b"}}}}}}"#
            )
        };
        let parse = |b: Bytes| -> serde_json::Value {
            assert!(b.ends_with(b"\n"));
            serde_json::from_slice(&b).unwrap()
        };
        let ev = parse(w.event(line("MODIFIED", 7).as_bytes()).await.unwrap());
        assert_eq!(ev["type"], "MODIFIED");
        let t = &ev["object"];
        assert_eq!(t["kind"], "Table");
        assert_eq!(t["metadata"], serde_json::json!({"resourceVersion": "7"}));
        assert_eq!(t["columnDefinitions"].as_array().unwrap().len(), 3);
        assert_eq!(t["rows"].as_array().unwrap().len(), 1);
        assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
        assert_eq!(t["rows"][0]["object"]["metadata"]["resourceVersion"], "7");
        // An ERROR event is not a Table; headers are written once.
        let err = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","code":410}}"#;
        let e = parse(w.event(err.as_bytes()).await.unwrap());
        assert_eq!(e["object"]["kind"], "Status");
        // A deletion at 9 shows the last version before it, once the side passed 9.
        c.table.advance(9);
        let ev = parse(w.event(line("DELETED", 9).as_bytes()).await.unwrap());
        assert!(ev["object"]["columnDefinitions"].is_null());
        assert_eq!(ev["object"]["metadata"]["resourceVersion"], "9");
        assert_eq!(ev["object"]["rows"][0]["cells"][0], "a");
        // Unreadable lines end the stream.
        assert!(w.event(b"{}").await.is_none());
        assert!(
            w.event(br#"{"type":"BOOKMARK","object":{}}"#)
                .await
                .is_none()
        );
    }

    #[tokio::test]
    async fn a_table_watch_writes_bookmarks_with_the_row_the_sides_bookmarks_showed() {
        let c = cache();
        c.table.set_columns(&columns()).unwrap();
        let bookmark = |annotations: &str| {
            format!(
                r#"{{"type":"BOOKMARK","object":{{"kind":"ConfigMap","apiVersion":"v1","metadata":{{"resourceVersion":"12"{annotations}}}}}}}"#
            )
        };
        let end = r#","annotations":{"k8s.io/initial-events-end":"true"}"#;
        let mut w = TableWatch::new(c.clone(), NONE);
        // No bookmark came upstream yet: no row to show, the stream ends (and the router
        // sends such watches to the apiserver meanwhile).
        assert!(!c.table.bookmarks_servable());
        assert!(w.event(bookmark("").as_bytes()).await.is_none());
        // The side's bookmark: the empty object's row, an age of `<unknown>`.
        let upstream = r#"{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{"resourceVersion":"11"},"columnDefinitions":null,"rows":[{"cells":["",0,"\u003cunknown\u003e"],"object":{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{"resourceVersion":"11","annotations":{"k8s.io/initial-events-end":"true"}}}}]}"#;
        let ev = parse_table_event(upstream).unwrap();
        for r in ev.rows {
            assert!(r.initial_events_end);
            c.table.set_bookmark_row(r.row);
        }
        assert!(!c.table.bookmarks_servable(), "not before the side synced");
        c.table.set_synced(true);
        assert!(c.table.bookmarks_servable());
        let parse = |b: Bytes| -> serde_json::Value { serde_json::from_slice(&b).unwrap() };
        let e = parse(w.event(bookmark("").as_bytes()).await.unwrap());
        assert_eq!(e["type"], "BOOKMARK");
        assert_eq!(
            e["object"]["metadata"],
            serde_json::json!({"resourceVersion": "12"})
        );
        assert_eq!(
            e["object"]["columnDefinitions"].as_array().unwrap().len(),
            3
        );
        let row = &e["object"]["rows"][0];
        assert_eq!(row["cells"], serde_json::json!(["", 0, "<unknown>"]));
        assert!(row["object"].is_null(), "includeObject=None: {row}");
        // `None` keeps the initial-events-end bookmark's metadata, as kube-apiserver does.
        let e = parse(w.event(bookmark(end).as_bytes()).await.unwrap());
        assert!(e["object"]["columnDefinitions"].is_null());
        let o = &e["object"]["rows"][0]["object"];
        assert_eq!(o["kind"], "PartialObjectMetadata");
        assert_eq!(o["metadata"]["resourceVersion"], "12");
        assert_eq!(
            o["metadata"]["annotations"]["k8s.io/initial-events-end"],
            "true"
        );
        // And the form is back to `None` for the next bookmark.
        let e = parse(w.event(bookmark("").as_bytes()).await.unwrap());
        assert!(e["object"]["rows"][0]["object"].is_null());
        // `Object`: the bookmark's object itself.
        let mut w = TableWatch::new(
            c.clone(),
            TableForm {
                io: IncludeObject::Object,
                v1beta1: false,
            },
        );
        let e = parse(w.event(bookmark(end).as_bytes()).await.unwrap());
        assert_eq!(e["object"]["rows"][0]["object"]["kind"], "ConfigMap");
        // Other columns: the row is dropped with the rest until a bookmark shows it again.
        c.table
            .set_columns(&columns().replace("\"Data\"", "\"Keys\""))
            .unwrap();
        assert!(!c.table.bookmarks_servable());
    }

    #[tokio::test(start_paused = true)]
    async fn a_table_watch_ends_when_a_row_does_not_come() {
        let c = cache();
        c.table.set_columns(&columns()).unwrap();
        let mut w = TableWatch::new(c.clone(), NONE);
        let line = r#"{"type":"ADDED","object":{"metadata":{"name":"a","namespace":"ns","resourceVersion":"5"}}}"#;
        assert!(w.event(line.as_bytes()).await.is_none());
        // Nor is a deletion shown before the side has passed it.
        attach(&c, "a", 5);
        let del = r#"{"type":"DELETED","object":{"metadata":{"name":"a","namespace":"ns","resourceVersion":"6"}}}"#;
        assert!(w.event(del.as_bytes()).await.is_none());
    }

    #[tokio::test]
    async fn empty_tables_have_the_rows_their_convertor_writes() {
        let c = cache();
        c.replace(vec![], 5);
        c.table.set_columns(&columns()).unwrap();
        let (cols, rows) = rows_of(&c, &[], Duration::ZERO).await.unwrap();
        let b = body(&c, &cols, &list_meta(5, None), &[], &rows, NONE).unwrap();
        assert!(b.ends_with(b",\"rows\":[]}"), "{b:?}");
        let st = TableStore::new(false, "", "things", Arc::new(ProtoBudget::new(u64::MAX)));
        st.set_columns(r#"[{"name":"Name","type":"string","format":"name","description":"x","priority":0},{"name":"Created At","type":"date","format":"","description":"y","priority":0}]"#).unwrap();
        let cols = st.columns().unwrap();
        let b = body(&c, &cols, &list_meta(5, None), &[], &[], NONE).unwrap();
        assert!(b.ends_with(b",\"rows\":null}"), "{b:?}");
    }
}
