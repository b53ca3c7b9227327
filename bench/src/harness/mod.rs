//! The swarms the benchmarks (and the workspace's integration tests, through `starling-tests`)
//! run in one process:
//!
//! - [`AveragingSwarm`]: N averagers on a [`LocalCluster`](starling_node::cluster::LocalCluster),
//!   stepped concurrently; [`RoundCheck`] checks every peer's result span by span against the
//!   exact weighted mean of the contributors its report names.
//! - [`exact_weighted_mean`] and [`WeightedMean`]: the reference mean, in f64.
//! - [`normal_tensors`] (and [`normal_vec`]): deterministic data from
//!   [`starling_compression::synthetic`].
//! - [`GossipSwarm`]: N gossip averagers stepped round by round, with the live peers'
//!   weighted mean and consensus distance ([`Consensus`]).
//! - [`rel_error`]: errors measured the same way everywhere.

mod gossip;
mod swarm;

pub use gossip::{Consensus, GossipSwarm};
pub use swarm::{
    exact_weighted_mean, normal_tensors, AveragingSwarm, RoundCheck, WeightedMean, EXACT,
};

/// `n` deterministic samples of N(0, 1): [`starling_compression::synthetic::normal`], the one
/// generator of the workspace's tests and benchmarks.
///
/// ```
/// assert_eq!(starling_bench::harness::normal_vec(4, 1).len(), 4);
/// ```
pub fn normal_vec(n: usize, seed: u64) -> Vec<f32> {
    starling_compression::synthetic::normal(n, seed)
}

/// `||a - b|| / ||b||` in f64 (`b` is the reference). Panics when the lengths differ.
///
/// ```
/// assert_eq!(starling_bench::harness::rel_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
/// ```
pub fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    starling_compression::bench::relative_error(b, a)
}
