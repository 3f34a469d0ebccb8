//! Finite-difference gradient checks (f64, central differences) for every differentiable
//! kernel: libtorch autograd must agree with the numeric derivative.

mod common;

use common::{f64s, gradcheck, i64s, normal, rand, signed, In};
use pipewright_ops::op::{AspectPolicy, Attention, AutoPad, BatchNorm, BinaryOp, ClassLoss, Conv, ConvTranspose, CoordMode, GeluApprox, Gemm, GridPadding, GroupNorm, LayerNorm, LinearAttention, LinearRule, LossReduction, Lrn, NearestMode, OptimizerStep, Pad, PadMode, Pool, Reduce, ReduceKind, Resize, ResizeMode, Rnn, RnnCell, RnnDirection, RoiAlign, Rotary, ScatterReduction, Slice, Softmax, Split, UnaryOp, VariadicOp, Window};
use pipewright_ops::Op;
use tch::Tensor;

fn g1(k: Op, inputs: Vec<In>) {
    gradcheck(&k, inputs, 1)
}

fn win(
    kernel: &[i64],
    strides: &[i64],
    pads: &[i64],
    dilations: &[i64],
    auto_pad: AutoPad,
) -> Window {
    Window {
        kernel_shape: kernel.to_vec(),
        strides: strides.to_vec(),
        pads: pads.to_vec(),
        dilations: dilations.to_vec(),
        auto_pad,
    }
}

#[test]
fn unary_ops() {
    use UnaryOp::*;
    let any = |s| signed(&[2, 3], s);
    let cases: Vec<(UnaryOp, Tensor)> = vec![
        (Abs, any(1)),
        (Neg, any(2)),
        (Sqrt, rand(&[2, 3], 3, 0.2, 2.0)),
        (Reciprocal, any(4)),
        (Exp, any(5)),
        (Log, rand(&[2, 3], 6, 0.2, 2.0)),
        (Erf, any(7)),
        (Tanh, any(8)),
        (Sigmoid, any(9)),
        (Relu, any(10)),
        (Sin, any(11)),
        (Cos, any(12)),
        (Tan, rand(&[2, 3], 13, -1.0, 1.0)),
        (Asin, rand(&[2, 3], 14, -0.9, 0.9)),
        (Acos, rand(&[2, 3], 15, -0.9, 0.9)),
        (Atan, any(16)),
        (Sinh, any(17)),
        (Cosh, any(18)),
        (Asinh, any(19)),
        (Acosh, rand(&[2, 3], 20, 1.2, 3.0)),
        (Atanh, rand(&[2, 3], 21, -0.9, 0.9)),
        (Softplus, any(22)),
        (Softsign, any(23)),
        (Identity, any(24)),
        (HardSwish, rand(&[2, 3], 25, -2.9, 2.9)),
        (Mish, any(26)),
    ];
    for (u, x) in cases {
        g1(Op::Unary(u), vec![In::D(x)]);
    }
}

/// `StopGradient` (a `detach()` of the source model) is the identity forward and passes
/// no gradient back: `x + StopGradient(x)` has derivative 1, not 2.
#[test]
fn stop_gradient_passes_values_and_no_gradient() {
    let x = signed(&[2, 3], 27).set_requires_grad(true);
    let stopped = common::eval(&Op::StopGradient, &[Some(&x)], pipewright_runtime::exec::Mode::Train).remove(0);
    assert_eq!(common::to_f64(&stopped), common::to_f64(&x));
    assert!(!stopped.requires_grad());
    let y = (&x + &stopped).sum(tch::Kind::Double);
    let grad = Tensor::run_backward(&[&y], &[&x], false, false).remove(0);
    assert_eq!(common::to_f64(&grad), vec![1.0; 6]);
}

#[test]
fn activations() {
    let x = || signed(&[3, 4], 31);
    g1(Op::LeakyRelu { alpha: 0.1 }, vec![In::D(x())]);
    g1(Op::Elu { alpha: 0.7 }, vec![In::D(x())]);
    g1(Op::Celu { alpha: 0.6 }, vec![In::D(x())]);
    g1(
        Op::Selu {
            alpha: 1.673_263_2,
            gamma: 1.050_701,
        },
        vec![In::D(x())],
    );
    g1(
        Op::HardSigmoid {
            alpha: 0.2,
            beta: 0.5,
        },
        vec![In::D(rand(&[3, 4], 32, -2.4, 2.4))],
    );
    g1(Op::ThresholdedRelu { alpha: 0.5 }, vec![In::D(x())]);
    g1(
        Op::Gelu {
            approximate: GeluApprox::None,
        },
        vec![In::D(x())],
    );
    g1(
        Op::Gelu {
            approximate: GeluApprox::Tanh,
        },
        vec![In::D(x())],
    );
    g1(
        Op::Binary(BinaryOp::PRelu),
        vec![In::D(x()), In::D(rand(&[4], 33, 0.1, 0.5))],
    );
}

/// At a bound, the gradient follows PyTorch's op behind the Clip: none with both bounds
/// (`hardtanh`, ReLU6), all of it with one (`clamp_min`), whether the bounds are
/// attributes or inputs. (Central differences straddle a bound, so this is no gradcheck.)
#[test]
fn clip_gradients_at_the_bounds_follow_pytorch() {
    let x = || Tensor::from_slice(&[0.0f64, 3.0, 6.0, -1.0, 7.0]).set_requires_grad(true);
    let gradient = |op: Op, bounds: Vec<Tensor>| {
        let x = x();
        let mut ins: Vec<Option<&Tensor>> = vec![Some(&x)];
        ins.extend(bounds.iter().map(Some));
        let y = common::eval(&op, &ins, pipewright_runtime::exec::Mode::Train).remove(0);
        y.sum(tch::Kind::Double).backward();
        Vec::<f64>::try_from(x.grad()).unwrap()
    };
    let relu6 = gradient(Op::Clip { min: Some(0.0), max: Some(6.0) }, vec![]);
    assert_eq!(relu6, [0.0, 1.0, 0.0, 0.0, 0.0]);
    let relu6_inputs = gradient(Op::Clip { min: None, max: None }, vec![Tensor::from(0.0f64), Tensor::from(6.0f64)]);
    assert_eq!(relu6_inputs, [0.0, 1.0, 0.0, 0.0, 0.0]);
    let clamp_min = gradient(Op::Clip { min: None, max: None }, vec![Tensor::from(0.0f64)]);
    assert_eq!(clamp_min, [1.0, 1.0, 1.0, 0.0, 1.0]);
}

#[test]
fn clip_attrs_and_inputs() {
    let x = || rand(&[2, 5], 41, -2.0, 2.0);
    g1(
        Op::Clip {
            min: Some(-0.5),
            max: Some(0.7),
        },
        vec![In::D(x())],
    );
    g1(
        Op::Clip {
            min: None,
            max: Some(0.3),
        },
        vec![In::D(x())],
    );
    let lo = Tensor::from(-0.25f64);
    g1(
        Op::Clip {
            min: None,
            max: None,
        },
        vec![In::D(x()), In::F(lo), In::N],
    );
    let hi = Tensor::from(0.55f64);
    g1(
        Op::Clip {
            min: None,
            max: None,
        },
        vec![In::D(x()), In::N, In::F(hi)],
    );
}

