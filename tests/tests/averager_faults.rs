//! Averaging when peers crash, stall or belong to other runs.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use starling_averager::{Averager, AveragerConfig, AveragerError, Fault, RoundReport, SpanOutcome};
use starling_node::{cluster::LocalCluster, Node, NodeConfig, PeerId};
use starling_tests::{bounded, init_tracing, normal_vec, rel_error};

const LEN: usize = 200_000;

fn node_cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(3))
}

fn avg_cfg(prefix: &str, group: usize) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.target_group_size = group;
    c.min_group_size = 2;
    c.matchmaking_time = Duration::from_secs(6);
    c.request_timeout = Duration::from_secs(3);
    c.sender_timeout = Duration::from_secs(3);
    c.reducer_timeout = Duration::from_secs(6);
    c.chunk_bytes = 64 * 1024; // several chunks per span, so "half way" exists
    c
}

struct Run {
    ids: Vec<PeerId>,
    originals: Vec<Vec<f32>>,
    weights: Vec<f32>,
    results: Vec<Vec<f32>>,
    reports: Vec<Result<RoundReport, AveragerError>>,
}

/// Starts `n` peers (peer `i` with `faults[i]`), runs one step on all of them concurrently, and
/// returns everything needed to check the outcome.
async fn run(
    prefix: &str,
    n: usize,
    group: usize,
    faults: &[Option<Fault>],
    sizes: &[usize],
) -> (Run, LocalCluster) {
    let cluster = LocalCluster::start(n, node_cfg()).await.unwrap();
    let ids: Vec<PeerId> = cluster.nodes.iter().map(Node::peer_id).collect();
    let mut averagers = Vec::new();
    for (i, node) in cluster.nodes.iter().enumerate() {
        let mut c = avg_cfg(prefix, group);
        c.fault = faults.get(i).copied().flatten();
        averagers.push(Averager::new(node.clone(), c).await.unwrap());
    }
    let originals: Vec<Vec<f32>> = (0..n)
        .map(|i| normal_vec(sizes[i % sizes.len()], 100 + i as u64))
        .collect();
    let weights: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 * 0.5).collect();
    let mut results = originals.clone();
    let deadline = Instant::now() + Duration::from_secs(40);
    let futs = averagers
        .iter()
        .zip(results.iter_mut())
        .zip(&weights)
        .map(|((a, t), w)| async move { a.step(&mut [&mut t[..]], *w, deadline).await });
    let reports = futures::future::join_all(futs).await;
    for a in averagers {
        a.shutdown().await;
    }
    (
        Run {
            ids,
            originals,
            weights,
            results,
            reports,
        },
        cluster,
    )
}

impl Run {
    fn index(&self) -> HashMap<PeerId, usize> {
        self.ids.iter().enumerate().map(|(i, p)| (*p, i)).collect()
    }

