//! DCT top-k gradient compression (in the style of DisTrO/DeMo): the arithmetic, without the
//! network. The gradient is cut into chunks of `chunk` values; each chunk goes through an
//! orthonormal DCT-II, and only its `k` largest coefficients by magnitude are kept (their
//! values rounded to f16, or replaced by their sign times one scale for the whole buffer).
//! What was not sent is added back next round (error feedback, in the coefficient domain).
//! With a momentum `beta < 1` ([`DctTopK::momentum`]) what was not sent decays by `beta`
//! before each round's gradient is added: the residual is then DeMo's decoupled momentum
//! (each peer's own, never averaged), of which only the largest frequencies travel; paired
//! with a sign update of the averaged result (`starling_training`'s `SgdConfig::sign`) it is
//! the DeMo optimizer.
//!
//! [`DctTopK::begin`] gives the sparse coefficient vector to average (zeros elsewhere: it is
//! meant to travel through a lossless stage that removes them, such as the frames' zstd
//! stage); [`DctTopK::finish`] turns the averaged coefficients back into a gradient. The
//! average of sparse vectors holds the union of their coefficients, so members that averaged
//! the same vector hold the same bits.
//!
//! ```
//! use starling_compression::dct::{DctTopK, DctValues};
//! let grads: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3).collect();
//! let mut state = DctTopK::new(grads.len(), 64, 4, DctValues::F16)?;
//! let mut coefficients = vec![0.0; grads.len()];
//! state.begin(&grads, &mut coefficients)?;
//! assert!(coefficients.iter().filter(|&&c| c != 0.0).count() <= 16 * 4);
//! // (averaged with the group here)
//! let mut out = vec![0.0; grads.len()];
//! state.finish(&coefficients, &mut out)?;
//! # Ok::<(), starling_compression::Error>(())
//! ```

use half::f16;

use crate::error::{check_len, Error, Result};
use crate::stats::check_finite;

/// Largest chunk accepted (its basis is `chunk²` floats: 4 MiB at most).
pub const MAX_CHUNK: usize = 1024;

/// How the kept coefficients' values are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DctValues {
    /// As they are.
    F32,
    /// Rounded to half precision (values beyond its range stay f32).
    F16,
    /// Their sign times one scale, the mean magnitude of every kept coefficient of the buffer.
    Sign,
}

/// The DCT top-k state of one flat gradient buffer: its chunking, the DCT bases and the
/// error-feedback residual. See the module docs.
#[derive(Debug, Clone)]
pub struct DctTopK {
    len: usize,
    chunk: usize,
    k: usize,
    values: DctValues,
    /// Row-major `chunk x chunk`: row `f` is the basis vector of frequency `f`.
    basis: Vec<f32>,
    /// The same for the last, shorter chunk (empty when `len` is a multiple of `chunk`).
    tail_basis: Vec<f32>,
    /// The fast forward transforms of a chunk and of the last, shorter one.
    forward: Forward,
    tail_forward: Option<Forward>,
    /// What earlier rounds did not send, per coefficient.
    residual: Vec<f32>,
    /// The residual the round in progress leaves, committed by `finish`.
    pending: Vec<f32>,
    /// What the residual is multiplied by before a round adds its gradient (1: plain error
    /// feedback).
    momentum: f32,
}

impl DctTopK {
    /// State for a buffer of `len` values in chunks of `chunk` (2..=[`MAX_CHUNK`]), keeping
    /// `k` (1..=`chunk`) coefficients of each (the last, shorter chunk keeps as many in
    /// proportion, at least one).
    pub fn new(len: usize, chunk: usize, k: usize, values: DctValues) -> Result<Self> {
        if !(2..=MAX_CHUNK).contains(&chunk) || k == 0 || k > chunk {
            return Err(Error::InvalidArgument(format!(
                "DCT top-k needs 2 <= chunk <= {MAX_CHUNK} and 1 <= k <= chunk, not chunk {chunk}, k {k}"
            )));
        }
        let tail = len % chunk;
        let mut planner = rustdct::DctPlanner::new();
        Ok(DctTopK {
            len,
            chunk,
            k,
            values,
            basis: basis(chunk),
            tail_basis: if tail > 0 { basis(tail) } else { Vec::new() },
            forward: Forward::new(&mut planner, chunk),
            tail_forward: (tail > 0).then(|| Forward::new(&mut planner, tail)),
            residual: vec![0.0; len],
            pending: Vec::new(),
            momentum: 1.0,
        })
    }

