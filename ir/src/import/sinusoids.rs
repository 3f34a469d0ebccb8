//! Sinusoidal position tables: the fixed encodings of the original Transformer (Marian,
//! Pegasus, M2M100, XGLM, CTRL), Whisper's encoder, VideoMAE, RoFormer, and the cos/sin
//! tables of rotary embeddings. PyTorch models compute them once and never train them (a
//! buffer, or a parameter with `requires_grad=False`), but an ONNX file stores them as
//! initializers like any weight, and an export records no `requires_grad`: trained, the
//! table moves and the model is no longer the one exported (Whisper's encoder stepped
//! 0.14 away from PyTorch's).
//!
//! A table is recognised by its values, not its name: along the positions (the
//! second-to-last axis; any axes before it of extent 1) every column is a sinusoid of
//! amplitude at most 1, `c[p + 1] + c[p - 1] = 2 cos(w) c[p]`, whatever its frequency `w`
//! and phase (sin and cos halves, interleaved, offset positions), and at least one column
//! turns within the table (so a tensor of ones or a linear ramp is none). Rows of zeros
//! (a padding position) hold no position and are skipped. Random or trained weights fail
//! the recurrence at their first column.

use pipewright_ops::TensorData;

/// How far the recurrence may miss, relative to the column's largest value: tables
/// computed in f32 drift in phase at long positions (the argument `p w` rounded at
/// position 1500 moves it by about 1e-4).
const TOLERANCE: f64 = 1e-3;

/// The fewest positions a table is recognised from (two equations of the recurrence).
const MIN_POSITIONS: usize = 4;

/// A column turns within the table when `|cos w|` is below this and its values reach
/// half the amplitude.
const TURNING: f64 = 0.99;

/// Whether `data` holds a sinusoidal position table (see the module docs). Always false
/// for a tensor read for its shape only, whose values are not at hand.
pub fn is_sinusoidal_table(data: &TensorData) -> bool {
    let r = data.dims.len();
    if !data.dtype.is_float() || data.is_shape_only() || r < 2 || data.dims[..r - 2].iter().any(|&d| d != 1) {
        return false;
    }
    let (rows, cols) = (data.dims[r - 2].max(0) as usize, data.dims[r - 1].max(0) as usize);
    if rows < MIN_POSITIONS || cols == 0 {
        return false;
    }
    let mut table = Table { data, cols, padding: vec![None; rows] };
    let mut turns = false;
    for k in 0..cols {
        match table.column_fit(k) {
            Some(turning) => turns |= turning,
            None => return false,
        }
    }
    turns
}

/// A `[rows, cols]` view of the table, with which rows are padding found as needed.
struct Table<'a> {
    data: &'a TensorData,
    cols: usize,
    padding: Vec<Option<bool>>,
}

