//! Write coalescing for one server connection: everything the protocol writes during a poll
//! of the connection (and of its HTTP/2 streams, which run in the same task:
//! [`crate::http::local_streams`]) leaves in one write.
//!
//! hyper's HTTP/2 codec hands every DATA frame larger than 256 bytes to the socket as its own
//! write and flushes after each one, so a watch event fanned out to the 250 streams of one
//! connection cost 250 `send` calls, and the kernel's per-segment work dominated the proxy's
//! CPU (`cargo bench --bench fanout`, 10,000 HTTP/2 watchers: about half of the proxy's CPU
//! in `sendto`). A plain `BufWriter` cannot help: the codec flushes it after every frame.
//!
//! Here the connection's future is wrapped by [`Driven`] and its IO by [`CoalescedIo`], which
//! share one buffer:
//!
//! - writes go into the buffer (a write at least as large as the buffer, with the buffer
//!   empty, goes straight through);
//! - a flush *during a poll of the connection* only marks the end of the protocol's batch;
//!   [`Driven`] writes the buffer out when that poll returns;
//! - when a poll wrote something, the buffer is not full and the connection has several
//!   HTTP/2 streams ([`Batching`]; a single response has nothing to wait for), [`Driven`]
//!   first yields (wakes itself and returns, which puts the connection at the back of the
//!   run queue), so the hub, still pushing a fan-out's event to other watchers, reaches more
//!   of this connection's streams before the one write; it yields again while each pass
//!   adds to the batch, at most `MAX_YIELDS` times;
//! - outside a poll of the connection (an upgraded connection's IO, used by another task
//!   after the connection future ended) a flush is a real flush.
//!
//! Nothing is left in the buffer: every poll that buffered bytes either writes them before
//! returning or has woken the connection to do it on the next poll, and shutdown writes
//! everything first. A write error met by [`Driven`] is kept and returned by the next read,
//! write or flush, so the protocol sees it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::http::budget::Conn;

/// Writes handed to connections' sockets by this process (each one system call), for the
/// fan-out bench's writes-per-delivery figure.
static SOCKET_WRITES: AtomicU64 = AtomicU64::new(0);

/// The number of socket writes made through [`CoalescedIo`] so far in this process.
pub fn socket_writes() -> u64 {
    SOCKET_WRITES.load(Ordering::Relaxed)
}

fn counted<T>(r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
    if let Poll::Ready(Ok(_)) = r {
        SOCKET_WRITES.fetch_add(1, Ordering::Relaxed);
    }
    r
}

/// Passes through the run queue a growing batch may wait for before it is written out. A
/// pass costs microseconds on an idle proxy (a batch that stops growing leaves on the next
/// pass); during a fan-out to thousands of streams it is about the time the other
/// connections take to encode their own batches, and the batch is written out earlier when
/// it reaches [`CAPACITY`]. Measured with `cargo bench --bench fanout` (10,000 watchers on
/// 40 connections): 0 passes gave 0.5 socket writes per delivery and a p99 near 85 ms;
/// 16 gave 0.03 and 27–35 ms; 32 was no better than 16.
const MAX_YIELDS: u32 = 16;

/// Bytes gathered before a write is forced. Large enough to hold one event for every stream
/// of a busy HTTP/2 connection several times over; allocated whole once a batch passes 4 KiB,
/// released when it empties.
pub const CAPACITY: usize = 64 * 1024;

/// A buffer up to this size (one response's head and a small body) grows as a `Vec` does and
/// is kept between batches; a larger one is released when it empties.
const SMALL: usize = 4096;

struct Shared<S> {
    io: S,
    buf: Vec<u8>,
    /// Bytes of `buf` already written.
    sent: usize,
    /// The connection future is being polled: flushes wait for the end of the poll.
    in_poll: bool,
    /// The protocol asked for a flush that is still to be done. The socket's own flush
    /// matters even when this buffer is empty: a TLS stream holds records it could not write
    /// yet, including those of writes that bypassed this buffer.
    flush_wanted: bool,
    /// Consecutive polls that yielded instead of writing the buffer out.
    yields: u32,
    /// `pending()` when the connection last yielded: a poll that adds nothing ends the batch.
    pending_at_yield: usize,
    /// A write error met while flushing after a poll, for the protocol to see.
    failed: Option<io::ErrorKind>,
    /// Told of every byte the socket takes ([`crate::http::budget`]).
    budget: Option<Arc<Conn>>,
}

impl<S: AsyncWrite + Unpin> Shared<S> {
    fn pending(&self) -> usize {
        self.buf.len() - self.sent
    }

