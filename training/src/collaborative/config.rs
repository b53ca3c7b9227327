//! What a collaborative optimizer is told ([`CollaborativeConfig`], [`Mode`], [`Averaging`])
//! and what it reports ([`StepReport`], [`StepTimings`], [`TrainingError`]).

use std::time::Duration;

use starling_averager::gossip::{GossipConfig, GossipReport};
use starling_averager::{AveragerConfig, AveragerError, RoundReport};
use starling_compression::Codec;

use crate::optim::{LrSchedule, OptimError, SgdConfig};
use crate::progress::{ProgressConfig, ProgressError, SwarmProgress};

/// [`CollaborativeConfig::delayed_max_stale`]'s default.
const DEFAULT_MAX_STALE: f64 = 0.125;

/// How the peers train together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// Average gradients over a global batch of `target_batch_size` samples, then take one
    /// shared optimizer step.
    Gradients,
    /// Take `inner_steps` local optimizer steps, then average the parameter deltas and apply the
    /// outer optimizer (DiLoCo).
    LocalSgd {
        /// Local steps between averaging rounds (DiLoCo's H).
        inner_steps: u64,
    },
}

/// How local SGD averages at the end of a phase.
#[derive(Debug, Clone)]
pub enum Averaging {
    /// A group all-reduce (matchmaking, then butterfly): every member ends with the same
    /// average.
    Group,
    /// One gossip round with neighbours of the configured topology (its prefix is set from
    /// the run): no waiting for a group; peers converge towards each other.
    Gossip(GossipConfig),
}

