//! Low-rank gradient compression (PowerSGD, Vogels et al. 2019): the arithmetic, without the
//! network. A gradient matrix `M` (rows x cols) goes out as two thin matrices: `P = M Q`
//! (rows x rank), averaged across the group, orthonormalized, then `Q = Mᵀ P` (cols x rank),
//! averaged too; every member then holds the same approximation `P Qᵀ` of the mean gradient.
//! `Q` is warm-started from the previous round (one power iteration per round), and what the
//! approximation missed of this peer's gradient is added back next round (error feedback).
//! With a momentum `beta < 1` ([`PowerSgd::momentum`]) what was missed decays by `beta` before
//! each round's gradient is added: the residual is then each peer's own momentum, of which the
//! top-`rank` subspace travels (DeMo's decoupled momentum, Peng et al. 2024, with a low-rank
//! instead of a DCT selection); paired with a sign update of the averaged result
//! (`starling_training`'s `SgdConfig::sign`).
//!
//! [`PowerSgd`] keeps that state for one flat gradient buffer whose matrices are described by
//! [`LowRankMatrix`]; everything else in the buffer (biases, matrices too small to gain) travels
//! uncompressed with `P`. The caller runs the two averages: [`PowerSgd::begin`] gives the first
//! vector to average, [`PowerSgd::middle`] turns its average into the second, and
//! [`PowerSgd::finish`] writes the result. All three are deterministic functions of their
//! inputs, so members that averaged the same vectors hold the same bits.
//!
//! ```
//! use starling_compression::lowrank::{LowRankMatrix, PowerSgd};
//! // A 64 x 32 weight matrix followed by a 32-element bias, averaged over two peers.
//! let layout = [LowRankMatrix { offset: 0, rows: 64, cols: 32 }];
//! let mut peers: Vec<PowerSgd> = (0..2).map(|_| PowerSgd::new(4, 64 * 32 + 32, &layout, 7).unwrap()).collect();
//! let grads: Vec<Vec<f32>> = (0..2)
//!     .map(|p| (0..64 * 32 + 32).map(|i| ((i * 7 + p * 3) % 11) as f32 - 5.0).collect())
//!     .collect();
//! let (one, two) = (peers[0].phase_one_len(), peers[0].phase_two_len());
//! // Phase one: every peer's P (and bias), averaged (here by hand).
//! let firsts: Vec<Vec<f32>> = peers.iter_mut().zip(&grads).map(|(p, g)| {
//!     let mut v = vec![0.0; one];
//!     p.begin(g, &mut v).unwrap();
//!     v
//! }).collect();
//! let mut mean_one: Vec<f32> = (0..one).map(|i| (firsts[0][i] + firsts[1][i]) / 2.0).collect();
//! // Phase two: every peer's Q, from the averaged P.
//! let seconds: Vec<Vec<f32>> = peers.iter_mut().map(|p| {
//!     let mut averaged = mean_one.clone();
//!     let mut v = vec![0.0; two];
//!     p.middle(&mut averaged, &mut v).unwrap();
//!     v
//! }).collect();
//! let mean_two: Vec<f32> = (0..two).map(|i| (seconds[0][i] + seconds[1][i]) / 2.0).collect();
//! let mut results = grads.clone();
//! for (p, r) in peers.iter_mut().zip(&mut results) {
//!     let mut averaged = mean_one.clone();
//!     let mut scratch = vec![0.0; two];
//!     p.middle(&mut averaged, &mut scratch).unwrap();
//!     p.finish(&averaged, &mean_two, r).unwrap();
//! }
//! assert_eq!(results[0], results[1]); // the same bits on both peers
//! # Ok::<(), starling_compression::Error>(())
//! ```

use std::ops::Range;

use crate::error::{check_len, Error, Result};
use crate::stats::check_finite;
use crate::Codec;

/// One matrix inside a flat buffer: `rows * cols` elements from `offset`, row-major. An N-D
/// tensor is passed reshaped to (first dimension, product of the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LowRankMatrix {
    /// Where the matrix starts in the flat buffer.
    pub offset: usize,
    /// Rows (the first dimension).
    pub rows: usize,
    /// Columns (the product of the other dimensions).
    pub cols: usize,
}

impl LowRankMatrix {
    /// The matrix's elements in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.rows * self.cols
    }

    /// Whether a rank-`rank` approximation sends at most half the elements of the matrix
    /// (`rank * (rows + cols) * 2 <= rows * cols`); smaller matrices stay uncompressed.
    pub fn gains(&self, rank: usize) -> bool {
        rank > 0 && rank * (self.rows + self.cols) * 2 <= self.rows * self.cols
    }
}

