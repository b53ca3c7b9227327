//! The verifier's side of a verified round (see [`crate::verify`]): after phase 1, with the
//! configured probability, ask one other reducer to reveal one random block of its result and
//! recompute it. Also the reducer's record of what it reduced (its transcript), from which it
//! answers such checks.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use rand::Rng;
use starling_node::streams::{open_confirmed, OpenError, Retry};
use tokio::time::Instant;

use super::Round;
use crate::pool::PoolBuf;
use crate::transport::Lane;
use crate::verify::{
    merkle, Evidence, InputValues, Seal, SealedPart, SignedResult, Transcript, TranscriptInput,
};
use crate::wire::{
    read_control, write_control, Control, MemberIdx, ReduceMsg, MAX_CONTROL_BYTES, REDUCE_PROTOCOL,
};
use starling_node::lock::lock;

/// Least time before the round's deadline worth starting a check in.
const MIN_AUDIT_TIME: std::time::Duration = std::time::Duration::from_millis(100);

/// A part of a reducer's result as this sender received it, with the reducer's seal.
pub(crate) struct ReceivedPart {
    /// Absolute range.
    pub range: Range<usize>,
    /// The contributors' peer ids, in member order.
    pub contributors: Vec<Vec<u8>>,
    pub seal: Seal,
}

/// What checking one block of a reducer's result found.
pub(crate) enum Verdict {
    /// The block recomputes to the sealed result.
    Clean,
    /// The reducer lied; the evidence has been checked.
    Caught(Box<Evidence>),
    /// No verdict: the reducer did not show the block (in time, or at all), or what it showed
    /// does not check out. Nothing can be proven, but its span is not applied.
    Unanswered(String),
    /// The reducer sent this peer other values than it sealed: certain, but not provable to
    /// others. Its span is not applied and this peer refuses it.
    SentOtherThanSealed,
}

/// With probability `verify` (this peer's own coin), the reducer this peer checks this
/// round (`None` when this round is not checked here, or this peer sends nothing). Which
/// reducer is not drawn independently by each member: the members that send are assigned to
/// the reducers by a rotation every member derives from the round ([`assigned`]), so each
/// reducer has its own checker and, with `verify = 1`, every span is checked every round.
/// Drawn independently, about a third of the reducers of a group of 8 went unchecked in each
/// round even then (`(1 - 1/7)^7`), and a lying reducer's first rounds were often applied.
pub(super) fn choose(round: &Round) -> Option<MemberIdx> {
    let cfg = round.config();
    if cfg.verify <= 0.0 || round.env.signer.is_none() {
        return None;
    }
    let checkers: Vec<MemberIdx> = MemberIdx::all(round.peers.len())
        .filter(|i| round.modes[i.get()] != crate::AveragingMode::Aux)
        .collect();
    let reducers: Vec<MemberIdx> = MemberIdx::all(round.peers.len())
        .filter(|j| !round.ranges[j.get()].is_empty())
        .collect();
    let seed = {
        let mut h = blake3::Hasher::new();
        h.update(&round.round_id.to_le_bytes());
        for p in &round.peers {
            h.update(&p.to_bytes());
        }
        let bytes = h.finalize();
        u64::from_le_bytes(bytes.as_bytes()[..8].try_into().expect("8 bytes"))
    };
    let target = assigned(&checkers, &reducers, round.me, seed)?;
    let mut rng = rand::thread_rng();
    rng.gen_bool(cfg.verify.clamp(0.0, 1.0)).then_some(target)
}

/// The reducer checker `me` is assigned in a round whose shared seed is `seed`: the checkers
/// (in member order) are rotated onto the reducers by an offset taken from the seed, never onto
/// themselves. When the checkers and the reducers are the same members (every member sends and
/// reduces), the assignment is a permutation without fixed points: every reducer has exactly
/// one checker. `None` when `me` does not check or no other member reduces.
fn assigned(
    checkers: &[MemberIdx],
    reducers: &[MemberIdx],
    me: MemberIdx,
    seed: u64,
) -> Option<MemberIdx> {
    let c = checkers.iter().position(|&i| i == me)?;
    let others = reducers.iter().filter(|&&j| j != me).count();
    if others == 0 {
        return None;
    }
    let n = reducers.len();
    // An offset in 1..n: a rotation of the members onto themselves that moves everyone.
    let offset = 1 + (seed % (n.max(2) as u64 - 1)) as usize;
    let mut k = (c + offset) % n;
    if reducers[k] == me {
        k = (k + 1) % n;
    }
    Some(reducers[k])
}

