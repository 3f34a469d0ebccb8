//! `pipewright trace-svg`: a training trace drawn as an SVG timeline, with the bubble
//! fraction of every stage; and `pipewright metrics-svg`: the loss curves of one or more
//! `train --metrics` files.

use std::path::Path;

use pipewright_core::fs::write_atomic;
use pipewright_core::metrics::{curves_svg, read_metrics, Run};
use pipewright_core::timeline::{bubbles, events_in, read_chrome_trace, timeline_svg_with, window_of, StepWindow, SvgOptions};

use crate::DriverError;

/// What drawing a trace gave: a line per stage with its bubble fraction over the steps
/// drawn, and what the drawing shows.
#[derive(Clone, Debug, PartialEq)]
pub struct Drawn {
    pub bubbles: Vec<String>,
    pub summary: String,
}

/// Draws `trace` (from `train --trace`) into `output`, `width` pixels wide at least,
/// over the steps `steps` (default: a trace of up to 10 steps whole, else its first 10).
pub fn draw_trace(trace: &Path, output: &Path, width: u32, steps: Option<StepWindow>) -> Result<Drawn, DriverError> {
    let text = std::fs::read_to_string(trace).map_err(|source| DriverError::Read { path: trace.to_path_buf(), source })?;
    let events = read_chrome_trace(&text).map_err(|e| DriverError::msg(format!("{}: {e}", trace.display())))?;
    if events.is_empty() {
        return Err(DriverError::msg(format!("{}: no complete (\"X\") events", trace.display())));
    }
    let options = SvgOptions { width: width.max(100), steps };
    let (window, what) = window_of(&events, &options);
    let shown = events_in(&events, window);
    if shown.is_empty() {
        return Err(DriverError::msg(format!("--steps {window}: the trace has no events in those steps ({what})")));
    }
    write_atomic(output, timeline_svg_with(&events, &options).as_bytes())?;
    // The bubble fractions of what is drawn: the window's.
    let bubbles = bubbles(&shown)
        .into_iter()
        .map(|(k, b)| format!("stage {k}: bubble fraction {:.4} (busy {:.3} ms of {:.3} ms)", b.fraction, b.busy_us / 1000.0, b.span_us / 1000.0))
        .collect();
    Ok(Drawn { bubbles, summary: format!("wrote {} ({} of {} events: {what})", output.display(), shown.len(), events.len()) })
}

/// Draws the loss curves of `files` (each from `train --metrics`; labelled by file name)
/// and their learning rates into `output`; returns what it wrote.
pub fn draw_metrics(files: &[std::path::PathBuf], output: &Path) -> Result<String, DriverError> {
    if files.is_empty() {
        return Err(DriverError::msg("metrics-svg: give at least one metrics file (from train --metrics)"));
    }
    let mut read = Vec::with_capacity(files.len());
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|source| DriverError::Read { path: f.clone(), source })?;
        let lines = read_metrics(&text).map_err(|e| DriverError::msg(format!("{}: {e}", f.display())))?;
        if lines.is_empty() {
            return Err(DriverError::msg(format!("{}: no steps (an empty metrics file)", f.display())));
        }
        let label = f.file_stem().map_or_else(|| f.display().to_string(), |s| s.to_string_lossy().into_owned());
        read.push((label, lines));
    }
    let runs: Vec<Run<'_>> = read.iter().map(|(label, lines)| Run { label, lines }).collect();
    write_atomic(output, curves_svg(&runs).as_bytes())?;
    let steps: usize = read.iter().map(|(_, l)| l.len()).sum();
    Ok(format!("wrote {} ({} run(s), {steps} steps)", output.display(), read.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that is not a trace, and one without complete events, are refused naming it.
    #[test]
    fn bad_traces_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let (bad, empty, out) = (dir.path().join("bad.json"), dir.path().join("empty.json"), dir.path().join("t.svg"));
        std::fs::write(&bad, "not json").unwrap();
        std::fs::write(&empty, "[]").unwrap();
        let e = draw_trace(&bad, &out, 1200, None).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: ", bad.display())), "{e}");
        let e = draw_trace(&empty, &out, 1200, None).unwrap_err().to_string();
        assert_eq!(e, format!("{}: no complete (\"X\") events", empty.display()));
        assert!(!out.exists());
    }
}
