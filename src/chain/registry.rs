//! The registry: Ruby class name → type-erased handler, with each worker's frozen middleware chain.
//!
//! Type erasure happens here, once: a `Worker<Args>` becomes an `Arc<dyn Handler>` that decodes the
//! arguments and calls `perform`. The chain of each worker (global middleware, then the worker's own) is
//! built when the registry is frozen and never changes afterwards, so running a job takes no lock.

pub(crate) mod args_check;

use std::marker::PhantomData;
use std::sync::Arc;

use crate::error::{JobError, JobResult};
use crate::middleware::concurrency::LocalConcurrencyLimit;
use crate::middleware::lock_key::{Keyed, LockKey};
use crate::middleware::{BoxFuture, Chain, Handler, ServerMiddleware};
use crate::worker::{JobContext, Worker, WorkerOptions};

// Its home is the support layer (`redact`); kept at this public path.
pub use crate::redact::redact_values;

/// Wraps a [`Worker`] as a [`Handler`].
struct WorkerHandler<W>(Arc<W>);

impl<W> std::fmt::Debug for WorkerHandler<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("WorkerHandler")
            .field(&std::any::type_name::<W>())
            .finish()
    }
}

impl<W: Worker> Handler for WorkerHandler<W> {
    fn call<'a>(&'a self, ctx: &'a JobContext) -> BoxFuture<'a, JobResult> {
        Box::pin(perform_decoded(self.0.as_ref(), ctx))
    }
}

/// The end of every chain: decodes the job's arguments as `W::Args` (an `ArgumentError` naming the
/// type when they do not fit, as Ruby's `perform` with the wrong arity) and runs `worker`, under
/// Sidekiq's `cancel!` when the job's context can be cancelled ([`crate::worker::run_cancellable`]).
pub(crate) async fn perform_decoded<W: Worker>(worker: &W, ctx: &JobContext) -> JobResult {
    let args: W::Args = ctx.args().map_err(|e| {
        JobError::new(
            "ArgumentError",
            format!(
                "arguments do not fit {}'s type {}: {}",
                W::CLASS,
                std::any::type_name::<W::Args>(),
                redact_values(&e.to_string())
            ),
        )
    })?;
    crate::worker::run_cancellable(ctx, worker.perform(ctx, args)).await
}

/// One registered worker class.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Runs the worker.
    pub handler: Arc<dyn Handler>,
    /// The worker's own middleware, run after the global ones.
    own: Vec<Arc<dyn ServerMiddleware>>,
    /// Global then own middleware; filled by [`Registry::freeze`].
    pub chain: Chain,
    /// The worker's `sidekiq_options`.
    pub options: WorkerOptions,
    /// [`Worker::SYNCHRONOUS`]: a timeout reports the job instead of cancelling it.
    pub(crate) synchronous: bool,
    /// [`Worker::CHECKS_CANCEL`]: the heartbeat's cancel check leaves its jobs alone.
    pub(crate) checks_cancel: bool,
    /// Decodes a payload's arguments as the worker's `Args` without running it (`oxidekiq check`).
    pub(crate) check_args: args_check::ArgsCheck,
}

#[cfg(test)]
mod tests {
    use crate::{JobContext, JobResult, NoArgs, Worker};

    #[derive(Debug)]
    struct Charge;
    impl Worker for Charge {
        const CLASS: &'static str = "ChargeJob";
        type Args = NoArgs;
        async fn perform(&self, _: &JobContext, _: NoArgs) -> JobResult {
            Ok(())
        }
    }

    #[test]
    fn a_class_registered_twice_is_an_error_naming_it_not_a_silent_replacement() {
        let mut r = super::Registry::new();
        r.register(Charge)
            .with(crate::UniqueJob::new())
            .register(Charge)
            .with(crate::SequentialJob::new());
        let e = r.freeze().unwrap_err().to_string();
        assert!(e.contains("ChargeJob"), "{e}");
        assert!(e.contains("more than once"), "{e}");
        let mut once = super::Registry::new();
        once.register(Charge).with(crate::UniqueJob::new());
        assert_eq!(
            once.freeze().unwrap().get("ChargeJob").unwrap().chain.len(),
            1
        );
    }
}

