//! Compressed gradient rounds that keep every member's bits the same: low rank
//! ([`Averager::step_low_rank`], PowerSGD's two averages `P` then `Q` as two all-reduces in
//! one group) and DCT top-k ([`Averager::step_sparse`], one exact all-reduce of sparse
//! coefficients through the frames' zstd stage).

use std::sync::Arc;

use starling_compression::dct::DctTopK;
use starling_compression::lowrank::PowerSgd;
use starling_compression::Codec;
use starling_node::PeerId;
use tokio::time::Instant;

use super::schema::Schema;
use super::Averager;
use crate::allreduce::{run_allreduce, Outcome, RoundEnv};
use crate::group::Group;
use crate::report::{SpanOutcome, SpanReport};
use crate::{AveragerConfig, AveragerError, AveragingMode, RoundReport};

/// Mixed into a round's id to name its second (`Q`) all-reduce: every member derives the same.
const PHASE_TWO: u64 = 0x5157_5f50_4841_5345;

impl Averager {
    /// Averages a gradient buffer in low rank (PowerSGD): each compressed matrix `M` of
    /// `state`'s layout goes out as `P = M Q` and then `Q = Mᵀ P̂` (two all-reduces in one
    /// group, with the exact codec: they are small), the rest of the buffer as it is with
    /// `P`. Every member of the group ends with the same bits in `grads`: the averaged
    /// approximation `P̂ Q̄ᵀ` of the mean gradient, and the exact mean of the rest. `state`
    /// keeps the warm-started `Q`s and what the approximation missed of this peer's gradient
    /// (added back next round: error feedback).
    ///
    /// Peers average together only with the same layout and rank. `grads` changes only if
    /// both all-reduces averaged every span; otherwise the report lists the buffer as kept
    /// local and `state` is as before. Needs the mean aggregation ([`crate::Aggregation::Mean`]):
    /// a robust aggregator of `P`s does not give a low-rank approximation of anything.
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager, mut grads: Vec<f32>) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::{Duration, Instant};
    /// use starling_compression::lowrank::{LowRankMatrix, PowerSgd};
    /// // grads holds a 512 x 256 weight matrix, then a bias of 512.
    /// let layout = [LowRankMatrix { offset: 0, rows: 512, cols: 256 }];
    /// let mut state = PowerSgd::new(4, grads.len(), &layout, 0)?;
    /// let deadline = Instant::now() + Duration::from_secs(30);
    /// let report = averager.step_low_rank(&mut grads, 1.0, deadline, &mut state).await?;
    /// println!("{} bytes out for {} gradient values", report.bytes_sent, grads.len());
    /// # Ok(()) }
    /// ```
    pub async fn step_low_rank(
        &self,
        grads: &mut [f32],
        weight: f32,
        deadline: std::time::Instant,
        state: &mut PowerSgd,
    ) -> Result<RoundReport, AveragerError> {
        let inner = self.low_rank_inner(grads, weight, Instant::from_std(deadline), state);
        let result = self.guarded(inner).await;
        if result.is_err() {
            state.abort();
        }
        result
    }

    /// [`Averager::prepare`] for the next [`Averager::step_low_rank`] with `state`.
    pub fn prepare_low_rank(&self, state: &PowerSgd, deadline: std::time::Instant) -> bool {
        if state.is_empty() || !self.config.aggregation.is_mean() {
            return false;
        }
        self.prepare_schema(low_rank_schema(state), deadline)
    }

    /// Averages a gradient buffer as DCT top-k coefficients (see
    /// `starling_compression::dct`): each chunk of `state.chunk()` values is transformed, its
    /// `state.k()` largest coefficients go out (the rest waits in `state`'s residual for the
    /// next round), and the group averages the sparse coefficient vectors exactly, through
    /// the frames' zstd stage, which drops the zeros: reducers merge the contributions (the
    /// union of their coefficients, weighted) and send back whatever is smaller, the sparse
    /// or the dense form. Every member of the group ends with the same bits in `grads`.
    ///
    /// Peers average together only with the same chunk, `k` and value mode. `grads` changes
    /// only if every span was averaged; otherwise the report lists the buffer as kept local
    /// and `state` is as before. Needs the mean aggregation.
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager, mut grads: Vec<f32>) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::{Duration, Instant};
    /// use starling_compression::dct::{DctTopK, DctValues};
    /// let mut state = DctTopK::new(grads.len(), 64, 2, DctValues::F16)?;
    /// let deadline = Instant::now() + Duration::from_secs(30);
    /// let report = averager.step_sparse(&mut grads, 1.0, deadline, &mut state).await?;
    /// println!("{} bytes out for {} gradient values", report.bytes_sent, grads.len());
    /// # Ok(()) }
    /// ```
    pub async fn step_sparse(
        &self,
        grads: &mut [f32],
        weight: f32,
        deadline: std::time::Instant,
        state: &mut DctTopK,
    ) -> Result<RoundReport, AveragerError> {
        let inner = self.sparse_inner(grads, weight, Instant::from_std(deadline), state);
        let result = self.guarded(inner).await;
        if result.is_err() {
            state.abort();
        }
        result
    }

    /// [`Averager::prepare`] for the next [`Averager::step_sparse`] with `state`.
    pub fn prepare_sparse(&self, state: &DctTopK, deadline: std::time::Instant) -> bool {
        if state.is_empty() || !self.config.aggregation.is_mean() {
            return false;
        }
        self.prepare_schema(sparse_schema(state), deadline)
    }

    async fn sparse_inner(
        &self,
        grads: &mut [f32],
        weight: f32,
        deadline: Instant,
        state: &mut DctTopK,
    ) -> Result<RoundReport, AveragerError> {
        let cfg = &self.config;
        let weight = self.check_step(weight, deadline)?;
        self.check_compressed(grads.len(), state.len())?;
        self.pool
            .set_limit(4 * grads.len() * std::mem::size_of::<f32>());
        let mut flat = self.pool.take_dirty(grads.len());
        state.begin(grads, &mut flat).map_err(compression_error)?;
        let (group, matchmaking_time, prepared) =
            self.form_group(&sparse_schema(state), deadline).await?;
        // Exact, so that every member holds the same mean; zstd drops the zeros.
        let exact = Arc::new(AveragerConfig {
            codec: Codec::None,
            zstd_level: Some(1),
            ..(**cfg).clone()
        });
        let env = RoundEnv {
            config: exact,
            transport: self.transport.clone(),
            router: self.router.clone(),
            pool: self.pool.clone(),
            bandwidth: self.bandwidth.current(),
            feedback: false,
        };
        let ar_start = Instant::now();
        let mut mine = vec![0.0f32; grads.len()];
        mine.copy_from_slice(&flat);
        let mut round = run_allreduce(env, &group, flat, f64::from(weight), deadline).await;
        let allreduce_time = ar_start.elapsed();
        self.after_round(&group, &mut round);
        for (range, values) in &round.patches {
            mine[range.clone()].copy_from_slice(values);
        }
        let me = group.members[group.my_index.get()].peer;
        let outcome = match complete(&round) {
            Ok(contributors) if cfg.mode != AveragingMode::Aux => {
                state.finish(&mine, grads).map_err(compression_error)?;
                SpanOutcome::Averaged { contributors }
            }
            Ok(contributors) => {
                state.abort();
                SpanOutcome::Averaged { contributors }
            }
            Err(reason) => {
                state.abort();
                SpanOutcome::KeptLocal { reason }
            }
        };
        Ok(RoundReport {
            round_id: group.round_id,
            group: round.group.clone(),
            my_index: group.my_index.get(),
            spans: vec![SpanReport {
                reducer: me,
                range: 0..grads.len(),
                outcome,
            }],
            failed_peers: round.failed_peers.clone(),
            bytes_sent: round.bytes_sent,
            bytes_received: round.bytes_received,
            fast_lane_transfers: round.fast_lanes,
            warm_lane_transfers: round.warm_lanes,
            matchmaking_time,
            prepared,
            allreduce_time,
            measured_upload: round.measured_bandwidth,
        })
    }

    /// What a compressed step needs: the mean aggregation, and a buffer of the state's size.
    fn check_compressed(&self, grads: usize, state: usize) -> Result<(), AveragerError> {
        if !self.config.aggregation.is_mean() {
            return Err(AveragerError::Config(format!(
                "compressed gradient rounds need the mean aggregation, not {}",
                self.config.aggregation
            )));
        }
        if grads != state || state == 0 {
            return Err(AveragerError::Schema(format!(
                "a gradient buffer of {grads} elements for a compression state of {state}"
            )));
        }
        Ok(())
    }

    async fn low_rank_inner(
        &self,
        grads: &mut [f32],
        weight: f32,
        deadline: Instant,
        state: &mut PowerSgd,
    ) -> Result<RoundReport, AveragerError> {
        let cfg = &self.config;
        let weight = self.check_step(weight, deadline)?;
        self.check_compressed(grads.len(), state.len())?;
        let (one_len, two_len) = (state.phase_one_len(), state.phase_two_len());
        self.pool
            .set_limit(4 * (one_len + two_len).max(1) * std::mem::size_of::<f32>());
        let mut mine_one = vec![0.0f32; one_len];
        state
            .begin(grads, &mut mine_one)
            .map_err(compression_error)?;
        let schema = low_rank_schema(state);
        let (group, matchmaking_time, prepared) = self.form_group(&schema, deadline).await?;
        // `P` and `Q` are small and must be the same bits everywhere: the exact codec.
        let exact = Arc::new(AveragerConfig {
            codec: Codec::None,
            ..(**cfg).clone()
        });
        let env = || RoundEnv {
            config: exact.clone(),
            transport: self.transport.clone(),
            router: self.router.clone(),
            pool: self.pool.clone(),
            bandwidth: self.bandwidth.current(),
            feedback: false,
        };
        let ar_start = Instant::now();
        let w = f64::from(weight);
        let mut flat = self.pool.take_dirty(one_len);
        flat.copy_from_slice(&mine_one);
        let mut one = run_allreduce(env(), &group, flat, w, deadline).await;
        // Its repair server ends by itself; the second all-reduce's is the one kept.
        let _phase_one_repairs = one.repair_server.take();
        self.after_round(&group, &mut one);
        let mut averaged_one = mine_one;
        for (range, values) in &one.patches {
            averaged_one[range.clone()].copy_from_slice(values);
        }
        // Members whose first all-reduce fell short still run the second with what they
        // hold, so that the others' does not wait on them; only their own result is dropped.
        let mut mine_two = vec![0.0f32; two_len];
        state
            .middle(&mut averaged_one, &mut mine_two)
            .map_err(compression_error)?;
        let second = Group {
            round_id: group.round_id ^ PHASE_TWO,
            ..group.clone()
        };
        let mut flat = self.pool.take_dirty(two_len);
        flat.copy_from_slice(&mine_two);
        let mut two = run_allreduce(env(), &second, flat, w, deadline).await;
        self.after_round(&second, &mut two);
        let allreduce_time = ar_start.elapsed();
        let mut averaged_two = mine_two;
        for (range, values) in &two.patches {
            averaged_two[range.clone()].copy_from_slice(values);
        }
        let whole = 0..grads.len();
        let me = group.members[group.my_index.get()].peer;
        let outcome = match (complete(&one), complete(&two)) {
            (Ok(a), Ok(b)) => {
                let contributors: Vec<PeerId> = a.into_iter().filter(|p| b.contains(p)).collect();
                if cfg.mode != AveragingMode::Aux {
                    state
                        .finish(&averaged_one, &averaged_two, grads)
                        .map_err(compression_error)?;
                } else {
                    state.abort();
                }
                SpanOutcome::Averaged { contributors }
            }
            (Err(reason), _) | (_, Err(reason)) => {
                state.abort();
                SpanOutcome::KeptLocal { reason }
            }
        };
        let mut failed_peers = one.failed_peers.clone();
        failed_peers.extend(two.failed_peers.iter().copied());
        failed_peers.sort();
        failed_peers.dedup();
        Ok(RoundReport {
            round_id: group.round_id,
            group: one.group.clone(),
            my_index: group.my_index.get(),
            spans: vec![SpanReport {
                reducer: me,
                range: whole,
                outcome,
            }],
            failed_peers,
            bytes_sent: one.bytes_sent + two.bytes_sent,
            bytes_received: one.bytes_received + two.bytes_received,
            fast_lane_transfers: one.fast_lanes + two.fast_lanes,
            warm_lane_transfers: one.warm_lanes + two.warm_lanes,
            matchmaking_time,
            prepared,
            allreduce_time,
            measured_upload: two.measured_bandwidth.or(one.measured_bandwidth),
        })
    }
}

