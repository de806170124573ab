//! Every Redis key name oxidekiq reads or writes, in one place.
//!
//! Sidekiq's keys are un-prefixed (PROTOCOL §0); keys of oxidekiq's own (working lists, locks, limits)
//! carry the `oxidekiq:` prefix so no Sidekiq Pro or GitLab reaper mistakes them for theirs (locks are
//! `oxidekiq:lock:<key>`, limits `oxidekiq:concurrency:<name>` and `oxidekiq:rate:<name>`).

/// `SET` of every queue name ever pushed to (`client.rb` SADDs on every push).
pub(crate) const QUEUES: &str = "queues";
/// `ZSET` of jobs scheduled for later, score = run-at epoch float seconds.
pub(crate) const SCHEDULE: &str = "schedule";
/// `ZSET` of failed jobs waiting for their next attempt.
pub(crate) const RETRY: &str = "retry";
/// `ZSET` of jobs that exhausted their retries (the morgue).
pub(crate) const DEAD: &str = "dead";
/// `SET` of live process identities (heartbeat).
pub(crate) const PROCESSES: &str = "processes";
/// Total processed counter.
pub(crate) const STAT_PROCESSED: &str = "stat:processed";
/// Total failed counter.
pub(crate) const STAT_FAILED: &str = "stat:failed";

/// `SET` of sidekiq-cron 1.x's schedules; its members are the schedules' hash keys (`cron_job:<name>`).
pub(crate) const CRON_JOBS: &str = "cron_jobs";
/// `SCAN` pattern of sidekiq-cron 2.x's per-namespace sets, `cron_jobs:<namespace>`.
pub(crate) const CRON_JOBS_NAMESPACED: &str = "cron_jobs:*";

/// sidekiq-scheduler's hash of next run times (`SidekiqScheduler::RedisManager.next_times_key`): its
/// presence means sidekiq-scheduler runs schedules from a Ruby process.
pub(crate) const SIDEKIQ_SCHEDULER_NEXT_TIMES: &str = "sidekiq-scheduler:next_times";

/// A sidekiq-cron 2.x namespace's set of schedules: `cron_jobs:<namespace>`.
pub(crate) fn cron_jobs_in(namespace: &str) -> String {
    format!("{CRON_JOBS}:{namespace}")
}

/// A schedule's hash: `cron_job:<name>` (sidekiq-cron 1.x) or `cron_job:<namespace>:<name>` (2.x).
pub(crate) fn cron_job(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("cron_job:{ns}:{name}"),
        None => format!("cron_job:{name}"),
    }
}

/// A schedule's claimed ticks (`ZSET`, member the tick's ISO 8601 time): `<schedule hash>:enqueued`,
/// in both layouts (`job.rb` `job_enqueued_key`).
pub(crate) fn cron_enqueued(job_key: &str) -> String {
    format!("{job_key}:enqueued")
}

/// A schedule's last jids (`LIST` of `{"jid":..,"enqueued":..}`): `<schedule hash>:jid_history`.
pub(crate) fn cron_jid_history(job_key: &str) -> String {
    format!("{job_key}:jid_history")
}

/// The list a queue's jobs live in: `queue:<name>`.
pub(crate) fn queue(name: &str) -> String {
    format!("queue:{name}")
}

/// The daily stats key, `stat:processed:YYYY-MM-DD` (UTC date).
pub(crate) fn stat_daily(base: &str, date: &str) -> String {
    format!("{base}:{date}")
}

/// The in-progress jobs hash of a process: `<identity>:work` (Sidekiq 6.5+).
pub(crate) fn work(identity: &str) -> String {
    format!("{identity}:work")
}

/// The in-progress jobs hash that Sidekiq 6.4 UIs read: `<identity>:workers`.
pub(crate) fn workers_legacy(identity: &str) -> String {
    format!("{identity}:workers")
}

/// The list the Web UI pushes Quiet/Stop signals into: `<identity>-signals`.
pub(crate) fn signals(identity: &str) -> String {
    format!("{identity}-signals")
}

