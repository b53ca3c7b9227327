//! The built-in models, in candle: `mlp` (image classifier) and `charlm` (a small
//! character-level transformer language model, optionally with a remote mixture-of-experts
//! layer). Every variable lives in one `VarMap`; [`Built::params`] holds them by name, in name
//! order, initialised from the run's seed (candle's CPU RNG cannot be seeded), so every peer of a
//! new run starts from the same values.

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{
    embedding, layer_norm, linear,
    loss::cross_entropy,
    ops::{layer_norm_slow, softmax, softmax_last_dim},
    Embedding, LayerNorm, Linear, VarBuilder, VarMap,
};
use rand::{rngs::StdRng, SeedableRng};
use starling_experts::RemoteMixtureOfExperts;
use starling_training::{Init, ParamSet, TensorInfo, VarBinding};

use crate::data::{Dataset, Images, Text};
use crate::manifest::{DataSpec, ModelSpec, RunManifest};

/// Windows of validation text evaluated at most (bounds an evaluation's time).
const MAX_EVAL_WINDOWS: usize = 64;
/// The layer norms' epsilon (PyTorch's default).
const LN_EPS: f64 = 1e-5;

/// Whether a forward pass must carry gradients to every parameter, or only computes values.
///
/// candle's fused `layer_norm` and `softmax_last_dim` have no backward: a graph through them
/// ends there, and every parameter under them gets no gradient. Training passes use the same
/// maths written with differentiable ops; evaluation keeps the fused kernels (about 2x faster
/// for those ops, and nothing needs their gradient).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Train,
    Eval,
}

/// A layer norm, differentiable when `pass` trains.
fn norm(ln: &LayerNorm, x: &Tensor, pass: Pass) -> candle_core::Result<Tensor> {
    match (pass, ln.bias()) {
        (Pass::Train, Some(bias)) => layer_norm_slow(x, ln.weight(), bias, LN_EPS as f32),
        (Pass::Train, None) => candle_core::bail!("the model's layer norms have biases"),
        (Pass::Eval, _) => ln.forward(x),
    }
}

/// A softmax over the last dimension, differentiable when `pass` trains.
fn softmax_last(x: &Tensor, pass: Pass) -> candle_core::Result<Tensor> {
    match pass {
        Pass::Train => softmax(x, D::Minus1),
        Pass::Eval => softmax_last_dim(x),
    }
}

/// One batch of inputs and targets.
pub struct Batch {
    /// Images `[b, inputs]` or token ids `[b, context]`.
    pub x: Tensor,
    /// Labels `[b]` or next tokens `[b, context]`.
    pub y: Tensor,
    /// Samples in it.
    pub samples: u64,
}

/// What an evaluation measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Eval {
    /// Test accuracy, a fraction.
    Accuracy(f64),
    /// Validation loss, nats per character.
    ValLoss(f64),
}

/// A model: its loss on a batch, and its evaluation.
pub trait Net: Send + Sync {
    /// Mean loss over `batch` (a scalar tensor to call `backward` on).
    fn loss(&self, batch: &Batch) -> candle_core::Result<Tensor>;
    /// Test accuracy or validation loss on `data`'s held-out part.
    fn evaluate(&self, data: &Dataset) -> Result<Eval>;
}

/// A built model with its variables bound to a parameter set.
pub struct Built {
    /// The model.
    pub net: Arc<dyn Net>,
    /// Its parameters (and gradients), by name.
    pub params: ParamSet,
    /// Moves values between `params` and the model's variables.
    pub binding: VarBinding,
}

/// Builds a model's remote mixture-of-experts layer from its variable builder.
pub type MoeBuilder<'a> = dyn Fn(VarBuilder) -> Result<RemoteMixtureOfExperts> + 'a;

