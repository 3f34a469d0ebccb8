//! Signal and detection kernels: DFT, STFT, RoiAlign and DeformConv.
//!
//! DFT and STFT are libtorch's FFTs over a complex view of the `[..., 1|2]` signal, so
//! autograd differentiates them. RoiAlign gathers its bilinear taps with index tables
//! computed here from the regions (read back to the host: the regions decide which
//! pixels are read, and are not differentiated, as in torchvision), then weights and
//! pools them with tensor ops (differentiable in the input). DeformConv samples the
//! input at the offset tap positions with libtorch's grid sampler (the ONNX reference is
//! defined by GridSample) and convolves the sampled columns with one batched matmul;
//! every input, offsets and mask included, gets a gradient.

use tch::{Kind, Tensor};

use super::util::{index_tensor, invalid, is_float_kind, kind, need, norm_axis, opt, scalar_i64, unsupported, R};
use pipewright_ops::op::{Conv, RoiAlign};

/// DFT: `axis` is the opset-17 attribute, or input 2 (default -2); the length input 1,
/// by default the axis extent (twice one less for a one-sided inverse).
pub(crate) fn dft(ins: &[Option<&Tensor>], inverse: bool, onesided: bool, attr_axis: Option<i64>) -> R<Tensor> {
    let x = need(ins, 0)?;
    let r = x.dim();
    let axis = match (attr_axis, opt(ins, 2)) {
        (Some(a), _) => a,
        (None, Some(t)) => scalar_i64(t)?,
        (None, None) => -2,
    };
    let axis = norm_axis(axis, r)?;
    if r < 2 || axis as usize >= r - 1 {
        return Err(invalid(format!("axis {axis} is not a signal axis of {:?}", x.size())));
    }
    let extent = x.size()[axis as usize];
    let n = match opt(ins, 1) {
        Some(t) => scalar_i64(t)?,
        None if inverse && onesided => 2 * (extent - 1),
        None => extent,
    };
    if n < 1 {
        return Err(invalid(format!("DFT length {n} must be positive")));
    }
    transform(x, axis, n, inverse, onesided)
}

/// The (inverse) DFT of length `n` along `axis` of a `[..., 1|2]` real or complex signal,
/// as `[..., 2]` (or `[..., 1]` for the real one-sided inverse). Half types are
/// transformed in f32.
fn transform(x: &Tensor, axis: i64, n: i64, inverse: bool, onesided: bool) -> R<Tensor> {
    let k = kind(x)?;
    if !is_float_kind(k) {
        return Err(unsupported(format!("a DFT of {k:?} elements")));
    }
    let work = if k == Kind::Double { Kind::Double } else { Kind::Float };
    let xw = x.f_to_kind(work)?;
    let signal = match x.size().last() {
        Some(1) => xw.f_squeeze_dim(-1)?,
        Some(2) => xw.f_contiguous()?.f_view_as_complex()?,
        _ => return Err(invalid(format!("signal {:?} must end in an axis of 1 or 2", x.size()))),
    };
    let out = match (inverse, onesided) {
        (false, _) => {
            let y = signal.f_fft_fft(n, axis, "backward")?;
            let y = if onesided { y.f_narrow(axis, 0, n / 2 + 1)? } else { y };
            y.f_view_as_real()?
        }
        (true, false) => signal.f_fft_ifft(n, axis, "backward")?.f_view_as_real()?,
        (true, true) => signal.f_fft_irfft(n, axis, "backward")?.f_unsqueeze(-1)?,
    };
    Ok(out.f_to_kind(k)?)
}

