//! Ops computed at import (NonZero, Unique, NonMaxSuppression, the windows,
//! MelWeightMatrix) and Compress with a known condition: their results from constants
//! and frozen inputs, and the refusal, naming the node, when a deciding input is data.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::*;
use pipewright_ir::{import_bytes, Graph, ImportError, ImportOptions, TensorData, ValueDef};

fn import_with(m: &ModelBuilder, opts: &ImportOptions) -> Result<Graph, ImportError> {
    import_bytes(&m.bytes(), Path::new("."), opts)
}

fn import(m: &ModelBuilder) -> Graph {
    import_with(m, &ImportOptions::default()).unwrap_or_else(|e| panic!("import failed: {e}"))
}

/// The constant a value was folded to: `(dims, values as f64)`.
fn constant(g: &Graph, name: &str) -> (Vec<i64>, Vec<f64>) {
    let v = g.value_ids().find(|v| g.value(*v).name == name).unwrap_or_else(|| panic!("no value {name:?}"));
    match &g.value(v).def {
        ValueDef::Weight(w) => (w.data.dims.clone(), w.data.to_f64s()),
        other => panic!("{name:?} is not a constant: {other:?}"),
    }
}

fn ints(v: &[i64]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn assert_close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs()), "{got:?} vs {want:?}");
    }
}

#[test]
fn non_zero_of_a_constant() {
    let m = ModelBuilder::new(13)
        .init(tensor_i64("x", &[2, 3], &[0, 4, 0, -1, 0, 2]))
        .node(node("NonZero", "nz", &["x"], &["y"]))
        .output("y");
    let (dims, vals) = constant(&import(&m), "y");
    assert_eq!(dims, vec![2, 3]);
    assert_eq!(vals, ints(&[0, 1, 1, 1, 0, 2]));
}

/// Unique in order of first occurrence, and along an axis (sorted slices), with all four
/// outputs; a trainable (float initializer) input is refused with the node's name.
#[test]
fn unique_outputs() {
    let m = ModelBuilder::new(11)
        .init(tensor_i64("x", &[6], &[3, 1, 3, 2, 1, 5]))
        .node(node("Unique", "u", &["x"], &["y", "idx", "inv", "cnt"]).int("sorted", 0))
        .output("y")
        .output("idx")
        .output("inv")
        .output("cnt");
    let g = import(&m);
    assert_eq!(constant(&g, "y").1, ints(&[3, 1, 2, 5]));
    assert_eq!(constant(&g, "idx").1, ints(&[0, 1, 3, 5]));
    assert_eq!(constant(&g, "inv").1, ints(&[0, 1, 0, 2, 1, 3]));
    assert_eq!(constant(&g, "cnt").1, ints(&[2, 2, 1, 1]));
    let rows = ModelBuilder::new(11)
        .init(tensor_i64("x", &[3, 2], &[2, 1, 0, 4, 2, 1]))
        .node(node("Unique", "u", &["x"], &["y", "idx", "inv", "cnt"]).int("axis", 0))
        .output("y")
        .output("inv");
    let g = import(&rows);
    assert_eq!(constant(&g, "y"), (vec![2, 2], ints(&[0, 4, 2, 1])));
    assert_eq!(constant(&g, "inv").1, ints(&[1, 0, 1]));
    let trainable = ModelBuilder::new(11)
        .init(tensor_f32("w", &[3], &[1.0, 2.0, 1.0]))
        .node(node("Unique", "u", &["w"], &["y"]))
        .output("y");
    let msg = import_with(&trainable, &ImportOptions::default()).expect_err("a trainable input is data").to_string();
    assert!(msg.contains("\"u\"") && msg.contains("not known at import"), "{msg}");
}

