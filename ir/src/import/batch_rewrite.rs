//! Source nodes of a fixed-batch export that bake the export batch, read as nodes that
//! follow the batch and compute the same at the export batch: identity gathers and
//! scatters at constant indices, zero initial states of recurrent layers, Resize to
//! sizes of the export batch, the sequence-first Reshapes around a layer whose rows take
//! the batch, and a per-head MatMul whose other side merged batch and heads. Each rewrite
//! is recorded on the graph (`Graph::source_rewrites`) so that `export` writes the source
//! node the same way, and noted among the import's warnings.

use onnx_protobuf::NodeProto;
use pipewright_ops::onnx::AttrSource;
use pipewright_ops::op::AttrValue;

use super::attrs::attribute_proto;
use super::node_proto::{batch_led_shape, concat0, filled, plain};
use super::Importer;
use crate::dim::{Dim, Shape, TensorType};
use crate::graph::SourceRewrite;
use crate::known::{Known, KnownData};
use crate::{DType, TensorData, ValueDef, ValueId, Weight};

/// A source node read as another: the node imported in its place (it keeps the source
/// node's outputs), the constants it adds, and what the import notes.
pub(super) struct BatchRewrite {
    node: NodeProto,
    /// Nodes imported (and exported) just before `node`, reading what it reads.
    before: Vec<NodeProto>,
    constants: Vec<(String, TensorData)>,
    note: String,
}

impl BatchRewrite {
    /// `node` as `op_type` reading `inputs`, without attributes.
    fn replace(node: &NodeProto, op_type: &str, inputs: Vec<String>, note: &str) -> BatchRewrite {
        let mut replacement = node.clone();
        replacement.op_type = op_type.into();
        replacement.input = inputs;
        replacement.attribute.clear();
        BatchRewrite { node: replacement, before: Vec::new(), constants: Vec::new(), note: format!("node {:?}: {note}", node.name) }
    }
}

