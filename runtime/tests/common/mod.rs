//! Test helpers: deterministic inputs and a finite-difference gradient check that compares
//! libtorch autograd with central differences in f64.

#![allow(dead_code)]

use pipewright_runtime::exec::{run, Mode};
use pipewright_ops::Op;
use tch::{Kind, Tensor};

/// One kernel input for a gradient check.
pub enum In {
    /// A differentiable f64 input (checked).
    D(Tensor),
    /// A fixed input (indices, shapes, bounds): not differentiated.
    F(Tensor),
    /// An absent optional input.
    N,
}

/// Deterministic pseudo-random values in `[lo, hi)`.
pub fn uniform(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            lo + (hi - lo) * u
        })
        .collect()
}

/// An f64 tensor of `shape` with values in `[lo, hi)`.
pub fn rand(shape: &[i64], seed: u64, lo: f64, hi: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    Tensor::from_slice(&uniform(n as usize, seed, lo, hi)).reshape(shape)
}

/// Values of magnitude in `[0.2, 1.5)` with random signs (away from kinks at 0).
pub fn signed(shape: &[i64], seed: u64) -> Tensor {
    let n: i64 = shape.iter().product();
    let mags = uniform(n as usize, seed, 0.2, 1.5);
    let signs = uniform(n as usize, seed ^ 0x9e37, 0.0, 1.0);
    let v: Vec<f64> = mags
        .iter()
        .zip(&signs)
        .map(|(m, s)| if *s < 0.5 { -m } else { *m })
        .collect();
    Tensor::from_slice(&v).reshape(shape)
}

/// Standard-normal-ish values (for general inputs).
pub fn normal(shape: &[i64], seed: u64) -> Tensor {
    rand(shape, seed, -1.5, 1.5)
}

pub fn i64s(v: &[i64], shape: &[i64]) -> Tensor {
    Tensor::from_slice(v).reshape(shape)
}

pub fn f64s(v: &[f64], shape: &[i64]) -> Tensor {
    Tensor::from_slice(v).reshape(shape)
}

pub fn to_f64(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap()
}

pub fn to_i64(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(&t.to_kind(Kind::Int64).reshape([-1])).unwrap()
}

pub fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "length: got {got:?}, want {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: got {g}, want {w} (all: {got:?})"
        );
    }
}

/// Runs `k` with `inputs`, returning its outputs.
pub fn eval(k: &Op, inputs: &[Option<&Tensor>], mode: Mode) -> Vec<Tensor> {
    run(k, inputs, mode).unwrap_or_else(|e| panic!("{e}"))
}

/// The scalar loss `sum_i sum(out_i * w_i)` over the first `n_out` floating outputs.
fn loss(k: &Op, xs: &[Option<Tensor>], n_out: usize, weights: &[Tensor]) -> Tensor {
    let refs: Vec<Option<&Tensor>> = xs.iter().map(|x| x.as_ref()).collect();
    let outs = eval(k, &refs, Mode::Train);
    let mut total = Tensor::from(0.0f64);
    for (o, w) in outs.iter().take(n_out).zip(weights) {
        if matches!(o.kind(), Kind::Double) {
            total += (o * w).sum(Kind::Double);
        }
    }
    total
}

/// Checks every differentiable input's autograd gradient against central differences
/// (eps 1e-6, relative tolerance 1e-5) of a random weighting of the first `n_out` outputs.
pub fn gradcheck(k: &Op, inputs: Vec<In>, n_out: usize) {
    let mut xs: Vec<Option<Tensor>> = Vec::new();
    let mut diff = Vec::new();
    for (i, inp) in inputs.into_iter().enumerate() {
        match inp {
            In::D(t) => {
                assert_eq!(t.kind(), Kind::Double, "differentiable inputs must be f64");
                diff.push(i);
                xs.push(Some(t.set_requires_grad(true)));
            }
            In::F(t) => xs.push(Some(t)),
            In::N => xs.push(None),
        }
    }
    let refs: Vec<Option<&Tensor>> = xs.iter().map(|x| x.as_ref()).collect();
    let outs = eval(k, &refs, Mode::Train);
    assert!(
        outs.len() >= n_out,
        "{} produced {} outputs, wanted {n_out}",
        k.name(),
        outs.len()
    );
    let weights: Vec<Tensor> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| rand(&o.size(), 1000 + i as u64, -1.0, 1.0))
        .collect();
    let l = loss(k, &xs, n_out, &weights);
    let leaves: Vec<&Tensor> = diff.iter().map(|&i| xs[i].as_ref().unwrap()).collect();
    let grads = Tensor::run_backward(&[&l], &leaves, false, false);
    for (gi, &i) in diff.iter().enumerate() {
        let numeric = numeric_grad(k, &xs, i, n_out, &weights);
        let analytic = to_f64(&grads[gi]);
        for (j, (a, n)) in analytic.iter().zip(&numeric).enumerate() {
            assert!(
                (a - n).abs() <= 1e-5 * (1.0 + n.abs()),
                "{}: d/d(input {i})[{j}]: autograd {a} vs finite difference {n}",
                k.name()
            );
        }
    }
}

fn numeric_grad(
    k: &Op,
    xs: &[Option<Tensor>],
    i: usize,
    n_out: usize,
    w: &[Tensor],
) -> Vec<f64> {
    let eps = 1e-6;
    let x = xs[i].as_ref().unwrap().detach();
    let shape = x.size();
    let base = to_f64(&x);
    let at = |j: usize, d: f64| -> f64 {
        let mut v = base.clone();
        v[j] += d;
        let mut ys: Vec<Option<Tensor>> =
            xs.iter().map(|t| t.as_ref().map(|t| t.detach())).collect();
        ys[i] = Some(Tensor::from_slice(&v).reshape(&shape));
        tch::no_grad(|| loss(k, &ys, n_out, w).double_value(&[]))
    };
    (0..base.len())
        .map(|j| (at(j, eps) - at(j, -eps)) / (2.0 * eps))
        .collect()
}
