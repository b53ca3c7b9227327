//! One harness for averaging tests and benchmarks: start N averagers on a [`LocalCluster`], step
//! them all concurrently with per-peer data and weights, and compare each result with the exact
//! weighted mean (of everyone, or of the contributors each span's report names).

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use starling_averager::{
    Aggregation, Averager, AveragerConfig, AveragerError, RoundReport, SpanOutcome,
};
use starling_node::{cluster::LocalCluster, Node, NodeConfig, PeerId};

use super::rel_error;

/// The relative error below which a span counts as holding the exact mean: what f32 rounding of
/// an uncompressed round leaves.
pub const EXACT: f64 = 1e-6;

/// N averagers, one per node of a [`LocalCluster`] on 127.0.0.1: `averagers()[i]` runs on
/// `nodes()[i]`, and peer `i`'s data and weight are `data[i]` and `weights[i]` in
/// [`AveragingSwarm::step_all`].
///
/// ```no_run
/// # async fn demo() -> Result<(), starling_averager::AveragerError> {
/// use std::time::{Duration, Instant};
/// use starling_averager::AveragerConfig;
/// use starling_node::NodeConfig;
/// use starling_bench::harness::{exact_weighted_mean, normal_tensors, rel_error, AveragingSwarm, RoundCheck};
///
/// let swarm = AveragingSwarm::start(4, NodeConfig::default(), |_| AveragerConfig::new("demo")).await?;
/// let before: Vec<Vec<Vec<f32>>> = (0..4).map(|p| normal_tensors(&[10, 1000], p)).collect();
/// let weights = [1.0, 2.0, 0.5, 3.5];
/// let mut data = before.clone();
/// let deadline = Instant::now() + Duration::from_secs(30);
/// let reports = swarm.step_all(&mut data, &weights, deadline).await;
/// // Either against everyone's mean, tensor by tensor...
/// let mean = exact_weighted_mean(&before, &weights);
/// assert!(rel_error(&data[0][1], &mean[1]) < 1e-6);
/// // ...or span by span against the contributors each report names.
/// let check = RoundCheck::new(swarm.peer_ids(), &before, &weights);
/// for (p, report) in reports.iter().enumerate() {
///     check.check_spans(p, report.as_ref().unwrap(), &data[p]).unwrap();
/// }
/// swarm.shutdown().await;
/// # Ok(()) }
/// ```
pub struct AveragingSwarm {
    cluster: LocalCluster,
    averagers: Vec<Averager>,
}

impl AveragingSwarm {
    /// Starts `n` nodes (from `node_config`, see [`LocalCluster::start`]) and on node `i` an
    /// averager configured by `config(i)`. On an error, whatever started is shut down.
    pub async fn start(
        n: usize,
        node_config: NodeConfig,
        mut config: impl FnMut(usize) -> AveragerConfig,
    ) -> Result<Self, AveragerError> {
        let cluster = LocalCluster::start(n, node_config).await?;
        let nodes = cluster.nodes.clone();
        let mut swarm = AveragingSwarm {
            cluster,
            averagers: Vec::with_capacity(n),
        };
        for (i, node) in nodes.into_iter().enumerate() {
            match Averager::new(node, config(i)).await {
                Ok(a) => swarm.averagers.push(a),
                Err(e) => {
                    swarm.shutdown().await;
                    return Err(e);
                }
            }
        }
        Ok(swarm)
    }

    /// Adds a peer on `node`, a node started outside the cluster (a client-mode node bootstrapped
    /// from `nodes()[0]`, say); it becomes the last peer, and [`AveragingSwarm::shutdown`] stops
    /// its node with the others. On an error the node is shut down.
    pub async fn add_peer(
        &mut self,
        node: Node,
        config: AveragerConfig,
    ) -> Result<(), AveragerError> {
        match Averager::new(node.clone(), config).await {
            Ok(a) => {
                self.averagers.push(a);
                self.cluster.nodes.push(node);
                Ok(())
            }
            Err(e) => {
                node.shutdown().await;
                Err(e)
            }
        }
    }

    /// The peers' nodes; `nodes()[0]` is the cluster's bootstrap peer.
    pub fn nodes(&self) -> &[Node] {
        &self.cluster.nodes
    }

    /// The peers' averagers, in the same order as [`AveragingSwarm::nodes`].
    pub fn averagers(&self) -> &[Averager] {
        &self.averagers
    }

