//! `NonZero` over values computed at run time, read densely: mixture-of-experts routing.
//!
//! A mixture-of-experts layer (Mixtral's, as PyTorch's TorchScript exporter writes it)
//! asks, per expert, which (choice, token) pairs chose it (`NonZero` of a one-hot mask),
//! gathers those tokens' rows, runs the expert on them, scales them by their routing
//! weights and scatters them back into a zero tensor of all tokens. How many pairs chose
//! an expert depends on the data, and a static stage program has no such extent.
//!
//! The importer reads such a `NonZero` as every position of its mask, in the order
//! `NonZero` lists them, and the scatter's updates multiplied by the mask at each
//! position, summed into the zeros: a position the mask does not select adds zero (and
//! passes back a zero gradient), a selected one adds what the sparse layer writes, so the
//! layer computes the same values and gradients, at the cost of running every expert on
//! every pair. `export` writes the source graph, which keeps the `NonZero`.
//!
//! This is sound only where every use of the positions is of that shape: index
//! arithmetic on them, rows gathered at them, row-by-row computation on those rows, and a
//! scatter of them into zeros along the rows' axis. Any other reader of either (a
//! reduction over the pairs, a graph output) is refused, naming the node.

use std::collections::HashMap;

use onnx_protobuf::NodeProto;
use pipewright_ops::onnx::AttrSource;

use super::attrs::{attribute_proto, Attrs};
use super::node_proto::{concat0, filled, plain};
use super::Importer;
use crate::error::{ImportError, NodeRef};
use crate::ValueId;

/// Which values the dense reading of a `NonZero` reaches, each with the name of the
/// flattened mask of the `NonZero` it comes from.
#[derive(Default)]
pub(super) struct DenseSelect {
    /// Positions (the `NonZero` output) and index arithmetic on them.
    positions: HashMap<ValueId, String>,
    /// Rows gathered at positions and what is computed from them row by row.
    rows: HashMap<ValueId, String>,
    /// Shapes (and sizes) of either, which hold the count of positions: only ever shapes.
    counts: HashMap<ValueId, String>,
    /// The mask each flattened mask was flattened from.
    masks: HashMap<String, String>,
    /// How many positions each mask has (its size): the pairs' extent.
    pairs: HashMap<String, crate::Dim>,
}

/// Ops that compute positions from positions element by element (or move them).
/// (`Slice` and `Concat` must keep every extent of the count where it was: they may pick
/// or join coordinates, never pairs. `Max` of one operand, the default exporter's
/// broadcast of one index tensor without its optimizer, is the positions themselves.)
const INDEX_OPS: &[&str] = &["Transpose", "Split", "Squeeze", "Unsqueeze", "Expand", "Reshape", "Flatten", "Cast", "Add", "Sub", "Mul", "Max", "Min", "Identity", "Slice", "Concat"];

/// Ops that build a shape vector from shape vectors.
const COUNT_OPS: &[&str] = &["Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Identity"];

/// Ops that read a shape vector as the shape they produce, in slot 1.
const SHAPED_OPS: &[&str] = &["Reshape", "Expand", "Tile"];

/// Ops that compute each element from the same element of their operands (broadcast).
pub(super) const ELEMENTWISE_OPS: &[&str] = &[
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Cast", "Identity", "Sigmoid", "Relu", "Tanh", "Gelu", "Erf", "Exp", "Neg", "Sqrt", "Softplus", "HardSigmoid", "HardSwish",
    "LeakyRelu", "Elu", "Selu", "Mish",
];

