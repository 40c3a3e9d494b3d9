//! Feature `count-alloc`: the heap of the proxy child over time. Every allocation through
//! mimalloc is counted (two atomic operations: the bytes now and the most since the last
//! sample), and `start` writes `ms now_bytes max_bytes` every 10 ms to the file named by
//! `KCP_ALLOC_TRACE`. A diagnostic: it costs CPU on every allocation.

use std::alloc::{GlobalAlloc, Layout};
use std::io::Write;
use std::sync::atomic::{AtomicI64, Ordering};

static NOW: AtomicI64 = AtomicI64::new(0);
static MAX: AtomicI64 = AtomicI64::new(0);
/// Bytes now by the allocation's size class (log2 of its size).
static BY_SIZE: [AtomicI64; 40] = [const { AtomicI64::new(0) }; 40];

fn class(n: usize) -> usize {
    (usize::BITS - n.leading_zeros()).min(39) as usize
}

pub struct Counting;

fn add(n: usize) {
    let n = i64::try_from(n).unwrap_or(i64::MAX);
    BY_SIZE[class(n as usize)].fetch_add(n, Ordering::Relaxed);
    let now = NOW.fetch_add(n, Ordering::Relaxed) + n;
    MAX.fetch_max(now, Ordering::Relaxed);
}

fn sub(n: usize) {
    BY_SIZE[class(n)].fetch_sub(i64::try_from(n).unwrap_or(i64::MAX), Ordering::Relaxed);
    NOW.fetch_sub(i64::try_from(n).unwrap_or(i64::MAX), Ordering::Relaxed);
}

// SAFETY: every call is forwarded to mimalloc unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        add(l.size());
        // SAFETY: forwarded as received.
        unsafe { mimalloc::MiMalloc.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        add(l.size());
        // SAFETY: forwarded as received.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        sub(l.size());
        // SAFETY: forwarded as received.
        unsafe { mimalloc::MiMalloc.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        sub(l.size());
        add(new);
        // SAFETY: forwarded as received.
        unsafe { mimalloc::MiMalloc.realloc(p, l, new) }
    }
}

/// Starts the sampling thread when `KCP_ALLOC_TRACE` names a file.
pub fn start() {
    let Some(path) = std::env::var_os("KCP_ALLOC_TRACE") else {
        return;
    };
    let Ok(mut f) = std::fs::File::create(path) else {
        return;
    };
    let t0 = std::time::Instant::now();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(std::time::Duration::from_millis(10));
            let now = NOW.load(Ordering::Relaxed);
            let max = MAX.swap(now, Ordering::Relaxed);
            let rss = std::fs::read_to_string("/proc/self/statm")
                .ok()
                .and_then(|s| {
                    s.split_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse::<i64>().ok())
                })
                .unwrap_or(0)
                * 4096;
            let by: Vec<String> = BY_SIZE
                .iter()
                .enumerate()
                .filter_map(|(i, b)| {
                    let b = b.load(Ordering::Relaxed);
                    (b >= 1 << 20).then(|| format!("<2^{i}:{}M", b >> 20))
                })
                .collect();
            let ms = t0.elapsed().as_millis();
            if writeln!(f, "{ms} {now} {max} {rss} {}", by.join(",")).is_err() {
                return;
            }
        }
    });
}
