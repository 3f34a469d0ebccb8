//! Helpers of the CLI integration tests: where the workspace and the shared corpus are,
//! running the `pipewright` binary, checking how a run ended, and the in-memory ONNX model
//! builder (shared with the IR's tests).
#![allow(dead_code)]

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "../../ir/tests/common/onnx_builder.rs"]
mod onnx_builder;
#[allow(unused_imports)]
pub use onnx_builder::*;

/// The workspace root (where `examples/`, `docs/` and `tests/data/` are).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The shared corpus (`../shared/corpus` from the workspace root).
pub fn corpus() -> PathBuf {
    let corpus = root().join("../shared/corpus");
    assert!(corpus.is_dir(), "the shared corpus is missing: expected it at {}", corpus.display());
    corpus
}

/// The shared model `NAME` (`corpus/models/NAME.onnx`).
pub fn model(name: &str) -> PathBuf {
    let p = corpus().join("models").join(format!("{name}.onnx"));
    assert!(p.is_file(), "the shared corpus is missing: expected {}", p.display());
    p
}

/// The `pipewright` binary as a command to add arguments to, with backtraces requested so
/// a panic would show them.
pub fn command() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.env("RUST_BACKTRACE", "1");
    c
}

/// Runs `pipewright ARGS` to its end.
pub fn pw<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    command().args(args).output().expect("runs pipewright")
}

/// Runs `pipewright ARGS`, which must succeed; returns its stdout. A failure panics with
/// the arguments, the exit status and what the run printed.
pub fn pw_ok<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<OsString> = args.into_iter().map(|a| a.as_ref().to_os_string()).collect();
    let out = pw(&args);
    if !out.status.success() {
        panic!("pipewright {args:?} failed ({}):\n{}", out.status, printed(&out));
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `pipewright ARGS`: `Ok(stdout)` when it succeeds, `Err(stderr)` when it fails or
/// panics (for tests that collect failures instead of stopping at the first).
pub fn try_pw<I, S>(args: I) -> Result<String, String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = pw(args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    if stderr.contains("panicked") {
        return Err(format!("panicked:\n{stderr}"));
    }
    if out.status.success() { Ok(stdout) } else { Err(stderr) }
}

/// Asserts that a run succeeded; returns its stdout. A failure panics with the exit
/// status and what the run printed.
pub fn ok(out: &Output) -> String {
    assert!(out.status.success(), "the run failed ({}):\n{}", out.status, printed(out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts that a run failed, without a panic, and that its stderr contains every one of
/// `words` (what the message must name: the file, node, stage or value, and the reason).
/// Returns the stderr.
pub fn fails(out: &Output, words: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected a failure naming {words:?}, got success:\n{}", printed(out));
    assert!(!stderr.contains("panicked"), "the run panicked:\n{stderr}");
    for w in words {
        assert!(stderr.contains(w), "stderr must mention {w:?}:\n{stderr}");
    }
    stderr
}

/// Asserts a clean failure: non-zero exit, no stdout, and stderr is exactly one line
/// that starts with `error:`, names `file` and contains every one of `words`, with no
/// sign of a panic. Returns the line.
pub fn assert_clean_error(out: &Output, file: &Path, words: &[&str]) -> String {
    let shown = file.display().to_string();
    let stderr = fails(out, &[&shown]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for bad in ["backtrace", "RUST_BACKTRACE"] {
        assert!(!stderr.contains(bad), "stderr shows a panic ({bad:?}):\n{stderr}");
    }
    let lines: Vec<&str> = stderr.trim_end().lines().collect();
    assert_eq!(lines.len(), 1, "stderr must be one line, got:\n{stderr}");
    let line = lines[0];
    assert!(line.starts_with("error: "), "stderr must start with \"error: \": {line}");
    for w in words {
        assert!(line.contains(w), "stderr must mention {w:?}: {line}");
    }
    assert!(stdout.is_empty(), "a failed run printed to stdout:\n{stdout}");
    line.to_string()
}

/// `pipewright inspect FILE [extra...]`, FILE a model or a stage module.
pub fn inspect(file: &Path, extra: &[&str]) -> Output {
    let mut args: Vec<&OsStr> = vec!["inspect".as_ref(), file.as_os_str()];
    args.extend(extra.iter().map(OsStr::new));
    pw(&args)
}

/// What a run printed, for a failure's message.
fn printed(out: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// The Python with onnxruntime and numpy the tests use (`PIPEWRIGHT_PYTHON`, which
/// scripts/test.sh sets up); a test that needs it fails loudly without it.
pub fn python() -> String {
    std::env::var("PIPEWRIGHT_PYTHON").unwrap_or_else(|_| panic!("PIPEWRIGHT_PYTHON is not set: run the tests through scripts/test.sh (it sets up onnxruntime and numpy)"))
}
