//! Bringing the members of a finished round back to one state only where they differ
//! ([`Averager::reconcile`]): first the members compare digests of their state (64 bits each,
//! one tiny all-reduce in the same group), then, only if some member's differs, they average
//! the state itself (a second all-reduce in that group). Peers that take every round together
//! with an exact codec hold the same bits and send about a kilobyte instead of their whole
//! state.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::step::write_flat;
use super::{Averager, FlagGuard};
use crate::allreduce::{run_allreduce, Outcome};
use crate::group::Group;
use crate::{Aggregation, AveragerConfig, AveragerError, AveragingMode, RoundReport};
use starling_node::lock::lock;
use starling_node::NodeError;

/// Mixed into a round's id to name its digest comparison: every member derives the same.
const DIGESTS: u64 = 0x4449_4745_5354_5321;
/// Mixed into a round's id to name its state average.
const STATE: u64 = 0x5354_4154_4521_2121;
/// Bits of the digest compared (each travels as a 0.0 or 1.0).
const DIGEST_BITS: usize = 64;
/// Groups kept for [`Averager::reconcile`] (the latest rounds').
pub(super) const RECENT_GROUPS: usize = 4;

/// What [`Averager::reconcile`] found and did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reconciliation {
    /// Every member's digest reached the comparison and all were the same: the state was not
    /// sent.
    pub agreed: bool,
    /// Fraction of the state's values averaged with the group (0 when the members agreed or
    /// the state was not averaged).
    pub averaged_fraction: f64,
    /// Bytes written to averaging streams (both all-reduces).
    pub bytes_sent: u64,
    /// Bytes read from averaging streams.
    pub bytes_received: u64,
    /// Time the comparison and the average took.
    pub time: Duration,
    /// Why the state was not compared, or not averaged in full, when it was not.
    pub error: Option<String>,
}

