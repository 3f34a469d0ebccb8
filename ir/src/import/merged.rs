//! Initializers an exporter merged: exporters (torch.onnx among them) store parameters
//! with identical values once, so the untrained LayerNorm weights of a whole model (all
//! ones) become one initializer read by every LayerNorm, and train as one tied weight.
//!
//! An initializer is taken for a merge when it is a float tensor, read by more than one
//! node of the main graph (and by no subgraph), and all its elements are equal, whether
//! its values are in the model file or in an external data file beside it (the default
//! exporter of PyTorch writes every weight there): deliberately tied weights (GPT-2's token embedding and output projection) hold
//! random values, which no merge of distinct parameters would produce. [`untie_merged`]
//! gives each reading node after the first its own copy, `NAME.untied1`, `NAME.untied2`,
//! ...; the importer and `export` call it on the same source graph, so the copies have
//! the same names in the build and in the exported model.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use onnx_protobuf::{GraphProto, TensorProto};
use pipewright_core::MergedInitializer;

use super::tensor::read_external_prefix;

/// ONNX element types that are floats, with their byte sizes.
pub(super) fn float_size(data_type: i32) -> Option<usize> {
    match data_type {
        1 => Some(4),       // FLOAT
        11 => Some(8),      // DOUBLE
        10 | 16 => Some(2), // FLOAT16, BFLOAT16
        _ => None,
    }
}

/// Whether every element of `t` is the same; external data is read from `model_dir`
/// (a tensor whose data cannot be read is not taken for a merge: the import reports it).
fn uniform(t: &TensorProto, model_dir: &Path) -> bool {
    let Some(size) = float_size(t.data_type) else { return false };
    let same_chunks = |bytes: &[u8]| {
        let mut chunks = bytes.chunks_exact(size);
        chunks.next().is_some_and(|first| chunks.remainder().is_empty() && chunks.all(|c| c == first))
    };
    if !t.external_data.is_empty() {
        let numel: i64 = t.dims.iter().product();
        let Ok(bytes) = usize::try_from(numel).map(|n| n * size) else { return false };
        // Random weights (a deliberate tie, such as a token embedding) differ within their
        // first bytes: only a uniform prefix makes the whole worth reading.
        const PREFIX: usize = 1 << 16;
        let uniform_in = |limit| read_external_prefix(t, model_dir, bytes, limit).is_ok_and(|b| same_chunks(&b));
        return uniform_in(PREFIX) && (bytes <= PREFIX || uniform_in(usize::MAX));
    }
    if !t.raw_data.is_empty() {
        return same_chunks(&t.raw_data);
    }
    fn same<T: PartialEq>(v: &[T]) -> bool {
        v.first().is_some_and(|f| v.iter().all(|x| x == f))
    }
    match t.data_type {
        11 => same(&t.double_data),
        10 | 16 => same(&t.int32_data),
        _ => same(&t.float_data),
    }
}

/// Names read inside subgraphs (If/Loop/Scan bodies), at any depth.
fn subgraph_reads(g: &GraphProto, out: &mut HashSet<String>) {
    for n in &g.node {
        for a in &n.attribute {
            for sub in a.g.as_ref().into_iter().chain(&a.graphs) {
                for m in &sub.node {
                    out.extend(m.input.iter().cloned());
                }
                subgraph_reads(sub, out);
            }
        }
    }
}

/// The merged initializers of `g` (see the module docs; external data relative to
/// `model_dir`), in initializer order, with the indices of the nodes reading each. One
/// read only by modules that hold no parameter ([`split_weightless_reads`]) is a constant,
/// no merge.
fn find(g: &GraphProto, model_dir: &Path) -> Vec<(MergedInitializer, Vec<usize>)> {
    let weightless = weightless_readers(g);
    uniform_shared(g, model_dir).into_iter().filter(|(_, readers)| !readers.iter().all(|&n| weightless(n))).collect()
}

/// Whether node `n` of `g` runs in a module that holds no parameter (a LayerNorm without
/// affine weights), by the exported program's signature and the node's recorded module;
/// never where either is missing.
fn weightless_readers(g: &GraphProto) -> impl Fn(usize) -> bool + '_ {
    let listed = super::provenance::listed_parameters(g);
    move |n: usize| {
        !listed.is_empty() && super::provenance::module_of(&g.node[n]).is_some_and(|m| !listed.iter().any(|p| super::provenance::is_state_of(p, m)))
    }
}