#[test]
fn binary_broadcasting() {
    use BinaryOp::*;
    for (b, seed) in [(Add, 50), (Sub, 51), (Mul, 52)] {
        g1(
            Op::Binary(b),
            vec![
                In::D(normal(&[2, 1, 3], seed)),
                In::D(normal(&[4, 1], seed + 10)),
            ],
        );
    }
    g1(
        Op::Binary(Div),
        vec![In::D(normal(&[2, 3], 53)), In::D(signed(&[3], 54))],
    );
    g1(
        Op::Binary(Pow),
        vec![
            In::D(rand(&[2, 3], 55, 0.5, 2.0)),
            In::D(normal(&[2, 1], 56)),
        ],
    );
    g1(
        Op::Binary(Pow),
        vec![In::D(normal(&[2, 3], 57)), In::F(i64s(&[2], &[1]))],
    );
    // A constant one-element exponent takes the scalar kernel (GELU's x^3).
    for e in [3.0f64, 0.5, -1.5] {
        let base = if e == 3.0 { normal(&[2, 3], 58) } else { rand(&[2, 3], 58, 0.5, 2.0) };
        g1(Op::Binary(Pow), vec![In::D(base), In::F(Tensor::from(e))]);
    }
    g1(Op::Binary(Pow), vec![In::D(rand(&[2, 3], 59, 0.5, 2.0)), In::F(Tensor::from_slice(&[2.0f64]).reshape([1, 1]))]);
}

#[test]
fn variadic() {
    use VariadicOp::*;
    for v in [Sum, Max, Min, Mean] {
        let ins = vec![
            In::D(normal(&[2, 3], 60)),
            In::D(normal(&[3], 61)),
            In::D(normal(&[2, 1], 62)),
        ];
        g1(Op::Variadic(v), ins);
    }
}

#[test]
fn matmul_and_gemm() {
    let mm = |a: &[i64], b: &[i64]| {
        g1(
            Op::MatMul,
            vec![In::D(normal(a, 70)), In::D(normal(b, 71))],
        )
    };
    mm(&[2, 3], &[3, 4]);
    mm(&[2, 2, 3], &[3, 2]);
    mm(&[3], &[3, 4]);
    mm(&[2, 3], &[3]);
    mm(&[3], &[3]);
    let gemm = Gemm {
        alpha: 0.5,
        beta: 2.0,
        trans_a: true,
        trans_b: true,
    };
    let ins = vec![
        In::D(normal(&[3, 2], 72)),
        In::D(normal(&[4, 3], 73)),
        In::D(normal(&[4], 74)),
    ];
    g1(Op::Gemm(gemm), ins);
    let plain = Gemm {
        alpha: 1.0,
        beta: 1.0,
        trans_a: false,
        trans_b: false,
    };
    g1(
        Op::Gemm(plain),
        vec![
            In::D(normal(&[2, 3], 75)),
            In::D(normal(&[3, 4], 76)),
            In::N,
        ],
    );
}

#[test]
fn conv_variants() {
    let conv = |w: Window, group| Op::Conv(Conv { window: w, group });
    // 2-D, groups, symmetric pads, bias.
    let k = conv(win(&[], &[1, 1], &[1, 1, 1, 1], &[], AutoPad::NotSet), 2);
    g1(
        k,
        vec![
            In::D(normal(&[1, 4, 4, 4], 80)),
            In::D(normal(&[2, 2, 3, 3], 81)),
            In::D(normal(&[2], 82)),
        ],
    );
    // Asymmetric pads, stride 2, dilation 2.
    let k = conv(
        win(&[2, 2], &[2, 2], &[0, 1, 2, 0], &[2, 2], AutoPad::NotSet),
        1,
    );
    g1(
        k,
        vec![
            In::D(normal(&[1, 2, 5, 5], 83)),
            In::D(normal(&[3, 2, 2, 2], 84)),
            In::N,
        ],
    );
    // 1-D with SAME_UPPER, 3-D with SAME_LOWER.
    let k = conv(win(&[], &[2], &[], &[], AutoPad::SameUpper), 1);
    g1(
        k,
        vec![
            In::D(normal(&[2, 2, 6], 85)),
            In::D(normal(&[2, 2, 2], 86)),
            In::D(normal(&[2], 87)),
        ],
    );
    let k = conv(win(&[], &[], &[], &[], AutoPad::SameLower), 1);
    g1(
        k,
        vec![
            In::D(normal(&[1, 1, 3, 3, 2], 88)),
            In::D(normal(&[2, 1, 2, 2, 2], 89)),
            In::N,
        ],
    );
}

#[test]
fn conv_transpose_variants() {
    let ct = |w: Window, group, output_padding: &[i64], output_shape: &[i64]| {
        Op::ConvTranspose(ConvTranspose {
            window: w,
            group,
            output_padding: output_padding.to_vec(),
            output_shape: output_shape.to_vec(),
        })
    };
    let k = ct(
        win(&[], &[2, 2], &[1, 0, 0, 1], &[], AutoPad::NotSet),
        1,
        &[1, 1],
        &[],
    );
    g1(
        k,
        vec![
            In::D(normal(&[1, 2, 3, 3], 90)),
            In::D(normal(&[2, 3, 3, 3], 91)),
            In::D(normal(&[3], 92)),
        ],
    );
    let k = ct(win(&[], &[2], &[], &[2], AutoPad::NotSet), 2, &[], &[]);
    g1(
        k,
        vec![
            In::D(normal(&[1, 4, 3], 93)),
            In::D(normal(&[4, 1, 2], 94)),
            In::N,
        ],
    );
    let k = ct(
        win(&[], &[3, 2], &[], &[], AutoPad::NotSet),
        1,
        &[],
        &[8, 7],
    );
    g1(
        k,
        vec![
            In::D(normal(&[1, 1, 2, 3], 95)),
            In::D(normal(&[1, 2, 3, 3], 96)),
            In::N,
        ],
    );
}

#[test]
fn pools() {
    let pool = |w, ceil_mode, count_include_pad| Pool {
        window: w,
        ceil_mode,
        count_include_pad,
    };
    let x = || In::D(normal(&[1, 2, 5, 5], 100));
    let p = pool(
        win(&[3, 3], &[2, 2], &[1, 0, 1, 1], &[], AutoPad::NotSet),
        true,
        false,
    );
    gradcheck(&Op::MaxPool(p.clone()), vec![x()], 1);
    g1(Op::AveragePool(p), vec![x()]);
    let p = pool(
        win(&[2, 2], &[1, 2], &[1, 1, 1, 1], &[2, 1], AutoPad::NotSet),
        false,
        true,
    );
    gradcheck(&Op::MaxPool(p.clone()), vec![x()], 1);
    g1(Op::AveragePool(p), vec![x()]);
    let p = pool(win(&[2], &[2], &[], &[], AutoPad::SameUpper), false, false);
    g1(
        Op::AveragePool(p.clone()),
        vec![In::D(normal(&[2, 1, 5], 101))],
    );
    gradcheck(&Op::MaxPool(p), vec![In::D(normal(&[2, 1, 5], 102))], 1);
    let p = pool(
        win(&[2, 2, 2], &[1, 1, 1], &[], &[], AutoPad::NotSet),
        false,
        false,
    );
    g1(
        Op::AveragePool(p.clone()),
        vec![In::D(normal(&[1, 1, 3, 3, 3], 103))],
    );
    gradcheck(
        &Op::MaxPool(p),
        vec![In::D(normal(&[1, 1, 3, 3, 3], 104))],
        1,
    );
    g1(
        Op::GlobalAveragePool,
        vec![In::D(normal(&[2, 3, 2, 2], 105))],
    );
    g1(
        Op::GlobalMaxPool,
        vec![In::D(normal(&[2, 3, 2, 2], 106))],
    );
}

