//! Prints one JSON line per codec, as `starling bench compression --size N` will:
//! `cargo run --release -p starling-compression --example codec_report -- [size] [iterations]`.

fn main() {
    let mut args = std::env::args().skip(1);
    let size = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000_000);
    let iterations = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    for report in starling_compression::bench::run_benchmark(size, iterations) {
        match serde_json::to_string(&report) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("cannot serialize report: {e}"),
        }
    }
}
