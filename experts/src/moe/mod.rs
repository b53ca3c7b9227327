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
//!
//! A forward is four steps, one function each: route (gate logits and beam search, in
//! `search`), dispatch (one call per chosen expert, in `dispatch`), assemble (outputs into
//! their samples' slots, and the mask of slots that answered) and gate (the softmax mixture).
//! The backward lives in `op`, the autograd node.

mod dispatch;
mod op;
mod search;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{Module, Tensor, D};
use candle_nn::{linear, Linear, VarBuilder};
use tokio::time::Instant;
use tracing::{debug, Instrument};

use crate::client::ExpertClient;
use crate::grid::ExpertUid;
use crate::{ExpertError, Result};
use starling_node::lock::lock;

use dispatch::{call_forward, group, Call};
use op::{ExpertsOp, Plan};
use search::{ban_key, Bans, Choices, PrefixCache, Searcher};

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
    banned: Bans,
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

    /// One routing and one round of calls: [`Self::route`], [`Self::dispatch`], [`assemble`]
    /// and [`gate`].
    fn forward_once(&self, x: &Tensor) -> Result<Tensor> {
        let (b, k) = (self.check_input(x)?, self.cfg.k_best);
        let (logits, chosen) = self.route(x)?;
        let dispatch::Dispatch { calls, coords } = group(&chosen, k, self.cfg.grid.len());
        let candidates: Vec<usize> = chosen.iter().map(|p| p.len()).collect();
        let outputs = self.dispatch(x, &calls, candidates)?;
        let out_len = self.sample_len();
        let Assembled { y, mask } = assemble(&calls, &outputs, b, k, out_len);
        let stats = self.record(&calls, &outputs);
        if let Some((sample, answered)) = short_sample(&mask, k, self.cfg.k_min) {
            *lock(&self.last) = stats;
            return Err(ExpertError::NotEnoughExperts {
                sample,
                answered,
                k_min: self.cfg.k_min,
            });
        }
        let mut y_shape = vec![b, k];
        y_shape.extend(&self.cfg.sample_shape);
        let answered = calls
            .into_iter()
            .zip(&outputs)
            .filter_map(|(c, o)| o.is_some().then_some(c));
        let op = ExpertsOp {
            plan: Arc::new(Plan {
                calls: answered.collect(),
                y,
                y_shape,
                k,
                in_len: self.sample_len(),
                out_len,
                backward_timeout: self.cfg.backward_timeout,
                rt: self.rt.clone(),
                last: self.last.clone(),
            }),
        };
        *lock(&self.last) = stats;
        let y = x.apply_op1(op)?; // [b, k, ..]
        gate(&logits, &coords, mask, &y)
    }

    /// Checks that `x` is `[batch >= 1, ..sample_shape]`; returns the batch size.
    fn check_input(&self, x: &Tensor) -> Result<usize> {
        let dims = x.dims();
        if dims.len() != 1 + self.cfg.sample_shape.len()
            || dims[1..] != self.cfg.sample_shape[..]
            || dims[0] == 0
        {
            return Err(ExpertError::Invalid(format!(
                "input shape {dims:?}, expected [batch, {:?}]",
                self.cfg.sample_shape
            )));
        }
        Ok(dims[0])
    }

    /// Elements per sample (inputs and outputs have the same shape).
    fn sample_len(&self) -> usize {
        self.cfg.sample_shape.iter().product()
    }

    /// The gates' logits for `x` (one `[b, grid[d]]` tensor per grid dimension, part of the
    /// autograd graph) and, per sample, the live experts beam search picks with them.
    fn route(&self, x: &Tensor) -> Result<(Vec<Tensor>, Choices)> {
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
        Ok((logits, chosen))
    }

    /// Makes the calls (each expert gets its samples' rows of `x`); each call's outputs,
    /// flattened, or `None` when it failed or was too late. `candidates[i]` is how many experts
    /// sample `i` was routed to.
    fn dispatch(
        &self,
        x: &Tensor,
        calls: &[Call],
        candidates: Vec<usize>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let x_data = Arc::new(x.detach().flatten_all()?.to_vec1::<f32>()?);
        let (calls, cfg, in_len) = (calls.to_vec(), self.cfg.clone(), self.sample_len());
        self.block_on(async move { call_forward(&cfg, calls, x_data, in_len, candidates).await })
    }

    /// Counts what the calls did and bans the replicas that failed for `failure_ban`.
    fn record(&self, calls: &[Call], outputs: &[Option<Vec<f32>>]) -> MoeStats {
        let mut stats = MoeStats {
            called: calls.len(),
            ..MoeStats::default()
        };
        let until = Instant::now() + self.cfg.failure_ban;
        for (call, out) in calls.iter().zip(outputs) {
            if out.is_some() {
                stats.answered += 1;
            } else {
                let uid = call.expert.uid().to_string();
                lock(&self.banned).insert(ban_key(&uid, &call.expert.peer()), until);
                stats.failed.push(uid);
            }
        }
        stats
    }

    /// A handle for beam search that owns what it needs (it runs on the tokio runtime).
    fn searcher(&self) -> Searcher {
        Searcher {
            cfg: self.cfg.clone(),
            client: self.client.clone(),
            cache: self.cache.clone(),
            banned: self.banned.clone(),
        }
    }

    /// Runs `fut` on the layer's runtime and waits for it (see [`block_on`]).
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

