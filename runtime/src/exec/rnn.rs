//! RNN, GRU and LSTM with their default activations, as a loop over the sequence of
//! libtorch matmuls and pointwise ops, so autograd differentiates through time. libtorch's
//! fused cells are not used: their gate order and bias layout differ from ONNX's, and the
//! loop handles every ONNX option (peepholes, `linear_before_reset`, `clip`, per-row
//! sequence lengths) the same way.
//!
//! Rows past their `sequence_lens` keep their state and output zeros in `Y` (as
//! onnxruntime does); a reverse direction starts at each row's last valid step.

use tch::{Kind, Tensor};

use super::util::{ints, invalid, need, opt, R};
use pipewright_ops::op::{Rnn, RnnCell, RnnDirection};

/// One direction's parameters: W `[G*H, I]` and R `[G*H, H]` transposed for right
/// multiplication, the recurrent bias `[G*H]` and LSTM peepholes `[3H]` (i, o, f).
struct Params {
    w_t: Tensor,
    r_t: Tensor,
    wb: Option<Tensor>,
    rb: Option<Tensor>,
    peep: Option<Tensor>,
}

/// The recurrent state: hidden and (LSTM) cell, each `[B, H]`.
struct State {
    h: Tensor,
    c: Option<Tensor>,
}

pub(crate) fn rnn(k: &Rnn, ins: &[Option<&Tensor>]) -> R<Vec<Tensor>> {
    let x = need(ins, 0)?;
    // Time-major from here on: [T, B, I].
    let x = if k.batch_major { x.f_transpose(0, 1)? } else { x.shallow_clone() };
    let [steps, batch, _] = x.size()[..] else {
        return Err(invalid(format!("X must be 3-D, got {:?}", x.size())));
    };
    let dirs = if k.direction == RnnDirection::Bidirectional { 2 } else { 1 };
    let mask = opt(ins, 4).map(|l| step_mask(l, steps, batch, &x)).transpose()?;
    let (mut ys, mut hs, mut cs) = (Vec::new(), Vec::new(), Vec::new());
    for d in 0..dirs {
        let p = params(k, ins, d, dirs, &x)?;
        let s = State { h: initial(k, opt(ins, 5), d, batch, &x)?, c: None };
        let s = if k.cell == RnnCell::Lstm { State { c: Some(initial(k, opt(ins, 6), d, batch, &x)?), ..s } } else { s };
        let reverse = k.direction == RnnDirection::Reverse || d == 1;
        let (y, last) = direction(k, &x, &p, s, mask.as_ref(), reverse)?;
        ys.push(y);
        hs.push(last.h);
        cs.extend(last.c);
    }
    let mut outs = vec![Tensor::f_stack(&ys, 1)?, Tensor::f_stack(&hs, 0)?];
    if !cs.is_empty() {
        outs.push(Tensor::f_stack(&cs, 0)?);
    }
    if k.batch_major {
        outs[0] = outs[0].f_permute([2, 0, 1, 3])?;
        for s in &mut outs[1..] {
            *s = s.f_transpose(0, 1)?;
        }
    }
    Ok(outs)
}

/// `[T, B, 1]`: whether step `t` is within row `b`'s sequence length.
fn step_mask(lens: &Tensor, steps: i64, batch: i64, like: &Tensor) -> R<Tensor> {
    let l = ints(lens)?;
    if l.len() as i64 != batch || l.iter().any(|&v| !(0..=steps).contains(&v)) {
        return Err(invalid(format!("sequence_lens {l:?} must give one length in 0..={steps} per batch row ({batch})")));
    }
    let lens = Tensor::f_from_slice(&l)?.f_to(like.device())?.f_unsqueeze(0)?;
    let t = Tensor::f_arange(steps, (Kind::Int64, like.device()))?.f_unsqueeze(1)?;
    Ok(t.f_lt_tensor(&lens)?.f_unsqueeze(-1)?)
}