#[test]
fn normalisations() {
    let bn = Op::BatchNormalization(BatchNorm {
        epsilon: 1e-5,
        momentum: 0.9,
        training_mode: true,
    });
    let ins = vec![
        In::D(normal(&[3, 2, 2, 2], 110)),
        In::D(normal(&[2], 111)),
        In::D(normal(&[2], 112)),
        In::F(rand(&[2], 113, -0.1, 0.1)),
        In::F(rand(&[2], 114, 0.5, 1.5)),
    ];
    gradcheck(&bn, ins, 1);
    for axis in [-1, 1] {
        let ln = Op::LayerNormalization(LayerNorm {
            axis,
            epsilon: 1e-5,
            stash_type: 1,
        });
        let sshape: &[i64] = if axis == 1 { &[3, 4] } else { &[4] };
        let ins = vec![
            In::D(normal(&[2, 3, 4], 115)),
            In::D(normal(sshape, 116)),
            In::D(normal(sshape, 117)),
        ];
        gradcheck(&ln, ins, 3);
    }
    let inorm = Op::InstanceNormalization { epsilon: 1e-5 };
    let ins = vec![
        In::D(normal(&[2, 3, 4], 118)),
        In::D(normal(&[3], 119)),
        In::D(normal(&[3], 120)),
    ];
    g1(inorm, ins);
}

#[test]
fn softmax_variants() {
    for coerce_2d in [false, true] {
        for axis in [1, -1] {
            let s = Softmax { axis, coerce_2d };
            g1(
                Op::Softmax(s.clone()),
                vec![In::D(normal(&[2, 3, 4], 130))],
            );
            g1(Op::LogSoftmax(s), vec![In::D(normal(&[2, 3, 4], 131))]);
        }
    }
}

#[test]
fn shape_ops() {
    let x = || In::D(normal(&[2, 3, 4], 140));
    g1(
        Op::Reshape { allow_zero: false },
        vec![x(), In::F(i64s(&[0, -1], &[2]))],
    );
    g1(Op::Flatten { axis: 2 }, vec![x()]);
    g1(
        Op::Transpose {
            perm: Some(vec![2, 0, 1]),
        },
        vec![x()],
    );
    g1(
        Op::Squeeze { axes: None },
        vec![In::D(normal(&[2, 1, 3], 141)), In::F(i64s(&[-2], &[1]))],
    );
    g1(
        Op::Unsqueeze {
            axes: Some(vec![0, -1]),
        },
        vec![x()],
    );
    g1(
        Op::Concat { axis: 1 },
        vec![x(), In::D(normal(&[2, 2, 4], 142))],
    );
    let split = Split {
        axis: 1,
        split: None,
        num_outputs: Some(2),
    };
    gradcheck(&Op::Split(split), vec![x()], 2);
    let split = Split {
        axis: 2,
        split: None,
        num_outputs: None,
    };
    gradcheck(
        &Op::Split(split),
        vec![x(), In::F(i64s(&[1, 3], &[2]))],
        2,
    );
    let sl = Op::Slice(Slice { attrs: None });
    let ins = vec![
        x(),
        In::F(i64s(&[-1, 0], &[2])),
        In::F(i64s(&[-5, 3], &[2])),
        In::F(i64s(&[2, 1], &[2])),
        In::F(i64s(&[-2, 2], &[2])),
    ];
    g1(sl, ins);
    let sl = Op::Slice(Slice {
        attrs: Some((vec![1], vec![100], Some(vec![1]))),
    });
    g1(sl, vec![x()]);
    g1(
        Op::Gather { axis: 1 },
        vec![x(), In::F(i64s(&[-1, 0, 2, 2], &[2, 2]))],
    );
    g1(
        Op::Gather { axis: 0 },
        vec![x(), In::F(i64s(&[1], &[]))],
    );
    let idx = i64s(&[0, 2, -1, 1, 1, 0], &[2, 3, 1]);
    g1(Op::GatherElements { axis: 2 }, vec![x(), In::F(idx)]);
    // GatherND: index pairs into the first two axes (one repeated, one negative), and one
    // index per batch row with batch_dims = 1.
    g1(Op::GatherND { batch_dims: 0 }, vec![x(), In::F(i64s(&[1, 2, 0, -1, 1, 2], &[3, 2]))]);
    g1(Op::GatherND { batch_dims: 1 }, vec![x(), In::F(i64s(&[2, 0, 1, 1], &[2, 2, 1]))]);
    g1(
        Op::Expand,
        vec![In::D(normal(&[3, 1], 143)), In::F(i64s(&[2, 1, 4], &[3]))],
    );
    let cond = Tensor::from_slice(&[true, false, true]);
    g1(
        Op::Where,
        vec![
            In::F(cond),
            In::D(normal(&[2, 3], 144)),
            In::D(normal(&[3], 145)),
        ],
    );
    g1(
        Op::Tile,
        vec![In::D(normal(&[2, 3], 146)), In::F(i64s(&[2, 1], &[2]))],
    );
    g1(
        Op::Trilu { upper: true },
        vec![In::D(normal(&[3, 4], 147)), In::F(Tensor::from(1i64))],
    );
    g1(
        Op::Trilu { upper: false },
        vec![In::D(normal(&[2, 3, 3], 148))],
    );
}