/// The uniform float initializers of `g` read by more than one node of the main graph,
/// with those nodes.
fn uniform_shared(g: &GraphProto, model_dir: &Path) -> Vec<(MergedInitializer, Vec<usize>)> {
    let mut readers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in g.node.iter().enumerate() {
        for input in &n.input {
            let r = readers.entry(input.as_str()).or_default();
            // A node reading the weight twice is one use.
            if r.last() != Some(&i) {
                r.push(i);
            }
        }
    }
    let mut inner = HashSet::new();
    subgraph_reads(g, &mut inner);
    // What the exporter marks as a constant is no parameter, merged or not: it stays one
    // frozen value.
    let constants = super::provenance::exporter_constants(g);
    g.initializer
        .iter()
        .filter(|t| !t.dims.is_empty() && !inner.contains(&t.name) && !constants.contains_key(&t.name))
        .filter_map(|t| {
            let r = readers.get(t.name.as_str()).filter(|r| r.len() > 1)?;
            uniform(t, model_dir).then(|| (MergedInitializer { name: t.name.clone(), uses: r.len(), weights: None }, r.clone()))
        })
        .collect()
}

/// The initializers of `g` an exporter merged, each with its number of reading nodes
/// (external data is read relative to `model_dir`).
pub fn merged_initializers(g: &GraphProto, model_dir: &Path) -> Vec<MergedInitializer> {
    find(g, model_dir).into_iter().map(|(m, _)| m).collect()
}

/// Gives every node after the first that reads a merged initializer its own copy
/// (`NAME.untiedK`, K from 1, a further `.untied` where that name is taken; a copy of an
/// external tensor names the same bytes of the same file); returns what was untied.
///
/// Where the default exporter recorded each reading node's module and its exported
/// program lists the parameter of that module the initializer stands for (`M.weight` for
/// an initializer `....weight` read by a node of module `M`), the copies follow the
/// parameters instead: the nodes of one module share one copy, named after its parameter
/// (a module applied several times, as ALBERT's one shared layer is, stays one weight, as
/// in PyTorch).
pub fn untie_merged(g: &mut GraphProto, model_dir: &Path) -> Vec<MergedInitializer> {
    let found = find(g, model_dir);
    let mut taken: HashSet<String> = g.initializer.iter().map(|t| t.name.clone()).chain(g.input.iter().map(|i| i.name.clone())).collect();
    taken.extend(g.node.iter().flat_map(|n| n.output.iter().cloned()));
    let listed = super::provenance::listed_parameters(g);
    let mut copies = Vec::new();
    let mut untied = Vec::new();
    for (m, readers) in &found {
        let Some(source) = g.initializer.iter().find(|t| t.name == m.name) else { continue };
        let groups = copies_of(g, &m.name, readers, &listed);
        untied.push(MergedInitializer { weights: Some(groups.len()), ..m.clone() });
        for (k, (param, nodes)) in groups.into_iter().enumerate() {
            if param.as_deref() == Some(m.name.as_str()) {
                continue;
            }
            let mut name = param.filter(|p| !taken.contains(p)).unwrap_or_else(|| format!("{}.untied{k}", m.name));
            while taken.contains(&name) {
                name.push_str(".untied");
            }
            taken.insert(name.clone());
            for node in nodes {
                for input in g.node[node].input.iter_mut().filter(|i| **i == m.name) {
                    *input = name.clone();
                }
            }
            let mut copy = source.clone();
            copy.name = name;
            copies.push(copy);
        }
    }
    g.initializer.extend(copies);
    untied
}

