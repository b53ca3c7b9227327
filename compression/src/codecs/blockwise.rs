//! Blockwise8Bit: blocks of [`BLOCK_SIZE`] values, each scaled by its absolute maximum and mapped to the nearest
//! entry of a fixed dynamic 8-bit code in the style of bitsandbytes' dynamic quantization.
//!
//! A code byte is `sign << 7 | m`, decoding to `±MAGNITUDES[m] · absmax`. The 128 magnitudes are 0 plus, per
//! decade `10^-d .. 10^(1-d)`, a linear run of levels ending at the decade's top (1.0 is exact, so each block's
//! largest value round-trips exactly). bitsandbytes spreads 1, 2, 4, ..., 64 levels over seven decades; we cover
//! four decades ([`DECADE_LEVELS`]: 2, 6, 16 and 103 levels), which brings the error on normal data under 1% and
//! still resolves values down to 1e-4 of the block maximum, where heavy-tailed blocks keep most of their values.
//!
//! Finding the nearest magnitude avoids a binary search: the float bits of `|x| / absmax` (exponent and 8 mantissa
//! bits) index a table giving the candidate level; at most one decision threshold falls within a table cell (tested
//! below), so one comparison finishes the job.

use std::sync::OnceLock;

use super::Op;
use crate::error::{Error, Result};

/// Elements per Blockwise8Bit block: each block stores one f32 absolute maximum (so the codec costs 8 + 32/4096
/// bits per element).
pub const BLOCK_SIZE: usize = 4096;

/// Levels per decade of the dynamic map, lowest decade first (`10^-4 .. 10^-3` up to `0.1 .. 1`); with the zero
/// level they make the 128 magnitudes.
pub const DECADE_LEVELS: [usize; 4] = [2, 6, 16, 103];

/// Ratios `|x| / absmax` below `2^-LUT_OCTAVES` all share the first table cell (they quantize to 0).
const LUT_OCTAVES: u32 = 20;
/// First float-bits key (`bits >> 15`) the table covers.
const LUT_BASE: u32 = (127 - LUT_OCTAVES) << 8;
/// Table cells: every key from `2^-LUT_OCTAVES` up to and including 1.0.
const LUT_LEN: usize = (LUT_OCTAVES as usize) * 256 + 1;

pub(crate) struct Tables {
    /// The 128 magnitudes, ascending, `[0] = 0`, `[127] = 1`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) magnitudes: [f32; 128],
    /// Decoded value of each code byte (before scaling by absmax).
    pub(crate) signed: [f32; 256],
    /// Decision thresholds: `thresholds[m]` is the midpoint of magnitudes `m` and `m + 1`; `[127] = +inf`.
    thresholds: [f32; 128],
    /// For each cell of ratio bits, the number of thresholds at or below the cell's lower end.
    lut: [u8; LUT_LEN],
}

pub(crate) fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| {
        let mut magnitudes = [0f32; 128];
        let mut m = 1;
        let decades = DECADE_LEVELS.len() as i32;
        for (d, &levels) in DECADE_LEVELS.iter().enumerate() {
            let top = 10f64.powi(d as i32 + 1 - decades);
            for k in 0..levels {
                magnitudes[m] = (top * (0.1 + 0.9 * (k + 1) as f64 / levels as f64)) as f32;
                m += 1;
            }
        }
        let signed = std::array::from_fn(|c| {
            let v = magnitudes[c & 127];
            if c & 128 != 0 {
                -v
            } else {
                v
            }
        });
        let mut thresholds = [f32::INFINITY; 128];
        for k in 0..127 {
            thresholds[k] =
                ((f64::from(magnitudes[k]) + f64::from(magnitudes[k + 1])) / 2.0) as f32;
        }
        let mut lut = [0u8; LUT_LEN];
        for (cell, entry) in lut.iter_mut().enumerate() {
            let lo = cell_low(cell);
            *entry = thresholds[..127].partition_point(|&t| t <= lo) as u8;
        }
        Tables {
            magnitudes,
            signed,
            thresholds,
            lut,
        }
    })
}

/// Lower end of table cell `cell` (cell 0 starts at 0: everything below `2^-LUT_OCTAVES` falls in it).
fn cell_low(cell: usize) -> f32 {
    if cell == 0 {
        0.0
    } else {
        f32::from_bits((LUT_BASE + cell as u32) << 15)
    }
}

impl Tables {
    /// Index of the magnitude nearest to `y` in `[0, 1]`.
    #[inline(always)]
    fn nearest(&self, y: f32) -> usize {
        let key = ((y.to_bits() >> 15).saturating_sub(LUT_BASE) as usize).min(LUT_LEN - 1);
        let m = usize::from(self.lut[key]) & 127;
        m + usize::from(y >= self.thresholds[m])
    }
}

