//! Element codes of the low-precision types (float8 variants, `f4e2m1`, `f8e8m0`, 4- and
//! 2-bit integers): unpacking from raw data, decoding a code to its value, and encoding a
//! value to a code (for constants written in the text form and for tests).
//!
//! Raw data packs `u4`/`i4`/`f4e2m1` two to a byte and `u2`/`i2` four to a byte, element 0
//! in the lowest bits (ONNX's layout); every other low-precision type takes one byte.
//!
//! Encoding follows ONNX `Cast` with `saturate = 1`: floats round to nearest even and
//! saturate to the largest finite value (NaN stays NaN where the format has one; `f4e2m1`,
//! which has none, maps it to zero as the reference does); integers are truncated toward
//! zero and wrap modulo 2^bits (NaN and infinities give zero); `f8e8m0` rounds up.

use crate::DType;

/// How a float format spends its special codes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Specials {
    /// IEEE: the top exponent holds infinities and NaNs (`e5m2`).
    Ieee,
    /// Finite, one NaN per sign at the all-ones code (`e4m3fn`).
    Fn,
    /// Finite, no negative zero: `0x80` is the only NaN (`e4m3fnuz`, `e5m2fnuz`).
    Fnuz,
    /// No NaN, no infinity (`f4e2m1`).
    None,
}

#[derive(Clone, Copy)]
struct Format {
    ebits: u32,
    mbits: u32,
    bias: i32,
    specials: Specials,
}

fn format(dtype: DType) -> Option<Format> {
    let f = |ebits, mbits, bias, specials| Some(Format { ebits, mbits, bias, specials });
    match dtype {
        DType::F8E4M3FN => f(4, 3, 7, Specials::Fn),
        DType::F8E4M3FNUZ => f(4, 3, 8, Specials::Fnuz),
        DType::F8E5M2 => f(5, 2, 15, Specials::Ieee),
        DType::F8E5M2FNUZ => f(5, 2, 16, Specials::Fnuz),
        DType::F4E2M1 => f(2, 1, 1, Specials::None),
        _ => None,
    }
}

/// Bit width and signedness of the packed integer types.
fn int_format(dtype: DType) -> Option<(u32, bool)> {
    match dtype {
        DType::U4 => Some((4, false)),
        DType::I4 => Some((4, true)),
        DType::U2 => Some((2, false)),
        DType::I2 => Some((2, true)),
        _ => None,
    }
}

/// The code of element `i` in raw data of a low-precision type (right-aligned bits).
pub fn code_at(dtype: DType, bytes: &[u8], i: usize) -> u8 {
    match dtype.bits() {
        4 => (bytes[i / 2] >> (4 * (i % 2))) & 0xF,
        2 => (bytes[i / 4] >> (2 * (i % 4))) & 0x3,
        _ => bytes[i],
    }
}

/// Packs one code per element into raw data.
pub fn pack(dtype: DType, codes: &[u8]) -> Vec<u8> {
    let bits = dtype.bits();
    if bits == 8 {
        return codes.to_vec();
    }
    let per = 8 / bits;
    let mask = (1u8 << bits) - 1;
    codes.chunks(per).map(|c| c.iter().enumerate().fold(0u8, |b, (k, &v)| b | ((v & mask) << (k * bits)))).collect()
}

/// The value of a low-precision code.
pub fn decode(dtype: DType, code: u8) -> f64 {
    if let Some((bits, signed)) = int_format(dtype) {
        let v = code as i32;
        return if signed && v >= 1 << (bits - 1) { (v - (1 << bits)) as f64 } else { v as f64 };
    }
    if dtype == DType::F8E8M0 {
        return if code == 0xFF { f64::NAN } else { 2f64.powi(code as i32 - 127) };
    }
    match format(dtype) {
        Some(f) => decode_float(f, code),
        None => f64::NAN,
    }
}

fn decode_float(f: Format, code: u8) -> f64 {
    let sign_bit = 1u8 << (f.ebits + f.mbits);
    let emax = (1u32 << f.ebits) - 1;
    let mmax = (1u32 << f.mbits) - 1;
    let exp = ((code as u32) >> f.mbits) & emax;
    let man = code as u32 & mmax;
    match f.specials {
        Specials::Fnuz if code == 0x80 => return f64::NAN,
        Specials::Fn if exp == emax && man == mmax => return f64::NAN,
        Specials::Ieee if exp == emax => return if man == 0 { sign(code & sign_bit != 0, f64::INFINITY) } else { f64::NAN },
        _ => {}
    }
    let mag = if exp == 0 {
        man as f64 * 2f64.powi(1 - f.bias - f.mbits as i32)
    } else {
        (1.0 + man as f64 / (1u32 << f.mbits) as f64) * 2f64.powi(exp as i32 - f.bias)
    };
    sign(code & sign_bit != 0, mag)
}

fn sign(neg: bool, v: f64) -> f64 {
    if neg { -v } else { v }
}

