//! Attention: `softmax(scale * Q K^T + mask) V`, as exporters spell it out node by node,
//! becomes one `Attention` node (ONNX opset 23's op, with 4-D `[batch, heads, seq, head]`
//! inputs) that the runtime runs as libtorch's scaled dot-product attention.
//!
//! Why: spelled out, attention materialises its `[batch, heads, q_seq, kv_seq]` scores
//! several times (the product, the scaled and masked logits, the probabilities) and keeps
//! them for the backward pass; a fused kernel (flash or memory-efficient attention on a
//! GPU, the flash kernel on the CPU) computes the same function in tiles and keeps only the
//! output and one statistic per row. On a GPU in bf16 the spelled-out form costs GPT-2
//! small a large part of its step.
//!
//! The pattern, from the last node back, each part optional where marked:
//! - `MatMul(P, V)`, `P` the probabilities, through identity `Cast`s (optional) and
//!   the guard `Where(IsNaN(S), 0, S)` (optional; torch.onnx's dynamo exporter writes it so
//!   a row with no key to attend gives zeros, which is what `Attention` defines); or the
//!   same product taken in 3-D and split into heads after, `Reshape(MatMul(P', V'))` with
//!   `P'` and `V'` flattened to `[batch * heads, seq, _]` (BLOOM, DeBERTa-v2): the fused
//!   node reads the 4-D values they flatten, or adds the `Reshape` that splits them;
//! - `S = Softmax(L)` over the last axis of a 4-D value, through identity `Cast`s (T5);
//! - `L = (A + M...) / s` or `(A + M...) * s`, `s` a scalar constant (CodeGen scales the
//!   masked scores): the scale joins `A`'s and each mask is scaled by it, a `Mul` added;
//! - `L` through `Max(L, f)`, `f` a constant at most -1e4 (optional; XGLM clamps the
//!   masked logits at the lowest float), which changes nothing for a row that attends a key;
//! - `L = A + M` (either order; `M` a float mask whose last axis is the keys', up to four
//!   of them added one after the other, as MPNet adds a position bias and the padding
//!   mask: the fused node's mask is then their sum, nodes added), `L = Where(C, A, f)`
//!   (`C` a boolean mask, `f` a constant at most -1e4, low enough that its exponential is
//!   zero beside any attended key), `L = Where(C, f, A)` (DeBERTa's `masked_fill`: the
//!   keys kept are `Not(C)`, `C`'s operand when `C` is a `Not`, else a `Not` added), both
//!   at once as GPT-Neo writes them, `Where(C, A, f) + M` (the fused node's mask is then
//!   `Where(C, M, f)`, one node added), or `L = A`;
//! - `A` the 4-D split of 3-D scores `A' + M'` (BLOOM's `baddbmm(alibi, Q', K'^T)`: masks
//!   added in 3-D are split into heads by a `Reshape` added, or broadcast as they are when
//!   their first extent is 1), the 3-D product's Q and K flattened as V is;
//! - `A = c * MatMul(a * Q, b * K^T)` (or the same product as a 4-D `Einsum`, CvT's
//!   `bhlk,bhtk->bhlt` of Q and K themselves; the product with V likewise) with `a`, `b`,
//!   `c` products or divisions of scalar constants (each optional), so the scale is
//!   `a * b * c`; a trainable one-element weight may be such a factor (a fixed-batch
//!   dynamo export's `sqrt(scale)`), and is then folded into the scale, only where every
//!   read of it is ([`fuse_attention`]); a factor of 4-D scores that is the same along
//!   their last two axes (Swin-v2's trained per-head temperature `[heads, 1, 1]`)
//!   multiplies the fused node's Q instead, one `Mul` added;
//! - `K^T` a `Transpose` of a 4-D value (K is then that value with the permutation's last
//!   two axes swapped back: a `Transpose` is added where that is not the value itself), or
//!   `Reshape(Transpose(M))` through 3-D (`M = [batch * heads, seq, head]`; K is the 4-D
//!   value `M` reshapes, as the dynamo exporter writes it, or else `M` reshaped, a `Reshape`
//!   added: torchvision's sequence-first attention, grouped-query keys repeated in 5-D),
//!   or any other 4-D value, K^T as its producer laid it out (SqueezeBERT's channel-first
//!   keys): K is then that value with its last two axes swapped, a `Transpose` added.
//!
//! Q, K and V must have the same number of heads (a broadcast K is left alone) and one
//! float type. What changes: a `Where` mask sets the masked logits to minus infinity rather
//! than `f`, which differs only for a query row that may attend no key at all (the
//! spelled-out form averages V there, `Attention` gives zeros); masks added one after the
//! other are summed first, which rounds differently from adding them to the logits in turn
//! (by an ulp of the logits), and so does a per-head temperature applied to Q rather than
//! to the scores.

use pipewright_ops::op::{Attention, BinaryOp, UnaryOp, VariadicOp};

use super::pattern::{factors, one_element_weight, producer, producer_of, rewrite_node, scalar, unary_operand, Product};
use crate::infer::{broadcast, Ctx};
use crate::{DType, Dim, Graph, NodeId, Op, Shape, TensorData, TensorType, Value, ValueDef, ValueId, Weight};

/// The highest `Where` fill value read as "masked": `exp(-1e4 + s)` underflows to zero in
/// fp32 for any logit `s` a trained model produces, as `exp(-inf)` does.
const MASK_FILL_AT_MOST: f64 = -1.0e4;

/// An operand of the fused node in 4-D (Q, K, V, or a float mask added to the scores): a
/// value of the graph, a permutation of one (`K^T` was written as one `Transpose` of the
/// heads-last tensor, so K itself is not in the graph), or a reshape of one (the operand
/// exists only flattened to 3-D, `[batch * heads, seq, head]`: torchvision's
/// sequence-first attention, the grouped-query exports' keys repeated over the heads in
/// 5-D, BLOOM's ALiBi bias).
enum Operand {
    Value(ValueId),
    Permuted { of: ValueId, perm: Vec<i64> },
    Reshaped { of: ValueId, dims: Vec<Dim> },
    /// A mask times a constant: one added before the scores were scaled (CodeGen's
    /// `(Q K^T + M) / s`), scaled as the scores are.
    Scaled { of: ValueId, factor: f64 },
}

impl Operand {
    fn ty(&self, g: &Graph) -> TensorType {
        match self {
            Operand::Value(v) | Operand::Scaled { of: v, .. } => g.value(*v).ty.clone(),
            Operand::Permuted { of, perm } => {
                let t = &g.value(*of).ty;
                TensorType::new(t.dtype, Shape(perm.iter().map(|&a| t.shape.0[a as usize]).collect()))
            }
            Operand::Reshaped { of, dims } => TensorType::new(g.value(*of).ty.dtype, Shape(dims.clone())),
        }
    }

    /// The operand as a value of the graph, adding the `Transpose` or `Reshape` (node
    /// `{name}/{role}`) that makes it where needed.
    fn materialise(&self, g: &mut Graph, name: &str, role: &str) -> ValueId {
        let ty = self.ty(g);
        let out = format!("{name}/{role}");
        let n = match self {
            Operand::Value(v) => return *v,
            Operand::Permuted { of, perm } => g.add_node(out.clone(), Op::Transpose { perm: Some(perm.clone()) }, vec![Some(*of)], vec![Some((out, ty))]),
            Operand::Reshaped { of, dims } => {
                // The batch as -1 (the other extents are fixed, [`unflattened`] checks).
                let extents: Vec<i64> = dims.iter().map(|d| d.fixed().unwrap_or(-1)).collect();
                let shape = add_constant(g, format!("{out}_shape"), TensorData::from_i64s(vec![4], &extents));
                g.add_node(out.clone(), Op::Reshape { allow_zero: false }, vec![Some(*of), Some(shape)], vec![Some((out, ty))])
            }
            Operand::Scaled { of, factor } => {
                let c = add_constant(g, format!("{out}_factor"), TensorData::from_f64s(ty.dtype, vec![], &[*factor]));
                g.add_node(out.clone(), Op::Binary(BinaryOp::Mul), vec![Some(*of), Some(c)], vec![Some((out, ty))])
            }
        };
        g.node(n).outputs[0].expect("one output")
    }
}

/// A constant `data` added to `g` as value `name`.
fn add_constant(g: &mut Graph, name: String, data: TensorData) -> ValueId {
    let ty = TensorType::new(data.dtype, Shape::fixed(&data.dims));
    g.add_value(Value { name, ty, def: ValueDef::Weight(Weight { data, trainable: false }) })
}

/// A boolean mask of the keys attended: `cond` itself, or its negation when the scores
/// were written `Where(masked, fill, A)` (DeBERTa's `masked_fill`) of a condition that is
/// not a `Not` already.
struct Keep {
    cond: ValueId,
    fill: ValueId,
    negated: bool,
}

/// The mask the fused node reads: float masks added to the scores (`added`, in the order
/// they were added) and a boolean mask that keeps keys. One of them alone is read as it
/// is; more are combined by nodes added for it: their sum, and `Where(keep, sum, fill)`
/// (what `Where(keep, A, fill) + sum` adds to `A` wherever `keep` keeps a key; elsewhere
/// both give logits whose exponentials are zero).
struct Mask {
    added: Vec<Operand>,
    keep: Option<Keep>,
}

