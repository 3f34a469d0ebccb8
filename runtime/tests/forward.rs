//! Forward unit tests with hand-computed expected values for the tricky ONNX semantics,
//! plus error reporting, device parsing and the raw-bytes conversions.

mod common;

use common::{assert_close, eval, f64s, i64s, to_f64, to_i64};
use pipewright_runtime::exec::{run, run_node, tensor_from_bytes, tensor_to_bytes, tensor_to_bytes_as, KernelError, Mode, Signature};
use pipewright_ops::op::{AutoPad, BatchNorm, BinaryOp, CastMode, Conv, ConvTranspose, LayerNorm, Pad, PadMode, Pool, Reduce, ReduceKind, Rnn, RnnCell, RnnDirection, Slice, Softmax, Split, TreeEnsemble, UnaryOp, Window};
use pipewright_ops::{DType, Op, TensorData};
use pipewright_runtime::device::{tch_device, Device};
use tch::{Kind, Tensor};

fn one(k: Op, ins: &[&Tensor]) -> Tensor {
    let ins: Vec<Option<&Tensor>> = ins.iter().map(|t| Some(*t)).collect();
    eval(&k, &ins, Mode::Eval).remove(0)
}

fn win(kernel: &[i64], strides: &[i64], pads: &[i64]) -> Window {
    Window {
        kernel_shape: kernel.to_vec(),
        strides: strides.to_vec(),
        pads: pads.to_vec(),
        ..Window::default()
    }
}

#[test]
fn mod_sign_rules() {
    let x = i64s(&[-7, 7, -7, 7], &[4]);
    let y = i64s(&[3, 3, -3, -3], &[4]);
    assert_eq!(
        to_i64(&one(Op::Binary(BinaryOp::Mod), &[&x, &y])),
        [2, 1, -1, -2]
    );
    assert_eq!(
        to_i64(&one(Op::Binary(BinaryOp::Fmod), &[&x, &y])),
        [-1, 1, -1, 1]
    );
    let xf = f64s(&[-7.5, 7.5], &[2]);
    let yf = f64s(&[2.0, -2.0], &[2]);
    assert_close(
        &to_f64(&one(Op::Binary(BinaryOp::Fmod), &[&xf, &yf])),
        &[-1.5, 1.5],
        0.0,
    );
}

#[test]
fn integer_div_truncates() {
    let x = i64s(&[-7, 7, -7, 6], &[4]);
    let y = i64s(&[2, -2, -2, 4], &[4]);
    let q = one(Op::Binary(BinaryOp::Div), &[&x, &y]);
    assert_eq!(q.kind(), Kind::Int64);
    assert_eq!(to_i64(&q), [-3, -3, 3, 1]);
}

#[test]
fn pow_keeps_base_type() {
    let x = i64s(&[2, 3], &[2]);
    let e = f64s(&[2.0, 0.5], &[2]);
    let y = one(Op::Binary(BinaryOp::Pow), &[&x, &e]);
    assert_eq!(y.kind(), Kind::Int64);
    assert_eq!(to_i64(&y), [4, 1]);
}

#[test]
fn comparisons_give_bool() {
    let x = f64s(&[1.0, 2.0, 3.0], &[3]);
    let y = f64s(&[2.0], &[1]);
    let lt = one(Op::Binary(BinaryOp::Less), &[&x, &y]);
    assert_eq!(lt.kind(), Kind::Bool);
    assert_eq!(to_i64(&lt), [1, 0, 0]);
}

#[test]
fn softmax_coerce_2d_normalises_trailing_block() {
    let x = f64s(&[0.0, 1.0, 2.0, 3.0], &[2, 2]);
    let y = one(
        Op::Softmax(Softmax {
            axis: 0,
            coerce_2d: true,
        }),
        &[&x],
    );
    let z: f64 = (0..4).map(|i| (i as f64).exp()).sum();
    let want: Vec<f64> = (0..4).map(|i| (i as f64).exp() / z).collect();
    assert_close(&to_f64(&y), &want, 1e-12);
    let y13 = one(
        Op::Softmax(Softmax {
            axis: 0,
            coerce_2d: false,
        }),
        &[&x],
    );
    let e2 = 2f64.exp();
    assert_close(
        &to_f64(&y13),
        &[
            1.0 / (1.0 + e2),
            1.0 / (1.0 + e2),
            e2 / (1.0 + e2),
            e2 / (1.0 + e2),
        ],
        1e-12,
    );
}

