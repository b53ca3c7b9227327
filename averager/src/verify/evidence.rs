//! Signed statements of a round ([`Seal`]s over inputs and results) and the [`Evidence`] built
//! from them, which any peer can check without trusting whoever publishes it.

use std::fmt;

use serde::{Deserialize, Serialize};
use starling_dht::owner::verify_document;
use starling_node::{owner_of_peer, PeerId};

use super::merkle::{self, Digest};
use crate::Aggregation;

/// Domain of a sender's signature over one chunk of its contribution.
pub const INPUT_DOMAIN: &str = "starling-averager-input-v1";
/// Domain of a reducer's signature over one part of its result.
pub const RESULT_DOMAIN: &str = "starling-averager-result-v1";

/// Largest run a seal may cover (elements): far above any chunk, and bounds what a forged
/// reveal can make a checker allocate.
const MAX_SEALED: u64 = 1 << 28;

/// A signed hash-tree root ([`merkle`]) over a run of values; what the signature covers besides
/// the root is the message of its kind ([`input_message`], [`result_message`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seal {
    /// Root over the values.
    pub root: Digest,
    /// Ed25519 signature (64 bytes) of the signer's node identity.
    pub signature: Vec<u8>,
}

fn put_bytes(m: &mut Vec<u8>, b: &[u8]) {
    m.extend_from_slice(&(b.len() as u64).to_le_bytes());
    m.extend_from_slice(b);
}

/// What a sender signs for the chunk `start..start + len` (absolute offsets in the flattened
/// vector) of the values it sent `reducer` in round `round_id`, with its declared weight.
pub fn input_message(
    round_id: u64,
    sender: &[u8],
    reducer: &[u8],
    start: u64,
    len: u64,
    weight: f64,
    root: &Digest,
) -> Vec<u8> {
    let mut m = Vec::with_capacity(160);
    m.extend_from_slice(&round_id.to_le_bytes());
    put_bytes(&mut m, sender);
    put_bytes(&mut m, reducer);
    m.extend_from_slice(&start.to_le_bytes());
    m.extend_from_slice(&len.to_le_bytes());
    m.extend_from_slice(&weight.to_bits().to_le_bytes());
    m.extend_from_slice(root);
    m
}

/// What a reducer signs for the part `start..start + len` of its result in round `round_id`:
/// the contributors (peer ids, in member order) and the aggregation it claims to have applied.
pub fn result_message(
    round_id: u64,
    reducer: &[u8],
    start: u64,
    len: u64,
    contributors: &[Vec<u8>],
    aggregation: &str,
    root: &Digest,
) -> Vec<u8> {
    let mut m = Vec::with_capacity(128 + 40 * contributors.len());
    m.extend_from_slice(&round_id.to_le_bytes());
    put_bytes(&mut m, reducer);
    m.extend_from_slice(&start.to_le_bytes());
    m.extend_from_slice(&len.to_le_bytes());
    m.extend_from_slice(&(contributors.len() as u64).to_le_bytes());
    for c in contributors {
        put_bytes(&mut m, c);
    }
    put_bytes(&mut m, aggregation.as_bytes());
    m.extend_from_slice(root);
    m
}

/// Why a piece of evidence proves nothing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EvidenceError {
    /// Its fields contradict each other or are out of range.
    #[error("malformed evidence: {0}")]
    Malformed(String),
    /// A signature does not verify under the key of the peer it names.
    #[error("a signature does not verify: {0}")]
    BadSignature(String),
    /// It is well formed and signed, and shows no wrongdoing.
    #[error("the evidence shows no fault")]
    NoFault,
}

/// Checks `seal` as signed by the peer whose id is `peer` over `message`.
pub(crate) fn check_seal(
    peer: &[u8],
    domain: &str,
    message: &[u8],
    seal: &Seal,
) -> Result<(), EvidenceError> {
    let id = PeerId::from_bytes(peer)
        .map_err(|_| EvidenceError::Malformed("a peer id does not parse".into()))?;
    let key = owner_of_peer(&id).ok_or_else(|| {
        EvidenceError::Malformed(format!("peer {id} has no ed25519 identity to check"))
    })?;
    verify_document(&key, domain, message, &seal.signature)
        .map_err(|_| EvidenceError::BadSignature(format!("{domain} by {id}")))
}

