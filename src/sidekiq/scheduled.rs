//! The poller that moves due jobs from `retry` and `schedule` into their queues.
//!
//! Mirrors `scheduled.rb` (PROTOCOL §5): sets in the order `retry`, then `schedule`; a random sleep of
//! ½–1½ × (`average` × live processes) between rounds (Ruby assumes every registered process polls, so we
//! must too, at the same rate). Unlike Ruby's one-job-per-round-trip loop, each round trip moves up to
//! [`BATCH`] jobs or [`BATCH_BYTES`] (at least one job): a script reads a batch of due members, Rust
//! gives each a fresh `enqueued_at` (keeping every other key and byte), and one Lua script moves them: a
//! member is pushed only if it is still in its set, and removed only once the push succeeded (all inside
//! the script, so two pollers never push one job twice, and a queue key of the wrong type leaves the job
//! in its set instead of destroying it: the error names the key, and the other jobs move on). A round drains everything that is due. A member that is not a job
//! goes to the dead set, never lost.

use std::time::Duration;

use rand::Rng;
use redis::Script;
use serde_json::Value;

use crate::error::Result;
use crate::keys;
use crate::redis_conn::Conn;
use crate::retry::to_json;
use crate::shutdown::ShutdownSignal;
use crate::time::{self, TimeFormat, score};

/// Members read and moved per round trip.
pub(crate) const BATCH: usize = 1000;

/// Bytes of due members read per round trip (at least one member, however large): with `BATCH`, it
/// bounds what a round holds in memory (the members, their rewritten payloads and the script call that
/// carries both) to a small multiple of the larger of this and the largest member.
pub(crate) const BATCH_BYTES: usize = 2 * 1024 * 1024;

/// Reads the due members of set KEYS[1] (score ≤ ARGV[1]) from rank ARGV[2] of the due ones, at most
/// ARGV[3] of them and, past the first, only while their total stays within ARGV[4] bytes. One member at
/// a time (`ZRANGE ... BYSCORE LIMIT`, Redis 6.2+ as the read it replaces), so Redis never holds more than
/// the budget and one member either.
const READ_DUE_LUA: &str = r#"
local out, bytes = {}, 0
local offset, count, budget = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
while #out < count do
  local m = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', offset + #out, 1)[1]
  if not m then break end
  if #out > 0 and bytes + #m > budget then break end
  out[#out + 1] = m
  bytes = bytes + #m
end
return out
"#;

/// KEYS[1] is the set, KEYS[2] `queues`, KEYS[3] the dead set, then one key per member: its queue, or
/// the dead set for a member that is not a job. ARGV[1] and ARGV[2] are the dead set's trim score and
/// size limit, then triples (member, queue name or '' for the dead set, new payload or dead score). A
/// job goes through the one `push_job` (`SADD queues`, `LPUSH`), a non-job through the one `to_dead`
/// (trimmed as `DeadSet#kill` trims), both of [`crate::lua`]. Each write comes before the `ZREM`,
/// through `pcall`: a write that fails leaves its member in the set. Returns {moved, left in the set by
/// a failed write, the first such error}.
const ENQUEUE_LUA: &str = concat!(
    crate::lua::lua_common!(),
    r#"
local set, queues, dead = KEYS[1], KEYS[2], KEYS[3]
local trim_before, dead_max = ARGV[1], tonumber(ARGV[2])
local moved, fails, first = 0, 0, ''
for i = 3, #ARGV, 3 do
  local member, q = ARGV[i], ARGV[i + 1]
  if redis.call('ZSCORE', set, member) then
    local key = KEYS[3 + (i / 3)]
    local err
    if q == '' then
      err = to_dead(dead, member, ARGV[i + 2], trim_before, dead_max)
    else
      err = push_job(queues, key, q, ARGV[i + 2])
    end
    if err then
      fails = fails + 1
      if first == '' then first = err end
    else
      redis.call('ZREM', set, member)
      moved = moved + 1
    end
  end
end
return {moved, fails, first}
"#
);

/// Moves every due job of `set` into its queue; returns how many moved.
#[allow(
    dead_code,
    reason = "the tests' entry point; the poller reads the route table too"
)]
pub(crate) async fn enqueue_due(
    conn: &mut Conn,
    set: &str,
    now: f64,
    tf: TimeFormat,
) -> Result<u64> {
    enqueue_due_routed(conn, set, now, tf, None).await
}

