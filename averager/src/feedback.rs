//! Error feedback across rounds for one tensor set ([`Residuals`]), for lossy codecs.
//!
//! The all-reduce quantizes chunk by chunk inside spans, so a caller cannot pre-quantize its
//! tensors: the averager does the bookkeeping. With
//! [`Averager::step_with_feedback`](crate::Averager::step_with_feedback) a round averages
//! `tensors + residual` instead of `tensors`, and afterwards keeps, per element:
//!
//! - on spans sent to another reducer: `corrected - decode(encode(corrected))`, what the
//!   reducer did not see of this peer's contribution (one chunk's quantization at a time);
//! - on spans this peer reduced itself (its own contribution is used exactly): zero;
//! - on spans that were not averaged (no group part, a failed reducer): the residual as it
//!   was, since nothing of it went out.
//!
//! So over many rounds the sum of what the group averaged of this peer tracks the sum of its
//! tensors to within one residual, instead of carrying the codec's bias every round. The
//! deltas reducers send back are quantized too and feedback does not cover them; they are
//! differences between peers' contributions, and their rounding is not the same every round
//! once the contributions carry residuals.
//!
//! Memory: one `f32` per element, kept by the caller (one [`Residuals`] per tensor set that
//! wants feedback, e.g. gradients but not parameters). The residual starts from zero when the
//! tensor sizes or the codec change, or after [`Residuals::reset`].

use starling_compression::{Codec, ErrorFeedback};

/// The error-feedback state of one tensor set across averaging rounds (see the module docs of
/// `feedback`). Pass the same value to every
/// [`Averager::step_with_feedback`](crate::Averager::step_with_feedback) of that tensor set.
///
/// ```
/// let mut residuals = starling_averager::Residuals::new();
/// assert!(residuals.residual().is_empty()); // sized by the first step
/// residuals.reset();
/// ```
#[derive(Debug, Clone, Default)]
pub struct Residuals {
    /// The tensor sizes and codec the residual belongs to.
    schema: Option<(Vec<usize>, Codec)>,
    feedback: Option<ErrorFeedback>,
}

impl Residuals {
    /// No residual yet; the first step sizes it.
    pub fn new() -> Self {
        Residuals::default()
    }

    /// The residual carried into the next round, over the flattened tensors (empty before the
    /// first step with a lossy codec).
    pub fn residual(&self) -> &[f32] {
        self.feedback.as_ref().map_or(&[], |f| f.residual())
    }

    /// Forgets the residual (e.g. after the model was reloaded or synced).
    pub fn reset(&mut self) {
        if let Some(f) = &mut self.feedback {
            f.reset();
        }
    }

    /// The feedback state for tensors of `sizes` sent with `codec`: the current one if it was
    /// built for exactly these, otherwise a zero residual of the new size.
    pub(crate) fn prepare(&mut self, sizes: &[usize], codec: Codec) -> &mut ErrorFeedback {
        let same = self
            .schema
            .as_ref()
            .is_some_and(|(s, c)| s == sizes && *c == codec);
        if !same || self.feedback.is_none() {
            let total = sizes.iter().sum();
            self.schema = Some((sizes.to_vec(), codec));
            self.feedback = Some(ErrorFeedback::new(total));
        }
        self.feedback.get_or_insert_with(|| ErrorFeedback::new(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_schema_or_codec_starts_from_zero() {
        let mut r = Residuals::new();
        r.prepare(&[2, 3], Codec::Uniform4Bit)
            .set_residual(0, &[1.0; 5])
            .unwrap();
        assert_eq!(r.residual(), &[1.0; 5]);
        // Same schema: kept.
        r.prepare(&[2, 3], Codec::Uniform4Bit);
        assert_eq!(r.residual(), &[1.0; 5]);
        // Other sizes (same total), another codec: a zero residual.
        r.prepare(&[3, 2], Codec::Uniform4Bit);
        assert_eq!(r.residual(), &[0.0; 5]);
        r.prepare(&[3, 2], Codec::Uniform4Bit)
            .set_residual(1, &[2.0])
            .unwrap();
        r.prepare(&[3, 2], Codec::Float16);
        assert_eq!(r.residual(), &[0.0; 5]);
        r.prepare(&[4], Codec::Float16);
        assert_eq!(r.residual().len(), 4);
        r.prepare(&[4], Codec::Float16)
            .set_residual(0, &[3.0; 4])
            .unwrap();
        r.reset();
        assert_eq!(r.residual(), &[0.0; 4]);
    }
}
