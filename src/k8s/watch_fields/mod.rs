//! Field-level change filtering for watchers: an opt-in extension of the proxy (Kubernetes has
//! no such thing). A watch that sends [`HEADER`] names the fields it cares about; a MODIFIED
//! event that changes none of them is not delivered to it (ADDED and DELETED always are).
//!
//! The header's value is a comma-separated list of field paths, all of one form:
//! - **select**: `spec, metadata.labels, metadata.annotations[example.com/x]` — deliver a
//!   MODIFIED event when any of these differs between the previous and the new object;
//! - **ignore**: `-status, -metadata.managedFields` — deliver it when anything but these
//!   differs (`metadata.resourceVersion` is always ignored in this form: it changes with
//!   every write).
//!
//! A path is dot-separated JSON field names (`[A-Za-z0-9_$-]`), each optionally followed by
//! `[key]` naming a map key that may contain dots or slashes (`metadata.labels[app.kubernetes.io/name]`).
//! Lists are compared whole. A missing field and a JSON `null` are the same (Kubernetes'
//! `omitempty` writes neither), objects compare by content whatever their key order.
//! Hostile input is bounded: at most [`MAX_PATHS`] paths of at most [`MAX_PATH_LEN`] bytes.
//!
//! Cost: an event's [`ChangeSet`] (the paths where the two objects differ) is computed once,
//! whatever the number of filters, in one walk of both objects. The hub's watchers intern
//! their filters in the resource's [`Registry`] ([`Slot`]: a small number per distinct
//! filter), which keeps the select filters' paths as one trie: one walk of the changes with
//! the trie decides every select filter, visiting only the changed paths some filter names,
//! whatever the number of filters; each distinct ignore filter is decided against the changes
//! in time bounded by its own size ([`WatchFields::changed_in`]), not the objects'. The
//! decisions are kept by slot in an array ([`Decisions`]). The number of distinct filters on
//! a resource, in all and per identity, is bounded by [`Registry`] (`cache.watchFields`).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

mod slots;
use slots::Index;
pub use slots::{Decisions, Slot};

/// The request header naming the fields (removed before a request reaches the apiserver).
pub const HEADER: &str = "x-kube-cache-proxy-watch-fields";
/// The response header saying whether a watch that asked is filtered: `applied`, or
/// `unfiltered` when the apiserver answers it (it cannot filter).
pub const APPLIED_HEADER: &str = "x-kube-cache-proxy-watch-filter";

pub const MAX_PATHS: usize = 32;
pub const MAX_PATH_LEN: usize = 256;

/// One segment of a path: a field name, then any `[key]` map keys.
type Path = Vec<String>;

/// A parsed filter. Equal filters are equal (`==`, and the same [`WatchFields::id`]): the
/// hub decides once per event per distinct filter.
#[derive(Debug, Clone)]
pub struct WatchFields {
    ignore: bool,
    paths: Vec<Path>,
    /// The paths as a tree (shared prefixes once), for [`WatchFields::changed_in`].
    tree: PathTree,
    /// The canonical form (sorted, deduplicated, paths under another dropped), for logs and
    /// metrics. It names the filter
    /// exactly: two filters are equal when their forms and canonical forms are.
    canonical: String,
    /// A hash of the paths, keyed per process (an attacker cannot make two filters collide
    /// offline; equality is decided on the content anyway).
    id: u64,
}

impl PartialEq for WatchFields {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id && self.ignore == other.ignore && self.canonical == other.canonical
    }
}

impl Eq for WatchFields {}

/// By [`WatchFields::id`] (equal filters have equal ids).
impl Hash for WatchFields {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.id);
    }
}

/// A trie of paths: where a path ends, and the next segments.
#[derive(Debug, Clone, Default)]
struct PathTree {
    end: bool,
    children: HashMap<Box<str>, PathTree>,
}

impl PathTree {
    fn insert(&mut self, path: &[String]) {
        let mut node = self;
        for seg in path {
            if node.end {
                // A prefix is already selected (or ignored): it decides for everything below.
                return;
            }
            node = node.children.entry(seg.as_str().into()).or_default();
        }
        node.end = true;
        node.children.clear();
    }
}

fn id_keys() -> &'static std::collections::hash_map::RandomState {
    static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    KEYS.get_or_init(Default::default)
}

