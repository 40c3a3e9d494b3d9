//! The protobuf side's task: one resource's protobuf WATCH on its own tokio task. It runs the
//! current [`ProtoState`]'s watch, delivers every frame to the [`ProtoSink`], counts, and asks
//! [`after_proto_watch`] for the next state.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::BodyExt as _;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, info, warn};

use super::frame::{FrameError, FrameReader, ProtoItem, decode};
use super::state::{ProtoError, ProtoState, ProtoWatchEnd, ProtoWatchOutcome, after_proto_watch};
use super::{ProtoSink, ProtoStats};
use crate::cache::Resource;
use crate::cache::reflector::backoff::{Backoff, jitter, random_unit};
use crate::cache::reflector::config::ReflectorConfig;
use crate::cache::reflector::error::{ReflectorError, error_response};
use crate::http::body;
use crate::k8s::protobuf;
use crate::upstream::{As, Upstream};

/// The media type asked for and expected: the apiserver answers a watch with
/// `application/vnd.kubernetes.protobuf;stream=watch`. client-go sends
/// `application/vnd.kubernetes.protobuf,application/json` for protobuf clients; without the
/// JSON fallback a resource with no protobuf encoding (custom resources) is refused with 406
/// instead of answered in JSON the frame reader would misread.
const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

/// One resource's protobuf WATCH loop. Started by [`ProtoSide::spawn`].
pub struct ProtoSide {
    resource: Resource,
    /// The group/version the resource's objects carry (`v1`, `apps/v1`).
    api_version: String,
    upstream: Upstream,
    sink: Arc<dyn ProtoSink>,
    cfg: ReflectorConfig,
    backoff: Backoff,
    stats: Arc<ProtoStats>,
    /// Whether the sink holds anything from this task (an attach or bookmark since the last
    /// `restarted`, or a state it was given before a resume start): an initial watch must then
    /// tell it `restarted` first.
    dirty: bool,
}

/// Controls a spawned protobuf side.
pub struct ProtoSideHandle {
    task: JoinHandle<()>,
    stats: Arc<ProtoStats>,
}

impl ProtoSideHandle {
    /// The counters.
    pub fn stats(&self) -> &Arc<ProtoStats> {
        &self.stats
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits for the task to end (after the shutdown token is cancelled).
    ///
    /// # Errors
    /// If the task panicked or was aborted.
    pub async fn join(self) -> Result<(), tokio::task::JoinError> {
        self.task.await
    }
}

impl ProtoSide {
    /// Starts the protobuf watch of `resource` (a built-in one: custom resources have no
    /// protobuf encoding) on the current tokio runtime: a watch with initial events first. It
    /// runs until `shutdown` is cancelled. `cfg`'s watch timeout, stall timeout, backoff and
    /// request timeout apply as to the JSON reflector.
    pub fn spawn(
        resource: Resource,
        upstream: Upstream,
        sink: Arc<dyn ProtoSink>,
        cfg: ReflectorConfig,
        shutdown: CancellationToken,
    ) -> ProtoSideHandle {
        ProtoSide::spawn_from(resource, upstream, sink, cfg, shutdown, None)
    }

    /// As [`ProtoSide::spawn`], but with `from: Some(rv)` the first watch resumes from `rv`
    /// (the sink holds the envelopes of a state at `rv`, e.g. from a warm restart); a 410 then
    /// starts over with `restarted` and initial events.
    pub fn spawn_from(
        resource: Resource,
        upstream: Upstream,
        sink: Arc<dyn ProtoSink>,
        cfg: ReflectorConfig,
        shutdown: CancellationToken,
        from: Option<u64>,
    ) -> ProtoSideHandle {
        let stats = Arc::new(ProtoStats::default());
        // Resumed from a state the sink holds whole: synced until a restart says otherwise.
        stats.synced.store(from.is_some(), Ordering::Relaxed);
        let span = tracing::info_span!("proto_side", resource = %resource.label());
        let side = ProtoSide {
            api_version: resource.api_version(),
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
            dirty: from.is_some(),
        };
        let first = match from {
            Some(rv) => ProtoState::Resume { rv, too_large: 0 },
            None => ProtoState::Initial,
        };
        let task = tokio::spawn(side.run(first, shutdown).instrument(span));
        ProtoSideHandle { task, stats }
    }

