//! sidekiq-cron's Redis layout: finding the schedules, reading their hashes, writing a declared
//! schedule as the gem's `save` writes it, and the bookkeeping after an enqueue.
//!
//! Two layouts, told apart by what the fleet wrote. sidekiq-cron 1.x (Debian's 1.8.0): the set
//! `cron_jobs` whose members are the hashes `cron_job:<name>`. sidekiq-cron 2.x: one set per namespace,
//! `cron_jobs:<namespace>`, members `cron_job:<namespace>:<name>`. In both, a member is the hash's key,
//! and the claim and history keys append `:enqueued` and `:jid_history` to it, so reading and claiming
//! need not know the layout; only writing a new schedule does ([`Layout`]).

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value, json};

pub(crate) use super::entry::DEFAULT_NAMESPACE;
use super::entry::LAST_ENQUEUE_TIME_FORMAT;
use super::{CronJob, Schedule};
use crate::error::Result;
use crate::keys;
use crate::redis_conn::Conn;
use crate::time::score;

/// How many schedules the gem's `jid_history` keeps (`cron_history_size`, 10).
const HISTORY_SIZE: i64 = 10;

/// How long claimed ticks are kept (`REMEMBER_THRESHOLD`, a day).
const REMEMBER_SECS: f64 = 24.0 * 60.0 * 60.0;

/// Where a declared schedule is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `cron_jobs` and `cron_job:<name>` (sidekiq-cron 1.x).
    Plain,
    /// `cron_jobs:default` and `cron_job:default:<name>` (sidekiq-cron 2.x).
    Namespaced,
}

/// How long the walker's turn lasts unless renewed: a walker that dies mid-walk leaves it to expire,
/// and another process walks then.
const WALK_LEASE: Duration = Duration::from_secs(30);

/// How often a walker renews its turn, and how often a process waiting for another's walk looks.
const WALK_RENEW: Duration = Duration::from_secs(1);

/// Ends the walker's turn if it is still its own.
const RELEASE_TURN: &str = r"
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0";

/// What the fleet's namespace walk gave this process.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The sets that hold schedules (`cron_jobs` and every `cron_jobs:<namespace>` found).
    pub(crate) sets: Vec<String>,
    /// How long until the fleet's next walk: look again then.
    pub(crate) fresh_for: Duration,
    /// A key of ours that was no turn or walk of ours (key, why), to be reported once: this process
    /// walked by itself.
    pub(crate) damaged: Option<(&'static str, String)>,
}

