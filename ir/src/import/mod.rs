//! ONNX to [`Graph`]: parse, validate domains/opsets/ops, convert nodes, infer shapes,
//! fold shape subgraphs, fuse spelled-out GELUs and attention ([`crate::fuse`]), compact and verify.

pub(crate) mod attrs;
mod batch_rewrite;
pub mod biases;
mod control;
mod dense_select;
mod dense_split;
mod detached;
mod fx;
mod node_proto;
mod evaluated;
pub mod images;
mod legacy;
mod padding;
mod provenance;
pub mod merged;
mod sinusoids;
pub mod tensor;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use onnx_protobuf::{Message, ModelProto, NodeProto, TensorProto, ValueInfoProto};
use pipewright_ops::dtype::onnx_type_name;
use pipewright_ops::onnx::AttrSource;
use pipewright_ops::onnx::{spec_in, MAX_KNOWN_OPSET};

use crate::dim::{Dim, Shape, TensorType};
use crate::error::{ImportError, ModelError, NodeRef};
use crate::infer::{infer, Ctx, In};
use crate::known::{evaluate, Known};
use crate::{BatchInfo, DType, Graph, ModelMeta, ValueDef, ValueId, Weight};

/// How the batch dimension is chosen: `Auto` makes a named (`dim_param`) axis 0, or a
/// fixed axis 0 shared by every input, the symbol `N`; `Fixed` keeps every extent.
pub use attrs::attribute_proto;
pub use pipewright_core::BatchMode;

/// Options of [`import_model`].
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    pub batch: BatchMode,
    /// Graph inputs replaced by these constants (by input name): for tests whose shape
    /// parameters (axes, target shapes, pads) are fed as inputs.
    pub frozen_inputs: HashMap<String, crate::TensorData>,
    /// Graph inputs frozen only where every node reading them takes them as a parameter
    /// that fixes a shape (Resize's roi and scales, Upsample's scales, the inputs of the
    /// ops computed at import: NonZero, Unique, NonMaxSuppression); anywhere else they
    /// stay inputs, as data. Named for the small float tensors that are most of them.
    pub float_parameters: HashMap<String, crate::TensorData>,
    /// Leave the values of large external-data weights in their file (never opened): the
    /// weights keep their type and extents ([`crate::TensorData::shape_only`]). For
    /// `plan` and `simulate`, which need shapes only, so a 3.8-billion-parameter model
    /// plans without its 15 GB of weights, or without the file at all.
    pub shapes_only: bool,
    /// Give each node reading an exporter-merged initializer its own copy
    /// ([`merged::untie_merged`]) instead of training one tied weight.
    pub untie_merged: bool,
    /// Initializers baked for the export batch to train as one slice shared by the batch
    /// ([`merged::train_batch_baked`]) instead of keeping them frozen.
    pub train_batch_baked: Vec<String>,
    /// Keep initializers the exporter folded from a parameter expanded to the export batch
    /// ([`provenance::expanded_parameters`]) as batch-baked constants instead of training
    /// them as that parameter: `export`'s view of the source, into which the trained slice
    /// goes back repeated over the export batch, as the source holds it.
    pub expanded_parameters_baked: bool,
    /// Keep the patterns fusion rewrites ([`crate::fuse`]) node by node, as exported: for
    /// `export`, which reads the importer's view of every source node by its name.
    pub unfused: bool,
    /// Keep training the one-element initializers read only as attention scales (the
    /// attention then stays spelled out) instead of folding their value into the fused
    /// `Attention` ([`crate::fuse::attention::FusedAttention::frozen_scales`]).
    pub train_attention_scales: bool,
    /// Initializers kept frozen on request (`compile --freeze`).
    pub freeze: Vec<String>,
    /// Sinusoidal position tables to train all the same (`compile --train-sinusoidal`),
    /// which [`sinusoids`] would keep frozen.
    pub train_sinusoidal: Vec<String>,
    /// Train the model as exported where its exporter dropped all-zero biases
    /// (`compile --no-restore-biases`), instead of restoring them ([`biases`]).
    pub no_restore_biases: bool,
}

impl ImportOptions {
    /// Freezes the named tensors that look like shape parameters fed as inputs (integer
    /// tensors of at most 64 elements, and scalars): axes, target shapes, pads, Range
    /// bounds. A compiler for static shapes needs their values; data stays an input.
    /// Float tensors of at most 64 elements, and larger ones of at most
    /// [`crate::known::KNOWN_LIMIT`] (a condition, the data of NonZero or Unique), become
    /// [`ImportOptions::float_parameters`]: frozen only where every reader fixes a shape.
    pub fn freeze_shape_inputs<'a>(&mut self, tensors: impl IntoIterator<Item = (&'a str, &'a crate::TensorData)>) {
        for (name, t) in tensors {
            if !name.is_empty() && (t.numel() <= 1 || (!t.dtype.is_float() && t.numel() <= 64)) {
                self.frozen_inputs.insert(name.to_string(), t.clone());
            } else if !name.is_empty() && t.numel() <= crate::known::KNOWN_LIMIT {
                self.float_parameters.insert(name.to_string(), t.clone());
            }
        }
    }
}

/// Reads a serialized `TensorProto` file (the backend suite's `input_K.pb`): the name it
/// stores (may be empty) and its contents.
pub fn read_tensor_file(path: &Path) -> Result<(String, crate::TensorData), ModelError> {
    let wrap = |error| ModelError { path: path.to_path_buf(), error };
    let bytes = std::fs::read(path).map_err(|e| wrap(ImportError::Io(e)))?;
    let t = onnx_protobuf::TensorProto::parse_from_bytes(&bytes).map_err(|e| wrap(ImportError::NotOnnx(e.to_string())))?;
    let name = t.name.clone();
    let dir = path.parent().unwrap_or(Path::new("."));
    Ok((name, tensor::tensor_from_proto(t, dir).map_err(wrap)?))
}

/// Imports an ONNX file. External data is read relative to the file's folder.
///
/// The file is parsed as it is read (not read whole first), so importing needs memory
/// for one copy of the weights, not two.
pub fn import_model(path: &Path, opts: &ImportOptions) -> Result<Graph, ModelError> {
    let wrap = |error| ModelError { path: path.to_path_buf(), error };
    let file = std::fs::File::open(path).map_err(|e| wrap(ImportError::Io(e)))?;
    let mut reader = HashingReader { inner: std::io::BufReader::with_capacity(1 << 20, file), hash: crc32fast::Hasher::new(), len: 0, error: None };
    let parsed = ModelProto::parse_from_reader(&mut reader);
    if let Some(e) = reader.error.take() {
        return Err(wrap(ImportError::Io(e)));
    }
    let model = check_model(reader.len, parsed).map_err(wrap)?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut graph = Importer::new(dir, opts).run(model).map_err(wrap)?;
    graph.meta.source_crc32 = reader.hash.finalize();
    Ok(graph)
}

/// Reads through, keeping the CRC-32 and the length of what was read, and the I/O error
/// that stopped it (the parser's own error does not carry it).
struct HashingReader<R> {
    inner: R,
    hash: crc32fast::Hasher,
    len: u64,
    error: Option<std::io::Error>,
}

impl<R: std::io::Read> std::io::Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf).inspect_err(|e| self.error = Some(std::io::Error::new(e.kind(), e.to_string())))?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
}

/// The CRC-32 a model file is identified by (`ModelMeta::source_crc32`).
pub fn content_crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// Imports a serialized model; `model_dir` is where external data files live.
pub fn import_bytes(bytes: &[u8], model_dir: &Path, opts: &ImportOptions) -> Result<Graph, ImportError> {
    let model = check_model(bytes.len() as u64, ModelProto::parse_from_bytes(bytes))?;
    let mut graph = Importer::new(model_dir, opts).run(model)?;
    graph.meta.source_crc32 = content_crc32(bytes);
    Ok(graph)
}

/// Classifies a parse of `len` bytes: empty, truncated, not ONNX, or a model this
/// importer can take.
fn check_model(len: u64, parsed: protobuf::Result<ModelProto>) -> Result<ModelProto, ImportError> {
    if len == 0 {
        return Err(ImportError::Empty);
    }
    let model = parsed.map_err(|e| {
        let msg = e.to_string();
        if msg.contains("EOF") || msg.contains("end of file") || msg.contains("truncated") {
            ImportError::Truncated(msg)
        } else {
            ImportError::NotOnnx(msg)
        }
    })?;
    if model.ir_version == 0 {
        return Err(ImportError::NotAModel("it declares no IR version"));
    }
    if model.graph.is_none() {
        return Err(ImportError::NotAModel("it has no graph"));
    }
    if !(3..=14).contains(&model.ir_version) {
        return Err(ImportError::IrVersion(model.ir_version));
    }
    Ok(model)
}

