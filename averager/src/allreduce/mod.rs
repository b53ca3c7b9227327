//! The butterfly all-reduce of one formed group (explained in the crate docs, "The all-reduce"
//! and "Re-delegation").
//!
//! - [`plan`]: who reduces what (span fractions, repair plans); pure.
//! - [`send`]: a sender's side of one span: stream the values, read back the deltas.
//! - [`reduce`]: a reducer's side: receive every sender's values, average part by part,
//!   return deltas; [`part::PartReducer`] holds the arithmetic, with no I/O.
//! - [`repair`]: phase 2, re-delegating the spans of reducers that failed.
//!
//! [`run_allreduce`] runs both sides for this peer and assembles the [`Outcome`]; it returns
//! the background repair server for the caller to keep instead of installing it anywhere.

mod audit;
mod gone;
mod part;
mod plan;
mod reduce;
mod repair;
mod rogue;
mod send;

use std::collections::{BTreeSet, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use starling_node::{Multiaddr, PeerId};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument;

use crate::config::{AveragerConfig, AveragingMode, Fault};
use crate::group::Group;
use crate::partition::rotated_spans;
use crate::pool::{BufPool, PoolBuf};
use crate::router::{Registration, RoundQueues, Router};
use crate::transport::Transport;
use crate::verify::{Banned, Signer, Transcripts};
use crate::wire::MemberIdx;
use crate::{AuditOutcome, AuditReport, SpanOutcome, SpanReport};
use starling_node::lock::lock;

use gone::{watch_down, Gone};
use reduce::{reduce_span, ReduceJob};
use repair::Repair;
use send::{send_span, SendKind};

/// Parts a span is cut into, at least, for the reducer's pipeline (see [`chunk_bytes_for`]).
const PARTS_PER_SPAN: usize = 4;
/// Smallest part worth its own frame and result message.
const MIN_PART_BYTES: usize = 64 * 1024;

/// The chunk size (bytes on the wire) for a span of `len` elements: `chunk_bytes`, or less, so
/// that the span is at least [`PARTS_PER_SPAN`] chunks (and parts) of at least
/// [`MIN_PART_BYTES`]. The reducer averages part by part and returns each part while later ones
/// still arrive; a span of a single chunk would leave nothing to overlap, and a small
/// all-reduce (10^6 values over four peers: one 1 MiB chunk per span) would pay both phases
/// one after the other. Sender and reducer compute it from the same range, so their chunks and
/// parts line up.
pub(crate) fn chunk_bytes_for(cfg: &AveragerConfig, len: usize) -> usize {
    let span_bytes = cfg
        .codec
        .frame_len(len)
        .unwrap_or_else(|| len.saturating_mul(4));
    (span_bytes / PARTS_PER_SPAN).clamp(MIN_PART_BYTES.min(cfg.chunk_bytes), cfg.chunk_bytes)
}

/// Contributors of a contiguous run of a span: `(absolute range, member indices)`.
pub(crate) type Segment = (Range<usize>, Vec<MemberIdx>);

/// What a round needs from its averager.
#[derive(Clone)]
pub(crate) struct RoundEnv {
    pub config: Arc<AveragerConfig>,
    pub transport: Transport,
    pub router: Router,
    pub pool: Arc<BufPool>,
    /// This peer's bandwidth estimate (bytes/s), for transfer-time estimates.
    pub bandwidth: f64,
    /// Error feedback is on: the flattened vector is the corrected contribution, and every
    /// span sent to a reducer with a lossy codec comes back with its residual.
    pub feedback: bool,
    /// Signs this peer's seals when the group verifies (`AveragerConfig::verify` > 0).
    pub signer: Option<Signer>,
    /// Where this peer's reductions keep their transcripts for reveals.
    pub transcripts: Transcripts,
    /// Peers proven to have lied: refused as senders, and where this round catches a reducer.
    pub banned: Banned,
    /// Reducers return each part's result itself, not a delta from what the sender sent, so
    /// that every member holds the same bits: always with the exact codec; with an
    /// [elementwise](starling_compression::Codec::is_elementwise) lossy codec (compressed
    /// rounds ask for it) the reducer first rounds the result through the codec, its own copy
    /// included. Verified rounds never ask for it with a lossy codec (a check recomputes the
    /// unrounded mean).
    pub values_back: bool,
}

/// What a round produced for the local peer.
pub(crate) struct Outcome {
    /// New values of the averaged ranges of the flattened vector; the rest keeps its values.
    pub patches: Vec<(Range<usize>, PoolBuf)>,
    /// With error feedback: for the patches whose values went to a reducer quantized, what the
    /// reducer did not see (corrected contribution minus its decoded copy). Patches not listed
    /// here were averaged from this peer's exact values.
    pub residuals: Vec<(Range<usize>, PoolBuf)>,
    pub group: Vec<PeerId>,
    pub spans: Vec<SpanReport>,
    pub failed_peers: Vec<PeerId>,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Span transfers sent over a fast lane.
    pub fast_lanes: usize,
    /// Of those, transfers on a lane kept open from an earlier round.
    pub warm_lanes: usize,
    /// This peer's upload rate (bytes/s) as seen on this round's streams, if enough was sent.
    pub measured_bandwidth: Option<f64>,
    /// The finished round, still serving other members' re-delegated parts for a while (see
    /// the crate docs); the caller keeps at most one and aborts it when the next round starts.
    pub repair_server: Option<JoinHandle<()>>,
    /// This peer's check of another reducer, when the group verifies and it checked one.
    pub audit: Option<AuditReport>,
}

impl Outcome {
    /// A round in which nothing was averaged.
    fn nothing(group: Vec<PeerId>) -> Self {
        Outcome {
            patches: vec![],
            residuals: vec![],
            group,
            spans: vec![],
            failed_peers: vec![],
            bytes_sent: 0,
            bytes_received: 0,
            fast_lanes: 0,
            warm_lanes: 0,
            measured_bandwidth: None,
            repair_server: None,
            audit: None,
        }
    }
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    fast: AtomicU64,
    /// Of those, transfers on a lane kept from an earlier round.
    warm: AtomicU64,
    /// Phase 1's uploads, for this peer's bandwidth estimate.
    upload: Mutex<Upload>,
}

/// Rounds that sent less than this say too little about bandwidth to be measured: a few
/// hundred KiB vanish into socket buffers at once, and a small round's time is mostly round
/// trips (on 500 Mbit/s links, 1e6 u8 values measured up to 2x apart between equal peers).
const MIN_MEASURED_BYTES: usize = 2 << 20;

/// What phase 1's concurrent streams uploaded: each stream's bytes and send time. Two readings
/// of the uplink, and the larger counts:
/// - all bytes over the whole window, first start to last end (streams share the uplink, so
///   this is its rate; per-stream rates summed varied 3x between peers on identical links);
/// - the median stream's rate times the number of streams: robust when one stream is held up
///   elsewhere (a reducer whose own uplink is saturated returns ACKs late), which stretches the
///   window and made a 400 Mbit/s peer read as 70 Mbit/s beside a 20 Mbit/s one.
///
/// Both are what got through, so neither exceeds the uplink by much; the larger is the better
/// bound.
#[derive(Default)]
struct Upload {
    streams: Vec<(usize, Instant, Instant)>,
}

impl Upload {
    fn add(&mut self, bytes: usize, start: Instant, end: Instant) {
        self.streams.push((bytes, start, end));
    }

    /// Bytes per second, if enough was sent over a measurable time.
    fn rate(&self) -> Option<f64> {
        let bytes: usize = self.streams.iter().map(|s| s.0).sum();
        let first = self.streams.iter().map(|s| s.1).min()?;
        let last = self.streams.iter().map(|s| s.2).max()?;
        let secs = (last - first).as_secs_f64();
        if bytes < MIN_MEASURED_BYTES || secs <= 0.0 {
            return None;
        }
        let mut rates: Vec<f64> = self
            .streams
            .iter()
            .filter(|s| s.2 > s.1)
            .map(|s| s.0 as f64 / (s.2 - s.1).as_secs_f64())
            .collect();
        rates.sort_by(f64::total_cmp);
        let median = rates.get(rates.len() / 2).copied().unwrap_or(0.0);
        Some((bytes as f64 / secs).max(median * self.streams.len() as f64))
    }
}

/// Everything a round's tasks need, shared between them.
struct Round {
    env: RoundEnv,
    round_id: u64,
    me: MemberIdx,
    weight: f64,
    peers: Vec<PeerId>,
    addrs: Vec<Vec<Multiaddr>>,
    modes: Vec<AveragingMode>,
    /// Declared bandwidths, as the group's member list gives them (the repair plan's input).
    bandwidths: Vec<f64>,
    /// Each member's span.
    ranges: Vec<Range<usize>>,
    flat: Arc<PoolBuf>,
    counters: Counters,
    deadline: Instant,
    /// Members this peer could not reach at all as reducers (every dial failed): gone, so its
    /// own reduction stops waiting for their parts (see [`Gone`]).
    gone: Gone,
}

impl Round {
    fn config(&self) -> &AveragerConfig {
        &self.env.config
    }

    /// The members that send (not `Aux`), except those listed.
    fn senders_except(&self, except: &[MemberIdx]) -> HashSet<MemberIdx> {
        MemberIdx::all(self.peers.len())
            .filter(|i| !except.contains(i) && self.modes[i.get()] != AveragingMode::Aux)
            .collect()
    }

    fn peer(&self, i: MemberIdx) -> PeerId {
        self.peers[i.get()]
    }

    /// These members' peer ids as bytes, in the given order (what seals sign).
    fn peer_bytes(&self, members: &[MemberIdx]) -> Vec<Vec<u8>> {
        members.iter().map(|&m| self.peer(m).to_bytes()).collect()
    }

    /// Crashes this peer (its node shuts down) if the configured fault is `fault`.
    async fn crash_if(&self, fault: Fault) -> bool {
        if self.config().fault() == Some(fault) {
            self.env.transport.node().shutdown().await;
            return true;
        }
        false
    }
}

/// A spawned task that is aborted when this handle drops, so a step cancelled half-way (its
/// node died, its future was dropped) leaves nothing running.
struct Task<T>(JoinHandle<T>);

impl<T> Drop for Task<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T: Send + 'static> Task<T> {
    fn spawn(fut: impl std::future::Future<Output = T> + Send + 'static) -> Self {
        Task(tokio::spawn(fut.in_current_span()))
    }
}

