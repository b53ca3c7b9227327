//! Codec kernels and the drivers that run them over a frame body, serially or on the rayon pool.
//!
//! Encoding runs in two steps: a [`EncodePlan`] holds what the codec computed from the whole input first (mean and
//! range, quantile thresholds), then the input is processed in spans of whole [`SPAN`]-element blocks, each block
//! checked for NaN/Inf (while it is in L1) and then encoded. Codebook codecs also fill a [`Hist`] of per-bin sums,
//! from which the codebook of bin means is written last. Decoding first builds a validated [`DecodeView`] of the
//! body (parameters checked, payload optionally scanned for NaN/Inf), then decodes spans; nothing is written to
//! the output until every check has passed.

pub(crate) mod blockwise;
pub(crate) mod codebook;
pub(crate) mod float;

use rayon::prelude::*;

use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::options::PARALLEL_MIN_ELEMENTS;
use crate::stats;

use blockwise::BLOCK_SIZE;

/// Elements per block of work: the unit of NaN/Inf checks, of parallel splits and of Blockwise8Bit's scaling.
pub(crate) const SPAN: usize = BLOCK_SIZE;

/// What a decode does with each decoded value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Op {
    /// `out[i] = v`
    Store,
    /// `out[i] += w * v`
    Add(f32),
}

/// Per-bin sums and counts, four interleaved copies so that runs of equal codes do not serialize on one counter.
/// Each bin is `[sum, count]` in f64, so one element updates one 16-byte pair (one SIMD add).
pub(crate) struct Hist {
    bins: [[[f64; 2]; 256]; 4],
}

impl Hist {
    pub(crate) fn new() -> Box<Hist> {
        Box::new(Hist {
            bins: [[[0.0; 2]; 256]; 4],
        })
    }

    /// Adds `x[i]` to the bin `codes[i]`.
    #[inline]
    pub(crate) fn add(&mut self, codes: &[u8], x: &[f32]) {
        let mut cs = codes.chunks_exact(4);
        let mut xs = x.chunks_exact(4);
        for (c, v) in (&mut cs).zip(&mut xs) {
            for lane in 0..4 {
                let bin = &mut self.bins[lane][usize::from(c[lane])];
                bin[0] += f64::from(v[lane]);
                bin[1] += 1.0;
            }
        }
        for (&c, &v) in cs.remainder().iter().zip(xs.remainder()) {
            let bin = &mut self.bins[0][usize::from(c)];
            bin[0] += f64::from(v);
            bin[1] += 1.0;
        }
    }

    fn merge(&mut self, other: &Hist) {
        for (mine, theirs) in self.bins.iter_mut().zip(&other.bins) {
            for (a, b) in mine.iter_mut().zip(theirs) {
                a[0] += b[0];
                a[1] += b[1];
            }
        }
    }

    /// The codebook of bin means for the first `B` bins; empty bins get `fallback(bin)`.
    pub(crate) fn codebook<const B: usize>(&self, fallback: impl Fn(usize) -> f32) -> [f32; B] {
        std::array::from_fn(|bin| {
            let count: f64 = self.bins.iter().map(|lane| lane[bin][1]).sum();
            if count == 0.0 {
                return fallback(bin);
            }
            let sum: f64 = self.bins.iter().map(|lane| lane[bin][0]).sum();
            (sum / count) as f32
        })
    }
}

/// What a codec computed from the whole input before encoding it block by block.
pub(crate) enum EncodePlan {
    None,
    Float16,
    BFloat16,
    ScaledFloat16 { mean: f32, std: f32, inv_std: f32 },
    Uniform8 { q: codebook::UniformQuantizer },
    Quantile8 { bins: Box<codebook::QuantileBins> },
    Blockwise8,
    Uniform4 { q: codebook::UniformQuantizer },
}