/// The sets that hold schedules, walked for once per `interval` by the fleet, not by every process:
/// the process that takes [`keys::CRON_WALK`] walks the keyspace and stores what it found in
/// [`keys::CRON_NAMESPACES`] until the next walk is due; the others read that, and wait (looking every
/// second) while a walk is under way. A key of ours of the wrong type, or holding no walk of ours,
/// makes this process walk by itself (as every process did before), so declared and stored schedules
/// still run. A walk the server refuses (an ACL without `SCAN`) is stored as finding nothing, so the
/// others read only the usual sets instead of waiting for a walk that cannot happen.
pub(crate) async fn shared_schedule_sets(
    conn: &Conn,
    identity: &str,
    interval: Duration,
) -> Result<Shared> {
    let mut c = conn.clone();
    let alone = |damaged: (&'static str, String)| Shared {
        sets: Vec::new(),
        fresh_for: interval,
        damaged: Some(damaged),
    };
    loop {
        let stored: redis::RedisResult<Option<String>> = redis::cmd("GET")
            .arg(keys::CRON_NAMESPACES)
            .query_async(&mut c)
            .await;
        match stored {
            Err(e) if is_connection(&e) => return Err(e.into()),
            Err(e) => {
                // Not "its schedules are not run": this process walks, and every schedule runs.
                let why = format!(
                    "{}; this process walks by itself (delete the key to restore the fleet's \
                     shared walk)",
                    unreadable(conn, keys::CRON_NAMESPACES, "string", &e).await
                );
                let mut s = alone((keys::CRON_NAMESPACES, why));
                s.sets = walk(conn, false).await?;
                return Ok(s);
            }
            Ok(Some(text)) => {
                let Ok(sets) = serde_json::from_str::<Vec<String>>(&text) else {
                    let mut s = alone((
                        keys::CRON_NAMESPACES,
                        "holds no list of sets written by oxidekiq; this process walks by itself"
                            .to_string(),
                    ));
                    s.sets = walk(conn, false).await?;
                    return Ok(s);
                };
                let ttl: i64 = match redis::cmd("PTTL")
                    .arg(keys::CRON_NAMESPACES)
                    .query_async(&mut c)
                    .await
                {
                    Ok(ttl) => ttl,
                    Err(e) if is_connection(&e) => return Err(e.into()),
                    Err(e) => return walk_alone(conn, interval, keys::CRON_NAMESPACES, &e).await,
                };
                let fresh_for = match u64::try_from(ttl) {
                    // Read until it expires, it would hide a namespace created meanwhile for longer
                    // than the interval (a year, for one written with `EX 31536000`): oxidekiq
                    // writes it for one interval (review of issue 43).
                    Ok(ms) if u128::from(ms) > interval.as_millis() => {
                        let mut s = alone((
                            keys::CRON_NAMESPACES,
                            format!(
                                "expires in {ms} ms, later than the next walk is due ({} ms); \
                                 this process walks by itself (delete the key to restore the \
                                 fleet's shared walk)",
                                interval.as_millis()
                            ),
                        ));
                        s.sets = walk(conn, false).await?;
                        return Ok(s);
                    }
                    Ok(ms) => Duration::from_millis(ms) + WALK_RENEW,
                    // Gone meanwhile: look again in a second.
                    Err(_) if ttl == -2 => WALK_RENEW,
                    // Without a TTL it would never expire, and no process would walk again.
                    Err(_) => {
                        let mut s = alone((
                            keys::CRON_NAMESPACES,
                            "has no TTL, as oxidekiq always writes it; this process walks by \
                             itself (delete the key to restore the fleet's shared walk)"
                                .to_string(),
                        ));
                        s.sets = walk(conn, false).await?;
                        return Ok(s);
                    }
                };
                let mut sets = sets;
                sets.retain(|s| s == keys::CRON_JOBS || s.starts_with("cron_jobs:"));
                return Ok(Shared {
                    sets,
                    fresh_for,
                    damaged: None,
                });
            }
            Ok(None) => {}
        }
        let took: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(keys::CRON_WALK)
            .arg(identity)
            .arg("NX")
            .arg("PX")
            .arg(WALK_LEASE.as_millis() as u64)
            .query_async(&mut c)
            .await;
        match took {
            Err(e) if is_connection(&e) => return Err(e.into()),
            Err(e) => {
                let mut s = alone((
                    keys::CRON_WALK,
                    format!("could not be taken ({e}); this process walks by itself"),
                ));
                s.sets = walk(conn, false).await?;
                return Ok(s);
            }
            Ok(Some(_)) => {
                let found = walk(conn, true).await;
                let stored = match &found {
                    Ok(sets) => Some(sets.clone()),
                    Err(e) if !e.is_connection_error() => Some(Vec::new()),
                    Err(_) => None,
                };
                if let Some(sets) = stored {
                    let text = serde_json::to_string(&sets).unwrap_or_else(|_| "[]".into());
                    // Stored for at most the default interval, whatever this process's (a poll
                    // interval above 600 s makes its own longer): a longer TTL is what the others
                    // take for a damaged key, and a fleet of mixed settings must not see one.
                    let ttl = interval.min(super::NAMESPACE_SCAN_INTERVAL);
                    let _: redis::RedisResult<()> = redis::cmd("SET")
                        .arg(keys::CRON_NAMESPACES)
                        .arg(text)
                        .arg("PX")
                        .arg(ttl.as_millis().max(1) as u64)
                        .query_async(&mut c)
                        .await;
                }
                // The stored walk now says when the next is due: the turn ends with the walk, or
                // the fleet would wait for its lease when the stored walk expires.
                let _: redis::RedisResult<i64> = redis::Script::new(RELEASE_TURN)
                    .key(keys::CRON_WALK)
                    .arg(identity)
                    .invoke_async(&mut c)
                    .await;
                return found.map(|sets| Shared {
                    sets,
                    fresh_for: interval,
                    damaged: None,
                });
            }
            Ok(None) => {
                // Another process walks, unless the turn is no turn of ours: every turn is a
                // string with a TTL of at most the lease, and any other key there would stop every
                // walk of the fleet for as long as it lasts.
                let kind: String = match redis::cmd("TYPE")
                    .arg(keys::CRON_WALK)
                    .query_async(&mut c)
                    .await
                {
                    Ok(kind) => kind,
                    Err(e) if is_connection(&e) => return Err(e.into()),
                    Err(e) => return walk_alone(conn, interval, keys::CRON_WALK, &e).await,
                };
                let ttl: i64 = match redis::cmd("PTTL")
                    .arg(keys::CRON_WALK)
                    .query_async(&mut c)
                    .await
                {
                    Ok(ttl) => ttl,
                    Err(e) if is_connection(&e) => return Err(e.into()),
                    Err(e) => return walk_alone(conn, interval, keys::CRON_WALK, &e).await,
                };
                let lease = WALK_LEASE.as_millis() as i64;
                if kind != "none" && (kind != "string" || ttl == -1 || ttl > lease) {
                    let mut s = alone((
                        keys::CRON_WALK,
                        format!(
                            "is a {kind} with a TTL of {ttl} ms, not a turn of oxidekiq's (a string \
                             expiring within {lease} ms); this process walks by itself (delete the \
                             key to restore the fleet's shared walk)"
                        ),
                    ));
                    s.sets = walk(conn, false).await?;
                    return Ok(s);
                }
                if ttl != -2 {
                    tokio::time::sleep(WALK_RENEW).await;
                }
            }
        }
    }
}

