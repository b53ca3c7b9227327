//! `starling train`: create a training run (a signed manifest in the DHT) or join one, and
//! train in it until its last epoch.

pub mod ui;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use clap::Args;
use starling_node::{Multiaddr, Node};
use starling_run::manifest::{self, DataSpec, OptimizerKind, SignedManifest};
use starling_run::session::Session;
use starling_run::setup::{
    build_model, check_data, new_manifest, new_run_data, schema_matches, seed_of, Hyper,
};
use starling_run::{data, model, Reporter};

use crate::observe::{ObserveArgs, Observer};
use crate::sched::CpuPolicy;
use crate::{JoinArgs, ListenArgs, NatArgs};
use ui::{Bar, JsonLines};

/// How long a joiner looks for the run's manifest.
const MANIFEST_LOOKUP: Duration = Duration::from_secs(30);

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Create a run with this name (1-64 of A-Z a-z 0-9 - _ .), publish its signed manifest,
    /// and train in it. Others join with --run NAME@<this peer's id>.
    #[arg(
        long,
        value_name = "NAME",
        conflicts_with = "run",
        required_unless_present = "run"
    )]
    new_run: Option<String>,
    /// Join a run: NAME, or NAME@KEY to accept only a manifest signed by KEY (the creator's peer
    /// id, as `--new-run` prints it, or its 64-digit hex key).
    #[arg(long, value_name = "NAME[@KEY]")]
    run: Option<manifest::RunRef>,
    /// With --run: read the signed manifest from this file (written by --save-manifest) instead
    /// of the DHT.
    #[arg(long, value_name = "FILE", requires = "run")]
    manifest: Option<PathBuf>,
    /// With --new-run: also write the signed manifest to this file.
    #[arg(long, value_name = "FILE", requires = "new_run")]
    save_manifest: Option<PathBuf>,
    /// The model of a new run: `mlp` (image classifier) or `charlm` (character-level
    /// transformer language model).
    #[arg(long, value_name = "MODEL")]
    model: Option<String>,
    /// Training data: for `mlp`, a directory of IDX files (MNIST's format: train-images-idx3-ubyte,
    /// train-labels-idx1-ubyte, optionally .gz, optionally t10k-* test files; default: the
    /// embedded 8x8 digits); for `charlm`, a UTF-8 text file (the last tenth validates).
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    #[command(flatten)]
    hyper: HyperArgs,
    #[command(flatten)]
    join: JoinArgs,
    #[command(flatten)]
    nat: NatArgs,
    #[command(flatten)]
    listen: ListenArgs,
    /// Save checkpoints here, and resume from the one here at start.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Epochs between checkpoints (one is also saved at the end and on Ctrl-C).
    #[arg(long, default_value_t = 10)]
    checkpoint_every: u64,
    /// Gradient mode: apply each global step one epoch late, computing the next batches
    /// while the step's averaging round runs (communication hidden behind compute; up to
    /// --max-stale of each gradient a step stale). Peers with and without it train together
    /// and stay identical.
    #[arg(long)]
    delayed_update: bool,
    /// With --delayed-update: the part of the next global batch (0 to 1] computed before the
    /// step in flight must be applied; past it the peer waits for the step. Larger overlaps
    /// more communication with compute and leaves more of each gradient a step stale
    /// (default 0.125; 1: a whole step late, which cost the glyphs MLP 6-14 points)
    #[arg(long, value_name = "FRACTION", requires = "delayed_update", value_parser = parse_fraction)]
    max_stale: Option<f64>,
    /// Draw the batches of shard INDEX/COUNT of the run's shared order (a stream per epoch from
    /// the run's seed, dealt out batch by batch) instead of this peer's own random batches: N
    /// peers given 0/N .. N-1/N together draw the batches that one peer given 0/1 draws alone,
    /// so a swarm's run can be compared with one peer's batch for batch, and no two of them
    /// compute the same batch.
    #[arg(long, value_name = "INDEX/COUNT")]
    shard: Option<starling_run::batches::Shard>,
    /// Before the first batch, wait until the run has N live peers, this one included (at
    /// most 10 minutes; Ctrl-C ends the wait): machines started together then train together
    /// from the first epoch instead of the first one stepping alone meanwhile.
    #[arg(long, value_name = "N", default_value_t = 1)]
    min_peers: usize,
    /// How the kernel schedules this process: `batch` (Linux's SCHED_BATCH: the network's
    /// short wake-ups wait for the running batch instead of cutting into it, and the peer
    /// yields to interactive programs) or `normal` (the system's default).
    #[arg(long, value_enum, value_name = "POLICY", default_value_t = CpuPolicy::Batch)]
    sched: CpuPolicy,
    /// Testing a swarm's defences: this peer lies on purpose, sending in every round instead
    /// of its gradient `scale:K` (the gradient times K), `sign-flip` or `noise:K` (Gaussian
    /// noise of K times its norm), whose fate is up to the run's --aggregation; or, as a
    /// reducer, returning results K too high (`reducer:K`), which a run with --verify catches.
    #[arg(long, value_name = "ATTACK", hide = true)]
    byzantine: Option<starling_run::attack::Attack>,
    /// One JSON object per line (events: node, devices, waiting, started, synced, step, eval,
    /// checkpoint, finished, left) instead of a progress bar.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    observe: ObserveArgs,
}

