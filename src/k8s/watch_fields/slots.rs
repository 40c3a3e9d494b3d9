//! Deciding every filter of an event at once: the hub's watchers hold their filter's [`Slot`]
//! (a small number per distinct filter, [`Registry::intern`]); the resource's select
//! filters' paths are one trie ([`Index`]) whose nodes list the slots of the filters with a
//! path ending there, so one walk of an event's changes with it marks every changed select
//! filter ([`Decisions`]), whatever their number.

use std::collections::HashMap;
use std::sync::Arc;

use super::{ChangeSet, Diff, Registry, WatchFields};

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

/// The interned filters of a resource's watchers and the select filters' paths as one trie
/// (its parts visible to the module's tests, which check its books).
#[derive(Debug, Default)]
pub(super) struct Index {
    /// Each interned filter's slot.
    pub(super) by_filter: HashMap<Arc<WatchFields>, u32>,
    /// By slot number.
    pub(super) slots: Vec<SlotState>,
    /// Slots held by no filter.
    pub(super) free: Vec<u32>,
    /// The select filters' paths: each node lists the filters with a path ending there.
    pub(super) root: IndexNode,
    /// Holds taken so far (each [`Slot`]'s ticket).
    pub(super) tickets: u64,
    /// Interned select filters (the trie is empty without one).
    pub(super) select: usize,
}

#[derive(Debug, Default)]
pub(super) struct SlotState {
    /// `None` while the slot is free.
    pub(super) filter: Option<Arc<WatchFields>>,
    pub(super) holds: usize,
    /// Select form: where each of the filter's paths is in the `ends` of its trie node.
    pub(super) pos: Vec<u32>,
}

#[derive(Debug, Default)]
pub(super) struct IndexNode {
    /// The select filters with a path ending here: (slot, which of its paths).
    pub(super) ends: Vec<(u32, u32)>,
    pub(super) children: HashMap<Box<str>, IndexNode>,
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

/// The hub's side of a [`Registry`]: its watchers' slots and the walk deciding an event.
impl Registry {
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
}
