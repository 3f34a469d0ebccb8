//! `pipewright inspect` on bad input: every case must fail with one clear `error:` line
//! that names the file and the problem, never a panic. Plus the positive external-data
//! case and `--dot` output.

mod common;

use std::path::Path;

use common::{assert_clean_error, corpus, inspect, model, node, ok, pw_ok, tensor_external, tensor_f32, tensor_f32_zeros, ModelBuilder, NodeExt};

/// A valid two-node model: `y = Relu(x + b)` with `x: f32[2,4]`.
fn tiny_model() -> ModelBuilder {
    ModelBuilder::new(13)
        .input_f32("x", &[2, 4])
        .init(tensor_f32("b", &[4], &[1.0, 2.0, 3.0, 4.0]))
        .node(node("Add", "add", &["x", "b"], &["s"]))
        .node(node("Relu", "relu", &["s"], &["y"]))
        .output("y")
}

/// `y = Gemm(x, W, B)` with `x: f32[2,4]`, `W: [4,3]`, `B: [3]` as given.
fn gemm_model(w: onnx_protobuf::TensorProto, b: onnx_protobuf::TensorProto) -> ModelBuilder {
    ModelBuilder::new(13).input_f32("x", &[2, 4]).init(w).init(b).node(node("Gemm", "gemm", &["x", "W", "B"], &["y"])).output("y")
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

const W_VALUES: [f32; 12] = [0.5, -1.0, 2.0, 3.25, 4.0, -5.5, 6.0, 7.0, 8.125, 9.0, -10.0, 11.0];
const B_VALUES: [f32; 3] = [0.1, 0.2, 0.3];

#[test]
fn tiny_model_imports() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_model().write(dir.path(), "tiny.onnx");
    let out = inspect(&path, &[]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("f32[N,4]"), "{text}");
}

#[test]
fn missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["cannot read the file", "No such file"]);
}

#[test]
fn text_file_is_not_onnx() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.onnx");
    std::fs::write(&path, "hello, this is a text file and not a model\n").unwrap();
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["not an ONNX model"]);
}

#[test]
fn random_bytes_are_not_onnx() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("noise.onnx");
    // A fixed pseudo-random sequence (xorshift), so the test is deterministic.
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect();
    std::fs::write(&path, bytes).unwrap();
    let out = inspect(&path, &[]);
    let line = assert_clean_error(&out, &path, &[]);
    assert!(line.contains("not an ONNX model") || line.contains("truncated or corrupt"), "{line}");
}

#[test]
fn empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.onnx");
    std::fs::write(&path, b"").unwrap();
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["empty", "not an ONNX model"]);
}

#[test]
fn truncated_model() {
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::read(model("mlp")).expect("mlp.onnx in the corpus");
    let path = dir.path().join("mlp-half.onnx");
    std::fs::write(&path, &full[..full.len() / 2]).unwrap();
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["truncated"]);
}

#[test]
fn unknown_op_types_are_all_listed_with_their_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let path = ModelBuilder::new(13)
        .input_f32("x", &[2, 4])
        .node(node("FooBar", "foo_a", &["x"], &["a"]))
        .node(node("Relu", "relu", &["a"], &["r"]))
        .node(node("Quux", "quux_1", &["r"], &["q"]))
        .node(node("FooBar", "foo_b", &["q"], &["y"]))
        .output("y")
        .write(dir.path(), "unknown.onnx");
    let out = inspect(&path, &[]);
    let line = assert_clean_error(&out, &path, &["2 unknown operator type(s)", "FooBar", "Quux", "\"foo_a\"", "\"foo_b\"", "\"quux_1\""]);
    assert!(!line.contains("Relu"), "a known op is listed as unknown: {line}");
}

#[test]
fn non_default_domain() {
    let dir = tempfile::tempdir().unwrap();
    let path = ModelBuilder::new(13)
        .opset_import("com.microsoft", 1)
        .input_f32("x", &[2, 4])
        .node(node("FusedGemm", "fused", &["x"], &["y"]).domain("com.microsoft"))
        .output("y")
        .write(dir.path(), "domain.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["domain", "\"com.microsoft\"", "\"fused\"", "FusedGemm"]);
}

#[test]
fn unsupported_opset() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = tiny_model();
    m.model.opset_import[0].version = 99;
    let path = m.write(dir.path(), "opset99.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["opset 99", "supported"]);
}

