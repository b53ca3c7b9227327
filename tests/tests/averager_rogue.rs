//! Malformed messages from a rogue group member, and garbage from strangers, never corrupt a
//! span or panic a task: every honest peer's tensors hold, span by span, the exact mean of the
//! contributors its report names (or its own values where the report says so), every refusal
//! comes with a reason, and the rogue's data is never counted where its first frame was bad.

use std::time::{Duration, Instant};

use futures::AsyncWriteExt;
use proptest::prelude::*;
use starling_averager::wire::{
    write_control, MatchMsg, MemberIdx, MemberInfo, ReduceMsg, MATCHMAKING_PROTOCOL,
    REDUCE_PROTOCOL,
};
use starling_averager::{
    Aggregation, AuditOutcome, AveragerConfig, AveragingMode, Fault, Rogue, SpanOutcome,
};
use starling_node::NodeConfig;
use starling_tests::{bounded, init_tracing, normal_tensors, AveragingSwarm, RoundCheck};

const PEERS: usize = 4;
const ROGUE: usize = 2;
const LEN: usize = 60_000;

fn node_cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(2))
}

fn avg_cfg(prefix: &str) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.target_group_size = PEERS;
    c.min_group_size = 2;
    c.matchmaking_time = Duration::from_secs(5);
    c.request_timeout = Duration::from_secs(1);
    c.sender_timeout = Duration::from_secs(1);
    c.reducer_timeout = Duration::from_secs(2);
    c.repair_min_time = Duration::from_millis(200);
    c.chunk_bytes = 16 * 1024; // several chunks and parts per span
    c
}

/// Whether the rogue's very first frame to a reducer is bad, so that no honest reducer may
/// count any of its data.
fn first_frame_is_bad(r: Rogue) -> bool {
    matches!(
        r,
        Rogue::HelloLength(_) | Rogue::HelloRound(_) | Rogue::ChunkOffset(_)
    )
}

/// One round of 4 peers where peer `ROGUE` misbehaves as `rogue` says.
async fn round_with(rogue: Rogue, case: u64) {
    round_aggregated(rogue, case, Aggregation::Mean, 0.0).await
}

/// [`round_with`], every peer's reducer applying `aggregation`, checking reducers with
/// probability `verify` (`AveragerConfig::verify`).
async fn round_aggregated(rogue: Rogue, case: u64, aggregation: Aggregation, verify: f64) {
    let prefix = format!("rogue-{case}");
    let swarm = AveragingSwarm::start(PEERS, node_cfg(), |i| {
        let mut c = avg_cfg(&prefix);
        c.aggregation = aggregation;
        c.verify = verify;
        if i == ROGUE {
            c.fault = Some(Fault::Rogue(rogue));
        }
        c
    })
    .await
    .unwrap();
    let mut data: Vec<Vec<Vec<f32>>> = (0..PEERS)
        .map(|i| normal_tensors(&[LEN], 100 * case + i as u64))
        .collect();
    let weights = [1.0, 2.0, 3.0, 4.0];
    let check = RoundCheck::new(swarm.peer_ids(), &data, &weights).with_aggregation(aggregation);
    let deadline = Instant::now() + Duration::from_secs(30);
    let results = swarm.step_all(&mut data, &weights, deadline).await;
    let rogue_id = swarm.peer_ids()[ROGUE];
    // Every lie is noticed: some honest peer names the rogue as failed.
    let noticed = results
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != ROGUE)
        .any(|(_, r)| r.as_ref().is_ok_and(|r| r.failed_peers.contains(&rogue_id)));
    assert!(noticed, "{rogue:?}: no honest peer noticed the rogue");
    for (i, r) in results.iter().enumerate() {
        if i == ROGUE {
            continue; // whatever it made of its own lies
        }
        let report = r
            .as_ref()
            .unwrap_or_else(|e| panic!("{rogue:?}: honest peer {i} failed: {e}"));
        check
            .check_spans(i, report, &data[i])
            .unwrap_or_else(|e| panic!("{rogue:?}: {e}"));
        if let Some(audit) = &report.audit {
            // Its lies are in the protocol, not in results: nobody is accused of a wrong one.
            assert!(
                !matches!(audit.outcome, AuditOutcome::Caught(_)),
                "{rogue:?}: peer {i} accused {}: {:?}",
                audit.reducer,
                audit.outcome
            );
        }
        for span in &report.spans {
            match &span.outcome {
                SpanOutcome::KeptLocal { reason } => {
                    assert!(!reason.is_empty(), "{rogue:?}: a refusal without a reason");
                    assert!(
                        !reason.contains("panic"),
                        "{rogue:?}: a task panicked: {reason}"
                    );
                }
                SpanOutcome::Averaged { contributors } if span.reducer != rogue_id => {
                    // (The rogue reduces its own span honestly: its data is in that one.)
                    if first_frame_is_bad(rogue) {
                        assert!(
                            !contributors.contains(&rogue_id),
                            "{rogue:?}: the rogue's data was counted in {span:?}"
                        );
                    }
                }
                SpanOutcome::Averaged { .. } | SpanOutcome::Redelegated { .. } => {}
            }
        }
    }
    let honest: Vec<_> = results
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != ROGUE)
        .filter_map(|(i, r)| r.as_ref().ok().map(|r| (i, r, &data[i][..])))
        .collect();
    check
        .check_agreement(&honest)
        .unwrap_or_else(|e| panic!("{rogue:?} ({aggregation}): {e}"));
    swarm.shutdown().await;
}

