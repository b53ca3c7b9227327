//! `starling._native.CollaborativeOptimizer`: Starling's collaborative optimizer over flat
//! parameter and gradient buffers that Python (numpy, PyTorch) views without copies. The
//! PyTorch-shaped wrapper is `starling.torch.Optimizer` (python/starling/torch.py).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use starling_averager::Aggregation;
use starling_node::Node;
use starling_training::{
    sync_state, AdamWConfig, CollaborativeConfig, CollaborativeOptimizer, Mode, OptimizerConfig,
    ParamSet, SgdConfig, StateServer, StateServerConfig, StepReport, SyncConfig, SyncError,
    TrainingError,
};
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Mutex;

use crate::averager::seconds;
use crate::errors::{averager_error, node_error, NodeClosedError, StarlingError, TimeoutError};
use crate::node::PyNode;
use crate::runtime::wait;

/// The Python exception for a training error.
fn training_error(e: TrainingError) -> PyErr {
    match e {
        TrainingError::Averager(e) => averager_error(e),
        e => StarlingError::new_err(starling_node::error_chain(&e)),
    }
}

/// The Python exception for a state-sync error.
fn sync_error(e: SyncError) -> PyErr {
    let text = starling_node::error_chain(&e);
    match e {
        SyncError::Deadline(_) => TimeoutError::new_err(text),
        SyncError::Node(e) => node_error(e),
        _ => StarlingError::new_err(text),
    }
}

/// Hyper-parameters of the optimizer the swarm steps with (Starling's flat AdamW or SGD,
/// written so that the same inputs give the same bits on every peer).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct Hyper {
    kind: String,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    momentum: f64,
    dampening: f64,
    nesterov: bool,
}

impl Hyper {
    fn config(&self) -> PyResult<OptimizerConfig> {
        let cfg = match self.kind.as_str() {
            "adamw" => OptimizerConfig::AdamW(AdamWConfig {
                lr: self.lr,
                beta1: self.betas.0,
                beta2: self.betas.1,
                eps: self.eps,
                weight_decay: self.weight_decay,
            }),
            "sgd" | "sign" => OptimizerConfig::Sgd(SgdConfig {
                lr: self.lr,
                momentum: self.momentum,
                dampening: self.dampening,
                nesterov: self.nesterov,
                weight_decay: self.weight_decay,
                sign: self.kind == "sign",
            }),
            other => {
                return Err(PyValueError::new_err(format!(
                    "optimizer {other:?}: Starling steps with \"adamw\", \"sgd\" or \"sign\""
                )))
            }
        };
        cfg.validate()
            .map_err(|e| PyValueError::new_err(format!("optimizer: {e}")))?;
        Ok(cfg)
    }
}

/// How the run averages: `mode` "gradients" (one shared step per global batch) or "diloco"
/// (local steps, parameter deltas averaged every `inner_steps` with an outer Nesterov step).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct Collab {
    target_batch_size: u64,
    mode: String,
    inner_steps: u64,
    outer_lr: f64,
    outer_momentum: f64,
    codec: String,
    aggregation: String,
    matchmaking_time: f64,
    averaging_timeout: f64,
    target_group_size: usize,
    projected_batch: bool,
    worker_momentum: Option<f32>,
}

