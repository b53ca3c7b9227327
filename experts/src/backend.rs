//! Expert backends: the layers a server hosts, with forward, and a backward that returns the
//! input gradient and updates the expert's own parameters with AdamW.
//!
//! Built on candle (autodiff on CPU; candle reaches CUDA through cudarc where it is built with
//! its `cuda` feature). Parameters live in a [`VarMap`], so checkpoints are safetensors files.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType as CDType, Device, Module, Tensor, Var, D};
use candle_nn::{linear, AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::activations::{ActivationCache, ActivationReuse};
use crate::ffn_step::{ffn_forward, ffn_gradients, BackwardPhases, FfnVars, FlatAdamW};
use crate::schema::{ExpertSchema, TensorSpec};
use crate::{ExpertError, Result};
use starling_node::lock::lock;

/// The architectures an expert can have.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ExpertKind {
    /// `Linear(dim, hidden) - GELU - Linear(hidden, dim)`; samples are vectors of `dim`.
    Ffn,
    /// A pre-norm transformer block (multi-head self-attention and a GELU feed-forward of width
    /// `hidden`, both residual); samples are sequences `[seq_len, dim]`.
    Transformer {
        /// Tokens per sample.
        seq_len: usize,
        /// Attention heads; must divide `dim`.
        heads: usize,
    },
}

/// AdamW settings of an expert's own optimizer: the hyper-parameters of
/// `starling_training::AdamWConfig` (experts/ and training/ are siblings; neither depends on the
/// other). A run's optimizer choice is `starling_run::manifest::OptimizerSpec`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWSpec {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWSpec {
    fn default() -> Self {
        AdamWSpec {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Everything needed to build an expert: architecture, sizes and optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertSpec {
    /// Architecture.
    pub kind: ExpertKind,
    /// Model width: input and output features per token.
    pub dim: usize,
    /// Inner width of the feed-forward part.
    pub hidden: usize,
    /// The expert's optimizer.
    pub optimizer: AdamWSpec,
}

impl ExpertSpec {
    /// A feed-forward expert `dim -> hidden -> dim`.
    pub fn ffn(dim: usize, hidden: usize) -> ExpertSpec {
        ExpertSpec {
            kind: ExpertKind::Ffn,
            dim,
            hidden,
            optimizer: AdamWSpec::default(),
        }
    }

    /// A transformer-block expert over sequences of `seq_len` tokens of width `dim`.
    pub fn transformer(dim: usize, hidden: usize, seq_len: usize, heads: usize) -> ExpertSpec {
        ExpertSpec {
            kind: ExpertKind::Transformer { seq_len, heads },
            dim,
            hidden,
            optimizer: AdamWSpec::default(),
        }
    }

    /// The same spec with another learning rate.
    pub fn with_lr(mut self, lr: f64) -> ExpertSpec {
        self.optimizer.lr = lr;
        self
    }

    /// The input/output schema this spec implies.
    pub fn schema(&self) -> ExpertSchema {
        let shape = match self.kind {
            ExpertKind::Ffn => vec![self.dim],
            ExpertKind::Transformer { seq_len, .. } => vec![seq_len, self.dim],
        };
        ExpertSchema {
            input: TensorSpec::f32(&shape),
            output: TensorSpec::f32(&shape),
        }
    }

    /// Refuses sizes of zero, heads that do not divide `dim` and unusable optimizer settings.
    fn validate(&self) -> Result<()> {
        if self.dim == 0 || self.hidden == 0 {
            return Err(ExpertError::Invalid(
                "dim and hidden must be positive".into(),
            ));
        }
        if let ExpertKind::Transformer { seq_len, heads } = self.kind {
            if seq_len == 0 || heads == 0 || !self.dim.is_multiple_of(heads) {
                return Err(ExpertError::Invalid(format!(
                    "transformer: seq_len {seq_len} must be positive and heads {heads} must divide dim {}",
                    self.dim
                )));
            }
        }
        let o = &self.optimizer;
        if !(o.lr.is_finite() && o.lr >= 0.0 && o.eps > 0.0) {
            return Err(ExpertError::Invalid(format!(
                "bad optimizer settings {o:?}"
            )));
        }
        Ok(())
    }
}

/// The feed-forward network `Linear - GELU - Linear` (an expert, or a block's second half).
struct Ffn {
    l1: Linear,
    l2: Linear,
}

impl Module for Ffn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.gelu()?)
    }
}

