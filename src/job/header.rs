//! Reading a payload's dispatch fields in one pass, and, for an ActiveJob wrapper, the four `job_data`
//! fields its unwrapping needs ([`crate::activejob`]) in that same pass: without this the `job_data`
//! hash, most of an ActiveJob payload's bytes, was walked twice (once here, once to unwrap it).
//!
//! Two modes read the same grammar. The plain one takes `args` as a [`RawValue`] (what a derived
//! struct of `Option<&RawValue>` fields did before). The ActiveJob one, used only once `class` was
//! read as an ActiveJob wrapper, reads `args` as `[{key: value, ...}, ...]`, keeping the raw text of
//! the four `job_data` fields it needs and skipping the rest, and finds the array's bounds from the
//! first key of its hash and from the payload's next key (or its closing brace): only whitespace and
//! one comma can sit between those and the brackets. Whatever that mode does not expect (`args` not
//! an array of hashes, an empty hash, a key or string with an escape) is an error in it, and
//! [`Header::read`] then reads the payload again in the plain mode, whose answer (and error) is the one
//! returned: the plain mode is the reference, the other a shortcut for what Rails writes.

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// The dispatch fields, each the raw JSON text of its value (a slice of the payload).
#[derive(Default)]
pub(super) struct Header<'a> {
    pub(super) class: Option<&'a RawValue>,
    pub(super) jid: Option<&'a RawValue>,
    pub(super) queue: Option<&'a RawValue>,
    pub(super) wrapped: Option<&'a RawValue>,
    /// The `args` array's text.
    pub(super) args: Option<&'a str>,
    pub(super) retry: Option<&'a RawValue>,
    /// For an ActiveJob wrapper whose `class` came before `args` (as every Sidekiq client writes it):
    /// what its `job_data` holds.
    pub(super) job_data: Option<JobDataText<'a>>,
    /// An ActiveJob wrapper's `args` that is the payload's last field: where it starts.
    open_args: Option<usize>,
}

/// The raw JSON text of the `job_data` fields [`crate::activejob`] reads; `None` when absent.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct JobDataText<'a> {
    pub(crate) job_class: Option<&'a str>,
    pub(crate) job_id: Option<&'a str>,
    pub(crate) executions: Option<&'a str>,
    pub(crate) arguments: Option<&'a str>,
}

impl<'a> Header<'a> {
    /// Reads the header of `raw`, a JSON text starting with `{`: serde_json's answer for a struct of
    /// optional fields (duplicate fields and trailing characters are errors, unknown keys ignored).
    pub(super) fn read(raw: &'a str) -> Result<Header<'a>, serde_json::Error> {
        Self::read_in(raw, true).or_else(|_| Self::read_in(raw, false))
    }

    fn read_in(raw: &'a str, activejob: bool) -> Result<Header<'a>, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(raw);
        let mut header = de.deserialize_map(HeaderVisitor { raw, activejob })?;
        de.end()?;
        if let Some(start) = header.open_args.take() {
            // The last field: `] }` and whitespace end the payload.
            let b = raw.as_bytes();
            let brace = (0..b.len()).rev().find(|&i| !is_ws(b[i]));
            let close = brace.and_then(|i| (b[i] == b'}').then_some(i));
            let close = close.and_then(|i| before_ws(b, i, b']'));
            let Some(close) = close else {
                return Err(de::Error::custom("args bounds not found"));
            };
            header.args = raw.get(start..close + 1);
        }
        Ok(header)
    }
}

/// A header key, and where it starts in the payload when it holds no escape.
struct KeyAt<'a> {
    key: Key,
    at: Option<&'a str>,
}

/// A header key: one of the six fields, or any other.
enum Key {
    Class,
    Jid,
    Queue,
    Wrapped,
    Args,
    Retry,
    Other,
}

impl Key {
    #[inline]
    fn of(name: &str) -> Key {
        match name {
            "class" => Key::Class,
            "jid" => Key::Jid,
            "queue" => Key::Queue,
            "wrapped" => Key::Wrapped,
            "args" => Key::Args,
            "retry" => Key::Retry,
            _ => Key::Other,
        }
    }
}

