//! `pipewright trace-svg`: draws a `train --trace` Chrome trace as an SVG timeline, one
//! row per stage and one box per event coloured by kind, with a time axis, and prints
//! each stage's bubble fraction (1 - busy time / span of the whole trace).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};

#[derive(clap::Args)]
pub struct TraceSvgArgs {
    /// The trace written by `pipewright train --trace`.
    pub trace: PathBuf,
    /// Where to write the SVG.
    #[arg(short, long, default_value = "timeline.svg")]
    pub output: PathBuf,
    /// Width of the time axis in pixels.
    #[arg(long, default_value_t = 1200)]
    pub width: u32,
}

/// One complete event of the trace.
#[derive(Clone, Debug)]
struct Ev {
    name: String,
    tid: u64,
    ts: f64,
    dur: f64,
    microbatch: Option<u64>,
    step: Option<u64>,
}

/// Busy kinds count toward a stage's busy time; send/recv (waiting on a neighbour) do not.
fn is_busy(name: &str) -> bool {
    matches!(name, "forward" | "backward" | "recompute" | "optimizer")
}

fn colour(name: &str) -> &'static str {
    match name {
        "forward" => "#4e79a7",
        "backward" => "#e15759",
        "recompute" => "#f28e2b",
        "send" => "#59a14f",
        "recv" => "#9c755f",
        "optimizer" => "#b07aa1",
        _ => "#bab0ac",
    }
}

fn parse(text: &str) -> Result<Vec<Ev>> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| anyhow!("not JSON: {e}"))?;
    // Either a bare array or the object form {"traceEvents": [...]}.
    let arr = match &v {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => o.get("traceEvents").and_then(|t| t.as_array()).ok_or_else(|| anyhow!("no traceEvents array"))?,
        _ => bail!("expected a JSON array of trace events"),
    };
    let mut out = Vec::new();
    for (i, e) in arr.iter().enumerate() {
        if e.get("ph").and_then(|p| p.as_str()) != Some("X") {
            continue;
        }
        let num = |k: &str| e.get(k).and_then(|x| x.as_f64()).ok_or_else(|| anyhow!("event {i}: no numeric {k:?}"));
        let args = e.get("args");
        out.push(Ev {
            name: e.get("name").and_then(|n| n.as_str()).unwrap_or("?").to_string(),
            tid: num("tid")? as u64,
            ts: num("ts")?,
            dur: num("dur")?.max(0.0),
            microbatch: args.and_then(|a| a.get("microbatch")).and_then(|x| x.as_u64()),
            step: args.and_then(|a| a.get("step")).and_then(|x| x.as_u64()),
        });
    }
    Ok(out)
}

/// Per stage: (busy µs, span µs, bubble fraction), span being the whole trace's.
fn bubbles(events: &[Ev]) -> BTreeMap<u64, (f64, f64, f64)> {
    let t0 = events.iter().map(|e| e.ts).fold(f64::INFINITY, f64::min);
    let t1 = events.iter().map(|e| e.ts + e.dur).fold(f64::NEG_INFINITY, f64::max);
    let span = (t1 - t0).max(0.0);
    let mut busy: BTreeMap<u64, f64> = BTreeMap::new();
    for e in events {
        let b = busy.entry(e.tid).or_default();
        if is_busy(&e.name) {
            *b += e.dur;
        }
    }
    busy.into_iter()
        .map(|(k, b)| {
            let frac = if span > 0.0 { (1.0 - b / span).clamp(0.0, 1.0) } else { 0.0 };
            (k, (b, span, frac))
        })
        .collect()
}

/// A "nice" tick interval (1, 2 or 5 times a power of ten) giving about `n` ticks.
fn tick_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1e-9);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|s| *s >= raw).unwrap_or(10.0 * p)
}

