//! Remote experts and the remote MoE layer across peers on 127.0.0.1.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use futures::{AsyncReadExt, AsyncWriteExt};
use starling_experts::wire::{read_msg, write_msg, Request, Response, WireTensor};
use starling_experts::{
    ClientConfig, Expert, ExpertClient, ExpertError, ExpertServer, ExpertSpec, MoeConfig,
    RemoteErrorKind, RemoteMixtureOfExperts, ServerConfig, EXPERTS_PROTOCOL,
};
use starling_node::{cluster::LocalCluster, Node, NodeConfig};
use starling_tests::{bounded, init_tracing, normal_vec, rel_error};

fn node_cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(5))
}

fn tensor(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(normal_vec(n, seed), shape, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn experts(spec: &ExpertSpec, uids: &[String], seed: u64) -> Vec<(String, Expert)> {
    uids.iter()
        .enumerate()
        .map(|(i, u)| (u.clone(), Expert::new(spec, seed + i as u64).unwrap()))
        .collect()
}

/// Waits until `uid` is visible in the DHT from `client`.
async fn wait_for(client: &ExpertClient, uid: &str) -> starling_experts::RemoteExpert {
    for _ in 0..100 {
        if let Ok(Some(e)) = client.find(uid).await {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{uid} never appeared in the DHT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn remote_expert_equals_local_expert() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let cluster = LocalCluster::start(2, node_cfg()).await.unwrap();
        let specs = [
            ("ffn.0.1", ExpertSpec::ffn(32, 128)),
            ("block.0", ExpertSpec::transformer(16, 32, 5, 4)),
        ];
        let hosted = specs
            .iter()
            .map(|(uid, spec)| (uid.to_string(), Expert::new(spec, 11).unwrap()))
            .collect();
        let server = ExpertServer::start(cluster.nodes[0].clone(), hosted, ServerConfig::default())
            .await
            .unwrap();
        let client = ExpertClient::new(cluster.nodes[1].clone(), ClientConfig::default());
        for (uid, spec) in &specs {
            let remote = wait_for(&client, uid).await;
            assert_eq!(remote.peer(), cluster.nodes[0].peer_id());
            let info = remote.info().await.unwrap();
            assert_eq!(&info.spec, spec);
            let mut local = Expert::new(spec, 11).unwrap();
            let mut shape = vec![7];
            shape.extend(spec.schema().input.shape);
            let x = tensor(&shape, 1);
            let g = tensor(&shape, 2);
            let y_remote = values(&remote.forward(&x).await.unwrap());
            let y_local = values(&local.forward(&x).unwrap());
            let e = rel_error(&y_remote, &y_local);
            assert!(e < 1e-5, "{uid}: forward rel. error {e}");
            let gx_remote = values(&remote.backward(&x, &g).await.unwrap());
            let gx_local = values(&local.backward(&x, &g).unwrap());
            let e = rel_error(&gx_remote, &gx_local);
            assert!(e < 1e-5, "{uid}: input gradient rel. error {e}");
            // Both took the same AdamW step.
            let e = rel_error(
                &values(&remote.forward(&x).await.unwrap()),
                &values(&local.forward(&x).unwrap()),
            );
            assert!(e < 1e-5, "{uid}: forward after one step, rel. error {e}");
            assert_eq!(remote.info().await.unwrap().steps, 1);
        }
        // The feed-forward expert's backward used what its forward kept (the block's recomputes).
        let reused = server.stats().reused_rows.load(Ordering::Relaxed);
        assert_eq!(reused, 7, "rows whose forward activations were reused");
        // The same through a lossy codec stays within the codec's bound.
        let f16 = ExpertClient::new(
            cluster.nodes[1].clone(),
            ClientConfig {
                codec: "f16".parse().unwrap(),
                ..ClientConfig::default()
            },
        );
        let remote = wait_for(&f16, "ffn.0.1").await;
        let x = tensor(&[3, 32], 5);
        let local = server.info("ffn.0.1").await.unwrap();
        assert_eq!(local.steps, 1);
        let y = values(&remote.forward(&x).await.unwrap());
        let mut reference = Expert::new(&specs[0].1, 11).unwrap();
        reference
            .backward(&tensor(&[7, 32], 1), &tensor(&[7, 32], 2))
            .unwrap();
        let e = rel_error(&y, &values(&reference.forward(&x).unwrap()));
        assert!(e < 2e-3, "f16 forward rel. error {e}");
        server.shutdown().await.unwrap();
        cluster.shutdown().await;
    })
    .await;
}

/// Opens a raw expert stream (after the hello) for adversarial requests.
async fn raw_stream(node: &Node, server: &Node) -> starling_node::Stream {
    let mut control = node.stream_control();
    let mut s = control
        .open_stream(server.peer_id(), EXPERTS_PROTOCOL)
        .await
        .unwrap();
    write_msg(&mut s, &Request::Hello).await.unwrap();
    assert!(matches!(
        read_msg::<_, Response>(&mut s, 1024).await.unwrap(),
        Response::Ready
    ));
    s
}

fn error_kind(r: Result<Tensor, ExpertError>) -> RemoteErrorKind {
    match r {
        Err(ExpertError::Remote { kind, .. }) => kind,
        other => panic!("expected a remote error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_clear_errors_and_the_server_keeps_serving() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let cluster = LocalCluster::start(2, node_cfg()).await.unwrap();
        let spec = ExpertSpec::ffn(16, 32);
        let cfg = ServerConfig {
            max_request_rows: 64,
            max_frame_bytes: 64 * 1024,
            ..ServerConfig::default()
        };
        let server = ExpertServer::start(
            cluster.nodes[0].clone(),
            experts(&spec, &["ffn.0".to_string()], 1),
            cfg,
        )
        .await
        .unwrap();
        let client = ExpertClient::new(cluster.nodes[1].clone(), ClientConfig::default());
        let good = wait_for(&client, "ffn.0").await;
        let unknown = client.expert("ffn.9", cluster.nodes[0].peer_id(), vec![]);
        assert_eq!(
            error_kind(unknown.forward(&tensor(&[2, 16], 1)).await),
            RemoteErrorKind::UnknownExpert
        );
        // Wrong feature count, wrong rank, mismatched gradient batch.
        assert_eq!(
            error_kind(good.forward(&tensor(&[2, 15], 1)).await),
            RemoteErrorKind::BadSchema
        );
        assert_eq!(
            error_kind(good.forward(&tensor(&[2, 4, 4], 1)).await),
            RemoteErrorKind::BadSchema
        );
        assert_eq!(
            error_kind(
                good.backward(&tensor(&[2, 16], 1), &tensor(&[3, 16], 1))
                    .await
            ),
            RemoteErrorKind::BadSchema
        );
        // Too many rows (within the frame limit), then a frame over the byte limit.
        assert_eq!(
            error_kind(good.forward(&tensor(&[65, 16], 1)).await),
            RemoteErrorKind::TooLarge
        );
        assert_eq!(
            error_kind(good.forward(&tensor(&[600, 16], 1)).await),
            RemoteErrorKind::TooLarge
        );
        // Raw abuse: garbage bytes, a tensor whose frame disagrees with its shape, NaN payloads, a
        // lying length prefix.
        let mut s = raw_stream(&cluster.nodes[1], &cluster.nodes[0]).await;
        s.write_all(&[5, 0, 0, 0, 0xff, 0xfe, 0xfd, 0xfc, 0xfb])
            .await
            .unwrap();
        match read_msg::<_, Response>(&mut s, 1 << 20).await.unwrap() {
            Response::Error { kind, .. } => assert_eq!(kind, RemoteErrorKind::Malformed),
            other => panic!("{other:?}"),
        }
        let mut lying = WireTensor::encode(
            &[2, 16],
            &normal_vec(32, 3),
            starling_compression::Codec::None,
        )
        .unwrap();
        lying.shape = vec![4, 16];
        let nan = WireTensor {
            shape: vec![1, 16],
            dtype: starling_experts::DType::F32,
            frame: starling_compression::encode(
                starling_compression::Codec::None,
                &[f32::NAN; 16],
                &starling_compression::EncodeOptions {
                    nonfinite: starling_compression::NonFinite::Allow,
                    ..Default::default()
                },
            )
            .unwrap(),
        };
        for bad in [lying, nan] {
            write_msg(
                &mut s,
                &Request::Forward {
                    uid: "ffn.0".into(),
                    inputs: vec![bad],
                },
            )
            .await
            .unwrap();
            match read_msg::<_, Response>(&mut s, 1 << 20).await.unwrap() {
                Response::Error { kind, message } => {
                    assert_eq!(kind, RemoteErrorKind::Malformed, "{message}")
                }
                other => panic!("{other:?}"),
            }
        }
        s.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        match read_msg::<_, Response>(&mut s, 1 << 20).await.unwrap() {
            Response::Error { kind, .. } => assert_eq!(kind, RemoteErrorKind::TooLarge),
            other => panic!("{other:?}"),
        }
        // ... after which the server closes that stream (it cannot resynchronise).
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
        // A peer that disconnects half way through a request.
        let mut s = raw_stream(&cluster.nodes[1], &cluster.nodes[0]).await;
        s.write_all(&1000u32.to_le_bytes()).await.unwrap();
        s.write_all(&[1, 2, 3]).await.unwrap();
        drop(s);
        // Many clients at once against a tiny queue: every call gets an answer, results or
        // `Overloaded`, none hangs.
        let calls = (0..64).map(|i| {
            let e = good.clone();
            async move { e.forward(&tensor(&[64, 16], i)).await }
        });
        let results = futures::future::join_all(calls).await;
        for r in &results {
            match r {
                Ok(_)
                | Err(ExpertError::Remote {
                    kind: RemoteErrorKind::Overloaded,
                    ..
                }) => {}
                Err(e) => panic!("unexpected {e}"),
            }
        }
        // And the server still serves well-formed calls correctly.
        let x = tensor(&[3, 16], 9);
        let reference = Expert::new(&spec, 1).unwrap();
        let e = rel_error(
            &values(&good.forward(&x).await.unwrap()),
            &values(&reference.forward(&x).unwrap()),
        );
        assert!(e < 1e-6, "rel. error {e}");
        let stats = server.stats();
        assert!(stats.refused.load(std::sync::atomic::Ordering::Relaxed) >= 9);
        server.shutdown().await.unwrap();
        cluster.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn checkpoints_survive_a_restart() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let dir = tempfile::tempdir().unwrap();
        let cluster = LocalCluster::start(2, node_cfg()).await.unwrap();
        let spec = ExpertSpec::ffn(8, 16);
        let uids = vec!["ffn.0".to_string(), "ffn.1".to_string()];
        let cfg = ServerConfig {
            checkpoint_dir: Some(dir.path().to_path_buf()),
            ..ServerConfig::default()
        };
        let server = ExpertServer::start(
            cluster.nodes[0].clone(),
            experts(&spec, &uids, 1),
            cfg.clone(),
        )
        .await
        .unwrap();
        let client = ExpertClient::new(cluster.nodes[1].clone(), ClientConfig::default());
        let remote = wait_for(&client, "ffn.1").await;
        let x = tensor(&[4, 8], 1);
        remote.backward(&x, &tensor(&[4, 8], 2)).await.unwrap();
        let trained = values(&remote.forward(&x).await.unwrap());
        server.shutdown().await.unwrap();
        assert!(dir.path().join("ffn.1.safetensors").exists());
        // Restart with freshly initialised experts (other seeds): the checkpoint wins.
        let server = ExpertServer::start(cluster.nodes[0].clone(), experts(&spec, &uids, 100), cfg)
            .await
            .unwrap();
        let remote = client.expert("ffn.1", cluster.nodes[0].peer_id(), vec![]);
        let e = rel_error(&values(&remote.forward(&x).await.unwrap()), &trained);
        assert!(e < 1e-7, "restored expert differs: rel. error {e}");
        server.shutdown().await.unwrap();
        // A checkpoint of another shape is refused with a clear error, not silently ignored.
        let other = ExpertSpec::ffn(8, 32);
        let err = ExpertServer::start(
            cluster.nodes[0].clone(),
            experts(&other, &uids, 1),
            ServerConfig {
                checkpoint_dir: Some(dir.path().to_path_buf()),
                ..ServerConfig::default()
            },
        )
        .await
        .err()
        .expect("a mismatched checkpoint must be refused");
        assert!(err.to_string().contains("shape"), "{err}");
        cluster.shutdown().await;
    })
    .await;
}

/// The MoE layer's output equals a plain local computation of the same mixture, and its
/// gradients (input and gate) match finite differences.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn moe_layer_matches_a_local_reference() {
    init_tracing();
    bounded(Duration::from_secs(180), async {
        let cluster = LocalCluster::start(2, node_cfg()).await.unwrap();
        let spec = ExpertSpec::ffn(8, 16).with_lr(0.0); // frozen experts: FD needs a fixed function
        let uids: Vec<String> = (0..4).map(|i| format!("ffn.{i}")).collect();
        let server = ExpertServer::start(
            cluster.nodes[0].clone(),
            experts(&spec, &uids, 1),
            ServerConfig::default(),
        )
        .await
        .unwrap();
        let client = ExpertClient::new(cluster.nodes[1].clone(), ClientConfig::default());
        for u in &uids {
            wait_for(&client, u).await;
        }
        let rt = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let vars = VarMap::new();
            let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
            let moe = RemoteMixtureOfExperts::new(
                vb.pp("moe"),
                client,
                MoeConfig::new("ffn", &[4], &[8]),
                rt,
            )
            .unwrap();
            // A fixed gate, so the routing (and with it the finite differences below) is the
            // same on every run: no sample sits on a tie between its 2nd and 3rd expert.
            let gate = (tensor(&[4, 8], 31) * 0.5).unwrap();
            gate_var(&vars, "weight").set(&gate).unwrap();
            gate_var(&vars, "bias")
                .set(&Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap())
                .unwrap();
            let x = candle_core::Var::from_tensor(&tensor(&[6, 8], 3)).unwrap();
            let y = moe.forward(&x).unwrap();
            assert_eq!(moe.last_stats().answered, moe.last_stats().called);
            // Reference: top-2 gate scores, softmax over them, weighted sum of local experts.
            let local: Vec<Expert> = (0..4)
                .map(|i| Expert::new(&spec, 1 + i as u64).unwrap())
                .collect();
            let expected = local_mixture(&vars, &x, &local, |l| {
                let mut order: Vec<usize> = (0..4).collect();
                order.sort_by(|a, b| l[*b].total_cmp(&l[*a]));
                order[..2].to_vec()
            });
            let w = gate_var(&vars, "weight").as_tensor().clone();
            let e = rel_error(&values(&y), &expected);
            assert!(e < 1e-5, "MoE output vs local reference: rel. error {e}");
            // Gradients against central finite differences of L = sum(y * r).
            let r = tensor(&[6, 8], 4);
            let loss = |x: &Tensor| -> f64 {
                (moe.forward(x).unwrap() * &r)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64
            };
            let grads = (moe.forward(&x).unwrap() * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gx = values(grads.get(&x).unwrap());
            let gw = values(grads.get(&w).expect("the gate gets a gradient"));
            let h = 1e-2f32;
            for i in [0usize, 13, 29, 47] {
                let mut p = values(&x);
                p[i] += h;
                let mut m = values(&x);
                m[i] -= h;
                let fd = (loss(&Tensor::from_vec(p, (6, 8), &Device::Cpu).unwrap())
                    - loss(&Tensor::from_vec(m, (6, 8), &Device::Cpu).unwrap()))
                    / (2.0 * h as f64);
                assert!(
                    (fd - gx[i] as f64).abs() < 2e-2 * (1.0 + fd.abs()),
                    "d/dx[{i}]: fd {fd}, autograd {}",
                    gx[i]
                );
            }
            let w0 = w.copy().unwrap(); // a deep copy: `clone` would share the storage `set` writes
            let var_w = gate_var(&vars, "weight");
            for i in [0usize, 9, 30] {
                let mut p = values(&w0);
                p[i] += h;
                var_w
                    .set(&Tensor::from_vec(p, w0.dims(), &Device::Cpu).unwrap())
                    .unwrap();
                let lp = loss(x.as_tensor());
                let mut m = values(&w0);
                m[i] -= h;
                var_w
                    .set(&Tensor::from_vec(m, w0.dims(), &Device::Cpu).unwrap())
                    .unwrap();
                let lm = loss(x.as_tensor());
                var_w.set(&w0.copy().unwrap()).unwrap();
                let fd = (lp - lm) / (2.0 * h as f64);
                assert!(
                    (fd - gw[i] as f64).abs() < 2e-2 * (1.0 + fd.abs()),
                    "d/dgate[{i}]: fd {fd}, autograd {}",
                    gw[i]
                );
            }
        })
        .await
        .unwrap();
        server.shutdown().await.unwrap();
        cluster.shutdown().await;
    })
    .await;
}

