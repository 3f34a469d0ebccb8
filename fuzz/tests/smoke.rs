//! The CI fuzz smoke run: 2,000 executions per target from the committed seeds. Every
//! target must run them all with no panic (a hang or an allocation bomb would end this
//! process with the guard's exit code and fail the test), and its mutants must reach both
//! outcomes: some accepted, most refused with an error.

use pipewright_fuzz::{run, Options, Target};

#[test]
fn every_target_survives_2000_mutated_inputs() {
    let crashes = std::env::temp_dir().join(format!("pipewright-fuzz-smoke-{}", std::process::id()));
    for target in Target::ALL {
        let mut opts = Options::new(target);
        opts.runs = 2_000;
        opts.seed = 11;
        opts.crash_dir = crashes.clone();
        let report = run(&opts).unwrap_or_else(|e| panic!("{target}: {e}"));
        eprintln!("{report}");
        assert_eq!(report.execs, 2_000, "{report}");
        assert!(report.crashes.is_empty(), "{target}: {:?}", report.crashes);
        assert!(report.accepted >= 1, "{target}: no input accepted (are the seeds valid?): {report}");
        assert!(report.refused >= 1_000, "{target}: the mutants are hardly ever refused: {report}");
        assert!(report.corpus > report.seeds, "{target}: no mutant reached a new error: {report}");
    }
    let _ = std::fs::remove_dir_all(&crashes);
}
