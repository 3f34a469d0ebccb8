//! Shapes computed from shapes, as the TorchScript exporter writes them for a dynamic batch
//! axis: the chains depend on the input's shape only, never on its data, so symbolic shape
//! inference follows the batch through them and the shapes are known at import.

mod common;

use std::path::Path;

use common::{node, tensor_i64, Ax, ModelBuilder, NodeExt, I64};
use pipewright_ir::{import_bytes, verify, Graph, ImportOptions};

fn import(m: &ModelBuilder) -> Graph {
    let g = import_bytes(&m.bytes(), Path::new("."), &ImportOptions::default()).unwrap_or_else(|e| panic!("import failed: {e}"));
    verify(&g).unwrap_or_else(|e| panic!("imported graph fails verification: {e:?}"));
    g
}

fn ty(g: &Graph, name: &str) -> String {
    let v = g.value_ids().find(|v| g.value(*v).name == name).unwrap_or_else(|| panic!("no value {name:?}"));
    g.value(v).ty.to_string()
}

/// `torch.Tensor.expand(batch, seq)` of the legacy exporter (RoBERTa's position ids, the
/// causal LMs' attention masks): the target is the input's shape rebuilt from
/// Shape/Gather/Unsqueeze/Concat, with each `-1` replaced by 1 through
/// `Where(Equal(shape, ConstantOfShape(Shape(shape)) * -1), ones, shape)`. Equal compares
/// the batch with -1, which no batch size equals.
#[test]
fn an_expand_target_rebuilt_from_the_input_shape_is_known() {
    let ones = common::tensor_i64("one", &[1], &[1]);
    let m = ModelBuilder::new(17)
        .input("ids", I64, &[Ax::Param("batch"), Ax::Fixed(16)])
        .init(tensor_i64("pos", &[1, 16], &(0..16).collect::<Vec<_>>()))
        .init(tensor_i64("i0", &[], &[0]))
        .init(tensor_i64("i1", &[], &[1]))
        .init(tensor_i64("axes0", &[1], &[0]))
        .init(tensor_i64("minus_one", &[], &[-1]))
        .node(node("Shape", "s", &["ids"], &["s"]))
        .node(node("Gather", "b", &["s", "i0"], &["b"]).int("axis", 0))
        .node(node("Gather", "t", &["s", "i1"], &["t"]).int("axis", 0))
        .node(node("Unsqueeze", "bu", &["b", "axes0"], &["bu"]))
        .node(node("Unsqueeze", "tu", &["t", "axes0"], &["tu"]))
        .node(node("Concat", "shape", &["bu", "tu"], &["shape"]).int("axis", 0))
        .node(node("Shape", "ss", &["shape"], &["ss"]))
        .node(node("ConstantOfShape", "ones", &["ss"], &["ones"]).tensor("value", ones))
        .node(node("Mul", "neg", &["ones", "minus_one"], &["neg"]))
        .node(node("Equal", "eq", &["shape", "neg"], &["eq"]))
        .node(node("Where", "sel", &["eq", "ones", "shape"], &["sel"]))
        .node(node("Expand", "expand", &["pos", "sel"], &["y"]))
        .output("y");
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "i64[N,16]");
    assert_eq!(ty(&g, "ids"), "i64[N,16]");
}

/// A shape input that is not known at import names where it stopped being known and what
/// to do: the model input whose values it reads, or the op the importer does not evaluate.
#[test]
fn an_unknown_shape_names_where_it_stopped_being_known() {
    let data_target = ModelBuilder::new(17)
        .input("x", common::F32, &[Ax::Fixed(2), Ax::Fixed(16)])
        .input("target", I64, &[Ax::Fixed(2)])
        .node(node("Reshape", "reshape", &["x", "target"], &["y"]))
        .output("y");
    let e = import_bytes(&data_target.bytes(), Path::new("."), &ImportOptions::default()).unwrap_err().to_string();
    assert!(e.contains("node \"reshape\" (Reshape): shape inference failed: shape input is not known at import: it is computed from the values of model input \"target\""), "{e}");
    let unevaluated = ModelBuilder::new(17)
        .input("x", common::F32, &[Ax::Param("batch"), Ax::Fixed(16)])
        .init(tensor_i64("k", &[1], &[2]))
        .node(node("Shape", "s", &["x"], &["s"]))
        .node(node("TopK", "top", &["s", "k"], &["t", "ti"]))
        .node(node("Reshape", "reshape", &["x", "t"], &["y"]))
        .output("y");
    let e = import_bytes(&unevaluated.bytes(), Path::new("."), &ImportOptions::default()).unwrap_err().to_string();
    assert!(e.contains("it stops being known at node \"top\" (TopK), whose result the importer does not compute from known inputs; export the model with this shape as a constant"), "{e}");
}

