//! A lock held in one Redis: the single-node case of RedLock. The one lock primitive of the crate: the
//! unique-job, sequential-job and until-executed middleware all take, keep and release their locks here.
//!
//! # How it works
//!
//! - **Acquire** is one command, `SET oxidekiq:lock:<key> <token> NX PX <ttl>` (`keys::lock`): it
//!   succeeds only when nobody holds the key, and the lock frees itself after `ttl` even if its holder
//!   dies. The token is 32 lowercase hex digits, never the same twice: 64 random bits drawn once per
//!   process, then a 64-bit counter, so a holder can prove the lock is still its own. A lock taken for a job ([`RedisLock::held_by`]) stores
//!   `<token>:<jid>`, so a busy lock names its holder in logs (one `GET`, only when the lock was busy).
//! - **Release** and **extend** are Lua scripts that compare the stored token with ours before they
//!   `DEL` or `PEXPIRE`. A plain `DEL` would be a read-then-write race: a holder whose lock expired could
//!   delete the lock someone else took since.
//! - Scripts are sent with `EVALSHA` using a SHA1 computed here ([`script_sha1`]); when Redis does not
//!   know the script (restart, `SCRIPT FLUSH`) it answers `NOSCRIPT` and we send the body with `EVAL`,
//!   which also caches it for the next `EVALSHA`. So a lock costs one round trip to take and one to
//!   release, and nothing in between unless its holder outlives a third of its TTL.
//! - The job middleware take their locks batched (`RedisLock::batched`): the same `SET NX PX`, sent in
//!   one pipeline with those of every other job starting meanwhile, and a release that compares and
//!   deletes many keys in one `EVALSHA` (`lock_batch`). A job's release is queued, not waited for
//!   (`LockGuard::release_detached`): its slot moves on while the batch task sends it, before any
//!   acquire queued after it, and a graceful stop waits for every queued release to reach Redis.
//! - A [`LockGuard`] can run a **keeper**: a task that re-`PEXPIRE`s the lock every `ttl / 3` while the
//!   guard lives ([`LockGuard::keep_alive`]), or the same loop polled beside a future in the caller's own
//!   task ([`LockGuard::hold_while`], what the middleware use: it cannot outlive the job). If the
//!   extension finds someone else's token (or cannot reach Redis for a whole `ttl`) the lock is lost: the
//!   keeper stops and [`LockGuard::is_lost`] turns true, so the holder can stop work that needed
//!   exclusivity.
//!
//! # Invariants
//!
//! - Only the holder of the token can release or extend the lock.
//! - The keeper never outlives its guard: it stops on [`LockGuard::release`] and is aborted on drop.
//! - Dropping a guard **does not release** the lock (a release needs a Redis round trip, which `Drop`
//!   cannot await): the key then expires by its TTL. Call [`LockGuard::release`] when done.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use oxidekiq::lock::{LockOptions, RedisLock};
//!
//! # async fn run(conn: oxidekiq::worker::Conn) -> oxidekiq::error::Result<()> {
//! let opts = LockOptions { ttl: Duration::from_secs(10), ..LockOptions::default() };
//! let lock = RedisLock::new(conn, "report:42", opts); // Redis key `oxidekiq:lock:report:42`
//!
//! // Non-blocking: `None` when someone else holds it.
//! if let Some(guard) = lock.try_lock().await? {
//!     guard.release().await?;
//! }
//!
//! // Blocking: waits up to `opts.timeout`, then `Error::LockNotAcquired`.
//! let mut guard = lock.lock().await?;
//! guard.keep_alive(); // long work: keep extending the TTL while we hold it
//! // ... work, checking `guard.is_lost()` at safe points ...
//! let released = guard.release().await?; // false if the lock had been lost
//! # let _ = released;
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{LazyLock, OnceLock};
use std::time::Duration;

use redis::{ErrorKind, ServerErrorKind};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::keys;
use crate::lock_batch::{Detached, Locks};
use crate::redis_conn::Conn;

// Their home is below the locks (a script's SHA1 with the scripts, a TTL in ms with the time); kept at
// these paths.
pub use crate::lua::script_sha1;
pub(crate) use crate::time::ttl_ms;

