//! Many consecutive rounds: memory and task counts stay flat.

use std::time::{Duration, Instant};

use starling_averager::{Averager, AveragerConfig};
use starling_node::{cluster::LocalCluster, NodeConfig};
use starling_tests::{bounded, init_tracing, normal_vec, rel_error};

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
        let cluster = LocalCluster::start(4, NodeConfig::default()).await.unwrap();
        let mut averagers = Vec::new();
        for n in &cluster.nodes {
            let mut c = AveragerConfig::new("soak");
            c.target_group_size = 4;
            c.min_group_size = 4;
            averagers.push(Averager::new(n.clone(), c).await.unwrap());
        }
        let originals: Vec<Vec<f32>> = (0..4).map(|i| normal_vec(10_000, i)).collect();
        let mean: Vec<f32> = (0..10_000)
            .map(|k| originals.iter().map(|o| o[k]).sum::<f32>() / 4.0)
            .collect();
        let metrics = tokio::runtime::Handle::current().metrics();
        let mut baseline = None;
        for round in 0..200 {
            if round == 20 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                baseline = Some((rss_bytes(), metrics.num_alive_tasks()));
            }
            let mut data = originals.clone();
            let deadline = Instant::now() + Duration::from_secs(30);
            let futs = averagers
                .iter()
                .zip(data.iter_mut())
                .map(|(a, d)| async move { a.step(&mut [&mut d[..]], 1.0, deadline).await });
            let reports: Vec<_> = futures::future::join_all(futs)
                .await
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| panic!("round {round}: {e}")))
                .collect();
            for (r, d) in reports.iter().zip(&data) {
                assert_eq!(r.group.len(), 4, "round {round}");
                assert!(rel_error(d, &mean) < 1e-6, "round {round}: {reports:#?}");
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
        for a in averagers {
            a.shutdown().await;
        }
        cluster.shutdown().await;
    })
    .await;
}