/// The groups of `readers` (node indices) of merged initializer `name` that get a weight
/// each, with the parameter each stands for ([`untie_merged`]): the readers whose module's
/// parameter is `listed` by that parameter, the nodes reading `name` itself beside
/// `Identity` readers, every other reader alone. The group holding `name`'s own parameter
/// (or else the first) keeps `name`.
fn copies_of(g: &GraphProto, name: &str, readers: &[usize], listed: &HashSet<String>) -> Vec<(Option<String>, Vec<usize>)> {
    let suffix = name.rsplit('.').next().unwrap_or(name);
    // TorchScript's exporter keeps one of several equal parameters and reads each of the
    // others through an `Identity` of it: where it did, the `Identity` nodes are the
    // other parameters, and the nodes reading the initializer itself are its own
    // parameter, applied more than once where there are several (SegGPT's patch
    // embedding, on the prompt and on the input; ALBERT's shared layer).
    let is_identity = |n: usize| g.node[n].op_type == "Identity";
    let identity_form = readers.iter().any(|&n| is_identity(n));
    let mut groups: Vec<(Option<String>, Vec<usize>)> = Vec::new();
    for &n in readers {
        let own = (identity_form && !is_identity(n)).then(|| name.to_string());
        let param = own.or_else(|| super::provenance::module_of(&g.node[n]).map(|m| format!("{m}.{suffix}")).filter(|p| listed.contains(p)));
        match groups.iter_mut().find(|(q, _)| param.is_some() && *q == param) {
            Some((_, nodes)) => nodes.push(n),
            None => groups.push((param, vec![n])),
        }
    }
    if !groups.iter().any(|(p, _)| p.as_deref() == Some(name)) {
        groups[0].0 = Some(name.to_string());
    }
    // The direct readers first, so that the copies count from 1 as they do otherwise.
    if let Some(i) = groups.iter().position(|(p, _)| identity_form && p.as_deref() == Some(name)) {
        let own = groups.remove(i);
        groups.insert(0, own);
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use onnx_protobuf::NodeProto;

    fn init(name: &str, values: &[f32]) -> TensorProto {
        TensorProto { name: name.into(), data_type: 1, dims: vec![values.len() as i64], raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(), ..Default::default() }
    }

    fn node(name: &str, inputs: &[&str]) -> NodeProto {
        NodeProto { name: name.into(), op_type: "Mul".into(), input: inputs.iter().map(|s| s.to_string()).collect(), output: vec![format!("{name}_out")], ..Default::default() }
    }

    fn bn(name: &str, inputs: &[&str]) -> NodeProto {
        NodeProto { op_type: "BatchNormalization".into(), ..node(name, inputs) }
    }

    /// A merged tensor of ones that is the scale of two BatchNorms and their running
    /// variance, and one of zeros for bias and mean: every running-statistic read gets its
    /// own copy; the scale and bias stay one (tied) weight.
    #[test]
    fn shared_batchnorm_buffers_are_split_from_weights_and_each_other() {
        let mut g = GraphProto {
            initializer: vec![init("ones", &[1.0; 4]), init("zeros", &[0.0; 4]), init("mean", &[0.5; 4]), init("var", &[2.0; 4])],
            node: vec![bn("bn1", &["x", "ones", "zeros", "zeros", "ones"]), bn("bn2", &["bn1_out", "ones", "zeros", "zeros", "ones"]), bn("bn3", &["bn2_out", "ones", "zeros", "mean", "var"])],
            ..Default::default()
        };
        assert_eq!(split_buffers(&mut g), ["ones", "zeros"]);
        let inputs: Vec<Vec<&str>> = g.node.iter().map(|n| n.input.iter().map(String::as_str).collect()).collect();
        assert_eq!(inputs[0], ["x", "ones", "zeros", "zeros.buffer1", "ones.buffer1"]);
        assert_eq!(inputs[1], ["bn1_out", "ones", "zeros", "zeros.buffer2", "ones.buffer2"]);
        // A buffer read once, and by nothing else, stays as it is.
        assert_eq!(inputs[2], ["bn2_out", "ones", "zeros", "mean", "var"]);
        assert_eq!(g.initializer.len(), 8);
        assert!(split_buffers(&mut g).is_empty(), "splitting twice changes nothing");
    }

    /// The TorchScript exporter's form of a fresh BatchNorm: its running mean and variance
    /// are `Identity` reads of its bias (zeros) and scale (ones). They become reads of
    /// copies of those initializers, and the Identities go; one read elsewhere stays.
    #[test]
    fn running_statistics_read_through_identities_are_split_too() {
        let identity = |name: &str, input: &str| NodeProto { name: name.into(), op_type: "Identity".into(), input: vec![input.into()], output: vec![name.into()], ..Default::default() };
        let mut g = GraphProto {
            initializer: vec![init("bn.weight", &[1.0; 4]), init("bn.bias", &[0.0; 4])],
            node: vec![identity("id_mean", "bn.bias"), identity("id_var", "bn.weight"), identity("id_kept", "bn.weight"), bn("bn", &["x", "bn.weight", "bn.bias", "id_mean", "id_var"]), node("mul", &["bn_out", "id_kept"])],
            ..Default::default()
        };
        assert_eq!(split_buffers(&mut g), ["bn.weight", "bn.bias"]);
        let names: Vec<&str> = g.node.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["id_kept", "bn", "mul"]);
        assert_eq!(g.node[1].input, ["x", "bn.weight", "bn.bias", "bn.bias.buffer1", "bn.weight.buffer1"]);
        let copies: Vec<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(copies, ["bn.weight", "bn.bias", "bn.weight.buffer1", "bn.bias.buffer1"]);
    }

    #[test]
    fn uniform_multi_use_initializers_are_untied_per_node() {
        let mut g = GraphProto {
            initializer: vec![init("ones", &[1.0; 4]), init("random", &[0.1, -0.3, 0.7, 0.2]), init("single", &[0.0; 4])],
            node: vec![node("a", &["x", "ones"]), node("b", &["a_out", "ones"]), node("c", &["b_out", "random"]), node("d", &["c_out", "random"]), node("e", &["d_out", "ones", "single"])],
            ..Default::default()
        };
        // The random weight read twice is a deliberate tie; `single` has one reader.
        let dir = Path::new(".");
        assert_eq!(merged_initializers(&g, dir), vec![MergedInitializer { name: "ones".into(), uses: 3, weights: None }]);
        assert_eq!(untie_merged(&mut g, dir), vec![MergedInitializer { name: "ones".into(), uses: 3, weights: Some(3) }]);
        let inputs: Vec<&str> = g.node.iter().map(|n| n.input[1].as_str()).collect();
        assert_eq!(inputs, ["ones", "ones.untied1", "random", "random", "ones.untied2"]);
        assert_eq!(g.initializer.len(), 5);
        assert_eq!(g.initializer[3].raw_data, g.initializer[0].raw_data);
        assert!(merged_initializers(&g, dir).is_empty());
    }

    /// TorchScript's form of a merge: the kept parameter read directly (here by two nodes,
    /// one module applied twice) and the others each through an `Identity`. Each
    /// `Identity` gets a copy; the direct readers keep one weight between them.
    #[test]
    fn direct_readers_beside_identities_are_one_parameter() {
        let identity = |name: &str| NodeProto { name: name.into(), op_type: "Identity".into(), input: vec!["zeros".into()], output: vec![format!("{name}_out")], ..Default::default() };
        let mut g = GraphProto {
            initializer: vec![init("zeros", &[0.0; 4])],
            node: vec![identity("i1"), node("conv1", &["x", "zeros"]), identity("i2"), node("conv2", &["y", "zeros"])],
            ..Default::default()
        };
        assert_eq!(untie_merged(&mut g, Path::new(".")), vec![MergedInitializer { name: "zeros".into(), uses: 4, weights: Some(3) }]);
        let inputs: Vec<&str> = g.node.iter().map(|n| n.input.last().map(String::as_str).unwrap_or_default()).collect();
        assert_eq!(inputs, ["zeros.untied1", "zeros", "zeros.untied2", "zeros"]);
        assert_eq!(g.initializer.len(), 3);
    }

    /// The default exporter's record of each node's module and the exported program's
    /// parameters: the copies follow the parameters. Two LayerNorms of module `a` (one
    /// layer applied twice, as ALBERT's shared layer) keep one weight, named as the
    /// initializer is; module `b`'s gets a copy named after its own parameter, and a node
    /// whose module's parameter the program does not list a copy of its own.
    #[test]
    fn the_copies_follow_the_modules_parameters_where_the_exporter_names_them() {
        use onnx_protobuf::StringStringEntryProto;
        let scoped = |name: &str, module: &str| {
            let mut n = node(name, &["x", "a.weight"]);
            n.metadata_props.push(StringStringEntryProto { key: "pkg.torch.onnx.name_scopes".into(), value: format!("['', 'model', '{module}', '{name}']"), ..Default::default() });
            n
        };
        let mut g = GraphProto { initializer: vec![init("a.weight", &[1.0; 4])], node: vec![scoped("n1", "a"), scoped("n2", "b"), scoped("n3", "a"), scoped("n4", "c")], ..Default::default() };
        let signature = "p_a_weight: PARAMETER target='a.weight'\np_b_weight: PARAMETER target='b.weight'";
        g.metadata_props.push(StringStringEntryProto { key: "pkg.torch.export.ExportedProgram.graph_signature".into(), value: signature.into(), ..Default::default() });
        let dir = Path::new(".");
        let mut plain = g.clone();
        plain.metadata_props.clear();
        assert_eq!(untie_merged(&mut g, dir), vec![MergedInitializer { name: "a.weight".into(), uses: 4, weights: Some(3) }]);
        // Module `c`'s parameter is not listed: its node gets a copy of its own.
        let inputs: Vec<&str> = g.node.iter().map(|n| n.input[1].as_str()).collect();
        assert_eq!(inputs, ["a.weight", "b.weight", "a.weight", "a.weight.untied2"]);
        assert_eq!(g.initializer.len(), 3);
        // Without the signature, one copy per node as before.
        untie_merged(&mut plain, dir);
        let inputs: Vec<&str> = plain.node.iter().map(|n| n.input[1].as_str()).collect();
        assert_eq!(inputs, ["a.weight", "a.weight.untied1", "a.weight.untied2", "a.weight.untied3"]);
    }

    /// A constant of the export batch 2 repeating one slice trains as that slice: with a
    /// leading extent of 2 groups of the batch (a class token expanded to the batch's
    /// tiles) too, expanded to twice the batch read from the source at run time; with
    /// `alike_rows`, a row repeated along the positions shrinks to one row. Slices that
    /// differ, or a leading extent no multiple of the batch, are refused, saying why.
    #[test]
    fn batch_baked_slices_train_as_one_shared_value() {
        let baked = |dims: &[i64], values: &[f32]| {
            let t = TensorProto { dims: dims.to_vec(), ..init("tok", values) };
            GraphProto { initializer: vec![t], node: vec![node("use", &["x", "tok"])], ..Default::default() }
        };
        let kept = |g: &GraphProto| g.initializer.iter().find(|t| t.name == "tok").map(|t| (t.dims.clone(), t.raw_data.len() / 4)).unwrap();
        let row = [0.5, -1.0, 2.0];
        let dir = Path::new(".");
        let mut g = baked(&[4, 1, 3], &row.repeat(4));
        train_batch_baked(&mut g, "tok", 2, dir, Some("x"), false).unwrap();
        assert_eq!(kept(&g), (vec![1, 1, 3], 3));
        assert_eq!(g.node[0].input[1], "tok:expanded");
        let groups = g.initializer.iter().find(|t| t.name.ends_with("/groups")).map(|t| t.raw_data.clone());
        assert_eq!(groups, Some(2i64.to_le_bytes().to_vec()), "twice the batch");
        let mut g = baked(&[2, 4, 3], &row.repeat(8));
        train_batch_baked(&mut g, "tok", 2, dir, Some("x"), true).unwrap();
        assert_eq!(kept(&g), (vec![1, 1, 3], 3));
        let mut g = baked(&[2, 4, 3], &row.repeat(8));
        train_batch_baked(&mut g, "tok", 2, dir, Some("x"), false).unwrap();
        assert_eq!(kept(&g), (vec![1, 4, 3], 12), "positions stay apart unless asked");
        let differing: Vec<f32> = (0..6).map(|i| i as f32).collect();
        assert_eq!(train_batch_baked(&mut baked(&[2, 1, 3], &differing), "tok", 2, dir, None, false), Err("its 2 slices differ, so it is not one value expanded to the batch".to_string()));
        assert_eq!(
            train_batch_baked(&mut baked(&[3, 1, 3], &row.repeat(3)), "tok", 2, dir, None, false),
            Err("its shape [3, 1, 3] does not start with the export batch (2) or a multiple of it".to_string())
        );
        // At the export batch 1: 3 rows of the batch (TimeSformer's class token per frame).
        let mut g = baked(&[3, 1, 3], &row.repeat(3));
        train_batch_baked(&mut g, "tok", 1, dir, Some("x"), false).unwrap();
        assert_eq!(kept(&g), (vec![1, 1, 3], 3));
        assert!(train_batch_baked(&mut baked(&[1, 1, 3], &row), "tok", 1, dir, None, false).is_err(), "one row is one slice already");
    }

    /// Ones merged with a LayerNorm weight and read by a LayerNorm module without
    /// parameters (`elementwise_affine=False`): that read gets a frozen copy, and the
    /// weight, read once more by its own module, is no merge. Without the exported
    /// program's signature nothing tells, and nothing is split.
    #[test]
    fn reads_by_modules_without_parameters_get_a_frozen_copy() {
        use onnx_protobuf::StringStringEntryProto;
        let entry = |k: &str, v: &str| StringStringEntryProto { key: k.into(), value: v.into(), ..Default::default() };
        let in_module = |name: &str, input: &str, module: &str| NodeProto {
            metadata_props: vec![entry("pkg.torch.onnx.name_scopes", &format!("['', 'enc', '{module}', 'layer_norm']"))],
            ..node(name, &["x", input])
        };
        let graph = |signature: Option<&str>| GraphProto {
            initializer: vec![init("enc.ln.weight", &[1.0; 4])],
            node: vec![in_module("pos", "enc.ln.weight", "enc.pos.norm"), in_module("ln", "enc.ln.weight", "enc.ln")],
            metadata_props: signature.map(|s| entry("pkg.torch.export.ExportedProgram.graph_signature", s)).into_iter().collect(),
            ..Default::default()
        };
        let mut g = graph(Some("p_enc_ln_weight: PARAMETER target='enc.ln.weight'\nargs_0: USER_INPUT"));
        assert_eq!(split_weightless_reads(&mut g, Path::new(".")), ["enc.ln.weight.constant"]);
        assert_eq!(g.node[0].input[1], "enc.ln.weight.constant");
        assert_eq!(g.node[1].input[1], "enc.ln.weight");
        assert!(merged_initializers(&g, Path::new(".")).is_empty());
        let mut g = graph(None);
        assert!(split_weightless_reads(&mut g, Path::new(".")).is_empty());
        assert_eq!(merged_initializers(&g, Path::new(".")).len(), 1);
    }

    /// An initializer whose values live in an external data file is found like an inline
    /// one (the default exporter writes every weight there), and its copies name the same
    /// bytes of the same file.
    #[test]
    fn external_uniform_initializers_are_merged_too() {
        use onnx_protobuf::StringStringEntryProto;
        let dir = tempfile::tempdir().unwrap();
        let ones: Vec<u8> = [1.0f32; 4].iter().chain(&[0.1, -0.3, 0.7, 0.2]).flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.path().join("m.onnx.data"), &ones).unwrap();
        let entry = |k: &str, v: &str| StringStringEntryProto { key: k.into(), value: v.into(), ..Default::default() };
        let external = |name: &str, offset: usize| TensorProto {
            name: name.into(),
            data_type: 1,
            dims: vec![4],
            data_location: protobuf::EnumOrUnknown::new(onnx_protobuf::tensor_proto::DataLocation::EXTERNAL),
            external_data: vec![entry("location", "m.onnx.data"), entry("offset", &offset.to_string()), entry("length", "16")],
            ..Default::default()
        };
        let mut g = GraphProto {
            initializer: vec![external("ln.weight", 0), external("w", 16)],
            node: vec![node("a", &["x", "ln.weight"]), node("b", &["a_out", "ln.weight"]), node("c", &["b_out", "w"]), node("d", &["c_out", "w"])],
            ..Default::default()
        };
        assert_eq!(merged_initializers(&g, dir.path()), vec![MergedInitializer { name: "ln.weight".into(), uses: 2, weights: None }]);
        untie_merged(&mut g, dir.path());
        let copy = g.initializer.iter().find(|t| t.name == "ln.weight.untied1").expect("the copy");
        assert_eq!(copy.external_data, g.initializer[0].external_data);
        // Without the data file nothing is taken for a merge (the import names the file).
        assert!(merged_initializers(&g, Path::new("/nonexistent")).is_empty());
    }
}

