//! Phase 2 of a round, re-delegation (explained in the crate docs, "Re-delegation"): a
//! sender that lost a reducer splits that reducer's span over the survivors by
//! [`repair_plan`](super::plan::repair_plan), sends its original values of each part to the
//! part's reducer and reduces its own part; a survivor serves the parts its plan gives it.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::{sleep_until, timeout, Instant};
use tracing::Instrument;

use super::plan::{repair_plan, transfer_estimate};
use super::reduce::{reduce_span, ReduceJob, Reduced};
use super::send::{send_span, SendKind};
use super::{kept, segment_reports, Round, Task};
use crate::config::AveragingMode;
use crate::pool::PoolBuf;
use crate::router::IncomingSender;
use crate::wire::{write_control, MemberIdx, ReduceMsg};
use crate::{SpanOutcome, SpanReport};

/// A part sent to another reducer came back (or not): `(failed reducer, part's reducer, part,
/// result)`.
type PartDone = (MemberIdx, MemberIdx, Range<usize>, super::send::Sent);

/// A part this peer needs back: its reducer, its range, and why the failed reducer's span is
/// being repaired.
struct Needed {
    reducer: MemberIdx,
    part: Range<usize>,
    why: String,
}

/// Phase 2 (re-delegation) on one peer; see the module docs. Owns its tasks: dropping it aborts
/// them.
pub(super) struct Repair {
    round: Arc<Round>,
    /// Reducers this peer saw fail (input of every repair plan it computes).
    down: BTreeSet<MemberIdx>,
    /// Members this peer saw fail in any role.
    pub failed: HashSet<MemberIdx>,
    /// Parts this peer needs back, by `(failed reducer, part start)`.
    needed: HashMap<(MemberIdx, usize), Needed>,
    /// Queues of the parts this peer reduces, by failed reducer (kept after the part is done,
    /// so a part is reduced at most once).
    sessions: HashMap<MemberIdx, mpsc::Sender<IncomingSender>>,
    session_tasks: FuturesUnordered<Task<(MemberIdx, Range<usize>, Reduced)>>,
    /// Parts sent to other reducers: those this peer needs, and contributions to spans it did
    /// not lose.
    part_tasks: FuturesUnordered<Task<PartDone>>,
    /// New values of the parts this peer needed, to write into its result.
    pub patches: Vec<(Range<usize>, PoolBuf)>,
    /// Error feedback: residuals of the needed parts sent to other reducers quantized (parts
    /// this peer reduced itself used its exact values).
    pub residuals: Vec<(Range<usize>, PoolBuf)>,
    /// Reports of the parts (or whole spans) this peer needed.
    pub reports: Vec<SpanReport>,
}

impl Repair {
    pub fn new(round: Arc<Round>, down: BTreeSet<MemberIdx>, failed: HashSet<MemberIdx>) -> Self {
        Repair {
            round,
            down,
            failed,
            needed: HashMap::new(),
            sessions: HashMap::new(),
            session_tasks: FuturesUnordered::new(),
            part_tasks: FuturesUnordered::new(),
            patches: Vec::new(),
            residuals: Vec::new(),
            reports: Vec::new(),
        }
    }

    /// The round it repairs.
    pub fn round(&self) -> &Arc<Round> {
        &self.round
    }

    /// Plans the repair of every span this peer lost (`(reducer, why)`), if the deadline leaves
    /// time, and starts sending and reducing its parts.
    pub fn start(&mut self, lost: Vec<(MemberIdx, String)>) {
        let round = self.round.clone();
        let cfg = round.config();
        let left = round.deadline.saturating_duration_since(Instant::now());
        for (j, why) in lost {
            let range = round.ranges[j.get()].clone();
            let need = cfg
                .repair_min_time
                .saturating_add(transfer_estimate(range.len(), round.env.bandwidth));
            if left < need {
                let reason = format!(
                    "{why}; {} ms left before the deadline, too little to re-delegate (needs {} ms)",
                    left.as_millis(),
                    need.as_millis()
                );
                self.keep(j, range, reason);
                continue;
            }
            let plan = self.plan(j);
            if plan.is_empty() {
                let reason = format!("{why}; no surviving reducer to re-delegate to");
                self.keep(j, range, reason);
                continue;
            }
            tracing::debug!(failed = j.0, ?plan, "re-delegating a failed reducer's span");
            for (k, part) in plan {
                let needed = Needed {
                    reducer: k,
                    part: part.clone(),
                    why: why.clone(),
                };
                self.needed.insert((j, part.start), needed);
                if k == round.me {
                    self.start_session(j, part);
                } else {
                    self.send_part(j, k, part);
                }
            }
        }
    }

