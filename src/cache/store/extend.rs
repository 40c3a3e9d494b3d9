//! Extending one resource's history back in time (`reflector::backfill`): a stretch of real
//! events the apiserver still had, or the difference to the state the history starts from,
//! joined in front of the history so that clients resuming from an older resourceVersion are
//! served exactly.

use std::sync::Arc;
use std::time::Instant;

use super::super::event::Event;
use super::super::{CachedObject, EventKind};
use super::{ABSORBED_KEPT, Objects, ResourceCache, rewind};

impl ResourceCache {
    /// Whether a watch from `rv` could be resumed after extending the history back to it:
    /// older than the history, and no absorbed relist in the way (inside one, the history
    /// is a difference that real events cannot be joined to).
    pub fn backfillable(&self, rv: u64) -> bool {
        let oldest = self.read().oldest_rv;
        rv > 0
            && rv < oldest
            && !self
                .absorbed
                .lock()
                .iter()
                .any(|(a, b)| (rv > *a && rv < *b) || (oldest > *a && oldest < *b))
    }

    /// Extends the history back to `from` with real events the apiserver still had
    /// (`cache::reflector::backfill`): `base` is the state at exactly `from` (an Exact list),
    /// `events` every change of the resource after `from` up to the history's start, in
    /// order (a watch from `from`). Replayed over `base` they must arrive at the state the
    /// history starts from (the current state with the history undone), object by object
    /// and resourceVersion by resourceVersion; otherwise nothing changes. The events get
    /// their previous states from the replay, as if they had been received live, so every
    /// watcher (selectors, transitions, change filters) and every later resume in the
    /// stretch is served exactly. Refused when the history would exceed its bound.
    pub fn extend_history(
        &self,
        from: u64,
        base: Vec<CachedObject>,
        events: Vec<(EventKind, CachedObject)>,
    ) -> Result<usize, BackfillRefused> {
        let Some(join) = self.join_point(from, events.len())? else {
            return Ok(0);
        };
        // The stretch's envelopes, when they are written from JSON.
        let charged = self.transcode_all(base.iter().chain(events.iter().map(|(_, o)| o)));
        self.finish_transcoding(charged, 0);
        let mut objects = base_objects(from, base)?;
        let mut history = Vec::with_capacity(events.len());
        let mut last = from;
        for (kind, object) in events {
            let rv = object.meta.resource_version;
            if rv <= last || rv > join.oldest {
                return Err(BackfillRefused(
                    "events out of order or past the history's start",
                ));
            }
            last = rv;
            let object = Arc::new(object);
            let key = object.key();
            let prev = match kind {
                EventKind::Deleted => objects.remove(&key),
                _ => objects.insert(key, object.clone()),
            };
            // A real history only: kube-apiserver's watch cache answers a resourceVersion
            // older than its window, while it has evicted nothing, with its current state
            // as ADDED events, which this refuses.
            if (kind != EventKind::Added) == prev.is_none() {
                return Err(BackfillRefused(
                    "a change to an object the list did not hold, or an ADDED for one it did",
                ));
            }
            let mut ev = Event::new(kind, object, prev);
            ev.at = join.at;
            history.push(Arc::new(ev));
        }
        let same = objects.len() == join.target.len()
            && objects
                .iter()
                .zip(join.target.iter())
                .all(|((ka, a), (kb, b))| {
                    ka == kb && a.meta.resource_version == b.meta.resource_version
                });
        if !same {
            return Err(BackfillRefused(
                "the events do not lead to the state the history starts from",
            ));
        }
        self.join_history(from, &join, history, false)
    }

    /// Extends the history back to `from` when the apiserver still has the state there
    /// (`base`, an Exact list: etcd keeps every revision until compaction) but no longer the
    /// changes after it (a watch from `from` is older than its watch cache's window): the
    /// stretch becomes the difference from `base` to the state the history starts from, as
    /// ADDED/MODIFIED/DELETED events with increasing resourceVersions (`cache::relist`),
    /// exactly what the client's own relist would compute, and is recorded like an absorbed
    /// relist: a resume from `from` gets the difference, one from strictly inside the stretch
    /// gets 410 (its position among the difference's events is unknown).
    pub fn extend_history_with_difference(
        &self,
        from: u64,
        base: Vec<CachedObject>,
    ) -> Result<usize, BackfillRefused> {
        let Some(join) = self.join_point(from, 0)? else {
            return Ok(0);
        };
        let charged = self.transcode_all(base.iter());
        self.finish_transcoding(charged, 0);
        let objects = base_objects(from, base)?;
        let Some(changes) =
            super::super::relist::difference(&objects, from, &join.target, join.oldest)
        else {
            return Err(BackfillRefused(
                "no history leads from the listed state to the history's start",
            ));
        };
        if join.len + changes.len() > self.cfg.history_max_events {
            return Err(BackfillRefused("the history would exceed historyMaxEvents"));
        }
        let charged = self.transcode_all(changes.iter().map(|(_, o, _)| &**o));
        self.finish_transcoding(charged, 0);
        let history = changes
            .into_iter()
            .map(|(kind, object, prev)| {
                let mut ev = Event::new(kind, object, prev);
                ev.at = join.at;
                Arc::new(ev)
            })
            .collect();
        self.join_history(from, &join, history, true)
    }

