//! The pass manager: runs named, typed passes in order — each takes the previous pass's
//! output and returns its own — and around each one times it, verifies its output (tests
//! and debug builds, or when asked), prints it (`--print-after`) and stops after it
//! (`--stop-after`).
//!
//! The passes of `pipewright compile` are [`PassName::ALL`] in order: `import`, `plan`,
//! `partition`, `recompute`, `weight-versioning` (this crate's `pipeline` module) and
//! `lower` (codegen). Every one of them does real work; printing and timing cover all of
//! them, the planner included.

use std::fmt::Write;
use std::time::{Duration, Instant};

use pipewright_core::{PassName, PrintAfter};

/// A pass's result: printable (`--print-after`) and checkable (the verifier).
pub trait PassOutput {
    /// The text `--print-after` shows for this pass.
    fn text(&self) -> String;
    /// Checks the result (the IR verifier, stage tables); one message per problem.
    fn check(&self) -> Result<(), Vec<String>> {
        Ok(())
    }
}

/// How a [`PassManager`] runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassOptions {
    pub print_after: PrintAfter,
    pub stop_after: Option<PassName>,
    /// Verify each pass's output; defaults to `cfg!(debug_assertions)`.
    pub verify: bool,
}

impl Default for PassOptions {
    fn default() -> PassOptions {
        PassOptions { print_after: PrintAfter::None, stop_after: None, verify: cfg!(debug_assertions) }
    }
}

/// A pass failed, or left an invalid result.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("pass {pass} failed: {source}")]
    Pass {
        pass: PassName,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("the result of pass {pass} is invalid: {}", .errors.join("; "))]
    Verify { pass: PassName, errors: Vec<String> },
    #[error("--{option} {pass}: this command runs only the passes {}", pipewright_core::words::spellings(.runs))]
    NotRun { option: &'static str, pass: PassName, runs: Vec<PassName> },
}

/// Runs passes and keeps what they printed and how long they took.
#[derive(Debug, Default)]
pub struct PassManager {
    opts: PassOptions,
    printed: String,
    timings: Vec<(PassName, Duration)>,
    stopped: bool,
}

impl PassManager {
    pub fn new(opts: PassOptions) -> PassManager {
        PassManager { opts, ..PassManager::default() }
    }

    /// Checks that `--print-after` and `--stop-after` name passes of `runs` (what the
    /// calling command runs).
    pub fn expect(&self, runs: &[PassName]) -> Result<(), ManagerError> {
        let named = [("print-after", match self.opts.print_after {
            PrintAfter::Pass(p) => Some(p),
            _ => None,
        }), ("stop-after", self.opts.stop_after)];
        for (option, pass) in named {
            if let Some(pass) = pass.filter(|p| !runs.contains(p)) {
                return Err(ManagerError::NotRun { option, pass, runs: runs.to_vec() });
            }
        }
        Ok(())
    }

    /// Runs `pass` on `input`: `None` (without running it) when an earlier pass was the
    /// `--stop-after` one.
    pub fn run<I, O, E>(&mut self, name: PassName, input: I, pass: impl FnOnce(I) -> Result<O, E>) -> Result<Option<O>, ManagerError>
    where
        O: PassOutput,
        E: std::error::Error + Send + Sync + 'static,
    {
        if self.stopped {
            return Ok(None);
        }
        let start = Instant::now();
        let result = pass(input);
        self.timings.push((name, start.elapsed()));
        let out = result.map_err(|e| ManagerError::Pass { pass: name, source: Box::new(e) })?;
        if self.opts.verify {
            out.check().map_err(|errors| ManagerError::Verify { pass: name, errors })?;
        }
        if matches!(self.opts.print_after, PrintAfter::All) || self.opts.print_after == PrintAfter::Pass(name) {
            let _ = writeln!(self.printed, "// ----- after {name} -----");
            self.printed.push_str(&out.text());
        }
        self.stopped = self.opts.stop_after == Some(name);
        Ok(Some(out))
    }

    /// Whether a `--stop-after` pass has run.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// What `--print-after` asked for, in pass order.
    pub fn printed(&self) -> &str {
        &self.printed
    }

    /// Each pass run and its wall time, in order.
    pub fn timings(&self) -> &[(PassName, Duration)] {
        &self.timings
    }

    /// One line per pass run with its wall time, then the total.
    pub fn timings_text(&self) -> String {
        let width = self.timings.iter().map(|t| t.0.name().len()).max().unwrap_or(0).max(5);
        let mut s = String::new();
        let mut total = Duration::ZERO;
        for (name, t) in &self.timings {
            total += *t;
            let _ = writeln!(s, "  {:<width$}  {:>10.3} ms", name.name(), t.as_secs_f64() * 1e3);
        }
        let _ = writeln!(s, "  {:<width$}  {:>10.3} ms", "total", total.as_secs_f64() * 1e3);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Out(&'static str);

    impl PassOutput for Out {
        fn text(&self) -> String {
            format!("{}\n", self.0)
        }
        fn check(&self) -> Result<(), Vec<String>> {
            if self.0 == "bad" { Err(vec!["bad output".into()]) } else { Ok(()) }
        }
    }

    fn ok(s: &'static str) -> impl FnOnce(()) -> Result<Out, std::io::Error> {
        move |()| Ok(Out(s))
    }

    #[test]
    fn prints_times_and_stops() {
        let opts = PassOptions { print_after: PrintAfter::All, stop_after: Some(PassName::Partition), verify: true };
        let mut pm = PassManager::new(opts);
        assert!(pm.run(PassName::Plan, (), ok("planned")).unwrap().is_some());
        assert!(pm.run(PassName::Partition, (), ok("cut")).unwrap().is_some());
        assert!(pm.stopped());
        assert!(pm.run(PassName::Recompute, (), ok("never")).unwrap().is_none());
        assert_eq!(pm.printed(), "// ----- after plan -----\nplanned\n// ----- after partition -----\ncut\n");
        assert_eq!(pm.timings().iter().map(|t| t.0).collect::<Vec<_>>(), [PassName::Plan, PassName::Partition]);
        assert!(pm.timings_text().contains("partition"));
    }

    #[test]
    fn verifies_and_names_the_failing_pass() {
        let mut pm = PassManager::new(PassOptions { verify: true, ..PassOptions::default() });
        let e = pm.run(PassName::Recompute, (), ok("bad")).unwrap_err();
        assert_eq!(e.to_string(), "the result of pass recompute is invalid: bad output");
        let e = pm.run(PassName::Lower, (), |()| Err::<Out, _>(std::io::Error::other("no room"))).unwrap_err();
        assert_eq!(e.to_string(), "pass lower failed: no room");
    }

    #[test]
    fn options_must_name_passes_the_command_runs() {
        let pm = PassManager::new(PassOptions { print_after: PrintAfter::Pass(PassName::Lower), ..PassOptions::default() });
        let e = pm.expect(&[PassName::Import, PassName::Plan, PassName::Partition]).unwrap_err();
        assert_eq!(e.to_string(), "--print-after lower: this command runs only the passes import, plan, partition");
    }
}
