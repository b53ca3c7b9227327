//! The manifest of a snapshot (epoch, layout, chunk size, one SHA-256 per chunk), the donors'
//! DHT announcements, and how a joiner picks the manifest the donors agree on. Pure: no I/O.

use std::collections::BTreeMap;
use std::ops::Range;

use ring::digest::{digest, SHA256};
use serde::{Deserialize, Serialize};
use starling_node::framing::{decode_msg, encode_msg};

use super::snapshot::{le_bytes, StateLayout, StateSnapshot};

/// A SHA-256 digest.
pub type Digest = [u8; 32];

/// Version of the manifest layout this crate writes and reads.
pub const MANIFEST_VERSION: u32 = 1;

/// SHA-256 of `bytes`.
pub(crate) fn sha256(bytes: &[u8]) -> Digest {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

/// Lower-case hex of the first 8 bytes of a digest (for logs and errors).
pub(crate) fn short(d: &Digest) -> String {
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// What a donor serves: the snapshot's epoch and layout, the chunk size and every chunk's
/// SHA-256. Its own SHA-256 (of its postcard encoding) is what donors announce in the DHT, so a
/// joiner that checks it knows every chunk hash is the one the donors signed.
///
/// Chunks never cross buffers: buffer after buffer, each is cut into `chunk_elems`-value
/// pieces (the last one shorter), sent as little-endian `f32`.
///
/// ```
/// use starling_training::{sync::{Manifest, StateView}, ParamSet};
/// let mut params = ParamSet::new();
/// params.add("w", &[5], &[1.0, 2.0, 3.0, 4.0, 5.0])?;
/// let snapshot = StateView::new(2, &params).capture()?;
/// let m = Manifest::of(&snapshot, 2);
/// assert_eq!((m.epoch, m.chunk_hashes.len()), (2, 3)); // 2 + 2 + 1 values
/// assert_eq!(m.chunk_values(2), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub version: u32,
    /// The snapshot's epoch.
    pub epoch: u64,
    /// The model's [`ParamSet::schema_hash`](crate::ParamSet::schema_hash).
    pub schema_hash: u64,
    /// Values per chunk (the last chunk of a buffer may hold fewer).
    pub chunk_elems: u32,
    /// The buffers, (name, values), in order.
    pub buffers: Vec<(String, u64)>,
    /// The counters, (name, value).
    pub counters: Vec<(String, u64)>,
    /// SHA-256 of every chunk's bytes, in order.
    pub chunk_hashes: Vec<Digest>,
}

/// Where a chunk's values live: buffer index and range in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkSpan {
    pub buffer: usize,
    pub range: Range<usize>,
}

/// The chunks of `buffers` (lengths) cut into `chunk_elems`-value pieces; `None` when a length
/// does not fit in memory or the chunk size is zero.
pub(crate) fn chunk_spans(buffers: &[u64], chunk_elems: usize) -> Option<Vec<ChunkSpan>> {
    if chunk_elems == 0 {
        return None;
    }
    let mut spans = Vec::new();
    for (buffer, &len) in buffers.iter().enumerate() {
        let len = usize::try_from(len).ok()?;
        let mut start = 0;
        while start < len {
            let end = start.saturating_add(chunk_elems).min(len);
            spans.push(ChunkSpan {
                buffer,
                range: start..end,
            });
            start = end;
        }
    }
    Some(spans)
}

impl Manifest {
    /// The manifest of `snapshot` cut into chunks of `chunk_elems` values (at least 1),
    /// hashing every chunk (about 1.5 GB/s with SHA extensions: run it off the network's
    /// threads for large states).
    pub fn of(snapshot: &StateSnapshot, chunk_elems: usize) -> Manifest {
        let chunk_elems = chunk_elems.clamp(1, u32::MAX as usize);
        let lens: Vec<u64> = snapshot
            .buffers
            .iter()
            .map(|(_, v)| v.len() as u64)
            .collect();
        let spans = chunk_spans(&lens, chunk_elems).unwrap_or_default();
        let chunk_hashes = spans
            .iter()
            .map(|s| sha256(&le_bytes(&snapshot.buffers[s.buffer].1[s.range.clone()])))
            .collect();
        Manifest {
            version: MANIFEST_VERSION,
            epoch: snapshot.epoch,
            schema_hash: snapshot.schema_hash,
            chunk_elems: chunk_elems as u32,
            buffers: snapshot
                .buffers
                .iter()
                .map(|(n, v)| (n.clone(), v.len() as u64))
                .collect(),
            counters: snapshot
                .counters
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
            chunk_hashes,
        }
    }

