//! Local collectives: the devices of one machine act as one member of the swarm.
//!
//! - [`LocalGroup`]: `n` devices of one process, each owning a buffer of `len` `f32` (a
//!   device's tensor), with all-reduce (sum, mean, weighted mean), reduce, broadcast and
//!   all-gather. Two backends ([`Backend`]):
//!   - **cpu**: each device is a thread owning a host buffer; collectives are reduce-scatter +
//!     all-gather over slices, run in parallel by the device threads, allocating nothing once
//!     the group is built. For tests and for machines without GPUs.
//!   - **nccl**: one CUDA device per member, collectives through NCCL (via `cudarc`, with the
//!     `cuda` feature). The libraries are loaded at run time, so building needs no CUDA; a
//!     machine without a driver or NCCL gets [`LocalError::NoDriver`] /
//!     [`LocalError::NoNccl`], never a panic.
//! - [`Hierarchical`]: reduces inside the machine, lets one swarm averager (anything
//!   implementing [`SwarmAverager`], e.g. [`crate::Averager`]) speak for the machine with the
//!   summed weight, then broadcasts the result to every device. A swarm round with two such
//!   machines of two devices and two plain peers is a group of four, not six.
//! - [`DeviceReport`]: which GPUs and which NCCL this process can use, in one line.
//!
//! ```
//! use starling_averager::devices::{LocalGroup, ReduceOp};
//! let mut group = LocalGroup::cpu(4, 1000)?;
//! for d in 0..4 {
//!     group.load(d, &vec![d as f32; 1000])?;
//! }
//! group.all_reduce(ReduceOp::Sum)?;
//! let mut out = vec![0.0; 1000];
//! group.store(3, &mut out)?;
//! assert!(out.iter().all(|&x| x == 6.0));
//! # Ok::<(), starling_averager::devices::LocalError>(())
//! ```
//!
//! NCCL note: `cudarc` looks for `libnccl.so`, while pip's `nvidia-nccl-cu12` and Debian's
//! `libnccl2` ship only `libnccl.so.2`. Without the link, [`LocalError::NoNccl`] names the
//! `libnccl.so.2` it found and the symlink to create (`ln -s .../libnccl.so.2 DIR/libnccl.so`
//! with `DIR` on `LD_LIBRARY_PATH`).

mod cpu;
mod error;
mod hierarchical;
#[cfg(feature = "cuda")]
mod nccl;
mod probe;

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

pub use error::LocalError;
pub use hierarchical::{Hierarchical, HierarchicalReport, SwarmAverager};
pub use probe::{DeviceReport, GpuInfo};

use cpu::{CpuGroup, Job};

/// Most devices in one group.
pub const MAX_DEVICES: usize = 64;

/// Where a [`LocalGroup`]'s devices live.
///
/// ```
/// use starling_averager::devices::Backend;
/// assert_eq!("nccl".parse::<Backend>().unwrap(), Backend::Nccl);
/// assert_eq!(Backend::Cpu.to_string(), "cpu");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Threads over host buffers.
    Cpu,
    /// CUDA devices through NCCL (needs the `cuda` feature, a driver and NCCL at run time).
    Nccl,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Cpu => "cpu",
            Backend::Nccl => "nccl",
        })
    }
}

impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Backend::Cpu),
            "nccl" => Ok(Backend::Nccl),
            other => Err(format!("unknown backend {other:?}: cpu or nccl")),
        }
    }
}

/// How an all-reduce (or reduce) combines the devices' buffers.
///
/// ```
/// use starling_averager::devices::{LocalGroup, ReduceOp};
/// let mut group = LocalGroup::cpu(2, 1)?;
/// group.load(0, &[1.0])?;
/// group.load(1, &[4.0])?;
/// group.all_reduce(ReduceOp::WeightedMean(&[2.0, 1.0]))?; // (2*1 + 1*4) / 3
/// let mut x = [0.0];
/// group.store(1, &mut x)?;
/// assert_eq!(x, [2.0]);
/// # Ok::<(), starling_averager::devices::LocalError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReduceOp<'a> {
    /// The element-wise sum.
    Sum,
    /// The element-wise mean (sum / devices).
    Mean,
    /// `sum_d w_d x_d / sum_d w_d`, one weight per device (finite, >= 0, positive sum).
    WeightedMean(&'a [f32]),
}

impl ReduceOp<'_> {
    /// Per-device coefficients (written into `coeffs`) and the factor applied to their sum.
    fn coefficients(&self, coeffs: &mut [f32]) -> Result<f32, LocalError> {
        let n = coeffs.len();
        match self {
            ReduceOp::Sum => {
                coeffs.fill(1.0);
                Ok(1.0)
            }
            ReduceOp::Mean => {
                coeffs.fill(1.0);
                Ok(1.0 / n as f32)
            }
            ReduceOp::WeightedMean(w) => {
                let total = check_weights(w, n)?;
                coeffs.copy_from_slice(w);
                Ok((1.0 / total) as f32)
            }
        }
    }
}