/// Layer norm written with differentiable primitives (candle's fused layer-norm op has no
/// backward).
struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    /// Scale 1 and shift 0 over the last dimension of width `dim`.
    fn new(dim: usize, vb: VarBuilder) -> candle_core::Result<Norm> {
        Ok(Norm {
            weight: vb.get_with_hints(dim, "weight", candle_nn::Init::Const(1.0))?,
            bias: vb.get_with_hints(dim, "bias", candle_nn::Init::Const(0.0))?,
        })
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
        normed
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)
    }
}

/// A pre-norm transformer block: self-attention then feed-forward, both residual.
struct Block {
    ln1: Norm,
    qkv: Linear,
    proj: Linear,
    ln2: Norm,
    ff: Ffn,
    heads: usize,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, d) = x.dims3()?;
        let dh = d / self.heads;
        let h = self.ln1.forward(x)?;
        let qkv = self
            .qkv
            .forward(&h)?
            .reshape((b, s, 3, self.heads, dh))?
            .permute((2, 0, 3, 1, 4))?; // [3, B, H, S, dh]
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let att = (q.matmul(&k.t()?.contiguous()?)? * (1.0 / (dh as f64).sqrt()))?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        let o = att.matmul(&v)?.transpose(1, 2)?.reshape((b, s, d))?;
        let x = (x + self.proj.forward(&o)?)?;
        let f = self.ff.forward(&self.ln2.forward(&x)?)?;
        x + f
    }
}

/// The network of an expert, by [`ExpertKind`].
enum Net {
    /// [`ExpertKind::Ffn`].
    Ffn(Ffn),
    /// [`ExpertKind::Transformer`].
    Block(Block),
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Ffn(f) => f.forward(x),
            Net::Block(b) => b.forward(x),
        }
    }
}

/// One expert: its parameters, its network and its optimizer.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use starling_experts::{Expert, ExpertSpec};
/// let mut expert = Expert::new(&ExpertSpec::ffn(8, 32), 7).unwrap();
/// let x = Tensor::randn(0f32, 1.0, (4, 8), &Device::Cpu).unwrap();
/// let y = expert.forward(&x).unwrap();
/// // Gradient of some loss with respect to y; backward returns d loss / d x and takes an
/// // AdamW step on the expert's parameters.
/// let grad_x = expert.backward(&x, &y.ones_like().unwrap()).unwrap();
/// assert_eq!(grad_x.dims(), &[4, 8]);
/// ```
pub struct Expert {
    spec: ExpertSpec,
    schema: ExpertSchema,
    varmap: VarMap,
    net: Net,
    trainer: Trainer,
    steps: u64,
    last_phases: BackwardPhases,
    /// Forward activations kept for backwards ([`crate::activations`]; feed-forward only).
    kept: ActivationCache,
}

/// How an expert computes its gradients and steps.
enum Trainer {
    /// Feed-forward experts: hand-derived gradients and a flat AdamW ([`crate::ffn_step`]).
    Ffn(FfnVars, FlatAdamW),
    /// Other architectures: candle's autograd and AdamW.
    Autograd(AdamW),
}

