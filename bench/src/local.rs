//! `starling bench local`: local collectives across N devices of this process, with NCCL's
//! bandwidth definitions (nccl-tests' `doc/PERFORMANCE.md`), and for the CPU backend the
//! machine's single-thread memcpy bandwidth measured in the same run, to compare against.
//!
//! - algorithm bandwidth `algbw = S / t`, with `S` the bytes of one device's buffer (for
//!   all-gather, the whole gathered buffer);
//! - bus bandwidth `busbw = algbw * factor`: `2(n-1)/n` for all-reduce, `(n-1)/n` for
//!   all-gather, 1 for broadcast and reduce. It is what each device moves in or out per second,
//!   comparable across device counts and with the hardware's own bandwidth.
//!
//! On the CPU, the devices' buffers share one memory bus. An all-reduce over `n` separate
//! buffers must read each of them and write each of them once (`n·S` bytes each way, what the
//! CPU backend does), while a memcpy of `S` reads and writes `S`. So an all-reduce moving memory
//! at memcpy's rate reaches `busbw = 2(n-1)/n²` of memcpy's bandwidth (0.375 for 4 devices),
//! and only more where several threads move more memory than one (measured on the 2-core
//! development machine: 2 threads copy 1.0-1.2 times what one does). The bench prints that
//! ratio, and `all_reduce_memory_gb_s` (`n·S / t`, the all-reduce's rate in memcpy's terms).

use std::time::Instant;

use anyhow::{ensure, Context, Result};
use clap::Args;
use serde::Serialize;
use starling_averager::devices::{Backend, DeviceReport, LocalError, LocalGroup, ReduceOp};

/// The flags of `starling bench local`.
#[derive(Args, Debug)]
pub struct LocalArgs {
    /// Devices in the group (CPU: threads; NCCL: the first N GPUs).
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Elements (f32) in each device's buffer.
    #[arg(long, default_value_t = 10_000_000)]
    size: usize,
    /// cpu or nccl.
    #[arg(long, default_value = "cpu")]
    backend: Backend,
    /// Timed runs of each collective (the mean is reported, as nccl-tests does).
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// Untimed runs before timing.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
}

/// The collectives the bench times.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AllReduce,
    Broadcast,
    AllGather,
    Reduce,
}

/// nccl-tests' bus bandwidth factor for `op` over `n` devices.
fn bus_factor(op: Op, n: usize) -> f64 {
    let n = n as f64;
    match op {
        Op::AllReduce => 2.0 * (n - 1.0) / n,
        Op::AllGather => (n - 1.0) / n,
        Op::Broadcast | Op::Reduce => 1.0,
    }
}

#[derive(Serialize, Debug)]
struct OpTiming {
    /// Mean time of one collective.
    time_ms: f64,
    /// Algorithm bandwidth, GB/s (1e9 bytes).
    alg_gb_s: f64,
    /// Bus bandwidth, GB/s.
    bus_gb_s: f64,
}

impl OpTiming {
    fn new(op: Op, n: usize, bytes: usize, secs: f64) -> Self {
        let alg = bytes as f64 / secs / 1e9;
        OpTiming {
            time_ms: secs * 1e3,
            alg_gb_s: alg,
            bus_gb_s: alg * bus_factor(op, n),
        }
    }
}

#[derive(Serialize, Debug)]
struct LocalBench {
    bench: &'static str,
    backend: Backend,
    devices: usize,
    elements: usize,
    /// Bytes of one device's buffer (`S`).
    bytes: usize,
    iterations: usize,
    /// Mean over all devices (the sum is checked once before timing).
    all_reduce: OpTiming,
    broadcast: OpTiming,
    all_gather: OpTiming,
    reduce: OpTiming,
    /// Single-thread memcpy of `bytes` between two warm buffers, GB/s (CPU backend only).
    memcpy_gb_s: Option<f64>,
    /// `all_reduce.bus_gb_s / memcpy_gb_s`.
    all_reduce_bus_over_memcpy: Option<f64>,
    /// `2(n-1)/n²`: `all_reduce_bus_over_memcpy` for an all-reduce that moves memory exactly
    /// at memcpy's rate (see the module doc).
    all_reduce_bus_over_memcpy_at_memcpy_rate: f64,
    /// `n·S / t` of the all-reduce: the bytes it reads (and writes) per second, comparable with
    /// `memcpy_gb_s`.
    all_reduce_memory_gb_s: f64,
    /// What `starling` found on this machine.
    devices_found: String,
}

/// Mean seconds per call of `f`, after `warmup` untimed calls.
fn mean_secs(
    warmup: usize,
    iterations: usize,
    mut f: impl FnMut() -> Result<(), LocalError>,
) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let t = Instant::now();
    for _ in 0..iterations {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64() / iterations as f64)
}