    async fn run(mut self, mut state: ProtoState, shutdown: CancellationToken) {
        info!("protobuf side starting");
        while state != ProtoState::Stopped {
            debug!(state = state.name(), detail = ?state, "protobuf side state");
            state = tokio::select! {
                biased;
                _ = shutdown.cancelled() => ProtoState::Stopped,
                next = self.step(state) => next,
            };
        }
        info!("protobuf side stopped");
    }

    async fn step(&mut self, state: ProtoState) -> ProtoState {
        let (from, too_large) = match state {
            ProtoState::Initial => (None, 0),
            ProtoState::Resume { rv, too_large } => (Some(rv), too_large),
            ProtoState::Backoff { next, after, cause } => {
                ProtoStats::inc(&self.stats.backoffs);
                debug!(?after, cause, "protobuf side backing off");
                tokio::time::sleep(after).await;
                return *next;
            }
            ProtoState::Stopped => return ProtoState::Stopped,
        };
        if from.is_none() && std::mem::take(&mut self.dirty) {
            ProtoStats::inc(&self.stats.restarts);
            self.stats.synced.store(false, Ordering::Relaxed);
            self.sink.restarted();
        }
        let out = self.watch(from).await;
        match &out.end {
            ProtoWatchEnd::Closed => {
                ProtoStats::inc(&self.stats.clean_ends);
                debug!(?from, last_rv = out.last_rv, "protobuf watch ended cleanly");
            }
            ProtoWatchEnd::Stalled => {
                ProtoStats::inc(&self.stats.stalls);
                warn!(
                    ?from,
                    last_rv = out.last_rv,
                    "protobuf watch stalled, re-watching"
                );
            }
            ProtoWatchEnd::Refused(e) | ProtoWatchEnd::Broken(e) => {
                ProtoStats::inc(&self.stats.errors);
                if let (ProtoWatchEnd::Refused(_), ProtoError::Upstream(e)) = (&out.end, e)
                    && e.is_unreachable()
                {
                    self.upstream.reachability().unreachable(e);
                }
                warn!(?from, last_rv = out.last_rv, error = %e, "protobuf watch failed");
            }
            ProtoWatchEnd::ErrorEvent(s) => {
                ProtoStats::inc(&self.stats.errors);
                warn!(?from, last_rv = out.last_rv, status = %s, "protobuf watch ERROR event");
            }
        }
        after_proto_watch(
            &out,
            too_large,
            &mut self.backoff,
            Instant::now(),
            random_unit(),
        )
    }

    /// One watch: with initial events (`from: None`) or from a resourceVersion.
    async fn watch(&mut self, from: Option<u64>) -> ProtoWatchOutcome {
        let started = Instant::now();
        let mut out = ProtoWatchOutcome {
            synced: from.is_some(),
            last_rv: from.unwrap_or(0),
            delivered: 0,
            lived: Default::default(),
            end: ProtoWatchEnd::Closed,
        };
        out.end = self.watch_inner(from, &mut out).await;
        out.lived = started.elapsed();
        out
    }

