//! The process-wide bound on the protobuf representation (`cache.protobufMaxBytes`).
//!
//! Each resource's protobuf side attaches an envelope to every object version it caches
//! (`ResourceCache::attach_protobuf`); the envelopes' bytes are charged here as they are
//! attached and corrected to the exact figure of each cache's current objects while the side
//! runs (`ResourceCache::reconcile_protobuf`). A resource whose attachment takes the total
//! over the bound is shed: its protobuf side stops, its current objects drop their
//! envelopes (history events keep theirs until they age out) and its protobuf readers are
//! answered by the apiserver again, as before the side started. The resource stays shed
//! until the process restarts (a log line and `kube_cache_proxy_cache_protobuf_shed` say
//! which). A bound of 0 never starts a protobuf side: every protobuf request passes through.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Debug)]
pub struct ProtoBudget {
    max: u64,
    used: AtomicU64,
}

impl Default for ProtoBudget {
    /// No bound (tests and embedders that do not configure one).
    fn default() -> Self {
        ProtoBudget::new(u64::MAX)
    }
}

impl ProtoBudget {
    pub fn new(max: u64) -> ProtoBudget {
        ProtoBudget {
            max,
            used: AtomicU64::new(0),
        }
    }

    /// Whether protobuf sides may run at all.
    pub fn enabled(&self) -> bool {
        self.max > 0
    }

    /// Adds `n` bytes; false when the total is now over the bound (the caller sheds).
    pub fn charge(&self, n: u64) -> bool {
        let before = self.used.fetch_add(n, Relaxed);
        before.saturating_add(n) <= self.max
    }

    /// Gives `n` charged bytes back.
    pub fn release(&self, n: u64) {
        // Never below zero, whatever the interleaving of charges and releases.
        let _ = self
            .used
            .fetch_update(Relaxed, Relaxed, |u| Some(u.saturating_sub(n)));
    }

    /// Bytes charged now, over all resources.
    pub fn used(&self) -> u64 {
        self.used.load(Relaxed)
    }

    pub fn max(&self) -> u64 {
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_past_the_bound_are_refused_and_releases_never_go_below_zero() {
        let b = ProtoBudget::new(100);
        assert!(b.charge(60));
        assert!(b.charge(40), "exactly at the bound is within it");
        assert!(!b.charge(1), "one byte over is refused");
        assert_eq!(b.used(), 101);
        b.release(101);
        assert_eq!(b.used(), 0);
        b.release(5);
        assert_eq!(b.used(), 0);
        assert!(!ProtoBudget::new(0).enabled());
        assert!(ProtoBudget::default().charge(u64::MAX));
    }
}
