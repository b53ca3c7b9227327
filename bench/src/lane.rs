//! `starling bench lane`: one-way throughput between two peers on 127.0.0.1, over a fast lane
//! and over a libp2p stream, with the same framing around the bytes.

use std::time::Instant;

use anyhow::{ensure, Context, Result};
use clap::Args;
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use serde::Serialize;
use starling_node::{Node, NodeConfig, StreamProtocol};

const PROTOCOL: StreamProtocol = StreamProtocol::new("/starling/bench/lane/1");
/// Bytes per write (like one averaging chunk).
const WRITE: usize = 1 << 20;

/// The flags of `starling bench lane`.
#[derive(Args, Debug)]
pub struct LaneArgs {
    /// MiB sent one way per transport.
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// Transfers at once (one lane, or one libp2p stream, each).
    #[arg(long, default_value_t = 1)]
    streams: usize,
}

#[derive(Serialize)]
struct LaneBench {
    bench: &'static str,
    mib: usize,
    streams: usize,
    fast_lane_gb_s: f64,
    libp2p_stream_gb_s: f64,
}

/// Serves one transfer: answers the sender's hello, reads to the end, then acknowledges with one
/// byte (so the sender times delivery, not just its writes).
async fn sink<S: futures::AsyncRead + futures::AsyncWrite + Unpin>(mut s: S) -> Result<u64> {
    let mut hello = [0u8; 1];
    s.read_exact(&mut hello).await?;
    s.write_all(&[1]).await?;
    s.flush().await?;
    let mut buf = vec![0u8; WRITE];
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    s.write_all(&[2]).await?;
    s.close().await?;
    Ok(total)
}

/// Says hello and waits for the answer: the stream is set up before the clock starts.
async fn ready<S: futures::AsyncRead + futures::AsyncWrite + Unpin>(mut s: S) -> Result<S> {
    s.write_all(&[0]).await?;
    s.flush().await?;
    let mut answer = [0u8; 1];
    s.read_exact(&mut answer).await?;
    Ok(s)
}

async fn source<S: futures::AsyncRead + futures::AsyncWrite + Unpin>(
    mut s: S,
    bytes: usize,
) -> Result<()> {
    let chunk: Vec<u8> = (0..WRITE).map(|i| (i * 7 + 1) as u8).collect();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(WRITE);
        s.write_all(&chunk[..n]).await?;
        left -= n;
    }
    s.close().await?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await.context("no acknowledgement")?;
    Ok(())
}

/// Opens `n` streams one at a time with `open` (retrying a few times: libp2p-stream drops
/// inbound streams that arrive while its accept queue is busy), each set up by [`ready`].
async fn open_ready<S, F, Fut>(n: usize, open: F) -> Result<Vec<S>>
where
    S: futures::AsyncRead + futures::AsyncWrite + Unpin,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<S>>,
{
    let mut out = Vec::new();
    for _ in 0..n {
        let mut last = None;
        for attempt in 0..5u64 {
            match async { ready(open().await?).await }.await {
                Ok(s) => {
                    out.push(s);
                    last = None;
                    break;
                }
                Err(e) => {
                    last = Some(e);
                    tokio::time::sleep(std::time::Duration::from_millis(20 * (attempt + 1))).await;
                }
            }
        }
        if let Some(e) = last {
            return Err(e.context("opening a stream"));
        }
    }
    Ok(out)
}

/// Serves the first `n` incoming streams, each with [`sink`] in its own task.
async fn serve_sinks<P, S>(
    mut incoming: impl futures::Stream<Item = (P, S)> + Unpin,
    n: usize,
) -> Vec<tokio::task::JoinHandle<Result<u64>>>
where
    S: futures::AsyncRead + futures::AsyncWrite + Unpin + Send + 'static,
{
    let mut tasks = Vec::new();
    while tasks.len() < n {
        let Some((_, s)) = incoming.next().await else {
            break;
        };
        tasks.push(tokio::spawn(sink(s)));
    }
    tasks
}

/// Runs `starling bench lane` and prints its JSON report.
pub async fn run(args: LaneArgs) -> Result<()> {
    ensure!(
        args.mib >= 1 && args.streams >= 1,
        "--mib and --streams must be at least 1"
    );
    let cfg = || NodeConfig::default().listen_on("/ip4/127.0.0.1/tcp/0".parse().expect("addr"));
    let server = Node::start(cfg()).await?;
    let client = Node::start(cfg()).await?;
    client.dial(server.listen_addrs().await?[0].clone()).await?;
    let per_stream = args.mib * (1 << 20) / args.streams;

    let mut lanes = server.accept_fast(PROTOCOL)?;
    let lanes = futures::stream::poll_fn(move |cx| lanes.poll_recv(cx));
    let lane_sinks = tokio::spawn(serve_sinks(lanes, args.streams));
    let ready_lanes = open_ready(args.streams, || async {
        Ok(client.open_fast(server.peer_id(), PROTOCOL).await?)
    })
    .await?;
    let t = Instant::now();
    futures::future::try_join_all(ready_lanes.into_iter().map(|l| source(l, per_stream))).await?;
    let fast = (per_stream * args.streams) as f64 / t.elapsed().as_secs_f64() / 1e9;

    let incoming = server.stream_control().accept(PROTOCOL)?;
    let p2p_sinks = tokio::spawn(serve_sinks(incoming, args.streams));
    let ready_streams = open_ready(args.streams, || async {
        Ok(client
            .stream_control()
            .open_stream(server.peer_id(), PROTOCOL)
            .await?)
    })
    .await?;
    let t = Instant::now();
    futures::future::try_join_all(ready_streams.into_iter().map(|s| source(s, per_stream))).await?;
    let p2p = (per_stream * args.streams) as f64 / t.elapsed().as_secs_f64() / 1e9;

    client.shutdown().await;
    server.shutdown().await;
    for t in lane_sinks.await?.into_iter().chain(p2p_sinks.await?) {
        let got = t.await??;
        ensure!(
            got == per_stream as u64,
            "a sink got {got} of {per_stream} bytes"
        );
    }
    let out = LaneBench {
        bench: "lane",
        mib: args.mib,
        streams: args.streams,
        fast_lane_gb_s: fast,
        libp2p_stream_gb_s: p2p,
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
