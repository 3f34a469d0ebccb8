//! GELU: the chains exporters spell out, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`
//! (GPT-2's `gelu_new`; BLOOM's factors it, `sqrt(2/pi) x (1 + 0.044715 x^2)`) and `0.5 x (1 + erf(x / sqrt(2)))` (BERT's, ViT's), in any order of
//! their products and sums, become one `Gelu` node.
//!
//! Why: each elementwise node is a kernel that reads and writes the whole activation,
//! forward and backward, and a transformer's MLP activation is its largest one; the fused
//! node is one kernel each way (libtorch's `gelu`) computing the same function. On a GPU
//! the spelled-out chain costs GPT-2 small several milliseconds a step.
//!
//! A chain is fused only when each of its intermediate values has exactly one reader (so
//! nothing outside the chain needs them), its result has its input's type, and its
//! constants are scalars within a relative 1e-3 of the exact ones (an fp16 export rounds
//! them). The stage ONNX writer spells a fused node out again for opsets before 20, which
//! have no `Gelu`.

use pipewright_ops::op::{BinaryOp, GeluApprox, UnaryOp};

use super::pattern::{binary_operands, close, factors, rewrite_node, scalar, unary_operand};
use crate::{Graph, NodeId, Op, ValueId};

/// `sqrt(2 / pi)`, the tanh form's inner factor.
const TANH_SCALE: f64 = 0.797_884_560_802_865_4;
/// The tanh form's cubic coefficient.
const TANH_CUBIC: f64 = 0.044_715;

/// Rewrites the last node of each GELU chain into `Gelu` reading the chain's input and
/// returns how many it fused. The rest of each chain is left without readers, for
/// [`Graph::remove_dead_nodes`].
pub fn fuse_gelu(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let found: Vec<(NodeId, ValueId, GeluApprox)> =
        g.node_ids().filter_map(|n| match_gelu(g, &uses, n).map(|(x, approx)| (n, x, approx))).collect();
    for &(n, x, approximate) in &found {
        rewrite_node(g, n, Op::Gelu { approximate }, &[Some(x)]);
    }
    found.len()
}

/// The input and form of the GELU chain ending at node `n`, if it ends one.
fn match_gelu(g: &Graph, uses: &[usize], n: NodeId) -> Option<(ValueId, GeluApprox)> {
    let node = g.node(n);
    if node.op != Op::Binary(BinaryOp::Mul) {
        return None;
    }
    let out = (*node.outputs.first()?)?;
    let product = factors(g, uses, out, true);
    if !close(product.constant, 0.5) || product.terms.len() != 2 {
        return None;
    }
    let (a, b) = (product.terms[0], product.terms[1]);
    let (x, approx) = one_plus_gelu_core(g, uses, b, a).or_else(|| one_plus_gelu_core(g, uses, a, b))?;
    let ty = &g.value(x).ty;
    (ty.dtype.is_float() && *ty == g.value(out).ty).then_some((x, approx))
}

/// Whether `d` is `1 + tanh(...)` or `1 + erf(...)` of `x`'s GELU, read only by the chain.
fn one_plus_gelu_core(g: &Graph, uses: &[usize], d: ValueId, x: ValueId) -> Option<(ValueId, GeluApprox)> {
    let (p, q) = binary_operands(g, uses, d, BinaryOp::Add)?;
    let core = match (scalar(g, p), scalar(g, q)) {
        (Some(one), None) if close(one, 1.0) => q,
        (None, Some(one)) if close(one, 1.0) => p,
        _ => return None,
    };
    let (op, arg) = unary_operand(g, uses, core)?;
    match op {
        UnaryOp::Tanh if is_tanh_argument(g, uses, arg, x) => Some((x, GeluApprox::Tanh)),
        UnaryOp::Erf if is_erf_argument(g, uses, arg, x) => Some((x, GeluApprox::None)),
        _ => None,
    }
}

/// `z = sqrt(2/pi) (x + 0.044715 x^3)`, the cube as `Pow(x, 3)` or `x x x`, or factored
/// as BLOOM writes it, `sqrt(2/pi) x (1 + 0.044715 x^2)`.
fn is_tanh_argument(g: &Graph, uses: &[usize], z: ValueId, x: ValueId) -> bool {
    let outer = factors(g, uses, z, uses[z.index()] == 1);
    if !close(outer.constant, TANH_SCALE) {
        return false;
    }
    match outer.terms[..] {
        [sum] => is_x_plus_cubic(g, uses, sum, x),
        [a, b] if a == x => is_one_plus_square(g, uses, b, x),
        [a, b] if b == x => is_one_plus_square(g, uses, a, x),
        _ => false,
    }
}

