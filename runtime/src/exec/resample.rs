//! Resize (and Upsample): separable resampling, one resized axis at a time.
//!
//! For every output position of an axis the source indices and weights are computed here
//! in f64 (1 tap nearest, 2 linear, 4 cubic, more where antialiased downsampling widens
//! the filter); the input is then gathered along that axis with one `index_select` and
//! the taps summed with their weights. Gathers and weighted sums are differentiable, so
//! autograd gives the backward pass, for any rank. The tap tables follow the ONNX
//! reference: a source coordinate that is an integer takes the window to its left, taps
//! outside the input take the edge value (or are dropped and the rest renormalised with
//! `exclude_outside`), and tf_crop_and_resize writes `extrapolation_value` where the
//! source lies outside the input.
//!
//! AffineGrid is libtorch's affine grid generator (ONNX defines it as PyTorch's), and
//! GridSample is libtorch's grid sampler, whose coordinate mapping, rounding (half to
//! even) and padding are ONNX's for every mode and padding the importer accepts.

use tch::{Kind, Tensor};

use super::util::{ints, invalid, is_float_kind, kind, need, norm_axis, opt, unsupported, R};
use pipewright_ops::op::{AspectPolicy, CoordMode, GridPadding, NearestMode, Resize, ResizeMode};

/// How one axis is resampled: its scale factor, output extent and region of interest.
struct AxisPlan {
    axis: usize,
    scale: f64,
    out: i64,
    roi: (f32, f32),
}

/// The taps of one axis: `idx` and `w` are `[out, n]` row-major; `outside` marks the
/// output positions whose source lies outside the input (tf_crop_and_resize only).
struct Taps {
    n: usize,
    idx: Vec<i64>,
    w: Vec<f64>,
    outside: Vec<bool>,
}

pub(crate) fn resize(r: &Resize, ins: &[Option<&Tensor>]) -> R<Tensor> {
    let x = need(ins, 0)?;
    if r.mode != ResizeMode::Nearest && !is_float_kind(kind(x)?) {
        return Err(unsupported(format!("{:?} interpolation of {:?} elements", r.mode, kind(x)?)));
    }
    let dims = x.size();
    let mut y = x.shallow_clone();
    for p in plan(r, ins, &dims)? {
        let taps = taps(r, &p, dims[p.axis]);
        y = apply(r, &y, &p, &taps)?;
    }
    Ok(y)
}

fn floats(t: Option<&Tensor>) -> R<Vec<f64>> {
    match t {
        None => Ok(Vec::new()),
        Some(t) => {
            let flat = super::host::on_host(t)?.f_to_kind(Kind::Double)?.f_reshape([-1])?;
            Ok(Vec::<f64>::try_from(&flat)?)
        }
    }
}

/// The axes that change, with their scales and output extents (from `sizes` when given,
/// else `floor(extent * scale)`), in the order of `axes`. An axis left as it is (scale 1,
/// same extent, full roi) is skipped, as the reference does.
fn plan(r: &Resize, ins: &[Option<&Tensor>], dims: &[i64]) -> R<Vec<AxisPlan>> {
    let rank = dims.len();
    let axes: Vec<usize> = match &r.axes {
        Some(a) => a.iter().map(|&a| norm_axis(a, rank).map(|a| a as usize)).collect::<R<_>>()?,
        None => (0..rank).collect(),
    };
    let (roi, scales, sizes) = if r.legacy {
        (Vec::new(), floats(opt(ins, 1))?, Vec::new())
    } else {
        (floats(opt(ins, 1))?, floats(opt(ins, 2))?, opt(ins, 3).map(ints).transpose()?.unwrap_or_default())
    };
    let k = axes.len();
    if axes.iter().any(|&a| dims[a] == 0) {
        return Err(invalid(format!("cannot resize an empty axis of {dims:?}")));
    }
    let (scale, out): (Vec<f64>, Vec<i64>) = if !sizes.is_empty() {
        if sizes.len() != k {
            return Err(invalid(format!("{} sizes for {k} axes", sizes.len())));
        }
        let ratios: Vec<f64> = axes.iter().zip(&sizes).map(|(&a, &s)| s as f64 / dims[a] as f64).collect();
        let pick = match r.aspect {
            AspectPolicy::Stretch => return Ok(plans(&axes, ratios, sizes, &roi, r.coord, dims)?),
            AspectPolicy::NotLarger => f64::min,
            AspectPolicy::NotSmaller => f64::max,
        };
        let f = ratios.iter().copied().reduce(pick).unwrap_or(1.0);
        (vec![f; k], axes.iter().map(|&a| (f * dims[a] as f64 + 0.5).floor() as i64).collect())
    } else if scales.len() == k {
        if let Some(s) = scales.iter().find(|s| !(**s > 0.0 && s.is_finite())) {
            return Err(invalid(format!("scale {s} is not positive")));
        }
        let out = axes.iter().zip(&scales).map(|(&a, &s)| (s * dims[a] as f64).floor() as i64).collect();
        (scales, out)
    } else {
        return Err(invalid(format!("{} scales and no sizes for {k} axes", scales.len())));
    };
    plans(&axes, scale, out, &roi, r.coord, dims)
}