/// Expert outputs laid out as `[b, k, out_len]` (flattened), and the mask `[b, k]` of the
/// slots that got an answer (1.0) or not (0.0: failed, late, or no expert chosen).
#[derive(Debug, PartialEq)]
struct Assembled {
    y: Vec<f32>,
    mask: Vec<f32>,
}

/// Puts each answered call's outputs (`outputs[i]` for `calls[i]`, one row of `out_len` per
/// routed sample) in its samples' slots.
fn assemble<E>(
    calls: &[Call<E>],
    outputs: &[Option<Vec<f32>>],
    b: usize,
    k: usize,
    out_len: usize,
) -> Assembled {
    let mut y = vec![0f32; b * k * out_len];
    let mut mask = vec![0f32; b * k];
    for (call, values) in calls.iter().zip(outputs) {
        let Some(values) = values else { continue };
        for (j, (&row, &slot)) in call.rows.iter().zip(&call.slots).enumerate() {
            let at = row as usize * k + slot as usize;
            y[at * out_len..(at + 1) * out_len]
                .copy_from_slice(&values[j * out_len..(j + 1) * out_len]);
            mask[at] = 1.0;
        }
    }
    Assembled { y, mask }
}

/// The first sample with fewer than `k_min` answered slots in `mask` (`[b, k]`), and how many
/// it has.
fn short_sample(mask: &[f32], k: usize, k_min: usize) -> Option<(usize, usize)> {
    mask.chunks(k)
        .map(|slots| slots.iter().filter(|&&m| m > 0.0).count())
        .enumerate()
        .find(|&(_, answered)| answered < k_min)
}

