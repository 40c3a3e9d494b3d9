//! Response-body wrappers: clean ends of long-running streams at shutdown, and request
//! accounting that lasts as long as the body does.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker, ready};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio_util::sync::{
    CancellationToken, WaitForCancellationFuture, WaitForCancellationFutureOwned,
};

use crate::http::body::BoxError;

/// The process's drain signal: a cancellation token whose state is also kept in an atomic
/// flag, which every frame of every long-running body reads. `CancellationToken::is_cancelled`
/// (and polling its future) locks the token's mutex, and this token is shared by every open
/// stream: one watch event fanned out to 10,000 watchers took that one lock 10,000 times,
/// from every worker thread. The flag is set before the token fires, so a task the token
/// wakes sees it.
#[derive(Clone, Default)]
pub struct Drain {
    token: CancellationToken,
    flag: Arc<AtomicBool>,
}

impl std::fmt::Debug for Drain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drain")
            .field("draining", &self.is_cancelled())
            .finish()
    }
}

impl Drain {
    pub fn new() -> Drain {
        Drain::default()
    }

    /// Starts draining: every long-running body ends at its next boundary.
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
        self.token.cancel();
    }

    /// Whether draining started: one atomic load.
    pub fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Completes when draining starts.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.token.cancelled()
    }

    /// [`Drain::cancelled`], owning its token.
    pub fn cancelled_owned(&self) -> WaitForCancellationFutureOwned {
        self.token.clone().cancelled_owned()
    }

    /// The token, for a background task that only waits for it.
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }
}

pin_project_lite::pin_project! {
    /// Ends a streaming body cleanly when the drain token fires.
    ///
    /// For newline-delimited JSON (watch streams) the end falls on an event boundary: after
    /// the signal, bytes up to the next `\n` are still forwarded, so the client reads whole
    /// events and a clean EOF, and client-go's reflector re-watches from its last
    /// resourceVersion instead of relisting. Other content types end at the next frame.
    pub struct DrainBody<B> {
        #[pin]
        inner: B,
        #[pin]
        drain: WaitForCancellationFutureOwned,
        signal: Drain,
        // The waker `drain` was last polled with: while it is the task's, the flag is read
        // instead of polling `drain` (which locks the shared token) on every frame.
        drain_waker: Option<Waker>,
        line_framed: bool,
        at_boundary: bool,
        draining: bool,
        done: bool,
        end_on_error: bool,
    }
}

impl<B> DrainBody<B> {
    pub fn new(inner: B, drain: &Drain, line_framed: bool) -> Self {
        DrainBody {
            inner,
            drain: drain.cancelled_owned(),
            signal: drain.clone(),
            drain_waker: None,
            line_framed,
            at_boundary: true,
            draining: false,
            done: false,
            end_on_error: false,
        }
    }

    /// A failure of the inner body (the upstream connection lost) ends this one cleanly
    /// instead of resetting the client's stream. For watches: a direct client sees the
    /// apiserver's connection drop as an EOF and re-watches from its last resourceVersion;
    /// an HTTP/2 stream reset (INTERNAL_ERROR) is a decode error to client-go, which then
    /// relists.
    pub fn ending_cleanly_on_error(mut self) -> Self {
        self.end_on_error = true;
        self
    }
}