    /// Counts a write the socket accepted (`n` bytes).
    fn wrote(&self, r: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        let r = counted(r);
        if let (Poll::Ready(Ok(n)), Some(b)) = (&r, &self.budget) {
            b.written(*n);
        }
        r
    }

    fn take_error(&mut self) -> io::Result<()> {
        match self.failed {
            Some(kind) => Err(io::Error::new(kind, "connection write failed")),
            None => Ok(()),
        }
    }

    /// Makes `buf` hold `len` more bytes. Past [`SMALL`] it grows straight to [`CAPACITY`]
    /// (`poll_room` keeps a batch within it): growing a fan-out's batch by doubling copied
    /// it again at each step, about 5% of the proxy's CPU in a fan-out of 5 KB events
    /// (`perf` of the load driver's `pb-fanout`: `memmove` under `RawVec::finish_grow`).
    fn make_room(&mut self, len: usize) {
        let need = self.buf.len() + len;
        if need > self.buf.capacity() && need > SMALL {
            self.buf.reserve_exact(CAPACITY.max(need) - self.buf.len());
        }
    }

    fn buffer(&mut self, data: &[u8]) {
        self.make_room(data.len());
        self.buf.extend_from_slice(data);
    }

    /// Writes the buffer out; releases its memory once it is empty.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.buf.len() {
            let r = Pin::new(&mut self.io).poll_write(cx, &self.buf[self.sent..]);
            let n = ready!(self.wrote(r))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.sent = 0;
        if self.buf.capacity() > SMALL {
            self.buf = Vec::new();
        } else {
            self.buf.clear();
        }
        Poll::Ready(Ok(()))
    }

    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        ready!(Pin::new(&mut self.io).poll_flush(cx))?;
        self.flush_wanted = false;
        Poll::Ready(Ok(()))
    }

    /// `poll_write_out` from `Driven`: an error is kept for the protocol, which learns of it
    /// on its next IO call.
    fn write_out_after_poll(&mut self, cx: &mut Context<'_>) {
        if self.failed.is_some() {
            return;
        }
        if let Poll::Ready(Err(e)) = self.poll_write_out(cx) {
            self.failed = Some(e.kind());
            cx.waker().wake_by_ref();
        }
    }
}

/// The connection's IO; see the module docs.
pub struct CoalescedIo<S>(Arc<Mutex<Shared<S>>>);

/// The connection's future, writing out what each of its polls buffered; see the module docs.
pub struct Driven<F: Future, S> {
    fut: F,
    shared: Arc<Mutex<Shared<S>>>,
    done: Option<F::Output>,
}

// The future is `Unpin` and the output is never pinned.
impl<F: Future + Unpin, S> Unpin for Driven<F, S> {}

/// Wraps `io`; the connection future built over the returned IO must be run through
/// [`Coalescing::drive`].
pub fn coalesce<S>(io: S) -> (CoalescedIo<S>, Coalescing<S>) {
    coalesce_counted(io, None)
}

/// [`coalesce`], telling `budget` of every byte the socket takes and when the writer is idle.
pub fn coalesce_counted<S>(io: S, budget: Option<Arc<Conn>>) -> (CoalescedIo<S>, Coalescing<S>) {
    let shared = Arc::new(Mutex::new(Shared {
        io,
        buf: Vec::new(),
        sent: 0,
        in_poll: false,
        flush_wanted: false,
        yields: 0,
        pending_at_yield: 0,
        failed: None,
        budget,
    }));
    (CoalescedIo(shared.clone()), Coalescing(shared))
}

/// The other half of [`coalesce`].
pub struct Coalescing<S>(Arc<Mutex<Shared<S>>>);

/// Whether anything besides the poll that just wrote may add to the batch before it leaves:
/// other streams of an HTTP/2 connection may, a single response (every HTTP/1.1 request, a
/// lone HTTP/2 stream) may not, and waiting for it would only delay its bytes.
pub trait Batching {
    fn batches(&self) -> bool;
}

impl<F> Batching for crate::http::local_streams::WithStreams<F> {
    fn batches(&self) -> bool {
        self.streams() > 1
    }
}

/// Any other connection future (tests): other tasks may add to its batch.
impl<T: ?Sized> Batching for Pin<Box<T>> {
    fn batches(&self) -> bool {
        true
    }
}

impl<S> Coalescing<S> {
    pub fn drive<F: Future + Unpin + Batching>(self, fut: F) -> Driven<F, S> {
        Driven {
            fut,
            shared: self.0,
            done: None,
        }
    }
}

