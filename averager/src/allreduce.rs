//! The butterfly all-reduce of one formed group.
//!
//! The flattened vector is cut into one contiguous span per member, sized by
//! [`crate::partition::solve_fractions`] over [`crate::partition::denoise_bandwidths`]
//! (clients and weak peers get none). Each sender streams its part of span `j` to reducer `j`
//! (over `j`'s fast lane when it has one) in order, in chunks of `chunk_bytes` (compressed by
//! the configured codec). The reducer works **part by part** (a part is one chunk's worth of
//! elements): as soon as every present sender has delivered a part, and every expected sender
//! has shown up (or the no-show time passed), it computes that part's weighted mean and streams
//! back to each contributor its *delta* `mean - received`, so quantization error does not
//! compound, while the following parts are still arriving: the return traffic overlaps the send
//! traffic on the same full-duplex stream. Senders apply deltas to their exact local values.
//! A sender that stalls past `sender_timeout` or breaks the protocol is left out of the parts
//! not finished yet; every part's result is the exact weighted mean of the contributors its
//! `Result` message lists, and reports give one entry per run of parts with the same
//! contributors. A sender keeps its results only if every part of the span came back.
//!
//! # Re-delegation (phase 2)
//!
//! A sender whose reducer *failed* (unreachable, stalled past its timeouts, disconnected, broke
//! the protocol, or does not know the round) re-delegates that reducer's span in the same round,
//! if the deadline leaves `repair_min_time` plus the span's estimated transfer time:
//!
//! - **Plan.** The span is split over the *surviving reducers* (members with a non-empty span,
//!   other than the failed one and any reducer this peer saw fail) by the same load-balancing
//!   solve as the round, applied to their declared bandwidths ([`repair_plan`]). The inputs are
//!   the group's member list and the failures this peer observed, so peers that saw the same
//!   failures compute the same plan.
//! - **Parts.** For each part the sender sends its *original* values to that part's reducer
//!   behind a [`ReduceMsg::RepairHello`] naming the failed reducer and the part; the reducer
//!   averages them with its own original values and returns deltas, exactly as in phase 1. A part
//!   that falls to this peer is reduced by this peer.
//! - **Agreement.** A reducer serves a part only if its own plan for that failed span gives it
//!   exactly that part (else it answers `Excluded`); so every contributor of a part agreed on
//!   it, and its result is the exact weighted mean of the contributors it lists.
//! - **Partial delivery.** A peer that received the failed reducer's result before it died
//!   keeps that result (its report says `Averaged`, with the original contributors). When a
//!   repair hello reaches it, it serves its planned part and also sends its original values to
//!   the plan's other parts, so the peers that lost the span average with every survivor and do
//!   not wait for it. Each peer's report lists, part by part, who reduced it and whose values
//!   are in it.
//! - **Waiting.** Only a peer that lost a span waits for phase 2, and only for its own parts:
//!   a clean round costs the caller nothing. A part's reducer waits for the members it believes
//!   alive (no-show after `request_timeout + sender_timeout`), then averages whoever
//!   delivered; no-shows are not counted as failed. After the round, a peer that can reduce
//!   keeps serving other members' parts in the background for `request_timeout` (one finished
//!   round at a time per averager, holding its copy of the original values). Every wait is
//!   bounded by the caller's deadline; a part not back by then, refused, or whose reducer
//!   fails too keeps its local values (there is no second repair), and the report says why.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use starling_compression::{decode_into, ChunkHeader, Codec, DecodeOptions};
use starling_node::PeerId;

use crate::lane::Lane;
use crate::pool::PoolBuf;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, timeout, timeout_at, Instant};

use crate::averager::Shared;
use crate::config::{AveragerConfig, Fault};
use crate::matchmaking::Group;
use crate::partition::{denoise_bandwidths, solve_fractions, spans};
use crate::wire::{
    read_control, read_frame_into, write_chunk, write_control, ChunkOut, Frame, ReduceMsg,
    SpanChunks, REDUCE_PROTOCOL, UNKNOWN_ROUND,
};
use crate::{AveragerError, AveragingMode, SpanOutcome, SpanReport};

/// A sender's stream routed to the round it names.
pub(crate) struct IncomingSender {
    pub peer: PeerId,
    pub hello: ReduceMsg,
    pub stream: Lane,
}

/// The queues of a running round: plain hellos go to the reduction of this peer's own span,
/// repair hellos to its re-delegation phase.
pub(crate) struct RoundRoute {
    pub senders: mpsc::Sender<IncomingSender>,
    pub repairs: mpsc::Sender<IncomingSender>,
}

/// Repair hellos queued per member of the group (a member sends at most one per failed span).
const REPAIR_QUEUE_PER_MEMBER: usize = 4;

/// What a round produced for the local peer.
pub(crate) struct Outcome {
    /// New values of the averaged ranges of the flattened vector; the rest keeps its values.
    pub patches: Vec<(Range<usize>, PoolBuf)>,
    pub group: Vec<PeerId>,
    pub spans: Vec<SpanReport>,
    pub failed_peers: Vec<PeerId>,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Span transfers sent over a fast lane.
    pub fast_lanes: usize,
    /// This peer's upload rate (bytes/s) as seen on this round's streams, if enough was sent.
    pub measured_bandwidth: Option<f64>,
}

/// How long a reducer crashing by `Fault::WhileReturning` lets its served results travel first.
const FAULT_FLUSH_GRACE: Duration = Duration::from_millis(500);

/// Streams shorter than this say too little about bandwidth to be measured.
const MIN_MEASURED_BYTES: usize = 256 * 1024;

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    fast: AtomicU64,
    /// Sum over concurrent sender streams of bytes / seconds (bits of f64).
    rate_sum: std::sync::Mutex<f64>,
}

/// Keeps a round's routes registered while it lives (the round, then its background repair
/// server).
struct RoundGuard {
    shared: Arc<Shared>,
    round_id: u64,
}

impl Drop for RoundGuard {
    fn drop(&mut self) {
        if let Ok(mut r) = self.shared.round_routes.lock() {
            r.remove(&self.round_id);
        }
    }
}

/// Everything a round's tasks need, shared between them.
struct Round {
    shared: Arc<Shared>,
    round_id: u64,
    me: u32,
    weight: f64,
    peers: Vec<PeerId>,
    addrs: Vec<Vec<String>>,
    modes: Vec<AveragingMode>,
    /// Declared bandwidths, as the group's member list gives them (the repair plan's input).
    bandwidths: Vec<f64>,
    /// Each member's span.
    ranges: Vec<Range<usize>>,
    flat: Arc<PoolBuf>,
    counters: Counters,
    deadline: Instant,
}