/// Deletes `KEYS[1]` only if it holds the token `ARGV[1]`; returns 1 if it deleted, else 0.
pub const RELEASE_SCRIPT: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('DEL', KEYS[1]) \
     else return 0 end";

/// Sets `KEYS[1]`'s TTL to `ARGV[2]` ms only if it holds the token `ARGV[1]`; returns 1 if it did, else 0.
pub const EXTEND_SCRIPT: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('PEXPIRE', KEYS[1], ARGV[2]) \
     else return 0 end";

static RELEASE_SHA: LazyLock<String> = LazyLock::new(|| script_sha1(RELEASE_SCRIPT));
static EXTEND_SHA: LazyLock<String> = LazyLock::new(|| script_sha1(EXTEND_SCRIPT));

/// Hex digits in a token: a 16-digit process prefix, then a 16-digit counter.
const TOKEN_LEN: usize = 32;

/// Where tokens come from: this process's prefix, 64 random bits in hex drawn at its first lock, and
/// the count of tokens it made. A token only has to differ from every other token a holder of the same
/// key may still hold: within a process the counter sees to that (it would take 2^64 acquisitions to
/// come back), across processes and runs the prefix (two processes draw the same one with a chance of
/// one in 2^64). A token then costs one atomic add, where drawing 128 bits from the thread's CSPRNG
/// for every acquisition cost several times the rest of a lock's making.
struct TokenSource {
    /// The 16 hex digits every token of this process starts with.
    prefix: [u8; 16],
    /// Tokens made so far (it starts at a random value: the token after a restart never follows one
    /// before it).
    next: AtomicU64,
}

static TOKENS: LazyLock<TokenSource> = LazyLock::new(|| {
    let mut prefix = [0u8; 16];
    hex_into(&mut prefix, &rand::random::<u64>().to_be_bytes());
    TokenSource {
        prefix,
        next: AtomicU64::new(rand::random()),
    }
});

/// A fresh token ([`TokenSource`]): 32 lowercase hex digits, unique across processes and runs.
pub(crate) fn new_token() -> String {
    let mut s = String::with_capacity(TOKEN_LEN);
    push_token(&mut s);
    s
}

/// The value a lock taken for the job `jid` stores: `<token>:<jid>`, built in one allocation (it is
/// made for every locked job, and for every run of an until-executed job).
pub(crate) fn job_value(jid: &str) -> String {
    let mut s = String::with_capacity(TOKEN_LEN + 1 + jid.len());
    push_token(&mut s);
    s.push(':');
    s.push_str(jid);
    s
}

/// Appends a fresh token ([`new_token`]) to `out`.
fn push_token(out: &mut String) {
    let token = token_digits();
    out.push_str(as_text(&token));
}

/// A job's lock value (`<token>:<jid>`, [`job_value`]) with a fresh token, for another attempt.
fn with_fresh_token(value: &str) -> String {
    let mut v = String::with_capacity(value.len());
    push_token(&mut v);
    v.push_str(value.get(TOKEN_LEN..).unwrap_or_default());
    v
}

/// The digits of a fresh token ([`TokenSource`]).
fn token_digits() -> [u8; TOKEN_LEN] {
    let tokens = &*TOKENS;
    let mut out = [0u8; TOKEN_LEN];
    out[..16].copy_from_slice(&tokens.prefix);
    let n = tokens.next.fetch_add(1, Ordering::Relaxed);
    hex_into(&mut out[16..], &n.to_be_bytes());
    out
}

/// Writes `bytes` in lowercase hex into `out` (twice as long).
fn hex_into(out: &mut [u8], bytes: &[u8]) {
    for (pair, &b) in out.chunks_exact_mut(2).zip(bytes) {
        pair.copy_from_slice(&HEX_PAIRS[usize::from(b)]);
    }
}

/// Hex digits as text (they are ASCII: never empty for want of UTF-8).
fn as_text(digits: &[u8]) -> &str {
    std::str::from_utf8(digits).unwrap_or_default()
}

/// Each byte's two lowercase hex digits, for [`push_hex`].
static HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut table = [[0u8; 2]; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = [DIGITS[b >> 4], DIGITS[b & 15]];
        b += 1;
    }
    table
};