/// Mixes the experts' outputs `y` (`[b, k, ..]`) into `[b, ..]` with a softmax over each
/// sample's chosen experts of their summed gate logits (the expert at `coords[d][s]` on
/// dimension `d` for slot `s`); slots whose `mask` is 0 get weight 0. The gates get their
/// gradient through the softmax.
fn gate(logits: &[Tensor], coords: &[Vec<u32>], mask: Vec<f32>, y: &Tensor) -> Result<Tensor> {
    let (b, k) = (y.dim(0)?, y.dim(1)?);
    let device = y.device();
    let mut score = Tensor::zeros((b, k), candle_core::DType::F32, device)?;
    for (l, c) in logits.iter().zip(coords) {
        let idx = Tensor::from_vec(c.clone(), (b, k), device)?;
        score = (score + l.gather(&idx, 1)?)?;
    }
    let mask = Tensor::from_vec(mask, (b, k), device)?;
    let score = (score + ((mask - 1.0)? * 1e9)?)?;
    let w = candle_nn::ops::softmax(&score, D::Minus1)?;
    let mut w_shape = vec![b, k];
    w_shape.extend(std::iter::repeat_n(1, y.rank() - 2));
    Ok(y.broadcast_mul(&w.reshape(w_shape)?)?.sum(1)?)
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn uid(coords: &[u32]) -> ExpertUid {
        ExpertUid {
            name: "ffn".into(),
            coords: coords.to_vec(),
        }
    }

    #[test]
    fn choices_are_grouped_into_one_call_per_expert() {
        // Three samples, k = 2; sample 2 found only one live expert.
        let chosen = vec![
            vec![(uid(&[0, 1]), "a"), (uid(&[0, 2]), "b")],
            vec![(uid(&[0, 2]), "b"), (uid(&[1, 0]), "c")],
            vec![(uid(&[0, 1]), "a")],
        ];
        let d = group(&chosen, 2, 2);
        let calls: Vec<_> = d
            .calls
            .iter()
            .map(|c| (c.expert, c.rows.clone(), c.slots.clone()))
            .collect();
        assert_eq!(
            calls,
            vec![
                ("a", vec![0, 2], vec![0, 0]),
                ("b", vec![0, 1], vec![1, 0]),
                ("c", vec![1], vec![1]),
            ]
        );
        assert_eq!(
            d.coords,
            vec![vec![0, 0, 0, 1, 0, 0], vec![1, 2, 2, 0, 1, 0]]
        );
    }

    #[test]
    fn answers_fill_their_slots_and_failures_leave_them_masked() {
        let calls = vec![
            Call {
                expert: "a",
                rows: vec![0, 1],
                slots: vec![0, 1],
            },
            Call {
                expert: "b",
                rows: vec![0],
                slots: vec![1],
            },
            Call {
                expert: "c",
                rows: vec![1],
                slots: vec![0],
            },
        ];
        // b failed; out_len 2.
        let outputs = vec![Some(vec![1.0, 2.0, 3.0, 4.0]), None, Some(vec![5.0, 6.0])];
        let a = assemble(&calls, &outputs, 2, 2, 2);
        assert_eq!(a.y, vec![1.0, 2.0, 0.0, 0.0, 5.0, 6.0, 3.0, 4.0]);
        assert_eq!(a.mask, vec![1.0, 0.0, 1.0, 1.0]);
        assert_eq!(short_sample(&a.mask, 2, 1), None);
        assert_eq!(short_sample(&a.mask, 2, 2), Some((0, 1)));
    }

    #[test]
    fn the_gate_mixes_answered_slots_by_softmax_of_summed_logits() {
        let dev = Device::Cpu;
        // b = 1, k = 2, a grid of [2, 2]; slot 0 is expert (0, 1), slot 1 is expert (1, 0).
        let logits = vec![
            Tensor::new(&[[0.0f32, 1.0]], &dev).unwrap(),
            Tensor::new(&[[2.0f32, 0.5]], &dev).unwrap(),
        ];
        let coords = vec![vec![0, 1], vec![1, 0]];
        let y = Tensor::new(&[[[1.0f32, 0.0], [0.0, 1.0]]], &dev).unwrap();
        // Scores: slot 0 = 0 + 0.5, slot 1 = 1 + 2 -> weights softmax([0.5, 3]).
        let out = gate(&logits, &coords, vec![1.0, 1.0], &y).unwrap();
        let w1 = 1.0 / (1.0 + (0.5f32 - 3.0).exp());
        let got = out.to_vec2::<f32>().unwrap();
        assert!((got[0][0] - (1.0 - w1)).abs() < 1e-6 && (got[0][1] - w1).abs() < 1e-6);
        // Slot 1 failed: all weight on slot 0, whatever its score.
        let out = gate(&logits, &coords, vec![1.0, 0.0], &y).unwrap();
        assert_eq!(out.to_vec2::<f32>().unwrap(), vec![vec![1.0, 0.0]]);
    }
}