/// Span fractions for members with these bandwidths and modes: the load-balancing solve, or an
/// equal split among the members that may reduce. `None` when nobody may reduce.
fn fractions(
    cfg: &AveragerConfig,
    bandwidths: &[f64],
    modes: &[AveragingMode],
) -> Option<Vec<f64>> {
    if cfg.load_balance {
        return solve_fractions(&denoise_bandwidths(bandwidths), modes);
    }
    let reducers = modes
        .iter()
        .filter(|m| **m != AveragingMode::Client)
        .count();
    (reducers > 0).then(|| {
        modes
            .iter()
            .map(|m| {
                if *m == AveragingMode::Client {
                    0.0
                } else {
                    1.0 / reducers as f64
                }
            })
            .collect()
    })
}

/// How the span of failed reducer `failed` is split over the surviving reducers, as seen by a
/// peer that believes the members in `down` failed too: `(member, part)` for every non-empty
/// part, in range order, covering the whole span (empty when no reducer survives).
///
/// A surviving reducer is a member with a non-empty span in `ranges`, other than `failed` and
/// the members in `down`; parts are sized by the same solve as the round's spans, over the
/// survivors' declared bandwidths. Deterministic: equal inputs give equal plans on every peer.
pub(crate) fn repair_plan(
    cfg: &AveragerConfig,
    ranges: &[Range<usize>],
    bandwidths: &[f64],
    modes: &[AveragingMode],
    failed: usize,
    down: &BTreeSet<u32>,
) -> Vec<(usize, Range<usize>)> {
    let Some(span) = ranges.get(failed).filter(|r| !r.is_empty()).cloned() else {
        return vec![];
    };
    let survivors: Vec<usize> = (0..ranges.len())
        .filter(|&i| i != failed && !ranges[i].is_empty() && !down.contains(&(i as u32)))
        .collect();
    let bw: Vec<f64> = survivors.iter().map(|&i| bandwidths[i]).collect();
    let sub_modes: Vec<AveragingMode> = survivors.iter().map(|&i| modes[i]).collect();
    if survivors.is_empty() {
        return vec![];
    }
    let Some(f) = fractions(cfg, &bw, &sub_modes) else {
        return vec![];
    };
    spans(span.len(), &f)
        .into_iter()
        .zip(survivors)
        .filter(|(part, _)| !part.is_empty())
        .map(|(part, i)| (i, span.start + part.start..span.start + part.end))
        .collect()
}

fn kept(reason: impl Into<String>) -> SpanOutcome {
    SpanOutcome::KeptLocal {
        reason: reason.into(),
    }
}

/// Runs the all-reduce for `group` over the flattened local vector.
pub(crate) async fn run_allreduce(
    shared: &Arc<Shared>,
    group: &Group,
    flat: PoolBuf,
    weight: f64,
    deadline: Instant,
) -> Outcome {
    let t_start = Instant::now();
    let n = group.members.len();
    let peers: Vec<PeerId> = group
        .members
        .iter()
        .map(|m| PeerId::from_bytes(&m.peer_id).unwrap_or_else(|_| PeerId::random()))
        .collect();
    let modes: Vec<AveragingMode> = group.members.iter().map(|m| m.mode).collect();
    let bandwidths: Vec<f64> = group.members.iter().map(|m| m.bandwidth).collect();
    let total = flat.len();
    let Some(fractions) = fractions(&shared.config, &bandwidths, &modes) else {
        return Outcome {
            patches: vec![],
            group: peers,
            spans: vec![],
            failed_peers: vec![],
            bytes_sent: 0,
            bytes_received: 0,
            fast_lanes: 0,
            measured_bandwidth: None,
        };
    };
    let ranges = spans(total, &fractions);
    let (tx, rx) = mpsc::channel(n + 4);
    let (repair_tx, repair_rx) = mpsc::channel(REPAIR_QUEUE_PER_MEMBER * n + 4);
    if let Ok(mut routes) = shared.round_routes.lock() {
        routes.insert(
            group.round_id,
            RoundRoute {
                senders: tx,
                repairs: repair_tx,
            },
        );
    }
    let guard = RoundGuard {
        shared: shared.clone(),
        round_id: group.round_id,
    };
    let round = Arc::new(Round {
        shared: shared.clone(),
        round_id: group.round_id,
        me: group.my_index as u32,
        weight,
        peers: peers.clone(),
        addrs: group.members.iter().map(|m| m.addrs.clone()).collect(),
        modes: modes.clone(),
        bandwidths,
        ranges: ranges.clone(),
        flat: Arc::new(flat),
        counters: Counters::default(),
        deadline,
    });
    let me = group.my_index;
    let i_send = modes[me] != AveragingMode::Aux;
    if shared.config.fault == Some(Fault::BeforeSending) {
        shared.node.shutdown().await;
    }

    // Senders: one task per remote reducer with a non-empty span.
    let mut sends = Vec::new();
    if i_send {
        for (j, range) in ranges.iter().enumerate() {
            if j != me && !range.is_empty() {
                let round = round.clone();
                let range = range.clone();
                sends.push((
                    j,
                    tokio::spawn(async move { send_span(&round, j, range, SendKind::Span).await }),
                ));
            }
        }
    }
    // Reducer: our own span.
    let my_range = ranges[me].clone();
    let reduced = if my_range.is_empty() {
        None
    } else {
        let job = ReduceJob {
            range: my_range.clone(),
            allowed: senders_except(&round, &[me as u32]),
            expected: senders_except(&round, &[me as u32]),
            repair: None,
        };
        Some(reduce_span(round.clone(), job, rx).await)
    };
    tracing::debug!(elapsed = ?t_start.elapsed(), "own span reduced");

    let mut patches: Vec<(Range<usize>, PoolBuf)> = Vec::new();
    let mut reports = Vec::new();
    // Members seen failing in any role, and reducers seen failing (the repair plan's input).
    let mut failed: HashSet<u32> = HashSet::new();
    let mut down: BTreeSet<u32> = BTreeSet::new();
    let mut lost: Vec<(usize, String)> = Vec::new();
    if let Some(r) = reduced {
        failed.extend(&r.failed);
        let reports_of = segment_reports(&peers, peers[me], &my_range, &r.segments, |c| {
            SpanOutcome::Averaged { contributors: c }
        });
        if r.segments.len() == 1 && r.segments[0].0 == my_range {
            patches.push((my_range.clone(), r.values));
        } else {
            for (seg, _) in &r.segments {
                let local = seg.start - my_range.start..seg.end - my_range.start;
                patches.push((seg.clone(), shared.pool.copy_of(&r.values[local])));
            }
        }
        reports.extend(reports_of);
    }
    for (j, handle) in sends {
        let range = ranges[j].clone();
        let outcome = match handle.await {
            Ok(Ok((segments, values))) => {
                patches.push((range.clone(), values));
                reports.extend(segment_reports(&peers, peers[j], &range, &segments, |c| {
                    SpanOutcome::Averaged { contributors: c }
                }));
                continue;
            }
            Ok(Err(fail)) => {
                failed.insert(j as u32);
                if fail.reducer_failed {
                    down.insert(j as u32);
                    lost.push((j, fail.reason));
                    continue;
                }
                kept(fail.reason)
            }
            Err(e) => kept(format!("sender task failed: {e}")),
        };
        reports.push(SpanReport {
            reducer: peers[j],
            range,
            outcome,
        });
    }
    tracing::debug!(elapsed = ?t_start.elapsed(), "sent spans returned");
    // Phase 2: repair what this peer lost; then, for a while, serve the parts of peers that
    // lost a span this peer received (in the background: the caller does not wait for it).
    let mut repair = Repair::new(round.clone(), down, failed);
    let mut repair_rx = repair_rx;
    if !lost.is_empty() {
        repair.start(lost);
        repair.drive(&mut repair_rx, None).await;
    }
    patches.append(&mut repair.patches);
    reports.append(&mut repair.reports);
    let failed = repair.failed.clone();
    let left = deadline.saturating_duration_since(Instant::now());
    if !ranges[me].is_empty() && left >= shared.config.repair_min_time {
        let until = (Instant::now() + shared.config.request_timeout).min(deadline);
        let server = tokio::spawn(async move {
            repair.drive(&mut repair_rx, Some(until)).await;
            drop(repair);
            drop(guard);
        });
        shared.set_repair_server(server);
    }

    reports.sort_by_key(|r| r.range.start);
    tracing::debug!(elapsed = ?t_start.elapsed(), "round assembled");
    let mut failed: Vec<PeerId> = failed.into_iter().map(|f| peers[f as usize]).collect();
    failed.sort();
    failed.dedup();
    Outcome {
        patches,
        group: peers,
        spans: reports,
        failed_peers: failed,
        bytes_sent: round.counters.sent.load(Ordering::Relaxed),
        bytes_received: round.counters.received.load(Ordering::Relaxed),
        fast_lanes: round.counters.fast.load(Ordering::Relaxed) as usize,
        measured_bandwidth: round
            .counters
            .rate_sum
            .lock()
            .ok()
            .map(|r| *r)
            .filter(|r| *r > 0.0),
    }
}

