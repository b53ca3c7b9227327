//! Codebook codecs: Uniform8Bit, Quantile8Bit and Uniform4Bit.
//!
//! Each element gets the code of the bin it falls in; the frame carries, for every bin, the mean of the values that
//! fell in it (empty bins get their centre). Decoding is a table lookup, and since every value decodes to the mean
//! of its bin, the sum (hence the mean) of the decoded tensor equals the input's up to f32 rounding of the codebook:
//! the codecs are unbiased whatever bins they chose.

use super::{Hist, Op};
use crate::stats;

/// Uniform8Bit covers mean ± this many standard deviations with its 256 bins.
pub const UNIFORM8_RANGE_SIGMAS: f64 = 3.0;
/// Uniform4Bit covers mean ± this many standard deviations with its 16 bins.
pub const UNIFORM4_RANGE_SIGMAS: f64 = 2.8;
/// Elements sampled to place Quantile8Bit's bin edges (inputs this small or smaller are used whole).
pub const QUANTILE_SAMPLE_ELEMENTS: usize = 1 << 14;

/// Uniform bins over mean ± k·σ: `code = clamp(floor((x - lo) / step), 0, bins - 1)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct UniformQuantizer {
    lo: f32,
    inv_step: f32,
    max_code: f32,
    lo64: f64,
    step64: f64,
}

impl UniformQuantizer {
    /// Bins for `x` (mean and σ estimated from a sample for large inputs; see [`stats::estimated_moments`]).
    pub(crate) fn new(x: &[f32], bins: usize) -> UniformQuantizer {
        let sigmas = if bins == 16 {
            UNIFORM4_RANGE_SIGMAS
        } else {
            UNIFORM8_RANGE_SIGMAS
        };
        let m = stats::estimated_moments(x);
        let (mean, std) = if m.mean.is_finite() && m.std.is_finite() {
            (m.mean, m.std)
        } else {
            (0.0, 0.0)
        };
        let max = f64::from(f32::MAX);
        let lo64 = (mean - sigmas * std).clamp(-max, max);
        let hi64 = (mean + sigmas * std).clamp(-max, max);
        let step64 = (hi64 - lo64) / bins as f64;
        let inv = (1.0 / step64) as f32;
        let inv_step = if step64 > 0.0 && inv.is_finite() {
            inv
        } else {
            0.0
        };
        UniformQuantizer {
            lo: lo64 as f32,
            inv_step,
            max_code: (bins - 1) as f32,
            lo64,
            step64,
        }
    }

    /// The bin of `v`. NaN (possible only from overflowing extremes) lands in bin 0.
    #[inline(always)]
    fn code(&self, v: f32) -> u8 {
        let t = ((v - self.lo) * self.inv_step).max(0.0).min(self.max_code);
        // SAFETY: `max`/`min` return a non-NaN value in [0, max_code] with max_code <= 255, which truncates to a
        // valid u8.
        unsafe { t.to_int_unchecked::<u8>() }
    }

    /// Centre of `bin`, the codebook entry of an empty bin.
    pub(crate) fn bin_centre(&self, bin: usize) -> f32 {
        let c = self.lo64 + (bin as f64 + 0.5) * self.step64;
        c.clamp(-f64::from(f32::MAX), f64::from(f32::MAX)) as f32
    }

    /// One code byte per element.
    #[inline]
    pub(crate) fn encode8(&self, x: &[f32], out: &mut [u8]) {
        for (c, &v) in out.iter_mut().zip(x) {
            *c = self.code(v);
        }
    }

    /// Two codes per byte (element 2i low nibble, 2i+1 high nibble); fills `hist` too.
    #[inline]
    pub(crate) fn encode4(&self, x: &[f32], out: &mut [u8], hist: &mut Hist) {
        let mut codes = [0u8; super::SPAN];
        let codes = &mut codes[..x.len()];
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = self.code(v);
        }
        hist.add(codes, x);
        let mut pairs = codes.chunks_exact(2);
        for (o, p) in out.iter_mut().zip(&mut pairs) {
            *o = p[0] | (p[1] << 4);
        }
        if let [last] = pairs.remainder() {
            out[x.len() / 2] = *last;
        }
    }
}

/// Cells of the uniform grid that Quantile8Bit's search starts from.
const GRID_CELLS: usize = 4096;