impl EncodePlan {
    /// Computes the plan of a (resolved) `codec` for `x`.
    pub(crate) fn new(codec: Codec, x: &[f32]) -> Result<EncodePlan> {
        Ok(match codec {
            Codec::None | Codec::Adaptive => EncodePlan::None,
            Codec::Float16 => EncodePlan::Float16,
            Codec::BFloat16 => EncodePlan::BFloat16,
            Codec::ScaledFloat16 => float::scaled_plan(x)?,
            Codec::Uniform8Bit => EncodePlan::Uniform8 {
                q: codebook::UniformQuantizer::new(x, 256),
            },
            Codec::Quantile8Bit => EncodePlan::Quantile8 {
                bins: codebook::QuantileBins::new(x),
            },
            Codec::Blockwise8Bit => EncodePlan::Blockwise8,
            Codec::Uniform4Bit => EncodePlan::Uniform4 {
                q: codebook::UniformQuantizer::new(x, 16),
            },
        })
    }

    fn uses_hist(&self) -> bool {
        matches!(
            self,
            EncodePlan::Uniform8 { .. }
                | EncodePlan::Quantile8 { .. }
                | EncodePlan::Uniform4 { .. }
        )
    }

    /// Bytes of main payload for element range `a..b` of a span (a is a multiple of [`SPAN`]).
    fn main_range(&self, a: usize, b: usize) -> std::ops::Range<usize> {
        match self {
            EncodePlan::None => 4 * a..4 * b,
            EncodePlan::Float16 | EncodePlan::BFloat16 | EncodePlan::ScaledFloat16 { .. } => {
                2 * a..2 * b
            }
            EncodePlan::Uniform8 { .. } | EncodePlan::Quantile8 { .. } | EncodePlan::Blockwise8 => {
                a..b
            }
            EncodePlan::Uniform4 { .. } => a / 2..b.div_ceil(2),
        }
    }

    /// Encodes one span: `x` starts at input index `base` (a multiple of [`SPAN`]); `main` is the span's part of the
    /// payload and `scales` its part of Blockwise8Bit's scale array (empty for other codecs).
    fn encode_span(
        &self,
        x: &[f32],
        base: usize,
        main: &mut [u8],
        scales: &mut [u8],
        hist: &mut Hist,
        check: bool,
    ) -> Result<()> {
        for (j, xb) in x.chunks(SPAN).enumerate() {
            let (a, b) = (j * SPAN, j * SPAN + xb.len());
            if check {
                stats::check_finite(xb, base + a)?;
            }
            let mb = &mut main[self.main_range(a, b)];
            match self {
                EncodePlan::None => float::encode_f32(xb, mb),
                EncodePlan::Float16 => float::encode_f16(xb, mb),
                EncodePlan::BFloat16 => float::encode_bf16(xb, mb),
                EncodePlan::ScaledFloat16 { mean, inv_std, .. } => {
                    float::encode_scaled_f16(xb, mb, *mean, *inv_std)
                }
                EncodePlan::Uniform8 { q } => {
                    q.encode8(xb, mb);
                    hist.add(mb, xb);
                }
                EncodePlan::Quantile8 { bins } => {
                    bins.encode(xb, mb);
                    hist.add(mb, xb);
                }
                EncodePlan::Blockwise8 => {
                    let scale = blockwise::encode_block(xb, mb);
                    scales[4 * j..4 * j + 4].copy_from_slice(&scale.to_le_bytes());
                }
                EncodePlan::Uniform4 { q } => q.encode4(xb, mb, hist),
            }
        }
        Ok(())
    }

    /// Writes the codec parameters (after the payload, since codebooks need the histogram).
    fn write_params(&self, params: &mut [u8], hist: &Hist) {
        let put = |params: &mut [u8], values: &[f32]| {
            for (p, v) in params.chunks_exact_mut(4).zip(values) {
                p.copy_from_slice(&v.to_le_bytes());
            }
        };
        match self {
            EncodePlan::ScaledFloat16 { mean, std, .. } => put(params, &[*mean, *std]),
            EncodePlan::Uniform8 { q } => {
                put(params, &hist.codebook::<256>(|bin| q.bin_centre(bin)))
            }
            EncodePlan::Uniform4 { q } => {
                put(params, &hist.codebook::<16>(|bin| q.bin_centre(bin)))
            }
            EncodePlan::Quantile8 { bins } => {
                put(params, &hist.codebook::<256>(|bin| bins.fallback(bin)))
            }
            EncodePlan::None
            | EncodePlan::Float16
            | EncodePlan::BFloat16
            | EncodePlan::Blockwise8 => {}
        }
    }
}

