//! The WATCH stream's wire format: the chunked body split into newline-terminated lines
//! (`LineSplitter`, bounded), and each line decoded into an event, a bookmark or an error
//! ([`parse_event_line`]).

use bytes::Bytes;
use serde::Deserialize;

use super::error::{ApiStatus, MAX_EVENT_LINE, ReflectorError};
use crate::cache::{CachedObject, EventKind, Resource};
use crate::k8s::scan::{ScanError, Scanner};

/// One decoded watch event line.
#[derive(Debug)]
pub enum WatchItem {
    Object(EventKind, CachedObject),
    Bookmark(u64),
    Error(ApiStatus),
}

/// Decodes one watch line `{"type":..,"object":..}` in one pass, without a generic JSON
/// value: with `type` first (as the apiserver writes it) the object is parsed where it lies
/// and copied once into its own allocation (without kind/apiVersion).
pub fn parse_event_line(line: &Bytes, resource: &Resource) -> Result<WatchItem, ReflectorError> {
    const WHAT: &str = "watch event";
    let kind_of = |t: &str| match t {
        "ADDED" => Some(EventKind::Added),
        "MODIFIED" => Some(EventKind::Modified),
        "DELETED" => Some(EventKind::Deleted),
        _ => None,
    };
    let mut s = Scanner::new(line);
    let mut typ: Option<String> = None;
    let mut obj = None;
    let mut span = None;
    let mut obj_err = None;
    let scanned = s
        .object(|s, k| match &*k {
            "type" => {
                typ = s.opt_string()?.map(|t| t.into_owned());
                Ok(())
            }
            "object" => {
                if typ.as_deref().and_then(kind_of).is_some() {
                    match CachedObject::scan(s, line, resource) {
                        Ok(o) => obj = Some(o),
                        Err(e) => {
                            let at = s.pos();
                            obj_err = Some(e);
                            return Err(ScanError::Syntax(at));
                        }
                    }
                } else {
                    s.peek()?;
                    let start = s.pos();
                    s.skip()?;
                    span = Some(start..s.pos());
                }
                Ok(())
            }
            _ => s.skip(),
        })
        .and_then(|()| s.end());
    if let Some(source) = obj_err {
        return Err(ReflectorError::Object { what: WHAT, source });
    }
    scanned.map_err(|source| ReflectorError::Scan { what: WHAT, source })?;
    let Some(typ) = typ else {
        return Err(ReflectorError::UnknownEventType(String::new()));
    };
    if let Some(kind) = kind_of(&typ) {
        let obj = match (obj, span) {
            (Some(o), _) => o,
            // `object` before `type`.
            (None, Some(span)) => {
                let raw = &line[span];
                CachedObject::scan(&mut Scanner::new(raw), raw, resource)
                    .map_err(|source| ReflectorError::Object { what: WHAT, source })?
            }
            (None, None) => {
                return Err(ReflectorError::Scan {
                    what: WHAT,
                    source: ScanError::Eof,
                });
            }
        };
        return Ok(WatchItem::Object(kind, obj));
    }
    let raw = span.map(|r| &line[r]).unwrap_or(b"{}");
    match &*typ {
        "BOOKMARK" => {
            #[derive(Deserialize)]
            struct Rv<'a> {
                #[serde(borrow, default)]
                metadata: Option<RvMeta<'a>>,
            }
            #[derive(Deserialize)]
            #[serde(rename_all = "camelCase")]
            struct RvMeta<'a> {
                #[serde(borrow, default)]
                resource_version: Option<std::borrow::Cow<'a, str>>,
            }
            let r: Rv<'_> = serde_json::from_slice(raw)
                .map_err(|source| ReflectorError::Decode { what: WHAT, source })?;
            let s = r
                .metadata
                .and_then(|m| m.resource_version)
                .unwrap_or_default();
            let rv = s
                .parse::<u64>()
                .map_err(|_| ReflectorError::BadResourceVersion {
                    what: "bookmark",
                    rv: s.to_string(),
                })?;
            Ok(WatchItem::Bookmark(rv))
        }
        "ERROR" => Ok(WatchItem::Error(ApiStatus::parse(0, raw, None))),
        other => Err(ReflectorError::UnknownEventType(other.to_string())),
    }
}

/// Splits a chunked byte stream into newline-terminated lines, with a bounded carry-over.
#[derive(Debug, Default)]
pub(super) struct LineSplitter {
    partial: Vec<u8>,
}