/// Largest rank accepted (beyond it a low-rank round sends about as much as the gradient).
pub const MAX_RANK: usize = 256;

/// The PowerSGD state of one flat gradient buffer: the layout, each compressed matrix's `Q`
/// (warm-started across rounds) and the error-feedback residual. See the module docs for the
/// round it drives.
#[derive(Debug, Clone)]
pub struct PowerSgd {
    rank: usize,
    len: usize,
    /// The matrices sent as `P` and `Q`, in buffer order.
    matrices: Vec<LowRankMatrix>,
    /// Everything else, sent as it is in phase one.
    dense: Vec<Range<usize>>,
    /// Every compressed matrix's `Q`, column-major (`cols` values per column), concatenated.
    q: Vec<f32>,
    /// What the last approximations missed, on the compressed matrices' elements.
    residual: Vec<f32>,
    /// `gradient + residual` of the round in progress.
    corrected: Vec<f32>,
    /// What the residual is multiplied by before a round's gradient is added (1: plain error
    /// feedback).
    momentum: f32,
    /// How `P`, `Q` and the rest travel: `None` (f32) or `BFloat16`.
    values: Codec,
}

impl PowerSgd {
    /// State for a buffer of `len` elements holding `matrices` (non-overlapping, inside the
    /// buffer), at rank `rank` (1..=[`MAX_RANK`]). Matrices that would not gain (see
    /// [`LowRankMatrix::gains`]) travel uncompressed. `Q` starts from standard normal values
    /// drawn from `seed`: peers that share the seed share their first `Q`, so their first
    /// round already agrees on the subspace.
    pub fn new(rank: usize, len: usize, matrices: &[LowRankMatrix], seed: u64) -> Result<Self> {
        if rank == 0 || rank > MAX_RANK {
            return Err(Error::InvalidArgument(format!(
                "PowerSGD rank {rank} is outside 1..={MAX_RANK}"
            )));
        }
        let mut sorted = matrices.to_vec();
        sorted.sort_by_key(|m| m.offset);
        let mut end = 0;
        for m in &sorted {
            let size = m
                .rows
                .checked_mul(m.cols)
                .and_then(|s| s.checked_add(m.offset));
            match size {
                Some(stop) if m.offset >= end && stop <= len => end = stop,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "matrix {}x{} at {} overlaps another or leaves the buffer of {len}",
                        m.rows, m.cols, m.offset
                    )))
                }
            }
        }
        let compressed: Vec<LowRankMatrix> = sorted.into_iter().filter(|m| m.gains(rank)).collect();
        let mut dense = Vec::new();
        let mut at = 0;
        for m in &compressed {
            if m.offset > at {
                dense.push(at..m.offset);
            }
            at = m.range().end;
        }
        if at < len {
            dense.push(at..len);
        }
        let q_len: usize = compressed.iter().map(|m| m.cols * rank).sum();
        let mut q = vec![0.0; q_len];
        fill_normal(&mut q, seed);
        Ok(PowerSgd {
            rank,
            len,
            matrices: compressed,
            dense,
            q,
            residual: vec![0.0; len],
            corrected: Vec::new(),
            momentum: 1.0,
            values: Codec::None,
        })
    }

    /// Keeps what the approximations missed as a momentum that decays by `beta`
    /// (0 < `beta` <= 1) each round: a round compresses `beta * residual + gradient`. 1, the
    /// default, is plain error feedback. The error says what is wrong with `beta`.
    ///
    /// ```
    /// use starling_compression::lowrank::{LowRankMatrix, PowerSgd};
    /// let layout = [LowRankMatrix { offset: 0, rows: 64, cols: 32 }];
    /// let state = PowerSgd::new(4, 64 * 32, &layout, 7)?.momentum(0.999)?;
    /// assert_eq!(state.beta(), 0.999);
    /// assert!(PowerSgd::new(4, 64 * 32, &layout, 7)?.momentum(0.0).is_err());
    /// # Ok::<(), starling_compression::Error>(())
    /// ```
    pub fn momentum(mut self, beta: f32) -> Result<Self> {
        if !(beta > 0.0 && beta <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "the PowerSGD momentum must be within (0, 1], not {beta}"
            )));
        }
        self.momentum = beta;
        Ok(self)
    }

    /// Sends `P`, `Q` and the uncompressed rest as `codec` values: [`Codec::None`] (f32, the
    /// default) or [`Codec::BFloat16`] (half the bytes; f32's range with 8 significant bits). The
    /// averager returns each averaged value rounded the same way to every member, so members
    /// still hold the same bits. What rounding the averaged `Q` misses stays in the residual with
    /// the rest of the approximation's error; the uncompressed rest's rounding (relative 2⁻⁹ at
    /// most) is not fed back. `Float16` is refused: `P = M Q` is a product of two
    /// gradient-sized factors and falls below f16's smallest values.
    ///
    /// ```
    /// use starling_compression::{lowrank::{LowRankMatrix, PowerSgd}, Codec};
    /// let layout = [LowRankMatrix { offset: 0, rows: 64, cols: 32 }];
    /// let state = PowerSgd::new(4, 64 * 32, &layout, 7)?.values(Codec::BFloat16)?;
    /// assert_eq!(state.values_codec(), Codec::BFloat16);
    /// assert!(PowerSgd::new(4, 64 * 32, &layout, 7)?.values(Codec::Uniform8Bit).is_err());
    /// # Ok::<(), starling_compression::Error>(())
    /// ```
    pub fn values(mut self, codec: Codec) -> Result<Self> {
        if !matches!(codec, Codec::None | Codec::BFloat16) {
            return Err(Error::InvalidArgument(format!(
                "PowerSGD values travel as none (f32) or bf16, not {codec}"
            )));
        }
        self.values = codec;
        Ok(self)
    }

    /// How `P`, `Q` and the uncompressed rest travel (see [`PowerSgd::values`]).
    pub fn values_codec(&self) -> Codec {
        self.values
    }

    /// The momentum what was missed decays by each round (1: plain error feedback).
    pub fn beta(&self) -> f32 {
        self.momentum
    }

    /// The rank of the approximations.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Elements of the gradient buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The matrices that go out compressed.
    pub fn compressed(&self) -> &[LowRankMatrix] {
        &self.matrices
    }

    /// Elements of the first vector to average: every compressed matrix's `P`, then the
    /// uncompressed rest of the buffer.
    pub fn phase_one_len(&self) -> usize {
        let p: usize = self.matrices.iter().map(|m| m.rows * self.rank).sum();
        p + self.dense.iter().map(|r| r.len()).sum::<usize>()
    }

    /// Elements of the second vector to average: every compressed matrix's `Q`.
    pub fn phase_two_len(&self) -> usize {
        self.q.len()
    }

    /// Elements sent per round against the buffer's: the compression ratio is
    /// `len() / elements_per_round()`.
    pub fn elements_per_round(&self) -> usize {
        self.phase_one_len() + self.phase_two_len()
    }

    /// What the last approximations missed of this peer's gradients (added back next round).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Forgets the residual and restarts `Q` from `seed` (after the model was reloaded).
    pub fn reset(&mut self, seed: u64) {
        self.residual.fill(0.0);
        fill_normal(&mut self.q, seed);
    }

    /// Starts a round: adds the residual (times the momentum) to `grads` and writes the first vector to average,
    /// `[P of each compressed matrix | the uncompressed rest]`, into `out`
    /// ([`phase_one_len`](Self::phase_one_len) elements). Refuses NaN/Inf gradients and wrong
    /// sizes; changes no state but the round in progress.
    pub fn begin(&mut self, grads: &[f32], out: &mut [f32]) -> Result<()> {
        check_len("gradient buffer", grads.len(), self.len)?;
        check_len("phase-one buffer", out.len(), self.phase_one_len())?;
        check_finite(grads, 0)?;
        self.corrected.clear();
        self.corrected.extend_from_slice(grads);
        for m in &self.matrices {
            for (c, r) in self.corrected[m.range()]
                .iter_mut()
                .zip(&self.residual[m.range()])
            {
                *c += self.momentum * r;
            }
        }
        let mut at = 0;
        let mut q_at = 0;
        for (i, m) in self.matrices.iter().enumerate() {
            let p_len = m.rows * self.rank;
            let q_len = m.cols * self.rank;
            renew_basis(&mut self.q[q_at..q_at + q_len], m.cols, self.rank, i as u64);
            project(
                &self.corrected[m.range()],
                m.rows,
                m.cols,
                &self.q[q_at..q_at + q_len],
                self.rank,
                &mut out[at..at + p_len],
            );
            at += p_len;
            q_at += q_len;
        }
        for r in &self.dense {
            out[at..at + r.len()].copy_from_slice(&grads[r.clone()]);
            at += r.len();
        }
        Ok(())
    }

    /// The middle of a round: orthonormalizes the averaged `P`s in `averaged_one` (in place:
    /// pass the same buffer to [`finish`](Self::finish)) and writes the second vector to
    /// average, every matrix's `Q = Mᵀ P`, into `out` ([`phase_two_len`](Self::phase_two_len)
    /// elements).
    pub fn middle(&mut self, averaged_one: &mut [f32], out: &mut [f32]) -> Result<()> {
        self.check_round()?;
        check_len(
            "averaged phase-one buffer",
            averaged_one.len(),
            self.phase_one_len(),
        )?;
        check_len("phase-two buffer", out.len(), self.phase_two_len())?;
        check_finite(averaged_one, 0)?;
        let mut at = 0;
        let mut q_at = 0;
        for m in &self.matrices {
            let p_len = m.rows * self.rank;
            let q_len = m.cols * self.rank;
            let p = &mut averaged_one[at..at + p_len];
            orthonormalize(p, m.rows, self.rank);
            project_back(
                &self.corrected[m.range()],
                m.rows,
                m.cols,
                p,
                self.rank,
                &mut out[q_at..q_at + q_len],
            );
            at += p_len;
            q_at += q_len;
        }
        Ok(())
    }

    /// Ends a round: writes the averaged approximation `P Qᵀ` of every compressed matrix and
    /// the averaged rest into `grads`, keeps what the approximation missed of this peer's
    /// corrected gradient as the next residual, and the averaged `Q`s for the next round.
    pub fn finish(
        &mut self,
        averaged_one: &[f32],
        averaged_two: &[f32],
        grads: &mut [f32],
    ) -> Result<()> {
        self.check_round()?;
        check_len(
            "averaged phase-one buffer",
            averaged_one.len(),
            self.phase_one_len(),
        )?;
        check_len(
            "averaged phase-two buffer",
            averaged_two.len(),
            self.phase_two_len(),
        )?;
        check_len("gradient buffer", grads.len(), self.len)?;
        check_finite(averaged_two, 0)?;
        let mut at = 0;
        let mut q_at = 0;
        for m in &self.matrices {
            let p_len = m.rows * self.rank;
            let q_len = m.cols * self.rank;
            let out = &mut grads[m.range()];
            reconstruct(
                &averaged_one[at..at + p_len],
                &averaged_two[q_at..q_at + q_len],
                m.rows,
                m.cols,
                self.rank,
                out,
            );
            for ((r, c), a) in self.residual[m.range()]
                .iter_mut()
                .zip(&self.corrected[m.range()])
                .zip(out.iter())
            {
                *r = c - a;
            }
            at += p_len;
            q_at += q_len;
        }
        for r in &self.dense {
            grads[r.clone()].copy_from_slice(&averaged_one[at..at + r.len()]);
            at += r.len();
        }
        self.q.copy_from_slice(averaged_two);
        self.corrected.clear();
        Ok(())
    }

    /// Abandons the round in progress (the averaging failed): the residual and `Q` stay as
    /// they were, the gradient was not changed.
    pub fn abort(&mut self) {
        self.corrected.clear();
    }

    fn check_round(&self) -> Result<()> {
        if self.corrected.len() != self.len {
            return Err(Error::InvalidArgument(
                "no PowerSGD round in progress: call begin first".into(),
            ));
        }
        Ok(())
    }
}

