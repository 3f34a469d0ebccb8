//! Selective recomputation: the stage program is cut into maximal runs of instructions
//! with the same recompute flag ("pieces"). A kept piece runs with autograd and keeps its
//! graph (what its backward needs stays alive); a recomputed piece runs without a graph
//! and keeps only its inputs, and reruns with autograd right before its backward. Every
//! piece's inputs are detached leaves, so the backward runs piece by piece in reverse,
//! carrying the gradient of each value from the pieces that read it to the piece that
//! wrote it. Values only a recomputed piece's internals use are freed after the forward.

use std::collections::HashMap;
use std::ops::Range;

use tch::{Kind, Tensor};

use super::memory::bytes_of;
use super::specialise::Specialised;
use crate::exec::{run_node_with, Mode, Signatures};
use crate::program::{Program, SlotId};
use pipewright_ops::op::MixedPrecisionRule;
use pipewright_ops::Op;

/// A maximal run of instructions with the same recompute flag.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    range: Range<usize>,
    recompute: bool,
    /// Slots it reads that are written before it (stage inputs, earlier pieces' values);
    /// stored tensors excluded.
    inputs: Vec<SlotId>,
    /// Slots it writes that are read after it or are program outputs.
    outputs: Vec<SlotId>,
    /// Indices into the trainable weights it reads.
    params: Vec<usize>,
}

/// The pieces of `p`; `param_slots` are the trainable weights, `stored` every stored slot.
pub(crate) fn pieces(p: &Program, param_slots: &[SlotId]) -> Vec<Piece> {
    let stored: Vec<bool> = {
        let mut v = vec![false; p.slots.len()];
        for s in &p.stored {
            v[s.slot.index()] = true;
        }
        v
    };
    let mut out: Vec<Piece> = Vec::new();
    for (i, ins) in p.instrs.iter().enumerate() {
        match out.last_mut() {
            Some(last) if last.recompute == ins.recompute => last.range.end = i + 1,
            _ => out.push(Piece { range: i..i + 1, recompute: ins.recompute, inputs: Vec::new(), outputs: Vec::new(), params: Vec::new() }),
        }
    }
    let defined_in: Vec<Option<usize>> = {
        let mut v = vec![None; p.slots.len()];
        for (pi, piece) in out.iter().enumerate() {
            for ins in &p.instrs[piece.range.clone()] {
                for s in ins.outputs.iter().flatten() {
                    v[s.index()] = Some(pi);
                }
            }
        }
        v
    };
    let mut read_after: Vec<Option<usize>> = vec![None; p.slots.len()];
    for (pi, piece) in out.iter().enumerate() {
        for ins in &p.instrs[piece.range.clone()] {
            for s in ins.inputs.iter().flatten() {
                read_after[s.index()] = Some(read_after[s.index()].map_or(pi, |r: usize| r.max(pi)));
            }
        }
    }
    for s in &p.outputs {
        read_after[s.index()] = Some(usize::MAX);
    }
    for (pi, piece) in out.iter_mut().enumerate() {
        for ins in &p.instrs[piece.range.clone()] {
            for s in ins.inputs.iter().flatten() {
                if let Some(k) = param_slots.iter().position(|x| x == s) {
                    if !piece.params.contains(&k) {
                        piece.params.push(k);
                    }
                } else if !stored[s.index()] && defined_in[s.index()] != Some(pi) && !piece.inputs.contains(s) {
                    piece.inputs.push(*s);
                }
            }
            for s in ins.outputs.iter().flatten() {
                if read_after[s.index()].is_some_and(|r| r > pi) && !piece.outputs.contains(s) {
                    piece.outputs.push(*s);
                }
            }
        }
    }
    out
}

/// What the forward of one piece left for its backward.
enum PieceState {
    /// Leaf inputs and the outputs, whose graph reaches back to those leaves.
    Kept { leaves: Vec<(SlotId, Tensor)>, outputs: Vec<(SlotId, Tensor)> },
    /// The inputs to rerun from.
    Recompute { inputs: Vec<(SlotId, Tensor)> },
}

