//! The ops the importer fuses (`pipewright_ir::fuse`), written for opsets that lack them as
//! the nodes those opsets have: `Gelu` before opset 20, `Attention` before opset 23. The
//! importer fuses the written form again, so a stage model re-imports as its stage.
//! `StopGradient`, which no opset has, is written as the `Identity` it computes (ONNX
//! describes inference, where the two agree).

use onnx_protobuf::{AttributeProto, NodeProto, TensorProto};
use pipewright_ir::import::{attribute_proto, tensor::tensor_to_proto};
use pipewright_ir::{DType, Graph, NodeId, Op, TensorData, ValueId};
use pipewright_ops::op::{Attention, AttrValue, GeluApprox};

/// The first opset with a `Gelu` op.
const GELU_OPSET: i64 = 20;
/// The first opset with an `Attention` op.
const ATTENTION_OPSET: i64 = 23;

/// Nodes and constants that replace one node.
#[derive(Default)]
pub struct Spelled {
    pub nodes: Vec<NodeProto>,
    pub initializers: Vec<TensorProto>,
}

/// Node `n` spelled out for the graph's opset, `None` when the opset has its op; an error
/// names what of the node the older opset cannot express.
pub fn spell_out(g: &Graph, n: NodeId) -> Result<Option<Spelled>, String> {
    let node = g.node(n);
    let name = |v: &Option<ValueId>| v.map(|v| g.value(v).name.clone());
    match (&node.op, node.outputs.as_slice()) {
        (Op::Gelu { approximate }, [Some(y)]) if g.meta.opset < GELU_OPSET => {
            let x = node.inputs.first().copied().flatten().ok_or("Gelu has no input")?;
            let y = &g.value(*y).name;
            let mut w = Writer::new(&node.name, y, "gelu");
            gelu(&mut w, *approximate, (&g.value(x).name, y), g.value(x).ty.dtype);
            Ok(Some(w.out))
        }
        (Op::Attention(at), _) if g.meta.opset < ATTENTION_OPSET => {
            let inputs: Vec<Option<String>> = node.inputs.iter().map(name).collect();
            let outputs: Vec<Option<String>> = node.outputs.iter().map(name).collect();
            let q = node.inputs.first().copied().flatten().ok_or("Attention has no Q")?;
            let mask_bool = node.inputs.get(3).copied().flatten().is_some_and(|m| g.value(m).ty.dtype == DType::Bool);
            let ty = &g.value(q).ty;
            let head = ty.shape.0.get(3).and_then(|d| d.fixed());
            attention(at, &node.name, &inputs, &outputs, (ty.dtype, ty.shape.rank(), head), mask_bool).map(Some)
        }
        (Op::StopGradient, [Some(y)]) => {
            let x = node.inputs.first().copied().flatten().ok_or("StopGradient has no input")?;
            let identity = NodeProto { name: node.name.clone(), op_type: "Identity".into(), input: vec![g.value(x).name.clone()], output: vec![g.value(*y).name.clone()], ..Default::default() };
            Ok(Some(Spelled { nodes: vec![identity], initializers: Vec::new() }))
        }
        _ => Ok(None),
    }
}

/// Writes the nodes of one spelled-out op: intermediate values are named `{y}/{op}/{part}`,
/// nodes `{node}/{op}_{k}`.
struct Writer {
    node: String,
    op: &'static str,
    prefix: String,
    out: Spelled,
}

impl Writer {
    fn new(node: &str, y: &str, op: &'static str) -> Writer {
        Writer { node: node.to_string(), op, prefix: format!("{y}/{op}"), out: Spelled::default() }
    }

    fn part(&self, part: &str) -> String {
        format!("{}/{part}", self.prefix)
    }

    /// A scalar constant of `dtype`.
    fn constant(&mut self, part: &str, dtype: DType, v: f64) -> String {
        let name = self.part(part);
        self.out.initializers.push(tensor_to_proto(&name, &TensorData::from_f64s(dtype, Vec::new(), &[v])));
        name
    }