/// Resize: gathers along each resized axis with per-tap weights. Nearest (one tap),
/// linear and cubic (two and four, edge taps clamped or excluded), antialiased
/// downsampling (wider filters), tf_crop_and_resize with its extrapolated border, and
/// the legacy Upsample form.
#[test]
fn resize_modes() {
    let x = || In::D(normal(&[1, 2, 4, 5], 150));
    let f32s = |v: &[f32]| In::F(Tensor::from_slice(v));
    let rs = |mode, coord| Resize {
        mode,
        coord,
        nearest: NearestMode::RoundPreferFloor,
        aspect: AspectPolicy::Stretch,
        cubic_a: -0.75,
        exclude_outside: false,
        extrapolation: 0.0,
        antialias: false,
        axes: None,
        legacy: false,
    };
    let up = f32s(&[1.0, 1.0, 2.0, 1.5]);
    let down = f32s(&[1.0, 1.0, 0.6, 0.5]);
    g1(Op::Resize(rs(ResizeMode::Nearest, CoordMode::Asymmetric)), vec![x(), In::N, up]);
    g1(Op::Resize(rs(ResizeMode::Linear, CoordMode::HalfPixel)), vec![x(), In::N, f32s(&[1.0, 1.0, 1.7, 0.6])]);
    let cubic = Resize { exclude_outside: true, cubic_a: -0.5, ..rs(ResizeMode::Cubic, CoordMode::AlignCorners) };
    g1(Op::Resize(cubic), vec![x(), In::N, In::N, In::F(i64s(&[1, 2, 3, 7], &[4]))]);
    g1(Op::Resize(rs(ResizeMode::Cubic, CoordMode::HalfPixel)), vec![x(), In::N, down]);
    for mode in [ResizeMode::Linear, ResizeMode::Cubic] {
        let aa = Resize { antialias: true, ..rs(mode, CoordMode::PytorchHalfPixel) };
        g1(Op::Resize(aa), vec![x(), In::N, f32s(&[1.0, 1.0, 0.6, 0.5])]);
    }
    let crop = Resize { extrapolation: 2.5, axes: Some(vec![3, 2]), ..rs(ResizeMode::Linear, CoordMode::TfCropAndResize) };
    g1(Op::Resize(crop), vec![x(), f32s(&[0.2, 0.4, 1.3, 0.9]), In::N, In::F(i64s(&[6, 3], &[2]))]);
    let legacy = Resize { legacy: true, nearest: NearestMode::Floor, ..rs(ResizeMode::Linear, CoordMode::Asymmetric) };
    g1(Op::Resize(legacy), vec![x(), f32s(&[1.0, 1.0, 2.0, 3.0])]);
}

/// GridSample through libtorch's grid sampler: gradients for the input and for the grid,
/// 2-D in every mode and padding, and 3-D linear.
#[test]
fn grid_sample_modes() {
    let grid = |shape: &[i64], seed| In::D(rand(shape, seed, -1.2, 1.2));
    let cases = [
        (ResizeMode::Linear, GridPadding::Zeros, false),
        (ResizeMode::Linear, GridPadding::Border, true),
        (ResizeMode::Linear, GridPadding::Reflection, false),
        (ResizeMode::Cubic, GridPadding::Zeros, true),
    ];
    for (i, (mode, padding, align_corners)) in cases.into_iter().enumerate() {
        let k = Op::GridSample { mode, padding, align_corners, v16: false };
        g1(k, vec![In::D(normal(&[2, 2, 4, 5], 160 + i as u64)), grid(&[2, 3, 2, 2], 170 + i as u64)]);
    }
    // Nearest: only the input has a gradient (the grid's is zero almost everywhere).
    let k = Op::GridSample { mode: ResizeMode::Nearest, padding: GridPadding::Border, align_corners: false, v16: false };
    g1(k, vec![In::D(normal(&[1, 2, 4, 5], 180)), In::F(rand(&[1, 3, 2, 2], 181, -1.2, 1.2))]);
    let k = Op::GridSample { mode: ResizeMode::Linear, padding: GridPadding::Zeros, align_corners: false, v16: false };
    g1(k, vec![In::D(normal(&[1, 1, 3, 2, 2], 182)), grid(&[1, 2, 2, 2, 3], 183)]);
}

/// AffineGrid: the grid is linear in theta (2-D and 3-D).
#[test]
fn affine_grid() {
    for align_corners in [false, true] {
        let k = Op::AffineGrid { align_corners };
        g1(k.clone(), vec![In::D(normal(&[2, 2, 3], 190)), In::F(i64s(&[2, 3, 4, 5], &[4]))]);
        g1(k, vec![In::D(normal(&[1, 3, 4], 191)), In::F(i64s(&[1, 1, 2, 3, 4], &[5]))]);
    }
}

/// Col2Im (overlapping blocks add up; strides, dilations, pads and a 3-D image) and
/// CenterCropPad (a crop on one axis, a pad on another).
#[test]
fn col2im_and_center_crop_pad() {
    let k = |d: &[i64], p: &[i64], s: &[i64]| Op::Col2Im { dilations: d.to_vec(), pads: p.to_vec(), strides: s.to_vec() };
    let ints = |v: &[i64]| In::F(i64s(v, &[v.len() as i64]));
    g1(k(&[], &[], &[]), vec![In::D(normal(&[2, 4, 12], 200)), ints(&[4, 5]), ints(&[2, 2])]);
    g1(k(&[1, 2], &[1, 0, 1, 1], &[2, 1]), vec![In::D(normal(&[1, 6, 8], 201)), ints(&[4, 5]), ints(&[3, 2])]);
    g1(k(&[], &[], &[]), vec![In::D(normal(&[1, 4, 6], 202)), ints(&[3, 2, 3]), ints(&[1, 2, 2])]);
    let crop = Op::CenterCropPad { axes: Some(vec![-1, 1]) };
    g1(crop, vec![In::D(normal(&[2, 5, 6], 203)), ints(&[3, 8])]);
}

/// LpPool with p = 2 and 3: explicit pads, strides with dilations, ceil mode.
#[test]
fn lp_pool() {
    let pool = |w, ceil_mode| Pool { window: w, ceil_mode, count_include_pad: false };
    let x = || In::D(normal(&[1, 2, 5, 5], 210));
    let k = |w, ceil, p| Op::LpPool { pool: pool(w, ceil), p };
    g1(k(win(&[2, 2], &[], &[1, 0, 0, 1], &[], AutoPad::NotSet), false, 2), vec![x()]);
    g1(k(win(&[2, 2], &[2, 1], &[], &[1, 2], AutoPad::NotSet), false, 3), vec![x()]);
    g1(k(win(&[2, 2], &[2, 2], &[], &[], AutoPad::NotSet), true, 2), vec![x()]);
}

/// DepthToSpace and SpaceToDepth in both channel orders (reshape, transpose, reshape).
#[test]
fn block_moves() {
    for crd in [false, true] {
        g1(Op::DepthToSpace { blocksize: 2, crd }, vec![In::D(normal(&[2, 8, 2, 3], 151))]);
        g1(Op::SpaceToDepth { blocksize: 2, crd }, vec![In::D(normal(&[2, 2, 4, 6], 152))]);
    }
}

#[test]
fn pad_modes() {
    for mode in [
        PadMode::Constant,
        PadMode::Reflect,
        PadMode::Edge,
        PadMode::Wrap,
    ] {
        let p = Op::Pad(Pad { mode, attrs: None });
        let pads = i64s(&[1, 2, 2, -1], &[4]);
        g1(
            p.clone(),
            vec![
                In::D(normal(&[3, 4], 150)),
                In::F(pads),
                In::F(Tensor::from(0.5f64)),
            ],
        );
        let pads = i64s(&[2, 1], &[2]);
        let ins = vec![
            In::D(normal(&[2, 3, 3], 151)),
            In::F(pads),
            In::N,
            In::F(i64s(&[-1], &[1])),
        ];
        g1(p, ins);
    }
    let p = Op::Pad(Pad {
        mode: PadMode::Reflect,
        attrs: Some((vec![0, 2, 0, 2], 0.0)),
    });
    g1(p, vec![In::D(normal(&[2, 3], 152))]);
}