impl WatchFields {
    /// Parses the header's value; the error says what is wrong (a 400 `Status` message).
    pub fn parse(value: &str) -> Result<WatchFields, String> {
        let items: Vec<&str> = value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if items.is_empty() {
            return Err(format!("{HEADER}: no field paths"));
        }
        if items.len() > MAX_PATHS {
            return Err(format!("{HEADER}: more than {MAX_PATHS} field paths"));
        }
        let ignore = items[0].starts_with('-');
        let mut paths = Vec::with_capacity(items.len());
        for item in &items {
            let (neg, p) = match item.strip_prefix('-') {
                Some(p) => (true, p.trim()),
                None => (false, *item),
            };
            if neg != ignore {
                return Err(format!(
                    "{HEADER}: {item:?}: paths are either all selected or all ignored ('-')"
                ));
            }
            if p.len() > MAX_PATH_LEN {
                return Err(format!(
                    "{HEADER}: a field path is longer than {MAX_PATH_LEN} bytes"
                ));
            }
            paths.push(parse_path(p).map_err(|e| format!("{HEADER}: {p:?}: {e}"))?);
        }
        if ignore {
            paths.push(vec!["metadata".into(), "resourceVersion".into()]);
        }
        paths.sort();
        paths.dedup();
        // A path under another says nothing more (`data.k1` with `data`): dropped, so equal
        // filters have one canonical form. Sorted, a path's prefixes come before it.
        let mut kept: Vec<Path> = Vec::with_capacity(paths.len());
        for p in paths {
            if !kept.iter().any(|k| p.starts_with(k)) {
                kept.push(p);
            }
        }
        let paths = kept;
        let canonical = paths
            .iter()
            .filter(|p| !(ignore && p[..] == ["metadata", "resourceVersion"]))
            .map(|p| {
                let s = display(p);
                if ignore { format!("-{s}") } else { s }
            })
            .collect::<Vec<_>>()
            .join(",");
        let mut tree = PathTree::default();
        for p in &paths {
            tree.insert(p);
        }
        let id = id_keys().hash_one((ignore, &paths));
        Ok(WatchFields {
            ignore,
            paths,
            tree,
            canonical,
            id,
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn canonical(&self) -> &str {
        &self.canonical
    }

    /// Whether the change from `old` to `new` concerns this filter, by comparing the two
    /// objects under each path (the direct evaluation, whose cost grows with the objects;
    /// [`WatchFields::changed_in`] decides the same from an event's [`ChangeSet`]).
    pub fn changed(&self, old: &Value, new: &Value) -> bool {
        if self.ignore {
            let ignored: Vec<&[String]> = self.paths.iter().map(|p| &p[..]).collect();
            !eq_except(Some(old), Some(new), &ignored)
        } else {
            self.paths.iter().any(|p| !same(at(old, p), at(new, p)))
        }
    }

    /// [`WatchFields::changed`], decided from the paths where the objects differ. Its cost
    /// is bounded by this filter's size: at each level of its tree it looks up the smaller
    /// of its own segments and the changed ones in the other.
    pub fn changed_in(&self, set: &ChangeSet) -> bool {
        let Some(root) = &set.root else {
            return false; // nothing differs
        };
        if self.ignore {
            changed_outside(root, &self.tree)
        } else {
            changed_under(root, &self.tree)
        }
    }

    /// [`WatchFields::changed`] on two objects' JSON; unreadable JSON counts as changed (the
    /// event is delivered).
    pub fn changed_json(&self, old: &[u8], new: &[u8]) -> bool {
        match ChangeSet::from_json(old, new) {
            Some(set) => self.changed_in(&set),
            None => true,
        }
    }
}

/// Where two versions of an object differ: the set of paths `p` (field names and map keys)
/// such that the values at `p` differ, with [`WatchFields::changed`]'s equality (missing is
/// `null`, key order does not matter, lists whole). The set is closed under prefixes (a
/// difference below is one above), so it is kept as a tree holding only what differs; its
/// size is at most the two objects' (which bound it: an object is at most what the apiserver
/// accepts, 3 MiB). Built in one walk of both objects, once per event whatever the number of
/// filters.
#[derive(Debug, Default)]
pub struct ChangeSet {
    /// `None`: the objects are equal.
    root: Option<Diff>,
}

/// A path where the values differ.
#[derive(Debug)]
struct Diff {
    /// Both values are objects, `null` or missing: the ignore form compares them key by key
    /// (a missing or `null` object is an empty one). Otherwise (a scalar, a list, or an
    /// object against a scalar or list) the values differ as a whole.
    maplike: bool,
    /// The keys below whose values differ (an object against anything else: the object's
    /// keys with a value, as against a missing one).
    children: HashMap<Box<str>, Diff>,
}

impl ChangeSet {
    /// The changes from `old` to `new`.
    pub fn new(old: &Value, new: &Value) -> ChangeSet {
        ChangeSet {
            root: diff(Some(old), Some(new)),
        }
    }

    /// [`ChangeSet::new`] of two objects' JSON; `None` when either is unreadable.
    pub fn from_json(old: &[u8], new: &[u8]) -> Option<ChangeSet> {
        let old: Value = serde_json::from_slice(old).ok()?;
        let new: Value = serde_json::from_slice(new).ok()?;
        Some(ChangeSet::new(&old, &new))
    }

    /// Whether anything differs.
    pub fn is_empty(&self) -> bool {
        self.root.is_none()
    }

    /// The number of differing paths (for tests and metrics).
    pub fn len(&self) -> usize {
        fn count(d: &Diff) -> usize {
            1 + d.children.values().map(count).sum::<usize>()
        }
        self.root.as_ref().map_or(0, count)
    }
}

/// The differing paths between `a` and `b` (the values at one path, `None` when missing or
/// under a non-object); `None` when they are equal ([`same`]).
fn diff(a: Option<&Value>, b: Option<&Value>) -> Option<Diff> {
    fn object(v: Option<&Value>) -> Option<&serde_json::Map<String, Value>> {
        match v {
            Some(Value::Object(m)) => Some(m),
            _ => None,
        }
    }
    let nullish = |v: Option<&Value>| matches!(v, None | Some(Value::Null));
    let (oa, ob) = (object(a), object(b));
    if oa.is_none() && ob.is_none() {
        return (!same(a, b)).then(|| Diff {
            maplike: nullish(a) && nullish(b),
            children: HashMap::new(),
        });
    }
    let empty = serde_json::Map::new();
    let (ma, mb) = (oa.unwrap_or(&empty), ob.unwrap_or(&empty));
    let mut children = HashMap::new();
    for (k, v) in ma {
        if let Some(d) = diff(Some(v), mb.get(k)) {
            children.insert(k.as_str().into(), d);
        }
    }
    for (k, v) in mb {
        if !ma.contains_key(k)
            && let Some(d) = diff(None, Some(v))
        {
            children.insert(k.as_str().into(), d);
        }
    }
    // Two objects differ when a key does; an object never equals anything else.
    let differs = !children.is_empty() || oa.is_none() || ob.is_none();
    differs.then(|| Diff {
        maplike: (oa.is_some() || nullish(a)) && (ob.is_some() || nullish(b)),
        children,
    })
}

/// The select form: whether a selected path (in `sel`, relative to `d`'s path) is a
/// changed path. `d` differs, so a path ending here is changed.
fn changed_under(d: &Diff, sel: &PathTree) -> bool {
    if sel.end {
        return true;
    }
    if d.children.len() <= sel.children.len() {
        d.children
            .iter()
            .any(|(k, dc)| sel.children.get(k).is_some_and(|s| changed_under(dc, s)))
    } else {
        sel.children
            .iter()
            .any(|(k, s)| d.children.get(k).is_some_and(|dc| changed_under(dc, s)))
    }
}

/// The ignore form: whether something differs outside the ignored paths (in `ig`, relative
/// to `d`'s path), as [`eq_except`] decides. Each changed key either is not under an ignored
/// path (a change: the walk stops) or is one of `ig`'s, so the walk visits at most `ig`'s
/// nodes and one more per level.
fn changed_outside(d: &Diff, ig: &PathTree) -> bool {
    if ig.end {
        return false;
    }
    if ig.children.is_empty() || !d.maplike {
        return true;
    }
    d.children.iter().any(|(k, dc)| match ig.children.get(k) {
        None => true,
        Some(i) => changed_outside(dc, i),
    })
}

/// How many distinct filters a resource may have at once, in all and per identity
/// (`cache.watchFields`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub per_resource: usize,
    pub per_identity: usize,
}

/// Why a filter was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The resource has `limit` distinct filters.
    Resource { limit: usize },
    /// This identity has `limit` distinct filters on the resource.
    Identity { limit: usize },
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Resource { limit } => write!(
                f,
                "{HEADER}: this resource's watches have {limit} distinct field filters, the most the proxy allows at once (cache.watchFields.maxFiltersPerResource); watch with one of the filters in use, without the header, or later"
            ),
            Refused::Identity { limit } => write!(
                f,
                "{HEADER}: your watches of this resource have {limit} distinct field filters, the most the proxy allows one user at once (cache.watchFields.maxFiltersPerIdentity); close some, or share a filter between watches"
            ),
        }
    }
}

