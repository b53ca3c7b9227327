//! One training peer in a run: builds the optimizer the manifest names, restores a checkpoint or
//! syncs state from the swarm, then trains batch by batch with the collaborative optimizer until
//! the run's last epoch (or until told to stop), evaluating, checkpointing and re-syncing when it
//! falls behind. Used by `starling train` (one per process) and `starling demo` (several in one).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use rand::rngs::StdRng;
use rand::SeedableRng;
use starling_node::Node;
use starling_training::state::{StateTarget, StateView};
use starling_training::{
    sync_state, AdamWConfig, CollaborativeConfig, CollaborativeOptimizer, GradientCompression,
    LrSchedule, Mode, OptimizerConfig, ParamSet, SgdConfig, StateServer, StateServerConfig,
    StepReport, SyncConfig, SyncError, VarBinding,
};

use crate::attack::Attack;
use crate::batches::{Batches, Sampler, Shard, SharedOrder};
use crate::checkpoint;
use crate::data::Dataset;
use crate::eval::BackgroundEval;
use crate::event::{split, Event, Reporter};
use crate::manifest::{
    self, ModeSpec, ModelSpec, OptimizerKind, RunManifest, ScheduleSpec, SignedManifest,
};
use crate::model::{Built, Eval, Net};

/// Batches that may fail in a row (e.g. no remote experts reachable) before the session gives up.
const MAX_BATCH_FAILURES: u32 = 60;
/// Pause before retrying a failed batch.
const BATCH_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Bound on a state sync at start or after falling behind.
const SYNC_DEADLINE: Duration = Duration::from_secs(120);
/// How long a joiner without a checkpoint waits for a peer of the run to serve its state: the
/// run's manifest was found, so its peers exist or did a moment ago (a creator publishes the
/// manifest before it serves). Past it the joiner trains from the run's initial values.
const JOIN_WAIT: Duration = Duration::from_secs(30);
/// How often a joiner waiting for a donor reads the run's progress to see whether it ended.
const ENDED_POLL: Duration = Duration::from_secs(1);
/// Pause between the reads of a joiner waiting for the run's first donor.
const JOIN_POLL: Duration = Duration::from_millis(50);
/// How long a peer waits for the run's `min_peers` before training with those there are.
pub const MIN_PEERS_WAIT: Duration = Duration::from_secs(600);
/// Pause between the reads of a peer waiting for `min_peers`.
const MIN_PEERS_POLL: Duration = Duration::from_millis(250);

/// What a session needs.
pub struct Session {
    /// This peer's node.
    pub node: Node,
    /// The run.
    pub manifest: RunManifest,
    /// The run as signed (re-published by every peer).
    pub signed: SignedManifest,
    /// This peer's data.
    pub data: Arc<Dataset>,
    /// The model built for the manifest.
    pub built: Built,
    /// Where to save checkpoints (and resume from).
    pub checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every this many epochs (and when leaving).
    pub checkpoint_every: u64,
    /// Sync state from the swarm before training (joining an existing run).
    pub sync_first: bool,
    /// Seed of this peer's batch sampling.
    pub sample_seed: u64,
    /// Draw this peer's share of the run's shared batch order instead of batches of its own
    /// (`sample_seed`): see [`SharedOrder`].
    pub shard: Option<Shard>,
    /// Set to leave the run after the current step.
    pub stop: Arc<AtomicBool>,
    /// Where events go.
    pub reporter: Arc<dyn Reporter>,
    /// How often progress is published and read (`None`: the defaults, 1 s and 0.5 s; a
    /// loopback demo whose epochs take a tenth of a second needs faster).
    pub progress_interval: Option<Duration>,
    /// Apply each global step one epoch late, computing the next batches while the round
    /// runs (`CollaborativeConfig::delayed_update`).
    pub delayed_update: bool,
    /// With `delayed_update`: the part of the next batch computed before the round in flight
    /// must be applied (`CollaborativeConfig::delayed_max_stale`; `None`: its default).
    pub max_stale: Option<f64>,
    /// Lie on purpose: send this instead of each batch's gradient (testing a swarm's
    /// defences; see [`crate::attack`]). `None` for an honest peer.
    pub attack: Option<Attack>,
    /// Before its first batch, wait (at most [`MIN_PEERS_WAIT`]) until the run has this many
    /// live peers, this one included: machines started together train together from the
    /// first epoch instead of the first one stepping alone meanwhile. 0 or 1: no wait.
    pub min_peers: usize,
}

