//! Averaging across whole groups of peers on 127.0.0.1.

use std::time::{Duration, Instant};

use starling_averager::{
    Aggregation, Averager, AveragerConfig, AveragerError, AveragingMode, RoundReport, SpanOutcome,
};
use starling_node::{cluster::LocalCluster, Node, NodeConfig, PeerId};
use starling_tests::{
    bounded, exact_weighted_mean, init_tracing, normal_tensors, normal_vec, rel_error,
    AveragingSwarm, RoundCheck,
};

const SIZES: [usize; 3] = [1, 1000, 3_000_000];

fn node_cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(5))
}

fn avg_cfg(prefix: &str, codec: &str, group: usize) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.codec = codec.parse().unwrap();
    c.target_group_size = group;
    c.min_group_size = 2;
    c.matchmaking_time = Duration::from_secs(8);
    c
}

/// Each peer's tensors: random normal, different per peer.
fn peer_tensors(peer: usize) -> Vec<Vec<f32>> {
    normal_tensors(&SIZES, (peer * 10) as u64 + 1)
}

/// `||x - mean|| / ||mean||`: the size of the delta a codec encodes, relative to the mean.
fn delta_scale(x: &[f32], mean: &[f32]) -> f64 {
    rel_error(x, mean).max(1e-12)
}

/// One round on every peer of `swarm`; every step must succeed.
async fn run_round(
    swarm: &AveragingSwarm,
    tensors: &mut [Vec<Vec<f32>>],
    weights: &[f32],
) -> Vec<RoundReport> {
    let deadline = Instant::now() + Duration::from_secs(60);
    swarm
        .step_all(tensors, weights, deadline)
        .await
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|e| panic!("peer {i}'s round failed: {e}")))
        .collect()
}

/// Four peers average once; peer `no_lane`, if any, refuses fast lanes, so the others reach it
/// (and it reaches them) over libp2p streams.
async fn exact_mean_with(codec: &str, bound: f64, no_lane: Option<usize>) {
    let swarm = AveragingSwarm::start(4, node_cfg(), |i| {
        let mut cfg = avg_cfg("exact", codec, 4);
        cfg.fast_lane = no_lane != Some(i);
        cfg
    })
    .await
    .unwrap();
    let originals: Vec<Vec<Vec<f32>>> = (0..4).map(peer_tensors).collect();
    let weights = [1.0f32, 2.0, 0.5, 3.5];
    let expected = exact_weighted_mean(&originals, &weights);
    // Three rounds from the same data: the later ones reuse the fast lanes the first one made.
    for round in 0..3 {
        let mut tensors = originals.clone();
        let reports = run_round(&swarm, &mut tensors, &weights).await;
        check_round(
            codec, bound, no_lane, &swarm, &reports, &tensors, &originals, &expected,
        );
        for (p, report) in reports.iter().enumerate() {
            let warm = if round == 0 {
                0
            } else {
                report.fast_lane_transfers
            };
            assert_eq!(report.warm_lane_transfers, warm, "round {round}, peer {p}");
        }
    }
    swarm.shutdown().await;
}