impl Mask {
    /// The mask as a value of the graph, adding the nodes that combine it where needed;
    /// `None` when its parts do not broadcast together.
    fn materialise(&self, g: &mut Graph, name: &str) -> Option<ValueId> {
        let ctx = Ctx { export_batch: g.batch.as_ref().and_then(|b| b.export_size) };
        let node = |g: &mut Graph, op: Op, inputs: Vec<ValueId>, dtype: DType, suffix: &str| -> Option<ValueId> {
            let shapes: Vec<Shape> = inputs.iter().map(|&v| g.value(v).ty.shape.clone()).collect();
            let ty = TensorType::new(dtype, broadcast(&shapes.iter().collect::<Vec<_>>(), ctx).ok()?);
            let n = g.add_node(format!("{name}/{suffix}"), op, inputs.into_iter().map(Some).collect(), vec![Some((format!("{name}/{suffix}"), ty))]);
            g.node(n).outputs[0]
        };
        let added: Vec<ValueId> = self.added.iter().enumerate().map(|(i, m)| m.materialise(g, name, &format!("mask_part{i}"))).collect();
        let keep = match &self.keep {
            Some(Keep { cond, fill, negated: true }) => Some((node(g, Op::Unary(UnaryOp::Not), vec![*cond], DType::Bool, "keep")?, *fill)),
            Some(Keep { cond, fill, negated: false }) => Some((*cond, *fill)),
            None => None,
        };
        let last = added.len().checked_sub(1);
        let mut sum = added.first().copied();
        for (i, &m) in added.iter().enumerate().skip(1) {
            let dtype = g.value(m).ty.dtype;
            let suffix = if keep.is_none() && Some(i) == last { "mask".to_string() } else { format!("mask_sum{i}") };
            sum = Some(node(g, Op::Binary(BinaryOp::Add), vec![sum?, m], dtype, &suffix)?);
        }
        match (sum, keep) {
            (Some(sum), Some((cond, fill))) => {
                let dtype = g.value(sum).ty.dtype;
                node(g, Op::Where, vec![cond, sum, fill], dtype, "mask")
            }
            (None, Some((cond, _))) => Some(cond),
            (sum, None) => sum,
        }
    }
}

/// One matched attention: the operands of the fused node.
struct Matched {
    q: Operand,
    /// Factors Q is multiplied by ([`ScaledProduct::q_factors`]).
    q_factors: Vec<ValueId>,
    k: Operand,
    v: Operand,
    mask: Option<Mask>,
    scale: f64,
    /// Trainable one-element weights read as factors of the scale, one entry per read.
    scale_weights: Vec<ValueId>,
    /// The type the spelled-out softmax ran in.
    softmax_type: DType,
}

/// What [`fuse_attention`] did.
#[derive(Debug, Default, PartialEq)]
pub struct FusedAttention {
    /// Attentions fused.
    pub count: usize,
    /// Trainable one-element weights whose every read was a factor of a fused attention's
    /// scale: their value is now the fused nodes' `scale` attribute, so they no longer
    /// train (the caller says so).
    pub frozen_scales: Vec<ValueId>,
}

/// Rewrites the last `MatMul` of each spelled-out attention into `Attention`. With
/// `fold_weight_scales`, a scale factor may be a trainable one-element weight, provided
/// every read of it is a factor of a fused attention's scale (the dynamo exporter writes a
/// fixed-batch export's `sqrt(scale)` so); otherwise such attentions stay spelled out.
pub fn fuse_attention(g: &mut Graph, fold_weight_scales: bool) -> FusedAttention {
    let uses = g.use_counts();
    let matched: Vec<(NodeId, Matched)> = g.node_ids().filter_map(|n| match_attention(g, &uses, n).map(|m| (n, m))).collect();
    // Each combined mask's nodes first: one whose parts do not broadcast leaves its
    // attention as it is, before the scale weights are counted below. (Nodes added for an
    // attention dropped after have no reader, for `remove_dead_nodes`.)
    let mut found: Vec<(NodeId, Matched, Option<ValueId>)> = Vec::new();
    for (n, m) in matched {
        if !fold_weight_scales && !m.scale_weights.is_empty() {
            continue;
        }
        let name = g.node(n).name.clone();
        match m.mask.as_ref().map(|mask| mask.materialise(g, &name)) {
            Some(None) => continue,
            Some(Some(mask)) => found.push((n, m, Some(mask))),
            None => found.push((n, m, None)),
        }
    }
    // Drop the attentions reading a weight that something else reads too, until none is
    // left (dropping one may leave another weight read outside the fused attentions).
    let frozen_scales = loop {
        let mut absorbed: Vec<(ValueId, usize)> = Vec::new();
        for w in found.iter().flat_map(|(_, m, _)| &m.scale_weights) {
            match absorbed.iter_mut().find(|(v, _)| v == w) {
                Some((_, n)) => *n += 1,
                None => absorbed.push((*w, 1)),
            }
        }
        let read_elsewhere: Vec<ValueId> = absorbed.iter().filter(|&&(w, n)| uses[w.index()] != n).map(|&(w, _)| w).collect();
        if read_elsewhere.is_empty() {
            break absorbed.into_iter().map(|(w, _)| w).collect();
        }
        found.retain(|(_, m, _)| !m.scale_weights.iter().any(|w| read_elsewhere.contains(w)));
    };
    for (n, m, mask) in &found {
        let name = g.node(*n).name.clone();
        let op = Op::Attention(Attention {
            is_causal: false,
            q_num_heads: None,
            kv_num_heads: None,
            qk_matmul_output_mode: 0,
            // An f32 attribute, as ONNX stores it.
            scale: Some(m.scale as f32),
            softcap: 0.0,
            // The spelled-out softmax's type: a mixed-precision stage keeps it (autocast
            // runs softmax in fp32), as the fused kernels do.
            softmax_precision: Some(m.softmax_type),
            left_window_size: -1,
            right_window_size: -1,
        });
        let (q, k, v) = (m.q.materialise(g, &name, "query"), m.k.materialise(g, &name, "key"), m.v.materialise(g, &name, "value"));
        let q = scaled_query(g, &name, q, &m.q_factors);
        rewrite_node(g, *n, op, &[Some(q), Some(k), Some(v), *mask]);
    }
    FusedAttention { count: found.len(), frozen_scales }
}

/// Q multiplied by `factors`, one `Mul` node added per factor (each keeps Q's type,
/// [`scaled_product`] checks).
fn scaled_query(g: &mut Graph, name: &str, q: ValueId, factors: &[ValueId]) -> ValueId {
    factors.iter().enumerate().fold(q, |q, (i, &f)| {
        let (ty, out) = (g.value(q).ty.clone(), format!("{name}/query_scaled{i}"));
        let n = g.add_node(out.clone(), Op::Binary(BinaryOp::Mul), vec![Some(q), Some(f)], vec![Some((out, ty))]);
        g.node(n).outputs[0].expect("one output")
    })
}

/// The attention whose last node is `n`, if `n` ends one: `MatMul(P, V)` in 4-D, or
/// `Reshape(MatMul(P', V'))` splitting the heads out of a product taken in 3-D (`P'` and
/// `V'` flattened to `[batch * heads, seq, _]`, as BLOOM and DeBERTa-v2 write it).
fn match_attention(g: &Graph, uses: &[usize], n: NodeId) -> Option<Matched> {
    let node = g.node(n);
    let [Some(y)] = node.outputs.as_slice() else { return None };
    let (probs, v) = match (&node.op, node.inputs.as_slice()) {
        (Op::MatMul, [Some(p), Some(v)]) => (*p, Operand::Value(*v)),
        (Op::Einsum { equation }, [Some(p), Some(v)]) if batched_product(equation) == Some(Product4::AB) => (*p, Operand::Value(*v)),
        (Op::Reshape { .. }, [Some(flat), Some(_)]) => flat_product(g, uses, *flat, *y)?,
        _ => return None,
    };
    let softmax_out = unguarded(g, uses, uncast(g, uses, probs)?)?;
    let logits = unclamped(g, uses, uncast(g, uses, softmax_input(g, uses, softmax_out)?)?);
    let (ScaledProduct { q, q_factors, k, scale, weights }, mask) = match (&g.value(logits).ty.shape.0[..], &g.value(*y).ty.shape.0[..]) {
        ([_, _, _, _], _) => unmasked(g, uses, logits)?,
        // Unmasked scores taken in 3-D, with no 4-D logits between them and the softmax
        // (Pegasus's encoder and cross attention): the product itself, split into heads.
        ([_, _, _], [b, h, _, _]) => (scaled_product(g, uses, logits, Layout::Flat { b: *b, h: *h })?, None),
        _ => return None,
    };
    let m = Matched { q, q_factors, k, v, mask, scale, scale_weights: weights, softmax_type: g.value(logits).ty.dtype };
    shapes_agree(g, &m, *y).then_some(m)
}