fn plans(axes: &[usize], scale: Vec<f64>, out: Vec<i64>, roi: &[f64], coord: CoordMode, dims: &[i64]) -> R<Vec<AxisPlan>> {
    let k = axes.len();
    let crop = coord == CoordMode::TfCropAndResize;
    if crop && roi.len() != 2 * k {
        return Err(invalid(format!("tf_crop_and_resize needs {} roi values, got {}", 2 * k, roi.len())));
    }
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
    let mut plans = Vec::with_capacity(k);
    for (i, &axis) in axes.iter().enumerate() {
        // The reference keeps the roi in f32 and does its arithmetic there.
        let roi = if crop { (roi[i] as f32, roi[k + i] as f32) } else { (0.0, 1.0) };
        let identity = close(scale[i], 1.0) && out[i] == dims[axis] && roi.0 == 0.0 && close(f64::from(roi.1), 1.0);
        if out[i] < 0 {
            return Err(invalid(format!("output extent {} for axis {axis}", out[i])));
        }
        if !identity {
            plans.push(AxisPlan { axis, scale: scale[i], out: out[i], roi });
        }
    }
    Ok(plans)
}

/// The source coordinate of output index `y` (the output width `out_w = scale * len` is
/// the unrounded one, as in the ONNX definition).
fn source(c: CoordMode, y: f64, p: &AxisPlan, len: i64) -> f64 {
    let (s, n) = (p.scale, len as f64);
    let out_w = s * n;
    match c {
        CoordMode::HalfPixel => (y + 0.5) / s - 0.5,
        CoordMode::HalfPixelSymmetric => {
            let offset = n / 2.0 * (1.0 - p.out as f64 / out_w);
            offset + (y + 0.5) / s - 0.5
        }
        CoordMode::PytorchHalfPixel if out_w == 1.0 => -0.5,
        CoordMode::PytorchHalfPixel => (y + 0.5) / s - 0.5,
        CoordMode::AlignCorners if out_w == 1.0 => 0.0,
        CoordMode::AlignCorners => y * (n - 1.0) / (out_w - 1.0),
        CoordMode::Asymmetric => y / s,
        CoordMode::TfCropAndResize => {
            let (a, b) = p.roi;
            let span = f64::from(b - a);
            let start = f64::from(a * (len - 1) as f32);
            let x = if out_w == 1.0 { f64::from((b - a) * (len - 1) as f32 / 2.0) } else { y * span * (n - 1.0) / (out_w - 1.0) };
            x + start
        }
    }
}

/// The first tap's offset from the left neighbour and the tap count. Antialiased
/// downsampling stretches the linear (triangle) or cubic filter by `1 / scale`.
fn window(r: &Resize, scale: f64) -> (i64, usize) {
    let s = scale.min(1.0);
    let start = match (r.mode, r.antialias) {
        (ResizeMode::Nearest, _) => return (0, 1),
        (ResizeMode::Linear, false) => 0,
        (ResizeMode::Cubic, false) => -1,
        (ResizeMode::Linear, true) => (-1.0 / s).floor() as i64 + 1,
        (ResizeMode::Cubic, true) => (-2.0 / s).floor() as i64 + 1,
    };
    (start, (2 - 2 * start) as usize)
}

/// The filter's weight at distance `t` (in input samples) from the source coordinate.
fn weight(r: &Resize, t: f64, scale: f64) -> f64 {
    let s = if r.antialias { scale.min(1.0) } else { 1.0 };
    let d = (t * s).abs();
    let a = f64::from(r.cubic_a);
    match r.mode {
        ResizeMode::Linear => (1.0 - d).clamp(0.0, 1.0),
        ResizeMode::Cubic if d <= 1.0 => ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0,
        ResizeMode::Cubic if d < 2.0 => ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a,
        _ => 0.0,
    }
}

/// The nearest source index of a fractional coordinate `x` (`i0 = floor(x)`, `ratio` its
/// fraction); an integer coordinate is its own nearest.
fn nearest(mode: NearestMode, x: f64, i0: i64, ratio: f64) -> i64 {
    if x == x.floor() {
        return x as i64;
    }
    let up = match mode {
        NearestMode::RoundPreferFloor => ratio > 0.5,
        NearestMode::RoundPreferCeil => ratio >= 0.5,
        NearestMode::Floor => false,
        NearestMode::Ceil => true,
    };
    i0 + i64::from(up)
}