/// [`enqueue_due`], sending a job of a rolled-back class (`route CLASS 0`) that comes due toward
/// `<queue>_rust` to `<queue>` instead, with its `queue` rewritten as the Ruby router rewrites it (a
/// roll back means no new Rust run of the class; Ruby's poller does the same with the router in
/// `configure_server`).
pub(crate) async fn enqueue_due_routed(
    conn: &mut Conn,
    set: &str,
    now: f64,
    tf: TimeFormat,
    routes: Option<&crate::route_table::RolledBack>,
) -> Result<u64> {
    let suffix = format!("{}\"", keys::RUST_QUEUE_SUFFIX);
    let script = Script::new(ENQUEUE_LUA);
    let read = Script::new(READ_DUE_LUA);
    let mut total = 0;
    // Members a failed write left in the set are skipped by the next read, so the others move on.
    let mut skip = 0;
    loop {
        // Bytes, not strings: one member that is not UTF-8 must not stop the whole set from moving.
        let due: Vec<Vec<u8>> = read
            .key(set)
            .arg(score(now))
            .arg(skip)
            .arg(BATCH)
            .arg(BATCH_BYTES)
            .invoke_async(conn)
            .await?;
        if due.is_empty() {
            return Ok(total);
        }
        let mut inv = script.prepare_invoke();
        inv.key(set).key(keys::QUEUES).key(keys::DEAD);
        let (trim_before, dead_max) = crate::lua::dead_trim(now);
        inv.arg(trim_before).arg(dead_max);
        // The route table is read only when a due job may be headed for a `_rust` queue.
        let headed_to_rust = due
            .iter()
            .any(|m| m.windows(suffix.len()).any(|w| w == suffix.as_bytes()));
        let rolled_back = match routes {
            Some(r) if headed_to_rust => r.classes(crate::route_table::REFRESH).await,
            _ => Default::default(),
        };
        for member in &due {
            let job = std::str::from_utf8(member)
                .ok()
                .and_then(|m| requeued_to(m, now, tf, &rolled_back));
            match job {
                Some((queue, payload)) => {
                    inv.key(keys::queue(&queue));
                    inv.arg(member).arg(queue).arg(payload)
                }
                None => {
                    tracing::warn!(
                        set,
                        "a member that is not a Sidekiq job moved to the dead set"
                    );
                    inv.key(keys::DEAD);
                    inv.arg(member).arg("").arg(score(now))
                }
            };
        }
        let (moved, failed, error): (u64, u64, String) = inv.invoke_async(conn).await?;
        total += moved;
        if failed > 0 {
            // Not an outage (that fails the whole call): a key of the wrong type, which will not mend
            // by itself, so it is an error; the other due jobs moved on.
            tracing::error!(set, count = failed, error = %error,
                "due jobs stay in their set: their queue cannot take them (retried next round)");
            skip += failed;
        }
        // A read cut by the byte budget has more behind it; the next read (empty when all moved) ends
        // the round.
    }
}

/// The payload as `Client#push` re-pushes it: the same keys with `enqueued_at` = now and no `at`.
/// `None` when the member is not a job (no string `class`, `args` not an array, no queue).
#[allow(dead_code, reason = "the tests' and the fuzz target's entry point")]
pub(crate) fn requeued_payload(member: &str, now: f64, tf: TimeFormat) -> Option<(String, String)> {
    requeued_to(member, now, tf, &Default::default())
}

/// [`requeued_payload`], with a job of a `rolled_back` class headed for `<queue>_rust` sent to
/// `<queue>` (its `queue` rewritten).
fn requeued_to(
    member: &str,
    now: f64,
    tf: TimeFormat,
    rolled_back: &std::collections::HashSet<String>,
) -> Option<(String, String)> {
    let mut msg: serde_json::Map<String, Value> = serde_json::from_str(member).ok()?;
    if !msg.get("class").is_some_and(Value::is_string)
        || !msg.get("args").is_some_and(Value::is_array)
    {
        return None;
    }
    let queue = match msg.get("queue") {
        Some(Value::String(q)) if !q.is_empty() => q.clone(),
        None => "default".to_string(),
        _ => return None,
    };
    let class = msg
        .get("wrapped")
        .and_then(Value::as_str)
        .or_else(|| msg.get("class").and_then(Value::as_str))
        .unwrap_or_default();
    let queue = match crate::route_table::redirect(rolled_back, &queue, class) {
        Some(base) => {
            msg.insert("queue".into(), Value::String(base.clone()));
            base
        }
        None => queue,
    };
    msg.shift_remove("at");
    msg.insert("enqueued_at".into(), tf.value(now));
    Some((queue, to_json(&msg)))
}

