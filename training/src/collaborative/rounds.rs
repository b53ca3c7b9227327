//! How a round's outcome lands in a step's report, the averaging calls the steps share, and which
//! rounds carry the state.

use super::*;

/// Peers expected in a round: every live peer the swarm's progress shows, whatever its epoch
/// (a reading taken while others publish their new epoch undercounts the latest one, and a
/// hint too small splits the swarm into groups), at least this one and one other; no hint when
/// no progress was read.
pub(super) fn swarm_peers(swarm: Option<&SwarmProgress>) -> Option<usize> {
    swarm.filter(|s| s.peers > 0).map(|s| s.peers.max(2))
}

/// The state a compressed (pseudo-)gradient round keeps between rounds.
#[derive(Debug)]
pub(super) enum Compressor {
    PowerSgd(PowerSgd),
    Dct(DctTopK),
}

/// Averages one (pseudo-)gradient buffer with the group: through `compressor` when given (its
/// own error feedback), else with error feedback when `residuals` is given (the averager
/// applies it only with a lossy codec).
pub(super) async fn average_gradients(
    averager: &Averager,
    compressor: Option<&mut Compressor>,
    residuals: Option<&mut Residuals>,
    grads: &mut [f32],
    weight: f32,
    deadline: Instant,
) -> Result<RoundReport, AveragerError> {
    match (compressor, residuals) {
        (Some(Compressor::PowerSgd(state)), _) => {
            averager.step_low_rank(grads, weight, deadline, state).await
        }
        (Some(Compressor::Dct(state)), _) => {
            averager.step_sparse(grads, weight, deadline, state).await
        }
        (None, Some(r)) => {
            averager
                .step_with_feedback(&mut [grads], weight, deadline, r)
                .await
        }
        (None, None) => averager.step(&mut [grads], weight, deadline).await,
    }
}

/// A digest of a state: the bits of every buffer, in order (the first 8 bytes of their
/// BLAKE3 hash). Peers with the same parameters and optimizer state have the same digest.
pub(super) fn state_digest(buffers: &[&[f32]]) -> u64 {
    let mut hasher = blake3::Hasher::new();
    for b in buffers {
        hasher.update(&(b.len() as u64).to_le_bytes());
        if cfg!(target_endian = "little") {
            // The values' bytes as they lie: already little-endian.
            hasher.update(bytemuck::cast_slice(b));
        } else {
            let mut bytes = [0u8; 4096];
            for piece in b.chunks(bytes.len() / 4) {
                for (dst, v) in bytes.chunks_exact_mut(4).zip(piece) {
                    dst.copy_from_slice(&v.to_le_bytes());
                }
                hasher.update(&bytes[..piece.len() * 4]);
            }
        }
    }
    let hash = hasher.finalize();
    u64::from_le_bytes(hash.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// Runs `work` (CPU-bound: a digest of a whole model's state) so that it does not hold up the
/// runtime's other tasks: on a multi-threaded runtime its worker hands its tasks to another
/// thread first ([`tokio::task::block_in_place`]); elsewhere it runs in place.
pub(super) fn off_the_runtime<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// Which rounds carry the state, whether rounds keep members identical, and each step's rate.
impl CollaborativeOptimizer {
    /// Whether the round that ends this epoch also averages the parameters and the optimizer
    /// state (every `state_averaging_every` epochs, and the run's `final_epoch`).
    pub(super) fn state_due(&self) -> bool {
        self.state_round_at(self.epoch + 1)
    }

    /// Whether the round that reaches `epoch` carries the state.
    fn state_round_at(&self, epoch: u64) -> bool {
        self.cfg.final_epoch == Some(epoch)
            || self
                .cfg
                .state_averaging_every
                .is_some_and(|n| n > 0 && epoch.is_multiple_of(n))
    }

    /// Sets the optimizer's rate for the step that ends `epoch`, if the run has a schedule.
    pub(super) fn schedule_lr(&mut self, epoch: u64) {
        if let Some(s) = &self.cfg.lr_schedule {
            self.optimizer.set_lr(s.lr_at(epoch));
        }
    }

    /// Whether a gradient round leaves every member of its group the same bits (the exact
    /// codec, PowerSGD, DCT top-k: the reducers send the mean itself), so that members whose
    /// state was the same before it still have the same state after it.
    pub(super) fn exact_rounds(&self) -> bool {
        self.compressor_spec.is_some() || self.averager.config().codec.is_lossless()
    }

    /// Whether the round after this epoch's carries the state: a peer an epoch behind the
    /// others would be in this one.
    pub(super) fn state_due_next(&self) -> bool {
        self.state_round_at(self.epoch + 2)
    }
}

/// The buffers a state round reconciles: `first` (the parameters, or DiLoCo's phase start),
/// then the optimizer's state.
pub(super) fn state_buffers<'a>(
    first: &'a mut [f32],
    optimizer: Vec<(&'static str, &'a mut [f32])>,
) -> Vec<&'a mut [f32]> {
    let mut buffers = vec![first];
    buffers.extend(optimizer.into_iter().map(|(_, b)| b));
    buffers
}

