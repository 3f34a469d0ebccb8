//! Property tests of the stage partitioner on random layered DAGs with skip edges, built
//! through the IR's public API: every node lands in exactly one stage, stages are
//! contiguous in the chosen order, and the DP's bottleneck equals the brute-force optimum,
//! with and without a memory limit that rules some splits out.

use pipewright_ir::{DType, Dim, Graph, ModelMeta, Op, Shape, TensorType, Value, ValueDef};
use pipewright_passes::cost::{CostModel, Roofline};
use pipewright_passes::partition::{
    choose_order, live_bytes, valid_cuts, MemoryModel, PartitionProblem, PipelineMemory,
};
use proptest::prelude::*;

/// `inputs[i]` lists earlier nodes node `i` reads (empty: the graph input); `widths[i]` is
/// its output's row width.
fn build(inputs: &[Vec<usize>], widths: &[i64]) -> Graph {
    let mut g = Graph::new(ModelMeta::default());
    let ty = |w: i64| TensorType::new(DType::F32, Shape(vec![Dim::N, Dim::Fixed(w)]));
    let x = g.add_value(Value {
        name: "x".into(),
        ty: ty(8),
        def: ValueDef::Input,
    });
    let mut outs = Vec::new();
    for (i, ins) in inputs.iter().enumerate() {
        let mut args: Vec<_> = ins.iter().map(|&j| Some(outs[j])).collect();
        if args.is_empty() {
            args.push(Some(x));
        }
        let op = if args.len() == 1 {
            Op::Unary(pipewright_ops::op::UnaryOp::Relu)
        } else {
            Op::Variadic(pipewright_ops::op::VariadicOp::Sum)
        };
        let n = g.add_node(
            format!("n{i}"),
            op,
            args,
            vec![Some((format!("v{i}"), ty(widths[i])))],
        );
        outs.push(g.node(n).outputs[0].unwrap());
    }
    // Graph outputs: every value nobody reads.
    let uses = g.use_counts();
    let sinks = outs
        .iter()
        .copied()
        .filter(|v| uses[v.index()] == 0)
        .collect();
    g.set_outputs(sinks);
    g
}

fn dag() -> impl Strategy<Value = (Vec<Vec<usize>>, Vec<i64>)> {
    (1usize..=14).prop_flat_map(|n| {
        let per_node: Vec<_> = (0..n)
            .map(|i| {
                if i == 0 {
                    Just(Vec::new()).boxed()
                } else {
                    // The previous layer plus, sometimes, a skip edge from further back.
                    (
                        0..i,
                        proptest::option::of(0..i),
                        proptest::bool::weighted(0.8),
                    )
                        .prop_map(move |(a, skip, chain)| {
                            let mut v = vec![if chain { i - 1 } else { a }];
                            if let Some(s) = skip {
                                if !v.contains(&s) {
                                    v.push(s);
                                }
                            }
                            v
                        })
                        .boxed()
                }
            })
            .collect();
        (per_node, proptest::collection::vec(1i64..64, n))
    })
}

