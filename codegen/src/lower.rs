//! IR graph to runtime [`Program`]: each node's op as it is (the runtime executes the IR's
//! own [`Op`](pipewright_ops::Op)s), values to slots in the graph's topological order,
//! weights and constants to stored tensors (sharing bytes). What is left here is stage
//! work: slots, stored tensors and the batch rewrites ([`rebatch`]).

use pipewright_core::UpdateRule;
use pipewright_ir::{Dim, Graph, NodeId, ValueDef, ValueId};
use pipewright_ops::{DType, TensorData};
use pipewright_runtime::program::{Extent, Instr, Program, SlotId, SlotInfo, Stored};

/// Why a graph could not be lowered.
#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    #[error("the graph has a cycle through node {0:?}")]
    Cycle(String),
    /// A node reads or writes a value that was given no slot (a bug in the caller).
    #[error("value {0:?} has no slot in the program")]
    MissingValue(String),
    /// The graph's stages are inconsistent.
    #[error("stage {stage}: {reason}")]
    Stage { stage: u32, reason: String },
}

/// Lowers the whole graph to one program.
pub fn lower_graph(g: &Graph) -> Result<Program, LowerError> {
    let order = g.topo_order().map_err(|n| LowerError::Cycle(g.node(n).name.clone()))?;
    let values: Vec<ValueId> = g.value_ids().collect();
    lower_nodes(g, &Lowering { nodes: &order, values: &values, inputs: g.inputs(), outputs: g.outputs() })
}

/// What [`lower_nodes`] lowers: a subset of a graph's nodes in execution order, and the
/// values that get slots (slot `i` is `values[i]`; every value a node reads or writes,
/// and every input and output, must be among them).
pub struct Lowering<'a> {
    pub nodes: &'a [NodeId],
    pub values: &'a [ValueId],
    /// Program inputs (fed by the caller), in order.
    pub inputs: &'a [ValueId],
    /// Program outputs, in order (a value may appear more than once).
    pub outputs: &'a [ValueId],
}

/// Lowers `l.nodes` of `g` to one program: weights and constants among `l.values` become
/// stored tensors, each node one instruction; then the [`rebatch`] rewrites apply.
pub fn lower_nodes(g: &Graph, l: &Lowering<'_>) -> Result<Program, LowerError> {
    let mut index: Vec<Option<SlotId>> = vec![None; g.value_count()];
    for (i, v) in l.values.iter().enumerate() {
        index[v.index()] = Some(SlotId(i as u32));
    }
    let slot = |v: ValueId| -> Result<SlotId, LowerError> {
        index.get(v.index()).copied().flatten().ok_or_else(|| LowerError::MissingValue(g.value(v).name.clone()))
    };
    let mut p = Program {
        slots: l.values.iter().map(|&v| slot_info(g, v)).collect(),
        inputs: l.inputs.iter().map(|&v| slot(v)).collect::<Result<_, _>>()?,
        outputs: l.outputs.iter().map(|&v| slot(v)).collect::<Result<_, _>>()?,
        ..Program::default()
    };
    for &v in l.values {
        if let ValueDef::Weight(w) = &g.value(v).def {
            let (elem, bytes) = match unpacked(&w.data) {
                Some((e, b)) => (e, b.into()),
                None => (w.data.dtype, w.data.bytes.clone()),
            };
            p.stored.push(Stored {
                slot: slot(v)?,
                elem,
                dims: w.data.dims.clone(),
                bytes,
                trainable: w.trainable,
                versions: 1,
                // Plain training until the weight-versioning pass says otherwise.
                update: if w.trainable { UpdateRule::Vanilla } else { UpdateRule::Constant },
                sync: Vec::new(),
            });
        }
    }
    for &n in l.nodes {
        let node = g.node(n);
        p.instrs.push(Instr {
            name: node.name.clone(),
            op: node.op.clone(),
            inputs: node.inputs.iter().map(|v| v.map(slot).transpose()).collect::<Result<_, _>>()?,
            outputs: node.outputs.iter().map(|v| v.map(slot).transpose()).collect::<Result<_, _>>()?,
            recompute: false,
        });
    }
    rebatch::apply_to(g, &mut p, l.nodes, l.values);
    Ok(p)
}