/// STFT of `[batch, length, 1|2]`: frames of `frame_length` every `frame_step` samples,
/// weighted by the window, each transformed along the frame axis.
pub(crate) fn stft(ins: &[Option<&Tensor>], onesided: bool) -> R<Tensor> {
    let x = need(ins, 0)?;
    let step = scalar_i64(need(ins, 1)?)?;
    let (window, length) = (opt(ins, 2), opt(ins, 3).map(scalar_i64).transpose()?);
    let d = x.size();
    if d.len() != 3 {
        return Err(invalid(format!("signal {d:?} must be [batch, length, 1|2]")));
    }
    let frame = match (length, window.map(|w| w.size())) {
        (Some(l), Some(w)) if w != [l] => return Err(invalid(format!("window {w:?} does not have frame_length {l}"))),
        (Some(l), _) => l,
        (None, Some(w)) if w.len() == 1 => w[0],
        (None, Some(w)) => return Err(invalid(format!("window {w:?} must be 1-D"))),
        (None, None) => d[1],
    };
    if step < 1 || frame < 1 || frame > d[1] {
        return Err(invalid(format!("frame_step {step} and frame_length {frame} do not fit a signal of {}", d[1])));
    }
    // [batch, frames, 1|2, frame] -> [batch, frames, frame, 1|2]
    let frames = x.f_unfold(1, frame, step)?.f_permute([0, 1, 3, 2])?;
    let frames = match window {
        Some(w) => frames.f_mul(&w.f_to_kind(kind(x)?)?.f_reshape([1, 1, frame, 1])?)?,
        None => frames,
    };
    transform(&frames, 2, frame, false, onesided)
}

/// The bilinear taps of every sample of one region: flat pixel indices and weights,
/// `[bins, samples, 4]` each, plus whether each sample slot is used (regions with fewer
/// adaptive samples than the widest one leave slots unused).
struct RoiTaps {
    idx: Vec<i64>,
    w: Vec<f64>,
    used: Vec<bool>,
    count: f64,
}

/// The sample grid of one region `[x1, y1, x2, y2]`, as the ONNX reference computes it.
fn roi_grid(r: &RoiAlign, roi: &[f64]) -> ((f64, f64), (f64, f64), (i64, i64)) {
    let off = if r.half_pixel { 0.5 } else { 0.0 };
    let s = f64::from(r.spatial_scale);
    let (x0, y0, x1, y1) = (roi[0] * s - off, roi[1] * s - off, roi[2] * s - off, roi[3] * s - off);
    let (mut w, mut h) = (x1 - x0, y1 - y0);
    if !r.half_pixel {
        w = w.max(1.0);
        h = h.max(1.0);
    }
    let (bh, bw) = (h / r.output_height as f64, w / r.output_width as f64);
    let grid = |extent: f64, out: i64| if r.sampling_ratio > 0 { r.sampling_ratio } else { (extent / out as f64).ceil() as i64 };
    ((y0, x0), (bh, bw), (grid(h, r.output_height).max(0), grid(w, r.output_width).max(0)))
}

/// One coordinate's two taps `(low, high, weight of high)`; `None` outside `[-1, n]`.
fn taps_1d(v: f64, n: i64) -> Option<(i64, i64, f64)> {
    if v < -1.0 || v > n as f64 {
        return None;
    }
    let v = v.max(0.0);
    let low = v as i64;
    if low >= n - 1 {
        return Some((n - 1, n - 1, 0.0));
    }
    Some((low, low + 1, v - low as f64))
}

fn roi_taps(r: &RoiAlign, roi: &[f64], slots: i64, h: i64, w: i64) -> RoiTaps {
    let ((y0, x0), (bh, bw), (gh, gw)) = roi_grid(r, roi);
    let bins = (r.output_height * r.output_width) as usize;
    let n = bins * slots as usize;
    let mut t = RoiTaps { idx: vec![0; n * 4], w: vec![0.0; n * 4], used: vec![false; n], count: (gh * gw).max(1) as f64 };
    for ph in 0..r.output_height {
        for pw in 0..r.output_width {
            let bin = (ph * r.output_width + pw) as usize;
            for iy in 0..gh {
                let y = y0 + ph as f64 * bh + (iy as f64 + 0.5) * bh / gh as f64;
                for ix in 0..gw {
                    let x = x0 + pw as f64 * bw + (ix as f64 + 0.5) * bw / gw as f64;
                    let slot = bin * slots as usize + (iy * gw + ix) as usize;
                    t.used[slot] = true;
                    // Outside the image a sample is 0 (weights 0), still counted.
                    let (Some((yl, yh, ly)), Some((xl, xh, lx))) = (taps_1d(y, h), taps_1d(x, w)) else { continue };
                    let taps = [(yl, xl, (1.0 - ly) * (1.0 - lx)), (yl, xh, (1.0 - ly) * lx), (yh, xl, ly * (1.0 - lx)), (yh, xh, ly * lx)];
                    for (k, (yy, xx, wt)) in taps.into_iter().enumerate() {
                        t.idx[slot * 4 + k] = yy * w + xx;
                        t.w[slot * 4 + k] = wt;
                    }
                }
            }
        }
    }
    t
}

