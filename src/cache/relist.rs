//! A relist told to watchers as ordinary events.
//!
//! When the proxy's own upstream watch breaks for good (410 Expired after compaction, an
//! apiserver restart that lost its watch cache), the reflector lists again. Closing every
//! downstream watch then would make every informer behind the proxy relist too: the
//! disruption the proxy is there to absorb. Instead the cache computes what a client's own
//! relist would: the objects added, changed and gone between the state it held (at
//! `old_rv`) and the new list (at `new_rv`), as ADDED, MODIFIED and DELETED events with
//! strictly increasing resourceVersions in `(old_rv, new_rv]`, then a bookmark at `new_rv`.
//! A watcher's stream stays valid: ordered, no event for a deleted UID except its
//! re-creation, and its final state is the list's.
//!
//! Added and changed objects carry their own resourceVersion (the revision of their last
//! write, which is after `old_rv` or the state would not differ). A deletion's true
//! revision is unknown (the list does not hold it), so it gets a free revision of the
//! range: one that no listed object of this resource carries. Such revisions exist: every
//! deleted object was deleted at a distinct revision of the range that no live object of
//! the resource holds. A deletion followed by a re-creation under the same name must come
//! before the re-creation, so deletions are given the smallest free revisions in order of
//! their bounds (earliest deadline first, which succeeds whenever any assignment does).
//!
//! Inside the window the cache's history is this difference, not the real writes, so no
//! watch can resume exactly from a resourceVersion strictly between `old_rv` and `new_rv`
//! (one the difference carried, or a real one a client got from the apiserver): a deletion
//! told at one revision may really have happened at another. The store answers such a
//! resume 410 Expired (the client relists) and serves no snapshot there; resumes from
//! `old_rv` or earlier, and from `new_rv` on, are exact.
//!
//! When the two states cannot come from one history (the new list is older, or an object
//! changed without its resourceVersion moving past `old_rv`: an etcd restored from a
//! backup, another cluster behind the same address), there is no valid difference: the
//! caller closes its watchers and they relist, as before.

use std::cmp::Ordering;
use std::sync::Arc;

use super::event::with_resource_version;
use super::{CachedObject, EventKind, ObjectKey};

/// A state of one resource: the objects by key (`store::Objects`, named here so the store
/// can use this module without a cycle).
pub type Objects = imbl::OrdMap<ObjectKey, Arc<CachedObject>>;

/// One event of a relist's difference: the kind, the new state (for `Deleted`, the last
/// known state at its assigned resourceVersion) and the previous state.
pub type Change = (EventKind, Arc<CachedObject>, Option<Arc<CachedObject>>);

