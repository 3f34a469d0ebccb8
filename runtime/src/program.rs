//! A stage program: the ops of one stage in execution order over numbered slots,
//! with its weights and constants. Codegen writes it; the runtime executes it. Plain
//! data, so it builds without libtorch.

use bytes::Bytes;
use pipewright_core::UpdateRule;
use serde::{Deserialize, Serialize};

use pipewright_ops::{DType, Op};

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

/// The axis of `shape` that carries the batch and the extents of the others (a sample's
/// shape): `None` unless exactly one extent is `N` and the others are fixed. The batch
/// is usually the first axis; a sequence-first recurrent network's output (`[T,N,V]`) or
/// a stack of layers' outputs (`[L,N,S,D]`) carries it further in.
pub fn split_batch_axis(shape: &[Extent]) -> Option<(usize, Vec<i64>)> {
    let axis = shape.iter().position(|e| *e == Extent::Batch(1))?;
    let rest = shape.iter().enumerate().filter(|(a, _)| *a != axis).map(|(_, e)| match e {
        Extent::Fixed(v) => Some(*v),
        Extent::Batch(_) => None,
    });
    Some((axis, rest.collect::<Option<Vec<i64>>>()?))
}

/// The declared type of a slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotInfo {
    /// The source model's value name, for messages.
    pub name: String,
    pub elem: DType,
    pub shape: Vec<Extent>,
    /// Index of the last instruction reading the slot; `None` for a program output (it
    /// lives to the end) or a slot nothing reads. Filled by [`Program::fill_last_uses`]
    /// when the module is written; absent in older modules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_use: Option<u32>,
}

/// A tensor stored in the program: a trainable parameter or a constant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    pub slot: SlotId,
    pub elem: DType,
    pub dims: Vec<i64>,
    #[serde(skip)]
    pub bytes: Bytes,
    pub trainable: bool,
    /// Weight version slots the stage may hold (2 for a PipeDream-2BW parameter, 1 for a
    /// constant or a parameter updated after a flush), as the weight-versioning pass
    /// decided; the runtime refuses to hold more.
    pub versions: u32,
    /// How the tensor is updated, as the weight-versioning pass decided; the runtime runs
    /// each microbatch with the weight version this rule names.
    pub update: UpdateRule,
    /// A tied weight read in several stages: every stage holding a copy (this one
    /// included), ascending. Their gradients are summed before each update so the copies
    /// stay identical. Empty for a weight only this stage reads (and in older modules).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sync: Vec<u32>,
}

fn is_false(v: &bool) -> bool {
    !*v
}

/// One op applied to slots.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Instr {
    /// The source node's name, for messages.
    pub name: String,
    pub op: Op,
    pub inputs: Vec<Option<SlotId>>,
    pub outputs: Vec<Option<SlotId>>,
    /// The instruction belongs to the stage's recompute segment: its outputs are not
    /// stashed for the backward pass but recomputed (from the stashed stage inputs and
    /// stashed outputs) right before it. `false` for stashed ones and in older modules.
    #[serde(default, skip_serializing_if = "is_false")]
    pub recompute: bool,
}

/// A straight-line program over slots.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// Identifies the compile that wrote the pipeline: every stage of one compile carries
    /// the same id, so stages of different compiles are not mixed. Empty when unknown.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pipeline: String,
    pub slots: Vec<SlotInfo>,
    /// Slots fed by the caller, in order.
    pub inputs: Vec<SlotId>,
    /// Slots returned to the caller, in order.
    pub outputs: Vec<SlotId>,
    pub stored: Vec<Stored>,
    pub instrs: Vec<Instr>,
    /// Inputs whose values depend on the microbatch size alone (shapes, and what an earlier
    /// stage computed from shapes and constants): the same for every microbatch of one
    /// size, so an executor reads them once when it specialises the program. Empty in
    /// older modules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub static_inputs: Vec<SlotId>,
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

    /// Stores each slot's [`SlotInfo::last_use`] from the instruction list (program
    /// outputs and unread slots get `None`).
    pub fn fill_last_uses(&mut self) {
        let last = self.last_uses();
        for (info, l) in self.slots.iter_mut().zip(last) {
            info.last_use = l.filter(|&i| i != usize::MAX).map(|i| i as u32);
        }
    }

    /// For each slot, the index of the first instruction writing it (`None` for program
    /// inputs, stored tensors and slots nothing writes).
    pub fn first_defs(&self) -> Vec<Option<usize>> {
        let mut first = vec![None; self.slots.len()];
        for (i, ins) in self.instrs.iter().enumerate() {
            for s in ins.outputs.iter().flatten() {
                if first[s.index()].is_none() {
                    first[s.index()] = Some(i);
                }
            }
        }
        first
    }

    /// Instructions in the recompute segment.
    pub fn recompute_count(&self) -> usize {
        self.instrs.iter().filter(|i| i.recompute).count()
    }

    /// Slots kept for the backward pass: the program inputs plus every slot written by an
    /// instruction outside the recompute segment (stored tensors are weights, not counted).
    pub fn stashed_slots(&self) -> Vec<SlotId> {
        let mut stashed = vec![false; self.slots.len()];
        for s in &self.inputs {
            stashed[s.index()] = true;
        }
        for ins in self.instrs.iter().filter(|i| !i.recompute) {
            for s in ins.outputs.iter().flatten() {
                stashed[s.index()] = true;
            }
        }
        for t in &self.stored {
            stashed[t.slot.index()] = false;
        }
        (0..self.slots.len()).filter(|&k| stashed[k]).map(|k| SlotId(k as u32)).collect()
    }

    /// The slot of a program input by its source name.
    pub fn input_named(&self, name: &str) -> Option<SlotId> {
        self.inputs.iter().copied().find(|s| self.slots[s.index()].name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::{split_batch_axis, Extent};

    /// The batch axis is found wherever it is; a shape with none, or with more than one
    /// extent following the batch, has no sample shape.
    #[test]
    fn the_batch_axis_is_found_wherever_it_is() {
        let (n, f) = (Extent::Batch(1), Extent::Fixed);
        assert_eq!(split_batch_axis(&[n, f(10)]), Some((0, vec![10])));
        assert_eq!(split_batch_axis(&[f(3), n, f(5), f(64)]), Some((1, vec![3, 5, 64])));
        assert_eq!(split_batch_axis(&[f(3), f(5)]), None);
        assert_eq!(split_batch_axis(&[Extent::Batch(2), f(5)]), None);
        assert_eq!(split_batch_axis(&[n, f(2), Extent::Batch(3)]), None);
    }
}
