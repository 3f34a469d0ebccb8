//! Attention's fused path (libtorch's scaled dot-product attention, taken when nobody
//! reads the scores) against its composed path (matmul, bias, guarded softmax, matmul,
//! which `grad.rs` checks by finite differences): the same Y and the same gradients of Q,
//! K and V, and the composed path wherever the fused kernels cannot follow ONNX.

mod common;

use common::normal;
use pipewright_ops::op::Attention;
use pipewright_ops::Op;
use pipewright_runtime::exec::{run_node, Mode, Signature};
use tch::{Kind, Tensor};

fn attention(is_causal: bool, heads: Option<(i64, i64)>) -> Attention {
    Attention {
        is_causal,
        q_num_heads: heads.map(|h| h.0),
        kv_num_heads: heads.map(|h| h.1),
        qk_matmul_output_mode: 0,
        scale: Some(0.3),
        softcap: 0.0,
        softmax_precision: None,
        left_window_size: -1,
        right_window_size: -1,
    }
}

/// Y and the gradients of Q, K and V of `sum(Y * w)`, with only Y read (`fused`) or every
/// output read; and whether the scores came back as the fused path's empty placeholder.
fn run(at: &Attention, qkv: [&Tensor; 3], mask: Option<&Tensor>, fused: bool) -> (Vec<Tensor>, bool) {
    let leaves: Vec<Tensor> = qkv.iter().map(|t| t.detach().set_requires_grad(true)).collect();
    let inputs = [Some(&leaves[0]), Some(&leaves[1]), Some(&leaves[2]), mask];
    let used = [true, false, false, !fused];
    let out = run_node(&Op::Attention(at.clone()), Signature::NONE, &inputs, Mode::Train, Some(&used)).expect("attention runs");
    let w = normal(&out[0].size(), 301);
    (&out[0] * &w).sum(Kind::Double).backward();
    let placeholder = out[3].numel() == 0;
    let mut results = vec![out[0].detach()];
    results.extend(leaves.iter().map(|l| l.grad()));
    (results, placeholder)
}

/// The fused and composed paths agree to f64 rounding; `expect_fused` says which path the
/// only-Y run must have taken.
fn agree(at: Attention, qkv: [Tensor; 3], mask: Option<Tensor>, expect_fused: bool) {
    let refs = [&qkv[0], &qkv[1], &qkv[2]];
    let (fused, placeholder) = run(&at, refs, mask.as_ref(), true);
    let (composed, _) = run(&at, refs, mask.as_ref(), false);
    assert_eq!(placeholder, expect_fused, "{at:?}: fused path taken = {placeholder}");
    for (what, (a, b)) in ["Y", "dQ", "dK", "dV"].iter().zip(fused.iter().zip(&composed)) {
        assert!(a.isfinite().all().int64_value(&[]) == 1, "{what} not finite: {at:?}");
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-10, "{what} differs by {diff:e}: {at:?}");
    }
}

fn qkv(q: &[i64], k: &[i64], v: &[i64]) -> [Tensor; 3] {
    [normal(q, 201), normal(k, 202), normal(v, 203)]
}

#[test]
fn the_fused_path_computes_what_the_composed_one_does() {
    let four = || qkv(&[2, 2, 3, 4], &[2, 2, 5, 4], &[2, 2, 5, 3]);
    agree(attention(false, None), four(), None, true);
    // A float mask broadcast over batch and heads.
    agree(attention(false, None), four(), Some(normal(&[3, 5], 204)), true);
    // A boolean mask whose first query row attends no key: zeros there, finite gradients.
    let allowed: Vec<bool> = (0..15).map(|i| i >= 5 && i % 3 != 1).collect();
    agree(attention(false, None), four(), Some(Tensor::from_slice(&allowed).reshape([1, 1, 3, 5])), true);
    // The causal frontier, without a mask.
    agree(attention(true, None), qkv(&[2, 2, 5, 4], &[2, 2, 5, 4], &[2, 2, 5, 3]), None, true);
    // 3-D packed heads, grouped-query (4 query heads over 2 key/value heads).
    agree(attention(false, Some((4, 2))), qkv(&[2, 3, 12], &[2, 4, 6], &[2, 4, 4]), None, true);
}

#[test]
fn what_the_fused_kernels_cannot_follow_takes_the_composed_path() {
    let four = || qkv(&[2, 2, 3, 4], &[2, 2, 5, 4], &[2, 2, 5, 3]);
    // A mask with the causal frontier, a mask shorter than the keys, a mask that takes a
    // gradient, soft capping, a narrower softmax.
    agree(attention(true, None), four(), Some(normal(&[3, 5], 205)), false);
    agree(attention(false, None), four(), Some(normal(&[3, 4], 206)), false);
    agree(attention(false, None), four(), Some(normal(&[3, 5], 207).set_requires_grad(true)), false);
    let mut capped = attention(false, None);
    capped.softcap = 2.0;
    agree(capped, four(), None, false);
    // A softmax narrower than the inputs (f32 for these f64 ones).
    let mut narrow = attention(false, None);
    narrow.softmax_precision = Some(pipewright_ops::DType::F32);
    agree(narrow, four(), None, false);
}