/// The members that send (not `Aux`), except those listed.
fn senders_except(round: &Round, except: &[u32]) -> HashSet<u32> {
    (0..round.peers.len() as u32)
        .filter(|i| !except.contains(i) && round.modes[*i as usize] != AveragingMode::Aux)
        .collect()
}

/// One report per run of `range` with its contributors (`outcome` builds the averaged
/// outcome from them); whatever the runs leave uncovered was not averaged and kept its values.
fn segment_reports(
    peers: &[PeerId],
    reducer: PeerId,
    range: &Range<usize>,
    segments: &[Segment],
    outcome: impl Fn(Vec<PeerId>) -> SpanOutcome,
) -> Vec<SpanReport> {
    let mut reports = Vec::new();
    let mut at = range.start;
    for (seg, contributors) in segments {
        if seg.start > at {
            reports.push(SpanReport {
                reducer,
                range: at..seg.start,
                outcome: kept("no contributions to this part"),
            });
        }
        reports.push(SpanReport {
            reducer,
            range: seg.clone(),
            outcome: outcome(contributors.iter().map(|c| peers[*c as usize]).collect()),
        });
        at = seg.end;
    }
    if at < range.end {
        reports.push(SpanReport {
            reducer,
            range: at..range.end,
            outcome: kept(if at == range.start {
                "no contributions arrived"
            } else {
                "the deadline passed before the rest of the span was averaged"
            }),
        });
    }
    reports
}

type PartDone = (
    u32,
    usize,
    Range<usize>,
    Result<(Vec<Segment>, PoolBuf), SendFail>,
);

/// Phase 2 (re-delegation) on one peer; see the module docs. Owns its tasks: dropping it aborts
/// them.
struct Repair {
    round: Arc<Round>,
    /// Reducers this peer saw fail (input of every repair plan it computes).
    down: BTreeSet<u32>,
    /// Members this peer saw fail in any role.
    failed: HashSet<u32>,
    /// Parts this peer needs back, by `(failed reducer, part start)`: their reducer, range, and
    /// why the failed reducer's span is being repaired.
    needed: HashMap<(u32, usize), (usize, Range<usize>, String)>,
    /// Queues of the parts this peer reduces, by failed reducer (kept after the part is done,
    /// so a part is reduced at most once).
    sessions: HashMap<u32, mpsc::Sender<IncomingSender>>,
    session_tasks: FuturesUnordered<JoinHandle<(u32, Range<usize>, Reduced)>>,
    /// Parts sent to other reducers: those this peer needs, and contributions to spans it did
    /// not lose.
    part_tasks: FuturesUnordered<JoinHandle<PartDone>>,
    /// New values of the parts this peer needed, to write into its result.
    patches: Vec<(Range<usize>, PoolBuf)>,
    /// Reports of the parts (or whole spans) this peer needed.
    reports: Vec<SpanReport>,
}

impl Drop for Repair {
    fn drop(&mut self) {
        for t in self.session_tasks.iter() {
            t.abort();
        }
        for t in self.part_tasks.iter() {
            t.abort();
        }
    }
}

impl Repair {
    fn new(round: Arc<Round>, down: BTreeSet<u32>, failed: HashSet<u32>) -> Self {
        Repair {
            round,
            down,
            failed,
            needed: HashMap::new(),
            sessions: HashMap::new(),
            session_tasks: FuturesUnordered::new(),
            part_tasks: FuturesUnordered::new(),
            patches: Vec::new(),
            reports: Vec::new(),
        }
    }

