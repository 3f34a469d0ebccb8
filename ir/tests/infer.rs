//! Shape inference through import of tiny hand-built models: broadcasting and MatMul
//! with the batch symbol, Reshape/Flatten, window ops, Split, Slice, folding of shape
//! subgraphs, op versions whose semantics are not implemented, and the quantization ops'
//! types and scale shapes (low-precision operands only reach casts and those ops).

mod common;

use std::path::Path;

use common::*;
use pipewright_ir::summary::Summary;
use pipewright_ir::{import_bytes, verify, BatchMode, Graph, ImportError, ImportOptions};
use onnx_protobuf::attribute_proto::AttributeType;
use onnx_protobuf::AttributeProto;
use protobuf::EnumOrUnknown;

fn try_import(m: &ModelBuilder, batch: BatchMode) -> Result<Graph, ImportError> {
    import_bytes(&m.bytes(), Path::new("."), &ImportOptions { batch, ..ImportOptions::default() })
}

fn import(m: &ModelBuilder) -> Graph {
    import_mode(m, BatchMode::Auto)
}

fn import_mode(m: &ModelBuilder, batch: BatchMode) -> Graph {
    let g = try_import(m, batch).unwrap_or_else(|e| panic!("import failed: {e}"));
    verify(&g).unwrap_or_else(|e| panic!("imported graph fails verification: {e:?}"));
    g
}

fn import_err(m: &ModelBuilder) -> ImportError {
    match try_import(m, BatchMode::Auto) {
        Ok(g) => panic!("import succeeded:\n{}", pipewright_ir::text::print_graph(&g)),
        Err(e) => e,
    }
}

/// The type of the value named `name`, as text (`f32[N,3,4]`).
fn ty(g: &Graph, name: &str) -> String {
    let v = g.value_ids().find(|v| g.value(*v).name == name).unwrap_or_else(|| panic!("no value {name:?}"));
    g.value(v).ty.to_string()
}

fn op_names(g: &Graph) -> Vec<&'static str> {
    g.topo_order().unwrap().into_iter().map(|n| g.node(n).op.name()).collect()
}

fn fixed(dims: &[i64]) -> Vec<Ax> {
    dims.iter().map(|&d| Ax::Fixed(d)).collect()
}

/// `x` of `dims` (axis 0 the batch), then `nodes`, with `outputs`.
fn model(opset: i64, dims: &[i64], nodes: Vec<onnx_protobuf::NodeProto>, outputs: &[&str]) -> ModelBuilder {
    let mut m = ModelBuilder::new(opset).input("x", F32, &fixed(dims));
    for n in nodes {
        m = m.node(n);
    }
    for o in outputs {
        m = m.output(o);
    }
    m
}

// ---------------------------------------------------------------- broadcasting

#[test]
fn broadcasting_keeps_a_named_batch() {
    let m = ModelBuilder::new(13)
        .input("x", F32, &["B".into(), 3.into(), 4.into()])
        .input("y", F32, &["B".into(), 1.into(), 1.into()])
        .init(tensor_f32("row", &[4], &[1.0, 2.0, 3.0, 4.0]))
        .init(tensor_f32("col", &[3, 1], &[1.0, 2.0, 3.0]))
        .node(node("Add", "add_xy", &["x", "y"], &["a"]))
        .node(node("Mul", "mul_row", &["a", "row"], &["b"]))
        .node(node("Sub", "sub_col", &["col", "b"], &["c"]))
        .output("c");
    let g = import(&m);
    let batch = g.batch.as_ref().expect("batch detected");
    assert_eq!(batch.name, "B");
    assert_eq!(ty(&g, "x"), "f32[N,3,4]");
    assert_eq!(ty(&g, "y"), "f32[N,1,1]");
    assert_eq!(ty(&g, "a"), "f32[N,3,4]");
    assert_eq!(ty(&g, "b"), "f32[N,3,4]");
    assert_eq!(ty(&g, "c"), "f32[N,3,4]");
}

#[test]
fn broadcasting_against_a_constant_baked_at_the_export_batch() {
    // x exported at batch 2; the mask constant carries that 2 on its leading axis.
    let m = model(13, &[2, 3, 4], vec![node("Add", "add_mask", &["x", "mask"], &["y"])], &["y"])
        .init(tensor_f32("mask", &[2, 1, 4], &[0.0; 8]));
    let g = import(&m);
    assert_eq!(g.batch.as_ref().unwrap().export_size, Some(2));
    assert_eq!(ty(&g, "mask"), "f32[2,1,4]");
    assert_eq!(ty(&g, "y"), "f32[N,3,4]");
    assert!(g.warnings.iter().any(|w| w.contains("\"mask\"") && w.contains("export batch")), "{:?}", g.warnings);

    let g = import_mode(&m, BatchMode::Fixed);
    assert!(g.batch.is_none());
    assert_eq!(ty(&g, "y"), "f32[2,3,4]");
}

#[test]
fn broadcasting_failure_is_reported_with_the_node() {
    let m = model(13, &[2, 3, 4], vec![node("Add", "bad_add", &["x", "w"], &["y"])], &["y"]).init(tensor_f32_zeros("w", &[5]));
    let e = import_err(&m);
    assert!(matches!(&e, ImportError::Shape { node, reason } if node.name == "bad_add" && reason.contains("do not broadcast")), "{e}");
    assert!(e.to_string().contains("\"bad_add\""), "{e}");
}

// ---------------------------------------------------------------- MatMul

#[test]
fn matmul_with_batch_dims() {
    let m = ModelBuilder::new(13)
        .input("a", F32, &fixed(&[2, 8, 16, 32]))
        .input("q", F32, &fixed(&[2, 4, 5, 6]))
        .input("k", F32, &fixed(&[2, 4, 6, 7]))
        .init(tensor_f32_zeros("w", &[32, 64]))
        .init(tensor_f32_zeros("v", &[6]))
        .init(tensor_f32_zeros("wb", &[1, 6, 3]))
        .node(node("MatMul", "proj", &["a", "w"], &["p"]))
        .node(node("MatMul", "scores", &["q", "k"], &["s"]))
        .node(node("MatMul", "vec", &["q", "v"], &["qv"]))
        .node(node("MatMul", "bcast", &["q", "wb"], &["qb"]))
        .output("p")
        .output("s")
        .output("qv")
        .output("qb");
    let g = import(&m);
    assert_eq!(ty(&g, "p"), "f32[N,8,16,64]");
    assert_eq!(ty(&g, "s"), "f32[N,4,5,7]");
    assert_eq!(ty(&g, "qv"), "f32[N,4,5]");
    assert_eq!(ty(&g, "qb"), "f32[N,4,5,3]");
}

#[test]
fn matmul_inner_mismatch() {
    let m = model(13, &[2, 3, 6], vec![node("MatMul", "mm", &["x", "w"], &["y"])], &["y"]).init(tensor_f32_zeros("w", &[5, 7]));
    let e = import_err(&m);
    assert!(matches!(&e, ImportError::Shape { reason, .. } if reason.contains("inner dimensions differ")), "{e}");
}

// ---------------------------------------------------------------- Reshape, Flatten

fn reshape_model(input: &[i64], target: &[i64]) -> ModelBuilder {
    model(13, input, vec![node("Reshape", "reshape", &["x", "shape"], &["y"])], &["y"])
        .init(tensor_i64("shape", &[target.len() as i64], target))
}

#[test]
fn reshape_with_minus_one() {
    assert_eq!(ty(&import(&reshape_model(&[2, 8], &[-1, 2, 4])), "y"), "f32[N,2,4]");
    assert_eq!(ty(&import(&reshape_model(&[2, 2, 4], &[0, -1])), "y"), "f32[N,8]");
    assert_eq!(ty(&import(&reshape_model(&[2, 8], &[-1])), "y"), "f32[8N]");
    // The input leads with the batch, so the leading 4 holds it (the export batch 2 times
    // 2): `[4, N, 2]` would put parts of two samples in one row at any other batch.
    assert_eq!(ty(&import(&reshape_model(&[2, 8], &[4, -1, 2])), "y"), "f32[2N,2,2]");
}

#[test]
fn reshape_with_a_literal_export_batch() {
    // Exported at batch 2: the target's leading 2 is the batch.
    assert_eq!(ty(&import(&reshape_model(&[2, 8], &[2, 2, 4])), "y"), "f32[N,2,4]");
    assert_eq!(ty(&import(&reshape_model(&[2, 2, 4], &[2, -1])), "y"), "f32[N,8]");
    // The batch folded into a larger leading extent.
    assert_eq!(ty(&import(&reshape_model(&[2, 8], &[4, 4])), "y"), "f32[2N,4]");
    // Next to a -1, a leading literal holds the batch folded with the next axis
    // (`view(batch * heads, -1, head)`), exported at batch 1 as at batch 2; the -1 is
    // what is left of one sample.
    assert_eq!(ty(&import(&reshape_model(&[1, 2, 6, 8], &[2, -1, 8])), "y"), "f32[2N,6,8]");
    assert_eq!(ty(&import(&reshape_model(&[2, 2, 6, 8], &[4, -1, 8])), "y"), "f32[2N,6,8]");
    // Where the input's first extent holds the batch and more (`[8N, 8]`, batch and
    // sequence merged), a leading literal equal to the export batch is the batch
    // (`view(batch, -1, heads, head)` exported at batch 1), not a 1 beside it.
    let two = model(13, &[1, 8, 8], vec![node("Reshape", "merge", &["x", "s1"], &["m"]), node("Reshape", "split", &["m", "s2"], &["y"])], &["y"])
        .init(tensor_i64("s1", &[2], &[8, 8]))
        .init(tensor_i64("s2", &[4], &[1, -1, 1, 8]));
    assert_eq!(ty(&import(&two), "m"), "f32[8N,8]");
    assert_eq!(ty(&import(&two), "y"), "f32[N,8,1,8]");
    // A sequence-first `view(seq, batch, -1)` of `[seq, N, heads, head]` (MLCD), written
    // with the export batch in the batch's place, keeps the batch there.
    let seq_first = model(13, &[1, 17, 2, 8], vec![node("Transpose", "t", &["x"], &["s"]).ints("perm", &[1, 0, 2, 3]), node("Reshape", "view", &["s", "shape"], &["y"])], &["y"])
        .init(tensor_i64("shape", &[3], &[17, 1, -1]));
    assert_eq!(ty(&import(&seq_first), "y"), "f32[17,N,16]");
    // With the batch fixed nothing is symbolic.
    assert_eq!(ty(&import_mode(&reshape_model(&[2, 8], &[2, 2, 4]), BatchMode::Fixed), "y"), "f32[2,2,4]");
}

#[test]
fn reshape_errors() {
    let e = import_err(&reshape_model(&[2, 8], &[-1, -1]));
    assert!(e.to_string().contains("more than one -1"), "{e}");
    let e = import_err(&reshape_model(&[2, 8], &[3, 5]));
    assert!(e.to_string().contains("cannot reshape"), "{e}");
    // MusicGen's `[batch * codebooks, seq]` input, its batch axis declared as the batch:
    // grouping its rows by codebook would cut the batch axis.
    let musicgen = ModelBuilder::new(13)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(6)])
        .node(node("Reshape", "reshape", &["x", "shape"], &["y"]))
        .output("y")
        .init(tensor_i64("shape", &[3], &[-1, 2, 6]));
    let e = import_err(&musicgen);
    assert!(
        e.to_string().contains("cannot reshape [N,6] to [-1,2,6]: it would cut the batch axis N into groups of 2 rows, so N must hold 2 rows per sample"),
        "{e}"
    );
}

#[test]
fn flatten() {
    let cases = [(1, "f32[N,60]"), (2, "f32[3N,20]"), (0, "f32[1,60N]"), (-1, "f32[12N,5]"), (4, "f32[60N,1]")];
    for (axis, want) in cases {
        let m = model(13, &[2, 3, 4, 5], vec![node("Flatten", "flat", &["x"], &["y"]).int("axis", axis)], &["y"]);
        assert_eq!(ty(&import(&m), "y"), want, "axis {axis}");
    }
    let m = model(13, &[2, 3, 4, 5], vec![node("Flatten", "flat", &["x"], &["y"]).int("axis", 5)], &["y"]);
    assert!(import_err(&m).to_string().contains("out of range"));
}

// ---------------------------------------------------------------- Conv and pools

fn conv_model(input: &[i64], weight: &[i64], f: impl FnOnce(onnx_protobuf::NodeProto) -> onnx_protobuf::NodeProto) -> ModelBuilder {
    model(13, input, vec![f(node("Conv", "conv", &["x", "w"], &["y"]))], &["y"]).init(tensor_f32_zeros("w", weight))
}

fn pool_model(op: &str, input: &[i64], f: impl FnOnce(onnx_protobuf::NodeProto) -> onnx_protobuf::NodeProto) -> ModelBuilder {
    model(13, input, vec![f(node(op, "pool", &["x"], &["y"]))], &["y"])
}

#[test]
fn conv_output_extents() {
    let g = import(&conv_model(&[2, 3, 32, 32], &[16, 3, 3, 3], |n| n.ints("pads", &[1, 1, 1, 1]).ints("strides", &[2, 2])));
    assert_eq!(ty(&g, "y"), "f32[N,16,16,16]");
    // Kernel taken from the weight, dilation 2: 10 - (3-1)*2 = 6.
    let g = import(&conv_model(&[2, 3, 10, 10], &[8, 3, 3, 3], |n| n.ints("dilations", &[2, 2])));
    assert_eq!(ty(&g, "y"), "f32[N,8,6,6]");
    // Asymmetric pads on one side.
    let g = import(&conv_model(&[2, 3, 5, 5], &[4, 3, 2, 2], |n| n.ints("pads", &[0, 0, 1, 1])));
    assert_eq!(ty(&g, "y"), "f32[N,4,5,5]");
    // Grouped.
    let g = import(&conv_model(&[2, 4, 8, 8], &[8, 2, 3, 3], |n| n.int("group", 2)));
    assert_eq!(ty(&g, "y"), "f32[N,8,6,6]");
}

#[test]
fn conv_same_padding() {
    for mode in ["SAME_UPPER", "SAME_LOWER"] {
        let g = import(&conv_model(&[2, 3, 33, 33], &[4, 3, 3, 3], |n| n.string("auto_pad", mode).ints("strides", &[2, 2])));
        assert_eq!(ty(&g, "y"), "f32[N,4,17,17]", "{mode}");
        let g = import(&conv_model(&[2, 3, 7, 9], &[4, 3, 3, 3], |n| n.string("auto_pad", mode)));
        assert_eq!(ty(&g, "y"), "f32[N,4,7,9]", "{mode}");
    }
    let g = import(&conv_model(&[2, 3, 7, 7], &[4, 3, 3, 3], |n| n.string("auto_pad", "VALID").ints("strides", &[2, 2])));
    assert_eq!(ty(&g, "y"), "f32[N,4,3,3]");
}

