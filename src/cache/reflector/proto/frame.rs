//! The protobuf watch stream's wire format: the body split into length-delimited frames
//! ([`FrameReader`], bounded, linear in the bytes read), and each frame decoded into an
//! object version, a bookmark or an error ([`decode`]) without copying the object.
//!
//! A frame is a 4-byte big-endian length and a `metav1.WatchEvent` message (client-go's
//! `framer.NewLengthDelimitedFrameReader`); the event's object is the object's whole protobuf
//! body, byte-identical to a GET of it at that resourceVersion (`k8s::protobuf_write`).

use bytes::{Buf as _, Bytes, BytesMut};

use super::super::error::{ApiStatus, MAX_EVENT_LINE};
use crate::cache::{EventKind, ObjectKey};
use crate::k8s::protobuf::{self, Envelope};
use crate::k8s::protobuf_write::INITIAL_EVENTS_END;

/// The longest frame accepted: the JSON watch's line bound (`MAX_EVENT_LINE`, 16 MiB: etcd
/// refuses objects above 1.5 MiB by default, 16 MiB leaves room for raised limits).
pub const MAX_FRAME: usize = MAX_EVENT_LINE;

/// Why a protobuf watch stream cannot be read further. Each one means the stream is broken
/// (the task backs off and resumes); none is the apiserver's verdict on the request.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("protobuf watch: frame of {0} bytes is longer than {MAX_FRAME} bytes")]
    TooLarge(u64),
    #[error("protobuf watch: stream ended in the middle of a frame ({0} bytes pending)")]
    Truncated(usize),
    #[error("protobuf watch: malformed event: {0}")]
    Malformed(&'static str),
    #[error("protobuf watch: unknown event type {0:?}")]
    UnknownEventType(String),
    #[error("protobuf watch: invalid resourceVersion {0:?}")]
    BadResourceVersion(String),
}

/// Splits a chunked body into frames' messages (the bytes after each 4-byte length).
///
/// A frame inside one chunk is a zero-copy slice of it. The bytes of a frame spanning chunks
/// are copied once into a buffer sized from its length, which is then frozen into the frame:
/// every byte is copied at most once, whatever the chunking.
#[derive(Debug, Default)]
pub struct FrameReader {
    /// The start of a frame that spans chunks: its header (fewer than 4 bytes), or its header
    /// and part of its message (then the capacity is the whole frame).
    partial: BytesMut,
}

impl FrameReader {
    /// Appends the messages of the frames completed by `chunk` to `out`.
    ///
    /// # Errors
    /// [`FrameError::TooLarge`] as soon as a header says more than [`MAX_FRAME`] (nothing of
    /// the frame is buffered); the reader must not be used after an error.
    pub fn push(&mut self, mut chunk: Bytes, out: &mut Vec<Bytes>) -> Result<(), FrameError> {
        if !self.partial.is_empty() {
            // Complete the header first, then the message.
            if self.partial.len() < 4 {
                let take = (4 - self.partial.len()).min(chunk.len());
                self.partial.extend_from_slice(&chunk.split_to(take));
                if self.partial.len() < 4 {
                    return Ok(());
                }
                let len = frame_len(&self.partial)?;
                self.partial.reserve(len);
            }
            let total = 4 + frame_len(&self.partial)?;
            let take = (total - self.partial.len()).min(chunk.len());
            self.partial.extend_from_slice(&chunk.split_to(take));
            if self.partial.len() < total {
                return Ok(());
            }
            let mut frame = std::mem::take(&mut self.partial).freeze();
            frame.advance(4);
            out.push(frame);
        }
        while chunk.len() >= 4 {
            let len = frame_len(&chunk)?;
            if chunk.len() < 4 + len {
                break;
            }
            let mut frame = chunk.split_to(4 + len);
            frame.advance(4);
            out.push(frame);
        }
        if !chunk.is_empty() {
            let want = if chunk.len() >= 4 {
                4 + frame_len(&chunk)?
            } else {
                4
            };
            self.partial = BytesMut::with_capacity(want);
            self.partial.extend_from_slice(&chunk);
        }
        Ok(())
    }

