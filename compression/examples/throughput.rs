//! Single-thread encode/decode throughput of chosen codecs (best of N, into reused buffers):
//! `cargo run --release -p starling-compression --example throughput -- [size] [iterations] [codec,codec,..]`.

use std::time::Instant;

use starling_compression::{encode_into, synthetic, Codec, DecodeOptions, Decoder, EncodeOptions};

fn best(iterations: usize, mut f: impl FnMut()) -> f64 {
    (0..iterations)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() -> Result<(), starling_compression::Error> {
    let mut args = std::env::args().skip(1);
    let size: usize = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000_000);
    let iterations: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(10);
    let codecs: Vec<Codec> = match args.next() {
        Some(list) => list.split(',').map(str::parse).collect::<Result<_, _>>()?,
        None => Codec::WIRE.to_vec(),
    };
    let x = synthetic::normal(size, 1);
    let mb = (size * 4) as f64 / 1e6;
    let mut frame = Vec::new();
    let mut out = vec![0f32; size];
    for codec in codecs {
        for (label, eo, dopt) in [
            ("", EncodeOptions::default(), DecodeOptions::default()),
            (
                "parallel",
                EncodeOptions::default().with_parallel(true),
                DecodeOptions::default().with_parallel(true),
            ),
        ] {
            let mut decoder = Decoder::new(dopt);
            encode_into(codec, &x, &eo, &mut frame)?;
            let mut err = None;
            let enc = best(iterations, || {
                if let Err(e) = encode_into(codec, &x, &eo, &mut frame) {
                    err = Some(e);
                }
            });
            let dec = best(iterations, || {
                if let Err(e) = decoder.decode_into(&frame, &mut out) {
                    err = Some(e);
                }
            });
            let add = best(iterations, || {
                if let Err(e) = decoder.decode_add(&frame, &mut out, 0.5) {
                    err = Some(e);
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
            println!(
                "{:<11} {:<8} encode {:>7.0} MB/s  decode {:>7.0} MB/s  decode_add {:>7.0} MB/s",
                codec.name(),
                label,
                mb / enc,
                mb / dec,
                mb / add
            );
        }
    }
    Ok(())
}