/// Appends `bytes` in lowercase hex to `out`: what `crate::job::hex` writes, through a buffer on the
/// stack and one copy instead of a `char` push (with its capacity check) per digit. Each byte's pair
/// of digits is one load from a table indexed by the byte ([`hex_into`], no bounds check): it runs for
/// every job locked by its arguments (its key's SHA1), and tokens are written the same way.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    let mut buf = [0u8; 64];
    for chunk in bytes.chunks(buf.len() / 2) {
        let text = &mut buf[..chunk.len() * 2];
        hex_into(text, chunk);
        // Hex digits are ASCII: this never fails.
        out.push_str(std::str::from_utf8(text).unwrap_or_default());
    }
}

/// The jid part of a lock value, if it has the `<token>:<jid>` shape of [`job_value`].
pub(crate) fn holder_jid(value: &str) -> Option<&str> {
    value.split_once(':').map(|(_, jid)| jid)
}

/// A pause drawn from `poll/2 ..= poll*3/2`, so waiters do not retry in lockstep.
pub(crate) fn jittered(poll: Duration) -> Duration {
    let micros = u64::try_from(poll.as_micros()).unwrap_or(u64::MAX / 2);
    let lo = micros / 2;
    let hi = micros.saturating_add(micros / 2);
    Duration::from_micros(rand::random_range(lo..=hi))
}

/// Runs a script by SHA, falling back to `EVAL` with its body when Redis answers `NOSCRIPT`.
async fn run_script(
    conn: &mut Conn,
    source: &str,
    sha: &str,
    key: &str,
    args: &[&str],
) -> Result<i64> {
    let mut evalsha = redis::cmd("EVALSHA");
    evalsha.arg(sha).arg(1).arg(key).arg(args);
    match evalsha.query_async::<i64>(conn).await {
        Ok(n) => Ok(n),
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            let mut eval = redis::cmd("EVAL");
            eval.arg(source).arg(1).arg(key).arg(args);
            Ok(eval.query_async::<i64>(conn).await?)
        }
        Err(e) => Err(e.into()),
    }
}

/// Releases `full_key` (e.g. `oxidekiq:lock:report:42`) if it still holds `token`; true if it was
/// deleted. One `EVALSHA`.
///
/// For callers that kept the token elsewhere (a job payload, another process) instead of a [`LockGuard`].
/// A stale token deletes nothing.
pub async fn release(conn: &mut Conn, full_key: &str, token: &str) -> Result<bool> {
    Ok(run_script(conn, RELEASE_SCRIPT, &RELEASE_SHA, full_key, &[token]).await? == 1)
}

/// Sets the TTL of `full_key` to `ttl` if it still holds `token`; true if it did, false if the lock
/// is gone or held by someone else.
pub async fn extend(conn: &mut Conn, full_key: &str, token: &str, ttl: Duration) -> Result<bool> {
    let ms = ttl_ms(ttl).to_string();
    Ok(run_script(conn, EXTEND_SCRIPT, &EXTEND_SHA, full_key, &[token, &ms]).await? == 1)
}

/// How a [`RedisLock`] expires and waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockOptions {
    /// How long the lock lives without being extended or released; bounds how long a crashed holder
    /// blocks everyone else. Default 30 s.
    pub ttl: Duration,
    /// The average pause between attempts of [`RedisLock::lock`]; each pause is jittered to
    /// `poll/2 ..= poll*3/2` so waiters do not retry in lockstep. Default 100 ms.
    pub poll: Duration,
    /// How long [`RedisLock::lock`] waits before giving up with [`Error::LockNotAcquired`]. Default 30 s.
    pub timeout: Duration,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: Duration::from_secs(30),
            poll: Duration::from_millis(100),
            timeout: Duration::from_secs(30),
        }
    }
}

/// A named lock in Redis under `oxidekiq:lock:<key>`; every acquisition yields a [`LockGuard`] with its
/// own token.
///
/// Cheap to build; one value may be used for many acquisitions, one after another or from clones.
#[derive(Debug, Clone)]
pub struct RedisLock {
    /// The connection acquisitions go through (cloned into each guard).
    conn: Conn,
    /// The full Redis key, `oxidekiq:lock:<key>`.
    key: String,
    /// TTL and waiting behaviour.
    opts: LockOptions,
    /// For a lock taken for a job ([`RedisLock::held_by`]): a value, `<token>:<jid>`, whose token no
    /// attempt has used yet; every attempt uses a token once.
    value: Option<String>,
    /// Acquire and release go through this batch task ([`crate::lock_batch`]).
    batched: Option<Locks>,
}

