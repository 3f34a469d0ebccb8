//! `Split` at sizes computed at run time, read densely: mixture-of-experts experts.
//!
//! GraniteMoE's and JetMoE's experts (`ParallelExperts`, as both PyTorch exporters write
//! them) sort the (token, choice) rows by the expert each chose, split the sorted rows
//! at the number of rows per expert (a `Split` whose sizes the routing computes, known
//! only at run time), run expert `i`'s linear map on part `i` and concatenate the parts
//! again. A static stage program has no extent for a part.
//!
//! The importer reads such a `Split` as every part holding all the rows, and the
//! `Concat` that joins the parts as the sum over parts of each part's rows where the
//! part's range `[start_i, end_i)` of the sorted rows holds them (`Where`), zero
//! elsewhere. The sizes sum to the rows (as `Split` requires), so each row lies in one
//! range: every row of the result is what its own part computes for it, and its gradient
//! reaches that part only, at the cost of every expert on every row. `export` writes the
//! source graph, which keeps the `Split`.
//!
//! This is sound only where the parts are computed on row by row (element by element,
//! or multiplied by a weight on the right) and joined by one `Concat` of all the parts,
//! in order, along the split axis. Any other reader of a part (its shape, a reduction,
//! a graph output) is refused, naming the node.

use std::collections::HashMap;

use onnx_protobuf::NodeProto;
use pipewright_ops::onnx::AttrSource;

use super::attrs::Attrs;
use super::dense_select::ELEMENTWISE_OPS;
use super::node_proto::plain;
use super::Importer;
use crate::error::{ImportError, NodeRef};
use crate::ValueId;

/// What the dense reading of run-time `Split`s reaches.
#[derive(Default)]
pub(super) struct DenseSplit {
    /// Each part, and each value computed from it row by row: which part it is.
    parts: HashMap<ValueId, Part>,
    /// Each split read densely, by node name.
    splits: HashMap<String, SplitRows>,
}

/// Part `index` of the split named `split`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Part {
    split: String,
    index: usize,
}

/// A split read densely: how many parts, and the name of its `[rows, parts]` boolean
/// value saying which part's range holds each row.
struct SplitRows {
    parts: usize,
    inside: String,
}

