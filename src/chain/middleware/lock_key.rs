//! How a lock or a limit is named for one job: the worker's class, its class plus a digest of its
//! arguments, a fixed name, or a name computed from the job's typed arguments or its whole context.
//!
//! [`LockKey`] is the one way every lock ([`UniqueJob`](super::unique::UniqueJob),
//! [`SequentialJob`](super::sequential::SequentialJob)) and every limit
//! ([`ConcurrencyLimit`](super::concurrency::ConcurrencyLimit), [`RateLimit`](super::rate_limit::RateLimit))
//! names itself; the client's until-executed locks digest the arguments the same way. The name built
//! here is the `<key>` of `oxidekiq:lock:<key>` (`keys::lock`) or of a limit's key.
//! A key computed from the typed arguments is most easily given at registration, where the worker's
//! `Args` type is known and the closure needs no annotation:
//! [`Registration::with_key`](crate::registry::Registration::with_key).
//!
//! # Argument digests
//!
//! [`LockKey::ByArgs`] hashes a canonical JSON form of the arguments ([`canonical_json`]): object keys
//! sorted at every depth, no whitespace, numbers exactly as written (`1` and `1.0` differ, as they do
//! in Ruby). So `{"a":1,"b":2}` and `{"b":2,"a":1}` give one key, whichever order a Ruby hash had.
//! For ActiveJob jobs the digest covers the decoded `arguments`, not the wrapper (whose `job_id` differs
//! for every enqueue).
//!
//! ```
//! use oxidekiq::middleware::lock_key::{args_digest, canonical_json};
//! use serde_json::json;
//!
//! assert_eq!(canonical_json(&json!([{"b": 2, "a": 1}])), r#"[{"a":1,"b":2}]"#);
//! assert_eq!(args_digest(&json!([{"a": 1, "b": 2}])), args_digest(&json!([{"b": 2, "a": 1}])));
//! ```

use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;
use sha1::{Digest, Sha1};

use crate::error::JobError;
use crate::keys;
use crate::worker::JobContext;

/// Computes a name from the job; an `Err` fails the job (arguments that do not fit the closure's type).
pub type KeyFn = dyn Fn(&JobContext) -> Result<String, JobError> + Send + Sync;

/// How a lock or limit is named for one job ([`Keyed::key`]).
///
/// ```
/// use oxidekiq::{Keyed, LockKey, Registry, UniqueJob};
/// # use oxidekiq::{JobContext, JobResult, Worker};
/// # #[derive(Debug)]
/// # struct SyncJob;
/// # impl Worker for SyncJob {
/// #     const CLASS: &'static str = "SyncJob";
/// #     type Args = (u64, String);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
///
/// let mut registry = Registry::new();
/// // Named from the job's context: one lock per queue.
/// registry
///     .register(SyncJob)
///     .with(UniqueJob::new().key(LockKey::by_context(|ctx| format!("sync-{}", ctx.queue()))));
/// ```
#[derive(Clone, Default)]
pub enum LockKey {
    /// The worker's class name: one lock (or limit) for every job of the class. The default.
    #[default]
    Class,
    /// `<class>:<sha1 of the canonical JSON of the args>`: one per distinct argument list.
    ByArgs,
    /// One name for every job, whatever its class (`"payment-api"`): jobs of several classes share it.
    Fixed(String),
    /// A name computed from each job ([`LockKey::by_args`], [`LockKey::by_context`]), used as is, so jobs
    /// of different classes can share a lock on purpose.
    Computed(Arc<KeyFn>),
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockKey::Class => f.write_str("Class"),
            LockKey::ByArgs => f.write_str("ByArgs"),
            LockKey::Fixed(name) => f.debug_tuple("Fixed").field(name).finish(),
            LockKey::Computed(_) => f.write_str("Computed(<fn>)"),
        }
    }
}

impl From<&str> for LockKey {
    fn from(name: &str) -> Self {
        LockKey::Fixed(name.to_string())
    }
}

impl From<String> for LockKey {
    fn from(name: String) -> Self {
        LockKey::Fixed(name)
    }
}