/// Turns a warm-started `Q` (`rank` columns of `cols`, column-major) into an orthonormal basis
/// of the same span before it is projected on: `P = M Q` is then as well conditioned as `M` on
/// that span (from a raw `Q`, one subspace iteration per round drives `P`'s columns towards the
/// top singular vector, and rounding, f32 and more so bf16, then decides the rest), and the
/// approximation `P̂ P̂ᵀ M` is the same. A column that vanished (the last round found its
/// direction collinear with the others and dropped it; it would stay zero for good) is drawn
/// again from a seed fixed by the matrix and column: every peer holds the same `Q` and makes
/// the same one.
fn renew_basis(q: &mut [f32], cols: usize, rank: usize, matrix: u64) {
    for attempt in 0..3u64 {
        for c in 0..rank {
            let col = &mut q[c * cols..(c + 1) * cols];
            if col.iter().all(|&x| x == 0.0) || !col.iter().all(|x| x.is_finite()) {
                fill_normal(col, (matrix * MAX_RANK as u64 + c as u64) ^ (attempt << 48));
            }
        }
        orthonormalize(q, cols, rank);
        if (0..rank).all(|c| q[c * cols..(c + 1) * cols].iter().any(|&x| x != 0.0)) {
            return;
        }
    }
}

/// `p = m q`: `m` rows x cols row-major, `q` column-major (rank columns of `cols`), `p`
/// column-major (rank columns of `rows`).
pub fn project(m: &[f32], rows: usize, cols: usize, q: &[f32], rank: usize, p: &mut [f32]) {
    for c in 0..rank {
        let qc = &q[c * cols..(c + 1) * cols];
        for (i, row) in m.chunks_exact(cols).take(rows).enumerate() {
            p[c * rows + i] = dot(row, qc);
        }
    }
}

