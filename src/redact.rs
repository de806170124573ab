//! What we print or store of text that is secret or untrusted: Redis URLs with their passwords
//! hidden, and names from payloads clipped to a bounded length.
//!
//! Layer: support (beside `logging`'s formatting); depends on nothing internal, so every layer above
//! applies the same rules.

use std::borrow::Cow;

/// How much of a name from a payload (a class, a jid) a log line shows.
pub(crate) const NAME_CHARS: usize = 200;

/// `s` cut to at most `max` characters, with `…(N bytes)` saying how long it was: a class name or a
/// jid from a payload can be megabytes, and a log line or a remembered set must not be.
pub(crate) fn clip(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    match s.char_indices().nth(max) {
        Some((i, _)) => Cow::Owned(format!("{}…({} bytes)", &s[..i], s.len())),
        None => Cow::Borrowed(s),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn clip_keeps_short_text_and_says_how_long_the_long_was() {
        assert_eq!(super::clip("abc", 3), "abc");
        assert_eq!(super::clip("abcd", 3), "abc…(4 bytes)");
        assert_eq!(super::clip("ééé", 2), "éé…(6 bytes)");
    }
}
