//! A stage program: the kernels of one stage in execution order over numbered slots,
//! with its weights and constants. Codegen writes it; the runtime executes it. Plain
//! data, so it builds without libtorch.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::kernel::{ElemType, Kernel};

/// Index of a slot (one tensor value) in a program; prints as `s3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SlotId(pub u32);

impl SlotId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for SlotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s{}", self.0)
    }
}

/// One extent: fixed, or a multiple of the batch size `N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Extent {
    Fixed(i64),
    Batch(i64),
}

impl Extent {
    pub fn at(self, batch: i64) -> i64 {
        match self {
            Extent::Fixed(v) => v,
            Extent::Batch(k) => k * batch,
        }
    }
}

/// The declared type of a slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotInfo {
    /// The source model's value name, for messages.
    pub name: String,
    pub elem: ElemType,
    pub shape: Vec<Extent>,
}

/// A tensor stored in the program: a trainable parameter or a constant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    pub slot: SlotId,
    pub elem: ElemType,
    pub dims: Vec<i64>,
    #[serde(skip)]
    pub bytes: Bytes,
    pub trainable: bool,
}

/// One kernel application.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Instr {
    /// The source node's name, for messages.
    pub name: String,
    pub kernel: Kernel,
    pub inputs: Vec<Option<SlotId>>,
    pub outputs: Vec<Option<SlotId>>,
}

/// A straight-line program over slots.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Program {
    pub slots: Vec<SlotInfo>,
    /// Slots fed by the caller, in order.
    pub inputs: Vec<SlotId>,
    /// Slots returned to the caller, in order.
    pub outputs: Vec<SlotId>,
    pub stored: Vec<Stored>,
    pub instrs: Vec<Instr>,
}

impl Program {
    /// For each slot, the index of the last instruction reading it (`usize::MAX` for
    /// program outputs, which live to the end). Slots are freed after their last read.
    pub fn last_uses(&self) -> Vec<Option<usize>> {
        let mut last = vec![None; self.slots.len()];
        for (i, ins) in self.instrs.iter().enumerate() {
            for s in ins.inputs.iter().flatten() {
                last[s.index()] = Some(i);
            }
        }
        for s in &self.outputs {
            last[s.index()] = Some(usize::MAX);
        }
        last
    }

    /// The slot of a program input by its source name.
    pub fn input_named(&self, name: &str) -> Option<SlotId> {
        self.inputs.iter().copied().find(|s| self.slots[s.index()].name == name)
    }
}
