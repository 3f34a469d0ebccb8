//! Per-stage lowering of a partitioned graph: one [`Program`] per pipeline stage.
//!
//! The graph has been through `passes::boundaries::insert_stage_boundaries`: a
//! `StageBoundary { from, to }` node sits in stage `to` and reads a value produced in
//! stage `from`. Stage `k`'s program holds the stage's own nodes; its boundary nodes are
//! not executed but become **program inputs** (the received tensors), and the value each
//! boundary reads becomes a **program output** of stage `k - 1` (the sent tensors).
//!
//! A crossing is named by the boundary's output value (`x@stage2` for the copy of `x`
//! arriving in stage 2): the "wire name" under which the sender's output and the
//! receiver's input meet. Program inputs are the received tensors, then the graph inputs
//! the stage reads; program outputs are the sent tensors, then the graph outputs the
//! stage produces. Weights and constants the stage reads are its stored tensors.

use std::collections::BTreeSet;

use pipewright_ir::{Graph, NodeId, Op, StageMap, ValueDef, ValueId};
use pipewright_passes::recompute::{Decision, RecomputePlan};
use pipewright_core::UpdateRule;
use pipewright_passes::versioning::WeightVersions;
use pipewright_ops::op::UnaryOp;
use pipewright_runtime::program::{Extent, Instr, Program, SlotId, SlotInfo};

use pipewright_ops::DType;

use crate::lower::{lower_nodes, LowerError, Lowering};

/// A tensor crossing between two adjacent stages.
#[derive(Clone, Debug, PartialEq)]
pub struct BoundaryTensor {
    /// The wire name: the boundary's output value (`x@stage2`).
    pub name: String,
    /// The value's name on this side (for a sent tensor, the sender's value; for a
    /// received one, the wire name).
    pub value: String,
    /// The stage on the other side.
    pub peer: u32,
    pub elem: DType,
    /// With `Batch(k)` for `k * N`.
    pub shape: Vec<Extent>,
}

/// A graph input read, or a graph output produced, by a stage.
#[derive(Clone, Debug, PartialEq)]
pub struct StageTensor {
    pub name: String,
    pub elem: DType,
    pub shape: Vec<Extent>,
}

/// Which parts of the graph make up one stage (shared by lowering and ONNX export).
#[derive(Clone, Debug, Default)]
pub struct StageSlice {
    pub stage: u32,
    /// The stage's nodes in execution order, boundaries excluded.
    pub nodes: Vec<NodeId>,
    /// Received: the boundary output values of this stage (wire values).
    pub received: Vec<ValueId>,
    /// Sent: `(value in this stage, wire value in the next stage)`.
    pub sent: Vec<(ValueId, ValueId)>,
    /// Graph inputs read here, in graph-input order.
    pub graph_inputs: Vec<ValueId>,
    /// Graph outputs produced here, in graph-output order.
    pub graph_outputs: Vec<ValueId>,
    /// Weights and constants read here, by value id.
    pub weights: Vec<ValueId>,
}

impl StageSlice {
    /// Program inputs: received, then graph inputs.
    pub fn inputs(&self) -> Vec<ValueId> {
        self.received.iter().chain(&self.graph_inputs).copied().collect()
    }

    /// Program outputs: sent (the local value), then graph outputs.
    pub fn outputs(&self) -> Vec<ValueId> {
        self.sent.iter().map(|s| s.0).chain(self.graph_outputs.iter().copied()).collect()
    }
}

/// One lowered stage.
#[derive(Clone, Debug)]
pub struct StageProgram {
    pub stage: u32,
    pub program: Program,
    pub received: Vec<BoundaryTensor>,
    pub sent: Vec<BoundaryTensor>,
    pub graph_inputs: Vec<StageTensor>,
    pub graph_outputs: Vec<StageTensor>,
    /// The IR node of each instruction of `program` (same order); `None` for the helper
    /// instructions the rebatch rewrites insert (they serve the instruction after them).
    pub instr_nodes: Vec<Option<NodeId>>,
    /// The IR value of each slot of `program`; `None` for the helper slots and constants
    /// the rebatch rewrites add.
    pub slot_values: Vec<Option<ValueId>>,
}

/// The pass results a stage module carries as annotations.
#[derive(Clone, Copy, Debug, Default)]
pub struct Annotations<'a> {
    pub recompute: Option<&'a RecomputePlan>,
    pub versions: Option<&'a WeightVersions>,
}