#[test]
fn conv_channel_mismatch() {
    let e = import_err(&conv_model(&[2, 3, 8, 8], &[4, 5, 3, 3], |n| n));
    assert!(matches!(&e, ImportError::Shape { reason, .. } if reason.contains("channels")), "{e}");
}

#[test]
fn pool_ceil_mode() {
    let k3s2 = |ceil: i64| move |n: onnx_protobuf::NodeProto| n.ints("kernel_shape", &[3, 3]).ints("strides", &[2, 2]).int("ceil_mode", ceil);
    assert_eq!(ty(&import(&pool_model("MaxPool", &[2, 3, 32, 32], k3s2(0))), "y"), "f32[N,3,15,15]");
    assert_eq!(ty(&import(&pool_model("MaxPool", &[2, 3, 32, 32], k3s2(1))), "y"), "f32[N,3,16,16]");
    assert_eq!(ty(&import(&pool_model("AveragePool", &[2, 3, 32, 32], k3s2(1))), "y"), "f32[N,3,16,16]");
    // ceil_mode would add a window starting in the trailing pad; it is dropped:
    // 5 + 1 + 1 - 2 = 5 -> ceil(5/2) + 1 = 4, but the 4th window starts at 6 >= 5 + 1.
    let clipped = |n: onnx_protobuf::NodeProto| n.ints("kernel_shape", &[2, 2]).ints("strides", &[2, 2]).ints("pads", &[1, 1, 1, 1]).int("ceil_mode", 1);
    assert_eq!(ty(&import(&pool_model("MaxPool", &[2, 3, 5, 5], clipped)), "y"), "f32[N,3,3,3]");
    // ResNet's stem pool.
    let stem = |n: onnx_protobuf::NodeProto| n.ints("kernel_shape", &[3, 3]).ints("strides", &[2, 2]).ints("pads", &[1, 1, 1, 1]);
    assert_eq!(ty(&import(&pool_model("MaxPool", &[2, 64, 112, 112], stem)), "y"), "f32[N,64,56,56]");
}

#[test]
fn pool_same_padding() {
    for mode in ["SAME_UPPER", "SAME_LOWER"] {
        let f = |n: onnx_protobuf::NodeProto| n.ints("kernel_shape", &[3, 3]).ints("strides", &[2, 2]).string("auto_pad", mode);
        assert_eq!(ty(&import(&pool_model("AveragePool", &[2, 3, 7, 8], f)), "y"), "f32[N,3,4,4]", "{mode}");
    }
    let g = import(&pool_model("GlobalAveragePool", &[2, 3, 7, 8], |n| n));
    assert_eq!(ty(&g, "y"), "f32[N,3,1,1]");
}

#[test]
fn pool_without_kernel_shape() {
    let e = import_err(&pool_model("MaxPool", &[2, 3, 8, 8], |n| n));
    assert!(e.to_string().contains("kernel_shape"), "{e}");
}

// ---------------------------------------------------------------- Split

#[test]
fn split_equal() {
    let m = model(13, &[2, 9], vec![node("Split", "split", &["x"], &["a", "b", "c"]).int("axis", 1)], &["a", "b", "c"]);
    let g = import(&m);
    for v in ["a", "b", "c"] {
        assert_eq!(ty(&g, v), "f32[N,3]");
    }
}

#[test]
fn split_uneven_sizes_from_an_input() {
    let m = model(13, &[2, 8], vec![node("Split", "split", &["x", "sizes"], &["a", "b"]).int("axis", 1)], &["a", "b"])
        .init(tensor_i64("sizes", &[2], &[2, 6]));
    let g = import(&m);
    assert_eq!(ty(&g, "a"), "f32[N,2]");
    assert_eq!(ty(&g, "b"), "f32[N,6]");
}

#[test]
fn split_uneven_sizes_from_the_attribute() {
    let m = model(11, &[2, 4], vec![node("Split", "split", &["x"], &["a", "b"]).int("axis", -1).ints("split", &[1, 3])], &["a", "b"]);
    let g = import(&m);
    assert_eq!(ty(&g, "a"), "f32[N,1]");
    assert_eq!(ty(&g, "b"), "f32[N,3]");
}

#[test]
fn split_num_outputs_uneven() {
    // Opset 18: 8 into 3 parts is 3, 3, 2.
    let m = model(18, &[2, 8], vec![node("Split", "split", &["x"], &["a", "b", "c"]).int("axis", 1).int("num_outputs", 3)], &["a", "b", "c"]);
    let g = import(&m);
    assert_eq!([ty(&g, "a"), ty(&g, "b"), ty(&g, "c")], ["f32[N,3]", "f32[N,3]", "f32[N,2]"]);
}

/// A fixed-batch export's Split of an axis of `5 N` rows (the export batch 2 tiled five
/// times) into whole row groups, `[8, 2]` at batch 2, follows the batch as `[4N, N]`.
#[test]
fn split_into_row_groups_of_a_fixed_batch_follows_the_batch() {
    let m = model(13, &[2, 4], vec![node("Tile", "tile", &["x", "reps"], &["t"]), node("Split", "split", &["t", "sizes"], &["a", "b"]).int("axis", 0)], &["a", "b"])
        .init(tensor_i64("reps", &[2], &[5, 1]))
        .init(tensor_i64("sizes", &[2], &[8, 2]));
    let g = import(&m);
    assert_eq!([ty(&g, "t"), ty(&g, "a"), ty(&g, "b")], ["f32[5N,4]", "f32[4N,4]", "f32[N,4]"]);
    assert!(g.warnings.iter().any(|w| w.contains("into parts of [8, 2] rows is read as a split into [4, 1] row groups")), "{:?}", g.warnings);
}

/// A ScatterND of no updates is its data, whatever batch its empty updates were exported
/// with.
#[test]
fn a_scatter_of_no_updates_is_its_data() {
    let m = model(13, &[2, 4], vec![node("ScatterND", "scatter", &["x", "nowhere", "nothing"], &["y"])], &["y"])
        .init(tensor_i64("nowhere", &[0, 1], &[]))
        .init(tensor_f32("nothing", &[0, 4], &[]));
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "f32[N,4]");
    assert_eq!(op_names(&g), ["Identity"]);
    assert!(g.warnings.iter().any(|w| w.contains("a ScatterND of no updates")), "{:?}", g.warnings);
}

#[test]
fn split_sizes_that_do_not_add_up() {
    let m = model(13, &[2, 8], vec![node("Split", "split", &["x", "sizes"], &["a", "b"]).int("axis", 1)], &["a", "b"])
        .init(tensor_i64("sizes", &[2], &[2, 5]));
    let e = import_err(&m);
    assert!(e.to_string().contains("do not add up"), "{e}");
}

// ---------------------------------------------------------------- Slice

fn slice_model(starts: i64, ends: i64, axis: i64, step: i64) -> ModelBuilder {
    model(13, &[2, 10], vec![node("Slice", "slice", &["x", "starts", "ends", "axes", "steps"], &["y"])], &["y"])
        .init(tensor_i64("starts", &[1], &[starts]))
        .init(tensor_i64("ends", &[1], &[ends]))
        .init(tensor_i64("axes", &[1], &[axis]))
        .init(tensor_i64("steps", &[1], &[step]))
}

#[test]
fn slice_with_negative_steps() {
    // 8, 6, 4, 2
    assert_eq!(ty(&import(&slice_model(8, 1, 1, -2)), "y"), "f32[N,4]");
    // The whole axis reversed.
    assert_eq!(ty(&import(&slice_model(-1, i64::MIN, 1, -1)), "y"), "f32[N,10]");
    // 9, 6, 3, 0: an end of -11 clamps to "before index 0".
    assert_eq!(ty(&import(&slice_model(-1, -11, 1, -3)), "y"), "f32[N,4]");
    // Out-of-range start clamps to the last index: 9, 8, 7.
    assert_eq!(ty(&import(&slice_model(100, 6, 1, -1)), "y"), "f32[N,3]");
    // Nothing selected.
    assert_eq!(ty(&import(&slice_model(2, 5, 1, -1)), "y"), "f32[N,0]");
}

#[test]
fn slice_over_the_batch_axis() {
    // Reversing the whole batch keeps N.
    assert_eq!(ty(&import(&slice_model(-1, i64::MIN, 0, -1)), "y"), "f32[N,10]");
    // The whole batch, forwards.
    assert_eq!(ty(&import(&slice_model(0, i64::MAX, 0, 1)), "y"), "f32[N,10]");
    // A fixed part of it is fixed.
    assert_eq!(ty(&import(&slice_model(0, 1, 0, 1)), "y"), "f32[1,10]");
}

/// `x` ([N, 10]) twice along the batch axis ([2N, 10]), sliced from `start` to `end`
/// along it, where each bound is a literal or `"n"`, the batch size read from `x`'s
/// shape (TimeSformer's `embeddings[:batch_size]` of its frames merged into the batch).
fn slice_by_the_batch_model(start: Option<i64>, end: Option<i64>) -> ModelBuilder {
    let bound = |name: &str, v: Option<i64>| match v {
        Some(v) => node("Constant", name, &[], &[name]).tensor("value", tensor_i64("", &[1], &[v])),
        None => node("Shape", name, &["x"], &[name]).int("start", 0).int("end", 1),
    };
    model(
        15,
        &[2, 10],
        vec![
            node("Concat", "frames", &["x", "x"], &["t"]).int("axis", 0),
            bound("start", start),
            bound("end", end),
            node("Slice", "slice", &["t", "start", "end", "axes0"], &["y"]),
        ],
        &["y"],
    )
    .init(tensor_i64("axes0", &[1], &[0]))
}

#[test]
fn slice_bounded_by_the_batch_size() {
    // t[:N] and t[N:] of t: [2N, 10] are N rows at every batch size.
    assert_eq!(ty(&import(&slice_by_the_batch_model(Some(0), None)), "y"), "f32[N,10]");
    assert_eq!(ty(&import(&slice_by_the_batch_model(None, Some(i64::MAX))), "y"), "f32[N,10]");
    // t[N:N] is empty.
    assert_eq!(ty(&import(&slice_by_the_batch_model(None, None)), "y"), "f32[0,10]");
    // t[1:N] has N - 1 rows, which no extent of pipewright's states: refused, saying so.
    assert_shape_error(&slice_by_the_batch_model(Some(1), None), &["\"slice\"", "slice 1..N (step 1) of an axis of extent 2N", "followed only where both bounds are multiples of it"]);
}

#[test]
fn slice_with_step_zero() {
    let e = import_err(&slice_model(0, 5, 1, 0));
    assert!(matches!(e, ImportError::Shape { .. }), "{e}");
}

// ---------------------------------------------------------------- folding shape subgraphs

/// `y = Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1]))`, the exporter's
/// `x.view(x.size(0), -1)`, with x: [2,3,4].
fn view_model() -> ModelBuilder {
    model(
        13,
        &[2, 3, 4],
        vec![
            node("Shape", "shape", &["x"], &["s"]),
            node("Constant", "zero", &[], &["zero"]).tensor("value", tensor_i64("", &[], &[0])),
            node("Gather", "gather", &["s", "zero"], &["d0"]).int("axis", 0),
            node("Unsqueeze", "unsqueeze", &["d0", "axes0"], &["d0u"]),
            node("Concat", "concat", &["d0u", "minus1"], &["target"]).int("axis", 0),
            node("Reshape", "view", &["x", "target"], &["y"]),
        ],
        &["y"],
    )
    .init(tensor_i64("axes0", &[1], &[0]))
    .init(tensor_i64("minus1", &[1], &[-1]))
}

#[test]
fn fixed_batch_folds_the_shape_subgraph() {
    let g = import_mode(&view_model(), BatchMode::Fixed);
    assert_eq!(op_names(&g), ["Reshape"], "{}", pipewright_ir::text::print_graph(&g));
    assert_eq!(ty(&g, "y"), "f32[2,12]");
    assert_eq!(ty(&g, "target"), "i64[2]");
    let text = pipewright_ir::text::print_graph(&g);
    assert!(text.contains("const \"target\" [2, -1]"), "{text}");
    let s = Summary::of(&g);
    assert_eq!(s.nodes, 1);
    assert_eq!(s.parameters, 0);
}

/// With the batch symbolic, the target computed from the input's shape is known up to the
/// batch: the Reshape reads a constant with -1 for it and the chain is removed.
#[test]
fn auto_batch_turns_a_target_computed_from_the_batch_into_a_constant() {
    let g = import(&view_model());
    let text = pipewright_ir::text::print_graph(&g);
    assert_eq!(op_names(&g), ["Reshape"], "{text}");
    assert!(text.contains("i64[2] = const \"view/target\" [-1, 12]"), "{text}");
    assert_eq!(ty(&g, "y"), "f32[N,12]");
}

#[test]
fn auto_batch_folds_shape_reads_that_avoid_the_batch() {
    // Shape(x)[1:] does not involve N: the Shape/Slice pair folds even with Auto, and
    // Reshape gets [N,...] by putting the batch back in front.
    let m = model(
        13,
        &[2, 3, 4],
        vec![
            node("Shape", "shape", &["x"], &["s"]).int("start", 1),
            node("Concat", "concat", &["minus1", "s"], &["target"]).int("axis", 0),
            node("Reshape", "view", &["x", "target"], &["y"]),
        ],
        &["y"],
    )
    .init(tensor_i64("minus1", &[1], &[-1]));
    let g = import(&m);
    assert_eq!(op_names(&g), ["Reshape"], "{}", pipewright_ir::text::print_graph(&g));
    assert_eq!(ty(&g, "y"), "f32[N,3,4]");
}

// ---------------------------------------------------------------- op versions

#[test]
fn op_version_without_implemented_semantics() {
    let m = ModelBuilder::new(6)
        .input("x", F32, &fixed(&[2, 4]))
        .init(tensor_f32_zeros("b", &[4]))
        .node(node("Equal", "old_equal", &["x", "b"], &["y"]))
        .output("y");
    let e = import_err(&m);
    assert!(
        matches!(&e, ImportError::OpVersion { node, op, opset: 6, version: 1, from: 7 } if node.name == "old_equal" && op == "Equal"),
        "{e:?}"
    );
    let msg = e.to_string();
    for w in ["\"old_equal\"", "Equal", "opset 6", "version 1", "supported from version 7"] {
        assert!(msg.contains(w), "{w:?} missing from: {msg}");
    }

    // The first implemented version imports.
    let mut m7 = m.clone();
    m7.model.opset_import[0].version = 7;
    assert_eq!(ty(&import(&m7), "y"), "bool[N,4]");
}

