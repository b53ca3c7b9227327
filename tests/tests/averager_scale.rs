//! Matchmaking at scale: 64 averagers on 127.0.0.1.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use starling_averager::AveragerConfig;
use starling_node::NodeConfig;
use starling_tests::{bounded, init_tracing, normal_tensors, AveragingSwarm, RoundCheck};

const N: usize = 64;
const GROUP: usize = 8;
const LEN: usize = 256;

/// The two tests take turns: 64 peers each on two cores is the load being measured.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn cfg(prefix: &str, group_bits: u32, window: Duration) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.target_group_size = GROUP;
    c.min_group_size = 2;
    c.group_bits = group_bits;
    c.matchmaking_time = window;
    c
}

fn node_cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(10))
}

/// 64 peers under one key, target 8: one step forms eight groups of exactly eight, none left
/// out, every peer in one group within one matchmaking window (20 s; measured here: the last
/// group begins 14.9-18.0 s in, the groups forming one after another, and 11.7-17.5 s since DHT
/// records decode byte strings in one copy: the 64 peers' lookups of the key, a 64-entry
/// record each, keep both cores busy); each holds the exact weighted mean of its group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_peers_form_groups_of_eight_in_one_window() {
    init_tracing();
    let _turn = ONE_AT_A_TIME.lock().await;
    bounded(Duration::from_secs(300), async {
        let window = Duration::from_secs(20);
        let swarm = AveragingSwarm::start(N, node_cfg(), |_| cfg("scale", 0, window))
            .await
            .unwrap();
        let weights: Vec<f32> = (0..N).map(|p| 1.0 + (p % 5) as f32 * 0.5).collect();
        let mut values: Vec<Vec<Vec<f32>>> = (0..N)
            .map(|p| normal_tensors(&[LEN], 900 + p as u64))
            .collect();
        let before = values.clone();
        let started = Instant::now();
        let reports = swarm
            .step_all(
                &mut values,
                &weights,
                Instant::now() + Duration::from_secs(120),
            )
            .await;
        eprintln!(
            "64 peers, one step: {:.2} s",
            started.elapsed().as_secs_f64()
        );
        let check = RoundCheck::new(swarm.peer_ids(), &before, &weights);
        for (p, r) in reports.iter().enumerate() {
            match r {
                Ok(r) => eprintln!(
                    "peer {p}: group of {}, matchmaking {:.2} s",
                    r.group.len(),
                    r.matchmaking_time.as_secs_f64()
                ),
                Err(e) => eprintln!("peer {p}: {e}"),
            }
        }
        let mut groups: HashSet<BTreeSet<usize>> = HashSet::new();
        for (p, r) in reports.iter().enumerate() {
            let r = r
                .as_ref()
                .unwrap_or_else(|e| panic!("peer {p} found no group: {e}"));
            assert!(
                r.matchmaking_time < window,
                "peer {p} needed more than one window: {:?}",
                r.matchmaking_time
            );
            let members: BTreeSet<usize> = r.group.iter().map(|id| check.index_of(id)).collect();
            assert!(members.contains(&p));
            check
                .check_spans(p, r, &values[p])
                .unwrap_or_else(|e| panic!("peer {p}: {e}"));
            groups.insert(members);
        }
        let sizes: Vec<usize> = groups.iter().map(BTreeSet::len).collect();
        assert_eq!(sizes, vec![GROUP; N / GROUP], "groups: {groups:?}");
        let covered: BTreeSet<usize> = groups.iter().flatten().copied().collect();
        assert_eq!(covered.len(), N, "every peer in exactly one group");
        swarm.shutdown().await;
    })
    .await;
}

/// 64 peers on a grid of 8 group keys (`group_bits` 3, target 8): rounds re-key each peer by
/// its index in its last group, so information spreads across keys; a peer alone in its cell
/// draws another. Every peer carries information from all 64 within 6 rounds (measured: 4; a
/// perfect 8x8 grid needs 2, but the first round's cells are random, so some hold fewer than 8
/// peers or one left over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_grid_information_from_all_64_reaches_every_peer_within_six_rounds() {
    init_tracing();
    let _turn = ONE_AT_A_TIME.lock().await;
    bounded(Duration::from_secs(600), async {
        let window = Duration::from_secs(10);
        let swarm = AveragingSwarm::start(N, node_cfg(), |_| cfg("scale-grid", 3, window))
            .await
            .unwrap();
        let weights = vec![1.0f32; N];
        let mut values: Vec<Vec<Vec<f32>>> = (0..N)
            .map(|p| normal_tensors(&[LEN], 100 + p as u64))
            .collect();
        let mut origins: Vec<HashSet<usize>> = (0..N).map(|p| [p].into_iter().collect()).collect();
        let mut rounds = 0;
        while origins.iter().any(|o| o.len() < N) && rounds < 6 {
            rounds += 1;
            let before = values.clone();
            let started = Instant::now();
            let reports = swarm
                .step_all(
                    &mut values,
                    &weights,
                    Instant::now() + Duration::from_secs(60),
                )
                .await;
            let check = RoundCheck::new(swarm.peer_ids(), &before, &weights);
            let mut next = origins.clone();
            let mut grouped = 0;
            for (p, r) in reports.iter().enumerate() {
                let Ok(r) = r else {
                    assert_eq!(
                        values[p], before[p],
                        "a failed step must not touch the tensors"
                    );
                    continue;
                };
                grouped += 1;
                check
                    .check_spans(p, r, &values[p])
                    .unwrap_or_else(|e| panic!("round {rounds}, peer {p}: {e}"));
                for contributors in r.spans.iter().filter_map(|s| s.outcome.contributors()) {
                    for c in contributors {
                        next[p].extend(origins[check.index_of(c)].iter().copied());
                    }
                }
            }
            origins = next;
            let least = origins.iter().map(HashSet::len).min().unwrap_or(0);
            eprintln!(
                "grid round {rounds}: {:.2} s, {grouped} of {N} grouped, every peer has heard \
                 from at least {least}",
                started.elapsed().as_secs_f64()
            );
        }
        assert!(
            origins.iter().all(|o| o.len() == N),
            "after {rounds} rounds some peer has not heard from all 64"
        );
        swarm.shutdown().await;
    })
    .await;
}
