//! Release detection: which of the gem's releases (7.1, 8.0, 8.1) the fleet runs.

use super::*;

/// The release of sidekiq-unique-jobs (7.1, 8.0, 8.1) whose rules this process follows, the fleet's:
/// `--unique-jobs-version` when given, else detected from what the fleet writes to Redis (`detect`)
/// at the first job of the gem and kept once found. Not a version number: `FleetGemRelease::current`
/// answers the release.
#[derive(Debug, Default)]
pub struct FleetGemRelease {
    /// `--unique-jobs-version`.
    pub(super) forced: Option<UniqueJobsGem>,
    /// The detected release (0: not yet).
    pub(super) found: AtomicU8,
}

impl FleetGemRelease {
    /// Follows `forced` if given, else what `detect` reads at the first gem job.
    pub fn new(forced: Option<UniqueJobsGem>) -> Self {
        FleetGemRelease {
            forced,
            found: AtomicU8::new(0),
        }
    }

    /// The release to follow now; detected (and logged) at the first call without a forced one. A
    /// detection that fails follows 8.1 for this job and tries again at the next.
    pub(crate) async fn current(&self, conn: &Conn) -> UniqueJobsGem {
        if let Some(g) = self.forced {
            return g;
        }
        match self.found.load(Ordering::Relaxed) {
            71 => return UniqueJobsGem::V7_1,
            80 => return UniqueJobsGem::V8_0,
            81 => return UniqueJobsGem::V8_1,
            _ => {}
        }
        match detect(conn).await {
            Ok((g, why)) => {
                let code = match g {
                    UniqueJobsGem::V7_1 => 71,
                    UniqueJobsGem::V8_0 => 80,
                    UniqueJobsGem::V8_1 => 81,
                };
                if self.found.swap(code, Ordering::Relaxed) == 0 {
                    if why == LIVE_READ {
                        tracing::info!(
                            "sidekiq-unique-jobs: following the rules of gem {} ({why}; \
                             --unique-jobs-version sets it)",
                            g.name()
                        );
                    } else {
                        // A guess: a wrong one changes what a failure does to the lock (7.1 and
                        // 8.0 release it, 8.1 keeps it), so it is said where operators look.
                        tracing::warn!(
                            "sidekiq-unique-jobs: following the rules of gem {} as a guess ({why}; \
                             no {} in Redis): set --unique-jobs-version to the fleet's release",
                            g.name(),
                            keys::UNIQUE_LIVE_VERSION
                        );
                    }
                }
                g
            }
            Err(e) => {
                tracing::warn!(error = %e,
                    "cannot tell which sidekiq-unique-jobs release the fleet runs: 8.1's rules for now");
                UniqueJobsGem::V8_1
            }
        }
    }
}

/// Reads which release of the gem a fleet runs from what it writes (protocol §6): 8.1's client writes
/// `queue_and_lock.lua` changelog entries; a Ruby process older than Sidekiq 7 (or without a version)
/// means 7.1 (8.x needs Sidekiq ≥ 7); `queue.lua` client entries beside Sidekiq ≥ 7 mean 8.0 (or a
/// 7.1 release that allowed Sidekiq 7, whose server rules are the same); nothing to go on: 8.1.
///
/// Before all that, the release each Ruby server of the gem writes to `uniquejobs:live` at start
/// wins: the changelog alone cannot tell 8.1 from 8.0 when the fleet's locks are all runtime ones
/// (8.1's server writes `queue.lua` entries too, and so does oxidekiq).
pub(crate) async fn detect(conn: &Conn) -> Result<(UniqueJobsGem, &'static str)> {
    let mut c = conn.clone();
    let live: Option<String> = match redis::cmd("GET")
        .arg(keys::UNIQUE_LIVE_VERSION)
        .query_async(&mut c)
        .await
    {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(key = keys::UNIQUE_LIVE_VERSION, error = %e,
                "cannot read the sidekiq-unique-jobs release at {} (a string): guessing from the changelog",
                keys::UNIQUE_LIVE_VERSION);
            None
        }
    };
    if let Some(g) = live.as_deref().and_then(release_named) {
        return Ok((g, LIVE_READ));
    }
    let entries: Vec<String> = redis::cmd("ZREVRANGE")
        .arg(keys::UNIQUE_CHANGELOG)
        .arg(0)
        .arg(199)
        .query_async(&mut c)
        .await
        .unwrap_or_default();
    let script_of = |e: &String| {
        serde_json::from_str::<Value>(e)
            .ok()
            .and_then(|v| v.get("script").and_then(Value::as_str).map(str::to_string))
    };
    let scripts: Vec<String> = entries.iter().filter_map(script_of).collect();
    if scripts.iter().any(|s| s == "queue_and_lock.lua") {
        return Ok((
            UniqueJobsGem::V8_1,
            "the changelog holds 8.1's queue_and_lock entries",
        ));
    }
    let survey = crate::fleet::survey(&mut c).await?;
    if survey.unversioned || survey.oldest.is_some_and(|v| v.0 < 7) {
        return Ok((UniqueJobsGem::V7_1, "a Sidekiq older than 7 is alive"));
    }
    if scripts.iter().any(|s| s == "queue.lua") {
        return Ok((
            UniqueJobsGem::V8_0,
            "the changelog holds queue.lua entries beside Sidekiq 7 or later",
        ));
    }
    Ok((
        UniqueJobsGem::V8_1,
        "nothing in Redis tells the release apart: the newest",
    ))
}

/// [`detect`]'s reason when it read the release itself, not a guess from the changelog.
pub(super) const LIVE_READ: &str = "uniquejobs:live, written by the gem's Ruby servers at start";

/// The rules a release of the gem (`7.1.33`, `8.0.13`, `8.1.0`) follows: 8.1 or later → 8.1, 8.0 →
/// 8.0, 7.x → 7.1 (the oldest oxidekiq knows); anything else is not a release.
pub(super) fn release_named(v: &str) -> Option<UniqueJobsGem> {
    let mut parts = v.trim().split('.').map(str::parse::<u32>);
    match (
        parts.next()?.ok()?,
        parts.next().and_then(|m| m.ok()).unwrap_or(0),
    ) {
        (7, _) => Some(UniqueJobsGem::V7_1),
        (8, 0) => Some(UniqueJobsGem::V8_0),
        (m, _) if m >= 8 => Some(UniqueJobsGem::V8_1),
        _ => None,
    }
}
