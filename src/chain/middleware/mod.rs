//! The server middleware chain, built once per worker class and then frozen.
//!
//! Mirrors `middleware/chain.rb`, with one difference Sidekiq itself documents: retry is not an entry in
//! the chain, it wraps it from outside (the processor fixes the outer order: job span → retry → stats →
//! [`until_executed::UntilExecuted`] → user chain → handler). Until-executed is built in: every chain
//! starts with it ([`Next::new`]), and it does nothing for a payload without a `unique_key`. A
//! middleware that must know a failed job's fate asks for it with [`JobContext::after_fate`]. A
//! middleware receives the job's [`JobContext`] and a [`Next`] it may call or not; not calling it is how
//! a duplicate "falls through".
//!
//! ```
//! use oxidekiq::middleware::{BoxFuture, Next, ServerMiddleware};
//! use oxidekiq::{JobContext, error::JobResult};
//!
//! #[derive(Debug)]
//! struct Timing;
//!
//! impl ServerMiddleware for Timing {
//!     fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
//!         Box::pin(async move {
//!             let start = std::time::Instant::now();
//!             let result = next.run(ctx).await;
//!             tracing::info!(jid = ctx.jid(), elapsed = ?start.elapsed(), "timed");
//!             result
//!         })
//!     }
//! }
//! ```

pub mod concurrency;
mod limits;
pub mod lock_key;
pub mod rate_limit;
pub mod sequential;
pub mod unique;
pub mod until_executed;

pub use lock_key::{Keyed, LockKey};

use std::sync::Arc;

use crate::error::JobResult;
use crate::worker::JobContext;

// Defined with the worker (the lowest module of the job chain, whose after-fate hooks return one);
// kept at this public path.
pub use crate::worker::BoxFuture;

/// One link of the server chain (Sidekiq's server middleware): called with the job and the rest of
/// the chain. Added for every worker with [`Registry::middleware`](crate::Registry::middleware), or for
/// one with [`Registration::with`](crate::Registration::with).
///
/// ```
/// use oxidekiq::{BoxFuture, JobContext, JobResult, Next, Registry, ServerMiddleware};
///
/// /// Skips every job while `maintenance` is set; it is acknowledged as done.
/// #[derive(Debug)]
/// struct Maintenance(bool);
///
/// impl ServerMiddleware for Maintenance {
///     fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
///         if self.0 {
///             tracing::info!(jid = ctx.jid(), "skipped for maintenance");
///             return Box::pin(async { Ok(()) });
///         }
///         next.run(ctx)
///     }
/// }
///
/// let mut registry = Registry::new();
/// registry.middleware(Maintenance(false));
/// ```
pub trait ServerMiddleware: Send + Sync + std::fmt::Debug + 'static {
    /// Runs around the rest of the chain; call `next.run(ctx)` to go on, or return without calling
    /// it to skip the job (it is then acknowledged as done).
    fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult>;
}

/// The type-erased end of the chain: decodes the arguments and runs the worker.
pub trait Handler: Send + Sync + std::fmt::Debug + 'static {
    /// Runs the job.
    fn call<'a>(&'a self, ctx: &'a JobContext) -> BoxFuture<'a, JobResult>;
}

/// A frozen chain of middleware.
pub type Chain = Arc<[Arc<dyn ServerMiddleware>]>;

// The traits must stay object-safe: the chain stores them as trait objects.
fn _obj_safe(_: Box<dyn ServerMiddleware>, _: Box<dyn Handler>) {}

/// The rest of the chain after the current middleware: `next.run(ctx)` runs it and the worker, and
/// gives their result, which a middleware may look at or change.
///
/// ```
/// use oxidekiq::{BoxFuture, JobContext, JobError, JobResult, Next, ServerMiddleware};
///
/// /// Tags every failure's message with the queue it came from.
/// #[derive(Debug)]
/// struct QueueInErrors;
///
/// impl ServerMiddleware for QueueInErrors {
///     fn call<'a>(&'a self, ctx: &'a JobContext, next: Next<'a>) -> BoxFuture<'a, JobResult> {
///         Box::pin(async move {
///             next.run(ctx).await.map_err(|mut e: JobError| {
///                 e.message = format!("[{}] {}", ctx.queue(), e.message);
///                 e
///             })
///         })
///     }
/// }
/// ```
#[derive(Debug)]
pub struct Next<'a> {
    /// The built-in sidekiq-unique-jobs stage has still to run (only at the head of the chain).
    gem_locks: bool,
    /// The built-in until-executed stage has still to run (only at the head of the chain).
    until_executed: bool,
    /// Middleware still to run, in order.
    rest: &'a [Arc<dyn ServerMiddleware>],
    /// The worker at the end.
    handler: &'a dyn Handler,
}

impl<'a> Next<'a> {
    /// The whole chain, ending in `handler`, preceded by the built-in
    /// [`until_executed::UntilExecuted`] stage.
    pub fn new(chain: &'a [Arc<dyn ServerMiddleware>], handler: &'a dyn Handler) -> Self {
        Next {
            gem_locks: true,
            until_executed: true,
            rest: chain,
            handler,
        }
    }

    /// Runs the next middleware, or the worker when none is left.
    pub fn run(self, ctx: &'a JobContext) -> BoxFuture<'a, JobResult> {
        if self.gem_locks {
            let rest = Next {
                gem_locks: false,
                ..self
            };
            // Most payloads are not the gem's: they name neither of its top-level fields, which the
            // decoding noted (no substring search of the payload, no parse).
            if !ctx.job().may_name_gem_lock() {
                return rest.run(ctx);
            }
            return Box::pin(gem_locked(ctx, rest));
        }
        if self.until_executed {
            let rest = Next {
                until_executed: false,
                ..self
            };
            // Most payloads carry no until-executed lock: those skip the stage (and its boxed future).
            if !until_executed::may_hold_lock(ctx.job()) {
                return rest.run(ctx);
            }
            return ServerMiddleware::call(&until_executed::UntilExecuted, ctx, rest);
        }
        match self.rest.split_first() {
            Some((first, rest)) => first.call(
                ctx,
                Next {
                    gem_locks: false,
                    until_executed: false,
                    rest,
                    handler: self.handler,
                },
            ),
            None => self.handler.call(ctx),
        }
    }
}

/// The sidekiq-unique-jobs stage ([`crate::unique_jobs`]): the rest of the chain runs under the gem's
/// lock rules; a job that dies takes its locks with it, as the gem's death handler does.
async fn gem_locked<'a>(ctx: &'a JobContext, rest: Next<'a>) -> JobResult {
    let conn = ctx.redis();
    // Registered before the run, so a panic's fate runs it too (hooks run only after a failure).
    if let Ok(Some(spec)) = crate::unique_jobs::LockConfig::read(ctx.job()) {
        let (conn, digest, jid) = (conn.clone(), spec.digest.clone(), ctx.jid().to_string());
        ctx.after_fate(move |fate: &crate::retry::Fate| {
            let dead = matches!(fate, crate::retry::Fate::Dead);
            Box::pin(async move {
                if dead {
                    crate::unique_jobs::delete_by_digest(conn, digest, jid).await;
                }
            })
        });
    }
    let gem = ctx.unique_jobs_gem().await;
    crate::unique_jobs::execute(&conn, ctx.job(), gem, rest.run(ctx)).await
}

// Moved from tests/limits.rs: concurrency and rate limits on a real Redis (needs crate-internal items).
#[cfg(test)]
mod tests_limits;

// The lock middleware's futures, measured against a real connection (needs crate-internal items).
#[cfg(test)]
mod tests_lock_futures;
