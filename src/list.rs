//! GET and LIST with `resourceVersion=0` served from the cache (the full list rules,
//! pagination and continue tokens come with the lists issue).

use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use http::{HeaderValue, Response, header};

use crate::body::{self, Body};
use crate::cache::ResourceCache;
use crate::cache::event::{Encoding, put_object};
use crate::hub::Filter;

fn json(b: BytesMut) -> Response<Body> {
    let mut r = Response::new(body::full(b.freeze()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// One object, or `None` when the cache does not hold it (the caller passes through, so a
/// 404 comes from the apiserver in its exact form, and an object newer than the cache is
/// still found).
pub fn get(
    cache: &ResourceCache,
    namespace: &str,
    name: &str,
    enc: Encoding,
) -> Option<Response<Body>> {
    let ns = if cache.resource.namespaced {
        namespace
    } else {
        ""
    };
    let (obj, _) = cache.get(ns, name);
    let obj = obj?;
    let mut b = BytesMut::with_capacity(obj.body.len() + 64);
    put_object(&mut b, &cache.resource, &obj.body, enc);
    Some(json(b))
}

/// Every object matching `filter`, at the cache's current resourceVersion, in key order.
pub fn list(cache: &Arc<ResourceCache>, filter: &Filter, enc: Encoding) -> Response<Body> {
    // An O(1) snapshot; serialisation happens without any lock.
    let (objects, rv) = cache.snapshot();
    let r = &cache.resource;
    let mut b = BytesMut::with_capacity(4096);
    match enc {
        Encoding::Json => {
            b.put_slice(b"{\"kind\":\"");
            b.put_slice(r.list_kind().as_bytes());
            b.put_slice(b"\",\"apiVersion\":\"");
            b.put_slice(r.api_version().as_bytes());
            b.put_slice(b"\"");
        }
        Encoding::Metadata => b.put_slice(
            b"{\"kind\":\"PartialObjectMetadataList\",\"apiVersion\":\"meta.k8s.io/v1\"",
        ),
    }
    b.put_slice(format!(",\"metadata\":{{\"resourceVersion\":\"{rv}\"}},\"items\":[").as_bytes());
    let mut first = true;
    // Keys order by namespace first, so a namespace's objects are one contiguous range: a
    // namespaced list reads only its namespace.
    let scoped: Box<dyn Iterator<Item = &Arc<crate::cache::CachedObject>>> = match &filter.namespace
    {
        Some(ns) => Box::new(
            objects
                .range(crate::cache::ObjectKey::new(ns, "")..)
                .take_while(move |(k, _)| &*k.namespace == ns.as_str())
                .map(|(_, o)| o),
        ),
        None => Box::new(objects.values()),
    };
    for o in scoped.filter(|o| filter.matches(o)) {
        if !first {
            b.put_u8(b',');
        }
        first = false;
        match enc {
            // List items carry no kind/apiVersion, as the apiserver writes them.
            Encoding::Json => b.put_slice(&o.body),
            Encoding::Metadata => put_object(&mut b, r, &o.body, enc),
        }
    }
    b.put_slice(b"]}");
    json(b)
}
