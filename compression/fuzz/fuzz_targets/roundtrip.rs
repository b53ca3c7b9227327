//! Arbitrary f32 tensors through every codec: encoding must succeed on finite input (or name the non-finite
//! element), and decoding what was encoded must give back the right length, finite values and, for `none`, the
//! exact input.

#![no_main]

use libfuzzer_sys::fuzz_target;
use starling_compression::{
    decode, encode, split_chunks, ChunkAssembler, Codec, DecodeOptions, EncodeOptions, Error, NonFinite,
};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let x: Vec<f32> = rest.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let codec = Codec::WIRE[usize::from(selector) % Codec::WIRE.len()];
    let opts = if selector & 0x80 != 0 { EncodeOptions::default().with_zstd(1) } else { EncodeOptions::default() };
    let first_bad = x.iter().position(|v| !v.is_finite());
    match encode(codec, &x, &opts) {
        Ok(frame) => {
            assert!(first_bad.is_none(), "non-finite input accepted");
            let y = decode(&frame, &DecodeOptions::default());
            match (codec, y) {
                (_, Ok(y)) => {
                    assert_eq!(y.len(), x.len());
                    assert!(y.iter().all(|v| v.is_finite()));
                    if codec == Codec::None {
                        assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()));
                    }
                }
                (c, Err(e)) => panic!("{c}: own frame refused: {e}"),
            }
            if selector & 0x40 != 0 && !x.is_empty() {
                let max = codec.frame_len(1).unwrap_or(0) + usize::from(selector & 0x3f) * 64;
                if let Ok(chunks) = split_chunks(codec, &x, max, &opts) {
                    let mut assembler = ChunkAssembler::new(x.len()).expect("assembler");
                    let mut complete = true;
                    for chunk in chunks {
                        let chunk = match chunk {
                            Ok(chunk) => chunk,
                            // A chunk has its own statistics: its spread can exceed the whole tensor's.
                            Err(Error::OutOfRange { .. }) if codec == Codec::ScaledFloat16 => {
                                complete = false;
                                continue;
                            }
                            Err(e) => panic!("{codec}: chunk of finite input failed: {e}"),
                        };
                        assert!(chunk.len() <= max);
                        assembler.accept(&chunk).expect("own chunk");
                    }
                    assert_eq!(assembler.is_complete(), complete);
                }
            }
        }
        Err(Error::NonFiniteInput { index, .. }) => assert!(first_bad.is_some_and(|i| i <= index)),
        // Only extreme magnitudes (|x| near f32::MAX) are out of scaled-f16's range.
        Err(Error::OutOfRange { .. }) => assert_eq!(codec, Codec::ScaledFloat16),
        Err(e) => panic!("{codec}: encode failed on {} values: {e}", x.len()),
    }
    let lenient = EncodeOptions::default().with_nonfinite(NonFinite::Allow);
    if let Ok(frame) = encode(codec, &x, &lenient) {
        let y = decode(&frame, &DecodeOptions::default().with_nonfinite(NonFinite::Allow)).expect("own frame");
        assert_eq!(y.len(), x.len());
    }
});
