//! Byte budgets for what responses have produced and the client's socket has not taken.
//!
//! A response body (a watch's initial state, a list page) can produce bytes faster than the
//! client reads them. HTTP/2 buffers them per stream (up to `server.http2MaxSendBufferBytes`
//! while the client's flow-control window is open), so a client that opens many streams with
//! large windows and never reads its socket made the proxy hold every stream's initial state:
//! 10 connections × 1,000 watches of a 250 KB namespace took 2.5–3.8 GB (issue 23, point 5).
//!
//! Two budgets bound those bytes; both count a response's data when its body hands it to the
//! protocol and release it when the connection's writer ([`crate::http::coalesce`]) hands
//! bytes to the socket (TLS included, which holds at most rustls' buffer more):
//!
//! - [`Conn`] (`server.connectionBufferBytes`): once a connection holds its budget, its
//!   response bodies wait (`Pending`) instead of producing more, and are woken when the
//!   writer has drained half of it. Every waiting stream is woken at once and they take
//!   turns in the connection's poll order, so one busy stream cannot hold the others back
//!   for longer than its one chunk. Bytes the socket could take but that HTTP/2 flow control
//!   holds (a stream whose window the client does not open keeps at most the rest of one
//!   chunk, 256 KiB for a watch's initial state) are not the socket's fault: when the
//!   connection's writer has written everything it was given, up to [`SET_ASIDE_BUDGETS`]
//!   budgets of what is still counted are set aside ([`Conn::writer_idle`]), so a
//!   connection's other streams go on while some of its streams are blocked by their windows.
//!   The process budget still counts them.
//! - [`Downstream`] (`server.downstreamBufferBytes`), process-wide: once the sum over all
//!   connections reaches it, a connection that already holds [`PROCESS_FLOOR`] bytes waits
//!   too, until some connection drains; a connection below the floor always proceeds, so
//!   slow clients together cannot stop everyone else. The sum is the gauge
//!   `kube_cache_proxy_downstream_buffered_bytes`; waits are counted in
//!   `kube_cache_proxy_downstream_buffer_waits_total{budget}`.
//!
//! A budget is checked before a body is polled, so a connection exceeds it by at most the
//! last chunk produced (a watch's initial chunk is at most 256 KiB plus one object).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use crate::http::body::{Body, BoxError};

/// A connection holding less than this may produce even when the process budget is spent:
/// one watch's initial chunk (256 KiB) fits, so every connection keeps moving.
pub const PROCESS_FLOOR: u64 = 256 * 1024;

/// How many connection budgets of bytes held by flow control (not by the socket) may be set
/// aside: with the default 4 MiB budget, 64 streams blocked by their windows with a whole
/// watch chunk each.
pub const SET_ASIDE_BUDGETS: u64 = 4;

/// The process-wide budget, shared by every connection of every listener.
#[derive(Debug)]
pub struct Downstream {
    limit: u64,
    conn_limit: u64,
    /// The sum of every connection's buffered bytes.
    buffered: Gauge,
    waits_connection: Counter,
    waits_process: Counter,
    has_waiters: AtomicBool,
    waiters: Mutex<Vec<Waker>>,
}

impl Downstream {
    /// `limit`: `server.downstreamBufferBytes`; `conn_limit`: `server.connectionBufferBytes`.
    pub fn new(
        limit: u64,
        conn_limit: u64,
        buffered: Gauge,
        waits_connection: Counter,
        waits_process: Counter,
    ) -> Downstream {
        Downstream {
            limit,
            conn_limit,
            buffered,
            waits_connection,
            waits_process,
            has_waiters: AtomicBool::new(false),
            waiters: Mutex::new(Vec::new()),
        }
    }

    /// Bytes held for all connections now.
    pub fn buffered(&self) -> u64 {
        u64::try_from(self.buffered.get()).unwrap_or(0)
    }

    fn add(&self, n: u64) {
        self.buffered.inc_by(i64::try_from(n).unwrap_or(i64::MAX));
    }

    fn sub(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.buffered.dec_by(i64::try_from(n).unwrap_or(i64::MAX));
        if self.has_waiters.load(Ordering::Acquire) && self.buffered() < self.limit {
            let waiters = {
                let mut w = self.waiters.lock();
                self.has_waiters.store(false, Ordering::Release);
                std::mem::take(&mut *w)
            };
            // Woken outside the lock: a waker may run code that registers again.
            for w in waiters {
                w.wake();
            }
        }
    }

    fn wait(&self, waker: &Waker) {
        let mut w = self.waiters.lock();
        if !w.iter().any(|x| x.will_wake(waker)) {
            w.push(waker.clone());
        }
        self.has_waiters.store(true, Ordering::Release);
    }
}