struct Importer<'a> {
    dir: &'a Path,
    opts: &'a ImportOptions,
    graph: Graph,
    names: HashMap<String, ValueId>,
    known: Vec<Option<Known>>,
    /// Sequence and optional values by name: resolved at import, never reaching the
    /// runtime (see [`control`]).
    composites: HashMap<String, control::Composite>,
    /// A Scan walks a graph input along axis 0: that axis is unrolled, so it cannot be
    /// the symbolic batch (every extent stays as exported).
    scans_axis0: bool,
    /// Names read as a layer's own parameter ([`layer_weights_read`]).
    layer_weights: std::collections::HashSet<String>,
    /// Names whose last extent a layer contracts against its weight ([`contraction_widths_read`]).
    contraction_widths: HashMap<String, i64>,
    /// Values whose leading extent holds the batch as the inner factor after this many
    /// outer rows (`[seq * batch, features]`), by name: a symbolic extent `seq·N` does not
    /// say where its batch sits, and the Reshape that splits it again needs to know.
    batch_rows: HashMap<String, i64>,
    /// Values unknown at import only because their shape holds the batch, whose every
    /// element is this one number ([`crate::known::fill_through`]).
    fills: HashMap<ValueId, f64>,
    /// Node outputs computed from trainable weights: never folded, known or not.
    from_weights: std::collections::HashSet<ValueId>,
    /// What the dense reading of data-dependent `NonZero`s reaches ([`dense_select`]).
    dense: dense_select::DenseSelect,
    /// What the dense reading of `Split`s at run-time sizes reaches ([`dense_split`]).
    dense_split: dense_split::DenseSplit,
    /// The nodes [`detached::stop_detached_reads`] added, imported as `StopGradient`.
    stop_gradients: std::collections::HashSet<String>,
    opsets: Opsets,
    ctx: Ctx,
}

