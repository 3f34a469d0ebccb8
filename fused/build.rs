// Compiles `src/fused.cpp` against the libtorch that torch-sys chose (its lib directory
// comes as DEP_TCH_LIBTORCH_LIB; the headers sit beside it in `include/`), with the same
// C++ standard and ABI flags as torch-sys's own wrapper, so the `at::Tensor`s that tch hands
// over are laid out as this code expects.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/fused.cpp");
    for var in [
        "DEP_TCH_LIBTORCH_LIB",
        "LIBTORCH_INCLUDE",
        "LIBTORCH_CXX11_ABI",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let lib = match env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(lib) => PathBuf::from(lib),
        Err(_) => {
            eprintln!("error: torch-sys did not report its libtorch (DEP_TCH_LIBTORCH_LIB); see scripts/libtorch.sh");
            std::process::exit(1);
        }
    };
    // torch-sys's rule: LIBTORCH_INCLUDE if set, else the directory above lib/.
    let root = env::var("LIBTORCH_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| lib.join(".."));
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("src/fused.cpp")
        .compile("pipewright_fused");
}