/// Before opset 7, `broadcast = 1` with `axis` aligns input 1 with input 0's axes from
/// `axis` on (numpy would align it with the trailing axes), and PRelu's `[C]` slope is
/// per channel: both import as an Unsqueeze of input 1 with trailing unit axes.
#[test]
fn legacy_broadcast_aligns_from_the_axis() {
    let m = ModelBuilder::new(6)
        .input("x", F32, &fixed(&[2, 3, 4]))
        .init(tensor_f32_zeros("b", &[3]))
        .node(node("Add", "add_at_axis_1", &["x", "b"], &["y"]).int("broadcast", 1).int("axis", 1))
        .node(node("PRelu", "prelu_per_channel", &["y", "b"], &["z"]))
        .node(node("Mul", "mul_trailing", &["z", "w"], &["out"]).int("broadcast", 1))
        .init(tensor_f32_zeros("w", &[4]))
        .output("out");
    let g = import(&m);
    assert_eq!(ty(&g, "out"), "f32[N,3,4]");
    let unsqueezes: Vec<String> = g.node_ids().filter(|&n| g.node(n).op.name() == "Unsqueeze").map(|n| g.node(n).op.to_string()).collect();
    assert_eq!(unsqueezes, ["Unsqueeze[axes=[1]]", "Unsqueeze[axes=[1]]"]);
    // Input 1 that does not fit from the axis is refused, naming the node.
    let bad = ModelBuilder::new(6)
        .input("x", F32, &fixed(&[2, 3]))
        .init(tensor_f32_zeros("b", &[3]))
        .node(node("Add", "add_off_the_end", &["x", "b"], &["y"]).int("broadcast", 1).int("axis", 1 + 1))
        .output("y");
    let msg = import_err(&bad).to_string();
    assert!(msg.contains("add_off_the_end") && msg.contains("broadcast axis 2"), "{msg}");
}

#[test]
fn op_that_does_not_exist_at_the_opset() {
    // Gelu is defined from opset 20.
    let m = model(17, &[2, 4], vec![node("Gelu", "gelu", &["x"], &["y"])], &["y"]);
    let e = import_err(&m);
    assert!(matches!(&e, ImportError::OpNotInOpset { opset: 17, .. }), "{e:?}");
    assert!(e.to_string().contains("does not exist at opset 17"), "{e}");
    let mut m20 = m.clone();
    m20.model.opset_import[0].version = 20;
    assert_eq!(ty(&import(&m20), "y"), "f32[N,4]");
}

#[test]
fn unsupported_attribute_is_an_error() {
    let m = model(13, &[2, 4], vec![node("Relu", "relu", &["x"], &["y"]).int("bogus", 1)], &["y"]);
    let e = import_err(&m);
    assert!(e.to_string().contains("\"bogus\"") && e.to_string().contains("not supported"), "{e}");
}

/// BitCast keeps the shape and reads the bits as `to`; types of another width are refused
/// naming the node and both widths.
#[test]
fn bitcast_needs_types_of_one_width() {
    let m = model(26, &[2, 4], vec![node("BitCast", "bc", &["x"], &["y"]).int("to", 6)], &["y"]);
    assert_eq!(ty(&import(&m), "y"), "i32[N,4]");
    let m = model(26, &[2, 4], vec![node("BitCast", "bc", &["x"], &["y"]).int("to", 7)], &["y"]);
    assert_shape_error(&m, &["\"bc\"", "bitcast from f32 (32 bits) to i64 (64 bits): the types must have the same width"]);
}

// ---------------------------------------------------------------- malformed models: errors, never panics

#[test]
fn slice_start_clamps_for_negative_steps() {
    // With a negative step the start clamps to [0, n-1]: -100 becomes 0, one element.
    assert_eq!(ty(&import(&slice_model(-100, i64::MIN, 1, -1)), "y"), "f32[N,1]");
    // 100 becomes 9: the whole axis.
    assert_eq!(ty(&import(&slice_model(100, i64::MIN, 1, -1)), "y"), "f32[N,10]");
    // A step larger than the axis selects the start only (and does not overflow).
    assert_eq!(ty(&import(&slice_model(1, i64::MAX, 1, i64::MAX)), "y"), "f32[N,1]");
    assert_eq!(ty(&import(&slice_model(-1, i64::MIN, 1, i64::MIN)), "y"), "f32[N,1]");
}

fn assert_shape_error(m: &ModelBuilder, words: &[&str]) {
    let e = std::panic::catch_unwind(|| import_err(m)).expect("import panicked instead of reporting an error");
    let msg = e.to_string();
    for w in words {
        assert!(msg.contains(w), "{w:?} missing from: {msg}");
    }
}

#[test]
fn zero_strides_and_dilations() {
    let m = conv_model(&[2, 3, 8, 8], &[4, 3, 3, 3], |n| n.ints("strides", &[0, 0]));
    assert_shape_error(&m, &["\"conv\"", "must be positive"]);
    let m = conv_model(&[2, 3, 8, 8], &[4, 3, 3, 3], |n| n.ints("dilations", &[1, 0]));
    assert_shape_error(&m, &["must be positive"]);
    let m = pool_model("MaxPool", &[2, 3, 8, 8], |n| n.ints("kernel_shape", &[2, 2]).ints("strides", &[0, 0]).string("auto_pad", "SAME_UPPER"));
    assert_shape_error(&m, &["\"pool\"", "must be positive"]);
    let m = pool_model("AveragePool", &[2, 3, 8, 8], |n| n.ints("kernel_shape", &[0, 2]));
    assert_shape_error(&m, &["must be positive"]);
}

#[test]
fn absurd_window_attributes() {
    let big = i64::MAX;
    let m = conv_model(&[2, 3, 8, 8], &[4, 3, 3, 3], |n| n.ints("pads", &[big, big, big, big]));
    assert_shape_error(&m, &["\"conv\"", "out of range"]);
    let m = model(13, &[2, 3, 8, 8], vec![node("ConvTranspose", "deconv", &["x", "w"], &["y"]).ints("strides", &[big, big])], &["y"])
        .init(tensor_f32_zeros("w", &[3, 4, 3, 3]));
    assert_shape_error(&m, &["\"deconv\"", "out of range"]);
    // One stride for two spatial axes.
    let m = model(13, &[2, 3, 8, 8], vec![node("ConvTranspose", "deconv", &["x", "w"], &["y"]).ints("strides", &[2])], &["y"])
        .init(tensor_f32_zeros("w", &[3, 4, 3, 3]));
    assert_shape_error(&m, &["\"deconv\"", "2 spatial dimensions"]);
    let ok = model(13, &[2, 3, 8, 8], vec![node("ConvTranspose", "deconv", &["x", "w"], &["y"]).ints("strides", &[2, 2])], &["y"])
        .init(tensor_f32_zeros("w", &[3, 4, 3, 3]));
    assert_eq!(ty(&import(&ok), "y"), "f32[N,4,17,17]");
}

#[test]
fn absurd_pads_and_repeats() {
    let m = model(13, &[2, 3], vec![node("Pad", "pad", &["x", "pads"], &["y"])], &["y"]).init(tensor_i64("pads", &[4], &[0, i64::MAX, 0, i64::MAX]));
    assert_shape_error(&m, &["\"pad\"", "overflow"]);
    let m = model(13, &[2, 3], vec![node("Tile", "tile", &["x", "reps"], &["y"])], &["y"]).init(tensor_i64("reps", &[2], &[-1, 2]));
    assert_shape_error(&m, &["\"tile\"", "must not be negative"]);
    let m = model(13, &[2, 3], vec![node("Tile", "tile", &["x", "reps"], &["y"])], &["y"]).init(tensor_i64("reps", &[2], &[i64::MAX, 2]));
    assert_shape_error(&m, &["\"tile\"", "overflow"]);
    let ok = model(13, &[2, 3], vec![node("Tile", "tile", &["x", "reps"], &["y"])], &["y"]).init(tensor_i64("reps", &[2], &[3, 0]));
    assert_eq!(ty(&import(&ok), "y"), "f32[3N,0]");
}

#[test]
fn sizes_that_overflow() {
    let big = 1i64 << 32;
    let m = ModelBuilder::new(13).input("x", F32, &fixed(&[2, big, big])).node(node("Flatten", "flat", &["x"], &["y"])).output("y");
    assert_shape_error(&m, &["tensor \"x\"", "too large"]);
    let m = model(13, &[2, 3], vec![node("ConstantOfShape", "fill", &["shape"], &["y"])], &["y"]).init(tensor_i64("shape", &[3], &[big, big, 4]));
    assert_shape_error(&m, &["\"fill\"", "too large"]);
    let m = model(13, &[2, 3], vec![node("Range", "range", &["a", "b", "c"], &["y"])], &["y"])
        .init(tensor_i64("a", &[], &[0]))
        .init(tensor_i64("b", &[], &[i64::MAX]))
        .init(tensor_i64("c", &[], &[1]));
    assert_shape_error(&m, &["\"range\"", "too large"]);
}

#[test]
fn integer_folding_that_would_overflow_is_left_unfolded() {
    // i64::MIN / -1, i64::MIN % -1, |i64::MIN| and i64::MIN - 1 have no i64 result.
    let m = ModelBuilder::new(13)
        .input("x", F32, &fixed(&[2, 3]))
        .init(tensor_i64("min", &[1], &[i64::MIN]))
        .init(tensor_i64("m1", &[1], &[-1]))
        .init(tensor_i64("one", &[1], &[1]))
        .node(node("Div", "div", &["min", "m1"], &["q"]))
        .node(node("Mod", "mod", &["min", "m1"], &["r"]))
        .node(node("Abs", "abs", &["min"], &["a"]))
        .node(node("Sub", "sub", &["min", "one"], &["s"]))
        .node(node("Neg", "neg", &["min"], &["n"]))
        .output("q")
        .output("r")
        .output("a")
        .output("s")
        .output("n");
    let g = std::panic::catch_unwind(|| import(&m)).expect("import panicked");
    assert_eq!(op_names(&g), ["Div", "Mod", "Abs", "Sub", "Neg"]);
    // Exact integer shape arithmetic still folds.
    let m = ModelBuilder::new(13)
        .input("x", F32, &fixed(&[2, 3]))
        .init(tensor_i64("a", &[1], &[-7]))
        .init(tensor_i64("b", &[1], &[3]))
        .node(node("Mod", "mod", &["a", "b"], &["r"]))
        .node(node("Div", "div", &["a", "b"], &["q"]))
        .node(node("Concat", "cat", &["r", "q"], &["y"]).int("axis", 0))
        .output("y");
    let g = import(&m);
    assert!(op_names(&g).is_empty());
    // Mod takes the divisor's sign (2), Div truncates (-2).
    assert!(pipewright_ir::text::print_graph(&g).contains("const \"y\" [2, -2]"), "{}", pipewright_ir::text::print_graph(&g));
}

#[test]
fn softmax_axis_is_checked() {
    let m = model(13, &[2, 10], vec![node("Softmax", "sm", &["x"], &["y"]).int("axis", 2)], &["y"]);
    assert_shape_error(&m, &["\"sm\"", "axis 2 out of range"]);
    let m = model(13, &[2, 10], vec![node("LogSoftmax", "lsm", &["x"], &["y"]).int("axis", -3)], &["y"]);
    assert_shape_error(&m, &["\"lsm\"", "out of range"]);
    // Before opset 13 the axis splits a 2-D view, and the rank itself is allowed.
    let m = model(11, &[2, 10], vec![node("Softmax", "sm", &["x"], &["y"]).int("axis", 2)], &["y"]);
    assert_eq!(ty(&import(&m), "y"), "f32[N,10]");
}

#[test]
fn batch_arithmetic_in_shape_subgraphs() {
    // target = [2*N - N, -1]: the batch survives subtraction of batch multiples.
    let m = model(
        13,
        &[2, 3, 4],
        vec![
            node("Shape", "shape", &["x"], &["s"]),
            node("Gather", "gather", &["s", "zero"], &["d0"]).int("axis", 0),
            node("Mul", "twice", &["d0", "two"], &["d2"]),
            node("Sub", "sub", &["d2", "d0"], &["d"]),
            node("Unsqueeze", "unsqueeze", &["d", "axes0"], &["du"]),
            node("Concat", "concat", &["du", "minus1"], &["target"]).int("axis", 0),
            node("Reshape", "view", &["x", "target"], &["y"]),
        ],
        &["y"],
    )
    .init(tensor_i64("zero", &[], &[0]))
    .init(tensor_i64("two", &[], &[2]))
    .init(tensor_i64("axes0", &[1], &[0]))
    .init(tensor_i64("minus1", &[1], &[-1]));
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "f32[N,12]");
    // With the batch fixed the whole subgraph folds.
    let g = import_mode(&m, BatchMode::Fixed);
    assert_eq!(op_names(&g), ["Reshape"]);
    assert_eq!(ty(&g, "y"), "f32[2,12]");
}

/// The default exporter's copies at constant indices shaped for the export batch: a
/// Gather of every element of a flattened tensor in order (`as_strided`) becomes a Reshape
/// that leaves the batch free, and a GatherND listing every element in order (an
/// attention mask's copy) the tensor itself; both follow the batch. Indices in any other
/// order stay a Gather, at the export batch.
#[test]
fn identity_gathers_at_the_export_batch_follow_the_batch() {
    let all: Vec<i64> = (0..2 * 3 * 2).collect();
    let m = model(17, &[2, 3, 2], vec![node("Reshape", "flat", &["x", "minus_one"], &["f"]), node("Gather", "as_strided", &["f", "idx"], &["y"])], &["y"])
        .init(tensor_i64("minus_one", &[1], &[-1]))
        .init(tensor_i64("idx", &[2, 6], &all));
    let g = import(&m);
    assert_eq!(op_names(&g), ["Reshape", "Reshape"]);
    assert_eq!(ty(&g, "y"), "f32[N,6]");
    let mut shuffled = all.clone();
    shuffled.swap(0, 1);
    let m = model(17, &[2, 3, 2], vec![node("Reshape", "flat", &["x", "minus_one"], &["f"]), node("Gather", "g", &["f", "idx"], &["y"])], &["y"])
        .init(tensor_i64("minus_one", &[1], &[-1]))
        .init(tensor_i64("idx", &[2, 6], &shuffled));
    assert_eq!(op_names(&import(&m)), ["Reshape", "Gather"]);

    let pairs: Vec<i64> = (0..2).flat_map(|b| (0..3).flat_map(move |s| [b, s])).collect();
    let m = ModelBuilder::new(17)
        .input("mask", I64, &fixed(&[2, 3]))
        .init(tensor_i64("idx", &[2, 3, 2], &pairs))
        .node(node("GatherND", "copy", &["mask", "idx"], &["y"]))
        .output("y");
    let g = import(&m);
    assert_eq!(op_names(&g), ["Identity"]);
    assert_eq!(ty(&g, "y"), "i64[N,3]");

    // A ScatterND over every element (its indices a Concat of expanded aranges, as the
    // TorchScript exporter builds a causal mask's) is its updates.
    let m = ModelBuilder::new(17)
        .input("x", F32, &fixed(&[2, 3]))
        .init(tensor_f32("mask", &[2, 3], &[0.0; 6]))
        .init(tensor_i64("rows", &[2, 1, 1], &[0, 1]))
        .init(tensor_i64("cols", &[1, 3, 1], &[0, 1, 2]))
        .init(tensor_i64("grid", &[3], &[2, 3, 1]))
        .node(node("Expand", "r", &["rows", "grid"], &["r"]))
        .node(node("Expand", "c", &["cols", "grid"], &["c"]))
        .node(node("Concat", "idx", &["r", "c"], &["idx"]).int("axis", -1))
        .node(node("ScatterND", "fill", &["mask", "idx", "x"], &["y"]))
        .output("y");
    let g = import(&m);
    assert!(op_names(&g).ends_with(&["Identity"]), "{:?}", op_names(&g));
    assert_eq!(ty(&g, "y"), "f32[N,3]");

    // A ScatterElements writing each element of a cache of the export batch at its own
    // position along axis 1 (positions expanded over the batch, as Gemma 2's fixed-batch
    // TorchScript export writes its cache) is its updates; one position off is not.
    let cache = |positions: [i64; 3]| {
        ModelBuilder::new(17)
            .input("x", F32, &fixed(&[2, 3, 2]))
            .init(tensor_f32("cache", &[2, 3, 2], &[0.0; 12]))
            .init(tensor_i64("positions", &[1, 3, 1], &positions))
            .init(tensor_i64("grid", &[3], &[2, 3, 2]))
            .node(node("Expand", "at", &["positions", "grid"], &["at"]))
            .node(node("ScatterElements", "write", &["cache", "at", "x"], &["y"]).int("axis", 1))
            .output("y")
    };
    let g = import(&cache([0, 1, 2]));
    assert!(op_names(&g).ends_with(&["Identity"]), "{:?}", op_names(&g));
    assert_eq!(ty(&g, "y"), "f32[N,3,2]");
    assert!(g.warnings.iter().any(|w| w.contains("ScatterElements writing every element")), "{:?}", g.warnings);
    let g = import(&cache([0, 2, 1]));
    assert!(op_names(&g).ends_with(&["ScatterElements"]), "{:?}", op_names(&g));
}