impl StageProgram {
    /// Fills the program's annotations: each instruction's recompute flag (from the
    /// recompute plan; a helper instruction follows the instruction it serves), each stored
    /// tensor's weight versions and update rule (constants: 1 version, `constant`), and
    /// each slot's last use.
    pub fn annotate(&mut self, a: &Annotations<'_>) {
        let p = &mut self.program;
        if let Some(plan) = a.recompute {
            let mut next = false;
            for (ins, node) in p.instrs.iter_mut().zip(&self.instr_nodes).rev() {
                ins.recompute = match node {
                    Some(n) => plan.node(*n) == Some(Decision::Recompute),
                    None => next,
                };
                next = ins.recompute;
            }
        }
        for t in p.stored.iter_mut() {
            let w = self.slot_values.get(t.slot.index()).copied().flatten().and_then(|v| a.versions.and_then(|vs| vs.get(v)));
            match w {
                Some(w) => {
                    t.versions = w.versions_in(self.stage).max(1);
                    t.update = w.rule;
                    if w.trainable && w.stages.len() > 1 {
                        t.sync = w.stages.clone();
                    }
                }
                None if !t.trainable => {
                    t.versions = 1;
                    t.update = UpdateRule::Constant;
                }
                None => {}
            }
        }
        p.fill_last_uses();
    }
}

/// Splits a partitioned graph into its stages.
pub fn slice_stages(g: &Graph, stages: &StageMap) -> Result<Vec<StageSlice>, LowerError> {
    let order = g.topo_order().map_err(|n| LowerError::Cycle(g.node(n).name.clone()))?;
    let d = stages.num_stages;
    let mut out: Vec<StageSlice> = (0..d).map(|stage| StageSlice { stage, ..StageSlice::default() }).collect();
    let mut weights: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); d as usize];
    let mut reads_input: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); d as usize];
    let stage_of = |n: NodeId| -> Result<u32, LowerError> {
        stages.get(n).filter(|&s| s < d).ok_or_else(|| LowerError::Stage {
            stage: d,
            reason: format!("node {:?} has no stage below {d}", g.node(n).name),
        })
    };
    for &n in &order {
        let s = stage_of(n)?;
        let node = g.node(n);
        if let Op::StageBoundary { from, to } = node.op {
            let input = node.inputs.first().copied().flatten();
            let output = node.outputs.first().copied().flatten();
            let (Some(input), Some(output)) = (input, output) else {
                return Err(LowerError::Stage { stage: s, reason: format!("boundary {:?} lacks its input or output", node.name) });
            };
            if to != s || from + 1 != to {
                return Err(LowerError::Stage { stage: s, reason: format!("boundary {:?} crosses {from} -> {to}", node.name) });
            }
            out[s as usize].received.push(output);
            out[from as usize].sent.push((input, output));
            continue;
        }
        for v in node.inputs.iter().flatten() {
            match g.value(*v).def {
                ValueDef::Input => {
                    reads_input[s as usize].insert(*v);
                }
                ValueDef::Weight(_) => {
                    weights[s as usize].insert(*v);
                }
                ValueDef::Node { node: p, .. } => {
                    let ps = stage_of(p)?;
                    if ps != s {
                        return Err(LowerError::Stage {
                            stage: s,
                            reason: format!("node {:?} reads {:?} from stage {ps} without a boundary", node.name, g.value(*v).name),
                        });
                    }
                }
            }
        }
        out[s as usize].nodes.push(n);
    }
    for (k, slice) in out.iter_mut().enumerate() {
        slice.graph_inputs = g.inputs().iter().copied().filter(|v| reads_input[k].contains(v)).collect();
        slice.weights = weights[k].iter().copied().collect();
    }
    for &v in g.outputs() {
        match g.value(v).def {
            ValueDef::Node { node, .. } => out[stage_of(node)? as usize].graph_outputs.push(v),
            // A graph input or constant returned as is: the last stage returns it.
            _ => {
                let last = out.last_mut().ok_or(LowerError::Stage { stage: 0, reason: "no stages".into() })?;
                last.graph_outputs.push(v);
                match g.value(v).def {
                    ValueDef::Input if !last.graph_inputs.contains(&v) => last.graph_inputs.push(v),
                    ValueDef::Weight(_) if !last.weights.contains(&v) => last.weights.push(v),
                    _ => {}
                }
            }
        }
    }
    Ok(out)
}

