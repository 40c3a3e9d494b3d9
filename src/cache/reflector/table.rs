//! The table side's upstream watch: one resource's WATCH in Table form
//! (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`, `includeObject=Metadata`), whose
//! rows — computed by the apiserver's printers, one per object version — are handed to the
//! resource's [`TableStore`] by object key and resourceVersion. The JSON reflector stays
//! authoritative: this side only supplies rows, and a Table read is served only when every
//! object version it shows has its row.
//!
//! ```text
//! state        outcome                                                      next
//! (start)      restored from a warm restart's saved state                   Resume{saved}
//! (start)      otherwise                                                    Initial
//! Initial      (sendInitialEvents=true) initial-events-end bookmark came,   Resume{last rv}
//!              then the stream ended or stalled
//! Initial      ended before that bookmark                                   Backoff -> Initial
//! Resume{rv}   ended cleanly or stalled                                     Resume{last rv}
//! any watch    the first event's columnDefinitions changed                  Initial (rows dropped)
//! any watch    410 (HTTP status or ERROR event)                             Initial
//! any watch    anything else (refused, broken, ERROR)                       Backoff -> same
//! any          shutdown or the memory bound shed the side                   Stopped
//! ```
//!
//! kube-apiserver writes `columnDefinitions` on a watch's first event only (its watch encoder
//! sets `NoHeaders` after it, k8s.io/apiserver `watchEmbeddedEncoder`), bookmarks included,
//! so every watch tells the columns before its first row. A deletion's row is not kept (a
//! Table watch shows a deleted object by its last version's row); it moves the side's
//! progress (`TableStore::advance`), which tells a Table watch that last row is final.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::BodyExt as _;
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, info, warn};

use super::backoff::{Backoff, jitter, random_unit};
use super::config::ReflectorConfig;
use super::error::{ReflectorError, error_response};
use super::watch::LineSplitter;
use crate::cache::Resource;
use crate::cache::table::{TableStore, now_ms, parse_table_event};
use crate::http::body;
use crate::upstream::{As, Upstream};

/// What the side asks for: the Table of meta.k8s.io/v1 in JSON.
pub const TABLE_ACCEPT: &str = "application/json;as=Table;v=v1;g=meta.k8s.io";

/// The table side's state; the task runs one and gets the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableState {
    /// A watch with initial events: every current object's row, the initial-events-end
    /// bookmark, then changes. Entered at start, after 410, after changed columns, and after
    /// an initial watch that ended before its bookmark.
    Initial,
    /// A watch from `rv`. Entered after a synced watch ended.
    Resume { rv: u64 },
    /// Sleeping before `next`. Entered after an error.
    Backoff {
        next: Box<TableState>,
        after: Duration,
    },
    /// Shut down, or shed for the memory bound. Never left.
    Stopped,
}

/// How one watch ended.
#[derive(Debug, PartialEq, Eq)]
pub enum TableEnd {
    /// Ended cleanly or stalled: resume.
    Closed,
    /// 410 Gone / Expired, or the columns changed: start over with initial events.
    StartOver,
    /// Refused or broken: back off.
    Failed,
}

/// The state after a watch that ended with `end`, having reached `last_rv` (0: its initial
/// state never completed). Pure.
pub fn after_watch(end: &TableEnd, last_rv: u64, backoff: Duration) -> TableState {
    let resume = if last_rv > 0 {
        TableState::Resume { rv: last_rv }
    } else {
        TableState::Initial
    };
    match end {
        TableEnd::StartOver => TableState::Initial,
        TableEnd::Closed if last_rv > 0 => resume,
        TableEnd::Closed | TableEnd::Failed => TableState::Backoff {
            next: Box::new(resume),
            after: backoff,
        },
    }
}

#[derive(Deserialize)]
struct Line<'a> {
    #[serde(borrow, rename = "type")]
    ty: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    object: &'a RawValue,
}

#[derive(Deserialize)]
struct StatusWire {
    #[serde(default)]
    code: u16,
}