/// What the working keys of older releases start with: the working hashes
/// (`oxidekiq:working:<identity>:<queue>`) of the releases before the batch lists, and the batch lists of
/// the first release that had them (`oxidekiq:working:<identity>:<queue>:@<n>`). This release writes
/// none; its recovery still takes them (a process of those releases killed in a mixed fleet).
pub(crate) const WORKING: &str = "oxidekiq:working:";

/// What every batch list's name starts with (reliable fetch): `oxidekiq:batch:<identity>:<queue>:@<n>`.
/// Not under [`WORKING`]: the recovery of a release before the batch lists SCANs `oxidekiq:working:*`
/// and would read a batch list as the working hash of a queue named `<queue>:@<n>` (stranding its jobs
/// in a queue nobody serves); it never looks here.
pub(crate) const BATCH: &str = "oxidekiq:batch:";

/// The set of identities of this release's reliable-fetch processes that may hold lists (issue 43):
/// each adds itself at start and at each of its recovery passes; a recovery that takes every key of a
/// dead one removes it. Recovery reads it (and each one's [`held_index`]) instead of walking the
/// keyspace at every pass.
pub(crate) const HOLDERS: &str = "oxidekiq:holders";

/// The set of the held lists of process `identity` (`oxidekiq:held:<identity>`): its landing lists, and
/// each batch list added by the write that fills it (the fast path's guard, the batch script) and removed
/// with the `DEL` that ends it. Entries may outlive their key (a push-back's `DEL`): a key that is gone
/// moves nothing, and the process drops such entries at its own recovery passes.
pub(crate) fn held_index(identity: &str) -> String {
    format!("oxidekiq:held:{identity}")
}

/// What every landing list's name starts with: `oxidekiq:landing:<identity>:<queue>`.
pub(crate) const LANDING: &str = "oxidekiq:landing:";

/// An iterable job's state hash, `it-<jid>` (Sidekiq 8's `iteration_key`): `ex`, `c`, `rt`,
/// `cancelled` (docs/iterable-protocol.md).
pub(crate) fn iteration(jid: &str) -> String {
    format!("it-{jid}")
}

/// The prefix of this process's batch lists (reliable fetch): `oxidekiq:batch:<identity>:`; the queue
/// name and the batch number follow ([`batch_list`]).
pub(crate) fn batch_prefix(identity: &str) -> String {
    format!("{BATCH}{identity}:")
}

/// The prefix of this process's landing lists (where a blocking fetch puts a job before the batch script
/// copies it into a batch list); the queue name follows.
pub(crate) fn landing_prefix(identity: &str) -> String {
    format!("{LANDING}{identity}:")
}

/// What a batch list's name ends with before its number: `<working prefix><queue>:@<batch>`.
const BATCH_MARK: &str = ":@";

/// Bits of a reliable-fetch unit id that hold the job's place in its batch list; the batch number is
/// above them (a batch holds at most 1 000 jobs, `fetch::MAX_BATCH`, which checks that they fit).
/// Ten bits leave 54 for the batch number: 8 for the capsule and 46 within it (`fetch::CAPSULE_SHIFT`).
pub(crate) const PLACE_BITS: u32 = 10;

/// A batch list of reliable fetch: `oxidekiq:batch:<identity>:<queue>:@<batch>` (`batch_prefix` from
/// [`batch_prefix`]), the jobs one fetch took from `queue`, in serve order (its head is the job the queue
/// served first). The last release wrote them as `oxidekiq:working:<identity>:<queue>:@<batch>`, in the
/// queue's order (its tail served first), and the ones before it kept a working hash
/// `oxidekiq:working:<identity>:<queue>`; recovery takes all three, each in its order.
pub(crate) fn batch_list(batch_prefix: &str, queue: &str, batch: u64) -> String {
    format!("{batch_prefix}{queue}{BATCH_MARK}{batch}")
}