/// Whether input `slot` of `node` is a BatchNormalization running statistic (mean,
/// variance): a buffer the forward updates, not a weight the optimizer trains.
fn is_bn_buffer(node: &onnx_protobuf::NodeProto, slot: usize) -> bool {
    node.op_type == "BatchNormalization" && (slot == 3 || slot == 4)
}

/// The initializers read only as BatchNorm running statistics (after [`split_buffers`],
/// every one that is a running statistic at all): buffers, not trainable weights.
pub fn bn_buffers(g: &GraphProto) -> HashSet<String> {
    let mut buffer: HashSet<String> = HashSet::new();
    let mut other: HashSet<&str> = HashSet::new();
    for n in &g.node {
        for (slot, input) in n.input.iter().enumerate() {
            if is_bn_buffer(n, slot) {
                buffer.insert(input.clone());
            } else {
                other.insert(input);
            }
        }
    }
    buffer.retain(|name| !other.contains(name.as_str()));
    buffer
}

/// Gives every BatchNormalization running statistic its own initializer where the source
/// shares one: an exporter that merges identical initializers makes one tensor of ones the
/// scale of every BatchNorm and its running variance too, and one of zeros their bias and
/// running mean. A weight and a buffer must not be one value (the weight trains, the buffer
/// follows the batches), nor may two BatchNorms update one buffer. Each running-statistic
/// read of an initializer that is read anywhere else gets a copy, `NAME.bufferK` (K from 1,
/// in node order; a further `.buffer` where that name is taken). Returns the names split.
/// The importer and `export` call it on the same source graph, so the copies have the
/// same names in the build and in the exported model. A running statistic read through an
/// `Identity` of an initializer is first made to read that initializer
/// ([`read_buffers_directly`]).
pub fn split_buffers(g: &mut GraphProto) -> Vec<String> {
    read_buffers_directly(g);
    let mut reads: HashMap<String, (Vec<(usize, usize)>, usize)> = HashMap::new();
    for (i, n) in g.node.iter().enumerate() {
        for (slot, input) in n.input.iter().enumerate().filter(|(_, input)| !input.is_empty()) {
            let entry = reads.entry(input.clone()).or_default();
            if is_bn_buffer(n, slot) {
                entry.0.push((i, slot));
            } else {
                entry.1 += 1;
            }
        }
    }
    let mut taken: HashSet<String> = g.initializer.iter().map(|t| t.name.clone()).chain(g.input.iter().map(|i| i.name.clone())).collect();
    taken.extend(g.node.iter().flat_map(|n| n.output.iter().cloned()));
    let mut copies = Vec::new();
    let mut split = Vec::new();
    for t in &g.initializer {
        let Some((buffers, others)) = reads.get(&t.name) else { continue };
        if buffers.is_empty() || buffers.len() + others < 2 {
            continue;
        }
        for (k, &(node, slot)) in buffers.iter().enumerate() {
            let mut name = format!("{}.buffer{}", t.name, k + 1);
            while taken.contains(&name) {
                name.push_str(".buffer");
            }
            taken.insert(name.clone());
            g.node[node].input[slot] = name.clone();
            let mut copy = t.clone();
            copy.name = name;
            copies.push(copy);
        }
        split.push(t.name.clone());
    }
    g.initializer.extend(copies);
    split
}

