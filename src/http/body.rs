//! The one response/request body type used across the proxy.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, combinators::UnsyncBoxBody};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A streaming body: upstream bodies pass through it frame by frame, never buffered whole.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

pub fn boxed<B>(b: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed_unsync()
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