/// How long to sleep before the next round (`scheduled.rb random_poll_interval`).
pub(crate) fn poll_interval(average: Duration, processes: u64, rng: &mut impl Rng) -> Duration {
    let count = processes.max(1) as f64;
    let interval = average.as_secs_f64() * count;
    let secs = if count < 10.0 {
        interval * rng.random::<f64>() + interval / 2.0
    } else {
        interval * rng.random::<f64>()
    };
    Duration::from_secs_f64(secs)
}

/// The process count Ruby scales the poll interval by: members of `processes` whose heartbeat hash
/// still has its `info` (`ProcessSet#cleanup` prunes the others before `scheduled.rb` counts them),
/// at least 1. A process killed with SIGKILL stays in the set, and counting it would slow every
/// poller down until something prunes it.
pub(crate) async fn live_process_count(conn: &mut Conn) -> Result<u64> {
    let ids: Vec<Vec<u8>> = redis::cmd("SMEMBERS")
        .arg(keys::PROCESSES)
        .query_async(conn)
        .await?;
    if ids.is_empty() {
        return Ok(1);
    }
    let mut pipe = redis::pipe();
    for id in &ids {
        pipe.cmd("HEXISTS").arg(id).arg("info");
    }
    let live: Vec<bool> = pipe.query_async(conn).await?;
    Ok((live.iter().filter(|l| **l).count() as u64).max(1))
}

/// The poller loop: runs until the process goes quiet.
pub(crate) async fn run(
    mut conn: Conn,
    average: Duration,
    fleet: std::sync::Arc<crate::fleet::Fleet>,
    mut shutdown: ShutdownSignal,
) {
    let routes = crate::route_table::RolledBack::new(conn.clone());
    // Ruby waits 10–15 s before the first round; we scale that with the configured average so a short
    // test interval also starts soon.
    let initial = average.as_secs_f64() * (2.0 + rand::rng().random::<f64>());
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs_f64(initial)) => {}
        _ = shutdown.quiet() => return,
    }
    let mut failing = false;
    loop {
        let now = time::now();
        // The fleet's format at this moment (re-decided on every heartbeat).
        let tf = fleet.time_format();
        let mut ok = true;
        for set in [keys::RETRY, keys::SCHEDULE] {
            match enqueue_due_routed(&mut conn, set, now, tf, Some(&routes)).await {
                Ok(n) if n > 0 => tracing::debug!(set, moved = n, "enqueued due jobs"),
                Ok(_) => {}
                Err(e) => {
                    ok = false;
                    if !failing {
                        tracing::warn!(error = %e, "scheduled poller cannot reach redis; retrying");
                    }
                }
            }
        }
        if ok && failing {
            tracing::info!("scheduled poller reaches redis again");
        }
        failing = !ok;
        shutdown.events().announce(crate::events::Event::PollerPass);
        let processes = live_process_count(&mut conn).await.unwrap_or(1);
        let pause = poll_interval(average, processes, &mut rand::rng());
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = shutdown.quiet() => return,
        }
    }
}

// Moved from tests/ruby_schedule.rs: the scheduled poller beside Ruby Sidekiq (needs crate-internal items).
#[cfg(test)]
mod tests_ruby;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn requeue_sets_enqueued_at_drops_at_and_keeps_the_rest() {
        let m = r#"{"retry":true,"queue":"q","class":"A","args":[12345678901234567890123],"at":5.0,"created_at":1.5}"#;
        let (q, p) = requeued_payload(m, 100.25, TimeFormat::Seconds).unwrap();
        assert_eq!(q, "q");
        assert_eq!(
            p,
            r#"{"retry":true,"queue":"q","class":"A","args":[12345678901234567890123],"created_at":1.5,"enqueued_at":100.25}"#
        );
        assert!(requeued_payload(r#"{"args":[]}"#, 1.0, TimeFormat::Seconds).is_none());
        assert!(requeued_payload("nope", 1.0, TimeFormat::Seconds).is_none());
        let rolled_back = ["A".to_string()].into();
        let m = r#"{"queue":"q_rust","class":"A","args":[]}"#;
        let (q, p) = requeued_to(m, 1.0, TimeFormat::Seconds, &rolled_back).unwrap();
        assert_eq!(q, "q");
        assert_eq!(
            p,
            r#"{"queue":"q","class":"A","args":[],"enqueued_at":1.0}"#
        );
    }

    #[test]
    fn poll_interval_scales_with_processes_like_ruby() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..100 {
            let d = poll_interval(Duration::from_secs(5), 3, &mut rng).as_secs_f64();
            assert!((7.5..=22.5).contains(&d), "{d}");
            let d = poll_interval(Duration::from_secs(5), 20, &mut rng).as_secs_f64();
            assert!((0.0..=100.0).contains(&d), "{d}");
        }
    }
}
