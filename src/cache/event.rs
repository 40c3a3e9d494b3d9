//! A change to a cached object, and its wire frames, each encoded at most once and shared
//! (as `Bytes`) by every watcher that receives it.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{CachedObject, EventKind, Resource};

/// How a watcher must see an event, after its selector is applied to the old and new state
/// (k8s.io/apiserver cacher `convertToWatchEvent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// As it happened.
    AsIs,
    /// A MODIFIED that brought the object into the selection: ADDED with the new state.
    Entered,
    /// A MODIFIED that took the object out of the selection: DELETED with the old state at
    /// the event's resourceVersion.
    Left,
}

/// Wire encodings of watch frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// The full object as JSON.
    Json,
    /// Metadata only (metadata informers): objects and watch events as
    /// `PartialObjectMetadata` of meta.k8s.io/v1, lists as `PartialObjectMetadataList` whose
    /// items carry that type meta, as the apiserver writes them. Which reads get it is
    /// `read::router::negotiate`'s decision.
    Metadata,
}

#[derive(Debug)]
pub struct Event {
    pub kind: EventKind,
    /// The new state (for a delete: the last state, at the delete's resourceVersion).
    pub object: Arc<CachedObject>,
    /// The state before, when the object existed.
    pub prev: Option<Arc<CachedObject>>,
    pub rv: u64,
    pub at: Instant,
    frames: [OnceLock<Bytes>; 6],
    /// Protobuf frames (delivery × full or metadata), allocated on the first protobuf
    /// watcher's read: most events never have one.
    proto_frames: OnceLock<Box<[OnceLock<Bytes>; 6]>>,
}

impl Event {
    pub fn new(
        kind: EventKind,
        object: Arc<CachedObject>,
        prev: Option<Arc<CachedObject>>,
    ) -> Event {
        Event {
            kind,
            rv: object.meta.resource_version,
            object,
            prev,
            at: Instant::now(),
            frames: Default::default(),
            proto_frames: OnceLock::new(),
        }
    }

    /// Whether any watch frame was encoded for this event.
    pub fn has_frames(&self) -> bool {
        self.frames.iter().any(|f| f.get().is_some()) || self.proto_frames.get().is_some()
    }

    /// The same event (the same object states, resourceVersion and time) with no frame
    /// encoded yet: what the history keeps once its watchers were served.
    pub fn without_frames(&self) -> Event {
        Event {
            kind: self.kind,
            object: self.object.clone(),
            prev: self.prev.clone(),
            rv: self.rv,
            at: self.at,
            frames: Default::default(),
            proto_frames: OnceLock::new(),
        }
    }

    /// Whether the protobuf envelopes this event's frames are made from have come (from the
    /// resource's protobuf side): the new state's, or for a deletion the last state's. A
    /// watcher to whom the event is a selector exit also needs the previous state's, which
    /// it has unless it was never attached (see [`Self::proto_frame`]).
    pub fn proto_ready(&self) -> bool {
        self.object.proto.get().is_some()
            || (self.kind == EventKind::Deleted
                && self.prev.as_ref().is_some_and(|p| p.proto.get().is_some()))
    }

