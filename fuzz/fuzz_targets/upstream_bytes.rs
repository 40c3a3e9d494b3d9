//! What the apiserver sends, through the readers the cache runs on it: the JSON scanner,
//! objects, watch event lines and list pages (JSON), and protobuf watch frames, envelopes,
//! `ObjectMeta` and `Status`. The apiserver is authenticated, but a reader that panics on
//! any input would take the proxy down with one bad byte: none may.

#![no_main]

use bytes::Bytes;
use kube_cache_proxy::cache::object::CachedObject;
use kube_cache_proxy::cache::reflector::list::parse_list_page;
use kube_cache_proxy::cache::reflector::proto::frame;
use kube_cache_proxy::cache::reflector::watch::parse_event_line;
use kube_cache_proxy::k8s::protobuf;
use kube_cache_proxy::k8s::resource::Resource;
use kube_cache_proxy::k8s::scan::Scanner;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let pods = Resource::core("pods", "Pod", true);
    let mut s = Scanner::new(data);
    let _ = s.skip();
    let b = Bytes::copy_from_slice(data);
    let _ = CachedObject::parse(b.clone(), &pods);
    let _ = parse_event_line(&b, &pods);
    let _ = parse_list_page(data, &pods);
    let _ = frame::decode(&b);
    let _ = protobuf::watch_event(data);
    let _ = protobuf::object_resource_version(data);
    if let Some(env) = protobuf::envelope(data) {
        if let Some(meta) = protobuf::object_meta(env.raw) {
            let _ = meta.labels().count();
            let _ = meta.annotations().count();
        }
    }
    if let Some(meta) = protobuf::object_meta(data) {
        let _ = meta.labels().count();
        // One annotation read alone is what the whole walk finds last for its key.
        for (key, _) in meta.annotations() {
            let last = meta
                .annotations()
                .filter(|(k, _)| *k == key)
                .last()
                .map(|(_, v)| v);
            assert_eq!(meta.annotation(key), last, "annotation {key:?}");
        }
    }
    let _ = protobuf::status(data);
});