/// Direction `d`'s weights, checked against X, the hidden size and the gate count.
fn params(k: &Rnn, ins: &[Option<&Tensor>], d: i64, dirs: i64, x: &Tensor) -> R<Params> {
    let (w, r) = (need(ins, 1)?, need(ins, 2)?);
    let gh = gates(k) * k.hidden_size;
    let input = x.size()[2];
    if w.size() != [dirs, gh, input] || r.size() != [dirs, gh, k.hidden_size] {
        return Err(invalid(format!(
            "W {:?} and R {:?} must be [{dirs}, {gh}, {input}] and [{dirs}, {gh}, {}]",
            w.size(),
            r.size(),
            k.hidden_size
        )));
    }
    let (mut wb, mut rb) = (None, None);
    if let Some(b) = opt(ins, 3) {
        if b.size() != [dirs, 2 * gh] {
            return Err(invalid(format!("B {:?} must be [{dirs}, {}]", b.size(), 2 * gh)));
        }
        let b = b.f_select(0, d)?;
        wb = Some(b.f_narrow(0, 0, gh)?);
        rb = Some(b.f_narrow(0, gh, gh)?);
    }
    let peep = match opt(ins, 7).filter(|_| k.cell == RnnCell::Lstm) {
        Some(p) if p.size() == [dirs, 3 * k.hidden_size] => Some(p.f_select(0, d)?),
        Some(p) => return Err(invalid(format!("P {:?} must be [{dirs}, {}]", p.size(), 3 * k.hidden_size))),
        None => None,
    };
    Ok(Params { w_t: w.f_select(0, d)?.f_transpose(0, 1)?, r_t: r.f_select(0, d)?.f_transpose(0, 1)?, wb, rb, peep })
}

fn gates(k: &Rnn) -> i64 {
    match k.cell {
        RnnCell::Rnn => 1,
        RnnCell::Gru => 3,
        RnnCell::Lstm => 4,
    }
}

/// Direction `d`'s initial state `[B, H]` from `[D, B, H]` (batch-major: `[B, D, H]`), or zeros.
fn initial(k: &Rnn, t: Option<&Tensor>, d: i64, batch: i64, x: &Tensor) -> R<Tensor> {
    let Some(t) = t else {
        return Ok(Tensor::f_zeros([batch, k.hidden_size], (x.f_kind()?, x.device()))?);
    };
    let t = if k.batch_major { t.f_transpose(0, 1)? } else { t.shallow_clone() };
    if t.dim() != 3 || t.size()[1..] != [batch, k.hidden_size] {
        return Err(invalid(format!("initial state {:?} does not fit batch {batch} and hidden size {}", t.size(), k.hidden_size)));
    }
    Ok(t.f_select(0, d)?)
}

/// Runs one direction over the sequence: `Y` of the direction `[T, B, H]` (in time order)
/// and the final state.
fn direction(k: &Rnn, x: &Tensor, p: &Params, mut s: State, mask: Option<&Tensor>, reverse: bool) -> R<(Tensor, State)> {
    let steps = x.size()[0];
    // The input projections of every step in one matmul: [T, B, G*H].
    let mut xw = x.f_matmul(&p.w_t)?;
    if let Some(wb) = &p.wb {
        xw = xw.f_add(wb)?;
    }
    let mut ys: Vec<Tensor> = Vec::with_capacity(steps as usize);
    let order: Vec<i64> = if reverse { (0..steps).rev().collect() } else { (0..steps).collect() };
    for &t in &order {
        let xt = xw.f_select(0, t)?;
        let next = match k.cell {
            RnnCell::Rnn => State { h: act(k, &xt.f_add(&recur(&s.h, p)?)?, Tensor::f_tanh)?, c: None },
            RnnCell::Gru => gru_step(k, &xt, &s.h, p)?,
            RnnCell::Lstm => lstm_step(k, &xt, &s, p)?,
        };
        let (next, y) = match mask {
            Some(m) => masked(&m.f_select(0, t)?, next, &s)?,
            None => (State { h: next.h.shallow_clone(), c: next.c }, next.h),
        };
        ys.push(y);
        s = next;
    }
    if reverse {
        ys.reverse();
    }
    Ok((Tensor::f_stack(&ys, 0)?, s))
}

