//! A GPT-2-shaped decoder: token and position embeddings, `layers` pre-norm blocks of
//! causal multi-head attention and a GELU MLP with residual connections, a final layer
//! norm and a language-model head tied to the token embedding (or its own weight). Weight
//! names and extents follow Hugging Face's GPT-2, so the presets have GPT-2's exact
//! parameter counts (124,439,808 and 354,823,168).

use onnx_protobuf::tensor_proto::DataType;

use crate::model::{attr_float, attr_int, attr_ints, attr_string, Fill, Model, SynthError};

/// The size of a GPT-shaped model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptShape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// Tokens per sample (the input is `i64[batch, seq]`).
    pub seq: usize,
    pub vocab: usize,
    /// Whether the output projection reuses the token embedding, as GPT-2 does.
    pub tied: bool,
}

impl GptShape {
    /// GPT-2 small: 12 layers of 768, 12 heads.
    pub const GPT2_SMALL: GptShape = GptShape { layers: 12, hidden: 768, heads: 12, seq: 1024, vocab: 50257, tied: true };
    /// GPT-2 medium: 24 layers of 1024, 16 heads.
    pub const GPT2_MEDIUM: GptShape = GptShape { layers: 24, hidden: 1024, heads: 16, seq: 1024, vocab: 50257, tied: true };
    /// The PipeDream-2BW paper's GPT models (Narayanan et al., ICML 2021, section 5):
    /// 1.3B is 24 layers of 2048 with 16 heads, 2.2B 32 of 2304 with 32 heads, 3.8B 32
    /// of 3072 with 32 heads, all at sequence length 512 (GPT-2's vocabulary, tied).
    pub const GPT_1_3B: GptShape = GptShape { layers: 24, hidden: 2048, heads: 16, seq: 512, vocab: 50257, tied: true };
    pub const GPT_2_2B: GptShape = GptShape { layers: 32, hidden: 2304, heads: 32, seq: 512, vocab: 50257, tied: true };
    pub const GPT_3_8B: GptShape = GptShape { layers: 32, hidden: 3072, heads: 32, seq: 512, vocab: 50257, tied: true };
    /// A model small enough for tests: 2 layers of 32, 4 heads, 16 tokens, 100 words.
    pub const TINY: GptShape = GptShape { layers: 2, hidden: 32, heads: 4, seq: 16, vocab: 100, tied: true };

    /// A preset by name: `gpt2-small`, `gpt2-medium`, `gpt-1.3b`, `gpt-2.2b`, `gpt-3.8b`
    /// or `tiny`.
    pub fn preset(name: &str) -> Option<GptShape> {
        match name {
            "gpt-1.3b" => Some(GptShape::GPT_1_3B),
            "gpt-2.2b" => Some(GptShape::GPT_2_2B),
            "gpt-3.8b" => Some(GptShape::GPT_3_8B),
            "gpt2-small" => Some(GptShape::GPT2_SMALL),
            "gpt2-medium" => Some(GptShape::GPT2_MEDIUM),
            "tiny" => Some(GptShape::TINY),
            _ => None,
        }
    }