/// The values a stage's program gives slots to: inputs, weights, then node outputs.
fn stage_values(g: &Graph, s: &StageSlice) -> Vec<ValueId> {
    let mut seen = vec![false; g.value_count()];
    let mut values = Vec::new();
    let mut add = |v: ValueId| {
        if !seen[v.index()] {
            seen[v.index()] = true;
            values.push(v);
        }
    };
    s.received.iter().chain(&s.graph_inputs).chain(&s.weights).for_each(|&v| add(v));
    for &n in &s.nodes {
        g.node(n).outputs.iter().flatten().for_each(|&v| add(v));
    }
    values
}

fn shape_of(g: &Graph, v: ValueId) -> Vec<Extent> {
    g.value(v)
        .ty
        .shape
        .0
        .iter()
        .map(|d| match *d {
            pipewright_ir::Dim::Fixed(x) => Extent::Fixed(x),
            pipewright_ir::Dim::Batch(k) => Extent::Batch(k),
        })
        .collect()
}

fn tensor(g: &Graph, v: ValueId) -> StageTensor {
    StageTensor { name: g.value(v).name.clone(), elem: g.value(v).ty.dtype, shape: shape_of(g, v) }
}

/// Lowers every stage of a partitioned graph to its own program.
pub fn lower_stages(g: &Graph, stages: &StageMap) -> Result<Vec<StageProgram>, LowerError> {
    slice_stages(g, stages)?.iter().map(|s| lower_slice(g, s)).collect()
}

/// Lowers one stage.
pub fn lower_slice(g: &Graph, s: &StageSlice) -> Result<StageProgram, LowerError> {
    let values = stage_values(g, s);
    let inputs = s.inputs();
    let outputs = s.outputs();
    let mut program = lower_nodes(g, &Lowering { nodes: &s.nodes, values: &values, inputs: &inputs, outputs: &outputs })
        .map_err(|e| LowerError::Stage { stage: s.stage, reason: e.to_string() })?;
    program.fill_last_uses();
    let static_values = batch_static_values(g);
    program.static_inputs = s.received.iter().zip(&program.inputs).filter(|(v, _)| static_values[v.index()]).map(|(_, slot)| *slot).collect();
    // One instruction per node in order, plus helper instructions inserted by the rebatch
    // rewrites; those write only new slots (past `values`), which identifies them.
    let slot_values: Vec<Option<ValueId>> = (0..program.slots.len()).map(|k| values.get(k).copied()).collect();
    let mut nodes = s.nodes.iter();
    let instr_nodes: Vec<Option<NodeId>> = program
        .instrs
        .iter()
        .map(|ins| {
            let mut outs = ins.outputs.iter().flatten().peekable();
            let helper = outs.peek().is_some() && outs.all(|o| o.index() >= values.len());
            if helper { None } else { nodes.next().copied() }
        })
        .collect();
    let boundary = |local: ValueId, wire: ValueId, peer: u32| BoundaryTensor {
        name: g.value(wire).name.clone(),
        value: g.value(local).name.clone(),
        peer,
        elem: g.value(wire).ty.dtype,
        shape: shape_of(g, wire),
    };
    // A sent tensor's slot carries its wire name (`x@stage2`), the name the next stage's
    // program gives the tensor it receives, so an executor pairs them by name; a graph
    // output's slot carries the graph's name.
    let names = s.sent.iter().map(|&(_, wire)| g.value(wire).name.clone()).chain(s.graph_outputs.iter().map(|&v| g.value(v).name.clone()));
    let mut instr_nodes = instr_nodes;
    name_outputs(&mut program, names.collect(), &mut instr_nodes);
    let slot_values: Vec<Option<ValueId>> = (0..program.slots.len()).map(|k| slot_values.get(k).copied().flatten()).collect();
    Ok(StageProgram {
        stage: s.stage,
        program,
        received: s.received.iter().map(|&v| boundary(v, v, s.stage.saturating_sub(1))).collect(),
        sent: s.sent.iter().map(|&(local, wire)| boundary(local, wire, s.stage + 1)).collect(),
        graph_inputs: s.graph_inputs.iter().map(|&v| tensor(g, v)).collect(),
        graph_outputs: s.graph_outputs.iter().map(|&v| tensor(g, v)).collect(),
        instr_nodes,
        slot_values,
    })
}

