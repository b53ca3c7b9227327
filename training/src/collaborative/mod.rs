//! The collaborative optimizer: many peers take one optimizer step together.
//!
//! Two modes ([`Mode`]):
//!
//! - **Gradients** (hivemind's `Optimizer`): every peer accumulates the gradients of its local
//!   batches; when the swarm as a whole has `target_batch_size` samples (the [progress
//!   tracker](crate::progress) says so), the peers average their mean gradients weighted by the
//!   samples behind them (the global batch's mean gradient) and all apply the same optimizer step.
//!   With the exact codec `none` the averager hands every member the same bits, so peers that
//!   start equal stay **bit-identical**, parameters and optimizer state alike.
//! - **Local SGD / DiLoCo**: every batch takes a step of the local (inner) optimizer; every
//!   `inner_steps` batches the peers average their pseudo-gradients (start-of-phase parameters
//!   minus current ones) and apply an outer optimizer (DiLoCo: SGD with Nesterov momentum 0.9,
//!   learning rate 0.7) to the start-of-phase parameters, which every member then continues
//!   from. Averaging happens `inner_steps` times less often.
//!
//! With a lossy codec, (pseudo-)gradients are averaged with error feedback
//! ([`CollaborativeConfig::error_feedback`], on by default): what quantization dropped of this
//! peer's contribution in one round goes into the next, so the codec's error does not pile up
//! as a bias.
//!
//! Local SGD can average through **gossip** instead of groups
//! ([`CollaborativeConfig::averaging`] = [`Averaging::Gossip`]): at the end of a phase each
//! peer runs one gossip round on its phase start and pseudo-gradient together (so both mix
//! towards the swarm's), then takes its outer step from the mixed values. Nobody waits for a
//! group to form, so slow peers do not hold fast ones; peers are no longer bit-identical (they
//! converge towards each other instead). Gradient mode always averages in groups.
//!
//! A peer that finds no group steps with its own values, and the [`StepReport`] says so; so does
//! a peer whose epoch is behind the swarm's (it should catch up by state sync).
//!
//! State sync ([`crate::sync`]): [`CollaborativeOptimizer::serve_state`] makes this peer a donor
//! whose snapshot is refreshed after every global (or outer) step;
//! [`CollaborativeOptimizer::restore_from`] writes a synced state and epoch into a late joiner.
//!
//! ```no_run
//! # async fn demo(node: starling_node::Node) -> Result<(), Box<dyn std::error::Error>> {
//! use starling_training::{CollaborativeConfig, CollaborativeOptimizer, Mode, ParamSet, Sgd, SgdConfig};
//! let mut params = ParamSet::new();
//! params.add("w", &[4], &[0.1, 0.2, 0.3, 0.4])?;
//! let sgd = Sgd::new(SgdConfig::new(0.1), params.len())?;
//! let cfg = CollaborativeConfig::new("my-run", 1024, Mode::Gradients);
//! let mut opt = CollaborativeOptimizer::new(node, Box::new(sgd), &params, cfg).await?;
//! loop {
//!     // ... compute a batch of 32 samples' mean gradient into params.grads_mut() ...
//!     let report = opt.step(&mut params, 32).await?;
//!     if report.stepped {
//!         println!("epoch {} (averaged with {:?} peers)", report.epoch, report.group_size);
//!     }
//! #   break;
//! }
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use starling_averager::gossip::{GossipAverager, GossipReport};
use starling_averager::{Averager, AveragerError, Reconciliation, Residuals, RoundReport};
use starling_compression::dct::{DctTopK, DctValues};
use starling_compression::lowrank::{LowRankMatrix, PowerSgd};

/// The compressor of a run that compresses its gradient rounds (`spec` set), built afresh if a
/// dropped round took it.
fn compressor<'a>(
    state: &'a mut Option<Compressor>,
    spec: &Option<CompressorSpec>,
) -> Result<Option<&'a mut Compressor>, TrainingError> {
    if let (None, Some(spec)) = (&state, spec) {
        *state = Some(spec.build()?);
    }
    Ok(state.as_mut())
}
use starling_node::{Node, NodeError};

use crate::metrics::{LossPoint, TrainingBoard, TrainingMetrics};