#[test]
fn missing_external_data_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = gemm_model(tensor_external("W", &[4, 3], "weights.bin", None, None), tensor_f32("B", &[3], &B_VALUES))
        .write(dir.path(), "ext.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["tensor \"W\"", "external data file", "weights.bin", "cannot be read"]);
}

/// A model in `root/model/` whose weight `W` lives at `location`; `root/x.bin` holds
/// valid data for it, so only the refusal can make the import fail.
fn escaping_model(root: &Path, location: &str) -> std::path::PathBuf {
    std::fs::write(root.join("x.bin"), f32_bytes(&W_VALUES)).unwrap();
    let model_dir = root.join("model");
    std::fs::create_dir(&model_dir).unwrap();
    gemm_model(tensor_external("W", &[4, 3], location, None, None), tensor_f32("B", &[3], &B_VALUES)).write(&model_dir, "m.onnx")
}

#[test]
fn external_data_with_parent_dir_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let path = escaping_model(root.path(), "../x.bin");
    let out = inspect(&path, &[]);
    let line = assert_clean_error(&out, &path, &["tensor \"W\"", "\"../x.bin\"", "escapes", "refused"]);
    assert!(!line.contains("cannot be read"), "{line}");
}

#[test]
fn external_data_with_absolute_path_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let abs = root.path().join("x.bin");
    let abs = abs.to_str().unwrap();
    let path = escaping_model(root.path(), abs);
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["tensor \"W\"", abs, "escapes", "refused"]);
}

#[cfg(unix)]
#[test]
fn external_data_through_a_symlink_out_of_the_folder_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let path = escaping_model(root.path(), "link.bin");
    std::os::unix::fs::symlink(root.path().join("x.bin"), root.path().join("model/link.bin")).unwrap();
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["tensor \"W\"", "\"link.bin\"", "escapes", "refused"]);
}

/// External data that is a FIFO (or any non-regular file) inside the model's folder is
/// refused without opening it: opening a FIFO for reading blocked every command forever.
#[cfg(unix)]
#[test]
fn external_data_that_is_a_fifo_is_refused_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("weights.bin");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success());
    let path = gemm_model(tensor_external("W", &[4, 3], "weights.bin", None, None), tensor_f32("B", &[3], &B_VALUES)).write(dir.path(), "fifo.onnx");
    // A hang would block this test forever; a watchdog turns it into a failure.
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.clone();
    std::thread::spawn(move || {
        let _ = tx.send(inspect(&p, &[]));
    });
    let out = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("inspect hung on a FIFO");
    assert_clean_error(&out, &path, &["tensor \"W\"", "\"weights.bin\"", "not a regular file"]);
    // A folder in its place too.
    std::fs::remove_file(&fifo).unwrap();
    std::fs::create_dir(&fifo).unwrap();
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["tensor \"W\"", "not a regular file"]);
}

/// Two initializers of one name (the ONNX checker rejects it; the second copy used to win
/// silently) are refused naming the name.
#[test]
fn duplicate_initializer_names_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = ModelBuilder::new(13)
        .input_f32("x", &[2, 4])
        .init(tensor_f32("W", &[4, 3], &W_VALUES))
        .init(tensor_f32_zeros("W", &[4, 3]))
        .init(tensor_f32("B", &[3], &B_VALUES))
        .node(node("Gemm", "gemm", &["x", "W", "B"], &["y"]))
        .output("y")
        .write(dir.path(), "dup.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["\"W\"", "twice", "initializer"]);
}

#[test]
fn cycle() {
    let dir = tempfile::tempdir().unwrap();
    let path = ModelBuilder::new(13)
        .input_f32("x", &[2, 4])
        .node(node("Add", "adder", &["x", "r"], &["a"]))
        .node(node("Relu", "looper", &["a"], &["r"]))
        .output("a")
        .write(dir.path(), "cycle.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["cycle", "adder", "looper"]);
}

#[test]
fn undefined_input() {
    let dir = tempfile::tempdir().unwrap();
    let path = ModelBuilder::new(13)
        .input_f32("x", &[2, 4])
        .node(node("Add", "adder", &["x", "ghost"], &["y"]))
        .output("y")
        .write(dir.path(), "undefined.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["\"adder\"", "\"ghost\"", "not defined"]);
}

#[test]
fn dot_into_missing_directory_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model().write(dir.path(), "tiny.onnx");
    let dot = dir.path().join("no-such-dir").join("graph.dot");
    let out = inspect(&model, &["--dot", dot.to_str().unwrap()]);
    assert_clean_error(&out, &dot, &["cannot write"]);
    assert!(!dot.exists());
    assert!(!dir.path().join("no-such-dir").exists());
    let left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, vec!["tiny.onnx".to_string()], "a partial or temporary file was left behind");
}