impl<'a> Importer<'a> {
    fn new(dir: &'a Path, opts: &'a ImportOptions) -> Importer<'a> {
        Importer { dir, opts, graph: Graph::default(), names: HashMap::new(), known: Vec::new(), composites: HashMap::new(), scans_axis0: false, layer_weights: Default::default(), contraction_widths: HashMap::new(), batch_rows: HashMap::new(), fills: HashMap::new(), from_weights: Default::default(), dense: Default::default(), dense_split: Default::default(), stop_gradients: Default::default(), opsets: Opsets::default(), ctx: Ctx::default() }
    }

    fn run(mut self, mut model: ModelProto) -> Result<Graph, ImportError> {
        let opsets = Opsets::of(&model)?;
        // A model of other domains only (training or ML ops) has no default opset; its
        // graph is recorded at the newest one.
        let opset = opsets.default.unwrap_or(MAX_KNOWN_OPSET);
        let mut g = model.graph.take().expect("checked by parse");
        self.graph.meta = ModelMeta {
            producer_name: model.producer_name.clone(),
            producer_version: model.producer_version.clone(),
            ir_version: model.ir_version,
            opset,
            graph_name: g.name.clone(),
            source_crc32: 0,
        };
        name_nodes(&mut g.node);
        check_ops(&g.node, &opsets)?;
        self.opsets = opsets;
        // Two initializers (or two graph inputs) of one name: the ONNX checker rejects the
        // model, and taking either copy silently would run different weights.
        let mut seen = std::collections::HashSet::new();
        for name in g.initializer.iter().map(|t| &t.name) {
            if !seen.insert(name) {
                return Err(ImportError::DuplicateValue { value: name.clone(), first: "an initializer".into(), second: "another initializer".into() });
            }
        }
        let mut seen = std::collections::HashSet::new();
        for name in g.input.iter().map(|i| &i.name) {
            if !seen.insert(name) {
                return Err(ImportError::DuplicateValue { value: name.clone(), first: "a graph input".into(), second: "another graph input".into() });
            }
        }
        // First, on the graph as exported (`export` rewrites the same source): the biases
        // the exporter's optimizer dropped, back as zeros.
        if !self.opts.no_restore_biases {
            self.graph.choices.restored_biases = biases::restore_dropped_biases(&mut g);
        }
        // The detaches the exporter's optimizer dropped, back in front of their readers.
        let detached = detached::stop_detached_reads(&mut g);
        self.stop_gradients = detached.nodes;
        self.graph.choices.detached_reads = detached.reads;
        self.graph.choices.unplaced_detaches = detached.unplaced;
        // Embedding rows PyTorch keeps from training (a padding index), the same way.
        let padding = padding::stop_padding_rows(&mut g.node, &mut g.initializer, opset);
        self.stop_gradients.extend(padding.stops);
        self.graph.choices.padding_rows = padding.lookups;
        // A tied weight the exporter also stored permuted is read through a Transpose of it
        // again, so the tie trains as one weight (weights left unread have nothing to compare).
        if !self.opts.shapes_only {
            self.graph.choices.retied = images::retie(&mut g, self.dir)?;
        }
        // Merged initializers are found (and untied on request) before anything reads the
        // initializers, so the copies import like any other weight; BatchNorm buffers
        // shared with weights or other BatchNorms are split first, whatever is asked.
        self.graph.choices.split_buffers = merged::split_buffers(&mut g);
        // Reads of a merged parameter by modules that hold none (a LayerNorm without
        // affine weights) get a frozen copy, whatever is asked.
        self.graph.choices.weightless_reads = merged::split_weightless_reads(&mut g, self.dir);
        let weightless = self.graph.choices.weightless_reads.clone();
        let merged = if self.opts.untie_merged { merged::untie_merged(&mut g, self.dir) } else { merged::merged_initializers(&g, self.dir) };
        self.graph.choices.untied = self.opts.untie_merged && !merged.is_empty();
        self.graph.choices.merged = merged;
        // After the rewrites: restored biases and copies untied by parameter hold their names.
        // The parameters of BatchNorms fused into convolutions are missing for that reason.
        let fused = provenance::fused_batchnorms(&g);
        self.graph.choices.missing_parameters =
            provenance::parameters_not_in_graph(&g).into_iter().filter(|p| !fused.iter().any(|m| provenance::is_state_of(p, m))).collect();
        self.graph.choices.fused_batchnorms = fused;
        self.graph.choices.script_fused_batchnorms = provenance::script_fused_batchnorms(&g);
        let initializer_names: std::collections::HashSet<String> = g.initializer.iter().map(|t| t.name.clone()).collect();
        let params = float_parameters_read(&g.node, &self.opts.float_parameters);
        self.layer_weights = layer_weights_read(&g.node);
        self.contraction_widths = contraction_widths_read(&g.node, &g.initializer);
        self.scans_axis0 = control::scans_inputs_along_axis0(&g.node, &g.input, opset);
        self.add_inputs(&g.input, &initializer_names, &params)?;
        // The export batch is known from here on.
        let batch_source = self.batch_source();
        let export_batch = self.ctx.export_batch.unwrap_or(1);
        for name in &self.opts.train_batch_baked {
            merged::train_batch_baked(&mut g, name, export_batch, self.dir, batch_source.as_deref(), false)
                .map_err(|reason| ImportError::BadTensor { name: name.clone(), reason: format!("--train-batch-baked: {reason}") })?;
            let dims = g.initializer.iter().find(|t| &t.name == name).map(|t| t.dims.clone()).unwrap_or_default();
            self.graph.choices.trained_batch_baked.push(format!("{name} {dims:?}"));
        }
        // A parameter the exporter expanded to the export batch and folded trains as the
        // parameter by default; one whose slices differ is no such expansion and stays as
        // it was (a batch-baked constant, kept frozen).
        let mut expanded: Vec<(String, provenance::BakedParameter)> = match self.opts.expanded_parameters_baked {
            true => Vec::new(),
            false => provenance::expanded_parameters(&g).into_iter().filter(|(name, _)| !self.opts.train_batch_baked.contains(name)).collect(),
        };
        expanded.sort_by(|a, b| a.0.cmp(&b.0));
        let mut slices_of_parameters = std::collections::HashSet::new();
        for (name, baked) in expanded {
            if merged::train_batch_baked(&mut g, &name, export_batch, self.dir, batch_source.as_deref(), baked.lookup).is_ok() {
                slices_of_parameters.insert(name.clone());
                let dims = g.initializer.iter().find(|t| t.name == name).map(|t| t.dims.clone()).unwrap_or_default();
                let how = if baked.lookup { "looked up" } else { "expanded" };
                self.graph.choices.trained_batch_baked.push(format!("{name} {dims:?} (the parameter {} {how})", baked.parameter));
            }
        }
        // BatchNorm running statistics follow the batches; the optimizer never trains them.
        let buffers = merged::bn_buffers(&g);
        let exporter_constants = provenance::exporter_constants(&g);
        let named_buffers = provenance::buffers_by_name(&g);
        let script_computed = provenance::script_computed_constants(&g);
        let mut computed = provenance::computed_from_parameters(&g);
        // (An expanded parameter's slice is that parameter: it trains as the source's.)
        computed.retain(|name, _| !slices_of_parameters.contains(name));
        // A float initializer only ever read as a Resize's scales decides shapes: a
        // constant, known at import (a weight would be read back from the device each step).
        let shape_parameters = read_only_where(&g.node, is_resize_parameter);
        let mut frozen_on_request = std::collections::HashSet::new();
        let mut trained_tables = std::collections::HashSet::new();
        for t in std::mem::take(&mut g.initializer) {
            let name = t.name.clone();
            let data = match self.opts.shapes_only.then(|| tensor::external_shape_only(&t)).flatten() {
                Some(shape_only) => shape_only?,
                None => tensor::tensor_from_proto(t, self.dir)?,
            };
            let parameter_like = data.dtype.is_float() && !data.dims.is_empty();
            let trainable = parameter_like
                && !buffers.contains(&name)
                && !weightless.contains(&name)
                && !shape_parameters.contains(&name)
                && !self.is_exporter_constant(&name, &data, &exporter_constants)
                && !self.is_named_buffer(&name, &data, &named_buffers)
                && !self.is_batch_baked(&name, &data)
                && !self.is_sinusoidal_table(&name, &data, &mut trained_tables);
            let frozen = parameter_like && self.opts.freeze.contains(&name);
            if frozen {
                self.graph.choices.frozen_on_request.push(format!("{name} {:?}", data.dims));
                frozen_on_request.insert(name.clone());
            }
            let trainable = trainable && !frozen;
            if let Some(sources) = computed.get(&name).filter(|_| trainable) {
                self.graph.choices.computed_from_parameters.push(format!("{name} ({sources})"));
            }
            if trainable && script_computed.contains(&name) {
                self.graph.choices.script_computed_constants.push(format!("{name} {:?}", data.dims));
            }
            self.define(name, TensorType::new(data.dtype, Shape::fixed(&data.dims)), ValueDef::Weight(Weight { data, trainable }));
        }
        if let Some(name) = self.opts.train_sinusoidal.iter().find(|n| !trained_tables.contains(*n)) {
            return Err(ImportError::BadTensor { name: name.clone(), reason: "--train-sinusoidal: the model has no sinusoidal position table of this name (compile's note lists those it keeps frozen)".into() });
        }
        if let Some(name) = self.opts.freeze.iter().find(|n| !frozen_on_request.contains(*n)) {
            return Err(ImportError::BadTensor { name: name.clone(), reason: "--freeze: the model has no float initializer of this name (`pipewright inspect MODEL --ir` lists its weights)".into() });
        }
        for idx in topo_sort(&g.node, &self.names)? {
            self.add_node(&g.node[idx], opset)?;
        }
        let outputs = g
            .output
            .iter()
            .map(|o| match (self.names.get(&o.name), self.composites.get(&o.name)) {
                (Some(&v), _) => Ok(v),
                (None, Some(c)) => Err(ImportError::BadTensor {
                    name: o.name.clone(),
                    reason: format!("is {}: graph outputs of sequence or optional type are not supported", c.describe()),
                }),
                (None, None) => Err(ImportError::UndefinedOutput(o.name.clone())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.check_dense_outputs(&outputs)?;
        self.check_dense_split_outputs(&outputs)?;
        self.graph.set_outputs(outputs);
        self.check_declared_types(g.output.iter().chain(&g.value_info));
        if !self.opts.unfused {
            // Shape arithmetic left without a reader must not count as a reader.
            self.graph.remove_dead_nodes();
            crate::fuse::fuse_gelu(&mut self.graph);
            let fused = crate::fuse::fuse_attention(&mut self.graph, !self.opts.train_attention_scales);
            for w in fused.frozen_scales {
                let v = self.graph.value(w);
                let name = v.name.clone();
                self.graph.choices.frozen_attention_scales.push(format!("{name} {}", v.ty.shape));
                // No longer a tied weight. (Untied, the list stays whole: it is what
                // `export` repeats on the source, one copy per use, frozen or not.)
                if !self.graph.choices.untied {
                    self.graph.choices.merged.retain(|m| m.name != name);
                }
            }
        }
        self.graph.remove_dead_nodes();
        self.graph
            .compact()
            .map_err(|n| ImportError::Cycle(vec![self.graph.node(n).name.clone()]))?;
        crate::verify::verify(&self.graph).map_err(|errs| {
            ImportError::Verify(errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))
        })?;
        Ok(self.graph)
    }

    fn define(&mut self, name: String, ty: TensorType, def: ValueDef) -> ValueId {
        let known = match &def {
            ValueDef::Weight(w) => Known::from_tensor(&w.data),
            _ => None,
        };
        let id = self.graph.add_value(crate::Value { name: name.clone(), ty, def });
        self.names.insert(name, id);
        self.set_known(id, known);
        id
    }

    /// A float initializer of rank >= 3 whose leading extent is the export batch is an
    /// activation the exporter evaluated for that batch (attention masks, an expanded
    /// class token), not a parameter: it is kept as a constant, with a warning.
    ///
    /// A tensor some node reads as a layer's own parameter (a convolution's kernel, a
    /// recurrent layer's weights, a normalization's scale) is a parameter whatever its
    /// leading extent: a conv with as many output channels as the export batch is not
    /// batch-baked.
    fn is_batch_baked(&mut self, name: &str, data: &crate::TensorData) -> bool {
        let baked = data.dims.len() >= 3
            && self.ctx.export_batch.is_some_and(|b| b > 1 && data.dims[0] == b)
            && !self.layer_weights.contains(name);
        if baked {
            self.graph.choices.frozen_batch_baked.push(format!("{name} {:?}", data.dims));
            self.graph.warnings.push(format!(
                "initializer {name:?} {:?} has the export batch as its leading extent; kept as a constant, not trained",
                data.dims
            ));
        }
        baked
    }

    /// A sinusoidal position table ([`sinusoids`]) is kept as a constant, as PyTorch keeps
    /// it, unless `--train-sinusoidal` names it (then it joins `trained`).
    fn is_sinusoidal_table(&mut self, name: &str, data: &crate::TensorData, trained: &mut std::collections::HashSet<String>) -> bool {
        if !sinusoids::is_sinusoidal_table(data) {
            return false;
        }
        let entry = format!("{name} {:?}", data.dims);
        if self.opts.train_sinusoidal.iter().any(|n| n == name) {
            self.graph.choices.trained_sinusoidal.push(entry);
            trained.insert(name.to_string());
            return false;
        }
        self.graph.choices.frozen_sinusoidal.push(entry);
        true
    }

    /// A float initializer its exporter marks as no parameter ([`provenance`]) is kept as
    /// a constant, with a warning.
    fn is_exporter_constant(&mut self, name: &str, data: &crate::TensorData, constants: &HashMap<String, String>) -> bool {
        let Some(why) = constants.get(name) else { return false };
        self.graph.warnings.push(format!("initializer {name:?}: {why}; kept as a constant, not trained"));
        self.graph.choices.exporter_constants.push(format!("{name} {:?}", data.dims));
        true
    }

    /// A float initializer of an export without a signature that carries a buffer's name
    /// ([`provenance::buffers_by_name`]) is kept as a constant, as PyTorch keeps buffers.
    fn is_named_buffer(&mut self, name: &str, data: &crate::TensorData, buffers: &std::collections::HashSet<String>) -> bool {
        if !buffers.contains(name) {
            return false;
        }
        self.graph.choices.named_buffers.push(format!("{name} {:?}", data.dims));
        true
    }

    fn set_known(&mut self, id: ValueId, k: Option<Known>) {
        if self.known.len() <= id.index() {
            self.known.resize(id.index() + 1, None);
        }
        self.known[id.index()] = k;
    }

    fn add_inputs(
        &mut self,
        inputs: &[ValueInfoProto],
        initializers: &std::collections::HashSet<String>,
        params: &HashMap<String, crate::TensorData>,
    ) -> Result<(), ImportError> {
        let frozen: HashMap<&String, &crate::TensorData> = self.opts.frozen_inputs.iter().chain(params).collect();
        for (name, data) in &frozen {
            if inputs.iter().any(|i| &i.name == *name) && !initializers.contains(*name) {
                let ty = TensorType::new(data.dtype, Shape::fixed(&data.dims));
                self.define((*name).clone(), ty, ValueDef::Weight(Weight { data: (*data).clone(), trainable: false }));
            }
        }
        let feeds: Vec<&ValueInfoProto> =
            inputs.iter().filter(|i| !initializers.contains(&i.name) && !frozen.contains_key(&i.name)).collect();
        let mut typed = Vec::with_capacity(feeds.len());
        for vi in &feeds {
            typed.push(declared_type(vi)?);
        }
        let batch = match self.opts.batch {
            BatchMode::Fixed => None,
            BatchMode::Auto if self.scans_axis0 => None,
            BatchMode::Auto => detect_batch(&typed),
        };
        if let Some((name, size)) = &batch {
            self.graph.batch = Some(BatchInfo { name: name.clone(), export_size: *size });
            self.ctx.export_batch = *size;
        }
        for (vi, (dtype, dims)) in feeds.iter().zip(typed) {
            let shape = dims
                .iter()
                .enumerate()
                .map(|(axis, d)| match d {
                    DeclaredDim::Fixed(v) if axis == 0 && batch.as_ref().is_some_and(|b| b.1 == Some(*v)) => Ok(Dim::N),
                    DeclaredDim::Fixed(v) => Ok(Dim::Fixed(*v)),
                    DeclaredDim::Param(p) if axis == 0 && batch.as_ref().is_some_and(|b| &b.0 == p) => Ok(Dim::N),
                    DeclaredDim::Param(p) => Err(ImportError::BadTensor { name: vi.name.clone(), reason: symbolic_axis(axis, p, self.opts.batch) }),
                    DeclaredDim::Unknown => Err(ImportError::BadTensor {
                        name: vi.name.clone(),
                        reason: format!("axis {axis} has no extent; graph inputs need static shapes except the batch axis"),
                    }),
                })
                .collect::<Result<Vec<_>, _>>()?;
            // Shape arithmetic (Flatten, Reshape) multiplies extents: refuse sizes that overflow.
            let ty = TensorType::new(dtype, Shape(shape));
            if byte_size(&ty, self.ctx.export_batch.unwrap_or(1)).is_none() {
                return Err(ImportError::BadTensor { name: vi.name.clone(), reason: format!("{ty} is too large (its byte size overflows 64 bits)") });
            }
            self.define(vi.name.clone(), ty, ValueDef::Input);
        }
        Ok(())
    }

    fn add_node(&mut self, node: &NodeProto, opset: i64) -> Result<(), ImportError> {
        if self.reads_nonzero_densely(node) {
            return self.add_dense_nonzero(node, opset);
        }
        if self.splits_densely(node) {
            return self.add_dense_split(node, opset);
        }
        if self.add_split_part_reader(node, opset)? {
            return Ok(());
        }
        if self.add_dense_reader(node, opset)? {
            return Ok(());
        }
        self.add_node_plain(node, opset)
    }

    /// Imports `node` as written (or as a rewrite reads it), without regard to what a
    /// dense `NonZero` reaches.
    fn add_node_plain(&mut self, node: &NodeProto, opset: i64) -> Result<(), ImportError> {
        let nref = || NodeRef { name: node.name.clone(), op_type: node.op_type.clone() };
        let bad = |reason: String| ImportError::BadNode { node: nref(), reason };
        if node.op_type == "Constant" {
            let data = constant_value(node, self.dir).map_err(bad)?;
            let out = node.output.first().ok_or_else(|| bad("has no output".into()))?;
            self.define(out.clone(), TensorType::new(data.dtype, Shape::fixed(&data.dims)), ValueDef::Weight(Weight { data, trainable: false }));
            return Ok(());
        }
        let spec = spec_in(&node.domain, &node.op_type).expect("checked by check_ops");
        let domain_opset = if spec.domain.is_empty() { opset } else { self.opsets.of_domain(spec.domain).expect("checked by check_ops") };
        let version = spec.version_at(domain_opset).expect("checked by check_ops");
        let (imin, imax) = spec.inputs;
        let (omin, omax) = spec.outputs;
        if node.input.len() < imin || node.input.len() > imax {
            return Err(bad(format!("has {} inputs; {} takes {}", node.input.len(), node.op_type, arity(imin, imax))));
        }
        if node.output.len() < omin || node.output.len() > omax {
            return Err(bad(format!("has {} outputs; {} gives {}", node.output.len(), node.op_type, arity(omin, omax))));
        }
        if evaluated::is_evaluated(&node.op_type) {
            return self.add_evaluated(node);
        }
        if node.op_type == "Compress" {
            return self.add_compress(node, opset);
        }
        if control::is_resolved_at_import(&node.op_type) {
            return self.add_control(node, version, opset);
        }
        if let Some(aligned) = self.align_second_input(node, version, opset)? {
            return self.add_node(&aligned, opset);
        }
        if let Some(rewrite) = self.batch_rewrite(node) {
            for replacement in self.apply_batch_rewrite(rewrite) {
                self.add_node(&replacement, opset)?;
            }
            return Ok(());
        }
        let op = if self.stop_gradients.contains(&node.name) || detached::is_detach(node) {
            crate::Op::StopGradient
        } else {
            attrs::convert_node(node, version).map_err(bad)?
        };
        let inputs = node.input.iter().map(|n| self.tensor_input(n, node)).collect::<Result<Vec<_>, _>>()?;
        self.add_op(&node.name, &node.op_type, op, inputs, &node.output)
    }

    /// The tensor value named `name` read by `node` (`None` for an omitted optional
    /// input); a sequence or optional value there is an error, as only the ops resolved
    /// at import take them.
    fn tensor_input(&self, name: &str, node: &NodeProto) -> Result<Option<ValueId>, ImportError> {
        if name.is_empty() {
            return Ok(None);
        }
        match (self.names.get(name), self.composites.get(name)) {
            (Some(&v), _) => Ok(Some(v)),
            (None, Some(c)) => Err(ImportError::BadNode {
                node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() },
                reason: format!("input {name:?} is {}; only sequence and optional ops take it (a tensor is needed)", c.describe()),
            }),
            (None, None) => Err(ImportError::UndefinedInput {
                node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() },
                input: name.to_string(),
            }),
        }
    }

    /// Where value `v`, unknown at import, stopped being known: the nearest node computing
    /// it from known inputs (an op the importer does not evaluate), or the model input
    /// whose values it reads; with what to do. `None` for a known value.
    fn unknown_origin(&self, v: ValueId) -> Option<String> {
        let known = |v: ValueId| self.known.get(v.index()).is_some_and(|k| k.is_some());
        let (mut stack, mut seen) = (vec![v], std::collections::HashSet::new());
        while let Some(v) = stack.pop() {
            if known(v) || !seen.insert(v) {
                continue;
            }
            match &self.graph.value(v).def {
                ValueDef::Input => {
                    return Some(format!(
                        "it is computed from the values of model input {:?}, which exist only at run time; the shape must come from constants or from input shapes",
                        self.graph.value(v).name
                    ))
                }
                ValueDef::Weight(_) => continue,
                ValueDef::Node { node, .. } => {
                    let n = self.graph.node(*node);
                    let unknown: Vec<ValueId> = n.inputs.iter().flatten().copied().filter(|&i| !known(i)).collect();
                    if unknown.is_empty() {
                        return Some(format!(
                            "it stops being known at node {:?} ({}), whose result the importer does not compute from known inputs; export the model with this shape as a constant (or at a fixed batch), or report the pattern",
                            n.name,
                            n.op.name()
                        ));
                    }
                    stack.extend(unknown);
                }
            }
        }
        None
    }

    /// Adds one converted op reading `inputs` and defining `output_names` (an empty name
    /// is an unused output): infers its types, folds it when its inputs are constants.
    fn add_op(&mut self, node_name: &str, op_type: &str, op: crate::Op, inputs: Vec<Option<ValueId>>, output_names: &[String]) -> Result<(), ImportError> {
        let nref = || NodeRef { name: node_name.to_string(), op_type: op_type.to_string() };
        let types: Vec<Option<In>> = inputs
            .iter()
            .map(|v| v.map(|v| In { ty: &self.graph.value(v).ty, known: self.known.get(v.index()).and_then(|k| k.as_ref()) }))
            .collect();
        let out_types = infer(&op, &types, output_names.len(), self.ctx).map_err(|reason| {
            // Say where a needed value stopped being known, and what to do.
            // The needed input is a shape-like one: integers of rank at most 1, the last of
            // them (the data operand comes first).
            let shape_like = |v: &&ValueId| {
                let ty = &self.graph.value(**v).ty;
                matches!(ty.dtype, crate::DType::I64 | crate::DType::I32) && ty.shape.rank() <= 1
            };
            let needed = inputs.iter().flatten().filter(shape_like).rev().find_map(|&v| self.unknown_origin(v));
            let origin = reason.contains("not known at import").then_some(needed).flatten();
            ImportError::Shape { node: nref(), reason: origin.map_or(reason.clone(), |o| format!("{reason}: {o}")) }
        })?;
        let operand_types = types.iter().flatten().map(|t| t.ty.dtype).chain(out_types.iter().map(|t| t.dtype));
        if let Some(d) = operand_types.filter(|d| d.is_low_precision()).find(|_| !handles_low_precision(&op)) {
            let reason = format!("{op_type} on element type {d} is not supported (only casts and the quantization ops take the low-precision types)");
            return Err(ImportError::BadNode { node: nref(), reason });
        }
        if out_types.iter().any(|t| t.shape.0.iter().any(|d| d.fixed().is_some_and(|v| v < 0))) {
            return Err(ImportError::Shape { node: nref(), reason: "an output extent is negative".into() });
        }
        if let Some(t) = out_types.iter().find(|t| byte_size(t, self.ctx.export_batch.unwrap_or(1)).is_none()) {
            return Err(ImportError::Shape { node: nref(), reason: format!("output {t} is too large (its byte size overflows 64 bits)") });
        }
        let mut known_outs = self.evaluate_known_all(&op, &inputs, &out_types);
        let fill = self.fill_of(&op, &inputs, &out_types, &mut known_outs);
        let foldable = output_names
            .iter()
            .zip(&known_outs)
            .all(|(name, k)| name.is_empty() || k.as_ref().is_some_and(|k| k.to_tensor().is_some()))
            && inputs.iter().flatten().all(|v| self.is_constant_or_shape_source(&op, *v));
        if foldable {
            for (name, k) in output_names.iter().zip(&known_outs).filter(|(name, _)| !name.is_empty()) {
                let data = k.as_ref().and_then(|k| k.to_tensor()).expect("checked");
                let ty = TensorType::new(data.dtype, Shape::fixed(&data.dims));
                self.define(name.clone(), ty, ValueDef::Weight(Weight { data, trainable: false }));
            }
            return Ok(());
        }
        let mut inputs = inputs;
        if let (Some(out), crate::Op::Reshape { .. }) = (out_types.first(), &op) {
            self.fix_reshape_target(node_name, &mut inputs, out);
            self.note_batch_rows(&inputs, out, output_names);
        }
        let outputs = output_names
            .iter()
            .zip(out_types)
            .map(|(name, ty)| (!name.is_empty()).then(|| (name.clone(), ty)))
            .collect();
        let id = self.graph.add_node(node_name.to_string(), op, inputs, outputs);
        let outs = self.graph.node(id).outputs.clone();
        for (slot, out) in outs.iter().enumerate() {
            if let Some(v) = out {
                self.names.insert(output_names[slot].clone(), *v);
                self.set_known(*v, known_outs.get(slot).cloned().flatten());
            }
        }
        if let (Some(f), Some(Some(out))) = (fill, outs.first()) {
            self.fills.insert(*out, f);
        }
        if self.reads_weights(&self.graph.node(id).op, &self.graph.node(id).inputs) {
            self.from_weights.extend(outs.iter().flatten());
        }
        Ok(())
    }

    /// The one value every element of the op's first output holds (when its input holds
    /// one): made its known contents when the output's shape is fixed (and small), else
    /// returned to be recorded for the ops that read it.
    fn fill_of(&self, op: &crate::Op, inputs: &[Option<ValueId>], out_types: &[TensorType], known_outs: &mut [Option<Known>]) -> Option<f64> {
        let (Some(first), Some(out)) = (known_outs.first_mut(), out_types.first()) else { return None };
        if first.is_some() {
            return None;
        }
        let input = inputs.first().copied().flatten();
        let known_fill = || self.known.get(input?.index())?.as_ref()?.uniform();
        let input_fill = input.and_then(|v| self.fills.get(&v).copied()).or_else(known_fill);
        let fill = crate::known::fill_through(op, input_fill, out.dtype)?;
        let shape: Option<Vec<i64>> = out.shape.0.iter().map(|d| d.fixed()).collect();
        *first = shape.and_then(|shape| crate::known::filled_shape(out.dtype, shape, fill));
        first.is_none().then_some(fill)
    }

    /// Records a Reshape output whose leading extent merges the input's axes up to its
    /// batch axis, the batch innermost (`[seq, batch * heads, dim]` to `[seq * batch,
    /// heads * dim]`, as `nn.MultiheadAttention` views its output): the Reshape that splits
    /// those rows again finds the batch after the outer rows ([`Importer::batch_rows`]).
    fn note_batch_rows(&mut self, inputs: &[Option<ValueId>], out: &TensorType, output_names: &[String]) {
        let (Some(Some(input)), Some(name)) = (inputs.first(), output_names.first()) else { return };
        let Some(before) = batch_rewrite::rows_before_batch(self.graph.value(*input).ty.shape.dims()) else { return };
        if before > 1 && out.shape.0.first() == Some(&Dim::Batch(before)) {
            self.batch_rows.insert(name.clone(), before);
        }
    }

    /// A `Reshape` whose target is computed from the batch (TorchScript's `Shape`, `Gather`,
    /// `Concat` chains) reads a constant instead: its output's extents, -1 for the one that
    /// follows the batch. The chain is then left without a reader (the fusions need its
    /// source read by nothing else, and the stage program has no shape arithmetic to run).
    fn fix_reshape_target(&mut self, node_name: &str, inputs: &mut [Option<ValueId>], out: &TensorType) {
        let [Some(_), Some(target)] = *inputs else { return };
        let computed = !matches!(self.graph.value(target).def, ValueDef::Weight(_)) && self.known.get(target.index()).is_some_and(Option::is_some);
        let batch_extents = out.shape.0.iter().filter(|d| d.fixed().is_none()).count();
        let empty = out.shape.0.iter().any(|d| d.fixed() == Some(0));
        let name = format!("{node_name}/target");
        if !computed || batch_extents != 1 || empty || self.names.contains_key(&name) {
            return;
        }
        let extents: Vec<i64> = out.shape.0.iter().map(|d| d.fixed().unwrap_or(-1)).collect();
        let data = crate::TensorData::from_i64s(vec![extents.len() as i64], &extents);
        let ty = TensorType::new(crate::DType::I64, Shape::fixed(&[extents.len() as i64]));
        inputs[1] = Some(self.define(name, ty, ValueDef::Weight(Weight { data, trainable: false })));
    }

    /// The contents of input `slot` when known at import (a constant, a frozen graph
    /// input or a folded result); otherwise the reason, naming the node and the input.
    fn known_input(&self, node: &NodeProto, slot: usize, why: &str) -> Result<crate::TensorData, ImportError> {
        let name = &node.input[slot];
        match &self.graph.value(self.names[name]).def {
            ValueDef::Weight(w) if !w.trainable => Ok(w.data.clone()),
            _ => Err(ImportError::Shape {
                node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() },
                reason: format!("{why}, but input {slot} ({name:?}) is not known at import (it must be a constant or a frozen graph input)"),
            }),
        }
    }

    /// An op computed at import ([`evaluated`]): its outputs become constants.
    fn add_evaluated(&mut self, node: &NodeProto) -> Result<(), ImportError> {
        let why = format!("{}'s output is computed at import (its shape depends on input values)", node.op_type);
        let mut ins = Vec::with_capacity(node.input.len());
        for (slot, name) in node.input.iter().enumerate() {
            ins.push(if name.is_empty() { None } else { Some(self.known_input(node, slot, &why)?) });
        }
        let refs: Vec<Option<&crate::TensorData>> = ins.iter().map(|t| t.as_ref()).collect();
        let outs = evaluated::evaluate_node(node, &refs)
            .map_err(|reason| ImportError::BadNode { node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() }, reason })?;
        for (name, data) in node.output.iter().zip(outs) {
            if !name.is_empty() {
                let ty = TensorType::new(data.dtype, Shape::fixed(&data.dims));
                self.define(name.clone(), ty, ValueDef::Weight(Weight { data, trainable: false }));
            }
        }
        Ok(())
    }

    /// Compress with a known condition is a Gather of the selected positions along the
    /// axis (of the flattened input without an axis), which autograd differentiates.
    fn add_compress(&mut self, node: &NodeProto, opset: i64) -> Result<(), ImportError> {
        let bad = |reason: String| ImportError::BadNode { node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() }, reason };
        let mut a = attrs::Attrs::new(&node.attribute);
        let axis = a.int("axis").map_err(bad)?;
        a.finish().map_err(bad)?;
        let cond = self.known_input(node, 1, "Compress's output extent is the number of true conditions")?;
        let x = &self.graph.value(self.names[&node.input[0]]).ty.shape;
        // The condition was written for the export batch: a compressed batch axis has that
        // extent, and the output's extent is the count of true entries either way.
        let batch = self.ctx.export_batch;
        let at_export = |d: &Dim| d.fixed().or_else(|| batch.map(|b| d.eval(b)));
        let (axis, extent) = match axis {
            Some(ax) => {
                let r = x.rank() as i64;
                if !(-r..r).contains(&ax) {
                    return Err(bad(format!("axis {ax} is out of range for rank {r}")));
                }
                (Some(ax.rem_euclid(r)), at_export(&x.0[ax.rem_euclid(r) as usize]))
            }
            None => (None, x.0.iter().try_fold(1i64, |p, d| at_export(d).map(|v| p * v))),
        };
        let extent = extent.ok_or_else(|| bad("the compressed extent must be static (a batch without export size is not)".into()))?;
        let picks: Vec<i64> = cond.to_i64s().iter().enumerate().filter(|(_, &c)| c != 0).map(|(i, _)| i as i64).collect();
        if let Some(p) = picks.iter().find(|&&p| p >= extent) {
            return Err(bad(format!("condition entry {p} is true but the compressed extent is {extent}")));
        }
        let weight = |data: crate::TensorData| {
            let ty = TensorType::new(data.dtype, Shape::fixed(&data.dims));
            (ty, ValueDef::Weight(Weight { data, trainable: false }))
        };
        let indices = format!("{}/compress_indices", node.name);
        let (ty, def) = weight(crate::TensorData::from_i64s(vec![picks.len() as i64], &picks));
        self.define(indices.clone(), ty, def);
        let mut data = node.input[0].clone();
        if axis.is_none() {
            let (shape, flat) = (format!("{}/flat_shape", node.name), format!("{}/flat", node.name));
            let (ty, def) = weight(crate::TensorData::from_i64s(vec![1], &[-1]));
            self.define(shape.clone(), ty, def);
            let reshape = NodeProto { name: format!("{}/flatten", node.name), op_type: "Reshape".into(), input: vec![data, shape], output: vec![flat.clone()], ..Default::default() };
            self.add_node(&reshape, opset)?;
            data = flat;
        }
        let axis_attr = attribute_proto("axis", &pipewright_ops::op::AttrValue::Int(axis.unwrap_or(0)));
        let gather = NodeProto {
            name: node.name.clone(),
            op_type: "Gather".into(),
            input: vec![data, indices],
            output: vec![node.output[0].clone()],
            attribute: vec![axis_attr],
            ..Default::default()
        };
        self.add_node(&gather, opset)
    }

    /// Old-opset broadcasting (see [`legacy`]): when input 1 needs trailing unit axes, adds
    /// the `Unsqueeze` that inserts them and returns the node reading its result instead.
    fn align_second_input(&mut self, node: &NodeProto, version: i64, opset: i64) -> Result<Option<NodeProto>, ImportError> {
        let (Some(a), Some(b)) = (node.input.first(), node.input.get(1)) else { return Ok(None) };
        let (Some(&a), Some(&b_id)) = (self.names.get(a), self.names.get(b)) else { return Ok(None) };
        let a_rank = self.graph.value(a).ty.shape.rank();
        let b_dims: Vec<Option<i64>> = self.graph.value(b_id).ty.shape.dims().iter().map(|d| d.fixed()).collect();
        let axes = legacy::second_input_alignment(node, version, a_rank, &b_dims)
            .map_err(|reason| ImportError::BadNode { node: NodeRef { name: node.name.clone(), op_type: node.op_type.clone() }, reason })?;
        let Some(axes) = axes else { return Ok(None) };
        let aligned = format!("{b}/aligned_to/{}", node.name);
        self.add_node(&legacy::unsqueeze_node(format!("{}/align_input_1", node.name), b.clone(), aligned.clone(), axes), opset)?;
        let mut rewritten = node.clone();
        rewritten.input[1] = aligned;
        Ok(Some(rewritten))
    }

    /// The known contents of every output: the first output's by [`evaluate`]; a Split
    /// of a known vector (shape arithmetic such as splitting a size input) gives all.
    fn evaluate_known_all(&self, op: &crate::Op, inputs: &[Option<ValueId>], out_types: &[TensorType]) -> Vec<Option<Known>> {
        let mut outs = vec![None; out_types.len()];
        if let (crate::Op::Split(_), Some(Some(x))) = (op, inputs.first()) {
            let Some(k) = self.known.get(x.index()).and_then(|k| k.as_ref()) else { return outs };
            if k.shape.len() != 1 {
                return outs;
            }
            let mut start = 0usize;
            for (slot, t) in out_types.iter().enumerate() {
                let Some(len) = t.shape.0.first().and_then(|d| d.fixed()) else { return vec![None; out_types.len()] };
                let end = start + len as usize;
                let data = match &k.data {
                    crate::known::KnownData::Ints(v) if end <= v.len() => crate::known::KnownData::Ints(v[start..end].to_vec()),
                    crate::known::KnownData::Floats(v) if end <= v.len() => crate::known::KnownData::Floats(v[start..end].to_vec()),
                    _ => return vec![None; out_types.len()],
                };
                outs[slot] = Some(Known { dtype: k.dtype, shape: vec![len], data });
                start = end;
            }
            return outs;
        }
        if let Some(first) = outs.first_mut() {
            *first = self.evaluate_known(op, inputs, out_types);
        }
        outs
    }

    fn evaluate_known(&self, op: &crate::Op, inputs: &[Option<ValueId>], out_types: &[TensorType]) -> Option<Known> {
        let ks: Vec<Option<&Known>> = inputs.iter().map(|v| v.and_then(|v| self.known.get(v.index()).and_then(|k| k.as_ref()))).collect();
        let dims: Vec<Option<Vec<Dim>>> = inputs.iter().map(|v| v.map(|v| self.graph.value(v).ty.shape.0.clone())).collect();
        let out = out_types.first()?;
        let fixed_shape: Option<Vec<i64>> = out.shape.0.iter().map(|d| d.fixed()).collect();
        evaluate(op, &ks, &dims, out.dtype, fixed_shape)
    }

    /// Folding may consume constants, inputs whose static shape is all that is read, and
    /// node outputs whose contents are known without the batch (the last extent of a
    /// `Shape` whose first is `N`: an attention's head size, read as its scale); never a
    /// trainable weight, which must stay a parameter.
    ///
    /// A node output computed from a trainable weight is no constant either, though its
    /// contents are known (a Reshape of a parameter): folding it would freeze the weight
    /// (DINOv2's TorchScript export reads its patch position embeddings through a Reshape
    /// and a Transpose).
    fn is_constant_or_shape_source(&self, op: &crate::Op, v: ValueId) -> bool {
        if matches!(op, crate::Op::Shape { .. } | crate::Op::Size) {
            return true;
        }
        match &self.graph.value(v).def {
            ValueDef::Weight(w) => !w.trainable,
            ValueDef::Node { .. } => !self.from_weights.contains(&v) && self.known.get(v.index()).and_then(|k| k.as_ref()).is_some_and(|k| k.to_tensor().is_some()),
            _ => false,
        }
    }

    /// Whether an op reading `inputs` computes from a trainable weight's values.
    fn reads_weights(&self, op: &crate::Op, inputs: &[Option<ValueId>]) -> bool {
        let trainable = |v: &ValueId| matches!(&self.graph.value(*v).def, ValueDef::Weight(w) if w.trainable);
        !matches!(op, crate::Op::Shape { .. } | crate::Op::Size) && inputs.iter().flatten().any(|v| trainable(v) || self.from_weights.contains(v))
    }

    /// Compares declared `value_info`/output types with inferred ones; disagreements are
    /// kept as warnings (the exporter's declaration may predate batch symbolisation).
    fn check_declared_types<'v>(&mut self, infos: impl Iterator<Item = &'v ValueInfoProto>) {
        let n = self.ctx.export_batch.unwrap_or(1);
        for vi in infos {
            let Some(&id) = self.names.get(&vi.name) else { continue };
            let Ok((dtype, dims)) = declared_type(vi) else { continue };
            let ty = &self.graph.value(id).ty;
            let shape_differs = dims.len() == ty.shape.rank()
                && dims.iter().zip(&ty.shape.0).any(|(d, ours)| matches!(d, DeclaredDim::Fixed(v) if *v != ours.eval(n)))
                || (dims.len() != ty.shape.rank() && !dims.is_empty());
            if dtype != ty.dtype || shape_differs {
                let msg = format!("value {:?}: the model declares {dtype}{:?}, inference gives {}", vi.name, dims, ty);
                self.graph.warnings.push(msg);
            }
        }
    }
}

