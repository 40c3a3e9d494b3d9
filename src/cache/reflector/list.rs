//! The LIST side: one page parsed in a single pass ([`parse_list_page`]), and the pager that
//! GETs every page of a collection into a side buffer.

use http::{Request, header};
use http_body_util::BodyExt as _;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};

use super::config::ReflectorConfig;
use super::error::{ReflectorError, error_response};
use super::stats::ReflectorStats;
use crate::cache::{CachedObject, Resource};
use crate::http::body;
use crate::k8s::scan::{Scalar, ScanError, Scanner};
use crate::upstream::{As, Upstream};

/// Upper bound on the capacity reserved from a list's `remainingItemCount`.
const MAX_RESERVE: usize = 1 << 20;

/// One LIST page.
#[derive(Debug)]
pub struct ListPage {
    pub items: Vec<CachedObject>,
    pub rv: u64,
    /// `metadata.continue`, when more pages follow.
    pub cont: Option<String>,
    pub remaining: Option<u64>,
}

/// Parses a LIST response page in one pass, without building a generic JSON value: the
/// envelope's metadata is read and each item is parsed where it lies
/// ([`CachedObject::scan`]).
///
/// Items are copied out of the page: a slice would keep the whole page buffer alive for as
/// long as any one of its objects stays unmodified in the cache.
pub fn parse_list_page(body: &[u8], resource: &Resource) -> Result<ListPage, ReflectorError> {
    const WHAT: &str = "list";
    let mut s = Scanner::new(body);
    let mut rv_s: Option<String> = None;
    let mut has_meta = false;
    let mut cont = None;
    let mut remaining = None;
    let mut items = Vec::new();
    let mut item_err = None;
    let scanned = s
        .object(|s, k| match &*k {
            "metadata" => {
                has_meta = true;
                s.object(|s, k| {
                    match &*k {
                        "resourceVersion" => {
                            rv_s = s.opt_string()?.map(|v| v.into_owned());
                        }
                        "continue" => cont = s.opt_string()?.map(|v| v.into_owned()),
                        "remainingItemCount" => {
                            let at = s.pos();
                            remaining = match s.scalar()? {
                                Scalar::Null => None,
                                Scalar::Num(n) => {
                                    Some(n.parse::<u64>().map_err(|_| ScanError::Type {
                                        at,
                                        want: "an unsigned integer",
                                    })?)
                                }
                                _ => {
                                    return Err(ScanError::Type {
                                        at,
                                        want: "an unsigned integer",
                                    });
                                }
                            };
                        }
                        _ => s.skip()?,
                    }
                    Ok(())
                })
            }
            "items" => s.array(|s, _| match CachedObject::scan(s, body, resource) {
                Ok(o) => {
                    items.push(o);
                    Ok(())
                }
                Err(e) => {
                    let at = s.pos();
                    item_err = Some(e);
                    Err(ScanError::Syntax(at))
                }
            }),
            _ => s.skip(),
        })
        .and_then(|()| s.end());
    if let Some(source) = item_err {
        return Err(ReflectorError::Object { what: WHAT, source });
    }
    scanned.map_err(|source| ReflectorError::Scan { what: WHAT, source })?;
    if !has_meta {
        return Err(ReflectorError::BadResourceVersion {
            what: WHAT,
            rv: String::new(),
        });
    }
    let rv_s = rv_s.unwrap_or_default();
    let rv = rv_s
        .parse::<u64>()
        .map_err(|_| ReflectorError::BadResourceVersion {
            what: WHAT,
            rv: rv_s.clone(),
        })?;
    Ok(ListPage {
        items,
        rv,
        cont: cont.filter(|c| !c.is_empty()),
        remaining,
    })
}

/// Lists one resource's collection for a reflector, page by page.
pub(super) struct Pager<'a> {
    pub(super) upstream: &'a Upstream,
    pub(super) resource: &'a Resource,
    pub(super) cfg: &'a ReflectorConfig,
    pub(super) stats: &'a ReflectorStats,
    /// List the state at exactly this resourceVersion (`resourceVersionMatch=Exact`, a
    /// backfill's base) instead of the most recent one.
    pub(super) exact: Option<u64>,
}