/// How a session ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The epoch it ended in.
    pub epoch: u64,
    /// The final evaluation.
    pub eval: Eval,
    /// Whether it reached the run's last epoch (not stopped early).
    pub finished: bool,
    /// Samples this peer trained on.
    pub samples: u64,
}

/// The optimizer the manifest names, for `len` parameters.
pub fn optimizer_config(m: &RunManifest) -> OptimizerConfig {
    let o = &m.optimizer;
    match o.kind {
        OptimizerKind::Adamw => {
            OptimizerConfig::AdamW(AdamWConfig::new(o.lr).weight_decay(o.weight_decay))
        }
        OptimizerKind::Sgd => OptimizerConfig::Sgd(
            SgdConfig::new(o.lr)
                .momentum(o.momentum)
                .nesterov(o.momentum > 0.0)
                .weight_decay(o.weight_decay),
        ),
        OptimizerKind::Sign => OptimizerConfig::Sgd(
            SgdConfig::new(o.lr)
                .momentum(o.momentum)
                .weight_decay(o.weight_decay)
                .sign(true),
        ),
    }
}

/// The collaborative optimizer's configuration for the manifest.
pub fn collaborative_config(m: &RunManifest) -> Result<CollaborativeConfig> {
    let mode = match m.mode {
        ModeSpec::Gradients => Mode::Gradients,
        ModeSpec::Diloco { inner_steps, .. } => Mode::LocalSgd { inner_steps },
    };
    let mut cfg = CollaborativeConfig::new(m.name.clone(), m.target_batch_size, mode);
    (cfg.averager.codec, cfg.compression) = GradientCompression::parse_codec(&m.codec)
        .map_err(|e| anyhow!("codec {:?}: {e}", m.codec))?;
    cfg.averager.aggregation = m
        .aggregation
        .parse()
        .map_err(|e| anyhow!("aggregation {:?}: {e}", m.aggregation))?;
    cfg.averager.verify = m.verify;
    cfg.worker_momentum = m.worker_momentum.map(|b| b as f32);
    cfg.averaging_timeout = Duration::from_secs(15);
    // Whatever rounds failed or ran apart since the last state round, the peers that finish
    // together end with one model.
    cfg.final_epoch = Some(m.epochs);
    cfg.lr_schedule = m.optimizer.schedule.map(|s| match s {
        ScheduleSpec::Cosine { warmup_epochs } => LrSchedule::WarmupCosine {
            peak_lr: m.optimizer.lr,
            min_lr: 0.0,
            warmup_steps: warmup_epochs,
            total_steps: m.epochs,
        },
    });
    if let ModeSpec::Diloco {
        outer_lr,
        outer_momentum,
        ..
    } = m.mode
    {
        cfg.outer = SgdConfig::new(outer_lr)
            .momentum(outer_momentum)
            .nesterov(outer_momentum > 0.0);
    }
    Ok(cfg)
}

/// The context length of the manifest's model (text windows), 0 for images.
fn context_of(m: &RunManifest) -> usize {
    match m.model {
        ModelSpec::Charlm { context, .. } => context,
        ModelSpec::Mlp { .. } => 0,
    }
}

/// What training needs of a session once the model is unpacked.
struct Ctx {
    node: Node,
    data: Arc<Dataset>,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_every: u64,
    sample_seed: u64,
    shard: Option<Shard>,
    stop: Arc<AtomicBool>,
    reporter: Arc<dyn Reporter>,
    attack: Option<Attack>,
}

struct Trainer {
    collab: CollaborativeOptimizer,
    params: ParamSet,
    binding: VarBinding,
    net: Arc<dyn Net>,
    /// Evaluations between steps, off the training thread (`None` for a model with a remote
    /// layer: those evaluate in line).
    evals: Option<BackgroundEval>,
}

