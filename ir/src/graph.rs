//! The graph IR: ops as petgraph nodes, tensors as values with typed ids.
//!
//! Values (`%vN`) live in an arena owned by the graph; each is a graph input, a weight
//! (initializer or folded constant) or the output of exactly one node. Nodes (`nN`) sit
//! in a petgraph `StableDiGraph` whose edges carry the value flowing from producer to
//! consumer, so graph algorithms (topological order, cycle checks, partitioning) work on
//! petgraph directly while the node's own `inputs` list keeps operand order.

use std::fmt;

use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use petgraph::Direction;

use crate::{Op, TensorData, TensorType};

/// Handle of a node; prints as `n12`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) NodeIndex<u32>);

impl NodeId {
    pub fn index(self) -> usize {
        self.0.index()
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0.index())
    }
}

/// Handle of a value; prints as `%v12`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub(crate) u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The id of arena index `i` (for side tables indexed by value).
    pub fn from_index(i: usize) -> ValueId {
        ValueId(i as u32)
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%v{}", self.0)
    }
}

/// A tensor stored in the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Weight {
    pub data: TensorData,
    /// Trainable parameters are float initializers of rank >= 1; everything else
    /// (index tensors, scalars, folded shape constants) is a constant.
    pub trainable: bool,
}

/// Where a value comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueDef {
    /// A graph input (fed per microbatch).
    Input,
    Weight(Weight),
    /// Output `slot` of `node`.
    Node { node: NodeId, slot: usize },
}

/// A tensor value.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    /// The ONNX name, kept for error messages, export and inspection.
    pub name: String,
    pub ty: TensorType,
    pub def: ValueDef,
}

impl Value {
    pub fn weight(&self) -> Option<&Weight> {
        match &self.def {
            ValueDef::Weight(w) => Some(w),
            _ => None,
        }
    }
}

/// One operator application.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The ONNX node name (may be empty in the source model; import fills `OpType_k`).
    pub name: String,
    pub op: Op,
    /// Operands in ONNX order; `None` for an omitted optional input.
    pub inputs: Vec<Option<ValueId>>,
    /// Results in ONNX order; `None` for an omitted optional output.
    pub outputs: Vec<Option<ValueId>>,
}

/// The value carried by a petgraph edge and the consumer's operand slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edge {
    pub value: ValueId,
    pub slot: usize,
}

/// Facts about the source model, kept for inspection and export.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelMeta {
    pub producer_name: String,
    pub producer_version: String,
    pub ir_version: i64,
    /// The default-domain opset.
    pub opset: i64,
    pub graph_name: String,
    /// CRC-32 of the model file's bytes: names the exact model a plan or a build was made
    /// from. 0 for graphs not read from a file.
    pub source_crc32: u32,
}

/// The symbolic batch dimension: its name and the extent the model was exported with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchInfo {
    pub name: String,
    /// The batch size the model was exported at, where its inputs declare one (a fixed
    /// batch made symbolic); `None` where the model's batch axis is already dynamic, and
    /// the size it was exported at is not recorded.
    pub export_size: Option<i64>,
}

impl BatchInfo {
    /// The batch the model's batch-baked constants are taken to be written for: the export
    /// batch, or 1 where the model's batch is dynamic (its constants then hold no batch).
    pub fn resolved_size(&self) -> i64 {
        self.export_size.filter(|&s| s > 0).unwrap_or(1)
    }
}

/// A model graph.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub meta: ModelMeta,
    pub batch: Option<BatchInfo>,
    values: Vec<Value>,
    dag: StableDiGraph<Node, Edge, u32>,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
    /// Notes from import (e.g. a batch dimension resolved to a constant at a node).
    pub warnings: Vec<String>,
    /// What import decided about initializers that changes what trains (frozen
    /// batch-baked constants, exporter-merged weights), for `compile` and `train` to say.
    pub choices: pipewright_core::ImportChoices,
    /// Source nodes the importer read as other nodes so that they follow the batch (a
    /// fixed-batch export's identity gathers, zero initial states, Resize sizes), for
    /// `export` to write the same way.
    pub source_rewrites: Vec<SourceRewrite>,
}

