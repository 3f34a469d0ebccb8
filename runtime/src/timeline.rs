//! Schedule timelines: the events `train --trace` records, their Chrome/Perfetto trace
//! file (written and read through one typed struct), each stage's bubble fraction, and an
//! SVG drawing with one row per stage (`pipewright trace-svg`).
//!
//! Plain Rust: builds without libtorch.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// What a traced interval did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceKind {
    Forward,
    Backward,
    Recompute,
    Send,
    Recv,
    Optimizer,
    /// The gradient all-reduce among a stage's replicas (recorded by `pipewright simulate`).
    AllReduce,
}

impl TraceKind {
    pub const ALL: [TraceKind; 7] = [TraceKind::Forward, TraceKind::Backward, TraceKind::Recompute, TraceKind::Send, TraceKind::Recv, TraceKind::Optimizer, TraceKind::AllReduce];

    /// The event name in the Chrome trace.
    pub fn name(self) -> &'static str {
        match self {
            TraceKind::Forward => "forward",
            TraceKind::Backward => "backward",
            TraceKind::Recompute => "recompute",
            TraceKind::Send => "send",
            TraceKind::Recv => "recv",
            TraceKind::Optimizer => "optimizer",
            TraceKind::AllReduce => "allreduce",
        }
    }

    /// The Chrome trace category: compute, comm or optim.
    pub fn category(self) -> &'static str {
        match self {
            TraceKind::Forward | TraceKind::Backward | TraceKind::Recompute => "compute",
            TraceKind::Send | TraceKind::Recv | TraceKind::AllReduce => "comm",
            TraceKind::Optimizer => "optim",
        }
    }

    /// Whether the stage computes (as opposed to waiting on a neighbour).
    pub fn is_busy(self) -> bool {
        !matches!(self, TraceKind::Send | TraceKind::Recv | TraceKind::AllReduce)
    }

    fn colour(self) -> &'static str {
        match self {
            TraceKind::Forward => "#4e79a7",
            TraceKind::Backward => "#e15759",
            TraceKind::Recompute => "#f28e2b",
            TraceKind::Send => "#59a14f",
            TraceKind::Recv => "#9c755f",
            TraceKind::Optimizer => "#b07aa1",
            TraceKind::AllReduce => "#76b7b2",
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

/// One complete ("X") event of a Chrome trace file.
#[derive(Serialize, Deserialize)]
struct ChromeEvent {
    name: TraceKind,
    #[serde(default)]
    cat: String,
    ph: String,
    ts: f64,
    dur: f64,
    #[serde(default)]
    pid: u64,
    tid: usize,
    args: ChromeArgs,
}

#[derive(Serialize, Deserialize)]
struct ChromeArgs {
    microbatch: Option<u64>,
    version: u64,
    step: u64,
}

/// Any event: only complete ("X") ones are read, the rest (metadata) skipped.
#[derive(Deserialize)]
struct AnyEvent {
    ph: String,
}

/// A trace file: a bare array of events, or `{"traceEvents": [...]}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TraceFile {
    Array(Vec<serde_json::Value>),
    Object {
        #[serde(rename = "traceEvents")]
        trace_events: Vec<serde_json::Value>,
    },
}

/// The events as a Chrome/Perfetto trace: a JSON array of complete ("X") events.
pub fn chrome_trace_json(events: &[TraceEvent]) -> String {
    let out: Vec<ChromeEvent> = events
        .iter()
        .map(|e| ChromeEvent {
            name: e.kind,
            cat: e.kind.category().into(),
            ph: "X".into(),
            ts: e.start_us,
            dur: e.dur_us,
            pid: 0,
            tid: e.stage,
            args: ChromeArgs { microbatch: e.microbatch, version: e.version, step: e.step },
        })
        .collect();
    // Plain numbers and strings: serialising cannot fail.
    serde_json::to_string(&out).unwrap_or_default()
}