/// Encodes `x` with the (resolved) `codec` into `body` (exactly params + payload bytes long).
pub(crate) fn encode_body(
    codec: Codec,
    x: &[f32],
    body: &mut [u8],
    check: bool,
    parallel: bool,
) -> Result<()> {
    let plan = EncodePlan::new(codec, x)?;
    let params_len = codec.params_len().unwrap_or(0);
    let (params, payload) = body.split_at_mut(params_len);
    let scales_len = if codec == Codec::Blockwise8Bit {
        4 * x.len().div_ceil(BLOCK_SIZE)
    } else {
        0
    };
    let (scales, main) = payload.split_at_mut(scales_len);
    let mut hist = Hist::new();
    if parallel && x.len() >= PARALLEL_MIN_ELEMENTS {
        let span = parallel_span(x.len());
        let mut jobs = Vec::with_capacity(x.len().div_ceil(span));
        let (mut main_rest, mut scales_rest) = (main, scales);
        for (i, xs) in x.chunks(span).enumerate() {
            let main_len = plan.main_range(0, xs.len()).len();
            let (m, rest) = std::mem::take(&mut main_rest).split_at_mut(main_len);
            main_rest = rest;
            let scale_len = if scales_len > 0 {
                4 * xs.len().div_ceil(BLOCK_SIZE)
            } else {
                0
            };
            let (s, rest) = std::mem::take(&mut scales_rest).split_at_mut(scale_len);
            scales_rest = rest;
            jobs.push((i * span, xs, m, s));
        }
        let uses_hist = plan.uses_hist();
        let merged = jobs
            .into_par_iter()
            .map(|(base, xs, m, s)| {
                let mut h = Hist::new();
                plan.encode_span(xs, base, m, s, &mut h, check)?;
                Ok(uses_hist.then_some(h))
            })
            .try_reduce(|| None, |a, b| Ok(merge_hists(a, b)))?;
        if let Some(h) = merged {
            hist = h;
        }
    } else {
        plan.encode_span(x, 0, main, scales, &mut hist, check)?;
    }
    plan.write_params(params, &hist);
    Ok(())
}

fn merge_hists(a: Option<Box<Hist>>, b: Option<Box<Hist>>) -> Option<Box<Hist>> {
    match (a, b) {
        (Some(mut a), Some(b)) => {
            a.merge(&b);
            Some(a)
        }
        (a, None) => a,
        (None, b) => b,
    }
}

/// Elements per parallel job: a multiple of [`SPAN`], about four jobs per thread, at least 64 Ki elements.
fn parallel_span(n: usize) -> usize {
    let jobs = 4 * rayon::current_num_threads().max(1);
    n.div_ceil(jobs).max(1 << 16).div_ceil(SPAN) * SPAN
}

