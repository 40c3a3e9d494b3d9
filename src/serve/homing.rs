//! Moving passed-through watches home: a watch the apiserver serves only because the cache
//! could not serve it when it came (not synced yet, its protobuf side starting, envelopes
//! of its starting point missing, the resource not registered yet, the cache's upstream
//! watch down) is ended cleanly once the cache can serve it from that client's last
//! resourceVersion, so the client watches again from there and lands on the cache.
//!
//! The end is the normal end of a watch stream, as at the apiserver's `timeoutSeconds`
//! (HTTP/1.1: the terminating chunk; HTTP/2: END_STREAM): client-go's reflector then
//! watches again from its last resourceVersion, without relisting. The relay reads the
//! frames it passes on (JSON lines, protobuf length-delimited frames) for their
//! resourceVersion only, and ends the stream only
//! - between two whole frames (the client has nothing half-read),
//! - at a resourceVersion the client holds: the request's own, then each event's and
//!   bookmark's; a watch with initial events (WatchList, or `resourceVersion` unset or
//!   `0`) only after its `k8s.io/initial-events-end` bookmark (before it, an end is a failed
//!   WatchList, and a legacy initial state has no resourceVersion to resume from);
//! - when the cache would serve the resume at once, as the apiserver would: the route a
//!   re-watch takes from this request's path, headers and parameters is the cache's, and
//!   the cache holds that resourceVersion in its history (no 410, no backfill, no relist)
//!   with every protobuf envelope it needs (`read::watch::resumable`);
//! - [`MIN_AGE`] after the stream began at the earliest: client-go treats a watch that ends
//!   within a second without an event as an error ("very short watch") and relists.
//!
//! Watches passed through for any other reason (what the cache does not implement, a
//! resource it does not cache, impersonation, a client's choice) are never moved: their
//! re-watch would go to the apiserver again.

use std::borrow::Cow;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Response, header};
use http_body::Frame;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::Deserialize;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::cache::event::Encoding;
use crate::cache::reflector::proto::{FrameReader, ProtoItem, decode};
use crate::http::body::{self, Body, BoxError};
use crate::k8s::protobuf_write::INITIAL_EVENTS_END;
use crate::k8s::request_info::RequestInfo;
use crate::metrics::PassthroughLabels;
use crate::read::plan::WatchParams;
use crate::read::router::{self, Route};
use crate::serve::state::State;

/// The earliest a moved watch ends after its stream began: client-go's reflector takes a
/// watch that ended within 1 s without an event for an error and lists again
/// (`handleWatch`: "very short watch"); the client's clock started before the relay's.
pub const MIN_AGE: Duration = Duration::from_secs(2);

/// How often a passed-through watch asks whether the cache can serve it now: a cheap check
/// (the route and a look at the cache's history) for the few watches passed through.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The longest JSON line the relay reads for its resourceVersion (the reflector's bound);
/// a longer one stops the reading, and the watch is then never moved.
const MAX_LINE: usize = crate::cache::reflector::proto::MAX_FRAME;

/// Whether a watch passed through for `why` went to the apiserver only because the cache
/// could not serve it yet: the reasons `read::watch::serve`, `read::initialized`, the
/// router and the request pipeline give while a cache, its protobuf side or its resource's
/// registration is starting, or while its upstream watch is down.
pub fn transient(why: &str) -> bool {
    matches!(
        why,
        "cache not synced"
            | "cache not ready"
            | "protobuf side not synced"
            | "protobuf envelopes of the starting point missing"
    ) || why == router::NOT_CACHED
        || why == router::UNCONFIRMED_LATEST_WATCH
        || why == crate::read::NOT_REACHED
        || why == crate::read::NOT_CONFIRMED
}

/// A watch about to be passed through that the cache may take over later (see the module).
pub struct Homing {
    caches: Arc<crate::cache::registry::Caches>,
    info: RequestInfo,
    /// The request's headers the route reads (Accept, User-Agent).
    headers: HeaderMap,
    query: String,
    params: WatchParams,
    reason: &'static str,
    moved: Family<PassthroughLabels, Counter>,
}