/// The first gate's parameter `name` (`weight` or `bias`) of a layer built under `moe`.
fn gate_var(vars: &VarMap, name: &str) -> candle_core::Var {
    vars.data().lock().unwrap()[&format!("moe.gate0.{name}")].clone()
}

/// A plain local computation of a one-dimensional MoE layer: per sample, the gate's logits, the
/// experts `chosen` from them, a softmax over the chosen logits, and the weighted sum of the
/// local experts' outputs.
fn local_mixture(
    vars: &VarMap,
    x: &Tensor,
    local: &[Expert],
    chosen: impl Fn(&[f32]) -> Vec<usize>,
) -> Vec<f32> {
    let w = gate_var(vars, "weight").as_tensor().clone();
    let b = gate_var(vars, "bias").as_tensor().clone();
    let logits = x
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let xs = x.to_vec2::<f32>().unwrap();
    let mut out = Vec::new();
    for (row, l) in logits.iter().enumerate() {
        let picks = chosen(l);
        let m = picks.iter().map(|&j| l[j]).fold(f32::MIN, f32::max);
        let e: Vec<f32> = picks.iter().map(|&j| (l[j] - m).exp()).collect();
        let z: f32 = e.iter().sum();
        let xr = Tensor::from_vec(xs[row].clone(), (1, xs[row].len()), &Device::Cpu).unwrap();
        let mut acc = vec![0f32; xs[row].len()];
        for (&j, ej) in picks.iter().zip(&e) {
            for (a, v) in acc.iter_mut().zip(values(&local[j].forward(&xr).unwrap())) {
                *a += v * ej / z;
            }
        }
        out.extend(acc);
    }
    out
}