/// The code of `v` in a low-precision type (see the module doc for the rounding rules).
pub fn encode(dtype: DType, v: f64) -> u8 {
    if let Some((bits, _)) = int_format(dtype) {
        // Two's complement wrapping gives the same low bits for signed and unsigned.
        return if v.is_finite() { v.trunc().rem_euclid((1u64 << bits) as f64) as u8 } else { 0 };
    }
    if dtype == DType::F8E8M0 {
        return encode_e8m0(v);
    }
    match format(dtype) {
        Some(f) => encode_float(f, v),
        None => 0,
    }
}

/// ONNX's `round_mode = "up"` with saturation, on the f32 bits of `v`.
fn encode_e8m0(v: f64) -> u8 {
    let bits = (v as f32).to_bits();
    let exp = (bits >> 23) & 0xFF;
    if exp == 0xFF {
        return 0xFF;
    }
    let up = bits & 0x7F_FFFF != 0 && exp < 0xFE;
    (exp + up as u32) as u8
}

/// Round to nearest (ties to the even code) over the format's finite codes, saturating.
fn encode_float(f: Format, v: f64) -> u8 {
    let sign_bit = 1u8 << (f.ebits + f.mbits);
    if v.is_nan() {
        return match f.specials {
            Specials::Fnuz => 0x80,
            Specials::Fn => sign_bit - 1,
            Specials::Ieee => sign_bit - 1,
            Specials::None => 0,
        };
    }
    let a = v.abs();
    let mut best = 0u8;
    let mut best_err = f64::INFINITY;
    for code in 0..sign_bit {
        let x = decode_float(f, code);
        if !x.is_finite() {
            continue;
        }
        let err = (x - a).abs();
        if err < best_err || (err == best_err && code & 1 == 0) {
            best = code;
            best_err = err;
        }
    }
    let negative = v.is_sign_negative() && !(f.specials == Specials::Fnuz && best == 0);
    if negative { best | sign_bit } else { best }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_format_limits() {
        assert_eq!(decode(DType::F8E4M3FN, 0x7E), 448.0);
        assert!(decode(DType::F8E4M3FN, 0x7F).is_nan());
        assert_eq!(decode(DType::F8E4M3FNUZ, 0x7F), 240.0);
        assert!(decode(DType::F8E4M3FNUZ, 0x80).is_nan());
        assert_eq!(decode(DType::F8E5M2, 0x7B), 57344.0);
        assert_eq!(decode(DType::F8E5M2, 0xFC), f64::NEG_INFINITY);
        assert_eq!(decode(DType::F8E5M2FNUZ, 0x7F), 57344.0);
        assert_eq!(decode(DType::F8E4M3FN, 0x01), 2f64.powi(-9));
        assert_eq!(decode(DType::F4E2M1, 0x7), 6.0);
        assert_eq!(decode(DType::F4E2M1, 0x9), -0.5);
        assert_eq!(decode(DType::F8E8M0, 0), 2f64.powi(-127));
        assert_eq!(decode(DType::I4, 0x8), -8.0);
        assert_eq!(decode(DType::I2, 0x3), -1.0);
        assert_eq!(decode(DType::U2, 0x3), 3.0);
    }

    #[test]
    fn encodes_round_to_nearest_even_and_saturates() {
        assert_eq!(decode(DType::F4E2M1, encode(DType::F4E2M1, 0.25)), 0.0);
        assert_eq!(decode(DType::F4E2M1, encode(DType::F4E2M1, 1.75)), 2.0);
        assert_eq!(decode(DType::F4E2M1, encode(DType::F4E2M1, 5.0)), 4.0);
        assert_eq!(decode(DType::F4E2M1, encode(DType::F4E2M1, -1e6)), -6.0);
        assert_eq!(decode(DType::F8E4M3FN, encode(DType::F8E4M3FN, 1e6)), 448.0);
        assert_eq!(encode(DType::F8E4M3FNUZ, -1e-9), 0);
        assert_eq!(decode(DType::I4, encode(DType::I4, -9.0)), 7.0);
        assert_eq!(decode(DType::U2, encode(DType::U2, -3.0)), 1.0);
        assert_eq!(decode(DType::F8E8M0, encode(DType::F8E8M0, 1.1)), 2.0);
        for code in 0..=255u8 {
            let v = decode(DType::F8E5M2FNUZ, code);
            if !v.is_nan() {
                assert_eq!(decode(DType::F8E5M2FNUZ, encode(DType::F8E5M2FNUZ, v)), v, "code {code:#x}");
            }
        }
    }

    #[test]
    fn packs_low_bits_first() {
        let raw = pack(DType::I4, &[0x1, 0xF, 0x8]);
        assert_eq!(raw, vec![0xF1, 0x08]);
        assert_eq!(code_at(DType::I4, &raw, 1), 0xF);
        let raw = pack(DType::U2, &[1, 2, 3, 0, 1]);
        assert_eq!(raw, vec![0b00_11_10_01, 0b01]);
        assert_eq!(code_at(DType::U2, &raw, 2), 3);
    }
}