impl Importer<'_> {
    /// The rewrite that makes `node` follow the batch, if it bakes the export batch in a
    /// way one of the rewrites recognises (only for a fixed-batch export).
    pub(super) fn batch_rewrite(&self, node: &NodeProto) -> Option<BatchRewrite> {
        let b = self.ctx.export_batch?;
        match node.op_type.as_str() {
            "Gather" => self.identity_gather_as_reshape(node, b).or_else(|| self.gather_at_alike_rows(node, b)),
            "GatherND" => self.identity_gather_nd(node, b),
            "ScatterND" => self.empty_scatter_nd(node)
                .or_else(|| self.identity_scatter_nd(node, b))
                .or_else(|| self.zeros_at_positions(node, b))
                .or_else(|| self.scatter_nd_per_row(node, b))
                .or_else(|| self.fill_at_leading_positions(node, b)),
            "TopK" => self.whole_axis_sort(node, b),
            "ScatterElements" => self.identity_scatter_elements(node, b).or_else(|| self.fill_scatter_elements(node, b)).or_else(|| self.scatter_at_one_position(node, b)),
            "Add" => self.zeros_added(node, b).or_else(|| self.alike_rows_broadcast(node, b)),
            "Sub" | "Mul" | "Div" => self.alike_rows_broadcast(node, b),
            "LSTM" | "GRU" | "RNN" => self.zero_initial_state_dropped(node),
            "Resize" => self.resize_sizes_follow_the_batch(node, b),
            "Reshape" => self.reshape_batch_into_rows(node, b).or_else(|| self.reshape_batch_out_of_rows(node, b)).or_else(|| self.reshape_uniform_rows(node, b)),
            "MatMul" if b == 1 => self.matmul_heads_split(node),
            "Slice" => self.slice_row_groups(node, b),
            "Split" => self.split_row_groups(node, b),
            _ => None,
        }
    }

    /// Defines the rewrite's constants, notes and records it; returns the nodes to import,
    /// in order.
    pub(super) fn apply_batch_rewrite(&mut self, rewrite: BatchRewrite) -> Vec<NodeProto> {
        for (name, data) in &rewrite.constants {
            let ty = TensorType::new(data.dtype, Shape::fixed(&data.dims));
            self.define(name.clone(), ty, ValueDef::Weight(Weight { data: data.clone(), trainable: false }));
        }
        self.graph.warnings.push(rewrite.note);
        let BatchRewrite { node, before, constants, .. } = rewrite;
        self.graph.source_rewrites.push(SourceRewrite { node: node.clone(), before: before.clone(), constants });
        before.into_iter().chain([node]).collect()
    }

    /// The extents of value `name` at the export batch `b`, when it carries the batch.
    fn batch_dims(&self, name: &str, b: i64) -> Option<Vec<i64>> {
        let shape = &self.graph.value(*self.names.get(name)?).ty.shape;
        shape.has_batch().then(|| shape.dims().iter().map(|d| d.eval(b)).collect())
    }

    /// PyTorch's default exporter writes `as_strided` of a contiguous tensor as a Gather
    /// from its flattened data at constant indices `0, 1, ..., n-1` shaped for the export
    /// batch: a reshape that does not follow the batch. Over a batch-carrying vector, that
    /// Gather becomes a Reshape to the indices' shape with the batch axis left free (`-1`),
    /// which is the same at the export batch and follows any other.
    fn identity_gather_as_reshape(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        if node.input.len() != 2 || node.attribute.iter().any(|a| a.name == "axis" && a.i != 0) {
            return None;
        }
        let data = self.batch_dims(&node.input[0], b).filter(|d| d.len() == 1)?;
        let (index_dims, values) = self.int_value(*self.names.get(&node.input[1])?, 0)?;
        let identity = values.iter().enumerate().all(|(i, &v)| v == i as i64);
        if !identity || index_dims.first() != Some(&b) || values.len() as i64 != data[0] {
            return None;
        }
        let mut target = index_dims;
        target[0] = -1;
        let shape_name = format!("{}/batch_free_shape", node.name);
        let note = "a Gather of every element in order (an exported as_strided) at the export batch is read as a Reshape that follows the batch";
        let mut rewrite = BatchRewrite::replace(node, "Reshape", vec![node.input[0].clone(), shape_name.clone()], note);
        rewrite.constants.push((shape_name, TensorData::from_i64s(vec![target.len() as i64], &target)));
        Some(rewrite)
    }

    /// The default exporter copies a batch-carrying tensor (an attention mask) with a
    /// GatherND at constant indices that list every element in order, shaped for the
    /// export batch; that is the tensor itself, at any batch: an Identity.
    fn identity_gather_nd(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        if node.input.len() != 2 || node.attribute.iter().any(|a| a.name == "batch_dims" && a.i != 0) {
            return None;
        }
        let dims = self.batch_dims(&node.input[0], b)?;
        let (index_dims, indices) = self.int_value(*self.names.get(&node.input[1])?, 0)?;
        enumerates(&index_dims, &indices, &dims).then(|| {
            BatchRewrite::replace(node, "Identity", vec![node.input[0].clone()], "a GatherND of every element in order at the export batch is read as the tensor itself")
        })
    }

    /// A ScatterND of no updates (indices with an empty leading extent) is its data,
    /// whatever extents the exporter gave the empty updates: Chameleon's text-only
    /// forward scatters its zero image tokens' embeddings, `[0, 2, 8]` at the export
    /// batch 2.
    fn empty_scatter_nd(&self, node: &NodeProto) -> Option<BatchRewrite> {
        let [data, indices, _] = node.input.as_slice() else { return None };
        let (_, leading) = self.graph.value(*self.names.get(indices)?).ty.shape.dims().split_last()?;
        leading.iter().any(|d| d.fixed() == Some(0)).then(|| {
            BatchRewrite::replace(node, "Identity", vec![data.clone()], "a ScatterND of no updates (its indices have an empty extent) is read as its data")
        })
    }

    /// The TorchScript exporter fills a causal mask with a ScatterND whose constant indices
    /// list every element of its (export-batch) data in order: every element is replaced,
    /// so the result is the updates themselves, which follow the batch: an Identity. (So
    /// do updates that the export fixed at its batch, as a decoder's mask built from its
    /// input's shape is: the index grid, which cannot follow the batch, is then gone, and
    /// the mask is left to the rewrites that make such constants broadcast.)
    fn identity_scatter_nd(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        if node.input.len() != 3 || node.attribute.iter().any(|a| a.name == "reduction" && a.s != b"none") {
            return None;
        }
        let extents = |name: &str| -> Option<Vec<i64>> {
            Some(self.graph.value(*self.names.get(name)?).ty.shape.dims().iter().map(|d| d.eval(b)).collect())
        };
        let dims = extents(&node.input[0])?;
        let updates = extents(&node.input[2])?;
        let (index_dims, indices) = self.int_value(*self.names.get(&node.input[1])?, 8)?;
        (dims == updates && enumerates(&index_dims, &indices, &dims)).then(|| {
            BatchRewrite::replace(node, "Identity", vec![node.input[2].clone()], "a ScatterND over every element in order at the export batch is read as its updates")
        })
    }

    /// A ScatterElements that writes every element of its data at its own position along
    /// `axis` from updates of the data's shape is its updates: Gemma 2's sliding-window
    /// cache, exported by TorchScript at a fixed batch, is a constant of the export batch
    /// overwritten at positions `0..len` by the step's keys and values.
    fn identity_scatter_elements(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let mut attrs = super::attrs::Attrs::new(&node.attribute);
        let axis = attrs.int_or("axis", 0).ok()?;
        if node.input.len() != 3 || attrs.string("reduction").ok()?.is_some_and(|r| r != "none") {
            return None;
        }
        let extents = |name: &str| -> Option<Vec<i64>> {
            Some(self.graph.value(*self.names.get(name)?).ty.shape.dims().iter().map(|d| d.eval(b)).collect())
        };
        let dims = extents(&node.input[0])?;
        let axis = usize::try_from(if axis < 0 { axis + dims.len() as i64 } else { axis }).ok()?;
        let (index_dims, indices) = self.int_value(*self.names.get(&node.input[1])?, 8)?;
        (dims == extents(&node.input[2])? && index_dims == dims && indexes_own_position(&dims, &indices, axis)).then(|| {
            BatchRewrite::replace(node, "Identity", vec![node.input[2].clone()], "a ScatterElements writing every element at its own position at the export batch is read as its updates")
        })
    }

    /// `x[:, c] = y` as the default exporter writes it at a fixed batch (CSM's depth
    /// decoder puts the backbone's state at position 0): a ScatterElements of updates that
    /// follow the batch at constant indices that are all `c`, shaped as the updates at the
    /// export batch. The indices are read as `c` everywhere in the updates' shape at run
    /// time.
    fn scatter_at_one_position(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [data, indices, updates] = &node.input[..] else { return None };
        let value = |name: &String| self.names.get(name).copied();
        let (data_value, update_value) = (value(data)?, value(updates)?);
        let update_dims = self.graph.value(update_value).ty.shape.dims().to_vec();
        if !self.graph.value(data_value).ty.shape.has_batch() || !update_dims.iter().any(|d| d.is_batch()) {
            return None;
        }
        let (index_dims, values) = self.int_value(value(indices)?, 0)?;
        let position = *values.first()?;
        if index_dims != update_dims.iter().map(|d| d.eval(b)).collect::<Vec<_>>() || values.iter().any(|&v| v != position) {
            return None;
        }
        let note = format!("a ScatterElements at indices all {position}, shaped as its updates at the export batch, is read with those indices shaped from the updates, which follow the batch");
        let mut rewrite = scatter_at_positions(node, data, updates, vec![1; update_dims.len()], &[position], &note);
        rewrite.node.attribute = node.attribute.clone();
        Some(rewrite)
    }

    /// A mixture-of-experts router's one-hot choice (`zeros.scatter(1, top_k_indices, 1)`,
    /// as the default exporter writes it at a fixed batch; DeepSeek-V3's group mask, as
    /// TorchScript does) scatters a constant fill (or updates that follow the batch) into
    /// a constant fill, shaped for the export batch's tokens, at indices that follow the
    /// batch: the same fills, shaped from the indices at run time (the data's extents
    /// that match a batch-carrying extent of the indices, off the scatter's axis, follow
    /// it; constant updates take the indices' shape, as ScatterElements requires).
    fn fill_scatter_elements(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let axis = super::attrs::Attrs::new(&node.attribute).int_or("axis", 0).ok()?;
        let [data, indices, updates] = &node.input[..] else { return None };
        let value = |name: &String| self.names.get(name).copied();
        let (data_value, index_value, update_value) = (value(data)?, value(indices)?, value(updates)?);
        let index_dims = self.graph.value(index_value).ty.shape.dims().to_vec();
        let fixed = |v: ValueId| -> Option<Vec<i64>> { self.graph.value(v).ty.shape.dims().iter().map(|d| d.fixed()).collect() };
        let data_dims = fixed(data_value)?;
        let rank = data_dims.len();
        let axis = usize::try_from(if axis < 0 { axis + rank as i64 } else { axis }).ok()?;
        // Updates that already follow the batch (TorchScript's `ones_like` of the indices)
        // stay; a constant fill of the indices' extents at the export batch is rebuilt.
        let updates_follow = self.graph.value(update_value).ty.shape.dims() == index_dims;
        if index_dims.len() != rank || !(updates_follow || fixed(update_value)? == index_dims.iter().map(|d| d.eval(b)).collect::<Vec<_>>()) {
            return None;
        }
        let follows: Vec<bool> = (0..rank).map(|a| a != axis && index_dims[a].is_batch() && index_dims[a].eval(b) == data_dims[a]).collect();
        if !follows.contains(&true) {
            return None;
        }
        let data_fill = self.uniform_fill(data_value)?;
        let update_fill = if updates_follow { None } else { Some(self.uniform_fill(update_value)?) };
        let at = |what: &str| format!("{}/batch/{what}", node.name);
        let updates_read = if updates_follow { updates.clone() } else { at("updates") };
        let note = "a ScatterElements into a constant fill of the export batch's extent (of a constant fill, or of updates that follow the batch) is read with the fills shaped from its indices, which follow the batch";
        let mut rewrite = BatchRewrite::replace(node, "ScatterElements", vec![at("data"), indices.clone(), updates_read], note);
        rewrite.node.attribute = node.attribute.clone();
        rewrite.before.push(plain(&at("index_shape"), "Shape", &[indices], &at("index_shape")));
        let mut extents = Vec::new();
        for (a, &follow) in follows.iter().enumerate() {
            let name = at(&format!("extent{a}"));
            let (constant, extent) = if follow {
                rewrite.before.push(plain(&name, "Gather", &[&at("index_shape"), &at(&format!("axis{a}"))], &name));
                (at(&format!("axis{a}")), a as i64)
            } else {
                (name.clone(), data_dims[a])
            };
            rewrite.constants.push((constant, TensorData::from_i64s(vec![1], &[extent])));
            extents.push(name);
        }
        let dtype = |v: ValueId| self.graph.value(v).ty.dtype;
        rewrite.before.extend([
            concat0(&at("data_shape"), &extents.iter().map(String::as_str).collect::<Vec<_>>(), &at("data_shape")),
            filled(&at("data"), &at("data_shape"), dtype(data_value), data_fill),
        ]);
        if let Some(update_fill) = update_fill {
            rewrite.before.push(filled(&at("updates"), &at("index_shape"), dtype(update_value), update_fill));
        }
        Some(rewrite)
    }

    /// A sort along an axis that follows the batch (`torch.sort`, which the exporters
    /// write as a TopK of the whole axis) takes `k` from the axis's extent at a fixed
    /// batch, as a constant: `k` read from the axis's extent at run time instead, so that
    /// it still sorts the whole axis.
    fn whole_axis_sort(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [x, k] = &node.input[..] else { return None };
        let shape = &self.graph.value(*self.names.get(x)?).ty.shape;
        let axis = shape.axis(super::attrs::Attrs::new(&node.attribute).int_or("axis", -1).ok()?)?;
        let (_, k_value) = self.int_value(*self.names.get(k)?, 0)?;
        let extent = shape.dims()[axis];
        if k_value != [extent.eval(b)] || !extent.is_batch() {
            return None;
        }
        let at = |what: &str| format!("{}/batch/{what}", node.name);
        let note = "a TopK of every element of an axis that follows the batch (a sort), its k the axis's extent at the export batch, is read with k the axis's extent at run time";
        let mut rewrite = BatchRewrite::replace(node, "TopK", vec![x.clone(), at("k")], note);
        rewrite.node.attribute = node.attribute.clone();
        rewrite.constants.push((at("axis"), TensorData::from_i64s(vec![1], &[axis as i64])));
        rewrite.before = vec![plain(&at("shape"), "Shape", &[x], &at("shape")), plain(&at("k"), "Gather", &[&at("shape"), &at("axis")], &at("k"))];
        Some(rewrite)
    }

    /// `x[:, c] = y` as TorchScript writes it at a fixed batch: a ScatterND at constant
    /// index pairs `(i, p_j)`, `i` every row of the export batch in order and the positions
    /// `p_j` the same in every row, of updates `[N, m, ...]` that follow the batch. That is
    /// a ScatterElements along axis 1 at `p_j` in every row, its indices shaped from the
    /// updates at run time.
    fn scatter_nd_per_row(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [data, indices, updates] = &node.input[..] else { return None };
        if node.attribute.iter().any(|a| a.name == "reduction" && a.s != b"none") {
            return None;
        }
        let value = |name: &String| self.names.get(name).copied();
        let data_dims = self.graph.value(value(data)?).ty.shape.dims().to_vec();
        let update_dims = self.graph.value(value(updates)?).ty.shape.dims().to_vec();
        let (index_dims, pairs) = self.int_value(value(indices)?, 8)?;
        let [rows, m, 2] = index_dims[..] else { return None };
        let rank = data_dims.len();
        let leads = |dims: &[Dim]| dims.first() == Some(&Dim::N);
        if rows != b || rank < 2 || !leads(&data_dims) || !leads(&update_dims) || update_dims.len() != rank || update_dims[1] != Dim::Fixed(m) {
            return None;
        }
        let positions: Vec<i64> = pairs.chunks(2).take(m as usize).map(|p| p[1]).collect();
        let per_row = pairs.chunks(2).enumerate().all(|(k, p)| p[0] == k as i64 / m && p[1] == positions[k % m as usize]);
        if !per_row {
            return None;
        }
        let note = format!("a ScatterND at positions {positions:?} of every row of the export batch is read as a ScatterElements at those positions in every row, which follows the batch");
        let mut position_dims = vec![1, m];
        position_dims.resize(rank, 1);
        let mut rewrite = scatter_at_positions(node, data, updates, position_dims, &positions, &note);
        rewrite.node.attribute = vec![attribute_proto("axis", &AttrValue::Int(1))];
        Some(rewrite)
    }

    /// A mixture-of-experts layer's `zeros.index_add(0, positions, rows)` (ScatterND, as
    /// the default exporter writes it at a fixed batch) scatters into constant zeros of
    /// the export batch's rows. Where the positions are known to index the rows of a value
    /// that follows the batch, of the zeros' extent at the export batch ([`Self::rows_indexed`]),
    /// the zeros take that value's rows at run time.
    fn zeros_at_positions(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [data, indices, _updates] = &node.input[..] else { return None };
        let data_value = *self.names.get(data)?;
        let dims: Vec<i64> = self.graph.value(data_value).ty.shape.dims().iter().map(|d| d.fixed()).collect::<Option<_>>()?;
        let index_value = *self.names.get(indices)?;
        let index_dims = self.graph.value(index_value).ty.shape.dims();
        if index_dims.last() != Some(&Dim::Fixed(1)) || dims.is_empty() || !self.all_zeros(data_value) {
            return None;
        }
        let (rows_of, axis) = self.rows_indexed(self.unsqueezed_from(index_value).unwrap_or(index_value))?;
        let extent = self.graph.value(rows_of).ty.shape.dims()[axis];
        if !extent.is_batch() || extent.eval(b) != dims[0] {
            return None;
        }
        let at = |what: &str| format!("{}/batch/{what}", node.name);
        let rows_name = self.graph.value(rows_of).name.clone();
        let note = "a ScatterND into constant zeros of the export batch's rows, at positions that index a value following the batch, is read with zeros of that value's rows";
        let mut rewrite = BatchRewrite::replace(node, "ScatterND", vec![at("zeros"), indices.clone(), node.input[2].clone()], note);
        rewrite.node.attribute = node.attribute.clone();
        rewrite.constants.push((at("axis"), TensorData::from_i64s(vec![1], &[axis as i64])));
        rewrite.constants.push((at("row_extent"), TensorData::from_i64s(vec![dims.len() as i64 - 1], &dims[1..])));
        rewrite.before = vec![
            plain(&at("shape"), "Shape", &[&rows_name], &at("shape")),
            plain(&at("rows"), "Gather", &[&at("shape"), &at("axis")], &at("rows")),
            concat0(&at("zeros_shape"), &[&at("rows"), &at("row_extent")], &at("zeros_shape")),
            filled(&at("zeros"), &at("zeros_shape"), self.graph.value(data_value).ty.dtype, 0.0),
        ];
        Some(rewrite)
    }

    /// A constant fill written at positions of the leading axis of a value that carries
    /// the batch further in (`x[:, :, -3:] = 0`, which the default exporter writes as a
    /// ScatterND of constant zeros at indices `[[5], [6], [7]]` into `x` transposed, the
    /// batch now third; Mllama's tile mask): the fill, its extents past the positions
    /// read from the data at run time, follows the batch.
    fn fill_at_leading_positions(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [data, indices, updates] = &node.input[..] else { return None };
        let value = |name: &String| self.names.get(name).copied();
        let (data_value, index_value, update_value) = (value(data)?, value(indices)?, value(updates)?);
        let data_dims = self.graph.value(data_value).ty.shape.dims().to_vec();
        let index_dims = self.graph.value(index_value).ty.shape.dims().to_vec();
        let update_dims = self.graph.value(update_value).ty.shape.dims().to_vec();
        let ([Dim::Fixed(count), Dim::Fixed(1)], Some(Dim::Fixed(_))) = (index_dims.as_slice(), data_dims.first()) else { return None };
        let at_export: Vec<Option<i64>> = data_dims[1..].iter().map(|d| Some(d.eval(b))).collect();
        let update_rest: Vec<Option<i64>> = update_dims.get(1..)?.iter().map(|d| d.fixed()).collect();
        if !data_dims[1..].iter().any(|d| d.is_batch()) || update_dims.first() != Some(&Dim::Fixed(*count)) || update_rest != at_export {
            return None;
        }
        let fill = self.uniform_fill(update_value)?;
        let at = |what: &str| format!("{}/batch/{what}", node.name);
        let note = "a ScatterND of a constant fill shaped for the export batch, at positions of a leading axis that does not carry the batch, is read with the fill shaped from the data at run time";
        let mut rewrite = BatchRewrite::replace(node, "ScatterND", vec![data.clone(), indices.clone(), at("updates")], note);
        rewrite.node.attribute = node.attribute.clone();
        let rank = data_dims.len() as i64;
        for (name, value) in [("count", *count), ("one", 1), ("end", rank)] {
            rewrite.constants.push((at(name), TensorData::from_i64s(vec![1], &[value])));
        }
        rewrite.before.extend([
            plain(&at("data_shape"), "Shape", &[data], &at("data_shape")),
            plain(&at("rest"), "Slice", &[&at("data_shape"), &at("one"), &at("end")], &at("rest")),
            concat0(&at("update_shape"), &[&at("count"), &at("rest")], &at("update_shape")),
            filled(&at("updates"), &at("update_shape"), self.graph.value(update_value).ty.dtype, fill),
        ]);
        Some(rewrite)
    }

    /// The value, and its axis, whose positions the integer value `positions` holds:
    /// the indices of a sort (a TopK whose `k` is its whole axis, so they are a permutation
    /// of that axis's positions), or positions that a Gather (axis 0) or GatherND already
    /// imported reads rows of a value at.
    fn rows_indexed(&self, positions: ValueId) -> Option<(ValueId, usize)> {
        if let ValueDef::Node { node, slot: 1 } = &self.graph.value(positions).def {
            let n = self.graph.node(*node);
            if let (crate::Op::TopK { axis, .. }, Some(Some(x))) = (&n.op, n.inputs.first()) {
                let shape = &self.graph.value(*x).ty.shape;
                let axis = shape.axis(*axis)?;
                return (self.graph.value(positions).ty.shape.dims()[axis] == shape.dims()[axis]).then_some((*x, axis));
            }
        }
        self.graph.node_ids().map(|id| self.graph.node(id)).find_map(|n| {
            let [Some(rows), Some(at)] = n.inputs[..] else { return None };
            let reads_rows = matches!(n.op, crate::Op::GatherND { batch_dims: 0 } | crate::Op::Gather { axis: 0 });
            let same = at == positions || self.unsqueezed_from(at) == Some(positions);
            (reads_rows && same && self.graph.value(rows).ty.shape.rank() >= 1).then_some((rows, 0))
        })
    }

    /// The value `v` is an Unsqueeze of (positions made a column for ScatterND or
    /// GatherND), if it is one.
    fn unsqueezed_from(&self, v: ValueId) -> Option<ValueId> {
        let ValueDef::Node { node, .. } = &self.graph.value(v).def else { return None };
        let n = self.graph.node(*node);
        matches!(n.op, crate::Op::Unsqueeze { .. }).then(|| n.inputs.first().copied().flatten()).flatten()
    }

    /// The one number every element of value `v` holds, where it is a constant (or
    /// known at import) that holds one.
    fn uniform_fill(&self, v: ValueId) -> Option<f64> {
        if let Some(fill) = self.known.get(v.index()).and_then(|k| k.as_ref()).and_then(|k| k.uniform()) {
            return Some(fill);
        }
        let ValueDef::Weight(w) = &self.graph.value(v).def else { return None };
        let values = w.data.to_f64s();
        let first = *values.first()?;
        values.iter().all(|&x| x == first).then_some(first)
    }

    /// Constant zeros of the export batch's shape added to a value of that shape leave
    /// the value: a mixture-of-experts layer's sum starts from such a constant at a fixed
    /// batch, which would keep the sum at the export batch. (A trainable weight of zeros,
    /// a bias at its initial value, is no such constant.)
    fn zeros_added(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [x, y] = &node.input[..] else { return None };
        let value = |name: &String| self.names.get(name).copied();
        let (zeros, other) = [(x, y), (y, x)].into_iter().find(|(z, _)| value(z).is_some_and(|v| matches!(&self.graph.value(v).def, ValueDef::Weight(w) if !w.trainable) && self.all_zeros(v)))?;
        let other_value = value(other)?;
        let at_export = |v: ValueId| -> Vec<i64> { self.graph.value(v).ty.shape.dims().iter().map(|d| d.eval(b)).collect() };
        let follows = self.graph.value(other_value).ty.shape.has_batch();
        (follows && at_export(value(zeros)?) == at_export(other_value)).then(|| {
            BatchRewrite::replace(node, "Identity", vec![other.clone()], "zeros of the export batch's shape added to a value are read as the value")
        })
    }

    /// The integer contents of value `v` (its fixed extents and row-major values): a
    /// constant's, or where they follow from constants through Unsqueeze, Reshape,
    /// Squeeze, Identity, Expand and Concat (index grids the TorchScript exporter builds at
    /// run time), looking at most `depth` nodes back. Shape inference does not fold these,
    /// and need not: only the rewrites here ask.
    fn int_value(&self, v: ValueId, depth: usize) -> Option<(Vec<i64>, Vec<i64>)> {
        let value = self.graph.value(v);
        let dims: Vec<i64> = value.ty.shape.dims().iter().map(|d| d.fixed()).collect::<Option<_>>()?;
        if dims.iter().product::<i64>() as usize > crate::known::KNOWN_LIMIT {
            return None;
        }
        let node = match &value.def {
            ValueDef::Weight(w) if !w.trainable => return Some((dims, w.data.to_i64s())),
            ValueDef::Node { node, .. } if depth > 0 => self.graph.node(*node),
            _ => return None,
        };
        let input = |i: usize| node.inputs.get(i).copied().flatten().and_then(|u| self.int_value(u, depth - 1));
        match &node.op {
            crate::Op::Unsqueeze { .. } | crate::Op::Reshape { .. } | crate::Op::Squeeze { .. } | crate::Op::Unary(pipewright_ops::op::UnaryOp::Identity) => {
                Some((dims, input(0)?.1))
            }
            crate::Op::Expand => {
                let (from, values) = input(0)?;
                let n = dims.iter().product::<i64>() as usize;
                Some((dims.clone(), (0..n).map(|i| values[crate::known::bcast_index(i, &dims, &from)]).collect()))
            }
            crate::Op::Concat { axis } => {
                let axis = usize::try_from(if *axis < 0 { axis + dims.len() as i64 } else { *axis }).ok()?;
                let parts: Vec<(Vec<i64>, Vec<i64>)> = (0..node.inputs.len()).map(input).collect::<Option<_>>()?;
                let outer: i64 = dims[..axis].iter().product();
                let mut out = Vec::with_capacity(dims.iter().product::<i64>() as usize);
                for o in 0..outer as usize {
                    for (d, values) in &parts {
                        let chunk: usize = d[axis..].iter().product::<i64>() as usize;
                        out.extend_from_slice(&values[o * chunk..(o + 1) * chunk]);
                    }
                }
                Some((dims, out))
            }
            _ => None,
        }
    }

    /// Whether value `v` is known to be all zeros: a constant, a folded value, or such a
    /// value only reshaped, expanded or cast (an exporter's zero initial state).
    pub(super) fn all_zeros(&self, v: ValueId) -> bool {
        let data = match &self.graph.value(v).def {
            // An initializer of zeros may have been taken for a trainable weight: its
            // values are what count here.
            ValueDef::Weight(w) => Some(w.data.clone()),
            ValueDef::Node { node, .. } => {
                let n = self.graph.node(*node);
                let passes_zeros = matches!(n.op.name(), "Expand" | "Reshape" | "Unsqueeze" | "Squeeze" | "Identity" | "Cast" | "Transpose" | "Tile");
                if let (true, Some(Some(first))) = (passes_zeros, n.inputs.first()) {
                    return self.all_zeros(*first);
                }
                self.known.get(v.index()).and_then(|k| k.as_ref()).and_then(|k| k.to_tensor())
            }
            _ => None,
        };
        data.is_some_and(|d| d.to_f64s().iter().all(|&x| x == 0.0))
    }

    /// Exporters write a recurrent layer's zero initial state as a constant (or an Expand
    /// of one) of the export batch; zeros are also what an absent initial state means, at
    /// any batch. An LSTM, GRU or RNN whose `initial_h` / `initial_c` is known to be all
    /// zeros loses those inputs.
    fn zero_initial_state_dropped(&self, node: &NodeProto) -> Option<BatchRewrite> {
        let zero = |slot: usize| node.input.get(slot).filter(|n| !n.is_empty()).and_then(|n| self.names.get(n)).is_some_and(|&v| self.all_zeros(v));
        let dropped: Vec<usize> = [5, 6].into_iter().filter(|&slot| zero(slot)).collect();
        if dropped.is_empty() {
            return None;
        }
        let mut inputs = node.input.clone();
        for slot in dropped {
            inputs[slot] = String::new();
        }
        while inputs.last().is_some_and(|n| n.is_empty()) {
            inputs.pop();
        }
        let mut rewrite = BatchRewrite::replace(node, &node.op_type, inputs, "a zero initial state of the export batch is read as no initial state (zeros at any batch)");
        // A recurrent layer keeps its attributes (hidden size, direction, layout).
        rewrite.node.attribute = node.attribute.clone();
        Some(rewrite)
    }

    /// A Resize to constant `sizes` that start with the export batch (PyTorch's default
    /// exporter writes `interpolate` so) keeps every batch at the export batch. Where each
    /// size is a whole multiple or divisor of its input extent, the same Resize by
    /// `scales` (1 on the batch axis) gives the same result at the export batch and follows
    /// any other. Where one is not (DepthAnything's head resizes 16 to 28), scales would
    /// round the output extent and move the sampling grid: the sizes are kept, their batch
    /// read from the input at run time.
    fn resize_sizes_follow_the_batch(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        if node.input.len() != 4 || node.input[3].is_empty() {
            return None;
        }
        let dims = self.graph.value(*self.names.get(&node.input[0])?).ty.shape.dims().to_vec();
        if dims.first().map(|d| d.is_batch()) != Some(true) || dims[1..].iter().any(|d| d.is_batch()) {
            return None;
        }
        let (_, sizes) = self.int_value(*self.names.get(&node.input[3])?, 0)?;
        if sizes.len() != dims.len() || sizes[0] != b {
            return None;
        }
        let whole = |(&size, d): (&i64, &Dim)| d.fixed().filter(|&e| size > 0 && e > 0 && (size % e == 0 || e % size == 0)).map(|e| size as f64 / e as f64);
        let scales: Option<Vec<f64>> = [Some(1.0)].into_iter().chain(sizes[1..].iter().zip(&dims[1..]).map(whole)).collect();
        let at = |what: &str| format!("{}/{what}", node.name);
        let mut rewrite = match scales {
            Some(scales) => {
                let name = at("batch_free_scales");
                let inputs = vec![node.input[0].clone(), node.input[1].clone(), name.clone()];
                let mut rewrite = BatchRewrite::replace(node, "Resize", inputs, "a Resize to sizes of the export batch is read as the same Resize by scales, which follows the batch");
                rewrite.constants.push((name, TensorData::from_f64s(DType::F32, vec![scales.len() as i64], &scales)));
                rewrite
            }
            None => {
                let (input_shape, batch_sizes) = (at("input_shape"), at("batch_led_sizes"));
                let inputs = vec![node.input[0].clone(), node.input[1].clone(), node.input[2].clone(), batch_sizes.clone()];
                let mut rewrite = BatchRewrite::replace(node, "Resize", inputs, "a Resize to sizes of the export batch is read as the same Resize to those sizes with the batch of its input");
                let (constants, shape_nodes) = batch_led_shape(&at("sizes"), &input_shape, &sizes[1..], &batch_sizes);
                rewrite.constants.extend(constants);
                rewrite.before.push(plain(&input_shape, "Shape", &[&node.input[0]], &input_shape));
                rewrite.before.extend(shape_nodes);
                rewrite
            }
        };
        // Resize keeps its attributes (mode, coordinate transformation).
        rewrite.node.attribute = node.attribute.clone();
        Some(rewrite)
    }

    /// A Reshape of a tensor whose batch is not its leading axis (sequence first,
    /// `[seq, batch, features]`) to a target written for the export batch, whose last
    /// extent a layer contracts against its weight (`Gemm` or `MatMul`). Exported at batch
    /// 1, `view(seq * batch, features)` (as `nn.MultiheadAttention` writes it) is the
    /// target `[seq, features]`, which could as well put the batch among the features; the
    /// weight says the features keep their width. The extent that ends where the input's
    /// batch axis ends becomes -1, so the batch joins the rows; at the export batch the
    /// target is the same.
    fn reshape_batch_into_rows(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [input, target] = node.input.as_slice() else { return None };
        let width = *self.contraction_widths.get(node.output.first()?)?;
        let before = rows_before_batch(self.graph.value(*self.names.get(input)?).ty.shape.dims())?;
        let (_, extents) = self.int_value(*self.names.get(target)?, 0)?;
        if extents.len() < 2 || extents.iter().any(|&v| v <= 0) || extents.last() != Some(&width) {
            return None;
        }
        // Where each target extent starts in the row-major layout. Read as it stands, the
        // batch goes to the extent starting where the input's batch axis starts; only when
        // that is the contracted last one is the reading wrong.
        let starts = extent_starts(&extents);
        if starts.iter().position(|&s| s == before) != Some(extents.len() - 1) {
            return None;
        }
        let rows = (0..extents.len() - 1).rev().find(|&i| starts[i].saturating_mul(extents[i]) == before.saturating_mul(b))?;
        let note = "written for the export batch, whose last extent a weight contracts, takes the batch into its rows";
        Some(reshape_freeing(node, &extents, rows, "batch_rows_target", note))
    }

    /// The Reshape that splits rows holding the batch inside outer rows
    /// ([`Importer::batch_rows`]) after the layer (`view(seq, batch, features)` of the
    /// layer's `[seq * batch, features]` output, the target `[seq, 1, features]` at batch
    /// 1): a symbolic extent `seq·N` does not say where its batch sits, so the target
    /// extent starting after the outer rows becomes -1 and takes the batch back out.
    fn reshape_batch_out_of_rows(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [input, target] = node.input.as_slice() else { return None };
        let outer = self.rows_through_layer(*self.names.get(input)?)?;
        let (_, extents) = self.int_value(*self.names.get(target)?, 0)?;
        if extents.iter().any(|&v| v <= 0) {
            return None;
        }
        let starts = extent_starts(&extents);
        let at = (1..extents.len()).find(|&i| starts[i] == outer && extents[i] % b == 0)?;
        let note = format!("of rows that hold the batch inside {outer} outer rows takes it back out");
        Some(reshape_freeing(node, &extents, at, "batch_unrows_target", &note))
    }

    /// A Reshape to a target that follows the batch (its leading extent read from a value
    /// that does) of a value known at import whose export-batch rows are all the same: a
    /// mask or positions the TorchScript exporter computed from ones of the export batch
    /// (PEGASUS-X pads such a mask to whole blocks, then views it per block by the hidden
    /// states' batch). Its first row is expanded to the target's batch first, which at the
    /// export batch is the value itself.
    fn reshape_uniform_rows(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [data, target] = node.input.as_slice() else { return None };
        let data_value = *self.names.get(data)?;
        let shape = self.graph.value(data_value).ty.shape.dims();
        let row: Vec<i64> = shape.get(1..)?.iter().map(|d| d.fixed()).collect::<Option<_>>()?;
        let leads_with_target_batch = self.known.get(self.names.get(target)?.index())?.as_ref()?.dims().first() == Some(&Dim::N);
        if shape.first() != Some(&Dim::Fixed(b)) || !leads_with_target_batch || !self.rows_alike(data_value, b) {
            return None;
        }
        let at = |what: &str| format!("{}/uniform_rows/{what}", node.name);
        let note = "reshapes a value whose export-batch rows are all the same to a target that follows the batch: its first row is expanded to that batch first";
        let mut rewrite = BatchRewrite::replace(node, "Reshape", vec![at("expanded"), target.clone()], note);
        rewrite.node.attribute = node.attribute.clone();
        first_row_expanded(&mut rewrite, &at(""), data, &row, target);
        Some(rewrite)
    }

    /// A Gather (axis 0) of a value without the batch at indices known at import whose
    /// leading extent is the export batch `b` (at least 2) and whose rows are all the
    /// same: `embedding(arange(n).expand(batch, -1))`, PEGASUS-X's global tokens as the
    /// TorchScript exporter writes them. The first row of indices is expanded to the batch
    /// of the model's first batch-carrying input, which at the export batch is the indices
    /// themselves.
    fn gather_at_alike_rows(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [data, indices] = node.input.as_slice() else { return None };
        if b < 2 || node.attribute.iter().any(|a| a.name == "axis" && a.i != 0) || self.graph.value(*self.names.get(data)?).ty.shape.has_batch() {
            return None;
        }
        let index_value = *self.names.get(indices)?;
        let index_dims = self.graph.value(index_value).ty.shape.dims();
        let rest: Vec<i64> = index_dims.get(1..)?.iter().map(|d| d.fixed()).collect::<Option<_>>()?;
        if index_dims.first() != Some(&Dim::Fixed(b)) || !self.rows_alike(index_value, b) {
            return None;
        }
        let source = self.batch_source()?;
        let at = |what: &str| format!("{}/alike_rows/{what}", node.name);
        let note = "a Gather at indices of the export batch's rows, all alike, reads them expanded to the batch";
        let mut rewrite = BatchRewrite::replace(node, "Gather", vec![data.clone(), at("expanded")], note);
        rewrite.node.attribute = node.attribute.clone();
        rewrite.before.push(plain(&at("source_shape"), "Shape", &[&source], &at("source_shape")));
        first_row_expanded(&mut rewrite, &at(""), indices, &rest, &at("source_shape"));
        Some(rewrite)
    }

    /// The name of the model's first input whose leading axis is the batch: where a
    /// rewrite reads the batch at run time.
    pub(super) fn batch_source(&self) -> Option<String> {
        let v = self.graph.inputs().iter().find(|&&v| self.graph.value(v).ty.shape.dims().first() == Some(&Dim::N))?;
        Some(self.graph.value(*v).name.clone())
    }

    /// Whether value `v`, known at import with `b` rows (or an integer grid that follows
    /// from constants, [`Self::int_value`]), holds the same values in each.
    fn rows_alike(&self, v: ValueId, b: i64) -> bool {
        fn alike<T: PartialEq>(values: &[T], b: i64) -> bool {
            let Some(width) = usize::try_from(b).ok().filter(|&b| b > 0 && values.len() % b == 0).map(|b| values.len() / b) else { return false };
            width > 0 && values.chunks(width).all(|row| row == &values[..width])
        }
        match self.known.get(v.index()) {
            // Floats compare as they are (as integers, 0.25 and 0.5 would be alike).
            Some(Some(Known { data: KnownData::Floats(values), .. })) => alike(values, b),
            Some(Some(Known { data: KnownData::Ints(values), .. })) => alike(values, b),
            _ => self.int_value(v, 4).is_some_and(|(_, ints)| alike(&ints, b)),
        }
    }

    /// A binary elementwise node reading, beside a value that carries the batch, a value
    /// known at import whose export-batch rows are all alike (Speech2Text's sinusoidal
    /// positions at `cumsum` of a mask of ones of the export batch, which TorchScript
    /// evaluates for that batch): that value's first row, which broadcasts over any batch.
    fn alike_rows_broadcast(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [x, y] = node.input.as_slice() else { return None };
        let value = |name: &String| self.names.get(name).copied();
        let dims = |v: ValueId| self.graph.value(v).ty.shape.0.clone();
        let slot = [(0, x, y), (1, y, x)].into_iter().find_map(|(slot, fixed, other)| {
            let (f, o) = (dims(value(fixed)?), dims(value(other)?));
            // (A constant of the export batch is the lowering's to keep one slice of.)
            let computed = !matches!(self.graph.value(value(fixed)?).def, ValueDef::Weight(_));
            let fits = b > 1 && computed && f.len() == o.len() && f.first() == Some(&Dim::Fixed(b)) && o.first().is_some_and(|d| d.is_batch()) && !f.iter().any(|d| d.is_batch());
            (fits && self.rows_alike(value(fixed)?, b)).then_some(slot)
        })?;
        let at = |what: &str| format!("{}/alike_rows/{what}", node.name);
        let mut inputs = node.input.clone();
        let source = std::mem::replace(&mut inputs[slot], at("first_row"));
        let mut rewrite = BatchRewrite::replace(node, &node.op_type, inputs, "an operand known at import whose export-batch rows are alike is read as its first row, which broadcasts over the batch");
        rewrite.node.attribute = node.attribute.clone();
        rewrite.constants.push((at("zero"), TensorData::from_i64s(vec![1], &[0])));
        rewrite.constants.push((at("one"), TensorData::from_i64s(vec![1], &[1])));
        rewrite.before.push(plain(&at("first_row"), "Slice", &[&source, &at("zero"), &at("one"), &at("zero")], &at("first_row")));
        Some(rewrite)
    }

    /// A MatMul of per-head 4-D operands `[batch, heads, m, k]` with 3-D ones whose
    /// batch and heads are merged (`[batch * heads, k, n]`), as an export at batch 1
    /// writes `bmm` after dropping the `view(batch * heads, ...)` of the other side: it
    /// broadcasts `[1, heads]` against `[heads]` there, and at no other batch. The merged
    /// operand is split into `[batch, heads, ...]` first, which is the same at batch 1.
    fn matmul_heads_split(&self, node: &NodeProto) -> Option<BatchRewrite> {
        let [x, y] = node.input.as_slice() else { return None };
        let shape = |name: &str| Some(self.graph.value(*self.names.get(name)?).ty.shape.0.clone());
        let (xs, ys) = (shape(x)?, shape(y)?);
        let heads_of = |four: &[Dim], three: &[Dim]| match (four, three) {
            ([Dim::Batch(1), Dim::Fixed(h), _, _], [Dim::Batch(k), r, c]) if h == k && *h > 1 => Some((*h, r.fixed()?, c.fixed()?)),
            _ => None,
        };
        let (slot, (heads, r, c)) = match (heads_of(&xs, &ys), heads_of(&ys, &xs)) {
            (Some(split), _) => (1, split),
            (None, Some(split)) => (0, split),
            (None, None) => return None,
        };
        let merged = &node.input[slot];
        let target = format!("{}/heads_split_target", node.name);
        let split = format!("{}/heads_split", node.name);
        let reshape = NodeProto {
            name: split.clone(),
            op_type: "Reshape".into(),
            input: vec![merged.clone(), target.clone()],
            output: vec![split.clone()],
            ..Default::default()
        };
        let mut inputs = node.input.clone();
        inputs[slot] = split;
        let mut rewrite = BatchRewrite::replace(
            node,
            "MatMul",
            inputs,
            &format!("a MatMul of per-head operands with {merged:?}, whose batch and {heads} heads the export at batch 1 merged, splits them apart first"),
        );
        rewrite.before.push(reshape);
        rewrite.constants.push((target, TensorData::from_i64s(vec![4], &[-1, heads, r, c])));
        Some(rewrite)
    }

    /// A Slice at constant bounds of an axis that holds `k` row groups of the batch (`k N`
    /// rows, as a model that runs its prompt and its input as one batch concatenates
    /// them): at bounds that are multiples of the export batch `b` it takes whole row
    /// groups (SegGPT's `(x[:b] + x[b:]) / 2`), and is read as those row groups at any
    /// batch, its bounds computed from the axis's extent.
    fn slice_row_groups(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let [data, starts, ends, rest @ ..] = node.input.as_slice() else { return None };
        let constant = |name: &str| self.int_value(*self.names.get(name)?, 0).map(|(_, v)| v);
        let dims = self.graph.value(*self.names.get(data)?).ty.shape.0.clone();
        let one = |name: &str| constant(name).filter(|v| v.len() == 1).map(|v| v[0]);
        let axis = match rest.first().filter(|a| !a.is_empty()) {
            Some(axes) => one(axes)?,
            None => 0,
        };
        let axis = usize::try_from(if axis < 0 { axis + dims.len() as i64 } else { axis }).ok()?;
        if rest.get(1).filter(|s| !s.is_empty()).is_some_and(|steps| constant(steps).as_deref() != Some(&[1])) {
            return None;
        }
        let Some(&Dim::Batch(k)) = dims.get(axis) else { return None };
        let (start, end) = (one(starts)?, one(ends)?.min(k * b));
        let whole_groups = k >= 2 && b >= 1 && start >= 0 && start % b == 0 && end % b == 0 && start < end && end - start < k * b;
        if !whole_groups {
            return None;
        }
        let (first, last) = (start / b, end / b);
        let at = |what: &str| format!("{}/row_groups_{what}", node.name);
        let note = format!("a Slice of rows {start}..{end} of an axis of {k} row groups of the batch ({} rows at the export batch {b}) is read as row groups {first}..{last}, which follow the batch", k * b);
        let mut inputs = vec![data.clone(), at("starts"), at("ends")];
        inputs.extend(rest.iter().cloned());
        let mut rewrite = BatchRewrite::replace(node, "Slice", inputs, &note);
        for (name, value) in [("axis", axis as i64), ("next", axis as i64 + 1), ("k", k), ("first", first), ("last", last)] {
            rewrite.constants.push((at(name), TensorData::from_i64s(vec![1], &[value])));
        }
        rewrite.before.extend([
            plain(&at("shape"), "Shape", &[data], &at("shape")),
            plain(&at("extent"), "Slice", &[&at("shape"), &at("axis"), &at("next")], &at("extent")),
            plain(&at("group"), "Div", &[&at("extent"), &at("k")], &at("group")),
            plain(&at("starts"), "Mul", &[&at("group"), &at("first")], &at("starts")),
            plain(&at("ends"), "Mul", &[&at("group"), &at("last")], &at("ends")),
        ]);
        Some(rewrite)
    }

    /// A Split of an axis that holds `k` row groups of the batch into parts of whole row
    /// groups, each a multiple of the export batch `b` (ZoeDepth's neck runs its four
    /// hidden states as one batch, `torch.cat(states)`, and takes them apart with
    /// `split(batch_size)`; Depth Pro splits its `4 N` patches of one scale from the `N`
    /// of the other; the exporters write the sizes as constants): read as a split into
    /// those row groups, which follows the batch (an equal split when every part is one
    /// group, else sizes computed from the axis's extent).
    fn split_row_groups(&self, node: &NodeProto, b: i64) -> Option<BatchRewrite> {
        let data = node.input.first()?;
        let dims = self.graph.value(*self.names.get(data)?).ty.shape.0.clone();
        let attribute = |name: &str| node.attribute.iter().find(|a| a.name == name);
        let axis = attribute("axis").map_or(0, |a| a.i);
        let axis = usize::try_from(if axis < 0 { axis + dims.len() as i64 } else { axis }).ok()?;
        let sizes = match (node.input.get(1).filter(|s| !s.is_empty()), attribute("split")) {
            (Some(sizes), _) => self.int_value(*self.names.get(sizes)?, 0)?.1,
            (None, Some(split)) => split.ints.clone(),
            (None, None) => return None,
        };
        let Some(&Dim::Batch(k)) = dims.get(axis) else { return None };
        let whole_groups = b >= 1 && sizes.iter().all(|&s| s > 0 && s % b == 0) && sizes.iter().sum::<i64>() == k * b;
        if k < 2 || sizes.len() < 2 || node.output.len() != sizes.len() || !whole_groups {
            return None;
        }
        let groups: Vec<i64> = sizes.iter().map(|&s| s / b).collect();
        if groups.iter().all(|&g| g == 1) {
            let note = format!("a Split of an axis of {k} row groups of the batch ({} rows at the export batch {b}) into parts of {b} rows is read as an equal split into the {k} row groups, which follows the batch", k * b);
            let mut rewrite = BatchRewrite::replace(node, "Split", vec![data.clone()], &note);
            rewrite.node.attribute = vec![attribute_proto("axis", &AttrValue::Int(axis as i64))];
            // From opset 18 an equal split names its count.
            if self.opsets.of_domain("").is_some_and(|v| v >= 18) {
                rewrite.node.attribute.push(attribute_proto("num_outputs", &AttrValue::Int(k)));
            }
            return Some(rewrite);
        }
        // Sizes computed at run time are an input from opset 13 on.
        if !self.opsets.of_domain("").is_some_and(|v| v >= 13) {
            return None;
        }
        let at = |what: &str| format!("{}/row_groups_{what}", node.name);
        let note = format!("a Split of an axis of {k} row groups of the batch ({} rows at the export batch {b}) into parts of {sizes:?} rows is read as a split into {groups:?} row groups, which follows the batch", k * b);
        let mut rewrite = BatchRewrite::replace(node, "Split", vec![data.clone(), at("sizes")], &note);
        rewrite.node.attribute = vec![attribute_proto("axis", &AttrValue::Int(axis as i64))];
        for (name, value) in [("axis", axis as i64), ("next", axis as i64 + 1), ("k", k)] {
            rewrite.constants.push((at(name), TensorData::from_i64s(vec![1], &[value])));
        }
        rewrite.constants.push((at("groups"), TensorData::from_i64s(vec![groups.len() as i64], &groups)));
        rewrite.before.extend([
            plain(&at("shape"), "Shape", &[data], &at("shape")),
            plain(&at("extent"), "Slice", &[&at("shape"), &at("axis"), &at("next")], &at("extent")),
            plain(&at("group"), "Div", &[&at("extent"), &at("k")], &at("group")),
            plain(&at("sizes"), "Mul", &[&at("group"), &at("groups")], &at("sizes")),
        ]);
        Some(rewrite)
    }

    /// The outer rows of `v`'s leading extent when `v` is a `Gemm` or 2-D `MatMul` of
    /// rows that hold the batch inside outer rows (the layer keeps its rows).
    fn rows_through_layer(&self, v: ValueId) -> Option<i64> {
        let ValueDef::Node { node, .. } = &self.graph.value(v).def else { return None };
        let layer = self.graph.node(*node);
        let is_layer = matches!(layer.op, crate::Op::Gemm(_)) || (matches!(layer.op, crate::Op::MatMul) && self.graph.value(v).ty.shape.rank() == 2);
        let rows = layer.inputs.first().copied().flatten()?;
        is_layer.then(|| self.batch_rows.get(&self.graph.value(rows).name).copied()).flatten()
    }
}