impl Pager<'_> {
    /// Lists every page into a side buffer. On error, also says whether it happened on a
    /// continue page.
    pub(super) async fn list(
        &self,
        paged: bool,
    ) -> Result<(Vec<CachedObject>, u64), (ReflectorError, bool)> {
        let path = self.resource.collection_path(None);
        let mut items: Vec<CachedObject> = Vec::new();
        let mut cont: Option<String> = None;
        // One buffer for every page of this list: a page is copied object by object out of
        // it, so it is free again once parsed, and a large list does not allocate (and fault
        // in) a fresh multi-megabyte buffer per page. Dropped with the list.
        let mut page_buf: Vec<u8> = Vec::new();
        loop {
            let on_continue = cont.is_some();
            // Read per page: an adaptive size follows the load even during a long list (the
            // apiserver accepts a different limit with each continue token).
            let limit = self.cfg.current_page_size();
            let pq = match (&cont, paged) {
                (Some(c), _) => format!(
                    "{path}?limit={limit}&continue={}",
                    utf8_percent_encode(c, NON_ALPHANUMERIC)
                ),
                (None, true) => match self.exact {
                    Some(rv) => format!(
                        "{path}?limit={limit}&resourceVersion={rv}&resourceVersionMatch=Exact"
                    ),
                    None => format!("{path}?limit={limit}"),
                },
                (None, false) => match self.exact {
                    Some(rv) => format!("{path}?resourceVersion={rv}&resourceVersionMatch=Exact"),
                    None => path.clone(),
                },
            };
            ReflectorStats::inc(&self.stats.list_pages);
            self.get_page(&pq, &mut page_buf)
                .await
                .map_err(|e| (e, on_continue))?;
            ReflectorStats::add(&self.stats.list_bytes, page_buf.len());
            let page = parse_list_page(&page_buf, self.resource).map_err(|e| (e, on_continue))?;
            if let Some(rem) = page.remaining {
                items.reserve(usize::try_from(rem).unwrap_or(MAX_RESERVE).min(MAX_RESERVE));
            }
            items.extend(page.items);
            match page.cont {
                Some(c) if paged => cont = Some(c),
                _ => return Ok((items, page.rv)),
            }
        }
    }

    /// GETs one list page into `buf` (cleared first).
    async fn get_page(&self, pq: &str, buf: &mut Vec<u8>) -> Result<(), ReflectorError> {
        const WHAT: &str = "list";
        let req = Request::get(self.upstream.uri(pq))
            .header(header::ACCEPT, "application/json")
            .body(body::empty())
            .expect("a GET with a valid URI is a valid request");
        let fetch = async {
            let resp = self
                .upstream
                .send(req, As::Proxy, false)
                .await
                .map_err(|source| ReflectorError::Transport { what: WHAT, source })?;
            crate::telemetry::set_status_code(resp.status().as_u16());
            if !resp.status().is_success() {
                return Err(error_response(WHAT, resp).await);
            }
            buf.clear();
            let mut body = resp.into_body();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| ReflectorError::Body {
                    what: WHAT,
                    source: e.into(),
                })?;
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                }
            }
            Ok(())
        };
        let timeout = self.cfg.request_timeout;
        let timed = async {
            tokio::time::timeout(timeout, fetch)
                .await
                .unwrap_or(Err(ReflectorError::Timeout {
                    what: WHAT,
                    timeout,
                }))
        };
        // A span per page: the cache's own trace (`telemetry`), its `traceparent` upstream.
        self.upstream
            .telemetry()
            .in_root_span(
                || format!("LIST {}", self.resource.label()),
                || super::span_attrs(self.resource, pq),
                timed,
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cms() -> Resource {
        Resource::core("configmaps", "ConfigMap", true)
    }

    #[test]
    fn list_page_parses_envelope_and_items_without_type_meta() {
        let body = br#"{"kind":"ConfigMapList","apiVersion":"v1","metadata":{"resourceVersion":"42","continue":"abc","remainingItemCount":3},"items":[{"metadata":{"name":"a","namespace":"ns","resourceVersion":"40"},"data":{"k":"v"}},{"metadata":{"name":"b","namespace":"ns","resourceVersion":"41"}}]}"#;
        let p = parse_list_page(body, &cms()).unwrap();
        assert_eq!(p.rv, 42);
        assert_eq!(p.cont.as_deref(), Some("abc"));
        assert_eq!(p.remaining, Some(3));
        let names: Vec<&str> = p.items.iter().map(|o| &*o.meta.name).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            &p.items[0].body[..],
            br#"{"metadata":{"name":"a","namespace":"ns","resourceVersion":"40"},"data":{"k":"v"}}"#
        );
    }

    #[test]
    fn list_page_last_page_empty_continue_and_null_items() {
        let p = parse_list_page(
            br#"{"metadata":{"resourceVersion":"7","continue":""},"items":null}"#,
            &cms(),
        )
        .unwrap();
        assert_eq!((p.rv, p.cont, p.items.len()), (7, None, 0));
    }

    #[test]
    fn list_page_without_resource_version_is_an_error() {
        let e = parse_list_page(br#"{"metadata":{},"items":[]}"#, &cms()).unwrap_err();
        assert!(
            matches!(e, ReflectorError::BadResourceVersion { .. }),
            "{e}"
        );
        let e = parse_list_page(
            br#"{"metadata":{"resourceVersion":"1"},"items":[{"metadata":{}}]}"#,
            &cms(),
        )
        .unwrap_err();
        assert!(matches!(e, ReflectorError::Object { .. }), "{e}");
    }
}