/// A model whose batch axis is already dynamic records no export batch: the IR's text
/// says `dynamic` (and parses back), and the summary says the size is not recorded, where
/// a fixed-batch export states the batch it was exported at.
#[test]
fn the_export_batch_is_stated_as_found() {
    let m = ModelBuilder::new(17).input("x", F32, &[Ax::Param("batch"), Ax::Fixed(3)]).node(node("Relu", "r", &["x"], &["y"])).output("y");
    let g = import(&m);
    assert_eq!(g.batch.as_ref().unwrap().export_size, None);
    let text = pipewright_ir::text::print_graph(&g);
    assert!(text.contains("batch=N(\"batch\", dynamic)"), "{text}");
    let back = pipewright_ir::parse_graph(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(pipewright_ir::text::print_graph(&back), text);
    let summary = pipewright_ir::summary::Summary::of(&g).text();
    assert!(summary.contains("batch:       N = \"batch\" (a dynamic axis in the model; the export batch is not recorded)"), "{summary}");

    let fixed = ModelBuilder::new(17).input("x", F32, &[Ax::Fixed(2), Ax::Fixed(3)]).node(node("Relu", "r", &["x"], &["y"])).output("y");
    let summary = pipewright_ir::summary::Summary::of(&import(&fixed)).text();
    assert!(summary.contains("(exported at the fixed batch 2, made symbolic)"), "{summary}");
}

/// What a dynamic-batch export of a transformer does to index its rows: `arange` over the
/// batch (from `Shape`) and a `GatherND` with the result.
#[test]
fn range_over_the_batch_and_gather_nd() {
    let m = ModelBuilder::new(20)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(5), Ax::Fixed(3)])
        .init(tensor_i64("zero", &[], &[0]))
        .init(tensor_i64("one", &[], &[1]))
        .init(tensor_i64("last", &[1], &[-1]))
        .node(node("Shape", "shape", &["x"], &["s"]).int("start", 0).int("end", 1))
        .node(node("Squeeze", "n", &["s"], &["n"]))
        .node(node("Range", "rows", &["zero", "n", "one"], &["rows"]))
        .node(node("Unsqueeze", "col", &["rows", "last"], &["idx"]))
        .node(node("GatherND", "pick", &["x", "idx"], &["y"]))
        .node(node("GatherND", "pick_b", &["x", "pairs"], &["z"]).int("batch_dims", 1))
        .input("pairs", I64, &[Ax::Param("batch"), Ax::Fixed(4), Ax::Fixed(1)])
        .output("y")
        .output("z");
    let g = import(&m);
    assert_eq!(ty(&g, "rows"), "i64[N]");
    assert_eq!(ty(&g, "y"), "f32[N,5,3]");
    assert_eq!(ty(&g, "z"), "f32[N,4,3]");
    let bad = ModelBuilder::new(20)
        .input("x", F32, &fixed(&[2, 3]))
        .input("i", I64, &fixed(&[2, 3]))
        .node(node("GatherND", "pick", &["x", "i"], &["y"]))
        .output("y");
    assert_shape_error(&bad, &["\"pick\"", "do not fit"]);
}

/// The loss ops: per target element under `reduction = none`, else a scalar; SCE's second
/// output is the scores' shape; targets that are not the input without its class axis are
/// refused, naming the node.
#[test]
fn class_loss_shapes() {
    let m = ModelBuilder::new(13)
        .input("scores", F32, &fixed(&[4, 5, 2]))
        .input("labels", I64, &fixed(&[4, 2]))
        .node(node("SoftmaxCrossEntropyLoss", "sce", &["scores", "labels"], &["loss", "logp"]).string("reduction", "none"))
        .node(node("NegativeLogLikelihoodLoss", "nll", &["logp", "labels"], &["mean"]).int("ignore_index", 0))
        .output("loss")
        .output("mean");
    let g = import(&m);
    assert_eq!(ty(&g, "loss"), "f32[N,2]");
    assert_eq!(ty(&g, "logp"), "f32[N,5,2]");
    assert_eq!(ty(&g, "mean"), "f32[]");
    let bad = ModelBuilder::new(13)
        .input("scores", F32, &fixed(&[4, 5, 2]))
        .input("labels", I64, &fixed(&[4, 5]))
        .node(node("NegativeLogLikelihoodLoss", "nll_bad", &["scores", "labels"], &["l"]))
        .output("l");
    let msg = import_err(&bad).to_string();
    assert!(msg.contains("nll_bad") && msg.contains("without its class axis"), "{msg}");
}

/// Attention's four outputs from 3-D grouped-query inputs with a cache, over a symbolic
/// batch; RMSNormalization and RotaryEmbedding keep their input's type; inconsistent
/// heads and attributes of a later opset are reported.
#[test]
fn attention_rms_norm_and_rotary_embedding() {
    let b = || Ax::Param("batch");
    let m = ModelBuilder::new(24)
        .input("q", F32, &[b(), Ax::Fixed(4), Ax::Fixed(24)])
        .input("k", F32, &[b(), Ax::Fixed(6), Ax::Fixed(12)])
        .input("v", F32, &[b(), Ax::Fixed(6), Ax::Fixed(10)])
        .input("pk", F32, &[b(), Ax::Fixed(2), Ax::Fixed(3), Ax::Fixed(6)])
        .input("pv", F32, &[b(), Ax::Fixed(2), Ax::Fixed(3), Ax::Fixed(5)])
        .init(tensor_f32("w", &[20], &[1.0; 20]))
        .node(node("Attention", "att", &["q", "k", "v", "", "pk", "pv"], &["y", "present_k", "present_v", "qk"]).int("q_num_heads", 4).int("kv_num_heads", 2).int("is_causal", 1))
        .node(node("RMSNormalization", "rms", &["y", "w"], &["n"]))
        .node(node("RotaryEmbedding", "rope", &["present_k", "cos", "sin"], &["r"]))
        .input("cos", F32, &[b(), Ax::Fixed(9), Ax::Fixed(3)])
        .input("sin", F32, &[b(), Ax::Fixed(9), Ax::Fixed(3)])
        .output("n")
        .output("present_v")
        .output("qk")
        .output("r");
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "f32[N,4,20]");
    assert_eq!(ty(&g, "present_k"), "f32[N,2,9,6]");
    assert_eq!(ty(&g, "present_v"), "f32[N,2,9,5]");
    assert_eq!(ty(&g, "qk"), "f32[N,4,4,9]");
    assert_eq!(ty(&g, "n"), "f32[N,4,20]");
    assert_eq!(ty(&g, "r"), "f32[N,2,9,6]");
    let att = |q: &[i64], k: &[i64], f: fn(onnx_protobuf::NodeProto) -> onnx_protobuf::NodeProto, opset: i64| {
        ModelBuilder::new(opset)
            .input("q", F32, &fixed(q))
            .input("k", F32, &fixed(k))
            .node(f(node("Attention", "att", &["q", "k", "k"], &["y"])))
            .output("y")
    };
    assert_shape_error(&att(&[2, 4, 24], &[2, 6, 12], |n| n, 23), &["\"att\"", "need q_num_heads"]);
    assert_shape_error(&att(&[2, 3, 4, 8], &[2, 2, 6, 8], |n| n, 23), &["\"att\"", "3 query heads are not a multiple of 2"]);
    let windowed = |n: onnx_protobuf::NodeProto| n.int("left_window_size", 2);
    assert!(import_err(&att(&[2, 2, 4, 8], &[2, 2, 6, 8], windowed, 24)).to_string().contains("left_window_size"));
    import(&att(&[2, 2, 4, 8], &[2, 2, 6, 8], windowed, 25));
}

/// TopK's two outputs take `k` (an initializer) at the axis; OneHot inserts the known
/// depth at its axis; EyeLike keeps the shape with its own dtype; Det drops the matrix
/// axes and keeps the batch.
#[test]
fn indexing_and_matrix_op_shapes() {
    let m = ModelBuilder::new(18)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(6), Ax::Fixed(3), Ax::Fixed(3)])
        .input("i", I64, &[Ax::Param("batch"), Ax::Fixed(5)])
        .input("m", F32, &[Ax::Param("batch"), Ax::Fixed(4)])
        .init(tensor_i64("k", &[1], &[2]))
        .init(tensor_i64("depth", &[], &[7]))
        .init(tensor_f32("onoff", &[2], &[0.0, 1.0]))
        .node(node("TopK", "top", &["x", "k"], &["v", "vi"]).int("axis", 1))
        .node(node("OneHot", "hot", &["i", "depth", "onoff"], &["h"]).int("axis", -2))
        .node(node("EyeLike", "eye", &["m"], &["e"]).int("dtype", 7).int("k", 1))
        .node(node("Det", "det", &["x"], &["d"]))
        .output("v")
        .output("vi")
        .output("h")
        .output("e")
        .output("d");
    let g = import(&m);
    assert_eq!(ty(&g, "v"), "f32[N,2,3,3]");
    assert_eq!(ty(&g, "vi"), "i64[N,2,3,3]");
    assert_eq!(ty(&g, "h"), "f32[N,7,5]");
    assert_eq!(ty(&g, "e"), "i64[N,4]");
    assert_eq!(ty(&g, "d"), "f32[N,6]");
    let too_many = ModelBuilder::new(18)
        .input("x", F32, &fixed(&[2, 3]))
        .init(tensor_i64("k", &[1], &[4]))
        .node(node("TopK", "top", &["x", "k"], &["v", "vi"]))
        .output("v");
    assert_shape_error(&too_many, &["\"top\"", "k = 4 does not fit"]);
    let not_square = model(18, &[2, 3, 4], vec![node("Det", "det", &["x"], &["d"])], &["d"]);
    assert_shape_error(&not_square, &["\"det\"", "[*, M, M]"]);
}

/// Scatter reductions exist from the opset that introduced them: `max` at opset 16 is
/// rejected at import with the reason, `add` accepted.
#[test]
fn scatter_reductions_follow_the_opset() {
    let scatter = |opset: i64, reduction: &str| {
        ModelBuilder::new(opset)
            .input("x", F32, &fixed(&[4, 3]))
            .input("u", F32, &fixed(&[2, 3]))
            .init(tensor_i64("i", &[2, 1], &[0, 2]))
            .node(node("ScatterND", "sc", &["x", "i", "u"], &["y"]).string("reduction", reduction))
            .output("y")
    };
    assert_eq!(ty(&import(&scatter(16, "add")), "y"), "f32[4,3]");
    assert_eq!(ty(&import(&scatter(18, "max")), "y"), "f32[4,3]");
    let e = import_err(&scatter(16, "max")).to_string();
    assert!(e.contains("reduction=\"max\" is not a scatter reduction"), "{e}");
}

/// Fixed-batch exports' zero initial states (a constant of the export batch) are dropped,
/// zeros being what an absent state means, so the layer follows the batch; a state that
/// is not zeros is kept. A Resize to sizes of the export batch becomes a Resize by scales,
/// or, where a size is no whole scale of its extent, a Resize to sizes led by the batch.
#[test]
fn zero_initial_states_and_resize_sizes_follow_the_batch() {
    let gru = |h0: onnx_protobuf::TensorProto| {
        ModelBuilder::new(14)
            .input("x", F32, &fixed(&[2, 5, 3]))
            .init(tensor_f32_zeros("w", &[1, 12, 3]))
            .init(tensor_f32_zeros("r", &[1, 12, 4]))
            .init(h0)
            .node(node("GRU", "gru", &["x", "w", "r", "", "", "h0"], &["y", "yh"]).int("hidden_size", 4).int("layout", 1))
            .output("yh")
    };
    let g = import(&gru(tensor_f32_zeros("h0", &[2, 1, 4])));
    assert_eq!(ty(&g, "yh"), "f32[N,1,4]");
    let gru_node = g.node_ids().map(|n| g.node(n)).find(|n| n.op.name() == "GRU").unwrap();
    assert_eq!(gru_node.inputs.iter().flatten().count(), 3, "the zero state is dropped");
    let g = import(&gru(tensor_f32("h0", &[2, 1, 4], &[0.5; 8])));
    let gru_node = g.node_ids().map(|n| g.node(n)).find(|n| n.op.name() == "GRU").unwrap();
    assert_eq!(gru_node.inputs.iter().flatten().count(), 4, "a state that is not zeros stays");

    let m = model(19, &[2, 3, 4, 4], vec![node("Resize", "up", &["x", "", "", "sizes"], &["y"]).string("mode", "linear")], &["y"])
        .init(tensor_i64("sizes", &[4], &[2, 3, 8, 8]));
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "f32[N,3,8,8]");
    assert!(g.warnings.iter().any(|w| w.contains("read as the same Resize by scales")), "{:?}", g.warnings);
    assert_eq!(g.source_rewrites.len(), 1);
    // 4 to 7 is no whole scale: the sizes stay, their batch read from the input.
    let m = model(19, &[2, 3, 4, 4], vec![node("Resize", "up", &["x", "", "", "sizes"], &["y"]).string("mode", "linear")], &["y"])
        .init(tensor_i64("sizes", &[4], &[2, 3, 7, 7]));
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "f32[N,3,7,7]");
    assert!(g.warnings.iter().any(|w| w.contains("read as the same Resize to those sizes with the batch of its input")), "{:?}", g.warnings);
    assert_eq!(g.source_rewrites.len(), 1);
}