/// One connection's budget; see the module docs.
#[derive(Debug)]
pub struct Conn {
    process: Arc<Downstream>,
    state: Mutex<ConnState>,
}

#[derive(Debug, Default)]
struct ConnState {
    /// Produced by this connection's bodies and not yet taken by its socket.
    buffered: u64,
    /// Part of `buffered` set aside by [`Conn::writer_idle`]: held by flow control, not by
    /// the socket.
    set_aside: u64,
    waiters: Vec<Waker>,
}

impl ConnState {
    fn counted(&self) -> u64 {
        self.buffered - self.set_aside
    }
}

/// Which budget a body waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    Connection,
    Process,
}

impl Conn {
    pub fn new(process: Arc<Downstream>) -> Conn {
        Conn {
            process,
            state: Mutex::new(ConnState::default()),
        }
    }

    /// Bytes this connection holds now.
    pub fn buffered(&self) -> u64 {
        self.state.lock().buffered
    }

    /// `Ok` when a body of this connection may produce; otherwise it is registered to be
    /// woken and must return `Pending`.
    fn admit(&self, cx: &Context<'_>) -> Result<(), Wait> {
        let mut s = self.state.lock();
        if s.counted() >= self.process.conn_limit {
            if !s.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                s.waiters.push(cx.waker().clone());
            }
            return Err(Wait::Connection);
        }
        if s.buffered >= PROCESS_FLOOR && self.process.buffered() >= self.process.limit {
            drop(s);
            self.process.wait(cx.waker());
            // Drained between the check and the registration: no wake would come.
            if self.process.buffered() < self.process.limit {
                cx.waker().wake_by_ref();
            }
            return Err(Wait::Process);
        }
        Ok(())
    }

    fn produced(&self, n: u64) {
        self.state.lock().buffered += n;
        self.process.add(n);
    }

    /// The socket took `n` bytes (frame headers and response heads included, which were
    /// never counted: the count errs towards zero).
    pub fn written(&self, n: usize) {
        let (released, waiters) = {
            let mut s = self.state.lock();
            let released = (n as u64).min(s.buffered);
            s.buffered -= released;
            s.set_aside = s.set_aside.min(s.buffered);
            let waiters = if s.counted() <= self.process.conn_limit / 2 {
                std::mem::take(&mut s.waiters)
            } else {
                Vec::new()
            };
            (released, waiters)
        };
        self.process.sub(released);
        for w in waiters {
            w.wake();
        }
    }

    /// The writer has handed the socket everything the protocol gave it: what is still
    /// counted waits for flow control (the client's windows), not for the socket. Up to
    /// [`SET_ASIDE_BUDGETS`] budgets of it are set aside so the connection's other streams
    /// are not starved by streams their client does not read.
    pub fn writer_idle(&self) {
        let cap = self.process.conn_limit.saturating_mul(SET_ASIDE_BUDGETS);
        let waiters = {
            let mut s = self.state.lock();
            if s.buffered == 0 || s.set_aside == s.buffered.min(cap) {
                return;
            }
            s.set_aside = s.buffered.min(cap);
            std::mem::take(&mut s.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The connection is gone, and with it whatever its protocol still held.
        let left = self.state.get_mut().buffered;
        self.process.sub(left);
    }
}

pin_project_lite::pin_project! {
    /// A response body that waits while its connection's budget (or the process's) is spent.
    pub struct Budgeted {
        #[pin]
        inner: Body,
        conn: Arc<Conn>,
        waiting: Option<Wait>,
    }
}

impl Budgeted {
    /// Not boxed: the connection holds it inline in each stream's state, so a watch frame
    /// goes through one box (the response's) rather than two, and an open stream costs one
    /// allocation less.
    pub fn wrap(inner: Body, conn: Arc<Conn>) -> Budgeted {
        Budgeted {
            inner,
            conn,
            waiting: None,
        }
    }
}

impl http_body::Body for Budgeted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if let Err(w) = this.conn.admit(cx) {
            // Counted once per wait, not per poll.
            if *this.waiting != Some(w) {
                match w {
                    Wait::Connection => this.conn.process.waits_connection.inc(),
                    Wait::Process => this.conn.process.waits_process.inc(),
                };
                *this.waiting = Some(w);
            }
            return Poll::Pending;
        }
        *this.waiting = None;
        let r = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &r
            && let Some(d) = f.data_ref()
        {
            this.conn.produced(d.len() as u64);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;

    fn downstream(limit: u64, conn_limit: u64) -> Arc<Downstream> {
        Arc::new(Downstream::new(
            limit,
            conn_limit,
            Gauge::default(),
            Counter::default(),
            Counter::default(),
        ))
    }

    /// A body of `n` chunks of `size` bytes.
    fn chunks(n: usize, size: usize) -> Body {
        let s = futures_util::stream::iter((0..n).map(move |_| {
            Ok::<_, BoxError>(http_body::Frame::data(Bytes::from(vec![b'x'; size])))
        }));
        crate::http::body::boxed(http_body_util::StreamBody::new(s))
    }

    fn poll<B>(b: &mut B) -> Poll<Option<usize>>
    where
        B: http_body::Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Display,
    {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(b).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(f))) => {
                Poll::Ready(Some(f.into_data().map(|d| d.len()).unwrap_or(0)))
            }
            Poll::Ready(Some(Err(e))) => panic!("{e}"),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    #[test]
    fn a_body_waits_once_its_connection_holds_the_budget_and_resumes_when_drained() {
        let d = downstream(1 << 30, 100);
        let conn = Arc::new(Conn::new(d.clone()));
        let mut b = Budgeted::wrap(chunks(10, 40), conn.clone());
        assert_eq!(poll(&mut b), Poll::Ready(Some(40)));
        assert_eq!(poll(&mut b), Poll::Ready(Some(40)));
        assert_eq!(poll(&mut b), Poll::Ready(Some(40)));
        // 120 >= 100: over budget by at most the last chunk.
        assert_eq!(poll(&mut b), Poll::Pending);
        assert_eq!(d.buffered(), 120);
        assert_eq!(d.waits_connection.get(), 1);
        assert_eq!(poll(&mut b), Poll::Pending);
        assert_eq!(
            d.waits_connection.get(),
            1,
            "one wait, however often polled"
        );
        conn.written(30);
        assert_eq!(poll(&mut b), Poll::Ready(Some(40)));
        assert_eq!(d.buffered(), 130);
        drop(b);
        drop(conn);
        assert_eq!(d.buffered(), 0, "a closed connection releases what it held");
    }

    #[test]
    fn the_waiting_streams_are_woken_when_the_writer_drains_half() {
        struct Flag(std::sync::atomic::AtomicUsize);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let d = downstream(1 << 30, 100);
        let conn = Arc::new(Conn::new(d.clone()));
        let mut b = Budgeted::wrap(chunks(10, 100), conn.clone());
        let flag = Arc::new(Flag(Default::default()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut b).poll_frame(&mut cx).is_ready());
        assert!(Pin::new(&mut b).poll_frame(&mut cx).is_pending());
        conn.written(10);
        assert_eq!(
            flag.0.load(Ordering::SeqCst),
            0,
            "90 left: not half drained"
        );
        conn.written(40);
        assert_eq!(flag.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn bytes_held_by_flow_control_are_set_aside_when_the_writer_is_idle() {
        let d = downstream(1 << 30, 100);
        let conn = Arc::new(Conn::new(d.clone()));
        let mut b = Budgeted::wrap(chunks(10, 100), conn.clone());
        assert!(poll(&mut b).is_ready());
        assert!(poll(&mut b).is_pending());
        for held in 2..=SET_ASIDE_BUDGETS + 1 {
            conn.writer_idle();
            assert!(poll(&mut b).is_ready(), "the other streams go on");
            assert!(poll(&mut b).is_pending());
            assert_eq!(d.buffered(), held * 100, "the process still counts them");
        }
        conn.writer_idle();
        assert!(
            poll(&mut b).is_pending(),
            "at most {SET_ASIDE_BUDGETS} budgets are set aside"
        );
    }

    #[test]
    fn the_process_budget_stops_connections_above_the_floor_only() {
        let floor = PROCESS_FLOOR as usize;
        let d = downstream(2 * PROCESS_FLOOR, 1 << 30);
        let big = Arc::new(Conn::new(d.clone()));
        let mut b = Budgeted::wrap(chunks(10, floor), big.clone());
        assert!(poll(&mut b).is_ready());
        assert!(poll(&mut b).is_ready());
        assert!(poll(&mut b).is_pending());
        assert_eq!(d.waits_process.get(), 1);
        let small = Arc::new(Conn::new(d.clone()));
        let mut s = Budgeted::wrap(chunks(2, 10), small.clone());
        assert!(poll(&mut s).is_ready(), "below the floor: never stopped");
        big.written(floor);
        assert!(poll(&mut b).is_ready());
        let mut rest = 0;
        while let Poll::Ready(Some(n)) = poll(&mut s) {
            rest += n;
        }
        assert_eq!(rest, 10);
        drop((b, s, big, small));
        assert_eq!(d.buffered(), 0);
    }
}