/// Encodes one block (`x.len() <= BLOCK_SIZE`) into `codes`, returning its absolute maximum.
pub(crate) fn encode_block(x: &[f32], codes: &mut [u8]) -> f32 {
    let t = tables();
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            lanes[j] = lanes[j].max(c[j].abs());
        }
    }
    let absmax = chunks
        .remainder()
        .iter()
        .fold(lanes.iter().fold(0f32, |a, &b| a.max(b)), |a, &b| {
            a.max(b.abs())
        });
    if absmax == 0.0 || !absmax.is_finite() {
        // All zeros (or non-finite input the caller allowed, which statistical codecs treat as 0).
        codes.fill(0);
        return if absmax.is_finite() { absmax } else { 0.0 };
    }
    let inv = 1.0 / absmax;
    for (c, &v) in codes.iter_mut().zip(x) {
        // For subnormal maxima `inv` overflows: divide instead.
        let y = if inv.is_finite() {
            v.abs() * inv
        } else {
            v.abs() / absmax
        };
        let m = t.nearest(y.min(1.0));
        *c = m as u8 | (((v.to_bits() >> 31) as u8) << 7);
    }
    absmax
}

/// Block scales on the wire must be finite and non-negative.
pub(crate) fn check_scales(scales: &[u8]) -> Result<()> {
    for b in scales.chunks_exact(4) {
        let s = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if !(s.is_finite() && s >= 0.0) {
            return Err(Error::InvalidParameter(
                "blockwise8 block scale is negative, NaN or infinite",
            ));
        }
    }
    Ok(())
}

/// Decodes whole blocks: `scales` holds one f32 LE per block of `codes`.
pub(crate) fn decode(scales: &[u8], codes: &[u8], out: &mut [f32], op: Op) {
    let t = tables();
    for ((s, cb), ob) in scales
        .chunks_exact(4)
        .zip(codes.chunks(BLOCK_SIZE))
        .zip(out.chunks_mut(BLOCK_SIZE))
    {
        let absmax = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        match op {
            Op::Store => {
                let table: [f32; 256] = std::array::from_fn(|c| t.signed[c] * absmax);
                for (o, &c) in ob.iter_mut().zip(cb) {
                    *o = table[usize::from(c)];
                }
            }
            Op::Add(w) => {
                let table: [f32; 256] = std::array::from_fn(|c| w * (t.signed[c] * absmax));
                for (o, &c) in ob.iter_mut().zip(cb) {
                    *o += table[usize::from(c)];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magnitudes_ascend_from_zero_to_one() {
        let t = tables();
        assert_eq!(DECADE_LEVELS.iter().sum::<usize>(), 127);
        assert_eq!(t.magnitudes[0], 0.0);
        assert_eq!(t.magnitudes[127], 1.0);
        assert!(t.magnitudes.windows(2).all(|w| w[0] < w[1]));
        assert!(
            t.thresholds[0] > f32::from_bits((LUT_BASE + 1) << 15),
            "cell 0 must hold no threshold"
        );
    }

    #[test]
    fn at_most_one_threshold_per_cell() {
        let t = tables();
        for cell in 0..LUT_LEN - 1 {
            let (lo, hi) = (cell_low(cell), cell_low(cell + 1));
            let inside = t.thresholds[..127]
                .iter()
                .filter(|&&th| th > lo && th < hi)
                .count();
            assert!(
                inside <= 1,
                "cell {cell} [{lo:e}, {hi:e}) holds {inside} thresholds"
            );
        }
    }

    #[test]
    fn nearest_matches_exhaustive_search() {
        let t = tables();
        let brute = |y: f32| {
            let mut best = 0;
            for m in 0..128 {
                if (t.magnitudes[m] - y).abs() < (t.magnitudes[best] - y).abs() {
                    best = m;
                }
            }
            best
        };
        let mut y = 1e-9f32;
        while y <= 1.0 {
            let (got, want) = (t.nearest(y), brute(y));
            // At a midpoint (up to the f32 rounding of the threshold) either neighbour is nearest.
            let (dg, dw) = (
                (t.magnitudes[got] - y).abs(),
                (t.magnitudes[want] - y).abs(),
            );
            assert!(
                got == want || dg <= dw + 2.5e-7 * y,
                "y = {y:e}: {got} vs {want}"
            );
            y = f32::from_bits(y.to_bits() + 97);
        }
        assert_eq!(t.nearest(1.0), 127);
        assert_eq!(t.nearest(0.0), 0);
    }

    #[test]
    fn block_max_is_exact_and_signs_kept() {
        let x = [0.5f32, -2.0, 1e-3, -1e-9, 0.0];
        let mut codes = [0u8; 5];
        let absmax = encode_block(&x, &mut codes);
        assert_eq!(absmax, 2.0);
        let mut scale = [0u8; 4];
        scale.copy_from_slice(&absmax.to_le_bytes());
        let mut out = [0f32; 5];
        decode(&scale, &codes, &mut out, Op::Store);
        assert_eq!(out[1], -2.0);
        assert!((out[0] - 0.5).abs() < 0.02);
        assert!(out[2] > 0.0 && (out[2] - 1e-3).abs() < 1e-4);
        assert_eq!(out[4], 0.0);
    }

    #[test]
    fn subnormal_block_does_not_overflow() {
        let x = [1e-45f32, -1e-45, 0.0];
        let mut codes = [0u8; 3];
        let absmax = encode_block(&x, &mut codes);
        let mut out = [0f32; 3];
        decode(&absmax.to_le_bytes(), &codes, &mut out, Op::Store);
        assert_eq!(out, [1e-45, -1e-45, 0.0]);
    }
}
