//! `pipewright compile`: compile the shared models into stages, load the stage modules,
//! run them in pipeline order (each stage fed the tensors the earlier stages sent, by
//! wire name) and compare with the stored onnxruntime outputs; the stage ONNX files
//! re-import and chain to the same outputs; `inspect` prints modules and reports corrupt
//! ones in one line.

mod common;

use std::path::Path;
use std::process::Output;

use common::{assert_clean_error, fails, inspect, model, ok, pw};
#[cfg(feature = "torch")]
use common::root;
use pipewright_runtime::build::{Manifest, StageEntry, TensorEntry};

fn compile(model: &Path, d: usize, out: &Path, extra: &[&str]) -> Output {
    let mut args: Vec<std::ffi::OsString> =
        vec!["compile".into(), model.into(), "--stages".into(), d.to_string().into(), "-o".into(), out.into()];
    args.extend(extra.iter().map(|s| s.into()));
    pw(&args)
}

fn compile_ok(model: &Path, d: usize, out: &Path) -> Manifest {
    let o = compile(model, d, out, &[]);
    assert!(o.status.success(), "compile {} d={d}: {}", model.display(), String::from_utf8_lossy(&o.stderr));
    Manifest::read(out).unwrap()
}

fn names(tensors: &[TensorEntry]) -> Vec<String> {
    tensors.iter().map(|t| t.name.clone()).collect()
}

#[cfg(feature = "torch")]
mod run {
    use super::*;
    use std::collections::HashMap;
    use pipewright_ir::{import_model, read_tensor_file, ImportOptions, TensorData};
    use pipewright_runtime::exec::{tensor_from_bytes, tensor_to_bytes, Mode};
    use pipewright_runtime::interp::Interpreter;
    use tch::Tensor;

    fn to_torch(t: &TensorData) -> Tensor {
        tensor_from_bytes(t.dtype, &t.dims, &t.bytes).unwrap()
    }

    /// `(name, tensor)` of `PREFIXk.pb` in k order.
    fn tensors(dir: &Path, prefix: &str) -> Vec<(String, TensorData)> {
        let mut out = Vec::new();
        for k in 0.. {
            let p = dir.join(format!("{prefix}{k}.pb"));
            if !p.exists() {
                break;
            }
            out.push(read_tensor_file(&p).unwrap());
        }
        out
    }

    /// The model's graph input and output names.
    fn io_names(model: &Path) -> (Vec<String>, Vec<String>) {
        let g = import_model(model, &ImportOptions::default()).unwrap();
        let n = |vs: &[pipewright_ir::ValueId]| vs.iter().map(|&v| g.value(v).name.clone()).collect();
        (n(g.inputs()), n(g.outputs()))
    }

    /// Feeds: the model's stored inputs by graph input name.
    fn feeds(model: &Path) -> (HashMap<String, Tensor>, Vec<String>, Vec<TensorData>) {
        let dir = model.with_extension("inputs");
        let (ins, outs) = io_names(model);
        let mut env = HashMap::new();
        for (i, (name, t)) in tensors(&dir, "input_").into_iter().enumerate() {
            let key = if ins.contains(&name) { name } else { ins[i].clone() };
            env.insert(key, to_torch(&t));
        }
        let expected = tensors(&dir, "output_").into_iter().map(|(_, t)| t).collect();
        (env, outs, expected)
    }

    fn check(model: &Path, what: &str, actual: &[Tensor], expected: &[TensorData]) {
        assert_eq!(actual.len(), expected.len(), "{what}: output count");
        for (k, (a, e)) in actual.iter().zip(expected).enumerate() {
            let (_, dims, _) = tensor_to_bytes(a).unwrap();
            assert_eq!(dims, e.dims, "{} {what}: output {k} shape", model.display());
            let a: Vec<f64> = Vec::<f64>::try_from(a.to_kind(tch::Kind::Double).flatten(0, -1)).unwrap();
            let e = e.to_f64s();
            let max_e = e.iter().filter(|x| x.is_finite()).fold(0.0f64, |m, x| m.max(x.abs()));
            let err = a.iter().zip(&e).fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
            let rel = if max_e > 0.0 { err / max_e } else { err };
            assert!(rel <= 1e-4, "{} {what}: output {k} relative error {rel:.3e}", model.display());
        }
    }

