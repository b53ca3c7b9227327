//! A reducer's side of one span (or of a re-delegated part): receive every sender's values
//! in chunks, average **part by part** as soon as every present sender delivered a part, and
//! stream each sender its delta while later parts still arrive. [`PartReducer`] holds the
//! arithmetic and bookkeeping with no I/O (in `part.rs`); [`reduce_span`] drives it over the network.

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use starling_compression::ChunkHeader;
use starling_node::PeerId;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{sleep_until, timeout, timeout_at, Instant};

use super::audit::{keep_transcript, AuditLog, Seals};
use super::part::{delta_into, Input, PartReducer};
use super::send::decode_options;
use super::{chunk_bytes_for, rogue, Round, Segment, Task};
use crate::config::{AveragingMode, Fault, Rogue};
use crate::metrics::Counted;
use crate::pool::PoolBuf;
use crate::router::IncomingSender;
use crate::transport::{unsplit_fast, LaneReader, LaneWriter};
use crate::verify::{Seal, SealedPart};
use crate::wire::{
    read_frame_into, write_chunk, write_control, write_data, Frame, MemberIdx, ReduceMsg,
    SpanChunks,
};
use crate::AveragerError;
use starling_node::lock::lock;

/// How long a reducer crashing by `Fault::WhileReturning` lets its served results travel first.
const FAULT_FLUSH_GRACE: Duration = Duration::from_millis(500);

/// What a reducer reduces: its own span (phase 1) or its part of a failed reducer's span.
pub(super) struct ReduceJob {
    pub range: Range<usize>,
    /// Senders it accepts, each at most once.
    pub allowed: HashSet<MemberIdx>,
    /// Senders it waits for (until the no-show time); a subset of `allowed`.
    pub expected: HashSet<MemberIdx>,
    /// `Some(failed reducer)` for a re-delegated part: senders must send a matching
    /// `RepairHello`, and members that do not come are not counted as failed (they may have
    /// received the failed reducer's result).
    pub repair: Option<MemberIdx>,
}

/// The result of reducing a span or part.
pub(super) struct Reduced {
    /// The weighted means of the finished parts (offsets within the job's range); elements of
    /// unfinished parts are unspecified.
    pub values: PoolBuf,
    /// The finished runs (absolute ranges) with their contributors, in order from the range's
    /// start. Parts nobody contributed to, or not finished by the deadline, are not listed.
    pub segments: Vec<Segment>,
    pub failed: Vec<MemberIdx>,
}

/// News from a sender's receive task.
enum Inbound {
    /// The sender's data now covers `0..prefix` of the range.
    Progress { sender: MemberIdx, prefix: usize },
    /// The sender stalled, broke the protocol or went away before delivering everything.
    Failed { sender: MemberIdx, why: String },
}

/// What a sender's writer task sends back.
enum Outbound {
    /// A finished part: its offset in the range, contributors and this sender's delta (with
    /// the exact codec `none`, the part's mean itself), and the part's result seal when the
    /// group verifies.
    Part {
        start: usize,
        contributors: Arc<Vec<MemberIdx>>,
        delta: PoolBuf,
        seal: Option<Seal>,
    },
    /// The sender is out of the remaining parts.
    Excluded(String),
}

/// A sender taking part in a reduction.
struct Present {
    weight: f64,
    /// Its values of the range, filled in order as chunks arrive.
    staging: Arc<Mutex<PoolBuf>>,
    /// How much of the range has arrived (chunks come in order).
    prefix: usize,
    out: mpsc::Sender<Outbound>,
    /// Its receive and result-writing tasks.
    receiver: Task<()>,
    writer: Task<bool>,
}

/// The state of one reduction while it runs (see [`reduce_span`]).
struct Reduction {
    round: Arc<Round>,
    job: ReduceJob,
    parts: PartReducer,
    senders: BTreeMap<MemberIdx, Present>,
    /// Senders that left (failed or finished), with their writer tasks to await at the end.
    writers: Vec<(MemberIdx, Task<bool>)>,
    /// Receive tasks of senders that left, aborted once the writers are done.
    receivers: Vec<Task<()>>,
    values: PoolBuf,
    failed: Vec<MemberIdx>,
    events: mpsc::Sender<Inbound>,
    /// Elements per part (and per sender chunk).
    part_len: usize,
    /// `Fault::WhileReturning`: only these senders get results, then this peer crashes.
    serve_only: Option<HashSet<MemberIdx>>,
    /// When the group verifies: every admitted sender's values and seals, and the sealed parts,
    /// kept for the round's transcript (see [`crate::verify`]).
    audit: Option<AuditLog>,
}

