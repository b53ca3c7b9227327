//! Checked reducers and excluded liars (`AveragerConfig::verify`).
//!
//! A robust aggregator ([`crate::Aggregation`]) bounds what a lying *sender* can do; this
//! module is about lying *reducers*, which could otherwise return any result they like for
//! their span. The protocol, in every round of a group that verifies:
//!
//! 1. **Senders commit before results exist.** After each data chunk a sender sends a
//!    [`Seal`]: the root of a hash tree over the chunk's values as the reducer decodes them
//!    (BLAKE3's own tree, [`merkle`]: the root is `blake3::hash` of the values' bytes, and
//!    any block of [`merkle::BLOCK`] values can be proven to belong to it), signed with its
//!    node identity together with the round, both peer ids, the chunk's range and its weight
//!    ([`evidence::input_message`]). The reducer checks every seal's signature, and one random
//!    chunk's root against what it decoded, before it uses the data (a seal that fails is
//!    refused like a malformed chunk); the other roots are checked when a block of them is
//!    revealed, so a sender that seals other values than it sends makes that reveal fail (the
//!    reducer says so instead of answering) and is caught at once where its one checked chunk
//!    lands.
//! 2. **Reducers sign results.** After each part of the result the reducer sends a result seal
//!    over the part's values, its contributors and the aggregation
//!    ([`evidence::result_message`]). The member that checks this reducer in the round (step
//!    3; known before the round's exchanges) checks every seal's signature as it arrives; the
//!    others keep the seals unverified, as they never use them. With the exact codec (`none`),
//!    where each sender receives the part's values themselves, every sender also checks the
//!    root against them on about one random part per span. A reducer whose seal does not
//!    match what it sent has failed the round (its span is re-delegated). The reducer keeps a
//!    transcript of the round (every contributor's values and seals, its result and seals) for
//!    a while. Its own contribution is sealed when a block of it is revealed.
//! 3. **Random blocks are recomputed.** After its round, each member, with probability
//!    `verify` (its own coin), checks the reducer it is assigned: the members are rotated onto
//!    the reducers by an offset all of them derive from the round (its id and members), so each
//!    reducer has one checker and, with `verify = 1`, every span is checked in every round. It
//!    picks by its own randomness one part of that reducer's result and one block of it, and
//!    asks the reducer to reveal it ([`evidence::Reveal`]): each
//!    contributor's values of the block with their proofs and seals, and the result block
//!    with its proof and seal. The verifier checks the result seal is the one it received, the
//!    result block is what it received (exact codec), every signature and proof, and
//!    recomputes the block with the group's aggregation.
//! 4. **Liars are caught with proof.** A recomputed block that differs (by more than
//!    summation order explains: 10⁻⁵ of the coordinate's largest input), or a revealed result
//!    seal that differs from the one received, is [`Evidence`] that anyone can check from its
//!    contents alone. The verifier does not apply that reducer's span (it keeps its own values
//!    there), refuses the reducer at once, and publishes the evidence in the DHT under
//!    `{prefix}.evidence` (under its own owner marker, so nobody can overwrite it). Every
//!    averager reads that key in the background ([`EVIDENCE_POLL`]), checks each new entry,
//!    and refuses the guilty peer in matchmaking for as long as it runs: it never declares with
//!    it, never takes its join request, and leaves a group whose leader lists it. Evidence that
//!    does not check out changes nothing.
//! 5. **Nobody applies a round before the checks are in.** When its sends are back (and its
//!    check done), each member sends every other member its verdict
//!    ([`crate::wire::ReduceMsg::Verdict`]: the evidence if it caught someone, else nothing),
//!    and applies the round only once every member's verdict has come, or its wait is over
//!    (as long as its own first phase took, at least 250 ms, at most the request timeout). A
//!    reducer that checked evidence accuses is refused at once and its span is not applied by
//!    any member that heard the verdict in time: in the round a liar is caught, no honest
//!    member applies its lie.
//!
//! A reducer that does not answer a reveal in time, or cannot show a block, is not accused
//! (that cannot be proven), but the verifier does not apply its span either. A reducer whose
//! revealed result block differs from what it sent the verifier is refused by that verifier
//! alone (what it sent is not signed, so others cannot check it).
//!
//! **What it costs.** Each sender hashes what it sends (BLAKE3, 6-7 GB/s on one core here);
//! each reducer hashes its result and one chunk per sender; each sender one part per span of
//! the results; one signature per chunk and part, each input seal's verified by its reducer and
//! each result seal's by the reducer's checker. A verifying member makes one request of a few
//! KiB (one block of each contributor) after its round, and the reducer hashes the revealed
//! part of each contributor to build the proofs: the verifier's round lasts one round trip
//! longer, and every member waits for the slowest member's verdict (one more message after the
//! slowest check). Reveals and verdicts travel on the lanes the round's exchanges left warm
//! (a new lane would cost a handshake's round trips); with the exact codec a sender hashes and
//! signs its chunks on a blocking thread ahead of its writes. Measured figures are in the
//! README ("Checked reducers").
//!
//! **What it cannot catch.**
//! - A reducer that alters a fraction `f` of its blocks is caught by one check with
//!   probability `f`: a liar that changes one block in a thousand mostly goes unseen for a long
//!   time; one that alters its whole span is caught by the first check of its span. With
//!   `verify = p`, each round checks a given reducer's span with probability `p` (its
//!   assigned checker's coin; with independent picks it was `1 − (1 − p/(n−1))^(n−1)`, 0.66
//!   for `p = 1`, `n = 8`). What a liar's unchecked rounds applied before the round it is
//!   caught in is not undone. A liar knows which member checks it (the rotation is public),
//!   not whether: a colluding checker lets it through in the rounds the rotation pairs them.
//! - A member whose verdict comes after the wait (crashed, or far slower than the others)
//!   holds nobody back; if it had caught the liar, the members that stopped waiting applied
//!   the lie (they refuse the liar once the published evidence reaches them).
//! - Alterations within 10⁻⁵ of the values (rounding-sized) pass.
//! - A reducer's own contribution is its choice: it is sealed and checked like the others,
//!   but with the mean a reducer can move its span by choosing it (as any sender can move
//!   every span). A robust aggregation bounds that; verification does not.
//! - Only coordinate-wise aggregations (mean, median, trimmed mean) can be recomputed one
//!   block at a time; `centered-clip` measures distances over whole parts, and a group that
//!   verifies refuses it (config error).
//! - With a lossy codec each sender receives a delta, not the result, so it cannot check the
//!   result against what it received: a reducer could send one sender a delta that lands
//!   elsewhere than its sealed (and checked) result. Verified groups should use the exact
//!   codec; lossy ones verify the reducer's own result only.
//! - Re-delegated parts (phase 2) carry seals but are not picked for checks.
//! - Evidence must fit one DHT entry (16 KiB): one block of every contributor, about 1.4 KiB
//!   each, so groups of up to about 10 members. Larger groups still catch and refuse the
//!   liar locally; publishing their evidence fails with a warning.

