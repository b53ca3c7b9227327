//! Tunables of encoding and decoding, with defaults and builder methods.

use crate::codec::Codec;
use crate::format::MAX_ELEMENTS;

/// Default [`AdaptivePolicy::threshold`]: tensors of fewer than 65 536 elements (256 KiB of f32) go uncompressed.
pub const ADAPTIVE_THRESHOLD_ELEMENTS: usize = 1 << 16;

/// Below this many elements the multi-threaded paths never split work (rayon overhead would dominate).
pub const PARALLEL_MIN_ELEMENTS: usize = 1 << 18;

/// Default zstd level of [`EncodeOptions::with_zstd`].
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;

/// What to do with NaN and ±Inf.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NonFinite {
    /// Refuse them with [`Error::NonFiniteInput`](crate::Error::NonFiniteInput) (encoding) or
    /// [`Error::NonFinitePayload`](crate::Error::NonFinitePayload) (decoding).
    #[default]
    Reject,
    /// Accept them. Float codecs (`none`, `f16`, `bf16`) carry NaN and ±Inf through; codecs that compute
    /// statistics (`scaled-f16`, `u8`, `quantile8`, `blockwise8`, `u4`) encode them as 0.0.
    Allow,
}

/// The size-adaptive policy behind [`Codec::Adaptive`]: tensors below `threshold` elements are sent uncompressed
/// (their codec overhead and error are not worth the bytes saved), larger ones use `large`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptivePolicy {
    /// Tensors with fewer elements than this are sent with [`Codec::None`].
    pub threshold: usize,
    /// Codec for tensors of at least `threshold` elements.
    pub large: Codec,
}

impl Default for AdaptivePolicy {
    fn default() -> Self {
        AdaptivePolicy {
            threshold: ADAPTIVE_THRESHOLD_ELEMENTS,
            large: Codec::Uniform8Bit,
        }
    }
}

/// How to encode.
///
/// ```
/// use starling_compression::{Codec, EncodeOptions, NonFinite};
/// let opts = EncodeOptions::default().with_zstd(3).with_parallel(true).with_nonfinite(NonFinite::Allow);
/// assert_eq!(opts.zstd_level, Some(3));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeOptions {
    /// NaN/Inf handling; rejected by default.
    pub nonfinite: NonFinite,
    /// Run the lossless zstd stage over the body at this level. The stage is kept only when it makes the frame
    /// smaller (for payloads over 256 KiB a 64 KiB probe must shrink by a tenth first). It pays on sparse or
    /// structured data; dense quantized gradients gain ~1.1x at a fraction of the codec's speed. Off by default.
    pub zstd_level: Option<i32>,
    /// Use the rayon thread pool for tensors of at least [`PARALLEL_MIN_ELEMENTS`]. Off by default.
    pub parallel: bool,
    /// The policy [`Codec::Adaptive`] resolves through.
    pub adaptive: AdaptivePolicy,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            nonfinite: NonFinite::Reject,
            zstd_level: None,
            parallel: false,
            adaptive: AdaptivePolicy::default(),
        }
    }
}

impl EncodeOptions {
    /// Sets the NaN/Inf handling.
    pub fn with_nonfinite(mut self, nonfinite: NonFinite) -> Self {
        self.nonfinite = nonfinite;
        self
    }

    /// Turns on the zstd stage at `level` (1..=22; 3 is a good default, see [`DEFAULT_ZSTD_LEVEL`]).
    pub fn with_zstd(mut self, level: i32) -> Self {
        self.zstd_level = Some(level);
        self
    }

    /// Turns the multi-threaded path for large tensors on or off.
    pub fn with_parallel(mut self, parallel: bool) -> Self {
        self.parallel = parallel;
        self
    }

    /// Sets the policy of [`Codec::Adaptive`].
    pub fn with_adaptive(mut self, adaptive: AdaptivePolicy) -> Self {
        self.adaptive = adaptive;
        self
    }
}

/// How to decode, and how much a decoder may trust a frame.
///
/// ```
/// use starling_compression::DecodeOptions;
/// let opts = DecodeOptions::default().with_max_elements(1 << 20);
/// assert_eq!(opts.max_elements, 1 << 20);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Frames declaring more elements are refused before anything is allocated. At most (and by default)
    /// [`MAX_ELEMENTS`]. A decode allocates at most `4 * max_elements` bytes of output plus, for a zstd frame, its
    /// raw body (at most `4 * max_elements + 1024` bytes) and zstd's own context.
    pub max_elements: usize,
    /// NaN/Inf handling; frames that decode to non-finite values are rejected by default.
    pub nonfinite: NonFinite,
    /// Use the rayon thread pool for frames of at least [`PARALLEL_MIN_ELEMENTS`]. Off by default.
    pub parallel: bool,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            max_elements: MAX_ELEMENTS,
            nonfinite: NonFinite::Reject,
            parallel: false,
        }
    }
}

impl DecodeOptions {
    /// Lowers the element limit (values above [`MAX_ELEMENTS`] are capped to it).
    pub fn with_max_elements(mut self, max_elements: usize) -> Self {
        self.max_elements = max_elements.min(MAX_ELEMENTS);
        self
    }

    /// Sets the NaN/Inf handling.
    pub fn with_nonfinite(mut self, nonfinite: NonFinite) -> Self {
        self.nonfinite = nonfinite;
        self
    }

    /// Turns the multi-threaded path for large frames on or off.
    pub fn with_parallel(mut self, parallel: bool) -> Self {
        self.parallel = parallel;
        self
    }
}