#[test]
fn slice_negative_steps_and_clamping() {
    let x = Tensor::arange(10, (Kind::Int64, tch::Device::Cpu));
    let k = Op::Slice(Slice { attrs: None });
    let s = |st: i64, en: i64, step: i64| {
        let (st, en, ax, sp) = (
            i64s(&[st], &[1]),
            i64s(&[en], &[1]),
            i64s(&[0], &[1]),
            i64s(&[step], &[1]),
        );
        to_i64(&one(k.clone(), &[&x, &st, &en, &ax, &sp]))
    };
    assert_eq!(s(-1, i64::MIN, -3), [9, 6, 3, 0]);
    assert_eq!(s(8, 1, -2), [8, 6, 4, 2]);
    assert_eq!(s(100, -100, -4), [9, 5, 1]);
    assert_eq!(s(2, 1000, 3), [2, 5, 8]);
    assert_eq!(s(5, 2, 1), Vec::<i64>::new());
    assert_eq!(s(2, 5, -1), Vec::<i64>::new());
}

#[test]
fn pad_modes_values() {
    let x = f64s(&[1.0, 2.0, 3.0], &[3]);
    let pads = i64s(&[2, 2], &[2]);
    let pad = |mode| to_f64(&one(Op::Pad(Pad { mode, attrs: None }), &[&x, &pads]));
    assert_eq!(pad(PadMode::Reflect), [3.0, 2.0, 1.0, 2.0, 3.0, 2.0, 1.0]);
    assert_eq!(pad(PadMode::Edge), [1.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0]);
    assert_eq!(pad(PadMode::Wrap), [2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0]);
    assert_eq!(pad(PadMode::Constant), [0.0, 0.0, 1.0, 2.0, 3.0, 0.0, 0.0]);
    let k = Op::Pad(Pad {
        mode: PadMode::Constant,
        attrs: Some((vec![1, -1], 9.0)),
    });
    assert_eq!(to_f64(&one(k, &[&x])), [9.0, 1.0, 2.0]);
}

#[test]
fn split_uneven() {
    let x = Tensor::arange(7, (Kind::Int64, tch::Device::Cpu));
    let k = Op::Split(Split {
        axis: 0,
        split: None,
        num_outputs: Some(3),
    });
    let parts = eval(&k, &[Some(&x)], Mode::Eval);
    let sizes: Vec<i64> = parts.iter().map(|p| p.size()[0]).collect();
    assert_eq!(sizes, [3, 3, 1]);
    assert_eq!(to_i64(&parts[2]), [6]);
    let k = Op::Split(Split {
        axis: -1,
        split: Some(vec![2, 5]),
        num_outputs: None,
    });
    let parts = eval(&k, &[Some(&x)], Mode::Eval);
    assert_eq!(to_i64(&parts[0]), [0, 1]);
    let k = Op::Split(Split {
        axis: 0,
        split: None,
        num_outputs: None,
    });
    let err = run(&k, &[Some(&x)], Mode::Eval).unwrap_err();
    assert!(
        matches!(err, KernelError::Invalid { op: "Split", .. }),
        "{err}"
    );
    let bad = i64s(&[3, 3], &[2]);
    assert_eq!(run(&k, &[Some(&x), Some(&bad)], Mode::Eval).unwrap_err().to_string(), "Split: invalid input: split sizes [3, 3] do not add up to dimension 7");
}

#[test]
fn ceil_mode_pool_shapes() {
    let x = Tensor::arange(25, (Kind::Double, tch::Device::Cpu)).reshape([1, 1, 5, 5]);
    let pool = |ceil_mode| Pool {
        window: win(&[2, 2], &[2, 2], &[]),
        ceil_mode,
        count_include_pad: false,
    };
    assert_eq!(one(Op::MaxPool(pool(true)), &[&x]).size(), [1, 1, 3, 3]);
    assert_eq!(
        one(Op::MaxPool(pool(false)), &[&x]).size(),
        [1, 1, 2, 2]
    );
    let avg = one(Op::AveragePool(pool(true)), &[&x]);
    assert_eq!(avg.size(), [1, 1, 3, 3]);
    // The last window holds only element 24; the corner windows of the last column two.
    let v = to_f64(&avg);
    assert_close(&[v[2], v[8]], &[(4.0 + 9.0) / 2.0, 24.0], 1e-12);
    // A window that would start in the end padding is dropped: in 3, k 2, s 2, pads 1/1.
    let x3 = f64s(&[1.0, 2.0, 3.0], &[1, 1, 3]);
    let p = Pool {
        window: win(&[2], &[2], &[1, 1]),
        ceil_mode: true,
        count_include_pad: true,
    };
    let y = one(Op::AveragePool(p), &[&x3]);
    assert_close(&to_f64(&y), &[0.5, 2.5], 1e-12);
}

