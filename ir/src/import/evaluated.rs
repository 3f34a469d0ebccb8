//! Ops computed once, at import: their results (or output shapes) follow from inputs
//! that must be known then, and a compiler for static shapes has no other way to run
//! them.
//!
//! - Data-dependent shapes: `NonZero`, `Unique` and `NonMaxSuppression` give outputs
//!   whose extents depend on input values, so every input must be a constant (or a
//!   frozen graph input); the outputs become constants.
//! - Signal constants: `HannWindow`, `HammingWindow`, `BlackmanWindow` and
//!   `MelWeightMatrix` depend only on scalar parameters that fix their shapes.
//!
//! None of these outputs is differentiable with respect to anything trainable (indices,
//! counts, windows of a given length), so folding them loses no gradient. `Compress`
//! needs only its condition: the importer turns it into a `Gather` (see `mod.rs`).

use std::cmp::Ordering;

use bytes::Bytes;
use onnx_protobuf::NodeProto;

use pipewright_ops::onnx::AttrSource;

use super::attrs::Attrs;
use crate::{DType, TensorData};

/// Whether `op_type` is evaluated at import by [`evaluate_node`].
pub(crate) fn is_evaluated(op_type: &str) -> bool {
    matches!(
        op_type,
        "NonZero" | "Unique" | "NonMaxSuppression" | "HannWindow" | "HammingWindow" | "BlackmanWindow" | "MelWeightMatrix"
    )
}

/// The node's outputs (one per output slot) from its inputs (`None`: an omitted optional
/// input). Every present input is known.
pub(crate) fn evaluate_node(node: &NodeProto, inputs: &[Option<&TensorData>]) -> Result<Vec<TensorData>, String> {
    let mut a = Attrs::new(&node.attribute);
    let req = |i: usize| inputs.get(i).copied().flatten().ok_or_else(|| format!("input {i} is required"));
    let outs = match node.op_type.as_str() {
        "NonZero" => vec![non_zero(req(0)?)],
        "Unique" => {
            let axis = a.int("axis")?;
            let sorted = a.bool_or("sorted", true)?;
            unique(req(0)?, axis, sorted)?
        }
        "NonMaxSuppression" => {
            let center = a.int_or("center_point_box", 0)?;
            if center != 0 && center != 1 {
                return Err(format!("center_point_box={center} must be 0 or 1"));
            }
            vec![non_max_suppression(inputs, center == 1)?]
        }
        "HannWindow" | "HammingWindow" | "BlackmanWindow" => {
            let periodic = a.bool_or("periodic", true)?;
            let dtype = output_dtype(&mut a)?;
            vec![window(&node.op_type, req(0)?, periodic, dtype)?]
        }
        "MelWeightMatrix" => {
            let dtype = output_dtype(&mut a)?;
            let p: Vec<&TensorData> = (0..5).map(req).collect::<Result<_, _>>()?;
            vec![mel_weight_matrix(&p, dtype)?]
        }
        other => return Err(format!("{other} is not evaluated at import")),
    };
    a.finish()?;
    Ok(outs)
}

fn output_dtype(a: &mut Attrs) -> Result<DType, String> {
    let code = a.int_or("output_datatype", 1)?;
    i32::try_from(code)
        .ok()
        .and_then(DType::from_onnx)
        .filter(|d| d.is_float() || d.is_int())
        .ok_or_else(|| format!("output_datatype={code} is not a supported numeric type"))
}

fn scalar_i64(t: &TensorData, what: &str) -> Result<i64, String> {
    match t.to_i64s()[..] {
        [v] => Ok(v),
        _ => Err(format!("{what} must be a scalar, not a tensor of shape {:?}", t.dims)),
    }
}

fn scalar_f64(t: &TensorData, what: &str) -> Result<f64, String> {
    match t.to_f64s()[..] {
        [v] => Ok(v),
        _ => Err(format!("{what} must be a scalar, not a tensor of shape {:?}", t.dims)),
    }
}

