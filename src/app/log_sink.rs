//! Where the process's log lines go: stderr, with the access log's lines
//! (`kube_cache_proxy::access` at info, one per request) gathered in memory and written
//! together, at most `log.accessFlushInterval` after they were logged (klog, which
//! kube-apiserver logs with, flushes its buffer every 5 s; Envoy's access log every 1 s).
//!
//! Why: written one by one, each request's line was a `write` to stderr on the worker that
//! served the request, about 40 µs of CPU per passed-through GET on the real path (of about
//! 380; docs/architecture.md, "What a fan-out and a passed-through GET cost"). Every other
//! line (warnings, errors, the proxy's own info lines) is written at once, after the access
//! lines gathered before it, so the order of lines is the order they were logged in.
//!
//! The gathered lines are written when they reach [`BATCH`] bytes, by a thread that wakes
//! every interval, and by [`LogSink::flush`] (the process calls it as it exits and from its
//! panic hook). A process killed outright (SIGKILL, out of memory) loses at most one
//! interval of access lines.

use std::io::Write;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Gathered access lines are written once they reach this many bytes (a few hundred lines):
/// a busy proxy writes in batches without waiting for the interval.
pub const BATCH: usize = 32 * 1024;

/// The access log's target (`serve::access`).
const ACCESS_TARGET: &str = "kube_cache_proxy::access";

/// A `MakeWriter` for the log subscriber: stderr, or any `W` in tests.
pub struct LogSink<W: Write + Send + 'static = std::io::Stderr> {
    shared: Arc<Mutex<Shared<W>>>,
    /// Whether access lines are gathered (`log.accessFlushInterval` above zero).
    gather: bool,
}

impl<W: Write + Send + 'static> Clone for LogSink<W> {
    fn clone(&self) -> Self {
        LogSink {
            shared: self.shared.clone(),
            gather: self.gather,
        }
    }
}

struct Shared<W> {
    pending: Vec<u8>,
    out: W,
}

impl<W: Write> Shared<W> {
    /// Writes what is pending. A failed write (stderr closed) drops the lines: logging
    /// never stops the proxy.
    fn write_pending(&mut self) {
        if !self.pending.is_empty() {
            let _ = self.out.write_all(&self.pending);
            let _ = self.out.flush();
            self.pending.clear();
            if self.pending.capacity() > 2 * BATCH {
                self.pending.shrink_to(BATCH);
            }
        }
    }
}

impl LogSink<std::io::Stderr> {
    /// The process's sink: stderr, access lines gathered for up to `interval` (zero: each
    /// line written at once, as every other line is), written by a background thread.
    pub fn stderr(interval: Duration) -> LogSink<std::io::Stderr> {
        let sink = LogSink::new(std::io::stderr(), !interval.is_zero());
        if sink.gather {
            let weak = Arc::downgrade(&sink.shared);
            let spawned = std::thread::Builder::new()
                .name("log-flush".into())
                .spawn(move || {
                    while let Some(shared) = {
                        std::thread::sleep(interval);
                        weak.upgrade()
                    } {
                        lock(&shared).write_pending();
                    }
                });
            if spawned.is_err() {
                // No thread: every line is written at once.
                return LogSink::new(std::io::stderr(), false);
            }
        }
        sink
    }
}