    fn check(&self) -> Result<(), SynthError> {
        let fields = [("layers", self.layers), ("hidden", self.hidden), ("heads", self.heads), ("seq", self.seq), ("vocab", self.vocab)];
        if let Some((name, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Err(SynthError::Shape(format!("{name} must be at least 1")));
        }
        if self.hidden % self.heads != 0 {
            return Err(SynthError::Shape(format!("hidden size {} is not a multiple of the {} heads", self.hidden, self.heads)));
        }
        Ok(())
    }
}

/// The GPT-shaped model of `shape`: input `input_ids: i64[batch, seq]`, output
/// `logits: f32[batch, seq, vocab]`.
pub fn gpt(shape: &GptShape) -> Result<Model, SynthError> {
    shape.check()?;
    let mut b = Builder::new(shape);
    let mut x = b.embeddings();
    for layer in 0..shape.layers {
        x = b.block(layer, &x);
    }
    let logits = b.head(&x);
    b.m.output(&logits);
    Ok(b.m)
}

const INIT_STD: f32 = 0.02;
const LN_EPS: f32 = 1e-5;

struct Builder {
    m: Model,
    s: GptShape,
    /// `[0, seq, heads, hidden / heads]`: splits the hidden axis into heads.
    heads_shape: String,
    /// `[0, seq, hidden]`: merges them back.
    merged_shape: String,
    /// `1 / sqrt(hidden / heads)`.
    scale: String,
    /// `f32[seq, seq]`, 0 on and below the diagonal, -1e4 above: hides later tokens.
    causal_mask: String,
}

impl Builder {
    fn new(s: &GptShape) -> Builder {
        let (seq, hidden, heads) = (s.seq as i64, s.hidden as i64, s.heads as i64);
        let mut m = Model::new("gpt", "input_ids", DataType::INT64, &[seq]);
        let heads_shape = m.const_i64("heads_shape", &[0, seq, heads, hidden / heads]);
        let merged_shape = m.const_i64("merged_shape", &[0, seq, hidden]);
        let scale = m.const_f32("attn_scale", &[], &[1.0 / ((hidden / heads) as f32).sqrt()]);
        let mask: Vec<f32> = (0..s.seq).flat_map(|i| (0..s.seq).map(move |j| if j > i { -1e4 } else { 0.0 })).collect();
        let causal_mask = m.const_f32("causal_mask", &[seq, seq], &mask);
        Builder { m, s: *s, heads_shape, merged_shape, scale, causal_mask }
    }

    fn embeddings(&mut self) -> String {
        let (v, s, h) = (self.s.vocab as i64, self.s.seq as i64, self.s.hidden as i64);
        let wte = self.m.weight("wte.weight", &[v, h], Fill::Random { std: INIT_STD });
        let wpe = self.m.weight("wpe.weight", &[s, h], Fill::Random { std: 0.01 });
        let tokens = self.m.op("Gather", "wte", &[&wte, "input_ids"], vec![attr_int("axis", 0)]);
        self.m.op("Add", "embed", &[&tokens, &wpe], vec![])
    }

    fn layer_norm(&mut self, prefix: &str, x: &str) -> String {
        let h = self.s.hidden as i64;
        let g = self.m.weight(&format!("{prefix}.weight"), &[h], Fill::Constant(1.0));
        let b = self.m.weight(&format!("{prefix}.bias"), &[h], Fill::Constant(0.0));
        self.m.op("LayerNormalization", prefix, &[x, &g, &b], vec![attr_int("axis", -1), attr_float("epsilon", LN_EPS)])
    }

    /// `x @ W + b` with `W: [inputs, outputs]` (GPT-2's `Conv1D`).
    fn linear(&mut self, prefix: &str, x: &str, inputs: usize, outputs: usize) -> String {
        let w = self.m.weight(&format!("{prefix}.weight"), &[inputs as i64, outputs as i64], Fill::Random { std: INIT_STD });
        let b = self.m.weight(&format!("{prefix}.bias"), &[outputs as i64], Fill::Constant(0.0));
        let y = self.m.op("MatMul", &format!("{prefix}.matmul"), &[x, &w], vec![]);
        self.m.op("Add", &format!("{prefix}.add"), &[&y, &b], vec![])
    }

    /// `[batch, seq, hidden]` to `[batch, heads, seq, hidden / heads]` (keys: `[.., head, seq]`).
    fn split_heads(&mut self, name: &str, x: &str, perm: &[i64]) -> String {
        let shape = self.heads_shape.clone();
        let r = self.m.op("Reshape", &format!("{name}.reshape"), &[x, &shape], vec![]);
        self.m.op("Transpose", &format!("{name}.transpose"), &[&r], vec![attr_ints("perm", perm)])
    }