    /// The peers' ids, in order: what [`RoundCheck::new`] needs to map a report's contributors
    /// back to peers.
    pub fn peer_ids(&self) -> Vec<PeerId> {
        self.cluster.nodes.iter().map(Node::peer_id).collect()
    }

    /// Steps every averager at once (concurrently, on the calling task): peer `i` averages its
    /// tensors `data[i]` with weight `weights[i]`. Returns each peer's result, in peer order;
    /// `data` holds what each step wrote.
    ///
    /// Panics unless there is one entry of `data` and of `weights` per peer.
    pub async fn step_all(
        &self,
        data: &mut [Vec<Vec<f32>>],
        weights: &[f32],
        deadline: Instant,
    ) -> Vec<Result<RoundReport, AveragerError>> {
        let n = self.averagers.len();
        assert!(
            data.len() == n && weights.len() == n,
            "step_all needs data and a weight for each of the {n} peers ({} and {} given)",
            data.len(),
            weights.len()
        );
        let steps = self.averagers.iter().zip(data.iter_mut()).zip(weights).map(
            |((a, tensors), &w)| async move {
                let mut views: Vec<&mut [f32]> =
                    tensors.iter_mut().map(Vec::as_mut_slice).collect();
                a.step(&mut views, w, deadline).await
            },
        );
        futures::future::join_all(steps).await
    }

    /// Shuts every averager down, then every node.
    pub async fn shutdown(self) {
        futures::future::join_all(self.averagers.into_iter().map(Averager::shutdown)).await;
        self.cluster.shutdown().await;
    }
}

/// `sizes.len()` tensors of N(0, 1) samples from [`starling_compression::synthetic::normal`],
/// tensor `t` seeded with `seed + t`: deterministic per-peer data.
///
/// ```
/// let t = starling_bench::harness::normal_tensors(&[3, 5], 10);
/// assert_eq!(t[1], starling_compression::synthetic::normal(5, 11));
/// ```
pub fn normal_tensors(sizes: &[usize], seed: u64) -> Vec<Vec<f32>> {
    sizes
        .iter()
        .zip(seed..)
        .map(|(&n, s)| starling_compression::synthetic::normal(n, s))
        .collect()
}

/// A weighted mean of tensor lists, accumulated in f64 one peer at a time (so a reference mean
/// needs one peer's data in memory at a time, not everyone's).
///
/// ```
/// let mut mean = starling_bench::harness::WeightedMean::default();
/// mean.add(&[vec![1.0, 2.0]], 1.0);
/// mean.add(&[vec![4.0, 8.0]], 2.0);
/// assert_eq!(mean.finish(), vec![vec![3.0, 6.0]]);
/// ```
#[derive(Debug, Default, Clone)]
pub struct WeightedMean {
    sums: Vec<Vec<f64>>,
    total: f64,
}

impl WeightedMean {
    /// Adds one peer's tensors with its weight. Panics if their sizes differ from the first
    /// peer's.
    pub fn add(&mut self, tensors: &[Vec<f32>], weight: f32) {
        if self.sums.is_empty() {
            self.sums = tensors.iter().map(|t| vec![0.0; t.len()]).collect();
        }
        let sizes = |ts: &[Vec<f32>]| ts.iter().map(Vec::len).collect::<Vec<_>>();
        assert!(
            self.sums.len() == tensors.len()
                && self
                    .sums
                    .iter()
                    .zip(tensors)
                    .all(|(s, t)| s.len() == t.len()),
            "tensor sizes {:?} differ from the first peer's {:?}",
            sizes(tensors),
            self.sums.iter().map(Vec::len).collect::<Vec<_>>()
        );
        let w = f64::from(weight);
        for (sum, t) in self.sums.iter_mut().zip(tensors) {
            for (s, &x) in sum.iter_mut().zip(t) {
                *s += f64::from(x) * w;
            }
        }
        self.total += w;
    }

    /// The weighted mean, rounded to f32 once.
    pub fn finish(self) -> Vec<Vec<f32>> {
        let total = self.total;
        self.sums
            .into_iter()
            .map(|s| s.into_iter().map(|v| (v / total) as f32).collect())
            .collect()
    }
}

