//! `starling experts serve` and `starling experts ls`.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Subcommand, ValueEnum};
use starling_experts::{
    expand_uid_pattern, ClientConfig, Expert, ExpertClient, ExpertServer, ExpertSpec, ServerConfig,
};
use starling_node::{Multiaddr, Node};

use crate::observe::{ObserveArgs, Observer};
use crate::JoinArgs;
use starling_bench::experts::ReuseArgs;

/// Expert architectures the CLI can host.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertArch {
    /// Linear(hidden, ffn-mult x hidden) - GELU - Linear(.., hidden).
    Ffn,
    /// A pre-norm transformer block over sequences of --seq-len tokens.
    Transformer,
}

#[derive(Subcommand, Debug)]
pub enum ExpertsCommand {
    /// Host experts and serve them to the swarm until interrupted (Ctrl-C).
    Serve {
        /// Expert uids, with ranges: `ffn.0.[0:8]` is ffn.0.0 .. ffn.0.7.
        #[arg(long)]
        uids: String,
        /// Architecture of every hosted expert.
        #[arg(long, value_enum, default_value_t = ExpertArch::Ffn)]
        expert: ExpertArch,
        /// Model width (features in and out of each expert).
        #[arg(long, default_value_t = 256)]
        hidden: usize,
        /// Inner width of the feed-forward part, as a multiple of --hidden.
        #[arg(long, default_value_t = 4)]
        ffn_mult: usize,
        /// Tokens per sample (transformer experts).
        #[arg(long, default_value_t = 16)]
        seq_len: usize,
        /// Attention heads (transformer experts).
        #[arg(long, default_value_t = 4)]
        heads: usize,
        /// AdamW learning rate of the experts.
        #[arg(long, default_value_t = 1e-3)]
        lr: f64,
        /// Save expert parameters here (periodically and on exit) and restore them at start.
        #[arg(long, value_name = "DIR")]
        checkpoint_dir: Option<PathBuf>,
        /// Seconds between checkpoints.
        #[arg(long, default_value_t = 300)]
        checkpoint_every: u64,
        /// Largest batch (samples) run at once.
        #[arg(long, default_value_t = 2048)]
        max_batch: usize,
        #[command(flatten)]
        reuse: ReuseArgs,
        /// Address to listen on. Repeatable. Default: TCP (and QUIC in public swarms) on all
        /// interfaces with OS-chosen ports.
        #[arg(long, value_name = "MULTIADDR")]
        listen: Vec<Multiaddr>,
        /// Seconds between status lines.
        #[arg(long, default_value_t = 10)]
        status_interval: u64,
        /// Print status lines as JSON objects.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        join: JoinArgs,
        #[command(flatten)]
        observe: ObserveArgs,
    },
    /// List the live experts of a grid and the peers serving them.
    Ls {
        /// Grid name (the part of the uid before the first dot).
        #[arg(long, default_value = "ffn")]
        grid: String,
        /// Also ask each expert's server for its architecture and steps.
        #[arg(long)]
        info: bool,
        /// Most experts to list.
        #[arg(long, default_value_t = 1024)]
        limit: usize,
        /// Print one JSON object per expert.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        join: JoinArgs,
    },
}

