//! The apiserver's protobuf responses, written from objects' own protobuf bytes without a
//! schema and without re-encoding any object: a LIST body around items, a watch stream's
//! frames around events, and the `PartialObjectMetadata` forms of both.
//!
//! Every function writes exactly the bytes kube-apiserver writes (checked byte for byte
//! against a real one in `tests/e2e/protobuf.rs`). Its encoders are gogo-protobuf's generated
//! `Marshal`: fields in ascending number order, and a proto2 `optional` string or embedded
//! message that Go holds as a plain value (not a pointer) always written, even when empty.
//! Hence `contentEncoding` and `contentType` as `1a 00 22 00` at the end of every envelope,
//! and `ListMeta.selfLink` as `0a 00` at the start of every list's metadata.
//!
//! - An object (GET): `k8s\0` + `runtime.Unknown{typeMeta 1 {apiVersion 1, kind 2}, raw 2,
//!   contentEncoding 3, contentType 4}` ([`object_envelope`]).
//! - A list: the same envelope, `raw` being the `XxxList` message `{metadata 1: ListMeta
//!   {selfLink 1, resourceVersion 2, continue 3, remainingItemCount 4 when set}, items 2
//!   (repeated)}`, each item the object's own message: the `raw` of its envelope, neither
//!   magic nor `Unknown` ([`list_body`]).
//! - A watch: a stream of frames, each a 4-byte big-endian length and a `metav1.WatchEvent
//!   {type 1, object 2: RawExtension{raw 1}}`, neither magic nor `Unknown` around the event;
//!   the `raw` inside is the object's whole envelope, magic included ([`watch_frame`]).
//!
//! Sources: k8s.io/apimachinery `runtime/serializer/protobuf` (envelope, `collections.go`'s
//! streaming list encoder, which writes the same bytes), `runtime/types_proto.go`
//! (`Unknown.NestedMarshalTo`), `pkg/apis/meta/v1/generated.pb.go`; k8s.io/apiserver
//! `endpoints/handlers/watch.go` (the event encoded by the stream serializer, the object
//! inside by the full one).

use super::protobuf::{Fields, MAGIC, Value};

/// A list's `metadata` (`metav1.ListMeta`). `selfLink` is gone from the API and always
/// written empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ListMeta<'a> {
    /// The list's resourceVersion.
    pub resource_version: &'a str,
    /// The continue token of a page with more after it; empty otherwise.
    pub continue_token: &'a str,
    /// The apiserver's estimate of the items after this page; only set with a continue
    /// token (and not for every kind of list), and then written even when 0.
    pub remaining_item_count: Option<i64>,
}

/// The group version of `PartialObjectMetadata` a metadata-only client asks for
/// (`as=PartialObjectMetadata;g=meta.k8s.io;v=v1` in its Accept).
pub const META_V1: &str = "meta.k8s.io/v1";

/// A watch frame's message longer than its 4-byte length can say.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("watch event of {0} bytes does not fit a protobuf frame (at most 4 GiB)")]
pub struct FrameTooLarge(pub usize);

