//! Gossip averaging on whole swarms (loopback, one process).
//!
//! - 16 peers, random vectors: the consensus distance shrinks geometrically over rounds for
//!   every topology, and the live peers' weighted mean stays put (codecs none, f16, u8).
//! - Killing 4 of 16 peers mid-round stalls nobody; the survivors converge to the mean of the
//!   survivors' mass.
//! - A peer 10x slower than the others does not slow their rounds.
//! - Digits: local SGD (DiLoCo) with gossip against group averaging.

use std::time::Duration;

use starling_averager::gossip::{ExchangeOutcome, GossipConfig, Topology};
use starling_node::{cluster::LocalCluster, NodeConfig};
use starling_tests::{bounded, init_tracing, GossipSwarm};
use starling_training::{Averaging, CollaborativeOptimizer, Mode, Sgd, SgdConfig};

#[path = "support/digits.rs"]
mod digits;

const PEERS: usize = 16;
const LEN: usize = 2000;

fn config(prefix: &str, topology: Topology, codec: &str) -> GossipConfig {
    let mut cfg = GossipConfig::new(prefix)
        .topology(topology)
        .codec(codec.parse().unwrap());
    cfg.request_timeout = Duration::from_secs(2);
    cfg.exchange_timeout = Duration::from_secs(4);
    cfg.membership_refresh = Duration::from_millis(500);
    cfg
}

/// Per-round contraction of the consensus distance, asserted as `(D_R / D_0)^(1/R) <= bound`
/// over R = 8 rounds after a warm-up round (the first round also declares everyone; `D_0` is
/// measured once every peer sees all 16). Bounds come from theory, with room for the
/// asynchrony (busy neighbours retried or skipped):
///
/// - ring: the cycle's slowest mode shrinks by about `(1 - (1 - cos(2 pi / 16)))^2 = 0.85` a
///   round when each edge is averaged once; bound 0.9 (measured ~0.75 over 8 rounds).
/// - exponential: log2(16) = 4 exchanges per peer and round at distances 1, 2, 4, 8, the
///   hypercube's exact averaging when matched; bound 0.1 (measured < 1e-3).
/// - random-2: 32 uniformly random pairwise averagings a round contract by
///   `(1 - 1/15)^32 = 0.11` in expectation (Boyd et al. 2006); bound 0.3.
/// - one-peer exponential: 16 exchanges a round, structured; random pairs would give
///   `(1 - 1/15)^16 = 0.33`; bound 0.5 (measured ~0.25).
const CONTRACTION: [(&str, Topology, f64); 4] = [
    ("ring", Topology::Ring, 0.9),
    ("exp", Topology::Exponential, 0.1),
    ("random-2", Topology::RandomK(2), 0.3),
    ("one-peer-exp", Topology::OnePeerExponential, 0.5),
];
const ROUNDS: usize = 8;