/// A validated view of a frame body, ready to decode. It lives on the stack for one decode; boxing the codebook
/// would cost an allocation per frame on the hot path, hence the large variant.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DecodeView<'a> {
    F32(&'a [u8]),
    F16(&'a [u8]),
    Bf16(&'a [u8]),
    ScaledF16 {
        mean: f32,
        std: f32,
        codes: &'a [u8],
    },
    Codebook8 {
        codebook: [f32; 256],
        codes: &'a [u8],
    },
    Codebook4 {
        codebook: [f32; 16],
        codes: &'a [u8],
    },
    Blockwise8 {
        scales: &'a [u8],
        codes: &'a [u8],
    },
}

impl<'a> DecodeView<'a> {
    /// Splits and validates the raw `body` of a frame of `count` elements of `codec` (lengths were checked by the
    /// header already). Checks parameters: codebook entries, block scales, mean and std must be finite (scales
    /// non-negative, and ScaledFloat16's `|mean| + 65504·std` must stay within f32).
    pub(crate) fn new(codec: Codec, count: usize, body: &'a [u8]) -> Result<DecodeView<'a>> {
        let params_len = codec.params_len().unwrap_or(0);
        let payload_len = codec.payload_len(count).unwrap_or(0);
        if body.len() != params_len + payload_len {
            return Err(Error::LengthMismatch {
                field: "raw body length",
                expected: (params_len + payload_len) as u64,
                actual: body.len() as u64,
            });
        }
        let (params, payload) = body.split_at(params_len);
        Ok(match codec {
            Codec::None | Codec::Adaptive => DecodeView::F32(payload),
            Codec::Float16 => DecodeView::F16(payload),
            Codec::BFloat16 => DecodeView::Bf16(payload),
            Codec::ScaledFloat16 => {
                let [mean, std] = read_params::<2>(params)?;
                float::check_scaled_params(mean, std)?;
                DecodeView::ScaledF16 {
                    mean,
                    std,
                    codes: payload,
                }
            }
            Codec::Uniform8Bit | Codec::Quantile8Bit => DecodeView::Codebook8 {
                codebook: read_params::<256>(params)?,
                codes: payload,
            },
            Codec::Uniform4Bit => DecodeView::Codebook4 {
                codebook: read_params::<16>(params)?,
                codes: payload,
            },
            Codec::Blockwise8Bit => {
                let (scales, codes) = payload.split_at(4 * count.div_ceil(BLOCK_SIZE));
                blockwise::check_scales(scales)?;
                DecodeView::Blockwise8 { scales, codes }
            }
        })
    }

    /// Errors with the first element that decodes to NaN or ±Inf. Only float payloads can: codebooks and scales
    /// were checked in [`new`](Self::new), and the ScaledFloat16 bound keeps finite codes finite.
    pub(crate) fn check_finite(&self) -> Result<()> {
        let bad = match self {
            DecodeView::F32(p) => float::first_nonfinite_f32(p),
            DecodeView::F16(p) | DecodeView::ScaledF16 { codes: p, .. } => {
                float::first_nonfinite_f16(p)
            }
            DecodeView::Bf16(p) => float::first_nonfinite_bf16(p),
            DecodeView::Codebook8 { .. }
            | DecodeView::Codebook4 { .. }
            | DecodeView::Blockwise8 { .. } => None,
        };
        match bad {
            Some(index) => Err(Error::NonFinitePayload { index }),
            None => Ok(()),
        }
    }

    /// Decodes elements `start..start + out.len()` (start a multiple of [`SPAN`]) into `out`.
    fn decode_span(&self, start: usize, out: &mut [f32], op: Op) {
        let end = start + out.len();
        match self {
            DecodeView::F32(p) => float::decode_f32(&p[4 * start..4 * end], out, op),
            DecodeView::F16(p) => float::decode_f16(&p[2 * start..2 * end], out, op),
            DecodeView::Bf16(p) => float::decode_bf16(&p[2 * start..2 * end], out, op),
            DecodeView::ScaledF16 { mean, std, codes } => {
                float::decode_scaled_f16(&codes[2 * start..2 * end], out, *mean, *std, op)
            }
            DecodeView::Codebook8 { codebook, codes } => {
                codebook::decode8(&codes[start..end], out, codebook, op)
            }
            DecodeView::Codebook4 { codebook, codes } => {
                codebook::decode4(&codes[start / 2..end.div_ceil(2)], out, codebook, op)
            }
            DecodeView::Blockwise8 { scales, codes } => {
                let blocks = 4 * (start / BLOCK_SIZE)..4 * end.div_ceil(BLOCK_SIZE);
                blockwise::decode(&scales[blocks], &codes[start..end], out, op)
            }
        }
    }

    /// Decodes the whole view into `out` (exactly the frame's element count long).
    pub(crate) fn decode(&self, out: &mut [f32], op: Op, parallel: bool) {
        if parallel && out.len() >= PARALLEL_MIN_ELEMENTS {
            let span = parallel_span(out.len());
            out.par_chunks_mut(span)
                .enumerate()
                .for_each(|(i, o)| self.decode_span(i * span, o, op));
        } else {
            self.decode_span(0, out, op);
        }
    }
}

/// Reads `N` f32 LE parameters and checks that they are finite.
fn read_params<const N: usize>(params: &[u8]) -> Result<[f32; N]> {
    if params.len() != 4 * N {
        return Err(Error::LengthMismatch {
            field: "params length",
            expected: 4 * N as u64,
            actual: params.len() as u64,
        });
    }
    let mut values = [0f32; N];
    for (v, b) in values.iter_mut().zip(params.chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    if values.iter().any(|v| !v.is_finite()) {
        return Err(Error::InvalidParameter(
            "codebook entry or scale is NaN or infinite",
        ));
    }
    Ok(values)
}
