//! Multi-process pipelines: stage executables (and `pipewright worker`) run one stage each,
//! linked over TCP, and train exactly like the embedded executor: the same losses at every
//! step and the same weights, bit for bit.
#![cfg(feature = "torch")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn pw() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn common(data: &Path) -> Vec<String> {
    let v = [
        "--data", data.to_str().unwrap(), "--label", "label", "--output", "linear_3", "--steps", "12", "--microbatch", "8",
        "--microbatches", "3", "--optimizer", "adam", "--lr", "0.003", "--clip-norm", "1.0", "--no-progress",
        // Bit-identical results need the same intra-op thread count on both sides
        // (parallel reductions inside kernels sum in a thread-dependent order).
        "--threads", "1",
    ];
    v.iter().map(|s| s.to_string()).collect()
}

fn losses(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap_or_else(|e| panic!("{}: {e}", metrics.display()))
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

/// Waits for every child (killing all after a minute), returning each one's status and stderr.
fn wait_all(children: Vec<Child>) -> Vec<(bool, String)> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut children = children;
    loop {
        if children.iter_mut().all(|c| matches!(c.try_wait(), Ok(Some(_)))) {
            break;
        }
        if Instant::now() > deadline {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            panic!("workers did not finish within two minutes (a hang)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
        })
        .collect()
}

fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<u8>)> = st.tensors().into_iter().map(|(n, t)| (n, t.data().to_vec())).collect();
    v.sort();
    v
}

#[test]
fn stage_executables_train_like_the_embedded_executor() {
    let data = root().join("examples/digits/digits.npz");
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    let out = pw()
        .args(["compile", root().join("../shared/corpus/models/mlp.onnx").to_str().unwrap(), "--stages", "2", "--schedule", "2bw", "--executables", "-o"])
        .arg(&build)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let embedded_metrics = dir.path().join("embedded.jsonl");
    let out = pw().arg("train").arg(&build).args(common(&data)).arg("--metrics").arg(&embedded_metrics).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let rendezvous = format!("127.0.0.1:{}", free_port());
    let worker_metrics = dir.path().join("workers.jsonl");
    let children: Vec<Child> = (0..2)
        .map(|k| {
            let mut c = Command::new(build.join(format!("stage{k}")));
            c.args(common(&data)).args(["--rendezvous", &rendezvous, "--save"]).arg(dir.path().join(format!("w{k}.safetensors")));
            if k == 1 {
                c.arg("--metrics").arg(&worker_metrics);
            }
            c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    for (ok, err) in wait_all(children) {
        assert!(ok, "stage process failed: {err}");
    }
    assert_eq!(losses(&worker_metrics), losses(&embedded_metrics), "two processes and two threads must train identically");
    let embedded = tensors(&build.join("weights.safetensors"));
    let mut workers = tensors(&dir.path().join("w0.safetensors"));
    workers.extend(tensors(&dir.path().join("w1.safetensors")));
    workers.sort();
    assert_eq!(workers.len(), embedded.len());
    assert!(workers == embedded, "weights differ between the process pipeline and the embedded executor");
}

#[test]
fn workers_with_replicas_match_and_a_foreign_stage_is_refused() {
    let data = root().join("examples/digits/digits.npz");
    let dir = tempfile::tempdir().unwrap();
    let build = dir.path().join("build");
    let model = root().join("../shared/corpus/models/mlp.onnx");
    let out = pw().args(["compile", model.to_str().unwrap(), "--stages", "2", "--schedule", "flush", "-o"]).arg(&build).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let embedded_metrics = dir.path().join("embedded.jsonl");
    let out = pw().arg("train").arg(&build).args(common(&data)).args(["--replicas", "2", "--metrics"]).arg(&embedded_metrics).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Four processes: ranks 0..3 = (replica 0: stages 0, 1), (replica 1: stages 0, 1).
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let children: Vec<Child> = (0..4)
        .map(|rank| {
            let mut c = pw();
            c.arg("worker").arg(&build).args(common(&data)).args(["--replicas", "2", "--rank", &rank.to_string(), "--rendezvous", &rendezvous]);
            if rank < 2 {
                c.arg("--save").arg(dir.path().join(format!("w{rank}.safetensors")));
            }
            c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    for (ok, err) in wait_all(children) {
        assert!(ok, "worker failed: {err}");
    }
    // Replica 0's stages hold the weights both replicas share.
    let embedded = tensors(&build.join("weights.safetensors"));
    let mut workers = tensors(&dir.path().join("w0.safetensors"));
    workers.extend(tensors(&dir.path().join("w1.safetensors")));
    workers.sort();
    assert!(workers == embedded, "two replicas over TCP and in one process must reach the same weights");
    assert_eq!(losses(&embedded_metrics).len(), 12);

    // A stage module from another compile: the workers stop with one clear error, no hang.
    let other = dir.path().join("other");
    let out = pw().args(["compile", model.to_str().unwrap(), "--stages", "2", "--schedule", "flush", "--recompute", "full", "-o"]).arg(&other).output().unwrap();
    assert!(out.status.success());
    std::fs::copy(other.join("stage1.pwm"), build.join("stage1.pwm")).unwrap();
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let children: Vec<Child> = (0..2)
        .map(|rank| {
            pw().arg("worker").arg(&build).args(common(&data)).args(["--rank", &rank.to_string(), "--rendezvous", &rendezvous, "--wait", "10"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let results = wait_all(children);
    assert!(!results[1].0 && results[1].1.contains("another compile"), "{:?}", results[1]);
    assert!(!results[0].0, "rank 0 must not wait forever for a peer that refused to start: {:?}", results[0]);
    for (_, err) in &results {
        assert!(!err.contains("panicked"), "{err}");
    }
}