/// A weight of a packed 4- or 2-bit type unpacked into its runtime holder type (i8, u8 or
/// f32), since stage files keep one element per byte or more; `None` for other types,
/// stored as they are.
fn unpacked(t: &TensorData) -> Option<(DType, Vec<u8>)> {
    let e = t.dtype;
    if e.per_byte() == 1 {
        return None;
    }
    let holder = e.holder();
    let values = t.to_f64s();
    let out: Vec<u8> = match holder {
        DType::I8 => values.iter().map(|&v| v as i8 as u8).collect(),
        DType::U8 => values.iter().map(|&v| v as u8).collect(),
        _ => values.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect(),
    };
    Some((holder, out))
}

fn slot_info(g: &Graph, v: ValueId) -> SlotInfo {
    let val = g.value(v);
    SlotInfo { name: val.name.clone(), elem: val.ty.dtype, shape: val.ty.shape.0.iter().map(|&d| extent(d)).collect(), last_use: None }
}

fn extent(d: Dim) -> Extent {
    match d {
        Dim::Fixed(v) => Extent::Fixed(v),
        Dim::Batch(k) => Extent::Batch(k),
    }
}

/// Rewrites what a fixed-batch export baked into constants so the program runs at any
/// microbatch size: Reshape targets get `-1` where the IR inferred the batch, Expand
/// targets and Tile repeats get `1` where they would pin the export batch, constants that
/// are one slice repeated over the export batch (attention masks) keep a single slice when
/// every reader broadcasts it (directly, or through a Gather or Expand that keeps it one
/// slice), and repeated slices concatenated with a batched tensor (class tokens) are
/// expanded to its batch at run time.
pub mod rebatch {
    use pipewright_core::UpdateRule;
    use pipewright_ir::{Dim, Graph, NodeId, Op, ValueDef, ValueId};
    use pipewright_runtime::program::{Extent, Program, SlotId, SlotInfo, Stored};
    use pipewright_ops::DType;

    /// The rewrites for a whole-graph program (slot `i` is value `i`, one instruction per
    /// node in topological order), as `lower_graph` builds it.
    pub fn apply(g: &Graph, p: &mut Program) {
        let order = g.topo_order().unwrap_or_default();
        let values: Vec<ValueId> = g.value_ids().collect();
        apply_to(g, p, &order, &values);
    }

    /// The rewrites for a program whose instruction `k` lowers `nodes[k]` and whose slot
    /// `i` holds `values[i]` (slots past `values` are ones codegen added).
    pub fn apply_to(g: &Graph, p: &mut Program, nodes: &[NodeId], values: &[ValueId]) {
        // An export at batch 1 bakes its batch into these constants as much as one at 4.
        let Some(b0) = g.batch.as_ref().map(|b| b.resolved_size()) else { return };
        for (k, &n) in nodes.iter().enumerate() {
            let node = g.node(n);
            let target = node.inputs.get(1).copied().flatten().filter(|v| is_const(g, *v));
            let out = node.outputs.first().copied().flatten().map(|v| g.value(v).ty.shape.0.clone());
            let (Some(target), Some(out)) = (target, out) else { continue };
            let new = match node.op {
                Op::Reshape { .. } if out.iter().filter(|d| d.is_batch()).count() == 1 => {
                    Some(out.iter().map(|d| if d.is_batch() { -1 } else { d.fixed().unwrap_or(0) }).collect::<Vec<i64>>())
                }
                Op::Expand if !read_as_element_indices(g, node.outputs[0]) => expand_target(g, node.inputs[0], &out, b0),
                Op::Tile => tile_repeats(g, node.inputs[0], target, b0),
                _ => None,
            };
            if let Some(values) = new {
                let slot = push_i64(p, &format!("{}:rebatched", g.value(target).name), &values);
                p.instrs[k].inputs[1] = Some(slot);
            }
        }
        shrink_repeated_constants(g, p, b0, nodes, values);
        expand_concat_slices(p, b0);
    }