impl<B> HttpBody for DrainBody<B>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        if !*this.draining {
            let registered = this
                .drain_waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()));
            *this.draining = if registered {
                this.signal.is_cancelled()
            } else {
                *this.drain_waker = Some(cx.waker().clone());
                this.drain.as_mut().poll(cx).is_ready()
            };
        }
        if *this.draining && (*this.at_boundary || !*this.line_framed) {
            *this.done = true;
            return Poll::Ready(None);
        }
        let frame = match ready!(this.inner.poll_frame(cx)) {
            None => {
                *this.done = true;
                return Poll::Ready(None);
            }
            Some(Err(e)) if *this.end_on_error => {
                let e: BoxError = e.into();
                tracing::debug!(error = %e, "upstream stream failed; ending the client's stream cleanly");
                *this.done = true;
                return Poll::Ready(None);
            }
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            Some(Ok(f)) => f,
        };
        let Ok(mut data) = frame.into_data() else {
            // Trailers pass through untouched.
            return Poll::Ready(None);
        };
        if *this.line_framed && !data.is_empty() {
            if *this.draining
                && let Some(i) = memchr::memchr(b'\n', &data)
            {
                data.truncate(i + 1);
                *this.done = true;
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            *this.at_boundary = data.last() == Some(&b'\n');
        }
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::{StreamExt as _, stream};
    use http_body_util::{BodyExt, StreamBody};

    fn frames(parts: &[&'static str]) -> impl HttpBody<Data = Bytes, Error = BoxError> {
        StreamBody::new(stream::iter(
            parts
                .iter()
                .map(|p| Ok::<_, BoxError>(Frame::data(Bytes::from_static(p.as_bytes()))))
                .collect::<Vec<_>>(),
        ))
    }

    #[tokio::test]
    async fn drain_ends_watch_streams_on_an_event_boundary() {
        let token = Drain::new();
        let mut b = std::pin::pin!(DrainBody::new(
            frames(&["{\"a\":1}\n{\"b\"", ":2}\n{\"c\":3}\n", "{\"d\":4}\n"]),
            &token,
            true,
        ));
        let first = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "{\"a\":1}\n{\"b\"");
        token.cancel();
        // Mid-event: the rest of event b is still delivered, then a clean end.
        let second = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(second, ":2}\n");
        assert!(b.frame().await.is_none());
    }

    #[tokio::test]
    async fn drain_at_a_boundary_ends_at_once() {
        let token = Drain::new();
        let mut b = std::pin::pin!(DrainBody::new(
            frames(&["{\"a\":1}\n", "{\"b\":2}\n"]),
            &token,
            true
        ));
        b.frame().await.unwrap().unwrap();
        token.cancel();
        assert!(b.frame().await.is_none());
    }

    /// A body waiting for its next frame ends when the drain starts: the token wakes it,
    /// and the flag it then reads is already set. Polled once by another waker before, it
    /// registers the task's own.
    #[tokio::test]
    async fn a_drain_wakes_a_waiting_body() {
        use futures_util::FutureExt as _;
        let token = Drain::new();
        let first = Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"{}\n")));
        let inner = StreamBody::new(stream::iter([first]).chain(stream::pending()));
        let mut b = Box::pin(DrainBody::new(inner, &token, true));
        assert_eq!(
            b.frame().await.unwrap().unwrap().into_data().unwrap(),
            "{}\n"
        );
        assert!(
            b.frame().now_or_never().is_none(),
            "waits for its next frame"
        );
        let (polled_tx, polled_rx) = tokio::sync::oneshot::channel();
        let waiting = tokio::spawn(async move {
            let mut next = b.frame();
            assert!(futures_util::poll!(&mut next).is_pending());
            polled_tx.send(()).unwrap();
            next.await.is_none()
        });
        polled_rx.await.unwrap();
        assert!(!token.is_cancelled());
        token.cancel();
        assert!(token.is_cancelled());
        assert!(waiting.await.unwrap(), "ended cleanly");
    }

    #[tokio::test]
    async fn without_drain_the_body_passes_through_whole() {
        let token = Drain::new();
        let b = DrainBody::new(frames(&["x\n", "y", "z\n"]), &token, true);
        assert_eq!(b.collect().await.unwrap().to_bytes(), "x\nyz\n");
    }

    /// An upstream failure mid-stream: an error to the client (its stream is reset) unless
    /// the body ends cleanly on errors (passed-through watches), then a clean end after what
    /// arrived.
    #[tokio::test]
    async fn an_upstream_failure_ends_a_watch_cleanly() {
        let failing = || {
            StreamBody::new(stream::iter(vec![
                Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"{\"a\":1}\n"))),
                Err::<Frame<Bytes>, BoxError>("connection lost".into()),
            ]))
        };
        let plain = DrainBody::new(failing(), &Drain::new(), true);
        assert!(plain.collect().await.is_err());
        let clean = DrainBody::new(failing(), &Drain::new(), true).ending_cleanly_on_error();
        assert_eq!(clean.collect().await.unwrap().to_bytes(), "{\"a\":1}\n");
    }
}