/// After a round that carries the state (`state` given): if its group formed, the members
/// compare digests of `state` and average it only where one differs
/// ([`Averager::reconcile`]). `exact`: the round leaves every member the same bits (the exact
/// codec, PowerSGD, DCT top-k), so equal states stay equal; after a lossy codec's round they
/// never are, and the state is averaged without comparing. `None` when the round carried no
/// state or formed no group.
pub(super) async fn reconcile_state(
    averager: &Averager,
    round: &Result<RoundReport, AveragerError>,
    exact: bool,
    state: Option<Vec<&mut [f32]>>,
    weight: f32,
    deadline: Instant,
) -> Option<Result<Reconciliation, AveragerError>> {
    let mut state = state?;
    let round = round.as_ref().ok()?;
    let digest = exact.then(|| {
        let views: Vec<&[f32]> = state.iter().map(|b| &**b).collect();
        off_the_runtime(|| state_digest(&views))
    });
    Some(
        averager
            .reconcile(round, digest, &mut state, weight, deadline)
            .await,
    )
}

/// Records in `report` (after [`note_round`]) what reconciling the state did: compared,
/// averaged, its bytes in the round's, and why it fell short when it did.
pub(super) fn note_reconciled(
    report: &mut StepReport,
    reconciled: Option<Result<Reconciliation, AveragerError>>,
) -> Result<(), TrainingError> {
    match reconciled {
        None => {}
        Some(Ok(r)) => {
            report.state_checked = r.agreed || r.averaged_fraction >= 1.0;
            report.state_averaged = r.averaged_fraction > 0.0;
            if let Some(round) = report.round.as_mut() {
                round.bytes_sent += r.bytes_sent;
                round.bytes_received += r.bytes_received;
                round.allreduce_time += r.time;
            }
            if let Some(e) = r.error {
                report.errors.push(e);
            }
        }
        Some(Err(AveragerError::Node(NodeError::Closed))) => {
            return Err(AveragerError::Node(NodeError::Closed).into())
        }
        Some(Err(e)) => report
            .errors
            .push(format!("the state was not reconciled: {e}")),
    }
    Ok(())
}

/// How to build a run's [`Compressor`] (again, when a delayed update's round that held it was
/// dropped, or the state was replaced by a sync).
#[derive(Debug, Clone)]
pub(super) enum CompressorSpec {
    PowerSgd {
        rank: usize,
        len: usize,
        layout: Vec<LowRankMatrix>,
        seed: u64,
        momentum: f32,
        values: starling_compression::Codec,
    },
    Dct {
        len: usize,
        chunk: usize,
        k: usize,
        values: DctValues,
        momentum: f32,
    },
}