/// `node` read as a ScatterElements of `updates` into `data` (its attributes left to the
/// caller) at the constant `positions` (extents `position_dims`, 1 where they repeat)
/// expanded to the updates' shape at run time.
fn scatter_at_positions(node: &NodeProto, data: &str, updates: &str, position_dims: Vec<i64>, positions: &[i64], note: &str) -> BatchRewrite {
    let at = |what: &str| format!("{}/batch/{what}", node.name);
    let mut rewrite = BatchRewrite::replace(node, "ScatterElements", vec![data.to_string(), at("indices"), updates.to_string()], note);
    rewrite.constants.push((at("positions"), TensorData::from_i64s(position_dims, positions)));
    rewrite.before.extend([plain(&at("update_shape"), "Shape", &[updates], &at("update_shape")), plain(&at("indices"), "Expand", &[&at("positions"), &at("update_shape")], &at("indices"))]);
    rewrite
}

/// Adds to `rewrite` the nodes writing `{prefix}expanded`: the first row of `value` (rows
/// of extents `row`) expanded to the batch that leads the shape vector `leading_of`.
fn first_row_expanded(rewrite: &mut BatchRewrite, prefix: &str, value: &str, row: &[i64], leading_of: &str) {
    let at = |what: &str| format!("{prefix}{what}");
    let (constants, shape_nodes) = batch_led_shape(&at("shape"), leading_of, row, &at("shape"));
    let (zero, one) = (constants[0].0.clone(), constants[1].0.clone());
    rewrite.constants.extend(constants);
    rewrite.before.push(plain(&at("row"), "Slice", &[value, &zero, &one, &zero], &at("row")));
    rewrite.before.extend(shape_nodes);
    rewrite.before.push(plain(&at("expanded"), "Expand", &[&at("row"), &at("shape")], &at("expanded")));
}

