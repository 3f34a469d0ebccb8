//! A per-stage trace recorder: each stage thread appends to its own `Vec` (no locks on
//! the hot path); the events come back in `TrainReport::trace`.

use std::time::Instant;

/// What a traced interval did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TraceKind {
    Forward,
    Backward,
    Recompute,
    Send,
    Recv,
    Optimizer,
}

impl TraceKind {
    /// The event name in the Chrome trace.
    pub fn name(self) -> &'static str {
        match self {
            TraceKind::Forward => "forward",
            TraceKind::Backward => "backward",
            TraceKind::Recompute => "recompute",
            TraceKind::Send => "send",
            TraceKind::Recv => "recv",
            TraceKind::Optimizer => "optimizer",
        }
    }

    /// The Chrome trace category: compute, comm or optim.
    pub fn category(self) -> &'static str {
        match self {
            TraceKind::Forward | TraceKind::Backward | TraceKind::Recompute => "compute",
            TraceKind::Send | TraceKind::Recv => "comm",
            TraceKind::Optimizer => "optim",
        }
    }
}

/// One interval on one stage; times in microseconds since the training start.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    pub kind: TraceKind,
    pub stage: usize,
    /// Start, µs since the shared epoch.
    pub start_us: f64,
    /// Duration in µs.
    pub dur_us: f64,
    /// The microbatch (global index); `None` for optimizer steps.
    pub microbatch: Option<u64>,
    /// The weight version used (forward/backward) or created (optimizer: `step + 1`).
    pub version: u64,
    /// The batch (step) index.
    pub step: u64,
}

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

/// The events as a Chrome/Perfetto trace: a JSON array of complete ("X") events.
pub fn chrome_trace_json(events: &[TraceEvent]) -> String {
    let arr: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            serde_json::json!({
                "name": e.kind.name(),
                "cat": e.kind.category(),
                "ph": "X",
                "ts": e.start_us,
                "dur": e.dur_us,
                "pid": 0,
                "tid": e.stage,
                "args": { "microbatch": e.microbatch, "version": e.version, "step": e.step },
            })
        })
        .collect();
    serde_json::to_string(&arr).expect("trace serializes")
}
