//! A per-stage trace recorder: each stage thread appends to its own `Vec` (no locks on
//! the hot path); the events come back in `TrainReport::trace` (see [`crate::timeline`]).

use std::time::Instant;

use crate::timeline::{TraceEvent, TraceKind};

/// Records events of one stage when enabled; a no-op otherwise.
pub(crate) struct Recorder {
    epoch: Option<Instant>,
    stage: usize,
    pub events: Vec<TraceEvent>,
}

impl Recorder {
    pub fn new(epoch: Option<Instant>, stage: usize) -> Self {
        Recorder { epoch, stage, events: Vec::new() }
    }

    /// The current instant when tracing, for a later `record`.
    #[inline]
    pub fn start(&self) -> Option<Instant> {
        self.epoch.map(|_| Instant::now())
    }

    #[inline]
    pub fn record(&mut self, kind: TraceKind, start: Option<Instant>, microbatch: Option<u64>, version: u64, step: u64) {
        let (Some(epoch), Some(start)) = (self.epoch, start) else { return };
        let end = Instant::now();
        let start_us = start.saturating_duration_since(epoch).as_secs_f64() * 1e6;
        let dur_us = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        self.events.push(TraceEvent { kind, stage: self.stage, start_us, dur_us, microbatch, version, step });
    }
}
