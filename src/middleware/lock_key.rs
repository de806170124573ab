//! Which Redis key a job's lock lives under: the worker's class, its class plus a digest of its
//! arguments, or a key the worker computes from its typed arguments.
//!
//! Shared by [`UniqueJob`](super::unique::UniqueJob) and [`SequentialJob`](super::sequential::SequentialJob)
//! (and by the client's until-executed locks, which digest the arguments the same way). The name built
//! here is the `<key>` of `lock:<key>` ([`keys::lock`](crate::keys::lock)).
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

use crate::worker::JobContext;

/// The builder methods every lock middleware shares (`key_by_args`, `key`, `lock_key`, `ttl`), for an
/// `impl<W: Worker>` block of a struct with fields `key: LockKey<W::Args>` and `ttl: Duration`.
macro_rules! lock_key_builders {
    () => {
        /// One lock per distinct argument list: `<class>:<sha1 of the canonical args>`.
        pub fn key_by_args(mut self) -> Self {
            self.key = $crate::middleware::lock_key::LockKey::ByArgs;
            self
        }

        /// A lock named by the worker from its typed arguments (used as is, under `lock:`).
        pub fn key(mut self, f: impl Fn(&W::Args) -> String + Send + Sync + 'static) -> Self {
            self.key = $crate::middleware::lock_key::LockKey::Custom(::std::sync::Arc::new(f));
            self
        }

        /// Any [`LockKey`](crate::middleware::lock_key::LockKey).
        pub fn lock_key(mut self, key: $crate::middleware::lock_key::LockKey<W::Args>) -> Self {
            self.key = key;
            self
        }

        /// The lock's TTL (default 30 s); the lock is extended while the job runs longer.
        pub fn ttl(mut self, ttl: ::std::time::Duration) -> Self {
            self.ttl = ttl;
            self
        }
    };
}
pub(crate) use lock_key_builders;

/// The function of a [`LockKey::Custom`] key.
pub type KeyFn<A> = Arc<dyn Fn(&A) -> String + Send + Sync>;

/// How a lock middleware names the lock of a job whose arguments are `A`.
pub enum LockKey<A> {
    /// The worker's class name: one lock for every job of the class. The default.
    Class,
    /// `<class>:<sha1 of the canonical JSON of the args>`: one lock per distinct argument list.
    ByArgs,
    /// A key the worker computes from its typed arguments, e.g. `format!("stripe-{customer_id}")`;
    /// used as is, so jobs of different classes can share a lock on purpose.
    Custom(KeyFn<A>),
}

impl<A> Clone for LockKey<A> {
    fn clone(&self) -> Self {
        match self {
            LockKey::Class => LockKey::Class,
            LockKey::ByArgs => LockKey::ByArgs,
            LockKey::Custom(f) => LockKey::Custom(f.clone()),
        }
    }
}

impl<A> fmt::Debug for LockKey<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockKey::Class => f.write_str("Class"),
            LockKey::ByArgs => f.write_str("ByArgs"),
            LockKey::Custom(_) => f.write_str("Custom(<fn>)"),
        }
    }
}

// Written out: a derive would require `A: Default`, which argument tuples rarely are.
#[allow(clippy::derivable_impls)]
impl<A> Default for LockKey<A> {
    fn default() -> Self {
        LockKey::Class
    }
}

impl<A: DeserializeOwned> LockKey<A> {
    /// The lock's name for this job (without the `lock:` prefix), or `None` when the arguments do not
    /// decode: the caller then runs the worker unlocked, which fails at once with the same
    /// `ArgumentError` the worker's own decoding reports.
    pub fn resolve(&self, ctx: &JobContext) -> Option<String> {
        match self {
            LockKey::Class => Some(ctx.class().to_string()),
            LockKey::ByArgs => {
                let args: Value = match ctx.activejob() {
                    Some(aj) => aj.arguments().clone(),
                    None => serde_json::from_str(ctx.args_json()).ok()?,
                };
                Some(format!("{}:{}", ctx.class(), args_digest(&args)))
            }
            LockKey::Custom(f) => {
                let args: A = ctx.args().ok()?;
                Some(f(&args))
            }
        }
    }
}

/// The SHA1, in lowercase hex, of [`canonical_json`] of `args`.
pub fn args_digest(args: &Value) -> String {
    crate::job::hex(&Sha1::digest(canonical_json(args).as_bytes()))
}

/// JSON text with object keys sorted (by their UTF-8 bytes) at every depth and no whitespace; numbers
/// keep the digits they were read with (serde_json's `arbitrary_precision`: `1` and `1.0` differ, big
/// integers and long decimals are exact; only an exponent's spelling is normalized, `1e3` → `1e+3`),
/// strings use serde_json's escaping.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
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
        // null, booleans and numbers have one spelling; numbers keep the text they were read with.
        other => out.push_str(&other.to_string()),
    }
}

fn write_string(s: &str, out: &mut String) {
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

    #[test]
    fn the_digest_is_the_sha1_of_the_canonical_text() {
        // sha1("[]") computed independently (e.g. `printf '[]' | sha1sum`).
        assert_eq!(
            args_digest(&json!([])),
            "97d170e1550eee4afc0af065b78cda302a97674c"
        );
    }
}
