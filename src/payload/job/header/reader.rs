//! [`scan`], the hand-written JSON reader of a payload's header, and its readings of an ActiveJob
//! wrapper's `job_data` and `arguments`.

use super::fields::{Field, RAILS_KEYS, named_bit, rails_key_at, wrapper_at};
use super::*;

/// Nesting [`scan`] reads (serde_json's own limit is 128); deeper payloads go to serde_json.
pub(super) const MAX_DEPTH: usize = 64;

/// The hand-written reader: `None` for anything it does not read exactly as serde_json would.
#[cfg(any(test, fuzzing))]
pub(super) fn scan(raw: &str) -> Option<Header<'_>> {
    let mut h = Header::default();
    scan_into(raw, &mut h).map(|()| h)
}

/// [`scan`] into `h` (a [`Header::default`]); what it holds after `None` is meaningless.
pub(super) fn scan_into<'a>(raw: &'a str, h: &mut Header<'a>) -> Option<()> {
    let mut r = Reader::new(raw);
    r.ws();
    r.eat(b'{')?;
    r.ws();
    let mut more = r.eat(b'}').is_none();
    while more {
        let key = r.key()?;
        r.colon()?;
        let start = r.i;
        let (slot, bit) = match key {
            b"class" => (&mut h.class, CLASS),
            b"jid" => (&mut h.jid, JID),
            b"queue" => (&mut h.queue, QUEUE),
            b"wrapped" => (&mut h.wrapped, WRAPPED),
            b"retry" => (&mut h.retry, 0),
            b"args" => {
                if h.activejob {
                    r.wrapper_args(&mut h.job_data)?;
                } else {
                    r.value(1)?;
                }
                (&mut h.args, 0)
            }
            _ => {
                h.named |= named_bit(key);
                r.value(1)?;
                more = r.more(b'}')?;
                continue;
            }
        };
        let wrapper = if bit == CLASS {
            wrapper_at(r.b, r.i)
        } else {
            0
        };
        if wrapper > 0 {
            r.i += wrapper;
            h.plain |= CLASS;
            h.activejob = true;
        } else if bit != 0 {
            if r.string_value(1)? {
                h.plain |= bit;
            }
        } else if key != b"args" {
            r.string_value(1)?;
        }
        let text = r.s.get(start..r.i)?;
        // Twice is serde's error. `null` reads as an absent `Option`, after which a second one would
        // go unnoticed here (and a `null` `args` is serde's own error): all left to serde.
        if slot.is_some() || text == "null" {
            return None;
        }
        *slot = Some(text);
        more = r.more(b'}')?;
    }
    r.ws();
    (r.i == r.b.len()).then_some(())
}

/// The four `job_data` fields of an ActiveJob wrapper's `args` text (`[job_data]`), read and checked
/// as [`scan`] reads them in a payload: `None` when it is not exactly one hash naming each field at
/// most once, or not JSON [`scan`] reads.
pub(crate) fn job_data(args: &str) -> Option<JobDataText<'_>> {
    let mut r = Reader::new(args);
    r.ws();
    let mut fields = None;
    r.wrapper_args(&mut fields)?;
    r.ws();
    if r.i == r.b.len() { fields } else { None }
}

/// The [`Markers`] of an ActiveJob `arguments` text, read and checked as in a payload; `None` when it
/// is not JSON [`scan`] reads.
#[cfg(test)]
pub(crate) fn markers(arguments: &str) -> Option<Markers> {
    let mut r = Reader::new(arguments);
    let mut m = Markers::default();
    r.ws();
    r.marked(Nest::ARGUMENTS, 0, &mut m)?;
    r.ws();
    (r.i == r.b.len()).then_some(m)
}

/// Where a value inside ActiveJob `arguments` sits: `depth` containers in the payload, `args` of them
/// inside `arguments`.
#[derive(Clone, Copy)]
pub(super) struct Nest {
    depth: usize,
    args: usize,
}

impl Nest {
    /// `arguments` itself: in `job_data`, in the wrapper's `args`, in the payload.
    const ARGUMENTS: Nest = Nest { depth: 3, args: 0 };

    fn inner(self) -> Nest {
        Nest {
            depth: self.depth + 1,
            args: self.args + 1,
        }
    }
}

pub(super) struct Reader<'a> {
    pub(super) s: &'a str,
    pub(super) b: &'a [u8],
    pub(super) i: usize,
}

impl<'a> Reader<'a> {
    fn new(s: &'a str) -> Self {
        Reader {
            s,
            b: s.as_bytes(),
            i: 0,
        }
    }

    /// The byte at the cursor; 0 past the end (a byte JSON never has outside a string).
    #[inline(always)]
    fn peek(&self) -> u8 {
        self.b.get(self.i).copied().unwrap_or(0)
    }