/// `nn.MultiheadAttention` at a fixed batch of 1: sequence first (`[seq, batch, width]`),
/// `view(seq * batch, width)` before its output projection and `view(seq, batch, width)`
/// after it, written as the targets `[5, 4]` and `[5, 1, 3]`. The projection's weight
/// says the width stays 4, so the rows take the batch, and the view after it takes it
/// back out; without a weight contracting the width, the reading is the layout's.
#[test]
fn sequence_first_rows_take_the_batch_before_a_weight() {
    let layer = |weight: bool| {
        let mut m = ModelBuilder::new(17)
            .input("x", F32, &fixed(&[1, 5, 4]))
            .init(tensor_i64("rows", &[2], &[5, 4]))
            .init(tensor_i64("back", &[3], &[5, 1, 3]))
            .init(tensor_f32_zeros("w", &[3, 4]))
            .node(node("Transpose", "seq_first", &["x"], &["t"]).ints("perm", &[1, 0, 2]))
            .node(node("Reshape", "merge", &["t", "rows"], &["r"]));
        m = if weight {
            m.node(node("Gemm", "proj", &["r", "w"], &["p"]).int("transB", 1))
                .node(node("Reshape", "split", &["p", "back"], &["s"]))
                .node(node("Transpose", "batch_first", &["s"], &["y"]).ints("perm", &[1, 0, 2]))
                .output("y")
        } else {
            m.node(node("Relu", "act", &["r"], &["y"])).output("y")
        };
        m
    };
    let g = import(&layer(true));
    assert_eq!(ty(&g, "r"), "f32[5N,4]");
    assert_eq!(ty(&g, "p"), "f32[5N,3]");
    assert_eq!(ty(&g, "s"), "f32[5,N,3]");
    assert_eq!(ty(&g, "y"), "f32[N,5,3]");
    assert!(g.warnings.iter().any(|w| w.contains("\"merge\"") && w.contains("takes the batch into its rows")), "{:?}", g.warnings);
    assert!(g.warnings.iter().any(|w| w.contains("\"split\"") && w.contains("takes it back out")), "{:?}", g.warnings);
    assert_eq!(g.source_rewrites.len(), 2);
    let g = import(&layer(false));
    assert_eq!(ty(&g, "y"), "f32[5,4N]");
    assert!(g.source_rewrites.is_empty());
    // At batch 2 the rows `[8, 4]` read as `[4N, 4]`; the view after the layer, `[4, 2,
    // 3]`, would read its leading 4 as `2N`: the rows say the batch comes after 4.
    let m = ModelBuilder::new(17)
        .input("x", F32, &fixed(&[2, 4, 4]))
        .init(tensor_i64("rows", &[2], &[8, 4]))
        .init(tensor_i64("back", &[3], &[4, 2, 3]))
        .init(tensor_f32_zeros("w", &[3, 4]))
        .node(node("Transpose", "seq_first", &["x"], &["t"]).ints("perm", &[1, 0, 2]))
        .node(node("Reshape", "merge", &["t", "rows"], &["r"]))
        .node(node("Gemm", "proj", &["r", "w"], &["p"]).int("transB", 1))
        .node(node("Reshape", "split", &["p", "back"], &["s"]))
        .output("s");
    let g = import(&m);
    assert_eq!(ty(&g, "r"), "f32[4N,4]");
    assert_eq!(ty(&g, "s"), "f32[4,N,3]");
}

/// An export at batch 1 that multiplies per-head queries `[1, heads, seq, dim]` with keys
/// whose batch and heads it merged (`[heads, dim, seq]`, the `bmm` operand) relies on
/// broadcasting that holds at batch 1 only; the keys are split into `[batch, heads, ...]`
/// first, and the product follows the batch. At batch 2 the same MatMul would not have
/// been exported, and is read as it stands.
#[test]
fn per_head_matmul_with_merged_heads_splits_them() {
    let attention = |batch: i64| {
        ModelBuilder::new(17)
            .input("q", F32, &fixed(&[batch, 2, 5, 4]))
            .input("k", F32, &fixed(&[batch, 2, 5, 4]))
            .init(tensor_i64("merge", &[3], &[2 * batch, 5, 4]))
            .node(node("Reshape", "merge_heads", &["k", "merge"], &["km"]))
            .node(node("Transpose", "kt", &["km"], &["kt"]).ints("perm", &[0, 2, 1]))
            .node(node("MatMul", "scores", &["q", "kt"], &["s"]))
            .output("s")
    };
    let g = import(&attention(1));
    assert_eq!(ty(&g, "kt"), "f32[2N,4,5]");
    assert_eq!(ty(&g, "s"), "f32[N,2,5,5]");
    assert!(g.warnings.iter().any(|w| w.contains("\"scores\"") && w.contains("splits them apart first")), "{:?}", g.warnings);
    assert_eq!(g.source_rewrites.len(), 1);
    assert_eq!(g.source_rewrites[0].before.len(), 1, "the Reshape that splits the heads is written before the MatMul");
    let e = import_err(&attention(2)).to_string();
    assert!(e.contains("\"scores\""), "{e}");
}

/// A causal mask built from constants (Trilu of a filled matrix, expanded to the export
/// batch) folds into one constant, which lowering and `export` keep one slice of; an
/// integer Expand stays an op (position ids expanded to the batch feed a Gather).
#[test]
fn a_causal_mask_of_constants_folds() {
    let m = ModelBuilder::new(17)
        .input("x", F32, &fixed(&[2, 1, 3, 3]))
        .node(node("Constant", "full_c", &[], &["full"]).tensor("value", tensor_f32("", &[3, 3], &[-9.0; 9])))
        .init(tensor_i64("diag", &[], &[1]))
        .init(tensor_i64("batch_shape", &[4], &[2, 1, 3, 3]))
        .init(tensor_i64("ids", &[1, 3], &[0, 1, 2]))
        .init(tensor_i64("ids_shape", &[2], &[2, 3]))
        .node(node("Trilu", "triu", &["full", "diag"], &["upper"]).int("upper", 1))
        .node(node("Expand", "to_batch", &["upper", "batch_shape"], &["mask"]))
        .node(node("Add", "masked", &["x", "mask"], &["y"]))
        .node(node("Expand", "ids_to_batch", &["ids", "ids_shape"], &["positions"]))
        .output("y")
        .output("positions");
    let g = import(&m);
    let mut ops = op_names(&g);
    ops.sort();
    assert_eq!(ops, ["Add", "Expand"]);
    assert_eq!(ty(&g, "mask"), "f32[2,1,3,3]");
    let mask = g.value_ids().find(|&v| g.value(v).name == "mask").and_then(|v| g.value(v).weight()).expect("a constant");
    let upper = [0.0, -9.0, -9.0, 0.0, 0.0, -9.0, 0.0, 0.0, 0.0];
    assert_eq!(mask.data.to_f64s(), [upper, upper].concat());
    // Constant pieces joined along an inner axis fold too.
    let m = ModelBuilder::new(17)
        .input("x", F32, &fixed(&[2, 3]))
        .init(tensor_i64("left", &[2, 1], &[1, 4]))
        .init(tensor_i64("right", &[2, 2], &[2, 3, 5, 6]))
        .node(node("Concat", "join", &["left", "right"], &["rows"]).int("axis", 1))
        .output("rows");
    let text = pipewright_ir::text::print_graph(&import(&m));
    assert!(text.contains("i64[2,3] = const \"rows\" [1, 2, 3, 4, 5, 6]"), "{text}");
}

/// A float initializer is a parameter, and what is computed from it alone stays
/// computed though its contents are known: folding a Reshape and an Unsqueeze of it
/// into one constant would freeze it (DINOv2's and DeiT's TorchScript exports read
/// position embeddings and tokens so).
#[test]
fn what_a_weight_alone_computes_is_not_folded() {
    let m = ModelBuilder::new(17)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(3), Ax::Fixed(4)])
        .init(tensor_f32("w", &[4], &[0.0, 1.0, 2.0, 3.0]))
        .init(tensor_i64("column", &[2], &[4, 1]))
        .init(tensor_i64("lead", &[1], &[0]))
        .node(node("Reshape", "as_column", &["w", "column"], &["wc"]))
        .node(node("Unsqueeze", "lead_axis", &["wc", "lead"], &["wu"]))
        .node(node("MatMul", "project", &["x", "wu"], &["y"]))
        .output("y");
    let g = import(&m);
    let mut ops = op_names(&g);
    ops.sort();
    assert_eq!(ops, ["MatMul", "Reshape", "Unsqueeze"]);
    let w = g.value_ids().find(|&v| g.value(v).name == "w").and_then(|v| g.value(v).weight()).expect("the weight");
    assert!(w.trainable);
}

/// A zero-filled cache whose shape holds the batch, indexed down to fixed extents and
/// counted (how many positions a model's cache has filled, Gemma 2's first step): the
/// count is known at import, and the Range it bounds has a fixed length; a ScatterElements
/// writing one extent of a shape vector is known too.
#[test]
fn a_filled_cache_indexed_and_counted_is_known() {
    let zero = tensor_f32("", &[1], &[0.0]);
    let m = ModelBuilder::new(17)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(4)])
        .init(tensor_i64("tail", &[3], &[1, 4, 8]))
        .init(tensor_i64("first", &[], &[0]))
        .init(tensor_i64("last_axis", &[1], &[-1]))
        .init(tensor_i64("two", &[], &[2]))
        .init(tensor_i64("one", &[], &[1]))
        .init(tensor_f32("nothing", &[], &[0.0]))
        .init(tensor_i64("slot", &[1], &[1]))
        .init(tensor_i64("six", &[1], &[6]))
        .node(node("Shape", "shape", &["x"], &["xs"]).int("end", 1))
        .node(node("Concat", "cache_shape", &["xs", "tail"], &["cs"]).int("axis", 0))
        .node(node("ConstantOfShape", "cache", &["cs"], &["cache"]).tensor("value", zero))
        .node(node("Gather", "row", &["cache", "first"], &["r"]).int("axis", 0))
        .node(node("Gather", "head", &["r", "first"], &["h"]).int("axis", 0))
        .node(node("ReduceSum", "per_position", &["h", "last_axis"], &["p"]).int("keepdims", 0))
        .node(node("Greater", "filled", &["p", "nothing"], &["f"]))
        .node(node("Cast", "as_int", &["f"], &["fi"]).int("to", 7))
        .node(node("ReduceSum", "count", &["fi"], &["n"]).int("keepdims", 0))
        .node(node("Add", "end", &["n", "two"], &["e"]))
        .node(node("Range", "positions", &["n", "e", "one"], &["pos"]))
        .node(node("ScatterElements", "new_length", &["tail", "slot", "six"], &["tail6"]).int("axis", 0))
        .output("pos")
        .output("tail6");
    let g = import(&m);
    let text = pipewright_ir::text::print_graph(&g);
    assert!(text.contains("i64[2] = const \"pos\" [0, 1]"), "{text}");
    assert!(text.contains("i64[3] = const \"tail6\" [1, 6, 8]"), "{text}");
}

/// LSTM outputs in both layouts (with the batch symbol on X's batch axis), and the
/// importer's rejection of activations other than the defaults.
#[test]
fn recurrent_op_shapes_and_activations() {
    let lstm = |layout: i64, x: &[Ax]| {
        ModelBuilder::new(14)
            .input("x", F32, x)
            .init(tensor_f32_zeros("w", &[2, 16, 3]))
            .init(tensor_f32_zeros("r", &[2, 16, 4]))
            .node(
                node("LSTM", "lstm", &["x", "w", "r"], &["y", "yh", "yc"])
                    .int("hidden_size", 4)
                    .int("layout", layout)
                    .string("direction", "bidirectional"),
            )
            .output("y")
            .output("yh")
            .output("yc")
    };
    let g = import(&lstm(1, &[Ax::Param("batch"), Ax::Fixed(5), Ax::Fixed(3)]));
    assert_eq!(ty(&g, "y"), "f32[N,5,2,4]");
    assert_eq!(ty(&g, "yh"), "f32[N,2,4]");
    assert_eq!(ty(&g, "yc"), "f32[N,2,4]");
    // Time-major X: `--batch auto` would take its axis 0 (time) for the batch.
    let g = import_mode(&lstm(0, &fixed(&[5, 6, 3])), BatchMode::Fixed);
    assert_eq!(ty(&g, "y"), "f32[5,2,6,4]");
    assert_eq!(ty(&g, "yh"), "f32[2,6,4]");
    // ... which is refused (training at another batch would lengthen the sequence).
    assert_shape_error(&lstm(0, &fixed(&[5, 6, 3])), &["\"lstm\"", "batch symbol on its sequence axis", "--batch fixed"]);
    // The batch on axis 1, as exporters write a batch-first model's transposed input.
    let mut transposed = lstm(0, &[Ax::Param("batch"), Ax::Fixed(5), Ax::Fixed(3)]);
    let graph = transposed.model.graph.as_mut().expect("graph");
    graph.node[0].input[0] = "x_time_major".into();
    graph.node.insert(0, node("Transpose", "to_time_major", &["x"], &["x_time_major"]).ints("perm", &[1, 0, 2]));
    assert_eq!(ty(&import(&transposed), "y"), "f32[5,2,N,4]");
    let wrong_width = lstm(0, &fixed(&[5, 6, 2]));
    assert_shape_error(&wrong_width, &["\"lstm\"", "must be [2, 16, input]"]);
    let activations = |names: &[&str]| {
        let list = AttributeProto {
            name: "activations".into(),
            type_: EnumOrUnknown::new(AttributeType::STRINGS),
            strings: names.iter().map(|s| s.as_bytes().to_vec()).collect(),
            ..Default::default()
        };
        ModelBuilder::new(14)
            .input("x", F32, &fixed(&[5, 6, 3]))
            .init(tensor_f32_zeros("w", &[1, 6, 3]))
            .init(tensor_f32_zeros("r", &[1, 6, 2]))
            .node(node("GRU", "gru", &["x", "w", "r"], &["y"]).int("hidden_size", 2).attr(list))
            .output("y")
    };
    assert_eq!(ty(&import_mode(&activations(&["Sigmoid", "Tanh"]), BatchMode::Fixed), "y"), "f32[5,1,6,2]");
    let e = import_err(&activations(&["Relu", "Tanh"])).to_string();
    assert!(e.contains("activations [\"Relu\", \"Tanh\"] are not supported"), "{e}");
}

