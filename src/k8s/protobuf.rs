//! The apiserver's protobuf encoding (`application/vnd.kubernetes.protobuf`), read far enough
//! to find what the proxy needs in a response it relays (an object's
//! `metadata.resourceVersion`) and what the cache needs of an object it holds as protobuf
//! bytes: the envelope's parts and the object's name, namespace, uid, resourceVersion and
//! labels; and, for the cache's own protobuf watch, a watch frame's event ([`watch_event`]),
//! an object's annotations and an ERROR event's `Status` ([`status`]). Nothing is decoded
//! beyond that; [`super::protobuf_write`] builds responses from the
//! same bytes.
//!
//! A protobuf body is the 4-byte magic `k8s\0` followed by a `runtime.Unknown` message:
//! `typeMeta` (1), `raw` (2, the object's own message), `contentEncoding` (3), `contentType`
//! (4). Every top-level Kubernetes object has its `ObjectMeta` as field 1, and `ObjectMeta`
//! holds `resourceVersion` as field 6 (k8s.io/apimachinery `generated.proto`).

/// The magic prefix of every protobuf-encoded Kubernetes object.
pub const MAGIC: &[u8; 4] = b"k8s\0";

/// One field of a protobuf message: its number and, for length-delimited fields, the bytes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Value<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32,
}

/// Reads a base-128 varint at the start of `buf`: the value and its length.
pub(super) fn varint(buf: &[u8]) -> Option<(u64, usize)> {
    let mut v: u64 = 0;
    for (i, b) in buf.iter().take(10).enumerate() {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// The fields of one message in wire order; stops (yielding `None` from then on) at the first
/// malformed byte, so hostile input ends the walk instead of misreading it.
#[derive(Clone)]
pub(super) struct Fields<'a> {
    buf: &'a [u8],
}

impl<'a> Fields<'a> {
    pub(super) fn of(msg: &'a [u8]) -> Fields<'a> {
        Fields { buf: msg }
    }

    /// The bytes not walked yet: after a field, where the next one starts.
    pub(super) fn rest(&self) -> &'a [u8] {
        self.buf
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Option<(u64, Value<'a>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.is_empty() {
            return None;
        }
        let parsed = (|| {
            let (key, n) = varint(self.buf)?;
            let rest = &self.buf[n..];
            let (value, used) = match key & 7 {
                0 => {
                    let (v, m) = varint(rest)?;
                    (Value::Varint(v), m)
                }
                1 => (Value::Fixed64, 8),
                2 => {
                    let (len, m) = varint(rest)?;
                    let end = m.checked_add(usize::try_from(len).ok()?)?;
                    (Value::Bytes(rest.get(m..end)?), end)
                }
                5 => (Value::Fixed32, 4),
                _ => return None,
            };
            if used > rest.len() {
                return None;
            }
            self.buf = &rest[used..];
            Some((key >> 3, value))
        })();
        if parsed.is_none() {
            self.buf = &[];
        }
        Some(parsed)
    }
}

/// The last occurrence of length-delimited field `number` (protobuf's "last one wins").
/// `None` if the message is malformed anywhere, even after that field.
pub(super) fn bytes_field(msg: &[u8], number: u64) -> Option<&[u8]> {
    let mut found = None;
    for f in (Fields { buf: msg }) {
        match f? {
            (n, Value::Bytes(b)) if n == number => found = Some(b),
            _ => {}
        }
    }
    found
}

/// `metadata.resourceVersion` of a protobuf-encoded object (`k8s\0` + `runtime.Unknown`).
/// `None` when the body is not one, or the object has no such number.
pub fn object_resource_version(body: &[u8]) -> Option<u64> {
    let unknown = body.strip_prefix(MAGIC)?;
    // An encoded `raw` (contentEncoding) is not read.
    if bytes_field(unknown, 3).is_some_and(|e| !e.is_empty()) {
        return None;
    }
    let raw = bytes_field(unknown, 2)?;
    let meta = bytes_field(raw, 1)?;
    let rv = std::str::from_utf8(bytes_field(meta, 6)?).ok()?;
    if rv.is_empty() || !rv.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    rv.parse().ok()
}

/// The parts of a protobuf-encoded object (`k8s\0` + `runtime.Unknown`), borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope<'a> {
    /// `typeMeta.apiVersion`, e.g. `v1` or `apps/v1`.
    pub api_version: &'a str,
    /// `typeMeta.kind`, e.g. `Pod` or `PodList`.
    pub kind: &'a str,
    /// The object's own message: what a list holds as one of its items.
    pub raw: &'a [u8],
    /// Empty unless `raw` is compressed; the apiserver never compresses it.
    pub content_encoding: &'a str,
    /// Empty (protobuf) as the apiserver writes it.
    pub content_type: &'a str,
}

