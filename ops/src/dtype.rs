//! Element types of tensors, with their ONNX codes and sizes.

use std::fmt;

/// An element type. The closed set the IR understands; ONNX types outside it
/// (strings, complex, 6-bit floats) are rejected at import with the value named.
///
/// The low-precision types (float8 variants, `f4e2m1`, `f8e8m0`, 4- and 2-bit integers)
/// are carried for `Cast`, `CastLike` and the quantization ops only; the importer rejects
/// any other op on them. `u4`/`i4`/`f4e2m1` pack two elements per byte and `u2`/`i2` four
/// (low bits first) in raw data, see [`DType::byte_len`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
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
    F8E4M3FN,
    F8E4M3FNUZ,
    F8E5M2,
    F8E5M2FNUZ,
    U4,
    I4,
    F4E2M1,
    F8E8M0,
    U2,
    I2,
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
            17 => DType::F8E4M3FN,
            18 => DType::F8E4M3FNUZ,
            19 => DType::F8E5M2,
            20 => DType::F8E5M2FNUZ,
            21 => DType::U4,
            22 => DType::I4,
            23 => DType::F4E2M1,
            24 => DType::F8E8M0,
            25 => DType::U2,
            26 => DType::I2,
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
            DType::F8E4M3FN => 17,
            DType::F8E4M3FNUZ => 18,
            DType::F8E5M2 => 19,
            DType::F8E5M2FNUZ => 20,
            DType::U4 => 21,
            DType::I4 => 22,
            DType::F4E2M1 => 23,
            DType::F8E8M0 => 24,
            DType::U2 => 25,
            DType::I2 => 26,
        }
    }

    /// Bytes per element, rounded up to one for the packed 4- and 2-bit types (a memory
    /// estimate; raw data lengths come from [`DType::byte_len`]).
    pub fn size(self) -> usize {
        self.bits().div_ceil(8)
    }

    /// Bits per element in raw data.
    pub fn bits(self) -> usize {
        match self {
            DType::U2 | DType::I2 => 2,
            DType::U4 | DType::I4 | DType::F4E2M1 => 4,
            _ => 8 * self.unpacked_size(),
        }
    }

    /// Bytes of raw data for `numel` elements: packed types round the last byte up.
    pub fn byte_len(self, numel: usize) -> Option<usize> {
        numel.checked_mul(self.bits()).map(|b| b.div_ceil(8))
    }

    /// Elements per byte in raw data: 2 for the 4-bit types, 4 for the 2-bit ones, else 1.
    pub fn per_byte(self) -> usize {
        8 / self.bits().min(8)
    }

    /// The type whose tensors hold this type's values exactly at run time: i8 for
    /// `i4`/`i2`, u8 for `u4`/`u2`, f32 for `f4e2m1`/`f8e8m0`; every other type holds itself.
    pub fn holder(self) -> DType {
        match self {
            DType::I4 | DType::I2 => DType::I8,
            DType::U4 | DType::U2 => DType::U8,
            DType::F4E2M1 | DType::F8E8M0 => DType::F32,
            t => t,
        }
    }

    /// The types QuantizeLinear produces and DequantizeLinear reads.
    pub fn is_quantized(self) -> bool {
        matches!(self, DType::U8 | DType::I8 | DType::U16 | DType::I16 | DType::I32) || (self.is_low_precision() && self != DType::F8E8M0)
    }

    /// The float8, float4 and 4/2-bit integer types, which only casts and the
    /// quantization ops handle.
    pub fn is_low_precision(self) -> bool {
        self.onnx_code() >= 17
    }

    fn unpacked_size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ | DType::F8E8M0 => 1,
            DType::U4 | DType::I4 | DType::F4E2M1 | DType::U2 | DType::I2 => 1,
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
            DType::F8E4M3FN => "f8e4m3fn",
            DType::F8E4M3FNUZ => "f8e4m3fnuz",
            DType::F8E5M2 => "f8e5m2",
            DType::F8E5M2FNUZ => "f8e5m2fnuz",
            DType::U4 => "u4",
            DType::I4 => "i4",
            DType::F4E2M1 => "f4e2m1",
            DType::F8E8M0 => "f8e8m0",
            DType::U2 => "u2",
            DType::I2 => "i2",
        }
    }

    /// Parses the short name printed by [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        ALL.iter().copied().find(|d| d.name() == name)
    }
}

const ALL: [DType; 23] = [
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
    DType::F8E4M3FN,
    DType::F8E4M3FNUZ,
    DType::F8E5M2,
    DType::F8E5M2FNUZ,
    DType::U4,
    DType::I4,
    DType::F4E2M1,
    DType::F8E8M0,
    DType::U2,
    DType::I2,
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
        27 => "float6e2m3".into(),
        28 => "float6e3m2".into(),
        other => DType::from_onnx(other).map(|d| d.name().to_string()).unwrap_or(format!("type code {other}")),
    }
}
