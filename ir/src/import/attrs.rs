//! A node's `AttributeProto`s as the op readers' [`AttrSource`] (rejecting attributes the
//! op's definition lacks), [`convert_node`] (one node to one op), and the ONNX form of
//! the IR's attribute table ([`attribute_proto`]).

use std::path::Path;

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::{AttributeProto, NodeProto};
use protobuf::{EnumOrUnknown, MessageField};
use pipewright_ops::op::{AttrValue, Op};
use pipewright_ops::onnx::{read_op, AttrSource};
use pipewright_ops::TensorData;

use super::tensor::tensor_from_proto;

/// Converts a (non-Constant) node whose schema version at the model's opset is `version`.
pub fn convert_node(node: &NodeProto, version: i64) -> Result<Op, String> {
    let mut a = Attrs::new(&node.attribute);
    // The v1 in-place hint carries no semantics.
    a.ignore("consumed_inputs");
    let op = read_op(&node.op_type, version, &mut a, node.input.len())?;
    a.finish()?;
    Ok(op)
}

/// The ONNX form of one attribute of `Op::attributes` (the table the text form shares).
pub fn attribute_proto(name: &str, value: &AttrValue) -> AttributeProto {
    let attr = |kind: AttributeType| AttributeProto { name: name.into(), type_: EnumOrUnknown::new(kind), ..Default::default() };
    match value {
        AttrValue::Int(v) => AttributeProto { i: *v, ..attr(AttributeType::INT) },
        AttrValue::Float(v) => AttributeProto { f: *v, ..attr(AttributeType::FLOAT) },
        AttrValue::Str(v) => AttributeProto { s: v.as_bytes().to_vec(), ..attr(AttributeType::STRING) },
        AttrValue::Ints(v) => AttributeProto { ints: v.clone(), ..attr(AttributeType::INTS) },
        AttrValue::DType(d) => AttributeProto { i: i64::from(d.onnx_code()), ..attr(AttributeType::INT) },
        AttrValue::Tensor(t) => AttributeProto { t: MessageField::some(super::tensor::tensor_to_proto("", t)), ..attr(AttributeType::TENSOR) },
    }
}

/// A node's attributes. Each getter marks the attribute as understood; [`Attrs::finish`]
/// then reports any attribute no getter asked for, so an attribute whose meaning the
/// importer does not implement is an error rather than silently ignored.
pub struct Attrs<'a> {
    list: &'a [AttributeProto],
    used: Vec<bool>,
}

impl<'a> Attrs<'a> {
    pub fn new(list: &'a [AttributeProto]) -> Attrs<'a> {
        Attrs { list, used: vec![false; list.len()] }
    }

    fn find(&mut self, name: &str) -> Option<&'a AttributeProto> {
        let i = self.list.iter().position(|a| a.name == name)?;
        self.used[i] = true;
        Some(&self.list[i])
    }

    fn kind(a: &AttributeProto) -> Option<AttributeType> {
        a.type_.enum_value().ok()
    }

    /// A subgraph attribute (If's branches, Loop's and Scan's body).
    pub fn graph(&mut self, name: &str) -> Result<Option<&'a onnx_protobuf::GraphProto>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if a.g.is_some() => Ok(a.g.as_ref()),
            Some(_) => Err(format!("attribute {name:?} must be a graph")),
        }
    }

    /// Fails on the first attribute no getter consumed.
    pub fn finish(self) -> Result<(), String> {
        match self.list.iter().zip(&self.used).find(|(_, used)| !**used) {
            None => Ok(()),
            Some((a, _)) => Err(format!("attribute {:?} is not supported", a.name)),
        }
    }
}

impl AttrSource for Attrs<'_> {
    /// Marks attributes that exist only as hints (e.g. `consumed_inputs`) as understood.
    fn ignore(&mut self, name: &str) {
        let _ = self.find(name);
    }

    fn int(&mut self, name: &str) -> Result<Option<i64>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if Self::kind(a) == Some(AttributeType::INT) || (Self::kind(a) == Some(AttributeType::UNDEFINED) && a.ints.is_empty()) => Ok(Some(a.i)),
            Some(_) => Err(format!("attribute {name:?} must be an integer")),
        }
    }

    fn float(&mut self, name: &str) -> Result<Option<f32>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if Self::kind(a) == Some(AttributeType::FLOAT) || Self::kind(a) == Some(AttributeType::UNDEFINED) => Ok(Some(a.f)),
            // Some exporters write integral values of float attributes as INT.
            Some(a) if Self::kind(a) == Some(AttributeType::INT) => Ok(Some(a.i as f32)),
            Some(_) => Err(format!("attribute {name:?} must be a float")),
        }
    }

    fn ints(&mut self, name: &str) -> Result<Option<Vec<i64>>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if matches!(Self::kind(a), Some(AttributeType::INTS) | Some(AttributeType::UNDEFINED)) => Ok(Some(a.ints.clone())),
            Some(_) => Err(format!("attribute {name:?} must be a list of integers")),
        }
    }

    fn string(&mut self, name: &str) -> Result<Option<String>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if matches!(Self::kind(a), Some(AttributeType::STRING) | Some(AttributeType::UNDEFINED)) => {
                String::from_utf8(a.s.clone()).map(Some).map_err(|_| format!("attribute {name:?} is not UTF-8"))
            }
            Some(_) => Err(format!("attribute {name:?} must be a string")),
        }
    }

    fn strings(&mut self, name: &str) -> Result<Option<Vec<String>>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if matches!(Self::kind(a), Some(AttributeType::STRINGS) | Some(AttributeType::UNDEFINED)) => a
                .strings
                .iter()
                .map(|s| String::from_utf8(s.clone()).map_err(|_| format!("attribute {name:?} is not UTF-8")))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(format!("attribute {name:?} must be a list of strings")),
        }
    }

    fn tensor(&mut self, name: &str) -> Result<Option<TensorData>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) => match a.t.as_ref() {
                Some(t) => tensor_from_proto(t.clone(), Path::new(".")).map(Some).map_err(|e| format!("attribute {name:?}: {e}")),
                None => Err(format!("attribute {name:?} must be a tensor")),
            },
        }
    }
}
