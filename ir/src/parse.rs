//! The text form read back: [`parse_graph`] turns what [`crate::text::print_graph`]
//! prints into a [`Graph`], so small filetests can state a pass's input as IR text.
//!
//! Ops go through the importer's own conversion: a node's attributes are turned into
//! ONNX attributes (the same table the printer and the ONNX exporter use,
//! `Op::attributes`) and converted at the graph's opset, so the parser accepts exactly the
//! ops and attributes import does. `StageBoundary[from=A, to=B]` and `StopGradient` (not
//! ONNX) are read directly. Output types are taken from the text; run the verifier to check them.
//!
//! The text never carries weight values: weights and constants shown without values parse
//! as zeros; constants shown with values (`const "axes" [0, 1]`) keep them. Node output
//! values, whose names the text does not show, are named after their id (`v12`) unless
//! `return` names them. Values and nodes are numbered in the order they are defined, so a
//! printed compacted graph (inputs and weights first, nodes in topological order) reads
//! back to the same text.
//!
//! A node line's trailing annotation (`# n3 "name" stage=1 stash ...`) is returned per
//! node by [`parse_graph_annotated`], for filetests whose input carries pass results.

use std::collections::HashMap;

use bytes::Bytes;
use onnx_protobuf::NodeProto;

use crate::dim::{Dim, Shape, TensorType};
use crate::import::attribute_proto;
use crate::import::attrs::convert_node;
use pipewright_ops::op::{AttrValue, Op};
use pipewright_ops::onnx::spec;
use crate::{BatchInfo, DType, Graph, ModelMeta, NodeId, TensorData, Value, ValueDef, ValueId, Weight};

/// Text that is not the IR's text form; names the 1-based line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

/// Parses a graph in text form.
pub fn parse_graph(text: &str) -> Result<Graph, ParseError> {
    parse_graph_annotated(text).map(|(g, _)| g)
}

/// Parses a graph in text form, with each node's trailing annotation (the text after its
/// name, e.g. `stage=1 stash`; empty when there is none).
pub fn parse_graph_annotated(text: &str) -> Result<(Graph, Vec<(NodeId, String)>), ParseError> {
    let mut p = Parser::default();
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty() && !l.starts_with("//"));
    let (n, header) = lines.next().ok_or(ParseError { line: 1, message: "empty text: expected `graph \"NAME\" ... {`".into() })?;
    p.header(header).map_err(|message| ParseError { line: n, message })?;
    let mut closed = false;
    for (n, line) in lines {
        let at = |message: String| ParseError { line: n, message };
        if closed {
            return Err(at(format!("text after the graph's closing `}}`: {line:?}")));
        }
        if line == "}" {
            closed = true;
        } else if let Some(rest) = line.strip_prefix("return") {
            p.returns(rest).map_err(at)?;
        } else {
            p.line(line).map_err(at)?;
        }
    }
    if !closed {
        return Err(ParseError { line: text.lines().count(), message: "the graph has no closing `}`".into() });
    }
    Ok((p.graph, p.notes))
}

#[derive(Default)]
struct Parser {
    graph: Graph,
    /// Text id (`%v12` → 12) to graph value.
    ids: HashMap<u32, ValueId>,
    notes: Vec<(NodeId, String)>,
}