/// Builds the manifest's model for `data`, its parameters initialised from the manifest's seed.
/// `moe` builds the remote MoE layer when the model has one.
pub fn build(
    manifest: &RunManifest,
    data: &Dataset,
    moe: Option<&MoeBuilder<'_>>,
) -> Result<Built> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let net: Arc<dyn Net> = match (&manifest.model, data, &manifest.data) {
        (ModelSpec::Mlp { hidden }, Dataset::Images(images), _) => Arc::new(Mlp {
            l1: linear(images.inputs, *hidden, vb.pp("l1"))?,
            l2: linear(*hidden, images.classes, vb.pp("l2"))?,
        }),
        (
            ModelSpec::Charlm {
                context,
                dim,
                layers,
                heads,
                moe: moe_spec,
            },
            Dataset::Text(_),
            DataSpec::Text { vocab },
        ) => {
            let vocab = vocab.chars().count();
            let layer = match moe_spec {
                Some(_) => {
                    let make = moe.context("this run has a MoE layer, but none was set up")?;
                    Some(make(vb.pp("moe"))?)
                }
                None => None,
            };
            Arc::new(CharLm::new(
                vb, vocab, *context, *dim, *layers, *heads, layer,
            )?)
        }
        _ => anyhow::bail!("model {} cannot train on this data", manifest.model.name()),
    };
    // Name order: the same tensors in the same order on every peer.
    let mut named: Vec<(String, candle_core::Var)> = vars
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the model's variables are poisoned"))?
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut params = ParamSet::new();
    let binding = VarBinding::register(&mut params, named)?;
    binding.initialize(
        &mut params,
        &mut StdRng::seed_from_u64(manifest.seed),
        init_rule,
    )?;
    Ok(Built {
        net,
        params,
        binding,
    })
}

/// The model's tensors' schema hash, as a manifest records it.
pub fn schema_hex(params: &ParamSet) -> String {
    format!("{:016x}", params.schema_hash())
}

/// Initialisation by tensor name: layer norms at 1 (weights) and 0 (biases), embeddings
/// N(0, 0.02), linear layers as PyTorch's `nn.Linear`.
fn init_rule(t: &TensorInfo) -> Init {
    let name = t.name();
    if name.contains(".ln") || name.starts_with("ln") {
        if name.ends_with("weight") {
            Init::Constant(1.0)
        } else {
            Init::Zeros
        }
    } else if name.contains("emb") {
        Init::Normal {
            mean: 0.0,
            std: 0.02,
        }
    } else if name.ends_with("bias") {
        Init::Zeros
    } else {
        Init::TorchLinear
    }
}

pub(crate) fn images_batch(d: &Images, idx: &[usize], test: bool) -> Result<Batch> {
    let (xs, ys) = if test {
        (&d.test_x, &d.test_y)
    } else {
        (&d.train_x, &d.train_y)
    };
    // The images' bytes first, gathered with plain copies, then converted in one pass. The
    // images lie at random in a large set: converting each where it lies waited on one cache
    // miss after another (a tenth of a lone glyphs MLP peer's CPU); copies of whole images let
    // the core fetch many lines at once. (A flat_map over the whole batch pushed value by value
    // was slower still: a tenth of a joiner's CPU.)
    let mut bytes: Vec<u8> = Vec::with_capacity(idx.len() * d.inputs);
    for &i in idx {
        bytes.extend_from_slice(&xs[i * d.inputs..(i + 1) * d.inputs]);
    }
    let x: Vec<f32> = bytes.iter().map(|&p| d.value(p)).collect();
    let y: Vec<u32> = idx.iter().map(|&i| ys[i]).collect();
    Ok(Batch {
        x: Tensor::from_vec(x, (idx.len(), d.inputs), &Device::Cpu)?,
        y: Tensor::from_vec(y, idx.len(), &Device::Cpu)?,
        samples: idx.len() as u64,
    })
}