/// The scikit-learn digits: 1797 8x8 images, features scaled to [0, 1]; a fixed 80/20 split.
fn digits() -> (Tensor, Tensor, Tensor, Tensor) {
    use rand::{seq::SliceRandom, SeedableRng};
    let d = smartcore::dataset::digits::load_dataset();
    let mut order: Vec<usize> = (0..d.num_samples).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    let split = d.num_samples * 4 / 5;
    let take = |idx: &[usize]| {
        let x: Vec<f32> = idx
            .iter()
            .flat_map(|&i| {
                d.data[i * d.num_features..(i + 1) * d.num_features]
                    .iter()
                    .map(|v| v / 16.0)
            })
            .collect();
        let y: Vec<u32> = idx.iter().map(|&i| d.target[i] as u32).collect();
        (
            Tensor::from_vec(x, (idx.len(), d.num_features), &Device::Cpu).unwrap(),
            Tensor::from_vec(y, idx.len(), &Device::Cpu).unwrap(),
        )
    };
    let (xt, yt) = take(&order[..split]);
    let (xv, yv) = take(&order[split..]);
    (xt, yt, xv, yv)
}

struct Model {
    inp: candle_nn::Linear,
    out: candle_nn::Linear,
    moe: Option<RemoteMixtureOfExperts>,
}