    /// Keeps what was not sent as a momentum that decays by `beta` (0 < `beta` <= 1) each round
    /// (1, the default: plain error feedback, nothing is lost). With `beta` about 0.999 and a
    /// sign update of the averaged result, this is DeMo (Peng et al., 2024).
    ///
    /// ```
    /// use starling_compression::dct::{DctTopK, DctValues};
    /// let state = DctTopK::new(1000, 128, 1, DctValues::F16)?.momentum(0.999)?;
    /// assert_eq!(state.beta(), 0.999);
    /// assert!(DctTopK::new(1000, 128, 1, DctValues::F16)?.momentum(1.5).is_err());
    /// # Ok::<(), starling_compression::Error>(())
    /// ```
    pub fn momentum(mut self, beta: f32) -> Result<Self> {
        if !(beta > 0.0 && beta <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "the DCT top-k momentum must be within (0, 1], not {beta}"
            )));
        }
        self.momentum = beta;
        Ok(self)
    }

    /// The momentum what was not sent decays by each round (1: plain error feedback).
    pub fn beta(&self) -> f32 {
        self.momentum
    }

    /// Values in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Values per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Coefficients kept per chunk.
    pub fn k(&self) -> usize {
        self.k
    }

    /// How kept values are sent.
    pub fn values(&self) -> DctValues {
        self.values
    }

    /// What earlier rounds did not send (coefficient domain).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Forgets the residual (after the model was reloaded).
    pub fn reset(&mut self) {
        self.residual.fill(0.0);
        self.pending.clear();
    }

    /// Coefficients kept in a chunk of `n` values.
    fn kept(&self, n: usize) -> usize {
        if n == self.chunk {
            self.k
        } else {
            (self.k * n).div_ceil(self.chunk).clamp(1, n)
        }
    }

    /// Starts a round: transforms `grads` (plus the residual, times the momentum) chunk by
    /// chunk and writes the
    /// kept coefficients into `out` (`len()` values, zeros elsewhere). Refuses NaN/Inf and
    /// wrong sizes; the residual changes only when the round [finishes](Self::finish).
    pub fn begin(&mut self, grads: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("gradient buffer", grads.len(), self.len)?;
        check_len("coefficient buffer", out.len(), self.len)?;
        check_finite(grads, 0)?;
        let mut pending = std::mem::take(&mut self.pending);
        pending.clear();
        pending.resize(self.len, 0.0);
        // Corrected coefficients into `pending`; the kept ones move to `out`.
        let mut order: Vec<usize> = Vec::with_capacity(self.chunk);
        let mut kept_sum = 0.0f64;
        let mut kept_count = 0usize;
        for (start, n) in self.chunks() {
            let range = start..start + n;
            let forward = match &mut self.tail_forward {
                Some(tail) if n != self.chunk => tail,
                _ => &mut self.forward,
            };
            forward.apply(&grads[range.clone()], &mut pending[range.clone()]);
            for (c, r) in pending[range.clone()]
                .iter_mut()
                .zip(&self.residual[range.clone()])
            {
                *c += self.momentum * r;
            }
            let coeffs = &pending[range.clone()];
            let k = self.kept(n);
            order.clear();
            if k == 1 {
                // The largest magnitude, in one pass (the first of equals).
                let mut best = 0;
                for (i, c) in coeffs.iter().enumerate() {
                    if c.abs() > coeffs[best].abs() {
                        best = i;
                    }
                }
                order.push(best);
            } else {
                order.extend(0..n);
                if k < n {
                    order.select_nth_unstable_by(k - 1, |&a, &b| {
                        coeffs[b].abs().total_cmp(&coeffs[a].abs())
                    });
                }
            }
            let dst = &mut out[range.clone()];
            dst.fill(0.0);
            for &i in &order[..k] {
                dst[i] = coeffs[i];
                kept_sum += f64::from(coeffs[i].abs());
                kept_count += 1;
            }
        }
        match self.values {
            DctValues::F32 => {}
            DctValues::F16 => {
                for v in out.iter_mut().filter(|v| **v != 0.0) {
                    let h = f16::from_f32(*v);
                    if h.is_finite() {
                        *v = h.to_f32();
                    }
                }
            }
            DctValues::Sign => {
                let scale = (kept_sum / kept_count.max(1) as f64) as f32;
                for v in out.iter_mut().filter(|v| **v != 0.0) {
                    *v = scale.copysign(*v);
                }
            }
        }
        // What was not sent: the corrected coefficients less what goes out.
        for (p, o) in pending.iter_mut().zip(out.iter()) {
            *p -= o;
        }
        self.pending = pending;
        Ok(())
    }

    /// Ends a round: writes the inverse transform of the averaged coefficients into `grads`,
    /// and keeps what this peer did not send for the next round.
    pub fn finish(&mut self, averaged: &[f32], grads: &mut [f32]) -> Result<()> {
        if self.pending.len() != self.len {
            return Err(Error::InvalidArgument(
                "no DCT top-k round in progress: call begin first".into(),
            ));
        }
        check_len("averaged coefficients", averaged.len(), self.len)?;
        check_len("gradient buffer", grads.len(), self.len)?;
        check_finite(averaged, 0)?;
        for (start, n) in self.chunks() {
            let range = start..start + n;
            let b = if n == self.chunk {
                &self.basis
            } else {
                &self.tail_basis
            };
            inverse(b, n, &averaged[range.clone()], &mut grads[range]);
        }
        std::mem::swap(&mut self.residual, &mut self.pending);
        self.pending.clear();
        Ok(())
    }

    /// Abandons the round in progress: the residual stays as it was.
    pub fn abort(&mut self) {
        self.pending.clear();
    }

    /// `(start, length)` of every chunk.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + 'static {
        let (len, chunk) = (self.len, self.chunk);
        (0..len.div_ceil(chunk)).map(move |c| (c * chunk, chunk.min(len - c * chunk)))
    }
}