use crate::optim::{Optimizer, Sgd};
use crate::params::ParamSet;
use crate::progress::{covered_stride, Covered, ProgressError, ProgressTracker, SwarmProgress};
use crate::sync::StateServer;

mod config;
mod delayed;
mod gradient;
mod local;
mod pace;
mod rounds;
mod schedule;
mod state;

pub use config::{
    Averaging, CollaborativeConfig, GradientCompression, Mode, StepReport, StepTimings,
    TrainingError,
};
use rounds::{
    average_gradients, behind_of, note_gossip, note_reconciled, note_round, reconcile_state,
    same_len, state_buffers, swarm_peers, Compressor, CompressorSpec,
};

/// Why a step used only local values when the progress records show no other peer.
const ALONE: &str = "no other peer in the run (by its progress records): stepped alone";

/// The window over which a peer measures its own throughput.
const RATE_WINDOW: Duration = Duration::from_secs(2);

/// Trains one model with the swarm (see the module docs).
pub struct CollaborativeOptimizer {
    cfg: CollaborativeConfig,
    /// Shared with the background round of a delayed update.
    averager: Arc<Averager>,
    /// Local SGD with [`Averaging::Gossip`].
    gossip: Option<GossipAverager>,
    /// Shared with the background publication of the progress after a step.
    tracker: Arc<ProgressTracker>,
    /// A publication of this peer's progress in flight (see `publish_in_background`), and
    /// what it took once it ends.
    publishing: Option<tokio::task::JoinHandle<(Result<(), ProgressError>, Duration)>>,
    /// How long the last awaited publications and reads of the progress took: on a network
    /// where they are slow ([`pace::SLOW_PROGRESS`]), the ones between batches run in the
    /// background instead of holding up compute.
    publish_took: pace::Latency,
    fetch_took: pace::Latency,
    /// A read of the swarm's progress in the background (slow networks): the epoch it was
    /// started in, and the task (its reading and how long it took).
    fetching: Option<(u64, pace::Fetching)>,
    /// The least time matchmaking took in rounds that searched when the step began: how far ahead of the batch a round's search starts. `None` until measured.
    matchmaking_estimate: Option<Duration>,
    optimizer: Box<dyn Optimizer>,
    /// Local SGD: the outer optimizer and the parameters at the start of the phase.
    outer: Option<(Sgd, Vec<f32>)>,
    /// State sync: the donor refreshed after every global or outer step.
    state_server: Option<StateServer>,
    len: usize,
    epoch: u64,
    /// Gradient mode: sum over batches of (batch mean gradient x batch samples).
    accumulated: Vec<f32>,
    /// Error feedback for the (pseudo-)gradients, when `error_feedback` is on.
    residuals: Residuals,
    /// This peer's worker momentum (`CollaborativeConfig::worker_momentum`; empty when off).
    momentum: Vec<f32>,
    /// Compressed gradient rounds (`CollaborativeConfig::compression`): how to build the
    /// compressor, and the compressor (away with a delayed update's round while it runs;
    /// built again if that round is dropped).
    compressor_spec: Option<CompressorSpec>,
    compressor: Option<Compressor>,
    /// Samples accumulated in the current epoch (or local-SGD phase).
    samples: u64,
    /// Local steps in the current local-SGD phase.
    inner: u64,
    /// Samples per second, smoothed.
    rate: f64,
    /// The rate's current window: when it started and the samples since.
    rate_window: Option<(Instant, u64)>,
    /// When the previous `step` call returned, and the epoch it left this peer in: the caller
    /// computed the next batch from then on (compute intervals leave out the time spent inside
    /// `step`: progress reads, a delayed round's application, averaging; counted as compute, a
    /// long wait there made the others' samples look several times more than they were and
    /// the swarm step at half its batch).
    last_batch: Option<(Instant, u64)>,
    /// Samples per second while computing (waiting and averaging excluded); 0 until measured.
    compute: pace::ComputeMeter,
    /// Samples in the latest batch.
    last_batch_samples: u64,
    /// When the current epoch's first batch arrived.
    epoch_start: Option<Instant>,
    /// The last swarm reading and when it was taken.
    swarm: Option<(Instant, SwarmProgress)>,
    /// The last reading actually read from the DHT (what a failed read falls back to), and
    /// when it was read.
    last_read: Option<SwarmProgress>,
    last_read_at: Option<Instant>,
    /// The swarm as the last round that held every live peer left it (made up by
    /// `progress_after_round`), and when that round began the epoch (Unix ms): what completes a
    /// reading of the epoch taken before every peer reported it (see `completed`).
    round_began: Option<(u64, SwarmProgress)>,
    /// The epoch in which the run's live peers began computing together with this one (see
    /// [`Self::start_together`]).
    together_epoch: Option<u64>,
    /// After a state sync, until this peer's first step: how many times the swarm was found
    /// an epoch ahead of the synced state (see `take_swarm_epoch`).
    fresh_sync: Option<u32>,
    /// A round met the others' round of a later epoch (rounds are tagged with the epoch they
    /// end) and this peer did not step: their epoch. The caller is told (`behind`) and syncs,
    /// which clears it. A caller that does not sync takes that epoch at its next round
    /// and trains on from its own values (apart until the next state round).
    behind_of: Option<u64>,
    /// Failures met during the current call, moved into its [`StepReport`].
    errors: Vec<String>,
    /// This run's metrics, and the node's (journals, board).
    metrics: TrainingMetrics,
    node_metrics: starling_node::metrics::Metrics,
    /// A state-server refresh in flight (hashing and announcing the new snapshot).
    serving: Option<tokio::task::JoinHandle<()>>,
    /// The state server's manifests served at the last look (see `wait_for_joiners`).
    manifests_seen: u64,
    /// The state server's manifests served when this peer last noticed a new one, and until
    /// when it reads the progress after every step (see `watching_for_joiners`).
    manifests_noticed: u64,
    joiner_watch: Option<Instant>,
    /// Rounds in a row that held every live peer (see `ProgressTracker::cover`).
    full_rounds: u32,
    /// When this peer last took a global step (gradient mode).
    last_stepped: Option<Instant>,
    /// The joiners that fetched a manifest since the watch began: once a round held them all,
    /// they are in, and the watch ends (see `joiners_in_round`).
    watched_joiners: Vec<starling_node::PeerId>,
    /// Delayed update: the round in flight.
    pending: Option<delayed::Pending>,
    /// Delayed update: rounds dropped unapplied (state replaced), awaited at shutdown.
    cancelled: Vec<tokio::task::JoinHandle<delayed::Finished>>,
    /// Delayed update: a gradient buffer back from the last applied round, for the next one.
    spare: Vec<f32>,
}

