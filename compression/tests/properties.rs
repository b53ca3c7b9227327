//! Property tests: per-element guarantees of each codec, chunking in any order, zstd and error feedback.

use proptest::prelude::*;
use starling_compression::{
    decode, encode, raw_frame_header, split_chunks, ChunkAssembler, ChunkHeader, Codec,
    DecodeOptions, EncodeOptions, ErrorFeedback, NonFinite, BLOCK_SIZE,
};

fn codec() -> impl Strategy<Value = Codec> {
    prop::sample::select(Codec::WIRE.to_vec())
}

/// Finite values over many magnitudes, with runs of repeats and zeros (sparse, constant and wide-range data).
fn tensor(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
    let value = prop_oneof![
        4 => -1.0f32..1.0,
        2 => (-1.0f32..1.0, -30i32..30).prop_map(|(m, e)| m * 2f32.powi(e)),
        1 => Just(0.0f32),
        1 => Just(3.25f32),
        1 => (-1.0f32..1.0, 60i32..100).prop_map(|(m, e)| m * 2f32.powi(e)),
    ];
    prop::collection::vec(value, 0..max_len)
}

fn decoded(codec: Codec, x: &[f32], opts: &EncodeOptions) -> Vec<f32> {
    let frame = encode(codec, x, opts).expect("encode");
    let header = ChunkHeader::parse(&frame).expect("header");
    assert_eq!(header.count, x.len());
    assert!(frame.len() <= codec.frame_len(x.len()).expect("layout"));
    let y = decode(&frame, &DecodeOptions::default()).expect("decode");
    assert_eq!(y.len(), x.len());
    assert!(y.iter().all(|v| v.is_finite()));
    y
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn per_element_guarantees(codec in codec(), x in tensor(9000)) {
        let y = decoded(codec, &x, &EncodeOptions::default());
        let (lo, hi) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
        match codec {
            Codec::None => prop_assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits())),
            Codec::Float16 => {
                for (a, b) in x.iter().zip(&y) {
                    if a.abs() > 65504.0 {
                        // Saturates instead of overflowing to infinity.
                        prop_assert_eq!(*b, 65504f32.copysign(*a));
                    } else {
                        // Half an ulp of f16 (2^-11 relative) for normal f16 values, 2^-25 absolute below them.
                        prop_assert!((a - b).abs() <= (a.abs() * 2f32.powi(-11)).max(2f32.powi(-25)), "{a} -> {b}");
                    }
                }
            }
            Codec::BFloat16 => {
                for (a, b) in x.iter().zip(&y) {
                    prop_assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "{a} -> {b}");
                }
            }
            Codec::Blockwise8Bit => {
                for (xb, yb) in x.chunks(BLOCK_SIZE).zip(y.chunks(BLOCK_SIZE)) {
                    let absmax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (a, b) in xb.iter().zip(yb) {
                        // Half the widest gap of the dynamic map (0.9/103 in the top decade).
                        prop_assert!((a - b).abs() <= absmax * 0.0044 + absmax * 1e-6, "{a} -> {b} (absmax {absmax})");
                        prop_assert!(a.signum() == b.signum() || *b == 0.0);
                    }
                }
            }
            Codec::Uniform8Bit | Codec::Quantile8Bit | Codec::Uniform4Bit => {
                // Codebook entries are bin means: inside the data's range, and the sum is kept.
                let slack = 1e-6 * lo.abs().max(hi.abs());
                prop_assert!(y.iter().all(|&v| v >= lo - slack && v <= hi + slack));
                let sx: f64 = x.iter().map(|&v| f64::from(v)).sum();
                let sy: f64 = y.iter().map(|&v| f64::from(v)).sum();
                let sa: f64 = x.iter().map(|&v| f64::from(v).abs()).sum();
                prop_assert!((sx - sy).abs() <= 1e-6 * sa + 1e-30, "sum {sx} -> {sy}");
            }
            Codec::ScaledFloat16 => {
                let n = x.len().max(1) as f64;
                let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
                let std = (x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n).sqrt();
                for (a, b) in x.iter().zip(&y) {
                    let tol = (f64::from(*a) - mean).abs() * 1e-3 + std * 1e-4 + mean.abs() * 1e-6 + 1e-30;
                    prop_assert!((f64::from(*a) - f64::from(*b)).abs() <= tol, "{a} -> {b}");
                }
            }
            Codec::Adaptive => unreachable!("not a wire codec"),
        }
    }

    #[test]
    fn chunks_reassemble_in_any_order(
        codec in codec(),
        x in tensor(20_000),
        extra in 0usize..40_000,
        order in any::<u64>(),
        zstd in any::<bool>(),
    ) {
        let params = codec.params_len().unwrap_or(0);
        let max_bytes = starling_compression::HEADER_LEN + params + 16 + extra;
        let opts = if zstd { EncodeOptions::default().with_zstd(1) } else { EncodeOptions::default() };
        let mut chunks: Vec<Vec<u8>> =
            split_chunks(codec, &x, max_bytes, &opts).expect("split").collect::<Result<_, _>>().expect("encode");
        prop_assert!(chunks.iter().all(|c| c.len() <= max_bytes));
        // Each chunk decodes alone to what the assembler puts at its offset.
        let mut expect = vec![0f32; x.len()];
        for c in &chunks {
            let h = ChunkHeader::parse(c).expect("header");
            prop_assert_eq!(h.total, x.len() as u64);
            let part = decode(c, &DecodeOptions::default()).expect("decode");
            expect[h.offset as usize..h.offset as usize + h.count].copy_from_slice(&part);
        }
        // Deterministic shuffle from `order`.
        let mut state = order | 1;
        for i in (1..chunks.len()).rev() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunks.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let mut assembler = ChunkAssembler::new(x.len()).expect("assembler");
        for c in &chunks {
            assembler.accept(c).expect("accept");
            let again = matches!(assembler.accept(c), Err(starling_compression::Error::ChunkOverlap { .. }));
            prop_assert!(again, "a repeated chunk must be refused");
        }
        let got = assembler.finish().expect("complete");
        prop_assert_eq!(&got, &expect);
        if codec == Codec::None {
            prop_assert_eq!(&got, &x);
        }
    }

    #[test]
    fn zstd_stage_is_lossless(codec in codec(), x in tensor(5000)) {
        let plain = decoded(codec, &x, &EncodeOptions::default());
        let zstd = decoded(codec, &x, &EncodeOptions::default().with_zstd(3));
        prop_assert_eq!(plain, zstd);
    }

    #[test]
    fn nonfinite_rejected_by_default_and_allowed_on_request(
        codec in codec(),
        x in tensor(3000).prop_filter("non-empty", |x| !x.is_empty()),
        at in any::<prop::sample::Index>(),
        bad in prop::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY]),
    ) {
        let mut x = x;
        let i = at.index(x.len());
        x[i] = bad;
        let rejected = encode(codec, &x, &EncodeOptions::default());
        let is_first_bad = matches!(rejected, Err(starling_compression::Error::NonFiniteInput { index, .. }) if index == i);
        prop_assert!(is_first_bad, "expected NonFiniteInput at {}, got {:?}", i, rejected);
        let frame = encode(codec, &x, &EncodeOptions::default().with_nonfinite(NonFinite::Allow)).expect("allowed");
        let lenient = DecodeOptions::default().with_nonfinite(NonFinite::Allow);
        let y = decode(&frame, &lenient).expect("decode");
        match codec {
            Codec::None | Codec::Float16 | Codec::BFloat16 => {
                prop_assert!(y[i].is_nan() == bad.is_nan() && y[i].is_infinite() == bad.is_infinite());
                let refused = matches!(
                    decode(&frame, &DecodeOptions::default()),
                    Err(starling_compression::Error::NonFinitePayload { index }) if index == i
                );
                prop_assert!(refused, "a strict decoder must refuse the non-finite element");
            }
            _ => {
                // Statistical codecs encode non-finite values as 0.0: the result is the frame of the cleaned input.
                prop_assert!(y.iter().all(|v| v.is_finite()));
                let mut clean = x.clone();
                clean[i] = 0.0;
                prop_assert_eq!(y, decoded(codec, &clean, &EncodeOptions::default()));
            }
        }
    }

    #[test]
    fn error_feedback_tracks_the_sum(codec in codec(), x in tensor(2000), rounds in 1usize..8) {
        let mut feedback = ErrorFeedback::new(x.len());
        let mut sent = vec![0f64; x.len()];
        for _ in 0..rounds {
            let frame = feedback.encode(codec, &x, &EncodeOptions::default()).expect("encode");
            for (s, d) in sent.iter_mut().zip(decode(&frame, &DecodeOptions::default()).expect("decode")) {
                *s += f64::from(d);
            }
        }
        // sent + residual == rounds * x, up to f32 rounding of the running sums.
        let scale = x.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs())) * rounds as f64;
        for ((s, r), g) in sent.iter().zip(feedback.residual()).zip(&x) {
            let want = rounds as f64 * f64::from(*g);
            prop_assert!((s + f64::from(*r) - want).abs() <= 1e-5 * scale + 1e-30, "{s} + {r} vs {want}");
        }
    }
}

