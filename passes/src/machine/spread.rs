//! How much the operations' times vary from one microbatch to the next, measured from a
//! trace ([`duration_factors`]) and drawn from in a replay ([`DurationSpread`]).

use std::collections::HashMap;

use pipewright_core::rng::mix;
use pipewright_core::timeline::{TraceEvent, TraceKind};
use serde::Serialize;

/// How much an operation's time varies from one microbatch to the next: measured
/// durations, each over the mean of its stage and kind. A replay of mean times leaves out
/// what this adds where stages are near balance: each hand-off waits for the slower of two
/// operations, and the mean of that maximum exceeds the maximum of the means (resnet18's
/// two stages on this CPU: 1.5 to 3.9 points of a 0.08 to 0.10 bubble, docs/simulator.md).
/// With a spread, each forward, recompute and backward takes its stage's time times a
/// factor drawn from these, the same draw in both of the simulator's engines, and the
/// simulator reports the mean of several replays, each its own draw.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DurationSpread {
    factors: Vec<f64>,
    /// Which of the simulator's replays this is (`DurationSpread::with_draw`); it seeds
    /// the draws.
    draw: u64,
}

impl DurationSpread {
    /// From measured factors (durations over their means): the finite positive ones,
    /// rescaled to a mean of 1 so that a stage's time stays its mean. `None` with fewer
    /// than 2, which spread nothing.
    pub fn new(factors: &[f64]) -> Option<DurationSpread> {
        let mut kept: Vec<f64> = factors.iter().copied().filter(|f| f.is_finite() && *f > 0.0).collect();
        kept.sort_by(f64::total_cmp);
        if kept.len() < 2 {
            return None;
        }
        let mean = kept.iter().sum::<f64>() / kept.len() as f64;
        Some(DurationSpread { factors: kept.iter().map(|f| f / mean).collect(), draw: 0 })
    }

    /// The factors, mean 1, in increasing order.
    pub fn factors(&self) -> &[f64] {
        &self.factors
    }

    /// The same factors for replay `draw`.
    pub(crate) fn with_draw(&self, draw: u64) -> DurationSpread {
        DurationSpread { draw, ..self.clone() }
    }

    /// The factor of stage `stage`'s operation `kind` (0 forward, 1 recompute, 2 backward)
    /// on microbatch `mb`: a function of those and the draw alone, so that both engines and
    /// any order of evaluation draw alike.
    pub(crate) fn factor(&self, stage: usize, mb: u64, kind: u64) -> f64 {
        let h = mix(mix(mix(mix(self.draw) ^ stage as u64) ^ mb) ^ kind);
        self.factors[(h % self.factors.len() as u64) as usize]
    }
}

/// Each forward and backward of `events`, its time in `seconds` (by index), over the mean
/// of its stage and kind there: the factors a [`DurationSpread`] is made of.
pub fn duration_factors(events: &[TraceEvent], seconds: &[f64]) -> Vec<f64> {
    let timed = || events.iter().zip(seconds).filter(|(e, _)| matches!(e.kind, TraceKind::Forward | TraceKind::Backward));
    let mut sums: HashMap<(usize, bool), (f64, usize)> = HashMap::new();
    for (e, &t) in timed() {
        let sum = sums.entry((e.stage, e.kind == TraceKind::Forward)).or_default();
        *sum = (sum.0 + t, sum.1 + 1);
    }
    timed()
        .filter_map(|(e, &t)| {
            let (sum, n) = sums[&(e.stage, e.kind == TraceKind::Forward)];
            (sum > 0.0).then(|| t * n as f64 / sum)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spread keeps the measured factors' shape and rescales them to a mean of 1;
    /// fewer than two usable factors spread nothing.
    #[test]
    fn a_spread_is_its_factors_over_their_mean() {
        let spread = DurationSpread::new(&[3.0, f64::NAN, 1.0, -2.0, 2.0, 0.0]).unwrap();
        assert_eq!(spread.factors(), [0.5, 1.0, 1.5]);
        assert!(DurationSpread::new(&[1.2, f64::INFINITY]).is_none());
        assert!(DurationSpread::new(&[]).is_none());
    }
}
