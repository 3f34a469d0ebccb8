//! Runs a [`Program`] on libtorch: loads its stored tensors onto a device once, then
//! executes the instructions in order, dropping each intermediate after its last use.
//! With autograd enabled the result carries the graph for the backward pass.

use tch::Tensor;

use crate::exec::{run_node, tensor_from_bytes, KernelError, Mode, Signatures};
use crate::program::{Program, SlotId};

/// Why a program could not run.
#[derive(Debug, thiserror::Error)]
pub enum InterpError {
    #[error("the program takes {expected} inputs, {got} were given")]
    InputCount { expected: usize, got: usize },
    #[error("stored tensor for slot {slot} ({name:?}): {source}")]
    Stored { slot: SlotId, name: String, #[source] source: KernelError },
    #[error("node {node:?} ({op}): {source}")]
    Kernel { node: String, op: &'static str, #[source] source: KernelError },
    #[error("node {node:?}: produced {got} outputs, the program expects {expected}")]
    OutputCount { node: String, expected: usize, got: usize },
    #[error("slot {slot} ({name:?}) is read before it is written")]
    Unset { slot: SlotId, name: String },
    #[error("cannot move tensors to {device:?}: {source}")]
    Device { device: tch::Device, #[source] source: tch::TchError },
}

/// A program with its stored tensors resident on a device.
pub struct Interpreter {
    program: Program,
    device: tch::Device,
    stored: Vec<(SlotId, Tensor)>,
    last_use: Vec<Option<usize>>,
    signatures: Signatures,
}

impl Interpreter {
    /// Uploads the program's weights and constants; trainable ones require gradients.
    pub fn new(program: Program, device: tch::Device) -> Result<Interpreter, InterpError> {
        let mut stored = Vec::with_capacity(program.stored.len());
        for s in &program.stored {
            let name = program.slots[s.slot.index()].name.clone();
            let t = tensor_from_bytes(s.elem, &s.dims, &s.bytes).map_err(|source| InterpError::Stored { slot: s.slot, name, source })?;
            let t = t.f_to_device(device).map_err(|source| InterpError::Device { device, source })?;
            let t = if s.trainable { t.set_requires_grad(true) } else { t };
            stored.push((s.slot, t));
        }
        let last_use = program.last_uses();
        let signatures = Signatures::of(&program);
        Ok(Interpreter { program, device, stored, last_use, signatures })
    }

    pub fn program(&self) -> &Program {
        &self.program
    }

    pub fn device(&self) -> tch::Device {
        self.device
    }

    /// The resident trainable tensors, in program order.
    pub fn parameters(&self) -> Vec<&Tensor> {
        self.program.stored.iter().zip(&self.stored).filter(|(s, _)| s.trainable).map(|(_, (_, t))| t).collect()
    }

    /// Executes the program on `inputs` (in the order of `Program::inputs`).
    pub fn run(&self, inputs: &[Tensor], mode: Mode) -> Result<Vec<Tensor>, InterpError> {
        let slots = self.execute(inputs, mode, true)?;
        let p = &self.program;
        p.outputs.iter().map(|s| slots[s.index()].as_ref().map(|t| t.shallow_clone()).ok_or_else(|| self.unset(*s))).collect()
    }

    /// Executes the program and keeps every slot's tensor (for per-node profiling).
    pub fn run_keep_all(&self, inputs: &[Tensor], mode: Mode) -> Result<Vec<Option<Tensor>>, InterpError> {
        self.execute(inputs, mode, false)
    }

    fn execute(&self, inputs: &[Tensor], mode: Mode, free: bool) -> Result<Vec<Option<Tensor>>, InterpError> {
        let p = &self.program;
        if inputs.len() != p.inputs.len() {
            return Err(InterpError::InputCount { expected: p.inputs.len(), got: inputs.len() });
        }
        let mut slots: Vec<Option<Tensor>> = (0..p.slots.len()).map(|_| None).collect();
        for (s, t) in &self.stored {
            slots[s.index()] = Some(t.shallow_clone());
        }
        for (s, t) in p.inputs.iter().zip(inputs) {
            slots[s.index()] = Some(t.shallow_clone());
        }
        for (i, ins) in p.instrs.iter().enumerate() {
            let outs = {
                let args: Vec<Option<&Tensor>> = ins
                    .inputs
                    .iter()
                    .map(|s| s.map(|s| slots[s.index()].as_ref().ok_or_else(|| self.unset(s))).transpose())
                    .collect::<Result<_, _>>()?;
                let used: Vec<bool> = ins.outputs.iter().map(Option::is_some).collect();
                run_node(&ins.op, self.signatures.get(i), &args, mode, Some(&used)).map_err(|source| InterpError::Kernel { node: ins.name.clone(), op: ins.op.name(), source })?
            };
            if outs.len() < ins.outputs.len() {
                return Err(InterpError::OutputCount { node: ins.name.clone(), expected: ins.outputs.len(), got: outs.len() });
            }
            for (slot, t) in ins.outputs.iter().zip(outs) {
                if let Some(s) = slot {
                    slots[s.index()] = Some(t);
                }
            }
            for s in ins.inputs.iter().flatten() {
                if free && self.last_use[s.index()] == Some(i) {
                    slots[s.index()] = None;
                }
            }
        }
        Ok(slots)
    }

    fn unset(&self, s: SlotId) -> InterpError {
        InterpError::Unset { slot: s, name: self.program.slots[s.index()].name.clone() }
    }
}