fn taps(r: &Resize, p: &AxisPlan, len: i64) -> Taps {
    let (start, n) = window(r, p.scale);
    let mut t = Taps { n, idx: Vec::new(), w: Vec::new(), outside: Vec::new() };
    for y in 0..p.out {
        let x = source(r.coord, y as f64, p, len);
        t.outside.push(r.coord == CoordMode::TfCropAndResize && (x < 0.0 || x > (len - 1) as f64));
        if r.mode == ResizeMode::Nearest {
            let fl = x.floor();
            t.idx.push(nearest(r.nearest, x, fl as i64, x - fl).clamp(0, len - 1));
            t.w.push(1.0);
            continue;
        }
        // An integer coordinate takes the window to its left with ratio 1 (the reference's
        // tie-breaking), which gives the same value and decides which edge taps exist.
        let fl = x.floor();
        let (i0, ratio) = if x == fl { (fl as i64 - 1, 1.0) } else { (fl as i64, x - fl) };
        let mut row: Vec<(i64, f64)> =
            (0..n as i64).map(|k| (i0 + start + k, weight(r, (start + k) as f64 - ratio, p.scale))).collect();
        if r.antialias {
            normalise(&mut row);
        }
        if r.exclude_outside {
            row.iter_mut().filter(|(i, _)| *i < 0 || *i >= len).for_each(|tap| tap.1 = 0.0);
            normalise(&mut row);
        }
        for (i, w) in row {
            t.idx.push(i.clamp(0, len - 1));
            t.w.push(w);
        }
    }
    t
}

/// Scales the weights to sum to one (left alone when they sum to zero).
fn normalise(row: &mut [(i64, f64)]) {
    let sum: f64 = row.iter().map(|t| t.1).sum();
    if sum != 0.0 {
        row.iter_mut().for_each(|t| t.1 /= sum);
    }
}

/// Resamples `y` along one axis: gather the taps, weight and sum them, then write the
/// extrapolation value where the source is outside.
fn apply(r: &Resize, y: &Tensor, p: &AxisPlan, t: &Taps) -> R<Tensor> {
    let (axis, dev) = (p.axis as i64, y.device());
    let idx = Tensor::f_from_slice(&t.idx)?.f_to(dev)?;
    let picked = y.f_index_select(axis, &idx)?;
    let out = if t.n == 1 {
        picked
    } else {
        let mut split = y.size();
        split[p.axis] = p.out;
        split.insert(p.axis + 1, t.n as i64);
        let mut wshape = vec![1i64; split.len()];
        wshape[p.axis] = p.out;
        wshape[p.axis + 1] = t.n as i64;
        let w = Tensor::f_from_slice(&t.w)?.f_to_kind(kind(y)?)?.f_to(dev)?.f_reshape(&wshape)?;
        picked.f_reshape(&split)?.f_mul(&w)?.f_sum_dim_intlist(axis + 1, false, kind(y)?)?
    };
    if !t.outside.iter().any(|&o| o) {
        return Ok(out);
    }
    let mut mshape = vec![1i64; y.dim()];
    mshape[p.axis] = p.out;
    let mask = Tensor::f_from_slice(&t.outside)?.f_reshape(&mshape)?.f_to(dev)?;
    Ok(out.f_masked_fill(&mask, f64::from(r.extrapolation))?)
}

/// GridSample: the grid (cast to the input's type) through libtorch's grid sampler,
/// differentiable in both the input and the grid.
pub(crate) fn grid_sample(x: &Tensor, grid: &Tensor, mode: ResizeMode, padding: GridPadding, align_corners: bool) -> R<Tensor> {
    let rank = x.dim();
    if !(4..=5).contains(&rank) || (mode == ResizeMode::Cubic && rank != 4) {
        return Err(unsupported(format!("{mode:?} sampling of a {rank}-D input")));
    }
    if !is_float_kind(kind(x)?) {
        return Err(unsupported(format!("sampling {:?} elements", kind(x)?)));
    }
    let interpolation = match mode {
        ResizeMode::Linear => 0,
        ResizeMode::Nearest => 1,
        ResizeMode::Cubic => 2,
    };
    let pad = match padding {
        GridPadding::Zeros => 0,
        GridPadding::Border => 1,
        GridPadding::Reflection => 2,
    };
    let grid = grid.f_to_kind(kind(x)?)?;
    Ok(Tensor::f_grid_sampler(x, &grid, interpolation, pad, align_corners)?)
}

/// AffineGrid: libtorch's generator, differentiable in `theta`. The size's batch entry is
/// theta's, so a size frozen at the export batch serves any batch.
pub(crate) fn affine_grid(theta: &Tensor, size: &Tensor, align_corners: bool) -> R<Tensor> {
    let mut size = ints(size)?;
    let t = theta.size();
    let fits = matches!((t.as_slice(), size.len()), ([_, 2, 3], 4) | ([_, 3, 4], 5));
    if !fits || !is_float_kind(kind(theta)?) {
        return Err(invalid(format!("theta {t:?} ({:?}) does not fit size {size:?}", kind(theta)?)));
    }
    size[0] = t[0];
    Ok(Tensor::f_affine_grid_generator(theta, &size, align_corners)?)
}
