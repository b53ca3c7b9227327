//! Progress tracking through the DHT: peers' reports add up on every peer, the rate bound
//! holds, a peer behind the swarm learns it, and nobody can report for another peer.

use std::time::Duration;

use starling_node::{cluster::LocalCluster, NodeConfig};
use starling_tests::{bounded, init_tracing};
use starling_training::progress::{LocalProgress, PeerProgress, ProgressConfig, ProgressTracker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_add_up_on_every_peer_and_forgeries_are_ignored() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let cluster = LocalCluster::start(4, NodeConfig::default()).await.unwrap();
        let cfg = ProgressConfig::new("progress-test", 1000);
        let trackers: Vec<ProgressTracker> = cluster
            .nodes
            .iter()
            .map(|n| ProgressTracker::new(n.clone(), cfg.clone()))
            .collect();
        // Peers 0-2 are in epoch 7; peer 3 is still in epoch 6.
        let local = [
            (7, 100, 10.0),
            (7, 200, 20.0),
            (7, 300, 30.0),
            (6, 900, 40.0),
        ];
        for (t, (epoch, samples, rate)) in trackers.iter().zip(local) {
            let p = LocalProgress {
                epoch,
                samples,
                samples_per_second: rate,
            };
            assert!(t.report(p).await.unwrap(), "the first report is published");
            // At once again, same epoch: held back by the rate bound.
            assert!(!t.report(p).await.unwrap());
        }
        // A forgery: peer 3 writes a huge report under a sub-key that is not its owner marker.
        let fake = PeerProgress {
            epoch: 7,
            samples: 1_000_000,
            samples_per_second: 1e9,
            time_ms: starling_dht::now_ms(),
        };
        cluster.nodes[3]
            .store(&cfg.key(), "peer-0", &fake, starling_dht::now_ms() + 30_000)
            .await
            .unwrap();
        for (i, t) in trackers.iter().enumerate() {
            let reports = t.reports().await.unwrap();
            assert_eq!(reports.len(), 4, "peer {i} reads every genuine report");
            let s = t.fetch().await.unwrap();
            assert_eq!((s.epoch, s.peers_in_epoch, s.peers), (7, 3, 4), "peer {i}");
            // 600 reported, extrapolated a little at 60 samples/s: far from the forged million.
            assert!(
                s.samples >= 600 && s.samples < 1000,
                "peer {i}: {}",
                s.samples
            );
            assert!(!s.ready);
            assert!(s.samples_per_second == 60.0);
        }
        let s = trackers[3].fetch().await.unwrap();
        assert!(s.is_behind(6), "the straggler learns it is behind");
        // A new epoch is published at once, whatever the rate bound.
        let p = LocalProgress {
            epoch: 8,
            samples: 1000,
            samples_per_second: 10.0,
        };
        assert!(trackers[0].report(p).await.unwrap());
        let s = trackers[1].fetch().await.unwrap();
        assert_eq!((s.epoch, s.peers_in_epoch), (8, 1));
        assert!(s.ready);
        cluster.shutdown().await;
    })
    .await;
}
