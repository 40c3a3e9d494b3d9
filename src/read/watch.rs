//! Downstream WATCH served from the cache, with the apiserver's semantics (see
//! `docs/architecture.md`, "The Kubernetes contract"): start points, 410 Expired as an ERROR event for a
//! resourceVersion older than the cache's history, bookmarks
//! (periodic and ~2 s before the deadline), `sendInitialEvents` with the
//! `k8s.io/initial-events-end` bookmark, `timeoutSeconds`, selectors with transitions,
//! PartialObjectMetadata.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use http::{HeaderValue, Response, header};
use http_body::Frame;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;

use crate::cache::event::{Delivery, Encoding, Event, FRAME_OVERHEAD, bookmark_frame, put_frame};
use crate::cache::hub::{Filter, Item, Subscription};
use crate::cache::reflector::backfill::BackfillError;
use crate::cache::{CachedObject, ResourceCache, Start, WatchError};
use crate::http::body::{self, Body};
use crate::http::drain::Drain;
use crate::read::plan::{self, WatchParams};
use crate::read::{Served, delegate};

/// Tunables of served watches.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// Periodic bookmarks for watchers that allow them (kube-apiserver: about a minute).
    pub bookmark_interval: Duration,
    /// ...and for watchers with a field-level change filter, whose suppressed events
    /// would otherwise leave their resourceVersion behind (`cache.filteredBookmarkInterval`).
    pub filtered_bookmark_interval: Duration,
    /// Without `timeoutSeconds`, a watch lasts a random time in [t, 2t) (kube-apiserver's
    /// `--min-request-timeout`, 1800 s), so reconnects spread out.
    pub default_timeout: Duration,
    /// How long a watch for a resourceVersion newer than the cache waits for it.
    pub wait_for_rv: Duration,
    /// Extends a cache's history back from the apiserver for a watch older than it
    /// (`cache.backfill`); `None`: such a watch gets 410 Expired.
    pub backfill: Option<crate::cache::reflector::backfill::Backfiller>,
    /// Brings a cache to a resourceVersion it has not reached by a probe of the apiserver
    /// (`Consistency::reach`); `None`: the watch only waits for its resource's events.
    pub consistency: Option<Arc<crate::read::consistency::Consistency>>,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            bookmark_interval: Duration::from_secs(60),
            filtered_bookmark_interval: Duration::from_secs(5),
            default_timeout: Duration::from_secs(1800),
            wait_for_rv: Duration::from_secs(3),
            backfill: None,
            consistency: None,
        }
    }
}

/// The Content-Type of a protobuf watch stream, as the apiserver writes it.
pub const PROTOBUF_STREAM: &str = "application/vnd.kubernetes.protobuf;stream=watch";

/// How long a protobuf watch waits for its starting point's envelopes (objects the JSON side
/// applied a moment before the protobuf side delivered them) before the apiserver serves it.
const PROTO_START_WAIT: Duration = Duration::from_secs(2);

/// A protobuf watch's representation: whole objects or their metadata, and the kind's
/// bookmark object (learnt from the protobuf side, `ResourceCache::proto_bookmark`).
struct Proto {
    metadata: bool,
    api_version: String,
    kind: String,
    /// The bookmark object's bytes after its metadata (`protobuf_write::bookmark_rest`).
    rest: Bytes,
}

impl Proto {
    fn new(cache: &ResourceCache, metadata: bool) -> Option<Proto> {
        if metadata {
            return Some(Proto {
                metadata,
                api_version: crate::k8s::protobuf_write::META_V1.into(),
                kind: "PartialObjectMetadata".into(),
                rest: Bytes::new(),
            });
        }
        let (kind, rest) = cache.proto_bookmark.lock().clone()?;
        Some(Proto {
            metadata,
            api_version: cache.resource.api_version(),
            kind,
            rest,
        })
    }

    fn bookmark(&self, rv: u64, initial_events_end: bool) -> Bytes {
        let object = crate::k8s::protobuf_write::bookmark_object(
            &self.api_version,
            &self.kind,
            &self.rest,
            &rv.to_string(),
            initial_events_end,
        );
        let mut out = Vec::with_capacity(object.len() + 24);
        let _ = crate::k8s::protobuf_write::watch_frame(&mut out, "BOOKMARK", &object);
        Bytes::from(out)
    }

    /// An object of the starting state as an ADDED frame, appended to `out`.
    fn added(&self, o: &CachedObject, out: &mut Vec<u8>) -> Option<()> {
        let env = o.proto.get()?;
        let object: std::borrow::Cow<'_, [u8]> = if self.metadata {
            crate::k8s::protobuf_write::metadata_object(env)?.into()
        } else {
            (&env[..]).into()
        };
        crate::k8s::protobuf_write::watch_frame(out, "ADDED", &object).ok()
    }

    /// Whether a starting point's entry can be written now.
    fn ready(&self, (o, ev, d): &InitialItem, initial_is_state: bool) -> bool {
        match ev {
            Some(ev) if !initial_is_state => ev.proto_frame(*d, self.metadata).is_some(),
            _ => o.proto.get().is_some(),
        }
    }

    /// Whether a starting point's entry that is not ready never will be: the envelopes its
    /// frame is made from are of versions at or before `synced`, the protobuf side's
    /// initial state, which attached every envelope it had for versions the JSON side
    /// held before it said it had synced. Such versions are those of history events older
    /// than the side (a backfilled stretch after a cold start, say): the side brings only
    /// the state it starts from and what follows.
    fn never_ready(&self, item: &InitialItem, initial_is_state: bool, synced: u64) -> bool {
        let rv = match &item.1 {
            Some(ev) if !initial_is_state => ev.rv,
            _ => item.0.meta.resource_version,
        };
        rv <= synced && !self.ready(item, initial_is_state)
    }
}