#[test]
fn dot_is_written_whole() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model().write(dir.path(), "tiny.onnx");
    let dot = dir.path().join("graph.dot");
    let out = inspect(&model, &["--dot", dot.to_str().unwrap()]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&dot).unwrap();
    assert!(text.starts_with("digraph"), "{text}");
    assert!(text.trim_end().ends_with('}'), "{text}");
    let mut left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, vec!["graph.dot".to_string(), "tiny.onnx".to_string()]);
}

#[test]
fn external_data_is_read_with_offset_and_length() {
    let dir = tempfile::tempdir().unwrap();
    // weights.bin: 16 junk bytes, W (48 bytes) at 16, B (12 bytes) at 64, 8 junk bytes.
    let mut file = vec![0xAB; 16];
    file.extend(f32_bytes(&W_VALUES));
    file.extend(f32_bytes(&B_VALUES));
    file.extend([0xCD; 8]);
    std::fs::write(dir.path().join("weights.bin"), &file).unwrap();
    let path = gemm_model(
        tensor_external("W", &[4, 3], "weights.bin", Some(16), Some(48)),
        tensor_external("B", &[3], "./weights.bin", Some(64), Some(12)),
    )
    .write(dir.path(), "ext.onnx");

    let out = inspect(&path, &["--json"]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("inspect --json prints JSON");
    assert_eq!(json["parameters"], 15, "{json:#}");
    assert_eq!(json["parameter_bytes"], 60, "{json:#}");
    assert_eq!(json["outputs"][0]["shape"], "[N,3]", "{json:#}");

    // The bytes are the ones at the offsets, not the junk around them.
    let g = pipewright_ir::import_model(&path, &Default::default()).expect("imports");
    let weight = |name: &str| {
        let v = g.value_ids().find(|v| g.value(*v).name == name).unwrap_or_else(|| panic!("no value {name}"));
        g.value(v).weight().expect("a weight").clone()
    };
    let (w, b) = (weight("W"), weight("B"));
    assert!(w.trainable && b.trainable);
    assert_eq!(w.data.dims, vec![4, 3]);
    assert_eq!(&w.data.bytes[..], &f32_bytes(&W_VALUES)[..]);
    assert_eq!(&b.data.bytes[..], &f32_bytes(&B_VALUES)[..]);
}

#[test]
fn external_data_past_the_end_of_its_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("weights.bin"), f32_bytes(&W_VALUES)).unwrap();
    let path = gemm_model(tensor_external("W", &[4, 3], "weights.bin", Some(8), None), tensor_f32("B", &[3], &B_VALUES))
        .write(dir.path(), "short.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["tensor \"W\"", "too few", "offset 8"]);
}

#[test]
fn malformed_attribute_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = ModelBuilder::new(13)
        .input_f32("x", &[2, 3, 8, 8])
        .init(tensor_f32_zeros("w", &[4, 3, 3, 3]))
        .node(node("Conv", "conv0", &["x", "w"], &["y"]).ints("strides", &[0, 0]))
        .output("y")
        .write(dir.path(), "stride0.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["\"conv0\"", "Conv", "strides [0, 0]", "must be positive"]);
}

#[test]
fn shape_error_names_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let path = ModelBuilder::new(13)
        .input_f32("x", &[2, 3, 6])
        .init(tensor_f32_zeros("w", &[5, 7]))
        .node(node("MatMul", "proj", &["x", "w"], &["y"]))
        .output("y")
        .write(dir.path(), "mismatch.onnx");
    let out = inspect(&path, &[]);
    assert_clean_error(&out, &path, &["\"proj\"", "MatMul", "shape inference failed", "inner dimensions differ"]);
}

/// `bench-step` counts the parameters as `inspect` does (values, not weight tensors).
#[test]
fn bench_step_counts_parameters_as_inspect_does() {
    let (model, inputs) = (model("mlp"), corpus().join("models/mlp.inputs"));
    let bench = pw_ok(["bench-step".as_ref(), model.as_os_str(), "--inputs".as_ref(), inputs.as_os_str(), "--steps".as_ref(), "1".as_ref()]);
    let summary = ok(&inspect(&model, &[]));
    let count = summary.lines().find_map(|l| l.strip_prefix("parameters:")).and_then(|r| r.split_whitespace().next()).expect("a parameter count");
    assert!(bench.contains(&format!("mlp: {count} parameters in 8 weight tensors")), "{bench}\n{summary}");
}