/// The schema of a low-rank step: the buffer, both averaged vectors and the rank (peers with
/// another layout or rank must not group with this one).
fn low_rank_schema(state: &PowerSgd) -> Schema {
    Schema::of(
        &[state.len(), state.phase_one_len(), state.phase_two_len()],
        &format!("powersgd:{}", state.rank()),
    )
}

/// The schema of a DCT top-k step: the buffer, the chunking and the values (peers with
/// another must not group with this one).
fn sparse_schema(state: &DctTopK) -> Schema {
    Schema::of(
        &[state.len()],
        &format!(
            "dct-topk:{}:{}:{:?}",
            state.chunk(),
            state.k(),
            state.values()
        ),
    )
}

/// The peers in every span of an all-reduce, if every span was averaged; else why not.
fn complete(outcome: &Outcome) -> Result<Vec<PeerId>, String> {
    if outcome.spans.is_empty() {
        return Err("nothing was averaged".into());
    }
    let mut common: Option<Vec<PeerId>> = None;
    for span in &outcome.spans {
        match &span.outcome {
            SpanOutcome::KeptLocal { reason } => {
                return Err(format!(
                    "span {:?} of a low-rank all-reduce was kept local: {reason}",
                    span.range
                ))
            }
            other => {
                let here = other.contributors().unwrap_or_default();
                common = Some(match common {
                    None => here.to_vec(),
                    Some(c) => c.into_iter().filter(|p| here.contains(p)).collect(),
                });
            }
        }
    }
    Ok(common.unwrap_or_default())
}

fn compression_error(e: starling_compression::Error) -> AveragerError {
    match e {
        starling_compression::Error::NonFiniteInput { index, .. } => {
            AveragerError::NonFinite(format!("gradient element {index} is NaN or infinite"))
        }
        other => AveragerError::Schema(other.to_string()),
    }
}