#[test]
fn average_pool_count_include_pad() {
    let x = f64s(&[1.0, 2.0, 3.0, 4.0], &[1, 1, 2, 2]);
    let p = |count_include_pad| Pool {
        window: win(&[2, 2], &[1, 1], &[1, 1, 0, 0]),
        ceil_mode: false,
        count_include_pad,
    };
    assert_close(
        &to_f64(&one(Op::AveragePool(p(false)), &[&x])),
        &[1.0, 1.5, 2.0, 2.5],
        1e-12,
    );
    assert_close(
        &to_f64(&one(Op::AveragePool(p(true)), &[&x])),
        &[0.25, 0.75, 1.0, 2.5],
        1e-12,
    );
}

#[test]
fn max_pool_indices_are_onnx_flat_offsets() {
    let x = f64s(
        &[1.0, 5.0, 3.0, 2.0, 9.0, 4.0, 0.0, 7.0, 8.0, 6.0, 1.0, 2.0],
        &[2, 1, 2, 3],
    );
    let p = Pool {
        window: win(&[2, 2], &[1, 1], &[1, 0, 0, 0]),
        ceil_mode: false,
        count_include_pad: false,
    };
    let outs = eval(&Op::MaxPool(p), &[Some(&x)], Mode::Eval);
    assert_eq!(outs[0].size(), [2, 1, 2, 2]);
    assert_eq!(to_f64(&outs[0]), [5.0, 5.0, 9.0, 9.0, 7.0, 8.0, 7.0, 8.0]);
    assert_eq!(to_i64(&outs[1]), [1, 1, 4, 4, 7, 8, 7, 8]);
}

#[test]
fn conv_transpose_output_shapes() {
    let x = Tensor::ones([1, 1, 3, 3], (Kind::Double, tch::Device::Cpu));
    let w = Tensor::ones([1, 2, 3, 3], (Kind::Double, tch::Device::Cpu));
    let ct = |pads: &[i64], op: &[i64], os: &[i64], auto_pad| {
        let window = Window {
            strides: vec![3, 2],
            pads: pads.to_vec(),
            auto_pad,
            ..Window::default()
        };
        let c = ConvTranspose {
            window,
            group: 1,
            output_padding: op.to_vec(),
            output_shape: os.to_vec(),
        };
        one(Op::ConvTranspose(c), &[&x, &w]).size()
    };
    assert_eq!(ct(&[], &[], &[], AutoPad::NotSet), [1, 2, 9, 7]);
    assert_eq!(
        ct(&[0, 0, 0, 0], &[1, 1], &[], AutoPad::NotSet),
        [1, 2, 10, 8]
    );
    assert_eq!(ct(&[1, 2, 1, 2], &[], &[], AutoPad::NotSet), [1, 2, 7, 3]);
    assert_eq!(ct(&[], &[], &[10, 8], AutoPad::NotSet), [1, 2, 10, 8]);
    assert_eq!(ct(&[], &[], &[], AutoPad::SameUpper), [1, 2, 9, 6]);
}

#[test]
fn reshape_flatten_squeeze() {
    let x = Tensor::zeros([2, 3, 4], (Kind::Float, tch::Device::Cpu));
    let sh = i64s(&[0, -1], &[2]);
    assert_eq!(
        one(Op::Reshape { allow_zero: false }, &[&x, &sh]).size(),
        [2, 12]
    );
    let e = Tensor::zeros([0, 3], (Kind::Float, tch::Device::Cpu));
    let sh = i64s(&[3, 0], &[2]);
    assert_eq!(
        one(Op::Reshape { allow_zero: true }, &[&e, &sh]).size(),
        [3, 0]
    );
    assert_eq!(one(Op::Flatten { axis: 0 }, &[&x]).size(), [1, 24]);
    assert_eq!(one(Op::Flatten { axis: -1 }, &[&x]).size(), [6, 4]);
    let u = one(
        Op::Unsqueeze {
            axes: Some(vec![-1, 1]),
        },
        &[&x],
    );
    assert_eq!(u.size(), [2, 1, 3, 4, 1]);
    assert_eq!(one(Op::Squeeze { axes: None }, &[&u]).size(), [2, 3, 4]);
    let bad = Op::Squeeze {
        axes: Some(vec![0]),
    };
    assert_eq!(run(&bad, &[Some(&x)], Mode::Eval).unwrap_err().to_string(), "Squeeze: invalid input: cannot squeeze axis 0 of size 2");
}