/// `y = Reshape(flat)` with `flat = MatMul(P', V')` of 3-D `[b * h, sq, dv]` values split
/// into `[b, h, sq, dv]`, `P'` the 4-D probabilities flattened, or the probabilities
/// themselves taken in 3-D (a softmax over flattened 4-D logits, [`softmax_input`]): the
/// probabilities and V in 4-D.
fn flat_product(g: &Graph, uses: &[usize], flat: ValueId, y: ValueId) -> Option<(ValueId, Operand)> {
    let dims = |v: ValueId| g.value(v).ty.shape.0.clone();
    let Some((Op::MatMul, [flat_probs, flat_v])) = producer(g, flat) else { return None };
    let ([b, h, sq, dv], [x, sq2, dv2]) = (&dims(y)[..], &dims(flat)[..]) else { return None };
    let split = b.mul(*h) == Some(*x) && sq == sq2 && dv == dv2;
    let probs = match producer(g, flat_probs) {
        Some((Op::Reshape { .. }, [probs, _])) if matches!(&dims(probs)[..], [pb, ph, psq, _] if pb == b && ph == h && psq == sq) => probs,
        _ if matches!(&dims(flat_probs)[..], [px, psq, _] if px == x && psq == sq) => flat_probs,
        _ => return None,
    };
    let single = uses[flat.index()] == 1 && uses[flat_probs.index()] == 1;
    (split && single).then_some(())?;
    Some((probs, unflattened(g, flat_v, *b, *h)?))
}

/// The 4-D `[b, h, s, d]` operand a 3-D `[b * h, s, d]` value flattens: the value it is
/// a `Reshape` of when there is one, else the value reshaped (which needs every extent
/// but the batch fixed).
fn unflattened(g: &Graph, flat: ValueId, b: Dim, h: Dim) -> Option<Operand> {
    let [x, s, d] = g.value(flat).ty.shape.0[..] else { return None };
    if b.mul(h) != Some(x) {
        return None;
    }
    let dims = vec![b, h, s, d];
    match producer(g, flat) {
        Some((Op::Reshape { .. }, [four, _])) if g.value(four).ty.shape.0 == dims => Some(Operand::Value(four)),
        _ => [h, s, d].iter().all(|e| e.fixed().is_some()).then_some(Operand::Reshaped { of: flat, dims }),
    }
}

/// `p` through identity `Cast`s (BLOOM's TorchScript export writes two), each read only
/// by the next.
fn uncast(g: &Graph, uses: &[usize], p: ValueId) -> Option<ValueId> {
    let mut at = p;
    loop {
        if uses[at.index()] != 1 {
            return None;
        }
        match producer(g, at) {
            Some((Op::Cast { .. }, [x])) if g.value(x).ty == g.value(at).ty => at = x,
            _ => return Some(at),
        }
    }
}

/// `p = Where(IsNaN(s), 0, s)`: `s`; otherwise `p` itself.
fn unguarded(g: &Graph, uses: &[usize], p: ValueId) -> Option<ValueId> {
    let Some((Op::Where, [nan, zero, s])) = producer(g, p) else { return Some(p) };
    let guard = uses[p.index()] == 1
        && uses[s.index()] == 2
        && scalar(g, zero) == Some(0.0)
        && unary_operand(g, uses, nan) == Some((UnaryOp::IsNaN, s));
    guard.then_some(s)
}

/// The logits of `s = Softmax(logits)` over the last axis, `logits` read only here: a 4-D
/// value; the 4-D logits `[b, h, sq, sk]` a 3-D `[b * h, sq, sk]` one flattens (Pegasus's
/// eager attention adds its mask in 4-D and takes the softmax in 3-D), over whose last
/// axis the softmax is the same; or 3-D logits made in 3-D (the caller checks for the
/// product).
fn softmax_input(g: &Graph, uses: &[usize], s: ValueId) -> Option<ValueId> {
    let Some((Op::Softmax(sm), [logits])) = producer(g, s) else { return None };
    let ty = &g.value(logits).ty;
    let rank = ty.shape.rank();
    let last = sm.axis == -1 || sm.axis == rank as i64 - 1;
    if !(last && uses[logits.index()] == 1 && ty.dtype.is_float()) {
        return None;
    }
    match ty.shape.0[..] {
        [_, _, _, _] => Some(logits),
        [x, sq, sk] => match producer(g, logits) {
            Some((Op::Reshape { .. }, [four, _])) if uses[four.index()] == 1 => match g.value(four).ty.shape.0[..] {
                [b, h, fsq, fsk] if b.mul(h) == Some(x) && fsq == sq && fsk == sk => Some(four),
                _ => None,
            },
            _ => Some(logits),
        },
        _ => None,
    }
}

/// `L` under `Max(L, f)` with `f` a constant at most [`MASK_FILL_AT_MOST`] (XGLM clamps
/// its masked logits at the lowest float before the softmax), else `logits` itself: the
/// clamp changes no probability of a row that attends any key.
fn unclamped(g: &Graph, uses: &[usize], logits: ValueId) -> ValueId {
    let low = |f: ValueId| is_mask_fill(g, f);
    let Some((Op::Variadic(VariadicOp::Max), [a, b])) = producer(g, logits) else { return logits };
    let same = |x: ValueId| g.value(x).ty == g.value(logits).ty;
    match (uses[logits.index()] == 1, low(b) && same(a), low(a) && same(b)) {
        (true, true, _) => a,
        (true, _, true) => b,
        _ => logits,
    }
}

/// Whether `f` is a scalar constant low enough to read as "masked" ([`MASK_FILL_AT_MOST`]).
fn is_mask_fill(g: &Graph, f: ValueId) -> bool {
    scalar(g, f).is_some_and(|f| f <= MASK_FILL_AT_MOST)
}

/// The most float masks added to one attention's scores (MPNet adds a relative-position
/// bias and the padding mask).
const ADDED_MASKS_AT_MOST: usize = 4;

/// Down the chain of additions from `at` (each read only by the next) to the operand
/// `scores_in` recognises, collecting the masks added on the way in the order they were
/// added; `None` when an addend is not a mask `is_mask` accepts or there are more than
/// `at_most`.
fn added_masks<T>(g: &Graph, uses: &[usize], mut at: ValueId, at_most: usize, scores_in: impl Fn(ValueId) -> Option<T>, is_mask: impl Fn(ValueId) -> bool) -> Option<(T, Vec<ValueId>)> {
    let mut added = Vec::new();
    let found = loop {
        if let Some(found) = scores_in(at) {
            break found;
        }
        let Some((Op::Binary(BinaryOp::Add), [a, b])) = producer(g, at).filter(|_| uses[at.index()] == 1) else { return None };
        let (next, mask) = match (scores_in(a).is_some(), scores_in(b).is_some()) {
            (true, _) => (a, b),
            (_, true) => (b, a),
            _ if producer(g, a).is_some_and(|(op, [_, _])| *op == Op::Binary(BinaryOp::Add)) => (a, b),
            _ => (b, a),
        };
        if !is_mask(mask) || added.len() == at_most {
            return None;
        }
        added.push(mask);
        at = next;
    };
    added.reverse();
    Some((found, added))
}

/// The scaled product under `logits` ([`scaled_product`]) and the mask: `A`, `A + M`,
/// `Where(C, A, f)`, `Where(C, f, A)` (the mask then `Not(C)`), `Where(C, A, f) + M` or
/// with more masks added (`(A + M1) + M2`, in either order), where `A` is the operand that
/// is a scaled product of the logits' full shape, or one computed in 3-D and split into
/// heads ([`flat_scores`]).
fn unmasked(g: &Graph, uses: &[usize], logits: ValueId) -> Option<(ScaledProduct, Option<Mask>)> {
    let ty = &g.value(logits).ty;
    let [b, h, _, keys] = ty.shape.0[..] else { return None };
    let single = |v: ValueId| uses[v.index()] == 1;
    let full = |a: ValueId| -> Option<(ScaledProduct, Vec<Operand>)> {
        if g.value(a).ty != *ty {
            return None;
        }
        match scaled_product(g, uses, a, Layout::Heads) {
            Some(s) => Some((s, Vec::new())),
            None => flat_scores(g, uses, a, b, h),
        }
    };
    let covers_keys = |m: ValueId| g.value(m).ty.shape.rank() <= 4 && g.value(m).ty.shape.0.last() == Some(&keys);
    let float_mask = |m: ValueId| g.value(m).ty.dtype == ty.dtype && covers_keys(m);
    // `Where(C, A, f)` keeping the keys `C` marks, or `Where(C, f, A)` keeping the others;
    // `A` may carry added masks itself (MPT masks its ALiBi-biased scores), which then
    // join the fused mask as they do when added after the `Where`.
    let kept = |w: ValueId| -> Option<(ScaledProduct, Vec<Operand>, Keep)> {
        let Some((Op::Where, [cond, x, y])) = producer(g, w) else { return None };
        let low = |f: ValueId| is_mask_fill(g, f);
        let masks = g.value(cond).ty.dtype == DType::Bool && covers_keys(cond);
        if !(single(w) && masks && g.value(w).ty == *ty) {
            return None;
        }
        let (a, keep) = match (low(y), low(x)) {
            (true, _) => (x, Keep { cond, fill: y, negated: false }),
            (_, true) => match unary_operand(g, uses, cond) {
                Some((UnaryOp::Not, kept)) => (y, Keep { cond: kept, fill: x, negated: false }),
                _ => (y, Keep { cond, fill: x, negated: true }),
            },
            _ => return None,
        };
        let ((scores, mut inner), biases) = added_masks(g, uses, a, ADDED_MASKS_AT_MOST, full, float_mask)?;
        inner.extend(biases.into_iter().map(Operand::Value));
        Some((scores, inner, keep))
    };
    let scores_in = |v: ValueId| full(v).map(|(s, inner)| (s, inner, None)).or_else(|| kept(v).map(|(s, inner, k)| (s, inner, Some(k))));
    if let Some(found) = scaled_after_masks(g, uses, logits, full, float_mask) {
        return Some(found);
    }
    let ((scores, mut inner, keep), outer) = added_masks(g, uses, logits, ADDED_MASKS_AT_MOST, scores_in, float_mask)?;
    if inner.len() + outer.len() > ADDED_MASKS_AT_MOST {
        return None;
    }
    // The masks added in 3-D were added first.
    inner.extend(outer.into_iter().map(Operand::Value));
    let mask = (!inner.is_empty() || keep.is_some()).then_some(Mask { added: inner, keep });
    Some((scores, mask))
}