/// NonZero: `[rank, count]` int64 coordinates of the non-zero elements, row-major.
fn non_zero(x: &TensorData) -> TensorData {
    let vals = x.to_f64s();
    let hits: Vec<usize> = (0..vals.len()).filter(|&i| vals[i] != 0.0).collect();
    let rank = x.dims.len();
    let mut out = vec![0i64; rank * hits.len()];
    for (j, &flat) in hits.iter().enumerate() {
        let mut rem = flat as i64;
        for ax in (0..rank).rev() {
            let extent = x.dims[ax].max(1);
            out[ax * hits.len() + j] = rem % extent;
            rem /= extent;
        }
    }
    TensorData::from_i64s(vec![rank as i64, hits.len() as i64], &out)
}

/// Picks the slices `idx` of `t` along `axis`, copying raw elements (any dtype).
fn take_axis(t: &TensorData, axis: usize, idx: &[usize]) -> TensorData {
    let (outer, n, inner) = split_at_axis(&t.dims, axis);
    let width = inner * t.dtype.size();
    let mut out = Vec::with_capacity(outer * idx.len() * width);
    for o in 0..outer {
        for &k in idx {
            let start = (o * n + k) * width;
            out.extend_from_slice(&t.bytes[start..start + width]);
        }
    }
    let mut dims = t.dims.clone();
    dims[axis] = idx.len() as i64;
    TensorData { dtype: t.dtype, dims, bytes: Bytes::from(out) }
}

/// `(product of the extents before axis, extent of axis, product after)`.
fn split_at_axis(dims: &[i64], axis: usize) -> (usize, usize, usize) {
    let p = |d: &[i64]| d.iter().product::<i64>().max(0) as usize;
    (p(&dims[..axis]), dims[axis].max(0) as usize, p(&dims[axis + 1..]))
}

/// Unique: the distinct elements (or slices along `axis`), sorted ascending or in order
/// of first occurrence, with the first-occurrence indices, the inverse indices (the
/// output position of every input element or slice) and the counts.
fn unique(x: &TensorData, axis: Option<i64>, sorted: bool) -> Result<Vec<TensorData>, String> {
    let (flat, axis) = match axis {
        None => (TensorData { dims: vec![x.numel() as i64], ..x.clone() }, 0),
        Some(a) => {
            let r = x.dims.len() as i64;
            if !(-r..r).contains(&a) {
                return Err(format!("axis {a} is out of range for rank {r}"));
            }
            (x.clone(), a.rem_euclid(r) as usize)
        }
    };
    let (outer, n, inner) = split_at_axis(&flat.dims, axis);
    // Integer keys compare exactly; floats by value.
    let keys: Vec<f64> = flat.to_f64s();
    let ikeys: Vec<i64> = flat.to_i64s();
    let slice_cmp = |p: usize, q: usize| -> Ordering {
        for o in 0..outer {
            for i in 0..inner {
                let (a, b) = ((o * n + p) * inner + i, (o * n + q) * inner + i);
                let c = if flat.dtype.is_float() { keys[a].total_cmp(&keys[b]) } else { ikeys[a].cmp(&ikeys[b]) };
                if c != Ordering::Equal {
                    return c;
                }
            }
        }
        Ordering::Equal
    };
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&p, &q| slice_cmp(p, q));
    // Groups of equal slices: (first occurrence, members), in sorted order.
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for &k in &order {
        match groups.last_mut() {
            Some((_, members)) if slice_cmp(members[0], k) == Ordering::Equal => members.push(k),
            _ => groups.push((k, vec![k])),
        }
    }
    if !sorted {
        groups.sort_by_key(|g| g.0);
    }
    let mut inverse = vec![0i64; n];
    for (pos, (_, members)) in groups.iter().enumerate() {
        for &k in members {
            inverse[k] = pos as i64;
        }
    }
    let firsts: Vec<usize> = groups.iter().map(|g| g.0).collect();
    let g = groups.len() as i64;
    Ok(vec![
        take_axis(&flat, axis, &firsts),
        TensorData::from_i64s(vec![g], &firsts.iter().map(|&f| f as i64).collect::<Vec<_>>()),
        TensorData::from_i64s(vec![n as i64], &inverse),
        TensorData::from_i64s(vec![g], &groups.iter().map(|m| m.1.len() as i64).collect::<Vec<_>>()),
    ])
}