/// Ruby class name → worker: every worker the process runs, with its own middleware (locks, limits)
/// and the middleware that runs around all of them.
///
/// ```
/// use std::time::Duration;
///
/// use oxidekiq::{JobContext, JobResult, NoArgs, Registry, SequentialJob, Worker};
///
/// #[derive(Debug)]
/// struct SyncJob;
/// impl Worker for SyncJob {
///     const CLASS: &'static str = "SyncJob";
///     type Args = (u64,);
///     async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult { Ok(()) }
/// }
///
/// #[derive(Debug)]
/// struct ReportJob;
/// impl Worker for ReportJob {
///     const CLASS: &'static str = "ReportJob";
///     type Args = NoArgs;
///     async fn perform(&self, _ctx: &JobContext, _args: NoArgs) -> JobResult { Ok(()) }
/// }
///
/// let mut registry = Registry::new();
/// registry
///     .register(SyncJob)
///     .register(ReportJob)
///     .with(SequentialJob::new().timeout(Duration::from_secs(120))); // one ReportJob at a time
/// assert_eq!(registry.classes(), ["ReportJob", "SyncJob"]);
/// ```
#[derive(Debug, Default, Clone)]
pub struct Registry {
    /// Registered workers by Ruby class name. Looked up for every job: foldhash, not the standard
    /// SipHash (about 200 instructions a lookup of a short class name, against about 50).
    workers: foldhash::HashMap<String, Entry>,
    /// Middleware that runs around every worker, in order.
    global: Vec<Arc<dyn ServerMiddleware>>,
    /// Classes registered more than once: [`Registry::freeze`] refuses them, since a second
    /// registration would otherwise replace the first and drop its locks and limits without a word.
    twice: Vec<String>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `worker` under [`Worker::CLASS`]. Returns the worker's [`Registration`], to add its
    /// locks and limits with [`Registration::with`] and [`Registration::with_key`].
    ///
    /// A class is registered once, with all its middleware on that one registration: a second
    /// `register` of the same class keeps the first (the second's middleware go nowhere) and makes
    /// [`Registry::freeze`] fail with an error naming the class.
    pub fn register<W: Worker>(&mut self, worker: W) -> Registration<'_, W> {
        if self.workers.contains_key(W::CLASS) {
            if !self.twice.iter().any(|c| c == W::CLASS) {
                self.twice.push(W::CLASS.to_string());
            }
            return Registration {
                registry: self,
                first: false,
                _worker: PhantomData,
            };
        }
        let options = worker.options();
        self.workers.insert(
            W::CLASS.to_string(),
            Entry {
                handler: Arc::new(WorkerHandler(Arc::new(worker))),
                own: Vec::new(),
                chain: Arc::from(Vec::new()),
                options,
                synchronous: W::SYNCHRONOUS,
                checks_cancel: W::CHECKS_CANCEL,
                check_args: args_check::check_args::<W::Args>,
            },
        );
        Registration {
            registry: self,
            first: true,
            _worker: PhantomData,
        }
    }

    /// Adds middleware that runs around every worker.
    pub fn middleware(&mut self, m: impl ServerMiddleware) -> &mut Self {
        self.global.push(Arc::new(m));
        self
    }

    /// Builds every worker's chain; the registry is not changed afterwards. Fails, naming the class,
    /// when a class was registered more than once ([`Registry::register`]).
    ///
    /// A worker with [`WorkerOptions::local_concurrency`] gets a [`LocalConcurrencyLimit`] of its own
    /// first in its chain: a job waiting for the local cap holds no lock or limit slot taken further on.
    /// (Before any of them, [`Next::new`](crate::middleware::Next::new) runs the server half of the
    /// client's until-executed locks.)
    pub fn freeze(mut self) -> crate::Result<Arc<Registry>> {
        if !self.twice.is_empty() {
            return Err(crate::Error::Config(format!(
                "worker class {} is registered more than once: a second `register` would replace the \
                 first and its locks and limits; register each class once, with all its middleware \
                 on that one registration",
                self.twice.join(", ")
            )));
        }
        let global = self.global.clone();
        for entry in self.workers.values_mut() {
            let local = entry
                .options
                .local_concurrency
                .map(|k| Arc::new(LocalConcurrencyLimit::new(k)) as Arc<dyn ServerMiddleware>);
            let chain: Vec<_> = local
                .into_iter()
                .chain(global.iter().cloned())
                .chain(entry.own.iter().cloned())
                .collect();
            entry.chain = Arc::from(chain);
        }
        Ok(Arc::new(self))
    }

    /// The worker registered for a class name.
    pub fn get(&self, class: &str) -> Option<&Entry> {
        self.workers.get(class)
    }

    /// The registered class names, sorted.
    pub fn classes(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.workers.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }
}

