//! `export`'s batch axis: a model exported at a fixed batch size (all six shared models
//! are) is trained by pipewright at any batch (the importer turns the export batch into
//! the symbolic `N`), so the exported model should take any batch too. [`dynamic_batch`]
//! rewrites the source graph with what the importer found:
//!
//! - axis 0 of every graph input and output whose extent is `N` becomes `dim_param "N"`
//!   (other batch-dependent output extents, such as `2*N`, are left unnamed), and the
//!   `value_info` hints, which carry the export batch, are dropped;
//! - a Reshape whose target is a constant and whose output has one batch extent gets a
//!   target with `-1` there (and every other extent written out), as the lowering does;
//! - an Expand whose constant target sets the batch where its operand already has it gets
//!   `1` there (broadcasting keeps the operand's batch);
//! - a float initializer baked for the export batch (an attention mask or a class token:
//!   a frozen constant of rank >= 3, leading extent the export batch, equal slices) keeps
//!   one slice (`[1, ...]`): broadcasting element-wise ops take it as it is, and a Concat
//!   along another axis reads it expanded to the batch of the tensor it is concatenated
//!   with (`Expand(c, Concat(Gather(Shape(x), 0), c.dims[1..]))`, as the lowering does);
//!   a `Constant` node holding one slice repeated so (token type ids the TorchScript
//!   exporter folded) is written as an initializer first, and rewritten the same way.
//!
//! Anything else that bakes the batch (a Tile over the batch, a Reshape whose output has
//! two batch extents) is not rewritten: the model then keeps its export batch, and
//! [`Rebatched::Fixed`] says which node holds it, for `export` to report.

use std::collections::HashMap;
use std::path::Path;

use onnx_protobuf::tensor_shape_proto::{dimension, Dimension};
use onnx_protobuf::{attribute_proto, type_proto, AttributeProto, GraphProto, NodeProto, TensorProto, ValueInfoProto};
use pipewright_ir::import::tensor::{tensor_from_proto, tensor_to_proto};
use pipewright_ir::{Dim, Graph, TensorData};

/// What [`dynamic_batch`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rebatched {
    /// The model takes any batch: `inputs` graph inputs made dynamic, `reshapes` Reshape
    /// targets, `expands` Expand targets and `sliced` batch-baked initializers rewritten.
    /// `rewritten` source nodes are written as the importer read them
    /// ([`pipewright_ir::Graph::source_rewrites`]).
    Dynamic { inputs: usize, reshapes: usize, expands: usize, sliced: usize, rewritten: usize },
    /// The source had no batch axis the importer could use; nothing changed.
    NoBatch,
    /// The model keeps its export batch `batch`: `why` names the node that bakes it.
    Fixed { batch: i64, why: String },
}

