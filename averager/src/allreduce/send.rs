//! A sender's side of one span: open a stream to the reducer (its fast lane when it has one),
//! stream this peer's values in chunks while reading back the averaged deltas part by part,
//! and turn them into new values.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use starling_compression::{decode_into, ChunkHeader, Codec, DecodeOptions};
use starling_node::streams::{open_confirmed, OpenError, Retry};
use tokio::time::{timeout, timeout_at, Instant};

use super::audit::ReceivedPart;
use super::{chunk_bytes_for, rogue, Round, Segment};
use crate::config::{Fault, Rogue};
use crate::pool::PoolBuf;
use crate::transport::{unsplit_fast, Lane, LaneWriter};
use crate::verify::Seal;
use crate::wire::{
    read_control, read_frame_into, write_chunk, write_control, write_data, ChunkOut, Control,
    Frame, MemberIdx, ReduceMsg, SpanChunks, MAX_CONTROL_BYTES, REDUCE_PROTOCOL, UNKNOWN_ROUND,
};
use crate::AveragerError;
use starling_node::lock::lock;

/// What a sender streams: its part of a reducer's span (phase 1), or its part of a failed
/// reducer's span to a surviving reducer (phase 2).
#[derive(Clone, Copy)]
pub(super) enum SendKind {
    Span,
    Repair { failed: MemberIdx },
}

/// Why a sender got no result back.
pub(super) struct SendFail {
    pub reason: String,
    /// The reducer failed (gone, stalled, broke the protocol, not in the round), as opposed to
    /// refusing us, or our own failure or deadline.
    pub reducer_failed: bool,
    /// No stream to the reducer could be opened at all ([`UNREACHABLE_AFTER`] dials in a row
    /// failed): the peer is gone, as a sender too.
    pub unreachable: bool,
}

/// Failed attempts in a row to open a stream to a reducer after which it is taken as gone
/// (with the pauses between them, about 150 ms on top of the dials): a peer that crashed fails
/// every dial at once, and retrying until the open deadline (twice the request timeout) made
/// its group wait for it.
const UNREACHABLE_AFTER: u32 = 4;

impl SendFail {
    fn reducer(reason: impl Into<String>) -> Self {
        SendFail {
            reason: reason.into(),
            reducer_failed: true,
            unreachable: false,
        }
    }

    fn other(reason: impl Into<String>) -> Self {
        SendFail {
            reason: reason.into(),
            reducer_failed: false,
            unreachable: false,
        }
    }

    /// The reducer was found down (its process died) while this send waited on it.
    pub(super) fn down() -> Self {
        SendFail {
            reason: "the reducer is down (its connections dropped and its address refuses)".into(),
            reducer_failed: true,
            unreachable: true,
        }
    }

    /// `Excluded(why)` from the reducer: a failure only if it does not know the round.
    fn excluded(why: String) -> Self {
        SendFail {
            reducer_failed: why == UNKNOWN_ROUND,
            reason: format!("excluded by reducer: {why}"),
            unreachable: false,
        }
    }
}

/// What sending a span gave: the contributors of each run of the range, the new values of the
/// whole range and, with error feedback and a lossy codec, the residual of the range (what the
/// reducer did not see of our contribution); or why no result came back.
pub(super) type Sent =
    Result<(Vec<Segment>, PoolBuf, Option<PoolBuf>, Vec<ReceivedPart>), SendFail>;

