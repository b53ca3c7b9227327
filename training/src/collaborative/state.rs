//! State sync for the collaborative optimizer: serving this peer's state as a donor, and
//! taking a synced state as a joiner.

use tracing::Instrument;

use crate::params::ParamSet;
use crate::sync::{StateServer, StateTarget, StateView, SyncError, SyncedState};

use super::CollaborativeOptimizer;

/// State sync: the donor side and the joiner side.
impl CollaborativeOptimizer {
    /// Makes this peer a donor: `server` gets this peer's state now and after every global step
    /// (gradient mode) or outer step (local SGD), taken at that boundary so it is consistent.
    /// Each refresh copies the state once; it is hashed (off the network's threads) and
    /// announced only when a joiner asks for it or the next announcement is due
    /// ([`StateServer::refresh`]); a failed refresh is logged, never fails the step.
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node, mut opt: starling_training::CollaborativeOptimizer, params: starling_training::ParamSet) -> Result<(), starling_training::SyncError> {
    /// use starling_training::{StateServer, StateServerConfig};
    /// opt.serve_state(StateServer::start(node, StateServerConfig::new("my-run"))?, &params).await;
    /// # Ok(()) }
    /// ```
    pub async fn serve_state(&mut self, server: StateServer, params: &ParamSet) {
        self.state_server = Some(server);
        self.refresh_served_state(params).await;
        // The first state is served when this returns.
        if let Some(task) = self.serving.take() {
            let _ = task.await;
        }
    }

    /// This peer's state as state sync moves it: the epoch, the parameters and, in gradient
    /// mode, the shared optimizer (`"opt"`); in local SGD, the outer optimizer (`"outer"`),
    /// since inner optimizer state is each peer's own. Joiners pass its
    /// [`layout`](StateView::layout) to [`sync_state`](crate::sync::sync_state).
    pub fn state_view<'a>(&'a self, params: &'a ParamSet) -> StateView<'a> {
        let view = StateView::new(self.epoch, params);
        match &self.outer {
            None => view.optimizer("opt", self.optimizer.as_ref()),
            Some((outer, _)) => view.optimizer("outer", outer),
        }
    }

    /// Writes a synced state into `params` and this optimizer (checking its layout first:
    /// on a mismatch nothing is written), takes its epoch, and starts the epoch afresh (no
    /// accumulated samples or gradients; in local SGD, a new phase from the synced parameters).
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node, mut opt: starling_training::CollaborativeOptimizer, mut params: starling_training::ParamSet) -> Result<(), starling_training::SyncError> {
    /// use starling_training::{sync_state, SyncConfig};
    /// let layout = opt.state_view(&params).layout();
    /// let (synced, _report) = sync_state(&node, &SyncConfig::new("my-run"), &layout).await?;
    /// opt.restore_from(&mut params, &synced)?;
    /// assert_eq!(opt.epoch(), synced.epoch());
    /// # Ok(()) }
    /// ```
    pub fn restore_from(
        &mut self,
        params: &mut ParamSet,
        synced: &SyncedState,
    ) -> Result<(), SyncError> {
        let target = StateTarget::new(params);
        let epoch = match self.outer.as_mut() {
            None => target
                .optimizer("opt", self.optimizer.as_mut())
                .apply(synced)?,
            Some((outer, anchor)) => {
                let epoch = target.optimizer("outer", outer).apply(synced)?;
                anchor.copy_from_slice(params.params());
                epoch
            }
        };
        // A delayed update's round in flight belonged to the state just replaced.
        self.cancel_pending();
        self.epoch = epoch;
        self.behind_of = None;
        self.accumulated.fill(0.0);
        // What earlier rounds owed belongs to the state this peer left behind.
        self.residuals.reset();
        // Built afresh at the next round (`Q` from the seed, no residual).
        self.compressor = None;
        self.samples = 0;
        self.inner = 0;
        self.swarm = None;
        // (A sync that follows a stale one keeps its count: at most `STALE_SYNC_RETRIES`
        // syncs again before the next step.)
        self.fresh_sync = Some(self.fresh_sync.unwrap_or(0));
        Ok(())
    }

    /// Gives the state server, if any, the state at this step boundary: the copy is taken
    /// now and handed over in the background (the first one is hashed and announced there),
    /// so the step does not wait, unless the previous refresh still runs: that one is waited
    /// for first, so refreshes land in order and the last state is always served.
    pub(super) async fn refresh_served_state(&mut self, params: &ParamSet) {
        let Some(server) = self.state_server.clone() else {
            return;
        };
        if let Some(previous) = self.serving.take() {
            let _ = previous.await;
        }
        let epoch = self.epoch;
        match self.state_view(params).capture() {
            Ok(snapshot) => {
                let refresh = async move {
                    if let Err(e) = server.refresh(snapshot).await {
                        tracing::warn!(epoch, "state sync: serving the new state failed: {e}");
                    }
                };
                self.serving = Some(tokio::spawn(refresh.in_current_span()));
            }
            Err(e) => tracing::warn!(epoch, "state sync: serving the new state failed: {e}"),
        }
    }
}