/// Checks one random block of reducer `j`'s result, which this peer received as `sealed`
/// parts and (with the exact codec) as the new `values` of the span starting at `span_start`.
/// Runs as soon as that span is back, beside the rest of the round.
pub(super) async fn check_span(
    round: &Round,
    j: MemberIdx,
    sealed: &[ReceivedPart],
    span_start: usize,
    values: &[f32],
) -> Verdict {
    // No time left for a request before the caller's deadline: the span cannot be checked,
    // so it is not applied.
    if round.deadline.saturating_duration_since(Instant::now()) < MIN_AUDIT_TIME {
        return Verdict::Unanswered("no time left to check the span".into());
    }
    let (part, block) = {
        let mut rng = rand::thread_rng();
        if sealed.is_empty() {
            return Verdict::Unanswered("the span came back without seals".into());
        }
        let part = &sealed[rng.gen_range(0..sealed.len())];
        let block = rng.gen_range(0..merkle::leaves(part.range.len()));
        (part, block)
    };
    let got = (round.env.values_back).then(|| {
        let b = merkle::block_range(part.range.len(), block);
        let at = part.range.start - span_start + b.start;
        &values[at..at + b.len()]
    });
    check(round, j, part, block, got).await
}

/// Asks reducer `j` for block `block` of `part` and judges the answer (`got`: the block as
/// this peer received it, with the exact codec).
async fn check(
    round: &Round,
    j: MemberIdx,
    part: &ReceivedPart,
    block: usize,
    got: Option<&[f32]>,
) -> Verdict {
    let cfg = round.config();
    let request = ReduceMsg::Reveal {
        round_id: round.round_id,
        start: part.range.start as u64,
        len: part.range.len() as u64,
        block: block as u32,
    };
    let peer = round.peer(j);
    let until = (Instant::now() + cfg.request_timeout).min(round.deadline);
    let reveal = match ask(round, j, &request, until).await {
        Ok(ReduceMsg::Revealed(r)) => r,
        Ok(ReduceMsg::Excluded(why)) => {
            return Verdict::Unanswered(format!("the reducer would not reveal: {why}"))
        }
        Ok(other) => return Verdict::Unanswered(format!("unexpected answer {other:?}")),
        Err(OpenError::Unanswered { last, .. }) => {
            return Verdict::Unanswered(format!("the reducer did not answer: {last}"))
        }
        Err(OpenError::BadReply(e)) => return Verdict::Unanswered(e.to_string()),
    };
    let asked = reveal.round_id == round.round_id
        && reveal.reducer == peer.to_bytes()
        && reveal.start == part.range.start as u64
        && reveal.len == part.range.len() as u64
        && reveal.block as usize == block;
    if !asked {
        return Verdict::Unanswered("the reducer revealed another block".into());
    }
    let aggregation = cfg.aggregation.to_string();
    let mine = SignedResult {
        contributors: part.contributors.clone(),
        aggregation: aggregation.clone(),
        seal: part.seal.clone(),
    };
    let theirs = SignedResult {
        contributors: reveal.contributors.clone(),
        aggregation: reveal.aggregation.clone(),
        seal: reveal.result_seal.clone(),
    };
    if mine != theirs {
        // Two results signed for one part: proof by itself, if the second signature holds.
        let evidence = Evidence::Equivocation {
            round_id: round.round_id,
            reducer: peer.to_bytes(),
            start: reveal.start,
            len: reveal.len,
            first: Box::new(mine),
            second: Box::new(theirs),
        };
        return match evidence.check() {
            Ok(_) => Verdict::Caught(Box::new(evidence)),
            Err(e) => Verdict::Unanswered(format!("the revealed result seal is not valid: {e}")),
        };
    }
    // What it sealed must be what it sent us (checked on about one part per span on receipt).
    // A difference is certain here but cannot be shown to anyone else (what it sent is not
    // signed): this peer refuses it for itself.
    if got.is_some_and(|g| {
        bytemuck::cast_slice::<f32, u8>(g) != bytemuck::cast_slice::<f32, u8>(&reveal.result)
    }) {
        return Verdict::SentOtherThanSealed;
    }
    let evidence = Evidence::WrongResult(reveal);
    match evidence.check() {
        Ok(_) => Verdict::Caught(Box::new(evidence)),
        Err(crate::verify::EvidenceError::NoFault) => Verdict::Clean,
        Err(e) => Verdict::Unanswered(format!("the reveal does not check out: {e}")),
    }
}

