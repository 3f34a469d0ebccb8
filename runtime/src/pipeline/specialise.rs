//! A stage program specialised for one microbatch size before its first step, so that a
//! step reads nothing back from the device to decide a shape (on a GPU each such read
//! stalls the stream).
//!
//! Every slot's shape is static once the batch is fixed (`Extent::Batch(k)` is `k * N`),
//! so Shape and Size nodes are evaluated here, and so is every cheap, deterministic node
//! whose inputs are all known now (stored constants, and what is computed from them and
//! from shapes: the Shape→Gather→Concat→Reshape chains of exported attention code, the
//! `[N]` slot codegen adds for fixed-batch rewrites). Their outputs become constants of
//! the run; the nodes are not run again. Every known value keeps a host copy, which the
//! kernels read in place of the device tensor (`exec::run_node_with`); a folded Shape
//! checks, when the step reaches it, that its input has the declared shape.
//!
//! A known value that no remaining kernel computes with on the device (every read left
//! is one the op makes on the host: a Reshape's shape, a Slice's bounds, an axis) is
//! never uploaded: its slot holds a stand-in with its shape and type and no values
//! ([`crate::exec::stand_in`]). Stored constants that may end up so stay on the host
//! when the stage loads ([`may_stay_on_host`]) and are uploaded here only if a kernel
//! needs them on the device.

use tch::{Device, Kind, Tensor};

use crate::exec::{run_node_with, stand_in, Mode, Signatures};
use crate::pipeline::memory::bytes_of;
use crate::program::{Extent, Program, SlotId};
use pipewright_ops::Op;

/// The largest value (elements) folded or given a host copy: shapes, axes, pads, small
/// masks; larger constants stay on the device only.
pub(crate) const HOST_LIMIT: i64 = 1 << 16;

/// A program's values known before a step at one batch size.
pub(crate) struct Specialised {
    /// The batch size (`N`) it holds for; `None` when no input has a batch axis.
    pub batch: Option<i64>,
    /// Per slot: its value on the host, when known before the step.
    pub host: Vec<Option<Tensor>>,
    /// Known values placed in their slots before a run: folded nodes' outputs and the
    /// constants kept on the host, each on the stage's device when a kernel computes with
    /// it there, otherwise as a stand-in without values.
    pub values: Vec<(SlotId, Tensor)>,
    /// Known values (stored constants and folded outputs) never uploaded: how many, and
    /// their bytes.
    pub off_device: (usize, u64),
    /// Bytes of the known values this specialisation uploaded.
    pub uploaded_bytes: u64,
    /// Per instruction: folded (not run).
    pub folded: Vec<bool>,
    /// Per folded Shape or Size node: its input and the shape the step must give it.
    pub expect: Vec<Option<(SlotId, Vec<i64>)>>,
}

impl Specialised {
    /// Folds what `constants` (trainable weights and running statistics excluded) and the
    /// static shapes at batch `batch` determine; known values a kernel computes with go
    /// to `device`, among them those of the constants in `kept` (held on the host so far).
    pub(crate) fn new(p: &Program, signatures: &Signatures, constants: &[(SlotId, &Tensor)], kept: &[SlotId], batch: Option<i64>, device: Device) -> Result<Specialised, String> {
        let mut host: Vec<Option<Tensor>> = (0..p.slots.len()).map(|_| None).collect();
        for (s, t) in constants {
            if t.numel() as i64 <= HOST_LIMIT {
                // A one-off read at start-up, never during a step.
                host[s.index()] = Some(t.detach().f_to(Device::Cpu).map_err(|e| format!("copying a constant to the host: {e}"))?);
            }
        }
        let mut out = Specialised { batch, host, values: Vec::new(), off_device: (0, 0), uploaded_bytes: 0, folded: vec![false; p.instrs.len()], expect: vec![None; p.instrs.len()] };
        for (i, ins) in p.instrs.iter().enumerate() {
            let used: Vec<bool> = ins.outputs.iter().map(Option::is_some).collect();
            let outs = if matches!(ins.op, Op::Shape { .. } | Op::Size) {
                let Some(x) = ins.inputs.first().copied().flatten() else { continue };
                let Some(dims) = static_shape(p, x, batch) else { continue };
                // The kernels read only the sizes: a broadcast scalar holds no data.
                let stand_in = Tensor::f_zeros([], (Kind::Float, Device::Cpu)).and_then(|z| z.f_expand(&dims, false)).map_err(|e| format!("node {:?}: {e}", ins.name))?;
                out.expect[i] = Some((x, dims));
                run_node_with(&ins.op, signatures.get(i), &[Some(&stand_in)], &[], Mode::Eval, Some(&used))
            } else if foldable(&ins.op) && ins.inputs.iter().flatten().all(|s| out.host[s.index()].is_some()) {
                let args: Vec<Option<&Tensor>> = ins.inputs.iter().map(|s| s.and_then(|s| out.host[s.index()].as_ref())).collect();
                run_node_with(&ins.op, signatures.get(i), &args, &args, Mode::Eval, Some(&used))
            } else {
                continue;
            };
            let outs = outs.map_err(|e| format!("node {:?} ({}): {e}", ins.name, ins.op.name()))?;
            if outs.len() < ins.outputs.len() || outs.iter().any(|t| t.numel() as i64 > HOST_LIMIT) {
                out.expect[i] = None;
                continue;
            }
            out.folded[i] = true;
            for (slot, t) in ins.outputs.iter().zip(outs) {
                if let Some(s) = slot {
                    out.host[s.index()] = Some(t);
                }
            }
        }
        out.place_known_values(p, kept, device)?;
        Ok(out)
    }

