//! The verifier's side of a verified round (see [`crate::verify`]): after phase 1, with the
//! configured probability, ask one other reducer to reveal one random block of its result and
//! recompute it.

use std::ops::Range;

use rand::Rng;
use starling_node::streams::{open_confirmed, OpenError, Retry};
use tokio::time::Instant;

use super::Round;
use crate::verify::{merkle, Evidence, Seal, SignedResult};
use crate::wire::{Control, MemberIdx, ReduceMsg, MAX_CONTROL_BYTES, REDUCE_PROTOCOL};

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
}

/// With probability `verify`, picks one reducer among `received` (other members' spans whose
/// every part came back sealed), one of its parts and one block, and checks it. Returns the
/// reducer and the verdict, or `None` when this round is not checked here.
pub(super) async fn audit(
    round: &Round,
    received: &[(MemberIdx, Vec<ReceivedPart>)],
) -> Option<(MemberIdx, Verdict)> {
    let cfg = round.config();
    // No time left for a request before the caller's deadline: no check this round (rather
    // than a check that cannot be answered, which would cost a span).
    if round.deadline.saturating_duration_since(Instant::now()) < MIN_AUDIT_TIME {
        return None;
    }
    let candidates: Vec<&(MemberIdx, Vec<ReceivedPart>)> = received
        .iter()
        .filter(|(_, parts)| !parts.is_empty())
        .collect();
    let (j, part, block) = {
        let mut rng = rand::thread_rng();
        if candidates.is_empty() || !rng.gen_bool(cfg.verify.clamp(0.0, 1.0)) {
            return None;
        }
        let (j, parts) = candidates[rng.gen_range(0..candidates.len())];
        let part = &parts[rng.gen_range(0..parts.len())];
        let block = rng.gen_range(0..merkle::leaves(part.range.len()));
        (*j, part, block)
    };
    let verdict = check(round, j, part, block).await;
    Some((j, verdict))
}

/// Asks reducer `j` for block `block` of `part` and judges the answer.
async fn check(round: &Round, j: MemberIdx, part: &ReceivedPart, block: usize) -> Verdict {
    let cfg = round.config();
    let request = ReduceMsg::Reveal {
        round_id: round.round_id,
        start: part.range.start as u64,
        len: part.range.len() as u64,
        block: block as u32,
    };
    let (peer, addrs) = (round.peer(j), &round.addrs[j.get()]);
    let transport = &round.env.transport;
    let until = (Instant::now() + cfg.request_timeout).min(round.deadline);
    let opened = open_confirmed(
        || transport.open_lane(peer, addrs, REDUCE_PROTOCOL),
        &Control::Control(&request),
        MAX_CONTROL_BYTES + 1,
        until,
        Retry::default(),
    )
    .await;
    let reveal = match opened {
        Ok(c) => match c.reply {
            Control::Control(ReduceMsg::Revealed(r)) => r,
            Control::Control(ReduceMsg::Excluded(why)) => {
                return Verdict::Unanswered(format!("the reducer would not reveal: {why}"))
            }
            Control::Control(other) => {
                return Verdict::Unanswered(format!("unexpected answer {other:?}"))
            }
        },
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
            first: mine,
            second: theirs,
        };
        return match evidence.check() {
            Ok(_) => Verdict::Caught(Box::new(evidence)),
            Err(e) => Verdict::Unanswered(format!("the revealed result seal is not valid: {e}")),
        };
    }
    let evidence = Evidence::WrongResult(reveal);
    match evidence.check() {
        Ok(_) => Verdict::Caught(Box::new(evidence)),
        Err(crate::verify::EvidenceError::NoFault) => Verdict::Clean,
        Err(e) => Verdict::Unanswered(format!("the reveal does not check out: {e}")),
    }
}