impl<T> std::future::Future for Task<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}

pub(crate) fn kept(reason: impl Into<String>) -> SpanOutcome {
    SpanOutcome::KeptLocal {
        reason: reason.into(),
    }
}

/// Runs the all-reduce for `group` over the flattened local vector, inside a `round{id, me}`
/// span.
pub(crate) fn run_allreduce(
    env: RoundEnv,
    group: &Group,
    flat: PoolBuf,
    weight: f64,
    deadline: Instant,
) -> impl std::future::Future<Output = Outcome> + '_ {
    let span = tracing::debug_span!(
        "round",
        id = %format_args!("{:016x}", group.round_id),
        me = group.my_index.0
    );
    run(env, group, flat, weight, deadline).instrument(span)
}

/// [`run_allreduce`] without its span.
async fn run(
    env: RoundEnv,
    group: &Group,
    flat: PoolBuf,
    weight: f64,
    deadline: Instant,
) -> Outcome {
    let t_start = Instant::now();
    tracing::debug!("round starts");
    let n = group.members.len();
    let peers: Vec<PeerId> = group.members.iter().map(|m| m.peer).collect();
    let modes: Vec<AveragingMode> = group.members.iter().map(|m| m.mode).collect();
    let bandwidths: Vec<f64> = group.members.iter().map(|m| m.bandwidth).collect();
    let Some(fractions) = plan::fractions(&env.config, &bandwidths, &modes) else {
        // Nobody may reduce (all clients): nothing to do, everyone keeps its values.
        return Outcome::nothing(peers);
    };
    // Laid out from a member the round's id picks (every member derives the same), so that a
    // group re-forming in the same order moves each member's span from round to round.
    let ranges = rotated_spans(
        flat.len(),
        &fractions,
        (group.round_id % n.max(1) as u64) as usize,
    );
    let (registration, queues) = env.router.register_round(group.round_id, n);
    let RoundQueues {
        senders,
        repairs: mut repair_rx,
        verdicts: mut verdict_rx,
    } = queues;
    let me = group.my_index;
    let round = Arc::new(Round {
        env,
        round_id: group.round_id,
        me,
        weight,
        addrs: group.members.iter().map(|m| m.addrs.clone()).collect(),
        peers: peers.clone(),
        modes: modes.clone(),
        bandwidths,
        ranges: ranges.clone(),
        flat: Arc::new(flat),
        counters: Counters::default(),
        deadline,
        gone: Gone::default(),
    });
    round.crash_if(Fault::BeforeSending).await;
    // Stops with the round (the handle aborts it when dropped).
    let _watch = Task::spawn(watch_down(round.clone()));

    let sends = start_sends(&round);
    // Reducer: our own span.
    let my_range = ranges[me.get()].clone();
    let reduced = if my_range.is_empty() {
        None
    } else {
        let job = ReduceJob {
            range: my_range.clone(),
            allowed: round.senders_except(&[me]),
            expected: round.senders_except(&[me]),
            repair: None,
        };
        Some(reduce_span(round.clone(), job, senders).await)
    };
    tracing::debug!(elapsed = ?t_start.elapsed(), "own span reduced");

    let mut phase1 = Phase1::default();
    if let Some(r) = reduced {
        phase1.own_span(&round, &my_range, r);
    }
    for (j, task) in sends {
        phase1.sent_span(&round, j, task.await);
    }
    // A verified round is applied only once the other members' checks are in (see
    // `verify`): this member's verdict goes to every member it has not seen fail.
    let verifies = round.env.signer.is_some();
    let verdicts_until = verifies.then(|| {
        audit::send_verdicts(&round, phase1.accusation.take(), &phase1.failed);
        audit::verdict_wait(&round, t_start.elapsed())
    });
    let Phase1 {
        mut patches,
        mut residuals,
        mut reports,
        failed,
        down,
        lost,
        audit,
        accusation: _,
    } = phase1;
    tracing::debug!(elapsed = ?t_start.elapsed(), "sent spans returned");
    // Phase 2: repair what this peer lost; then, for a while, serve the parts of peers that
    // lost a span this peer received (in the background: the caller does not wait for it).
    let mut repair = Repair::new(round.clone(), down, failed);
    if !lost.is_empty() {
        repair.start(lost);
        repair.drive(&mut repair_rx, None).await;
    }
    patches.append(&mut repair.patches);
    residuals.append(&mut repair.residuals);
    reports.append(&mut repair.reports);
    let failed = repair.failed.clone();
    if let Some(until) = verdicts_until {
        let verdicts = audit::collect_verdicts(&round, &mut verdict_rx, &failed, until).await;
        for (k, accuser, evidence) in verdicts.accusations {
            let why = format!(
                "not applied: member {} caught its reducer lying ({evidence})",
                round.peer(accuser)
            );
            withhold_span(&round, k, &why, &mut patches, &mut residuals, &mut reports);
        }
        if !verdicts.missing.is_empty() {
            tracing::debug!(missing = ?verdicts.missing, "applied without some members' verdicts");
        }
    }
    drop(verdict_rx);
    let repair_server = (!my_range.is_empty())
        .then(|| serve_repairs(repair, repair_rx, registration))
        .flatten();

    reports.sort_by_key(|r| r.range.start);
    tracing::debug!(elapsed = ?t_start.elapsed(), "round assembled");
    let mut failed: Vec<PeerId> = failed.into_iter().map(|f| round.peer(f)).collect();
    failed.sort();
    failed.dedup();
    let counters = &round.counters;
    let measured_bandwidth = lock(&counters.upload).rate();
    Outcome {
        patches,
        residuals,
        group: peers,
        spans: reports,
        failed_peers: failed,
        bytes_sent: counters.sent.load(Ordering::Relaxed),
        bytes_received: counters.received.load(Ordering::Relaxed),
        fast_lanes: counters.fast.load(Ordering::Relaxed) as usize,
        warm_lanes: counters.warm.load(Ordering::Relaxed) as usize,
        measured_bandwidth,
        repair_server,
        audit,
    }
}

