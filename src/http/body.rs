//! The one response/request body type used across the proxy.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full, combinators::UnsyncBoxBody};
use prometheus_client::metrics::counter::Counter;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A streaming body: upstream bodies pass through it frame by frame, never buffered whole.
///
/// The producer (a watch, a list, an upstream response) is boxed once. What the request
/// pipeline adds around it for its whole life (the response-bytes counter, the hooks that
/// end the request's metrics, access-log line and quota slot when the body ends) is held
/// here inline rather than as further boxed wrappers: a watch frame then goes through one
/// box, not one per wrapper (at 10,000 watchers each box was a cache miss per event per
/// stream; docs/architecture.md, "What a fan-out and a passed-through GET cost").
pub struct Body {
    inner: UnsyncBoxBody<Bytes, BoxError>,
    /// The response-bytes counter data frames are added to, and the access log's count.
    counted: Option<(Counter, Option<Arc<AtomicU64>>)>,
    /// Runs once, when the body ends or is dropped (the client went away), whichever is
    /// first; hooks added later run after earlier ones.
    on_end: Option<Box<dyn FnOnce() + Send>>,
}

impl Body {
    fn new<B>(b: B) -> Body
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Body {
            inner: b.map_err(Into::into).boxed_unsync(),
            counted: None,
            on_end: None,
        }
    }

    /// Adds the bytes of every data frame from now on to `metric` (moving while a long
    /// watch runs) and to `sent` when given (read when the body ends). Replaces an earlier
    /// counter.
    pub fn count_into(&mut self, metric: Counter, sent: Option<Arc<AtomicU64>>) {
        self.counted = Some((metric, sent));
    }

    /// Runs `f` once when the body ends or is dropped, after the hooks added before it (an
    /// inner step's clean-up before the request's metrics, as nested wrappers did).
    pub fn on_end(&mut self, f: impl FnOnce() + Send + 'static) {
        self.on_end = Some(match self.on_end.take() {
            None => Box::new(f),
            Some(prev) => Box::new(move || {
                prev();
                f();
            }),
        });
    }

    fn end(&mut self) {
        if let Some(f) = self.on_end.take() {
            f();
        }
    }
}

impl Default for Body {
    fn default() -> Body {
        empty()
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Body")
            .field("counted", &self.counted.is_some())
            .field("on_end", &self.on_end.is_some())
            .finish_non_exhaustive()
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        self.end();
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let r = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &r {
            Some(Ok(f)) => {
                if let Some((metric, sent)) = &this.counted
                    && let Some(d) = f.data_ref()
                {
                    metric.inc_by(d.len() as u64);
                    if let Some(s) = sent {
                        s.fetch_add(d.len() as u64, Ordering::Relaxed);
                    }
                }
            }
            Some(Err(_)) => {}
            None => this.end(),
        }
        Poll::Ready(r)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Body::new(Full::new(bytes.into()))
}

pub fn empty() -> Body {
    Body::new(Empty::new())
}

/// `b` as a [`Body`]; a `Body` is returned as it is, not boxed again.
pub fn boxed<B>(b: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut b = Some(b);
    if let Some(body) = (&mut b as &mut dyn std::any::Any).downcast_mut::<Option<Body>>() {
        return body.take().expect("just set");
    }
    Body::new(b.expect("not taken"))
}

/// A body made of already-built frames with a known total length (sent with
/// `Content-Length`): large cached objects go out as the shared bytes they are stored in,
/// without being copied into one response buffer.
pub struct Frames {
    frames: std::collections::VecDeque<Bytes>,
    remaining: u64,
}

impl Frames {
    pub fn new(frames: std::collections::VecDeque<Bytes>) -> Frames {
        let remaining = frames.iter().map(|f| f.len() as u64).sum();
        Frames { frames, remaining }
    }

    /// The frames not yet sent, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Bytes> {
        self.frames.iter()
    }

    pub fn len(&self) -> u64 {
        self.remaining
    }

    pub fn is_empty(&self) -> bool {
        self.remaining == 0
    }
}

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let f = self.frames.pop_front();
        if let Some(f) = &f {
            self.remaining -= f.len() as u64;
        }
        std::task::Poll::Ready(f.map(|f| Ok(http_body::Frame::data(f))))
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.remaining)
    }
}

/// Builds a [`Frames`] body: small pieces are copied into shared chunks, pieces of at least
/// `zero_copy_min` bytes are passed on as they are.
pub struct FramesBuilder {
    frames: std::collections::VecDeque<Bytes>,
    cur: bytes::BytesMut,
    chunk: usize,
    zero_copy_min: usize,
}

impl FramesBuilder {
    pub fn new(chunk: usize, zero_copy_min: usize) -> FramesBuilder {
        FramesBuilder {
            frames: Default::default(),
            cur: bytes::BytesMut::new(),
            chunk,
            zero_copy_min,
        }
    }

    /// The chunk being filled, to write small pieces into directly.
    pub fn buf(&mut self) -> &mut bytes::BytesMut {
        if self.cur.len() >= self.chunk {
            self.flush();
        }
        if self.cur.capacity() == self.cur.len() {
            self.cur.reserve(self.chunk);
        }
        &mut self.cur
    }

    /// Appends `b`, shared rather than copied when it is large.
    pub fn put_bytes(&mut self, b: &Bytes) {
        if b.len() >= self.zero_copy_min {
            self.flush();
            self.frames.push_back(b.clone());
        } else {
            self.buf().extend_from_slice(b);
        }
    }

    fn flush(&mut self) {
        // The rest of the chunk's allocation stays with `cur` for the next small pieces
        // (the commas between large items share one chunk).
        if !self.cur.is_empty() {
            self.frames.push_back(self.cur.split().freeze());
        }
    }

    pub fn finish(mut self) -> Frames {
        self.flush();
        Frames::new(self.frames)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(parts: &[&'static str]) -> Body {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect();
        boxed(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )))
    }

    #[tokio::test]
    async fn hooks_run_once_in_order_at_end_or_drop_and_bytes_are_counted() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let metric = Counter::default();
        let sent = Arc::new(AtomicU64::new(0));
        let mut b = chunks(&["ab", "cde"]);
        let t = tx.clone();
        b.on_end(move || t.send("inner").unwrap());
        b.count_into(metric.clone(), Some(sent.clone()));
        let t = tx.clone();
        b.on_end(move || t.send("outer").unwrap());
        // Passed on as it is: the hooks and the counter stay with it.
        let b = boxed(b);
        assert_eq!(b.collect().await.unwrap().to_bytes(), "abcde");
        assert_eq!(metric.get(), 5);
        assert_eq!(sent.load(Ordering::Relaxed), 5);
        assert_eq!(rx.try_recv(), Ok("inner"));
        assert_eq!(rx.try_recv(), Ok("outer"));
        assert!(rx.try_recv().is_err());

        // Dropped before its end (the client went away): the hooks run then, once.
        let mut b = chunks(&["a", "b"]);
        let t = tx.clone();
        b.on_end(move || t.send("dropped").unwrap());
        let first = b.frame().await;
        assert_eq!(first.unwrap().unwrap().into_data().unwrap(), "a");
        assert!(rx.try_recv().is_err());
        drop(b);
        assert_eq!(rx.try_recv(), Ok("dropped"));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn a_body_is_not_boxed_again() {
        let mut b = full("x");
        b.count_into(Counter::default(), None);
        // Boxed again, the outer body would carry no counter of its own.
        assert!(boxed(b).counted.is_some());
    }
}