#[test]
fn cumsum_variants() {
    for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
        let k = Op::CumSum { exclusive, reverse };
        g1(
            k,
            vec![In::D(normal(&[2, 4], 160)), In::F(Tensor::from(-1i64))],
        );
    }
}

#[test]
fn reductions() {
    use ReduceKind::*;
    for kind in [
        Sum, Mean, Max, Min, Prod, L1, L2, LogSum, LogSumExp, SumSquare,
    ] {
        let x = || match kind {
            LogSum => rand(&[2, 3, 2], 170, 0.2, 2.0),
            _ => signed(&[2, 3, 2], 171),
        };
        for keepdims in [false, true] {
            let r = Reduce {
                kind,
                axes: Some(vec![0, -1]),
                keepdims,
                noop_with_empty_axes: false,
            };
            g1(Op::Reduce(r), vec![In::D(x())]);
        }
        let r = Reduce {
            kind,
            axes: None,
            keepdims: false,
            noop_with_empty_axes: false,
        };
        g1(
            Op::Reduce(r.clone()),
            vec![In::D(x()), In::F(i64s(&[1], &[1]))],
        );
        g1(Op::Reduce(r), vec![In::D(x())]);
    }
}

#[test]
fn einsum() {
    let e = |eq: &str| Op::Einsum {
        equation: eq.to_string(),
    };
    g1(
        e("ij,jk->ik"),
        vec![In::D(normal(&[2, 3], 180)), In::D(normal(&[3, 4], 181))],
    );
    g1(
        e("bij, bjk -> bik"),
        vec![
            In::D(normal(&[2, 2, 3], 182)),
            In::D(normal(&[2, 3, 2], 183)),
        ],
    );
    g1(e("...ii->...i"), vec![In::D(normal(&[2, 3, 3], 184))]);
    g1(
        e("ij,ij"),
        vec![In::D(normal(&[2, 3], 185)), In::D(normal(&[2, 3], 186))],
    );
}

/// LayerNormalization whose mean and inverse deviation nobody reads runs libtorch's fused
/// kernel: the same output and the same gradients as the composed definition.
#[test]
fn fused_layer_norm_matches_the_composed_one() {
    use pipewright_runtime::exec::{run, run_node, Mode, Signature};
    for axis in [-1i64, 1] {
        let k = Op::LayerNormalization(LayerNorm { axis, epsilon: 1e-5, stash_type: 1 });
        let sshape: &[i64] = if axis == 1 { &[3, 4] } else { &[4] };
        let leaves = [normal(&[2, 3, 4], 130), normal(sshape, 131), normal(sshape, 132)].map(|t| t.set_requires_grad(true));
        let w = normal(&[2, 3, 4], 133);
        let grads = |fused: bool| {
            let ins: Vec<Option<&Tensor>> = leaves.iter().map(Some).collect();
            let y = if fused { run_node(&k, Signature::NONE, &ins, Mode::Train, Some(&[true, false, false])) } else { run(&k, &ins, Mode::Train) }.unwrap().remove(0);
            let l = (&y * &w).sum(tch::Kind::Double);
            let refs: Vec<&Tensor> = leaves.iter().collect();
            (y.detach(), Tensor::run_backward(&[&l], &refs, false, false))
        };
        let ((y1, g1), (y2, g2)) = (grads(true), grads(false));
        assert!((&y1 - &y2).abs().max().double_value(&[]) < 1e-12, "axis {axis}: outputs differ");
        for (a, b) in g1.iter().zip(&g2) {
            assert!((a - b).abs().max().double_value(&[]) < 1e-10, "axis {axis}: gradients differ");
        }
    }
}

/// The loss ops, with respect to the scores (and log-probabilities), under each reduction,
/// class weights and an ignored target.
#[test]
fn class_loss_ops() {
    let loss = |reduction, ignore_index| ClassLoss { reduction, ignore_index };
    let targets = || In::F(i64s(&[2, 0, 3, 3, 1, 0], &[3, 2]));
    let weights = || In::F(Tensor::from_slice(&[0.5f64, 1.0, 2.0, 1.5]));
    for r in [LossReduction::None, LossReduction::Sum, LossReduction::Mean] {
        g1(Op::NegativeLogLikelihoodLoss(loss(r, None)), vec![In::D(normal(&[3, 4, 2], 301)), targets(), In::N]);
        g1(Op::NegativeLogLikelihoodLoss(loss(r, Some(3))), vec![In::D(normal(&[3, 4, 2], 302)), targets(), weights()]);
        gradcheck(&Op::SoftmaxCrossEntropyLoss(loss(r, None)), vec![In::D(normal(&[3, 4, 2], 303)), targets(), weights()], 2);
        gradcheck(&Op::SoftmaxCrossEntropyLoss(loss(r, Some(0))), vec![In::D(normal(&[3, 4, 2], 304)), targets(), In::N], 2);
    }
}

fn attention(is_causal: bool, heads: Option<(i64, i64)>, mode: i64) -> Attention {
    Attention {
        is_causal,
        q_num_heads: heads.map(|h| h.0),
        kv_num_heads: heads.map(|h| h.1),
        qk_matmul_output_mode: mode,
        scale: None,
        softcap: 0.0,
        softmax_precision: None,
        left_window_size: -1,
        right_window_size: -1,
    }
}

/// Attention through every output (Y, present key and value, the scores of each mode):
/// 4-D and 3-D layouts, masks, the causal frontier, grouped-query heads, a cache and rows
/// with no key to attend (whose zeros must not make NaN gradients).
#[test]
fn attention_paths() {
    let q4 = || normal(&[2, 2, 3, 4], 201);
    let k4 = || normal(&[2, 2, 5, 4], 202);
    let v4 = || normal(&[2, 2, 5, 3], 203);
    // 4-D, no mask, raw scores.
    g4(attention(false, None, 0), vec![In::D(q4()), In::D(k4()), In::D(v4())]);
    // A differentiable float mask, softcap and scale, scores with the bias (mode 2 has
    // -inf where a key is masked, so the causal case reads the softcapped scores instead).
    let mut a = attention(false, None, 2);
    a.softcap = 2.0;
    a.scale = Some(0.3);
    g4(a.clone(), vec![In::D(q4()), In::D(k4()), In::D(v4()), In::D(normal(&[3, 5], 204))]);
    a.is_causal = true;
    a.qk_matmul_output_mode = 1;
    g4(a, vec![In::D(q4()), In::D(k4()), In::D(v4()), In::D(normal(&[3, 5], 211))]);
    // 3-D grouped-query (4 query heads over 2 key/value heads), causal, softmax scores.
    let gqa = attention(true, Some((4, 2)), 3);
    g4(gqa, vec![In::D(normal(&[2, 3, 12], 205)), In::D(normal(&[2, 4, 6], 206)), In::D(normal(&[2, 4, 4], 207))]);
    // A boolean mask shorter than the keys whose first row attends nothing, with a cache.
    let allowed: Vec<bool> = (0..12).map(|i| i >= 4 && i % 3 != 1).collect();
    let mask = Tensor::from_slice(&allowed).reshape([3, 4]);
    let past = || normal(&[2, 2, 2, 4], 208);
    g4(
        attention(false, None, 3),
        vec![In::D(q4()), In::D(k4()), In::D(normal(&[2, 2, 5, 3], 209)), In::F(mask), In::D(past()), In::D(normal(&[2, 2, 2, 3], 210))],
    );
    // An external cache (nonpad_kv_seqlen) with a causal sliding window: the first
    // sample's early queries see no key at all (a negative offset).
    let mut w = attention(true, None, 3);
    w.left_window_size = 1;
    g4(w, vec![In::D(q4()), In::D(k4()), In::D(v4()), In::N, In::N, In::N, In::F(i64s(&[2, 5], &[2]))]);
}

