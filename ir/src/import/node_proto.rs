//! The ONNX nodes the importer writes for its own readings of a source node (the dense
//! readings, the batch rewrites, a batch-baked initializer trained as one slice): built
//! here, then imported like any node of the model.

use onnx_protobuf::NodeProto;
use pipewright_ops::op::AttrValue;

use super::attrs::attribute_proto;
use crate::{DType, TensorData};

/// A node of `op_type` without attributes.
pub(super) fn plain(name: &str, op_type: &str, inputs: &[&str], output: &str) -> NodeProto {
    NodeProto { name: name.into(), op_type: op_type.into(), input: inputs.iter().map(|s| s.to_string()).collect(), output: vec![output.into()], ..Default::default() }
}

/// A `Concat` of `inputs` along axis 0 (of shape vectors, or of coordinates).
pub(super) fn concat0(name: &str, inputs: &[&str], output: &str) -> NodeProto {
    let mut n = plain(name, "Concat", inputs, output);
    n.attribute.push(attribute_proto("axis", &AttrValue::Int(0)));
    n
}

/// `ConstantOfShape(shape)` with every element `value` of `dtype`, its output named after it.
pub(super) fn filled(name: &str, shape: &str, dtype: DType, value: f64) -> NodeProto {
    let mut n = plain(name, "ConstantOfShape", &[shape], name);
    n.attribute.push(attribute_proto("value", &AttrValue::Tensor(TensorData::from_f64s(dtype, vec![1], &[value]))));
    n
}

/// The nodes writing `shape`, the vector `[batch, rest...]` whose `batch` is the leading
/// element of the shape vector `leading_of` (a Reshape target that follows the batch, or
/// `Shape` of a batch-carrying input), with the constants they read, named from `prefix`:
/// how a value fixed at the export batch is expanded to the batch at run time.
pub(super) fn batch_led_shape(prefix: &str, leading_of: &str, rest: &[i64], shape: &str) -> (Vec<(String, TensorData)>, Vec<NodeProto>) {
    batch_groups_led_shape(prefix, leading_of, 1, rest, shape)
}

/// [`batch_led_shape`] led by `groups` times the batch (`groups` rows per sample).
pub(super) fn batch_groups_led_shape(prefix: &str, leading_of: &str, groups: i64, rest: &[i64], shape: &str) -> (Vec<(String, TensorData)>, Vec<NodeProto>) {
    let at = |what: &str| format!("{prefix}/{what}");
    let mut constants = vec![
        (at("zero"), TensorData::from_i64s(vec![1], &[0])),
        (at("one"), TensorData::from_i64s(vec![1], &[1])),
        (at("rest"), TensorData::from_i64s(vec![rest.len() as i64], rest)),
    ];
    let mut nodes = vec![plain(&at("batch"), "Slice", &[leading_of, &at("zero"), &at("one"), &at("zero")], &at("batch"))];
    let mut leading = at("batch");
    if groups != 1 {
        constants.push((at("groups"), TensorData::from_i64s(vec![1], &[groups])));
        nodes.push(plain(&at("rows"), "Mul", &[&at("batch"), &at("groups")], &at("rows")));
        leading = at("rows");
    }
    nodes.push(concat0(shape, &[&leading, &at("rest")], shape));
    (constants, nodes)
}