#[test]
fn gather_shape_size_range() {
    let x = f64s(&[1.0, 2.0, 3.0], &[3]);
    let idx = i64s(&[-1, 0], &[2]);
    assert_eq!(
        to_f64(&one(Op::Gather { axis: 0 }, &[&x, &idx])),
        [3.0, 1.0]
    );
    let m = Tensor::zeros([2, 3, 4, 5], (Kind::Float, tch::Device::Cpu));
    assert_eq!(
        to_i64(&one(
            Op::Shape {
                start: 1,
                end: Some(-1)
            },
            &[&m]
        )),
        [3, 4]
    );
    assert_eq!(
        to_i64(&one(
            Op::Shape {
                start: -10,
                end: None
            },
            &[&m]
        )),
        [2, 3, 4, 5]
    );
    let size = one(Op::Size, &[&m]);
    assert_eq!((size.dim(), to_i64(&size)), (0, vec![120]));
    let (s, l, d) = (Tensor::from(10i64), Tensor::from(1i64), Tensor::from(-3i64));
    assert_eq!(to_i64(&one(Op::Range, &[&s, &l, &d])), [10, 7, 4]);
    let (s, l, d) = (
        Tensor::from(0.5f32),
        Tensor::from(2.0f32),
        Tensor::from(0.5f32),
    );
    let r = one(Op::Range, &[&s, &l, &d]);
    assert_eq!((r.kind(), to_f64(&r)), (Kind::Float, vec![0.5, 1.0, 1.5]));
}

#[test]
fn constant_of_shape_cast_and_cumsum() {
    let sh = i64s(&[2, 2], &[2]);
    let c = one(
        Op::ConstantOfShape {
            value: Some(TensorData::from_f64s(DType::I32, vec![1], &[7.0])),
        },
        &[&sh],
    );
    assert_eq!((c.kind(), to_i64(&c)), (Kind::Int, vec![7; 4]));
    let z = one(Op::ConstantOfShape { value: None }, &[&sh]);
    assert_eq!(z.kind(), Kind::Float);
    let x = f64s(&[-1.7, 2.9], &[2]);
    assert_eq!(
        to_i64(&one(Op::Cast { to: DType::I32, mode: CastMode::default() }, &[&x])),
        [-1, 2]
    );
    let x = f64s(&[1.0, 2.0, 3.0], &[3]);
    let ax = Tensor::from(0i32);
    let cs = |exclusive, reverse| to_f64(&one(Op::CumSum { exclusive, reverse }, &[&x, &ax]));
    assert_eq!(cs(false, false), [1.0, 3.0, 6.0]);
    assert_eq!(cs(true, false), [0.0, 1.0, 3.0]);
    assert_eq!(cs(false, true), [6.0, 5.0, 3.0]);
    assert_eq!(cs(true, true), [5.0, 3.0, 0.0]);
}

#[test]
fn reduce_semantics() {
    let x = f64s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let r = |kind, axes: Option<Vec<i64>>, keepdims, noop| {
        Op::Reduce(Reduce {
            kind,
            axes,
            keepdims,
            noop_with_empty_axes: noop,
        })
    };
    let y = one(r(ReduceKind::Sum, Some(vec![1]), true, false), &[&x]);
    assert_eq!((y.size(), to_f64(&y)), (vec![2, 1], vec![3.0, 7.0]));
    let y = one(r(ReduceKind::Prod, None, false, false), &[&x]);
    assert_eq!((y.dim(), to_f64(&y)), (0, vec![24.0]));
    let y = one(r(ReduceKind::SumSquare, None, false, true), &[&x]);
    assert_eq!(to_f64(&y), [1.0, 4.0, 9.0, 16.0]);
    let empty = Tensor::zeros([0], (Kind::Int64, tch::Device::Cpu));
    let y = one(r(ReduceKind::Max, None, true, false), &[&x, &empty]);
    assert_eq!((y.size(), to_f64(&y)), (vec![1, 1], vec![4.0]));
    let xi = i64s(&[1, 2, 4, 4], &[2, 2]);
    let y = one(r(ReduceKind::Mean, Some(vec![1]), false, false), &[&xi]);
    assert_eq!((y.kind(), to_i64(&y)), (Kind::Int64, vec![1, 4]));
}

#[test]
fn argmax_select_last_index() {
    let x = f64s(&[1.0, 3.0, 3.0, 0.0, 0.0, -1.0], &[2, 3]);
    let a = |last, max| {
        let k = if max {
            Op::ArgMax {
                axis: 1,
                keepdims: false,
                select_last_index: last,
            }
        } else {
            Op::ArgMin {
                axis: 1,
                keepdims: false,
                select_last_index: last,
            }
        };
        to_i64(&one(k, &[&x]))
    };
    assert_eq!(a(false, true), [1, 0]);
    assert_eq!(a(true, true), [2, 1]);
    assert_eq!(a(false, false), [0, 2]);
}

