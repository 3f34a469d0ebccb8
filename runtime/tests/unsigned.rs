//! The bitwise kernels and the exact emulation of u16/u32/u64 (held in signed libtorch
//! kinds), against Rust's own unsigned arithmetic on values at the edges of each type.

use pipewright_ops::op::{BinaryOp, UnaryOp, VariadicOp};
use pipewright_ops::{DType, Op};
use pipewright_runtime::exec::{run, run_node, tensor_from_bytes, tensor_to_bytes_as, KernelError, Mode, Signature};
use tch::Tensor;

const U64S: [u64; 8] = [0, 1, 7, 1 << 32, (1 << 63) - 1, 1 << 63, u64::MAX - 6, u64::MAX];

fn u64s(v: &[u64]) -> Tensor {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    tensor_from_bytes(DType::U64, &[v.len() as i64], &bytes).unwrap()
}

fn back(t: &Tensor, et: DType) -> Vec<u64> {
    let (_, b) = tensor_to_bytes_as(t, et).unwrap();
    let w = et.size();
    b.chunks(w).map(|c| c.iter().rev().fold(0u64, |a, &x| (a << 8) | x as u64)).collect()
}

/// Runs `k` as a program node whose inputs are declared `types`: the runtime routes ops
/// on u16/u32/u64 operands to the unsigned kernels.
fn uns(k: Op, ins: &[&Tensor], types: &[DType]) -> Result<Vec<Tensor>, KernelError> {
    let types: Vec<Option<DType>> = types.iter().map(|t| Some(*t)).collect();
    let sig = Signature { inputs: &types, outputs: &[] };
    run_node(&k, sig, &ins.iter().map(|t| Some(*t)).collect::<Vec<_>>(), Mode::Eval, None)
}

/// Every pair of the edge values, as two flat u64 tensors.
fn pairs() -> (Vec<u64>, Vec<u64>) {
    U64S.iter().flat_map(|&a| U64S.iter().map(move |&b| (a, b))).unzip()
}

#[test]
fn u64_arithmetic_and_order_are_unsigned() {
    let (a, b) = pairs();
    let (x, y) = (u64s(&a), u64s(&b));
    let t = [DType::U64, DType::U64];
    let bin = |k: BinaryOp| back(&uns(Op::Binary(k), &[&x, &y], &t).unwrap()[0], DType::U64);
    let zip = |f: fn(u64, u64) -> u64| a.iter().zip(&b).map(|(&p, &q)| f(p, q)).collect::<Vec<_>>();
    assert_eq!(bin(BinaryOp::Add), zip(u64::wrapping_add));
    assert_eq!(bin(BinaryOp::Sub), zip(u64::wrapping_sub));
    assert_eq!(bin(BinaryOp::Mul), zip(u64::wrapping_mul));
    let pred = |k: BinaryOp| -> Vec<bool> {
        let r = &uns(Op::Binary(k), &[&x, &y], &t).unwrap()[0];
        Vec::<bool>::try_from(r).unwrap()
    };
    let zipb = |f: fn(&u64, &u64) -> bool| a.iter().zip(&b).map(|(p, q)| f(p, q)).collect::<Vec<_>>();
    assert_eq!(pred(BinaryOp::Less), zipb(|p, q| p < q));
    assert_eq!(pred(BinaryOp::GreaterOrEqual), zipb(|p, q| p >= q));
    assert_eq!(pred(BinaryOp::Greater), zipb(|p, q| p > q));
    assert_eq!(pred(BinaryOp::LessOrEqual), zipb(|p, q| p <= q));
    let var = |k: VariadicOp| back(&uns(Op::Variadic(k), &[&x, &y], &t).unwrap()[0], DType::U64);
    assert_eq!(var(VariadicOp::Max), zip(u64::max));
    assert_eq!(var(VariadicOp::Min), zip(u64::min));
}