type InitialItem = (Arc<CachedObject>, Option<Arc<Event>>, Delivery);

/// Whether a watch resuming from `from` (a client's last resourceVersion) would be served
/// by `cache` now, at once and as the apiserver would serve it: both sides it needs ready,
/// `from` reached and still in the history (no 410, no backfill), and for `protobuf` every
/// event after it with its envelope or still able to get one (events after the protobuf
/// side's start; `Proto::never_ready`). `metadata`: a protobuf watch of
/// `PartialObjectMetadata`. What moves a watch passed through while the cache was not ready
/// back to it (`serve::homing`); the route and the pipeline's checks are the caller's.
pub fn resumable(cache: &ResourceCache, from: u64, protobuf: bool, metadata: bool) -> bool {
    if from == 0 || cache.side(protobuf, false) != crate::cache::Side::Ready || from > cache.rv() {
        return false;
    }
    if protobuf && Proto::new(cache, metadata).is_none() {
        return false;
    }
    let Ok((events, _)) = cache.changes_since(from) else {
        return false;
    };
    if !protobuf {
        return true;
    }
    let synced = cache
        .proto_synced
        .load(std::sync::atomic::Ordering::Relaxed);
    events
        .iter()
        .all(|ev| ev.rv > synced || ev.proto_frame(Delivery::AsIs, metadata).is_some())
}

/// Serves a watch from `cache`, or hands it to the apiserver (cache not ready, or the wait for
/// a newer resourceVersion failed). `protobuf`: in the apiserver's protobuf (from the
/// objects' envelopes), `enc` then saying whole objects or metadata.
pub async fn serve(
    cache: Arc<ResourceCache>,
    params: WatchParams,
    filter: Filter,
    enc: Encoding,
    protobuf: bool,
    cfg: &WatchConfig,
    drain: Drain,
) -> Served {
    // A watch that came while the cache or its protobuf side is starting waits for it,
    // bounded, then is asked to come back (429, `read::initialized`), as kube-apiserver
    // answers while its watch cache initializes: passed through, it would stay on the
    // apiserver for its whole life. A side that cannot become ready sends it to the
    // apiserver (it must not keep its clients from being served).
    crate::read::initialized(&cache, protobuf, false, cfg.wait_for_rv).await?;
    let proto = if protobuf {
        match Proto::new(&cache, enc == Encoding::Metadata) {
            Some(p) if cache.protobuf_ready() => Some(p),
            _ => return delegate("protobuf side not synced"),
        }
    } else {
        None
    };
    let register = |start, filter| {
        if proto.is_some() {
            cache.watch_protobuf(start, filter)
        } else {
            cache.watch(start, filter)
        }
    };
    let (start, wait) = plan::watch_start(&params, cache.rv());
    if let Some(n) = wait
        && n > cache.rv()
        && !match &cfg.consistency {
            Some(c) => c.reach(&cache, n, cfg.wait_for_rv).await,
            None => cache.wait_for_rv(n, cfg.wait_for_rv).await,
        }
    {
        return delegate(crate::read::NOT_REACHED);
    }
    let bookmark_interval = if filter.changes.is_some() {
        cfg.bookmark_interval.min(cfg.filtered_bookmark_interval)
    } else {
        cfg.bookmark_interval
    };
    let filter = Arc::new(filter);
    let mut reg = register(start, filter.clone());
    // Older than the history: extend it back from the apiserver when it still has the
    // stretch (`reflector::backfill`), then register again.
    if let (Err(WatchError::Expired { requested, .. }), Some(b)) = (&reg, &cfg.backfill)
        && cache.backfillable(*requested)
        && !b.unreachable()
    {
        // Boxed: the backfill's upstream LIST and WATCH are most of this future's size,
        // which every watch request would otherwise allocate.
        match Box::pin(b.fill(&cache, *requested)).await {
            Ok(_) => reg = register(start, filter),
            // The apiserver could not serve the stretch now (its own watch cache still
            // initializing after a restart answers 429): the client watches again from the
            // same resourceVersion after `Retry-After`, as it does when the apiserver itself
            // answers so; a 410 would make it relist for a moment's unavailability.
            Err(BackfillError::Unavailable(why)) => {
                return Err(crate::read::watch_unreachable(format!(
                    "the history from resourceVersion {requested} cannot be had from the \
                     apiserver now ({why}); watch again from it"
                ))
                .into());
            }
            Err(_) => {}
        }
    }
    let reg = match reg {
        Ok(r) => r,
        Err(WatchError::NotReady) => return delegate("cache not ready"),
        // Older than this cache's history: 410 Expired as an ERROR event on a 200 stream, as
        // the apiserver answers past its own window. Passing such watches through instead
        // would turn every client resuming after a proxy restart or relist into a long-lived
        // apiserver watch, just when the apiserver is busiest; with 410 they relist from
        // this cache.
        Err(e @ WatchError::Expired { .. }) => {
            let status = crate::k8s::status::Status::from(e);
            let frame = status.watch_error_frame(proto.is_some());
            return Ok(stream_response(body::full(frame), proto.is_some()));
        }
    };
    let initial: VecDeque<_> = reg.initial.into();
    let initial_is_state = start == Start::Initial;
    // A protobuf watch starts once its starting point's envelopes are all there (the
    // protobuf side is normally milliseconds behind); the apiserver serves it otherwise,
    // at once when one of them will never come.
    if let Some(p) = &proto {
        use std::sync::atomic::Ordering::Relaxed;
        let done = std::sync::atomic::AtomicUsize::new(0);
        let all_ready = || {
            let mut i = done.load(Relaxed);
            while i < initial.len() && p.ready(&initial[i], initial_is_state) {
                i += 1;
            }
            done.store(i, Relaxed);
            i == initial.len()
        };
        let never = || {
            let synced = cache.proto_synced.load(Relaxed);
            initial
                .iter()
                .skip(done.load(Relaxed))
                .any(|item| p.never_ready(item, initial_is_state, synced))
        };
        if !all_ready() {
            cache
                .wait_protobuf(|| all_ready() || never(), PROTO_START_WAIT)
                .await;
            if !all_ready() {
                return delegate("protobuf envelopes of the starting point missing");
            }
        }
    }
    let timeout = params.timeout.unwrap_or_else(|| {
        // In [default, 2 * default), as the apiserver's `minRequestTimeout` jitter.
        cfg.default_timeout + cfg.default_timeout.mul_f64(fastrand::f64())
    });
    let deadline = Instant::now() + timeout;
    let deadline_bookmark = (params.allow_bookmarks && timeout > Duration::from_secs(2))
        .then(|| deadline - Duration::from_secs(2));
    let next_bookmark = Instant::now() + bookmark_interval;
    let protobuf = proto.is_some();
    let st = WatchState {
        cache,
        enc,
        proto: proto.map(Box::new),
        initial,
        initial_is_state,
        // kube-apiserver 1.36 ends every initial state it sends (sendInitialEvents=true, and
        // also resourceVersion unset or "0") with the initial-events-end bookmark when the
        // watcher allows bookmarks (seen by the differential corpus).
        end_bookmark: initial_is_state && params.allow_bookmarks,
        last_rv: reg.rv,
        sub: reg.sub,
        bookmarks: params.allow_bookmarks,
        next_bookmark,
        bookmark_interval,
        // The apiserver sends a last bookmark about 2 s before the deadline (when the watch
        // is long enough for that to make sense).
        deadline_bookmark,
        drain: drain.clone(),
        drain_waker: None,
        bookmark_armed: false,
        done: false,
    };
    let bookmark_at = deadline_bookmark.map_or(next_bookmark, |d| d.min(next_bookmark));
    let body = WatchBody {
        drain: drain.cancelled_owned(),
        deadline: tokio::time::sleep_until(deadline),
        bookmark: tokio::time::sleep_until(bookmark_at),
        st,
    };
    Ok(stream_response(body::boxed(body), protobuf))
}