impl Collab {
    fn config(&self, run: &str) -> PyResult<CollaborativeConfig> {
        let mode = match self.mode.as_str() {
            "gradients" => Mode::Gradients,
            "diloco" => Mode::LocalSgd {
                inner_steps: self.inner_steps.max(1),
            },
            other => {
                return Err(PyValueError::new_err(format!(
                    "mode {other:?}: \"gradients\" or \"diloco\""
                )))
            }
        };
        if self.target_batch_size == 0 {
            return Err(PyValueError::new_err(
                "target_batch_size must be at least 1",
            ));
        }
        let mut cfg = CollaborativeConfig::new(run, self.target_batch_size, mode);
        (cfg.averager.codec, cfg.compression) =
            starling_training::GradientCompression::parse_codec(&self.codec)
                .map_err(|e| PyValueError::new_err(format!("codec {:?}: {e}", self.codec)))?;
        cfg.averager.aggregation = self.aggregation.parse::<Aggregation>().map_err(|e| {
            PyValueError::new_err(format!("aggregation {:?}: {e}", self.aggregation))
        })?;
        cfg.averager.matchmaking_time = seconds("matchmaking_time", self.matchmaking_time)?;
        cfg.averager.target_group_size = self.target_group_size.max(2);
        cfg.averaging_timeout = seconds("averaging_timeout", self.averaging_timeout)?;
        cfg.projected_batch = self.projected_batch;
        if let Some(beta) = self.worker_momentum {
            if !(beta > 0.0 && beta < 1.0 && matches!(mode, Mode::Gradients)) {
                return Err(PyValueError::new_err(format!(
                    "worker_momentum {beta}: a factor above 0 and below 1, in mode \"gradients\""
                )));
            }
            cfg.worker_momentum = Some(beta);
        }
        if matches!(mode, Mode::LocalSgd { .. }) {
            cfg.outer = SgdConfig::new(self.outer_lr)
                .momentum(self.outer_momentum)
                .nesterov(self.outer_momentum > 0.0);
        }
        Ok(cfg)
    }
}

/// `(epoch, optimizer kind, optimizer steps, [(state buffer name, float32 bytes)])`.
type OptimizerState<'py> = (u64, String, u64, Vec<(String, Bound<'py, PyBytes>)>);

/// A flat `f32` buffer of a [`PyCollaborative`], for `numpy.asarray`: it exposes
/// `__array_interface__` and keeps its owner (and so the memory) alive.
#[pyclass(name = "FlatBuffer", module = "starling", frozen)]
pub(crate) struct FlatBuffer {
    _owner: Py<PyCollaborative>,
    addr: usize,
    len: usize,
}

impl FlatBuffer {
    /// The buffer at `addr` of `owner` (one of its two), keeping `owner` alive.
    fn of(owner: &Bound<'_, PyCollaborative>, addr: usize) -> Self {
        FlatBuffer {
            _owner: owner.clone().unbind(),
            addr,
            len: owner.get().len,
        }
    }
}

#[pymethods]
impl FlatBuffer {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.len,))?;
        d.set_item("typestr", "<f4")?;
        d.set_item("data", (self.addr, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.len
    }
}

/// The collaborative optimizer and the flat buffers it steps.
#[pyclass(name = "CollaborativeOptimizer", module = "starling", frozen)]
pub(crate) struct PyCollaborative {
    node: Node,
    run: String,
    /// Parameters and gradients. Their buffers are allocated once, never resized (Python
    /// views point into them), and freed only with this object.
    params: Mutex<ParamSet>,
    /// `None` after shutdown.
    collab: Mutex<Option<CollaborativeOptimizer>>,
    /// The state server (donor for late joiners), once `serve_state` ran.
    server: Mutex<Option<StateServer>>,
    /// Where each tensor lies in the flat buffers.
    ranges: Vec<(usize, usize)>,
    /// Addresses of the parameter and gradient buffers, and their length in values.
    params_addr: usize,
    grads_addr: usize,
    len: usize,
    /// The epoch after the last call that changed it (read without waiting on a step).
    epoch: AtomicU64,
}

impl PyCollaborative {
    /// `step` with a batch of `batch` samples, or `try_step` without one, under the optimizer's
    /// and the parameters' locks, with the GIL released; the epoch Python reads is updated.
    fn run_step(&self, py: Python<'_>, batch: Option<u64>) -> PyResult<PyStepReport> {
        let report = wait(py, async {
            let mut collab = self.collab.lock().await;
            let collab = collab
                .as_mut()
                .ok_or_else(|| NodeClosedError::new_err("the optimizer has shut down"))?;
            let mut params = self.params.lock().await;
            let report = match batch {
                Some(samples) => collab.step(&mut params, samples).await,
                None => collab.try_step(&mut params).await,
            }
            .map_err(training_error);
            self.epoch.store(collab.epoch(), Ordering::Release);
            report
        })??;
        Ok(PyStepReport::from(&report))
    }
}

