//! Prints (as markdown) the bottleneck stage time of each partitioner relative to the lower
//! bound `total compute / d`, per corpus model and `d` in {2, 4, 8}, at the model's export
//! batch with analytic costs on the default cluster (pipeline links 150 GB/s, no memory
//! limit). Run with `cargo test -p pipewright-passes --test planner_table -- --nocapture`.
//!
//! Asserts that the DP is never worse than a baseline and strictly better than the
//! parameter-balanced split on the CNNs.

use std::path::PathBuf;

use pipewright_passes::cluster::Cluster;
use pipewright_passes::cost::CostModel;
use pipewright_passes::partition::{balanced_by, uniform_by_nodes, PipelineMemory};
use pipewright_core::Balance;
use pipewright_passes::planner::PlanContext;

#[test]
fn planner_table() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/corpus/models");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("the shared corpus is missing: {}: {e}", dir.display()));
    let mut models: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "onnx"))
        .collect();
    models.sort();
    let cluster = Cluster::default();
    let mut out = String::from(
        "| model | nodes | b | d | order | DP (this planner) | uniform by nodes | param-balanced | flop-balanced | DP / max(total/d, largest node) | DP, free comm |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for path in models {
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let g = pipewright_ir::import_model(&path, &Default::default()).expect("import");
        let cost = CostModel::new(&g, cluster.roofline()).expect("cost");
        let b = cost.export_batch.max(1) as u64;
        let mut ctx = PlanContext::new(&g, &cost, &cluster, pipewright_core::Precision::Fp32).expect("context");
        let n = ctx.len();
        let order = ctx.order().kind;
        let params = ctx.balance_weights(Balance::Params, b);
        let flops = ctx.balance_weights(Balance::Flops, b);
        for d in [2usize, 4, 8] {
            if d > n {
                continue;
            }
            let prob = ctx.problem(b, pipewright_core::Recompute::None, cluster.pipeline_bw(pipewright_core::Layout::new(d, 1))).clone();
            let total: f64 = prob.time.iter().sum();
            let lb = total / d as f64;
            let free = PipelineMemory::unlimited();
            let dp = prob.optimal_partition(d, &free).expect("dp").bottleneck;
            let eval = |cuts: Vec<usize>| prob.bottleneck_of(&cuts, &free).expect("valid cuts");
            let uni = eval(uniform_by_nodes(n, d));
            let par = eval(balanced_by(&params, d));
            let flo = eval(balanced_by(&flops, d));
            let lb2 = lb.max(prob.time.iter().copied().fold(0.0, f64::max));
            let mut no_comm = prob.clone();
            no_comm.bandwidth = f64::INFINITY;
            let dp_free = no_comm.optimal_partition(d, &free).expect("dp").bottleneck;
            for (what, x) in [("uniform", uni), ("params", par), ("flops", flo)] {
                assert!(
                    dp <= x * (1.0 + 1e-9),
                    "{name} d={d}: DP {dp} worse than {what} {x}"
                );
            }
            if name.contains("resnet") || name.contains("mobilenet") {
                assert!(
                    dp < par,
                    "{name} d={d}: DP {dp} not better than param-balanced {par}"
                );
            }
            out += &format!(
                "| {name} | {n} | {b} | {d} | {order:?} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
                dp / lb,
                uni / lb,
                par / lb,
                flo / lb,
                dp / lb2,
                dp_free / lb
            );
        }
    }
    out += "\nEntries: bottleneck stage time (compute + boundary communication) / (total compute / d); 1.000 is the lower bound. The last two columns separate the causes of the gap: node granularity (a stage cannot be smaller than its largest node) and boundary communication (the DP re-run with free links).\n";
    println!("{out}");
}
