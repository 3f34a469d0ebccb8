//! Stopping a run early, at a step boundary every worker agrees on (Ctrl-C, a `SIGTERM`,
//! or the caller): the embedded executor's workers end right after the same optimizer
//! step, with every weight version, optimizer state and running statistic of that step,
//! so the run can be checkpointed there and resumed as if it had not stopped.
//!
//! Workers complete step `t` at different times (the last stage first), and 2BW's first
//! stages have already begun the next step's forwards when the last finishes a step. A
//! request therefore picks the step after the newest one any worker has completed: no
//! worker has passed it, and every worker can reach it, as the schedule is valid up to
//! any step (each op before a worker's step `t` depends only on ops before the others'
//! step `t`). Messages a worker sends for microbatches beyond the stop may find their
//! receiver gone; those are dropped, not errors.

use std::sync::Mutex;

/// The agreement on where a run stops ([`crate::pipeline::TrainConfig::stop`]).
#[derive(Debug, Default)]
pub struct StopGate {
    state: Mutex<Gate>,
}

#[derive(Debug, Default)]
struct Gate {
    /// The newest step (from 0) any worker has completed.
    newest: Option<u64>,
    /// Asked to stop before any worker completed a step: the first to complete one decides.
    asked_early: bool,
    /// The step after which every worker stops, once decided.
    stop_after: Option<u64>,
}

impl StopGate {
    pub fn new() -> StopGate {
        StopGate::default()
    }

    /// Asks the run to stop after the step following the newest one any worker has
    /// completed (the first step, if none has). A second request changes nothing.
    pub fn request(&self) {
        let mut g = self.lock();
        match (g.stop_after, g.newest) {
            (Some(_), _) => {}
            (None, Some(t)) => g.stop_after = Some(t + 1),
            (None, None) => g.asked_early = true,
        }
    }

    /// Whether a stop was asked for.
    pub fn requested(&self) -> bool {
        let g = self.lock();
        g.asked_early || g.stop_after.is_some()
    }

    /// The step after which the run stops (from 0), once asked.
    pub fn stop_after(&self) -> Option<u64> {
        self.lock().stop_after
    }

    /// A worker completed step `t`: whether it stops here.
    pub(crate) fn completed(&self, t: u64) -> bool {
        let mut g = self.lock();
        g.newest = Some(g.newest.map_or(t, |n| n.max(t)));
        if g.asked_early && g.stop_after.is_none() {
            // Nobody had completed a step: this is the run's first, the same for all.
            g.stop_after = Some(t);
        }
        g.stop_after.is_some_and(|x| t >= x)
    }

    /// Whether step `t`'s work is beyond the stop (its messages may go unreceived).
    pub(crate) fn beyond(&self, t: u64) -> bool {
        self.lock().stop_after.is_some_and(|x| t > x)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Gate> {
        // The gate holds two numbers; a worker that panicked holding it left them whole.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_after_the_step_no_worker_has_passed() {
        let gate = StopGate::new();
        assert!(!gate.completed(0));
        assert!(!gate.completed(1)); // the last stage is ahead
        gate.request();
        assert_eq!(gate.stop_after(), Some(2));
        assert!(!gate.completed(1)); // the first stage catches up, and goes on
        assert!(gate.beyond(3) && !gate.beyond(2));
        assert!(gate.completed(2));
        gate.request();
        assert_eq!(gate.stop_after(), Some(2), "a second request changes nothing");
    }

    #[test]
    fn a_request_before_any_step_stops_after_the_first() {
        let gate = StopGate::new();
        gate.request();
        assert!(gate.requested() && gate.stop_after().is_none());
        assert!(!gate.beyond(5));
        assert!(gate.completed(5), "a resumed run's first step is 5");
        assert!(gate.completed(5) && gate.beyond(6) && !gate.beyond(5));
    }
}