/// Runs `rounds` rounds of `topology` on a fresh swarm over `cluster`; returns the consensus
/// distance after each round relative to the distance once membership settled, and the live
/// mean's relative drift over the whole run (from the initial vectors).
async fn run(
    cluster: &LocalCluster,
    prefix: &str,
    topology: Topology,
    codec: &str,
    rounds: usize,
) -> (Vec<f64>, f64) {
    let mut swarm = GossipSwarm::start(cluster, &config(prefix, topology, codec), LEN, 1)
        .await
        .unwrap();
    let start = swarm.consensus_of_vectors();
    // The first round declares everyone; then every peer reads all 16.
    for (i, r) in swarm.round().await {
        r.unwrap_or_else(|e| panic!("peer {i}: {e}"));
    }
    assert!(swarm.settle_membership(50).await, "membership settles");
    let d0 = swarm.consensus().await.distance;
    let mut ratios = Vec::new();
    for _ in 0..rounds {
        for (i, r) in swarm.round().await {
            r.unwrap_or_else(|e| panic!("peer {i}: {e}"));
        }
        ratios.push(swarm.consensus().await.distance / d0);
    }
    let end = swarm.consensus().await;
    swarm.shutdown().await;
    (ratios, end.mean_error(&start))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consensus_contracts_for_every_topology_and_the_mean_stays() {
    init_tracing();
    bounded(Duration::from_secs(240), async {
        let cluster = LocalCluster::start(PEERS, NodeConfig::default()).await.unwrap();
        for (name, topology, bound) in CONTRACTION {
            let (ratios, drift) = run(&cluster, name, topology, "none", ROUNDS).await;
            let rate = ratios[ROUNDS - 1].powf(1.0 / ROUNDS as f64);
            eprintln!(
                "{name}: per-round contraction {rate:.3} (bound {bound}); distance/D0 {}; mean drift {drift:.1e}",
                fmt(&ratios)
            );
            assert!(rate <= bound, "{name}: contraction {rate:.3} per round, bound {bound}");
            assert!(drift < 1e-5, "{name}: the mean moved by {drift:e} (relative)");
        }
        // Quantized codecs: each side applies the same decoded difference, so the mean holds
        // to float rounding here too (bound asserted: 1e-5, as for `none`); the consensus
        // reaches the codec's floor instead of zero.
        for codec in ["f16", "u8"] {
            let (ratios, drift) =
                run(&cluster, codec, Topology::OnePeerExponential, codec, ROUNDS).await;
            let rate = ratios[ROUNDS - 1].powf(1.0 / ROUNDS as f64);
            eprintln!(
                "one-peer-exp, codec {codec}: contraction {rate:.3}; distance/D0 {}; mean drift {drift:.1e}",
                fmt(&ratios)
            );
            assert!(drift < 1e-5, "{codec}: the mean moved by {drift:e} (relative)");
            assert!(ratios[ROUNDS - 1] < 1e-2, "{codec}: consensus {}", fmt(&ratios));
        }
        cluster.shutdown().await;
    })
    .await;
}

fn fmt(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.1e}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// 16 peers gossip (one-peer exponential); in round 3, four of them shut down (averager and
/// node) while the others are mid-round. Every survivor finishes every round (the test is
/// bounded; a step never waits past its deadline, and failed neighbours are backed off and
/// left out of the graph), each fails at most a few exchanges, and the survivors converge to
/// the weighted mean of what they held once the dead were gone, which stays put (1e-5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_four_of_sixteen_stalls_nobody_and_survivors_converge() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let cluster = LocalCluster::start(PEERS, NodeConfig::default()).await.unwrap();
        let mut cfg = config("kill", Topology::OnePeerExponential, "none");
        // A back-off as long as the test's bound: each survivor tries each dead peer at most
        // once, whatever the timing (with the default 1 s, doubling, it would retry a dead
        // peer after 1, 3, 7 s ... until its declaration's TTL runs out).
        cfg.backoff = Duration::from_secs(120);
        cfg.max_backoff = cfg.backoff;
        let mut swarm = GossipSwarm::start(&cluster, &cfg, LEN, 2).await.unwrap();
        for _ in 0..3 {
            swarm.round().await;
        }
        assert!(swarm.settle_membership(50).await);
        let doomed = [3usize, 7, 8, 13];
        // The doomed peers' averagers leave the swarm (by value) and shut down, with their
        // nodes, while the survivors step.
        let dying: Vec<_> = doomed
            .iter()
            .map(|&i| (swarm.peers[i].take().unwrap(), cluster.nodes[i].clone()))
            .collect();
        let kill = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            for (averager, node) in dying {
                node.shutdown().await;
                averager.shutdown().await;
            }
        };
        let (reports, ()) = futures::join!(swarm.round(), kill);
        for (i, r) in reports {
            r.unwrap_or_else(|e| panic!("survivor {i}: {e}"));
        }
        let after_kill = swarm.consensus().await;
        let mut failed = vec![0usize; PEERS];
        let mut averaged = vec![0usize; PEERS];
        for _ in 0..10 {
            for (i, r) in swarm.round().await {
                let r = r.unwrap_or_else(|e| panic!("survivor {i}: {e}"));
                for e in r.exchanges.iter().chain(&r.served) {
                    if e.averaged() {
                        averaged[i] += 1;
                    } else if matches!(e.outcome, ExchangeOutcome::Failed(_)) {
                        failed[i] += 1;
                        assert!(doomed.iter().any(|&d| cluster.nodes[d].peer_id() == e.peer));
                    }
                }
            }
        }
        let end = swarm.consensus().await;
        let drift = end.mean_error(&after_kill);
        eprintln!(
            "survivors: distance {:.2e} -> {:.2e}; mean drift {drift:.1e}; failed exchanges {failed:?}; averaged {averaged:?}",
            after_kill.distance, end.distance
        );
        for i in swarm.live() {
            assert!(failed[i] <= doomed.len(), "peer {i} kept trying the dead: {failed:?}");
            assert!(averaged[i] >= 5, "peer {i} averaged too little: {averaged:?}");
        }
        assert!(drift < 1e-5, "the survivors' mean moved by {drift:e}");
        assert!(
            end.distance < after_kill.distance * 1e-2,
            "survivors converge: {:.2e} -> {:.2e}",
            after_kill.distance,
            end.distance
        );
        swarm.shutdown().await;
        cluster.shutdown().await;
    })
    .await;
}