fn numbers(n: usize) -> impl Strategy<Value = (Vec<f64>, Vec<f64>, Vec<f64>)> {
    let v = |hi: u32| proptest::collection::vec((0..hi).prop_map(f64::from), n);
    (v(50), v(20), v(20))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn dp_matches_brute_force(
        (inputs, widths) in dag(),
        (time, params, act) in numbers(14),
        d in 1usize..=8,
        bw in prop_oneof![Just(1.0f64), Just(16.0), Just(1e9)],
        factors in (1u32..4, 1u32..4, 0u32..4),
        limit_frac in 0.0f64..1.2,
    ) {
        let g = build(&inputs, &widths);
        let n = inputs.len();
        let cost = CostModel::new(&g, Roofline::default()).unwrap();
        let order = choose_order(&g, &cost, 1).unwrap();
        prop_assert_eq!(order.nodes.len(), n);
        // Random times, parameters and activations (integers, so sums are exact).
        let (time, params, act) = (time[..n].to_vec(), params[..n].to_vec(), act[..n].to_vec());
        let live: Vec<f64> = live_bytes(&g, &order.nodes, &cost).iter().map(|l| l.at(1)).collect();
        prop_assert_eq!(live.len(), n + 1);
        let prob = PartitionProblem { time, param_bytes: params, act_bytes: act, kept_bytes: Vec::new(), live_bytes: live, bandwidth: bw, transfer_share: 1.0, awaiting_bytes: Vec::new(), keeps_graph: Vec::new() };

        // Without a memory limit.
        let free = PipelineMemory::unlimited();
        let dp = prob.optimal_partition(d, &free);
        let bf = prob.brute_force_partition(d, &free);
        prop_assert_eq!(dp.is_some(), bf.is_some());
        if let (Some(dp), Some(bf)) = (&dp, &bf) {
            prop_assert!((dp.bottleneck - bf.bottleneck).abs() <= 1e-9 * bf.bottleneck.max(1e-12), "dp {} bf {}", dp.bottleneck, bf.bottleneck);
            prop_assert!(valid_cuts(&dp.cuts, n));
            prop_assert_eq!(dp.cuts.len() + 1, d);
            // Every node exactly once, stages contiguous and ordered along every edge.
            let stages = dp.stage_of_nodes(&order.nodes);
            prop_assert_eq!(stages.len(), n);
            let mut seen = std::collections::HashSet::new();
            let mut stage_of = std::collections::HashMap::new();
            let mut last = 0;
            for (node, s) in &stages {
                prop_assert!(seen.insert(*node));
                prop_assert!(*s >= last && *s < d);
                last = *s;
                stage_of.insert(*node, *s);
            }
            for node in g.node_ids() {
                for v in g.node(node).inputs.iter().flatten() {
                    if let ValueDef::Node { node: p, .. } = g.value(*v).def {
                        prop_assert!(stage_of[&p] <= stage_of[&node]);
                    }
                }
            }
        } else {
            prop_assert!(d > n);
        }

        // With a memory limit between the smallest one-node stage and the whole model.
        // A flushing schedule's update holds one more copy of the weights than its compute.
        let mem = MemoryModel { weight_factor: factors.0 as f64, act_factor: factors.1 as f64, kept_factor: 0.0, input_factor: factors.2 as f64, update_factor: factors.0 as f64 + 1.0, awaiting_factor: 0.0, limit: 0.0 };
        if n >= d {
            let lo = (0..n).map(|i| prob.stage_memory(i, i + 1, &mem)).fold(f64::INFINITY, f64::min);
            let hi = prob.stage_memory(0, n, &mem);
            let limit = (lo + (hi - lo) * limit_frac).floor();
            let uniform = PipelineMemory::uniform(MemoryModel { limit, ..mem });
            // 1F1B's: stage k holds d - k microbatches' activations and inputs.
            let held = |k: usize| (d - k) as f64;
            let per_stage = PipelineMemory::per_stage((0..d).map(|k| MemoryModel { limit, act_factor: mem.act_factor * held(k), input_factor: mem.input_factor * held(k), ..mem }).collect());
            for mem in [uniform, per_stage] {
                let dp = prob.optimal_partition(d, &mem);
                let bf = prob.brute_force_partition(d, &mem);
                prop_assert_eq!(dp.is_some(), bf.is_some(), "limit {}", limit);
                if let (Some(dp), Some(bf)) = (dp, bf) {
                    prop_assert!((dp.bottleneck - bf.bottleneck).abs() <= 1e-9 * bf.bottleneck.max(1e-12), "dp {} bf {}", dp.bottleneck, bf.bottleneck);
                    let (_, m) = prob.evaluate(&dp.cuts, &mem);
                    prop_assert!(m.iter().all(|&x| x <= limit));
                    prop_assert!(valid_cuts(&dp.cuts, n));
                }
            }
        }
    }
}