/// One source node read as another ([`Graph::source_rewrites`]): the node written in its
/// place (it keeps the source node's outputs), the nodes written just before it (which
/// read only what it reads) and the constants it adds.
#[derive(Clone, Debug, Default)]
pub struct SourceRewrite {
    pub node: onnx_protobuf::NodeProto,
    pub before: Vec<onnx_protobuf::NodeProto>,
    pub constants: Vec<(String, TensorData)>,
}

impl Graph {
    pub fn new(meta: ModelMeta) -> Graph {
        Graph { meta, ..Graph::default() }
    }

    pub fn add_value(&mut self, value: Value) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        if matches!(value.def, ValueDef::Input) {
            self.inputs.push(id);
        }
        self.values.push(value);
        id
    }

    /// Adds a node whose inputs are already defined, creating one output value per
    /// `(name, type)` in `outputs` (`None` for an omitted output).
    pub fn add_node(
        &mut self,
        name: String,
        op: Op,
        inputs: Vec<Option<ValueId>>,
        outputs: Vec<Option<(String, TensorType)>>,
    ) -> NodeId {
        let idx = self.dag.add_node(Node { name, op, inputs: inputs.clone(), outputs: Vec::new() });
        let node = NodeId(idx);
        let mut outs = Vec::with_capacity(outputs.len());
        for (slot, out) in outputs.into_iter().enumerate() {
            outs.push(out.map(|(name, ty)| self.add_value(Value { name, ty, def: ValueDef::Node { node, slot } })));
        }
        self.dag[idx].outputs = outs;
        for (slot, input) in inputs.iter().enumerate() {
            if let Some(v) = *input {
                if let Some(ValueDef::Node { node: producer, .. }) = self.values.get(v.index()).map(|x| &x.def) {
                    self.dag.add_edge(producer.0, idx, Edge { value: v, slot });
                }
            }
        }
        node
    }

    /// Renames a value (the text parser names graph outputs this way).
    pub fn rename_value(&mut self, v: ValueId, name: String) {
        self.values[v.index()].name = name;
    }

    pub fn set_outputs(&mut self, outputs: Vec<ValueId>) {
        self.outputs = outputs;
    }

    pub fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.index()]
    }

    pub fn value_mut(&mut self, id: ValueId) -> &mut Value {
        &mut self.values[id.index()]
    }

    /// The value, or `None` when `id` is out of range (for the verifier).
    pub fn try_value(&self, id: ValueId) -> Option<&Value> {
        self.values.get(id.index())
    }

    pub fn value_count(&self) -> usize {
        self.values.len()
    }

    pub fn value_ids(&self) -> impl Iterator<Item = ValueId> + '_ {
        (0..self.values.len() as u32).map(ValueId)
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.dag[id.0]
    }

    pub fn try_node(&self, id: NodeId) -> Option<&Node> {
        self.dag.node_weight(id.0)
    }

    pub fn node_count(&self) -> usize {
        self.dag.node_count()
    }

    /// Node ids in insertion order (not necessarily topological after edits).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.dag.node_indices().map(NodeId)
    }

    /// The petgraph view, for graph algorithms.
    pub fn dag(&self) -> &StableDiGraph<Node, Edge, u32> {
        &self.dag
    }

    /// Nodes in a topological order (ties broken by id, so the order is stable), or the
    /// id of a node on a cycle.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, NodeId> {
        let mut indegree: Vec<usize> = vec![0; self.dag.node_bound()];
        for e in self.dag.edge_references() {
            indegree[e.target().index()] += 1;
        }
        let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<u32>> = self
            .dag
            .node_indices()
            .filter(|n| indegree[n.index()] == 0)
            .map(|n| std::cmp::Reverse(n.index() as u32))
            .collect();
        let mut order = Vec::with_capacity(self.dag.node_count());
        while let Some(std::cmp::Reverse(i)) = ready.pop() {
            let idx = NodeIndex::new(i as usize);
            order.push(NodeId(idx));
            for e in self.dag.edges_directed(idx, Direction::Outgoing) {
                let t = e.target().index();
                indegree[t] -= 1;
                if indegree[t] == 0 {
                    ready.push(std::cmp::Reverse(t as u32));
                }
            }
        }
        if order.len() == self.dag.node_count() {
            Ok(order)
        } else {
            let stuck = self.dag.node_indices().find(|n| indegree[n.index()] > 0).expect("a node left on a cycle");
            Err(NodeId(stuck))
        }
    }

    /// Nodes that read `value`, with the operand slot, in node order.
    pub fn consumers(&self, value: ValueId) -> Vec<(NodeId, usize)> {
        // A node's output is read along its outgoing edges, which keeps passes that visit
        // every value linear; inputs and weights have no producer and need the scan.
        if let ValueDef::Node { node, .. } = self.values[value.index()].def {
            let mut out: Vec<(NodeId, usize)> = self
                .dag
                .edges_directed(node.0, Direction::Outgoing)
                .filter(|e| e.weight().value == value)
                .map(|e| (NodeId(e.target()), e.weight().slot))
                .collect();
            out.sort_unstable_by_key(|&(n, slot)| (n.0.index(), slot));
            return out;
        }
        let mut out = Vec::new();
        for n in self.dag.node_indices() {
            for (slot, v) in self.dag[n].inputs.iter().enumerate() {
                if *v == Some(value) {
                    out.push((NodeId(n), slot));
                }
            }
        }
        out
    }

    /// Number of reads of every value (graph outputs count as a read).
    pub fn use_counts(&self) -> Vec<usize> {
        let mut uses = vec![0; self.values.len()];
        for n in self.dag.node_weights() {
            for v in n.inputs.iter().flatten() {
                uses[v.index()] += 1;
            }
        }
        for v in &self.outputs {
            uses[v.index()] += 1;
        }
        uses
    }

    /// Removes nodes whose outputs nobody reads, repeatedly, and returns how many went.
    pub fn remove_dead_nodes(&mut self) -> usize {
        let mut removed = 0;
        loop {
            let uses = self.use_counts();
            let dead: Vec<NodeIndex<u32>> = self
                .dag
                .node_indices()
                .filter(|&n| self.dag[n].outputs.iter().flatten().all(|v| uses[v.index()] == 0))
                .collect();
            if dead.is_empty() {
                return removed;
            }
            for n in dead {
                self.dag.remove_node(n);
                removed += 1;
            }
        }
    }

    /// Renumbers nodes and values densely: inputs, then weights (in their current order),
    /// then node outputs in topological order. Unused weights are dropped. Ids printed by
    /// the text form are the ids of the compacted graph.
    pub fn compact(&mut self) -> Result<(), NodeId> {
        self.compact_with_remap().map(|_| ())
    }

    /// [`Graph::compact`], returning each old node index's new id (`None`: removed), so
    /// side tables keyed by node can follow the renumbering.
    pub fn compact_with_remap(&mut self) -> Result<Vec<Option<NodeId>>, NodeId> {
        let order = self.topo_order()?;
        let mut node_remap: Vec<Option<NodeId>> = vec![None; self.dag.node_bound()];
        let uses = self.use_counts();
        let mut remap: Vec<Option<ValueId>> = vec![None; self.values.len()];
        let mut out = Graph { meta: self.meta.clone(), batch: self.batch.clone(), ..Graph::default() };
        out.warnings = std::mem::take(&mut self.warnings);
        out.choices = std::mem::take(&mut self.choices);
        out.source_rewrites = std::mem::take(&mut self.source_rewrites);
        for &v in &self.inputs {
            remap[v.index()] = Some(out.add_value(self.values[v.index()].clone()));
        }
        for (i, v) in self.values.iter().enumerate() {
            if matches!(v.def, ValueDef::Weight(_)) && uses[i] > 0 {
                remap[i] = Some(out.add_value(v.clone()));
            }
        }
        for n in order {
            let node = &self.dag[n.0];
            let inputs = node.inputs.iter().map(|v| v.and_then(|v| remap[v.index()])).collect();
            let outputs = node
                .outputs
                .iter()
                .map(|v| v.map(|v| (self.values[v.index()].name.clone(), self.values[v.index()].ty.clone())))
                .collect();
            let new = out.add_node(node.name.clone(), node.op.clone(), inputs, outputs);
            node_remap[n.index()] = Some(new);
            for (old, newv) in node.outputs.iter().zip(out.dag[new.0].outputs.clone()) {
                if let (Some(o), Some(nv)) = (old, newv) {
                    remap[o.index()] = Some(nv);
                }
            }
        }
        out.outputs = self.outputs.iter().filter_map(|v| remap[v.index()]).collect();
        *self = out;
        Ok(node_remap)
    }

    /// Points operand `slot` of `node` at `value`, keeping the petgraph edges in step.
    pub fn set_input(&mut self, node: NodeId, slot: usize, value: Option<ValueId>) {
        if let Some(e) = self
            .dag
            .edges_directed(node.0, Direction::Incoming)
            .find(|e| e.weight().slot == slot)
            .map(|e| e.id())
        {
            self.dag.remove_edge(e);
        }
        self.dag[node.0].inputs[slot] = value;
        if let Some(v) = value {
            if let ValueDef::Node { node: producer, .. } = self.values[v.index()].def {
                self.dag.add_edge(producer.0, node.0, Edge { value: v, slot });
            }
        }
    }

    /// Trainable weights' total element count.
    pub fn parameter_count(&self) -> u64 {
        self.values
            .iter()
            .filter_map(|v| v.weight())
            .filter(|w| w.trainable)
            .map(|w| w.data.numel() as u64)
            .sum()
    }

    /// Trainable weights' total bytes.
    pub fn parameter_bytes(&self) -> u64 {
        self.values
            .iter()
            .filter_map(|v| v.weight())
            .filter(|w| w.trainable)
            .map(|w| w.data.byte_len() as u64)
            .sum()
    }

    /// Mutable access to a node for passes that rewrite ops in place.
    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.dag[id.0]
    }

    /// Builds a graph from raw parts without checks, for verifier tests of broken graphs.
    #[doc(hidden)]
    pub fn push_raw_node(&mut self, node: Node) -> NodeId {
        NodeId(self.dag.add_node(node))
    }

    /// Adds a petgraph edge without checks, for verifier tests of broken graphs (a cycle
    /// cannot be built through `add_node`, which only links to existing producers).
    #[doc(hidden)]
    pub fn push_raw_edge(&mut self, from: NodeId, to: NodeId, edge: Edge) {
        self.dag.add_edge(from.0, to.0, edge);
    }
}