impl LineSplitter {
    /// Appends the complete lines in `chunk` (without their `\n`) to `out`. A line within one
    /// chunk is a zero-copy slice of it; a line spanning chunks is assembled in a fresh buffer.
    pub(super) fn push(
        &mut self,
        mut chunk: Bytes,
        out: &mut Vec<Bytes>,
    ) -> Result<(), ReflectorError> {
        while let Some(pos) = memchr::memchr(b'\n', &chunk) {
            let head = chunk.split_to(pos + 1);
            let line = if self.partial.is_empty() {
                head.slice(..pos)
            } else {
                self.extend(&head[..pos])?;
                Bytes::from(std::mem::take(&mut self.partial))
            };
            out.push(line);
        }
        if !chunk.is_empty() {
            self.extend(&chunk)?;
        }
        Ok(())
    }

    fn extend(&mut self, data: &[u8]) -> Result<(), ReflectorError> {
        if self.partial.len() + data.len() > MAX_EVENT_LINE {
            self.partial = Vec::new();
            return Err(ReflectorError::LineTooLong);
        }
        self.partial.extend_from_slice(data);
        Ok(())
    }

    /// Whether a partial line (not just whitespace) is pending.
    pub(super) fn has_partial(&self) -> bool {
        self.partial.iter().any(|b| !b.is_ascii_whitespace())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cms() -> Resource {
        Resource::core("configmaps", "ConfigMap", true)
    }

    #[test]
    fn event_line_object_is_parsed_and_stripped_of_type_meta() {
        let line = Bytes::from_static(
            br#"{"type":"MODIFIED","object":{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"a","namespace":"ns","resourceVersion":"43"}}}"#,
        );
        let WatchItem::Object(kind, obj) = parse_event_line(&line, &cms()).unwrap() else {
            panic!("not an object event");
        };
        assert_eq!(kind, EventKind::Modified);
        assert_eq!(obj.meta.resource_version, 43);
        assert_eq!(
            &obj.body[..],
            br#"{"metadata":{"name":"a","namespace":"ns","resourceVersion":"43"}}"#
        );
    }

    #[test]
    fn event_line_bookmark_error_and_unknown() {
        let bm = Bytes::from_static(
            br#"{"type":"BOOKMARK","object":{"kind":"ConfigMap","apiVersion":"v1","metadata":{"resourceVersion":"99"}}}"#,
        );
        assert!(matches!(
            parse_event_line(&bm, &cms()).unwrap(),
            WatchItem::Bookmark(99)
        ));
        let err = Bytes::from_static(
            br#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 5 (9)","reason":"Expired","code":410}}"#,
        );
        let WatchItem::Error(s) = parse_event_line(&err, &cms()).unwrap() else {
            panic!("not an error");
        };
        assert!(s.is_expired());
        assert_eq!(s.code, 410);
        let unk = Bytes::from_static(br#"{"type":"WHAT","object":{}}"#);
        assert!(
            matches!(parse_event_line(&unk, &cms()), Err(ReflectorError::UnknownEventType(t)) if t == "WHAT")
        );
        for bad in [
            &br#"{"type":"ADDED""#[..],
            br#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"1"}}"#,
            br#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"1"}]}"#,
            br#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"1"}}} x"#,
        ] {
            assert!(
                matches!(
                    parse_event_line(&Bytes::from_static(bad), &cms()),
                    Err(ReflectorError::Scan { .. } | ReflectorError::Object { .. })
                ),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn line_splitter_handles_lines_across_and_within_chunks() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        s.push(Bytes::from_static(b"{\"a\":1}\n{\"b\""), &mut out)
            .unwrap();
        assert_eq!(out, [Bytes::from_static(b"{\"a\":1}")]);
        assert!(s.has_partial());
        out.clear();
        s.push(Bytes::from_static(b":2"), &mut out).unwrap();
        assert!(out.is_empty());
        s.push(Bytes::from_static(b"}\n\n{\"c\":3}\n"), &mut out)
            .unwrap();
        assert_eq!(
            out,
            [
                Bytes::from_static(b"{\"b\":2}"),
                Bytes::new(),
                Bytes::from_static(b"{\"c\":3}")
            ]
        );
        assert!(!s.has_partial());
    }

    #[test]
    fn line_splitter_refuses_unbounded_lines() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        let big = Bytes::from(vec![b'x'; MAX_EVENT_LINE / 2 + 1]);
        s.push(big.clone(), &mut out).unwrap();
        assert!(matches!(
            s.push(big, &mut out),
            Err(ReflectorError::LineTooLong)
        ));
    }
}
