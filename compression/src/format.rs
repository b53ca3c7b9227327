//! The chunk wire format: a fixed, versioned header followed by the codec's parameters and payload.
//!
//! ```text
//! offset size field
//!      0    4 magic            b"STRL"
//!      4    1 format version   FORMAT_VERSION (1)
//!      5    1 codec id         Codec::wire_id
//!      6    1 flags            bit 0: body is zstd-compressed; other bits must be 0
//!      7    1 reserved         0
//!      8    8 count            elements in this frame (u64 LE, at most MAX_ELEMENTS)
//!     16    8 offset           index of the frame's first element in the whole tensor (u64 LE)
//!     24    8 total            elements in the whole tensor (u64 LE, at most MAX_TOTAL_ELEMENTS)
//!     32    4 params length    bytes of codec parameters before zstd (u32 LE; fixed per codec)
//!     36    4 payload length   bytes of payload before zstd (u32 LE; a function of codec and count)
//!     40    4 body length      bytes after the header on the wire (u32 LE; params + payload unless zstd)
//!     44    4 reserved         0
//!     48      body             params then payload, or one zstd frame holding both
//! ```
//! All multi-byte values are little-endian. Codec parameters are f32 LE: ScaledFloat16 stores mean then standard
//! deviation; Uniform8Bit and Quantile8Bit store a 256-entry codebook; Uniform4Bit a 16-entry codebook. Blockwise8Bit
//! keeps its per-block absolute maxima (f32 LE, one per [`BLOCK_SIZE`](crate::BLOCK_SIZE) elements) at the start of
//! its payload, followed by one code byte per element. Uniform4Bit packs element `2i` in the low nibble of byte `i`
//! and element `2i+1` in the high nibble (an odd count leaves a zero high nibble).
//!
//! Every field is checked before anything is allocated or indexed: lengths must match what codec and count imply
//! exactly, the frame must be exactly `HEADER_LEN + body length` bytes, and `offset + count <= total`.

use std::ops::Range;

use crate::codec::Codec;
use crate::error::{Error, Result};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"STRL";

/// The wire format version this build writes and reads.
pub const FORMAT_VERSION: u8 = 1;

/// Bytes of the fixed frame header.
pub const HEADER_LEN: usize = 48;

/// Hard maximum of elements in one frame: 2^28 (1 GiB of f32). Decoders refuse larger counts before allocating;
/// [`DecodeOptions::max_elements`](crate::DecodeOptions::max_elements) can lower it further.
pub const MAX_ELEMENTS: usize = 1 << 28;

/// Hard maximum of elements in a whole (chunked) tensor: 2^40.
pub const MAX_TOTAL_ELEMENTS: u64 = 1 << 40;

/// Flag bit: the body (params and payload) is one zstd frame.
pub(crate) const FLAG_ZSTD: u8 = 1;

/// The decoded, validated header of one frame.
///
/// ```
/// use starling_compression::{encode, ChunkHeader, Codec, EncodeOptions};
/// let frame = encode(Codec::Float16, &[1.0, 2.0, 3.0], &EncodeOptions::default())?;
/// let header = ChunkHeader::parse(&frame)?;
/// assert_eq!((header.codec, header.count, header.offset, header.total), (Codec::Float16, 3, 0, 3));
/// assert_eq!(header.frame_len(), frame.len());
/// # Ok::<(), starling_compression::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    /// The codec of the payload (never `Adaptive`).
    pub codec: Codec,
    /// Elements in this frame.
    pub count: usize,
    /// Index of this frame's first element in the whole tensor.
    pub offset: u64,
    /// Elements in the whole tensor.
    pub total: u64,
    /// Whether the body is zstd-compressed.
    pub zstd: bool,
    /// Bytes after the header on the wire.
    pub body_len: usize,
}

