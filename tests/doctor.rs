//! `pipewright doctor` and the loading of libtorch's CUDA libraries, on this CPU-only
//! machine: the CPU libtorch is reported as such, and a libtorch folder whose CUDA
//! libraries cannot be loaded is named in the error `--device cuda` gives.
#![cfg(feature = "torch")]

use std::path::{Path, PathBuf};
use std::process::Command;

fn pw(args: &[&str], lib: Option<&Path>) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.args(args);
    if let Some(lib) = lib {
        // The binary's rpath is a RUNPATH, so LD_LIBRARY_PATH wins.
        c.env("LD_LIBRARY_PATH", lib);
    }
    c.output().expect("runs pipewright")
}

/// The folder of the libtorch the binary runs against, from its own report.
fn libtorch_lib(report: &str) -> PathBuf {
    let line = report.lines().find(|l| l.starts_with("libtorch: ")).expect("a libtorch line");
    PathBuf::from(line.rsplit(" at ").next().expect("a folder"))
}

#[test]
fn doctor_reports_a_cpu_only_libtorch() {
    let out = pw(&["doctor"], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let lib = libtorch_lib(&text);
    assert!(lib.join("libtorch_cpu.so").exists(), "{text}");
    if lib.join("libtorch_cuda.so").exists() {
        return; // a CUDA libtorch: the CPU-only report does not apply
    }
    assert!(text.contains("2.11.0"), "{text}");
    assert!(text.contains("CUDA libraries: not present") && text.contains("CUDA available: no (CPU only"), "{text}");
    assert!(text.contains("  cpu: ") && !text.contains("cuda:0"), "{text}");
}

/// A libtorch folder (hard links to the real one) whose `libc10_cuda.so` and
/// `libtorch_cuda.so` are not libraries: `doctor` and `--device cuda` name the file and
/// the loader's complaint instead of a bare "no CUDA device".
#[test]
fn unloadable_cuda_libraries_are_named() {
    let out = pw(&["doctor"], None);
    let real = libtorch_lib(&String::from_utf8_lossy(&out.stdout));
    let dir = tempfile::tempdir().expect("temp dir");
    let lib = dir.path().join("libtorch-9.9.9/lib");
    std::fs::create_dir_all(&lib).unwrap();
    for e in std::fs::read_dir(&real).unwrap() {
        let e = e.unwrap();
        let to = lib.join(e.file_name());
        if e.file_type().unwrap().is_file() && std::fs::hard_link(e.path(), &to).is_err() {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
    for name in ["libc10_cuda.so", "libtorch_cuda.so"] {
        std::fs::write(lib.join(name), "not a library").unwrap();
    }
    let out = pw(&["doctor"], Some(&lib));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains(&format!("libtorch: 9.9.9 at {}", lib.display())), "{text}");
    assert!(text.contains("libc10_cuda.so could not be loaded"), "{text}");
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/corpus/models");
    let (model, inputs) = (models.join("mlp.onnx"), models.join("mlp.inputs"));
    let out = pw(&["run-forward", model.to_str().unwrap(), "--inputs", inputs.to_str().unwrap(), "--device", "cuda"], Some(&lib));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("libtorch's CUDA libraries") && err.contains("libc10_cuda.so"), "{err}");
}