    /// The bytes of an incomplete frame held: not 0 when the stream ends means it was cut.
    pub fn pending(&self) -> usize {
        self.partial.len()
    }
}

/// The message length in a frame header at the start of `buf` (at least 4 bytes), bounded.
fn frame_len(buf: &[u8]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    match usize::try_from(len) {
        Ok(n) if n <= MAX_FRAME => Ok(n),
        _ => Err(FrameError::TooLarge(u64::from(len))),
    }
}

/// One decoded protobuf watch event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtoItem {
    /// An object version: ADDED, MODIFIED, or DELETED (then the object's last state with the
    /// deletion's resourceVersion).
    Object {
        kind: EventKind,
        key: ObjectKey,
        rv: u64,
        /// The object's whole body as a GET at `rv` returns it; a slice of the frame.
        envelope: Bytes,
    },
    /// A BOOKMARK: an empty object of the kind with only `metadata.resourceVersion`, and the
    /// `k8s.io/initial-events-end` annotation on the one that ends a watch's initial events.
    Bookmark {
        rv: u64,
        initial_events_end: bool,
        /// The bookmark object's whole body; a slice of the frame.
        envelope: Bytes,
    },
    /// An ERROR event's `Status`.
    Error(ApiStatus),
}

impl ProtoItem {
    /// The envelope of an object or bookmark.
    pub fn envelope(&self) -> Option<&Bytes> {
        match self {
            ProtoItem::Object { envelope, .. } | ProtoItem::Bookmark { envelope, .. } => {
                Some(envelope)
            }
            ProtoItem::Error(_) => None,
        }
    }
}

/// Decodes one frame's message (from [`FrameReader`]). Objects and bookmarks must be whole
/// uncompressed envelopes with metadata and a decimal resourceVersion; the caller checks
/// their kind ([`Envelope`] via [`protobuf::envelope`] of [`ProtoItem::envelope`]).
///
/// # Errors
/// A [`FrameError`] for anything malformed; never panics on any input.
pub fn decode(frame: &Bytes) -> Result<ProtoItem, FrameError> {
    let event = protobuf::watch_event(frame).ok_or(FrameError::Malformed("WatchEvent"))?;
    let kind = match event.event_type {
        "ADDED" => Some(EventKind::Added),
        "MODIFIED" => Some(EventKind::Modified),
        "DELETED" => Some(EventKind::Deleted),
        "BOOKMARK" | "ERROR" => None,
        other => return Err(FrameError::UnknownEventType(other.to_string())),
    };
    let env = envelope_of(event.object)?;
    if event.event_type == "ERROR" {
        if env.kind != "Status" {
            return Err(FrameError::Malformed("ERROR event without a Status"));
        }
        let s = protobuf::status(env.raw).ok_or(FrameError::Malformed("Status"))?;
        return Ok(ProtoItem::Error(ApiStatus {
            code: u16::try_from(s.code).unwrap_or(0),
            reason: s.reason.to_string(),
            message: s.message.to_string(),
            causes: s
                .causes
                .iter()
                .map(|(r, m)| (r.to_string(), m.to_string()))
                .collect(),
            retry_after: s
                .retry_after_seconds
                .and_then(|n| u64::try_from(n).ok())
                .map(std::time::Duration::from_secs),
        }));
    }
    let meta = protobuf::object_meta(env.raw).ok_or(FrameError::Malformed("ObjectMeta"))?;
    let rv_text = meta.resource_version;
    let rv = if !rv_text.is_empty() && rv_text.bytes().all(|b| b.is_ascii_digit()) {
        rv_text.parse::<u64>().ok()
    } else {
        None
    }
    .ok_or_else(|| FrameError::BadResourceVersion(rv_text.to_string()))?;
    let envelope = frame.slice_ref(event.object);
    Ok(match kind {
        Some(kind) => ProtoItem::Object {
            kind,
            key: ObjectKey::new(meta.namespace, meta.name),
            rv,
            envelope,
        },
        None => ProtoItem::Bookmark {
            rv,
            initial_events_end: meta.annotation(INITIAL_EVENTS_END) == Some("true"),
            envelope,
        },
    })
}

