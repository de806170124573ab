//! Reading a payload's dispatch fields in one pass, and, for an ActiveJob wrapper, the four `job_data`
//! fields its unwrapping needs ([`crate::activejob`]) in that same pass: without this the `job_data`
//! hash, most of an ActiveJob payload's bytes, was walked twice (once here, once to unwrap it).
//!
//! Two readers. [`scan`] is a hand-written one for what Sidekiq clients write: it checks the JSON
//! grammar as it goes and refuses (`None`) anything it does not expect, a key with an escape, a
//! field given twice, nesting deeper than [`MAX_DEPTH`] or any grammar error. serde_json's reading of
//! a struct of optional raw fields ([`Plain`]) is the reference: it reads whatever [`scan`] refused,
//! and its answer (or error) is the one returned. [`scan`] never accepts a text serde_json refuses and
//! finds the same fields where it accepts (the tests `generated_payloads_read_the_same_both_ways` and
//! `mutated_payloads_are_never_accepted_by_scan_alone` compare them); it costs a fraction of the serde
//! walk, which mattered most for ActiveJob payloads, three times the size of a plain one.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::activejob_keys::{
    GLOBALID_KEY, INDIFFERENT_KEY, RUBY2_KEYWORDS_KEY, SERIALIZER_KEY, SYMBOL_KEYS_KEY,
};
use super::{TIMEOUT_FIELD, UNIQUE_KEY_FIELD};

/// The dispatch fields, each the raw JSON text of its value (a slice of the payload); `None` when
/// absent or `null` (as an `Option` field reads it).
#[derive(Default, Debug, PartialEq)]
pub(super) struct Header<'a> {
    pub(super) class: Option<&'a str>,
    pub(super) jid: Option<&'a str>,
    pub(super) queue: Option<&'a str>,
    pub(super) wrapped: Option<&'a str>,
    pub(super) args: Option<&'a str>,
    pub(super) retry: Option<&'a str>,
    /// For an ActiveJob wrapper whose `class` came before `args` (as every Sidekiq client writes it)
    /// and whose `args` holds one hash naming none of the four fields twice: what that hash holds.
    pub(super) job_data: Option<JobDataText<'a>>,
    /// Which of `class`, `jid`, `queue`, `wrapped` ([`CLASS`], [`JID`], [`QUEUE`], [`WRAPPED`]) the
    /// reader saw to be a string without an escape, so that nobody looks for one again (0 from
    /// serde_json's reading: each is then checked).
    pub(super) plain: u8,
    /// Which of the top-level keys the runtime asks about the payload may carry ([`UNIQUE_KEY`],
    /// [`TIMEOUT`], [`GEM_LOCK`]): [`scan`] knows (it read every top-level key); after serde_json,
    /// whether the text names them at all. Each saves a substring search of the whole payload per job
    /// (an ActiveJob payload is three times a plain one).
    pub(super) named: u8,
    /// [`scan`] saw `class` to be one of [`ACTIVEJOB_WRAPPERS`](super::ACTIVEJOB_WRAPPERS), written
    /// without an escape (false from serde_json's reading: the decoder then compares the class).
    pub(super) activejob: bool,
}

/// Bits of [`Header::named`]: `unique_key`, the until-executed lock's field.
pub(super) const UNIQUE_KEY: u8 = 1;
/// Bits of [`Header::named`]: `oxidekiq_timeout`, a job's own timeout.
pub(super) const TIMEOUT: u8 = 2;
/// Bits of [`Header::named`]: `lock` or `lock_digest`, what sidekiq-unique-jobs' server reads.
pub(super) const GEM_LOCK: u8 = 4;

/// The top-level keys of [`GEM_LOCK`] (sidekiq-unique-jobs' `lock` type and `lock_digest`).
pub(super) const GEM_LOCK_KEYS: [&str; 2] = ["lock", "lock_digest"];

