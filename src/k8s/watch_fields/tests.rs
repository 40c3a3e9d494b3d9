use super::slots::IndexNode;
use super::*;
use serde_json::json;

fn f(s: &str) -> WatchFields {
    WatchFields::parse(s).unwrap()
}

/// The direct evaluation, checked against the decision from the event's changed paths.
fn ch(f: &WatchFields, old: &Value, new: &Value) -> bool {
    let direct = f.changed(old, new);
    assert_eq!(
        f.changed_in(&ChangeSet::new(old, new)),
        direct,
        "{} on {old} -> {new}",
        f.canonical()
    );
    direct
}

/// Small JSON values: objects of a few keys (some of them the ones the ignore form
/// always ignores), nested, with scalars, lists and nulls, so that subtrees are often
/// equal, missing or of another kind.
fn value() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just(Value::Null),
        (0i64..2).prop_map(|n| json!(n)),
        Just(json!([0])),
        Just(json!({})),
        Just(json!("s")),
    ];
    leaf.prop_recursive(4, 40, 4, |inner| {
        proptest::collection::btree_map("a|b|metadata|resourceVersion", inner, 0..4)
            .prop_map(|m| Value::Object(m.into_iter().collect()))
    })
}

/// A value and a variant of it: equal, one subtree replaced, or unrelated.
fn pair() -> impl proptest::strategy::Strategy<Value = (Value, Value)> {
    use proptest::prelude::*;
    (
        value(),
        value(),
        0u8..3,
        "a|b|metadata",
        "a|b|resourceVersion",
    )
        .prop_map(|(a, b, how, k1, k2)| match how {
            0 => (a.clone(), a),
            1 => {
                let mut n = a.clone();
                match n.as_object_mut() {
                    Some(m) => match m.get_mut(&k1).and_then(Value::as_object_mut) {
                        Some(inner) => {
                            inner.insert(k2, b);
                        }
                        None => {
                            m.insert(k1, b);
                        }
                    },
                    None => n = b,
                }
                (a, n)
            }
            _ => (a, b),
        })
}

fn header() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    (
        any::<bool>(),
        proptest::collection::vec(
            proptest::collection::vec("a|b|metadata|resourceVersion", 1..4),
            1..4,
        ),
    )
        .prop_map(|(ignore, paths)| {
            paths
                .iter()
                .map(|p| format!("{}{}", if ignore { "-" } else { "" }, p.join(".")))
                .collect::<Vec<_>>()
                .join(",")
        })
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(2000))]
    /// The decision from an event's changed paths is the direct comparison's, for both
    /// forms, over generated objects and filters (nested, missing, null, kind changes).
    #[test]
    fn the_changed_paths_decide_as_the_direct_comparison(
        (old, new) in pair(),
        h in header(),
        g in header(),
    ) {
        let set = ChangeSet::new(&old, &new);
        proptest::prop_assert_eq!(set.is_empty(), same(Some(&old), Some(&new)));
        for hv in [h, g] {
            let f = f(&hv);
            proptest::prop_assert_eq!(
                f.changed_in(&set), f.changed(&old, &new),
                "{} on {} -> {}", f.canonical(), old, new
            );
        }
    }
}

#[test]
fn the_changed_paths_are_those_that_differ() {
    let old = json!({"metadata": {"resourceVersion": "1", "labels": {"a": "1"}},
                     "data": {"k1": "v", "k2": "v", "k3": null}, "list": [1]});
    let new = json!({"metadata": {"resourceVersion": "2", "labels": {"a": "1"}},
                     "data": {"k1": "w", "k2": "v"}, "list": [1], "spec": {}});
    // The object, metadata, metadata.resourceVersion, data, data.k1, spec.
    assert_eq!(ChangeSet::new(&old, &new).len(), 6);
    assert!(ChangeSet::new(&old, &old).is_empty());
    // The same filter content from two requests is one filter; a prefix subsumes.
    assert_eq!(f("data, data.k1"), f("data"));
    assert_eq!(f("data").id(), f(" data ").id());
    assert_ne!(f("data"), f("-data"));
    assert!(ch(&f("data[k1]"), &old, &new));
    assert!(!ch(&f("data.k2,data.k3,list,metadata.labels"), &old, &new));
    assert!(ch(&f("-metadata,-data"), &old, &new), "spec appeared");
    assert!(!ch(&f("-metadata,-data,-spec"), &old, &new));
}

