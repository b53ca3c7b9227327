//! Decoders face untrusted bytes: random and mutated frames must give an error or a well-formed result, never a
//! panic, and claims of huge sizes are refused before anything is allocated.

use proptest::prelude::*;
use starling_compression::{
    decode, decode_add, decode_into, encode, split_chunks, ChunkAssembler, ChunkHeader, Codec,
    DecodeOptions, Decoder, EncodeOptions, Error, NonFinite, HEADER_LEN, MAGIC, MAX_ELEMENTS,
};

const LIMIT: usize = 1 << 16;

fn limits() -> DecodeOptions {
    DecodeOptions::default().with_max_elements(LIMIT)
}

/// Decodes `bytes` every way there is; checks that a success is well-formed.
fn decode_every_way(bytes: &[u8]) {
    for nonfinite in [NonFinite::Reject, NonFinite::Allow] {
        let opts = limits().with_nonfinite(nonfinite);
        if let Ok(values) = decode(bytes, &opts) {
            let header = ChunkHeader::parse(bytes).expect("a decoded frame has a valid header");
            assert_eq!(values.len(), header.count);
            assert!(header.count <= LIMIT);
            if nonfinite == NonFinite::Reject {
                assert!(values.iter().all(|v| v.is_finite()));
            }
        }
    }
    if let Ok(header) = ChunkHeader::parse_prefix(bytes) {
        if header.count <= LIMIT {
            let mut out = vec![7.0f32; header.count];
            let before = out.clone();
            match decode_into(bytes, &mut out) {
                Ok(_) => {}
                Err(_) => assert_eq!(
                    out, before,
                    "a failed decode_into must not touch its output"
                ),
            }
            let mut acc = vec![1.0f32; header.count];
            if decode_add(bytes, &mut acc, 0.5).is_err() {
                assert!(
                    acc.iter().all(|&v| v == 1.0),
                    "a failed decode_add must not touch its output"
                );
            }
            if header.total <= LIMIT as u64 {
                if let Ok(mut assembler) =
                    ChunkAssembler::with_options(header.total as usize, limits())
                {
                    let _ = assembler.accept(bytes);
                    let _ = assembler.accept(bytes);
                }
            }
        }
        let mut wrong = vec![0f32; header.count.min(LIMIT) + 1];
        assert!(Decoder::new(limits())
            .decode_into(bytes, &mut wrong)
            .is_err());
    }
}

fn valid_frame() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(Codec::WIRE.to_vec()),
        prop::collection::vec(-100.0f32..100.0, 0..6000),
        any::<bool>(),
    )
        .prop_map(|(codec, x, zstd)| {
            let opts = if zstd {
                EncodeOptions::default().with_zstd(1)
            } else {
                EncodeOptions::default()
            };
            encode(codec, &x, &opts).expect("encode")
        })
}

#[derive(Debug, Clone)]
enum Mutation {
    Set(prop::sample::Index, u8),
    Xor(prop::sample::Index, u8),
    Truncate(prop::sample::Index),
    Extend(Vec<u8>),
    /// Overwrite a header field with an extreme value.
    Field(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(i, b)| Mutation::Xor(i, b)),
        any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        prop::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Extend),
        (
            prop::sample::select(vec![8usize, 16, 24, 32, 36, 40]),
            prop::sample::select(vec![
                0u64,
                1,
                0xff,
                0xffff_ffff,
                u64::MAX,
                (MAX_ELEMENTS as u64) + 1,
                1 << 40
            ])
        )
            .prop_map(|(at, v)| Mutation::Field(at, v)),
    ]
}

