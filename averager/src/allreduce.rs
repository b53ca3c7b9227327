//! The butterfly all-reduce of one formed group.
//!
//! The flattened vector is cut into one contiguous span per member, sized by
//! [`crate::partition::solve_fractions`] (clients and weak peers get none). Each sender streams
//! its part of span `j` to reducer `j` in chunks of `chunk_bytes` (compressed by the configured
//! codec); each reducer stages every sender's part, and once all senders have delivered (or been
//! excluded for stalling past `sender_timeout`) it computes the weighted mean and streams back to
//! each contributor its *delta* `mean - received`, so quantization error does not compound.
//! Senders apply deltas to their exact local values. A sender's contribution counts only when
//! complete, so a span's result is always the exact weighted mean of the senders it lists.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use starling_compression::{
    decode_into, split_chunks, ChunkAssembler, ChunkHeader, Codec, DecodeOptions, EncodeOptions,
};
use starling_node::{PeerId, Stream};
use tokio::sync::mpsc;
use tokio::time::{sleep_until, timeout, timeout_at, Instant};

use crate::averager::Shared;
use crate::config::Fault;
use crate::matchmaking::Group;
use crate::partition::{solve_fractions, spans};
use crate::wire::{
    read_control, read_frame, write_control, write_data, Frame, ReduceMsg, REDUCE_PROTOCOL,
};
use crate::{AveragerError, AveragingMode, SpanOutcome, SpanReport};

/// A sender's stream routed to the round it names.
pub(crate) struct IncomingSender {
    pub peer: PeerId,
    pub hello: ReduceMsg,
    pub stream: Stream,
}

/// What a round produced for the local peer.
pub(crate) struct Outcome {
    pub result: Vec<f32>,
    pub group: Vec<PeerId>,
    pub spans: Vec<SpanReport>,
    pub failed_peers: Vec<PeerId>,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// This peer's upload rate (bytes/s) as seen on this round's streams, if enough was sent.
    pub measured_bandwidth: Option<f64>,
}

/// Streams shorter than this say too little about bandwidth to be measured.
const MIN_MEASURED_BYTES: usize = 256 * 1024;

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    /// Sum over concurrent sender streams of bytes / seconds (bits of f64).
    rate_sum: std::sync::Mutex<f64>,
}

struct RoundGuard<'a> {
    shared: &'a Shared,
    round_id: u64,
}