#[test]
fn distinct_filters_are_bounded_per_resource_and_per_identity() {
    let reg = Arc::new(Registry::default());
    let lim = Limits {
        per_resource: 3,
        per_identity: 2,
    };
    let a = |s: &str| Arc::new(f(s));
    let l1 = reg.admit(&a("spec"), "alice", lim).unwrap();
    let l2 = reg.admit(&a("status"), "alice", lim).unwrap();
    // Her third distinct filter is refused; one she holds is not, nor someone else's.
    assert_eq!(
        reg.admit(&a("data"), "alice", lim).unwrap_err(),
        Refused::Identity { limit: 2 }
    );
    let l3 = reg.admit(&a(" spec "), "alice", lim).unwrap();
    let l4 = reg.admit(&a("data"), "bob", lim).unwrap();
    assert_eq!(reg.distinct(), 3);
    // The resource is full: a new filter is refused for anyone, one in use is not.
    let e = reg.admit(&a("metadata"), "carol", lim).unwrap_err();
    assert_eq!(e, Refused::Resource { limit: 3 });
    assert!(e.to_string().contains("maxFiltersPerResource"), "{e}");
    let l5 = reg.admit(&a("status"), "carol", lim).unwrap();
    assert_eq!(reg.refused_identity.load(Ordering::Relaxed), 1);
    assert_eq!(reg.refused_resource.load(Ordering::Relaxed), 1);
    // Released as the watches end: a filter goes with its last lease.
    drop(l1);
    assert_eq!(reg.distinct(), 3, "alice still watches with spec");
    drop(l3);
    assert_eq!(reg.distinct(), 2);
    reg.admit(&a("metadata"), "carol", lim).unwrap();
    drop((l2, l4, l5));
    assert_eq!((reg.distinct(), reg.identities()), (0, 0));
    // A limit of 0 admits no filter.
    let none = Limits {
        per_resource: 0,
        per_identity: 5,
    };
    assert!(reg.admit(&a("spec"), "alice", none).is_err());
}

/// A deterministic pseudo-random generator (xorshift64*), for repeatable generated cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

/// Keys of the generated objects and paths: field names, the ones the ignore form always
/// ignores, and map keys only a `[key]` can name.
const KEYS: &[&str] = &["a", "b", "metadata", "resourceVersion", "k.io/x", "l"];

fn random_value(r: &mut Rng, depth: usize) -> Value {
    match r.below(if depth == 0 { 6 } else { 9 }) {
        0 => Value::Null,
        1 => json!(r.below(2)),
        2 => json!([r.below(2)]),
        3 => json!({}),
        4 => json!("s"),
        5 => json!(true),
        _ => {
            let mut m = serde_json::Map::new();
            for _ in 0..r.below(4) {
                m.insert(r.pick(KEYS).to_string(), random_value(r, depth - 1));
            }
            Value::Object(m)
        }
    }
}

/// `v` with a few random changes: a subtree replaced, a key removed or added, a `null`.
fn mutate(r: &mut Rng, v: &Value, depth: usize) -> Value {
    match v {
        Value::Object(m) if depth > 0 && r.below(5) != 0 => {
            let mut m = m.clone();
            for _ in 0..1 + r.below(2) {
                let k = r.pick(KEYS).to_string();
                match r.below(4) {
                    0 => {
                        m.remove(&k);
                    }
                    1 => {
                        m.insert(k, Value::Null);
                    }
                    2 => {
                        let inner = m.get(&k).cloned().unwrap_or(Value::Null);
                        m.insert(k, mutate(r, &inner, depth - 1));
                    }
                    _ => {
                        m.insert(k, random_value(r, depth - 1));
                    }
                }
            }
            Value::Object(m)
        }
        _ if r.below(3) == 0 => v.clone(),
        _ => random_value(r, depth),
    }
}

