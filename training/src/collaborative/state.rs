//! State sync for the collaborative optimizer: serving this peer's state as a donor, and
//! taking a synced state as a joiner.

use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::params::ParamSet;
use crate::progress::SwarmProgress;
use crate::sync::{ServeHold, StateServer, StateTarget, StateView, SyncError, SyncedState};

use super::{CollaborativeOptimizer, TrainingError};

/// How often a lone peer waiting for a joiner (see `wait_for_joiners`) looks again.
const JOIN_POLL: Duration = Duration::from_millis(5);
/// How long after the joiner's last session closes the lone peer reads the progress for the
/// joiner's announcement ([`CollaborativeOptimizer::announce`], right after it applies the
/// state): one DHT write and read, a few milliseconds on a LAN, but the joiner also applies
/// the state first, and both peers may share a loaded machine (250 ms was once too short on
/// CI's two cores). Costs a lone peer this once when whoever fetched its state does not join.
const JOINER_GRACE: Duration = Duration::from_secs(1);
/// How long after a joiner fetched this peer's state it reads the swarm's progress after every
/// step instead of making the reading up from its round (see `watching_for_joiners`).
const JOINER_WATCH: Duration = Duration::from_millis(250);

/// What a run's only peer found when it looked for joiners (see
/// [`CollaborativeOptimizer::wait_for_joiners`]).
pub(super) enum Lone {
    /// A joiner announced itself: the progress that names it.
    Joined(SwarmProgress),
    /// Still alone: it steps, holding new joiners off the state it leaves (`None` without a
    /// state server, or while a session was taking the state at that instant).
    Alone(Option<ServeHold>),
}

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
        self.refresh_served_state(params, None).await;
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
    /// for first, so refreshes land in order and the last state is always served. `hold`
    /// (from [`Self::wait_for_joiners`]) ends once the new state is in.
    pub(super) async fn refresh_served_state(
        &mut self,
        params: &ParamSet,
        hold: Option<ServeHold>,
    ) {
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
                    drop(hold);
                };
                self.serving = Some(tokio::spawn(refresh.in_current_span()));
            }
            Err(e) => tracing::warn!(epoch, "state sync: serving the new state failed: {e}"),
        }
    }

    /// Whether a joiner fetched this peer's state in the last [`JOINER_WATCH`]. Then the step
    /// reads the swarm's progress for real instead of making it up from its round: the joiner
    /// announces itself once synced, and only a reading that shows it makes the next rounds
    /// wait for it (`expect_peers`). Made up until the next periodic read (`fetch_interval`),
    /// the readings left it out, the swarm stepped on in groups re-formed without it, and the
    /// joiner, an epoch behind after each sync, synced again: up to nine times in a row (a
    /// third glyphs MLP peer joining a pair that stepped every 2 ms).
    pub(super) fn watching_for_joiners(&mut self) -> bool {
        let Some(server) = &self.state_server else {
            return false;
        };
        let served = server.stats().manifests_served;
        let now = std::time::Instant::now();
        if served != self.manifests_noticed {
            // The joiners since the last look (the server remembers the last few).
            let new = served.saturating_sub(self.manifests_noticed) as usize;
            let recent = server.recent_joiners();
            let skip = recent.len().saturating_sub(new);
            for peer in recent.into_iter().skip(skip) {
                if !self.watched_joiners.contains(&peer) {
                    self.watched_joiners.push(peer);
                }
            }
            self.manifests_noticed = served;
            self.joiner_watch = Some(now + JOINER_WATCH);
        }
        let watching = self.joiner_watch.is_some_and(|until| now < until);
        if !watching {
            self.watched_joiners.clear();
        }
        watching
    }

    /// After a round: a watch for joiners (see [`Self::watching_for_joiners`]) whose joiners
    /// were all in `group` ends, since they are in. Reading the progress after every step for
    /// the rest of the watch cost both peers of a glyphs MLP pair a DHT read (about 0.8 ms)
    /// per 9 ms step for its first 28 steps.
    pub(super) fn joiners_in_round(&mut self, group: &[starling_node::PeerId]) {
        let arrived = self.joiner_watch.is_some()
            && !self.watched_joiners.is_empty()
            && self.watched_joiners.iter().all(|p| group.contains(p));
        if arrived {
            tracing::debug!(
                epoch = self.epoch,
                joiners = self.watched_joiners.len(),
                "the joiners that fetched this peer's state are in its round: the watch ends"
            );
            self.joiner_watch = None;
            self.watched_joiners.clear();
        }
    }

    /// A run's only peer (by its progress records), about to step alone while a joiner fetches
    /// its state, or after one fetched it since the last look: stepping would leave the joiner
    /// an epoch behind with the state it fetched, and it would sync again (a second transfer
    /// of the whole state); waiting costs the lone peer little. Waits while joiners' sessions
    /// are open (at most the averaging timeout), then reads the progress every 20 ms for up to
    /// [`JOINER_GRACE`] for the joiner's announcement; returns the reading if it names another
    /// peer. Without a state server, or when nobody fetched anything since the last look,
    /// returns at once (the reading this peer goes on with may be up to `fetch_interval` old).
    /// Alone, it returns a hold on the state it is leaving ([`StateServer::hold`]) for the
    /// caller to keep until its step's state is in: a joiner whose hello comes after the look
    /// gets the state of this step.
    pub(super) async fn wait_for_joiners(&mut self) -> Result<Lone, TrainingError> {
        let Some(server) = self.state_server.clone() else {
            return Ok(Lone::Alone(None));
        };
        // Taken before the look: a joiner whose hello comes after it gets the state of the
        // step this peer is about to take, not the one it leaves.
        let hold = server.hold();
        let fetched = server.stats().manifests_served;
        if hold.is_some() && server.sessions_open() == 0 && fetched == self.manifests_seen {
            return Ok(Lone::Alone(hold));
        }
        drop(hold);
        // The joiner reads this peer's samples as they are (its batch, complete, and no
        // more coming): it takes one batch of its own and joins the round, instead of
        // computing what it would project this peer still computes.
        self.settle_publication().await?;
        let published = self.tracker.publish(self.final_progress()).await;
        self.tolerate(published)?;
        let started = Instant::now();
        while server.sessions_open() > 0 && started.elapsed() < self.cfg.averaging_timeout {
            tokio::time::sleep(JOIN_POLL).await;
        }
        self.manifests_seen = server.stats().manifests_served;
        let grace_end = Instant::now() + JOINER_GRACE;
        loop {
            self.swarm = None;
            let swarm = self.swarm_progress().await?;
            if swarm.peers > 1 {
                tracing::debug!(
                    epoch = self.epoch,
                    waited_ms = started.elapsed().as_secs_f64() * 1e3,
                    "waited for a joiner fetching this peer's state instead of stepping alone"
                );
                return Ok(Lone::Joined(swarm));
            }
            if Instant::now() >= grace_end {
                return Ok(Lone::Alone(server.hold()));
            }
            tokio::time::sleep(4 * JOIN_POLL).await;
        }
    }
}
