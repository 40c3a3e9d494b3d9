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

    /// A hub watcher's hold on `f`'s slot (equal filters share one; a new filter takes a free
    /// slot, its paths joining the trie when it is of the select form). O(the filter's
    /// size), whatever the number of filters.
    pub fn intern(self: &Arc<Self>, f: &Arc<WatchFields>) -> Slot {
        let mut ix = self.index.lock();
        let (index, ticket) = ix.acquire(f);
        let filter = ix.slots[index as usize]
            .filter
            .clone()
            .expect("an acquired slot has its filter");
        Slot {
            registry: self.clone(),
            ignore: filter.ignore,
            filter,
            index,
            ticket,
        }
    }

    /// Slots held (distinct filters of the hub's watchers).
    pub fn interned(&self) -> usize {
        self.index.lock().by_filter.len()
    }

    /// Starts `d`'s event: marks every select filter with a path in `set`; whether there was
    /// a select filter to decide.
    fn mark(&self, set: &ChangeSet, d: &mut Decisions) -> bool {
        let ix = self.index.lock();
        d.ticket = ix.tickets;
        if d.by_slot.len() < ix.slots.len() {
            d.by_slot.resize(ix.slots.len(), 0);
        }
        if let Some(root) = &set.root {
            mark(root, &ix.root, &mut d.by_slot, 2 * d.epoch + 1);
        }
        ix.select > 0
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

/// A hub watcher's hold on its filter's slot in the resource's [`Registry`]
/// ([`Registry::intern`]): equal filters share one slot, numbered from 0, reused once no
/// watcher holds it. The slot names the filter's decision in an event's [`Decisions`] (an
/// index into an array, no hashing). Released when dropped.
pub struct Slot {
    registry: Arc<Registry>,
    /// The interned filter (the first of the equal ones).
    filter: Arc<WatchFields>,
    index: u32,
    /// When this hold was taken ([`Index::tickets`]): an event's decisions hold only the
    /// slots held before they were started.
    ticket: u64,
    ignore: bool,
}

impl Slot {
    /// The slot's number.
    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// The interned filter.
    pub fn filter(&self) -> &Arc<WatchFields> {
        &self.filter
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("index", &self.index)
            .field("filter", &self.filter.canonical)
            .finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.registry.index.lock().release(self.index);
    }
}

/// The interned filters of a resource's watchers and the select filters' paths as one trie.
#[derive(Debug, Default)]
struct Index {
    /// Each interned filter's slot.
    by_filter: HashMap<Arc<WatchFields>, u32>,
    /// By slot number.
    slots: Vec<SlotState>,
    /// Slots held by no filter.
    free: Vec<u32>,
    /// The select filters' paths: each node lists the filters with a path ending there.
    root: IndexNode,
    /// Holds taken so far (each [`Slot`]'s ticket).
    tickets: u64,
    /// Interned select filters (the trie is empty without one).
    select: usize,
}

#[derive(Debug, Default)]
struct SlotState {
    /// `None` while the slot is free.
    filter: Option<Arc<WatchFields>>,
    holds: usize,
    /// Select form: where each of the filter's paths is in the `ends` of its trie node.
    pos: Vec<u32>,
}

#[derive(Debug, Default)]
struct IndexNode {
    /// The select filters with a path ending here: (slot, which of its paths).
    ends: Vec<(u32, u32)>,
    children: HashMap<Box<str>, IndexNode>,
}

impl Index {
    fn acquire(&mut self, f: &Arc<WatchFields>) -> (u32, u64) {
        self.tickets += 1;
        if let Some(&s) = self.by_filter.get(&**f) {
            self.slots[s as usize].holds += 1;
            return (s, self.tickets);
        }
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(SlotState::default());
                u32::try_from(self.slots.len() - 1).expect("fewer slots than watchers")
            }
        };
        let mut pos = Vec::new();
        if !f.ignore {
            self.select += 1;
            pos.reserve_exact(f.paths.len());
            for (j, p) in f.paths.iter().enumerate() {
                let mut node = &mut self.root;
                for seg in p {
                    if !node.children.contains_key(seg.as_str()) {
                        node.children
                            .insert(seg.as_str().into(), IndexNode::default());
                    }
                    node = node.children.get_mut(seg.as_str()).expect("just inserted");
                }
                pos.push(node.ends.len() as u32);
                node.ends.push((s, j as u32));
            }
        }
        self.slots[s as usize] = SlotState {
            filter: Some(f.clone()),
            holds: 1,
            pos,
        };
        self.by_filter.insert(f.clone(), s);
        (s, self.tickets)
    }

    fn release(&mut self, s: u32) {
        let st = &mut self.slots[s as usize];
        st.holds -= 1;
        if st.holds > 0 {
            return;
        }
        let st = std::mem::take(st);
        let f = st.filter.expect("a held slot has its filter");
        self.by_filter.remove(&*f);
        if !f.ignore {
            self.select -= 1;
            for (p, &at) in f.paths.iter().zip(&st.pos) {
                remove_end(&mut self.root, p, at, &mut self.slots);
            }
        }
        self.free.push(s);
    }
}