/// The events that take a watcher from `old` at `old_rv` to `new` at `new_rv`, in
/// resourceVersion order; `None` when no history leads from one to the other.
pub fn difference(old: &Objects, old_rv: u64, new: &Objects, new_rv: u64) -> Option<Vec<Change>> {
    if new_rv < old_rv {
        return None;
    }
    let mut changes: Vec<Change> = Vec::new();
    // (last state, the revision it must come before) per deletion.
    let mut gone: Vec<(Arc<CachedObject>, u64)> = Vec::new();
    let fresh = |o: &Arc<CachedObject>| {
        let rv = o.meta.resource_version;
        rv > old_rv && rv <= new_rv
    };
    let mut a = old.iter().peekable();
    let mut b = new.iter().peekable();
    loop {
        let order = match (a.peek(), b.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((ka, _)), Some((kb, _))) => ka.cmp(kb),
        };
        match order {
            Ordering::Less => {
                let (_, o) = a.next()?;
                gone.push((o.clone(), new_rv + 1));
            }
            Ordering::Greater => {
                let (_, n) = b.next()?;
                if !fresh(n) {
                    return None;
                }
                changes.push((EventKind::Added, n.clone(), None));
            }
            Ordering::Equal => {
                let (_, o) = a.next()?;
                let (_, n) = b.next()?;
                if o.meta.uid != n.meta.uid {
                    if !fresh(n) {
                        return None;
                    }
                    gone.push((o.clone(), n.meta.resource_version));
                    changes.push((EventKind::Added, n.clone(), None));
                } else if n.meta.resource_version == o.meta.resource_version {
                    if n.body != o.body {
                        return None;
                    }
                } else if fresh(n) {
                    changes.push((EventKind::Modified, n.clone(), Some(o.clone())));
                } else {
                    return None;
                }
            }
        }
    }
    let mut taken: Vec<u64> = changes.iter().map(|c| c.1.meta.resource_version).collect();
    taken.sort_unstable();
    gone.sort_by_key(|(_, before)| *before);
    let mut next = old_rv + 1;
    let mut t = 0;
    for (last, before) in gone {
        loop {
            while t < taken.len() && taken[t] < next {
                t += 1;
            }
            if t < taken.len() && taken[t] == next {
                next += 1;
            } else {
                break;
            }
        }
        if next >= before {
            return None;
        }
        let mut object = CachedObject::clone(&last);
        object.body = with_resource_version(&last.body, last.meta.resource_version, next).into();
        object.meta.resource_version = next;
        changes.push((EventKind::Deleted, Arc::new(object), Some(last)));
        next += 1;
    }
    changes.sort_by_key(|c| c.1.meta.resource_version);
    Some(changes)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use bytes::Bytes;
    use proptest::prelude::*;

    use super::*;
    use crate::cache::Resource;

    fn obj(name: &str, uid: &str, rv: u64, data: &str) -> Arc<CachedObject> {
        let raw = format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"ns","uid":"{uid}","resourceVersion":"{rv}"}},"data":{{"v":"{data}"}}}}"#
        );
        Arc::new(
            CachedObject::parse(
                Bytes::from(raw),
                &Resource::core("configmaps", "ConfigMap", true),
            )
            .unwrap(),
        )
    }

    fn state(objs: &[Arc<CachedObject>]) -> Objects {
        objs.iter().map(|o| (o.key(), o.clone())).collect()
    }

    fn kinds(c: &[Change]) -> Vec<(EventKind, String, u64)> {
        c.iter()
            .map(|(k, o, _)| (*k, o.meta.name.to_string(), o.meta.resource_version))
            .collect()
    }

    #[test]
    fn added_changed_and_gone_objects_become_events_in_resource_version_order() {
        let old = state(&[
            obj("a", "ua", 5, "1"),
            obj("b", "ub", 6, "1"),
            obj("c", "uc", 7, "1"),
        ]);
        let new = state(&[
            obj("a", "ua", 5, "1"),
            obj("b", "ub", 12, "2"),
            obj("d", "ud", 11, "1"),
        ]);
        let c = difference(&old, 10, &new, 20).unwrap();
        assert_eq!(
            kinds(&c),
            [
                (EventKind::Added, "d".to_string(), 11),
                (EventKind::Modified, "b".to_string(), 12),
                // c's deletion takes the first revision no listed object holds.
                (EventKind::Deleted, "c".to_string(), 13),
            ]
        );
        let deleted = &c[2].1;
        assert!(
            std::str::from_utf8(&deleted.body)
                .unwrap()
                .contains(r#""resourceVersion":"13""#),
            "the DELETED object carries its event's resourceVersion"
        );
        assert_eq!(c[1].2.as_ref().unwrap().meta.resource_version, 6);
        assert_eq!(c[2].2.as_ref().unwrap().meta.resource_version, 7);
    }

    #[test]
    fn a_re_created_object_is_deleted_before_it_is_added_again() {
        let old = state(&[obj("a", "u1", 5, "1"), obj("b", "ub", 6, "1")]);
        // b went too, and a was re-created at 13: a's deletion must come before 13 (b's may
        // come later), so a takes 11 and b 12.
        let new = state(&[obj("a", "u2", 13, "1")]);
        let c = difference(&old, 10, &new, 30).unwrap();
        assert_eq!(
            kinds(&c),
            [
                (EventKind::Deleted, "a".to_string(), 11),
                (EventKind::Deleted, "b".to_string(), 12),
                (EventKind::Added, "a".to_string(), 13),
            ]
        );
        assert_eq!(&*c[0].1.meta.uid, "u1");
    }

    #[test]
    fn states_no_history_connects_have_no_difference() {
        let old = state(&[obj("a", "ua", 5, "1")]);
        // An older list.
        assert!(difference(&old, 10, &old, 9).is_none());
        // A changed object whose resourceVersion did not move past the old state.
        assert!(difference(&old, 10, &state(&[obj("a", "ua", 5, "2")]), 20).is_none());
        assert!(difference(&old, 10, &state(&[obj("a", "ua", 8, "2")]), 20).is_none());
        // An object that appeared at a revision the old state had already seen.
        let two = state(&[obj("a", "ua", 5, "1"), obj("b", "ub", 9, "1")]);
        assert!(difference(&old, 10, &two, 20).is_none());
        // A re-creation with no revision left for the deletion before it.
        assert!(difference(&old, 10, &state(&[obj("a", "u2", 11, "1")]), 20).is_none());
        // The same state: nothing to say.
        assert_eq!(difference(&old, 10, &old, 15).unwrap().len(), 0);
    }

    /// One write of a history: `Some(data)` creates or changes `name`, `None` deletes it;
    /// `other` writes another resource (it only takes a revision).
    #[derive(Debug, Clone)]
    enum Op {
        Put(u8, u8),
        Delete(u8),
        Other,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6, any::<u8>()).prop_map(|(n, d)| Op::Put(n, d)),
            (0u8..6).prop_map(Op::Delete),
            Just(Op::Other),
        ]
    }

    /// Replays `ops` from revision 1; the state after each revision.
    fn replay(ops: &[Op]) -> Vec<Objects> {
        let mut live: BTreeMap<u8, Arc<CachedObject>> = BTreeMap::new();
        let mut uids = 0;
        let mut states = vec![Objects::new()];
        for (i, op) in ops.iter().enumerate() {
            let rv = i as u64 + 1;
            match op {
                Op::Put(n, d) => {
                    let uid = match live.get(n) {
                        Some(o) => o.meta.uid.to_string(),
                        None => {
                            uids += 1;
                            format!("u{uids}")
                        }
                    };
                    live.insert(*n, obj(&format!("o{n}"), &uid, rv, &d.to_string()));
                }
                Op::Delete(n) => {
                    live.remove(n);
                }
                Op::Other => {}
            }
            states.push(live.values().map(|o| (o.key(), o.clone())).collect());
        }
        states
    }

    proptest! {
        /// For any history and any two revisions of it, the difference applied to the old
        /// state gives the new one, with strictly increasing resourceVersions in the range,
        /// and no event a watcher could not have seen (no change or deletion of an absent
        /// name, no addition of a present one).
        #[test]
        fn the_difference_of_any_two_states_of_one_history_leads_from_one_to_the_other(
            ops in prop::collection::vec(op(), 1..80),
            cut in any::<prop::sample::Index>(),
            end in any::<prop::sample::Index>(),
        ) {
            let states = replay(&ops);
            let a = cut.index(states.len());
            let b = a + end.index(states.len() - a);
            let (old_rv, new_rv) = (a as u64, b as u64);
            let c = difference(&states[a], old_rv, &states[b], new_rv).expect("one history");
            let mut at = states[a].clone();
            let mut last = old_rv;
            for (kind, o, prev) in &c {
                let rv = o.meta.resource_version;
                prop_assert!(rv > last && rv <= new_rv, "rv {rv} after {last}, up to {new_rv}");
                last = rv;
                let held = at.get(&o.key()).cloned();
                match kind {
                    EventKind::Added => {
                        prop_assert!(held.is_none());
                        at.insert(o.key(), o.clone());
                    }
                    EventKind::Modified => {
                        prop_assert_eq!(held.as_ref(), prev.as_ref());
                        prop_assert!(held.is_some());
                        at.insert(o.key(), o.clone());
                    }
                    EventKind::Deleted => {
                        prop_assert_eq!(held.as_ref(), prev.as_ref());
                        prop_assert!(held.is_some());
                        at.remove(&o.key());
                    }
                }
            }
            prop_assert_eq!(at, states[b].clone());
        }
    }
}