impl Table<'_> {
    fn at(&self, p: usize, k: usize) -> f64 {
        self.data.f64_at(p * self.cols + k)
    }

    /// Whether row `p` is all zeros (only looked at where its element in column `k` is 0).
    fn is_padding(&mut self, p: usize, k: usize) -> bool {
        if self.at(p, k) != 0.0 {
            return false;
        }
        if let Some(known) = self.padding[p] {
            return known;
        }
        let zero = (0..self.cols).all(|j| self.at(p, j) == 0.0);
        self.padding[p] = Some(zero);
        zero
    }

    /// Fits column `k` to the recurrence over every three consecutive positions: `None`
    /// when it is no sinusoid of amplitude at most 1, else whether it turns.
    fn column_fit(&mut self, k: usize) -> Option<bool> {
        let rows = self.padding.len();
        let mut triples = Vec::new();
        for p in 1..rows - 1 {
            if !(self.is_padding(p - 1, k) || self.is_padding(p, k) || self.is_padding(p + 1, k)) {
                triples.push((self.at(p - 1, k) + self.at(p + 1, k), self.at(p, k)));
            }
        }
        if triples.len() + 2 < MIN_POSITIONS {
            return None;
        }
        let peak = (0..rows).map(|p| self.at(p, k).abs()).fold(0.0, f64::max);
        if !peak.is_finite() || peak > 1.0 + TOLERANCE {
            return None;
        }
        let (ab, bb) = triples.iter().fold((0.0, 0.0), |(ab, bb), &(a, b)| (ab + a * b, bb + b * b));
        // A column zero inside the table (sin at frequency 0) is no turn, and no obstacle.
        let cos_w = if bb > 0.0 { ab / bb / 2.0 } else { 1.0 };
        let misses = triples.iter().any(|&(a, b)| (a - 2.0 * cos_w * b).abs() > TOLERANCE * peak.max(f64::MIN_POSITIVE));
        if misses || cos_w.abs() > 1.0 + TOLERANCE {
            return None;
        }
        Some(cos_w.abs() < TURNING && peak >= 0.5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipewright_ops::DType;

    fn table(dims: &[i64], f: impl Fn(usize, usize) -> f64) -> TensorData {
        let cols = *dims.last().unwrap() as usize;
        let rows = dims[dims.len() - 2] as usize;
        let numel = dims.iter().product::<i64>() as usize;
        let values: Vec<f64> = (0..numel).map(|i| i % (rows * cols)).map(|i| f(i / cols, i % cols) as f32 as f64).collect();
        TensorData::from_f64s(DType::F32, dims.to_vec(), &values)
    }

    /// The Transformer's table, sin in the first half of the columns and cos in the
    /// second (Marian, Whisper), or interleaved (VideoMAE), at its frequencies.
    fn transformer(p: usize, k: usize, d: usize, interleaved: bool) -> f64 {
        let (i, cos) = if interleaved { (k / 2, k % 2 == 1) } else { (k % (d / 2), k >= d / 2) };
        let angle = p as f64 / 10000f64.powf(2.0 * i as f64 / d as f64);
        if cos { angle.cos() } else { angle.sin() }
    }

    #[test]
    fn position_tables_are_recognised_in_every_layout() {
        assert!(is_sinusoidal_table(&table(&[32, 16], |p, k| transformer(p, k, 16, false))));
        assert!(is_sinusoidal_table(&table(&[1, 8, 16], |p, k| transformer(p, k, 16, true))));
        // Long, computed in f32: the phase drifts, within the tolerance.
        let f32_angle = |p: usize, k: usize| ((p as f32) * (1.0f32 / 10000f32.powf(2.0 * (k % 32) as f32 / 64.0))) as f64;
        assert!(is_sinusoidal_table(&table(&[1500, 64], |p, k| if k < 32 { f32_angle(p, k).sin() } else { f32_angle(p, k).cos() })));
        // A padding row of zeros (M2M100's position 1) is skipped.
        assert!(is_sinusoidal_table(&table(&[34, 16], |p, k| if p == 1 { 0.0 } else { transformer(p, k, 16, false) })));
        // Rotary cos and sin tables, [1, 1, positions, dim].
        assert!(is_sinusoidal_table(&table(&[1, 1, 8, 4], |p, k| (p as f64 / 10000f64.powf((k % 2) as f64 / 2.0)).cos())));
    }

    #[test]
    fn weights_ones_ramps_and_scaled_tables_are_not_tables() {
        let mut seed = 7u64;
        let mut random = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 0.04
        };
        let weights: Vec<f64> = (0..64).map(|_| random()).collect();
        assert!(!is_sinusoidal_table(&table(&[8, 8], |p, k| weights[p * 8 + k])));
        assert!(!is_sinusoidal_table(&table(&[8, 8], |_, _| 1.0)));
        assert!(!is_sinusoidal_table(&table(&[8, 8], |_, _| 0.0)));
        assert!(!is_sinusoidal_table(&table(&[8, 8], |p, _| p as f64 / 8.0)));
        assert!(!is_sinusoidal_table(&table(&[8, 16], |p, k| 2.0 * transformer(p, k, 16, false))));
        // Too few positions, positions on a batch axis, a vector.
        assert!(!is_sinusoidal_table(&table(&[3, 16], |p, k| transformer(p, k, 16, false))));
        assert!(!is_sinusoidal_table(&table(&[2, 8, 16], |p, k| transformer(p, k, 16, false))));
        assert!(!is_sinusoidal_table(&TensorData::from_f64s(DType::F32, vec![16], &[0.5; 16])));
        assert!(!is_sinusoidal_table(&TensorData::shape_only(DType::F32, vec![32, 16])));
    }
}
