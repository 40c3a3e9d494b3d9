//! Tests of one resource's cache (`super`).

use super::*;
use bytes::Bytes;
use proptest::prelude::*;

fn pod(ns: &str, name: &str, node: Option<&str>, rv: u64) -> CachedObject {
    let spec = node.map_or(String::new(), |n| {
        format!(r#","spec":{{"nodeName":"{n}"}}"#)
    });
    let raw = format!(
        r#"{{"metadata":{{"name":"{name}","namespace":"{ns}","resourceVersion":"{rv}"}}{spec}}}"#
    );
    CachedObject::parse(Bytes::from(raw), &Resource::core("pods", "Pod", true)).unwrap()
}

fn rebuilt(objects: &Objects) -> imbl::OrdMap<Box<str>, imbl::OrdSet<ObjectKey>> {
    let mut ix = FieldIndex::for_resource(&Resource::core("pods", "Pod", true)).unwrap();
    for (k, o) in objects.iter() {
        ix.update(k, None, Some(o));
    }
    ix.keys
}

/// The history is extended back only with a stretch that leads exactly to its start;
/// then a watch from the stretch's start gets the events with their previous states (a
/// node-selected watcher sees the pod leave its node as DELETED).
#[tokio::test]
async fn the_history_is_extended_back_only_by_a_stretch_that_joins_it() {
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), StoreConfig::default());
    // The state at 20: p on node n2 (moved from n1 at 15), q created at 12.
    cache.replace(
        vec![pod("a", "p", Some("n2"), 15), pod("a", "q", None, 12)],
        20,
    );
    cache.apply(EventKind::Modified, pod("a", "q", None, 21));
    assert_eq!(cache.oldest_rv(), 20);
    let base = || vec![pod("a", "p", Some("n1"), 8), pod("a", "r", None, 9)];
    let good = || {
        vec![
            (EventKind::Added, pod("a", "q", None, 12)),
            (EventKind::Modified, pod("a", "p", Some("n2"), 15)),
            (EventKind::Deleted, pod("a", "r", None, 17)),
        ]
    };
    // Missing the deletion of r: refused, nothing changes.
    let mut short = good();
    short.pop();
    assert!(cache.extend_history(10, base(), short).is_err());
    // Out of order, or past the history's start: refused.
    let mut swapped = good();
    swapped.swap(0, 1);
    assert!(cache.extend_history(10, base(), swapped).is_err());
    let mut late = good();
    late.push((EventKind::Added, pod("a", "z", None, 22)));
    assert!(cache.extend_history(10, base(), late).is_err());
    assert_eq!(cache.oldest_rv(), 20);
    // The real stretch joins.
    assert_eq!(cache.extend_history(10, base(), good()), Ok(3));
    assert_eq!(cache.oldest_rv(), 10);
    let filter = Filter {
        fields: crate::k8s::selector::FieldSelector::parse("spec.nodeName=n1").unwrap(),
        ..Default::default()
    };
    let reg = cache.watch(Start::After(10), Arc::new(filter)).unwrap();
    let got: Vec<_> = reg
        .initial
        .iter()
        .map(|(o, _, d)| (o.meta.name.to_string(), o.meta.resource_version, *d))
        .collect();
    assert_eq!(got, [("p".to_string(), 15, Delivery::Left)]);
    let all = cache.watch(Start::After(9), Arc::new(Filter::default()));
    assert!(matches!(all, Err(WatchError::Expired { .. })));
}