/// `1 + 0.044715 x^2`, the square as `Pow(x, 2)` or `x x`.
fn is_one_plus_square(g: &Graph, uses: &[usize], sum: ValueId, x: ValueId) -> bool {
    let Some((p, q)) = binary_operands(g, uses, sum, BinaryOp::Add) else { return false };
    let quadratic = match (scalar(g, p), scalar(g, q)) {
        (Some(one), None) if close(one, 1.0) => q,
        (None, Some(one)) if close(one, 1.0) => p,
        _ => return false,
    };
    let square = factors(g, uses, quadratic, uses[quadratic.index()] == 1);
    close(square.constant, TANH_CUBIC) && is_power(g, uses, &square.terms, x, 2)
}

/// Whether `terms` multiply to `x^n`: `x` `n` times, or one `Pow(x, n)`.
fn is_power(g: &Graph, uses: &[usize], terms: &[ValueId], x: ValueId, n: usize) -> bool {
    match terms {
        [power] if n > 1 => binary_operands(g, uses, *power, BinaryOp::Pow).is_some_and(|(base, e)| base == x && scalar(g, e) == Some(n as f64)),
        _ => terms.len() == n && terms.iter().all(|&t| t == x),
    }
}

/// `x + 0.044715 x^3`.
fn is_x_plus_cubic(g: &Graph, uses: &[usize], sum: ValueId, x: ValueId) -> bool {
    let Some((p, q)) = binary_operands(g, uses, sum, BinaryOp::Add) else { return false };
    let cubic = match (p == x, q == x) {
        (true, false) => q,
        (false, true) => p,
        _ => return false,
    };
    let cube = factors(g, uses, cubic, uses[cubic.index()] == 1);
    close(cube.constant, TANH_CUBIC) && is_power(g, uses, &cube.terms, x, 3)
}

/// `z = x / sqrt(2)` (or `x * (1 / sqrt(2))`).
fn is_erf_argument(g: &Graph, uses: &[usize], z: ValueId, x: ValueId) -> bool {
    let f = factors(g, uses, z, uses[z.index()] == 1);
    f.terms == [x] && close(f.constant, std::f64::consts::FRAC_1_SQRT_2)
}

#[cfg(test)]
mod tests {
    use super::fuse_gelu;
    use crate::{parse_graph, text::print_graph, Graph};

    const HEADER: &str = "graph \"g\" ir_version=8 opset=17 producer=\"t\" batch=N(\"N\", dynamic) {\n  %v0: f32[N,8] = input \"x\"\n";

    /// GPT-2's `gelu_new` as torch.onnx writes it, with `cubic` as the cube's coefficient
    /// and `extra` appended before the return (another reader of an intermediate, say).
    fn tanh_chain(cubic: &str, extra: &str, ret: &str) -> String {
        format!(
            "{HEADER}  %v1: f32[] = const \"half\" [0.5]\n  %v2: f32[] = const \"three\" [3.0]\n  %v3: f32[] = const \"cubic\" [{cubic}]\n  %v4: f32[] = const \"scale\" [0.7978845834732056]\n  %v5: f32[] = const \"one\" [1.0]\n  %v6: f32[N,8] = Mul(%v0, %v1)  # n0 \"Mul\"\n  %v7: f32[N,8] = Pow(%v0, %v2)  # n1 \"Pow\"\n  %v8: f32[N,8] = Mul(%v7, %v3)  # n2 \"Mul_1\"\n  %v9: f32[N,8] = Add(%v0, %v8)  # n3 \"Add\"\n  %v10: f32[N,8] = Mul(%v9, %v4)  # n4 \"Mul_2\"\n  %v11: f32[N,8] = Tanh(%v10)  # n5 \"Tanh\"\n  %v12: f32[N,8] = Add(%v11, %v5)  # n6 \"Add_1\"\n  %v13: f32[N,8] = Mul(%v6, %v12)  # n7 \"Mul_3\"\n{extra}  return {ret}\n}}\n"
        )
    }

