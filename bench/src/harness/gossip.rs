//! [`GossipSwarm`]: N gossip averagers on a [`LocalCluster`], stepped round by round, with the
//! measures the gossip tests and `starling bench gossip` report (weighted mean of the live
//! peers, consensus distance).

use std::time::{Duration, Instant};

use starling_averager::gossip::{
    consensus_distance, weighted_mean, GossipAverager, GossipConfig, GossipReport,
};
use starling_averager::AveragerError;
use starling_node::cluster::LocalCluster;

/// Gossip averagers on the nodes of a cluster, each with its own vector and weight. Peers can
/// be killed (averager and node shut down); the measures cover the live ones.
pub struct GossipSwarm {
    /// The peers' averagers; `None` once killed.
    pub peers: Vec<Option<GossipAverager>>,
    /// Each peer's vector as its last step left it.
    pub vectors: Vec<Vec<f32>>,
    /// Each peer's weight.
    pub weights: Vec<f64>,
    /// Limit of one step.
    pub step_limit: Duration,
}

/// The state of the live peers at one moment.
#[derive(Debug, Clone)]
pub struct Consensus {
    /// Weighted mean of the live peers' values.
    pub mean: Vec<f64>,
    /// Mean squared distance to it, per element.
    pub distance: f64,
}

impl Consensus {
    /// `||self.mean - other.mean|| / ||other.mean||`.
    pub fn mean_error(&self, reference: &Consensus) -> f64 {
        let num: f64 = self
            .mean
            .iter()
            .zip(&reference.mean)
            .map(|(a, b)| (a - b).powi(2))
            .sum();
        let den: f64 = reference.mean.iter().map(|b| b * b).sum();
        (num / den.max(f64::MIN_POSITIVE)).sqrt()
    }
}

impl GossipSwarm {
    /// One averager per node of `cluster` with `config`, vectors of `len` values `1 + N(0, 1)`
    /// (seeded by `seed` and the peer's index) and weights 1, 1.5, 2, 1, ...
    pub async fn start(
        cluster: &LocalCluster,
        config: &GossipConfig,
        len: usize,
        seed: u64,
    ) -> Result<Self, AveragerError> {
        let mut peers = Vec::new();
        for node in &cluster.nodes {
            peers.push(Some(
                GossipAverager::new(node.clone(), config.clone()).await?,
            ));
        }
        let n = peers.len();
        let vectors = (0..n)
            .map(|i| {
                starling_compression::synthetic::normal(len, seed.wrapping_add(i as u64))
                    .into_iter()
                    .map(|v| v + 1.0)
                    .collect()
            })
            .collect();
        let weights = (0..n).map(|i| 1.0 + 0.5 * (i % 3) as f64).collect();
        Ok(GossipSwarm {
            peers,
            vectors,
            weights,
            step_limit: Duration::from_secs(20),
        })
    }

    /// Indices of the live peers.
    pub fn live(&self) -> Vec<usize> {
        (0..self.peers.len())
            .filter(|&i| self.peers[i].is_some())
            .collect()
    }

    /// Every live peer steps once, concurrently; returns each one's report (by peer index).
    pub async fn round(&mut self) -> Vec<(usize, Result<GossipReport, AveragerError>)> {
        let deadline = Instant::now() + self.step_limit;
        let steps =
            self.peers
                .iter()
                .zip(self.vectors.iter_mut())
                .zip(&self.weights)
                .enumerate()
                .filter_map(|(i, ((p, v), w))| p.as_ref().map(|p| (i, p, v, *w)))
                .map(|(i, p, v, w)| async move {
                    (i, p.step(&mut [&mut v[..]], w as f32, deadline).await)
                });
        futures::future::join_all(steps).await
    }

    /// Declares and re-reads membership on every live peer until each sees all live peers
    /// (at most `tries` times). Returns whether they all do.
    pub async fn settle_membership(&self, tries: usize) -> bool {
        let want = self.live().len();
        for _ in 0..tries {
            let counts = futures::future::join_all(
                self.peers
                    .iter()
                    .flatten()
                    .map(|p| async move { p.refresh_members().await.unwrap_or(0) }),
            )
            .await;
            if counts.iter().all(|&c| c == want) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// The live peers' current values (what exchanges work on; waits for exchanges in flight).
    pub async fn values(&self) -> Vec<(usize, Vec<f32>)> {
        let reads = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().map(|p| (i, p)))
            .map(|(i, p)| async move { (i, p.values().await) });
        futures::future::join_all(reads)
            .await
            .into_iter()
            .filter_map(|(i, v)| v.map(|v| (i, v)))
            .collect()
    }

    /// Weighted mean and consensus distance of the live peers' current values.
    pub async fn consensus(&self) -> Consensus {
        let values = self.values().await;
        let vs: Vec<&[f32]> = values.iter().map(|(_, v)| &v[..]).collect();
        let ws: Vec<f64> = values.iter().map(|(i, _)| self.weights[*i]).collect();
        Consensus {
            mean: weighted_mean(&vs, &ws),
            distance: consensus_distance(&vs, &ws),
        }
    }

    /// The same measures over the vectors as given (before any step: the starting point).
    pub fn consensus_of_vectors(&self) -> Consensus {
        let live = self.live();
        let vs: Vec<&[f32]> = live.iter().map(|&i| &self.vectors[i][..]).collect();
        let ws: Vec<f64> = live.iter().map(|&i| self.weights[i]).collect();
        Consensus {
            mean: weighted_mean(&vs, &ws),
            distance: consensus_distance(&vs, &ws),
        }
    }

    /// Stops peer `i`'s averager and takes it out of the live set (the caller shuts its node).
    pub async fn kill(&mut self, i: usize) {
        if let Some(p) = self.peers[i].take() {
            p.shutdown().await;
        }
    }

    /// Shuts every averager down.
    pub async fn shutdown(self) {
        for p in self.peers.into_iter().flatten() {
            p.shutdown().await;
        }
    }
}
