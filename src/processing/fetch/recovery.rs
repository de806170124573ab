//! Orphan recovery for reliable fetch: the batch lists of processes that died go back to their queues,
//! and so do the working keys of processes of older releases (the last release's batch lists under
//! `oxidekiq:working:`, the working hashes before them) and landing lists (an upgrade or a roll back in
//! the middle of a fleet loses nothing).
//!
//! Whether a process is dead is decided inside the script, by Redis's clock, with a grace that lets a
//! process which merely could not beat (a Redis stall) reclaim its liveness key ([`mark_alive`]) and keep
//! its jobs. A count per payload sends a job that kills every process it touches to the dead set instead
//! of looping.

use std::sync::Arc;
use std::time::Duration;

use redis::{AsyncCommands, Script};

use crate::error::Result;
use crate::fleet::Fleet;
use crate::keys::{self, BATCH_SUSPECTS, HOLDERS, RECOVERED, SUSPECTS};
use crate::lua::{dead_trim, lua_common};
use crate::redis_conn::Conn;
use crate::shutdown::ShutdownSignal;
use crate::time::{self, TimeFormat, score};

/// How often one payload may be recovered from a dead process before it goes to the dead set.
pub(crate) const MAX_RECOVERIES: i64 = 3;

/// Lifetime of the recovery lock, renewed once after the key scan.
const RECOVERY_LOCK_TTL: Duration = Duration::from_secs(30);

/// Keys asked of each SCAN step of a recovery pass.
const SCAN_COUNT: usize = 1000;

/// Orphan recovery of one process, deciding inside the script whether it is dead. KEYS[1] is its liveness
/// key, KEYS[2] the hash of suspects (`suspects_of`; identity → Redis time in ms when first seen without a liveness key),
/// KEYS[3] the recovery counts, KEYS[4] the dead set, KEYS[5] its index of held lists
/// ([`keys::held_index`]), KEYS[6] [`HOLDERS`], then fours (held key: a batch list, a working hash of
/// an older version or a landing list; its acks set, or the key itself when it has none; the queue its
/// name gives as a batch list; the queue its name gives as a hash or landing list; see `move_back`): the
/// keys found by the SCAN in Rust, passed here whole. ARGV: grace in ms, recovery limit, dead score,
/// `failed_at` text, dead trim score, dead max size, identity, and the suspect mark kept by the caller
/// when the suspects hash cannot be used (a key of the wrong type: `m` for no mark yet, `m<ms>` for a
/// mark; empty when the hash is used), and one letter per held key, `d` for a batch list of this release
/// (its head served first), `a` for any other key (see `move_back`). A process whose key exists is alive (its suspect mark goes); one
/// first seen without it is only marked; only one still without it a grace later (measured by Redis's
/// own clock) has its jobs pushed back. So a process that merely could not beat (a Redis stall longer
/// than the TTL) re-sets its key on its next beat and keeps its jobs. Returns {state (0 alive, 1
/// suspect, 2 recovered), moved, killed, error, Redis time in ms, a damaged liveness key ('' if
/// none)}. A liveness key that is not a string with a TTL (every one is written by `PSETEX`) counts as
/// gone, reported, so a damaged one cannot keep a dead process's jobs in its keys for good. A process
/// recovered without an error leaves the holders, and its index goes, in the same script.
const ORPHAN_LUA: &str = concat!(
    lua_common!(),
    super::lua_move_back!(),
    r#"
-- TIME before writes needs effects replication (the only mode from Redis 7; opt-in before 5).
if redis.replicate_commands then redis.replicate_commands() end
local who = ARGV[7]
local mem = ARGV[8] ~= ''
-- Every liveness key is a string with a TTL (PSETEX); anything else there is no sign of life, or the
-- process's jobs would stay in its keys for good. It is reported (6th reply) and judged as absent.
local ttl, alive_kind = redis.call('PTTL', KEYS[1]), kind(KEYS[1])
local damaged = ''
if ttl >= 0 and alive_kind == 'string' then
  if not mem then redis.call('HDEL', KEYS[2], who) end
  return {0, 0, 0, '', 0, ''}
elseif ttl ~= -2 then
  damaged = KEYS[1] .. ' is a ' .. alive_kind .. ' with ' .. (ttl == -1 and 'no TTL' or 'a TTL') .. ', not the string with a TTL every liveness key is'
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local since
if mem then since = tonumber(string.sub(ARGV[8], 2)) else since = tonumber(redis.call('HGET', KEYS[2], who)) end
if not since then
  if not mem then redis.call('HSET', KEYS[2], who, string.format('%d', now_ms)) end
  return {1, 0, 0, '', now_ms, damaged}
end
if now_ms - since < tonumber(ARGV[1]) then return {1, 0, 0, '', now_ms, damaged} end
local limit = tonumber(ARGV[2])
local moved, killed, errs = 0, 0, {}
local n = 0
for i = 7, #KEYS, 4 do
  n = n + 1
  local desc = string.sub(ARGV[9], n, n) == 'd'
  local m, k, err = move_back(KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3], desc, limit, KEYS[3], KEYS[4], ARGV[3], ARGV[5], tonumber(ARGV[6]), ARGV[4],
    'sent to the dead set so it does not take down another process (last owner ' .. who .. ')')
  moved = moved + m
  killed = killed + k
  if err then errs[#errs + 1] = err end
end
if #errs == 0 then
  if not mem then redis.call('HDEL', KEYS[2], who) end
  redis.pcall('DEL', KEYS[5])
  redis.pcall('SREM', KEYS[6], who)
end
return {2, moved, killed, table.concat(errs, '; '), now_ms, damaged}
"#
);

