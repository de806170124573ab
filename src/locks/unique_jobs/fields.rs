//! The gem's fields in a payload: the lock type, and [`LockConfig`] (the gem's name), what a job's
//! fields ask of its lock.

use super::*;

/// The gem's lock types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockType {
    /// Released before perform.
    UntilExecuting,
    /// Released after a successful perform.
    UntilExecuted,
    /// Held only while performing (`<d>:RUN`).
    WhileExecuting,
    /// Until executing, then while executing.
    UntilAndWhileExecuting,
    /// Never released by the server.
    UntilExpired,
}

impl LockType {
    pub(super) fn named(name: &str) -> Option<LockType> {
        Some(match name {
            "until_executing" => LockType::UntilExecuting,
            "until_executed" => LockType::UntilExecuted,
            "while_executing" => LockType::WhileExecuting,
            "until_and_while_executing" => LockType::UntilAndWhileExecuting,
            "until_expired" => LockType::UntilExpired,
            _ => return None,
        })
    }
}

/// What the gem's fields of one payload ask of its lock: the gem's own
/// `SidekiqUniqueJobs::LockConfig` (`lock_config.rb`), which reads the same fields of the job hash,
/// plus the digest, the score and the payload the steps need.
#[derive(Debug, Clone)]
pub(crate) struct LockConfig {
    /// The lock type.
    pub lock: LockType,
    /// The payload's `lock` text (the `type` the gem writes).
    pub(super) lock_name: String,
    /// The digest without a `:RUN` suffix.
    pub digest: String,
    /// `lock_ttl` in milliseconds (0: none).
    pub(super) pttl: i64,
    /// `lock_timeout` in seconds.
    pub(super) timeout: i64,
    /// `lock_limit` (1 unless given).
    pub(super) limit: i64,
    /// The server strategy.
    pub strategy: Strategy,
    /// `lock_info`: write `<d>:INFO`.
    pub(super) info: bool,
    /// The job's `at` as the gem passes it (`lock_score`), or empty.
    pub(super) score: String,
    /// The payload, to write `:INFO` and the payloads of the conflict strategies.
    pub(super) map: Map<String, Value>,
}

/// An integer the way Ruby's `to_i` reads a JSON value (a float is cut, anything else is 0).
pub(super) fn to_i(v: Option<&Value>) -> i64 {
    match v {
        Some(Value::Number(n)) => n
            .as_i64()
            .or_else(|| n.as_f64().filter(|f| f.is_finite()).map(|f| f as i64))
            .unwrap_or(0),
        Some(Value::String(s)) => s.trim().parse::<f64>().map_or(0, |f| f as i64),
        _ => 0,
    }
}

/// The cheap test before [`LockConfig::read`] parses the payload: false when it names neither
/// `lock_digest` nor a `lock` option at all, as for most jobs.
pub(crate) fn may_be_gems(job: &Job) -> bool {
    let raw = job.raw();
    raw.contains("\"lock_digest\"") || raw.contains("\"lock\":")
}

/// Whether a payload names one of the gem's lock types in `lock` without a usable `lock_digest` (none,
/// empty, not a string): the gem's server computes such a job's digest from the class (8.1's
/// `on_conflict: reschedule`, a client without the gem), which oxidekiq cannot.
pub(crate) fn lacks_digest(map: &Map<String, Value>) -> bool {
    let named = map
        .get("lock")
        .and_then(Value::as_str)
        .is_some_and(|l| LockType::named(l).is_some());
    named
        && map
            .get(LOCK_DIGEST_FIELD)
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
}