/// A symbolic batch axis that cannot be the batch says why and what to do, under
/// `--batch fixed` and when another input lacks it.
#[test]
fn a_symbolic_axis_that_is_not_the_batch_says_what_to_do() {
    let m = ModelBuilder::new(17).input("x", common::F32, &[Ax::Param("batch"), Ax::Fixed(4)]).node(node("Relu", "r", &["x"], &["y"])).output("y");
    let fixed = ImportOptions { batch: pipewright_ir::BatchMode::Fixed, ..ImportOptions::default() };
    let e = import_bytes(&m.bytes(), Path::new("."), &fixed).unwrap_err().to_string();
    assert!(e.contains("tensor \"x\": axis 0 is the symbol \"batch\", but --batch fixed keeps the extents as exported: import with --batch auto"), "{e}");
    let two = ModelBuilder::new(17)
        .input("x", common::F32, &[Ax::Param("batch"), Ax::Fixed(4)])
        .input("scale", common::F32, &[Ax::Fixed(4)])
        .node(node("Mul", "m", &["x", "scale"], &["y"]))
        .output("y");
    let e = import_bytes(&two.bytes(), Path::new("."), &ImportOptions::default()).unwrap_err().to_string();
    assert!(e.contains("axis 0 is the symbol \"batch\", but it cannot be taken for the batch: every model input must start with the same batch axis"), "{e}");
}

/// `F.pad` to a multiple of a window (Swin), as the legacy exporter writes it: the pads come
/// from Mod/Sub over the input's static spatial sizes, joined with zeros, reshaped to
/// pairs, reversed along axis 0 (Slice with step -1) and transposed into ONNX's order.
#[test]
fn pads_computed_from_the_input_shape_are_known() {
    let zero = common::tensor_i64("zero", &[1], &[0]);
    let scalar = |name: &str, v: i64| tensor_i64(name, &[], &[v]);
    let m = ModelBuilder::new(17)
        .input("x", common::F32, &[Ax::Param("batch"), Ax::Fixed(3), Ax::Fixed(7), Ax::Fixed(7)])
        .init(scalar("i2", 2))
        .init(scalar("i3", 3))
        .init(scalar("win", 4))
        .init(tensor_i64("axes0", &[1], &[0]))
        .init(tensor_i64("four", &[1], &[4]))
        .init(tensor_i64("pairs_shape", &[2], &[-1, 2]))
        .init(tensor_i64("flat", &[1], &[-1]))
        .init(tensor_i64("start", &[1], &[-1]))
        .init(tensor_i64("end", &[1], &[i64::MIN]))
        .init(tensor_i64("step", &[1], &[-1]))
        .init(tensor_i64("zero_pad", &[1], &[0]))
        .node(node("Shape", "s", &["x"], &["s"]))
        .node(node("Gather", "h", &["s", "i2"], &["h"]).int("axis", 0))
        .node(node("Gather", "w", &["s", "i3"], &["w"]).int("axis", 0))
        .node(node("Mod", "hm", &["h", "win"], &["hm"]))
        .node(node("Sub", "hs", &["win", "hm"], &["hs"]))
        .node(node("Mod", "ph", &["hs", "win"], &["ph"]))
        .node(node("Mod", "wm", &["w", "win"], &["wm"]))
        .node(node("Sub", "ws", &["win", "wm"], &["ws"]))
        .node(node("Mod", "pw", &["ws", "win"], &["pw"]))
        .node(node("Unsqueeze", "phu", &["ph", "axes0"], &["phu"]))
        .node(node("Unsqueeze", "pwu", &["pw", "axes0"], &["pwu"]))
        .node(node("Concat", "last", &["zero_pad", "pwu", "zero_pad", "phu"], &["last"]).int("axis", 0))
        .node(node("ConstantOfShape", "zeros", &["four"], &["zeros"]).tensor("value", zero))
        .node(node("Concat", "full", &["last", "zeros"], &["full"]).int("axis", 0))
        .node(node("Reshape", "pairs", &["full", "pairs_shape"], &["pairs"]))
        .node(node("Slice", "rev", &["pairs", "start", "end", "axes0", "step"], &["rev"]))
        .node(node("Transpose", "tr", &["rev"], &["tr"]).ints("perm", &[1, 0]))
        .node(node("Reshape", "pads", &["tr", "flat"], &["pads"]))
        .node(node("Pad", "pad", &["x", "pads"], &["y"]))
        .output("y");
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "f32[N,3,8,8]");
}

