//! The writer: the shared buffer lines wait in, the thread that writes it out every 20 ms, its guard,
//! and the installation of the logger (with the warnings raised before it).

use super::*;

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
}

impl Sink {
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
    let flusher = Arc::downgrade(&sink);
    // The flusher ends by itself once the guard and the subscriber's writer are gone.
    let _ = std::thread::Builder::new()
        .name("oxidekiq-log".into())
        .spawn(move || {
            while let Some(sink) = flusher.upgrade() {
                sink.flush();
                drop(sink);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
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
