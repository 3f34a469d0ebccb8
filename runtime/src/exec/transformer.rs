//! The transformer ops modern exporters emit: Attention (opsets 23-25), RMSNormalization
//! and RotaryEmbedding (opset 23).
//!
//! All three are composed from differentiable libtorch ops (matmul, softmax, masked fill,
//! gathers, concatenations), so autograd trains through them. Attention's masking is
//! built as one additive bias (`0` where a key may be attended, `-inf` where not, plus a
//! float mask's values); a query row whose bias is `-inf` everywhere has no key to attend
//! and gives zeros, as ONNX defines, never NaN, in the forward or the backward pass.

use tch::{Device, Kind, Tensor};

use super::util::{invalid, kind, need, norm_axis, opt, R};
use super::convert::kind_of;
use pipewright_ops::op::{Attention, LayerNorm, Rotary};

/// Attention: outputs Y, present key, present value (the cache with K and V appended, or
/// K and V themselves as `[batch, heads, seq, head_size]`) and the scores of
/// `qk_matmul_output_mode`.
///
/// When nobody reads the scores (`scores_read` false) and nothing but a mask or the causal
/// frontier applies, libtorch's scaled dot-product attention computes Y in one fused
/// kernel ([`fused_attention`]); the scores output is then an empty placeholder.
pub(crate) fn attention(at: &Attention, ins: &[Option<&Tensor>], scores_read: bool) -> R<Vec<Tensor>> {
    let (q, k, v) = (need(ins, 0)?, need(ins, 1)?, need(ins, 2)?);
    let rank = q.dim();
    if k.dim() != rank || v.dim() != rank {
        return Err(invalid(format!("Q, K and V differ in rank: {:?}, {:?}, {:?}", q.size(), k.size(), v.size())));
    }
    let q4 = split_heads(q, at.q_num_heads, "Q")?;
    let (mut k4, mut v4) = (split_heads(k, at.kv_num_heads, "K")?, split_heads(v, at.kv_num_heads, "V")?);
    check_heads(&q4, &k4, &v4)?;
    if !scores_read {
        if let Some(y) = fused_attention(at, ins, (&q4, &k4, &v4))? {
            let y = if rank == 3 { y.f_transpose(1, 2)?.f_reshape([q.size()[0], q4.size()[2], -1])? } else { y };
            let placeholder = Tensor::f_empty([0], (kind(q)?, q.device()))?;
            return Ok(vec![y, k4, v4, placeholder]);
        }
    }
    let past = match (opt(ins, 4), opt(ins, 5)) {
        (Some(pk), Some(pv)) => {
            k4 = Tensor::f_cat(&[pk, &k4], 2)?;
            v4 = Tensor::f_cat(&[pv, &v4], 2)?;
            Some(pk.size().get(2).copied().ok_or_else(|| invalid("past_key must be 4-D"))?)
        }
        (None, None) => None,
        _ => return Err(invalid("past_key and past_value must be given together")),
    };
    let nonpad = opt(ins, 6);
    if past.is_some() && nonpad.is_some() {
        return Err(invalid("nonpad_kv_seqlen cannot be combined with past_key/past_value"));
    }
    let (qs, ks) = (q4.size(), k4.size());
    let (sq, skv) = (qs[2], ks[2]);
    let bias = attention_bias(at, opt(ins, 3), past, nonpad, (sq, skv), kind(q)?, q.device())?;
    let (kr, vr) = repeat_kv(&k4, &v4, qs[1])?;
    let scores = scores(at, &q4, &kr)?;
    let capped = if at.softcap > 0.0 {
        let c = f64::from(at.softcap);
        scores.f_div_scalar(c)?.f_tanh()?.f_mul_scalar(c)?
    } else {
        scores.shallow_clone()
    };
    let logits = match &bias {
        Some(b) => capped.f_add(b)?,
        None => capped.shallow_clone(),
    };
    let probs = guarded_softmax(&logits, bias.as_ref(), at.softmax_precision.map(kind_of).transpose()?)?;
    let qk_out = match at.qk_matmul_output_mode {
        0 => scores,
        1 => capped,
        2 => logits,
        _ => probs.f_to_kind(kind(q)?)?,
    };
    // The probabilities return to the inputs' type before the second matmul (ONNX casts
    // the softmax output back to T1).
    let y = probs.f_to_kind(kind(q)?)?.f_to_kind(kind(&vr)?)?.f_matmul(&vr)?;
    let y = if rank == 3 { y.f_transpose(1, 2)?.f_reshape([qs[0], sq, -1])? } else { y };
    Ok(vec![y, k4, v4, qk_out])
}