/// Quantile8Bit's bins: `edges[k]` is the lower edge of bin `k + 1` (the `(k+1)/256` quantile of a sample of
/// [`QUANTILE_SAMPLE_ELEMENTS`] values) and `edges[255] = +inf` is a sentinel.
///
/// Finding a value's bin (the number of edges at or below it) without a per-element binary search: a uniform grid
/// of [`GRID_CELLS`] cells spans `edges[0] ..= edges[254]`; for each cell the table holds how many edges lie in
/// lower cells and how many in the cell itself. Most cells hold no edge or one, so the bin is one table load and
/// at most one comparison; cells with several edges (duplicates in sparse data) count them in a short loop. The
/// grid index is computed with the same float arithmetic for edges and values, so rounding cannot misplace one.
pub(crate) struct QuantileBins {
    edges: [f32; 256],
    g0: f32,
    ginv: f32,
    /// Per cell: edges in lower cells (low byte) and edges in this cell (high byte).
    cells: [u16; GRID_CELLS],
}

impl QuantileBins {
    pub(crate) fn new(x: &[f32]) -> Box<QuantileBins> {
        let mut sample: Vec<f32> = if x.len() <= QUANTILE_SAMPLE_ELEMENTS {
            x.to_vec()
        } else {
            stats::sample_positions(x.len(), QUANTILE_SAMPLE_ELEMENTS)
                .map(|i| x[i])
                .collect()
        };
        sample.sort_unstable_by(f32::total_cmp);
        let mut edges = [f32::INFINITY; 256];
        if !sample.is_empty() {
            for (k, edge) in edges.iter_mut().take(255).enumerate() {
                *edge = sample[(k + 1) * sample.len() / 256];
            }
        }
        Self::from_edges(edges)
    }

    pub(crate) fn from_edges(edges: [f32; 256]) -> Box<QuantileBins> {
        let (g0, g1) = (edges[0], edges[254]);
        let width = (f64::from(g1) - f64::from(g0)) / GRID_CELLS as f64;
        let ginv = (1.0 / width) as f32;
        let (g0, ginv) = if width > 0.0 && ginv.is_finite() && g0.is_finite() {
            (g0, ginv)
        } else {
            (0.0, 0.0)
        };
        let mut bins = Box::new(QuantileBins {
            edges,
            g0,
            ginv,
            cells: [0; GRID_CELLS],
        });
        let edge_cells: Vec<usize> = edges[..255].iter().map(|&e| bins.cell(e)).collect();
        for (c, entry) in bins.cells.iter_mut().enumerate() {
            let below = edge_cells.partition_point(|&ec| ec < c);
            let within = edge_cells[below..].partition_point(|&ec| ec == c);
            *entry = below as u16 | ((within as u16) << 8);
        }
        bins
    }

    /// The grid cell of `v`: monotone in `v`; NaN goes to cell 0.
    #[inline(always)]
    fn cell(&self, v: f32) -> usize {
        let c = ((v - self.g0) * self.ginv)
            .max(0.0)
            .min((GRID_CELLS - 1) as f32);
        // SAFETY: `max`/`min` give a non-NaN value in [0, GRID_CELLS - 1], which truncates to a valid u32.
        (unsafe { c.to_int_unchecked::<u32>() }) as usize
    }

    /// The bin of `v` given its cell.
    #[inline(always)]
    fn code_in_cell(&self, v: f32, cell: usize) -> u8 {
        let entry = self.cells[cell & (GRID_CELLS - 1)];
        let below = usize::from(entry & 255);
        let within = usize::from(entry >> 8);
        if within <= 1 {
            // edges[below] is the cell's one edge (or, with none, one of a higher cell, and v < it).
            return (below + usize::from(within == 1 && v >= self.edges[below & 255])) as u8;
        }
        let mut code = below;
        for &e in &self.edges[below..(below + within).min(255)] {
            code += usize::from(v >= e);
        }
        code as u8
    }

    /// The bin of one value.
    #[cfg(test)]
    fn code(&self, v: f32) -> u8 {
        self.code_in_cell(v, self.cell(v))
    }

    /// One code byte per element (`x.len() <= SPAN`): grid cells first (vectorized), then table lookups.
    #[inline]
    pub(crate) fn encode(&self, x: &[f32], out: &mut [u8]) {
        let mut cells = [0u32; super::SPAN];
        let cells = &mut cells[..x.len()];
        for (c, &v) in cells.iter_mut().zip(x) {
            *c = self.cell(v) as u32;
        }
        for ((o, &v), &c) in out.iter_mut().zip(x).zip(cells.iter()) {
            *o = self.code_in_cell(v, c as usize);
        }
    }

    /// Codebook entry of an empty bin: the middle of its edges (or its one finite edge).
    pub(crate) fn fallback(&self, bin: usize) -> f32 {
        let t = &self.edges;
        let v = match bin {
            0 => t[0],
            255 => t[254],
            b => t[b - 1] * 0.5 + t[b] * 0.5,
        };
        if v.is_finite() {
            v
        } else {
            0.0
        }
    }
}