/// Loads `d + 1` into device `d`, all-reduces once (sum) and checks every device got
/// `n(n+1)/2` everywhere: the timing below is of collectives that work.
fn check_sum(group: &mut LocalGroup) -> Result<()> {
    let (n, len) = (group.devices(), group.len());
    let mut buf = vec![0.0f32; len];
    for d in 0..n {
        buf.fill(d as f32 + 1.0);
        group.load(d, &buf)?;
    }
    group.all_reduce(ReduceOp::Sum)?;
    let expected = (n * (n + 1) / 2) as f32;
    for d in 0..n {
        group.store(d, &mut buf)?;
        ensure!(
            buf.iter().all(|&x| x == expected),
            "all-reduce gave a wrong sum on device {d}"
        );
    }
    Ok(())
}

/// Single-thread memcpy bandwidth over `bytes`, GB/s (warm buffers, mean of `iterations`).
fn memcpy_gb_s(bytes: usize, warmup: usize, iterations: usize) -> Result<f64> {
    let len = bytes / std::mem::size_of::<f32>();
    let src = vec![1.0f32; len];
    let mut dst = vec![0.0f32; len];
    let secs = mean_secs(warmup, iterations, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        Ok(())
    })?;
    Ok(bytes as f64 / secs / 1e9)
}

/// Runs `starling bench local` and prints its JSON report.
pub fn run(args: LocalArgs) -> Result<()> {
    ensure!(
        args.size >= 1 && args.iterations >= 1,
        "--size and --iterations must be at least 1"
    );
    let report = DeviceReport::probe();
    let mut group = LocalGroup::new(args.backend, args.devices, args.size).with_context(|| {
        format!(
            "starting a {} group of {} devices",
            args.backend, args.devices
        )
    })?;
    check_sum(&mut group)?;
    let (n, bytes) = (args.devices, args.size * std::mem::size_of::<f32>());
    let (w, it) = (args.warmup, args.iterations);
    // Mean keeps the values finite run after run (a sum would grow n-fold each time).
    let all_reduce = mean_secs(w, it, || group.all_reduce(ReduceOp::Mean))?;
    let broadcast = mean_secs(w, it, || group.broadcast(0))?;
    let all_gather = mean_secs(w, it, || group.all_gather())?;
    let reduce = mean_secs(w, it, || group.reduce(0, ReduceOp::Mean))?;
    drop(group);
    let memcpy = match args.backend {
        Backend::Cpu => Some(memcpy_gb_s(bytes, w, it)?),
        Backend::Nccl => None,
    };
    let all_reduce_memory_gb_s = (n * bytes) as f64 / all_reduce / 1e9;
    let all_reduce = OpTiming::new(Op::AllReduce, n, bytes, all_reduce);
    let result = LocalBench {
        bench: "local",
        backend: args.backend,
        devices: n,
        elements: args.size,
        bytes,
        iterations: it,
        all_reduce_bus_over_memcpy: memcpy.map(|m| all_reduce.bus_gb_s / m),
        all_reduce_bus_over_memcpy_at_memcpy_rate: bus_factor(Op::AllReduce, n) / n as f64,
        all_reduce_memory_gb_s,
        all_reduce,
        broadcast: OpTiming::new(Op::Broadcast, n, bytes, broadcast),
        all_gather: OpTiming::new(Op::AllGather, n, bytes, all_gather),
        reduce: OpTiming::new(Op::Reduce, n, bytes, reduce),
        memcpy_gb_s: memcpy,
        devices_found: report.to_string(),
    };
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_follow_nccl_tests_definitions() {
        assert_eq!(bus_factor(Op::AllReduce, 4), 1.5);
        assert_eq!(bus_factor(Op::AllGather, 4), 0.75);
        assert_eq!(bus_factor(Op::Broadcast, 4), 1.0);
        assert_eq!(bus_factor(Op::Reduce, 8), 1.0);
        assert_eq!(bus_factor(Op::AllReduce, 1), 0.0);
        assert_eq!(bus_factor(Op::AllReduce, 4) / 4.0, 0.375);
        // 4 devices, 40 MB each, 10 ms: 4 GB/s algorithm, 6 GB/s bus bandwidth.
        let t = OpTiming::new(Op::AllReduce, 4, 40_000_000, 0.01);
        assert!((t.alg_gb_s - 4.0).abs() < 1e-9 && (t.bus_gb_s - 6.0).abs() < 1e-9);
        assert!((t.time_ms - 10.0).abs() < 1e-9);
    }

    #[test]
    fn a_small_cpu_run_prints_and_checks_its_sum() {
        let args = LocalArgs {
            devices: 3,
            size: 1000,
            backend: Backend::Cpu,
            iterations: 2,
            warmup: 1,
        };
        run(args).unwrap();
        let e = run(LocalArgs {
            devices: 2,
            size: 10,
            backend: Backend::Nccl,
            iterations: 1,
            warmup: 0,
        });
        // Without a GPU (or without the cuda feature) NCCL is a clear error, not a panic.
        if let Err(e) = e {
            let text = format!("{e:#}");
            assert!(
                text.contains("nccl")
                    || text.contains("NCCL")
                    || text.contains("CUDA")
                    || text.contains("driver"),
                "{text}"
            );
        }
    }
}