impl<W: Write + Send + 'static> LogSink<W> {
    pub fn new(out: W, gather: bool) -> LogSink<W> {
        LogSink {
            shared: Arc::new(Mutex::new(Shared {
                pending: Vec::new(),
                out,
            })),
            gather,
        }
    }

    /// Writes the gathered lines now.
    pub fn flush(&self) {
        lock(&self.shared).write_pending();
    }

    /// Writes the gathered lines unless another thread holds the lock (a panic hook: the
    /// panicking thread may be the one holding it).
    pub fn try_flush(&self) {
        match self.shared.try_lock() {
            Ok(mut s) => s.write_pending(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().write_pending(),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
    }

    /// The writer itself (tests: what reached it).
    pub fn with_out<R>(&self, f: impl FnOnce(&mut W) -> R) -> R {
        f(&mut lock(&self.shared).out)
    }
}

/// The lock, also after a panic while it was held (the lines are plain bytes: nothing can
/// be left half-updated that matters).
fn lock<W>(m: &Mutex<Shared<W>>) -> MutexGuard<'_, Shared<W>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One event's writer: the subscriber formats the whole line, then writes it here.
pub struct LineWriter<'a, W: Write + Send + 'static> {
    sink: &'a LogSink<W>,
    gathered: bool,
}

impl<W: Write + Send + 'static> Write for LineWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut s = lock(&self.sink.shared);
        s.pending.extend_from_slice(buf);
        if !self.gathered || s.pending.len() >= BATCH {
            s.write_pending();
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a, W: Write + Send + 'static> tracing_subscriber::fmt::MakeWriter<'a> for LogSink<W> {
    type Writer = LineWriter<'a, W>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            sink: self,
            gathered: false,
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        LineWriter {
            sink: self,
            gathered: self.gather
                && *meta.level() == tracing::Level::INFO
                && meta.target() == ACCESS_TARGET,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::fmt::MakeWriter;

    fn written(sink: &LogSink<Vec<u8>>) -> String {
        sink.with_out(|o| String::from_utf8(o.clone()).unwrap())
    }

    fn meta_of(target: &'static str, level: tracing::Level) -> &'static tracing::Metadata<'static> {
        // A leaked callsite's metadata, for the writer's choice only.
        struct Cs;
        impl tracing::callsite::Callsite for Cs {
            fn set_interest(&self, _: tracing::subscriber::Interest) {}
            fn metadata(&self) -> &tracing::Metadata<'_> {
                unreachable!()
            }
        }
        static CS: Cs = Cs;
        Box::leak(Box::new(tracing::Metadata::new(
            "event",
            target,
            level,
            None,
            None,
            None,
            tracing::field::FieldSet::new(&[], tracing::callsite::Identifier(&CS)),
            tracing::metadata::Kind::EVENT,
        )))
    }

    #[test]
    fn access_lines_wait_for_a_flush_and_keep_their_order_with_other_lines() {
        let sink = LogSink::new(Vec::new(), true);
        let access = meta_of(ACCESS_TARGET, tracing::Level::INFO);
        let other = meta_of("kube_cache_proxy::cache", tracing::Level::WARN);
        sink.make_writer_for(access).write_all(b"a1\n").unwrap();
        sink.make_writer_for(access).write_all(b"a2\n").unwrap();
        assert_eq!(written(&sink), "", "access lines are gathered");
        // Any other line writes what was gathered before it, then itself.
        sink.make_writer_for(other).write_all(b"w1\n").unwrap();
        assert_eq!(written(&sink), "a1\na2\nw1\n");
        sink.make_writer_for(access).write_all(b"a3\n").unwrap();
        assert_eq!(written(&sink), "a1\na2\nw1\n");
        sink.flush();
        assert_eq!(written(&sink), "a1\na2\nw1\na3\n");
    }

    #[test]
    fn a_full_batch_is_written_without_waiting() {
        let sink = LogSink::new(Vec::new(), true);
        let access = meta_of(ACCESS_TARGET, tracing::Level::INFO);
        let line = [b'x'; 1000];
        let mut n = 0;
        while written(&sink).is_empty() {
            sink.make_writer_for(access).write_all(&line).unwrap();
            n += 1;
            assert!(n <= BATCH / 1000 + 1, "nothing written after {n} lines");
        }
        assert_eq!(written(&sink).len(), n * 1000);
    }

    #[test]
    fn without_gathering_every_line_is_written_at_once() {
        let sink = LogSink::new(Vec::new(), false);
        let access = meta_of(ACCESS_TARGET, tracing::Level::INFO);
        sink.make_writer_for(access).write_all(b"a1\n").unwrap();
        assert_eq!(written(&sink), "a1\n");
        // A debug line of the access target is not an access line either.
        let sink = LogSink::new(Vec::new(), true);
        sink.make_writer_for(meta_of(ACCESS_TARGET, tracing::Level::WARN))
            .write_all(b"w\n")
            .unwrap();
        assert_eq!(written(&sink), "w\n");
    }
}