/// The set of the places in batch list `held` whose jobs are done (acknowledged, their fate written, or
/// pushed back): `oxidekiq:acks:<identity>:<queue>:@<batch>`, for a list of either prefix (the last
/// release's `oxidekiq:working:` lists have the same acks names). Outside the held prefixes, so
/// recovery's scan does not take it for a held key.
pub(crate) fn acks_of(held: &str) -> String {
    match held
        .strip_prefix(BATCH)
        .or_else(|| held.strip_prefix(WORKING))
    {
        Some(rest) => format!("{ACKS}{rest}"),
        None => format!("{ACKS}{held}"),
    }
}

/// What every acks set's name starts with ([`acks_of`]).
pub(crate) const ACKS: &str = "oxidekiq:acks:";

/// The queue of the part of a batch list's key after the identity (`<queue>:@<batch>`), or None when it
/// has no batch number (a working hash of an older version, or a landing list).
pub(crate) fn batch_queue(rest: &str) -> Option<&str> {
    let (queue, batch) = rest.rsplit_once(BATCH_MARK)?;
    (!batch.is_empty() && batch.bytes().all(|b| b.is_ascii_digit())).then_some(queue)
}

/// The key whose presence says a reliable-fetch process is alive: `oxidekiq:alive:<identity>`, refreshed
/// by its heartbeat, read by orphan recovery.
pub(crate) fn alive(identity: &str) -> String {
    format!("oxidekiq:alive:{identity}")
}