#[pymethods]
impl PyCollaborative {
    /// Joins run `run_id` on `node` for tensors of `shapes` (all float32), stepping with
    /// `optimizer` under `collab` (see the Python wrapper for the arguments).
    #[new]
    fn new(
        py: Python<'_>,
        node: &PyNode,
        run_id: &str,
        shapes: Vec<Vec<usize>>,
        optimizer: Hyper,
        collab: Collab,
    ) -> PyResult<Self> {
        node.check_open()?;
        if shapes.is_empty() {
            return Err(PyValueError::new_err("no parameters to train"));
        }
        let mut params = ParamSet::new();
        let mut ranges = Vec::with_capacity(shapes.len());
        for (i, shape) in shapes.iter().enumerate() {
            let id = params
                .add_zeros(format!("p{i}"), shape)
                .map_err(|e| PyValueError::new_err(format!("parameter {i}: {e}")))?;
            let info = params.info(id).expect("just added");
            ranges.push((info.range().start, info.range().len()));
        }
        let opt = optimizer
            .config()?
            .build(params.len())
            .map_err(|e| PyValueError::new_err(format!("optimizer: {e}")))?;
        let cfg = collab.config(run_id)?;
        let len = params.len();
        let (params_addr, grads_addr) = {
            let (p, g) = params.buffers_mut();
            (p.as_mut_ptr() as usize, g.as_mut_ptr() as usize)
        };
        let n = node.node.clone();
        let built = wait(py, async {
            CollaborativeOptimizer::new(n, opt, &params, cfg).await
        })?
        .map_err(training_error)?;
        Ok(PyCollaborative {
            node: node.node.clone(),
            run: run_id.to_string(),
            params: Mutex::new(params),
            collab: Mutex::new(Some(built)),
            server: Mutex::new(None),
            ranges,
            params_addr,
            grads_addr,
            len,
            epoch: AtomicU64::new(0),
        })
    }

    /// `(offset, length)` of each tensor in the flat buffers.
    #[getter]
    fn ranges(&self) -> Vec<(usize, usize)> {
        self.ranges.clone()
    }

    /// The flat parameter buffer (for `numpy.asarray`).
    fn params_buffer(slf: &Bound<'_, Self>) -> FlatBuffer {
        FlatBuffer::of(slf, slf.get().params_addr)
    }

    /// The flat gradient buffer (for `numpy.asarray`).
    fn grads_buffer(slf: &Bound<'_, Self>) -> FlatBuffer {
        FlatBuffer::of(slf, slf.get().grads_addr)
    }

    /// Takes one batch of `batch_size` samples whose mean gradient is in the gradient buffer;
    /// averages and steps when the swarm has its global batch (gradient mode), or steps
    /// locally and averages every `inner_steps` (DiLoCo). The GIL is released meanwhile.
    fn step(&self, py: Python<'_>, batch_size: u64) -> PyResult<PyStepReport> {
        self.run_step(py, Some(batch_size))
    }

    /// Gradient mode, for a peer with no more batches this epoch: takes the global step if the
    /// swarm has its batch, adding no samples (this peer's count is final for the epoch).
    /// Returns at once either way; call it again after a pause until the report says
    /// `stepped`. In DiLoCo mode it does nothing. The GIL is released meanwhile.
    fn try_step(&self, py: Python<'_>) -> PyResult<PyStepReport> {
        self.run_step(py, None)
    }