/// Starts the table side of `resource` on the current runtime, with initial events or,
/// restored from a warm restart's saved state, from `from`; it runs until `shutdown` is
/// cancelled or the store is shed.
pub fn spawn(
    resource: Resource,
    upstream: Upstream,
    store: Arc<TableStore>,
    cfg: ReflectorConfig,
    shutdown: CancellationToken,
    from: Option<u64>,
) -> tokio::task::JoinHandle<()> {
    let span = tracing::info_span!("table_side", resource = %resource.label());
    tokio::spawn(
        async move {
            info!("table side starting");
            let mut backoff = Backoff::new(
                cfg.backoff_initial,
                cfg.backoff_max,
                cfg.backoff_reset_after,
            );
            let mut state = match from {
                Some(rv) => TableState::Resume { rv },
                None => TableState::Initial,
            };
            let shed = store.shed.clone();
            while state != TableState::Stopped {
                state = tokio::select! {
                    biased;
                    () = shutdown.cancelled() => TableState::Stopped,
                    () = shed.cancelled() => TableState::Stopped,
                    next = step(&resource, &upstream, &store, &cfg, &mut backoff, state) => next,
                };
            }
            info!("table side stopped");
        }
        .instrument(span),
    )
}

async fn step(
    resource: &Resource,
    upstream: &Upstream,
    store: &TableStore,
    cfg: &ReflectorConfig,
    backoff: &mut Backoff,
    state: TableState,
) -> TableState {
    let from = match state {
        TableState::Initial => None,
        TableState::Resume { rv } => Some(rv),
        TableState::Backoff { next, after } => {
            tokio::time::sleep(after).await;
            return *next;
        }
        TableState::Stopped => return TableState::Stopped,
    };
    let started = Instant::now();
    let (end, last_rv, delivered) = watch(resource, upstream, store, cfg, from).await;
    debug!(?from, ?end, last_rv, delivered, "table watch ended");
    // A watch the apiserver closes at once without anything is backed off as an error (the
    // JSON reflector's rule), so a server closing every watch cannot make the task spin.
    let end = if end == TableEnd::Closed && delivered == 0 && started.elapsed().as_secs() < 1 {
        TableEnd::Failed
    } else {
        end
    };
    let delay = backoff.next_delay(Instant::now(), random_unit());
    after_watch(&end, last_rv, delay)
}