impl TrainArgs {
    /// The scheduling policy asked for (applied before the async runtime starts).
    pub fn sched(&self) -> CpuPolicy {
        self.sched
    }
}

/// Hyper-parameters of a new run (a joiner takes them from the manifest).
#[derive(Args, Debug, Default)]
pub struct HyperArgs {
    /// Optimizer: adamw, sgd (Nesterov momentum when --momentum > 0) or sign (steps by the
    /// sign; with --codec dct-topk:C:K:momentum=B it is DeMo). Default adamw.
    #[arg(long)]
    pub(crate) optimizer: Option<OptimizerKind>,
    /// Learning rate (default: mlp 0.005, charlm 0.003).
    #[arg(long)]
    pub(crate) lr: Option<f64>,
    /// Weight decay (default 0).
    #[arg(long)]
    pub(crate) weight_decay: Option<f64>,
    /// SGD momentum (default 0.9; sign: 0).
    #[arg(long)]
    pub(crate) momentum: Option<f64>,
    /// Learning rate over the run: constant (default) or cosine (warmup, then a half cosine
    /// down to 0 at the last epoch).
    #[arg(long, value_parser = ["constant", "cosine"])]
    pub(crate) lr_schedule: Option<String>,
    /// With --lr-schedule cosine: epochs of linear warmup (default 0).
    #[arg(long)]
    pub(crate) warmup_epochs: Option<u64>,
    /// Samples per local batch (default: mlp 32, charlm 16).
    #[arg(long)]
    pub(crate) batch_size: Option<u64>,
    /// Samples per global step, over the whole swarm (default: mlp 256, charlm 64).
    #[arg(long)]
    pub(crate) target_batch_size: Option<u64>,
    /// Epochs (global steps; DiLoCo: outer steps) the run lasts (default: mlp 60, charlm 150).
    #[arg(long)]
    pub(crate) epochs: Option<u64>,
    /// Evaluate every this many epochs (default: a sixth of the run).
    #[arg(long)]
    pub(crate) eval_every: Option<u64>,
    /// How peers train together: gradients (average every global batch's gradients) or diloco
    /// (local steps, then average the parameter deltas). Default gradients.
    #[arg(long, value_parser = ["gradients", "diloco"])]
    pub(crate) mode: Option<String>,
    /// DiLoCo: local steps per averaging round (default 10).
    #[arg(long)]
    pub(crate) inner_steps: Option<u64>,
    /// DiLoCo: outer learning rate (default 0.7).
    #[arg(long)]
    pub(crate) outer_lr: Option<f64>,
    /// DiLoCo: outer Nesterov momentum (default 0.9).
    #[arg(long)]
    pub(crate) outer_momentum: Option<f64>,
    /// Averaging codec: none (exact), f16, bf16, u8, u4, ... (default none); or compressed
    /// gradient rounds: `powersgd:RANK[:bf16][:momentum=B]` (low rank),
    /// `dct-topk:CHUNK:K[:sign][:momentum=B]`
    /// (K of every CHUNK DCT coefficients); B < 1 makes what was not sent a decaying momentum.
    #[arg(long)]
    pub(crate) codec: Option<String>,
    /// How reducers combine the peers' contributions: mean (default), median,
    /// `trimmed-mean[:FRACTION]`, `centered-clip[:iters=N][,tau=T][,reject=K]` (robust to lying
    /// peers; reject=K leaves out contributions K clipping radii away).
    #[arg(long)]
    pub(crate) aggregation: Option<String>,
    /// Check reducers: after each round, recompute one random block of another reducer's
    /// result with this probability (0 to 1), and refuse peers caught lying (default 0: off).
    #[arg(long)]
    pub(crate) verify: Option<f64>,
    /// Gradient mode: each peer averages the momentum of its gradients (factor B, 0 < B < 1)
    /// instead of the gradients, and the optimizer's own --momentum defaults to 0. With
    /// --aggregation centered-clip:reject=2 a peer sending the opposite of its gradient stands
    /// out and is left out (default: off).
    #[arg(long, value_name = "B")]
    pub(crate) worker_momentum: Option<f64>,
    /// Seed of the initial parameters (default: from the clock).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// mlp: hidden units (default 64).
    #[arg(long)]
    pub(crate) hidden: Option<usize>,
    /// charlm: characters of context (default 32).
    #[arg(long)]
    pub(crate) context: Option<usize>,
    /// charlm: model width (default 64).
    #[arg(long)]
    pub(crate) dim: Option<usize>,
    /// charlm: transformer blocks (default 2).
    #[arg(long)]
    pub(crate) layers: Option<usize>,
    /// charlm: attention heads (default 4).
    #[arg(long)]
    pub(crate) heads: Option<usize>,
    /// charlm: a remote mixture-of-experts layer on the grid NAME, served by `starling experts
    /// serve --uids 'NAME.0.[0:E]' --hidden <--dim>` peers.
    #[arg(long, value_name = "NAME")]
    pub(crate) moe_grid: Option<String>,
    /// charlm with --moe-grid: experts in the grid (default 4).
    #[arg(long)]
    pub(crate) moe_experts: Option<usize>,
    /// charlm with --moe-grid: experts per token (default 2).
    #[arg(long)]
    pub(crate) moe_k: Option<usize>,
}

