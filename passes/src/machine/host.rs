//! A CPU host's cores as the stages' threads share them: how its scheduler hands them out
//! ([`HostCores`]) and how much threads slow each other beyond their share ([`Crowding`]).

use serde::Serialize;

/// A CPU host's cores, which the stages' threads share, and how its scheduler shares them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct HostCores {
    pub cores: usize,
    /// The scheduler's time slice, seconds: a thread that has work but no core waits in
    /// line, and one that used up its slice while others wait goes to the back. 0: ideal
    /// processor sharing (every runnable thread at once, at `cores / threads` of a core).
    pub time_slice_s: f64,
    /// The scheduler's tick, seconds, on which turns end ([`HostCores::turn_end`]): Linux
    /// looks for a thread to preempt only on its tick, so a turn lasts from the slice up
    /// to a tick longer. 0: turns end at the slice itself (the tick unknown).
    pub tick_s: f64,
    /// How much slower a thread's work runs as threads crowd the host.
    pub crowding: Crowding,
}

impl HostCores {
    /// `cores` under Linux's default time slice ([`default_time_slice`]), as `simulate
    /// --host-cores` and the planner replay a CPU host.
    pub fn linux(cores: usize) -> HostCores {
        HostCores { cores, time_slice_s: default_time_slice(cores), tick_s: 0.0, crowding: Crowding::NONE }
    }

    /// `cores` shared ideally, for hand-computed cases.
    pub fn ideal(cores: usize) -> HostCores {
        HostCores { cores, time_slice_s: 0.0, tick_s: 0.0, crowding: Crowding::NONE }
    }

    /// The same host with threads slowing each other by `crowding` (what a profile
    /// measured, as the cost model's `crowding` reads it).
    pub fn crowded(self, crowding: Crowding) -> HostCores {
        HostCores { crowding, ..self }
    }

    /// The same host with its turns ending on a tick of `tick_s` seconds (what a profile
    /// measured, as the cost model's `tick` reads it).
    pub fn ticking(self, tick_s: f64) -> HostCores {
        HostCores { tick_s, ..self }
    }

    /// When a turn on a core that began at `start` ends: at the first tick (ticks at every
    /// multiple of `tick_s` from the replay's start) at least a slice after `start`, as a
    /// thread that has used up its slice is preempted on the next tick only; at the slice
    /// itself without a tick.
    pub fn turn_end(&self, start: f64) -> f64 {
        let earliest = start + self.time_slice_s;
        if self.tick_s > 0.0 {
            ((earliest / self.tick_s).ceil() * self.tick_s).max(earliest)
        } else {
            earliest
        }
    }

    /// The speed of a thread holding a core (or, under ideal sharing, its share of the
    /// cores) while `threads` threads have work.
    pub fn rate(&self, threads: usize) -> f64 {
        let share = if self.time_slice_s > 0.0 { 1.0 } else { (self.cores as f64 / threads.max(1) as f64).min(1.0) };
        share / self.crowding.slowdown(threads, self.cores)
    }
}

/// How much slower each thread's work runs while several have work on a host, beyond
/// their share of its cores: the caches and the memory bandwidth they share, the
/// scheduler's switches. Measured by `pipewright profile` with as many threads as cores
/// (`at_cores`) and twice as many (`at_twice`); 1 is none.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Crowding {
    pub at_cores: f64,
    pub at_twice: f64,
}

impl Crowding {
    pub const NONE: Crowding = Crowding { at_cores: 1.0, at_twice: 1.0 };

    /// With `threads` working on `cores` cores: 1 for one thread, linear from there to
    /// `at_cores` at `cores` threads and on to `at_twice` at twice as many; beyond that
    /// (not measured) `at_twice`.
    pub fn slowdown(&self, threads: usize, cores: usize) -> f64 {
        let (n, c) = (threads as f64, cores.max(1) as f64);
        if n <= 1.0 {
            1.0
        } else if n <= c {
            1.0 + (self.at_cores - 1.0) * (n - 1.0) / (c - 1.0)
        } else if n <= 2.0 * c {
            self.at_cores + (self.at_twice - self.at_cores) * (n - c) / c
        } else {
            self.at_twice
        }
    }

    /// Whether `threads` threads slow each other at all.
    pub fn slows(&self, threads: usize, cores: usize) -> bool {
        self.slowdown(threads, cores) != 1.0
    }
}

/// Linux's default time slice on `cores` CPUs (EEVDF's base slice, 0.75 ms, scaled by
/// `1 + log2(cores)` for up to 8 CPUs, as `sysctl_sched_base_slice` is by default): what a
/// thread woken while every core is busy may wait for.
pub fn default_time_slice(cores: usize) -> f64 {
    let scale = 1 + cores.clamp(1, 8).ilog2();
    f64::from(750 * scale) / 1e6
}
