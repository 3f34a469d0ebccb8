//! The partition pass: given the stage of every node, insert explicit `StageBoundary`
//! nodes wherever a value crosses from one stage to the next, and return the stage side
//! table of the rewritten graph.
//!
//! A value produced in stage `s` and read in stages up to `t > s` crosses every stage in
//! between: it is forwarded through a chain of boundaries `s -> s+1 -> ... -> t`, so a
//! skip connection costs a send in every stage it passes, and each reader takes the copy
//! that arrived in its own stage.
//!
//! Values computed from weights and constants alone (a transposed LM head, the
//! `Identity(weight)` an exporter writes for every reuse of a deduplicated initializer, an
//! attention mask built from constants) do not cross: each later stage that reads one
//! computes it again from its own copy of those weights. A stage reading such a value thus
//! holds the weights it comes from, as the weight-versioning pass expects (tied weights,
//! their gradients summed across the stages holding them), and no weight travels as an
//! activation every microbatch.

use std::collections::HashMap;

use pipewright_ir::{Graph, NodeId, Op, StageMap, ValueDef, ValueId};

/// Why stages could not be inserted.
#[derive(Debug)]
pub enum BoundaryError {
    /// A node has no stage.
    Unassigned { node: String },
    /// A value is read in an earlier stage than the one producing it.
    Backward { value: String, producer_stage: u32, consumer: String, consumer_stage: u32 },
    /// The rewritten graph failed verification (a bug in this pass).
    Invalid(String),
}

impl std::fmt::Display for BoundaryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BoundaryError::Unassigned { node } => write!(f, "node {node:?} has no stage"),
            BoundaryError::Backward { value, producer_stage, consumer, consumer_stage } => write!(
                f,
                "value {value:?} is produced in stage {producer_stage} but read by node {consumer:?} in earlier stage {consumer_stage}"
            ),
            BoundaryError::Invalid(why) => write!(f, "the partitioned graph is invalid: {why}"),
        }
    }
}

impl std::error::Error for BoundaryError {}

/// Inserts stage boundaries for `stages` (which must give every node a stage) and
/// returns the stage table of the compacted, rewritten graph.
pub fn insert_stage_boundaries(g: &mut Graph, stages: &StageMap) -> Result<StageMap, BoundaryError> {
    let mut table = stages.clone();
    let original: Vec<NodeId> = g.node_ids().collect();
    for &n in &original {
        if stages.get(n).is_none() {
            return Err(BoundaryError::Unassigned { node: g.node(n).name.clone() });
        }
    }
    localize_weight_derived(g, &mut table);
    g.remove_dead_nodes();
    let produced: Vec<(ValueId, NodeId)> = g
        .value_ids()
        .filter_map(|v| match g.value(v).def {
            ValueDef::Node { node, .. } => Some((v, node)),
            _ => None,
        })
        .collect();
    for (v, producer) in produced {
        forward_value(g, &mut table, v, producer)?;
    }
    let remap = g.compact_with_remap().map_err(|n| BoundaryError::Invalid(format!("cycle through {n}")))?;
    let table = table.remap(&remap);
    pipewright_ir::verify(g).map_err(|e| BoundaryError::Invalid(format!("{e:?}")))?;
    pipewright_ir::verify_stages(g, &table).map_err(|e| {
        BoundaryError::Invalid(e.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("; "))
    })?;
    Ok(table)
}

/// Whether each value is computed from weights and constants alone (by value index).
fn weight_derived(g: &Graph, order: &[NodeId]) -> Vec<bool> {
    let mut derived: Vec<bool> = g.value_ids().map(|v| matches!(g.value(v).def, ValueDef::Weight(_))).collect();
    for &n in order {
        let node = g.node(n);
        let from_weights = node.inputs.iter().flatten().next().is_some() && node.inputs.iter().flatten().all(|v| derived[v.index()]);
        if from_weights && !matches!(node.op, Op::StageBoundary { .. }) {
            for v in node.outputs.iter().flatten() {
                derived[v.index()] = true;
            }
        }
    }
    derived
}