/// Logits scaled after the masks were added, `(A + M...) / s` or `(A + M...) * s` with `s`
/// a scalar constant (CodeGen): the scale joins `A`'s and each mask is scaled by it (a
/// `Mul` added), which is the same function.
fn scaled_after_masks(
    g: &Graph,
    uses: &[usize],
    logits: ValueId,
    full: impl Fn(ValueId) -> Option<(ScaledProduct, Vec<Operand>)>,
    float_mask: impl Fn(ValueId) -> bool,
) -> Option<(ScaledProduct, Option<Mask>)> {
    let (op, [x, c]) = producer(g, logits)?;
    let factor = match (op, scalar(g, c)?) {
        (Op::Binary(BinaryOp::Div), s) => 1.0 / s,
        (Op::Binary(BinaryOp::Mul), s) => s,
        _ => return None,
    };
    // A positive, finite scale, as [`scaled_product`] requires of its own.
    if !(factor.is_finite() && factor > 0.0) || uses[logits.index()] != 1 || g.value(x).ty != g.value(logits).ty {
        return None;
    }
    let ((mut scores, inner), masks) = added_masks(g, uses, x, ADDED_MASKS_AT_MOST, full, float_mask)?;
    if masks.is_empty() || !inner.is_empty() {
        return None;
    }
    scores.scale *= factor;
    let added = masks.into_iter().map(|of| Operand::Scaled { of, factor }).collect();
    Some((scores, Some(Mask { added, keep: None })))
}

/// `Reshape(L')` splitting the heads out of 3-D logits `L' = A' + M'...` (BLOOM's
/// `baddbmm(alibi, Q, K^T)`; DeBERTa-v2's product): the scaled product of 3-D Q and K^T
/// and the added masks, each in 4-D: one of `[b * h, _, keys]` split into heads, one
/// broadcast over them as it is.
fn flat_scores(g: &Graph, uses: &[usize], split: ValueId, b: Dim, h: Dim) -> Option<(ScaledProduct, Vec<Operand>)> {
    let Some((Op::Reshape { .. }, [flat, _])) = producer(g, split) else { return None };
    let ty = &g.value(flat).ty;
    let [x, _, keys] = ty.shape.0[..] else { return None };
    if uses[split.index()] != 1 || b.mul(h) != Some(x) {
        return None;
    }
    let scores_in = |v: ValueId| (g.value(v).ty == *ty).then(|| scaled_product(g, uses, v, Layout::Flat { b, h })).flatten();
    let lifted = |m: ValueId| -> Option<Operand> {
        let t = &g.value(m).ty;
        match t.shape.0[..] {
            _ if t.dtype != ty.dtype || t.shape.0.last() != Some(&keys) => None,
            [first, _, _] if first == x => unflattened(g, m, b, h),
            [Dim::Fixed(1), _, _] | [_, _] | [_] => Some(Operand::Value(m)),
            _ => None,
        }
    };
    let (scores, masks) = added_masks(g, uses, flat, ADDED_MASKS_AT_MOST, scores_in, |m| lifted(m).is_some())?;
    Some((scores, masks.into_iter().map(lifted).collect::<Option<_>>()?))
}

/// Q, K and the scale of attention's scores.
struct ScaledProduct {
    q: Operand,
    /// Factors of the scores constant along their last two axes (a per-head temperature),
    /// which the fused node's Q is multiplied by.
    q_factors: Vec<ValueId>,
    k: Operand,
    scale: f64,
    /// Trainable one-element weights among the scale's factors (the dynamo exporter's
    /// `[1]` initializer in a fixed-batch export), one entry per read.
    weights: Vec<ValueId>,
}

/// How the scores' product is laid out: 4-D with the heads an axis of their own, or 3-D
/// with them merged into the batch (`[b * h, seq, head]`).
#[derive(Clone, Copy)]
enum Layout {
    Heads,
    Flat { b: Dim, h: Dim },
}

/// `A = c * MatMul(a * Q, b * K^T)`: Q, K and the scale `a * b * c`, each of `a`, `b`,
/// `c` a product of scalar constants and one-element weights.
fn scaled_product(g: &Graph, uses: &[usize], scores: ValueId, layout: Layout) -> Option<ScaledProduct> {
    let mut weights = Vec::new();
    let mut scale = 1.0;
    let mut split = |p: Product| -> Vec<ValueId> {
        scale *= p.constant;
        let mut terms = Vec::new();
        for t in p.terms {
            match one_element_weight(g, t) {
                Some(w) => {
                    scale *= w;
                    weights.push(t);
                }
                None => terms.push(t),
            }
        }
        terms
    };
    let outer = split(factors(g, uses, scores, uses[scores.index()] == 1));
    // `Q K^T` as a MatMul, or as a 4-D Einsum (CvT) taking K^T or K itself.
    let product_kind = |t: ValueId| match producer(g, t) {
        Some((Op::MatMul, [_, _])) => Some(Product4::AB),
        Some((Op::Einsum { equation }, [_, _])) if matches!(layout, Layout::Heads) => batched_product(equation),
        _ => None,
    };
    let (product, mut q_factors) = one_operand(g, outer, |t| product_kind(t).is_some())?;
    if uses[product.index()] != 1 {
        return None;
    }
    let kind = product_kind(product)?;
    let Some((_, [a, b])) = producer(g, product) else { return None };
    let not_factor = |t: ValueId| !row_constant(g, t);
    let (q, left) = one_operand(g, split(factors(g, uses, a, uses[a.index()] == 1)), not_factor)?;
    let (kt, right) = one_operand(g, split(factors(g, uses, b, uses[b.index()] == 1)), not_factor)?;
    q_factors.extend(left.into_iter().chain(right));
    let (q, k) = match layout {
        Layout::Heads if kind == Product4::ABt => (Operand::Value(q), Operand::Value(kt)),
        Layout::Heads => (Operand::Value(q), untransposed(g, uses, kt)?),
        // Flattened, a factor's axes would not line up with Q's in 4-D.
        Layout::Flat { .. } if !q_factors.is_empty() => return None,
        Layout::Flat { b, h } => (unflattened(g, q, b, h)?, flat_untransposed(g, uses, kt, b, h)?),
    };
    let q_ty = q.ty(g);
    let fits_q = |f: &ValueId| {
        let t = &g.value(*f).ty;
        let dims = &t.shape.0;
        let aligned = q_ty.shape.0.iter().skip(q_ty.shape.rank().saturating_sub(dims.len()));
        t.dtype == q_ty.dtype && dims.len() <= q_ty.shape.rank() && dims.iter().zip(aligned).all(|(d, e)| *d == Dim::Fixed(1) || d == e)
    };
    let sound = scale.is_finite() && scale > 0.0 && q_factors.iter().all(fits_q);
    sound.then_some(ScaledProduct { q, q_factors, k, scale, weights })
}

/// A product of 4-D operands over their two leading (batch and heads) axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Product4 {
    /// `A B`, as MatMul computes it (`bhij,bhjk->bhik`).
    AB,
    /// `A B^T` (`bhik,bhjk->bhij`: scores from Q and K themselves).
    ABt,
}

/// Which batched product a 4-D Einsum `equation` is, if either (any letters, spaces
/// ignored).
fn batched_product(equation: &str) -> Option<Product4> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (ins, out) = eq.split_once("->")?;
    let (a, b) = ins.split_once(',')?;
    let [a, b, out] = [a, b, out].map(|t| t.chars().collect::<Vec<char>>());
    if a.len() != 4 || b.len() != 4 || out.len() != 4 || a[..2] != b[..2] || a[..2] != out[..2] {
        return None;
    }
    let (i, k, j) = (a[2], a[3], out[3]);
    let distinct = a[0] != a[1] && ![a[0], a[1]].iter().any(|c| [i, k, j].contains(c)) && i != k && k != j && i != j;
    if !distinct || out[2] != i {
        return None;
    }
    match (b[2], b[3]) {
        (x, y) if x == k && y == j => Some(Product4::AB),
        (x, y) if x == j && y == k => Some(Product4::ABt),
        _ => None,
    }
}