/// Drops what the round gave for reducer `k`'s span (another member proved it lied there):
/// this peer keeps its own values on it, and its reports say why.
fn withhold_span(
    round: &Round,
    k: MemberIdx,
    why: &str,
    patches: &mut Vec<(Range<usize>, PoolBuf)>,
    residuals: &mut Vec<(Range<usize>, PoolBuf)>,
    reports: &mut Vec<SpanReport>,
) {
    let span = &round.ranges[k.get()];
    let inside = |r: &Range<usize>| r.start >= span.start && r.end <= span.end;
    patches.retain(|(r, _)| !inside(r));
    residuals.retain(|(r, _)| !inside(r));
    let reducer = round.peer(k);
    reports.retain(|r| !(r.reducer == reducer && inside(&r.range)));
    reports.push(SpanReport {
        reducer,
        range: span.clone(),
        outcome: kept(why),
    });
}

/// After the round, a peer that reduced keeps serving other members' re-delegated parts in the
/// background for `request_timeout` (if the deadline leaves `repair_min_time`), holding the
/// round's routes until then.
fn serve_repairs(
    mut repair: Repair,
    mut rx: tokio::sync::mpsc::Receiver<crate::router::IncomingSender>,
    registration: Registration,
) -> Option<JoinHandle<()>> {
    let round = repair.round().clone();
    let cfg = round.config();
    let left = round.deadline.saturating_duration_since(Instant::now());
    if left < cfg.repair_min_time {
        return None;
    }
    let until = (Instant::now() + cfg.request_timeout).min(round.deadline);
    let serve = async move {
        repair.drive(&mut rx, Some(until)).await;
        drop(repair);
        drop(registration);
    };
    Some(tokio::spawn(serve.in_current_span()))
}