impl<'de> de::Deserialize<'de> for KeyAt<'de> {
    #[inline]
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyAt<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("field identifier")
            }
            #[inline]
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<KeyAt<'de>, E> {
                Ok(KeyAt {
                    key: Key::of(v),
                    at: Some(v),
                })
            }
            #[inline]
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyAt<'de>, E> {
                Ok(KeyAt {
                    key: Key::of(v),
                    at: None,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

struct HeaderVisitor<'a> {
    raw: &'a str,
    activejob: bool,
}

impl<'a> Visitor<'a> for HeaderVisitor<'a> {
    type Value = Header<'a>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("struct Header")
    }

    fn visit_map<M: MapAccess<'a>>(self, mut map: M) -> Result<Header<'a>, M::Error> {
        let mut h = Header::default();
        // Each field once, as a derived struct has it; `null` reads as absent (`Option`).
        #[inline]
        fn once<'a, M: MapAccess<'a>>(
            slot: &mut Option<&'a RawValue>,
            name: &'static str,
            map: &mut M,
        ) -> Result<(), M::Error> {
            if slot.is_some() {
                return Err(de::Error::duplicate_field(name));
            }
            *slot = map.next_value::<Option<&'a RawValue>>()?;
            Ok(())
        }
        let mut args_seen = false;
        // Where an ActiveJob wrapper's `args` starts, until its end is found: just before the next
        // key (`] , "key"`), or before the payload's closing brace ([`Header::read_in`]).
        let mut open: Option<usize> = None;
        while let Some(KeyAt { key, at }) = map.next_key::<KeyAt<'a>>()? {
            if let Some(start) = open.take() {
                let b = self.raw.as_bytes();
                let close = at
                    .map(|k| offset(self.raw, k).saturating_sub(1))
                    .and_then(|q| before_ws(b, q, b','))
                    .and_then(|c| before_ws(b, c, b']'));
                let Some(close) = close else {
                    return Err(de::Error::custom("args bounds not found"));
                };
                h.args = self.raw.get(start..close + 1);
            }
            match key {
                Key::Class => once(&mut h.class, "class", &mut map)?,
                Key::Jid => once(&mut h.jid, "jid", &mut map)?,
                Key::Queue => once(&mut h.queue, "queue", &mut map)?,
                Key::Wrapped => once(&mut h.wrapped, "wrapped", &mut map)?,
                Key::Retry => once(&mut h.retry, "retry", &mut map)?,
                Key::Args => {
                    if args_seen {
                        return Err(de::Error::duplicate_field("args"));
                    }
                    args_seen = true;
                    // Compared as written: a class spelled with escapes takes the plain mode.
                    let class = h
                        .class
                        .and_then(|c| c.get().strip_prefix('"').and_then(|s| s.strip_suffix('"')));
                    let wrapper = class.is_some_and(|c| super::ACTIVEJOB_WRAPPERS.contains(&c));
                    if self.activejob && wrapper {
                        let (start, job_data) =
                            map.next_value_seed(WrapperArgs { raw: self.raw })?;
                        open = Some(start);
                        h.job_data = job_data;
                    } else {
                        h.args = map.next_value::<Option<&'a RawValue>>()?.map(RawValue::get);
                    }
                }
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        h.open_args = open;
        Ok(h)
    }
}

/// An ActiveJob wrapper's `args`: `[job_data, ...]`, the first element a hash with at least one key.
/// Gives where the array starts and, when it holds exactly one hash with no field twice, that hash's
/// fields.
struct WrapperArgs<'a> {
    raw: &'a str,
}

impl<'a> DeserializeSeed<'a> for WrapperArgs<'a> {
    type Value = (usize, Option<JobDataText<'a>>);

    fn deserialize<D: Deserializer<'a>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'a> Visitor<'a> for WrapperArgs<'a> {
    type Value = (usize, Option<JobDataText<'a>>);

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array of job_data hashes")
    }

    fn visit_seq<S: SeqAccess<'a>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
        let b = self.raw.as_bytes();
        let Some(first) = seq.next_element_seed(JobDataFields { raw: self.raw })? else {
            return Err(de::Error::custom("no job_data"));
        };
        // `[ { "` before the first key.
        let open = first
            .first_key
            .map(|k| offset(self.raw, k).saturating_sub(1))
            .and_then(|q| before_ws(b, q, b'{'))
            .and_then(|o| before_ws(b, o, b'['));
        let Some(open) = open else {
            return Err(de::Error::custom("args bounds not found"));
        };
        let mut single = !first.twice;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            single = false;
        }
        Ok((open, single.then_some(first.fields)))
    }
}

