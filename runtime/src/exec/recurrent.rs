//! The stateful sequence ops of opset 27: LinearAttention (the linear, gated, delta and
//! gated-delta recurrences of linear-attention and DeltaNet layers) and
//! CausalConvWithState (the causal depthwise convolution in front of them).
//!
//! LinearAttention runs the recurrence token by token, as ONNX defines it, from
//! differentiable libtorch ops (elementwise products and batched matmuls), so autograd
//! gives the backward pass through time; half-precision inputs are computed in f32 as the
//! reference does. The convolution is one grouped conv1d over the carried state
//! concatenated with the input.

use tch::{Kind, Tensor};

use super::util::{invalid, kind, need, opt, R};
use pipewright_ops::op::LinearAttention;

/// `[batch, seq, heads * d]` as `[batch, heads, seq, d]`.
fn unpack(x: &Tensor, heads: i64, name: &str) -> R<Tensor> {
    let s = x.size();
    let [b, t, hd] = s[..] else { return Err(invalid(format!("{name} must be 3-D [batch, seq, heads * d], got {s:?}"))) };
    if heads <= 0 || hd % heads != 0 {
        return Err(invalid(format!("{name}'s last axis {hd} is not a multiple of {heads} heads")));
    }
    Ok(x.f_reshape([b, t, heads, hd / heads])?.f_transpose(1, 2)?)
}

/// f32 for half-precision inputs (the recurrence accumulates), else the input's kind.
fn compute_kind(k: Kind) -> Kind {
    if matches!(k, Kind::Half | Kind::BFloat16) { Kind::Float } else { k }
}

/// LinearAttention: outputs `[batch, seq, q_heads * d_v]` and the final state
/// `[batch, kv_heads, d_k, d_v]`.
pub(crate) fn linear_attention(la: &LinearAttention, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let (q, k, v) = (need(ins, 0)?, need(ins, 1)?, need(ins, 2)?);
    let out_kind = kind(q)?;
    let ck = compute_kind(out_kind);
    let q4 = unpack(q, la.q_num_heads, "query")?.f_to_kind(ck)?;
    let k4 = unpack(k, la.kv_num_heads, "key")?.f_to_kind(ck)?;
    let v4 = unpack(v, la.kv_num_heads, "value")?.f_to_kind(ck)?;
    let (qs, ks, vs) = (q4.size(), k4.size(), v4.size());
    let (b, t, d_k, d_v) = (qs[0], qs[2], qs[3], vs[3]);
    if ks[0] != b || vs[0] != b || ks[2] != t || vs[2] != t || ks[3] != d_k {
        return Err(invalid(format!("query {:?}, key {:?} and value {:?} do not match", q.size(), k.size(), v.size())));
    }
    let group = la.q_num_heads / la.kv_num_heads.max(1);
    let hkv = la.kv_num_heads;
    let (decay, beta) = (opt(ins, 4), opt(ins, 5));
    if la.update_rule.gated() != decay.is_some() || la.update_rule.delta() != beta.is_some() {
        return Err(invalid("the update rule's decay and beta inputs do not match the inputs given"));
    }
    // Per step: decay [b, hkv, t, 1 or d_k], beta [b, 1 or hkv, t, 1].
    let decay4 = match decay {
        Some(g) if g.size().last() == Some(&hkv) => Some(g.f_reshape([b, t, hkv, 1])?.f_transpose(1, 2)?.f_to_kind(ck)?),
        Some(g) => Some(unpack(g, hkv, "decay")?.f_to_kind(ck)?),
        None => None,
    };
    let beta4 = match beta {
        Some(x) => {
            let last = *x.size().last().ok_or_else(|| invalid("beta must be 3-D"))?;
            Some(x.f_reshape([b, t, last, 1])?.f_transpose(1, 2)?.f_to_kind(ck)?)
        }
        None => None,
    };
    let (mut state, state_kind) = match opt(ins, 3) {
        Some(p) => {
            if p.size() != [b, hkv, d_k, d_v] {
                return Err(invalid(format!("past_state {:?} must be [{b}, {hkv}, {d_k}, {d_v}]", p.size())));
            }
            (p.f_to_kind(ck)?, kind(p)?)
        }
        None => (Tensor::f_zeros([b, hkv, d_k, d_v], (ck, q.device()))?, out_kind),
    };
    let scale = if la.scale == 0.0 { 1.0 / (d_k as f64).sqrt() } else { la.scale as f64 };
    let mut outs = Vec::with_capacity(t as usize);
    for i in 0..t {
        let (q_t, k_t) = (q4.f_select(2, i)?, k4.f_select(2, i)?);
        let mut v_t = v4.f_select(2, i)?;
        if let Some(g) = &decay4 {
            state = state.f_mul(&g.f_select(2, i)?.f_exp()?.f_unsqueeze(-1)?)?;
        }
        if let Some(bt) = &beta4 {
            // S^T k: [b, hkv, 1, d_k] @ [b, hkv, d_k, d_v].
            let retrieved = k_t.f_unsqueeze(-2)?.f_matmul(&state)?.f_squeeze_dim(-2)?;
            v_t = bt.f_select(2, i)?.f_mul(&v_t.f_sub(&retrieved)?)?;
        }
        state = state.f_add(&k_t.f_unsqueeze(-1)?.f_mul(&v_t.f_unsqueeze(-2)?)?)?;
        let read = if group > 1 { state.f_repeat_interleave_self_int(group, Some(1), None)? } else { state.shallow_clone() };
        outs.push(q_t.f_unsqueeze(-2)?.f_matmul(&read)?.f_squeeze_dim(-2)?.f_mul_scalar(scale)?);
    }
    let y = Tensor::f_stack(&outs, 2)?.f_transpose(1, 2)?.f_reshape([b, t, la.q_num_heads * d_v])?.f_to_kind(out_kind)?;
    Ok(vec![y, state.f_to_kind(state_kind)?])
}

/// CausalConvWithState: Y (the input's shape) and the last `k - 1` positions of the
/// carried state followed by the input.
pub(crate) fn causal_conv_with_state(silu: bool, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let (x, w) = (need(ins, 0)?, need(ins, 1)?);
    let (xs, ws) = (x.size(), w.size());
    let (&[b, c, _], &[wc, 1, k]) = (&xs[..], &ws[..]) else {
        return Err(invalid(format!("input {xs:?} must be [batch, channels, length] and weight {ws:?} [channels, 1, k]")));
    };
    if wc != c || k < 1 {
        return Err(invalid(format!("weight {ws:?} does not fit {c} channels")));
    }
    let x_kind = kind(x)?;
    let pad = match opt(ins, 3) {
        Some(p) if p.size() == [b, c, k - 1] => p.f_to_kind(x_kind)?,
        Some(p) => return Err(invalid(format!("past_state {:?} must be [{b}, {c}, {}]", p.size(), k - 1))),
        None => Tensor::f_zeros([b, c, k - 1], (x_kind, x.device()))?,
    };
    let padded = Tensor::f_cat(&[&pad, x], 2)?;
    let ck = compute_kind(x_kind);
    let bias = opt(ins, 2).map(|t| t.f_to_kind(ck)).transpose()?;
    let mut y = padded.f_to_kind(ck)?.f_conv1d(&w.f_to_kind(ck)?, bias.as_ref(), [1], [0], [1], c)?;
    if silu {
        y = y.f_mul(&y.f_sigmoid()?)?;
    }
    let total = padded.size()[2];
    let present = padded.f_narrow(2, total - (k - 1), k - 1)?;
    Ok(vec![y.f_to_kind(x_kind)?, present])
}