/// Removes the end of a path at `ends[at]` of its node below `node`, then the nodes left
/// without ends or children; whether `node` is left so.
fn remove_end(node: &mut IndexNode, path: &[String], at: u32, slots: &mut [SlotState]) -> bool {
    match path.split_first() {
        None => {
            node.ends.swap_remove(at as usize);
            // The last end moved to `at`: its filter's position follows.
            if let Some(&(t, j)) = node.ends.get(at as usize) {
                slots[t as usize].pos[j as usize] = at;
            }
            if node.ends.capacity() > 16 && node.ends.len() < node.ends.capacity() / 4 {
                node.ends.shrink_to(node.ends.len() * 2);
            }
        }
        Some((seg, rest)) => {
            if let Some(c) = node.children.get_mut(seg.as_str())
                && remove_end(c, rest, at, slots)
            {
                node.children.remove(seg.as_str());
                if node.children.capacity() > 16
                    && node.children.len() < node.children.capacity() / 4
                {
                    node.children.shrink_to(node.children.len() * 2);
                }
            }
        }
    }
    node.ends.is_empty() && node.children.is_empty()
}

/// The select form for every interned filter at once: marks (`by_slot[s] = changed`) the
/// filters with a path ending at a changed path, i.e. a node of both the changes below `d`
/// and the trie below `n` (a filter is changed when one of its paths is a changed path,
/// [`changed_under`]). At each level it looks up the smaller side's keys in the other, so the
/// walk visits only the changed paths some filter names, whatever the number of filters.
fn mark(d: &Diff, n: &IndexNode, by_slot: &mut [u32], changed: u32) {
    for &(s, _) in &n.ends {
        by_slot[s as usize] = changed;
    }
    if d.children.len() <= n.children.len() {
        for (k, dc) in &d.children {
            if let Some(c) = n.children.get(k) {
                mark(dc, c, by_slot, changed);
            }
        }
    } else {
        for (k, c) in &n.children {
            if let Some(dc) = d.children.get(k) {
                mark(dc, c, by_slot, changed);
            }
        }
    }
}

/// One event's decisions, by slot ([`Slot`]), for every filter of one [`Registry`]: the
/// select filters all at once in one walk of the event's changes with the registry's trie
/// (at the first decision the event needs), each ignore filter when a watcher first needs it
/// ([`changed_outside`]). A watcher's lookup is an array read. Reused from event to event
/// ([`Decisions::begin`]): an epoch tells this event's entries from older ones, so nothing is
/// cleared or allocated per event beyond growing to the number of slots.
#[derive(Debug, Default)]
pub struct Decisions {
    /// `2 * epoch + changed` for the slots decided in this event.
    by_slot: Vec<u32>,
    epoch: u32,
    /// The registry's ticket count when the walk ran: a slot held since then may be a slot
    /// that was another filter's at the walk.
    ticket: u64,
    walked: bool,
    /// Decisions computed since [`Decisions::begin`]: walks (one per event, deciding every
    /// select filter), ignore-form decisions (one per distinct filter) and those of slots
    /// held after the walk.
    evaluations: u64,
}

impl Decisions {
    /// Starts the next event's decisions.
    pub fn begin(&mut self) {
        self.epoch += 1;
        if self.epoch >= 1 << 31 {
            self.by_slot.fill(0);
            self.epoch = 1;
        }
        self.walked = false;
        self.evaluations = 0;
    }

    /// This event's decision for `slot`'s filter, when already made: O(1), no hashing.
    #[inline]
    pub fn lookup(&self, slot: &Slot) -> Option<bool> {
        if !self.walked || slot.ticket > self.ticket {
            return None;
        }
        let v = *self.by_slot.get(slot.index as usize)?;
        let unchanged = 2 * self.epoch;
        if v == unchanged + 1 {
            Some(true)
        } else if v == unchanged || !slot.ignore {
            // A select filter the walk did not mark is unchanged.
            Some(false)
        } else {
            None
        }
    }

    /// Whether the event whose changes are `set` concerns `slot`'s filter: the first call of
    /// an event walks the registry's trie (every select filter decided); an ignore filter is
    /// decided once per event. Every slot given between two [`Decisions::begin`] is of the
    /// same registry.
    pub fn decide(&mut self, slot: &Slot, set: &ChangeSet) -> bool {
        if self.epoch == 0 {
            self.begin();
        }
        if !self.walked {
            self.walked = true;
            if slot.registry.mark(set, self) {
                self.evaluations += 1;
            }
        }
        if let Some(c) = self.lookup(slot) {
            return c;
        }
        let c = slot.filter.changed_in(set);
        self.evaluations += 1;
        if slot.ticket <= self.ticket
            && let Some(v) = self.by_slot.get_mut(slot.index as usize)
        {
            *v = 2 * self.epoch + u32::from(c);
        }
        c
    }

    /// Decisions computed since [`Decisions::begin`] (see the field).
    pub fn evaluations(&self) -> u64 {
        self.evaluations
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
mod tests {
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
}