    fn attention(&mut self, p: &str, x: &str) -> String {
        let h = self.s.hidden;
        let qkv = self.linear(&format!("{p}.attn.c_attn"), x, h, 3 * h);
        let parts = self.m.node("Split", &format!("{p}.attn.split"), &[&qkv], vec![attr_int("axis", -1), attr_int("num_outputs", 3)], 3);
        let q = self.split_heads(&format!("{p}.attn.q"), &parts[0], &[0, 2, 1, 3]);
        let k = self.split_heads(&format!("{p}.attn.k"), &parts[1], &[0, 2, 3, 1]);
        let v = self.split_heads(&format!("{p}.attn.v"), &parts[2], &[0, 2, 1, 3]);
        let (scale, mask) = (self.scale.clone(), self.causal_mask.clone());
        let scores = self.m.op("MatMul", &format!("{p}.attn.scores"), &[&q, &k], vec![]);
        let scaled = self.m.op("Mul", &format!("{p}.attn.scale"), &[&scores, &scale], vec![]);
        let masked = self.m.op("Add", &format!("{p}.attn.mask"), &[&scaled, &mask], vec![]);
        let probs = self.m.op("Softmax", &format!("{p}.attn.softmax"), &[&masked], vec![attr_int("axis", -1)]);
        let context = self.m.op("MatMul", &format!("{p}.attn.context"), &[&probs, &v], vec![]);
        let merged = self.m.op("Transpose", &format!("{p}.attn.merge.transpose"), &[&context], vec![attr_ints("perm", &[0, 2, 1, 3])]);
        let merged_shape = self.merged_shape.clone();
        let merged = self.m.op("Reshape", &format!("{p}.attn.merge.reshape"), &[&merged, &merged_shape], vec![]);
        self.linear(&format!("{p}.attn.c_proj"), &merged, h, h)
    }

    fn mlp(&mut self, p: &str, x: &str) -> String {
        let h = self.s.hidden;
        let up = self.linear(&format!("{p}.mlp.c_fc"), x, h, 4 * h);
        let act = self.m.op("Gelu", &format!("{p}.mlp.gelu"), &[&up], vec![attr_string("approximate", "tanh")]);
        self.linear(&format!("{p}.mlp.c_proj"), &act, 4 * h, h)
    }

    fn block(&mut self, layer: usize, x: &str) -> String {
        let p = format!("h.{layer}");
        let normed = self.layer_norm(&format!("{p}.ln_1"), x);
        let attn = self.attention(&p, &normed);
        let x = self.m.op("Add", &format!("{p}.residual_1"), &[x, &attn], vec![]);
        let normed = self.layer_norm(&format!("{p}.ln_2"), &x);
        let mlp = self.mlp(&p, &normed);
        self.m.op("Add", &format!("{p}.residual_2"), &[&x, &mlp], vec![])
    }

    fn head(&mut self, x: &str) -> String {
        let normed = self.layer_norm("ln_f", x);
        let w = if self.s.tied {
            self.m.op("Transpose", "lm_head.transpose", &["wte.weight"], vec![attr_ints("perm", &[1, 0])])
        } else {
            self.m.weight("lm_head.weight", &[self.s.hidden as i64, self.s.vocab as i64], Fill::Random { std: INIT_STD })
        };
        self.m.op("MatMul", "logits", &[&normed, &w], vec![])
    }
}

#[cfg(test)]
mod tests {
    use super::{gpt, GptShape};

    #[test]
    fn the_presets_have_gpt2s_parameter_counts() {
        assert_eq!(gpt(&GptShape::GPT2_SMALL).unwrap().parameters(), 124_439_808);
        assert_eq!(gpt(&GptShape::GPT2_MEDIUM).unwrap().parameters(), 354_823_168);
        let untied = GptShape { tied: false, ..GptShape::GPT2_SMALL };
        assert_eq!(gpt(&untied).unwrap().parameters(), 124_439_808 + 768 * 50257);
        // The paper's models: 12 L h^2 in the blocks plus the embeddings.
        let billions = |s: &GptShape| gpt(s).unwrap().parameters() as f64 / 1e9;
        assert!((billions(&GptShape::GPT_1_3B) - 1.3).abs() < 0.05);
        assert!((billions(&GptShape::GPT_2_2B) - 2.2).abs() < 0.05);
        assert!((billions(&GptShape::GPT_3_8B) - 3.8).abs() < 0.05);
    }

    #[test]
    fn impossible_shapes_are_refused() {
        let odd = GptShape { heads: 5, ..GptShape::TINY };
        assert!(gpt(&odd).unwrap_err().to_string().contains("not a multiple of the 5 heads"));
        let empty = GptShape { layers: 0, ..GptShape::TINY };
        assert!(gpt(&empty).unwrap_err().to_string().contains("layers must be at least 1"));
    }
}
