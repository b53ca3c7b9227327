//! [`DeviceReport`]: which GPUs (and which NCCL) this process can use, for `starling node`,
//! `starling bench local` and training commands to print in one line.

use std::fmt;

use serde::Serialize;

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// The name the driver reports (e.g. `NVIDIA H200`).
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
}

/// What local devices this process found.
///
/// ```
/// use starling_averager::devices::DeviceReport;
/// let report = DeviceReport::probe();
/// println!("{report}"); // e.g. "local devices: CPU only (built without CUDA support; ...)"
/// assert!(report.to_string().lines().count() == 1);
/// ```
#[derive(Debug, Clone, Serialize)]
pub struct DeviceReport {
    /// This build has the `cuda` feature.
    pub cuda_support: bool,
    /// The GPUs the driver reports (empty without CUDA support, driver or GPU).
    pub gpus: Vec<GpuInfo>,
    /// The NCCL version, when NCCL could be loaded.
    pub nccl_version: Option<String>,
    /// Why GPUs (or NCCL) cannot be used, if they cannot.
    pub problem: Option<String>,
}

impl DeviceReport {
    /// Looks for GPUs and NCCL (without the `cuda` feature: reports that the build has no CUDA
    /// support). Never panics, also when the driver or NCCL library is missing.
    pub fn probe() -> Self {
        #[cfg(feature = "cuda")]
        {
            super::nccl::probe()
        }
        #[cfg(not(feature = "cuda"))]
        DeviceReport {
            cuda_support: false,
            gpus: Vec::new(),
            nccl_version: None,
            problem: Some(
                "built without CUDA support; rebuild with --features cuda to use GPUs".into(),
            ),
        }
    }

    /// True if the NCCL backend can run here (GPUs, driver and NCCL all present).
    pub fn nccl_usable(&self) -> bool {
        !self.gpus.is_empty() && self.nccl_version.is_some()
    }
}

impl fmt::Display for DeviceReport {
    /// One line: the GPUs found and NCCL's version, or why there are none.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "local devices: ")?;
        if self.gpus.is_empty() {
            write!(f, "CPU only")?;
        } else {
            let plural = if self.gpus.len() == 1 { "" } else { "s" };
            let list: Vec<String> = self
                .gpus
                .iter()
                .map(|g| {
                    format!(
                        "{}: {}, {:.1} GiB",
                        g.ordinal,
                        g.name,
                        g.memory_bytes as f64 / (1u64 << 30) as f64
                    )
                })
                .collect();
            write!(f, "{} GPU{plural} ({})", self.gpus.len(), list.join("; "))?;
            if let Some(v) = &self.nccl_version {
                write!(f, ", NCCL {v}")?;
            }
        }
        if let Some(p) = &self.problem {
            // Keep the report on one line whatever the message holds.
            write!(f, " ({})", p.replace('\n', " "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_one_line_and_say_why_there_are_no_gpus() {
        let r = DeviceReport::probe();
        let line = r.to_string();
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(line.starts_with("local devices: "), "{line}");
        if r.gpus.is_empty() {
            assert!(line.contains("CPU only") && r.problem.is_some(), "{line}");
            assert!(!r.nccl_usable());
        }
        #[cfg(not(feature = "cuda"))]
        assert!(line.contains("--features cuda"), "{line}");

        let gpus = DeviceReport {
            cuda_support: true,
            gpus: vec![
                GpuInfo {
                    ordinal: 0,
                    name: "NVIDIA H200".into(),
                    memory_bytes: 141 << 30,
                },
                GpuInfo {
                    ordinal: 1,
                    name: "NVIDIA H200".into(),
                    memory_bytes: 141 << 30,
                },
            ],
            nccl_version: Some("2.21.5".into()),
            problem: None,
        };
        assert_eq!(
            gpus.to_string(),
            "local devices: 2 GPUs (0: NVIDIA H200, 141.0 GiB; 1: NVIDIA H200, 141.0 GiB), NCCL 2.21.5"
        );
        assert!(gpus.nccl_usable());
    }
}