impl RedisLock {
    /// A lock on the Redis key `oxidekiq:lock:<key>` (see `keys::lock`).
    pub fn new(conn: Conn, key: &str, opts: LockOptions) -> Self {
        Self::at(conn, keys::lock(key), opts)
    }

    /// A lock on exactly the Redis key `full_key` (a key carried by a payload, or the recovery lock).
    pub(crate) fn at(conn: Conn, full_key: String, opts: LockOptions) -> Self {
        RedisLock {
            conn,
            key: full_key,
            opts,
            value: None,
            batched: None,
        }
    }

    /// Acquires and releases in batches with the other jobs' locks through `locks`' batch task
    /// ([`crate::lock_batch`]): the same commands, fewer round trips. What the job middleware use, with
    /// the handle of the job's context; without one (`None`) each command is sent alone.
    pub(crate) fn batched(mut self, locks: Option<&Locks>) -> Self {
        self.batched = locks.cloned();
        self
    }

    /// Takes the lock for the job `jid`: the stored value is `<token>:<jid>`, so whoever finds it busy
    /// can name the holder ([`RedisLock::holder_jid`]).
    pub fn held_by(mut self, jid: &str) -> Self {
        self.value = Some(job_value(jid));
        self
    }

    /// The full Redis key, `oxidekiq:lock:<key>`.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The options this lock was built with.
    pub fn options(&self) -> &LockOptions {
        &self.opts
    }

    /// One attempt, one `SET NX PX`: the guard if the lock was free, `None` at once if someone holds it.
    pub async fn try_lock(&self) -> Result<Option<LockGuard>> {
        // The stored value is left for `try_lock_owned`; this attempt gets a token of its own.
        let value = match &self.value {
            Some(unspent) => with_fresh_token(unspent),
            None => new_token(),
        };
        let (set, key, token) = self.attempt(self.key.clone(), value).await?;
        Ok(set.then(|| LockGuard {
            conn: self.conn.clone(),
            key,
            token,
            ttl: self.opts.ttl,
            lost: OnceLock::new(),
            keeper: None,
            batched: self.batched.clone(),
        }))
    }

    /// [`RedisLock::try_lock`] that gives the lock up: its key and value (the one [`held_by`] made,
    /// whose token no attempt has used) go into the guard without a copy (a job's lock, taken once per
    /// job); `Err` gives it back when someone else holds it.
    ///
    /// [`held_by`]: RedisLock::held_by
    pub(crate) async fn try_lock_owned(mut self) -> Result<std::result::Result<LockGuard, Self>> {
        let key = std::mem::take(&mut self.key);
        let job = self.value.is_some();
        let value = self.value.take().unwrap_or_else(new_token);
        let (set, key, value) = self.attempt(key, value).await?;
        if set {
            return Ok(Ok(LockGuard {
                conn: self.conn,
                key,
                token: value,
                ttl: self.opts.ttl,
                lost: OnceLock::new(),
                keeper: None,
                batched: self.batched,
            }));
        }
        self.key = key;
        // Its token was used: a later attempt needs another.
        self.value = job.then(|| with_fresh_token(&value));
        Ok(Err(self))
    }

    /// One `SET key value NX PX ttl`, batched or alone; whether it set the key, with the key and the
    /// value back.
    async fn attempt(&self, key: String, value: String) -> Result<(bool, String, String)> {
        let (set, key, value) = match &self.batched {
            Some(locks) => {
                // The request owns the key and the value and comes back with its answer: they go
                // into the guard without another copy.
                let req = crate::lock_batch::Acquire {
                    key,
                    value,
                    ttl_ms: ttl_ms(self.opts.ttl),
                };
                let (set, req) = locks.batcher().acquire_owned(&self.conn, req).await;
                (set?, req.key, req.value)
            }
            // Boxed, as every path a job's lock does not take: the futures of redis-rs's commands
            // would otherwise make every locked job's future (allocated and moved per job) larger.
            None => Box::pin(self.set_alone(key, value)).await?,
        };
        crate::prom::metrics().lock_attempt(set);
        Ok((set, key, value))
    }

