//! Migrating a worker from Ruby to Rust, one class at a time, without a deploy per step and without
//! stranding a job (docs/migration.md).
//!
//! - [`check`]: `oxidekiq check` decodes a sample of real payloads with each Rust worker's `Args`.
//! - [`route`]: `oxidekiq route CLASS PERCENT` / `oxidekiq routes`, the canary read by
//!   `ruby/oxidekiq.rb`, and the one-command roll back.
//! - [`handoff`]: `--handoff QUEUE`, unknown classes and Ruby-side contracts go back to Ruby.
//! - [`report`]: `oxidekiq report`, the hottest classes by execution time.
//!
//! The subcommands share the binary's flags and config (Redis URL, `-C`, `-q`): `oxidekiq -q default
//! check`.
//!
//! They read payloads through [`read_window`], bounded as the fetch is: never more than
//! [`WINDOW_BYTES`] per round trip, and a payload over `--max-payload-bytes` is counted, never sent.

pub(crate) mod check;
pub(crate) mod handoff;
pub(crate) mod report;
pub(crate) mod route;

use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::Subcommand;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::redis_conn::{self, Conn};
use crate::registry::Registry;

/// The migration subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Decode a sample of real payloads of every registered class with its worker's Args type, without taking them
    Check {
        /// Payloads decoded per class at most
        #[arg(long, value_name = "N", default_value_t = 300)]
        sample: usize,
        /// Payloads read per queue or set at most
        #[arg(long, value_name = "N", default_value_t = 100_000)]
        scan_limit: usize,
    },
    /// Send PERCENT (0-100) of CLASS's new jobs to <queue>_rust; 0 stops at once and moves its waiting jobs back
    Route {
        /// The Ruby class name (for ActiveJob: the job class)
        class: String,
        /// Share of new jobs, 0 to 100
        #[arg(value_parser = clap::value_parser!(u8).range(0..=100))]
        percent: u8,
        /// Seconds to wait before the roll back's second pass (the Ruby clients' cache window)
        #[arg(long, value_name = "SECONDS", default_value_t = route::RUBY_REFRESH_SECS + 2.0, hide = true)]
        settle: f64,
        /// Route a class that no registered Rust worker knows (its routed jobs would fail in Rust)
        #[arg(long)]
        force: bool,
    },
    /// List the routes: share, live oxidekiq processes serving each, jobs run in Rust and in Ruby over the last hour
    Routes {
        /// Report as of this RFC 3339 time instead of now (tests)
        #[arg(long, value_name = "TIME", hide = true)]
        at: Option<String>,
    },
    /// The hottest classes by total execution time over the last hour, to choose what to migrate next
    Report {
        /// Classes shown at most
        #[arg(long, value_name = "N", default_value_t = 20)]
        limit: usize,
        /// Sidekiq 6.x (no metrics): jobs sampled per queue
        #[arg(long, value_name = "N", default_value_t = 300)]
        sample: usize,
        /// Report as of this RFC 3339 time instead of now (tests)
        #[arg(long, value_name = "TIME", hide = true)]
        at: Option<String>,
    },
}

/// The members of a set that are UTF-8 and how many are not (skipped): names in Redis are bytes, and
/// one that is not text must not make a subcommand fail.
pub(crate) async fn utf8_members(conn: &mut Conn, key: &str) -> Result<(Vec<String>, usize)> {
    let all: Vec<Vec<u8>> = redis::cmd("SMEMBERS").arg(key).query_async(conn).await?;
    let total = all.len();
    let names: Vec<String> = all
        .into_iter()
        .filter_map(|m| String::from_utf8(m).ok())
        .collect();
    let skipped = total - names.len();
    Ok((names, skipped))
}

/// For a read of `key` that failed with `e`: `<key> is a <type>` when the key alone is at fault (a key
/// of the wrong type: the command reports it and goes on with the others), `None` for any other
/// failure (Redis away: the command fails).
pub(crate) async fn damaged(conn: &mut Conn, key: &str, e: &Error) -> Option<String> {
    let Error::Redis(r) = e else {
        return None;
    };
    if r.code() != Some("WRONGTYPE") {
        return None;
    }
    let t: String = redis::cmd("TYPE")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap_or_else(|_| "unknown".into());
    Some(format!("{key} is a {t}"))
}

/// Ruby's `String#to_i` then `clamp(0, 100)`, as `ruby/oxidekiq.rb` reads a route share: leading
/// blanks, a sign, digits with single `_` between them; anything else ends the number (`"4.9"` is
/// 4, `"abc"` is 0, `"300"` is 100).
pub(crate) fn ruby_share(value: &[u8]) -> u8 {
    let mut rest = value;
    while let [b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r', tail @ ..] = rest {
        rest = tail;
    }
    let negative = match rest {
        [b'-', tail @ ..] => {
            rest = tail;
            true
        }
        [b'+', tail @ ..] => {
            rest = tail;
            false
        }
        _ => false,
    };
    let mut n: u64 = 0;
    let mut after_digit = false;
    for &b in rest {
        match b {
            b'0'..=b'9' => {
                n = (n * 10 + u64::from(b - b'0')).min(1000);
                after_digit = true;
            }
            b'_' if after_digit => after_digit = false,
            _ => break,
        }
    }
    if negative { 0 } else { n.min(100) as u8 }
}