    /// Puts every folded output and every constant in `kept` in `values`: uploaded when a
    /// kernel that still runs computes with it, a stand-in otherwise.
    fn place_known_values(&mut self, p: &Program, kept: &[SlotId], device: Device) -> Result<(), String> {
        let on_device = self.read_on_device(p);
        let folded_outputs = p.instrs.iter().zip(&self.folded).filter(|(_, f)| **f).flat_map(|(ins, _)| ins.outputs.iter().flatten().copied());
        let known: Vec<SlotId> = kept.iter().copied().chain(folded_outputs).collect();
        for s in known {
            let Some(t) = self.host[s.index()].as_ref() else { continue };
            let name = &p.slots[s.index()].name;
            let value = if on_device[s.index()] {
                self.uploaded_bytes += bytes_of(t);
                t.f_to_device(device)
            } else {
                self.off_device.0 += 1;
                self.off_device.1 += bytes_of(t);
                stand_in(t, device)
            };
            self.values.push((s, value.map_err(|e| format!("placing {name:?}: {e}"))?));
        }
        Ok(())
    }

    /// Per slot: some instruction that still runs computes with it on the device (reads it
    /// other than as [`Op::reads_on_host`] says), or it leaves the stage.
    fn read_on_device(&self, p: &Program) -> Vec<bool> {
        let mut on_device = vec![false; p.slots.len()];
        for s in &p.outputs {
            on_device[s.index()] = true;
        }
        for (ins, _) in p.instrs.iter().zip(&self.folded).filter(|(_, f)| !**f) {
            for (j, s) in ins.inputs.iter().enumerate() {
                if let Some(s) = s.filter(|_| !ins.op.reads_on_host(j)) {
                    on_device[s.index()] = true;
                }
            }
        }
        on_device
    }
}

/// Whether stored constant `s` may need no device copy: it does not leave the stage, and
/// every instruction reading it reads it on the host or may be folded. Such a constant is
/// kept on the host at load and uploaded by the specialisation only if needed.
pub(crate) fn may_stay_on_host(p: &Program, s: SlotId) -> bool {
    let read_off_device = |ins: &crate::program::Instr| ins.inputs.iter().enumerate().all(|(j, x)| *x != Some(s) || ins.op.reads_on_host(j) || foldable(&ins.op));
    !p.outputs.contains(&s) && p.instrs.iter().all(read_off_device)
}

/// The batch size `inputs` (the program's inputs, in order) were given at: the first
/// batch axis's extent over its multiple.
pub(crate) fn batch_of(p: &Program, inputs: &[Tensor]) -> Option<i64> {
    p.inputs.iter().zip(inputs).find_map(|(s, t)| {
        let shape = &p.slots[s.index()].shape;
        let (axis, k) = shape.iter().enumerate().find_map(|(a, e)| if let Extent::Batch(k) = e { Some((a, *k)) } else { None })?;
        t.size().get(axis).map(|n| n / k.max(1))
    })
}

/// A slot's shape at batch `batch`, when every extent is known.
fn static_shape(p: &Program, s: SlotId, batch: Option<i64>) -> Option<Vec<i64>> {
    p.slots[s.index()].shape.iter().map(|e| if let Extent::Fixed(v) = e { Some(*v) } else { batch.map(|n| e.at(n)) }).collect()
}

/// Nodes that are cheap deterministic functions of their inputs' values (no randomness,
/// no training-mode behaviour, no weights): what shape arithmetic is made of.
fn foldable(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_)
            | Op::Binary(_)
            | Op::Variadic(_)
            | Op::Clip { .. }
            | Op::IsInf { .. }
            | Op::Cast { .. }
            | Op::CastLike { .. }
            | Op::Reshape { .. }
            | Op::Flatten { .. }
            | Op::Transpose { .. }
            | Op::Squeeze { .. }
            | Op::Unsqueeze { .. }
            | Op::Concat { .. }
            | Op::Split(_)
            | Op::Slice(_)
            | Op::Gather { .. }
            | Op::GatherElements { .. }
            | Op::GatherND { .. }
            | Op::Expand
            | Op::Where
            | Op::ConstantOfShape { .. }
            | Op::Range
            | Op::Reduce(_)
            | Op::ArgMax { .. }
            | Op::ArgMin { .. }
            | Op::Trilu { .. }
            | Op::Pad(_)
            | Op::Tile
            | Op::CumSum { .. }
            | Op::OneHot { .. }
            | Op::ScatterND { .. }
            | Op::ScatterElements { .. }
            | Op::EyeLike { .. }
    )
}
