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

    /// For callers that encode in pieces of their own (an all-reduce that quantizes chunk by
    /// chunk inside spans): adds the residual to `values` in place, giving the corrected
    /// contribution to encode. Record what each piece lost afterwards with
    /// [`set_residual`](Self::set_residual) (or [`clear_residual`](Self::clear_residual) where
    /// it went out exactly); where nothing went out, leave the residual as it is.
    ///
    /// ```
    /// use starling_compression::{decode, encode, Codec, EncodeOptions, DecodeOptions, ErrorFeedback};
    /// let grad = vec![0.3f32, -0.1, 0.05, 0.7];
    /// let mut feedback = ErrorFeedback::new(4);
    /// let mut corrected = grad.clone();
    /// feedback.add_residual_to(&mut corrected)?;
    /// // The first two values go out quantized, the last two exactly.
    /// let frame = encode(Codec::Uniform4Bit, &corrected[..2], &EncodeOptions::default())?;
    /// let sent = decode(&frame, &DecodeOptions::default())?;
    /// let lost: Vec<f32> = corrected[..2].iter().zip(&sent).map(|(c, s)| c - s).collect();
    /// feedback.set_residual(0, &lost)?;
    /// feedback.clear_residual(2..4)?;
    /// assert_eq!(&feedback.residual()[..2], &lost[..]);
    /// assert_eq!(&feedback.residual()[2..], &[0.0, 0.0]);
    /// # Ok::<(), starling_compression::Error>(())
    /// ```
    pub fn add_residual_to(&self, values: &mut [f32]) -> Result<()> {
        if values.len() != self.residual.len() {
            return Err(Error::LengthMismatch {
                field: "contribution length",
                expected: self.residual.len() as u64,
                actual: values.len() as u64,
            });
        }
        values
            .iter_mut()
            .zip(&self.residual)
            .for_each(|(v, r)| *v += r);
        Ok(())
    }

    /// Sets the residual of the elements `offset..offset + residual.len()` (what encoding that
    /// piece of the corrected contribution lost: corrected minus decoded).
    pub fn set_residual(&mut self, offset: usize, residual: &[f32]) -> Result<()> {
        let range = self.piece(offset, residual.len())?;
        self.residual[range].copy_from_slice(residual);
        Ok(())
    }

    /// Zeroes the residual of `range` (that piece went out exactly).
    pub fn clear_residual(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        let range = self.piece(range.start, range.len())?;
        self.residual[range].fill(0.0);
        Ok(())
    }

    fn piece(&self, offset: usize, len: usize) -> Result<std::ops::Range<usize>> {
        match offset.checked_add(len) {
            Some(end) if end <= self.residual.len() => Ok(offset..end),
            _ => Err(Error::LengthMismatch {
                field: "residual piece end",
                expected: self.residual.len() as u64,
                actual: offset.saturating_add(len) as u64,
            }),
        }
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