/// A small float graph input read only by Unique is frozen (it decides the output shape);
/// read by another op too, it stays data and Unique is refused.
#[test]
fn frozen_float_inputs_of_unique() {
    let data = TensorData::from_f64s(pipewright_ir::DType::F32, vec![4], &[0.5, -1.0, 0.5, 2.0]);
    let mut opts = ImportOptions::default();
    opts.freeze_shape_inputs([("x", &data)]);
    let only = ModelBuilder::new(11).input_f32("x", &[4]).node(node("Unique", "u", &["x"], &["y"])).output("y");
    let g = import_with(&only, &opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(constant(&g, "y").1, vec![-1.0, 0.5, 2.0]);
    let shared = only.clone().node(node("Neg", "neg", &["x"], &["z"])).output("z");
    let msg = import_with(&shared, &opts).expect_err("x is data").to_string();
    assert!(msg.contains("Unique") && msg.contains("input 0"), "{msg}");
}

/// NonMaxSuppression: the overlapping lower-scored box is suppressed, the score threshold
/// drops the last one, and centre-point boxes select the same.
#[test]
fn non_max_suppression() {
    // Boxes and scores as (trainable) float initializers, or as graph inputs to freeze.
    let nms = |center: i64, as_inputs: bool| {
        let m = ModelBuilder::new(11);
        let m = if as_inputs {
            m.input_f32("boxes", &[1, 4, 4]).input_f32("scores", &[1, 1, 4])
        } else {
            m.init(tensor_f32("boxes", &[1, 4, 4], &[0.0; 16])).init(tensor_f32("scores", &[1, 1, 4], &[0.5; 4]))
        };
        m.init(tensor_i64("max", &[1], &[3]))
            .node(node("Constant", "iou_c", &[], &["iou"]).tensor("value", tensor_f32("", &[1], &[0.5])))
            .node(node("Constant", "score_c", &[], &["score"]).tensor("value", tensor_f32("", &[1], &[0.2])))
            .node(node("NonMaxSuppression", "nms", &["boxes", "scores", "max", "iou", "score"], &["sel"]).int("center_point_box", center))
            .output("sel")
    };
    // Corners: box 1 overlaps box 0 (IoU 0.82), box 2 is apart, box 3 below the threshold.
    let corners = [0.0f64, 0.0, 1.0, 1.0, 0.0, 0.1, 1.0, 1.1, 2.0, 2.0, 3.0, 3.0, 5.0, 5.0, 6.0, 6.0];
    let want = (vec![2, 3], ints(&[0, 0, 0, 0, 0, 2]));
    let f32s = |dims: Vec<i64>, v: &[f64]| TensorData::from_f64s(pipewright_ir::DType::F32, dims, v);
    let mut opts = ImportOptions::default();
    opts.frozen_inputs = HashMap::from([
        ("boxes".to_string(), f32s(vec![1, 4, 4], &corners)),
        ("scores".to_string(), f32s(vec![1, 1, 4], &[0.9, 0.8, 0.7, 0.1])),
    ]);
    let msg = import_with(&nms(0, false), &ImportOptions::default()).expect_err("trainable boxes").to_string();
    assert!(msg.contains("\"nms\"") && msg.contains("input 0"), "{msg}");
    let g = import_with(&nms(0, true), &opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(constant(&g, "sel"), want);
    // The same boxes as [x_centre, y_centre, width, height].
    let centres: Vec<f64> = corners.chunks(4).flat_map(|c| [(c[1] + c[3]) / 2.0, (c[0] + c[2]) / 2.0, c[3] - c[1], c[2] - c[0]]).collect();
    opts.frozen_inputs.insert("boxes".into(), f32s(vec![1, 4, 4], &centres));
    let g = import_with(&nms(1, true), &opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(constant(&g, "sel"), want);
}

/// Windows (periodic and symmetric) and a mel matrix against their formulas.
#[test]
fn windows_and_mel_weights() {
    let window = |op: &str, periodic: i64| {
        let m = ModelBuilder::new(17)
            .init(tensor_i64("n", &[], &[5]))
            .node(node(op, "w", &["n"], &["y"]).int("periodic", periodic))
            .output("y");
        constant(&import(&m), "y")
    };
    let cos = |k: f64, n: f64, d: f64| (2.0 * std::f64::consts::PI * k * n / d).cos();
    let hann: Vec<f64> = (0..5).map(|i| 0.5 - 0.5 * cos(1.0, i as f64, 5.0)).collect();
    let hamming: Vec<f64> = (0..5).map(|i| 25.0 / 46.0 - 21.0 / 46.0 * cos(1.0, i as f64, 4.0)).collect();
    let blackman: Vec<f64> = (0..5).map(|i| 0.42 - 0.5 * cos(1.0, i as f64, 5.0) + 0.08 * cos(2.0, i as f64, 5.0)).collect();
    assert_close(&window("HannWindow", 1).1, &hann);
    assert_close(&window("HammingWindow", 0).1, &hamming);
    assert_close(&window("BlackmanWindow", 1).1, &blackman);
    let mel = ModelBuilder::new(17)
        .init(tensor_i64("bins", &[], &[2]))
        .init(tensor_i64("dft", &[], &[16]))
        .init(tensor_i64("rate", &[], &[8000]))
        .node(node("Constant", "lo_c", &[], &["lo"]).tensor("value", tensor_f32("", &[], &[0.0])))
        .node(node("Constant", "hi_c", &[], &["hi"]).tensor("value", tensor_f32("", &[], &[4000.0])))
        .node(node("MelWeightMatrix", "mel", &["bins", "dft", "rate", "lo", "hi"], &["y"]))
        .output("y");
    let (dims, vals) = constant(&import(&mel), "y");
    assert_eq!(dims, vec![9, 2]);
    // Every filter is a triangle peaking at 1; each column sums to at least 1.
    for col in 0..2 {
        let c: Vec<f64> = (0..9).map(|r| vals[r * 2 + col]).collect();
        assert!(c.iter().any(|&v| v == 1.0) && c.iter().all(|&v| (0.0..=1.0).contains(&v)), "{c:?}");
    }
}

/// Compress with a constant condition becomes a Gather (with an axis) or a flatten and
/// a Gather (without); a condition fed as data is refused.
#[test]
fn compress_as_gather() {
    let m = |axis: Option<i64>| {
        let mut n = node("Compress", "c", &["x", "cond"], &["y"]);
        if let Some(a) = axis {
            n = n.int("axis", a);
        }
        ModelBuilder::new(11).input_f32("x", &[2, 3]).init(tensor_i64("cond", &[3], &[1, 0, 1])).node(n).output("y")
    };
    let ty = |g: &Graph| g.value(g.outputs()[0]).ty.to_string();
    let g = import(&m(Some(-1)));
    assert_eq!(ty(&g), "f32[N,2]");
    assert!(g.node_ids().any(|n| g.node(n).op.name() == "Gather"));
    assert_eq!(ty(&import(&m(None))), "f32[2]");
    let data = ModelBuilder::new(11)
        .input_f32("x", &[2, 3])
        .input("cond", I64, &[Ax::Fixed(3)])
        .node(node("Compress", "c", &["x", "cond"], &["y"]).int("axis", 1))
        .output("y");
    let msg = import_with(&data, &ImportOptions::default()).expect_err("data condition").to_string();
    assert!(msg.contains("\"c\"") && msg.contains("input 1"), "{msg}");
    // A condition over the 64-element freezing limit is frozen when Compress alone reads it.
    let cond: Vec<i64> = (0..100).map(|i| i64::from(i % 3 == 0)).collect();
    let mut opts = ImportOptions::default();
    let t = TensorData::from_i64s(vec![100], &cond);
    opts.freeze_shape_inputs([("cond", &t)]);
    let long = ModelBuilder::new(11)
        .input_f32("x", &[2, 100])
        .input("cond", I64, &[Ax::Fixed(100)])
        .node(node("Compress", "c", &["x", "cond"], &["y"]).int("axis", 1))
        .output("y");
    let g = import_with(&long, &opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ty(&g), "f32[N,34]");
    let shared = long.node(node("Cast", "cast", &["cond"], &["z"]).int("to", 1)).output("z");
    let msg = import_with(&shared, &opts).expect_err("a condition also read as data stays data").to_string();
    assert!(msg.contains("Compress") && msg.contains("input 1"), "{msg}");
}

/// The importer's batch-baked check freezes activations the exporter evaluated for its
/// batch (attention masks, ViT's expanded class token, position embeddings expanded per
/// sample), never a layer's own parameters: in the batch-4 ResNet export two convolutions
/// have 4 output channels (kernels `[4, 8, 1, 1]`), and they must still train. Every
/// batch-4 export of the corpus, with how many initializers it really baked, and how many
/// more the exporter itself marks as folded from no parameter (the attention masks, and
/// Llama's rotary tables: constants whatever their leading extent). ViT's class token, which
/// the exporter records as folded from the `cls_token` parameter by an expand, trains as
/// that parameter instead of being frozen.
#[test]
fn layer_parameters_are_never_taken_for_batch_baked_activations() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/exports");
    let baked = [("resnet-b4", 0, 0, 0), ("convnext-b4", 0, 0, 0), ("bert-b4", 1, 1, 0), ("gpt2-b4", 0, 1, 0), ("llama-b4", 0, 3, 0), ("whisper-b4", 1, 1, 0), ("vit-b4", 0, 2, 1)];
    for (name, count, folded, expanded) in baked {
        let g = pipewright_ir::import_model(&dir.join(format!("{name}.onnx")), &pipewright_ir::ImportOptions::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let frozen = &g.choices.frozen_batch_baked;
        assert_eq!(frozen.len(), count, "{name}: {frozen:?}");
        let trained = &g.choices.trained_batch_baked;
        assert_eq!(trained.len(), expanded, "{name}: {trained:?}");
        assert!(trained.iter().all(|t| t.contains("(the parameter") && t.contains("expanded)")), "{name}: {trained:?}");
        assert!(frozen.iter().all(|f| !f.contains("weight")), "{name}: {frozen:?}");
        let constants: Vec<&String> = g.warnings.iter().filter(|w| w.contains("folded it from no parameter")).collect();
        assert_eq!(constants.len(), folded, "{name}: {constants:?}");
        assert!(constants.iter().all(|w| !w.contains("weight\"")), "{name}: {constants:?}");
    }
}

/// A mixture-of-experts step as TorchScript writes it: the pairs a routing mask selects
/// (`NonZero` of a mask computed at run time), the token rows gathered at them, an
/// expert applied row by row, and the rows scattered back into zeros of all tokens.
fn routed(mask_into: &str, output: &str) -> ModelBuilder {
    ModelBuilder::new(17)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(4)])
        .input("route", F32, &[Ax::Param("batch"), Ax::Fixed(2)])
        .init(tensor_f32("expert", &[4, 4], &[0.5; 16]))
        .init(tensor_f32("half", &[], &[0.5]))
        .init(tensor_i64("second", &[1], &[1]))
        .init(tensor_i64("rows", &[1], &[-1]))
        .init(tensor_i64("ones", &[2], &[1, 1]))
        .node(node("Transpose", "pairs_first", &["route"], &["rt"]).ints("perm", &[1, 0]))
        .node(node("Greater", "chose", &["rt", "half"], &["mask"]))
        .node(node("NonZero", "selected", &[mask_into], &["nz"]))
        .node(node("Transpose", "pair_rows", &["nz"], &["nzt"]).ints("perm", &[1, 0]))
        .node(node("Split", "coordinates", &["nzt", "ones"], &["choice", "tok2"]).int("axis", 1))
        .node(node("Reshape", "tokens", &["tok2", "rows"], &["tok_flat"]))
        .node(node("Squeeze", "token", &["tok2", "second"], &["tok"]))
        .node(node("Gather", "rows_at", &["x", "tok"], &["picked"]).int("axis", 0))
        .node(node("MatMul", "apply", &["picked", "expert"], &["out"]))
        .node(node("Shape", "x_shape", &["x"], &["xs"]))
        .node(node("ConstantOfShape", "zeros", &["xs"], &["z"]).tensor("value", tensor_f32("", &[1], &[0.0])))
        .node(node("Unsqueeze", "token_col", &["tok", "second"], &["tc"]))
        .node(node("Shape", "out_shape", &["out"], &["os"]))
        .node(node("Expand", "at", &["tc", "os"], &["idx"]))
        .node(node("ScatterElements", "back", &["z", "idx", "out"], &["y"]).int("axis", 0))
        .output(output)
}

/// The dense reading: every (choice, token) position, the scatter's updates masked and
/// summed into the zeros; the import says so.
#[test]
fn non_zero_of_routing_is_read_densely() {
    let g = import(&routed("mask", "y"));
    let ops: Vec<&str> = g.node_ids().map(|n| g.node(n).op.name()).collect();
    assert!(ops.contains(&"Range") && !ops.contains(&"NonZero"), "{ops:?}");
    assert!(g.warnings.iter().any(|w| w.contains("\"selected\"") && w.contains("every position of its mask")), "{:?}", g.warnings);
    let text = pipewright_ir::text::print_graph(&g);
    assert!(text.contains("ScatterElements[axis=0, reduction=\"add\"]"), "{text}");
    let y = g.value_ids().find(|&v| g.value(v).name == "y").expect("y");
    assert_eq!(g.value(y).ty.to_string(), "f32[N,4]");
}

/// Where the positions or rows go elsewhere than back into zeros, the dense reading
/// would change the result: refused, naming the node or the output.
#[test]
fn non_zero_of_data_used_otherwise_is_refused() {
    let e = import_with(&routed("mask", "picked"), &ImportOptions::default()).expect_err("rows as an output").to_string();
    assert!(e.contains("\"picked\"") && e.contains("scattered back into zeros"), "{e}");
    let reduced = routed("mask", "y").node(node("ReduceSum", "count", &["tok_flat"], &["n"]).int("keepdims", 0)).output("n");
    let e = import_with(&reduced, &ImportOptions::default()).expect_err("a reduction of positions").to_string();
    assert!(e.contains("\"count\"") && e.contains("reads the positions"), "{e}");
    // The count itself (how many pairs chose the expert) would be every position's.
    let counted = routed("mask", "y")
        .node(node("Shape", "how_many", &["tok"], &["hm"]))
        .node(node("Cast", "as_float", &["hm"], &["hmf"]).int("to", 1))
        .node(node("Div", "share", &["y", "hmf"], &["ys"]))
        .output("ys");
    let e = import_with(&counted, &ImportOptions::default()).expect_err("arithmetic on the count").to_string();
    assert!(e.contains("\"share\"") && e.contains("the count of positions"), "{e}");
}

/// Experts as GraniteMoE's `ParallelExperts` are exported: the rows (sorted by expert)
/// split at sizes known only at run time, one expert's linear map per part, the parts
/// joined again in order.
fn experts(joined: &[&str], output: &str) -> ModelBuilder {
    ModelBuilder::new(17)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(4)])
        .input("route", F32, &[Ax::Param("batch"), Ax::Fixed(2)])
        .init(tensor_f32("half", &[], &[0.5]))
        .init(tensor_i64("tokens", &[1], &[0]))
        .init(tensor_f32("expert0", &[4, 3], &[0.5; 12]))
        .init(tensor_f32("expert1", &[4, 3], &[0.25; 12]))
        .init(tensor_f32("bias1", &[3], &[1.0; 3]))
        .node(node("Greater", "chose", &["route", "half"], &["mask"]))
        .node(node("Cast", "as_count", &["mask"], &["counts"]).int("to", 7))
        .node(node("ReduceSum", "per_expert", &["counts", "tokens"], &["sizes"]).int("keepdims", 0))
        .node(node("Split", "by_expert", &["x", "sizes"], &["part0", "part1"]).int("axis", 0))
        .node(node("MatMul", "apply0", &["part0", "expert0"], &["out0"]))
        .node(node("MatMul", "apply1", &["part1", "expert1"], &["pre1"]))
        .node(node("Add", "bias", &["pre1", "bias1"], &["out1"]))
        .node(node("Concat", "joined", joined, &["y"]).int("axis", 0))
        .output(output)
}

