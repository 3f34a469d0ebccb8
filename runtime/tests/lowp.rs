//! The low-precision element types: decoding raw (packed) bytes into their holder
//! tensors, casts into them against brute-force references, and the quantization kernels
//! on cases the backend suite does not cover (remainder blocks, saturation, round modes).

use pipewright_runtime::exec::{run, tensor_from_bytes, tensor_to_bytes, Mode};
use pipewright_ops::op::{CastMode, Quantize, RoundMode};
use pipewright_ops::{DType, Op};
use tch::{Kind, Tensor};

fn f32s(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

fn cast(x: &Tensor, to: DType, saturate: bool, round: RoundMode) -> Tensor {
    let k = Op::Cast { to, mode: CastMode { saturate, round } };
    run(&k, &[Some(x)], Mode::Eval).unwrap().remove(0)
}

fn cast_f32(values: &[f32], to: DType) -> Vec<f32> {
    f32s(&cast(&Tensor::from_slice(values), to, true, RoundMode::Up))
}

#[test]
fn packed_bytes_decode_low_bits_first_into_holders() {
    // Three int4 elements in two bytes: 0x1, 0xF (-1), then 0x8 (-8) and padding.
    let t = tensor_from_bytes(DType::I4, &[3], &[0xF1, 0x08]).unwrap();
    assert_eq!(t.kind(), Kind::Int8);
    assert_eq!(f32s(&t), [1.0, -1.0, -8.0]);
    let t = tensor_from_bytes(DType::U2, &[5], &[0b00_11_10_01, 0b01]).unwrap();
    assert_eq!((t.kind(), f32s(&t)), (Kind::Uint8, vec![1.0, 2.0, 3.0, 0.0, 1.0]));
    let t = tensor_from_bytes(DType::F4E2M1, &[2], &[0x97]).unwrap();
    assert_eq!(f32s(&t), [6.0, -0.5]);
    let t = tensor_from_bytes(DType::F8E8M0, &[3], &[0, 127, 0xFF]).unwrap();
    let v = f32s(&t);
    assert_eq!((v[0], v[1]), (2f32.powi(-127), 1.0));
    assert!(v[2].is_nan());
    // Float8 stays in libtorch's own kind, byte for byte.
    let t = tensor_from_bytes(DType::F8E4M3FN, &[2], &[0x7E, 0x80]).unwrap();
    assert_eq!(f32s(&t), [448.0, -0.0]);
    assert_eq!(tensor_to_bytes(&t).unwrap().2, [0x7E, 0x80]);
    assert_eq!(tensor_from_bytes(DType::I4, &[3], &[0xF1]).unwrap_err().to_string(), "tensor conversion: invalid input: 1 bytes do not hold a i4 tensor of shape [3]");
}

/// Nearest-even rounding onto a sorted grid of non-negative values (even index = even
/// mantissa), saturating at the top.
fn nearest_even(grid: &[f64], a: f64) -> f64 {
    let mut best = 0;
    for (i, &g) in grid.iter().enumerate() {
        let (d, db) = ((g - a).abs(), (grid[best] - a).abs());
        if d < db || (d == db && i % 2 == 0) {
            best = i;
        }
    }
    grid[best]
}

#[test]
fn float4_casts_round_to_nearest_even_and_saturate() {
    let grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let xs: Vec<f32> = (-160..=160).map(|i| i as f32 / 16.0).collect();
    let got = cast_f32(&xs, DType::F4E2M1);
    for (x, y) in xs.iter().zip(&got) {
        let want = nearest_even(&grid, x.abs() as f64) as f32 * x.signum();
        assert_eq!(*y, want, "f4e2m1({x})");
    }
    let got = cast_f32(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30], DType::F4E2M1);
    assert_eq!(got, [0.0, 6.0, -6.0, 6.0]);
}

