//! A new run from hyper-parameters, its data and its model: what `starling train --new-run` and
//! `starling demo` do before a session starts, and the checks a joiner makes on what it built.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use starling_experts::{ClientConfig, ExpertClient, MoeConfig, RemoteMixtureOfExperts};
use starling_node::Node;

use crate::batches::Sampler;
use crate::data::Dataset;
use crate::manifest::{
    DataSpec, ModeSpec, ModelSpec, MoeSpec, OptimizerKind, OptimizerSpec, RunManifest,
    ScheduleSpec, KNOWN_MODELS, MANIFEST_FORMAT,
};
use crate::model::{Built, Eval};
use crate::session::optimizer_config;

/// Hyper-parameters of a new run, each `None` for the model's default (a joiner takes them from
/// the manifest). `starling train` fills it from its flags, whose names the messages use.
#[derive(Debug, Clone, Default)]
pub struct Hyper {
    /// Optimizer: adamw, sgd (Nesterov momentum when --momentum > 0) or sign (steps by the
    /// sign; with --codec dct-topk:C:K:momentum=B it is DeMo). Default adamw.
    pub optimizer: Option<OptimizerKind>,
    /// Learning rate (default: mlp 0.005, charlm 0.003).
    pub lr: Option<f64>,
    /// Weight decay (default 0).
    pub weight_decay: Option<f64>,
    /// SGD momentum (default 0.9; sign: 0).
    pub momentum: Option<f64>,
    /// Learning rate over the run: constant (default) or cosine (warmup, then a half cosine
    /// down to 0 at the last epoch).
    pub lr_schedule: Option<String>,
    /// With --lr-schedule cosine: epochs of linear warmup (default 0).
    pub warmup_epochs: Option<u64>,
    /// Samples per local batch (default: mlp 32, charlm 16).
    pub batch_size: Option<u64>,
    /// Samples per global step, over the whole swarm (default: mlp 256, charlm 64).
    pub target_batch_size: Option<u64>,
    /// Epochs (global steps; DiLoCo: outer steps) the run lasts (default: mlp 60, charlm 150).
    pub epochs: Option<u64>,
    /// Evaluate every this many epochs (default: a sixth of the run).
    pub eval_every: Option<u64>,
    /// How peers train together: gradients (average every global batch's gradients) or diloco
    /// (local steps, then average the parameter deltas). Default gradients.
    pub mode: Option<String>,
    /// DiLoCo: local steps per averaging round (default 10).
    pub inner_steps: Option<u64>,
    /// DiLoCo: outer learning rate (default 0.7).
    pub outer_lr: Option<f64>,
    /// DiLoCo: outer Nesterov momentum (default 0.9).
    pub outer_momentum: Option<f64>,
    /// Averaging codec: none (exact), f16, bf16, u8, u4, ... (default none); or compressed
    /// gradient rounds: `powersgd:RANK[:bf16][:momentum=B]` (low rank),
    /// `dct-topk:CHUNK:K[:sign][:momentum=B]`
    /// (K of every CHUNK DCT coefficients); B < 1 makes what was not sent a decaying momentum.
    pub codec: Option<String>,
    /// How reducers combine the peers' contributions: mean (default), median,
    /// `trimmed-mean[:FRACTION]`, `centered-clip[:iters=N][,tau=T][,reject=K]` (robust to lying peers).
    pub aggregation: Option<String>,
    /// Check reducers: after each round, recompute one random block of another reducer's
    /// result with this probability, and refuse peers caught lying (default 0: off).
    pub verify: Option<f64>,
    /// Gradient mode: each peer averages the momentum of its gradients with this factor
    /// (0 < B < 1) instead of the gradients, and the optimizer has no momentum of its own (its
    /// `--momentum` defaults to 0 then). With a robust aggregation (centered-clip:reject=2) it
    /// makes a peer that sends the opposite of its gradient stand out (default: off).
    pub worker_momentum: Option<f64>,
    /// Seed of the initial parameters (default: from the clock).
    pub seed: Option<u64>,
    /// mlp: hidden units (default 64).
    pub hidden: Option<usize>,
    /// charlm: characters of context (default 32).
    pub context: Option<usize>,
    /// charlm: model width (default 64).
    pub dim: Option<usize>,
    /// charlm: transformer blocks (default 2).
    pub layers: Option<usize>,
    /// charlm: attention heads (default 4).
    pub heads: Option<usize>,
    /// charlm: a remote mixture-of-experts layer on the grid NAME, served by `starling experts
    /// serve --uids 'NAME.0.[0:E]' --hidden <--dim>` peers.
    pub moe_grid: Option<String>,
    /// charlm with --moe-grid: experts in the grid (default 4).
    pub moe_experts: Option<usize>,
    /// charlm with --moe-grid: experts per token (default 2).
    pub moe_k: Option<usize>,
}

