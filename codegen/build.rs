// Codegen uses only the runtime's plain-data types, but `cargo test --workspace` unifies
// features: the CLI turns on the runtime's `torch` feature, so codegen's own test
// binaries then link libtorch too. Give them the same rpath as the runtime's targets when
// a libtorch is configured; without one there is nothing to link and nothing to do.
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=build.rs");
    if let Ok(dir) = std::env::var("LIBTORCH") {
        if let Ok(real) = Path::new(&dir).canonicalize() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", real.join("lib").display());
        }
    }
}