impl HyperArgs {
    /// The hyper-parameters the flags give.
    pub fn hyper(&self) -> Hyper {
        Hyper {
            optimizer: self.optimizer,
            lr: self.lr,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            lr_schedule: self.lr_schedule.clone(),
            warmup_epochs: self.warmup_epochs,
            batch_size: self.batch_size,
            target_batch_size: self.target_batch_size,
            epochs: self.epochs,
            eval_every: self.eval_every,
            mode: self.mode.clone(),
            inner_steps: self.inner_steps,
            outer_lr: self.outer_lr,
            outer_momentum: self.outer_momentum,
            codec: self.codec.clone(),
            aggregation: self.aggregation.clone(),
            verify: self.verify,
            worker_momentum: self.worker_momentum,
            seed: self.seed,
            hidden: self.hidden,
            context: self.context,
            dim: self.dim,
            layers: self.layers,
            heads: self.heads,
            moe_grid: self.moe_grid.clone(),
            moe_experts: self.moe_experts,
            moe_k: self.moe_k,
        }
    }

    /// The flags given, by name (a joiner may give none).
    fn given(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        let mut note = |on: bool, name| {
            if on {
                v.push(name)
            }
        };
        note(self.optimizer.is_some(), "--optimizer");
        note(self.lr.is_some(), "--lr");
        note(self.weight_decay.is_some(), "--weight-decay");
        note(self.momentum.is_some(), "--momentum");
        note(self.lr_schedule.is_some(), "--lr-schedule");
        note(self.warmup_epochs.is_some(), "--warmup-epochs");
        note(self.batch_size.is_some(), "--batch-size");
        note(self.target_batch_size.is_some(), "--target-batch-size");
        note(self.epochs.is_some(), "--epochs");
        note(self.eval_every.is_some(), "--eval-every");
        note(self.mode.is_some(), "--mode");
        note(self.inner_steps.is_some(), "--inner-steps");
        note(self.outer_lr.is_some(), "--outer-lr");
        note(self.outer_momentum.is_some(), "--outer-momentum");
        note(self.codec.is_some(), "--codec");
        note(self.aggregation.is_some(), "--aggregation");
        note(self.verify.is_some(), "--verify");
        note(self.worker_momentum.is_some(), "--worker-momentum");
        note(self.seed.is_some(), "--seed");
        note(self.hidden.is_some(), "--hidden");
        note(self.context.is_some(), "--context");
        note(self.dim.is_some(), "--dim");
        note(self.layers.is_some(), "--layers");
        note(self.heads.is_some(), "--heads");
        note(self.moe_grid.is_some(), "--moe-grid");
        note(self.moe_experts.is_some(), "--moe-experts");
        note(self.moe_k.is_some(), "--moe-k");
        v
    }
}

