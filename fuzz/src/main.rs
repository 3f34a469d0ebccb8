//! `pipewright-fuzz`: runs fuzz campaigns and replays saved inputs (see docs/fuzzing.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use pipewright_fuzz::{campaign, Options, Target};

const USAGE: &str = "usage:
  pipewright-fuzz run TARGET|all [--runs N] [--seed N] [--max-len BYTES] [--max-seed-len BYTES] [--timeout-ms MS]
                  [--alloc-cap-mb MB] [--rss-limit-mb MB] [--seeds DIR]... [--crashes DIR] [--progress N]
  pipewright-fuzz repro TARGET FILE...
targets: onnx module npy npz safetensors checkpoint checkpoint-stage";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match real_main(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pipewright-fuzz: {e}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn targets_of(name: &str) -> Result<Vec<Target>, String> {
    if name == "all" {
        return Ok(Target::ALL.to_vec());
    }
    Target::from_name(name).map(|t| vec![t]).ok_or_else(|| format!("unknown target `{name}`"))
}

fn number(option: &str, value: Option<&String>) -> Result<u64, String> {
    let v = value.ok_or_else(|| format!("{option} needs a value"))?;
    v.parse::<u64>().map_err(|_| format!("{option}: `{v}` is not a non-negative integer"))
}

fn real_main(args: &[String]) -> Result<ExitCode, String> {
    match args.first().map(String::as_str) {
        Some("run") => {
            let targets = targets_of(args.get(1).ok_or("run needs a target")?)?;
            let mut opts = Options::new(targets[0]);
            let mut it = args[2..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--runs" => opts.runs = number(a, it.next())?,
                    "--seed" => opts.seed = number(a, it.next())?,
                    "--max-len" => opts.max_len = number(a, it.next())? as usize,
                    "--max-seed-len" => opts.max_seed_len = number(a, it.next())? as usize,
                    "--timeout-ms" => opts.timeout = Duration::from_millis(number(a, it.next())?),
                    "--alloc-cap-mb" => opts.alloc_cap = number(a, it.next())? << 20,
                    "--rss-limit-mb" => opts.rss_limit_mib = number(a, it.next())?,
                    "--progress" => opts.progress_every = number(a, it.next())?,
                    "--seeds" => opts.extra_seeds.push(PathBuf::from(it.next().ok_or("--seeds needs a folder")?)),
                    "--crashes" => opts.crash_dir = PathBuf::from(it.next().ok_or("--crashes needs a folder")?),
                    other => return Err(format!("unknown option `{other}`")),
                }
            }
            let mut crashes = 0;
            for t in targets {
                opts.target = t;
                let report = campaign::run(&opts)?;
                println!("{report}");
                for c in &report.crashes {
                    println!("  crash: {} ({})", c.message.lines().next().unwrap_or(""), c.saved.display());
                }
                crashes += report.crashes.len();
            }
            Ok(if crashes == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Some("repro") => {
            let target = *targets_of(args.get(1).ok_or("repro needs a target")?)?.first().ok_or("repro needs one target")?;
            let defaults = Options::new(target);
            let mut panicked = false;
            for file in &args[2..] {
                let input = std::fs::read(file).map_err(|e| format!("{file}: cannot read: {e}"))?;
                let outcome = campaign::replay(target, &defaults.seed_root, &defaults.crash_dir, &input, defaults.timeout, defaults.alloc_cap)?;
                panicked |= outcome.starts_with("PANIC");
                println!("{file}: {outcome}");
            }
            Ok(if panicked { ExitCode::from(1) } else { ExitCode::SUCCESS })
        }
        _ => Err("expected `run` or `repro`".into()),
    }
}