    /// Past any whitespace. Compact JSON (what Ruby writes) has none: one comparison then.
    #[inline(always)]
    fn ws(&mut self) {
        if self.peek() <= b' ' {
            self.ws_slow();
        }
    }

    #[inline(never)]
    fn ws_slow(&mut self) {
        while matches!(self.b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    #[inline(always)]
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek() == c).then(|| self.i += 1)
    }

    /// `:` between a key and its value, with the whitespace around it.
    #[inline(always)]
    fn colon(&mut self) -> Option<()> {
        if self.peek() == b':' {
            self.i += 1;
        } else {
            self.ws_slow();
            self.eat(b':')?;
        }
        self.ws();
        Some(())
    }

    /// After a member of a container that `close` ends: `Some(true)` past a comma (another member
    /// follows), `Some(false)` past `close`.
    #[inline(always)]
    fn more(&mut self, close: u8) -> Option<bool> {
        let mut c = self.peek();
        if c <= b' ' {
            self.ws_slow();
            c = self.peek();
        }
        if c == b',' {
            self.i += 1;
            self.ws();
            Some(true)
        } else if c == close {
            self.i += 1;
            Some(false)
        } else {
            None
        }
    }

    /// A key with no escape: its bytes, without the quotes.
    #[inline(always)]
    fn key(&mut self) -> Option<&'a [u8]> {
        let start = self.i + 1;
        self.string(false)?;
        self.b.get(start..self.i - 1)
    }

    /// A string ([`string_at`]): `true` when it held an escape.
    #[inline(always)]
    fn string(&mut self, escapes: bool) -> Option<bool> {
        string_at(self.b, &mut self.i, escapes)
    }

    /// A string whose opening quote the caller saw at the cursor.
    #[inline(always)]
    fn string_seen(&mut self) -> Option<bool> {
        let (end, escaped) = string_body(self.b, self.i + 1, true)?;
        self.i = end;
        Some(escaped)
    }

    /// Any value ([`Reader::value`]): `true` when it is a string without an escape.
    #[inline(always)]
    fn string_value(&mut self, depth: usize) -> Option<bool> {
        match self.peek() {
            b'"' => self.string_seen().map(|escaped| !escaped),
            // `null` and numbers (most of `job_data` besides strings) without the call to `value`.
            b'n' => self.literal(b"null").map(|()| false),
            b'0'..=b'9' => self.number().map(|()| false),
            _ => self.value(depth).map(|()| false),
        }
    }

    /// Past an opening bracket: `Some(true)` when a member follows, `Some(false)` past `close`.
    #[inline(always)]
    fn first(&mut self, close: u8) -> Option<bool> {
        self.i += 1;
        self.ws();
        Some(self.eat(close).is_none())
    }

    /// Any JSON value, checked; `depth`: the containers it sits in.
    fn value(&mut self, depth: usize) -> Option<()> {
        match self.peek() {
            b'"' => self.string_seen().map(drop),
            b'{' | b'[' if depth >= MAX_DEPTH => None,
            b'{' => {
                let mut more = self.first(b'}')?;
                while more {
                    self.string(true)?;
                    self.colon()?;
                    self.value(depth + 1)?;
                    more = self.more(b'}')?;
                }
                Some(())
            }
            b'[' => {
                let mut more = self.first(b']')?;
                while more {
                    self.value(depth + 1)?;
                    more = self.more(b']')?;
                }
                Some(())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number(),
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.b
            .get(self.i..)?
            .starts_with(word)
            .then(|| self.i += word.len())
    }

    /// Past a run of ASCII digits; how many. Eight at a time while eight bytes remain: the timestamps
    /// every payload carries (`created_at`, `enqueued_at`: 17 characters as Sidekiq ≤ 7 writes them)
    /// cost a byte-by-byte loop several instructions a digit.
    #[inline(always)]
    pub(super) fn digits(&mut self) -> usize {
        const ONES: u64 = u64::MAX / 255;
        const HIGHS: u64 = ONES << 7;
        let start = self.i;
        while let Some(chunk) = self.b.get(self.i..self.i + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let x = u64::from_le_bytes(word);
            // A byte is a digit when it is at least b'0' (x - '0' does not borrow below it) and at most
            // b'9' (x + (0x7f - '9') does not reach 0x80); bytes ≥ 0x80 are flagged by `x` itself.
            // The lowest flagged byte is the first that is not a digit (no borrow crosses into a
            // lower byte, so the bytes below it are judged exactly).
            let below = x.wrapping_sub(ONES * u64::from(b'0'));
            let above = x.wrapping_add(ONES * u64::from(0x7f - b'9'));
            let not_digit = (below | above | x) & HIGHS;
            if not_digit != 0 {
                self.i += not_digit.trailing_zeros() as usize / 8;
                return self.i - start;
            }
            self.i += 8;
        }
        while self.peek().is_ascii_digit() {
            self.i += 1;
        }
        self.i - start
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    #[inline]
    fn number(&mut self) -> Option<()> {
        self.eat(b'-');
        match self.peek() {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.eat(b'.').is_some() && self.digits() == 0 {
            return None;
        }
        if matches!(self.peek(), b'e' | b'E') {
            self.i += 1;
            if matches!(self.peek(), b'+' | b'-') {
                self.i += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(())
    }

    /// An ActiveJob wrapper's `args`, checked as any value, with the four fields of its first
    /// element when that is the only one and a hash naming none of them twice.
    fn wrapper_args(&mut self, out: &mut Option<JobDataText<'a>>) -> Option<()> {
        if self.peek() != b'[' {
            return self.value(1);
        }
        let mut more = self.first(b']')?;
        if more && self.peek() == b'{' {
            // Filled in place (it is big): cleared again unless it is exactly one job_data hash.
            let found = out.insert(JobDataText::default());
            let mut twice = false;
            // Where the next key of Rails' order is expected in RAILS_KEYS.
            let mut next = 0;
            let mut more_keys = self.first(b'}')?;
            while more_keys {
                let (field, escaped) = match rails_key_at(self.b, self.i, next) {
                    // The key Rails writes next, and its colon: one comparison of bytes.
                    n if n > 0 => {
                        self.i += n;
                        let field = Field::rails(next);
                        next += 1;
                        self.ws();
                        // Seven of Rails' eleven keys are none of the four: their value is only
                        // checked, without the bookkeeping below.
                        if field == Field::Other {
                            self.string_value(3)?;
                            more_keys = self.more(b'}')?;
                            continue;
                        }
                        (field, false)
                    }
                    _ => {
                        let key_start = self.i + 1;
                        let escaped = self.string(true)?;
                        let key = self.b.get(key_start..self.i - 1)?;
                        self.colon()?;
                        // Back in step with Rails' order after a key it has in another place.
                        if let Some(at) = RAILS_KEYS
                            .iter()
                            .position(|lit| lit.get(1..lit.len() - 2) == Some(key))
                        {
                            next = at + 1;
                        }
                        (Field::of(key), escaped)
                    }
                };
                let start = self.i;
                if field == Field::Arguments {
                    self.marked(Nest::ARGUMENTS, start, &mut found.markers)?;
                } else if self.string_value(3)? {
                    found.plain |= match field {
                        Field::JobClass => JOB_CLASS,
                        Field::JobId => JOB_ID,
                        _ => 0,
                    };
                }
                let slot = match field {
                    Field::JobClass => Some(&mut found.job_class),
                    Field::JobId => Some(&mut found.job_id),
                    Field::Executions => Some(&mut found.executions),
                    Field::Arguments => Some(&mut found.arguments),
                    // Its text is not kept: no slice of it is taken.
                    Field::Other => None,
                };
                // An escaped key could spell one of the four: the unwrapping reads the text then.
                twice |= escaped;
                if let Some(slot) = slot {
                    twice |= slot.replace(self.s.get(start..self.i)?).is_some();
                }
                more_keys = self.more(b'}')?;
            }
            more = self.more(b']')?;
            if more || twice {
                *out = None;
            }
        }
        while more {
            self.value(2)?;
            more = self.more(b']')?;
        }
        Some(())
    }

    /// Any value inside ActiveJob `arguments` whose text starts at `base`, checked as
    /// [`Reader::value`] checks it, its ActiveJob keys noted in `m`.
    fn marked(&mut self, at: Nest, base: usize, m: &mut Markers) -> Option<()> {
        match self.peek() {
            b'{' | b'[' if at.args >= ARGS_MAX_DEPTH => {
                m.full();
                self.value(at.depth)
            }
            b'{' | b'[' if at.depth >= MAX_DEPTH => None,
            b'{' => self.marked_hash(at, base, m),
            b'[' => {
                let mut more = self.first(b']')?;
                while more {
                    // A scalar element (most arguments) without the call for a container.
                    if matches!(self.peek(), b'{' | b'[') {
                        self.marked(at.inner(), base, m)?;
                    } else {
                        self.string_value(at.depth + 1)?;
                    }
                    more = self.more(b']')?;
                }
                Some(())
            }
            _ => self.string_value(at.depth).map(drop),
        }
    }

    /// A hash inside ActiveJob `arguments` ([`Reader::marked`]): at most one well-formed marker is
    /// cut (with the comma before it, or, first in its hash, with the one after it).
    fn marked_hash(&mut self, at: Nest, base: usize, m: &mut Markers) -> Option<()> {
        let mut more = self.first(b'}')?;
        let mut marker = false;
        // The last comma between members of this hash.
        let mut comma = None;
        while more {
            let key_start = self.i;
            // A key holding an escape could spell a marker: the full decoder reads it.
            if self.string(true)? {
                m.full();
            }
            let key = self.b.get(key_start + 1..self.i - 1)?;
            self.colon()?;
            let value_start = self.i;
            self.marked(at.inner(), base, m)?;
            let value_end = self.i;
            if key.starts_with(b"_aj_") {
                let value = self.b.get(value_start..value_end)?;
                let is = |name: &str| key == name.as_bytes();
                let well_formed = match () {
                    () if is(SYMBOL_KEYS_KEY) || is(RUBY2_KEYWORDS_KEY) => key_names(value),
                    () if is(INDIFFERENT_KEY) => Some(value == b"true" || value == b"false"),
                    () if is(GLOBALID_KEY) || is(SERIALIZER_KEY) => Some(false),
                    // Another `_aj_` key is an ordinary key (`deserialize_hash` keeps it).
                    _ => None,
                };
                match well_formed {
                    None => {}
                    Some(false) => m.full(),
                    Some(true) if marker => m.full(),
                    Some(true) => {
                        marker = true;
                        match comma {
                            // Not the first member: cut from the comma before it.
                            Some(c) => m.cut(c - base, value_end - base),
                            // The first member: cut it and the comma after it, if any.
                            None => {
                                self.ws();
                                let to = if self.peek() == b',' {
                                    self.i + 1
                                } else {
                                    value_end
                                };
                                m.cut(key_start - base, to - base);
                            }
                        }
                    }
                }
            }
            self.ws();
            if self.peek() == b',' {
                comma = Some(self.i);
            }
            more = self.more(b'}')?;
        }
        Some(())
    }
}

/// Whether `value` (JSON text the reader checked) is `[ "name", ... ]`, what `_aj_symbol_keys` and
/// `_aj_ruby2_keywords` hold.
pub(super) fn key_names(value: &[u8]) -> Option<bool> {
    let mut r = Reader {
        s: "",
        b: value,
        i: 0,
    };
    if r.peek() != b'[' {
        return Some(false);
    }
    let mut more = r.first(b']')?;
    while more {
        if r.peek() != b'"' {
            return Some(false);
        }
        r.string(true)?;
        more = r.more(b']')?;
    }
    Some(true)
}

/// The string that opens at `b[*i] == '"'`, checked as serde_json checks one it skips: no control
/// character, and only the escapes JSON has (`\u` with four hex digits; its value is not checked, as
/// serde_json's skipping does not). `escapes: false` refuses any escape. Leaves `*i` just past it;
/// `true` when it held an escape.
#[inline(always)]
pub(crate) fn string_at(b: &[u8], i: &mut usize, escapes: bool) -> Option<bool> {
    if b.get(*i) != Some(&b'"') {
        return None;
    }
    let (end, escaped) = string_body(b, *i + 1, escapes)?;
    *i = end;
    Some(escaped)
}

/// [`string_at`] past its opening quote, at `j`: the index just past the closing quote, and whether
/// the string held an escape.
#[inline(always)]
pub(super) fn string_body(b: &[u8], mut j: usize, escapes: bool) -> Option<(usize, bool)> {
    const ONES: u64 = u64::MAX / 255;
    const HIGHS: u64 = ONES << 7;
    let mut escaped = false;
    loop {
        // Eight bytes at a time up to a quote, a backslash or a control character (serde_json's
        // `skip_to_escape` trick: the lowest flagged byte is the first match).
        while let Some(chunk) = b.get(j..j + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let x = u64::from_le_bytes(word);
            let quote = x ^ (ONES * u64::from(b'"'));
            let backslash = x ^ (ONES * u64::from(b'\\'));
            let control = x.wrapping_sub(ONES * 0x20) & !x;
            let found = (control
                | quote.wrapping_sub(ONES) & !quote
                | backslash.wrapping_sub(ONES) & !backslash)
                & HIGHS;
            if found != 0 {
                j += found.trailing_zeros() as usize / 8;
                break;
            }
            j += 8;
        }
        match *b.get(j)? {
            b'"' => return Some((j + 1, escaped)),
            b'\\' if escapes => {
                escaped = true;
                match *b.get(j + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => j += 2,
                    b'u' => {
                        let hex = b.get(j + 2..j + 6)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return None;
                        }
                        j += 6;
                    }
                    _ => return None,
                }
            }
            c if c < 0x20 || c == b'\\' => return None,
            _ => j += 1,
        }
    }
}
