//! The NCCL backend (feature `cuda`): one CUDA device per member, NCCL communicators made by
//! `ncclCommInitAll` in this process, one stream per device, every collective issued for all
//! devices inside one NCCL group and waited for before returning.
//!
//! `cudarc` loads `libcuda` and `libnccl` at run time and panics on its first call into a
//! library it cannot load, so every entry here first checks `is_culib_present()`, and runs
//! behind `catch_unwind` too (a library too old to have a function `cudarc` needs panics the
//! same way): a machine without a driver or NCCL gets an error, never a panic.
//!
//! Weighted means use `ncclRedOpCreatePreMulSum` (NCCL >= 2.11): each device's buffer is
//! multiplied by its weight over the total on the fly, so one collective does it.

use std::ffi::{c_void, CStr};
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut, DriverError};
use cudarc::nccl::result::{self, NcclError};
use cudarc::nccl::sys;

use super::{panic_text, part, DeviceReport, GpuInfo, LocalError, ReduceOp};

const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;

fn driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn nccl_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

fn cuda_err(e: DriverError) -> LocalError {
    LocalError::Cuda(e.to_string())
}

fn nccl_err(e: NcclError) -> LocalError {
    // SAFETY: an NcclError exists only after the library was loaded; the string is static.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
    LocalError::Nccl(format!("{:?}: {}", e.0, text.to_string_lossy()))
}

/// Runs `f`, turning a panic inside `cudarc` (a function missing from the loaded library) into
/// an error.
fn guarded<T>(f: impl FnOnce() -> Result<T, LocalError>) -> Result<T, LocalError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(LocalError::Cuda(format!(
            "the CUDA driver or NCCL library lacks something this build needs ({}); \
             update the driver or NCCL",
            panic_text(p.as_ref())
        )))
    })
}

/// Directories where a `libnccl.so.2` is commonly installed: the library path, system
/// directories, and the `nvidia/nccl/lib` folder of Python installs (pip's `nvidia-nccl-cu12`).
fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/nccl/lib",
    ] {
        dirs.push(d.into());
    }
    let mut roots: Vec<PathBuf> = vec!["/usr/lib".into(), "/usr/local/lib".into()];
    for var in ["HOME", "VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            let v = PathBuf::from(v);
            roots.push(if var == "HOME" {
                v.join(".local/lib")
            } else {
                v.join("lib")
            });
        }
    }
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("python3") {
                for sub in ["site-packages", "dist-packages"] {
                    dirs.push(e.path().join(sub).join("nvidia/nccl/lib"));
                }
            }
        }
    }
    dirs
}

/// The first `libnccl.so.<version>` in `dirs`.
pub(crate) fn find_versioned_nccl(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter().find_map(|d| {
        let mut found: Vec<PathBuf> = std::fs::read_dir(d)
            .ok()?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("libnccl.so."))
            .map(|e| e.path())
            .collect();
        found.sort();
        found.into_iter().next()
    })
}

/// What to do about a missing `libnccl.so`.
pub(crate) fn nccl_hint(found: Option<&Path>) -> String {
    match found {
        Some(p) => format!(
            "Found {p}: link it as libnccl.so on the library path, e.g. `mkdir -p ~/.local/lib/starling \
             && ln -sf {p} ~/.local/lib/starling/libnccl.so && export LD_LIBRARY_PATH=~/.local/lib/starling:$LD_LIBRARY_PATH`.",
            p = p.display()
        ),
        None => "No libnccl.so.* found either: install NCCL (`pip install nvidia-nccl-cu12`, or \
                 Debian's libnccl2), then link its libnccl.so.2 as libnccl.so in a directory on \
                 LD_LIBRARY_PATH."
            .into(),
    }
}

fn no_nccl() -> LocalError {
    LocalError::NoNccl {
        hint: nccl_hint(find_versioned_nccl(&candidate_dirs()).as_deref()),
    }
}