/// A look at `key` refused (an ACL without `TYPE` or `PTTL`, which the poller did not need before
/// the shared walk): reported, and this process walks by itself, as for a damaged key (review of
/// issue 43: the refusal failed the look, and only `cron_jobs` and `cron_jobs:default` were read).
async fn walk_alone(
    conn: &Conn,
    interval: Duration,
    key: &'static str,
    e: &redis::RedisError,
) -> Result<Shared> {
    Ok(Shared {
        sets: walk(conn, false).await?,
        fresh_for: interval,
        damaged: Some((
            key,
            format!("could not be looked at ({e}); this process walks by itself"),
        )),
    })
}

/// The sets that hold schedules: `cron_jobs` and every `cron_jobs:<namespace>` that exists (found by
/// `SCAN`, as 2.x's `available_namespaces = :auto` finds them with `KEYS`). A walker holding the
/// fleet's turn (`lease`) renews the turn while it walks.
async fn walk(conn: &Conn, lease: bool) -> Result<Vec<String>> {
    let mut sets = vec![keys::CRON_JOBS.to_string()];
    let mut cursor: u64 = 0;
    let mut renewed = tokio::time::Instant::now();
    loop {
        if lease && renewed.elapsed() >= WALK_RENEW {
            let _: redis::RedisResult<()> = redis::cmd("PEXPIRE")
                .arg(keys::CRON_WALK)
                .arg(WALK_LEASE.as_millis() as u64)
                .query_async(&mut conn.clone())
                .await;
            renewed = tokio::time::Instant::now();
        }
        // A name that is not UTF-8 is no namespace of the gem's (its namespaces are Ruby strings)
        // and is skipped: read as text, it failed the whole walk, stored for the fleet as finding
        // nothing (review of issue 43).
        let (next, found): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(keys::CRON_JOBS_NAMESPACED)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn.clone())
            .await?;
        sets.extend(found.into_iter().filter_map(|k| String::from_utf8(k).ok()));
        if next == 0 {
            break;
        }
        cursor = next;
    }
    sets.sort();
    sets.dedup();
    Ok(sets)
}