impl Expert {
    /// Builds an expert with parameters drawn from a generator seeded with `seed`, so two
    /// experts built from the same spec and seed are identical.
    pub fn new(spec: &ExpertSpec, seed: u64) -> Result<Expert> {
        spec.validate()?;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, CDType::F32, &Device::Cpu);
        let ffn = |vb: VarBuilder| -> candle_core::Result<Ffn> {
            Ok(Ffn {
                l1: linear(spec.dim, spec.hidden, vb.pp("ff1"))?,
                l2: linear(spec.hidden, spec.dim, vb.pp("ff2"))?,
            })
        };
        let net = match spec.kind {
            ExpertKind::Ffn => Net::Ffn(ffn(vb.clone())?),
            ExpertKind::Transformer { heads, .. } => Net::Block(Block {
                ln1: Norm::new(spec.dim, vb.pp("ln1"))?,
                qkv: linear(spec.dim, 3 * spec.dim, vb.pp("qkv"))?,
                proj: linear(spec.dim, spec.dim, vb.pp("proj"))?,
                ln2: Norm::new(spec.dim, vb.pp("ln2"))?,
                ff: ffn(vb.clone())?,
                heads,
            }),
        };
        seeded_init(&varmap, seed)?;
        let o = spec.optimizer;
        // `STARLING_EXPERTS_AUTOGRAD=1` trains feed-forward experts through candle's autograd
        // and AdamW as before the hand-derived path, for comparisons.
        let autograd = std::env::var_os("STARLING_EXPERTS_AUTOGRAD").is_some_and(|v| v == "1");
        let trainer = match spec.kind {
            ExpertKind::Ffn if !autograd => {
                let data = lock(varmap.data());
                let var = |name: &str| {
                    data.get(name).cloned().ok_or_else(|| {
                        ExpertError::Invalid(format!("internal: no variable {name}"))
                    })
                };
                let vars = FfnVars {
                    w1: var("ff1.weight")?,
                    b1: var("ff1.bias")?,
                    w2: var("ff2.weight")?,
                    b2: var("ff2.bias")?,
                };
                let opt = FlatAdamW::new(o, &[&vars.w1, &vars.b1, &vars.w2, &vars.b2]);
                Trainer::Ffn(vars, opt)
            }
            _ => Trainer::Autograd(AdamW::new(
                varmap.all_vars(),
                ParamsAdamW {
                    lr: o.lr,
                    beta1: o.beta1,
                    beta2: o.beta2,
                    eps: o.eps,
                    weight_decay: o.weight_decay,
                },
            )?),
        };
        Ok(Expert {
            schema: spec.schema(),
            spec: spec.clone(),
            varmap,
            net,
            trainer,
            steps: 0,
            last_phases: BackwardPhases::default(),
            kept: ActivationCache::new(ActivationReuse::default()),
        })
    }

    /// The spec it was built from.
    pub fn spec(&self) -> &ExpertSpec {
        &self.spec
    }

    /// Input and output shapes.
    pub fn schema(&self) -> &ExpertSchema {
        &self.schema
    }

    /// Optimizer steps taken (backward calls) since creation or the last checkpoint restore.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Number of trainable parameters.
    pub fn num_parameters(&self) -> usize {
        self.varmap
            .all_vars()
            .iter()
            .map(|v| v.as_tensor().elem_count())
            .sum()
    }

    /// Runs the expert on a batch `[batch, ..input shape]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.check_input(x)?;
        match &self.trainer {
            Trainer::Ffn(vars, _) => Ok(ffn_forward(vars, x, false)?.0),
            Trainer::Autograd(_) => Ok(self.net.forward(x)?.detach()),
        }
    }

    /// How forwards keep activations for backwards (feed-forward experts; others always
    /// recompute). See [`ActivationReuse`].
    pub fn set_activation_reuse(&mut self, reuse: ActivationReuse) {
        self.kept = ActivationCache::new(reuse);
    }

    /// The current [`ActivationReuse`].
    pub fn activation_reuse(&self) -> ActivationReuse {
        self.kept.reuse()
    }

    /// [`Self::forward`] on a batch made of `parts` (consecutive row counts, one per request)
    /// that also keeps each part's hidden activations, so that [`Self::backward_parts`] on the
    /// same inputs skips recomputing them.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use starling_experts::{Expert, ExpertSpec};
    /// let mut expert = Expert::new(&ExpertSpec::ffn(8, 32), 7).unwrap();
    /// let x = Tensor::randn(0f32, 1.0, (5, 8), &Device::Cpu).unwrap();
    /// let y = expert.forward_parts(&x, &[2, 3]).unwrap();
    /// // The backward of the second request alone reuses what its forward kept.
    /// let second = x.narrow(0, 2, 3).unwrap();
    /// expert.backward_parts(&second, &y.narrow(0, 2, 3).unwrap(), &[3]).unwrap();
    /// assert_eq!(expert.last_backward_phases().reused_rows, 3);
    /// ```
    pub fn forward_parts(&mut self, x: &Tensor, parts: &[usize]) -> Result<Tensor> {
        let rows = self.check_input(x)?;
        check_parts(parts, rows)?;
        let Trainer::Ffn(vars, _) = &self.trainer else {
            return Ok(self.net.forward(x)?.detach());
        };
        if !self.kept.enabled() {
            return Ok(ffn_forward(vars, x, false)?.0);
        }
        let (y, pre) = ffn_forward(vars, x, true)?;
        let pre = pre.unwrap_or_default();
        let inputs = x.flatten_all()?.to_vec1::<f32>()?;
        let (width, hidden) = (inputs.len() / rows.max(1), pre.len() / rows.max(1));
        let mut start = 0;
        for &n in parts {
            let (a, b) = (start, start + n);
            self.kept.insert(
                inputs[a * width..b * width].to_vec(),
                pre[a * hidden..b * hidden].to_vec(),
                self.steps,
            );
            start = b;
        }
        Ok(y)
    }

    /// Given the inputs of a forward pass and the gradient of the loss with respect to its
    /// outputs, returns the gradient with respect to the inputs and takes one AdamW step on the
    /// expert's parameters (the gradient used is that of `sum(y * grad_out)`).
    pub fn backward(&mut self, x: &Tensor, grad_out: &Tensor) -> Result<Tensor> {
        let rows = self.check_input(x)?;
        self.backward_parts(x, grad_out, &[rows])
    }

    /// [`Self::backward`] on a batch made of `parts` (consecutive row counts, one per request):
    /// parts whose inputs a [`Self::forward_parts`] kept reuse its activations when every part
    /// of the batch has them (within [`ActivationReuse::max_stale_steps`]); otherwise the
    /// batch is recomputed with the current weights.
    pub fn backward_parts(
        &mut self,
        x: &Tensor,
        grad_out: &Tensor,
        parts: &[usize],
    ) -> Result<Tensor> {
        let batch = self.check_input(x)?;
        let grad_batch = self.schema.output.check_batch(
            "output gradient",
            grad_out.dims(),
            crate::DType::F32,
        )?;
        if grad_batch != batch {
            return Err(ExpertError::Invalid(format!(
                "output gradient has {grad_batch} samples, input has {batch}"
            )));
        }
        check_parts(parts, batch)?;
        let grad_x = match &mut self.trainer {
            Trainer::Ffn(vars, opt) => {
                let pre = match self.kept.enabled() {
                    true => take_kept(&mut self.kept, x, parts, self.steps)?,
                    false => None,
                };
                let reused_rows = if pre.is_some() { batch } else { 0 };
                let (grad_x, grads, recompute, gradients) = ffn_gradients(vars, x, grad_out, pre)?;
                let stepped = Instant::now();
                opt.step(&[&vars.w1, &vars.b1, &vars.w2, &vars.b2], &grads)?;
                self.last_phases = BackwardPhases {
                    recompute,
                    gradients,
                    optimizer: stepped.elapsed(),
                    reused_rows,
                };
                grad_x
            }
            Trainer::Autograd(opt) => {
                let started = Instant::now();
                let xv = Var::from_tensor(x)?;
                let y = self.net.forward(xv.as_tensor())?;
                let loss = (y * grad_out)?.sum_all()?;
                let recomputed = Instant::now();
                let grads = loss.backward()?;
                let grad_x = grads
                    .get(xv.as_tensor())
                    .cloned()
                    .unwrap_or(x.zeros_like()?);
                let stepped = Instant::now();
                opt.step(&grads)?;
                self.last_phases = BackwardPhases {
                    recompute: recomputed - started,
                    gradients: stepped - recomputed,
                    optimizer: stepped.elapsed(),
                    reused_rows: 0,
                };
                grad_x
            }
        };
        self.steps += 1;
        Ok(grad_x)
    }

    /// Where the last [`Self::backward`]'s time went.
    pub fn last_backward_phases(&self) -> BackwardPhases {
        self.last_phases
    }

    /// Checks that `x` is an f32 `[batch, ..input shape]`; returns the batch size.
    fn check_input(&self, x: &Tensor) -> Result<usize> {
        if x.dtype() != CDType::F32 {
            return Err(ExpertError::Invalid(format!("input dtype {:?}", x.dtype())));
        }
        self.schema
            .input
            .check_batch("input", x.dims(), crate::DType::F32)
    }

    /// Writes the parameters to `path` (safetensors), atomically: a crash leaves either the old
    /// file or the new one.
    pub fn save(&self, path: &Path) -> Result<()> {
        let err = |e: &dyn std::fmt::Display| ExpertError::Checkpoint {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let tmp = path.with_extension("tmp");
        self.varmap.save(&tmp).map_err(|e| err(&e))?;
        std::fs::rename(&tmp, path).map_err(|e| err(&e))
    }

    /// Restores parameters saved by [`Self::save`]. Fails (and leaves the expert unchanged) if a
    /// tensor is missing or has another shape.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let err = |m: String| ExpertError::Checkpoint {
            path: path.display().to_string(),
            message: m,
        };
        let loaded =
            candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| err(e.to_string()))?;
        let data = lock(self.varmap.data());
        for (name, var) in data.iter() {
            match loaded.get(name) {
                Some(t) if t.dims() == var.dims() && t.dtype() == var.dtype() => {}
                Some(t) => {
                    return Err(err(format!(
                        "{name}: shape {:?}, expected {:?}",
                        t.dims(),
                        var.dims()
                    )))
                }
                None => return Err(err(format!("{name} missing"))),
            }
        }
        for (name, var) in data.iter() {
            if let Some(t) = loaded.get(name) {
                var.set(t)?;
            }
        }
        drop(data);
        self.kept.clear();
        Ok(())
    }
}