pub async fn run(cmd: ExpertsCommand) -> Result<()> {
    match cmd {
        ExpertsCommand::Serve {
            uids,
            expert,
            hidden,
            ffn_mult,
            seq_len,
            heads,
            lr,
            checkpoint_dir,
            checkpoint_every,
            max_batch,
            reuse,
            listen,
            status_interval,
            json,
            join,
            observe,
        } => {
            let uids = expand_uid_pattern(&uids)?;
            let spec = match expert {
                ExpertArch::Ffn => ExpertSpec::ffn(hidden, hidden * ffn_mult),
                ExpertArch::Transformer => {
                    ExpertSpec::transformer(hidden, hidden * ffn_mult, seq_len, heads)
                }
            }
            .with_lr(lr);
            let experts = uids
                .iter()
                .map(|u| Ok((u.clone(), Expert::new(&spec, seed_of(u))?)))
                .collect::<Result<Vec<_>>>()?;
            let params: usize = experts.iter().map(|(_, e)| e.num_parameters()).sum();
            let mut cfg = join.config()?;
            cfg.listen = listen;
            let node = Node::start(cfg).await?;
            println!("peer id: {}", node.peer_id());
            for a in node.listen_addrs().await? {
                println!("listening on {a}");
            }
            let server_cfg = ServerConfig {
                max_batch_rows: max_batch,
                checkpoint_dir: checkpoint_dir.clone(),
                checkpoint_every: Duration::from_secs(checkpoint_every.max(1)),
                activation_reuse: reuse.reuse(),
                ..ServerConfig::default()
            };
            let server = ExpertServer::start(node.clone(), experts, server_cfg).await?;
            let observer = Observer::start(&node, &observe).await?;
            observer.print(json);
            println!(
                "serving {} {:?} experts ({} .. {}), {:.1} M parameters{}",
                server.uids().len(),
                expert,
                server.uids()[0],
                server.uids()[server.uids().len() - 1],
                params as f64 / 1e6,
                checkpoint_dir
                    .map(|d| format!(", checkpoints in {}", d.display()))
                    .unwrap_or_default()
            );
            let mut tick = tokio::time::interval(Duration::from_secs(status_interval.max(1)));
            tick.tick().await;
            let started = Instant::now();
            let mut last_rows = 0;
            loop {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => break,
                    _ = crate::node_cmd::terminate() => break,
                    _ = tick.tick() => {
                        let s = server.stats();
                        let peers = node.status().await.map(|s| s.connected_peers).unwrap_or(0);
                        let rows = s.rows.load(Ordering::Relaxed);
                        let rate = (rows - last_rows) as f64 / status_interval.max(1) as f64;
                        last_rows = rows;
                        let status = serde_json::json!({
                            "uptime_s": started.elapsed().as_secs(),
                            "peers": peers,
                            "served": s.served.load(Ordering::Relaxed),
                            "refused": s.refused.load(Ordering::Relaxed),
                            "batches": s.batches.load(Ordering::Relaxed),
                            "samples": rows,
                            "samples_per_s": rate,
                        });
                        if json {
                            println!("{status}");
                        } else {
                            println!(
                                "peers {} | requests served {} refused {} | batches {} | samples {} ({:.0}/s)",
                                peers, status["served"], status["refused"], status["batches"], rows, rate
                            );
                        }
                    }
                }
            }
            println!("shutting down (saving checkpoints if configured)");
            observer.stop().await;
            let saved = server.shutdown().await;
            node.shutdown().await;
            saved.context("final checkpoint")?;
            Ok(())
        }
        ExpertsCommand::Ls {
            grid,
            info,
            limit,
            json,
            join,
        } => {
            if join.bootstrap.is_empty() {
                bail!("--bootstrap is required: give the address of a running node");
            }
            let node = Node::start(join.config()?.client(true)).await?;
            let client = ExpertClient::new(node.clone(), ClientConfig::default());
            let result = list(&client, &grid, info, limit, json).await;
            node.shutdown().await;
            result
        }
    }
}

async fn list(
    client: &ExpertClient,
    grid: &str,
    info: bool,
    limit: usize,
    json: bool,
) -> Result<()> {
    let experts = client.list(grid, limit).await?;
    if experts.is_empty() && !json {
        println!("no live experts under {grid:?}");
    }
    for e in &experts {
        let details = if info {
            match e.info().await {
                Ok(i) => Some(i),
                Err(err) => {
                    eprintln!("{}: {err}", e.uid());
                    None
                }
            }
        } else {
            None
        };
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "uid": e.uid(),
                    "peer": e.peer().to_string(),
                    "kind": details.as_ref().map(|i| format!("{:?}", i.spec.kind)),
                    "dim": details.as_ref().map(|i| i.spec.dim),
                    "hidden": details.as_ref().map(|i| i.spec.hidden),
                    "steps": details.as_ref().map(|i| i.steps),
                })
            );
        } else {
            match details {
                Some(i) => println!(
                    "{}\t{}\t{:?} dim {} hidden {} steps {}",
                    e.uid(),
                    e.peer(),
                    i.spec.kind,
                    i.spec.dim,
                    i.spec.hidden,
                    i.steps
                ),
                None => println!("{}\t{}", e.uid(), e.peer()),
            }
        }
    }
    if !json {
        println!("{} live expert(s)", experts.len());
    }
    Ok(())
}

/// A stable seed per uid, so a restarted server without checkpoints starts from the same
/// parameters.
fn seed_of(uid: &str) -> u64 {
    uid.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}