#[test]
fn small_integer_casts_truncate_and_wrap() {
    let xs = [-9.5, -8.0, -2.5, 7.6, 8.0, 15.5, 100.0, f32::NAN, f32::INFINITY];
    assert_eq!(cast_f32(&xs, DType::I4), [7.0, -8.0, -2.0, 7.0, -8.0, -1.0, 4.0, 0.0, 0.0]);
    assert_eq!(cast_f32(&xs, DType::U4), [7.0, 8.0, 14.0, 7.0, 8.0, 15.0, 4.0, 0.0, 0.0]);
    assert_eq!(cast_f32(&xs, DType::I2), [-1.0, 0.0, -2.0, -1.0, 0.0, -1.0, 0.0, 0.0, 0.0]);
    assert_eq!(cast_f32(&xs, DType::U2), [3.0, 0.0, 2.0, 3.0, 0.0, 3.0, 0.0, 0.0, 0.0]);
    let ints = Tensor::from_slice(&[-9i64, 16, 17]);
    assert_eq!(f32s(&cast(&ints, DType::I4, true, RoundMode::Up)), [7.0, 0.0, 1.0]);
}

#[test]
fn float8_saturation_and_fnuz_zero() {
    let xs = Tensor::from_slice(&[1e6f32, -1e6, f32::INFINITY, f32::NAN, 470.0]);
    let sat = f32s(&cast(&xs, DType::F8E4M3FN, true, RoundMode::Up));
    assert_eq!(&sat[..3], [448.0, -448.0, 448.0]);
    assert!(sat[3].is_nan());
    let raw = f32s(&cast(&xs, DType::F8E4M3FN, false, RoundMode::Up));
    assert!(raw[0].is_nan() && raw[2].is_nan(), "{raw:?}");
    let e5 = f32s(&cast(&xs, DType::F8E5M2, false, RoundMode::Up));
    assert_eq!(&e5[..3], [f32::INFINITY, f32::NEG_INFINITY, f32::INFINITY]);
    let fnuz = f32s(&cast(&xs, DType::F8E5M2FNUZ, true, RoundMode::Up));
    assert_eq!(&fnuz[..3], [57344.0, -57344.0, 57344.0]);
    // fnuz has no negative zero: its 0x80 code is NaN.
    let z = cast(&Tensor::from_slice(&[-1e-9f32]), DType::F8E4M3FNUZ, false, RoundMode::Up);
    assert_eq!(tensor_to_bytes(&z).unwrap().2, [0x00]);
}

#[test]
fn e8m0_round_modes() {
    let xs = Tensor::from_slice(&[0.0f32, 1.1, 1.5, 1.0, 0.75, -4.0, 3.0e38, f32::NAN]);
    let run_mode = |round, saturate| f32s(&cast(&xs, DType::F8E8M0, saturate, round));
    let up = run_mode(RoundMode::Up, true);
    assert_eq!(&up[..7], [2f32.powi(-127), 2.0, 2.0, 1.0, 1.0, 4.0, 2f32.powi(127)]);
    assert!(up[7].is_nan());
    let down = run_mode(RoundMode::Down, true);
    assert_eq!(&down[..7], [2f32.powi(-127), 1.0, 1.0, 1.0, 0.5, 4.0, 2f32.powi(127)]);
    // Nearest: 1.5 is a tie and rounds up (the reference's lsb is "exponent > 0").
    let near = run_mode(RoundMode::Nearest, true);
    assert_eq!(&near[..7], [2f32.powi(-127), 1.0, 2.0, 1.0, 1.0, 4.0, 2f32.powi(127)]);
    assert!(run_mode(RoundMode::Up, false)[6].is_nan(), "2^127 rounded up overflows without saturate");
}

fn quantize(x: &Tensor, scale: &Tensor, zp: Option<&Tensor>, q: Quantize) -> Tensor {
    run(&Op::QuantizeLinear(q), &[Some(x), Some(scale), zp], Mode::Eval).unwrap().remove(0)
}

fn q(to: DType, axis: i64, block_size: i64) -> Quantize {
    Quantize { output_dtype: Some(to), axis, block_size, saturate: true, precision: None }
}

