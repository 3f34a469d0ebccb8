//! `pipewright doctor`: what this process found of libtorch and the devices it can reach,
//! for bug reports and for checking a GPU machine before training on it.

use std::fmt;
use std::path::PathBuf;

use pipewright_core::units::human_bytes;
use pipewright_runtime::device::{cuda_devices, libtorch_dir, libtorch_version, load_cuda, CudaLibs, GpuInfo};

/// The libtorch tch 0.24 is built for.
pub const EXPECTED_LIBTORCH: &str = "2.11.0";

/// What was found.
#[derive(Clone, Debug)]
pub struct Doctor {
    pub libtorch_dir: Option<PathBuf>,
    pub libtorch_version: Option<String>,
    pub cuda_libs: CudaLibs,
    pub cuda_available: bool,
    /// CUDA devices with their memory, or why they could not be listed.
    pub gpus: Result<Vec<GpuInfo>, String>,
    pub cpu_threads: i32,
    /// The machine's memory (`MemTotal` of /proc/meminfo), when readable.
    pub host_memory: Option<u64>,
}

/// Looks (loading libtorch's CUDA libraries when they are there, as `--device cuda` does).
pub fn doctor() -> Doctor {
    let dir = libtorch_dir();
    let cuda_libs = load_cuda().clone();
    Doctor {
        libtorch_version: dir.as_deref().and_then(libtorch_version),
        libtorch_dir: dir,
        cuda_libs,
        cuda_available: tch::Cuda::is_available(),
        gpus: cuda_devices(),
        cpu_threads: tch::get_num_threads(),
        host_memory: host_memory(),
    }
}

fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

impl fmt::Display for Doctor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.libtorch_dir {
            Some(dir) => writeln!(f, "libtorch: {} at {}", self.libtorch_version.as_deref().unwrap_or("version unknown"), dir.display())?,
            None => writeln!(f, "libtorch: libtorch_cpu.so not found in this process's mappings")?,
        }
        writeln!(f, "built for: libtorch {EXPECTED_LIBTORCH} (tch 0.24)")?;
        writeln!(f, "CUDA libraries: {}", self.cuda_libs)?;
        match (&self.gpus, self.cuda_available) {
            (_, false) => writeln!(f, "CUDA available: no (CPU only: train and run with --device cpu)")?,
            (Ok(gpus), true) => writeln!(f, "CUDA available: yes, {} device(s)", gpus.len())?,
            (Err(e), true) => writeln!(f, "CUDA available: yes, but listing devices failed: {e}")?,
        }
        writeln!(f, "devices:")?;
        let mem = self.host_memory.map_or_else(|| "memory unknown".to_string(), |m| format!("{} memory", human_bytes(m)));
        writeln!(f, "  cpu: {} threads, {mem}", self.cpu_threads)?;
        if let Ok(gpus) = &self.gpus {
            for g in gpus {
                writeln!(f, "  cuda:{}: {} total, {} free", g.index, human_bytes(g.total_bytes), human_bytes(g.free_bytes))?;
            }
        }
        Ok(())
    }
}