/// Y by libtorch's scaled dot-product attention (flash or memory-efficient kernels where
/// the device and types allow, its math fallback elsewhere), or `None` when the node needs
/// what only the composed form does: soft capping, a past cache, `nonpad_kv_seqlen`, a
/// window, a mask together with the causal frontier, a mask that needs padding to the
/// keys, or a mask that takes a gradient (the fused kernels may not return one).
///
/// Same function: libtorch's kernels give a query row with no key to attend zeros, as ONNX
/// defines (the composed form's guard); they accumulate the softmax in fp32 for bf16 and
/// fp16 inputs, which covers a `softmax_precision` of fp32 there.
fn fused_attention(at: &Attention, ins: &[Option<&Tensor>], (q, k, v): (&Tensor, &Tensor, &Tensor)) -> R<Option<Tensor>> {
    let plain = at.softcap == 0.0 && at.left_window_size < 0 && at.right_window_size < 0 && (4..=6).all(|i| opt(ins, i).is_none());
    // The kernels run the softmax at least as wide as the inputs (fp32 for bf16/fp16): a
    // narrower `softmax_precision` than the inputs (f32 for f64) is the composed form's.
    let input_kind = kind(q)?;
    let wide_precision = at.softmax_precision.map_or(true, |p| p.is_float() && p.size() >= input_kind.elt_size_in_bytes());
    let mask = opt(ins, 3);
    let skv = k.size()[2];
    let mask_fits = mask.map_or(true, |m| m.dim() <= 4 && m.size().last() == Some(&skv) && !m.requires_grad() && !at.is_causal);
    if !(plain && wide_precision && mask_fits) {
        return Ok(None);
    }
    // A float mask is added in the inputs' type, as the composed form adds it.
    let mask = match mask {
        Some(m) if m.f_kind()? != Kind::Bool => Some(m.f_to_kind(input_kind)?),
        other => other.map(Tensor::shallow_clone),
    };
    let grouped = q.size()[1] != k.size()[1];
    let scale = at.scale.map(f64::from);
    Ok(Some(Tensor::f_scaled_dot_product_attention(q, k, v, mask.as_ref(), 0.0, at.is_causal, scale, grouped)?))
}

/// Q, K or V as `[batch, heads, seq, head_size]`: 3-D inputs pack the heads into their
/// last axis, `heads` coming from the attribute.
fn split_heads(t: &Tensor, heads: Option<i64>, name: &str) -> R<Tensor> {
    let s = t.size();
    match (s.len(), heads) {
        (4, _) => Ok(t.shallow_clone()),
        (3, Some(h)) if h > 0 && s[2] % h == 0 => Ok(t.f_reshape([s[0], s[1], h, s[2] / h])?.f_transpose(1, 2)?),
        (3, Some(h)) => Err(invalid(format!("{name} hidden size {} is not a multiple of {h} heads", s[2]))),
        (3, None) => Err(invalid("3-D inputs need q_num_heads and kv_num_heads")),
        (r, _) => Err(invalid(format!("{name} must be 3-D or 4-D, got rank {r}"))),
    }
}

