//! Many consecutive rounds: memory and task counts stay flat.

use std::time::{Duration, Instant};

use starling_averager::AveragerConfig;
use starling_node::NodeConfig;
use starling_tests::{
    bounded, exact_weighted_mean, init_tracing, normal_tensors, rel_error, AveragingSwarm,
};

/// Resident memory of this process, in bytes (Linux).
fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Stated bound: after warm-up, 200 rounds may grow resident memory by at most this much
/// (allocator slack); a leak of one 40 KB tensor copy per round per peer would exceed it.
const RSS_GROWTH_BOUND: usize = 24 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_rounds_without_growth() {
    init_tracing();
    bounded(Duration::from_secs(600), async {
        let swarm = AveragingSwarm::start(4, NodeConfig::default(), |_| {
            let mut c = AveragerConfig::new("soak");
            c.target_group_size = 4;
            c.min_group_size = 4;
            c
        })
        .await
        .unwrap();
        let originals: Vec<Vec<Vec<f32>>> = (0..4).map(|i| normal_tensors(&[10_000], i)).collect();
        let weights = [1.0f32; 4];
        let mean = exact_weighted_mean(&originals, &weights);
        let metrics = tokio::runtime::Handle::current().metrics();
        let mut baseline = None;
        for round in 0..200 {
            if round == 20 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                baseline = Some((rss_bytes(), metrics.num_alive_tasks()));
            }
            let mut data = originals.clone();
            let deadline = Instant::now() + Duration::from_secs(30);
            let reports: Vec<_> = swarm
                .step_all(&mut data, &weights, deadline)
                .await
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| panic!("round {round}: {e}")))
                .collect();
            for (r, d) in reports.iter().zip(&data) {
                assert_eq!(r.group.len(), 4, "round {round}");
                assert!(
                    rel_error(&d[0], &mean[0]) < 1e-6,
                    "round {round}: {reports:#?}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (rss0, tasks0) = baseline.unwrap();
        let (rss1, tasks1) = (rss_bytes(), metrics.num_alive_tasks());
        assert!(
            rss1 <= rss0 + RSS_GROWTH_BOUND,
            "resident memory grew from {rss0} to {rss1} bytes over 180 rounds"
        );
        assert!(
            tasks1 <= tasks0 + 4,
            "alive tasks grew from {tasks0} to {tasks1}"
        );
        swarm.shutdown().await;
    })
    .await;
}
