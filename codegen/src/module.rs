//! Writing stage modules: one self-contained file per pipeline stage (header, program as
//! JSON, weights as safetensors; see `docs/module-format.md`).
//!
//! The byte encoding is the runtime's [`pipewright_runtime::module::encode`], next to its
//! reader, so writer and reader cannot drift; this module adds the atomic file write.

use std::path::Path;

use pipewright_core::fs::write_atomic;
use pipewright_runtime::module::encode;
pub use pipewright_runtime::module::{ModuleError, ModuleErrorKind, ModuleHeader, StageParams, FORMAT_VERSION};
use pipewright_runtime::program::Program;

/// Writes a stage module to `path` atomically (`pipewright_core::fs::write_atomic`): on
/// any error `path` is untouched and no temporary file is left. Errors name `path`.
pub fn write_module(path: impl AsRef<Path>, params: &StageParams, program: &Program) -> Result<(), ModuleError> {
    let path = path.as_ref();
    let bytes = encode(params, program).map_err(|e| e.at(path))?;
    write_atomic(path, &bytes).map_err(|e| ModuleError::new(ModuleErrorKind::Io { op: e.op, source: e.source }).at(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipewright_core::{Recompute, Schedule};
    use pipewright_runtime::module::read_module;

    const PARAMS: StageParams = StageParams { stage: 0, depth: 2, schedule: Schedule::Flush, recompute: Recompute::None };

    #[test]
    fn writes_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stage0.pwm");
        let p = Program::default();
        write_module(&path, &PARAMS, &p).unwrap();
        write_module(&path, &PARAMS, &p).unwrap(); // replaces an existing file
        let m = read_module(&path).unwrap();
        assert_eq!(m.header.params, PARAMS);
        assert_eq!(m.program, p);
    }

    #[test]
    fn a_failed_write_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        // The target is a non-empty directory, so the rename fails.
        let path = dir.path().join("stage0.pwm");
        std::fs::create_dir_all(path.join("occupied")).unwrap();
        let e = write_module(&path, &PARAMS, &Program::default()).unwrap_err();
        assert!(matches!(e.kind, ModuleErrorKind::Io { .. }), "{e}");
        assert!(e.to_string().contains("stage0.pwm"), "{e}");
    }
}
