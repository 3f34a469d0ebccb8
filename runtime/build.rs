// Build script: bakes libtorch's `lib/` into this package's binaries and tests as an rpath,
// so they run without `LD_LIBRARY_PATH`. (Plain `//` comments: the CLI's build.rs
// `include!`s this file, where inner doc comments do not compile.)
//
// It follows torch-sys's choice of libtorch:
// - `LIBTORCH_USE_PYTORCH` set: the Python PyTorch install (its `torch/lib`, asked of
//   `python3`, or `python` inside a virtualenv, like torch-sys);
// - otherwise `LIBTORCH_LIB` or `LIBTORCH` (`<dir>/lib`). `LIBTORCH` normally comes from
//   `.cargo/config.toml`, which points it at the `.libtorch` link that
//   `scripts/libtorch.sh` creates at the repository root; a user's own `LIBTORCH` wins.
//   The path is canonicalised so the rpath names the real directory, not the link, and
//   installed binaries keep working wherever they are copied.
//
// `cargo:rustc-link-arg` applies only to this package's own targets (tests, examples,
// benches, bins), never to dependents: every package that links tch into a binary needs
// this build script too (the CLI `include!`s it), and a `torch` feature of its own, since
// the script only acts when `CARGO_FEATURE_TORCH` is set.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    for var in [
        "LIBTORCH",
        "LIBTORCH_LIB",
        "LIBTORCH_USE_PYTORCH",
        "VIRTUAL_ENV",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_TORCH").is_none() {
        return;
    }
    if env::var_os("LIBTORCH_USE_PYTORCH").is_some() {
        return pytorch_rpath();
    }
    let dir = env::var("LIBTORCH_LIB")
        .or_else(|_| env::var("LIBTORCH"))
        .unwrap_or_default();
    if dir.is_empty() {
        fail("LIBTORCH is not set");
    }
    let real = match Path::new(&dir).canonicalize() {
        Ok(p) => p,
        Err(e) => fail(&format!("LIBTORCH={dir} cannot be resolved ({e})")),
    };
    emit_rpath(&real.join("lib"));
}

fn emit_rpath(lib: &Path) {
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

/// The `torch/lib` of the Python PyTorch install; a warning (no rpath) when Python fails.
fn pytorch_rpath() {
    let python = if env::var_os("VIRTUAL_ENV").is_some() {
        "python"
    } else {
        "python3"
    };
    let script = "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))";
    let out = Command::new(python).args(["-c", script]).output();
    let lib = out
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match lib.map(PathBuf::from).and_then(|p| p.canonicalize().ok()) {
        Some(lib) => emit_rpath(&lib),
        None => println!(
            "cargo:warning=LIBTORCH_USE_PYTORCH is set but `{python}` could not locate torch/lib; \
             set LD_LIBRARY_PATH to it before running"
        ),
    }
}

fn fail(why: &str) -> ! {
    eprintln!(
        "error: {why}. The `torch` feature needs libtorch 2.11.0: run `scripts/libtorch.sh` \
         (it assembles libtorch and links it as `.libtorch` at the repository root, which \
         .cargo/config.toml points LIBTORCH at), set LIBTORCH to your own libtorch, set \
         LIBTORCH_USE_PYTORCH=1 to use a Python PyTorch install, or build with \
         --no-default-features."
    );
    std::process::exit(1);
}