impl Model {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.inp.forward(x)?.relu()?;
        let h = match &self.moe {
            Some(moe) => (&h + moe.forward(&h)?)?,
            None => h,
        };
        self.out.forward(&h)
    }
}

fn accuracy(model: &Model, x: &Tensor, y: &Tensor) -> f32 {
    let pred = model
        .forward(x)
        .unwrap()
        .argmax(1)
        .unwrap()
        .to_vec1::<u32>()
        .unwrap();
    let y = y.to_vec1::<u32>().unwrap();
    pred.iter().zip(&y).filter(|(a, b)| a == b).count() as f32 / y.len() as f32
}

/// Trains for `epochs`, calling `at_epoch(e)` before each; returns the mean loss per epoch and
/// how many batches failed (and were skipped).
fn train(
    model: &Model,
    vars: &VarMap,
    data: &(Tensor, Tensor, Tensor, Tensor),
    epochs: usize,
    mut at_epoch: impl FnMut(usize),
) -> (Vec<f32>, usize) {
    use candle_nn::Optimizer;
    let mut opt = candle_nn::AdamW::new(
        vars.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 3e-3,
            weight_decay: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    let (xt, yt, _, _) = data;
    let n = xt.dim(0).unwrap();
    let batch = 64;
    let mut losses = Vec::new();
    let mut failed = 0;
    for epoch in 0..epochs {
        at_epoch(epoch);
        let (mut sum, mut count) = (0f32, 0);
        for start in (0..n).step_by(batch) {
            let len = batch.min(n - start);
            let x = xt.narrow(0, start, len).unwrap();
            let y = yt.narrow(0, start, len).unwrap();
            let logits = match model.forward(&x) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("epoch {epoch}: batch at {start} failed: {e}");
                    failed += 1;
                    continue;
                }
            };
            let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
            opt.backward_step(&loss).unwrap();
            sum += loss.to_scalar::<f32>().unwrap();
            count += 1;
        }
        losses.push(sum / count.max(1) as f32);
    }
    (losses, failed)
}