/// Gives the reads of a merged initializer by modules that hold no parameter (a
/// `LayerNorm(elementwise_affine=False)`, whose ones the default exporter's optimizer
/// merged with a parameter of equal values: Data2VecAudio's positional convolutions read
/// the encoder's LayerNorm weight so) one copy, `NAME.constant` (a further `.constant`
/// where that name is taken), which the import keeps frozen: PyTorch's modules hold no
/// weight there, and tied to the parameter they moved with it. Needs the exported
/// program's signature (which lists every parameter) and each reading node's module;
/// where every reader is such a module, the initializer itself is the constant. Returns
/// the frozen initializers' names, sorted. The importer and `export` call it on the same source
/// graph, so the copies have the same names in the build and in the exported model.
pub fn split_weightless_reads(g: &mut GraphProto, model_dir: &Path) -> Vec<String> {
    let plan: Vec<(String, Vec<usize>, bool)> = {
        let weightless = weightless_readers(g);
        uniform_shared(g, model_dir)
            .into_iter()
            .filter_map(|(m, readers)| {
                let constant: Vec<usize> = readers.iter().copied().filter(|&n| weightless(n)).collect();
                let all = constant.len() == readers.len();
                (!constant.is_empty()).then_some((m.name, constant, all))
            })
            .collect()
    };
    let mut taken: HashSet<String> = g.initializer.iter().map(|t| t.name.clone()).chain(g.input.iter().map(|i| i.name.clone())).collect();
    taken.extend(g.node.iter().flat_map(|n| n.output.iter().cloned()));
    let mut frozen = Vec::new();
    for (name, readers, all) in plan {
        if all {
            frozen.push(name);
            continue;
        }
        let Some(source) = g.initializer.iter().find(|t| t.name == name) else { continue };
        let mut copy = source.clone();
        copy.name = format!("{name}.constant");
        while taken.contains(&copy.name) {
            copy.name.push_str(".constant");
        }
        taken.insert(copy.name.clone());
        for n in readers {
            for input in g.node[n].input.iter_mut().filter(|i| **i == name) {
                *input = copy.name.clone();
            }
        }
        frozen.push(copy.name.clone());
        g.initializer.push(copy);
    }
    frozen.sort();
    frozen
}