impl LockConfig {
    /// The gem's fields of `job`: `Ok(None)` for a job that is not the gem's (no `lock_digest`);
    /// `Err` when it is, but names a lock type the gem does not know (the gem raises too).
    pub(crate) fn read(job: &Job) -> std::result::Result<Option<LockConfig>, JobError> {
        if !may_be_gems(job) {
            return Ok(None);
        }
        let Ok(map) = job.to_map() else {
            return Ok(None);
        };
        let lock_name = map.get("lock").and_then(Value::as_str).unwrap_or_default();
        // Running a job that lacks its digest without the lock would break the lock's promise: it
        // fails instead, for Ruby to run (the hand-off gives it to Ruby before this).
        if lacks_digest(&map) {
            return Err(JobError::new(
                crate::error::INVALID_PAYLOAD,
                format!(
                    "sidekiq-unique-jobs lock `{lock_name}` without a {LOCK_DIGEST_FIELD}: the gem's \
                     server computes the digest from the class, which oxidekiq cannot; route this \
                     class to Ruby"
                ),
            ));
        }
        let Some(digest) = map.get(LOCK_DIGEST_FIELD).and_then(Value::as_str) else {
            return Ok(None);
        };
        let digest = digest
            .strip_suffix(keys::UNIQUE_RUN_SUFFIX)
            .unwrap_or(digest)
            .to_string();
        let Some(lock) = LockType::named(lock_name) else {
            return Err(JobError::new(
                crate::error::INVALID_PAYLOAD,
                format!(
                    "sidekiq-unique-jobs lock `{}` of digest {digest} is not a lock type oxidekiq knows \
                     (until_executing, until_executed, while_executing, until_and_while_executing, \
                     until_expired)",
                    crate::redact::clip(lock_name, 64)
                ),
            ));
        };
        let strategy = match map.get("on_conflict") {
            Some(Value::String(s)) => Strategy::named(s),
            Some(Value::Object(o)) => o
                .get("server")
                .and_then(Value::as_str)
                .map_or(Strategy::None, Strategy::named),
            _ => Strategy::None,
        };
        let limit = match to_i(map.get("lock_limit")) {
            n if n >= 1 => n,
            _ => 1,
        };
        let score = match map.get("at") {
            Some(Value::Number(n)) => n.to_string(),
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        };
        Ok(Some(LockConfig {
            lock,
            lock_name: lock_name.to_string(),
            digest,
            pttl: to_i(map.get("lock_ttl"))
                .saturating_mul(1000)
                .clamp(0, MAX_TTL_MS),
            timeout: to_i(map.get("lock_timeout")).max(0),
            limit,
            strategy,
            info: map
                .get("lock_info")
                .is_some_and(|v| v.as_bool() == Some(true)),
            score,
            map,
        }))
    }

    /// The runtime lock's digest, `<d>:RUN`.
    pub(crate) fn run_digest(&self) -> String {
        format!("{}{}", self.digest, keys::UNIQUE_RUN_SUFFIX)
    }

    /// `<d>:INFO` as the gem writes it (`locksmith.rb lock_info`; 8.x adds `at`).
    pub(super) fn info_json(&self, gem: UniqueJobsGem, now: f64) -> String {
        let field = |k: &str| self.map.get(k).cloned().unwrap_or(Value::Null);
        let mut info = Map::new();
        info.insert("worker".into(), field("class"));
        info.insert("queue".into(), field("queue"));
        info.insert("limit".into(), field("lock_limit"));
        info.insert("timeout".into(), field("lock_timeout"));
        info.insert("ttl".into(), field("lock_ttl"));
        info.insert("type".into(), Value::String(self.lock_name.clone()));
        info.insert("lock_args".into(), field("lock_args"));
        info.insert("time".into(), time::float_value(now));
        if gem != UniqueJobsGem::V7_1 {
            info.insert("at".into(), field("at"));
        }
        Value::Object(info).to_string()
    }

    /// The gem's wait for the lock in seconds: `lock_timeout`, 0 → 1, 8.1 caps it at 5 (and
    /// oxidekiq at [`MAX_WAIT_SECS`]).
    pub(super) fn wait(&self, gem: UniqueJobsGem) -> Duration {
        let mut s = if self.timeout == 0 {
            1
        } else {
            self.timeout.min(MAX_WAIT_SECS)
        };
        if gem == UniqueJobsGem::V8_1 {
            s = s.min(5);
        }
        Duration::from_secs(u64::try_from(s).unwrap_or(1))
    }
}