/// A box as `(y_min, x_min, y_max, x_max)` in f32, the reference's precision.
fn corners(b: &[f32], center: bool) -> [f32; 4] {
    if center {
        let (hw, hh) = (b[2] / 2.0, b[3] / 2.0);
        [b[1] - hh, b[0] - hw, b[1] + hh, b[0] + hw]
    } else {
        [b[0].min(b[2]), b[1].min(b[3]), b[0].max(b[2]), b[1].max(b[3])]
    }
}

/// Whether the intersection over union of `a` and `b` exceeds `threshold`.
fn overlaps(a: [f32; 4], b: [f32; 4], threshold: f32) -> bool {
    let (y0, x0, y1, x1) = (a[0].max(b[0]), a[1].max(b[1]), a[2].min(b[2]), a[3].min(b[3]));
    if x1 <= x0 || y1 <= y0 {
        return false;
    }
    let inter = (x1 - x0) * (y1 - y0);
    let area = |c: [f32; 4]| (c[3] - c[1]) * (c[2] - c[0]);
    let (a1, a2) = (area(a), area(b));
    let union = a1 + a2 - inter;
    if inter <= 0.0 || a1 <= 0.0 || a2 <= 0.0 || union <= 0.0 {
        return false;
    }
    inter / union > threshold
}

/// NonMaxSuppression: per batch and class, boxes by descending score (ties: lower index
/// first), kept unless they overlap a kept box by more than the IoU threshold; scores at
/// or below the score threshold (when given) are dropped. `[selected, 3]` int64 rows
/// `(batch, class, box)`.
fn non_max_suppression(inputs: &[Option<&TensorData>], center: bool) -> Result<TensorData, String> {
    let (boxes, scores) = match (inputs.first().copied().flatten(), inputs.get(1).copied().flatten()) {
        (Some(b), Some(s)) => (b, s),
        _ => return Err("boxes and scores are required".into()),
    };
    let (bd, sd) = (&boxes.dims, &scores.dims);
    if bd.len() != 3 || bd[2] != 4 || sd.len() != 3 || sd[0] != bd[0] || sd[2] != bd[1] {
        return Err(format!("boxes {bd:?} must be [batches, boxes, 4] and scores {sd:?} [batches, classes, boxes]"));
    }
    let opt = |i: usize| inputs.get(i).copied().flatten().filter(|t| t.numel() > 0);
    let max_out = match opt(2) {
        Some(t) => scalar_i64(t, "max_output_boxes_per_class")?.max(0),
        None => 0,
    };
    let iou = match opt(3) {
        Some(t) => scalar_f64(t, "iou_threshold")? as f32,
        None => 0.0,
    };
    let score_min = opt(4).map(|t| scalar_f64(t, "score_threshold").map(|v| v as f32)).transpose()?;
    let bv: Vec<f32> = boxes.to_f64s().into_iter().map(|v| v as f32).collect();
    let sv: Vec<f32> = scores.to_f64s().into_iter().map(|v| v as f32).collect();
    let (nb, nc, nbox) = (bd[0] as usize, sd[1] as usize, bd[1] as usize);
    let mut rows: Vec<i64> = Vec::new();
    for b in 0..nb {
        let boxes_of = |i: usize| corners(&bv[(b * nbox + i) * 4..(b * nbox + i) * 4 + 4], center);
        for c in 0..nc {
            let s = &sv[(b * nc + c) * nbox..(b * nc + c + 1) * nbox];
            let mut cand: Vec<usize> = (0..nbox).filter(|&i| score_min.is_none_or(|m| s[i] > m)).collect();
            cand.sort_by(|&p, &q| s[q].total_cmp(&s[p]).then(p.cmp(&q)));
            let mut kept: Vec<usize> = Vec::new();
            for i in cand {
                if kept.len() as i64 >= max_out {
                    break;
                }
                if kept.iter().all(|&k| !overlaps(boxes_of(i), boxes_of(k), iou)) {
                    kept.push(i);
                    rows.extend([b as i64, c as i64, i as i64]);
                }
            }
        }
    }
    Ok(TensorData::from_i64s(vec![rows.len() as i64 / 3, 3], &rows))
}