/// Marks `identity` alive for `ttl`. False when the key had expired (a Redis stall or a pause longer
/// than the TTL): this reclaims it, and the process keeps its jobs unless it stayed away past the grace
/// of [`recover_orphans`]. It also clears its own suspect mark: a mark left from an earlier absence that
/// no recovery pass saw end would otherwise date a later absence from the first one, and take the jobs
/// of a process that is away again only briefly without any grace.
pub(crate) async fn mark_alive(conn: &mut Conn, identity: &str, ttl: Duration) -> Result<bool> {
    let ms = ttl.as_millis().max(1000) as u64;
    let key = keys::alive(identity);
    // Each reply on its own: a suspects hash of the wrong type must not make the liveness write look
    // failed (it ran), only be reported.
    let replies: Vec<redis::RedisResult<redis::Value>> = redis::pipe()
        .ignore_errors()
        .exists(&key)
        .pset_ex(&key, 1, ms)
        .hdel(SUSPECTS, identity)
        .hdel(BATCH_SUSPECTS, identity)
        .sadd(HOLDERS, identity)
        .query_async(conn)
        .await?;
    let mut replies = replies.into_iter();
    let existed = replies
        .next()
        .transpose()?
        .map(redis::from_redis_value::<bool>);
    if let Some(Err(e)) = replies.next() {
        return Err(e.into());
    }
    for key in [SUSPECTS, BATCH_SUSPECTS, HOLDERS] {
        if let Some(Err(e)) = replies.next()
            && first_report(&format!("{key} {e}"))
        {
            report_damaged(conn, key, &e.to_string()).await;
        }
    }
    Ok(existed
        .transpose()
        .map_err(redis::RedisError::from)?
        .unwrap_or(false))
}

/// Logs at error level a key of ours that recovery cannot use, with its type.
async fn report_damaged(conn: &mut Conn, key: &str, what: &str) {
    let kind = key_type(conn, key)
        .await
        .unwrap_or_else(|_| "unknown".into());
    tracing::error!(key, key_type = %kind, error = what,
        "orphan recovery: a key of oxidekiq's has the wrong type; recovery goes on without it \
         (delete the key to restore it)");
}

/// Errors already logged by this process's recovery passes: a damaged key is named once at error level,
/// not at every pass (every two beats, in every process). Bounded: forgotten past 10 000.
static REPORTED: std::sync::LazyLock<std::sync::Mutex<foldhash::HashSet<String>>> =
    std::sync::LazyLock::new(Default::default);

/// True the first time `text` is reported.
fn first_report(text: &str) -> bool {
    let Ok(mut seen) = REPORTED.lock() else {
        return true;
    };
    if seen.len() >= 10_000 {
        seen.clear();
    }
    seen.insert(text.to_string())
}

/// The members (or key names) of `raw` that are text: one that is not UTF-8 is no key or identity of
/// oxidekiq's, and is named once and skipped, so it costs only itself (read as text, the whole reply
/// failed: one such member of the holders set stopped every pass by index of the fleet, one in an index
/// lost its process's real lists, one key name failed every walk).
fn text_only(raw: Vec<Vec<u8>>, key: &str) -> Vec<String> {
    raw.into_iter()
        .filter_map(|m| match String::from_utf8(m) {
            Ok(t) => Some(t),
            Err(e) => {
                let shown = crate::redact::clip(&String::from_utf8_lossy(e.as_bytes()), 200)
                    .into_owned();
                if first_report(&format!("{key} not UTF-8 {shown}")) {
                    tracing::error!(key, member = %shown,
                        "orphan recovery: a member or key name that is not UTF-8 is no key of oxidekiq's; \
                         skipped (reported once)");
                }
                None
            }
        })
        .collect()
}

/// `TYPE key`.
async fn key_type(conn: &mut Conn, key: &str) -> Result<String> {
    Ok(redis::cmd("TYPE").arg(key).query_async(conn).await?)
}

/// Suspect marks kept in memory while the suspects hash has the wrong type: identity → (Redis time in
/// ms when this process first saw it without its liveness key, when this process last saw it so).
/// Process-wide, as the hash is Redis-wide; each process that runs a pass judges by its own marks, so
/// a dead process's jobs still go back one grace after the first pass that saw it, and a merely
/// stalled one keeps them. The suspect cannot clear a mark in another process's memory (its beat
/// clears the hash's), so a mark not seen again within two graces is stale: the absence it dated may
/// have ended since, and a new one starts its own grace. (Two, not one: each process runs its own
/// passes, a little over a grace apart at most, and a pass missed to another's lock must not reset it.)
static MEMORY_MARKS: std::sync::LazyLock<std::sync::Mutex<Marks>> =
    std::sync::LazyLock::new(Default::default);