    async fn watch_inner(
        &mut self,
        from: Option<u64>,
        out: &mut ProtoWatchOutcome,
    ) -> ProtoWatchEnd {
        const WHAT: &str = "protobuf watch";
        let timeout_secs = jitter(self.cfg.watch_timeout, random_unit())
            .as_secs()
            .max(1);
        let start = match from {
            // KEP-3157's watch-list: the state as ADDED events, then a bookmark annotated
            // `k8s.io/initial-events-end`; NotOlderThan with no resourceVersion is a
            // consistent read of the current state.
            None => "sendInitialEvents=true&resourceVersionMatch=NotOlderThan".to_string(),
            Some(rv) => format!("resourceVersion={rv}"),
        };
        let pq = format!(
            "{}?watch=1&{start}&allowWatchBookmarks=true&timeoutSeconds={timeout_secs}",
            self.resource.collection_path(None),
        );
        let req = Request::get(self.upstream.uri(&pq))
            .header(header::ACCEPT, PROTOBUF)
            .body(body::empty())
            .expect("a GET with a valid URI is a valid request");
        ProtoStats::inc(&self.stats.watch_starts);
        if from.is_none() {
            ProtoStats::inc(&self.stats.initial_watches);
        }
        let timeout = self.cfg.request_timeout;
        let refused = |e: ReflectorError| ProtoWatchEnd::Refused(e.into());
        let resp = match tokio::time::timeout(timeout, self.upstream.send(req, As::Proxy, true))
            .await
        {
            Err(_) => {
                return refused(ReflectorError::Timeout {
                    what: WHAT,
                    timeout,
                });
            }
            Ok(Err(source)) => return refused(ReflectorError::Transport { what: WHAT, source }),
            Ok(Ok(resp)) => resp,
        };
        if !resp.status().is_success() {
            let err = tokio::time::timeout(timeout, error_response(WHAT, resp))
                .await
                .unwrap_or(ReflectorError::Timeout {
                    what: WHAT,
                    timeout,
                });
            return refused(err);
        }
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !content_type.starts_with(PROTOBUF) {
            return ProtoWatchEnd::Refused(ProtoError::NotProtobuf(content_type.to_string()));
        }
        debug!(?from, timeout_secs, "protobuf watch established");

        let mut body = resp.into_body();
        let mut reader = FrameReader::default();
        let mut frames: Vec<Bytes> = Vec::new();
        loop {
            let deadline = Instant::now() + self.cfg.stall_timeout;
            let chunk = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => return ProtoWatchEnd::Stalled,
                Ok(None) if reader.pending() > 0 => {
                    return ProtoWatchEnd::Broken(FrameError::Truncated(reader.pending()).into());
                }
                Ok(None) => return ProtoWatchEnd::Closed,
                Ok(Some(Err(e))) => {
                    let e = ReflectorError::Body {
                        what: WHAT,
                        source: e.into(),
                    };
                    return ProtoWatchEnd::Broken(e.into());
                }
                Ok(Some(Ok(chunk))) => chunk,
            };
            let Ok(data) = chunk.into_data() else {
                continue; // trailers
            };
            self.stats
                .bytes
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            if let Err(e) = reader.push(data, &mut frames) {
                return ProtoWatchEnd::Broken(e.into());
            }
            for frame in frames.drain(..) {
                ProtoStats::inc(&self.stats.frames);
                let item = match decode(&frame) {
                    Ok(item) => item,
                    Err(e) => return ProtoWatchEnd::Broken(e.into()),
                };
                if let Some(env) = item.envelope()
                    && let Err(e) = self.check_kind(env)
                {
                    return ProtoWatchEnd::Broken(e);
                }
                match item {
                    ProtoItem::Object {
                        kind,
                        key,
                        rv,
                        envelope,
                    } => {
                        self.sink.attach(kind, key, rv, envelope);
                        ProtoStats::inc(&self.stats.objects);
                        if out.synced {
                            out.last_rv = rv;
                            self.stats.last_rv.store(rv, Ordering::Relaxed);
                        }
                    }
                    ProtoItem::Bookmark {
                        rv,
                        initial_events_end,
                        envelope,
                    } => {
                        self.sink.bookmark(rv, initial_events_end, envelope);
                        ProtoStats::inc(&self.stats.bookmarks);
                        if initial_events_end {
                            out.synced = true;
                            self.stats.synced.store(true, Ordering::Relaxed);
                        }
                        if out.synced {
                            out.last_rv = rv;
                            self.stats.last_rv.store(rv, Ordering::Relaxed);
                        }
                    }
                    ProtoItem::Error(status) => return ProtoWatchEnd::ErrorEvent(status),
                }
                self.dirty = true;
                out.delivered += 1;
            }
        }
    }

    /// An event's object must be of the watched kind: anything else would be attached as
    /// bytes the proxy then serves for this resource.
    fn check_kind(&self, env: &[u8]) -> Result<(), ProtoError> {
        let e = protobuf::envelope(env).ok_or(FrameError::Malformed("object envelope"))?;
        if e.kind == self.resource.kind && e.api_version == self.api_version {
            return Ok(());
        }
        Err(ProtoError::WrongKind {
            got: format!("{}/{}", e.api_version, e.kind),
            want: format!("{}/{}", self.api_version, self.resource.kind),
        })
    }
}
