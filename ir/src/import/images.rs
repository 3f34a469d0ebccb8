//! Tied weights an exporter stored twice. A language model reads its token embedding
//! again, transposed, as its output projection; exporters fold that transpose into a
//! second initializer holding the same values permuted (PyTorch's default exporter records
//! it as folded from the embedding; the TorchScript exporter records nothing). Imported as
//! found, the two would train as independent weights: after one SGD step a tied BERT's
//! outputs were 0.29 from PyTorch's.
//!
//! [`retie`] finds each float initializer whose values are bit for bit another's with its
//! axes reordered (not merely equal: identical copies are more often constants the
//! exporter did not share, a mask per layer), the other not all one value (which any
//! order would match), and replaces it with `Transpose(source, perm)`, so the weight trains once, as in the model
//! exported. Where the exporter recorded what it folded, only an initializer folded from
//! that one weight is taken; without such records, equal values under a permutation are
//! the evidence (random weights never coincide). `export` writes each such initializer
//! back as its source's trained values permuted.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use onnx_protobuf::{AttributeProto, GraphProto, NodeProto, TensorProto};
use pipewright_core::FoldedImage;
use protobuf::EnumOrUnknown;

use super::merged::float_size;
use super::provenance::folded_parameters;
use super::tensor::tensor_from_proto;
use crate::error::ImportError;
use crate::TensorData;

/// Tensors of more axes than this are not searched for permutations (6! = 720 orders).
const MAX_RANK: usize = 6;

/// Replaces every permuted copy of another weight in `g` by a `Transpose` of it (see the
/// module docs; external data relative to `model_dir`) and returns what it replaced.
pub fn retie(g: &mut GraphProto, model_dir: &Path) -> Result<Vec<FoldedImage>, ImportError> {
    let images = find(g, model_dir)?;
    let names: HashSet<&str> = images.iter().map(|i| i.name.as_str()).collect();
    g.initializer.retain(|t| !names.contains(t.name.as_str()));
    g.input.retain(|i| !names.contains(i.name.as_str()));
    for image in &images {
        let perm = AttributeProto {
            name: "perm".into(),
            ints: image.perm.iter().map(|&p| p as i64).collect(),
            type_: EnumOrUnknown::new(onnx_protobuf::attribute_proto::AttributeType::INTS),
            ..Default::default()
        };
        g.node.push(NodeProto {
            name: format!("retie {}", image.name),
            op_type: "Transpose".into(),
            input: vec![image.source.clone()],
            output: vec![image.name.clone()],
            attribute: vec![perm],
            ..Default::default()
        });
    }
    Ok(images)
}

/// The permuted copies in `g`, in initializer order; a weight that is itself a copy is
/// never taken as another's source.
fn find(g: &GraphProto, model_dir: &Path) -> Result<Vec<FoldedImage>, ImportError> {
    let folded = folded_parameters(g);
    let candidates: Vec<&TensorProto> = g.initializer.iter().filter(|t| is_candidate(t)).collect();
    let pairs: Vec<(&TensorProto, &TensorProto)> = if folded.is_empty() {
        same_elements_pairs(&candidates, model_dir)
    } else {
        recorded_pairs(&candidates, &folded)
    };
    let mut loaded: HashMap<String, TensorData> = HashMap::new();
    let mut load = |t: &TensorProto| -> Result<TensorData, ImportError> {
        if let Some(d) = loaded.get(&t.name) {
            return Ok(d.clone());
        }
        let d = tensor_from_proto(t.clone(), model_dir)?;
        loaded.insert(t.name.clone(), d.clone());
        Ok(d)
    };
    let (mut images, mut taken) = (Vec::new(), HashSet::new());
    for (image, source) in pairs {
        if taken.contains(&image.name) || taken.contains(&source.name) || images.iter().any(|i: &FoldedImage| i.source == image.name) {
            continue;
        }
        let (x, p) = (load(image)?, load(source)?);
        if is_uniform(&p) {
            continue;
        }
        if let Some(perm) = orders(&p.dims, &x.dims).into_iter().find(|perm| p.permuted(perm).is_some_and(|q| q.bytes == x.bytes)) {
            taken.insert(image.name.clone());
            images.push(FoldedImage { name: image.name.clone(), source: source.name.clone(), perm });
        }
    }
    Ok(images)
}