pub mod evidence;
pub mod merkle;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use starling_dht::OwnerKey;
use starling_node::{Node, PeerId};
use tokio::time::Instant;

pub use evidence::{Evidence, EvidenceError, Reveal, RevealedInput, Seal, SignedResult};
use starling_node::lock::lock;

use crate::wire::MemberIdx;

/// How often an averager reads the published evidence.
pub const EVIDENCE_POLL: Duration = Duration::from_secs(2);
/// Transcripts a reducer keeps: its latest round's (checks come right after a round; a round
/// run meanwhile replaces it only once it has reduced everything). It holds the senders'
/// values of this peer's span, its result, and its flattened vector.
const TRANSCRIPTS_KEPT: usize = 1;
/// How long a transcript stays after its round.
const TRANSCRIPT_LIFE: Duration = Duration::from_secs(60);
/// How long published evidence lives in the DHT.
const EVIDENCE_TTL: Duration = Duration::from_secs(24 * 3600);

/// Signs this peer's seals with its node identity.
#[derive(Clone)]
pub(crate) struct Signer {
    key: OwnerKey,
    pub me: Vec<u8>,
}

impl Signer {
    pub fn of(node: &Node) -> Self {
        Signer {
            key: node.owner_key().clone(),
            me: node.peer_id().to_bytes(),
        }
    }