/// A new run's manifest from the flags (schema hash still empty), validated.
pub fn new_manifest(name: &str, model: &str, h: &Hyper, data: DataSpec) -> Result<RunManifest> {
    ensure!(
        KNOWN_MODELS.contains(&model),
        "unknown model {model:?}: this binary builds {}",
        KNOWN_MODELS.join(", ")
    );
    let lm = model == "charlm";
    let model_spec = if lm {
        ModelSpec::Charlm {
            context: h.context.unwrap_or(32),
            dim: h.dim.unwrap_or(64),
            layers: h.layers.unwrap_or(2),
            heads: h.heads.unwrap_or(4),
            moe: h.moe_grid.as_ref().map(|grid| MoeSpec {
                grid: grid.clone(),
                experts: h.moe_experts.unwrap_or(4),
                k_best: h.moe_k.unwrap_or(2),
            }),
        }
    } else {
        for (flag, given) in [
            ("--context", h.context.is_some()),
            ("--dim", h.dim.is_some()),
            ("--layers", h.layers.is_some()),
            ("--heads", h.heads.is_some()),
            ("--moe-grid", h.moe_grid.is_some()),
        ] {
            ensure!(
                !given,
                "{flag} is a charlm option; model mlp does not take it"
            );
        }
        ModelSpec::Mlp {
            hidden: h.hidden.unwrap_or(64),
        }
    };
    ensure!(
        !(lm && h.hidden.is_some()),
        "--hidden is an mlp option; charlm's width is --dim"
    );
    let mode = match h.mode.as_deref() {
        Some("diloco") => ModeSpec::Diloco {
            inner_steps: h.inner_steps.unwrap_or(10),
            outer_lr: h.outer_lr.unwrap_or(0.7),
            outer_momentum: h.outer_momentum.unwrap_or(0.9),
        },
        _ => {
            for (flag, given) in [
                ("--inner-steps", h.inner_steps.is_some()),
                ("--outer-lr", h.outer_lr.is_some()),
                ("--outer-momentum", h.outer_momentum.is_some()),
            ] {
                ensure!(!given, "{flag} applies only with --mode diloco");
            }
            ModeSpec::Gradients
        }
    };
    let epochs = h.epochs.unwrap_or(if lm { 150 } else { 60 });
    let manifest = RunManifest {
        format: MANIFEST_FORMAT,
        name: name.to_string(),
        model: model_spec,
        data,
        optimizer: OptimizerSpec {
            kind: h.optimizer.unwrap_or(OptimizerKind::Adamw),
            lr: h.lr.unwrap_or(if lm { 3e-3 } else { 5e-3 }),
            weight_decay: h.weight_decay.unwrap_or(0.0),
            // (A sign step takes its momentum from the compressor when it is DeMo's.)
            momentum: h.momentum.unwrap_or(match h.optimizer {
                Some(OptimizerKind::Sign) => 0.0,
                // The momentum is the workers' (averaged), not the optimizer's.
                _ if h.worker_momentum.is_some() => 0.0,
                _ => 0.9,
            }),
            schedule: schedule(h)?,
        },
        mode,
        codec: h.codec.clone().unwrap_or_else(|| "none".into()),
        aggregation: h.aggregation.clone().unwrap_or_else(|| "mean".into()),
        verify: h.verify.unwrap_or(0.0),
        worker_momentum: h.worker_momentum,
        batch_size: h.batch_size.unwrap_or(if lm { 16 } else { 32 }),
        target_batch_size: h.target_batch_size.unwrap_or(if lm { 64 } else { 256 }),
        epochs,
        eval_every: h.eval_every.unwrap_or((epochs / 6).max(1)),
        seed: h.seed.unwrap_or_else(starling_dht::now_ms),
        schema_hash: "0".into(),
        created_ms: starling_dht::now_ms(),
    };
    manifest.validate()?;
    Ok(manifest)
}

/// The data kind of a new run, from `--data` (reading what it must to know the sizes).
pub fn new_run_data(model: &str, data: Option<&Path>) -> Result<(DataSpec, Dataset)> {
    match (model, data) {
        ("charlm", Some(file)) => {
            let text = crate::data::read_text(file, None)?;
            let vocab = text.vocab.iter().collect();
            Ok((DataSpec::Text { vocab }, Dataset::Text(text)))
        }
        ("charlm", None) => bail!("model charlm trains on text: give --data FILE (UTF-8)"),
        (_, Some(dir)) => {
            let images = crate::data::read_idx_dir(dir)?;
            let side = (images.inputs as f64).sqrt() as usize;
            let (rows, cols) = if side * side == images.inputs {
                (side, side)
            } else {
                (1, images.inputs)
            };
            Ok((
                DataSpec::Idx {
                    rows,
                    cols,
                    classes: images.classes,
                },
                Dataset::Images(images),
            ))
        }
        (_, None) => Ok((DataSpec::Digits, Dataset::Images(crate::data::digits()))),
    }
}

