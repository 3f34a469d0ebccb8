//! Schedule timelines: the events `train --trace` records, their Chrome/Perfetto trace
//! file (written and read through one typed struct), each stage's bubble fraction, and an
//! SVG drawing with one row per stage (`pipewright trace-svg`).
//!
//! A long run drawn whole is a barcode (200 steps of 2 stages are thousands of boxes a
//! pixel wide), so [`timeline_svg_with`] draws a window of steps ([`StepWindow`]; by
//! default the first [`DEFAULT_WINDOW_STEPS`] of a longer trace, said in the title) and
//! widens the drawing until a typical compute box holds its microbatch id, written in the
//! box as `<text>`.
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
    /// A weight gradient run apart from its backward (a schedule that splits the backward:
    /// `Backward` is then the input gradient alone).
    #[serde(rename = "backward-weight")]
    BackwardWeight,
    Recompute,
    Send,
    Recv,
    Optimizer,
    /// The gradient all-reduce among a stage's replicas (recorded by `pipewright simulate`).
    AllReduce,
}

impl TraceKind {
    pub const ALL: [TraceKind; 8] = [TraceKind::Forward, TraceKind::Backward, TraceKind::BackwardWeight, TraceKind::Recompute, TraceKind::Send, TraceKind::Recv, TraceKind::Optimizer, TraceKind::AllReduce];

    /// The event name in the Chrome trace.
    pub fn name(self) -> &'static str {
        match self {
            TraceKind::Forward => "forward",
            TraceKind::Backward => "backward",
            TraceKind::BackwardWeight => "backward-weight",
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
            TraceKind::Forward | TraceKind::Backward | TraceKind::BackwardWeight | TraceKind::Recompute => "compute",
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
            TraceKind::BackwardWeight => "#ff9da7",
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

/// Per stage (index = stage), the mean µs its thread spent after a backward of step
/// `from_step` or later (and the send of its gradient, when one follows) before its next
/// event ([`gaps_after_backward`]): work of the runtime's that no event covers (releasing
/// the microbatch's graph and activations), which a run's trace shows as a gap. `None` for
/// a stage with no backward followed by another event.
pub fn after_backward_us(events: &[TraceEvent], from_step: u64) -> Vec<Option<f64>> {
    let stages = events.iter().map(|e| e.stage + 1).max().unwrap_or(0);
    (0..stages)
        .map(|stage| {
            let gaps = gaps_after_backward(events, stage, from_step);
            (!gaps.is_empty()).then(|| gaps.iter().sum::<f64>() / gaps.len() as f64)
        })
        .collect()
}

/// Each gap, µs, from the end of a backward of `stage` of step `from_step` or later (or of
/// the send of its gradient, when one follows) to the stage's next event, in time order;
/// a backward with nothing after it has none.
pub fn gaps_after_backward(events: &[TraceEvent], stage: usize, from_step: u64) -> Vec<f64> {
    let mut mine: Vec<&TraceEvent> = events.iter().filter(|e| e.stage == stage).collect();
    mine.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    let mut gaps = Vec::new();
    for (k, e) in mine.iter().enumerate() {
        if e.kind != TraceKind::Backward || e.step < from_step {
            continue;
        }
        let (mut end, mut next) = (e.start_us + e.dur_us, mine.get(k + 1));
        if let Some(send) = next.filter(|n| n.kind == TraceKind::Send && n.microbatch == e.microbatch) {
            end = send.start_us + send.dur_us;
            next = mine.get(k + 2);
        }
        if let Some(n) = next {
            gaps.push((n.start_us - end).max(0.0));
        }
    }
    gaps
}

fn span(events: &[TraceEvent]) -> (f64, f64) {
    let t0 = events.iter().map(|e| e.start_us).fold(f64::INFINITY, f64::min);
    let t1 = events.iter().map(|e| e.start_us + e.dur_us).fold(f64::NEG_INFINITY, f64::max);
    (t0, t1)
}

/// Steps a drawing shows by default when the trace has more.
pub const DEFAULT_WINDOW_STEPS: u64 = 10;

/// The most pixels of time axis [`timeline_svg_with`] widens a drawing to.
pub const MAX_SVG_WIDTH: u32 = 20_000;

/// Steps `start..end` of a trace (its events' `step`, counted from 0; `end` excluded), as
/// `trace-svg --steps 10..20` takes them (`10..` runs to the trace's end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepWindow {
    pub start: u64,
    /// `None`: to the end of the trace.
    pub end: Option<u64>,
}

impl StepWindow {
    pub fn contains(&self, step: u64) -> bool {
        step >= self.start && self.end.is_none_or(|e| step < e)
    }
}

impl std::str::FromStr for StepWindow {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?}: expected a step range START..END (e.g. 10..20: steps 10 to 19, counted from 0) or START..");
        let (a, b) = s.split_once("..").ok_or_else(bad)?;
        let start = a.trim().parse::<u64>().map_err(|_| bad())?;
        let end = if b.trim().is_empty() { None } else { Some(b.trim().parse::<u64>().map_err(|_| bad())?) };
        if end.is_some_and(|e| e <= start) {
            return Err(format!("{s:?}: the range is empty (END must be above START)"));
        }
        Ok(StepWindow { start, end })
    }
}