/// TorchScript's `x.view(x.size(0), 4, 3, 2)`: the target is rebuilt from `Shape(x)` at
/// run time. At import it is known up to the batch, so the `Reshape` reads a constant with
/// -1 for the batch, and the chain is left without a reader (the stage program runs no
/// shape arithmetic, and the attention fusion sees the reshaped value read only once).
#[test]
fn a_reshape_target_computed_from_the_batch_becomes_a_constant() {
    let m = ModelBuilder::new(17)
        .input_f32("x", &[2, 4, 6])
        .init(tensor_i64("i0", &[], &[0]))
        .init(tensor_i64("axes0", &[1], &[0]))
        .init(tensor_i64("rest", &[3], &[4, 3, 2]))
        .node(node("Shape", "s", &["x"], &["s"]))
        .node(node("Gather", "b", &["s", "i0"], &["b"]).int("axis", 0))
        .node(node("Unsqueeze", "bu", &["b", "axes0"], &["bu"]))
        .node(node("Concat", "target", &["bu", "rest"], &["target"]).int("axis", 0))
        .node(node("Reshape", "r", &["x", "target"], &["y"]))
        .output("y");
    let g = import(&m);
    let text = pipewright_ir::text::print_graph(&g);
    assert_eq!(ty(&g, "y"), "f32[N,4,3,2]");
    assert!(text.contains("i64[4] = const \"r/target\" [-1, 4, 3, 2]"), "{text}");
    assert!(!text.contains("Shape(") && !text.contains("Concat"), "{text}");
    // A target that is a constant already is read as it is.
    let fixed = ModelBuilder::new(17)
        .input_f32("x", &[2, 4, 6])
        .init(tensor_i64("target", &[4], &[0, 4, 3, 2]))
        .node(node("Reshape", "r", &["x", "target"], &["y"]))
        .output("y");
    let text = pipewright_ir::text::print_graph(&import(&fixed));
    assert!(text.contains("const \"target\" [0, 4, 3, 2]") && !text.contains("r/target"), "{text}");
}

/// `Tensor.repeat` by a head count as the TorchScript exporter writes it (YOSO's
/// attention): the repeats are a OneHot of a constant position, its "on" value read from
/// the input's shape, reshaped to a vector. The importer computes the OneHot, so Tile's
/// repeats and output shape are known.
#[test]
fn tile_repeats_made_by_a_one_hot_of_a_shape_are_known() {
    let m = ModelBuilder::new(17)
        .input("x", common::F32, &[Ax::Param("batch"), Ax::Fixed(3), Ax::Fixed(1), Ax::Fixed(4)])
        .init(tensor_i64("i1", &[], &[1]))
        .init(tensor_i64("one", &[1], &[1]))
        .init(tensor_i64("position", &[1], &[2]))
        .init(tensor_i64("depth", &[], &[4]))
        .init(tensor_i64("flat", &[1], &[-1]))
        .node(node("Shape", "s", &["x"], &["s"]))
        .node(node("Gather", "heads", &["s", "i1"], &["heads"]).int("axis", 0))
        .node(node("Reshape", "heads1", &["heads", "one"], &["heads1"]))
        .node(node("Concat", "values", &["one", "heads1"], &["values"]).int("axis", 0))
        .node(node("OneHot", "onehot", &["position", "depth", "values"], &["onehot"]))
        .node(node("Reshape", "repeats", &["onehot", "flat"], &["repeats"]))
        .node(node("Tile", "tile", &["x", "repeats"], &["y"]))
        .output("y");
    let g = import(&m);
    assert_eq!(ty(&g, "y"), "f32[N,3,3,4]");
}

/// Constant split sizes along the batch axis (XMOD's language adapters, exported by
/// TorchScript with a dynamic batch): the model runs at one batch size only, and the
/// refusal says so and what to do.
#[test]
fn constant_split_sizes_along_the_batch_say_the_export_fixed_them() {
    let m = ModelBuilder::new(17)
        .input("x", common::F32, &[Ax::Param("batch"), Ax::Fixed(4)])
        .init(tensor_i64("sizes", &[1], &[2]))
        .node(node("Split", "split", &["x", "sizes"], &["y"]).int("axis", 0))
        .output("y");
    let e = import_bytes(&m.bytes(), Path::new("."), &ImportOptions::default()).unwrap_err().to_string();
    assert!(
        e.contains("node \"split\" (Split): shape inference failed: split sizes [2] are constants, but the axis they split follows the batch (N): the exporter fixed them for one batch size (or, tracing, for one input's data: a mixture-of-experts router's counts per expert), and ONNX requires them to add up to the axis, so the model runs at no other; export the model at a fixed batch size, or, where the sizes come from the data, with PyTorch's default exporter (torch.onnx.export(..., dynamo=True)), which computes them"),
        "{e}"
    );
}
