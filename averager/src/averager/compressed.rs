//! Compressed gradient rounds that keep every member's bits the same: low rank
//! ([`Averager::step_low_rank`], PowerSGD's two averages `P` then `Q` as two all-reduces in
//! one group) and DCT top-k ([`Averager::step_sparse`], one exact all-reduce of sparse
//! coefficients through the frames' zstd stage).

use std::sync::Arc;
use std::time::Duration;

use starling_compression::dct::DctTopK;
use starling_compression::lowrank::PowerSgd;
use starling_compression::Codec;
use starling_node::PeerId;
use tokio::time::Instant;

use super::schema::Schema;
use super::Averager;
use crate::allreduce::{run_allreduce, Outcome};
use crate::group::Group;
use crate::report::{SpanOutcome, SpanReport};
use crate::{AveragerConfig, AveragerError, AveragingMode, RoundReport};

/// Mixed into a round's id to name its second (`Q`) all-reduce: every member derives the same.
const PHASE_TWO: u64 = 0x5157_5f50_4841_5345;

impl Averager {
    /// Averages a gradient buffer in low rank (PowerSGD): each compressed matrix `M` of
    /// `state`'s layout goes out as `P = M Q` and then `Q = Mᵀ P̂` (two all-reduces in one
    /// group, as f32 or, if `state` says so ([`PowerSgd::values`]), bf16 rounded by each
    /// part's reducer: the exact codec in verified rounds), the rest of the buffer as it is
    /// with `P`. Every member of the group ends with the same bits in `grads`: the averaged
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
        self.prepare_schema(low_rank_schema(&self.config, state), deadline)
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
        let weight = self.check_step(weight, deadline)?;
        self.check_compressed(grads.len(), state.len())?;
        self.pool
            .set_limit(4 * grads.len() * std::mem::size_of::<f32>());
        let mut mine = vec![0.0f32; grads.len()];
        state.begin(grads, &mut mine).map_err(compression_error)?;
        let (group, matchmaking_time, prepared) =
            self.form_group(&sparse_schema(state), deadline).await?;
        // Exact, so that every member holds the same mean; zstd drops the zeros.
        let exact = Arc::new(AveragerConfig {
            codec: Codec::None,
            zstd_level: Some(1),
            ..(*self.config).clone()
        });
        let ar_start = Instant::now();
        let (averaged, mut round) = self
            .exact_round(&exact, &group, mine, f64::from(weight), deadline)
            .await;
        let allreduce_time = ar_start.elapsed();
        self.after_round(&group, &mut round);
        let outcome = self.settle(
            &[&round],
            state,
            |s| s.finish(&averaged, grads),
            DctTopK::abort,
        )?;
        Ok(compressed_report(
            &group,
            &[&round],
            grads.len(),
            outcome,
            (matchmaking_time, prepared, allreduce_time),
        ))
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
        let weight = self.check_step(weight, deadline)?;
        self.check_compressed(grads.len(), state.len())?;
        let (one_len, two_len) = (state.phase_one_len(), state.phase_two_len());
        self.pool
            .set_limit(4 * (one_len + two_len).max(1) * std::mem::size_of::<f32>());
        let mut mine_one = vec![0.0f32; one_len];
        state
            .begin(grads, &mut mine_one)
            .map_err(compression_error)?;
        let schema = low_rank_schema(&self.config, state);
        let (group, matchmaking_time, prepared) = self.form_group(&schema, deadline).await?;
        // `P` and `Q` must be the same bits everywhere: f32, or bf16 values rounded by their
        // reducer (not in verified rounds: a check recomputes the unrounded mean).
        let exact = Arc::new(AveragerConfig {
            codec: low_rank_codec(&self.config, state),
            ..(*self.config).clone()
        });
        let ar_start = Instant::now();
        let w = f64::from(weight);
        let (mut averaged_one, mut one) = self
            .exact_round(&exact, &group, mine_one, w, deadline)
            .await;
        // Its repair server ends by itself; the second all-reduce's is the one kept.
        let _phase_one_repairs = one.repair_server.take();
        self.after_round(&group, &mut one);
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
        let (averaged_two, mut two) = self
            .exact_round(&exact, &second, mine_two, w, deadline)
            .await;
        self.after_round(&second, &mut two);
        let allreduce_time = ar_start.elapsed();
        let outcome = self.settle(
            &[&one, &two],
            state,
            |s| s.finish(&averaged_one, &averaged_two, grads),
            PowerSgd::abort,
        )?;
        Ok(compressed_report(
            &group,
            &[&one, &two],
            grads.len(),
            outcome,
            (matchmaking_time, prepared, allreduce_time),
        ))
    }

    /// One all-reduce of `mine` in `group` with `config` (no error feedback; results come back
    /// as values, so every member holds the same bits: `config.codec` must be elementwise):
    /// the vector as averaged (this peer's own values where a span was not) and the round's
    /// outcome.
    async fn exact_round(
        &self,
        config: &Arc<AveragerConfig>,
        group: &Group,
        mine: Vec<f32>,
        weight: f64,
        deadline: Instant,
    ) -> (Vec<f32>, Outcome) {
        debug_assert!(config.codec.is_elementwise());
        let mut env = self.round_env(config.clone(), false);
        env.values_back = true;
        let mut flat = self.pool.take_dirty(mine.len());
        flat.copy_from_slice(&mine);
        let round = run_allreduce(env, group, flat, weight, deadline).await;
        let mut averaged = mine;
        for (range, values) in &round.patches {
            averaged[range.clone()].copy_from_slice(values);
        }
        (averaged, round)
    }

    /// What a compressed step's all-reduces mean for this peer: if every span of every one
    /// was averaged, `finish` writes the result (an `Aux` peer, which contributed nothing,
    /// `abort`s instead) and the buffer counts as averaged by the peers in all of them;
    /// otherwise `abort` and the buffer is kept local.
    fn settle<S>(
        &self,
        rounds: &[&Outcome],
        state: &mut S,
        finish: impl FnOnce(&mut S) -> starling_compression::Result<()>,
        abort: impl FnOnce(&mut S),
    ) -> Result<SpanOutcome, AveragerError> {
        Ok(match complete(rounds) {
            Ok(contributors) => {
                if self.config.mode == AveragingMode::Aux {
                    abort(state);
                } else {
                    finish(state).map_err(compression_error)?;
                }
                SpanOutcome::Averaged { contributors }
            }
            Err(reason) => {
                abort(state);
                SpanOutcome::KeptLocal { reason }
            }
        })
    }
}