/// A protobuf envelope goes to the object version of its key and resourceVersion: the
/// current one, one in the history, or one the JSON side applies later; a version the
/// JSON side passed without keeping is dropped; a relist keeps unchanged versions'.
#[tokio::test]
async fn protobuf_envelopes_attach_to_their_exact_object_version() {
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), StoreConfig::default());
    let env = |s: &str| Bytes::from(s.to_string());
    let key = |n: &str| ObjectKey::new("a", n);
    // Ahead of the JSON side (not synced yet): waits.
    assert_eq!(
        cache.attach_protobuf(&key("p"), 5, env("p5")),
        Attached::Later
    );
    cache.replace(vec![pod("a", "p", None, 5), pod("a", "q", None, 6)], 10);
    let proto_of = |n: &str| {
        cache
            .current()
            .objects
            .get(&key(n))
            .and_then(|o| o.proto.get().cloned())
    };
    assert_eq!(proto_of("p"), Some(env("p5")));
    assert_eq!(proto_of("q"), None);
    assert_eq!(
        cache.attach_protobuf(&key("q"), 6, env("q6")),
        Attached::Now
    );
    // Another version of q than the one held: not attached to it.
    assert_eq!(
        cache.attach_protobuf(&key("q"), 4, env("q4")),
        Attached::Dropped
    );
    assert_eq!(proto_of("q"), Some(env("q6")));
    // q changes at 11 before its protobuf arrives; the protobuf of 12 (p) comes first.
    assert_eq!(
        cache.attach_protobuf(&key("p"), 12, env("p12")),
        Attached::Later
    );
    cache.apply(EventKind::Modified, pod("a", "q", None, 11));
    cache.apply(EventKind::Modified, pod("a", "p", None, 12));
    assert_eq!(proto_of("p"), Some(env("p12")));
    cache.apply(EventKind::Modified, pod("a", "q", None, 13));
    // q at 11 is only in the history now.
    assert_eq!(
        cache.attach_protobuf(&key("q"), 11, env("q11")),
        Attached::Now
    );
    let (events, _) = cache.changes_since(10).unwrap();
    assert_eq!(events[0].object.proto.get(), Some(&env("q11")));
    assert_eq!(proto_of("q"), None);
    // A relist: p unchanged keeps its envelope, q changed has none.
    cache.replace(vec![pod("a", "p", None, 12), pod("a", "q", None, 20)], 20);
    assert_eq!(proto_of("p"), Some(env("p12")));
    assert_eq!(proto_of("q"), None);
    assert_eq!(cache.protobuf_coverage(), (1, 1, 3));
}

/// The protobuf bound (`cache.protobufMaxBytes`): envelopes are charged as they attach,
/// the charge follows the current objects (a replaced version gives its bytes back), and
/// the attachment that takes the total over the bound sheds the resource: protobuf reads
/// stop, the current objects drop their envelopes, the bytes are released, nothing attaches
/// again and no protobuf reader starts the side again. The budget is shared by every
/// cache built from one configuration.
#[tokio::test]
async fn the_protobuf_bound_sheds_the_resource_that_crosses_it() {
    let budget = Arc::new(crate::cache::proto_budget::ProtoBudget::new(10));
    let cfg = StoreConfig {
        proto_budget: budget.clone(),
        ..StoreConfig::default()
    };
    let pods = ResourceCache::new(Resource::core("pods", "Pod", true), cfg.clone());
    let cms = ResourceCache::new(Resource::core("configmaps", "ConfigMap", true), cfg);
    let env = |n: usize| Bytes::from(vec![b'x'; n]);
    let key = |n: &str| ObjectKey::new("a", n);
    pods.replace(vec![pod("a", "p", None, 5), pod("a", "q", None, 6)], 10);
    cms.replace(vec![pod("a", "c", None, 7)], 10);
    pods.want_protobuf();
    assert!(pods.protobuf_started());
    assert_eq!(pods.attach_protobuf(&key("p"), 5, env(4)), Attached::Now);
    assert_eq!(cms.attach_protobuf(&key("c"), 7, env(3)), Attached::Now);
    assert_eq!(budget.used(), 7, "both caches charge one budget");
    // p changes: its old envelope leaves with the old version once reconciled.
    pods.apply(EventKind::Modified, pod("a", "p", None, 11));
    pods.reconcile_protobuf();
    assert_eq!(budget.used(), 3);
    assert_eq!(pods.attach_protobuf(&key("p"), 11, env(5)), Attached::Now);
    assert_eq!(budget.used(), 8);
    assert!(!pods.proto_shed.is_cancelled());
    pods.proto_synced
        .store(11, std::sync::atomic::Ordering::Relaxed);
    assert!(pods.protobuf_ready());
    // q's 3 bytes take it to 11 > 10: pods is shed, configmaps keeps its envelopes.
    assert_eq!(pods.attach_protobuf(&key("q"), 6, env(3)), Attached::Now);
    assert!(pods.proto_shed.is_cancelled());
    assert!(!pods.protobuf_ready());
    assert_eq!(pods.protobuf_coverage(), (0, 2, 0), "envelopes dropped");
    assert_eq!(
        budget.used(),
        3,
        "only the configmaps' bytes remain charged"
    );
    assert_eq!(
        pods.attach_protobuf(&key("q"), 6, env(3)),
        Attached::Dropped
    );
    // As a late initial-events-end bookmark would.
    pods.proto_synced
        .store(12, std::sync::atomic::Ordering::Relaxed);
    assert!(!pods.protobuf_ready(), "a late bookmark does not revive it");
    assert!(!cms.proto_shed.is_cancelled());
    assert_eq!(cms.protobuf_coverage(), (1, 0, 3));
    // A bound of 0: no protobuf side ever starts.
    let off = ResourceCache::new(
        Resource::core("pods", "Pod", true),
        StoreConfig {
            proto_budget: Arc::new(crate::cache::proto_budget::ProtoBudget::new(0)),
            ..StoreConfig::default()
        },
    );
    off.want_protobuf();
    assert!(!off.protobuf_started());
}

