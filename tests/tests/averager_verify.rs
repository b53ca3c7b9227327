//! Verified rounds (`AveragerConfig::verify`): a reducer that returns a wrong result for its
//! span is caught with evidence anyone can check, no honest member applies its span in the
//! round it is caught in (the catching member's verdict reaches the others before they apply
//! the round), every honest peer refuses it, and honest rounds are never accused.

use std::time::{Duration, Instant};

use starling_averager::verify::Evidence;
use starling_averager::{AuditOutcome, AveragerConfig, SpanOutcome};
use starling_node::{NodeConfig, PeerId};
use starling_tests::{bounded, init_tracing, normal_tensors, AveragingSwarm, RoundCheck};

const PEERS: usize = 8;
const LIAR: usize = 3;
const LEN: usize = 40_000;

fn node_cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(2))
}

fn avg_cfg(prefix: &str, verify: f64) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.target_group_size = PEERS;
    c.min_group_size = 2;
    c.matchmaking_time = Duration::from_secs(3);
    c.request_timeout = Duration::from_secs(2);
    c.chunk_bytes = 16 * 1024; // several chunks and parts per span
    c.verify = verify;
    c
}

fn data_for(round: u64, peers: usize) -> Vec<Vec<Vec<f32>>> {
    (0..peers)
        .map(|i| normal_tensors(&[LEN], 1_000 * round + i as u64))
        .collect()
}