/// The one term `is_operand` picks and the others, each of which must be a factor
/// constant over the last two axes ([`row_constant`]).
fn one_operand(g: &Graph, terms: Vec<ValueId>, is_operand: impl Fn(ValueId) -> bool) -> Option<(ValueId, Vec<ValueId>)> {
    let (operands, others): (Vec<ValueId>, Vec<ValueId>) = terms.into_iter().partition(|&t| is_operand(t));
    let [operand] = operands[..] else { return None };
    others.iter().all(|&t| row_constant(g, t)).then_some((operand, others))
}

/// Whether `t` is the same along the scores' last two axes (extent 1 there): a factor of
/// the scores that may multiply Q instead, as Swin-v2's per-head `exp(logit_scale)` does.
fn row_constant(g: &Graph, t: ValueId) -> bool {
    g.value(t).ty.shape.0.iter().rev().take(2).all(|d| *d == Dim::Fixed(1))
}

/// K from `K^T`: a `Transpose` of 4-D `x` (K is `x` permuted with the last two axes
/// swapped back, `x` itself when that is the identity), or `Reshape(Transpose(M))` that
/// swaps the last two axes of a 3-D `M = [b * h, s, d]` and splits its first into `[b,
/// h]` (K is `M` in 4-D, [`unflattened`]).
fn untransposed(g: &Graph, uses: &[usize], kt: ValueId) -> Option<Operand> {
    if uses[kt.index()] != 1 {
        return None;
    }
    // Keys laid out heads-last by their producer (SqueezeBERT's channel-first `[batch,
    // heads, head, seq]`): K is `K^T` with its last two axes swapped, a Transpose added.
    let swapped = || (g.value(kt).ty.shape.rank() == 4).then(|| Operand::Permuted { of: kt, perm: vec![0, 1, 3, 2] });
    let Some((op, operands)) = producer_of(g, kt) else { return swapped() };
    match (op, operands.as_slice()) {
        // A permutation of the four axes as numbers 0 to 3 (a negative one is left alone).
        (Op::Transpose { perm: Some(p) }, &[x]) if p.len() == 4 && (0..4).all(|a| p.contains(&a)) => {
            let perm = vec![p[0], p[1], p[3], p[2]];
            Some(if perm == [0, 1, 2, 3] { Operand::Value(x) } else { Operand::Permuted { of: x, perm } })
        }
        (Op::Reshape { .. }, &[flat, _]) => {
            let [b, h, d, s] = g.value(kt).ty.shape.0[..] else { return None };
            match flat_untransposed(g, uses, flat, b, h) {
                Some(k) => (k.ty(g).shape.0 == [b, h, s, d]).then_some(k),
                None => swapped(),
            }
        }
        _ => swapped(),
    }
}

/// K from a 3-D `K^T = Transpose(M)` that swaps the last two axes of `M = [b * h, s,
/// d]`: `M` in 4-D ([`unflattened`]).
fn flat_untransposed(g: &Graph, uses: &[usize], kt: ValueId, b: Dim, h: Dim) -> Option<Operand> {
    let Some((Op::Transpose { perm: Some(p) }, [flat])) = producer(g, kt) else { return None };
    (uses[kt.index()] == 1 && p[..] == [0, 2, 1] && uses[flat.index()] == 1).then_some(())?;
    unflattened(g, flat, b, h)
}

/// Whether Q `[b, h, sq, d]`, K `[b, h, skv, d]` and V `[b, h, skv, dv]` share their type,
/// batch and heads, and the product `y` is `[b, h, sq, dv]` of that type.
fn shapes_agree(g: &Graph, m: &Matched, y: ValueId) -> bool {
    let (q, k, v, out) = (m.q.ty(g), m.k.ty(g), m.v.ty(g), g.value(y).ty.clone());
    let same_type = [&k, &v, &out].iter().all(|t| t.dtype == q.dtype) && q.dtype.is_float();
    let fits = |qd: &[Dim], kd: &[Dim], vd: &[Dim], yd: &[Dim]| match (qd, kd, vd, yd) {
        ([b, h, sq, d], [kb, kh, skv, kd], [vb, vh, vs, dv], [yb, yh, ysq, ydv]) => {
            [kb, vb, yb].iter().all(|x| *x == b) && [kh, vh, yh].iter().all(|x| *x == h) && d == kd && skv == vs && sq == ysq && dv == ydv
        }
        _ => false,
    };
    same_type && fits(&q.shape.0, &k.shape.0, &v.shape.0, &out.shape.0)
}

#[cfg(test)]
mod tests {
    use super::fuse_attention;
    use crate::{parse_graph, text::print_graph, Graph};

    const HEADER: &str = "graph \"g\" ir_version=8 opset=17 producer=\"t\" batch=N(\"N\", dynamic) {\n  %v0: f32[N,4,8,16] = input \"q\"\n  %v1: f32[N,4,8,16] = input \"k\"\n  %v2: f32[N,4,8,16] = input \"v\"\n";

