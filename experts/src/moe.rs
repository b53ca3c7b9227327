//! [`RemoteMixtureOfExperts`]: a candle layer whose experts live on other peers.
//!
//! Forward: a gating function scores each grid dimension; beam search over the live DHT
//! prefixes picks, per sample, the `k_best` live experts with the highest summed scores; the
//! chosen experts are called in parallel; experts that fail or time out are masked out of the
//! softmax over the chosen experts' scores; once every sample has `k_min` answers the layer
//! waits at most `timeout_after_k_min` for the rest. Fewer than `k_min` answers for a sample is an
//! error. Backward (through candle's autograd) sends output gradients to the experts that
//! answered forward and gets input gradients back; the gating weights receive their gradient
//! through the softmax.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{CpuStorage, CustomOp1, Layout, Module, Shape, Tensor, D};
use candle_nn::{linear, Linear, VarBuilder};
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;
use tracing::{debug, Instrument};

use crate::client::{ExpertClient, RemoteExpert};
use crate::grid::ExpertUid;
use crate::lock::lock;
use crate::{ExpertError, Result};

/// Settings of a remote MoE layer.
#[derive(Debug, Clone)]
pub struct MoeConfig {
    /// Name of the expert grid (`ffn` for uids `ffn.i.j`).
    pub name: String,
    /// Size of each grid dimension, e.g. `[1, 8]` for `ffn.0.[0:8]`.
    pub grid: Vec<usize>,
    /// Shape of one sample, in and out (the experts' schema).
    pub sample_shape: Vec<usize>,
    /// Experts per sample.
    pub k_best: usize,
    /// Fewest answering experts per sample; fewer is an error.
    pub k_min: usize,
    /// Longest wait for forward answers.
    pub forward_timeout: Duration,
    /// Longest wait for backward answers.
    pub backward_timeout: Duration,
    /// Once every sample has `k_min` answers, wait at most this long for the others.
    pub timeout_after_k_min: Duration,
    /// DHT prefix listings are reused for this long.
    pub dht_cache: Duration,
    /// A replica (expert uid on one peer) that failed is skipped by beam search for this long;
    /// other replicas of the same uid are still used.
    pub failure_ban: Duration,
}

impl MoeConfig {
    /// Defaults for a grid `name` of the given shape over samples of `sample_shape`: k_best 2,
    /// k_min 1, 10 s forward and 20 s backward timeouts, 1 s after k_min.
    pub fn new(name: &str, grid: &[usize], sample_shape: &[usize]) -> MoeConfig {
        MoeConfig {
            name: name.to_string(),
            grid: grid.to_vec(),
            sample_shape: sample_shape.to_vec(),
            k_best: 2,
            k_min: 1,
            forward_timeout: Duration::from_secs(10),
            backward_timeout: Duration::from_secs(20),
            timeout_after_k_min: Duration::from_secs(1),
            dht_cache: Duration::from_secs(5),
            failure_ban: Duration::from_secs(30),
        }
    }
}

/// What the last forward did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeStats {
    /// Distinct experts called.
    pub called: usize,
    /// Of those, how many answered in time.
    pub answered: usize,
    /// Uids that failed or timed out.
    pub failed: Vec<String>,
    /// Backward calls that failed (their gradient contribution is zero).
    pub backward_failed: usize,
}

type Hosts = HashMap<u32, Vec<crate::grid::ExpertHost>>;
/// DHT prefix listings by prefix, with the time they were fetched.
type PrefixCache = Arc<Mutex<HashMap<Vec<u32>, (Instant, Hosts)>>>;
/// A partial path through the grid: coordinates so far, summed score, who declared it.
type Beam = Vec<(Vec<u32>, f32, Option<crate::grid::ExpertHost>)>;

/// A mixture-of-experts layer whose experts are served by other peers.
///
/// ```no_run
/// # fn demo(client: starling_experts::ExpertClient, rt: tokio::runtime::Handle) -> starling_experts::Result<()> {
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use starling_experts::{MoeConfig, RemoteMixtureOfExperts};
/// let vars = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
/// let moe = RemoteMixtureOfExperts::new(vb.pp("moe"), client, MoeConfig::new("ffn", &[1, 8], &[64]), rt)?;
/// // Call from a plain thread (not from inside an async task): the layer blocks on the network.
/// let x = Tensor::randn(0f32, 1.0, (32, 64), &Device::Cpu)?;
/// let y = moe.forward(&x)?;           // [32, 64]
/// let loss = y.sqr()?.mean_all()?;
/// let grads = loss.backward()?;       // experts get their gradients; `vars` get the gate's
/// # Ok(()) }
/// ```
pub struct RemoteMixtureOfExperts {
    cfg: MoeConfig,
    gates: Vec<Linear>,
    client: ExpertClient,
    rt: tokio::runtime::Handle,
    cache: PrefixCache,
    banned: Arc<Mutex<HashMap<String, Instant>>>,
    last: Arc<Mutex<MoeStats>>,
}