/// Bytes of one tensor of type `t` at batch size `n`, or `None` if that overflows `i64`.
fn byte_size(t: &TensorType, n: i64) -> Option<i64> {
    t.shape.0.iter().try_fold(t.dtype.size() as i64, |acc, d| match *d {
        Dim::Fixed(v) => acc.checked_mul(v),
        Dim::Batch(k) => acc.checked_mul(k.checked_mul(n)?),
    })
}

fn arity(min: usize, max: usize) -> String {
    match (min, max) {
        (a, b) if a == b => a.to_string(),
        (a, usize::MAX) => format!("{a} or more"),
        (a, b) => format!("{a} to {b}"),
    }
}

/// The default-domain opset, if the model imports the default domain.
fn default_opset(model: &ModelProto) -> Result<Option<i64>, ImportError> {
    let Some(v) = model.opset_import.iter().find(|o| o.domain.is_empty() || o.domain == "ai.onnx").map(|o| o.version) else {
        return if model.opset_import.is_empty() { Err(ImportError::NoDefaultOpset) } else { Ok(None) };
    };
    if !(1..=MAX_KNOWN_OPSET).contains(&v) {
        return Err(ImportError::Opset(v));
    }
    Ok(Some(v))
}

/// The opsets a model imports, by domain (the default domain as `""`).
#[derive(Debug, Default)]
struct Opsets {
    default: Option<i64>,
    others: HashMap<String, i64>,
}

