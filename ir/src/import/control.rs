//! Control flow, sequences and optionals, resolved at import.
//!
//! A static-graph compiler has no run-time branches, loops or tensor lists, so these
//! ops never reach the IR: `If` inlines the branch its (import-time known) condition
//! takes; `Loop` and `Scan` are unrolled when the trip count, the condition's evolution
//! and the sequence length are known; a sequence is tracked as the list of its tensor
//! values and an optional as at most one. Subgraph nodes are imported like top-level
//! ones, their values renamed `node/iteration/name` so every unrolled copy is distinct;
//! names a subgraph reads from the enclosing scope resolve through the importer's table.
//! Cases that would need run-time control (an unknown condition, a position computed
//! from data) are refused naming the node.

use std::collections::{HashMap, HashSet};

use onnx_protobuf::{GraphProto, NodeProto};

use pipewright_ops::onnx::AttrSource;

use super::attrs::Attrs;
use super::Importer;
use crate::dim::{Dim, Shape, TensorType};
use crate::error::{ImportError, NodeRef};
use pipewright_ops::op::{CastMode, Op, Slice};
use crate::{DType, TensorData, ValueDef, ValueId, Weight};

/// The most attention heads FlexAttention expands (an index constant of one entry each).
const MAX_HEADS: i64 = 1 << 16;

/// Iterations beyond which a loop is not unrolled (the graph would grow without bound).
const MAX_UNROLL: i64 = 1024;

/// The ops this module resolves (they have no `Op`).
pub(super) fn is_resolved_at_import(op_type: &str) -> bool {
    matches!(
        op_type,
        "If" | "Loop"
            | "Scan"
            | "SequenceConstruct"
            | "SequenceAt"
            | "SequenceEmpty"
            | "SequenceInsert"
            | "SequenceErase"
            | "SequenceLength"
            | "SplitToSequence"
            | "ConcatFromSequence"
            | "Optional"
            | "OptionalHasElement"
            | "OptionalGetElement"
            | "FlexAttention"
    )
}

/// A value that is not a tensor: a sequence of tensors or an optional tensor.
#[derive(Clone, Debug)]
pub(crate) enum Composite {
    Sequence(Vec<ValueId>),
    Optional(Option<ValueId>),
}

impl Composite {
    pub(super) fn describe(&self) -> &'static str {
        match self {
            Composite::Sequence(_) => "a sequence",
            Composite::Optional(_) => "an optional",
        }
    }
}

/// What a name is bound to.
#[derive(Clone, Debug)]
pub(super) enum Bound {
    Tensor(ValueId),
    Composite(Composite),
}

/// Whether a Scan among `nodes` walks one of the graph `inputs` along its axis 0 (Scan 8
/// walks every scanned input per batch row, so also along axis 0).
pub(super) fn scans_inputs_along_axis0(nodes: &[NodeProto], inputs: &[onnx_protobuf::ValueInfoProto], opset: i64) -> bool {
    let is_input = |name: &str| inputs.iter().any(|i| i.name == name);
    nodes.iter().filter(|n| n.op_type == "Scan").any(|n| {
        let attr = |name: &str| n.attribute.iter().find(|a| a.name == name);
        let m = attr("num_scan_inputs").map_or(0, |a| a.i.max(0) as usize).min(n.input.len());
        let first = n.input.len() - m;
        let axes = attr("scan_input_axes").map(|a| a.ints.clone()).unwrap_or_default();
        // Scan 8 has no scan_input_axes: its batch axis 0 is walked row by row.
        let v8 = opset < 9;
        n.input[first..].iter().enumerate().any(|(j, x)| is_input(x) && (v8 || axes.get(j).copied().unwrap_or(0) == 0))
            || (v8 && n.input.iter().skip(1).any(|x| is_input(x)))
    })
}

/// Every node of `nodes` and of their subgraphs, at any depth.
pub(super) fn nested_nodes(nodes: &[NodeProto]) -> Vec<&NodeProto> {
    let mut all = Vec::new();
    for n in nodes {
        all.push(n);
        for g in subgraphs(n) {
            all.extend(nested_nodes(&g.node));
        }
    }
    all
}

fn subgraphs(n: &NodeProto) -> impl Iterator<Item = &GraphProto> {
    n.attribute.iter().flat_map(|a| a.g.as_ref().into_iter().chain(a.graphs.iter()))
}

/// The names `n` reads: its inputs and the outer-scope names its subgraphs read.
pub(super) fn reads(n: &NodeProto) -> Vec<String> {
    let mut names: Vec<String> = n.input.iter().filter(|x| !x.is_empty()).cloned().collect();
    for g in subgraphs(n) {
        names.extend(free_names(g));
    }
    names
}

/// The names `g` reads without defining them (its outer-scope references).
fn free_names(g: &GraphProto) -> Vec<String> {
    let mut defined: HashSet<&str> = g.input.iter().map(|i| i.name.as_str()).chain(g.initializer.iter().map(|t| t.name.as_str())).collect();
    let mut free = Vec::new();
    for n in &g.node {
        for r in reads(n) {
            if !defined.contains(r.as_str()) {
                free.push(r);
            }
        }
        defined.extend(n.output.iter().map(|o| o.as_str()));
    }
    free.extend(g.output.iter().filter(|o| !defined.contains(o.name.as_str())).map(|o| o.name.clone()));
    free
}

