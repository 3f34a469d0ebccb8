//! Every input the fuzzer ever found a crash with (`fuzz/crashes/TARGET-HASH.bin`) is
//! replayed through its target under the same guard: it must now be refused cleanly or
//! accepted, never panic, and never trip the allocation cap or the time limit (either
//! would end this test process with the guard's exit code).

use std::time::Duration;

use pipewright_fuzz::guard::{self, Outcome};
use pipewright_fuzz::{Context, Target};

#[test]
fn every_saved_crash_is_now_a_clean_outcome() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let ctx = Context::new(&root.join("seeds")).unwrap();
    guard::install(Duration::from_secs(10));
    guard::set_alloc_cap(512 << 20);
    let scratch = std::env::temp_dir().join(format!("pipewright-fuzz-regressions-{}", std::process::id()));
    let mut files: Vec<_> = std::fs::read_dir(root.join("crashes")).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let mut seen = 0;
    for f in files.iter().filter(|f| f.extension().is_some_and(|e| e == "bin")) {
        let stem = f.file_stem().unwrap().to_str().unwrap();
        let (name, _hash) = stem.rsplit_once('-').unwrap();
        let target = Target::from_name(name).unwrap_or_else(|| panic!("{}: no target `{name}`", f.display()));
        let input = std::fs::read(f).unwrap();
        match guard::execute(target.name(), &scratch, &input, |d| ctx.execute(target, d)) {
            Outcome::Panicked(m) => panic!("{}: still panics: {m}", f.display()),
            Outcome::Accepted => eprintln!("{}: accepted", f.display()),
            Outcome::Refused(m) => eprintln!("{}: refused: {m}", f.display()),
        }
        seen += 1;
    }
    assert!(seen >= 2, "the saved crashes are missing from {}", root.join("crashes").display());
    let _ = std::fs::remove_dir_all(&scratch);
}

/// The findings refused with the error that names their cause.
#[test]
fn the_findings_get_specific_errors() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let ctx = Context::new(&root.join("seeds")).unwrap();
    let findings = [
        (Target::Onnx, "onnx-5a83703e471492ca.bin", "num_outputs 2147483647 does not match the node's 3 outputs"),
        (Target::Onnx, "onnx-d813efc48b2a0a0c.bin", "scans 1099511627776 rows of 3 steps"),
        (Target::Onnx, "onnx-882de7f86be74da4.bin", "2147483648 query heads is more than the 65536 supported"),
        (Target::Onnx, "onnx-62712179e91b4069.bin", "hidden_size 9223372036854775807 is out of range"),
        (Target::Onnx, "onnx-f7288aae93418f8f.bin", "the product of the extents [9223372036854775807,2,1] overflows"),
        (Target::Npy, "npy-099c2c0f26a45e3c.bin", "shape [18446744073709551615] of <i4 needs more than 2^64 bytes"),
        (Target::Npz, "npz-4c186d6fedd882c1.bin", "member `input.npy`"),
    ];
    for (target, file, cause) in findings {
        let bytes = std::fs::read(root.join("crashes").join(file)).unwrap_or_else(|e| panic!("crashes/{file}: {e}"));
        let e = ctx.execute(target, &bytes).unwrap_err();
        assert!(e.contains(cause), "{file}: {e}");
    }
}