#[test]
fn error_feedback_shrinks_the_average_error() {
    let x = starling_compression::synthetic::normal(4096, 3);
    let mut feedback = ErrorFeedback::new(x.len());
    let mut sent = vec![0f64; x.len()];
    let rounds = 50;
    for _ in 0..rounds {
        let frame = feedback
            .encode(Codec::Uniform4Bit, &x, &EncodeOptions::default())
            .expect("encode");
        for (s, d) in sent
            .iter_mut()
            .zip(decode(&frame, &DecodeOptions::default()).expect("decode"))
        {
            *s += f64::from(d);
        }
    }
    let avg: Vec<f32> = sent.iter().map(|s| (s / rounds as f64) as f32).collect();
    let one_shot = decode(
        &encode(Codec::Uniform4Bit, &x, &EncodeOptions::default()).expect("encode"),
        &DecodeOptions::default(),
    )
    .expect("decode");
    let with = starling_compression::bench::relative_error(&x, &avg);
    let without = starling_compression::bench::relative_error(&x, &one_shot);
    assert!(
        with < without / 10.0,
        "with feedback {with}, without {without}"
    );
    let mut chunked = ErrorFeedback::new(x.len());
    let frames = chunked
        .encode_chunks(Codec::Uniform8Bit, &x, 2000, &EncodeOptions::default())
        .expect("chunks");
    assert!(frames.len() > 1);
    assert!(chunked.residual().iter().any(|&r| r != 0.0));
    assert!(matches!(
        chunked.encode(Codec::None, &x[..10], &EncodeOptions::default()),
        Err(starling_compression::Error::LengthMismatch { .. })
    ));
}

