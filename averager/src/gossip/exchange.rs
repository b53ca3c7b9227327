//! One exchange on the wire, both sides, carrying out the decisions of [`proto`](super::proto)
//! (how a hello is answered, what an answer means, what a failure in each phase leaves). The initiator holds its exclusive lock from the copy of
//! its values to the application of its update; the responder takes its own with `try_lock` and
//! answers `Busy` when it cannot, so a peer is in at most one exchange at a time and nobody
//! waits on a lock while holding another (no deadlock; the initiator retries after a random
//! pause).
//!
//! ```text
//! initiator                                   responder
//!   Hello{prefix, schema, len, w_a, alpha} ->
//!                                          <- Ready{w_b} | Busy | NotServing | Refused(why)
//!   value chunks of x_a, SendDone         ->
//!                                             d = x_b - x̂_a, encoded; d̂ = its own decoding
//!                                          <- difference chunks, DiffDone
//!   x_a += c_a d̂; Applied                 ->
//!                                             x_b -= c_b d̂
//! ```

use futures::AsyncWriteExt;
use starling_compression::{ChunkHeader, DecodeOptions, Decoder};
use starling_node::streams::{open_confirmed, OpenError, Retry};
use starling_node::PeerId;
use tokio::time::{timeout, timeout_at, Instant};

use super::membership::Member;
use super::mix::difference_in_place;
use super::proto::{
    answer_hello, Hello, Initiator, InitiatorAction, InitiatorEvent, Responder, ResponderAction,
    ResponderEvent, ResponderSide,
};
use super::report::{Exchange, ExchangeOutcome, Role};
use super::Shared;
use crate::transport::{Lane, LaneReader, LaneWriter};
use crate::wire::{
    read_frame_into, write_chunk, write_control, ChunkOut, Control, Frame, GossipMsg, SpanChunks,
    GOSSIP_PROTOCOL, MAX_CONTROL_BYTES,
};

/// Exchanges logged for the next report, at most.
pub(crate) const MAX_SERVED_LOG: usize = 256;

/// How one attempt at an exchange ended.
enum Attempt {
    Done(Exchange),
    /// Busy or not serving: retry after a pause.
    Busy(Exchange),
}

fn exchange(peer: PeerId, role: Role, my_weight: f64) -> Exchange {
    Exchange {
        peer,
        role,
        outcome: ExchangeOutcome::Busy,
        my_weight,
        peer_weight: 0.0,
        moved: 0.0,
        bytes_sent: 0,
        bytes_received: 0,
        fast_lane: false,
    }
}

/// Exchanges with `target`, retrying while it is busy for up to the busy patience; never past
/// `deadline`. A failure backs the target off.
pub(crate) async fn initiate(shared: &Shared, target: &Member, deadline: Instant) -> Exchange {
    let cfg = &shared.config;
    let give_up = (Instant::now() + cfg.busy_patience).min(deadline);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let ex = match try_once(shared, target, deadline).await {
            Attempt::Done(ex) => ex,
            Attempt::Busy(ex) => {
                let pause = std::time::Duration::from_millis(
                    (5 + rand::random::<u64>() % 20) * u64::from(attempts.min(8)),
                );
                if Instant::now() + pause >= give_up {
                    ex
                } else {
                    tokio::time::sleep(pause).await;
                    continue;
                }
            }
        };
        let mut backoff = starling_node::lock::lock(&shared.backoff);
        match &ex.outcome {
            ExchangeOutcome::Averaged | ExchangeOutcome::Busy => backoff.ok(&target.peer),
            ExchangeOutcome::Failed(why) => {
                tracing::debug!(peer = %target.peer, "gossip exchange failed: {why}");
                backoff.fail(target.peer, cfg.backoff, cfg.max_backoff, Instant::now());
            }
            ExchangeOutcome::Unconfirmed(_) => {}
        }
        return ex;
    }
}