/// A phase-1 send to one reducer, and this peer's check of that reducer if it checks it.
type SendTask = Task<(send::Sent, Option<audit::Verdict>)>;

/// Phase 1, sending side: one task per remote reducer with a non-empty span (none for an `Aux`
/// peer, which sends nothing).
///
/// When the group verifies, the task of the reducer this peer checks (see [`audit::choose`])
/// goes on to check one block of it as soon as it is back, beside the rest of the round.
fn start_sends(round: &Arc<Round>) -> Vec<(MemberIdx, SendTask)> {
    let me = round.me;
    if round.modes[me.get()] == AveragingMode::Aux
        || round.config().fault() == Some(Fault::SilentReducer)
    {
        return Vec::new();
    }
    let checked = audit::choose(round);
    MemberIdx::all(round.peers.len())
        .filter(|&j| j != me && !round.ranges[j.get()].is_empty())
        .map(|j| {
            let (round, range) = (round.clone(), round.ranges[j.get()].clone());
            let task = Task::spawn(async move {
                let sent = round
                    .gone
                    .unless_gone(
                        j,
                        send_span(&round, j, range.clone(), SendKind::Span, checked == Some(j)),
                    )
                    .await
                    .unwrap_or_else(|| Err(send::SendFail::down()));
                if sent.as_ref().is_err_and(|e| e.unreachable) {
                    // Its part will not come either: this peer's reduction stops waiting.
                    round.gone.insert(j);
                }
                let verdict = match &sent {
                    Ok((_, values, _, sealed)) if checked == Some(j) => {
                        Some(audit::check_span(&round, j, sealed, range.start, values).await)
                    }
                    _ => None,
                };
                (sent, verdict)
            });
            (j, task)
        })
        .collect()
}