/// Streams our part of reducer `j`'s span (or, in phase 2, a part of a failed reducer's span to
/// surviving reducer `j`) and, at the same time, reads back the averaged deltas part by part as
/// the reducer finishes them. Returns the contributors of each run of the range and the new
/// values of the whole range, or a failure if any part did not come back (partial results are
/// discarded: the range is then repaired or kept whole).
///
/// `checks`: this peer checks reducer `j` this round ([`super::audit::choose`]), so the result
/// seals' signatures are verified as they arrive (see [`receive_results`]).
pub(super) async fn send_span(
    round: &Round,
    j: MemberIdx,
    range: Range<usize>,
    kind: SendKind,
    checks: bool,
) -> Sent {
    let cfg = &round.env.config;
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
        let mut hello = match kind {
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
        if let Some(r) = rogue::of(cfg) {
            rogue::lie_in_hello(&mut hello, r);
        }
        let part = &round.flat[range.clone()];
        // With a lossy codec, the reducer averaged what it decoded, not our exact values: keep
        // that decoded copy so the returned delta lands the result exactly on the mean.
        let mut as_sent = (cfg.codec != Codec::None).then(|| round.env.pool.take_dirty(part.len()));
        // A lane kept warm from an earlier round carries the hello and the data at once (no
        // round trip before the first byte: on a busy link the `Ready` waits behind queued data).
        // If that lane turns out dead before the reducer admitted us, nothing reached the
        // round: the exchange starts over once on a fresh lane, which waits for `Ready` first.
        let mut warm = round.env.transport.take_idle(round.peer(j));
        let (stream, hello_bytes, pipelined, t_start, exchanged) = loop {
            let pipelined = warm.is_some();
            let (stream, hello_bytes) = match warm.take() {
                Some(lane) => {
                    let mut lane = Lane::Fast(Box::new(lane));
                    match write_control(&mut lane, &hello).await {
                        Ok(n) => (lane, n),
                        Err(e) => {
                            tracing::debug!(reducer = j.0, "warm lane died while idle: {e}");
                            continue;
                        }
                    }
                }
                None => {
                    let (s, n) = open_with_hello(round, j, &hello, ack_wait).await?;
                    (s, n)
                }
            };
            // The upload is timed from the first data byte (after the reducer's `Ready` on a
            // fresh lane; at once on a warm one) to the last byte handed to the lane. A lane
            // holds little unsent data (the node limits it), so bytes handed over have left
            // this host; on a warm lane those sent before the reducer's `Ready` wait in its
            // receive buffer, and if that fills, the wait reads as a slower uplink for this
            // round, which the median of recent rounds absorbs.
            let t_start = Instant::now();
            let admitted = AtomicBool::new(!pipelined);
            let refused = AtomicBool::new(false);
            let (mut rd, mut wr) = round.env.transport.split_counted(stream, "reduce");
            let write = async {
                let sent = write_span(
                    round,
                    &mut wr,
                    (j, range.start),
                    part,
                    as_sent.as_deref_mut(),
                    phase1,
                )
                .await?;
                // The upload rate counts the time to send, not the wait for results.
                Ok((sent, Instant::now()))
            };
            let read = async {
                if pipelined {
                    await_ready(&mut rd, ack_wait, &refused).await?;
                    admitted.store(true, Ordering::Relaxed);
                }
                receive_results(
                    round,
                    &mut rd,
                    (j, range.start),
                    range.len(),
                    result_gap,
                    failed_reducer,
                    checks,
                )
                .await
            };
            // Whichever side fails first ends the exchange (a refusal arrives on the read side
            // while the write side may still be pushing data nobody reads).
            match futures::future::try_join(write, read).await {
                Ok(done) => {
                    break ((rd, wr), hello_bytes, pipelined, t_start, done);
                }
                // Only the lane's failure (not a refusal, nor our own failure or deadline).
                Err(e)
                    if pipelined
                        && e.reducer_failed
                        && !admitted.load(Ordering::Relaxed)
                        && !refused.load(Ordering::Relaxed) =>
                {
                    tracing::debug!(
                        reducer = j.0,
                        "warm lane failed before admission: {}",
                        e.reason
                    );
                }
                Err(e) => return Err(e),
            }
        };
        let (rd, wr) = stream;
        if matches!(wr.get_ref(), LaneWriter::Fast(_)) {
            round.counters.fast.fetch_add(1, Ordering::Relaxed);
        }
        if pipelined {
            round.counters.warm.fetch_add(1, Ordering::Relaxed);
        }
        let ((sent, t_sent), (segments, delta, sealed)) = exchanged;
        let data_bytes = sent;
        let sent = sent + hello_bytes;
        round
            .counters
            .sent
            .fetch_add(sent as u64, Ordering::Relaxed);
        // Only phase 1's concurrent streams measure this peer's upload rate.
        if phase1 {
            lock(&round.counters.upload).add(data_bytes, t_start, t_sent);
        }
        // A fast lane whose exchange ended cleanly stays open for the next round; a libp2p
        // stream is closed (streams are cheap to open).
        let (rd, mut wr) = (rd.into_inner(), wr.into_inner());
        if matches!(wr, LaneWriter::Fast(_)) {
            if let Some(lane) = unsplit_fast(rd, wr) {
                round.env.transport.keep_idle(round.peer(j), lane);
            }
        } else {
            let _ = futures::AsyncWriteExt::close(&mut wr).await;
        }
        tracing::debug!(reducer = j.0, sent_in = ?t_sent - t_start, total = ?t0.elapsed(), bytes = sent, "span sent and returned");
        // With a lossy codec, turn the delta into the new values: (what the reducer saw of us)
        // + delta. The exact codec `none` (no `as_sent` copy) carries the mean itself, so every
        // member holds the same bits.
        let mut result = delta;
        let mut residual = None;
        if let Some(mut base) = as_sent {
            // Unless the reducer sent the result itself (`RoundEnv::values_back`).
            if !round.env.values_back {
                result
                    .iter_mut()
                    .zip(base.iter())
                    .for_each(|(d, b)| *d += b);
            }
            // Error feedback: the copy becomes what quantization dropped, in place (the
            // round's vector is the corrected contribution when feedback is on).
            if round.env.feedback {
                base.iter_mut()
                    .zip(part)
                    .for_each(|(s, corrected)| *s = corrected - *s);
                residual = Some(base);
            }
        }
        let segments = segments
            .into_iter()
            .map(|(r, c)| (range.start + r.start..range.start + r.end, c))
            .collect();
        Ok((segments, result, residual, sealed))
    };
    timeout_at(round.deadline, work)
        .await
        .unwrap_or_else(|_| Err(SendFail::other("deadline passed")))
}