async fn try_once(shared: &Shared, target: &Member, deadline: Instant) -> Attempt {
    let cfg = &shared.config;
    let end = (Instant::now() + cfg.exchange_timeout).min(deadline);
    let peer = target.peer;
    let mut ex = exchange(peer, Role::Initiator, 0.0);
    let mut machine = Initiator::new(cfg.alpha);
    // Ends the attempt as the machine says (an action other than the one expected is an end).
    let finish = |mut ex: Exchange, action: InitiatorAction| match action {
        InitiatorAction::Retry => Attempt::Busy(ex),
        InitiatorAction::End(ended) => {
            ex.outcome = ended;
            Attempt::Done(ex)
        }
        other => {
            ex.outcome = ExchangeOutcome::Failed(format!("unexpected step {other:?}"));
            Attempt::Done(ex)
        }
    };
    // Our own exchanges (as responder) are bounded: wait for the one in flight.
    let Ok(_guard) = timeout_at(end, shared.exclusive.clone().lock_owned()).await else {
        return Attempt::Done(ex); // Busy: our own side stayed busy until the deadline
    };
    let served = shared.served();
    let mut x = Vec::new();
    let w_a = served
        .as_ref()
        .map(|s| f64::from(s.buffer.copy_out(&mut x)));
    let (served, w_a) = match (served, machine.on(InitiatorEvent::Locked(w_a)), w_a) {
        (Some(s), InitiatorAction::SendHello, Some(w)) => (s, w),
        (_, action, _) => return finish(ex, action),
    };
    ex.my_weight = w_a;
    let hello = GossipMsg::Hello {
        prefix: cfg.prefix.clone(),
        schema: served.schema,
        len: x.len() as u64,
        weight: w_a,
        alpha: cfg.alpha,
    };
    let open_by = (Instant::now() + cfg.request_timeout).min(end);
    let transport = &shared.transport;
    let opened = open_confirmed(
        || transport.open_lane(peer, &target.addrs, GOSSIP_PROTOCOL),
        &Control::Control(&hello),
        MAX_CONTROL_BYTES + 1,
        open_by,
        Retry {
            attempts: 4,
            pause: std::time::Duration::from_millis(25),
            ..Retry::default()
        },
    )
    .await;
    let confirmed = match opened {
        Ok(c) => c,
        Err(e) => {
            let why = match e {
                OpenError::Unanswered { last, .. } => format!("no answer: {last}"),
                OpenError::BadReply(e) => format!("bad answer: {e}"),
            };
            return finish(ex, machine.on(InitiatorEvent::Failed(why)));
        }
    };
    ex.bytes_sent += confirmed.sent as u64;
    ex.fast_lane = confirmed.stream.is_fast();
    let Control::Control(reply) = confirmed.reply;
    match machine.on(InitiatorEvent::Answer(reply)) {
        InitiatorAction::SendValues { w_b } => ex.peer_weight = w_b,
        action => return finish(ex, action),
    }
    let (mut rd, mut wr) = confirmed.stream.split();
    let send = async {
        let mut n = write_vector(shared, &mut wr, &x, None).await?;
        n += write_control(&mut wr, &GossipMsg::SendDone)
            .await
            .map_err(|e| e.to_string())?;
        wr.flush().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(n)
    };
    match timeout_at(end, send).await {
        Ok(Ok(n)) => ex.bytes_sent += n as u64,
        Ok(Err(why)) => return finish(ex, machine.on(InitiatorEvent::Failed(why))),
        Err(_) => return finish(ex, machine.on(InitiatorEvent::Failed("timed out".into()))),
    }
    match machine.on(InitiatorEvent::Sent) {
        InitiatorAction::ReadDifference => {}
        action => return finish(ex, action),
    }
    let mut d_hat = x; // reuse the copy's allocation
    let read = read_vector(shared, &mut rd, &mut d_hat, |m| {
        matches!(m, GossipMsg::DiffDone)
    });
    match timeout_at(end, read).await {
        Ok(Ok(n)) => ex.bytes_received += n as u64,
        Ok(Err(why)) => return finish(ex, machine.on(InitiatorEvent::Failed(why))),
        Err(_) => return finish(ex, machine.on(InitiatorEvent::Failed("timed out".into()))),
    }
    let c_a = match machine.on(InitiatorEvent::Difference) {
        InitiatorAction::Apply { c_a } => c_a,
        action => return finish(ex, action),
    };
    if !served.buffer.add_scaled(&d_hat, c_a) {
        // Nothing was added, so this is a failure before applying, whatever the machine's
        // phase (it moved to `Applied` when it asked for the update).
        let why = "the local vector changed size during the exchange".into();
        ex.outcome = ExchangeOutcome::Failed(why);
        return Attempt::Done(ex);
    }
    // Applied: from here on a lost confirmation moves the pair's mass (see the report).
    let confirm = async {
        let n = write_control(&mut wr, &GossipMsg::Applied)
            .await
            .map_err(|e| e.to_string())?;
        wr.flush().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(n)
    };
    let event = match timeout_at(end, confirm).await {
        Ok(Ok(n)) => {
            ex.bytes_sent += n as u64;
            InitiatorEvent::Confirmed
        }
        Ok(Err(why)) => InitiatorEvent::Failed(format!("confirmation not sent: {why}")),
        Err(_) => InitiatorEvent::Failed("confirmation timed out".into()),
    };
    if let InitiatorAction::End(ended) = machine.on(event) {
        if ended == ExchangeOutcome::Averaged {
            ex.moved = f64::from(c_a);
        }
        ex.outcome = ended;
    }
    let _ = timeout(cfg.request_timeout, wr.close()).await;
    shared.count(&ex);
    Attempt::Done(ex)
}