impl RemoteMixtureOfExperts {
    /// Builds the layer; the gating parameters are created through `vb` (so the caller's
    /// optimizer trains them). `rt` runs the network calls.
    pub fn new(
        vb: VarBuilder,
        client: ExpertClient,
        cfg: MoeConfig,
        rt: tokio::runtime::Handle,
    ) -> Result<Self> {
        if cfg.grid.is_empty() || cfg.grid.contains(&0) {
            return Err(ExpertError::Invalid(
                "grid dimensions must be positive".into(),
            ));
        }
        if cfg.k_best == 0 || cfg.k_min > cfg.k_best {
            return Err(ExpertError::Invalid(
                "need 0 <= k_min <= k_best and k_best >= 1".into(),
            ));
        }
        ExpertUid::parse(&format!("{}.0", cfg.name))?;
        let features: usize = cfg.sample_shape.iter().product();
        if features == 0 {
            return Err(ExpertError::Invalid("empty sample shape".into()));
        }
        let gates = cfg
            .grid
            .iter()
            .enumerate()
            .map(|(d, &g)| linear(features, g, vb.pp(format!("gate{d}"))))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(RemoteMixtureOfExperts {
            cfg,
            gates,
            client,
            rt,
            cache: Arc::default(),
            banned: Arc::default(),
            last: Arc::default(),
        })
    }

    /// Its settings.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// What the last forward did.
    pub fn last_stats(&self) -> MoeStats {
        lock(&self.last).clone()
    }

