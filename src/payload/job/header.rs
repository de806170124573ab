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

mod fields;
#[cfg(any(test, fuzzing))]
mod oracle;
mod reader;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_unique_key;

#[cfg(any(test, fuzzing))]
pub(crate) use oracle::both_ways;
pub(crate) use reader::job_data;
#[cfg(test)]
pub(crate) use reader::markers;
use reader::scan_into;

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