impl CollaborativeOptimizer {
    /// Joins the run on `node` with `optimizer` (gradient mode: the shared optimizer; local SGD:
    /// the inner one) for parameters shaped like `params`.
    pub async fn new(
        node: Node,
        optimizer: Box<dyn Optimizer>,
        params: &ParamSet,
        mut cfg: CollaborativeConfig,
    ) -> Result<Self, TrainingError> {
        let len = params.len();
        same_len(optimizer.len(), params)?;
        cfg.averager.prefix = format!("{}.train", cfg.run);
        cfg.progress.run = cfg.run.clone();
        cfg.progress.target_batch_size = cfg.target_batch_size;
        if cfg.delayed_update && matches!(cfg.mode, Mode::LocalSgd { .. }) {
            return Err(TrainingError::Config(
                "the delayed update is for gradient mode; local SGD already averages once per phase"
                    .into(),
            ));
        }
        if !(cfg.delayed_max_stale > 0.0 && cfg.delayed_max_stale <= 1.0) {
            return Err(TrainingError::Config(format!(
                "delayed_max_stale {} is not in (0, 1]",
                cfg.delayed_max_stale
            )));
        }
        if let Some(s) = &cfg.lr_schedule {
            s.validate()?;
        }
        if let Some(beta) = cfg.worker_momentum {
            if !(beta > 0.0 && beta < 1.0) {
                return Err(TrainingError::Config(format!(
                    "worker momentum {beta} is not in (0, 1)"
                )));
            }
            if matches!(cfg.mode, Mode::LocalSgd { .. }) {
                return Err(TrainingError::Config(
                    "worker momentum is for gradient mode; DiLoCo's outer optimizer has its own"
                        .into(),
                ));
            }
            // Momenta and plain gradients must never be averaged together.
            cfg.averager.prefix = format!("{}.train.wm{beta}", cfg.run);
        }
        if cfg.delayed_update {
            // The round runs behind compute: waiting for a member that is late (peers start
            // their rounds at their own batch boundaries, up to a batch apart) costs nothing
            // while the round ends within an epoch; starting without it splits the swarm.
            let grace = cfg.averager.matchmaking_time / 2;
            cfg.averager.start_grace.get_or_insert(grace);
        }
        if cfg.compression != GradientCompression::Codec {
            if !matches!(cfg.averaging, Averaging::Group) {
                return Err(TrainingError::Config(
                    "compressed gradient rounds run in groups, not through gossip".into(),
                ));
            }
            if !cfg.averager.aggregation.is_mean() {
                return Err(TrainingError::Config(format!(
                    "compressed gradient rounds need the mean aggregation, not {}",
                    cfg.averager.aggregation
                )));
            }
        }
        let compressor_spec = CompressorSpec::of(cfg.compression, params, &cfg.run)?;
        let compressor = compressor_spec
            .as_ref()
            .map(CompressorSpec::build)
            .transpose()?;
        let averager = Arc::new(Averager::new(node.clone(), cfg.averager.clone()).await?);
        let gossip = match (&cfg.averaging, cfg.mode) {
            (Averaging::Group, _) => None,
            (Averaging::Gossip(g), Mode::LocalSgd { .. }) => {
                let mut g = g.clone();
                g.prefix = format!("{}.train", cfg.run);
                Some(GossipAverager::new(node.clone(), g).await?)
            }
            (Averaging::Gossip(_), Mode::Gradients) => {
                return Err(TrainingError::Config(
                    "gradient mode averages in groups: use Averaging::Group, or Mode::LocalSgd for gossip"
                        .into(),
                ))
            }
        };
        let metrics = TrainingMetrics::of(&node);
        let node_metrics = node.metrics().clone();
        // The heartbeat says which run this peer trains in from the start.
        node_metrics.set_section(&TrainingBoard::new(cfg.run.clone(), 0, 0.0, None));
        let tracker = Arc::new(ProgressTracker::new(node, cfg.progress.clone()));
        let outer = match cfg.mode {
            Mode::Gradients => None,
            Mode::LocalSgd { .. } => Some((Sgd::new(cfg.outer, len)?, params.params().to_vec())),
        };
        Ok(CollaborativeOptimizer {
            averager,
            gossip,
            tracker,
            publishing: None,
            publish_took: pace::Latency::default(),
            fetch_took: pace::Latency::default(),
            fetching: None,
            matchmaking_estimate: None,
            optimizer,
            outer,
            state_server: None,
            len,
            epoch: 0,
            accumulated: vec![0.0; len],
            residuals: Residuals::new(),
            momentum: Vec::new(),
            compressor_spec,
            compressor,
            samples: 0,
            inner: 0,
            rate: 0.0,
            rate_window: None,
            last_batch: None,
            compute: pace::ComputeMeter::default(),
            last_batch_samples: 0,
            epoch_start: None,
            swarm: None,
            last_read: None,
            round_began: None,
            last_read_at: None,
            together_epoch: None,
            fresh_sync: None,
            behind_of: None,
            errors: Vec::new(),
            metrics,
            node_metrics,
            serving: None,
            manifests_seen: 0,
            manifests_noticed: 0,
            joiner_watch: None,
            full_rounds: 0,
            last_stepped: None,
            watched_joiners: Vec::new(),
            pending: None,
            cancelled: Vec::new(),
            spare: Vec::new(),
            cfg,
        })
    }