/// Resize's output extents: `floor(extent * scale)` from scales, the sizes as given (also
/// when they come from the input's shape, batch included), one common factor under a
/// keep_aspect_ratio_policy, and the legacy Upsample; scales that are not known at import
/// or that scale the batch are refused.
#[test]
fn resize_and_upsample_shapes() {
    let batch = [Ax::Param("batch"), Ax::Fixed(3), Ax::Fixed(5), Ax::Fixed(7)];
    let m = ModelBuilder::new(19)
        .input("x", F32, &batch)
        .init(tensor_f32("scales", &[4], &[1.0, 1.0, 0.6, 1.5]))
        .init(tensor_i64("hw", &[2], &[6, 8]))
        .init(tensor_i64("zero", &[1], &[0]))
        .init(tensor_i64("two", &[1], &[2]))
        .init(tensor_i64("wh", &[2], &[20, 4]))
        .node(node("Resize", "by_scale", &["x", "", "scales"], &["a"]).string("mode", "cubic"))
        .node(node("Shape", "shape", &["x"], &["s"]))
        .node(node("Slice", "nc", &["s", "zero", "two"], &["nc"]))
        .node(node("Concat", "sizes", &["nc", "hw"], &["sizes"]).int("axis", 0))
        .node(node("Resize", "by_size", &["x", "", "", "sizes"], &["b"]).string("mode", "linear"))
        .node(node("Resize", "aspect", &["x", "", "", "wh"], &["c"]).ints("axes", &[3, 2]).string("keep_aspect_ratio_policy", "not_larger"))
        .output("a")
        .output("b")
        .output("c");
    let g = import(&m);
    assert_eq!(ty(&g, "a"), "f32[N,3,3,10]");
    assert_eq!(ty(&g, "b"), "f32[N,3,6,8]");
    // Float scales are a shape's parameters, never a weight (nor read back each step).
    let scales = g.value_ids().find(|v| g.value(*v).name == "scales").expect("scales");
    assert!(matches!(&g.value(scales).def, pipewright_ir::ValueDef::Weight(w) if !w.trainable), "{:?}", g.value(scales).def);
    // not_larger: min(20 / 7, 4 / 5) = 0.8 for both axes: round(5 * 0.8), round(7 * 0.8).
    assert_eq!(ty(&g, "c"), "f32[N,3,4,6]");
    let up = ModelBuilder::new(9)
        .input("x", F32, &fixed(&[2, 3, 4]))
        .init(tensor_f32("scales", &[3], &[1.0, 2.0, 3.0]))
        .node(node("Upsample", "up", &["x", "scales"], &["y"]))
        .output("y");
    assert_eq!(ty(&import(&up), "y"), "f32[N,6,12]");
    let unknown = ModelBuilder::new(19)
        .input("x", F32, &fixed(&[1, 3, 4, 4]))
        .input("scales", F32, &fixed(&[4]))
        .node(node("Resize", "rs", &["x", "", "scales"], &["y"]))
        .output("y");
    assert_shape_error(&unknown, &["\"rs\"", "not known at import"]);
    let on_batch = ModelBuilder::new(19)
        .input("x", F32, &batch)
        .init(tensor_f32("scales", &[4], &[2.0, 1.0, 1.0, 1.0]))
        .node(node("Resize", "rs", &["x", "", "scales"], &["y"]))
        .output("y");
    assert_shape_error(&on_batch, &["\"rs\"", "the batch"]);
}

/// The vision ops' shape rules: DepthToSpace/SpaceToDepth, GridSample (the grid's spatial
/// extents), AffineGrid (the size's spatial extents, theta's batch), Col2Im (the block
/// count must match the padded image) and CenterCropPad.
#[test]
fn vision_op_shapes() {
    let batch = |dims: &[i64]| std::iter::once(Ax::Param("batch")).chain(dims.iter().map(|&d| Ax::Fixed(d))).collect::<Vec<_>>();
    let m = ModelBuilder::new(22)
        .input("x", F32, &batch(&[8, 2, 3]))
        .input("grid", F32, &batch(&[5, 7, 2]))
        .input("theta", F32, &batch(&[2, 3]))
        .input("cols", F32, &batch(&[12, 8]))
        .init(tensor_i64("size", &[4], &[1, 3, 6, 4]))
        .init(tensor_i64("image", &[2], &[4, 5]))
        .init(tensor_i64("block", &[2], &[3, 2]))
        .init(tensor_i64("crop", &[2], &[1, 5]))
        .node(node("DepthToSpace", "d2s", &["x"], &["a"]).int("blocksize", 2).string("mode", "CRD"))
        .node(node("SpaceToDepth", "s2d", &["a"], &["b"]).int("blocksize", 2))
        .node(node("GridSample", "gs", &["x", "grid"], &["c"]))
        .node(node("AffineGrid", "ag", &["theta", "size"], &["d"]))
        .node(node("Col2Im", "c2i", &["cols", "image", "block"], &["e"]).ints("pads", &[1, 0, 1, 1]).ints("strides", &[2, 1]).ints("dilations", &[1, 2]))
        .node(node("CenterCropPad", "ccp", &["x", "crop"], &["f"]).ints("axes", &[-1, 2]))
        .output("b")
        .output("c")
        .output("d")
        .output("e")
        .output("f");
    let g = import(&m);
    assert_eq!(ty(&g, "a"), "f32[N,2,4,6]");
    assert_eq!(ty(&g, "b"), "f32[N,8,2,3]");
    assert_eq!(ty(&g, "c"), "f32[N,8,5,7]");
    assert_eq!(ty(&g, "d"), "f32[N,6,4,2]");
    assert_eq!(ty(&g, "e"), "f32[N,2,4,5]");
    assert_eq!(ty(&g, "f"), "f32[N,8,5,1]");
    // Padded 6 x 6 image, 3 x 2 blocks dilated (1, 2), strides (2, 1): 2 x 4 = 8 positions.
    let blocks = |l: i64| {
        ModelBuilder::new(18)
            .input("cols", F32, &fixed(&[1, 12, l]))
            .init(tensor_i64("image", &[2], &[4, 5]))
            .init(tensor_i64("block", &[2], &[3, 2]))
            .node(node("Col2Im", "c2i", &["cols", "image", "block"], &["e"]).ints("pads", &[1, 0, 1, 1]).ints("strides", &[2, 1]).ints("dilations", &[1, 2]))
            .output("e")
    };
    assert_eq!(ty(&import(&blocks(8)), "e"), "f32[N,2,4,5]");
    assert_shape_error(&blocks(12), &["\"c2i\"", "12 blocks given", "holds 8"]);
    let bad = ModelBuilder::new(13).input("x", F32, &fixed(&[1, 6, 2, 2])).node(node("DepthToSpace", "d2s", &["x"], &["y"]).int("blocksize", 2)).output("y");
    assert_shape_error(&bad, &["\"d2s\"", "not a multiple"]);
}

/// DFT (the opset-17 axis attribute, the opset-20 axis and length inputs, one-sided
/// forward and inverse), STFT (frames from the step and window), RoiAlign (one output per
/// region) and DeformConv (Conv's output; offsets must match it).
#[test]
fn signal_op_shapes() {
    let batch = |dims: &[i64]| std::iter::once(Ax::Param("batch")).chain(dims.iter().map(|&d| Ax::Fixed(d))).collect::<Vec<_>>();
    let m = ModelBuilder::new(20)
        .input("x", F32, &batch(&[10, 6, 1]))
        .input("c", F32, &batch(&[10, 6, 2]))
        .input("s", F32, &batch(&[128, 1]))
        .init(tensor_f32_zeros("win", &[16]))
        .init(tensor_i64("len", &[], &[12]))
        .init(tensor_i64("axis", &[], &[2]))
        .init(tensor_i64("step", &[], &[8]))
        .node(node("DFT", "rfft", &["x", "len", "axis"], &["a"]).int("onesided", 1))
        .node(node("DFT", "ifft", &["c"], &["b"]).int("inverse", 1))
        .node(node("DFT", "irfft", &["c", "", "axis"], &["d"]).int("inverse", 1).int("onesided", 1))
        .node(node("STFT", "stft", &["s", "step", "win"], &["e"]))
        .output("a")
        .output("b")
        .output("d")
        .output("e");
    let g = import(&m);
    assert_eq!(ty(&g, "a"), "f32[N,10,7,2]");
    assert_eq!(ty(&g, "b"), "f32[N,10,6,2]");
    assert_eq!(ty(&g, "d"), "f32[N,10,10,1]");
    // 1 + (128 - 16) / 8 = 15 frames of 16 / 2 + 1 = 9 bins.
    assert_eq!(ty(&g, "e"), "f32[N,15,9,2]");
    let v17 = ModelBuilder::new(17).input("x", F32, &batch(&[5, 4, 2])).node(node("DFT", "dft", &["x"], &["y"]).int("axis", 2)).output("y");
    assert_eq!(ty(&import(&v17), "y"), "f32[N,5,4,2]");
    let complex_axis = ModelBuilder::new(17).input("x", F32, &batch(&[5, 2])).node(node("DFT", "dft", &["x"], &["y"]).int("axis", 2)).output("y");
    assert_shape_error(&complex_axis, &["\"dft\"", "not a signal axis"]);
    let roi = ModelBuilder::new(22)
        .input("x", F32, &batch(&[3, 10, 12]))
        .init(tensor_f32_zeros("rois", &[5, 4]))
        .init(tensor_i64("idx", &[5], &[0, 1, 1, 0, 2]))
        .node(node("RoiAlign", "roi", &["x", "rois", "idx"], &["y"]).int("output_height", 2).int("output_width", 4))
        .output("y");
    assert_eq!(ty(&import(&roi), "y"), "f32[5,3,2,4]");
    let deform = |offset_channels: i64| {
        ModelBuilder::new(22)
            .input("x", F32, &batch(&[4, 6, 6]))
            .init(tensor_f32_zeros("w", &[6, 2, 3, 3]))
            .input("off", F32, &batch(&[offset_channels, 3, 3]))
            .node(node("DeformConv", "dc", &["x", "w", "off"], &["y"]).int("group", 2).int("offset_group", 2).ints("strides", &[2, 2]).ints("pads", &[1, 1, 1, 1]))
            .output("y")
    };
    assert_eq!(ty(&import(&deform(36)), "y"), "f32[N,6,3,3]");
    assert_shape_error(&deform(18), &["\"dc\"", "offset"]);
    let auto = ModelBuilder::new(22)
        .input("x", F32, &batch(&[4, 6, 6]))
        .init(tensor_f32_zeros("w", &[6, 2, 3, 3]))
        .input("off", F32, &batch(&[36, 6, 6]))
        .node(node("DeformConv", "dc", &["x", "w", "off"], &["y"]).int("group", 2).int("offset_group", 2).string("auto_pad", "SAME_UPPER"))
        .output("y");
    let msg = import_err(&auto).to_string();
    assert!(msg.contains("\"dc\"") && msg.contains("auto_pad"), "{msg}");
}

/// MaxUnpool's unpooled extents (and a larger known output_shape), TensorScatter's cache
/// type and its fit check, SwiGLU's equal-shape rule, and the integer and quantized
/// products' element types (int32; the output zero point's type).
#[test]
fn unpool_cache_swiglu_and_quantized_types() {
    let batch = || Ax::Param("batch");
    let m = ModelBuilder::new(22)
        .input("x", F32, &[batch(), Ax::Fixed(3), Ax::Fixed(2), Ax::Fixed(4)])
        .input("i", I64, &[batch(), Ax::Fixed(3), Ax::Fixed(2), Ax::Fixed(4)])
        .init(tensor_i64("shape", &[4], &[1, 3, 5, 9]))
        .node(node("MaxUnpool", "up", &["x", "i"], &["y"]).ints("kernel_shape", &[2, 2]).ints("strides", &[2, 2]).ints("pads", &[0, 1, 0, 0]))
        .node(node("MaxUnpool", "up_to", &["x", "i", "shape"], &["z"]).ints("kernel_shape", &[2, 2]).ints("strides", &[2, 2]))
        .output("y")
        .output("z");
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "f32[N,3,4,7]");
    assert_eq!(ty(&g, "z"), "f32[N,3,5,9]");

    let cache = |update: i64| {
        ModelBuilder::new(24)
            .input("past", F32, &[batch(), Ax::Fixed(2), Ax::Fixed(6), Ax::Fixed(4)])
            .input("new", F32, &[batch(), Ax::Fixed(2), Ax::Fixed(update), Ax::Fixed(4)])
            .node(node("TensorScatter", "write", &["past", "new"], &["present"]).string("mode", "circular"))
            .output("present")
    };
    assert_eq!(ty(&import(&cache(3)), "present"), "f32[N,2,6,4]");
    assert_shape_error(&cache(7), &["\"write\"", "does not fit"]);

    let glu = ModelBuilder::new(28)
        .input("a", F32, &fixed(&[2, 4]))
        .input("b", F32, &fixed(&[1, 4]))
        .node(node("SwiGLU", "glu", &["a", "b"], &["y"]))
        .output("y");
    assert_shape_error(&glu, &["\"glu\"", "one type and shape"]);

    const U8: i32 = 2;
    let q = ModelBuilder::new(21)
        .input("a", U8, &fixed(&[2, 4]))
        .input("b", U8, &fixed(&[4, 3]))
        .input("w", U8, &fixed(&[5, 2, 3, 3]))
        .input("img", U8, &fixed(&[1, 2, 8, 8]))
        .init(tensor_f32("s", &[], &[0.5]))
        .init(u8_tensor("z"))
        .node(node("QLinearMatMul", "qmm", &["a", "s", "z", "b", "s", "z", "s", "z"], &["y"]))
        .node(node("MatMulInteger", "mmi", &["a", "b"], &["p"]))
        .node(node("ConvInteger", "ci", &["img", "w"], &["c"]).ints("pads", &[1, 1, 1, 1]))
        .output("y")
        .output("p")
        .output("c");
    let g = import(&q);
    assert_eq!(ty(&g, "y"), "u8[2,3]");
    assert_eq!(ty(&g, "p"), "i32[2,3]");
    assert_eq!(ty(&g, "c"), "i32[1,5,8,8]");
}

fn u8_tensor(name: &str) -> onnx_protobuf::TensorProto {
    let mut t = onnx_protobuf::TensorProto::new();
    t.name = name.into();
    t.data_type = 2;
    t.raw_data = vec![128];
    t
}

// ---------------------------------------------------------------- low precision

/// A tensor of a low-precision type from its raw (packed) bytes.
fn tensor_raw(name: &str, data_type: i32, dims: &[i64], raw: &[u8]) -> onnx_protobuf::TensorProto {
    onnx_protobuf::TensorProto { name: name.into(), dims: dims.to_vec(), data_type, raw_data: raw.to_vec(), ..Default::default() }
}

const INT4: i32 = 22;
const FLOAT8E4M3FN: i32 = 17;