/// A header of 1 to 5 paths of 1 to 4 segments (nested, map keys, often prefixes of one
/// another), all selected or all ignored.
fn random_header(r: &mut Rng) -> String {
    let ignore = r.below(3) == 0;
    let mut paths: Vec<String> = Vec::new();
    for _ in 0..1 + r.below(5) {
        let mut p = match paths.last() {
            // Often a path under or beside the previous one.
            Some(prev) if r.below(3) == 0 => prev.clone(),
            _ => String::new(),
        };
        for _ in 0..1 + r.below(if p.is_empty() { 4 } else { 2 }) {
            let k = r.pick(KEYS);
            if p.is_empty() && k.contains('.') {
                p.push('a');
            }
            if k.contains('.') || (!p.is_empty() && r.below(4) == 0) {
                p.push_str(&format!("[{k}]"));
            } else {
                if !p.is_empty() {
                    p.push('.');
                }
                p.push_str(k);
            }
        }
        paths.push(p);
    }
    let sign = if ignore { "-" } else { "" };
    paths
        .iter()
        .map(|p| format!("{sign}{p}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The trie is exactly the held select filters' paths: each end where its filter's
/// position says, no node without ends or children but the root, the slots' books right.
fn check_index(reg: &Registry) {
    let ix = reg.index.lock();
    fn walk(n: &IndexNode, path: &mut Vec<String>, ix: &Index, ends: &mut usize, root: bool) {
        assert!(
            root || !n.ends.is_empty() || !n.children.is_empty(),
            "{path:?} is empty"
        );
        for (at, &(s, j)) in n.ends.iter().enumerate() {
            let st = &ix.slots[s as usize];
            let f = st.filter.as_ref().expect("a slot in the trie is held");
            assert!(!f.ignore);
            assert_eq!(f.paths[j as usize], *path);
            assert_eq!(st.pos[j as usize] as usize, at);
            *ends += 1;
        }
        for (k, c) in &n.children {
            path.push(k.to_string());
            walk(c, path, ix, ends, false);
            path.pop();
        }
    }
    let mut ends = 0;
    walk(&ix.root, &mut Vec::new(), &ix, &mut ends, true);
    let held: Vec<_> = ix.slots.iter().filter(|s| s.filter.is_some()).collect();
    assert_eq!(held.len(), ix.by_filter.len());
    assert_eq!(held.len() + ix.free.len(), ix.slots.len());
    assert!(held.iter().all(|s| s.holds > 0));
    let select: Vec<_> = held
        .iter()
        .filter_map(|s| s.filter.as_ref().filter(|f| !f.ignore))
        .collect();
    assert_eq!(select.len(), ix.select);
    assert_eq!(ends, select.iter().map(|f| f.paths.len()).sum::<usize>());
    for (f, &s) in &ix.by_filter {
        assert_eq!(ix.slots[s as usize].filter.as_deref(), Some(&**f));
    }
}

/// For generated filters of both forms (nested paths, map keys, prefixes of one another,
/// equal filters written differently) and generated pairs of objects, the decisions by
/// slot (the select filters all marked by one walk of the trie, the ignore filters each
/// decided once) equal each filter's own decision and the direct comparison, while
/// watchers come and go between events (slots freed and reused, paths leaving the trie).
#[test]
fn decisions_by_slot_are_each_filters_own() {
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    let reg = Arc::new(Registry::default());
    let mut held: Vec<Slot> = Vec::new();
    let mut d = Decisions::default();
    let (mut decided, mut changed) = (0, 0);
    for event in 0..3000 {
        // Watchers come and go.
        for _ in 0..r.below(6) {
            if !held.is_empty() && r.below(2) == 0 {
                let i = r.below(held.len());
                held.swap_remove(i);
            } else if held.len() < 60 {
                let h = random_header(&mut r);
                held.push(reg.intern(&Arc::new(f(&h))));
                // Sometimes the same filter again, written otherwise.
                if r.below(4) == 0 {
                    let mut items: Vec<&str> = h.split(',').collect();
                    items.reverse();
                    let again = Arc::new(f(&format!(" {} ", items.join(" , "))));
                    let s = reg.intern(&again);
                    assert_eq!(s.index(), held.last().unwrap().index());
                    held.push(s);
                }
            }
        }
        if event % 50 == 0 {
            check_index(&reg);
        }
        let old = random_value(&mut r, 4);
        let new = mutate(&mut r, &old, 4);
        let set = ChangeSet::new(&old, &new);
        d.begin();
        let n = held.len();
        let start = r.below(n.max(1));
        for i in 0..n {
            let s = &held[(start + i) % n];
            let got = d.decide(s, &set);
            let direct = s.filter().changed(&old, &new);
            assert_eq!(
                got,
                s.filter().changed_in(&set),
                "{} on {old} -> {new}",
                s.filter().canonical()
            );
            assert_eq!(got, direct, "{} on {old} -> {new}", s.filter().canonical());
            assert_eq!(d.lookup(s), Some(got), "decided once per event");
            decided += 1;
            changed += usize::from(got);
        }
        // One walk for the select filters, one decision per distinct ignore filter.
        let ignore: std::collections::HashSet<usize> = held
            .iter()
            .filter(|s| s.filter().ignore)
            .map(Slot::index)
            .collect();
        assert!(d.evaluations() as usize <= 1 + ignore.len());
    }
    // Both outcomes were seen often.
    assert!(
        changed > decided / 10 && changed < decided * 9 / 10,
        "{changed} of {decided}"
    );
    check_index(&reg);
    drop(held);
    check_index(&reg);
    assert_eq!(reg.interned(), 0);
    assert!(reg.index.lock().root.children.is_empty());
}

#[test]
fn slots_are_shared_reused_and_their_paths_leave_the_trie() {
    let reg = Arc::new(Registry::default());
    let a = |s: &str| Arc::new(f(s));
    let spec = reg.intern(&a("spec, metadata.labels[app.kubernetes.io/name]"));
    let status = reg.intern(&a("status"));
    let ignore = reg.intern(&a("-status"));
    let spec2 = reg.intern(&a("metadata.labels[app.kubernetes.io/name],spec"));
    assert_eq!(
        [spec.index(), status.index(), ignore.index(), spec2.index()],
        [0, 1, 2, 0]
    );
    assert!(Arc::ptr_eq(spec.filter(), spec2.filter()), "interned");
    assert_eq!(reg.interned(), 3);
    let labels = |reg: &Registry| {
        let ix = reg.index.lock();
        ix.root
            .children
            .get("metadata")
            .is_some_and(|m| m.children.contains_key("labels"))
    };
    // A slot goes with its last holder, and its paths with it.
    drop(spec);
    assert!(labels(&reg));
    drop(spec2);
    assert!(!labels(&reg));
    assert_eq!(reg.interned(), 2);
    check_index(&reg);
    // The free slot is the next filter's.
    let data = reg.intern(&a("data"));
    assert_eq!(data.index(), 0);
    // A walk decides every select filter; the released paths decide nothing.
    let old = json!({"metadata": {"labels": {"app.kubernetes.io/name": "x"}}, "data": 1});
    let new = json!({"metadata": {"labels": {"app.kubernetes.io/name": "y"}}, "data": 2});
    let set = ChangeSet::new(&old, &new);
    let mut d = Decisions::default();
    d.begin();
    assert!(d.decide(&data, &set));
    assert_eq!(d.lookup(&status), Some(false), "marked by the same walk");
    assert_eq!(
        d.lookup(&ignore),
        None,
        "an ignore filter is decided on demand"
    );
    assert!(d.decide(&ignore, &set));
    assert_eq!(d.evaluations(), 2);
    // The next event forgets this one's decisions.
    d.begin();
    assert_eq!(d.lookup(&data), None);
    drop((status, ignore, data));
    check_index(&reg);
    assert_eq!(reg.interned(), 0);
    assert!(reg.index.lock().root.children.is_empty());
}

/// A slot freed and taken by another filter after an event's walk is decided for its own
/// filter, not by the marks the walk left for the previous one.
#[test]
fn a_slot_taken_after_the_walk_is_decided_for_its_own_filter() {
    let reg = Arc::new(Registry::default());
    let spec = reg.intern(&Arc::new(f("spec")));
    let old = json!({"spec": 1, "status": 1});
    let new = json!({"spec": 2, "status": 1});
    let set = ChangeSet::new(&old, &new);
    let mut d = Decisions::default();
    d.begin();
    assert!(d.decide(&spec, &set));
    let index = spec.index();
    drop(spec);
    let status = reg.intern(&Arc::new(f("status")));
    assert_eq!(status.index(), index);
    assert_eq!(d.lookup(&status), None);
    assert!(!d.decide(&status, &set));
    let ignore = reg.intern(&Arc::new(f("-spec")));
    assert!(!d.decide(&ignore, &set));
}

#[test]
fn paths_parse_with_map_keys_and_bad_ones_say_why() {
    assert_eq!(
        parse_path("metadata.annotations[example.com/x]").unwrap(),
        ["metadata", "annotations", "example.com/x"]
    );
    assert_eq!(parse_path("a[b][c].d").unwrap(), ["a", "b", "c", "d"]);
    for (bad, why) in [
        ("", "empty field name"),
        ("spec.", "empty field name"),
        (".spec", "empty field name"),
        ("a..b", "empty field name"),
        ("[x]", "a path starts with a field name"),
        ("a[x", "unclosed '['"),
        ("a[]", "empty map key"),
        ("a b", "expected '.' or '[' after a field"),
        ("a/b", "expected '.' or '[' after a field"),
        ("*", "unexpected '*'"),
    ] {
        assert_eq!(parse_path(bad).unwrap_err(), why, "{bad:?}");
    }
}

#[test]
fn a_header_is_one_form_bounded_and_canonical() {
    assert_eq!(
        f("spec, metadata.labels,spec").canonical(),
        "metadata.labels,spec"
    );
    assert_eq!(
        f(" -status , -metadata.managedFields").canonical(),
        "-metadata.managedFields,-status"
    );
    assert_eq!(
        f("spec,metadata.labels").id(),
        f("metadata.labels, spec").id()
    );
    assert_ne!(f("spec").id(), f("-spec").id());
    let e = WatchFields::parse("spec,-status").unwrap_err();
    assert!(e.contains("either all selected or all ignored"), "{e}");
    assert!(
        WatchFields::parse(" , ")
            .unwrap_err()
            .contains("no field paths")
    );
    let many = vec!["spec"; MAX_PATHS + 1].join(",");
    assert!(WatchFields::parse(&many).unwrap_err().contains("more than"));
    let long = format!("a{}", ".b".repeat(MAX_PATH_LEN));
    assert!(
        WatchFields::parse(&long)
            .unwrap_err()
            .contains("longer than")
    );
    assert!(
        WatchFields::parse("spec[")
            .unwrap_err()
            .contains("\"spec[\"")
    );
}

#[test]
fn selected_fields_decide() {
    let old = json!({"metadata": {"resourceVersion": "1", "labels": {"a": "1"},
                                   "annotations": {"example.com/x": "1", "other": "1"}},
                     "spec": {"replicas": 1, "list": [1, 2]}, "status": {"n": 1}});
    let status_only = {
        let mut v = old.clone();
        v["status"]["n"] = json!(2);
        v["metadata"]["resourceVersion"] = json!("2");
        v
    };
    let spec = f("spec");
    assert!(!ch(&spec, &old, &status_only));
    let mut list = old.clone();
    list["spec"]["list"] = json!([2, 1]);
    assert!(ch(&spec, &old, &list), "lists compare whole, in order");
    let ann = f("metadata.annotations[example.com/x]");
    let mut other = old.clone();
    other["metadata"]["annotations"]["other"] = json!("2");
    assert!(!ch(&ann, &old, &other));
    let mut mine = old.clone();
    mine["metadata"]["annotations"]["example.com/x"] = json!("2");
    assert!(ch(&ann, &old, &mine));
    // Missing and null are the same; a field appearing with a value is a change.
    let mut null = old.clone();
    null["spec"]["extra"] = Value::Null;
    assert!(!ch(&spec, &old, &null));
    let mut added = old.clone();
    added["spec"]["extra"] = json!(0);
    assert!(ch(&spec, &old, &added));
    // Key order does not matter.
    let a: Value = serde_json::from_str(r#"{"spec":{"a":1,"b":2}}"#).unwrap();
    let b: Value = serde_json::from_str(r#"{"spec":{"b":2,"a":1}}"#).unwrap();
    assert!(!ch(&spec, &a, &b));
}

#[test]
fn ignored_fields_and_the_resource_version_never_decide() {
    let ig = f("-status,-metadata.managedFields");
    let old = json!({"metadata": {"resourceVersion": "1", "managedFields": [{"t": 1}],
                                   "labels": {"a": "1"}},
                     "spec": {"x": 1}, "status": {"n": 1}});
    let mut heartbeat = old.clone();
    heartbeat["status"]["n"] = json!(2);
    heartbeat["metadata"]["managedFields"] = json!([{"t": 2}]);
    heartbeat["metadata"]["resourceVersion"] = json!("2");
    assert!(!ch(&ig, &old, &heartbeat));
    let mut label = heartbeat.clone();
    label["metadata"]["labels"]["a"] = json!("2");
    assert!(ch(&ig, &old, &label));
    // An ignored subtree appearing or vanishing is no change; anything else is.
    let mut no_status = old.clone();
    no_status.as_object_mut().unwrap().remove("status");
    assert!(!ch(&ig, &old, &no_status));
    let mut new_field = old.clone();
    new_field["spec"]["y"] = json!(true);
    assert!(ch(&ig, &old, &new_field));
    // A map key path inside the ignore form.
    let ann = f("-metadata.annotations[ts]");
    let a = json!({"metadata": {"annotations": {"ts": "1", "k": "v"}}});
    let b = json!({"metadata": {"annotations": {"ts": "2", "k": "v"}}});
    assert!(!ch(&ann, &a, &b));
}

proptest::proptest! {
    /// A filter selecting a top-level field decides exactly as comparing that field, and
    /// the ignore form of every other top-level field agrees with it.
    #[test]
    fn select_and_ignore_agree(
        a in proptest::collection::btree_map("[abc]", 0i64..3, 0..4),
        b in proptest::collection::btree_map("[abc]", 0i64..3, 0..4),
    ) {
        let to = |m: &std::collections::BTreeMap<String, i64>| {
            Value::Object(m.iter().map(|(k, v)| (k.clone(), json!(v))).collect())
        };
        let (va, vb) = (json!({"x": to(&a), "y": to(&b)}), json!({"x": to(&b), "y": to(&b)}));
        let select = f("x");
        let ignore = f("-y");
        proptest::prop_assert_eq!(ch(&select, &va, &vb), a != b);
        proptest::prop_assert_eq!(ch(&ignore, &va, &vb), a != b);
        proptest::prop_assert!(!ch(&select, &va, &va));
    }
}
