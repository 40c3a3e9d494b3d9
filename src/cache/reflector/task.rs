//! The reflector task: one resource's LIST+WATCH loop on its own tokio task. It runs the
//! current [`State`]'s I/O (the pager's LIST, the WATCH stream), delivers to the sink, reports
//! health and status, and asks the pure transitions for the next state.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::BodyExt as _;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, info, warn};

use super::backoff::{Backoff, jitter, random_unit};
use super::config::ReflectorConfig;
use super::error::{ReflectorError, error_response};
use super::list::Pager;
use super::state::{State, WatchEnd, WatchOutcome, after_list_error, after_watch};
use super::stats::{ReflectorStats, ReflectorStatus, RelistReason};
use super::watch::{LineSplitter, WatchItem, parse_event_line};
use crate::cache::{ReflectorSink, Resource};
use crate::http::body;
use crate::upstream::{As, Upstream};

/// One resource's LIST+WATCH loop. Created and started by [`Reflector::spawn`].
pub struct Reflector {
    resource: Resource,
    upstream: Upstream,
    sink: Arc<dyn ReflectorSink>,
    cfg: ReflectorConfig,
    backoff: Backoff,
    stats: Arc<ReflectorStats>,
    status: watch::Sender<ReflectorStatus>,
    /// The last health report given to the sink (`None`: none yet).
    reported: Option<Option<String>>,
    /// The resourceVersion of the list just delivered, until the watch that follows it.
    listed_rv: Option<u64>,
}

/// Controls a spawned reflector.
pub struct ReflectorHandle {
    task: JoinHandle<()>,
    status: watch::Receiver<ReflectorStatus>,
    stats: Arc<ReflectorStats>,
}