    /// The epoch: global steps (gradient mode) or outer steps (local SGD) taken.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Continues at `epoch` with the values now in `params` (restored from a checkpoint, with the
    /// optimizer this was built with): the epoch starts afresh, and in local SGD a new phase
    /// starts from `params`. A peer whose checkpoint is behind the swarm still syncs state.
    ///
    /// ```no_run
    /// # fn demo(mut opt: starling_training::CollaborativeOptimizer, params: starling_training::ParamSet) {
    /// opt.resume(12, &params);
    /// assert_eq!(opt.epoch(), 12);
    /// # }
    /// ```
    pub fn resume(&mut self, epoch: u64, params: &ParamSet) {
        self.cancel_pending();
        self.epoch = epoch;
        self.behind_of = None;
        self.accumulated.fill(0.0);
        self.samples = 0;
        self.inner = 0;
        self.swarm = None;
        if let Some((_, anchor)) = self.outer.as_mut() {
            anchor.copy_from_slice(params.params());
        }
    }

    /// Leaves the run cleanly: stops the state server (if any), a delayed update's round in
    /// flight (unapplied: [`flush`](Self::flush) first to keep it) and the averager (its
    /// background tasks and registrations); the node keeps running.
    pub async fn shutdown(mut self) {
        if let Some(server) = &self.state_server {
            server.shutdown().await;
        }
        self.end_background_rounds().await;
        if let Some((_, task)) = self.fetching.take() {
            task.abort();
        }
        let _ = self.settle_publication().await;
        if let Some(task) = self.serving.take() {
            // The last state refresh completes: a peer that leaves still serves it until then.
            let _ = task.await;
        }
        if let Some(g) = self.gossip {
            g.shutdown().await;
        }
        match Arc::try_unwrap(self.averager) {
            Ok(averager) => averager.shutdown().await,
            // Not reached: every round that shared it has ended. Dropping it stops its tasks.
            Err(_) => tracing::debug!("the averager is still shared at shutdown"),
        }
    }