impl std::fmt::Display for StepWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.end {
            Some(e) => write!(f, "{}..{e}", self.start),
            None => write!(f, "{}..", self.start),
        }
    }
}

/// How [`timeline_svg_with`] draws.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SvgOptions {
    /// Pixels of time axis at least (more when the boxes need it to hold their labels).
    pub width: u32,
    /// The steps drawn; `None`: every step of a trace of at most [`DEFAULT_WINDOW_STEPS`],
    /// else the first [`DEFAULT_WINDOW_STEPS`].
    pub steps: Option<StepWindow>,
}

impl Default for SvgOptions {
    fn default() -> Self {
        SvgOptions { width: 1200, steps: None }
    }
}

/// Pixels a label of `chars` characters takes at the drawing's 10 px label font (about
/// 0.6 em per digit), with 2 px of margin on each side.
pub fn label_width(chars: usize) -> f64 {
    chars as f64 * 6.0 + 4.0
}

/// The steps of `events` (lowest, highest), if any.
fn step_range(events: &[TraceEvent]) -> Option<(u64, u64)> {
    let lo = events.iter().map(|e| e.step).min()?;
    let hi = events.iter().map(|e| e.step).max()?;
    Some((lo, hi))
}

/// The window [`timeline_svg_with`] draws for `options`, and a sentence saying which it is.
pub fn window_of(events: &[TraceEvent], options: &SvgOptions) -> (StepWindow, String) {
    let (lo, hi) = step_range(events).unwrap_or((0, 0));
    let total = hi - lo + 1;
    match options.steps {
        Some(w) => (w, format!("steps {w} of {lo}..{}", hi + 1)),
        None if total > DEFAULT_WINDOW_STEPS => {
            let w = StepWindow { start: lo, end: Some(lo + DEFAULT_WINDOW_STEPS) };
            (w, format!("steps {w} of {lo}..{}: the first {DEFAULT_WINDOW_STEPS}; trace-svg --steps A..B draws others", hi + 1))
        }
        None => (StepWindow { start: lo, end: None }, format!("all {total} steps")),
    }
}

/// The events of `events` in the window `w`.
pub fn events_in(events: &[TraceEvent], w: StepWindow) -> Vec<TraceEvent> {
    events.iter().filter(|e| w.contains(e.step)).cloned().collect()
}