/// The envelope of an event's object, refusing a compressed one (the apiserver never
/// compresses `raw`; the proxy could not serve it as a GET's bytes).
fn envelope_of(object: &[u8]) -> Result<Envelope<'_>, FrameError> {
    let env = protobuf::envelope(object).ok_or(FrameError::Malformed("object envelope"))?;
    if !env.content_encoding.is_empty() {
        return Err(FrameError::Malformed("compressed object"));
    }
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::protobuf_write::{bookmark_object, object_envelope, watch_frame};

    /// Bytes kube-apiserver v1.36.3 sent (`k8s::protobuf_write`'s tests hold the same).
    mod real {
        /// GET of ConfigMap pb/c2.
        pub const GET_C2: &str = "6b3873000a0f0a0276311209436f6e6669674d617012450a430a02633212001a02706222002a2462366635623964652d643164372d346137362d396366322d35343936366365653464376432033230333800420808fbe3c0d80610001a002200";
        /// The watch frame of c2's deletion at resourceVersion 209.
        pub const DELETED_FRAME: &str = "0000006d0a0744454c4554454412620a606b3873000a0f0a0276311209436f6e6669674d617012450a430a02633212001a02706222002a2462366635623964652d643164372d346137362d396366322d35343936366365653464376432033230393800420808fbe3c0d80610001a002200";
        /// The initial-events-end bookmark frame of a ConfigMap watch.
        pub const CM_BOOKMARK: &str = "000000610a08424f4f4b4d41524b12550a536b3873000a0f0a0276311209436f6e6669674d617012380a360a0012001a0022002a0032033230393800420062210a196b38732e696f2f696e697469616c2d6576656e74732d656e641204747275651a002200";
    }

    fn unhex(s: &str) -> Vec<u8> {
        hex::decode(s).unwrap()
    }

    fn frame(ty: &str, object: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        watch_frame(&mut out, ty, object).unwrap();
        out
    }

    /// A stream of varied frames: the real ones and frames of 0, 1, 300 and 70,000 bytes.
    fn stream() -> (Vec<u8>, Vec<Vec<u8>>) {
        let mut frames = vec![unhex(real::DELETED_FRAME), unhex(real::CM_BOOKMARK)];
        for n in [0usize, 1, 300, 70_000] {
            let mut f = (n as u32).to_be_bytes().to_vec();
            f.extend((0..n).map(|i| i as u8));
            frames.push(f);
        }
        frames.push(frame("ADDED", &unhex(real::GET_C2)));
        (frames.concat(), frames)
    }

    fn read_all(reader: &mut FrameReader, chunks: &[&[u8]]) -> Vec<Bytes> {
        let mut out = Vec::new();
        for c in chunks {
            reader
                .push(Bytes::copy_from_slice(c), &mut out)
                .expect("valid frames");
        }
        out
    }

    #[test]
    fn frames_are_read_whole_wherever_the_chunks_split_them() {
        let (bytes, frames) = stream();
        let want: Vec<&[u8]> = frames.iter().map(|f| &f[4..]).collect();
        // One chunk; every split into two chunks; every frame byte by byte.
        let mut r = FrameReader::default();
        assert_eq!(read_all(&mut r, &[&bytes]), want);
        assert_eq!(r.pending(), 0);
        for at in 0..=bytes.len() {
            let mut r = FrameReader::default();
            let (a, b) = bytes.split_at(at);
            assert_eq!(read_all(&mut r, &[a, b]), want, "split at {at}");
            assert_eq!(r.pending(), 0, "split at {at}");
        }
        let bytewise: Vec<&[u8]> = bytes.chunks(1).collect();
        let mut r = FrameReader::default();
        assert_eq!(read_all(&mut r, &bytewise), want);
        // Three chunks, every pair of split points inside the small frames.
        let small = &bytes[..frames[..5].iter().map(Vec::len).sum::<usize>()];
        for i in 0..=small.len() {
            for j in i..=small.len() {
                let mut r = FrameReader::default();
                let got = read_all(&mut r, &[&small[..i], &small[i..j], &small[j..]]);
                assert_eq!(got, &want[..5], "splits at {i}, {j}");
            }
        }
    }

    #[test]
    fn a_frame_within_a_chunk_is_a_slice_of_it() {
        let (bytes, _) = stream();
        let chunk = Bytes::from(bytes);
        let mut out = Vec::new();
        FrameReader::default()
            .push(chunk.clone(), &mut out)
            .unwrap();
        let range = chunk.as_ptr_range();
        for f in &out {
            assert!(range.contains(&f.as_ptr()) || f.is_empty());
        }
    }

    #[test]
    fn an_incomplete_frame_is_pending_when_the_stream_ends() {
        let (bytes, frames) = stream();
        for cut in [1, 3, 4, 5, frames[0].len() - 1, frames[0].len() + 2] {
            let mut r = FrameReader::default();
            let got = read_all(&mut r, &[&bytes[..cut]]);
            assert_eq!(got.len(), usize::from(cut > frames[0].len()));
            assert!(r.pending() > 0, "cut at {cut}");
        }
    }

    #[test]
    fn a_frame_longer_than_the_bound_is_refused_from_its_header() {
        let over = (MAX_FRAME as u32 + 1).to_be_bytes();
        let mut out = Vec::new();
        assert_eq!(
            FrameReader::default().push(Bytes::copy_from_slice(&over), &mut out),
            Err(FrameError::TooLarge(MAX_FRAME as u64 + 1))
        );
        // The header split across chunks, after a good frame; nothing of it is buffered.
        let (bytes, _) = stream();
        let mut r = FrameReader::default();
        let mut out = Vec::new();
        r.push(
            Bytes::from([bytes.as_slice(), &[0xff, 0xff]].concat()),
            &mut out,
        )
        .unwrap();
        assert_eq!(out.len(), 7);
        assert_eq!(
            r.push(Bytes::from_static(&[0xff, 0xff, 0x00]), &mut out),
            Err(FrameError::TooLarge(u64::from(u32::MAX)))
        );
        assert!(r.partial.capacity() < 64);
        // Exactly the bound is a frame (its bytes still to come).
        let mut r = FrameReader::default();
        r.push(
            Bytes::copy_from_slice(&(MAX_FRAME as u32).to_be_bytes()),
            &mut out,
        )
        .unwrap();
        assert_eq!(r.pending(), 4);
    }

    #[test]
    fn decodes_real_object_and_bookmark_events_as_slices_of_the_frame() {
        let f = Bytes::from(unhex(real::DELETED_FRAME)).slice(4..);
        let item = decode(&f).unwrap();
        let ProtoItem::Object {
            kind,
            key,
            rv,
            envelope,
        } = &item
        else {
            panic!("{item:?}")
        };
        assert_eq!(
            (*kind, key, *rv),
            (EventKind::Deleted, &ObjectKey::new("pb", "c2"), 209)
        );
        let env = protobuf::envelope(envelope).unwrap();
        assert_eq!(object_envelope("v1", "ConfigMap", env.raw), envelope[..]);
        assert!(f.as_ptr_range().contains(&envelope.as_ptr()), "zero-copy");
        assert_eq!(
            protobuf::object_resource_version(&unhex(real::GET_C2)),
            Some(203)
        );

        let f = Bytes::from(unhex(real::CM_BOOKMARK)).slice(4..);
        let item = decode(&f).unwrap();
        let ProtoItem::Bookmark {
            rv: 209,
            initial_events_end: true,
            envelope,
        } = &item
        else {
            panic!("{item:?}")
        };
        assert_eq!(
            envelope,
            &bookmark_object("v1", "ConfigMap", &[], "209", true)
        );
        let plain = bookmark_object("v1", "ConfigMap", &[], "310", false);
        assert_eq!(
            decode(&Bytes::from(frame("BOOKMARK", &plain)).slice(4..)),
            Ok(ProtoItem::Bookmark {
                rv: 310,
                initial_events_end: false,
                envelope: Bytes::from(plain),
            })
        );
        for (ty, kind) in [
            ("ADDED", EventKind::Added),
            ("MODIFIED", EventKind::Modified),
        ] {
            let got = decode(&Bytes::from(frame(ty, &unhex(real::GET_C2))).slice(4..));
            assert!(
                matches!(got, Ok(ProtoItem::Object { kind: k, rv: 203, .. }) if k == kind),
                "{ty}: {got:?}"
            );
        }
    }

    /// A `Status` envelope as the apiserver writes an ERROR event's object: metadata (1),
    /// status (2), message (3), reason (4), details (5), code (6).
    fn status_object(code: u16, reason: &str, message: &str) -> Vec<u8> {
        let mut raw = vec![0x0a, 0x00, 0x12, 0x07];
        raw.extend_from_slice(b"Failure");
        for (key, text) in [(0x1a, message), (0x22, reason)] {
            raw.extend_from_slice(&[key, text.len() as u8]);
            raw.extend_from_slice(text.as_bytes());
        }
        raw.extend_from_slice(&[0x2a, 0x00, 0x30]);
        let mut c = code;
        while c >= 0x80 {
            raw.push((c as u8) | 0x80);
            c >>= 7;
        }
        raw.push(c as u8);
        object_envelope("v1", "Status", &raw)
    }

    #[test]
    fn decodes_an_error_events_status() {
        let obj = status_object(410, "Expired", "too old resource version: 1 (208)");
        let got = decode(&Bytes::from(frame("ERROR", &obj)).slice(4..)).unwrap();
        let ProtoItem::Error(s) = got else {
            panic!("{got:?}")
        };
        assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
        assert!(s.is_expired());
        assert_eq!(s.message, "too old resource version: 1 (208)");
        let obj = status_object(500, "InternalError", "boom");
        let got = decode(&Bytes::from(frame("ERROR", &obj)).slice(4..)).unwrap();
        assert!(matches!(got, ProtoItem::Error(s) if s.code == 500 && !s.is_expired()));
    }

    #[test]
    fn refuses_malformed_events_without_panicking() {
        let get = unhex(real::GET_C2);
        let cases: Vec<(Vec<u8>, FrameError)> = vec![
            (
                frame("RENAMED", &get)[4..].to_vec(),
                FrameError::UnknownEventType("RENAMED".into()),
            ),
            (b"".to_vec(), FrameError::UnknownEventType(String::new())),
            (
                frame("ADDED", b"{\"kind\":\"ConfigMap\"}")[4..].to_vec(),
                FrameError::Malformed("object envelope"),
            ),
            (
                frame("ERROR", &get)[4..].to_vec(),
                FrameError::Malformed("ERROR event without a Status"),
            ),
            (vec![0x0a, 0x05, b'A'], FrameError::Malformed("WatchEvent")),
            (
                frame("ADDED", &object_envelope("v1", "ConfigMap", &[0x12, 0x00]))[4..].to_vec(),
                FrameError::Malformed("ObjectMeta"),
            ),
            (
                frame(
                    "ADDED",
                    &bookmark_object("v1", "ConfigMap", &[], "+5", false),
                )[4..]
                    .to_vec(),
                FrameError::BadResourceVersion("+5".into()),
            ),
        ];
        for (msg, want) in cases {
            assert_eq!(decode(&Bytes::from(msg)), Err(want.clone()), "{want}");
        }
        // Every truncation and every single-byte corruption of a real frame: an error or an
        // item, never a panic; a corrupted envelope never reads as another object's name.
        let f = unhex(real::DELETED_FRAME)[4..].to_vec();
        for cut in 0..f.len() {
            let _ = decode(&Bytes::copy_from_slice(&f[..cut]));
        }
        for i in 0..f.len() {
            for b in [0x00, 0x7f, 0x80, 0xff] {
                let mut g = f.clone();
                g[i] = b;
                let _ = decode(&Bytes::from(g));
            }
        }
    }
}
