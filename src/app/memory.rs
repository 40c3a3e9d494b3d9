//! The process's memory settings, applied once at start.
//!
//! Transparent huge pages are turned off for the process. mimalloc asks the kernel for them
//! (`madvise(MADV_HUGEPAGE)` on its arenas), so a burst that touches fresh memory (thousands
//! of watches opening at once) faults in whole 2 MiB pages, zeroed, however little of each
//! it uses. Measured with the load driver's scenario a (10,000 watchers, 100 per TLS
//! connection, 5 writes/s, real kube-apiserver, 2 shared cores; five runs each way,
//! alternating): with them the proxy's peak RSS was 198–372 MB (up to 360 MB of it huge
//! pages) and it used 6.2–7.7 µs of CPU per delivery; without them 62–104 MB in four runs
//! (202 MB in one) and 5.2–5.5 µs (6.8 in one), p99 the same (85–104 ms). The kernel
//! zeroing huge pages (`clear_page_erms` under `do_huge_pmd_anonymous_page`) was the
//! largest item of a profile of the proxy over a whole fan-out run. docs/architecture.md,
//! "Memory bounds", has the figures.

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