impl ChunkHeader {
    /// Parses and validates the fixed header at the start of `bytes` without requiring the body to be present: use
    /// it to learn a frame's length ([`frame_len`](Self::frame_len)) from its first [`HEADER_LEN`] bytes.
    pub fn parse_prefix(bytes: &[u8]) -> Result<ChunkHeader> {
        let Some(h) = bytes.first_chunk::<HEADER_LEN>() else {
            return Err(Error::Truncated {
                len: bytes.len(),
                need: HEADER_LEN,
            });
        };
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != MAGIC {
            return Err(Error::BadMagic { found: magic });
        }
        if h[4] != FORMAT_VERSION {
            return Err(Error::UnsupportedVersion {
                found: h[4],
                supported: FORMAT_VERSION,
            });
        }
        let codec = Codec::from_wire_id(h[5])?;
        let flags = h[6];
        if flags & !FLAG_ZSTD != 0 {
            return Err(Error::UnknownFlags(flags & !FLAG_ZSTD));
        }
        if h[7] != 0 || read_u32(h, 44) != 0 {
            return Err(Error::ReservedNonZero);
        }
        let count = read_u64(h, 8);
        let offset = read_u64(h, 16);
        let total = read_u64(h, 24);
        if count > MAX_ELEMENTS as u64 {
            return Err(Error::TooManyElements {
                count,
                max: MAX_ELEMENTS as u64,
            });
        }
        if total > MAX_TOTAL_ELEMENTS {
            return Err(Error::TooManyElements {
                count: total,
                max: MAX_TOTAL_ELEMENTS,
            });
        }
        match offset.checked_add(count) {
            Some(end) if end <= total => {}
            _ => {
                return Err(Error::ChunkOutOfRange {
                    offset,
                    count,
                    total,
                })
            }
        }
        // count <= MAX_ELEMENTS = 2^28, so it fits usize on every supported target and the layout cannot overflow.
        let count = count as usize;
        let (Some(params_len), Some(payload_len)) = (codec.params_len(), codec.payload_len(count))
        else {
            return Err(Error::InvalidParameter("codec has no wire layout"));
        };
        expect_len("params length", params_len, read_u32(h, 32))?;
        expect_len("payload length", payload_len, read_u32(h, 36))?;
        let body_len = read_u32(h, 40) as usize;
        let raw_len = params_len + payload_len;
        let zstd = flags & FLAG_ZSTD != 0;
        if zstd {
            // The encoder keeps the zstd stage only when it shrinks the body.
            if body_len >= raw_len {
                return Err(Error::LengthMismatch {
                    field: "compressed body length (must be below the raw length)",
                    expected: raw_len.saturating_sub(1) as u64,
                    actual: body_len as u64,
                });
            }
        } else {
            expect_len("body length", raw_len, body_len as u32)?;
        }
        Ok(ChunkHeader {
            codec,
            count,
            offset,
            total,
            zstd,
            body_len,
        })
    }

    /// Parses and validates a whole frame's header: [`parse_prefix`](Self::parse_prefix) plus a check that `bytes`
    /// is exactly one frame long.
    pub fn parse(bytes: &[u8]) -> Result<ChunkHeader> {
        let header = Self::parse_prefix(bytes)?;
        if bytes.len() != header.frame_len() {
            if bytes.len() < header.frame_len() {
                return Err(Error::Truncated {
                    len: bytes.len(),
                    need: header.frame_len(),
                });
            }
            return Err(Error::LengthMismatch {
                field: "frame length",
                expected: header.frame_len() as u64,
                actual: bytes.len() as u64,
            });
        }
        Ok(header)
    }

    /// Bytes of the whole frame on the wire.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len
    }

    /// The elements this frame covers in the whole tensor.
    pub fn range(&self) -> Range<u64> {
        self.offset..self.offset + self.count as u64
    }

    /// Bytes of codec parameters before the zstd stage.
    pub fn params_len(&self) -> usize {
        self.codec.params_len().unwrap_or(0)
    }

    /// Bytes of payload before the zstd stage.
    pub fn payload_len(&self) -> usize {
        self.codec.payload_len(self.count).unwrap_or(0)
    }

    /// Writes this header into the first [`HEADER_LEN`] bytes of `out`.
    pub(crate) fn write(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = FORMAT_VERSION;
        out[5] = self.codec.wire_id().unwrap_or(u8::MAX);
        out[6] = if self.zstd { FLAG_ZSTD } else { 0 };
        out[7] = 0;
        out[8..16].copy_from_slice(&(self.count as u64).to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.total.to_le_bytes());
        out[32..36].copy_from_slice(&(self.params_len() as u32).to_le_bytes());
        out[36..40].copy_from_slice(&(self.payload_len() as u32).to_le_bytes());
        out[40..44].copy_from_slice(&(self.body_len as u32).to_le_bytes());
        out[44..48].copy_from_slice(&0u32.to_le_bytes());
    }
}