    fn fused(text: &str) -> (usize, Graph) {
        let mut g = parse_graph(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let n = fuse_gelu(&mut g);
        g.remove_dead_nodes();
        g.compact().expect("acyclic");
        crate::verify(&g).unwrap_or_else(|e| panic!("{e:?}"));
        (n, g)
    }

    #[test]
    fn the_tanh_form_becomes_one_gelu_node_of_the_chain_input() {
        let (n, g) = fused(&tanh_chain("0.044714998453855515", "", "%v13 \"y\""));
        assert_eq!(n, 1);
        let text = print_graph(&g);
        assert!(text.contains("= Gelu[approximate=\"tanh\"](%v0)  # n0 \"Mul_3\""), "{text}");
        assert_eq!(g.node_count(), 1, "{text}");
    }

    /// BLOOM's `bloom_gelu_forward`: `x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 *
    /// x * x)))`, the cubic factored; with the square's coefficient off, left alone.
    #[test]
    fn the_factored_tanh_form_becomes_gelu() {
        let chain = |cubic: &str| format!(
            "{HEADER}  %v1: f32[] = const \"half\" [0.5]\n  %v2: f32[] = const \"scale\" [0.79788456]\n  %v3: f32[] = const \"cubic\" [{cubic}]\n  %v4: f32[] = const \"one\" [1.0]\n  %v5: f32[N,8] = Mul(%v0, %v1)  # n0 \"half_x\"\n  %v6: f32[N,8] = Mul(%v0, %v2)  # n1 \"scaled_x\"\n  %v7: f32[N,8] = Mul(%v0, %v3)  # n2 \"k_x\"\n  %v8: f32[N,8] = Mul(%v7, %v0)  # n3 \"k_x2\"\n  %v9: f32[N,8] = Add(%v8, %v4)  # n4 \"poly\"\n  %v10: f32[N,8] = Mul(%v6, %v9)  # n5 \"arg\"\n  %v11: f32[N,8] = Tanh(%v10)  # n6 \"tanh\"\n  %v12: f32[N,8] = Add(%v11, %v4)  # n7 \"one_plus\"\n  %v13: f32[N,8] = Mul(%v5, %v12)  # n8 \"gelu\"\n  return %v13 \"y\"\n}}\n"
        );
        let (n, g) = fused(&chain("0.044715"));
        let text = print_graph(&g);
        assert_eq!((n, g.node_count()), (1, 1), "{text}");
        assert!(text.contains("= Gelu[approximate=\"tanh\"](%v0)  # n0 \"gelu\""), "{text}");
        let (n, g) = fused(&chain("0.05"));
        assert_eq!((n, g.node_count()), (0, 9), "{}", print_graph(&g));
    }

    #[test]
    fn the_erf_form_in_either_product_order_becomes_gelu() {
        // torch.onnx before opset 20: `x * (1 + erf(x / sqrt 2))`, then `* 0.5`; and the
        // same with `0.5 x` first and a product by `1 / sqrt 2`.
        let variants = [
            ("Div(%v0, %v1)", "Mul(%v0, %v6)", "Mul(%v7, %v2)"),
            ("Mul(%v0, %v1)", "Mul(%v2, %v0)", "Mul(%v7, %v6)"),
        ];
        for (inner, first, last) in variants {
            let sqrt2 = if inner.starts_with("Div") { "1.4142135381698608" } else { "0.7071067690849304" };
            let text = format!(
                "{HEADER}  %v1: f32[] = const \"sqrt2\" [{sqrt2}]\n  %v2: f32[] = const \"half\" [0.5]\n  %v3: f32[] = const \"one\" [1.0]\n  %v4: f32[N,8] = {inner}  # n0 \"Div\"\n  %v5: f32[N,8] = Erf(%v4)  # n1 \"Erf\"\n  %v6: f32[N,8] = Add(%v5, %v3)  # n2 \"Add\"\n  %v7: f32[N,8] = {first}  # n3 \"Mul\"\n  %v8: f32[N,8] = {last}  # n4 \"Mul_1\"\n  return %v8 \"y\"\n}}\n"
            );
            let (n, g) = fused(&text);
            let printed = print_graph(&g);
            assert_eq!((n, g.node_count()), (1, 1), "{text}\n{printed}");
            assert!(printed.contains("= Gelu(%v0)  # n0 \"Mul_1\""), "{printed}");
        }
    }

    #[test]
    fn a_chain_whose_intermediate_is_read_elsewhere_is_left_alone() {
        // The tanh's input is also a graph output: removing the chain would lose it.
        let (n, g) = fused(&tanh_chain("0.044714998453855515", "", "%v13 \"y\", %v10 \"inner\""));
        assert_eq!((n, g.node_count()), (0, 8), "{}", print_graph(&g));
    }

    #[test]
    fn a_chain_with_another_coefficient_is_not_gelu() {
        let (n, g) = fused(&tanh_chain("0.05", "", "%v13 \"y\""));
        assert_eq!((n, g.node_count()), (0, 8), "{}", print_graph(&g));
    }

    #[test]
    fn a_cube_written_as_products_is_recognised() {
        let text = tanh_chain("0.044714998453855515", "", "%v13 \"y\"")
            .replace("%v7: f32[N,8] = Pow(%v0, %v2)  # n1 \"Pow\"", "%v14: f32[N,8] = Mul(%v0, %v0)  # n8 \"Sq\"\n  %v7: f32[N,8] = Mul(%v14, %v0)  # n1 \"Cube\"");
        let (n, g) = fused(&text);
        assert_eq!((n, g.node_count()), (1, 1), "{}", print_graph(&g));
    }
}
