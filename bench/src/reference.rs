//! The plain-TCP reference butterfly of `starling bench allreduce --reference`: what the same
//! all-reduce costs with nothing but TCP connections kept open between rounds, equal spans, and
//! the same codec and chunk size. No encryption, no matchmaking, no fault tolerance: a floor to
//! measure Starling's per-round costs against, run by the same processes in the same run.
//!
//! Peer `i` of `n` reduces span `i` (equal spans). Each pair of peers shares one connection
//! (the lower index dials), over which each side sends, in order, its part of the other's span
//! and then the mean of its own span; both sides read in the same order, so one connection
//! carries both phases without any other framing than a length prefix per chunk.
//! Peers find each other's listening addresses through the DHT of the node they run anyway.

use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use starling_compression::{split_chunks, ChunkHeader, Codec, Decoder, EncodeOptions};
use starling_dht::now_ms;
use starling_node::{Multiaddr, Node};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, Instant};

/// DHT key under which the peers publish their reference listeners.
const RENDEZVOUS_KEY: &str = "bench-allreduce.reference";
/// Longest wait for the other peers' addresses and connections.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for one chunk while a round runs.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(60);

/// One peer's connections of the reference butterfly.
pub struct TcpButterfly {
    me: usize,
    n: usize,
    /// Connection to each other peer (`None` at `me`).
    links: Vec<Option<(OwnedReadHalf, OwnedWriteHalf)>>,
    codec: Codec,
    chunk_bytes: usize,
}

/// Equal spans of `len` elements among `n` peers.
fn span(len: usize, n: usize, i: usize) -> Range<usize> {
    len * i / n..len * (i + 1) / n
}

/// The IPv4 addresses in `addrs` (non-loopback first).
fn ips(addrs: &[Multiaddr]) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = addrs
        .iter()
        .filter_map(|a| {
            let text = a.to_string();
            let mut parts = text.split('/').skip(1);
            match (parts.next(), parts.next()) {
                (Some("ip4"), Some(ip)) => ip.parse::<IpAddr>().ok(),
                _ => None,
            }
        })
        .filter(|ip| !ip.is_unspecified())
        .collect();
    ips.sort_by_key(|ip| ip.is_loopback());
    ips.dedup();
    ips
}