/// The envelope of a protobuf-encoded object. `None` when `body` is not one: no magic, a
/// malformed message, a field of the wrong wire type or strings that are not UTF-8.
pub fn envelope(body: &[u8]) -> Option<Envelope<'_>> {
    let unknown = body.strip_prefix(MAGIC)?;
    let mut env = Envelope {
        api_version: "",
        kind: "",
        raw: &[],
        content_encoding: "",
        content_type: "",
    };
    for f in Fields::of(unknown) {
        let (n, v) = f?;
        match (n, v) {
            (1, Value::Bytes(type_meta)) => {
                for f in Fields::of(type_meta) {
                    match f? {
                        (1, Value::Bytes(b)) => env.api_version = std::str::from_utf8(b).ok()?,
                        (2, Value::Bytes(b)) => env.kind = std::str::from_utf8(b).ok()?,
                        (1 | 2, _) => return None,
                        _ => {}
                    }
                }
            }
            (2, Value::Bytes(b)) => env.raw = b,
            (3, Value::Bytes(b)) => env.content_encoding = std::str::from_utf8(b).ok()?,
            (4, Value::Bytes(b)) => env.content_type = std::str::from_utf8(b).ok()?,
            (1..=4, _) => return None,
            _ => {}
        }
    }
    Some(env)
}

/// What the cache keeps of an object's `ObjectMeta` (field 1 of every top-level object),
/// borrowed from the object's protobuf message. Absent strings read as empty, as in Go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectMeta<'a> {
    /// `name` (field 1).
    pub name: &'a str,
    /// `namespace` (3); empty for cluster-scoped objects.
    pub namespace: &'a str,
    /// `uid` (5).
    pub uid: &'a str,
    /// `resourceVersion` (6), as the apiserver wrote it (a decimal number from etcd).
    pub resource_version: &'a str,
    /// The whole `ObjectMeta` message, walked again by [`ObjectMeta::labels`].
    meta: &'a [u8],
}

impl<'a> ObjectMeta<'a> {
    /// `labels` (field 11, a `map<string, string>`: one entry message `{key 1, value 2}` per
    /// label, in the order written, which the apiserver sorts by key). Entries were checked
    /// by [`object_meta`]; a later duplicate key is yielded again, as protobuf's map merge
    /// would let it win.
    pub fn labels(&self) -> impl Iterator<Item = (&'a str, &'a str)> + Clone + 'a {
        Fields::of(self.meta).filter_map(|f| match f? {
            (11, Value::Bytes(entry)) => map_entry(entry),
            _ => None,
        })
    }
}

impl<'a> ObjectMeta<'a> {
    /// `annotations` (field 12, a `map<string, string>` like [`ObjectMeta::labels`]). Unlike
    /// labels, entries are not checked by [`object_meta`]: a malformed one is skipped.
    pub fn annotations(&self) -> impl Iterator<Item = (&'a str, &'a str)> + Clone + 'a {
        Fields::of(self.meta).filter_map(|f| match f? {
            (12, Value::Bytes(entry)) => map_entry(entry),
            _ => None,
        })
    }

    /// The annotation `key`'s value (the last entry with that key, as protobuf's map merge
    /// keeps). Only that entry's value is checked as UTF-8: other entries' keys are compared
    /// as bytes and their values are not read, so a reader after one annotation (a watch
    /// bookmark's `k8s.io/initial-events-end`, the load driver's write time) does not decode
    /// every other one. A malformed entry is skipped, as by [`ObjectMeta::annotations`].
    pub fn annotation(&self, key: &str) -> Option<&'a str> {
        let mut found = None;
        for f in Fields::of(self.meta) {
            if let Some((12, Value::Bytes(entry))) = f
                && let Some((k, v)) = map_entry_bytes(entry)
                && k == key.as_bytes()
                && let Ok(v) = std::str::from_utf8(v)
            {
                found = Some(v);
            }
        }
        found
    }
}