#[test]
fn batch_norm_modes_and_dropout() {
    let x = f64s(&[1.0, 3.0, 5.0, 7.0], &[2, 2]);
    let (s, b) = (f64s(&[1.0, 1.0], &[2]), f64s(&[0.0, 0.0], &[2]));
    let (m, v) = (f64s(&[0.0, 0.0], &[2]), f64s(&[1.0, 1.0], &[2]));
    let k = Op::BatchNormalization(BatchNorm {
        epsilon: 0.0,
        momentum: 0.9,
        training_mode: true,
    });
    let ins = [Some(&x), Some(&s), Some(&b), Some(&m), Some(&v)];
    let outs = eval(&k, &ins, Mode::Train);
    assert_close(&to_f64(&outs[0]), &[-1.0, -1.0, 1.0, 1.0], 1e-12);
    // momentum is an f32 attribute: 0.9f32 is not 0.9.
    assert_close(&to_f64(&outs[1]), &[0.3, 0.5], 1e-6);
    assert_close(&to_f64(&outs[2]), &[0.9 + 0.4, 0.9 + 0.4], 1e-6);
    // Exported with training_mode=1, the node uses batch statistics even in Eval.
    let outs = eval(&k, &ins, Mode::Eval);
    assert_eq!(outs.len(), 3);
    assert_close(&to_f64(&outs[0]), &[-1.0, -1.0, 1.0, 1.0], 1e-12);
    let inference = Op::BatchNormalization(BatchNorm { epsilon: 0.0, momentum: 0.9, training_mode: false });
    // Trained where the graph reads only Y, the running variance is runtime state and
    // takes PyTorch's unbiased estimate (variance 8 of [1, 5], not 4).
    let only_y = [true, false, false];
    let outs = run_node(&inference, Signature::NONE, &ins, Mode::Train, Some(&only_y)).unwrap();
    assert_close(&to_f64(&outs[1]), &[0.3, 0.5], 1e-6);
    assert_close(&to_f64(&outs[2]), &[0.9 + 0.8, 0.9 + 0.8], 1e-6);
    let outs = eval(&inference, &ins, Mode::Eval);
    assert_eq!(outs.len(), 1);
    assert_close(&to_f64(&outs[0]), &[1.0, 3.0, 5.0, 7.0], 1e-12);
    let d = Op::Dropout {
        ratio: Some(0.5),
        seed: None,
    };
    let big = Tensor::ones([1000], (Kind::Double, tch::Device::Cpu));
    let outs = eval(&d, &[Some(&big)], Mode::Eval);
    assert_eq!((to_f64(&outs[0])[0], outs[1].kind()), (1.0, Kind::Bool));
    let outs = eval(&d, &[Some(&big)], Mode::Train);
    let y = to_f64(&outs[0]);
    assert!(y.iter().all(|&v| v == 0.0 || v == 2.0));
    let kept = y.iter().filter(|&&v| v == 2.0).count();
    assert!((350..650).contains(&kept), "kept {kept} of 1000");
    assert_eq!(to_i64(&outs[1]).iter().sum::<i64>() as usize, kept);
}

#[test]
fn layer_norm_outputs() {
    let x = f64s(&[1.0, 3.0, 2.0, 2.0], &[2, 2]);
    let s = f64s(&[1.0, 1.0], &[2]);
    let k = Op::LayerNormalization(LayerNorm {
        axis: -1,
        epsilon: 0.0,
        stash_type: 1,
    });
    let outs = eval(&k, &[Some(&x), Some(&s)], Mode::Eval);
    assert_eq!(outs.len(), 3);
    assert_eq!(outs[1].size(), [2, 1]);
    assert_close(&to_f64(&outs[1]), &[2.0, 2.0], 1e-12);
    assert_close(&to_f64(&outs[2])[..1], &[1.0], 1e-12);
    assert_close(&to_f64(&outs[0])[..2], &[-1.0, 1.0], 1e-12);
}

#[test]
fn errors_name_the_problem() {
    let x = f64s(&[1.0], &[1]);
    let e = run(&Op::Unary(UnaryOp::Not), &[Some(&x)], Mode::Eval).unwrap_err();
    assert!(matches!(e, KernelError::DType { op: "Not", .. }), "{e}");
    let e = run(&Op::MatMul, &[Some(&x)], Mode::Eval).unwrap_err();
    assert_eq!(e.to_string(), "MatMul: required input 1 is missing");
    let m = f64s(&[1.0, 2.0], &[2]);
    let e = run(&Op::MatMul, &[Some(&m), Some(&x)], Mode::Eval).unwrap_err();
    assert!(matches!(e, KernelError::Torch { op: "MatMul", .. }), "{e}");
    let e = run(&Op::Cast { to: DType::U32, mode: CastMode::default() }, &[Some(&x)], Mode::Eval).unwrap_err();
    assert!(e.to_string().contains("u32"), "{e}");
    let x4 = Tensor::zeros([1, 1, 2, 2], (Kind::Double, tch::Device::Cpu));
    let p = Pool {
        window: win(&[3, 3], &[], &[]),
        ceil_mode: false,
        count_include_pad: false,
    };
    assert_eq!(run(&Op::MaxPool(p), &[Some(&x4)], Mode::Eval).unwrap_err().to_string(), "MaxPool: invalid input: window 3 is larger than the padded input 2");
    let x6 = Tensor::zeros([1, 1, 1, 1, 1, 1], (Kind::Double, tch::Device::Cpu));
    let p = Pool {
        window: win(&[1, 1, 1, 1], &[], &[]),
        ceil_mode: false,
        count_include_pad: false,
    };
    let e = run(&Op::AveragePool(p), &[Some(&x6)], Mode::Eval).unwrap_err();
    assert!(matches!(e, KernelError::Unsupported { .. }), "{e}");
}