impl CompressorSpec {
    /// The spec of `compression` for `params` (`None` for the codec's rounds), checked by
    /// building it once. PowerSGD: every tensor of two or more dimensions is a matrix (its
    /// first dimension by the rest), and `Q` starts from a seed drawn from the run's name, so
    /// that every peer of the run starts from the same one.
    pub fn of(
        compression: GradientCompression,
        params: &ParamSet,
        run: &str,
    ) -> Result<Option<Self>, TrainingError> {
        let spec = match compression {
            GradientCompression::Codec => return Ok(None),
            GradientCompression::PowerSgd {
                rank,
                momentum,
                bf16,
            } => {
                let layout = params
                    .iter()
                    .filter(|(_, t)| t.shape().len() >= 2)
                    .map(|(_, t)| LowRankMatrix {
                        offset: t.range().start,
                        rows: t.shape()[0],
                        cols: t.shape()[1..].iter().product(),
                    })
                    .collect();
                // FNV-1a of the run's name: the same on every platform.
                let seed = run.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
                });
                CompressorSpec::PowerSgd {
                    rank,
                    len: params.len(),
                    layout,
                    seed,
                    momentum,
                    values: if bf16 {
                        starling_compression::Codec::BFloat16
                    } else {
                        starling_compression::Codec::None
                    },
                }
            }
            GradientCompression::DctTopK {
                chunk,
                k,
                sign,
                momentum,
            } => CompressorSpec::Dct {
                len: params.len(),
                chunk,
                k,
                values: if sign {
                    DctValues::Sign
                } else {
                    DctValues::F16
                },
                momentum,
            },
        };
        spec.build()?;
        Ok(Some(spec))
    }

    /// A fresh state (PowerSGD's `Q` from the seed; no residual).
    pub fn build(&self) -> Result<Compressor, TrainingError> {
        let err = |e: starling_compression::Error| {
            TrainingError::Config(format!("gradient compression: {e}"))
        };
        Ok(match self {
            CompressorSpec::PowerSgd {
                rank,
                len,
                layout,
                seed,
                momentum,
                values,
            } => Compressor::PowerSgd(
                PowerSgd::new(*rank, *len, layout, *seed)
                    .and_then(|s| s.momentum(*momentum))
                    .and_then(|s| s.values(*values))
                    .map_err(err)?,
            ),
            CompressorSpec::Dct {
                len,
                chunk,
                k,
                values,
                momentum,
            } => Compressor::Dct(
                DctTopK::new(*len, *chunk, *k, *values)
                    .and_then(|s| s.momentum(*momentum))
                    .map_err(err)?,
            ),
        })
    }
}

/// Records a gossip round's outcome in `report`: the peers averaged with (as `group_size`,
/// this peer included); a round that averaged with nobody says why. Only this peer's node
/// stopping is an error.
pub(super) fn note_gossip(
    report: &mut StepReport,
    averaged: Result<GossipReport, AveragerError>,
) -> Result<(), TrainingError> {
    match averaged {
        Ok(round) => {
            let mut peers = round.averaged_with();
            peers.sort();
            peers.dedup();
            report.group_size = Some(peers.len() + 1);
            if peers.is_empty() {
                let e = format!(
                    "gossip averaged with nobody this round ({} members)",
                    round.members
                );
                report.errors.push(e.clone());
                report.averaging_error = Some(e);
            }
            report.gossip = Some(round);
            Ok(())
        }
        Err(AveragerError::Node(NodeError::Closed)) => {
            Err(AveragerError::Node(NodeError::Closed).into())
        }
        Err(e) => {
            report.errors.push(e.to_string());
            report.averaging_error = Some(e.to_string());
            Ok(())
        }
    }
}

/// `params` holds `expected` values, or the schema error that says so.
pub(super) fn same_len(expected: usize, params: &ParamSet) -> Result<(), TrainingError> {
    if params.len() == expected {
        return Ok(());
    }
    Err(TrainingError::Schema {
        expected,
        actual: params.len(),
    })
}

/// The later round tag (epoch) another peer searched with, when a round ended because this
/// peer is behind.
pub(super) fn behind_of(averaged: &Result<RoundReport, AveragerError>) -> Option<u64> {
    match averaged {
        Err(AveragerError::Behind { theirs, .. }) => Some(*theirs),
        _ => None,
    }
}