impl Averager {
    /// After a round (`after`, the report of a step that just finished), brings its group's
    /// members to one state where they differ: the members compare `digest` (any 64-bit digest
    /// of the caller's state, e.g. parameters and optimizer state), and only if one differs
    /// (or `digest` is `None`: the caller knows they differ, e.g. after a lossy codec) they
    /// average `state`, weighted by `weight`, with the exact codec and this averager's
    /// aggregation. Spans that could not be averaged keep this peer's values.
    ///
    /// Every member of the round must call it (with the same number of state values), or the
    /// others wait for it until the round's request timeout. All members that see the
    /// comparison complete make the same choice; a member whose comparison fell short keeps
    /// its state (and says so in [`Reconciliation::error`]).
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager, mut grads: Vec<f32>, mut params: Vec<f32>) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::{Duration, Instant};
    /// let deadline = Instant::now() + Duration::from_secs(30);
    /// let round = averager.step(&mut [&mut grads[..]], 1.0, deadline).await?;
    /// let digest = params.iter().fold(0u64, |h, v| h.rotate_left(5) ^ u64::from(v.to_bits()));
    /// let r = averager.reconcile(&round, Some(digest), &mut [&mut params[..]], 1.0, deadline).await?;
    /// if !r.agreed {
    ///     println!("the group's states differed; {:.0}% averaged", 100.0 * r.averaged_fraction);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn reconcile(
        &self,
        after: &RoundReport,
        digest: Option<u64>,
        state: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
    ) -> Result<Reconciliation, AveragerError> {
        if self.busy.swap(true, Ordering::AcqRel) {
            return Err(AveragerError::StepInProgress);
        }
        let flags = [&self.busy];
        let _busy = FlagGuard(&flags);
        let node = self.transport.node();
        if node.is_closed() {
            return Err(NodeError::Closed.into());
        }
        let deadline = Instant::from_std(deadline);
        let weight = self.check_step(weight, deadline)?;
        let group = lock(&self.recent_groups)
            .iter()
            .find(|g| g.round_id == after.round_id)
            .cloned()
            .ok_or_else(|| {
                AveragerError::Config(format!(
                    "round {:016x} is not among this averager's latest rounds",
                    after.round_id
                ))
            })?;
        // Refused before anything goes out: a member that found its state broken mid-way
        // would leave the others waiting in the second all-reduce.
        if let Some(i) = state.iter().position(|t| !t.iter().all(|v| v.is_finite())) {
            return Err(AveragerError::NonFinite(format!(
                "state tensor {i} holds NaN or infinity"
            )));
        }
        if state.iter().all(|t| t.is_empty()) {
            return Err(AveragerError::Schema("no state to reconcile".into()));
        }
        tokio::select! {
            biased;
            _ = node.closed() => Err(NodeError::Closed.into()),
            r = self.reconcile_inner(&group, digest, state, weight, deadline) => r,
        }
    }

    async fn reconcile_inner(
        &self,
        group: &Group,
        digest: Option<u64>,
        state: &mut [&mut [f32]],
        weight: f32,
        deadline: Instant,
    ) -> Result<Reconciliation, AveragerError> {
        let began = Instant::now();
        let mut done = Reconciliation::default();
        if let Some(liar) = group
            .members
            .iter()
            .find(|m| self.banned.contains(&m.peer.to_bytes()))
        {
            // A member caught lying in the round just taken (or since): the others refuse its
            // messages, and would wait for its span until their timeouts (15 s, four processes on
            // loopback). Each member that heard the verdict skipped the liar's span
            // alike; the next state round, without it, brings anyone else back.
            done.error = Some(format!(
                "the state digests were not compared: member {} of the round is refused for lying",
                liar.peer
            ));
            done.time = began.elapsed();
            return Ok(done);
        }
        if let Some(digest) = digest {
            let compared = self.compare_digests(group, digest, deadline).await;
            done.bytes_sent += compared.bytes_sent;
            done.bytes_received += compared.bytes_received;
            match verdict(group, &compared) {
                Verdict::Agreed => {
                    done.agreed = true;
                    done.time = began.elapsed();
                    return Ok(done);
                }
                Verdict::Differ => {}
                Verdict::Unknown(why) => {
                    done.error = Some(format!("the state digests were not compared: {why}"));
                    done.time = began.elapsed();
                    return Ok(done);
                }
            }
        }
        // The state itself: exact (the point is the same bits everywhere), the configured
        // aggregation.
        let cfg = Arc::new(AveragerConfig {
            codec: starling_compression::Codec::None,
            zstd_level: None,
            ..(*self.config).clone()
        });
        let flat = self.flatten(state)?;
        let second = Group {
            round_id: group.round_id ^ STATE,
            ..group.clone()
        };
        let env = self.round_env(cfg, false);
        let mut round = run_allreduce(env, &second, flat, f64::from(weight), deadline).await;
        // (It ends by itself; the round this one follows keeps serving its repairs.)
        drop(round.repair_server.take());
        done.bytes_sent += round.bytes_sent;
        done.bytes_received += round.bytes_received;
        if self.config.mode != AveragingMode::Aux {
            for (range, values) in &round.patches {
                write_flat(state, range.start, values);
            }
        }
        done.averaged_fraction = crate::report::averaged_fraction(&round.spans);
        if done.averaged_fraction < 1.0 {
            done.error = Some(format!(
                "only {:.0}% of the state was averaged",
                100.0 * done.averaged_fraction
            ));
        }
        done.time = began.elapsed();
        Ok(done)
    }

    /// The digest all-reduce: each bit as 0.0 or 1.0, every member weighted alike, the plain
    /// mean (a robust aggregator would hide a minority's bits).
    async fn compare_digests(&self, group: &Group, digest: u64, deadline: Instant) -> Outcome {
        let cfg = Arc::new(AveragerConfig {
            codec: starling_compression::Codec::None,
            zstd_level: None,
            aggregation: Aggregation::Mean,
            verify: 0.0,
            ..(*self.config).clone()
        });
        let mut flat = self.pool.take_dirty(DIGEST_BITS);
        for (i, v) in flat.iter_mut().enumerate() {
            *v = ((digest >> i) & 1) as f32;
        }
        let weight = if self.config.mode == AveragingMode::Aux {
            0.0
        } else {
            1.0
        };
        let first = Group {
            round_id: group.round_id ^ DIGESTS,
            ..group.clone()
        };
        let env = self.round_env(cfg, false);
        let mut round = run_allreduce(env, &first, flat, weight, deadline).await;
        drop(round.repair_server.take());
        round
    }

    /// Keeps `group` for a later [`Averager::reconcile`] of its round.
    pub(super) fn remember_group(&self, group: &Group) {
        let mut recent = lock(&self.recent_groups);
        if recent.len() == RECENT_GROUPS {
            recent.pop_front();
        }
        recent.push_back(group.clone());
    }
}

/// What the digest comparison says.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// Every contributing member's digest was in and all were the same.
    Agreed,
    /// The comparison completed and some member's digest differs (or one's is missing).
    Differ,
    /// This peer did not see the whole comparison.
    Unknown(String),
}

/// Reads the digest all-reduce: the mean of each bit is exactly 0 or 1 only where every
/// member sent the same bit (any other mean is at least 1/n away from both).
fn verdict(group: &Group, round: &Outcome) -> Verdict {
    let covered: usize = round.patches.iter().map(|(r, _)| r.len()).sum();
    if round.spans.is_empty() || covered < DIGEST_BITS {
        return Verdict::Unknown(
            match round.spans.iter().find_map(|s| match &s.outcome {
                crate::SpanOutcome::KeptLocal { reason } => Some(reason.clone()),
                _ => None,
            }) {
                Some(reason) => reason,
                None => "nothing came back".into(),
            },
        );
    }
    let contributing = group
        .members
        .iter()
        .filter(|m| m.mode != AveragingMode::Aux)
        .count();
    let everyone = round.spans.iter().all(|s| {
        s.outcome
            .contributors()
            .is_some_and(|c| c.len() == contributing)
    });
    let same = round
        .patches
        .iter()
        .flat_map(|(_, v)| v.iter())
        .all(|&b| !(1e-6..=1.0 - 1e-6).contains(&b));
    if everyone && same {
        Verdict::Agreed
    } else {
        Verdict::Differ
    }
}

/// An empty list of recent groups.
pub(super) fn no_groups() -> std::sync::Mutex<VecDeque<Group>> {
    std::sync::Mutex::new(VecDeque::with_capacity(RECENT_GROUPS))
}