/// `q = mᵀ p`: `m` rows x cols row-major, `p` column-major (rank columns of `rows`), `q`
/// column-major (rank columns of `cols`).
pub fn project_back(m: &[f32], rows: usize, cols: usize, p: &[f32], rank: usize, q: &mut [f32]) {
    q[..cols * rank].fill(0.0);
    for c in 0..rank {
        let qc = &mut q[c * cols..(c + 1) * cols];
        for (i, row) in m.chunks_exact(cols).take(rows).enumerate() {
            let s = p[c * rows + i];
            if s != 0.0 {
                for (q, v) in qc.iter_mut().zip(row) {
                    *q += s * v;
                }
            }
        }
    }
}

/// `out = p qᵀ` (rows x cols row-major) from column-major `p` (rows) and `q` (cols).
pub fn reconstruct(p: &[f32], q: &[f32], rows: usize, cols: usize, rank: usize, out: &mut [f32]) {
    for (i, row) in out.chunks_exact_mut(cols).take(rows).enumerate() {
        row.fill(0.0);
        for c in 0..rank {
            let s = p[c * rows + i];
            if s != 0.0 {
                for (o, q) in row.iter_mut().zip(&q[c * cols..(c + 1) * cols]) {
                    *o += s * q;
                }
            }
        }
    }
}