/// One `job_data` hash: the four fields' text, and where its first key is.
struct JobDataFields<'a> {
    raw: &'a str,
}

struct JobDataFound<'a> {
    fields: JobDataText<'a>,
    first_key: Option<&'a str>,
    /// One of the four fields was given twice (the full decoder decides what that means).
    twice: bool,
}

impl<'a> DeserializeSeed<'a> for JobDataFields<'a> {
    type Value = JobDataFound<'a>;

    fn deserialize<D: Deserializer<'a>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'a> Visitor<'a> for JobDataFields<'a> {
    type Value = JobDataFound<'a>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a job_data hash")
    }

    fn visit_map<M: MapAccess<'a>>(self, mut map: M) -> Result<Self::Value, M::Error> {
        let mut found = JobDataFound {
            fields: JobDataText::default(),
            first_key: None,
            twice: false,
        };
        // `&str` keys and strings borrow from the payload: one with an escape is an error here, and
        // the plain mode reads the payload then.
        while let Some(key) = map.next_key::<&'a str>()? {
            found.first_key.get_or_insert(key);
            let (slot, value) = match key {
                // The two strings with their quotes, as the raw text the others are.
                "job_class" | "job_id" => {
                    let s = map.next_value::<&'a str>()?;
                    let at = offset(self.raw, s);
                    let quoted = self.raw.get(at.wrapping_sub(1)..at + s.len() + 1);
                    let slot = if key == "job_class" {
                        &mut found.fields.job_class
                    } else {
                        &mut found.fields.job_id
                    };
                    (slot, quoted)
                }
                "executions" => (
                    &mut found.fields.executions,
                    Some(map.next_value::<&'a RawValue>()?.get()),
                ),
                "arguments" => (
                    &mut found.fields.arguments,
                    Some(map.next_value::<&'a RawValue>()?.get()),
                ),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            let Some(value) = value else {
                return Err(de::Error::custom("job_data string bounds not found"));
            };
            found.twice |= slot.replace(value).is_some();
        }
        Ok(found)
    }
}

/// Where `s`, a slice of `raw`, starts in it.
fn offset(raw: &str, s: &str) -> usize {
    s.as_ptr() as usize - raw.as_ptr() as usize
}

fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// The index of `want` just before `i`, past whitespace.
fn before_ws(b: &[u8], mut i: usize, want: u8) -> Option<usize> {
    while i > 0 {
        i -= 1;
        match b[i] {
            c if is_ws(c) => {}
            c if c == want => return Some(i),
            _ => return None,
        }
    }
    None
}

/// Reads `raw` in both modes and says how they differ (`Ok` when they agree: same error-ness, and the
/// same text for every field). The ActiveJob mode failing where the plain one succeeds is agreement:
/// [`Header::read`] falls back to the plain mode then.
#[cfg(test)]
pub(crate) fn modes_agree(raw: &str) -> Result<bool, String> {
    let text = |h: &Header<'_>| {
        let f = |v: Option<&RawValue>| v.map(|v| v.get().to_string());
        (
            f(h.class),
            f(h.jid),
            f(h.queue),
            f(h.wrapped),
            f(h.retry),
            h.args.map(str::to_string),
        )
    };
    match (Header::read_in(raw, true), Header::read_in(raw, false)) {
        (Ok(a), Ok(p)) if text(&a) == text(&p) => Ok(a.job_data.is_some()),
        (Ok(a), Ok(p)) => Err(format!("{:?} / {:?}", text(&a), text(&p))),
        (Ok(a), Err(e)) => Err(format!("{:?} / plain error {e}", text(&a))),
        (Err(_), _) => Ok(false),
    }
}
