//! The CPU backend: one thread per device, each device owning a host buffer (its tensor).
//!
//! The calling thread is device 0; devices `1..n` are persistent threads that sleep on a condvar
//! between collectives. A collective is one job that every device runs on **its part** of the
//! vector (`part(d)`, a contiguous slice, see [`super::part`]):
//!
//! - all-reduce is reduce-scatter + all-gather over the parts, pipelined block by block: device
//!   `d` sums block `b` of its part across all buffers (in device order, into a stack
//!   accumulator that stays in L1) and at once writes the result into block `b` of every
//!   buffer. Every element is read once per buffer and written once per buffer: the least
//!   memory traffic an all-reduce over `n` separate buffers can have (`2n` times the vector).
//! - reduce does the same but writes only the root's buffer; broadcast and all-gather copy one
//!   buffer's part into every other buffer, block by block.
//!
//! **Safety invariant.** During a job, device `d` touches only `part(d)` of any buffer, and
//! parts are disjoint, so no element is ever accessed by two threads at once; the only
//! exception is the warm-up job, where each device writes its own whole buffer and nothing
//! else. The caller reaches the buffers only between jobs (through `&mut self`), when every
//! device thread is asleep holding no reference. Buffers and scratch are allocated once, at
//! construction (and their pages faulted in by the warm-up), so a warm collective allocates
//! nothing.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::{panic_text, part, LocalError};
use starling_node::lock::lock;

/// Elements handled at a time: a block of the accumulator and of one source buffer (16 KiB
/// each) stay in L1 while the block is summed and written back.
const BLOCK: usize = 4096;

/// What every device does in one collective.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Job {
    /// `post * sum_k coeffs[k] * buf_k`, written into every buffer (`root: None`) or into
    /// `root`'s only.
    Reduce { root: Option<usize>, post: f32 },
    /// `root`'s buffer into every other buffer.
    Broadcast { root: usize },
    /// Device `d`'s part of its own buffer into every other buffer.
    AllGather,
    /// Each device writes zeros over its own whole buffer (faults its pages in).
    WarmUp,
    /// The device threads end.
    Exit,
}

/// The job board: written by the caller, read by the device threads.
struct Control {
    generation: u64,
    job: Job,
    /// One coefficient per device (for `Reduce`); allocated once.
    coeffs: Vec<f32>,
    /// Device threads that have not finished the current job.
    pending: usize,
    /// The first failure of a device thread, if any.
    failure: Option<String>,
}

/// One device's buffer, reached through a raw pointer by every device thread (see the module's
/// safety invariant).
struct RawBuf {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the pointer is owned by `Shared` and only dereferenced under the module's invariant.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

struct Shared {
    bufs: Vec<RawBuf>,
    len: usize,
    control: Mutex<Control>,
    start: Condvar,
    done: Condvar,
}

impl Shared {
    /// Elements `r` of buffer `k`.
    ///
    /// # Safety
    /// No thread may write these elements while the slice lives.
    unsafe fn read(&self, k: usize, r: Range<usize>) -> &[f32] {
        let b = &self.bufs[k];
        debug_assert!(r.start <= r.end && r.end <= b.len);
        std::slice::from_raw_parts(b.ptr.add(r.start), r.len())
    }

    /// Elements `r` of buffer `k`, writable.
    ///
    /// # Safety
    /// No other reference to these elements may exist while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn write(&self, k: usize, r: Range<usize>) -> &mut [f32] {
        let b = &self.bufs[k];
        debug_assert!(r.start <= r.end && r.end <= b.len);
        std::slice::from_raw_parts_mut(b.ptr.add(r.start), r.len())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for b in &self.bufs {
            // SAFETY: made by `Box::into_raw` in `CpuGroup::new`, freed once, here, after every
            // device thread (each holding an `Arc<Shared>`) has ended.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(b.ptr, b.len)) });
        }
    }
}