/// Renames the outer-scope references of `g` (and of its own subgraphs) by `map`.
fn rename_free(g: &mut GraphProto, map: &HashMap<String, String>) {
    let local: HashSet<String> = g
        .input
        .iter()
        .map(|i| i.name.clone())
        .chain(g.initializer.iter().map(|t| t.name.clone()))
        .chain(g.node.iter().flat_map(|n| n.output.iter().cloned()))
        .collect();
    let outer: HashMap<String, String> = map.iter().filter(|(k, _)| !local.contains(*k)).map(|(k, v)| (k.clone(), v.clone())).collect();
    for n in g.node.iter_mut() {
        rename_node_reads(n, &outer);
    }
    for o in g.output.iter_mut() {
        if let Some(r) = outer.get(&o.name) {
            o.name = r.clone();
        }
    }
}

fn rename_node_reads(n: &mut NodeProto, map: &HashMap<String, String>) {
    for i in n.input.iter_mut() {
        if let Some(r) = map.get(i) {
            *i = r.clone();
        }
    }
    for a in n.attribute.iter_mut() {
        if let Some(g) = a.g.as_mut() {
            rename_free(g, map);
        }
        for g in a.graphs.iter_mut() {
            rename_free(g, map);
        }
    }
}

fn nref(node: &NodeProto) -> NodeRef {
    NodeRef { name: node.name.clone(), op_type: node.op_type.clone() }
}

fn bad(node: &NodeProto, reason: impl Into<String>) -> ImportError {
    ImportError::BadNode { node: nref(node), reason: reason.into() }
}

/// Scan's attributes (opset 9 on): per scan input and output, the axis and whether it is
/// walked in reverse.
struct ScanAxes {
    in_axes: Vec<i64>,
    in_reverse: Vec<bool>,
    out_axes: Vec<i64>,
    out_reverse: Vec<bool>,
}

