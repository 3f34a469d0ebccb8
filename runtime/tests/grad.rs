//! Finite-difference gradient checks (f64, central differences) for every differentiable
//! kernel: libtorch autograd must agree with the numeric derivative.

mod common;

use common::{gradcheck, i64s, normal, rand, signed, In};
use pipewright_runtime::kernel::*;
use tch::Tensor;

fn g1(k: Kernel, inputs: Vec<In>) {
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
    use UnaryKind::*;
    let any = |s| signed(&[2, 3], s);
    let cases: Vec<(UnaryKind, Tensor)> = vec![
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
        g1(Kernel::Unary(u), vec![In::D(x)]);
    }
}

#[test]
fn activations() {
    let x = || signed(&[3, 4], 31);
    g1(Kernel::LeakyRelu { alpha: 0.1 }, vec![In::D(x())]);
    g1(Kernel::Elu { alpha: 0.7 }, vec![In::D(x())]);
    g1(Kernel::Celu { alpha: 0.6 }, vec![In::D(x())]);
    g1(
        Kernel::Selu {
            alpha: 1.673_263_2,
            gamma: 1.050_701,
        },
        vec![In::D(x())],
    );
    g1(
        Kernel::HardSigmoid {
            alpha: 0.2,
            beta: 0.5,
        },
        vec![In::D(rand(&[3, 4], 32, -2.4, 2.4))],
    );
    g1(Kernel::ThresholdedRelu { alpha: 0.5 }, vec![In::D(x())]);
    g1(
        Kernel::Gelu {
            approximate: GeluApprox::None,
        },
        vec![In::D(x())],
    );
    g1(
        Kernel::Gelu {
            approximate: GeluApprox::Tanh,
        },
        vec![In::D(x())],
    );
    g1(
        Kernel::Binary(BinaryKind::PRelu),
        vec![In::D(x()), In::D(rand(&[4], 33, 0.1, 0.5))],
    );
}

#[test]
fn clip_attrs_and_inputs() {
    let x = || rand(&[2, 5], 41, -2.0, 2.0);
    g1(
        Kernel::Clip {
            min: Some(-0.5),
            max: Some(0.7),
        },
        vec![In::D(x())],
    );
    g1(
        Kernel::Clip {
            min: None,
            max: Some(0.3),
        },
        vec![In::D(x())],
    );
    let lo = Tensor::from(-0.25f64);
    g1(
        Kernel::Clip {
            min: None,
            max: None,
        },
        vec![In::D(x()), In::F(lo), In::N],
    );
    let hi = Tensor::from(0.55f64);
    g1(
        Kernel::Clip {
            min: None,
            max: None,
        },
        vec![In::D(x()), In::N, In::F(hi)],
    );
}

#[test]
fn binary_broadcasting() {
    use BinaryKind::*;
    for (b, seed) in [(Add, 50), (Sub, 51), (Mul, 52)] {
        g1(
            Kernel::Binary(b),
            vec![
                In::D(normal(&[2, 1, 3], seed)),
                In::D(normal(&[4, 1], seed + 10)),
            ],
        );
    }
    g1(
        Kernel::Binary(Div),
        vec![In::D(normal(&[2, 3], 53)), In::D(signed(&[3], 54))],
    );
    g1(
        Kernel::Binary(Pow),
        vec![
            In::D(rand(&[2, 3], 55, 0.5, 2.0)),
            In::D(normal(&[2, 1], 56)),
        ],
    );
    g1(
        Kernel::Binary(Pow),
        vec![In::D(normal(&[2, 3], 57)), In::F(i64s(&[2], &[1]))],
    );
    // A constant one-element exponent takes the scalar kernel (GELU's x^3).
    for e in [3.0f64, 0.5, -1.5] {
        let base = if e == 3.0 { normal(&[2, 3], 58) } else { rand(&[2, 3], 58, 0.5, 2.0) };
        g1(Kernel::Binary(Pow), vec![In::D(base), In::F(Tensor::from(e))]);
    }
    g1(Kernel::Binary(Pow), vec![In::D(rand(&[2, 3], 59, 0.5, 2.0)), In::F(Tensor::from_slice(&[2.0f64]).reshape([1, 1]))]);
}

#[test]
fn variadic() {
    use VariadicKind::*;
    for v in [Sum, Max, Min, Mean] {
        let ins = vec![
            In::D(normal(&[2, 3], 60)),
            In::D(normal(&[3], 61)),
            In::D(normal(&[2, 1], 62)),
        ];
        g1(Kernel::Variadic(v), ins);
    }
}