    /// The protobuf watch frame for this delivery (`metadata`: the object as
    /// `PartialObjectMetadata`), encoded once and shared, from the objects' protobuf
    /// envelopes: as it happened, the new state's; entering a selection, the new state's as
    /// ADDED; leaving it, the previous state's at this event's resourceVersion as DELETED
    /// (a deletion without its own envelope too: its last state at the deletion's
    /// resourceVersion is the previous state so rewritten). `None` while an envelope it needs
    /// has not come, or is malformed.
    pub fn proto_frame(&self, delivery: Delivery, metadata: bool) -> Option<Bytes> {
        let slot = match delivery {
            Delivery::AsIs => 0,
            Delivery::Entered => 1,
            Delivery::Left => 2,
        } + if metadata { 3 } else { 0 };
        let slots = self.proto_frames.get_or_init(Default::default);
        if let Some(f) = slots[slot].get() {
            return Some(f.clone());
        }
        let rewritten = |o: &CachedObject| {
            let env = o.proto.get()?;
            crate::k8s::protobuf_write::with_resource_version(env, &self.rv.to_string())
        };
        let (ty, object): (&str, std::borrow::Cow<'_, [u8]>) = match delivery {
            Delivery::AsIs => match (self.object.proto.get(), self.kind) {
                (Some(env), kind) => (kind.as_str(), (&env[..]).into()),
                (None, EventKind::Deleted) => ("DELETED", rewritten(self.prev.as_deref()?)?.into()),
                (None, _) => return None,
            },
            Delivery::Entered => ("ADDED", (&self.object.proto.get()?[..]).into()),
            Delivery::Left => (
                "DELETED",
                rewritten(self.prev.as_deref().unwrap_or(&self.object))?.into(),
            ),
        };
        let object: std::borrow::Cow<'_, [u8]> = if metadata {
            crate::k8s::protobuf_write::metadata_object(&object)?.into()
        } else {
            object
        };
        let mut out = Vec::new();
        crate::k8s::protobuf_write::watch_frame(&mut out, ty, &object).ok()?;
        Some(slots[slot].get_or_init(|| Bytes::from(out)).clone())
    }

    /// The frame `{"type":..,"object":..}\n` for this delivery and encoding, encoded once.
    pub fn frame(&self, resource: &Resource, delivery: Delivery, enc: Encoding) -> Bytes {
        let slot = match (delivery, enc) {
            (Delivery::AsIs, Encoding::Json) => 0,
            (Delivery::Entered, Encoding::Json) => 1,
            (Delivery::Left, Encoding::Json) => 2,
            (Delivery::AsIs, Encoding::Metadata) => 3,
            (Delivery::Entered, Encoding::Metadata) => 4,
            (Delivery::Left, Encoding::Metadata) => 5,
        };
        self.frames[slot]
            .get_or_init(|| {
                let (ty, body): (&str, std::borrow::Cow<'_, [u8]>) = match delivery {
                    Delivery::AsIs => (self.kind.as_str(), (&self.object.body[..]).into()),
                    Delivery::Entered => ("ADDED", (&self.object.body[..]).into()),
                    Delivery::Left => {
                        let prev = self.prev.as_ref().unwrap_or(&self.object);
                        (
                            "DELETED",
                            with_resource_version(&prev.body, prev.meta.resource_version, self.rv)
                                .into(),
                        )
                    }
                };
                encode_frame(resource, ty, &body, enc)
            })
            .clone()
    }
}

/// Encodes one watch frame from an object body (JSON without kind/apiVersion).
pub fn encode_frame(resource: &Resource, ty: &str, body: &[u8], enc: Encoding) -> Bytes {
    let mut b = BytesMut::with_capacity(body.len() + 96);
    put_frame(&mut b, resource, ty, body, enc);
    b.freeze()
}

/// Appends one watch frame (as [`encode_frame`]) to `b`, without a buffer of its own.
pub fn put_frame(b: &mut impl BufMut, resource: &Resource, ty: &str, body: &[u8], enc: Encoding) {
    b.put_slice(b"{\"type\":\"");
    b.put_slice(ty.as_bytes());
    b.put_slice(b"\",\"object\":");
    put_object(b, resource, body, enc);
    b.put_slice(b"}\n");
}

/// At most how many bytes more than the object's body a frame of `put_frame` takes,
/// besides the kind and apiVersion: `{"type":"MODIFIED","object":` and `}\n`, the type
/// meta's keys, and PartialObjectMetadata's.
pub const FRAME_OVERHEAD: usize = 128;

