//! The process's memory settings, applied once at start: transparent huge pages off, and
//! the runtime whose idle worker threads give freed memory back ([`runtime`]).
//!
//! Transparent huge pages are turned off for the process. mimalloc asks the kernel for them
//! (`madvise(MADV_HUGEPAGE)` on its arenas), so a burst that touches fresh memory (thousands
//! of watches opening at once) faults in whole 2 MiB pages, zeroed, however little of each
//! it uses. In the load driver's scenario a (10,000 watchers, 100 per TLS connection, real
//! kube-apiserver, 2 shared cores) huge pages were up to 360 of the proxy's 372 MB peak RSS;
//! with them off they are 4 MB (those mapped before `main`). The scenario's peak RSS and CPU
//! per delivery are bimodal whatever this setting (about 70 MB and 5.3 µs, or about 400 MB
//! and 8.4 µs, from run to run), so what huge pages cost beyond their own pages is not
//! established. docs/architecture.md, "Memory bounds", has the figures.

/// Turns transparent huge pages off for this process (`prctl(PR_SET_THP_DISABLE)`, which
/// holds whatever the system's THP mode, and whatever mimalloc asks for). Call it first thing
/// in `main`. An error (a kernel without the call) is returned for the caller to log; the
/// process works either way.
///
/// # Errors
/// The `prctl` call's.
#[cfg(target_os = "linux")]
pub fn disable_transparent_huge_pages() -> Result<(), std::io::Error> {
    nix::sys::prctl::set_thp_disable(true).map_err(std::io::Error::from)
}

/// Not Linux: nothing to turn off.
///
/// # Errors
/// None.
#[cfg(not(target_os = "linux"))]
pub fn disable_transparent_huge_pages() -> Result<(), std::io::Error> {
    Ok(())
}

/// How long the allocator keeps freed memory mapped before it gives it back to the system,
/// unless the environment sets `MIMALLOC_PURGE_DELAY` (the operator's choice then stands):
/// `None` when it does.
///
/// mimalloc's own default is 1 s. The upstream ingest (`cargo run --release -p loadtest --
/// --only ingest`: a cold start listing 20,000 ConfigMaps of 10 KiB, then a MODIFIED event
/// of each; 2 shared cores) spent about half of its CPU zeroing pages the kernel faulted back
/// in after they had been given back: the initial LIST took 0.173 GB per CPU-second with the
/// default, 0.375 with 5 s and 0.396 never giving back; the watch events 0.117, 0.172 and
/// 0.168. Freed memory then goes back 5 s after a burst instead of 1 s.
pub fn purge_delay_ms() -> Option<i64> {
    std::env::var_os("MIMALLOC_PURGE_DELAY")
        .is_none()
        .then_some(PURGE_DELAY_MS)
}

/// See [`purge_delay_ms`].
pub const PURGE_DELAY_MS: i64 = 5_000;

/// How often at most an idle worker thread gives memory back (see [`runtime`]).
pub const RELEASE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The tokio runtime the proxy runs on: multi-threaded with every driver, as
/// `#[tokio::main]` builds it, plus `release_idle_memory` called by a worker thread when it
/// goes idle, at most once per [`RELEASE_EVERY`] per thread.
///
/// The binary that picks the global allocator passes its collection call (mimalloc's
/// `mi_collect`; this crate forbids the `unsafe` such a call needs). What a thread
/// allocated and another freed stays in the first thread's heap until that thread
/// allocates again, so after a burst (10,000 hostile watch streams closed at once) an idle
/// proxy kept tens of MB it no longer used: in the load driver's `hostile-streams`
/// scenario RSS 10 s after the streams closed was 84 MB against 37 MB before them, and
/// 58 MB after 5 s of light traffic woke the threads (docs/architecture.md, "Memory
/// bounds"). Collecting on park gives it back once the threads rest; at most once a second,
/// since a collection visits the thread's pages.
///
/// # Errors
/// The runtime builder's.
pub fn runtime(release_idle_memory: fn()) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_park(move || {
            if due(std::time::Instant::now()) {
                release_idle_memory();
            }
        })
        .build()
}

/// Whether this thread's next release is due at `now` (it then is not before
/// [`RELEASE_EVERY`] has passed).
fn due(now: std::time::Instant) -> bool {
    thread_local! {
        static NEXT: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
    }
    NEXT.with(|next| {
        if next.get().is_some_and(|t| now < t) {
            return false;
        }
        next.set(Some(now + RELEASE_EVERY));
        true
    })
}

#[cfg(test)]
mod release_tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    static RELEASED: AtomicUsize = AtomicUsize::new(0);

    /// A thread's releases are at least [`super::RELEASE_EVERY`] apart, each thread
    /// counting its own.
    #[test]
    fn an_idle_thread_releases_at_most_once_per_interval() {
        let t0 = Instant::now();
        assert!(super::due(t0), "the first park releases");
        assert!(!super::due(t0));
        assert!(!super::due(t0 + super::RELEASE_EVERY / 2));
        assert!(super::due(t0 + super::RELEASE_EVERY));
        assert!(!super::due(t0 + super::RELEASE_EVERY));
        let other = std::thread::spawn(move || super::due(t0)).join().unwrap();
        assert!(other, "another thread has its own interval");
    }

    /// The runtime calls the release when its workers go idle.
    #[test]
    fn the_runtime_releases_memory_when_its_workers_park() {
        let rt = super::runtime(|| {
            RELEASED.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        // Work spawned onto the workers; they park once it is done. Waits for the first
        // release however slow the machine (bounded only so a broken hook fails).
        let released = rt.block_on(async {
            for _ in 0..4 {
                tokio::spawn(async {}).await.unwrap();
            }
            for _ in 0..6000 {
                if RELEASED.load(Ordering::SeqCst) >= 1 {
                    return true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            false
        });
        drop(rt);
        assert!(released, "no worker called the release when it parked");
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn transparent_huge_pages_are_off_for_the_process_once_disabled() {
        super::disable_transparent_huge_pages().expect("prctl");
        assert!(
            nix::sys::prctl::get_thp_disable().expect("prctl"),
            "the process's THP-disable flag is set"
        );
    }
}