impl Parser {
    fn header(&mut self, line: &str) -> Result<(), String> {
        let mut c = Cursor::new(line);
        c.expect("graph")?;
        let mut meta = ModelMeta { graph_name: c.quoted()?, ..ModelMeta::default() };
        loop {
            c.spaces();
            if c.eat("{") {
                break;
            }
            let key = c.word()?;
            c.expect("=")?;
            match key.as_str() {
                "ir_version" => meta.ir_version = c.int()?,
                "opset" => meta.opset = c.int()?,
                "producer" => {
                    let p = c.quoted()?;
                    let (name, version) = p.split_once(' ').unwrap_or((p.as_str(), ""));
                    (meta.producer_name, meta.producer_version) = (name.to_string(), version.to_string());
                }
                "batch" => {
                    c.expect("N(")?;
                    let name = c.quoted()?;
                    let export_size = match c.eat(", dynamic") {
                        true => None,
                        false => {
                            c.expect(", exported")?;
                            Some(c.int()?)
                        }
                    };
                    c.expect(")")?;
                    self.graph.batch = Some(BatchInfo { name, export_size });
                }
                other => return Err(format!("unknown graph field {other:?}")),
            }
        }
        c.end()?;
        let batch = self.graph.batch.take();
        self.graph = Graph::new(meta);
        self.graph.batch = batch;
        Ok(())
    }

    /// A value (`%v3: f32[4] = weight "w"`) or a node line.
    fn line(&mut self, line: &str) -> Result<(), String> {
        let mut c = Cursor::new(line);
        let outputs = self.output_list(&mut c)?;
        c.expect("=")?;
        c.spaces();
        let kind = c.word()?;
        if outputs.len() == 1 && matches!(kind.as_str(), "input" | "weight" | "const") {
            let (id, ty) = outputs.into_iter().next().flatten().ok_or("a value line needs `%vN: TYPE`")?;
            return self.value(&mut c, id, ty, &kind);
        }
        self.node(&mut c, outputs, kind)
    }

    /// `%v1: f32[N,4], _, %v2: i64[]`.
    fn output_list(&mut self, c: &mut Cursor) -> Result<Vec<Option<(u32, TensorType)>>, String> {
        let mut out = Vec::new();
        loop {
            c.spaces();
            if c.eat("_") {
                out.push(None);
            } else {
                let id = c.value_id()?;
                c.expect(":")?;
                c.spaces();
                out.push(Some((id, c.tensor_type()?)));
            }
            c.spaces();
            if !c.eat(",") {
                return Ok(out);
            }
        }
    }

    fn value(&mut self, c: &mut Cursor, id: u32, ty: TensorType, kind: &str) -> Result<(), String> {
        c.spaces();
        let name = c.quoted()?;
        let def = match kind {
            "input" => ValueDef::Input,
            _ => {
                let dims = ty.shape.0.iter().map(|d| d.fixed()).collect::<Option<Vec<i64>>>().ok_or_else(|| format!("weight {name:?} has a batch-sized shape {}", ty.shape))?;
                c.spaces();
                let data = if c.peek() == Some('[') { constant(c, ty.dtype, dims)? } else { zeros(ty.dtype, dims)? };
                ValueDef::Weight(Weight { data, trainable: kind == "weight" })
            }
        };
        c.end()?;
        self.define(id, Value { name, ty, def })
    }

    fn define(&mut self, id: u32, value: Value) -> Result<(), String> {
        if self.ids.contains_key(&id) {
            return Err(format!("%v{id} is defined twice"));
        }
        let v = self.graph.add_value(value);
        self.ids.insert(id, v);
        Ok(())
    }

    fn node(&mut self, c: &mut Cursor, outputs: Vec<Option<(u32, TensorType)>>, op_type: String) -> Result<(), String> {
        let attrs = if c.peek() == Some('[') { attr_list(c)? } else { Vec::new() };
        c.expect("(")?;
        let mut inputs = Vec::new();
        c.spaces();
        if !c.eat(")") {
            loop {
                c.spaces();
                inputs.push(if c.eat("_") { None } else { Some(self.use_value(c.value_id()?)?) });
                c.spaces();
                if c.eat(")") {
                    break;
                }
                c.expect(",")?;
            }
        }
        c.spaces();
        c.expect("#")?;
        c.spaces();
        c.node_id()?;
        c.spaces();
        let name = c.quoted()?;
        let note = c.rest().trim().to_string();
        let op = self.op(&op_type, &attrs, inputs.len(), outputs.len()).map_err(|e| format!("node {name:?} ({op_type}): {e}"))?;
        for (id, _) in outputs.iter().flatten() {
            if self.ids.contains_key(id) {
                return Err(format!("%v{id} is defined twice"));
            }
        }
        let outs = outputs.iter().map(|o| o.as_ref().map(|(id, ty)| (format!("v{id}"), ty.clone()))).collect();
        let node = self.graph.add_node(name, op, inputs, outs);
        for ((id, _), v) in outputs.iter().zip(&self.graph.node(node).outputs).filter_map(|(o, v)| Some((o.as_ref()?, (*v)?))) {
            self.ids.insert(*id, v);
        }
        self.notes.push((node, note));
        Ok(())
    }