/// Float tensors of rank 2 or more (a bias or a norm's scale is never stored transposed).
fn is_candidate(t: &TensorProto) -> bool {
    float_size(t.data_type).is_some() && (2..=MAX_RANK).contains(&t.dims.len()) && t.dims.iter().all(|&d| d > 0)
}

/// (image, source) pairs the exporter recorded: an initializer folded from exactly one
/// weight that is itself an initializer of the same element count.
fn recorded_pairs<'a>(candidates: &[&'a TensorProto], folded: &HashMap<String, Vec<String>>) -> Vec<(&'a TensorProto, &'a TensorProto)> {
    let by_name: HashMap<&str, &TensorProto> = candidates.iter().map(|t| (t.name.as_str(), *t)).collect();
    candidates
        .iter()
        .filter_map(|t| {
            let [source] = folded.get(&t.name)?.as_slice() else { return None };
            let s = by_name.get(source.as_str())?;
            (s.name != t.name && same_extents(s, t)).then_some((*t, *s))
        })
        .collect()
}

/// Without records: every later initializer whose extents are a permutation of an
/// earlier one's and whose first element is the same (it is under any permutation), as
/// (image, source).
fn same_elements_pairs<'a>(candidates: &[&'a TensorProto], model_dir: &Path) -> Vec<(&'a TensorProto, &'a TensorProto)> {
    let firsts: Vec<Option<Vec<u8>>> = candidates.iter().map(|t| first_element(t, model_dir)).collect();
    let mut pairs = Vec::new();
    for (i, x) in candidates.iter().enumerate() {
        for (j, p) in candidates.iter().enumerate().take(i) {
            if x.data_type == p.data_type && same_extents(p, x) && firsts[i].is_some() && firsts[i] == firsts[j] {
                pairs.push((*x, *p));
            }
        }
    }
    pairs
}

fn same_extents(a: &TensorProto, b: &TensorProto) -> bool {
    let sorted = |t: &TensorProto| {
        let mut d = t.dims.clone();
        d.sort_unstable();
        d
    };
    a.data_type == b.data_type && sorted(a) == sorted(b)
}

/// The raw bytes of `t`'s first element, read without reading the rest.
fn first_element(t: &TensorProto, model_dir: &Path) -> Option<Vec<u8>> {
    let size = float_size(t.data_type)?;
    if !t.external_data.is_empty() {
        let numel: i64 = t.dims.iter().product();
        let bytes = usize::try_from(numel).ok()? * size;
        return super::tensor::read_external_prefix(t, model_dir, bytes, size).ok().map(|b| b[..size.min(b.len())].to_vec());
    }
    if !t.raw_data.is_empty() {
        return t.raw_data.get(..size).map(<[u8]>::to_vec);
    }
    match t.data_type {
        1 => t.float_data.first().map(|v| v.to_le_bytes().to_vec()),
        11 => t.double_data.first().map(|v| v.to_le_bytes().to_vec()),
        _ => t.int32_data.first().map(|v| (*v as u16).to_le_bytes().to_vec()),
    }
}

fn is_uniform(t: &TensorData) -> bool {
    let size = t.dtype.size();
    let mut chunks = t.bytes.chunks_exact(size);
    chunks.next().is_some_and(|first| chunks.all(|c| c == first))
}

/// Every axis order but the identity taking extents `from` to extents `to`, the plain
/// transpose first. (A tied weight is stored transposed; an equal copy is more likely a
/// constant the exporter did not share, such as a mask per layer.)
fn orders(from: &[i64], to: &[i64]) -> Vec<Vec<usize>> {
    let rank = from.len();
    let mut out = Vec::new();
    let mut perm = Vec::with_capacity(rank);
    let mut used = vec![false; rank];
    permutations(from, to, &mut perm, &mut used, &mut out);
    out.retain(|p| p.iter().enumerate().any(|(i, &a)| i != a));
    // The reversed order (a matrix's transpose) is what an exporter folds.
    let reversed: Vec<usize> = (0..rank).rev().collect();
    out.sort_by_key(|p| p != &reversed);
    out
}

