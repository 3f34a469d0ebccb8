//! Opsets before 7: the `broadcast`/`axis` attributes of the arithmetic ops and the
//! per-channel slope of PRelu, rewritten to numpy broadcasting.
//!
//! Before opset 7, `Add`, `Sub`, `Mul`, `Div`, `Pow` and `Gemm` broadcast their second
//! input only when `broadcast = 1`, aligning it with the first input's axes from `axis`
//! (by default the trailing axes, as numpy does). PRelu 6 and older apply a slope of one
//! value per channel (`[C]`) to the channel axis 1. The importer turns the cases numpy
//! would align differently into an `Unsqueeze` of the second input with trailing unit
//! axes, so every later stage sees only numpy broadcasting.

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::{AttributeProto, NodeProto};
use protobuf::EnumOrUnknown;

/// The ops whose definitions before opset 7 carry `broadcast` (and, except Gemm, `axis`).
const LEGACY_BROADCAST: &[&str] = &["Add", "Sub", "Mul", "Div", "Pow"];

/// The trailing axes to insert into input 1 of a node at schema `version` so that numpy
/// broadcasting gives the old semantics, given both inputs' ranks (and input 1's shape for
/// PRelu). `None` when numpy already agrees.
pub fn second_input_alignment(node: &NodeProto, version: i64, a_rank: usize, b_dims: &[Option<i64>]) -> Result<Option<Vec<i64>>, String> {
    if version >= 7 {
        return Ok(None);
    }
    let b_rank = b_dims.len();
    let trailing = |from_axis: usize| -> Option<Vec<i64>> {
        // Input 1 covers axes from_axis..from_axis + b_rank of input 0; the axes after
        // that become unit axes at the end of input 1.
        let missing = a_rank.saturating_sub(from_axis + b_rank);
        (missing > 0).then(|| (b_rank..b_rank + missing).map(|x| x as i64).collect())
    };
    if node.op_type == "PRelu" {
        // A slope of one value per channel: [C] against [N, C, ...].
        let per_channel = b_rank == 1 && a_rank >= 3 && b_dims[0] != Some(1);
        return Ok(if per_channel { trailing(1) } else { None });
    }
    if !LEGACY_BROADCAST.contains(&node.op_type.as_str()) {
        return Ok(None);
    }
    let int_attr = |name: &str| node.attribute.iter().find(|a| a.name == name).map(|a| a.i);
    if int_attr("broadcast").unwrap_or(0) == 0 {
        // No broadcast: the shapes must be equal, which numpy handles alike (and shape
        // inference reports when they are not broadcastable at all).
        return Ok(None);
    }
    match int_attr("axis") {
        None => Ok(None),
        Some(axis) => {
            let r = a_rank as i64;
            let from = if axis < 0 { axis + r } else { axis };
            if from < 0 || from + b_rank as i64 > r {
                return Err(format!("broadcast axis {axis} does not fit input 1 of rank {b_rank} into input 0 of rank {a_rank}"));
            }
            Ok(trailing(from as usize))
        }
    }
}

/// The `Unsqueeze` (opset 1 form: `axes` as an attribute) that inserts `axes` into `input`.
pub fn unsqueeze_node(name: String, input: String, output: String, axes: Vec<i64>) -> NodeProto {
    let attr = AttributeProto { name: "axes".into(), ints: axes, type_: EnumOrUnknown::new(AttributeType::INTS), ..Default::default() };
    NodeProto { name, op_type: "Unsqueeze".into(), input: vec![input], output: vec![output], attribute: vec![attr], ..Default::default() }
}