/// Retained snapshots are bounded by the bytes they alone keep alive: once the states
/// replaced after the oldest exceed the bound, the oldest goes when a new walk starts.
#[tokio::test]
async fn retained_snapshots_are_bounded_by_the_bytes_they_keep_alive() {
    let cfg = StoreConfig {
        snapshot_max_bytes: 1000,
        ..StoreConfig::default()
    };
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), cfg);
    cache.replace(vec![pod("a", "p", None, 10)], 10);
    cache.retain(&cache.current());
    let body = pod("a", "p", None, 11).body.len();
    // Replacing the object many times: every earlier state is kept alive by the snapshot.
    let mut rv = 10;
    while (rv - 10) as usize * body <= 1000 {
        rv += 1;
        cache.apply(EventKind::Modified, pod("a", "p", None, rv));
    }
    assert_eq!(cache.retained_snapshots(), (1, Some(10)), "no new walk yet");
    assert!(cache.retained_bytes() > 1000);
    cache.retain(&cache.current());
    assert_eq!(cache.retained_snapshots(), (1, Some(rv)), "the oldest went");
    assert_eq!(cache.retained_bytes(), 0);
}

/// The object bytes follow every add, change, delete and relist.
#[tokio::test]
async fn object_bytes_follow_the_current_state() {
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), StoreConfig::default());
    let len = |o: &CachedObject| o.body.len();
    let (a, b) = (pod("a", "p", None, 10), pod("a", "q", Some("n1"), 10));
    let want = len(&a) + len(&b);
    cache.replace(vec![a, b], 10);
    assert_eq!(cache.object_bytes(), want);
    let changed = pod("a", "p", Some("node-with-a-long-name"), 11);
    let want = want - len(&pod("a", "p", None, 10)) + len(&changed);
    cache.apply(EventKind::Modified, changed);
    assert_eq!(cache.object_bytes(), want);
    cache.apply(EventKind::Deleted, pod("a", "q", Some("n1"), 12));
    assert_eq!(
        cache.object_bytes(),
        len(&pod("a", "p", Some("node-with-a-long-name"), 11))
    );
    cache.replace(vec![], 20);
    assert_eq!(cache.object_bytes(), 0);
}

/// A watch from a resourceVersion the cache no longer has is counted by why: older than
/// the history window, or older than the last relist.
#[tokio::test]
async fn expired_watches_are_counted_by_reason() {
    use std::sync::atomic::Ordering::Relaxed;
    let cfg = StoreConfig {
        history_max_events: 2,
        absorb_relists: false,
        ..StoreConfig::default()
    };
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), cfg);
    let stats = |c: &ResourceCache| {
        (
            c.watch_stats.expired_too_old.load(Relaxed),
            c.watch_stats.expired_relist.load(Relaxed),
        )
    };
    let expired = |c: &ResourceCache, rv| {
        matches!(
            c.watch(Start::After(rv), Arc::new(Filter::default())),
            Err(WatchError::Expired { .. })
        )
    };
    cache.replace(vec![pod("a", "p", None, 10)], 10);
    assert!(expired(&cache, 5), "before the first list");
    assert_eq!(stats(&cache), (1, 0));
    cache.replace(vec![pod("a", "p", None, 20)], 20);
    assert!(expired(&cache, 15), "before the relist");
    assert_eq!(stats(&cache), (1, 1));
    for rv in 21..=24 {
        cache.apply(EventKind::Modified, pod("a", "p", None, rv));
    }
    assert!(
        expired(&cache, 21),
        "trimmed from the history after the relist"
    );
    assert_eq!(stats(&cache), (2, 1));
    assert!(!expired(&cache, 23));
}