/// One contributor's values of a revealed block, with the proof that its sender signed them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RevealedInput {
    /// The contributor's peer id (bytes).
    pub peer: Vec<u8>,
    /// Its weight, as its seal signs it.
    pub weight: f64,
    /// Its values of the block.
    pub values: Vec<f32>,
    /// The block's path to the seal's root.
    pub path: Vec<Digest>,
    /// Its signed root over the part.
    pub seal: Seal,
}

/// What a reducer shows of one block of one part of its result on request: every
/// contributor's signed values of the block and its own signed result. Self-contained: it
/// names every peer by id, so anyone can check the signatures and recompute the block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reveal {
    /// The round.
    pub round_id: u64,
    /// The reducer (peer id bytes).
    pub reducer: Vec<u8>,
    /// The part: first element (absolute) and length.
    pub start: u64,
    /// Elements in the part.
    pub len: u64,
    /// The aggregation the reducer signed (`Aggregation`'s text form).
    pub aggregation: String,
    /// The contributors the reducer signed, in member order.
    pub contributors: Vec<Vec<u8>>,
    /// Which block of the part ([`merkle::BLOCK`] elements each).
    pub block: u32,
    /// The contributions to the block, in the order the reducer combined them.
    pub inputs: Vec<RevealedInput>,
    /// The reducer's result for the block.
    pub result: Vec<f32>,
    /// The result block's path to the result seal's root.
    pub result_path: Vec<Digest>,
    /// The reducer's signed root over the part's result.
    pub result_seal: Seal,
}

impl Reveal {
    /// The message the reducer's result seal signs.
    pub fn result_message(&self) -> Vec<u8> {
        result_message(
            self.round_id,
            &self.reducer,
            self.start,
            self.len,
            &self.contributors,
            &self.aggregation,
            &self.result_seal.root,
        )
    }

    /// Checks every signature and path, then recomputes the block from the signed inputs:
    /// `Ok(true)` if the reducer's signed result differs from the aggregation of the inputs
    /// (beyond what summation order can change: 10⁻⁵ of the largest input of the coordinate),
    /// `Ok(false)` if it matches.
    pub fn recompute(&self) -> Result<bool, EvidenceError> {
        let bad = |m: &str| Err(EvidenceError::Malformed(m.to_string()));
        if self.len == 0 || self.len > MAX_SEALED {
            return bad("part length out of range");
        }
        let len = self.len as usize;
        let block = self.block as usize;
        if block >= merkle::leaves(len) {
            return bad("block beyond the part");
        }
        let range = merkle::block_range(len, block);
        let aggregation: Aggregation =
            self.aggregation.parse().map_err(EvidenceError::Malformed)?;
        if !aggregation.is_coordinatewise() {
            return bad("the aggregation cannot be checked one block at a time");
        }
        check_seal(
            &self.reducer,
            RESULT_DOMAIN,
            &self.result_message(),
            &self.result_seal,
        )?;
        if self.result.len() != range.len()
            || !merkle::verify_block(
                &self.result,
                block,
                len,
                &self.result_path,
                &self.result_seal.root,
            )
        {
            return bad("the result block is not the sealed one");
        }
        if self.inputs.is_empty() || self.inputs.len() != self.contributors.len() {
            return bad("the inputs are not the signed contributors");
        }
        let mut seen: Vec<&[u8]> = Vec::with_capacity(self.inputs.len());
        for input in &self.inputs {
            if !self.contributors.contains(&input.peer) || seen.contains(&input.peer.as_slice()) {
                return bad("the inputs are not the signed contributors");
            }
            seen.push(&input.peer);
            if !(input.weight.is_finite() && input.weight >= 0.0) {
                return bad("a weight is not a finite non-negative number");
            }
            if input.values.len() != range.len() || !input.values.iter().all(|v| v.is_finite()) {
                return bad("an input block has the wrong length or a non-finite value");
            }
            let message = input_message(
                self.round_id,
                &input.peer,
                &self.reducer,
                self.start,
                self.len,
                input.weight,
                &input.seal.root,
            );
            check_seal(&input.peer, INPUT_DOMAIN, &message, &input.seal)?;
            if !merkle::verify_block(&input.values, block, len, &input.path, &input.seal.root) {
                return bad("an input block is not the sealed one");
            }
        }
        let pairs: Vec<(f64, &[f32])> = self
            .inputs
            .iter()
            .map(|i| (i.weight, i.values.as_slice()))
            .collect();
        let mut expected = vec![0.0f32; range.len()];
        aggregation.aggregate(&mut expected, &pairs);
        Ok(differs(&expected, &self.result, &pairs))
    }
}

