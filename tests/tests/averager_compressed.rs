//! Compressed gradient rounds between peers. Low rank (PowerSGD): the two all-reduces of a
//! round run in one group and leave every member with the same bits, the approximation a plain
//! reference computes. DCT top-k: the sparse coefficients are averaged exactly, and every member
//! holds the inverse transform of their mean.

use std::time::{Duration, Instant};

use starling_averager::{AveragerConfig, AveragerError, Fault, SpanOutcome};
use starling_compression::dct::{DctTopK, DctValues};
use starling_compression::lowrank::{LowRankMatrix, PowerSgd};
use starling_compression::Codec;
use starling_node::NodeConfig;
use starling_tests::{bounded, init_tracing, normal_vec, AveragingSwarm};

const ROWS: usize = 256;
const COLS: usize = 128;
const SMALL: usize = 64;
/// A 256x128 matrix, a 64x64 one, and a bias of 128.
const LEN: usize = ROWS * COLS + SMALL * SMALL + 128;

fn layout() -> Vec<LowRankMatrix> {
    vec![
        LowRankMatrix {
            offset: 0,
            rows: ROWS,
            cols: COLS,
        },
        LowRankMatrix {
            offset: ROWS * COLS,
            rows: SMALL,
            cols: SMALL,
        },
    ]
}

fn avg_cfg(prefix: &str, peers: usize) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.target_group_size = peers;
    c.min_group_size = 2;
    c.matchmaking_time = Duration::from_secs(5);
    c.request_timeout = Duration::from_secs(3);
    c.sender_timeout = Duration::from_secs(3);
    c.reducer_timeout = Duration::from_secs(5);
    c
}

fn node_cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(3))
}

/// What every peer should hold after a round, from a plain simulation: the same PowerSGD
/// arithmetic with the mean taken in f64.
fn reference(states: &mut [PowerSgd], grads: &[Vec<f32>]) -> Vec<f32> {
    let mean = |vs: &[Vec<f32>]| -> Vec<f32> {
        (0..vs[0].len())
            .map(|i| (vs.iter().map(|v| f64::from(v[i])).sum::<f64>() / vs.len() as f64) as f32)
            .collect()
    };
    let firsts: Vec<Vec<f32>> = states
        .iter_mut()
        .zip(grads)
        .map(|(s, g)| {
            let mut v = vec![0.0; s.phase_one_len()];
            s.begin(g, &mut v).unwrap();
            v
        })
        .collect();
    let mut one = mean(&firsts);
    let seconds: Vec<Vec<f32>> = states
        .iter_mut()
        .map(|s| {
            let mut p = one.clone();
            let mut v = vec![0.0; s.phase_two_len()];
            s.middle(&mut p, &mut v).unwrap();
            v
        })
        .collect();
    let two = mean(&seconds);
    let mut out = grads[0].clone();
    let mut p = states[0].clone();
    p.middle(&mut one, &mut vec![0.0; two.len()]).unwrap();
    p.finish(&one, &two, &mut out).unwrap();
    for s in &mut states[1..] {
        let mut scratch = one.clone();
        s.middle(&mut scratch, &mut vec![0.0; two.len()]).unwrap();
        let mut o = grads[0].clone();
        s.finish(&scratch, &two, &mut o).unwrap();
    }
    states[0] = p;
    out
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}

