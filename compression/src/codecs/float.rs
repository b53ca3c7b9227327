//! Float codecs: raw f32, f16, bf16 and mean/std-scaled f16.
//!
//! f16 conversions go through `half`'s slice converters (F16C when the CPU has it) on L1-resident tiles; bf16 is
//! plain integer arithmetic the compiler vectorizes. Bytes are little-endian on the wire; on little-endian hosts
//! the copies are `memcpy`s.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::{EncodePlan, Op};
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::stats;

/// Largest finite f16.
pub(crate) const F16_MAX: f32 = 65504.0;
/// Largest finite bf16.
pub(crate) const BF16_MAX: f32 = f32::from_bits(0x7f7f_0000);
/// Elements per stack tile of the f16 conversions (4 KiB of f32, stays in L1).
const TILE: usize = 1024;

/// Clamps finite values into `±max`; NaN and ±Inf pass unchanged (branch-free select).
#[inline(always)]
fn saturate(v: f32, max: f32) -> f32 {
    let c = v.clamp(-max, max);
    if v.is_infinite() {
        v
    } else {
        c
    }
}

pub(super) fn encode_f32(x: &[f32], out: &mut [u8]) {
    #[cfg(target_endian = "little")]
    out.copy_from_slice(bytemuck::cast_slice(x));
    #[cfg(not(target_endian = "little"))]
    for (o, v) in out.chunks_exact_mut(4).zip(x) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

/// Writes `v` as little-endian u16s into `out` (`2 * v.len()` bytes).
#[inline]
fn write_u16s(v: &[u16], out: &mut [u8]) {
    #[cfg(target_endian = "little")]
    out.copy_from_slice(bytemuck::cast_slice(v));
    #[cfg(not(target_endian = "little"))]
    for (o, v) in out.chunks_exact_mut(2).zip(v) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

/// Reads little-endian u16s from `src` (`2 * out.len()` bytes) into `out`.
#[inline]
fn read_u16s(src: &[u8], out: &mut [u16]) {
    #[cfg(target_endian = "little")]
    bytemuck::cast_slice_mut::<u16, u8>(out).copy_from_slice(src);
    #[cfg(not(target_endian = "little"))]
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = u16::from_le_bytes([b[0], b[1]]);
    }
}

pub(super) fn encode_f16(x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU supports AVX and F16C (checked above) and `out` holds 2 bytes per element.
        unsafe { x86::affine_to_f16(x, out, 0.0, 1.0, false) };
        return;
    }
    encode_f16_portable(x, out);
}

fn encode_f16_portable(x: &[f32], out: &mut [u8]) {
    let mut tmp = [0f32; TILE];
    for (xb, ob) in x.chunks(TILE).zip(out.chunks_mut(2 * TILE)) {
        let n = xb.len();
        for (t, &v) in tmp[..n].iter_mut().zip(xb) {
            *t = saturate(v, F16_MAX);
        }
        put_f16(&tmp[..n], ob);
    }
}

/// Converts `y` to f16 into `out` (little-endian bytes): straight into `out` when it is 2-byte aligned (frames in
/// a `Vec<u8>` are), else through a stack tile.
#[inline(always)]
fn put_f16(y: &[f32], out: &mut [u8]) {
    #[cfg(target_endian = "little")]
    if let Ok(direct) = bytemuck::try_cast_slice_mut::<u8, f16>(out) {
        direct.convert_from_f32_slice(y);
        return;
    }
    let mut h = [f16::ZERO; TILE];
    h[..y.len()].convert_from_f32_slice(y);
    write_u16s(bytemuck::cast_slice(&h[..y.len()]), out);
}

/// f32 to bf16 bits, round to nearest even; finite values saturate at ±[`BF16_MAX`], NaN stays (quiet) NaN.
#[inline(always)]
pub(crate) fn f32_to_bf16_bits(v: f32) -> u16 {
    let b = saturate(v, BF16_MAX).to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    (if nan { (b >> 16) | 0x0040 } else { rounded }) as u16
}