impl Opsets {
    fn of(model: &ModelProto) -> Result<Opsets, ImportError> {
        let default = default_opset(model)?;
        let others = model
            .opset_import
            .iter()
            .filter(|o| !o.domain.is_empty() && o.domain != "ai.onnx")
            .map(|o| (o.domain.clone(), o.version))
            .collect();
        Ok(Opsets { default, others })
    }

    /// The opset of `domain` the model imports.
    fn of_domain(&self, domain: &str) -> Option<i64> {
        if domain.is_empty() || domain == "ai.onnx" {
            self.default
        } else {
            self.others.get(domain).copied()
        }
    }
}

/// Gives unnamed nodes a stable name (`Relu_3`) so every message can name them.
fn name_nodes(nodes: &mut [NodeProto]) {
    for (i, n) in nodes.iter_mut().enumerate() {
        if n.name.is_empty() {
            n.name = format!("{}_{i}", n.op_type);
        }
    }
}

/// Rejects foreign domains, unknown op types (all reported together) and op versions
/// whose semantics are not implemented.
/// The ops defined on float8, float4 and 4/2-bit integer operands; the runtime holds those
/// in wider types (see `pipewright_runtime`'s `lowp`), where other kernels would compute
/// in the wrong precision.
fn handles_low_precision(op: &crate::Op) -> bool {
    use crate::Op;
    matches!(op, Op::Cast { .. } | Op::CastLike { .. } | Op::QuantizeLinear(_) | Op::DequantizeLinear { .. })
}

