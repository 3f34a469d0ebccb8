//! `pipewright synth`: generated ONNX models at real sizes, from a preset or a node count
//! and the values that override it.

use std::path::PathBuf;

use pipewright_core::units::human_bytes;
use pipewright_core::Storage;
use pipewright_synth::{GptShape, LayeredShape};

use crate::DriverError;

/// Which model to generate.
#[derive(Clone, Debug)]
pub enum SynthShape {
    /// A GPT-2-shaped decoder: a preset (`gpt2-small`, ..., `tiny`) and what overrides it.
    Gpt { preset: String, layers: Option<usize>, hidden: Option<usize>, heads: Option<usize>, seq: Option<usize>, vocab: Option<usize>, untied: bool },
    /// A long chain of layers with residuals and skips across many layers.
    Layered { nodes: usize, width: usize, long_skip_every: usize, long_skip_span: usize },
}

/// What `pipewright synth` is asked.
#[derive(Clone, Debug)]
pub struct SynthRequest {
    pub shape: SynthShape,
    /// Where the weights go; `None`: inline below 1 GiB of weights, external above.
    pub weights: Option<Storage>,
    pub seed: u64,
    pub output: PathBuf,
}

/// Generates and writes the model; returns the line the command prints.
pub fn synth(req: &SynthRequest) -> Result<String, DriverError> {
    let fail = |e: pipewright_synth::SynthError| DriverError::msg(e.to_string());
    let (model, what) = match &req.shape {
        SynthShape::Gpt { preset, layers, hidden, heads, seq, vocab, untied } => {
            let p = GptShape::preset(preset)
                .ok_or_else(|| DriverError::msg(format!("unknown preset {preset:?}: expected gpt2-small, gpt2-medium, gpt-1.3b, gpt-2.2b, gpt-3.8b or tiny")))?;
            let shape = GptShape {
                layers: layers.unwrap_or(p.layers),
                hidden: hidden.unwrap_or(p.hidden),
                heads: heads.unwrap_or(p.heads),
                seq: seq.unwrap_or(p.seq),
                vocab: vocab.unwrap_or(p.vocab),
                tied: p.tied && !untied,
            };
            let what = format!("GPT, {} layers x {}, {} heads, {} tokens, vocabulary {}", shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab);
            (pipewright_synth::gpt(&shape).map_err(fail)?, what)
        }
        SynthShape::Layered { nodes, width, long_skip_every, long_skip_span } => {
            let shape = LayeredShape { width: *width, long_skip_every: *long_skip_every, long_skip_span: *long_skip_span, ..LayeredShape::with_nodes(*nodes) };
            let what = format!("layered, {} layers x {}, a skip across {} layers every {}", shape.layers, shape.width, shape.long_skip_span, shape.long_skip_every);
            (pipewright_synth::layered(&shape).map_err(fail)?, what)
        }
    };
    let storage = req.weights.unwrap_or(if model.parameters() * 4 < 1 << 30 { Storage::Inline } else { Storage::External });
    let written = model.write(&req.output, storage, req.seed).map_err(fail)?;
    let data = match (&written.data, storage) {
        (Some(d), _) => format!(" and {}", d.display()),
        (None, Storage::ShapesOnly) => " (shapes only: its external data file is declared, not written; for plan and simulate)".to_string(),
        (None, _) => String::new(),
    };
    Ok(format!(
        "wrote {}{data}: {what}; {} nodes, {} parameters ({})",
        written.model.display(),
        written.nodes,
        written.parameters,
        human_bytes(written.parameters * 4)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt(preset: &str) -> SynthShape {
        SynthShape::Gpt { preset: preset.into(), layers: Some(1), hidden: None, heads: None, seq: None, vocab: None, untied: false }
    }

    /// A preset with an override writes its model and says what it wrote; an unknown
    /// preset is refused naming the known ones.
    #[test]
    fn presets_and_overrides() {
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path().join("g.onnx");
        let line = synth(&SynthRequest { shape: gpt("tiny"), weights: None, seed: 1, output: output.clone() }).unwrap();
        assert!(line.starts_with(&format!("wrote {}: GPT, 1 layers x 32", output.display())), "{line}");
        assert!(output.is_file());
        let e = synth(&SynthRequest { shape: gpt("gpt-9"), weights: None, seed: 1, output }).unwrap_err().to_string();
        assert!(e.starts_with("unknown preset \"gpt-9\": expected gpt2-small"), "{e}");
    }
}