/// Prints the node's identity and dialable addresses (the first is the one to give others).
async fn print_node(node: &Node, json: bool) -> Result<Vec<Multiaddr>> {
    let addrs = crate::node_cmd::reachable_first(node.listen_addrs().await?);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "event": "node",
                "peer_id": node.peer_id().to_string(),
                "listen": addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            })
        );
    } else {
        println!("peer id: {}", node.peer_id());
        for a in &addrs {
            println!("listening on {a}");
        }
    }
    Ok(addrs)
}

pub async fn run(args: TrainArgs) -> Result<()> {
    let rt = tokio::runtime::Handle::current();
    let mut cfg = args.join.config()?;
    args.listen.apply(&mut cfg);
    args.nat.apply(&mut cfg);
    // A creator restarted with its own command (after a crash): its --checkpoint-dir holds the
    // run it created, so it rejoins that run (hyper-parameters from the saved manifest) instead
    // of creating a second one under the same name.
    let restarted = match (&args.new_run, &args.checkpoint_dir) {
        (Some(name), Some(dir)) => {
            starling_run::checkpoint::saved_manifest(dir)?.filter(|(m, _)| &m.name == name)
        }
        _ => None,
    };
    if let (Some(dir), true) = (&args.checkpoint_dir, restarted.is_some()) {
        tracing::info!(
            "--checkpoint-dir {} holds this run: rejoining it (its manifest's hyper-parameters apply)",
            dir.display()
        );
    }
    // Everything that can be refused is checked before anything is written or announced.
    let creating = args.new_run.as_ref().filter(|_| restarted.is_none());
    let (manifest, signed, node, data, built, sync_first) = if let Some(name) = creating {
        let model_name = args
            .model
            .as_deref()
            .context("--new-run needs --model (mlp or charlm)")?;
        // The model's name (`new_manifest` refuses unknown ones), the sizes (no data read for
        // an invalid run), then the data, then the model.
        let placeholder = if model_name == "charlm" {
            DataSpec::Text { vocab: "ab".into() }
        } else {
            DataSpec::Digits
        };
        new_manifest(name, model_name, &args.hyper.hyper(), placeholder)?;
        let (spec, data) = new_run_data(model_name, args.data.as_deref())?;
        let mut manifest = new_manifest(name, model_name, &args.hyper.hyper(), spec)?;
        check_data(&manifest, &data)?;
        for caveat in manifest.caveats() {
            tracing::warn!("{caveat}");
        }
        if let Some(path) = &args.save_manifest {
            ensure!(
                !path.exists(),
                "--save-manifest {}: the file exists (not overwritten)",
                path.display()
            );
        }
        let node = Node::start(cfg).await?;
        let built = build_model(&manifest, &data, Some(&node), rt.clone())?;
        manifest.schema_hash = model::schema_hex(&built.params);
        manifest.validate()?;
        let signed = SignedManifest::sign(&manifest, node.owner_key())?;
        (manifest, signed, node, data, built, false)
    } else {
        let given = args.hyper.given();
        if restarted.is_none() {
            ensure!(
                given.is_empty() && args.model.is_none(),
                "{} set a new run's hyper-parameters; a joiner takes them from the run's manifest (drop them, or create a run with --new-run)",
                if args.model.is_some() { "--model".to_string() } else { given.join(", ") }
            );
            ensure!(
                args.manifest.is_some() || !args.join.bootstrap.is_empty(),
                "--run needs --bootstrap ADDR (a peer of the run) or --manifest FILE"
            );
        }
        let run = args.run.clone();
        let from_file = match &args.manifest {
            Some(path) => {
                let run = run.as_ref().context("give --new-run NAME or --run NAME")?;
                let bytes = std::fs::read(path)
                    .with_context(|| format!("reading --manifest {}", path.display()))?;
                let signed = SignedManifest::from_json(&bytes)
                    .with_context(|| format!("--manifest {}", path.display()))?;
                Some(manifest::choose(run, &[signed])?)
            }
            None => restarted.clone(),
        };
        // The manifest in hand (from --manifest or the checkpoint directory), or the run to
        // look up in the DHT.
        let source = match (from_file, run) {
            (Some(c), _) => Ok(c),
            (None, Some(run)) => Err(run),
            (None, None) => anyhow::bail!("give --new-run NAME or --run NAME"),
        };
        // IDX files are read while the node starts and the manifest is looked up.
        let ahead = data::Prefetch::start(args.data.as_deref());
        let node = Node::start(cfg).await?;
        let chosen = match source {
            Ok(c) => Ok(c),
            Err(run) => manifest::fetch(&node, &run, MANIFEST_LOOKUP).await,
        };
        let (manifest, signed) = match chosen {
            Ok(c) => c,
            Err(e) => {
                node.shutdown().await;
                return Err(e);
            }
        };
        let prepared = async {
            let data = data::load_prefetched(&manifest.data, args.data.as_deref(), ahead).await?;
            check_data(&manifest, &data)?;
            let built = build_model(&manifest, &data, Some(&node), rt.clone())?;
            schema_matches(&manifest, &built)?;
            Ok::<_, anyhow::Error>((data, built))
        }
        .await;
        let (data, built) = match prepared {
            Ok(v) => v,
            Err(e) => {
                node.shutdown().await;
                return Err(e);
            }
        };
        (manifest, signed, node, data, built, true)
    };

    let addrs = print_node(&node, args.json).await?;
    let observer = match Observer::start(&node, &args.observe).await {
        Ok(o) => o,
        Err(e) => {
            node.shutdown().await;
            return Err(e);
        }
    };
    observer.print(args.json);
    // The same device line as `starling node` (GPUs and NCCL, or why there are none).
    let devices = starling_averager::devices::DeviceReport::probe();
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "event": "devices", "report": devices.to_string() })
        );
    } else {
        println!("{devices}");
    }
    if let Some(path) = &args.save_manifest {
        std::fs::write(path, signed.to_json())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if restarted.is_some() {
        // Its peers may all be gone: the run's manifest is readable again from here.
        manifest::publish(&node, &manifest.name, &signed).await?;
    } else if args.new_run.is_some() {
        manifest::publish(&node, &manifest.name, &signed).await?;
        if !args.json {
            let boot = addrs
                .first()
                .map_or("<this peer's address>".to_string(), |a| a.to_string());
            println!(
                "created run {} ({}, {} epochs); others join with:\n  starling train --run {}@{} --bootstrap {boot}",
                manifest.name,
                manifest.model.name(),
                manifest.epochs,
                manifest.name,
                node.peer_id()
            );
        }
    }
    let reporter: Arc<dyn Reporter> = if args.json {
        Arc::new(JsonLines)
    } else {
        Arc::new(Bar::new("", manifest.epochs))
    };
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn(watch_interrupts(stop.clone()));
    let session = Session {
        node: node.clone(),
        sample_seed: seed_of(&node),
        shard: args.shard,
        manifest,
        signed,
        data: Arc::new(data),
        built,
        checkpoint_dir: args.checkpoint_dir.clone(),
        checkpoint_every: args.checkpoint_every,
        sync_first,
        stop,
        reporter,
        progress_interval: None,
        delayed_update: args.delayed_update,
        max_stale: args.max_stale,
        attack: args.byzantine,
        min_peers: args.min_peers,
    };
    let outcome = session.run().await;
    watcher.abort();
    observer.stop().await;
    node.shutdown().await;
    outcome.map(|_| ())
}

