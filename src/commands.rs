//! One function per subcommand: build the request from the arguments, call the library,
//! print what it returns.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use pipewright_core::fs::write_atomic;
use pipewright_core::{Balance, Scheme};
use pipewright_driver::compile::{compile, plan, CompileRequest};
use pipewright_ir::summary::Summary;
use pipewright_ir::{import_model, ImportOptions};
use pipewright_passes::cluster::{parse_bandwidth, parse_bytes, parse_flops, Cluster, DEFAULT_CLUSTER_NOTE};
use pipewright_passes::manager::{PassOptions, PrintAfter};
use pipewright_passes::pipeline::PlanRequest;
use pipewright_passes::plan_file::PlanFile;
use pipewright_passes::planner::PlanOptions;
use pipewright_passes::presets::{self, SimCluster};
use pipewright_passes::profile::Profile;
use pipewright_driver::simulate::{per_scheme_path, simulate as simulate_model, write_trace, SimulateRequest};
use pipewright_runtime::listing::{module_json, module_text};
use pipewright_runtime::module::{looks_like_module, read_module};
use pipewright_runtime::timeline::{bubbles, events_in, read_chrome_trace, timeline_svg_with, window_of, SvgOptions};

use pipewright_core::units::human_bytes;
use pipewright_synth::{GptShape, LayeredShape, Storage};

use crate::args::{ClusterArgs, CompileArgs, ExportArgs, InspectArgs, LaunchArgs, PlanArgs, SimulateArgs, SynthArgs, SynthKind, TraceSvgArgs};

pub fn inspect(args: &InspectArgs) -> Result<()> {
    if looks_like_module(&args.model) {
        let m = read_module(&args.model)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&module_json(&m))?);
        } else {
            print!("{}", module_text(&m));
        }
        return Ok(());
    }
    let graph = import_model(&args.model, &ImportOptions { batch: args.batch, ..ImportOptions::default() })?;
    if let Some(path) = &args.dot {
        write_atomic(path, pipewright_ir::dot::print_dot(&graph).as_bytes())?;
    }
    if args.ir {
        print!("{}", pipewright_ir::text::print_graph(&graph));
    } else if args.json {
        println!("{}", serde_json::to_string_pretty(&Summary::of(&graph))?);
    } else {
        print!("{}", Summary::of(&graph).text());
    }
    Ok(())
}

