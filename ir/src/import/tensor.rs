//! `TensorProto` to [`TensorData`] (typed fields, raw bytes and external data files), and
//! back ([`tensor_to_proto`], raw bytes).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path};

use bytes::Bytes;
use onnx_protobuf::tensor_proto::DataLocation;
use onnx_protobuf::TensorProto;

use pipewright_ops::dtype::onnx_type_name;
use crate::error::ImportError;
use crate::{DType, TensorData};

/// `t` as a `TensorProto` named `name`, its bytes as `raw_data`.
pub fn tensor_to_proto(name: &str, t: &TensorData) -> TensorProto {
    TensorProto { name: name.into(), dims: t.dims.clone(), data_type: t.dtype.onnx_code(), raw_data: t.bytes.to_vec(), ..Default::default() }
}

/// Converts a tensor, reading external data relative to `model_dir`. Takes the proto by
/// value so raw bytes move into the result without a copy.
pub fn tensor_from_proto(mut t: TensorProto, model_dir: &Path) -> Result<TensorData, ImportError> {
    let name = t.name.clone();
    let bad = |reason: String| ImportError::BadTensor { name: name.clone(), reason };
    let dtype = DType::from_onnx(t.data_type)
        .ok_or_else(|| bad(format!("element type {} is not supported", onnx_type_name(t.data_type))))?;
    if t.segment.is_some() {
        return Err(bad("segmented tensors are not supported".into()));
    }
    if let Some(d) = t.dims.iter().find(|&&d| d < 0) {
        return Err(bad(format!("negative dimension {d}")));
    }
    let dims = t.dims.clone();
    let numel = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d as usize)).ok_or_else(|| bad("element count overflows".into()))?;
    let expected = dtype.byte_len(numel).ok_or_else(|| bad("byte size overflows".into()))?;
    let bytes = if t.data_location.enum_value() == Ok(DataLocation::EXTERNAL) {
        read_external(&t, model_dir, expected)?
    } else if !t.raw_data.is_empty() || numel == 0 {
        Bytes::from(std::mem::take(&mut t.raw_data))
    } else {
        typed_field_bytes(&t, dtype)
    };
    let got = bytes.len();
    TensorData::new(dtype, dims, bytes)
        .ok_or_else(|| bad(format!("holds {got} bytes of data, but its shape and type need {expected}")))
}

/// Under [`super::ImportOptions::shapes_only`]: an external-data tensor of floats (weights,
/// whose values no shape depends on), or of more elements than import evaluates
/// ([`crate::known::KNOWN_LIMIT`]), becomes a [`TensorData::shape_only`] without its file
/// being opened; its `external_data` entries must still name a location. Small integer
/// tensors (shape arithmetic) are still read. `None`: the tensor is read as usual.
pub(crate) fn external_shape_only(t: &TensorProto) -> Option<Result<TensorData, ImportError>> {
    if t.data_location.enum_value() != Ok(DataLocation::EXTERNAL) || t.dims.iter().any(|&d| d < 0) {
        return None;
    }
    let numel = t.dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))?;
    let dtype = DType::from_onnx(t.data_type)?;
    if numel <= crate::known::KNOWN_LIMIT && !dtype.is_float() {
        return None;
    }
    if !t.external_data.iter().any(|kv| kv.key == "location" && !kv.value.is_empty()) {
        return Some(Err(ImportError::BadTensor { name: t.name.clone(), reason: "external data without a location".into() }));
    }
    Some(Ok(TensorData::shape_only(dtype, t.dims.clone())))
}

