//! Stopping a run early at a step boundary every worker agrees on (Ctrl-C, a `SIGTERM`,
//! `SIGUSR1` to an MPI job, or the caller): every worker ends right after the same
//! optimizer step, with every weight version, optimizer state and running statistic of
//! that step, so the run can be checkpointed there and resumed as if it had not stopped.
//!
//! The first stage decides, in-band. Before it begins a step `s` (its first forward of
//! `s`, which in every schedule is a stage's first op of the step) it looks at the
//! request; the first stages of the replicas agree on it (a sum over them), and if asked,
//! each sends a stop marker to the next stage in place of step `s`'s first activations.
//! Every later stage meets the marker exactly where it would have received those
//! activations, passes it on, and from then on skips every op of step `s` and beyond. Any
//! schedule is valid cut after a step (a stage's ops up to step `s - 1` depend only on the
//! others' ops up to step `s - 1`), no message of step `s` is ever sent, and the decision
//! needs no extra message between processes: it works alike for threads and MPI ranks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// The request to stop and where the run stopped ([`crate::pipeline::TrainConfig::stop`]).
#[derive(Debug, Default)]
pub struct StopGate {
    asked: AtomicBool,
    /// The last step (from 0) the run completed before stopping, once a first stage
    /// decided (or a later stage met the marker).
    stopped_after: Mutex<Option<u64>>,
}

impl StopGate {
    pub fn new() -> StopGate {
        StopGate::default()
    }

    /// Asks the run to stop before the next step the first stage begins (after the first
    /// step, if none has completed). Safe in a signal watcher; a second request changes
    /// nothing.
    pub fn request(&self) {
        self.asked.store(true, Ordering::SeqCst);
    }

    /// Whether a stop was asked for.
    pub fn requested(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }

    /// The last step (from 0) of a run that stopped early.
    pub fn stop_after(&self) -> Option<u64> {
        *self.lock()
    }

    /// A worker learnt that the run stops before step `next` (which is never the first).
    pub(crate) fn stopped_before(&self, next: u64) {
        let mut g = self.lock();
        g.get_or_insert(next.saturating_sub(1));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        // The gate holds one number; a worker that panicked holding it left it whole.
        self.stopped_after.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_remembered_and_the_first_decision_stands() {
        let gate = StopGate::new();
        assert!(!gate.requested() && gate.stop_after().is_none());
        gate.request();
        gate.request();
        assert!(gate.requested());
        gate.stopped_before(3);
        gate.stopped_before(5);
        assert_eq!(gate.stop_after(), Some(2), "every worker stops before the same step");
    }
}
