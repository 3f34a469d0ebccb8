//! Planning time: the corpus models (goal < 1 s) and a generated 100,000-node layered DAG
//! with skip edges (goal < 10 s), on the default 8-worker cluster, global batch 64; and the
//! partition pass (stage boundaries) on that graph with long skips added, at d = 4 and 64
//! (it took 352 s before consumers were found along edges).

use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use pipewright_ops::op::{BinaryOp, UnaryOp};
use pipewright_ir::{DType, Dim, Graph, ModelMeta, Op, Shape, TensorType, Value, ValueDef};
use pipewright_ir::StageMap;
use pipewright_passes::boundaries::insert_stage_boundaries;
use pipewright_passes::cluster::Cluster;
use pipewright_passes::cost::CostModel;
use pipewright_passes::planner::{plan, PlanOptions};

/// `n` nodes of Relu chains on f32[N,64]; every fourth node adds a skip from 3 nodes back.
pub fn layered_dag(n: usize) -> Graph {
    let mut g = Graph::new(ModelMeta::default());
    let ty = TensorType::new(DType::F32, Shape(vec![Dim::N, Dim::Fixed(64)]));
    let x = g.add_value(Value {
        name: "x".into(),
        ty: ty.clone(),
        def: ValueDef::Input,
    });
    let mut outs = vec![x];
    for i in 0..n {
        let prev = *outs.last().unwrap_or(&x);
        let (op, inputs) = if i % 4 == 3 && outs.len() > 3 {
            (
                Op::Binary(BinaryOp::Add),
                vec![Some(prev), Some(outs[outs.len() - 4])],
            )
        } else {
            (Op::Unary(UnaryOp::Relu), vec![Some(prev)])
        };
        let node = g.add_node(
            format!("n{i}"),
            op,
            inputs,
            vec![Some((format!("v{i}"), ty.clone()))],
        );
        outs.push(g.node(node).outputs[0].expect("output"));
    }
    g.set_outputs(vec![*outs.last().unwrap_or(&x)]);
    g
}

/// [`layered_dag`] plus, every 200 nodes, a skip from 4,000 nodes back: values that cross
/// many stage boundaries and are forwarded through every stage in between.
fn with_long_skips(n: usize) -> Graph {
    let mut g = layered_dag(n);
    let order = g.topo_order().expect("a DAG");
    for (k, &node) in order.iter().enumerate().skip(4000).step_by(200) {
        let far = g.node(order[k - 4000]).outputs[0];
        let ty = g.value(far.expect("output")).ty.clone();
        let input = g.node(node).outputs[0];
        let add = g.add_node(format!("long{k}"), Op::Binary(BinaryOp::Add), vec![input, far], vec![Some((format!("long{k}"), ty))]);
        let out = g.node(add).outputs[0];
        for (reader, slot) in g.consumers(input.expect("output")) {
            if reader != add {
                g.set_input(reader, slot, out);
            }
        }
    }
    g
}

fn bench_partition(c: &mut Criterion) {
    let g = with_long_skips(100_000);
    let order = g.topo_order().expect("a DAG");
    let mut group = c.benchmark_group("partition-100k-long-skips");
    group.sample_size(10);
    for d in [4usize, 64] {
        let mut stages = StageMap::new(d as u32);
        for (k, &n) in order.iter().enumerate() {
            stages.set(n, (k * d / order.len()) as u32);
        }
        group.bench_function(format!("insert_stage_boundaries d={d}"), |b| {
            b.iter(|| {
                let mut graph = g.clone();
                insert_stage_boundaries(&mut graph, &stages).expect("partition")
            })
        });
    }
    group.finish();
}

fn bench(c: &mut Criterion) {
    let cluster = Cluster::default();
    let opts = PlanOptions::default();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus/models");
    for name in ["gpt2-tiny", "resnet18"] {
        let path = dir.join(format!("{name}.onnx"));
        assert!(path.is_file(), "the shared corpus is missing: expected {}", path.display());
        let g = pipewright_ir::import_model(&path, &Default::default()).expect("import");
        c.bench_function(&format!("plan/{name} (cost model + plan)"), |b| {
            b.iter(|| {
                let cost = CostModel::new(&g, cluster.roofline()).expect("cost");
                plan(&g, &cost, &cluster, &opts).expect("plan")
            })
        });
    }
    let g = layered_dag(100_000);
    let mut group = c.benchmark_group("plan-100k");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));
    group.bench_function("layered 100k nodes (cost model + plan)", |b| {
        b.iter(|| {
            let cost = CostModel::new(&g, cluster.roofline()).expect("cost");
            plan(&g, &cost, &cluster, &opts).expect("plan")
        })
    });
    group.finish();
}

criterion_group!(benches, bench, bench_partition);
criterion_main!(benches);
