//! Hierarchical averaging: the devices of a machine reduce locally, one swarm averager speaks
//! for the machine with the summed weight, and the result is broadcast back to every device.
//!
//! Why it is exact: with device weights `w_d`, the machine's weighted mean `m = sum w_d x_d / W`
//! with weight `W = sum w_d` contributes `W m = sum w_d x_d` to the swarm's weighted mean, the
//! same as its devices would have one by one; but the swarm sees one member per machine, so a
//! machine's devices never compete for its uplink.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use super::{check_weights, LocalError, LocalGroup, ReduceOp};
use crate::{Averager, AveragerError, RoundReport};

/// One averaging round with the swarm, as the member that speaks for a whole machine: what
/// [`Hierarchical`] needs from a swarm averager. [`Averager`] implements it (the group
/// all-reduce); so can any other averager over flat `f32` tensors (gossip, say).
///
/// ```
/// use std::time::Instant;
/// use starling_averager::devices::SwarmAverager;
///
/// /// A swarm of one: the round leaves the values as they are.
/// struct Alone;
/// impl SwarmAverager for Alone {
///     type Report = ();
///     type Error = std::convert::Infallible;
///     async fn average(&self, _: &mut [&mut [f32]], _: f32, _: Instant) -> Result<(), Self::Error> {
///         Ok(())
///     }
/// }
/// ```
pub trait SwarmAverager {
    /// What a round reports.
    type Report;
    /// Why a round failed.
    type Error;
    /// Replaces `tensors` by their weighted mean with the swarm's, finishing before `deadline`.
    fn average(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: Instant,
    ) -> impl Future<Output = Result<Self::Report, Self::Error>>;
}

impl SwarmAverager for Averager {
    type Report = RoundReport;
    type Error = AveragerError;
    fn average(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: Instant,
    ) -> impl Future<Output = Result<RoundReport, AveragerError>> {
        self.step(tensors, weight, deadline)
    }
}

impl<S: SwarmAverager> SwarmAverager for &S {
    type Report = S::Report;
    type Error = S::Error;
    fn average(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: Instant,
    ) -> impl Future<Output = Result<S::Report, S::Error>> {
        (**self).average(tensors, weight, deadline)
    }
}

impl<S: SwarmAverager> SwarmAverager for Arc<S> {
    type Report = S::Report;
    type Error = S::Error;
    fn average(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: Instant,
    ) -> impl Future<Output = Result<S::Report, S::Error>> {
        (**self).average(tensors, weight, deadline)
    }
}

/// What a hierarchical step did.
#[derive(Debug)]
pub struct HierarchicalReport<R, E> {
    /// The swarm round, or why there was none. Either way every device ends with the same
    /// values: the swarm's mean where the round averaged, the machine's weighted mean elsewhere.
    pub swarm: Result<R, E>,
    /// The weight the machine declared in the swarm: the sum of its devices' weights.
    pub machine_weight: f32,
    /// Devices that took part.
    pub devices: usize,
}

/// A [`LocalGroup`] whose devices average with the swarm as one member.
///
/// One [`Hierarchical::step`]: reduce the devices' buffers to device 0 (weighted mean), let the
/// swarm averager average that buffer (split into the tensors of
/// [`Hierarchical::with_layout`]) with weight = the sum of the device weights, then broadcast
/// device 0's buffer to every device. Local collectives run on the calling thread (and the CPU
/// group's device threads): call `step` from a plain thread through a runtime handle's
/// `block_on`, or accept that a tokio worker is busy for the duration of the local copies.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::{Duration, Instant};
/// use starling_averager::{Averager, AveragerConfig};
/// use starling_averager::devices::{Hierarchical, LocalGroup};
/// use starling_node::{Node, NodeConfig};
///
/// let node = Node::start(NodeConfig::default()).await?;
/// let averager = Averager::new(node, AveragerConfig::new("my-run")).await?;
/// let group = LocalGroup::cpu(2, 1010)?; // or LocalGroup::nccl(8, 1010) on a GPU machine
/// let mut machine = Hierarchical::new(group, averager).with_layout(&[1000, 10])?;
/// // ... each device trains on its buffer (host_buffer_mut / load) ...
/// let deadline = Instant::now() + Duration::from_secs(30);
/// let report = machine.step(&[32.0, 32.0], deadline).await?;
/// match report.swarm {
///     Ok(round) => println!("averaged with {} members", round.group.len()),
///     Err(e) => println!("devices hold the machine's mean only: {e}"),
/// }
/// # Ok(()) }
/// ```
pub struct Hierarchical<S> {
    group: LocalGroup,
    swarm: S,
    layout: Vec<usize>,
    /// Host copy of device 0's buffer for backends whose buffers are in device memory
    /// (allocated once; empty on the CPU backend).
    staging: Vec<f32>,
}

impl<S: SwarmAverager> Hierarchical<S> {
    /// Devices of `group` averaging with the swarm through `swarm`, as one tensor of
    /// `group.len()` elements (see [`Hierarchical::with_layout`]).
    pub fn new(group: LocalGroup, swarm: S) -> Self {
        let staging = if group.host_buffer(0).is_some() {
            Vec::new()
        } else {
            vec![0.0; group.len()]
        };
        Hierarchical {
            layout: vec![group.len()],
            group,
            swarm,
            staging,
        }
    }