    /// Starts serving this peer's state to late joiners (after the initial values are in
    /// the buffers, and after `load_state_from_peers`).
    fn serve_state(&self, py: Python<'_>) -> PyResult<()> {
        // It spawns its tasks on the runtime.
        let server = {
            let _runtime = crate::runtime::runtime()?.enter();
            StateServer::start(self.node.clone(), StateServerConfig::new(self.run.clone()))
                .map_err(sync_error)?
        };
        wait(py, async {
            let mut collab = self.collab.lock().await;
            let collab = collab
                .as_mut()
                .ok_or_else(|| NodeClosedError::new_err("the optimizer has shut down"))?;
            let params = self.params.lock().await;
            collab.serve_state(server.clone(), &params).await;
            *self.server.lock().await = Some(server);
            // Counted in the run from now on, not from its first batch.
            if let Err(e) = collab.announce().await {
                tracing::debug!("announcing this peer's progress: {e}");
            }
            Ok::<(), PyErr>(())
        })?
    }

    /// Downloads the run's current state (parameters, optimizer state, epoch) from peers
    /// that serve it, within `timeout` seconds. Returns the epoch, or `None` when no peer
    /// serves the run yet (a run's first peer).
    /// With `min_epoch`, only a state of at least that epoch is taken (donors still serving
    /// an older one are waited for, up to `timeout`).
    #[pyo3(signature = (timeout = 60.0, min_epoch = None))]
    fn load_state_from_peers(
        &self,
        py: Python<'_>,
        timeout: f64,
        min_epoch: Option<u64>,
    ) -> PyResult<Option<u64>> {
        let deadline = seconds("timeout", timeout)?;
        wait(py, async {
            let mut collab = self.collab.lock().await;
            let collab = collab
                .as_mut()
                .ok_or_else(|| NodeClosedError::new_err("the optimizer has shut down"))?;
            let mut params = self.params.lock().await;
            let layout = collab.state_view(&params).layout();
            let mut cfg = SyncConfig::new(self.run.clone());
            cfg.deadline = deadline;
            if let Some(min) = min_epoch {
                cfg.min_epoch = min;
            }
            match sync_state(&self.node, &cfg, &layout).await {
                Ok((synced, _report)) => {
                    collab
                        .restore_from(&mut params, &synced)
                        .map_err(sync_error)?;
                    self.epoch.store(collab.epoch(), Ordering::Release);
                    // Counted in the run from now on: a donor training alone waits for this
                    // peer instead of stepping past the state it just sent.
                    if let Err(e) = collab.announce().await {
                        tracing::debug!("announcing this peer after state sync: {e}");
                    }
                    Ok(Some(collab.epoch()))
                }
                Err(SyncError::NoDonors { .. }) => Ok(None),
                Err(e) => Err(sync_error(e)),
            }
        })?
    }

    /// The run's epoch (global steps taken).
    #[getter]
    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Reports the latest training loss (metrics, dashboard, heartbeat).
    fn report_loss(&self, py: Python<'_>, loss: f64) -> PyResult<()> {
        // Without the GIL while a step on another thread holds the optimizer.
        let collab = py.detach(|| self.collab.blocking_lock());
        if let Some(c) = collab.as_ref() {
            c.report_loss(loss);
        }
        Ok(())
    }