/// [`MEMORY_MARKS`]' map.
type Marks = std::collections::HashMap<String, (u64, tokio::time::Instant)>;

/// What of recovery's own bookkeeping can be used in this pass.
#[derive(Debug, Clone, Copy)]
struct Bookkeeping {
    /// `oxidekiq:suspects` and `oxidekiq:suspects:batch` are hashes (or absent): marks go there, else in
    /// [`MEMORY_MARKS`].
    suspects: bool,
    /// `oxidekiq:recovered` and `dead` are usable: a job recovered too often goes to the dead set.
    /// Without them every job is pushed back, uncounted (a job that kills every process it touches then
    /// loops, which is better than stranding every job of the dead process).
    counts: bool,
}

/// Checks the types of the keys a pass writes, reporting each damaged one.
async fn bookkeeping(conn: &mut Conn) -> Result<Bookkeeping> {
    let (suspects, batch_suspects, recovered, dead): (String, String, String, String) =
        redis::pipe()
            .cmd("TYPE")
            .arg(SUSPECTS)
            .cmd("TYPE")
            .arg(BATCH_SUSPECTS)
            .cmd("TYPE")
            .arg(RECOVERED)
            .cmd("TYPE")
            .arg(keys::DEAD)
            .query_async(conn)
            .await?;
    let ok = |key: &str, kind: &str, want: &str| {
        let fine = kind == want || kind == "none";
        if !fine {
            tracing::error!(key, key_type = %kind,
                "orphan recovery: {key} is a {kind}, not a {want}; recovery goes on without it (delete \
                 or repair the key to restore it)");
        }
        fine
    };
    let suspects = ok(SUSPECTS, &suspects, "hash") & ok(BATCH_SUSPECTS, &batch_suspects, "hash");
    let counts = ok(RECOVERED, &recovered, "hash") & ok(keys::DEAD, &dead, "zset");
    Ok(Bookkeeping { suspects, counts })
}

/// What [`recover_orphans`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recovered {
    /// Jobs pushed back to their queues.
    pub requeued: u64,
    /// Jobs sent to the dead set after too many recoveries.
    pub killed: u64,
    /// Processes seen without a liveness key, not yet past the grace.
    pub suspects: u64,
}

/// How orphan recovery judges and annotates.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecoveryPolicy {
    /// How long a process must stay without its liveness key (by Redis's clock) before its jobs are
    /// taken; at least the liveness TTL, so a process that could only not beat reclaims its key first.
    pub grace: Duration,
    /// How `failed_at` is written on a job sent to the dead set.
    pub time_format: TimeFormat,
}

impl Default for RecoveryPolicy {
    fn default() -> Self {
        RecoveryPolicy {
            grace: Duration::from_secs(15),
            time_format: TimeFormat::Seconds,
        }
    }
}

/// Pushes back the jobs of every process found dead inside the recovery script (see [`ORPHAN_LUA`]).
/// One process at a time does it (`SET oxidekiq:recovery-lock <identity> NX PX 30000`, renewed after the
/// key scan, released by compare-and-delete); returns `None` when another process holds that lock.
pub(crate) async fn recover_orphans(
    conn: &mut Conn,
    own_identity: &str,
    now: f64,
    policy: RecoveryPolicy,
) -> Result<Option<Recovered>> {
    let mut watch = Vec::new();
    recover_found(conn, own_identity, now, policy, Find::Scan(&mut watch)).await
}

/// [`recover_orphans`], finding the held keys as `find` says.
pub(crate) async fn recover_found(
    conn: &mut Conn,
    own_identity: &str,
    now: f64,
    policy: RecoveryPolicy,
    find: Find<'_>,
) -> Result<Option<Recovered>> {
    let got: Option<String> = redis::cmd("SET")
        .arg(keys::RECOVERY_LOCK)
        .arg(own_identity)
        .arg("NX")
        .arg("PX")
        .arg(RECOVERY_LOCK_TTL.as_millis() as u64)
        .query_async(conn)
        .await?;
    if got.is_none() {
        // Held, unless the key is no lock of ours: every lock this code takes is a string with a TTL.
        // Anything else would stop recovery for good, so the pass goes on without the lock (each
        // process's jobs still move in one script, so two passes at once never move a job twice).
        let kind = key_type(conn, keys::RECOVERY_LOCK).await?;
        let ttl: i64 = redis::cmd("PTTL")
            .arg(keys::RECOVERY_LOCK)
            .query_async(conn)
            .await?;
        if kind == "none" || (kind == "string" && ttl != -1) {
            return Ok(None);
        }
        // Named once, not at every pass of every process (review of issue 43).
        if first_report(&format!("{} {kind} {}", keys::RECOVERY_LOCK, ttl == -1)) {
            tracing::error!(key = keys::RECOVERY_LOCK, key_type = %kind, ttl_ms = ttl,
                "orphan recovery: {} is a {kind} without the TTL its lock always has: not a lock of \
                 oxidekiq's; recovering without the lock (delete the key to restore it; reported \
                 once)", keys::RECOVERY_LOCK);
        }
        return recover_locked(conn, own_identity, now, policy, false, find)
            .await
            .map(Some);
    }
    let result = recover_locked(conn, own_identity, now, policy, true, find).await;
    // Compare-and-delete: a pass that outlasted the lock's 30 s must not free another process's lock.
    let _ = crate::lock::release(conn, keys::RECOVERY_LOCK, own_identity).await;
    result.map(Some)
}

