//! Each way a step can fail names its real cause: a schema mismatch names both schemas, a
//! deadline already past, a second concurrent step, a bad weight, this peer's own node dying
//! mid-step (ends the step at once), and `step_blocking` from inside a runtime. Also the
//! blocking step itself, from plain threads.

use std::time::{Duration, Instant};

use starling_averager::{Averager, AveragerConfig, AveragerError, Fault};
use starling_node::{cluster::LocalCluster, NodeConfig, NodeError};
use starling_tests::{
    bounded, exact_weighted_mean, init_tracing, normal_tensors, normal_vec, rel_error,
    AveragingSwarm,
};

fn node_cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(5))
}

fn avg_cfg(prefix: &str) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.target_group_size = 2;
    c.min_group_size = 2;
    c.matchmaking_time = Duration::from_secs(3);
    c
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(120)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_mismatch_names_both_schemas() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let swarm = AveragingSwarm::start(2, node_cfg(), |_| avg_cfg("mismatch"))
            .await
            .unwrap();
        let mut data = vec![normal_tensors(&[1000], 1), normal_tensors(&[2000], 2)];
        let reports = swarm.step_all(&mut data, &[1.0, 1.0], far()).await;
        for (r, (mine, theirs)) in reports
            .into_iter()
            .zip([("1000", "2000"), ("2000", "1000")])
        {
            match r {
                Err(e @ AveragerError::SchemaMismatch { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains(&format!("{mine} elements")), "{msg}");
                    assert!(msg.contains(&format!("{theirs} elements")), "{msg}");
                }
                other => panic!("expected SchemaMismatch, got {other:?}"),
            }
        }
        swarm.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_and_a_second_step_get_their_own_errors() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let cluster = LocalCluster::start(1, node_cfg()).await.unwrap();
        let averager = Averager::new(cluster.nodes[0].clone(), avg_cfg("args"))
            .await
            .unwrap();
        let mut t = normal_vec(100, 3);
        let before = t.clone();
        let past = Instant::now() - Duration::from_millis(1);
        assert!(matches!(
            averager.step(&mut [&mut t[..]], 1.0, past).await,
            Err(AveragerError::Deadline(_))
        ));
        assert!(matches!(
            averager.step(&mut [&mut t[..]], -1.0, far()).await,
            Err(AveragerError::InvalidWeight(w)) if w == -1.0
        ));
        assert!(matches!(
            averager.step(&mut [&mut t[..]], f32::INFINITY, far()).await,
            Err(AveragerError::InvalidWeight(_))
        ));
        // A second step while one is searching.
        let mut u = normal_vec(100, 4);
        {
            let mut vt = [&mut t[..]];
            let first = averager.step(&mut vt, 1.0, far());
            let second = async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                averager.step(&mut [&mut u[..]], 1.0, far()).await
            };
            tokio::pin!(first);
            let second = tokio::select! {
                r = second => r,
                r = &mut first => panic!("the first step ended first: {r:?}"),
            };
            assert!(
                matches!(second, Err(AveragerError::StepInProgress)),
                "{second:?}"
            );
            // Dropping the first step half-way frees the averager for the next one.
        }
        match averager.step(&mut [&mut t[..]], 1.0, far()).await {
            Err(AveragerError::NoGroup { alone: true, .. }) => {}
            other => panic!("expected a lone NoGroup, got {other:?}"),
        }
        assert_eq!(t, before, "failed steps change nothing");
        // step_blocking inside a runtime would stall it.
        assert!(matches!(
            averager.step_blocking(&mut [&mut t[..]], 1.0, far()),
            Err(AveragerError::BlockingInRuntime)
        ));
        averager.shutdown().await;
        cluster.shutdown().await;
    })
    .await;
}