/// The length of the `class` value at `b[i..]` when it is one of the ActiveJob wrappers' names,
/// quoted, with no escape (else 0): one comparison of bytes with each literal instead of reading the
/// 54-byte string and comparing it twice more (`args` and the decoder ask whether it is a wrapper).
/// The test `wrapper_literals_are_the_wrappers` holds the literals to `ACTIVEJOB_WRAPPERS`.
#[inline(always)]
fn wrapper_at(b: &[u8], i: usize) -> usize {
    #[inline(always)]
    fn at<const N: usize>(b: &[u8], i: usize, lit: &[u8; N]) -> usize {
        match b.get(i..i + N) {
            Some(here) if here == lit => N,
            _ => 0,
        }
    }
    // The first letter tells the two apart, and a plain job's class from both with no call to
    // compare the bytes (a slice compared with a long literal is a `bcmp` call).
    match b.get(i + 1) {
        Some(b'A') => at(
            b,
            i,
            b"\"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper\"",
        ),
        Some(b'S') => at(b, i, b"\"Sidekiq::ActiveJob::Wrapper\""),
        _ => 0,
    }
}

/// The [`Header::named`] bit of a top-level key. Literal patterns (a length test, then a word
/// compare) as this runs for every top-level key of every job; the test
/// `named_keys_are_the_runtime_s_names` holds them to the constants.
#[inline(always)]
fn named_bit(key: &[u8]) -> u8 {
    match key {
        b"unique_key" => UNIQUE_KEY,
        b"oxidekiq_timeout" => TIMEOUT,
        b"lock" | b"lock_digest" => GEM_LOCK,
        _ => 0,
    }
}

/// Bits of [`Header::plain`].
pub(super) const CLASS: u8 = 1;
/// Bits of [`Header::plain`].
pub(super) const JID: u8 = 2;
/// Bits of [`Header::plain`].
pub(super) const QUEUE: u8 = 4;
/// Bits of [`Header::plain`].
pub(super) const WRAPPED: u8 = 8;

/// The raw JSON text of the `job_data` fields [`crate::activejob`] reads; `None` when absent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct JobDataText<'a> {
    pub(crate) job_class: Option<&'a str>,
    pub(crate) job_id: Option<&'a str>,
    pub(crate) executions: Option<&'a str>,
    pub(crate) arguments: Option<&'a str>,
    /// `job_class` ([`JOB_CLASS`]) and `job_id` ([`JOB_ID`]) when each is a string without an escape.
    pub(crate) plain: u8,
    /// ActiveJob's keys in `arguments`, noted while they were read.
    pub(crate) markers: Markers,
}

/// Bits of [`JobDataText::plain`].
pub(crate) const JOB_CLASS: u8 = 1;
/// Bits of [`JobDataText::plain`].
pub(crate) const JOB_ID: u8 = 2;

/// The most hash markers [`Markers`] holds; more sends the arguments to the full decoder.
const MAX_CUTS: usize = 8;

/// Nesting (containers inside `arguments`, itself included) whose markers [`Markers`] follows; deeper
/// arguments take the full decoder.
pub(crate) const ARGS_MAX_DEPTH: usize = 32;

/// What the ActiveJob arguments' text holds of ActiveJob's own keys (`arguments.rb`), noted while the
/// reader checks it, so that the unwrapping does not walk it again. The plain reading of the text with
/// the [`Markers::cuts`] taken out is the decoded arguments, unless [`Markers::cuts`] is `None`.
///
/// Only keys matter: an ActiveJob marker is always a hash key, and a key holding a backslash could
/// spell one in escapes. Ruby's JSON never writes a duplicate key (a Ruby hash has none), so the plain
/// reading and the `Value` reading agree on every hash.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Markers {
    /// A GlobalID, a serialized object, a malformed or repeated marker, an escaped key, more than
    /// [`MAX_CUTS`] markers or nesting deeper than [`ARGS_MAX_DEPTH`]: the full decoder must run.
    full: bool,
    /// How many of `cuts` are used.
    n: u8,
    /// Byte ranges of the arguments' text, in order, that hold the well-formed hash markers
    /// (`_aj_symbol_keys`, `_aj_ruby2_keywords`, `_aj_hash_with_indifferent_access`, at most one per
    /// hash) and a comma next to each: `deserialize_hash` does nothing else to such a hash.
    cuts: [(u32, u32); MAX_CUTS],
}

