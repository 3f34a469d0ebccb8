//! Mixed precision: the compute element type of a [`Precision`] and fp16's dynamic loss
//! scale.
//!
//! Master weights and optimizer state stay fp32: a forward casts the fp32 weights it
//! uses to the compute type, the backward's gradients are cast back to fp32 before they
//! are accumulated, and the optimizer updates the fp32 weights. Under fp16 the loss is
//! multiplied by the scale before the backward (small gradients would otherwise underflow
//! in fp16) and the gradients are divided by it before the update.
//!
//! Skipping must be one decision for the whole pipeline: under 2BW every stage holds its
//! own weight versions, so if one stage skipped an update and another applied it the
//! stages would train different models from then on. Each stage therefore contributes
//! whether its own gradients overflowed to a sum over every stage and replica
//! (`Transport::all_reduce_sum`, the reduction gradient clipping uses) and all of them
//! feed the same answer to [`LossScaler::update`]: they skip together and their scales
//! stay equal.

pub use pipewright_core::Precision;
use tch::Kind;

/// The libtorch element type training computes in under `p`.
pub fn compute_kind(p: Precision) -> Kind {
    match p {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        Precision::Fp16 => Kind::Half,
    }
}

/// fp16's dynamic loss scale (PyTorch's `GradScaler` rule): an overflow skips the update
/// and halves the scale; `growth_interval` updates in a row without one double it.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    pub scale: f64,
    pub growth_interval: u32,
    /// Updates applied since the last overflow or growth.
    pub good_steps: u32,
    /// Updates skipped so far.
    pub skipped: u64,
}

impl LossScaler {
    /// PyTorch's defaults: scale 2^16, growth after 2,000 good steps.
    pub fn new() -> Self {
        Self::with(65536.0, 2000)
    }

    pub fn with(scale: f64, growth_interval: u32) -> Self {
        LossScaler { scale, growth_interval: growth_interval.max(1), good_steps: 0, skipped: 0 }
    }

    /// Records one step's outcome (`overflow`: some stage's gradients were not finite) and
    /// says whether to apply the update.
    pub fn update(&mut self, overflow: bool) -> bool {
        if overflow {
            // The scale never falls below 1: below it, scaling would only lose precision.
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
            self.skipped += 1;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
        true
    }
}

impl Default for LossScaler {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_skips_and_halves() {
        let mut s = LossScaler::with(1024.0, 3);
        assert!(s.update(false));
        assert!(!s.update(true));
        assert_eq!((s.scale, s.good_steps, s.skipped), (512.0, 0, 1));
        assert!(!s.update(true));
        assert_eq!(s.scale, 256.0);
    }

    #[test]
    fn grows_after_interval_good_steps() {
        let mut s = LossScaler::with(8.0, 3);
        assert!(s.update(false) && s.update(false));
        assert_eq!(s.scale, 8.0);
        assert!(s.update(false));
        assert_eq!((s.scale, s.good_steps), (16.0, 0));
        // An overflow restarts the count.
        s.update(false);
        s.update(false);
        s.update(true);
        assert_eq!(s.scale, 8.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale, 8.0);
        s.update(false);
        assert_eq!(s.scale, 16.0);
    }

    #[test]
    fn scale_stays_at_least_one() {
        let mut s = LossScaler::with(2.0, 10);
        for _ in 0..5 {
            s.update(true);
        }
        assert_eq!((s.scale, s.skipped), (1.0, 5));
    }

    #[test]
    fn kinds() {
        assert_eq!(compute_kind(Precision::Fp32), Kind::Float);
        assert_eq!(compute_kind(Precision::Bf16), Kind::BFloat16);
        assert_eq!(compute_kind(Precision::Fp16), Kind::Half);
    }
}