/// The distinct filters of one resource's open watches, with the identities holding them:
/// the bound on how many decisions each event needs. A watch holds a [`Lease`] as long as it
/// is open.
///
/// The hub's watchers also intern their filters here ([`Registry::intern`], a [`Slot`] held
/// as long as the watcher is registered): each distinct filter gets a small slot number, and
/// the select filters' paths are kept as one trie, so an event decides every select filter
/// in one walk of its changes ([`Decisions`]). Slots are held by the hub's watchers rather
/// than by the leases because the two end independently: a slot freed and reused while a
/// watcher still named it would give that watcher another filter's decisions.
#[derive(Debug, Default)]
pub struct Registry {
    state: parking_lot::Mutex<RegistryState>,
    index: parking_lot::Mutex<Index>,
    /// Admissions refused: over the resource's limit, over an identity's.
    pub refused_resource: AtomicU64,
    pub refused_identity: AtomicU64,
}

#[derive(Debug, Default)]
struct RegistryState {
    /// Each distinct filter and the leases holding it.
    filters: HashMap<Arc<WatchFields>, usize>,
    /// Each identity's distinct filters and its leases holding each.
    owners: HashMap<Box<str>, HashMap<Arc<WatchFields>, usize>>,
}

impl Registry {
    /// Admits a watch with filter `f` for `owner` (an identity): always when the filter is
    /// already in use (by anyone for the resource's limit, by `owner` for its own), else
    /// while both counts are below their limits.
    pub fn admit(
        self: &Arc<Self>,
        f: &Arc<WatchFields>,
        owner: &str,
        limits: Limits,
    ) -> Result<Lease, Refused> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let known = st.filters.contains_key(&**f);
        let mine = st.owners.get(owner);
        let known_to_owner = mine.is_some_and(|m| m.contains_key(&**f));
        if !known && st.filters.len() >= limits.per_resource {
            self.refused_resource.fetch_add(1, Ordering::Relaxed);
            return Err(Refused::Resource {
                limit: limits.per_resource,
            });
        }
        if !known_to_owner && mine.map_or(0, HashMap::len) >= limits.per_identity {
            self.refused_identity.fetch_add(1, Ordering::Relaxed);
            return Err(Refused::Identity {
                limit: limits.per_identity,
            });
        }
        *st.filters.entry(f.clone()).or_default() += 1;
        *st.owners
            .entry(owner.into())
            .or_default()
            .entry(f.clone())
            .or_default() += 1;
        Ok(Lease {
            registry: self.clone(),
            filter: f.clone(),
            owner: owner.into(),
        })
    }

    /// Distinct filters in use.
    pub fn distinct(&self) -> usize {
        self.state.lock().filters.len()
    }

    /// Identities with a filter in use.
    pub fn identities(&self) -> usize {
        self.state.lock().owners.len()
    }

    fn release(&self, f: &WatchFields, owner: &str) {
        let mut st = self.state.lock();
        if let Some(n) = st.filters.get_mut(f) {
            *n -= 1;
            if *n == 0 {
                st.filters.remove(f);
            }
        }
        if let Some(m) = st.owners.get_mut(owner) {
            if let Some(n) = m.get_mut(f) {
                *n -= 1;
                if *n == 0 {
                    m.remove(f);
                }
            }
            if m.is_empty() {
                st.owners.remove(owner);
            }
        }
    }
}