impl Session {
    /// Trains until the run's last epoch or until `stop` is set.
    pub async fn run(self) -> Result<Outcome> {
        let Session {
            node,
            manifest: m,
            signed,
            data,
            built,
            checkpoint_dir,
            checkpoint_every,
            sync_first,
            sample_seed,
            shard,
            stop,
            reporter,
            progress_interval,
            delayed_update,
            max_stale,
            attack,
            min_peers,
        } = self;
        let Built {
            net,
            mut params,
            binding,
        } = built;
        let mut optimizer = optimizer_config(&m)
            .build(params.len())
            .map_err(|e| anyhow!("{e}"))?;
        // A checkpoint of this run, if the directory has one.
        let mut resumed = None;
        if let Some(dir) = &checkpoint_dir {
            if checkpoint::check_checkpoint_dir(dir, &signed)? {
                let meta = StateTarget::new(&mut params)
                    .optimizer("opt", optimizer.as_mut())
                    .load(dir)
                    .with_context(|| format!("restoring the checkpoint in {}", dir.display()))?;
                resumed = Some(meta.epoch);
            } else {
                checkpoint::claim(dir, &signed)?;
            }
        }
        let mut cfg = collaborative_config(&m)?;
        if let Some(every) = progress_interval {
            cfg.progress.publish_interval = every;
            cfg.fetch_interval = every;
        }
        cfg.delayed_update = delayed_update && matches!(cfg.mode, Mode::Gradients);
        if let Some(f) = max_stale {
            cfg.delayed_max_stale = f;
        }
        cfg.averager.result_bias = attack.and_then(|a| a.result_bias());
        let mut collab = CollaborativeOptimizer::new(node.clone(), optimizer, &params, cfg).await?;
        if let (Some(epoch), Some(dir)) = (resumed, &checkpoint_dir) {
            collab.resume(epoch, &params);
            reporter.event(&Event::Resumed {
                epoch,
                dir: dir.display().to_string(),
            });
        }
        let server = StateServer::start(node.clone(), StateServerConfig::new(m.name.clone()))?;
        let republish = tokio::spawn(republish(node.clone(), m.name.clone(), signed.clone()));
        let evals = BackgroundEval::new(&m, &data);
        let mut t = Trainer {
            collab,
            params,
            binding,
            net,
            evals,
        };
        let mut announced = false;
        if sync_first {
            // A joiner with nothing of its own (no checkpoint) waits for the run's peers: one
            // that trained alone from the initial values while the creator was still starting
            // would step through epochs nobody else took (and pull the others to its state).
            let wait = if resumed.is_none() {
                JOIN_WAIT
            } else {
                Duration::ZERO
            };
            announced = match t.sync(&node, &m, reporter.as_ref(), 0, wait, &stop).await {
                Ok(announced) => announced,
                Err(e) => match e.ended_at(&m).filter(|_| resumed.is_none()) {
                    // Training the whole run alone from its initial values would end with a
                    // model nobody else has, reported as if this peer had joined the run.
                    Some(epoch) => anyhow::bail!(
                        "run {:?} has ended: its peers' state is at epoch {epoch} of {}, and \
                         none of them serves it any more; start a new run (--new-run) or \
                         resume from a checkpoint",
                        m.name,
                        m.epochs
                    ),
                    None => false,
                },
            };
        }
        t.binding.params_to_vars(&t.params)?;
        t.collab.serve_state(server.clone(), &t.params).await;
        if !announced {
            // A creator's progress record is there before its first batch: a joiner that
            // synced from it counts it at once (and it counts the joiner, see `sync`).
            if let Err(e) = t.collab.announce().await {
                tracing::debug!("announcing this peer's progress: {e}");
            }
        }
        if min_peers > 1 && t.wait_for_peers(min_peers, reporter.as_ref(), &stop).await {
            t.collab.start_together();
        }
        let (unigram, bigram) = match data.as_ref() {
            Dataset::Text(text) => (Some(text.unigram_entropy()), Some(text.bigram_entropy())),
            Dataset::Images(_) => (None, None),
        };
        reporter.event(&Event::Started {
            peer: node.peer_id().to_string(),
            run: m.name.clone(),
            model: m.model.name().into(),
            params: t.params.len(),
            epoch: t.collab.epoch(),
            epochs: m.epochs,
            unigram_entropy_nats: unigram,
            bigram_entropy_nats: bigram,
        });
        let ctx = Ctx {
            node,
            data,
            checkpoint_dir,
            checkpoint_every,
            sample_seed,
            shard,
            stop,
            reporter,
            attack,
        };
        match attack {
            Some(a @ Attack::ReducerBias(_)) => tracing::warn!(
                "this peer lies on purpose: as a reducer it returns results altered by {a}"
            ),
            Some(a) => {
                tracing::warn!("this peer lies on purpose: it sends {a} instead of its gradients")
            }
            None => {}
        }
        let result = t.train(&ctx, &m).await;
        republish.abort();
        server.shutdown().await;
        t.collab.shutdown().await;
        result
    }
}

