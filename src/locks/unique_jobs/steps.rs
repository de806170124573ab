//! The gem's steps: one script of ours per step (`queue`, `lock`, `unlock`, the death handler, `replace`),
//! and [`GemLock`], a job's run through them.

use super::*;

/// Shared head of the scripts: the keys (the gem's order, [`keys::unique_family`]), the arguments
/// (jid, pttl, type, limit, lock score, now, max_history, gem release `71`/`80`/`81`, the script's
/// name in the changelog) and `note`, the changelog entry (`ZADD`, trim to `max_history`, `PUBLISH`).
macro_rules! uniq_head {
    () => {
        concat!("\n", include_str!("head.lua"))
    };
}

/// The gem's `queue` step: the digest key names the jid that queues, and the jid joins `:QUEUED`;
/// returns the jid, or the holder's jid when the limit is reached (`Limit exceeded`). One deviation:
/// a jid the digest already names whose token is not in `:QUEUED` (gone, or left in `:PRIMED`) gets
/// it back there (see the script), so a run recovered after a crash between its queue and lock steps
/// is not dropped.
pub(super) const QUEUE_LUA: &str = concat!(uniq_head!(), "\n", include_str!("queue.lua"));

/// The gem's `lock` step: the jid joins `:LOCKED` and the digests set (the expiring set for
/// `until_expired` with a TTL); the waiting lists are cleared (8.1: deleted; 7.1/8.0: this jid removed
/// and a 1 s TTL). Returns the jid, or nil when the limit is reached (`Limited`).
pub(super) const LOCK_LUA: &str = concat!(uniq_head!(), "\n", include_str!("lock.lua"));

/// The gem's `unlock` step. A jid that does not hold the lock while others wait or hold it yields
/// (nil; 8.0 answers the jid). Otherwise the lock's keys go (`until_expired` keeps `:LOCKED`), the
/// digest leaves the digests set, and the wake-up token is pushed: `LPUSH :QUEUED 1`, `PEXPIRE 5000`.
pub(super) const UNLOCK_LUA: &str = concat!(uniq_head!(), "\n", include_str!("unlock.lua"));

/// The gem's death handler (`delete_by_digest`), for the dead job's own locks only: each of the
/// digest `KEYS[1]` and its `:RUN` lock whose digest key or `:LOCKED` hash names the jid `ARGV[1]`
/// loses its keys and its entries in the digests sets (`KEYS[2]`, `KEYS[3]`). The gem deletes both
/// whoever holds them, so a job dying after another job of its digest took the `:RUN` lock frees that
/// running job's lock and lets a third run beside it: oxidekiq keeps a lock another jid holds.
/// Returns how many keys went.
pub(super) const DELETE_LUA: &str = concat!("\n", include_str!("delete.lua"));

/// The `replace` strategy's first half (`delete_job_by_digest`): the first job naming the digest
/// `ARGV[1]` in the queue `KEYS[1]` (read 50 at a time), else in `schedule` (`KEYS[2]`), else in
/// `retry` (`KEYS[3]`), is removed and returned; then, if one was, the digest's lock keys are deleted
/// and its digests entry removed (`KEYS[4]`). Nil when no job names it.
pub(super) const REPLACE_LUA: &str = concat!("\n", include_str!("replace.lua"));

pub(super) static QUEUE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(QUEUE_LUA));
pub(super) static LOCK: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(LOCK_LUA));
pub(super) static UNLOCK: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(UNLOCK_LUA));
pub(super) static DELETE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(DELETE_LUA));
pub(super) static REPLACE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(REPLACE_LUA));

/// The release code the scripts branch on.
pub(super) fn gem_code(gem: UniqueJobsGem) -> &'static str {
    match gem {
        UniqueJobsGem::V7_1 => "71",
        UniqueJobsGem::V8_0 => "80",
        UniqueJobsGem::V8_1 => "81",
    }
}

/// One of the gem's locks of a job: the digest (`<d>` or `<d>:RUN`) and the job's fields.
pub(super) struct GemLock<'a> {
    pub(super) spec: &'a LockConfig,
    pub(super) digest: String,
    pub(super) gem: UniqueJobsGem,
}

