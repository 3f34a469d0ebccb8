//! What the fusions match on: a value as a product of constants and factors, the node
//! that alone produces a value, scalar constants.

use pipewright_ops::op::{BinaryOp, UnaryOp};

use crate::{Graph, NodeId, Op, ValueDef, ValueId};

/// A value as a product: the constant factor and the other factors.
pub(super) struct Product {
    pub constant: f64,
    pub terms: Vec<ValueId>,
}

/// `v` as a product, looking through `Mul` nodes and divisions by a constant; below `v`
/// only through values read by nothing else (`descend` says whether `v`'s own node may
/// be looked through).
pub(super) fn factors(g: &Graph, uses: &[usize], v: ValueId, descend: bool) -> Product {
    let mut p = Product { constant: 1.0, terms: Vec::new() };
    collect_factors(g, uses, v, descend, &mut p);
    p
}

fn collect_factors(g: &Graph, uses: &[usize], v: ValueId, descend: bool, p: &mut Product) {
    if let Some(c) = scalar(g, v) {
        p.constant *= c;
        return;
    }
    let single = |v: ValueId| uses[v.index()] == 1;
    match producer(g, v).filter(|_| descend) {
        Some((Op::Binary(BinaryOp::Mul), [a, b])) => {
            collect_factors(g, uses, a, single(a), p);
            collect_factors(g, uses, b, single(b), p);
        }
        Some((Op::Binary(BinaryOp::Div), [a, b])) => match scalar(g, b) {
            Some(c) if c != 0.0 => {
                p.constant /= c;
                collect_factors(g, uses, a, single(a), p);
            }
            _ => p.terms.push(v),
        },
        _ => p.terms.push(v),
    }
}

/// The operands of the binary `op` node that alone reads into `v`'s reader.
pub(super) fn binary_operands(g: &Graph, uses: &[usize], v: ValueId, op: BinaryOp) -> Option<(ValueId, ValueId)> {
    match producer(g, v).filter(|_| uses[v.index()] == 1)? {
        (Op::Binary(o), [a, b]) if *o == op => Some((a, b)),
        _ => None,
    }
}

/// The op and operand of the unary node that alone produces `v` for its one reader.
pub(super) fn unary_operand(g: &Graph, uses: &[usize], v: ValueId) -> Option<(UnaryOp, ValueId)> {
    match producer(g, v).filter(|_| uses[v.index()] == 1)? {
        (Op::Unary(u), [a]) => Some((*u, a)),
        _ => None,
    }
}

/// The op and operands of the node producing `v` (its first output), when every operand
/// is present.
pub(super) fn producer<const N: usize>(g: &Graph, v: ValueId) -> Option<(&Op, [ValueId; N])> {
    let (op, inputs) = producer_of(g, v)?;
    Some((op, inputs.try_into().ok()?))
}

/// [`producer`] for any number of operands.
pub(super) fn producer_of(g: &Graph, v: ValueId) -> Option<(&Op, Vec<ValueId>)> {
    let ValueDef::Node { node, slot: 0 } = g.value(v).def else { return None };
    let node = g.node(node);
    let inputs: Vec<ValueId> = node.inputs.iter().copied().collect::<Option<_>>()?;
    Some((&node.op, inputs))
}

/// A float constant of one element: its value.
pub(super) fn scalar(g: &Graph, v: ValueId) -> Option<f64> {
    one_element(g, v, false)
}

/// A trainable float weight of one element: its value.
pub(super) fn one_element_weight(g: &Graph, v: ValueId) -> Option<f64> {
    one_element(g, v, true)
}

/// The value of a float initializer of one element, trainable or not as asked.
fn one_element(g: &Graph, v: ValueId, trainable: bool) -> Option<f64> {
    let w = g.value(v).weight()?;
    let complete = w.data.numel() == 1 && w.data.bytes.len() == w.data.byte_len();
    (w.trainable == trainable && w.data.dtype.is_float() && complete).then(|| w.data.to_f64s()[0])
}

pub(super) fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-3 * b.abs()
}

/// Turns node `n` into `op` reading `inputs`, keeping its outputs (and so every reader of
/// them); the nodes that fed it alone are left without readers, for
/// [`Graph::remove_dead_nodes`].
pub(super) fn rewrite_node(g: &mut Graph, n: NodeId, op: Op, inputs: &[Option<ValueId>]) {
    // Absent trailing operands are omitted, as ONNX writes them.
    let given = inputs.iter().rposition(Option::is_some).map_or(0, |i| i + 1);
    let inputs = &inputs[..given];
    let arity = g.node(n).inputs.len().max(inputs.len());
    g.node_mut(n).inputs.resize(arity, None);
    for slot in 0..arity {
        g.set_input(n, slot, inputs.get(slot).copied().flatten());
    }
    let node = g.node_mut(n);
    node.inputs.truncate(inputs.len());
    node.op = op;
}