fn check_ops(nodes: &[NodeProto], opsets: &Opsets) -> Result<(), ImportError> {
    let nref = |n: &NodeProto| NodeRef { name: n.name.clone(), op_type: n.op_type.clone() };
    // Subgraph nodes (If branches, loop bodies) are checked with the rest.
    let nodes = control::nested_nodes(nodes);
    let is_default = |n: &NodeProto| n.domain.is_empty() || n.domain == "ai.onnx";
    // Of other domains, only the ops of `DOMAIN_SPECS`, and only if the model imports them.
    let foreign: Vec<(NodeRef, String)> = nodes
        .iter()
        .filter(|n| !is_default(n) && (spec_in(&n.domain, &n.op_type).is_none() || opsets.of_domain(&n.domain).is_none()))
        .map(|n| (nref(n), n.domain.clone()))
        .collect();
    if !foreign.is_empty() {
        return Err(ImportError::Domain(foreign));
    }
    if opsets.default.is_none() && nodes.iter().any(|n| is_default(n)) {
        return Err(ImportError::NoDefaultOpset);
    }
    let mut unknown: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for n in nodes.iter().filter(|n| spec_in(&n.domain, &n.op_type).is_none()) {
        unknown.entry(n.op_type.clone()).or_default().push(n.name.clone());
    }
    if !unknown.is_empty() {
        return Err(ImportError::UnknownOps(unknown.into_iter().collect()));
    }
    for n in nodes {
        let s = spec_in(&n.domain, &n.op_type).expect("known");
        let opset = opsets.of_domain(&n.domain).expect("checked above");
        match s.version_at(opset) {
            None => return Err(ImportError::OpNotInOpset { node: nref(n), op: n.op_type.clone(), opset }),
            Some(v) if v < s.supported_from => {
                return Err(ImportError::OpVersion { node: nref(n), op: n.op_type.clone(), opset, version: v, from: s.supported_from })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Orders nodes so producers come first; reports undefined inputs, values defined twice
/// and cycles by node name.
fn topo_sort(nodes: &[NodeProto], defined: &HashMap<String, ValueId>) -> Result<Vec<usize>, ImportError> {
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            if let Some(&first) = producer.get(o.as_str()) {
                return Err(ImportError::DuplicateValue { value: o.clone(), first: nodes[first].name.clone(), second: n.name.clone() });
            }
            if defined.contains_key(o) {
                return Err(ImportError::DuplicateValue { value: o.clone(), first: "an initializer or graph input".into(), second: n.name.clone() });
            }
            producer.insert(o, i);
        }
    }
    let mut pending = vec![0usize; nodes.len()];
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        // A subgraph's outer-scope reads order the node like its inputs.
        for input in control::reads(n).iter() {
            match producer.get(input.as_str()) {
                Some(&p) => {
                    pending[i] += 1;
                    users[p].push(i);
                }
                None if defined.contains_key(input) => {}
                None => {
                    return Err(ImportError::UndefinedInput {
                        node: NodeRef { name: n.name.clone(), op_type: n.op_type.clone() },
                        input: input.to_string(),
                    })
                }
            }
        }
    }
    let mut ready: std::collections::VecDeque<usize> = (0..nodes.len()).filter(|&i| pending[i] == 0).collect();
    let mut order = Vec::with_capacity(nodes.len());
    while let Some(i) = ready.pop_front() {
        order.push(i);
        for &u in &users[i] {
            pending[u] -= 1;
            if pending[u] == 0 {
                ready.push_back(u);
            }
        }
    }
    if order.len() < nodes.len() {
        let stuck = (0..nodes.len()).filter(|&i| pending[i] > 0).map(|i| nodes[i].name.clone()).collect();
        return Err(ImportError::Cycle(stuck));
    }
    Ok(order)
}

#[derive(Clone, Debug, PartialEq)]
enum DeclaredDim {
    Fixed(i64),
    Param(String),
    Unknown,
}

fn declared_type(vi: &ValueInfoProto) -> Result<(DType, Vec<DeclaredDim>), ImportError> {
    use onnx_protobuf::tensor_shape_proto::dimension::Value as D;
    use onnx_protobuf::type_proto::Value as T;
    let bad = |reason: String| ImportError::BadTensor { name: vi.name.clone(), reason };
    let t = match vi.type_.as_ref().and_then(|t| t.value.as_ref()) {
        Some(T::TensorType(t)) => t,
        // An optional tensor input is taken as present (a compiled job always feeds it);
        // OptionalHasElement on it is true, OptionalGetElement the tensor itself.
        Some(T::OptionalType(o)) => match o.elem_type.as_ref().and_then(|t| t.value.as_ref()) {
            Some(T::TensorType(t)) => t,
            _ => return Err(bad("only optionals of tensors are supported (not of sequences or maps)".into())),
        },
        Some(_) => return Err(bad("only tensor-typed values are supported (not sequences, maps or optionals)".into())),
        None => return Err(bad("has no type".into())),
    };
    let dtype = DType::from_onnx(t.elem_type)
        .ok_or_else(|| ImportError::ValueType { name: vi.name.clone(), type_name: onnx_type_name(t.elem_type) })?;
    let dims = match t.shape.as_ref() {
        None => return Err(bad("has no shape".into())),
        Some(s) => s
            .dim
            .iter()
            .map(|d| match &d.value {
                Some(D::DimValue(v)) if *v >= 0 => DeclaredDim::Fixed(*v),
                Some(D::DimParam(p)) if !p.is_empty() => DeclaredDim::Param(p.clone()),
                _ => DeclaredDim::Unknown,
            })
            .collect(),
    };
    Ok((dtype, dims))
}

/// The batch symbol's name and export size: a shared named axis 0, or a shared fixed axis 0.
/// The candidates of [`ImportOptions::float_parameters`] that every reading node takes
/// as a shape-fixing parameter (Resize's roi and scales, Upsample's scales, the inputs
/// of NonZero, Unique and NonMaxSuppression, whose output shapes depend on their values).
fn float_parameters_read(nodes: &[NodeProto], candidates: &HashMap<String, crate::TensorData>) -> HashMap<String, crate::TensorData> {
    let is_param = |n: &NodeProto, slot: usize| {
        is_resize_parameter(n, slot)
            || match n.op_type.as_str() {
                // Ops computed at import, whose output shapes depend on these values.
                "NonZero" | "Unique" => slot == 0,
                "NonMaxSuppression" => slot < 5,
                "Compress" => slot == 1,
                _ => false,
            }
    };
    let params = read_only_where(nodes, is_param);
    candidates.iter().filter(|(name, _)| params.contains(name.as_str())).map(|(name, t)| (name.clone(), t.clone())).collect()
}

/// A Resize's (or Upsample's) scales or region of interest: values that decide a shape.
fn is_resize_parameter(n: &NodeProto, slot: usize) -> bool {
    match n.op_type.as_str() {
        "Resize" => slot == 1 || slot == 2,
        "Upsample" => slot == 1,
        _ => false,
    }
}

/// The names every node reading them reads where `is_param(node, slot)`.
fn read_only_where(nodes: &[NodeProto], is_param: impl Fn(&NodeProto, usize) -> bool) -> std::collections::HashSet<String> {
    let mut reads: HashMap<&str, bool> = HashMap::new();
    for n in nodes {
        for (slot, name) in n.input.iter().enumerate() {
            let all = reads.entry(name.as_str()).or_insert(true);
            *all &= is_param(n, slot);
        }
    }
    reads.into_iter().filter(|(_, all)| *all).map(|(name, _)| name.to_string()).collect()
}

/// The names some node reads in a layer-parameter slot: kernels and biases of
/// convolutions, weights of recurrent layers, scales and statistics of normalizations.
fn layer_weights_read(nodes: &[NodeProto]) -> std::collections::HashSet<String> {
    let is_weight = |n: &NodeProto, slot: usize| match n.op_type.as_str() {
        "Conv" | "ConvTranspose" | "ConvInteger" | "DeformConv" => slot == 1 || slot == 2,
        "QLinearConv" => slot == 3 || slot == 8,
        "RNN" | "GRU" | "LSTM" => (1..=3).contains(&slot) || slot == 7,
        "BatchNormalization" => (1..=4).contains(&slot),
        "InstanceNormalization" | "LayerNormalization" | "GroupNormalization" | "RMSNormalization" => slot == 1 || slot == 2,
        _ => false,
    };
    nodes
        .iter()
        .flat_map(|n| n.input.iter().enumerate().filter(move |&(slot, name)| !name.is_empty() && is_weight(n, slot)).map(|(_, name)| name.clone()))
        .collect()
}

/// The names a `Gemm` or `MatMul` reads as its left operand against an initializer
/// weight, with the width the weight contracts their last extent with.
fn contraction_widths_read(nodes: &[NodeProto], initializers: &[TensorProto]) -> HashMap<String, i64> {
    let dims: HashMap<&str, &[i64]> = initializers.iter().map(|t| (t.name.as_str(), t.dims.as_slice())).collect();
    let int_attr = |n: &NodeProto, name: &str| n.attribute.iter().find(|a| a.name == name).map_or(0, |a| a.i);
    let mut widths = HashMap::new();
    for n in nodes.iter().filter(|n| n.input.len() >= 2) {
        let Some(w) = dims.get(n.input[1].as_str()).filter(|d| d.len() >= 2) else { continue };
        let width = match n.op_type.as_str() {
            "Gemm" if int_attr(n, "transA") == 0 => w[usize::from(int_attr(n, "transB") != 0)],
            "MatMul" => w[w.len() - 2],
            _ => continue,
        };
        widths.insert(n.input[0].clone(), width);
    }
    widths
}

fn detect_batch(inputs: &[(DType, Vec<DeclaredDim>)]) -> Option<(String, Option<i64>)> {
    let firsts: Vec<&DeclaredDim> = inputs.iter().filter_map(|(_, d)| d.first()).collect();
    if firsts.is_empty() || firsts.len() != inputs.len() {
        return None;
    }
    match firsts[0] {
        DeclaredDim::Param(p) if firsts.iter().all(|d| *d == firsts[0]) => Some((p.clone(), None)),
        DeclaredDim::Fixed(v) if *v > 0 && firsts.iter().all(|d| *d == firsts[0]) => Some(("N".into(), Some(*v))),
        _ => None,
    }
}

/// Why an input's symbolic axis `axis` (named `p`) cannot be imported, and what to do.
fn symbolic_axis(axis: usize, p: &str, mode: BatchMode) -> String {
    match (axis, mode) {
        (0, BatchMode::Fixed) => format!(
            "axis 0 is the symbol {p:?}, but --batch fixed keeps the extents as exported: import with --batch auto (the default) to take it for the batch, or export the model at a fixed batch"
        ),
        (0, BatchMode::Auto) => format!(
            "axis 0 is the symbol {p:?}, but it cannot be taken for the batch: every model input must start with the same batch axis (and none be scanned along it); export the model with every input batched, or at a fixed batch"
        ),
        _ => format!("axis {axis} is the symbol {p:?}; only the batch axis (axis 0) may be symbolic: export the model with this axis at a fixed extent"),
    }
}

/// The tensor of a Constant node, from whichever `value*` attribute it carries.
fn constant_value(node: &NodeProto, dir: &Path) -> Result<crate::TensorData, String> {
    use onnx_protobuf::attribute_proto::AttributeType as A;
    let attr = match node.attribute.as_slice() {
        [a] => a,
        [] => return Err("has no value attribute".into()),
        _ => return Err("must have exactly one value attribute".into()),
    };
    let kind = attr.type_.enum_value().ok();
    Ok(match attr.name.as_str() {
        "value" => tensor::tensor_from_proto(attr.t.as_ref().cloned().ok_or("value is not a tensor")?, dir).map_err(|e| e.to_string())?,
        "value_float" => crate::TensorData::from_f64s(DType::F32, vec![], &[attr.f as f64]),
        "value_floats" => crate::TensorData::from_f64s(DType::F32, vec![attr.floats.len() as i64], &attr.floats.iter().map(|&f| f as f64).collect::<Vec<_>>()),
        "value_int" => crate::TensorData::from_i64s(vec![], &[attr.i]),
        "value_ints" => crate::TensorData::from_i64s(vec![attr.ints.len() as i64], &attr.ints),
        other if kind == Some(A::SPARSE_TENSOR) || other.starts_with("value_string") || other == "sparse_value" => {
            return Err(format!("attribute {other:?} (sparse or string constants) is not supported"))
        }
        other => return Err(format!("attribute {other:?} is not a Constant value attribute")),
    })
}