impl ReflectorHandle {
    /// Status changes (list / watch / backoff / stopped).
    pub fn status(&self) -> watch::Receiver<ReflectorStatus> {
        self.status.clone()
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<ReflectorStats> {
        &self.stats
    }

    /// Stops the task at its next await point without the final `set_unhealthy` report;
    /// prefer cancelling the shutdown token.
    pub fn abort(&self) {
        self.task.abort();
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits for the task to end (after the shutdown token is cancelled, or `abort`).
    ///
    /// # Errors
    /// If the task panicked or was aborted.
    pub async fn join(self) -> Result<(), tokio::task::JoinError> {
        self.task.await
    }
}

impl Reflector {
    /// Starts the reflector for `resource` on the current tokio runtime. It runs until
    /// `shutdown` is cancelled; then it reports `set_unhealthy(Some("reflector stopped"))` and
    /// ends.
    pub fn spawn(
        resource: Resource,
        upstream: Upstream,
        sink: Arc<dyn ReflectorSink>,
        cfg: ReflectorConfig,
        shutdown: CancellationToken,
    ) -> ReflectorHandle {
        Reflector::spawn_from(resource, upstream, sink, cfg, shutdown, async { None })
    }

    /// As [`Reflector::spawn`], but first awaits `from`: `Some(rv)` when the sink was given
    /// a state at `rv` some other way (a warm restart loaded it), so the reflector starts
    /// with a WATCH from `rv` instead of a LIST (a 410 there relists as usual).
    pub fn spawn_from(
        resource: Resource,
        upstream: Upstream,
        sink: Arc<dyn ReflectorSink>,
        cfg: ReflectorConfig,
        shutdown: CancellationToken,
        from: impl std::future::Future<Output = Option<u64>> + Send + 'static,
    ) -> ReflectorHandle {
        let label = resource.label();
        let initial = RelistReason::Initial;
        let (status_tx, status_rx) = watch::channel(ReflectorStatus::Listing { reason: initial });
        let stats = Arc::new(ReflectorStats::default());
        let r = Reflector {
            backoff: Backoff::new(
                cfg.backoff_initial,
                cfg.backoff_max,
                cfg.backoff_reset_after,
            ),
            resource,
            upstream,
            sink,
            cfg,
            stats: stats.clone(),
            status: status_tx,
            reported: None,
            listed_rv: None,
        };
        let span = tracing::info_span!("reflector", resource = %label);
        let task = tokio::spawn(r.run(shutdown, from).instrument(span));
        ReflectorHandle {
            task,
            status: status_rx,
            stats,
        }
    }

    async fn run(
        mut self,
        shutdown: CancellationToken,
        from: impl std::future::Future<Output = Option<u64>>,
    ) {
        let from = tokio::select! {
            biased;
            _ = shutdown.cancelled() => None,
            from = from => from,
        };
        let mut state = match from {
            _ if shutdown.is_cancelled() => State::Stopped,
            Some(rv) => {
                info!(rv, "reflector resuming from a saved state");
                self.stats.last_rv.store(rv, Ordering::Relaxed);
                State::Watch { rv, too_large: 0 }
            }
            None => State::List {
                reason: RelistReason::Initial,
                paged: true,
            },
        };
        info!("reflector starting");
        while state != State::Stopped {
            debug!(state = state.name(), detail = ?state, "reflector state");
            state = tokio::select! {
                biased;
                _ = shutdown.cancelled() => State::Stopped,
                next = self.step(state) => next,
            };
        }
        info!("reflector stopped");
        self.report_health(Some("reflector stopped".into()));
        self.status.send_replace(ReflectorStatus::Stopped);
    }

    /// Runs `state` (its I/O and sink calls) and returns the next state.
    async fn step(&mut self, state: State) -> State {
        match state {
            State::List { reason, paged } => {
                ReflectorStats::inc(&self.stats.lists[reason.index()]);
                self.status
                    .send_replace(ReflectorStatus::Listing { reason });
                self.report_health(Some(format!("listing ({})", reason.as_str())));
                match self.pager().list(paged).await {
                    Ok((items, rv)) => {
                        debug!(items = items.len(), rv, "list complete");
                        self.sink.replace(items, rv);
                        self.listed_rv = Some(rv);
                        ReflectorStats::inc(&self.stats.syncs);
                        self.stats.last_rv.store(rv, Ordering::Relaxed);
                        State::Watch { rv, too_large: 0 }
                    }
                    Err((err, on_continue)) => {
                        ReflectorStats::inc(&self.stats.list_errors);
                        if err.is_unreachable() {
                            self.upstream.reachability().unreachable(&err);
                        }
                        warn!(error = %err, reason = reason.as_str(), "list failed");
                        after_list_error(
                            &err,
                            on_continue,
                            &mut self.backoff,
                            Instant::now(),
                            random_unit(),
                        )
                    }
                }
            }
            State::Watch { rv, too_large } => {
                self.status.send_replace(ReflectorStatus::Watching { rv });
                let out = self.watch(rv).await;
                match &out.end {
                    WatchEnd::Closed => {
                        ReflectorStats::inc(&self.stats.watch_clean_ends);
                        debug!(from = rv, last_rv = out.last_rv, "watch ended cleanly");
                    }
                    WatchEnd::Stalled => {
                        ReflectorStats::inc(&self.stats.stalls);
                        warn!(
                            from = rv,
                            last_rv = out.last_rv,
                            timeout = ?self.cfg.stall_timeout,
                            "watch stalled: no event or bookmark, re-watching"
                        );
                        self.report_health(Some("watch stalled".into()));
                    }
                    WatchEnd::Refused(e) | WatchEnd::Broken(e) => {
                        ReflectorStats::inc(&self.stats.watch_errors);
                        if matches!(out.end, WatchEnd::Refused(_)) && e.is_unreachable() {
                            self.upstream.reachability().unreachable(e);
                        }
                        warn!(from = rv, last_rv = out.last_rv, error = %e, "watch failed");
                    }
                    WatchEnd::ErrorEvent(s) => {
                        ReflectorStats::inc(&self.stats.watch_errors);
                        warn!(from = rv, last_rv = out.last_rv, status = %s, "watch ERROR event");
                    }
                }
                after_watch(
                    &out,
                    too_large,
                    &mut self.backoff,
                    Instant::now(),
                    random_unit(),
                )
            }
            State::Backoff { next, after, cause } => {
                ReflectorStats::inc(&self.stats.backoffs);
                self.status.send_replace(ReflectorStatus::BackingOff {
                    error: cause.clone(),
                    delay: after,
                });
                self.report_health(Some(cause));
                tokio::time::sleep(after).await;
                next.into()
            }
            State::Stopped => State::Stopped,
        }
    }

    /// Reports health to the sink unless it is the same as the last report.
    fn report_health(&mut self, reason: Option<String>) {
        if self.reported.as_ref() == Some(&reason) {
            return;
        }
        self.sink.set_unhealthy(reason.clone());
        self.reported = Some(reason);
    }

    /// The pager for this reflector's resource.
    fn pager(&self) -> Pager<'_> {
        Pager {
            upstream: &self.upstream,
            resource: &self.resource,
            cfg: &self.cfg,
            stats: &self.stats,
            exact: None,
        }
    }

    /// One watch from `from`: opens it, delivers its events, returns how it ended.
    async fn watch(&mut self, from: u64) -> WatchOutcome {
        let started = Instant::now();
        let mut out = WatchOutcome {
            from,
            last_rv: from,
            delivered: 0,
            lived: Duration::ZERO,
            end: WatchEnd::Closed,
        };
        // Only the first attempt after a list starts from state just read.
        let after_list = self.listed_rv.take() == Some(from);
        out.end = self.watch_inner(&mut out, after_list).await;
        out.lived = started.elapsed();
        out
    }

    async fn watch_inner(&mut self, out: &mut WatchOutcome, after_list: bool) -> WatchEnd {
        const WHAT: &str = "watch";
        let timeout_secs = jitter(self.cfg.watch_timeout, random_unit())
            .as_secs()
            .max(1);
        let pq = format!(
            "{}?watch=1&allowWatchBookmarks=true&resourceVersion={}&timeoutSeconds={timeout_secs}",
            self.resource.collection_path(None),
            out.from
        );
        let req = Request::get(self.upstream.uri(&pq))
            .header(header::ACCEPT, "application/json")
            .body(body::empty())
            .expect("a GET with a valid URI is a valid request");
        ReflectorStats::inc(&self.stats.watch_starts);
        let timeout = self.cfg.request_timeout;
        // A span until the watch is established (its headers): the cache's own trace.
        let send = async {
            let r = tokio::time::timeout(timeout, self.upstream.send(req, As::Proxy, true)).await;
            if let Ok(Ok(resp)) = &r {
                crate::telemetry::set_status_code(resp.status().as_u16());
            }
            r
        };
        let sent = self
            .upstream
            .telemetry()
            .in_root_span(
                || format!("WATCH {}", self.resource.label()),
                || super::span_attrs(&self.resource, &pq),
                send,
            )
            .await;
        let resp = match sent {
            Err(_) => {
                return WatchEnd::Refused(ReflectorError::Timeout {
                    what: WHAT,
                    timeout,
                });
            }
            Ok(Err(source)) => {
                return WatchEnd::Refused(ReflectorError::Transport { what: WHAT, source });
            }
            Ok(Ok(resp)) => resp,
        };
        if !resp.status().is_success() {
            let err = tokio::time::timeout(timeout, error_response(WHAT, resp))
                .await
                .unwrap_or(ReflectorError::Timeout {
                    what: WHAT,
                    timeout,
                });
            return WatchEnd::Refused(err);
        }
        ReflectorStats::inc(&self.stats.watches_established);
        debug!(from = out.from, timeout_secs, "watch established");
        // A resumed watch is healthy once the stream proves it resumes: its first event or
        // bookmark, or a short grace without an ERROR (the apiserver answers a
        // resourceVersion it has compacted with 200 and then a 410 ERROR event; until that
        // line, the cache may be stale).
        // A watch right after a list starts from state just read: healthy at once.
        let mut healthy_at = if after_list {
            self.report_health(None);
            None
        } else {
            Some(Instant::now() + WATCH_HEALTHY_GRACE.min(self.cfg.stall_timeout / 2))
        };

        let mut body = resp.into_body();
        let mut lines = LineSplitter::default();
        let mut batch: Vec<Bytes> = Vec::new();
        let mut deadline = Instant::now() + self.cfg.stall_timeout;
        loop {
            let until = healthy_at.map_or(deadline, |h| h.min(deadline));
            let frame = match tokio::time::timeout_at(until, body.frame()).await {
                Err(_) if healthy_at.is_some_and(|h| Instant::now() >= h) => {
                    healthy_at = None;
                    self.report_health(None);
                    continue;
                }
                Err(_) => return WatchEnd::Stalled,
                Ok(None) if lines.has_partial() => {
                    return WatchEnd::Broken(ReflectorError::TruncatedLine);
                }
                Ok(None) => return WatchEnd::Closed,
                Ok(Some(Err(e))) => {
                    return WatchEnd::Broken(ReflectorError::Body {
                        what: WHAT,
                        source: e.into(),
                    });
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            ReflectorStats::add(&self.stats.watch_bytes, data.len());
            if let Err(e) = lines.push(data, &mut batch) {
                return WatchEnd::Broken(e);
            }
            for line in batch.drain(..) {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                match parse_event_line(&line, &self.resource) {
                    Ok(WatchItem::Object(kind, obj)) => {
                        let rv = obj.meta.resource_version;
                        self.sink.apply(kind, obj);
                        out.last_rv = rv;
                        out.delivered += 1;
                        ReflectorStats::inc(&self.stats.events);
                        self.stats.last_rv.store(rv, Ordering::Relaxed);
                    }
                    Ok(WatchItem::Bookmark(rv)) => {
                        if let Some(rest) = crate::cache::event::json_bookmark_rest(&line) {
                            self.sink.json_bookmark(rest);
                        }
                        self.sink.bookmark(rv);
                        out.last_rv = rv;
                        out.delivered += 1;
                        ReflectorStats::inc(&self.stats.bookmarks);
                        self.stats.last_rv.store(rv, Ordering::Relaxed);
                    }
                    Ok(WatchItem::Error(status)) => return WatchEnd::ErrorEvent(status),
                    Err(e) => return WatchEnd::Broken(e),
                }
                if healthy_at.take().is_some() {
                    self.report_health(None);
                }
                deadline = Instant::now() + self.cfg.stall_timeout;
            }
        }
    }
}

/// How long an established watch must go without an ERROR event (when it carries nothing
/// else) before the reflector reports the cache healthy (at most half the stall timeout).
pub(super) const WATCH_HEALTHY_GRACE: Duration = Duration::from_millis(500);