/// The pixels of time axis that give nine in ten compute boxes of `events` room for the
/// longest microbatch label (the shortest tenth may be outliers: one tiny box would widen
/// the whole drawing), between `min` and [`MAX_SVG_WIDTH`].
fn legible_width(events: &[TraceEvent], min: u32) -> f64 {
    let (t0, t1) = span(events);
    let span = (t1 - t0).max(1.0);
    let mut durs: Vec<f64> = events.iter().filter(|e| e.kind.is_busy() && e.microbatch.is_some()).map(|e| e.dur_us).collect();
    if durs.is_empty() {
        return f64::from(min);
    }
    durs.sort_by(f64::total_cmp);
    let short = durs[durs.len() / 10].max(1e-3);
    let chars = events.iter().filter_map(|e| e.microbatch).max().map_or(1, |m| m.to_string().len());
    // 5% over, so that rounding leaves the box no narrower than its label.
    let needed = 1.05 * label_width(chars) * span / short;
    needed.clamp(f64::from(min), f64::from(MAX_SVG_WIDTH.max(min)))
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
/// time axis in milliseconds; every event, at exactly that width.
pub fn timeline_svg(events: &[TraceEvent], width: u32) -> String {
    draw(events, f64::from(width), "")
}

/// The timeline of the steps `options` selects (see [`window_of`]; the title says which),
/// at least `options.width` pixels wide and wider where the median compute box would
/// not hold its microbatch id; each compute box wide enough for its id shows it as text.
pub fn timeline_svg_with(events: &[TraceEvent], options: &SvgOptions) -> String {
    let (w, what) = window_of(events, options);
    let shown = events_in(events, w);
    draw(&shown, legible_width(&shown, options.width), &format!(", {what}"))
}

/// [`timeline_svg`]'s drawing of `events`, `plot_w` pixels of time axis, `what` appended
/// to the title.
fn draw(events: &[TraceEvent], plot_w: f64, what: &str) -> String {
    let stages: Vec<usize> = events.iter().map(|e| e.stage).collect::<BTreeSet<_>>().into_iter().collect();
    let (t0, t1) = span(events);
    let span = if events.is_empty() { 1.0 } else { (t1 - t0).max(1.0) };
    let t0 = if events.is_empty() { 0.0 } else { t0 };
    let (left, top, row_h, gap) = (90.0, 48.0, 36.0, 10.0);
    let rows_h = stages.len() as f64 * (row_h + gap);
    let (total_w, total_h) = (left + plot_w + 20.0, top + rows_h + 60.0);
    let x = |t: f64| left + (t - t0) / span * plot_w;
    let mut s = String::new();
    let _ = writeln!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0}" height="{total_h:.0}" viewBox="0 0 {total_w:.0} {total_h:.0}" font-family="sans-serif" font-size="11">"#);
    let _ = writeln!(s, r#"<text x="{left}" y="16" font-size="13">pipeline timeline ({} stages, {} events{what})</text>"#, stages.len(), events.len());
    // Legend (circles, so that <rect>s are exactly the events), under the title.
    let mut lx = left;
    for k in TraceKind::ALL {
        let _ = writeln!(s, r#"<circle cx="{lx}" cy="28" r="5" fill="{}"/><text x="{}" y="32">{}</text>"#, k.colour(), lx + 8.0, k.name());
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
        // The microbatch id inside its compute box, where the box holds it.
        if let (true, Some(m)) = (e.kind.is_busy(), e.microbatch) {
            let label = m.to_string();
            if w >= label_width(label.len()) {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.2}" y="{:.1}" font-size="10" fill="white" text-anchor="middle" pointer-events="none">{label}</text>"#,
                    x(e.start_us) + w / 2.0,
                    ry + rh / 2.0 + 3.5
                );
            }
        }
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
    fn the_gap_after_a_backward_and_its_send_is_the_runtimes_untraced_work() {
        let at = |kind, stage, start_us, dur_us, mb: Option<u64>, step| TraceEvent { kind, stage, start_us, dur_us, microbatch: mb, version: 0, step };
        let events = vec![
            // Stage 0: backward [0, 10], the next forward at 14 (4 µs), then backward
            // [20, 30] and the optimizer at 36 (6 µs); the warm-up step's gap (8 µs) is
            // left out.
            at(TraceKind::Backward, 0, -20.0, 10.0, Some(0), 0),
            at(TraceKind::Forward, 0, -2.0, 2.0, Some(1), 0),
            at(TraceKind::Backward, 0, 0.0, 10.0, Some(1), 1),
            at(TraceKind::Forward, 0, 14.0, 5.0, Some(2), 1),
            at(TraceKind::Backward, 0, 20.0, 10.0, Some(2), 1),
            at(TraceKind::Optimizer, 0, 36.0, 2.0, None, 1),
            // Stage 1: the gradient's send [12, 13] after backward [2, 12], then a wait
            // in recv from 16 (3 µs); its last backward has nothing after it.
            at(TraceKind::Backward, 1, 2.0, 10.0, Some(1), 1),
            at(TraceKind::Send, 1, 12.0, 1.0, Some(1), 1),
            at(TraceKind::Recv, 1, 16.0, 8.0, Some(2), 1),
            at(TraceKind::Backward, 1, 24.0, 10.0, Some(2), 1),
            // Stage 2: no backward.
            at(TraceKind::Forward, 2, 0.0, 1.0, Some(1), 1),
        ];
        assert_eq!(gaps_after_backward(&events, 0, 1), [4.0, 6.0]);
        assert_eq!(after_backward_us(&events, 1), [Some(5.0), Some(3.0), None]);
        assert_eq!(after_backward_us(&events, 0)[0], Some(6.0));
        assert!(after_backward_us(&[], 0).is_empty());
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

    /// A 200-step 1F1B-like trace of 2 stages, 4 microbatches per step: forward 100 µs,
    /// backward 200 µs, a send after each, an optimizer step per batch.
    fn long_trace() -> Vec<TraceEvent> {
        let mut out = Vec::new();
        for stage in 0..2 {
            let mut t = stage as f64 * 50.0;
            for step in 0..200u64 {
                for j in 0..4 {
                    let mb = Some(step * 4 + j);
                    for (kind, dur) in [(TraceKind::Forward, 100.0), (TraceKind::Send, 5.0), (TraceKind::Backward, 200.0)] {
                        out.push(TraceEvent { kind, stage, start_us: t, dur_us: dur, microbatch: mb, version: step, step });
                        t += dur;
                    }
                }
                out.push(TraceEvent { kind: TraceKind::Optimizer, stage, start_us: t, dur_us: 20.0, microbatch: None, version: step + 1, step });
                t += 20.0;
            }
        }
        out
    }

    /// The drawn boxes: (width, the title's `step N`, the label drawn in the box, if any).
    fn boxes(svg: &str) -> Vec<(f64, u64, Option<String>)> {
        let lines: Vec<&str> = svg.lines().collect();
        let attr = |l: &str, a: &str| -> String { l.split(&format!(" {a}=\"")).nth(1).and_then(|r| r.split('"').next()).unwrap_or_default().to_string() };
        let mut out = Vec::new();
        for (i, l) in lines.iter().enumerate().filter(|(_, l)| l.starts_with("<rect")) {
            let width: f64 = attr(l, "width").parse().unwrap();
            let step: u64 = l.split(" step ").nth(1).and_then(|r| r.split(':').next()).unwrap().parse().unwrap();
            let label = lines.get(i + 1).filter(|n| n.starts_with("<text") && n.contains("font-size=\"10\"")).map(|n| n.split('>').nth(1).unwrap().trim_end_matches("</text").to_string());
            out.push((width, step, label));
        }
        out
    }

    #[test]
    fn long_traces_draw_a_window_with_labelled_boxes() {
        let events = long_trace();
        // Drawn whole at 1200 px, a box is a fraction of a pixel: the barcode of the issue.
        let whole = boxes(&timeline_svg(&events, 1200));
        assert_eq!(whole.len(), events.len());
        assert!(whole.iter().all(|b| b.2.is_none()), "no box of the whole trace holds a label");

        // By default: the first 10 steps, said in the title.
        let svg = timeline_svg_with(&events, &SvgOptions::default());
        assert!(svg.contains("steps 0..10 of 0..200: the first 10; trace-svg --steps A..B draws others"), "{}", &svg[..400]);
        let drawn = boxes(&svg);
        assert_eq!(drawn.len(), events.iter().filter(|e| e.step < 10).count());
        assert!(drawn.iter().all(|b| b.1 < 10));

        // A window: exactly its steps, every compute box labelled with its microbatch id
        // as <text>, each in a box wide enough for it.
        let window: StepWindow = "150..160".parse().unwrap();
        let svg = timeline_svg_with(&events, &SvgOptions { width: 1200, steps: Some(window) });
        assert!(svg.contains("steps 150..160 of 0..200"));
        let drawn = boxes(&svg);
        let expected: Vec<&TraceEvent> = events.iter().filter(|e| (150..160).contains(&e.step)).collect();
        assert_eq!(drawn.len(), expected.len());
        for (e, (width, step, label)) in expected.iter().zip(&drawn) {
            assert_eq!(e.step, *step);
            if e.kind.is_busy() && e.microbatch.is_some() {
                let id = e.microbatch.unwrap().to_string();
                assert_eq!(label.as_deref(), Some(id.as_str()), "{e:?}");
                assert!(*width >= label_width(id.len()), "box {width} px for label {id}");
            } else {
                assert!(label.is_none(), "{e:?}");
            }
        }
        assert!(svg.contains(">637</text>") && !svg.contains(">640</text>"));
    }

    #[test]
    fn step_windows_parse_and_refuse_empty_ranges() {
        assert_eq!("10..20".parse::<StepWindow>().unwrap(), StepWindow { start: 10, end: Some(20) });
        assert_eq!("5..".parse::<StepWindow>().unwrap().to_string(), "5..");
        assert!("20..10".parse::<StepWindow>().unwrap_err().contains("empty"));
        assert!("ten".parse::<StepWindow>().unwrap_err().contains("START..END"));
        let w: StepWindow = "3..".parse().unwrap();
        assert!(w.contains(3) && w.contains(1000) && !w.contains(2));
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