/// Orthonormalizes the `rank` columns (each `rows` long, column-major) of `p` in place by
/// modified Gram-Schmidt, run twice ("twice is enough": the second pass removes what rounding
/// left of the first on ill-conditioned input), with dot products and norms accumulated in
/// f64. A column that is (numerically) in the span of the ones before it becomes zero: it adds
/// nothing to the approximation, rather than amplified rounding noise.
pub fn orthonormalize(p: &mut [f32], rows: usize, rank: usize) {
    for c in 0..rank {
        let (done, rest) = p.split_at_mut(c * rows);
        let col = &mut rest[..rows];
        let before = norm(col);
        if before == 0.0 || !before.is_finite() {
            col.fill(0.0);
            continue;
        }
        for _pass in 0..2 {
            for b in 0..c {
                let basis = &done[b * rows..(b + 1) * rows];
                let d = dot64(col, basis);
                if d != 0.0 {
                    for (x, y) in col.iter_mut().zip(basis) {
                        *x = (f64::from(*x) - d * f64::from(*y)) as f32;
                    }
                }
            }
        }
        let after = norm(col);
        if after <= before * 1e-5 {
            col.fill(0.0);
        } else {
            let inv = 1.0 / after;
            for x in col.iter_mut() {
                *x = (f64::from(*x) * inv) as f32;
            }
        }
    }
}

/// `a · b` in f32 with eight partial sums (shared with the DCT).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: vectorizes, and the order is fixed, so every peer computes the same
    // bits from the same inputs.
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let (xs, ys) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = xs
        .remainder()
        .iter()
        .zip(ys.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in xs.zip(ys) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

fn norm(a: &[f32]) -> f64 {
    dot64(a, a).sqrt()
}

/// Standard normal values from `seed` (splitmix64 and Box-Muller): the same on every platform.
fn fill_normal(out: &mut [f32], seed: u64) {
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // 53 random bits in (0, 1].
        ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    };
    for pair in out.chunks_mut(2) {
        let (u, v) = (next(), next());
        let r = (-2.0 * u.ln()).sqrt();
        let t = std::f64::consts::TAU * v;
        pair[0] = (r * t.cos()) as f32;
        if pair.len() > 1 {
            pair[1] = (r * t.sin()) as f32;
        }
    }
}

#[cfg(test)]
mod tests;