/// First Ctrl-C (or SIGTERM): leave after the current step, saving a checkpoint. Second: quit.
async fn watch_interrupts(stop: Arc<AtomicBool>) {
    loop {
        tokio::select! {
            r = tokio::signal::ctrl_c() => { if r.is_err() { return; } }
            _ = crate::node_cmd::terminate() => {}
        }
        if stop.swap(true, Ordering::Relaxed) {
            eprintln!("interrupted again: quitting now");
            std::process::exit(130);
        }
        eprintln!("leaving the run after this step (Ctrl-C again to quit now)");
    }
}

/// `--max-stale`: a fraction in (0, 1].
fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if f > 0.0 && f <= 1.0 {
        Ok(f)
    } else {
        Err(format!("{s} is not in (0, 1]"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_stale_takes_a_fraction_and_needs_the_delayed_update() {
        assert_eq!(parse_fraction("0.25"), Ok(0.25));
        assert_eq!(parse_fraction("1"), Ok(1.0));
        for bad in ["0", "-0.5", "1.5", "nan", "inf", "half"] {
            assert!(parse_fraction(bad).is_err(), "{bad} accepted");
        }
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: TrainArgs,
        }
        let parse = |extra: &[&str]| {
            let mut argv = vec!["starling", "--run", "r"];
            argv.extend_from_slice(extra);
            <Cli as clap::Parser>::try_parse_from(argv).map(|c| c.args.max_stale)
        };
        assert!(
            parse(&["--max-stale", "0.5"]).is_err(),
            "without --delayed-update"
        );
        assert_eq!(
            parse(&["--delayed-update", "--max-stale", "0.5"]).unwrap(),
            Some(0.5)
        );
        assert_eq!(parse(&["--delayed-update"]).unwrap(), None);
    }
}