/// Splits the part of a working or landing key after its prefix, `<identity>:<queue>`, into identity and
/// queue name. The identity is `host:pid:hex12` (`launcher.rb`); a queue name may hold ':' too, so the
/// identity ends at the first `:<digits>:<hex>` pair after the host, which also reads right the keys
/// of an older process whose host name kept its ':' (this version replaces them, see
/// `heartbeat::identity_for`). None when there is no such pair, or no queue after it.
pub(crate) fn split_held(rest: &str) -> Option<(&str, &str)> {
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

/// The pattern that matches every process's batch lists (`oxidekiq:batch:`), the working keys of older
/// releases (`oxidekiq:working:`) and the landing lists (`oxidekiq:landing:`), for recovery: one SCAN of
/// the keyspace finds all of them (the few other keys it lets through are dropped by their prefix; acks
/// sets, `oxidekiq:acks:`, and locks, `oxidekiq:lock:`, are not).
pub(crate) const HELD_PATTERN: &str = "oxidekiq:[blw][ao][nrt][cdk]*";

/// Hash of processes seen without their liveness key: identity → Redis time (ms) when first seen so;
/// recovery takes their jobs only once they stay so for a grace (see `fetch/recovery.rs` `ORPHAN_LUA`).
pub(crate) const SUSPECTS: &str = "oxidekiq:suspects";

/// The same marks for the processes that hold batch lists under [`BATCH`] (this release's). Apart from
/// [`SUSPECTS`]: a recovery pass of an older release, which never sees `oxidekiq:batch:` keys, takes
/// such a process for one that holds nothing and deletes its mark from [`SUSPECTS`] at every pass, so in
/// a mixed fleet this release's passes found it unmarked each time and never reached the grace (its
/// jobs stayed in its batch lists for as long as an older process ran). No older release reads this key.
pub(crate) const BATCH_SUSPECTS: &str = "oxidekiq:suspects:batch";

/// Hash of per-payload recovery counts (SHA1 of the payload → times recovered from a dead process).
pub(crate) const RECOVERED: &str = "oxidekiq:recovered";

/// Taken (`SET NX PX`, five minutes) by the process whose recovery walks the keyspace as the fleet's
/// periodic safety net, so a fleet walks it about once per interval, however many processes it has.
pub(crate) const RECOVERY_WALK: &str = "oxidekiq:recovery-walk";

/// Taken (`SET NX PX`, 30 s, renewed while it walks) by the process whose cron poller walks the
/// keyspace for sidekiq-cron 2.x namespaces for the fleet, so a fleet walks it once per interval.
pub(crate) const CRON_WALK: &str = "oxidekiq:cron-walk";

/// What the fleet's last walk for sidekiq-cron namespaces found: a JSON array of the `cron_jobs*`
/// sets, a string that expires when the next walk is due; the other processes read it.
pub(crate) const CRON_NAMESPACES: &str = "oxidekiq:cron-namespaces";

/// The key guarding orphan recovery, so one process at a time does it.
pub(crate) const RECOVERY_LOCK: &str = "oxidekiq:recovery-lock";

// ---- Locks and limits (`lock.rs`, `middleware/`): oxidekiq's own, so under its prefix ----
// Versions before this one wrote locks as `lock:<key>`: during a rolling upgrade an old and a new
// process do not see each other's locks (a payload that carries its own `unique_key` keeps it).

/// The prefix of every named lock's key ([`lock`]).
pub(crate) const LOCK_PREFIX: &str = "oxidekiq:lock:";

/// The prefix of the lock keys of versions before [`LOCK_PREFIX`], which a payload enqueued then
/// may still carry as its `unique_key`.
pub(crate) const OLD_LOCK_PREFIX: &str = "lock:";

/// The key of a named lock (unique, sequential and until-executed locks): `oxidekiq:lock:<key>`.
pub(crate) fn lock(key: &str) -> String {
    let mut k = String::with_capacity(LOCK_PREFIX.len() + key.len());
    k.push_str(LOCK_PREFIX);
    k.push_str(key);
    k
}

/// `ZSET` of the leases of the concurrency limit `name` (member = holder id, score = expiry in ms):
/// `oxidekiq:concurrency:<name>`.
pub(crate) fn concurrency(name: &str) -> String {
    format!("oxidekiq:concurrency:{name}")
}

/// `ZSET` of the starts of the rate limit `name` in its window (score = start in µs):
/// `oxidekiq:rate:<name>`.
pub(crate) fn rate(name: &str) -> String {
    format!("oxidekiq:rate:{name}")
}

// ---- Migrating a worker from Ruby (issue 14): routes, live registrations, own counters, hand-off ----
// Read by ruby/oxidekiq.rb too: a name changed here must change there.

/// `HASH` class → share in percent (0–100) of its new jobs the Ruby middleware sends to `<queue>_rust`.
pub(crate) const ROUTES: &str = "oxidekiq:routes";

/// The suffix of the queue a routed job goes to: `<queue>_rust`.
pub(crate) const RUST_QUEUE_SUFFIX: &str = "_rust";

/// `ZSET` identity → expiry epoch seconds of the live oxidekiq processes that fetch from `rust_queue`
/// with a worker registered for `class`; refreshed by each beat with a TTL of a few beats, so the key
/// is gone within that TTL once the last of them dies. Ruby only asks `EXISTS`.
pub(crate) fn serving(rust_queue: &str, class: &str) -> String {
    format!("oxidekiq:serving:{rust_queue}|{class}")
}

/// The pattern matching every [`serving`] key.
pub(crate) const SERVING_PATTERN: &str = "oxidekiq:serving:*";

/// `HASH` of the jobs oxidekiq ran in one UTC minute (`%Y%m%d|%H:%M`): fields `<Class>|p` (run) and
/// `<Class>|f` (failed), 2 h TTL; Sidekiq's own metrics count Ruby and Rust together, this tells them
/// apart (and is all there is on 6.4, which records no execution metrics).
pub(crate) fn ran(minute: &str) -> String {
    format!("oxidekiq:ran|{minute}")
}

/// `HASH` class → jobs handed off to Ruby (`--handoff`), never expires.
pub(crate) const HANDOFF: &str = "oxidekiq:handoff";

// ---- Keys read back by name (issue 12, "config" helper): the serving keys' parts, Sidekiq's metrics ----

/// The prefix of every [`serving`] key; `ruby/oxidekiq.rb` builds the same name
/// (`SERVING_PREFIX`), so a change here must change there.
pub(crate) const SERVING_PREFIX: &str = "oxidekiq:serving:";

/// The `(<queue>_rust, class)` a [`serving`] key names; None for any other key. Split at the last
/// `|`: a queue name may hold one, a Ruby class name cannot.
pub(crate) fn split_serving(key: &str) -> Option<(&str, &str)> {
    key.strip_prefix(SERVING_PREFIX)?.rsplit_once('|')
}

/// Sidekiq 7.x per-minute metrics hash, `j|%Y%m%d|%-H:%-M` (`metrics/tracking.rb@v7.3.9` `nowmin`,
/// `metrics/query.rb@v7.3.9`: `"j|#{time.strftime("%Y%m%d")}|#{time.hour}:#{time.min}"`).
pub(crate) fn metrics_minute_v7(t: chrono::DateTime<chrono::Utc>) -> String {
    format!("j|{}", t.format("%Y%m%d|%-H:%-M"))
}

/// Sidekiq 8.x per-minute metrics hash, `j|%y%m%d|%-H:%M` (`metrics/tracking.rb@v8.1.7` `nowshort`,
/// `metrics/query.rb@v8.1.7` `ROLLUPS[:minutely]`).
pub(crate) fn metrics_minute_v8(t: chrono::DateTime<chrono::Utc>) -> String {
    format!("j|{}", t.format("%y%m%d|%-H:%M"))
}

/// Sidekiq 8.x 10-minute rollup of the metrics hash: the minute key without its last digit
/// (`metrics/tracking.rb@v8.1.7` `nowmid = nowshort[0..-2]`).
pub(crate) fn metrics_ten_minutes_v8(t: chrono::DateTime<chrono::Utc>) -> String {
    let mut key = metrics_minute_v8(t);
    key.pop();
    key
}

/// Sidekiq 7.x per-minute histogram of a class, `<Class>-%d-%H:%-M` (`metrics/shared.rb@v7.3.9`:
/// `"#{klass}-#{now.strftime("%d-%H:%-M")}"`).
pub(crate) fn histogram_v7(class: &str, t: chrono::DateTime<chrono::Utc>) -> String {
    format!("{class}-{}", t.format("%d-%H:%-M"))
}

/// Sidekiq 8.x per-minute histogram of a class, `h|<Class>-%-d-%-H:%-M` (`metrics/shared.rb@v8.1.7`:
/// `"h|#{klass}-#{now.strftime("%-d-%-H:%-M")}"`).
pub(crate) fn histogram_v8(class: &str, t: chrono::DateTime<chrono::Utc>) -> String {
    format!("h|{class}-{}", t.format("%-d-%-H:%-M"))
}

/// sidekiq-unique-jobs' changelog sorted set (fixed names, whatever the `lock_prefix`: `key.rb`).
pub(crate) const UNIQUE_CHANGELOG: &str = "uniquejobs:changelog";
/// The release of sidekiq-unique-jobs the last Ruby server started with (`update_version.lua`,
/// written at each server start by 7.1 and 8.x: `8.1.0`).
pub(crate) const UNIQUE_LIVE_VERSION: &str = "uniquejobs:live";
/// sidekiq-unique-jobs' sorted set of held digests.
pub(crate) const UNIQUE_DIGESTS: &str = "uniquejobs:digests";
/// sidekiq-unique-jobs' sorted set of `until_expired` digests with a TTL.
pub(crate) const UNIQUE_EXPIRING_DIGESTS: &str = "uniquejobs:expiring_digests";
/// The suffix of sidekiq-unique-jobs' runtime lock (`while_executing`): `<digest>:RUN`.
pub(crate) const UNIQUE_RUN_SUFFIX: &str = ":RUN";

/// The eight keys every sidekiq-unique-jobs script takes for a digest `d`, in the gem's order
/// (`key.rb` `to_a`): `d`, `d:QUEUED`, `d:PRIMED`, `d:LOCKED`, `d:INFO`, the changelog, the digests
/// and the expiring digests.
pub(crate) fn unique_family(d: &str) -> [String; 8] {
    [
        d.to_string(),
        format!("{d}:QUEUED"),
        format!("{d}:PRIMED"),
        format!("{d}:LOCKED"),
        format!("{d}:INFO"),
        UNIQUE_CHANGELOG.to_string(),
        UNIQUE_DIGESTS.to_string(),
        UNIQUE_EXPIRING_DIGESTS.to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_lists_name_their_queue_and_their_acks() {
        let k = batch_list(&batch_prefix("h:1:ab"), "q:@x", 12);
        assert_eq!(k, "oxidekiq:batch:h:1:ab:q:@x:@12");
        assert_eq!(
            acks_of("oxidekiq:working:h:1:ab:q:@x:@12"),
            "oxidekiq:acks:h:1:ab:q:@x:@12",
            "the last release's lists keep their acks names"
        );
        let rest = k.strip_prefix(BATCH).unwrap();
        let (id, tail) = split_held(rest).unwrap();
        assert_eq!(id, "h:1:ab");
        assert_eq!(batch_queue(tail), Some("q:@x"));
        assert_eq!(batch_queue("default"), None);
        assert_eq!(batch_queue("q:@"), None);
        assert_eq!(acks_of(&k), "oxidekiq:acks:h:1:ab:q:@x:@12");
    }

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

    #[test]
    fn metrics_keys_follow_each_versions_query() {
        use chrono::TimeZone;
        let t = chrono::Utc
            .with_ymd_and_hms(2026, 11, 3, 8, 4, 30)
            .single()
            .unwrap();
        assert_eq!(metrics_minute_v7(t), "j|20261103|8:4");
        assert_eq!(metrics_minute_v8(t), "j|261103|8:04");
        assert_eq!(metrics_ten_minutes_v8(t), "j|261103|8:0");
        assert_eq!(histogram_v7("A", t), "A-03-08:4");
        assert_eq!(histogram_v8("A", t), "h|A-3-8:4");
    }

    #[test]
    fn serving_keys_split_back_into_queue_and_class() {
        let key = serving("default_rust", "Hard::Worker");
        assert_eq!(split_serving(&key), Some(("default_rust", "Hard::Worker")));
        assert!(SERVING_PATTERN.starts_with(SERVING_PREFIX));
        assert_eq!(split_serving("oxidekiq:routes"), None);
    }

    /// The Ruby router (`ruby/oxidekiq.rb`) names three keys of ours as constants: each must be the
    /// string this module names, or routed jobs go where no oxidekiq reads them.
    #[test]
    fn the_ruby_router_names_the_same_keys() {
        let ruby = include_str!("../../ruby/oxidekiq.rb");
        let constant = |name: &str| -> Option<&str> {
            let line = ruby
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{name} = ")))?;
            line.split('"').nth(1)
        };
        assert_eq!(constant("ROUTES_KEY"), Some(ROUTES));
        assert_eq!(constant("SERVING_PREFIX"), Some(SERVING_PREFIX));
        assert_eq!(constant("RUST_SUFFIX"), Some(RUST_QUEUE_SUFFIX));
        // The serving key Ruby asks EXISTS of is `#{SERVING_PREFIX}#{target}|#{klass}`, as `serving` writes.
        assert!(
            ruby.contains("\"#{SERVING_PREFIX}#{target}|#{klass}\""),
            "ruby/oxidekiq.rb no longer builds the serving key as keys::serving does"
        );
    }

    /// Source still to move its key names here (issue 12): paths under `src/`, a directory ending in
    /// `/` or a file; a path starting with one of these is not scanned. Remove an entry once its
    /// keys come from this module, and the scan below holds it to that from then on.
    const NOT_YET_SCANNED: &[&str] = &[];

    /// How a Redis key name looks when it is spelled out in Rust or Lua source: a prefix of Sidekiq's
    /// or ours at the start of a string, a suffix of Sidekiq's at its end.
    const KEY_SHAPES: &[&str] = &[
        "\"queue:",
        "'queue:",
        "\"stat:",
        "'stat:",
        "\"oxidekiq:",
        "'oxidekiq:",
        "\"lock:",
        "'lock:",
        "\"j|",
        "\"h|",
        ":work\"",
        ":workers\"",
        "-signals\"",
        "'-signals'",
    ];

    /// Sidekiq's plain key names, which are also ordinary words (a payload's `retry`, a process's
    /// `queues`): flagged only as the argument of a Redis command.
    const PLAIN_KEYS: &[&str] = &[QUEUES, PROCESSES, DEAD, RETRY, SCHEDULE];
    const REDIS_CALLS: &[&str] = &[
        ".arg(",
        ".key(",
        "call(",
        ".zadd(",
        ".zrem(",
        ".zcard(",
        ".zrange",
        ".lpush(",
        ".rpush(",
        ".llen(",
        ".lrange(",
        ".sadd(",
        ".srem(",
        ".smembers(",
        ".del(",
        ".exists(",
        ".hget(",
        ".hset(",
        ".hdel(",
        ".hgetall(",
        ".scan_match(",
    ];

    /// The Redis key literals of one file's library code (its `#[cfg(test)] mod tests` may spell keys
    /// out, to check independently what the code wrote), as `file:line: text`.
    fn key_literals(path: &std::path::Path, text: &str) -> Vec<String> {
        let mut found = Vec::new();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.trim();
            if code == "#[cfg(test)]"
                && lines
                    .get(i + 1)
                    .is_some_and(|next| next.trim().starts_with("mod tests"))
            {
                break;
            }
            if code.starts_with("//") {
                continue;
            }
            let shaped = KEY_SHAPES.iter().any(|s| code.contains(s));
            let plain = REDIS_CALLS
                .iter()
                .any(|c| code.to_ascii_lowercase().contains(c))
                && PLAIN_KEYS.iter().any(|k| {
                    code.contains(&format!("\"{k}\"")) || code.contains(&format!("'{k}'"))
                });
            if shaped || plain {
                found.push(format!("{}:{}: {code}", path.display(), i + 1));
            }
        }
        found
    }

    fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// Issue 12's "no Redis key literal outside `keys`": every key name is built here, so a prefix
    /// or namespace is a change to this one file.
    #[test]
    fn no_redis_key_literal_outside_keys() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        assert!(
            files.len() > 20,
            "found only {} files under {}",
            files.len(),
            src.display()
        );
        let mut found = Vec::new();
        for path in files {
            let rel = path
                .strip_prefix(&src)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            // `tests_*.rs` and `tests.rs` files are whole test modules (moved in from tests/, or a
            // `mod tests` in a file of its own): test code, as a `mod tests`, may spell keys out.
            let test_file = path.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with("tests_") || n == "tests.rs"
            });
            if rel == "support/keys.rs"
                || test_file
                || NOT_YET_SCANNED.iter().any(|p| rel.starts_with(p))
            {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            found.extend(key_literals(
                std::path::Path::new(&format!("src/{rel}")),
                &text,
            ));
        }
        assert!(
            found.is_empty(),
            "Redis key names spelled out outside src/support/keys.rs (build them with a `keys` item):\n{}",
            found.join("\n")
        );
    }

    /// The scan finds the shapes it looks for, in Rust and in Lua, and passes over words that only
    /// look like keys.
    #[test]
    fn the_key_scan_flags_literals_and_passes_over_fields() {
        let p = std::path::Path::new("x.rs");
        let flagged = [
            r#"let k = format!("queue:{name}");"#,
            r#"local k = 'queue:' .. q"#,
            r#"redis.pcall('ZADD', 'dead', score, member)"#,
            r#"pipe.cmd("ZADD").arg("retry").arg(score);"#,
            r#"format!("oxidekiq:alive:{identity}")"#,
            r#"format!("{id}:work")"#,
        ];
        for line in flagged {
            assert_eq!(key_literals(p, line).len(), 1, "{line}");
        }
        let passed = [
            r#"m.insert("retry".into(), Value::Bool(true));"#,
            r#"    .get("queues")"#,
            r#"// the "queue:" prefix"#,
            "let k = keys::queue(name);",
            "#[cfg(test)]\nmod tests {\n    const K: &str = \"queue:a\";",
        ];
        for text in passed {
            assert!(key_literals(p, text).is_empty(), "{text}");
        }
    }
}
