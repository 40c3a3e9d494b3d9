use super::*;

#[test]
fn the_schema_compiles_and_knows_the_built_in_kinds() {
    assert!(SCHEMA.knows("", "v1", "Pod"));
    assert!(SCHEMA.knows("apps", "v1", "Deployment"));
    assert!(SCHEMA.knows("coordination.k8s.io", "v1", "Lease"));
    assert!(!SCHEMA.knows("example.com", "v1", "Widget"));
}

fn pod(json: &str) -> Result<Vec<u8>, TranscodeError> {
    SCHEMA.object("", "v1", "Pod", json.as_bytes())
}

#[test]
fn an_empty_pod_is_its_go_zero_values() {
    // metadata 1, spec 2, status 3: each a Go value, always written, with its own plain
    // fields inside, zero. ObjectMeta's: name 1, generateName 2, namespace 3, selfLink 4,
    // uid 5, resourceVersion 6 (""), generation 7 (0), creationTimestamp 8 (the zero time:
    // an empty message). Its pointers, slices and maps: nothing.
    let b = pod(r#"{"kind":"Pod","apiVersion":"v1","metadata":{}}"#).unwrap();
    let meta = [
        0x0a, 0x10, 0x0a, 0x00, 0x12, 0x00, 0x1a, 0x00, 0x22, 0x00, 0x2a, 0x00, 0x32, 0x00, 0x38,
        0x00, 0x42, 0x00,
    ];
    assert_eq!(&b[..meta.len()], &meta[..], "{b:02x?}");
    // The spec absent from JSON is still the zero PodSpec, plain fields and all.
    assert_eq!(b[meta.len()], 0x12);
    assert!(b[meta.len() + 1] > 0, "a zero PodSpec has plain fields");
    assert_eq!(
        b,
        pod(r#"{"metadata":{"name":""},"spec":{},"status":{}}"#).unwrap()
    );
}

#[test]
fn an_unknown_member_is_refused_not_dropped() {
    let e = pod(r#"{"metadata":{"name":"a","fromTheFuture":1}}"#).unwrap_err();
    assert_eq!(
        e,
        TranscodeError::UnknownKey {
            ty: "k8s.io/apimachinery/pkg/apis/meta/v1.ObjectMeta".into(),
            key: "fromTheFuture".into()
        }
    );
    assert!(matches!(
        SCHEMA.object("", "v1", "Widget", b"{}"),
        Err(TranscodeError::UnknownKind(_))
    ));
    // A member of the wrong JSON type.
    assert!(pod(r#"{"spec":{"priority":"high"}}"#).is_err());
    assert!(pod(r#"{"spec":{"priority":2147483648}}"#).is_err());
}

#[test]
fn a_message_longer_than_127_bytes_gets_a_longer_length() {
    let long = "x".repeat(300);
    let b = pod(&format!(r#"{{"metadata":{{"name":"{long}"}}}}"#)).unwrap();
    // metadata: key 0x0a, length 317 (name's 303, the other plain fields' 14) as a
    // two-byte varint (0xbd 0x02), then name 1, its length 300 two bytes too.
    assert_eq!(&b[..6], &[0x0a, 0xbd, 0x02, 0x0a, 0xac, 0x02][..]);
    assert_eq!(&b[6..306], long.as_bytes());
}

#[test]
fn times_and_durations_read_as_go_writes_them() {
    assert_eq!(rfc3339("1970-01-01T00:00:00Z"), Some((0, 0)));
    assert_eq!(rfc3339("2026-12-07T21:58:26Z"), Some((1_796_680_706, 0)));
    assert_eq!(
        rfc3339("2026-01-02T03:04:05.123456Z"),
        Some((1_767_323_045, 123_456_000))
    );
    assert_eq!(rfc3339("1970-01-01T01:00:00+01:00"), Some((0, 0)));
    assert_eq!(rfc3339("1969-12-31T23:59:59Z"), Some((-1, 0)));
    assert_eq!(rfc3339("2026-13-01T00:00:00Z"), None);
    assert_eq!(rfc3339("yesterday"), None);
    assert_eq!(go_duration("0s"), Some(0));
    assert_eq!(go_duration("1h2m3.5s"), Some(3_723_500_000_000));
    assert_eq!(go_duration("300ms"), Some(300_000_000));
    assert_eq!(go_duration("-1.5µs"), Some(-1_500));
    assert_eq!(go_duration("5"), None);
    assert_eq!(go_duration(""), None);
}

#[test]
fn map_entries_are_written_in_sorted_key_order() {
    let a = pod(r#"{"metadata":{"labels":{"b":"2","a":"1"}}}"#).unwrap();
    let b = pod(r#"{"metadata":{"labels":{"a":"1","b":"2"}}}"#).unwrap();
    assert_eq!(a, b);
    let at = |k: &[u8]| a.windows(k.len()).position(|w| w == k).unwrap();
    assert!(at(b"\x0a\x01a\x12\x011") < at(b"\x0a\x01b\x12\x012"));
}
