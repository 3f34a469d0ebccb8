//! The `--metrics` file of a training run, one JSON line per step ([`MetricsLine`]), which
//! `train` writes and `metrics-svg` reads, and its drawing: loss curves of one or more
//! runs against the step, with the learning rate beneath ([`curves_svg`]).
//!
//! The drawing is for reading at a glance: each run's raw losses faint, a moving average
//! over them bold in the same colour, one legend entry per run, axes with round ticks, and
//! the learning-rate panel sharing the step axis. Every series is a `<polyline>` with a
//! `data-series` attribute (`loss`, `smoothed`, `eval` (dashed, a dot per evaluation), `lr`)
//! and `data-run` (the run's label), so
//! tests and scripts can find them.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// One line of `--metrics`: one training step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricsLine {
    /// 1-based: the step just completed.
    pub step: usize,
    pub loss: f64,
    pub samples: usize,
    pub seconds: f64,
    pub samples_per_s: f64,
    /// The learning rate the step used (absent in files of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// The held-out set's loss after this step, when the run evaluated (`--eval-data`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Its accuracy (cross-entropy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Its perplexity (a language model: the exponential of the loss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_perplexity: Option<f64>,
    /// Present (true) only on a step whose update was skipped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// On the first line only: the settings a resume with `--force` let differ from the
    /// checkpoint's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forced: Vec<String>,
}

/// Reads a metrics file's text; an error names the line and what is wrong with it.
pub fn read_metrics(text: &str) -> Result<Vec<MetricsLine>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("line {}: not a metrics line of `train --metrics`: {e}", i + 1)))
        .collect()
}

/// One run to draw: its label (the file name, say) and its steps.
pub struct Run<'a> {
    pub label: &'a str,
    pub lines: &'a [MetricsLine],
}

const COLOURS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];
const WIDTH: f64 = 900.0;
const LEFT: f64 = 70.0;
const PLOT_W: f64 = WIDTH - LEFT - 30.0;
const LOSS_TOP: f64 = 60.0;
const LOSS_H: f64 = 300.0;
const LR_GAP: f64 = 50.0;
const LR_H: f64 = 110.0;

