//! `starling.Averager`: butterfly all-reduce of numpy float32 arrays, in place.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use starling_averager::{Aggregation, Averager, AveragerConfig, AveragingMode, RoundReport};
use starling_compression::Codec;

use crate::errors::averager_error;
use crate::node::PyNode;
use crate::runtime::wait;
use crate::slot::Slot;
use crate::tensors;

/// A positive, finite number of seconds, or a `ValueError` naming `what`.
pub(crate) fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    if s.is_finite() && s > 0.0 {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(PyValueError::new_err(format!(
            "{what} must be a positive number of seconds, got {s}"
        )))
    }
}

/// A codec name (`none`, `f16`, `u8`, ...), or a `ValueError` listing what is accepted.
pub(crate) fn codec(name: &str) -> PyResult<Codec> {
    name.parse()
        .map_err(|e| PyValueError::new_err(format!("codec {name:?}: {e}")))
}

/// Averages lists of numpy float32 arrays with the other peers of a run (`prefix`): each
/// `step` finds a group through the DHT and runs one butterfly all-reduce; the arrays hold the
/// group's weighted mean afterwards, written in place. Steps run one at a time per averager;
/// one averager per node.
#[pyclass(name = "Averager", module = "starling", frozen)]
pub(crate) struct PyAverager {
    averager: Slot<Averager>,
    prefix: String,
}

impl PyAverager {
    fn get(&self) -> PyResult<Arc<Averager>> {
        self.averager.get("the averager")
    }
}

#[pymethods]
impl PyAverager {
    #[new]
    #[pyo3(signature = (
        node,
        prefix,
        target_group_size = 4,
        min_group_size = 2,
        matchmaking_time = 5.0,
        codec = "none",
        aggregation = "mean",
        client = false,
        request_timeout = 5.0,
        verify = 0.0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        node: &PyNode,
        prefix: &str,
        target_group_size: usize,
        min_group_size: usize,
        matchmaking_time: f64,
        codec: &str,
        aggregation: &str,
        client: bool,
        request_timeout: f64,
        verify: f64,
    ) -> PyResult<Self> {
        node.check_open()?;
        let mut cfg = AveragerConfig::new(prefix);
        cfg.target_group_size = target_group_size;
        cfg.min_group_size = min_group_size;
        cfg.matchmaking_time = seconds("matchmaking_time", matchmaking_time)?;
        cfg.request_timeout = seconds("request_timeout", request_timeout)?;
        cfg.codec = self::codec(codec)?;
        cfg.aggregation = aggregation
            .parse::<Aggregation>()
            .map_err(|e| PyValueError::new_err(format!("aggregation {aggregation:?}: {e}")))?;
        cfg.verify = verify;
        if client {
            cfg.mode = AveragingMode::Client;
        }
        let n = node.node.clone();
        let averager = wait(py, Averager::new(n, cfg))?.map_err(averager_error)?;
        Ok(PyAverager {
            averager: Slot::new(averager),
            prefix: prefix.to_string(),
        })
    }

    /// Averages `tensors` (a list of numpy float32 arrays, C-contiguous and writable: anything
    /// else is a `TypeError` or `ValueError` naming the array) with a group, weighted by
    /// `weight` (e.g. the samples behind these values), within `timeout` seconds. The arrays
    /// are read and written in place, without copies, and the GIL is released for the whole
    /// round: do not touch them from another thread meanwhile. Raises `NoGroupError`,
    /// `SchemaMismatchError`, `TimeoutError` or `NodeClosedError`; the arrays then keep their
    /// values.
    #[pyo3(signature = (tensors, weight = 1.0, timeout = 30.0))]
    fn step(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyAny>,
        weight: f32,
        timeout: f64,
    ) -> PyResult<PyRoundReport> {
        let averager = self.get()?;
        let deadline = Instant::now() + seconds("timeout", timeout)?;
        let mut arrays = tensors::borrow(tensors)?;
        let mut slices = arrays.slices();
        let report = wait(py, async move {
            averager.step(&mut slices, weight, deadline).await
        })?
        .map_err(averager_error)?;
        Ok(PyRoundReport::from(&report))
    }

    /// The run prefix this averager matches under.
    #[getter]
    fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Stops serving rounds; later steps raise `NodeClosedError`. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(a) = self.averager.take() {
            wait(py, a.shutdown())?;
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.shutdown(py)?;
        Ok(false)
    }
}

/// What one averaging round did.
#[pyclass(name = "RoundReport", module = "starling", frozen, get_all)]
pub(crate) struct PyRoundReport {
    /// The round's id (shared by the group).
    round_id: u64,
    /// The group's peer ids, leader first.
    group: Vec<String>,
    /// This peer's index in `group`.
    my_index: usize,
    /// Fraction of the values averaged with at least one other peer (1.0: all of them).
    averaged_fraction: f64,
    /// Peers that failed during the round.
    failed_peers: Vec<String>,
    /// Bytes this peer sent and received.
    bytes_sent: u64,
    bytes_received: u64,
    /// Seconds spent finding the group, and in the all-reduce.
    matchmaking_time: f64,
    allreduce_time: f64,
    /// Transfers that went over a fast lane (a direct encrypted TCP connection).
    fast_lane_transfers: usize,
}

impl From<&RoundReport> for PyRoundReport {
    fn from(r: &RoundReport) -> Self {
        PyRoundReport {
            round_id: r.round_id,
            group: r.group.iter().map(|p| p.to_string()).collect(),
            my_index: r.my_index,
            averaged_fraction: r.averaged_fraction(),
            failed_peers: r.failed_peers.iter().map(|p| p.to_string()).collect(),
            bytes_sent: r.bytes_sent,
            bytes_received: r.bytes_received,
            matchmaking_time: r.matchmaking_time.as_secs_f64(),
            allreduce_time: r.allreduce_time.as_secs_f64(),
            fast_lane_transfers: r.fast_lane_transfers,
        }
    }
}

#[pymethods]
impl PyRoundReport {
    /// Members of the group, this peer included.
    #[getter]
    fn group_size(&self) -> usize {
        self.group.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "RoundReport(group_size={}, averaged_fraction={:.3}, failed_peers={}, allreduce_time={:.3})",
            self.group.len(),
            self.averaged_fraction,
            self.failed_peers.len(),
            self.allreduce_time
        )
    }
}
