//! The codec benchmark behind `starling bench compression [--size N]`: encode and decode throughput, wire size and
//! error of every codec on random normal data, one report per codec; then the gradient compressors (PowerSGD at
//! ranks 1, 4 and 16, DCT top-k at two densities and with sign values) on a square matrix of about the same size,
//! once low rank plus noise and once heavy-tailed (Student-t, gradient-like), one round each without error
//! feedback's help.

use std::time::Instant;

use crate::codec::Codec;
use crate::format::MAX_ELEMENTS;
use crate::frame::{encode_into, Decoder};
use crate::options::{DecodeOptions, EncodeOptions, DEFAULT_ZSTD_LEVEL};
use crate::synthetic;

/// One codec's figures from [`run_benchmark`]. Throughputs count MB (10^6 bytes) of f32 input per second on one
/// thread; timings are the median of the iterations, after one untimed warm-up, into reused buffers.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CodecBenchReport {
    /// Codec name (`"u8"`, ...; `"+zstd"` marks the variant with the lossless stage on).
    pub codec: String,
    /// Elements encoded.
    pub size: usize,
    /// Encode throughput, MB of f32 input per second.
    pub encode_mb_per_s: f64,
    /// Decode (into an existing buffer) throughput, MB of f32 output per second.
    pub decode_mb_per_s: f64,
    /// Decode-and-accumulate (`decode_add`) throughput, MB of f32 output per second.
    pub decode_add_mb_per_s: f64,
    /// Bytes of the frame, header included.
    pub wire_bytes: usize,
    /// f32 input bytes / wire bytes.
    pub compression_ratio: f64,
    /// ||x - decode(encode(x))|| / ||x||.
    pub relative_error: f64,
    /// Remarks (set for the zstd variants and on failure).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Benchmarks every codec on `size` random normal values (capped at [`MAX_ELEMENTS`]), timing `iterations`
/// encodes and decodes each (at least one). Also runs `none` and `u8` with the zstd stage, whose notes say what
/// zstd gained.
///
/// ```
/// let reports = starling_compression::bench::run_benchmark(10_000, 1);
/// assert!(reports.iter().any(|r| r.codec == "u8" && r.compression_ratio > 3.5));
/// ```
pub fn run_benchmark(size: usize, iterations: usize) -> Vec<CodecBenchReport> {
    let size = size.min(MAX_ELEMENTS);
    let iterations = iterations.max(1);
    let x = synthetic::normal(size, 0x5eed);
    let plain = EncodeOptions::default();
    let zstd = EncodeOptions::default().with_zstd(DEFAULT_ZSTD_LEVEL);
    let mut runs: Vec<(String, Codec, EncodeOptions)> = Codec::WIRE
        .iter()
        .map(|&c| (c.name().to_owned(), c, plain))
        .collect();
    runs.push(("none+zstd".to_owned(), Codec::None, zstd));
    runs.push(("u8+zstd".to_owned(), Codec::Uniform8Bit, zstd));
    let mut reports: Vec<CodecBenchReport> = runs
        .into_iter()
        .map(|(name, codec, opts)| bench_one(name, codec, &opts, &x, iterations))
        .collect();
    reports.extend(gradient_compressors(size, iterations));
    reports
}