    /// Runs the stage modules of `build` in order on the model's stored inputs.
    pub fn run_modules(model: &Path, build: &Path, manifest: &Manifest, what: &str) {
        let (env, outs, expected) = feeds(model);
        let env = run_stages(build, manifest, env, what);
        let actual: Vec<Tensor> = outs.iter().map(|n| env[n].shallow_clone()).collect();
        check(model, what, &actual, &expected);
    }

    /// Runs the stage modules of `build` in order, starting from the graph inputs in `env`;
    /// returns `env` with every tensor sent and every graph output added.
    pub fn run_stages(build: &Path, manifest: &Manifest, mut env: HashMap<String, Tensor>, what: &str) -> HashMap<String, Tensor> {
        let _guard = tch::no_grad_guard();
        for st in &manifest.stages {
            let module = pipewright_runtime::module::read_module(build.join(&st.module)).unwrap();
            let (received, inputs) = (names(&st.received), names(&st.graph_inputs));
            let (sent, outputs) = (names(&st.sent), names(&st.graph_outputs));
            assert_eq!(module.program.inputs.len(), received.len() + inputs.len());
            assert_eq!(module.program.outputs.len(), sent.len() + outputs.len());
            let args: Vec<Tensor> = received
                .iter()
                .chain(&inputs)
                .map(|n| env.get(n).unwrap_or_else(|| panic!("{what}: nothing sent or fed as {n:?}")).shallow_clone())
                .collect();
            let interp = Interpreter::new(module.program, tch::Device::Cpu).unwrap();
            let results = interp.run(&args, Mode::Eval).unwrap_or_else(|e| panic!("{what}: stage {}: {e}", st.index));
            for (n, t) in sent.iter().chain(&outputs).zip(results) {
                env.insert(n.clone(), t);
            }
        }
        env
    }

    /// Re-imports each `stageK.onnx` and runs them in order.
    pub fn run_onnx(model: &Path, build: &Path, manifest: &Manifest) {
        let (mut env, outs, expected) = feeds(model);
        let _guard = tch::no_grad_guard();
        for st in &manifest.stages {
            let path = build.join(st.onnx.as_deref().expect("compiled with --stage-onnx"));
            let g = import_model(&path, &ImportOptions::default()).unwrap_or_else(|e| panic!("re-import: {e}"));
            pipewright_ir::verify(&g).unwrap();
            let program = pipewright_codegen::lower_graph(&g).unwrap();
            let args: Vec<Tensor> = g
                .inputs()
                .iter()
                .map(|&v| env.get(&g.value(v).name).unwrap_or_else(|| panic!("{}: no tensor {:?}", path.display(), g.value(v).name)).shallow_clone())
                .collect();
            let interp = Interpreter::new(program, tch::Device::Cpu).unwrap();
            let results = interp.run(&args, Mode::Eval).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for (&v, t) in g.outputs().iter().zip(results) {
                env.insert(g.value(v).name.clone(), t);
            }
        }
        let actual: Vec<Tensor> = outs.iter().map(|n| env[n].shallow_clone()).collect();
        check(model, "stage ONNX chain", &actual, &expected);
    }
}

#[cfg(feature = "torch")]
fn modules_match(name: &str, depths: &[usize]) {
    modules_match_at(&model(name), name, depths);
}

#[cfg(feature = "torch")]
fn modules_match_at(model: &Path, name: &str, depths: &[usize]) {
    let model = model.to_path_buf();
    for &d in depths {
        let dir = tempfile::tempdir().unwrap();
        let manifest = compile_ok(&model, d, dir.path());
        assert_eq!(manifest.pipeline.depth as usize, d);
        assert_eq!(manifest.stages.len(), d);
        for k in 0..d {
            assert!(dir.path().join(format!("stage{k}.pwm")).is_file());
            assert!(!dir.path().join(format!("stage{k}.onnx")).exists(), "stage ONNX only with --stage-onnx");
        }
        run::run_modules(&model, dir.path(), &manifest, &format!("{name} d={d}"));
    }
}

#[cfg(feature = "torch")]
mod stages_reproduce_the_model {
    use super::modules_match;