    /// `(epoch, optimizer kind, optimizer steps, [(state name, float32 bytes)])`: what a
    /// checkpoint needs besides the parameters.
    fn state<'py>(&self, py: Python<'py>) -> PyResult<OptimizerState<'py>> {
        let collab = py.detach(|| self.collab.blocking_lock());
        let c = collab
            .as_ref()
            .ok_or_else(|| NodeClosedError::new_err("the optimizer has shut down"))?;
        let opt = c.optimizer();
        let buffers = opt
            .state()
            .into_iter()
            .map(|(name, values)| {
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                (name.to_string(), PyBytes::new(py, &bytes))
            })
            .collect();
        Ok((
            c.params_epoch(),
            opt.config().kind().to_string(),
            opt.steps(),
            buffers,
        ))
    }

    /// Restores what [`state`](Self::state) gave (the parameters must already be in the
    /// buffer): every buffer must match by name and length, else nothing changes.
    fn load_state(
        &self,
        py: Python<'_>,
        epoch: u64,
        steps: u64,
        buffers: Vec<(String, Vec<u8>)>,
    ) -> PyResult<()> {
        let mut collab = py.detach(|| self.collab.blocking_lock());
        let c = collab
            .as_mut()
            .ok_or_else(|| NodeClosedError::new_err("the optimizer has shut down"))?;
        {
            let opt = c.optimizer_mut();
            let mut state = opt.state_mut();
            if state.len() != buffers.len() {
                return Err(PyValueError::new_err(format!(
                    "optimizer state has {} buffers, this optimizer {}",
                    buffers.len(),
                    state.len()
                )));
            }
            for ((name, target), (their_name, bytes)) in state.iter().zip(&buffers) {
                if name != their_name || bytes.len() != target.len() * 4 {
                    return Err(PyValueError::new_err(format!(
                        "optimizer state {their_name:?} ({} bytes) does not fit {name:?} ({} values)",
                        bytes.len(),
                        target.len()
                    )));
                }
            }
            for ((_, target), (_, bytes)) in state.iter_mut().zip(&buffers) {
                for (t, b) in target.iter_mut().zip(bytes.chunks_exact(4)) {
                    *t = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            opt.set_steps(steps);
        }
        let params = py.detach(|| self.params.blocking_lock());
        c.resume(epoch, &params);
        self.epoch.store(epoch, Ordering::Release);
        Ok(())
    }

    /// Leaves the run: stops the state server and the averager (the node keeps running).
    /// Idempotent; the buffers stay readable.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        wait(py, async {
            let taken = self.collab.lock().await.take();
            if let Some(c) = taken {
                c.shutdown().await;
            }
            if let Some(s) = self.server.lock().await.take() {
                s.shutdown().await;
            }
        })
    }
}

/// What one call of `step` did.
#[pyclass(name = "StepReport", module = "starling", frozen, get_all)]
pub(crate) struct PyStepReport {
    /// The epoch after this call.
    epoch: u64,
    /// True when this call ended an epoch (a global or outer step was taken).
    stepped: bool,
    /// Peers whose data was averaged in this step's round, if one ran.
    group_size: Option<usize>,
    /// Samples behind this peer's contribution to the step.
    samples: u64,
    /// Whether the round brought its group to one parameters and optimizer state (compared
    /// their digests and found them equal, or averaged them).
    state_checked: bool,
    /// Whether the parameters and optimizer state were averaged too (some member's differed).
    state_averaged: bool,
    /// True when this peer is behind the swarm (it should load state from peers).
    behind: bool,
    /// The swarm's epoch as this peer last read it, if it read one.
    swarm_epoch: Option<u64>,
    /// When a round met the others' round of a later epoch (this peer did not step): their
    /// epoch.
    others_epoch: Option<u64>,
    /// When `behind` without a step: the least epoch to load from peers.
    sync_floor: u64,
    /// Every failure met during the call (averaging errors, progress-record errors).
    errors: Vec<String>,
    /// Seconds waiting for the swarm, averaging, and in the optimizer.
    waiting: f64,
    averaging: f64,
    optimizer: f64,
}

impl From<&StepReport> for PyStepReport {
    fn from(r: &StepReport) -> Self {
        let mut errors = r.errors.clone();
        if let Some(e) = &r.averaging_error {
            if !errors.contains(e) {
                errors.insert(0, e.clone());
            }
        }
        PyStepReport {
            epoch: r.epoch,
            stepped: r.stepped,
            group_size: r.group_size,
            samples: r.samples,
            state_checked: r.state_checked,
            state_averaged: r.state_averaged,
            behind: r.behind,
            swarm_epoch: r.swarm.as_ref().map(|s| s.epoch),
            others_epoch: r.others_epoch,
            sync_floor: r.sync_floor(),
            errors,
            waiting: r.timings.waiting.as_secs_f64(),
            averaging: r.timings.averaging.as_secs_f64(),
            optimizer: r.timings.optimizer.as_secs_f64(),
        }
    }
}

#[pymethods]
impl PyStepReport {
    fn __repr__(&self) -> String {
        format!(
            "StepReport(epoch={}, stepped={}, group_size={:?}, errors={})",
            self.epoch,
            self.stepped,
            self.group_size,
            self.errors.len()
        )
    }
}