#[cfg(test)]
mod tests {
    use super::{Graph, ModelMeta, NodeId, Value, ValueDef, ValueId};
    use pipewright_ops::op::{BinaryOp, UnaryOp};
    use crate::{DType, Dim, Op, Shape, TensorType};

    /// Every node reading `v`, by scanning all inputs (what `consumers` must agree with).
    fn scan(g: &Graph, v: ValueId) -> Vec<(NodeId, usize)> {
        let mut out = Vec::new();
        for n in g.node_ids() {
            for (slot, i) in g.node(n).inputs.iter().enumerate() {
                if *i == Some(v) {
                    out.push((n, slot));
                }
            }
        }
        out.sort_by_key(|&(n, s)| (n.index(), s));
        out
    }

    #[test]
    fn consumers_follow_rewired_inputs_and_removed_nodes() {
        let ty = TensorType::new(DType::F32, Shape(vec![Dim::N, Dim::Fixed(4)]));
        let mut g = Graph::new(ModelMeta::default());
        let x = g.add_value(Value { name: "x".into(), ty: ty.clone(), def: ValueDef::Input });
        let out = |g: &Graph, n: NodeId| g.node(n).outputs[0];
        let a = g.add_node("a".into(), Op::Unary(UnaryOp::Relu), vec![Some(x)], vec![Some(("a".into(), ty.clone()))]);
        let b = g.add_node("b".into(), Op::Binary(BinaryOp::Add), vec![out(&g, a), out(&g, a)], vec![Some(("b".into(), ty.clone()))]);
        let c = g.add_node("c".into(), Op::Binary(BinaryOp::Mul), vec![out(&g, b), out(&g, a)], vec![Some(("c".into(), ty.clone()))]);
        g.set_outputs(vec![out(&g, c).unwrap()]);
        let values: Vec<ValueId> = g.value_ids().collect();
        let check = |g: &Graph| {
            for &v in &values {
                assert_eq!(g.consumers(v), scan(g, v), "consumers of {}", g.value(v).name);
            }
        };
        check(&g);
        assert_eq!(g.consumers(out(&g, a).unwrap()), vec![(b, 0), (b, 1), (c, 1)]);
        g.set_input(b, 1, Some(x));
        g.set_input(c, 1, out(&g, b));
        check(&g);
        g.set_input(c, 0, Some(x));
        g.set_outputs(vec![out(&g, c).unwrap()]);
        g.remove_dead_nodes();
        check(&g);
    }
}