    /// Seals this peer's values of `start..start + values.len()` sent to `reducer`.
    pub fn seal_input(
        &self,
        round_id: u64,
        reducer: &PeerId,
        start: usize,
        weight: f64,
        values: &[f32],
    ) -> Seal {
        let root = merkle::root(values);
        let m = evidence::input_message(
            round_id,
            &self.me,
            &reducer.to_bytes(),
            start as u64,
            values.len() as u64,
            weight,
            &root,
        );
        Seal {
            root,
            signature: self.key.sign_document(evidence::INPUT_DOMAIN, &m).to_vec(),
        }
    }

    /// Seals this reducer's result `values` of the part starting at `start`.
    pub fn seal_result(
        &self,
        round_id: u64,
        start: usize,
        contributors: &[Vec<u8>],
        aggregation: &str,
        values: &[f32],
    ) -> Seal {
        let root = merkle::root(values);
        let m = evidence::result_message(
            round_id,
            &self.me,
            start as u64,
            values.len() as u64,
            contributors,
            aggregation,
            &root,
        );
        Seal {
            root,
            signature: self.key.sign_document(evidence::RESULT_DOMAIN, &m).to_vec(),
        }
    }
}

/// Checks a sender's seal over its chunk `start..start + len`: its signature, and with
/// `values` (what this reducer decoded of the chunk) that its root is theirs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_input(
    round_id: u64,
    sender: &PeerId,
    reducer: &[u8],
    start: usize,
    len: usize,
    weight: f64,
    values: Option<&[f32]>,
    seal: &Seal,
) -> bool {
    if values.is_some_and(|v| merkle::root(v) != seal.root) {
        return false;
    }
    let m = evidence::input_message(
        round_id,
        &sender.to_bytes(),
        reducer,
        start as u64,
        len as u64,
        weight,
        &seal.root,
    );
    evidence::check_seal(&sender.to_bytes(), evidence::INPUT_DOMAIN, &m, seal).is_ok()
}

/// Checks a reducer's result seal: with `values` (the exact codec) that it seals them, and with
/// `signature` that the reducer signed it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_result(
    round_id: u64,
    reducer: &PeerId,
    range: &Range<usize>,
    contributors: &[Vec<u8>],
    aggregation: &str,
    values: Option<&[f32]>,
    seal: &Seal,
    signature: bool,
) -> bool {
    if values.is_some_and(|v| merkle::root(v) != seal.root) {
        return false;
    }
    if !signature {
        return true;
    }
    let m = evidence::result_message(
        round_id,
        &reducer.to_bytes(),
        range.start as u64,
        range.len() as u64,
        contributors,
        aggregation,
        &seal.root,
    );
    evidence::check_seal(&reducer.to_bytes(), evidence::RESULT_DOMAIN, &m, seal).is_ok()
}

/// One contributor's part of a reducer's transcript.
pub(crate) struct TranscriptInput {
    pub peer: Vec<u8>,
    pub weight: f64,
    /// Its values of the whole span.
    pub values: InputValues,
    /// Its seals, by absolute chunk start: (chunk length, seal).
    pub seals: HashMap<usize, (usize, Seal)>,
    /// The reducer's own contribution is sealed when a block of it is revealed (by this
    /// signer): it is the reducer's choice anyway (see the module docs).
    pub sealer: Option<Signer>,
}

/// Where a transcript finds a contributor's values.
pub(crate) enum InputValues {
    /// A sender's staging buffer (offsets within the span).
    Staged(Arc<Mutex<crate::pool::PoolBuf>>),
    /// The reducer's own flattened vector (absolute offsets): shared with the round, not
    /// copied.
    Own(Arc<crate::pool::PoolBuf>),
}