impl TcpButterfly {
    /// Listens on every interface, publishes the listener under `RENDEZVOUS_KEY` through
    /// `node`, and connects to the other `n - 1` peers (each found the same way).
    pub async fn connect(
        node: &Node,
        me: usize,
        n: usize,
        codec: Codec,
        chunk_bytes: usize,
    ) -> Result<Self> {
        ensure!(me < n, "index {me} out of {n} peers");
        let listener = TcpListener::bind("0.0.0.0:0").await?;
        let port = listener.local_addr()?.port();
        let mine: Vec<String> = ips(&node.listen_addrs().await?)
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port).to_string())
            .collect();
        ensure!(!mine.is_empty(), "the node listens on no IPv4 address");
        let expires = now_ms() + 600_000;
        node.store(RENDEZVOUS_KEY, &me.to_string(), &mine, expires)
            .await
            .context("publishing the reference listener")?;
        let deadline = Instant::now() + SETUP_TIMEOUT;
        let peers = loop {
            let found: Vec<(String, Vec<String>, u64)> = node.get(RENDEZVOUS_KEY).await?;
            let mut peers: Vec<Option<Vec<String>>> = vec![None; n];
            for (k, v, _) in found {
                if let Some(slot) = k.parse::<usize>().ok().and_then(|i| peers.get_mut(i)) {
                    *slot = Some(v);
                }
            }
            if peers.iter().all(Option::is_some) {
                break peers;
            }
            ensure!(
                Instant::now() < deadline,
                "the other peers' reference listeners did not appear"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let mut links: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        // Dial the higher indices, accept the lower ones (each says who it is).
        for (j, addrs) in peers.iter().enumerate().skip(me + 1) {
            let addrs = addrs.as_deref().unwrap_or_default();
            let mut last = anyhow!("peer {j} published no address");
            for a in addrs {
                let Ok(addr) = a.parse::<SocketAddr>() else {
                    continue;
                };
                match timeout(Duration::from_secs(3), TcpStream::connect(addr)).await {
                    Ok(Ok(mut s)) => {
                        s.write_all(&(me as u32).to_le_bytes()).await?;
                        links[j] = Some(s);
                        break;
                    }
                    Ok(Err(e)) => last = anyhow!("connecting to peer {j} at {addr}: {e}"),
                    Err(_) => last = anyhow!("connecting to peer {j} at {addr}: timed out"),
                }
            }
            if links[j].is_none() {
                return Err(last);
            }
        }
        for _ in 0..me {
            let (mut s, _) = timeout(deadline - Instant::now(), listener.accept())
                .await
                .context("waiting for the lower peers to connect")??;
            let mut who = [0u8; 4];
            timeout(Duration::from_secs(3), s.read_exact(&mut who)).await??;
            let j = u32::from_le_bytes(who) as usize;
            ensure!(j < me && links[j].is_none(), "unexpected peer index {j}");
            links[j] = Some(s);
        }
        let links = links
            .into_iter()
            .map(|s| {
                s.map(|s| {
                    let _ = s.set_nodelay(true);
                    s.into_split()
                })
            })
            .collect();
        Ok(TcpButterfly {
            me,
            n,
            links,
            codec,
            chunk_bytes,
        })
    }

    /// One all-reduce of `data` (the same length on every peer): afterwards it holds the mean
    /// of all peers' data (through the codec). Returns the bytes this peer wrote.
    pub async fn round(&mut self, data: &mut [f32]) -> Result<u64> {
        let (me, n, len) = (self.me, self.n, data.len());
        let mine = span(len, n, me);
        let (codec, chunk_bytes) = (self.codec, self.chunk_bytes);
        // Phase 1: send every other peer its span of our data, receive our span from each.
        let data_ref: &[f32] = data;
        let phase1 = self.links.iter_mut().enumerate().filter_map(|(j, l)| {
            let (rd, wr) = l.as_mut()?;
            let out = &data_ref[span(len, n, j)];
            let want = mine.len();
            Some(async move {
                let mut got = vec![0.0f32; want];
                let (sent, ()) = tokio::try_join!(
                    write_span(wr, codec, out, chunk_bytes),
                    read_span(rd, &mut got, chunk_bytes),
                )?;
                Ok::<_, anyhow::Error>((sent, got))
            })
        });
        let parts = futures::future::try_join_all(phase1).await?;
        let mut sent: u64 = parts.iter().map(|(s, _)| s).sum();
        let mut mean: Vec<f64> = data[mine.clone()].iter().map(|x| f64::from(*x)).collect();
        for (_, part) in &parts {
            mean.iter_mut()
                .zip(part)
                .for_each(|(m, x)| *m += f64::from(*x));
        }
        let mean: Vec<f32> = mean.iter().map(|m| (m / n as f64) as f32).collect();
        // Phase 2: send our span's mean to everyone, receive every other span's mean.
        let mut rest: Vec<(usize, &mut [f32])> = Vec::new();
        let mut tail = data;
        let mut at = 0;
        for j in 0..n {
            let r = span(len, n, j);
            let (head, t) = tail.split_at_mut(r.end - at);
            tail = t;
            at = r.end;
            if j == me {
                head.copy_from_slice(&mean);
            } else {
                rest.push((j, head));
            }
        }
        let mean = &mean;
        let phase2 = self
            .links
            .iter_mut()
            .enumerate()
            .filter_map(|(j, l)| l.as_mut().map(|l| (j, l)))
            .zip(rest)
            .map(|((j, (rd, wr)), (k, out))| async move {
                ensure!(j == k, "span order");
                let (sent, ()) = tokio::try_join!(
                    write_span(wr, codec, mean, chunk_bytes),
                    read_span(rd, out, chunk_bytes),
                )?;
                Ok::<_, anyhow::Error>(sent)
            });
        sent += futures::future::try_join_all(phase2)
            .await?
            .into_iter()
            .sum::<u64>();
        Ok(sent)
    }
}

/// Writes `values` as length-prefixed chunks of the codec; returns the bytes written.
async fn write_span(
    wr: &mut OwnedWriteHalf,
    codec: Codec,
    values: &[f32],
    chunk_bytes: usize,
) -> Result<u64> {
    let mut chunks = split_chunks(codec, values, chunk_bytes, &EncodeOptions::default())?;
    let mut buf = Vec::new();
    let mut sent = 0u64;
    while let Some(h) = chunks.next_into(&mut buf) {
        h?;
        wr.write_all(&(buf.len() as u32).to_le_bytes()).await?;
        wr.write_all(&buf).await?;
        sent += 4 + buf.len() as u64;
    }
    wr.flush().await?;
    Ok(sent)
}

/// Reads chunks until all of `out` is filled (chunks in any order, each within bounds).
async fn read_span(rd: &mut OwnedReadHalf, out: &mut [f32], chunk_bytes: usize) -> Result<()> {
    let mut filled = 0usize;
    let mut buf = Vec::new();
    let mut decoder = Decoder::default();
    while filled < out.len() {
        let mut len = [0u8; 4];
        timeout(CHUNK_TIMEOUT, rd.read_exact(&mut len))
            .await
            .context("reading a chunk timed out")??;
        let len = u32::from_le_bytes(len) as usize;
        if len > chunk_bytes.max(1 << 16) {
            bail!("chunk of {len} bytes over the limit");
        }
        buf.resize(len, 0);
        timeout(CHUNK_TIMEOUT, rd.read_exact(&mut buf))
            .await
            .context("reading a chunk timed out")??;
        let h = ChunkHeader::parse(&buf)?;
        let at = usize::try_from(h.offset)?;
        ensure!(
            h.total == out.len() as u64 && at + h.count <= out.len(),
            "chunk out of range"
        );
        decoder.decode_into(&buf, &mut out[at..at + h.count])?;
        filled += h.count;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_the_vector_in_order() {
        for (len, n) in [(10, 4), (3, 4), (1_000_001, 7)] {
            let mut at = 0;
            for i in 0..n {
                let r = span(len, n, i);
                assert_eq!(r.start, at);
                at = r.end;
            }
            assert_eq!(at, len);
        }
    }
}