impl Trainer {
    /// Syncs state from the swarm (at least `min_epoch`); a failure is reported (and
    /// returned): training may go on from the local values. While no peer serves a fitting
    /// state, reads again every [`JOIN_POLL`] for up to `wait` (or until `stop` is set).
    /// Returns whether it synced and published this peer's progress after.
    async fn sync(
        &mut self,
        node: &Node,
        m: &RunManifest,
        reporter: &dyn Reporter,
        min_epoch: u64,
        wait: Duration,
        stop: &AtomicBool,
    ) -> Result<bool, Unsynced> {
        let layout = self.collab.state_view(&self.params).layout();
        let mut cfg = SyncConfig::new(m.name.clone());
        cfg.min_epoch = min_epoch;
        cfg.deadline = SYNC_DEADLINE;
        cfg.max_rounds = 5;
        let until = Instant::now() + wait;
        let mut told = false;
        // (Looked at first after one poll: a run's peers publish progress as they start.)
        let mut ended_looked = Instant::now();
        let synced = loop {
            match sync_state(node, &cfg, &layout).await {
                Err(SyncError::NoDonors { .. })
                    if Instant::now() + JOIN_POLL < until && !stop.load(Ordering::Relaxed) =>
                {
                    if !std::mem::replace(&mut told, true) {
                        tracing::info!(
                            "state sync: no peer of the run serves its state yet; waiting up to {} s",
                            wait.as_secs()
                        );
                    }
                    if ended_looked.elapsed() >= ENDED_POLL {
                        ended_looked = Instant::now();
                        let highest = self.collab.highest_reported_epoch().await;
                        if let Some(epoch) = highest.ok().flatten().filter(|e| *e >= m.epochs) {
                            return Err(Unsynced::Ended(epoch));
                        }
                    }
                    tokio::time::sleep(JOIN_POLL).await;
                }
                other => break other,
            }
        };
        match synced {
            Ok((synced, report)) => match self.collab.restore_from(&mut self.params, &synced) {
                Ok(()) => {
                    reporter.event(&Event::Synced {
                        epoch: report.epoch,
                        bytes: report.bytes,
                        donors: report.donors.iter().filter(|d| d.chunks > 0).count(),
                        seconds: report.seconds,
                    });
                    // The others count this peer from now on, not from its first batch: a
                    // donor training alone waits for it instead of stepping past the state it
                    // just sent (which would make this peer sync again).
                    match self.collab.announce().await {
                        Ok(()) => return Ok(true),
                        Err(e) => tracing::debug!("announcing this peer after state sync: {e}"),
                    }
                }
                Err(e) => tracing::warn!("state sync: the synced state does not apply: {e}"),
            },
            Err(e @ SyncError::NoDonors { .. }) => {
                tracing::info!("state sync: no donors yet; starting from the run's initial values");
                return Err(Unsynced::Failed(e));
            }
            Err(e) => {
                tracing::warn!("state sync failed ({e}); training from local values");
                return Err(Unsynced::Failed(e));
            }
        }
        Ok(false)
    }

