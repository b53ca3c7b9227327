//! `starling.Node`: a Starling node (libp2p host and DHT) on the process's runtime.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use starling_node::{Multiaddr, Node, NodeConfig, SwarmKey};

use crate::errors::{node_error, NodeClosedError};
use crate::runtime::wait;

/// A multiaddress from Python, or a `ValueError` naming the argument.
fn addr(what: &str, s: &str) -> PyResult<Multiaddr> {
    s.parse()
        .map_err(|e| PyValueError::new_err(format!("{what} {s:?} is not a multiaddress: {e}")))
}

/// A Starling node: joins a swarm through `initial_peers`, serves the DHT, carries averaging.
#[pyclass(name = "Node", module = "starling", frozen)]
pub(crate) struct PyNode {
    pub(crate) node: Node,
}

impl PyNode {
    /// `NodeClosedError` once the node has stopped, without a round trip to it.
    pub(crate) fn check_open(&self) -> PyResult<()> {
        if self.node.is_closed() {
            return Err(NodeClosedError::new_err("the node has shut down"));
        }
        Ok(())
    }
}

#[pymethods]
impl PyNode {
    #[new]
    #[pyo3(signature = (
        initial_peers = Vec::new(),
        listen = None,
        swarm_key = None,
        identity = None,
        client = false,
        request_timeout = 10.0,
    ))]
    fn new(
        py: Python<'_>,
        initial_peers: Vec<String>,
        listen: Option<Vec<String>>,
        swarm_key: Option<PathBuf>,
        identity: Option<PathBuf>,
        client: bool,
        request_timeout: f64,
    ) -> PyResult<Self> {
        if !(request_timeout.is_finite() && request_timeout > 0.0) {
            return Err(PyValueError::new_err(format!(
                "request_timeout must be a positive number of seconds, got {request_timeout}"
            )));
        }
        let mut cfg = NodeConfig::default()
            .client(client)
            .with_request_timeout(Duration::from_secs_f64(request_timeout));
        for p in &initial_peers {
            cfg = cfg.bootstrap_from(addr("initial peer", p)?);
        }
        for l in listen.iter().flatten() {
            cfg = cfg.listen_on(addr("listen address", l)?);
        }
        if let Some(path) = swarm_key {
            cfg = cfg.with_swarm_key(SwarmKey::read(&path).map_err(node_error)?);
        }
        if let Some(path) = identity {
            cfg = cfg.with_identity_file(path);
        }
        let node = wait(py, Node::start(cfg))?.map_err(node_error)?;
        Ok(PyNode { node })
    }

    /// This node's peer id (base58).
    #[getter]
    fn peer_id(&self) -> String {
        self.node.peer_id().to_string()
    }

    /// Addresses other peers can join through (each ends in `/p2p/<peer id>`): pass one as
    /// `initial_peers` to another node.
    #[getter]
    fn addresses(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.check_open()?;
        let node = self.node.clone();
        let addrs = wait(py, async move { node.listen_addrs().await })?.map_err(node_error)?;
        let me = self.node.peer_id();
        Ok(addrs
            .into_iter()
            .map(|a| {
                let a = a.to_string();
                if a.contains("/p2p/") {
                    a
                } else {
                    format!("{a}/p2p/{me}")
                }
            })
            .collect())
    }

    /// Stores `value` (bytes) under `(key, subkey)` in the DHT for `expiration` seconds from
    /// now; returns how many peers acknowledged. A `subkey` that names an owner
    /// (`"[owner:<key>]..."`) is signed by this node and may only be written by it.
    #[pyo3(signature = (key, subkey, value, expiration = 60.0))]
    fn store(
        &self,
        py: Python<'_>,
        key: &str,
        subkey: &str,
        value: Vec<u8>,
        expiration: f64,
    ) -> PyResult<usize> {
        self.check_open()?;
        if !(expiration.is_finite() && expiration > 0.0) {
            return Err(PyValueError::new_err(format!(
                "expiration must be a positive number of seconds, got {expiration}"
            )));
        }
        let until = starling_dht::now_ms() + (expiration * 1000.0) as u64;
        let node = self.node.clone();
        let (key, subkey) = (key.to_string(), subkey.to_string());
        let report = wait(
            py,
            async move { node.store(&key, &subkey, &value, until).await },
        )?
        .map_err(node_error)?;
        Ok(report.acknowledged)
    }

    /// The live entries under `key`: a list of `(subkey, value, expires_at)` with `value` as
    /// bytes and `expires_at` in unix seconds; empty when there are none.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &str,
    ) -> PyResult<Vec<(String, Bound<'py, PyBytes>, f64)>> {
        self.check_open()?;
        let node = self.node.clone();
        let key = key.to_string();
        let entries: Vec<(String, Vec<u8>, u64)> =
            wait(py, async move { node.get(&key).await })?.map_err(node_error)?;
        Ok(entries
            .into_iter()
            .map(|(sub, v, exp)| (sub, PyBytes::new(py, &v), exp as f64 / 1000.0))
            .collect())
    }

    /// Peers with an open connection (peer ids).
    fn connected_peers(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.check_open()?;
        let node = self.node.clone();
        let peers = wait(py, async move { node.connected_peers().await })?.map_err(node_error)?;
        Ok(peers.iter().map(|p| p.to_string()).collect())
    }

    /// Stops the node: its connections close and every later call raises `NodeClosedError`.
    /// Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let node = self.node.clone();
        wait(py, async move { node.shutdown().await })
    }

    /// True once the node has stopped.
    #[getter]
    fn closed(&self) -> bool {
        self.node.is_closed()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.shutdown(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "Node(peer_id={:?}, closed={})",
            self.node.peer_id().to_string(),
            self.node.is_closed()
        )
    }
}