fn g4(a: Attention, inputs: Vec<In>) {
    gradcheck(&Op::Attention(a), inputs, 4)
}

#[test]
fn rms_normalization_and_rotary_embedding() {
    for (axis, sshape) in [(-1i64, &[4i64][..]), (1, &[3, 4][..])] {
        let k = Op::RMSNormalization(LayerNorm { axis, epsilon: 1e-5, stash_type: 1 });
        g1(k, vec![In::D(normal(&[2, 3, 4], 220)), In::D(normal(sshape, 221))]);
    }
    let rot = |interleaved, dim, heads| Op::RotaryEmbedding(Rotary { interleaved, rotary_embedding_dim: dim, num_heads: heads });
    let pos = || In::F(i64s(&[0, 3, 7, 9, 1, 1], &[2, 3]));
    // 4-D [batch, heads, seq, head]: whole head (halves, then interleaved pairs), caches
    // picked by position ids.
    for interleaved in [false, true] {
        let ins = vec![In::D(normal(&[2, 2, 3, 6], 222)), In::D(normal(&[10, 3], 223)), In::D(normal(&[10, 3], 224)), pos()];
        g1(rot(interleaved, 0, None), ins);
    }
    // Partial rotation of the first 4 features.
    let ins = vec![In::D(normal(&[2, 2, 3, 6], 225)), In::D(normal(&[10, 2], 226)), In::D(normal(&[10, 2], 227)), pos()];
    g1(rot(true, 4, None), ins);
    // 3-D [batch, seq, heads * head] with per-token caches and no position ids.
    let ins = vec![In::D(normal(&[2, 3, 12], 228)), In::D(normal(&[2, 3, 3], 229)), In::D(normal(&[2, 3, 3], 230))];
    g1(rot(false, 0, Some(2)), ins);
}

#[test]
fn indexing_ops() {
    for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
        let k = Op::CumProd { exclusive, reverse };
        g1(k, vec![In::D(signed(&[2, 4], 190)), In::F(Tensor::from(1i64))]);
    }
    // TopK: the values' gradient flows to the picked elements (indices are integers).
    for largest in [true, false] {
        let k = Op::TopK { axis: -1, largest, sorted: true };
        gradcheck(&k, vec![In::D(normal(&[3, 5], 191)), In::F(i64s(&[2], &[1]))], 2);
    }
    // OneHot: differentiable in the [off, on] values; one index out of range, one negative.
    g1(
        Op::OneHot { axis: 1 },
        vec![In::F(i64s(&[0, 3, -1, 7], &[2, 2])), In::F(Tensor::from(4i64)), In::D(f64s(&[0.3, 1.7], &[2]))],
    );
    g1(
        Op::ReverseSequence { batch_axis: 1, time_axis: 0 },
        vec![In::D(normal(&[4, 3, 2], 192)), In::F(i64s(&[4, 1, 2], &[3]))],
    );
}

/// ScatterND and ScatterElements in the data and the updates, for the reductions that
/// are differentiable everywhere (none, add; mul too away from zeros). Indices are
/// distinct for `none` (repeated ones leave the result to the scatter order).
#[test]
fn scatter_ops() {
    use ScatterReduction as S;
    for reduction in [S::None, S::Add, S::Mul] {
        let nd = Op::ScatterND { reduction };
        g1(nd.clone(), vec![In::D(signed(&[4, 3], 193)), In::F(i64s(&[1, -1], &[2, 1])), In::D(signed(&[2, 3], 194))]);
        g1(nd, vec![In::D(signed(&[2, 3, 2], 195)), In::F(i64s(&[0, 2, 1, 1, 1, 0], &[3, 2])), In::D(signed(&[3, 2], 196))]);
        let el = Op::ScatterElements { axis: 1, reduction };
        let idx = i64s(&[2, 0, -1, 1], &[2, 2]);
        g1(el, vec![In::D(signed(&[2, 4], 197)), In::F(idx), In::D(signed(&[2, 2], 198))]);
    }
    // Add accumulates repeated indices: each update's gradient is its target's.
    let el = Op::ScatterElements { axis: 0, reduction: S::Add };
    g1(el, vec![In::D(signed(&[3, 2], 199)), In::F(i64s(&[1, 1, 1, 0], &[2, 2])), In::D(signed(&[2, 2], 200))]);
}

#[test]
fn normalisation_ops() {
    for p in [1, 2] {
        g1(Op::LpNormalization { axis: 1, p }, vec![In::D(signed(&[2, 3, 2], 201))]);
    }
    // Soft and hard shrink (inputs away from the thresholds at +-0.5).
    for bias in [0.5f32, 0.0] {
        g1(Op::Shrink { bias, lambd: 0.5 }, vec![In::D(f64s(&[-1.2, -0.3, 0.1, 0.7, 1.4, -0.8], &[2, 3]))]);
    }
    for size in [3, 2] {
        let l = Lrn { alpha: 0.3, beta: 0.75, bias: 1.5, size };
        g1(Op::Lrn(l), vec![In::D(normal(&[2, 4, 3], 202))]);
    }
    g1(Op::MeanVarianceNormalization { axes: vec![0, 2, 3] }, vec![In::D(normal(&[2, 3, 2, 2], 203))]);
    for per_channel in [true, false] {
        let g = GroupNorm { epsilon: 1e-5, num_groups: 2, stash_type: 1, per_channel };
        let n = if per_channel { 4 } else { 2 };
        g1(
            Op::GroupNormalization(g),
            vec![In::D(normal(&[2, 4, 3], 204)), In::D(normal(&[n], 205)), In::D(normal(&[n], 206))],
        );
    }
    g1(Op::Det, vec![In::D(normal(&[2, 3, 3], 207))]);
}

fn rnn_kernel(cell: RnnCell, direction: RnnDirection, batch_major: bool, linear_before_reset: bool, clip: Option<f32>) -> Op {
    Op::Rnn(Rnn { cell, hidden_size: 2, direction, batch_major, clip, linear_before_reset })
}

