//! Helpers of the CLI integration tests: the in-memory ONNX model builder (shared with the
//! IR's tests) and running the `pipewright` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "../../ir/tests/common/onnx_builder.rs"]
mod onnx_builder;
#[allow(unused_imports)]
pub use onnx_builder::*;

/// The shared corpus (`../shared/corpus` from the workspace root).
pub fn corpus() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/corpus");
    assert!(root.is_dir(), "the shared corpus is missing: expected it at {}", root.display());
    root
}

/// Runs `pipewright` with `args`, with backtraces requested so a panic would show them.
pub fn pipewright(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run pipewright")
}

/// `pipewright inspect MODEL [extra...]`.
pub fn inspect(model: &Path, extra: &[&str]) -> Output {
    let mut args: Vec<&std::ffi::OsStr> = vec!["inspect".as_ref(), model.as_os_str()];
    args.extend(extra.iter().map(|s| std::ffi::OsStr::new(*s)));
    pipewright(&args)
}

/// Asserts a clean failure: non-zero exit, no stdout, and stderr is exactly one line
/// that starts with `error:`, names `file` and contains every one of `words`, with no
/// sign of a panic. Returns the line.
pub fn assert_clean_error(out: &Output, file: &Path, words: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "expected failure, got success; stdout:\n{stdout}\nstderr:\n{stderr}");
    for bad in ["panicked", "backtrace", "RUST_BACKTRACE"] {
        assert!(!stderr.contains(bad), "stderr shows a panic ({bad:?}):\n{stderr}");
    }
    let lines: Vec<&str> = stderr.trim_end().lines().collect();
    assert_eq!(lines.len(), 1, "stderr must be one line, got:\n{stderr}");
    let line = lines[0];
    assert!(line.starts_with("error: "), "stderr must start with \"error: \": {line}");
    let shown = file.display().to_string();
    assert!(line.contains(&shown), "stderr must name {shown}: {line}");
    for w in words {
        assert!(line.contains(w), "stderr must mention {w:?}: {line}");
    }
    assert!(stdout.is_empty(), "a failed run printed to stdout:\n{stdout}");
    line.to_string()
}