    /// The forward pass, with a typed error. `x` is `[batch, ..sample_shape]`.
    ///
    /// If some sample is left with fewer than `k_min` answers because chosen experts failed,
    /// the routing is done once more without them (they are banned for `failure_ban`), so a
    /// server that just died costs one retry rather than a failed step.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.forward_once(x) {
            Err(ExpertError::NotEnoughExperts { .. }) if !self.last_stats().failed.is_empty() => {
                debug!("retrying the MoE forward without the experts that just failed");
                self.forward_once(x)
            }
            other => other,
        }
    }

    fn forward_once(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        if dims.len() != 1 + self.cfg.sample_shape.len()
            || dims[1..] != self.cfg.sample_shape[..]
            || dims[0] == 0
        {
            return Err(ExpertError::Invalid(format!(
                "input shape {dims:?}, expected [batch, {:?}]",
                self.cfg.sample_shape
            )));
        }
        let b = dims[0];
        let k = self.cfg.k_best;
        let flat = x.flatten_from(1)?;
        let logits = self
            .gates
            .iter()
            .map(|g| g.forward(&flat))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let scores: Vec<Vec<Vec<f32>>> = logits
            .iter()
            .map(|l| l.to_vec2::<f32>())
            .collect::<candle_core::Result<_>>()?;
        let chosen = self.block_on({
            let this = self.searcher();
            async move { this.beam_search(&scores).await }
        })??;
        // Group rows by expert.
        let mut calls: Vec<Call> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut coords = vec![vec![0u32; b * k]; self.cfg.grid.len()];
        for (row, picks) in chosen.iter().enumerate() {
            for (slot, (uid, expert)) in picks.iter().enumerate() {
                let i = *index.entry(uid.to_string()).or_insert_with(|| {
                    calls.push(Call {
                        expert: expert.clone(),
                        rows: Vec::new(),
                        slots: Vec::new(),
                        answered: false,
                    });
                    calls.len() - 1
                });
                calls[i].rows.push(row as u32);
                calls[i].slots.push(slot as u32);
                for (d, c) in uid.coords.iter().enumerate() {
                    coords[d][row * k + slot] = *c;
                }
            }
        }
        let in_len: usize = self.cfg.sample_shape.iter().product();
        let x_data = x.detach().flatten_all()?.to_vec1::<f32>()?;
        let candidates: Vec<usize> = chosen.iter().map(|p| p.len()).collect();
        let outputs = self.block_on({
            let calls = calls.clone();
            let cfg = self.cfg.clone();
            let x_data = Arc::new(x_data);
            async move { call_forward(&cfg, calls, x_data, in_len, candidates).await }
        })?;
        // Assemble Y [b, k, ..] and the mask.
        let out_len = in_len;
        let mut y = vec![0f32; b * k * out_len];
        let mut mask = vec![0f32; b * k];
        let mut stats = MoeStats {
            called: calls.len(),
            ..MoeStats::default()
        };
        for (i, out) in outputs.into_iter().enumerate() {
            match out {
                Some(values) => {
                    stats.answered += 1;
                    calls[i].answered = true;
                    for (j, (&row, &slot)) in calls[i].rows.iter().zip(&calls[i].slots).enumerate()
                    {
                        let at = (row as usize * k + slot as usize) * out_len;
                        y[at..at + out_len]
                            .copy_from_slice(&values[j * out_len..(j + 1) * out_len]);
                        mask[row as usize * k + slot as usize] = 1.0;
                    }
                }
                None => {
                    let uid = calls[i].expert.uid().to_string();
                    lock(&self.banned).insert(
                        ban_key(&uid, &calls[i].expert.peer()),
                        Instant::now() + self.cfg.failure_ban,
                    );
                    stats.failed.push(uid);
                }
            }
        }
        for (row, n) in mask.chunks(k).enumerate() {
            let answered = n.iter().filter(|&&m| m > 0.0).count();
            if answered < self.cfg.k_min {
                *lock(&self.last) = stats;
                return Err(ExpertError::NotEnoughExperts {
                    sample: row,
                    answered,
                    k_min: self.cfg.k_min,
                });
            }
        }
        let mut y_shape = vec![b, k];
        y_shape.extend(&self.cfg.sample_shape);
        let op = ExpertsOp {
            plan: Arc::new(Plan {
                calls: calls.into_iter().filter(|c| c.answered).collect(),
                y,
                y_shape: y_shape.clone(),
                k,
                in_len,
                out_len,
                backward_timeout: self.cfg.backward_timeout,
                rt: self.rt.clone(),
                last: self.last.clone(),
            }),
        };
        *lock(&self.last) = stats;
        let y = x.apply_op1(op)?; // [b, k, ..]
                                  // Gating weights over the chosen experts; failed or empty slots masked out.
        let device = x.device();
        let mut score = Tensor::zeros((b, k), candle_core::DType::F32, device)?;
        for (d, l) in logits.iter().enumerate() {
            let idx = Tensor::from_vec(coords[d].clone(), (b, k), device)?;
            score = (score + l.gather(&idx, 1)?)?;
        }
        let mask = Tensor::from_vec(mask, (b, k), device)?;
        let score = (score + ((mask - 1.0)? * 1e9)?)?;
        let w = candle_nn::ops::softmax(&score, D::Minus1)?;
        let mut w_shape = vec![b, k];
        w_shape.extend(std::iter::repeat_n(1, self.cfg.sample_shape.len()));
        Ok(y.broadcast_mul(&w.reshape(w_shape)?)?.sum(1)?)
    }

    fn searcher(&self) -> Searcher {
        Searcher {
            cfg: self.cfg.clone(),
            client: self.client.clone(),
            cache: self.cache.clone(),
            banned: self.banned.clone(),
        }
    }

    fn block_on<F>(&self, fut: F) -> Result<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        block_on(&self.rt, fut)
    }
}

impl Module for RemoteMixtureOfExperts {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(xs).map_err(|e| match e {
            ExpertError::Tensor(t) => t,
            other => candle_core::Error::Msg(other.to_string()),
        })
    }
}

/// Failures are remembered per replica: `uid@peer`.
fn ban_key(uid: &str, peer: &starling_node::PeerId) -> String {
    format!("{uid}@{peer}")
}

/// Runs `fut` on `rt` and waits for it from the calling (non-async) thread.
fn block_on<F>(rt: &tokio::runtime::Handle, fut: F) -> Result<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(
        async move {
            let _ = tx.send(fut.await);
        }
        .in_current_span(),
    );
    let wait = move || rx.recv().map_err(|_| ExpertError::Closed);
    match tokio::runtime::Handle::try_current() {
        Err(_) => wait(),
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(wait),
        Ok(_) => Err(ExpertError::Invalid(
            "the MoE layer blocks on the network: call it from a plain thread or spawn_blocking, not from a current-thread runtime".into(),
        )),
    }
}

#[derive(Clone)]
struct Call {
    expert: RemoteExpert,
    rows: Vec<u32>,
    slots: Vec<u32>,
    answered: bool,
}

