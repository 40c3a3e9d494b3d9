//! The apiserver's protobuf encoding (`application/vnd.kubernetes.protobuf`), read far enough
//! to find what the proxy needs in a response it relays: an object's
//! `metadata.resourceVersion`.
//!
//! A protobuf body is the 4-byte magic `k8s\0` followed by a `runtime.Unknown` message:
//! `typeMeta` (1), `raw` (2, the object's own message), `contentEncoding` (3), `contentType`
//! (4). Every top-level Kubernetes object has its `ObjectMeta` as field 1, and `ObjectMeta`
//! holds `resourceVersion` as field 6 (k8s.io/apimachinery `generated.proto`).

/// The magic prefix of every protobuf-encoded Kubernetes object.
pub const MAGIC: &[u8; 4] = b"k8s\0";

/// One field of a protobuf message: its number and, for length-delimited fields, the bytes.
#[derive(Debug, PartialEq, Eq)]
enum Value<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32,
}

/// Reads a base-128 varint at the start of `buf`: the value and its length.
fn varint(buf: &[u8]) -> Option<(u64, usize)> {
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
struct Fields<'a> {
    buf: &'a [u8],
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
fn bytes_field(msg: &[u8], number: u64) -> Option<&[u8]> {
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
