//! Tensor contents kept as raw little-endian bytes.
//!
//! Weights are never converted: the bytes read from the model are shared (`Bytes` is
//! reference-counted) by every pass and by codegen, so no pass copies a weight.

use bytes::Bytes;

use crate::{lowp, DType};

/// A dense tensor: element type, extents and raw little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    pub dtype: DType,
    pub dims: Vec<i64>,
    pub bytes: Bytes,
}

impl TensorData {
    /// Wraps bytes; `None` if their length does not match `dims` and `dtype`.
    pub fn new(dtype: DType, dims: Vec<i64>, bytes: Bytes) -> Option<TensorData> {
        let numel: i64 = dims.iter().product();
        (numel >= 0 && dtype.byte_len(numel as usize) == Some(bytes.len())).then_some(TensorData { dtype, dims, bytes })
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().product::<i64>() as usize
    }

    /// The bytes its shape and type need, whether or not they were read (see
    /// [`TensorData::shape_only`]).
    pub fn byte_len(&self) -> usize {
        self.dtype.byte_len(self.numel()).unwrap_or(0)
    }

    /// A weight whose values were left in its external data file (`ImportOptions::
    /// shapes_only`): its type and extents are known, its bytes are empty. Only analyses
    /// that need no values (the cost model, the planner, the simulator) may see one.
    pub fn shape_only(dtype: DType, dims: Vec<i64>) -> TensorData {
        TensorData { dtype, dims, bytes: Bytes::new() }
    }

    /// Whether the values were left unread ([`TensorData::shape_only`]).
    pub fn is_shape_only(&self) -> bool {
        self.bytes.is_empty() && self.byte_len() > 0
    }

    /// The tensor with its axes permuted as ONNX `Transpose(perm)` does (output axis `i` is
    /// input axis `perm[i]`); `None` for a permutation of the wrong rank, a sub-byte element
    /// type or values not read.
    pub fn permuted(&self, perm: &[usize]) -> Option<TensorData> {
        let rank = self.dims.len();
        let mut seen = vec![false; rank];
        if perm.len() != rank || perm.iter().any(|&p| p >= rank || std::mem::replace(&mut seen[p], true)) || self.dtype.bits() < 8 || self.is_shape_only() {
            return None;
        }
        let size = self.dtype.size();
        let dims: Vec<usize> = self.dims.iter().map(|&d| d as usize).collect();
        let mut strides = vec![1usize; rank];
        for a in (0..rank.saturating_sub(1)).rev() {
            strides[a] = strides[a + 1] * dims[a + 1];
        }
        let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        let out_strides: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
        let mut out = Vec::with_capacity(self.bytes.len());
        let mut index = vec![0usize; rank];
        for _ in 0..self.numel() {
            let at: usize = index.iter().zip(&out_strides).map(|(i, s)| i * s).sum::<usize>() * size;
            out.extend_from_slice(&self.bytes[at..at + size]);
            // The next output index, last axis fastest.
            for a in (0..rank).rev() {
                index[a] += 1;
                if index[a] < out_dims[a] {
                    break;
                }
                index[a] = 0;
            }
        }
        Some(TensorData { dtype: self.dtype, dims: out_dims.iter().map(|&d| d as i64).collect(), bytes: Bytes::from(out) })
    }

    pub fn from_i64s(dims: Vec<i64>, values: &[i64]) -> TensorData {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorData { dtype: DType::I64, dims, bytes: Bytes::from(bytes) }
    }

    /// Builds a tensor of `dtype` from f64 values (rounding/truncating as a cast would).
    pub fn from_f64s(dtype: DType, dims: Vec<i64>, values: &[f64]) -> TensorData {
        if dtype.is_low_precision() {
            let codes: Vec<u8> = values.iter().map(|&v| lowp::encode(dtype, v)).collect();
            return TensorData { dtype, dims, bytes: Bytes::from(lowp::pack(dtype, &codes)) };
        }
        let mut out = Vec::with_capacity(values.len() * dtype.size());
        for &v in values {
            encode_f64(dtype, v, &mut out);
        }
        TensorData { dtype, dims, bytes: Bytes::from(out) }
    }

    /// Elements as i64 (integer and bool types exactly; floats truncated).
    pub fn to_i64s(&self) -> Vec<i64> {
        (0..self.numel()).map(|i| self.get_f64_or_i64(i).1).collect()
    }

    /// Element `i` (row-major) as f64, without decoding the others.
    pub fn f64_at(&self, i: usize) -> f64 {
        self.get_f64_or_i64(i).0
    }

    /// Elements as f64.
    pub fn to_f64s(&self) -> Vec<f64> {
        (0..self.numel()).map(|i| self.get_f64_or_i64(i).0).collect()
    }