pub(super) fn encode_bf16(x: &[f32], out: &mut [u8]) {
    let mut tmp = [0u16; TILE];
    for (xb, ob) in x.chunks(TILE).zip(out.chunks_mut(2 * TILE)) {
        let n = xb.len();
        for (t, &v) in tmp[..n].iter_mut().zip(xb) {
            *t = f32_to_bf16_bits(v);
        }
        write_u16s(&tmp[..n], ob);
    }
}

/// Each value as the `Float16` or `BFloat16` codec encodes and decodes it (saturation and
/// rounding included), through the codec's own encoder and decoder a tile at a time.
pub(crate) fn round_trip(codec: Codec, values: &mut [f32]) {
    let mut bytes = [0u8; 2 * TILE];
    for tile in values.chunks_mut(TILE) {
        let b = &mut bytes[..2 * tile.len()];
        if codec == Codec::Float16 {
            encode_f16(tile, b);
            decode_f16(b, tile, Op::Store);
        } else {
            encode_bf16(tile, b);
            decode_bf16(b, tile, Op::Store);
        }
    }
}

/// The ScaledFloat16 plan: exact mean and standard deviation. Exact statistics bound every scaled value by
/// `sqrt(n) <= 2^14 < 65504`, so nothing saturates.
pub(super) fn scaled_plan(x: &[f32]) -> Result<EncodePlan> {
    let m = stats::exact_moments(x);
    if !(m.mean.is_finite() && m.std.is_finite()) {
        // Finite input always has finite moments: name the offending element.
        stats::check_finite(x, 0)?;
    }
    let (mean, std) = (m.mean as f32, m.std as f32);
    if check_scaled_params(mean, std).is_err() {
        return Err(Error::OutOfRange {
            codec: Codec::ScaledFloat16,
            reason: "|mean| + 65504 * std exceeds the f32 range; use none or f16",
        });
    }
    let inv = 1.0 / std;
    let inv_std = if std > 0.0 && inv.is_finite() {
        inv
    } else {
        0.0
    };
    Ok(EncodePlan::ScaledFloat16 { mean, std, inv_std })
}

/// ScaledFloat16 parameters must be finite, `std >= 0`, and `|mean| + 65504 * std` within f32 so every finite code
/// decodes to a finite value.
pub(crate) fn check_scaled_params(mean: f32, std: f32) -> Result<()> {
    let bound = f64::from(mean).abs() + f64::from(F16_MAX) * f64::from(std);
    if !mean.is_finite() || !std.is_finite() || std < 0.0 || bound > f64::from(f32::MAX) / 2.0 {
        return Err(Error::InvalidParameter(
            "scaled-f16 mean/std not finite, negative, or out of range",
        ));
    }
    Ok(())
}

pub(super) fn encode_scaled_f16(x: &[f32], out: &mut [u8], mean: f32, inv_std: f32) {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU supports AVX and F16C (checked above) and `out` holds 2 bytes per element.
        unsafe { x86::affine_to_f16(x, out, mean, inv_std, true) };
        return;
    }
    encode_scaled_f16_portable(x, out, mean, inv_std);
}

fn encode_scaled_f16_portable(x: &[f32], out: &mut [u8], mean: f32, inv_std: f32) {
    let mut tmp = [0f32; TILE];
    for (xb, ob) in x.chunks(TILE).zip(out.chunks_mut(2 * TILE)) {
        let n = xb.len();
        for (t, &v) in tmp[..n].iter_mut().zip(xb) {
            *t = ((v - mean) * inv_std).clamp(-F16_MAX, F16_MAX);
        }
        put_f16(&tmp[..n], ob);
    }
}

