//! The fast lane under a flood from a non-member: 200 idle connections that never send a token
//! and 200 that send garbage, kept up (each reconnects when the listener ends it) on one
//! member's lane port while four members average. Every transfer, to the flooded member too,
//! must still use the lane, and every result must be exact.
//!
//! The flood comes from 127.0.0.2-127.0.0.11 (loopback is a /8), the members from 127.0.0.1, so
//! that the per-IP bound applies to the flood only. Ten IPs of twenty idle connections fill
//! every place the listener gives strangers, so the members get in through the room kept for
//! IPs with pending offers.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use starling_averager::{Averager, AveragerConfig, RoundReport};
use starling_node::{cluster::LocalCluster, NodeConfig};
use starling_tests::{bounded, init_tracing, normal_vec, rel_error};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

const PEERS: usize = 4;
const SIZE: usize = 100_000;
const ROUNDS: usize = 3;
/// Idle and garbage connections to the flooded member's lane port.
const IDLE: usize = 200;
const GARBAGE: usize = 200;
/// Source IPs of the flood: 127.0.0.2 and up.
const FLOOD_IPS: usize = 10;
/// A flooder's pause after its connection ends, before the next (bounds the connection rate).
const RECONNECT_PAUSE: Duration = Duration::from_millis(200);
/// The member whose lane port is flooded.
const FLOODED: usize = 1;

/// What the flood did.
#[derive(Default)]
struct FloodStats {
    /// Connections the flood opened.
    opened: AtomicUsize,
    /// Idle connections the listener ended (a place's deadline, or no place).
    idle_ended: AtomicUsize,
}

/// Keeps one connection to `target` from `source` open (sending `junk` first, if any) until
/// the listener ends it, then opens another, until `stop`.
async fn flooder(
    source: IpAddr,
    target: SocketAddr,
    junk: Option<Vec<u8>>,
    stop: Arc<AtomicBool>,
    stats: Arc<FloodStats>,
) {
    while !stop.load(Ordering::Relaxed) {
        let socket = TcpSocket::new_v4().expect("a socket");
        socket
            .bind(SocketAddr::new(source, 0))
            .expect("a loopback source address");
        if let Ok(mut tcp) = socket.connect(target).await {
            stats.opened.fetch_add(1, Ordering::Relaxed);
            if let Some(junk) = &junk {
                let _ = tcp.write_all(junk).await;
            }
            let mut buf = [0u8; 64];
            // Held until the listener ends it (or the test stops).
            loop {
                tokio::select! {
                    r = tcp.read(&mut buf) => match r {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    },
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                    }
                }
            }
            if junk.is_none() {
                stats.idle_ended.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}

fn avg_cfg() -> AveragerConfig {
    let mut c = AveragerConfig::new("flood");
    c.codec = "none".parse().unwrap();
    c.target_group_size = PEERS;
    c.min_group_size = PEERS;
    c.matchmaking_time = Duration::from_secs(8);
    c
}

/// Reducers other than this peer that it sent a span to.
fn transfers(report: &RoundReport) -> usize {
    let me = report.group[report.my_index];
    let mut reducers: Vec<_> = report
        .spans
        .iter()
        .map(|s| s.reducer)
        .filter(|r| *r != me)
        .collect();
    reducers.sort();
    reducers.dedup();
    reducers.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_keep_their_lanes_under_a_flood_of_idle_and_garbage_connections() {
    init_tracing();
    bounded(Duration::from_secs(180), async {
        let node_cfg = NodeConfig::default().with_request_timeout(Duration::from_secs(5));
        let cluster = LocalCluster::start(PEERS, node_cfg).await.unwrap();
        let mut averagers = Vec::new();
        for n in &cluster.nodes {
            averagers.push(Averager::new(n.clone(), avg_cfg()).await.unwrap());
        }
        let target = SocketAddr::from((
            [127, 0, 0, 1],
            cluster.nodes[FLOODED].fast_lane_port().unwrap(),
        ));

        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(FloodStats::default());
        let mut flood = Vec::new();
        for i in 0..IDLE + GARBAGE {
            let source = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + (i % FLOOD_IPS) as u8));
            let junk = (i >= IDLE).then(|| {
                normal_vec(1024, i as u64)
                    .iter()
                    .map(|x| x.to_bits() as u8)
                    .collect()
            });
            flood.push(tokio::spawn(flooder(
                source,
                target,
                junk,
                stop.clone(),
                stats.clone(),
            )));
        }
        // Every flooder connected at least once before the rounds begin.
        while stats.opened.load(Ordering::Relaxed) < IDLE + GARBAGE {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let data: Vec<Vec<f32>> = (0..PEERS)
            .map(|p| normal_vec(SIZE, 100 + p as u64))
            .collect();
        let mean: Vec<f32> = (0..SIZE)
            .map(|k| (data.iter().map(|d| f64::from(d[k])).sum::<f64>() / PEERS as f64) as f32)
            .collect();
        for round in 0..ROUNDS {
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut tensors = data.clone();
            let steps = averagers
                .iter()
                .zip(tensors.iter_mut())
                .map(|(a, t)| async move { a.step(&mut [&mut t[..]], 1.0, deadline).await });
            let reports = futures::future::join_all(steps).await;
            for (p, (report, got)) in reports.into_iter().zip(&tensors).enumerate() {
                let report = report.unwrap_or_else(|e| panic!("round {round} peer {p}: {e}"));
                assert_eq!(report.group.len(), PEERS, "round {round} peer {p}");
                let sent = transfers(&report);
                assert!(sent >= 1, "round {round} peer {p} sent no span");
                assert_eq!(
                    report.fast_lane_transfers, sent,
                    "round {round} peer {p}: not every transfer used the fast lane"
                );
                let err = rel_error(got, &mean);
                assert!(err <= 1e-6, "round {round} peer {p}: rel error {err}");
            }
        }

        stop.store(true, Ordering::Relaxed);
        for f in flood {
            f.await.unwrap();
        }
        // The flood was real: listeners ended idle connections (a place's deadline, or none).
        assert!(stats.idle_ended.load(Ordering::Relaxed) > 0);
        eprintln!(
            "flood: {} connections opened, {} idle ones ended by the listeners",
            stats.opened.load(Ordering::Relaxed),
            stats.idle_ended.load(Ordering::Relaxed)
        );
        for a in averagers {
            a.shutdown().await;
        }
        cluster.shutdown().await;
    })
    .await;
}