/// Writes this peer's values of a span (`part`) as data chunks, then `SendDone`; with a lossy
/// codec also decodes each chunk into `as_sent` (what the reducer will see of us). Returns the
/// bytes written.
/// When the group verifies, each chunk is followed by this peer's seal over the chunk's values
/// as the reducer decodes them (`to`: the reducer and the span's absolute start).
async fn write_span<W: futures::AsyncWrite + Unpin>(
    round: &Round,
    wr: &mut W,
    to: (MemberIdx, usize),
    part: &[f32],
    mut as_sent: Option<&mut [f32]>,
    phase1: bool,
) -> Result<usize, SendFail> {
    let cfg = round.config();
    let mut sent = 0;
    let mut chunks = SpanChunks::new(
        cfg.codec,
        part,
        chunk_bytes_for(cfg, part.len()),
        cfg.zstd_level,
    )
    .map_err(|e| SendFail::other(e.to_string()))?;
    let mut index = 0;
    let rogue = rogue::of(cfg).filter(|_| phase1);
    // With the exact codec the seals are over our own values, known before anything is sent:
    // they are hashed and signed on a blocking thread, ahead of the writes, so the hashing
    // overlaps the transfer instead of following each chunk.
    let mut ahead = match (&round.env.signer, &as_sent) {
        (Some(_), None) if cfg.zstd_level.is_none() => Some(seals_ahead(round, to, part.len())),
        _ => None,
    };
    while let Some(chunk) = chunks.next_chunk() {
        if phase1 && round.crash_if(Fault::AfterSentChunks(index)).await {
            return Err(SendFail::other("fault injected: crashed while sending"));
        }
        index += 1;
        let chunk = chunk.map_err(|e| SendFail::other(e.to_string()))?;
        if let (Some(r), 1) = (rogue, index) {
            if rogue_chunk(wr, &chunk, r).await? {
                break;
            }
        }
        // Where the chunk lies in the span (our own encoder's header: in range by construction).
        let (at, count) = match &chunk {
            ChunkOut::Raw { values, offset, .. } => (*offset, values.len()),
            ChunkOut::Encoded(bytes) => {
                let header =
                    ChunkHeader::parse(bytes).map_err(|e| SendFail::other(e.to_string()))?;
                (header.offset as usize, header.count)
            }
        };
        if let (Some(buf), ChunkOut::Encoded(bytes)) = (as_sent.as_deref_mut(), &chunk) {
            decode_into(bytes, &mut buf[at..at + count])
                .map_err(|e| SendFail::other(e.to_string()))?;
        }
        sent += timeout(cfg.reducer_timeout, write_chunk(wr, &chunk))
            .await
            .map_err(|_| SendFail::reducer("reducer stopped reading"))?
            .map_err(|e| SendFail::reducer(e.to_string()))?;
        if let Some(signer) = &round.env.signer {
            let values = match as_sent.as_deref() {
                Some(buf) => &buf[at..at + count],
                None => &part[at..at + count],
            };
            let (j, span_start) = to;
            let precomputed = match ahead.as_mut() {
                Some(rx) => rx.recv().await.filter(|(a, c, _)| (*a, *c) == (at, count)),
                None => None,
            };
            let seal = match precomputed {
                Some((_, _, seal)) => seal,
                None => {
                    // Not precomputed (a lossy codec), or the thread's chunking disagreed:
                    // seal here (and stop reading a thread that is out of step).
                    ahead = None;
                    signer.seal_input(
                        round.round_id,
                        &round.peer(j),
                        span_start + at,
                        round.weight,
                        values,
                    )
                }
            };
            sent += write_control(wr, &ReduceMsg::Seal(seal))
                .await
                .map_err(|e| SendFail::reducer(e.to_string()))?;
        }
    }
    sent += write_control(wr, &ReduceMsg::SendDone)
        .await
        .map_err(|e| SendFail::reducer(e.to_string()))?;
    futures::AsyncWriteExt::flush(wr)
        .await
        .map_err(|e| SendFail::reducer(e.to_string()))?;
    Ok(sent)
}