/// Whether a claimed result differs from the recomputed one by more than summation order can
/// explain, at any coordinate (a non-finite claim always differs).
fn differs(expected: &[f32], claimed: &[f32], inputs: &[(f64, &[f32])]) -> bool {
    expected.iter().zip(claimed).enumerate().any(|(k, (e, c))| {
        if !c.is_finite() {
            return true;
        }
        let scale = inputs
            .iter()
            .map(|(_, x)| x[k].abs())
            .fold(c.abs(), f32::max);
        (e - c).abs() > 1e-5 * scale + f32::MIN_POSITIVE
    })
}

/// A reducer's signed result for one part, as one member received it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedResult {
    /// The contributors it signed, in member order.
    pub contributors: Vec<Vec<u8>>,
    /// The aggregation it signed.
    pub aggregation: String,
    /// Its seal.
    pub seal: Seal,
}

/// Proof that a peer broke the all-reduce: what the averager publishes in the DHT under
/// `{prefix}.evidence` and refuses the guilty peer for, once it has checked it
/// ([`Evidence::check`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Evidence {
    /// The reducer's signed result for a block is not the aggregation of the inputs their
    /// senders signed.
    WrongResult(Box<Reveal>),
    /// The reducer signed two different results for the same part of a round.
    Equivocation {
        /// The round.
        round_id: u64,
        /// The reducer (peer id bytes).
        reducer: Vec<u8>,
        /// The part's first element (absolute).
        start: u64,
        /// Elements in the part.
        len: u64,
        /// One signed result.
        first: Box<SignedResult>,
        /// Another, different.
        second: Box<SignedResult>,
    },
}

impl Evidence {
    /// The peer this evidence accuses (unchecked).
    pub fn accused(&self) -> Option<PeerId> {
        let bytes = match self {
            Evidence::WrongResult(r) => &r.reducer,
            Evidence::Equivocation { reducer, .. } => reducer,
        };
        PeerId::from_bytes(bytes).ok()
    }

    /// The round it is about.
    pub fn round_id(&self) -> u64 {
        match self {
            Evidence::WrongResult(r) => r.round_id,
            Evidence::Equivocation { round_id, .. } => *round_id,
        }
    }

    /// Checks the evidence from its contents alone (signatures, hash paths, the recomputed
    /// block) and returns the peer it proves guilty. Fails for anything that proves nothing:
    /// forged or broken signatures, a result that is right, two equal results.
    pub fn check(&self) -> Result<PeerId, EvidenceError> {
        let accused = self
            .accused()
            .ok_or_else(|| EvidenceError::Malformed("the accused peer id does not parse".into()))?;
        match self {
            Evidence::WrongResult(reveal) => {
                if reveal.recompute()? {
                    Ok(accused)
                } else {
                    Err(EvidenceError::NoFault)
                }
            }
            Evidence::Equivocation {
                round_id,
                reducer,
                start,
                len,
                first,
                second,
            } => {
                // The same statement (signed twice, or copied) is no contradiction.
                let same = first.seal.root == second.seal.root
                    && first.contributors == second.contributors
                    && first.aggregation == second.aggregation;
                if same {
                    return Err(EvidenceError::NoFault);
                }
                for s in [first, second] {
                    let m = result_message(
                        *round_id,
                        reducer,
                        *start,
                        *len,
                        &s.contributors,
                        &s.aggregation,
                        &s.seal.root,
                    );
                    check_seal(reducer, RESULT_DOMAIN, &m, &s.seal)?;
                }
                Ok(accused)
            }
        }
    }
}