/// Checks one round of [`exact_mean_with`]: groups, lanes, and every peer's values.
#[allow(clippy::too_many_arguments)]
fn check_round(
    codec: &str,
    bound: f64,
    no_lane: Option<usize>,
    swarm: &AveragingSwarm,
    reports: &[RoundReport],
    tensors: &[Vec<Vec<f32>>],
    originals: &[Vec<Vec<f32>>],
    expected: &[Vec<f32>],
) {
    for (p, report) in reports.iter().enumerate() {
        assert_eq!(report.group.len(), 4, "peer {p} was in a group of 4");
        assert!(report.failed_peers.is_empty());
        assert_eq!(report.averaged_fraction(), 1.0);
        // Every span sent to a lane-capable reducer went over a fast lane; the rest over libp2p.
        let me = report.group[report.my_index];
        let lane_less = no_lane.map(|i| swarm.nodes()[i].peer_id());
        let mut reducers: Vec<_> = report.spans.iter().map(|s| s.reducer).collect();
        reducers.dedup();
        let fast_capable = reducers
            .iter()
            .filter(|r| **r != me && Some(**r) != lane_less)
            .count();
        let expected_fast = if Some(me) == lane_less {
            0
        } else {
            fast_capable
        };
        assert_eq!(report.fast_lane_transfers, expected_fast, "peer {p}");
        for s in &report.spans {
            match &s.outcome {
                SpanOutcome::Averaged { contributors } => assert_eq!(contributors.len(), 4),
                other => panic!("span {:?} not averaged: {other:?}", s.range),
            }
        }
        // A lossy codec's error applies to what it encodes, chunk by chunk of the flattened
        // vector: the delta between a peer's own values and the mean. So lossy codecs are measured
        // over the whole vector against that scale; `none` must be exact on every tensor.
        if codec == "none" {
            for t in 0..SIZES.len() {
                let err = rel_error(&tensors[p][t], &expected[t]);
                assert!(
                    err < bound,
                    "{codec}: peer {p} tensor {t} rel error {err} >= {bound}"
                );
            }
        } else {
            let flat = |v: &[Vec<f32>]| v.concat();
            let exp = flat(expected);
            let err = rel_error(&flat(&tensors[p]), &exp) / delta_scale(&flat(&originals[p]), &exp);
            assert!(err < bound, "{codec}: peer {p} rel error {err} >= {bound}");
        }
    }
    // The exact codec hands back the mean itself: after a complete round every peer holds the
    // same bits (what a shared optimizer step needs).
    if codec == "none" {
        for p in 1..4 {
            assert!(
                tensors[p] == tensors[0],
                "peer {p}'s values differ from peer 0's"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_peers_hold_the_exact_weighted_mean_uncompressed() {
    init_tracing();
    bounded(
        Duration::from_secs(180),
        exact_mean_with("none", 1e-6, None),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_peers_average_within_codec_bounds() {
    init_tracing();
    bounded(Duration::from_secs(240), async {
        // One peer without a fast lane: the others fall back to libp2p streams for it.
        exact_mean_with("f16", 1e-3, Some(3)).await;
        exact_mean_with("u8", 3e-2, Some(0)).await;
        exact_mean_with("blockwise8", 1.2e-2, None).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_mode_peer_averages_without_listening() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // Every averager is configured as a `Node`: the one on the client-mode node takes part
        // as a `Client` by itself, since nobody could reach it to reduce.
        let cfg = || {
            let c = avg_cfg("client", "none", 4);
            assert_eq!(c.mode, AveragingMode::Node);
            c
        };
        let mut swarm = AveragingSwarm::start(3, node_cfg(), |_| cfg())
            .await
            .unwrap();
        let boot = swarm.nodes()[0].listen_addrs().await.unwrap()[0].clone();
        let client = Node::start(node_cfg().client(true).bootstrap_from(boot))
            .await
            .unwrap();
        assert!(client.listen_addrs().await.unwrap().is_empty());
        swarm.add_peer(client.clone(), cfg()).await.unwrap();
        let mut tensors: Vec<Vec<Vec<f32>>> =
            (0..4).map(|p| normal_tensors(&[10_000], p + 7)).collect();
        let weights = [1.0f32; 4];
        let expected = exact_weighted_mean(&tensors, &weights).remove(0);
        let reports = run_round(&swarm, &mut tensors, &weights).await;
        let client_report = &reports[3];
        assert_eq!(client_report.group.len(), 4);
        // The client reduced nothing: every span it reports belongs to another peer.
        assert!(client_report
            .spans
            .iter()
            .all(|s| s.reducer != client.peer_id()));
        for t in &tensors {
            assert!(rel_error(&t[0], &expected) < 1e-6, "{reports:#?}");
        }
        swarm.shutdown().await;
    })
    .await;
}

/// Moshpit-style grid: 8 peers, groups of 4, one grid bit, so the peers search under two group
/// keys and re-key by their index in the last group. In every round each span holds the exact
/// weighted mean of the current values of the contributors its report names; within a few rounds
/// every peer's values carry information from all 8 peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grid_rounds_mix_information_across_groups() {
    init_tracing();
    bounded(Duration::from_secs(300), async {
        const N: usize = 8;
        const LEN: usize = 2000;
        let swarm = AveragingSwarm::start(N, node_cfg(), |_| {
            let mut c = avg_cfg("grid", "none", 4);
            c.group_bits = 1;
            c.matchmaking_time = Duration::from_secs(5);
            c
        })
        .await
        .unwrap();
        let weights: Vec<f32> = (0..N).map(|p| 1.0 + p as f32 * 0.25).collect();
        let mut values: Vec<Vec<Vec<f32>>> = (0..N)
            .map(|p| normal_tensors(&[LEN], 500 + p as u64))
            .collect();
        let mut origins: Vec<std::collections::HashSet<usize>> =
            (0..N).map(|p| [p].into_iter().collect()).collect();
        let mut rounds = 0;
        while origins.iter().any(|o| o.len() < N) && rounds < 6 {
            rounds += 1;
            let before = values.clone();
            let deadline = Instant::now() + Duration::from_secs(30);
            let started = Instant::now();
            let reports = swarm.step_all(&mut values, &weights, deadline).await;
            eprintln!(
                "grid round {rounds}: {:.2} s, {} of {N} peers found a group",
                started.elapsed().as_secs_f64(),
                reports.iter().filter(|r| r.is_ok()).count()
            );
            // Each span holds the exact weighted mean of the current values of the contributors
            // its report names; kept-local spans are unchanged.
            let check = RoundCheck::new(swarm.peer_ids(), &before, &weights);
            let mut next = origins.clone();
            for (p, report) in reports.iter().enumerate() {
                // A peer left without a group (its key had no partner) keeps its values.
                let Ok(report) = report else {
                    assert_eq!(
                        values[p], before[p],
                        "a failed step must not touch the tensors"
                    );
                    continue;
                };
                if let Err(e) = check.check_spans(p, report, &values[p]) {
                    panic!("round {rounds}: {e}");
                }
                for contributors in report.spans.iter().filter_map(|s| s.outcome.contributors()) {
                    for c in contributors {
                        let o = origins[check.index_of(c)].clone();
                        next[p].extend(o);
                    }
                }
            }
            origins = next;
        }
        assert!(
            origins.iter().all(|o| o.len() == N),
            "after {rounds} rounds some peer has not heard from everyone: {origins:?}"
        );
        swarm.shutdown().await;
    })
    .await;
}

/// A peer alone under its group key gives up after one search window with a clear error, instead
/// of searching until its (much later) deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_peer_gives_up_after_one_window() {
    init_tracing();
    // The deadline is 120 s away; the test's bound (20 s) holds only if the search stops after
    // its 2 s window.
    bounded(Duration::from_secs(20), async {
        let cluster = LocalCluster::start(2, node_cfg()).await.unwrap();
        let mut c = avg_cfg("lonely", "none", 4);
        c.matchmaking_time = Duration::from_secs(2);
        let averager = Averager::new(cluster.nodes[0].clone(), c).await.unwrap();
        let mut t = normal_vec(100, 1);
        let before = t.clone();
        let r = averager
            .step(
                &mut [&mut t[..]],
                1.0,
                Instant::now() + Duration::from_secs(120),
            )
            .await;
        match r {
            Err(starling_averager::AveragerError::NoGroup { alone: true, .. }) => {}
            other => panic!("expected NoGroup with alone: true, got {other:?}"),
        }
        assert_eq!(t, before, "a failed step leaves the tensors alone");
        averager.shutdown().await;
        cluster.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nan_or_infinite_input_is_refused_before_anything_is_sent() {
    init_tracing();
    bounded(Duration::from_secs(30), async {
        let node = Node::start(node_cfg().listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap()))
            .await
            .unwrap();
        let averager = Averager::new(node.clone(), avg_cfg("nan", "none", 2))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut a = normal_vec(10, 1);
        let mut b = normal_vec(100_000, 2);
        let before = (a.clone(), b.clone());
        b[54_321] = f32::NAN;
        let err = averager
            .step(&mut [&mut a[..], &mut b[..]], 1.0, deadline)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("tensor 1"), "{err}");
        b[54_321] = f32::NEG_INFINITY;
        assert!(averager
            .step(&mut [&mut a[..], &mut b[..]], 1.0, deadline)
            .await
            .is_err());
        b[54_321] = before.1[54_321];
        assert!(matches!(
            averager
                .step(&mut [&mut a[..], &mut b[..]], f32::NAN, deadline)
                .await,
            Err(starling_averager::AveragerError::InvalidWeight(w)) if w.is_nan()
        ));
        assert!(
            a == before.0 && b == before.1,
            "refused steps change nothing"
        );
        averager.shutdown().await;
        node.shutdown().await;
    })
    .await;
}

/// An `Aux` peer in a real 4-peer round reduces a span (it has bandwidth to give) but
/// contributes no weight: the three others hold the exact weighted mean of their own data
/// only, every span's contributors exclude the Aux peer, and its own tensors stay as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aux_peer_reduces_a_span_and_contributes_no_weight() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        const AUX: usize = 3;
        let swarm = AveragingSwarm::start(4, node_cfg(), |i| {
            let mut c = avg_cfg("aux", "none", 4);
            if i == AUX {
                c.mode = AveragingMode::Aux;
            }
            c
        })
        .await
        .unwrap();
        let mut data: Vec<Vec<Vec<f32>>> = (0..4)
            .map(|i| normal_tensors(&[1000, 200_000], 40 + i as u64))
            .collect();
        let before = data.clone();
        let weights = [1.0, 2.0, 3.0, 50.0]; // the Aux peer's weight must not count
        let deadline = Instant::now() + Duration::from_secs(60);
        let reports: Vec<RoundReport> = swarm
            .step_all(&mut data, &weights, deadline)
            .await
            .into_iter()
            .map(|r| r.expect("round succeeds"))
            .collect();
        let ids = swarm.peer_ids();
        let expected = exact_weighted_mean(&before[..AUX], &weights[..AUX]);
        for (i, r) in reports.iter().enumerate() {
            assert_eq!(r.group.len(), 4, "peer {i} grouped with everyone");
            assert_eq!(r.averaged_fraction(), 1.0, "peer {i}: {:?}", r.spans);
            for s in &r.spans {
                let c = s.outcome.contributors().expect("averaged");
                assert!(!c.contains(&ids[AUX]), "the Aux peer's data is in {s:?}");
            }
            if i == AUX {
                assert_eq!(data[i], before[i], "the Aux peer's tensors are left alone");
            } else {
                for (t, e) in data[i].iter().zip(&expected) {
                    assert!(rel_error(t, e) < 1e-6, "peer {i}: {}", rel_error(t, e));
                }
            }
        }
        // The Aux peer reduced a span of its own, for everyone.
        let aux_span: usize = reports[0]
            .spans
            .iter()
            .filter(|s| s.reducer == ids[AUX])
            .map(|s| s.range.len())
            .sum();
        assert!(
            aux_span > 0,
            "the Aux peer reduced nothing: {:?}",
            reports[0].spans
        );
        swarm.shutdown().await;
    })
    .await;
}

/// A group of the peers an averager was told to expect starts at once: with a target of 16 and
/// a 60 s matchmaking window, 3 peers that expect 3 average well before the window could close
/// (the step's 20 s deadline would cut a leader waiting out its window), and hold the exact mean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_told_how_many_to_expect_start_without_waiting_out_the_window() {
    init_tracing();
    bounded(Duration::from_secs(90), async {
        let swarm = AveragingSwarm::start(3, NodeConfig::default(), |_| {
            let mut cfg = AveragerConfig::new("expect");
            cfg.target_group_size = 16;
            cfg.matchmaking_time = Duration::from_secs(60);
            cfg
        })
        .await
        .unwrap();
        for a in swarm.averagers() {
            a.expect_peers(Some(3));
        }
        let mut data: Vec<Vec<Vec<f32>>> = (0..3).map(|p| normal_tensors(&[1000], p)).collect();
        let weights = [1.0, 2.0, 3.0];
        let expected = exact_weighted_mean(&data, &weights);
        let deadline = Instant::now() + Duration::from_secs(20);
        let reports = swarm.step_all(&mut data, &weights, deadline).await;
        for (p, r) in reports.iter().enumerate() {
            let r = r.as_ref().unwrap_or_else(|e| panic!("peer {p}: {e}"));
            assert_eq!(r.group.len(), 3, "peer {p}");
            assert!(rel_error(&data[p][0], &expected[0]) < 1e-6, "peer {p}");
        }
        swarm.shutdown().await;
    })
    .await;
}

/// Matchmaking does not wait for a peer who left: 4 peers (target 4, a 10 s window) average,
/// one leaves; after its last declaration expired, the 3 left average with a deadline (5 s)
/// shorter than the window, which a leader waiting for a fourth peer could not meet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_peer_leaves_the_rest_do_not_wait_out_the_window() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let swarm = AveragingSwarm::start(4, NodeConfig::default(), |_| {
            let mut cfg = AveragerConfig::new("leave");
            cfg.target_group_size = 4;
            cfg.min_group_size = 2;
            cfg.matchmaking_time = Duration::from_secs(10);
            cfg
        })
        .await
        .unwrap();
        let mut data: Vec<Vec<Vec<f32>>> = (0..4).map(|p| normal_tensors(&[500], p)).collect();
        let reports = swarm
            .step_all(
                &mut data,
                &[1.0; 4],
                Instant::now() + Duration::from_secs(30),
            )
            .await;
        assert!(reports
            .iter()
            .all(|r| r.as_ref().is_ok_and(|r| r.group.len() == 4)));
        swarm.nodes()[3].shutdown().await;
        // Its declaration lives until its window's end (10 s after it declared).
        tokio::time::sleep(Duration::from_secs(11)).await;
        let averagers = &swarm.averagers()[..3];
        for round in 0..2 {
            let mut data: Vec<Vec<Vec<f32>>> = (0..3)
                .map(|p| normal_tensors(&[500], 10 * round + p))
                .collect();
            let expected = exact_weighted_mean(&data, &[1.0; 3]);
            let deadline = Instant::now() + Duration::from_secs(5);
            let steps = averagers
                .iter()
                .zip(data.iter_mut())
                .map(|(a, t)| async move {
                    let mut views: Vec<&mut [f32]> = t.iter_mut().map(Vec::as_mut_slice).collect();
                    a.step(&mut views, 1.0, deadline).await
                });
            let reports = futures::future::join_all(steps).await;
            for (p, r) in reports.iter().enumerate() {
                let r = r
                    .as_ref()
                    .unwrap_or_else(|e| panic!("round {round}, peer {p}: {e}"));
                assert_eq!(r.group.len(), 3, "round {round}, peer {p}");
                assert!(
                    rel_error(&data[p][0], &expected[0]) < 1e-6,
                    "round {round}, peer {p}: not the mean"
                );
            }
        }
        swarm.shutdown().await;
    })
    .await;
}