    fn use_value(&self, id: u32) -> Result<ValueId, String> {
        self.ids.get(&id).copied().ok_or_else(|| format!("%v{id} is used before it is defined"))
    }

    /// The op through the importer's conversion at the graph's opset.
    fn op(&self, op_type: &str, attrs: &[(String, AttrValue)], n_inputs: usize, n_outputs: usize) -> Result<Op, String> {
        let get = |k: &str| attrs.iter().find(|(n, _)| n == k).map(|(_, v)| v);
        if op_type == "StageBoundary" {
            let stage = |k: &str| match get(k) {
                Some(AttrValue::Int(v)) => u32::try_from(*v).map_err(|_| format!("{k}={v} is not a stage")),
                _ => Err(format!("needs an integer `{k}`")),
            };
            return Ok(Op::StageBoundary { from: stage("from")?, to: stage("to")? });
        }
        if op_type == "StopGradient" {
            return Ok(Op::StopGradient);
        }
        let s = spec(op_type).ok_or_else(|| format!("unknown op {op_type:?}"))?;
        // An op of another domain is at its newest version (the text form records the
        // default opset only).
        let at = if s.domain.is_empty() { self.graph.meta.opset } else { *s.versions.last().unwrap_or(&1) };
        // The importer fuses ops whatever the opset (`crate::fuse`): those parse at any
        // opset, at their first version.
        let fused = crate::fuse::FUSED_OPS.contains(&op_type).then(|| s.versions.first().copied()).flatten();
        let version = s.version_at(at).or(fused).ok_or_else(|| format!("{op_type} does not exist at opset {}", self.graph.meta.opset))?;
        let node = NodeProto {
            op_type: op_type.into(),
            input: vec![String::new(); n_inputs],
            output: vec![String::new(); n_outputs],
            attribute: attrs.iter().map(|(k, v)| attribute_proto(k, v)).collect(),
            ..NodeProto::default()
        };
        convert_node(&node, version)
    }

    /// `%v9 "out", %v10 "logits"`: the graph outputs, named.
    fn returns(&mut self, rest: &str) -> Result<(), String> {
        let mut c = Cursor::new(rest);
        let mut outs = Vec::new();
        loop {
            c.spaces();
            if c.at_end() {
                break;
            }
            let v = self.use_value(c.value_id()?)?;
            c.spaces();
            let name = c.quoted()?;
            self.graph.rename_value(v, name);
            outs.push(v);
            c.spaces();
            if !c.eat(",") {
                break;
            }
        }
        c.end()?;
        self.graph.set_outputs(outs);
        Ok(())
    }
}

fn zeros(dtype: DType, dims: Vec<i64>) -> Result<TensorData, String> {
    let numel: usize = dims.iter().map(|&d| usize::try_from(d).unwrap_or(0)).product();
    let len = dtype.byte_len(numel).ok_or_else(|| "weight too large".to_string())?;
    TensorData::new(dtype, dims, Bytes::from(vec![0u8; len])).ok_or_else(|| "bad weight shape".to_string())
}