/// Weight gradients by weight index, and gradients of values by slot.
pub(crate) type Grads = (Vec<Option<Tensor>>, HashMap<SlotId, Tensor>);

/// A selective forward: per piece its state, the weight leaves and the program outputs.
pub(crate) struct PieceFwd {
    states: Vec<PieceState>,
    pub outputs: Vec<Tensor>,
    /// Live bytes it holds: kept pieces' outputs and every piece's inputs.
    pub act_bytes: u64,
}

/// One instruction's reads of trainable weights in a forward whose backward is split (the
/// input gradients first, the weight gradients later): an alias per weight operand, so
/// that the gradient through this read is its own (a weight read twice, as a tied
/// embedding and output layer are, gets one per read), and the instruction's outputs,
/// whose gradients the input-gradient pass keeps for the weight-gradient pass.
pub(crate) struct WeightRead {
    /// `(weight index, alias read)` per weight operand.
    pub aliases: Vec<(usize, Tensor)>,
    /// The outputs that carry a gradient.
    pub outputs: Vec<Tensor>,
    /// The instruction is a product (matrix product, convolution), whose weight gradient
    /// is a product of its own and waits for the weight-gradient pass. Other reads (a
    /// norm's scale, a bias) get their weight gradient with the input gradient: it comes
    /// out of the same kernel, or is a reduction.
    pub deferred: bool,
    /// For the products whose weight gradient the weight-gradient pass forms itself
    /// ([`DirectGrad`]) rather than through autograd: what it needs.
    pub direct: Option<DirectGrad>,
}

/// A product whose weights' gradients are formed directly from its kept output gradient
/// `g`, with the kernel autograd's own formula uses (`mm` of the transposed operand), so
/// the result is the one a whole backward gives, without walking the graph again.
pub(crate) enum DirectGrad {
    /// `MatMul(x, W)`, `W` a 2-D weight, `x` of rank 2 or more (as the product ran it,
    /// cast under mixed precision): `dW = x'^T g'`, `x'` and `g'` folded to 2-D as
    /// `matmul` folds them.
    MatMulRhs { x: Tensor },
    /// `Gemm(A, B, C)` with `alpha = 1`, `A` not transposed and not a weight, `B` a 2-D
    /// weight (transposed or not), `C` absent or a weight added with `beta = 1`:
    /// `dB = A^T g` (its transpose for `trans_b`), `dC = g` summed to `C`'s shape.
    GemmB { a: Tensor, trans_b: bool, c_shape: Option<Vec<i64>> },
}

impl DirectGrad {
    /// The direct form of instruction `op`'s weight gradients, given its weight operands
    /// (`(input index, alias)`) and the operands as the kernel ran them; `None` where
    /// autograd forms them.
    pub(crate) fn of(op: &Op, weights: &[(usize, &Tensor)], args: &[Option<&Tensor>]) -> Option<DirectGrad> {
        let arg = |j: usize| args.get(j).copied().flatten();
        let at: Vec<usize> = weights.iter().map(|(j, _)| *j).collect();
        let (w, x) = (arg(1)?, arg(0)?);
        // The operand as the kernel ran it, in the weight's operand's type (cast alike).
        if !op.forms_weight_gradient_directly(&at, w.dim(), x.dim()) || w.kind() != x.kind() {
            return None;
        }
        match (op, weights) {
            (Op::MatMul, _) => Some(DirectGrad::MatMulRhs { x: x.detach() }),
            (Op::Gemm(g), [_, rest @ ..]) => {
                let c_shape = rest.first().map(|(_, c)| c.size());
                Some(DirectGrad::GemmB { a: x.detach(), trans_b: g.trans_b, c_shape })
            }
            _ => None,
        }
    }

    /// The operand it keeps for the weight-gradient pass.
    pub(crate) fn operand(&self) -> &Tensor {
        match self {
            DirectGrad::MatMulRhs { x } => x,
            DirectGrad::GemmB { a, .. } => a,
        }
    }