/// One `map<string, string>` entry: (key 1, value 2), each absent one empty.
fn map_entry(entry: &[u8]) -> Option<(&str, &str)> {
    let (key, value) = map_entry_bytes(entry)?;
    Some((
        std::str::from_utf8(key).ok()?,
        std::str::from_utf8(value).ok()?,
    ))
}

/// [`map_entry`]'s key and value as bytes, not checked as UTF-8.
fn map_entry_bytes(entry: &[u8]) -> Option<(&[u8], &[u8])> {
    let (mut key, mut value): (&[u8], &[u8]) = (&[], &[]);
    for f in Fields::of(entry) {
        match f? {
            (1, Value::Bytes(b)) => key = b,
            (2, Value::Bytes(b)) => value = b,
            (1 | 2, _) => return None,
            _ => {}
        }
    }
    Some((key, value))
}

/// The `ObjectMeta` fields the cache needs, read from an object's own message (an
/// [`Envelope::raw`]) in one pass, skipping everything else undecoded. `None` when the
/// object has no metadata or any of it is malformed (a wrong wire type, a string that is not
/// UTF-8, a broken label entry), so a caller never indexes half-read metadata.
pub fn object_meta(raw: &[u8]) -> Option<ObjectMeta<'_>> {
    let meta = bytes_field(raw, 1)?;
    let mut out = ObjectMeta {
        name: "",
        namespace: "",
        uid: "",
        resource_version: "",
        meta,
    };
    for f in Fields::of(meta) {
        let (n, v) = f?;
        let slot = match n {
            1 => &mut out.name,
            3 => &mut out.namespace,
            5 => &mut out.uid,
            6 => &mut out.resource_version,
            11 => {
                let Value::Bytes(entry) = v else { return None };
                map_entry(entry)?;
                continue;
            }
            _ => continue,
        };
        let Value::Bytes(b) = v else { return None };
        *slot = std::str::from_utf8(b).ok()?;
    }
    Some(out)
}

/// One event of a protobuf watch stream: a frame's message, `metav1.WatchEvent{type 1,
/// object 2: runtime.RawExtension{raw 1}}`, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchEvent<'a> {
    /// `ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK` or `ERROR`.
    pub event_type: &'a str,
    /// The object's whole protobuf body (`k8s\0` + `runtime.Unknown`), as a GET returns it.
    pub object: &'a [u8],
}

/// The event in one watch frame's message (the bytes after its 4-byte length). `None` when
/// the message is malformed, a field has the wrong wire type, or the type is not UTF-8.
pub fn watch_event(msg: &[u8]) -> Option<WatchEvent<'_>> {
    let mut event = WatchEvent {
        event_type: "",
        object: &[],
    };
    for f in Fields::of(msg) {
        match f? {
            (1, Value::Bytes(b)) => event.event_type = std::str::from_utf8(b).ok()?,
            (2, Value::Bytes(ext)) => {
                for f in Fields::of(ext) {
                    match f? {
                        (1, Value::Bytes(raw)) => event.object = raw,
                        (1, _) => return None,
                        _ => {}
                    }
                }
            }
            (1 | 2, _) => return None,
            _ => {}
        }
    }
    Some(event)
}

/// What the proxy reads of a `metav1.Status` message (the [`Envelope::raw`] of a `Status`
/// object: a watch ERROR event's object, an error response in protobuf), borrowed from it:
/// `message` (3), `reason` (4), `code` (6, an int32 varint), and from `details` (5) its
/// `causes` (4: `{reason 1, message 2}`) and `retryAfterSeconds` (5). k8s.io/apimachinery
/// `pkg/apis/meta/v1/generated.proto`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Status<'a> {
    pub code: i32,
    pub reason: &'a str,
    pub message: &'a str,
    /// `details.causes`: (reason, message).
    pub causes: Vec<(&'a str, &'a str)>,
    pub retry_after_seconds: Option<i32>,
}

