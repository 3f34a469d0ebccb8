//! Training progress for people and programs: an indicatif bar on a terminal (plain lines
//! every `--log-every` steps otherwise), and one JSON line of metrics per step.
//!
//! While the bar is drawn, every line meant for the terminal goes through
//! [`Progress::println`] (printed with the bar suspended, above it), and the bar is cleared before
//! anything else is printed, so on a terminal the banner, the bar, warnings and the
//! summary never share a line (indicatif leaves its cursor at the end of the bar's line:
//! a plain `eprintln!` after it continued that line).

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use pipewright_core::metrics::MetricsLine;
use pipewright_driver::train::{eval_perplexity, StepReport};

/// `1234 samples/s`, or `12.3 s/step` when a step takes longer than a second per sample
/// (`0 samples/s` says nothing).
fn speed_text(samples_per_s: f64, step_seconds: f64) -> String {
    if step_seconds >= 1.0 {
        format!("{step_seconds:.1} s/step")
    } else if samples_per_s >= 10.0 {
        format!("{samples_per_s:.0} samples/s")
    } else {
        format!("{samples_per_s:.1} samples/s")
    }
}

pub struct Progress {
    bar: Option<ProgressBar>,
    metrics: Option<std::fs::File>,
    pub started: Instant,
    first_step: usize,
    steps: usize,
    log_every: usize,
    /// The last step's line, printed in place of the bar when it is cleared.
    last: Option<String>,
    /// What `--force` let differ on resume, for the first metrics line.
    forced: Vec<String>,
    /// Evaluations report perplexity (the data is a token stream).
    language_model: bool,
}

impl Progress {
    pub fn new(steps: usize, first_step: usize, log_every: usize, plain: bool, metrics: Option<&Path>) -> Result<Self> {
        let metrics = match metrics {
            Some(p) => Some(std::fs::File::create(p).with_context(|| format!("{}: cannot create", p.display()))?),
            None => None,
        };
        let bar = (!plain && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(steps as u64);
            let style = ProgressStyle::with_template("{bar:30} step {pos}/{len}  {msg}  eta {eta}").unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_position(first_step as u64);
            bar
        });
        Ok(Progress { bar, metrics, started: Instant::now(), first_step, steps, log_every: log_every.max(1), last: None, forced: Vec::new(), language_model: false })
    }

    /// Evaluations of a language model also report perplexity.
    pub fn language_model(mut self, yes: bool) -> Self {
        self.language_model = yes;
        self
    }

    /// Records in the metrics what a resume with `--force` let differ.
    pub fn forced(mut self, forced: Vec<String>) -> Self {
        self.forced = forced;
        self
    }

    pub fn step(&mut self, r: &StepReport) {
        let rate = r.samples as f64 / r.seconds.max(1e-9);
        let speed = speed_text(rate, r.seconds);
        let done = r.step + 1 - self.first_step;
        let eta = self.started.elapsed().as_secs_f64() / done as f64 * (self.steps - r.step - 1) as f64;
        match &self.bar {
            Some(bar) => {
                bar.set_message(format!("loss {:.4}  {speed}", r.loss));
                bar.set_position(r.step as u64 + 1);
                self.last = Some(format!("step {:>5}/{}  loss {:.4}  {speed}", r.step + 1, self.steps, r.loss));
            }
            None if r.step % self.log_every == 0 || r.step + 1 == self.steps => {
                eprintln!("step {:>5}/{}  loss {:.4}  {speed}  eta {eta:.1}s", r.step + 1, self.steps, r.loss);
            }
            None => {}
        }
        if let Some(f) = self.metrics.as_mut() {
            let forced = std::mem::take(&mut self.forced);
            let eval = r.eval.as_ref();
            let line = MetricsLine {
                step: r.step + 1,
                loss: r.loss,
                samples: r.samples,
                seconds: r.seconds,
                samples_per_s: rate,
                lr: Some(r.lr),
                eval_loss: eval.map(|e| e.loss),
                eval_accuracy: eval.and_then(|e| e.accuracy),
                eval_perplexity: eval.and_then(|e| eval_perplexity(e, self.language_model)),
                skipped: r.skipped,
                forced,
            };
            if let Ok(text) = serde_json::to_string(&line) {
                let _ = writeln!(f, "{text}");
            }
        }
    }

    /// Prints a line to stderr: above the bar while it is drawn, else plainly. The bar is
    /// suspended (cleared, the line printed, the bar redrawn) rather than given the line
    /// with `ProgressBar::println`, which queues it for the next rate-limited draw: lines
    /// queued just before the bar is cleared at the end were lost.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| eprintln!("{line}")),
            None => eprintln!("{line}"),
        }
    }

    /// Clears the bar (leaving the last step as a plain line), so that what follows starts
    /// on a line of its own.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
            if let Some(last) = self.last.take() {
                eprintln!("{last}");
            }
        }
    }
}

impl Drop for Progress {
    /// A run that ends in an error clears the bar too, so the error starts its own line
    /// (indicatif's own drop leaves the bar drawn, the cursor after it).
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::speed_text;

    #[test]
    fn slow_steps_show_seconds_per_step() {
        assert_eq!(speed_text(1234.4, 0.1), "1234 samples/s");
        assert_eq!(speed_text(4.26, 0.94), "4.3 samples/s");
        assert_eq!(speed_text(0.25, 16.0), "16.0 s/step");
        assert_eq!(speed_text(1.1, 3.6), "3.6 s/step");
    }
}