/// Matchmaking started ahead (`prepare`): three peers search before their tensors are ready,
/// then step 0, 300 and 600 ms later; every step uses the group formed ahead, and all hold the
/// exact weighted mean. A second round in which one peer prepared for other tensor sizes
/// searches afresh and still averages with the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_prepared_ahead_gives_its_step_the_group() {
    init_tracing();
    bounded(Duration::from_secs(90), async {
        let swarm = AveragingSwarm::start(3, NodeConfig::default(), |_| {
            let mut cfg = AveragerConfig::new("prepared");
            cfg.target_group_size = 3;
            cfg.matchmaking_time = Duration::from_secs(10);
            // The last peer steps 600 ms after the first: well within the grace (the default,
            // 500 ms here, left it to when the leader's read after the grace happened to come).
            cfg.start_grace = Some(Duration::from_secs(3));
            cfg
        })
        .await
        .unwrap();
        let sizes = [1000, 4000];
        for a in swarm.averagers() {
            a.expect_peers(Some(3));
        }
        for round in 0..2u64 {
            let deadline = Instant::now() + Duration::from_secs(30);
            for (p, a) in swarm.averagers().iter().enumerate() {
                // In the second round peer 2 prepares for the wrong tensors.
                let prepared_sizes: &[usize] = if round == 1 && p == 2 { &[10] } else { &sizes };
                assert!(a.prepare(prepared_sizes, deadline), "peer {p}");
                assert!(!a.prepare(prepared_sizes, deadline), "prepared twice");
            }
            let mut data: Vec<Vec<Vec<f32>>> = (0..3)
                .map(|p| normal_tensors(&sizes, 100 * round + 10 * p))
                .collect();
            let weights = [1.0, 2.0, 3.0];
            let expected = exact_weighted_mean(&data, &weights);
            let steps = swarm
                .averagers()
                .iter()
                .zip(data.iter_mut())
                .zip(weights)
                .enumerate()
                .map(|(p, ((a, t), w))| async move {
                    tokio::time::sleep(Duration::from_millis(300 * p as u64)).await;
                    let mut views: Vec<&mut [f32]> = t.iter_mut().map(Vec::as_mut_slice).collect();
                    a.step(&mut views, w, deadline).await
                });
            let reports = futures::future::join_all(steps).await;
            for (p, r) in reports.iter().enumerate() {
                let r = r
                    .as_ref()
                    .unwrap_or_else(|e| panic!("round {round}, peer {p}: {e}"));
                assert_eq!(r.group.len(), 3, "round {round}, peer {p}");
                assert_eq!(
                    r.prepared,
                    !(round == 1 && p == 2),
                    "round {round}, peer {p}"
                );
                for (t, e) in data[p].iter().zip(&expected) {
                    assert!(rel_error(t, e) < 1e-6, "round {round}, peer {p}");
                }
            }
        }
        swarm.shutdown().await;
    })
    .await;
}