/// Per value: whether it depends on the batch size alone, not on any data or weight — a
/// shape, a constant, or what is computed from those (deterministically). A stage that
/// receives such a value can read it once per batch size ([`Program::static_inputs`]).
fn batch_static_values(g: &Graph) -> Vec<bool> {
    let mut known: Vec<bool> = g.value_ids().map(|v| matches!(&g.value(v).def, ValueDef::Weight(w) if !w.trainable)).collect();
    let Ok(order) = g.topo_order() else { return vec![false; known.len()] };
    for n in order {
        let node = g.node(n);
        let derived = match node.op {
            Op::Shape { .. } | Op::Size => true,
            // Random, or carrying training-mode state.
            Op::Dropout { .. } | Op::BatchNormalization(_) => false,
            _ => node.inputs.iter().flatten().all(|v| known[v.index()]),
        };
        for v in node.outputs.iter().flatten() {
            known[v.index()] = derived;
        }
    }
    known
}

/// Gives output `i` of `p` the name `names[i]`. A slot needed under a second name — a
/// received tensor passed straight on to the next stage (its input name is the wire it
/// arrived on, its output name the wire it leaves on), or one tensor both sent and a graph
/// output — is copied into a new slot by an `Identity` helper instruction for each extra
/// name, so every input and output of the program has a slot of its own name.
fn name_outputs(p: &mut Program, names: Vec<String>, instr_nodes: &mut Vec<Option<NodeId>>) {
    let mut claimed: Vec<SlotId> = p.inputs.clone();
    for (i, name) in names.into_iter().enumerate() {
        let slot = p.outputs[i];
        if claimed.contains(&slot) && p.slots[slot.index()].name != name {
            let info = p.slots[slot.index()].clone();
            let copy = SlotId(p.slots.len() as u32);
            p.slots.push(SlotInfo { name: name.clone(), last_use: None, ..info });
            p.instrs.push(Instr { name: format!("{name}:copy"), op: Op::Unary(UnaryOp::Identity), inputs: vec![Some(slot)], outputs: vec![Some(copy)], recompute: false });
            instr_nodes.push(None);
            p.outputs[i] = copy;
            claimed.push(copy);
        } else {
            p.slots[slot.index()].name = name;
            claimed.push(slot);
        }
    }
    p.fill_last_uses();
}