/// Seals of our values of `span_start..span_start + len` (sent to reducer `j`), one per chunk
/// as [`write_span`] cuts them with the exact codec, computed in order on a blocking thread:
/// `(offset in the span, count, seal)`. At most a few run ahead of the writes; the thread stops
/// when the receiver is dropped.
fn seals_ahead(
    round: &Round,
    (j, span_start): (MemberIdx, usize),
    len: usize,
) -> tokio::sync::mpsc::Receiver<(usize, usize, Seal)> {
    const AHEAD: usize = 4;
    let (tx, rx) = tokio::sync::mpsc::channel(AHEAD);
    let Some(signer) = round.env.signer.clone() else {
        return rx;
    };
    let flat = round.flat.clone();
    let (round_id, reducer, weight) = (round.round_id, round.peer(j), round.weight);
    let chunk_bytes = chunk_bytes_for(round.config(), len);
    tokio::task::spawn_blocking(move || {
        let part = &flat[span_start..span_start + len];
        let Ok(mut chunks) = SpanChunks::new(Codec::None, part, chunk_bytes, None) else {
            return;
        };
        while let Some(Ok(ChunkOut::Raw { values, offset, .. })) = chunks.next_chunk() {
            let seal = signer.seal_input(round_id, &reducer, span_start + offset, weight, values);
            if tx.blocking_send((offset, values.len(), seal)).is_err() {
                return;
            }
        }
    });
    rx
}

/// Fault injection: writes the rogue version of a sender's first chunk (after which the honest
/// one follows, or, for `EarlyDone`, `SendDone`: returns true to stop sending).
async fn rogue_chunk<W: futures::AsyncWrite + Unpin>(
    wr: &mut W,
    chunk: &ChunkOut<'_>,
    r: Rogue,
) -> Result<bool, SendFail> {
    let fail = |e: AveragerError| SendFail::other(e.to_string());
    match r {
        Rogue::ChunkOffset(off) => {
            let frame = rogue::with_offset(chunk, off).map_err(fail)?;
            write_data(wr, &frame).await.map_err(fail)?;
        }
        Rogue::DuplicateChunk => {
            write_chunk(wr, chunk).await.map_err(fail)?;
        }
        Rogue::EarlyDone => {
            write_chunk(wr, chunk).await.map_err(fail)?;
            return Ok(true);
        }
        _ => {}
    }
    Ok(false)
}