fn list_gpus() -> Result<Vec<GpuInfo>, LocalError> {
    use cudarc::driver::result as drv;
    drv::init().map_err(cuda_err)?;
    let count = drv::device::get_count().map_err(cuda_err)?;
    (0..count)
        .map(|i| {
            let dev = drv::device::get(i).map_err(cuda_err)?;
            Ok(GpuInfo {
                ordinal: i as usize,
                name: drv::device::get_name(dev).map_err(cuda_err)?,
                // SAFETY: `dev` is a valid device handle.
                memory_bytes: unsafe { drv::device::total_mem(dev) }.map_err(cuda_err)? as u64,
            })
        })
        .collect()
}

/// `NCCL_VERSION_CODE` as `major.minor.patch`.
fn version_text(code: i32) -> String {
    let (major, minor, patch) = if code >= 10000 {
        (code / 10000, code % 10000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    };
    format!("{major}.{minor}.{patch}")
}

/// The GPUs and NCCL this process can use (see [`DeviceReport::probe`]).
pub(crate) fn probe() -> DeviceReport {
    let mut r = DeviceReport {
        cuda_support: true,
        gpus: Vec::new(),
        nccl_version: None,
        problem: None,
    };
    if !driver_present() {
        r.problem = Some(LocalError::NoDriver.to_string());
        return r;
    }
    match guarded(list_gpus) {
        Ok(gpus) if gpus.is_empty() => {
            r.problem = Some("the NVIDIA driver reports no GPU".into());
            return r;
        }
        Ok(gpus) => r.gpus = gpus,
        Err(e) => {
            r.problem = Some(format!("the NVIDIA driver reports no usable GPU: {e}"));
            return r;
        }
    }
    if !nccl_present() {
        r.problem = Some(no_nccl().to_string());
        return r;
    }
    match guarded(|| result::get_nccl_version().map_err(nccl_err)) {
        Ok(code) => r.nccl_version = Some(version_text(code)),
        Err(e) => r.problem = Some(e.to_string()),
    }
    r
}

/// An NCCL communicator, destroyed on drop.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one at a time (`&mut` access).
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        let comm = self.0;
        // SAFETY: made by ncclCommInitAll, destroyed once.
        let _ = catch_unwind(|| unsafe { result::comm_destroy(comm) });
    }
}

/// A per-device reduction operator: a built-in one, or a premultiplied sum to destroy after use.
struct Op {
    op: sys::ncclRedOp_t,
    custom: bool,
}

pub(crate) struct NcclGroup {
    // Field order is drop order: communicators before buffers and streams.
    comms: Vec<RawComm>,
    bufs: Vec<CudaSlice<f32>>,
    streams: Vec<Arc<CudaStream>>,
    len: usize,
}

impl NcclGroup {
    pub fn new(devices: usize, len: usize) -> Result<Self, LocalError> {
        if !driver_present() {
            return Err(LocalError::NoDriver);
        }
        guarded(|| Self::init(devices, len))
    }