/// Makes each BatchNorm running statistic read through an `Identity` of an initializer
/// read the initializer itself, and drops the `Identity` where nothing else reads it. The
/// TorchScript exporter stores a value once and reads its duplicates through `Identity`:
/// a fresh BatchNorm's running variance (ones) and mean (zeros) become Identities of its
/// scale and bias, and a running statistic that is not an initializer would be neither a
/// buffer the forward updates nor split from the weight it equals.
fn read_buffers_directly(g: &mut GraphProto) {
    let initializers: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    let identity_of: HashMap<String, String> = g
        .node
        .iter()
        .filter(|n| n.op_type == "Identity" && n.input.len() == 1 && n.output.len() == 1 && initializers.contains(n.input[0].as_str()))
        .map(|n| (n.output[0].clone(), n.input[0].clone()))
        .collect();
    let mut bypassed = HashSet::new();
    for n in &mut g.node {
        for slot in [3, 4] {
            let Some(source) = n.input.get(slot).filter(|_| is_bn_buffer(n, slot)).and_then(|x| identity_of.get(x)) else { continue };
            bypassed.insert(std::mem::replace(&mut n.input[slot], source.clone()));
        }
    }
    if bypassed.is_empty() {
        return;
    }
    let mut read: HashSet<String> = g.node.iter().flat_map(|n| n.input.iter().cloned()).chain(g.output.iter().map(|o| o.name.clone())).collect();
    subgraph_reads(g, &mut read);
    g.node.retain(|n| !(n.op_type == "Identity" && n.output.len() == 1 && bypassed.contains(&n.output[0]) && !read.contains(&n.output[0])));
}

