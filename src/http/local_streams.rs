//! An HTTP/2 connection's streams run inside the connection's own task.
//!
//! hyper runs every HTTP/2 stream (the request's service future, then the pump from the
//! response body to the connection) as a future it hands to the server's executor. With
//! tokio's executor each stream is a task of its own, so one watch event fanned out to the
//! 250 streams of a connection scheduled 250 tasks: each woken by the hub, queued, polled on
//! whichever worker, each then taking the connection's shared h2 state and waking the
//! connection task to encode its frame. With 10,000 watch streams that scheduling was the
//! largest share of the proxy's CPU (`cargo bench --bench fanout`), and the frames of one
//! connection trickled in from tasks spread over the whole run queue.
//!
//! Here [`LocalExec`], the builder's executor, hands each stream to the connection that
//! accepted it, and [`WithStreams`] polls a connection's streams from the connection's task
//! (a `FuturesUnordered`: a woken stream costs an atomic push and at most one wake of the
//! connection task), then the connection itself, which encodes what those streams just sent
//! into one batch ([`crate::http::coalesce`] writes it out). Envoy serves a connection's streams
//! from one worker thread the same way.
//!
//! The cost: the streams of one connection no longer run on two cores at once, and a
//! stream's CPU-heavy step delays the connection's other streams by its length (the largest
//! is gzipping a large cached list page for a client that accepts gzip). Every
//! stream future yields at its own await points, the h2 codec already serialises a
//! connection's frames, and connections (clients) still spread over the workers.
//!
//! Measured with `cargo bench --bench fanout` (10,000 watch streams on 40 connections, one
//! 1 KB event, proxy and client on the same two cores): p99 delivery latency 27–35 ms,
//! down from 40–48 ms with a task per stream, and one event to all 10,000 streams costs the
//! proxy about 40 ms of CPU.
//!
//! The executor finds its connection through a thread-local set only while [`WithStreams`]
//! polls the connection, which is where hyper's server accepts streams and hands them over.
//! Anything executed outside that (no other caller exists in hyper 1's server) is spawned as
//! a task, as before.

use std::cell::RefCell;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};

type StreamFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

thread_local! {
    /// Streams accepted by the connection being polled on this thread, waiting to join its set.
    static ACCEPTED: RefCell<Option<Vec<StreamFuture>>> = const { RefCell::new(None) };
}

/// The server builder's executor: stream futures join the connection that accepted them.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        let fut = ACCEPTED.with(|a| match a.borrow_mut().as_mut() {
            Some(accepted) => {
                // A panic in one stream ends that stream (dropping it resets it), not the
                // connection's task with every other stream in it, as it would have ended
                // only its own task before.
                accepted.push(Box::pin(AssertUnwindSafe(fut).catch_unwind().map(|r| {
                    if r.is_err() {
                        tracing::error!("an HTTP/2 stream panicked; it was reset");
                    }
                })));
                None
            }
            None => Some(fut),
        });
        if let Some(fut) = fut {
            tokio::spawn(fut);
        }
    }
}

/// Polls through this many stream completions before the connection gets its turn again, so
/// a burst of finishing streams cannot hold back the connection's reads and writes.
const STREAM_BUDGET: usize = 256;

/// Rounds of (streams, connection) in one poll: a connection poll that accepts new streams
/// is followed by their first poll, so a request's handler starts without a trip through the
/// run queue.
const MAX_ROUNDS: usize = 4;

/// A connection future and the streams it accepted.
pub struct WithStreams<F> {
    conn: F,
    streams: FuturesUnordered<StreamFuture>,
}

impl<F> WithStreams<F> {
    pub fn new(conn: F) -> WithStreams<F> {
        WithStreams {
            conn,
            streams: FuturesUnordered::new(),
        }
    }

    /// Streams not yet finished.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }
}

/// Restores the thread-local on every exit from a connection poll, unwinding included.
struct Scope;

impl Scope {
    fn enter() -> Scope {
        ACCEPTED.with(|a| *a.borrow_mut() = Some(Vec::new()));
        Scope
    }

    fn accepted(&self) -> Vec<StreamFuture> {
        ACCEPTED.with(|a| {
            a.borrow_mut()
                .as_mut()
                .map(std::mem::take)
                .unwrap_or_default()
        })
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        ACCEPTED.with(|a| *a.borrow_mut() = None);
    }
}