fn model(
    vars: &VarMap,
    hidden: usize,
    moe: Option<(ExpertClient, tokio::runtime::Handle)>,
) -> Model {
    let vb = VarBuilder::from_varmap(vars, DType::F32, &Device::Cpu);
    let moe = moe.map(|(client, rt)| {
        let mut cfg = MoeConfig::new("ffn", &[1, 8], &[hidden]);
        cfg.k_best = 2;
        cfg.k_min = 1;
        cfg.timeout_after_k_min = Duration::from_millis(500);
        cfg.forward_timeout = Duration::from_secs(5);
        cfg.backward_timeout = Duration::from_secs(5);
        RemoteMixtureOfExperts::new(vb.pp("moe"), client, cfg, rt).unwrap()
    });
    let m = Model {
        inp: candle_nn::linear(64, hidden, vb.pp("inp")).unwrap(),
        out: candle_nn::linear(hidden, 10, vb.pp("out")).unwrap(),
        moe,
    };
    seed_vars(vars, 42);
    m
}

/// Deterministic initialisation, so the baseline and the MoE model start their shared layers
/// from the same parameters: each variable (by name) drawn uniform in ±1/sqrt(fan_in), biases 0.
fn seed_vars(vars: &VarMap, seed: u64) {
    use rand::{Rng, SeedableRng};
    let data = vars.data().lock().unwrap();
    for (name, var) in data.iter() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(
            seed ^ name
                .bytes()
                .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)),
        );
        let dims = var.dims().to_vec();
        let v: Vec<f32> = if dims.len() == 2 {
            let bound = 1.0 / (dims[1] as f32).sqrt();
            (0..dims[0] * dims[1])
                .map(|_| rng.gen_range(-bound..bound))
                .collect()
        } else {
            vec![0.0; var.elem_count()]
        };
        var.set(&Tensor::from_vec(v, dims, &Device::Cpu).unwrap())
            .unwrap();
    }
}