/// The product of the extents before the batch axis of `dims` (`seq` of `[seq, batch,
/// ...]`), where the batch is not the leading axis and those extents are fixed.
pub(super) fn rows_before_batch(dims: &[Dim]) -> Option<i64> {
    let axis = dims.iter().position(|d| d.is_batch()).filter(|&a| a > 0)?;
    dims[..axis].iter().map(|d| d.fixed()).product()
}

/// Where each of `extents` starts in their row-major layout: the product of those before.
fn extent_starts(extents: &[i64]) -> Vec<i64> {
    extents.iter().scan(1i64, |p, &v| Some(std::mem::replace(p, p.saturating_mul(v)))).collect()
}

/// `node`, a Reshape to the constant `extents`, reading a target with `-1` at `free` instead
/// (the constant `{node}/{suffix}`), so that extent takes the batch.
fn reshape_freeing(node: &NodeProto, extents: &[i64], free: usize, suffix: &str, note: &str) -> BatchRewrite {
    let mut rewritten = extents.to_vec();
    rewritten[free] = -1;
    let name = format!("{}/{suffix}", node.name);
    let note = format!("a Reshape to {extents:?} {note} ({rewritten:?})");
    let mut rewrite = BatchRewrite::replace(node, "Reshape", vec![node.input[0].clone(), name.clone()], &note);
    rewrite.constants.push((name, TensorData::from_i64s(vec![rewritten.len() as i64], &rewritten)));
    rewrite
}