/// A relist keeps watchers open: they get the difference as events, then a bookmark at the
/// list's resourceVersion; a watch resumed from before the relist gets the same events.
/// A list that no history explains (older than the state) still closes them.
#[tokio::test]
async fn a_relist_reaches_open_watchers_as_the_difference() {
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), StoreConfig::default());
    cache.replace(
        vec![pod("a", "p", Some("n1"), 10), pod("a", "q", None, 11)],
        12,
    );
    let mut all = cache
        .watch(Start::After(12), Arc::new(Filter::default()))
        .unwrap();
    let on_n1 = Filter {
        fields: crate::k8s::selector::FieldSelector::parse("spec.nodeName=n1").unwrap(),
        ..Filter::default()
    };
    let mut n1 = cache
        .watch(Start::After(12), Arc::new(on_n1.clone()))
        .unwrap();
    // While the proxy's watch was down: p moved to n2 (at 14), q was deleted, r created.
    cache.replace(
        vec![pod("a", "p", Some("n2"), 14), pod("a", "r", Some("n1"), 15)],
        20,
    );
    assert_eq!(cache.relists(), 1);
    assert_eq!(cache.absorbed_relists(), [(12, 20)]);
    async fn got(sub: &mut Subscription, n: usize) -> Vec<(&'static str, String, u64)> {
        let mut v = Vec::new();
        for _ in 0..n {
            let (e, d) = sub.rx.recv().await.expect("an event");
            let ty = match d {
                Delivery::AsIs => e.kind.as_str(),
                Delivery::Entered => "ADDED",
                Delivery::Left => "DELETED",
            };
            v.push((ty, e.object.meta.name.to_string(), e.rv));
        }
        v
    }
    // q's deletion takes the first revision after the old state that no listed object
    // holds.
    let want_all = [
        ("DELETED", "q".to_string(), 13),
        ("MODIFIED", "p".to_string(), 14),
        ("ADDED", "r".to_string(), 15),
    ];
    assert_eq!(got(&mut all.sub, 3).await, want_all);
    assert_eq!(
        got(&mut n1.sub, 2).await,
        [
            ("DELETED", "p".to_string(), 14),
            ("ADDED", "r".to_string(), 15)
        ],
        "a watcher's selector sees the difference as it sees any change"
    );
    assert_eq!(cache.rv(), 20);
    // Resumed from before the relist: the same events, from the history.
    let resumed = cache
        .watch(Start::After(12), Arc::new(Filter::default()))
        .unwrap();
    let replayed: Vec<_> = resumed
        .initial
        .iter()
        .map(|(o, e, _)| {
            (
                e.as_ref().unwrap().kind.as_str(),
                o.meta.name.to_string(),
                o.meta.resource_version,
            )
        })
        .collect();
    assert_eq!(replayed, want_all);
    // From inside the window (a revision of the difference, or a real one the apiserver
    // gave): no exact resume is possible, so 410; no snapshot either.
    for inside in [13, 14, 19] {
        assert!(matches!(
            cache.watch(Start::After(inside), Arc::new(Filter::default())),
            Err(WatchError::Expired { .. })
        ));
        assert!(cache.snapshot_at(inside).is_none());
    }
    assert!(
        cache
            .watch(Start::After(20), Arc::new(Filter::default()))
            .is_ok()
    );
    assert!(
        std::str::from_utf8(&resumed.initial[0].0.body)
            .unwrap()
            .contains(r#""resourceVersion":"13""#)
    );

    // An older list: no history leads there, so watchers are closed (they relist).
    cache.replace(vec![pod("a", "p", Some("n2"), 14)], 18);
    assert_eq!(cache.absorbed_relists(), [(12, 20)]);
    assert!(matches!(
        cache.watch(Start::After(15), Arc::new(Filter::default())),
        Err(WatchError::Expired { .. })
    ));
    assert!(
        all.sub.rx.recv().await.is_none(),
        "the open watcher was closed"
    );
}