/// Why a collaborative step failed (averaging failures are not errors: see [`StepReport`]).
#[derive(Debug, thiserror::Error)]
pub enum TrainingError {
    /// The optimizer refused the buffers.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// Progress could not be read or published.
    #[error(transparent)]
    Progress(#[from] ProgressError),
    /// The averager could not start, or its node stopped.
    #[error(transparent)]
    Averager(#[from] AveragerError),
    /// The configuration cannot work (what to change).
    #[error("invalid collaborative configuration: {0}")]
    Config(String),
    /// The parameters do not match what the optimizer was built for.
    #[error("the parameter set has {actual} values but the collaborative optimizer was built for {expected}")]
    Schema {
        /// Values it was built for.
        expected: usize,
        /// Values passed.
        actual: usize,
    },
}

/// Everything tunable about collaborative training.
#[derive(Debug, Clone)]
pub struct CollaborativeConfig {
    /// The run's name: the averager's prefix and the progress key derive from it.
    pub run: String,
    /// Gradient mode: samples per global step.
    pub target_batch_size: u64,
    /// How the peers train together.
    pub mode: Mode,
    /// The averaging configuration (its prefix is set from `run`).
    pub averager: AveragerConfig,
    /// Local SGD: average in groups (the default) or through gossip. Gradient mode needs
    /// `Group`.
    pub averaging: Averaging,
    /// The progress tracker's configuration (run and target set from the fields above).
    pub progress: ProgressConfig,
    /// Bound on one averaging round, matchmaking included.
    pub averaging_timeout: Duration,
    /// How often to read the swarm's progress (in between, the last reading is extrapolated).
    pub fetch_interval: Duration,
    /// Gradient mode: a peer stops accumulating when the swarm's samples, the others'
    /// projected from their compute rates, reach the target (on by default: each peer then
    /// computes about its share of the global batch). Off, only reported samples count, and a
    /// peer steps early only when its own samples reach the target: for callers that give
    /// each peer an exact share and then wait with `CollaborativeOptimizer::try_step`
    /// (reproducible experiments).
    pub projected_batch: bool,
    /// DiLoCo's outer optimizer (local-SGD mode).
    pub outer: SgdConfig,
    /// Every this many epochs, the gradient round's group also brings its members to one
    /// parameters and optimizer state (in local SGD with group averaging, the phase start and
    /// the outer optimizer's state), so that groups smaller than the swarm, or rounds that
    /// failed or averaged only part of the gradients, do not let peers drift apart for good.
    /// After the gradients, in the same group, the members compare 64-bit digests of that
    /// state (a few hundred bytes) and average it (weighted by samples like the gradients,
    /// with the exact codec whatever `averager.codec` says) only if one differs; after a
    /// lossy codec's round, which leaves members apart, it is averaged without comparing.
    /// See [`Averager::reconcile`](starling_averager::Averager::reconcile). `None` never
    /// does.
    pub state_averaging_every: Option<u64>,
    /// The run's last epoch, when it has one: the round that reaches it also reconciles the
    /// state (as every `state_averaging_every`-th does), so that the peers in it end the run
    /// holding one model, whatever rounds failed or ran in smaller groups since the last state
    /// round (costing a digest comparison when they are already equal). Every peer of a run
    /// must set the same value (`starling train` sets the manifest's epochs); peers that
    /// disagree do not group in that round. `None` (the default): no such round.
    pub final_epoch: Option<u64>,
    /// With a lossy codec, average gradients (gradient mode) and pseudo-gradients (local SGD)
    /// with error feedback: what quantization dropped of this peer's contribution in one round
    /// is added to the next (see `starling_averager::Residuals`; one `f32` per parameter).
    /// Parameters and optimizer state are never averaged with feedback. No effect with the
    /// exact codec `none`.
    pub error_feedback: bool,
    /// Gradient mode: the delayed parameter update. The round that averages an epoch's
    /// gradients runs in the background while the caller computes the next epoch's batches
    /// (on the parameters from before that round); its optimizer step is applied one epoch late,
    /// at the first call after it finished, or once [`delayed_max_stale`] of the next batch
    /// has been computed (waiting for the round then). Communication then overlaps compute
    /// when a round takes less than that part of an epoch's compute, at the price of that
    /// part of the next gradient being one step stale. Once its group has formed, the next
    /// round's search starts beside its all-reduce (pre-scheduled as usual), so a slow link
    /// costs the all-reduce, not the all-reduce plus matchmaking. Every peer still applies the same
    /// averaged gradient to the same parameters (bit-identical with codec `none`), so peers
    /// with and without it can train together. Call
    /// `CollaborativeOptimizer::flush` before reading the parameters as the run's result
    /// (evaluation, checkpoints, the end of training). Off by default; local SGD refuses it.
    ///
    /// [`delayed_max_stale`]: CollaborativeConfig::delayed_max_stale
    pub delayed_update: bool,
    /// With [`delayed_update`]: the part of the next global batch (the swarm's samples as this peer
    /// projects them, against `target_batch_size`) that may be computed before the round in flight
    /// is applied; past it, the peer waits for the round. In (0, 1]; 1 lets a round run until this
    /// peer's whole share of the next batch is in (every gradient may be a step stale). Default
    /// 0.125. Measured on two generated-glyphs MLP peers (target 2048, 188 epochs, test accuracy
    /// 0.82-0.84 without the delayed update): 1 gave 0.68-0.77 (rounds that ended late in the next
    /// epoch), 0.5 gave 0.78-0.79, 0.25 0.81-0.82, 0.125 0.82-0.83, at the same speed on loopback,
    /// where a round ends within a few batches.
    ///
    /// [`delayed_update`]: CollaborativeConfig::delayed_update
    pub delayed_max_stale: f64,
    /// Gradient mode: matchmaking for a round starts in the background when the swarm is
    /// projected to reach its batch within about two matchmaking times (as measured in earlier
    /// rounds), so that the group is ready when the gradients are and a step does not wait for
    /// the DHT's round trips (hivemind's pre-scheduled matchmaking). On by default.
    pub scheduled_matchmaking: bool,
    /// How (pseudo-)gradient rounds compress: through the averager's codec (the default), in
    /// low rank (PowerSGD) or as DCT top-k coefficients; see [`GradientCompression`].
    pub compression: GradientCompression,
    /// The optimizer's learning rate as a function of the epoch (`None`: the rate it was built
    /// with, throughout). Set before every step, from the epoch the step ends (in local SGD,
    /// the epoch of the phase, for every inner step), so every peer uses the same rate on the
    /// same step whenever it joined.
    ///
    /// ```
    /// use starling_training::{CollaborativeConfig, LrSchedule, Mode};
    /// let mut cfg = CollaborativeConfig::new("run", 256, Mode::Gradients);
    /// // 600 epochs: 30 of warmup, then a half cosine down to 0.
    /// cfg.lr_schedule = Some(LrSchedule::WarmupCosine {
    ///     peak_lr: 0.005, min_lr: 0.0, warmup_steps: 30, total_steps: 600,
    /// });
    /// ```
    pub lr_schedule: Option<LrSchedule>,
    /// Gradient mode: worker momentum (Karimireddy, He and Jaggi 2021). Each peer averages
    /// its momentum `m <- beta * m + g` (`g` its epoch's mean gradient) instead of `g`, and
    /// the optimizer steps with the averaged momentum: give it no momentum of its own
    /// (`SgdConfig::new(lr)`); with the `mean` aggregation that is the same training as the
    /// optimizer's momentum `beta`, up to rounding. What it is for: a robust aggregation sees
    /// each peer's momentum, in which the noise of single batches has averaged out, so a peer
    /// that sends the opposite of its gradient (or any lie a few spreads away) stands out from
    /// the honest ones and is clipped (or, with `centered-clip:reject=2`, left out), where its
    /// single gradients are lost in the batch noise. Peers with and without it (or with another
    /// `beta`) never group: the averager's key names it. The momentum lives in memory (a state
    /// sync keeps it): a peer that starts or restarts mid-run starts it from zero, so for about
    /// `1 / (1 - beta)` rounds its contributions are shorter than the others' (and a robust
    /// aggregation clips them). `None` (the default): off. Local SGD refuses it (DiLoCo's
    /// outer optimizer has its momentum).
    ///
    /// ```
    /// use starling_training::{CollaborativeConfig, Mode};
    /// let mut cfg = CollaborativeConfig::new("run", 512, Mode::Gradients);
    /// cfg.worker_momentum = Some(0.9);
    /// cfg.averager.aggregation = "centered-clip:reject=2".parse().unwrap();
    /// ```
    pub worker_momentum: Option<f32>,
}

impl CollaborativeConfig {
    /// Defaults: groups of up to 16, the exact codec, 30 s per averaging round, swarm progress
    /// read at most twice a second, DiLoCo's outer optimizer (SGD, lr 0.7, Nesterov momentum
    /// 0.9), error feedback on (it acts only with a lossy codec).
    pub fn new(run: impl Into<String>, target_batch_size: u64, mode: Mode) -> Self {
        let run = run.into();
        let mut averager = AveragerConfig::new(format!("{run}.train"));
        averager.target_group_size = 16;
        let progress = ProgressConfig::new(run.clone(), target_batch_size);
        CollaborativeConfig {
            run,
            target_batch_size,
            mode,
            averager,
            averaging: Averaging::Group,
            progress,
            averaging_timeout: Duration::from_secs(30),
            fetch_interval: Duration::from_millis(500),
            projected_batch: true,
            outer: SgdConfig::new(0.7).momentum(0.9).nesterov(true),
            state_averaging_every: Some(10),
            final_epoch: None,
            error_feedback: true,
            delayed_update: false,
            delayed_max_stale: DEFAULT_MAX_STALE,
            scheduled_matchmaking: true,
            compression: GradientCompression::Codec,
            lr_schedule: None,
            worker_momentum: None,
        }
    }
}

/// How the collaborative optimizer's (pseudo-)gradient rounds compress. The parameters and
/// optimizer state that rounds reconcile (`CollaborativeConfig::state_averaging_every`) are
/// compared by digest and, where they differ, averaged exact.
///
/// ```
/// use starling_training::{CollaborativeConfig, GradientCompression, Mode};
/// let mut cfg = CollaborativeConfig::new("run", 256, Mode::Gradients);
/// cfg.compression = GradientCompression::PowerSgd { rank: 4, momentum: 1.0, bf16: true };
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum GradientCompression {
    /// Through the averager's codec (`AveragerConfig::codec`), with error feedback when
    /// `CollaborativeConfig::error_feedback` is on and the codec is lossy.
    #[default]
    Codec,
    /// Low rank (PowerSGD) at this rank: every weight matrix (an N-D tensor as its first
    /// dimension by the rest) travels as two thin factors, biases and matrices too small to
    /// gain as they are, all exact; every member ends with the same bits (see
    /// `starling_averager::Averager::step_low_rank`). Always with error feedback.
    PowerSgd {
        /// The approximation's rank (1..=256).
        rank: usize,
        /// What the approximation missed decays by this factor each round (1: plain error
        /// feedback; about 0.999 with a sign step, `SgdConfig::sign`: a low-rank DeMo). See
        /// `starling_compression::lowrank::PowerSgd::momentum`.
        momentum: f32,
        /// The factors and the rest travel as bf16 (half the bytes of f32; every member still
        /// holds the same bits). See `starling_compression::lowrank::PowerSgd::values`.
        bf16: bool,
    },
    /// DCT top-k: the buffer in chunks of `chunk` values, each transformed (orthonormal
    /// DCT-II), its `k` largest coefficients sent (f16 values, or their signs times one scale),
    /// averaged exactly and sparse (see `starling_averager::Averager::step_sparse`); every
    /// member ends with the same bits. Always with error feedback.
    DctTopK {
        /// Values per chunk (2..=1024).
        chunk: usize,
        /// Coefficients kept per chunk (1..=chunk).
        k: usize,
        /// Send signs times one scale instead of f16 values.
        sign: bool,
        /// What was not sent decays by this factor each round (1: plain error feedback; about
        /// 0.999 with a sign step, `SgdConfig::sign`: DeMo). See
        /// `starling_compression::dct::DctTopK::momentum`.
        momentum: f32,
    },
}

impl GradientCompression {
    /// The averager codec and the gradient compression a codec name stands for, as
    /// `starling train --codec` takes it: a tensor codec (`none`, `f16`, `u8`, `u4`, ...) that
    /// every round goes through, or a compressor, `powersgd:RANK[:bf16][:momentum=B]` (1..=256) or
    /// `dct-topk:CHUNK:K[:sign][:momentum=B]` (2 <= CHUNK <= 1024, 1 <= K <= CHUNK;
    /// 0 < B <= 1, default 1), whose rounds keep peers
    /// bit-identical (the averager's codec is then the exact `none`, for the rounds that carry
    /// the state). The error says what is wrong with the name.
    ///
    /// ```
    /// use starling_compression::Codec;
    /// use starling_training::GradientCompression as G;
    /// assert_eq!(G::parse_codec("u8")?, (Codec::Uniform8Bit, G::Codec));
    /// assert_eq!(
    ///     G::parse_codec("powersgd:4")?,
    ///     (Codec::None, G::PowerSgd { rank: 4, momentum: 1.0, bf16: false })
    /// );
    /// assert_eq!(
    ///     G::parse_codec("powersgd:4:bf16:momentum=0.99")?.1,
    ///     G::PowerSgd { rank: 4, momentum: 0.99, bf16: true }
    /// );
    /// assert_eq!(
    ///     G::parse_codec("dct-topk:64:2:sign")?.1,
    ///     G::DctTopK { chunk: 64, k: 2, sign: true, momentum: 1.0 }
    /// );
    /// assert_eq!(
    ///     G::parse_codec("dct-topk:256:1:momentum=0.999")?.1,
    ///     G::DctTopK { chunk: 256, k: 1, sign: false, momentum: 0.999 }
    /// );
    /// assert!(G::parse_codec("dct-topk:256:1:momentum=2").is_err());
    /// assert!(G::parse_codec("powersgd:0").is_err());
    /// assert!(G::parse_codec("powersgd:4:sign").is_err());
    /// assert!(G::parse_codec("dct-topk:64:65").is_err());
    /// # Ok::<(), String>(())
    /// ```
    pub fn parse_codec(name: &str) -> Result<(Codec, GradientCompression), String> {
        if let Some(rest) = name.strip_prefix("powersgd:") {
            let usage = "powersgd:RANK[:bf16][:momentum=B]";
            let mut parts = rest.split(':');
            let rank = parts.next().unwrap_or_default();
            let rank: usize = rank
                .parse()
                .map_err(|_| format!("{usage} needs a whole number, not {rank:?}"))?;
            let max = starling_compression::lowrank::MAX_RANK;
            if !(1..=max).contains(&rank) {
                return Err(format!(
                    "the PowerSGD rank must be within 1..={max}, not {rank}"
                ));
            }
            let (bf16, momentum) = flag_and_momentum("powersgd", "bf16", usage, rest, parts)?;
            return Ok((
                Codec::None,
                GradientCompression::PowerSgd {
                    rank,
                    momentum,
                    bf16,
                },
            ));
        }
        if let Some(rest) = name.strip_prefix("dct-topk:") {
            let usage = || {
                format!("dct-topk:CHUNK:K[:sign][:momentum=B] needs whole numbers, not {rest:?}")
            };
            let mut parts = rest.split(':');
            let mut number = || -> Result<usize, String> {
                parts.next().and_then(|p| p.parse().ok()).ok_or_else(usage)
            };
            let (chunk, k) = (number()?, number()?);
            let usage = "dct-topk:CHUNK:K[:sign][:momentum=B]";
            let (sign, momentum) = flag_and_momentum("dct-topk", "sign", usage, rest, parts)?;
            let max = starling_compression::dct::MAX_CHUNK;
            if !((2..=max).contains(&chunk) && (1..=chunk).contains(&k)) {
                return Err(format!(
                    "dct-topk needs 2 <= CHUNK <= {max} and 1 <= K <= CHUNK, not {chunk} and {k}"
                ));
            }
            return Ok((
                Codec::None,
                GradientCompression::DctTopK {
                    chunk,
                    k,
                    sign,
                    momentum,
                },
            ));
        }
        let codec = name.parse::<Codec>().map_err(|e| {
            format!("{e} (or powersgd:RANK[:bf16][:momentum=B], dct-topk:CHUNK:K[:sign][:momentum=B] for compressed gradients)")
        })?;
        Ok((codec, GradientCompression::Codec))
    }
}

/// The options after a compressor's numbers: `flag` (first only), then `momentum=B`; anything
/// else is refused, naming `usage` and the spec (`{compressor}:{rest}`).
fn flag_and_momentum<'a>(
    compressor: &str,
    flag: &str,
    usage: &str,
    rest: &str,
    parts: impl Iterator<Item = &'a str>,
) -> Result<(bool, f32), String> {
    let (mut set, mut momentum) = (false, 1.0f32);
    for (i, part) in parts.enumerate() {
        match (i, part, part.strip_prefix("momentum=")) {
            (0, f, _) if f == flag => set = true,
            (_, _, Some(b)) if momentum == 1.0 => momentum = parse_momentum(compressor, b)?,
            _ => return Err(format!("{usage}, not {compressor}:{rest} ({part:?})")),
        }
    }
    Ok((set, momentum))
}

/// A compressor's `momentum=B`, within (0, 1].
fn parse_momentum(compressor: &str, b: &str) -> Result<f32, String> {
    b.parse::<f32>()
        .ok()
        .filter(|b| *b > 0.0 && *b <= 1.0)
        .ok_or_else(|| format!("{compressor}: the momentum must be within (0, 1], not {b:?}"))
}

/// What one call to [`CollaborativeOptimizer::step`](super::CollaborativeOptimizer::step) did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The epoch (global steps taken) after this call.
    pub epoch: u64,
    /// Whether a global step (gradient mode) or an outer step (local SGD) was taken.
    pub stepped: bool,
    /// Members of the averaging group when one formed (this peer included).
    pub group_size: Option<usize>,
    /// Why the step used only local values, when it did.
    pub averaging_error: Option<String>,
    /// Every failure this call met and went on from: the averaging round's, then progress
    /// reads or writes that failed (the last reading was used instead). None of them ends
    /// training; only this peer's own node stopping does.
    pub errors: Vec<String>,
    /// Whether this step's round brought its members to one state (every
    /// `state_averaging_every` epochs): they compared digests of their parameters and
    /// optimizer state and found them equal, or averaged them.
    pub state_checked: bool,
    /// Whether this step's round averaged the parameters and the optimizer state: some
    /// member's differed from the others' (or a lossy codec left them apart).
    pub state_averaged: bool,
    /// Samples this peer had accumulated when it stepped (or has accumulated so far).
    pub samples: u64,
    /// The swarm's progress as last read.
    pub swarm: Option<SwarmProgress>,
    /// Whether this peer's epoch is behind the swarm's (it should sync state).
    pub behind: bool,
    /// When a round of this call met the others' round of a later epoch (rounds are tagged
    /// with the epoch they end; this peer did not step): their epoch, which a state sync
    /// should bring at least.
    pub others_epoch: Option<u64>,
    /// The averaging round, when one ran (group averaging).
    pub round: Option<RoundReport>,
    /// The gossip round, when one ran (local SGD with [`Averaging::Gossip`]).
    pub gossip: Option<GossipReport>,
    /// Where the time of a global (or outer) step went; zero when none was taken.
    pub timings: StepTimings,
}

