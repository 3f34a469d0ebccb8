//! The verifier: first that every id resolves, then the semantics (one producer per
//! value, inputs defined, edges matching operands, no cycle, types as inference gives).

use std::fmt;

use crate::infer::{infer, Ctx, In};
use crate::known::{evaluate, Known};
use crate::{Graph, NodeId, TensorType, ValueDef, ValueId};

/// One problem found by [`verify`].
#[derive(Clone, Debug, PartialEq)]
pub enum VerifyError {
    ValueOutOfRange { node: NodeId, value: ValueId },
    GraphOutputOutOfRange { value: ValueId },
    ProducerMismatch { value: ValueId, node: NodeId },
    TwoProducers { value: ValueId, first: NodeId, second: NodeId },
    UndefinedInput { node: NodeId, slot: usize, value: ValueId },
    EdgeMismatch { node: NodeId },
    Cycle { node: NodeId },
    InferenceFailed { node: NodeId, reason: String },
    TypeMismatch { node: NodeId, value: ValueId, stored: TensorType, inferred: TensorType },
    NoStage { node: NodeId },
    StageCrossing { node: NodeId, value: ValueId, producer_stage: u32, consumer_stage: u32 },
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerifyError::ValueOutOfRange { node, value } => write!(f, "{node} refers to {value}, which does not exist"),
            VerifyError::GraphOutputOutOfRange { value } => write!(f, "graph output {value} does not exist"),
            VerifyError::ProducerMismatch { value, node } => write!(f, "{value} is listed as an output of {node}, but its definition says otherwise"),
            VerifyError::TwoProducers { value, first, second } => write!(f, "{value} is produced by both {first} and {second}"),
            VerifyError::UndefinedInput { node, slot, value } => write!(f, "{node} input {slot} reads {value}, which no node, weight or input defines"),
            VerifyError::EdgeMismatch { node } => write!(f, "{node}: graph edges do not match its operands"),
            VerifyError::Cycle { node } => write!(f, "the graph has a cycle through {node}"),
            VerifyError::InferenceFailed { node, reason } => write!(f, "{node}: shape inference fails: {reason}"),
            VerifyError::NoStage { node } => write!(f, "{node} has no pipeline stage"),
            VerifyError::StageCrossing { node, value, producer_stage, consumer_stage } => write!(
                f,
                "{node} in stage {consumer_stage} reads {value} from stage {producer_stage} without a stage boundary"
            ),
            VerifyError::TypeMismatch { node, value, stored, inferred } => {
                write!(f, "{node}: {value} is typed {stored} but inference gives {inferred}")
            }
        }
    }
}

/// Checks the graph's structural and type invariants; returns every problem found.
pub fn verify(g: &Graph) -> Result<(), Vec<VerifyError>> {
    let mut errs = check_ids(g);
    if errs.is_empty() {
        errs.extend(check_definitions(g));
    }
    if errs.is_empty() {
        errs.extend(check_edges(g));
    }
    if errs.is_empty() {
        match g.topo_order() {
            Err(node) => errs.push(VerifyError::Cycle { node }),
            Ok(order) => errs.extend(check_types(g, &order)),
        }
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}

fn check_ids(g: &Graph) -> Vec<VerifyError> {
    let mut errs = Vec::new();
    for n in g.node_ids() {
        let node = g.node(n);
        for v in node.inputs.iter().chain(&node.outputs).flatten() {
            if g.try_value(*v).is_none() {
                errs.push(VerifyError::ValueOutOfRange { node: n, value: *v });
            }
        }
    }
    for v in g.outputs() {
        if g.try_value(*v).is_none() {
            errs.push(VerifyError::GraphOutputOutOfRange { value: *v });
        }
    }
    errs
}

fn check_definitions(g: &Graph) -> Vec<VerifyError> {
    let mut errs = Vec::new();
    let mut producer: Vec<Option<NodeId>> = vec![None; g.value_count()];
    for n in g.node_ids() {
        for (slot, v) in g.node(n).outputs.iter().enumerate() {
            let Some(v) = *v else { continue };
            if let Some(first) = producer[v.index()] {
                errs.push(VerifyError::TwoProducers { value: v, first, second: n });
            }
            producer[v.index()] = Some(n);
            if g.value(v).def != (ValueDef::Node { node: n, slot }) {
                errs.push(VerifyError::ProducerMismatch { value: v, node: n });
            }
        }
    }
    let defined = |v: ValueId| match &g.value(v).def {
        ValueDef::Input | ValueDef::Weight(_) => true,
        ValueDef::Node { node, .. } => producer[v.index()] == Some(*node),
    };
    for n in g.node_ids() {
        for (slot, v) in g.node(n).inputs.iter().enumerate() {
            if let Some(v) = *v {
                if !defined(v) {
                    errs.push(VerifyError::UndefinedInput { node: n, slot, value: v });
                }
            }
        }
    }
    errs
}

fn check_edges(g: &Graph) -> Vec<VerifyError> {
    use petgraph::visit::EdgeRef;
    let mut errs = Vec::new();
    for n in g.node_ids() {
        let mut expected: Vec<(usize, ValueId, usize)> = g
            .node(n)
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(slot, v)| {
                let v = (*v)?;
                match g.value(v).def {
                    ValueDef::Node { node, .. } => Some((node.index(), v, slot)),
                    _ => None,
                }
            })
            .collect();
        let mut actual: Vec<(usize, ValueId, usize)> = g
            .dag()
            .edges_directed(n.0, petgraph::Direction::Incoming)
            .map(|e| (e.source().index(), e.weight().value, e.weight().slot))
            .collect();
        expected.sort();
        actual.sort();
        if expected != actual {
            errs.push(VerifyError::EdgeMismatch { node: n });
        }
    }
    errs
}

fn check_types(g: &Graph, order: &[NodeId]) -> Vec<VerifyError> {
    let mut errs = Vec::new();
    let ctx = Ctx { export_batch: g.batch.as_ref().and_then(|b| b.export_size) };
    let mut known: Vec<Option<Known>> =
        g.value_ids().map(|v| g.value(v).weight().and_then(|w| Known::from_tensor(&w.data))).collect();
    for &n in order {
        let node = g.node(n);
        let ins: Vec<Option<In>> = node
            .inputs
            .iter()
            .map(|v| v.map(|v| In { ty: &g.value(v).ty, known: known[v.index()].as_ref() }))
            .collect();
        match infer(&node.op, &ins, node.outputs.len(), ctx) {
            Err(reason) => errs.push(VerifyError::InferenceFailed { node: n, reason }),
            Ok(types) => {
                for (v, inferred) in node.outputs.iter().zip(&types) {
                    let Some(v) = *v else { continue };
                    let stored = &g.value(v).ty;
                    if stored != inferred {
                        errs.push(VerifyError::TypeMismatch { node: n, value: v, stored: stored.clone(), inferred: inferred.clone() });
                    }
                }
                let ks: Vec<Option<&Known>> = node.inputs.iter().map(|v| v.and_then(|v| known[v.index()].as_ref())).collect();
                let dims: Vec<_> = node.inputs.iter().map(|v| v.map(|v| g.value(v).ty.shape.0.clone())).collect();
                if let (Some(first), Some(Some(out))) = (types.first(), node.outputs.first()) {
                    let fixed: Option<Vec<i64>> = first.shape.0.iter().map(|d| d.fixed()).collect();
                    known[out.index()] = evaluate(&node.op, &ks, &dims, first.dtype, fixed);
                }
            }
        }
    }
    errs
}