/// Rows whose sequence has ended keep `prev`'s state and output zeros.
fn masked(m: &Tensor, next: State, prev: &State) -> R<(State, Tensor)> {
    let y = next.h.f_where_self(m, &next.h.f_zeros_like()?)?;
    let h = next.h.f_where_self(m, &prev.h)?;
    let c = match (next.c, &prev.c) {
        (Some(c), Some(pc)) => Some(c.f_where_self(m, pc)?),
        (c, _) => c,
    };
    Ok((State { h, c }, y))
}

/// `h R^T + Rb`: the recurrent projection of all gates, `[B, G*H]`.
fn recur(h: &Tensor, p: &Params) -> R<Tensor> {
    let r = h.f_matmul(&p.r_t)?;
    Ok(match &p.rb {
        Some(rb) => r.f_add(rb)?,
        None => r,
    })
}

/// An activation of a gate's pre-activation, clipped first when `clip` is set.
fn act(k: &Rnn, pre: &Tensor, f: fn(&Tensor) -> Result<Tensor, tch::TchError>) -> R<Tensor> {
    Ok(match k.clip {
        Some(c) => f(&pre.f_clamp(-(c as f64), c as f64)?)?,
        None => f(pre)?,
    })
}

/// GRU (gates z, r, h): `H' = (1 - z) * h~ + z * H`, with the reset gate applied to the
/// previous state before its projection, or to the projection (`linear_before_reset`).
fn gru_step(k: &Rnn, xt: &Tensor, h: &Tensor, p: &Params) -> R<State> {
    let n = k.hidden_size;
    let x3 = xt.f_split(n, -1)?;
    let rec = recur(h, p)?;
    let r3 = rec.f_split(n, -1)?;
    let z = act(k, &x3[0].f_add(&r3[0])?, Tensor::f_sigmoid)?;
    let r = act(k, &x3[1].f_add(&r3[1])?, Tensor::f_sigmoid)?;
    let hh = if k.linear_before_reset {
        r.f_mul(&r3[2])?
    } else {
        let proj = r.f_mul(h)?.f_matmul(&p.r_t.f_narrow(1, 2 * n, n)?)?;
        match &p.rb {
            Some(rb) => proj.f_add(&rb.f_narrow(0, 2 * n, n)?)?,
            None => proj,
        }
    };
    let cand = act(k, &x3[2].f_add(&hh)?, Tensor::f_tanh)?;
    // (1 - z) * cand + z * h, written as cand + z * (h - cand).
    Ok(State { h: cand.f_add(&z.f_mul(&h.f_sub(&cand)?)?)?, c: None })
}

/// LSTM (gates i, o, f, c) with optional peepholes on the cell state.
fn lstm_step(k: &Rnn, xt: &Tensor, s: &State, p: &Params) -> R<State> {
    let n = k.hidden_size;
    let c = s.c.as_ref().ok_or_else(|| invalid("LSTM state without a cell"))?;
    let g = xt.f_add(&recur(&s.h, p)?)?.f_split(n, -1)?;
    let peep = |j: i64, on: &Tensor, pre: &Tensor| -> R<Tensor> {
        Ok(match &p.peep {
            Some(pp) => pre.f_add(&pp.f_narrow(0, j * n, n)?.f_mul(on)?)?,
            None => pre.shallow_clone(),
        })
    };
    let i = act(k, &peep(0, c, &g[0])?, Tensor::f_sigmoid)?;
    let f = act(k, &peep(2, c, &g[2])?, Tensor::f_sigmoid)?;
    let cand = act(k, &g[3], Tensor::f_tanh)?;
    let c_next = f.f_mul(c)?.f_add(&i.f_mul(&cand)?)?;
    let o = act(k, &peep(1, &c_next, &g[1])?, Tensor::f_sigmoid)?;
    Ok(State { h: o.f_mul(&c_next.f_tanh()?)?, c: Some(c_next) })
}
