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
}

/// The raw JSON text of the `job_data` fields [`crate::activejob`] reads; `None` when absent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct JobDataText<'a> {
    pub(crate) job_class: Option<&'a str>,
    pub(crate) job_id: Option<&'a str>,
    pub(crate) executions: Option<&'a str>,
    pub(crate) arguments: Option<&'a str>,
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
    pub(super) fn read(raw: &'a str) -> Result<Header<'a>, serde_json::Error> {
        match scan(raw) {
            Some(header) => Ok(header),
            None => Self::read_plain(raw),
        }
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
        })
    }
}

/// Nesting [`scan`] reads (serde_json's own limit is 128); deeper payloads go to serde_json.
const MAX_DEPTH: usize = 64;

/// The hand-written reader: `None` for anything it does not read exactly as serde_json would.
fn scan(raw: &str) -> Option<Header<'_>> {
    let mut r = Reader::new(raw);
    let mut h = Header::default();
    r.ws();
    r.eat(b'{')?;
    r.ws();
    let mut more = r.eat(b'}').is_none();
    while more {
        let key = r.key()?;
        r.colon()?;
        let start = r.i;
        let slot = match key {
            b"class" => &mut h.class,
            b"jid" => &mut h.jid,
            b"queue" => &mut h.queue,
            b"wrapped" => &mut h.wrapped,
            b"retry" => &mut h.retry,
            b"args" => {
                let wrapper = h.class.and_then(|c| c.strip_prefix('"')?.strip_suffix('"'));
                if wrapper.is_some_and(|c| super::ACTIVEJOB_WRAPPERS.contains(&c)) {
                    h.job_data = r.wrapper_args()?;
                } else {
                    r.value(1)?;
                }
                &mut h.args
            }
            _ => {
                r.value(1)?;
                more = r.more(b'}')?;
                continue;
            }
        };
        if key != b"args" {
            r.value(1)?;
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
    (r.i == r.b.len()).then_some(h)
}

/// The four `job_data` fields of an ActiveJob wrapper's `args` text (`[job_data]`), read and checked
/// as [`scan`] reads them in a payload: `None` when it is not exactly one hash naming each field at
/// most once, or not JSON [`scan`] reads.
pub(crate) fn job_data(args: &str) -> Option<JobDataText<'_>> {
    let mut r = Reader::new(args);
    r.ws();
    let fields = r.wrapper_args()?;
    r.ws();
    if r.i == r.b.len() { fields } else { None }
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

    #[inline]
    fn ws(&mut self) {
        while matches!(self.b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    #[inline]
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.b.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    /// `:` between a key and its value, with the whitespace around it.
    #[inline]
    fn colon(&mut self) -> Option<()> {
        self.ws();
        self.eat(b':')?;
        self.ws();
        Some(())
    }

    /// After a member of a container that `close` ends: `Some(true)` past a comma (another member
    /// follows), `Some(false)` past `close`.
    #[inline]
    fn more(&mut self, close: u8) -> Option<bool> {
        self.ws();
        if self.eat(b',').is_some() {
            self.ws();
            return Some(true);
        }
        self.eat(close)?;
        Some(false)
    }

    /// A key with no escape: its bytes, without the quotes.
    fn key(&mut self) -> Option<&'a [u8]> {
        let start = self.i + 1;
        self.string(false)?;
        self.b.get(start..self.i - 1)
    }

    /// A string ([`string_at`]): `true` when it held an escape.
    #[inline]
    fn string(&mut self, escapes: bool) -> Option<bool> {
        string_at(self.b, &mut self.i, escapes)
    }

    /// Past an opening bracket: `Some(true)` when a member follows, `Some(false)` past `close`.
    #[inline]
    fn first(&mut self, close: u8) -> Option<bool> {
        self.i += 1;
        self.ws();
        Some(self.eat(close).is_none())
    }

    /// Any JSON value, checked; `depth`: the containers it sits in.
    fn value(&mut self, depth: usize) -> Option<()> {
        let c = *self.b.get(self.i)?;
        match c {
            b'"' => self.string(true).map(drop),
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

    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        self.i - start
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Option<()> {
        self.eat(b'-');
        match *self.b.get(self.i)? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.eat(b'.').is_some() && self.digits() == 0 {
            return None;
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.b.get(self.i), Some(b'+' | b'-')) {
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
    fn wrapper_args(&mut self) -> Option<Option<JobDataText<'a>>> {
        if self.b.get(self.i) != Some(&b'[') {
            self.value(1)?;
            return Some(None);
        }
        let mut more = self.first(b']')?;
        let mut fields = None;
        if more && self.b.get(self.i) == Some(&b'{') {
            let mut found = JobDataText::default();
            let mut twice = false;
            let mut more_keys = self.first(b'}')?;
            while more_keys {
                let key_start = self.i + 1;
                let escaped = self.string(true)?;
                let key = self.b.get(key_start..self.i - 1)?;
                self.colon()?;
                let start = self.i;
                self.value(3)?;
                let slot = match key {
                    b"job_class" => &mut found.job_class,
                    b"job_id" => &mut found.job_id,
                    b"executions" => &mut found.executions,
                    b"arguments" => &mut found.arguments,
                    _ => &mut None,
                };
                // An escaped key could spell one of the four: the unwrapping reads the text then.
                twice |= escaped || slot.replace(self.s.get(start..self.i)?).is_some();
                more_keys = self.more(b'}')?;
            }
            more = self.more(b']')?;
            // Exactly one job_data hash.
            fields = (!more && !twice).then_some(found);
        }
        while more {
            self.value(2)?;
            more = self.more(b']')?;
        }
        Some(fields)
    }
}

/// The string that opens at `b[*i] == '"'`, checked as serde_json checks one it skips: no control
/// character, and only the escapes JSON has (`\u` with four hex digits; its value is not checked, as
/// serde_json's skipping does not). `escapes: false` refuses any escape. Leaves `*i` just past it;
/// `true` when it held an escape.
pub(crate) fn string_at(b: &[u8], i: &mut usize, escapes: bool) -> Option<bool> {
    const ONES: u64 = u64::MAX / 255;
    const HIGHS: u64 = ONES << 7;
    if b.get(*i) != Some(&b'"') {
        return None;
    }
    *i += 1;
    let mut escaped = false;
    loop {
        // Eight bytes at a time up to a quote, a backslash or a control character (serde_json's
        // `skip_to_escape` trick: the lowest flagged byte is the first match).
        while let Some(chunk) = b.get(*i..*i + 8) {
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
                *i += found.trailing_zeros() as usize / 8;
                break;
            }
            *i += 8;
        }
        let c = *b.get(*i)?;
        escaped |= c == b'\\';
        match c {
            b'"' => {
                *i += 1;
                return Some(escaped);
            }
            b'\\' if escapes => match *b.get(*i + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => *i += 2,
                b'u' => {
                    let hex = b.get(*i + 2..*i + 6)?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return None;
                    }
                    *i += 6;
                }
                _ => return None,
            },
            c if c < 0x20 || c == b'\\' => return None,
            _ => *i += 1,
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
            s.job_data = None;
            if s == p {
                Ok(found)
            } else {
                Err(format!("scan {s:?} / serde {p:?}"))
            }
        }
        (Some(s), Err(e)) => Err(format!("scan {s:?} / serde error {e}")),
    }
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
}