fn stream_response(b: Body, protobuf: bool) -> Response<Body> {
    let mut r = Response::new(b);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(if protobuf {
            PROTOBUF_STREAM
        } else {
            "application/json"
        }),
    );
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    r
}

struct WatchState {
    cache: Arc<ResourceCache>,
    enc: Encoding,
    /// Protobuf frames instead of `enc`'s JSON. Boxed: a JSON watch (most) then carries
    /// 8 bytes here for its whole life, not the representation's ~90.
    proto: Option<Box<Proto>>,
    initial: VecDeque<InitialItem>,
    initial_is_state: bool,
    end_bookmark: bool,
    last_rv: u64,
    sub: Subscription,
    bookmarks: bool,
    next_bookmark: Instant,
    bookmark_interval: Duration,
    deadline_bookmark: Option<Instant>,
    drain: Drain,
    /// The waker the drain future and the deadline were last polled with (see
    /// [`WatchBody`]).
    drain_waker: Option<Waker>,
    /// The bookmark timer has been polled with `drain_waker` since it was last reset.
    bookmark_armed: bool,
    done: bool,
}

pin_project_lite::pin_project! {
    /// A served watch's body. Its timers and its drain registration live as long as the
    /// stream and are polled in place: an event costs a watcher one queue receive, not the
    /// registration and removal of two timers and of a waiter on the drain token that every
    /// watch of the process shares (which a `select!` over fresh futures per event does).
    /// At 10,000 watchers that churn was a large part of one event's fan-out.
    struct WatchBody {
        #[pin]
        drain: WaitForCancellationFutureOwned,
        #[pin]
        deadline: Sleep,
        // Armed (polled) only when the watcher allows bookmarks.
        #[pin]
        bookmark: Sleep,
        st: WatchState,
    }
}

impl http_body::Body for WatchBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let mut this = self.project();
        let st = this.st;
        if st.done {
            return Poll::Ready(None);
        }
        // The starting point is written without looking at anything else, as before.
        if let Some(chunk) = st.next_initial() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        // In the order of the former `biased` select: the drain, the deadline, events,
        // bookmarks. The drain future is polled only to register this task's waker (once,
        // or when another task polls the body); a cancellation wakes it, and the flag is
        // read on every poll.
        // The deadline timer likewise: once polled with this task's waker it wakes the task
        // when it fires, and `is_elapsed` is read instead of polling it for every event.
        let registered = st
            .drain_waker
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()));
        let ended = if registered {
            st.drain.is_cancelled() || this.deadline.is_elapsed()
        } else {
            st.drain_waker = Some(cx.waker().clone());
            st.bookmark_armed = false;
            this.drain.as_mut().poll(cx).is_ready() || this.deadline.as_mut().poll(cx).is_ready()
        };
        if ended {
            // A watch ended by the drain (the proxy stopping) first gets what is queued for
            // it and a bookmark at its progress, when it allows bookmarks: the client then
            // watches again from this replica's progress, not from its last event, which
            // another replica (or this one, restarted cold) holds in its history or
            // serves with one backfill for every client of the resource instead of one per
            // client's last event. (At the deadline the bookmark was sent 2 s before.)
            let last = if st.bookmarks && st.drain.is_cancelled() {
                st.bookmark_now().0
            } else {
                None
            };
            st.done = true;
            return Poll::Ready(last.map(|b| Ok(Frame::data(b))));
        }
        loop {
            match st.sub.rx.poll_recv(cx) {
                // Closed by the hub (slow consumer, relist): a clean end.
                Poll::Ready(None) => {
                    st.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(item)) => {
                    let mut out = Batch::default();
                    st.push_item(&mut out, item);
                    for _ in 0..BATCH_FRAMES {
                        if out.len() >= BATCH_BYTES {
                            break;
                        }
                        match st.sub.rx.try_recv() {
                            Ok(i) => st.push_item(&mut out, i),
                            Err(_) => break,
                        }
                    }
                    if let Some(b) = out.finish() {
                        return Poll::Ready(Some(Ok(Frame::data(b))));
                    }
                    if st.done {
                        return Poll::Ready(None);
                    }
                    // Only items already part of the starting point: look again.
                }
                Poll::Pending => break,
            }
        }
        let bookmark_due = st.bookmarks
            && if st.bookmark_armed {
                this.bookmark.is_elapsed()
            } else {
                st.bookmark_armed = true;
                this.bookmark.as_mut().poll(cx).is_ready()
            };
        if bookmark_due {
            let (chunk, at) = st.bookmark_now();
            if let Some(at) = at {
                this.bookmark.as_mut().reset(at);
            }
            // Polled again (and so registered) before it is read again.
            st.bookmark_armed = false;
            return Poll::Ready(chunk.map(|b| Ok(Frame::data(b))));
        }
        Poll::Pending
    }
}

