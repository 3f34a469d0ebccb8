//! Shape inference of the signal and detection ops: DFT, STFT, RoiAlign and DeformConv.

use super::{conv, known_ints, In, R};
use crate::dim::{normalize_axis, Dim, Shape, TensorType};
use pipewright_ops::op::{Conv, RoiAlign};

/// A scalar input known at import (`what` names it in the error).
fn known_scalar(i: In, what: &str) -> R<i64> {
    match known_ints(i, what)?[..] {
        [v] => Ok(v),
        _ => Err(format!("{what} input must be a scalar")),
    }
}

fn fixed(d: Dim, what: &str) -> R<i64> {
    d.fixed().ok_or_else(|| format!("{what} must not depend on the batch"))
}

/// DFT's output: the transformed axis becomes the DFT length (`n / 2 + 1` one-sided
/// forward), the last axis 2 (real and imaginary parts) or 1 for a one-sided inverse,
/// which is real. Returns `(output, axis, length)`.
pub(super) fn dft(x: &TensorType, length: Option<In>, axis_in: Option<In>, attr_axis: Option<i64>, inverse: bool, onesided: bool) -> R<(TensorType, usize, i64)> {
    let d = &x.shape.0;
    let r = d.len();
    if r < 2 || !matches!(d[r - 1], Dim::Fixed(1) | Dim::Fixed(2)) {
        return Err(format!("input {} must end in an axis of 1 (real) or 2 (complex)", x.shape));
    }
    let axis = match (attr_axis, axis_in) {
        (Some(a), _) => a,
        (None, Some(i)) => known_scalar(i, "axis")?,
        (None, None) => -2,
    };
    let a = normalize_axis(axis, r).filter(|&a| a < r - 1).ok_or_else(|| format!("axis {axis} is not a signal axis of {}", x.shape))?;
    let extent = fixed(d[a], "the transformed extent")?;
    let n = match length {
        Some(i) => known_scalar(i, "dft_length")?,
        None if inverse && onesided => 2 * (extent - 1),
        None => extent,
    };
    if n < 1 {
        return Err(format!("the DFT length {n} must be positive"));
    }
    let mut out = d.clone();
    out[a] = Dim::Fixed(if onesided && !inverse { n / 2 + 1 } else { n });
    out[r - 1] = Dim::Fixed(if inverse && onesided { 1 } else { 2 });
    Ok((TensorType::new(x.dtype, Shape(out)), a, n))
}

/// STFT's output `[batch, frames, bins, 2]`, frames `1 + (length - frame_length) / step`.
pub(super) fn stft(x: &TensorType, step: In, window: Option<In>, length: Option<In>, onesided: bool) -> R<Vec<TensorType>> {
    let d = &x.shape.0;
    if d.len() != 3 || !matches!(d[2], Dim::Fixed(1) | Dim::Fixed(2)) {
        return Err(format!("signal {} must be [batch, length, 1|2]", x.shape));
    }
    let step = known_scalar(step, "frame_step")?;
    let signal = fixed(d[1], "the signal length")?;
    let window_len = match window {
        Some(w) if w.ty.shape.rank() == 1 => Some(fixed(w.ty.shape.0[0], "the window length")?),
        Some(w) => return Err(format!("window {} must be 1-D", w.ty.shape)),
        None => None,
    };
    let frame = match (length, window_len) {
        (Some(l), w) => {
            let l = known_scalar(l, "frame_length")?;
            if w.is_some_and(|w| w != l) {
                return Err(format!("the window length {w:?} differs from frame_length {l}"));
            }
            l
        }
        (None, Some(w)) => w,
        (None, None) => signal,
    };
    if step < 1 || frame < 1 || frame > signal {
        return Err(format!("frame_step {step} and frame_length {frame} must be positive, the frame no longer than the signal ({signal})"));
    }
    let frames = 1 + (signal - frame) / step;
    let bins = if onesided { frame / 2 + 1 } else { frame };
    Ok(vec![TensorType::new(x.dtype, Shape(vec![d[0], Dim::Fixed(frames), Dim::Fixed(bins), Dim::Fixed(2)]))])
}

/// RoiAlign's output `[rois, C, output_height, output_width]`.
pub(super) fn roi_align(r: &RoiAlign, x: &TensorType, rois: &TensorType, idx: &TensorType) -> R<Vec<TensorType>> {
    let (dx, dr, di) = (&x.shape.0, &rois.shape.0, &idx.shape.0);
    if dx.len() != 4 || dr.len() != 2 || dr[1] != Dim::Fixed(4) || di.len() != 1 || di[0] != dr[0] {
        return Err(format!("input {}, rois {} and batch indices {} must be [N,C,H,W], [R,4] and [R]", x.shape, rois.shape, idx.shape));
    }
    let out = vec![dr[0], dx[1], Dim::Fixed(r.output_height), Dim::Fixed(r.output_width)];
    Ok(vec![TensorType::new(x.dtype, Shape(out))])
}

/// DeformConv: a 2-D convolution's output; offsets `[N, 2 * offset_group * kH * kW, oH, oW]`
/// and the mask `[N, offset_group * kH * kW, oH, oW]` must match it.
pub(super) fn deform_conv(c: &Conv, offset_group: i64, x: In, w: In, offset: &TensorType, mask: Option<&TensorType>) -> R<Vec<TensorType>> {
    if x.ty.shape.rank() != 4 {
        return Err(format!("input {} must be 2-D ([N,C,H,W]); other spatial ranks are not supported", x.ty.shape));
    }
    let out = conv(c, x, w)?;
    let o = &out[0].shape.0;
    let taps = fixed(w.ty.shape.0[2], "kernel")? * fixed(w.ty.shape.0[3], "kernel")?;
    let c_in = fixed(x.ty.shape.0[1], "channels")?;
    if offset_group < 1 || c_in % offset_group != 0 {
        return Err(format!("offset_group {offset_group} must divide the {c_in} input channels"));
    }
    let want = |per_tap: i64| vec![o[0], Dim::Fixed(per_tap * offset_group * taps), o[2], o[3]];
    if offset.shape.0 != want(2) {
        return Err(format!("offset {} must be {}", offset.shape, Shape(want(2))));
    }
    if let Some(m) = mask {
        if m.shape.0 != want(1) {
            return Err(format!("mask {} must be {}", m.shape, Shape(want(1))));
        }
    }
    Ok(out)
}