/// `[1, -2]` or `[0.5]`: a constant's values.
fn constant(c: &mut Cursor, dtype: DType, dims: Vec<i64>) -> Result<TensorData, String> {
    let items = c.list()?;
    let numel: i64 = dims.iter().product();
    if items.len() as i64 != numel {
        return Err(format!("a constant of shape {dims:?} needs {numel} values, {} are given", items.len()));
    }
    if dtype == DType::I64 {
        let v = items.iter().map(|t| t.parse::<i64>().map_err(|_| format!("{t:?} is not an integer"))).collect::<Result<Vec<_>, _>>()?;
        return Ok(TensorData::from_i64s(dims, &v));
    }
    let v = items.iter().map(|t| t.parse::<f64>().map_err(|_| format!("{t:?} is not a number"))).collect::<Result<Vec<_>, _>>()?;
    Ok(TensorData::from_f64s(dtype, dims, &v))
}

/// `[axis=1, perm=[1, 0], approximate="tanh", to=f32, value=f32:0.0]`.
fn attr_list(c: &mut Cursor) -> Result<Vec<(String, AttrValue)>, String> {
    c.expect("[")?;
    let mut out = Vec::new();
    loop {
        c.spaces();
        let key = c.word()?;
        c.expect("=")?;
        out.push((key, attr_value(c)?));
        c.spaces();
        if c.eat("]") {
            return Ok(out);
        }
        c.expect(",")?;
    }
}

fn attr_value(c: &mut Cursor) -> Result<AttrValue, String> {
    match c.peek() {
        Some('"') => Ok(AttrValue::Str(c.quoted()?)),
        Some('[') => {
            let items = c.list()?;
            Ok(AttrValue::Ints(items.iter().map(|t| t.parse().map_err(|_| format!("{t:?} is not an integer"))).collect::<Result<_, _>>()?))
        }
        _ => {
            let token = c.token();
            if let (Some(dtype), Some('[')) = (token.strip_suffix(':'), c.peek()) {
                let dtype = DType::from_name(dtype).ok_or_else(|| format!("unknown element type {dtype:?}"))?;
                let items = c.list()?;
                let xs = items.iter().map(|t| t.parse::<f64>().map_err(|_| format!("{t:?} is not a number"))).collect::<Result<Vec<_>, _>>()?;
                return Ok(AttrValue::Tensor(TensorData::from_f64s(dtype, vec![xs.len() as i64], &xs)));
            }
            if let Some((dtype, value)) = token.split_once(':') {
                let dtype = DType::from_name(dtype).ok_or_else(|| format!("unknown element type {dtype:?}"))?;
                let x: f64 = value.parse().map_err(|_| format!("{value:?} is not a number"))?;
                return Ok(AttrValue::Tensor(TensorData::from_f64s(dtype, vec![1], &[x])));
            }
            if let Some(d) = DType::from_name(&token) {
                return Ok(AttrValue::DType(d));
            }
            let float = token.contains(['.', 'e', 'E']) || token.contains("inf") || token.contains("NaN");
            if float {
                token.parse().map(AttrValue::Float).map_err(|_| format!("{token:?} is not a number"))
            } else {
                token.parse().map(AttrValue::Int).map_err(|_| format!("{token:?} is not an attribute value"))
            }
        }
    }
}