impl Importer<'_> {
    /// Resolves one node of [`is_resolved_at_import`]'s ops.
    pub(super) fn add_control(&mut self, node: &NodeProto, version: i64, opset: i64) -> Result<(), ImportError> {
        let mut a = Attrs::new(&node.attribute);
        let result = match node.op_type.as_str() {
            "If" => self.inline_if(node, &mut a, opset),
            "Loop" => self.unroll_loop(node, &mut a, opset),
            "Scan" if version < 9 => self.unroll_scan8(node, &mut a, opset),
            "Scan" => self.unroll_scan(node, &mut a, opset),
            "SplitToSequence" => self.split_to_sequence(node, &mut a, opset),
            "ConcatFromSequence" => self.concat_from_sequence(node, &mut a),
            "FlexAttention" => self.flex_attention(node, &mut a, opset),
            _ => self.sequence_or_optional(node, &mut a),
        };
        result?;
        a.finish().map_err(|r| bad(node, r))
    }

    fn bound(&self, name: &str) -> Option<Bound> {
        if let Some(&v) = self.names.get(name) {
            return Some(Bound::Tensor(v));
        }
        self.composites.get(name).map(|c| Bound::Composite(c.clone()))
    }

    fn bind(&mut self, name: String, b: Bound) {
        match b {
            Bound::Tensor(v) => {
                self.composites.remove(&name);
                self.names.insert(name, v);
            }
            Bound::Composite(c) => {
                self.names.remove(&name);
                self.composites.insert(name, c);
            }
        }
    }

    /// The binding of input `slot` of `node` (`None` when omitted).
    fn input_bound(&self, node: &NodeProto, slot: usize) -> Result<Option<Bound>, ImportError> {
        match node.input.get(slot).filter(|n| !n.is_empty()) {
            None => Ok(None),
            Some(n) => self.bound(n).map(Some).ok_or_else(|| ImportError::UndefinedInput { node: nref(node), input: n.clone() }),
        }
    }

    fn tensor_at(&self, node: &NodeProto, slot: usize) -> Result<Option<ValueId>, ImportError> {
        match self.input_bound(node, slot)? {
            None => Ok(None),
            Some(Bound::Tensor(v)) => Ok(Some(v)),
            Some(Bound::Composite(c)) => Err(bad(node, format!("input {slot} is {}, where a tensor is needed", c.describe()))),
        }
    }

    fn sequence_at(&self, node: &NodeProto, slot: usize) -> Result<Vec<ValueId>, ImportError> {
        match self.input_bound(node, slot)? {
            Some(Bound::Composite(Composite::Sequence(s))) => Ok(s),
            _ => Err(bad(node, format!("input {slot} must be a sequence"))),
        }
    }

    /// The integer contents of input `slot`, which must be known at import.
    fn known_ints_at(&self, node: &NodeProto, slot: usize, what: &str) -> Result<Option<Vec<i64>>, ImportError> {
        let Some(v) = self.tensor_at(node, slot)? else { return Ok(None) };
        self.known_ints(v)
            .map(Some)
            .ok_or_else(|| bad(node, format!("its {what} (input {slot}) is not known at import; run-time control flow is not supported")))
    }

    fn known_ints(&self, v: ValueId) -> Option<Vec<i64>> {
        self.known.get(v.index())?.as_ref()?.fixed_ints()
    }

    fn constant(&mut self, name: String, data: TensorData) -> ValueId {
        let ty = TensorType::new(data.dtype, Shape::fixed(&data.dims));
        self.define(name, ty, ValueDef::Weight(Weight { data, trainable: false }))
    }

    fn bool_constant(&mut self, name: String, b: bool) -> ValueId {
        self.constant(name, TensorData::from_f64s(DType::Bool, vec![], &[b as i64 as f64]))
    }

    /// Adds `op` on `inputs` with one output named `name`; returns its value.
    fn add_one(&mut self, name: &str, op: Op, inputs: Vec<Option<ValueId>>) -> Result<ValueId, ImportError> {
        let op_type = op.name();
        self.add_op(name, op_type, op, inputs, &[name.to_string()])?;
        Ok(self.names[name])
    }

    /// Imports `g`'s nodes with its inputs bound to `formals`, its values renamed under
    /// `prefix`; returns the bindings of its outputs.
    fn inline_graph(&mut self, owner: &NodeProto, g: &GraphProto, prefix: &str, formals: Vec<Bound>, opset: i64) -> Result<Vec<Bound>, ImportError> {
        if formals.len() != g.input.len() {
            return Err(bad(owner, format!("its subgraph {:?} takes {} inputs; {} are bound", g.name, g.input.len(), formals.len())));
        }
        let mut rename: HashMap<String, String> = HashMap::new();
        for (vi, b) in g.input.iter().zip(formals) {
            let new = format!("{prefix}/{}", vi.name);
            rename.insert(vi.name.clone(), new.clone());
            self.bind(new, b);
        }
        for t in &g.initializer {
            let new = format!("{prefix}/{}", t.name);
            let data = super::tensor::tensor_from_proto(t.clone(), self.dir)?;
            rename.insert(t.name.clone(), new.clone());
            self.constant(new, data);
        }
        for (i, n) in g.node.iter().enumerate() {
            let mut n = n.clone();
            n.name = format!("{prefix}/{}", if n.name.is_empty() { format!("{}_{i}", n.op_type) } else { n.name.clone() });
            rename_node_reads(&mut n, &rename);
            for out in n.output.iter_mut().filter(|o| !o.is_empty()) {
                let new = format!("{prefix}/{out}");
                rename.insert(out.clone(), new.clone());
                *out = new;
            }
            self.add_node(&n, opset)?;
        }
        g.output
            .iter()
            .map(|o| {
                let name = rename.get(&o.name).unwrap_or(&o.name);
                self.bound(name).ok_or_else(|| bad(owner, format!("its subgraph {:?} does not define its output {:?}", g.name, o.name)))
            })
            .collect()
    }

    fn bind_outputs(&mut self, node: &NodeProto, outs: Vec<Bound>) -> Result<(), ImportError> {
        if node.output.len() > outs.len() {
            return Err(bad(node, format!("has {} outputs; its subgraph gives {}", node.output.len(), outs.len())));
        }
        for (name, b) in node.output.iter().zip(outs) {
            if !name.is_empty() {
                self.bind(name.clone(), b);
            }
        }
        Ok(())
    }

    fn subgraph<'g>(node: &NodeProto, a: &mut Attrs<'g>, name: &str) -> Result<&'g GraphProto, ImportError> {
        a.graph(name).map_err(|r| bad(node, r))?.ok_or_else(|| bad(node, format!("has no {name:?} attribute")))
    }

    /// If: inlines the branch the import-time condition selects.
    fn inline_if(&mut self, node: &NodeProto, a: &mut Attrs, opset: i64) -> Result<(), ImportError> {
        let then_branch = Self::subgraph(node, a, "then_branch")?;
        let else_branch = Self::subgraph(node, a, "else_branch")?;
        let cond = self.known_ints_at(node, 0, "condition")?.unwrap_or_default();
        let [c] = cond[..] else { return Err(bad(node, "its condition must hold one element")) };
        let (branch, tag) = if c != 0 { (then_branch, "then") } else { (else_branch, "else") };
        let outs = self.inline_graph(node, branch, &format!("{}/{tag}", node.name), vec![], opset)?;
        self.bind_outputs(node, outs)
    }

    /// Loop: unrolled while the trip count and the condition (known at import after each
    /// iteration) let it run; scan outputs are stacked along a new axis 0.
    fn unroll_loop(&mut self, node: &NodeProto, a: &mut Attrs, opset: i64) -> Result<(), ImportError> {
        let body = Self::subgraph(node, a, "body")?;
        let trips = self.known_ints_at(node, 0, "trip count")?.map(|v| v.first().copied().unwrap_or(0));
        let mut cond = self.known_ints_at(node, 1, "condition")?.is_none_or(|v| v.first().is_some_and(|&c| c != 0));
        let mut state: Vec<Bound> = (2..node.input.len())
            .map(|slot| self.input_bound(node, slot)?.ok_or_else(|| bad(node, format!("loop-carried input {slot} is omitted"))))
            .collect::<Result<_, _>>()?;
        let n_scan = body.output.len().checked_sub(1 + state.len()).ok_or_else(|| bad(node, "its body gives fewer outputs than the loop carries"))?;
        let mut scans: Vec<Vec<ValueId>> = vec![Vec::new(); n_scan];
        let mut i = 0;
        while cond && trips.is_none_or(|m| i < m) {
            if i >= MAX_UNROLL {
                return Err(bad(node, format!("runs more than {MAX_UNROLL} iterations; unrolling it is not supported")));
            }
            let prefix = format!("{}/{i}", node.name);
            let iteration = self.constant(format!("{prefix}/iteration"), TensorData::from_i64s(vec![], &[i]));
            let cond_in = self.bool_constant(format!("{prefix}/condition"), cond);
            let formals = [Bound::Tensor(iteration), Bound::Tensor(cond_in)].into_iter().chain(state.iter().cloned()).collect();
            let outs = self.inline_graph(node, body, &prefix, formals, opset)?;
            cond = match &outs[0] {
                Bound::Tensor(v) => self.known_ints(*v).and_then(|c| c.first().map(|&c| c != 0)),
                _ => None,
            }
            .ok_or_else(|| bad(node, format!("its condition after iteration {i} is not known at import; a data-dependent loop is not supported")))?;
            state = outs[1..1 + state.len()].to_vec();
            for (k, out) in outs[1 + state.len()..].iter().enumerate() {
                let Bound::Tensor(v) = out else { return Err(bad(node, "a scan output of its body is not a tensor")) };
                scans[k].push(*v);
            }
            i += 1;
        }
        let mut outs = state;
        for (k, vs) in scans.iter().enumerate() {
            if vs.is_empty() {
                return Err(bad(node, "runs no iteration, so its scan outputs have no static shape; not supported"));
            }
            outs.push(Bound::Tensor(self.stack(&format!("{}/scan_output_{k}", node.name), vs, 0)?));
        }
        self.bind_outputs(node, outs)
    }

    /// The tensors `vs` stacked along a new `axis` (Unsqueeze then Concat).
    fn stack(&mut self, name: &str, vs: &[ValueId], axis: i64) -> Result<ValueId, ImportError> {
        let mut parts = Vec::with_capacity(vs.len());
        // From opset 13 the axes are an input (the IR's text form follows the opset).
        let axes_input = (self.graph.meta.opset >= 13).then(|| self.constant(format!("{name}/axes"), TensorData::from_i64s(vec![1], &[axis])));
        let op = Op::Unsqueeze { axes: if axes_input.is_some() { None } else { Some(vec![axis]) } };
        for (j, &v) in vs.iter().enumerate() {
            parts.push(Some(self.add_one(&format!("{name}/{j}/unsqueezed"), op.clone(), vec![Some(v), axes_input])?));
        }
        self.add_one(name, Op::Concat { axis }, parts)
    }

    /// Element `index` of `v` along `axis`, the axis removed (Gather of a scalar index).
    fn take(&mut self, name: &str, v: ValueId, axis: i64, index: i64) -> Result<ValueId, ImportError> {
        let idx = self.constant(format!("{name}/index"), TensorData::from_i64s(vec![], &[index]));
        self.add_one(name, Op::Gather { axis }, vec![Some(v), Some(idx)])
    }

    /// The fixed extent of `v` along `axis` (negative counts from the end).
    fn extent(&self, node: &NodeProto, v: ValueId, axis: i64) -> Result<(i64, i64), ImportError> {
        let shape = &self.graph.value(v).ty.shape;
        let rank = shape.rank() as i64;
        let ax = if axis < 0 { axis + rank } else { axis };
        if !(0..rank).contains(&ax) {
            return Err(bad(node, format!("axis {axis} is out of range for rank {rank}")));
        }
        match shape.0[ax as usize] {
            Dim::Fixed(n) => Ok((ax, n)),
            _ => Err(bad(node, format!("axis {axis} is the symbolic batch; resolving it at import (unrolling or splitting along it) is not supported"))),
        }
    }

    /// Scan (opset 9 on): unrolled over the scan inputs' common, fixed length.
    fn unroll_scan(&mut self, node: &NodeProto, a: &mut Attrs, opset: i64) -> Result<(), ImportError> {
        let body = Self::subgraph(node, a, "body")?;
        let m = a.int("num_scan_inputs").map_err(|r| bad(node, r))?.ok_or_else(|| bad(node, "has no num_scan_inputs"))?;
        let m = usize::try_from(m).ok().filter(|&m| m >= 1 && m <= node.input.len()).ok_or_else(|| bad(node, "num_scan_inputs is out of range"))?;
        let n = node.input.len() - m;
        let k = body.output.len().checked_sub(n).ok_or_else(|| bad(node, "its body gives fewer outputs than the scan carries"))?;
        let list = |a: &mut Attrs, name: &str, len: usize| -> Result<Vec<i64>, ImportError> {
            let v = a.ints(name).map_err(|r| bad(node, r))?.unwrap_or_else(|| vec![0; len]);
            if v.len() != len {
                return Err(bad(node, format!("{name} has {} entries for {len} values", v.len())));
            }
            Ok(v)
        };
        let axes = ScanAxes {
            in_axes: list(a, "scan_input_axes", m)?,
            in_reverse: list(a, "scan_input_directions", m)?.iter().map(|&d| d != 0).collect(),
            out_axes: list(a, "scan_output_axes", k)?,
            out_reverse: list(a, "scan_output_directions", k)?.iter().map(|&d| d != 0).collect(),
        };
        let inputs = (0..node.input.len())
            .map(|s| self.tensor_at(node, s)?.ok_or_else(|| bad(node, format!("input {s} is omitted"))))
            .collect::<Result<Vec<_>, _>>()?;
        let outs = self.scan_core(node, body, &node.name, &inputs[..n], &inputs[n..], &axes, opset)?;
        self.bind_outputs(node, outs.into_iter().map(Bound::Tensor).collect())
    }

    /// The unrolled scan of `scanned` with initial `states`: the final states, then the
    /// stacked scan outputs.
    #[allow(clippy::too_many_arguments)]
    fn scan_core(
        &mut self,
        node: &NodeProto,
        body: &GraphProto,
        prefix: &str,
        states: &[ValueId],
        scanned: &[ValueId],
        axes: &ScanAxes,
        opset: i64,
    ) -> Result<Vec<ValueId>, ImportError> {
        let mut len = None;
        for (&v, &axis) in scanned.iter().zip(&axes.in_axes) {
            let (_, l) = self.extent(node, v, axis)?;
            if len.is_some_and(|len| len != l) {
                return Err(bad(node, "its scan inputs differ in length"));
            }
            len = Some(l);
        }
        let len = len.unwrap_or(0);
        if len == 0 || len > MAX_UNROLL {
            return Err(bad(node, format!("scans {len} steps; only 1 to {MAX_UNROLL} steps are unrolled (not supported)")));
        }
        let mut state: Vec<ValueId> = states.to_vec();
        let mut scans: Vec<Vec<ValueId>> = vec![Vec::new(); axes.out_axes.len()];
        for t in 0..len {
            let step = format!("{prefix}/{t}");
            let mut formals: Vec<Bound> = state.iter().map(|&v| Bound::Tensor(v)).collect();
            for (j, &v) in scanned.iter().enumerate() {
                let index = if axes.in_reverse[j] { len - 1 - t } else { t };
                formals.push(Bound::Tensor(self.take(&format!("{step}/scan_input_{j}"), v, axes.in_axes[j], index)?));
            }
            let outs = self.inline_graph(node, body, &step, formals, opset)?;
            let tensors = outs
                .into_iter()
                .map(|b| match b {
                    Bound::Tensor(v) => Ok(v),
                    Bound::Composite(c) => Err(bad(node, format!("its body gives {}, where a tensor is needed", c.describe()))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            state = tensors[..state.len()].to_vec();
            for (k, &v) in tensors[state.len()..].iter().enumerate() {
                scans[k].push(v);
            }
        }
        for (k, mut vs) in scans.into_iter().enumerate() {
            if axes.out_reverse[k] {
                vs.reverse();
            }
            state.push(self.stack(&format!("{prefix}/scan_output_{k}"), &vs, axes.out_axes[k])?);
        }
        Ok(state)
    }

    /// Scan of opset 8: a leading batch axis on every state and scan input (the scan axis
    /// is axis 1), optional per-row sequence lengths (only the full length is accepted).
    fn unroll_scan8(&mut self, node: &NodeProto, a: &mut Attrs, opset: i64) -> Result<(), ImportError> {
        let body = Self::subgraph(node, a, "body")?;
        let m = a.int("num_scan_inputs").map_err(|r| bad(node, r))?.ok_or_else(|| bad(node, "has no num_scan_inputs"))?;
        let m = usize::try_from(m).ok().filter(|&m| m >= 1 && m < node.input.len()).ok_or_else(|| bad(node, "num_scan_inputs is out of range"))?;
        let n = node.input.len() - 1 - m;
        let k = body.output.len().checked_sub(n).ok_or_else(|| bad(node, "its body gives fewer outputs than the scan carries"))?;
        let dirs = a.ints("directions").map_err(|r| bad(node, r))?.unwrap_or_else(|| vec![0; m]);
        if dirs.len() != m {
            return Err(bad(node, "directions must have one entry per scan input"));
        }
        let inputs = (1..node.input.len())
            .map(|s| self.tensor_at(node, s)?.ok_or_else(|| bad(node, format!("input {s} is omitted"))))
            .collect::<Result<Vec<_>, _>>()?;
        let (_, batch) = self.extent(node, inputs[0], 0)?;
        let (_, len) = self.extent(node, inputs[n], 1)?;
        // Every batch row is unrolled too: a declared batch of 2^40 rows made the importer
        // add nodes until memory ran out (found by pipewright-fuzz,
        // fuzz/crashes/onnx-d813efc48b2a0a0c.bin).
        if (batch as i64).saturating_mul(len as i64) > MAX_UNROLL {
            return Err(bad(node, format!("scans {batch} rows of {len} steps; at most {MAX_UNROLL} steps in all are unrolled (not supported)")));
        }
        if let Some(lens) = self.known_ints_at(node, 0, "sequence lengths")? {
            if lens.iter().any(|&l| l != len) {
                return Err(bad(node, "sequence lengths shorter than the scan axis are not supported"));
            }
        }
        let axes = ScanAxes { in_axes: vec![0; m], in_reverse: dirs.iter().map(|&d| d != 0).collect(), out_axes: vec![0; k], out_reverse: vec![false; k] };
        let mut rows: Vec<Vec<ValueId>> = vec![Vec::new(); n + k];
        for b in 0..batch {
            let prefix = format!("{}/batch_{b}", node.name);
            let mut per_row = Vec::with_capacity(inputs.len());
            for (j, &v) in inputs.iter().enumerate() {
                per_row.push(self.take(&format!("{prefix}/input_{j}"), v, 0, b)?);
            }
            let outs = self.scan_core(node, body, &prefix, &per_row[..n], &per_row[n..], &axes, opset)?;
            for (slot, v) in outs.into_iter().enumerate() {
                rows[slot].push(v);
            }
        }
        let mut outs = Vec::with_capacity(rows.len());
        for (slot, vs) in rows.iter().enumerate() {
            outs.push(Bound::Tensor(self.stack(&format!("{}/output_{slot}", node.name), vs, 0)?));
        }
        self.bind_outputs(node, outs)
    }

    /// A position input (known at import) normalised against a sequence of `len`; `hi`
    /// is the largest valid position.
    fn position(&self, node: &NodeProto, slot: usize, len: usize, hi: i64, default: i64) -> Result<usize, ImportError> {
        let p = match self.known_ints_at(node, slot, "position")? {
            None => default,
            Some(v) => *v.first().ok_or_else(|| bad(node, "its position is empty"))?,
        };
        let len = len as i64;
        let q = if p < 0 { p + len } else { p };
        if q < 0 || q > hi {
            return Err(bad(node, format!("position {p} is out of range for a sequence of {len}")));
        }
        Ok(q as usize)
    }

    fn sequence_or_optional(&mut self, node: &NodeProto, a: &mut Attrs) -> Result<(), ImportError> {
        let out = node.output[0].clone();
        let bound = match node.op_type.as_str() {
            "SequenceEmpty" => {
                a.ignore("dtype");
                Bound::Composite(Composite::Sequence(Vec::new()))
            }
            "SequenceConstruct" => {
                let vs = (0..node.input.len())
                    .map(|s| self.tensor_at(node, s)?.ok_or_else(|| bad(node, format!("input {s} is omitted"))))
                    .collect::<Result<_, _>>()?;
                Bound::Composite(Composite::Sequence(vs))
            }
            "SequenceInsert" => {
                let mut seq = self.sequence_at(node, 0)?;
                let t = self.tensor_at(node, 1)?.ok_or_else(|| bad(node, "has no tensor to insert"))?;
                let len = seq.len();
                let at = self.position(node, 2, len, len as i64, len as i64)?;
                seq.insert(at, t);
                Bound::Composite(Composite::Sequence(seq))
            }
            "SequenceErase" => {
                let mut seq = self.sequence_at(node, 0)?;
                let len = seq.len();
                let at = self.position(node, 1, len, len as i64 - 1, len as i64 - 1)?;
                seq.remove(at);
                Bound::Composite(Composite::Sequence(seq))
            }
            "SequenceAt" => {
                let seq = self.sequence_at(node, 0)?;
                if node.input.get(1).is_none_or(|n| n.is_empty()) {
                    return Err(bad(node, "has no position"));
                }
                Bound::Tensor(seq[self.position(node, 1, seq.len(), seq.len() as i64 - 1, 0)?])
            }
            "SequenceLength" => {
                let len = self.sequence_at(node, 0)?.len() as i64;
                Bound::Tensor(self.constant(out.clone(), TensorData::from_i64s(vec![], &[len])))
            }
            "Optional" => {
                a.ignore("type");
                Bound::Composite(Composite::Optional(self.tensor_at(node, 0)?))
            }
            "OptionalHasElement" => {
                let has = match self.input_bound(node, 0)? {
                    None | Some(Bound::Composite(Composite::Optional(None))) => false,
                    Some(_) => true,
                };
                Bound::Tensor(self.bool_constant(out.clone(), has))
            }
            "OptionalGetElement" => match self.input_bound(node, 0)? {
                Some(Bound::Composite(Composite::Optional(Some(v)))) | Some(Bound::Tensor(v)) => Bound::Tensor(v),
                Some(Bound::Composite(Composite::Sequence(s))) => Bound::Composite(Composite::Sequence(s)),
                _ => return Err(bad(node, "its optional input is empty")),
            },
            other => return Err(bad(node, format!("{other} is not resolved at import"))),
        };
        self.bind(out, bound);
        Ok(())
    }

    /// SplitToSequence: the pieces along `axis` (size-1 pieces without `split`, squeezed
    /// unless `keepdims`; equal chunks for a scalar `split`; the given sizes for a list).
    fn split_to_sequence(&mut self, node: &NodeProto, a: &mut Attrs, opset: i64) -> Result<(), ImportError> {
        let axis = a.int_or("axis", 0).map_err(|r| bad(node, r))?;
        let keepdims = a.bool_or("keepdims", true).map_err(|r| bad(node, r))?;
        let x = self.tensor_at(node, 0)?.ok_or_else(|| bad(node, "has no input"))?;
        if let Some(pieces) = self.dense_split_to_sequence(node, x, axis, opset)? {
            self.bind(node.output[0].clone(), Bound::Composite(Composite::Sequence(pieces)));
            return Ok(());
        }
        let (ax, extent) = self.extent(node, x, axis)?;
        let split = match self.tensor_at(node, 1)? {
            None => None,
            Some(v) => {
                let sizes = self.known_ints_at(node, 1, "split")?.unwrap_or_default();
                Some((self.graph.value(v).ty.shape.rank() == 0, sizes))
            }
        };
        let name = &node.name;
        let mut pieces = Vec::new();
        let sizes: Vec<i64> = match split {
            None if !keepdims => {
                for i in 0..extent {
                    pieces.push(self.take(&format!("{name}/piece_{i}"), x, ax, i)?);
                }
                self.bind(node.output[0].clone(), Bound::Composite(Composite::Sequence(pieces)));
                return Ok(());
            }
            None => vec![1; extent as usize],
            Some((true, s)) => {
                let c = *s.first().filter(|&&c| c > 0).ok_or_else(|| bad(node, "its split must be positive"))?;
                (0..extent).step_by(c as usize).map(|start| c.min(extent - start)).collect()
            }
            Some((false, s)) => s,
        };
        if sizes.iter().any(|&s| s < 0) || sizes.iter().sum::<i64>() != extent {
            return Err(bad(node, format!("split sizes {sizes:?} do not add up to the extent {extent}")));
        }
        let mut start = 0;
        for (i, s) in sizes.iter().enumerate() {
            let piece = format!("{name}/piece_{i}");
            // From opset 10 the bounds are inputs (the IR's text form follows the opset).
            let (op, inputs) = if self.graph.meta.opset >= 10 {
                let mut bound = |what: &str, v: i64| Some(self.constant(format!("{piece}/{what}"), TensorData::from_i64s(vec![1], &[v])));
                let inputs = vec![Some(x), bound("starts", start), bound("ends", start + s), bound("axes", ax)];
                (Op::Slice(Slice { attrs: None }), inputs)
            } else {
                (Op::Slice(Slice { attrs: Some((vec![start], vec![start + s], Some(vec![ax]))) }), vec![Some(x)])
            };
            pieces.push(self.add_one(&piece, op, inputs)?);
            start += s;
        }
        self.bind(node.output[0].clone(), Bound::Composite(Composite::Sequence(pieces)));
        Ok(())
    }

    /// A SplitToSequence at sizes computed at run time (one per piece, a vector of fixed
    /// length) is read as the Split it is, densely ([`super::dense_split`]): its pieces
    /// are the Split's parts; `None` where its sizes are known or absent.
    fn dense_split_to_sequence(&mut self, node: &NodeProto, x: ValueId, axis: i64, opset: i64) -> Result<Option<Vec<ValueId>>, ImportError> {
        let Some(sizes) = self.tensor_at(node, 1)? else { return Ok(None) };
        let size_dims = self.graph.value(sizes).ty.shape.dims().to_vec();
        let [crate::Dim::Fixed(count)] = size_dims[..] else { return Ok(None) };
        if self.known.get(sizes.index()).is_some_and(|k| k.is_some()) {
            return Ok(None);
        }
        let name = &node.name;
        let pieces: Vec<String> = (0..count).map(|i| format!("{name}/piece_{i}")).collect();
        let split = NodeProto {
            name: name.clone(),
            op_type: "Split".into(),
            input: vec![self.graph.value(x).name.clone(), self.graph.value(sizes).name.clone()],
            output: pieces.clone(),
            attribute: vec![super::attrs::attribute_proto("axis", &pipewright_ops::op::AttrValue::Int(axis))],
            ..Default::default()
        };
        self.add_dense_split(&split, opset)?;
        Ok(Some(pieces.iter().map(|p| self.names[p]).collect()))
    }

    /// ConcatFromSequence: Concat of the elements, or their stack with `new_axis`.
    fn concat_from_sequence(&mut self, node: &NodeProto, a: &mut Attrs) -> Result<(), ImportError> {
        let axis = a.int("axis").map_err(|r| bad(node, r))?.ok_or_else(|| bad(node, "has no axis"))?;
        let new_axis = a.bool_or("new_axis", false).map_err(|r| bad(node, r))?;
        let seq = self.sequence_at(node, 0)?;
        if seq.is_empty() {
            return Err(bad(node, "concatenates an empty sequence (no static shape); not supported"));
        }
        let out = &node.output[0];
        let v = if new_axis { self.stack(out, &seq, axis)? } else { self.add_one(out, Op::Concat { axis }, seq.into_iter().map(Some).collect())? };
        self.bind(out.clone(), Bound::Tensor(v));
        Ok(())
    }

    /// FlexAttention (`ai.onnx.preview`): composed at import from MatMul, Softmax and the
    /// inlined `score_mod`/`prob_mod` subgraphs, as ONNX defines it: Q and K each scaled
    /// by `sqrt(scale)`, the scores cast to the softmax precision (f32 below double), K
    /// and V heads repeated for grouped queries (a Gather of head indices), the result
    /// cast back to V's type.
    fn flex_attention(&mut self, node: &NodeProto, a: &mut Attrs, opset: i64) -> Result<(), ImportError> {
        if opset < 13 {
            return Err(bad(node, "needs a default-domain opset of 13 or more (Softmax over the last axis)"));
        }
        let score_mod = a.graph("score_mod").map_err(|r| bad(node, r))?;
        let prob_mod = a.graph("prob_mod").map_err(|r| bad(node, r))?;
        let scale = a.float("scale").map_err(|r| bad(node, r))?;
        let precision = a.int("softmax_precision").map_err(|r| bad(node, r))?;
        let [q, k, v] = [0, 1, 2].map(|s| self.tensor_at(node, s));
        let (q, k, v) = (q?.ok_or_else(|| bad(node, "Q is required"))?, k?.ok_or_else(|| bad(node, "K is required"))?, v?.ok_or_else(|| bad(node, "V is required"))?);
        let dims = |v: ValueId| self.graph.value(v).ty.shape.0.clone();
        let (qd, kd) = (dims(q), dims(k));
        let (&[_, Dim::Fixed(hq), _, Dim::Fixed(e)], &[_, Dim::Fixed(hkv), _, _]) = (&qd[..], &kd[..]) else {
            return Err(bad(node, "Q, K and V must be rank 4 with fixed heads and head size"));
        };
        if hkv <= 0 || hq % hkv != 0 {
            return Err(bad(node, format!("{hq} query heads are not a multiple of {hkv} key/value heads")));
        }
        // Grouped heads become an index constant of `hq` entries: a declared head count of
        // 2^31 made the importer ask for 16 GiB (found by pipewright-fuzz,
        // fuzz/crashes/onnx-882de7f86be74da4.bin).
        if hq > MAX_HEADS {
            return Err(bad(node, format!("{hq} query heads is more than the {MAX_HEADS} supported")));
        }
        let q_dtype = self.graph.value(q).ty.dtype;
        let v_dtype = self.graph.value(v).ty.dtype;
        let compute = match precision {
            Some(code) => DType::from_onnx(code as i32).filter(|d| d.is_float()).ok_or_else(|| bad(node, format!("softmax_precision {code} is not a float type")))?,
            None if q_dtype == DType::F64 => DType::F64,
            None => DType::F32,
        };
        let name = node.name.clone();
        let (k, v) = if hq != hkv {
            let heads: Vec<i64> = (0..hq).map(|h| h / (hq / hkv)).collect();
            let idx = self.constant(format!("{name}/kv_heads"), TensorData::from_i64s(vec![hq], &heads));
            let k = self.add_one(&format!("{name}/k_grouped"), Op::Gather { axis: 1 }, vec![Some(k), Some(idx)])?;
            (k, self.add_one(&format!("{name}/v_grouped"), Op::Gather { axis: 1 }, vec![Some(v), Some(idx)])?)
        } else {
            (k, v)
        };
        let scale = scale.unwrap_or(1.0 / (e as f32).sqrt());
        let root = self.constant(format!("{name}/sqrt_scale"), TensorData::from_f64s(q_dtype, vec![], &[scale.sqrt() as f64]));
        let mul = Op::Binary(pipewright_ops::op::BinaryOp::Mul);
        let qs = self.add_one(&format!("{name}/q_scaled"), mul.clone(), vec![Some(q), Some(root)])?;
        let ks = self.add_one(&format!("{name}/k_scaled"), mul, vec![Some(k), Some(root)])?;
        let kt = self.add_one(&format!("{name}/k_transposed"), Op::Transpose { perm: Some(vec![0, 1, 3, 2]) }, vec![Some(ks)])?;
        let mut scores = self.add_one(&format!("{name}/scores"), Op::MatMul, vec![Some(qs), Some(kt)])?;
        scores = self.cast_to(&format!("{name}/scores_cast"), scores, compute)?;
        if let Some(g) = score_mod {
            scores = self.apply_mod(node, g, &format!("{name}/score_mod"), scores, compute, opset)?;
        }
        let softmax = Op::Softmax(pipewright_ops::op::Softmax { axis: -1, coerce_2d: false });
        let mut probs = self.add_one(&format!("{name}/probs"), softmax, vec![Some(scores)])?;
        if let Some(g) = prob_mod {
            probs = self.apply_mod(node, g, &format!("{name}/prob_mod"), probs, compute, opset)?;
        }
        let vc = self.cast_to(&format!("{name}/v_cast"), v, compute)?;
        let y = self.add_one(&format!("{name}/weighted"), Op::MatMul, vec![Some(probs), Some(vc)])?;
        let y = self.cast_to(&format!("{name}/y"), y, v_dtype)?;
        self.bind(node.output[0].clone(), Bound::Tensor(y));
        Ok(())
    }

    /// `v` as `dtype` (itself when it already is).
    fn cast_to(&mut self, name: &str, v: ValueId, dtype: DType) -> Result<ValueId, ImportError> {
        if self.graph.value(v).ty.dtype == dtype {
            return Ok(v);
        }
        self.add_one(name, Op::Cast { to: dtype, mode: CastMode::default() }, vec![Some(v)])
    }

    /// A modifier subgraph inlined on `x`; its one output, cast to `dtype`.
    fn apply_mod(&mut self, node: &NodeProto, g: &GraphProto, prefix: &str, x: ValueId, dtype: DType, opset: i64) -> Result<ValueId, ImportError> {
        match self.inline_graph(node, g, prefix, vec![Bound::Tensor(x)], opset)?[..] {
            [Bound::Tensor(y)] => self.cast_to(&format!("{prefix}/cast"), y, dtype),
            _ => Err(bad(node, format!("its subgraph {:?} must give exactly one tensor", g.name))),
        }
    }
}