    /// A tensor `[k B0, ...]` of repeated slices concatenated (on another axis) with a
    /// tensor of `k N` rows, like a class token (TimeSformer's, one per frame of each
    /// sample: `k` frames), becomes its first slice expanded to the rows of that tensor at
    /// run time: `Expand(c[0:1], Concat(Shape(x)[0:1], c.dims[1..]))`. Its slices are known
    /// to repeat when it is a constant whose slices are equal, when it has one row (the
    /// exporter dropped the no-op expand of a parameter at batch 1), or when an Expand of
    /// an operand with a leading 1, or of fewer axes, made it.
    fn expand_concat_slices(p: &mut Program, b0: i64) {
        use pipewright_ops::Op;
        let mut k = p.instrs.len();
        while k > 0 {
            k -= 1;
            let Op::Concat { axis } = p.instrs[k].op else { continue };
            let ins = p.instrs[k].inputs.clone();
            let rank = ins.first().copied().flatten().map(|s| p.slots[s.index()].shape.len()).unwrap_or(0) as i64;
            if rank < 2 || axis == 0 || axis == -rank {
                continue;
            }
            let Some((batched, per_sample)) = ins.iter().flatten().copied().find_map(|s| match p.slots[s.index()].shape.first() {
                Some(&Extent::Batch(c)) => Some((s, c)),
                _ => None,
            }) else {
                continue;
            };
            let rows = per_sample * b0;
            // Instructions go in before the Concat, which moves down as they do.
            let mut concat_at = k;
            for (pos, s) in ins.iter().enumerate() {
                let Some(s) = *s else { continue };
                let shape = &p.slots[s.index()].shape;
                if shape.len() < 2 || shape[0] != Extent::Fixed(rows) {
                    continue;
                }
                let fixed: Option<Vec<i64>> = shape.iter().map(|e| if let Extent::Fixed(v) = e { Some(*v) } else { None }).collect();
                let Some(dims) = fixed else { continue };
                let before = p.instrs.len();
                let Some(single) = first_slice(p, s, rows, concat_at) else { continue };
                concat_at += p.instrs.len() - before;
                let expanded = expand_to_batch(p, single, (batched, per_sample), &dims, concat_at);
                concat_at += 3;
                p.instrs[concat_at].inputs[pos] = Some(expanded);
            }
        }
    }

    /// A slot holding the first of `s`'s `rows` equal slices, or `None` when they are not
    /// known to be equal. May insert a Slice instruction at `k`.
    fn first_slice(p: &mut Program, s: SlotId, rows: i64, k: usize) -> Option<SlotId> {
        use pipewright_ops::Op;
        use pipewright_ops::op::Slice;
        use pipewright_runtime::program::Instr;
        if let Some(st) = p.stored.iter().position(|x| x.slot == s && !x.trainable) {
            let (dims, bytes) = (p.stored[st].dims.clone(), p.stored[st].bytes.clone());
            let slice = bytes.len() / rows.max(1) as usize;
            if slice == 0 || !bytes.chunks(slice).all(|c| c == &bytes[..slice]) {
                return None;
            }
            let (name, elem) = (p.slots[s.index()].name.clone(), p.slots[s.index()].elem);
            let mut one = dims;
            one[0] = 1;
            let single = new_slot(p, &format!("{name}:slice"), elem, one.iter().map(|&d| Extent::Fixed(d)).collect());
            p.stored.push(Stored { slot: single, elem, dims: one, bytes: bytes.slice(..slice), trainable: false, versions: 1, update: UpdateRule::Constant, sync: Vec::new() });
            return Some(single);
        }
        if rows == 1 {
            return Some(s);
        }
        let producer = p.instrs[..k].iter().rev().find(|i| i.outputs.contains(&Some(s)))?;
        let operand = &p.slots[producer.inputs.first().copied().flatten()?.index()].shape;
        let repeats = operand.len() < p.slots[s.index()].shape.len() || operand.first() == Some(&Extent::Fixed(1));
        if !matches!(producer.op, Op::Expand) || !repeats {
            return None;
        }
        let (name, elem) = (p.slots[s.index()].name.clone(), p.slots[s.index()].elem);
        let mut shape = p.slots[s.index()].shape.clone();
        shape[0] = Extent::Fixed(1);
        let single = new_slot(p, &format!("{name}:slice"), elem, shape);
        let label = p.instrs[k].name.clone();
        let slice = Op::Slice(Slice { attrs: Some((vec![0], vec![1], Some(vec![0]))) });
        p.instrs.insert(k, Instr { name: format!("{label}:slice"), op: slice, inputs: vec![Some(s)], outputs: vec![Some(single)], recompute: false });
        Some(single)
    }