impl Drop for RoundGuard<'_> {
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
    flat: Arc<Vec<f32>>,
    counters: Counters,
    deadline: Instant,
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
    flat: Vec<f32>,
    weight: f64,
    deadline: Instant,
) -> Outcome {
    let n = group.members.len();
    let peers: Vec<PeerId> = group
        .members
        .iter()
        .map(|m| PeerId::from_bytes(&m.peer_id).unwrap_or_else(|_| PeerId::random()))
        .collect();
    let modes: Vec<AveragingMode> = group.members.iter().map(|m| m.mode).collect();
    let bandwidths: Vec<f64> = group.members.iter().map(|m| m.bandwidth).collect();
    let total = flat.len();
    let solved = if shared.config.load_balance {
        solve_fractions(&bandwidths, &modes)
    } else {
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
    };
    let Some(fractions) = solved else {
        return Outcome {
            result: flat,
            group: peers,
            spans: vec![],
            failed_peers: vec![],
            bytes_sent: 0,
            bytes_received: 0,
            measured_bandwidth: None,
        };
    };
    let ranges = spans(total, &fractions);
    let (tx, rx) = mpsc::channel(n + 4);
    if let Ok(mut routes) = shared.round_routes.lock() {
        routes.insert(group.round_id, tx);
    }
    let _guard = RoundGuard {
        shared,
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
                    tokio::spawn(async move { send_span(&round, j, range).await }),
                ));
            }
        }
    }
    // Reducer: our own span.
    let my_range = ranges[me].clone();
    let reduced = if my_range.is_empty() {
        None
    } else {
        Some(reduce_span(round.clone(), my_range.clone(), rx).await)
    };

    let mut result: Vec<f32> = round.flat.as_ref().clone();
    let mut reports = Vec::new();
    let mut failed: HashSet<PeerId> = HashSet::new();
    if let Some(r) = reduced {
        for f in &r.failed {
            failed.insert(peers[*f as usize]);
        }
        let outcome = match r.mean {
            Some(mean) => {
                result[my_range.clone()].copy_from_slice(&mean);
                SpanOutcome::Averaged {
                    contributors: r.contributors.iter().map(|c| peers[*c as usize]).collect(),
                }
            }
            None => kept("no contributions arrived"),
        };
        reports.push(SpanReport {
            reducer: peers[me],
            range: my_range,
            outcome,
        });
    }
    for (j, handle) in sends {
        let range = ranges[j].clone();
        let outcome = match handle.await {
            Ok(Ok((contributors, values))) => {
                result[range.clone()].copy_from_slice(&values);
                SpanOutcome::Averaged {
                    contributors: contributors.iter().map(|c| peers[*c as usize]).collect(),
                }
            }
            Ok(Err(reason)) => {
                failed.insert(peers[j]);
                kept(reason)
            }
            Err(e) => kept(format!("sender task failed: {e}")),
        };
        reports.push(SpanReport {
            reducer: peers[j],
            range,
            outcome,
        });
    }
    reports.sort_by_key(|r| r.range.start);
    let mut failed: Vec<PeerId> = failed.into_iter().collect();
    failed.sort();
    Outcome {
        result,
        group: peers,
        spans: reports,
        failed_peers: failed,
        bytes_sent: round.counters.sent.load(Ordering::Relaxed),
        bytes_received: round.counters.received.load(Ordering::Relaxed),
        measured_bandwidth: round
            .counters
            .rate_sum
            .lock()
            .ok()
            .map(|r| *r)
            .filter(|r| *r > 0.0),
    }
}

/// Streams our part of reducer `j`'s span, reads back the averaged delta, and returns the new
/// values of the span.
async fn send_span(
    round: &Round,
    j: usize,
    range: Range<usize>,
) -> Result<(Vec<u32>, Vec<f32>), String> {
    let cfg = &round.shared.config;
    let work = async {
        let t0 = Instant::now();
        let hello = ReduceMsg::Hello {
            round_id: round.round_id,
            sender: round.me,
            weight: round.weight,
            start: range.start as u64,
            len: range.len() as u64,
        };
        let (mut stream, mut sent) = open_with_hello(round, j, &hello).await?;
        let opts = EncodeOptions::default();
        let part = &round.flat[range.clone()];
        let chunks =
            split_chunks(cfg.codec, part, cfg.chunk_bytes, &opts).map_err(|e| e.to_string())?;
        // With a lossy codec, the reducer averaged what it decoded, not our exact values: keep
        // that decoded copy so the returned delta lands the result exactly on the mean.
        let mut as_sent = (cfg.codec != Codec::None).then(|| vec![0.0f32; part.len()]);
        for (index, chunk) in chunks.enumerate() {
            if cfg.fault == Some(Fault::AfterSentChunks(index)) {
                round.shared.node.shutdown().await;
                return Err("fault injected: crashed while sending".into());
            }
            let chunk = chunk.map_err(|e| e.to_string())?;
            if let Some(buf) = as_sent.as_mut() {
                let header = ChunkHeader::parse(&chunk).map_err(|e| e.to_string())?;
                let at = header.offset as usize;
                decode_into(&chunk, &mut buf[at..at + header.count]).map_err(|e| e.to_string())?;
            }
            sent += timeout(cfg.reducer_timeout, write_data(&mut stream, &chunk))
                .await
                .map_err(|_| "reducer stopped reading".to_string())?
                .map_err(|e| e.to_string())?;
        }
        sent += write_control(&mut stream, &ReduceMsg::SendDone)
            .await
            .map_err(|e| e.to_string())?;
        futures::AsyncWriteExt::flush(&mut stream)
            .await
            .map_err(|e| e.to_string())?;
        round
            .counters
            .sent
            .fetch_add(sent as u64, Ordering::Relaxed);
        let t_sent = t0.elapsed();
        if sent >= MIN_MEASURED_BYTES && !t_sent.is_zero() {
            if let Ok(mut r) = round.counters.rate_sum.lock() {
                *r += sent as f64 / t_sent.as_secs_f64();
            }
        }

        let reply: ReduceMsg = timeout(
            cfg.reducer_timeout,
            read_control(&mut stream, cfg.max_frame_bytes),
        )
        .await
        .map_err(|_| "reducer did not answer in time".to_string())?
        .map_err(|e| e.to_string())?;
        let contributors = match reply {
            ReduceMsg::Result { contributors } => contributors,
            ReduceMsg::Excluded(why) => return Err(format!("excluded by reducer: {why}")),
            other => return Err(format!("unexpected message {other:?}")),
        };
        if !contributors.contains(&round.me)
            || contributors
                .iter()
                .any(|c| *c as usize >= round.peers.len())
        {
            return Err("reducer's contributor list is malformed".into());
        }
        let delta = receive_chunks(
            round,
            &mut stream,
            range.len(),
            cfg.reducer_timeout,
            Phase::Result,
        )
        .await?;
        let _ = futures::AsyncWriteExt::close(&mut stream).await;
        let mut result = delta;
        tracing::debug!(reducer = j, ?t_sent, total = ?t0.elapsed(), bytes = sent, "span sent and returned");
        // Turn the delta into the new values: (what the reducer saw of us) + delta.
        match as_sent {
            Some(base) => result.iter_mut().zip(&base).for_each(|(d, b)| *d += b),
            None => result.iter_mut().zip(part).for_each(|(d, b)| *d += b),
        }
        Ok((contributors, result))
    };
    timeout_at(round.deadline, work)
        .await
        .unwrap_or_else(|_| Err("deadline passed".into()))
}

