//! Reaching a [`Device`] (parsed and printed by `pipewright_core`) through libtorch.

use std::path::{Path, PathBuf};

pub use pipewright_core::Device;

/// A device libtorch cannot reach.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    #[error(
        "CUDA device {0} requested but no CUDA device is available \
         (libtorch built without CUDA or no GPU)"
    )]
    NoCuda(Device),
    #[error("CUDA device {device} requested but libtorch's CUDA libraries: {libs}")]
    CudaLibs { device: Device, libs: String },
    #[error("CUDA device {device} requested but only {count} CUDA device(s) are available")]
    OutOfRange { device: Device, count: i64 },
}

/// The tch device for `device`, after checking that libtorch can reach it.
#[cfg(feature = "torch")]
pub fn tch_device(device: Device) -> Result<tch::Device, DeviceError> {
    match device {
        Device::Cpu => Ok(tch::Device::Cpu),
        Device::Cuda(n) => {
            if let libs @ CudaLibs::Failed { .. } = load_cuda() {
                return Err(DeviceError::CudaLibs { device, libs: libs.to_string() });
            }
            if !tch::Cuda::is_available() {
                return Err(DeviceError::NoCuda(device));
            }
            let count = tch::Cuda::device_count();
            if n as i64 >= count {
                return Err(DeviceError::OutOfRange { device, count });
            }
            Ok(tch::Device::Cuda(n))
        }
    }
}

/// Where libtorch's CUDA libraries came from, or why they are not loaded.
///
/// The linker drops `libtorch_cuda.so` from the binary (nothing calls it by name), and
/// libtorch registers its CUDA backend only when that library is loaded: so before asking
/// libtorch for CUDA, [`load_cuda`] opens `libc10_cuda.so` and `libtorch_cuda.so` from the
/// folder of the `libtorch_cpu.so` this process runs against (found in `/proc/self/maps`),
/// with `RTLD_GLOBAL`. One binary then serves CPU-only machines (a CPU libtorch has no
/// such files: CUDA is simply not available) and GPU machines (a CUDA libtorch on the
/// library path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaLibs {
    /// Both libraries were loaded from this folder.
    Loaded(PathBuf),
    /// The libtorch folder has no `libtorch_cuda.so`: a CPU-only libtorch.
    Absent(PathBuf),
    /// A library is there but could not be loaded (a missing CUDA dependency, say).
    Failed { path: PathBuf, message: String },
    /// This process's `libtorch_cpu.so` could not be located.
    NoLibtorch,
}

impl std::fmt::Display for CudaLibs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaLibs::Loaded(dir) => write!(f, "loaded from {}", dir.display()),
            CudaLibs::Absent(dir) => write!(f, "not present in {} (a CPU-only libtorch)", dir.display()),
            CudaLibs::Failed { path, message } => write!(f, "{} could not be loaded: {message}", path.display()),
            CudaLibs::NoLibtorch => f.write_str("not loaded: this process's libtorch_cpu.so was not found in /proc/self/maps"),
        }
    }
}

/// The folder of the `libtorch_cpu.so` mapped into this process.
pub fn libtorch_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps_libtorch_dir(&maps)
}

/// The folder of `libtorch_cpu.so` in the text of a `/proc/PID/maps`.
fn maps_libtorch_dir(maps: &str) -> Option<PathBuf> {
    maps.lines().filter_map(|l| l.split_whitespace().nth(5)).map(Path::new).find(|p| p.file_name().is_some_and(|n| n == "libtorch_cpu.so")).and_then(|p| p.parent()).map(Path::to_path_buf)
}

/// libtorch's version as its folder records it: a pip install's `torch/version.py`, a
/// libtorch archive's `build-version`, or a folder named `libtorch-X.Y.Z...`
/// (`scripts/libtorch.sh`'s cache).
pub fn libtorch_version(lib: &Path) -> Option<String> {
    let root = lib.parent()?;
    if let Ok(text) = std::fs::read_to_string(root.join("version.py")) {
        let v = text.lines().find_map(|l| l.strip_prefix("__version__ = ")).map(|v| v.trim().trim_matches(|c| c == '\'' || c == '"').to_string());
        if v.is_some() {
            return v;
        }
    }
    if let Ok(text) = std::fs::read_to_string(root.join("build-version")) {
        return Some(text.trim().to_string());
    }
    let name = root.file_name()?.to_str()?;
    name.strip_prefix("libtorch-").map(str::to_string)
}