fn permutations(from: &[i64], to: &[i64], perm: &mut Vec<usize>, used: &mut [bool], out: &mut Vec<Vec<usize>>) {
    let axis = perm.len();
    if axis == from.len() {
        out.push(perm.clone());
        return;
    }
    for p in 0..from.len() {
        if !used[p] && from[p] == to[axis] {
            used[p] = true;
            perm.push(p);
            permutations(from, to, perm, used, out);
            perm.pop();
            used[p] = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onnx_protobuf::StringStringEntryProto;
    use onnx_protobuf::ValueInfoProto;

    fn float_tensor(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
        TensorProto { name: name.into(), dims: dims.to_vec(), data_type: 1, float_data: values.to_vec(), ..Default::default() }
    }

    fn graph(initializers: Vec<TensorProto>) -> GraphProto {
        GraphProto { initializer: initializers, ..Default::default() }
    }

    #[test]
    fn a_transposed_copy_is_computed_from_its_source() {
        let embedding = float_tensor("wte", &[2, 3], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]);
        let projection = float_tensor("lm_head", &[3, 2], &[0.1, 0.4, 0.2, 0.5, 0.3, 0.6]);
        let mut g = graph(vec![embedding, projection]);
        let images = retie(&mut g, Path::new(".")).expect("reads");
        assert_eq!(images, [FoldedImage { name: "lm_head".into(), source: "wte".into(), perm: vec![1, 0] }]);
        assert_eq!(g.initializer.len(), 1);
        let node = &g.node[0];
        assert_eq!((node.op_type.as_str(), node.input.as_slice(), node.output.as_slice()), ("Transpose", &["wte".to_string()][..], &["lm_head".to_string()][..]));
        assert_eq!(node.attribute[0].ints, [1, 0]);
    }

    #[test]
    fn distinct_or_uniform_weights_stay_apart() {
        // The same first element, otherwise different: two weights.
        let a = float_tensor("a", &[2, 2], &[0.1, 0.2, 0.3, 0.4]);
        let b = float_tensor("b", &[2, 2], &[0.1, 0.3, 0.2, 0.5]);
        // All zeros: equal under every order, so nothing says they are one weight.
        let z1 = float_tensor("z1", &[2, 3], &[0.0; 6]);
        let z2 = float_tensor("z2", &[3, 2], &[0.0; 6]);
        let mut g = graph(vec![a, b, z1, z2]);
        assert!(retie(&mut g, Path::new(".")).expect("reads").is_empty());
        assert_eq!(g.initializer.len(), 4);
        assert!(g.node.is_empty());
    }

    #[test]
    fn with_records_only_what_was_folded_from_the_weight_is_taken() {
        let embedding = float_tensor("model.wte.weight", &[2, 3], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]);
        let folded = float_tensor("val_7", &[3, 2], &[0.1, 0.4, 0.2, 0.5, 0.3, 0.6]);
        // The same values, but recorded as folded from another weight: left alone.
        let other = float_tensor("val_9", &[3, 2], &[0.1, 0.4, 0.2, 0.5, 0.3, 0.6]);
        let record = |name: &str, sources: &str| ValueInfoProto {
            name: name.into(),
            metadata_props: vec![StringStringEntryProto { key: "pkg.onnxscript.optimizer.folded_from".into(), value: sources.into(), ..Default::default() }],
            ..Default::default()
        };
        let mut g = graph(vec![embedding, folded, other]);
        g.value_info = vec![record("val_7", "['model.wte.weight']"), record("val_9", "['model.other.weight', 't']")];
        let images = retie(&mut g, Path::new(".")).expect("reads");
        assert_eq!(images, [FoldedImage { name: "val_7".into(), source: "model.wte.weight".into(), perm: vec![1, 0] }]);
    }

    #[test]
    fn orders_put_the_transpose_first() {
        assert_eq!(orders(&[4, 4], &[4, 4]), [vec![1, 0]]);
        assert!(orders(&[2, 3], &[2, 3]).is_empty(), "an equal copy is no transpose");
        assert_eq!(orders(&[2, 3, 4], &[4, 2, 3]), [vec![2, 0, 1]]);
        assert!(orders(&[2, 3], &[2, 4]).is_empty());
    }
}
