//! Every Redis key name oxidekiq reads or writes, in one place.
//!
//! Sidekiq's keys are un-prefixed (PROTOCOL §0); keys of oxidekiq's own (working lists, locks, limits)
//! carry the `oxidekiq:` prefix so no Sidekiq Pro or GitLab reaper mistakes them for theirs.

/// `SET` of every queue name ever pushed to (`client.rb` SADDs on every push).
pub const QUEUES: &str = "queues";
/// `ZSET` of jobs scheduled for later, score = run-at epoch float seconds.
pub const SCHEDULE: &str = "schedule";
/// `ZSET` of failed jobs waiting for their next attempt.
pub const RETRY: &str = "retry";
/// `ZSET` of jobs that exhausted their retries (the morgue).
pub const DEAD: &str = "dead";
/// `SET` of live process identities (heartbeat).
pub const PROCESSES: &str = "processes";
/// Total processed counter.
pub const STAT_PROCESSED: &str = "stat:processed";
/// Total failed counter.
pub const STAT_FAILED: &str = "stat:failed";

/// The list a queue's jobs live in: `queue:<name>`.
pub fn queue(name: &str) -> String {
    format!("queue:{name}")
}

/// The daily stats key, `stat:processed:YYYY-MM-DD` (UTC date).
pub fn stat_daily(base: &str, date: &str) -> String {
    format!("{base}:{date}")
}

/// The in-progress jobs hash of a process: `<identity>:work` (Sidekiq 6.5+).
pub fn work(identity: &str) -> String {
    format!("{identity}:work")
}

/// The in-progress jobs hash that Sidekiq 6.4 UIs read: `<identity>:workers`.
pub fn workers_legacy(identity: &str) -> String {
    format!("{identity}:workers")
}

/// The list the Web UI pushes Quiet/Stop signals into: `<identity>-signals`.
pub fn signals(identity: &str) -> String {
    format!("{identity}-signals")
}

/// What every working hash's name starts with (reliable fetch): `oxidekiq:working:<identity>:<queue>`.
pub const WORKING: &str = "oxidekiq:working:";

/// What every landing list's name starts with: `oxidekiq:landing:<identity>:<queue>`.
pub const LANDING: &str = "oxidekiq:landing:";

/// The prefix of this process's working hashes (reliable fetch); the queue name follows.
pub fn working_prefix(identity: &str) -> String {
    format!("{WORKING}{identity}:")
}

/// The prefix of this process's landing lists (where a blocking fetch puts a job before the batch script
/// moves it into the working hash); the queue name follows.
pub fn landing_prefix(identity: &str) -> String {
    format!("{LANDING}{identity}:")
}

/// The key whose presence says a reliable-fetch process is alive: `oxidekiq:alive:<identity>`, refreshed
/// by its heartbeat, read by orphan recovery.
pub fn alive(identity: &str) -> String {
    format!("oxidekiq:alive:{identity}")
}

/// Splits the part of a working or landing key after its prefix, `<identity>:<queue>`, into identity and
/// queue name. The identity is `host:pid:hex12` (`launcher.rb`); a queue name may hold ':' too, so the
/// identity ends at the first `:<digits>:<hex>` pair after the host, which also reads right the keys
/// of an older process whose host name kept its ':' (this version replaces them, see
/// `heartbeat::identity_for`). None when there is no such pair, or no queue after it.
pub fn split_held(rest: &str) -> Option<(&str, &str)> {
    let parts: Vec<&str> = rest.split(':').collect();
    let is_pid = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    // 12 hex digits in every identity Sidekiq or oxidekiq makes; any length is read, as tests use short ones.
    let is_nonce = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    // Host name at least one part, then pid and nonce, then at least one part of queue name.
    let i =
        (1..parts.len().saturating_sub(2)).find(|&i| is_pid(parts[i]) && is_nonce(parts[i + 1]))?;
    let len: usize = parts[..i + 2].iter().map(|p| p.len() + 1).sum::<usize>() - 1;
    let (identity, queue) = (rest.get(..len)?, rest.get(len + 1..)?);
    Some((identity, queue))
}