#[test]
fn blocked_quantization_with_a_short_last_block() {
    // Axis 1 of length 5 in blocks of 2: blocks {0,1}, {2,3}, {4}.
    let x = Tensor::from_slice(&[2f32, 4.0, 9.0, 12.0, 20.0, -2.0, -4.0, -9.0, -12.0, -20.0]).reshape([2, 5]);
    let scale = Tensor::from_slice(&[1f32, 3.0, 5.0, 2.0, 3.0, 4.0]).reshape([2, 3]);
    let zp = Tensor::from_slice(&[0i8, 1, -1, 0, 0, 2]).reshape([2, 3]);
    let y = quantize(&x, &scale, Some(&zp), q(DType::I8, 1, 2));
    assert_eq!(y.kind(), Kind::Int8);
    // 9/3 = 3 (+1), 12/3 = 4 (+1), 20/5 = 4 (-1); -9/3 = -3, -12/3 = -4, -20/4 = -5 (+2).
    assert_eq!(f32s(&y), [2.0, 4.0, 4.0, 5.0, 3.0, -1.0, -2.0, -3.0, -4.0, -3.0]);
    let dq = run(&Op::DequantizeLinear { axis: 1, block_size: 2, output_dtype: None }, &[Some(&y), Some(&scale), Some(&zp)], Mode::Eval).unwrap();
    assert_eq!(f32s(&dq[0]), [2.0, 4.0, 9.0, 12.0, 20.0, -2.0, -4.0, -9.0, -12.0, -20.0]);
    let bad = Tensor::from_slice(&[1f32, 2.0]).reshape([1, 2]);
    let err = run(&Op::QuantizeLinear(q(DType::I8, 1, 2)), &[Some(&x), Some(&bad), None], Mode::Eval).unwrap_err();
    assert!(err.to_string().contains("blocked parameter"), "{err}");
}

#[test]
fn quantization_saturates_to_the_target_range_and_rounds_half_to_even() {
    let x = Tensor::from_slice(&[0.5f32, 1.5, 2.5, -100.0, 100.0]);
    let one = Tensor::from_slice(&[1f32]);
    let y = quantize(&x, &one, None, q(DType::I4, 1, 0));
    assert_eq!(f32s(&y), [0.0, 2.0, 2.0, -8.0, 7.0]);
    let y = quantize(&x, &one, None, q(DType::U2, 1, 0));
    assert_eq!(f32s(&y), [0.0, 2.0, 2.0, 0.0, 3.0]);
    let y = quantize(&x, &one, None, q(DType::F4E2M1, 1, 0));
    assert_eq!(f32s(&y), [0.5, 1.5, 2.0, -6.0, 6.0]);
    let no_sat = Quantize { saturate: false, ..q(DType::F8E4M3FN, 1, 0) };
    assert!(f32s(&quantize(&x, &Tensor::from_slice(&[0.1f32]), None, no_sat))[4].is_nan());
}

#[test]
fn dynamic_quantization_matches_the_reference_formula() {
    let x = Tensor::from_slice(&[0f32, 2.0, -3.0, -2.5, 1.34, 0.5]);
    let out = run(&Op::DynamicQuantizeLinear, &[Some(&x)], Mode::Eval).unwrap();
    assert_eq!(f32s(&out[0]), [153.0, 255.0, 0.0, 26.0, 221.0, 179.0]);
    assert_eq!(f32s(&out[1]), [5.0f32 / 255.0]);
    assert_eq!((out[2].kind(), f32s(&out[2])), (Kind::Uint8, vec![153.0]));
    // An all-zero input: the range is empty and the scale falls back to 1/255.
    let out = run(&Op::DynamicQuantizeLinear, &[Some(&Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)))], Mode::Eval).unwrap();
    assert_eq!((f32s(&out[1]), f32s(&out[2])), (vec![1f32 / 255.0], vec![0.0]));
}