/// The gradient compressors on a `side x side` matrix (`side²` about `size`, at least 16):
/// low rank (8) plus 10% noise, then Student-t (3 degrees of freedom). One round of one peer:
/// what goes on the wire (f32 factors for PowerSGD's two vectors; the zstd frame of the sparse
/// coefficients for DCT top-k), "encode" the work before sending (PowerSGD: both projections
/// and the orthonormalization), "decode" the work after (the reconstruction, the inverse DCT).
/// `decode_add_mb_per_s` is 0: the reducers add plain vectors.
pub fn gradient_compressors(size: usize, iterations: usize) -> Vec<CodecBenchReport> {
    let side = ((size as f64).sqrt() as usize).max(16);
    let n = side * side;
    let low_rank = {
        let u = synthetic::normal(side * 8, 0x10);
        let v = synthetic::normal(side * 8, 0x11);
        let noise = synthetic::normal(n, 0x12);
        let mut m = vec![0f32; n];
        for i in 0..side {
            for j in 0..side {
                let s: f32 = (0..8).map(|k| u[k * side + i] * v[k * side + j]).sum();
                m[i * side + j] = s / 8f32.sqrt() + 0.1 * noise[i * side + j];
            }
        }
        m
    };
    let heavy = synthetic::student_t(n, 3, 0x13);
    let mut out = Vec::new();
    for (input, x) in [("low-rank+noise", &low_rank), ("student-t", &heavy)] {
        for (rank, values) in [
            (1, Codec::None),
            (4, Codec::None),
            (4, Codec::BFloat16),
            (16, Codec::None),
        ] {
            out.push(bench_powersgd(input, side, rank, values, x, iterations));
        }
        for (chunk, k, values) in [
            (64, 8, crate::dct::DctValues::F16),
            (64, 2, crate::dct::DctValues::F16),
            (64, 2, crate::dct::DctValues::Sign),
            // DeMo's density.
            (256, 1, crate::dct::DctValues::F16),
        ] {
            out.push(bench_dct(input, chunk, k, values, x, iterations));
        }
    }
    out
}

fn empty_report(codec: String, size: usize) -> CodecBenchReport {
    CodecBenchReport {
        codec,
        size,
        encode_mb_per_s: 0.0,
        decode_mb_per_s: 0.0,
        decode_add_mb_per_s: 0.0,
        wire_bytes: 0,
        compression_ratio: 0.0,
        relative_error: 0.0,
        note: None,
    }
}

fn bench_powersgd(
    input: &str,
    side: usize,
    rank: usize,
    values: Codec,
    x: &[f32],
    iterations: usize,
) -> CodecBenchReport {
    use crate::lowrank::{LowRankMatrix, PowerSgd};
    let name = match values {
        Codec::None => format!("powersgd:{rank}"),
        other => format!("powersgd:{rank}:{other}"),
    };
    let mut report = empty_report(format!("{name} ({input}, {side}x{side})"), x.len());
    let layout = [LowRankMatrix {
        offset: 0,
        rows: side,
        cols: side,
    }];
    let outcome = (|| -> crate::Result<()> {
        let mut state = PowerSgd::new(rank, x.len(), &layout, 1)?.values(values)?;
        let mut one = vec![0f32; state.phase_one_len()];
        let mut two = vec![0f32; state.phase_two_len()];
        let mut y = vec![0f32; x.len()];
        // Both vectors as a one-peer group's reducer returns them: rounded through the codec.
        let encode = |state: &mut PowerSgd, one: &mut [f32], two: &mut [f32]| {
            state.begin(x, one)?;
            values.round_trip(one)?;
            state.middle(one, two)?;
            values.round_trip(two)
        };
        let encode_s = median_secs(iterations, || {
            encode(&mut state, &mut one, &mut two)?;
            state.abort();
            Ok(())
        })?;
        encode(&mut state, &mut one, &mut two)?;
        let start = Instant::now();
        state.finish(&one, &two, &mut y)?;
        let decode_s = start.elapsed().as_secs_f64().max(1e-9);
        let mb = (x.len() * 4) as f64 / 1e6;
        report.encode_mb_per_s = mb / encode_s;
        report.decode_mb_per_s = mb / decode_s;
        let per_value = if values == Codec::None { 4 } else { 2 };
        report.wire_bytes = 2 * crate::HEADER_LEN + per_value * state.elements_per_round();
        report.relative_error = relative_error(x, &y);
        Ok(())
    })();
    finish_report(report, outcome, x.len())
}