/// Answers an inbound exchange (the stream's first message was `msg`).
pub(crate) async fn respond(shared: &Shared, peer: PeerId, msg: GossipMsg, mut lane: Lane) {
    let cfg = &shared.config;
    let GossipMsg::Hello {
        prefix,
        schema,
        len,
        weight: w_a,
        alpha,
    } = msg
    else {
        tracing::debug!(%peer, "gossip stream opened without a hello");
        return;
    };
    // The lock first (a try: never waits), then everything the answer depends on under it.
    let guard = shared.exclusive.clone().try_lock_owned().ok();
    let served = shared.served();
    let codec = cfg.codec.to_string();
    let me = Responder {
        prefix: &cfg.prefix,
        alpha: cfg.alpha,
        codec: &codec,
        served: served.as_ref().map(|s| {
            (
                s.schema,
                s.buffer.len() as u64,
                f64::from(s.buffer.weight()),
            )
        }),
        free: guard.is_some(),
    };
    let hello = Hello {
        prefix: &prefix,
        schema,
        len,
        weight: w_a,
        alpha,
    };
    let answer = answer_hello(&me, &hello);
    let (_guard, served, c_b, w_b) = match (answer, guard, served) {
        (Ok((c_b, w_b)), Some(g), Some(s)) => (g, s, c_b, w_b),
        (answer, _, _) => {
            let answer = answer.err().unwrap_or(GossipMsg::NotServing);
            let _ = timeout(cfg.request_timeout, async {
                write_control(&mut lane, &answer).await?;
                lane.flush().await?;
                Ok::<_, crate::AveragerError>(())
            })
            .await;
            return;
        }
    };
    let mut ex = exchange(peer, Role::Responder, 0.0);
    ex.fast_lane = lane.is_fast();
    ex.my_weight = w_b;
    ex.peer_weight = w_a;
    let (mut rd, mut wr) = lane.split();
    let len = len as usize; // equals our buffer's length, checked above
    let mut machine = ResponderSide::new(c_b);
    // Receiving and sending the difference share one bound, as the initiator's do.
    let end = Instant::now() + cfg.exchange_timeout;
    let receive = async {
        let mut n = write_control(&mut wr, &GossipMsg::Ready { weight: w_b })
            .await
            .map_err(|e| e.to_string())?;
        wr.flush().await.map_err(|e| e.to_string())?;
        let mut d = vec![0.0f32; len];
        let got = read_vector(shared, &mut rd, &mut d, |m| {
            matches!(m, GossipMsg::SendDone)
        })
        .await?;
        n += got;
        Ok::<_, String>((d, n, got))
    };
    let mut step = match timeout_at(end, receive).await {
        Ok(Ok((d, sent, got))) => {
            ex.bytes_sent += sent as u64;
            ex.bytes_received += got as u64;
            Ok((d, machine.on(ResponderEvent::Received)))
        }
        Ok(Err(why)) => Err(machine.on(ResponderEvent::Failed(why))),
        Err(_) => Err(machine.on(ResponderEvent::Failed("timed out".into()))),
    };
    if let Ok((d, ResponderAction::SendDifference)) = step {
        let mut d = d;
        let send = async {
            let mut x_b = Vec::new();
            served.buffer.copy_out(&mut x_b);
            if x_b.len() != len {
                return Err("the local vector changed size".to_string());
            }
            difference_in_place(&mut d, &x_b);
            // What the initiator will decode of the difference, bit for bit: both sides apply it.
            let mut d_hat = x_b;
            let mut n = write_vector(shared, &mut wr, &d, Some(&mut d_hat)).await?;
            n += write_control(&mut wr, &GossipMsg::DiffDone)
                .await
                .map_err(|e| e.to_string())?;
            wr.flush().await.map_err(|e| e.to_string())?;
            Ok::<_, String>((d_hat, n))
        };
        step = match timeout_at(end, send).await {
            Ok(Ok((d_hat, n))) => {
                ex.bytes_sent += n as u64;
                Ok((d_hat, machine.on(ResponderEvent::Sent)))
            }
            Ok(Err(why)) => Err(machine.on(ResponderEvent::Failed(why))),
            Err(_) => Err(machine.on(ResponderEvent::Failed("timed out".into()))),
        };
    }
    let action = match step {
        Ok((d_hat, ResponderAction::AwaitConfirmation)) => {
            let mut buf = Vec::new();
            let confirmed = timeout(
                cfg.exchange_timeout,
                read_frame_into::<_, GossipMsg>(&mut rd, MAX_CONTROL_BYTES + 1, &mut buf),
            )
            .await;
            let event = match confirmed {
                Ok(Ok((Frame::Control(GossipMsg::Applied), n))) => {
                    ex.bytes_received += n as u64;
                    ResponderEvent::Confirmed
                }
                Ok(Ok(_)) => ResponderEvent::Failed("expected the confirmation".into()),
                Ok(Err(e)) => ResponderEvent::Failed(format!("no confirmation: {e}")),
                Err(_) => ResponderEvent::Failed("confirmation timed out".into()),
            };
            match machine.on(event) {
                ResponderAction::Apply { c_b } => {
                    if served.buffer.add_scaled(&d_hat, -c_b) {
                        ex.moved = f64::from(c_b);
                        ResponderAction::End(ExchangeOutcome::Averaged)
                    } else {
                        ResponderAction::End(ExchangeOutcome::Unconfirmed(
                            "the local vector changed size".into(),
                        ))
                    }
                }
                other => other,
            }
        }
        Ok((_, action)) | Err(action) => action,
    };
    ex.outcome = match action {
        ResponderAction::End(ended) => ended,
        other => ExchangeOutcome::Failed(format!("unexpected step {other:?}")),
    };
    if let ExchangeOutcome::Unconfirmed(why) = &ex.outcome {
        tracing::warn!(%peer, "gossip exchange left unconfirmed, local values kept: {why}");
    }
    let _ = timeout(cfg.request_timeout, wr.close()).await;
    shared.count(&ex);
    shared.log_served(ex);
}

