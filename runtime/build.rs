// Build script: bakes libtorch's `lib/` into this package's binaries and tests as an rpath,
// so they run without `LD_LIBRARY_PATH`.
//
// `LIBTORCH` normally comes from `.cargo/config.toml` (the `.libtorch` link that
// `scripts/libtorch.sh` creates at the repository root); a user's own `LIBTORCH` wins. The
// path is canonicalised so the rpath names the real directory, not the link, and installed
// binaries keep working wherever they are copied.
//
// `cargo:rustc-link-arg` applies only to this package's own targets (tests, examples,
// benches, bins), never to dependents: every package that links tch and produces a binary
// (e.g. the CLI) needs a copy of this build script.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_TORCH").is_none() {
        return;
    }
    match env::var("LIBTORCH") {
        Ok(dir) if !dir.is_empty() => emit_rpath(PathBuf::from(dir)),
        _ if env::var("LIBTORCH_USE_PYTORCH").as_deref() == Ok("1") => {}
        _ => fail("LIBTORCH is not set"),
    }
}

fn emit_rpath(dir: PathBuf) {
    let real = match dir.canonicalize() {
        Ok(p) => p,
        Err(e) => fail(&format!("LIBTORCH={} cannot be resolved ({e})", dir.display())),
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", real.join("lib").display());
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