    /// Inserts, at `k`, `Expand(single, Concat(Shape(batched)[0:1], dims[1..]))` and
    /// returns its output slot; `batched` has `rows N` rows.
    fn expand_to_batch(p: &mut Program, single: SlotId, (batched, rows): (SlotId, i64), dims: &[i64], k: usize) -> SlotId {
        use pipewright_ops::Op;
        use pipewright_runtime::program::Instr;
        let (name, elem) = (p.slots[single.index()].name.clone(), p.slots[single.index()].elem);
        let rest = push_i64(p, &format!("{name}:dims"), &dims[1..]);
        let n_slot = new_slot(p, &format!("{name}:batch"), DType::I64, vec![Extent::Fixed(1)]);
        let target = new_slot(p, &format!("{name}:target"), DType::I64, vec![Extent::Fixed(dims.len() as i64)]);
        let mut shape = vec![Extent::Batch(rows)];
        shape.extend(dims[1..].iter().map(|&d| Extent::Fixed(d)));
        let expanded = new_slot(p, &format!("{name}:expanded"), elem, shape);
        let label = p.instrs[k].name.clone();
        let new = [
            Instr { name: format!("{label}:batch"), op: Op::Shape { start: 0, end: Some(1) }, inputs: vec![Some(batched)], outputs: vec![Some(n_slot)], recompute: false },
            Instr { name: format!("{label}:target"), op: Op::Concat { axis: 0 }, inputs: vec![Some(n_slot), Some(rest)], outputs: vec![Some(target)], recompute: false },
            Instr { name: format!("{label}:expand"), op: Op::Expand, inputs: vec![Some(single), Some(target)], outputs: vec![Some(expanded)], recompute: false },
        ];
        for (i, instr) in new.into_iter().enumerate() {
            p.instrs.insert(k + i, instr);
        }
        expanded
    }

    fn new_slot(p: &mut Program, name: &str, elem: DType, shape: Vec<Extent>) -> SlotId {
        let slot = SlotId(p.slots.len() as u32);
        p.slots.push(SlotInfo { name: name.to_string(), elem, shape, last_use: None });
        slot
    }

    fn is_const(g: &Graph, v: ValueId) -> bool {
        matches!(&g.value(v).def, ValueDef::Weight(w) if !w.trainable)
    }

    /// Whether `v` is read as the indices of GatherElements/ScatterElements, whose shape
    /// is the result's: an index tensor kept at extent 1 would not broadcast there.
    fn read_as_element_indices(g: &Graph, v: Option<ValueId>) -> bool {
        v.is_some_and(|v| {
            g.consumers(v).iter().any(|(n, slot)| {
                matches!(g.node(*n).op, Op::GatherElements { .. } | Op::ScatterElements { .. } | Op::Scatter { .. }) && *slot == 1
            })
        })
    }

    /// An Expand target with `1` wherever the operand's own extent is the batch, and
    /// where a leading axis of extent 1 was expanded to the export batch (the result then
    /// broadcasts against the batch instead of fixing it).
    fn expand_target(g: &Graph, x: Option<ValueId>, out: &[Dim], b0: i64) -> Option<Vec<i64>> {
        let xs = &g.value(x?).ty.shape.0;
        let off = out.len().checked_sub(xs.len())?;
        let mut t = Vec::with_capacity(out.len());
        let mut changed = false;
        for (i, d) in out.iter().enumerate() {
            t.push(match d {
                Dim::Fixed(v) if i == 0 && *v == b0 && (off > 0 || xs[0] == Dim::Fixed(1)) => {
                    changed = true;
                    1
                }
                Dim::Fixed(v) => *v,
                Dim::Batch(_) if i >= off && xs[i - off] == *d => {
                    changed = true;
                    1
                }
                Dim::Batch(_) => return None,
            });
        }
        changed.then_some(t)
    }

    /// Tile repeats with `1` where a leading axis of extent 1 was repeated to the export
    /// batch (position ids tiled over the batch): like an Expand to the export batch, the
    /// result then broadcasts against the batch.
    fn tile_repeats(g: &Graph, x: Option<ValueId>, repeats: ValueId, b0: i64) -> Option<Vec<i64>> {
        let first = g.value(x?).ty.shape.0.first().copied();
        let ValueDef::Weight(w) = &g.value(repeats).def else { return None };
        let mut reps = w.data.to_i64s();
        (first == Some(Dim::Fixed(1)) && reps.first() == Some(&b0) && b0 != 1).then(|| {
            reps[0] = 1;
            reps
        })
    }