pub(crate) fn decode8(codes: &[u8], out: &mut [f32], codebook: &[f32; 256], op: Op) {
    match op {
        Op::Store => {
            for (o, &c) in out.iter_mut().zip(codes) {
                *o = codebook[usize::from(c)];
            }
        }
        Op::Add(w) => {
            let scaled: [f32; 256] = std::array::from_fn(|i| w * codebook[i]);
            for (o, &c) in out.iter_mut().zip(codes) {
                *o += scaled[usize::from(c)];
            }
        }
    }
}

pub(crate) fn decode4(codes: &[u8], out: &mut [f32], codebook: &[f32; 16], op: Op) {
    let w = match op {
        Op::Store => 1.0,
        Op::Add(w) => w,
    };
    let pairs: [[f32; 2]; 256] =
        std::array::from_fn(|b| [w * codebook[b & 15], w * codebook[b >> 4]]);
    let mut outs = out.chunks_exact_mut(2);
    match op {
        Op::Store => {
            for (o, &b) in (&mut outs).zip(codes) {
                o.copy_from_slice(&pairs[usize::from(b)]);
            }
        }
        Op::Add(_) => {
            for (o, &b) in (&mut outs).zip(codes) {
                let p = &pairs[usize::from(b)];
                o[0] += p[0];
                o[1] += p[1];
            }
        }
    }
    if let ([last], Some(&b)) = (outs.into_remainder(), codes.last()) {
        let v = pairs[usize::from(b)][0];
        match op {
            Op::Store => *last = v,
            Op::Add(_) => *last += v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_bins(edges: [f32; 256], probes: impl Iterator<Item = f32>) {
        let bins = QuantileBins::from_edges(edges);
        for v in probes {
            let expect = edges[..255].partition_point(|&e| e <= v);
            assert_eq!(usize::from(bins.code(v)), expect, "v = {v}");
        }
        assert_eq!(bins.code(f32::NAN), 0);
    }

    #[test]
    fn quantile_search_matches_partition_point() {
        let mut t = [0f32; 256];
        for (k, e) in t.iter_mut().enumerate() {
            *e = ((k as f32) - 128.0) * 0.5;
        }
        t[10] = t[9]; // duplicate edges
        t[255] = f32::INFINITY;
        check_bins(t, (-3000..3000).map(|i| i as f32 * 0.023));
        let near = |e: f32| {
            [
                e,
                f32::from_bits(e.to_bits().wrapping_add(1)),
                f32::from_bits(e.to_bits().wrapping_sub(1)),
            ]
        };
        check_bins(t, t.iter().flat_map(|&e| near(e)));
        // sparse data: most edges at zero
        let mut sparse = [0f32; 256];
        sparse[250..255].copy_from_slice(&[0.5, 1.0, 2.0, 3.0, 4.0]);
        sparse[..3].copy_from_slice(&[-2.0, -1.0, -0.5]);
        sparse[255] = f32::INFINITY;
        sparse[3..250].sort_by(f32::total_cmp);
        check_bins(sparse, (-500..500).map(|i| i as f32 * 0.011));
        // all edges equal, and clustered edges with an outlier
        let mut same = [1.0f32; 256];
        same[255] = f32::INFINITY;
        check_bins(same, [0.5, 1.0, 1.5, -1e30, 1e30].into_iter());
        let mut clustered: [f32; 256] = std::array::from_fn(|k| k as f32 * 1e-6);
        clustered[254] = 1e30;
        clustered[255] = f32::INFINITY;
        check_bins(
            clustered,
            (0..600).map(|i| i as f32 * 5e-7).chain([1e29, 1e30, 2e30]),
        );
        // extreme edges whose grid width overflows f32
        let mut wide: [f32; 256] = std::array::from_fn(|k| (k as f32 - 127.0) * 2.6e36);
        wide[255] = f32::INFINITY;
        check_bins(wide, (-130..130).map(|i| i as f32 * 2.6e36));
    }

    #[test]
    fn uniform_codes_cover_range_and_clip() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) / 100.0).collect();
        let q = UniformQuantizer::new(&x, 256);
        let mut codes = vec![0u8; x.len()];
        q.encode8(&x, &mut codes);
        assert!(codes.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(q.code(-1e30), 0);
        assert_eq!(q.code(1e30), 255);
        assert_eq!(q.code(f32::NAN), 0);
    }

    #[test]
    fn constant_input_has_zero_step() {
        let x = vec![2.5f32; 100];
        let q = UniformQuantizer::new(&x, 16);
        assert_eq!(q.inv_step, 0.0);
        assert_eq!(q.code(2.5), 0);
    }
}