struct Searcher {
    cfg: MoeConfig,
    client: ExpertClient,
    cache: PrefixCache,
    banned: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Searcher {
    async fn children(&self, prefix: &[u32]) -> Hosts {
        if let Some((at, hosts)) = lock(&self.cache).get(prefix) {
            if at.elapsed() < self.cfg.dht_cache {
                return hosts.clone();
            }
        }
        let hosts = match self.client.children(&self.cfg.name, prefix).await {
            Ok(h) => h,
            Err(e) => {
                debug!("DHT lookup of {}{prefix:?} failed: {e}", self.cfg.name);
                Hosts::new()
            }
        };
        lock(&self.cache).insert(prefix.to_vec(), (Instant::now(), hosts.clone()));
        hosts
    }

    /// Per sample, up to `k_best` live experts with the highest summed gate scores, best first.
    async fn beam_search(
        &self,
        scores: &[Vec<Vec<f32>>],
    ) -> Result<Vec<Vec<(ExpertUid, RemoteExpert)>>> {
        let b = scores.first().map_or(0, |s| s.len());
        let k = self.cfg.k_best;
        let levels = self.cfg.grid.len();
        let now = Instant::now();
        let banned: HashSet<String> = {
            let mut m = lock(&self.banned);
            m.retain(|_, until| *until > now);
            m.keys().cloned().collect()
        };
        let mut beams: Vec<Beam> = vec![vec![(vec![], 0.0, None)]; b];
        for (level, level_scores) in scores.iter().enumerate().take(levels) {
            let prefixes: HashSet<Vec<u32>> =
                beams.iter().flatten().map(|(p, _, _)| p.clone()).collect();
            let lookups = prefixes.into_iter().map(|p| async move {
                let hosts = self.children(&p).await;
                (p, hosts)
            });
            let children: HashMap<Vec<u32>, Hosts> = futures::future::join_all(lookups)
                .await
                .into_iter()
                .collect();
            for (row, beam) in beams.iter_mut().enumerate() {
                let mut next = Vec::new();
                for (prefix, score, _) in beam.iter() {
                    let Some(hosts) = children.get(prefix) else {
                        continue;
                    };
                    for (&c, replicas) in hosts {
                        if c as usize >= self.cfg.grid[level] {
                            continue;
                        }
                        let mut p = prefix.clone();
                        p.push(c);
                        // At the last level, the freshest replica that has not failed lately.
                        let host = if level + 1 == levels {
                            let uid = ExpertUid {
                                name: self.cfg.name.clone(),
                                coords: p.clone(),
                            }
                            .to_string();
                            replicas.iter().find(|h| {
                                h.peer_id()
                                    .is_some_and(|peer| !banned.contains(&ban_key(&uid, &peer)))
                            })
                        } else {
                            replicas.first()
                        };
                        let Some(host) = host else { continue };
                        next.push((p, score + level_scores[row][c as usize], Some(host.clone())));
                    }
                }
                next.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                next.truncate(k);
                *beam = next;
            }
        }
        Ok(beams
            .into_iter()
            .map(|beam| {
                beam.into_iter()
                    .filter_map(|(coords, _, host)| {
                        let host = host?;
                        let uid = ExpertUid {
                            name: self.cfg.name.clone(),
                            coords,
                        };
                        let expert = self.client.expert(
                            &uid.to_string(),
                            host.peer_id()?,
                            host.multiaddrs(),
                        );
                        Some((uid, expert))
                    })
                    .collect()
            })
            .collect())
    }
}

/// Calls every chosen expert in parallel. Returns each call's outputs (flattened) or `None`.
async fn call_forward(
    cfg: &MoeConfig,
    calls: Vec<Call>,
    x: Arc<Vec<f32>>,
    in_len: usize,
    candidates: Vec<usize>,
) -> Vec<Option<Vec<f32>>> {
    let mut outputs: Vec<Option<Vec<f32>>> = vec![None; calls.len()];
    let mut answered = vec![0usize; candidates.len()];
    let need: Vec<usize> = candidates.iter().map(|&c| c.min(cfg.k_min)).collect();
    let deadline = Instant::now() + cfg.forward_timeout;
    let mut soft: Option<Instant> = None;
    let mut pending: FuturesUnordered<_> = calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let x = x.clone();
            let call = call.clone();
            let mut shape = vec![call.rows.len()];
            shape.extend(&cfg.sample_shape);
            let limit = cfg.forward_timeout;
            async move {
                let mut rows = Vec::with_capacity(call.rows.len() * in_len);
                for &r in &call.rows {
                    rows.extend_from_slice(&x[r as usize * in_len..(r as usize + 1) * in_len]);
                }
                let result = async {
                    let t = Tensor::from_vec(rows, shape, &candle_core::Device::Cpu)?;
                    let y = call.expert.forward_within(&t, limit).await?;
                    Ok::<_, ExpertError>(y.flatten_all()?.to_vec1::<f32>()?)
                }
                .await;
                (i, result)
            }
        })
        .collect();
    if need.iter().all(|&n| n == 0) {
        soft = Some(Instant::now() + cfg.timeout_after_k_min);
    }
    while !pending.is_empty() {
        let wake = soft.map_or(deadline, |s| s.min(deadline));
        let next = tokio::select! {
            n = pending.next() => n,
            _ = tokio::time::sleep_until(wake) => break,
        };
        let Some((i, result)) = next else { break };
        match result {
            Ok(values) if values.len() == calls[i].rows.len() * in_len => {
                for &r in &calls[i].rows {
                    answered[r as usize] += 1;
                }
                outputs[i] = Some(values);
            }
            Ok(values) => debug!(
                uid = calls[i].expert.uid(),
                len = values.len(),
                "expert answered with the wrong size"
            ),
            Err(e) => debug!(uid = calls[i].expert.uid(), "expert call failed: {e}"),
        }
        if soft.is_none() && answered.iter().zip(&need).all(|(a, n)| a >= n) {
            soft = Some(Instant::now() + cfg.timeout_after_k_min);
        }
    }
    outputs
}