    /// Every span of every listed peer holds exactly the weighted mean of the contributors its
    /// report names, or its original values where the report says they were kept.
    fn check_spans(&self, peers: &[usize]) {
        let index = self.index();
        for &p in peers {
            let report = self.reports[p]
                .as_ref()
                .unwrap_or_else(|e| panic!("peer {p} step failed: {e}"));
            for span in &report.spans {
                let r = span.range.clone();
                let got = &self.results[p][r.clone()];
                match &span.outcome {
                    SpanOutcome::Averaged { contributors }
                    | SpanOutcome::Redelegated { contributors, .. } => {
                        let w: f64 = contributors
                            .iter()
                            .map(|c| f64::from(self.weights[index[c]]))
                            .sum();
                        let expected: Vec<f32> = r
                            .clone()
                            .map(|k| {
                                let s: f64 = contributors
                                    .iter()
                                    .map(|c| {
                                        f64::from(self.originals[index[c]][k])
                                            * f64::from(self.weights[index[c]])
                                    })
                                    .sum();
                                (s / w) as f32
                            })
                            .collect();
                        let err = rel_error(got, &expected);
                        assert!(
                            err < 1e-6,
                            "peer {p} span {r:?}: rel error {err} against its contributors' mean"
                        );
                    }
                    SpanOutcome::KeptLocal { reason } => {
                        assert_eq!(
                            got,
                            &self.originals[p][r.clone()],
                            "peer {p} span {r:?} kept local ({reason})"
                        );
                    }
                }
            }
            let covered: usize = report.spans.iter().map(|s| s.range.len()).sum();
            assert_eq!(
                covered,
                self.originals[p].len(),
                "the report covers every element"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_peers_form_two_groups_of_four() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let (run, cluster) = run("two-groups", 8, 4, &[], &[LEN]).await;
        let mut groups: Vec<Vec<PeerId>> = Vec::new();
        for r in &run.reports {
            let r = r.as_ref().expect("every peer averages");
            assert_eq!(r.group.len(), 4);
            let mut g = r.group.clone();
            g.sort();
            if !groups.contains(&g) {
                groups.push(g);
            }
        }
        assert_eq!(groups.len(), 2, "two groups formed: {groups:?}");
        let a: HashSet<_> = groups[0].iter().collect();
        assert!(
            groups[1].iter().all(|p| !a.contains(p)),
            "the groups are disjoint"
        );
        run.check_spans(&(0..8).collect::<Vec<_>>());
        cluster.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_different_schemas_never_group() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // Peers 0 and 2 hold 1000 elements, peers 1 and 3 hold 2000.
        let (run, cluster) = run("schemas", 4, 4, &[], &[1000, 2000]).await;
        for (i, r) in run.reports.iter().enumerate() {
            let r = r.as_ref().expect("each pair averages");
            let mut members: Vec<usize> = r.group.iter().map(|p| run.index()[p]).collect();
            members.sort();
            let expected = if i % 2 == 0 { vec![0, 2] } else { vec![1, 3] };
            assert_eq!(
                members, expected,
                "peer {i} grouped only with its own schema"
            );
        }
        run.check_spans(&[0, 1, 2, 3]);
        cluster.shutdown().await;
    })
    .await;
}

/// Runs 4 peers where peer `victim` crashes at `fault`; the survivors must finish before the
/// deadline with exact means over the contributors their reports name.
async fn survivors_finish(prefix: &str, fault: Fault) -> Run {
    let victim = 2;
    let mut faults = vec![None; 4];
    faults[victim] = Some(fault);
    let (run, cluster) = run(prefix, 4, 4, &faults, &[LEN]).await;
    let survivors: Vec<usize> = (0..4).filter(|&i| i != victim).collect();
    run.check_spans(&survivors);
    let victim_id = run.ids[victim];
    for &s in &survivors {
        let r = run.reports[s].as_ref().unwrap();
        assert!(
            r.failed_peers.contains(&victim_id),
            "peer {s} reports the crashed peer: {r:?}"
        );
        for span in &r.spans {
            if let SpanOutcome::Averaged { contributors } = &span.outcome {
                // Under heavy load a slow survivor may legitimately be excluded too; what must
                // hold is that this peer's own data is in every span it reports as averaged.
                assert!(contributors.contains(&run.ids[s]), "{r:#?}");
            }
        }
    }
    cluster.shutdown().await;
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_before_sending() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let run = survivors_finish("kill-before", Fault::BeforeSending).await;
        // Nobody received anything from the victim: no span lists it.
        for s in [0, 1, 3] {
            for span in &run.reports[s].as_ref().unwrap().spans {
                if let SpanOutcome::Averaged { contributors } = &span.outcome {
                    assert!(!contributors.contains(&run.ids[2]));
                }
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_half_way_through_sending() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        survivors_finish("kill-halfway", Fault::AfterSentChunks(1)).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_while_reducing() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let run = survivors_finish("kill-reducing", Fault::WhileReducing).await;
        // The victim's span could not come back: the survivors kept their values there and say so.
        for s in [0, 1, 3] {
            let r = run.reports[s].as_ref().unwrap();
            let lost = r
                .spans
                .iter()
                .find(|sp| sp.reducer == run.ids[2])
                .expect("victim reduced a span");
            assert!(
                matches!(lost.outcome, SpanOutcome::KeptLocal { .. }),
                "{lost:?}"
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_during_matchmaking_followers_regroup() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // Peer 0 declares first and leads; it crashes once it has accepted two followers.
        let cluster = LocalCluster::start(4, node_cfg()).await.unwrap();
        let mut averagers = Vec::new();
        for (i, node) in cluster.nodes.iter().enumerate() {
            let mut c = avg_cfg("leader-dies", 4);
            if i == 0 {
                c.fault = Some(Fault::LeaderAfterFollowers(2));
            }
            averagers.push(Averager::new(node.clone(), c).await.unwrap());
        }
        let deadline = Instant::now() + Duration::from_secs(40);
        let mut data: Vec<Vec<f32>> = (0..4).map(|i| normal_vec(1000, i as u64)).collect();
        let originals = data.clone();
        let (first, rest) = data.split_at_mut(1);
        let leader = async {
            averagers[0]
                .step(&mut [&mut first[0][..]], 1.0, deadline)
                .await
        };
        let followers = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let futs = averagers[1..]
                .iter()
                .zip(rest.iter_mut())
                .map(|(a, t)| async move { a.step(&mut [&mut t[..]], 1.0, deadline).await });
            futures::future::join_all(futs).await
        };
        let (leader_result, follower_results) = tokio::join!(leader, followers);
        assert!(leader_result.is_err(), "the leader crashed");
        let dead = cluster.nodes[0].peer_id();
        for (i, r) in follower_results.iter().enumerate() {
            let r = r.as_ref().expect("followers regroup and average");
            assert!(Instant::now() < deadline);
            assert!(
                !r.group.contains(&dead),
                "follower {i} regrouped without the dead leader"
            );
            assert_eq!(r.group.len(), 3);
        }
        let expected: Vec<f32> = (0..1000)
            .map(|k| (originals[1][k] + originals[2][k] + originals[3][k]) / 3.0)
            .collect();
        for t in &data[1..] {
            assert!(rel_error(t, &expected) < 1e-6);
        }
        for a in averagers {
            a.shutdown().await;
        }
        cluster.shutdown().await;
    })
    .await;
}