impl StepReport {
    /// The least epoch a state sync should bring when this call found the peer [`behind`]
    /// without stepping: the others' epoch when a round met it, else the epoch after this
    /// peer's.
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node, mut opt: starling_training::CollaborativeOptimizer, mut params: starling_training::ParamSet) -> Result<(), Box<dyn std::error::Error>> {
    /// use starling_training::{sync_state, SyncConfig};
    /// let report = opt.step(&mut params, 32).await?;
    /// if report.behind && !report.stepped {
    ///     let mut cfg = SyncConfig::new("my-run");
    ///     cfg.min_epoch = report.sync_floor();
    ///     let (synced, _) = sync_state(&node, &cfg, &opt.state_view(&params).layout()).await?;
    ///     opt.restore_from(&mut params, &synced)?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// [`behind`]: StepReport::behind
    pub fn sync_floor(&self) -> u64 {
        self.others_epoch.unwrap_or(0).max(self.epoch + 1)
    }
}

/// Where the time of one global step went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimings {
    /// From the epoch's first batch until the step began: local compute plus waiting for the
    /// swarm's global batch.
    pub waiting: Duration,
    /// Averaging (matchmaking and all-reduce).
    pub averaging: Duration,
    /// The optimizer update.
    pub optimizer: Duration,
}