/// The sum of `weights` (in f64), if there is one finite weight >= 0 per device and the sum is
/// positive.
pub(crate) fn check_weights(weights: &[f32], devices: usize) -> Result<f64, LocalError> {
    let bad = || LocalError::InvalidWeights {
        weights: weights.to_vec(),
    };
    if weights.len() != devices || !weights.iter().all(|w| w.is_finite() && *w >= 0.0) {
        return Err(bad());
    }
    let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    if !(total > 0.0 && (total as f32).is_finite()) {
        return Err(bad());
    }
    Ok(total)
}

/// Device `d`'s part of a vector of `len` elements split over `n` devices: contiguous, in
/// device order, sizes differing by at most one (equal when `n` divides `len`).
///
/// ```
/// use starling_averager::devices::part;
/// assert_eq!(part(10, 4, 0), 0..2);
/// assert_eq!(part(10, 4, 3), 7..10);
/// assert_eq!(part(1, 4, 2), 0..0);
/// ```
pub fn part(len: usize, n: usize, d: usize) -> Range<usize> {
    let at = |i: usize| (len as u128 * i as u128 / n.max(1) as u128) as usize;
    at(d)..at(d + 1)
}

/// The message of a caught panic.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked".into())
}

enum Inner {
    Cpu(CpuGroup),
    #[cfg(feature = "cuda")]
    Nccl(nccl::NcclGroup),
}

/// The devices of one process, each owning a buffer of `len` `f32`, and collectives over them.
///
/// Buffers start at zero. Fill them with [`LocalGroup::load`] (or, on the CPU backend, write
/// through [`LocalGroup::host_buffer_mut`]); read them with [`LocalGroup::store`]. Collectives
/// work in place on the buffers and return when every device holds its result.
///
/// ```
/// use starling_averager::devices::{Backend, LocalGroup, ReduceOp};
/// let mut group = LocalGroup::new(Backend::Cpu, 4, 8)?;
/// group.host_buffer_mut(2).unwrap().fill(1.5);
/// group.broadcast(2)?;                    // every device now holds 1.5s
/// group.all_reduce(ReduceOp::Mean)?;      // still 1.5s
/// // all-gather: device d contributes `group.part(d)` of its own buffer
/// for d in 0..4 {
///     let r = group.part(d);
///     group.host_buffer_mut(d).unwrap()[r].fill(d as f32);
/// }
/// group.all_gather()?;
/// assert_eq!(group.host_buffer(1).unwrap(), &[0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
/// # Ok::<(), starling_averager::devices::LocalError>(())
/// ```
pub struct LocalGroup {
    inner: Inner,
    devices: usize,
    len: usize,
    /// Per-device coefficients of the current reduction (allocated once).
    coeffs: Vec<f32>,
}

impl LocalGroup {
    /// `devices` devices of `backend`, each with a zeroed buffer of `len` elements.
    pub fn new(backend: Backend, devices: usize, len: usize) -> Result<Self, LocalError> {
        match backend {
            Backend::Cpu => Self::cpu(devices, len),
            Backend::Nccl => Self::nccl(devices, len),
        }
    }

    /// `devices` CPU devices (threads), each with a zeroed host buffer of `len` elements
    /// (allocated, and its pages faulted in, here).
    pub fn cpu(devices: usize, len: usize) -> Result<Self, LocalError> {
        check_devices(devices)?;
        let inner = Inner::Cpu(CpuGroup::new(devices, len)?);
        Ok(Self::with(inner, devices, len))
    }

    /// The first `devices` CUDA devices of this machine, with NCCL communicators between them
    /// and a zeroed device buffer of `len` elements each. Errors, never panics, when this build
    /// lacks the `cuda` feature ([`LocalError::NoCudaSupport`]), when the driver or NCCL cannot
    /// be loaded ([`LocalError::NoDriver`], [`LocalError::NoNccl`]) or when there are fewer GPUs
    /// ([`LocalError::NotEnoughDevices`]).
    ///
    /// ```
    /// use starling_averager::devices::{LocalError, LocalGroup};
    /// match LocalGroup::nccl(2, 1 << 20) {
    ///     Ok(group) => println!("{} GPUs", group.devices()),
    ///     Err(e) => println!("no NCCL here: {e}"), // e.g. on a machine without GPUs
    /// }
    /// ```
    pub fn nccl(devices: usize, len: usize) -> Result<Self, LocalError> {
        check_devices(devices)?;
        #[cfg(feature = "cuda")]
        {
            let inner = Inner::Nccl(nccl::NcclGroup::new(devices, len)?);
            Ok(Self::with(inner, devices, len))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = len;
            Err(LocalError::NoCudaSupport)
        }
    }

    fn with(inner: Inner, devices: usize, len: usize) -> Self {
        LocalGroup {
            inner,
            devices,
            len,
            coeffs: vec![1.0; devices],
        }
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        match self.inner {
            Inner::Cpu(_) => Backend::Cpu,
            #[cfg(feature = "cuda")]
            Inner::Nccl(_) => Backend::Nccl,
        }
    }

