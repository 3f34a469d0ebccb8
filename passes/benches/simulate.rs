//! Paper scale (issue 15): the planner's full search for the PipeDream-2BW paper's GPT
//! 3.8B (32 layers of 3072, sequence 512; generated with shapes only, no weights) on 64
//! V100-16GB in 8 servers, mixed precision, global batch 512 (goal < 1 s); and a
//! 1,024-GPU replay of 1,000 batches (goal: seconds).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use pipewright_core::{Precision, Scheme};
use pipewright_ir::{import_model, ImportOptions};
use pipewright_passes::cost::CostModel;
use pipewright_passes::machine::{AllReduce, Link};
use pipewright_passes::planner::{plan, PlanOptions};
use pipewright_passes::presets::{device, network, SimCluster};
use pipewright_passes::simulate::{simulate, SimSetup, StageCost};
use pipewright_synth::{gpt, GptShape};
use pipewright_core::Storage;

fn bench_plan(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let path = dir.path().join("gpt-3.8b.onnx");
    gpt(&GptShape::GPT_3_8B).expect("a shape").write(&path, Storage::ShapesOnly, 0).expect("written");
    let g = import_model(&path, &ImportOptions { shapes_only: true, ..ImportOptions::default() }).expect("imports without weights");
    let cluster = SimCluster::from_preset(device("V100-16GB").expect("preset"), network("25gbit").expect("preset"), 8, 8, Precision::Fp16, Some(1.0)).expect("cluster");
    let opts = PlanOptions { global_batch: 512, precision: Precision::Fp16, ..PlanOptions::default() };
    let mut group = c.benchmark_group("paper scale");
    group.sample_size(10).measurement_time(Duration::from_secs(20));
    group.bench_function("plan GPT 3.8B on 64 V100 (cost model + full search)", |bch| {
        bch.iter(|| {
            let cost = CostModel::new(&g, cluster.cluster.roofline()).expect("costs");
            plan(&g, &cost, &cluster.cluster, &opts).expect("a plan")
        })
    });
    group.finish();
}

/// 1,024 GPUs as 16 replicas of a 64-stage pipeline, 64 microbatches per batch, 1,000
/// batches: 8.2 million forward and backward operations.
fn bench_replay(c: &mut Criterion) {
    let (d, w, m) = (64usize, 16usize, 64u64);
    let stage = StageCost { forward_s: 0.01, backward_s: 0.02, weight_grad_s: 0.0, recompute_s: 0.0, optimizer_s: 0.001, send_s: 0.0, after_backward_s: 0.0, send_bytes: 12e6, grad_bytes: 240e6, tied_sync_s: 0.0, memory_one: 1e9, memory_per_extra: 1e8, memory_at_update: 0.0, gradient_bytes: 0.0, memory_per_awaiting: 0.0 };
    let mut group = c.benchmark_group("replay");
    group.sample_size(10).measurement_time(Duration::from_secs(30));
    for scheme in [Scheme::TwoBw, Scheme::GPipe] {
        let setup = SimSetup {
            scheme,
            w,
            b: 1,
            m,
            batches: 1000,
            stages: vec![stage.clone(); d],
            links: vec![Link { bandwidth: 150e9, latency_s: 5e-6 }; d - 1],
            allreduce: AllReduce::ring(Link { bandwidth: 25e9 / 8.0 / 8.0, latency_s: 20e-6 }),
            record: false,
            host: None,
            tied_groups: Vec::new(),
            spread: None,
        };
        group.bench_function(format!("1,024 GPUs (d = 64, w = 16, m = 64), 1,000 batches, {scheme}"), |bch| bch.iter(|| simulate(&setup).expect("replays")));
    }
    group.finish();
}

criterion_group!(benches, bench_plan, bench_replay);
criterion_main!(benches);