    /// Waits until the run has `wanted` live peers (this one included), `stop` is set or
    /// [`MIN_PEERS_WAIT`] passes, keeping this peer's progress record fresh meanwhile; whether
    /// the peers are there.
    async fn wait_for_peers(
        &mut self,
        wanted: usize,
        reporter: &dyn Reporter,
        stop: &AtomicBool,
    ) -> bool {
        let until = Instant::now() + MIN_PEERS_WAIT;
        let mut told = None;
        loop {
            let peers = match self.collab.live_peers().await {
                Ok(n) => n,
                Err(e) => {
                    tracing::debug!("reading the run's peers: {e}");
                    0
                }
            };
            if told != Some(peers) {
                told = Some(peers);
                reporter.event(&Event::Waiting { peers, wanted });
            }
            if peers >= wanted {
                return true;
            }
            if stop.load(Ordering::Relaxed) {
                return false;
            }
            if Instant::now() >= until {
                tracing::warn!(
                    "the run has {peers} of the {wanted} peers --min-peers asks for after {} s: training with them",
                    MIN_PEERS_WAIT.as_secs()
                );
                return false;
            }
            tokio::time::sleep(MIN_PEERS_POLL).await;
            // Its record lives `report_lifetime`: refreshed, so that a long wait does not
            // make this peer vanish from the others' count.
            if let Err(e) = self.collab.announce().await {
                tracing::debug!("announcing this peer while waiting for peers: {e}");
            }
        }
    }

    fn save(&self, dir: &std::path::Path, reporter: &dyn Reporter) {
        // The epoch the parameters are at (a delayed update's round in flight is not in them).
        let saved = StateView::new(self.collab.params_epoch(), &self.params)
            .optimizer("opt", self.collab.optimizer())
            .save(dir);
        match saved {
            Ok(_) => reporter.event(&Event::Checkpoint {
                epoch: self.collab.params_epoch(),
                dir: dir.display().to_string(),
            }),
            Err(e) => tracing::warn!("saving a checkpoint in {} failed: {e}", dir.display()),
        }
    }