/// The next round's search may start beside a running all-reduce (a delayed update's round
/// runs in the background of compute): while a peer's own step searches, `prepare` refuses;
/// once `searches_done` has grown (its group formed), `prepare` starts the next search while
/// the step's all-reduce of 32 MB is still running, and the next steps take those groups and
/// hold the exact mean, as the first did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_search_starts_while_a_step_still_reduces() {
    init_tracing();
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    bounded(Duration::from_secs(120), async {
        let swarm = AveragingSwarm::start(2, NodeConfig::default(), |_| {
            let mut cfg = AveragerConfig::new("pipelined");
            cfg.target_group_size = 2;
            cfg.matchmaking_time = Duration::from_secs(10);
            cfg
        })
        .await
        .unwrap();
        let averagers = swarm.averagers();
        for a in averagers {
            a.expect_peers(Some(2));
        }
        let sizes = [8_000_000];
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut data: Vec<Vec<Vec<f32>>> = (0..2).map(|p| normal_tensors(&sizes, 70 + p)).collect();
        let expected = exact_weighted_mean(&data, &[1.0, 1.0]);
        let before: Vec<u64> = averagers.iter().map(Averager::searches_done).collect();
        let reduced = AtomicUsize::new(0);
        let (first, second) = data.split_at_mut(1);
        let (t0, t1) = (&mut first[0], &mut second[0]);
        let step0 = async {
            let mut views: Vec<&mut [f32]> = t0.iter_mut().map(Vec::as_mut_slice).collect();
            let r = averagers[0].step(&mut views, 1.0, deadline).await;
            reduced.fetch_add(1, SeqCst);
            r
        };
        let step1 = async {
            // Peer 0 searches alone meanwhile: no search may be prepared beside its own.
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(
                !averagers[0].prepare(&sizes, deadline),
                "prepared while the step searched"
            );
            let mut views: Vec<&mut [f32]> = t1.iter_mut().map(Vec::as_mut_slice).collect();
            let r = averagers[1].step(&mut views, 1.0, deadline).await;
            reduced.fetch_add(1, SeqCst);
            r
        };
        let next = async {
            let mut beside = 0;
            for (p, a) in averagers.iter().enumerate() {
                while a.searches_done() == before[p] {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let still_reducing = reduced.load(SeqCst) < 2;
                assert!(a.prepare(&sizes, deadline), "peer {p}: not prepared");
                beside += usize::from(still_reducing);
            }
            beside
        };
        let (r0, r1, beside) = futures::join!(step0, step1, next);
        for (p, r) in [r0, r1].into_iter().enumerate() {
            let r = r.unwrap_or_else(|e| panic!("peer {p}: {e}"));
            assert_eq!(r.group.len(), 2);
            assert!(rel_error(&data[p][0], &expected[0]) < 1e-6, "peer {p}");
        }
        assert!(
            beside > 0,
            "no search started while the round still reduced"
        );
        // The next round takes the groups searched for beside the first.
        let mut data: Vec<Vec<Vec<f32>>> = (0..2).map(|p| normal_tensors(&sizes, 80 + p)).collect();
        let expected = exact_weighted_mean(&data, &[1.0, 1.0]);
        let reports = swarm.step_all(&mut data, &[1.0, 1.0], deadline).await;
        for (p, r) in reports.iter().enumerate() {
            let r = r.as_ref().unwrap_or_else(|e| panic!("peer {p}: {e}"));
            assert!(r.prepared, "peer {p}: searched afresh");
            assert!(rel_error(&data[p][0], &expected[0]) < 1e-6, "peer {p}");
        }
        swarm.shutdown().await;
    })
    .await;
}

