//! `starling.GossipAverager`: gossip averaging of numpy float32 arrays, in place.

use std::time::Instant;

use pyo3::prelude::*;
use starling_averager::gossip::{ExchangeOutcome, GossipAverager, GossipConfig, GossipReport};

use crate::averager::{codec, seconds};
use crate::errors::averager_error;
use crate::node::PyNode;
use crate::runtime::wait;
use crate::slot::Slot;
use crate::tensors;

/// Averages with a few neighbours per round instead of a whole group (decentralized SGD's
/// gossip): each `step` adds the arrays' change since the last step to the averager's copy,
/// exchanges with this round's neighbours, and writes the result back into the arrays.
#[pyclass(name = "GossipAverager", module = "starling", frozen)]
pub(crate) struct PyGossipAverager {
    averager: Slot<GossipAverager>,
}

#[pymethods]
impl PyGossipAverager {
    #[new]
    #[pyo3(signature = (node, prefix, codec = "none", alpha = 1.0, exchange_timeout = 10.0))]
    fn new(
        py: Python<'_>,
        node: &PyNode,
        prefix: &str,
        codec: &str,
        alpha: f64,
        exchange_timeout: f64,
    ) -> PyResult<Self> {
        node.check_open()?;
        let mut cfg = GossipConfig::new(prefix);
        cfg.codec = self::codec(codec)?;
        cfg.alpha = alpha;
        cfg.exchange_timeout = seconds("exchange_timeout", exchange_timeout)?;
        let n = node.node.clone();
        let averager = wait(py, GossipAverager::new(n, cfg))?.map_err(averager_error)?;
        Ok(PyGossipAverager {
            averager: Slot::new(averager),
        })
    }

    /// One gossip round on `tensors` (numpy float32 arrays, C-contiguous, writable), weighted
    /// by `weight`, within `timeout` seconds; the GIL is released meanwhile.
    #[pyo3(signature = (tensors, weight = 1.0, timeout = 30.0))]
    fn step(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyAny>,
        weight: f32,
        timeout: f64,
    ) -> PyResult<PyGossipReport> {
        let averager = self.averager.get("the gossip averager")?;
        let deadline = Instant::now() + seconds("timeout", timeout)?;
        let mut arrays = tensors::borrow(tensors)?;
        let mut slices = arrays.slices();
        let report = wait(py, async move {
            averager.step(&mut slices, weight, deadline).await
        })?
        .map_err(averager_error)?;
        Ok(PyGossipReport::from(&report))
    }

    /// Stops answering exchanges; later steps raise `NodeClosedError`. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(a) = self.averager.take() {
            wait(py, a.shutdown())?;
        }
        Ok(())
    }
}

/// What one gossip round did.
#[pyclass(name = "GossipReport", module = "starling", frozen, get_all)]
pub(crate) struct PyGossipReport {
    /// The round number on this peer.
    round: u64,
    /// Members of the run this peer knew of.
    members: usize,
    /// Exchanges this peer started that averaged, and that did not.
    averaged: usize,
    failed: usize,
    /// Exchanges other peers started with this one since the last step.
    served: usize,
    bytes_sent: u64,
    bytes_received: u64,
    /// Seconds the round took.
    duration: f64,
}

impl From<&GossipReport> for PyGossipReport {
    fn from(r: &GossipReport) -> Self {
        let averaged = r
            .exchanges
            .iter()
            .filter(|e| matches!(e.outcome, ExchangeOutcome::Averaged))
            .count();
        PyGossipReport {
            round: r.round,
            members: r.members,
            averaged,
            failed: r.exchanges.len() - averaged,
            served: r.served.len(),
            bytes_sent: r.bytes_sent,
            bytes_received: r.bytes_received,
            duration: r.duration.as_secs_f64(),
        }
    }
}