    /// Peers this optimizer's averager refuses because it holds checked evidence that they
    /// returned a wrong result as reducers (`AveragerConfig::verify`; see
    /// `starling_averager::verify`). Empty when verification is off.
    ///
    /// ```no_run
    /// # fn demo(opt: &starling_training::CollaborativeOptimizer) {
    /// for peer in opt.refused_peers() {
    ///     eprintln!("refusing {peer}");
    /// }
    /// # }
    /// ```
    pub fn refused_peers(&self) -> Vec<starling_node::PeerId> {
        self.averager.refused_peers()
    }

    /// The gossip averager, in local SGD with [`Averaging::Gossip`] (its
    /// [`totals`](GossipAverager::totals) count every byte gossip moved).
    pub fn gossip(&self) -> Option<&GossipAverager> {
        self.gossip.as_ref()
    }

    /// The local (gradient mode: shared) optimizer.
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// Publishes this peer's progress now (its epoch and the samples so far), so that the
    /// other peers count it in the run from this moment instead of from its first batch: call
    /// it once the peer is ready to train (after state sync), or peers already training may
    /// find no other peer in their progress records and step alone meanwhile. A run's first
    /// peer has nobody to store the record with; that error changes nothing.
    ///
    /// ```no_run
    /// # async fn demo(mut opt: starling_training::CollaborativeOptimizer) {
    /// let _ = opt.announce().await;
    /// # }
    /// ```
    pub async fn announce(&mut self) -> Result<(), TrainingError> {
        Ok(self.tracker.publish(self.local_progress()).await?)
    }

    /// Tells the optimizer that the run's live peers begin computing this epoch now, as this
    /// one does: they waited for each other (`starling train --min-peers`). Until the others'
    /// rates are measured, this epoch's batch is then projected with each of them computing
    /// as many samples as this peer, so the first global batch lands on the target. Without
    /// it a peer counts an unmeasured peer's samples only once reported, and every peer
    /// computed most of the first batch itself (two charlm peers: 224 samples for a target of
    /// 128, 160 in another run; 128 with it).
    ///
    /// ```no_run
    /// # async fn demo(mut opt: starling_training::CollaborativeOptimizer) {
    /// while opt.live_peers().await.unwrap_or(0) < 4 {
    ///     tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    /// }
    /// opt.start_together();
    /// # }
    /// ```
    pub fn start_together(&mut self) {
        self.together_epoch = Some(self.epoch);
    }

    /// The live peers of the run, this one included once it has [announced](Self::announce)
    /// itself, by a fresh read of their progress records (peers refused for lying left out):
    /// what a peer waiting for the swarm before its first batch polls.
    ///
    /// ```no_run
    /// # async fn demo(mut opt: starling_training::CollaborativeOptimizer) {
    /// while opt.live_peers().await.unwrap_or(0) < 4 {
    ///     let _ = opt.announce().await; // keeps this peer's record fresh meanwhile
    ///     tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    /// }
    /// # }
    /// ```
    pub async fn live_peers(&mut self) -> Result<usize, TrainingError> {
        Ok(self.reading_tracker().fetch().await?.peers)
    }