/// The exact weighted mean (in f64, rounded once) of every peer's tensors: `data[i]` weighted by
/// `weights[i]`.
///
/// ```
/// let data = vec![vec![vec![1.0f32, 2.0]], vec![vec![4.0, 8.0]]];
/// assert_eq!(starling_bench::harness::exact_weighted_mean(&data, &[1.0, 2.0]), vec![vec![3.0, 6.0]]);
/// ```
pub fn exact_weighted_mean(data: &[Vec<Vec<f32>>], weights: &[f32]) -> Vec<Vec<f32>> {
    assert_eq!(data.len(), weights.len(), "one weight per peer");
    let mut mean = WeightedMean::default();
    for (tensors, &w) in data.iter().zip(weights) {
        mean.add(tensors, w);
    }
    mean.finish()
}

/// A round's inputs (every peer's id, tensors before the round and weight), to check each peer's
/// result span by span against what its [`RoundReport`] says happened.
///
/// ```
/// use starling_bench::harness::RoundCheck;
/// let ids = vec![starling_node::PeerId::random(), starling_node::PeerId::random()];
/// let check = RoundCheck::new(ids.clone(), &[vec![vec![1.0, 2.0]], vec![vec![4.0, 8.0]]], &[1.0, 2.0]);
/// assert_eq!(check.mean_over(&ids, 1..2), vec![6.0]);
/// assert_eq!(check.mean_over(&ids[..1], 0..2), vec![1.0, 2.0]);
/// ```
pub struct RoundCheck {
    ids: Vec<PeerId>,
    index: HashMap<PeerId, usize>,
    /// Every peer's tensors before the round, flattened as the averager flattens them.
    before: Vec<Vec<f32>>,
    weights: Vec<f32>,
    /// The rule the reducers applied (the mean unless [`RoundCheck::with_aggregation`] says).
    aggregation: Aggregation,
}

impl RoundCheck {
    /// The round where peer `i` (`ids[i]`) held `before[i]` and stepped with `weights[i]`.
    pub fn new(ids: Vec<PeerId>, before: &[Vec<Vec<f32>>], weights: &[f32]) -> Self {
        assert!(
            ids.len() == before.len() && ids.len() == weights.len(),
            "one id, tensor list and weight per peer"
        );
        RoundCheck {
            index: ids.iter().enumerate().map(|(i, p)| (*p, i)).collect(),
            ids,
            before: before.iter().map(|t| t.concat()).collect(),
            weights: weights.to_vec(),
            aggregation: Aggregation::Mean,
        }
    }

    /// The same round averaged with `aggregation`: [`RoundCheck::check_spans`] then checks
    /// every averaged span against what any robust rule must give (see there) instead of the
    /// exact mean, which only [`Aggregation::Mean`] gives.
    ///
    /// ```
    /// use starling_averager::Aggregation;
    /// use starling_bench::harness::RoundCheck;
    /// let ids = vec![starling_node::PeerId::random(), starling_node::PeerId::random()];
    /// let check = RoundCheck::new(ids.clone(), &[vec![vec![1.0]], vec![vec![4.0]]], &[1.0, 1.0])
    ///     .with_aggregation(Aggregation::Median);
    /// assert_eq!(check.range_over(&ids, 0..1), vec![(1.0, 4.0)]);
    /// ```
    pub fn with_aggregation(mut self, aggregation: Aggregation) -> Self {
        self.aggregation = aggregation;
        self
    }