pub(crate) fn text_batch(tokens: &[u32], starts: &[usize], context: usize) -> Result<Batch> {
    let mut x = Vec::with_capacity(starts.len() * context);
    let mut y = Vec::with_capacity(starts.len() * context);
    for &s in starts {
        x.extend_from_slice(&tokens[s..s + context]);
        y.extend_from_slice(&tokens[s + 1..s + context + 1]);
    }
    Ok(Batch {
        x: Tensor::from_vec(x, (starts.len(), context), &Device::Cpu)?,
        y: Tensor::from_vec(y, (starts.len(), context), &Device::Cpu)?,
        samples: starts.len() as u64,
    })
}

struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?.relu()?)
    }
}

impl Net for Mlp {
    fn loss(&self, batch: &Batch) -> candle_core::Result<Tensor> {
        cross_entropy(&self.logits(&batch.x)?, &batch.y)
    }

    fn evaluate(&self, data: &Dataset) -> Result<Eval> {
        let Dataset::Images(d) = data else {
            anyhow::bail!("mlp evaluates on images");
        };
        let n = d.test_y.len();
        let mut correct = 0usize;
        for from in (0..n).step_by(512) {
            let idx: Vec<usize> = (from..(from + 512).min(n)).collect();
            let b = images_batch(d, &idx, true)?;
            let pred: Vec<u32> = self.logits(&b.x)?.argmax(D::Minus1)?.to_vec1()?;
            correct += pred
                .iter()
                .zip(&d.test_y[from..])
                .filter(|(p, y)| p == y)
                .count();
        }
        Ok(Eval::Accuracy(correct as f64 / n.max(1) as f64))
    }
}

/// A pre-norm causal transformer block of the charlm.
///
/// Why not the experts' transformer block (`starling_experts`' `ExpertKind::Transformer`): that
/// one is a whole network behind a server (no mask: it sees one sequence of activations at a
/// time), with its own layer norm written in primitive ops; this one masks attention causally
/// and runs candle's fused layer norm and softmax when evaluating (they have no backward, so
/// training uses the primitive ops: [`Pass`]). Their parameter names also differ, and they are
/// part of a run's tensor schema: merging them would change every charlm run's schema hash.
struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    out: Linear,
    heads: usize,
}

impl Block {
    fn new(vb: VarBuilder, dim: usize, heads: usize) -> candle_core::Result<Self> {
        Ok(Block {
            ln1: layer_norm(dim, LN_EPS, vb.pp("ln1"))?,
            qkv: linear(dim, 3 * dim, vb.pp("qkv"))?,
            proj: linear(dim, dim, vb.pp("proj"))?,
            ln2: layer_norm(dim, LN_EPS, vb.pp("ln2"))?,
            fc: linear(dim, 4 * dim, vb.pp("fc"))?,
            out: linear(4 * dim, dim, vb.pp("out"))?,
            heads,
        })
    }

    /// Pre-norm block: `x + attn(ln1 x)`, then `x + mlp(ln2 x)`. `mask` is `[t, t]`.
    fn forward(&self, x: &Tensor, mask: &Tensor, pass: Pass) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let dh = d / self.heads;
        let qkv = self
            .qkv
            .forward(&norm(&self.ln1, x, pass)?)?
            .reshape((b, t, 3, self.heads, dh))?
            .permute((2, 0, 3, 1, 4))?;
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let att = (q.matmul(&k.t()?.contiguous()?)? / (dh as f64).sqrt())?;
        let att = softmax_last(&att.broadcast_add(mask)?, pass)?;
        let y = att
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, t, d))?;
        let x = (x + self.proj.forward(&y)?)?;
        let h = self.fc.forward(&norm(&self.ln2, &x, pass)?)?.gelu()?;
        x + self.out.forward(&h)?
    }
}

struct CharLm {
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<Block>,
    moe: Option<RemoteMixtureOfExperts>,
    ln: LayerNorm,
    head: Linear,
    context: usize,
    mask: Tensor,
}