/// What the first phase left this peer with.
#[derive(Default)]
struct Phase1 {
    /// New values of the ranges averaged so far.
    patches: Vec<(Range<usize>, PoolBuf)>,
    /// Error feedback: residuals of the patches sent quantized (see [`Outcome::residuals`]).
    residuals: Vec<(Range<usize>, PoolBuf)>,
    reports: Vec<SpanReport>,
    /// Members seen failing in any role.
    failed: HashSet<MemberIdx>,
    /// Reducers seen failing (the repair plan's input).
    down: BTreeSet<MemberIdx>,
    /// Spans whose reducer failed, with why: phase 2 re-delegates them.
    lost: Vec<(MemberIdx, String)>,
    /// This peer's check of another reducer, if it checked one this round.
    audit: Option<AuditReport>,
    /// The evidence, if that check caught the reducer lying (sent to the other members).
    accusation: Option<Box<crate::verify::Evidence>>,
}

impl Phase1 {
    /// Takes this peer's own reduced span.
    fn own_span(&mut self, round: &Round, my_range: &Range<usize>, r: reduce::Reduced) {
        self.failed.extend(&r.failed);
        self.reports.extend(segment_reports(
            round,
            round.me,
            my_range,
            &r.segments,
            |c| SpanOutcome::Averaged { contributors: c },
        ));
        if r.segments.len() == 1 && r.segments[0].0 == *my_range {
            self.patches.push((my_range.clone(), r.values));
        } else {
            for (seg, _) in &r.segments {
                let local = seg.start - my_range.start..seg.end - my_range.start;
                self.patches
                    .push((seg.clone(), round.env.pool.copy_of(&r.values[local])));
            }
        }
    }