/// Largest window or mel matrix computed at import (elements).
const MAX_ELEMENTS: i64 = 1 << 24;

/// The cosine-sum windows: `sum_k a_k cos(2 pi k n / N)` with `N` the size (periodic) or
/// size - 1 (symmetric).
fn window(op: &str, size: &TensorData, periodic: bool, dtype: DType) -> Result<TensorData, String> {
    let n = scalar_i64(size, "size")?;
    if !(0..=MAX_ELEMENTS).contains(&n) {
        return Err(format!("size {n} is negative or too large"));
    }
    let coeffs: &[f64] = match op {
        "HannWindow" => &[0.5, -0.5],
        "HammingWindow" => &[25.0 / 46.0, -21.0 / 46.0],
        _ => &[0.42, -0.5, 0.08],
    };
    let denom = if periodic { n } else { n - 1 } as f64;
    let vals: Vec<f64> = (0..n)
        .map(|i| {
            let t = 2.0 * std::f64::consts::PI * i as f64 / denom;
            coeffs.iter().enumerate().map(|(k, c)| c * (k as f64 * t).cos()).sum()
        })
        .collect();
    Ok(TensorData::from_f64s(dtype, vec![n], &vals))
}

/// MelWeightMatrix `[dft_length / 2 + 1, num_mel_bins]`: triangular filters between mel
/// points spaced evenly from the lower to the upper edge, each placed at the spectrogram
/// bin `floor((dft_length + 1) * hz / sample_rate)` (as the reference computes them: the
/// `log1p` of the edges in f32, the rest in f64).
fn mel_weight_matrix(p: &[&TensorData], dtype: DType) -> Result<TensorData, String> {
    let bins = scalar_i64(p[0], "num_mel_bins")?;
    let dft = scalar_i64(p[1], "dft_length")?;
    let rate = scalar_i64(p[2], "sample_rate")?;
    let (lo, hi) = (scalar_f64(p[3], "lower_edge_hertz")?, scalar_f64(p[4], "upper_edge_hertz")?);
    if bins < 1 || dft < 1 || rate < 1 || (dft / 2 + 1).saturating_mul(bins) > MAX_ELEMENTS {
        return Err(format!("num_mel_bins {bins}, dft_length {dft} and sample_rate {rate} must be positive (and the matrix not too large)"));
    }
    let mel = |hz: f64| f64::from(2595.0f32 * (hz as f32 / 700.0).ln_1p()) / std::f64::consts::LN_10;
    let (lo_mel, hi_mel) = (mel(lo), mel(hi));
    let step = (hi_mel - lo_mel) / (bins + 2) as f64;
    let points: Vec<i64> = (0..bins + 2)
        .map(|i| {
            let hz = 700.0 * ((i as f64 * step + lo_mel) / 2595.0 * std::f64::consts::LN_10).exp_m1();
            (((dft + 1) as f64 * hz) / rate as f64).floor() as i64
        })
        .collect();
    let rows = dft / 2 + 1;
    let mut out = vec![0.0f64; (rows * bins) as usize];
    let mut set = |j: i64, i: i64, v: f64| -> Result<(), String> {
        if !(0..rows).contains(&j) {
            return Err(format!("a mel point falls on spectrogram bin {j}, outside 0..{rows}"));
        }
        out[(j * bins + i) as usize] = v;
        Ok(())
    };
    for i in 0..bins {
        let (l, c, h) = (points[i as usize], points[i as usize + 1], points[i as usize + 2]);
        if c == l {
            set(c, i, 1.0)?;
        } else {
            for j in l..=c {
                set(j, i, (j - l) as f64 / (c - l) as f64)?;
            }
        }
        for j in c..h {
            set(j, i, (h - j) as f64 / (h - c) as f64)?;
        }
    }
    Ok(TensorData::from_f64s(dtype, vec![rows, bins], &out))
}