    /// Splits the buffer into tensors of these sizes for the swarm round (peers average
    /// together only if they pass the same tensor sizes: use the layout plain peers use).
    pub fn with_layout(mut self, sizes: &[usize]) -> Result<Self, LocalError> {
        let total: usize = sizes.iter().sum();
        if total != self.group.len() {
            return Err(LocalError::Invalid(format!(
                "layout of {total} elements for buffers of {}",
                self.group.len()
            )));
        }
        self.layout = sizes.to_vec();
        Ok(self)
    }

    /// The devices.
    pub fn group(&self) -> &LocalGroup {
        &self.group
    }

    /// The devices, to load or train on between steps.
    pub fn group_mut(&mut self) -> &mut LocalGroup {
        &mut self.group
    }

    /// The swarm averager.
    pub fn swarm(&self) -> &S {
        &self.swarm
    }

    /// The group and the swarm averager back.
    pub fn into_parts(self) -> (LocalGroup, S) {
        (self.group, self.swarm)
    }

    /// One hierarchical round with device weights `weights` (one per device, e.g. the samples
    /// behind each device's update), finishing the swarm round before `deadline`. Errors only
    /// for bad weights or a failed local collective; a failed swarm round is reported in
    /// [`HierarchicalReport::swarm`], with every device holding the machine's weighted mean.
    pub async fn step(
        &mut self,
        weights: &[f32],
        deadline: Instant,
    ) -> Result<HierarchicalReport<S::Report, S::Error>, LocalError> {
        let total = check_weights(weights, self.group.devices())? as f32;
        self.group.reduce(0, ReduceOp::WeightedMean(weights))?;
        let on_host = self.staging.is_empty();
        if !on_host {
            self.group.store(0, &mut self.staging)?;
        }
        let buf: &mut [f32] = match self.group.host_buffer_mut(0) {
            Some(b) => b,
            None => &mut self.staging,
        };
        let mut views = split(buf, &self.layout);
        let swarm = self.swarm.average(&mut views, total, deadline).await;
        drop(views);
        if !on_host {
            self.group.load(0, &self.staging)?;
        }
        self.group.broadcast(0)?;
        Ok(HierarchicalReport {
            swarm,
            machine_weight: total,
            devices: self.group.devices(),
        })
    }
}

/// `buf` cut into consecutive views of `sizes` (which sum to its length).
fn split<'a>(mut buf: &'a mut [f32], sizes: &[usize]) -> Vec<&'a mut [f32]> {
    let mut views = Vec::with_capacity(sizes.len());
    for &s in sizes {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(s);
        views.push(head);
        buf = tail;
    }
    views
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A swarm whose "other member" holds `other` with `weight`: the round returns the
    /// two-member weighted mean, and records the tensor sizes and weight it was given.
    struct TwoMembers {
        other: Vec<f32>,
        weight: f32,
        seen: RefCell<Vec<(Vec<usize>, f32)>>,
    }

    impl SwarmAverager for TwoMembers {
        type Report = usize;
        type Error = String;
        async fn average(
            &self,
            tensors: &mut [&mut [f32]],
            weight: f32,
            _: Instant,
        ) -> Result<usize, String> {
            let sizes = tensors.iter().map(|t| t.len()).collect();
            self.seen.borrow_mut().push((sizes, weight));
            let mut at = 0;
            for t in tensors.iter_mut() {
                for x in t.iter_mut() {
                    *x = (*x * weight + self.other[at] * self.weight) / (weight + self.weight);
                    at += 1;
                }
            }
            Ok(2)
        }
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn every_device_ends_with_the_weighted_mean_of_devices_and_swarm() {
        let len = 10;
        let mut group = LocalGroup::cpu(3, len).unwrap();
        for d in 0..3 {
            group.load(d, &vec![d as f32 + 1.0; len]).unwrap();
        }
        let swarm = TwoMembers {
            other: vec![10.0; len],
            weight: 4.0,
            seen: RefCell::new(Vec::new()),
        };
        let mut machine = Hierarchical::new(group, &swarm)
            .with_layout(&[3, 7])
            .unwrap();
        let weights = [1.0, 2.0, 3.0];
        let report = block_on(machine.step(&weights, Instant::now())).unwrap();
        assert_eq!(report.swarm, Ok(2));
        assert_eq!(report.machine_weight, 6.0);
        assert_eq!(*swarm.seen.borrow(), vec![(vec![3, 7], 6.0)]);
        // (1*1 + 2*2 + 3*3 + 4*10) / 10
        let expected = 5.4f32;
        for d in 0..3 {
            for &x in machine.group().host_buffer(d).unwrap() {
                assert!((x - expected).abs() < 1e-6, "device {d}: {x}");
            }
        }
        assert!(matches!(
            block_on(machine.step(&[0.0, 0.0, 0.0], Instant::now())),
            Err(LocalError::InvalidWeights { .. })
        ));
        assert!(matches!(
            Hierarchical::new(LocalGroup::cpu(1, 4).unwrap(), &swarm).with_layout(&[3]),
            Err(LocalError::Invalid(_))
        ));
    }
}