proptest! {
    /// A raw header plus the values' bytes is byte for byte the frame `split_chunks` encodes for
    /// the same chunk with `Codec::None`.
    #[test]
    fn raw_frame_header_matches_the_encoder(
        data in proptest::collection::vec(-1e6f32..1e6, 1..3000),
        chunk_bytes in 64usize..4096,
    ) {
        let opts = EncodeOptions::default();
        let mut chunks = split_chunks(Codec::None, &data, chunk_bytes, &opts).unwrap();
        let mut frame = Vec::new();
        while let Some(h) = chunks.next_into(&mut frame) {
            let h = h.unwrap();
            let start = h.offset as usize;
            let mut raw = raw_frame_header(h.count, h.offset, data.len() as u64).unwrap().to_vec();
            for v in &data[start..start + h.count] {
                raw.extend_from_slice(&v.to_le_bytes());
            }
            prop_assert_eq!(&raw, &frame);
        }
    }
}

#[test]
fn raw_frame_header_refuses_out_of_range_chunks() {
    assert!(raw_frame_header(10, 95, 100).is_err());
    assert!(raw_frame_header(10, u64::MAX, u64::MAX).is_err());
    assert!(raw_frame_header(1 << 29, 0, 1 << 30).is_err());
    assert!(raw_frame_header(10, 90, 100).is_ok());
}