fn apply(frame: &mut Vec<u8>, m: &Mutation) {
    if frame.is_empty() {
        return;
    }
    match m {
        Mutation::Set(i, b) => {
            let i = i.index(frame.len());
            frame[i] = *b;
        }
        Mutation::Xor(i, b) => {
            let i = i.index(frame.len());
            frame[i] ^= *b;
        }
        Mutation::Truncate(i) => {
            let i = i.index(frame.len());
            frame.truncate(i);
        }
        Mutation::Extend(bytes) => frame.extend_from_slice(bytes),
        Mutation::Field(at, v) => {
            let width = if *at >= 32 { 4 } else { 8 };
            if frame.len() >= at + width {
                frame[*at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..3000)) {
        decode_every_way(&bytes);
    }

    #[test]
    fn random_bodies_behind_valid_magic_never_panic(
        head in prop::collection::vec(any::<u8>(), 44),
        body in prop::collection::vec(any::<u8>(), 0..3000),
    ) {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&head);
        bytes[4] = 1;
        bytes[5] %= 8;
        bytes.extend_from_slice(&body);
        decode_every_way(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic(frame in valid_frame(), mutations in prop::collection::vec(mutation(), 1..4)) {
        let mut frame = frame;
        for m in &mutations {
            apply(&mut frame, m);
        }
        decode_every_way(&frame);
    }

    #[test]
    fn mutated_chunks_never_panic_the_assembler(
        x in prop::collection::vec(-1.0f32..1.0, 1..5000),
        codec in prop::sample::select(Codec::WIRE.to_vec()),
        victim in any::<prop::sample::Index>(),
        m in mutation(),
    ) {
        let chunks: Vec<Vec<u8>> = split_chunks(codec, &x, 2048, &EncodeOptions::default())
            .expect("split").collect::<Result<_, _>>().expect("encode");
        let v = victim.index(chunks.len());
        let mut assembler = ChunkAssembler::new(x.len()).expect("assembler");
        for (i, c) in chunks.iter().enumerate() {
            let mut c = c.clone();
            if i == v {
                apply(&mut c, &m);
            }
            let _ = assembler.accept(&c);
        }
        prop_assert!(assembler.received() <= x.len());
        let (_, ranges) = assembler.into_parts();
        prop_assert!(ranges.windows(2).all(|w| w[0].end < w[1].start));
    }
}

fn header_bytes(
    codec: u8,
    count: u64,
    total: u64,
    params: u32,
    payload: u32,
    body: u32,
    flags: u8,
) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&[1, codec, flags, 0]);
    h.extend_from_slice(&count.to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    h.extend_from_slice(&total.to_le_bytes());
    h.extend_from_slice(&params.to_le_bytes());
    h.extend_from_slice(&payload.to_le_bytes());
    h.extend_from_slice(&body.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

#[test]
fn huge_claims_are_refused_before_allocation() {
    // 2^28 f32 declared, nothing sent.
    let max = MAX_ELEMENTS as u64;
    let frame = header_bytes(0, max, max, 0, (4 * max) as u32, (4 * max) as u32, 0);
    assert!(matches!(
        decode(&frame, &DecodeOptions::default()),
        Err(Error::Truncated { .. })
    ));
    // One more than the hard maximum.
    let frame = header_bytes(4, max + 1, max + 1, 1024, (max + 1) as u32, 0, 0);
    assert!(matches!(
        decode(&frame, &DecodeOptions::default()),
        Err(Error::TooManyElements { .. })
    ));
    // A tiny zstd body claiming 2^28 elements: refused by the caller's limit before decompressing.
    let frame = [
        header_bytes(0, max, max, 0, (4 * max) as u32, 9, 1),
        vec![0u8; 9],
    ]
    .concat();
    assert!(matches!(
        decode(&frame, &limits()),
        Err(Error::TooManyElements { .. })
    ));
}

#[test]
fn zstd_bodies_that_lie_are_refused() {
    let x: Vec<f32> = vec![0.0; 10_000];
    let frame = encode(Codec::None, &x, &EncodeOptions::default().with_zstd(3)).expect("encode");
    let header = ChunkHeader::parse(&frame).expect("header");
    assert!(header.zstd);
    // Same compressed body, but the header claims fewer elements: the body decompresses to too much.
    let small = header_bytes(0, 100, 100, 0, 400, header.body_len as u32, 1);
    let lying = [small, frame[HEADER_LEN..].to_vec()].concat();
    assert!(matches!(
        decode(&lying, &limits()),
        Err(Error::LengthMismatch { .. } | Error::Zstd(_))
    ));
    // A compressed body of garbage.
    let garbage = [header_bytes(0, 100, 100, 0, 400, 20, 1), vec![0xAB; 20]].concat();
    assert!(matches!(
        decode(&garbage, &limits()),
        Err(Error::Zstd(_) | Error::LengthMismatch { .. })
    ));
}

#[test]
fn bad_parameters_are_refused() {
    let x: Vec<f32> = (0..5000).map(|i| i as f32).collect();
    for (codec, at) in [
        (Codec::Uniform8Bit, HEADER_LEN + 40),
        (Codec::ScaledFloat16, HEADER_LEN + 4),
    ] {
        let mut frame = encode(codec, &x, &EncodeOptions::default()).expect("encode");
        frame[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(
            matches!(decode(&frame, &limits()), Err(Error::InvalidParameter(_))),
            "{codec}"
        );
    }
    let mut frame = encode(Codec::Blockwise8Bit, &x, &EncodeOptions::default()).expect("encode");
    frame[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
    assert!(matches!(
        decode(&frame, &limits()),
        Err(Error::InvalidParameter(_))
    ));
    let mut frame = encode(Codec::ScaledFloat16, &x, &EncodeOptions::default()).expect("encode");
    frame[HEADER_LEN + 4..HEADER_LEN + 8].copy_from_slice(&1e36f32.to_le_bytes());
    assert!(matches!(
        decode(&frame, &limits()),
        Err(Error::InvalidParameter(_))
    ));
}