impl<F: Future + Unpin> Future for WithStreams<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        for _ in 0..MAX_ROUNDS {
            // Streams first: the frames they send are encoded by the connection's poll below.
            let mut finished = 0;
            while finished < STREAM_BUDGET {
                match this.streams.poll_next_unpin(cx) {
                    Poll::Ready(Some(())) => finished += 1,
                    Poll::Ready(None) | Poll::Pending => break,
                }
            }
            if finished == STREAM_BUDGET {
                cx.waker().wake_by_ref();
            }
            let scope = Scope::enter();
            let r = Pin::new(&mut this.conn).poll(cx);
            let accepted = scope.accepted();
            drop(scope);
            if let Poll::Ready(v) = r {
                // The connection is over; streams still held here could never send again.
                return Poll::Ready(v);
            }
            if accepted.is_empty() {
                return Poll::Pending;
            }
            this.streams.extend(accepted);
        }
        // New streams are still arriving: their first poll comes on the next pass.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A connection that "accepts" `n` streams on its first poll by executing them on the
    /// builder's executor, then stays open until every stream has run to completion.
    struct FakeConn {
        to_accept: usize,
        done: Arc<AtomicUsize>,
        total: usize,
    }

    impl Future for FakeConn {
        type Output = &'static str;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<&'static str> {
            use hyper::rt::Executor;
            for _ in 0..std::mem::take(&mut self.to_accept) {
                let done = self.done.clone();
                let waker = cx.waker().clone();
                LocalExec.execute(async move {
                    tokio::task::yield_now().await;
                    done.fetch_add(1, Ordering::SeqCst);
                    // The connection learns of a finished stream through its own waker, as
                    // h2 wakes the connection task when a stream sends or closes.
                    waker.wake();
                });
            }
            if self.done.load(Ordering::SeqCst) == self.total {
                Poll::Ready("closed")
            } else {
                Poll::Pending
            }
        }
    }

    #[tokio::test]
    async fn streams_run_inside_the_connection_task() {
        let done = Arc::new(AtomicUsize::new(0));
        let conn = FakeConn {
            to_accept: 300,
            done: done.clone(),
            total: 300,
        };
        let before = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        let mut ws = WithStreams::new(conn);
        let mut polls = 0;
        let out = std::future::poll_fn(|cx| {
            polls += 1;
            let r = Pin::new(&mut ws).poll(cx);
            if polls == 1 {
                // Accepted on the first poll and already polled once in it.
                assert_eq!(ws.streams(), 300);
                assert_eq!(
                    tokio::runtime::Handle::current()
                        .metrics()
                        .num_alive_tasks(),
                    before,
                    "no stream became a task of its own"
                );
            }
            r
        })
        .await;
        assert_eq!(out, "closed");
        assert_eq!(done.load(Ordering::SeqCst), 300);
    }

    /// A stream that panics ends alone; the connection and its other streams go on.
    #[tokio::test]
    async fn a_panicking_stream_ends_alone() {
        let done = Arc::new(AtomicUsize::new(0));
        let d = done.clone();
        let mut accepted = false;
        let conn = std::future::poll_fn(move |cx| {
            use hyper::rt::Executor;
            if !accepted {
                accepted = true;
                LocalExec.execute(async {
                    tokio::task::yield_now().await;
                    panic!("a stream's bug");
                });
                let (d, waker) = (d.clone(), cx.waker().clone());
                LocalExec.execute(async move {
                    tokio::task::yield_now().await;
                    tokio::task::yield_now().await;
                    d.fetch_add(1, Ordering::SeqCst);
                    waker.wake();
                });
            }
            if d.load(Ordering::SeqCst) == 1 {
                Poll::Ready("closed")
            } else {
                Poll::Pending
            }
        });
        let out = WithStreams::new(Box::pin(conn)).await;
        assert_eq!(out, "closed");
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn outside_a_connection_poll_the_executor_spawns() {
        use hyper::rt::Executor;
        let (tx, rx) = tokio::sync::oneshot::channel();
        LocalExec.execute(async move {
            let _ = tx.send(7);
        });
        assert_eq!(rx.await.unwrap(), 7);
    }

    #[tokio::test]
    async fn the_streams_end_with_their_connection() {
        struct Dropped(Arc<AtomicUsize>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicUsize::new(0));
        let close = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (d, c) = (dropped.clone(), close.clone());
        let mut accepted = false;
        let conn = std::future::poll_fn(move |_cx| {
            use hyper::rt::Executor;
            if !accepted {
                accepted = true;
                let guard = Dropped(d.clone());
                LocalExec.execute(async move {
                    let _guard = guard;
                    std::future::pending::<()>().await;
                });
            }
            if c.load(Ordering::SeqCst) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        let mut ws = WithStreams::new(Box::pin(conn));
        std::future::poll_fn(|cx| {
            assert!(Pin::new(&mut ws).poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        assert_eq!(ws.streams(), 1);
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        close.store(true, Ordering::SeqCst);
        std::future::poll_fn(|cx| Pin::new(&mut ws).poll(cx)).await;
        drop(ws);
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
    }
}
