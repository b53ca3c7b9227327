//! Averaging when peers crash, stall or belong to other runs.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use starling_averager::{AveragerConfig, AveragerError, Fault, RoundReport, SpanOutcome};
use starling_node::{NodeConfig, PeerId};
use starling_tests::{
    bounded, exact_weighted_mean, init_tracing, normal_tensors, normal_vec, rel_error,
    AveragingSwarm, RoundCheck,
};

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
    /// Every peer's values before the round, and weight.
    check: RoundCheck,
    results: Vec<Vec<Vec<f32>>>,
    reports: Vec<Result<RoundReport, AveragerError>>,
}

/// Starts `n` peers (peer `i` with `faults[i]`), runs one step on all of them concurrently, shuts
/// them down, and returns everything needed to check the outcome.
async fn run(
    prefix: &str,
    n: usize,
    group: usize,
    faults: &[Option<Fault>],
    sizes: &[usize],
) -> Run {
    run_with(prefix, n, group, faults, sizes, |_| {}).await
}

/// [`run`] with every peer's configuration adjusted by `configure`.
async fn run_with(
    prefix: &str,
    n: usize,
    group: usize,
    faults: &[Option<Fault>],
    sizes: &[usize],
    configure: impl Fn(&mut AveragerConfig),
) -> Run {
    let swarm = AveragingSwarm::start(n, node_cfg(), |i| {
        let mut c = avg_cfg(prefix, group);
        c.fault = faults.get(i).copied().flatten();
        configure(&mut c);
        c
    })
    .await
    .unwrap();
    let originals: Vec<Vec<Vec<f32>>> = (0..n)
        .map(|i| normal_tensors(&[sizes[i % sizes.len()]], 100 + i as u64))
        .collect();
    let weights: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 * 0.5).collect();
    let mut results = originals.clone();
    let deadline = Instant::now() + Duration::from_secs(40);
    let reports = swarm.step_all(&mut results, &weights, deadline).await;
    let ids = swarm.peer_ids();
    swarm.shutdown().await;
    let mut probe = avg_cfg(prefix, group);
    configure(&mut probe);
    Run {
        check: RoundCheck::new(ids.clone(), &originals, &weights)
            .with_aggregation(probe.aggregation),
        ids,
        results,
        reports,
    }
}