/// The reducer of `range` in a round's report, if that span was averaged by it.
fn reducer_of(
    report: &starling_averager::RoundReport,
    peer: &PeerId,
) -> Option<std::ops::Range<usize>> {
    report
        .spans
        .iter()
        .find(|s| s.reducer == *peer)
        .map(|s| s.range.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reducer_that_alters_its_result_is_caught_not_applied_and_refused_by_everyone() {
    init_tracing();
    let caught = bounded(Duration::from_secs(240), catch_a_liar("verify-liar", 1.0)).await;
    assert!(caught.is_some(), "nobody caught the liar in 10 rounds");
}

/// Detection over many swarms (the "within 10 rounds in at least 19 of 20 runs"): for
/// each checking probability, 20 fresh 8-peer swarms with one lying reducer; prints in which
/// round it was caught. `cargo test --release -p starling-tests --test averager_verify
/// detection_table -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "20 swarms per probability: run by hand for the table"]
async fn detection_table() {
    init_tracing();
    for p in [0.25, 0.5, 1.0] {
        let mut rounds = Vec::new();
        for run in 0..20 {
            let prefix = format!("verify-table-{p}-{run}");
            let caught = bounded(Duration::from_secs(240), catch_a_liar(&prefix, p)).await;
            rounds.push(caught);
        }
        let within = rounds.iter().filter(|r| r.is_some()).count();
        println!("verify = {p}: caught within 10 rounds in {within} of 20 runs; round caught (0-based): {rounds:?}");
    }
}

/// One 8-peer swarm in which peer `LIAR` adds 1 to every value of its span's result: rounds
/// until some honest peer catches it (at most 10; `None` if none did). Checks on the way that
/// every accusation names the liar, that the catching peer kept its own values on the liar's
/// span, that the published evidence checks out, that every honest peer comes to refuse the
/// liar, and that the next rounds form without it and are exact.
async fn catch_a_liar(prefix: &str, verify: f64) -> Option<u64> {
    {
        let swarm = AveragingSwarm::start(PEERS, node_cfg(), |i| {
            let mut c = avg_cfg(prefix, verify);
            if i == LIAR {
                // Well-formed values, consistently sealed: only a recomputation shows the lie.
                c.result_bias = Some(1.0);
            }
            c
        })
        .await
        .unwrap();
        let ids = swarm.peer_ids();
        let liar = ids[LIAR];
        let weights = [1.0f32; PEERS];
        let mut caught_in = None;
        for round in 0..10u64 {
            let before = data_for(round, PEERS);
            let mut data = before.clone();
            let deadline = Instant::now() + Duration::from_secs(30);
            let results = swarm.step_all(&mut data, &weights, deadline).await;
            for (i, r) in results.iter().enumerate() {
                if i == LIAR {
                    continue;
                }
                let report = r.as_ref().unwrap_or_else(|e| panic!("peer {i}: {e}"));
                let Some(audit) = &report.audit else {
                    assert!(
                        verify < 1.0,
                        "peer {i} did not check a reducer with verify = 1"
                    );
                    continue;
                };
                match &audit.outcome {
                    AuditOutcome::Caught(what) => {
                        assert_eq!(
                            audit.reducer, liar,
                            "peer {i} accused an honest peer: {what}"
                        );
                        // The catching peer kept its own values on the liar's span.
                        let span = reducer_of(report, &liar).expect("the liar reduced a span");
                        assert_eq!(
                            data[i][0][span.clone()],
                            before[i][0][span.clone()],
                            "peer {i} applied the span it caught the liar on"
                        );
                        let kept = report.spans.iter().any(|s| {
                            s.reducer == liar
                                && matches!(&s.outcome, SpanOutcome::KeptLocal { reason } if reason.contains("not applied"))
                        });
                        assert!(kept, "peer {i}: {:?}", report.spans);
                        caught_in.get_or_insert(round);
                    }
                    AuditOutcome::Clean => assert_ne!(
                        audit.reducer, liar,
                        "peer {i} found the liar's altered block clean"
                    ),
                    AuditOutcome::Unanswered(why) => {
                        panic!("peer {i}: a reveal went unanswered on loopback: {why}")
                    }
                }
            }
            if caught_in == Some(round) {
                // The catching member's verdict reached every member before it applied the
                // round: none applied the liar's span, and each refuses the liar already.
                for (i, r) in results.iter().enumerate() {
                    if i == LIAR {
                        continue;
                    }
                    let report = r.as_ref().unwrap();
                    let span = reducer_of(report, &liar).expect("the liar reduced a span");
                    assert_eq!(
                        data[i][0][span.clone()],
                        before[i][0][span],
                        "peer {i} applied the liar's span in the round it was caught: {:?}",
                        report.spans
                    );
                    assert!(
                        swarm.averagers()[i].refused_peers().contains(&liar),
                        "peer {i} does not refuse the liar right after the round it was caught in"
                    );
                }
                break;
            }
        }
        let Some(caught_in) = caught_in else {
            swarm.shutdown().await;
            return None;
        };
        tracing::info!("liar caught in round {caught_in}");

        // The evidence is in the DHT and checks out on its own.
        let key = format!("{prefix}.evidence");
        let key = key.as_str();
        let give_up = Instant::now() + Duration::from_secs(30);
        let evidence: Vec<Evidence> = loop {
            let found: Vec<Evidence> = swarm.nodes()[0]
                .get::<Evidence>(key)
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|(_, e, _)| e)
                .collect();
            if !found.is_empty() || Instant::now() > give_up {
                break found;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert!(!evidence.is_empty(), "no evidence was published");
        for e in &evidence {
            assert_eq!(e.check().unwrap(), liar, "{e}");
        }

        // Every honest peer refuses the liar (read from the published evidence).
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            let missing: Vec<usize> = (0..PEERS)
                .filter(|&i| i != LIAR && !swarm.averagers()[i].refused_peers().contains(&liar))
                .collect();
            if missing.is_empty() {
                break;
            }
            assert!(
                Instant::now() < give_up,
                "peers {missing:?} still accept the liar"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // The next rounds form without it (it searches too, and is refused) and average
        // exactly.
        for round in 100..102u64 {
            let before = data_for(round, PEERS);
            let mut data = before.clone();
            let check = RoundCheck::new(ids.clone(), &before, &weights);
            let deadline = Instant::now() + Duration::from_secs(20);
            let liar_deadline = Instant::now() + Duration::from_secs(4);
            let steps = swarm
                .averagers()
                .iter()
                .zip(data.iter_mut())
                .enumerate()
                .map(|(i, (a, tensors))| async move {
                    let mut views: Vec<&mut [f32]> =
                        tensors.iter_mut().map(Vec::as_mut_slice).collect();
                    let until = if i == LIAR { liar_deadline } else { deadline };
                    a.step(&mut views, 1.0, until).await
                });
            let results = futures::future::join_all(steps).await;
            for (i, r) in results.iter().enumerate() {
                if i == LIAR {
                    continue;
                }
                let report = r.as_ref().unwrap_or_else(|e| panic!("peer {i}: {e}"));
                assert!(
                    !report.group.contains(&liar),
                    "peer {i} grouped with the liar again"
                );
                assert_eq!(report.group.len(), PEERS - 1);
                check.check_spans(i, report, &data[i]).unwrap();
            }
        }
        swarm.shutdown().await;
        Some(caught_in)
    }
}

/// Honest rounds with every member checking a reducer after each: exact means, the same bits
/// on every peer, every check clean, nobody refused. 40 rounds (320 checks) here;
/// `STARLING_VERIFY_ROUNDS=200` for the 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honest_verified_rounds_are_exact_and_never_accuse_anyone() {
    init_tracing();
    let rounds: u64 = std::env::var("STARLING_VERIFY_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(40);
    bounded(Duration::from_secs(60 + 3 * rounds), async {
        let swarm = AveragingSwarm::start(PEERS, node_cfg(), |_| avg_cfg("verify-honest", 1.0))
            .await
            .unwrap();
        let ids = swarm.peer_ids();
        let weights: Vec<f32> = (0..PEERS).map(|i| 1.0 + i as f32 * 0.5).collect();
        let mut checks = 0usize;
        for round in 0..rounds {
            let before = data_for(round, PEERS);
            let mut data = before.clone();
            let check = RoundCheck::new(ids.clone(), &before, &weights);
            let deadline = Instant::now() + Duration::from_secs(30);
            let results = swarm.step_all(&mut data, &weights, deadline).await;
            for (i, r) in results.iter().enumerate() {
                let report = r
                    .as_ref()
                    .unwrap_or_else(|e| panic!("round {round} peer {i}: {e}"));
                check.check_spans(i, report, &data[i]).unwrap();
                assert_eq!(report.averaged_fraction(), 1.0, "round {round} peer {i}");
                let audit = report
                    .audit
                    .as_ref()
                    .expect("verify = 1 checks every round");
                assert_eq!(
                    audit.outcome,
                    AuditOutcome::Clean,
                    "round {round} peer {i} on {}",
                    audit.reducer
                );
                checks += 1;
            }
            let honest: Vec<_> = results
                .iter()
                .enumerate()
                .map(|(i, r)| (i, r.as_ref().unwrap(), &data[i][..]))
                .collect();
            check.check_agreement(&honest).unwrap();
        }
        assert_eq!(checks, PEERS * rounds as usize);
        for (i, a) in swarm.averagers().iter().enumerate() {
            assert!(a.refused_peers().is_empty(), "peer {i} refuses someone");
        }
        swarm.shutdown().await;
    })
    .await;
}

/// A member that learned of a liar before its group's leader did (the evidence reaches peers
/// at different times) refuses the group it is offered with the liar in it, and tells the
/// others: they average without it at once, every span exact over the two of them (its own
/// span re-delegated), instead of waiting for its part and its span until their timeouts
/// (here set past the round's deadline, so that waiting would show as an unfinished round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_refusing_a_group_with_a_liar_tells_the_others_who_finish_without_it() {
    init_tracing();
    const LEADER: usize = 0;
    const WARY: usize = 1;
    const SUSPECT: usize = 2;
    bounded(Duration::from_secs(120), async {
        let swarm = AveragingSwarm::start(3, node_cfg(), |_| {
            let mut c = avg_cfg("declined", 1.0);
            c.target_group_size = 3;
            c.sender_timeout = Duration::from_secs(60);
            c.reducer_timeout = Duration::from_secs(60);
            c
        })
        .await
        .unwrap();
        let ids = swarm.peer_ids();
        let a = swarm.averagers();
        a[WARY].refuse_for_testing(&ids[SUSPECT]);
        // The leader waits for all three (the earliest window leads: it searches first).
        a[LEADER].expect_peers(Some(3));
        let before = data_for(0, 3);
        let weights = [1.0f32, 2.0, 3.0];
        let check = RoundCheck::new(ids.clone(), &before, &weights);
        let mut data = before.clone();
        let deadline = Instant::now() + Duration::from_secs(20);
        let steps = a.iter().zip(data.iter_mut()).zip(weights).enumerate().map(
            |(i, ((averager, tensors), w))| async move {
                if i != LEADER {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                let mut views: Vec<&mut [f32]> =
                    tensors.iter_mut().map(Vec::as_mut_slice).collect();
                averager.step(&mut views, w, deadline).await
            },
        );
        let results = futures::future::join_all(steps).await;
        for i in [LEADER, SUSPECT] {
            let report = results[i]
                .as_ref()
                .unwrap_or_else(|e| panic!("peer {i}: {e}"));
            // The leader's group listed the wary member (the case under test).
            assert_eq!(report.group.len(), 3, "peer {i}: {:?}", report.group);
            check.check_spans(i, report, &data[i]).unwrap();
            assert_eq!(
                report.averaged_fraction(),
                1.0,
                "peer {i}: {:?}",
                report.spans
            );
            for span in &report.spans {
                assert!(
                    !span
                        .outcome
                        .contributors()
                        .unwrap_or(&[])
                        .contains(&ids[WARY]),
                    "peer {i}: the member that declined is in {span:?}"
                );
            }
        }
        if let Ok(report) = &results[WARY] {
            assert!(!report.group.contains(&ids[SUSPECT]));
        }
        swarm.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn verification_refuses_an_aggregation_it_cannot_recompute() {
    let node = starling_node::Node::start(NodeConfig::default())
        .await
        .unwrap();
    let mut c = avg_cfg("verify-config", 0.5);
    c.aggregation = "centered-clip".parse().unwrap();
    let err = starling_averager::Averager::new(node.clone(), c)
        .await
        .err()
        .expect("centered-clip with verify must be refused");
    assert!(err.to_string().contains("coordinate-wise"), "{err}");
    let mut c = avg_cfg("verify-config", 1.5);
    c.verify = 1.5;
    assert!(starling_averager::Averager::new(node.clone(), c)
        .await
        .is_err());
    node.shutdown().await;
}