/// A position in one line.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a str) -> Self {
        Cursor { s, at: 0 }
    }

    fn rest(&self) -> &'a str {
        &self.s[self.at..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn at_end(&self) -> bool {
        self.rest().trim().is_empty()
    }

    fn spaces(&mut self) {
        let r = self.rest();
        self.at += r.len() - r.trim_start().len();
    }

    fn eat(&mut self, t: &str) -> bool {
        if self.rest().starts_with(t) {
            self.at += t.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, t: &str) -> Result<(), String> {
        self.spaces();
        if self.eat(t) {
            Ok(())
        } else {
            Err(format!("expected `{t}` at {:?}", self.rest()))
        }
    }

    fn end(&mut self) -> Result<(), String> {
        if self.at_end() {
            Ok(())
        } else {
            Err(format!("unexpected {:?}", self.rest().trim()))
        }
    }

    /// Letters, digits, `_`, `.`, `-`, `+`, `:` (words, numbers, `f32:0.0`).
    fn token(&mut self) -> String {
        self.spaces();
        let r = self.rest();
        let n = r.find(|ch: char| !(ch.is_alphanumeric() || "_.-+:".contains(ch))).unwrap_or(r.len());
        self.at += n;
        r[..n].to_string()
    }

    fn word(&mut self) -> Result<String, String> {
        self.spaces();
        let r = self.rest();
        let n = r.find(|ch: char| !(ch.is_alphanumeric() || ch == '_')).unwrap_or(r.len());
        if n == 0 {
            return Err(format!("expected a name at {r:?}"));
        }
        self.at += n;
        Ok(r[..n].to_string())
    }

    fn int(&mut self) -> Result<i64, String> {
        let t = self.token();
        t.parse().map_err(|_| format!("expected an integer, found {t:?}"))
    }

    /// `[a, b, c]` as the item texts.
    fn list(&mut self) -> Result<Vec<String>, String> {
        self.expect("[")?;
        let r = self.rest();
        let close = r.find(']').ok_or("a list without `]`")?;
        self.at += close + 1;
        Ok(r[..close].split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect())
    }

    /// A string as Rust's `{:?}` writes it.
    fn quoted(&mut self) -> Result<String, String> {
        self.spaces();
        if !self.eat("\"") {
            return Err(format!("expected a quoted string at {:?}", self.rest()));
        }
        let mut out = String::new();
        let mut chars = self.rest().char_indices();
        while let Some((i, ch)) = chars.next() {
            match ch {
                '"' => {
                    self.at += i + 1;
                    return Ok(out);
                }
                '\\' => match chars.next().map(|x| x.1) {
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some('r') => out.push('\r'),
                    Some('0') => out.push('\0'),
                    Some('u') => {
                        let hex: String = chars.by_ref().map(|x| x.1).skip_while(|&c| c == '{').take_while(|&c| c != '}').collect();
                        let ch = u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32).ok_or("a bad \\u{...} escape")?;
                        out.push(ch);
                    }
                    Some(other) => out.push(other),
                    None => break,
                },
                other => out.push(other),
            }
        }
        Err("an unterminated string".into())
    }

    fn digits(&mut self) -> Option<u32> {
        let r = self.rest();
        let n = r.find(|ch: char| !ch.is_ascii_digit()).unwrap_or(r.len());
        self.at += n;
        r[..n].parse().ok()
    }

    fn value_id(&mut self) -> Result<u32, String> {
        self.spaces();
        let at = self.rest();
        if !self.eat("%v") {
            return Err(format!("expected a value id `%vN` at {at:?}"));
        }
        self.digits().ok_or_else(|| format!("expected a value id `%vN` at {at:?}"))
    }

    fn node_id(&mut self) -> Result<u32, String> {
        self.spaces();
        let at = self.rest();
        if !self.eat("n") {
            return Err(format!("expected a node id `nN` at {at:?}"));
        }
        self.digits().ok_or_else(|| format!("expected a node id `nN` at {at:?}"))
    }

    /// `f32[N,32,4N]`.
    fn tensor_type(&mut self) -> Result<TensorType, String> {
        let name = self.word()?;
        let dtype = DType::from_name(&name).ok_or_else(|| format!("unknown element type {name:?}"))?;
        let dims = self.list()?;
        let shape = dims
            .iter()
            .map(|d| match d.strip_suffix('N') {
                Some("") => Ok(Dim::Batch(1)),
                Some(k) => k.parse().map(Dim::Batch).map_err(|_| format!("bad extent {d:?}")),
                None => d.parse().map(Dim::Fixed).map_err(|_| format!("bad extent {d:?}")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(TensorType::new(dtype, Shape(shape)))
    }
}
