//! The guard around each execution: a panic is caught and its message kept; an
//! allocation over the cap and an execution over the time limit save the input and end
//! the process with their own exit codes (checked in a child process, since they must
//! end it).

use std::process::Command;
use std::time::Duration;

use pipewright_fuzz::guard::{self, Outcome, EXIT_ALLOC, EXIT_HANG};

const CHILD: &str = "PIPEWRIGHT_FUZZ_GUARD_CHILD";

#[test]
fn a_panic_is_caught_with_its_message() {
    guard::install(Duration::from_secs(10));
    let dir = std::env::temp_dir().join("pipewright-fuzz-guard-panic");
    match guard::execute("test", &dir, b"abc", |d| if d.len() == 3 { panic!("three bytes") } else { Ok(()) }) {
        Outcome::Panicked(m) => assert!(m.contains("three bytes"), "{m}"),
        _ => panic!("the panic was not caught"),
    }
    assert!(matches!(guard::execute("test", &dir, b"ab", |_| Err("no".into())), Outcome::Refused(m) if m == "no"));
}

/// Runs one of the child cases below in a fresh process of this test binary.
fn child(case: &str, dir: &std::path::Path) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_case", "--nocapture", "--test-threads", "1"])
        .env(CHILD, case)
        .env("CRASH_DIR", dir)
        .output()
        .unwrap()
}

#[test]
fn child_case() {
    let Ok(case) = std::env::var(CHILD) else { return };
    let dir = std::path::PathBuf::from(std::env::var("CRASH_DIR").unwrap());
    // A short limit only for the hang: the allocation report prints a symbolised backtrace,
    // which on a loaded machine took longer than 200 ms and was then reported as a hang.
    guard::install(Duration::from_millis(if case == "hang" { 200 } else { 20_000 }));
    guard::set_alloc_cap(64 << 20);
    match case.as_str() {
        "alloc" => {
            guard::execute("bomb", &dir, b"bomb-input", |_| {
                let v: Vec<u8> = Vec::with_capacity(std::hint::black_box(1 << 40));
                Err(format!("{}", std::hint::black_box(v).capacity()))
            });
        }
        "hang" => {
            guard::execute("sleepy", &dir, b"hang-input", |_| {
                std::thread::sleep(Duration::from_secs(30));
                Ok(())
            });
        }
        _ => unreachable!(),
    }
    // Reaching here means the guard let it through.
    std::process::exit(0);
}

#[test]
fn an_allocation_bomb_and_a_hang_are_saved_and_reported() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    for (case, target, code, input) in [("alloc", "bomb", EXIT_ALLOC, &b"bomb-input"[..]), ("hang", "sleepy", EXIT_HANG, b"hang-input")] {
        let dir = std::env::temp_dir().join(format!("pipewright-fuzz-guard-{case}-{}", std::process::id()));
        let out = child(case, &dir);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{case}: {stderr}");
        let saved = dir.join(format!("{target}-{:016x}.bin", guard::hash(input)));
        assert_eq!(std::fs::read(&saved).unwrap(), input, "{case}: {stderr}");
        assert!(stderr.contains(&saved.display().to_string()), "{case}: {stderr}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