/// Whether `indices` (extents `index_dims`, `[..dims, rank]`, row-major `values`) lists
/// every index tuple of a tensor of extents `dims`, in row-major order: a GatherND or
/// ScatterND with them touches every element, in place.
fn enumerates(index_dims: &[i64], values: &[i64], dims: &[i64]) -> bool {
    let Some((&k, lead)) = index_dims.split_last() else { return false };
    if k as usize != dims.len() || lead != dims {
        return false;
    }
    let mut expected = vec![0i64; dims.len()];
    for tuple in values.chunks(dims.len()) {
        if tuple != expected.as_slice() {
            return false;
        }
        for axis in (0..dims.len()).rev() {
            expected[axis] += 1;
            if expected[axis] < dims[axis] {
                break;
            }
            expected[axis] = 0;
        }
    }
    true
}

/// Whether every element of `values` (row-major over `dims`) is its own coordinate along `axis`.
fn indexes_own_position(dims: &[i64], values: &[i64], axis: usize) -> bool {
    let Some(&extent) = dims.get(axis) else { return false };
    let inner: i64 = dims[axis + 1..].iter().product();
    values.len() as i64 == dims.iter().product::<i64>() && values.iter().enumerate().all(|(i, &v)| v == (i as i64 / inner) % extent)
}
