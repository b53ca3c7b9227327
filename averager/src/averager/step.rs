//! The step family of the [`Averager`]: [`Averager::step`] and its variants (error feedback,
//! the exact codec, blocking), and the path each of them takes — flatten and check the
//! tensors, find a group (a prepared search or a new one), run the all-reduce, write the
//! averaged spans back. The compressed rounds (`compressed.rs`) and the state reconciliation
//! (`reconcile.rs`) reuse its pieces.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use starling_node::NodeError;
use tokio::time::Instant;
use tracing::Instrument;

use super::schema::{wire_label, Schema};
use super::{member_info, AbortOnDrop, Averager, FlagGuard};
use crate::allreduce::run_allreduce;
use crate::group::Group;
use crate::matchmaking::find_group;
use crate::pool::PoolBuf;
use crate::{AveragerConfig, AveragerError, AveragingMode, Residuals, RoundReport};
use starling_node::lock::lock;

/// Elements flattened and checked at a time (fits in L1/L2).
const FLATTEN_PIECE: usize = 8192;

impl Averager {
    /// Finds a group and averages `tensors` with it, weighted by `weight` (e.g. the number of
    /// samples behind this peer's update), finishing before `deadline`. The tensors change only
    /// if the round completes, and only on the spans the report lists as averaged.
    ///
    /// Errors name the cause: [`AveragerError::SchemaMismatch`] when the other searching peers
    /// pass other tensor sizes or another codec, [`AveragerError::NoGroup`] when too few peers
    /// searched (a lone peer gives up after one matchmaking window), `Node(Closed)` at once
    /// when this peer's own node stops, [`AveragerError::StepInProgress`] for a second
    /// concurrent step, [`AveragerError::InvalidWeight`] and
    /// [`AveragerError::Deadline`] for bad arguments.
    pub async fn step(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
    ) -> Result<RoundReport, AveragerError> {
        self.step_impl(tensors, weight, deadline, None).await
    }