/// Reads the events of a trace [`chrome_trace_json`] wrote (also in the object form that
/// other tools use); non-"X" events are skipped.
pub fn read_chrome_trace(text: &str) -> Result<Vec<TraceEvent>, String> {
    let file: TraceFile = serde_json::from_str(text).map_err(|e| format!("not a trace (a JSON array of events, or {{\"traceEvents\": [...]}}): {e}"))?;
    let (TraceFile::Array(raw) | TraceFile::Object { trace_events: raw }) = file;
    let mut out = Vec::with_capacity(raw.len());
    for (i, v) in raw.into_iter().enumerate() {
        let any: AnyEvent = serde_json::from_value(v.clone()).map_err(|e| format!("event {i}: {e}"))?;
        if any.ph != "X" {
            continue;
        }
        let e: ChromeEvent = serde_json::from_value(v).map_err(|e| format!("event {i}: {e}"))?;
        out.push(TraceEvent {
            kind: e.name,
            stage: e.tid,
            start_us: e.ts,
            dur_us: e.dur.max(0.0),
            microbatch: e.args.microbatch,
            version: e.args.version,
            step: e.args.step,
        });
    }
    Ok(out)
}

/// A stage's share of the timeline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bubble {
    /// Busy (compute and optimizer) µs.
    pub busy_us: f64,
    /// The whole trace's span, µs.
    pub span_us: f64,
    /// `1 - busy / span`.
    pub fraction: f64,
}

/// Per stage: busy time, the span of the whole trace and the bubble fraction.
pub fn bubbles(events: &[TraceEvent]) -> BTreeMap<usize, Bubble> {
    let (t0, t1) = span(events);
    let span_us = (t1 - t0).max(0.0);
    let mut busy: BTreeMap<usize, f64> = BTreeMap::new();
    for e in events {
        let b = busy.entry(e.stage).or_default();
        if e.kind.is_busy() {
            *b += e.dur_us;
        }
    }
    busy.into_iter()
        .map(|(k, busy_us)| {
            let fraction = if span_us > 0.0 { (1.0 - busy_us / span_us).clamp(0.0, 1.0) } else { 0.0 };
            (k, Bubble { busy_us, span_us, fraction })
        })
        .collect()
}

fn span(events: &[TraceEvent]) -> (f64, f64) {
    let t0 = events.iter().map(|e| e.start_us).fold(f64::INFINITY, f64::min);
    let t1 = events.iter().map(|e| e.start_us + e.dur_us).fold(f64::NEG_INFINITY, f64::max);
    (t0, t1)
}

/// A "nice" tick interval (1, 2 or 5 times a power of ten) giving about `n` ticks.
fn tick_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1e-9);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|s| *s >= raw).unwrap_or(10.0 * p)
}