/// Writes an object with its type meta: the resource's kind, or PartialObjectMetadata with
/// only the metadata.
pub fn put_object(b: &mut impl BufMut, resource: &Resource, body: &[u8], enc: Encoding) {
    match enc {
        // A custom resource's body already carries its type meta (see `Resource::custom`).
        Encoding::Json if resource.custom => b.put_slice(body),
        Encoding::Json => {
            b.put_slice(b"{\"kind\":\"");
            b.put_slice(resource.kind.as_bytes());
            b.put_slice(b"\",\"apiVersion\":\"");
            b.put_slice(resource.api_version().as_bytes());
            b.put_slice(b"\"");
            if body.len() > 2 {
                b.put_u8(b',');
                b.put_slice(&body[1..]);
            } else {
                b.put_u8(b'}');
            }
        }
        Encoding::Metadata => {
            b.put_slice(b"{\"kind\":\"PartialObjectMetadata\",\"apiVersion\":\"meta.k8s.io/v1\",\"metadata\":");
            b.put_slice(metadata_of(body).as_bytes());
            b.put_u8(b'}');
        }
    }
}

/// The raw `metadata` member of an object body.
pub fn metadata_of(body: &[u8]) -> &str {
    #[derive(Deserialize)]
    struct M<'a> {
        #[serde(borrow)]
        metadata: &'a RawValue,
    }
    serde_json::from_slice::<M<'_>>(body)
        .map(|m| m.metadata.get())
        .unwrap_or("{}")
}

/// The body with its `metadata.resourceVersion` replaced (the first occurrence of the exact
/// member, which is metadata's: the apiserver writes `metadata` first).
pub fn with_resource_version(body: &[u8], old: u64, new: u64) -> Vec<u8> {
    if old == new {
        return body.to_vec();
    }
    let needle = format!("\"resourceVersion\":\"{old}\"");
    let hay = body;
    match hay
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())
    {
        Some(i) => {
            let mut v = Vec::with_capacity(body.len() + 4);
            v.extend_from_slice(&hay[..i]);
            v.extend_from_slice(format!("\"resourceVersion\":\"{new}\"").as_bytes());
            v.extend_from_slice(&hay[i + needle.len()..]);
            v
        }
        None => body.to_vec(),
    }
}

/// The longest JSON bookmark rest kept: the empty fields of a kind, a few dozen bytes.
const BOOKMARK_REST_MAX: usize = 4096;

/// From an upstream JSON watch line `{"type":"BOOKMARK","object":{"kind":..,"apiVersion":..,
/// "metadata":{..}REST}}`, REST: what the apiserver writes after the bookmark object's
/// metadata (its kind's empty fields: `,"spec":{"containers":null},"status":{}` for a Pod,
/// nothing for a ConfigMap). `None` for anything of another shape.
pub fn json_bookmark_rest(line: &[u8]) -> Option<Bytes> {
    #[derive(serde::Deserialize)]
    struct Line<'a> {
        #[serde(borrow)]
        object: &'a serde_json::value::RawValue,
    }
    let l: Line<'_> = serde_json::from_slice(line).ok()?;
    let obj = l.object.get().as_bytes();
    const KEY: &[u8] = b"\"metadata\":";
    let at = obj.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    // Only the type meta before the metadata, as the apiserver orders them.
    let head: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&[&obj[..at - KEY.len()], b"\"\":0}"].concat()).ok()?;
    if head
        .keys()
        .any(|k| !matches!(k.as_str(), "kind" | "apiVersion" | ""))
    {
        return None;
    }
    let mut meta = serde_json::Deserializer::from_slice(&obj[at..])
        .into_iter::<&serde_json::value::RawValue>();
    meta.next()?.ok()?;
    let rest = &obj[at + meta.byte_offset()..obj.len().checked_sub(1)?];
    let well_formed = obj.ends_with(b"}")
        && rest.len() <= BOOKMARK_REST_MAX
        && (rest.is_empty()
            || (rest.starts_with(b",")
                && serde_json::from_slice::<serde_json::Value>(
                    &[b"{\"\":0", rest, b"}"].concat(),
                )
                .is_ok()));
    well_formed.then(|| Bytes::copy_from_slice(rest))
}

