//! Events the runtime's periodic loops announce, for tests to wait on instead of time windows (River's
//! `TestSignal`s): "two heartbeats later", "after a poller pass", not "after 3 seconds", which a loaded
//! machine makes too short. Each launcher has its own [`Events`], carried by its
//! [`ShutdownSignal`](crate::shutdown::ShutdownSignal), so the loops need nothing new to announce; a test
//! subscribes through [`Handle::events`](crate::launcher::Handle::events).
//!
//! Free in production: while nobody listens, announcing is one atomic load. Events are announced per
//! pass of a loop, never per job.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::broadcast;

/// What a loop just finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Event {
    /// A heartbeat was written (the process hash, and the liveness key where the fetch keeps one), or
    /// failed to be: either way one beat's interval has passed.
    Beat,
    /// The scheduled poller finished a pass over `retry` and `schedule`.
    PollerPass,
    /// An orphan recovery pass ended.
    RecoveryPass,
    /// The cron poller finished a round.
    CronRound,
}

/// One launcher's announcements. Cloning shares them.
#[derive(Debug, Clone)]
pub(crate) struct Events {
    /// The channel and its listener count.
    inner: Arc<Inner>,
}

/// What clones of [`Events`] share.
#[derive(Debug)]
struct Inner {
    /// Where announcements go while someone listens.
    tx: broadcast::Sender<Event>,
    /// How many [`Listener`]s exist: announcing skips the channel while there are none.
    listeners: AtomicUsize,
}

impl Default for Events {
    fn default() -> Self {
        Self::new()
    }
}

impl Events {
    /// Events nobody listens to yet.
    pub(crate) fn new() -> Self {
        let (tx, _) = broadcast::channel(256);
        Events {
            inner: Arc::new(Inner {
                tx,
                listeners: AtomicUsize::new(0),
            }),
        }
    }

    /// Announces `event` to every listener; nothing while there is none.
    pub(crate) fn announce(&self, event: Event) {
        if self.inner.listeners.load(Ordering::Relaxed) > 0 {
            let _ = self.inner.tx.send(event);
        }
    }

    /// A listener that sees every event announced from now on.
    pub(crate) fn subscribe(&self) -> Listener {
        self.inner.listeners.fetch_add(1, Ordering::Relaxed);
        Listener {
            rx: self.inner.tx.subscribe(),
            events: self.clone(),
        }
    }
}

/// One subscriber's view of a launcher's [`Events`].
#[derive(Debug)]
pub struct Listener {
    /// Its receiver.
    rx: broadcast::Receiver<Event>,
    /// Whose listener it is (to count it out on drop).
    events: Events,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.events.inner.listeners.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Listener {
    /// Waits until `event` has been announced `n` times since the subscription (or the last wait), for
    /// at most `limit`. Returns whether it was. Events lost to a slow listener count as seen: a listener
    /// that fell behind by 256 announcements has certainly seen `n` passes of any loop go by.
    pub async fn wait_for(&mut self, event: Event, n: usize, limit: Duration) -> bool {
        let mut seen = 0;
        let waited = tokio::time::timeout(limit, async {
            while seen < n {
                match self.rx.recv().await {
                    Ok(e) if e == event => seen += 1,
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => seen = n,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        })
        .await;
        waited.is_ok() && seen >= n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_listener_counts_only_its_event_and_nothing_is_sent_without_one() {
        let events = Events::new();
        events.announce(Event::Beat); // nobody listens: dropped
        let mut l = events.subscribe();
        events.announce(Event::PollerPass);
        events.announce(Event::Beat);
        events.announce(Event::Beat);
        assert!(l.wait_for(Event::Beat, 2, Duration::from_secs(1)).await);
        assert!(
            !l.wait_for(Event::Beat, 1, Duration::from_millis(50)).await,
            "no third beat was announced"
        );
        assert!(
            !l.wait_for(Event::CronRound, 1, Duration::from_millis(50))
                .await
        );
        drop(l);
        assert_eq!(events.inner.listeners.load(Ordering::Relaxed), 0);
    }
}