fn rogues() -> impl Strategy<Value = Rogue> {
    prop_oneof![
        (1u64..u64::MAX).prop_map(Rogue::HelloLength),
        (1u64..u64::MAX).prop_map(Rogue::HelloRound),
        (1u64..u64::MAX).prop_map(Rogue::ChunkOffset),
        Just(Rogue::DuplicateChunk),
        Just(Rogue::EarlyDone),
        (any::<u64>(), any::<u64>()).prop_map(|(start, len)| Rogue::ResultRange { start, len }),
        (PEERS as u32..u32::MAX).prop_map(Rogue::Contributor),
        Just(Rogue::DuplicateResult),
        (1u64..u64::MAX).prop_map(Rogue::DeltaOffset),
    ]
}

proptest! {
    // Each case is a whole 4-peer round on loopback: a few cases, every kind of lie.
    #![proptest_config(ProptestConfig { cases: 12, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn a_rogue_member_never_corrupts_a_span(rogue in rogues(), case in 0u64..1_000_000) {
        init_tracing();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(bounded(Duration::from_secs(90), round_with(rogue, case)));
    }
}

/// Every kind of lie, with fixed values at the edges (the property test above samples them at
/// random).
fn every_lie() -> [Rogue; 10] {
    [
        Rogue::HelloLength(u64::MAX),
        Rogue::HelloRound(1),
        Rogue::ChunkOffset(u64::MAX - 1),
        Rogue::DuplicateChunk,
        Rogue::EarlyDone,
        Rogue::ResultRange {
            start: u64::MAX,
            len: u64::MAX,
        },
        Rogue::ResultRange { start: 0, len: 0 },
        Rogue::Contributor(u32::MAX),
        Rogue::DuplicateResult,
        Rogue::DeltaOffset(u64::MAX),
    ]
}

/// Every kind of lie at least once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_lie_is_refused() {
    init_tracing();
    for (case, lie) in every_lie().into_iter().enumerate() {
        bounded(
            Duration::from_secs(90),
            round_with(lie, 1_000_000 + case as u64),
        )
        .await;
    }
}