    fn fused(body: &str) -> (usize, Graph, String) {
        let text = format!("{HEADER}{body}}}\n");
        let mut g = parse_graph(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let n = fuse_attention(&mut g, true).count;
        g.remove_dead_nodes();
        g.compact().expect("acyclic");
        crate::verify(&g).unwrap_or_else(|e| panic!("{e:?}"));
        let printed = print_graph(&g);
        (n, g, printed)
    }

    /// torch.onnx's TorchScript form of BERT/GPT-2 eager attention: `Q K^T / sqrt(d)`, an
    /// added float mask, the softmax, the product with V.
    const EAGER: &str = "  %v3: f32[] = const \"sqrt_d\" [4.0]\n  %v4: f32[1,1,8,8] = const \"mask\"\n  %v5: f32[N,4,16,8] = Transpose[perm=[0, 1, 3, 2]](%v1)  # n0 \"kt\"\n  %v6: f32[N,4,8,8] = MatMul(%v0, %v5)  # n1 \"qk\"\n  %v7: f32[N,4,8,8] = Div(%v6, %v3)  # n2 \"scaled\"\n  %v8: f32[N,4,8,8] = Add(%v7, %v4)  # n3 \"masked\"\n  %v9: f32[N,4,8,8] = Softmax[axis=-1](%v8)  # n4 \"probs\"\n  %v10: f32[N,4,8,16] = MatMul(%v9, %v2)  # n5 \"attn\"\n";

    #[test]
    fn eager_attention_with_an_added_mask_becomes_one_node() {
        let (n, g, text) = fused(&format!("{EAGER}  return %v10 \"y\"\n"));
        assert_eq!((n, g.node_count()), (1, 1), "{text}");
        assert!(text.contains("= Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2, %v3)  # n0 \"attn\""), "{text}");
    }

    /// CodeGen's order: the mask added to `Q K^T` before the scale divides them; the mask
    /// is scaled too (a `Mul` added), the scale joins the product's.
    #[test]
    fn scores_scaled_after_the_mask_was_added_scale_the_mask_too() {
        let body = EAGER
            .replace("Div(%v6, %v3)  # n2 \"scaled\"", "Add(%v6, %v4)  # n2 \"masked_first\"")
            .replace("Add(%v7, %v4)  # n3 \"masked\"", "Div(%v7, %v3)  # n3 \"scaled_after\"")
            + "  return %v10 \"y\"\n";
        let (n, g, text) = fused(&body);
        assert_eq!((n, g.node_count()), (1, 2), "{text}");
        assert!(text.contains("= Mul(%v3, %v4)  # n0 \"attn/mask_part0\""), "{text}");
        assert!(text.contains("Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2, %v5)"), "{text}");
    }

    /// SqueezeBERT's channel-first keys: `K^T` is the producer's own layout, `[batch,
    /// heads, head, seq]`, with no Transpose to look through; K is it swapped back.
    #[test]
    fn channel_first_keys_are_swapped_back_into_k() {
        let body = "  %v3: f32[] = const \"sqrt_d\" [4.0]\n  %v4: f32[N,4,16,8] = input \"k_channels\"\n  %v5: f32[N,4,8,8] = MatMul(%v0, %v4)  # n0 \"qk\"\n  %v6: f32[N,4,8,8] = Div(%v5, %v3)  # n1 \"scaled\"\n  %v7: f32[N,4,8,8] = Softmax[axis=-1](%v6)  # n2 \"probs\"\n  %v8: f32[N,4,8,16] = MatMul(%v7, %v2)  # n3 \"attn\"\n  return %v8 \"y\"\n";
        let (n, g, text) = fused(body);
        assert_eq!((n, g.node_count()), (1, 2), "{text}");
        assert!(text.contains("= Transpose[perm=[0, 1, 3, 2]](%v3)  # n0 \"attn/key\""), "{text}");
    }

    /// CvT's einsum attention: `bhlk,bhtk->bhlt` takes Q and K themselves, `bhlt,bhtv->bhlv`
    /// the probabilities and V; an einsum of another form is not a product of the pattern.
    #[test]
    fn einsum_attention_is_fused() {
        let body = |scores: &str| format!("  %v3: f32[] = const \"scale\" [0.25]\n  %v4: f32[N,4,8,8] = Einsum[equation=\"{scores}\"](%v0, %v1)  # n0 \"qk\"\n  %v5: f32[N,4,8,8] = Mul(%v4, %v3)  # n1 \"scaled\"\n  %v6: f32[N,4,8,8] = Softmax[axis=-1](%v5)  # n2 \"probs\"\n  %v7: f32[N,4,8,16] = Einsum[equation=\"bhlt,bhtv->bhlv\"](%v6, %v2)  # n3 \"attn\"\n  return %v7 \"y\"\n");
        let (n, g, text) = fused(&body("bhlk,bhtk->bhlt"));
        assert_eq!((n, g.node_count()), (1, 1), "{text}");
        assert!(text.contains("= Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2)  # n0 \"attn\""), "{text}");
        let (n, _, text) = fused(&body("bhlk,bhtk->bhtl"));
        assert_eq!(n, 0, "{text}");
        assert_eq!(super::batched_product("b h i j, b h j k -> b h i k"), Some(super::Product4::AB));
        assert_eq!(super::batched_product("bhij,bhkj->bhik"), Some(super::Product4::ABt));
        assert_eq!(super::batched_product("bhij,bhjk->bhki"), None);
        assert_eq!(super::batched_product("bij,bjk->bik"), None);
    }

    /// XGLM's clamp of the masked logits at the lowest float, between the mask and the
    /// softmax, is looked through; a clamp at a value that could change an attended
    /// key's weight is not.
    #[test]
    fn a_clamp_of_the_masked_logits_at_the_lowest_float_is_looked_through() {
        let clamped = |floor: &str| {
            let clamp = format!("  %v11: f32[] = const \"floor\" [{floor}]\n  %v12: f32[N,4,8,8] = Max(%v8, %v11)  # n6 \"clamped\"\n  %v9: f32[N,4,8,8] = Softmax[axis=-1](%v12)");
            EAGER.replace("  %v9: f32[N,4,8,8] = Softmax[axis=-1](%v8)", &clamp) + "  return %v10 \"y\"\n"
        };
        let (n, g, text) = fused(&clamped("-3.4028234663852886e38"));
        assert_eq!((n, g.node_count()), (1, 1), "{text}");
        let (n, _, text) = fused(&clamped("-1.0"));
        assert_eq!(n, 0, "{text}");
    }

    #[test]
    fn the_dynamo_form_with_split_scale_nan_guard_and_3d_transpose_is_fused() {
        // torch.onnx's dynamo decomposition of SDPA: sqrt(scale) on each operand, K^T
        // through 3-D, and the guard that zeroes rows with no key to attend.
        let body = "  %v3: f32[] = const \"root_scale\" [0.5]\n  %v4: i64[3] = const \"flat\" [-1, 8, 16]\n  %v5: i64[4] = const \"back\" [-1, 4, 16, 8]\n  %v6: f32[] = const \"zero\" [0.0]\n  %v7: f32[4N,8,16] = Reshape(%v1, %v4)  # n0 \"flat_k\"\n  %v8: f32[4N,16,8] = Transpose[perm=[0, 2, 1]](%v7)  # n1 \"flat_kt\"\n  %v9: f32[N,4,16,8] = Reshape(%v8, %v5)  # n2 \"kt\"\n  %v10: f32[N,4,8,16] = Mul(%v0, %v3)  # n3 \"q_scaled\"\n  %v11: f32[N,4,16,8] = Mul(%v9, %v3)  # n4 \"kt_scaled\"\n  %v12: f32[N,4,8,8] = MatMul(%v10, %v11)  # n5 \"qk\"\n  %v13: f32[N,4,8,8] = Softmax[axis=-1](%v12)  # n6 \"probs\"\n  %v14: bool[N,4,8,8] = IsNaN(%v13)  # n7 \"nan\"\n  %v15: f32[N,4,8,8] = Where(%v14, %v6, %v13)  # n8 \"guarded\"\n  %v16: f32[N,4,8,16] = MatMul(%v15, %v2)  # n9 \"sdpa\"\n  return %v16 \"y\"\n";
        let (n, g, text) = fused(body);
        assert_eq!((n, g.node_count()), (1, 1), "{text}");
        assert!(text.contains("= Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2)  # n0 \"sdpa\""), "{text}");
    }

    #[test]
    fn a_heads_last_key_transposed_once_gets_its_own_transpose() {
        // TorchScript's SDPA export: K^T as one Transpose of `[batch, seq, heads, head]`.
        let body = EAGER.replace(
            "  %v5: f32[N,4,16,8] = Transpose[perm=[0, 1, 3, 2]](%v1)",
            "  %v11: f32[N,8,4,16] = Transpose[perm=[0, 2, 1, 3]](%v1)  # n6 \"heads_last\"\n  %v5: f32[N,4,16,8] = Transpose[perm=[0, 2, 3, 1]](%v11)",
        ) + "  return %v10 \"y\"\n";
        let (n, g, text) = fused(&body);
        assert_eq!((n, g.node_count()), (1, 3), "{text}");
        assert!(text.contains("%v5: f32[N,4,8,16] = Transpose[perm=[0, 2, 1, 3]](%v4)  # n1 \"attn/key\""), "{text}");
        assert!(text.contains("Attention[scale=0.25, softmax_precision=f32](%v0, %v5, %v2, %v3)"), "{text}");
    }

    #[test]
    fn a_boolean_mask_kept_by_where_becomes_the_mask_input() {
        let body = "  %v3: f32[] = const \"scale\" [0.25]\n  %v4: bool[1,1,8,8] = const \"causal\"\n  %v5: f32[] = const \"lowest\" [-3.4028234663852886e38]\n  %v6: f32[N,4,16,8] = Transpose[perm=[0, 1, 3, 2]](%v1)  # n0 \"kt\"\n  %v7: f32[N,4,8,8] = MatMul(%v0, %v6)  # n1 \"qk\"\n  %v8: f32[N,4,8,8] = Mul(%v7, %v3)  # n2 \"scaled\"\n  %v9: f32[N,4,8,8] = Where(%v4, %v8, %v5)  # n3 \"masked\"\n  %v10: f32[N,4,8,8] = Softmax[axis=3](%v9)  # n4 \"probs\"\n  %v11: f32[N,4,8,16] = MatMul(%v10, %v2)  # n5 \"attn\"\n  return %v11 \"y\"\n";
        let (n, _, text) = fused(body);
        assert_eq!(n, 1, "{text}");
        assert!(text.contains("Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2, %v3)") && text.contains("bool[1,1,8,8]"), "{text}");
        // A fill that does not underflow the softmax is a bias, not a mask: left alone.
        let (n, g, text) = fused(&body.replace("[-3.4028234663852886e38]", "[-1.0]"));
        assert_eq!((n, g.node_count()), (0, 6), "{text}");
    }

    /// GPT-Neo's form (TorchScript and dynamo alike): no scale, a causal `Where` and then
    /// the padding mask added; the fused node reads `Where(causal, padding, fill)`, one
    /// node per attention, and the padding mask may be read by other layers too.
    #[test]
    fn a_causal_where_then_an_added_mask_becomes_one_combined_mask() {
        let body = "  %v3: bool[1,1,8,8] = const \"causal\"\n  %v4: f32[] = const \"lowest\" [-3.4028234663852886e38]\n  %v5: f32[N,1,1,8] = input \"padding\"\n  %v6: f32[N,4,16,8] = Transpose[perm=[0, 1, 3, 2]](%v1)  # n0 \"kt\"\n  %v7: f32[N,4,8,8] = MatMul(%v0, %v6)  # n1 \"qk\"\n  %v8: f32[N,4,8,8] = Where(%v3, %v7, %v4)  # n2 \"causal_masked\"\n  %v9: f32[N,4,8,8] = Add(%v8, %v5)  # n3 \"masked\"\n  %v10: f32[N,4,8,8] = Softmax[axis=-1](%v9)  # n4 \"probs\"\n  %v11: f32[N,4,8,16] = MatMul(%v10, %v2)  # n5 \"attn\"\n  %v12: f32[N,1,1,8] = Neg(%v5)  # n6 \"other_reader\"\n  return %v11 \"y\", %v12 \"z\"\n";
        let (n, g, text) = fused(body);
        assert_eq!((n, g.node_count()), (1, 3), "{text}");
        assert!(text.contains("%v7: f32[N,1,8,8] = Where(%v4, %v3, %v5)  # n1 \"attn/mask\""), "{text}");
        assert!(text.contains("Attention[scale=1.0, softmax_precision=f32](%v0, %v1, %v2, %v7)"), "{text}");
        // The added mask first, and a causal Where read elsewhere: the first fuses, the
        // second is left alone.
        let (n, _, text) = fused(&body.replace("Add(%v8, %v5)", "Add(%v5, %v8)"));
        assert_eq!(n, 1, "{text}");
        let (n, g, text) = fused(&body.replace("return %v11 \"y\"", "return %v8 \"w\", %v11 \"y\""));
        assert_eq!((n, g.node_count()), (0, 7), "{text}");
        // MPT's order: the bias added first, the causal Where over the biased scores.
        let inside = body
            .replace("Where(%v3, %v7, %v4)  # n2 \"causal_masked\"", "Add(%v7, %v5)  # n2 \"biased\"")
            .replace("Add(%v8, %v5)  # n3 \"masked\"", "Where(%v3, %v8, %v4)  # n3 \"masked\"");
        let (n, g, text) = fused(&inside);
        assert_eq!((n, g.node_count()), (1, 3), "{text}");
        assert!(text.contains("%v7: f32[N,1,8,8] = Where(%v4, %v3, %v5)  # n1 \"attn/mask\""), "{text}");
    }

    /// A fixed-batch dynamo export: `sqrt(scale)` on Q and on K^T as a trainable `[1]`
    /// initializer. Folded (the import's default) its value is the scale and the weight
    /// is frozen; not folded, or read by anything else too, the attention stays.
    #[test]
    fn a_one_element_weight_read_only_as_the_scale_is_folded_into_it() {
        let body = "  %v3: f32[1] = weight \"root_scale\" [0.5]\n  %v4: f32[N,4,16,8] = Transpose[perm=[0, 1, 3, 2]](%v1)  # n0 \"kt\"\n  %v5: f32[N,4,8,16] = Mul(%v0, %v3)  # n1 \"q_scaled\"\n  %v6: f32[N,4,16,8] = Mul(%v4, %v3)  # n2 \"kt_scaled\"\n  %v7: f32[N,4,8,8] = MatMul(%v5, %v6)  # n3 \"qk\"\n  %v8: f32[N,4,8,8] = Softmax[axis=-1](%v7)  # n4 \"probs\"\n  %v9: f32[N,4,8,16] = MatMul(%v8, %v2)  # n5 \"attn\"\n  return %v9 \"y\"\n";
        let parse = |body: &str| parse_graph(&format!("{HEADER}{body}}}\n")).unwrap();
        let mut g = parse(body);
        let fused = fuse_attention(&mut g, true);
        assert_eq!(fused.count, 1);
        assert_eq!(fused.frozen_scales.iter().map(|&w| g.value(w).name.as_str()).collect::<Vec<_>>(), ["root_scale"]);
        g.remove_dead_nodes();
        g.compact().unwrap();
        let text = print_graph(&g);
        assert!(text.contains("Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2)") && !text.contains("root_scale"), "{text}");
        assert_eq!(fuse_attention(&mut parse(body), false), super::FusedAttention::default());
        let elsewhere = body.replace("return %v9 \"y\"", "%v10: f32[1] = Neg(%v3)  # n6 \"other\"\n  return %v9 \"y\", %v10 \"z\"");
        assert_eq!(fuse_attention(&mut parse(&elsewhere), true), super::FusedAttention::default());
    }

    /// torchvision's sequence-first attention (dynamo, fixed batch): K only exists in 3-D,
    /// `[batch * heads, seq, head]`, transposed there and split into heads after, so K in
    /// 4-D is a `Reshape` added to it.
    #[test]
    fn a_key_transposed_in_3d_from_no_4d_value_gets_its_own_reshape() {
        let body = "  %v3: f32[8,4N,16] = input \"k_seq_first\"\n  %v4: i64[4] = const \"split\" [-1, 4, 16, 8]\n  %v5: f32[] = const \"scale\" [0.25]\n  %v6: f32[4N,8,16] = Transpose[perm=[1, 0, 2]](%v3)  # n0 \"batch_first\"\n  %v7: f32[4N,16,8] = Transpose[perm=[0, 2, 1]](%v6)  # n1 \"flat_kt\"\n  %v8: f32[N,4,16,8] = Reshape(%v7, %v4)  # n2 \"kt\"\n  %v9: f32[N,4,8,8] = MatMul(%v0, %v8)  # n3 \"qk\"\n  %v10: f32[N,4,8,8] = Mul(%v9, %v5)  # n4 \"scaled\"\n  %v11: f32[N,4,8,8] = Softmax[axis=-1](%v10)  # n5 \"probs\"\n  %v12: f32[N,4,8,16] = MatMul(%v11, %v2)  # n6 \"attn\"\n  return %v12 \"y\"\n";
        let (n, g, text) = fused(body);
        assert_eq!((n, g.node_count()), (1, 3), "{text}");
        assert!(text.contains("i64[4] = const \"attn/key_shape\" [-1, 4, 8, 16]"), "{text}");
        assert!(text.contains("%v6: f32[N,4,8,16] = Reshape(%v5, %v4)  # n1 \"attn/key\""), "{text}");
        assert!(text.contains("Attention[scale=0.25, softmax_precision=f32](%v0, %v6, %v2)"), "{text}");
    }

    /// MPNet's form: a relative-position bias and then the padding mask added to the
    /// scaled scores (the fused mask is their sum, one node added); T5's identity `Cast`
    /// between the logits and the softmax is looked through.
    #[test]
    fn two_added_masks_become_their_sum_and_a_cast_before_the_softmax_is_looked_through() {
        let body = "  %v3: f32[] = const \"sqrt_d\" [4.0]\n  %v4: f32[1,4,8,8] = input \"bias\"\n  %v5: f32[N,1,1,8] = input \"padding\"\n  %v6: f32[N,4,16,8] = Transpose[perm=[0, 1, 3, 2]](%v1)  # n0 \"kt\"\n  %v7: f32[N,4,8,8] = MatMul(%v0, %v6)  # n1 \"qk\"\n  %v8: f32[N,4,8,8] = Div(%v7, %v3)  # n2 \"scaled\"\n  %v9: f32[N,4,8,8] = Add(%v8, %v4)  # n3 \"biased\"\n  %v10: f32[N,4,8,8] = Add(%v9, %v5)  # n4 \"masked\"\n  %v11: f32[N,4,8,8] = Cast[to=f32](%v10)  # n5 \"as_f32\"\n  %v12: f32[N,4,8,8] = Softmax[axis=-1](%v11)  # n6 \"probs\"\n  %v13: f32[N,4,8,16] = MatMul(%v12, %v2)  # n7 \"attn\"\n  return %v13 \"y\"\n";
        let (n, g, text) = fused(body);
        assert_eq!((n, g.node_count()), (1, 2), "{text}");
        assert!(text.contains("%v5: f32[N,4,8,8] = Add(%v3, %v4)  # n0 \"attn/mask\""), "{text}");
        assert!(text.contains("Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2, %v5)"), "{text}");
        // The mask first in the outer sum, the scores first in the inner: the same.
        let (n, _, text) = fused(&body.replace("Add(%v9, %v5)", "Add(%v5, %v9)").replace("Add(%v8, %v4)", "Add(%v4, %v8)"));
        assert_eq!(n, 1, "{text}");
        // The partial sum read elsewhere: left alone.
        let (n, _, text) = fused(&body.replace("return %v13 \"y\"", "return %v13 \"y\", %v9 \"biased\""));
        assert_eq!(n, 0, "{text}");
    }

    /// BLOOM's form (dynamo and TorchScript alike): Q, K and V flattened to `[batch *
    /// heads, seq, head]`, `baddbmm(alibi, Q, K^T)` in 3-D, the scores split into heads
    /// for the causal mask and the softmax, flattened again for the product with V, whose
    /// output is split into heads last. The fused node reads the 4-D values; ALiBi, one
    /// bias per flattened row, is split into heads and added to the causal mask.
    const FLAT: &str = "  %v3: f32[] = const \"inv_norm\" [0.25]\n  %v4: i64[3] = const \"flat\" [-1, 8, 16]\n  %v5: i64[4] = const \"split\" [-1, 4, 8, 8]\n  %v6: i64[3] = const \"flat_scores\" [-1, 8, 8]\n  %v7: i64[4] = const \"split_out\" [-1, 4, 8, 16]\n  %v8: f32[4N,1,8] = input \"alibi\"\n  %v9: f32[N,1,8,8] = input \"causal\"\n  %v10: f32[4N,8,16] = Reshape(%v0, %v4)  # n0 \"flat_q\"\n  %v11: f32[4N,8,16] = Reshape(%v1, %v4)  # n1 \"flat_k\"\n  %v12: f32[4N,16,8] = Transpose[perm=[0, 2, 1]](%v11)  # n2 \"flat_kt\"\n  %v13: f32[4N,8,8] = MatMul(%v10, %v12)  # n3 \"qk\"\n  %v14: f32[4N,8,8] = Mul(%v13, %v3)  # n4 \"scaled\"\n  %v15: f32[4N,8,8] = Add(%v14, %v8)  # n5 \"baddbmm\"\n  %v16: f32[N,4,8,8] = Reshape(%v15, %v5)  # n6 \"split_scores\"\n  %v17: f32[N,4,8,8] = Add(%v16, %v9)  # n7 \"masked\"\n  %v18: f32[N,4,8,8] = Softmax[axis=-1](%v17)  # n8 \"probs\"\n  %v19: f32[4N,8,8] = Reshape(%v18, %v6)  # n9 \"flat_probs\"\n  %v20: f32[4N,8,16] = Reshape(%v2, %v4)  # n10 \"flat_v\"\n  %v21: f32[4N,8,16] = MatMul(%v19, %v20)  # n11 \"bmm\"\n  %v22: f32[N,4,8,16] = Reshape(%v21, %v7)  # n12 \"attn\"\n  return %v22 \"y\"\n";

    #[test]
    fn attention_taken_in_3d_and_split_into_heads_reads_the_4d_values() {
        let (n, g, text) = fused(FLAT);
        assert_eq!((n, g.node_count()), (1, 3), "{text}");
        assert!(text.contains("i64[4] = const \"attn/mask_part0_shape\" [-1, 4, 1, 8]"), "{text}");
        assert!(text.contains("f32[N,4,1,8] = Reshape(%v3, %v5)  # n0 \"attn/mask_part0\""), "{text}");
        assert!(text.contains("f32[N,4,8,8] = Add(%v6, %v4)  # n1 \"attn/mask\""), "{text}");
        assert!(text.contains("= Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2, %v7)  # n2 \"attn\""), "{text}");
        // A bias shared by every row broadcasts as it is, without a Reshape.
        let (n, g, text) = fused(&FLAT.replace("f32[4N,1,8] = input", "f32[1,1,8] = input"));
        assert_eq!((n, g.node_count()), (1, 2), "{text}");
        // V flattened from another 4-D layout (heads first): its flat form is split into
        // `[b, h]` by a Reshape added, which pairs each row of the probabilities with the
        // row of V the spelled-out product does.
        let swapped = FLAT.replace("%v20: f32[4N,8,16] = Reshape(%v2, %v4)", "%v23: f32[4,N,8,16] = Transpose[perm=[1, 0, 2, 3]](%v2)  # n13 \"heads_first\"\n  %v20: f32[4N,8,16] = Reshape(%v23, %v4)");
        let (n, _, text) = fused(&swapped);
        assert_eq!(n, 1, "{text}");
        assert!(text.contains("\"attn/value\""), "{text}");
        // The flat product read elsewhere: left alone.
        let (n, _, text) = fused(&FLAT.replace("return %v22 \"y\"", "return %v22 \"y\", %v21 \"flat\""));
        assert_eq!(n, 0, "{text}");
    }

    /// DeBERTa-v2's form: the scale divides K^T in 3-D, and `masked_fill` writes the mask
    /// as `Where(Not(keep), fill, scores)`: the fused node reads `keep`, or a `Not` added
    /// for it where the condition is not one.
    /// Pegasus's eager attention (dynamo and TorchScript alike): the mask added to the
    /// scores split into heads, then the softmax taken over them flattened again; and,
    /// with no mask (its encoder and cross attention), the softmax over the 3-D product
    /// itself. Both read the 4-D values.
    #[test]
    fn attention_whose_softmax_is_taken_in_3d_reads_the_4d_values() {
        let softmax_3d = FLAT.replace(
            "%v18: f32[N,4,8,8] = Softmax[axis=-1](%v17)  # n8 \"probs\"\n  %v19: f32[4N,8,8] = Reshape(%v18, %v6)  # n9 \"flat_probs\"",
            "%v18: f32[4N,8,8] = Reshape(%v17, %v6)  # n8 \"flat_logits\"\n  %v19: f32[4N,8,8] = Softmax[axis=-1](%v18)  # n9 \"flat_probs\"",
        );
        assert_ne!(softmax_3d, FLAT);
        let (n, g, text) = fused(&softmax_3d);
        assert_eq!((n, g.node_count()), (1, 3), "{text}");
        assert!(text.contains("= Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2, %v7)  # n2 \"attn\""), "{text}");
        let unmasked = "  %v3: f32[] = const \"inv_norm\" [0.25]\n  %v4: i64[3] = const \"flat\" [-1, 8, 16]\n  %v5: i64[4] = const \"split_out\" [-1, 4, 8, 16]\n  %v6: f32[4N,8,16] = Reshape(%v0, %v4)  # n0 \"flat_q\"\n  %v7: f32[4N,8,16] = Reshape(%v1, %v4)  # n1 \"flat_k\"\n  %v8: f32[4N,16,8] = Transpose[perm=[0, 2, 1]](%v7)  # n2 \"flat_kt\"\n  %v9: f32[4N,8,8] = MatMul(%v6, %v8)  # n3 \"qk\"\n  %v10: f32[4N,8,8] = Mul(%v9, %v3)  # n4 \"scaled\"\n  %v11: f32[4N,8,8] = Softmax[axis=-1](%v10)  # n5 \"probs\"\n  %v12: f32[4N,8,16] = Reshape(%v2, %v4)  # n6 \"flat_v\"\n  %v13: f32[4N,8,16] = MatMul(%v11, %v12)  # n7 \"bmm\"\n  %v14: f32[N,4,8,16] = Reshape(%v13, %v5)  # n8 \"attn\"\n  return %v14 \"y\"\n";
        let (n, g, text) = fused(unmasked);
        assert_eq!((n, g.node_count()), (1, 1), "{text}");
        assert!(text.contains("= Attention[scale=0.25, softmax_precision=f32](%v0, %v1, %v2)  # n0 \"attn\""), "{text}");
        // The 3-D probabilities read elsewhere: left alone.
        let (n, _, text) = fused(&unmasked.replace("return %v14 \"y\"", "return %v14 \"y\", %v11 \"p\""));
        assert_eq!(n, 0, "{text}");
    }

    #[test]
    fn a_where_that_fills_where_its_condition_holds_keeps_the_negation() {
        let body = FLAT
            .replace("%v14: f32[4N,8,8] = Mul(%v13, %v3)  # n4 \"scaled\"\n  %v15: f32[4N,8,8] = Add(%v14, %v8)", "%v14: f32[4N,16,8] = Div(%v12, %v3)  # n4 \"scaled_kt\"\n  %v15: f32[4N,8,8] = MatMul(%v10, %v14)")
            .replace("%v13: f32[4N,8,8] = MatMul(%v10, %v12)  # n3 \"qk\"\n  ", "")
            .replace("%v8: f32[4N,1,8] = input \"alibi\"\n  %v9: f32[N,1,8,8] = input \"causal\"", "%v8: bool[N,1,1,8] = input \"keep\"\n  %v9: f32[] = const \"lowest\" [-3.4028234663852886e38]\n  %v13: bool[N,1,1,8] = Not(%v8)  # n3 \"masked\"")
            .replace("Add(%v16, %v9)  # n7 \"masked\"", "Where(%v13, %v9, %v16)  # n7 \"masked_fill\"");
        let (n, g, text) = fused(&body);
        assert_eq!((n, g.node_count()), (1, 1), "{text}");
        assert!(text.contains("= Attention[scale=4.0, softmax_precision=f32](%v0, %v1, %v2, %v3)"), "{text}");
        let negated = body.replace("%v13: bool[N,1,1,8] = Not(%v8)  # n3 \"masked\"", "%v13: bool[N,1,1,8] = Identity(%v8)  # n3 \"masked\"");
        let (n, g, text) = fused(&negated);
        assert_eq!((n, g.node_count()), (1, 3), "{text}");
        assert!(text.contains("bool[N,1,1,8] = Not(%v4)  # n1 \"attn/keep\""), "{text}");
    }

    /// Swin-v2's cosine attention: the scores multiplied by a trained per-head
    /// temperature `[heads, 1, 1]` rather than a scalar. The factor is the same along a
    /// row, so it multiplies Q (one node added) and the fused scale is 1; a factor that
    /// varies along the keys is not a scale, and the attention stays.
    #[test]
    fn a_per_head_temperature_multiplies_the_query() {
        let body = "  %v3: f32[4,1,1] = weight \"logit_scale\"\n  %v4: f32[N,4,16,8] = Transpose[perm=[0, 1, 3, 2]](%v1)  # n0 \"kt\"\n  %v5: f32[N,4,8,8] = MatMul(%v0, %v4)  # n1 \"qk\"\n  %v6: f32[N,4,8,8] = Mul(%v5, %v3)  # n2 \"scaled\"\n  %v7: f32[N,4,8,8] = Softmax[axis=-1](%v6)  # n3 \"probs\"\n  %v8: f32[N,4,8,16] = MatMul(%v7, %v2)  # n4 \"attn\"\n  return %v8 \"y\"\n";
        let (n, g, text) = fused(body);
        assert_eq!((n, g.node_count()), (1, 2), "{text}");
        assert!(text.contains("%v4: f32[N,4,8,16] = Mul(%v0, %v3)  # n0 \"attn/query_scaled0\""), "{text}");
        assert!(text.contains("Attention[scale=1.0, softmax_precision=f32](%v4, %v1, %v2)"), "{text}");
        let (n, g, text) = fused(&body.replace("f32[4,1,1] = weight", "f32[1,1,8] = weight"));
        assert_eq!((n, g.node_count()), (0, 5), "{text}");
    }

    #[test]
    fn attention_whose_scores_are_read_elsewhere_or_whose_key_broadcasts_is_left_alone() {
        let (n, g, text) = fused(&format!("{EAGER}  return %v10 \"y\", %v9 \"probs\"\n"));
        assert_eq!((n, g.node_count()), (0, 6), "{text}");
        // One key head shared by four query heads by broadcasting, not grouped attention.
        let shared = EAGER.replace(
            "  %v5: f32[N,4,16,8] = Transpose[perm=[0, 1, 3, 2]](%v1)",
            "  %v11: f32[N,1,8,16] = Slice(%v1, %v12, %v13, %v14)  # n6 \"one_head\"\n  %v5: f32[N,1,16,8] = Transpose[perm=[0, 1, 3, 2]](%v11)",
        ) + "  return %v10 \"y\"\n";
        let shared = shared.replace("  %v3: f32[] = const", "  %v12: i64[1] = const \"s\" [0]\n  %v13: i64[1] = const \"e\" [1]\n  %v14: i64[1] = const \"a\" [1]\n  %v3: f32[] = const");
        let (n, _, text) = fused(&shared);
        assert_eq!(n, 0, "{text}");
    }
}
