//! `pipewright doctor` and the loading of libtorch's CUDA libraries: the libtorch the
//! binary runs against is reported as it is (a CPU-only one as such; a CUDA one with its
//! libraries loaded and its devices, or none on a machine without a GPU), and a libtorch
//! folder whose CUDA libraries cannot be loaded is named in the error `--device cuda` gives.
#![cfg(feature = "torch")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{command, corpus, fails, ok, pw_ok};
use pipewright_runtime::device::{load_cuda, CudaLibs};

/// `pipewright ARGS` against the libtorch in `lib`: the binary's rpath is a RUNPATH, so
/// `LD_LIBRARY_PATH` wins.
fn with_libtorch(lib: &Path, args: &[&str]) -> Output {
    command().args(args).env("LD_LIBRARY_PATH", lib).output().expect("runs pipewright")
}

/// The line of `report` that starts with `prefix`.
fn line<'a>(report: &'a str, prefix: &str) -> &'a str {
    report.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix:?} line in:\n{report}"))
}

/// The folder of the libtorch the binary runs against, from its own report.
fn libtorch_lib(report: &str) -> PathBuf {
    PathBuf::from(line(report, "libtorch: ").rsplit(" at ").next().expect("a folder"))
}

/// What the binary's report must say about CUDA is what this test process finds: it runs
/// against the same libtorch (the same rpath) and loads its CUDA libraries as `doctor`
/// does.
#[test]
fn doctor_reports_the_libtorch_in_use() {
    let text = pw_ok(["doctor"]);
    let lib = libtorch_lib(&text);
    assert!(lib.join("libtorch_cpu.so").exists(), "{text}");
    assert!(line(&text, "libtorch: ").starts_with("libtorch: 2.11.0"), "{text}");
    assert!(text.contains("\nbuilt for: libtorch 2.11.0 (tch 0.24)\n"), "{text}");
    assert!(text.contains("\ndevices:\n  cpu: "), "{text}");
    let libs = line(&text, "CUDA libraries: ");
    let available = line(&text, "CUDA available: ");
    let gpus: Vec<&str> = text.lines().filter(|l| l.starts_with("  cuda:")).collect();
    let no_cuda = "CUDA available: no (CPU only: train and run with --device cpu)";
    match load_cuda() {
        CudaLibs::Absent(dir) => {
            // A CPU-only libtorch (this machine's): no CUDA libraries, no CUDA device.
            assert_eq!(dir, &lib);
            assert!(!lib.join("libtorch_cuda.so").exists());
            assert_eq!(libs, format!("CUDA libraries: not present in {} (a CPU-only libtorch)", lib.display()), "{text}");
            assert_eq!(available, no_cuda, "{text}");
            assert!(gpus.is_empty(), "{text}");
        }
        CudaLibs::Loaded(dir) => {
            // A CUDA libtorch: both libraries loaded from its folder, and every device
            // libtorch reaches listed with its memory; on a machine without a GPU, none.
            assert_eq!(dir, &lib);
            assert_eq!(libs, format!("CUDA libraries: loaded from {}", lib.display()), "{text}");
            let count = if tch::Cuda::is_available() { tch::Cuda::device_count() } else { 0 };
            if count > 0 {
                assert_eq!(available, format!("CUDA available: yes, {count} device(s)"), "{text}");
                assert_eq!(gpus.len(), count as usize, "{text}");
                for (k, g) in gpus.iter().enumerate() {
                    assert!(g.starts_with(&format!("  cuda:{k}: ")) && g.contains(" total, ") && g.ends_with(" free"), "{text}");
                }
            } else {
                assert_eq!(available, no_cuda, "{text}");
                assert!(gpus.is_empty(), "{text}");
            }
        }
        CudaLibs::Failed { path, message } => {
            // A CUDA libtorch whose libraries do not load (a CUDA dependency missing, say):
            // the file and the loader's complaint are named, and CUDA is not available.
            assert!([lib.join("libc10_cuda.so"), lib.join("libtorch_cuda.so")].contains(path), "{path:?}");
            assert_eq!(libs, format!("CUDA libraries: {} could not be loaded: {message}", path.display()), "{text}");
            assert_eq!(available, no_cuda, "{text}");
            assert!(gpus.is_empty(), "{text}");
        }
        CudaLibs::NoLibtorch => panic!("this test process's libtorch_cpu.so was not found; the binary's is {}", lib.display()),
    }
}

/// A libtorch folder (hard links to the real one) whose `libc10_cuda.so` and
/// `libtorch_cuda.so` are not libraries: `doctor` and `--device cuda` name the file and
/// the loader's complaint instead of a bare "no CUDA device".
#[test]
fn unloadable_cuda_libraries_are_named() {
    let real = libtorch_lib(&pw_ok(["doctor"]));
    let dir = tempfile::tempdir().expect("temp dir");
    let lib = dir.path().join("libtorch-9.9.9/lib");
    std::fs::create_dir_all(&lib).unwrap();
    let broken = ["libc10_cuda.so", "libtorch_cuda.so"];
    for e in std::fs::read_dir(&real).unwrap() {
        let e = e.unwrap();
        // Not the two written below: a hard link to a CUDA libtorch's own would be
        // overwritten through the link.
        if broken.iter().any(|b| e.file_name() == *b) {
            continue;
        }
        let to = lib.join(e.file_name());
        if e.file_type().unwrap().is_file() && std::fs::hard_link(e.path(), &to).is_err() {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
    for name in broken {
        std::fs::write(lib.join(name), "not a library").unwrap();
    }
    let text = ok(&with_libtorch(&lib, &["doctor"]));
    assert!(text.contains(&format!("libtorch: 9.9.9 at {}", lib.display())), "{text}");
    let c10 = lib.join("libc10_cuda.so");
    assert!(text.contains(&format!("CUDA libraries: {} could not be loaded: ", c10.display())), "{text}");
    let models = corpus().join("models");
    let (model, inputs) = (models.join("mlp.onnx"), models.join("mlp.inputs"));
    let out = with_libtorch(&lib, &["run-forward", model.to_str().unwrap(), "--inputs", inputs.to_str().unwrap(), "--device", "cuda"]);
    fails(&out, &["CUDA device cuda:0 requested but libtorch's CUDA libraries: ", &format!("{} could not be loaded: ", c10.display())]);
}