/// A cache rebuilt from its image has the same state, history (with each event's previous
/// state), snapshots and absorbed windows; it is ready at once and unconfirmed until its
/// upstream watch reports; a watch resumes from any resourceVersion of the history.
#[tokio::test]
async fn a_restored_cache_is_the_cache_it_was_saved_from() {
    let r = Resource::core("pods", "Pod", true);
    let a = ResourceCache::new(r.clone(), StoreConfig::default());
    assert!(a.image().is_none(), "no image before the first sync");
    a.replace(
        vec![pod("a", "p", Some("n1"), 10), pod("a", "q", None, 11)],
        12,
    );
    a.apply(EventKind::Modified, pod("a", "p", Some("n2"), 13));
    a.apply(EventKind::Added, pod("b", "r", Some("n1"), 14));
    // A relist told as a difference (q gone, r changed).
    a.replace(
        vec![pod("a", "p", Some("n2"), 13), pod("b", "r", None, 17)],
        18,
    );
    a.apply(EventKind::Deleted, pod("a", "p", Some("n2"), 19));
    a.bookmark(21);
    let image = a.image().unwrap();
    assert_eq!((image.rv, image.oldest_rv, image.base.len()), (21, 12, 2));

    let b = ResourceCache::new(r.clone(), StoreConfig::default());
    b.restore(image.clone()).unwrap();
    assert!(b.is_ready() && b.unhealthy().is_some());
    assert_eq!(b.rv(), 21);
    assert_eq!(b.absorbed_relists(), a.absorbed_relists());
    let (ca, cb) = (a.current(), b.current());
    assert_eq!(ca.objects, cb.objects);
    assert_eq!(ca.index.unwrap().keys, cb.index.unwrap().keys);
    assert_eq!(a.object_bytes(), b.object_bytes());
    let history = |c: &ResourceCache| {
        c.changes_since(12)
            .unwrap()
            .0
            .iter()
            .map(|e| (e.kind, e.rv, e.object.clone(), e.prev.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(history(&a), history(&b));
    for at in [12, 13, 14, 18, 19, 21] {
        let (sa, sb) = (a.snapshot_at(at), b.snapshot_at(at));
        assert_eq!(sa.map(|s| s.objects), sb.map(|s| s.objects), "at {at}");
        let ok = |c: &ResourceCache| {
            c.watch(Start::After(at), Arc::new(Filter::default()))
                .is_ok()
        };
        assert_eq!(ok(&a), ok(&b), "resume from {at}");
    }
    assert!(
        b.restore(image).is_err(),
        "only into a cache that has not synced"
    );

    // An image that does not hold together is refused whole.
    let mut bad = a.image().unwrap();
    bad.events.swap(0, 1);
    let c = ResourceCache::new(r, StoreConfig::default());
    assert!(c.restore(bad).is_err());
    assert!(!c.is_ready());
}

/// A warm restart keeps the protobuf side's work: restored from a state whose every
/// current object had its envelope, the cache serves protobuf at once (ready, the bookmark
/// template known, history events with their envelopes) and its side resumes from the
/// saved resourceVersion; from a state missing one, the side starts over (started, not
/// ready, no resume point) but the history keeps what it had; a side that never ran, or a
/// proxy with protobuf turned off, starts nothing.
#[tokio::test]
async fn a_restored_cache_resumes_its_protobuf_side_only_from_a_complete_state() {
    let r = Resource::core("pods", "Pod", true);
    let env = |s: &str| Bytes::from(s.to_string());
    let key = |n: &str| ObjectKey::new("a", n);
    let a = ResourceCache::new(r.clone(), StoreConfig::default());
    a.replace(vec![pod("a", "p", None, 10), pod("a", "q", None, 11)], 12);
    let never = a.image().unwrap();
    assert_eq!(never.protobuf, ProtoImage::default());
    a.want_protobuf();
    a.attach_protobuf(&key("p"), 10, env("p10"));
    a.attach_protobuf(&key("q"), 11, env("q11"));
    *a.proto_bookmark.lock() = Some(("Pod".into(), env("rest")));
    a.protobuf_synced(12);
    a.apply(EventKind::Modified, pod("a", "p", None, 13));
    assert_eq!(a.attach_protobuf(&key("p"), 13, env("p13")), Attached::Now);
    let complete = a.image().unwrap();
    assert!(complete.protobuf.complete && complete.protobuf.started);
    a.apply(EventKind::Added, pod("a", "r", None, 14));
    let partial = a.image().unwrap();
    assert!(!partial.protobuf.complete && partial.protobuf.started);

    let history_envelope = |c: &ResourceCache| {
        let (events, _) = c.changes_since(12).unwrap();
        events[0].object.proto.get().cloned()
    };
    let b = ResourceCache::new(r.clone(), StoreConfig::default());
    b.restore(complete).unwrap();
    assert!(b.protobuf_started() && b.protobuf_ready());
    assert_eq!(b.take_protobuf_resume(), Some(13));
    assert_eq!(b.take_protobuf_resume(), None, "taken once");
    assert_eq!(*b.proto_bookmark.lock(), Some(("Pod".into(), env("rest"))));
    assert_eq!(b.protobuf_coverage(), (2, 0, 6));
    assert_eq!(history_envelope(&b), Some(env("p13")));

    let c = ResourceCache::new(r.clone(), StoreConfig::default());
    c.restore(partial.clone()).unwrap();
    assert!(c.protobuf_started() && !c.protobuf_ready());
    assert_eq!(c.take_protobuf_resume(), None);
    assert_eq!(history_envelope(&c), Some(env("p13")));

    let d = ResourceCache::new(r.clone(), StoreConfig::default());
    d.restore(never).unwrap();
    assert!(!d.protobuf_started() && d.take_protobuf_resume().is_none());

    let off = ResourceCache::new(
        r,
        StoreConfig {
            proto_budget: Arc::new(crate::cache::proto_budget::ProtoBudget::new(0)),
            ..StoreConfig::default()
        },
    );
    off.restore(partial).unwrap();
    assert!(!off.protobuf_started() && !off.protobuf_ready());
    assert_eq!(off.protobuf_coverage(), (0, 3, 0), "envelopes dropped");
    assert_eq!(history_envelope(&off), None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// The node index always equals one rebuilt from the objects: live, at every
    /// resourceVersion rebuilt from the history, and after a relist; a watch of one node
    /// starts with exactly that node's pods.
    #[test]
    fn node_index_follows_every_change(
        initial in proptest::collection::vec(("(a|b)", "[a-d]", proptest::option::of("(n1|n2|)")), 0..12),
        ops in proptest::collection::vec(("(a|b)", "[a-d]", proptest::option::of("(n1|n2|)"), any::<bool>()), 0..30),
    ) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let cache = ResourceCache::new(Resource::core("pods", "Pod", true), StoreConfig::default());
            let mut rv = 10;
            let items = initial.iter().map(|(ns, n, node)| { rv += 1; pod(ns, n, node.as_deref(), rv) }).collect();
            cache.replace(items, rv);
            let first = rv;
            for (ns, n, node, delete) in &ops {
                rv += 1;
                let kind = if *delete { EventKind::Deleted } else { EventKind::Modified };
                cache.apply(kind, pod(ns, n, node.as_deref(), rv));
            }
            let cur = cache.current();
            prop_assert_eq!(&cur.index.as_ref().unwrap().keys, &rebuilt(&cur.objects));
            for at in first..=rv {
                let snap = cache.snapshot_at(at).unwrap();
                prop_assert_eq!(&snap.index.as_ref().unwrap().keys, &rebuilt(&snap.objects));
            }
            for node in ["n1", "n2", ""] {
                let f = Filter {
                    fields: crate::k8s::selector::FieldSelector::parse(&format!("spec.nodeName={node}")).unwrap(),
                    ..Filter::default()
                };
                let want: Vec<ObjectKey> = cur.objects.iter().filter(|(_, o)| f.matches(o)).map(|(k, _)| k.clone()).collect();
                let reg = cache.watch(Start::Initial, Arc::new(f)).unwrap();
                let got: Vec<ObjectKey> = reg.initial.iter().map(|(o, _, _)| o.key()).collect();
                prop_assert_eq!(got, want);
            }
            Ok(())
        })?;
    }
}

/// A backfilled stretch's events are objects of their own, parsed from the backfill's
/// watch: an envelope of a version that is also the current object's (p at 15, unchanged
/// since) goes to the history's event too, so a protobuf watch resuming before it finds
/// it; the current object keeps the one it had.
#[tokio::test]
async fn an_envelope_reaches_a_backfilled_event_of_the_current_version() {
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), StoreConfig::default());
    cache.replace(vec![pod("a", "p", None, 15)], 20);
    cache.want_protobuf();
    let key = ObjectKey::new("a", "p");
    assert_eq!(
        cache.attach_protobuf(&key, 15, Bytes::from_static(b"side")),
        Attached::Now
    );
    let stretch = vec![(EventKind::Modified, pod("a", "p", None, 15))];
    assert_eq!(
        cache.extend_history(10, vec![pod("a", "p", None, 8)], stretch),
        Ok(1)
    );
    let event = || cache.changes_since(10).unwrap().0.remove(0);
    assert!(
        event().object.proto.get().is_none(),
        "not the current object"
    );
    assert_eq!(
        cache.attach_protobuf(&key, 15, Bytes::from_static(b"backfill")),
        Attached::Now
    );
    assert_eq!(event().object.proto.get().unwrap(), "backfill");
    let (current, _) = cache.get("a", "p");
    assert_eq!(current.unwrap().proto.get().unwrap(), "side");
}