/// Loads libtorch's CUDA libraries once per process (see [`CudaLibs`]).
#[cfg(feature = "torch")]
pub fn load_cuda() -> &'static CudaLibs {
    static LOADED: std::sync::OnceLock<CudaLibs> = std::sync::OnceLock::new();
    LOADED.get_or_init(|| {
        let Some(dir) = libtorch_dir() else { return CudaLibs::NoLibtorch };
        if !dir.join("libtorch_cuda.so").exists() {
            return CudaLibs::Absent(dir);
        }
        for name in ["libc10_cuda.so", "libtorch_cuda.so"] {
            let path = dir.join(name);
            if let Err(message) = dlopen_global(&path) {
                return CudaLibs::Failed { path, message };
            }
        }
        CudaLibs::Loaded(dir)
    })
}

/// `dlopen(path, RTLD_NOW | RTLD_GLOBAL)`; the handle is kept for the process's life.
#[cfg(feature = "torch")]
fn dlopen_global(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| "the path holds a NUL byte".to_string())?;
    // SAFETY: `c` is a valid NUL-terminated string; dlerror's text is copied at once.
    unsafe {
        let handle = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        if handle.is_null() {
            let err = libc::dlerror();
            let message = if err.is_null() { "dlopen failed".to_string() } else { std::ffi::CStr::from_ptr(err).to_string_lossy().into_owned() };
            return Err(message);
        }
    }
    Ok(())
}

