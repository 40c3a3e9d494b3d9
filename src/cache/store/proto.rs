//! The protobuf side's envelopes on the cache's object versions: attaching them as they
//! come, the memory bound they are charged to, and what readers ask of them.

use bytes::Bytes;
use parking_lot::RwLockReadGuard;

use super::*;

impl ResourceCache {
    /// Attaches the protobuf envelope of the object version `key` at `rv` (from the
    /// resource's protobuf stream) to the version the JSON side holds: the current object,
    /// or the history's event at `rv` (an object since changed or deleted). A version the
    /// JSON side has not reached yet waits until it applies it; one it has passed without
    /// holding (trimmed from the history) is dropped.
    pub fn attach_protobuf(&self, key: &ObjectKey, rv: u64, envelope: Bytes) -> Attached {
        if self.proto_shed.is_cancelled() {
            return Attached::Dropped;
        }
        // Its own allocation: the envelope arrives as a slice of a network chunk holding
        // other frames, which it would otherwise keep alive as long as the object version.
        let envelope = Bytes::copy_from_slice(&envelope);
        let s = self.read();
        let n = envelope.len() as u64;
        let (mut found, mut fresh) = (false, false);
        if let Some(o) = s.objects.get(key)
            && o.meta.resource_version == rv
        {
            found = true;
            fresh |= o.proto.set(envelope.clone());
        }
        // The history's event at `rv` too: the same object version, though not always the
        // same allocation as the current object (a backfilled stretch's events are parsed
        // from the backfill's own watch), and a protobuf watch resuming before it needs it.
        let i = s.history.partition_point(|e| e.rv < rv);
        if let Some(e) = s.history.get(i)
            && e.rv == rv
            && e.object.meta.name == key.name
            && e.object.meta.namespace == key.namespace
        {
            found = true;
            fresh |= e.object.proto.set(envelope.clone());
        }
        if found {
            if fresh {
                self.charge_protobuf(n, s);
            } else {
                drop(s);
            }
            self.proto_attached.notify_waiters();
            return Attached::Now;
        }
        if rv <= s.rv && self.is_ready() {
            return Attached::Dropped;
        }
        // Under the read lock: the JSON side applies `rv` only after, and finds it.
        let mut p = self.proto_pending.lock();
        if p.len() >= PROTO_PENDING_MAX {
            let at = s.rv;
            p.retain(|(_, r), _| *r > at);
        }
        if p.len() < PROTO_PENDING_MAX {
            p.insert((key.clone(), rv), envelope);
        }
        self.proto_pending_len
            .store(p.len(), std::sync::atomic::Ordering::Relaxed);
        Attached::Later
    }