/// Past `history_frames_kept` the history holds an event without the frames encoded for its
/// watchers (a watcher that holds the event keeps them); a later reader gets the same
/// event and encodes the same frame again. The newest event is never stripped.
#[tokio::test]
async fn the_history_lets_go_of_an_events_frames_once_its_watchers_were_served() {
    let resource = Resource::core("pods", "Pod", true);
    let cache = |kept| {
        let cfg = StoreConfig {
            history_frames_kept: kept,
            ..StoreConfig::default()
        };
        let c = ResourceCache::new(resource.clone(), cfg);
        c.replace(vec![pod("a", "p", None, 10)], 10);
        c.apply(EventKind::Modified, pod("a", "p", Some("n1"), 11));
        c
    };
    let frame = |e: &Event| {
        e.frame(
            &resource,
            Delivery::AsIs,
            super::super::event::Encoding::Json,
        )
    };
    for (kept, stripped) in [(Duration::ZERO, true), (Duration::from_secs(3600), false)] {
        let c = cache(kept);
        let (events, _) = c.changes_since(10).unwrap();
        let served = events[0].clone();
        let encoded = frame(&served);
        assert!(served.has_frames());
        // The newest event is never looked at: still the same, frames and all.
        std::thread::sleep(Duration::from_millis(2));
        let (again, _) = c.changes_since(10).unwrap();
        assert!(Arc::ptr_eq(&again[0], &served));
        // The next change makes it an older event.
        c.apply(EventKind::Modified, pod("a", "p", Some("n2"), 12));
        let (later, _) = c.changes_since(10).unwrap();
        assert_eq!(later.len(), 2);
        let e = &later[0];
        assert_eq!(!Arc::ptr_eq(e, &served), stripped, "kept {kept:?}");
        assert_eq!(e.has_frames(), !stripped);
        assert_eq!((e.rv, e.kind, e.at), (served.rv, served.kind, served.at));
        assert!(Arc::ptr_eq(&e.object, &served.object));
        // The watcher's copy keeps its frame; a late reader encodes the same bytes.
        assert!(served.has_frames());
        assert_eq!(frame(e), encoded);
    }
}

