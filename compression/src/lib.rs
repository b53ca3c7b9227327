//! Tensor codecs and the chunk wire format of Starling.
//!
//! Every tensor a peer sends for averaging or to an expert passes through this crate, so it is built to be
//! exact about what it promises, safe against hostile bytes, and as fast as memory allows:
//!
//! - **Codecs** ([`Codec`]) over `&[f32]` (and f16/bf16 input): raw f32, f16, bf16, mean/std-scaled f16, uniform
//!   8-bit and quantile 8-bit with codebooks of bin means (so the decoded mean is the input's), blockwise 8-bit
//!   with per-block absmax and a bitsandbytes-style dynamic map, uniform 4-bit, and a size-adaptive policy. An
//!   optional lossless zstd stage runs over the encoded body where it shrinks it.
//! - **The wire format** ([`format`](mod@format)): a versioned, self-describing 48-byte header (magic, version, codec,
//!   flags, element count, offset and total for chunking, lengths) before the codec's parameters and payload.
//!   Decoders check every field before they allocate or index, refuse more than [`MAX_ELEMENTS`] (or a lower
//!   limit), reject NaN/Inf unless told otherwise, and never leave an output half-written on error.
//! - **Chunking**: [`split_chunks`] cuts a flat tensor into frames of at most N bytes; [`ChunkAssembler`] places
//!   frames arriving in any order, refusing overlaps and strangers.
//! - **Hot-path APIs**: [`encode_into`] reuses the output buffer, [`decode_into`] writes into an existing slice,
//!   [`decode_add`] accumulates `weight * decoded` for reducers; [`Decoder`] keeps zstd scratch between frames.
//!   Kernels are simple loops that vectorize, processed in L1-sized blocks; large tensors can use rayon
//!   ([`EncodeOptions::parallel`], [`DecodeOptions::parallel`]).
//! - **Error feedback** ([`ErrorFeedback`]) for lossy codecs on gradients, and the benchmark behind
//!   `starling bench compression` ([`bench::run_benchmark`]).
//!
//! ```
//! use starling_compression::{decode_add, encode, Codec, EncodeOptions};
//! let grad: Vec<f32> = (0..50_000).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3).collect();
//! let codec: Codec = "u8".parse()?;
//! let frame = encode(codec, &grad, &EncodeOptions::default())?;
//! let mut sum = vec![0.0f32; grad.len()];
//! decode_add(&frame, &mut sum, 1.0)?;
//! let mean_in: f64 = grad.iter().map(|&v| f64::from(v)).sum::<f64>() / grad.len() as f64;
//! let mean_out: f64 = sum.iter().map(|&v| f64::from(v)).sum::<f64>() / sum.len() as f64;
//! assert!((mean_in - mean_out).abs() < 1e-6);
//! # Ok::<(), starling_compression::Error>(())
//! ```
//!
//! Departures from hivemind's compression: statistics of large tensors (range of the uniform codecs, quantile
//! edges) come from a deterministic sample instead of a full pass or sort; codebooks hold bin means rather than
//! bin centres; and the blockwise map gives its top decade more levels than bitsandbytes' (see
//! [`DECADE_LEVELS`]).

#![warn(missing_docs)]

pub mod bench;
mod chunk;
mod codec;
mod codecs;
pub mod dct;
mod error;
mod feedback;
pub mod format;
mod frame;
pub mod lowrank;
mod options;
mod stats;
pub mod synthetic;

pub use chunk::{elements_per_chunk, split_chunks, ChunkAssembler, SplitChunks};
pub use codec::Codec;
pub use codecs::blockwise::{BLOCK_SIZE, DECADE_LEVELS};
pub use codecs::codebook::{
    QUANTILE_SAMPLE_ELEMENTS, UNIFORM4_RANGE_SIGMAS, UNIFORM8_RANGE_SIGMAS,
};
pub use error::{Error, Result};
pub use feedback::ErrorFeedback;
pub use format::{
    ChunkHeader, FORMAT_VERSION, HEADER_LEN, MAGIC, MAX_ELEMENTS, MAX_TOTAL_ELEMENTS,
};
pub use frame::{
    decode, decode_add, decode_into, encode, encode_bf16, encode_f16, encode_into,
    raw_frame_header, Decoder,
};
pub use options::{
    AdaptivePolicy, DecodeOptions, EncodeOptions, NonFinite, ADAPTIVE_THRESHOLD_ELEMENTS,
    DEFAULT_ZSTD_LEVEL, PARALLEL_MIN_ELEMENTS,
};
