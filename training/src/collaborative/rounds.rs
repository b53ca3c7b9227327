//! How a round's outcome lands in a step's report, and the averaging calls the steps share.

use super::*;

/// Peers expected in a round: every live peer the swarm's progress shows, whatever its epoch
/// (a reading taken while others publish their new epoch undercounts the latest one, and a
/// hint too small splits the swarm into groups), at least this one and one other; no hint when
/// no progress was read.
pub(super) fn swarm_peers(swarm: Option<&SwarmProgress>) -> Option<usize> {
    swarm.filter(|s| s.peers > 0).map(|s| s.peers.max(2))
}

/// Averages one (pseudo-)gradient buffer with the group: in low rank when `low_rank` is given
/// (its own error feedback), else with error feedback when `residuals` is given (the averager
/// applies it only with a lossy codec).
pub(super) async fn average_gradients(
    averager: &Averager,
    low_rank: Option<&mut PowerSgd>,
    residuals: Option<&mut Residuals>,
    grads: &mut [f32],
    weight: f32,
    deadline: Instant,
) -> Result<RoundReport, AveragerError> {
    match (low_rank, residuals) {
        (Some(state), _) => averager.step_low_rank(grads, weight, deadline, state).await,
        (None, Some(r)) => {
            averager
                .step_with_feedback(&mut [grads], weight, deadline, r)
                .await
        }
        (None, None) => averager.step(&mut [grads], weight, deadline).await,
    }
}

/// How to build the PowerSGD state of a run's parameters (again, when a delayed update's round
/// that held it was dropped, or the state was replaced by a sync).
#[derive(Debug, Clone)]
pub(super) struct LowRankSpec {
    rank: usize,
    len: usize,
    layout: Vec<LowRankMatrix>,
    seed: u64,
}

impl LowRankSpec {
    /// PowerSGD at `rank` for `params`: every tensor of two or more dimensions is a matrix (its
    /// first dimension by the rest). `Q` starts from a seed drawn from the run's name, so that
    /// every peer of the run starts from the same one.
    pub fn of(rank: usize, params: &ParamSet, run: &str) -> Self {
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
        LowRankSpec {
            rank,
            len: params.len(),
            layout,
            seed,
        }
    }

    /// A fresh state: `Q` from the seed, no residual.
    pub fn build(&self) -> Result<PowerSgd, TrainingError> {
        PowerSgd::new(self.rank, self.len, &self.layout, self.seed)
            .map_err(|e| TrainingError::Config(format!("low-rank averaging: {e}")))
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