/// 8 peers gossip freely (no rounds in step): each computes for a while, then steps; one
/// computes 10x longer. Counted within the same run, the fast peers complete several times
/// more rounds than the slow one (if they waited on it they would complete as many), and the
/// slow peer is still averaged with (it answers exchanges while it computes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_times_slower_peer_does_not_slow_the_others() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        const N: usize = 8;
        const SLOW: usize = 5;
        const SLOW_ROUNDS: usize = 6;
        let cluster = LocalCluster::start(N, NodeConfig::default()).await.unwrap();
        let cfg = config("slow", Topology::OnePeerExponential, "none");
        let mut swarm = GossipSwarm::start(&cluster, &cfg, LEN, 3).await.unwrap();
        swarm.round().await;
        assert!(swarm.settle_membership(50).await);
        let start = swarm.consensus().await;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let compute = Duration::from_millis(20);
        let peers = swarm
            .peers
            .iter()
            .zip(swarm.vectors.iter_mut())
            .zip(&swarm.weights)
            .enumerate()
            .map(|(i, ((p, v), w))| {
                let p = p.as_ref().unwrap();
                let stop = &stop;
                async move {
                    let pause = if i == SLOW { compute * 10 } else { compute };
                    let (mut rounds, mut averaged) = (0usize, 0usize);
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        tokio::time::sleep(pause).await; // "compute"
                        let deadline = std::time::Instant::now() + Duration::from_secs(10);
                        let r = p
                            .step(&mut [&mut v[..]], *w as f32, deadline)
                            .await
                            .unwrap();
                        averaged += r.averaged_with().len();
                        rounds += 1;
                        if i == SLOW && rounds == SLOW_ROUNDS {
                            stop.store(true, std::sync::atomic::Ordering::Release);
                        }
                    }
                    (rounds, averaged)
                }
            });
        let counts = futures::future::join_all(peers).await;
        let end = swarm.consensus().await;
        eprintln!("rounds and exchanges per peer (peer {SLOW} is slow): {counts:?}");
        let slow = counts[SLOW].0;
        for (i, (rounds, _)) in counts.iter().enumerate() {
            if i != SLOW {
                assert!(
                    *rounds >= 3 * slow,
                    "peer {i}: {rounds} rounds against the slow peer's {slow}"
                );
            }
        }
        assert!(
            counts[SLOW].1 >= SLOW_ROUNDS,
            "the slow peer was averaged with: {counts:?}"
        );
        assert!(end.mean_error(&start) < 1e-5);
        swarm.shutdown().await;
        cluster.shutdown().await;
    })
    .await;
}