fn svg(events: &[Ev], width: u32) -> String {
    let stages: Vec<u64> = events.iter().map(|e| e.tid).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    let t0 = events.iter().map(|e| e.ts).fold(f64::INFINITY, f64::min);
    let t1 = events.iter().map(|e| e.ts + e.dur).fold(f64::NEG_INFINITY, f64::max);
    let span = if events.is_empty() { 1.0 } else { (t1 - t0).max(1.0) };
    let t0 = if events.is_empty() { 0.0 } else { t0 };
    let (left, top, row_h, gap) = (90.0, 40.0, 36.0, 10.0);
    let plot_w = width as f64;
    let rows_h = stages.len() as f64 * (row_h + gap);
    let (total_w, total_h) = (left + plot_w + 20.0, top + rows_h + 60.0);
    let x = |t: f64| left + (t - t0) / span * plot_w;
    let mut s = String::new();
    let _ = writeln!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0}" height="{total_h:.0}" viewBox="0 0 {total_w:.0} {total_h:.0}" font-family="sans-serif" font-size="11">"#);
    let _ = writeln!(s, r#"<text x="{left}" y="16" font-size="13">pipeline timeline ({} stages, {} events)</text>"#, stages.len(), events.len());
    // Legend (circles, so that <rect>s are exactly the events).
    let mut lx = left + 300.0;
    for k in ["forward", "backward", "recompute", "send", "recv", "optimizer"] {
        let _ = writeln!(s, r#"<circle cx="{lx}" cy="12" r="5" fill="{}"/><text x="{}" y="16">{k}</text>"#, colour(k), lx + 8.0);
        lx += 80.0;
    }
    let bub = bubbles(events);
    for (r, k) in stages.iter().enumerate() {
        let y = top + r as f64 * (row_h + gap);
        let frac = bub.get(k).map(|b| b.2).unwrap_or(0.0);
        let _ = writeln!(s, r#"<text x="6" y="{:.1}">stage {k}</text><text x="6" y="{:.1}" fill="gray">bubble {:.0}%</text>"#, y + 14.0, y + 28.0, frac * 100.0);
        let _ = writeln!(s, r#"<line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="lightgray"/>"#, y + row_h, left + plot_w, y + row_h);
    }
    for e in events {
        let r = stages.iter().position(|k| *k == e.tid).unwrap_or(0) as f64;
        let y = top + r * (row_h + gap);
        let thin = matches!(e.name.as_str(), "send" | "recv");
        let (ry, rh) = if thin { (y + row_h - 6.0, 6.0) } else { (y, row_h - 8.0) };
        let w = (e.dur / span * plot_w).max(0.5);
        let mb = e.microbatch.map(|m| format!(" mb {m}")).unwrap_or_default();
        let st = e.step.map(|t| format!(" step {t}")).unwrap_or_default();
        let _ = writeln!(
            s,
            r#"<rect x="{:.2}" y="{ry:.1}" width="{w:.2}" height="{rh:.1}" fill="{}"><title>{}{mb}{st}: {:.1} µs at {:.1} µs</title></rect>"#,
            x(e.ts),
            colour(&e.name),
            e.name,
            e.dur,
            e.ts - t0
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

fn fmt_ms(ms: f64) -> String {
    let s = format!("{ms:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

pub fn run(args: &TraceSvgArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.trace).with_context(|| format!("{}: cannot read", args.trace.display()))?;
    let events = parse(&text).map_err(|e| anyhow!("{}: {e}", args.trace.display()))?;
    if events.is_empty() {
        bail!("{}: no complete (\"X\") events", args.trace.display());
    }
    crate::output::write_atomic(&args.output, svg(&events, args.width.max(100)).as_bytes())?;
    for (k, (busy, span, frac)) in bubbles(&events) {
        println!("stage {k}: bubble fraction {frac:.4} (busy {:.3} ms of {:.3} ms)", busy / 1000.0, span / 1000.0);
    }
    eprintln!("wrote {} ({} events)", args.output.display(), events.len());
    Ok(())
}