/// The report of a compressed step over a buffer of `len` values, whose all-reduces are
/// `rounds` (in order) and whose fate is `outcome`; `timings` are the matchmaking time,
/// whether it was prepared, and the all-reduces' time.
fn compressed_report(
    group: &Group,
    rounds: &[&Outcome],
    len: usize,
    outcome: SpanOutcome,
    (matchmaking_time, prepared, allreduce_time): (Duration, bool, Duration),
) -> RoundReport {
    let mut failed_peers: Vec<PeerId> = rounds
        .iter()
        .flat_map(|r| r.failed_peers.iter().copied())
        .collect();
    failed_peers.sort();
    failed_peers.dedup();
    RoundReport {
        round_id: group.round_id,
        group: rounds[0].group.clone(),
        my_index: group.my_index.get(),
        spans: vec![SpanReport {
            reducer: group.members[group.my_index.get()].peer,
            range: 0..len,
            outcome,
        }],
        failed_peers,
        bytes_sent: rounds.iter().map(|r| r.bytes_sent).sum(),
        bytes_received: rounds.iter().map(|r| r.bytes_received).sum(),
        fast_lane_transfers: rounds.iter().map(|r| r.fast_lanes).sum(),
        warm_lane_transfers: rounds.iter().map(|r| r.warm_lanes).sum(),
        matchmaking_time,
        prepared,
        allreduce_time,
        measured_upload: rounds.iter().rev().find_map(|r| r.measured_bandwidth),
        audit: rounds.iter().find_map(|r| r.audit.clone()),
    }
}

/// The schema of a low-rank step: the buffer, both averaged vectors, the rank and how the
/// values travel (peers with another layout, rank or precision must not group with this one).
fn low_rank_schema(config: &AveragerConfig, state: &PowerSgd) -> Schema {
    let codec = low_rank_codec(config, state);
    let tag = match codec {
        Codec::None => format!("powersgd:{}", state.rank()),
        other => format!("powersgd:{}:{other}", state.rank()),
    };
    Schema::of(
        &[state.len(), state.phase_one_len(), state.phase_two_len()],
        &tag,
    )
}

/// The codec a low-rank step's two all-reduces use: the state's, except in verified rounds,
/// which need exact values (a check recomputes the unrounded mean).
fn low_rank_codec(config: &AveragerConfig, state: &PowerSgd) -> Codec {
    if config.verify > 0.0 {
        Codec::None
    } else {
        state.values_codec()
    }
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

/// The peers in every span of every one of `rounds`, if every span was averaged; else why
/// not.
fn complete(rounds: &[&Outcome]) -> Result<Vec<PeerId>, String> {
    let mut common: Option<Vec<PeerId>> = None;
    for round in rounds {
        if round.spans.is_empty() {
            return Err("nothing was averaged".into());
        }
        for span in &round.spans {
            let here = match &span.outcome {
                SpanOutcome::KeptLocal { reason } => {
                    return Err(format!(
                        "span {:?} of a compressed round's all-reduce was kept local: {reason}",
                        span.range
                    ))
                }
                other => other.contributors().unwrap_or_default(),
            };
            common = Some(match common {
                None => here.to_vec(),
                Some(c) => c.into_iter().filter(|p| here.contains(p)).collect(),
            });
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