/// The sets a round reads: those found, and always `cron_jobs` and `cron_jobs:default`, so schedules
/// of the two usual sets are seen at once, whatever the last scan found.
pub(crate) fn sets_to_read(mut found: Vec<String>) -> Vec<String> {
    found.push(keys::CRON_JOBS.to_string());
    found.push(keys::cron_jobs_in(DEFAULT_NAMESPACE));
    found.sort();
    found.dedup();
    found
}

/// The layout a new schedule is written in: namespaced when the fleet already has a namespaced set.
pub(crate) fn layout_of(sets: &[String]) -> Layout {
    if sets.iter().any(|s| s != keys::CRON_JOBS) {
        Layout::Namespaced
    } else {
        Layout::Plain
    }
}

/// What a read of the schedules found: each hash as (key, fields), and the keys that could not be
/// read, with why (a set or a hash of the wrong type, a key that is not UTF-8); those are passed over,
/// so one bad key stops no other schedule, and the caller reports each once.
#[derive(Debug, Default)]
pub(crate) struct Loaded {
    /// The schedules' hashes.
    pub(crate) hashes: Vec<(String, HashMap<String, String>)>,
    /// (key, what is wrong with it).
    pub(crate) problems: Vec<(String, String)>,
}

/// Every schedule hash of `sets` (`Job.all`: `SMEMBERS`, then one `HGETALL` per member, pipelined).
/// Field values that are not UTF-8 are read lossily (the schedule then fails to parse, or runs with
/// the replacement character in a text field), never failing the whole read.
pub(crate) async fn load(conn: &Conn, sets: &[String]) -> Result<Loaded> {
    let mut loaded = Loaded::default();
    let mut members: Vec<String> = Vec::new();
    for set in sets {
        match redis::cmd("SMEMBERS")
            .arg(set)
            .query_async::<Vec<Vec<u8>>>(&mut conn.clone())
            .await
        {
            Ok(found) => {
                for m in found {
                    match String::from_utf8(m) {
                        Ok(m) => members.push(m),
                        Err(e) => loaded.problems.push((
                            set.clone(),
                            format!(
                                "holds a member that is not UTF-8 ({:?}); that schedule is not run",
                                String::from_utf8_lossy(e.as_bytes())
                            ),
                        )),
                    }
                }
            }
            Err(e) if !is_connection(&e) => loaded.problems.push((
                set.clone(),
                refused(conn, set, "set of cron schedules", &e).await,
            )),
            Err(e) => return Err(e.into()),
        }
    }
    read_hashes(conn, members, loaded).await
}

/// The schedule hashes `keys` (one `HGETALL` each, pipelined): the schedules a round finds due between
/// two whole reads (issue 43: every round read every schedule, 10 000 `HGETALL` a second for 10 000
/// schedules of which one ticked every 2 s).
pub(crate) async fn load_keys(conn: &Conn, keys: Vec<String>) -> Result<Loaded> {
    read_hashes(conn, keys, Loaded::default()).await
}

