//! `starling demo`: zero configuration. A bootstrap peer and N training peers on 127.0.0.1 train
//! the digits MLP together (each with its own progress bar), then the swarm's test accuracy is
//! printed beside one peer trained alone on the same number of samples.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use indicatif::MultiProgress;
use starling_node::{cluster::LocalCluster, NodeConfig};

use starling_run::data::{self, Dataset};
use starling_run::manifest::{self, DataSpec, SignedManifest};
use starling_run::model::{self, Eval};
use starling_run::setup::{build_model, new_manifest, train_alone, Hyper};
use starling_run::{Reporter, Session};

use crate::train::ui::{Bar, JsonLines};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Training peers (besides the bootstrap peer).
    #[arg(long, default_value_t = 4)]
    peers: usize,
    /// Epochs (global steps of 256 samples).
    #[arg(long, default_value_t = 60)]
    epochs: u64,
    /// Averaging codec (none, f16, u8, u4, ...).
    #[arg(long, default_value = "none")]
    codec: String,
    /// One JSON object per line per peer event, and a final `result` object.
    #[arg(long)]
    json: bool,
    /// Apply each global step one epoch late, overlapping averaging with compute (see
    /// `starling train --delayed-update`).
    #[arg(long)]
    delayed_update: bool,
}

pub async fn run(args: DemoArgs) -> Result<()> {
    anyhow::ensure!(
        (1..=16).contains(&args.peers),
        "--peers must be between 1 and 16"
    );
    let hyper = Hyper {
        epochs: Some(args.epochs),
        codec: Some(args.codec.clone()),
        seed: Some(7),
        ..Hyper::default()
    };
    let mut manifest = new_manifest("demo", "mlp", &hyper, DataSpec::Digits)?;
    let digits = Dataset::Images(data::digits());
    let rt = tokio::runtime::Handle::current();
    if !args.json {
        println!(
            "starting a bootstrap peer and {} training peers on 127.0.0.1 ...",
            args.peers
        );
    }
    let cluster = LocalCluster::start(args.peers + 1, NodeConfig::default()).await?;
    let boot = &cluster.nodes[0];
    let probe = build_model(&manifest, &digits, None, rt.clone())?;
    manifest.schema_hash = model::schema_hex(&probe.params);
    let signed = SignedManifest::sign(&manifest, boot.owner_key())?;
    manifest::publish(boot, &manifest.name, &signed).await?;
    if !args.json {
        let addr = boot.listen_addrs().await?.into_iter().next();
        println!(
            "run {:?}: mlp on the 8x8 digits, {} epochs of {} samples, codec {}; bootstrap {}",
            manifest.name,
            manifest.epochs,
            manifest.target_batch_size,
            manifest.codec,
            addr.map_or_else(String::new, |a| a.to_string())
        );
    }
    let bars = MultiProgress::new();
    let data = Arc::new(digits);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (i, node) in cluster.nodes[1..].iter().enumerate() {
        let reporter: Arc<dyn Reporter> = if args.json {
            Arc::new(JsonLines)
        } else {
            let bar = Bar::new(&format!("peer {}", i + 1), manifest.epochs);
            bars.add(bar.bar().clone());
            Arc::new(bar)
        };
        let session = Session {
            node: node.clone(),
            manifest: manifest.clone(),
            signed: signed.clone(),
            data: data.clone(),
            built: build_model(&manifest, &data, None, rt.clone())?,
            checkpoint_dir: None,
            checkpoint_every: 10,
            sync_first: false,
            sample_seed: 1000 + i as u64,
            shard: None,
            stop: Arc::new(AtomicBool::new(false)),
            reporter,
            // The demo's epochs take 25-40 ms on a 2-core machine: with reports every 100 ms
            // the peers learned of each other's samples a wave of batches late and the global
            // batch averaged 292-353 for 256 (1.14-1.38x); at 25 ms, 257-273 (6 runs each).
            progress_interval: Some(Duration::from_millis(25)),
            delayed_update: args.delayed_update,
            max_stale: None,
            attack: None,
            min_peers: 0,
        };
        tasks.push(tokio::spawn(session.run()));
    }
    let mut accuracies = Vec::new();
    let mut epochs = Vec::new();
    let mut samples = 0u64;
    for t in tasks {
        let out = t.await.context("a training peer panicked")??;
        anyhow::ensure!(out.finished, "a peer stopped at epoch {}", out.epoch);
        epochs.push(out.epoch);
        samples += out.samples;
        if let Eval::Accuracy(a) = out.eval {
            accuracies.push(a);
        }
    }
    let swarm_seconds = started.elapsed().as_secs_f64();
    cluster.shutdown().await;

    // One peer alone, on as many samples: the same global batches, the same optimizer.
    let baseline_started = Instant::now();
    // The swarm's global batches overshoot the target by what arrives while the peers' reports
    // travel: the baseline takes as many steps of the swarm's mean global batch.
    let global_batch = (samples / manifest.epochs.max(1)).max(1);
    let baseline = {
        let manifest = manifest.clone();
        let data = data.clone();
        let eval = tokio::task::spawn_blocking(move || train_alone(&manifest, &data, global_batch))
            .await??;
        match eval {
            Eval::Accuracy(a) => a,
            Eval::ValLoss(_) => anyhow::bail!("the demo's model is a classifier"),
        }
    };
    let baseline_seconds = baseline_started.elapsed().as_secs_f64();
    let mean = accuracies.iter().sum::<f64>() / accuracies.len().max(1) as f64;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "event": "result",
                "peers": args.peers,
                "epochs": manifest.epochs,
                "swarm_test_accuracy": mean,
                "peer_test_accuracies": accuracies,
                "peer_epochs": epochs,
                "swarm_seconds": swarm_seconds,
                "global_batch": global_batch,
                "baseline_test_accuracy": baseline,
                "baseline_seconds": baseline_seconds,
            })
        );
    } else {
        let each: Vec<String> = accuracies
            .iter()
            .map(|a| format!("{:.1}%", 100.0 * a))
            .collect();
        println!();
        println!(
            "swarm of {} peers: test accuracy {:.1}% (each peer: {}) in {swarm_seconds:.1} s",
            args.peers,
            100.0 * mean,
            each.join(", ")
        );
        println!(
            "one peer alone, same samples ({} steps of {}): test accuracy {:.1}% in {baseline_seconds:.1} s",
            manifest.epochs,
            global_batch,
            100.0 * baseline
        );
        println!("Across machines: `starling train --new-run NAME --model mlp` on one, then the `starling train --run ...` line it prints on the others.");
    }
    Ok(())
}