fn lock<S>(m: &Mutex<Shared<S>>) -> MutexGuard<'_, Shared<S>> {
    // No poisoning: a panic while holding the lock cannot leave the buffer inconsistent in a
    // way that matters more than the panic itself; keep serving the other side.
    m.lock()
}

impl<F: Future + Unpin + Batching, S: AsyncWrite + Unpin> Future for Driven<F, S> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        if this.done.is_none() {
            lock(&this.shared).in_poll = true;
            let r = Pin::new(&mut this.fut).poll(cx);
            lock(&this.shared).in_poll = false;
            if let Poll::Ready(v) = r {
                this.done = Some(v);
            }
        }
        let mut g = lock(&this.shared);
        if this.done.is_none() {
            if g.pending() > 0 {
                let growing = g.yields == 0 || g.pending() > g.pending_at_yield;
                if growing && g.yields < MAX_YIELDS && g.pending() < CAPACITY && this.fut.batches()
                {
                    // Let the streams the fan-out is still waking queue their frames first:
                    // the batch grows while each pass through the run queue adds to it.
                    g.yields += 1;
                    g.pending_at_yield = g.pending();
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                g.yields = 0;
                g.write_out_after_poll(cx);
            } else if g.flush_wanted {
                g.write_out_after_poll(cx);
            }
            if g.pending() == 0
                && !g.flush_wanted
                && g.failed.is_none()
                && let Some(b) = &g.budget
            {
                // Everything the protocol wrote reached the socket: what the connection's
                // budget still counts is held by flow control.
                b.writer_idle();
            }
            return Poll::Pending;
        }
        g.yields = 0;
        // Whatever the last poll wrote goes out before the connection counts as ended.
        if g.failed.is_none() && g.poll_write_out(cx).is_pending() {
            return Poll::Pending;
        }
        drop(g);
        match this.done.take() {
            Some(v) => Poll::Ready(v),
            None => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for CoalescedIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut g = lock(&self.0);
        g.take_error()?;
        Pin::new(&mut g.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> CoalescedIo<S> {
    /// Makes room for `len` more bytes: writes the buffer out first if they would not fit.
    /// `Ready(true)` when the bytes should go straight to the socket instead.
    fn poll_room(g: &mut Shared<S>, cx: &mut Context<'_>, len: usize) -> Poll<io::Result<bool>> {
        g.take_error()?;
        if g.pending() > 0 && g.pending() + len > CAPACITY {
            ready!(g.poll_drain(cx))?;
        }
        Poll::Ready(Ok(g.pending() == 0 && len >= CAPACITY))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for CoalescedIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut g = lock(&self.0);
        if ready!(Self::poll_room(&mut g, cx, data.len()))? {
            let r = Pin::new(&mut g.io).poll_write(cx, data);
            return g.wrote(r);
        }
        g.buffer(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total = bufs.iter().map(|b| b.len()).sum::<usize>();
        let mut g = lock(&self.0);
        if ready!(Self::poll_room(&mut g, cx, total))? {
            let r = Pin::new(&mut g.io).poll_write_vectored(cx, bufs);
            return g.wrote(r);
        }
        g.make_room(total);
        for b in bufs {
            g.buf.extend_from_slice(b);
        }
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut g = lock(&self.0);
        g.take_error()?;
        if g.in_poll {
            // `Driven` writes the batch out (and flushes the socket) when this poll of the
            // connection returns.
            g.flush_wanted = true;
            return Poll::Ready(Ok(()));
        }
        g.poll_write_out(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut g = lock(&self.0);
        g.take_error()?;
        ready!(g.poll_drain(cx))?;
        Pin::new(&mut g.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::AsyncWriteExt;

    /// A socket that records each write it accepts.
    #[derive(Clone, Default)]
    struct Recorder {
        writes: Arc<Mutex<Vec<Vec<u8>>>>,
        flushes: Arc<AtomicUsize>,
        /// Accept at most this many bytes per write (0: all).
        max: usize,
        /// Like a TLS stream: hold what is written in `staged` until flushed.
        stage: bool,
        staged: Arc<Mutex<Vec<u8>>>,
    }

    impl AsyncRead for Recorder {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Pending
        }
    }

    impl AsyncWrite for Recorder {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            data: &[u8],
        ) -> Poll<io::Result<usize>> {
            let n = if self.max == 0 {
                data.len()
            } else {
                data.len().min(self.max)
            };
            if self.stage {
                self.staged.lock().extend_from_slice(&data[..n]);
            } else {
                self.writes.lock().push(data[..n].to_vec());
            }
            Poll::Ready(Ok(n))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.flushes.fetch_add(1, Ordering::Relaxed);
            let staged = std::mem::take(&mut *self.staged.lock());
            if !staged.is_empty() {
                self.writes.lock().push(staged);
            }
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn joined(r: &Recorder) -> Vec<u8> {
        r.writes.lock().concat()
    }

    /// Waits (bounded, for hangs only) until `len` bytes have reached the socket.
    async fn wait_for_bytes(r: &Recorder, len: usize) {
        for _ in 0..200 {
            if joined(r).len() >= len {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// A batch past [`SMALL`] gets its whole [`CAPACITY`] at once and is not moved again
    /// while it fills (growing by doubling copied it at every step); a small one stays
    /// small; a large one is released once written out.
    #[tokio::test]
    async fn a_batch_grows_to_capacity_in_one_step() {
        let rec = Recorder::default();
        let (mut io, _driver) = coalesce(rec.clone());
        let frame = [5u8; 1000];
        for _ in 0..4 {
            io.write_all(&frame).await.unwrap();
        }
        let small = lock(&io.0).buf.capacity();
        assert!(small <= SMALL, "4,000 bytes in a small buffer, got {small}");
        io.write_all(&frame).await.unwrap();
        let (cap, at) = {
            let g = lock(&io.0);
            (g.buf.capacity(), g.buf.as_ptr())
        };
        assert_eq!(cap, CAPACITY);
        for _ in 5..CAPACITY / frame.len() {
            io.write_all(&frame).await.unwrap();
        }
        {
            let g = lock(&io.0);
            assert_eq!(g.pending(), CAPACITY / frame.len() * frame.len());
            assert_eq!(
                (g.buf.capacity(), g.buf.as_ptr()),
                (cap, at),
                "moved while filling"
            );
        }
        assert!(
            joined(&rec).is_empty(),
            "nothing written before the batch is full"
        );
        io.flush().await.unwrap();
        assert_eq!(joined(&rec).len(), CAPACITY / frame.len() * frame.len());
        assert_eq!(lock(&io.0).buf.capacity(), 0, "a large buffer is released");
    }

    /// Frames written and flushed one by one inside one poll of the connection leave in one
    /// write, after the connection yielded once; every byte arrives, in order.
    #[tokio::test]
    async fn a_polls_frames_leave_in_one_write() {
        let rec = Recorder::default();
        let (io, driver) = coalesce(rec.clone());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<Vec<u8>>>();
        let conn = async move {
            let mut io = io;
            while let Some(frames) = rx.recv().await {
                for f in frames {
                    io.write_all(&f).await.unwrap();
                    io.flush().await.unwrap();
                }
            }
        };
        let task = tokio::spawn(driver.drive(Box::pin(conn)));
        let frames: Vec<Vec<u8>> = (0..250u8).map(|i| vec![i; 1100]).collect();
        tx.send(frames.clone()).unwrap();
        wait_for_bytes(&rec, frames.concat().len()).await;
        let writes = rec.writes.lock().clone();
        // 275,000 bytes: the buffer fills four times, then the rest after the poll.
        assert_eq!(
            writes.len(),
            5,
            "{:?}",
            writes.iter().map(Vec::len).collect::<Vec<_>>()
        );
        assert_eq!(writes.concat(), frames.concat());
        drop(tx);
        task.await.unwrap();
    }

    /// Frames that keep arriving over several polls (stream tasks running between them) still
    /// leave in one write once a poll adds nothing.
    #[tokio::test(flavor = "current_thread")]
    async fn a_batch_growing_over_polls_leaves_in_one_write() {
        let rec = Recorder::default();
        let (io, driver) = coalesce(rec.clone());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        let conn = async move {
            let mut io = io;
            while let Some(f) = rx.recv().await {
                io.write_all(&f).await.unwrap();
                io.flush().await.unwrap();
            }
        };
        let task = tokio::spawn(driver.drive(Box::pin(conn)));
        // Four stream tasks in a chain: each queues its frame, then wakes the next, so the
        // connection is polled between any two frames.
        let (first, mut prev) = tokio::sync::oneshot::channel::<()>();
        for i in 0..4u8 {
            let (next_tx, next_rx) = tokio::sync::oneshot::channel::<()>();
            let tx = tx.clone();
            let go = std::mem::replace(&mut prev, next_rx);
            tokio::spawn(async move {
                let _ = go.await;
                tx.send(vec![i; 1000]).unwrap();
                let _ = next_tx.send(());
            });
        }
        // Every task waits on its signal before the chain starts.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        first.send(()).unwrap();
        let _ = prev.await;
        wait_for_bytes(&rec, 4000).await;
        let writes = rec.writes.lock().clone();
        assert_eq!(
            writes.len(),
            1,
            "{:?}",
            writes.iter().map(Vec::len).collect::<Vec<_>>()
        );
        assert_eq!(writes[0].len(), 4000);
        drop(tx);
        task.await.unwrap();
    }

    /// A write outside a poll of the connection (an upgraded connection's IO, used by another
    /// task) is written out by its own flush.
    #[tokio::test]
    async fn flushes_outside_the_connections_poll_are_real() {
        let rec = Recorder::default();
        let (mut io, _driver) = coalesce(rec.clone());
        io.write_all(b"hello").await.unwrap();
        assert!(joined(&rec).is_empty(), "buffered until flushed");
        io.flush().await.unwrap();
        assert_eq!(joined(&rec), b"hello");
        assert_eq!(rec.flushes.load(Ordering::Relaxed), 1);
    }

    /// What the connection's last poll wrote goes out before the driven future completes,
    /// also through a socket that takes a few bytes at a time.
    #[tokio::test]
    async fn the_last_polls_bytes_leave_before_the_end() {
        let rec = Recorder {
            max: 7,
            ..Recorder::default()
        };
        let (io, driver) = coalesce(rec.clone());
        let fut = async move {
            let mut io = io;
            io.write_all(b"the final frame").await.unwrap();
            io.flush().await.unwrap();
            42
        };
        assert_eq!(driver.drive(Box::pin(fut)).await, 42);
        assert_eq!(joined(&rec), b"the final frame");
    }

    /// A flush asked for during a poll reaches the socket even when nothing is left in the
    /// buffer (the write went straight through): a TLS stream would otherwise keep the tail
    /// of a response until something else flushed it.
    #[tokio::test]
    async fn flushes_reach_the_socket_when_writes_bypassed_the_buffer() {
        let sock = Recorder {
            stage: true,
            ..Recorder::default()
        };
        let (io, driver) = coalesce(sock.clone());
        let big = vec![3u8; CAPACITY + 10];
        let expect = big.clone();
        let (_keep, idle) = tokio::sync::oneshot::channel::<()>();
        let conn = async move {
            let mut io = io;
            io.write_all(&big).await.unwrap();
            io.flush().await.unwrap();
            // The connection then waits for its next request.
            let _ = idle.await;
        };
        let task = tokio::spawn(driver.drive(Box::pin(conn)));
        wait_for_bytes(&sock, expect.len()).await;
        assert_eq!(joined(&sock), expect);
        assert!(sock.staged.lock().is_empty());
        task.abort();
    }

    /// A connection future whose batch nothing else can add to (one response).
    struct Single<F>(Pin<Box<F>>);

    impl<F: Future> Future for Single<F> {
        type Output = F::Output;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            self.0.as_mut().poll(cx)
        }
    }

    impl<F> Batching for Single<F> {
        fn batches(&self) -> bool {
            false
        }
    }

    async fn poll_once<F: Future + Unpin + Batching>(mut d: Driven<F, Recorder>) {
        std::future::poll_fn(|cx| {
            let _ = Pin::new(&mut d).poll(cx);
            Poll::Ready(())
        })
        .await;
    }

    /// What a poll wrote leaves at the end of that poll when nothing else can add to the
    /// batch, and only after a pass through the run queue when something can.
    #[tokio::test]
    async fn only_a_batching_connection_waits_for_more() {
        for batching in [false, true] {
            let rec = Recorder::default();
            let (io, driver) = coalesce(rec.clone());
            let conn = async move {
                let mut io = io;
                io.write_all(b"one response").await.unwrap();
                io.flush().await.unwrap();
                std::future::pending::<()>().await;
            };
            let writes = if batching {
                let conn: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(conn);
                poll_once(driver.drive(conn)).await;
                rec.writes.lock().len()
            } else {
                poll_once(driver.drive(Single(Box::pin(conn)))).await;
                rec.writes.lock().len()
            };
            assert_eq!(writes, usize::from(!batching), "batching: {batching}");
        }
    }

    /// A large write with nothing buffered goes straight through, not through a copy.
    #[tokio::test]
    async fn large_writes_bypass_the_buffer() {
        let rec = Recorder::default();
        let (mut io, _driver) = coalesce(rec.clone());
        let big = vec![7u8; CAPACITY + 1];
        let n = io.write(&big).await.unwrap();
        assert_eq!(n, big.len());
        assert_eq!(rec.writes.lock().len(), 1);
    }
}