/// Reads a reducer's answers to a span of `len` elements: for each part, `Result` (its range and
/// contributors) and its delta chunks, until `ResultDone`; at most `gap` between frames. Returns
/// the runs of the span (offsets within it) with their contributors, and the whole delta.
///
/// When the group verifies, each part ends with the reducer's result seal, returned with the
/// part. Its root is checked here against the values received (the exact codec) on about one
/// part per span; its signature only when this peer `checks` the reducer this round. A seal
/// is of use only to the check, as evidence, and verifying every part's signature in every
/// span (ed25519, tens of microseconds each; 120 per round for 4 peers) was about a tenth of
/// the CPU verification added to a round. A reducer whose signature fails there has failed
/// the round for its checker (its span is re-delegated); elsewhere the bad seal is never used.
#[allow(clippy::too_many_arguments)]
async fn receive_results<R: futures::AsyncRead + Unpin>(
    round: &Round,
    rd: &mut R,
    from: (MemberIdx, usize),
    len: usize,
    gap: Duration,
    failed_reducer: Option<MemberIdx>,
    checks: bool,
) -> Result<(Vec<Segment>, PoolBuf, Vec<ReceivedPart>), SendFail> {
    let verifying = round.env.signer.is_some();
    let exact = round.env.values_back;
    let aggregation = round.env.config.aggregation.to_string();
    let (j, span_start) = from;
    let mut sealed: Vec<ReceivedPart> = Vec::new();
    // The part being received still owes its seal.
    let mut unsealed: Option<(Range<usize>, Vec<MemberIdx>)> = None;
    let cfg = &round.env.config;
    // Every element is decoded into before the delta is used (the span must come back whole).
    let mut delta = round.env.pool.take_dirty(len);
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
            Frame::Data => {
                let Some((part, got)) = current.as_mut() else {
                    return Err(SendFail::reducer("delta chunk outside a part"));
                };
                let h = ChunkHeader::parse(&chunk).map_err(|e| SendFail::reducer(e.to_string()))?;
                let (at, count) = (h.offset, h.count);
                let in_place = h.total == part.len() as u64
                    && at == *got as u64
                    && (*got)
                        .checked_add(count)
                        .is_some_and(|end| end <= part.len());
                if !in_place {
                    return Err(SendFail::reducer("delta chunk out of place"));
                }
                let at = *got;
                let dst = part.start + at;
                decoder
                    .decode_into(&chunk, &mut delta[dst..dst + count])
                    .map_err(|e| SendFail::reducer(e.to_string()))?;
                *got += count;
            }
            Frame::Control(ReduceMsg::ResultSeal(seal)) => {
                let complete = current.as_ref().is_some_and(|(p, got)| *got == p.len());
                let Some((part, contributors)) = unsealed.take().filter(|_| complete) else {
                    return Err(SendFail::reducer("a result seal out of place"));
                };
                let ids = round.peer_bytes(&contributors);
                let abs = span_start + part.start..span_start + part.end;
                // The root is checked against the values received on about one part per span
                // (at random), and on the block a check reveals; the signature where this peer
                // checks the reducer (see above).
                let sample = part.len() as f64 / len.max(1) as f64;
                let values =
                    (exact && rand::random::<f64>() < sample).then(|| &delta[part.clone()]);
                if !crate::verify::check_result(
                    round.round_id,
                    &round.peer(j),
                    &abs,
                    &ids,
                    &aggregation,
                    values,
                    &seal,
                    checks,
                ) {
                    return Err(SendFail::reducer(
                        "the reducer's result seal does not match its result",
                    ));
                }
                sealed.push(ReceivedPart {
                    range: abs,
                    contributors: ids,
                    seal,
                });
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
                if unsealed.is_some() {
                    return Err(SendFail::reducer(
                        "a part of the result came without its seal",
                    ));
                }
                let end = start.checked_add(part_len);
                let well_formed = start == covered as u64
                    && part_len > 0
                    && end.is_some_and(|end| end <= len as u64)
                    && contributors.contains(&round.me)
                    && contributors.iter().all(|c| {
                        c.within(round.peers.len()).is_some() && Some(*c) != failed_reducer
                    });
                if !well_formed {
                    return Err(SendFail::reducer(
                        "reducer's part or contributor list is malformed",
                    ));
                }
                // In range: checked above against `len`, a usize.
                let part = covered..covered + part_len as usize;
                if verifying {
                    unsealed = Some((part.clone(), contributors.clone()));
                }
                match segments.last_mut() {
                    Some(last) if last.1 == contributors => last.0.end = part.end,
                    _ => segments.push((part.clone(), contributors)),
                }
                current = Some((part, 0));
            }
            Frame::Control(ReduceMsg::ResultDone) => {
                let complete = current.as_ref().is_none_or(|(p, got)| *got == p.len());
                if !complete || covered != len || unsealed.is_some() {
                    return Err(SendFail::reducer("reducer's result is incomplete"));
                }
                return Ok((segments, delta, sealed));
            }
            Frame::Control(ReduceMsg::Excluded(why)) => return Err(SendFail::excluded(why)),
            Frame::Control(other) => {
                return Err(SendFail::reducer(format!("unexpected message {other:?}")))
            }
        }
    }
}