#[test]
fn matmul_and_gemm() {
    let mm = |a: &[i64], b: &[i64]| {
        g1(
            Kernel::MatMul,
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
    g1(Kernel::Gemm(gemm), ins);
    let plain = Gemm {
        alpha: 1.0,
        beta: 1.0,
        trans_a: false,
        trans_b: false,
    };
    g1(
        Kernel::Gemm(plain),
        vec![
            In::D(normal(&[2, 3], 75)),
            In::D(normal(&[3, 4], 76)),
            In::N,
        ],
    );
}

#[test]
fn conv_variants() {
    let conv = |w: Window, group| Kernel::Conv(Conv { window: w, group });
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
        Kernel::ConvTranspose(ConvTranspose {
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
    gradcheck(&Kernel::MaxPool(p.clone()), vec![x()], 1);
    g1(Kernel::AveragePool(p), vec![x()]);
    let p = pool(
        win(&[2, 2], &[1, 2], &[1, 1, 1, 1], &[2, 1], AutoPad::NotSet),
        false,
        true,
    );
    gradcheck(&Kernel::MaxPool(p.clone()), vec![x()], 1);
    g1(Kernel::AveragePool(p), vec![x()]);
    let p = pool(win(&[2], &[2], &[], &[], AutoPad::SameUpper), false, false);
    g1(
        Kernel::AveragePool(p.clone()),
        vec![In::D(normal(&[2, 1, 5], 101))],
    );
    gradcheck(&Kernel::MaxPool(p), vec![In::D(normal(&[2, 1, 5], 102))], 1);
    let p = pool(
        win(&[2, 2, 2], &[1, 1, 1], &[], &[], AutoPad::NotSet),
        false,
        false,
    );
    g1(
        Kernel::AveragePool(p.clone()),
        vec![In::D(normal(&[1, 1, 3, 3, 3], 103))],
    );
    gradcheck(
        &Kernel::MaxPool(p),
        vec![In::D(normal(&[1, 1, 3, 3, 3], 104))],
        1,
    );
    g1(
        Kernel::GlobalAveragePool,
        vec![In::D(normal(&[2, 3, 2, 2], 105))],
    );
    g1(
        Kernel::GlobalMaxPool,
        vec![In::D(normal(&[2, 3, 2, 2], 106))],
    );
}

#[test]
fn normalisations() {
    let bn = Kernel::BatchNormalization(BatchNorm {
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
        let ln = Kernel::LayerNormalization(LayerNorm {
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
    let inorm = Kernel::InstanceNormalization { epsilon: 1e-5 };
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
                Kernel::Softmax(s.clone()),
                vec![In::D(normal(&[2, 3, 4], 130))],
            );
            g1(Kernel::LogSoftmax(s), vec![In::D(normal(&[2, 3, 4], 131))]);
        }
    }
}

#[test]
fn shape_ops() {
    let x = || In::D(normal(&[2, 3, 4], 140));
    g1(
        Kernel::Reshape { allow_zero: false },
        vec![x(), In::F(i64s(&[0, -1], &[2]))],
    );
    g1(Kernel::Flatten { axis: 2 }, vec![x()]);
    g1(
        Kernel::Transpose {
            perm: Some(vec![2, 0, 1]),
        },
        vec![x()],
    );
    g1(
        Kernel::Squeeze { axes: None },
        vec![In::D(normal(&[2, 1, 3], 141)), In::F(i64s(&[-2], &[1]))],
    );
    g1(
        Kernel::Unsqueeze {
            axes: Some(vec![0, -1]),
        },
        vec![x()],
    );
    g1(
        Kernel::Concat { axis: 1 },
        vec![x(), In::D(normal(&[2, 2, 4], 142))],
    );
    let split = Split {
        axis: 1,
        split: None,
        num_outputs: Some(2),
    };
    gradcheck(&Kernel::Split(split), vec![x()], 2);
    let split = Split {
        axis: 2,
        split: None,
        num_outputs: None,
    };
    gradcheck(
        &Kernel::Split(split),
        vec![x(), In::F(i64s(&[1, 3], &[2]))],
        2,
    );
    let sl = Kernel::Slice(Slice { attrs: None });
    let ins = vec![
        x(),
        In::F(i64s(&[-1, 0], &[2])),
        In::F(i64s(&[-5, 3], &[2])),
        In::F(i64s(&[2, 1], &[2])),
        In::F(i64s(&[-2, 2], &[2])),
    ];
    g1(sl, ins);
    let sl = Kernel::Slice(Slice {
        attrs: Some((vec![1], vec![100], Some(vec![1]))),
    });
    g1(sl, vec![x()]);
    g1(
        Kernel::Gather { axis: 1 },
        vec![x(), In::F(i64s(&[-1, 0, 2, 2], &[2, 2]))],
    );
    g1(
        Kernel::Gather { axis: 0 },
        vec![x(), In::F(i64s(&[1], &[]))],
    );
    let idx = i64s(&[0, 2, -1, 1, 1, 0], &[2, 3, 1]);
    g1(Kernel::GatherElements { axis: 2 }, vec![x(), In::F(idx)]);
    // GatherND: index pairs into the first two axes (one repeated, one negative), and one
    // index per batch row with batch_dims = 1.
    g1(Kernel::GatherNd { batch_dims: 0 }, vec![x(), In::F(i64s(&[1, 2, 0, -1, 1, 2], &[3, 2]))]);
    g1(Kernel::GatherNd { batch_dims: 1 }, vec![x(), In::F(i64s(&[2, 0, 1, 1], &[2, 2, 1]))]);
    g1(
        Kernel::Expand,
        vec![In::D(normal(&[3, 1], 143)), In::F(i64s(&[2, 1, 4], &[3]))],
    );
    let cond = Tensor::from_slice(&[true, false, true]);
    g1(
        Kernel::Where,
        vec![
            In::F(cond),
            In::D(normal(&[2, 3], 144)),
            In::D(normal(&[3], 145)),
        ],
    );
    g1(
        Kernel::Tile,
        vec![In::D(normal(&[2, 3], 146)), In::F(i64s(&[2, 1], &[2]))],
    );
    g1(
        Kernel::Trilu { upper: true },
        vec![In::D(normal(&[3, 4], 147)), In::F(Tensor::from(1i64))],
    );
    g1(
        Kernel::Trilu { upper: false },
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
    g1(Kernel::Resize(rs(ResizeMode::Nearest, CoordMode::Asymmetric)), vec![x(), In::N, up]);
    g1(Kernel::Resize(rs(ResizeMode::Linear, CoordMode::HalfPixel)), vec![x(), In::N, f32s(&[1.0, 1.0, 1.7, 0.6])]);
    let cubic = Resize { exclude_outside: true, cubic_a: -0.5, ..rs(ResizeMode::Cubic, CoordMode::AlignCorners) };
    g1(Kernel::Resize(cubic), vec![x(), In::N, In::N, In::F(i64s(&[1, 2, 3, 7], &[4]))]);
    g1(Kernel::Resize(rs(ResizeMode::Cubic, CoordMode::HalfPixel)), vec![x(), In::N, down]);
    for mode in [ResizeMode::Linear, ResizeMode::Cubic] {
        let aa = Resize { antialias: true, ..rs(mode, CoordMode::PytorchHalfPixel) };
        g1(Kernel::Resize(aa), vec![x(), In::N, f32s(&[1.0, 1.0, 0.6, 0.5])]);
    }
    let crop = Resize { extrapolation: 2.5, axes: Some(vec![3, 2]), ..rs(ResizeMode::Linear, CoordMode::TfCropAndResize) };
    g1(Kernel::Resize(crop), vec![x(), f32s(&[0.2, 0.4, 1.3, 0.9]), In::N, In::F(i64s(&[6, 3], &[2]))]);
    let legacy = Resize { legacy: true, nearest: NearestMode::Floor, ..rs(ResizeMode::Linear, CoordMode::Asymmetric) };
    g1(Kernel::Resize(legacy), vec![x(), f32s(&[1.0, 1.0, 2.0, 3.0])]);
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
        let k = Kernel::GridSample { mode, padding, align_corners };
        g1(k, vec![In::D(normal(&[2, 2, 4, 5], 160 + i as u64)), grid(&[2, 3, 2, 2], 170 + i as u64)]);
    }
    // Nearest: only the input has a gradient (the grid's is zero almost everywhere).
    let k = Kernel::GridSample { mode: ResizeMode::Nearest, padding: GridPadding::Border, align_corners: false };
    g1(k, vec![In::D(normal(&[1, 2, 4, 5], 180)), In::F(rand(&[1, 3, 2, 2], 181, -1.2, 1.2))]);
    let k = Kernel::GridSample { mode: ResizeMode::Linear, padding: GridPadding::Zeros, align_corners: false };
    g1(k, vec![In::D(normal(&[1, 1, 3, 2, 2], 182)), grid(&[1, 2, 2, 2, 3], 183)]);
}

/// AffineGrid: the grid is linear in theta (2-D and 3-D).
#[test]
fn affine_grid() {
    for align_corners in [false, true] {
        let k = Kernel::AffineGrid { align_corners };
        g1(k.clone(), vec![In::D(normal(&[2, 2, 3], 190)), In::F(i64s(&[2, 3, 4, 5], &[4]))]);
        g1(k, vec![In::D(normal(&[1, 3, 4], 191)), In::F(i64s(&[1, 1, 2, 3, 4], &[5]))]);
    }
}

/// Col2Im (overlapping blocks add up; strides, dilations, pads and a 3-D image) and
/// CenterCropPad (a crop on one axis, a pad on another).
#[test]
fn col2im_and_center_crop_pad() {
    let k = |d: &[i64], p: &[i64], s: &[i64]| Kernel::Col2Im { dilations: d.to_vec(), pads: p.to_vec(), strides: s.to_vec() };
    let ints = |v: &[i64]| In::F(i64s(v, &[v.len() as i64]));
    g1(k(&[], &[], &[]), vec![In::D(normal(&[2, 4, 12], 200)), ints(&[4, 5]), ints(&[2, 2])]);
    g1(k(&[1, 2], &[1, 0, 1, 1], &[2, 1]), vec![In::D(normal(&[1, 6, 8], 201)), ints(&[4, 5]), ints(&[3, 2])]);
    g1(k(&[], &[], &[]), vec![In::D(normal(&[1, 4, 6], 202)), ints(&[3, 2, 3]), ints(&[1, 2, 2])]);
    let crop = Kernel::CenterCropPad { axes: Some(vec![-1, 1]) };
    g1(crop, vec![In::D(normal(&[2, 5, 6], 203)), ints(&[3, 8])]);
}

/// LpPool with p = 2 and 3: explicit pads, strides with dilations, ceil mode.
#[test]
fn lp_pool() {
    let pool = |w, ceil_mode| Pool { window: w, ceil_mode, count_include_pad: false };
    let x = || In::D(normal(&[1, 2, 5, 5], 210));
    let k = |w, ceil, p| Kernel::LpPool { pool: pool(w, ceil), p };
    g1(k(win(&[2, 2], &[], &[1, 0, 0, 1], &[], AutoPad::NotSet), false, 2), vec![x()]);
    g1(k(win(&[2, 2], &[2, 1], &[], &[1, 2], AutoPad::NotSet), false, 3), vec![x()]);
    g1(k(win(&[2, 2], &[2, 2], &[], &[], AutoPad::NotSet), true, 2), vec![x()]);
}

/// DepthToSpace and SpaceToDepth in both channel orders (reshape, transpose, reshape).
#[test]
fn block_moves() {
    for crd in [false, true] {
        g1(Kernel::DepthToSpace { blocksize: 2, crd }, vec![In::D(normal(&[2, 8, 2, 3], 151))]);
        g1(Kernel::SpaceToDepth { blocksize: 2, crd }, vec![In::D(normal(&[2, 2, 4, 6], 152))]);
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
        let p = Kernel::Pad(Pad { mode, attrs: None });
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
    let p = Kernel::Pad(Pad {
        mode: PadMode::Reflect,
        attrs: Some((vec![0, 2, 0, 2], 0.0)),
    });
    g1(p, vec![In::D(normal(&[2, 3], 152))]);
}

#[test]
fn cumsum_variants() {
    for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
        let k = Kernel::CumSum { exclusive, reverse };
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
            g1(Kernel::Reduce(r), vec![In::D(x())]);
        }
        let r = Reduce {
            kind,
            axes: None,
            keepdims: false,
            noop_with_empty_axes: false,
        };
        g1(
            Kernel::Reduce(r.clone()),
            vec![In::D(x()), In::F(i64s(&[1], &[1]))],
        );
        g1(Kernel::Reduce(r), vec![In::D(x())]);
    }
}

#[test]
fn einsum() {
    let e = |eq: &str| Kernel::Einsum {
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
    use pipewright_runtime::exec::{run, run_used, Mode};
    for axis in [-1i64, 1] {
        let k = Kernel::LayerNormalization(LayerNorm { axis, epsilon: 1e-5, stash_type: 1 });
        let sshape: &[i64] = if axis == 1 { &[3, 4] } else { &[4] };
        let leaves = [normal(&[2, 3, 4], 130), normal(sshape, 131), normal(sshape, 132)].map(|t| t.set_requires_grad(true));
        let w = normal(&[2, 3, 4], 133);
        let grads = |fused: bool| {
            let ins: Vec<Option<&Tensor>> = leaves.iter().map(Some).collect();
            let y = if fused { run_used(&k, &ins, Mode::Train, &[true, false, false]) } else { run(&k, &ins, Mode::Train) }.unwrap().remove(0);
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