impl Homing {
    /// For a watch passed through for `why`: `Some` when the cache may take it over later.
    pub fn new(
        state: &State,
        info: &RequestInfo,
        query: Option<&str>,
        headers: &HeaderMap,
        why: &'static str,
    ) -> Option<Homing> {
        if info.verb != "watch" || !transient(why) {
            return None;
        }
        let params = WatchParams::parse(query)?;
        let mut kept = HeaderMap::new();
        for name in [header::ACCEPT, header::USER_AGENT] {
            for v in headers.get_all(&name) {
                kept.append(name.clone(), v.clone());
            }
        }
        Some(Homing {
            caches: state.caches.clone(),
            info: info.clone(),
            headers: kept,
            query: query.unwrap_or("").to_string(),
            params,
            reason: why,
            moved: state.metrics.watches_moved_home.clone(),
        })
    }

    /// The apiserver's answer, relayed so that it ends once the cache can serve the client
    /// (`labels`: the passthrough's, for the moved-home counter). Other answers than a
    /// JSON or protobuf watch stream are relayed as they are.
    pub fn wrap(self, resp: Response<Body>, labels: PassthroughLabels) -> Response<Body> {
        let ct = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let format = if ct.starts_with("application/vnd.kubernetes.protobuf") {
            Format::Proto(FrameReader::default())
        } else if ct.starts_with("application/json") {
            Format::Json(BytesMut::new())
        } else {
            return resp;
        };
        if !resp.status().is_success() {
            return resp;
        }
        let tracker = Tracker::new(format, &self.params);
        let (parts, inner) = resp.into_parts();
        let mut check = tokio::time::interval_at(Instant::now() + MIN_AGE, CHECK_EVERY);
        check.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let b = HomingBody {
            inner,
            tracker,
            check,
            home: self,
            labels,
            done: false,
        };
        Response::from_parts(parts, body::boxed(b))
    }

    /// Whether the client's re-watch from `from` would be served by the cache now.
    fn ready(&self, from: u64) -> bool {
        let q = resume_query(&self.query, from);
        match router::route(
            &Method::GET,
            &self.info,
            Some(&q),
            &self.headers,
            |g, v, r| self.caches.get(g, v, r),
        ) {
            Ok(Route::Watch {
                cache,
                protobuf,
                enc,
                ..
            }) => crate::read::watch::resumable(&cache, from, protobuf, enc == Encoding::Metadata),
            _ => false,
        }
    }
}

/// The query of a client's re-watch from `from`: the same, resuming from `from` without
/// initial events (client-go's reflector after a watch ends; a WatchList informer's
/// re-watch is such a watch too).
fn resume_query(query: &str, from: u64) -> String {
    let mut parts: Vec<Cow<'_, str>> = query
        .split('&')
        .filter(|kv| {
            let key = kv.split('=').next().unwrap_or("");
            !kv.is_empty()
                && !matches!(
                    key,
                    "resourceVersion" | "resourceVersionMatch" | "sendInitialEvents"
                )
        })
        .map(Cow::Borrowed)
        .collect();
    parts.push(format!("resourceVersion={from}").into());
    parts.join("&")
}

enum Format {
    /// Newline-terminated JSON events; the bytes of a line not yet complete.
    Json(BytesMut),
    Proto(FrameReader),
}

/// What the client holds of a relayed watch stream: the resourceVersion it would resume
/// from, once it has one.
struct Tracker {
    format: Format,
    /// Still in the initial events (before the initial-events-end bookmark).
    initial: bool,
    last_rv: Option<u64>,
    /// Something could not be read (or an ERROR event came): the watch is never moved.
    lost: bool,
}

impl Tracker {
    fn new(format: Format, params: &WatchParams) -> Tracker {
        let rv = params.resource_version.as_deref().unwrap_or("");
        let initial = params.send_initial_events == Some(true)
            || (params.send_initial_events.is_none() && (rv.is_empty() || rv == "0"));
        let last_rv = if initial {
            None
        } else {
            rv.parse::<u64>().ok().filter(|n| *n > 0)
        };
        Tracker {
            format,
            initial,
            last_rv,
            lost: false,
        }
    }