    /// Serves repair hellos and collects finished parts. With `linger == None`, returns once
    /// every part this peer needs is settled; with `Some(until)`, once `until` has passed and
    /// no part this peer reduces or contributes to is in flight. Never past the deadline: parts
    /// still missing then keep their local values.
    pub async fn drive(
        &mut self,
        rx: &mut mpsc::Receiver<IncomingSender>,
        linger: Option<Instant>,
    ) {
        let deadline = self.round.deadline;
        loop {
            let idle = self.session_tasks.is_empty() && self.part_tasks.is_empty();
            match linger {
                // (Idle with parts still needed only if a task died: they stay local.)
                None if self.needed.is_empty() || idle => break,
                Some(until) if idle && Instant::now() >= until => break,
                _ => {}
            }
            let until = linger.unwrap_or(deadline);
            tokio::select! {
                Some(inc) = rx.recv() => self.dispatch(inc),
                Some(done) = self.session_tasks.next() => match done {
                    Ok((j, part, reduced)) => self.session_done(j, part, reduced),
                    Err(e) => tracing::warn!("repair reduce task failed: {e}"),
                },
                Some(done) = self.part_tasks.next() => match done {
                    Ok((j, k, part, r)) => self.part_done(j, k, part, r),
                    Err(e) => tracing::warn!("repair send task failed: {e}"),
                },
                _ = sleep_until(until), if idle && linger.is_some() => {}
                _ = sleep_until(deadline) => break,
            }
        }
        // Parts that did not come back in time keep their local values.
        for ((j, _), n) in std::mem::take(&mut self.needed) {
            let reason = format!(
                "{}; the deadline passed before {} returned the re-delegated part",
                n.why,
                self.round.peer(n.reducer)
            );
            self.keep(j, n.part, reason);
        }
    }

    /// This peer's repair plan for failed reducer `j`'s span.
    fn plan(&self, j: MemberIdx) -> Vec<(MemberIdx, Range<usize>)> {
        let r = &self.round;
        repair_plan(
            r.config(),
            &r.ranges,
            &r.bandwidths,
            &r.modes,
            j,
            &self.down,
        )
    }

    fn keep(&mut self, j: MemberIdx, range: Range<usize>, reason: String) {
        self.reports.push(SpanReport {
            reducer: self.round.peer(j),
            range,
            outcome: kept(reason),
        });
    }

    /// Sends this peer's original values of `part` of failed reducer `j`'s span to member `k`.
    fn send_part(&mut self, j: MemberIdx, k: MemberIdx, part: Range<usize>) {
        let round = self.round.clone();
        self.part_tasks.push(Task::spawn(async move {
            let r = send_span(
                &round,
                k,
                part.clone(),
                SendKind::Repair { failed: j },
                false,
            )
            .await;
            (j, k, part, r)
        }));
    }

    /// Starts reducing this peer's part of failed reducer `j`'s span.
    fn start_session(&mut self, j: MemberIdx, part: Range<usize>) {
        let round = self.round.clone();
        let (tx, rx) = mpsc::channel(round.peers.len() + 4);
        self.sessions.insert(j, tx);
        let allowed = round.senders_except(&[round.me, j]);
        let expected = allowed
            .iter()
            .copied()
            .filter(|i| !self.failed.contains(i) && !self.down.contains(i))
            .collect();
        let job = ReduceJob {
            range: part.clone(),
            allowed,
            expected,
            repair: Some(j),
        };
        self.session_tasks.push(Task::spawn(async move {
            let reduced = reduce_span(round, job, rx).await;
            (j, part, reduced)
        }));
    }