/// AVX + F16C conversion of f32 to f16, eight lanes at a time with the saturation fused in (the portable path
/// needs a separate pass for it).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::F16_MAX;

    /// Whether this CPU has AVX and F16C (`std` caches the answer).
    #[inline]
    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx") && is_x86_feature_detected!("f16c")
    }

    /// `out = f16((x - shift) * scale)` as little-endian bytes, rounding to nearest even. Finite results
    /// saturate at ±65504, NaN stays NaN, and ±Inf stays infinite unless `saturate_inf`.
    ///
    /// # Safety
    /// The CPU must support AVX and F16C ([`available`]), and `out.len() == 2 * x.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn affine_to_f16(
        x: &[f32],
        out: &mut [u8],
        shift: f32,
        scale: f32,
        saturate_inf: bool,
    ) {
        debug_assert_eq!(out.len(), 2 * x.len());
        let hi = _mm256_set1_ps(F16_MAX);
        let lo = _mm256_set1_ps(-F16_MAX);
        let shift = _mm256_set1_ps(shift);
        let scale = _mm256_set1_ps(scale);
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let inf = _mm256_set1_ps(f32::INFINITY);
        let keep_inf = if saturate_inf {
            _mm256_setzero_ps()
        } else {
            _mm256_castsi256_ps(_mm256_set1_epi32(-1))
        };
        let convert = |v: __m256| -> __m128i {
            let y = _mm256_mul_ps(_mm256_sub_ps(v, shift), scale);
            // min/max return their second operand when either is NaN, so NaN passes through.
            let clamped = _mm256_max_ps(lo, _mm256_min_ps(hi, y));
            let is_inf = _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_and_ps(y, abs_mask), inf),
                keep_inf,
            );
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_blendv_ps(clamped, y, is_inf))
        };
        let mut xs = x.chunks_exact(8);
        let mut os = out.chunks_exact_mut(16);
        for (xc, oc) in (&mut xs).zip(&mut os) {
            // SAFETY: `xc` holds 8 f32 and `oc` 16 bytes; both intrinsics take unaligned pointers.
            unsafe {
                let h = convert(_mm256_loadu_ps(xc.as_ptr()));
                _mm_storeu_si128(oc.as_mut_ptr().cast::<__m128i>(), h);
            }
        }
        let rest = xs.remainder();
        if !rest.is_empty() {
            let mut buf = [0f32; 8];
            buf[..rest.len()].copy_from_slice(rest);
            let mut bytes = [0u8; 16];
            // SAFETY: `buf` holds 8 f32 and `bytes` 16 bytes; both intrinsics take unaligned pointers.
            unsafe {
                let h = convert(_mm256_loadu_ps(buf.as_ptr()));
                _mm_storeu_si128(bytes.as_mut_ptr().cast::<__m128i>(), h);
            }
            let tail = os.into_remainder();
            tail.copy_from_slice(&bytes[..tail.len()]);
        }
    }
}