/// Encodes the typed repeated field that carries this dtype's data.
fn typed_field_bytes(t: &TensorProto, dtype: DType) -> Bytes {
    let mut out = Vec::new();
    match dtype {
        DType::F32 => t.float_data.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::F64 => t.double_data.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::I64 => t.int64_data.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::U32 => t.uint64_data.iter().for_each(|v| out.extend((*v as u32).to_le_bytes())),
        DType::U64 => t.uint64_data.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::I32 => t.int32_data.iter().for_each(|v| out.extend(v.to_le_bytes())),
        // The narrow types are stored one element per int32, bit patterns for the halves.
        DType::I16 => t.int32_data.iter().for_each(|v| out.extend((*v as i16).to_le_bytes())),
        DType::U16 | DType::F16 | DType::Bf16 => t.int32_data.iter().for_each(|v| out.extend((*v as u16).to_le_bytes())),
        DType::I8 => t.int32_data.iter().for_each(|v| out.push(*v as i8 as u8)),
        DType::U8 | DType::Bool => t.int32_data.iter().for_each(|v| out.push(*v as u8)),
        // One byte of raw data per int32: a float8 code, or two 4-bit / four 2-bit elements.
        DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ | DType::F8E8M0 | DType::U4 | DType::I4
        | DType::F4E2M1 | DType::U2 | DType::I2 => t.int32_data.iter().for_each(|v| out.push(*v as u8)),
    }
    Bytes::from(out)
}

pub(crate) fn read_external(t: &TensorProto, model_dir: &Path, expected: usize) -> Result<Bytes, ImportError> {
    read_external_prefix(t, model_dir, expected, usize::MAX)
}

/// The first `limit` bytes (at most) of `t`'s external data, checked as [`read_external`]
/// checks the whole: a caller that may decide from a prefix need not read a large weight.
pub(crate) fn read_external_prefix(t: &TensorProto, model_dir: &Path, expected: usize, limit: usize) -> Result<Bytes, ImportError> {
    let name = t.name.clone();
    let bad = |reason: String| ImportError::BadTensor { name: name.clone(), reason };
    let mut location = None;
    let mut offset = 0u64;
    let mut length = None;
    for kv in &t.external_data {
        match kv.key.as_str() {
            "location" => location = Some(kv.value.clone()),
            "offset" => offset = kv.value.parse().map_err(|_| bad(format!("external data offset {:?} is not a number", kv.value)))?,
            "length" => length = Some(kv.value.parse::<u64>().map_err(|_| bad(format!("external data length {:?} is not a number", kv.value)))?),
            _ => {}
        }
    }
    let location = location.ok_or_else(|| bad("external data without a location".into()))?;
    let rel = Path::new(&location);
    let escapes = rel.is_absolute() || rel.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir));
    if escapes || location.is_empty() {
        return Err(ImportError::ExternalEscape { name, location });
    }
    let path = model_dir.join(rel);
    let missing = |source| ImportError::ExternalMissing { name: t.name.clone(), path: path.clone(), source };
    // A symlink inside the folder may still point outside it.
    let real = path.canonicalize().map_err(missing)?;
    let real_dir = model_dir.canonicalize().map_err(missing)?;
    if !real.starts_with(&real_dir) {
        return Err(ImportError::ExternalEscape { name: t.name.clone(), location });
    }
    let length = length.unwrap_or(expected as u64);
    if length != expected as u64 {
        return Err(bad(format!("external data length {length} does not match the {expected} bytes its shape and type need")));
    }
    // Checked before opening: opening a FIFO for reading blocks until a writer comes,
    // and a device can be read forever.
    let kind = std::fs::metadata(&real).map_err(missing)?.file_type();
    if !kind.is_file() {
        return Err(bad(format!("external data {location:?} is not a regular file (a folder, FIFO, socket or device); refused without reading it")));
    }
    let mut file = std::fs::File::open(&real).map_err(missing)?;
    let size = file.metadata().map_err(missing)?.len();
    if offset.checked_add(length).is_none_or(|end| end > size) {
        return Err(bad(format!(
            "external data {location:?} holds {size} bytes, too few for offset {offset} + length {length}"
        )));
    }
    file.seek(SeekFrom::Start(offset)).map_err(missing)?;
    let mut buf = vec![0u8; (length as usize).min(limit)];
    file.read_exact(&mut buf).map_err(missing)?;
    Ok(Bytes::from(buf))
}