/// A watch's admission of its filter ([`Registry::admit`]), released when dropped.
pub struct Lease {
    registry: Arc<Registry>,
    filter: Arc<WatchFields>,
    owner: Box<str>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("filter", &self.filter.canonical)
            .finish()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.registry.release(&self.filter, &self.owner);
    }
}

fn display(p: &[String]) -> String {
    let mut s = String::new();
    for (i, seg) in p.iter().enumerate() {
        let plain = !seg.is_empty() && seg.bytes().all(is_name_byte);
        if i == 0 {
            s.push_str(seg);
        } else if plain {
            s.push('.');
            s.push_str(seg);
        } else {
            s.push('[');
            s.push_str(seg);
            s.push(']');
        }
    }
    s
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'$'
}

/// `a.b[key].c` -> ["a", "b", "key", "c"].
fn parse_path(p: &str) -> Result<Path, String> {
    let mut out = Vec::new();
    let b = p.as_bytes();
    let mut i = 0;
    let mut expect_name = true;
    while i < b.len() {
        match b[i] {
            b'[' => {
                if out.is_empty() {
                    return Err("a path starts with a field name".into());
                }
                let Some(end) = p[i + 1..].find(']') else {
                    return Err("unclosed '['".into());
                };
                let key = &p[i + 1..i + 1 + end];
                if key.is_empty() {
                    return Err("empty map key".into());
                }
                if key.contains('[') {
                    return Err("'[' inside a map key".into());
                }
                out.push(key.to_string());
                i += end + 2;
                expect_name = false;
            }
            b'.' => {
                if expect_name {
                    return Err("empty field name".into());
                }
                expect_name = true;
                i += 1;
            }
            _ => {
                if !expect_name {
                    return Err("expected '.' or '[' after a field".into());
                }
                let start = i;
                while i < b.len() && is_name_byte(b[i]) {
                    i += 1;
                }
                if i == start {
                    return Err(format!(
                        "unexpected {:?}",
                        p[i..].chars().next().unwrap_or(' ')
                    ));
                }
                out.push(p[start..i].to_string());
                expect_name = false;
            }
        }
    }
    if expect_name {
        return Err("empty field name".into());
    }
    Ok(out)
}