    /// What a check that was not clean means: a caught liar is refused and the evidence
    /// published; a reducer seen sending other values than it sealed is refused here.
    fn judged(&mut self, round: &Round, j: MemberIdx, verdict: audit::Verdict) -> AuditOutcome {
        let reducer = round.peer(j);
        match verdict {
            audit::Verdict::Clean => AuditOutcome::Clean,
            audit::Verdict::Caught(evidence) => {
                tracing::warn!("caught a lying reducer: {evidence}");
                round.env.banned.insert(&reducer);
                crate::verify::publish(
                    round.env.transport.node(),
                    &round.config().prefix,
                    &evidence,
                );
                let what = evidence.to_string();
                self.accusation = Some(evidence);
                AuditOutcome::Caught(what)
            }
            audit::Verdict::Unanswered(why) => {
                tracing::info!(%reducer, "a reducer's result could not be checked: {why}");
                AuditOutcome::Unanswered(why)
            }
            audit::Verdict::SentOtherThanSealed => {
                tracing::warn!(%reducer, "a reducer sent other values than it sealed; refusing it here");
                round.env.banned.insert(&reducer);
                AuditOutcome::Unanswered(
                    "the reducer sent other values than it sealed (refused here; not provable to others)".into(),
                )
            }
        }
    }