/// A cache restored from saved state counts as unconfirmed (the proxy's readiness waits for
/// it, bounded) until its resumed upstream watch has proved itself; a cold cache never does.
#[tokio::test]
async fn a_restored_cache_is_unconfirmed_until_its_resumed_watch_proves_itself() {
    let r = Resource::core("pods", "Pod", true);
    let hour = Duration::from_secs(3600);
    let a = ResourceCache::new(r.clone(), StoreConfig::default());
    a.replace(vec![pod("a", "p", None, 10)], 12);
    assert!(!a.restored_unconfirmed(hour), "a cold cache");
    let b = ResourceCache::new(r, StoreConfig::default());
    b.restore(a.image().unwrap()).unwrap();
    assert!(b.restored_unconfirmed(hour));
    assert!(!b.restored_unconfirmed(Duration::ZERO), "past the bound");
    b.set_unhealthy(Some("watch broken".into()));
    assert!(b.restored_unconfirmed(hour));
    b.set_unhealthy(None);
    assert!(!b.restored_unconfirmed(hour));
}

/// A resource that goes quiet after a burst does not hold the burst's events past the
/// history's bounds: `trim_history` applies them without a new event (the newest event
/// stays, as after any record), and is a no-op while nothing is due.
#[tokio::test]
async fn a_quiet_resource_lets_go_of_its_history_past_the_bounds() {
    let cfg = StoreConfig {
        absorb_relists: false,
        ..StoreConfig::default()
    };
    let (max_age, frames_kept) = (cfg.history_max_age, cfg.history_frames_kept);
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), cfg);
    cache.replace(vec![pod("a", "p", None, 10)], 10);
    for rv in 11..=14 {
        cache.apply(EventKind::Modified, pod("a", "p", None, rv));
    }
    let resumable = |c: &ResourceCache, rv| {
        c.watch(Start::After(rv), Arc::new(Filter::default()))
            .is_ok()
    };
    let start = Instant::now();
    // Nothing is due yet: the history and its frames stay.
    cache.trim_history_at(start);
    let (events, _) = cache.changes_since(10).unwrap();
    assert_eq!(events.len(), 4);
    // Served to a watcher: its frame is encoded and held by the event.
    let served = events[0].clone();
    let resource = Resource::core("pods", "Pod", true);
    let _ = served.frame(
        &resource,
        Delivery::AsIs,
        super::super::event::Encoding::Json,
    );
    assert!(served.has_frames());
    // Past the frames' bound, not the history's: the events stay, the history's copies
    // without their frames.
    cache.trim_history_at(start + frames_kept + Duration::from_secs(1));
    let (events, _) = cache.changes_since(10).unwrap();
    assert_eq!(events.len(), 4);
    assert!(!events[0].has_frames());
    assert_eq!(events[0].rv, served.rv);
    assert!(resumable(&cache, 10));
    // Past the history's age: only the newest event is left; a watch from before it is
    // expired, one from it or later resumes.
    cache.trim_history_at(start + max_age + Duration::from_secs(1));
    let (events, _) = cache.changes_since(13).unwrap();
    assert_eq!(events.iter().map(|e| e.rv).collect::<Vec<_>>(), vec![14]);
    assert!(!resumable(&cache, 12));
    assert!(resumable(&cache, 13));
    assert!(resumable(&cache, 14));
    // The newest event stays whatever its age.
    cache.trim_history_at(start + 10 * max_age);
    assert!(resumable(&cache, 13));
}

