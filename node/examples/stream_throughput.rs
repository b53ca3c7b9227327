//! Measures raw stream throughput between two nodes in one process (TCP + noise + yamux on
//! 127.0.0.1): `cargo run --release -p starling-node --example stream_throughput -- [MiB] [streams]`.

use std::time::Instant;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use starling_node::{Node, NodeConfig, StreamProtocol};

const PROTO: StreamProtocol = StreamProtocol::new("/starling/example/throughput/1");

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let streams: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1);
    let local = NodeConfig::default().listen_on("/ip4/127.0.0.1/tcp/0".parse()?);
    let a = Node::start(local.clone()).await?;
    let addr = a.listen_addrs().await?[0].clone();
    let b = Node::start(local.bootstrap_from(addr)).await?;
    let mut incoming = a.stream_control().accept(PROTO)?;
    let reader = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..streams {
            let (_, mut s) = incoming.next().await.expect("stream");
            tasks.push(tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 20];
                let mut total = 0usize;
                loop {
                    let n = s.read(&mut buf).await.expect("read");
                    if n == 0 {
                        break total;
                    }
                    total += n;
                }
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.expect("task");
        }
        total
    });
    let per_stream = mib * (1 << 20) / streams;
    let start = Instant::now();
    let mut writers = Vec::new();
    for _ in 0..streams {
        let mut control = b.stream_control();
        let peer = a.peer_id();
        writers.push(tokio::spawn(async move {
            let mut s = control.open_stream(peer, PROTO).await.expect("open");
            let chunk = vec![7u8; 1 << 20];
            let mut left = per_stream;
            while left > 0 {
                let n = left.min(chunk.len());
                s.write_all(&chunk[..n]).await.expect("write");
                left -= n;
            }
            s.close().await.expect("close");
        }));
    }
    for w in writers {
        w.await?;
    }
    let total = reader.await?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"streams\":{streams},\"bytes\":{total},\"seconds\":{secs:.3},\"mib_per_s\":{:.1}}}",
        total as f64 / secs / (1 << 20) as f64
    );
    a.shutdown().await;
    b.shutdown().await;
    Ok(())
}