/// At most how many bytes more than the object's envelope an ADDED frame of the protobuf
/// stream takes: the length prefix, the WatchEvent's type and the object's field headers (and
/// for metadata, the PartialObjectMetadata envelope's type meta).
const PROTO_FRAME_OVERHEAD: usize = 128;

/// Frames written to a connection in one go, at most.
const BATCH_FRAMES: usize = 128;
const BATCH_BYTES: usize = 256 * 1024;

impl WatchState {
    fn push_item(&mut self, out: &mut Batch, (ev, d): Item) {
        if self.done || ev.rv <= self.last_rv {
            return; // already part of this watcher's starting point
        }
        let frame = match &self.proto {
            None => ev.frame(&self.cache.resource, d, self.enc),
            Some(p) => match ev.proto_frame(d, p.metadata) {
                Some(f) => f,
                // The previous state of an object leaving this watcher's selection never
                // got its envelope: end cleanly after what came before; the client watches
                // again from there, and the apiserver serves it while it is missing.
                None => {
                    self.done = true;
                    return;
                }
            },
        };
        self.last_rv = ev.rv;
        out.push(frame);
    }

    /// Where this watcher's events come from.
    fn hub(&self) -> &crate::cache::hub::Hub {
        if self.proto.is_some() {
            &self.cache.proto_hub
        } else {
            &self.cache.hub
        }
    }

    fn bookmark_frame(&self, rv: u64, initial_events_end: bool) -> Bytes {
        match &self.proto {
            Some(p) => p.bookmark(rv, initial_events_end),
            None => {
                let rest = self.cache.json_bookmark_rest().unwrap_or_default();
                bookmark_frame(
                    &self.cache.resource,
                    rv,
                    initial_events_end,
                    self.enc,
                    &rest,
                )
            }
        }
    }

    /// The next chunk of the starting point (then its end bookmark), if any is left.
    fn next_initial(&mut self) -> Option<Bytes> {
        if !self.initial.is_empty() {
            let r = &self.cache.resource;
            // The chunk's entries and their size, known before it is written: one buffer of
            // the right size, where growing one by doubling left up to half of a 256 KiB
            // chunk unused (held as long as the chunk waits for its connection's socket)
            // and freed the smaller buffers on the way.
            let (n, size) = self.next_initial_size();
            let mut out = Vec::with_capacity(size);
            for (obj, ev, d) in self.initial.drain(..n) {
                // (A protobuf watch starts only once every entry's envelope is there.)
                match (&self.proto, ev) {
                    (None, Some(ev)) if !self.initial_is_state => {
                        out.extend_from_slice(&ev.frame(r, d, self.enc));
                    }
                    (None, _) => put_frame(&mut out, r, "ADDED", &obj.body, self.enc),
                    (Some(p), Some(ev)) if !self.initial_is_state => {
                        if let Some(f) = ev.proto_frame(d, p.metadata) {
                            out.extend_from_slice(&f);
                        }
                    }
                    (Some(p), _) => {
                        let _ = p.added(&obj, &mut out);
                    }
                }
            }
            debug_assert!(out.len() <= size, "{} > {size}", out.len());
            if self.initial.is_empty() {
                // Its buffer (one entry per initial object) would otherwise be kept for the
                // life of the watch.
                self.initial = VecDeque::new();
            }
            return Some(Bytes::from(out));
        }
        if self.end_bookmark {
            self.end_bookmark = false;
            return Some(self.bookmark_frame(self.last_rv, true));
        }
        None
    }

    /// How many entries of the starting point the next chunk takes (up to [`BATCH_BYTES`]
    /// and the entry that crosses it) and at most how many bytes they are written in.
    fn next_initial_size(&self) -> (usize, usize) {
        let r = &self.cache.resource;
        let type_meta = r.kind.len() + r.api_version().len() + FRAME_OVERHEAD;
        let (mut n, mut size) = (0, 0);
        for (obj, ev, d) in &self.initial {
            if size >= BATCH_BYTES {
                break;
            }
            size += match (&self.proto, ev) {
                (None, Some(ev)) if !self.initial_is_state => ev.frame(r, *d, self.enc).len(),
                (None, _) => obj.body.len() + type_meta,
                (Some(p), Some(ev)) if !self.initial_is_state => {
                    ev.proto_frame(*d, p.metadata).map_or(0, |f| f.len())
                }
                (Some(_), _) => obj
                    .proto
                    .get()
                    .map_or(0, |e| e.len() + PROTO_FRAME_OVERHEAD),
            };
            n += 1;
        }
        (n, size)
    }