/// RNN, GRU and LSTM through time (T = 3, B = 2, I = 3, H = 2) in every direction, in the
/// input, both weights, the bias and the initial states (and LSTM peepholes); with
/// per-row sequence lengths, batch-major layout and clipping in some cases. Every output
/// (Y, Y_h and, for LSTM, Y_c) enters the loss.
#[test]
fn recurrent_ops() {
    use RnnDirection::*;
    let (t, b, i, h) = (3i64, 2i64, 3i64, 2i64);
    let cells = [(RnnCell::Rnn, 1i64), (RnnCell::Gru, 3), (RnnCell::Lstm, 4)];
    for (ci, (cell, g)) in cells.into_iter().enumerate() {
        for (di, direction) in [Forward, Reverse, Bidirectional].into_iter().enumerate() {
            let d = if direction == Bidirectional { 2 } else { 1 };
            let seed = 300 + 20 * ci as u64 + 5 * di as u64;
            let batch_major = direction == Reverse;
            let x_shape: &[i64] = if batch_major { &[b, t, i] } else { &[t, b, i] };
            let state_shape: &[i64] = if batch_major { &[b, d, h] } else { &[d, b, h] };
            let lens = if direction == Bidirectional { In::F(i64s(&[3, 2], &[2])) } else { In::N };
            let mut ins = vec![
                In::D(normal(x_shape, seed)),
                In::D(normal(&[d, g * h, i], seed + 1)),
                In::D(normal(&[d, g * h, h], seed + 2)),
                In::D(normal(&[d, 2 * g * h], seed + 3)),
                lens,
                In::D(normal(state_shape, seed + 4)),
            ];
            if cell == RnnCell::Lstm {
                ins.push(In::D(normal(state_shape, seed + 5)));
                ins.push(In::D(normal(&[d, 3 * h], seed + 6)));
            }
            let clip = if direction == Forward { Some(0.9) } else { None };
            for lbr in if cell == RnnCell::Gru { vec![false, true] } else { vec![false] } {
                let k = rnn_kernel(cell, direction, batch_major, lbr, clip);
                let ins = ins.iter().map(|x| match x {
                    In::D(t) => In::D(t.copy()),
                    In::F(t) => In::F(t.copy()),
                    In::N => In::N,
                });
                gradcheck(&k, ins.collect(), if cell == RnnCell::Lstm { 3 } else { 2 });
            }
        }
    }
    // Only X, W and R (no bias, states or peepholes).
    for (cell, g) in cells {
        let k = rnn_kernel(cell, Forward, false, false, None);
        let n_out = if cell == RnnCell::Lstm { 3 } else { 2 };
        gradcheck(&k, vec![In::D(normal(&[t, b, i], 390)), In::D(normal(&[1, g * h, i], 391)), In::D(normal(&[1, g * h, h], 392))], n_out);
    }
}

/// DFT through libtorch's FFTs: real and complex signals, one-sided, inverse and real
/// one-sided inverse (default length 2 * (n - 1)), the opset-20 axis input, and lengths
/// that zero-pad or truncate the signal.
#[test]
fn dft_forms() {
    let k = |inverse, onesided, axis| Op::Dft { inverse, onesided, axis };
    let scalar = |v: i64| In::F(i64s(&[v], &[]));
    g1(k(false, false, Some(1)), vec![In::D(normal(&[2, 5, 1], 220))]);
    g1(k(false, true, Some(1)), vec![In::D(normal(&[2, 6, 1], 221))]);
    g1(k(true, false, Some(-2)), vec![In::D(normal(&[2, 5, 2], 222))]);
    g1(k(true, true, Some(1)), vec![In::D(normal(&[2, 4, 2], 223))]);
    g1(k(false, false, None), vec![In::D(normal(&[3, 4, 2], 224)), scalar(7), scalar(1)]);
    g1(k(false, true, None), vec![In::D(normal(&[3, 5, 1], 225)), scalar(3)]);
    g1(k(false, false, None), vec![In::D(normal(&[2, 3, 4, 2], 226)), In::N, scalar(1)]);
}

/// STFT: a rectangular and a (differentiable) window, one-sided and two-sided, a complex
/// signal with an explicit frame length.
#[test]
fn stft_frames() {
    let scalar = |v: i64| In::F(i64s(&[v], &[]));
    g1(Op::Stft { onesided: true }, vec![In::D(normal(&[1, 12, 1], 230)), scalar(3), In::D(rand(&[4], 231, 0.2, 1.0))]);
    g1(Op::Stft { onesided: false }, vec![In::D(normal(&[2, 9, 1], 232)), scalar(2), In::N, scalar(5)]);
    g1(Op::Stft { onesided: false }, vec![In::D(normal(&[1, 10, 2], 233)), scalar(4), In::N, scalar(4)]);
}

/// RoiAlign w.r.t. the input (the regions are constants): averaged and max-pooled bins,
/// fixed and adaptive sampling, both coordinate modes, a region partly outside.
#[test]
fn roi_align_modes() {
    let roi = |max, sampling_ratio, half_pixel| {
        Op::RoiAlign(RoiAlign { max, output_height: 2, output_width: 3, sampling_ratio, spatial_scale: 0.5, half_pixel, v10: false })
    };
    let rois = || In::F(f64s(&[1.1, 0.7, 8.3, 7.9, 2.2, 1.3, 13.7, 11.1, -3.1, 4.1, 5.3, 16.9], &[3, 4]));
    let batch = || In::F(i64s(&[0, 1, 1], &[3]));
    for (i, (max, ratio, half)) in [(false, 2, true), (false, 0, false), (true, 2, false), (true, 0, true)].into_iter().enumerate() {
        g1(roi(max, ratio, half), vec![In::D(normal(&[2, 3, 6, 7], 240 + i as u64)), rois(), batch()]);
    }
}

/// DeformConv: gradients for the input, weight, offsets, bias and mask, with groups,
/// offset groups, pads, strides and dilations.
#[test]
fn deform_conv() {
    let conv = |w, group| Conv { window: w, group };
    let k = Op::DeformConv { conv: conv(win(&[2, 2], &[2, 1], &[1, 0, 1, 1], &[1, 2], AutoPad::NotSet), 2), offset_group: 2 };
    // Rows (5 + 1 + 1 - 2) / 2 + 1 = 3; columns (5 + 0 + 1 - 3) / 1 + 1 = 4 (dilation 2).
    let (oh, ow) = (3, 4);
    g1(
        k,
        vec![
            In::D(normal(&[1, 4, 5, 5], 250)),
            In::D(normal(&[2, 2, 2, 2], 251)),
            In::D(rand(&[1, 16, oh, ow], 252, -1.3, 1.3)),
            In::D(normal(&[2], 253)),
            In::D(rand(&[1, 8, oh, ow], 254, 0.2, 1.0)),
        ],
    );
    let plain = Op::DeformConv { conv: conv(win(&[], &[], &[], &[], AutoPad::NotSet), 1), offset_group: 1 };
    g1(plain, vec![In::D(normal(&[2, 1, 3, 4], 255)), In::D(normal(&[2, 1, 2, 2], 256)), In::D(rand(&[2, 8, 2, 3], 257, -0.9, 0.9))]);
}