/// One sealed part of a reducer's result.
pub(crate) struct SealedPart {
    /// Absolute range.
    pub range: Range<usize>,
    /// Contributors, in the order the reducer combined them (itself first).
    pub order: Vec<MemberIdx>,
    /// Their peer ids in member order (what the seal signs).
    pub contributors: Vec<Vec<u8>>,
    pub seal: Seal,
}

/// What a reducer keeps of one round to answer reveals.
pub(crate) struct Transcript {
    pub round_id: u64,
    pub reducer: Vec<u8>,
    pub aggregation: String,
    pub span: Range<usize>,
    pub inputs: BTreeMap<MemberIdx, TranscriptInput>,
    pub parts: Vec<SealedPart>,
    /// The result of the span (offsets within the span).
    pub result: crate::pool::PoolBuf,
}

impl Transcript {
    /// Block `block` of the part starting at `start` (absolute, `len` elements), or why it
    /// cannot be shown: not in this transcript, or a sender's seal that does not match what
    /// it sent (senders' roots are checked on one random chunk each during the round, the
    /// others here).
    pub fn reveal(&self, start: usize, len: usize, block: usize) -> Result<Reveal, String> {
        let missing = || "no such block in this round".to_string();
        let part = self
            .parts
            .iter()
            .find(|p| p.range.start == start && p.range.len() == len)
            .ok_or_else(missing)?;
        if block >= merkle::leaves(len) {
            return Err(missing());
        }
        let local =
            start.checked_sub(self.span.start).ok_or_else(missing)?..start - self.span.start + len;
        let mut inputs = Vec::with_capacity(part.order.len());
        for m in &part.order {
            let input = self.inputs.get(m).ok_or_else(missing)?;
            let staged;
            let values = match &input.values {
                InputValues::Staged(buf) => {
                    staged = lock(buf);
                    staged.get(local.clone())
                }
                InputValues::Own(flat) => flat.get(start..start + len),
            }
            .ok_or_else(missing)?;
            let seal = match &input.sealer {
                Some(signer) => signer.seal_input(
                    self.round_id,
                    &PeerId::from_bytes(&self.reducer).map_err(|e| e.to_string())?,
                    start,
                    input.weight,
                    values,
                ),
                None => match input.seals.get(&start) {
                    Some((sealed_len, seal)) if *sealed_len == len => seal.clone(),
                    _ => return Err(missing()),
                },
            };
            let shown = &values[merkle::block_range(len, block)];
            let path = merkle::path(values, block);
            if !merkle::verify_block(shown, block, len, &path, &seal.root) {
                let who = PeerId::from_bytes(&input.peer).map(|p| p.to_string());
                return Err(format!(
                    "sender {} sealed other values than it sent",
                    who.unwrap_or_default()
                ));
            }
            inputs.push(RevealedInput {
                peer: input.peer.clone(),
                weight: input.weight,
                values: shown.to_vec(),
                path,
                seal,
            });
        }
        let result = self.result.get(local).ok_or_else(missing)?;
        Ok(Reveal {
            round_id: self.round_id,
            reducer: self.reducer.clone(),
            start: start as u64,
            len: len as u64,
            aggregation: self.aggregation.clone(),
            contributors: part.contributors.clone(),
            block: block as u32,
            inputs,
            result: result[merkle::block_range(len, block)].to_vec(),
            result_path: merkle::path(result, block),
            result_seal: part.seal.clone(),
        })
    }
}

/// A transcript and when it was kept.
type Kept = (Instant, Arc<Transcript>);

/// A reducer's latest transcripts (cheap to clone).
#[derive(Clone, Default)]
pub(crate) struct Transcripts {
    kept: Arc<Mutex<VecDeque<Kept>>>,
    /// Wakes reveals waiting for a round that is still returning its results.
    added: Arc<tokio::sync::Notify>,
}

impl Transcripts {
    pub fn keep(&self, t: Transcript) {
        let mut kept = lock(&self.kept);
        kept.retain(|(at, _)| at.elapsed() < TRANSCRIPT_LIFE);
        while kept.len() >= TRANSCRIPTS_KEPT {
            kept.pop_front();
        }
        kept.push_back((Instant::now(), Arc::new(t)));
        drop(kept);
        self.added.notify_waiters();
    }

