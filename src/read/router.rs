//! The cache-or-passthrough decision: one pure function, table-tested.
//!
//! Keep in step with what the cache implements exactly: a request is served from memory only
//! when every parameter it carries is understood; anything else goes to the apiserver, which
//! also writes the exact errors for invalid requests. Mirrors the spirit of
//! k8s.io/apiserver `shouldDelegateList`.

use std::sync::Arc;

use http::Method;

use crate::cache::ResourceCache;
use crate::cache::event::Encoding;
use crate::cache::hub::Filter;
use crate::k8s::fields::{FieldCheck, check_field_selector};
use crate::k8s::request_info::RequestInfo;
use crate::k8s::selector::{FieldSelector, LabelSelector};
use crate::read::plan::{self, ListParams, ReadAt, WatchParams};
use crate::read::{Served, delegate};

#[derive(Debug)]
pub enum Route {
    Watch {
        cache: Arc<ResourceCache>,
        params: WatchParams,
        filter: Filter,
        enc: Encoding,
    },
    Get {
        cache: Arc<ResourceCache>,
        enc: Encoding,
        /// `Latest` (subject to the consistency policy) or `Any`.
        at: ReadAt,
    },
    List {
        cache: Arc<ResourceCache>,
        filter: Filter,
        enc: Encoding,
        params: ListParams,
    },
}

impl Route {
    /// The cache the request reads.
    pub fn cache(&self) -> &Arc<ResourceCache> {
        match self {
            Route::Watch { cache, .. } | Route::Get { cache, .. } | Route::List { cache, .. } => {
                cache
            }
        }
    }
}

/// What a response may be encoded as, from `Accept` (in the client's order of preference).
/// `None` when nothing the cache writes is acceptable (protobuf only, `as=Table`).
pub fn negotiate(accept: Option<&str>, list: bool) -> Option<Encoding> {
    let Some(accept) = accept.filter(|a| !a.trim().is_empty()) else {
        return Some(Encoding::Json);
    };
    for mt in accept.split(',') {
        let mut parts = mt.split(';').map(str::trim);
        let ty = parts.next().unwrap_or("");
        let mut as_ = None;
        let mut g = None;
        let mut v = None;
        for p in parts {
            match p.split_once('=') {
                Some(("as", x)) => as_ = Some(x),
                Some(("g", x)) => g = Some(x),
                Some(("v", x)) => v = Some(x),
                _ => {}
            }
        }
        if !matches!(ty, "application/json" | "*/*" | "application/*") {
            continue;
        }
        match (as_, g, v) {
            (None, _, _) => return Some(Encoding::Json),
            (Some("PartialObjectMetadataList"), Some("meta.k8s.io"), Some("v1")) if list => {
                return Some(Encoding::Metadata);
            }
            (Some("PartialObjectMetadata"), Some("meta.k8s.io"), Some("v1")) if !list => {
                return Some(Encoding::Metadata);
            }
            // Watches of metadata informers ask for the list form of the type as well.
            (Some("PartialObjectMetadataList"), Some("meta.k8s.io"), Some("v1")) => {
                return Some(Encoding::Metadata);
            }
            _ => continue,
        }
    }
    None
}

/// The filter for a request's scope and selectors; `None` when the apiserver must answer
/// (invalid selectors get its exact 400; fields the cache cannot evaluate exactly).
fn filter_for(
    cache: &ResourceCache,
    namespace: &str,
    labels: &str,
    fields: &str,
) -> Option<Filter> {
    let labels = LabelSelector::parse(labels).ok()?;
    let fields = FieldSelector::parse(fields).ok()?;
    let fields = match check_field_selector(&cache.resource, &fields) {
        FieldCheck::Cache(f) => f,
        FieldCheck::Reject(_) | FieldCheck::Passthrough => return None,
    };
    Some(Filter {
        namespace: (!namespace.is_empty()).then(|| namespace.to_string()),
        labels,
        fields,
        namespaces: None,
    })
}