struct Plan {
    calls: Vec<Call>,
    y: Vec<f32>,
    y_shape: Vec<usize>,
    k: usize,
    in_len: usize,
    out_len: usize,
    backward_timeout: Duration,
    rt: tokio::runtime::Handle,
    last: Arc<Mutex<MoeStats>>,
}

/// The remote experts as one autograd node: forward returns the outputs gathered eagerly,
/// backward calls the experts' backward.
struct ExpertsOp {
    plan: Arc<Plan>,
}

impl CustomOp1 for ExpertsOp {
    fn name(&self) -> &'static str {
        "remote-experts"
    }

    fn cpu_fwd(
        &self,
        _storage: &CpuStorage,
        _layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((
            CpuStorage::F32(self.plan.y.clone()),
            Shape::from_dims(&self.plan.y_shape),
        ))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let plan = self.plan.clone();
        let x = Arc::new(arg.detach().flatten_all()?.to_vec1::<f32>()?);
        let x_len = x.len();
        let g = Arc::new(grad_res.detach().flatten_all()?.to_vec1::<f32>()?);
        let sample_shape: Vec<usize> = plan.y_shape[2..].to_vec();
        let fut = {
            let plan = plan.clone();
            async move {
                let calls = plan.calls.iter().map(|call| {
                    let (x, g) = (x.clone(), g.clone());
                    let sample_shape = sample_shape.clone();
                    let plan = plan.clone();
                    async move {
                        let n = call.rows.len();
                        let mut xs = Vec::with_capacity(n * plan.in_len);
                        let mut gs = Vec::with_capacity(n * plan.out_len);
                        for (&r, &s) in call.rows.iter().zip(&call.slots) {
                            let r = r as usize;
                            xs.extend_from_slice(&x[r * plan.in_len..(r + 1) * plan.in_len]);
                            let at = (r * plan.k + s as usize) * plan.out_len;
                            gs.extend_from_slice(&g[at..at + plan.out_len]);
                        }
                        let mut shape = vec![n];
                        shape.extend(&sample_shape);
                        let result = async {
                            let xt =
                                Tensor::from_vec(xs, shape.clone(), &candle_core::Device::Cpu)?;
                            let gt = Tensor::from_vec(gs, shape, &candle_core::Device::Cpu)?;
                            let gx = call
                                .expert
                                .backward_within(&xt, &gt, plan.backward_timeout)
                                .await?;
                            Ok::<_, ExpertError>(gx.flatten_all()?.to_vec1::<f32>()?)
                        }
                        .await;
                        if let Err(e) = &result {
                            debug!(uid = call.expert.uid(), "backward failed: {e}");
                        }
                        result.ok().filter(|v| v.len() == n * plan.in_len)
                    }
                });
                futures::future::join_all(calls).await
            }
        };
        let results =
            block_on(&plan.rt, fut).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut grad = vec![0f32; x_len];
        let mut failed = 0;
        for (call, result) in plan.calls.iter().zip(results) {
            let Some(gx) = result else {
                failed += 1;
                continue;
            };
            for (j, &r) in call.rows.iter().enumerate() {
                let r = r as usize;
                for (dst, src) in grad[r * plan.in_len..(r + 1) * plan.in_len]
                    .iter_mut()
                    .zip(&gx[j * plan.in_len..(j + 1) * plan.in_len])
                {
                    *dst += src;
                }
            }
        }
        lock(&plan.last).backward_failed = failed;
        Ok(Some(Tensor::from_vec(grad, arg.shape(), arg.device())?))
    }
}