impl CharLm {
    fn new(
        vb: VarBuilder,
        vocab: usize,
        context: usize,
        dim: usize,
        layers: usize,
        heads: usize,
        moe: Option<RemoteMixtureOfExperts>,
    ) -> Result<Self> {
        let mask: Vec<f32> = (0..context)
            .flat_map(|i| (0..context).map(move |j| if j > i { -1e9 } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (context, context), vb.device())?.to_dtype(vb.dtype())?;
        Ok(CharLm {
            tok: embedding(vocab, dim, vb.pp("tok_emb"))?,
            pos: embedding(context, dim, vb.pp("pos_emb"))?,
            blocks: (0..layers)
                .map(|l| Block::new(vb.pp(format!("block{l}")), dim, heads))
                .collect::<candle_core::Result<_>>()?,
            moe,
            ln: layer_norm(dim, LN_EPS, vb.pp("ln_f"))?,
            head: linear(dim, vocab, vb.pp("head"))?,
            context,
            mask,
        })
    }

    /// Logits `[b * t, vocab]` for token ids `[b, t]`.
    fn logits(&self, x: &Tensor, pass: Pass) -> candle_core::Result<Tensor> {
        let (b, t) = x.dims2()?;
        let positions = Tensor::arange(0u32, t as u32, &Device::Cpu)?;
        let mut h = self
            .tok
            .forward(x)?
            .broadcast_add(&self.pos.forward(&positions)?)?;
        let mask = self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
        for block in &self.blocks {
            h = block.forward(&h, &mask, pass)?;
        }
        let d = h.dim(2)?;
        let mut flat = h.reshape((b * t, d))?;
        if let Some(moe) = &self.moe {
            flat = (&flat + moe.forward(&flat)?)?;
        }
        self.head.forward(&norm(&self.ln, &flat, pass)?)
    }

    /// Mean loss per character over `batch`.
    fn loss_in(&self, batch: &Batch, pass: Pass) -> candle_core::Result<Tensor> {
        let logits = self.logits(&batch.x, pass)?;
        cross_entropy(&logits, &batch.y.flatten_all()?)
    }
}

impl Net for CharLm {
    fn loss(&self, batch: &Batch) -> candle_core::Result<Tensor> {
        self.loss_in(batch, Pass::Train)
    }