    /// The `SET NX PX` of an attempt, sent alone.
    async fn set_alone(&self, key: String, value: String) -> Result<(bool, String, String)> {
        let reply = redis::cmd("SET")
            .arg(&key)
            .arg(&value)
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms(self.opts.ttl))
            .query_async::<Option<redis::Value>>(&mut self.conn.clone())
            .await?;
        Ok((reply.is_some(), key, value))
    }

    /// Waits for the lock: retries every `poll` (jittered) until it is free, or fails with
    /// [`Error::LockNotAcquired`] once `timeout` has passed.
    pub async fn lock(&self) -> Result<LockGuard> {
        let start = Instant::now();
        // `None`: a timeout past what an `Instant` can hold (`Duration::MAX`, "as long as it
        // takes") waits without a deadline instead of overflowing.
        let deadline = start.checked_add(self.opts.timeout);
        loop {
            if let Some(guard) = self.try_lock().await? {
                return Ok(guard);
            }
            let now = Instant::now();
            let pause = jittered(self.opts.poll);
            let pause = match deadline {
                Some(deadline) if now >= deadline => {
                    return Err(Error::LockNotAcquired(format!(
                        "{} still held by another holder after waiting {:?}",
                        self.key,
                        now - start
                    )));
                }
                Some(deadline) => pause.min(deadline - now),
                None => pause,
            };
            tokio::time::sleep(pause).await;
        }
    }

    /// The token of the current holder, `None` when the lock is free (for logs and tests).
    pub async fn holder(&self) -> Result<Option<String>> {
        let mut conn = self.conn.clone();
        let mut get = redis::cmd("GET");
        get.arg(&self.key);
        // Boxed: read only when a lock is busy (see `try_lock`).
        Ok(Box::pin(get.query_async(&mut conn)).await?)
    }

    /// The jid of the current holder when it took the lock with [`RedisLock::held_by`]; `None` when the
    /// lock is free or its value has another shape.
    pub async fn holder_jid(&self) -> Result<Option<String>> {
        Ok(self
            .holder()
            .await?
            .as_deref()
            .and_then(holder_jid)
            .map(str::to_string))
    }
}

/// The running keeper of a guard.
#[derive(Debug)]
struct Keeper {
    /// Tells the task to stop; dropping it stops the task too.
    stop: oneshot::Sender<()>,
    /// The task, awaited on release and aborted on drop so it never outlives the guard.
    task: JoinHandle<()>,
}

/// Proof of holding a [`RedisLock`]: its token, and optionally a keeper that extends it.
///
/// Release it with [`LockGuard::release`]. Dropping it stops the keeper but leaves the key in Redis until
/// its TTL runs out.
#[derive(Debug)]
pub struct LockGuard {
    /// The connection release and extension go through.
    conn: Conn,
    /// The full Redis key, `oxidekiq:lock:<key>`.
    key: String,
    /// This acquisition's token: the value stored under the key.
    token: String,
    /// The TTL set on acquisition and on every extension.
    ttl: Duration,
    /// Set by the keeper when it finds the lock no longer ours; made when a keeper starts (most
    /// guards never run one).
    lost: OnceLock<Arc<AtomicBool>>,
    /// The extension task, once [`LockGuard::keep_alive`] started it.
    keeper: Option<Keeper>,
    /// Released through this batch task ([`RedisLock::batched`]).
    batched: Option<Locks>,
}

impl LockGuard {
    /// A guard for a lock whose value was set elsewhere (the until-executed claim script).
    pub(crate) fn taken(conn: Conn, key: String, token: String, ttl: Duration) -> Self {
        LockGuard {
            conn,
            key,
            token,
            ttl,
            lost: OnceLock::new(),
            keeper: None,
            batched: None,
        }
    }

    /// This holder's token (32 lowercase hex characters; `<token>:<jid>` for a job's lock).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The full Redis key, `oxidekiq:lock:<key>`.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// True once the keeper found the lock gone or someone else's, or could not extend it for a whole
    /// TTL. Always false without a keeper (nobody checks).
    pub fn is_lost(&self) -> bool {
        self.lost.get().is_some_and(|l| l.load(Ordering::SeqCst))
    }