/// The dense reading: every part holds all the rows, the Concat takes each row from
/// the part whose range holds it; the import says so, and the result keeps the rows.
#[test]
fn split_at_sizes_computed_at_run_time_is_read_densely() {
    let g = import(&experts(&["out0", "out1"], "y"));
    let ops: Vec<&str> = g.node_ids().map(|n| g.node(n).op.name()).collect();
    assert!(ops.contains(&"CumSum") && ops.contains(&"Where") && !ops.contains(&"Split") && !ops.contains(&"Concat"), "{ops:?}");
    assert!(g.warnings.iter().any(|w| w.contains("\"by_expert\"") && w.contains("each of its 2 parts read as all the rows")), "{:?}", g.warnings);
    let y = g.value_ids().find(|&v| g.value(v).name == "y").expect("y");
    assert_eq!(g.value(y).ty.to_string(), "f32[N,3]");
}

/// Where a part goes elsewhere than through row-by-row computation into one Concat of
/// all the parts in order, the dense reading would change the result: refused, naming
/// the node or the output.
#[test]
fn split_at_run_time_sizes_used_otherwise_is_refused() {
    let refused = |m: &ModelBuilder| import_with(m, &ImportOptions::default()).expect_err("refused").to_string();
    let e = refused(&experts(&["out1", "out0"], "y"));
    assert!(e.contains("\"joined\"") && e.contains("not all of them in order"), "{e}");
    let no_output = experts(&["out0", "out1"], "out0").node(node("Concat", "nowhere", &["out0", "out1"], &[]).int("axis", 0));
    let e = refused(&no_output);
    assert!(e.contains("\"nowhere\"") && e.contains("without one output"), "{e}");
    let e = refused(&experts(&["out0", "out1"], "out0"));
    assert!(e.contains("\"out0\"") && e.contains("one Concat joins all its parts"), "{e}");
    let reduced = experts(&["out0", "out1"], "y").node(node("ReduceSum", "total", &["out1"], &["t"]).int("keepdims", 0)).output("t");
    let e = refused(&reduced);
    assert!(e.contains("\"total\"") && e.contains("computes across the rows"), "{e}");
    let wide = ModelBuilder::new(17)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(4)])
        .input("route", F32, &[Ax::Param("batch"), Ax::Fixed(2)])
        .init(tensor_i64("tokens", &[1], &[0]))
        .node(node("Cast", "as_count", &["route"], &["counts"]).int("to", 7))
        .node(node("ReduceSum", "per_expert", &["counts", "tokens"], &["sizes"]).int("keepdims", 0))
        .node(node("Split", "columns", &["x", "sizes"], &["a", "b"]).int("axis", 1))
        .node(node("Concat", "joined", &["a", "b"], &["y"]).int("axis", 1))
        .output("y");
    let e = refused(&wide);
    assert!(e.contains("\"columns\"") && e.contains("along axis 1"), "{e}");
}

/// A sort of an axis that follows the batch (TopK of the whole axis, `k` its extent
/// computed from the shape) keeps the axis's symbolic extent.
#[test]
fn sort_of_a_batch_axis_keeps_its_extent() {
    let m = ModelBuilder::new(17)
        .input("x", F32, &[Ax::Param("batch"), Ax::Fixed(2)])
        .init(tensor_i64("flat", &[1], &[-1]))
        .init(tensor_i64("first", &[1], &[0]))
        .node(node("Reshape", "flatten", &["x", "flat"], &["f"]))
        .node(node("Shape", "extent", &["f"], &["fs"]))
        .node(node("Gather", "k", &["fs", "first"], &["k"]).int("axis", 0))
        .node(node("TopK", "sort", &["f", "k"], &["values", "order"]).int("largest", 0))
        .output("order");
    let g = import(&m);
    let order = g.value_ids().find(|&v| g.value(v).name == "order").expect("order");
    assert_eq!(g.value(order).ty.to_string(), "i64[2N]");
}