/// Receives every sender's values of the job's range and averages them **part by part**: as
/// soon as every present sender has delivered a part (of [`chunk_bytes_for`] the range), its mean is
/// computed and each sender gets its delta back while the next parts are still arriving, so the
/// return traffic overlaps the send traffic. Parts wait until every expected sender has shown up
/// (or the no-show time passed). A sender that fails is left out of the parts not finished yet;
/// each part's contributors are exactly the senders (and this peer) whose data is in its mean.
pub(super) async fn reduce_span(
    round: Arc<Round>,
    job: ReduceJob,
    mut rx: mpsc::Receiver<IncomingSender>,
) -> Reduced {
    let cfg = round.config();
    let chunk_bytes = chunk_bytes_for(cfg, job.range.len());
    let part_len = starling_compression::elements_per_chunk(cfg.codec, chunk_bytes)
        .unwrap_or(1 << 16)
        .max(1);
    // No-shows count as failed only in phase 1, where every sender owes us its part.
    let phase1 = job.repair.is_none();
    // A sender must open its stream within the time to set one up plus `sender_timeout`.
    let no_show = (Instant::now() + cfg.request_timeout + cfg.sender_timeout).min(round.deadline);
    let (events, mut ev_rx) = mpsc::channel::<Inbound>(4 * round.peers.len() + 16);
    let mut r = Reduction {
        parts: PartReducer::new(job.range.clone(), part_len).with_aggregation(cfg.aggregation),
        // Each part is cleared and summed into before it is read.
        values: round.env.pool.take_dirty(job.range.len()),
        round: round.clone(),
        job,
        senders: BTreeMap::new(),
        writers: Vec::new(),
        receivers: Vec::new(),
        failed: Vec::new(),
        events,
        part_len,
        serve_only: None,
        audit: round.env.signer.as_ref().map(|_| AuditLog::default()),
    };
    let mut gone_seen = 0;
    loop {
        if round.gone.count() > gone_seen && !r.job.expected.is_empty() {
            // Members this peer could not reach as reducers will not send their parts.
            gone_seen = round.gone.count();
            let gone = round.gone.snapshot();
            r.give_up_on(|m| gone.contains(m), phase1);
        }
        if !r.finish_ready_parts().await || r.parts.is_done() {
            break;
        }
        tokio::select! {
            Some(inc) = rx.recv() => r.admit(inc).await,
            Some(ev) = ev_rx.recv() => r.on_event(ev),
            _ = round.gone.changed.notified(), if !r.job.expected.is_empty() => {}
            _ = sleep_until(no_show), if !r.job.expected.is_empty() => {
                let gone = r.job.expected.drain();
                if phase1 {
                    r.failed.extend(gone);
                }
            }
            _ = sleep_until(round.deadline) => {
                let gone = r.job.expected.drain();
                if phase1 {
                    r.failed.extend(gone);
                }
                break;
            }
        }
    }
    r.finish().await
}

impl Reduction {
    /// Stops waiting for the parts of the expected senders in `gone` (who declined the round
    /// or cannot be reached): failed, in phase 1.
    fn give_up_on(&mut self, gone: impl Fn(&MemberIdx) -> bool, phase1: bool) {
        let no_shows: Vec<MemberIdx> = self.job.expected.iter().copied().filter(gone).collect();
        for m in no_shows {
            tracing::debug!(
                member = m.0,
                "not waiting for the part of a member that is gone"
            );
            self.job.expected.remove(&m);
            self.job.allowed.remove(&m);
            if phase1 {
                self.failed.push(m);
            }
        }
    }

