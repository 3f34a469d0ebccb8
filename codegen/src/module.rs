//! Writing stage modules: one self-contained file per pipeline stage (header, program as
//! JSON, weights as safetensors; see `docs/module-format.md`).
//!
//! The byte encoding is the runtime's [`pipewright_runtime::module::encode`], next to its
//! reader, so writer and reader cannot drift; this module adds the atomic file write.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use pipewright_runtime::module::encode;
pub use pipewright_runtime::module::{
    ModuleError, ModuleErrorKind, ModuleHeader, Recompute, Schedule, StageParams, FORMAT_VERSION,
};
use pipewright_runtime::program::Program;

/// The bytes of a stage module for `program`.
pub fn encode_module(params: &StageParams, program: &Program) -> Result<Vec<u8>, ModuleError> {
    encode(params, program)
}

/// Writes a stage module to `path` atomically: the bytes go to a temporary file in the same
/// folder, which is flushed to disk and then renamed over `path`. On any error the
/// temporary file is removed and `path` is untouched. Errors name `path`.
pub fn write_module(path: impl AsRef<Path>, params: &StageParams, program: &Program) -> Result<(), ModuleError> {
    let path = path.as_ref();
    let bytes = encode_module(params, program).map_err(|e| e.at(path))?;
    write_atomically(path, &bytes).map_err(|(op, source)| ModuleError::new(ModuleErrorKind::Io { op, source }).at(path))
}

type IoResult<T> = Result<T, (&'static str, std::io::Error)>;

fn write_atomically(path: &Path, bytes: &[u8]) -> IoResult<()> {
    let name = path
        .file_name()
        .ok_or(("write the file", std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (tmp, file) = create_temp(&dir, &name.to_string_lossy())?;
    let result = fill(file, bytes).and_then(|()| fs::rename(&tmp, path).map_err(|e| ("rename the temporary file into place", e)));
    match result {
        Ok(()) => {
            // Make the rename itself durable; best effort (not all platforms allow it).
            if let Ok(d) = File::open(&dir) {
                let _ = d.sync_all();
            }
            Ok(())
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// A new, exclusively created `.NAME.PID.N.tmp` next to the target.
fn create_temp(dir: &Path, name: &str) -> IoResult<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(("create a temporary file next to it", e)),
        }
    }
}

fn fill(mut file: File, bytes: &[u8]) -> IoResult<()> {
    file.write_all(bytes).map_err(|e| ("write the temporary file", e))?;
    file.sync_all().map_err(|e| ("flush the temporary file to disk", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipewright_runtime::module::read_module;

    const PARAMS: StageParams = StageParams { stage: 0, depth: 2, schedule: Schedule::Flush, recompute: Recompute::None };

    fn temp_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("pw-module-test-{}-{}", std::process::id(), line!()));
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    #[test]
    fn writes_atomically_and_reads_back() {
        let dir = temp_dir().join("ok");
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("stage0.pwm");
        let p = Program::default();
        write_module(&path, &PARAMS, &p).unwrap();
        write_module(&path, &PARAMS, &p).unwrap(); // replaces an existing file
        let m = read_module(&path).unwrap();
        assert_eq!(m.header.params, PARAMS);
        assert_eq!(m.program, p);
        assert!(leftovers(&dir).is_empty());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn failed_write_leaves_nothing() {
        let dir = temp_dir().join("fail");
        fs::create_dir_all(&dir).unwrap();
        // The target is a non-empty directory, so the rename fails.
        let path = dir.join("stage0.pwm");
        fs::create_dir_all(path.join("occupied")).unwrap();
        let e = write_module(&path, &PARAMS, &Program::default()).unwrap_err();
        assert!(matches!(e.kind, ModuleErrorKind::Io { .. }), "{e}");
        assert!(e.to_string().contains("stage0.pwm"), "{e}");
        assert!(leftovers(&dir).is_empty());
        fs::remove_dir_all(&dir).unwrap();
    }
}