impl LockKey {
    /// A name computed from the job's typed arguments, e.g. `format!("stripe-{customer}")`. Arguments
    /// that do not fit `A` fail the job with `ArgumentError`, as the worker's own decoding would.
    pub fn by_args<A, F>(f: F) -> Self
    where
        A: DeserializeOwned + 'static,
        F: Fn(&A) -> String + Send + Sync + 'static,
    {
        LockKey::Computed(Arc::new(move |ctx: &JobContext| {
            let args: A = ctx.args().map_err(|e| {
                JobError::new(
                    "ArgumentError",
                    format!(
                        "cannot name the lock of {}: arguments do not fit {}: {}",
                        ctx.class(),
                        std::any::type_name::<A>(),
                        crate::redact::redact_values(&e.to_string())
                    ),
                )
            })?;
            Ok(f(&args))
        }))
    }

    /// A name computed from the whole job context (queue, class, payload).
    pub fn by_context<F>(f: F) -> Self
    where
        F: Fn(&JobContext) -> String + Send + Sync + 'static,
    {
        LockKey::Computed(Arc::new(move |ctx: &JobContext| Ok(f(ctx))))
    }

    /// The Redis key of this job's lock, `oxidekiq:lock:<name>` (`keys::lock` of [`LockKey::resolve`]),
    /// built in one allocation for a class or argument name: the lock middleware ask for it for every
    /// job.
    pub(crate) fn lock_key(&self, ctx: &JobContext) -> Result<String, JobError> {
        match self {
            LockKey::Class => Ok(keys::lock(ctx.class())),
            LockKey::ByArgs => {
                let mut key =
                    String::with_capacity(keys::LOCK_PREFIX.len() + ctx.class().len() + 1 + 40);
                key.push_str(keys::LOCK_PREFIX);
                push_args_name(ctx, &mut key)?;
                Ok(key)
            }
            LockKey::Fixed(_) | LockKey::Computed(_) => Ok(keys::lock(&self.resolve(ctx)?)),
        }
    }

    /// This job's name (without any prefix). `Err` when the arguments do not decode: a limit fails the
    /// job with it; a lock runs the worker unlocked, which fails at once with its own `ArgumentError`.
    pub fn resolve(&self, ctx: &JobContext) -> Result<String, JobError> {
        match self {
            LockKey::Class => Ok(ctx.class().to_string()),
            LockKey::ByArgs => {
                let mut name = String::with_capacity(ctx.class().len() + 1 + 40);
                push_args_name(ctx, &mut name)?;
                Ok(name)
            }
            LockKey::Fixed(name) => Ok(name.clone()),
            LockKey::Computed(f) => f(ctx),
        }
    }
}

/// A lock or limit named by a [`LockKey`]: [`UniqueJob`](super::unique::UniqueJob),
/// [`SequentialJob`](super::sequential::SequentialJob),
/// [`ConcurrencyLimit`](super::concurrency::ConcurrencyLimit) and
/// [`RateLimit`](super::rate_limit::RateLimit) share these builder methods, and
/// [`Registration::with_key`](crate::registry::Registration::with_key) names them from the worker's typed
/// arguments.
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{ConcurrencyLimit, Keyed, Registry, SequentialJob, UniqueJob};
/// # use oxidekiq::{JobContext, JobResult, Worker};
/// # #[derive(Debug)]
/// # struct SyncJob;
/// # impl Worker for SyncJob {
/// #     const CLASS: &'static str = "SyncJob";
/// #     type Args = (u64,);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
/// # #[derive(Debug)]
/// # struct ImportJob;
/// # impl Worker for ImportJob {
/// #     const CLASS: &'static str = "ImportJob";
/// #     type Args = (u64,);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
/// # #[derive(Debug)]
/// # struct ExportJob;
/// # impl Worker for ExportJob {
/// #     const CLASS: &'static str = "ExportJob";
/// #     type Args = (u64,);
/// #     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// # }
///
/// let mut registry = Registry::new();
/// registry.register(SyncJob).with(UniqueJob::new().key_by_args()); // one per argument list
/// registry.register(ImportJob).with(SequentialJob::new().key("warehouse")); // a fixed, shared name
/// registry.register(ExportJob).with(ConcurrencyLimit::new(1).key("warehouse").wait(Duration::ZERO));
/// ```
pub trait Keyed: Sized {
    /// The same lock or limit, named by `key`.
    fn keyed(self, key: LockKey) -> Self;

    /// Named by `key`; a `&str` or `String` is a fixed name (`.key("payment-api")`).
    fn key(self, key: impl Into<LockKey>) -> Self {
        self.keyed(key.into())
    }

    /// One per distinct argument list: `<class>:<sha1 of the canonical args>`.
    fn key_by_args(self) -> Self {
        self.keyed(LockKey::ByArgs)
    }
}