/// `members`' hashes added to `loaded`.
async fn read_hashes(conn: &Conn, mut members: Vec<String>, mut loaded: Loaded) -> Result<Loaded> {
    members.sort();
    members.dedup();
    if members.is_empty() {
        return Ok(loaded);
    }
    let mut pipe = redis::pipe();
    for m in &members {
        pipe.cmd("HGETALL").arg(m);
    }
    type Raw = HashMap<Vec<u8>, Vec<u8>>;
    let hashes: Vec<Raw> = match pipe.query_async(&mut conn.clone()).await {
        Ok(h) => h,
        // The server refused a command of the pipeline (redis-rs wraps a `WRONGTYPE` in a pipeline
        // failure): a member is not a hash. Read them one by one to pass over just that one.
        Err(e) if !is_connection(&e) => {
            let mut out = Vec::with_capacity(members.len());
            for m in &members {
                match redis::cmd("HGETALL")
                    .arg(m)
                    .query_async(&mut conn.clone())
                    .await
                {
                    Ok(h) => out.push(h),
                    Err(e) if !is_connection(&e) => {
                        let why = refused(conn, m, "cron schedule hash", &e).await;
                        loaded.problems.push((m.clone(), why));
                        out.push(Raw::new());
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            out
        }
        Err(e) => return Err(e.into()),
    };
    // A member whose hash is gone (destroyed between the two reads) is skipped, as `Job.all` does.
    loaded.hashes = members
        .into_iter()
        .zip(hashes)
        .filter(|(_, h)| !h.is_empty())
        .map(|(key, raw)| {
            let text = |b: Vec<u8>| {
                String::from_utf8(b)
                    .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
            };
            (
                key,
                raw.into_iter().map(|(k, v)| (text(k), text(v))).collect(),
            )
        })
        .collect();
    Ok(loaded)
}

/// A dropped, refused or timed-out connection (retry the round), as opposed to the server refusing a
/// command.
fn is_connection(e: &redis::RedisError) -> bool {
    e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() || e.is_io_error()
}

/// Why the server refused to read `key`, which should be a `expected`: its type when it is another
/// (`WRONGTYPE`), else the server's error (an ACL denial, ...).
async fn refused(conn: &Conn, key: &str, expected: &str, e: &redis::RedisError) -> String {
    format!(
        "{}; its cron schedules are not run",
        unreadable(conn, key, expected, e).await
    )
}

/// What is wrong with `key`, which could not be read as `expected`: its type, or the error.
async fn unreadable(conn: &Conn, key: &str, expected: &str, e: &redis::RedisError) -> String {
    if e.code() != Some("WRONGTYPE") {
        return format!("could not be read ({e})");
    }
    let kind: String = redis::cmd("TYPE")
        .arg(key)
        .query_async(&mut conn.clone())
        .await
        .unwrap_or_else(|_| "unknown".into());
    format!("is a {kind}, not a {expected}")
}

/// Writes a declared schedule as the gem's `save` does (`job.rb`): the hash with every field of
/// `to_hash`, its key in the layout's set, and, unless the schedule already has claimed ticks, the
/// tick before `now` claimed, so a new schedule does not enqueue at once. The status in Redis is kept
/// unless the declaration sets one, so a schedule disabled on the Cron tab stays disabled across a
/// restart; `last_enqueue_time` is kept too. One script: a schedule is never half written.
pub(crate) async fn save(
    conn: &Conn,
    job: &CronJob,
    layout: Layout,
    now: DateTime<Utc>,
) -> Result<()> {
    let schedule = Schedule::parse(&job.cron).map_err(crate::error::Error::Config)?;
    let (set, namespace) = match layout {
        Layout::Plain => (keys::CRON_JOBS.to_string(), None),
        Layout::Namespaced => (
            keys::cron_jobs_in(DEFAULT_NAMESPACE),
            Some(DEFAULT_NAMESPACE),
        ),
    };
    let key = keys::cron_job(namespace, &job.name);
    let tick = schedule
        .previous_time(now)
        .map_err(crate::error::Error::Config)?;
    let status = match job.enabled {
        Some(true) => "enabled",
        Some(false) => "disabled",
        None => "",
    };
    let mut fields: Vec<(&str, String)> = vec![
        ("name", job.name.clone()),
        ("klass", job.class.clone()),
        ("cron", job.cron.clone()),
        ("description", job.description.clone().unwrap_or_default()),
        ("args", Value::Array(job.args.clone()).to_string()),
        ("date_as_argument", job.date_as_argument.to_string()),
        ("message", message(job).to_string()),
        ("active_job", job.active_job.to_string()),
        (
            "queue_name_prefix",
            job.queue_name_prefix.clone().unwrap_or_default(),
        ),
        (
            "queue_name_delimiter",
            job.queue_name_delimiter.clone().unwrap_or_default(),
        ),
        ("symbolize_args", "false".into()),
    ];
    if let Some(ns) = namespace {
        fields.push(("namespace", ns.to_string()));
    }
    let claim = super::entry::claim_of(&key, tick);
    let mut inv = SAVE.prepare_invoke();
    inv.key(&set)
        .key(&key)
        .key(&claim.key)
        .arg(score(crate::time::now()))
        .arg(&claim.member)
        .arg(status);
    for (k, v) in &fields {
        inv.arg(*k).arg(v);
    }
    inv.invoke_async::<()>(&mut conn.clone()).await?;
    Ok(())
}

/// The `message` the gem builds for a class it cannot load: `{"queue":..,"class":..,"args":..}`, and
/// the declared options as a class's `sidekiq_options` would add them.
fn message(job: &CronJob) -> Value {
    let mut m = Map::new();
    m.insert(
        "queue".into(),
        json!(job.queue.as_deref().unwrap_or("default")),
    );
    for (k, v) in &job.options {
        if !matches!(k.as_str(), "queue" | "class" | "args") {
            m.insert(k.clone(), v.clone());
        }
    }
    m.insert("class".into(), json!(job.class));
    m.insert("args".into(), Value::Array(job.args.clone()));
    Value::Object(m)
}

/// KEYS[1] the set, KEYS[2] the hash, KEYS[3] its claimed ticks; ARGV[1] now's score, ARGV[2] the tick
/// before now, ARGV[3] the declared status or '' to keep Redis's, then field/value pairs.
const SAVE_SCRIPT: &str = r"
redis.call('SADD', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], 'status', ARGV[3])
else
  redis.call('HSETNX', KEYS[2], 'status', 'enabled')
end
redis.call('HSETNX', KEYS[2], 'last_enqueue_time', '')
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('ZADD', KEYS[3], ARGV[1], ARGV[2])
end
return 1
";

/// The script, sent by SHA1 with the body as fallback on `NOSCRIPT`.
static SAVE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(SAVE_SCRIPT));

/// What the gem writes after an enqueue (`save_last_enqueue_time`, `add_jid_history`,
/// `remove_previous_enques`): the enqueue time, the jid at the head of the history (kept to 10), and
/// claimed ticks older than a day removed, in the `twin`'s claim set too (the claimed push adds to it,
/// and its own poller may never enqueue to trim it). The job is already in its queue: a failure here
/// is logged by the caller and changes nothing about which tick ran.
pub(crate) async fn after_enqueue(
    conn: &Conn,
    job_key: &str,
    twin: Option<&str>,
    jid: &str,
    now: DateTime<Utc>,
) -> Result<()> {
    let at = now.format(LAST_ENQUEUE_TIME_FORMAT).to_string();
    let history = json!({"jid": jid, "enqueued": at}).to_string();
    let secs = crate::time::epoch_secs(now);
    let mut pipe = redis::pipe();
    pipe.cmd("HSET")
        .arg(job_key)
        .arg("last_enqueue_time")
        .arg(&at)
        .ignore();
    pipe.cmd("LPUSH")
        .arg(keys::cron_jid_history(job_key))
        .arg(history)
        .ignore();
    pipe.cmd("LTRIM")
        .arg(keys::cron_jid_history(job_key))
        .arg(0)
        .arg(HISTORY_SIZE - 1)
        .ignore();
    for key in std::iter::once(job_key).chain(twin) {
        pipe.cmd("ZREMRANGEBYSCORE")
            .arg(keys::cron_enqueued(key))
            .arg(0)
            .arg(format!("({}", score(secs - REMEMBER_SECS)))
            .ignore();
    }
    pipe.query_async::<()>(&mut conn.clone()).await?;
    Ok(())
}