    fn push_i64(p: &mut Program, name: &str, values: &[i64]) -> SlotId {
        let slot = SlotId(p.slots.len() as u32);
        p.slots.push(SlotInfo { name: name.to_string(), elem: DType::I64, shape: vec![Extent::Fixed(values.len() as i64)], last_use: None });
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        p.stored.push(Stored { slot, elem: DType::I64, dims: vec![values.len() as i64], bytes: bytes.into(), trainable: false, versions: 1, update: UpdateRule::Constant, sync: Vec::new() });
        slot
    }

    /// Constants `[B0, ...]` whose B0 slices are equal and whose readers all broadcast them
    /// keep one slice. So do those read where one slice gives one slice of the result,
    /// which broadcasting readers then take: a Gather (axis 0) taking them as indices
    /// (token type ids the exporter folded to the export batch, looked up in their
    /// embedding), and an Expand of a constant target that repeats the export batch (a
    /// mask of those ids expanded over the heads), whose target's batch becomes 1.
    fn shrink_repeated_constants(g: &Graph, p: &mut Program, b0: i64, nodes: &[NodeId], values: &[ValueId]) {
        // Attention's mask (operand 3) broadcasts over the batch as an added one does.
        let broadcasting = |n: NodeId, slot: usize| matches!(g.node(n).op, Op::Binary(_) | Op::Variadic(_) | Op::Where) || matches!(g.node(n).op, Op::Attention(_)) && slot == 3;
        let broadcasts = |v: ValueId| {
            let c = g.consumers(v);
            !c.is_empty() && c.iter().all(|&(n, slot)| broadcasting(n, slot))
        };
        // The results a slice of `v` narrows to one slice, and the Expand targets (by
        // instruction) that must repeat it once; `None` when a reader needs every slice.
        let narrowing = |v: ValueId| -> Option<(Vec<ValueId>, Vec<(usize, Vec<i64>)>)> {
            let (mut outs, mut targets) = (Vec::new(), Vec::new());
            for (n, slot) in g.consumers(v) {
                let node = g.node(n);
                let out = node.outputs.first().copied().flatten();
                match (&node.op, slot) {
                    _ if broadcasting(n, slot) => {}
                    (Op::Gather { axis: 0 }, 1) if out.is_some_and(broadcasts) => outs.extend(out),
                    (Op::Expand, 0) if out.is_some_and(broadcasts) => {
                        let target = node.inputs.get(1).copied().flatten().filter(|t| is_const(g, *t))?;
                        let mut t = g.value(target).weight()?.data.to_i64s();
                        let k = nodes.iter().position(|&m| m == n)?;
                        if t.first() != Some(&b0) {
                            return None;
                        }
                        t[0] = 1;
                        outs.extend(out);
                        targets.push((k, t));
                    }
                    _ => return None,
                }
            }
            Some((outs, targets))
        };
        let slot_of = |v: ValueId| values.iter().position(|&x| x == v);
        let (mut narrowed, mut retargeted) = (Vec::new(), Vec::new());
        for s in p.stored.iter_mut() {
            let Some(&v) = values.get(s.slot.index()) else { continue };
            if s.trainable || s.dims.len() < 2 || s.dims[0] != b0 || g.consumers(v).is_empty() {
                continue;
            }
            let Some((outs, targets)) = narrowing(v) else { continue };
            let slice = s.bytes.len() / b0 as usize;
            let first = &s.bytes[..slice];
            if s.bytes.chunks(slice).all(|c| c == first) {
                s.bytes = s.bytes.slice(..slice);
                s.dims[0] = 1;
                narrowed.push(s.slot.index());
                narrowed.extend(outs.into_iter().filter_map(slot_of));
                retargeted.extend(targets);
            }
        }
        for slot in narrowed {
            if let Some(first) = p.slots[slot].shape.first_mut() {
                *first = Extent::Fixed(1);
            }
        }
        for (k, target) in retargeted {
            let slot = push_i64(p, &format!("{}:one_slice", g.node(nodes[k]).name), &target);
            p.instrs[k].inputs[1] = Some(slot);
        }
    }
}