/// `--train-batch-baked NAME`: the initializer `name`, baked for the export batch `b0`
/// (its `b0` leading slices equal: an exporter's `cls_token.expand(B, -1, -1)`), becomes
/// its first slice, a trainable weight of the same name shared by the whole batch, read
/// through `Expand(NAME, [b0, ...])` by the nodes that read it (the pattern of a class
/// token the legacy exporter writes, which the lowering expands to any batch). Its values
/// may be in the model file or in an external data file beside it (`model_dir`, as the
/// default exporter writes them); the slice is then stored in the model. With a
/// `batch_source` (a graph input whose leading axis is the batch), the Expand's target
/// takes its batch from that input at run time instead. With `alike_rows` (a lookup of a
/// parameter's rows), the leading axes after the batch along which the slice repeats too
/// (one row looked up at every position) shrink to one, so that the row trains once for
/// all the positions that read it. Errors say why `name` cannot be.
pub fn train_batch_baked(g: &mut GraphProto, name: &str, b0: i64, model_dir: &Path, batch_source: Option<&str>, alike_rows: bool) -> Result<(), String> {
    let t = g.initializer.iter_mut().find(|t| t.name == name).ok_or("no initializer of that name")?;
    let dims = t.dims.clone();
    // `groups` rows of the batch each (Mllama's class embedding expanded to the batch's
    // tiles, `[batch * tiles, 1, width]`). At the export batch 1, the export's other
    // extents decide: read as the batch's rows, a leading extent that was not fails at
    // another batch where it meets the model's activations.
    if b0 < 1 || dims.len() < 2 || dims[0] < 2 || dims[0] % b0 != 0 {
        return Err(format!("its shape {dims:?} does not start with the export batch ({b0}) or a multiple of it"));
    }
    let groups = dims[0] / b0;
    if float_size(t.data_type).is_none() {
        return Err("it is not a float tensor".into());
    }
    let data = super::tensor::tensor_from_proto(t.clone(), model_dir).map_err(|e| e.to_string())?;
    let slice = data.bytes.len() / dims[0] as usize;
    if slice == 0 || !data.bytes.chunks(slice).all(|c| c == &data.bytes[..slice]) {
        return Err(format!("its {} slices differ, so it is not one value expanded to the batch", dims[0]));
    }
    let mut kept: Vec<i64> = [1].into_iter().chain(dims[1..].iter().copied()).collect();
    let mut bytes = data.bytes.slice(..slice);
    if alike_rows {
        // Axis by axis from the first after the batch, never the row itself.
        for axis in 1..kept.len() - 1 {
            let part = bytes.len() / kept[axis] as usize;
            if part == 0 || !bytes.chunks(part).all(|c| c == &bytes[..part]) {
                break;
            }
            bytes = bytes.slice(..part);
            kept[axis] = 1;
        }
    }
    let first = crate::TensorData { dims: kept, bytes, ..data };
    *t = super::tensor::tensor_to_proto(name, &first);
    let (shape, expanded) = (format!("{name}:batch_shape"), format!("{name}:expanded"));
    for n in g.node.iter_mut() {
        for i in n.input.iter_mut().filter(|i| *i == name) {
            *i = expanded.clone();
        }
    }
    match batch_source {
        // The batch read from that input at run time, so that whatever reads the slice
        // (a layer norm, a projection, a view per head) follows the batch too.
        Some(source) => {
            let source_shape = format!("{name}:source_shape");
            let (constants, nodes) = super::node_proto::batch_groups_led_shape(&format!("{name}:batch"), &source_shape, groups, &dims[1..], &shape);
            g.initializer.extend(constants.iter().map(|(n, t)| super::tensor::tensor_to_proto(n, t)));
            g.node.push(super::node_proto::plain(&source_shape, "Shape", &[source], &source_shape));
            g.node.extend(nodes);
        }
        None => g.initializer.push(super::tensor::tensor_to_proto(&shape, &crate::TensorData::from_i64s(vec![dims.len() as i64], &dims))),
    }
    g.node.push(onnx_protobuf::NodeProto { name: expanded.clone(), op_type: "Expand".into(), input: vec![name.to_string(), shape], output: vec![expanded], ..Default::default() });
    Ok(())
}
