//! Criterion benchmarks of encode, decode and decode_add per codec on 2^20 random normal values (4 MiB of f32),
//! single-threaded. `cargo bench -p starling-compression`; throughput is reported in bytes of f32 per second.
//! For the 10^7-element table the CLI prints, see `examples/codec_report.rs`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use starling_compression::{encode_into, synthetic, Codec, DecodeOptions, Decoder, EncodeOptions};

const N: usize = 1 << 20;

fn codecs(c: &mut Criterion) {
    let x = synthetic::normal(N, 42);
    let opts = EncodeOptions::default();
    let mut group = c.benchmark_group("codec");
    group.throughput(Throughput::Bytes((N * 4) as u64));
    group.sample_size(20);
    for codec in Codec::WIRE {
        let mut frame = Vec::new();
        if let Err(e) = encode_into(codec, &x, &opts, &mut frame) {
            eprintln!("skipping {codec}: {e}");
            continue;
        }
        group.bench_function(BenchmarkId::new("encode", codec), |b| {
            b.iter(|| encode_into(codec, &x, &opts, &mut frame).map(|h| h.count))
        });
        let mut decoder = Decoder::new(DecodeOptions::default());
        let mut out = vec![0f32; N];
        group.bench_function(BenchmarkId::new("decode_into", codec), |b| {
            b.iter(|| decoder.decode_into(&frame, &mut out).map(|h| h.count))
        });
        group.bench_function(BenchmarkId::new("decode_add", codec), |b| {
            b.iter(|| decoder.decode_add(&frame, &mut out, 0.5).map(|h| h.count))
        });
    }
    group.finish();
}

criterion_group!(benches, codecs);
criterion_main!(benches);