#[test]
fn bytes_round_trip() {
    let bytes: Vec<u8> = [1.5f32, -2.0, 3.25, 0.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let t = tensor_from_bytes(DType::F32, &[2, 2], &bytes).unwrap();
    assert_eq!(t.size(), [2, 2]);
    assert_eq!(
        tensor_to_bytes(&t).unwrap(),
        (DType::F32, vec![2, 2], bytes.clone())
    );
    let tt = t.transpose(0, 1);
    let (_, shape, tb) = tensor_to_bytes(&tt).unwrap();
    assert_eq!(shape, [2, 2]);
    assert_eq!(&tb[4..8], &3.25f32.to_le_bytes());
    let b = tensor_from_bytes(DType::Bool, &[3], &[0, 2, 1]).unwrap();
    assert_eq!(tensor_to_bytes(&b).unwrap().2, [0, 1, 1]);
    assert_eq!(tensor_from_bytes(DType::F32, &[3], &bytes).unwrap_err().to_string(), "tensor conversion: invalid input: 16 bytes do not hold a f32 tensor of shape [3]");
    // u16/u32/u64 live in signed carriers and come back bit for bit.
    for (et, bytes) in [(DType::U16, vec![0xFF, 0xFF, 1, 0]), (DType::U32, vec![0xFF; 8]), (DType::U64, vec![0x80; 16])] {
        let t = tensor_from_bytes(et, &[2], &bytes).unwrap();
        assert_eq!(tensor_to_bytes_as(&t, et).unwrap(), (vec![2], bytes));
    }
    assert_eq!(to_i64(&tensor_from_bytes(DType::U16, &[1], &[0xFF, 0xFF]).unwrap()), [65535]);
    // A carrier value outside the type's range is no u16.
    assert_eq!(tensor_to_bytes_as(&Tensor::from_slice(&[70000i32]), DType::U16).unwrap_err().to_string(), "tensor conversion: invalid input: value 70000 is outside the range of u16");
    assert_eq!(tensor_to_bytes_as(&Tensor::from_slice(&[1.0f32]), DType::U32).unwrap_err().to_string(), "tensor conversion: dtype not supported: a Float tensor does not hold u32 values");
    let s = tensor_from_bytes(DType::I64, &[], &7i64.to_le_bytes()).unwrap();
    assert_eq!((s.dim(), to_i64(&s)), (0, vec![7]));
}

#[test]
fn devices() {
    assert_eq!(tch_device(Device::Cpu).unwrap(), tch::Device::Cpu);
    if !tch::Cuda::is_available() {
        let e = tch_device(Device::Cuda(0)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "CUDA device cuda:0 requested but no CUDA device is available (libtorch built without CUDA or no GPU)"
        );
    }
}

#[test]
fn kernels_serialise() {
    let k = Op::Conv(Conv {
        window: win(&[3, 3], &[1, 1], &[1, 1, 1, 1]),
        group: 1,
    });
    let json = serde_json::to_string(&k).unwrap();
    assert_eq!(serde_json::from_str::<Op>(&json).unwrap(), k);
}

/// Per-row sequence lengths: each row of a bidirectional GRU/LSTM/RNN run with lengths
/// gives what that row alone gives on its truncated sequence, with zeros in `Y` past its
/// length (the reverse direction starts at the row's last valid step).
#[test]
fn rnn_sequence_lengths_match_truncated_rows() {
    let (t, i, h) = (4i64, 3i64, 2i64);
    for (cell, g) in [(RnnCell::Rnn, 1i64), (RnnCell::Gru, 3), (RnnCell::Lstm, 4)] {
        let k = Op::Rnn(Rnn { cell, hidden_size: h, direction: RnnDirection::Bidirectional, batch_major: false, clip: None, linear_before_reset: false });
        let x = Tensor::randn([t, 2, i], (Kind::Double, tch::Device::Cpu));
        let w = Tensor::randn([2, g * h, i], (Kind::Double, tch::Device::Cpu));
        let r = Tensor::randn([2, g * h, h], (Kind::Double, tch::Device::Cpu));
        let lens = i64s(&[4, 2], &[2]);
        let all = eval(&k, &[Some(&x), Some(&w), Some(&r), None, Some(&lens)], Mode::Eval);
        for (row, len) in [(0i64, 4i64), (1, 2)] {
            let xr = x.narrow(1, row, 1).narrow(0, 0, len);
            let alone = eval(&k, &[Some(&xr), Some(&w), Some(&r)], Mode::Eval);
            let y = all[0].narrow(2, row, 1);
            assert_close(&to_f64(&y.narrow(0, 0, len)), &to_f64(&alone[0]), 1e-12);
            assert_close(&to_f64(&y.narrow(0, len, t - len)), &vec![0.0; ((t - len) * 2 * h) as usize], 0.0);
            for s in 1..all.len() {
                assert_close(&to_f64(&all[s].narrow(1, row, 1)), &to_f64(&alone[s]), 1e-12);
            }
        }
    }
}

/// LpNormalization leaves an all-zero vector zero (the reference's norm of 1), not NaN.
#[test]
fn lp_normalization_of_a_zero_vector() {
    let x = f64s(&[3.0, 0.0, 4.0, 0.0], &[2, 2]);
    let y = one(Op::LpNormalization { axis: 0, p: 2 }, &[&x]);
    assert_close(&to_f64(&y), &[0.6, 0.0, 0.8, 0.0], 1e-12);
    let y = one(Op::LpNormalization { axis: 1, p: 1 }, &[&x]);
    assert_close(&to_f64(&y), &[1.0, 0.0, 1.0, 0.0], 1e-12);
}

fn u8s(v: &[u8], shape: &[i64]) -> Tensor {
    Tensor::from_slice(v).reshape(shape)
}

/// The integer products are exact, and QLinear requantization rounds half to even
/// (negative halves too) and saturates to the output type.
#[test]
fn integer_and_quantized_products() {
    let a = u8s(&[1, 2, 3, 4], &[2, 2]);
    let b = u8s(&[5, 6], &[2, 1]);
    let (az, bz) = (u8s(&[1], &[]), u8s(&[5], &[]));
    let ins = [Some(&a), Some(&b), Some(&az), Some(&bz)];
    let y = run(&Op::MatMulInteger, &ins, Mode::Eval).unwrap().remove(0);
    assert_eq!((y.kind(), Vec::<i32>::try_from(&y.flatten(0, -1)).unwrap()), (Kind::Int, vec![1, 3]));

    let x = u8s(&[6, 10, 255], &[3, 1]);
    let one = u8s(&[1], &[1, 1]);
    let f = |v: f32| Tensor::from_slice(&[v]).reshape([] as [i64; 0]);
    let (xs, ws, ys) = (f(0.25), f(1.0), f(1.0));
    let wz = u8s(&[0], &[]);
    let quant = |xz: &Tensor, yz: &Tensor| {
        let ins = [Some(&x), Some(&xs), Some(xz), Some(&one), Some(&ws), Some(&wz), Some(&ys), Some(yz)];
        let y = run(&Op::QLinearMatMul, &ins, Mode::Eval).unwrap().remove(0);
        Vec::<i64>::try_from(&y.to_kind(Kind::Int64).flatten(0, -1)).unwrap()
    };
    // 1.5, 2.5, 63.75 -> 2, 2, 64
    assert_eq!(quant(&u8s(&[0], &[]), &u8s(&[0], &[])), [2, 2, 64]);
    // Less 200: -48.5, -47.5, 13.75 -> -48, -48, 14 (int8), and saturated at 0 for uint8.
    let i8z = Tensor::from_slice(&[0i8]).reshape([] as [i64; 0]);
    assert_eq!(quant(&u8s(&[200], &[]), &i8z), [-48, -48, 14]);
    assert_eq!(quant(&u8s(&[200], &[]), &u8s(&[0], &[])), [0, 0, 14]);

    // ConvInteger with a per-output-channel weight zero point: centred weights [2, 0].
    let img = u8s(&[1, 2, 3, 4], &[1, 1, 2, 2]);
    let w = u8s(&[3, 5], &[2, 1, 1, 1]);
    let wz = u8s(&[1, 5], &[2]);
    let conv = Op::ConvInteger(Conv { window: Window::default(), group: 1 });
    let y = run(&conv, &[Some(&img), Some(&w), None, Some(&wz)], Mode::Eval).unwrap().remove(0);
    assert_eq!(Vec::<i32>::try_from(&y.flatten(0, -1)).unwrap(), [2, 4, 6, 8, 0, 0, 0, 0]);
}

/// MaxUnpool places each value at its flat offset and zero-extends to output_shape;
/// TensorScatter writes from each row's index, wrapping only when circular.
#[test]
fn unpool_and_cache_writes() {
    let x = f64s(&[1.0, 2.0], &[1, 1, 1, 2]);
    let i = i64s(&[1, 2], &[1, 1, 1, 2]);
    let k = Op::MaxUnpool { kernel_shape: vec![1, 2], strides: vec![1, 2], pads: vec![] };
    assert_eq!(to_f64(&one(k.clone(), &[&x, &i])), [0.0, 1.0, 2.0, 0.0]);
    let shape = i64s(&[1, 1, 2, 5], &[4]);
    let y = one(k, &[&x, &i, &shape]);
    assert_eq!((y.size(), to_f64(&y)), (vec![1, 1, 2, 5], vec![0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]));

    let cache = f64s(&[0.0; 8], &[2, 4]);
    let upd = f64s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let write = i64s(&[3, 1], &[2]);
    let circ = one(Op::TensorScatter { axis: 1, circular: true }, &[&cache, &upd, &write]);
    assert_eq!(to_f64(&circ), [2.0, 0.0, 0.0, 1.0, 0.0, 3.0, 4.0, 0.0]);
    let lin = Op::TensorScatter { axis: 1, circular: false };
    let e = run(&lin, &[Some(&cache), Some(&upd), Some(&write)], Mode::Eval).unwrap_err();
    assert!(e.to_string().contains("outside the cache"), "{e}");
}

/// TreeEnsemble by hand: tree A splits feature 0 at `<= 1.0` (NaN goes true), then
/// feature 1 by set membership {2, 5}; tree B is one leaf. Sum, average, min and max
/// aggregate per target; a table with a cycle is an error, not a hang.
#[test]
fn tree_ensemble_walks_and_aggregates() {
    // The ONNX tables: node 0 (tree A's root) `x0 <= 1` goes to leaf 0 or node 1; node 1
    // `x1 in {2, 5}` to leaf 1 or leaf 2; node 2 (tree B's root) `x0 >= 0` to leaf 3.
    let f64s_of = |v: &[f64]| TensorData::from_f64s(DType::F64, vec![v.len() as i64], v);
    let tree = |aggregate_function| TreeEnsemble {
        featureids: vec![0, 1, 0],
        modes: TensorData::from_f64s(DType::U8, vec![3], &[0.0, 6.0, 2.0]),
        splits: f64s_of(&[1.0, 0.0, 0.0]),
        truenodeids: vec![0, 1, 3],
        falsenodeids: vec![1, 2, 3],
        trueleafs: vec![1, 1, 1],
        falseleafs: vec![0, 1, 1],
        missing_tracks_true: vec![1, 1, 1],
        leaf_targetids: vec![0, 1, 1, 0],
        leaf_weights: f64s_of(&[10.0, 20.0, 30.0, 1.0]),
        tree_roots: vec![0, 2],
        membership_values: Some(f64s_of(&[2.0, 5.0, f64::NAN])),
        n_targets: 2,
        aggregate_function,
    };
    let x = f64s(&[0.5, 9.0, 3.0, 5.0, 3.0, 4.0, f64::NAN, 2.0], &[4, 2]);
    let run = |aggregate| to_f64(&one(Op::TreeEnsemble(Box::new(tree(aggregate))), &[&x]));
    // Rows reach leaves (0, 3), (1, 3), (2, 3), (0, 3).
    assert_eq!(run(1), [11.0, 0.0, 1.0, 20.0, 1.0, 30.0, 11.0, 0.0]);
    assert_eq!(run(0), [5.5, 0.0, 0.5, 10.0, 0.5, 15.0, 5.5, 0.0]);
    assert_eq!(run(2), [1.0, f64::MAX, 1.0, 20.0, 1.0, 30.0, 1.0, f64::MAX]);
    assert_eq!(run(3), [10.0, -f64::MAX, 1.0, 20.0, 1.0, 30.0, 10.0, -f64::MAX]);
    let mut cyclic = tree(1);
    (cyclic.trueleafs[2], cyclic.truenodeids[2]) = (0, 2);
    let r = run_kernel_result(Op::TreeEnsemble(Box::new(cyclic)), &x);
    assert!(r.is_err_and(|e| e.to_string().contains("a tree's nodes form a cycle")));
}

fn run_kernel_result(k: Op, x: &Tensor) -> Result<Vec<Tensor>, KernelError> {
    run(&k, &[Some(x)], Mode::Eval)
}