    async fn train(&mut self, s: &Ctx, m: &RunManifest) -> Result<Outcome> {
        let reporter = s.reporter.as_ref();
        let diloco = matches!(m.mode, ModeSpec::Diloco { .. });
        let context = context_of(m);
        let batch_size = m.batch_size as usize;
        let mut batches = match s.shard {
            Some(shard) => Batches::Shared(SharedOrder::new(batch_size, m.seed, shard)),
            None => Batches::Own(Sampler::new(batch_size, s.sample_seed)),
        };
        let started = Instant::now();
        let mut samples_total = 0u64;
        let (mut window_start, mut window_samples) = (Instant::now(), 0u64);
        let mut failures = 0u32;
        let mut steps = Steps::default();
        let mut liar_rng = StdRng::seed_from_u64(s.sample_seed ^ 0x6c69_6172);
        while self.collab.epoch() < m.epochs {
            if s.stop.load(Ordering::Relaxed) {
                self.flush(s, m, &mut steps).await?;
                if let Some(dir) = &s.checkpoint_dir {
                    self.save(dir, reporter);
                }
                let eval = evaluate(self.net.clone(), &s.data).await?;
                reporter.event(&Event::Left {
                    epoch: self.collab.epoch(),
                    reason: "interrupted".into(),
                });
                return Ok(Outcome {
                    epoch: self.collab.epoch(),
                    eval,
                    samples: samples_total,
                    finished: false,
                });
            }
            // One batch's gradient, computed off the network's threads.
            let batch = batches.next(self.collab.epoch(), &s.data, context)?;
            let samples = batch.samples;
            let net = self.net.clone();
            let binding = self.binding.clone();
            let mut params = std::mem::take(&mut self.params);
            // The network's threads woken during the last batch run before the next one. Under
            // `SCHED_BATCH` (`--sched batch`) a woken thread does not preempt a running one, and
            // with a core per process the next batch began before them: a search's round trips
            // waited for one batch after another (two generated-glyphs MLP peers on a core
            // each: 7 ms from starting a search to asking its leader, 1.5 ms with a yield; the
            // pair's run 1.66-1.72 s against 1.72-1.88 s, six alternating runs each; the lone
            // peer's 2.42-2.46 s against 2.44-2.47 s). Yielding here rather than in the batch's
            // thread spares a switch to this thread and back (1.68-1.74 s that way). Nothing
            // to yield to with a core to spare.
            std::thread::yield_now();
            let (params, computed) = tokio::task::spawn_blocking(move || {
                let computed = (|| -> Result<f32> {
                    let loss = net.loss(&batch)?;
                    let grads = loss.backward()?;
                    binding.grads_to_set(&grads, &mut params)?;
                    Ok(loss.to_scalar::<f32>()?)
                })();
                (params, computed)
            })
            .await?;
            self.params = params;
            // A batch can fail for a while without anything being wrong here (a remote expert
            // layer whose servers are not found yet, or just went down): retry, boundedly.
            let loss = match computed {
                Ok(loss) => {
                    failures = 0;
                    loss
                }
                Err(e) => {
                    failures += 1;
                    if failures >= MAX_BATCH_FAILURES {
                        return Err(e.context(format!("{failures} batches in a row failed")));
                    }
                    tracing::warn!("a batch failed ({e:#}); retrying");
                    tokio::time::sleep(BATCH_RETRY_PAUSE).await;
                    continue;
                }
            };
            anyhow::ensure!(
                loss.is_finite(),
                "the loss is {loss}: training diverged (lower --lr?)"
            );
            samples_total += samples;
            window_samples += samples;
            steps.loss_sum += f64::from(loss);
            steps.loss_batches += 1;
            steps.last_loss = f64::from(loss);
            if let Some(a) = &s.attack {
                a.apply(self.params.grads_mut(), &mut liar_rng);
            }
            let report = self.collab.step(&mut self.params, samples).await?;
            if diloco || report.stepped {
                self.binding.params_to_vars(&self.params)?;
            }
            let elapsed = window_start.elapsed().as_secs_f64();
            if elapsed >= 1.0 {
                steps.rate = window_samples as f64 / elapsed;
                (window_start, window_samples) = (Instant::now(), 0);
            }
            if report.stepped {
                self.stepped(s, m, &report, &mut steps).await?;
            }
            // Behind the swarm (more than one epoch, a synced state that was already an epoch
            // old, or a round that met the others' later epoch) and no step taken: catch up by
            // state sync.
            if report.behind && !report.stepped {
                let floor = report.sync_floor();
                // A failure is reported; training goes on from the local values.
                let _ = self
                    .sync(&s.node, m, reporter, floor, Duration::ZERO, &s.stop)
                    .await;
                self.binding.params_to_vars(&self.params)?;
            }
        }
        self.flush(s, m, &mut steps).await?;
        let eval = evaluate(self.net.clone(), &s.data).await?;
        let (test_accuracy, val_loss_nats) = split(eval);
        if let Some(dir) = &s.checkpoint_dir {
            self.save(dir, reporter);
        }
        reporter.event(&Event::Finished {
            epoch: self.collab.epoch(),
            test_accuracy,
            val_loss_nats,
            samples: samples_total,
            seconds: started.elapsed().as_secs_f64(),
            params_sha256: params_sha256(self.params.params()),
            refused_peers: self
                .collab
                .refused_peers()
                .iter()
                .map(|p| p.to_string())
                .collect(),
        });
        Ok(Outcome {
            epoch: self.collab.epoch(),
            eval,
            samples: samples_total,
            finished: true,
        })
    }
}

/// What the step events of a session carry over from batch to batch.
#[derive(Default)]
struct Steps {
    /// The mean loss of the batches since the last step: what the loss curve reports.
    loss_sum: f64,
    loss_batches: u32,
    /// The latest batch's loss.
    last_loss: f64,
    /// This peer's samples per second over the last second or so.
    rate: f64,
}