/// Opens a reduce stream to member `j` and waits (at most `wait`) for its `Ready`, retrying
/// streams that were dropped before the reducer saw them (see `starling_node::streams`).
/// Retrying is safe: a reducer counts each sender at most once.
async fn open_with_hello(
    round: &Round,
    j: MemberIdx,
    hello: &ReduceMsg,
    wait: Duration,
) -> Result<(Lane, usize), SendFail> {
    let (peer, addrs) = (round.peer(j), &round.addrs[j.get()]);
    let transport = &round.env.transport;
    // The reducer may still be starting its round: allow for that, then give up.
    let opened = open_confirmed(
        || transport.open_lane(peer, addrs, REDUCE_PROTOCOL),
        &Control::Control(hello),
        MAX_CONTROL_BYTES + 1,
        Instant::now() + wait,
        Retry {
            open_failures: UNREACHABLE_AFTER,
            ..Retry::default()
        },
    )
    .await;
    match opened {
        Ok(c) => match c.reply {
            Control::Control(ReduceMsg::Ready) => Ok((c.stream, c.sent)),
            Control::Control(ReduceMsg::Excluded(why)) => Err(SendFail::excluded(why)),
            Control::Control(other) => {
                Err(SendFail::reducer(format!("unexpected message {other:?}")))
            }
        },
        Err(OpenError::Unanswered {
            last, timed_out, ..
        }) => Err(SendFail {
            reason: format!("could not reach the reducer: {last}"),
            reducer_failed: true,
            // Every dial failed (not a reducer slow to answer): the peer is gone.
            unreachable: !timed_out,
        }),
        Err(OpenError::BadReply(e)) => Err(SendFail::reducer(e.to_string())),
    }
}

/// On a warm lane: reads the reducer's answer to the hello sent with the data (at most
/// `wait`). `Ready` admits us; `Excluded` is a refusal (`refused` is set: not worth a fresh
/// lane); anything else fails the exchange.
async fn await_ready<R: futures::AsyncRead + Unpin>(
    rd: &mut R,
    wait: Duration,
    refused: &AtomicBool,
) -> Result<(), SendFail> {
    let answer = timeout(wait, read_control::<_, ReduceMsg>(rd))
        .await
        .map_err(|_| SendFail::reducer("the reducer did not answer the hello in time"))?
        .map_err(|e| SendFail::reducer(e.to_string()))?;
    match answer {
        ReduceMsg::Ready => Ok(()),
        ReduceMsg::Excluded(why) => {
            refused.store(true, Ordering::Relaxed);
            Err(SendFail::excluded(why))
        }
        other => Err(SendFail::reducer(format!("unexpected message {other:?}"))),
    }
}

pub(super) fn decode_options(len: usize) -> DecodeOptions {
    DecodeOptions::default().with_max_elements(len.max(1))
}
