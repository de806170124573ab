//! Shutdown as a value: one [`Shutdown`] owned by the launcher, [`ShutdownSignal`]s everywhere else.
//!
//! Mirrors the phases of `launcher.rb`/`manager.rb`: running → quiet (stop fetching, finish what runs)
//! → stopping (deadline set) → cancelled (the deadline passed: running jobs are told to stop, and their
//! payloads are pushed back). Every loop `select!`s on the signal; a worker sees it through its
//! [`JobContext`](crate::worker::JobContext).

use crate::events::Events;
use tokio::sync::watch;

/// The process's phase; later phases imply the earlier ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Fetching and running jobs.
    Running,
    /// No new jobs are fetched; running ones finish (TSTP, or the Web UI's Quiet).
    Quiet,
    /// TERM/INT: quiet, and running jobs have until the deadline.
    Stopping,
    /// The deadline passed: running jobs should stop now; their payloads are pushed back.
    Cancelled,
}

/// A control request, whatever its source (OS signal, the Web UI's `<identity>-signals`, a test).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Stop fetching; finish running jobs (TSTP, Web UI Quiet).
    Quiet,
    /// Stop: quiet, then running jobs get until the deadline (TERM, INT, Web UI Stop).
    Stop,
    /// Log the running jobs (TTIN).
    Dump,
}

impl Control {
    /// The control a signal name stands for (`TSTP`, `TERM`, `INT`, `TTIN`), as the Web UI sends them.
    pub fn from_signal(name: &str) -> Option<Control> {
        match name.trim_start_matches("SIG") {
            "TSTP" | "USR1" => Some(Control::Quiet),
            "TERM" | "INT" => Some(Control::Stop),
            "TTIN" | "INFO" => Some(Control::Dump),
            _ => None,
        }
    }
}

/// The launcher's handle, which moves the phase forward (never back).
#[derive(Debug)]
pub(crate) struct Shutdown {
    /// Sender side of the phase channel.
    tx: watch::Sender<Phase>,
    /// What the launcher's loops announce for tests ([`crate::events`]).
    events: Events,
}

/// A read-only view of the phase that loops and jobs wait on.
#[derive(Debug, Clone)]
pub struct ShutdownSignal {
    /// Receiver side of the phase channel.
    rx: watch::Receiver<Phase>,
    /// The launcher's announcements, which every loop holding this signal can make.
    events: Events,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// A new handle in the `Running` phase.
    pub(crate) fn new() -> Self {
        let (tx, _rx) = watch::channel(Phase::Running);
        Shutdown {
            tx,
            events: Events::new(),
        }
    }

    /// A signal to hand to a loop or a job.
    pub(crate) fn signal(&self) -> ShutdownSignal {
        ShutdownSignal {
            rx: self.tx.subscribe(),
            events: self.events.clone(),
        }
    }

    /// Moves to `phase` if it is later than the current one.
    pub(crate) fn advance(&self, phase: Phase) {
        self.tx.send_if_modified(|p| {
            if phase > *p {
                *p = phase;
                true
            } else {
                false
            }
        });
    }

    /// The current phase.
    pub(crate) fn phase(&self) -> Phase {
        *self.tx.borrow()
    }
}

impl ShutdownSignal {
    /// The launcher's announcements for tests ([`crate::events`]).
    pub(crate) fn events(&self) -> &Events {
        &self.events
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        *self.rx.borrow()
    }

    /// True once the process is quiet or stopping: do not start new work.
    pub fn is_quiet(&self) -> bool {
        self.phase() >= Phase::Quiet
    }

    /// True once TERM/INT arrived: a long job may want to wrap up.
    pub fn is_stopping(&self) -> bool {
        self.phase() >= Phase::Stopping
    }

    /// True once the shutdown deadline passed: a running job should stop now (its payload is pushed
    /// back). The check for synchronous code, which cannot await [`ShutdownSignal::cancelled`].
    pub fn is_cancelled(&self) -> bool {
        self.phase() >= Phase::Cancelled
    }

    /// Waits until the phase reaches `phase` (at once if it already has).
    pub async fn reached(&mut self, phase: Phase) {
        // An Err means the launcher dropped its handle: treat that as the end of everything.
        let _ = self.rx.wait_for(|p| *p >= phase).await;
    }

    /// Waits until the process stops fetching.
    pub async fn quiet(&mut self) {
        self.reached(Phase::Quiet).await
    }

    /// Waits until running jobs are told to stop (the shutdown deadline passed).
    pub async fn cancelled(&mut self) {
        self.reached(Phase::Cancelled).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn phases_only_move_forward_and_wake_waiters() {
        let s = Shutdown::new();
        let mut sig = s.signal();
        assert!(!sig.is_quiet());
        s.advance(Phase::Stopping);
        s.advance(Phase::Quiet);
        assert_eq!(s.phase(), Phase::Stopping);
        sig.quiet().await;
        assert!(sig.is_stopping());
        let mut sig2 = sig.clone();
        let waiter = tokio::spawn(async move { sig2.cancelled().await });
        s.advance(Phase::Cancelled);
        waiter.await.unwrap();
    }
}