/// What one DiLoCo run on digits gave.
#[derive(Debug, Clone, Copy)]
struct DigitsRow {
    /// Validation accuracy, the mean over the peers' final parameters.
    accuracy: f64,
    /// Averaging rounds (outer steps) per peer.
    rounds: usize,
    /// Bytes sent per peer, the mean over the peers (every exchange or all-reduce byte).
    bytes_per_peer: u64,
}

/// DiLoCo (H = 10, the inner and outer optimizers of `training_collaborative.rs`) on digits,
/// 4 peers, `batches` local batches of 16 each, averaging in groups or through gossip
/// (one-peer exponential graph, codec none).
async fn diloco_digits(gossip: bool, batches: usize, run: &str) -> DigitsRow {
    use digits::*;
    const H: u64 = 10;
    let (train, val) = digits();
    let cluster = LocalCluster::start(PEERS, NodeConfig::default())
        .await
        .unwrap();
    let train = &train;
    let runs = cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(p, node)| async move {
            let mut params = model();
            let inner = Sgd::new(SgdConfig::new(0.2).momentum(0.9), params.len()).unwrap();
            let mut cfg = collab_cfg(run, Mode::LocalSgd { inner_steps: H });
            cfg.state_averaging_every = None;
            cfg.error_feedback = false;
            if gossip {
                cfg.averaging =
                    Averaging::Gossip(config(run, Topology::OnePeerExponential, "none"));
            }
            let mut collab =
                CollaborativeOptimizer::new(node.clone(), Box::new(inner), &params, cfg)
                    .await
                    .unwrap();
            let (mut rounds, mut bytes) = (0usize, 0u64);
            for k in 0..batches {
                let values = params.params().to_vec();
                let idx = batch(train, p, k / BATCHES_PER_EPOCH, k % BATCHES_PER_EPOCH);
                gradient(&values, train, &idx, params.grads_mut());
                let r = collab.step(&mut params, BATCH as u64).await.unwrap();
                if r.stepped {
                    rounds += 1;
                }
                if let Some(round) = &r.round {
                    bytes += round.bytes_sent;
                }
            }
            if let Some(g) = collab.gossip() {
                bytes = g.totals().bytes_sent;
            }
            collab.shutdown().await;
            (params.params().to_vec(), rounds, bytes)
        });
    let results = futures::future::join_all(runs).await;
    cluster.shutdown().await;
    let n = results.len() as f64;
    DigitsRow {
        accuracy: results.iter().map(|(p, ..)| accuracy(p, &val)).sum::<f64>() / n,
        rounds: results[0].1,
        bytes_per_peer: (results.iter().map(|r| r.2 as f64).sum::<f64>() / n) as u64,
    }
}

/// Local SGD (DiLoCo, H = 10, 200 local batches per peer) averaging through gossip on the
/// one-peer exponential graph reaches the accuracy of the same run averaging in groups, within
/// 2 points; both learn (> 0.9). Bytes per peer are printed for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diloco_with_gossip_matches_group_averaging_on_digits() {
    init_tracing();
    bounded(Duration::from_secs(300), async {
        const BATCHES: usize = 200;
        let group = diloco_digits(false, BATCHES, "digits-group").await;
        let gossip = diloco_digits(true, BATCHES, "digits-gossip").await;
        eprintln!("| averaging | accuracy | rounds | bytes sent per peer |");
        eprintln!("|---|---|---|---|");
        for (name, r) in [("group", group), ("gossip, one-peer exp.", gossip)] {
            eprintln!(
                "| {name} | {:.3} | {} | {} |",
                r.accuracy, r.rounds, r.bytes_per_peer
            );
        }
        assert!(group.accuracy > 0.9, "the baseline learned: {group:?}");
        assert_eq!(gossip.rounds, BATCHES / 10);
        assert!(
            (gossip.accuracy - group.accuracy).abs() <= 0.02,
            "gossip {:.3} against groups {:.3}",
            gossip.accuracy,
            group.accuracy
        );
    })
    .await;
}