/// With transcoding (`cache.protobufTranscode`), every object version gets its envelope
/// from its JSON as it is applied (the initial list, events, the history), so protobuf
/// reads are served as soon as the JSON side has synced, with no protobuf watch; the
/// bookmark template is the kind's zero object. An object the schema cannot write turns it
/// off for the resource: protobuf reads wait for the protobuf side's own watch.
#[tokio::test]
async fn transcoded_envelopes_come_with_each_object_version() {
    let cfg = StoreConfig {
        protobuf_transcode: true,
        ..StoreConfig::default()
    };
    let cache = ResourceCache::new(Resource::core("pods", "Pod", true), cfg);
    assert!(cache.transcodes());
    cache.served();
    assert!(
        cache.proto_bookmark.lock().is_some(),
        "template of the zero Pod"
    );
    assert!(!cache.protobuf_ready());
    cache.replace(
        vec![pod("a", "p", Some("n1"), 5), pod("a", "q", None, 6)],
        10,
    );
    assert!(cache.protobuf_ready());
    let envelope_of = |o: &CachedObject| {
        let raw = crate::k8s::transcode::SCHEMA
            .object("", "v1", "Pod", &o.body)
            .unwrap();
        Bytes::from(crate::k8s::protobuf_write::object_envelope(
            "v1", "Pod", &raw,
        ))
    };
    let current = cache.current();
    for o in current.objects.values() {
        assert_eq!(o.proto.get(), Some(&envelope_of(o)));
    }
    cache.apply(EventKind::Modified, pod("a", "p", Some("n2"), 11));
    cache.apply(EventKind::Deleted, pod("a", "q", None, 12));
    let (events, _) = cache.changes_since(10).unwrap();
    assert_eq!(events.len(), 2);
    for e in &events {
        assert_eq!(e.object.proto.get(), Some(&envelope_of(&e.object)));
    }
    let (with, without, _) = cache.protobuf_coverage();
    assert_eq!((with, without), (1, 0));
    assert_eq!(
        cache.transcoded.load(std::sync::atomic::Ordering::Relaxed),
        4
    );

    // A field the schema does not have: transcoding stops, reads wait for the side.
    let raw = r#"{"metadata":{"name":"r","namespace":"a","resourceVersion":"13"},"spec":{"fromTheFuture":true}}"#;
    let future =
        CachedObject::parse(Bytes::from(raw), &Resource::core("pods", "Pod", true)).unwrap();
    cache.apply(EventKind::Added, future);
    assert!(!cache.transcodes());
    assert!(cache.transcode_off.is_cancelled());
    assert!(!cache.protobuf_ready());
    let (with, without, _) = cache.protobuf_coverage();
    assert_eq!((with, without), (1, 1));
}