/// The bytes a base-128 varint of `v` takes.
fn varint_len(v: u64) -> usize {
    // 1 + floor(bits / 7), with 0 taking one byte.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The size of a length-delimited field of `len` bytes with a one-byte key (numbers 1-15).
fn field_len(len: usize) -> usize {
    1 + varint_len(len as u64) + len
}

/// The key and length of length-delimited field `number` (1-15), its payload to follow.
fn put_header(out: &mut Vec<u8>, number: u8, len: usize) {
    debug_assert!((1..16).contains(&number));
    out.push((number << 3) | 2);
    put_varint(out, len as u64);
}

fn put_field(out: &mut Vec<u8>, number: u8, payload: &[u8]) {
    put_header(out, number, payload.len());
    out.extend_from_slice(payload);
}

/// `runtime.TypeMeta`'s message: apiVersion and kind, both always written.
fn type_meta_len(api_version: &str, kind: &str) -> usize {
    field_len(api_version.len()) + field_len(kind.len())
}

/// The whole envelope of an object whose message is `raw_len` bytes: magic, then
/// `runtime.Unknown` with the empty `contentEncoding` and `contentType` the apiserver writes.
fn envelope_len(api_version: &str, kind: &str, raw_len: usize) -> usize {
    MAGIC.len() + field_len(type_meta_len(api_version, kind)) + field_len(raw_len) + 4
}

/// Writes the envelope up to `raw`'s header; `raw_len` bytes of `raw` must follow, then
/// [`put_envelope_tail`].
fn put_envelope_head(out: &mut Vec<u8>, api_version: &str, kind: &str, raw_len: usize) {
    out.extend_from_slice(MAGIC);
    put_header(out, 1, type_meta_len(api_version, kind));
    put_field(out, 1, api_version.as_bytes());
    put_field(out, 2, kind.as_bytes());
    put_header(out, 2, raw_len);
}

/// `contentEncoding` and `contentType`, both empty.
fn put_envelope_tail(out: &mut Vec<u8>) {
    out.extend_from_slice(&[0x1a, 0x00, 0x22, 0x00]);
}

/// An object's protobuf body as the apiserver answers a GET of it: `k8s\0` +
/// `runtime.Unknown` around `raw`, the object's own message.
pub fn object_envelope(api_version: &str, kind: &str, raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(envelope_len(api_version, kind, raw.len()));
    put_envelope_head(&mut out, api_version, kind, raw.len());
    out.extend_from_slice(raw);
    put_envelope_tail(&mut out);
    out
}

fn list_meta_len(meta: &ListMeta<'_>) -> usize {
    2 + field_len(meta.resource_version.len())
        + field_len(meta.continue_token.len())
        + meta
            .remaining_item_count
            .map_or(0, |n| 1 + varint_len(n as u64))
}

fn put_list_meta(out: &mut Vec<u8>, meta: &ListMeta<'_>) {
    put_header(out, 1, list_meta_len(meta));
    // selfLink, empty.
    out.extend_from_slice(&[0x0a, 0x00]);
    put_field(out, 2, meta.resource_version.as_bytes());
    put_field(out, 3, meta.continue_token.as_bytes());
    if let Some(n) = meta.remaining_item_count {
        out.push(4 << 3);
        // An int64 varint: a negative value (never sent) would take ten bytes, as in Go.
        put_varint(out, n as u64);
    }
}

/// A LIST response body as the apiserver writes it: the envelope of list kind `list_kind`
/// (`PodList`, `PartialObjectMetadataList`, ...) in `api_version`, around a list of `meta`
/// and `items`, each an object's own message ([`super::protobuf::Envelope::raw`], or a
/// [`partial_object_metadata`] for a metadata-only list). One allocation of the exact size;
/// the items are copied once.
pub fn list_body<T: AsRef<[u8]>>(
    api_version: &str,
    list_kind: &str,
    meta: &ListMeta<'_>,
    items: &[T],
) -> Vec<u8> {
    let list_len = field_len(list_meta_len(meta))
        + items
            .iter()
            .map(|i| field_len(i.as_ref().len()))
            .sum::<usize>();
    let mut out = Vec::with_capacity(envelope_len(api_version, list_kind, list_len));
    put_envelope_head(&mut out, api_version, list_kind, list_len);
    put_list_meta(&mut out, meta);
    for item in items {
        put_field(&mut out, 2, item.as_ref());
    }
    put_envelope_tail(&mut out);
    debug_assert_eq!(out.len(), out.capacity());
    out
}

/// The length of a `WatchEvent` message around an object of `object_len` bytes: what its
/// frame's 4-byte header says (client-go's `LengthDelimitedFrameReader` reads it as a
/// big-endian `uint32`).
fn watch_event_len(type_len: usize, object_len: usize) -> Result<u32, FrameTooLarge> {
    let event_len = field_len(type_len) + field_len(field_len(object_len));
    u32::try_from(event_len).map_err(|_| FrameTooLarge(event_len))
}

/// Appends one protobuf watch frame to `out`: the 4-byte big-endian length of a
/// `metav1.WatchEvent{type, object: {raw: object}}` and the event, `object` being the
/// object's whole protobuf body (magic and envelope included: [`object_envelope`] or the
/// bytes the apiserver sent for it). `event_type` is `ADDED`, `MODIFIED`, `DELETED`,
/// `BOOKMARK` or `ERROR`.
///
/// # Errors
/// [`FrameTooLarge`] if the event does not fit the frame's length (nothing is written).
pub fn watch_frame(
    out: &mut Vec<u8>,
    event_type: &str,
    object: &[u8],
) -> Result<(), FrameTooLarge> {
    let frame_len = watch_event_len(event_type.len(), object.len())?;
    out.reserve(4 + frame_len as usize);
    out.extend_from_slice(&frame_len.to_be_bytes());
    put_field(out, 1, event_type.as_bytes());
    put_header(out, 2, field_len(object.len()));
    put_field(out, 1, object);
    Ok(())
}

/// The `PartialObjectMetadata` message of an object, given the object's own message: its
/// `metadata` field exactly as encoded (key, length and `ObjectMeta`), which is the whole of
/// a `PartialObjectMetadata {metadata 1}`. Borrowed, no copy. `None` unless the message
/// starts with a well-formed `metadata` field, as every object the apiserver encodes does,
/// and has no second one (which protobuf would merge into the first).
pub fn partial_object_metadata(raw: &[u8]) -> Option<&[u8]> {
    let mut fields = Fields::of(raw);
    let Some(Some((1, Value::Bytes(_)))) = fields.next() else {
        return None;
    };
    let meta_field = &raw[..raw.len() - fields.rest().len()];
    for f in fields {
        if f?.0 == 1 {
            return None;
        }
    }
    Some(meta_field)
}

/// The annotation of the bookmark that ends a watch's initial events, valued `"true"`
/// ([KEP-3157](https://github.com/kubernetes/enhancements/tree/master/keps/sig-api-machinery/3157-watch-list)).
pub const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";

/// What a kind's bookmark objects hold after their metadata, borrowed from the message of a
/// bookmark object the apiserver sent for that kind: its other fields empty as Go encodes an
/// empty object. Nothing for a ConfigMap or a `PartialObjectMetadata`; a Pod's `spec` and
/// `status` with their always-written empty strings and zeros (28 and 19 bytes). No schema
/// here knows these, so the cache learns them from its own upstream watch's bookmarks.
/// `None` unless `bookmark_raw` starts with a well-formed metadata field.
pub fn bookmark_rest(bookmark_raw: &[u8]) -> Option<&[u8]> {
    let meta = partial_object_metadata(bookmark_raw)?;
    Some(&bookmark_raw[meta.len()..])
}

/// A bookmark's `ObjectMeta`: every always-written field empty (name 1, generateName 2,
/// namespace 3, selfLink 4, uid 5, generation 7 as 0, creationTimestamp 8 as the zero
/// time's empty message) but resourceVersion 6, and the one annotation (12) of an
/// initial-events-end bookmark.
fn bookmark_meta_len(resource_version: &str, initial_events_end: bool) -> usize {
    let annotations = if initial_events_end {
        field_len(field_len(INITIAL_EVENTS_END.len()) + field_len(4))
    } else {
        0
    };
    10 + field_len(resource_version.len()) + 4 + annotations
}

fn put_bookmark_meta(out: &mut Vec<u8>, resource_version: &str, initial_events_end: bool) {
    put_header(
        out,
        1,
        bookmark_meta_len(resource_version, initial_events_end),
    );
    out.extend_from_slice(&[0x0a, 0x00, 0x12, 0x00, 0x1a, 0x00, 0x22, 0x00, 0x2a, 0x00]);
    put_field(out, 6, resource_version.as_bytes());
    out.extend_from_slice(&[0x38, 0x00, 0x42, 0x00]);
    if initial_events_end {
        put_header(out, 12, field_len(INITIAL_EVENTS_END.len()) + field_len(4));
        put_field(out, 1, INITIAL_EVENTS_END.as_bytes());
        put_field(out, 2, b"true");
    }
}

/// A bookmark event's object, whole (magic and envelope included, as [`watch_frame`] takes
/// it): an empty object of `kind` but for `metadata.resourceVersion` and, when
/// `initial_events_end`, the [`INITIAL_EVENTS_END`] annotation; `rest` is the kind's
/// [`bookmark_rest`]. One allocation of the exact size.
pub fn bookmark_object(
    api_version: &str,
    kind: &str,
    rest: &[u8],
    resource_version: &str,
    initial_events_end: bool,
) -> Vec<u8> {
    let raw_len = field_len(bookmark_meta_len(resource_version, initial_events_end)) + rest.len();
    let mut out = Vec::with_capacity(envelope_len(api_version, kind, raw_len));
    put_envelope_head(&mut out, api_version, kind, raw_len);
    put_bookmark_meta(&mut out, resource_version, initial_events_end);
    out.extend_from_slice(rest);
    put_envelope_tail(&mut out);
    debug_assert_eq!(out.len(), out.capacity());
    out
}

/// An object's whole protobuf body (magic and envelope) with `metadata.resourceVersion`
/// set to `resource_version`, every other byte as it was: what the apiserver writes for a
/// copy of the object whose resourceVersion it changed (the watch cache's DELETED event of
/// an object leaving a selector, at the event's resourceVersion; a deletion's last state).
/// Re-encoding the copy gives these bytes because gogo's encoders write fields in ascending
/// order and the original was written by the same encoder. `None` unless `body` is an
/// envelope around a message that starts with one well-formed `metadata` field.
pub fn with_resource_version(body: &[u8], resource_version: &str) -> Option<Vec<u8>> {
    let e = super::protobuf::envelope(body)?;
    let meta_field = partial_object_metadata(e.raw)?;
    let after = &e.raw[meta_field.len()..];
    let Some(Some((1, Value::Bytes(meta)))) = Fields::of(meta_field).next() else {
        return None;
    };
    let mut new_meta = Vec::with_capacity(meta.len() + resource_version.len() + 2);
    let mut fields = Fields::of(meta);
    let mut written = false;
    loop {
        let before = fields.rest();
        let Some(f) = fields.next() else { break };
        let (n, _) = f?;
        let this = &before[..before.len() - fields.rest().len()];
        if n == 6 {
            if written {
                return None; // a second resourceVersion: not what the apiserver writes
            }
            put_field(&mut new_meta, 6, resource_version.as_bytes());
            written = true;
            continue;
        }
        if n > 6 && !written {
            put_field(&mut new_meta, 6, resource_version.as_bytes());
            written = true;
        }
        new_meta.extend_from_slice(this);
    }
    if !written {
        put_field(&mut new_meta, 6, resource_version.as_bytes());
    }
    let raw_len = field_len(new_meta.len()) + after.len();
    let mut out = Vec::with_capacity(envelope_len(e.api_version, e.kind, raw_len));
    put_envelope_head(&mut out, e.api_version, e.kind, raw_len);
    put_field(&mut out, 1, &new_meta);
    out.extend_from_slice(after);
    put_envelope_tail(&mut out);
    Some(out)
}

/// An object's whole body as `PartialObjectMetadata` of meta.k8s.io/v1 (what a metadata
/// client's protobuf GET or watch event holds), from the object's whole body. `None` as
/// [`partial_object_metadata`].
pub fn metadata_object(body: &[u8]) -> Option<Vec<u8>> {
    let e = super::protobuf::envelope(body)?;
    let pom = partial_object_metadata(e.raw)?;
    Some(object_envelope(META_V1, "PartialObjectMetadata", pom))
}

/// A failure `Status` (v1) as the apiserver writes it in protobuf, e.g. a watch's ERROR
/// event for 410 Expired: `metav1.Status {metadata 1: empty ListMeta, status 2 "Failure",
/// message 3, reason 4, code 6}`, `details` (5) absent as Go leaves a nil pointer out.
pub fn failure_status(message: &str, reason: &str, code: i32) -> Vec<u8> {
    const FAILURE: &[u8] = b"Failure";
    // An empty ListMeta: selfLink, resourceVersion and continue written empty.
    const EMPTY_LIST_META: [u8; 6] = [0x0a, 0x00, 0x12, 0x00, 0x1a, 0x00];
    // An int32 is written as a sign-extended varint, as in Go.
    let code = code as i64 as u64;
    let raw_len = field_len(EMPTY_LIST_META.len())
        + field_len(FAILURE.len())
        + field_len(message.len())
        + field_len(reason.len())
        + 1
        + varint_len(code);
    let mut out = Vec::with_capacity(envelope_len("v1", "Status", raw_len));
    put_envelope_head(&mut out, "v1", "Status", raw_len);
    put_field(&mut out, 1, &EMPTY_LIST_META);
    put_field(&mut out, 2, FAILURE);
    put_field(&mut out, 3, message.as_bytes());
    put_field(&mut out, 4, reason.as_bytes());
    out.push(6 << 3);
    put_varint(&mut out, code);
    put_envelope_tail(&mut out);
    debug_assert_eq!(out.len(), out.capacity());
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::k8s::protobuf::{envelope, object_resource_version};

    /// Bytes kube-apiserver v1.36.3 sent (`tests/e2e/protobuf.rs` checks the same rules live).
    pub(crate) mod real {
        /// GET of ConfigMap pb/c2 (no labels, data or managedFields).
        pub const GET_C2: &str = "6b3873000a0f0a0276311209436f6e6669674d617012450a430a02633212001a02706222002a2462366635623964652d643164372d346137362d396366322d35343936366365653464376432033230333800420808fbe3c0d80610001a002200";
        /// LIST of ConfigMaps matching nothing, at resourceVersion 207.
        pub const EMPTY_LIST: &str =
            "6b3873000a130a027631120d436f6e6669674d61704c697374120b0a090a0012033230371a001a002200";
        /// The watch frame of c2's deletion at resourceVersion 209.
        pub const DELETED_FRAME: &str = "0000006d0a0744454c4554454412620a606b3873000a0f0a0276311209436f6e6669674d617012450a430a02633212001a02706222002a2462366635623964652d643164372d346137362d396366322d35343936366365653464376432033230393800420808fbe3c0d80610001a002200";
        /// Initial-events-end bookmark frames (sendInitialEvents=true): ConfigMaps, Pods, and
        /// ConfigMaps as `PartialObjectMetadata`.
        pub const CM_BOOKMARK: &str = "000000610a08424f4f4b4d41524b12550a536b3873000a0f0a0276311209436f6e6669674d617012380a360a0012001a0022002a0032033230393800420062210a196b38732e696f2f696e697469616c2d6576656e74732d656e641204747275651a002200";
        pub const POD_BOOKMARK: &str = "000000900a08424f4f4b4d41524b1283010a80016b3873000a090a0276311203506f64126b0a360a0012001a0022002a0032033230393800420062210a196b38732e696f2f696e697469616c2d6576656e74732d656e64120474727565121c1a00320042004a0052005800600068008201008a01009a0100c201001a130a001a0022002a0032004a005a0072008801001a002200";
        pub const META_BOOKMARK: &str = "000000790a08424f4f4b4d41524b126d0a6b6b3873000a270a0e6d6574612e6b38732e696f2f763112155061727469616c4f626a6563744d6574616461746112380a360a0012001a0022002a0032033231323800420062210a196b38732e696f2f696e697469616c2d6576656e74732d656e641204747275651a002200";
    }

    fn unhex(s: &str) -> Vec<u8> {
        hex::decode(s).unwrap()
    }

    /// The object inside a frame: (event type, the object's whole body).
    fn frame_parts(frame: &[u8]) -> (&str, &[u8]) {
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(frame.len(), 4 + len);
        let event = &frame[4..];
        let ty = crate::k8s::protobuf::bytes_field(event, 1).unwrap();
        let ext = crate::k8s::protobuf::bytes_field(event, 2).unwrap();
        let obj = crate::k8s::protobuf::bytes_field(ext, 1).unwrap();
        (std::str::from_utf8(ty).unwrap(), obj)
    }

    #[test]
    fn an_object_and_an_empty_list_are_the_apiservers_bytes() {
        let get = unhex(real::GET_C2);
        let env = envelope(&get).unwrap();
        assert_eq!((env.api_version, env.kind), ("v1", "ConfigMap"));
        assert_eq!(object_envelope("v1", "ConfigMap", env.raw), get);
        let meta = ListMeta {
            resource_version: "207",
            ..ListMeta::default()
        };
        let empty: &[&[u8]] = &[];
        assert_eq!(
            list_body("v1", "ConfigMapList", &meta, empty),
            unhex(real::EMPTY_LIST)
        );
    }

    #[test]
    fn a_watch_frame_is_the_apiservers_bytes() {
        let frame = unhex(real::DELETED_FRAME);
        let (ty, object) = frame_parts(&frame);
        assert_eq!(ty, "DELETED");
        assert_eq!(object_resource_version(object), Some(209));
        let mut out = b"earlier frames".to_vec();
        watch_frame(&mut out, "DELETED", object).unwrap();
        assert_eq!(&out[..14], b"earlier frames", "appended");
        assert_eq!(&out[14..], frame);
    }

    #[test]
    fn bookmarks_are_the_apiservers_bytes_for_any_resource_version() {
        for (frame, api_version, kind, rest_len) in [
            (real::CM_BOOKMARK, "v1", "ConfigMap", 0),
            (real::POD_BOOKMARK, "v1", "Pod", 51),
            (real::META_BOOKMARK, META_V1, "PartialObjectMetadata", 0),
        ] {
            let frame = unhex(frame);
            let (ty, object) = frame_parts(&frame);
            assert_eq!(ty, "BOOKMARK");
            let env = envelope(object).unwrap();
            let rest = bookmark_rest(env.raw).unwrap();
            assert_eq!(rest.len(), rest_len, "{kind}");
            let rv = object_resource_version(object).unwrap().to_string();
            let built = bookmark_object(api_version, kind, rest, &rv, true);
            assert_eq!(built, object, "{kind}");
            let mut out = Vec::new();
            watch_frame(&mut out, "BOOKMARK", &built).unwrap();
            assert_eq!(out, frame, "{kind}");
            // Another resourceVersion, with a longer length; a plain bookmark.
            let later = bookmark_object(api_version, kind, rest, "18446744073709551615", false);
            let env = envelope(&later).unwrap();
            assert_eq!((env.api_version, env.kind), (api_version, kind));
            assert_eq!(object_resource_version(&later), Some(u64::MAX));
            assert_eq!(bookmark_rest(env.raw), Some(rest));
        }
    }

    #[test]
    fn a_list_holds_its_metadata_and_items_verbatim() {
        // Items of 0, 1, 127, 128 and 20,000 bytes take one-, two- and three-byte lengths.
        let items: Vec<Vec<u8>> = [0, 1, 127, 128, 20_000]
            .iter()
            .map(|n| (0..*n).map(|i| i as u8).collect())
            .collect();
        for remaining in [None, Some(0), Some(1), Some(300), Some(-1)] {
            let meta = ListMeta {
                resource_version: "12",
                continue_token: "eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MTJ9",
                remaining_item_count: remaining,
            };
            let body = list_body("apps/v1", "DeploymentList", &meta, &items);
            let env = envelope(&body).unwrap();
            assert_eq!((env.api_version, env.kind), ("apps/v1", "DeploymentList"));
            assert_eq!((env.content_encoding, env.content_type), ("", ""));
            assert!(body.ends_with(&[0x1a, 0, 0x22, 0]));
            let fields: Vec<_> = Fields::of(env.raw).map(Option::unwrap).collect();
            assert_eq!(fields.len(), 1 + items.len());
            let Value::Bytes(lm) = &fields[0].1 else {
                panic!("metadata")
            };
            let lm: Vec<_> = Fields::of(lm).map(Option::unwrap).collect();
            let mut want = vec![
                (1, Value::Bytes(b"")),
                (2, Value::Bytes(b"12")),
                (3, Value::Bytes(meta.continue_token.as_bytes())),
            ];
            if let Some(n) = remaining {
                want.push((4, Value::Varint(n as u64)));
            }
            assert_eq!(lm, want);
            for (f, item) in fields[1..].iter().zip(&items) {
                assert_eq!(f, &(2, Value::Bytes(item)));
            }
        }
    }

    #[test]
    fn partial_object_metadata_is_the_objects_own_metadata_field() {
        let get = unhex(real::GET_C2);
        let raw = envelope(&get).unwrap().raw;
        let partial = partial_object_metadata(raw).unwrap();
        assert_eq!(partial, raw, "a ConfigMap without data is its metadata");
        let mut with_data = raw.to_vec();
        with_data.extend_from_slice(&[0x12, 0x06, 0x0a, 0x01, b'k', 0x12, 0x01, b'v']);
        assert_eq!(partial_object_metadata(&with_data), Some(raw));
        assert_eq!(partial_object_metadata(b""), None);
        // Not first, repeated, or followed by a malformed field.
        assert_eq!(partial_object_metadata(&with_data[raw.len()..]), None);
        assert_eq!(partial_object_metadata(&[raw, raw].concat()), None);
        assert_eq!(
            partial_object_metadata(&[raw, &[0x12, 0x05]].concat()),
            None
        );
        assert_eq!(partial_object_metadata(&raw[..raw.len() - 1]), None);
    }

    #[test]
    fn a_frame_too_long_for_its_length_header_is_refused() {
        assert_eq!(watch_event_len(8, 100), Ok(8 + 2 + 100 + 2 + 2));
        let max = u32::MAX as usize;
        assert!(watch_event_len(5, max - 20).is_ok());
        assert_eq!(watch_event_len(5, max), Err(FrameTooLarge(max + 19)));
    }

    #[test]
    fn varint_lengths_match_what_is_written() {
        for v in [
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len(), varint_len(v), "{v}");
            assert_eq!(crate::k8s::protobuf::varint(&out), Some((v, out.len())));
        }
    }

    /// A deletion's frame is the object's last state with the deletion's resourceVersion:
    /// rewriting the real GET of c2 at 203 to 209 gives the real DELETED frame's object.
    #[test]
    fn a_changed_resource_version_is_the_apiservers_bytes() {
        let get = unhex(real::GET_C2);
        let (ty, deleted) = {
            let f = unhex(real::DELETED_FRAME);
            let (t, o) = frame_parts(&f);
            (t.to_string(), o.to_vec())
        };
        assert_eq!(ty, "DELETED");
        assert_eq!(with_resource_version(&get, "209").unwrap(), deleted);
        assert_eq!(with_resource_version(&deleted, "203").unwrap(), get);
        // Longer and shorter numbers change every enclosing length.
        let long = with_resource_version(&get, "123456789012").unwrap();
        assert_eq!(object_resource_version(&long), Some(123_456_789_012));
        assert_eq!(with_resource_version(&long, "203").unwrap(), get);
        assert_eq!(with_resource_version(b"k8s\0junk", "1"), None);
        assert_eq!(with_resource_version(b"{}", "1"), None);
    }

    #[test]
    fn metadata_objects_are_the_objects_metadata_under_partial_object_metadata() {
        let get = unhex(real::GET_C2);
        let m = metadata_object(&get).unwrap();
        let e = envelope(&m).unwrap();
        assert_eq!((e.api_version, e.kind), (META_V1, "PartialObjectMetadata"));
        let orig = envelope(&get).unwrap();
        assert_eq!(e.raw, partial_object_metadata(orig.raw).unwrap());
        assert_eq!(object_resource_version(&m), Some(203));
    }

    #[test]
    fn a_failure_status_reads_back_as_written() {
        let b = failure_status("too old resource version: 5 (208)", "Expired", 410);
        let e = envelope(&b).unwrap();
        assert_eq!((e.api_version, e.kind), ("v1", "Status"));
        let s = crate::k8s::protobuf::status(e.raw).unwrap();
        assert_eq!(s.code, 410);
        assert_eq!(s.reason, "Expired");
        assert_eq!(s.message, "too old resource version: 5 (208)");
        // metadata 1 (empty ListMeta), then status 2 "Failure".
        assert!(
            e.raw
                .starts_with(&[0x0a, 0x06, 0x0a, 0x00, 0x12, 0x00, 0x1a, 0x00, 0x12, 0x07])
        );
        assert!(
            e.raw.ends_with(&[0x30, 0x9a, 0x03]),
            "410 as a varint, last"
        );
    }
}