    /// A node `op(inputs) -> output`.
    fn step(&mut self, op: &str, inputs: &[&str], output: &str, attributes: Vec<AttributeProto>) {
        let k = self.out.nodes.len();
        self.out.nodes.push(NodeProto {
            name: format!("{}/{}_{k}", self.node, self.op),
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.to_string()],
            attribute: attributes,
            ..Default::default()
        });
    }

    /// A node `op(inputs)` writing the intermediate `part`: its name.
    fn derive(&mut self, op: &str, inputs: &[&str], part: &str, attributes: Vec<AttributeProto>) -> String {
        let out = self.part(part);
        self.step(op, inputs, &out, attributes);
        out
    }

    /// `x` cast to `to`, or `x` itself without a type to cast to.
    fn cast_to(&mut self, x: String, to: Option<DType>, part: &str) -> String {
        match to {
            Some(t) => self.derive("Cast", &[&x], part, vec![attribute_proto("to", &AttrValue::DType(t))]),
            None => x,
        }
    }
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` or `0.5 x (1 + erf(x / sqrt(2)))`,
/// its constants of `x`'s type.
fn gelu(w: &mut Writer, approximate: GeluApprox, (x, y): (&str, &str), dtype: DType) {
    let (half, one) = (w.constant("half", dtype, 0.5), w.constant("one", dtype, 1.0));
    let core = match approximate {
        GeluApprox::Tanh => {
            let three = w.constant("three", dtype, 3.0);
            let cubic = w.constant("cubic", dtype, 0.044_715);
            let scale = w.constant("scale", dtype, (2.0 / std::f64::consts::PI).sqrt());
            let cube = w.derive("Pow", &[x, &three], "cube", vec![]);
            let term = w.derive("Mul", &[&cube, &cubic], "cubic_term", vec![]);
            let inner = w.derive("Add", &[x, &term], "inner", vec![]);
            let scaled = w.derive("Mul", &[&inner, &scale], "scaled", vec![]);
            w.derive("Tanh", &[&scaled], "core", vec![])
        }
        GeluApprox::None => {
            let sqrt2 = w.constant("sqrt2", dtype, std::f64::consts::SQRT_2);
            let scaled = w.derive("Div", &[x, &sqrt2], "scaled", vec![]);
            w.derive("Erf", &[&scaled], "core", vec![])
        }
    };
    let one_plus = w.derive("Add", &[&core, &one], "one_plus", vec![]);
    let half_x = w.derive("Mul", &[x, &half], "half_x", vec![]);
    w.step("Mul", &[&half_x, &one_plus], y, vec![]);
}

/// `softmax(scale Q K^T + mask) V` over 4-D inputs, as the importer fuses it again: the
/// scores in Q's type (in `softmax_precision` around the softmax when that is wider), a
/// float mask added, a boolean one kept by `Where` against the type's lowest value, and
/// the guard that gives a row with no key to attend zeros. What the older opsets cannot
/// express (3-D packed heads, a past cache, the causal flag, soft capping, windows, the
/// extra outputs) is refused.
fn attention(at: &Attention, node: &str, inputs: &[Option<String>], outputs: &[Option<String>], (dtype, rank, head): (DType, usize, Option<i64>), mask_bool: bool) -> Result<Spelled, String> {
    let plain = !at.is_causal && at.softcap == 0.0 && at.left_window_size < 0 && at.right_window_size < 0 && at.q_num_heads.is_none();
    let extra_outputs = outputs.iter().skip(1).any(Option::is_some);
    let extra_inputs = inputs.iter().skip(4).any(Option::is_some);
    let (Some(Some(q)), Some(Some(k)), Some(Some(v)), Some(Some(y))) = (inputs.first(), inputs.get(1), inputs.get(2), outputs.first()) else {
        return Err("Attention needs Q, K, V and Y".into());
    };
    if !plain || extra_outputs || extra_inputs || rank != 4 {
        return Err("only 4-D attention without a cache, causal flag, soft cap, window or extra outputs has a form before opset 23; export the model at opset 23".into());
    }
    let scale = match (at.scale, head) {
        (Some(s), _) => f64::from(s),
        (None, Some(d)) if d > 0 => 1.0 / (d as f64).sqrt(),
        _ => return Err("the scale is the default and the head size is not known".into()),
    };
    let mut w = Writer::new(node, y, "attention");
    let kt = w.derive("Transpose", &[k], "k_t", vec![attribute_proto("perm", &AttrValue::Ints(vec![0, 1, 3, 2]))]);
    let product = w.derive("MatMul", &[q, &kt], "product", vec![]);
    let scale = w.constant("scale", dtype, scale);
    let scores = w.derive("Mul", &[&product, &scale], "scores", vec![]);
    let logits = match inputs.get(3).cloned().flatten() {
        Some(mask) if mask_bool => {
            let lowest = w.constant("lowest", dtype, lowest_finite(dtype)?);
            w.derive("Where", &[&mask, &scores, &lowest], "masked", vec![])
        }
        Some(mask) => w.derive("Add", &[&scores, &mask], "masked", vec![]),
        None => scores,
    };
    let wide = at.softmax_precision.filter(|p| p.size() > dtype.size());
    let softmax_in = w.cast_to(logits, wide, "wide");
    let probs = w.derive("Softmax", &[&softmax_in], "probs", vec![attribute_proto("axis", &AttrValue::Int(3))]);
    let zero = w.constant("zero", wide.unwrap_or(dtype), 0.0);
    let nan = w.derive("IsNaN", &[&probs], "nan", vec![]);
    let guarded = w.derive("Where", &[&nan, &zero, &probs], "guarded", vec![]);
    let narrowed = w.cast_to(guarded, wide.map(|_| dtype), "narrow");
    w.step("MatMul", &[&narrowed, v], y, vec![]);
    Ok(w.out)
}

/// The lowest finite value of a float type: what a boolean mask's `Where` writes for the
/// keys a query may not attend.
fn lowest_finite(dtype: DType) -> Result<f64, String> {
    match dtype {
        DType::F64 => Ok(f64::MIN),
        DType::F32 => Ok(f64::from(f32::MIN)),
        // bf16 keeps fp32's exponent: its largest finite value is (2 - 2^-7) 2^127.
        DType::Bf16 => Ok(-(2.0 - 2f64.powi(-7)) * 2f64.powi(127)),
        DType::F16 => Ok(-65504.0),
        other => Err(format!("a boolean mask over {other} attention has no fill value; export the model at opset 23")),
    }
}
