//! The process's memory settings, applied once at start.
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