/// Appends `<class>:<digest>`, the name of [`LockKey::ByArgs`], to `out`.
///
/// Plain arguments (`[42]`, `["a",1.5,null]`) are usually already in canonical form as the payload
/// carries them ([`is_canonical`]): their text is digested as it is, without parsing it into a
/// `Value` and writing it back (which would give the same text).
fn push_args_name(ctx: &JobContext, out: &mut String) -> Result<(), JobError> {
    out.push_str(ctx.class());
    out.push(':');
    let raw = ctx.args_json();
    match ctx.activejob() {
        Some(aj) => push_digest(out, &canonical_json(aj.arguments())),
        None if is_canonical(raw) => push_digest(out, raw),
        None => {
            let parsed: Value = serde_json::from_str(raw).map_err(|e| {
                JobError::new("ArgumentError", format!("cannot digest the arguments: {e}"))
            })?;
            push_digest(out, &canonical_json(&parsed));
        }
    }
    Ok(())
}

/// Appends the SHA1 of `canonical`, in lowercase hex, to `out`.
fn push_digest(out: &mut String, canonical: &str) {
    crate::lock::push_hex(out, &Sha1::digest(canonical.as_bytes()));
}

/// Arrays [`is_canonical`] reads; deeper texts go through serde_json (whose own limit is 128).
const MAX_PLAIN_DEPTH: usize = 64;

/// True when `text` is valid JSON that [`canonical_json`] writes back unchanged: no whitespace, no
/// object (its keys would need sorting), strings without any escape, numbers without an exponent
/// (whose spelling is normalized), arrays nested at most [`MAX_PLAIN_DEPTH`] deep. Anything else,
/// valid or not, is false and left to serde_json.
fn is_canonical(text: &str) -> bool {
    let b = text.as_bytes();
    let mut i = 0;
    let mut depth = 0;
    loop {
        // A value starts at `i`.
        match b.get(i) {
            Some(b'[') => {
                depth += 1;
                i += 1;
                if depth > MAX_PLAIN_DEPTH {
                    return false;
                }
                if b.get(i) != Some(&b']') {
                    continue;
                }
                depth -= 1;
                i += 1;
            }
            Some(b'"') => match b[i + 1..]
                .iter()
                .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
            {
                Some(n) if b[i + 1 + n] == b'"' => i += n + 2,
                _ => return false,
            },
            Some(b't') if b[i..].starts_with(b"true") => i += 4,
            Some(b'f') if b[i..].starts_with(b"false") => i += 5,
            Some(b'n') if b[i..].starts_with(b"null") => i += 4,
            _ => match number_end(b, i) {
                Some(end) => i = end,
                None => return false,
            },
        }
        // After a value: arrays that close, then a comma, or the end of the text.
        loop {
            match b.get(i) {
                Some(b']') if depth > 0 => {
                    depth -= 1;
                    i += 1;
                }
                Some(b',') if depth > 0 => {
                    i += 1;
                    break;
                }
                None if depth == 0 => return true,
                _ => return false,
            }
        }
    }
}

/// The end of the JSON number without an exponent that starts at `i` (`-`, then `0` or a digit run
/// without a leading zero, then maybe `.` and at least one digit); `None` if none starts there.
fn number_end(b: &[u8], mut i: usize) -> Option<usize> {
    let digits = |mut i: usize| {
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        i
    };
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    i = match b.get(i)? {
        b'0' => i + 1,
        b'1'..=b'9' => digits(i + 1),
        _ => return None,
    };
    if b.get(i) == Some(&b'.') {
        let end = digits(i + 1);
        if end == i + 1 {
            return None;
        }
        i = end;
    }
    Some(i)
}

/// The SHA1, in lowercase hex, of [`canonical_json`] of `args`.
pub fn args_digest(args: &Value) -> String {
    let mut out = String::with_capacity(40);
    push_digest(&mut out, &canonical_json(args));
    out
}

/// JSON text with object keys sorted (by their UTF-8 bytes) at every depth and no whitespace; numbers
/// keep the digits they were read with (serde_json's `arbitrary_precision`: `1` and `1.0` differ, big
/// integers and long decimals are exact; only an exponent's spelling is normalized, `1e3` → `1e+3`),
/// strings use serde_json's escaping.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::with_capacity(64);
    write_canonical(v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(k, out);
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        Value::String(s) => write_string(s, out),
        // Numbers keep the text they were read with (`arbitrary_precision`: what their `Display`
        // writes too); null and booleans have one spelling.
        Value::Number(n) => out.push_str(n.as_str()),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Null => out.push_str("null"),
    }
}