/// The cluster: defaults, then the TOML file, then individual flags.
fn cluster(args: &ClusterArgs) -> Result<Cluster> {
    let mut c = match &args.cluster {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
            Cluster::from_toml(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?
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

fn read_profile(path: &Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    Profile::from_json(&text).map_err(|e| anyhow!("{}: {e}", path.display()))
}

pub fn plan_command(args: &PlanArgs) -> Result<()> {
    let profile = args.profile.as_deref().map(read_profile).transpose()?;
    if args.balance == Balance::Profile && profile.is_none() {
        bail!("--balance profile needs --profile FILE (from `pipewright profile`)");
    }
    let options = PlanOptions {
        global_batch: args.batch,
        schedules: args.schedule.clone(),
        stages: args.stages,
        cuts: (!args.cut.is_empty()).then(|| args.cut.clone()),
        balance: args.balance,
        optimizer: args.training.optimizer,
        momentum: args.training.momentum,
        precision: args.training.precision,
        top: args.top,
        microbatch: args.microbatch,
        recompute: args.recompute,
    };
    let request = PlanRequest::Search { cluster: cluster(&args.cluster)?, options, profile };
    let passes = PassOptions { print_after: args.print_after.map_or(PrintAfter::None, PrintAfter::Pass), ..PassOptions::default() };
    let planned = plan(&args.model, &request, &passes)?;
    if args.print_after.is_some() {
        print!("{}", planned.printed);
        return Ok(());
    }
    let file = planned.file.ok_or_else(|| anyhow!("{}: nothing was planned", args.model.display()))?;
    let default_cluster = args.cluster.is_default();
    if args.json {
        // stdout stays the plan file; the JSON's `cluster` holds the numbers.
        if default_cluster {
            eprintln!("note: {DEFAULT_CLUSTER_NOTE}");
        }
        println!("{}", file.to_json());
    } else {
        if default_cluster {
            println!("note: {DEFAULT_CLUSTER_NOTE}");
        }
        print!("{}", file.plan.text());
    }
    Ok(())
}

/// `--cluster FILE|PRESET` for `simulate`: a file when one exists at that path.
fn sim_cluster(args: &SimulateArgs) -> Result<Option<SimCluster>> {
    let preset_flags = [("--network", args.network.is_some()), ("--servers", args.servers.is_some()), ("--gpus-per-server", args.gpus_per_server.is_some()), ("--efficiency", args.efficiency.is_some())];
    let given: Vec<&str> = preset_flags.iter().filter(|f| f.1).map(|f| f.0).collect();
    let Some(spec) = &args.cluster else {
        if !given.is_empty() {
            bail!("{} need(s) a device preset in --cluster", given.join(", "));
        }
        return Ok(None);
    };
    let path = Path::new(spec);
    if path.is_file() {
        if !given.is_empty() {
            bail!("{} appl(ies) to a device preset, not to the cluster file {spec} (set its keys instead)", given.join(", "));
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("{spec}: cannot read"))?;
        return Ok(Some(SimCluster::from_toml(spec, &text).map_err(|e| anyhow!("{spec}: {e}"))?));
    }
    let device = presets::device(spec).map_err(|e| anyhow!("--cluster: {e}"))?;
    let network = presets::network(args.network.as_deref().unwrap_or(device.network)).map_err(|e| anyhow!("--network: {e}"))?;
    let (servers, per_server, efficiency) = (args.servers.unwrap_or(1), args.gpus_per_server.unwrap_or(8), args.efficiency.unwrap_or(1.0));
    Ok(Some(SimCluster::from_preset(device, network, servers, per_server, args.training.precision, efficiency).map_err(|e| anyhow!("--cluster {spec}: {e}"))?))
}

pub fn simulate(args: &SimulateArgs) -> Result<()> {
    let profile = args.profile.as_deref().map(read_profile).transpose()?;
    let is_plan = args.input.extension().is_some_and(|e| e == "json");
    let schemes = match &args.schedule {
        Some(s) => s.0.clone(),
        None if is_plan => vec![PlanFile::read(&args.input)?.plan.chosen.schedule.into()],
        None => Scheme::ALL.to_vec(),
    };
    let request = SimulateRequest {
        input: args.input.clone(),
        cluster: sim_cluster(args)?,
        global_batch: args.batch,
        schemes,
        profile,
        optimizer: args.training.optimizer,
        momentum: args.training.momentum,
        precision: args.training.precision,
        batches: args.batches,
        record: args.trace.is_some() || args.svg.is_some(),
        stage_times: args.stage_times.clone(),
        host_cores: args.host_cores,
    };
    let report = simulate_model(&request)?;
    let several = report.outcomes.iter().filter(|o| o.simulation.is_some()).count() > 1;
    for o in &report.outcomes {
        let Some(sim) = &o.simulation else { continue };
        let trace = args.trace.as_deref().map(|p| per_scheme_path(p, o.scheme, several));
        let svg = args.svg.as_deref().map(|p| per_scheme_path(p, o.scheme, several));
        write_trace(sim, trace.as_deref(), svg.as_deref(), 1200)?;
        for p in trace.iter().chain(&svg) {
            eprintln!("wrote {} ({} events)", p.display(), sim.events.len());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

fn compile_request(args: &CompileArgs) -> Result<CompileRequest> {
    for (flag, v) in [("--stages", args.stages.map(|d| d as u64)), ("--microbatch", args.microbatch), ("--microbatches", args.microbatches), ("--batch", args.batch)] {
        if v == Some(0) {
            bail!("{flag} must be at least 1");
        }
    }
    let plan = if let Some(path) = &args.plan {
        PlanRequest::File { path: path.clone(), file: Box::new(PlanFile::read(path)?) }
    } else if let Some(depth) = args.stages {
        PlanRequest::Stages { depth, schedule: args.schedule, recompute: args.recompute, microbatch: args.microbatch, microbatches: args.microbatches }
    } else {
        let options = PlanOptions {
            global_batch: args.batch.unwrap_or(512),
            schedules: vec![args.schedule],
            recompute: Some(args.recompute),
            microbatch: args.microbatch,
            top: 1,
            ..PlanOptions::default()
        };
        PlanRequest::Search { cluster: Cluster::default(), options, profile: None }
    };
    let executable = if args.executables { Some(std::env::current_exe().context("cannot locate the pipewright binary")?) } else { None };
    Ok(CompileRequest { model: args.model.clone(), plan, output: args.output.clone(), executable, stage_onnx: args.stage_onnx,
        passes: args.pass_options(),
        import: ImportOptions { untie_merged: args.untie_merged, train_batch_baked: args.train_batch_baked.clone(), ..ImportOptions::default() },
    })
}

pub fn compile_command(args: &CompileArgs) -> Result<()> {
    let compiled = compile(&compile_request(args)?)?;
    for line in compiled.choices.as_ref().map(|c| c.lines()).unwrap_or_default() {
        eprintln!("note: {line}");
    }
    print!("{}", compiled.printed);
    if args.timings {
        eprint!("{}", compiled.timings_text());
    }
    let Some((manifest, _)) = compiled.written else { return Ok(()) };
    let decision = compiled.decision.map(|d| d.text()).unwrap_or_default();
    println!("compiled {} into {} stage(s) in {}: {decision}", args.model.display(), manifest.stages.len(), args.output.display());
    Ok(())
}

pub fn launch(args: &LaunchArgs) -> Result<()> {
    use pipewright_driver::launch::{mpirun_line, run_mpirun, shell_line, LaunchRequest};
    let program = std::env::current_exe().map_err(|e| anyhow::anyhow!("cannot find this pipewright binary: {e}"))?;
    let req = LaunchRequest {
        build: args.build.clone(),
        np: args.np,
        hostfile: args.hostfile.clone(),
        executables: args.executables,
        program,
        worker_args: args.worker_args.clone(),
    };
    let line = mpirun_line(&req)?;
    if args.dry_run {
        println!("{}", shell_line(&line));
        return Ok(());
    }
    eprintln!("{}", shell_line(&line));
    match run_mpirun(&line)? {
        0 => Ok(()),
        code => anyhow::bail!("the MPI job failed (mpirun exit status {code}; each rank's messages are above)"),
    }
}

pub fn export(args: &ExportArgs) -> Result<()> {
    let exported = pipewright_driver::export::export_onnx(&args.build, &args.output)?;
    println!(
        "wrote {} ({} trained initializers from {}; {})",
        args.output.display(),
        exported.replaced,
        args.build.join(pipewright_driver::export::WEIGHTS_FILE).display(),
        exported.batch_text()
    );
    Ok(())
}

pub fn trace_svg(args: &TraceSvgArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.trace).with_context(|| format!("{}: cannot read", args.trace.display()))?;
    let events = read_chrome_trace(&text).map_err(|e| anyhow!("{}: {e}", args.trace.display()))?;
    if events.is_empty() {
        bail!("{}: no complete (\"X\") events", args.trace.display());
    }
    let options = SvgOptions { width: args.width.max(100), steps: args.steps };
    let (window, what) = window_of(&events, &options);
    let shown = events_in(&events, window);
    if shown.is_empty() {
        bail!("--steps {window}: the trace has no events in those steps ({what})");
    }
    write_atomic(&args.output, timeline_svg_with(&events, &options).as_bytes())?;
    // The bubble fractions are the whole trace's, as before; the drawing's are its window's.
    for (k, b) in bubbles(&events) {
        println!("stage {k}: bubble fraction {:.4} (busy {:.3} ms of {:.3} ms)", b.fraction, b.busy_us / 1000.0, b.span_us / 1000.0);
    }
    eprintln!("wrote {} ({} of {} events: {what})", args.output.display(), shown.len(), events.len());
    Ok(())
}

pub fn synth(args: &SynthArgs) -> Result<()> {
    let (model, what, weights) = match &args.kind {
        SynthKind::Gpt(a) => {
            let preset = GptShape::preset(&a.preset).ok_or_else(|| anyhow!("unknown preset {:?}: expected gpt2-small, gpt2-medium, gpt-1.3b, gpt-2.2b, gpt-3.8b or tiny", a.preset))?;
            let shape = GptShape {
                layers: a.layers.unwrap_or(preset.layers),
                hidden: a.hidden.unwrap_or(preset.hidden),
                heads: a.heads.unwrap_or(preset.heads),
                seq: a.seq.unwrap_or(preset.seq),
                vocab: a.vocab.unwrap_or(preset.vocab),
                tied: preset.tied && !a.untied,
            };
            let what = format!("GPT, {} layers x {}, {} heads, {} tokens, vocabulary {}", shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab);
            (pipewright_synth::gpt(&shape)?, what, &a.weights)
        }
        SynthKind::Layered(a) => {
            let shape = LayeredShape { width: a.width, long_skip_every: a.long_skip_every, long_skip_span: a.long_skip_span, ..LayeredShape::with_nodes(a.nodes) };
            let what = format!("layered, {} layers x {}, a skip across {} layers every {}", shape.layers, shape.width, shape.long_skip_span, shape.long_skip_every);
            (pipewright_synth::layered(&shape)?, what, &a.weights)
        }
    };
    let storage = weights.weights.unwrap_or(if model.parameters() * 4 < 1 << 30 { Storage::Inline } else { Storage::External });
    let written = model.write(&weights.output, storage, weights.seed)?;
    let data = match (&written.data, storage) {
        (Some(d), _) => format!(" and {}", d.display()),
        (None, Storage::ShapesOnly) => " (shapes only: its external data file is declared, not written; for plan and simulate)".to_string(),
        (None, _) => String::new(),
    };
    println!(
        "wrote {}{data}: {what}; {} nodes, {} parameters ({})",
        written.model.display(),
        written.nodes,
        written.parameters,
        human_bytes(written.parameters * 4)
    );
    Ok(())
}