/// Lowers one stage and fills its annotations (see [`StageProgram::annotate`]).
pub fn lower_slice_annotated(g: &Graph, s: &StageSlice, a: &Annotations<'_>) -> Result<StageProgram, LowerError> {
    let mut sp = lower_slice(g, s)?;
    sp.annotate(a);
    Ok(sp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipewright_ir::{import_bytes, import_model, ImportOptions};
    use std::path::Path;
    use pipewright_runtime::program::SlotId;

    /// The shared MLP cut into `d` stages of consecutive nodes (topological order).
    fn partitioned(d: u32) -> (Graph, StageMap) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus/models/mlp.onnx");
        assert!(path.is_file(), "the shared corpus is missing: expected {}", path.display());
        let mut g = import_model(&path, &ImportOptions::default()).unwrap();
        let order = g.topo_order().unwrap();
        let mut map = StageMap::new(d);
        for (i, n) in order.iter().enumerate() {
            map.set(*n, (i * d as usize / order.len()) as u32);
        }
        let stages = pipewright_passes::boundaries::insert_stage_boundaries(&mut g, &map).unwrap();
        (g, stages)
    }

    #[test]
    fn stages_connect_and_cover_the_graph() {
        let (g, stages) = partitioned(3);
        let progs = lower_stages(&g, &stages).unwrap();
        assert_eq!(progs.len(), 3);
        let boundaries = g.node_ids().filter(|&n| matches!(g.node(n).op, Op::StageBoundary { .. })).count();
        let instrs: usize = progs.iter().map(|p| p.program.instrs.len()).sum();
        assert!(instrs >= g.node_count() - boundaries);
        assert!(progs[0].received.is_empty() && progs[2].sent.is_empty());
        for k in 0..2 {
            let sent: Vec<_> = progs[k].sent.iter().map(|t| (&t.name, t.elem, &t.shape)).collect();
            let recv: Vec<_> = progs[k + 1].received.iter().map(|t| (&t.name, t.elem, &t.shape)).collect();
            assert_eq!(sent, recv);
            assert!(!sent.is_empty());
            assert!(progs[k + 1].received.iter().all(|t| t.shape.first() == Some(&Extent::Batch(1))));
        }
        assert_eq!(progs[0].graph_inputs.len(), 1);
        assert_eq!(progs[2].graph_outputs.len(), 1);
        for p in &progs {
            assert_eq!(p.program.inputs.len(), p.received.len() + p.graph_inputs.len());
            assert_eq!(p.program.outputs.len(), p.sent.len() + p.graph_outputs.len());
        }
    }

    /// Slot names of the program's inputs and outputs.
    fn io_names(p: &Program) -> (Vec<String>, Vec<String>) {
        let names = |slots: &[SlotId]| slots.iter().map(|s| p.slots[s.index()].name.clone()).collect();
        (names(&p.inputs), names(&p.outputs))
    }

    /// A tensor a stage receives and passes straight on (a skip connection crossing two
    /// cuts) arrives and leaves under two wire names: the stage copies it into a slot of
    /// its own for the second (vit-tiny at d = 4 was refused before).
    #[test]
    fn a_tensor_passed_straight_through_a_stage_gets_its_own_output_slot() {
        let text = include_str!("../../passes/tests/filetests/partition_skip_forwarded.pwir");
        let partitioned = text.split("// ----- expect -----\n").nth(1).expect("the expected partition");
        let (g, notes) = pipewright_ir::parse_graph_annotated(partitioned).unwrap();
        let mut stages = StageMap::new(3);
        for (n, note) in &notes {
            stages.set(*n, note.trim_start_matches("stage=").parse().unwrap());
        }
        let progs = lower_stages(&g, &stages).unwrap();
        // The parsed boundary outputs are named after their ids: %v6 arrives in stage 1 and
        // leaves as %v8 (unchanged) and, through Relu, as %v9.
        let (ins, outs) = io_names(&progs[1].program);
        assert_eq!(ins, ["v6"]);
        assert_eq!(outs, ["v8", "v9"]);
        let p = &progs[1].program;
        let copy = p.instrs.last().unwrap();
        assert_eq!((copy.op.clone(), copy.inputs.clone(), copy.outputs.clone()), (Op::Unary(UnaryOp::Identity), vec![Some(p.inputs[0])], vec![Some(p.outputs[0])]));
        assert_eq!(progs[1].instr_nodes.last(), Some(&None), "a helper, not a node");
        let (ins2, _) = io_names(&progs[2].program);
        assert_eq!(ins2, ["v8", "v9"], "the next stage receives what was sent");
    }

    #[test]
    fn instructions_map_to_their_nodes() {
        let (g, stages) = partitioned(2);
        for sp in lower_stages(&g, &stages).unwrap() {
            assert_eq!(sp.instr_nodes.len(), sp.program.instrs.len());
            assert_eq!(sp.slot_values.len(), sp.program.slots.len());
            for (ins, n) in sp.program.instrs.iter().zip(&sp.instr_nodes) {
                if let Some(n) = n {
                    assert_eq!(g.node(*n).name, ins.name);
                }
            }
            // Sent slots carry the wire name the next stage receives them under; every
            // other slot keeps its value's name.
            let sent: Vec<SlotId> = sp.program.outputs[..sp.sent.len()].to_vec();
            for (k, (info, v)) in sp.program.slots.iter().zip(&sp.slot_values).enumerate() {
                match sent.iter().position(|s| s.index() == k) {
                    Some(i) => assert_eq!(info.name, sp.sent[i].name),
                    None => {
                        if let Some(v) = v {
                            assert_eq!(g.value(*v).name, info.name);
                        }
                    }
                }
            }
            let last = sp.program.last_uses();
            for (info, l) in sp.program.slots.iter().zip(last) {
                assert_eq!(info.last_use, l.filter(|&i| i != usize::MAX).map(|i| i as u32));
            }
        }
    }

    #[test]
    fn stage_onnx_reimports() {
        let (g, stages) = partitioned(2);
        for s in slice_stages(&g, &stages).unwrap() {
            let bytes = crate::onnx_export::export_stage_bytes(&g, &s).unwrap();
            let h = import_bytes(&bytes, Path::new("."), &ImportOptions::default()).unwrap();
            assert_eq!(h.meta.opset, g.meta.opset);
            assert_eq!(h.inputs().len(), s.received.len() + s.graph_inputs.len());
            assert_eq!(h.outputs().len(), s.sent.len() + s.graph_outputs.len());
            assert_eq!(h.parameter_count(), s.weights.iter().filter(|&&w| g.value(w).weight().is_some_and(|x| x.trainable)).map(|&w| g.value(w).ty.shape.numel(1) as u64).sum::<u64>());
        }
    }
}
