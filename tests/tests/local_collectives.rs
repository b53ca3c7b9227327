//! Local collectives (issue #17): the CPU backend against exact references with 4 devices, and
//! hierarchical averaging, where two "machines" of two CPU devices each and two plain peers
//! make a swarm group of four members and every device ends with the global weighted mean.

use std::time::{Duration, Instant};

use starling_averager::devices::{Hierarchical, LocalGroup, ReduceOp};
use starling_averager::{Averager, AveragerConfig, AveragerError, RoundReport};
use starling_node::NodeConfig;
use starling_tests::{
    bounded, exact_weighted_mean, init_tracing, normal_tensors, normal_vec, rel_error,
    AveragingSwarm, EXACT,
};

const DEVICES: usize = 4;

/// `||a - b|| / ||b||` against an f64 reference.
fn rel_error_f64(a: &[f32], b: &[f64]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += (f64::from(x) - y).powi(2);
        norm += y * y;
    }
    (diff / norm.max(1e-300)).sqrt()
}

/// A CPU group of four devices holding normal random buffers (different per device).
fn random_group(len: usize, seed: u64) -> (LocalGroup, Vec<Vec<f32>>) {
    let inputs: Vec<Vec<f32>> = (0..DEVICES)
        .map(|d| normal_vec(len, seed * 10 + d as u64))
        .collect();
    let mut group = LocalGroup::cpu(DEVICES, len).unwrap();
    for (d, x) in inputs.iter().enumerate() {
        group.load(d, x).unwrap();
    }
    (group, inputs)
}

#[test]
fn cpu_all_reduce_is_the_exact_sum_and_mean_on_four_devices() {
    for (i, len) in [1usize, 1000, 10_000_000].into_iter().enumerate() {
        let (mut group, inputs) = random_group(len, i as u64 + 1);
        let mut sum = vec![0.0f64; len];
        for x in &inputs {
            for (s, &v) in sum.iter_mut().zip(x) {
                *s += f64::from(v);
            }
        }
        group.all_reduce(ReduceOp::Sum).unwrap();
        let mut out = vec![0.0f32; len];
        for d in 0..DEVICES {
            group.store(d, &mut out).unwrap();
            let err = rel_error_f64(&out, &sum);
            assert!(err < 1e-6, "size {len}, device {d}: relative error {err}");
        }
        // The mean of the same inputs, on a fresh load.
        for (d, x) in inputs.iter().enumerate() {
            group.load(d, x).unwrap();
        }
        group.all_reduce(ReduceOp::Mean).unwrap();
        let mean: Vec<f64> = sum.iter().map(|s| s / DEVICES as f64).collect();
        for d in 0..DEVICES {
            group.store(d, &mut out).unwrap();
            let err = rel_error_f64(&out, &mean);
            assert!(
                err < 1e-6,
                "mean, size {len}, device {d}: relative error {err}"
            );
        }
    }
}

#[test]
fn cpu_broadcast_and_all_gather_are_exact_on_four_devices() {
    for (i, len) in [1usize, 1000, 10_000_000].into_iter().enumerate() {
        let (mut group, inputs) = random_group(len, 100 + i as u64);
        group.broadcast(2).unwrap();
        for d in 0..DEVICES {
            assert!(
                group.host_buffer(d).unwrap() == &inputs[2][..],
                "size {len}"
            );
        }
        for (d, x) in inputs.iter().enumerate() {
            group.load(d, x).unwrap();
        }
        group.all_gather().unwrap();
        let gathered: Vec<f32> = (0..DEVICES)
            .flat_map(|d| inputs[d][group.part(d)].iter().copied())
            .collect();
        for d in 0..DEVICES {
            assert!(group.host_buffer(d).unwrap() == &gathered[..], "size {len}");
        }
    }
}

const SIZES: [usize; 3] = [1, 1000, 50_000];

/// A plain peer's step.
async fn plain_step(
    averager: &Averager,
    tensors: &mut [Vec<f32>],
    weight: f32,
    deadline: Instant,
) -> Result<RoundReport, AveragerError> {
    let mut views: Vec<&mut [f32]> = tensors.iter_mut().map(Vec::as_mut_slice).collect();
    averager.step(&mut views, weight, deadline).await
}

/// A machine of two CPU devices, device `d` holding `data[d]`, averaging through `averager`.
fn machine<'a>(averager: &'a Averager, data: &[Vec<Vec<f32>>]) -> Hierarchical<&'a Averager> {
    let total: usize = SIZES.iter().sum();
    let mut group = LocalGroup::cpu(data.len(), total).unwrap();
    for (d, tensors) in data.iter().enumerate() {
        group.load(d, &tensors.concat()).unwrap();
    }
    Hierarchical::new(group, averager)
        .with_layout(&SIZES)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_machines_of_two_devices_and_two_peers_average_as_a_group_of_four() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        // Room for six in the group: if devices joined the swarm one by one there would be six
        // members; one member per machine makes four.
        let swarm = AveragingSwarm::start(4, NodeConfig::default(), |_| {
            let mut c = AveragerConfig::new("hierarchical");
            c.target_group_size = 6;
            c.min_group_size = 4;
            c.matchmaking_time = Duration::from_secs(3);
            c
        })
        .await
        .unwrap();
        // Contributors: machine A's devices, machine B's devices, peer C, peer D.
        let data: Vec<Vec<Vec<f32>>> = (0..6).map(|i| normal_tensors(&SIZES, 7 * i + 1)).collect();
        let weights = [1.0f32, 2.0, 0.5, 3.0, 1.5, 2.5];
        let expected = exact_weighted_mean(&data, &weights).concat();

        let avs = swarm.averagers();
        let mut a = machine(&avs[0], &data[0..2]);
        let mut b = machine(&avs[1], &data[2..4]);
        let (mut c, mut d) = (data[4].clone(), data[5].clone());
        let deadline = Instant::now() + Duration::from_secs(60);
        let (ra, rb, rc, rd) = tokio::join!(
            a.step(&weights[0..2], deadline),
            b.step(&weights[2..4], deadline),
            plain_step(&avs[2], &mut c, weights[4], deadline),
            plain_step(&avs[3], &mut d, weights[5], deadline),
        );
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert_eq!((ra.machine_weight, rb.machine_weight), (3.0, 3.5));
        let rounds = [
            ra.swarm.unwrap(),
            rb.swarm.unwrap(),
            rc.unwrap(),
            rd.unwrap(),
        ];
        for (p, round) in rounds.iter().enumerate() {
            assert_eq!(round.group.len(), 4, "member {p}: a group of four, not six");
            assert_eq!(round.averaged_fraction(), 1.0, "member {p}");
        }
        for (name, m) in [("A", &a), ("B", &b)] {
            for dev in 0..2 {
                let got = m.group().host_buffer(dev).unwrap();
                let err = rel_error(got, &expected);
                assert!(
                    err < EXACT,
                    "machine {name} device {dev}: relative error {err}"
                );
            }
        }
        for (name, t) in [("C", &c), ("D", &d)] {
            let err = rel_error(&t.concat(), &expected);
            assert!(err < EXACT, "peer {name}: relative error {err}");
        }
        drop((a, b));
        swarm.shutdown().await;
    })
    .await;
}