    /// [`Averager::step`] with error feedback for a lossy codec (see [`Residuals`]): the round
    /// averages `tensors + residual`, and `residuals` keeps what quantization dropped of this
    /// peer's contribution for the next round. Use one [`Residuals`] per tensor set (gradients,
    /// say; not parameters, whose quantization error is not meant to be replayed). With the
    /// exact codec `none` this is [`Averager::step`] and the residual stays empty. The residual
    /// restarts from zero when the tensor sizes or the codec change; an `Aux` peer contributes
    /// nothing and leaves it as it is.
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager, mut grads: Vec<f32>) -> Result<(), starling_averager::AveragerError> {
    /// use std::time::{Duration, Instant};
    /// let mut residuals = starling_averager::Residuals::new();
    /// for _ in 0..10 {
    ///     // ... compute this batch's gradient into `grads` ...
    ///     let deadline = Instant::now() + Duration::from_secs(30);
    ///     averager
    ///         .step_with_feedback(&mut [&mut grads[..]], 1.0, deadline, &mut residuals)
    ///         .await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn step_with_feedback(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
        residuals: &mut Residuals,
    ) -> Result<RoundReport, AveragerError> {
        self.step_impl(tensors, weight, deadline, Some(residuals))
            .await
    }

    async fn step_impl(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
        residuals: Option<&mut Residuals>,
    ) -> Result<RoundReport, AveragerError> {
        let inner = self.step_inner(
            self.config.clone(),
            tensors,
            weight,
            Instant::from_std(deadline),
            residuals,
        );
        self.guarded(inner).await
    }

    /// [`Averager::step`] with the exact codec `none`, whatever codec the configuration
    /// names: for values a lossy codec must not touch, such as the parameters and optimizer
    /// state a training run averages now and then (a second moment quantized to around zero,
    /// or below it, makes Adam's steps explode). Every member then holds the same bits.
    /// Peers group for it only with peers averaging the same sizes exactly.
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager, mut params: Vec<f32>, mut exp_avg_sq: Vec<f32>) -> Result<(), starling_averager::AveragerError> {
    /// use std::time::{Duration, Instant};
    /// let deadline = Instant::now() + Duration::from_secs(30);
    /// averager.step_exact(&mut [&mut params[..], &mut exp_avg_sq[..]], 1.0, deadline).await?;
    /// # Ok(()) }
    /// ```
    pub async fn step_exact(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
    ) -> Result<RoundReport, AveragerError> {
        let inner = self.step_inner(
            self.exact_config(),
            tensors,
            weight,
            Instant::from_std(deadline),
            None,
        );
        self.guarded(inner).await
    }

    /// [`Averager::prepare`] for a [`Averager::step_exact`] of tensors of `sizes`.
    pub fn prepare_exact(&self, sizes: &[usize], deadline: std::time::Instant) -> bool {
        if sizes.iter().sum::<usize>() == 0 {
            return false;
        }
        self.prepare_schema(
            Schema::of(sizes, &wire_label(&self.exact_config())),
            deadline,
        )
    }

    /// This averager's configuration with the exact codec and no zstd stage.
    fn exact_config(&self) -> Arc<AveragerConfig> {
        if self.config.codec == starling_compression::Codec::None
            && self.config.zstd_level.is_none()
        {
            return self.config.clone();
        }
        Arc::new(AveragerConfig {
            codec: starling_compression::Codec::None,
            zstd_level: None,
            ..(*self.config).clone()
        })
    }

    /// Runs one step's work (`inner`, not started yet): one step at a time, ended at once
    /// when this peer's node stops, recorded in the metrics.
    pub(super) async fn guarded(
        &self,
        inner: impl std::future::Future<Output = Result<RoundReport, AveragerError>>,
    ) -> Result<RoundReport, AveragerError> {
        if self.busy.swap(true, Ordering::AcqRel) {
            return Err(AveragerError::StepInProgress);
        }
        // Searching until `form_group` ends (a step that fails before it searched nothing).
        self.searching.store(true, Ordering::Release);
        let flags = [&self.busy, &self.searching];
        let _busy = FlagGuard(&flags);
        let node = self.transport.node();
        if node.is_closed() {
            return Err(NodeError::Closed.into());
        }
        let span = tracing::debug_span!(parent: node.span(), "averager");
        // A node that stops (shutdown, crash) ends the step at once: its streams are gone, and
        // waiting out the deadline would only hold the caller up. The tensors are written in
        // one synchronous pass at the end, so a step cut short never leaves them half-written.
        let result = tokio::select! {
            biased;
            _ = node.closed() => Err(NodeError::Closed.into()),
            r = inner.instrument(span) => r,
        };
        self.transport
            .metrics()
            .record_step(node, &result, self.bandwidth.current());
        result
    }

    /// Checks a step's weight and deadline; the weight this peer contributes with (none as an
    /// `Aux` peer).
    pub(super) fn check_step(&self, weight: f32, deadline: Instant) -> Result<f32, AveragerError> {
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(AveragerError::InvalidWeight(weight));
        }
        if deadline <= Instant::now() {
            return Err(AveragerError::Deadline("before the step began"));
        }
        Ok(if self.config.mode == AveragingMode::Aux {
            0.0
        } else {
            weight
        })
    }

    /// [`Averager::step`] for synchronous training loops: blocks the calling thread until the
    /// step ends, while the network keeps running on the runtime the averager was created on
    /// (which must be a multi-threaded one). Call it from a plain thread (the training loop's),
    /// never from inside an async runtime ([`AveragerError::BlockingInRuntime`]).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::{Duration, Instant};
    /// use starling_averager::{Averager, AveragerConfig};
    /// use starling_node::{Node, NodeConfig};
    ///
    /// let rt = tokio::runtime::Runtime::new()?; // network threads
    /// let node = rt.block_on(Node::start(NodeConfig::default()))?;
    /// let averager = rt.block_on(Averager::new(node, AveragerConfig::new("my-run")))?;
    /// let mut weights = vec![0.0f32; 1000];
    /// for step in 0..100 {
    ///     // ... model compute on this thread ...
    ///     if step % 10 == 9 {
    ///         let deadline = Instant::now() + Duration::from_secs(30);
    ///         if let Err(e) = averager.step_blocking(&mut [&mut weights[..]], 1.0, deadline) {
    ///             eprintln!("no averaging this time: {e}");
    ///         }
    ///     }
    /// }
    /// rt.block_on(averager.shutdown());
    /// # Ok(()) }
    /// ```
    pub fn step_blocking(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
    ) -> Result<RoundReport, AveragerError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(AveragerError::BlockingInRuntime);
        }
        if self.runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
            return Err(AveragerError::Config(
                "step_blocking needs the averager to be created on a multi-threaded tokio runtime \
                 (a current-thread runtime is driven only by its own block_on)"
                    .into(),
            ));
        }
        self.runtime.block_on(self.step(tensors, weight, deadline))
    }

    async fn step_inner(
        &self,
        cfg: Arc<AveragerConfig>,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: Instant,
        residuals: Option<&mut Residuals>,
    ) -> Result<RoundReport, AveragerError> {
        let weight = self.check_step(weight, deadline)?;
        let mut flat = self.flatten(tensors)?;
        let sizes: Vec<usize> = tensors.iter().map(|t| t.len()).collect();
        // Error feedback: the round averages the corrected contribution. Only a lossy codec
        // leaves a residual, and only a peer that contributes (not `Aux`) carries one.
        let feedback = residuals
            .filter(|_| !cfg.codec.is_lossless() && cfg.mode != AveragingMode::Aux)
            .map(|r| r.prepare(&sizes, cfg.codec));
        if let Some(f) = feedback.as_deref() {
            f.add_residual_to(&mut flat)
                .map_err(|e| AveragerError::Schema(e.to_string()))?;
        }
        let schema = Schema::of(&sizes, &wire_label(&cfg));
        let (group, matchmaking_time, was_prepared) = self.form_group(&schema, deadline).await?;

        let ar_start = Instant::now();
        let env = self.round_env(cfg.clone(), feedback.is_some());
        let mut outcome = run_allreduce(env, &group, flat, f64::from(weight), deadline).await;
        let allreduce_time = ar_start.elapsed();
        self.after_round(&group, &mut outcome);
        if let Some(f) = feedback {
            // Averaged ranges start from zero (this peer's own reductions used its exact
            // values); those sent quantized take what the reducer did not see. Ranges not
            // averaged keep their residual: nothing of it went out. In range: the patches
            // cover parts of the flattened vector the residual was sized for.
            for (range, _) in &outcome.patches {
                let _ = f.clear_residual(range.clone());
            }
            for (range, residual) in &outcome.residuals {
                let _ = f.set_residual(range.start, residual);
            }
        }
        if cfg.mode != AveragingMode::Aux {
            for (range, values) in &outcome.patches {
                write_flat(tensors, range.start, values);
            }
        }
        Ok(RoundReport {
            round_id: group.round_id,
            group: outcome.group,
            my_index: group.my_index.get(),
            spans: outcome.spans,
            failed_peers: outcome.failed_peers,
            bytes_sent: outcome.bytes_sent,
            bytes_received: outcome.bytes_received,
            fast_lane_transfers: outcome.fast_lanes,
            warm_lane_transfers: outcome.warm_lanes,
            matchmaking_time,
            prepared: was_prepared,
            allreduce_time,
            measured_upload: outcome.measured_bandwidth,
            audit: outcome.audit,
        })
    }

    /// Finds the group of a step averaging `schema`: the search [`Averager::prepare`] started
    /// for it, or a new one. Returns the group, the time matchmaking took, and whether it was
    /// prepared.
    pub(super) async fn form_group(
        &self,
        schema: &Schema,
        deadline: Instant,
    ) -> Result<(Group, std::time::Duration, bool), AveragerError> {
        let flags = [&self.searching];
        let searching = FlagGuard(&flags);
        let formed = self.search(schema, deadline).await;
        if let Ok((group, ..)) = &formed {
            self.remember_group(group);
        }
        // The search is over (a search for the next step may be prepared from now on) once
        // the flag is down: counted after it.
        drop(searching);
        self.searches_done.fetch_add(1, Ordering::AcqRel);
        formed
    }

    /// How many steps' matchmaking has ended, with a group or without: a caller that runs a
    /// step in a background task (a delayed update) reads it before it starts the step, and
    /// once it has grown, that step's search is over and [`Averager::prepare`] may start the
    /// next one while the step's all-reduce still runs.
    ///
    /// ```no_run
    /// # async fn demo(averager: std::sync::Arc<starling_averager::Averager>, mut grads: Vec<f32>) {
    /// use std::time::{Duration, Instant};
    /// let before = averager.searches_done();
    /// let deadline = Instant::now() + Duration::from_secs(30);
    /// let a = averager.clone();
    /// let len = grads.len();
    /// let round = tokio::spawn(async move { a.step(&mut [&mut grads[..]], 1.0, deadline).await });
    /// // ... compute ...
    /// if averager.searches_done() > before {
    ///     averager.prepare(&[len], deadline); // the next round's group forms meanwhile
    /// }
    /// # let _ = round.await; }
    /// ```
    pub fn searches_done(&self) -> u64 {
        self.searches_done.load(Ordering::Acquire)
    }

    async fn search(
        &self,
        schema: &Schema,
        deadline: Instant,
    ) -> Result<(Group, std::time::Duration, bool), AveragerError> {
        let cfg = &self.config;
        self.announce(schema);
        let grid = *lock(&self.grid_index);
        let mm_start = Instant::now();
        let prepared = self.take_prepared(schema.hash, grid);
        let was_prepared = prepared.is_some();
        let searched = match prepared {
            // Started ahead by `prepare`: usually formed already, or about to.
            // (Aborted if this step is dropped while it waits: nobody would use its group.)
            Some(task) => match AbortOnDrop(task).join().await {
                Ok(found) => found,
                Err(e) => Err(AveragerError::Protocol(format!(
                    "the matchmaking task ended: {e}"
                ))),
            },
            None => {
                let (group_key, mm) = self.search_inputs(schema.hash, grid);
                let me = member_info(
                    &self.transport,
                    cfg.mode,
                    self.bandwidth.current(),
                    self.round_tag(),
                )
                .await?;
                find_group(&mm, &group_key, me, deadline).await
            }
        };
        match searched {
            Ok(group) => Ok((group, mm_start.elapsed(), was_prepared)),
            Err(e @ AveragerError::NoGroup { alone: true, .. }) => {
                // Alone in its grid cell: the others moved on (they re-key by their index in
                // their last group), so staying would leave it alone in every round. Another
                // cell, drawn at random, for the next one.
                if cfg.group_bits > 0 {
                    let cells = 1u32 << cfg.group_bits;
                    let mut grid = lock(&self.grid_index);
                    *grid = (*grid + 1 + rand::random::<u32>() % (cells - 1)) % cells;
                }
                Err(self.explain_loneliness(schema, e).await)
            }
            Err(e) => Err(e),
        }
    }

    /// What a finished all-reduce leaves for the next rounds: the bandwidth measured, the
    /// repair server that serves the others' re-delegated parts, the grid cell and the group.
    pub(super) fn after_round(&self, group: &Group, outcome: &mut crate::allreduce::Outcome) {
        let cfg = &self.config;
        self.bandwidth.record(outcome.measured_bandwidth);
        if let Some(server) = outcome.repair_server.take() {
            self.keep_repair_server(Some(server));
        }
        if cfg.group_bits > 0 {
            *lock(&self.grid_index) = group.my_index.0 % (1 << cfg.group_bits);
        }
        *lock(&self.last_group) = group
            .members
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != group.my_index.0 as usize)
            .map(|(_, m)| m.peer)
            .collect();
    }

    /// Flattens the tensors into one pooled buffer (the round's snapshot) and checks for
    /// NaN/Inf in the same pass: each piece is checked right after its copy, while it is still
    /// in cache. A round needs about 4 model-sized buffers (this one, the one the previous
    /// round's repair server still holds, what it receives as a reducer, the deltas it gets
    /// back): the pool keeps that much for the next round instead of faulting in fresh pages.
    pub(super) fn flatten(&self, tensors: &[&mut [f32]]) -> Result<PoolBuf, AveragerError> {
        let total: usize = tensors.iter().map(|t| t.len()).sum();
        if total == 0 {
            return Err(AveragerError::Schema("no elements to average".into()));
        }
        // A verifying reducer also keeps its last rounds' transcripts (about one model's worth
        // each), whose buffers come back to the pool when they are dropped.
        let buffers = if self.config.verify > 0.0 { 6 } else { 4 };
        self.pool
            .set_limit(buffers * total * std::mem::size_of::<f32>());
        let mut flat = self.pool.take_dirty(total);
        let mut at = 0;
        for (i, t) in tensors.iter().enumerate() {
            for piece in t.chunks(FLATTEN_PIECE) {
                let dst = &mut flat[at..at + piece.len()];
                dst.copy_from_slice(piece);
                if !dst.iter().all(|v| v.is_finite()) {
                    return Err(AveragerError::NonFinite(format!(
                        "tensor {i} holds NaN or infinity"
                    )));
                }
                at += piece.len();
            }
        }
        Ok(flat)
    }
}

/// Writes `values` at flat offset `start` of the concatenation of `tensors`.
pub(super) fn write_flat(tensors: &mut [&mut [f32]], start: usize, values: &[f32]) {
    let end = start + values.len();
    let mut offset = 0;
    for t in tensors.iter_mut() {
        let (lo, hi) = (offset, offset + t.len());
        offset = hi;
        if hi <= start {
            continue;
        }
        if lo >= end {
            break;
        }
        let (a, b) = (start.max(lo), end.min(hi));
        t[a - lo..b - lo].copy_from_slice(&values[a - start..b - start]);
    }
}