impl Run {
    /// Every span of every listed peer holds exactly the weighted mean of the contributors its
    /// report names (under a robust aggregation: a value inside their range), or its original
    /// values where the report says they were kept; peers that averaged a span together hold
    /// the same bits there.
    fn check_spans(&self, peers: &[usize]) {
        let mut agreed = Vec::new();
        for &p in peers {
            let report = self.reports[p]
                .as_ref()
                .unwrap_or_else(|e| panic!("peer {p} step failed: {e}"));
            if let Err(e) = self.check.check_spans(p, report, &self.results[p]) {
                panic!("{e}");
            }
            agreed.push((p, report, &self.results[p][..]));
        }
        if let Err(e) = self.check.check_agreement(&agreed) {
            panic!("{e}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_peers_form_two_groups_of_four() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // A long window: full groups start as soon as they fill, and under load (8 peers on 2
        // cores) no leader closes its window before its followers found it.
        let run = run_with("two-groups", 8, 4, &[], &[LEN], |c| {
            c.matchmaking_time = Duration::from_secs(15)
        })
        .await;
        let mut groups: Vec<Vec<PeerId>> = Vec::new();
        for r in &run.reports {
            let r = r.as_ref().expect("every peer averages");
            assert_eq!(r.group.len(), 4, "groups: {:?}", r.group);
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
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_different_schemas_never_group() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // Peers 0 and 2 hold 1000 elements, peers 1 and 3 hold 2000.
        let run = run("schemas", 4, 4, &[], &[1000, 2000]).await;
        for (i, r) in run.reports.iter().enumerate() {
            let r = r.as_ref().expect("each pair averages");
            let mut members: Vec<usize> = r.group.iter().map(|p| run.check.index_of(p)).collect();
            members.sort();
            let expected = if i % 2 == 0 { vec![0, 2] } else { vec![1, 3] };
            assert_eq!(
                members, expected,
                "peer {i} grouped only with its own schema"
            );
        }
        run.check_spans(&[0, 1, 2, 3]);
    })
    .await;
}

/// Runs 4 peers where peer `victim` crashes at `fault`; the survivors must finish before the
/// deadline with exact means over the contributors their reports name.
async fn survivors_finish(prefix: &str, fault: Fault) -> Run {
    survivors_finish_with(prefix, fault, |_| {}).await
}

/// [`survivors_finish`] with every peer's configuration adjusted by `configure`.
async fn survivors_finish_with(
    prefix: &str,
    fault: Fault,
    configure: impl Fn(&mut AveragerConfig),
) -> Run {
    let victim = 2;
    let mut faults = vec![None; 4];
    faults[victim] = Some(fault);
    let run = run_with(prefix, 4, 4, &faults, &[LEN], configure).await;
    let survivors: Vec<usize> = (0..4).filter(|&i| i != victim).collect();
    run.check_spans(&survivors);
    let victim_id = run.ids[victim];
    for &s in &survivors {
        let r = run.reports[s].as_ref().unwrap();
        // A survivor that got every span back from the victim may never notice the crash.
        let noticed = r
            .spans
            .iter()
            .any(|sp| !matches!(sp.outcome, SpanOutcome::Averaged { .. }));
        assert!(
            !noticed || r.failed_peers.contains(&victim_id),
            "peer {s} reports the crashed peer: {r:?}"
        );
        for span in &r.spans {
            if let Some(contributors) = span.outcome.contributors() {
                // Under heavy load a slow survivor may legitimately be excluded too; what must
                // hold is that this peer's own data is in every span it reports as averaged.
                assert!(contributors.contains(&run.ids[s]), "{r:#?}");
            }
        }
    }
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
                if let Some(contributors) = span.outcome.contributors() {
                    assert!(!contributors.contains(&run.ids[2]));
                }
            }
        }
    })
    .await;
}

/// Every timeout longer than `run_with`'s 40 s deadline: a round that waited for any would
/// show it.
fn timeouts_past_the_deadline(c: &mut AveragerConfig) {
    c.request_timeout = Duration::from_secs(45);
    c.sender_timeout = Duration::from_secs(45);
    c.reducer_timeout = Duration::from_secs(45);
}

/// A member that is gone when the round starts (its node down: every dial to it fails at
/// once) is given up on after a few failed dials, not after the open deadline, and the
/// survivors' reductions stop waiting for its part: with every timeout set past the round's
/// deadline, they still average every span (the victim's re-delegated) in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_member_is_given_up_on_at_once_not_after_the_timeouts() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let run = survivors_finish_with(
            "kill-unreachable",
            Fault::BeforeSending,
            timeouts_past_the_deadline,
        )
        .await;
        for s in [0, 1, 3] {
            let r = run.reports[s].as_ref().unwrap();
            assert!(r.failed_peers.contains(&run.ids[2]), "peer {s}: {r:?}");
            for span in &r.spans {
                assert!(
                    span.outcome.contributors().is_some(),
                    "peer {s} kept its own values: {span:?}"
                );
            }
        }
    })
    .await;
}