/// How long a sender keeps retrying to get a stream past libp2p-stream's accept queue.
const HELLO_RETRY_PAUSE: Duration = Duration::from_millis(25);

/// Opens a reduce stream to member `j` and waits for its `Ready`, retrying streams that were
/// dropped before the reducer saw them (libp2p-stream drops inbound streams that arrive while its
/// accept queue is busy). Retrying is safe: a reducer counts each sender at most once.
async fn open_with_hello(
    round: &Round,
    j: usize,
    hello: &ReduceMsg,
) -> Result<(Stream, usize), String> {
    let cfg = &round.shared.config;
    // The reducer may still be starting its round: allow for that, then give up.
    let give_up = Instant::now() + cfg.request_timeout * 2;
    let mut last = String::from("no attempt");
    let mut attempt = 0u32;
    while Instant::now() < give_up {
        if attempt > 0 {
            tokio::time::sleep(HELLO_RETRY_PAUSE * attempt.min(8)).await;
        }
        attempt += 1;
        let mut stream = match round
            .shared
            .open_stream(round.peers[j], &round.addrs[j], REDUCE_PROTOCOL)
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
            Ok(Ok(ReduceMsg::Excluded(why))) => return Err(format!("excluded by reducer: {why}")),
            Ok(Ok(other)) => return Err(format!("unexpected message {other:?}")),
            Ok(Err(e)) => {
                tracing::debug!(reducer = j, attempt, "hello stream dropped, retrying: {e}");
                last = e.to_string();
            }
            Err(_) => return Err("reducer did not acknowledge in time".into()),
        }
    }
    Err(format!("could not reach the reducer: {last}"))
}

fn decode_options(len: usize) -> DecodeOptions {
    DecodeOptions::default().with_max_elements(len.max(1))
}

/// The result of reducing our own span.
struct Reduced {
    /// The weighted mean, if anyone contributed.
    mean: Option<Vec<f32>>,
    contributors: Vec<u32>,
    failed: Vec<u32>,
}

type Received = (u32, Stream, Result<(f64, Vec<f32>), String>);