/// Three rounds of four peers whose factors travel as `values`, beside the f32 reference on
/// shadow states: every member holds the same bits and every span is averaged by all four;
/// returns, per round, each peer's bytes sent and peer 0's relative distance from the reference.
async fn four_peer_rounds(prefix: &str, values: Codec) -> Vec<(Vec<u64>, f64)> {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let swarm = AveragingSwarm::start(4, node_cfg(), |_| avg_cfg(prefix, 4))
            .await
            .unwrap();
        let state = || PowerSgd::new(4, LEN, &layout(), 9).unwrap();
        let mut states: Vec<PowerSgd> = (0..4).map(|_| state().values(values).unwrap()).collect();
        // The f32 reference's states start alike and then follow their own results.
        let mut shadow: Vec<PowerSgd> = (0..4).map(|_| state()).collect();
        let mut out = Vec::new();
        for round in 0..3u64 {
            let mut grads: Vec<Vec<f32>> = (0..4).map(|p| normal_vec(LEN, 40 * round + p)).collect();
            let want = reference(&mut shadow, &grads);
            let deadline = Instant::now() + Duration::from_secs(40);
            let reports = futures::future::join_all(
                swarm
                    .averagers()
                    .iter()
                    .zip(&mut grads)
                    .zip(&mut states)
                    .map(|((a, g), s)| a.step_low_rank(g, 1.0, deadline, s)),
            )
            .await;
            let mut bytes = Vec::new();
            for (p, r) in reports.iter().enumerate() {
                let r = r.as_ref().unwrap_or_else(|e| panic!("peer {p}: {e}"));
                assert_eq!(r.group.len(), 4);
                assert!(matches!(&r.spans[0].outcome, SpanOutcome::Averaged { contributors } if contributors.len() == 4));
                bytes.push(r.bytes_sent);
            }
            for p in 1..4 {
                assert!(grads[p] == grads[0], "round {round}: peer {p} holds other bits than peer 0");
            }
            out.push((bytes, rel(&grads[0], &want)));
        }
        swarm.shutdown().await;
        out
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_peers_hold_the_same_low_rank_average_as_a_plain_reference() {
    for (round, (bytes, e)) in four_peer_rounds("lowrank", Codec::None)
        .await
        .into_iter()
        .enumerate()
    {
        // Both all-reduces together: far fewer bytes than one f32 all-reduce (3/4 of the
        // buffer out to reducers and 3/4 back, at 4 bytes a value).
        let dense = (LEN * 4 * 3 / 4 * 2) as u64;
        assert!(
            bytes.iter().all(|b| b * 10 < dense),
            "round {round}: {bytes:?} bytes"
        );
        assert!(e < 1e-4, "round {round}: {e} from the reference");
    }
}

/// Two peers whose low-rank states differ in `states` never average together: neither's
/// gradient or residual changes.
async fn never_group(prefix: &str, mut states: [PowerSgd; 2]) {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let swarm = AveragingSwarm::start(2, node_cfg(), |_| {
            let mut c = avg_cfg(prefix, 2);
            c.matchmaking_time = Duration::from_secs(2);
            c
        })
        .await
        .unwrap();
        let mut grads: Vec<Vec<f32>> = (0..2).map(|p| normal_vec(LEN, p)).collect();
        let before = grads.clone();
        let deadline = Instant::now() + Duration::from_secs(6);
        let reports = futures::future::join_all(
            swarm
                .averagers()
                .iter()
                .zip(&mut grads)
                .zip(&mut states)
                .map(|((a, g), s)| a.step_low_rank(g, 1.0, deadline, s)),
        )
        .await;
        for r in &reports {
            assert!(
                matches!(
                    r,
                    Err(AveragerError::SchemaMismatch { .. } | AveragerError::NoGroup { .. })
                ),
                "{r:?}"
            );
        }
        assert_eq!(grads, before, "nothing changes without a round");
        assert!(states
            .iter()
            .all(|s| s.residual().iter().all(|&r| r == 0.0)));
        swarm.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_rank_is_another_schema() {
    never_group(
        "lowrank-ranks",
        [
            PowerSgd::new(2, LEN, &layout(), 1).unwrap(),
            PowerSgd::new(4, LEN, &layout(), 1).unwrap(),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f32_and_bf16_factors_are_other_schemas() {
    never_group(
        "lowrank-values",
        [
            PowerSgd::new(4, LEN, &layout(), 1).unwrap(),
            PowerSgd::new(4, LEN, &layout(), 1)
                .unwrap()
                .values(Codec::BFloat16)
                .unwrap(),
        ],
    )
    .await;
}

/// With bf16 factors every member still holds the same bits, within bf16's precision of the
/// f32 reference, for about half the bytes of f32 factors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_factors_leave_every_member_the_same_bits_for_half_the_bytes() {
    // As f32: 3/4 of both vectors out to the other reducers, 3/4 back from them.
    let elements = PowerSgd::new(4, LEN, &layout(), 9)
        .unwrap()
        .elements_per_round();
    let f32_bytes = (elements * 4 * 3 / 4 * 2) as u64;
    let rounds = four_peer_rounds("lowrank-bf16", Codec::BFloat16).await;
    for (round, (bytes, e)) in rounds.into_iter().enumerate() {
        // At 2 bytes a value (plus the round's messages and frame headers).
        assert!(
            bytes.iter().all(|b| b * 100 < f32_bytes * 65),
            "round {round}: {bytes:?} bytes, {f32_bytes} as f32"
        );
        // Only the first round's states match the reference's exactly (later ones follow
        // their own rounded results): the first is held to bf16's precision, the later ones
        // to staying an approximation of the same subspace.
        let bound = if round == 0 { 1e-2 } else { 0.1 };
        assert!(
            e > 0.0 && e < bound,
            "round {round}: {e} from the f32 reference"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_of_a_peer_killed_mid_round_agree_or_keep_their_gradient() {
    survivors_agree("lowrank-kill", Codec::None).await;
}

/// The same with bf16 factors: the re-delegated span's new reducer rounds its result too, so
/// the survivors that averaged still hold the same bits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_with_bf16_factors_agree_or_keep_their_gradient() {
    survivors_agree("lowrank-kill-bf16", Codec::BFloat16).await;
}

/// Peer 2 of 4 crashes while reducing its span of a low-rank round whose factors travel as
/// `values`: the survivors re-delegate it, and each either averaged (all of those with the
/// same bits) or kept its gradient and residual.
async fn survivors_agree(prefix: &str, values: Codec) {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let swarm = AveragingSwarm::start(4, node_cfg(), |i| {
            let mut c = avg_cfg(prefix, 4);
            if i == 2 {
                c.fault = Some(Fault::WhileReducing);
            }
            c
        })
        .await
        .unwrap();
        let mut states: Vec<PowerSgd> = (0..4)
            .map(|_| {
                PowerSgd::new(4, LEN, &layout(), 3)
                    .unwrap()
                    .values(values)
                    .unwrap()
            })
            .collect();
        let mut grads: Vec<Vec<f32>> = (0..4).map(|p| normal_vec(LEN, 70 + p)).collect();
        let before = grads.clone();
        let deadline = Instant::now() + Duration::from_secs(40);
        let reports = futures::future::join_all(
            swarm
                .averagers()
                .iter()
                .zip(&mut grads)
                .zip(&mut states)
                .map(|((a, g), s)| a.step_low_rank(g, 1.0, deadline, s)),
        )
        .await;
        assert!(reports[2].is_err(), "the victim crashed");
        let mut averaged = Vec::new();
        for p in [0, 1, 3] {
            let r = reports[p]
                .as_ref()
                .unwrap_or_else(|e| panic!("survivor {p}: {e}"));
            match &r.spans[0].outcome {
                SpanOutcome::Averaged { .. } => averaged.push(p),
                SpanOutcome::KeptLocal { .. } => {
                    assert_eq!(grads[p], before[p], "survivor {p} kept its gradient");
                    assert!(states[p].residual().iter().all(|&v| v == 0.0));
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(
            !averaged.is_empty(),
            "the survivors re-delegated the victim's span"
        );
        for p in &averaged {
            assert!(
                grads[*p] == grads[averaged[0]],
                "survivors {p} and {} differ",
                averaged[0]
            );
        }
        swarm.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_peers_hold_the_inverse_transform_of_the_mean_sparse_coefficients() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let swarm = AveragingSwarm::start(4, node_cfg(), |_| avg_cfg("dct", 4))
            .await
            .unwrap();
        for values in [DctValues::F16, DctValues::Sign] {
            let mut states: Vec<DctTopK> = (0..4)
                .map(|_| DctTopK::new(LEN, 64, 4, values).unwrap())
                .collect();
            let mut shadow = states.clone();
            for round in 0..2u64 {
                let mut grads: Vec<Vec<f32>> =
                    (0..4).map(|p| normal_vec(LEN, 90 + 10 * round + p)).collect();
                // The reference: each peer's kept coefficients, their mean in f64, inverted.
                let coefficients: Vec<Vec<f32>> = shadow
                    .iter_mut()
                    .zip(&grads)
                    .map(|(s, g)| {
                        let mut c = vec![0.0; LEN];
                        s.begin(g, &mut c).unwrap();
                        c
                    })
                    .collect();
                let mean: Vec<f32> = (0..LEN)
                    .map(|i| {
                        (coefficients.iter().map(|c| f64::from(c[i])).sum::<f64>() / 4.0) as f32
                    })
                    .collect();
                let mut want = vec![0.0; LEN];
                for s in &mut shadow {
                    s.finish(&mean, &mut want).unwrap();
                }
                let deadline = Instant::now() + Duration::from_secs(40);
                let reports = futures::future::join_all(
                    swarm
                        .averagers()
                        .iter()
                        .zip(&mut grads)
                        .zip(&mut states)
                        .map(|((a, g), s)| a.step_sparse(g, 1.0, deadline, s)),
                )
                .await;
                let dense = (LEN * 4 * 3 / 4 * 2) as u64;
                for (p, r) in reports.iter().enumerate() {
                    let r = r.as_ref().unwrap_or_else(|e| panic!("peer {p}: {e}"));
                    assert!(matches!(&r.spans[0].outcome, SpanOutcome::Averaged { contributors } if contributors.len() == 4));
                    // A sixteenth of the coefficients out, up to four sixteenths back.
                    assert!(r.bytes_sent * 3 < dense, "{values:?} round {round} peer {p}: {} bytes of {dense}", r.bytes_sent);
                    eprintln!("{values:?} round {round} peer {p}: {} bytes sent, dense {dense}", r.bytes_sent);
                }
                for p in 1..4 {
                    assert!(grads[p] == grads[0], "{values:?} round {round}: peer {p} differs");
                }
                let e = rel(&grads[0], &want);
                assert!(e < 1e-5, "{values:?} round {round}: {e} from the reference");
                for (s, r) in states.iter().zip(&shadow) {
                    assert!(rel(s.residual(), r.residual()) < 1e-6, "the residuals agree");
                }
            }
        }
        swarm.shutdown().await;
    })
    .await;
}

/// After a round, its members compare digests of their state and average the state only where
/// one differs: identical states cost a few hundred bytes and stay as they were; one member's
/// state changed by hand is caught and every member ends with the exact weighted mean (the
/// same bits everywhere); a caller that knows the states differ (no digest) averages at once;
/// a round this averager never took is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_average_their_state_only_where_their_digests_differ() {
    init_tracing();
    const STATE: usize = 50_000;
    bounded(Duration::from_secs(120), async {
        let swarm = AveragingSwarm::start(4, node_cfg(), |_| avg_cfg("reconcile", 4))
            .await
            .unwrap();
        let weights = [1.0f32, 2.0, 3.0, 4.0];
        let digest = |s: &[f32]| {
            s.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
                (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
            })
        };
        // Three rounds: the states equal; peer 2's changed; no digests at all.
        for (case, tamper, with_digest) in
            [(0, None, true), (1, Some(2usize), true), (2, None, false)]
        {
            let mut grads: Vec<Vec<Vec<f32>>> = (0..4)
                .map(|p| vec![normal_vec(1000, 10 * case + p)])
                .collect();
            let deadline = Instant::now() + Duration::from_secs(40);
            let rounds = swarm.step_all(&mut grads, &weights, deadline).await;
            let common = normal_vec(STATE, 77);
            let mut states: Vec<Vec<f32>> = (0..4)
                .map(|p| match tamper {
                    Some(t) if t == p => normal_vec(STATE, 78),
                    _ if case == 2 => normal_vec(STATE, 90 + p as u64),
                    _ => common.clone(),
                })
                .collect();
            let mut want = starling_tests::WeightedMean::default();
            for (s, w) in states.iter().zip(weights) {
                want.add(std::slice::from_ref(s), w);
            }
            let want = want.finish().remove(0);
            let before = states.clone();
            let done = futures::future::join_all(
                swarm
                    .averagers()
                    .iter()
                    .zip(&rounds)
                    .zip(&mut states)
                    .zip(weights)
                    .map(|(((a, r), s), w)| {
                        let r = r.as_ref().expect("the round formed");
                        let d = with_digest.then(|| digest(s));
                        async move { a.reconcile(r, d, &mut [&mut s[..]], w, deadline).await }
                    }),
            )
            .await;
            for (p, d) in done.iter().enumerate() {
                let d = d
                    .as_ref()
                    .unwrap_or_else(|e| panic!("case {case} peer {p}: {e}"));
                assert!(d.error.is_none(), "case {case} peer {p}: {:?}", d.error);
                if case == 0 {
                    assert!(d.agreed && d.averaged_fraction == 0.0, "peer {p}: {d:?}");
                    assert!(
                        d.bytes_sent < 2_000,
                        "peer {p} sent {} bytes to compare",
                        d.bytes_sent
                    );
                    assert!(states[p] == before[p], "peer {p}'s agreed state changed");
                } else {
                    assert!(
                        !d.agreed && d.averaged_fraction == 1.0,
                        "case {case} peer {p}: {d:?}"
                    );
                    assert!(d.bytes_sent > (STATE * 4 / 2) as u64);
                    assert!(
                        states[p] == states[0],
                        "case {case}: peer {p} holds other bits than peer 0"
                    );
                }
            }
            if case > 0 {
                let e = rel(&states[0], &want);
                assert!(e < 1e-6, "case {case}: {e} from the exact weighted mean");
            }
        }
        // A round this averager never took.
        let mut grads: Vec<Vec<Vec<f32>>> = (0..4).map(|p| vec![normal_vec(1000, p)]).collect();
        let deadline = Instant::now() + Duration::from_secs(40);
        let mut r = swarm
            .step_all(&mut grads, &weights, deadline)
            .await
            .remove(0)
            .unwrap();
        r.round_id ^= 1;
        let mut s = normal_vec(10, 1);
        let refused = swarm.averagers()[0]
            .reconcile(&r, Some(1), &mut [&mut s[..]], 1.0, deadline)
            .await;
        assert!(
            matches!(refused, Err(AveragerError::Config(_))),
            "{refused:?}"
        );
        // NaN in the state is refused before anything goes out.
        s[3] = f32::NAN;
        let r = swarm
            .step_all(&mut grads, &weights, deadline)
            .await
            .remove(0)
            .unwrap();
        let refused = swarm.averagers()[0]
            .reconcile(&r, Some(1), &mut [&mut s[..]], 1.0, deadline)
            .await;
        assert!(
            matches!(refused, Err(AveragerError::NonFinite(_))),
            "{refused:?}"
        );
        swarm.shutdown().await;
    })
    .await;
}