/// The value at `path`, `None` when absent (or under a non-object).
fn at<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut cur = v;
    for seg in path {
        cur = cur.as_object()?.get(seg)?;
    }
    Some(cur)
}

/// Equal, a missing field being the same as `null` at any depth.
fn same(a: Option<&Value>, b: Option<&Value>) -> bool {
    match (a, b) {
        (None | Some(Value::Null), None | Some(Value::Null)) => true,
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            x.iter().all(|(k, v)| same(Some(v), y.get(k)))
                && y.iter()
                    .all(|(k, v)| x.contains_key(k) || same(None, Some(v)))
        }
        (Some(Value::Array(x)), Some(Value::Array(y))) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(Some(a), Some(b)))
        }
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// Equal except under the `ignored` paths (relative to `a` and `b`); a missing or `null`
/// object is an empty one.
fn eq_except(a: Option<&Value>, b: Option<&Value>, ignored: &[&[String]]) -> bool {
    if ignored.iter().any(|p| p.is_empty()) {
        return true; // this whole subtree is ignored
    }
    if ignored.is_empty() {
        return same(a, b);
    }
    let empty = serde_json::Map::new();
    fn as_map<'a>(
        v: Option<&'a Value>,
        empty: &'a serde_json::Map<String, Value>,
    ) -> Option<&'a serde_json::Map<String, Value>> {
        match v {
            None | Some(Value::Null) => Some(empty),
            Some(Value::Object(m)) => Some(m),
            Some(_) => None,
        }
    }
    let (Some(ma), Some(mb)) = (as_map(a, &empty), as_map(b, &empty)) else {
        return same(a, b);
    };
    ma.keys()
        .chain(mb.keys().filter(|k| !ma.contains_key(*k)))
        .all(|k| {
            let under: Vec<&[String]> = ignored
                .iter()
                .filter(|p| p[0] == *k)
                .map(|p| &p[1..])
                .collect();
            eq_except(ma.get(k), mb.get(k), &under)
        })
}

#[cfg(test)]
mod tests;
