//! Element types of tensors, with their ONNX codes and sizes.

use std::fmt;

/// An element type. The closed set the IR understands; ONNX types outside it
/// (strings, complex, 4/8-bit floats) are rejected at import with the value named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
    F64,
    I64,
    I32,
    I16,
    I8,
    U8,
    U16,
    U32,
    U64,
    Bool,
}

impl DType {
    /// Maps an ONNX `TensorProto.DataType` code; `None` for types the IR does not carry.
    pub fn from_onnx(code: i32) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::U8,
            3 => DType::I8,
            4 => DType::U16,
            5 => DType::I16,
            6 => DType::I32,
            7 => DType::I64,
            9 => DType::Bool,
            10 => DType::F16,
            11 => DType::F64,
            12 => DType::U32,
            13 => DType::U64,
            16 => DType::Bf16,
            _ => return None,
        })
    }

    /// The ONNX `TensorProto.DataType` code.
    pub fn onnx_code(self) -> i32 {
        match self {
            DType::F32 => 1,
            DType::U8 => 2,
            DType::I8 => 3,
            DType::U16 => 4,
            DType::I16 => 5,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::Bool => 9,
            DType::F16 => 10,
            DType::F64 => 11,
            DType::U32 => 12,
            DType::U64 => 13,
            DType::Bf16 => 16,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::F16 | DType::Bf16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::Bf16 | DType::F64)
    }

    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::I64 | DType::I32 | DType::I16 | DType::I8 | DType::U8 | DType::U16 | DType::U32 | DType::U64
        )
    }

    /// The short name used in the text form (`f32`, `i64`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
        }
    }

    /// Parses the short name printed by [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        ALL.iter().copied().find(|d| d.name() == name)
    }
}

const ALL: [DType; 13] = [
    DType::F32,
    DType::F16,
    DType::Bf16,
    DType::F64,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::Bool,
];

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A human-readable name for an ONNX data-type code, including the ones the IR rejects.
pub fn onnx_type_name(code: i32) -> String {
    match code {
        0 => "undefined".into(),
        8 => "string".into(),
        14 => "complex64".into(),
        15 => "complex128".into(),
        17..=20 => "float8".into(),
        21 => "uint4".into(),
        22 => "int4".into(),
        23 => "float4e2m1".into(),
        other => DType::from_onnx(other).map(|d| d.name().to_string()).unwrap_or(format!("type code {other}")),
    }
}