    /// Number of devices.
    pub fn devices(&self) -> usize {
        self.devices
    }

    /// Elements in each device's buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the buffers hold no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device `d`'s part of the buffers: what it contributes to [`LocalGroup::all_gather`]
    /// (see [`part`]).
    pub fn part(&self, d: usize) -> Range<usize> {
        part(self.len, self.devices, d)
    }

    /// Copies `values` (exactly `len` elements) into device `d`'s buffer.
    pub fn load(&mut self, d: usize, values: &[f32]) -> Result<(), LocalError> {
        self.check_device(d)?;
        self.check_len(values.len())?;
        match &mut self.inner {
            Inner::Cpu(g) => {
                g.buffer_mut(d).copy_from_slice(values);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Inner::Nccl(g) => g.load(d, values),
        }
    }

    /// Copies device `d`'s buffer into `out` (exactly `len` elements).
    pub fn store(&self, d: usize, out: &mut [f32]) -> Result<(), LocalError> {
        self.check_device(d)?;
        self.check_len(out.len())?;
        match &self.inner {
            Inner::Cpu(g) => {
                out.copy_from_slice(g.buffer(d));
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Inner::Nccl(g) => g.store(d, out),
        }
    }

    /// Device `d`'s buffer, on the CPU backend (`None` on NCCL, whose buffers are in device
    /// memory, or for a device out of range).
    pub fn host_buffer(&self, d: usize) -> Option<&[f32]> {
        match &self.inner {
            Inner::Cpu(g) if d < self.devices => Some(g.buffer(d)),
            _ => None,
        }
    }

    /// Device `d`'s buffer, writable, on the CPU backend (`None` on NCCL or out of range).
    pub fn host_buffer_mut(&mut self, d: usize) -> Option<&mut [f32]> {
        match &mut self.inner {
            Inner::Cpu(g) if d < self.devices => Some(g.buffer_mut(d)),
            _ => None,
        }
    }

    /// Every device's buffer becomes the reduction `op` of all buffers.
    pub fn all_reduce(&mut self, op: ReduceOp<'_>) -> Result<(), LocalError> {
        self.reduction(None, op)
    }

    /// Device `root`'s buffer becomes the reduction `op` of all buffers; the others keep their
    /// values.
    pub fn reduce(&mut self, root: usize, op: ReduceOp<'_>) -> Result<(), LocalError> {
        self.check_device(root)?;
        self.reduction(Some(root), op)
    }

    fn reduction(&mut self, root: Option<usize>, op: ReduceOp<'_>) -> Result<(), LocalError> {
        let post = op.coefficients(&mut self.coeffs)?;
        match &mut self.inner {
            Inner::Cpu(g) => g.run(Job::Reduce { root, post }, &self.coeffs),
            #[cfg(feature = "cuda")]
            Inner::Nccl(g) => g.reduction(root, op, &self.coeffs, post),
        }
    }

    /// Every device's buffer becomes a copy of device `root`'s.
    pub fn broadcast(&mut self, root: usize) -> Result<(), LocalError> {
        self.check_device(root)?;
        match &mut self.inner {
            Inner::Cpu(g) => g.run(Job::Broadcast { root }, &[]),
            #[cfg(feature = "cuda")]
            Inner::Nccl(g) => g.broadcast(root),
        }
    }

    /// In-place all-gather: device `d` contributes [`LocalGroup::part`]`(d)` of its own buffer;
    /// afterwards every buffer holds every device's part.
    pub fn all_gather(&mut self) -> Result<(), LocalError> {
        match &mut self.inner {
            Inner::Cpu(g) => g.run(Job::AllGather, &[]),
            #[cfg(feature = "cuda")]
            Inner::Nccl(g) => g.all_gather(),
        }
    }

    fn check_device(&self, d: usize) -> Result<(), LocalError> {
        if d < self.devices {
            Ok(())
        } else {
            Err(LocalError::Invalid(format!(
                "device {d} out of range: the group has {} devices",
                self.devices
            )))
        }
    }

    fn check_len(&self, len: usize) -> Result<(), LocalError> {
        if len == self.len {
            Ok(())
        } else {
            Err(LocalError::Invalid(format!(
                "a buffer of {len} elements where the group's hold {}",
                self.len
            )))
        }
    }
}

impl fmt::Debug for LocalGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalGroup")
            .field("backend", &self.backend())
            .field("devices", &self.devices)
            .field("len", &self.len)
            .finish()
    }
}

fn check_devices(devices: usize) -> Result<(), LocalError> {
    if (1..=MAX_DEVICES).contains(&devices) {
        Ok(())
    } else {
        Err(LocalError::Invalid(format!(
            "{devices} devices: a group has 1 to {MAX_DEVICES}"
        )))
    }
}

#[cfg(test)]
mod tests;