    #[test]
    fn mlp() {
        modules_match("mlp", &[1, 2, 3, 4]);
    }
    #[test]
    fn gpt2_tiny() {
        modules_match("gpt2-tiny", &[1, 2, 3, 4]);
    }
    #[test]
    fn bert_tiny() {
        modules_match("bert-tiny", &[1, 2, 3, 4]);
    }
    #[test]
    fn resnet18() {
        modules_match("resnet18", &[1, 2, 3, 4]);
    }
    #[test]
    fn mobilenet_v2() {
        modules_match("mobilenet_v2", &[1, 2, 3, 4]);
    }
    #[test]
    fn vit_tiny() {
        modules_match("vit-tiny", &[1, 2, 3, 4]);
    }
    /// The encoder-decoder fixture (`tests/data/make_t5_tiny.py`): two inputs, the
    /// encoder's output read by every decoder layer, deduplicated initializers.
    #[test]
    fn t5_tiny() {
        let model = super::root().join("tests/data/t5-tiny.onnx");
        super::modules_match_at(&model, "t5-tiny", &[1, 2, 3, 4]);
    }
}

#[cfg(feature = "torch")]
mod stage_onnx_chains {
    use super::*;

    fn chain(name: &str, d: usize) {
        let model = model(name);
        let dir = tempfile::tempdir().unwrap();
        let o = compile(&model, d, dir.path(), &["--stage-onnx"]);
        assert!(o.status.success(), "compile {} d={d}: {}", model.display(), String::from_utf8_lossy(&o.stderr));
        let manifest = Manifest::read(dir.path()).unwrap();
        run::run_onnx(&model, dir.path(), &manifest);
    }

    #[test]
    fn mlp() {
        chain("mlp", 2);
        chain("mlp", 4);
    }
    #[test]
    fn resnet18() {
        chain("resnet18", 2);
    }
    #[test]
    fn gpt2_tiny() {
        chain("gpt2-tiny", 3);
    }
    #[test]
    fn bert_tiny() {
        chain("bert-tiny", 2);
    }
    #[test]
    fn vit_tiny() {
        chain("vit-tiny", 2);
    }
    #[test]
    fn mobilenet_v2() {
        chain("mobilenet_v2", 2);
    }
}

/// Boundary tensors match across stages: what stage k sends, stage k+1 receives.
#[test]
fn manifest_connects_stages() {
    let dir = tempfile::tempdir().unwrap();
    let m = compile_ok(&model("resnet18"), 4, dir.path());
    let stages: &[StageEntry] = &m.stages;
    assert_eq!((m.pipeline.schedule.name(), m.pipeline.recompute.name()), ("2bw", "none"));
    // `--stages` alone decides no microbatch, microbatch count or width.
    assert_eq!((m.pipeline.microbatch, m.pipeline.microbatches, m.pipeline.replicas), (None, None, None));
    assert_eq!(m.pipeline.origin, "compile --stages 4");
    for k in 0..stages.len() - 1 {
        assert_eq!(names(&stages[k].sent), names(&stages[k + 1].received), "stage {k} -> {}", k + 1);
        assert!(!stages[k].sent.is_empty());
    }
    assert!(stages[0].received.is_empty());
    assert!(stages[stages.len() - 1].sent.is_empty());
    assert_eq!(stages[stages.len() - 1].graph_outputs.len(), 1);
    // No temporary files left behind.
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!n.contains(".tmp"), "{n}");
    }
}

#[test]
fn inspect_prints_a_module() {
    let dir = tempfile::tempdir().unwrap();
    let o = compile(&model("mlp"), 2, dir.path(), &["--schedule", "flush", "--recompute", "full"]);
    ok(&o);
    let out = inspect(&dir.path().join("stage1.pwm"), &[]);
    ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let version = format!("version:      {}", pipewright_runtime::module::FORMAT_VERSION);
    for needle in ["stage module: stage 1 of 2", "schedule:     flush", "recompute:    full", &version, "checksum:", "f32[N,", "Gemm[", "# "] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }
}

#[test]
fn corrupt_modules_fail_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let o = compile(&model("mlp"), 2, dir.path(), &[]);
    ok(&o);
    let good = std::fs::read(dir.path().join("stage1.pwm")).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("flipped.pwm", { let mut b = good.clone(); let i = b.len() / 2; b[i] ^= 0x40; b }, "checksum mismatch"),
        ("short.pwm", good[..good.len() - 100].to_vec(), "truncated"),
        ("header.pwm", good[..40].to_vec(), "truncated"),
        ("prefix.bin", good[..5].to_vec(), "truncated"),
        ("magic.pwm", { let mut b = good.clone(); b[0] = b'X'; b }, "not a pipewright stage module"),
        ("empty.pwm", Vec::new(), "truncated"),
    ];
    for (name, bytes, needle) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        assert_clean_error(&inspect(&path, &[]), &path, &[needle]);
    }
}