pub(super) fn decode_f32(src: &[u8], out: &mut [f32], op: Op) {
    match op {
        Op::Store => {
            #[cfg(target_endian = "little")]
            bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(src);
            #[cfg(not(target_endian = "little"))]
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Op::Add(w) => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o += w * f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

/// Decodes f16 codes `src` to f32 `y` and hands each tile to `emit(out_tile, y_tile)`.
#[inline(always)]
fn for_f16_tiles(src: &[u8], out: &mut [f32], mut emit: impl FnMut(&mut [f32], &[f32])) {
    let mut bits = [0u16; TILE];
    let mut y = [0f32; TILE];
    for (sb, ob) in src.chunks(2 * TILE).zip(out.chunks_mut(TILE)) {
        let n = ob.len();
        get_f16(sb, &mut bits, &mut y[..n]);
        emit(ob, &y[..n]);
    }
}

/// Converts the little-endian f16 bytes `src` into `y`, directly when `src` is 2-byte aligned.
#[inline(always)]
fn get_f16(src: &[u8], bits: &mut [u16; TILE], y: &mut [f32]) {
    #[cfg(target_endian = "little")]
    if let Ok(direct) = bytemuck::try_cast_slice::<u8, f16>(src) {
        direct.convert_to_f32_slice(y);
        return;
    }
    let n = y.len();
    read_u16s(src, &mut bits[..n]);
    let h: &[f16] = bytemuck::cast_slice(&bits[..n]);
    h.convert_to_f32_slice(y);
}

pub(super) fn decode_f16(src: &[u8], out: &mut [f32], op: Op) {
    match op {
        Op::Store => {
            let mut bits = [0u16; TILE];
            for (sb, ob) in src.chunks(2 * TILE).zip(out.chunks_mut(TILE)) {
                get_f16(sb, &mut bits, ob);
            }
        }
        Op::Add(w) => for_f16_tiles(src, out, |o, y| {
            for (o, &y) in o.iter_mut().zip(y) {
                *o += w * y;
            }
        }),
    }
}

pub(super) fn decode_scaled_f16(src: &[u8], out: &mut [f32], mean: f32, std: f32, op: Op) {
    match op {
        Op::Store => for_f16_tiles(src, out, |o, y| {
            for (o, &y) in o.iter_mut().zip(y) {
                *o = y * std + mean;
            }
        }),
        Op::Add(w) => for_f16_tiles(src, out, |o, y| {
            for (o, &y) in o.iter_mut().zip(y) {
                *o += w * (y * std + mean);
            }
        }),
    }
}

#[inline(always)]
fn bf16_to_f32(b: [u8; 2]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes(b)) << 16)
}

pub(super) fn decode_bf16(src: &[u8], out: &mut [f32], op: Op) {
    match op {
        Op::Store => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_to_f32([b[0], b[1]]);
            }
        }
        Op::Add(w) => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o += w * bf16_to_f32([b[0], b[1]]);
            }
        }
    }
}

/// Index of the first element of `src` whose bits under `mask` are all ones (an IEEE NaN or infinity), scanning
/// tiles branch-free first.
#[inline(always)]
fn first_all_ones<const W: usize>(src: &[u8], mask: u32) -> Option<usize> {
    let word = |b: &[u8]| -> u32 {
        let mut w = [0u8; 4];
        w[..W].copy_from_slice(&b[..W]);
        u32::from_le_bytes(w)
    };
    for (t, tile) in src.chunks(W * TILE).enumerate() {
        let mut acc = 0u32;
        for b in tile.chunks_exact(W) {
            acc |= u32::from(word(b) & mask == mask);
        }
        if acc != 0 {
            let i = tile
                .chunks_exact(W)
                .position(|b| word(b) & mask == mask)
                .unwrap_or(0);
            return Some(t * TILE + i);
        }
    }
    None
}

pub(super) fn first_nonfinite_f32(src: &[u8]) -> Option<usize> {
    first_all_ones::<4>(src, 0x7f80_0000)
}

pub(super) fn first_nonfinite_f16(src: &[u8]) -> Option<usize> {
    first_all_ones::<2>(src, 0x7c00)
}