impl Markers {
    fn full(&mut self) {
        self.full = true;
    }

    fn cut(&mut self, from: usize, to: usize) {
        match (
            self.cuts.get_mut(usize::from(self.n)),
            u32::try_from(from),
            u32::try_from(to),
        ) {
            (Some(slot), Ok(a), Ok(z)) => {
                *slot = (a, z);
                self.n += 1;
            }
            _ => self.full = true,
        }
    }

    /// The ranges to cut out of the text (empty: it is the decoded arguments as it is); `None` when
    /// the full decoder must run.
    pub(crate) fn cuts(&self) -> Option<&[(u32, u32)]> {
        if self.full {
            return None;
        }
        self.cuts.get(..usize::from(self.n))
    }

    /// `text` (the arguments these markers were noted in) with the cuts taken out; `None` when the
    /// full decoder must run.
    pub(crate) fn strip(&self, text: &str) -> Option<String> {
        let cuts = self.cuts()?;
        let mut out = String::with_capacity(text.len());
        let mut from = 0;
        for &(a, z) in cuts {
            out.push_str(text.get(from..a as usize)?);
            from = z as usize;
        }
        out.push_str(text.get(from..)?);
        Some(out)
    }
}

/// The reference reader: serde_json's reading of the six fields.
#[derive(Deserialize)]
struct Plain<'a> {
    #[serde(default, borrow)]
    class: Option<&'a RawValue>,
    #[serde(default, borrow)]
    jid: Option<&'a RawValue>,
    #[serde(default, borrow)]
    queue: Option<&'a RawValue>,
    #[serde(default, borrow)]
    wrapped: Option<&'a RawValue>,
    #[serde(default, borrow)]
    args: Option<&'a RawValue>,
    #[serde(default, borrow)]
    retry: Option<&'a RawValue>,
}