fn fmt_ms(ms: f64) -> String {
    let s = format!("{ms:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The timeline as SVG, `width` pixels of time axis: one row per stage with its bubble
/// fraction, one box per event coloured by kind (send/recv as thin bars), a legend and a
/// time axis in milliseconds.
pub fn timeline_svg(events: &[TraceEvent], width: u32) -> String {
    let stages: Vec<usize> = events.iter().map(|e| e.stage).collect::<BTreeSet<_>>().into_iter().collect();
    let (t0, t1) = span(events);
    let span = if events.is_empty() { 1.0 } else { (t1 - t0).max(1.0) };
    let t0 = if events.is_empty() { 0.0 } else { t0 };
    let (left, top, row_h, gap) = (90.0, 40.0, 36.0, 10.0);
    let plot_w = f64::from(width);
    let rows_h = stages.len() as f64 * (row_h + gap);
    let (total_w, total_h) = (left + plot_w + 20.0, top + rows_h + 60.0);
    let x = |t: f64| left + (t - t0) / span * plot_w;
    let mut s = String::new();
    let _ = writeln!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0}" height="{total_h:.0}" viewBox="0 0 {total_w:.0} {total_h:.0}" font-family="sans-serif" font-size="11">"#);
    let _ = writeln!(s, r#"<text x="{left}" y="16" font-size="13">pipeline timeline ({} stages, {} events)</text>"#, stages.len(), events.len());
    // Legend (circles, so that <rect>s are exactly the events).
    let mut lx = left + 300.0;
    for k in TraceKind::ALL {
        let _ = writeln!(s, r#"<circle cx="{lx}" cy="12" r="5" fill="{}"/><text x="{}" y="16">{}</text>"#, k.colour(), lx + 8.0, k.name());
        lx += 80.0;
    }
    let bub = bubbles(events);
    for (r, k) in stages.iter().enumerate() {
        let y = top + r as f64 * (row_h + gap);
        let frac = bub.get(k).map_or(0.0, |b| b.fraction);
        let _ = writeln!(s, r#"<text x="6" y="{:.1}">stage {k}</text><text x="6" y="{:.1}" fill="gray">bubble {:.0}%</text>"#, y + 14.0, y + 28.0, frac * 100.0);
        let _ = writeln!(s, r#"<line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="lightgray"/>"#, y + row_h, left + plot_w, y + row_h);
    }
    for e in events {
        let r = stages.iter().position(|k| *k == e.stage).unwrap_or(0) as f64;
        let y = top + r * (row_h + gap);
        let (ry, rh) = if e.kind.is_busy() { (y, row_h - 8.0) } else { (y + row_h - 6.0, 6.0) };
        let w = (e.dur_us / span * plot_w).max(0.5);
        let mb = e.microbatch.map(|m| format!(" mb {m}")).unwrap_or_default();
        let _ = writeln!(
            s,
            r#"<rect x="{:.2}" y="{ry:.1}" width="{w:.2}" height="{rh:.1}" fill="{}"><title>{}{mb} step {}: {:.1} µs at {:.1} µs</title></rect>"#,
            x(e.start_us),
            e.kind.colour(),
            e.kind.name(),
            e.step,
            e.dur_us,
            e.start_us - t0
        );
    }
    // Time axis in milliseconds.
    let ay = top + rows_h + 5.0;
    let _ = writeln!(s, r#"<line x1="{left}" y1="{ay:.1}" x2="{:.1}" y2="{ay:.1}" stroke="black"/>"#, left + plot_w);
    let step = tick_step(span, 10.0);
    let mut t = 0.0;
    while t <= span + 1e-9 {
        let tx = left + t / span * plot_w;
        let _ = writeln!(s, r#"<line x1="{tx:.1}" y1="{ay:.1}" x2="{tx:.1}" y2="{:.1}" stroke="black"/><text x="{tx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, ay + 5.0, ay + 18.0, fmt_ms(t / 1000.0));
        t += step;
    }
    let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (ms)</text>"#, left + plot_w / 2.0, ay + 36.0);
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: TraceKind, stage: usize, start_us: f64, dur_us: f64) -> TraceEvent {
        TraceEvent { kind, stage, start_us, dur_us, microbatch: Some(0), version: 0, step: 0 }
    }

    #[test]
    fn trace_files_round_trip_and_bubbles_count_compute_only() {
        let events = vec![ev(TraceKind::Forward, 0, 0.0, 40.0), ev(TraceKind::Send, 0, 40.0, 10.0), ev(TraceKind::Backward, 1, 50.0, 50.0)];
        let json = chrome_trace_json(&events);
        assert_eq!(read_chrome_trace(&json).unwrap(), events);
        let wrapped = format!("{{\"traceEvents\": {json}}}");
        assert_eq!(read_chrome_trace(&wrapped).unwrap(), events);
        let b = bubbles(&events);
        assert_eq!(b[&0], Bubble { busy_us: 40.0, span_us: 100.0, fraction: 0.6 });
        assert_eq!(b[&1].fraction, 0.5);
        let svg = timeline_svg(&events, 400);
        assert_eq!(svg.matches("<rect").count(), 3);
        assert!(svg.contains("bubble 60%"), "{svg}");
    }

    #[test]
    fn bad_traces_say_what_is_wrong() {
        assert!(read_chrome_trace("{").unwrap_err().starts_with("not a trace"));
        let e = read_chrome_trace(r#"[{"ph": "X", "name": "nap", "ts": 0, "dur": 1, "tid": 0, "args": {"version": 0, "step": 0}}]"#).unwrap_err();
        assert!(e.starts_with("event 0: unknown variant `nap`"), "{e}");
        // Metadata events are skipped.
        assert_eq!(read_chrome_trace(r#"[{"ph": "M", "name": "thread_name"}]"#).unwrap(), vec![]);
    }
}