#[test]
fn bad_arguments_fail_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let o = compile(&model("mlp"), 2, dir.path(), &["--schedule", "zigzag"]);
    let err = fails(&o, &["error: invalid value 'zigzag' for '--schedule <SCHEDULE>' [possible values: 2bw, flush, gpipe, zb-h1, zb-h2, interleaved-2, interleaved-4, zb-v]"]);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    let missing = dir.path().join("absent.onnx");
    let o = compile(&missing, 2, &dir.path().join("b"), &[]);
    assert_clean_error(&o, &missing, &["pass import failed", "cannot read the file", "No such file"]);
}

/// `--executables`: `stageK` is this binary with the module appended; run without
/// arguments it prints its module.
#[test]
fn executables_carry_their_module() {
    let dir = tempfile::tempdir().unwrap();
    let o = compile(&model("mlp"), 2, dir.path(), &["--executables"]);
    ok(&o);
    let exe = dir.path().join("stage1");
    let out = std::process::Command::new(&exe).output().unwrap();
    ok(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("stage module: stage 1 of 2"));
}

/// The `inspect` text of every stage module of `name` compiled at depth `d` with
/// `--recompute MODE` and microbatch 8.
fn inspected_stages(name: &str, d: usize, mode: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let o = compile(&model(name), d, dir.path(), &["--recompute", mode, "--microbatch", "8"]);
    assert!(o.status.success(), "compile {name} d={d}: {}", String::from_utf8_lossy(&o.stderr));
    (0..d)
        .map(|k| {
            let out = inspect(&dir.path().join(format!("stage{k}.pwm")), &[]);
            ok(&out);
            String::from_utf8(out.stdout).unwrap()
        })
        .collect()
}

/// The lowered stage programs with `--recompute selective`: instructions marked
/// `[recompute]`/`[stash]`, slot lifetimes, weight versions and update rules, segments.
#[test]
fn stage_programs_snapshot() {
    for name in ["gpt2-tiny", "resnet18"] {
        for d in [2, 4] {
            for (k, text) in inspected_stages(name, d, "selective").iter().enumerate() {
                assert!(text.contains("segments:") && text.contains("live "), "{text}");
                insta::assert_snapshot!(format!("stage_program_{}_d{d}_stage{k}", name.replace('-', "_")), text);
            }
        }
    }
}

/// `--recompute full`: every slot an instruction writes is in the recompute segment
/// (only the stage inputs are stashed); `none`: nothing is.
#[test]
fn recompute_segments_follow_the_mode() {
    let dir = tempfile::tempdir().unwrap();
    for mode in ["full", "none", "selective"] {
        let build = dir.path().join(mode);
        let o = compile(&model("gpt2-tiny"), 2, &build, &["--recompute", mode, "--microbatch", "8"]);
        ok(&o);
        for k in 0..2 {
            let m = pipewright_runtime::module::read_module(build.join(format!("stage{k}.pwm"))).unwrap();
            let p = &m.program;
            let recomputed = p.recompute_count();
            match mode {
                "full" => {
                    assert_eq!(recomputed, p.instrs.len(), "stage {k}");
                    let entry: Vec<_> = p.inputs.iter().chain(p.stored.iter().map(|t| &t.slot)).collect();
                    for ins in &p.instrs {
                        for o in ins.outputs.iter().flatten() {
                            assert!(!entry.contains(&o), "stage {k}: {o} is an input");
                        }
                    }
                    assert_eq!(p.stashed_slots(), p.inputs, "stage {k}");
                }
                "none" => {
                    assert_eq!(recomputed, 0, "stage {k}");
                    assert!(p.instrs.iter().all(|i| !i.recompute));
                }
                _ => assert!(recomputed > 0 && recomputed < p.instrs.len(), "stage {k}: {recomputed} of {}", p.instrs.len()),
            }
            // Lifetimes: each slot's last use is the last instruction reading it.
            let last = p.last_uses();
            for (info, l) in p.slots.iter().zip(last) {
                assert_eq!(info.last_use, l.filter(|&i| i != usize::MAX).map(|i| i as u32), "{}", info.name);
            }
            // 2BW: trainable weights hold two versions; constants one.
            for t in &p.stored {
                if t.trainable {
                    assert_eq!((t.versions, t.update.name()), (2, "2bw"), "{}", p.slots[t.slot.index()].name);
                } else {
                    assert_eq!(t.versions, 1);
                }
            }
        }
    }
}