/// Sends `msg` (a reveal request or a verdict) to member `j` and reads its one-message answer.
/// On the warm lane this round's exchange with `j` left idle when there is one: no new
/// connection (opening one took 4-7 ms on a busy loopback, and every member waits for the
/// slowest verdict), and the lane stays warm for the next round. Otherwise, or if that lane
/// breaks before answering, on a lane of its own.
async fn ask(
    round: &Round,
    j: MemberIdx,
    msg: &ReduceMsg,
    until: Instant,
) -> Result<ReduceMsg, OpenError> {
    let (peer, addrs) = (round.peer(j), &round.addrs[j.get()]);
    let transport = &round.env.transport;
    if let Some(lane) = transport.take_idle(peer) {
        let mut lane = Lane::Fast(Box::new(lane));
        let answer = tokio::time::timeout_at(until, async {
            write_control(&mut lane, msg).await?;
            read_control::<_, ReduceMsg>(&mut lane).await
        })
        .await;
        match answer {
            Ok(Ok(reply)) => {
                if let Lane::Fast(lane) = lane {
                    transport.keep_idle(peer, *lane);
                }
                return Ok(reply);
            }
            Ok(Err(e)) => tracing::debug!(%peer, "a warm lane broke, opening one: {e}"),
            Err(_) => {
                return Err(OpenError::Unanswered {
                    attempts: 1,
                    last: "no answer on the warm lane in time".into(),
                    timed_out: true,
                })
            }
        }
    }
    open_confirmed(
        || transport.open_lane(peer, addrs, REDUCE_PROTOCOL),
        &Control::Control(msg),
        MAX_CONTROL_BYTES + 1,
        until,
        Retry::default(),
    )
    .await
    .map(|c| {
        if let Lane::Fast(lane) = c.stream {
            transport.keep_idle(peer, *lane);
        }
        let Control::Control(reply) = c.reply;
        reply
    })
}

/// Least time a member waits for the others' verdicts after its own phase 1 (see
/// [`verdict_wait`]).
const MIN_VERDICT_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// How long after its own phase 1 a member waits for the other members' verdicts: as long as
/// its phase 1 took (members reduce side by side, so the others' end about when its own does,
/// plus one check), at least [`MIN_VERDICT_WAIT`], at most the request timeout, and never past
/// the round's deadline. A member whose verdict does not come within it (crashed, or very
/// slow) holds back nobody for longer.
pub(super) fn verdict_wait(round: &Round, phase1: std::time::Duration) -> Instant {
    let wait = phase1.clamp(
        MIN_VERDICT_WAIT,
        round.config().request_timeout.max(MIN_VERDICT_WAIT),
    );
    (Instant::now() + wait).min(round.deadline)
}

/// Sends this member's verdict (`evidence` if its check caught a reducer) to every other
/// member but `skip` (those seen failing), each on a stream of its own, in the background:
/// each send ends when the member has queued it, or by the request timeout.
pub(super) fn send_verdicts(
    round: &std::sync::Arc<Round>,
    evidence: Option<Box<Evidence>>,
    skip: &std::collections::HashSet<MemberIdx>,
) {
    let msg = ReduceMsg::Verdict {
        round_id: round.round_id,
        evidence,
    };
    let until = (Instant::now() + round.config().request_timeout).min(round.deadline);
    for j in MemberIdx::all(round.peers.len()).filter(|j| *j != round.me && !skip.contains(j)) {
        let (round, msg) = (round.clone(), msg.clone());
        let send = async move {
            if let Err(e) = ask(&round, j, &msg, until).await {
                tracing::debug!(peer = %round.peer(j), "sending this round's verdict: {e}");
            }
        };
        tokio::spawn(tracing::Instrument::in_current_span(send));
    }
}

/// What the other members' verdicts said.
#[derive(Default)]
pub(super) struct Verdicts {
    /// Checked evidence against a member of this round: (accused, accuser, the evidence).
    pub accusations: Vec<(MemberIdx, MemberIdx, Box<Evidence>)>,
    /// Members whose verdict did not come in time.
    pub missing: Vec<MemberIdx>,
}