impl fmt::Display for Evidence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = self
            .accused()
            .map_or_else(|| "?".to_string(), |p| p.to_string());
        match self {
            Evidence::WrongResult(r) => write!(
                f,
                "reducer {who} returned a wrong result for elements {}..{} of round {:016x}",
                r.start,
                r.start + r.len,
                r.round_id
            ),
            Evidence::Equivocation { round_id, .. } => write!(
                f,
                "reducer {who} signed two different results in round {round_id:016x}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::merkle::{block_range, path, root};
    use rand::{Rng, SeedableRng};
    use starling_node::{owner_key_of, Keypair};

    struct Member {
        id: Vec<u8>,
        key: starling_dht::OwnerKey,
    }

    fn member() -> Member {
        let kp = Keypair::generate_ed25519();
        Member {
            id: kp.public().to_peer_id().to_bytes(),
            key: owner_key_of(&kp).unwrap(),
        }
    }

    /// A reveal of block 1 of a 200-element part reduced by `reducer` from three inputs, with
    /// `alter` added to the reducer's result.
    fn reveal(aggregation: Aggregation, alter: f32) -> (Reveal, Vec<Member>) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let members: Vec<Member> = (0..3).map(|_| member()).collect();
        let reducer = &members[0];
        let (round_id, start, len, block) = (77u64, 1000u64, 600usize, 1usize);
        let weights = [1.0, 2.5, 0.5];
        let values: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..len).map(|_| rng.gen_range(-3.0f32..3.0)).collect())
            .collect();
        let pairs: Vec<(f64, &[f32])> = weights
            .iter()
            .zip(&values)
            .map(|(w, v)| (*w, v.as_slice()))
            .collect();
        let mut result = vec![0.0f32; len];
        aggregation.aggregate(&mut result, &pairs);
        result.iter_mut().for_each(|v| *v += alter);
        let contributors: Vec<Vec<u8>> = members.iter().map(|m| m.id.clone()).collect();
        let agg = aggregation.to_string();
        let r_root = root(&result);
        let m = result_message(
            round_id,
            &reducer.id,
            start,
            len as u64,
            &contributors,
            &agg,
            &r_root,
        );
        let result_seal = Seal {
            root: r_root,
            signature: reducer.key.sign_document(RESULT_DOMAIN, &m).to_vec(),
        };
        let inputs = members
            .iter()
            .zip(&values)
            .zip(weights)
            .map(|((mb, v), w)| {
                let r = root(v);
                let m = input_message(round_id, &mb.id, &reducer.id, start, len as u64, w, &r);
                RevealedInput {
                    peer: mb.id.clone(),
                    weight: w,
                    values: v[block_range(len, block)].to_vec(),
                    path: path(v, block),
                    seal: Seal {
                        root: r,
                        signature: mb.key.sign_document(INPUT_DOMAIN, &m).to_vec(),
                    },
                }
            })
            .collect();
        let reveal = Reveal {
            round_id,
            reducer: reducer.id.clone(),
            start,
            len: len as u64,
            aggregation: agg,
            contributors,
            block: block as u32,
            inputs,
            result: result[block_range(len, block)].to_vec(),
            result_path: path(&result, block),
            result_seal,
        };
        assert!(merkle::verify_block(
            &reveal.result,
            block,
            len,
            &reveal.result_path,
            &reveal.result_seal.root
        ));
        (reveal, members)
    }

    #[test]
    fn a_wrong_result_is_proven_and_a_right_one_is_not() {
        for agg in ["mean", "median", "trimmed-mean:0.2"] {
            let agg: Aggregation = agg.parse().unwrap();
            let (honest, _) = reveal(agg, 0.0);
            assert_eq!(
                Evidence::WrongResult(Box::new(honest)).check(),
                Err(EvidenceError::NoFault),
                "{agg}"
            );
            let (liar, members) = reveal(agg, 0.01);
            let guilty = Evidence::WrongResult(Box::new(liar)).check().unwrap();
            assert_eq!(guilty.to_bytes(), members[0].id, "{agg}");
        }
    }

    #[test]
    fn forged_or_tampered_evidence_proves_nothing() {
        let (liar, members) = reveal(Aggregation::Mean, 1.0);
        // A checker's claim that an input was other than its sender signed.
        let mut e = liar.clone();
        e.inputs[1].values[0] += 5.0;
        assert!(matches!(
            Evidence::WrongResult(Box::new(e)).check(),
            Err(EvidenceError::Malformed(_))
        ));
        // A weight the sender did not sign.
        let mut e = liar.clone();
        e.inputs[2].weight = 100.0;
        assert!(matches!(
            Evidence::WrongResult(Box::new(e)).check(),
            Err(EvidenceError::BadSignature(_))
        ));
        // A result seal made by someone else than the accused reducer.
        let mut e = liar.clone();
        let forged = members[1]
            .key
            .sign_document(RESULT_DOMAIN, &e.result_message());
        e.result_seal.signature = forged.to_vec();
        assert!(matches!(
            Evidence::WrongResult(Box::new(e)).check(),
            Err(EvidenceError::BadSignature(_))
        ));
        // An input left out (the others' mean would differ).
        let mut e = liar.clone();
        e.inputs.pop();
        assert!(matches!(
            Evidence::WrongResult(Box::new(e)).check(),
            Err(EvidenceError::Malformed(_))
        ));
        // Another block than the paths prove.
        let mut e = liar.clone();
        e.block = 0;
        assert!(Evidence::WrongResult(Box::new(e)).check().is_err());
        // Centered clipping cannot be checked block by block.
        let mut e = liar;
        e.aggregation = "centered-clip".into();
        assert!(Evidence::WrongResult(Box::new(e)).check().is_err());
    }

    #[test]
    fn two_different_signed_results_for_one_part_prove_equivocation() {
        let (a, members) = reveal(Aggregation::Mean, 0.0);
        let (mut b, _) = (a.clone(), ());
        let mut altered = a.result.clone();
        altered[0] += 1.0;
        b.result_seal.root = root(&altered);
        b.result_seal.signature = members[0]
            .key
            .sign_document(RESULT_DOMAIN, &b.result_message())
            .to_vec();
        let signed = |r: &Reveal| SignedResult {
            contributors: r.contributors.clone(),
            aggregation: r.aggregation.clone(),
            seal: r.result_seal.clone(),
        };
        let equivocation = |first: SignedResult, second: SignedResult| Evidence::Equivocation {
            round_id: a.round_id,
            reducer: a.reducer.clone(),
            start: a.start,
            len: a.len,
            first: Box::new(first),
            second: Box::new(second),
        };
        let guilty = equivocation(signed(&a), signed(&b)).check().unwrap();
        assert_eq!(guilty.to_bytes(), members[0].id);
        assert_eq!(
            equivocation(signed(&a), signed(&a)).check(),
            Err(EvidenceError::NoFault)
        );
        // The second "result" signed by another peer: nothing.
        let mut c = signed(&b);
        c.seal.signature = members[2]
            .key
            .sign_document(RESULT_DOMAIN, &b.result_message())
            .to_vec();
        assert!(matches!(
            equivocation(signed(&a), c).check(),
            Err(EvidenceError::BadSignature(_))
        ));
        // Evidence survives the wire format it is published in.
        let e = equivocation(signed(&a), signed(&b));
        let bytes = starling_dht::encode_value(&e).unwrap();
        let back: Evidence = starling_dht::decode_value(&bytes).unwrap();
        assert_eq!(back, e);
    }
}
