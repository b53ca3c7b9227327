//! Arbitrary bytes through every decoding entry point. Run with an allocation cap so an unbounded allocation is a
//! crash: `cargo fuzz run decode -- -malloc_limit_mb=64` (the decoder limit below allows 2^16 elements).

#![no_main]

use libfuzzer_sys::fuzz_target;
use starling_compression::{ChunkAssembler, ChunkHeader, DecodeOptions, Decoder, NonFinite};

const LIMIT: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let strict = DecodeOptions::default().with_max_elements(LIMIT);
    let lenient = strict.with_nonfinite(NonFinite::Allow);
    for opts in [strict, lenient] {
        let mut decoder = Decoder::new(opts);
        if let Ok(values) = decoder.decode(data) {
            let header = ChunkHeader::parse(data).expect("decoded frames have valid headers");
            assert_eq!(values.len(), header.count);
            assert!(header.count <= LIMIT);
            if opts.nonfinite == NonFinite::Reject {
                assert!(values.iter().all(|v| v.is_finite()));
            }
        }
    }
    if let Ok(header) = ChunkHeader::parse_prefix(data) {
        if header.count <= LIMIT {
            let mut decoder = Decoder::new(strict);
            let mut out = vec![3.0f32; header.count];
            if decoder.decode_into(data, &mut out).is_err() {
                assert!(out.iter().all(|&v| v == 3.0), "failed decode_into wrote its output");
            }
            let mut acc = vec![1.0f32; header.count];
            if decoder.decode_add(data, &mut acc, -2.0).is_err() {
                assert!(acc.iter().all(|&v| v == 1.0), "failed decode_add wrote its output");
            }
        }
        if header.total <= LIMIT as u64 {
            if let Ok(mut assembler) = ChunkAssembler::with_options(header.total as usize, strict) {
                let first = assembler.accept(data).is_ok();
                let second = assembler.accept(data);
                assert!(!(first && second.is_ok() && header.count > 0), "a repeated chunk was accepted");
            }
        }
    }
});