/// One CUDA device as the CUDA runtime libtorch loaded reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    pub index: usize,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// Free and total memory of each CUDA device, through the CUDA runtime libtorch itself
/// loaded (`cudaSetDevice`, `cudaMemGetInfo`, found with `dlsym`); empty when CUDA is not
/// available. Errors name the call that failed.
#[cfg(feature = "torch")]
pub fn cuda_devices() -> Result<Vec<GpuInfo>, String> {
    load_cuda();
    if !tch::Cuda::is_available() {
        return Ok(Vec::new());
    }
    type SetDevice = unsafe extern "C" fn(i32) -> i32;
    type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> i32;
    // SAFETY: the symbols are the CUDA runtime's, with these C signatures (cudaError_t is
    // an int enum); each is checked for null before the call.
    unsafe {
        let set = libc::dlsym(libc::RTLD_DEFAULT, c"cudaSetDevice".as_ptr());
        let info = libc::dlsym(libc::RTLD_DEFAULT, c"cudaMemGetInfo".as_ptr());
        if set.is_null() || info.is_null() {
            return Err("the CUDA runtime's cudaSetDevice/cudaMemGetInfo were not found in this process".into());
        }
        let (set, info) = (std::mem::transmute::<*mut libc::c_void, SetDevice>(set), std::mem::transmute::<*mut libc::c_void, MemGetInfo>(info));
        let mut out = Vec::new();
        for index in 0..tch::Cuda::device_count().max(0) as usize {
            let rc = set(index as i32);
            if rc != 0 {
                return Err(format!("cudaSetDevice({index}) returned error {rc}"));
            }
            let (mut free, mut total) = (0usize, 0usize);
            let rc = info(&mut free, &mut total);
            if rc != 0 {
                return Err(format!("cudaMemGetInfo on cuda:{index} returned error {rc}"));
            }
            out.push(GpuInfo { index, free_bytes: free as u64, total_bytes: total as u64 });
        }
        let _ = set(0);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_cuda_message() {
        let msg = DeviceError::NoCuda(Device::Cuda(0)).to_string();
        assert_eq!(
            msg,
            "CUDA device cuda:0 requested but no CUDA device is available \
             (libtorch built without CUDA or no GPU)"
        );
    }

    #[test]
    fn finds_libtorch_in_the_process_maps() {
        let maps = "7f00-7f01 r-xp 00000000 08:01 42  /opt/torch/lib/libtorch_cpu.so\n7f02-7f03 r--p 00000000 08:01 43  /usr/lib/libc.so.6\n";
        assert_eq!(maps_libtorch_dir(maps), Some(PathBuf::from("/opt/torch/lib")));
        assert_eq!(maps_libtorch_dir("7f02-7f03 r--p 00000000 08:01 43  /usr/lib/libtorch_cpu.so.bak\n"), None);
    }

    #[test]
    fn reads_the_version_libtorch_folders_record() {
        let dir = tempfile::tempdir().unwrap();
        let pip = dir.path().join("torch");
        std::fs::create_dir_all(pip.join("lib")).unwrap();
        std::fs::write(pip.join("version.py"), "from typing import Optional\n__version__ = '2.11.0+cu130'\n").unwrap();
        assert_eq!(libtorch_version(&pip.join("lib")).as_deref(), Some("2.11.0+cu130"));
        let archive = dir.path().join("libtorch");
        std::fs::create_dir_all(archive.join("lib")).unwrap();
        std::fs::write(archive.join("build-version"), "2.11.0+cpu\n").unwrap();
        assert_eq!(libtorch_version(&archive.join("lib")).as_deref(), Some("2.11.0+cpu"));
        let cache = dir.path().join("libtorch-2.11.0-cpu");
        std::fs::create_dir_all(cache.join("lib")).unwrap();
        assert_eq!(libtorch_version(&cache.join("lib")).as_deref(), Some("2.11.0-cpu"));
        let other = dir.path().join("elsewhere");
        std::fs::create_dir_all(other.join("lib")).unwrap();
        assert_eq!(libtorch_version(&other.join("lib")), None);
    }

    /// This process's libtorch: its folder is found, and asking for CUDA gives what that
    /// libtorch can do. A CPU-only libtorch (this machine's) has no CUDA libraries, and
    /// asking for CUDA says so without loading any. A CUDA libtorch's two libraries load
    /// from its folder, and `cuda:0` is reachable exactly when libtorch sees a device (each
    /// listed with its memory; past the last one the count is named); or a library that
    /// cannot be loaded is named in the error, file and loader message.
    #[cfg(feature = "torch")]
    #[test]
    fn cuda_requests_follow_the_libtorch_in_use() {
        let dir = libtorch_dir().expect("libtorch_cpu.so is mapped");
        assert!(dir.join("libtorch_cpu.so").exists());
        let cuda0 = Device::Cuda(0);
        match load_cuda() {
            CudaLibs::Absent(found) => {
                assert_eq!(found, &dir);
                assert!(!dir.join("libtorch_cuda.so").exists());
                assert_eq!(load_cuda().to_string(), format!("not present in {} (a CPU-only libtorch)", dir.display()));
                assert_eq!(tch_device(cuda0), Err(DeviceError::NoCuda(cuda0)));
                assert_eq!(cuda_devices(), Ok(Vec::new()));
            }
            CudaLibs::Loaded(found) => {
                assert_eq!(found, &dir);
                assert!(dir.join("libtorch_cuda.so").exists() && dir.join("libc10_cuda.so").exists());
                assert_eq!(load_cuda().to_string(), format!("loaded from {}", dir.display()));
                if tch::Cuda::is_available() {
                    let count = tch::Cuda::device_count();
                    assert!(count > 0);
                    assert_eq!(tch_device(cuda0), Ok(tch::Device::Cuda(0)));
                    let past = Device::Cuda(count as usize);
                    assert_eq!(tch_device(past), Err(DeviceError::OutOfRange { device: past, count }));
                    let gpus = cuda_devices().unwrap_or_else(|e| panic!("{e}"));
                    assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), (0..count as usize).collect::<Vec<_>>());
                    assert!(gpus.iter().all(|g| g.total_bytes > 0 && g.free_bytes <= g.total_bytes), "{gpus:?}");
                } else {
                    // A CUDA libtorch on a machine without a GPU.
                    assert_eq!(tch_device(cuda0), Err(DeviceError::NoCuda(cuda0)));
                    assert_eq!(cuda_devices(), Ok(Vec::new()));
                }
            }
            libs @ CudaLibs::Failed { path, message } => {
                // A CUDA libtorch whose libraries do not load (a CUDA dependency missing).
                assert!([dir.join("libc10_cuda.so"), dir.join("libtorch_cuda.so")].contains(path), "{libs}");
                assert!(!message.is_empty(), "{libs}");
                let e = tch_device(cuda0).unwrap_err();
                assert_eq!(e, DeviceError::CudaLibs { device: cuda0, libs: libs.to_string() });
                assert_eq!(e.to_string(), format!("CUDA device cuda:0 requested but libtorch's CUDA libraries: {} could not be loaded: {message}", path.display()));
            }
            CudaLibs::NoLibtorch => panic!("libtorch_cpu.so is mapped from {} but load_cuda did not find it", dir.display()),
        }
    }
}