    /// Where a backfill joins the history: `None` when the history already reaches `from`.
    fn join_point(&self, from: u64, events: usize) -> Result<Option<JoinPoint>, BackfillRefused> {
        let (mut objects, undo, oldest, len, front_at) = {
            let s = self.read();
            if !self.is_ready() {
                return Err(BackfillRefused("the cache is not synced"));
            }
            let undo: Vec<Arc<Event>> = s.history.iter().cloned().collect();
            (
                s.objects.clone(),
                undo,
                s.oldest_rv,
                s.history.len(),
                s.history.front().map(|e| e.at),
            )
        };
        if from >= oldest {
            return Ok(None);
        }
        if !self.backfillable(from) {
            return Err(BackfillRefused("an absorbed relist lies in the way"));
        }
        if len + events > self.cfg.history_max_events {
            return Err(BackfillRefused("the history would exceed historyMaxEvents"));
        }
        // The state the history starts from, at `oldest`.
        rewind(&mut objects, None, &undo);
        Ok(Some(JoinPoint {
            target: objects,
            oldest,
            len,
            at: stretch_at(front_at, Instant::now(), self.cfg.history_max_age),
        }))
    }

    /// Puts `history` (the stretch `(from, join.oldest]`) in front of the history, unless the
    /// history moved since `join` was read; `absorbed`: the stretch is a difference.
    fn join_history(
        &self,
        from: u64,
        join: &JoinPoint,
        history: Vec<Arc<Event>>,
        absorbed: bool,
    ) -> Result<usize, BackfillRefused> {
        let n = history.len();
        let mut s = self.write();
        // Trimmed, relisted or extended meanwhile: the join point is gone.
        if s.oldest_rv != join.oldest || s.history.len() < join.len {
            return Err(BackfillRefused("the history moved meanwhile"));
        }
        if s.history.len() + n > self.cfg.history_max_events {
            return Err(BackfillRefused("the history would exceed historyMaxEvents"));
        }
        if absorbed {
            let mut w = self.absorbed.lock();
            if w.len() == ABSORBED_KEPT {
                w.pop_front();
            }
            // Oldest first, as relists are recorded.
            w.push_front((from, join.oldest));
        }
        for ev in history.into_iter().rev() {
            s.history.push_front(ev);
        }
        // Events joined at the front are new, encoded only for the watchers they resume.
        s.unframed += n;
        s.oldest_rv = from;
        Ok(n)
    }
}

/// The history's start as a backfill found it (`ResourceCache::join_point`).
struct JoinPoint {
    /// The state at `oldest`: the current state with the history undone.
    target: Objects,
    oldest: u64,
    /// The history's length then.
    len: usize,
    /// The time the stretch's events are given ([`stretch_at`]).
    at: Instant,
}

/// The time a backfilled stretch's events are given: the history's first event's, so the
/// history stays in the order its age bound trims it; but now when that event is already
/// past `cache.historyMaxAge` (the newest event of a resource quiet for longer, which the
/// trim keeps), or there is none: a stretch stamped that old would leave the history at
/// the next trim, within a second, before the clients it was fetched for read it. The
/// events behind such a stretch then stay until it ages out.
fn stretch_at(front_at: Option<Instant>, now: Instant, max_age: std::time::Duration) -> Instant {
    match front_at {
        Some(a) if now.duration_since(a) <= max_age => a,
        _ => now,
    }
}

/// A backfill's Exact list as a state; refused when an object is newer than the list.
fn base_objects(from: u64, base: Vec<CachedObject>) -> Result<Objects, BackfillRefused> {
    let mut objects = Objects::new();
    for o in base {
        if o.meta.resource_version > from {
            return Err(BackfillRefused("a listed object newer than the list"));
        }
        objects.insert(o.key(), Arc::new(o));
    }
    Ok(objects)
}

/// Why the history was not extended back ([`ResourceCache::extend_history`]).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("history not extended: {0}")]
pub struct BackfillRefused(pub &'static str);

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A stretch joins with the history's first event's time while that event is within the
    /// age bound, so the history stays ordered by age; a first event past it (a quiet
    /// resource's kept newest) or none gives the stretch the present, so the periodic trim
    /// does not take it before its clients read it.
    #[test]
    fn a_stretch_is_never_born_past_the_age_bound() {
        let max = Duration::from_secs(150);
        let now = Instant::now() + Duration::from_secs(1000);
        let young = now - Duration::from_secs(10);
        let old = now - Duration::from_secs(151);
        assert_eq!(stretch_at(Some(young), now, max), young);
        assert_eq!(stretch_at(Some(now - max), now, max), now - max);
        assert_eq!(stretch_at(Some(old), now, max), now);
        assert_eq!(stretch_at(None, now, max), now);
    }
}
