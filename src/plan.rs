//! `pipewright plan`: the PipeDream-2BW planner over an imported model — candidate
//! configurations ranked by predicted throughput, and the chosen partition; with
//! `--print-after partition`, the IR after the stage-boundary pass.

use anyhow::{bail, Context, Result};
use pipewright_ir::text::print_graph_annotated;
use pipewright_ir::{import_model, ImportOptions};
use pipewright_passes::boundaries::insert_stage_boundaries;
use pipewright_passes::cluster::{parse_bandwidth, parse_bytes, parse_flops, Cluster};
use pipewright_passes::cost::{CostModel, Profile};
use pipewright_core::{Balance, PassName};
use pipewright_passes::planner::{plan, PlanOptions};

use crate::PlanArgs;

/// The cluster: defaults, then the TOML file, then individual flags.
pub fn cluster(args: &PlanArgs) -> Result<Cluster> {
    let mut c = match &args.cluster {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
            Cluster::from_toml(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        None => Cluster::default(),
    };
    if let Some(w) = args.workers {
        c.workers = w;
    }
    if let Some(m) = &args.memory {
        c.memory_per_worker = parse_bytes(m)?;
    }
    if let Some(b) = &args.intra_bw {
        c.intra_bw = parse_bandwidth(b)?;
    }
    if let Some(b) = &args.inter_bw {
        c.inter_bw = parse_bandwidth(b)?;
    }
    if let Some(n) = args.workers_per_node {
        c.workers_per_node = n;
    }
    if let Some(f) = &args.peak_flops {
        c.peak_flops = parse_flops(f)?;
    }
    Ok(c)
}

fn options(args: &PlanArgs) -> PlanOptions {
    PlanOptions {
        global_batch: args.batch,
        schedules: args.schedule.clone(),
        stages: args.stages,
        cuts: (!args.cut.is_empty()).then(|| args.cut.clone()),
        balance: args.balance,
        optimizer: args.optimizer,
        momentum: args.momentum,
        top: args.top,
        microbatch: args.microbatch,
        recompute: args.recompute,
    }
}

pub fn run(args: &PlanArgs) -> Result<()> {
    let mut graph = import_model(&args.model, &ImportOptions::default())?;
    let cluster = cluster(args)?;
    let mut cost = CostModel::new(&graph, cluster.roofline()).map_err(|e| anyhow::anyhow!("{}: {e}", args.model.display()))?;
    if let Some(path) = &args.profile {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let profile = Profile::from_json(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        cost.apply_profile(&graph, &profile).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    } else if args.balance == Balance::Profile {
        bail!("--balance profile needs --profile FILE (from `pipewright profile`)");
    }
    let opts = options(args);
    let plan = plan(&graph, &cost, &cluster, &opts).map_err(|e| anyhow::anyhow!("{}: {e}", args.model.display()))?;
    match args.print_after {
        None => {}
        Some(PassName::Partition) => {
            let stages = insert_stage_boundaries(&mut graph, &plan.stage_map())
                .map_err(|e| anyhow::anyhow!("{}: partition: {e}", args.model.display()))?;
            print!("{}", print_graph_annotated(&graph, |n| stages.get(n).map(|s| format!("stage={s}"))));
            return Ok(());
        }
        Some(other) => bail!("--print-after takes a pass `plan` runs: partition (not {other})"),
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", plan.text());
    }
    Ok(())
}