/// Re-draws every parameter from a seeded generator: weights (rank 2) uniform in
/// `±1/sqrt(fan_in)`, linear biases zero; layer-norm scales and shifts keep their constants.
/// Checks that `parts` are positive row counts adding up to `rows`.
fn check_parts(parts: &[usize], rows: usize) -> Result<()> {
    if parts.contains(&0) || parts.iter().sum::<usize>() != rows {
        return Err(ExpertError::Invalid(format!(
            "parts {parts:?} do not add up to {rows} rows"
        )));
    }
    Ok(())
}

/// The kept pre-activations of every part of `x`, concatenated; `None` (and whatever was
/// taken is dropped) when any part has none.
fn take_kept(
    kept: &mut ActivationCache,
    x: &Tensor,
    parts: &[usize],
    step: u64,
) -> Result<Option<Vec<f32>>> {
    let inputs = x.flatten_all()?.to_vec1::<f32>()?;
    let rows: usize = parts.iter().sum();
    let width = inputs.len() / rows.max(1);
    let mut all: Option<Vec<f32>> = None;
    let mut start = 0;
    for &n in parts {
        let Some(pre) = kept.take(&inputs[start * width..(start + n) * width], step) else {
            return Ok(None);
        };
        start += n;
        match &mut all {
            None if parts.len() == 1 => return Ok(Some(pre)),
            None => {
                let mut v = Vec::with_capacity(pre.len() / n * rows);
                v.extend_from_slice(&pre);
                all = Some(v);
            }
            Some(v) => v.extend_from_slice(&pre),
        }
    }
    Ok(all)
}

fn seeded_init(varmap: &VarMap, seed: u64) -> Result<()> {
    let data = lock(varmap.data());
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = StdRng::seed_from_u64(seed);
    for name in names {
        let var = &data[name];
        let dims = var.dims().to_vec();
        let is_norm = name.starts_with("ln");
        let values: Vec<f32> = if dims.len() == 2 {
            let bound = 1.0 / (dims[1] as f32).sqrt();
            (0..dims[0] * dims[1])
                .map(|_| rng.gen_range(-bound..bound))
                .collect()
        } else if is_norm {
            continue;
        } else {
            vec![0.0; var.elem_count()]
        };
        var.set(&Tensor::from_vec(values, dims, &Device::Cpu)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
