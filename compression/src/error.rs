//! The crate's error type: every way encoding, decoding or assembling chunks can fail.

use crate::codec::Codec;

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while encoding, decoding or assembling chunks.
///
/// Decoding errors never leave an output buffer half-written: every check runs before the first element is stored.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The frame is shorter than its header, or shorter than the header says.
    #[error("frame is truncated: {len} bytes, need at least {need}")]
    Truncated {
        /// Bytes available.
        len: usize,
        /// Bytes required.
        need: usize,
    },
    /// The frame does not start with [`MAGIC`](crate::MAGIC).
    #[error("bad magic {found:02x?}: not a Starling tensor frame")]
    BadMagic {
        /// The first four bytes found.
        found: [u8; 4],
    },
    /// The frame uses a wire format version this build does not speak.
    #[error("unsupported wire format version {found} (this build speaks version {supported})")]
    UnsupportedVersion {
        /// Version in the frame.
        found: u8,
        /// [`FORMAT_VERSION`](crate::FORMAT_VERSION).
        supported: u8,
    },
    /// The codec id byte names no codec.
    #[error("unknown codec id {0} in frame header")]
    UnknownCodecId(u8),
    /// A codec name given by a user or a config names no codec.
    #[error(
        "unknown codec name {0:?}; expected one of none, f16, bf16, scaled-f16, u8, quantile8, blockwise8, u4, adaptive"
    )]
    UnknownCodecName(String),
    /// The header sets flag bits this version does not define.
    #[error("unknown flag bits {0:#04x} in frame header")]
    UnknownFlags(u8),
    /// A reserved header field is not zero.
    #[error("reserved header field is not zero")]
    ReservedNonZero,
    /// More elements than a hard or configured limit.
    #[error("{count} elements exceed the limit of {max}")]
    TooManyElements {
        /// Elements declared or given.
        count: u64,
        /// The limit.
        max: u64,
    },
    /// A length or count field disagrees with what the rest of the frame or the caller implies.
    #[error("{field} is {actual} but must be {expected}")]
    LengthMismatch {
        /// Which length.
        field: &'static str,
        /// The value it must have.
        expected: u64,
        /// The value found.
        actual: u64,
    },
    /// A chunk's element range does not fit in its tensor.
    #[error(
        "chunk of {count} elements at offset {offset} lies outside a tensor of {total} elements"
    )]
    ChunkOutOfRange {
        /// First element of the chunk in the tensor.
        offset: u64,
        /// Elements in the chunk.
        count: u64,
        /// Elements in the tensor.
        total: u64,
    },
    /// A codec parameter on the wire (codebook entry, block scale, mean, standard deviation) is unusable.
    #[error("invalid codec parameter: {0}")]
    InvalidParameter(&'static str),
    /// A caller's argument is unusable (a rank out of range, a matrix outside its buffer).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The input cannot be represented by the chosen codec at all.
    #[error("input out of range for codec {codec}: {reason}")]
    OutOfRange {
        /// The codec.
        codec: Codec,
        /// Why.
        reason: &'static str,
    },
    /// The input holds a NaN or an infinity and the encoder was not told to accept them.
    #[error(
        "input element {index} is {value} (NaN or infinite); such values are rejected unless \
         EncodeOptions::nonfinite is NonFinite::Allow"
    )]
    NonFiniteInput {
        /// Index of the first such element.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A frame carries a NaN or an infinity and the decoder was not told to accept them.
    #[error(
        "frame element {index} is NaN or infinite; such values are rejected unless \
         DecodeOptions::nonfinite is NonFinite::Allow"
    )]
    NonFinitePayload {
        /// Index (within the frame) of the first such element.
        index: usize,
    },
    /// The zstd stage failed to compress or decompress.
    #[error("zstd: {0}")]
    Zstd(String),
    /// A chunk size limit too small to carry even one element.
    #[error("a chunk of at most {max_chunk_bytes} bytes cannot hold one element of codec {codec} (needs {needed})")]
    ChunkTooSmall {
        /// The codec.
        codec: Codec,
        /// The limit asked for.
        max_chunk_bytes: usize,
        /// The smallest frame of one element.
        needed: usize,
    },
    /// A chunk overlaps (or repeats) one already accepted.
    #[error("chunk of {count} elements at offset {offset} overlaps a chunk already received")]
    ChunkOverlap {
        /// First element of the chunk.
        offset: u64,
        /// Elements in the chunk.
        count: u64,
    },
    /// The tensor is not complete yet.
    #[error("tensor incomplete: {received} of {total} elements received")]
    Incomplete {
        /// Elements received so far.
        received: u64,
        /// Elements in the tensor.
        total: u64,
    },
}

/// [`Error::LengthMismatch`] for `field` unless `got == want`: a caller's buffer of the wrong size.
pub(crate) fn check_len(field: &'static str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::LengthMismatch {
            field,
            expected: want as u64,
            actual: got as u64,
        });
    }
    Ok(())
}