#[test]
fn u64_division_and_remainder() {
    let (a, b): (Vec<u64>, Vec<u64>) = pairs().0.into_iter().zip(pairs().1).filter(|(_, q)| *q != 0).unzip();
    let (x, y) = (u64s(&a), u64s(&b));
    let t = [DType::U64, DType::U64];
    let q = back(&uns(Op::Binary(BinaryOp::Div), &[&x, &y], &t).unwrap()[0], DType::U64);
    let r = back(&uns(Op::Binary(BinaryOp::Mod), &[&x, &y], &t).unwrap()[0], DType::U64);
    assert_eq!(q, a.iter().zip(&b).map(|(p, q)| p / q).collect::<Vec<_>>());
    assert_eq!(r, a.iter().zip(&b).map(|(p, q)| p % q).collect::<Vec<_>>());
}

#[test]
fn narrow_unsigned_wrap_to_their_width() {
    for (et, max) in [(DType::U16, u16::MAX as u64), (DType::U32, u32::MAX as u64)] {
        let vals = [0, 1, 3, max / 2, max / 2 + 1, max - 1, max];
        let (a, b): (Vec<u64>, Vec<u64>) = vals.iter().flat_map(|&p| vals.iter().map(move |&q| (p, q))).unzip();
        let enc = |v: &[u64]| {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()[..et.size()].to_vec()).collect();
            tensor_from_bytes(et, &[v.len() as i64], &bytes).unwrap()
        };
        let (x, y) = (enc(&a), enc(&b));
        let bin = |k: BinaryOp| back(&uns(Op::Binary(k), &[&x, &y], &[et, et]).unwrap()[0], et);
        let m = max + 1;
        assert_eq!(bin(BinaryOp::Add), a.iter().zip(&b).map(|(p, q)| (p + q) % m).collect::<Vec<_>>());
        assert_eq!(bin(BinaryOp::Sub), a.iter().zip(&b).map(|(p, q)| (p + m - q) % m).collect::<Vec<_>>());
        assert_eq!(bin(BinaryOp::Mul), a.iter().zip(&b).map(|(p, q)| ((*p as u128 * *q as u128) % m as u128) as u64).collect::<Vec<_>>());
        let not = back(&uns(Op::Unary(UnaryOp::BitNot), &[&x], &[et]).unwrap()[0], et);
        assert_eq!(not, a.iter().map(|p| max - p).collect::<Vec<_>>());
    }
}

#[test]
fn shifts_follow_opset_28() {
    let shifts = [0u64, 1, 5, 31, 32, 63, 64, 200];
    let (a, s): (Vec<u64>, Vec<u64>) = U64S.iter().flat_map(|&p| shifts.iter().map(move |&q| (p, q))).unzip();
    let (x, y) = (u64s(&a), u64s(&s));
    let t = [DType::U64, DType::U64];
    let l = back(&uns(Op::Binary(BinaryOp::ShiftLeft), &[&x, &y], &t).unwrap()[0], DType::U64);
    let r = back(&uns(Op::Binary(BinaryOp::ShiftRight), &[&x, &y], &t).unwrap()[0], DType::U64);
    assert_eq!(l, a.iter().zip(&s).map(|(p, q)| p.checked_shl(*q as u32).filter(|_| *q < 64).unwrap_or(0)).collect::<Vec<_>>());
    assert_eq!(r, a.iter().zip(&s).map(|(p, q)| p.checked_shr(*q as u32).filter(|_| *q < 64).unwrap_or(0)).collect::<Vec<_>>());
    // Signed: arithmetic right shift; out-of-range amounts give the sign fill.
    let x = Tensor::from_slice(&[-8i8, -8, 8, 8, 100, -1]);
    let y = Tensor::from_slice(&[1i8, 9, 9, -1, 1, 0]);
    let sh = |k| Vec::<i8>::try_from(&run(&Op::Binary(k), &[Some(&x), Some(&y)], Mode::Eval).unwrap()[0]).unwrap();
    assert_eq!(sh(BinaryOp::ShiftRight), [-4, -1, 0, 0, 50, -1]);
    assert_eq!(sh(BinaryOp::ShiftLeft), [-16, 0, 0, 0, -56, -1]);
}

