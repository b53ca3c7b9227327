//! A rogue member for tests (`Fault::Rogue`, `testing` feature): the lies a broken or hostile
//! peer can tell in the all-reduce, written where the honest code writes the real thing.
//! Without the feature `AveragerConfig::fault()` is always `None` and none of this runs.

use starling_compression::raw_frame_header;

use crate::config::{AveragerConfig, Fault, Rogue};
use crate::wire::{ChunkOut, MemberIdx, ReduceMsg};
use crate::AveragerError;

/// The rogue behaviour configured, if any.
pub(super) fn of(cfg: &AveragerConfig) -> Option<Rogue> {
    match cfg.fault() {
        Some(Fault::Rogue(r)) => Some(r),
        _ => None,
    }
}

/// Bends a sender's hello the way `r` says.
pub(super) fn lie_in_hello(hello: &mut ReduceMsg, r: Rogue) {
    if let ReduceMsg::Hello { round_id, len, .. } = hello {
        match r {
            Rogue::HelloLength(extra) => *len = len.wrapping_add(extra.max(1)),
            Rogue::HelloRound(mask) => *round_id ^= mask.max(1),
            _ => {}
        }
    }
}

/// Bends a reducer's first `Result` the way `r` says.
pub(super) fn lie_in_result(head: &mut ReduceMsg, r: Rogue) {
    if let ReduceMsg::Result {
        start,
        len,
        contributors,
    } = head
    {
        match r {
            Rogue::ResultRange { start: s, len: l } => (*start, *len) = (s, l),
            Rogue::Contributor(i) => contributors.push(MemberIdx(i)),
            _ => {}
        }
    }
}

/// A data chunk's bytes (compression wire format) claiming element offset `offset`.
pub(super) fn with_offset(chunk: &ChunkOut<'_>, offset: u64) -> Result<Vec<u8>, AveragerError> {
    let mut frame = match chunk {
        ChunkOut::Encoded(bytes) => bytes.to_vec(),
        ChunkOut::Raw {
            values,
            offset: at,
            total,
        } => {
            let mut f = raw_frame_header(values.len(), *at as u64, *total as u64)?.to_vec();
            f.extend_from_slice(bytemuck::cast_slice(values));
            f
        }
    };
    // The chunk header keeps the offset at bytes 16..24 (little-endian u64).
    if let Some(field) = frame.get_mut(16..24) {
        field.copy_from_slice(&offset.to_le_bytes());
    }
    Ok(frame)
}
