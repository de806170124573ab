//! Escaping and clipping: what no log line shows raw, and how much of a value it shows.

use super::*;

/// True for a character that must not reach a log line raw: C0 and C1 controls (newline, carriage
/// return, the ESC of ANSI sequences, ...), DEL, the Unicode line and paragraph separators (some
/// viewers break lines there) and the bidirectional overrides that reorder what a reader sees.
pub(crate) fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}')
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// Writes `s` with every character of [`needs_escape`] written as an escape: `\n`, `\r`, `\t`, else
/// `\u{..}` (as Rust's `escape_debug` does). Anything else, backslashes included, is written as is.
pub(crate) fn write_escaped(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    // Most lines are printable ASCII: one scan, one write.
    if printable_ascii(s.as_bytes()) {
        return out.write_str(s);
    }
    let mut start = 0;
    for (i, c) in s.char_indices() {
        if needs_escape(c) {
            out.write_str(&s[start..i])?;
            match c {
                '\n' => out.write_str("\\n")?,
                '\r' => out.write_str("\\r")?,
                '\t' => out.write_str("\\t")?,
                c => write!(out, "\\u{{{:x}}}", u32::from(c))?,
            }
            start = i + c.len_utf8();
        }
    }
    out.write_str(&s[start..])
}

/// True when every byte is printable ASCII (0x20..0x7f), tested eight bytes at a time: a log line is
/// about a hundred bytes, and a byte at a time this test cost more than the rest of the line.
pub(super) fn printable_ascii(bytes: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    const SPACE: u64 = u64::from_ne_bytes([0x20; 8]);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        let x = u64::from_ne_bytes(word);
        // A byte below 0x20 (the classic "has a byte less than n" test), or at or above 0x7f
        // (adding 1 sets its top bit; a byte at or above 0x80 has it already).
        if (x.wrapping_sub(SPACE) & !x & HIGH) != 0 || ((x.wrapping_add(ONES) | x) & HIGH) != 0 {
            return false;
        }
    }
    words.remainder().iter().all(|b| (0x20..0x7f).contains(b))
}

/// `s` with control characters escaped (see [`write_escaped`]), for text written outside the logger.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let _ = write_escaped(&mut out, s);
    out
}

/// Most characters of one field's value a log line shows, as much as Sidekiq stores of an error
/// message (issue 43: a 1 MB iteration cursor in an error made a 2 MB line at every retry; a value from
/// Redis or a payload is clipped in logs as it is where it is stored). Past it, `…(N bytes)`.
pub(crate) const MAX_VALUE_CHARS: usize = 10_000;

/// `value` clipped to [`MAX_VALUE_CHARS`], owned.
pub(super) fn clipped(value: &str) -> String {
    crate::redact::clip(value, MAX_VALUE_CHARS).into_owned()
}

/// Clips what `out` holds from `start` (one value just written) to [`MAX_VALUE_CHARS`].
pub(super) fn clip_tail(out: &mut String, start: usize) {
    let Some(value) = out.get(start..) else {
        return;
    };
    if value.len() <= MAX_VALUE_CHARS {
        return;
    }
    if let Some((i, _)) = value.char_indices().nth(MAX_VALUE_CHARS) {
        let total = value.len();
        out.truncate(start + i);
        let _ = write!(out, "…({total} bytes)");
    }
}
