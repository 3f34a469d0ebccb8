//! One function per subcommand that needs no libtorch: the arguments become the driver's
//! request, the driver does the work, and what it returns is printed.

use anyhow::Result;
use pipewright_driver::launch::{mpirun_line, run_mpirun, shell_line, LaunchRequest};
use pipewright_driver::plan::{compile_command as compile_build, plan_command, Printed};
use pipewright_driver::simulate::{simulate as simulate_model, write_traces};

use pipewright_driver::inspect::InspectRequest;
use pipewright_driver::plan::{CompileSpec, PlanSpec};
use pipewright_driver::simulate::SimulateSpec;

use crate::args::{ExportArgs, LaunchArgs, MetricsSvgArgs, SynthArgs, TraceSvgArgs};

/// Prints a command's output: the notes on standard error, the rest on standard output.
fn show(printed: &Printed) {
    for note in &printed.notes {
        eprintln!("note: {note}");
    }
    print!("{}", printed.stdout);
}

pub fn inspect(args: &InspectRequest) -> Result<()> {
    print!("{}", pipewright_driver::inspect::inspect(args)?);
    Ok(())
}

pub fn plan(args: &PlanSpec) -> Result<()> {
    show(&plan_command(args)?);
    Ok(())
}

pub fn simulate(args: &SimulateSpec) -> Result<()> {
    let report = simulate_model(&args.request()?)?;
    for line in write_traces(&report, args.trace.as_deref(), args.svg.as_deref())? {
        eprintln!("{line}");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

pub fn compile_command(args: &CompileSpec) -> Result<()> {
    let (compiled, printed) = compile_build(args)?;
    show(&printed);
    if args.timings {
        eprint!("{}", compiled.timings_text());
    }
    Ok(())
}

pub fn launch(args: &LaunchArgs) -> Result<()> {
    let program = std::env::current_exe().map_err(|e| anyhow::anyhow!("cannot find this pipewright binary: {e}"))?;
    let req = LaunchRequest { build: args.build.clone(), np: args.np, hostfile: args.hostfile.clone(), executables: args.executables, program, worker_args: args.worker_args.clone() };
    let line = mpirun_line(&req)?;
    if args.dry_run {
        println!("{}", shell_line(&line));
        return Ok(());
    }
    eprintln!("{}", shell_line(&line));
    let signals = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = signals.clone();
    ctrlc::set_handler(move || {
        if seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            eprintln!("\nstopping every rank after the current step (a second Ctrl-C stops the job at once, without saving)");
        } else {
            eprintln!("\nstopping the job now");
        }
    })
    .map_err(|e| anyhow::anyhow!("cannot handle Ctrl-C: {e}"))?;
    let argv: Vec<String> = std::env::args().collect();
    let exit = run_mpirun(&line, &argv, &signals)?;
    match (exit.code, exit.forwarded) {
        (0, 0) => Ok(()),
        // Stopped at a step boundary: rank 0 printed where and how to resume.
        (0, _) => std::process::exit(130),
        (code, 0) => match &args.hostfile {
            // A host that cannot be reached fails before any rank starts; Open MPI (or ssh)
            // names it above, in words of its own.
            Some(hostfile) => anyhow::bail!(
                "the MPI job failed (mpirun exit status {code}; each rank's messages, or mpirun's, are above); if no rank started, check that every host of {} ({}) is reachable from this one (ssh, or the launch agent) and has this pipewright and the build folder at the same paths",
                hostfile.display(),
                pipewright_driver::launch::hostfile_hosts(hostfile)?.join(", ")
            ),
            None => anyhow::bail!("the MPI job failed (mpirun exit status {code}; each rank's messages are above)"),
        },
        (code, _) => anyhow::bail!("the MPI job was stopped at once by a second signal (mpirun exit status {code}); resume from its last complete checkpoint"),
    }
}

pub fn export(args: &ExportArgs) -> Result<()> {
    let exported = pipewright_driver::export::export_onnx(&args.build, &args.output)?;
    let data = exported.data.as_ref().map(|d| format!(" and {}", d.display())).unwrap_or_default();
    println!(
        "wrote {}{data} ({} trained initializers from {}; {})",
        args.output.display(),
        exported.replaced,
        args.build.join(pipewright_driver::export::WEIGHTS_FILE).display(),
        exported.batch_text()
    );
    Ok(())
}

pub fn trace_svg(args: &TraceSvgArgs) -> Result<()> {
    let drawn = pipewright_driver::trace::draw_trace(&args.trace, &args.output, args.width, args.steps)?;
    for line in &drawn.bubbles {
        println!("{line}");
    }
    eprintln!("{}", drawn.summary);
    Ok(())
}

pub fn metrics_svg(args: &MetricsSvgArgs) -> Result<()> {
    eprintln!("{}", pipewright_driver::trace::draw_metrics(&args.metrics, &args.output)?);
    Ok(())
}

pub fn synth(args: &SynthArgs) -> Result<()> {
    println!("{}", pipewright_driver::synth::synth(&args.request())?);
    Ok(())
}