/// Checks that `data` suits the manifest's model (text longer than the context).
pub fn check_data(m: &RunManifest, data: &Dataset) -> Result<()> {
    if let (ModelSpec::Charlm { context, .. }, Dataset::Text(t)) = (&m.model, data) {
        ensure!(
            t.train.len() > context + 1 && t.val.len() > context + 1,
            "--data: the text is too short for a context of {context} characters (training part {}, validation part {})",
            t.train.len(),
            t.val.len()
        );
    }
    Ok(())
}

/// Builds the manifest's model (with its remote MoE layer on `node` when it has one) and checks
/// its schema against the manifest's.
pub fn build_model(
    m: &RunManifest,
    data: &Dataset,
    node: Option<&Node>,
    rt: tokio::runtime::Handle,
) -> Result<Built> {
    let moe_spec = match &m.model {
        ModelSpec::Charlm {
            moe: Some(spec),
            dim,
            ..
        } => Some((spec.clone(), *dim)),
        _ => None,
    };
    let make = |vb: candle_nn::VarBuilder| -> Result<RemoteMixtureOfExperts> {
        let (spec, dim) = moe_spec.clone().context("no MoE layer")?;
        let mut cfg = MoeConfig::new(&spec.grid, &[1, spec.experts], &[dim]);
        cfg.k_best = spec.k_best;
        cfg.k_min = 1;
        cfg.timeout_after_k_min = Duration::from_millis(500);
        cfg.forward_timeout = Duration::from_secs(5);
        cfg.backward_timeout = Duration::from_secs(10);
        let client = match node {
            Some(n) => ExpertClient::new(n.clone(), ClientConfig::default()),
            None => bail!("the MoE layer needs a node"),
        };
        Ok(RemoteMixtureOfExperts::new(vb, client, cfg, rt.clone())?)
    };
    let built = crate::model::build(m, data, Some(&make))?;
    Ok(built)
}

/// Checks that `built` has the tensor schema the manifest names (peers must build the same
/// model to train together).
pub fn schema_matches(m: &RunManifest, built: &Built) -> Result<()> {
    let mine = crate::model::schema_hex(&built.params);
    ensure!(
        mine == m.schema_hash,
        "this binary builds a different {} for run {:?} (tensor schema {mine}, the run's {}): it cannot train in it",
        m.model.name(),
        m.name,
        m.schema_hash
    );
    Ok(())
}

/// A batch-sampling seed of this peer's own (peers draw different batches).
pub fn seed_of(node: &Node) -> u64 {
    node.peer_id()
        .to_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
        })
}

/// One peer trains alone for the run's epochs on batches of `global_batch` samples, with the
/// run's optimizer (what a swarm's global steps amount to): the baseline a swarm is measured
/// against. Returns its final evaluation.
pub fn train_alone(m: &RunManifest, data: &Dataset, global_batch: u64) -> Result<Eval> {
    let mut built = crate::model::build(m, data, None)?;
    let mut opt = optimizer_config(m)
        .build(built.params.len())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut sampler = Sampler::new(global_batch as usize, 1);
    for _ in 0..m.epochs {
        let batch = sampler.next(data, 0)?;
        let grads = built.net.loss(&batch)?.backward()?;
        built.binding.grads_to_set(&grads, &mut built.params)?;
        opt.step_set(&mut built.params)?;
        built.binding.params_to_vars(&built.params)?;
    }
    built.net.evaluate(data)
}

/// The schedule `--lr-schedule` and `--warmup-epochs` ask for.
fn schedule(h: &Hyper) -> Result<Option<ScheduleSpec>> {
    match (h.lr_schedule.as_deref(), h.warmup_epochs) {
        (None | Some("constant"), None) => Ok(None),
        (None | Some("constant"), Some(_)) => {
            anyhow::bail!("--warmup-epochs needs --lr-schedule cosine")
        }
        (Some("cosine"), warmup) => Ok(Some(ScheduleSpec::Cosine {
            warmup_epochs: warmup.unwrap_or(0),
        })),
        (Some(other), _) => anyhow::bail!("unknown --lr-schedule {other:?}: constant or cosine"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lr_schedule_flags_give_a_schedule_or_say_what_is_wrong() {
        let h = |s: Option<&str>, w: Option<u64>| Hyper {
            lr_schedule: s.map(Into::into),
            warmup_epochs: w,
            ..Hyper::default()
        };
        assert_eq!(schedule(&h(None, None)).unwrap(), None);
        assert_eq!(schedule(&h(Some("constant"), None)).unwrap(), None);
        assert_eq!(
            schedule(&h(Some("cosine"), None)).unwrap(),
            Some(ScheduleSpec::Cosine { warmup_epochs: 0 })
        );
        assert_eq!(
            schedule(&h(Some("cosine"), Some(5))).unwrap(),
            Some(ScheduleSpec::Cosine { warmup_epochs: 5 })
        );
        let err = schedule(&h(None, Some(5))).unwrap_err().to_string();
        assert!(err.contains("--lr-schedule cosine"), "{err}");
        let err = schedule(&h(Some("step"), None)).unwrap_err().to_string();
        assert!(err.contains("constant or cosine"), "{err}");
    }
}