/// A member that returned every result of its span but sent none of its own parts, then died:
/// every send to it succeeded, so nothing failed on the survivors' side, and their reductions
/// wait for its part. Their nodes find it down (its connections dropped, its address refuses)
/// and the reductions stop waiting at once: with every timeout set past the round's deadline,
/// the survivors still average every span in time. Before, they waited for its part until the
/// no-show timeout (seen in eight `starling train` processes, one SIGKILLed: a 10 s round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_found_down_is_not_waited_for() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let run = survivors_finish_with(
            "kill-silent",
            Fault::SilentReducer,
            timeouts_past_the_deadline,
        )
        .await;
        let victim = run.ids[2];
        for s in [0, 1, 3] {
            let r = run.reports[s].as_ref().unwrap();
            assert!(r.failed_peers.contains(&victim), "peer {s}: {r:?}");
            for span in &r.spans {
                let contributors = span
                    .outcome
                    .contributors()
                    .unwrap_or_else(|| panic!("peer {s} kept its own values: {span:?}"));
                // Its part reached nobody: only its own span (which it returned) holds it.
                if span.reducer != victim {
                    assert!(!contributors.contains(&victim), "peer {s}: {span:?}");
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

/// The parts of the victim's span in survivor `s`'s report, checked to cover one contiguous
/// range.
fn victim_parts(run: &Run, s: usize, victim: usize) -> Vec<starling_averager::SpanReport> {
    let r = run.reports[s].as_ref().unwrap();
    let parts: Vec<_> = r
        .spans
        .iter()
        .filter(|sp| sp.reducer == run.ids[victim])
        .cloned()
        .collect();
    assert!(!parts.is_empty(), "peer {s}: victim reduced a span: {r:#?}");
    for w in parts.windows(2) {
        assert_eq!(w[0].range.end, w[1].range.start, "peer {s}: {parts:#?}");
    }
    parts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_while_reducing_has_its_span_redelegated() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let run = survivors_finish("kill-reducing", Fault::WhileReducing).await;
        // The victim's span never came back: the survivors split it among themselves in the
        // same round and now hold the exact weighted mean of the three survivors there too
        // (`check_spans` checked the values against the contributors listed here).
        let survivors = [0, 1, 3];
        let mut ids: Vec<PeerId> = survivors.iter().map(|&s| run.ids[s]).collect();
        ids.sort();
        let mut covered = None;
        for s in survivors {
            let parts = victim_parts(&run, s, 2);
            let range = parts[0].range.start..parts[parts.len() - 1].range.end;
            assert_eq!(
                *covered.get_or_insert(range.clone()),
                range,
                "same span everywhere"
            );
            for part in &parts {
                let SpanOutcome::Redelegated { to, contributors } = &part.outcome else {
                    panic!("peer {s}: part not re-delegated: {part:?}");
                };
                assert!(ids.contains(to), "re-delegated to a survivor: {part:?}");
                let mut c = contributors.clone();
                c.sort();
                assert_eq!(c, ids, "peer {s}: every survivor in the repaired part");
            }
        }
        let report = run.reports[0].as_ref().unwrap();
        assert_eq!(report.averaged_fraction(), 1.0, "{report:#?}");
    })
    .await;
}

/// The crashes above under each robust aggregator: the survivors finish, every span they
/// averaged lies inside its contributors' range and is the same on all of them, and the crashed
/// reducer's span is re-delegated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_finish_under_every_robust_aggregator() {
    init_tracing();
    for (a, aggregation) in ["median", "trimmed-mean", "centered-clip"]
        .iter()
        .enumerate()
    {
        let aggregation: starling_averager::Aggregation = aggregation.parse().unwrap();
        for (f, fault) in [
            Fault::BeforeSending,
            Fault::AfterSentChunks(1),
            Fault::WhileReducing,
        ]
        .into_iter()
        .enumerate()
        {
            let prefix = format!("kill-robust-{a}-{f}");
            let run = bounded(
                Duration::from_secs(120),
                survivors_finish_with(&prefix, fault, |c| c.aggregation = aggregation),
            )
            .await;
            if fault == Fault::WhileReducing {
                for s in [0, 1, 3] {
                    for part in victim_parts(&run, s, 2) {
                        assert!(
                            matches!(part.outcome, SpanOutcome::Redelegated { .. }),
                            "{aggregation}: peer {s}: {part:?}"
                        );
                    }
                }
            }
        }
    }
}