/// `s` as a JSON string, escaped as serde_json escapes it: only `"`, `\` and control characters
/// below U+0020 are (serde_json's `ESCAPE` table), so a string without them is written as is.
fn write_string(s: &str, out: &mut String) {
    if !s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
        return;
    }
    // Serializing a string to JSON cannot fail.
    out.push_str(&serde_json::to_string(s).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn object_keys_are_sorted_at_every_depth() {
        let a: Value =
            serde_json::from_str(r#"[{"b":2,"a":{"y":[1,{"d":0,"c":1}],"x":null}},"s"]"#).unwrap();
        assert_eq!(
            canonical_json(&a),
            r#"[{"a":{"x":null,"y":[1,{"c":1,"d":0}]},"b":2},"s"]"#
        );
    }

    #[test]
    fn key_order_does_not_change_the_digest_but_values_do() {
        let a: Value = serde_json::from_str(r#"[{"a":1,"b":2}]"#).unwrap();
        let b: Value = serde_json::from_str(r#"[{"b":2,"a":1}]"#).unwrap();
        let c: Value = serde_json::from_str(r#"[{"b":2,"a":3}]"#).unwrap();
        assert_eq!(args_digest(&a), args_digest(&b));
        assert_ne!(args_digest(&a), args_digest(&c));
        assert_eq!(args_digest(&a).len(), 40);
    }

    #[test]
    fn numbers_are_kept_as_written() {
        let v: Value =
            serde_json::from_str("[1, 1.0, 12345678901234567890123, 0.10000000000000000001]")
                .unwrap();
        assert_eq!(
            canonical_json(&v),
            "[1,1.0,12345678901234567890123,0.10000000000000000001]"
        );
    }

    #[test]
    fn strings_are_escaped_like_json() {
        assert_eq!(
            canonical_json(&json!(["a\"b\n", "é"])),
            "[\"a\\\"b\\n\",\"é\"]"
        );
    }

    /// The canonical form by another road: every object's keys sorted by bytes into a new value, which
    /// serde_json then writes whole (its own escaping, numbers as they were read). The fast paths of
    /// `write_canonical` must give exactly this text, or every lock key would change.
    fn reference(v: &Value) -> String {
        fn sorted(v: &Value) -> Value {
            match v {
                Value::Object(map) => {
                    let mut entries: Vec<(String, Value)> =
                        map.iter().map(|(k, v)| (k.clone(), sorted(v))).collect();
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                    Value::Object(entries.into_iter().collect())
                }
                Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
                other => other.clone(),
            }
        }
        serde_json::to_string(&sorted(v)).unwrap()
    }

    /// Pieces random JSON texts are built from: numbers spelled every way JSON allows, strings with
    /// every kind of character serde_json escapes or passes through, keys that sort differently by
    /// bytes than by characters.
    const NUMBERS: &[&str] = &[
        "0",
        "-0",
        "7",
        "-12",
        "1.0",
        "1.50",
        "0.10000000000000000001",
        "1e3",
        "1E3",
        "1e+3",
        "-2.5e-7",
        "6.02E+23",
        "12345678901234567890123",
        "-9223372036854775809",
        "18446744073709551616",
        "3.0e0",
    ];
    const STRINGS: &[&str] = &[
        r#""""#,
        r#""plain""#,
        r#""a\"b""#,
        r#""back\\slash""#,
        r#""\n\t\r\b\f""#,
        r#""\u0000\u001f\u007f""#,
        r#""\u00e9 é""#,
        r#""\ud83d\ude00 😀""#,
        r#""\u2028\u2029""#,
        r#""\/slash""#,
        r#""tab\u0009""#,
        r#""Zürich""#,
        r#""a:b""#,
    ];

    fn random_json(depth: u32, out: &mut String) {
        let pick = |n: usize| rand::random_range(0..n);
        match if depth == 0 { pick(4) } else { pick(6) } {
            0 => out.push_str(NUMBERS[pick(NUMBERS.len())]),
            1 => out.push_str(STRINGS[pick(STRINGS.len())]),
            2 => out.push_str(["true", "false", "null"][pick(3)]),
            3 => out.push_str(" [ ] "),
            4 => {
                out.push_str("[ ");
                for i in 0..pick(4) {
                    if i > 0 {
                        out.push_str(" , ");
                    }
                    random_json(depth - 1, out);
                }
                out.push(']');
            }
            _ => {
                out.push('{');
                for i in 0..pick(5) {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(STRINGS[pick(STRINGS.len())]);
                    out.push_str(" :\n");
                    random_json(depth - 1, out);
                }
                out.push('}');
            }
        }
    }

    #[test]
    fn the_canonical_text_and_digest_are_what_they_always_were_for_varied_arguments() {
        let mut cases: Vec<String> = [
            "[]",
            "[1]",
            "[1,2,3]",
            r#"[{"b":2,"a":1}]"#,
            r#"[{"é":1,"z":2,"a\"":3,"":4}]"#,
            r#"["\u0000", "\u001b[31m", "x\ny"]"#,
            "[1.0, 1, -0, 1e3, 1E-3]",
            r#"[{"_aj_globalid":"gid://app/User/1"},{"_aj_symbol_keys":[]}]"#,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for _ in 0..2000 {
            let mut text = String::from("[");
            random_json(4, &mut text);
            text.push(']');
            cases.push(text);
        }
        for text in &cases {
            let v: Value = serde_json::from_str(text).unwrap();
            let expected = reference(&v);
            assert_eq!(canonical_json(&v), expected, "{text}");
            assert_eq!(
                args_digest(&v),
                crate::job::hex(&Sha1::digest(expected.as_bytes())),
                "{text}"
            );
        }
    }

    /// What `is_canonical` promises: a text it accepts is valid JSON whose canonical form is the text
    /// itself, so digesting it as it is gives the key the parse would.
    fn check_plain(text: &str) {
        if is_canonical(text) {
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(canonical_json(&v), text);
        }
    }

    #[test]
    fn plain_arguments_are_their_own_canonical_form_and_the_rest_is_parsed() {
        for plain in [
            "[]",
            "[42]",
            r#"[1,"two",null,true,false,[2.5,-0,[]],"é 😀",0.10000000000000000001,-7]"#,
            "[[[[]]],[]]",
        ] {
            assert!(is_canonical(plain), "{plain}");
            check_plain(plain);
        }
        for other in [
            r#"[{"a":1}]"#,
            "[1e3]",
            "[1E3]",
            "[ 1]",
            "[1,\n2]",
            r#"["a\n"]"#,
            r#"["a\"b"]"#,
            "[\"a\tb\"]",
            "[01]",
            "[1.]",
            "[.5]",
            "[-]",
            "[+1]",
            "[1,]",
            "[,1]",
            "[",
            "]",
            "[1]]",
            "[[1]",
            "[tru]",
            "[nul]",
            "[1][2]",
            r#"["unterminated]"#,
            "",
        ] {
            assert!(!is_canonical(other), "{other}");
        }
        assert!(!is_canonical(&format!(
            "{}{}",
            "[".repeat(65),
            "]".repeat(65)
        )));
        assert!(is_canonical(&format!(
            "{}{}",
            "[".repeat(64),
            "]".repeat(64)
        )));
    }

    #[test]
    fn a_text_read_as_plain_always_gives_the_parsed_key() {
        let alphabet: Vec<char> = "[]{}\",.:-+0123456789eEtrufalsn \\x\n".chars().collect();
        let mut plain = 0;
        for _ in 0..3000 {
            let mut text = String::from("[");
            random_json(3, &mut text);
            text.push(']');
            let v: Value = serde_json::from_str(&text).unwrap();
            // The payload's own compact writing (Ruby's JSON writes no whitespace either).
            let compact = serde_json::to_string(&v).unwrap();
            for t in [&text, &compact] {
                check_plain(t);
                plain += usize::from(is_canonical(t));
            }
            // And texts one edit away from it, valid or not.
            let mut chars: Vec<char> = compact.chars().collect();
            let at = rand::random_range(0..=chars.len());
            match rand::random_range(0..3) {
                0 if at < chars.len() => {
                    chars.remove(at);
                }
                1 if at < chars.len() => {
                    chars[at] = alphabet[rand::random_range(0..alphabet.len())]
                }
                _ => chars.insert(at, alphabet[rand::random_range(0..alphabet.len())]),
            }
            check_plain(&chars.into_iter().collect::<String>());
        }
        assert!(plain > 100, "only {plain} texts took the plain path");
    }

    #[test]
    fn the_digest_is_the_sha1_of_the_canonical_text() {
        // sha1("[]") computed independently (e.g. `printf '[]' | sha1sum`).
        assert_eq!(
            args_digest(&json!([])),
            "97d170e1550eee4afc0af065b78cda302a97674c"
        );
    }
}