impl GemLock<'_> {
    /// Runs one step's script for `jid`: its answer (a jid), or `None`.
    pub(super) async fn step(
        &self,
        conn: &Conn,
        script: &redis::Script,
        name: &str,
        jid: &str,
    ) -> Result<Option<String>> {
        let mut inv = script.prepare_invoke();
        for k in keys::unique_family(&self.digest) {
            inv.key(k);
        }
        inv.arg(jid)
            .arg(self.spec.pttl)
            .arg(&self.spec.lock_name)
            .arg(self.spec.limit)
            .arg(&self.spec.score)
            .arg(time::now().to_string())
            .arg(MAX_HISTORY)
            .arg(gem_code(self.gem))
            .arg(name);
        Ok(inv.invoke_async(&mut conn.clone()).await?)
    }

    /// The gem's `lock!` (`locksmith.rb`): held already by `jid` → true; else `queue`, `:INFO`, the
    /// move from `:QUEUED` to `:PRIMED` (tried for `wait`, once when `None`), `lock`. False when
    /// another jid holds it.
    pub(super) async fn take(
        &self,
        conn: &Conn,
        jid: &str,
        wait: Option<Duration>,
    ) -> Result<bool> {
        let family = keys::unique_family(&self.digest);
        let [_, queued, primed, locked, info, ..] = &family;
        let mut c = conn.clone();
        let held: bool = redis::cmd("HEXISTS")
            .arg(locked)
            .arg(jid)
            .query_async(&mut c)
            .await?;
        if held {
            return Ok(true);
        }
        let queued_jid = self.step(conn, &QUEUE, "queue.lua", jid).await?;
        if !matches!(queued_jid.as_deref(), Some(j) if j == jid || j == "1") {
            return Ok(false);
        }
        if self.spec.info {
            let json = self.spec.info_json(self.gem, time::now());
            redis::cmd("SET")
                .arg(info)
                .arg(json)
                .query_async::<()>(&mut c)
                .await?;
        }
        let deadline = wait.map(|w| tokio::time::Instant::now() + w);
        let primed_jid = loop {
            let moved: Option<String> = redis::cmd("LMOVE")
                .arg(queued)
                .arg(primed)
                .arg("RIGHT")
                .arg("LEFT")
                .query_async(&mut c)
                .await?;
            match (moved, deadline) {
                (Some(m), _) => break m,
                (None, Some(d)) if tokio::time::Instant::now() < d => {
                    tokio::time::sleep(MOVE_POLL).await
                }
                (None, _) => return Ok(false),
            }
        };
        if primed_jid != jid && primed_jid != "1" {
            return Ok(false);
        }
        Ok(self.step(conn, &LOCK, "lock.lua", jid).await?.is_some())
    }

    /// The gem's `unlock`: the jid it answers (`None`: it yielded to other holders).
    pub(super) async fn unlock(&self, conn: &Conn, jid: &str) -> Result<Option<String>> {
        self.step(conn, &UNLOCK, "unlock.lua", jid).await
    }

    /// [`GemLock::unlock`] after the perform: an error is logged (the job stays done or failed as it
    /// ended), naming the key.
    pub(super) async fn release(&self, conn: &Conn, jid: &str) {
        if let Err(e) = self.unlock(conn, jid).await {
            tracing::error!(digest = %crate::redact::clip(&self.digest, crate::redact::NAME_CHARS), error = %e,
                "cannot release the sidekiq-unique-jobs lock {}: it stays until the gem's reaper frees it",
                self.digest);
        }
    }

    /// [`GemLock::release`] only if `jid` holds the lock (`HEXISTS <d>:LOCKED jid`): for a job that is
    /// not performed, whose earlier run (cut by a crash) may have left it. An error is logged.
    pub(super) async fn release_if_held(&self, conn: &Conn, jid: &str) {
        let [_, _, _, locked, ..] = &keys::unique_family(&self.digest);
        let held: redis::RedisResult<bool> = redis::cmd("HEXISTS")
            .arg(locked)
            .arg(jid)
            .query_async(&mut conn.clone())
            .await;
        match held {
            Ok(true) => self.release(conn, jid).await,
            Ok(false) => {}
            Err(e) => {
                tracing::error!(digest = %crate::redact::clip(&self.digest, crate::redact::NAME_CHARS), error = %e,
                    "cannot read the sidekiq-unique-jobs lock {} a crashed run of this job may have left: it stays until the gem's reaper frees it",
                    self.digest)
            }
        }
    }

    /// Takes the lock back for `jid` after a failed perform (`until_executing`,
    /// `until_and_while_executing`, as the gem's `lock(wait: …)`); an error is logged.
    pub(super) async fn relock(&self, conn: &Conn, jid: &str) {
        match self.take(conn, jid, Some(Duration::from_secs(1))).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(digest = %crate::redact::clip(&self.digest, crate::redact::NAME_CHARS), jid,
                "sidekiq-unique-jobs lock (digest) not taken back after the failure: another job holds it")
            }
            Err(e) => {
                tracing::error!(digest = %crate::redact::clip(&self.digest, crate::redact::NAME_CHARS), error = %e,
                "cannot take the sidekiq-unique-jobs lock (digest) back after the failure")
            }
        }
    }
}

/// A Redis error in a step before the perform: the job fails with it (retry path, nothing lost).
pub(super) fn step_failure(digest: &str, e: &crate::Error) -> JobError {
    JobError::new(
        "Oxidekiq::UniqueJobsError",
        format!("sidekiq-unique-jobs lock {digest}: {e}"),
    )
}