/// Two servers host 8 experts; a model with a remote MoE layer (k_best 2) trains on digits and
/// matches the same model without the layer; one server is killed half way and training goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn moe_model_trains_on_digits_and_survives_a_server_loss() {
    init_tracing();
    bounded(Duration::from_secs(600), async {
        let hidden = 32;
        let epochs = 16;
        let kill_at = 8;
        let data = Arc::new(digits());
        // Baseline: the same model without the MoE layer, same initialisation of shared layers.
        let baseline = {
            let data = data.clone();
            tokio::task::spawn_blocking(move || {
                let vars = VarMap::new();
                let m = model(&vars, hidden, None);
                let (losses, _) = train(&m, &vars, &data, epochs, |_| {});
                (accuracy(&m, &data.2, &data.3), losses)
            })
            .await
            .unwrap()
        };
        let cluster = LocalCluster::start(3, node_cfg()).await.unwrap();
        let spec = ExpertSpec::ffn(hidden, 4 * hidden).with_lr(3e-3);
        let uids = starling_experts::expand_uid_pattern("ffn.0.[0:8]").unwrap();
        let server_a = ExpertServer::start(
            cluster.nodes[0].clone(),
            experts(&spec, &uids[..4], 1),
            ServerConfig::default(),
        )
        .await
        .unwrap();
        let server_b = ExpertServer::start(
            cluster.nodes[1].clone(),
            experts(&spec, &uids[4..], 5),
            ServerConfig::default(),
        )
        .await
        .unwrap();
        let client = ExpertClient::new(cluster.nodes[2].clone(), ClientConfig::default());
        for u in &uids {
            wait_for(&client, u).await;
        }
        let rt = tokio::runtime::Handle::current();
        let node_b = cluster.nodes[1].clone();
        let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
        let (killed_tx, killed_rx) = std::sync::mpsc::channel::<()>();
        let killer = tokio::spawn(async move {
            if tokio::task::spawn_blocking(move || kill_rx.recv())
                .await
                .unwrap()
                .is_ok()
            {
                server_b.shutdown().await.unwrap();
                node_b.shutdown().await;
                let _ = killed_tx.send(());
            }
        });
        let (acc, losses, failed) = {
            let data = data.clone();
            tokio::task::spawn_blocking(move || {
                let vars = VarMap::new();
                let m = model(&vars, hidden, Some((client, rt)));
                let (losses, failed) = train(&m, &vars, &data, epochs, |e| {
                    if e == kill_at {
                        kill_tx.send(()).unwrap();
                        killed_rx.recv().unwrap();
                    }
                });
                (accuracy(&m, &data.2, &data.3), losses, failed)
            })
            .await
            .unwrap()
        };
        killer.await.unwrap();
        eprintln!(
            "baseline: accuracy {:.4}, losses {:?}",
            baseline.0, baseline.1
        );
        eprintln!("with remote MoE: accuracy {acc:.4}, losses {losses:?}, failed batches {failed}");
        assert!(
            acc >= baseline.0,
            "MoE model accuracy {acc} is below the baseline's {}",
            baseline.0
        );
        // Training went on after the kill and the loss kept falling.
        assert!(failed <= 1, "{failed} batches failed");
        assert!(
            losses[epochs - 1] < losses[kill_at],
            "loss did not keep falling after the kill: {losses:?}"
        );
        assert!(losses[epochs - 1] < losses[kill_at - 1], "{losses:?}");
        server_a.shutdown().await.unwrap();
        cluster.shutdown().await;
    })
    .await;
}

