//! Typed reading of a node's attributes, rejecting ones the op's definition lacks; and
//! the ONNX form of the IR's attribute table ([`attribute_proto`]).

use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::AttributeProto;
use protobuf::{EnumOrUnknown, MessageField};

use pipewright_ops::op::AttrValue;

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

    /// Marks attributes that exist only as hints (e.g. `consumed_inputs`) as understood.
    pub fn ignore(&mut self, name: &str) {
        let _ = self.find(name);
    }

    pub fn int(&mut self, name: &str) -> Result<Option<i64>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if Self::kind(a) == Some(AttributeType::INT) || (Self::kind(a) == Some(AttributeType::UNDEFINED) && a.ints.is_empty()) => Ok(Some(a.i)),
            Some(_) => Err(format!("attribute {name:?} must be an integer")),
        }
    }

    pub fn int_or(&mut self, name: &str, default: i64) -> Result<i64, String> {
        Ok(self.int(name)?.unwrap_or(default))
    }

    pub fn bool_or(&mut self, name: &str, default: bool) -> Result<bool, String> {
        Ok(self.int(name)?.map(|v| v != 0).unwrap_or(default))
    }

    pub fn float(&mut self, name: &str) -> Result<Option<f32>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if Self::kind(a) == Some(AttributeType::FLOAT) || Self::kind(a) == Some(AttributeType::UNDEFINED) => Ok(Some(a.f)),
            // Some exporters write integral values of float attributes as INT.
            Some(a) if Self::kind(a) == Some(AttributeType::INT) => Ok(Some(a.i as f32)),
            Some(_) => Err(format!("attribute {name:?} must be a float")),
        }
    }

    pub fn float_or(&mut self, name: &str, default: f32) -> Result<f32, String> {
        Ok(self.float(name)?.unwrap_or(default))
    }

    pub fn ints(&mut self, name: &str) -> Result<Option<Vec<i64>>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if matches!(Self::kind(a), Some(AttributeType::INTS) | Some(AttributeType::UNDEFINED)) => Ok(Some(a.ints.clone())),
            Some(_) => Err(format!("attribute {name:?} must be a list of integers")),
        }
    }

    pub fn ints_or_empty(&mut self, name: &str) -> Result<Vec<i64>, String> {
        Ok(self.ints(name)?.unwrap_or_default())
    }

    pub fn string(&mut self, name: &str) -> Result<Option<String>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if matches!(Self::kind(a), Some(AttributeType::STRING) | Some(AttributeType::UNDEFINED)) => {
                String::from_utf8(a.s.clone()).map(Some).map_err(|_| format!("attribute {name:?} is not UTF-8"))
            }
            Some(_) => Err(format!("attribute {name:?} must be a string")),
        }
    }

    pub fn strings(&mut self, name: &str) -> Result<Option<Vec<String>>, String> {
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

    pub fn tensor(&mut self, name: &str) -> Result<Option<onnx_protobuf::TensorProto>, String> {
        match self.find(name) {
            None => Ok(None),
            Some(a) if a.t.is_some() => Ok(a.t.as_ref().cloned()),
            Some(_) => Err(format!("attribute {name:?} must be a tensor")),
        }
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