    /// Finishes every part that every present sender has delivered (once every expected sender
    /// showed up). Returns false if this peer crashed by fault injection.
    async fn finish_ready_parts(&mut self) -> bool {
        let round = self.round.clone();
        let cfg = round.config();
        let values_back = round.env.values_back;
        while self.job.expected.is_empty() {
            let Some(part) = self.parts.ready(self.senders.values().map(|s| s.prefix)) else {
                break;
            };
            if self.parts.is_first() && self.job.repair.is_none() {
                if round.crash_if(Fault::WhileReducing).await {
                    return false;
                }
                if let Some(Fault::WhileReturning(n)) = cfg.fault() {
                    self.serve_only = Some(self.senders.keys().take(n).copied().collect());
                }
            }
            // Late senders can no longer join: they would miss the finished parts.
            self.job.allowed.clear();
            let Some(contributors) = self.reduce_part(&part) else {
                continue; // nobody's data: the part stays local
            };
            if let Some(bias) = cfg.result_bias {
                // A lying reducer on purpose (`AveragerConfig::result_bias`).
                self.values[part.clone()]
                    .iter_mut()
                    .for_each(|v| *v += bias);
            }
            if values_back {
                // Rounded as every member will decode it (a no-op with the exact codec; the
                // averager asks for this only with elementwise codecs).
                if let Err(e) = cfg.codec.round_trip(&mut self.values[part.clone()]) {
                    tracing::error!("results sent back as values with {}: {e}", cfg.codec);
                }
            }
            let seal = self.seal_part(&part, &contributors);
            let mut gone = Vec::new();
            for (&sender, s) in &self.senders {
                if self
                    .serve_only
                    .as_ref()
                    .is_some_and(|only| !only.contains(&sender))
                {
                    continue;
                }
                let mut delta = round.env.pool.take_dirty(part.len());
                if values_back {
                    // The result itself (rounded through the codec above): every member then
                    // holds the same bits (a delta added to each sender's own values would not).
                    delta.copy_from_slice(&self.values[part.clone()]);
                } else {
                    delta_into(
                        &mut delta,
                        &self.values[part.clone()],
                        &lock(&s.staging)[part.clone()],
                    );
                }
                let msg = Outbound::Part {
                    start: part.start,
                    contributors: contributors.clone(),
                    delta,
                    seal: seal.clone(),
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
                tracing::debug!(sender = sender.0, "a sender stopped taking results");
                self.leave(sender);
                self.failed.push(sender);
            }
        }
        true
    }

    /// When the group verifies: seals the part's result and records the part for the
    /// transcript.
    fn seal_part(&mut self, part: &Range<usize>, contributors: &[MemberIdx]) -> Option<Seal> {
        let round = &self.round;
        let signer = round.env.signer.as_ref()?;
        let audit = self.audit.as_mut()?;
        let abs = self.job.range.start + part.start..self.job.range.start + part.end;
        let me = round.me;
        audit.own |= contributors.contains(&me);
        let ids = round.peer_bytes(contributors);
        let seal = signer.seal_result(
            round.round_id,
            abs.start,
            &ids,
            &round.config().aggregation.to_string(),
            &self.values[part.clone()],
        );
        // The order `reduce_part` combined them in: this peer first, then by member index.
        let mut order: Vec<MemberIdx> = contributors.iter().copied().filter(|c| *c == me).collect();
        order.extend(contributors.iter().copied().filter(|c| *c != me));
        audit.parts.push(SealedPart {
            range: abs,
            order,
            contributors: ids,
            seal: seal.clone(),
        });
        Some(seal)
    }

    /// The weighted mean of `part` over this peer (unless `Aux`) and every present sender,
    /// written into the result; `None` when nobody contributed.
    fn reduce_part(&mut self, part: &Range<usize>) -> Option<Arc<Vec<MemberIdx>>> {
        let round = &self.round;
        let me = round.me;
        let abs = self.job.range.start + part.start..self.job.range.start + part.end;
        let staged: Vec<(MemberIdx, f64, MutexGuard<'_, PoolBuf>)> = self
            .senders
            .iter()
            .map(|(&m, s)| (m, s.weight, lock(&s.staging)))
            .collect();
        let mut inputs = Vec::with_capacity(staged.len() + 1);
        if round.modes[me.get()] != AveragingMode::Aux {
            inputs.push(Input {
                member: me,
                weight: round.weight,
                values: &round.flat[abs],
            });
        }
        inputs.extend(staged.iter().map(|(member, weight, st)| Input {
            member: *member,
            weight: *weight,
            values: &st[part.clone()],
        }));
        self.parts
            .reduce_next(&mut self.values[part.clone()], &inputs)
            .map(|(_, contributors)| contributors)
    }

    /// Takes a sender whose hello reached this round, if it is one the job accepts.
    async fn admit(&mut self, inc: IncomingSender) {
        let round = self.round.clone();
        let cfg = round.config();
        let IncomingSender {
            peer,
            hello,
            mut stream,
        } = inc;
        if let ReduceMsg::Declined { sender, .. } = hello {
            // A member that refused the group: its part will not come (phase 1; a repair
            // job's senders are those that were there).
            let its_own = sender.within(round.peers.len()).is_some() && round.peer(sender) == peer;
            if its_own && self.job.repair.is_none() {
                self.give_up_on(|m| *m == sender, true);
            }
            let _ = timeout(
                cfg.request_timeout,
                write_control(&mut stream, &ReduceMsg::Ready),
            )
            .await;
            return;
        }
        let (sender, weight, start, hlen) = match (hello, self.job.repair) {
            (
                ReduceMsg::Hello {
                    sender,
                    weight,
                    start,
                    len,
                    ..
                },
                None,
            ) => (sender, weight, start, len),
            (
                ReduceMsg::RepairHello {
                    sender,
                    weight,
                    failed,
                    start,
                    len,
                    ..
                },
                Some(f),
            ) if failed == f => (sender, weight, start, len),
            _ => return,
        };
        let range = &self.job.range;
        let valid = sender.within(round.peers.len()).is_some()
            && round.peer(sender) == peer
            && self.job.allowed.contains(&sender)
            && start == range.start as u64
            && hlen == range.len() as u64
            && weight.is_finite()
            && weight >= 0.0
            && !round.env.banned.contains(&peer.to_bytes());
        if !valid {
            tracing::debug!(%peer, "refused a sender with a bad or late hello");
            let refusal = ReduceMsg::Excluded("bad or late hello".into());
            let _ = timeout(cfg.request_timeout, write_control(&mut stream, &refusal)).await;
            return;
        }
        let ready = timeout(
            cfg.request_timeout,
            write_control(&mut stream, &ReduceMsg::Ready),
        )
        .await;
        if !matches!(ready, Ok(Ok(_))) {
            return; // the sender retries on a new stream
        }
        self.job.allowed.remove(&sender);
        self.job.expected.remove(&sender);
        let (rd, wr) = round.env.transport.split_counted(stream, "reduce");
        let len = range.len();
        // Read only below the sender's delivered prefix.
        let staging = Arc::new(Mutex::new(round.env.pool.take_dirty(len)));
        let (out_tx, out_rx) = mpsc::channel(4);
        // The read half comes back to the writer once the sender's part ended cleanly, so a
        // fast lane can be kept for the next round.
        let (rd_tx, rd_rx) = oneshot::channel();
        let seals: Option<Seals> = self.audit.as_mut().map(|audit| {
            let seals = Seals::default();
            audit
                .inputs
                .insert(sender, (weight, staging.clone(), seals.clone()));
            seals
        });
        // The one chunk whose seal this reducer checks against the values now (every seal's
        // signature is checked; the other roots when a block of them is revealed).
        let chunks = len.div_ceil(self.part_len).max(1);
        let check_at = rand::random::<u64>() as usize % chunks * self.part_len;
        let receiver = Task::spawn(receive_part(
            round.clone(),
            rd,
            Incoming {
                sender,
                weight,
                start: range.start,
                len,
                seals,
                check_at,
            },
            staging.clone(),
            self.events.clone(),
            rd_tx,
        ));
        let writer = Task::spawn(write_results(round.clone(), peer, wr, rd_rx, out_rx));
        let present = Present {
            weight,
            staging,
            prefix: 0,
            out: out_tx,
            receiver,
            writer,
        };
        self.senders.insert(sender, present);
    }

    fn on_event(&mut self, ev: Inbound) {
        match ev {
            Inbound::Progress { sender, prefix } => {
                if let Some(s) = self.senders.get_mut(&sender) {
                    s.prefix = prefix;
                }
            }
            Inbound::Failed { sender, why } => {
                if let Some(out) = self.leave(sender) {
                    tracing::debug!(sender = sender.0, "excluded a sender: {why}");
                    self.failed.push(sender);
                    let _ = out.try_send(Outbound::Excluded(why));
                }
            }
        }
    }

    /// Removes a sender from the parts still to come; its writer is awaited at the end.
    fn leave(&mut self, sender: MemberIdx) -> Option<mpsc::Sender<Outbound>> {
        let s = self.senders.remove(&sender)?;
        self.writers.push((sender, s.writer));
        self.receivers.push(s.receiver);
        Some(s.out)
    }

    /// Closes every result stream (writers finish with `ResultDone`), waits for them, and
    /// hands back the result.
    async fn finish(mut self) -> Reduced {
        let round = self.round.clone();
        // Every part is reduced and sealed: the transcript can answer reveals now, while the
        // last results are still on their way to the slower senders.
        if let (Some(audit), None) = (self.audit.take(), self.job.repair) {
            keep_transcript(&round, &self.job.range, audit, &self.values);
        }
        let present: HashSet<MemberIdx> = self.senders.keys().copied().collect();
        for sender in present.iter().copied().collect::<Vec<_>>() {
            self.leave(sender);
        }
        for (sender, writer) in std::mem::take(&mut self.writers) {
            let served = self
                .serve_only
                .as_ref()
                .is_none_or(|only| only.contains(&sender));
            let ok = matches!(timeout_at(round.deadline, writer).await, Ok(Ok(true)));
            if !ok && served && present.contains(&sender) {
                tracing::debug!(sender = sender.0, "could not return the result");
                self.failed.push(sender);
            }
        }
        self.receivers.clear();
        let silent = round.config().fault() == Some(Fault::SilentReducer);
        if self.serve_only.is_some() || (silent && self.job.repair.is_none()) {
            // Let the served results leave before the connections drop.
            tokio::time::sleep(FAULT_FLUSH_GRACE).await;
            round.env.transport.node().shutdown().await;
        }
        self.failed.sort_unstable();
        self.failed.dedup();
        Reduced {
            values: self.values,
            segments: self.parts.into_segments(),
            failed: self.failed,
        }
    }
}

/// Reads one sender's chunks (in order) into its staging buffer, reporting progress, until its
/// `SendDone`; at most `sender_timeout` between frames.
/// When the group verifies, each chunk must be followed by the sender's seal over what was
/// decoded of it; the chunk counts (is reported) only once its seal checks out.
async fn receive_part(
    round: Arc<Round>,
    mut rd: Counted<LaneReader>,
    incoming: Incoming,
    staging: Arc<Mutex<PoolBuf>>,
    events: mpsc::Sender<Inbound>,
    done: oneshot::Sender<Counted<LaneReader>>,
) {
    let cfg = &round.env.config;
    let Incoming {
        sender,
        weight,
        start,
        len,
        seals,
        check_at,
    } = incoming;
    let me = round.peer(round.me).to_bytes();
    // A decoded chunk waiting for its seal.
    let mut unsealed: Option<(usize, usize)> = None;
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
            Frame::Data => {
                if unsealed.is_some() {
                    break "a chunk came without its seal".to_string();
                }
                let header = match ChunkHeader::parse(&chunk) {
                    Ok(h) => h,
                    Err(e) => break e.to_string(),
                };
                let count = header.count;
                let in_place = header.total == len as u64
                    && header.offset == prefix as u64
                    && count > 0
                    && prefix.checked_add(count).is_some_and(|end| end <= len);
                if !in_place {
                    break "chunk out of order or out of range".to_string();
                }
                let at = prefix;
                let decoded = decoder.decode_into(&chunk, &mut lock(&staging)[at..at + count]);
                if let Err(e) = decoded {
                    break e.to_string();
                }
                prefix += count;
                if seals.is_some() {
                    unsealed = Some((at, count));
                    continue;
                }
                if events
                    .send(Inbound::Progress { sender, prefix })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Frame::Control(ReduceMsg::Seal(seal)) => {
                let (Some((at, count)), Some(seals)) = (unsealed.take(), seals.as_ref()) else {
                    break "a seal out of place".to_string();
                };
                let genuine = {
                    let staged = lock(&staging);
                    crate::verify::check_input(
                        round.round_id,
                        &round.peer(sender),
                        &me,
                        start + at,
                        count,
                        weight,
                        (at == check_at).then(|| &staged[at..at + count]),
                        &seal,
                    )
                };
                if !genuine {
                    break "a chunk's seal does not match its values".to_string();
                }
                lock(seals).insert(start + at, (count, seal));
                if events
                    .send(Inbound::Progress { sender, prefix })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Frame::Control(ReduceMsg::SendDone) if prefix == len && unsealed.is_none() => {
                let _ = done.send(rd);
                return;
            }
            Frame::Control(ReduceMsg::SendDone) => break "sender's part is incomplete".to_string(),
            Frame::Control(other) => break format!("unexpected message {other:?}"),
        }
    };
    let _ = events.send(Inbound::Failed { sender, why }).await;
}

/// Writes a sender's results as the reducer finishes parts: `Result` and the delta chunks of
/// each part, then `ResultDone`; then either parks a fast lane whose read half came back clean
/// (`read_half`: the sender's `SendDone` was read) for the next round, or closes the stream.
/// Returns whether everything went out.
async fn write_results(
    round: Arc<Round>,
    peer: PeerId,
    mut wr: Counted<LaneWriter>,
    read_half: oneshot::Receiver<Counted<LaneReader>>,
    mut parts: mpsc::Receiver<Outbound>,
) -> bool {
    let cfg = &round.env.config;
    let mut sent = 0usize;
    // Fault injection: a rogue reducer lies in the first part it returns.
    let mut rogue = rogue::of(cfg);
    let result = async {
        while let Some(out) = parts.recv().await {
            match out {
                Outbound::Part {
                    start,
                    contributors,
                    delta,
                    seal,
                } => {
                    let mut head = ReduceMsg::Result {
                        start: start as u64,
                        len: delta.len() as u64,
                        contributors: contributors.to_vec(),
                    };
                    let lie = rogue.take();
                    if let Some(r) = lie {
                        rogue::lie_in_result(&mut head, r);
                    }
                    let times = if lie == Some(Rogue::DuplicateResult) {
                        2
                    } else {
                        1
                    };
                    for _ in 0..times {
                        sent += write_control(&mut wr, &head).await?;
                        // A part fits one chunk (parts are cut by the chunk size, or smaller).
                        let mut chunks =
                            SpanChunks::new(cfg.codec, &delta, cfg.chunk_bytes, cfg.zstd_level)?;
                        let mut first = true;
                        while let Some(chunk) = chunks.next_chunk() {
                            let chunk = chunk?;
                            sent += match lie {
                                Some(Rogue::DeltaOffset(off)) if first => {
                                    write_data(&mut wr, &rogue::with_offset(&chunk, off)?).await?
                                }
                                _ => write_chunk(&mut wr, &chunk).await?,
                            };
                            first = false;
                        }
                        if let Some(seal) = &seal {
                            sent += write_control(&mut wr, &ReduceMsg::ResultSeal(seal.clone()))
                                .await?;
                        }
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
        Ok::<_, AveragerError>(true)
    }
    .await;
    if matches!(result, Ok(true)) {
        // The sender's part normally ended before its last result went out; allow a moment.
        let rd = match wr.get_ref() {
            LaneWriter::Fast(_) => timeout(round.env.config.sender_timeout, read_half)
                .await
                .ok()
                .and_then(Result::ok),
            LaneWriter::P2p(_) => None,
        };
        match rd {
            Some(rd) => {
                if let Some(lane) = unsplit_fast(rd.into_inner(), wr.into_inner()) {
                    round.env.router.park(peer, lane);
                }
            }
            // Close (FIN) rather than drop (RST), so the last frames are never discarded.
            None => {
                let _ = futures::AsyncWriteExt::close(&mut wr).await;
            }
        }
    }
    round
        .counters
        .sent
        .fetch_add(sent as u64, Ordering::Relaxed);
    matches!(result, Ok(true))
}

/// Who sends a span, as its hello said: what the receive task checks its chunks and seals
/// against.
struct Incoming {
    sender: MemberIdx,
    weight: f64,
    /// Absolute start of the job's range.
    start: usize,
    len: usize,
    /// Where its seals go, when the group verifies.
    seals: Option<Seals>,
    /// The offset (within the range) of the chunk whose seal is checked against its values.
    check_at: usize,
}