/// The orthonormal DCT-II basis of size `n`, row `f` = frequency `f` (computed in f64).
fn basis(n: usize) -> Vec<f32> {
    let mut b = vec![0.0f32; n * n];
    let nf = n as f64;
    for f in 0..n {
        let s = if f == 0 {
            (1.0 / nf).sqrt()
        } else {
            (2.0 / nf).sqrt()
        };
        for (i, v) in b[f * n..(f + 1) * n].iter_mut().enumerate() {
            *v = (s * (std::f64::consts::PI * (i as f64 + 0.5) * f as f64 / nf).cos()) as f32;
        }
    }
    b
}

/// The orthonormal DCT-II of one chunk size, in O(n log n) (rustdct, FFT-based): what
/// the dense basis computes, to rounding. Only the forward transform uses it: each peer
/// transforms its own gradient, so its bits need not match another host's (rustfft picks its
/// SIMD code by CPU), while the inverse of the averaged coefficients, which every member must
/// compute to the same bits, stays the fixed-order sparse product ([`inverse`]).
#[derive(Clone)]
struct Forward {
    dct: std::sync::Arc<dyn rustdct::TransformType2And3<f32>>,
    scratch: Vec<f32>,
    /// Scales of frequency 0 and of the others: `sqrt(1/n)` and `sqrt(2/n)`.
    scale: (f32, f32),
}

impl std::fmt::Debug for Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forward")
            .field("len", &self.dct.len())
            .finish()
    }
}

impl Forward {
    fn new(planner: &mut rustdct::DctPlanner<f32>, n: usize) -> Self {
        let dct = planner.plan_dct2(n);
        let scratch = vec![0.0; dct.get_scratch_len()];
        let nf = n as f64;
        Forward {
            dct,
            scratch,
            scale: ((1.0 / nf).sqrt() as f32, (2.0 / nf).sqrt() as f32),
        }
    }

    /// `out = B x` for one chunk (`x` and `out` of the planned length).
    fn apply(&mut self, x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(x);
        self.dct.process_dct2_with_scratch(out, &mut self.scratch);
        let (first, rest) = out.split_at_mut(1);
        first[0] *= self.scale.0;
        for v in rest {
            *v *= self.scale.1;
        }
    }
}

/// `out = B x` (the forward transform of one chunk, dense: the reference [`Forward`] is
/// tested against).
#[cfg(test)]
fn transform(b: &[f32], n: usize, x: &[f32], out: &mut [f32]) {
    for (f, o) in out.iter_mut().enumerate().take(n) {
        *o = crate::lowrank::dot(&b[f * n..(f + 1) * n], &x[..n]);
    }
}

/// `out = Bᵀ c` (the inverse transform of one chunk: B is orthonormal).
fn inverse(b: &[f32], n: usize, c: &[f32], out: &mut [f32]) {
    out[..n].fill(0.0);
    for (f, &cf) in c.iter().enumerate().take(n) {
        if cf != 0.0 {
            for (o, v) in out.iter_mut().zip(&b[f * n..(f + 1) * n]) {
                *o += cf * v;
            }
        }
    }
}

#[cfg(test)]
mod tests;
