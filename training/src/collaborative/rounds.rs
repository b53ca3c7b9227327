//! How a round's outcome lands in a step's report, and the averaging calls the steps share.

use super::*;

/// Peers expected in a round: every live peer the swarm's progress shows, whatever its epoch
/// (a reading taken while others publish their new epoch undercounts the latest one, and a
/// hint too small splits the swarm into groups), at least this one and one other; no hint when
/// no progress was read.
pub(super) fn swarm_peers(swarm: Option<&SwarmProgress>) -> Option<usize> {
    swarm.filter(|s| s.peers > 0).map(|s| s.peers.max(2))
}

/// Averages one (pseudo-)gradient buffer with the group, with error feedback when `residuals`
/// is given (the averager applies it only with a lossy codec).
pub(super) async fn average_gradients(
    averager: &Averager,
    residuals: Option<&mut Residuals>,
    grads: &mut [f32],
    weight: f32,
    deadline: Instant,
) -> Result<RoundReport, AveragerError> {
    match residuals {
        Some(r) => {
            averager
                .step_with_feedback(&mut [grads], weight, deadline, r)
                .await
        }
        None => averager.step(&mut [grads], weight, deadline).await,
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