/// Background mode: 6 peers gossip continuously on shared buffers while their "training"
/// adds a small step to every value now and then (the same on every peer, so the mean moves by
/// a known amount). Once every loop has run 10 rounds (counted, not timed) they stop cleanly:
/// the peers have converged and the mean is the start's plus the steps taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_loops_converge_on_shared_buffers_and_stop_cleanly() {
    use starling_averager::gossip::{
        consensus_distance, weighted_mean, GossipAverager, GossipBuffer,
    };
    init_tracing();
    bounded(Duration::from_secs(60), async {
        const N: usize = 6;
        const STEPS: usize = 5;
        let cluster = LocalCluster::start(N, NodeConfig::default()).await.unwrap();
        let cfg = config("background", Topology::RandomK(1), "none");
        let mut peers = Vec::new();
        for (i, node) in cluster.nodes.iter().enumerate() {
            let g = GossipAverager::new(node.clone(), cfg.clone())
                .await
                .unwrap();
            let v = starling_compression::synthetic::normal(LEN, 100 + i as u64);
            let buf = GossipBuffer::new(v, 1.0 + i as f32).unwrap();
            peers.push((g, buf));
        }
        let measure = |peers: &[(GossipAverager, GossipBuffer)]| {
            let vs: Vec<Vec<f32>> = peers.iter().map(|(_, b)| b.snapshot()).collect();
            let refs: Vec<&[f32]> = vs.iter().map(|v| &v[..]).collect();
            let ws: Vec<f64> = peers.iter().map(|(_, b)| f64::from(b.weight())).collect();
            (weighted_mean(&refs, &ws), consensus_distance(&refs, &ws))
        };
        let (mean0, d0) = measure(&peers);
        let handles: Vec<_> = peers
            .iter()
            .map(|(g, b)| {
                g.start_background(b.clone(), Duration::from_millis(10))
                    .unwrap()
            })
            .collect();
        for (g, _) in &peers {
            let mut tries = 0;
            while g.refresh_members().await.unwrap() < N && tries < 50 {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let start_rounds: Vec<u64> = handles.iter().map(|h| h.rounds()).collect();
        let mut steps = 0;
        while handles
            .iter()
            .zip(&start_rounds)
            .any(|(h, s)| h.rounds() < s + 10)
        {
            if steps < STEPS {
                for (_, b) in &peers {
                    b.update(|v| v.iter_mut().for_each(|x| *x += 0.01));
                }
                steps += 1;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for _ in steps..STEPS {
            for (_, b) in &peers {
                b.update(|v| v.iter_mut().for_each(|x| *x += 0.01));
            }
        }
        for h in handles {
            h.stop().await;
        }
        // Exchanges answered after the loops stopped are over once each lock is free.
        for (g, _) in &peers {
            g.values().await;
        }
        let (mean1, d1) = measure(&peers);
        let shift = 0.01 * STEPS as f64;
        let err = mean0
            .iter()
            .zip(&mean1)
            .map(|(a, b)| (a + shift - b).powi(2))
            .sum::<f64>()
            .sqrt()
            / mean0
                .iter()
                .map(|a| (a + shift).powi(2))
                .sum::<f64>()
                .sqrt();
        eprintln!("background: distance {d0:.2e} -> {d1:.2e}, mean error {err:.1e}");
        assert!(err < 1e-5, "mean error {err:e}");
        assert!(d1 < d0 * 1e-2, "distance {d0:.2e} -> {d1:.2e}");
        // After stop, the buffers are no longer served: a step works again on the averager.
        let mut v = vec![0.0f32; LEN];
        let r = peers[0]
            .0
            .step(
                &mut [&mut v[..]],
                1.0,
                std::time::Instant::now() + Duration::from_secs(5),
            )
            .await;
        assert!(r.is_ok(), "{r:?}");
        for (g, _) in peers {
            g.shutdown().await;
        }
        cluster.shutdown().await;
    })
    .await;
}