/// RoiAlign: per region and bin, the samples' bilinear values averaged (or, `max`, the
/// largest weighted tap, as the reference computes it).
pub(crate) fn roi_align(r: &RoiAlign, x: &Tensor, rois: &Tensor, batch: &Tensor) -> R<Tensor> {
    let d = x.size();
    let nr = rois.size().first().copied().unwrap_or(0);
    if d.len() != 4 || rois.size() != [nr, 4] || batch.size() != [nr] {
        return Err(invalid(format!("input {d:?}, rois {:?} and batch indices {:?} must be [N,C,H,W], [R,4] and [R]", rois.size(), batch.size())));
    }
    let (c, h, w) = (d[1], d[2], d[3]);
    let boxes = Vec::<f64>::try_from(&super::host::on_host(rois)?.f_to_kind(Kind::Double)?.f_reshape([-1])?)?;
    let slots = (0..nr as usize).map(|i| {
        let (_, _, (gh, gw)) = roi_grid(r, &boxes[i * 4..i * 4 + 4]);
        gh * gw
    });
    let slots = slots.max().unwrap_or(0).max(1);
    let (mut idx, mut wts, mut used, mut counts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..nr as usize {
        let t = roi_taps(r, &boxes[i * 4..i * 4 + 4], slots, h, w);
        idx.extend(t.idx);
        wts.extend(t.w);
        used.extend(t.used.into_iter().map(i64::from));
        counts.push(t.count);
    }
    let bi = super::util::ints(batch)?;
    if let Some(b) = bi.iter().find(|&&b| !(0..d[0]).contains(&b)) {
        return Err(invalid(format!("batch index {b} is outside the input's {} images", d[0])));
    }
    let k = kind(x)?;
    let bins = r.output_height * r.output_width;
    let per_roi = bins * slots * 4;
    // [R, C, H*W] -> the taps [R, C, bins * slots * 4].
    let images = x.f_index_select(0, &index_tensor(&bi, x)?)?.f_reshape([nr, c, h * w])?;
    let gather_idx = index_tensor(&idx, x)?.f_reshape([nr, 1, per_roi])?.f_expand([nr, c, per_roi], false)?;
    let weights = Tensor::f_from_slice(&wts)?.f_to_kind(k)?.f_to(x.device())?.f_reshape([nr, 1, per_roi])?;
    let terms = images.f_gather(2, &gather_idx, false)?.f_mul(&weights)?.f_reshape([nr, c, bins, slots, 4])?;
    let out = if r.max {
        let unused = index_tensor(&used, x)?.f_eq(0)?.f_reshape([nr, 1, bins, slots])?;
        terms.f_amax([4], false)?.f_masked_fill(&unused, f64::NEG_INFINITY)?.f_amax([3], false)?
    } else {
        let counts = Tensor::f_from_slice(&counts)?.f_to_kind(k)?.f_to(x.device())?.f_reshape([nr, 1, 1])?;
        terms.f_sum_dim_intlist(&[3i64, 4][..], false, k)?.f_div(&counts)?
    };
    Ok(out.f_reshape([nr, c, r.output_height, r.output_width])?)
}

/// DeformConv (2-D): `Y = W * columns + B`, the columns being the input sampled
/// bilinearly (zero outside) at every tap's position plus its offset, times the mask.
pub(crate) fn deform_conv(cv: &Conv, offset_group: i64, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let (x, wt, off) = (need(ins, 0)?, need(ins, 1)?, need(ins, 2)?);
    let (d, wd, od) = (x.size(), wt.size(), off.size());
    if d.len() != 4 || wd.len() != 4 || od.len() != 4 {
        return Err(unsupported(format!("DeformConv over input {d:?}, weight {wd:?}, offset {od:?}: only 2-D is supported")));
    }
    let (n, c, h, w) = (d[0], d[1], d[2], d[3]);
    let (m, kh, kw, oh, ow) = (wd[0], wd[2], wd[3], od[2], od[3]);
    let g = cv.group;
    let og = offset_group;
    let taps = kh * kw;
    if g < 1 || og < 1 || c != wd[1] * g || m % g != 0 || c % og != 0 || od[1] != 2 * og * taps {
        return Err(invalid(format!("input {d:?}, weight {wd:?} (group {g}) and offset {od:?} (offset_group {og}) do not fit")));
    }
    let positions = tap_positions(cv, [h, w], [kh, kw], [oh, ow], x)?;
    let k = kind(x)?;
    // Offsets [N, og, kh*kw, 2, oH, oW]: (dy, dx) per tap.
    let off = off.f_reshape([n, og, taps, 2, oh, ow])?;
    let y = off.f_select(3, 0)?.f_add(&positions[0])?;
    let xx = off.f_select(3, 1)?.f_add(&positions[1])?;
    // Pixel p as align_corners=false grid coordinates (2p + 1) / extent - 1 (defined at extent 1).
    let norm = |p: Tensor, extent: i64| -> R<Tensor> { Ok(p.f_mul_scalar(2.0)?.f_add_scalar(1.0)?.f_div_scalar(extent as f64)?.f_sub_scalar(1.0)?) };
    let grid = Tensor::f_stack(&[norm(xx, w)?, norm(y, h)?], -1)?.f_to_kind(k)?.f_reshape([n * og, taps * oh, ow, 2])?;
    let sampled = x.f_reshape([n * og, c / og, h, w])?.f_grid_sampler(&grid, 0, 0, false)?;
    let mut cols = sampled.f_reshape([n, og, c / og, taps, oh, ow])?;
    if let Some(mask) = opt(ins, 4) {
        cols = cols.f_mul(&mask.f_reshape([n, og, 1, taps, oh, ow])?)?;
    }
    let cols = cols.f_reshape([n, g, (c / g) * taps, oh * ow])?;
    let out = wt.f_reshape([g, m / g, (c / g) * taps])?.f_matmul(&cols)?.f_reshape([n, m, oh, ow])?;
    match opt(ins, 3) {
        Some(b) => Ok(out.f_add(&b.f_reshape([1, m, 1, 1])?)?),
        None => Ok(out),
    }
}

/// The undisplaced tap rows and columns `[kh*kw, oH, oW]` (f64, on `like`'s device):
/// `-pad_begin + stride * o + dilation * k` per axis.
fn tap_positions(cv: &Conv, input: [i64; 2], kernel: [i64; 2], out: [i64; 2], like: &Tensor) -> R<[Tensor; 2]> {
    let wdw = &cv.window;
    let get = |v: &[i64], i: usize, default: i64| if v.is_empty() { default } else { v.get(i).copied().unwrap_or(default) };
    if !wdw.kernel_shape.is_empty() && wdw.kernel_shape != kernel {
        return Err(invalid(format!("kernel_shape {:?} does not match the weight's {kernel:?}", wdw.kernel_shape)));
    }
    let mut axes = Vec::with_capacity(2);
    for a in 0..2 {
        let (stride, dil, pad) = (get(&wdw.strides, a, 1), get(&wdw.dilations, a, 1), get(&wdw.pads, a, 0));
        let span = (kernel[a] - 1) * dil + 1;
        let pad_end = get(&wdw.pads, a + 2, 0);
        if stride < 1 || dil < 1 || (input[a] + pad + pad_end - span) / stride + 1 != out[a] {
            return Err(invalid(format!("the offsets' output extent {} does not match the window over {}", out[a], input[a])));
        }
        let mut v = Vec::with_capacity((kernel[0] * kernel[1] * out[0] * out[1]) as usize);
        for ki in 0..kernel[0] {
            for kj in 0..kernel[1] {
                for i in 0..out[0] {
                    for j in 0..out[1] {
                        let (k, o) = if a == 0 { (ki, i) } else { (kj, j) };
                        v.push((-pad + stride * o + dil * k) as f64);
                    }
                }
            }
        }
        let t = Tensor::f_from_slice(&v)?.f_to(like.device())?.f_reshape([kernel[0] * kernel[1], out[0], out[1]])?;
        axes.push(t);
    }
    let col = axes.pop().ok_or_else(|| invalid("internal: no column positions"))?;
    let row = axes.pop().ok_or_else(|| invalid("internal: no row positions"))?;
    Ok([row, col])
}