/// The same crashes in verified rounds (every member checks a reducer after the round): the
/// survivors finish with exact spans that agree, the crashed reducer's span is re-delegated,
/// and no check accuses anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_finish_in_verified_rounds() {
    init_tracing();
    for (f, fault) in [
        Fault::BeforeSending,
        Fault::AfterSentChunks(1),
        Fault::WhileReducing,
    ]
    .into_iter()
    .enumerate()
    {
        let prefix = format!("kill-verified-{f}");
        let run = bounded(
            Duration::from_secs(120),
            survivors_finish_with(&prefix, fault, |c| c.verify = 1.0),
        )
        .await;
        for s in [0, 1, 3] {
            let report = run.reports[s].as_ref().unwrap();
            if let Some(audit) = &report.audit {
                assert!(
                    !matches!(audit.outcome, starling_averager::AuditOutcome::Caught(_)),
                    "{fault:?}: peer {s} accused {}: {:?}",
                    audit.reducer,
                    audit.outcome
                );
            }
            if fault == Fault::WhileReducing {
                for part in victim_parts(&run, s, 2) {
                    assert!(
                        matches!(part.outcome, SpanOutcome::Redelegated { .. }),
                        "peer {s}: {part:?}"
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_while_reducing_without_time_to_redelegate_keeps_local() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // Re-delegation needs more time than the 40 s deadline leaves: the survivors keep their
        // values on the victim's span, as before re-delegation existed, and say why.
        let run = survivors_finish_with("kill-reducing-late", Fault::WhileReducing, |c| {
            c.repair_min_time = Duration::from_secs(3600);
        })
        .await;
        for s in [0, 1, 3] {
            let parts = victim_parts(&run, s, 2);
            assert_eq!(parts.len(), 1, "peer {s}: the span stays whole: {parts:#?}");
            match &parts[0].outcome {
                SpanOutcome::KeptLocal { reason } => {
                    assert!(reason.contains("too little to re-delegate"), "{reason}")
                }
                other => panic!("peer {s}: expected KeptLocal, got {other:?}"),
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reducer_killed_after_serving_one_sender() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // The victim returns its result to one survivor, then dies. That survivor keeps the
        // victim's result (averaged over everyone, the victim included) but still serves and
        // contributes to the repair; the two others re-delegate the span and hold the three
        // survivors' exact mean there. Each report names exactly whose values it holds.
        let run = survivors_finish("kill-returning", Fault::WhileReturning(1)).await;
        let victim = run.ids[2];
        let mut survivors: Vec<PeerId> = [0, 1, 3].iter().map(|&s| run.ids[s]).collect();
        survivors.sort();
        let mut served = 0;
        for s in [0, 1, 3] {
            let parts = victim_parts(&run, s, 2);
            if let SpanOutcome::Averaged { contributors } = &parts[0].outcome {
                assert_eq!(parts.len(), 1);
                assert!(contributors.contains(&victim), "{parts:#?}");
                served += 1;
                continue;
            }
            for part in &parts {
                let SpanOutcome::Redelegated { contributors, .. } = &part.outcome else {
                    panic!("peer {s}: part not re-delegated: {part:?}");
                };
                let mut c = contributors.clone();
                c.sort();
                assert_eq!(c, survivors, "peer {s}: every survivor in the part");
            }
        }
        assert_eq!(
            served, 1,
            "one survivor got the victim's result: {:#?}",
            run.reports
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_during_matchmaking_followers_regroup() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // Peer 0 declares first and leads; it crashes once it has accepted two followers.
        let swarm = AveragingSwarm::start(4, node_cfg(), |i| {
            let mut c = avg_cfg("leader-dies", 4);
            if i == 0 {
                c.fault = Some(Fault::LeaderAfterFollowers(2));
            }
            c
        })
        .await
        .unwrap();
        let averagers = swarm.averagers();
        let deadline = Instant::now() + Duration::from_secs(40);
        let mut data: Vec<Vec<f32>> = (0..4).map(|i| normal_vec(1000, i)).collect();
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
        let dead = swarm.nodes()[0].peer_id();
        for (i, r) in follower_results.iter().enumerate() {
            let r = r
                .as_ref()
                .unwrap_or_else(|e| panic!("follower {i} did not regroup and average: {e}"));
            assert!(Instant::now() < deadline);
            assert!(
                !r.group.contains(&dead),
                "follower {i} regrouped without the dead leader"
            );
            assert_eq!(r.group.len(), 3);
        }
        let followers: Vec<Vec<Vec<f32>>> =
            originals[1..].iter().map(|o| vec![o.clone()]).collect();
        let expected = exact_weighted_mean(&followers, &[1.0; 3]).remove(0);
        for t in &data[1..] {
            assert!(rel_error(t, &expected) < 1e-6);
        }
        swarm.shutdown().await;
    })
    .await;
}