/// Element-wise ops that broadcast an operand of leading extent 1 to any batch.
const BROADCASTING: &[&str] = &["Add", "Sub", "Mul", "Div", "Where", "Pow", "Max", "Min", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor"];

const INT64: i32 = 7;

/// The i64 values of a tensor stored in the file (external data is not read).
fn i64_values(t: &TensorProto) -> Option<Vec<i64>> {
    if t.data_type != INT64 || !t.external_data.is_empty() {
        return None;
    }
    tensor_from_proto(t.clone(), Path::new("")).ok().map(|d| d.to_i64s())
}

fn i64_tensor(name: &str, values: &[i64]) -> TensorProto {
    tensor_to_proto(name, &TensorData::from_i64s(vec![values.len() as i64], values))
}

fn set_dim0(vi: &mut ValueInfoProto, shape: &[Dim]) {
    let Some(type_proto::Value::TensorType(t)) = vi.type_.as_mut().and_then(|t| t.value.as_mut()) else { return };
    let Some(s) = t.shape.as_mut() else { return };
    for (d, ir) in s.dim.iter_mut().zip(shape) {
        match ir {
            Dim::Batch(1) => *d = Dimension { value: Some(dimension::Value::DimParam("N".into())), ..Default::default() },
            Dim::Batch(_) => *d = Dimension::default(),
            Dim::Fixed(_) => {}
        }
    }
}

/// Writes the source nodes the importer read as other nodes (so that they follow the
/// batch) as it read them, with the constants they add; returns how many.
fn apply_source_rewrites(g: &mut GraphProto, ir: &Graph) -> usize {
    let mut count = 0;
    for rw in &ir.source_rewrites {
        // Matched by a named output (an omitted one is an empty name many nodes share).
        let Some((slot, name)) = rw.node.output.iter().enumerate().find(|(_, o)| !o.is_empty()) else { continue };
        let Some(at) = g.node.iter().position(|n| n.output.get(slot) == Some(name)) else { continue };
        g.node[at] = rw.node.clone();
        g.node.splice(at..at, rw.before.iter().cloned());
        g.initializer.extend(rw.constants.iter().map(|(name, data)| tensor_to_proto(name, data)));
        count += 1;
    }
    count
}

/// Rewrites `Constant` nodes whose tensor repeats one slice over the export batch (token
/// type ids the TorchScript exporter folded) as initializers of the same name, so that the
/// rewrites of batch-baked initializers see them.
fn hoist_batch_constants(g: &mut GraphProto, b0: i64) {
    let mut hoisted = Vec::new();
    g.node.retain(|n| {
        let value = n.attribute.iter().find(|a| a.name == "value").and_then(|a| a.t.as_ref());
        let (true, Some(t), Some(name)) = (n.op_type == "Constant", value, n.output.first()) else { return true };
        if t.dims.len() < 2 || t.dims[0] != b0 || !t.external_data.is_empty() {
            return true;
        }
        let Ok(data) = tensor_from_proto(t.clone(), Path::new("")) else { return true };
        let proto = tensor_to_proto(name, &data);
        // Only one slice repeated: a constant whose leading extent merely equals the export
        // batch (MPT's ALiBi slopes for 2 heads) stays as it was.
        if !repeats_one_slice(&proto, b0) {
            return true;
        }
        hoisted.push(proto);
        false
    });
    g.initializer.extend(hoisted);
}

/// Whether `t`'s stored bytes are `b0` equal slices (data in the file, not external).
fn repeats_one_slice(t: &TensorProto, b0: i64) -> bool {
    let slice = t.raw_data.len() / b0 as usize;
    t.external_data.is_empty() && slice > 0 && t.raw_data.chunks(slice).all(|c| c == &t.raw_data[..slice])
}

/// Whether every node reading `x` broadcasts a leading extent of 1 back to the batch: an
/// element-wise op, or a Gather taking `x` as indices whose result only such ops read.
fn broadcast_safe(g: &GraphProto, x: &str) -> bool {
    let readers = |x: &str| g.node.iter().filter(|n| n.input.iter().any(|i| i == x)).collect::<Vec<_>>();
    let elementwise = |x: &str| readers(x).iter().all(|n| BROADCASTING.contains(&n.op_type.as_str()));
    let r = readers(x);
    !r.is_empty()
        && r.iter().all(|n| {
            BROADCASTING.contains(&n.op_type.as_str()) || (n.op_type == "Gather" && n.input.first().is_some_and(|d| d != x) && n.output.first().is_some_and(|o| elementwise(o)))
        })
}

/// Rewrites `g` (the source graph, with the trained weights written in) so that it takes
/// any batch, using `ir`, the importer's graph of the same source; see the module docs.
/// On [`Rebatched::Fixed`] and [`Rebatched::NoBatch`] `g` is left as it was.
pub fn dynamic_batch(g: &mut GraphProto, ir: &Graph) -> Rebatched {
    let Some(batch) = ir.batch.as_ref() else { return Rebatched::NoBatch };
    let b0 = batch.resolved_size();
    // The importer's frozen constants: only those can be batch-baked (a trainable weight
    // may well have the export batch as its first extent, e.g. 2 output channels).
    let frozen: std::collections::HashSet<&str> = ir.value_ids().filter(|&v| ir.value(v).weight().is_some_and(|w| !w.trainable)).map(|v| ir.value(v).name.as_str()).collect();
    let shapes: HashMap<&str, &[Dim]> = ir.value_ids().map(|v| (ir.value(v).name.as_str(), ir.value(v).ty.shape.0.as_slice())).collect();
    let mut out = g.clone();
    let rewritten = apply_source_rewrites(&mut out, ir);
    hoist_batch_constants(&mut out, b0);
    let fixed = |why: String| Rebatched::Fixed { batch: b0, why };
    let initializers: HashMap<String, usize> = out.initializer.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
    // A tensor by name: an initializer, or a Constant node's value.
    let constant = |g: &GraphProto, name: &str| -> Option<TensorProto> {
        if let Some(&i) = initializers.get(name) {
            return Some(g.initializer[i].clone());
        }
        g.node.iter().find(|n| n.op_type == "Constant" && n.output.first().is_some_and(|o| o == name)).and_then(|n| n.attribute.iter().find(|a| a.name == "value")).and_then(|a| a.t.as_ref().cloned())
    };

    let mut inputs = 0;
    for vi in out.input.iter_mut().filter(|i| !initializers.contains_key(&i.name)) {
        if let Some(shape) = shapes.get(vi.name.as_str()).filter(|s| s.first().is_some_and(|d| d.is_batch())) {
            set_dim0(vi, shape);
            inputs += 1;
        }
    }
    if inputs == 0 {
        return Rebatched::NoBatch;
    }
    for vi in out.output.iter_mut() {
        if let Some(shape) = shapes.get(vi.name.as_str()) {
            set_dim0(vi, shape);
        }
    }
    out.value_info.clear();

    let folded: HashMap<&str, Vec<i64>> = ir
        .value_ids()
        .filter_map(|v| ir.value(v).weight().filter(|w| !w.trainable && w.data.dtype == pipewright_ir::DType::I64).map(|w| (ir.value(v).name.as_str(), w.data.to_i64s())))
        .collect();
    let (mut reshapes, mut expands, mut sliced) = (0, 0, 0);
    let mut added: HashMap<Vec<i64>, String> = HashMap::new();
    let mut new_inits = Vec::new();
    for k in 0..out.node.len() {
        let node = &out.node[k];
        let (op, name) = (node.op_type.clone(), node.name.clone());
        if op != "Reshape" && op != "Expand" {
            continue;
        }
        let (Some(data), Some(target), Some(result)) = (node.input.first().cloned(), node.input.get(1).cloned(), node.output.first().cloned()) else { continue };
        // A target computed from constants in the source (a Concat of shape pieces) is one
        // the importer folded: its value is the importer's.
        // An Expand the importer folded whole (a float mask expanded from a constant) may
        // leave no value for its target: the result's extents are a target that expands
        // the operand the same way.
        let folded_result = || (op == "Expand").then(|| shapes.get(result.as_str())?.iter().map(|d| d.fixed()).collect::<Option<Vec<i64>>>()).flatten();
        let Some(values) = constant(&out, &target).as_ref().and_then(i64_values).or_else(|| folded.get(target.as_str()).cloned()).or_else(folded_result) else { continue };
        let Some(out_shape) = shapes.get(result.as_str()).filter(|s| s.iter().any(|d| d.is_batch())) else {
            // An Expand the importer folded or kept at fixed extents (a constant operand):
            // a leading export batch in its target becomes 1 where only broadcasting
            // readers see the result (a BERT's token type ids, expanded to the export
            // batch).
            if op == "Expand" && values.first() == Some(&b0) && b0 > 1 && broadcast_safe(&out, &result) {
                let mut v = values.clone();
                v[0] = 1;
                let fresh = added.entry(v.clone()).or_insert_with(|| format!("{target}:batch{}", new_inits.len())).clone();
                if !new_inits.iter().any(|t: &TensorProto| t.name == fresh) {
                    new_inits.push(i64_tensor(&fresh, &v));
                }
                out.node[k].input[1] = fresh;
                expands += 1;
            }
            continue;
        };
        let new: Vec<i64> = if op == "Reshape" {
            if out_shape.iter().filter(|d| d.is_batch()).count() != 1 {
                return fixed(format!("Reshape {name:?} has more than one batch extent in its output"));
            }
            out_shape.iter().map(|d| if d.is_batch() { -1 } else { d.fixed().unwrap_or(0) }).collect()
        } else {
            // Expand: `1` where the operand's own (right-aligned) extent is the batch.
            let Some(operand) = shapes.get(data.as_str()) else { continue };
            let offset = values.len().saturating_sub(operand.len());
            let mut v = values.clone();
            for (i, d) in out_shape.iter().enumerate().skip(offset) {
                if d.is_batch() {
                    if !operand[i - offset].is_batch() {
                        return fixed(format!("Expand {name:?} makes the batch axis from a constant"));
                    }
                    v[i] = 1;
                }
            }
            v
        };
        if new == values {
            continue;
        }
        let fresh = added.entry(new.clone()).or_insert_with(|| format!("{target}:batch{}", new_inits.len())).clone();
        if !new_inits.iter().any(|t: &TensorProto| t.name == fresh) {
            new_inits.push(i64_tensor(&fresh, &new));
        }
        out.node[k].input[1] = fresh;
        if op == "Reshape" {
            reshapes += 1;
        } else {
            expands += 1;
        }
    }

    // Batch-baked constants: the importer's (float, rank >= 3), and others of rank >= 2
    // whose slices are equal and whose readers broadcast (a boolean mask, position ids
    // read by a Gather).
    let trainable: std::collections::HashSet<&str> = ir.value_ids().filter(|&v| ir.value(v).weight().is_some_and(|w| w.trainable)).map(|v| ir.value(v).name.as_str()).collect();
    let mut inserts: Vec<(usize, Vec<NodeProto>)> = Vec::new();
    for i in 0..out.initializer.len() {
        let t = &out.initializer[i];
        if t.dims.len() < 2 || t.dims[0] != b0 || b0 <= 1 || trainable.contains(t.name.as_str()) {
            continue;
        }
        let baked = frozen.contains(t.name.as_str()) && t.dims.len() >= 3 && matches!(t.data_type, 1 | 10 | 11 | 16);
        let (name, dims) = (t.name.clone(), t.dims.clone());
        let readers: Vec<usize> = (0..out.node.len()).filter(|&k| out.node[k].input.contains(&name)).collect();
        if readers.is_empty() {
            continue;
        }
        if !repeats_one_slice(t, b0) {
            // Read where the batch meets it, it fixes the batch; read otherwise (a
            // convolution's weight with as many output channels as the export batch), it
            // has nothing to do with the batch.
            let meets_batch = readers.iter().any(|&k| BROADCASTING.contains(&out.node[k].op_type.as_str()) || out.node[k].op_type == "Concat");
            if baked && meets_batch {
                return fixed(format!("initializer {name:?} {dims:?} is baked for the export batch with slices that differ"));
            }
            continue;
        }
        // Every reader must broadcast the one slice back to the batch ([`broadcast_safe`]),
        // or be a Concat (below).
        let acceptable = readers.iter().any(|&k| out.node[k].op_type == "Concat") && readers.iter().all(|&k| out.node[k].op_type == "Concat") || broadcast_safe(&out, &name);
        if !acceptable {
            if baked {
                let n = readers.iter().map(|&k| &out.node[k]).find(|n| !BROADCASTING.contains(&n.op_type.as_str())).map(|n| format!("{} {:?}", n.op_type, n.name)).unwrap_or_default();
                return fixed(format!("initializer {name:?} {dims:?} is baked for the export batch and read by {n}"));
            }
            continue;
        }
        for &k in &readers {
            let n = &out.node[k];
            if n.op_type != "Concat" {
                continue;
            }
            // A Concat along another axis with a batched tensor (a class token): the one
            // slice expanded to that tensor's batch at run time.
            let axis = n.attribute.iter().find(|a| a.name == "axis").map_or(0, |a| a.i);
            let partner = n.input.iter().find(|x| shapes.get(x.as_str()).is_some_and(|s| s.first() == Some(&Dim::Batch(1))));
            let (true, Some(partner)) = (n.op_type == "Concat" && axis != 0 && axis != -(dims.len() as i64), partner.cloned()) else {
                return fixed(format!("initializer {name:?} {dims:?} is baked for the export batch and read by {} {:?}", n.op_type, n.name));
            };
            let p = format!("{name}:batch{k}");
            new_inits.push(i64_tensor(&format!("{p}:first"), &[0]));
            new_inits.push(i64_tensor(&format!("{p}:rest"), &dims[1..]));
            let node = |op: &str, suffix: &str, inputs: Vec<String>, attribute: Vec<AttributeProto>| NodeProto {
                name: format!("{p}:{suffix}"),
                op_type: op.into(),
                input: inputs,
                output: vec![format!("{p}:{suffix}")],
                attribute,
                ..Default::default()
            };
            let axis0 = |name: &str| AttributeProto { name: name.into(), i: 0, type_: protobuf::EnumOrUnknown::new(attribute_proto::AttributeType::INT), ..Default::default() };
            let nodes = vec![
                node("Shape", "shape", vec![partner], vec![]),
                node("Gather", "n", vec![format!("{p}:shape"), format!("{p}:first")], vec![axis0("axis")]),
                node("Concat", "target", vec![format!("{p}:n"), format!("{p}:rest")], vec![axis0("axis")]),
                node("Expand", "expand", vec![name.clone(), format!("{p}:target")], vec![]),
            ];
            for x in out.node[k].input.iter_mut().filter(|x| **x == name) {
                *x = format!("{p}:expand");
            }
            inserts.push((k, nodes));
        }
        let t = &mut out.initializer[i];
        let slice = t.raw_data.len() / b0 as usize;
        t.raw_data.truncate(slice);
        t.dims[0] = 1;
        sliced += 1;
    }
    // Later positions first, so the earlier ones stay where they were.
    inserts.sort_by_key(|(k, _)| std::cmp::Reverse(*k));
    for (k, nodes) in inserts {
        for (j, n) in nodes.into_iter().enumerate() {
            out.node.insert(k + j, n);
        }
    }
    // Targets no node reads any more (replaced above) would only be dead weight.
    let read: std::collections::HashSet<String> = out.node.iter().flat_map(|n| n.input.iter().cloned()).chain(out.output.iter().chain(&out.input).map(|o| o.name.clone())).collect();
    out.initializer.retain(|t| read.contains(&t.name) || !matches!(t.data_type, INT64));
    out.initializer.extend(new_inits);
    *g = out;
    Rebatched::Dynamic { inputs, reshapes, expands, sliced, rewritten }
}