    /// Plans the repair of every span this peer lost (`(reducer, why)`), if the deadline leaves
    /// time, and starts sending and reducing its parts.
    fn start(&mut self, lost: Vec<(usize, String)>) {
        let round = self.round.clone();
        let cfg = &round.shared.config;
        let me = round.me as usize;
        let left = round.deadline.saturating_duration_since(Instant::now());
        for (j, why) in lost {
            let range = round.ranges[j].clone();
            let need = cfg
                .repair_min_time
                .saturating_add(transfer_estimate(range.len(), round.shared.bandwidth()));
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
                self.keep(
                    j,
                    range,
                    format!("{why}; no surviving reducer to re-delegate to"),
                );
                continue;
            }
            tracing::debug!(failed = j, ?plan, "re-delegating a failed reducer's span");
            for (k, part) in plan {
                self.needed
                    .insert((j as u32, part.start), (k, part.clone(), why.clone()));
                if k == me {
                    self.start_session(j as u32, part);
                } else {
                    self.send_part(j as u32, k, part);
                }
            }
        }
    }

    /// Serves repair hellos and collects finished parts. With `linger == None`, returns once
    /// every part this peer needs is settled; with `Some(until)`, once `until` has passed and
    /// no part this peer reduces or contributes to is in flight. Never past the deadline: parts
    /// still missing then keep their local values.
    async fn drive(&mut self, rx: &mut mpsc::Receiver<IncomingSender>, linger: Option<Instant>) {
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
        for ((j, _), (k, part, why)) in std::mem::take(&mut self.needed) {
            let reason = format!(
                "{why}; the deadline passed before {} returned the re-delegated part",
                self.round.peers[k]
            );
            self.keep(j as usize, part, reason);
        }
    }

    /// This peer's repair plan for failed reducer `j`'s span.
    fn plan(&self, j: usize) -> Vec<(usize, Range<usize>)> {
        let r = &self.round;
        repair_plan(
            &r.shared.config,
            &r.ranges,
            &r.bandwidths,
            &r.modes,
            j,
            &self.down,
        )
    }

    fn keep(&mut self, j: usize, range: Range<usize>, reason: String) {
        self.reports.push(SpanReport {
            reducer: self.round.peers[j],
            range,
            outcome: kept(reason),
        });
    }

    /// Sends this peer's original values of `part` of failed reducer `j`'s span to member `k`.
    fn send_part(&mut self, j: u32, k: usize, part: Range<usize>) {
        let round = self.round.clone();
        self.part_tasks.push(tokio::spawn(async move {
            let r = send_span(&round, k, part.clone(), SendKind::Repair { failed: j }).await;
            (j, k, part, r)
        }));
    }

    /// Starts reducing this peer's part of failed reducer `j`'s span.
    fn start_session(&mut self, j: u32, part: Range<usize>) {
        let round = self.round.clone();
        let n = round.peers.len();
        let (tx, rx) = mpsc::channel(n + 4);
        self.sessions.insert(j, tx);
        let allowed = senders_except(&round, &[round.me, j]);
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
        self.session_tasks.push(tokio::spawn(async move {
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
            let t = round.shared.config.request_timeout;
            let msg = ReduceMsg::Excluded(why.to_string());
            tokio::spawn(async move {
                let _ = timeout(t, write_control(&mut inc.stream, &msg)).await;
            });
        };
        if !self.sessions.contains_key(&failed) {
            let me = round.me as usize;
            let plan = if (failed as usize) < round.peers.len() && failed as usize != me {
                self.plan(failed as usize)
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
            tracing::debug!(failed, start, len, "serving a re-delegated part");
            for (k, part) in plan {
                if k == me {
                    self.start_session(failed, part);
                } else if round.modes[me] != AveragingMode::Aux {
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

    fn session_done(&mut self, j: u32, part: Range<usize>, reduced: Reduced) {
        let round = self.round.clone();
        self.failed.extend(&reduced.failed);
        if self.needed.remove(&(j, part.start)).is_none() {
            return; // served for others; this peer keeps the failed reducer's own result
        }
        let to = round.peers[round.me as usize];
        for (seg, _) in &reduced.segments {
            self.patches.push((
                seg.clone(),
                round
                    .shared
                    .pool
                    .copy_of(&reduced.values[seg.start - part.start..seg.end - part.start]),
            ));
        }
        self.reports.extend(segment_reports(
            &round.peers,
            round.peers[j as usize],
            &part,
            &reduced.segments,
            |contributors| SpanOutcome::Redelegated { to, contributors },
        ));
    }

    fn part_done(
        &mut self,
        j: u32,
        k: usize,
        part: Range<usize>,
        r: Result<(Vec<Segment>, PoolBuf), SendFail>,
    ) {
        let round = self.round.clone();
        if let Err(fail) = &r {
            if fail.reducer_failed {
                self.failed.insert(k as u32);
            }
        }
        let Some((_, _, why)) = self.needed.remove(&(j, part.start)) else {
            return; // a contribution to a span this peer did not lose
        };
        match r {
            Ok((segments, values)) => {
                self.patches.push((part.clone(), values));
                let to = round.peers[k];
                self.reports.extend(segment_reports(
                    &round.peers,
                    round.peers[j as usize],
                    &part,
                    &segments,
                    |contributors| SpanOutcome::Redelegated { to, contributors },
                ));
            }
            Err(fail) => self.reports.push(SpanReport {
                reducer: round.peers[j as usize],
                range: part,
                outcome: kept(format!(
                    "{why}; re-delegating to {} failed: {}",
                    round.peers[k], fail.reason
                )),
            }),
        }
    }
}

/// Time to move `len` f32 values out and back at `bandwidth` bytes per second.
fn transfer_estimate(len: usize, bandwidth: f64) -> Duration {
    Duration::try_from_secs_f64(2.0 * 4.0 * len as f64 / bandwidth).unwrap_or(Duration::MAX)
}

/// What a sender streams: its part of a reducer's span (phase 1), or its part of a failed
/// reducer's span to a surviving reducer (phase 2).
#[derive(Clone, Copy)]
enum SendKind {
    Span,
    Repair { failed: u32 },
}

/// Why a sender got no result back.
struct SendFail {
    reason: String,
    /// The reducer failed (gone, stalled, broke the protocol, not in the round), as opposed to
    /// refusing us, or our own failure or deadline.
    reducer_failed: bool,
}

impl SendFail {
    fn reducer(reason: impl Into<String>) -> Self {
        SendFail {
            reason: reason.into(),
            reducer_failed: true,
        }
    }

    fn other(reason: impl Into<String>) -> Self {
        SendFail {
            reason: reason.into(),
            reducer_failed: false,
        }
    }

    /// `Excluded(why)` from the reducer: a failure only if it does not know the round.
    fn excluded(why: String) -> Self {
        SendFail {
            reducer_failed: why == UNKNOWN_ROUND,
            reason: format!("excluded by reducer: {why}"),
        }
    }
}

/// Contributors of a contiguous run of a span: `(absolute range, member indices)`.
pub(crate) type Segment = (Range<usize>, Vec<u32>);

/// Streams our part of reducer `j`'s span (or, in phase 2, a part of a failed reducer's span to
/// surviving reducer `j`) and, at the same time, reads back the averaged deltas part by part as
/// the reducer finishes them. Returns the contributors of each run of the range and the new
/// values of the whole range, or a failure if any part did not come back (partial results are
/// discarded: the range is then repaired or kept whole).
async fn send_span(
    round: &Round,
    j: usize,
    range: Range<usize>,
    kind: SendKind,
) -> Result<(Vec<Segment>, PoolBuf), SendFail> {
    let cfg = &round.shared.config;
    let phase1 = matches!(kind, SendKind::Span);
    // A surviving reducer may still be finishing phase 1 when our repair hello arrives. A part
    // comes back only once every sender delivered it (or the reducer gave up waiting for
    // no-shows), so allow for a no-show between result frames.
    let ack_wait = match kind {
        SendKind::Span => cfg.request_timeout * 2,
        SendKind::Repair { .. } => cfg.request_timeout * 2 + cfg.reducer_timeout,
    };
    let result_gap = cfg.reducer_timeout + cfg.request_timeout + cfg.sender_timeout;
    let failed_reducer = match kind {
        SendKind::Span => None,
        SendKind::Repair { failed } => Some(failed),
    };
    let work = async {
        let t0 = Instant::now();
        let hello = match kind {
            SendKind::Span => ReduceMsg::Hello {
                round_id: round.round_id,
                sender: round.me,
                weight: round.weight,
                start: range.start as u64,
                len: range.len() as u64,
            },
            SendKind::Repair { failed } => ReduceMsg::RepairHello {
                round_id: round.round_id,
                sender: round.me,
                weight: round.weight,
                failed,
                start: range.start as u64,
                len: range.len() as u64,
            },
        };
        let (stream, hello_bytes) = open_with_hello(round, j, &hello, ack_wait).await?;
        if stream.is_fast() {
            round.counters.fast.fetch_add(1, Ordering::Relaxed);
        }
        let (mut rd, mut wr) = stream.split();
        let part = &round.flat[range.clone()];
        // With a lossy codec, the reducer averaged what it decoded, not our exact values: keep
        // that decoded copy so the returned delta lands the result exactly on the mean.
        let mut as_sent =
            (cfg.codec != Codec::None).then(|| round.shared.pool.take_dirty(part.len()));
        let write = async {
            let mut sent = hello_bytes;
            let mut chunks = SpanChunks::new(cfg.codec, part, cfg.chunk_bytes)
                .map_err(|e| SendFail::other(e.to_string()))?;
            let mut index = 0;
            while let Some(chunk) = chunks.next_chunk() {
                if phase1 && cfg.fault == Some(Fault::AfterSentChunks(index)) {
                    round.shared.node.shutdown().await;
                    return Err(SendFail::other("fault injected: crashed while sending"));
                }
                index += 1;
                let chunk = chunk.map_err(|e| SendFail::other(e.to_string()))?;
                if let (Some(buf), ChunkOut::Encoded(bytes)) = (as_sent.as_mut(), &chunk) {
                    let header =
                        ChunkHeader::parse(bytes).map_err(|e| SendFail::other(e.to_string()))?;
                    let at = header.offset as usize;
                    decode_into(bytes, &mut buf[at..at + header.count])
                        .map_err(|e| SendFail::other(e.to_string()))?;
                }
                sent += timeout(cfg.reducer_timeout, write_chunk(&mut wr, &chunk))
                    .await
                    .map_err(|_| SendFail::reducer("reducer stopped reading"))?
                    .map_err(|e| SendFail::reducer(e.to_string()))?;
            }
            sent += write_control(&mut wr, &ReduceMsg::SendDone)
                .await
                .map_err(|e| SendFail::reducer(e.to_string()))?;
            futures::AsyncWriteExt::flush(&mut wr)
                .await
                .map_err(|e| SendFail::reducer(e.to_string()))?;
            Ok::<_, SendFail>((sent, t0.elapsed()))
        };
        let read = receive_results(round, &mut rd, range.len(), result_gap, failed_reducer);
        // Whichever side fails first ends the exchange (a refusal arrives on the read side while
        // the write side may still be pushing data nobody reads).
        let ((sent, t_sent), (segments, delta)) = futures::future::try_join(write, read).await?;
        round
            .counters
            .sent
            .fetch_add(sent as u64, Ordering::Relaxed);
        // Only phase 1's concurrent streams measure this peer's upload rate.
        if phase1 && sent >= MIN_MEASURED_BYTES && !t_sent.is_zero() {
            if let Ok(mut r) = round.counters.rate_sum.lock() {
                *r += sent as f64 / t_sent.as_secs_f64();
            }
        }
        let _ = futures::AsyncWriteExt::close(&mut wr).await;
        drop(rd);
        tracing::debug!(reducer = j, ?t_sent, total = ?t0.elapsed(), bytes = sent, "span sent and returned");
        // Turn the delta into the new values: (what the reducer saw of us) + delta.
        let mut result = delta;
        match as_sent {
            Some(base) => result
                .iter_mut()
                .zip(base.iter())
                .for_each(|(d, b)| *d += b),
            None => result.iter_mut().zip(part).for_each(|(d, b)| *d += b),
        }
        let segments = segments
            .into_iter()
            .map(|(r, c)| (range.start + r.start..range.start + r.end, c))
            .collect();
        Ok((segments, result))
    };
    timeout_at(round.deadline, work)
        .await
        .unwrap_or_else(|_| Err(SendFail::other("deadline passed")))
}

/// Reads a reducer's answers to a span of `len` elements: for each part, `Result` (its range and
/// contributors) and its delta chunks, until `ResultDone`; at most `gap` between frames. Returns
/// the runs of the span (offsets within it) with their contributors, and the whole delta.
async fn receive_results<R: futures::AsyncRead + Unpin>(
    round: &Round,
    rd: &mut R,
    len: usize,
    gap: Duration,
    failed_reducer: Option<u32>,
) -> Result<(Vec<Segment>, PoolBuf), SendFail> {
    let cfg = &round.shared.config;
    // Every element is decoded into before the delta is used (the span must come back whole).
    let mut delta = round.shared.pool.take_dirty(len);
    let mut segments: Vec<Segment> = Vec::new();
    // The part being received: its range and how many of its elements arrived.
    let mut current: Option<(Range<usize>, usize)> = None;
    let mut decoder = starling_compression::Decoder::new(decode_options(len));
    let mut chunk = Vec::new();
    loop {
        let (frame, n) = timeout(
            gap,
            read_frame_into::<_, ReduceMsg>(rd, cfg.max_frame_bytes, &mut chunk),
        )
        .await
        .map_err(|_| SendFail::reducer("reducer did not answer in time"))?
        .map_err(|e| SendFail::reducer(e.to_string()))?;
        round
            .counters
            .received
            .fetch_add(n as u64, Ordering::Relaxed);
        let covered = segments.last().map_or(0, |s| s.0.end);
        match frame {
            Frame::Data(()) => {
                let Some((part, got)) = current.as_mut() else {
                    return Err(SendFail::reducer("delta chunk outside a part"));
                };
                let h = ChunkHeader::parse(&chunk).map_err(|e| SendFail::reducer(e.to_string()))?;
                let (at, count) = (h.offset as usize, h.count);
                if h.total != part.len() as u64 || at != *got || at + count > part.len() {
                    return Err(SendFail::reducer("delta chunk out of place"));
                }
                let dst = part.start + at;
                decoder
                    .decode_into(&chunk, &mut delta[dst..dst + count])
                    .map_err(|e| SendFail::reducer(e.to_string()))?;
                *got += count;
            }
            Frame::Control(ReduceMsg::Result {
                start,
                len: part_len,
                contributors,
            }) => {
                if let Some((part, got)) = &current {
                    if *got != part.len() {
                        return Err(SendFail::reducer("a part's delta is incomplete"));
                    }
                }
                let (start, part_len) = (start as usize, part_len as usize);
                if start != covered
                    || part_len == 0
                    || start + part_len > len
                    || !contributors.contains(&round.me)
                    || contributors
                        .iter()
                        .any(|c| *c as usize >= round.peers.len() || Some(*c) == failed_reducer)
                {
                    return Err(SendFail::reducer(
                        "reducer's part or contributor list is malformed",
                    ));
                }
                let part = start..start + part_len;
                match segments.last_mut() {
                    Some(last) if last.1 == contributors => last.0.end = part.end,
                    _ => segments.push((part.clone(), contributors)),
                }
                current = Some((part, 0));
            }
            Frame::Control(ReduceMsg::ResultDone) => {
                let complete = current.as_ref().is_none_or(|(p, got)| *got == p.len());
                if !complete || covered != len {
                    return Err(SendFail::reducer("reducer's result is incomplete"));
                }
                return Ok((segments, delta));
            }
            Frame::Control(ReduceMsg::Excluded(why)) => return Err(SendFail::excluded(why)),
            Frame::Control(other) => {
                return Err(SendFail::reducer(format!("unexpected message {other:?}")))
            }
        }
    }
}

/// How long a sender keeps retrying to get a stream past libp2p-stream's accept queue.
const HELLO_RETRY_PAUSE: Duration = Duration::from_millis(25);

/// Opens a reduce stream to member `j` and waits (at most `wait`) for its `Ready`, retrying
/// streams that were dropped before the reducer saw them (libp2p-stream drops inbound streams
/// that arrive while its accept queue is busy). Retrying is safe: a reducer counts each sender
/// at most once.
async fn open_with_hello(
    round: &Round,
    j: usize,
    hello: &ReduceMsg,
    wait: Duration,
) -> Result<(Lane, usize), SendFail> {
    let cfg = &round.shared.config;
    // The reducer may still be starting its round: allow for that, then give up.
    let give_up = Instant::now() + wait;
    let mut last = String::from("no attempt");
    let mut attempt = 0u32;
    while Instant::now() < give_up {
        if attempt > 0 {
            tokio::time::sleep(HELLO_RETRY_PAUSE * attempt.min(8)).await;
        }
        attempt += 1;
        let mut stream = match round
            .shared
            .open_lane(round.peers[j], &round.addrs[j], REDUCE_PROTOCOL)
            .await
        {
            Ok(s) => s,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        let sent = match write_control(&mut stream, hello).await {
            Ok(n) => n,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        match timeout_at(
            give_up,
            read_control::<_, ReduceMsg>(&mut stream, cfg.max_frame_bytes),
        )
        .await
        {
            Ok(Ok(ReduceMsg::Ready)) => return Ok((stream, sent)),
            Ok(Ok(ReduceMsg::Excluded(why))) => return Err(SendFail::excluded(why)),
            Ok(Ok(other)) => {
                return Err(SendFail::reducer(format!("unexpected message {other:?}")))
            }
            Ok(Err(e)) => {
                tracing::debug!(reducer = j, attempt, "hello stream dropped, retrying: {e}");
                last = e.to_string();
            }
            Err(_) => return Err(SendFail::reducer("reducer did not acknowledge in time")),
        }
    }
    Err(SendFail::reducer(format!(
        "could not reach the reducer: {last}"
    )))
}

fn decode_options(len: usize) -> DecodeOptions {
    DecodeOptions::default().with_max_elements(len.max(1))
}

/// What a reducer reduces: its own span (phase 1) or its part of a failed reducer's span.
struct ReduceJob {
    range: Range<usize>,
    /// Senders it accepts, each at most once.
    allowed: HashSet<u32>,
    /// Senders it waits for (until the no-show time); a subset of `allowed`.
    expected: HashSet<u32>,
    /// `Some(failed reducer)` for a re-delegated part: senders must send a matching
    /// `RepairHello`, and members that do not come are not counted as failed (they may have
    /// received the failed reducer's result).
    repair: Option<u32>,
}

/// The result of reducing a span or part.
struct Reduced {
    /// The weighted means of the finished parts (offsets within the job's range); elements of
    /// unfinished parts are unspecified.
    values: PoolBuf,
    /// The finished runs (absolute ranges) with their contributors, in order from the range's
    /// start. Parts nobody contributed to, or not finished by the deadline, are not listed.
    segments: Vec<Segment>,
    failed: Vec<u32>,
}

/// News from a sender's receive task.
enum Inbound {
    /// The sender's data now covers `0..prefix` of the range.
    Progress { sender: u32, prefix: usize },
    /// The sender stalled, broke the protocol or went away before delivering everything.
    Failed { sender: u32, why: String },
}

/// What a sender's writer task sends back.
enum Outbound {
    /// A finished part: its offset in the range, contributors and this sender's delta.
    Part {
        start: usize,
        contributors: Arc<Vec<u32>>,
        delta: PoolBuf,
    },
    /// The sender is out of the remaining parts.
    Excluded(String),
}

/// A sender taking part in a reduction.
struct Present {
    weight: f64,
    /// Its values of the range, filled in order as chunks arrive.
    staging: Arc<std::sync::Mutex<PoolBuf>>,
    /// How much of the range has arrived (chunks come in order).
    prefix: usize,
    out: mpsc::Sender<Outbound>,
}

fn lock(m: &std::sync::Mutex<PoolBuf>) -> std::sync::MutexGuard<'_, PoolBuf> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Receives every sender's values of the job's range and averages them **part by part**: as
/// soon as every present sender has delivered a part (of `chunk_bytes` on the wire), its mean is
/// computed and each sender gets its delta back while the next parts are still arriving, so the
/// return traffic overlaps the send traffic. Parts wait until every expected sender has shown up
/// (or the no-show time passed). A sender that fails is left out of the parts not finished yet;
/// each part's contributors are exactly the senders (and this peer) whose data is in its mean.
async fn reduce_span(
    round: Arc<Round>,
    job: ReduceJob,
    mut rx: mpsc::Receiver<IncomingSender>,
) -> Reduced {
    let cfg = &round.shared.config;
    let me = round.me;
    let ReduceJob {
        range,
        mut allowed,
        mut expected,
        repair,
    } = job;
    // No-shows count as failed only in phase 1, where every sender owes us its part.
    let phase1 = repair.is_none();
    let len = range.len();
    let part_len = starling_compression::elements_per_chunk(cfg.codec, cfg.chunk_bytes)
        .unwrap_or(1 << 16)
        .max(1);
    let parts: Vec<Range<usize>> = (0..len)
        .step_by(part_len)
        .map(|s| s..(s + part_len).min(len))
        .collect();
    let i_contribute = round.modes[me as usize] != AveragingMode::Aux;
    let mut senders: BTreeMap<u32, Present> = BTreeMap::new();
    let mut receivers: Vec<JoinHandle<()>> = Vec::new();
    let mut writers: Vec<(u32, JoinHandle<bool>)> = Vec::new();
    let (ev_tx, mut ev_rx) = mpsc::channel::<Inbound>(4 * round.peers.len() + 16);
    // Each part is cleared and summed into before it is read.
    let mut values = round.shared.pool.take_dirty(len);
    let mut segments: Vec<Segment> = Vec::new();
    let mut failed: Vec<u32> = Vec::new();
    let mut next = 0usize;
    // A sender must open its stream within the time to set one up plus `sender_timeout`.
    let no_show = (Instant::now() + cfg.request_timeout + cfg.sender_timeout).min(round.deadline);
    // Fault::WhileReturning: only these senders get results, then this peer crashes.
    let mut serve_only: Option<HashSet<u32>> = None;

    'round: loop {
        // Finish every part that every present sender has delivered.
        while next < parts.len()
            && expected.is_empty()
            && senders.values().all(|s| s.prefix >= parts[next].end)
        {
            if next == 0 && phase1 {
                match cfg.fault {
                    Some(Fault::WhileReducing) => {
                        round.shared.node.shutdown().await;
                        break 'round;
                    }
                    Some(Fault::WhileReturning(n)) => {
                        serve_only = Some(senders.keys().take(n).copied().collect());
                    }
                    _ => {}
                }
            }
            // Late senders can no longer join: they would miss the finished parts.
            allowed.clear();
            let part = parts[next].clone();
            next += 1;
            let mut contributors: Vec<u32> = senders.keys().copied().collect();
            if i_contribute {
                contributors.push(me);
            }
            if contributors.is_empty() {
                continue; // nobody's data: the part stays local
            }
            contributors.sort_unstable();
            let mut total_weight: f64 = senders.values().map(|s| s.weight).sum();
            if i_contribute {
                total_weight += round.weight;
            }
            let scale = |w: f64| {
                if total_weight > 0.0 {
                    (w / total_weight) as f32
                } else {
                    1.0 / contributors.len() as f32
                }
            };
            let mean = &mut values[part.clone()];
            mean.fill(0.0);
            if i_contribute {
                let k = scale(round.weight);
                let mine = &round.flat[range.start + part.start..range.start + part.end];
                mean.iter_mut().zip(mine).for_each(|(m, x)| *m += k * x);
            }
            for s in senders.values() {
                let k = scale(s.weight);
                let st = lock(&s.staging);
                mean.iter_mut()
                    .zip(&st[part.clone()])
                    .for_each(|(m, x)| *m += k * x);
            }
            let abs = range.start + part.start..range.start + part.end;
            match segments.last_mut() {
                Some(last) if last.1 == contributors && last.0.end == abs.start => {
                    last.0.end = abs.end
                }
                _ => segments.push((abs, contributors.clone())),
            }
            let contributors = Arc::new(contributors);
            let mut gone = Vec::new();
            for (&sender, s) in &senders {
                if serve_only
                    .as_ref()
                    .is_some_and(|only| !only.contains(&sender))
                {
                    continue;
                }
                let mut delta = round.shared.pool.take_dirty(part.len());
                {
                    let st = lock(&s.staging);
                    delta
                        .iter_mut()
                        .zip(mean.iter().zip(&st[part.clone()]))
                        .for_each(|(d, (m, x))| *d = m - x);
                }
                let msg = Outbound::Part {
                    start: part.start,
                    contributors: contributors.clone(),
                    delta,
                };
                if !matches!(
                    timeout(cfg.sender_timeout, s.out.send(msg)).await,
                    Ok(Ok(()))
                ) {
                    gone.push(sender);
                }
            }
            // A sender that cannot take its results back has failed (its data still counts in
            // the parts finished so far, as their contributor lists say).
            for sender in gone {
                tracing::debug!(sender, "a sender stopped taking results");
                senders.remove(&sender);
                failed.push(sender);
            }
        }
        if next == parts.len() {
            break;
        }
        tokio::select! {
            Some(inc) = rx.recv() => {
                let IncomingSender { peer, hello, mut stream } = inc;
                let (sender, weight, start, hlen) = match (hello, repair) {
                    (ReduceMsg::Hello { sender, weight, start, len, .. }, None) => (sender, weight, start, len),
                    (ReduceMsg::RepairHello { sender, weight, failed, start, len, .. }, Some(f)) if failed == f => {
                        (sender, weight, start, len)
                    }
                    _ => continue,
                };
                let valid = (sender as usize) < round.peers.len()
                    && round.peers[sender as usize] == peer
                    && allowed.contains(&sender)
                    && start == range.start as u64
                    && hlen == len as u64
                    && weight.is_finite()
                    && weight >= 0.0;
                if !valid {
                    tracing::debug!(%peer, "refused a sender with a bad or late hello");
                    let _ = timeout(cfg.request_timeout, write_control(&mut stream, &ReduceMsg::Excluded("bad or late hello".into()))).await;
                    continue;
                }
                if !matches!(timeout(cfg.request_timeout, write_control(&mut stream, &ReduceMsg::Ready)).await, Ok(Ok(_))) {
                    continue; // the sender retries on a new stream
                }
                allowed.remove(&sender);
                expected.remove(&sender);
                let (rd, wr) = stream.split();
                // Read only below the sender's delivered prefix.
                let staging = Arc::new(std::sync::Mutex::new(round.shared.pool.take_dirty(len)));
                let (out_tx, out_rx) = mpsc::channel(4);
                receivers.push(tokio::spawn(receive_part(round.clone(), rd, sender, len, staging.clone(), ev_tx.clone())));
                writers.push((sender, tokio::spawn(write_results(round.clone(), wr, out_rx))));
                senders.insert(sender, Present { weight, staging, prefix: 0, out: out_tx });
            }
            Some(ev) = ev_rx.recv() => match ev {
                Inbound::Progress { sender, prefix } => {
                    if let Some(s) = senders.get_mut(&sender) {
                        s.prefix = prefix;
                    }
                }
                Inbound::Failed { sender, why } => {
                    if let Some(s) = senders.remove(&sender) {
                        tracing::debug!(sender, "excluded a sender: {why}");
                        failed.push(sender);
                        let _ = s.out.try_send(Outbound::Excluded(why));
                    }
                }
            },
            _ = sleep_until(no_show), if !expected.is_empty() => {
                let gone = expected.drain();
                if phase1 {
                    failed.extend(gone);
                }
            }
            _ = sleep_until(round.deadline) => {
                let gone = expected.drain();
                if phase1 {
                    failed.extend(gone);
                }
                break;
            }
        }
    }
    // Close every result stream (writers finish with `ResultDone`) and wait for them.
    let present: HashSet<u32> = senders.keys().copied().collect();
    drop(senders);
    for (sender, w) in writers {
        let served = serve_only
            .as_ref()
            .is_none_or(|only| only.contains(&sender));
        let ok = matches!(timeout_at(round.deadline, w).await, Ok(Ok(true)));
        if !ok && served && present.contains(&sender) {
            tracing::debug!(sender, "could not return the result");
            failed.push(sender);
        }
    }
    for r in receivers {
        r.abort();
    }
    if serve_only.is_some() {
        // Let the served results leave before the connections drop.
        tokio::time::sleep(FAULT_FLUSH_GRACE).await;
        round.shared.node.shutdown().await;
    }
    failed.sort_unstable();
    failed.dedup();
    Reduced {
        values,
        segments,
        failed,
    }
}

/// Reads one sender's chunks (in order) into its staging buffer, reporting progress, until its
/// `SendDone`; at most `sender_timeout` between frames.
async fn receive_part<R: futures::AsyncRead + Unpin>(
    round: Arc<Round>,
    mut rd: R,
    sender: u32,
    len: usize,
    staging: Arc<std::sync::Mutex<PoolBuf>>,
    events: mpsc::Sender<Inbound>,
) {
    let cfg = &round.shared.config;
    let mut prefix = 0usize;
    let mut decoder = starling_compression::Decoder::new(decode_options(len));
    let mut chunk = Vec::new();
    let why = loop {
        let read = timeout(
            cfg.sender_timeout,
            read_frame_into::<_, ReduceMsg>(&mut rd, cfg.max_frame_bytes, &mut chunk),
        )
        .await;
        let (frame, n) = match read {
            Err(_) => break "sender stalled".to_string(),
            Ok(Err(e)) => break e.to_string(),
            Ok(Ok(f)) => f,
        };
        round
            .counters
            .received
            .fetch_add(n as u64, Ordering::Relaxed);
        match frame {
            Frame::Data(()) => {
                let header = match ChunkHeader::parse(&chunk) {
                    Ok(h) => h,
                    Err(e) => break e.to_string(),
                };
                let (at, count) = (header.offset as usize, header.count);
                if header.total != len as u64 || at != prefix || count == 0 || at + count > len {
                    break "chunk out of order or out of range".to_string();
                }
                let decoded = decoder.decode_into(&chunk, &mut lock(&staging)[at..at + count]);
                if let Err(e) = decoded {
                    break e.to_string();
                }
                prefix += count;
                if events
                    .send(Inbound::Progress { sender, prefix })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Frame::Control(ReduceMsg::SendDone) if prefix == len => return,
            Frame::Control(ReduceMsg::SendDone) => break "sender's part is incomplete".to_string(),
            Frame::Control(other) => break format!("unexpected message {other:?}"),
        }
    };
    let _ = events.send(Inbound::Failed { sender, why }).await;
}

/// Writes a sender's results as the reducer finishes parts: `Result` and the delta chunks of
/// each part, then `ResultDone` and a clean close. Returns whether everything went out.
async fn write_results<W: futures::AsyncWrite + Unpin>(
    round: Arc<Round>,
    mut wr: W,
    mut parts: mpsc::Receiver<Outbound>,
) -> bool {
    let cfg = &round.shared.config;
    let mut sent = 0usize;
    let result = async {
        while let Some(out) = parts.recv().await {
            match out {
                Outbound::Part {
                    start,
                    contributors,
                    delta,
                } => {
                    let head = ReduceMsg::Result {
                        start: start as u64,
                        len: delta.len() as u64,
                        contributors: contributors.to_vec(),
                    };
                    sent += write_control(&mut wr, &head).await?;
                    let mut chunks = SpanChunks::new(cfg.codec, &delta, cfg.chunk_bytes)?;
                    while let Some(chunk) = chunks.next_chunk() {
                        sent += write_chunk(&mut wr, &chunk?).await?;
                    }
                    // The sender may be waiting for exactly this part.
                    futures::AsyncWriteExt::flush(&mut wr).await?;
                }
                Outbound::Excluded(why) => {
                    sent += write_control(&mut wr, &ReduceMsg::Excluded(why)).await?;
                    futures::AsyncWriteExt::close(&mut wr).await?;
                    return Ok(false);
                }
            }
        }
        sent += write_control(&mut wr, &ReduceMsg::ResultDone).await?;
        // Close (FIN) rather than drop (RST), so the last frames are never discarded in flight.
        futures::AsyncWriteExt::close(&mut wr).await?;
        Ok::<_, AveragerError>(true)
    }
    .await;
    round
        .counters
        .sent
        .fetch_add(sent as u64, Ordering::Relaxed);
    matches!(result, Ok(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AveragingMode::{Client, Node};

    #[test]
    fn repair_plan_splits_the_failed_span_over_survivors_only() {
        let cfg = AveragerConfig::new("plan");
        let ranges = vec![0..25, 25..50, 50..50, 50..100];
        let bw = [1e8; 4];
        let modes = [Node, Node, Client, Node];
        let none = BTreeSet::new();
        // Member 3 failed: its span goes to the two other reducers (not the client), in halves.
        let plan = repair_plan(&cfg, &ranges, &bw, &modes, 3, &none);
        assert_eq!(plan, vec![(0, 50..75), (1, 75..100)]);
        assert_eq!(plan, repair_plan(&cfg, &ranges, &bw, &modes, 3, &none));
        // A reducer seen failing too gets nothing.
        let down = BTreeSet::from([3, 1]);
        assert_eq!(
            repair_plan(&cfg, &ranges, &bw, &modes, 3, &down),
            vec![(0, 50..100)]
        );
        // Nobody left, an empty span, or an index out of range: no plan.
        let all = BTreeSet::from([0, 1]);
        assert!(repair_plan(&cfg, &ranges, &bw, &modes, 3, &all).is_empty());
        assert!(repair_plan(&cfg, &ranges, &bw, &modes, 2, &none).is_empty());
        assert!(repair_plan(&cfg, &ranges, &bw, &modes, 9, &none).is_empty());
        // Parts follow bandwidth like the round's spans.
        let bw = [3e8, 1e8, 1e8, 1e8];
        let plan = repair_plan(&cfg, &ranges, &bw, &modes, 3, &none);
        assert_eq!(plan.first().map(|p| p.1.start), Some(50));
        assert_eq!(plan.last().map(|p| p.1.end), Some(100));
        assert!(plan[0].1.len() > plan[1].1.len(), "{plan:?}");
    }

    #[test]
    fn transfer_estimate_never_panics() {
        assert_eq!(transfer_estimate(1000, 8000.0), Duration::from_secs(1));
        assert_eq!(transfer_estimate(1000, 0.0), Duration::MAX);
        assert_eq!(transfer_estimate(1000, f64::NAN), Duration::MAX);
    }
}