/// Besides [`ELEMENTWISE_OPS`], ops that compute each row from that row alone, given rows
/// in their first operand.
const ROW_SHAPE_OPS: &[&str] = &["MatMul", "Gemm", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Transpose"];

/// What a node does with values the dense reading reaches.
enum Reads {
    /// Nothing: an ordinary node.
    Nothing,
    /// Positions or rows, computing more of them: the outputs join the given set.
    Positions(String),
    Rows(String),
    /// A shape holding the count (`Shape`, `Size` of either), or a vector made of it.
    Counts(String),
    /// An op that takes a count only as the shape it produces (a Reshape or Expand
    /// target): its outputs are what its other inputs make them.
    Shaped,
    /// A scatter of rows into zeros at positions: written masked.
    Scatter(String),
}

impl Importer<'_> {
    /// Whether `node` is a `NonZero` the importer reads densely (its input is computed at
    /// run time, of rank 1 or 2).
    pub(super) fn reads_nonzero_densely(&self, node: &NodeProto) -> bool {
        let Some(&mask) = node.input.first().and_then(|n| self.names.get(n)) else { return false };
        node.op_type == "NonZero" && self.known.get(mask.index()).is_none_or(|k| k.is_none()) && (1..=2).contains(&self.graph.value(mask).ty.shape.rank())
    }

    /// Every position of the mask, as `NonZero` would list them were all selected:
    /// `[rank, numel]` from `Range(0, Size(mask))` (row and column of each for rank 2).
    pub(super) fn add_dense_nonzero(&mut self, node: &NodeProto, opset: i64) -> Result<(), ImportError> {
        let mask = node.input[0].clone();
        let rank = self.graph.value(self.names[&mask]).ty.shape.rank();
        let at = |what: &str| format!("{}/dense/{what}", node.name);
        self.constant_i64(&at("zero"), &[], &[0]);
        self.constant_i64(&at("one"), &[], &[1]);
        self.constant_i64(&at("lead"), &[1], &[0]);
        self.constant_i64(&at("flat"), &[1], &[-1]);
        let mut nodes = vec![
            plain(&at("size"), "Size", &[&mask], &at("size")),
            plain(&at("index"), "Range", &[&at("zero"), &at("size"), &at("one")], &at("index")),
            plain(&at("mask_flat"), "Reshape", &[&mask, &at("flat")], &at("mask_flat")),
        ];
        if rank == 1 {
            nodes.push(plain(&node.name, "Unsqueeze", &[&at("index"), &at("lead")], &node.output[0]));
        } else {
            nodes.extend([
                plain(&at("shape"), "Shape", &[&mask], &at("shape")),
                plain(&at("columns"), "Gather", &[&at("shape"), &at("one")], &at("columns")),
                plain(&at("row"), "Div", &[&at("index"), &at("columns")], &at("row")),
                plain(&at("column"), "Mod", &[&at("index"), &at("columns")], &at("column")),
                plain(&at("row_lead"), "Unsqueeze", &[&at("row"), &at("lead")], &at("row_lead")),
                plain(&at("column_lead"), "Unsqueeze", &[&at("column"), &at("lead")], &at("column_lead")),
            ]);
            nodes.push(concat0(&node.name, &[&at("row_lead"), &at("column_lead")], &node.output[0]));
        }
        for n in &nodes {
            self.add_node(n, opset)?;
        }
        self.graph.warnings.push(format!(
            "node {:?} (NonZero): its count depends on the data; read as every position of its mask, the scatter of what is computed there masked",
            node.name
        ));
        let positions = self.names[&node.output[0]];
        self.dense.positions.insert(positions, at("mask_flat"));
        self.dense.masks.insert(at("mask_flat"), mask);
        let pairs = self.graph.value(positions).ty.shape.dims()[1];
        self.dense.pairs.insert(at("mask_flat"), pairs);
        Ok(())
    }

    /// Imports `node` when it reads positions or rows of a dense `NonZero` (checking that
    /// it may); `Ok(false)` when it reads neither and is imported as usual.
    pub(super) fn add_dense_reader(&mut self, node: &NodeProto, opset: i64) -> Result<bool, ImportError> {
        let reads = self.dense_reads(node)?;
        match reads {
            Reads::Nothing => return Ok(false),
            Reads::Scatter(mask) => return self.add_masked_scatter(node, &mask, opset).map(|_| true),
            Reads::Shaped => return Ok(false),
            Reads::Counts(_) | Reads::Positions(_) | Reads::Rows(_) => self.add_node_plain(node, opset)?,
        }
        if let (Reads::Positions(mask), "Slice" | "Concat") = (&reads, node.op_type.as_str()) {
            self.check_pairs_kept(node, mask)?;
        }
        if let Reads::Rows(mask) = &reads {
            self.check_rows_hold_pairs(node, mask)?;
        }
        let outputs: Vec<ValueId> = node.output.iter().filter_map(|o| self.names.get(o).copied()).collect();
        let set = match &reads {
            Reads::Positions(_) => &mut self.dense.positions,
            Reads::Rows(_) => &mut self.dense.rows,
            _ => &mut self.dense.counts,
        };
        if let Reads::Positions(mask) | Reads::Rows(mask) | Reads::Counts(mask) = reads {
            set.extend(outputs.into_iter().map(|v| (v, mask.clone())));
        }
        Ok(true)
    }

    /// A Slice or Concat of positions may pick or join coordinates, never pairs: every
    /// axis where an input has the pairs' extent keeps it in the output.
    fn check_pairs_kept(&self, node: &NodeProto, mask: &str) -> Result<(), ImportError> {
        let pairs = self.dense.pairs[mask];
        let dims = |name: &String| self.names.get(name).map(|&v| self.graph.value(v).ty.shape.dims().to_vec());
        let out = dims(&node.output[0]).unwrap_or_default();
        let kept = node.input.iter().filter(|n| self.names.get(*n).is_some_and(|v| self.dense.positions.contains_key(v))).filter_map(dims).all(|d| {
            d.len() == out.len() && d.iter().zip(&out).all(|(i, o)| *i != pairs || o == i)
        });
        if kept {
            return Ok(());
        }
        let reason = "picks or joins the positions of a NonZero whose count depends on the data (not only their coordinates), which its dense reading cannot follow; export the model with a dense formulation".into();
        Err(ImportError::BadNode { node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() }, reason })
    }

    /// Rows keep an extent of one row per pair (a product contracting over the pairs
    /// would sum selected and unselected ones alike).
    fn check_rows_hold_pairs(&self, node: &NodeProto, mask: &str) -> Result<(), ImportError> {
        let pairs = self.dense.pairs[mask];
        let holds = |name: &String| self.names.get(name).is_none_or(|&v| self.graph.value(v).ty.shape.dims().contains(&pairs));
        if node.output.iter().filter(|o| !o.is_empty()).all(holds) {
            return Ok(());
        }
        let reason = "computes across the rows gathered at the positions of a NonZero whose count depends on the data (its output has no row per position), which its dense reading cannot follow; export the model with a dense formulation".into();
        Err(ImportError::BadNode { node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() }, reason })
    }

    /// A graph output the dense reading reaches would hold every position, not the
    /// selected ones: refused.
    pub(super) fn check_dense_outputs(&self, outputs: &[ValueId]) -> Result<(), ImportError> {
        match outputs.iter().find(|v| self.dense.positions.contains_key(v) || self.dense.rows.contains_key(v)) {
            Some(&v) => Err(ImportError::BadTensor {
                name: self.graph.value(v).name.clone(),
                reason: "a graph output computed from a NonZero of values known only at run time (its count depends on the data), which pipewright reads densely only where the result is scattered back into zeros (mixture-of-experts routing); export the model with a fixed selection or a dense formulation".into(),
            }),
            None => Ok(()),
        }
    }

    fn dense_reads(&self, node: &NodeProto) -> Result<Reads, ImportError> {
        let slot_of = |set: &HashMap<ValueId, String>| -> Vec<(usize, String)> {
            node.input.iter().enumerate().filter_map(|(i, n)| Some((i, set.get(self.names.get(n)?)?.clone()))).collect()
        };
        let (positions, rows, counts) = (slot_of(&self.dense.positions), slot_of(&self.dense.rows), slot_of(&self.dense.counts));
        let Some(mask) = positions.iter().chain(&rows).chain(&counts).map(|(_, m)| m.clone()).next() else { return Ok(Reads::Nothing) };
        let op = node.op_type.as_str();
        let refuse = |what: &str| {
            let reason = format!(
                "reads {what} of a NonZero whose count depends on the data, which pipewright reads densely (every position, masked) only for index arithmetic, rows gathered at the positions, row-by-row computation on them and their scatter into zeros (mixture-of-experts routing); export the model with a dense formulation"
            );
            Err(ImportError::BadNode { node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() }, reason })
        };
        if positions.iter().chain(&rows).chain(&counts).any(|(_, m)| *m != mask) {
            return refuse("the positions of two NonZeros together");
        }
        if !counts.is_empty() {
            let as_target = SHAPED_OPS.contains(&op) && only_slots(&counts, &[1]);
            if !as_target {
                return match op {
                    "ConstantOfShape" => Ok(Reads::Rows(mask)),
                    _ if COUNT_OPS.contains(&op) && (op == "Concat" || only_slots(&counts, &[0])) && positions.is_empty() && rows.is_empty() => Ok(Reads::Counts(mask)),
                    _ => refuse("the count of positions"),
                };
            }
            if positions.is_empty() && rows.is_empty() {
                return Ok(Reads::Shaped);
            }
        }
        classify(op, &positions, &rows, mask).map_or_else(|what| refuse(what), Ok)
    }

    /// A scatter of rows at positions, with the rows multiplied by the mask at each
    /// position and summed in: `ScatterElements(zeros, positions, rows)` along the rows'
    /// axis (Mixtral's, as TorchScript writes it) becomes `ScatterElements(zeros,
    /// positions, rows * mask, reduction = add)`, where the pairs the mask did not select
    /// add zero where the selected one writes; a scatter that already adds
    /// (`ScatterND(sum, positions, rows, reduction = add)`, OLMoE's `index_add_` as the
    /// default exporter writes it) keeps its data and adds the masked rows.
    fn add_masked_scatter(&mut self, node: &NodeProto, mask: &str, opset: i64) -> Result<(), ImportError> {
        let refuse = |reason: &str| {
            Err(ImportError::BadNode {
                node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() },
                reason: format!("scatters rows computed at the positions of a NonZero whose count depends on the data, {reason}; pipewright reads such a NonZero densely only when its rows are added into a tensor, or scattered into zeros along their own axis (mixture-of-experts routing)"),
            })
        };
        let mut attrs = Attrs::new(&node.attribute);
        let axis = attrs.int_or("axis", 0).unwrap_or(-1);
        let reduction = attrs.string("reduction").ok().flatten().unwrap_or_else(|| "none".into());
        let data = self.names[&node.input[0]];
        let zeros = self.all_zeros(data) || self.fills.get(&data) == Some(&0.0);
        let target = match reduction.as_str() {
            "add" if zeros => self.zeros_following_the_batch(node, data, mask, opset)?.unwrap_or_else(|| node.input[0].clone()),
            "add" => node.input[0].clone(),
            "none" if node.op_type == "ScatterElements" && axis == 0 => {
                if !zeros {
                    return refuse("into a tensor not known to be zeros");
                }
                self.zeros_following_the_batch(node, data, mask, opset)?.unwrap_or_else(|| node.input[0].clone())
            }
            _ => return refuse(&format!("along axis {axis} with reduction {reduction:?}")),
        };
        let updates = self.names[&node.input[2]];
        if self.graph.value(updates).ty.shape.dims().first() != Some(&self.dense.pairs[mask]) {
            return refuse("whose updates do not have one row per position first");
        }
        let rank = self.graph.value(updates).ty.shape.rank();
        let dtype = self.graph.value(updates).ty.dtype;
        let at = |what: &str| format!("{}/dense/{what}", node.name);
        let mut rows_shape = vec![-1i64];
        rows_shape.resize(rank.max(1), 1);
        self.constant_i64(&at("rows_shape"), &[rows_shape.len() as i64], &rows_shape);
        let mut cast = plain(&at("mask"), "Cast", &[mask], &at("mask"));
        cast.attribute.push(attribute_proto("to", &pipewright_ops::op::AttrValue::Int(dtype.onnx_code() as i64)));
        let mut scatter = plain(&node.name, &node.op_type, &[&target, &node.input[1], &at("masked")], &node.output[0]);
        scatter.attribute = vec![attribute_proto("reduction", &pipewright_ops::op::AttrValue::Str("add".into()))];
        if node.op_type == "ScatterElements" {
            scatter.attribute.push(attribute_proto("axis", &pipewright_ops::op::AttrValue::Int(0)));
        }
        let nodes = [
            cast,
            plain(&at("mask_rows"), "Reshape", &[&at("mask"), &at("rows_shape")], &at("mask_rows")),
            plain(&at("masked"), "Mul", &[&node.input[2], &at("mask_rows")], &at("masked")),
            scatter,
        ];
        for n in &nodes {
            self.add_node_plain(n, opset)?;
        }
        Ok(())
    }

    /// A fixed-batch export writes the zeros a layer scatters into as a constant of the
    /// export batch's token count: zeros of the mask's batch-carrying extent instead
    /// (the tokens the positions index), built at run time; `None` where the data
    /// already follows the batch or no extent of the mask matches it.
    fn zeros_following_the_batch(&mut self, node: &NodeProto, data: ValueId, mask_flat: &str, opset: i64) -> Result<Option<String>, ImportError> {
        let (Some(b), Some(mask)) = (self.ctx.export_batch, self.dense.masks.get(mask_flat).cloned()) else { return Ok(None) };
        let dims: Option<Vec<i64>> = self.graph.value(data).ty.shape.dims().iter().map(|d| d.fixed()).collect();
        let Some((&rows, rest)) = dims.as_ref().and_then(|d| d.split_first()) else { return Ok(None) };
        let mask_dims = self.graph.value(self.names[&mask]).ty.shape.dims().to_vec();
        let carrying: Vec<usize> = (0..mask_dims.len()).filter(|&a| mask_dims[a].is_batch()).collect();
        let [axis] = carrying[..] else { return Ok(None) };
        if mask_dims[axis].eval(b) != rows {
            return Ok(None);
        }
        let at = |what: &str| format!("{}/dense/{what}", node.name);
        let constants = vec![
            (at("token_axis"), crate::TensorData::from_i64s(vec![1], &[axis as i64])),
            (at("row_extent"), crate::TensorData::from_i64s(vec![rest.len() as i64], rest)),
        ];
        for (name, data) in &constants {
            self.constant_i64(name, &data.dims, &data.to_i64s());
        }
        let nodes = [
            plain(&at("mask_shape"), "Shape", &[&mask], &at("mask_shape")),
            plain(&at("tokens"), "Gather", &[&at("mask_shape"), &at("token_axis")], &at("tokens")),
            concat0(&at("zeros_shape"), &[&at("tokens"), &at("row_extent")], &at("zeros_shape")),
            filled(&at("zeros"), &at("zeros_shape"), self.graph.value(data).ty.dtype, 0.0),
        ];
        for n in &nodes {
            self.add_node_plain(n, opset)?;
        }
        // `export` writes the source's scatter (sparse, as exported) into the same zeros.
        let mut source = node.clone();
        source.input[0] = at("zeros");
        self.graph.source_rewrites.push(crate::graph::SourceRewrite { node: source, before: nodes.to_vec(), constants });
        self.graph.warnings.push(format!("node {:?}: the zeros it scatters into, a constant of the export batch, are built from the tokens the positions index", node.name));
        Ok(Some(at("zeros")))
    }

    pub(super) fn constant_i64(&mut self, name: &str, dims: &[i64], values: &[i64]) {
        let data = crate::TensorData::from_i64s(dims.to_vec(), values);
        let ty = crate::dim::TensorType::new(data.dtype, crate::dim::Shape::fixed(dims));
        self.define(name.to_string(), ty, crate::ValueDef::Weight(crate::Weight { data, trainable: false }));
    }
}

