//! [`GossipBuffer`]: values and weight shared between a training loop and the gossip averager
//! running in the background.

use std::sync::{Arc, Mutex};

use crate::AveragerError;
use starling_node::lock::lock;

/// A flat `f32` vector and its averaging weight, shared (cheap to clone) between the caller and
/// a background gossip loop ([`GossipAverager::start_background`](super::GossipAverager::start_background)).
///
/// The lock is held only for in-memory work (a copy, one local update, one exchange's update),
/// never across network waits. Exchanges *add* their update to whatever the buffer holds at
/// that moment, so the caller's own updates in between (optimizer steps) are kept, and the
/// exchanges' mass balance holds regardless.
///
/// ```
/// use starling_averager::gossip::GossipBuffer;
/// let params = GossipBuffer::new(vec![0.5f32; 4], 1.0).unwrap();
/// params.update(|p| p.iter_mut().for_each(|v| *v -= 0.1)); // a local step
/// assert_eq!(params.snapshot(), vec![0.4f32; 4]);
/// ```
#[derive(Clone)]
pub struct GossipBuffer {
    inner: Arc<Mutex<Values>>,
}

struct Values {
    data: Vec<f32>,
    weight: f32,
}

impl GossipBuffer {
    /// Shares `values` with averaging weight `weight` (finite, >= 0).
    pub fn new(values: Vec<f32>, weight: f32) -> Result<Self, AveragerError> {
        check_weight(weight)?;
        if values.is_empty() {
            return Err(AveragerError::Schema("no elements to average".into()));
        }
        Ok(GossipBuffer {
            inner: Arc::new(Mutex::new(Values {
                data: values,
                weight,
            })),
        })
    }

    /// Elements in the vector (fixed for the buffer's life).
    pub fn len(&self) -> usize {
        lock(&self.inner).data.len()
    }

    /// Always false: a buffer holds at least one element.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The averaging weight.
    pub fn weight(&self) -> f32 {
        lock(&self.inner).weight
    }

    /// Sets the averaging weight (finite, >= 0), used by exchanges from now on.
    pub fn set_weight(&self, weight: f32) -> Result<(), AveragerError> {
        check_weight(weight)?;
        lock(&self.inner).weight = weight;
        Ok(())
    }

    /// A copy of the values.
    pub fn snapshot(&self) -> Vec<f32> {
        lock(&self.inner).data.clone()
    }

    /// Runs `f` on the values under the lock (a local optimizer step, a read). Keep it short:
    /// exchanges wait for it.
    pub fn update<R>(&self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        f(&mut lock(&self.inner).data)
    }

    /// Copies the values into `out` and returns the weight, in one critical section.
    pub(crate) fn copy_out(&self, out: &mut Vec<f32>) -> f32 {
        let v = lock(&self.inner);
        out.clear();
        out.extend_from_slice(&v.data);
        v.weight
    }

    /// `values += c * d`; false (and nothing changed) if `d` has another length.
    pub(crate) fn add_scaled(&self, d: &[f32], c: f32) -> bool {
        let mut v = lock(&self.inner);
        if v.data.len() != d.len() {
            return false;
        }
        super::mix::add_scaled(&mut v.data, d, c);
        true
    }

    /// Runs `f` on the values and the weight under the lock.
    pub(crate) fn with_lock<R>(&self, f: impl FnOnce(&mut Vec<f32>, &mut f32) -> R) -> R {
        let mut v = lock(&self.inner);
        let Values { data, weight } = &mut *v;
        f(data, weight)
    }

    /// Whether two handles share the same values.
    pub(crate) fn same(&self, other: &GossipBuffer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

pub(crate) fn check_weight(weight: f32) -> Result<(), AveragerError> {
    if weight.is_finite() && weight >= 0.0 {
        Ok(())
    } else {
        Err(AveragerError::InvalidWeight(weight))
    }
}