/// Reads a `metav1.Status` message. `None` when it is malformed anywhere or a field read has
/// the wrong wire type or is not UTF-8.
pub fn status(raw: &[u8]) -> Option<Status<'_>> {
    fn text(v: Value<'_>) -> Option<&str> {
        match v {
            Value::Bytes(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }
    // An int32 is written as a (sign-extended) varint; truncated as Go reads it.
    fn int32(v: Value<'_>) -> Option<i32> {
        match v {
            Value::Varint(n) => Some(n as i32),
            _ => None,
        }
    }
    let mut out = Status::default();
    for f in Fields::of(raw) {
        match f? {
            (3, v) => out.message = text(v)?,
            (4, v) => out.reason = text(v)?,
            (6, v) => out.code = int32(v)?,
            (5, Value::Bytes(details)) => {
                for f in Fields::of(details) {
                    match f? {
                        (4, Value::Bytes(cause)) => {
                            let (mut reason, mut message) = ("", "");
                            for f in Fields::of(cause) {
                                match f? {
                                    (1, v) => reason = text(v)?,
                                    (2, v) => message = text(v)?,
                                    _ => {}
                                }
                            }
                            out.causes.push((reason, message));
                        }
                        (5, v) => out.retry_after_seconds = Some(int32(v)?),
                        (4, _) => return None,
                        _ => {}
                    }
                }
            }
            (5, _) => return None,
            _ => {}
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(n: u64, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut put = |mut v: u64| loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        };
        put((n << 3) | 2);
        put(bytes.len() as u64);
        out.extend_from_slice(bytes);
        out
    }

    /// One annotation is read without decoding the others, with protobuf's map semantics:
    /// the last entry of a key wins, a malformed entry (or a value that is not UTF-8) is
    /// skipped, and the answer agrees with [`ObjectMeta::annotations`] on every case.
    #[test]
    fn one_annotation_is_read_as_the_last_entry_of_its_key() {
        let entry = |k: &[u8], v: &[u8]| field(12, &[field(1, k), field(2, v)].concat());
        let metas: Vec<(Vec<u8>, Option<&str>)> = vec![
            // Padding before the wanted key, as the load driver's pods carry it.
            (
                [
                    entry(b"loadtest/pad", &[b'x'; 300]),
                    entry(b"loadtest/ts", b"12"),
                ]
                .concat(),
                Some("12"),
            ),
            // A later duplicate wins.
            (
                [entry(b"loadtest/ts", b"1"), entry(b"loadtest/ts", b"2")].concat(),
                Some("2"),
            ),
            // A value that is not UTF-8 is skipped; an earlier good one stays.
            (
                [entry(b"loadtest/ts", b"3"), entry(b"loadtest/ts", b"\xff")].concat(),
                Some("3"),
            ),
            // Another key's value need not be UTF-8.
            (
                [entry(b"other", b"\xff\xfe"), entry(b"loadtest/ts", b"4")].concat(),
                Some("4"),
            ),
            // A key that is a prefix of the wanted one, and no entry of it.
            (entry(b"loadtest/t", b"5"), None),
            // An entry whose key has the wrong wire type is skipped.
            (
                [
                    field(12, &[vec![1 << 3, 1], field(2, b"6")].concat()),
                    entry(b"a", b"b"),
                ]
                .concat(),
                None,
            ),
        ];
        for (i, (annotations, want)) in metas.iter().enumerate() {
            let raw = field(1, &[field(1, b"p"), annotations.clone()].concat());
            let meta = object_meta(&raw).unwrap();
            assert_eq!(meta.annotation("loadtest/ts"), *want, "case {i}");
            let by_iterator = meta
                .annotations()
                .filter(|(k, _)| *k == "loadtest/ts")
                .last()
                .map(|(_, v)| v);
            assert_eq!(by_iterator, *want, "case {i}: the iterator disagrees");
        }
    }

    /// A Lease as the apiserver encodes it: TypeMeta, then the object with its ObjectMeta
    /// (name 1, namespace 3, uid 5, resourceVersion 6, generation 7 as a varint) and a spec.
    fn lease(rv: &str) -> Vec<u8> {
        let type_meta = [field(1, b"coordination.k8s.io/v1"), field(2, b"Lease")].concat();
        let meta = [
            field(1, b"l1"),
            field(3, b"default"),
            field(5, b"0b7e6c1a-0000-4000-8000-000000000001"),
            field(6, rv.as_bytes()),
            vec![7 << 3, 0x96, 0x01],
        ]
        .concat();
        let object = [field(1, &meta), field(2, &field(1, b"holder"))].concat();
        let unknown = [
            field(1, &type_meta),
            field(2, &object),
            field(3, b""),
            field(4, b""),
        ]
        .concat();
        [MAGIC.as_slice(), &unknown].concat()
    }

    /// GET of ConfigMap pb/c1 from kube-apiserver v1.36.3: labels b=2 and a=1 (written
    /// sorted), annotation x=y, managedFields, data k=v.
    const REAL_C1: &str = "6b3873000a0f0a0276311209436f6e6669674d6170128c020a81020a02633112001a02706222002a2430616237666362392d343336662d346338312d616165392d34303437336531346139383932033230323800420808fbe3c0d80610005a060a01611201315a060a016212013262060a01781201798a01a2010a07756e6b6e6f776e12065570646174651a027631220808fbe3c0d806100032084669656c647356313a750a737b22663a64617461223a7b222e223a7b7d2c22663a6b223a7b7d7d2c22663a6d65746164617461223a7b22663a616e6e6f746174696f6e73223a7b222e223a7b7d2c22663a78223a7b7d7d2c22663a6c6162656c73223a7b222e223a7b7d2c22663a61223a7b7d2c22663a62223a7b7d7d7d7d420012060a016b1201761a002200";

    #[test]
    fn reads_the_envelope_and_metadata_of_a_real_object() {
        let body = hex::decode(REAL_C1).unwrap();
        let env = envelope(&body).unwrap();
        assert_eq!((env.api_version, env.kind), ("v1", "ConfigMap"));
        assert_eq!((env.content_encoding, env.content_type), ("", ""));
        assert_eq!(env.raw.len(), 268);
        assert!(body.ends_with(&[env.raw, &[0x1a, 0, 0x22, 0]].concat()));
        let meta = object_meta(env.raw).unwrap();
        assert_eq!(
            (meta.name, meta.namespace, meta.uid, meta.resource_version),
            ("c1", "pb", "0ab7fcb9-436f-4c81-aae9-40473e14a989", "202")
        );
        assert_eq!(meta.labels().collect::<Vec<_>>(), [("a", "1"), ("b", "2")]);
    }

    #[test]
    fn reads_metadata_with_absent_fields_as_empty() {
        let body = lease("5");
        let meta = object_meta(envelope(&body).unwrap().raw).unwrap();
        assert_eq!(
            (meta.name, meta.namespace, meta.resource_version),
            ("l1", "default", "5")
        );
        assert_eq!(meta.labels().count(), 0);
        // A cluster-scoped object: no namespace field at all.
        let raw = field(1, &[field(1, b"n1"), field(6, b"9")].concat());
        let meta = object_meta(&raw).unwrap();
        assert_eq!((meta.name, meta.namespace, meta.uid), ("n1", "", ""));
        // A label entry without a value (an empty one, omitted by some encoders).
        let raw = field(1, &field(11, &field(1, b"k")));
        assert_eq!(
            object_meta(&raw).unwrap().labels().collect::<Vec<_>>(),
            [("k", "")]
        );
    }

    #[test]
    fn refuses_malformed_envelopes_and_metadata() {
        assert_eq!(envelope(b"k8s"), None);
        assert_eq!(envelope(b"{}"), None);
        // typeMeta as a varint; a kind that is not UTF-8.
        assert_eq!(envelope(&[MAGIC.as_slice(), &[0x08, 0x01]].concat()), None);
        let bad_kind = field(1, &field(2, &[0xff]));
        assert_eq!(envelope(&[MAGIC.as_slice(), &bad_kind].concat()), None);
        // Every truncation of a real object's message is refused or read whole.
        let body = hex::decode(REAL_C1).unwrap();
        let raw = envelope(&body).unwrap().raw;
        for cut in 0..raw.len() {
            if let Some(m) = object_meta(&raw[..cut]) {
                assert_eq!(m.name, "c1", "cut at {cut}");
                assert_eq!(m.labels().count(), 2, "cut at {cut}");
            }
        }
        // A name as a varint, a label entry that is not a message, a uid not UTF-8.
        assert_eq!(object_meta(&field(1, &[0x08, 0x01])), None);
        assert_eq!(object_meta(&field(1, &[0x5a, 0x01, 0x08])), None);
        assert_eq!(object_meta(&field(1, &field(5, &[0xc3]))), None);
        assert_eq!(object_meta(&field(2, b"")), None, "no metadata");
    }

    /// The initial-events-end bookmark frame of a ConfigMap watch from kube-apiserver
    /// v1.36.3 (also in `protobuf_write`'s tests), without its 4-byte length.
    const REAL_CM_BOOKMARK_EVENT: &str = "0a08424f4f4b4d41524b12550a536b3873000a0f0a0276311209436f6e6669674d617012380a360a0012001a0022002a0032033230393800420062210a196b38732e696f2f696e697469616c2d6576656e74732d656e641204747275651a002200";

    #[test]
    fn reads_a_watch_event_and_its_objects_annotations() {
        let msg = hex::decode(REAL_CM_BOOKMARK_EVENT).unwrap();
        let ev = watch_event(&msg).unwrap();
        assert_eq!(ev.event_type, "BOOKMARK");
        let env = envelope(ev.object).unwrap();
        assert_eq!((env.api_version, env.kind), ("v1", "ConfigMap"));
        let meta = object_meta(env.raw).unwrap();
        assert_eq!((meta.name, meta.resource_version), ("", "209"));
        assert_eq!(
            meta.annotations().collect::<Vec<_>>(),
            [("k8s.io/initial-events-end", "true")]
        );
        assert_eq!(meta.annotation("k8s.io/initial-events-end"), Some("true"));
        assert_eq!(meta.annotation("k8s.io/initial-events"), None);
        assert_eq!(meta.labels().count(), 0);
        // Every truncation is refused or read as a prefix of the event, never misread.
        for cut in 0..msg.len() {
            if let Some(ev) = watch_event(&msg[..cut]) {
                assert!(ev.event_type.is_empty() || ev.event_type == "BOOKMARK");
                assert!(
                    ev.object.is_empty() || ev.object.len() == 0x53,
                    "cut at {cut}"
                );
            }
        }
        // A type as a varint; an object that is not a message; an empty message.
        assert_eq!(watch_event(&[0x08, 0x01]), None);
        assert_eq!(watch_event(&[0x12, 0x02, 0x08, 0x01]), None);
        assert_eq!(
            watch_event(b""),
            Some(WatchEvent {
                event_type: "",
                object: b""
            })
        );
    }

    #[test]
    fn reads_a_status_message() {
        let details = [
            field(
                4,
                &[field(1, b"ResourceVersionTooLarge"), field(2, b"too large")].concat(),
            ),
            vec![5 << 3, 2],
        ]
        .concat();
        let raw = [
            field(1, b""),
            field(2, b"Failure"),
            field(3, b"too old resource version: 1 (200)"),
            field(4, b"Expired"),
            field(5, &details),
            vec![6 << 3, 0x9a, 0x03],
        ]
        .concat();
        let s = status(&raw).unwrap();
        assert_eq!(
            (s.code, s.reason, s.message),
            (410, "Expired", "too old resource version: 1 (200)")
        );
        assert_eq!(s.causes, [("ResourceVersionTooLarge", "too large")]);
        assert_eq!(s.retry_after_seconds, Some(2));
        assert_eq!(status(b""), Some(Status::default()));
        // A code as bytes, a reason as a varint, details as a varint, a cut message.
        assert_eq!(status(&field(6, b"1")), None);
        assert_eq!(status(&[4 << 3, 1]), None);
        assert_eq!(status(&[5 << 3, 1]), None);
        assert_eq!(status(&raw[..raw.len() - 1]), None);
    }

    #[test]
    fn reads_the_resource_version_of_an_encoded_object() {
        assert_eq!(object_resource_version(&lease("48213")), Some(48213));
        // A 300-byte rv string and large fields take multi-byte lengths.
        let long = "9".repeat(19);
        assert_eq!(object_resource_version(&lease(&long)), long.parse().ok());
    }

    #[test]
    fn refuses_what_is_not_an_encoded_object_with_a_resource_version() {
        assert_eq!(object_resource_version(b""), None);
        assert_eq!(object_resource_version(b"{\"metadata\":{}}"), None);
        assert_eq!(object_resource_version(MAGIC), None);
        assert_eq!(object_resource_version(&lease("")), None);
        assert_eq!(object_resource_version(&lease("+5")), None);
        // Every truncation of a valid body is refused or read whole, never misread.
        let full = lease("77");
        for cut in 0..full.len() {
            let r = object_resource_version(&full[..cut]);
            assert!(r.is_none() || r == Some(77), "cut at {cut}: {r:?}");
        }
        // Length prefixes past the end, overlong varints, unknown wire types.
        let mut bad = MAGIC.to_vec();
        bad.extend_from_slice(&[0x12, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert_eq!(object_resource_version(&bad), None);
        let mut bad = MAGIC.to_vec();
        bad.extend_from_slice(&[0x12; 1]);
        bad.extend_from_slice(&[0xff; 11]);
        assert_eq!(object_resource_version(&bad), None);
        let mut bad = MAGIC.to_vec();
        bad.extend_from_slice(&[0x0b, 0x00]);
        assert_eq!(object_resource_version(&bad), None);
    }
}