pub(super) fn first_nonfinite_bf16(src: &[u8]) -> Option<usize> {
    first_all_ones::<2>(src, 0x7f80)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn a_round_trip_in_place_is_what_a_frame_decodes_to() {
        let mut rng = 0x1234_5678_u64;
        let values: Vec<f32> = (0..3 * TILE + 5)
            .map(|i| {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let unit = (rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                unit * 10f32.powi((i % 13) as i32 - 9) * if i % 97 == 0 { 1e9 } else { 1.0 }
            })
            .collect();
        for codec in [Codec::Float16, Codec::BFloat16] {
            let frame = crate::encode(codec, &values, &crate::EncodeOptions::default()).unwrap();
            let mut decoded = vec![0.0f32; values.len()];
            crate::decode_into(&frame, &mut decoded).unwrap();
            let mut rounded = values.clone();
            codec.round_trip(&mut rounded).unwrap();
            assert_eq!(
                rounded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                decoded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{codec}"
            );
            // Rounded values encode without loss: a second trip changes no bit.
            let mut again = rounded.clone();
            codec.round_trip(&mut again).unwrap();
            assert_eq!(again, rounded);
        }
        let mut v = values.clone();
        Codec::None.round_trip(&mut v).unwrap();
        assert_eq!(v, values);
        assert!(Codec::Uniform4Bit.round_trip(&mut v).is_err());
    }

    #[test]
    fn bf16_rounding_matches_half() {
        let mut state = 0x1234_5678u32;
        for _ in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let v = f32::from_bits(state);
            if !v.is_finite() || v.abs() > BF16_MAX {
                continue;
            }
            assert_eq!(f32_to_bf16_bits(v), bf16::from_f32(v).to_bits(), "{v:e}");
        }
        assert_eq!(
            f32_to_bf16_bits(f32::MAX),
            (BF16_MAX.to_bits() >> 16) as u16
        );
        assert!(f32::from_bits(u32::from(f32_to_bf16_bits(f32::NAN)) << 16).is_nan());
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16_bits(f32::NEG_INFINITY), 0xff80);
    }

    #[test]
    fn f16_saturates_finite_and_keeps_infinite() {
        let x = [1e6f32, -1e6, f32::INFINITY, f32::NAN, 65519.0, 1.0];
        let mut out = [0u8; 12];
        encode_f16(&x, &mut out);
        let mut back = [0f32; 6];
        decode_f16(&out, &mut back, Op::Store);
        assert_eq!(back[0], F16_MAX);
        assert_eq!(back[1], -F16_MAX);
        assert_eq!(back[2], f32::INFINITY);
        assert!(back[3].is_nan());
        assert_eq!(back[4], F16_MAX);
        assert_eq!(back[5], 1.0);
    }

    #[test]
    fn simd_and_portable_f16_agree() {
        let mut state = 0x9e37_79b9u32;
        let mut x: Vec<f32> = (0..10_007)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                match i % 4 {
                    0 => f32::from_bits(state),
                    1 => (state as f32 / u32::MAX as f32 - 0.5) * 1e-3,
                    _ => (state as f32 / u32::MAX as f32 - 0.5) * 2e5,
                }
            })
            .collect();
        x.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            65519.0,
            65520.0,
            -0.0,
            6e-8,
            1e-9,
        ]);
        for n in [0, 1, 7, 8, 9, x.len()] {
            let x = &x[..n];
            let (mut a, mut b) = (vec![0u8; 2 * n], vec![0u8; 2 * n]);
            encode_f16(x, &mut a);
            encode_f16_portable(x, &mut b);
            let same = |p: &[u8], q: &[u8]| {
                p.chunks_exact(2).zip(q.chunks_exact(2)).all(|(p, q)| {
                    let (p, q) = (
                        f16::from_le_bytes([p[0], p[1]]),
                        f16::from_le_bytes([q[0], q[1]]),
                    );
                    p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan())
                })
            };
            assert!(same(&a, &b), "f16, n = {n}");
            let finite: Vec<f32> = x
                .iter()
                .map(|&v| if v.is_finite() { v } else { 1.0 })
                .collect();
            encode_scaled_f16(&finite, &mut a, 3.0, 0.25);
            encode_scaled_f16_portable(&finite, &mut b, 3.0, 0.25);
            assert!(same(&a, &b), "scaled, n = {n}");
        }
    }

    #[test]
    fn nonfinite_scans() {
        let mut v = vec![0u8; 4 * 3000];
        assert_eq!(first_nonfinite_f32(&v), None);
        v[4 * 2500 + 2] = 0x80;
        v[4 * 2500 + 3] = 0x7f;
        assert_eq!(first_nonfinite_f32(&v), Some(2500));
        let mut h = vec![0u8; 2 * 3000];
        h[2 * 1234 + 1] = 0x7c;
        assert_eq!(first_nonfinite_f16(&h), Some(1234));
        assert_eq!(first_nonfinite_bf16(&h), None);
        h[2 * 7 + 1] = 0xff;
        h[2 * 7] = 0x80;
        assert_eq!(first_nonfinite_bf16(&h), Some(7));
    }
}