    /// The highest epoch any peer of the run has reported, from every progress record the DHT
    /// still holds (live or not: a peer's last record outlives it for `report_lifetime`).
    /// A run whose peers reported its last epoch has ended; a joiner with nothing of its own
    /// should not train it alone.
    ///
    /// ```no_run
    /// # async fn demo(mut opt: starling_training::CollaborativeOptimizer) {
    /// if opt.highest_reported_epoch().await.ok().flatten() >= Some(100) {
    ///     println!("the run has ended");
    /// }
    /// # }
    /// ```
    pub async fn highest_reported_epoch(&mut self) -> Result<Option<u64>, TrainingError> {
        let reports = self.tracker.reports().await?;
        Ok(reports.iter().map(|(_, r)| r.epoch).max())
    }

    /// The local optimizer, to restore its state between steps (from a checkpoint the caller
    /// keeps); follow with [`resume`](Self::resume) for the epoch.
    ///
    /// ```no_run
    /// # fn demo(mut opt: starling_training::CollaborativeOptimizer) {
    /// opt.optimizer_mut().set_steps(100);
    /// # }
    /// ```
    pub fn optimizer_mut(&mut self) -> &mut dyn Optimizer {
        self.optimizer.as_mut()
    }

    /// Takes one batch: `params.grads()` holds the mean gradient of `batch_samples` samples.
    /// Gradient mode accumulates it and, once the swarm has its global batch, averages and steps;
    /// local SGD steps locally and averages every `inner_steps` batches.
    pub async fn step(
        &mut self,
        params: &mut ParamSet,
        batch_samples: u64,
    ) -> Result<StepReport, TrainingError> {
        same_len(self.len, params)?;
        let called_in = self.epoch;
        self.note_batch(batch_samples);
        self.metrics.samples.inc_by(batch_samples);
        let report = match self.cfg.mode {
            Mode::Gradients => self.gradient_step(params, batch_samples).await,
            Mode::LocalSgd { inner_steps } => self.local_step(params, inner_steps.max(1)).await,
        };
        let report = self.with_errors(report);
        self.record(&report);
        // Stamped with the epoch the call leaves: the next batch's interval is measured
        // unless something else changes the epoch before it (see `note_batch`). A caller that
        // gives each peer an exact share (`projected_batch` off: a batch, then `try_step` until
        // the swarm steps) may not compute between a call that stepped and its next batch at
        // all; measured, that made its rate look boundless and the others start a round
        // without a peer about to join: not measured (the epoch the call began in).
        let stamp = if self.cfg.projected_batch {
            self.epoch
        } else {
            called_in
        };
        self.last_batch = Some((Instant::now(), stamp));
        report
    }

    /// Reports the training loss of the latest batch: the `training_loss` metric, the node's
    /// loss curve (dashboards) and its heartbeat. Non-finite losses are ignored.
    ///
    /// ```no_run
    /// # fn demo(opt: &starling_training::CollaborativeOptimizer) {
    /// opt.report_loss(0.42);
    /// # }
    /// ```
    pub fn report_loss(&self, loss: f64) {
        if !loss.is_finite() {
            return;
        }
        self.metrics.loss.set(loss);
        self.node_metrics.journal::<LossPoint>().push(LossPoint {
            time_ms: starling_dht::now_ms(),
            epoch: self.epoch,
            loss,
        });
        self.node_metrics.update_board(|b| {
            if let Some(mut t) = b.get::<TrainingBoard>() {
                t.loss = Some(loss);
                let _ = b.put(&t);
            }
        });
    }

    /// Updates the metrics and the node's board after a step.
    fn record(&self, report: &Result<StepReport, TrainingError>) {
        if let Ok(r) = report {
            if r.stepped {
                self.metrics.steps.inc();
            }
        }
        self.metrics.epoch.set(self.epoch as i64);
        let rate = if self.rate.is_finite() {
            self.rate
        } else {
            0.0
        };
        self.metrics.samples_per_second.set(rate);
        let (run, epoch) = (self.cfg.run.clone(), self.epoch);
        self.node_metrics.update_board(|b| {
            let loss = b.get::<TrainingBoard>().and_then(|t| t.loss);
            if let Err(e) = b.put(&TrainingBoard::new(run, epoch, rate, loss)) {
                tracing::warn!("{e}");
            }
        });
    }
}