    /// Where the client would resume from if the stream ended now: `None` in the middle of
    /// a frame, in the initial events, or without a resourceVersion.
    fn resumable_from(&self) -> Option<u64> {
        let whole = match &self.format {
            Format::Json(partial) => partial.is_empty(),
            Format::Proto(reader) => reader.pending() == 0,
        };
        (whole && !self.lost && !self.initial)
            .then_some(self.last_rv)
            .flatten()
    }

    /// Reads the frames `chunk` completes.
    fn push(&mut self, chunk: &Bytes) {
        if self.lost {
            return;
        }
        let mut items = Vec::new();
        match &mut self.format {
            Format::Proto(reader) => {
                let mut frames = Vec::new();
                if reader.push(chunk.clone(), &mut frames).is_err() {
                    self.lost = true;
                    return;
                }
                for f in frames {
                    items.push(match decode(&f) {
                        Ok(ProtoItem::Object { rv, .. }) => Item::Event(rv),
                        Ok(ProtoItem::Bookmark {
                            rv,
                            initial_events_end,
                            ..
                        }) => Item::Bookmark(rv, initial_events_end),
                        Ok(ProtoItem::Error(_)) | Err(_) => Item::Unreadable,
                    });
                }
            }
            Format::Json(partial) => {
                let mut rest = &chunk[..];
                while let Some(i) = rest.iter().position(|b| *b == b'\n') {
                    let item = if partial.is_empty() {
                        json_item(&rest[..i])
                    } else {
                        partial.extend_from_slice(&rest[..i]);
                        let line = std::mem::take(partial);
                        json_item(&line)
                    };
                    items.push(item);
                    rest = &rest[i + 1..];
                }
                partial.extend_from_slice(rest);
                if partial.len() > MAX_LINE {
                    self.lost = true;
                    return;
                }
            }
        }
        for item in items {
            self.item(item);
        }
    }

    fn item(&mut self, item: Item) {
        match item {
            Item::Blank => {}
            Item::Event(rv) if !self.initial => self.last_rv = Some(rv),
            Item::Event(_) => {}
            Item::Bookmark(rv, end) if self.initial => {
                if end {
                    self.initial = false;
                    self.last_rv = Some(rv);
                }
            }
            Item::Bookmark(rv, _) => self.last_rv = Some(rv),
            Item::Unreadable => self.lost = true,
        }
    }
}

/// What a frame tells of the client's resourceVersion.
enum Item {
    /// An empty line (none is sent, but a line reader skips them).
    Blank,
    Event(u64),
    /// A bookmark, and whether it ends the initial events.
    Bookmark(u64, bool),
    /// An ERROR event, or a frame that cannot be read.
    Unreadable,
}

#[derive(Deserialize)]
struct JsonEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    object: Option<JsonObject<'a>>,
}

#[derive(Deserialize)]
struct JsonObject<'a> {
    #[serde(default, borrow)]
    metadata: Option<JsonMeta<'a>>,
}

#[derive(Deserialize)]
struct JsonMeta<'a> {
    #[serde(rename = "resourceVersion", default, borrow)]
    resource_version: Option<Cow<'a, str>>,
    #[serde(default)]
    annotations: Option<InitialEventsEnd>,
}

/// Whether an `annotations` map holds `k8s.io/initial-events-end: "true"`, read without
/// keeping the map.
struct InitialEventsEnd(bool);

impl<'de> Deserialize<'de> for InitialEventsEnd {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = InitialEventsEnd;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Self::Value, A::Error> {
                let mut end = false;
                while let Some(k) = m.next_key::<Cow<'de, str>>()? {
                    let v = m.next_value::<Cow<'de, str>>()?;
                    if k == INITIAL_EVENTS_END && v == "true" {
                        end = true;
                    }
                }
                Ok(InitialEventsEnd(end))
            }
        }
        d.deserialize_map(V)
    }
}

