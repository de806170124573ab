//! The panic hook: panics logged through the logger, escaped and redacted.

/// Routes panic messages through the logger instead of the default hook's raw `eprintln`: a panic
/// message may quote a payload (escaped like every line) or a Redis URL (redacted). The previous
/// hook still runs if this one is re-entered (a panic while logging a panic).
pub(super) fn install_panic_hook() {
    thread_local! {
        static IN_HOOK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if IN_HOOK.with(|h| h.replace(true)) {
            previous(info);
            return;
        }
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(a panic without a message)");
        let message = crate::redact::redact_urls_in(message);
        let location = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let thread = std::thread::current();
        tracing::error!(
            thread = thread.name().unwrap_or("unnamed"),
            location = %location,
            "panicked: {message}"
        );
        IN_HOOK.with(|h| h.set(false));
    }));
}
