//! A small seeded generator (SplitMix64): fast enough to fill a billion floats in seconds,
//! reproducible across machines, and with no dependency.

use pipewright_core::rng::SplitMix64;

pub struct SplitMix(SplitMix64);

impl SplitMix {
    /// The stream for tensor `index` of a model generated with `seed`: streams of
    /// different tensors do not depend on each other, so storage order does not matter.
    pub fn for_tensor(seed: u64, index: usize) -> SplitMix {
        SplitMix(SplitMix64::new(seed ^ 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(index as u64 + 1)))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [-1, 1).
    pub fn next_signed_unit(&mut self) -> f32 {
        // The top 24 bits give every representable step of an f32 in [0, 1).
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        2.0 * unit - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::SplitMix;

    #[test]
    fn values_are_reproducible_and_cover_the_range() {
        let draw = |seed, index| {
            let mut r = SplitMix::for_tensor(seed, index);
            (0..10_000).map(|_| r.next_signed_unit()).collect::<Vec<_>>()
        };
        let a = draw(7, 3);
        assert_eq!(a, draw(7, 3));
        assert_ne!(a, draw(7, 4));
        assert_ne!(a, draw(8, 3));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!(a.iter().any(|&v| v < -0.99) && a.iter().any(|&v| v > 0.99));
    }
}
