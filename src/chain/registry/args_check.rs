//! The decoder `oxidekiq check` runs on sampled payloads ([`crate::migrate::check`]): does a payload's
//! `args` fit one worker's `Args` type, and if not, where and what JSON type is there, never the value.
//!
//! The registry keeps one such decoder per class ([`ArgsCheck`], built when the worker is registered,
//! where its type is known); it lives here, with the registry, so that the registry hands `check` a
//! decoder and knows nothing of the migration commands above it (docs/layout.md).

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::job::Job;
use crate::redact::redact_values;

/// Decodes a payload's `args` as one worker's `Args` type; the registry keeps one per class.
pub(crate) type ArgsCheck = fn(&Job) -> std::result::Result<(), Mismatch>;

/// Why a payload's arguments do not fit: where, what JSON type is there, and serde's message with
/// every quoted value blanked.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Mismatch {
    /// The field path inside `args` (`[1]`, `[2].locale`; for ActiveJob, inside `arguments`).
    pub path: String,
    /// The JSON type found at that path (`string`, `number`, `missing`, `array of 3`, …).
    pub found: String,
    /// What serde expected, values blanked.
    pub message: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: JSON {} ({})", self.path, self.found, self.message)
    }
}

/// The JSON type of a value, never its content.
pub(crate) fn json_type(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => "boolean".into(),
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer".into(),
        Value::Number(_) => "number".into(),
        Value::String(_) => "string".into(),
        Value::Array(a) => format!("array of {}", a.len()),
        Value::Object(_) => "object".into(),
    }
}

/// Decodes `job`'s arguments as `A`, exactly as the worker would receive them.
pub(crate) fn check_args<A: DeserializeOwned>(job: &Job) -> std::result::Result<(), Mismatch> {
    let (root, prefix) = if job.is_activejob() {
        match crate::activejob::unwrap(job.args_json()) {
            Ok(info) => (info.into_arguments(), "arguments"),
            Err(msg) => {
                return Err(Mismatch {
                    path: "args[0]".into(),
                    found: "ActiveJob job_data".into(),
                    message: redact_values(&msg),
                });
            }
        }
    } else {
        match serde_json::from_str::<Value>(job.args_json()) {
            Ok(v) => (v, "args"),
            Err(e) => {
                return Err(Mismatch {
                    path: "args".into(),
                    found: "invalid JSON".into(),
                    message: redact_values(&e.to_string()),
                });
            }
        }
    };
    match serde_path_to_error::deserialize::<_, A>(&root) {
        Ok(_) => Ok(()),
        Err(e) => {
            let path = e.path().clone();
            let found = match at_path(&root, &path) {
                Some(v) => json_type(v),
                None => "missing".into(),
            };
            let shown = path.to_string();
            let path = if shown == "." {
                prefix.to_string()
            } else {
                format!("{prefix}{shown}")
            };
            Err(Mismatch {
                path,
                found,
                message: redact_values(&e.into_inner().to_string()),
            })
        }
    }
}

/// The value at a serde path, if there is one.
fn at_path<'v>(root: &'v Value, path: &serde_path_to_error::Path) -> Option<&'v Value> {
    use serde_path_to_error::Segment;
    let mut v = root;
    for seg in path.iter() {
        v = match seg {
            Segment::Seq { index } => v.get(*index)?,
            Segment::Map { key } => v.get(key.as_str())?,
            Segment::Enum { .. } | Segment::Unknown => v,
        };
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(args: &str) -> Job {
        Job::from_str(&format!(r#"{{"class":"X","args":{args},"jid":"j"}}"#)).unwrap()
    }

    #[test]
    fn a_mismatch_names_the_path_and_type_never_the_value() {
        let e = check_args::<(String, i64)>(&job(r#"["bob","SECRET"]"#)).unwrap_err();
        assert_eq!(e.path, "args[1]");
        assert_eq!(e.found, "string");
        assert!(!e.to_string().contains("SECRET"), "{e}");
        assert!(check_args::<(String, i64)>(&job(r#"["bob",5]"#)).is_ok());
        let e = check_args::<(String, i64)>(&job(r#"["bob"]"#)).unwrap_err();
        assert_eq!((e.path.as_str(), e.found.as_str()), ("args", "array of 1"));
    }

    #[test]
    fn nested_fields_have_their_path() {
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct Opts {
            locale: String,
        }
        let e = check_args::<(u64, Opts)>(&job(r#"[1,{"locale":12345}]"#)).unwrap_err();
        assert_eq!(e.path, "args[1].locale");
        assert_eq!(e.found, "integer");
        assert!(!e.to_string().contains("12345"), "{e}");
    }
}