/// Gives every later stage that reads a weight-derived value its own copy of the nodes
/// computing it (reading the weights themselves), and points its readers at that copy.
fn localize_weight_derived(g: &mut Graph, table: &mut StageMap) {
    let Ok(order) = g.topo_order() else { return };
    let derived = weight_derived(g, &order);
    let mut copies: HashMap<(ValueId, u32), ValueId> = HashMap::new();
    for &n in &order {
        let Some(s) = table.get(n) else { continue };
        for v in g.node(n).outputs.clone().into_iter().flatten() {
            if !derived[v.index()] {
                continue;
            }
            for (reader, slot) in g.consumers(v) {
                match table.get(reader) {
                    Some(t) if t > s => {
                        let copy = copy_in_stage(g, table, &derived, &mut copies, v, t);
                        g.set_input(reader, slot, Some(copy));
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Whether `v` is weight-derived: by the analysis, or as a copy made here (an earlier
/// stage's reader may already read a copy, and its own outputs be copied on).
fn is_derived(derived: &[bool], v: ValueId) -> bool {
    derived.get(v.index()).copied().unwrap_or(true)
}

/// The copy of weight-derived value `v` computed in stage `t` (made on first use).
fn copy_in_stage(g: &mut Graph, table: &mut StageMap, derived: &[bool], copies: &mut HashMap<(ValueId, u32), ValueId>, v: ValueId, t: u32) -> ValueId {
    if let Some(&c) = copies.get(&(v, t)) {
        return c;
    }
    let ValueDef::Node { node, .. } = g.value(v).def else { return v };
    let original = g.node(node).clone();
    let inputs = original
        .inputs
        .iter()
        .map(|i| i.map(|u| if is_derived(derived, u) { copy_in_stage(g, table, derived, copies, u, t) } else { u }))
        .collect();
    let outputs = original.outputs.iter().map(|o| o.map(|o| (format!("{}@stage{t}", g.value(o).name), g.value(o).ty.clone()))).collect();
    let copy = g.add_node(format!("{}@stage{t}", original.name), original.op.clone(), inputs, outputs);
    table.set(copy, t);
    for (o, c) in original.outputs.iter().zip(g.node(copy).outputs.clone()) {
        if let (Some(o), Some(c)) = (o, c) {
            copies.insert((*o, t), c);
        }
    }
    copies[&(v, t)]
}

/// Chains boundaries for one value and points each reader at its own stage's copy.
fn forward_value(g: &mut Graph, table: &mut StageMap, v: ValueId, producer: NodeId) -> Result<(), BoundaryError> {
    let s = table.get(producer).expect("checked: every node has a stage");
    let readers: Vec<(NodeId, usize, u32)> = g
        .consumers(v)
        .into_iter()
        .map(|(n, slot)| (n, slot, table.get(n).expect("checked: every node has a stage")))
        .collect();
    if let Some(&(n, _, t)) = readers.iter().find(|r| r.2 < s) {
        return Err(BoundaryError::Backward {
            value: g.value(v).name.clone(),
            producer_stage: s,
            consumer: g.node(n).name.clone(),
            consumer_stage: t,
        });
    }
    let last = readers.iter().map(|r| r.2).max().unwrap_or(s);
    let mut copy_in: Vec<ValueId> = vec![v];
    let ty = g.value(v).ty.clone();
    let name = g.value(v).name.clone();
    for k in s..last {
        let prev = *copy_in.last().expect("non-empty");
        let b = g.add_node(
            format!("{name}->stage{}", k + 1),
            Op::StageBoundary { from: k, to: k + 1 },
            vec![Some(prev)],
            vec![Some((format!("{name}@stage{}", k + 1), ty.clone()))],
        );
        table.set(b, k + 1);
        copy_in.push(g.node(b).outputs[0].expect("boundary has an output"));
    }
    for (n, slot, t) in readers {
        if t > s {
            g.set_input(n, slot, Some(copy_in[(t - s) as usize]));
        }
    }
    Ok(())
}