    /// Takes a waiting protobuf envelope for an object version the JSON side now applies.
    pub(super) fn take_pending_protobuf(&self, o: &CachedObject) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.proto_pending_len.load(Relaxed) == 0 {
            return;
        }
        let mut p = self.proto_pending.lock();
        if let Some(b) = p.remove(&(o.key(), o.meta.resource_version)) {
            let n = b.len() as u64;
            if o.proto.set(b) && !self.cfg.proto_budget.charge(n) {
                // Called under the write lock: the shedding happens once it is released.
                self.proto_charged.fetch_add(n, Relaxed);
                self.proto_over.store(true, Relaxed);
                return;
            }
            self.proto_charged.fetch_add(n, Relaxed);
        }
        self.proto_pending_len.store(p.len(), Relaxed);
    }

    /// Charges an attached envelope to the protobuf bound; over it, the resource is shed
    /// (after `s`, the read lock, is released).
    pub(super) fn charge_protobuf(&self, n: u64, s: RwLockReadGuard<'_, State>) {
        self.proto_charged
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        let within = self.cfg.proto_budget.charge(n);
        drop(s);
        if !within {
            self.shed_protobuf();
        }
    }

    /// Sheds this resource's protobuf representation (see [`crate::cache::proto_budget`]):
    /// its side stops, protobuf reads and watches go to the apiserver, and the current
    /// objects drop their envelopes (history events and retained snapshots keep theirs until
    /// they age out). Idempotent.
    pub fn shed_protobuf(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.proto_shed.is_cancelled() {
            return;
        }
        self.proto_shed.cancel();
        self.proto_synced.store(0, Relaxed);
        tracing::warn!(
            resource = %self.resource.label(),
            used = self.cfg.proto_budget.used(),
            max = self.cfg.proto_budget.max(),
            "the protobuf representation reached cache.protobufMaxBytes: this resource's protobuf side stops and its protobuf requests go to the apiserver"
        );
        {
            let mut s = self.write();
            let with: Vec<(ObjectKey, Arc<CachedObject>)> = s
                .objects
                .iter()
                .filter(|(_, o)| o.proto.get().is_some())
                .map(|(k, o)| (k.clone(), Arc::new(o.without_protobuf())))
                .collect();
            for (k, o) in with {
                s.objects.insert(k, o);
            }
            self.proto_hub.close_all(CloseReason::Relist);
        }
        self.proto_pending.lock().clear();
        self.proto_pending_len.store(0, Relaxed);
        self.cfg
            .proto_budget
            .release(self.proto_charged.swap(0, Relaxed));
    }

    /// Corrects this cache's charge to the exact bytes of its current objects' envelopes
    /// (replaced and deleted versions give theirs back), or sheds it when an attachment made
    /// under the write lock took the total over the bound. Called periodically while the
    /// protobuf side runs.
    pub fn reconcile_protobuf(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.proto_over.swap(false, Relaxed) {
            self.shed_protobuf();
            return;
        }
        if self.proto_shed.is_cancelled() {
            return;
        }
        let (_, _, exact) = self.protobuf_coverage();
        let exact = exact as u64;
        let before = self.proto_charged.swap(exact, Relaxed);
        if exact >= before {
            if !self.cfg.proto_budget.charge(exact - before) {
                self.shed_protobuf();
            }
        } else {
            self.cfg.proto_budget.release(before - exact);
        }
    }

    /// Drops waiting protobuf envelopes of versions at or before `rv` (the JSON side
    /// passed them without holding them: e.g. a relist that skipped them).
    pub(super) fn prune_pending_protobuf(&self, rv: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.proto_pending_len.load(Relaxed) == 0 {
            return;
        }
        let mut p = self.proto_pending.lock();
        p.retain(|(_, r), _| *r > rv);
        self.proto_pending_len.store(p.len(), Relaxed);
    }

    /// The process-wide protobuf bound this cache charges.
    pub fn protobuf_budget(&self) -> &crate::cache::proto_budget::ProtoBudget {
        &self.cfg.proto_budget
    }

    /// Whether this resource's envelopes are written from its JSON objects
    /// (`k8s::transcode`) rather than read from the protobuf side's upstream watch: its kind
    /// is in the schema, transcoding is on, no object has failed it, and it was not shed.
    pub fn transcodes(&self) -> bool {
        self.proto_transcode.is_some()
            && !self.transcode_off.is_cancelled()
            && !self.proto_shed.is_cancelled()
            && self.cfg.proto_budget.enabled()
    }

    /// Writes the envelope of every object of `objects` that has none from its JSON, when
    /// this resource transcodes: the bytes to charge to the protobuf bound
    /// ([`Self::finish_transcoding`]). An object that cannot be transcoded turns
    /// transcoding off for the resource (its protobuf side's upstream watch takes over).
    pub(super) fn transcode_all<'a>(&self, objects: impl Iterator<Item = &'a CachedObject>) -> u64 {
        let Some(kind) = self.proto_transcode.filter(|_| self.transcodes()) else {
            return 0;
        };
        let r = &self.resource;
        let api_version = if r.group.is_empty() {
            r.version.clone()
        } else {
            format!("{}/{}", r.group, r.version)
        };
        let mut charged = 0;
        let mut n = 0;
        for o in objects {
            if o.proto.get().is_some() {
                continue;
            }
            match crate::k8s::transcode::SCHEMA.write(kind, &o.body) {
                Ok(raw) => {
                    let envelope =
                        crate::k8s::protobuf_write::object_envelope(&api_version, &r.kind, &raw);
                    let len = envelope.len() as u64;
                    if o.proto.set(Bytes::from(envelope)) {
                        charged += len;
                        n += 1;
                    }
                }
                Err(e) => {
                    self.stop_transcoding(&e, o);
                    break;
                }
            }
        }
        self.transcoded
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        charged
    }

    /// Charges envelopes written by [`Self::transcode_all`] to the protobuf bound (over it,
    /// the resource is shed), and with `synced_at` > 0 (the JSON side's state at that
    /// resourceVersion has them all) marks the protobuf side synced there. Called with no
    /// lock held.
    pub(super) fn finish_transcoding(&self, charged: u64, synced_at: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        if charged > 0 {
            self.proto_charged.fetch_add(charged, Relaxed);
            if !self.cfg.proto_budget.charge(charged) {
                self.shed_protobuf();
                return;
            }
        }
        if synced_at > 0 && self.transcodes() {
            self.protobuf_synced(synced_at);
        } else if charged > 0 {
            self.proto_attached.notify_waiters();
        }
    }

    /// An object could not be transcoded: the resource's envelopes come from the protobuf
    /// side's own upstream watch from now on (the registry starts it), and protobuf reads
    /// wait for it, or go to the apiserver, until it has synced.
    fn stop_transcoding(&self, e: &crate::k8s::transcode::TranscodeError, o: &CachedObject) {
        if self.transcode_off.is_cancelled() {
            return;
        }
        tracing::warn!(
            resource = %self.resource.label(),
            namespace = %o.meta.namespace,
            name = %o.meta.name,
            resource_version = o.meta.resource_version,
            error = %e,
            "an object could not be written in protobuf from its JSON (the apiserver is newer than the proxy's schema?): this resource's protobuf envelopes come from its own upstream protobuf watch from now on"
        );
        self.proto_synced
            .store(0, std::sync::atomic::Ordering::Relaxed);
        self.transcode_off.cancel();
        self.proto_attached.notify_waiters();
    }

    /// The bookmark template of a transcoded resource: the kind's zero object, written from
    /// an empty JSON object, as the apiserver's bookmarks are (`c.newFunc()` with only its
    /// resourceVersion set).
    fn transcoded_bookmark(&self) -> Option<(String, Bytes)> {
        let r = &self.resource;
        let raw = crate::k8s::transcode::SCHEMA
            .object(
                &r.group,
                &r.version,
                &r.kind,
                br#"{"metadata":{"resourceVersion":"1"}}"#,
            )
            .ok()?;
        let rest = crate::k8s::protobuf_write::bookmark_rest(&raw)?;
        Some((r.kind.clone(), Bytes::copy_from_slice(rest)))
    }

    /// Whether protobuf reads can be served: the protobuf side has synced and is running.
    pub fn protobuf_ready(&self) -> bool {
        self.proto_synced.load(std::sync::atomic::Ordering::Relaxed) > 0
            && self.is_ready()
            && !self.proto_shed.is_cancelled()
    }

    /// The resource is served from now on (the registry put it in the served set): with
    /// `cache.protobufSide: eager` a built-in resource's protobuf side starts with it, so
    /// its protobuf readers find it synced rather than start it (custom resources have none).
    pub fn served(&self) {
        if (self.cfg.protobuf_eager || self.transcodes()) && !self.resource.custom {
            self.want_protobuf();
        }
    }

    /// A protobuf reader came: the registry starts this resource's protobuf side once.
    pub fn want_protobuf(&self) {
        if !self.cfg.proto_budget.enabled() || self.proto_shed.is_cancelled() {
            return;
        }
        if self.proto_wanted_at.set(Instant::now()).is_ok() {
            if self.transcodes()
                && let Some(b) = self.transcoded_bookmark()
            {
                *self.proto_bookmark.lock() = Some(b);
            }
            self.proto_wanted_tx.send_replace(true);
        }
    }

    /// Whether this resource's protobuf side is starting: it was started (with the resource,
    /// or by its first protobuf reader) less than [`STARTING`] ago, protobuf is enabled, the side was not shed for its memory
    /// budget and has not synced yet.
    pub fn protobuf_coming(&self) -> bool {
        self.cfg.proto_budget.enabled()
            && !self.proto_shed.is_cancelled()
            && self
                .proto_wanted_at
                .get()
                .is_some_and(|t| t.elapsed() < STARTING)
            && !self.protobuf_ready()
    }

    /// The protobuf side's initial state has come, up to `rv`; wakes the watches waiting
    /// for it ([`Self::wait_protobuf_ready`]).
    pub fn protobuf_synced(&self, rv: u64) {
        self.proto_synced
            .fetch_max(rv.max(1), std::sync::atomic::Ordering::Relaxed);
        self.proto_attached.notify_waiters();
    }

    /// Waits (bounded) until the protobuf side has synced ([`Self::protobuf_ready`]).
    pub async fn wait_protobuf_ready(&self, bound: Duration) -> bool {
        wait_attached(&self.proto_attached, || self.protobuf_ready(), bound).await
    }

    /// Whether a protobuf reader has come (the protobuf side runs).
    pub fn protobuf_started(&self) -> bool {
        self.proto_wanted_at.get().is_some()
    }

    /// Resolves once a protobuf reader has come (see [`Self::want_protobuf`]).
    pub async fn protobuf_wanted(&self) {
        let mut rx = self.proto_wanted_tx.subscribe();
        let _ = rx.wait_for(|w| *w).await;
    }

    /// The protobuf side's part of a saved state whose current objects are `objects` (see
    /// [`ProtoImage`]).
    pub(super) fn protobuf_image(&self, objects: &Objects) -> ProtoImage {
        use std::sync::atomic::Ordering::Relaxed;
        let started = self.protobuf_started() && !self.proto_shed.is_cancelled();
        let bookmark = self.proto_bookmark.lock().clone();
        let complete = started
            && bookmark.is_some()
            && self.proto_synced.load(Relaxed) > 0
            && objects.values().all(|o| o.proto.get().is_some());
        ProtoImage {
            complete,
            started,
            bookmark,
        }
    }

    /// After a warm restart (the envelopes came on the restored objects): a protobuf side
    /// that had started before starts again at once, since its readers are coming back.
    /// When the saved state had every envelope it resumes its watch from `rv` and protobuf
    /// reads are served at once, resumed watches from the restored history included;
    /// otherwise it starts over with the whole state and reads wait for it, as on a first
    /// start.
    pub(super) fn restore_protobuf(&self, rv: u64, p: ProtoImage) {
        if self.transcodes() {
            // Every restored object got its envelope as it was loaded.
            self.want_protobuf();
            self.protobuf_synced(rv);
            return;
        }
        if !p.started || !self.cfg.proto_budget.enabled() {
            return;
        }
        if let Some(b) = p.bookmark {
            *self.proto_bookmark.lock() = Some(b);
        }
        if p.complete {
            *self.proto_resume.lock() = Some(rv);
            self.protobuf_synced(rv);
        }
        self.want_protobuf();
    }

    /// Where the protobuf side resumes its watch from, after a warm restart whose saved
    /// state had every envelope (see `Self::restore_protobuf`); `None` afterwards.
    pub fn take_protobuf_resume(&self) -> Option<u64> {
        self.proto_resume.lock().take()
    }

    /// Current objects with and without their protobuf envelope, and the envelopes' bytes.
    pub fn protobuf_coverage(&self) -> (usize, usize, usize) {
        // An O(1) snapshot: the walk holds no lock (writers are not kept waiting by it).
        let objects = self.read().objects.clone();
        let (mut with, mut bytes) = (0, 0);
        for o in objects.values() {
            if let Some(b) = o.proto.get() {
                with += 1;
                bytes += b.len();
            }
        }
        (with, objects.len() - with, bytes)
    }
}