/// One worker just registered: adds its own middleware (locks, limits), in the spirit of tower's
/// `layer`. The worker's type is known here, so a key computed from its arguments is a closure over
/// `&W::Args` whose type needs no spelling out:
///
/// ```
/// use std::time::Duration;
/// use oxidekiq::middleware::{concurrency::ConcurrencyLimit, rate_limit::RateLimit, unique::UniqueJob};
/// use oxidekiq::{JobContext, Registry, Worker, error::JobResult};
///
/// #[derive(Debug)]
/// struct ChargeJob;
/// impl Worker for ChargeJob {
///     const CLASS: &'static str = "ChargeJob";
///     type Args = (u64, f64, String);
///     async fn perform(&self, _: &JobContext, _: Self::Args) -> JobResult { Ok(()) }
/// }
///
/// let mut registry = Registry::new();
/// registry
///     .register(ChargeJob)
///     .with_key(UniqueJob::new(), |(customer, ..)| format!("stripe-{customer}"))
///     .with_key(ConcurrencyLimit::new(3), |(customer, ..)| format!("stripe-{customer}"))
///     .with(RateLimit::new("payment-api", 100, Duration::from_secs(60)));
/// ```
///
/// Middleware run in the order they are added, after the global ones ([`Registry::middleware`]).
#[derive(Debug)]
pub struct Registration<'r, W> {
    /// The registry the worker was added to.
    registry: &'r mut Registry,
    /// False for a second registration of a class: its middleware are not added to the first's (the
    /// registry refuses to freeze anyway).
    first: bool,
    /// The worker whose arguments key closures read.
    _worker: PhantomData<fn() -> W>,
}

impl<'r, W: Worker> Registration<'r, W> {
    /// Adds a middleware of this worker's own: a lock, a limit, or any [`ServerMiddleware`].
    pub fn with(self, middleware: impl ServerMiddleware) -> Self {
        if !self.first {
            return self;
        }
        if let Some(entry) = self.registry.workers.get_mut(W::CLASS) {
            entry.own.push(Arc::new(middleware));
        }
        self
    }

    /// Adds a lock or limit named by `key` from each job's arguments (decoded as the worker's own
    /// `Args`; arguments that do not fit fail the job with `ArgumentError`).
    pub fn with_key<L, F>(self, layer: L, key: F) -> Self
    where
        L: Keyed + ServerMiddleware,
        F: Fn(&W::Args) -> String + Send + Sync + 'static,
    {
        self.with(layer.keyed(LockKey::by_args(key)))
    }

    /// Registers another worker (so registrations chain: `.register(A).register(B)`).
    pub fn register<V: Worker>(self, worker: V) -> Registration<'r, V> {
        self.registry.register(worker)
    }
}