/// Every kind of lie under each robust aggregator: the reducers refuse the rogue's frames the
/// same way, every honest span lies inside its contributors' range, and honest peers agree on
/// every span they averaged together.
async fn every_lie_is_refused_under(aggregation: &str, first_case: u64) {
    init_tracing();
    let aggregation: Aggregation = aggregation.parse().unwrap();
    for (case, lie) in every_lie().into_iter().enumerate() {
        bounded(
            Duration::from_secs(90),
            round_aggregated(lie, first_case + case as u64, aggregation, 0.0),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_lie_is_refused_under_the_median() {
    every_lie_is_refused_under("median", 2_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_lie_is_refused_under_the_trimmed_mean() {
    every_lie_is_refused_under("trimmed-mean", 3_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_lie_is_refused_under_centered_clipping() {
    every_lie_is_refused_under("centered-clip", 4_000_000).await;
}

/// Every kind of lie in verified rounds (every member checks a reducer after each round): the
/// seals and checks change nothing of how lies are refused, and honest peers never accuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_lie_is_refused_in_verified_rounds() {
    init_tracing();
    for (case, lie) in every_lie().into_iter().enumerate() {
        bounded(
            Duration::from_secs(90),
            round_aggregated(lie, 5_000_000 + case as u64, Aggregation::Mean, 1.0),
        )
        .await;
    }
}

/// A stranger (a node of the swarm that is not in the group) floods every averager with
/// malformed matchmaking and reduce streams while the group averages: garbage bytes, oversized
/// length words, a join that names another peer or has a NaN bandwidth, hellos for unknown
/// rounds and out-of-range members. The group still averages exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_garbage_never_disturbs_a_round() {
    init_tracing();
    bounded(Duration::from_secs(90), async {
        let swarm = AveragingSwarm::start(PEERS, node_cfg(), |_| avg_cfg("strangers"))
            .await
            .unwrap();
        let stranger = starling_node::Node::start(
            node_cfg()
                .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
                .bootstrap_from(swarm.nodes()[0].listen_addrs().await.unwrap()[0].clone()),
        )
        .await
        .unwrap();
        let targets: Vec<_> = swarm.nodes().iter().map(|n| n.peer_id()).collect();
        let flood = {
            let stranger = stranger.clone();
            async move {
                let mut control = stranger.stream_control();
                let fake = MemberInfo {
                    peer_id: targets[0].to_bytes(), // not the stranger's own id
                    mode: AveragingMode::Node,
                    bandwidth: f64::NAN,
                    addrs: vec![],
                    tag: 0,
                };
                for round in 0..3u64 {
                    for &peer in &targets {
                        let garbage: [&[u8]; 3] = [
                            b"\xff\xff\xff\x7fjunk",
                            b"\x05\x00\x00\x00\x00\xff\xff\xff\xff",
                            b"hello?",
                        ];
                        for proto in [MATCHMAKING_PROTOCOL, REDUCE_PROTOCOL] {
                            for bytes in garbage {
                                if let Ok(mut s) = control.open_stream(peer, proto.clone()).await {
                                    let _ = s.write_all(bytes).await;
                                    let _ = s.close().await;
                                }
                            }
                        }
                        if let Ok(mut s) = control.open_stream(peer, MATCHMAKING_PROTOCOL).await {
                            let join = MatchMsg::Join {
                                group_key: "strangers".into(),
                                info: fake.clone(),
                                window_end: 0,
                            };
                            let _ = write_control(&mut s, &join).await;
                        }
                        if let Ok(mut s) = control.open_stream(peer, REDUCE_PROTOCOL).await {
                            let hello = ReduceMsg::RepairHello {
                                round_id: round,
                                sender: MemberIdx(u32::MAX),
                                weight: f64::NAN,
                                failed: MemberIdx(u32::MAX),
                                start: u64::MAX,
                                len: u64::MAX,
                            };
                            let _ = write_control(&mut s, &hello).await;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let mut data: Vec<Vec<Vec<f32>>> = (0..PEERS)
            .map(|i| normal_tensors(&[LEN], 7_000 + i as u64))
            .collect();
        let weights = [1.0; PEERS];
        let check = RoundCheck::new(swarm.peer_ids(), &data, &weights);
        let deadline = Instant::now() + Duration::from_secs(40);
        let (results, ()) = tokio::join!(swarm.step_all(&mut data, &weights, deadline), flood);
        for (i, r) in results.iter().enumerate() {
            let report = r.as_ref().unwrap_or_else(|e| panic!("peer {i}: {e}"));
            assert_eq!(
                report.averaged_fraction(),
                1.0,
                "peer {i}: {:?}",
                report.spans
            );
            check.check_spans(i, report, &data[i]).unwrap();
        }
        stranger.shutdown().await;
        swarm.shutdown().await;
    })
    .await;
}