/// `n` CPU devices, each owning a buffer of `len` elements.
pub(crate) struct CpuGroup {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Device 0's coefficients for the current job (allocated once).
    coeffs: Vec<f32>,
    /// Set when a device thread failed: the group refuses further jobs.
    broken: Option<String>,
}

impl CpuGroup {
    pub fn new(devices: usize, len: usize) -> Result<Self, LocalError> {
        let bufs = (0..devices)
            .map(|_| {
                let b: Box<[f32]> = vec![0.0f32; len].into_boxed_slice();
                RawBuf {
                    ptr: Box::into_raw(b).cast::<f32>(),
                    len,
                }
            })
            .collect();
        let shared = Arc::new(Shared {
            bufs,
            len,
            control: Mutex::new(Control {
                generation: 0,
                job: Job::WarmUp,
                coeffs: vec![1.0; devices],
                pending: 0,
                failure: None,
            }),
            start: Condvar::new(),
            done: Condvar::new(),
        });
        let mut group = CpuGroup {
            shared,
            workers: Vec::with_capacity(devices.saturating_sub(1)),
            coeffs: vec![1.0; devices],
            broken: None,
        };
        for d in 1..devices {
            let shared = group.shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("starling-cpu-device-{d}"))
                .spawn(move || device_thread(&shared, d));
            match spawned {
                Ok(handle) => group.workers.push(handle),
                // Dropping the group ends the threads already started.
                Err(e) => {
                    return Err(LocalError::Worker(format!(
                        "cannot start the thread of CPU device {d}: {e}"
                    )))
                }
            }
        }
        group.run(Job::WarmUp, &[])?;
        Ok(group)
    }

    pub fn devices(&self) -> usize {
        self.shared.bufs.len()
    }

    pub fn buffer(&self, d: usize) -> &[f32] {
        // SAFETY: between jobs no device thread touches a buffer; `&self` excludes `&mut`.
        unsafe { self.shared.read(d, 0..self.shared.len) }
    }

    pub fn buffer_mut(&mut self, d: usize) -> &mut [f32] {
        // SAFETY: between jobs no device thread touches a buffer; `&mut self` is exclusive.
        unsafe { self.shared.write(d, 0..self.shared.len) }
    }

    /// Runs `job` on every device (this thread being device 0) and waits for all of them.
    /// `coeffs` (one per device) is read by `Reduce` jobs only.
    pub fn run(&mut self, job: Job, coeffs: &[f32]) -> Result<(), LocalError> {
        if let Some(why) = &self.broken {
            return Err(LocalError::Worker(why.clone()));
        }
        let n = self.devices();
        if !coeffs.is_empty() {
            self.coeffs.copy_from_slice(coeffs);
        }
        {
            let mut c = lock(&self.shared.control);
            c.job = job;
            c.coeffs.copy_from_slice(&self.coeffs);
            c.pending = n - 1;
            c.generation += 1;
        }
        self.shared.start.notify_all();
        // Device 0's share, on this thread. Even if it fails, wait for the others: they may
        // still be touching the buffers.
        let mine = catch_unwind(AssertUnwindSafe(|| {
            run_part(&self.shared, 0, job, &self.coeffs)
        }));
        let mut c = lock(&self.shared.control);
        while c.pending > 0 {
            c = self.shared.done.wait(c).unwrap_or_else(|e| e.into_inner());
        }
        let failure = c.failure.take().or_else(|| {
            mine.err()
                .map(|p| format!("device 0: {}", panic_text(p.as_ref())))
        });
        drop(c);
        if let Some(why) = failure {
            self.broken = Some(why.clone());
            return Err(LocalError::Worker(why));
        }
        Ok(())
    }
}