    fn get_f64_or_i64(&self, i: usize) -> (f64, i64) {
        if self.dtype.is_low_precision() {
            let v = lowp::decode(self.dtype, lowp::code_at(self.dtype, &self.bytes, i));
            return (v, v as i64);
        }
        let s = self.dtype.size();
        let b = &self.bytes[i * s..(i + 1) * s];
        macro_rules! int {
            ($t:ty) => {{
                let v = <$t>::from_le_bytes(b.try_into().expect("element width"));
                (v as f64, v as i64)
            }};
        }
        match self.dtype {
            DType::I64 => int!(i64),
            DType::I32 => int!(i32),
            DType::I16 => int!(i16),
            DType::I8 => int!(i8),
            DType::U8 => int!(u8),
            DType::U16 => int!(u16),
            DType::U32 => int!(u32),
            DType::U64 => int!(u64),
            DType::Bool => ((b[0] != 0) as i64 as f64, (b[0] != 0) as i64),
            DType::F32 => {
                let v = f32::from_le_bytes(b.try_into().expect("element width")) as f64;
                (v, v as i64)
            }
            DType::F64 => {
                let v = f64::from_le_bytes(b.try_into().expect("element width"));
                (v, v as i64)
            }
            DType::F16 => {
                let v = half::f16::from_le_bytes(b.try_into().expect("element width")).to_f64();
                (v, v as i64)
            }
            DType::Bf16 => {
                let v = half::bf16::from_le_bytes(b.try_into().expect("element width")).to_f64();
                (v, v as i64)
            }
            // Decoded above; listed so that a new type must choose its decoding.
            DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ | DType::F8E8M0 | DType::U4 | DType::I4
            | DType::F4E2M1 | DType::U2 | DType::I2 => (f64::NAN, 0),
        }
    }
}

/// Appends `v` encoded as `dtype` to `out`. Low-precision types append one code per byte:
/// the packed 4- and 2-bit types still need [`lowp::pack`].
pub fn encode_f64(dtype: DType, v: f64, out: &mut Vec<u8>) {
    if dtype.is_low_precision() {
        out.push(lowp::encode(dtype, v));
        return;
    }
    match dtype {
        DType::F32 => out.extend((v as f32).to_le_bytes()),
        DType::F64 => out.extend(v.to_le_bytes()),
        DType::F16 => out.extend(half::f16::from_f64(v).to_le_bytes()),
        DType::Bf16 => out.extend(half::bf16::from_f64(v).to_le_bytes()),
        DType::I64 => out.extend((v as i64).to_le_bytes()),
        DType::I32 => out.extend((v as i32).to_le_bytes()),
        DType::I16 => out.extend((v as i16).to_le_bytes()),
        DType::I8 => out.extend((v as i8).to_le_bytes()),
        DType::U8 => out.extend((v as u8).to_le_bytes()),
        DType::U16 => out.extend((v as u16).to_le_bytes()),
        DType::U32 => out.extend((v as u32).to_le_bytes()),
        DType::U64 => out.extend((v as u64).to_le_bytes()),
        DType::Bool => out.push((v != 0.0) as u8),
        DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ | DType::F8E8M0 | DType::U4 | DType::I4
        | DType::F4E2M1 | DType::U2 | DType::I2 => {}
    }
}

/// The serialised form of a [`TensorData`] (an op's attribute tensor in a stage module):
/// its type, extents and bytes in hex, which keeps every value exact (an `i64` beyond
/// 2^53 or a NaN payload survives where a list of numbers would not).
#[derive(serde::Serialize, serde::Deserialize)]
struct TensorForm {
    dtype: DType,
    dims: Vec<i64>,
    hex: String,
}

impl serde::Serialize for TensorData {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let hex = self.bytes.iter().map(|b| format!("{b:02x}")).collect();
        TensorForm { dtype: self.dtype, dims: self.dims.clone(), hex }.serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for TensorData {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TensorData, D::Error> {
        use serde::de::Error;
        let form = TensorForm::deserialize(d)?;
        let bytes = hex_bytes(&form.hex).ok_or_else(|| D::Error::custom("tensor bytes are not an even number of hex digits"))?;
        TensorData::new(form.dtype, form.dims, Bytes::from(bytes)).ok_or_else(|| D::Error::custom("tensor bytes do not match its type and extents"))
    }
}

fn hex_bytes(hex: &str) -> Option<Vec<u8>> {
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permuted_moves_axes_as_transpose_does() {
        // [2, 3] -> [3, 2]: element (i, j) lands at (j, i).
        let t = TensorData::from_i64s(vec![2, 3], &[0, 1, 2, 10, 11, 12]);
        assert_eq!(t.permuted(&[1, 0]), Some(TensorData::from_i64s(vec![3, 2], &[0, 10, 1, 11, 2, 12])));
        // [2, 1, 3] -> perm [2, 0, 1]: output (k, i, j) is input (i, j, k).
        let t = TensorData::from_i64s(vec![2, 1, 3], &[0, 1, 2, 10, 11, 12]);
        assert_eq!(t.permuted(&[2, 0, 1]), Some(TensorData::from_i64s(vec![3, 2, 1], &[0, 10, 1, 11, 2, 12])));
        assert_eq!(t.permuted(&[0, 1, 2]), Some(t.clone()));
        assert_eq!(t.permuted(&[0, 0, 1]), None, "not a permutation");
        assert_eq!(t.permuted(&[1, 0]), None, "wrong rank");
    }

    /// An attribute tensor survives serialisation bit for bit, extreme integers included.
    #[test]
    fn serde_keeps_every_value() {
        let t = TensorData::from_i64s(vec![2], &[i64::MAX, -7]);
        let json = serde_json::to_string(&t).expect("serialises");
        assert_eq!(serde_json::from_str::<TensorData>(&json).expect("parses"), t);
        let bad = json.replace("\"hex\":\"", "\"hex\":\"0");
        let err = serde_json::from_str::<TensorData>(&bad).expect_err("odd hex is refused");
        assert!(err.to_string().contains("not an even number of hex digits"), "{err}");
    }
}