/// A peer that declares experts and accepts calls but never answers.
async fn stalling_server(node: Node, uids: &[&str]) -> tokio::task::JoinHandle<()> {
    let host = starling_experts::ExpertHost {
        peer: node.peer_id().to_bytes(),
        addrs: node
            .listen_addrs()
            .await
            .unwrap()
            .iter()
            .map(|a| a.to_string())
            .collect(),
    };
    for uid in uids {
        let uid = starling_experts::ExpertUid::parse(uid).unwrap();
        for level in 0..uid.coords.len() {
            let (key, sub) = uid.declaration_at(level, &node.owner_marker());
            node.store(&key, &sub, &host, starling_dht::now_ms() + 600_000)
                .await
                .unwrap();
        }
    }
    let mut incoming = node.stream_control().accept(EXPERTS_PROTOCOL).unwrap();
    tokio::spawn(async move {
        use futures::StreamExt;
        let mut held = Vec::new();
        while let Some((_, mut s)) = incoming.next().await {
            if let Ok(Request::Hello) = read_msg::<_, Request>(&mut s, 1024).await {
                let _ = write_msg(&mut s, &Response::Ready).await;
                held.push(s); // read nothing more, answer nothing
            }
        }
    })
}

/// Stalled experts are masked out after `timeout_after_k_min`, the output is the mixture of
/// the experts that answered, and fewer than `k_min` answers is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalled_experts_are_masked_and_k_min_is_enforced() {
    init_tracing();
    bounded(Duration::from_secs(40), async {
        let cluster = LocalCluster::start(3, node_cfg()).await.unwrap();
        let spec = ExpertSpec::ffn(8, 16).with_lr(0.0);
        let live: Vec<String> = (0..4).map(|i| format!("ffn.{i}")).collect();
        let server = ExpertServer::start(
            cluster.nodes[0].clone(),
            experts(&spec, &live, 1),
            ServerConfig::default(),
        )
        .await
        .unwrap();
        let staller = stalling_server(
            cluster.nodes[1].clone(),
            &["ffn.4", "ffn.5", "ffn.6", "ffn.7"],
        )
        .await;
        let client = ExpertClient::new(cluster.nodes[2].clone(), ClientConfig::default());
        for u in ["ffn.0", "ffn.3", "ffn.4", "ffn.7"] {
            wait_for(&client, u).await;
        }
        let rt = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let moe_with = |k_min: usize, forward_timeout: Duration| {
                let vars = VarMap::new();
                let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
                let mut cfg = MoeConfig::new("ffn", &[8], &[8]);
                cfg.k_best = 8;
                cfg.k_min = k_min;
                cfg.forward_timeout = forward_timeout;
                cfg.timeout_after_k_min = Duration::from_millis(300);
                let moe =
                    RemoteMixtureOfExperts::new(vb.pp("moe"), client.clone(), cfg, rt.clone())
                        .unwrap();
                (vars, moe)
            };
            // A forward timeout far beyond the test's bound: only `timeout_after_k_min` can end the wait.
            let (vars, moe) = moe_with(4, Duration::from_secs(120));
            let x = tensor(&[5, 8], 21);
            let y = moe.forward(&x).unwrap();
            let stats = moe.last_stats();
            assert_eq!((stats.called, stats.answered), (8, 4), "{stats:?}");
            let mut failed = stats.failed.clone();
            failed.sort();
            assert_eq!(failed, vec!["ffn.4", "ffn.5", "ffn.6", "ffn.7"]);
            // Reference: softmax over the live experts' gate scores only.
            let local: Vec<Expert> = (0..4)
                .map(|i| Expert::new(&spec, 1 + i as u64).unwrap())
                .collect();
            let expected = local_mixture(&vars, &x, &local, |_| (0..4).collect());
            let err = rel_error(&values(&y), &expected);
            assert!(
                err < 1e-5,
                "output vs the live experts' mixture: rel. error {err}"
            );
            // Backward reaches only the live experts and still gives a gradient.
            let xv = candle_core::Var::from_tensor(&x).unwrap();
            let grads = moe
                .forward(&xv)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            assert!(grads.get(&xv).is_some());
            // The stallers are now skipped without waiting.
            assert_eq!(moe.last_stats().called, 4);
            assert_eq!(moe.last_stats().backward_failed, 0);
            // k_min above what can answer: a clear error once the forward timeout passes, not a
            // hang or a NaN.
            let (_, strict) = moe_with(5, Duration::from_secs(2));
            match strict.try_forward(&x) {
                Err(ExpertError::NotEnoughExperts {
                    answered, k_min, ..
                }) => {
                    assert_eq!((answered, k_min), (4, 5))
                }
                other => panic!(
                    "expected NotEnoughExperts, got {:?}",
                    other.map(|t| t.dims().to_vec())
                ),
            }
        })
        .await
        .unwrap();
        staller.abort();
        server.shutdown().await.unwrap();
        cluster.shutdown().await;
    })
    .await;
}