    fn evaluate(&self, data: &Dataset) -> Result<Eval> {
        let Dataset::Text(t) = data else {
            anyhow::bail!("charlm evaluates on text");
        };
        eval_text(self, t)
    }
}

/// Mean loss over up to [`MAX_EVAL_WINDOWS`] non-overlapping validation windows.
fn eval_text(lm: &CharLm, t: &Text) -> Result<Eval> {
    let c = lm.context;
    ensure!(
        t.val.len() > c,
        "the validation text ({} characters) is shorter than the context ({c})",
        t.val.len()
    );
    let windows = ((t.val.len() - 1) / c).clamp(1, MAX_EVAL_WINDOWS);
    let starts: Vec<usize> = (0..windows).map(|w| w * c).collect();
    let mut total = 0.0;
    for chunk in starts.chunks(16) {
        let b = text_batch(&t.val, chunk, c)?;
        let loss: f32 = lm.loss_in(&b, Pass::Eval)?.to_scalar()?;
        total += loss as f64 * chunk.len() as f64;
    }
    Ok(Eval::ValLoss(total / windows as f64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batches::Sampler;
    use crate::data::digits;
    use crate::manifest::test_manifest;
    use rand::Rng;

    fn manifest(model: ModelSpec, data: DataSpec) -> RunManifest {
        RunManifest {
            seed: 3,
            ..test_manifest(model, data)
        }
    }

    #[test]
    fn the_same_seed_builds_the_same_parameters() {
        let data = Dataset::Images(digits());
        let m = manifest(ModelSpec::Mlp { hidden: 16 }, DataSpec::Digits);
        let a = build(&m, &data, None).unwrap();
        let b = build(&m, &data, None).unwrap();
        assert_eq!(a.params.params(), b.params.params());
        assert_eq!(schema_hex(&a.params), schema_hex(&b.params));
        assert_eq!(a.params.len(), 64 * 16 + 16 + 16 * 10 + 10);
        let mut other = m.clone();
        other.seed = 4;
        assert_ne!(
            build(&other, &data, None).unwrap().params.params(),
            a.params.params()
        );
    }

    #[test]
    fn an_image_batch_holds_each_chosen_image_and_label_in_order() {
        let d = digits();
        let mut rng = rand::thread_rng();
        let idx: Vec<usize> = (0..37).map(|_| rng.gen_range(0..d.train_len())).collect();
        let b = images_batch(&d, &idx, false).unwrap();
        assert_eq!(b.samples, 37);
        assert_eq!(b.x.dims(), &[37, d.inputs]);
        let x: Vec<f32> = b.x.flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<u32> = b.y.to_vec1().unwrap();
        for (k, &i) in idx.iter().enumerate() {
            let want: Vec<f32> = d.train_x[i * d.inputs..(i + 1) * d.inputs]
                .iter()
                .map(|&p| f32::from(p) / 16.0)
                .collect();
            assert_eq!(x[k * d.inputs..(k + 1) * d.inputs], want[..], "image {k}");
            assert_eq!(y[k], d.train_y[i]);
        }
        let t = images_batch(&d, &[0, d.test_y.len() - 1], true).unwrap();
        let y: Vec<u32> = t.y.to_vec1().unwrap();
        assert_eq!(y, [d.test_y[0], d.test_y[d.test_y.len() - 1]]);
    }

    #[test]
    fn charlm_loss_starts_near_uniform_and_is_causal() {
        let text: Vec<u32> = (0..400).map(|i| (i % 7) as u32).collect();
        let data = Dataset::Text(Text {
            vocab: "abcdefg".chars().collect(),
            train: text.clone(),
            val: text,
        });
        let m = manifest(
            ModelSpec::Charlm {
                context: 8,
                dim: 16,
                layers: 1,
                heads: 2,
                moe: None,
            },
            DataSpec::Text {
                vocab: "abcdefg".into(),
            },
        );
        let built = build(&m, &data, None).unwrap();
        let Eval::ValLoss(loss) = built.net.evaluate(&data).unwrap() else {
            panic!("text evaluates to a loss");
        };
        assert!(
            (loss - 7f64.ln()).abs() < 0.3,
            "initial loss {loss} vs ln 7"
        );
        // Causality: changing the last token changes no earlier position's logits.
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let lm = CharLm::new(vb, 7, 8, 16, 2, 2, None).unwrap();
        let logits = |tokens: Vec<u32>| -> Vec<Vec<f32>> {
            let x = Tensor::from_vec(tokens, (1, 8), &Device::Cpu).unwrap();
            lm.logits(&x, Pass::Eval).unwrap().to_vec2().unwrap()
        };
        let a = logits(vec![0, 1, 2, 3, 4, 5, 6, 0]);
        let b = logits(vec![0, 1, 2, 3, 4, 5, 6, 5]);
        for pos in 0..7 {
            assert!(
                a[pos]
                    .iter()
                    .zip(&b[pos])
                    .all(|(x, y)| (x - y).abs() < 1e-6),
                "position {pos} saw the future"
            );
        }
        assert!(a[7].iter().zip(&b[7]).any(|(x, y)| (x - y).abs() > 1e-6));
    }

    fn tiny_text() -> (Dataset, DataSpec) {
        let mut rng = StdRng::seed_from_u64(9);
        let text: Vec<u32> = (0..600).map(|_| rng.gen_range(0..5)).collect();
        let data = Dataset::Text(Text {
            vocab: "abcde".chars().collect(),
            train: text.clone(),
            val: text,
        });
        (
            data,
            DataSpec::Text {
                vocab: "abcde".into(),
            },
        )
    }

    /// Every parameter of every built-in model gets a non-zero gradient from one batch (the
    /// binding refuses a backward that misses one; this also checks none is identically zero),
    /// and a training pass computes the same loss as the evaluation pass's fused kernels.
    #[test]
    fn every_parameter_of_every_builtin_model_gets_a_gradient() {
        let (text, text_spec) = tiny_text();
        let cases = [
            (
                ModelSpec::Mlp { hidden: 16 },
                DataSpec::Digits,
                Dataset::Images(digits()),
            ),
            (
                ModelSpec::Charlm {
                    context: 8,
                    dim: 16,
                    layers: 2,
                    heads: 2,
                    moe: None,
                },
                text_spec,
                text,
            ),
        ];
        for (spec, data_spec, data) in cases {
            let name = spec.name();
            let mut built = build(&manifest(spec, data_spec), &data, None).unwrap();
            let batch = Sampler::new(8, 1).next(&data, 8).unwrap();
            let loss = built.net.loss(&batch).unwrap();
            built
                .binding
                .grads_to_set(&loss.backward().unwrap(), &mut built.params)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            for (tensor, _) in built.binding.vars() {
                let g = built.params.grad(tensor).unwrap();
                assert!(
                    g.iter().any(|&v| v != 0.0) && g.iter().all(|v| v.is_finite()),
                    "{name}: {tensor} got no gradient"
                );
            }
        }
        // The training pass (differentiable ops) and the evaluation pass (fused kernels) agree.
        let (data, _) = tiny_text();
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let lm = CharLm::new(vb, 5, 8, 16, 2, 2, None).unwrap();
        let batch = Sampler::new(8, 2).next(&data, 8).unwrap();
        let train: f32 = lm
            .loss_in(&batch, Pass::Train)
            .unwrap()
            .to_scalar()
            .unwrap();
        let eval: f32 = lm.loss_in(&batch, Pass::Eval).unwrap().to_scalar().unwrap();
        assert!((train - eval).abs() < 1e-5, "train {train} vs eval {eval}");
    }

    /// The charlm's gradient against central finite differences of its loss, in f64 on a tiny
    /// configuration: for three random entries of every tensor, |fd - grad| <= 1e-6 + 1e-4 |grad|
    /// (h = 1e-5: truncation ~1e-10, rounding ~1e-11).
    #[test]
    fn the_charlm_gradient_matches_finite_differences() {
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F64, &Device::Cpu);
        let lm = CharLm::new(vb, 5, 6, 8, 2, 2, None).unwrap();
        let (data, _) = tiny_text();
        let batch = Sampler::new(3, 4).next(&data, 6).unwrap();
        let loss = |lm: &CharLm| -> f64 {
            lm.loss_in(&batch, Pass::Train)
                .unwrap()
                .to_scalar()
                .unwrap()
        };
        let grads = lm.loss_in(&batch, Pass::Train).unwrap().backward().unwrap();
        let named: Vec<(String, candle_core::Var)> = vars
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(
            named.len(),
            2 + 2 * 12 + 4,
            "embeddings, blocks, ln_f, head"
        );
        let mut rng = StdRng::seed_from_u64(5);
        let h = 1e-5;
        let mut checked = 0;
        for (name, var) in &named {
            let grad: Vec<f64> = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient"))
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            // `copy`: a Var's tensor shares its storage, and `set` writes into it.
            let original = var.as_tensor().copy().unwrap();
            let values: Vec<f64> = original.flatten_all().unwrap().to_vec1().unwrap();
            let at = |i: usize, v: f64| {
                let mut vs = values.clone();
                vs[i] = v;
                var.set(&Tensor::from_vec(vs, var.dims(), &Device::Cpu).unwrap())
                    .unwrap();
            };
            for _ in 0..3 {
                let i = rng.gen_range(0..values.len());
                at(i, values[i] + h);
                let plus = loss(&lm);
                at(i, values[i] - h);
                let minus = loss(&lm);
                var.set(&original).unwrap();
                let fd = (plus - minus) / (2.0 * h);
                assert!(
                    (fd - grad[i]).abs() <= 1e-6 + 1e-4 * grad[i].abs(),
                    "{name}[{i}]: finite difference {fd:e}, gradient {:e}",
                    grad[i]
                );
                checked += 1;
            }
        }
        assert_eq!(checked, 3 * named.len());
    }
}