/// Receives every sender's part of our span, averages, and sends deltas back.
async fn reduce_span(
    round: Arc<Round>,
    range: Range<usize>,
    mut rx: mpsc::Receiver<IncomingSender>,
) -> Reduced {
    let cfg = &round.shared.config;
    let me = round.me;
    let mut expected: HashSet<u32> = (0..round.peers.len() as u32)
        .filter(|&i| i != me && round.modes[i as usize] != AveragingMode::Aux)
        .collect();
    let mut contributions: Vec<(u32, f64, Vec<f32>)> = Vec::new();
    let mut streams: HashMap<u32, Stream> = HashMap::new();
    let mut failed: Vec<u32> = Vec::new();
    let mut pending: FuturesUnordered<tokio::task::JoinHandle<Received>> = FuturesUnordered::new();
    // A sender must open its stream within the time to set one up plus `sender_timeout`.
    let no_show = (Instant::now() + cfg.request_timeout + cfg.sender_timeout).min(round.deadline);

    while !expected.is_empty() || !pending.is_empty() {
        tokio::select! {
            Some(inc) = rx.recv() => {
                let IncomingSender { peer, hello, mut stream } = inc;
                let ReduceMsg::Hello { sender, weight, start, len, .. } = hello else { continue };
                let valid = (sender as usize) < round.peers.len()
                    && round.peers[sender as usize] == peer
                    && expected.contains(&sender)
                    && start == range.start as u64
                    && len == range.len() as u64
                    && weight.is_finite()
                    && weight >= 0.0;
                if !valid {
                    tracing::debug!(%peer, "refused a sender with a bad hello");
                    let _ = timeout(cfg.request_timeout, write_control(&mut stream, &ReduceMsg::Excluded("bad hello".into()))).await;
                    continue;
                }
                if !matches!(timeout(cfg.request_timeout, write_control(&mut stream, &ReduceMsg::Ready)).await, Ok(Ok(_))) {
                    continue; // the sender retries on a new stream
                }
                expected.remove(&sender);
                let round = round.clone();
                let len = range.len();
                pending.push(tokio::spawn(async move {
                    let gap = round.shared.config.sender_timeout;
                    let r = receive_chunks(&round, &mut stream, len, gap, Phase::Part)
                        .await
                        .map(|data| (weight, data));
                    (sender, stream, r)
                }));
            }
            Some(done) = pending.next() => {
                match done {
                    Ok((sender, stream, Ok((weight, data)))) => {
                        contributions.push((sender, weight, data));
                        streams.insert(sender, stream);
                    }
                    Ok((sender, mut stream, Err(why))) => {
                        tracing::debug!(sender, "excluded a sender: {why}");
                        failed.push(sender);
                        let _ = timeout(cfg.request_timeout, write_control(&mut stream, &ReduceMsg::Excluded(why))).await;
                    }
                    Err(e) => tracing::warn!("receive task failed: {e}"),
                }
            }
            _ = sleep_until(no_show), if !expected.is_empty() => {
                failed.extend(expected.drain());
            }
            _ = sleep_until(round.deadline) => {
                failed.extend(expected.drain());
                break;
            }
        }
    }
    // Tasks still running at the deadline are abandoned (their streams drop).
    for p in pending.iter() {
        p.abort();
    }

    if cfg.fault == Some(Fault::WhileReducing) {
        round.shared.node.shutdown().await;
    }
    let mine = &round.flat[range.clone()];
    let i_contribute = round.modes[me as usize] != AveragingMode::Aux;
    let mut all: Vec<(u32, f64, &[f32])> = contributions
        .iter()
        .map(|(s, w, d)| (*s, *w, &d[..]))
        .collect();
    if i_contribute {
        all.push((me, round.weight, mine));
    }
    if all.is_empty() {
        return Reduced {
            mean: None,
            contributors: vec![],
            failed,
        };
    }
    let total_weight: f64 = all.iter().map(|(_, w, _)| w).sum();
    let equal = total_weight <= 0.0;
    let mut mean = vec![0.0f32; range.len()];
    for (_, w, data) in &all {
        let scale = if equal {
            1.0 / all.len() as f64
        } else {
            w / total_weight
        } as f32;
        for (m, x) in mean.iter_mut().zip(data.iter()) {
            *m += scale * x;
        }
    }
    let mut contributors: Vec<u32> = all.iter().map(|(s, _, _)| *s).collect();
    contributors.sort_unstable();

    // Send each contributor its delta, in parallel.
    let mean = Arc::new(mean);
    let mut replies = Vec::new();
    for (sender, _, data) in contributions {
        let Some(mut stream) = streams.remove(&sender) else {
            continue;
        };
        let round = round.clone();
        let mean = mean.clone();
        let contributors = contributors.clone();
        replies.push(tokio::spawn(async move {
            let delta: Vec<f32> = mean.iter().zip(&data).map(|(m, x)| m - x).collect();
            let r = timeout_at(
                round.deadline,
                send_result(&round, &mut stream, contributors, &delta),
            )
            .await;
            if !matches!(r, Ok(Ok(()))) {
                tracing::debug!(sender, "could not return the result");
            }
        }));
    }
    for r in replies {
        let _ = r.await;
    }
    Reduced {
        mean: Some(Arc::try_unwrap(mean).unwrap_or_else(|m| m.as_ref().clone())),
        contributors,
        failed,
    }
}