    fn find(&self, round_id: u64, start: usize) -> Option<Arc<Transcript>> {
        lock(&self.kept)
            .iter()
            .rev()
            .find(|(at, t)| {
                t.round_id == round_id && t.span.contains(&start) && at.elapsed() < TRANSCRIPT_LIFE
            })
            .map(|(_, t)| t.clone())
    }

    /// The transcript of round `round_id` holding element `start`, waiting until `until` for
    /// one that is still being written (a sender can ask as soon as it has its own result,
    /// before the reducer has served the others).
    pub async fn wait_for(
        &self,
        round_id: u64,
        start: usize,
        until: Instant,
    ) -> Option<Arc<Transcript>> {
        loop {
            let added = self.added.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            if let Some(t) = self.find(round_id, start) {
                return Some(t);
            }
            if Instant::now() >= until {
                return None;
            }
            let _ = tokio::time::timeout_at(until, added).await;
        }
    }
}

/// Peers this averager refuses: proven liars (cheap to clone).
#[derive(Clone, Default)]
pub(crate) struct Banned(Arc<Mutex<HashSet<Vec<u8>>>>);

impl Banned {
    pub fn insert(&self, peer: &PeerId) -> bool {
        lock(&self.0).insert(peer.to_bytes())
    }

    pub fn contains(&self, peer: &[u8]) -> bool {
        lock(&self.0).contains(peer)
    }

    pub fn list(&self) -> Vec<PeerId> {
        lock(&self.0)
            .iter()
            .filter_map(|b| PeerId::from_bytes(b).ok())
            .collect()
    }
}

/// The DHT key evidence of a run is published under.
pub(crate) fn evidence_key(prefix: &str) -> String {
    format!("{prefix}.evidence")
}

/// Publishes checked evidence in the background (under this node's owner marker, one sub-key
/// per accused peer and round).
pub(crate) fn publish(node: &Node, prefix: &str, evidence: &Evidence) {
    let node = node.clone();
    let key = evidence_key(prefix);
    let subkey = format!(
        "{}.{:016x}.{}",
        evidence
            .accused()
            .map(|p| p.to_string())
            .unwrap_or_default(),
        evidence.round_id(),
        node.owner_marker()
    );
    let evidence = evidence.clone();
    tokio::spawn(async move {
        let expiration = starling_dht::now_ms() + EVIDENCE_TTL.as_millis() as u64;
        match node.store(&key, &subkey, &evidence, expiration).await {
            Ok(_) => tracing::info!("published evidence: {evidence}"),
            Err(e) => tracing::warn!("could not publish evidence ({evidence}): {e}"),
        }
    });
}

/// Reads the run's published evidence every [`EVIDENCE_POLL`] until aborted, checks each new
/// entry, and refuses the peers it proves guilty.
pub(crate) async fn watch_evidence(node: Node, prefix: String, banned: Banned) {
    let key = evidence_key(&prefix);
    let mut seen: HashSet<(String, u64)> = HashSet::new();
    loop {
        tokio::time::sleep(EVIDENCE_POLL).await;
        if node.is_closed() {
            return;
        }
        let entries = match tokio::time::timeout(EVIDENCE_POLL, node.get::<Evidence>(&key)).await {
            Ok(Ok(entries)) => entries,
            _ => continue,
        };
        for (subkey, evidence, expiration) in entries {
            if seen.len() > 4096 {
                seen.clear(); // bounded: re-checking old evidence is harmless
            }
            if !seen.insert((subkey.clone(), expiration)) {
                continue;
            }
            match evidence.check() {
                Ok(guilty) => {
                    if banned.insert(&guilty) {
                        tracing::warn!("refusing {guilty} from now on: {evidence}");
                    }
                }
                Err(e) => tracing::debug!("ignoring evidence under {subkey}: {e}"),
            }
        }
    }
}