    /// Routes a repair hello to the part it names. A part this peer did not plan for (it did not
    /// lose that span) starts if its own plan gives it exactly that part; this peer then also
    /// contributes its original values to the plan's other parts, so the peers repairing the
    /// span average with it too and need not wait for it. Anything else is refused.
    fn dispatch(&mut self, inc: IncomingSender) {
        let round = self.round.clone();
        let ReduceMsg::RepairHello {
            failed, start, len, ..
        } = inc.hello
        else {
            return;
        };
        let refuse = |mut inc: IncomingSender, why: &str| {
            let t = round.config().request_timeout;
            let msg = ReduceMsg::Excluded(why.to_string());
            let answer = async move {
                let _ = timeout(t, write_control(&mut inc.stream, &msg)).await;
            };
            tokio::spawn(answer.in_current_span());
        };
        if !self.sessions.contains_key(&failed) {
            let me = round.me;
            let plan = if failed.within(round.peers.len()).is_some() && failed != me {
                self.plan(failed)
            } else {
                vec![]
            };
            let mine = plan.iter().any(|(k, part)| {
                *k == me && part.start as u64 == start && part.len() as u64 == len
            });
            if !mine {
                refuse(inc, "that part is not this peer's under its repair plan");
                return;
            }
            tracing::debug!(failed = failed.0, start, len, "serving a re-delegated part");
            for (k, part) in plan {
                if k == me {
                    self.start_session(failed, part);
                } else if round.modes[me.get()] != AveragingMode::Aux {
                    self.send_part(failed, k, part);
                }
            }
        }
        let Some(tx) = self.sessions.get(&failed) else {
            return;
        };
        if let Err(e) = tx.try_send(inc) {
            let inc = match e {
                mpsc::error::TrySendError::Full(i) | mpsc::error::TrySendError::Closed(i) => i,
            };
            refuse(inc, "that part is already reduced");
        }
    }

    fn session_done(&mut self, j: MemberIdx, part: Range<usize>, reduced: Reduced) {
        let round = self.round.clone();
        self.failed.extend(&reduced.failed);
        if self.needed.remove(&(j, part.start)).is_none() {
            return; // served for others; this peer keeps the failed reducer's own result
        }
        let to = round.peer(round.me);
        for (seg, _) in &reduced.segments {
            let local = seg.start - part.start..seg.end - part.start;
            self.patches
                .push((seg.clone(), round.env.pool.copy_of(&reduced.values[local])));
        }
        self.reports.extend(segment_reports(
            &round,
            j,
            &part,
            &reduced.segments,
            |contributors| SpanOutcome::Redelegated { to, contributors },
        ));
    }

    fn part_done(&mut self, j: MemberIdx, k: MemberIdx, part: Range<usize>, r: super::send::Sent) {
        let round = self.round.clone();
        if let Err(fail) = &r {
            if fail.reducer_failed {
                self.failed.insert(k);
            }
        }
        let Some(needed) = self.needed.remove(&(j, part.start)) else {
            return; // a contribution to a span this peer did not lose
        };
        match r {
            Ok((segments, values, residual, _sealed)) => {
                self.patches.push((part.clone(), values));
                if let Some(residual) = residual {
                    self.residuals.push((part.clone(), residual));
                }
                let to = round.peer(k);
                self.reports.extend(segment_reports(
                    &round,
                    j,
                    &part,
                    &segments,
                    |contributors| SpanOutcome::Redelegated { to, contributors },
                ));
            }
            Err(fail) => self.reports.push(SpanReport {
                reducer: round.peer(j),
                range: part,
                outcome: kept(format!(
                    "{}; re-delegating to {} failed: {}",
                    needed.why,
                    round.peer(k),
                    fail.reason
                )),
            }),
        }
    }
}
