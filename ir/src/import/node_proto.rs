//! The ONNX nodes the importer writes for its own readings of a source node (the dense
//! readings, the batch rewrites): built here, then imported like any node of the model.

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