/// Records an averaging round's outcome in `report`: a round that did not form or covered only
/// part of the buffers leaves the local values in place and says why; only this peer's node
/// stopping is an error.
pub(super) fn note_round(
    report: &mut StepReport,
    averaged: Result<RoundReport, AveragerError>,
) -> Result<(), TrainingError> {
    match averaged {
        Ok(round) => {
            report.group_size = Some(round.group.len());
            if round.averaged_fraction() < 1.0 {
                let e = format!(
                    "only {:.0}% of the values were averaged",
                    100.0 * round.averaged_fraction()
                );
                report.errors.push(e.clone());
                report.averaging_error = Some(e);
            }
            report.round = Some(round);
            Ok(())
        }
        Err(AveragerError::Node(NodeError::Closed)) => {
            Err(AveragerError::Node(NodeError::Closed).into())
        }
        Err(e) => {
            report.errors.push(e.to_string());
            report.averaging_error = Some(e.to_string());
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A leader waits one and a half batches for peers still computing, never less than the
    /// averager's default nor more than half the window; a batch time that is not a time
    /// (no rate yet) leaves the default.
    #[test]
    fn the_start_grace_covers_a_batch_within_its_bounds() {
        use super::super::schedule::batch_grace;
        let (floor, ceiling) = (Duration::from_millis(500), Duration::from_millis(2500));
        let ms = |b: f64| batch_grace(b, floor, ceiling).as_millis();
        assert_eq!(ms(0.8), 1200);
        assert_eq!(ms(1.0), 1500);
        assert_eq!(ms(0.004), 500);
        assert_eq!(ms(30.0), 2500);
        assert_eq!(ms(f64::INFINITY), 500);
        assert_eq!(ms(f64::NAN), 500);
        assert_eq!(ms(-1.0), 500);
    }

    /// The digest against a plain reference (BLAKE3 of the lengths and little-endian bytes),
    /// and it tells one changed bit apart.
    #[test]
    fn the_digest_is_blake3_of_the_bytes_and_sees_one_bit() {
        let a: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..77).map(|i| i as f32 - 30.5).collect();
        let mut bytes = Vec::new();
        for buf in [&a, &b] {
            bytes.extend_from_slice(&(buf.len() as u64).to_le_bytes());
            for v in buf.iter() {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        let want = u64::from_le_bytes(blake3::hash(&bytes).as_bytes()[..8].try_into().unwrap());
        assert_eq!(state_digest(&[&a, &b]), want);
        let mut c = a.clone();
        c[4321] = f32::from_bits(c[4321].to_bits() ^ 1);
        assert_ne!(state_digest(&[&c, &b]), want);
        // The split between buffers counts, not only the concatenation.
        assert_ne!(state_digest(&[&a[..10], &a[10..], &b]), want);
    }

    /// The momentum (and PowerSGD's values) of a compression spec reach the compressor it
    /// builds, and PowerSGD compresses the tensors of two or more dimensions.
    #[test]
    fn compressor_specs_carry_their_momentum() {
        let mut params = ParamSet::new();
        params.add_zeros("w", &[32, 16]).unwrap();
        params.add_zeros("b", &[32]).unwrap();
        params.add_zeros("conv", &[8, 4, 3, 3]).unwrap();
        let spec = CompressorSpec::of(
            GradientCompression::PowerSgd {
                rank: 2,
                momentum: 0.9,
                bf16: true,
            },
            &params,
            "run",
        )
        .unwrap()
        .unwrap();
        match spec.build().unwrap() {
            Compressor::PowerSgd(s) => {
                assert_eq!(s.beta(), 0.9);
                assert_eq!(s.values_codec(), starling_compression::Codec::BFloat16);
                let shapes: Vec<(usize, usize)> =
                    s.compressed().iter().map(|m| (m.rows, m.cols)).collect();
                assert_eq!(shapes, [(32, 16), (8, 36)]);
            }
            _ => panic!("not PowerSGD"),
        }
        let dct = GradientCompression::DctTopK {
            chunk: 64,
            k: 2,
            sign: false,
            momentum: 0.5,
        };
        match CompressorSpec::of(dct, &params, "run")
            .unwrap()
            .unwrap()
            .build()
            .unwrap()
        {
            Compressor::Dct(s) => assert_eq!(s.beta(), 0.5),
            _ => panic!("not DCT"),
        }
        assert!(
            CompressorSpec::of(GradientCompression::Codec, &params, "run")
                .unwrap()
                .is_none()
        );
    }

    /// `off_the_runtime` runs its work on every kind of runtime and from every place a step
    /// can run: a multi-threaded runtime's `block_on` and its tasks, a current-thread
    /// runtime, and no runtime.
    #[test]
    fn off_the_runtime_runs_everywhere() {
        assert_eq!(off_the_runtime(|| 7), 7);
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        assert_eq!(multi.block_on(async { off_the_runtime(|| 8) }), 8);
        let task = multi.spawn(async { off_the_runtime(|| 9) });
        assert_eq!(multi.block_on(task).unwrap(), 9);
        let single = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(single.block_on(async { off_the_runtime(|| 10) }), 10);
    }
}