/// What an op of type `op` does with the positions and rows it reads (at the given
/// slots), all of one mask; `Err` says what it reads that the dense reading cannot allow.
fn classify(op: &str, positions: &[(usize, String)], rows: &[(usize, String)], mask: String) -> Result<Reads, &'static str> {
    Ok(match op {
        "Shape" | "Size" => Reads::Counts(mask),
        "ScatterElements" | "ScatterND" if only_slots(positions, &[1]) && only_slots(rows, &[2]) && !positions.is_empty() => Reads::Scatter(mask),
        "Gather" | "GatherND" if only_slots(positions, &[1]) && rows.is_empty() => Reads::Rows(mask),
        _ if rows.is_empty() && INDEX_OPS.contains(&op) => Reads::Positions(mask),
        "MatMul" | "Gemm" if only_slots(rows, &[0]) && positions.is_empty() => Reads::Rows(mask),
        _ if (ELEMENTWISE_OPS.contains(&op) || ROW_SHAPE_OPS.contains(&op)) && positions.is_empty() => Reads::Rows(mask),
        _ if positions.is_empty() => return Err("rows computed at the positions"),
        _ => return Err("the positions"),
    })
}

/// Whether every slot in `list` is one of `allowed`.
fn only_slots(list: &[(usize, String)], allowed: &[usize]) -> bool {
    list.iter().all(|(i, _)| allowed.contains(i))
}