/// Q `[b, q_heads, q_seq, d]`, K `[b, kv_heads, kv_seq, d]`, V `[b, kv_heads, kv_seq, dv]`:
/// the query heads group over the key/value heads and Q's head size is K's (both paths
/// rely on it).
fn check_heads(q: &Tensor, k: &Tensor, v: &Tensor) -> R<()> {
    let (q_heads, kv_heads) = (q.size()[1], k.size()[1]);
    if v.size()[1] != kv_heads || kv_heads == 0 || q_heads % kv_heads != 0 {
        return Err(invalid(format!("{q_heads} query heads do not group over {kv_heads} key and {} value heads", v.size()[1])));
    }
    if k.size()[3] != q.size()[3] {
        return Err(invalid(format!("Q head size {} differs from K head size {}", q.size()[3], k.size()[3])));
    }
    Ok(())
}

/// Grouped-query attention: each key/value head serves `q_heads / kv_heads` consecutive
/// query heads ([`check_heads`]), so K and V repeat each head in place (`h0, h0, h1, h1, ...`).
fn repeat_kv(k: &Tensor, v: &Tensor, q_heads: i64) -> R<(Tensor, Tensor)> {
    let kv_heads = k.size()[1];
    if q_heads == kv_heads {
        return Ok((k.shallow_clone(), v.shallow_clone()));
    }
    let r = q_heads / kv_heads;
    Ok((k.f_repeat_interleave_self_int(r, 1, None)?, v.f_repeat_interleave_self_int(r, 1, None)?))
}

/// `(Q * sqrt(scale)) (K * sqrt(scale))^T`: the scale is split over both operands against
/// overflow in narrow types, and rounded to the inputs' type first, as ONNX does.
fn scores(at: &Attention, q: &Tensor, k: &Tensor) -> R<Tensor> {
    let head = q.size()[3];
    let scale = at.scale.map_or(1.0 / (head as f64).sqrt(), f64::from);
    let s = Tensor::f_scalar_tensor(scale.sqrt(), (kind(q)?, q.device()))?;
    Ok(q.f_mul(&s)?.f_matmul(&k.f_mul(&s)?.f_transpose(-2, -1)?)?)
}

/// The additive bias of the mask, the causal frontier, the sliding window and the
/// padding of `nonpad_kv_seqlen`, broadcastable to `[batch, heads, q_seq, kv_seq]`;
/// `None` when nothing is masked.
fn attention_bias(
    at: &Attention,
    mask: Option<&Tensor>,
    past: Option<i64>,
    nonpad: Option<&Tensor>,
    (sq, skv): (i64, i64),
    k: Kind,
    dev: Device,
) -> R<Option<Tensor>> {
    let mut bias = match mask {
        Some(m) => Some(mask_bias(m, skv, k)?),
        None => None,
    };
    if let Some(allowed) = positional_allowed(at, past, nonpad, (sq, skv), dev)? {
        let b = allowed_to_bias(&allowed, k)?;
        bias = Some(match bias {
            Some(m) => m.f_add(&b)?,
            None => b,
        });
    }
    Ok(bias)
}

/// The attention mask as an additive bias: booleans mark attended keys (`0`, else
/// `-inf`), other types are added as they are. A mask shorter than the keys is padded
/// with `-inf` (the keys past it are not attended).
fn mask_bias(m: &Tensor, skv: i64, k: Kind) -> R<Tensor> {
    let m = if m.f_kind()? == Kind::Bool { allowed_to_bias(m, k)? } else { m.f_to_kind(k)? };
    let mut shape = m.size();
    let last = *shape.last().ok_or_else(|| invalid("attn_mask is a scalar"))?;
    if last > skv {
        return Err(invalid(format!("attn_mask covers {last} keys, more than the {skv} there are")));
    }
    if last == skv {
        return Ok(m);
    }
    if let Some(l) = shape.last_mut() {
        *l = skv - last;
    }
    let pad = Tensor::f_full(shape.as_slice(), f64::NEG_INFINITY, (k, m.device()))?;
    Ok(Tensor::f_cat(&[&m, &pad], -1)?)
}