/// A peer whose own node shuts down while it searches learns it within a second, not after
/// its window or deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_own_node_ends_the_step_at_once() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let cluster = LocalCluster::start(1, node_cfg()).await.unwrap();
        let node = cluster.nodes[0].clone();
        let mut cfg = avg_cfg("dead");
        cfg.matchmaking_time = Duration::from_secs(30);
        let averager = Averager::new(node.clone(), cfg).await.unwrap();
        let mut t = normal_vec(100, 5);
        let before = t.clone();
        let mut vt = [&mut t[..]];
        let step = averager.step(&mut vt, 1.0, far());
        let kill = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            node.shutdown().await;
            Instant::now()
        };
        let (r, killed_at) = tokio::join!(step, kill);
        let waited = killed_at.elapsed();
        assert!(
            matches!(r, Err(AveragerError::Node(NodeError::Closed))),
            "{r:?}"
        );
        assert!(
            waited < Duration::from_secs(1),
            "returned {waited:?} after the node stopped"
        );
        assert_eq!(t, before);
        // And a step on a dead node fails at once.
        assert!(matches!(
            averager.step(&mut [&mut t[..]], 1.0, far()).await,
            Err(AveragerError::Node(NodeError::Closed))
        ));
        averager.shutdown().await;
    })
    .await;
}

/// Mid-round: a peer that crashes after the group formed (its node shuts down before it sends
/// anything) gets `Node(Closed)` back instead of `Ok` after the deadline; the other averages
/// without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_node_dies_mid_round_gets_closed() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let swarm = AveragingSwarm::start(2, node_cfg(), |i| {
            let mut c = avg_cfg("midround");
            if i == 1 {
                c.fault = Some(Fault::BeforeSending);
            }
            c
        })
        .await
        .unwrap();
        let [a, b] = swarm.averagers() else {
            unreachable!("two peers")
        };
        let mut x = normal_vec(10_000, 6);
        let mut y = normal_vec(10_000, 7);
        let deadline = Instant::now() + Duration::from_secs(40);
        let started = Instant::now();
        let (mut vx, mut vy) = ([&mut x[..]], [&mut y[..]]);
        let (ra, rb) = tokio::join!(a.step(&mut vx, 1.0, deadline), async {
            let r = b.step(&mut vy, 1.0, deadline).await;
            (r, started.elapsed())
        });
        let (rb, took) = rb;
        assert!(
            matches!(rb, Err(AveragerError::Node(NodeError::Closed))),
            "{rb:?}"
        );
        assert!(
            took < Duration::from_secs(20),
            "the crashed peer waited {took:?}"
        );
        // The survivor is not averaged with anyone: it keeps its values.
        if let Ok(r) = ra {
            assert_eq!(r.averaged_fraction(), 0.0);
        }
        swarm.shutdown().await;
    })
    .await;
}

/// Two training loops on plain threads average with `step_blocking` while the network runs on
/// a separate multi-threaded runtime.
#[test]
fn step_blocking_averages_from_plain_threads() {
    init_tracing();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let swarm = rt
        .block_on(AveragingSwarm::start(2, node_cfg(), |_| {
            avg_cfg("blocking")
        }))
        .unwrap();
    let data: Vec<Vec<Vec<f32>>> = (0..2).map(|i| normal_tensors(&[50_000], 10 + i)).collect();
    let weights = [1.0f32, 3.0];
    let exact = exact_weighted_mean(&data, &weights).remove(0);
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = swarm
            .averagers()
            .iter()
            .zip(&data)
            .zip(weights)
            .map(|((a, d), w)| {
                s.spawn(move || {
                    let mut t = d[0].clone();
                    let deadline = Instant::now() + Duration::from_secs(60);
                    let report = a.step_blocking(&mut [&mut t[..]], w, deadline).unwrap();
                    assert_eq!(report.averaged_fraction(), 1.0);
                    t
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &results {
        assert!(rel_error(r, &exact) < 1e-6, "{}", rel_error(r, &exact));
    }
    rt.block_on(swarm.shutdown());
}