/// Generated models (a tied-embedding GPT and a layered graph whose long skips cross every
/// stage boundary), which nobody tuned anything on: the stages of every depth, run in
/// sequence, give the outputs of the whole model (depth 1) on the same random inputs.
#[cfg(feature = "torch")]
#[test]
fn generated_models_split_at_any_depth_compute_the_whole_model() {
    use pipewright_synth::{gpt, layered, GptShape, LayeredShape};
use pipewright_core::Storage;
    use tch::{Kind, Tensor};
    let dir = tempfile::tempdir().unwrap();
    let gpt_model = gpt(&GptShape { layers: 3, ..GptShape::TINY }).unwrap().write(&dir.path().join("gpt.onnx"), Storage::Inline, 3).unwrap();
    let layered_shape = LayeredShape { layers: 120, width: 8, long_skip_every: 5, long_skip_span: 40 };
    let layered_model = layered(&layered_shape).unwrap().write(&dir.path().join("layered.onnx"), Storage::Inline, 4).unwrap();
    tch::manual_seed(5);
    let cases = [
        (gpt_model.model, "input_ids", Tensor::randint(GptShape::TINY.vocab as i64, [3, GptShape::TINY.seq as i64], (Kind::Int64, tch::Device::Cpu))),
        (layered_model.model, "x", Tensor::randn([3, 8], (Kind::Float, tch::Device::Cpu))),
    ];
    for (model, input, feed) in cases {
        let mut whole = None;
        for d in 1..=4 {
            let build = dir.path().join(format!("{}-d{d}", model.file_stem().unwrap().to_string_lossy()));
            let manifest = compile_ok(&model, d, &build);
            let output = manifest.outputs().next().expect("an output").name.clone();
            let env = [(input.to_string(), feed.shallow_clone())].into_iter().collect();
            let what = format!("{} d={d}", model.display());
            let out = run::run_stages(&build, &manifest, env, &what).remove(&output).expect("the output");
            match &whole {
                None => whole = Some(out),
                Some(w) => {
                    let diff = (&out - w).abs().max().double_value(&[]);
                    let scale = w.abs().max().double_value(&[]).max(1e-6);
                    assert!(diff / scale < 1e-5, "{what}: differs from d=1 by {diff} (scale {scale})");
                }
            }
        }
    }
}