impl Trainer {
    /// After a global (or outer) step: the step event, the loss curve, an evaluation and a
    /// checkpoint when due.
    async fn stepped(
        &mut self,
        s: &Ctx,
        m: &RunManifest,
        report: &StepReport,
        steps: &mut Steps,
    ) -> Result<()> {
        let reporter = s.reporter.as_ref();
        // Metrics, the node's loss curve (dashboard) and its heartbeat.
        self.collab
            .report_loss(steps.loss_sum / f64::from(steps.loss_batches.max(1)));
        (steps.loss_sum, steps.loss_batches) = (0.0, 0);
        let rate = steps.rate;
        let swarm = report.swarm.clone();
        reporter.event(&Event::Step {
            epoch: report.epoch,
            loss: steps.last_loss,
            samples_per_second: rate,
            swarm_samples_per_second: swarm.as_ref().map_or(rate, |s| s.samples_per_second),
            peers: swarm.as_ref().map_or(1, |s| s.peers.max(1)),
            samples: report.samples,
            waiting_seconds: report.timings.waiting.as_secs_f64(),
            averaging_seconds: report.timings.averaging.as_secs_f64(),
            lr: self.collab.optimizer().lr(),
            bytes_sent: report.round.as_ref().map_or(0, |r| r.bytes_sent),
            bytes_received: report.round.as_ref().map_or(0, |r| r.bytes_received),
            state_checked: report.state_checked,
            state_averaged: report.state_averaged,
            group_size: report.group_size,
            averaging_error: report.averaging_error.clone(),
            errors: report.errors.clone(),
            audit: report
                .round
                .as_ref()
                .and_then(|r| r.audit.as_ref())
                .map(crate::event::Audit::of),
        });
        let epoch = report.epoch;
        // With a delayed update in flight the parameters are one epoch short: evaluations and
        // checkpoints wait for the epoch they name.
        if epoch.is_multiple_of(m.eval_every)
            && epoch < m.epochs
            && epoch == self.collab.params_epoch()
        {
            match self.evals.as_mut() {
                Some(evals) => {
                    if let Some((e, eval)) = evals.start(epoch, &self.params, &s.data).await? {
                        reporter.event(&Event::eval(e, eval));
                    }
                }
                None => {
                    let eval = evaluate(self.net.clone(), &s.data).await?;
                    reporter.event(&Event::eval(epoch, eval));
                }
            }
        } else if let Some((e, eval)) = self.evals.as_mut().map_or(Ok(None), |v| v.ready())? {
            reporter.event(&Event::eval(e, eval));
        }
        if let Some(dir) = &s.checkpoint_dir {
            if epoch.is_multiple_of(s.checkpoint_every.max(1)) {
                self.save(dir, reporter);
            }
        }
        Ok(())
    }

    /// Applies a delayed update's round in flight (its step event too), so that the
    /// parameters are the epoch's.
    /// Also waits for an evaluation still running in the background (its event goes out).
    async fn flush(&mut self, s: &Ctx, m: &RunManifest, steps: &mut Steps) -> Result<()> {
        if let Some(report) = self.collab.flush(&mut self.params).await? {
            self.binding.params_to_vars(&self.params)?;
            self.stepped(s, m, &report, steps).await?;
        }
        if let Some(evals) = self.evals.as_mut() {
            if let Some((epoch, eval)) = evals.wait().await? {
                s.reporter.event(&Event::eval(epoch, eval));
            }
        }
        Ok(())
    }
}

/// SHA-256 of `params`' bits, little-endian, as hex.
pub fn params_sha256(params: &[f32]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for chunk in params.chunks(4096) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        h.update(&bytes);
    }
    hex::encode(h.finalize())
}

/// Why [`Trainer::sync`] did not sync.
enum Unsynced {
    /// The sync failed (reported already).
    Failed(SyncError),
    /// While it waited for a donor, the run's progress records showed it had ended (a peer
    /// reported this epoch, the run's last or later).
    Ended(u64),
}

impl Unsynced {
    /// The epoch that shows run `m` has ended, if this says so: progress records at its last
    /// epoch, or a failed sync whose donors announced its last state (the peers left; their
    /// announcements outlive them for a while).
    fn ended_at(&self, m: &RunManifest) -> Option<u64> {
        match self {
            Unsynced::Ended(epoch) => Some(*epoch),
            Unsynced::Failed(SyncError::Incomplete {
                announced_epoch: Some(epoch),
                ..
            }) if *epoch + 1 >= m.epochs => Some(*epoch),
            Unsynced::Failed(_) => None,
        }
    }
}

/// Evaluates off the network's threads.
async fn evaluate(net: Arc<dyn Net>, data: &Arc<Dataset>) -> Result<Eval> {
    let data = data.clone();
    tokio::task::spawn_blocking(move || net.evaluate(&data)).await?
}

/// Keeps the run's signed manifest in the DHT while this peer trains.
async fn republish(node: Node, name: String, signed: SignedManifest) {
    loop {
        if let Err(e) = manifest::publish(&node, &name, &signed).await {
            tracing::debug!("re-publishing the run's manifest: {e:#}");
        }
        tokio::time::sleep(manifest::REPUBLISH_EVERY).await;
    }
}