#[test]
fn top_k_pow_and_refusals() {
    let x = u64s(&U64S);
    let k = Tensor::from_slice(&[3i64]);
    let outs = uns(Op::TopK { axis: 0, largest: true, sorted: true }, &[&x, &k], &[DType::U64, DType::I64]).unwrap();
    assert_eq!(back(&outs[0], DType::U64), [u64::MAX, u64::MAX - 6, 1 << 63]);
    assert_eq!(Vec::<i64>::try_from(&outs[1]).unwrap(), [7, 6, 5]);
    let base = Tensor::from_slice(&[2.0f32, 0.5]);
    let e = u64s(&[3, 1 << 63]);
    let p = &uns(Op::Binary(BinaryOp::Pow), &[&base, &e], &[DType::F32, DType::U64]).unwrap()[0];
    assert_eq!(Vec::<f32>::try_from(p).unwrap(), [8.0, 0.0]);
    // Ops whose signed result would differ are refused, naming the op and type.
    let err = uns(Op::Unary(UnaryOp::Abs), &[&x], &[DType::U64]).unwrap_err();
    assert!(matches!(err, KernelError::DType { .. }) && err.to_string().contains("Abs on u64"), "{err}");
    let err = uns(Op::Variadic(VariadicOp::Mean), &[&x, &x], &[DType::U64, DType::U64]).unwrap_err();
    assert!(err.to_string().contains("Mean on u64"), "{err}");
    // Data movement runs on the carrier kind as it is: the values come back unchanged.
    let idx = Tensor::from_slice(&[7i64, 0, 5]);
    let picked = uns(Op::Gather { axis: 0 }, &[&x, &idx], &[DType::U64, DType::I64]).unwrap();
    assert_eq!(back(&picked[0], DType::U64), [u64::MAX, 0, 1 << 63]);
}

#[test]
fn bitwise_logic_on_native_kinds() {
    let x = Tensor::from_slice(&[0b1100i16, -1]);
    let y = Tensor::from_slice(&[0b1010i16, 5]);
    let b = |k| Vec::<i16>::try_from(&run(&Op::Binary(k), &[Some(&x), Some(&y)], Mode::Eval).unwrap()[0]).unwrap();
    assert_eq!(b(BinaryOp::BitAnd), [0b1000, 5]);
    assert_eq!(b(BinaryOp::BitOr), [0b1110, -1]);
    assert_eq!(b(BinaryOp::BitXor), [0b0110, -6]);
    let n = &run(&Op::Unary(UnaryOp::BitNot), &[Some(&x)], Mode::Eval).unwrap()[0];
    assert_eq!(Vec::<i16>::try_from(n).unwrap(), [!0b1100, 0]);
    let f = Tensor::from_slice(&[1.0f32]);
    assert_eq!(run(&Op::Binary(BinaryOp::BitAnd), &[Some(&f), Some(&f)], Mode::Eval).unwrap_err().to_string(), "BitwiseAnd: dtype not supported: bitwise ops need integer inputs, got Float");
}

/// BitCast keeps every bit: the unsigned types held in wider kinds go through their own
/// width both ways, and floats read as integers give their IEEE bits.
#[test]
fn bitcast_keeps_the_bits_of_carried_types() {
    let x = Tensor::from_slice(&[-1i16, i16::MIN, 7]);
    let as_u16 = uns(Op::BitCast { to: DType::U16 }, &[&x], &[DType::I16]).unwrap();
    assert_eq!(back(&as_u16[0], DType::U16), [0xFFFF, 0x8000, 7]);
    let again = uns(Op::BitCast { to: DType::I16 }, &[&as_u16[0]], &[DType::U16]).unwrap();
    assert_eq!(Vec::<i16>::try_from(&again[0]).unwrap(), [-1, i16::MIN, 7]);
    let f = Tensor::from_slice(&[1.5f32, -0.0, f32::INFINITY]);
    let bits = uns(Op::BitCast { to: DType::U32 }, &[&f], &[DType::F32]).unwrap();
    assert_eq!(back(&bits[0], DType::U32), [1.5f32.to_bits() as u64, (-0.0f32).to_bits() as u64, f32::INFINITY.to_bits() as u64]);
    let err = run(&Op::BitCast { to: DType::F8E4M3FN }, &[Some(&Tensor::from_slice(&[1u8]))], Mode::Eval).unwrap_err();
    assert!(err.to_string().contains("BitCast of f8e4m3fn is not supported"), "{err}");
}