/// A BOOKMARK frame at `rv`: the kind's empty object with only `metadata.resourceVersion`
/// (and the initial-events-end annotation), then `rest`, the kind's empty fields the
/// apiserver writes after the metadata ([`json_bookmark_rest`]; JSON only).
pub fn bookmark_frame(
    resource: &Resource,
    rv: u64,
    initial_events_end: bool,
    enc: Encoding,
    rest: &[u8],
) -> Bytes {
    let (kind, api_version) = match enc {
        Encoding::Json => (resource.kind.clone(), resource.api_version()),
        Encoding::Metadata => (
            "PartialObjectMetadata".to_string(),
            "meta.k8s.io/v1".to_string(),
        ),
    };
    let annotations = if initial_events_end {
        ",\"annotations\":{\"k8s.io/initial-events-end\":\"true\"}"
    } else {
        ""
    };
    let rest = match enc {
        Encoding::Json => std::str::from_utf8(rest).unwrap_or(""),
        Encoding::Metadata => "",
    };
    Bytes::from(format!(
        "{{\"type\":\"BOOKMARK\",\"object\":{{\"kind\":\"{kind}\",\"apiVersion\":\"{api_version}\",\"metadata\":{{\"resourceVersion\":\"{rv}\"{annotations}}}{rest}}}}}\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Resource;

    fn cm(name: &str, rv: u64, extra: &str) -> Arc<CachedObject> {
        let raw = format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"ns","resourceVersion":"{rv}"{extra}}},"data":{{"a":"b"}}}}"#
        );
        Arc::new(
            CachedObject::parse(
                Bytes::from(raw),
                &Resource::core("configmaps", "ConfigMap", true),
            )
            .unwrap(),
        )
    }

    #[test]
    fn frames_carry_type_meta_and_are_encoded_once() {
        let r = Resource::core("configmaps", "ConfigMap", true);
        let e = Event::new(EventKind::Added, cm("a", 5, ""), None);
        let f = e.frame(&r, Delivery::AsIs, Encoding::Json);
        let v: serde_json::Value = serde_json::from_slice(&f).unwrap();
        assert_eq!(v["type"], "ADDED");
        assert_eq!(v["object"]["kind"], "ConfigMap");
        assert_eq!(v["object"]["apiVersion"], "v1");
        assert_eq!(v["object"]["data"]["a"], "b");
        assert!(f.ends_with(b"\n"));
        let again = e.frame(&r, Delivery::AsIs, Encoding::Json);
        assert_eq!(f.as_ptr(), again.as_ptr(), "the same shared bytes");
    }

    #[test]
    fn leaving_the_selection_is_a_delete_of_the_old_state_at_the_events_rv() {
        let r = Resource::core("configmaps", "ConfigMap", true);
        let e = Event::new(
            EventKind::Modified,
            cm("a", 9, r#","labels":{"x":"2"}"#),
            Some(cm("a", 5, r#","labels":{"x":"1"}"#)),
        );
        let v: serde_json::Value =
            serde_json::from_slice(&e.frame(&r, Delivery::Left, Encoding::Json)).unwrap();
        assert_eq!(v["type"], "DELETED");
        assert_eq!(v["object"]["metadata"]["labels"]["x"], "1");
        assert_eq!(v["object"]["metadata"]["resourceVersion"], "9");
        let v: serde_json::Value =
            serde_json::from_slice(&e.frame(&r, Delivery::Entered, Encoding::Json)).unwrap();
        assert_eq!(v["type"], "ADDED");
        assert_eq!(v["object"]["metadata"]["labels"]["x"], "2");
    }

    #[test]
    fn custom_resource_frames_keep_the_objects_own_type_meta_once() {
        let r = Resource::test_widgets(true, &[]);
        let raw = br#"{"apiVersion":"example.com/v1","kind":"Widget","metadata":{"name":"w","namespace":"ns","resourceVersion":"3"},"spec":{"size":1}}"#;
        let o = CachedObject::parse(Bytes::from_static(raw), &r).unwrap();
        assert_eq!(
            &o.body[..],
            &raw[..],
            "list items of custom resources keep type meta"
        );
        let e = Event::new(EventKind::Added, Arc::new(o), None);
        let f = e.frame(&r, Delivery::AsIs, Encoding::Json);
        assert_eq!(
            &f[..],
            &[&b"{\"type\":\"ADDED\",\"object\":"[..], &raw[..], b"}\n"].concat()[..]
        );
        let v: serde_json::Value =
            serde_json::from_slice(&e.frame(&r, Delivery::AsIs, Encoding::Metadata)).unwrap();
        assert_eq!(v["object"]["kind"], "PartialObjectMetadata");
        assert_eq!(v["object"]["metadata"]["name"], "w");
    }

    #[test]
    fn metadata_frames_hold_only_metadata() {
        let r = Resource::core("configmaps", "ConfigMap", true);
        let e = Event::new(EventKind::Added, cm("a", 5, ""), None);
        let v: serde_json::Value =
            serde_json::from_slice(&e.frame(&r, Delivery::AsIs, Encoding::Metadata)).unwrap();
        assert_eq!(v["object"]["kind"], "PartialObjectMetadata");
        assert_eq!(v["object"]["apiVersion"], "meta.k8s.io/v1");
        assert_eq!(v["object"]["metadata"]["name"], "a");
        assert!(v["object"].get("data").is_none());
    }

    #[test]
    fn a_json_bookmarks_rest_is_what_the_apiserver_wrote_after_its_metadata() {
        let pod = br#"{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"12","annotations":{"k8s.io/initial-events-end":"true"}},"spec":{"containers":null},"status":{}}}"#;
        let rest = json_bookmark_rest(pod).unwrap();
        assert_eq!(&rest[..], br#","spec":{"containers":null},"status":{}"#);
        let r = Resource::core("pods", "Pod", true);
        let v: serde_json::Value =
            serde_json::from_slice(&bookmark_frame(&r, 13, false, Encoding::Json, &rest)).unwrap();
        assert_eq!(
            v["object"],
            serde_json::json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "13"}, "spec": {"containers": null}, "status": {}})
        );
        // Metadata-only watchers' bookmarks are PartialObjectMetadata: no rest.
        let v: serde_json::Value =
            serde_json::from_slice(&bookmark_frame(&r, 13, false, Encoding::Metadata, &rest))
                .unwrap();
        assert!(v["object"].get("spec").is_none());
        let cm = br#"{"type":"BOOKMARK","object":{"kind":"ConfigMap","apiVersion":"v1","metadata":{"resourceVersion":"9"}}}"#;
        assert_eq!(json_bookmark_rest(cm).as_deref(), Some(&b""[..]));
        for bad in [
            &br#"{"type":"BOOKMARK","object":{"kind":"Pod","extra":1,"metadata":{"resourceVersion":"9"}}}"#[..],
            br#"{"type":"BOOKMARK","object":{"kind":"Pod"}}"#,
            br#"{"type":"BOOKMARK","object":[1]}"#,
            b"{}",
        ] {
            assert_eq!(json_bookmark_rest(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn bookmarks_match_the_apiservers_shape() {
        let r = Resource::core("configmaps", "ConfigMap", true);
        assert_eq!(
            &bookmark_frame(&r, 222, true, Encoding::Json, b"")[..],
            &b"{\"type\":\"BOOKMARK\",\"object\":{\"kind\":\"ConfigMap\",\"apiVersion\":\"v1\",\"metadata\":{\"resourceVersion\":\"222\",\"annotations\":{\"k8s.io/initial-events-end\":\"true\"}}}}\n"[..]
        );
        let v: serde_json::Value =
            serde_json::from_slice(&bookmark_frame(&r, 7, false, Encoding::Json, b"")).unwrap();
        assert_eq!(
            v["object"]["metadata"],
            serde_json::json!({"resourceVersion": "7"})
        );
    }
}