    /// Takes what sending span `j` to its reducer gave, and this peer's check of that span if
    /// it checked it.
    fn sent_span(
        &mut self,
        round: &Round,
        j: MemberIdx,
        result: Result<(send::Sent, Option<audit::Verdict>), tokio::task::JoinError>,
    ) {
        let range = round.ranges[j.get()].clone();
        let outcome = match result {
            Ok((_, Some(verdict))) if !matches!(verdict, audit::Verdict::Clean) => {
                // Checked and not clean: nothing of the span is applied.
                let outcome = self.judged(round, j, verdict);
                let why = match &outcome {
                    AuditOutcome::Caught(what) | AuditOutcome::Unanswered(what) => {
                        format!("not applied: {what}")
                    }
                    AuditOutcome::Clean => "not applied".to_string(),
                };
                self.audit = Some(AuditReport {
                    reducer: round.peer(j),
                    outcome,
                });
                kept(why)
            }
            Ok((Ok((segments, values, residual, _)), verdict)) => {
                if verdict.is_some() {
                    self.audit = Some(AuditReport {
                        reducer: round.peer(j),
                        outcome: AuditOutcome::Clean,
                    });
                }
                self.patches.push((range.clone(), values));
                if let Some(residual) = residual {
                    self.residuals.push((range.clone(), residual));
                }
                self.reports
                    .extend(segment_reports(round, j, &range, &segments, |c| {
                        SpanOutcome::Averaged { contributors: c }
                    }));
                return;
            }
            Ok((Err(fail), _)) => {
                self.failed.insert(j);
                if fail.reducer_failed {
                    self.down.insert(j);
                    self.lost.push((j, fail.reason));
                    return;
                }
                kept(fail.reason)
            }
            Err(e) => kept(format!("sender task failed: {e}")),
        };
        self.reports.push(SpanReport {
            reducer: round.peer(j),
            range,
            outcome,
        });
    }
}

/// One report per run of `range` with its contributors (`outcome` builds the averaged
/// outcome from them); whatever the runs leave uncovered was not averaged and kept its values.
fn segment_reports(
    round: &Round,
    reducer: MemberIdx,
    range: &Range<usize>,
    segments: &[Segment],
    outcome: impl Fn(Vec<PeerId>) -> SpanOutcome,
) -> Vec<SpanReport> {
    let reducer = round.peer(reducer);
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
            outcome: outcome(contributors.iter().map(|c| round.peer(*c)).collect()),
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

#[cfg(test)]
mod upload_tests {
    use super::*;

    #[test]
    fn one_held_up_stream_does_not_hide_the_uplink() {
        let t = Instant::now();
        let at = |ms: u64| t + std::time::Duration::from_millis(ms);
        let mut u = Upload::default();
        // Three 1 MB streams; two done in 40 ms, one held up to 400 ms.
        u.add(1_000_000, at(0), at(40));
        u.add(1_000_000, at(0), at(40));
        u.add(1_000_000, at(0), at(400));
        let r = u.rate().unwrap();
        assert!((r - 75e6).abs() < 1e3, "{r}");
        // Phase 1's streams run together; had they run one after the other, the median reading
        // would count the uplink twice (it is the larger here).
        let mut v = Upload::default();
        v.add(1_500_000, at(0), at(100));
        v.add(1_500_000, at(100), at(200));
        assert!((v.rate().unwrap() - 30e6).abs() < 1e3);
        // Too little to measure.
        let mut w = Upload::default();
        w.add(1000, at(0), at(1));
        assert!(w.rate().is_none());
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::*;
    use starling_compression::Codec;

    #[test]
    fn small_spans_are_cut_into_parts_and_large_ones_keep_the_configured_chunk() {
        let mut cfg = AveragerConfig::new("chunks");
        cfg.codec = Codec::Float16;
        // 10^6 values over 4 peers: a 500 KB span in four 125 KB chunks.
        let c = chunk_bytes_for(&cfg, 250_000);
        assert!((120_000..=130_000).contains(&c), "{c}");
        // Large spans: the configured chunk size.
        assert_eq!(chunk_bytes_for(&cfg, 10_000_000), cfg.chunk_bytes);
        // Tiny spans: never below the smallest part, nor above the configured chunk.
        assert_eq!(chunk_bytes_for(&cfg, 10), MIN_PART_BYTES);
        cfg.chunk_bytes = 8192;
        assert_eq!(chunk_bytes_for(&cfg, 10), 8192);
        // Every codec, adaptive included, gives a chunk its encoder accepts.
        for codec in ["none", "u8", "blockwise8", "adaptive"] {
            cfg.codec = codec.parse().unwrap();
            cfg.chunk_bytes = 1 << 20;
            let c = chunk_bytes_for(&cfg, 250_000);
            assert!((MIN_PART_BYTES..=1 << 20).contains(&c), "{codec}: {c}");
        }
    }
}