    /// The gradients of the weight operands, in the order [`DirectGrad::of`] was given
    /// them, from the product's output gradient `g`, each in its weight's type `kinds`.
    pub(crate) fn gradients(&self, g: &Tensor, kinds: &[Kind]) -> Result<Vec<Tensor>, tch::TchError> {
        let grads = match self {
            DirectGrad::MatMulRhs { x } => {
                let (k, n) = (x.size().last().copied().unwrap_or(1), g.size().last().copied().unwrap_or(1));
                vec![x.f_reshape([-1, k])?.f_tr()?.f_mm(&g.f_reshape([-1, n])?)?]
            }
            DirectGrad::GemmB { a, trans_b, c_shape } => {
                let ab = a.f_tr()?.f_mm(g)?;
                let mut out = vec![if *trans_b { ab.f_tr()? } else { ab }];
                if let Some(shape) = c_shape {
                    out.push(g.f_sum_to_size(shape)?);
                }
                out
            }
        };
        grads.into_iter().zip(kinds).map(|(t, &k)| if t.kind() == k { Ok(t) } else { t.f_to_kind(k) }).collect()
    }
}

/// The parts of a worker the piece engine reads.
pub(crate) struct Engine<'a> {
    pub program: &'a Program,
    /// The declared types of the program's instructions.
    pub signatures: &'a Signatures,
    pub pieces: &'a [Piece],
    pub constants: &'a [(SlotId, Tensor)],
    pub param_slots: &'a [SlotId],
    pub mode: Mode,
    pub last_use: &'a [Option<usize>],
    /// `(instruction, mean index, variance index)` of BatchNormalization running stats.
    pub bn_stats: &'a [(usize, usize, usize)],
    /// The program specialised for this batch size: folded nodes and host copies.
    pub special: Option<&'a Specialised>,
    /// The type kernels compute in: fp32, or bf16/fp16 under mixed precision, where each
    /// node's float operands follow its [`MixedPrecisionRule`].
    pub compute: Kind,
}

fn leaf(t: &Tensor) -> Tensor {
    if t.is_floating_point() {
        t.detach().set_requires_grad(true)
    } else {
        t.detach()
    }
}