/// Two servers host replicas of one uid; a peer that writes unsigned or lying declarations is
/// ignored; when one replica's server dies the layer keeps working through the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_take_over_and_forged_declarations_are_ignored() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let cluster = LocalCluster::start(4, node_cfg()).await.unwrap();
        let spec = ExpertSpec::ffn(8, 16).with_lr(0.0);
        let uid = vec!["ffn.0".to_string()];
        let server_a = ExpertServer::start(
            cluster.nodes[0].clone(),
            experts(&spec, &uid, 1),
            ServerConfig::default(),
        )
        .await
        .unwrap();
        let server_b = ExpertServer::start(
            cluster.nodes[1].clone(),
            experts(&spec, &uid, 1),
            ServerConfig::default(),
        )
        .await
        .unwrap();
        // The forger: an unsigned declaration of ffn.1, and a signed one that points at A.
        let forger = &cluster.nodes[2];
        let lie = starling_experts::ExpertHost {
            peer: cluster.nodes[0].peer_id().to_bytes(),
            addrs: vec![],
        };
        let exp = starling_dht::now_ms() + 600_000;
        forger.store("experts/ffn.", "1", &lie, exp).await.unwrap();
        forger
            .store(
                "experts/ffn.",
                &format!("2{}", forger.owner_marker()),
                &lie,
                exp,
            )
            .await
            .unwrap();
        // It cannot write under A's marker at all.
        assert!(forger
            .store(
                "experts/ffn.",
                &format!("0{}", cluster.nodes[0].owner_marker()),
                &lie,
                exp
            )
            .await
            .is_err());
        let client = ExpertClient::new(cluster.nodes[3].clone(), ClientConfig::default());
        let mut peers = Vec::new();
        for _ in 0..100 {
            peers = client
                .find_replicas("ffn.0")
                .await
                .unwrap()
                .iter()
                .map(|e| e.peer())
                .collect();
            if peers.len() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        peers.sort();
        let mut expected = vec![cluster.nodes[0].peer_id(), cluster.nodes[1].peer_id()];
        expected.sort();
        assert_eq!(peers, expected);
        let coords: Vec<u32> = client
            .children("ffn", &[])
            .await
            .unwrap()
            .into_keys()
            .collect();
        assert_eq!(coords, vec![0], "forged coordinates must not appear");
        let rt = tokio::runtime::Handle::current();
        let node_a = cluster.nodes[0].clone();
        tokio::task::spawn_blocking(move || {
            let vars = VarMap::new();
            let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
            let mut cfg = MoeConfig::new("ffn", &[4], &[8]);
            cfg.k_best = 1;
            let moe = RemoteMixtureOfExperts::new(vb.pp("moe"), client, cfg, rt.clone()).unwrap();
            let x = tensor(&[4, 8], 8);
            // With k_best 1 and one live uid, the mixture is that expert's output.
            let reference = values(&Expert::new(&spec, 1).unwrap().forward(&x).unwrap());
            let e = rel_error(&values(&moe.forward(&x).unwrap()), &reference);
            assert!(e < 1e-6, "rel. error {e}");
            rt.block_on(async {
                server_a.shutdown().await.unwrap();
                node_a.shutdown().await;
            });
            for _ in 0..3 {
                let e = rel_error(&values(&moe.forward(&x).unwrap()), &reference);
                assert!(e < 1e-6, "after losing replica A: rel. error {e}");
            }
        })
        .await
        .unwrap();
        server_b.shutdown().await.unwrap();
        cluster.shutdown().await;
    })
    .await;
}