    /// A bookmark is due: what to write (the queued events, then the bookmark; only the
    /// events, then the end, when the hub closed this watcher) and when the next one is due
    /// (`None` once the stream is done).
    fn bookmark_now(&mut self) -> (Option<Bytes>, Option<Instant>) {
        let now = Instant::now();
        if self.deadline_bookmark.is_some_and(|d| d <= now) {
            self.deadline_bookmark = None;
        }
        if self.next_bookmark <= now {
            self.next_bookmark = now + self.bookmark_interval;
        }
        let next = match self.deadline_bookmark {
            Some(d) => d.min(self.next_bookmark),
            None => self.next_bookmark,
        };
        // Progress every event up to which has reached this watcher's queue.
        let progress = self.hub().dispatched_rv();
        let mut out = Batch::default();
        loop {
            match self.sub.rx.try_recv() {
                Ok(i) => self.push_item(&mut out, i),
                Err(crate::cache::hub::TryRecvError::Empty) => break,
                Err(crate::cache::hub::TryRecvError::Disconnected) => {
                    // Closed by the hub (relist, slow consumer): the dispatcher's progress
                    // may already lie past events this watcher will never get, so no
                    // bookmark — deliver what is queued, then end.
                    self.done = true;
                    return (out.finish(), None);
                }
            }
        }
        if self.done {
            // An event this protobuf watcher cannot be sent: no bookmark past it.
            return (out.finish(), None);
        }
        self.last_rv = self.last_rv.max(progress);
        out.push(self.bookmark_frame(self.last_rv, false));
        (out.finish(), Some(next))
    }
}

/// Frames for one write: a single frame is passed on as the shared `Bytes` (no per-watcher
/// copy, which matters for large objects); several small ones are joined so the connection
/// gets one write instead of many.
#[derive(Default)]
struct Batch {
    one: Option<Bytes>,
    many: Option<BytesMut>,
}

impl Batch {
    fn push(&mut self, frame: Bytes) {
        if let Some(m) = &mut self.many {
            m.extend_from_slice(&frame);
        } else if let Some(first) = self.one.take() {
            let mut m = BytesMut::with_capacity(first.len() + frame.len());
            m.extend_from_slice(&first);
            m.extend_from_slice(&frame);
            self.many = Some(m);
        } else {
            self.one = Some(frame);
        }
    }

    fn len(&self) -> usize {
        self.many
            .as_ref()
            .map_or_else(|| self.one.as_ref().map_or(0, Bytes::len), BytesMut::len)
    }