impl Engine<'_> {
    /// Slots with the constants and `params` (the trainable weights) set.
    pub(crate) fn base_slots(&self, params: &[Tensor]) -> Vec<Option<Tensor>> {
        let mut slots: Vec<Option<Tensor>> = (0..self.program.slots.len()).map(|_| None).collect();
        for (s, t) in self.constants {
            slots[s.index()] = Some(t.shallow_clone());
        }
        for (s, t) in self.param_slots.iter().zip(params) {
            slots[s.index()] = Some(t.shallow_clone());
        }
        for (s, t) in self.special.iter().flat_map(|sp| &sp.values) {
            slots[s.index()] = Some(t.shallow_clone());
        }
        slots
    }

    /// Runs the instructions of `range` over `slots`; frees slots after their last read
    /// when `free`. Returns the new running statistics when `stats` is set, and with
    /// `count_act` the bytes of the non-view kernel outputs (what a graph-recording
    /// forward keeps).
    ///
    /// With `reads`, each instruction reads every trainable weight through an alias of
    /// its own and is listed there with its outputs ([`WeightRead`]).
    pub(crate) fn run_range(
        &self,
        range: Range<usize>,
        slots: &mut [Option<Tensor>],
        free: bool,
        stats: bool,
        count_act: bool,
        mut reads: Option<&mut Vec<WeightRead>>,
    ) -> Result<(Vec<(usize, Tensor)>, u64), String> {
        let p = self.program;
        let (mut new_stats, mut act_bytes) = (Vec::new(), 0u64);
        for i in range {
            let ins = &p.instrs[i];
            if self.special.is_some_and(|sp| sp.folded[i]) {
                self.check_folded(i, slots)?;
                self.free_after(i, slots, free);
                continue;
            }
            let aliases = match reads {
                Some(_) => self.weight_aliases(ins, slots).map_err(|e| format!("node {:?}: aliasing its weights: {e}", ins.name))?,
                None => Vec::new(),
            };
            let (outs, direct) = {
                let args: Vec<Option<&Tensor>> = ins
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(j, s)| match aliases.iter().find(|a| a.0 == j) {
                        Some((_, _, alias)) => Ok(Some(alias)),
                        None => s.map(|s| slots[s.index()].as_ref().ok_or_else(|| format!("slot {s} ({:?}) is read before it is written", p.slots[s.index()].name))).transpose(),
                    })
                    .collect::<Result<_, _>>()?;
                let host: Vec<Option<&Tensor>> = match self.special {
                    Some(sp) => ins.inputs.iter().map(|s| s.and_then(|s| sp.host[s.index()].as_ref())).collect(),
                    None => Vec::new(),
                };
                let used: Vec<bool> = ins.outputs.iter().map(Option::is_some).collect();
                let cast = self.mixed_precision_operands(&ins.op, &args).map_err(|e| format!("node {:?} ({}): casting its operands: {e}", ins.name, ins.op.name()))?;
                let args: Vec<Option<&Tensor>> = match &cast {
                    Some(c) => c.iter().map(Option::as_ref).collect(),
                    None => args,
                };
                // A product reading weights: what the weight-gradient pass needs to form
                // their gradients itself.
                let direct = if !aliases.is_empty() {
                    DirectGrad::of(&ins.op, &aliases.iter().map(|(j, _, a)| (*j, a)).collect::<Vec<_>>(), &args)
                } else {
                    None
                };
                (run_node_with(&ins.op, self.signatures.get(i), &args, &host, self.mode, Some(&used)).map_err(|e| format!("node {:?} ({}): {e}", ins.name, ins.op.name()))?, direct)
            };
            if outs.len() < ins.outputs.len() {
                return Err(format!("node {:?}: produced {} outputs, expected {}", ins.name, outs.len(), ins.outputs.len()));
            }
            if stats {
                if let Some(&(_, mean, var)) = self.bn_stats.iter().find(|(n, _, _)| *n == i) {
                    if let (Some(m), Some(v)) = (outs.get(1), outs.get(2)) {
                        new_stats.push((mean, m.detach()));
                        new_stats.push((var, v.detach()));
                    }
                }
            }
            if let Some(list) = reads.as_deref_mut().filter(|_| !aliases.is_empty()) {
                let outputs = ins.outputs.iter().zip(&outs).filter(|(s, t)| s.is_some() && t.requires_grad()).map(|(_, t)| t.shallow_clone()).collect();
                let deferred = ins.op.defers_weight_gradient();
                list.push(WeightRead { aliases: aliases.into_iter().map(|(_, w, a)| (w, a)).collect(), outputs, deferred, direct });
            }
            for (slot, t) in ins.outputs.iter().zip(outs) {
                if let Some(s) = slot {
                    if count_act && !ins.op.is_view() {
                        act_bytes += bytes_of(&t);
                    }
                    slots[s.index()] = Some(t);
                }
            }
            self.free_after(i, slots, free);
        }
        Ok((new_stats, act_bytes))
    }

    /// `(input position, weight index, alias)` for each trainable weight `ins` reads.
    fn weight_aliases(&self, ins: &crate::program::Instr, slots: &[Option<Tensor>]) -> Result<Vec<(usize, usize, Tensor)>, tch::TchError> {
        let mut out = Vec::new();
        for (j, s) in ins.inputs.iter().enumerate() {
            let Some(s) = s else { continue };
            let Some(w) = self.param_slots.iter().position(|p| p == s) else { continue };
            if let Some(t) = slots[s.index()].as_ref().filter(|t| t.requires_grad()) {
                out.push((j, w, t.f_alias()?));
            }
        }
        Ok(out)
    }

    /// Under mixed precision, `op`'s operands cast as its rule wants (matrix products in
    /// the compute type, sensitive ops in fp32); `None` when none needs a cast.
    fn mixed_precision_operands(&self, op: &Op, args: &[Option<&Tensor>]) -> Result<Option<Vec<Option<Tensor>>>, tch::TchError> {
        if self.compute == Kind::Float {
            return Ok(None);
        }
        let target = match op.mixed_precision_rule() {
            MixedPrecisionRule::LowType => self.compute,
            MixedPrecisionRule::Fp32 => Kind::Float,
            MixedPrecisionRule::AsGiven => return Ok(None),
        };
        let low = |k: Kind| matches!(k, Kind::Float | Kind::Half | Kind::BFloat16);
        if !args.iter().flatten().any(|t| low(t.kind()) && t.kind() != target) {
            return Ok(None);
        }
        args.iter().map(|a| a.map(|t| if low(t.kind()) && t.kind() != target { t.f_to_kind(target) } else { Ok(t.shallow_clone()) }).transpose()).collect::<Result<Vec<_>, _>>().map(Some)
    }

    /// Frees (when `free`) the slots instruction `i` read last.
    fn free_after(&self, i: usize, slots: &mut [Option<Tensor>], free: bool) {
        if !free {
            return;
        }
        let p = self.program;
        for s in p.instrs[i].inputs.iter().flatten() {
            if self.last_use[s.index()] == Some(i) && !p.outputs.contains(s) {
                slots[s.index()] = None;
            }
        }
    }

    /// A folded Shape or Size node: its input has the shape it was folded for (a cheap
    /// metadata check, no device read), or the specialisation was wrong.
    fn check_folded(&self, i: usize, slots: &[Option<Tensor>]) -> Result<(), String> {
        let Some((x, dims)) = self.special.and_then(|sp| sp.expect[i].as_ref()) else { return Ok(()) };
        match &slots[x.index()] {
            Some(t) if t.size() == *dims => Ok(()),
            Some(t) => Err(format!("node {:?}: its input has shape {:?}, not the {dims:?} the program was specialised for (please report it)", self.program.instrs[i].name, t.size())),
            None => Ok(()), // not computed in this range (a piece): nothing to compare
        }
    }

    fn take(slots: &[Option<Tensor>], ids: &[SlotId], what: &str) -> Result<Vec<(SlotId, Tensor)>, String> {
        ids.iter()
            .map(|s| slots[s.index()].as_ref().map(|t| (*s, t.shallow_clone())).ok_or_else(|| format!("{what}: slot {s} is not set")))
            .collect()
    }

    /// The first forward: kept pieces record their graphs on leaf inputs, recomputed pieces
    /// run without one. `params` are the weight leaves (`requires_grad`), `inputs` the
    /// stage inputs in program order.
    pub(crate) fn forward(&self, params: &[Tensor], inputs: &[Tensor], stats: bool) -> Result<(PieceFwd, Vec<(usize, Tensor)>), String> {
        let p = self.program;
        let mut slots = self.base_slots(params);
        for (s, t) in p.inputs.iter().zip(inputs) {
            slots[s.index()] = Some(t.detach());
        }
        let (mut states, mut all_stats, mut act_bytes) = (Vec::new(), Vec::new(), 0u64);
        // Each value counts once, however many pieces hold it.
        let mut counted = vec![false; p.slots.len()];
        let mut count = |list: &[(SlotId, Tensor)]| {
            for (s, t) in list {
                if !std::mem::replace(&mut counted[s.index()], true) {
                    act_bytes += bytes_of(t);
                }
            }
        };
        for piece in self.pieces {
            let ins = Self::take(&slots, &piece.inputs, "piece input")?;
            count(&ins);
            if piece.recompute {
                all_stats.extend(tch::no_grad(|| self.run_range(piece.range.clone(), &mut slots, true, stats, false, None))?.0);
                states.push(PieceState::Recompute { inputs: ins.into_iter().map(|(s, t)| (s, t.detach())).collect() });
            } else {
                let leaves: Vec<(SlotId, Tensor)> = ins.iter().map(|(s, t)| (*s, leaf(t))).collect();
                for (s, t) in &leaves {
                    slots[s.index()] = Some(t.shallow_clone());
                }
                all_stats.extend(self.run_range(piece.range.clone(), &mut slots, true, stats, false, None)?.0);
                let outputs = Self::take(&slots, &piece.outputs, "piece output")?;
                count(&outputs);
                // Later pieces read these values as fresh leaves, not through this graph.
                for (s, t) in &outputs {
                    slots[s.index()] = Some(t.detach());
                }
                states.push(PieceState::Kept { leaves, outputs });
            }
        }
        let outputs = Self::take(&slots, &p.outputs, "program output")?.into_iter().map(|(_, t)| t).collect();
        Ok((PieceFwd { states, outputs, act_bytes }, all_stats))
    }

    /// Back-propagates `seeds` (gradients of program outputs, by slot) through the pieces
    /// in reverse. Returns the weight gradients (by weight index) and the gradients of the
    /// stage inputs (by slot), `None` where nothing flows.
    pub(crate) fn backward(&self, f: PieceFwd, params: &[Tensor], seeds: Vec<(SlotId, Tensor)>) -> Result<Grads, String> {
        let mut grads: HashMap<SlotId, Tensor> = HashMap::new();
        for (s, g) in seeds {
            add(&mut grads, s, g);
        }
        let mut pgrads: Vec<Option<Tensor>> = (0..params.len()).map(|_| None).collect();
        for (piece, state) in self.pieces.iter().zip(f.states).rev() {
            if !piece.outputs.iter().any(|s| grads.contains_key(s)) {
                continue;
            }
            let (leaves, outputs) = match state {
                PieceState::Kept { leaves, outputs } => (leaves, outputs),
                PieceState::Recompute { inputs } => self.rerun(piece, params, inputs)?,
            };
            let mut root: Option<Tensor> = None;
            for (s, o) in &outputs {
                if let (Some(g), true) = (grads.remove(s), o.requires_grad()) {
                    let term = (o * g.to_device(o.device())).f_sum(Kind::Double).map_err(|e| e.to_string())?;
                    root = Some(match root {
                        None => term,
                        Some(r) => r + term,
                    });
                }
            }
            let Some(root) = root else { continue };
            let leaf_targets: Vec<&(SlotId, Tensor)> = leaves.iter().filter(|(_, t)| t.requires_grad()).collect();
            let mut targets: Vec<&Tensor> = leaf_targets.iter().map(|(_, t)| t).collect();
            targets.extend(piece.params.iter().map(|&k| &params[k]));
            let gs = Tensor::f_run_backward(&[root], &targets, false, false).map_err(|e| e.to_string().lines().next().unwrap_or("").to_string())?;
            let mut it = gs.into_iter();
            for (s, _) in leaf_targets {
                if let Some(g) = it.next().filter(|g| g.defined()) {
                    add(&mut grads, *s, g);
                }
            }
            for &k in &piece.params {
                if let Some(g) = it.next().filter(|g| g.defined()) {
                    pgrads[k] = Some(match pgrads[k].take() {
                        None => g,
                        Some(a) => tch::no_grad(|| a + g),
                    });
                }
            }
        }
        Ok((pgrads, grads))
    }

    /// A recomputed piece again, with its graph, from its saved inputs.
    #[allow(clippy::type_complexity)]
    fn rerun(&self, piece: &Piece, params: &[Tensor], inputs: Vec<(SlotId, Tensor)>) -> Result<(Vec<(SlotId, Tensor)>, Vec<(SlotId, Tensor)>), String> {
        let mut slots = self.base_slots(params);
        let leaves: Vec<(SlotId, Tensor)> = inputs.iter().map(|(s, t)| (*s, leaf(t))).collect();
        for (s, t) in &leaves {
            slots[s.index()] = Some(t.shallow_clone());
        }
        self.run_range(piece.range.clone(), &mut slots, false, false, false, None)?;
        let outputs = Self::take(&slots, &piece.outputs, "piece output")?;
        Ok((leaves, outputs))
    }
}