/// Robust aggregation across reducers: five peers (equal weights) average 5000 values under
/// `median` and `trimmed-mean:0.2`, and every peer holds the coordinate-wise rule computed over
/// the whole vectors (each reducer applies it to its span); under `centered-clip` one peer
/// sending its values x1000 moves nobody far from the honest peers' mean, where `mean` moves
/// them hundreds of units. Peers that differ in aggregation never share a group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn robust_aggregators_apply_their_rule_and_never_group_with_another() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let n = 5;
        let len = 5000;
        let originals: Vec<Vec<Vec<f32>>> = (0..n)
            .map(|p| normal_tensors(&[len], 50 + p as u64))
            .collect();
        let column = |j: usize, data: &[Vec<Vec<f32>>]| {
            let mut c: Vec<f32> = data.iter().map(|d| d[0][j]).collect();
            c.sort_by(f32::total_cmp);
            c
        };
        for (name, rule) in [
            ("median", (|c: &[f32]| c[2]) as fn(&[f32]) -> f32),
            ("trimmed-mean:0.2", |c: &[f32]| (c[1] + c[2] + c[3]) / 3.0),
        ] {
            let swarm = AveragingSwarm::start(n, NodeConfig::default(), |_| {
                let mut cfg = AveragerConfig::new(format!("agg-{name}"));
                cfg.target_group_size = n;
                cfg.aggregation = name.parse().unwrap();
                cfg
            })
            .await
            .unwrap();
            let mut data = originals.clone();
            let reports = swarm
                .step_all(
                    &mut data,
                    &[1.0; 5],
                    Instant::now() + Duration::from_secs(30),
                )
                .await;
            for (p, r) in reports.iter().enumerate() {
                assert_eq!(
                    r.as_ref()
                        .unwrap_or_else(|e| panic!("{name}, peer {p}: {e}"))
                        .group
                        .len(),
                    n
                );
                for (j, got) in data[p][0].iter().enumerate() {
                    let want = rule(&column(j, &originals));
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{name}, peer {p}, element {j}: {got} vs {want}"
                    );
                }
            }
            swarm.shutdown().await;
        }
        // One liar sends x1000.
        let mut lying = originals[..4].to_vec();
        lying[3][0].iter_mut().for_each(|v| *v *= 1000.0);
        let honest_mean: Vec<f32> = (0..len)
            .map(|j| (0..3).map(|p| originals[p][0][j]).sum::<f32>() / 3.0)
            .collect();
        for (name, bound) in [("mean", None), ("centered-clip", Some(1.5f32))] {
            let swarm = AveragingSwarm::start(4, NodeConfig::default(), |_| {
                let mut cfg = AveragerConfig::new(format!("agg-lie-{name}"));
                cfg.target_group_size = 4;
                cfg.aggregation = name.parse().unwrap();
                cfg
            })
            .await
            .unwrap();
            let mut data = lying.clone();
            let reports = swarm
                .step_all(
                    &mut data,
                    &[1.0; 4],
                    Instant::now() + Duration::from_secs(30),
                )
                .await;
            assert!(reports
                .iter()
                .all(|r| r.as_ref().is_ok_and(|r| r.group.len() == 4)));
            let off = data[0][0]
                .iter()
                .zip(&honest_mean)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            match bound {
                Some(b) => assert!(off < b, "{name}: {off} from the honest mean"),
                None => assert!(off > 100.0, "{name}: the liar moved it only {off}"),
            }
            swarm.shutdown().await;
        }
        // Two aggregations in one run: two groups of two, never a group of four.
        let swarm = AveragingSwarm::start(4, NodeConfig::default(), |i| {
            let mut cfg = AveragerConfig::new("agg-mixed");
            cfg.target_group_size = 4;
            cfg.min_group_size = 2;
            cfg.matchmaking_time = Duration::from_secs(3);
            cfg.aggregation = if i % 2 == 0 {
                Aggregation::Mean
            } else {
                "median".parse().unwrap()
            };
            cfg
        })
        .await
        .unwrap();
        let mut data = originals[..4].to_vec();
        let reports = swarm
            .step_all(
                &mut data,
                &[1.0; 4],
                Instant::now() + Duration::from_secs(30),
            )
            .await;
        let ids = swarm.peer_ids();
        for (p, r) in reports.iter().enumerate() {
            let r = r.as_ref().unwrap_or_else(|e| panic!("peer {p}: {e}"));
            assert_eq!(r.group.len(), 2, "peer {p}");
            for member in &r.group {
                let q = ids.iter().position(|id| id == member).unwrap();
                assert_eq!(
                    q % 2,
                    p % 2,
                    "peer {p} grouped with peer {q} of another aggregation"
                );
            }
        }
        swarm.shutdown().await;
    })
    .await;
}