impl Importer<'_> {
    /// Whether `node` is a `Split` at sizes computed at run time (its `split` input is
    /// neither a constant nor computed from shapes), which the importer reads densely.
    pub(super) fn splits_densely(&self, node: &NodeProto) -> bool {
        let sizes = node.input.get(1).filter(|n| !n.is_empty()).and_then(|n| self.names.get(n));
        node.op_type == "Split" && sizes.is_some_and(|&v| self.known.get(v.index()).is_none_or(|k| k.is_none()))
    }

    /// Every part as the split's whole input, and which part's range holds each row:
    /// `ends = CumSum(sizes)`, `starts = ends - sizes`, `inside[r, i] = starts[i] <= r < ends[i]`.
    pub(super) fn add_dense_split(&mut self, node: &NodeProto, opset: i64) -> Result<(), ImportError> {
        let nref = || NodeRef { name: node.name.clone(), op_type: node.op_type.clone() };
        let refuse = |reason: String| Err(ImportError::BadNode { node: nref(), reason });
        let (data, sizes) = (node.input[0].clone(), node.input[1].clone());
        let Some(&data_id) = self.names.get(&data) else {
            return Err(ImportError::UndefinedInput { node: nref(), input: data });
        };
        let rank = self.graph.value(data_id).ty.shape.rank();
        let axis = Attrs::new(&node.attribute).int_or("axis", 0).map_err(|reason| ImportError::BadNode { node: nref(), reason })?;
        if rank == 0 || (axis != 0 && axis != -(rank as i64)) {
            return refuse(format!("splits at sizes computed at run time along axis {axis} of a rank-{rank} tensor; pipewright reads such a Split densely only along the rows (axis 0: mixture-of-experts experts); export the model with a dense formulation"));
        }
        let parts = node.output.len();
        let size_dims = self.graph.value(self.names[&sizes]).ty.shape.dims().to_vec();
        if size_dims != [crate::Dim::Fixed(parts as i64)] {
            return refuse(format!("splits into {parts} parts at sizes of shape {}, computed at run time; a Split reads one size per output", crate::dim::Shape(size_dims)));
        }
        let at = |what: &str| format!("{}/dense/{what}", node.name);
        self.constant_i64(&at("zero"), &[], &[0]);
        self.constant_i64(&at("one"), &[], &[1]);
        self.constant_i64(&at("column"), &[1], &[1]);
        let nodes = [
            plain(&at("ends"), "CumSum", &[&sizes, &at("zero")], &at("ends")),
            plain(&at("starts"), "Sub", &[&at("ends"), &sizes], &at("starts")),
            plain(&at("shape"), "Shape", &[&data], &at("shape")),
            plain(&at("rows"), "Gather", &[&at("shape"), &at("zero")], &at("rows")),
            plain(&at("row"), "Range", &[&at("zero"), &at("rows"), &at("one")], &at("row")),
            plain(&at("row_column"), "Unsqueeze", &[&at("row"), &at("column")], &at("row_column")),
            plain(&at("from_start"), "GreaterOrEqual", &[&at("row_column"), &at("starts")], &at("from_start")),
            plain(&at("before_end"), "Less", &[&at("row_column"), &at("ends")], &at("before_end")),
            plain(&at("inside"), "And", &[&at("from_start"), &at("before_end")], &at("inside")),
        ];
        for n in &nodes {
            self.add_node_plain(n, opset)?;
        }
        for (index, output) in node.output.iter().enumerate().filter(|(_, o)| !o.is_empty()) {
            self.add_node_plain(&plain(&format!("{}/dense/part{index}", node.name), "Identity", &[&data], output), opset)?;
            self.dense_split.parts.insert(self.names[output], Part { split: node.name.clone(), index });
        }
        self.dense_split.splits.insert(node.name.clone(), SplitRows { parts, inside: at("inside") });
        self.graph.warnings.push(format!(
            "node {:?} (Split): its sizes depend on the data; each of its {parts} parts read as all the rows, the Concat joining them as each row taken from the part whose range holds it",
            node.name
        ));
        Ok(())
    }

    /// Imports `node` when it reads parts of a dense `Split` (checking that it may);
    /// `Ok(false)` when it reads none and is imported as usual.
    pub(super) fn add_split_part_reader(&mut self, node: &NodeProto, opset: i64) -> Result<bool, ImportError> {
        let read: Vec<(usize, Part)> = node.input.iter().enumerate().filter_map(|(i, n)| Some((i, self.dense_split.parts.get(self.names.get(n)?)?.clone()))).collect();
        let Some((_, part)) = read.first().cloned() else { return Ok(false) };
        let refuse = |what: &str| {
            let reason = format!(
                "{what} of a Split whose sizes depend on the data, which pipewright reads densely (every part holding all the rows) only for row-by-row computation on each part and one Concat of all the parts, in order (mixture-of-experts experts); export the model with a dense formulation"
            );
            Err(ImportError::BadNode { node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() }, reason })
        };
        if node.op_type == "Concat" {
            return self.add_dense_concat(node, &read, opset).map(|_| true);
        }
        if read.iter().any(|(_, p)| *p != part) {
            return refuse("reads two parts together");
        }
        if !self.computes_rows(node, &read) {
            return refuse("computes across the rows, or reshapes them, of a part");
        }
        self.add_node_plain(node, opset)?;
        let outputs: Vec<ValueId> = node.output.iter().filter_map(|o| self.names.get(o).copied()).collect();
        self.dense_split.parts.extend(outputs.into_iter().map(|v| (v, part.clone())));
        Ok(true)
    }

    /// Whether `node` computes each row of its output from the same row of the parts it
    /// reads (at the slots in `read`) alone: element by element with operands that hold
    /// no rows (rank below the part's, or one row), or a product by a matrix on the right.
    fn computes_rows(&self, node: &NodeProto, read: &[(usize, Part)]) -> bool {
        let rank = |name: &String| self.names.get(name).map(|&v| self.graph.value(v).ty.shape.rank());
        let dims = |name: &String| self.names.get(name).map(|&v| self.graph.value(v).ty.shape.dims().to_vec());
        let part_rank = rank(&node.input[read[0].0]).unwrap_or(0);
        let others = node.input.iter().enumerate().filter(|(i, n)| !n.is_empty() && !read.iter().any(|(r, _)| r == i));
        let mut attrs = Attrs::new(&node.attribute);
        match node.op_type.as_str() {
            "MatMul" => read.iter().all(|(i, _)| *i == 0) && part_rank >= 2 && others.into_iter().all(|(_, n)| rank(n) == Some(2)),
            "Gemm" => {
                let trans_a = attrs.int_or("transA", 0).unwrap_or(1);
                read.iter().all(|(i, _)| *i == 0) && trans_a == 0 && others.into_iter().all(|(i, n)| i == 1 || rank(n).is_some_and(|r| r < 2) || dims(n).is_some_and(|d| d.first() == Some(&crate::Dim::Fixed(1))))
            }
            op if ELEMENTWISE_OPS.contains(&op) => others.into_iter().all(|(_, n)| rank(n).is_some_and(|r| r < part_rank) || dims(n).is_some_and(|d| d.len() == part_rank && d.first() == Some(&crate::Dim::Fixed(1)))),
            _ => false,
        }
    }

    /// A Concat of all the parts of one dense split, in order, along the rows: the sum
    /// over parts of `Where(inside[:, i], part_i, 0)`.
    fn add_dense_concat(&mut self, node: &NodeProto, read: &[(usize, Part)], opset: i64) -> Result<(), ImportError> {
        let refuse = |reason: &str| {
            Err(ImportError::BadNode {
                node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() },
                reason: format!("joins parts of a Split whose sizes depend on the data {reason}; pipewright reads such a Split densely only where one Concat joins all its parts, in order, along the rows (mixture-of-experts experts)"),
            })
        };
        if node.output.len() != 1 || node.output[0].is_empty() {
            return refuse("without one output (a Concat gives one)");
        }
        let split = read[0].1.split.clone();
        let rows = &self.dense_split.splits[&split];
        let in_order = read.len() == node.input.len() && read.len() == rows.parts && read.iter().enumerate().all(|(k, (slot, p))| *slot == k && p.index == k && p.split == split);
        if !in_order {
            return refuse("with other values, or not all of them in order");
        }
        let rank = self.graph.value(self.names[&node.input[0]]).ty.shape.rank();
        let axis = Attrs::new(&node.attribute).int_or("axis", 0).unwrap_or(-1);
        if rank == 0 || (axis != 0 && axis != -(rank as i64)) {
            return refuse(&format!("along axis {axis}, not the rows"));
        }
        let inside = rows.inside.clone();
        let dtype = self.graph.value(self.names[&node.input[0]]).ty.dtype;
        let at = |what: &str| format!("{}/dense/{what}", node.name);
        let mut mask_shape = vec![-1i64];
        mask_shape.resize(rank, 1);
        self.constant_i64(&at("mask_shape"), &[rank as i64], &mask_shape);
        self.constant_i64(&at("parts_axis"), &[1], &[1]);
        let zero = crate::TensorData::from_f64s(dtype, vec![], &[0.0]);
        let zero_ty = crate::dim::TensorType::new(dtype, crate::dim::Shape::fixed(&[]));
        self.define(at("zero"), zero_ty, crate::ValueDef::Weight(crate::Weight { data: zero, trainable: false }));
        let mut nodes = Vec::new();
        let last = node.input.len() - 1;
        // The running sum of the parts' rows; the last sum (or the only part's rows)
        // defines the Concat's output, under the Concat's name.
        let mut sum: Option<String> = None;
        for (k, input) in node.input.iter().enumerate() {
            let part = |what: &str| at(&format!("{what}{k}"));
            self.constant_i64(&part("from"), &[1], &[k as i64]);
            self.constant_i64(&part("to"), &[1], &[k as i64 + 1]);
            let only = node.input.len() == 1;
            let (rows_node, rows) = if only { (node.name.clone(), node.output[0].clone()) } else { (part("rows"), part("rows")) };
            nodes.extend([
                plain(&part("inside"), "Slice", &[&inside, &part("from"), &part("to"), &at("parts_axis")], &part("inside")),
                plain(&part("mask"), "Reshape", &[&part("inside"), &at("mask_shape")], &part("mask")),
                plain(&rows_node, "Where", &[&part("mask"), input, &at("zero")], &rows),
            ]);
            sum = Some(match sum {
                None => rows,
                Some(previous) => {
                    let (name, output) = if k == last { (node.name.clone(), node.output[0].clone()) } else { (part("sum"), part("sum")) };
                    nodes.push(plain(&name, "Add", &[&previous, &rows], &output));
                    output
                }
            });
        }
        for n in &nodes {
            self.add_node_plain(n, opset)?;
        }
        Ok(())
    }

    /// A graph output computed from a part would hold every row of every part: refused.
    pub(super) fn check_dense_split_outputs(&self, outputs: &[ValueId]) -> Result<(), ImportError> {
        match outputs.iter().find(|v| self.dense_split.parts.contains_key(v)) {
            Some(&v) => Err(ImportError::BadTensor {
                name: self.graph.value(v).name.clone(),
                reason: "a graph output computed from a part of a Split whose sizes depend on the data, which pipewright reads densely only where one Concat joins all its parts again (mixture-of-experts experts); export the model with a dense formulation".into(),
            }),
            None => Ok(()),
        }
    }
}