    /// Per element of `range`, the least and the greatest of `contributors`' values before
    /// the round: where every robust rule's result lies (a median, a trimmed mean and each
    /// centered-clipping iterate are convex combinations of the inputs, coordinate-wise or as
    /// vectors).
    pub fn range_over(&self, contributors: &[PeerId], range: Range<usize>) -> Vec<(f32, f32)> {
        let members: Vec<usize> = contributors.iter().map(|c| self.index_of(c)).collect();
        range
            .map(|k| {
                members
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &m| {
                        let v = self.before[m][k];
                        (lo.min(v), hi.max(v))
                    })
            })
            .collect()
    }

    /// The peers' ids, in order.
    pub fn ids(&self) -> &[PeerId] {
        &self.ids
    }

    /// The index of peer `id`; panics if it was not in the round's swarm.
    pub fn index_of(&self, id: &PeerId) -> usize {
        *self
            .index
            .get(id)
            .unwrap_or_else(|| panic!("{id} is not a peer of this swarm"))
    }

    /// The exact weighted mean (in f64, rounded once) of `contributors`' values before the
    /// round, on `range` of the flattened vector.
    pub fn mean_over(&self, contributors: &[PeerId], range: Range<usize>) -> Vec<f32> {
        let members: Vec<usize> = contributors.iter().map(|c| self.index_of(c)).collect();
        let total: f64 = members.iter().map(|&m| f64::from(self.weights[m])).sum();
        range
            .map(|k| {
                let s: f64 = members
                    .iter()
                    .map(|&m| f64::from(self.before[m][k]) * f64::from(self.weights[m]))
                    .sum();
                (s / total) as f32
            })
            .collect()
    }

    /// Checks that peer `peer`'s tensors after the round (`after`) hold, on every span of its
    /// report, the exact weighted mean (relative error below [`EXACT`]) of the contributors the
    /// span names, or the peer's own values where the report says they were kept, and that the
    /// report covers every element. The error says which span is wrong and how. With a robust
    /// [`aggregation`](RoundCheck::with_aggregation), an averaged span must instead hold
    /// finite values inside its contributors' range, element by element ([`Self::range_over`]),
    /// up to f32 rounding.
    pub fn check_spans(
        &self,
        peer: usize,
        report: &RoundReport,
        after: &[Vec<f32>],
    ) -> Result<(), String> {
        let after = after.concat();
        let before = &self.before[peer];
        for span in &report.spans {
            let r = span.range.clone();
            let got = &after[r.clone()];
            match &span.outcome {
                SpanOutcome::Averaged { contributors }
                | SpanOutcome::Redelegated { contributors, .. }
                    if self.aggregation.is_mean() =>
                {
                    let err = rel_error(got, &self.mean_over(contributors, r.clone()));
                    if err >= EXACT {
                        return Err(format!(
                            "peer {peer} span {r:?}: rel error {err} against its contributors' mean"
                        ));
                    }
                }
                SpanOutcome::Averaged { contributors }
                | SpanOutcome::Redelegated { contributors, .. } => {
                    let bounds = self.range_over(contributors, r.clone());
                    let outside = got.iter().zip(&bounds).position(|(v, (lo, hi))| {
                        // f32 rounding of the rule's arithmetic, relative to the values.
                        let slack = 1e-5 * lo.abs().max(hi.abs()).max(1.0);
                        !(v.is_finite() && *v >= lo - slack && *v <= hi + slack)
                    });
                    if let Some(k) = outside {
                        return Err(format!(
                            "peer {peer} span {r:?}: element {} is {}, outside its {} contributors' range {:?} ({})",
                            r.start + k,
                            got[k],
                            contributors.len(),
                            bounds[k],
                            self.aggregation
                        ));
                    }
                }
                SpanOutcome::KeptLocal { reason } => {
                    if got != &before[r.clone()] {
                        return Err(format!(
                            "peer {peer} span {r:?} kept local ({reason}) but its values changed"
                        ));
                    }
                }
            }
        }
        let covered: usize = report.spans.iter().map(|s| s.range.len()).sum();
        if covered != before.len() {
            return Err(format!(
                "peer {peer}: the report covers {covered} of {} elements",
                before.len()
            ));
        }
        Ok(())
    }

    /// Checks that peers who report the same span averaged by the same reducer over the same
    /// contributors hold the same bits there: a reducer sends one result to every member, so
    /// any difference is a corrupted span (what [`Self::check_spans`] cannot see under a robust
    /// rule, which leaves a range rather than one value). `results` holds each checked peer's
    /// index, report and tensors after the round.
    pub fn check_agreement(
        &self,
        results: &[(usize, &RoundReport, &[Vec<f32>])],
    ) -> Result<(), String> {
        // (span start, span end, reducer, sorted contributors) -> (first peer, its values)
        type SpanKey = (usize, usize, PeerId, Vec<PeerId>);
        let mut seen: HashMap<SpanKey, (usize, Vec<f32>)> = HashMap::new();
        for (peer, report, after) in results {
            let after = after.concat();
            for span in &report.spans {
                let SpanOutcome::Averaged { contributors } = &span.outcome else {
                    continue;
                };
                let mut c = contributors.clone();
                c.sort();
                let key = (span.range.start, span.range.end, span.reducer, c);
                let got = after[span.range.clone()].to_vec();
                match seen.get(&key) {
                    Some((other, values)) if values != &got => {
                        return Err(format!(
                            "peers {other} and {peer} hold different values on span {:?} reduced by {}",
                            span.range, span.reducer
                        ));
                    }
                    Some(_) => {}
                    None => {
                        seen.insert(key, (*peer, got));
                    }
                }
            }
        }
        Ok(())
    }
}