fn allowed_to_bias(allowed: &Tensor, k: Kind) -> R<Tensor> {
    let zero = Tensor::f_zeros([] as [i64; 0], (k, allowed.device()))?;
    Ok(zero.f_masked_fill(&allowed.f_logical_not()?, f64::NEG_INFINITY)?)
}

/// Which keys each query may attend by position: the causal frontier `j <= i + offset`,
/// the window `p - left <= j <= p + right` around the absolute position `p = i + offset`,
/// and the keys before `nonpad_kv_seqlen`. `offset` counts the valid keys before the
/// query block: the past length, `nonpad_kv_seqlen - q_seq` per batch for an external
/// cache, else 0. `[q, kv]` or `[batch, 1, q, kv]`; `None` when nothing applies.
fn positional_allowed(at: &Attention, past: Option<i64>, nonpad: Option<&Tensor>, (sq, skv): (i64, i64), dev: Device) -> R<Option<Tensor>> {
    let i = Tensor::f_arange(sq, (Kind::Int64, dev))?.f_reshape([sq, 1])?;
    let j = Tensor::f_arange(skv, (Kind::Int64, dev))?.f_reshape([1, skv])?;
    let nonpad = match nonpad {
        Some(n) => Some(n.f_to_kind(Kind::Int64)?.f_to_device(dev)?.f_reshape([-1, 1, 1, 1])?),
        None => None,
    };
    let pos = match (&nonpad, past) {
        (Some(n), None) => i.f_add(&n.f_sub_scalar(sq)?)?,
        _ => i.f_add_scalar(past.unwrap_or(0))?,
    };
    // `pos - j`: how far each key lies before the query's absolute position.
    let diff = pos.f_sub(&j)?;
    let mut allowed: Option<Tensor> = None;
    let mut and = |t: Tensor| -> R<()> {
        allowed = Some(match allowed.take() {
            Some(a) => a.f_logical_and(&t)?,
            None => t,
        });
        Ok(())
    };
    if at.is_causal {
        and(diff.f_ge(0)?)?;
    }
    if at.left_window_size >= 0 {
        and(diff.f_le(at.left_window_size)?)?;
    }
    if at.right_window_size >= 0 {
        and(diff.f_neg()?.f_le(at.right_window_size)?)?;
    }
    if let Some(n) = &nonpad {
        and(j.f_lt_tensor(n)?)?;
    }
    Ok(allowed)
}

/// Softmax over the keys, in `precision` when given. Rows whose bias masks every key are
/// zero: their logits are replaced before the softmax (which would give NaN) and the
/// result after it, so no NaN reaches the output or the gradient.
fn guarded_softmax(logits: &Tensor, bias: Option<&Tensor>, precision: Option<Kind>) -> R<Tensor> {
    let Some(bias) = bias else {
        return Ok(logits.f_softmax(-1, precision)?);
    };
    let empty = bias.f_amax([-1], true)?.f_isneginf()?;
    let safe = logits.f_masked_fill(&empty, 0.0)?;
    Ok(safe.f_softmax(-1, precision)?.f_masked_fill(&empty, 0.0)?)
}

/// RMSNormalization: `X / sqrt(mean(X^2 over axis..) + epsilon) * Scale`. The statistics
/// are taken in `stash_type` when it is wider than X (f16/bf16 inputs in f32); a wider X
/// is never narrowed.
pub(crate) fn rms_norm(ln: &LayerNorm, x: &Tensor, scale: &Tensor) -> R<Tensor> {
    let axis = norm_axis(ln.axis, x.dim())?;
    let dims: Vec<i64> = (axis..x.dim() as i64).collect();
    let k = kind(x)?;
    let stash = match ln.stash_type {
        1 => Kind::Float,
        11 => Kind::Double,
        _ => k,
    };
    let wide = if stash.elt_size_in_bytes() > k.elt_size_in_bytes() { stash } else { k };
    let xs = x.f_to_kind(wide)?;
    let mean_sq = xs.f_mul(&xs)?.f_mean_dim(dims.as_slice(), true, None)?;
    let normalized = xs.f_mul(&mean_sq.f_add_scalar(f64::from(ln.epsilon))?.f_rsqrt()?)?.f_to_kind(k)?;
    Ok(normalized.f_mul(scale)?)
}