/// Where a held key found by the scan lives.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// `oxidekiq:batch:`: this release's batch lists.
    Batch,
    /// `oxidekiq:working:`: the last release's batch lists and older releases' working hashes.
    Working,
    /// `oxidekiq:landing:`: landing lists.
    Landing,
}

/// One held key of a process found by the scan.
#[derive(Debug)]
struct HeldKey {
    /// The key.
    key: String,
    /// Its acks set (the key itself when it has none).
    acks: String,
    /// The queue a batch list goes back to.
    queue: String,
    /// The queue a working hash or landing list goes back to.
    hash_queue: String,
    /// A batch list of this release (`oxidekiq:batch:`): its head was served first. The last release's
    /// batch lists (`oxidekiq:working:`) keep their queue's order (their tail was served first).
    serve_order: bool,
}

/// Every batch list, working key (of older releases) and landing list in Redis, found by one walk of the
/// keyspace (`SCAN MATCH`).
async fn held_by_others(conn: &mut Conn) -> Result<Vec<String>> {
    let mut held: Vec<Vec<u8>> = Vec::new();
    // COUNT 1000, not the default 10: a pass walks the whole keyspace, which may hold millions of
    // unrelated keys (a million took 190 000 round trips at 10, about a thousand at 1000), and each SCAN
    // step stays short for Redis.
    let opts = redis::ScanOptions::default()
        .with_pattern(keys::HELD_PATTERN)
        .with_count(SCAN_COUNT);
    let mut iter: redis::AsyncIter<'_, Vec<u8>> = conn.scan_options(opts).await?;
    while let Some(item) = iter.next_item().await {
        held.push(item?);
    }
    drop(iter);
    Ok(text_only(held, keys::HELD_PATTERN))
}

/// The processes of [`HOLDERS`] but this one whose liveness key is not a live one (gone, or not the
/// string with a TTL every liveness key is: the script judges those), each with the keys its index
/// ([`keys::held_index`]) names. What this costs follows the processes and the lists of the dead ones,
/// whatever else Redis holds. A damaged holders set or index is reported once and costs only what it
/// names: the keyspace scan still finds those keys.
async fn held_by_dead_holders(conn: &mut Conn, own_identity: &str) -> Result<DeadHolders> {
    let holders: Vec<String> = match redis::cmd("SMEMBERS").arg(HOLDERS).query_async(conn).await {
        Ok(h) => text_only(h, HOLDERS),
        Err(e) => {
            let e = crate::Error::from(e);
            if e.is_outage() {
                return Err(e);
            }
            if first_report(&format!("{HOLDERS} {e}")) {
                report_damaged(conn, HOLDERS, &e.to_string()).await;
            }
            return Ok(DeadHolders {
                holders_unreadable: true,
                ..DeadHolders::default()
            });
        }
    };
    let others: Vec<String> = holders.into_iter().filter(|h| h != own_identity).collect();
    if others.is_empty() {
        return Ok(DeadHolders::default());
    }
    let mut pipe = redis::pipe();
    for id in &others {
        let alive = keys::alive(id);
        pipe.cmd("PTTL").arg(&alive).cmd("TYPE").arg(&alive);
    }
    let states: Vec<(i64, String)> = {
        let flat: Vec<redis::Value> = pipe.query_async(conn).await?;
        flat.chunks(2)
            .map(|p| {
                let ttl = redis::from_redis_value::<i64>(p[0].clone()).unwrap_or(-2);
                let kind = redis::from_redis_value::<String>(p[1].clone()).unwrap_or_default();
                (ttl, kind)
            })
            .collect()
    };
    let dead: Vec<String> = others
        .into_iter()
        .zip(states)
        .filter(|(_, (ttl, kind))| !(*ttl >= 0 && kind == "string"))
        .map(|(id, _)| id)
        .collect();
    if dead.is_empty() {
        return Ok(DeadHolders::default());
    }
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    for id in &dead {
        pipe.smembers(keys::held_index(id));
    }
    let replies: Vec<redis::RedisResult<Vec<Vec<u8>>>> = {
        let raw: Vec<redis::RedisResult<redis::Value>> = pipe.query_async(conn).await?;
        raw.into_iter()
            .map(|r| r.and_then(|v| redis::from_redis_value(v).map_err(redis::RedisError::from)))
            .collect()
    };
    let mut held = Vec::new();
    for (id, r) in dead.iter().zip(replies) {
        match r {
            Ok(keys) => held.extend(text_only(keys, &keys::held_index(id))),
            Err(e) => {
                let index = keys::held_index(id);
                if first_report(&format!("{index} {e}")) {
                    report_damaged(conn, &index, &e.to_string()).await;
                }
            }
        }
    }
    Ok(DeadHolders {
        dead,
        held,
        holders_unreadable: false,
    })
}