/// QuantizeLinear's output type (zero point, else output_dtype, else u8) and its per-axis
/// and blocked scale shapes; DequantizeLinear's (output_dtype, else the scale's);
/// DynamicQuantizeLinear's three outputs.
#[test]
fn quantization_types_and_scale_shapes() {
    let m = ModelBuilder::new(25)
        .input("x", F32, &fixed(&[1, 4, 6]))
        .init(tensor_f32("s_axis", &[4], &[1.0, 2.0, 3.0, 4.0]))
        .init(tensor_f32_zeros("s_block", &[1, 4, 3]))
        // Four int4 zero points, two to a byte.
        .init(tensor_raw("z4", INT4, &[4], &[0x21, 0xF0]))
        .node(node("QuantizeLinear", "q_u8", &["x", "s_axis"], &["a"]))
        .node(node("QuantizeLinear", "q_i4", &["x", "s_axis", "z4"], &["b"]))
        .node(node("QuantizeLinear", "q_f8", &["x", "s_block"], &["c"]).int("axis", 2).int("block_size", 2).int("output_dtype", FLOAT8E4M3FN as i64))
        .node(node("DequantizeLinear", "dq", &["b", "s_axis", "z4"], &["d"]))
        .node(node("DequantizeLinear", "dq16", &["c", "s_block"], &["e"]).int("axis", -1).int("block_size", 2).int("output_dtype", 10))
        .node(node("DynamicQuantizeLinear", "dyn", &["x"], &["f", "f_scale", "f_zp"]))
        .output("a")
        .output("d")
        .output("e")
        .output("f")
        .output("f_scale")
        .output("f_zp");
    let g = import(&m);
    assert_eq!(ty(&g, "a"), "u8[N,4,6]");
    assert_eq!(ty(&g, "b"), "i4[N,4,6]");
    assert_eq!(ty(&g, "c"), "f8e4m3fn[N,4,6]");
    assert_eq!(ty(&g, "d"), "f32[N,4,6]");
    assert_eq!(ty(&g, "e"), "f16[N,4,6]");
    assert_eq!((ty(&g, "f"), ty(&g, "f_scale"), ty(&g, "f_zp")), ("u8[N,4,6]".into(), "f32[]".into(), "u8[]".into()));
    // The attributes print and parse back (the text form goes through the importer).
    let text = pipewright_ir::text::print_graph(&g);
    assert!(text.contains("QuantizeLinear[axis=2, block_size=2, output_dtype=f8e4m3fn]"), "{text}");
    let back = pipewright_ir::parse_graph(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(pipewright_ir::text::print_graph(&back), text);
    let quant = |scale: onnx_protobuf::TensorProto, n: onnx_protobuf::NodeProto| {
        ModelBuilder::new(25).input("x", F32, &fixed(&[1, 4, 6])).init(scale).node(n).output("y")
    };
    // Blocks of 4 over 6 elements make 2 blocks, not 3.
    let blocked = quant(tensor_f32_zeros("s", &[1, 4, 3]), node("QuantizeLinear", "q", &["x", "s"], &["y"]).int("axis", 2).int("block_size", 4));
    assert_shape_error(&blocked, &["\"q\"", "blocked scale", "blocks of 4"]);
    let per_axis = quant(tensor_f32_zeros("s", &[5]), node("QuantizeLinear", "q", &["x", "s"], &["y"]));
    assert_shape_error(&per_axis, &["\"q\"", "per-axis scale must be [4]"]);
    let m = ModelBuilder::new(25)
        .input("x", F32, &fixed(&[1, 4]))
        .init(tensor_f32("s", &[], &[1.0]))
        .init(tensor_raw("z", INT4, &[], &[0x01]))
        .node(node("QuantizeLinear", "q", &["x", "s", "z"], &["y"]).int("output_dtype", 3))
        .output("y");
    assert_shape_error(&m, &["\"q\"", "output_dtype i8 differs from the zero point's type i4"]);
}

/// Only casts and the quantization ops take the low-precision types: another op on them
/// is refused at import with the op and the type named (the runtime holds them in wider
/// types, where it would compute in the wrong precision).
#[test]
fn low_precision_operands_are_refused_outside_casts_and_quantization() {
    let m = ModelBuilder::new(21)
        .input("q", INT4, &fixed(&[1, 4]))
        .node(node("Cast", "widen", &["q"], &["w"]).int("to", 1))
        .node(node("Add", "sum", &["q", "q"], &["y"]))
        .output("w")
        .output("y");
    let e = import_err(&m);
    let msg = e.to_string();
    assert!(msg.contains("\"sum\"") && msg.contains("Add on element type i4 is not supported"), "{msg}");
    let ok = ModelBuilder::new(21).input("q", INT4, &fixed(&[1, 4])).node(node("Cast", "widen", &["q"], &["w"]).int("to", 1).int("saturate", 0)).output("w");
    let g = import(&ok);
    assert_eq!(ty(&g, "w"), "f32[N,4]");
}

/// LinearAttention's output `[batch, seq, q_heads * d_v]` and state `[batch, kv_heads,
/// d_k, d_v]` over a symbolic batch; its rule's inputs are checked. CausalConvWithState
/// keeps the input's shape and carries `k - 1` positions.
#[test]
fn linear_attention_and_causal_conv_shapes() {
    let b = || Ax::Param("batch");
    let la = |rule: &str, inputs: &[&str]| {
        ModelBuilder::new(27)
            .input("q", F32, &[b(), Ax::Fixed(5), Ax::Fixed(12)])
            .input("k", F32, &[b(), Ax::Fixed(5), Ax::Fixed(6)])
            .input("v", F32, &[b(), Ax::Fixed(5), Ax::Fixed(8)])
            .input("g", F32, &[b(), Ax::Fixed(5), Ax::Fixed(2)])
            .input("beta", F32, &[b(), Ax::Fixed(5), Ax::Fixed(1)])
            .node(node("LinearAttention", "la", inputs, &["y", "state"]).int("q_num_heads", 4).int("kv_num_heads", 2).string("update_rule", rule))
            .output("y")
            .output("state")
    };
    let g = import(&la("gated_delta", &["q", "k", "v", "", "g", "beta"]));
    assert_eq!(ty(&g, "y"), "f32[N,5,16]");
    assert_eq!(ty(&g, "state"), "f32[N,2,3,4]");
    assert_shape_error(&la("linear", &["q", "k", "v", "", "g"]), &["\"la\"", "needs no decay"]);
    assert_shape_error(&la("delta", &["q", "k", "v"]), &["\"la\"", "a beta"]);
    let conv = |k: i64| {
        ModelBuilder::new(27)
            .input("x", F32, &[b(), Ax::Fixed(3), Ax::Fixed(7)])
            .init(tensor_f32_zeros("w", &[3, 1, k]))
            .node(node("CausalConvWithState", "conv", &["x", "w"], &["y", "carry"]).string("activation", "swish"))
            .output("y")
            .output("carry")
    };
    let g = import(&conv(4));
    assert_eq!(ty(&g, "y"), "f32[N,3,7]");
    assert_eq!(ty(&g, "carry"), "f32[N,3,3]");
    assert_eq!(ty(&import(&conv(1)), "carry"), "f32[N,3,0]");
}

/// Ops of other domains: accepted where the model imports their domain (also without
/// the default domain), by their domain's opset; an optimizer step gives the new tensors
/// and states in blocks; a domain op spelled in the default domain is unknown.
#[test]
fn training_and_ml_domain_ops() {
    let mut m = ModelBuilder::new(1)
        .input("x", F32, &fixed(&[3, 4]))
        .init(tensor_i64("idx", &[2], &[3, 1]))
        .node(node("Binarizer", "bin", &["x"], &["b"]).domain("ai.onnx.ml").float("threshold", 0.5))
        .node(node("ArrayFeatureExtractor", "afe", &["b", "idx"], &["picked"]).domain("ai.onnx.ml"))
        .output("picked");
    m.model.opset_import[0].domain = "ai.onnx.ml".into();
    let g = import(&m);
    assert_eq!(ty(&g, "picked"), "f32[N,2]");
    let mut unimported = m.clone();
    unimported.model.opset_import[0].domain = "ai.onnx.preview.training".into();
    let e = import_err(&unimported);
    assert!(matches!(e, ImportError::Domain(_)), "{e}");
    assert_eq!(
        e.to_string(),
        "2 node(s) use an operator domain pipewright cannot handle: node \"bin\" (Binarizer) in domain \"ai.onnx.ml\", node \"afe\" (ArrayFeatureExtractor) in domain \"ai.onnx.ml\""
    );
    let adam = |domain: &str| {
        ModelBuilder::new(18)
            .opset_import("ai.onnx.preview.training", 1)
            .init(tensor_f32("r", &[], &[0.1]))
            .init(tensor_i64("t", &[], &[1]))
            .input("x1", F32, &fixed(&[2]))
            .input("x2", F32, &fixed(&[3, 2]))
            .input("g1", F32, &fixed(&[2]))
            .input("g2", F32, &fixed(&[3, 2]))
            .input("v1", F32, &fixed(&[2]))
            .input("v2", F32, &fixed(&[3, 2]))
            .input("h1", F32, &fixed(&[2]))
            .input("h2", F32, &fixed(&[3, 2]))
            .node(node("Adam", "adam", &["r", "t", "x1", "x2", "g1", "g2", "v1", "v2", "h1", "h2"], &["x1n", "x2n", "v1n", "v2n", "h1n", "h2n"]).domain(domain))
            .output("x2n")
            .output("h1n")
    };
    let g = try_import(&adam("ai.onnx.preview.training"), BatchMode::Fixed).unwrap();
    assert_eq!((ty(&g, "x2n"), ty(&g, "h1n")), ("f32[3,2]".to_string(), "f32[2]".to_string()));
    let e = try_import(&adam(""), BatchMode::Fixed).err().expect("Adam outside the training domain is unknown");
    assert!(matches!(e, ImportError::UnknownOps(_)), "{e}");
    assert_eq!(e.to_string(), "1 unknown operator type(s): Adam (nodes \"adam\")");
}

/// PatchTST at a fixed batch of 1: each channel of each sample is a sequence of its own
/// (`[batch * channels, patches, width]`, read `[3N, 4, 16]`), and its attention views
/// that as `view(batch * channels, -1, heads, head)` and `view(batch * channels * heads,
/// -1, head)`, written `[3, -1, 2, 8]` and `[6, -1, 8]`. The leading literal is the
/// input's leading extents merged as they were, so the -1 keeps the patches, not the batch.
#[test]
fn leading_literals_of_merged_batch_extents_keep_them_merged() {
    let m = ModelBuilder::new(17)
        .input("x", F32, &fixed(&[1, 3, 4, 16]))
        .init(tensor_i64("samples", &[3], &[3, 4, 16]))
        .init(tensor_i64("heads", &[4], &[3, -1, 2, 8]))
        .init(tensor_i64("merged", &[3], &[6, -1, 8]))
        .node(node("Reshape", "per_channel", &["x", "samples"], &["c"]))
        .node(node("Reshape", "split_heads", &["c", "heads"], &["h"]))
        .node(node("Transpose", "heads_first", &["h"], &["t"]).ints("perm", &[0, 2, 1, 3]))
        .node(node("Reshape", "merge_heads", &["t", "merged"], &["y"]))
        .output("y");
    let g = import(&m);
    assert_eq!(ty(&g, "c"), "f32[3N,4,16]");
    assert_eq!(ty(&g, "h"), "f32[3N,4,2,8]");
    assert_eq!(ty(&g, "y"), "f32[6N,4,8]");
    // ViTDet at batch 1: windows and heads merged (`[8N, 4, 8]`, four windows of two
    // heads), viewed as `view(windows, heads, h, w, -1)`, written `[4, 2, 2, 2, -1]`: the
    // 4 is the batch times a divisor of 8, the windows.
    let m = ModelBuilder::new(17)
        .input("x", F32, &fixed(&[1, 8, 4, 8]))
        .init(tensor_i64("merged", &[3], &[8, 4, 8]))
        .init(tensor_i64("windows", &[5], &[4, 2, 2, 2, -1]))
        .node(node("Reshape", "merge", &["x", "merged"], &["m"]))
        .node(node("Reshape", "per_window", &["m", "windows"], &["w"]))
        .output("w");
    let g = import(&m);
    assert_eq!(ty(&g, "m"), "f32[8N,4,8]");
    assert_eq!(ty(&g, "w"), "f32[4N,2,2,2,8]");
}

/// A mixture-of-experts router exported at a fixed batch of 2 (four tokens a sample):
/// its one-hot choice scatters constant ones into constant zeros of the export batch's
/// tokens, its sort is a TopK whose constant k is those tokens, and `index_add` writes
/// the rows it gathered at the sorted positions back into constant zeros of those
/// tokens. Each follows the batch, and the import notes each.
#[test]
fn a_fixed_batch_router_follows_the_batch() {
    let m = ModelBuilder::new(17)
        .input("x", F32, &fixed(&[2, 4, 3]))
        .init(tensor_i64("rows", &[2], &[-1, 3]))
        .init(tensor_f32("router", &[3, 2], &[0.5, -0.5, 0.25, 0.75, -1.0, 1.0]))
        .init(tensor_i64("one", &[1], &[1]))
        .init(tensor_f32_zeros("choice_zeros", &[8, 2]))
        .init(tensor_f32("ones", &[8, 1], &[1.0; 8]))
        .init(tensor_i64("flat", &[1], &[-1]))
        .init(tensor_i64("tokens", &[1], &[8]))
        .init(tensor_f32_zeros("sum_zeros", &[8, 3]))
        .node(node("Reshape", "token_rows", &["x", "rows"], &["t"]))
        .node(node("MatMul", "logits", &["t", "router"], &["l"]))
        .node(node("TopK", "top", &["l", "one"], &["top_values", "chosen"]).int("axis", 1))
        .node(node("ScatterElements", "one_hot", &["choice_zeros", "chosen", "ones"], &["onehot"]).int("axis", 1))
        .node(node("Reshape", "experts", &["chosen", "flat"], &["e"]))
        .node(node("TopK", "sort", &["e", "tokens"], &["sorted", "order"]).int("axis", 0).int("largest", 0))
        .node(node("Gather", "grouped", &["t", "order"], &["g"]).int("axis", 0))
        .node(node("Unsqueeze", "positions", &["order", "one"], &["p"]))
        .node(node("ScatterND", "index_add", &["sum_zeros", "p", "g"], &["y"]).string("reduction", "add"))
        .output("onehot")
        .output("y");
    let g = import(&m);
    assert_eq!(ty(&g, "t"), "f32[4N,3]");
    assert_eq!(ty(&g, "onehot"), "f32[4N,2]");
    assert_eq!(ty(&g, "order"), "i64[4N]");
    assert_eq!(ty(&g, "y"), "f32[4N,3]");
    for (node, note) in [("one_hot", "fills shaped from its indices"), ("sort", "k the axis's extent at run time"), ("index_add", "zeros of that value's rows")] {
        assert!(g.warnings.iter().any(|w| w.contains(&format!("{node:?}")) && w.contains(note)), "{node}: {:?}", g.warnings);
    }
    assert_eq!(g.source_rewrites.len(), 3);
}

/// `x: [2,3,4]` (exported at batch 2) plus `mask` viewed by x's batch: `Reshape(mask,
/// Concat(Shape(x)[0], [3, 4]))`, `mask` a `[2,10]` constant padded to `[2,12]` (the
/// TorchScript exporter's PEGASUS-X pads a mask of ones to whole blocks so).
fn mask_viewed_by_the_batch(rows: &[f32]) -> ModelBuilder {
    model(
        13,
        &[2, 3, 4],
        vec![
            node("Constant", "mask", &[], &["mask"]).tensor("value", tensor_f32("", &[2, 10], rows)),
            node("Pad", "pad", &["mask", "pads"], &["padded"]),
            node("Shape", "shape", &["x"], &["s"]),
            node("Gather", "batch", &["s", "zero"], &["b"]).int("axis", 0),
            node("Unsqueeze", "unsqueeze", &["b", "axes0"], &["bu"]),
            node("Concat", "concat", &["bu", "blocks"], &["target"]).int("axis", 0),
            node("Reshape", "view", &["padded", "target"], &["viewed"]),
            node("Add", "add", &["x", "viewed"], &["y"]),
        ],
        &["y"],
    )
    .init(tensor_i64("pads", &[4], &[0, 0, 0, 2]))
    .init(tensor_i64("zero", &[], &[0]))
    .init(tensor_i64("axes0", &[1], &[0]))
    .init(tensor_i64("blocks", &[2], &[3, 4]))
}

#[test]
fn a_constant_of_alike_rows_viewed_by_the_batch_is_expanded_to_it() {
    let g = import(&mask_viewed_by_the_batch(&[1.0; 20]));
    let text = pipewright_ir::text::print_graph(&g);
    assert_eq!(ty(&g, "viewed"), "f32[N,3,4]", "{text}");
    assert!(op_names(&g).contains(&"Expand"), "{text}");
    assert!(g.warnings.iter().any(|w| w.contains("node \"view\": reshapes a value whose export-batch rows are all the same")), "{:?}", g.warnings);
}

#[test]
fn a_constant_of_differing_rows_viewed_by_the_batch_is_refused() {
    let mut rows = [1.0; 20];
    rows[15] = 0.0;
    let e = import_err(&mask_viewed_by_the_batch(&rows));
    assert!(
        e.to_string().contains("node \"view\" (Reshape): shape inference failed: cannot reshape [2,12] to [N,3,4]: the target follows the batch, but the value's extents were fixed at export"),
        "{e}"
    );
}

/// `x: [2,3]` (exported at batch 2) beside tokens embedded at indices expanded to the
/// export batch, `embedding(arange(4).expand(2, -1))` (PEGASUS-X's global tokens as the
/// TorchScript exporter writes them), viewed per sample and concatenated with `x`.
fn tokens_expanded_to_the_batch(rows: &[i64]) -> ModelBuilder {
    model(
        13,
        &[2, 3],
        vec![
            node("Expand", "expand", &["ids", "ids_shape"], &["idx"]),
            node("Gather", "embed", &["w", "idx"], &["tokens"]),
            node("Reshape", "view", &["tokens", "flat"], &["flat_tokens"]),
            node("Concat", "concat", &["x", "flat_tokens"], &["y"]).int("axis", 1),
        ],
        &["y"],
    )
    .init(tensor_i64("ids", &[rows.len() as i64 / 4, 4], rows))
    .init(tensor_i64("ids_shape", &[2], &[2, 4]))
    .init(tensor_f32("w", &[4, 3], &[0.5; 12]))
    .init(tensor_i64("flat", &[2], &[2, 12]))
}

#[test]
fn a_gather_at_indices_expanded_to_the_export_batch_follows_the_batch() {
    let g = import(&tokens_expanded_to_the_batch(&[0, 1, 2, 3]));
    let text = pipewright_ir::text::print_graph(&g);
    assert_eq!(ty(&g, "tokens"), "f32[N,4,3]", "{text}");
    assert_eq!(ty(&g, "y"), "f32[N,15]", "{text}");
    assert!(g.warnings.iter().any(|w| w.contains("node \"embed\": a Gather at indices of the export batch's rows, all alike")), "{:?}", g.warnings);
    // Rows that differ are no expansion of one row: the Gather is left as it was.
    let g = import(&tokens_expanded_to_the_batch(&[0, 1, 2, 3, 3, 2, 1, 0]));
    assert_eq!(ty(&g, "tokens"), "f32[2,4,3]");
    assert!(!g.warnings.iter().any(|w| w.contains("a Gather at indices")), "{:?}", g.warnings);
}

/// A model that runs its prompt and its input as one batch (SegGPT) concatenates them
/// into `2N` rows and averages the halves: an export at a fixed batch writes the halves
/// as Slices at the export batch (`[:b]`, `[b:]`), read as row groups that follow the
/// batch. Bounds that are not whole row groups are read as they stand.
#[test]
fn slices_of_whole_row_groups_follow_the_batch() {
    let halves = |batch: i64, cut: i64| {
        ModelBuilder::new(17)
            .input("prompt", F32, &fixed(&[batch, 3]))
            .input("x", F32, &fixed(&[batch, 3]))
            .init(tensor_i64("zero", &[1], &[0]))
            .init(tensor_i64("cut", &[1], &[cut]))
            .init(tensor_i64("end", &[1], &[i64::MAX]))
            .node(node("Concat", "both", &["prompt", "x"], &["both"]).int("axis", 0))
            .node(node("Slice", "first", &["both", "zero", "cut", "zero"], &["first"]))
            .node(node("Slice", "second", &["both", "cut", "end", "zero"], &["second"]))
            .node(node("Add", "merge", &["first", "second"], &["merged"]))
            .output("merged")
    };
    for batch in [1, 2] {
        let g = import(&halves(batch, batch));
        assert_eq!(ty(&g, "both"), "f32[2N,3]");
        assert_eq!((ty(&g, "first"), ty(&g, "second"), ty(&g, "merged")), ("f32[N,3]".to_string(), "f32[N,3]".to_string(), "f32[N,3]".to_string()));
        assert!(g.warnings.iter().any(|w| w.contains("\"first\"") && w.contains(&format!("rows 0..{batch}")) && w.contains("row groups 0..1, which follow the batch")), "{:?}", g.warnings);
        assert_eq!(g.source_rewrites.len(), 2);
    }
    let g = import(&halves(2, 3));
    assert!(g.source_rewrites.is_empty(), "rows 0..3 of 2 x 2 are no whole row groups");
}

/// `x[:, :, -3:] = 0` at a fixed batch (Mllama's tile mask): the default exporter moves
/// the sliced axis first, `[8, 3, N, 1]`, and writes a ScatterND of constant zeros shaped
/// for the export batch at rows 5..8; read with the zeros shaped from the data, it follows
/// the batch. Updates that are not one fill are read as they stand.
#[test]
fn a_fill_at_positions_of_a_leading_axis_follows_the_batch() {
    let masked = |updates: onnx_protobuf::TensorProto| {
        ModelBuilder::new(17)
            .input("x", F32, &fixed(&[2, 3, 8, 1]))
            .init(tensor_i64("rows", &[3, 1], &[5, 6, 7]))
            .init(updates)
            .node(node("Transpose", "first", &["x"], &["xt"]).ints("perm", &[2, 1, 0, 3]))
            .node(node("ScatterND", "fill", &["xt", "rows", "zeros"], &["filled"]))
            .node(node("Transpose", "back", &["filled"], &["y"]).ints("perm", &[2, 1, 0, 3]))
            .output("y")
    };
    let g = import(&masked(tensor_f32_zeros("zeros", &[3, 3, 2, 1])));
    assert_eq!(ty(&g, "y"), "f32[N,3,8,1]");
    assert!(g.warnings.iter().any(|w| w.contains("\"fill\"") && w.contains("read with the fill shaped from the data at run time")), "{:?}", g.warnings);
    assert_eq!(g.source_rewrites.len(), 1);
    let g = import(&masked(tensor_f32("zeros", &[3, 3, 2, 1], &(0..18).map(|i| i as f32).collect::<Vec<_>>())));
    assert!(g.source_rewrites.is_empty(), "updates of differing values stay");
}

/// Speech2Text's sinusoidal positions at a fixed batch (TorchScript): `cumsum` of a mask
/// of ones of the export batch, a table looked up at the flattened positions and viewed
/// back as `[2, 4, 3]`, all known at import, added to the features: their rows are alike,
/// so the sum reads the first row, which broadcasts over any batch. Positions of rows that
/// differ (a mask that pads one row) are read as they stand.
#[test]
fn positions_known_at_import_with_alike_rows_broadcast_over_the_batch() {
    let positions = |mask: &[i64]| {
        ModelBuilder::new(17)
            .input("x", F32, &fixed(&[2, 4, 3]))
            .init(tensor_i64("mask", &[2, 4], mask))
            .init(tensor_i64("axis", &[], &[1]))
            .init(tensor_i64("flat", &[1], &[-1]))
            .init(tensor_i64("view", &[3], &[2, 4, -1]))
            .init(tensor_f32("table", &[10, 3], &(0..30).map(|i| i as f32 * 0.25).collect::<Vec<_>>()))
            .node(node("CumSum", "count", &["mask", "axis"], &["counted"]))
            .node(node("Mul", "masked", &["counted", "mask"], &["at"]))
            .node(node("Reshape", "flatten", &["at", "flat"], &["at_flat"]))
            .node(node("Gather", "lookup", &["table", "at_flat"], &["rows"]).int("axis", 0))
            .node(node("Reshape", "per_sample", &["rows", "view"], &["pos"]))
            .node(node("Relu", "features", &["x"], &["h"]))
            .node(node("Add", "add_positions", &["h", "pos"], &["y"]))
            .output("y")
    };
    let g = import(&positions(&[1; 8]));
    assert_eq!(ty(&g, "y"), "f32[N,4,3]");
    assert!(g.warnings.iter().any(|w| w.contains("\"add_positions\"") && w.contains("read as its first row, which broadcasts over the batch")), "{:?}", g.warnings);
    assert_eq!(g.source_rewrites.len(), 1);
    let g = import(&positions(&[1, 1, 1, 1, 1, 1, 0, 0]));
    assert!(g.source_rewrites.is_empty(), "rows that differ are read as they stand");
}

/// ZoeDepth's neck runs four hidden states as one batch and takes them apart with
/// `split(batch_size)`: the TorchScript export writes a Split into parts of the export
/// batch, read (at opsets before and after 18) as an equal split into row groups that
/// follow the batch. Parts of another size are read as they stand.
#[test]
fn splits_into_whole_row_groups_follow_the_batch() {
    let stacked = |opset: i64, part: i64| {
        ModelBuilder::new(opset)
            .input("a", F32, &fixed(&[2, 3]))
            .input("b", F32, &fixed(&[2, 3]))
            .init(tensor_i64("parts", &[2], &[part, 4 - part]))
            .node(node("Concat", "both", &["a", "b"], &["both"]).int("axis", 0))
            .node(node("Split", "apart", &["both", "parts"], &["first", "second"]).int("axis", 0))
            .node(node("Mul", "merge", &["first", "second"], &["merged"]))
            .output("merged")
    };
    for opset in [17, 18] {
        let g = import(&stacked(opset, 2));
        assert_eq!((ty(&g, "both"), ty(&g, "first"), ty(&g, "merged")), ("f32[2N,3]".to_string(), "f32[N,3]".to_string(), "f32[N,3]".to_string()));
        assert!(g.warnings.iter().any(|w| w.contains("\"apart\"") && w.contains("read as an equal split into the 2 row groups")), "{:?}", g.warnings);
        assert_eq!(g.source_rewrites.len(), 1);
    }
    let g = import(&stacked(17, 1));
    assert!(g.source_rewrites.is_empty(), "parts of 1 and 3 rows are no row groups of 2");
    assert_eq!(ty(&g, "first"), "f32[1,3]");
}

/// `x[:, 0] = y` at a fixed batch (CSM's depth decoder puts the backbone's state at
/// position 0): the default exporter writes a ScatterElements at constant indices, all 0,
/// shaped as the updates at the export batch; read with those indices shaped from the
/// updates, it follows the batch. Indices that are not all one position are read as they
/// stand.
#[test]
fn a_scatter_at_one_position_follows_the_batch() {
    let scatter = |positions: &[i64]| {
        ModelBuilder::new(17)
            .input("x", F32, &fixed(&[2, 4, 3]))
            .input("y", F32, &fixed(&[2, 1, 3]))
            .init(tensor_i64("at", &[2, 1, 3], positions))
            .node(node("Relu", "rx", &["x"], &["rx"]))
            .node(node("ScatterElements", "put", &["rx", "at", "y"], &["put"]).int("axis", 1))
            .output("put")
    };
    let g = import(&scatter(&[0; 6]));
    assert_eq!(ty(&g, "put"), "f32[N,4,3]");
    assert!(g.warnings.iter().any(|w| w.contains("\"put\"") && w.contains("indices all 0")), "{:?}", g.warnings);
    assert_eq!(g.source_rewrites.len(), 1);
    let g = import(&scatter(&[0, 0, 0, 1, 1, 1]));
    assert!(g.source_rewrites.is_empty(), "{:?}", g.warnings);
}

/// `x[:, 0] = y` as TorchScript writes it at a fixed batch: a ScatterND at the pairs
/// `(i, 0)` of every row `i` of the export batch, read as a ScatterElements at position 0
/// of every row, which follows the batch. Pairs that skip a row are read as they stand.
#[test]
fn a_scatter_nd_at_one_position_per_row_follows_the_batch() {
    let scatter = |pairs: &[i64]| {
        ModelBuilder::new(17)
            .input("x", F32, &fixed(&[2, 4, 3]))
            .input("y", F32, &fixed(&[2, 1, 3]))
            .init(tensor_i64("at", &[2, 1, 2], pairs))
            .node(node("Relu", "rx", &["x"], &["rx"]))
            .node(node("ScatterND", "put", &["rx", "at", "y"], &["put"]))
            .output("put")
    };
    let g = import(&scatter(&[0, 0, 1, 0]));
    assert_eq!(ty(&g, "put"), "f32[N,4,3]");
    assert!(g.warnings.iter().any(|w| w.contains("\"put\"") && w.contains("positions [0] of every row")), "{:?}", g.warnings);
    assert_eq!(g.source_rewrites.len(), 1);
    let g = import(&scatter(&[0, 0, 0, 1]));
    assert!(g.source_rewrites.is_empty(), "{:?}", g.warnings);
}
