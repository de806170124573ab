//! The writer: the shared buffer lines wait in, the thread that writes it out (at most every 20 ms, and
//! asleep while no line comes), its guard, and the installation of the logger (with the warnings raised
//! before it).

use super::*;

use std::sync::Condvar;
use std::sync::atomic::AtomicBool;

/// Flushes what is buffered when dropped (at exit).
#[derive(Debug)]
pub(crate) struct LogGuard {
    /// The shared buffer.
    pub(super) sink: Arc<Sink>,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        self.sink.flush();
    }
}

/// Buffered bytes past which the logging thread writes them out itself.
pub(super) const FLUSH_AT: usize = 1 << 20;

/// Where finished lines wait to be written: the buffer they are appended to, and a second one that the
/// writer swaps in for it and writes out. Both keep their capacity: a fresh buffer per flush (every 20
/// ms, growing to a megabyte at full speed) faulted in fresh pages each time, and the kernel zeroing
/// them (`clear_page_erms`) was 8-13% of a no-op job's CPU.
#[derive(Debug, Default)]
pub(crate) struct Sink {
    /// Lines not yet written.
    pub(super) lines: Mutex<Vec<u8>>,
    /// The writer's buffer; its lock also keeps two writers' batches in order.
    pub(super) spare: Mutex<Vec<u8>>,
    /// Set, under the `lines` lock, while the writer sleeps on `wake` for a line to come into the
    /// empty buffer; read under that lock by whoever appends.
    pub(super) idle: AtomicBool,
    /// Wakes the idle writer ([`Sink::appended`]).
    pub(super) wake: Condvar,
}

/// How often the writer writes out at most: a line waits at most this long, plus the writer's wake-up.
pub(super) const FLUSH_EVERY: Duration = Duration::from_millis(20);

/// How long the idle writer sleeps before it looks whether its sink is still there (it ends once the
/// sink is gone: a second logger of the tests).
const IDLE_RECHECK: Duration = Duration::from_secs(5);

impl Sink {
    /// Called by whoever appended to `lines`, with `idle` read under the same lock: the first line into
    /// the empty buffer of a sleeping writer wakes it (a futex wake, at most once per write-out); the
    /// others cost nothing.
    pub(super) fn appended(&self, idle: bool) {
        if idle {
            self.wake.notify_one();
        }
    }

    /// Waits, asleep, until a line is buffered (true), at most [`IDLE_RECHECK`] (false). `None`: the
    /// buffer's lock is poisoned, nothing can be written any more.
    fn wait_for_line(&self) -> Option<bool> {
        let Ok(mut lines) = self.lines.lock() else {
            return None;
        };
        if lines.is_empty() {
            self.idle.store(true, Ordering::Relaxed);
            lines = match self
                .wake
                .wait_timeout_while(lines, IDLE_RECHECK, |l| l.is_empty())
            {
                Ok((l, _)) => l,
                Err(poisoned) => poisoned.into_inner().0,
            };
            self.idle.store(false, Ordering::Relaxed);
        }
        Some(!lines.is_empty())
    }

    /// Writes out what is buffered.
    pub(super) fn flush(&self) {
        let Ok(mut spare) = self.spare.lock() else {
            return;
        };
        match self.lines.lock() {
            Ok(mut b) if !b.is_empty() => std::mem::swap(&mut *b, &mut *spare),
            _ => return,
        }
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(&spare);
        let _ = out.flush();
        spare.clear();
    }
}

/// Installs the Sidekiq-shaped logger on stdout, in `format`, writing lines of `level` and above. Keep
/// the guard alive until exit: dropping it writes out what is still buffered.
pub(crate) fn init_with(level: LogLevel, format: LogFormat) -> LogGuard {
    let sink = Arc::new(Sink::default());
    spawn_writer(&sink);
    let level = level.filter();
    // A second init (tests) keeps the first subscriber.
    let installed =
        tracing::subscriber::set_global_default(Logger::new(level, format, sink.clone()));
    if installed.is_ok() {
        install_panic_hook();
        let early = EARLY.lock().map(|mut e| std::mem::take(&mut *e));
        for message in early.unwrap_or_default() {
            tracing::warn!("{message}");
        }
    }
    LogGuard { sink }
}

/// Starts the thread that writes out `sink`: it sleeps until a line comes into the empty buffer (no
/// wake-up at all while the process logs nothing: it woke every 20 ms before, 50 times a second on an
/// idle process), writes it out at once, then at most every [`FLUSH_EVERY`] while lines keep coming, as
/// before. A line waits at most as long as it did (20 ms); on a quiet process, less. It ends once the
/// guard and the subscriber's writer are gone (within [`IDLE_RECHECK`]).
pub(super) fn spawn_writer(sink: &Arc<Sink>) {
    let flusher = Arc::downgrade(sink);
    let _ = std::thread::Builder::new()
        .name("oxidekiq-log".into())
        .spawn(move || {
            while let Some(sink) = flusher.upgrade() {
                match sink.wait_for_line() {
                    Some(true) => {}
                    Some(false) => continue,
                    None => break,
                }
                sink.flush();
                drop(sink);
                std::thread::sleep(FLUSH_EVERY);
            }
        });
}

/// Warnings raised before the logger is installed (reading flags and `sidekiq.yml` comes first, since
/// they choose the log format), written as the first lines once it is: a warning about an ignored key
/// must not vanish. At most [`EARLY_MAX`] are kept.
pub(super) static EARLY: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Warnings kept for the logger at most.
pub(super) const EARLY_MAX: usize = 100;

/// Logs `message` at warning level now if a logger is installed, else as soon as one is
/// ([`init_with`]).
pub(crate) fn warn_early(message: String) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!("{message}");
        return;
    }
    if let Ok(mut early) = EARLY.lock()
        && early.len() < EARLY_MAX
    {
        early.push(message);
    }
}