    /// The encoding that travels and is hashed (postcard).
    pub fn encode(&self) -> Vec<u8> {
        // Encoding plain integers, strings and byte arrays into a Vec cannot fail.
        encode_msg(self).unwrap_or_default()
    }

    /// Values in chunk `index` (0 past the end).
    pub fn chunk_values(&self, index: usize) -> usize {
        let lens: Vec<u64> = self.buffers.iter().map(|(_, l)| *l).collect();
        chunk_spans(&lens, self.chunk_elems as usize)
            .and_then(|s| s.get(index).map(|s| s.range.len()))
            .unwrap_or(0)
    }

    /// The chunks' places.
    pub(crate) fn spans(&self) -> Option<Vec<ChunkSpan>> {
        let lens: Vec<u64> = self.buffers.iter().map(|(_, l)| *l).collect();
        chunk_spans(&lens, self.chunk_elems as usize)
    }

    /// Decodes a manifest received from a donor and checks it: its hash is `expected` (what the
    /// donors announced), its epoch is `epoch`, its layout is the joiner's, its chunks are at
    /// most `max_chunk_elems` values and there is one hash per chunk. Returns the manifest and
    /// its chunk places, or [`ManifestFault`] saying whether the donor or the layout is at fault.
    pub(crate) fn decode_checked(
        bytes: &[u8],
        expected: &Digest,
        epoch: u64,
        layout: &StateLayout,
        max_chunk_elems: usize,
    ) -> Result<(Manifest, Vec<ChunkSpan>), ManifestFault> {
        let got = sha256(bytes);
        if &got != expected {
            return Err(ManifestFault::Donor(format!(
                "manifest hash {} is not the announced {}",
                short(&got),
                short(expected)
            )));
        }
        // The hash matched what the donor signed: from here on a bad manifest is the donors'
        // agreed state, not one donor's corruption.
        let m: Manifest = decode_msg(bytes)
            .map_err(|e| ManifestFault::Donor(format!("undecodable manifest: {e}")))?;
        if m.version != MANIFEST_VERSION {
            return Err(ManifestFault::Layout(format!(
                "manifest version {}, this build reads {MANIFEST_VERSION}",
                m.version
            )));
        }
        if m.epoch != epoch {
            return Err(ManifestFault::Donor(format!(
                "manifest of epoch {}, announced {epoch}",
                m.epoch
            )));
        }
        if let Some(why) = layout.mismatch(m.schema_hash, &m.buffers, &m.counters) {
            return Err(ManifestFault::Layout(why));
        }
        if m.chunk_elems == 0 || m.chunk_elems as usize > max_chunk_elems {
            return Err(ManifestFault::Layout(format!(
                "chunks of {} values; this joiner accepts 1 to {max_chunk_elems}",
                m.chunk_elems
            )));
        }
        let spans = m
            .spans()
            .ok_or_else(|| ManifestFault::Layout("buffers too large for this machine".into()))?;
        if spans.len() != m.chunk_hashes.len() {
            return Err(ManifestFault::Layout(format!(
                "{} chunk hashes for {} chunks",
                m.chunk_hashes.len(),
                spans.len()
            )));
        }
        Ok((m, spans))
    }
}

/// Why a received manifest was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ManifestFault {
    /// This donor sent something else than it announced: ask another.
    Donor(String),
    /// The agreed manifest does not fit the joiner's model.
    Layout(String),
}