impl<'a> Header<'a> {
    /// Reads the header of `raw`, a JSON text: serde_json's answer for a struct of optional fields
    /// (duplicate fields and trailing characters are errors, unknown keys ignored).
    #[cfg(test)]
    pub(super) fn read(raw: &'a str) -> Result<Header<'a>, serde_json::Error> {
        let mut h = Header::default();
        Self::read_into(raw, &mut h).map(|()| h)
    }

    /// [`Header::read`] into `h`, which must be [`Header::default`]: the header is big, and written
    /// where the decoder keeps it rather than moved there.
    pub(super) fn read_into(raw: &'a str, h: &mut Header<'a>) -> Result<(), serde_json::Error> {
        if scan_into(raw, h).is_none() {
            *h = Self::read_plain(raw)?;
        }
        Ok(())
    }

    fn read_plain(raw: &'a str) -> Result<Header<'a>, serde_json::Error> {
        let p: Plain<'a> = serde_json::from_str(raw)?;
        let get = |v: Option<&'a RawValue>| v.map(RawValue::get);
        Ok(Header {
            class: get(p.class),
            jid: get(p.jid),
            queue: get(p.queue),
            wrapped: get(p.wrapped),
            args: get(p.args),
            retry: get(p.retry),
            job_data: None,
            plain: 0,
            activejob: false,
            // A key spelled with an escape (`unique\u005fkey`) reads as `unique_key` too: any `\u`
            // keeps every test on (this path is rare, so the cost is nil).
            named: if raw.contains("\\u") {
                UNIQUE_KEY | TIMEOUT | GEM_LOCK
            } else {
                let bit = |names: &[&str], bit: u8| {
                    if names.iter().any(|n| raw.contains(n)) {
                        bit
                    } else {
                        0
                    }
                };
                bit(&[UNIQUE_KEY_FIELD], UNIQUE_KEY)
                    | bit(&[TIMEOUT_FIELD], TIMEOUT)
                    | bit(&GEM_LOCK_KEYS, GEM_LOCK)
            },
        })
    }
}

/// Nesting [`scan`] reads (serde_json's own limit is 128); deeper payloads go to serde_json.
const MAX_DEPTH: usize = 64;

/// The hand-written reader: `None` for anything it does not read exactly as serde_json would.
#[cfg(any(test, fuzzing))]
fn scan(raw: &str) -> Option<Header<'_>> {
    let mut h = Header::default();
    scan_into(raw, &mut h).map(|()| h)
}

/// [`scan`] into `h` (a [`Header::default`]); what it holds after `None` is meaningless.
fn scan_into<'a>(raw: &'a str, h: &mut Header<'a>) -> Option<()> {
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

/// Which of the `job_data` fields [`JobDataText`] holds a key names.
#[derive(Clone, Copy, PartialEq)]
enum Field {
    JobClass,
    JobId,
    Executions,
    Arguments,
    Other,
}

impl Field {
    fn of(key: &[u8]) -> Field {
        match key {
            b"job_class" => Field::JobClass,
            b"job_id" => Field::JobId,
            b"executions" => Field::Executions,
            b"arguments" => Field::Arguments,
            _ => Field::Other,
        }
    }