/// Which stream phase [`receive_chunks`] reads.
#[derive(Clone, Copy)]
enum Phase {
    /// A sender's part, ended by `SendDone`.
    Part,
    /// A reducer's delta, ended by `ResultDone`.
    Result,
}

/// Reads data chunks of a span of `len` elements until the phase's end marker, allowing at most
/// `gap` between frames, and returns the span once every element has arrived.
async fn receive_chunks(
    round: &Round,
    stream: &mut Stream,
    len: usize,
    gap: Duration,
    phase: Phase,
) -> Result<Vec<f32>, String> {
    let cfg = &round.shared.config;
    let mut assembler =
        ChunkAssembler::with_options(len, decode_options(len)).map_err(|e| e.to_string())?;
    loop {
        let (frame, n) = timeout(gap, read_frame::<_, ReduceMsg>(stream, cfg.max_frame_bytes))
            .await
            .map_err(|_| match phase {
                Phase::Part => "sender stalled".to_string(),
                Phase::Result => "reducer stalled while returning the result".to_string(),
            })?
            .map_err(|e| e.to_string())?;
        round
            .counters
            .received
            .fetch_add(n as u64, Ordering::Relaxed);
        match (frame, phase) {
            (Frame::Data(chunk), _) => {
                assembler.accept(&chunk).map_err(|e| e.to_string())?;
            }
            (Frame::Control(ReduceMsg::SendDone), Phase::Part)
            | (Frame::Control(ReduceMsg::ResultDone), Phase::Result) => break,
            (Frame::Control(other), _) => return Err(format!("unexpected message {other:?}")),
        }
    }
    if !assembler.is_complete() {
        return Err(match phase {
            Phase::Part => "sender's part is incomplete".into(),
            Phase::Result => "reducer's result is incomplete".into(),
        });
    }
    assembler.finish().map_err(|e| e.to_string())
}

async fn send_result(
    round: &Round,
    stream: &mut Stream,
    contributors: Vec<u32>,
    delta: &[f32],
) -> Result<(), AveragerError> {
    let cfg = &round.shared.config;
    let mut sent = write_control(stream, &ReduceMsg::Result { contributors }).await?;
    for chunk in split_chunks(cfg.codec, delta, cfg.chunk_bytes, &EncodeOptions::default())? {
        sent += write_data(stream, &chunk?).await?;
    }
    sent += write_control(stream, &ReduceMsg::ResultDone).await?;
    // Close (FIN) rather than drop (RST), so the last frames are never discarded in flight.
    futures::AsyncWriteExt::close(stream).await?;
    round
        .counters
        .sent
        .fetch_add(sent as u64, Ordering::Relaxed);
    Ok(())
}