    /// Starts the keeper: every `ttl / 3` it resets the TTL while the lock is still ours. Calling it
    /// again does nothing. Must be called inside a Tokio runtime (it spawns a task, as every caller of
    /// this crate's async API already is).
    pub fn keep_alive(&mut self) {
        if self.keeper.is_some() {
            return;
        }
        let (stop, mut stopped) = oneshot::channel();
        let period = keeper_period(self.ttl);
        let keep = self.extender(Instant::now());
        let task = tokio::spawn(async move {
            tokio::select! {
                // A message or a dropped sender: either way the guard is done.
                _ = &mut stopped => {}
                () = async {
                    tokio::time::sleep(period).await;
                    keep.await;
                } => {}
            }
        });
        self.keeper = Some(Keeper { stop, task });
    }

    /// Runs `fut` in the caller's task while the same keeper loop extends the lock beside it: nothing
    /// is spawned, so the extension cannot outlive `fut`, and a dropped `fut` stops it too. A lost lock
    /// does not stop `fut` (a running job cannot be stopped safely); the keeper logs it and ends.
    pub async fn hold_while<F: Future>(&self, fut: F) -> F::Output {
        // `fut` is polled first (`biased`), and the keeper builds nothing until its first pause has
        // passed: a job that ends at its first poll never registers a timer or clones its lock's key.
        let keeper = async {
            let started = Instant::now();
            tokio::time::sleep(keeper_period(self.ttl)).await;
            // Boxed: made only once the first pause has passed (see `try_lock`).
            Box::pin(self.extender(started)).await;
        };
        tokio::pin!(fut);
        tokio::select! {
            biased;
            out = &mut fut => out,
            () = keeper => fut.await,
        }
    }

    /// The keeper's loop after its first pause ([`keep_extending`]) for this guard, owning what it
    /// needs; `started` is when the lock was taken.
    fn extender(&self, started: Instant) -> impl Future<Output = ()> + Send + 'static {
        keep_extending(
            self.conn.clone(),
            self.key.clone(),
            self.token.clone(),
            self.ttl,
            Arc::clone(self.lost.get_or_init(Arc::default)),
            started,
        )
    }

    /// Extends the lock once by its TTL; false if it is no longer ours.
    pub async fn extend(&mut self) -> Result<bool> {
        Box::pin(extend(&mut self.conn, &self.key, &self.token, self.ttl)).await
    }

    /// Stops the keeper and releases the lock; true if our token was still there and was deleted,
    /// false if the lock had expired or been taken by someone else.
    pub async fn release(mut self) -> Result<bool> {
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.stop.send(());
            // The task only ends; a JoinError would mean it panicked or was aborted, nothing to undo.
            let _ = keeper.task.await;
        }
        if let Some(locks) = self.batched.take() {
            let req = crate::lock_batch::Release {
                key: std::mem::take(&mut self.key),
                token: std::mem::take(&mut self.token),
            };
            return locks.batcher().release(&self.conn, req).await;
        }
        Box::pin(release(&mut self.conn, &self.key, &self.token)).await
    }

    /// [`LockGuard::release_logged`] without waiting for Redis, for a job's lock whose job has ended: a
    /// batched guard without a keeper task queues its release on the connection's batch task
    /// (`lock_batch`), which sends it with the next batch and logs its outcome the same way; the
    /// launcher flushes that queue before the process exits. Any other guard is released and logged
    /// here.
    pub(crate) async fn release_detached(self) {
        if let Some(rest) = self.queue_release() {
            rest.await;
        }
    }

    /// Queues the release on the batch task ([`LockGuard::release_detached`]); what is left to await
    /// when it cannot be queued (a keeper task runs, the guard is not batched, the task is gone), boxed:
    /// a job's lock never takes that path, and its future stays small.
    fn queue_release(mut self) -> Option<Detached> {
        let Some(locks) = self.batched.take().filter(|_| self.keeper.is_none()) else {
            return Some(Box::pin(self.release_logged()));
        };
        let req = crate::lock_batch::Release {
            key: std::mem::take(&mut self.key),
            token: std::mem::take(&mut self.token),
        };
        locks.batcher().release_detached(&self.conn, req)
    }

    /// [`LockGuard::release`] for a job's lock: a failure is logged, not returned. The key then expires
    /// by its TTL, and the job's own result matters more than its lock's clean-up.
    pub(crate) async fn release_logged(self) {
        let key = self.key.clone();
        // No span of its own: the line is written in the caller's (the job's).
        crate::lock_batch::log_release(&tracing::Span::none(), &key, self.release().await);
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(keeper) = self.keeper.take() {
            keeper.task.abort();
        }
    }
}