/// RotaryEmbedding. The input is viewed as `[batch, seq, heads, head_size]`; the caches
/// are `[max_position, rotary_dim / 2]` rows picked by `position_ids`, or already
/// `[batch, seq, rotary_dim / 2]` without them.
pub(crate) fn rotary_embedding(r: &Rotary, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let (x, cos, sin) = (need(ins, 0)?, need(ins, 1)?, need(ins, 2)?);
    let shape = x.size();
    let x4 = match (shape.len(), r.num_heads) {
        (4, _) => x.f_transpose(1, 2)?,
        (3, Some(h)) if h > 0 && shape[2] % h == 0 => x.f_reshape([shape[0], shape[1], h, shape[2] / h])?,
        _ => return Err(invalid(format!("input {shape:?} must be 4-D, or 3-D with a num_heads dividing its last axis"))),
    };
    let head = x4.size()[3];
    let rd = if r.rotary_embedding_dim == 0 { head } else { r.rotary_embedding_dim };
    if rd > head || rd % 2 != 0 {
        return Err(invalid(format!("rotary_embedding_dim {rd} must be even and at most the head size {head}")));
    }
    let half = rd / 2;
    let (cos, sin) = match opt(ins, 3) {
        Some(p) => (cache_rows(cos, p)?, cache_rows(sin, p)?),
        None => (cos.shallow_clone(), sin.shallow_clone()),
    };
    if cos.size().last() != Some(&half) || sin.size().last() != Some(&half) {
        return Err(invalid(format!("the caches' last axis must be rotary_embedding_dim / 2 = {half}")));
    }
    let (cos, sin) = (cos.f_unsqueeze(2)?, sin.f_unsqueeze(2)?);
    let rot = x4.f_narrow(-1, 0, rd)?;
    let (x1, x2) = if r.interleaved {
        (rot.f_slice(-1, 0, None, 2)?, rot.f_slice(-1, 1, None, 2)?)
    } else {
        (rot.f_narrow(-1, 0, half)?, rot.f_narrow(-1, half, half)?)
    };
    let real = cos.f_mul(&x1)?.f_sub(&sin.f_mul(&x2)?)?;
    let imag = sin.f_mul(&x1)?.f_add(&cos.f_mul(&x2)?)?;
    let rotated = if r.interleaved {
        Tensor::f_stack(&[real, imag], -1)?.f_reshape(rot.size())?
    } else {
        Tensor::f_cat(&[real, imag], -1)?
    };
    let out = Tensor::f_cat(&[rotated, x4.f_narrow(-1, rd, head - rd)?], -1)?;
    Ok(if shape.len() == 3 { out.f_reshape(shape.as_slice())? } else { out.f_transpose(1, 2)? })
}

/// `cache[position_ids]`: the rows of a 2-D cache, shaped like the ids plus the cache's
/// last axis (a gather autograd differentiates into the cache too).
fn cache_rows(cache: &Tensor, ids: &Tensor) -> R<Tensor> {
    if cache.dim() != 2 {
        return Err(invalid(format!("with position_ids the caches must be 2-D, got {:?}", cache.size())));
    }
    let flat = ids.f_to_kind(Kind::Int64)?.f_reshape([-1])?;
    let mut shape = ids.size();
    shape.push(cache.size()[1]);
    Ok(cache.f_index_select(0, &flat)?.f_reshape(shape.as_slice())?)
}
