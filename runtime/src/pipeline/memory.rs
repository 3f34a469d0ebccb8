//! Live tensor bytes per stage: what a worker holds at each point of its schedule
//! (weight versions, the gradient accumulator, optimizer state, stashed activations),
//! counted so the planner's memory prediction can be checked against a real run.
//!
//! Activations are counted the way the planner's cost model counts them: the outputs of
//! every non-view kernel a forward that records a graph produced (what autograd may keep
//! for the backward pass), plus the stage inputs the worker stashes. Under full
//! recomputation a stashed microbatch holds only its inputs; the recomputed activations
//! of the one microbatch being back-propagated count while they live.

use tch::Tensor;

/// Bytes of a tensor's elements.
pub fn bytes_of(t: &Tensor) -> u64 {
    t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
}

/// A stage's live bytes at one moment, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageMemory {
    /// Sum of the other fields.
    pub total: u64,
    /// Every weight version held.
    pub weights: u64,
    /// The gradient accumulator (and the gradients of an update in progress).
    pub gradients: u64,
    pub optimizer: u64,
    /// Stashed activations and stage inputs of in-flight microbatches.
    pub activations: u64,
    /// Non-trainable stored tensors (constants, running statistics).
    pub constants: u64,
    /// Weight versions held.
    pub versions: usize,
    /// Microbatches between their forward and their backward.
    pub in_flight: usize,
}

impl StageMemory {
    /// Keeps `now` if its total is the larger.
    pub(crate) fn keep_peak(&mut self, mut now: StageMemory) {
        now.total = now.weights + now.gradients + now.optimizer + now.activations + now.constants;
        if now.total > self.total {
            *self = now;
        }
    }
}