/// Waits until every member but this one and `skip` has sent its verdict, or until `until`;
/// checks the evidence they carry. Evidence that accuses a peer of another round is proof all
/// the same: that peer is refused here too. Evidence that does not check out is dropped.
pub(super) async fn collect_verdicts(
    round: &Round,
    rx: &mut tokio::sync::mpsc::Receiver<crate::router::IncomingVerdict>,
    skip: &std::collections::HashSet<MemberIdx>,
    until: Instant,
) -> Verdicts {
    let mut waiting: std::collections::HashSet<MemberIdx> = MemberIdx::all(round.peers.len())
        .filter(|j| *j != round.me && !skip.contains(j))
        .collect();
    let mut out = Verdicts::default();
    while !waiting.is_empty() {
        let Ok(Some(v)) = tokio::time::timeout_at(until, rx.recv()).await else {
            break;
        };
        let Some(from) = round
            .peers
            .iter()
            .position(|p| *p == v.peer)
            .map(MemberIdx::of)
        else {
            continue;
        };
        waiting.remove(&from);
        let Some(evidence) = v.evidence else {
            continue;
        };
        match evidence.check() {
            // (Evidence against this peer itself changes nothing here.)
            Ok(accused) if accused == round.peer(round.me) => {}
            Ok(accused) => {
                round.env.banned.insert(&accused);
                let member = round.peers.iter().position(|p| *p == accused);
                match member {
                    Some(k) if evidence.round_id() == round.round_id => {
                        tracing::warn!(accuser = %v.peer, "a member caught a reducer of this round lying: {evidence}");
                        out.accusations.push((MemberIdx::of(k), from, evidence));
                    }
                    _ => {
                        tracing::warn!(accuser = %v.peer, "a member holds evidence of an earlier lie: {evidence}")
                    }
                }
            }
            Err(e) => {
                tracing::debug!(from = %v.peer, "a verdict's evidence does not check out: {e}")
            }
        }
    }
    out.missing = waiting.into_iter().collect();
    out.missing.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every member sends and reduces: whatever the seed, each reducer is assigned exactly one
    /// checker and nobody checks itself. With a member that only sends (a client), every
    /// reducer is still covered and nobody is assigned itself.
    #[test]
    fn the_rotation_gives_every_reducer_a_checker_and_nobody_itself() {
        for n in 2..=12usize {
            let all: Vec<MemberIdx> = MemberIdx::all(n).collect();
            for seed in [0u64, 1, 2, 7, 12345, u64::MAX] {
                let targets: Vec<MemberIdx> = all
                    .iter()
                    .map(|&me| assigned(&all, &all, me, seed).unwrap())
                    .collect();
                for (me, t) in all.iter().zip(&targets) {
                    assert_ne!(me, t, "n {n} seed {seed}: checks itself");
                }
                let mut sorted = targets.clone();
                sorted.sort();
                assert_eq!(sorted, all, "n {n} seed {seed}: not a permutation");
            }
            // Member 0 only sends; the others reduce.
            let reducers = &all[1..];
            if reducers.len() >= 2 {
                for seed in [0u64, 3, 99] {
                    let targets: Vec<MemberIdx> = all
                        .iter()
                        .map(|&me| assigned(&all, reducers, me, seed).unwrap())
                        .collect();
                    for (me, t) in all.iter().zip(&targets) {
                        assert_ne!(me, t);
                        assert!(reducers.contains(t));
                    }
                    for r in reducers {
                        assert!(targets.contains(r), "n {n} seed {seed}: {r} unchecked");
                    }
                }
            }
        }
        // Alone with its own span: nothing to check.
        let one = [MemberIdx::of(0)];
        assert_eq!(assigned(&one, &one, MemberIdx::of(0), 5), None);
        // Not a checker (an auxiliary peer): nothing.
        let two: Vec<MemberIdx> = MemberIdx::all(2).collect();
        assert_eq!(assigned(&two[..1], &two, MemberIdx::of(1), 5), None);
    }
}

/// What a verifying reducer records for its transcript.
#[derive(Default)]
pub(super) struct AuditLog {
    pub inputs: BTreeMap<MemberIdx, (f64, Arc<Mutex<PoolBuf>>, Seals)>,
    pub parts: Vec<SealedPart>,
    /// Whether its own values are in some part (sealed when revealed).
    pub own: bool,
}

/// A sender's seals as they arrive, by absolute chunk start: (chunk length, seal).
pub(super) type Seals = Arc<Mutex<HashMap<usize, (usize, Seal)>>>;

/// Keeps what a verifying reducer needs to answer reveals of its span: every contributor's
/// values and seals, its result and result seals (see [`crate::verify::Transcript`]).
pub(super) fn keep_transcript(
    round: &Round,
    range: &Range<usize>,
    audit: AuditLog,
    result: &PoolBuf,
) {
    let pool = &round.env.pool;
    let peer = |m: MemberIdx| round.peer(m).to_bytes();
    let mut inputs: BTreeMap<MemberIdx, TranscriptInput> = audit
        .inputs
        .into_iter()
        .map(|(m, (weight, values, seals))| {
            let seals = std::mem::take(&mut *lock(&seals));
            let input = TranscriptInput {
                peer: peer(m),
                weight,
                values: InputValues::Staged(values),
                seals,
                sealer: None,
            };
            (m, input)
        })
        .collect();
    if audit.own {
        inputs.insert(
            round.me,
            TranscriptInput {
                peer: peer(round.me),
                weight: round.weight,
                values: InputValues::Own(round.flat.clone()),
                seals: HashMap::new(),
                sealer: round.env.signer.clone(),
            },
        );
    }
    round.env.transcripts.keep(Transcript {
        round_id: round.round_id,
        reducer: peer(round.me),
        aggregation: round.config().aggregation.to_string(),
        span: range.clone(),
        inputs,
        parts: audit.parts,
        result: pool.copy_of(result),
    });
}
