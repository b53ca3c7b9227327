//! The handle of a background gossip loop.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use starling_node::lock::lock;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{GossipBuffer, GossipReport, Shared};

/// A background gossip loop
/// ([`GossipAverager::start_background`](super::GossipAverager::start_background)).
/// [`GossipHandle::stop`] ends it after the round in flight; dropping the handle aborts it at
/// once (an exchange cut in its last message can then leave the pair's mass moved by one
/// update, see the module docs).
pub struct GossipHandle {
    pub(super) shared: Arc<Shared>,
    pub(super) buffer: GossipBuffer,
    pub(super) stop: watch::Sender<bool>,
    pub(super) reports: watch::Receiver<Option<GossipReport>>,
    pub(super) task: Option<JoinHandle<()>>,
}

impl GossipHandle {
    /// Rounds the averager has run (this loop's and earlier steps').
    pub fn rounds(&self) -> u64 {
        self.shared.rounds.load(Ordering::Relaxed)
    }

    /// The last round's report.
    pub fn last_report(&self) -> Option<GossipReport> {
        self.reports.borrow().clone()
    }

    /// Stops the loop after the round in flight (bounded by its exchange timeouts) and stops
    /// answering exchanges on the buffer.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.release();
    }

    fn release(&self) {
        let mut served = lock(&self.shared.served);
        if served.as_ref().is_some_and(|s| s.buffer.same(&self.buffer)) {
            *served = None;
        }
        self.shared.background.store(false, Ordering::Release);
    }
}

impl Drop for GossipHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.release();
    }
}