/// Writes `data` as chunks under the configured codec; with `decoded`, also writes there what
/// the other side will decode of each chunk. Returns the bytes written.
async fn write_vector(
    shared: &Shared,
    wr: &mut LaneWriter,
    data: &[f32],
    mut decoded: Option<&mut Vec<f32>>,
) -> Result<usize, String> {
    let cfg = &shared.config;
    let mut chunks =
        SpanChunks::new(cfg.codec, data, cfg.chunk_bytes, None).map_err(|e| e.to_string())?;
    let mut sent = 0;
    while let Some(chunk) = chunks.next_chunk() {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if let Some(out) = decoded.as_deref_mut() {
            match &chunk {
                ChunkOut::Raw { values, offset, .. } => {
                    out[*offset..*offset + values.len()].copy_from_slice(values)
                }
                ChunkOut::Encoded(bytes) => {
                    let h = ChunkHeader::parse(bytes).map_err(|e| e.to_string())?;
                    let at = h.offset as usize; // our own encoder's header: in range
                    starling_compression::decode_into(bytes, &mut out[at..at + h.count])
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        sent += write_chunk(wr, &chunk).await.map_err(|e| e.to_string())?;
    }
    Ok(sent)
}

/// Reads a vector of `out.len()` elements sent as chunks in order, then the control message
/// `done` accepts; every chunk must continue where the last ended. Returns the bytes read.
async fn read_vector(
    shared: &Shared,
    rd: &mut LaneReader,
    out: &mut [f32],
    done: fn(&GossipMsg) -> bool,
) -> Result<usize, String> {
    let len = out.len();
    let mut decoder = Decoder::new(DecodeOptions::default().with_max_elements(len.max(1)));
    let mut buf = Vec::new();
    let (mut got, mut bytes) = (0usize, 0usize);
    loop {
        let (frame, n) =
            read_frame_into::<_, GossipMsg>(rd, shared.config.max_frame_bytes, &mut buf)
                .await
                .map_err(|e| e.to_string())?;
        bytes += n;
        match frame {
            Frame::Data => {
                let h = ChunkHeader::parse(&buf).map_err(|e| e.to_string())?;
                let in_place = h.total == len as u64
                    && h.offset == got as u64
                    && got.checked_add(h.count).is_some_and(|end| end <= len);
                if !in_place {
                    return Err("chunk out of place".into());
                }
                decoder
                    .decode_into(&buf, &mut out[got..got + h.count])
                    .map_err(|e| e.to_string())?;
                got += h.count;
            }
            Frame::Control(m) if done(&m) => {
                if got != len {
                    return Err(format!("{got} of {len} elements arrived"));
                }
                return Ok(bytes);
            }
            Frame::Control(m) => return Err(format!("unexpected message {m:?}")),
        }
    }
}