impl Drop for CpuGroup {
    fn drop(&mut self) {
        {
            let mut c = lock(&self.shared.control);
            c.job = Job::Exit;
            c.generation += 1;
        }
        self.shared.start.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Device `d`'s loop: wait for a job, run its share, report, until `Exit`.
fn device_thread(shared: &Shared, d: usize) {
    let n = shared.bufs.len();
    let mut coeffs = vec![1.0f32; n];
    let mut seen = 0u64;
    loop {
        let job = {
            let mut c = lock(&shared.control);
            while c.generation == seen {
                c = shared.start.wait(c).unwrap_or_else(|e| e.into_inner());
            }
            seen = c.generation;
            coeffs.copy_from_slice(&c.coeffs);
            c.job
        };
        if job == Job::Exit {
            return;
        }
        let result = catch_unwind(AssertUnwindSafe(|| run_part(shared, d, job, &coeffs)));
        let mut c = lock(&shared.control);
        if let Err(p) = result {
            c.failure
                .get_or_insert_with(|| format!("device {d}: {}", panic_text(p.as_ref())));
        }
        c.pending -= 1;
        if c.pending == 0 {
            shared.done.notify_all();
        }
    }
}

/// Device `d`'s share of `job`: everything it does touches `part(d)` only (see the module doc).
fn run_part(shared: &Shared, d: usize, job: Job, coeffs: &[f32]) {
    let n = shared.bufs.len();
    let mine = part(shared.len, n, d);
    match job {
        Job::Reduce { root, post } => reduce_part(shared, mine, coeffs, post, root),
        Job::Broadcast { root } => fan_out(shared, root, mine),
        Job::AllGather => fan_out(shared, d, mine),
        Job::WarmUp => {
            // SAFETY: in the warm-up each device writes its own buffer and touches no other.
            unsafe { shared.write(d, 0..shared.len) }.fill(0.0);
        }
        Job::Exit => {}
    }
}

/// Sums `r` across all buffers (`coeffs`-weighted, in device order, times `post`) block by
/// block, writing each block into every buffer or into `root`'s.
fn reduce_part(shared: &Shared, r: Range<usize>, coeffs: &[f32], post: f32, root: Option<usize>) {
    let n = shared.bufs.len();
    let mut acc = [0.0f32; BLOCK];
    let mut at = r.start;
    while at < r.end {
        let b = at..(at + BLOCK).min(r.end);
        let acc = &mut acc[..b.len()];
        {
            // SAFETY: `b` lies in this device's part; nobody else touches it during the job,
            // and this device holds no other reference into it while these slices live.
            let src = unsafe { shared.read(0, b.clone()) };
            let c = coeffs[0];
            for (a, &x) in acc.iter_mut().zip(src) {
                *a = c * x;
            }
            for (k, &c) in coeffs.iter().enumerate().take(n).skip(1) {
                let src = unsafe { shared.read(k, b.clone()) };
                for (a, &x) in acc.iter_mut().zip(src) {
                    *a += c * x;
                }
            }
        }
        if post != 1.0 {
            for a in acc.iter_mut() {
                *a *= post;
            }
        }
        // SAFETY: as above; the read slices are gone.
        match root {
            Some(t) => unsafe { shared.write(t, b.clone()) }.copy_from_slice(acc),
            None => {
                for k in 0..n {
                    unsafe { shared.write(k, b.clone()) }.copy_from_slice(acc);
                }
            }
        }
        at = b.end;
    }
}

/// Copies `r` of buffer `from` into every other buffer, block by block (each source block is
/// read from memory once, then from cache).
fn fan_out(shared: &Shared, from: usize, r: Range<usize>) {
    let n = shared.bufs.len();
    let mut at = r.start;
    while at < r.end {
        let b = at..(at + BLOCK).min(r.end);
        // SAFETY: `b` lies in this device's part; `from`'s copy of it is only read, and every
        // written buffer differs from `from`.
        let src = unsafe { shared.read(from, b.clone()) };
        for k in (0..n).filter(|&k| k != from) {
            unsafe { shared.write(k, b.clone()) }.copy_from_slice(src);
        }
        at = b.end;
    }
}
