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
use crate::progress::{LocalProgress, ProgressError, ProgressTracker, SwarmProgress};
use crate::sync::StateServer;

mod config;
mod delayed;
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
            last_read_at: None,
            fresh_sync: None,
            behind_of: None,
            errors: Vec::new(),
            metrics,
            node_metrics,
            serving: None,
            manifests_seen: 0,
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

    async fn gradient_step(
        &mut self,
        params: &mut ParamSet,
        batch_samples: u64,
    ) -> Result<StepReport, TrainingError> {
        let k = batch_samples as f32;
        self.accumulated
            .iter_mut()
            .zip(params.grads())
            .for_each(|(a, g)| *a += k * g);
        // While a delayed update's round is in flight this peer's published progress stays
        // that of the epoch the round ends (see `delayed`).
        if self.pending.is_none() {
            let local = self.local_progress();
            if !self.tracker.due(&local) {
                self.collect_publication()?;
            } else if self.publish_took.slow() {
                // A slow network: the report goes out beside compute (one at a time; a report
                // due while the last is in flight waits for the next batch).
                self.collect_publication()?;
                if self.publishing.is_none() {
                    self.spawn_publication();
                }
            } else {
                self.settle_publication().await?;
                let started = Instant::now();
                let reported = self.tracker.publish(local).await;
                self.publish_took.note(started.elapsed());
                self.tolerate(reported)?;
            }
        }
        self.try_global_step(params).await
    }

    /// Gradient mode, for a peer with no more batches this epoch (or that wants to wait for the
    /// swarm): takes the global step if the swarm has its batch, without adding samples.
    /// Returns at once either way; call it again (after a pause) until `stepped`.
    pub async fn try_step(&mut self, params: &mut ParamSet) -> Result<StepReport, TrainingError> {
        same_len(self.len, params)?;
        match self.cfg.mode {
            Mode::Gradients => {
                // Its count is final for this epoch: a rate of 0, so that nobody projects
                // samples it will not compute.
                let last = LocalProgress {
                    samples_per_second: 0.0,
                    ..self.local_progress()
                };
                let reported = if self.pending.is_none() {
                    self.settle_publication().await?;
                    self.tracker.report_final(last).await
                } else {
                    Ok(false)
                };
                let report = match self.tolerate(reported) {
                    Ok(_) => self.try_global_step(params).await,
                    Err(e) => Err(e),
                };
                let report = self.with_errors(report);
                self.record(&report);
                report
            }
            Mode::LocalSgd { .. } => Ok(self.idle_report()),
        }
    }

    fn idle_report(&self) -> StepReport {
        StepReport {
            epoch: self.epoch,
            stepped: false,
            group_size: None,
            averaging_error: None,
            errors: Vec::new(),
            state_checked: false,
            state_averaged: false,
            samples: self.samples,
            swarm: self.swarm.as_ref().map(|(_, s)| s.clone()),
            behind: false,
            others_epoch: None,
            round: None,
            gossip: None,
            timings: StepTimings::default(),
        }
    }

    /// Steps if the swarm (or this peer alone) has the global batch: averages the mean
    /// gradient with the group, weighted by samples, and applies the shared optimizer step.
    async fn try_global_step(
        &mut self,
        params: &mut ParamSet,
    ) -> Result<StepReport, TrainingError> {
        // Delayed update: a round that finished meanwhile is applied first. While one is in
        // flight the swarm's reports of the next epoch cannot be in yet (every member of the
        // round publishes when its round ends): nothing to read unless this peer alone has the
        // batch.
        let mut applied = self.apply_if_finished(params).await?;
        if let Some(r) = applied.take_if(|r| r.behind) {
            // The round just ended found the others an epoch on: the caller syncs first.
            return Ok(r);
        }
        self.catch_up();
        match self.round_in_flight(params).await? {
            delayed::InFlight::Computing => {
                return Ok(applied.unwrap_or_else(|| self.idle_report()));
            }
            delayed::InFlight::Settled(Some(r)) if r.behind => return Ok(*r),
            delayed::InFlight::Settled(r) => applied = r.map(|r| *r).or(applied),
        }
        let read_at = Instant::now();
        let mut swarm = self.swarm_progress().await?;
        tracing::trace!(
            reading_ms = read_at.elapsed().as_secs_f64() * 1e3,
            "swarm progress"
        );
        self.take_swarm_epoch(&swarm);
        let ready = self.batch_ready(&swarm);
        if ready
            && (swarm.peers_in_epoch < swarm.peers || self.state_due() || self.state_due_next())
        {
            // About to average while a live peer's report of this epoch is missing (it may
            // have stepped a moment ago), or in a round that would carry the state (a joiner
            // that synced at epoch E while its donor stepped to E + 1 alone would average the
            // state while the donor does not), or in the round before one (a peer an epoch
            // behind would average gradients while the others average the state): read
            // again, so that this peer agrees with the others on the epoch, and so on which
            // rounds carry the state.
            self.swarm = None;
            swarm = self.swarm_progress().await?;
            self.take_swarm_epoch(&swarm);
        }
        let behind = swarm.is_behind(self.epoch);
        let mut report = self.idle_report();
        report.swarm = Some(swarm);
        report.behind = behind;
        if behind && self.fresh_sync.is_some() {
            // The state just synced is already an epoch old (the donor stepped meanwhile):
            // averaging with the swarm would apply its gradients to older parameters. The
            // caller syncs again (`behind`); it does not step meanwhile.
            return Ok(applied.unwrap_or(report));
        }
        if !ready || self.samples == 0 {
            if let Some(swarm) = &report.swarm {
                self.schedule_matchmaking(swarm);
            }
            return Ok(applied.unwrap_or(report));
        }
        // Rounds apply in order: the one in flight (delayed update) before this one starts.
        if let Some(r) = self.apply_pending(params).await? {
            if r.behind {
                return Ok(r);
            }
            applied = Some(r);
        }
        // The local mean gradient, averaged with the group's weighted by samples: the global
        // batch's mean gradient.
        let scale = 1.0 / self.samples as f32;
        params
            .grads_mut()
            .iter_mut()
            .zip(&self.accumulated)
            .for_each(|(g, a)| *g = a * scale);
        if let Some(beta) = self.cfg.worker_momentum {
            // What this peer contributes is its momentum (see the config's docs). A round that
            // fails, or finds this peer behind, keeps it: it is this peer's own history.
            self.momentum.resize(self.len, 0.0);
            self.momentum
                .iter_mut()
                .zip(params.grads_mut())
                .for_each(|(m, g)| {
                    *m = beta * *m + *g;
                    *g = *m;
                });
        }
        if report.swarm.as_ref().is_some_and(|s| s.peers <= 1) {
            // Alone, but perhaps a joiner is fetching this peer's state: it joins this round.
            if let Some(swarm) = self.wait_for_joiners().await? {
                report.swarm = Some(swarm);
            }
        }
        // Every live peer searches about now: a group of them need not wait out the window.
        self.averager
            .expect_peers(swarm_peers(report.swarm.as_ref()));
        self.grace_for_batches();
        // Peers in another epoch never group (one a round behind would average gradients of
        // other parameters): it learns at its search that it is behind.
        self.averager.set_round_tag(self.epoch);
        let began = Instant::now();
        report.timings.waiting = self.epoch_start.map_or(Duration::ZERO, |t| began - t);
        let deadline = began + self.cfg.averaging_timeout;
        // No other live peer in the run's progress (a run's first peer, before anyone joins):
        // searching would only wait out a matchmaking window.
        let alone = report.swarm.as_ref().is_some_and(|s| s.peers <= 1);
        // Every `state_averaging_every` epochs the same round also averages the parameters and
        // the optimizer state, so that peers whose earlier rounds failed or ran in smaller
        // groups meet again. In the gradient round itself, not in a second round after the
        // step: every peer in an epoch averages the same tensors, so a peer never waits out a
        // matchmaking window for one that is averaging something else.
        let with_state = self.state_due();
        let weight = self.samples as f32;
        if self.cfg.delayed_update && !alone {
            compressor(&mut self.compressor, &self.compressor_spec)?;
            let mut grads = std::mem::take(&mut self.spare);
            grads.resize(self.len, 0.0);
            grads.copy_from_slice(params.grads());
            report.samples = self.samples;
            self.launch(
                params,
                delayed::Launch {
                    grads,
                    with_state,
                    weight,
                    deadline,
                    report,
                },
            );
            self.accumulated.fill(0.0);
            self.samples = 0;
            self.swarm = None;
            self.epoch_start = None;
            // Published when the round ends (`apply_pending`): a report of the next epoch now
            // would tell the peers still about to start this round that they are behind.
            return Ok(applied.unwrap_or_else(|| self.idle_report()));
        }
        if let Some(r) = applied {
            // A delayed round applied just now, and this step (alone) taken at once: both
            // steps happened; the report is this one's, with the other's failures.
            report.errors.extend(r.errors);
        }
        if alone {
            // A search started ahead would form a group nobody steps in.
            self.averager.cancel_prepared();
            report.averaging_error = Some(ALONE.into());
        } else {
            let averaged = average_gradients(
                &self.averager,
                compressor(&mut self.compressor, &self.compressor_spec)?,
                self.cfg.error_feedback.then_some(&mut self.residuals),
                params.grads_mut(),
                weight,
                deadline,
            )
            .await;
            // The parameters and the optimizer state, in the same group, weighted by samples
            // like the gradients; sent only if some member's differ from the others' (see
            // `reconcile_state`).
            let exact = self.exact_rounds();
            let state =
                with_state.then(|| state_buffers(params.params_mut(), self.optimizer.state_mut()));
            let reconciled =
                reconcile_state(&self.averager, &averaged, exact, state, weight, deadline).await;
            let mut ahead = behind_of(&averaged);
            note_round(&mut report, averaged)?;
            note_reconciled(&mut report, reconciled)?;
            self.learn_matchmaking(&report);
            if ahead.is_none() && report.round.is_none() {
                ahead = self.others_moved_on(self.epoch).await?;
            }
            if let Some(theirs) = ahead {
                // The others are past this epoch: applying its gradients here would leave
                // this peer's parameters apart from theirs. No step; the caller syncs.
                self.note_behind(&mut report, theirs);
                return Ok(report);
            }
        }
        let averaged_at = Instant::now();
        report.timings.averaging = averaged_at - began;
        self.schedule_lr(self.epoch);
        self.optimizer.step_set(params)?;
        self.epoch += 1;
        self.fresh_sync = None;
        self.accumulated.fill(0.0);
        self.samples = 0;
        self.swarm = self.progress_after_round(&report, starling_dht::now_ms());
        report.timings.optimizer = averaged_at.elapsed();
        self.epoch_start = None;
        let stepped_at = Instant::now();
        self.refresh_served_state(params).await;
        // The others learn of the new epoch now.
        self.publish_in_background().await?;
        tracing::debug!(
            epoch = self.epoch,
            averaging_ms = report.timings.averaging.as_secs_f64() * 1e3,
            matchmaking_ms = report
                .round
                .as_ref()
                .map_or(0.0, |r| r.matchmaking_time.as_secs_f64() * 1e3),
            prepared = report.round.as_ref().is_some_and(|r| r.prepared),
            optimizer_ms = report.timings.optimizer.as_secs_f64() * 1e3,
            serving_ms = stepped_at.elapsed().as_secs_f64() * 1e3,
            "global step taken"
        );
        report.epoch = self.epoch;
        report.stepped = true;
        Ok(report)
    }
}