/// The pattern that matches every process's landing lists and working hashes, for recovery: one SCAN
/// of the keyspace finds both (the few other keys it lets through are dropped by their prefix).
pub const HELD_PATTERN: &str = "oxidekiq:[lw][ao][nr][dk]ing:*";

/// Hash of processes seen without their liveness key: identity → Redis time (ms) when first seen so;
/// recovery takes their jobs only once they stay so for a grace (see `fetch/recovery.rs` `ORPHAN_LUA`).
pub const SUSPECTS: &str = "oxidekiq:suspects";

/// Hash of per-payload recovery counts (SHA1 of the payload → times recovered from a dead process).
pub const RECOVERED: &str = "oxidekiq:recovered";

/// The key guarding orphan recovery, so one process at a time does it.
pub const RECOVERY_LOCK: &str = "oxidekiq:recovery-lock";

/// The key of a named lock (unique and sequential middleware): `lock:<key>`.
pub fn lock(key: &str) -> String {
    format!("lock:{key}")
}

// ---- Migrating a worker from Ruby (issue 14): routes, live registrations, own counters, hand-off ----
// Read by ruby/oxidekiq.rb too: a name changed here must change there.

/// `HASH` class → share in percent (0–100) of its new jobs the Ruby middleware sends to `<queue>_rust`.
pub const ROUTES: &str = "oxidekiq:routes";

/// The suffix of the queue a routed job goes to: `<queue>_rust`.
pub const RUST_QUEUE_SUFFIX: &str = "_rust";

/// The queue oxidekiq serves for jobs routed away from `queue`: `<queue>_rust`.
pub fn rust_queue(queue: &str) -> String {
    format!("{queue}{RUST_QUEUE_SUFFIX}")
}

/// `ZSET` identity → expiry epoch seconds of the live oxidekiq processes that fetch from `rust_queue`
/// with a worker registered for `class`; refreshed by each beat with a TTL of a few beats, so the key
/// is gone within that TTL once the last of them dies. Ruby only asks `EXISTS`.
pub fn serving(rust_queue: &str, class: &str) -> String {
    format!("oxidekiq:serving:{rust_queue}|{class}")
}

/// The pattern matching every [`serving`] key.
pub const SERVING_PATTERN: &str = "oxidekiq:serving:*";

/// `HASH` of the jobs oxidekiq ran in one UTC minute (`%Y%m%d|%H:%M`): fields `<Class>|p` (run) and
/// `<Class>|f` (failed), 2 h TTL; Sidekiq's own metrics count Ruby and Rust together, this tells them
/// apart (and is all there is on 6.4, which records no execution metrics).
pub fn ran(minute: &str) -> String {
    format!("oxidekiq:ran|{minute}")
}

/// `HASH` class → jobs handed off to Ruby (`--handoff`), never expires.
pub const HANDOFF: &str = "oxidekiq:handoff";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_keys_split_at_the_pid_and_nonce() {
        assert_eq!(
            split_held("web1:42:0123456789ab:default"),
            Some(("web1:42:0123456789ab", "default"))
        );
        assert_eq!(
            split_held("node:a:42:0123456789ab:ffff:default"),
            Some(("node:a:42:0123456789ab", "ffff:default"))
        );
        assert_eq!(
            split_held("h:1:0123456789ab:q:7:abcdefabcdef"),
            Some(("h:1:0123456789ab", "q:7:abcdefabcdef"))
        );
        assert_eq!(split_held("h:1:0123456789ab"), None);
        assert_eq!(
            split_held("node:a:42:ffff:default"),
            Some(("node:a:42:ffff", "default"))
        );
        assert_eq!(split_held("h:1:nothex:default"), None);
        assert_eq!(split_held("1:0123456789ab:default"), None);
    }

    #[test]
    fn sidekiq_key_shapes_match_ruby() {
        assert_eq!(queue("default"), "queue:default");
        assert_eq!(work("h:1:ab"), "h:1:ab:work");
        assert_eq!(workers_legacy("h:1:ab"), "h:1:ab:workers");
        assert_eq!(signals("h:1:ab"), "h:1:ab-signals");
        assert_eq!(
            stat_daily(STAT_PROCESSED, "2026-11-21"),
            "stat:processed:2026-11-21"
        );
    }
}