    fn finish(self) -> Option<Bytes> {
        match (self.one, self.many) {
            (_, Some(m)) => Some(m.freeze()),
            (one, None) => one,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{EventKind, ReflectorSink, Resource, StoreConfig};
    use http_body_util::BodyExt;

    fn configmaps() -> Resource {
        Resource::core("configmaps", "ConfigMap", true)
    }

    fn cm(rv: u64) -> CachedObject {
        let raw =
            format!(r#"{{"metadata":{{"name":"a","namespace":"ns","resourceVersion":"{rv}"}}}}"#);
        CachedObject::parse(Bytes::from(raw), &configmaps()).unwrap()
    }

    async fn watch(query: &str, cfg: &WatchConfig) -> (Arc<ResourceCache>, Body, Drain) {
        let cache = ResourceCache::new(configmaps(), StoreConfig::default());
        cache.replace(Vec::new(), 1);
        let drain = Drain::new();
        let resp = serve(
            cache.clone(),
            WatchParams::parse(Some(query)).unwrap(),
            Filter::default(),
            Encoding::Json,
            false,
            cfg,
            drain.clone(),
        )
        .await
        .unwrap();
        (cache, resp.into_body(), drain)
    }

    /// The ConfigMap `pb/c2` at `rv` in JSON, the object `protobuf_write::tests::real`'s
    /// captured protobuf bytes are of.
    fn c2(rv: u64) -> CachedObject {
        let raw =
            format!(r#"{{"metadata":{{"name":"c2","namespace":"pb","resourceVersion":"{rv}"}}}}"#);
        CachedObject::parse(Bytes::from(raw), &configmaps()).unwrap()
    }

    async fn next(b: &mut Body) -> Option<String> {
        let f = b.frame().await?.unwrap();
        Some(String::from_utf8(f.into_data().unwrap().to_vec()).unwrap())
    }

    /// The bookmark 2 s before the deadline, then the end at the deadline (timings are
    /// lower bounds: neither may come early).
    // Paused time: the deadline and bookmark timers fire when the runtime is idle, without
    // waiting seconds of wall-clock time.
    #[tokio::test(start_paused = true)]
    async fn a_watch_bookmarks_before_its_deadline_and_ends_at_it() {
        let q = "watch=1&resourceVersion=1&allowWatchBookmarks=true&timeoutSeconds=3";
        let (cache, mut b, _drain) = watch(q, &WatchConfig::default()).await;
        let t0 = Instant::now();
        cache.apply(EventKind::Modified, cm(2));
        let e = next(&mut b).await.unwrap();
        assert!(e.starts_with("{\"type\":\"ADDED\""), "{e}");
        let bm = next(&mut b).await.unwrap();
        assert!(bm.contains("\"BOOKMARK\"") && bm.contains("\"resourceVersion\":\"2\""));
        assert!(t0.elapsed() >= Duration::from_millis(900));
        assert_eq!(next(&mut b).await, None);
        assert!(t0.elapsed() >= Duration::from_millis(2900));
        drop(b);
        assert_eq!(cache.hub.len(), 0, "the ended watch is unsubscribed");
    }

    /// Periodic bookmarks carry the progress; the drain ends a watch after what was queued
    /// and a bookmark at its progress (when it allows bookmarks); the hub closing a watcher
    /// ends its stream after what was queued.
    // Paused time: the deadline and bookmark timers fire when the runtime is idle, without
    // waiting seconds of wall-clock time.
    #[tokio::test(start_paused = true)]
    async fn a_watch_bookmarks_periodically_and_ends_on_drain_with_a_bookmark_or_hub_close() {
        let cfg = WatchConfig {
            bookmark_interval: Duration::from_millis(200),
            ..WatchConfig::default()
        };
        let q = "watch=1&resourceVersion=1&allowWatchBookmarks=true";
        let (cache, mut b, drain) = watch(q, &cfg).await;
        let t0 = Instant::now();
        cache.apply(EventKind::Modified, cm(2));
        assert!(next(&mut b).await.unwrap().contains("\"ADDED\""));
        for i in 1..=2 {
            let bm = next(&mut b).await.unwrap();
            assert!(bm.contains("\"BOOKMARK\"") && bm.contains("\"resourceVersion\":\"2\""));
            assert!(t0.elapsed() >= Duration::from_millis(200 * i - 20));
        }
        // The drain: what is queued, then a bookmark at the progress, then the end.
        cache.apply(EventKind::Modified, cm(3));
        while cache.hub.dispatched_rv() < 3 {
            tokio::task::yield_now().await;
        }
        drain.cancel();
        let last = next(&mut b).await.unwrap();
        let (ev, bm) = last.split_once('\n').unwrap();
        assert!(
            ev.contains("\"MODIFIED\"") && ev.contains("\"resourceVersion\":\"3\""),
            "{last}"
        );
        assert!(
            bm.contains("\"BOOKMARK\"") && bm.contains("\"resourceVersion\":\"3\""),
            "{last}"
        );
        assert_eq!(next(&mut b).await, None);

        // A watcher that does not allow bookmarks gets none at the drain.
        let drain = Drain::new();
        let resp = serve(
            cache.clone(),
            WatchParams::parse(Some("watch=1&resourceVersion=3")).unwrap(),
            Filter::default(),
            Encoding::Json,
            false,
            &cfg,
            drain.clone(),
        )
        .await
        .unwrap();
        let mut b = resp.into_body();
        drain.cancel();
        assert_eq!(next(&mut b).await, None);

        let (cache, mut b, _drain) = watch("watch=1&resourceVersion=1", &cfg).await;
        cache.apply(EventKind::Modified, cm(2));
        // The dispatcher queues the event before the hub closes the watcher.
        while cache.hub.dispatched_rv() < 2 {
            tokio::task::yield_now().await;
        }
        cache.hub.close_all(crate::cache::hub::CloseReason::Relist);
        assert!(
            next(&mut b)
                .await
                .unwrap()
                .contains("\"resourceVersion\":\"2\"")
        );
        assert_eq!(next(&mut b).await, None);
    }

    fn unhex(s: &str) -> Bytes {
        Bytes::from(
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect::<Vec<u8>>(),
        )
    }

    /// Splits a protobuf watch chunk into its frames: (type, object).
    fn proto_frames(mut b: &[u8]) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        while !b.is_empty() {
            let n = u32::from_be_bytes(b[..4].try_into().unwrap()) as usize;
            let ev = crate::k8s::protobuf::watch_event(&b[4..4 + n]).unwrap();
            out.push((ev.event_type.to_string(), ev.object.to_vec()));
            b = &b[4 + n..];
        }
        out
    }

    /// A protobuf watch from the cache: the starting state's envelopes as ADDED, the
    /// initial-events-end bookmark byte for byte as kube-apiserver wrote it (its template
    /// learnt from the protobuf side), a deletion as the last state at the deletion's
    /// resourceVersion, and an event whose envelope has not come held back until it comes.
    // Paused time: the wait below ends when the runtime is idle, not after wall-clock time.
    #[tokio::test(start_paused = true)]
    async fn a_protobuf_watch_is_the_apiservers_frames_each_sent_once_its_envelope_came() {
        use crate::k8s::protobuf_write::tests::real;
        use crate::k8s::protobuf_write::with_resource_version;
        let r = configmaps();
        let json = c2;
        let cache = ResourceCache::new(r.clone(), StoreConfig::default());
        cache.replace(vec![json(203)], 209);
        let get = unhex(real::GET_C2);
        let key = crate::cache::ObjectKey::new("pb", "c2");
        // Not synced: the apiserver serves protobuf watches.
        let q = "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true";
        let cfg = WatchConfig::default();
        let serve_pb = |cache: Arc<ResourceCache>| {
            serve(
                cache,
                WatchParams::parse(Some(q)).unwrap(),
                Filter::default(),
                Encoding::Json,
                true,
                &cfg,
                Drain::new(),
            )
        };
        assert!(serve_pb(cache.clone()).await.is_err());
        cache.attach_protobuf(&key, 203, get.clone());
        let bm = unhex(real::CM_BOOKMARK);
        let bm_object = proto_frames(&bm).remove(0).1;
        crate::cache::reflector::proto::ProtoSink::bookmark(&*cache, 209, true, bm_object.into());
        let resp = serve_pb(cache.clone()).await.unwrap();
        assert_eq!(resp.headers()[header::CONTENT_TYPE], PROTOBUF_STREAM);
        let mut b = resp.into_body();
        let first = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(proto_frames(&first), vec![("ADDED".into(), get.to_vec())]);
        let end = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(
            &end[..],
            &bm[..],
            "the apiserver's initial-events-end bookmark"
        );

        // A change whose envelope has not come is held back...
        cache.apply(EventKind::Modified, json(210));
        let held = tokio::time::timeout(Duration::from_secs(5), b.frame()).await;
        assert!(held.is_err(), "nothing is sent before the envelope");
        // ...and sent once it comes.
        let v210 = Bytes::from(with_resource_version(&get, "210").unwrap());
        cache.attach_protobuf(&key, 210, v210.clone());
        let f = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(proto_frames(&f), vec![("MODIFIED".into(), v210.to_vec())]);
        // A deletion without an envelope of its own: the last state at its resourceVersion.
        cache.apply(EventKind::Deleted, json(211));
        let f = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(
            proto_frames(&f),
            vec![(
                "DELETED".into(),
                with_resource_version(&get, "211").unwrap()
            )]
        );
    }

    /// A protobuf resume whose starting point holds a version older than the protobuf
    /// side's initial state and without its envelope (a history event from before the side
    /// started: after a cold restart, a backfilled stretch) goes to the apiserver at once:
    /// that envelope never comes. One whose missing envelope is of a version after the
    /// side's sync waits for it, as before, and is served from the cache once it comes.
    // Paused time: a wait would advance the clock by `PROTO_START_WAIT` without wall time.
    #[tokio::test(start_paused = true)]
    async fn a_protobuf_resume_waits_only_for_envelopes_that_can_still_come() {
        use crate::k8s::protobuf_write::tests::real;
        use crate::k8s::protobuf_write::with_resource_version;
        let r = configmaps();
        let json = c2;
        let get = unhex(real::GET_C2);
        let at = |rv: u64| Bytes::from(with_resource_version(&get, &rv.to_string()).unwrap());
        let key = crate::cache::ObjectKey::new("pb", "c2");
        let cache = ResourceCache::new(r.clone(), StoreConfig::default());
        cache.replace(vec![json(203)], 209);
        // 210 happened before the protobuf side started: only 211, the state it starts
        // from, gets an envelope; it syncs at 211.
        cache.apply(EventKind::Modified, json(210));
        cache.apply(EventKind::Modified, json(211));
        cache.want_protobuf();
        cache.attach_protobuf(&key, 211, at(211));
        let bm = unhex(real::CM_BOOKMARK);
        let bm_object = proto_frames(&bm).remove(0).1;
        crate::cache::reflector::proto::ProtoSink::bookmark(&*cache, 211, true, bm_object.into());
        assert!(cache.protobuf_ready());
        let cfg = WatchConfig::default();
        let resume = |from: u64| {
            let (cache, cfg) = (cache.clone(), cfg.clone());
            async move {
                let q = format!("watch=1&resourceVersion={from}&allowWatchBookmarks=true");
                serve(
                    cache,
                    WatchParams::parse(Some(&q)).unwrap(),
                    Filter::default(),
                    Encoding::Json,
                    true,
                    &cfg,
                    Drain::new(),
                )
                .await
            }
        };
        let t0 = Instant::now();
        assert!(resume(209).await.is_err(), "handed to the apiserver");
        assert_eq!(t0.elapsed(), Duration::ZERO, "at once, without waiting");

        // 212's envelope can still come: the resume waits for it and is served.
        cache.apply(EventKind::Modified, json(212));
        let waiting = tokio::spawn(resume(211));
        tokio::task::yield_now().await;
        assert!(
            !waiting.is_finished(),
            "the resume waits for 212's envelope"
        );
        cache.attach_protobuf(&key, 212, at(212));
        let resp = waiting.await.unwrap().expect("served from the cache");
        let mut b = resp.into_body();
        let f = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(
            proto_frames(&f),
            vec![("MODIFIED".into(), at(212).to_vec())]
        );
    }

    /// What moves a passed-through watch home (`serve::homing`): a resume the cache would
    /// serve at once. Not before the cache has synced or reached the resourceVersion, never
    /// from before its history (that would cost a backfill or a 410), and in protobuf only
    /// when every envelope after it is there or can still come.
    #[tokio::test]
    async fn a_resume_is_the_caches_once_it_holds_the_resource_version_and_its_envelopes() {
        use crate::k8s::protobuf_write::tests::real;
        use crate::k8s::protobuf_write::with_resource_version;
        let json = c2;
        let get = unhex(real::GET_C2);
        let at = |rv: u64| Bytes::from(with_resource_version(&get, &rv.to_string()).unwrap());
        let key = crate::cache::ObjectKey::new("pb", "c2");
        let cache = ResourceCache::new(configmaps(), StoreConfig::default());
        assert!(!resumable(&cache, 209, false, false), "not synced");
        cache.replace(vec![json(203)], 209);
        assert!(resumable(&cache, 209, false, false));
        assert!(!resumable(&cache, 210, false, false), "not reached");
        assert!(
            !resumable(&cache, 208, false, false),
            "older than the history"
        );
        assert!(!resumable(&cache, 0, false, false));
        // 210 happened before the protobuf side started: its envelope never comes.
        cache.apply(EventKind::Modified, json(210));
        cache.apply(EventKind::Modified, json(211));
        assert!(resumable(&cache, 209, false, false));
        assert!(!resumable(&cache, 211, true, false), "no protobuf side");
        cache.want_protobuf();
        cache.attach_protobuf(&key, 211, at(211));
        let bm = unhex(real::CM_BOOKMARK);
        let bm_object = proto_frames(&bm).remove(0).1;
        crate::cache::reflector::proto::ProtoSink::bookmark(&*cache, 211, true, bm_object.into());
        assert!(
            !resumable(&cache, 209, true, false),
            "210's envelope never comes"
        );
        assert!(resumable(&cache, 210, true, false));
        assert!(resumable(&cache, 211, true, true), "metadata too");
        // 212's envelope is still to come (after the side's start): served once it does.
        cache.apply(EventKind::Modified, json(212));
        assert!(resumable(&cache, 211, true, false));
        // A backfilled stretch's envelopes, attached to its events, make it resumable.
        cache.attach_protobuf(&key, 210, at(210));
        assert!(resumable(&cache, 209, true, false));
    }

    /// A watch that came while the cache was starting (right after the proxy started) waits
    /// for the sync and is served from the cache, whatever its start (a resume, a
    /// WatchList); without a sync within the wait it is asked to come back (429 "storage is
    /// (re)initializing" with `Retry-After`, as from kube-apiserver's initializing watch
    /// cache), not handed to the apiserver, where it would stay. The same for a starting
    /// protobuf side. A side that is not coming at all sends the watch to the apiserver at
    /// once.
    // Paused time: the bounded wait expires when the runtime is idle.
    #[tokio::test(start_paused = true)]
    async fn a_watch_while_the_cache_is_starting_waits_for_its_sync_or_is_asked_to_retry() {
        let q = "watch=1&resourceVersion=5&allowWatchBookmarks=true";
        let cfg = WatchConfig::default();
        let watch = |cache: Arc<ResourceCache>, q: &'static str, protobuf: bool| {
            let cfg = cfg.clone();
            async move {
                serve(
                    cache,
                    WatchParams::parse(Some(q)).unwrap(),
                    Filter::default(),
                    Encoding::Json,
                    protobuf,
                    &cfg,
                    Drain::new(),
                )
                .await
            }
        };
        let refused_429 = |r: Served| match r {
            Err(crate::read::NotServed::Refuse(s)) => {
                assert_eq!(s.code(), 429, "{s:?}");
                assert_eq!(s.message(), "storage is (re)initializing");
                let resp = s.into_response();
                assert_eq!(resp.headers()["retry-after"], "1");
            }
            Err(crate::read::NotServed::Delegate(why)) => panic!("handed to the apiserver: {why}"),
            Ok(_) => panic!("served"),
        };

        // Synced while the resume waits: served from the cache, from its resourceVersion.
        let cache = ResourceCache::new(configmaps(), StoreConfig::default());
        assert!(cache.starting());
        let waiting = tokio::spawn(watch(cache.clone(), q, false));
        // ...and a WatchList (initial events) likewise.
        let list_q = "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&resourceVersion=0";
        let waiting_list = tokio::spawn(watch(cache.clone(), list_q, false));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the resume waits for the sync");
        assert!(!waiting_list.is_finished(), "the WatchList waits too");
        cache.replace(Vec::new(), 5);
        let resp = waiting.await.unwrap().expect("served from the cache");
        assert_eq!(resp.status(), http::StatusCode::OK);
        let mut b = resp.into_body();
        cache.apply(EventKind::Added, cm(6));
        let e = next(&mut b).await.unwrap();
        assert!(
            e.starts_with("{\"type\":\"ADDED\"") && e.contains("\"resourceVersion\":\"6\""),
            "{e}"
        );
        let resp = waiting_list.await.unwrap().expect("served from the cache");
        assert_eq!(resp.status(), http::StatusCode::OK);

        // Not synced within the wait: 429, after the wait.
        let cold = ResourceCache::new(configmaps(), StoreConfig::default());
        let t0 = Instant::now();
        refused_429(watch(cold.clone(), q, false).await);
        assert!(t0.elapsed() >= cfg.wait_for_rv, "after the wait");
        refused_429(watch(cold, list_q, false).await);

        // A protobuf watch while the protobuf side (started with the resource, or by the
        // first protobuf reader) has not synced: the same wait, then 429.
        cache.want_protobuf();
        assert!(cache.protobuf_coming());
        let t0 = Instant::now();
        refused_429(watch(cache.clone(), q, true).await);
        assert!(t0.elapsed() >= cfg.wait_for_rv);
        // With no protobuf side coming (not started, or protobuf off), the apiserver serves
        // it at once.
        let other = ResourceCache::new(configmaps(), StoreConfig::default());
        other.replace(Vec::new(), 5);
        let t0 = Instant::now();
        assert!(
            matches!(
                watch(other, q, true).await,
                Err(crate::read::NotServed::Delegate("protobuf side not synced"))
            ),
            "handed to the apiserver"
        );
        assert!(t0.elapsed() < cfg.wait_for_rv);
    }

    #[test]
    fn watch_params_accept_what_clients_send() {
        let p = WatchParams::parse(Some("watch=1&resourceVersion=5&allowWatchBookmarks=true&timeoutSeconds=300&labelSelector=app%3Da")).unwrap();
        assert_eq!(p.resource_version.as_deref(), Some("5"));
        assert!(p.allow_bookmarks);
        assert_eq!(p.timeout, Some(Duration::from_secs(300)));
        assert_eq!(p.label_selector, "app=a");
        let p = WatchParams::parse(Some("watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true")).unwrap();
        assert_eq!(p.send_initial_events, Some(true));
    }

    #[test]
    fn invalid_or_unknown_watch_params_are_left_to_the_apiserver() {
        for q in [
            "watch=1&sendInitialEvents=true",
            "watch=1&resourceVersionMatch=NotOlderThan",
            "watch=1&resourceVersionMatch=Exact&resourceVersion=5",
            "watch=1&resourceVersion=abc",
            "watch=1&timeoutSeconds=-1",
            "watch=1&pretty=true",
            "watch=maybe",
        ] {
            assert_eq!(WatchParams::parse(Some(q)), None, "{q}");
        }
    }

    #[test]
    fn a_single_frame_is_written_without_a_copy_and_several_are_joined() {
        let f = Bytes::from(vec![b'x'; 1 << 20]);
        let mut b = Batch::default();
        b.push(f.clone());
        assert_eq!(b.finish().unwrap().as_ptr(), f.as_ptr());
        let mut b = Batch::default();
        b.push(Bytes::from_static(b"a\n"));
        b.push(Bytes::from_static(b"b\n"));
        b.push(Bytes::from_static(b"c\n"));
        assert_eq!(b.len(), 6);
        assert_eq!(b.finish().unwrap(), "a\nb\nc\n");
        assert!(Batch::default().finish().is_none());
    }
}