fn expect_len(field: &'static str, expected: usize, actual: u32) -> Result<()> {
    if expected as u64 != u64::from(actual) {
        return Err(Error::LengthMismatch {
            field,
            expected: expected as u64,
            actual: u64::from(actual),
        });
    }
    Ok(())
}

fn read_u32(h: &[u8; HEADER_LEN], at: usize) -> u32 {
    u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]])
}

fn read_u64(h: &[u8; HEADER_LEN], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[at..at + 8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(codec: Codec, count: usize) -> ChunkHeader {
        let raw = codec.params_len().unwrap_or(0) + codec.payload_len(count).unwrap_or(0);
        ChunkHeader {
            codec,
            count,
            offset: 5,
            total: 5 + count as u64,
            zstd: false,
            body_len: raw,
        }
    }

    fn frame(h: &ChunkHeader) -> Vec<u8> {
        let mut out = vec![0u8; h.frame_len()];
        let head: &mut [u8; HEADER_LEN] =
            (&mut out[..HEADER_LEN]).try_into().expect("header slice");
        h.write(head);
        out
    }

    #[test]
    fn header_round_trips() {
        for codec in Codec::WIRE {
            let h = header(codec, 4097);
            assert_eq!(ChunkHeader::parse(&frame(&h)).ok(), Some(h));
        }
    }

    #[test]
    fn header_rejects_each_bad_field() {
        let h = header(Codec::Uniform8Bit, 100);
        let good = frame(&h);
        let patch = |at: usize, bytes: &[u8]| {
            let mut f = good.clone();
            f[at..at + bytes.len()].copy_from_slice(bytes);
            ChunkHeader::parse(&f)
        };
        assert!(matches!(patch(0, b"XTRL"), Err(Error::BadMagic { .. })));
        assert!(matches!(
            patch(4, &[2]),
            Err(Error::UnsupportedVersion { found: 2, .. })
        ));
        assert!(matches!(patch(5, &[9]), Err(Error::UnknownCodecId(9))));
        assert!(matches!(patch(6, &[2]), Err(Error::UnknownFlags(2))));
        assert!(matches!(patch(7, &[1]), Err(Error::ReservedNonZero)));
        assert!(matches!(patch(44, &[1]), Err(Error::ReservedNonZero)));
        assert!(matches!(
            patch(8, &(1u64 << 40).to_le_bytes()),
            Err(Error::TooManyElements { .. })
        ));
        assert!(matches!(
            patch(8, &99u64.to_le_bytes()),
            Err(Error::LengthMismatch { .. })
        ));
        assert!(matches!(
            patch(16, &u64::MAX.to_le_bytes()),
            Err(Error::ChunkOutOfRange { .. })
        ));
        assert!(matches!(
            patch(24, &10u64.to_le_bytes()),
            Err(Error::ChunkOutOfRange { .. })
        ));
        assert!(matches!(
            patch(24, &u64::MAX.to_le_bytes()),
            Err(Error::TooManyElements { .. })
        ));
        assert!(matches!(
            patch(32, &0u32.to_le_bytes()),
            Err(Error::LengthMismatch { .. })
        ));
        assert!(matches!(
            patch(36, &99u32.to_le_bytes()),
            Err(Error::LengthMismatch { .. })
        ));
        assert!(matches!(
            patch(40, &0u32.to_le_bytes()),
            Err(Error::LengthMismatch { .. })
        ));
        // zstd flag with a body as long as the raw one
        assert!(matches!(patch(6, &[1]), Err(Error::LengthMismatch { .. })));
        assert!(matches!(
            ChunkHeader::parse(&good[..HEADER_LEN - 1]),
            Err(Error::Truncated { .. })
        ));
        assert!(matches!(
            ChunkHeader::parse(&good[..good.len() - 1]),
            Err(Error::Truncated { .. })
        ));
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(
            ChunkHeader::parse(&long),
            Err(Error::LengthMismatch { .. })
        ));
        assert!(ChunkHeader::parse_prefix(&good[..HEADER_LEN]).is_ok());
    }
}