/// Decides where a request goes: a cache read, or the apiserver (with the reason).
/// `lookup(group, version, resource)` finds a cache.
pub fn route(
    method: &Method,
    info: &RequestInfo,
    query: Option<&str>,
    accept: Option<&str>,
    lookup: impl Fn(&str, &str, &str) -> Option<Arc<ResourceCache>>,
) -> Served<Route> {
    if *method != Method::GET {
        return delegate("not a read");
    }
    if !info.is_resource_request || !info.subresource.is_empty() {
        return delegate("not a cacheable resource request");
    }
    let Some(cache) = lookup(&info.api_group, &info.api_version, &info.resource) else {
        return delegate("resource not cached");
    };
    if !cache.is_ready() {
        return delegate("cache not synced");
    }
    // A namespaced path for a cluster-scoped resource (or the reverse) is the apiserver's
    // 404 to write.
    if !cache.resource.namespaced && !info.namespace.is_empty() && info.resource != "namespaces" {
        return delegate("namespace on a cluster-scoped resource");
    }
    let ns = if info.resource == "namespaces" {
        ""
    } else {
        info.namespace.as_str()
    };
    match info.verb.as_str() {
        "watch" if info.name.is_empty() => {
            let Some(enc) = negotiate(accept, true) else {
                return delegate("encoding");
            };
            let Some(params) = WatchParams::parse(query) else {
                return delegate("watch parameters");
            };
            // A watch without resourceVersion asks for the most recent state; while the
            // upstream watch is down or unconfirmed the cache may be behind, so the
            // apiserver serves it.
            if params.resource_version.as_deref().unwrap_or("").is_empty()
                && cache.unhealthy().is_some()
            {
                return delegate("cache unconfirmed for a most-recent watch");
            }
            let Some(filter) =
                filter_for(&cache, ns, &params.label_selector, &params.field_selector)
            else {
                return delegate("selector");
            };
            Ok(Route::Watch {
                cache,
                params,
                filter,
                enc,
            })
        }
        "get" if !info.name.is_empty() => {
            let Some(enc) = negotiate(accept, false) else {
                return delegate("encoding");
            };
            // resourceVersion=0 ("any") or unset (most recent, when the consistency policy
            // confirms the cache); anything else is the apiserver's.
            let Some(at) = plan::get(query) else {
                return delegate("get parameters");
            };
            Ok(Route::Get { cache, enc, at })
        }
        "list" => {
            let Some(enc) = negotiate(accept, true) else {
                return delegate("encoding");
            };
            let params = match ListParams::parse(query) {
                Ok(p) => p,
                Err(why) => return delegate(why),
            };
            let Some(filter) =
                filter_for(&cache, ns, &params.label_selector, &params.field_selector)
            else {
                return delegate("selector");
            };
            // A cluster-wide list narrowed to one namespace by field selector is read from
            // that namespace's keys by the apiserver, which then pages it inconsistently
            // (kube-apiserver 1.36 repeats the first page): leave paging such lists to it.
            if filter.namespace.is_none()
                && params.limit > 0
                && filter.fields.exact_value("metadata.namespace").is_some()
            {
                return delegate("namespace field selector with limit");
            }
            Ok(Route::List {
                cache,
                filter,
                enc,
                params,
            })
        }
        _ => delegate("verb"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_prefers_the_clients_order() {
        assert_eq!(negotiate(None, true), Some(Encoding::Json));
        assert_eq!(
            negotiate(Some("application/json"), true),
            Some(Encoding::Json)
        );
        assert_eq!(
            negotiate(Some("application/vnd.kubernetes.protobuf, */*"), true),
            Some(Encoding::Json)
        );
        assert_eq!(
            negotiate(Some("application/vnd.kubernetes.protobuf"), true),
            None
        );
        assert_eq!(
            negotiate(
                Some(
                    "application/vnd.kubernetes.protobuf;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
                ),
                true
            ),
            Some(Encoding::Metadata)
        );
        assert_eq!(
            negotiate(
                Some("application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"),
                false
            ),
            Some(Encoding::Metadata)
        );
        assert_eq!(
            negotiate(Some("application/json;as=Table;v=v1;g=meta.k8s.io"), true),
            None
        );
        assert_eq!(
            negotiate(
                Some("application/json;as=Table;v=v1;g=meta.k8s.io,application/json"),
                true
            ),
            Some(Encoding::Json)
        );
    }
}