/// `compile --timings` lists every pass and every kind of file written, and its total is
/// the sum of those lines (the writes included); `inspect stage.pwm --json` prints the
/// module's summary as JSON that agrees with the text form.
#[test]
fn timings_add_up_and_modules_inspect_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let out = compile(&model("mlp"), 2, dir.path(), &["--timings", "--stage-onnx"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let ms = |l: &str| -> f64 { l.split(" ms").next().and_then(|x| x.split_whitespace().last()).and_then(|x| x.parse().ok()).unwrap_or_else(|| panic!("{l}")) };
    let lines: Vec<&str> = err.lines().filter(|l| l.contains(" ms")).collect();
    let (total, parts) = lines.split_last().expect("timing lines");
    assert!(total.trim_start().starts_with("total") && total.contains("passes") && total.contains("writing"), "{err}");
    for name in ["import", "lower", "write stage modules", "write stage ONNX", "write manifest"] {
        assert!(parts.iter().any(|l| l.trim_start().starts_with(name)), "{name} missing: {err}");
    }
    let sum: f64 = parts.iter().map(|l| ms(l)).sum();
    assert!((sum - ms(total)).abs() <= 0.001 * parts.len() as f64, "lines sum to {sum}, total says {}: {err}", ms(total));

    let module = dir.path().join("stage0.pwm");
    let out = inspect(&module, &["--json"]);
    ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("inspect stage.pwm --json prints JSON");
    assert_eq!((v["stage"].as_u64(), v["depth"].as_u64()), (Some(0), Some(2)));
    assert_eq!(v["inputs"][0]["name"].as_str(), Some("input"));
    let text = String::from_utf8_lossy(&inspect(&module, &[]).stdout).to_string();
    let params = v["trainable_parameters"].as_u64().expect("trainable_parameters");
    assert!(params > 0 && text.contains(&format!("{params} trainable parameters")), "{params} vs {text}");
    assert_eq!(v["instructions"].as_array().map(|a| a.len()), text.lines().find_map(|l| l.strip_prefix("instructions (")?.strip_suffix("):")?.parse().ok()));
}

/// A fixed-batch export whose baked shapes pipewright reads so that every kernel runs at
/// another batch but values move between samples is refused at compile, naming the graph
/// output whose samples differ though every sample was the same input, and no build is
/// written. The model, exported at batch 1: a sample's 8 values viewed as 2 rows of 4,
/// transposed, and flattened into one row of 8. Import reads the rows as following the
/// batch (`[2N, 4]`) and the flat row as the batch (`[N, 8]`); at batch 2 that row takes
/// the first two columns of both samples.
#[test]
fn a_fixed_batch_reading_that_mixes_samples_is_refused() {
    use common::{node, tensor_f32, tensor_i64, ModelBuilder, NodeExt};
    let dir = tempfile::tempdir().unwrap();
    let model = ModelBuilder::new(13)
        .input_f32("x", &[1, 4, 2])
        .init(tensor_i64("rows_shape", &[2], &[2, 4]))
        .init(tensor_i64("flat_shape", &[2], &[1, 8]))
        .init(tensor_f32("w", &[8], &[0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25, 1.375]))
        .node(node("Reshape", "rows", &["x", "rows_shape"], &["a"]))
        .node(node("Transpose", "columns", &["a"], &["t"]).ints("perm", &[1, 0]))
        .node(node("Reshape", "flat", &["t", "flat_shape"], &["f"]))
        .node(node("Mul", "scale", &["f", "w"], &["y"]))
        .output("y")
        .write(dir.path(), "mixes.onnx");
    let out = dir.path().join("build");
    let o = compile(&model, 1, &out, &[]);
    fails(&o, &[
        "stage 0: graph output \"y\": sample 1 differs from sample 0",
        "though every sample was the same input",
        "at batch 2 (the model was exported at the fixed batch 1)",
        "export the model with a dynamic batch axis",
    ]);
    assert!(!out.join("pipeline.toml").exists(), "a refused compile wrote a build");
}

/// Token type ids the TorchScript exporter folded at the export batch (a `Constant` node
/// `[2, 4]` of zeros) and looked up in their embedding are one row repeated: import reads
/// the lookup at that row expanded to the batch of the model's input, so the model
/// compiles (and passes compile's check at batch 3) instead of pinning batch 2, and
/// `export` writes a model that takes any batch, the lookup written as import read it.
#[test]
fn token_type_ids_folded_at_the_export_batch_follow_the_batch() {
    use common::{node, tensor_f32, tensor_i64, Ax, ModelBuilder, NodeExt, I64};
    let dir = tempfile::tempdir().unwrap();
    let table = |name: &str, rows: i64| tensor_f32(name, &[rows, 3], &(0..rows * 3).map(|i| i as f32 * 0.25).collect::<Vec<_>>());
    let model = ModelBuilder::new(13)
        .input("ids", I64, &[Ax::Fixed(2), Ax::Fixed(4)])
        .init(table("words", 10))
        .init(table("types", 2))
        .node(node("Constant", "type_ids", &[], &["type_ids"]).tensor("value", tensor_i64("type_ids", &[2, 4], &[0; 8])))
        .node(node("Gather", "word_embeddings", &["words", "ids"], &["w"]))
        .node(node("Gather", "type_embeddings", &["types", "type_ids"], &["t"]))
        .node(node("Add", "embeddings", &["w", "t"], &["y"]))
        .output("y")
        .write(dir.path(), "types.onnx");
    let out = dir.path().join("build");
    let o = compile(&model, 1, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    ok(&pw(["train", out.to_str().unwrap(), "--steps", "1", "--microbatch", "3", "--no-progress"]));
    let exported = dir.path().join("trained.onnx");
    let o = pw(["export", out.to_str().unwrap(), "-o", exported.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && stdout.contains("batch axis dynamic") && stdout.contains("1 other node(s) rewritten"), "{stdout}{}", String::from_utf8_lossy(&o.stderr));
}
