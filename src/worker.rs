//! `pipewright worker`, and stage executables started with arguments: one stage of one
//! replica as its own process, linked to the other workers over TCP, running the same
//! schedule as the embedded executor. Start every rank (`replica * stages + stage`) of a
//! job with the same options; under an MPI launcher in MPMD form
//! (`mpirun -np 1 build/stage0 OPTS : -np 1 build/stage1 OPTS`) each process takes its
//! rank from the launcher's environment.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};
use pipewright_runtime::module::{decode_module_bytes, read_module, StageModule};
use pipewright_runtime::pipeline::{boundary_names, chrome_trace_json, run_worker, StepReport, Tcp, TcpOptions};

use crate::train::{config, human, load_batches, read_manifest, Progress};
use crate::TrainArgs;

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    /// This worker's rank, `replica * stages + stage`. Default: the MPI launcher's
    /// (OMPI_COMM_WORLD_RANK, PMI_RANK or PMIX_RANK), else a stage executable's own stage.
    #[arg(long)]
    pub rank: Option<usize>,
    /// `host:port` where rank 0 listens and every worker registers.
    #[arg(long, default_value = "127.0.0.1:29500")]
    pub rendezvous: String,
    /// Seconds to wait for the other workers.
    #[arg(long, default_value_t = 120)]
    pub wait: u64,
    /// Save this stage's trained weights (safetensors) here.
    #[arg(long)]
    pub save: Option<PathBuf>,
}

/// The stage executable's command line: the worker options, the build folder being the
/// executable's own folder.
#[derive(clap::Parser)]
#[command(about = "A pipewright stage executable: run without arguments to print its stage module; with options, run its stage as a pipeline worker")]
pub struct StageExeCli {
    #[command(flatten)]
    pub args: WorkerArgs,
}

fn env_usize(names: &[&str]) -> Option<usize> {
    names.iter().find_map(|n| std::env::var(n).ok()).and_then(|v| v.trim().parse().ok())
}

/// Runs one worker. `embedded` is a stage executable's own module.
pub fn run(args: &WorkerArgs, embedded: Option<Vec<u8>>) -> Result<()> {
    let t = &args.train;
    let (manifest, order) = read_manifest(&t.build)?;
    let manifest_path = t.build.join("pipeline.toml");
    let (d, w) = (order.len(), t.replicas.max(1));
    let embedded = match embedded {
        Some(bytes) => Some(decode_module_bytes(bytes.into()).map_err(|e| anyhow!("the stage module appended to this executable: {e}"))?),
        None => None,
    };
    let launcher_rank = env_usize(&["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]);
    let rank = args.rank.or(launcher_rank).or(embedded.as_ref().map(|m| m.header.params.stage as usize)).ok_or_else(|| anyhow!("no --rank, and no MPI launcher environment to take it from"))?;
    if let Some(size) = env_usize(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]) {
        if size != d * w {
            bail!("the launcher started {size} processes but the job has {} ({d} stages x {w} replicas)", d * w);
        }
    }
    let (stage, replica) = (rank % d, rank / d);
    let module: StageModule = match embedded {
        Some(m) => m,
        None => read_module(t.build.join(&order[stage])).map_err(|e| anyhow!("{e}"))?,
    };
    if module.header.params.stage as usize != stage || module.header.params.depth as usize != d {
        bail!("rank {rank} runs stage {stage} of {d}, but this stage module is stage {} of {}", module.header.params.stage, module.header.params.depth);
    }
    let id = manifest.get("pipeline_id").and_then(|v| v.as_str()).unwrap_or_default();
    if module.program.pipeline != id {
        bail!("stage {stage}: this stage module comes from another compile (pipeline id {:?}) than {} ({id:?})", module.program.pipeline, manifest_path.display());
    }
    let schedule = module.header.params.schedule;
    let m = t.microbatches.unwrap_or(d);
    let batches = load_batches(t, &manifest, &manifest_path, m * w, 0)?;
    let cfg = config(t, schedule)?;
    if cfg.checkpoint_every.is_some() || t.resume.is_some() {
        bail!("--checkpoint-every and --resume work with `pipewright train` (the embedded executor) only");
    }
    let (recv_names, send_names) = boundary_names(&module, &cfg.loss).map_err(|e| anyhow!("{e}"))?;
    let opts = TcpOptions {
        rank,
        depth: d,
        replicas: w,
        rendezvous: args.rendezvous.clone(),
        pipeline: module.program.pipeline.clone(),
        recv_names,
        send_names,
        timeout: std::time::Duration::from_secs(args.wait),
    };
    eprintln!("rank {rank}: stage {stage} of {d}, replica {replica} of {w}; joining {}", args.rendezvous);
    let tcp = Tcp::connect(opts).map_err(|e| anyhow!("rank {rank}: {e}"))?;
    let last = stage + 1 == d;
    let mut progress = Progress::new(t, 0)?;
    let mut on_step = |r: StepReport| progress.step(&r);
    let report = run_worker(module, &cfg, replica, Box::new(tcp), Box::new(batches.into_iter()), &mut on_step).map_err(|e| anyhow!("rank {rank}: {e}"))?;
    progress.finish();
    if let Some(path) = &t.trace {
        crate::output::write_atomic(path, chrome_trace_json(&report.trace).as_bytes())?;
    }
    if let Some(path) = &args.save {
        crate::export::save_weights(path, &report)?;
    }
    if last {
        let (first, end) = (report.losses.first().copied().unwrap_or(f64::NAN), report.losses.last().copied().unwrap_or(f64::NAN));
        println!("rank {rank} (stage {stage}, replica {replica}): trained {} steps in {:.1}s: loss {first:.4} -> {end:.4}", report.losses.len(), progress.started.elapsed().as_secs_f64());
    }
    println!("rank {rank} (stage {stage}): peak live tensor bytes {}, weight versions held (peak) {}", human(report.memory[0].total), report.peak_versions[0]);
    Ok(())
}
