//! A long layered graph with skip connections: `layers` layers on `f32[batch, width]`,
//! each `Relu(x) * w + skip`, where the skip is the previous layer's input (a residual)
//! and, every `long_skip_every` layers, also the output of the layer `long_skip_span`
//! layers back. Long skips cross many stage boundaries, which is what makes partitioning
//! a graph hard: the value has to be forwarded through every stage in between.

use onnx_protobuf::tensor_proto::DataType;

use crate::model::{Fill, Model, SynthError};

/// The size of a layered graph. Each layer is 3 nodes (4 with a long skip).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayeredShape {
    pub layers: usize,
    pub width: usize,
    pub long_skip_every: usize,
    pub long_skip_span: usize,
}

impl LayeredShape {
    /// About `nodes` nodes of width 64, with a long skip across 1,000 layers every 50.
    pub fn with_nodes(nodes: usize) -> LayeredShape {
        let (long_skip_every, long_skip_span) = (50, 1000);
        // 3 nodes per layer, plus one per long skip.
        let per_50 = 3 * long_skip_every + 1;
        LayeredShape { layers: nodes * long_skip_every / per_50, width: 64, long_skip_every, long_skip_span }
    }

    fn check(&self) -> Result<(), SynthError> {
        if self.layers == 0 || self.width == 0 {
            return Err(SynthError::Shape("layers and width must be at least 1".into()));
        }
        if self.long_skip_every == 0 || self.long_skip_span == 0 {
            return Err(SynthError::Shape("long skips need a period and a span of at least 1 layer".into()));
        }
        Ok(())
    }
}

/// The layered graph of `shape`: input `x: f32[batch, width]`, output `y`.
pub fn layered(shape: &LayeredShape) -> Result<Model, SynthError> {
    shape.check()?;
    let mut m = Model::new("layered", "x", DataType::FLOAT, &[shape.width as i64]);
    let mut outputs = vec!["x".to_string()];
    for l in 0..shape.layers {
        let input = outputs[l].clone();
        let w = m.weight(&format!("l{l}.w"), &[shape.width as i64], Fill::Random { std: 0.5 });
        let relu = m.op("Relu", &format!("l{l}.relu"), &[&input], vec![]);
        let scaled = m.op("Mul", &format!("l{l}.mul"), &[&relu, &w], vec![]);
        let mut y = m.op("Add", &format!("l{l}.residual"), &[&scaled, &input], vec![]);
        if l % shape.long_skip_every == shape.long_skip_every - 1 && l >= shape.long_skip_span {
            let far = outputs[l + 1 - shape.long_skip_span].clone();
            y = m.op("Add", &format!("l{l}.long_skip"), &[&y, &far], vec![]);
        }
        outputs.push(y);
    }
    let last = outputs.last().cloned().unwrap_or_default();
    let y = m.op("Identity", "y", &[&last], vec![]);
    m.output(&y);
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::{layered, LayeredShape};

    #[test]
    fn the_node_count_follows_the_request() {
        let m = layered(&LayeredShape::with_nodes(100_800)).unwrap();
        let n = m.nodes();
        assert!((99_000..=100_800).contains(&n), "{n} nodes");
        assert_eq!(m.parameters(), LayeredShape::with_nodes(100_800).layers as u64 * 64);
    }

    #[test]
    fn a_zero_period_is_refused() {
        let shape = LayeredShape { long_skip_every: 0, ..LayeredShape::with_nodes(1000) };
        let e = layered(&shape).err().expect("a zero period is refused");
        assert_eq!(e.to_string(), "invalid shape: long skips need a period and a span of at least 1 layer");
    }
}