/// Swish and SwiGLU (gate and value), with a non-default alpha.
#[test]
fn swish_and_swiglu() {
    for alpha in [1.0, 0.6] {
        g1(Op::Swish { alpha }, vec![In::D(signed(&[3, 4], 211))]);
        g1(Op::SwiGlu { alpha }, vec![In::D(signed(&[2, 3], 212)), In::D(signed(&[2, 3], 213))]);
    }
}

/// MaxUnpool w.r.t. X, with and without a larger output_shape; TensorScatter w.r.t. the
/// cache and the update, linear and circular (wrapping past the end).
#[test]
fn unpool_and_tensor_scatter() {
    let unpool = Op::MaxUnpool { kernel_shape: vec![2, 2], strides: vec![2, 2], pads: vec![] };
    // Offsets into [1, 1, 4, 4], one per 2x2 window.
    let idx = || In::F(i64s(&[5, 2, 8, 15], &[1, 1, 2, 2]));
    g1(unpool.clone(), vec![In::D(signed(&[1, 1, 2, 2], 221)), idx()]);
    g1(unpool, vec![In::D(signed(&[1, 1, 2, 2], 222)), idx(), In::F(i64s(&[1, 1, 5, 5], &[4]))]);
    for circular in [false, true] {
        let k = Op::TensorScatter { axis: -2, circular };
        let write = i64s(if circular { &[3, 1] } else { &[0, 2] }, &[2]);
        g1(k, vec![In::D(signed(&[2, 3, 5, 2], 223)), In::D(signed(&[2, 3, 3, 2], 224)), In::F(write)]);
    }
    g1(Op::TensorScatter { axis: 1, circular: false }, vec![In::D(signed(&[2, 4], 225)), In::D(signed(&[2, 2], 226))]);
}

fn linear_attention(rule: (bool, bool), q_heads: i64, kv_heads: i64, scale: f32) -> Op {
    let update_rule = match rule {
        (false, false) => LinearRule::Linear,
        (true, false) => LinearRule::Gated,
        (false, true) => LinearRule::Delta,
        (true, true) => LinearRule::GatedDelta,
    };
    Op::LinearAttention(LinearAttention { q_num_heads: q_heads, kv_num_heads: kv_heads, scale, update_rule, chunk_size: 0 })
}

/// LinearAttention through time (3 tokens), both outputs, for every update rule: the
/// gradient reaches Q, K, V, the past state, the decay (per head and per key dimension)
/// and beta (per head and shared).
#[test]
fn linear_attention_rules() {
    let (b, t, d_k, d_v) = (2, 3, 2, 3);
    let qkv = |h: i64, hq: i64, s: u64| {
        vec![In::D(signed(&[b, t, hq * d_k], s)), In::D(signed(&[b, t, h * d_k], s + 1).f_mul_scalar(0.5).unwrap()), In::D(signed(&[b, t, h * d_v], s + 2))]
    };
    let past = |h: i64, s: u64| In::D(signed(&[b, h, d_k, d_v], s).f_mul_scalar(0.3).unwrap());
    // linear: no decay, no beta; with a past state and GQA (4 query heads on 2 KV heads).
    let mut ins = qkv(2, 4, 500);
    ins.push(past(2, 503));
    gradcheck(&linear_attention((false, false), 4, 2, 0.0), ins, 2);
    // gated, per-key-dimension decay (log space, negative).
    let mut ins = qkv(2, 2, 510);
    ins.extend([In::N, In::D(rand(&[b, t, 2 * d_k], 513, -0.8, -0.1))]);
    gradcheck(&linear_attention((true, false), 2, 2, 0.7), ins, 2);
    // delta with a shared beta and a past state.
    let mut ins = qkv(2, 2, 520);
    ins.extend([past(2, 523), In::N, In::D(rand(&[b, t, 1], 524, 0.2, 0.9))]);
    gradcheck(&linear_attention((false, true), 2, 2, 0.0), ins, 2);
    // gated_delta, per-head decay and beta, multi-query (one KV head for 3 query heads).
    let mut ins = qkv(1, 3, 530);
    ins.extend([past(1, 533), In::D(rand(&[b, t, 1], 534, -0.8, -0.1)), In::D(rand(&[b, t, 1], 535, 0.2, 0.9))]);
    gradcheck(&linear_attention((true, true), 3, 1, 0.0), ins, 2);
}

/// CausalConvWithState: input, weight, bias and carried state, with and without SiLU;
/// kernel size 1 (an empty carry) too.
#[test]
fn causal_conv_with_state() {
    for (silu, k, seed) in [(false, 3, 540), (true, 3, 550), (true, 1, 560)] {
        let ins = vec![
            In::D(signed(&[2, 3, 4], seed)),
            In::D(signed(&[3, 1, k], seed + 1)),
            In::D(signed(&[3], seed + 2)),
            In::D(signed(&[2, 3, k - 1], seed + 3)),
        ];
        gradcheck(&Op::CausalConvWithState { silu }, ins, if k > 1 { 2 } else { 1 });
    }
    gradcheck(&Op::CausalConvWithState { silu: false }, vec![In::D(signed(&[1, 2, 2], 570)), In::D(signed(&[2, 1, 4], 571)), In::N, In::N], 2);
}

/// The training domain's optimizer steps (two tensors each, after the first update so
/// the bias correction and beta apply), and ArrayFeatureExtractor.
#[test]
fn optimizer_steps_and_array_feature_extractor() {
    let scalars = || [In::F(f64s(&[0.1], &[])), In::F(i64s(&[2], &[]))];
    let block = |s: u64| [In::D(signed(&[3], s)), In::D(signed(&[2, 2], s + 1))];
    let positive = |s: u64| [In::D(rand(&[3], s, 0.2, 1.0)), In::D(rand(&[2, 2], s + 1, 0.2, 1.0))];
    let ins = |states: &[[In; 2]]| {
        let mut v: Vec<In> = scalars().into();
        v.extend(block(600));
        v.extend(block(610));
        for s in states {
            v.extend(s.iter().map(|i| match i {
                In::D(t) => In::D(t.shallow_clone()),
                In::F(t) => In::F(t.shallow_clone()),
                In::N => In::N,
            }));
        }
        v
    };
    let adagrad = OptimizerStep::Adagrad { decay_factor: 0.1, epsilon: 1e-5, norm_coefficient: 0.01 };
    gradcheck(&Op::Optimizer(adagrad), ins(&[positive(620)]), 4);
    let adam = OptimizerStep::Adam { alpha: 0.9, beta: 0.8, epsilon: 1e-2, norm_coefficient: 0.01, norm_coefficient_post: 0.1 };
    gradcheck(&Op::Optimizer(adam), ins(&[block(630), positive(640)]), 6);
    for nesterov in [false, true] {
        let m = OptimizerStep::Momentum { alpha: 0.9, beta: 0.5, norm_coefficient: 0.01, nesterov };
        gradcheck(&Op::Optimizer(m), ins(&[block(650)]), 4);
    }
    g1(Op::ArrayFeatureExtractor, vec![In::D(normal(&[2, 5], 660)), In::F(i64s(&[4, 0, 4], &[3]))]);
}