fn json_item(line: &[u8]) -> Item {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Item::Blank;
    }
    let Ok(ev) = serde_json::from_slice::<JsonEvent<'_>>(line) else {
        return Item::Unreadable;
    };
    let meta = ev.object.and_then(|o| o.metadata);
    let rv = meta
        .as_ref()
        .and_then(|m| m.resource_version.as_deref())
        .and_then(|rv| rv.parse::<u64>().ok());
    let end = meta
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .is_some_and(|a| a.0);
    match (&*ev.kind, rv) {
        ("ADDED" | "MODIFIED" | "DELETED", Some(rv)) => Item::Event(rv),
        ("BOOKMARK", Some(rv)) => Item::Bookmark(rv, end),
        _ => Item::Unreadable,
    }
}

/// A passed-through watch's body that ends cleanly once the cache can serve its client.
struct HomingBody {
    inner: Body,
    tracker: Tracker,
    check: Interval,
    home: Homing,
    labels: PassthroughLabels,
    done: bool,
}

impl http_body::Body for HomingBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        while this.check.poll_tick(cx).is_ready() {
            if let Some(from) = this.tracker.resumable_from()
                && this.home.ready(from)
            {
                this.done = true;
                this.home.moved.get_or_create(&this.labels).inc();
                tracing::debug!(
                    resource = %this.labels.resource,
                    reason = this.home.reason,
                    from,
                    "passed-through watch ended: the cache serves its client from here"
                );
                // The upstream watch ends now (its hooks run: the open-passthrough gauge).
                this.inner = body::empty();
                return Poll::Ready(None);
            }
        }
        let r = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if let Some(Ok(f)) = &r
            && let Some(d) = f.data_ref()
        {
            this.tracker.push(d);
        }
        Poll::Ready(r)
    }

    fn is_end_stream(&self) -> bool {
        self.done || http_body::Body::is_end_stream(&self.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(q: &str, proto: bool) -> Tracker {
        let format = if proto {
            Format::Proto(FrameReader::default())
        } else {
            Format::Json(BytesMut::new())
        };
        Tracker::new(format, &WatchParams::parse(Some(q)).unwrap())
    }

    fn ev(kind: &str, rv: u64) -> String {
        format!(
            "{{\"type\":\"{kind}\",\"object\":{{\"kind\":\"Event\",\"apiVersion\":\"v1\",\"involvedObject\":{{\"resourceVersion\":\"1\"}},\"metadata\":{{\"name\":\"a\",\"resourceVersion\":\"{rv}\"}}}}}}\n"
        )
    }

    #[test]
    fn a_resume_is_movable_from_its_own_resource_version_then_from_each_event() {
        let mut t = tracker("watch=1&resourceVersion=5&allowWatchBookmarks=true", false);
        assert_eq!(t.resumable_from(), Some(5));
        t.push(&Bytes::from(ev("MODIFIED", 7)));
        assert_eq!(
            t.resumable_from(),
            Some(7),
            "the object's own, not a nested one"
        );
        // Half a line: not between frames.
        let line = ev("ADDED", 9);
        let (a, b) = line.split_at(20);
        t.push(&Bytes::copy_from_slice(a.as_bytes()));
        assert_eq!(t.resumable_from(), None, "in the middle of a frame");
        t.push(&Bytes::copy_from_slice(b.as_bytes()));
        assert_eq!(t.resumable_from(), Some(9));
        t.push(&Bytes::from_static(
            b"{\"type\":\"BOOKMARK\",\"object\":{\"kind\":\"ConfigMap\",\"metadata\":{\"resourceVersion\":\"12\"}}}\n",
        ));
        assert_eq!(t.resumable_from(), Some(12), "a bookmark moves it too");
        t.push(&Bytes::from_static(
            b"{\"type\":\"ERROR\",\"object\":{\"kind\":\"Status\",\"code\":410}}\n",
        ));
        assert_eq!(t.resumable_from(), None, "never after an ERROR");
    }

    #[test]
    fn a_watch_with_initial_events_is_movable_only_after_their_end_bookmark() {
        for q in [
            "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true",
            "watch=1&allowWatchBookmarks=true",
            "watch=1&resourceVersion=0&allowWatchBookmarks=true",
        ] {
            let mut t = tracker(q, false);
            assert_eq!(t.resumable_from(), None, "{q}");
            t.push(&Bytes::from(ev("ADDED", 3)));
            assert_eq!(t.resumable_from(), None, "{q}: an initial event");
            t.push(&Bytes::from_static(
                b"{\"type\":\"BOOKMARK\",\"object\":{\"metadata\":{\"resourceVersion\":\"8\"}}}\n",
            ));
            assert_eq!(
                t.resumable_from(),
                None,
                "{q}: a bookmark in the initial events"
            );
            t.push(&Bytes::from_static(
                b"{\"type\":\"BOOKMARK\",\"object\":{\"metadata\":{\"resourceVersion\":\"9\",\"annotations\":{\"a\":\"b\",\"k8s.io/initial-events-end\":\"true\"}}}}\n",
            ));
            assert_eq!(t.resumable_from(), Some(9), "{q}");
            t.push(&Bytes::from(ev("DELETED", 10)));
            assert_eq!(t.resumable_from(), Some(10), "{q}");
        }
    }

    #[test]
    fn protobuf_frames_are_read_for_their_resource_version_across_chunks() {
        use crate::k8s::protobuf_write::tests::real;
        use crate::k8s::protobuf_write::{bookmark_object, watch_frame, with_resource_version};
        let unhex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let get = unhex(real::GET_C2);
        let q = "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true";
        let mut t = tracker(q, true);
        let mut stream = Vec::new();
        watch_frame(&mut stream, "ADDED", &get).unwrap();
        let bm = bookmark_object("v1", "ConfigMap", &[], "209", true);
        watch_frame(&mut stream, "BOOKMARK", &bm).unwrap();
        let v210 = with_resource_version(&get, "210").unwrap();
        watch_frame(&mut stream, "MODIFIED", &v210).unwrap();
        let stream = Bytes::from(stream);
        // Byte by byte: a frame completes only at its last byte.
        let mut seen = Vec::new();
        for i in 0..stream.len() {
            t.push(&stream.slice(i..i + 1));
            seen.push(t.resumable_from());
        }
        assert_eq!(seen.last(), Some(&Some(210)));
        assert!(
            seen.contains(&Some(209)),
            "after the initial-events-end bookmark"
        );
        assert_eq!(
            seen.iter().filter(|s| s.is_some()).count(),
            2,
            "only at the two frame ends after the initial events: {seen:?}"
        );
    }

    #[test]
    fn the_resume_query_keeps_the_selectors_and_drops_the_start() {
        assert_eq!(
            resume_query(
                "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&labelSelector=a%3Db&allowWatchBookmarks=true&resourceVersion=",
                42
            ),
            "watch=1&labelSelector=a%3Db&allowWatchBookmarks=true&resourceVersion=42"
        );
        let q = resume_query("watch=1&resourceVersion=7", 9);
        let p = WatchParams::parse(Some(&q)).unwrap();
        assert_eq!(p.resource_version.as_deref(), Some("9"));
        assert!(p.resumes());
    }

    #[test]
    fn only_reasons_of_a_cache_not_ready_yet_are_moved() {
        for why in [
            "cache not synced",
            "protobuf side not synced",
            "protobuf envelopes of the starting point missing",
            "cache not ready",
            router::NOT_CACHED,
            router::UNCONFIRMED_LATEST_WATCH,
            crate::read::NOT_REACHED,
        ] {
            assert!(transient(why), "{why}");
        }
        for why in [
            "impersonation",
            "selector",
            "watch parameters",
            "field-level change filter in protobuf",
            router::PROTOBUF,
        ] {
            assert!(!transient(why), "{why}");
        }
    }
}