/// A donor's DHT announcement under `{run}.state`, in a sub-key signed by the donor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateAnnouncement {
    /// Epoch of the snapshot it serves.
    pub epoch: u64,
    /// The model's schema hash.
    pub schema_hash: u64,
    /// SHA-256 of the manifest ([`Manifest::encode`]).
    pub manifest_hash: Digest,
    /// Chunks in the snapshot.
    pub chunks: u64,
    /// Bytes of chunk data in the snapshot.
    pub bytes: u64,
    /// Where to dial the donor (multiaddrs).
    pub addrs: Vec<String>,
}

/// The manifest a joiner takes: its epoch, its hash and the donors that announce it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestChoice<P> {
    /// The epoch.
    pub epoch: u64,
    /// The manifest's SHA-256.
    pub manifest_hash: Digest,
    /// Every donor that announced it, in the order given.
    pub donors: Vec<P>,
}

/// Picks the manifest to sync to from `(donor, announcement)` pairs: among announcements for
/// `schema_hash` at `min_epoch` or later, the newest epoch whose most-announced manifest has at
/// least `min_agreeing` donors, and in it that manifest (a tie goes to the smaller hash, so
/// every joiner picks the same). A donor counts once (its first announcement).
///
/// ```
/// use starling_training::sync::{choose_manifest, StateAnnouncement};
/// let ann = |epoch, h: u8| StateAnnouncement {
///     epoch, schema_hash: 9, manifest_hash: [h; 32], chunks: 1, bytes: 4, addrs: vec![],
/// };
/// let seen = [("a", ann(5, 1)), ("b", ann(5, 2)), ("c", ann(5, 2)), ("d", ann(4, 3))];
/// let choice = choose_manifest(&seen, 9, 0, 1).unwrap();
/// assert_eq!((choice.epoch, choice.manifest_hash, choice.donors), (5, [2; 32], vec!["b", "c"]));
/// // Asking for three agreeing donors: no epoch has them.
/// assert!(choose_manifest(&seen, 9, 0, 3).is_none());
/// ```
pub fn choose_manifest<P: Clone + PartialEq>(
    announcements: &[(P, StateAnnouncement)],
    schema_hash: u64,
    min_epoch: u64,
    min_agreeing: usize,
) -> Option<ManifestChoice<P>> {
    let mut seen: Vec<&P> = Vec::new();
    let mut groups: BTreeMap<(u64, Digest), Vec<P>> = BTreeMap::new();
    for (peer, a) in announcements {
        if seen.contains(&peer) {
            continue;
        }
        seen.push(peer);
        if a.schema_hash != schema_hash || a.epoch < min_epoch {
            continue;
        }
        groups
            .entry((a.epoch, a.manifest_hash))
            .or_default()
            .push(peer.clone());
    }
    let ((epoch, manifest_hash), donors) = groups
        .into_iter()
        .filter(|(_, donors)| donors.len() >= min_agreeing.max(1))
        // Newest epoch, then most donors, then the smaller hash.
        .max_by(|((e1, h1), d1), ((e2, h2), d2)| {
            (e1, d1.len()).cmp(&(e2, d2.len())).then_with(|| h2.cmp(h1))
        })?;
    Some(ManifestChoice {
        epoch,
        manifest_hash,
        donors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::StateView;
    use crate::{ParamSet, Sgd, SgdConfig};

    fn ann(epoch: u64, schema: u64, h: u8) -> StateAnnouncement {
        StateAnnouncement {
            epoch,
            schema_hash: schema,
            manifest_hash: [h; 32],
            chunks: 1,
            bytes: 4,
            addrs: Vec::new(),
        }
    }

    #[test]
    fn the_newest_epoch_wins_then_the_most_donors_then_the_smaller_hash() {
        let seen = [
            (1, ann(3, 7, 9)),
            (2, ann(4, 7, 5)),
            (3, ann(4, 7, 6)),
            (4, ann(4, 7, 6)),
            (5, ann(9, 8, 1)), // another model: ignored
            (2, ann(9, 7, 1)), // a second announcement by donor 2: ignored
        ];
        let c = choose_manifest(&seen, 7, 0, 1).unwrap();
        assert_eq!(
            (c.epoch, c.manifest_hash, c.donors),
            (4, [6; 32], vec![3, 4])
        );
        // A tie on donors goes to the smaller hash, whatever the order.
        let tie = [(1, ann(4, 7, 6)), (2, ann(4, 7, 5))];
        assert_eq!(
            choose_manifest(&tie, 7, 0, 1).unwrap().manifest_hash,
            [5; 32]
        );
        let tie = [(2, ann(4, 7, 5)), (1, ann(4, 7, 6))];
        assert_eq!(
            choose_manifest(&tie, 7, 0, 1).unwrap().manifest_hash,
            [5; 32]
        );
        // Requiring 3 agreeing donors falls back to no choice; requiring a newer epoch too.
        assert!(choose_manifest(&seen, 7, 0, 3).is_none());
        assert!(choose_manifest(&seen, 7, 5, 1).is_none());
        // With 2 required, epoch 4's pair of donors is taken over epoch 3's single one.
        assert_eq!(choose_manifest(&seen, 7, 0, 2).unwrap().epoch, 4);
        assert!(choose_manifest::<u8>(&[], 7, 0, 1).is_none());
    }

    fn snapshot(n: usize) -> (StateSnapshot, StateLayout) {
        let mut params = ParamSet::new();
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        params.add("w", &[n], &values).unwrap();
        let sgd = Sgd::new(SgdConfig::new(0.1).momentum(0.9), n).unwrap();
        let view = StateView::new(3, &params).optimizer("opt", &sgd);
        (view.capture().unwrap(), view.layout())
    }

    #[test]
    fn a_manifest_is_checked_against_its_hash_epoch_and_layout() {
        let (snap, layout) = snapshot(10);
        let m = Manifest::of(&snap, 4);
        // 10 values in 4-value chunks, two buffers: 3 chunks each.
        assert_eq!(m.chunk_hashes.len(), 6);
        assert_eq!(
            (m.chunk_values(0), m.chunk_values(2), m.chunk_values(6)),
            (4, 2, 0)
        );
        let bytes = m.encode();
        let h = sha256(&bytes);
        let (back, spans) = Manifest::decode_checked(&bytes, &h, 3, &layout, 4).unwrap();
        assert_eq!(back, m);
        assert_eq!(
            spans[5],
            ChunkSpan {
                buffer: 1,
                range: 8..10
            }
        );
        let donor_fault = |r| matches!(r, Err(ManifestFault::Donor(_)));
        let layout_fault = |r| matches!(r, Err(ManifestFault::Layout(_)));
        assert!(donor_fault(Manifest::decode_checked(
            &bytes, &[0; 32], 3, &layout, 4
        )));
        assert!(donor_fault(Manifest::decode_checked(
            &bytes, &h, 4, &layout, 4
        )));
        assert!(layout_fault(Manifest::decode_checked(
            &bytes, &h, 3, &layout, 3
        )));
        let (_, other) = snapshot(11);
        assert!(layout_fault(Manifest::decode_checked(
            &bytes, &h, 3, &other, 4
        )));
        // A manifest whose hash list does not match its chunks, signed as it is.
        let mut short_list = m.clone();
        short_list.chunk_hashes.pop();
        let bytes = short_list.encode();
        let r = Manifest::decode_checked(&bytes, &sha256(&bytes), 3, &layout, 4);
        assert!(layout_fault(r));
        // Garbage with the right hash is the donor's fault, never a panic.
        let junk = vec![0xff; 40];
        assert!(donor_fault(Manifest::decode_checked(
            &junk,
            &sha256(&junk),
            3,
            &layout,
            4
        )));
    }

    #[test]
    fn chunk_hashes_follow_the_values() {
        let (snap, _) = snapshot(8);
        let mut changed = snap.clone();
        changed.buffers[0].1[5] = 99.0;
        let (a, b) = (Manifest::of(&snap, 4), Manifest::of(&changed, 4));
        assert_eq!(a.chunk_hashes[0], b.chunk_hashes[0]);
        assert_ne!(a.chunk_hashes[1], b.chunk_hashes[1]);
        assert_eq!(a.chunk_hashes[2..], b.chunk_hashes[2..]);
        assert!(chunk_spans(&[3], 0).is_none());
        assert_eq!(chunk_spans(&[0, 2], 4).unwrap().len(), 1);
    }
}