/// Round tags: of three peers, one tagged a round behind the other two learns it from its search
/// at once (`Behind`, well before its 20 s window ends) and never groups with them; the two
/// average together; tagged like them, it joins their next round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_a_round_behind_learns_it_at_once_and_joins_the_next_round() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let swarm = AveragingSwarm::start(3, NodeConfig::default(), |_| {
            let mut cfg = AveragerConfig::new("tags");
            cfg.target_group_size = 3;
            cfg.min_group_size = 2;
            cfg.matchmaking_time = Duration::from_secs(20);
            cfg
        })
        .await
        .unwrap();
        let averagers = swarm.averagers();
        for (a, tag) in averagers.iter().zip([8, 8, 7]) {
            a.set_round_tag(tag);
            a.expect_peers(Some(3));
        }
        let mut data: Vec<Vec<Vec<f32>>> = (0..3).map(|p| normal_tensors(&[4000], p)).collect();
        let weights = [1.0, 2.0, 3.0];
        let check = RoundCheck::new(swarm.peer_ids(), &data, &weights);
        let started = Instant::now();
        let deadline = started + Duration::from_secs(60);
        let reports = swarm.step_all(&mut data, &weights, deadline).await;
        match &reports[2] {
            Err(AveragerError::Behind { mine: 7, theirs: 8 }) => {}
            other => panic!("the peer behind: {other:?}"),
        }
        let two: Vec<PeerId> = swarm.peer_ids()[..2].to_vec();
        for p in 0..2 {
            let r = reports[p]
                .as_ref()
                .unwrap_or_else(|e| panic!("peer {p}: {e}"));
            let mut group = r.group.clone();
            group.sort();
            let mut want = two.clone();
            want.sort();
            assert_eq!(
                group, want,
                "peer {p} averaged with the other one in its round"
            );
            check.check_spans(p, r, &data[p]).unwrap();
        }
        // (The window's length, not a timing threshold: a peer that waited out its window
        // would take all of it.)
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "somebody waited out its 20 s window: {:?}",
            started.elapsed()
        );
        // Caught up: all three in round 9.
        for a in averagers {
            a.set_round_tag(9);
        }
        let check = RoundCheck::new(swarm.peer_ids(), &data, &weights);
        let deadline = Instant::now() + Duration::from_secs(60);
        let reports = swarm.step_all(&mut data, &weights, deadline).await;
        for (p, r) in reports.iter().enumerate() {
            let r = r.as_ref().unwrap_or_else(|e| panic!("peer {p}: {e}"));
            assert_eq!(r.group.len(), 3);
            check.check_spans(p, r, &data[p]).unwrap();
        }
        swarm.shutdown().await;
    })
    .await;
}