fn bench_dct(
    input: &str,
    chunk: usize,
    k: usize,
    values: crate::dct::DctValues,
    x: &[f32],
    iterations: usize,
) -> CodecBenchReport {
    use crate::dct::{DctTopK, DctValues};
    let sign = if values == DctValues::Sign {
        ":sign"
    } else {
        ""
    };
    let mut report = empty_report(format!("dct-topk:{chunk}:{k}{sign} ({input})"), x.len());
    let outcome = (|| -> crate::Result<()> {
        let mut state = DctTopK::new(x.len(), chunk, k, values)?;
        let mut c = vec![0f32; x.len()];
        let mut y = vec![0f32; x.len()];
        let zstd = EncodeOptions::default().with_zstd(1);
        let mut frame = Vec::new();
        let encode_s = median_secs(iterations, || {
            state.begin(x, &mut c)?;
            encode_into(Codec::None, &c, &zstd, &mut frame)?;
            state.abort();
            Ok(())
        })?;
        state.begin(x, &mut c)?;
        let start = Instant::now();
        state.finish(&c, &mut y)?;
        let decode_s = start.elapsed().as_secs_f64().max(1e-9);
        let mb = (x.len() * 4) as f64 / 1e6;
        report.encode_mb_per_s = mb / encode_s;
        report.decode_mb_per_s = mb / decode_s;
        report.wire_bytes = frame.len();
        report.relative_error = relative_error(x, &y);
        Ok(())
    })();
    finish_report(report, outcome, x.len())
}

fn finish_report(
    mut report: CodecBenchReport,
    outcome: crate::Result<()>,
    len: usize,
) -> CodecBenchReport {
    match outcome {
        Ok(()) => {
            report.compression_ratio = (len * 4) as f64 / report.wire_bytes.max(1) as f64;
            report.note = Some("one round of one peer, without error feedback".into());
        }
        Err(e) => report.note = Some(format!("failed: {e}")),
    }
    report
}

fn bench_one(
    name: String,
    codec: Codec,
    opts: &EncodeOptions,
    x: &[f32],
    iterations: usize,
) -> CodecBenchReport {
    let mb = (x.len() * 4) as f64 / 1e6;
    let mut report = empty_report(name, x.len());
    let mut frame = Vec::new();
    let mut out = vec![0f32; x.len()];
    let mut decoder = Decoder::new(DecodeOptions::default());
    let outcome = (|| -> crate::Result<()> {
        encode_into(codec, x, opts, &mut frame)?;
        decoder.decode_into(&frame, &mut out)?;
        let encode_s = median_secs(iterations, || {
            encode_into(codec, x, opts, &mut frame).map(drop)
        })?;
        let decode_s = median_secs(iterations, || {
            decoder.decode_into(&frame, &mut out).map(drop)
        })?;
        let mut acc = vec![0f32; x.len()];
        decoder.decode_add(&frame, &mut acc, 1.0)?;
        let add_s = median_secs(iterations, || {
            decoder.decode_add(&frame, &mut acc, 1.0).map(drop)
        })?;
        report.encode_mb_per_s = mb / encode_s;
        report.decode_mb_per_s = mb / decode_s;
        report.decode_add_mb_per_s = mb / add_s;
        Ok(())
    })();
    if let Err(e) = outcome {
        report.note = Some(format!("failed: {e}"));
        return report;
    }
    report.wire_bytes = frame.len();
    report.compression_ratio = (x.len() * 4) as f64 / frame.len() as f64;
    report.relative_error = relative_error(x, &out);
    if let Some(level) = opts.zstd_level {
        let raw = codec.frame_len(x.len()).unwrap_or(frame.len());
        report.note = Some(if frame.len() < raw {
            format!(
                "zstd level {level} over the {codec} body: {:.3}x smaller than {codec} alone; pays on sparse or \
                 structured data, rarely on dense gradients",
                raw as f64 / frame.len() as f64
            )
        } else {
            format!("zstd level {level} did not shrink the {codec} body (probe or result), so the frame is plain {codec}")
        });
    }
    report
}

fn median_secs(iterations: usize, mut f: impl FnMut() -> crate::Result<()>) -> crate::Result<f64> {
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64().max(1e-9));
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `||x - y|| / ||x||` in f64 (0 for an all-zero `x` equal to `y`).
pub fn relative_error(x: &[f32], y: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&a, &b) in x.iter().zip(y) {
        let d = f64::from(a) - f64::from(b);
        num += d * d;
        den += f64::from(a) * f64::from(a);
    }
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}
