//! Error feedback for lossy codecs on gradients: what quantization dropped this round is added back next round,
//! so errors do not accumulate (the sum of what was sent tracks the sum of the gradients to within one residual).

use crate::chunk::split_chunks;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::frame::{encode, Decoder};
use crate::options::{DecodeOptions, EncodeOptions, NonFinite};

/// Keeps the residual `corrected - decode(encode(corrected))` of one tensor (or span) between rounds, where
/// `corrected = gradient + previous residual`.
///
/// ```
/// use starling_compression::{decode, Codec, DecodeOptions, EncodeOptions, ErrorFeedback};
/// let grad = vec![0.3f32, -0.1, 0.05, 0.7];
/// let mut feedback = ErrorFeedback::new(grad.len());
/// let mut sent = vec![0.0f32; grad.len()];
/// for _ in 0..100 {
///     let frame = feedback.encode(Codec::Uniform4Bit, &grad, &EncodeOptions::default())?;
///     for (s, d) in sent.iter_mut().zip(decode(&frame, &DecodeOptions::default())?) {
///         *s += d;
///     }
/// }
/// // What was sent over 100 rounds equals 100 gradients minus the last residual.
/// for ((s, g), r) in sent.iter().zip(&grad).zip(feedback.residual()) {
///     assert!((s - (100.0 * g - r)).abs() < 1e-3);
/// }
/// # Ok::<(), starling_compression::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
    scratch: Vec<f32>,
}

impl ErrorFeedback {
    /// Feedback state for a tensor of `len` elements, starting with a zero residual.
    pub fn new(len: usize) -> ErrorFeedback {
        ErrorFeedback {
            residual: vec![0.0; len],
            scratch: Vec::new(),
        }
    }

    /// Elements tracked.
    pub fn len(&self) -> usize {
        self.residual.len()
    }

    /// Whether the tracked tensor is empty.
    pub fn is_empty(&self) -> bool {
        self.residual.is_empty()
    }

    /// The residual carried into the next round.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Forgets the residual (e.g. after the model was reloaded).
    pub fn reset(&mut self) {
        self.residual.fill(0.0);
    }

    /// Encodes `grad + residual` into one frame and keeps the new residual. On error the residual is unchanged.
    pub fn encode(&mut self, codec: Codec, grad: &[f32], opts: &EncodeOptions) -> Result<Vec<u8>> {
        self.correct(grad)?;
        let frame = encode(codec, &self.scratch, opts)?;
        self.commit(std::slice::from_ref(&frame))?;
        Ok(frame)
    }

    /// Like [`encode`](Self::encode), split into frames of at most `max_chunk_bytes` (see
    /// [`split_chunks`](crate::split_chunks)).
    pub fn encode_chunks(
        &mut self,
        codec: Codec,
        grad: &[f32],
        max_chunk_bytes: usize,
        opts: &EncodeOptions,
    ) -> Result<Vec<Vec<u8>>> {
        self.correct(grad)?;
        let frames = split_chunks(codec, &self.scratch, max_chunk_bytes, opts)?
            .collect::<Result<Vec<_>>>()?;
        self.commit(&frames)?;
        Ok(frames)
    }

    /// scratch = grad + residual.
    fn correct(&mut self, grad: &[f32]) -> Result<()> {
        if grad.len() != self.residual.len() {
            return Err(Error::LengthMismatch {
                field: "gradient length",
                expected: self.residual.len() as u64,
                actual: grad.len() as u64,
            });
        }
        self.scratch.clear();
        self.scratch
            .extend(grad.iter().zip(&self.residual).map(|(g, r)| g + r));
        Ok(())
    }

    /// residual = scratch - decode(frames), then swap into place.
    fn commit(&mut self, frames: &[Vec<u8>]) -> Result<()> {
        let mut decoder = Decoder::new(DecodeOptions::default().with_nonfinite(NonFinite::Allow));
        for frame in frames {
            let header = crate::format::ChunkHeader::parse(frame)?;
            let range = header.offset as usize..header.offset as usize + header.count;
            decoder.decode_add(frame, &mut self.scratch[range], -1.0)?;
        }
        std::mem::swap(&mut self.residual, &mut self.scratch);
        Ok(())
    }
}