    /// The field of `RAILS_KEYS[at]`.
    fn rails(at: usize) -> Field {
        match at {
            0 => Field::JobClass,
            1 => Field::JobId,
            5 => Field::Arguments,
            6 => Field::Executions,
            _ => Field::Other,
        }
    }
}

/// The `job_data` keys in the order ActiveJob's `serialize` writes them (Rails 6.1 `core.rb`; Rails
/// 7.1+ adds `scheduled_at` last), each quoted with its colon as compact JSON writes it: the reader
/// compares the next key's bytes with the one expected instead of reading a string and matching it
/// against every name. Any other key, or the same ones in another order or spacing, is read as any key.
const RAILS_KEYS: [&[u8]; 12] = [
    b"\"job_class\":",
    b"\"job_id\":",
    b"\"provider_job_id\":",
    b"\"queue_name\":",
    b"\"priority\":",
    b"\"arguments\":",
    b"\"executions\":",
    b"\"exception_executions\":",
    b"\"locale\":",
    b"\"timezone\":",
    b"\"enqueued_at\":",
    b"\"scheduled_at\":",
];

/// The length of `RAILS_KEYS[next]` when `b` holds it at `i`, else 0. Each arm compares with a literal
/// of known length, which the compiler turns into a few word compares with constants (the generic
/// comparison of slices from the table calls `memcmp`): this runs for every key of every ActiveJob
/// job.
#[inline(always)]
fn rails_key_at(b: &[u8], i: usize, next: usize) -> usize {
    #[inline(always)]
    fn at<const N: usize>(b: &[u8], i: usize, lit: &[u8; N]) -> usize {
        match b.get(i..i + N) {
            Some(here) if here == lit => N,
            _ => 0,
        }
    }
    match next {
        0 => at(b, i, b"\"job_class\":"),
        1 => at(b, i, b"\"job_id\":"),
        2 => at(b, i, b"\"provider_job_id\":"),
        3 => at(b, i, b"\"queue_name\":"),
        4 => at(b, i, b"\"priority\":"),
        5 => at(b, i, b"\"arguments\":"),
        6 => at(b, i, b"\"executions\":"),
        7 => at(b, i, b"\"exception_executions\":"),
        8 => at(b, i, b"\"locale\":"),
        9 => at(b, i, b"\"timezone\":"),
        10 => at(b, i, b"\"enqueued_at\":"),
        11 => at(b, i, b"\"scheduled_at\":"),
        _ => 0,
    }
}

/// Where a value inside ActiveJob `arguments` sits: `depth` containers in the payload, `args` of them
/// inside `arguments`.
#[derive(Clone, Copy)]
struct Nest {
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

struct Reader<'a> {
    s: &'a str,
    b: &'a [u8],
    i: usize,
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
    fn digits(&mut self) -> usize {
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
fn key_names(value: &[u8]) -> Option<bool> {
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
fn string_body(b: &[u8], mut j: usize, escapes: bool) -> Option<(usize, bool)> {
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

/// Reads `raw` with [`scan`] and with serde_json: `Ok(found)` when they agree (`found`: [`scan`]
/// read it and found `job_data`), or when [`scan`] refused it; `Err` says how they differ. The tests
/// and the fuzz target (`crate::fuzzing`) hold [`scan`] to this.
#[cfg(any(test, fuzzing))]
pub(crate) fn both_ways(raw: &str) -> Result<bool, String> {
    let plain = Header::read_plain(raw);
    match (scan(raw), plain) {
        (None, _) => Ok(false),
        (Some(mut s), Ok(p)) => {
            let found = s.job_data.is_some();
            notes_hold(raw, &s)?;
            // What only the hand-written reader notes (serde_json's reading leaves each unknown),
            // checked above.
            s.job_data = None;
            s.plain = 0;
            s.activejob = false;
            s.named = p.named;
            if s == p {
                Ok(found)
            } else {
                Err(format!("scan {s:?} / serde {p:?}"))
            }
        }
        (Some(s), Err(e)) => Err(format!("scan {s:?} / serde error {e}")),
    }
}

/// What [`scan`] notes beyond the fields, held to serde_json's reading of `raw`: each `plain` bit
/// names a string field without a backslash; each `named` bit says exactly whether the payload has
/// that top-level key; the `job_data` fields are the texts of those keys of the one hash in `args`, and
/// their `plain` bits name strings without a backslash.
#[cfg(any(test, fuzzing))]
fn notes_hold(raw: &str, s: &Header<'_>) -> Result<(), String> {
    use std::collections::HashMap;
    let unescaped = |text: Option<&str>| {
        text.is_some_and(|t| t.len() >= 2 && t.starts_with('"') && !t.contains('\\'))
    };
    for (bit, text) in [
        (CLASS, s.class),
        (JID, s.jid),
        (QUEUE, s.queue),
        (WRAPPED, s.wrapped),
    ] {
        if s.plain & bit != 0 && !unescaped(text) {
            return Err(format!("plain bit {bit} on {text:?}"));
        }
    }
    let wrapper = s
        .class
        .and_then(|c| c.strip_prefix('"')?.strip_suffix('"'))
        .is_some_and(|c| super::ACTIVEJOB_WRAPPERS.contains(&c));
    if s.activejob != wrapper {
        return Err(format!(
            "activejob noted {}, class {:?}",
            s.activejob, s.class
        ));
    }
    // Keys borrowed (scan refused any with an escape) and values left as text, as `Plain` reads them.
    let top: HashMap<&str, &RawValue> = serde_json::from_str(raw).map_err(|e| e.to_string())?;
    for (bit, names) in [
        (UNIQUE_KEY, &[UNIQUE_KEY_FIELD][..]),
        (TIMEOUT, &[TIMEOUT_FIELD][..]),
        (GEM_LOCK, &GEM_LOCK_KEYS[..]),
    ] {
        let present = names.iter().any(|n| top.contains_key(n));
        if (s.named & bit != 0) != present {
            return Err(format!(
                "{names:?} noted {}, present {present}",
                s.named & bit != 0
            ));
        }
    }
    let Some(jd) = s.job_data else {
        return Ok(());
    };
    // The one hash of `args`, its fields as texts (no key of it has an escape when the reader noted
    // its fields; serde_json keeps the last of a duplicate key, the reader gives up on a duplicate of
    // the four, so the texts agree).
    let hashes: Vec<HashMap<&str, &RawValue>> =
        serde_json::from_str(s.args.ok_or("job_data without args")?).map_err(|e| e.to_string())?;
    let [hash] = hashes.as_slice() else {
        return Err(format!("job_data noted in {} hashes", hashes.len()));
    };
    let get = |k: &str| hash.get(k).map(|v| v.get());
    for (name, noted, bit) in [
        ("job_class", jd.job_class, Some(JOB_CLASS)),
        ("job_id", jd.job_id, Some(JOB_ID)),
        ("executions", jd.executions, None),
        ("arguments", jd.arguments, None),
    ] {
        if noted != get(name) {
            return Err(format!(
                "job_data {name}: noted {noted:?}, serde {:?}",
                get(name)
            ));
        }
        if let Some(bit) = bit
            && jd.plain & bit != 0
            && !unescaped(noted)
        {
            return Err(format!("job_data plain bit {bit} on {noted:?}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Every recorded payload (`fixtures/`, Sidekiq 6.4 to 8.1 and Rails 6.1).
    fn recorded() -> Vec<String> {
        crate::test_support::fixture_files("")
            .into_iter()
            .map(|(_, text)| text)
            .filter(|text| text.trim_start().starts_with('{'))
            .collect()
    }

    #[test]
    fn every_recorded_payload_is_read_by_scan_as_serde_reads_it() {
        let payloads = recorded();
        assert!(payloads.len() >= 20, "{} fixtures", payloads.len());
        for raw in &payloads {
            assert!(scan(raw).is_some(), "scan refused {raw}");
            both_ways(raw).unwrap();
        }
    }

    #[test]
    fn scan_refuses_what_it_does_not_read_exactly() {
        for raw in [
            r#"{"class":"A","class":"B","args":[]}"#,
            r#"{"class":null,"class":"B","args":[]}"#,
            r#"{"class":"A","args":null}"#,
            r#"{"cl\u0061ss":"A","args":[]}"#,
            r#"{"class":"A","args":[01]}"#,
            r#"{"class":"A","args":["\x"]}"#,
            r#"{"class":"A","args":[1,]}"#,
            r#"{"class":"A","args":[]} x"#,
            "{\"class\":\"A\",\"args\":[\"\u{1}\"]}",
        ] {
            assert!(scan(raw).is_none(), "{raw}");
        }
        let deep = format!(
            r#"{{"class":"A","args":{}{}}}"#,
            "[".repeat(MAX_DEPTH),
            "]".repeat(MAX_DEPTH)
        );
        assert!(scan(&deep).is_none());
        assert!(Header::read(&deep).is_ok());
    }

    /// Recorded payloads with bytes replaced, inserted or removed: whatever `scan` accepts, serde_json
    /// accepts too and reads the same.
    #[test]
    fn mutated_payloads_are_never_accepted_by_scan_alone() {
        let seed = rand::random::<u64>();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let payloads = recorded();
        let alphabet = b"{}[]\",:\\ \t\n0123456789.-+eEtrufalsn\x01\x1fuA";
        let mut accepted = 0;
        for _ in 0..20_000 {
            let mut b = payloads[rng.random_range(0..payloads.len())]
                .clone()
                .into_bytes();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..b.len());
                let c = alphabet[rng.random_range(0..alphabet.len())];
                match rng.random_range(0..3) {
                    0 => b[at] = c,
                    1 => b.insert(at, c),
                    _ => {
                        b.remove(at);
                    }
                }
            }
            let Ok(raw) = String::from_utf8(b) else {
                continue;
            };
            if let Err(e) = both_ways(&raw) {
                panic!("seed {seed}: {raw}: {e}");
            }
            accepted += usize::from(scan(&raw).is_some());
        }
        // Many mutations land inside strings and keep the payload valid.
        assert!(accepted > 1_000, "seed {seed}: {accepted}");
    }

    /// The word-at-a-time digit run stops exactly where a byte-by-byte one does: every byte value
    /// after 0 to 19 digits (so at every place of a word and past one), and random runs of bytes.
    #[test]
    fn digit_runs_end_where_the_byte_loop_ends() {
        let by_bytes = |b: &[u8]| b.iter().take_while(|c| c.is_ascii_digit()).count();
        let check = |b: &[u8], from: usize| {
            let mut r = Reader { s: "", b, i: from };
            let n = r.digits();
            let expected = by_bytes(b.get(from..).unwrap_or_default());
            assert_eq!((n, r.i), (expected, from + expected), "{b:?} from {from}");
        };
        for run in 0..20 {
            for stop in 0..=255u8 {
                for tail in [&b""[..], b"5", b"0123456789"] {
                    let mut b: Vec<u8> = (0..run).map(|k| b'0' + (k % 10) as u8).collect();
                    b.push(stop);
                    b.extend_from_slice(tail);
                    check(&b, 0);
                    check(&b, run.min(3));
                }
            }
        }
        let seed = rand::random::<u64>();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let alphabet = b"0123456789/:.eE-+\x00\x7f\x80\xb9\xba\xff ";
        for _ in 0..50_000 {
            let len = rng.random_range(0..24);
            let b: Vec<u8> = (0..len)
                .map(|_| {
                    if rng.random_bool(0.8) {
                        b'0' + rng.random_range(0..10)
                    } else {
                        alphabet[rng.random_range(0..alphabet.len())]
                    }
                })
                .collect();
            let from = rng.random_range(0..=len);
            let r = std::panic::catch_unwind(|| check(&b, from));
            assert!(r.is_ok(), "seed {seed}");
        }
    }

    /// The literals `wrapper_at` compares are the wrappers' names, quoted; a name cut short, run on or
    /// escaped is not one.
    #[test]
    fn wrapper_literals_are_the_wrappers() {
        for name in super::super::ACTIVEJOB_WRAPPERS {
            let quoted = format!("\"{name}\"");
            assert_eq!(wrapper_at(quoted.as_bytes(), 0), quoted.len(), "{name}");
            let padded = format!("xx{quoted},");
            assert_eq!(wrapper_at(padded.as_bytes(), 2), quoted.len(), "{name}");
            assert_eq!(wrapper_at(&quoted.as_bytes()[..quoted.len() - 1], 0), 0);
            let longer = format!("\"{name}X\"");
            assert_eq!(wrapper_at(longer.as_bytes(), 0), 0);
            let escaped = quoted.replacen('A', "\\u0041", 1);
            assert_eq!(wrapper_at(escaped.as_bytes(), 0), 0);
        }
        assert_eq!(wrapper_at(b"\"NoopJob\"", 0), 0);
    }

    /// The literals `rails_key_at` compares are the table's, each at its own place.
    #[test]
    fn rails_keys_are_compared_in_their_order() {
        for (at, lit) in RAILS_KEYS.iter().enumerate() {
            for next in 0..=RAILS_KEYS.len() {
                let want = if next == at { lit.len() } else { 0 };
                assert_eq!(rails_key_at(lit, 0, next), want, "key {at} at {next}");
            }
            // Cut short, or one byte off: no match.
            assert_eq!(rails_key_at(&lit[..lit.len() - 1], 0, at), 0);
            let mut off = lit.to_vec();
            off[lit.len() / 2] ^= 1;
            assert_eq!(rails_key_at(&off, 0, at), 0);
        }
    }
}

#[cfg(test)]
mod tests_unique_key {
    use crate::job::Job;

    /// The literals [`super::named_bit`] matches are the names the runtime reads.
    #[test]
    fn named_keys_are_the_runtime_s_names() {
        use super::{GEM_LOCK, GEM_LOCK_KEYS, TIMEOUT, UNIQUE_KEY, named_bit};
        assert_eq!(
            named_bit(crate::job::UNIQUE_KEY_FIELD.as_bytes()),
            UNIQUE_KEY
        );
        assert_eq!(named_bit(crate::job::TIMEOUT_FIELD.as_bytes()), TIMEOUT);
        assert!(GEM_LOCK_KEYS.contains(&crate::unique_jobs::LOCK_DIGEST_FIELD));
        for key in GEM_LOCK_KEYS {
            assert_eq!(named_bit(key.as_bytes()), GEM_LOCK, "{key}");
        }
        assert_eq!(named_bit(b"locks"), 0);
        assert_eq!(named_bit(b"unique_ke"), 0);
    }

    /// A payload names a timeout or the gem's lock fields only at its top level: the same names in
    /// the arguments (an ActiveJob `job_data`'s keys are arguments too) are not the runtime's, and
    /// an escaped spelling is read by serde_json and keeps each test on.
    #[test]
    fn top_level_names_are_noted_where_they_are() {
        let job = |raw: &str| match Job::parse(raw.as_bytes().to_vec(), 1 << 20) {
            Ok(job) => (job.may_name_timeout(), job.may_name_gem_lock()),
            Err((_, e)) => panic!("{raw}: {e}"),
        };
        let cases = [
            (
                r#"{"class":"X","args":[],"oxidekiq_timeout":2}"#,
                (true, false),
            ),
            (
                r#"{"class":"X","args":[],"lock":"until_executed"}"#,
                (false, true),
            ),
            (
                r#"{"class":"X","args":[],"lock_digest":"uniquejobs:d"}"#,
                (false, true),
            ),
            (
                r#"{"class":"X","args":[{"oxidekiq_timeout":2,"lock":"x","lock_digest":"d"}]}"#,
                (false, false),
            ),
            (
                r#"{"class":"ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper","wrapped":"J","args":[{"job_class":"J","job_id":"i","arguments":[{"lock":1}],"executions":0,"oxidekiq_timeout":1}]}"#,
                (false, false),
            ),
            (
                r#"{"class":"X","args":[],"oxidekiq\u005ftimeout":2}"#,
                (true, true),
            ),
            (
                r#"{"class":"X","args":[],"\u006cock":"until_executed"}"#,
                (true, true),
            ),
        ];
        for (raw, want) in cases {
            assert_eq!(job(raw), want, "{raw}");
        }
    }

    fn names_unique_key(raw: &str) -> bool {
        match Job::parse(raw.as_bytes().to_vec(), 1 << 20) {
            Ok(job) => job.may_name_unique_key(),
            Err((_, e)) => panic!("{raw}: {e}"),
        }
    }

    /// The lock test may only be skipped when the payload surely has no top-level `unique_key`; an
    /// escaped spelling of the key (read by serde_json, not the hand-written reader) keeps it on
    /// (review R1: `unique\u005fkey` used to skip its lock).
    #[test]
    fn a_unique_key_spelled_any_way_keeps_the_lock_test_on() {
        let plain = r#"{"class":"X","args":[],"jid":"j1","unique_key":"k","unique_ttl":60}"#;
        let escaped = r#"{"class":"X","args":[],"jid":"j1","unique\u005fkey":"k","unique_ttl":60}"#;
        let first = r#"{"class":"X","args":[],"jid":"j1","\u0075nique_key":"k","unique_ttl":60}"#;
        let none = r#"{"class":"X","args":["unique"],"jid":"j1"}"#;
        assert!(names_unique_key(plain));
        assert!(names_unique_key(escaped));
        assert!(names_unique_key(first));
        assert!(!names_unique_key(none));
    }
}