fn add(grads: &mut HashMap<SlotId, Tensor>, s: SlotId, g: Tensor) {
    let g = match grads.remove(&s) {
        None => g,
        Some(a) => tch::no_grad(|| a + g),
    };
    grads.insert(s, g);
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipewright_ops::op::Gemm;

    /// The direct weight gradients equal autograd's bit for bit: `MatMul` of a rank-3
    /// input by a 2-D weight, `Gemm` with `B` transposed or not and a bias `C`, in fp32 and
    /// with the operands cast to bf16 (the gradient back in the weight's fp32); a `Gemm`
    /// with `alpha != 1` or a weight as `A` is left to autograd.
    #[test]
    fn direct_weight_gradients_are_autograds() {
        tch::manual_seed(0);
        let leaf = |dims: &[i64]| Tensor::randn(dims, (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let autograd = |y: &Tensor, g: &Tensor, of: &[&Tensor]| Tensor::f_run_backward(&[(y * g).sum(Kind::Float)], of, false, false).unwrap();
        for low in [None, Some(Kind::BFloat16)] {
            let cast = |t: &Tensor| low.map_or_else(|| t.shallow_clone(), |k| t.to_kind(k));
            // MatMul(x, W), x [2, 3, 4], W [4, 5].
            let (x, w) = (leaf(&[2, 3, 4]), leaf(&[4, 5]));
            let (xc, wc) = (cast(&x), cast(&w));
            let y = xc.matmul(&wc);
            let g = cast(&Tensor::randn([2, 3, 5], (Kind::Float, tch::Device::Cpu)));
            let direct = DirectGrad::of(&Op::MatMul, &[(1, &w)], &[Some(&xc), Some(&wc)]).expect("direct");
            let got = direct.gradients(&g, &[Kind::Float]).unwrap();
            let want = autograd(&y.to_kind(Kind::Float), &g.to_kind(Kind::Float), &[&w]);
            assert!(got[0].equal(&want[0]), "matmul ({low:?})");
            for trans_b in [false, true] {
                let gemm = Op::Gemm(Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b });
                let (a, b, c) = (leaf(&[3, 4]), leaf(if trans_b { &[5, 4] } else { &[4, 5] }), leaf(&[5]));
                let (ac, bc, cc) = (cast(&a), cast(&b), cast(&c));
                let y = crate::exec::run_node(&gemm, crate::exec::Signature::NONE, &[Some(&ac), Some(&bc), Some(&cc)], crate::exec::Mode::Train, None).unwrap().remove(0);
                let g = cast(&Tensor::randn([3, 5], (Kind::Float, tch::Device::Cpu)));
                let direct = DirectGrad::of(&gemm, &[(1, &b), (2, &c)], &[Some(&ac), Some(&bc), Some(&cc)]).expect("direct");
                let got = direct.gradients(&g, &[Kind::Float, Kind::Float]).unwrap();
                let want = autograd(&y.to_kind(Kind::Float), &g.to_kind(Kind::Float), &[&b, &c]);
                assert!(got[0].equal(&want[0]) && got[1].equal(&want[1]), "gemm trans_b={trans_b} ({low:?})");
            }
        }
        let (a, b) = (leaf(&[3, 4]), leaf(&[4, 5]));
        let scaled = Op::Gemm(Gemm { alpha: 2.0, beta: 1.0, trans_a: false, trans_b: false });
        assert!(DirectGrad::of(&scaled, &[(1, &b)], &[Some(&a), Some(&b)]).is_none());
        assert!(DirectGrad::of(&Op::MatMul, &[(0, &a)], &[Some(&a), Some(&b)]).is_none());
    }
}
