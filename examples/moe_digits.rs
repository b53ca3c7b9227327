//! A classifier with a decentralized mixture-of-experts layer. Two expert servers (separate
//! peers) host the grid `ffn.0.[0:8]`; a trainer peer builds `input -> relu -> h + MoE(h) ->
//! classes` in candle, routes each sample to its 2 best live experts, and trains on the
//! scikit-learn digits. Half way through, one server goes down: its experts are masked out and
//! training continues on the other four.
//!
//! `cargo run --release -p starling-examples --example moe_digits`

use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use starling_experts::{
    expand_uid_pattern, ClientConfig, Expert, ExpertClient, ExpertServer, ExpertSpec, MoeConfig,
    RemoteMixtureOfExperts, ServerConfig,
};
use starling_node::{cluster::LocalCluster, NodeConfig};

const HIDDEN: usize = 32;
const EPOCHS: usize = 12;
const BATCH: usize = 64;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rt = tokio::runtime::Runtime::new()?;
    // Three peers on 127.0.0.1: two expert servers and the trainer.
    let cluster = rt.block_on(LocalCluster::start(3, NodeConfig::default()))?;
    let spec = ExpertSpec::ffn(HIDDEN, 4 * HIDDEN).with_lr(3e-3);
    let uids = expand_uid_pattern("ffn.0.[0:8]")?;
    let host = |from: usize, to: usize| {
        uids[from..to]
            .iter()
            .map(|u| Ok((u.clone(), Expert::new(&spec, from as u64 + u.len() as u64)?)))
            .collect::<starling_experts::Result<Vec<_>>>()
    };
    let server_a = rt.block_on(ExpertServer::start(
        cluster.nodes[0].clone(),
        host(0, 4)?,
        ServerConfig::default(),
    ))?;
    let server_b = rt.block_on(ExpertServer::start(
        cluster.nodes[1].clone(),
        host(4, 8)?,
        ServerConfig::default(),
    ))?;
    let client = ExpertClient::new(cluster.nodes[2].clone(), ClientConfig::default());
    // Wait until the trainer sees all 8 experts in the DHT.
    rt.block_on(async {
        while client.list("ffn", 64).await.map_or(0, |l| l.len()) < 8 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    // The model: candle layers plus the remote MoE layer; one optimizer trains the local
    // parameters and the gate, the experts train themselves on the servers.
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let inp = candle_nn::linear(64, HIDDEN, vb.pp("inp"))?;
    let out = candle_nn::linear(HIDDEN, 10, vb.pp("out"))?;
    let mut cfg = MoeConfig::new("ffn", &[1, 8], &[HIDDEN]);
    cfg.k_best = 2;
    cfg.k_min = 1;
    cfg.timeout_after_k_min = Duration::from_millis(500);
    let moe = RemoteMixtureOfExperts::new(vb.pp("moe"), client, cfg, rt.handle().clone())?;
    let forward = |x: &Tensor| -> candle_core::Result<Tensor> {
        let h = inp.forward(x)?.relu()?;
        out.forward(&(&h + moe.forward(&h)?)?)
    };
    let mut opt = candle_nn::AdamW::new(
        vars.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 3e-3,
            weight_decay: 0.0,
            ..Default::default()
        },
    )?;

    let (xt, yt, xv, yv) = digits()?;
    let n = xt.dim(0)?;
    let mut server_b = Some(server_b);
    for epoch in 0..EPOCHS {
        if epoch == EPOCHS / 2 {
            if let Some(s) = server_b.take() {
                rt.block_on(async {
                    let _ = s.shutdown().await;
                    cluster.nodes[1].shutdown().await;
                });
                println!("-- server B (ffn.0.4 .. ffn.0.7) is gone; training continues --");
            }
        }
        let (mut sum, mut batches, mut skipped) = (0.0, 0, 0);
        for start in (0..n).step_by(BATCH) {
            let len = BATCH.min(n - start);
            let logits = match forward(&xt.narrow(0, start, len)?) {
                Ok(l) => l,
                Err(e) => {
                    skipped += 1;
                    eprintln!("skipping a batch: {e}");
                    continue;
                }
            };
            let loss = candle_nn::loss::cross_entropy(&logits, &yt.narrow(0, start, len)?)?;
            opt.backward_step(&loss)?;
            sum += loss.to_scalar::<f32>()?;
            batches += 1;
        }
        let pred = forward(&xv)?.argmax(1)?.to_vec1::<u32>()?;
        let truth = yv.to_vec1::<u32>()?;
        let acc =
            pred.iter().zip(&truth).filter(|(a, b)| a == b).count() as f32 / truth.len() as f32;
        let stats = moe.last_stats();
        println!(
            "epoch {epoch:2}: loss {:.4}, test accuracy {:.3}, experts answering {}/{}{}",
            sum / batches.max(1) as f32,
            acc,
            stats.answered,
            stats.called,
            if skipped > 0 {
                format!(", {skipped} batches skipped")
            } else {
                String::new()
            }
        );
    }
    rt.block_on(async {
        server_a.shutdown().await?;
        cluster.shutdown().await;
        Ok::<_, starling_experts::ExpertError>(())
    })?;
    Ok(())
}

/// The scikit-learn digits (1797 8x8 images, bundled in smartcore), scaled to [0, 1], split
/// 80/20 with a fixed shuffle.
fn digits() -> candle_core::Result<(Tensor, Tensor, Tensor, Tensor)> {
    use rand::{seq::SliceRandom, SeedableRng};
    let d = smartcore::dataset::digits::load_dataset();
    let mut order: Vec<usize> = (0..d.num_samples).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    let split = d.num_samples * 4 / 5;
    let take = |idx: &[usize]| -> candle_core::Result<(Tensor, Tensor)> {
        let f = d.num_features;
        let x: Vec<f32> = idx
            .iter()
            .flat_map(|&i| d.data[i * f..(i + 1) * f].iter().map(|v| v / 16.0))
            .collect();
        let y: Vec<u32> = idx.iter().map(|&i| d.target[i] as u32).collect();
        Ok((
            Tensor::from_vec(x, (idx.len(), f), &Device::Cpu)?,
            Tensor::from_vec(y, idx.len(), &Device::Cpu)?,
        ))
    };
    let (xt, yt) = take(&order[..split])?;
    let (xv, yv) = take(&order[split..])?;
    Ok((xt, yt, xv, yv))
}