/// The runs' losses (and learning rates, where the files have them) as one SVG picture.
pub fn curves_svg(runs: &[Run<'_>]) -> String {
    let finite = |v: f64| v.is_finite();
    let steps = runs.iter().flat_map(|r| r.lines.iter().map(|l| l.step as f64));
    let (s0, s1) = bounds(steps).unwrap_or((0.0, 1.0));
    let (l0, l1) = bounds(runs.iter().flat_map(|r| r.lines.iter().flat_map(|l| [Some(l.loss), l.eval_loss]).flatten().filter(|&v| finite(v)))).unwrap_or((0.0, 1.0));
    let lrs: Vec<f64> = runs.iter().flat_map(|r| r.lines.iter().filter_map(|l| l.lr)).collect();
    let lr_panel = !lrs.is_empty();
    let height = LOSS_TOP + LOSS_H + if lr_panel { LR_GAP + LR_H } else { 0.0 } + 50.0;
    let x = Axis::new(s0, s1, LEFT, LEFT + PLOT_W);
    let y = Axis::new(l0, l1, LOSS_TOP + LOSS_H, LOSS_TOP);
    let mut s = String::new();
    let _ = writeln!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#);
    let _ = writeln!(s, r#"<rect width="{WIDTH}" height="{height}" fill="white"/>"#);
    let evaluated = runs.iter().any(|r| r.lines.iter().any(|l| l.eval_loss.is_some()));
    let title = match (evaluated, lr_panel) {
        (true, true) => "training loss (evaluation dashed) and learning rate",
        (true, false) => "training loss (evaluation dashed)",
        (false, true) => "training loss and learning rate",
        (false, false) => "training loss",
    };
    let _ = writeln!(s, r#"<text x="{LEFT}" y="20" font-size="15">{title}</text>"#);
    legend(&mut s, runs);
    frame(&mut s, &x, &y, "loss", LOSS_TOP, LOSS_H, !lr_panel);
    for (k, run) in runs.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let raw: Vec<(f64, f64)> = run.lines.iter().filter(|l| finite(l.loss)).map(|l| (l.step as f64, l.loss)).collect();
        polyline(&mut s, "loss", run.label, &raw, &x, &y, colour, r#"stroke-width="1" stroke-opacity="0.35""#);
        polyline(&mut s, "smoothed", run.label, &moving_average(&raw), &x, &y, colour, r#"stroke-width="2.2""#);
        let eval: Vec<(f64, f64)> = run.lines.iter().filter_map(|l| l.eval_loss.filter(|v| finite(*v)).map(|v| (l.step as f64, v))).collect();
        if !eval.is_empty() {
            evaluations(&mut s, run.label, &eval, &x, &y, colour);
        }
    }
    if lr_panel {
        let top = LOSS_TOP + LOSS_H + LR_GAP;
        let (r0, r1) = bounds(lrs.iter().copied()).unwrap_or((0.0, 1.0));
        let y = Axis::new(r0.min(0.0), r1, top + LR_H, top);
        frame(&mut s, &x, &y, "learning rate", top, LR_H, true);
        for (k, run) in runs.iter().enumerate() {
            let pts: Vec<(f64, f64)> = run.lines.iter().filter_map(|l| l.lr.map(|lr| (l.step as f64, lr))).collect();
            polyline(&mut s, "lr", run.label, &pts, &x, &y, COLOURS[k % COLOURS.len()], r#"stroke-width="1.6""#);
        }
    }
    s.push_str("</svg>\n");
    s
}

/// The lowest and highest of `vs`, widened when they are equal; `None` when empty.
fn bounds(vs: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (lo, hi) = vs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return None;
    }
    Some(if lo == hi { (lo - 0.5_f64.max(lo.abs() * 0.1), hi + 0.5_f64.max(hi.abs() * 0.1)) } else { (lo, hi) })
}

/// A linear map from data values to pixels, over round tick marks.
struct Axis {
    lo: f64,
    hi: f64,
    from: f64,
    to: f64,
    ticks: Vec<f64>,
}

impl Axis {
    fn new(lo: f64, hi: f64, from: f64, to: f64) -> Axis {
        let step = nice_step((hi - lo) / 5.0);
        let first = (lo / step).floor() * step;
        let last = (hi / step).ceil() * step;
        let ticks = (0..=((last - first) / step).round() as usize).map(|i| first + i as f64 * step).collect();
        Axis { lo: first, hi: last.max(first + step), from, to, ticks }
    }

    fn at(&self, v: f64) -> f64 {
        self.from + (v - self.lo) / (self.hi - self.lo) * (self.to - self.from)
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|&v| v >= raw).unwrap_or(10.0 * p)
}

/// A tick label: plain for ordinary magnitudes, exponent form for rates like 3e-4.
fn tick_text(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() < 1e-2 || v.abs() >= 1e5 {
        format!("{v:.0e}")
    } else {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn frame(s: &mut String, x: &Axis, y: &Axis, label: &str, top: f64, h: f64, step_labels: bool) {
    let bottom = top + h;
    let _ = writeln!(s, r##"<rect x="{LEFT}" y="{top}" width="{PLOT_W}" height="{h}" fill="none" stroke="#999"/>"##);
    for &t in &y.ticks {
        let py = y.at(t);
        let _ = writeln!(s, r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##, LEFT + PLOT_W, LEFT - 6.0, py + 4.0, tick_text(t));
    }
    for &t in &x.ticks {
        let px = x.at(t);
        let _ = writeln!(s, r##"<line x1="{px:.1}" y1="{top}" x2="{px:.1}" y2="{bottom}" stroke="#eee"/>"##);
        if step_labels {
            let _ = writeln!(s, r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, bottom + 16.0, tick_text(t));
        }
    }
    let _ = writeln!(s, r#"<text x="16" y="{:.1}" transform="rotate(-90 16 {:.1})" text-anchor="middle">{label}</text>"#, top + h / 2.0, top + h / 2.0);
    if step_labels {
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#, LEFT + PLOT_W / 2.0, bottom + 34.0);
    }
}

fn legend(s: &mut String, runs: &[Run<'_>]) {
    let mut lx = LEFT;
    for (k, run) in runs.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let _ = writeln!(s, r#"<line x1="{lx}" y1="40" x2="{}" y2="40" stroke="{colour}" stroke-width="3"/><text x="{}" y="44">{}</text>"#, lx + 20.0, lx + 26.0, escape(run.label));
        lx += 40.0 + 7.0 * run.label.chars().count() as f64;
    }
}

/// One series as a `<polyline>`; `stroke` holds its width, opacity or dashes.
#[allow(clippy::too_many_arguments)]
fn polyline(s: &mut String, series: &str, run: &str, pts: &[(f64, f64)], x: &Axis, y: &Axis, colour: &str, stroke: &str) {
    let points: Vec<String> = pts.iter().map(|&(a, b)| format!("{:.1},{:.1}", x.at(a), y.at(b))).collect();
    let _ = writeln!(s, r#"<polyline data-series="{series}" data-run="{}" points="{}" fill="none" stroke="{colour}" {stroke}/>"#, escape(run), points.join(" "));
}

/// The evaluation losses: dashed, with a dot at each evaluation.
fn evaluations(s: &mut String, run: &str, pts: &[(f64, f64)], x: &Axis, y: &Axis, colour: &str) {
    polyline(s, "eval", run, pts, x, y, colour, r#"stroke-width="2" stroke-dasharray="6 4""#);
    for &(a, b) in pts {
        let _ = writeln!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{colour}"/>"#, x.at(a), y.at(b));
    }
}

/// A centred moving average over about a twentieth of the points (at least 1).
/// Linear in the points (prefix sums), whatever the window: a long run's file has a
/// point per step.
fn moving_average(pts: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let half = pts.len() / 40;
    let mut prefix = Vec::with_capacity(pts.len() + 1);
    prefix.push(0.0);
    for p in pts {
        prefix.push(prefix[prefix.len() - 1] + p.1);
    }
    (0..pts.len())
        .map(|i| {
            let (a, b) = (i.saturating_sub(half), (i + half + 1).min(pts.len()));
            (pts[i].0, (prefix[b] - prefix[a]) / (b - a) as f64)
        })
        .collect()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: usize, loss: f64, lr: Option<f64>) -> MetricsLine {
        MetricsLine { step, loss, samples: 8, seconds: 0.1, samples_per_s: 80.0, lr, eval_loss: None, eval_accuracy: None, eval_perplexity: None, skipped: false, forced: Vec::new() }
    }

    #[test]
    fn lines_round_trip_and_older_files_without_a_rate_still_read() {
        let l = line(3, 0.5, Some(1e-3));
        let text = serde_json::to_string(&l).expect("serialise");
        assert_eq!(read_metrics(&text).expect("read"), vec![l]);
        let old = r#"{"step":1,"loss":2.3,"samples":64,"seconds":0.5,"samples_per_s":128.0}"#;
        assert_eq!(read_metrics(old).expect("old line")[0].lr, None);
        let e = read_metrics("{\"step\":1}\nnot json").expect_err("bad lines");
        assert!(e.starts_with("line 1: not a metrics line of `train --metrics`: missing field `loss`"), "{e}");
    }

    #[test]
    fn the_moving_average_is_the_mean_of_each_window() {
        let pts: Vec<(f64, f64)> = (0..80).map(|i| (i as f64, if i % 2 == 0 { 1.0 } else { 3.0 })).collect();
        let avg = moving_average(&pts);
        // Windows of 2 * 2 + 1 points inside, shorter at the ends.
        assert_eq!(avg[10], (10.0, (1.0 + 3.0 + 1.0 + 3.0 + 1.0) / 5.0));
        assert_eq!(avg[0], (0.0, (1.0 + 3.0 + 1.0) / 3.0));
        assert_eq!(avg[79], (79.0, (3.0 + 1.0 + 3.0) / 3.0));
    }

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        let a = Axis::new(0.37, 2.31, 0.0, 100.0);
        assert_eq!(a.ticks, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        assert_eq!(tick_text(3e-4), "3e-4");
        assert_eq!(tick_text(2.5), "2.5");
        assert!((a.at(0.0) - 0.0).abs() < 1e-9 && (a.at(2.5) - 100.0).abs() < 1e-9);
    }
}