/// One watch; returns how it ended, the last resourceVersion of a synced stream (0 when its
/// initial state did not complete) and how many events it delivered.
async fn watch(
    resource: &Resource,
    upstream: &Upstream,
    store: &TableStore,
    cfg: &ReflectorConfig,
    from: Option<u64>,
) -> (TableEnd, u64, u64) {
    const WHAT: &str = "table watch";
    let timeout_secs = jitter(cfg.watch_timeout, random_unit()).as_secs().max(1);
    let start = match from {
        None => "sendInitialEvents=true&resourceVersionMatch=NotOlderThan".to_string(),
        Some(rv) => format!("resourceVersion={rv}"),
    };
    let pq = format!(
        "{}?watch=1&{start}&allowWatchBookmarks=true&includeObject=Metadata&timeoutSeconds={timeout_secs}",
        resource.collection_path(None),
    );
    let req = Request::get(upstream.uri(&pq))
        .header(header::ACCEPT, TABLE_ACCEPT)
        .body(body::empty())
        .expect("a GET with a valid URI is a valid request");
    let mut last_rv = from.unwrap_or(0);
    let mut delivered = 0u64;
    let timeout = cfg.request_timeout;
    let resp = match tokio::time::timeout(timeout, upstream.send(req, As::Proxy, true)).await {
        Err(_) => {
            warn!("table watch: no answer in time");
            return (TableEnd::Failed, last_rv, 0);
        }
        Ok(Err(source)) => {
            let e = ReflectorError::Transport { what: WHAT, source };
            if e.is_unreachable() {
                upstream.reachability().unreachable(&e);
            }
            warn!(error = %e, "table watch failed");
            return (TableEnd::Failed, last_rv, 0);
        }
        Ok(Ok(resp)) => resp,
    };
    if !resp.status().is_success() {
        let gone = resp.status().as_u16() == 410;
        let e = tokio::time::timeout(timeout, error_response(WHAT, resp)).await;
        if let Ok(e) = e {
            warn!(error = %e, "table watch refused");
        }
        let end = if gone {
            TableEnd::StartOver
        } else {
            TableEnd::Failed
        };
        return (end, last_rv, 0);
    }
    let mut body = resp.into_body();
    let mut lines = LineSplitter::default();
    let mut batch: Vec<Bytes> = Vec::new();
    let mut first = true;
    loop {
        let deadline = Instant::now() + cfg.stall_timeout;
        let next = tokio::select! {
            next = tokio::time::timeout_at(deadline, body.frame()) => next,
            // The CRD declares other columns: a new watch carries the apiserver's new ones.
            () = store.kicked() => return (TableEnd::Closed, last_rv, delivered.max(1)),
        };
        let chunk = match next {
            Err(_) | Ok(None) => return (TableEnd::Closed, last_rv, delivered),
            Ok(Some(Err(e))) => {
                warn!(error = %e, "table watch broke");
                return (TableEnd::Failed, last_rv, delivered);
            }
            Ok(Some(Ok(chunk))) => chunk,
        };
        let Ok(data) = chunk.into_data() else {
            continue;
        };
        if lines.push(data, &mut batch).is_err() {
            return (TableEnd::Failed, last_rv, delivered);
        }
        for line in batch.drain(..) {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let Ok(l) = serde_json::from_slice::<Line<'_>>(&line) else {
                warn!("table watch: an event line that is not an event");
                return (TableEnd::Failed, last_rv, delivered);
            };
            if l.ty == "ERROR" {
                let code = serde_json::from_str::<StatusWire>(l.object.get())
                    .map(|s| s.code)
                    .unwrap_or(0);
                warn!(code, "table watch ERROR event");
                let end = if code == 410 {
                    TableEnd::StartOver
                } else {
                    TableEnd::Failed
                };
                return (end, last_rv, delivered);
            }
            let ev = match parse_table_event(l.object.get()) {
                Ok(ev) => ev,
                Err(e) => {
                    warn!(error = e, "table watch: unreadable Table");
                    return (TableEnd::Failed, last_rv, delivered);
                }
            };
            if first {
                first = false;
                let Some(cols) = ev.columns.as_deref() else {
                    warn!("table watch: first event without columnDefinitions");
                    return (TableEnd::Failed, last_rv, delivered);
                };
                if store.set_columns(cols).is_none() {
                    warn!("table watch: unreadable columnDefinitions");
                    return (TableEnd::Failed, last_rv, delivered);
                }
                if store.restart.swap(false, Relaxed) {
                    info!("table columns changed: fetching every row again");
                    return (TableEnd::StartOver, 0, delivered);
                }
                // Not yet the columns the CRD declares (the apiserver switches its serving
                // of the resource a moment after the CRD changed): again, after a backoff.
                if !store.columns_expected() {
                    info!("table columns are not yet the CRD's: watching again");
                    return (TableEnd::Failed, last_rv, delivered);
                }
            }
            delivered += 1;
            let now = now_ms();
            let synced = from.is_some() || last_rv > 0;
            for r in ev.rows {
                match &*l.ty {
                    "ADDED" | "MODIFIED" => store.attach(r.key, r.rv, r.row, now),
                    "BOOKMARK" => {
                        if r.initial_events_end {
                            last_rv = r.rv;
                        } else if synced {
                            last_rv = last_rv.max(r.rv);
                        }
                        // Its row (the empty object's) first: a synced side can write
                        // its watchers' bookmarks.
                        let end = r.initial_events_end;
                        store.set_bookmark_row(r.row);
                        if end {
                            store.set_synced(true);
                        }
                        continue;
                    }
                    _ => {}
                }
                if synced {
                    last_rv = last_rv.max(r.rv);
                }
            }
            if last_rv > 0 {
                store.advance(last_rv);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_side_resumes_after_a_synced_watch_and_starts_over_otherwise() {
        let d = Duration::from_millis(800);
        assert_eq!(
            after_watch(&TableEnd::Closed, 42, d),
            TableState::Resume { rv: 42 }
        );
        assert_eq!(
            after_watch(&TableEnd::Closed, 0, d),
            TableState::Backoff {
                next: Box::new(TableState::Initial),
                after: d
            },
            "an initial watch that ended before its bookmark"
        );
        assert_eq!(
            after_watch(&TableEnd::StartOver, 42, d),
            TableState::Initial
        );
        assert_eq!(
            after_watch(&TableEnd::Failed, 42, d),
            TableState::Backoff {
                next: Box::new(TableState::Resume { rv: 42 }),
                after: d
            }
        );
    }
}