/// The keeper's pause between extensions: a third of the TTL, at least 1 ms.
fn keeper_period(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(1))
}

/// The keeper's loop after its first pause (callers wait `ttl / 3` first, so a short job's lock costs
/// nothing between its acquire and its release): extends now, then every `ttl / 3`, and returns once
/// the lock is lost (someone else's token, or no extension succeeded for a whole TTL).
/// `last_extended` is when the lock was taken.
async fn keep_extending(
    mut conn: Conn,
    key: String,
    token: String,
    ttl: Duration,
    lost: Arc<AtomicBool>,
    mut last_extended: Instant,
) {
    let period = keeper_period(ttl);
    loop {
        match extend(&mut conn, &key, &token, ttl).await {
            Ok(true) => last_extended = Instant::now(),
            Ok(false) => {
                tracing::warn!(lock = %key, "lock lost: the key expired or holds another token");
                lost.store(true, Ordering::SeqCst);
                crate::prom::metrics().lock_lost();
                return;
            }
            Err(e) => {
                if last_extended.elapsed() >= ttl {
                    tracing::warn!(lock = %key, error = %e, "lock lost: could not extend it for a whole ttl");
                    lost.store(true, Ordering::SeqCst);
                    crate::prom::metrics().lock_lost();
                    return;
                }
                tracing::warn!(lock = %key, error = %e, "lock extension failed, will retry");
            }
        }
        tokio::time::sleep(period).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoding::hex;

    #[test]
    fn script_sha1_is_lowercase_hex_of_the_source() {
        assert_eq!(script_sha1(""), "da39a3ee5e6b4b0d3255bfef95601890afd80709");
        assert_eq!(
            script_sha1("abc"),
            "a9993e364706816aba3e25717850c26c9cd0d89d"
        );
    }

    #[test]
    fn push_hex_writes_what_hex_writes() {
        let bytes: Vec<u8> = (0..=255u8).chain(0..=255u8).collect();
        for n in [0, 1, 16, 20, 31, 32, 33, 255, bytes.len()] {
            let mut out = String::from("x");
            push_hex(&mut out, &bytes[..n]);
            assert_eq!(out, format!("x{}", hex(&bytes[..n])));
        }
    }

    #[test]
    fn tokens_are_32_lowercase_hex_digits_and_never_repeat() {
        let tokens: Vec<String> = (0..10_000).map(|_| new_token()).collect();
        for t in &tokens {
            assert_eq!(t.len(), 32, "{t}");
            assert!(
                t.chars()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
                "{t}"
            );
        }
        let distinct: std::collections::HashSet<&String> = tokens.iter().collect();
        assert_eq!(distinct.len(), tokens.len());
        // Every token of this process shares its prefix; the counter makes the difference.
        assert!(tokens.iter().all(|t| t[..16] == tokens[0][..16]));
    }

    #[test]
    fn jitter_stays_within_half_to_one_and_a_half_poll() {
        let poll = Duration::from_millis(100);
        for _ in 0..1000 {
            let p = jittered(poll);
            assert!(p >= Duration::from_millis(50) && p <= Duration::from_millis(150));
        }
    }

    #[test]
    fn the_holder_jid_follows_the_token() {
        let v = job_value("deadbeef");
        assert_eq!(holder_jid(&v), Some("deadbeef"));
        assert_eq!(v.len(), 32 + 1 + 8);
        assert_eq!(holder_jid("plain-token"), None);
    }

    #[test]
    fn a_zero_ttl_becomes_one_millisecond() {
        assert_eq!(ttl_ms(Duration::ZERO), 1);
        assert_eq!(ttl_ms(Duration::from_millis(300)), 300);
    }
}