/// Payload bytes one [`read_window`] call returns at most (plus one payload).
pub(crate) const WINDOW_BYTES: usize = 8 * 1024 * 1024;

/// Reads members `start..start+count` of a list (`LRANGE` order) or a sorted set (`ZRANGE` order) one
/// by one inside Redis, stopping once the bytes returned reach ARGV[5]; a member longer than ARGV[4]
/// is returned as its length instead of its bytes. KEYS[1] = the key; ARGV = `list`/`zset`, start,
/// count, item limit, byte budget. Returns the members (strings or lengths); fewer than `count` at the
/// end of the key or when the budget is spent. One member at a time: the Lua side holds one payload,
/// never a whole `LRANGE` of them. A key of another type is an error naming it and its type (a script
/// error at its first `LRANGE` named neither).
const WINDOW_LUA: &str = r#"
local list = ARGV[1] == 'list'
local t = redis.call('TYPE', KEYS[1]).ok
local want = list and 'list' or 'zset'
if t ~= want and t ~= 'none' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[1] .. ' is a ' .. t .. ', not a ' .. want)
end
local start, count = tonumber(ARGV[2]), tonumber(ARGV[3])
local limit, budget = tonumber(ARGV[4]), tonumber(ARGV[5])
local out, bytes = {}, 0
for i = start, start + count - 1 do
  local got
  if list then got = redis.call('LRANGE', KEYS[1], i, i) else got = redis.call('ZRANGE', KEYS[1], i, i) end
  local m = got[1]
  if m == nil then break end
  if #m > limit then
    out[#out + 1] = #m
  else
    out[#out + 1] = m
    bytes = bytes + #m
  end
  if bytes >= budget then break end
end
return out
"#;

/// One member read by [`read_window`].
#[derive(Debug)]
pub(crate) enum Member {
    /// Its bytes.
    Bytes(Vec<u8>),
    /// Over the item limit: only its length was sent.
    TooLarge,
}

/// Up to `count` members of `key` (a list when `is_list`, else a sorted set) from `start`, at most
/// [`WINDOW_BYTES`] of them (plus one), members over `item_limit` bytes as [`Member::TooLarge`]. An
/// empty answer means the end of the key.
pub(crate) async fn read_window(
    conn: &mut Conn,
    key: &str,
    is_list: bool,
    start: usize,
    count: usize,
    item_limit: usize,
) -> Result<Vec<Member>> {
    static SCRIPT: std::sync::LazyLock<redis::Script> =
        std::sync::LazyLock::new(|| redis::Script::new(WINDOW_LUA));
    let values: Vec<redis::Value> = SCRIPT
        .key(key)
        .arg(if is_list { "list" } else { "zset" })
        .arg(start)
        .arg(count)
        .arg(item_limit)
        .arg(WINDOW_BYTES)
        .invoke_async(conn)
        .await?;
    Ok(values
        .into_iter()
        .filter_map(|v| match v {
            redis::Value::BulkString(b) => Some(Member::Bytes(b)),
            redis::Value::Int(_) => Some(Member::TooLarge),
            _ => None,
        })
        .collect())
}

fn parse_at(at: &Option<String>) -> Result<DateTime<Utc>> {
    match at {
        None => Ok(Utc::now()),
        Some(s) => DateTime::parse_from_rfc3339(s)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| Error::Config(format!("--at `{s}`: {e}"))),
    }
}

async fn connect(config: &Config) -> Result<Conn> {
    let client =
        redis_conn::client_with_ca(&config.redis_url(), config.redis_ca_file().as_deref())?;
    redis_conn::connect(&client).await
}

/// Runs a subcommand; returns what to print and whether it succeeded (the exit status).
pub(crate) async fn run(
    command: Command,
    config: &Config,
    registry: &Registry,
) -> Result<(String, bool)> {
    let mut conn = connect(config).await?;
    match command {
        Command::Check { sample, scan_limit } => {
            let r = check::run(
                &mut conn,
                config,
                registry,
                check::Limits {
                    sample: sample.max(1),
                    scan: scan_limit.max(1),
                },
            )
            .await?;
            Ok((r.render(), !r.any_failed()))
        }
        Command::Route {
            class,
            percent,
            settle,
            force,
        } => {
            // A typo routes jobs nobody can run: refused unless forced (a roll back always runs).
            if percent > 0 && !force && registry.get(&class).is_none() {
                return Err(Error::Config(format!(
                    "route {}: no registered Rust worker has this class (registered: {}); check the \
                     name, or pass --force to route it anyway",
                    crate::logging::escape(&class),
                    registry.classes().join(", ")
                )));
            }
            let settle = Duration::try_from_secs_f64(settle.max(0.0)).unwrap_or(Duration::ZERO);
            let out = route::route(&mut conn, &class, percent, settle).await?;
            Ok((out, true))
        }
        Command::Routes { at } => Ok((route::list(&mut conn, parse_at(&at)?).await?, true)),
        Command::Report { limit, sample, at } => Ok((
            report::report(&mut conn, registry, parse_at(&at)?, limit, sample.max(1)).await?,
            true,
        )),
    }
}