/// What [`held_by_dead_holders`] found.
#[derive(Debug, Default)]
struct DeadHolders {
    /// The holders judged dead.
    dead: Vec<String>,
    /// The keys their indexes name.
    held: Vec<String>,
    /// [`HOLDERS`] could not be read (a key of another type: reported once): no pass by index can
    /// find a dead process then, so the pass walks the keyspace instead (review of issue 43: every
    /// dead process waited for the fleet's walk, about 5 minutes, past its grace).
    holders_unreadable: bool,
}

/// `held` (key names of held lists) by process, but this one's: every key of one process goes to one
/// script call, so one decision covers all of them. Keys that are no held list of a process are
/// dropped.
fn group(mut held: Vec<String>, own_identity: &str) -> Vec<(String, Vec<HeldKey>)> {
    // The same key may come from an index and the scan, or from two indexes.
    held.sort_unstable();
    held.dedup();
    let mut by_process: Vec<(String, Vec<HeldKey>)> = Vec::new();
    for key in held {
        // Three layouts: this release's batch lists (`oxidekiq:batch:`), the working keys of older
        // releases (`oxidekiq:working:`: the last release's batch lists, and before them working hashes)
        // and landing lists (`oxidekiq:landing:`, every release).
        let (rest, kind) = if let Some(rest) = key.strip_prefix(keys::BATCH) {
            (rest, Layout::Batch)
        } else if let Some(rest) = key.strip_prefix(keys::WORKING) {
            (rest, Layout::Working)
        } else if let Some(rest) = key.strip_prefix(keys::LANDING) {
            (rest, Layout::Landing)
        } else {
            continue;
        };
        // identity = host:pid:hex12; the queue name is the rest (both may hold ':').
        let Some((identity, queue)) = keys::split_held(rest) else {
            continue;
        };
        if identity == own_identity {
            continue;
        }
        // A batch list (`<queue>:@<n>`) has an acks set; under `oxidekiq:working:` the script tells it
        // from a working hash of an older version by its type, and sends each to its own queue. Under
        // `oxidekiq:batch:` every key is a batch list: one without its number is no key of ours.
        let batch = match kind {
            Layout::Batch => match keys::batch_queue(queue) {
                Some(q) => Some(q),
                None => {
                    if first_report(&key) {
                        tracing::warn!(%key, "orphan recovery: a key under oxidekiq:batch: without a batch number; left alone (reported once)");
                    }
                    continue;
                }
            },
            Layout::Working => keys::batch_queue(queue),
            Layout::Landing => None,
        };
        let acks = batch.map_or_else(|| key.clone(), |_| keys::acks_of(&key));
        let held = HeldKey {
            key: key.clone(),
            acks,
            queue: keys::queue(batch.unwrap_or(queue)),
            // A key under `oxidekiq:batch:` of another type than a list (none is written so) still
            // goes to the queue its name gives, not to `<queue>:@<n>`.
            hash_queue: keys::queue(match kind {
                Layout::Batch => batch.unwrap_or(queue),
                _ => queue,
            }),
            serve_order: matches!(kind, Layout::Batch),
        };
        let identity = identity.to_string();
        match by_process.iter_mut().find(|(i, _)| *i == identity) {
            Some((_, keys)) => keys.push(held),
            None => by_process.push((identity, vec![held])),
        }
    }
    // Newest batch first: each is pushed to the served end, so the oldest is served first again.
    let batch_of = |k: &HeldKey| {
        k.key
            .rsplit_once(":@")
            .and_then(|(_, n)| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    for (_, held) in &mut by_process {
        held.sort_by_key(|k| std::cmp::Reverse(batch_of(k)));
    }
    by_process
}

/// How a recovery pass finds the held keys of other processes.
#[derive(Debug)]
pub(crate) enum Find<'a> {
    /// A `SCAN` of the whole keyspace: every layout of every release (at start, then rarely, as a
    /// safety net). Records in `.0` the processes it found that are not among [`HOLDERS`] (older
    /// releases, or a lost index), with their keys, for the passes by index to watch.
    Scan(&'a mut Vec<(String, Vec<String>)>),
    /// The holders' indexes ([`keys::held_index`]), plus the keys of the processes the last scan found
    /// outside them (a process recovered without an error leaves that list).
    Index(&'a mut Vec<(String, Vec<String>)>),
}

/// One pass, with the recovery lock held (`locked`) or, when that key is damaged, without it.
async fn recover_locked(
    conn: &mut Conn,
    own_identity: &str,
    now: f64,
    policy: RecoveryPolicy,
    locked: bool,
    find: Find<'_>,
) -> Result<Recovered> {
    let DeadHolders {
        dead: dead_holders,
        mut held,
        holders_unreadable,
    } = held_by_dead_holders(conn, own_identity).await?;
    // A holders set of another type hides every holder from a pass by index: this pass walks, as
    // every pass did before the index, until an operator deletes the key (named at ERROR once). That
    // costs the old keyspace walk per pass, not the recovery of the fleet.
    let find = match find {
        Find::Index(watch) if holders_unreadable => Find::Scan(watch),
        other => other,
    };
    let mut watched: Option<&mut Vec<(String, Vec<String>)>> = None;
    // Whether this pass saw every held key of the keyspace (a walk that Redis served): only such a
    // pass may drop the suspect marks of the processes it did not judge (see the end of this function).
    let mut walked = false;
    let mut by_process = match find {
        Find::Scan(watch) => match held_by_others(conn).await {
            Ok(found) => {
                walked = true;
                let all = group(found, own_identity);
                let holders: Vec<String> =
                    match redis::cmd("SMEMBERS").arg(HOLDERS).query_async(conn).await {
                        Ok(h) => text_only(h, HOLDERS),
                        Err(e) if crate::Error::from(e.clone()).is_outage() => {
                            return Err(e.into());
                        }
                        Err(_) => Vec::new(),
                    };
                *watch = all
                    .iter()
                    .filter(|(id, _)| !holders.contains(id))
                    .map(|(id, keys)| (id.clone(), keys.iter().map(|k| k.key.clone()).collect()))
                    .collect();
                // The index's keys too: a scan may miss a key created while it ran.
                for (_, keys) in &all {
                    held.extend(keys.iter().map(|k| k.key.clone()));
                }
                group(held, own_identity)
            }
            Err(e) if e.is_outage() => return Err(e),
            Err(e) => {
                // A walk refused for good (an ACL without `SCAN`) must not take the pass by index
                // with it (the loop would then walk, refused, at every pass, and never read an index
                // again): this pass reads the indexes and the watched processes, as any other.
                if first_report(&e.to_string()) {
                    tracing::error!(error = %e, cause = e.fault(),
                        "orphan recovery cannot walk the keyspace; it reads the indexes of held lists \
                         only, and lists no index names (an older release's) are not found (reported once)");
                }
                for (_, keys) in watch.iter() {
                    held.extend(keys.iter().cloned());
                }
                watched = Some(watch);
                group(held, own_identity)
            }
        },
        Find::Index(watch) => {
            for (_, keys) in watch.iter() {
                held.extend(keys.iter().cloned());
            }
            watched = Some(watch);
            group(held, own_identity)
        }
    };
    // A dead holder whose index names nothing is still judged: recovered (with nothing to move), it
    // leaves the holders.
    for id in dead_holders {
        if !by_process.iter().any(|(i, _)| *i == id) {
            by_process.push((id, Vec::new()));
        }
    }
    // A walk of a huge keyspace may have taken a while: go on only while the lock is still ours (and
    // for another 30 s), so two passes never judge the same processes at once.
    if locked
        && !crate::lock::extend(conn, keys::RECOVERY_LOCK, own_identity, RECOVERY_LOCK_TTL).await?
    {
        tracing::warn!("orphan recovery lock expired during the key scan; this pass stops");
        return Ok(Recovered::default());
    }
    let books = bookkeeping(conn).await?;
    let holders: Vec<String> = by_process.iter().map(|(i, _)| i.clone()).collect();
    let mut total = Recovered::default();
    let script = Script::new(ORPHAN_LUA);
    let grace_ms = policy.grace.as_millis().max(1) as u64;
    let (trim_before, dead_max) = dead_trim(now);
    let limit = if books.counts { MAX_RECOVERIES } else { -1 };
    for (identity, held) in by_process {
        let mark = if books.suspects {
            String::new()
        } else {
            let since = MEMORY_MARKS
                .lock()
                .ok()
                .and_then(|m| m.get(&identity).copied())
                .filter(|(_, seen)| seen.elapsed() < policy.grace * 2)
                .map(|(ms, _)| ms);
            since.map_or_else(|| "m".to_string(), |ms| format!("m{ms}"))
        };
        let mut inv = script.key(keys::alive(&identity));
        inv.key(suspects_of(&held))
            .key(RECOVERED)
            .key(keys::DEAD)
            .key(keys::held_index(&identity))
            .key(HOLDERS);
        let mut orders = String::with_capacity(held.len());
        for h in &held {
            inv.key(&h.key)
                .key(&h.acks)
                .key(&h.queue)
                .key(&h.hash_queue);
            orders.push(if h.serve_order { 'd' } else { 'a' });
        }
        inv.arg(grace_ms)
            .arg(limit)
            .arg(score(now))
            .arg(policy.time_format.value(now).to_string())
            .arg(&trim_before)
            .arg(dead_max)
            .arg(&identity)
            .arg(&mark)
            .arg(&orders);
        let reply: redis::RedisResult<(u8, u64, u64, String, u64, String)> =
            inv.invoke_async(conn).await;
        let (state, moved, killed, err, redis_ms, damaged) = match reply {
            Ok(r) => r,
            Err(e) => {
                let e = crate::Error::from(e);
                if e.is_outage() {
                    return Err(e);
                }
                // One process's keys failing for a reason of their own (a damaged key the script
                // raised on) must not stop the recovery of the others: named, and the pass goes on.
                let first = held.first().map_or("", |h| h.key.as_str());
                if first_report(&format!("{identity} {e}")) {
                    tracing::error!(process = %identity, keys = held.len(), first_key = %first, error = %e,
                        "orphan recovery: could not recover this dead process's keys (a damaged key?); \
                         they stay in Redis, and the pass goes on with the other processes");
                }
                continue;
            }
        };
        if !damaged.is_empty() {
            tracing::error!(process = %identity, error = %damaged,
                "orphan recovery: a liveness key of oxidekiq's is damaged; its process is judged by the \
                 recovery grace as if the key were gone");
        }
        if !books.suspects
            && let Ok(mut marks) = MEMORY_MARKS.lock()
        {
            match state {
                1 => {
                    let seen = tokio::time::Instant::now();
                    let mark = marks.entry(identity.clone()).or_insert((redis_ms, seen));
                    if mark.1.elapsed() >= policy.grace * 2 {
                        // Stale (see MEMORY_MARKS): this absence starts now.
                        mark.0 = redis_ms;
                    }
                    mark.1 = seen;
                }
                _ if err.is_empty() => {
                    marks.remove(&identity);
                }
                _ => {}
            }
        }
        match state {
            1 => total.suspects += 1,
            2 => {
                if moved + killed > 0 {
                    tracing::warn!(process = %identity, requeued = moved, dead = killed,
                        "recovered jobs of a process that died");
                }
                if err.is_empty()
                    && let Some(w) = watched.as_mut()
                {
                    w.retain(|(id, _)| *id != identity);
                }
                if !err.is_empty() && first_report(&format!("{identity} {err}")) {
                    tracing::error!(process = %identity, error = %err,
                        "could not push back every job of a dead process; the rest stay in its working keys \
                         (reported once; retried every pass)");
                }
            }
            _ => {}
        }
        total.requeued += moved;
        total.killed += killed;
    }
    // A suspect that has no key left (it stopped cleanly, or was recovered) needs no mark.
    if !books.suspects {
        if let Ok(mut marks) = MEMORY_MARKS.lock() {
            marks.retain(|who, _| holders.contains(who));
        }
        return Ok(total);
    }
    // Only a walk judged every process that holds keys: a pass by index judges the dead holders and
    // its own watched processes, and dropping the others' marks wiped the mark of a process that only
    // another process's walk found, at every pass, so that it was never recovered (review of issue 43).
    if !walked {
        return Ok(total);
    }
    for hash in [SUSPECTS, BATCH_SUSPECTS] {
        let suspects: Vec<String> = conn.hkeys(hash).await?;
        let gone: Vec<&String> = suspects
            .iter()
            .filter(|s| !holders.iter().any(|i| i == *s))
            .collect();
        if !gone.is_empty() {
            let _: () = conn.hdel(hash, gone).await?;
        }
    }
    Ok(total)
}

/// The suspects hash that dates a process's absence: [`BATCH_SUSPECTS`] for one that holds batch lists
/// under `oxidekiq:batch:` (an older release's pass would delete its mark from [`SUSPECTS`]), else
/// [`SUSPECTS`], which older releases share.
fn suspects_of(held: &[HeldKey]) -> &'static str {
    if held.iter().any(|k| k.key.starts_with(keys::BATCH)) {
        BATCH_SUSPECTS
    } else {
        SUSPECTS
    }
}

/// One pass, logged.
/// One pass, logged. True when it ran (false: another process held the recovery lock, or it failed).
async fn recover(conn: &mut Conn, identity: &str, policy: RecoveryPolicy, find: Find<'_>) -> bool {
    match recover_found(conn, identity, time::now(), policy, find).await {
        Ok(Some(r)) => {
            if r.requeued + r.killed > 0 {
                tracing::info!(
                    requeued = r.requeued,
                    dead = r.killed,
                    "orphan recovery done"
                );
            }
            return true;
        }
        Ok(None) => {}
        Err(e) if e.is_outage() => {
            tracing::debug!(error = %e, "orphan recovery failed; will try again")
        }
        // Not an outage: a key it needs is damaged (those of its own it can do without are reported
        // and worked around above), and retrying will not mend it.
        Err(e) if first_report(&e.to_string()) => tracing::error!(error = %e, cause = e.fault(),
            "orphan recovery failed, not for an outage; will try again (reported once)"),
        Err(e) => tracing::debug!(error = %e, "orphan recovery failed again"),
    }
    false
}

/// How often, about, a process's recovery walks the whole keyspace (jittered, ±25%), besides its first
/// pass: a safety net for lists no index names (an older release's, an index write lost to a failover
/// or refused). Every other pass reads the indexes of held lists only, so an idle fleet's recovery costs
/// Redis what the fleet holds, not what else Redis holds (issue 43: 4 idle processes beside 1 M
/// unrelated keys spent 4 s of Redis CPU a minute walking it every two beats).
pub(crate) const SCAN_EVERY: Duration = Duration::from_secs(300);

/// Whether this process walks the keyspace now for the fleet: it takes [`keys::RECOVERY_WALK`] for
/// [`SCAN_EVERY`] unless another process took it since. A key that cannot be taken for another reason
/// (damaged, refused) lets it walk: the net must not fail closed. A key there that is no turn of
/// ours (every one is a string with a TTL) counts as damaged: `SET NX` answers nil for a key of any type
/// or without a TTL, which stopped every walk of the fleet for good (review of issue 43).
pub(super) async fn take_walk(conn: &mut Conn, identity: &str) -> bool {
    let r: redis::RedisResult<Option<String>> = redis::cmd("SET")
        .arg(keys::RECOVERY_WALK)
        .arg(identity)
        .arg("NX")
        .arg("PX")
        .arg(SCAN_EVERY.as_millis() as u64)
        .query_async(conn)
        .await;
    if !matches!(r, Ok(None)) {
        return true;
    }
    let (Ok(kind), Ok(ttl)) = (
        key_type(conn, keys::RECOVERY_WALK).await,
        redis::cmd("PTTL")
            .arg(keys::RECOVERY_WALK)
            .query_async::<i64>(conn)
            .await,
    ) else {
        return false;
    };
    if kind == "none" || (kind == "string" && ttl != -1) {
        return false;
    }
    if first_report(&format!("{} {kind} {ttl}", keys::RECOVERY_WALK)) {
        tracing::error!(key = keys::RECOVERY_WALK, key_type = %kind, ttl_ms = ttl,
            "orphan recovery: {} is a {kind} without the TTL its turn always has: not a key of \
             oxidekiq's; this process walks at its own turns (delete the key to restore it)", keys::RECOVERY_WALK);
    }
    true
}

/// The recovery loop of a reliable-fetch process: a pass at once, then one every `every` (jittered),
/// until the process goes quiet. Its first pass walks the keyspace, and so does one pass about every
/// [`SCAN_EVERY`] in the fleet (the process that takes [`keys::RECOVERY_WALK`]);
/// the others read the indexes of held lists (and watch the processes the last walk found outside
/// them). Each pass first keeps this process's own index true (each capsule's `tidy_index`).
pub(crate) async fn recovery_loop(
    mut conn: Conn,
    identity: String,
    every: Duration,
    policy: RecoveryPolicy,
    fleet: Arc<Fleet>,
    fetches: Vec<Arc<dyn super::Fetch>>,
    mut signal: ShutdownSignal,
) {
    let mut watch: Vec<(String, Vec<String>)> = Vec::new();
    let mut next_scan = tokio::time::Instant::now();
    let mut walked = false;
    loop {
        // The dead entries it may write take the format the live fleet reads now.
        let policy = RecoveryPolicy {
            time_format: fleet.time_format(),
            ..policy
        };
        // Every capsule's part of the index: each one's landing lists (a recovery that took the
        // process for dead dropped them all; the first capsule's alone came back before).
        for fetch in &fetches {
            if let Err(e) = fetch.tidy_index().await
                && !e.is_outage()
                && first_report(&e.to_string())
            {
                tracing::error!(error = %e, "cannot tidy this process's index of held lists (a damaged key?); recovery's keyspace walk still finds its lists");
            }
        }
        let mut periodic = false;
        let find = if tokio::time::Instant::now() >= next_scan {
            let first = !walked;
            periodic = !first;
            walked = true;
            let jitter = rand::random::<f64>() * 0.5 + 0.75;
            next_scan = tokio::time::Instant::now() + SCAN_EVERY.mul_f64(jitter);
            if first || take_walk(&mut conn, &identity).await {
                Find::Scan(&mut watch)
            } else {
                Find::Index(&mut watch)
            }
        } else {
            Find::Index(&mut watch)
        };
        let fleet_walk = matches!(find, Find::Scan(_)) && periodic;
        if !recover(&mut conn, &identity, policy, find).await && fleet_walk {
            // The fleet's walk did not happen (another pass held the lock, or it failed): its turn is
            // given back, and this process tries again at its next pass. (A first pass that finds the
            // lock held is not tried again: the fleet's walks cover it.)
            let _ = crate::lock::release(&mut conn, keys::RECOVERY_WALK, &identity).await;
            next_scan = tokio::time::Instant::now();
        }
        signal.events().announce(crate::events::Event::RecoveryPass);
        if signal.is_quiet() {
            return;
        }
        let jitter = rand::random::<f64>() * 0.5 + 0.75;
        tokio::select! {
            _ = tokio::time::sleep(every.mul_f64(jitter)) => {}
            _ = signal.quiet() => return,
        }
    }
}

/// For tests: records `payload` as recovered `times` already (the count is per payload, by SHA1, as
/// `ORPHAN_LUA` keeps it), computed by Redis itself.
#[cfg(test)]
pub(crate) fn mark_recovered(c: &mut redis::Connection, payload: &str, times: i64) {
    let sha: String = redis::cmd("EVAL")
        .arg("return redis.sha1hex(ARGV[1])")
        .arg(0)
        .arg(payload)
        .query(c)
        .unwrap();
    let _: () = redis::Commands::hset(c, crate::keys::RECOVERED, &sha, times).unwrap();
}