    fn init(devices: usize, len: usize) -> Result<Self, LocalError> {
        let found = CudaContext::device_count().map_err(cuda_err)?.max(0) as usize;
        if found < devices {
            return Err(LocalError::NotEnoughDevices {
                wanted: devices,
                found,
            });
        }
        if !nccl_present() {
            return Err(no_nccl());
        }
        let mut streams = Vec::with_capacity(devices);
        let mut bufs = Vec::with_capacity(devices);
        for d in 0..devices {
            let ctx = CudaContext::new(d).map_err(cuda_err)?;
            let stream = ctx.new_stream().map_err(cuda_err)?;
            // CUDA refuses empty allocations; an empty group keeps one unused element.
            bufs.push(stream.alloc_zeros::<f32>(len.max(1)).map_err(cuda_err)?);
            streams.push(stream);
        }
        let mut raw: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devices];
        let ordinals: Vec<i32> = (0..devices as i32).collect();
        // SAFETY: `raw` has room for `devices` communicators, `ordinals` names `devices` GPUs.
        unsafe { result::comm_init_all(raw.as_mut_ptr(), devices as i32, ordinals.as_ptr()) }
            .map_err(nccl_err)?;
        let group = NcclGroup {
            comms: raw.into_iter().map(RawComm).collect(),
            bufs,
            streams,
            len,
        };
        group.synchronize()?;
        Ok(group)
    }

    fn synchronize(&self) -> Result<(), LocalError> {
        for s in &self.streams {
            s.synchronize().map_err(cuda_err)?;
        }
        Ok(())
    }

    pub fn load(&mut self, d: usize, values: &[f32]) -> Result<(), LocalError> {
        if values.is_empty() {
            return Ok(());
        }
        guarded(|| {
            let s = &self.streams[d];
            s.memcpy_htod(values, &mut self.bufs[d]).map_err(cuda_err)?;
            s.synchronize().map_err(cuda_err)
        })
    }

    pub fn store(&self, d: usize, out: &mut [f32]) -> Result<(), LocalError> {
        if out.is_empty() {
            return Ok(());
        }
        guarded(|| {
            let s = &self.streams[d];
            s.memcpy_dtoh(&self.bufs[d].slice(0..self.len), out)
                .map_err(cuda_err)?;
            s.synchronize().map_err(cuda_err)
        })
    }

    /// Issues `issue(device, buffer pointer, communicator, stream)` for every device inside one
    /// NCCL group, then waits for every stream.
    fn launch(
        &mut self,
        mut issue: impl FnMut(usize, u64, sys::ncclComm_t, sys::cudaStream_t) -> Result<(), NcclError>,
    ) -> Result<(), LocalError> {
        if self.len == 0 {
            return Ok(());
        }
        let mut guards = Vec::with_capacity(self.comms.len());
        let mut first_error = None;
        result::group_start().map_err(nccl_err)?;
        let devices = self.bufs.iter_mut().zip(&self.streams).zip(&self.comms);
        for (d, ((buf, stream), comm)) in devices.enumerate() {
            let (ptr, guard) = buf.device_ptr_mut(stream);
            guards.push(guard);
            if let Err(e) = issue(d, ptr, comm.0, stream.cu_stream() as _) {
                first_error.get_or_insert(e);
            }
        }
        let ended = result::group_end();
        drop(guards);
        if let Some(e) = first_error {
            return Err(nccl_err(e));
        }
        ended.map_err(nccl_err)?;
        self.synchronize()
    }

    /// Device `d`'s operator for `op`: sum, average, or premultiplied sum by `coeffs[d] * post`.
    fn make_op(
        &self,
        d: usize,
        op: ReduceOp<'_>,
        coeffs: &[f32],
        post: f32,
    ) -> Result<Op, LocalError> {
        let builtin = |op| Ok(Op { op, custom: false });
        match op {
            ReduceOp::Sum => builtin(sys::ncclRedOp_t::ncclSum),
            ReduceOp::Mean => builtin(sys::ncclRedOp_t::ncclAvg),
            ReduceOp::WeightedMean(_) => {
                let mut scalar = coeffs[d] * post;
                let mut out = MaybeUninit::<sys::ncclRedOp_t>::uninit();
                // SAFETY: `out` receives the op; the scalar is read during the call
                // (host-immediate residence).
                unsafe {
                    result::reduce_op_create_pre_mul_sum(
                        out.as_mut_ptr(),
                        (&mut scalar as *mut f32).cast::<c_void>(),
                        F32,
                        sys::ncclScalarResidence_t::ncclScalarHostImmediate,
                        self.comms[d].0,
                    )
                }
                .map_err(nccl_err)?;
                // NCCL numbers custom ops from ncclNumOps up; `cudarc` declares the op type as
                // an enum, so take only a value the enum has (the first custom op is
                // ncclNumOps: we create one at a time and destroy it after use).
                // SAFETY: the call wrote an int-sized value.
                let bits = unsafe { out.as_ptr().cast::<u32>().read() };
                if bits > sys::ncclRedOp_t::ncclNumOps as u32 {
                    return Err(LocalError::Nccl(format!(
                        "NCCL handed out custom reduction op {bits}, which this build cannot name"
                    )));
                }
                // SAFETY: checked to be one of the enum's values.
                Ok(Op {
                    op: unsafe { out.assume_init() },
                    custom: true,
                })
            }
        }
    }

    pub fn reduction(
        &mut self,
        root: Option<usize>,
        op: ReduceOp<'_>,
        coeffs: &[f32],
        post: f32,
    ) -> Result<(), LocalError> {
        guarded(|| {
            let ops = (0..self.comms.len())
                .map(|d| self.make_op(d, op, coeffs, post))
                .collect::<Result<Vec<Op>, _>>()?;
            let len = self.len;
            let result = self.launch(|d, ptr, comm, stream| {
                let p = ptr as *mut c_void;
                // SAFETY: in-place collective on a live buffer of `len` elements.
                unsafe {
                    match root {
                        None => result::all_reduce(p, p, len, F32, ops[d].op, comm, stream),
                        Some(r) => {
                            result::reduce(p, p, len, F32, ops[d].op, r as i32, comm, stream)
                        }
                    }
                }
                .map(|_| ())
            });
            for (d, op) in ops.iter().enumerate().filter(|(_, o)| o.custom) {
                // SAFETY: created on this communicator above, used, now destroyed once.
                let _ = unsafe { result::reduce_op_destroy(op.op, self.comms[d].0) };
            }
            result
        })
    }

    pub fn broadcast(&mut self, root: usize) -> Result<(), LocalError> {
        let len = self.len;
        guarded(|| {
            self.launch(|_, ptr, comm, stream| {
                let p = ptr as *mut c_void;
                // SAFETY: in-place broadcast on a live buffer of `len` elements.
                unsafe { result::broadcast(p, p, len, F32, root as i32, comm, stream) }.map(|_| ())
            })
        })
    }

    /// In-place all-gather of the parts (`ncclAllGather` when they are equal, else one
    /// broadcast per part, all in one group).
    pub fn all_gather(&mut self) -> Result<(), LocalError> {
        let (len, n) = (self.len, self.comms.len());
        let bytes = |elements: usize| (elements * std::mem::size_of::<f32>()) as u64;
        guarded(|| {
            self.launch(|d, ptr, comm, stream| {
                if len % n == 0 {
                    let count = len / n;
                    let send = (ptr + bytes(d * count)) as *const c_void;
                    // SAFETY: in place: the send part lies inside the receive buffer at rank d.
                    unsafe {
                        result::all_gather(send, ptr as *mut c_void, count, F32, comm, stream)
                    }
                    .map(|_| ())
                } else {
                    for k in (0..n).filter(|&k| !part(len, n, k).is_empty()) {
                        let r = part(len, n, k);
                        let p = (ptr + bytes(r.start)) as *mut c_void;
                        // SAFETY: in-place broadcast of a range inside the buffer.
                        unsafe { result::broadcast(p, p, r.len(), F32, k as i32, comm, stream) }?;
                    }
                    Ok(())
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::LocalGroup;

    /// A stand-in driver with one "GPU", and an NCCL that has only `ncclGetVersion`.
    const FAKE_CUDA: &str = r#"
        #include <string.h>
        #include <stddef.h>
        int cuInit(unsigned f) { return 0; }
        int cuDeviceGetCount(int *c) { *c = 1; return 0; }
        int cuDeviceGet(int *d, int o) { *d = o; return 0; }
        int cuDeviceGetName(char *n, int len, int d) { strncpy(n, "Fake GPU", len); return 0; }
        int cuDeviceTotalMem_v2(size_t *b, int d) { *b = (size_t)80 << 30; return 0; }
    "#;
    const FAKE_NCCL: &str = "int ncclGetVersion(int *v) { *v = 22105; return 0; }";
    const THIS_TEST: &str =
        "devices::nccl::tests::a_driver_without_nccl_or_with_missing_functions_is_an_error";

    fn compile(dir: &Path, source: &str, lib: &str) -> bool {
        let c = dir.join(format!("{lib}.c"));
        std::fs::write(&c, source).unwrap();
        std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join(lib))
            .arg(&c)
            .status()
            .is_ok_and(|s| s.success())
    }

    /// The NCCL backend with a (stand-in) driver but no `libnccl.so`, and with an NCCL missing
    /// the functions it needs: errors that say what to do, never a panic. The library path is
    /// read when a process starts, so the checks run in a child process of this test binary.
    #[test]
    fn a_driver_without_nccl_or_with_missing_functions_is_an_error() {
        match std::env::var("STARLING_FAKE_CUDA").as_deref() {
            Ok("no-nccl") => return no_nccl_child(),
            Ok("stub-nccl") => return stub_nccl_child(),
            _ => {}
        }
        let dir = std::env::temp_dir().join(format!("starling-fake-cuda-{}", std::process::id()));
        let with = dir.join("with-nccl");
        std::fs::create_dir_all(&with).unwrap();
        if !(compile(&dir, FAKE_CUDA, "libcuda.so")
            && compile(&dir, FAKE_NCCL, "libnccl.so.2")
            && compile(&with, FAKE_NCCL, "libnccl.so"))
        {
            eprintln!("skipped: no C compiler (cc) to build stand-in CUDA libraries");
            return;
        }
        let mut modes = vec![("stub-nccl", format!("{}:{}", dir.display(), with.display()))];
        if !nccl_present() {
            // (Where a real libnccl.so is installed, cudarc would find it.)
            modes.push(("no-nccl", dir.display().to_string()));
        }
        for (mode, path) in modes {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", THIS_TEST, "--nocapture", "--test-threads=1"])
                .env("LD_LIBRARY_PATH", path)
                .env("STARLING_FAKE_CUDA", mode)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "{mode}: {text}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn no_nccl_child() {
        let report = DeviceReport::probe();
        assert_eq!(report.gpus.len(), 1, "{report}");
        let line = report.to_string();
        assert!(
            line.contains("Fake GPU") && line.contains("ln -sf"),
            "{line}"
        );
        assert!(matches!(
            LocalGroup::nccl(2, 10),
            Err(LocalError::NotEnoughDevices {
                wanted: 2,
                found: 1
            })
        ));
        match LocalGroup::nccl(1, 10) {
            Err(LocalError::NoNccl { hint }) => assert!(hint.contains("libnccl.so.2"), "{hint}"),
            other => panic!("expected NoNccl, got {other:?}"),
        }
    }

    fn stub_nccl_child() {
        let report = DeviceReport::probe();
        assert_eq!(report.nccl_version.as_deref(), Some("2.21.5"), "{report}");
        assert!(report.nccl_usable());
        // The stand-in driver lacks what creating a context needs: an error, not a panic.
        match LocalGroup::nccl(1, 10) {
            Err(LocalError::Cuda(m)) => assert!(m.contains("Missing symbol"), "{m}"),
            other => panic!("expected a missing-function error, got {other:?}"),
        }
    }

    #[test]
    fn finds_a_versioned_nccl_and_says_which_link_to_make() {
        let dir = std::env::temp_dir().join(format!("starling-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(find_versioned_nccl(std::slice::from_ref(&dir)), None);
        let lib = dir.join("libnccl.so.2");
        std::fs::write(&lib, b"").unwrap();
        let found = find_versioned_nccl(&[PathBuf::from("/nonexistent"), dir.clone()]);
        assert_eq!(found.as_deref(), Some(lib.as_path()));
        let hint = nccl_hint(found.as_deref());
        assert!(
            hint.contains(&format!("ln -sf {}", lib.display())),
            "{hint}"
        );
        assert!(nccl_hint(None).contains("install NCCL"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(version_text(22105), "2.21.5");
        assert_eq!(version_text(2708), "2.7.8");
    }
}
