//! `pipewright launch`: the `mpirun` line that starts a build's pipeline as an MPI job,
//! one rank per stage and replica, numbered by the build's placement ([`Layout`]:
//! stage-major by default, the replicas of a stage on consecutive ranks, so on one server
//! when they fit; replica-major, each pipeline on consecutive ranks), either every rank
//! running `pipewright worker BUILD` (SPMD) or each running its stage executable (MPMD,
//! `compile --executables`). The launch flags this tool relies on live here alone
//! ([`local_flags`], [`cluster_flags`]); the tests take them from `launch --dry-run`.

use std::path::{Path, PathBuf};

use pipewright_core::{Layout, RunFlags, Schedule, Source};
use pipewright_runtime::build::Manifest;

use crate::DriverError;

/// What `pipewright launch` is asked to start.
#[derive(Clone, Debug)]
pub struct LaunchRequest {
    pub build: PathBuf,
    /// Ranks (default: stages x replicas).
    pub np: Option<usize>,
    /// Hosts and slots for `mpirun --hostfile` (several machines).
    pub hostfile: Option<PathBuf>,
    /// Run the stage executables (MPMD) instead of `pipewright worker` (SPMD).
    pub executables: bool,
    /// The `pipewright` binary the ranks run (SPMD).
    pub program: PathBuf,
    /// The worker options, passed to every rank as given.
    pub worker_args: Vec<String>,
}

/// Flags for a job on this machine alone: `--oversubscribe` lets ranks outnumber cores
/// (a 4-rank job on 2 cores), `--bind-to none` leaves each rank's intra-op threads free to
/// use every core, and root (containers, CI) needs `--allow-run-as-root`.
pub fn local_flags() -> Vec<String> {
    let mut f: Vec<String> = ["--oversubscribe", "--bind-to", "none"].iter().map(|s| s.to_string()).collect();
    if is_root() {
        f.insert(0, "--allow-run-as-root".into());
    }
    f
}

/// Flags for a job over the hosts of `hostfile`.
pub fn cluster_flags(hostfile: &Path) -> Vec<String> {
    let mut f = vec!["--hostfile".to_string(), hostfile.display().to_string(), "--bind-to".into(), "none".into()];
    if is_root() {
        f.insert(0, "--allow-run-as-root".into());
    }
    f
}

fn is_root() -> bool {
    // The effective user id, as /proc reports it (no libc needed in this crate).
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(2)).map(|u| u == "0"))
        .unwrap_or(false)
}

/// `--replicas N` (or `--replicas=N`) among the worker options.
fn replicas_flag(args: &[String]) -> Result<Option<u64>, DriverError> {
    let mut found = None;
    for (i, a) in args.iter().enumerate() {
        let value = if a == "--replicas" {
            Some(args.get(i + 1).cloned().unwrap_or_default())
        } else {
            a.strip_prefix("--replicas=").map(str::to_string)
        };
        if let Some(v) = value {
            found = Some(v.parse::<u64>().map_err(|_| DriverError::msg(format!("--replicas {v:?} (after --): not a whole number")))?);
        }
    }
    Ok(found)
}

/// The `mpirun` command line (program first).
pub fn mpirun_line(req: &LaunchRequest) -> Result<Vec<String>, DriverError> {
    let manifest = Manifest::read(&req.build)?;
    let d = manifest.stages.len();
    let shape = manifest.pipeline.resolve(RunFlags { replicas: replicas_flag(&req.worker_args)?, ..RunFlags::default() });
    let w = usize::try_from(shape.replicas.value).unwrap_or(usize::MAX);
    let ranks = d.checked_mul(w).ok_or_else(|| DriverError::msg("stages x replicas overflows"))?;
    if let Some(np) = req.np {
        if np != ranks {
            return Err(DriverError::msg(format!(
                "--np {np}, but the job has {d} stage(s) x {w} replica(s) = {ranks} ranks ({}); {}",
                match shape.replicas.source {
                    Source::Build => "replicas from the build",
                    Source::Flag { .. } => "replicas from --replicas",
                    Source::Default => "1 replica by default",
                },
                if np % d == 0 { format!("give --replicas {} after --", np / d) } else { format!("--np must be a multiple of the {d} stages") }
            )));
        }
    }
    let mut line = vec!["mpirun".to_string()];
    line.extend(match &req.hostfile {
        Some(h) => cluster_flags(h),
        None => local_flags(),
    });
    let layout = Layout::new(d, w).placed(manifest.pipeline.placement);
    let schedule = manifest.pipeline.schedule;
    // Several stages per worker over several hosts: each rank is placed on its worker's
    // host, one app context per run of ranks sharing a host (mpirun numbers the ranks in
    // the contexts' order).
    let hosts = match &req.hostfile {
        Some(h) if schedule.virtual_stages() > 1 => Some(worker_hosts(h, layout, schedule)?),
        _ => None,
    };
    if req.executables {
        for (k, s) in manifest.stages.iter().enumerate() {
            let exe = req.build.join(format!("stage{k}"));
            if !exe.is_file() {
                return Err(DriverError::msg(format!(
                    "{}: no stage executable for stage {k} ({}); compile with --executables",
                    exe.display(),
                    s.module
                )));
            }
        }
        // MPMD: mpirun numbers the ranks of `-np a prog0 : -np b prog1 ...` in order, so
        // the programs follow the ranks' placement: stage-major, each stage once on `w`
        // consecutive ranks (its replicas); replica-major, each replica's stages in order,
        // one rank each.
        let program = |rank: usize| vec![req.build.join(format!("stage{}", layout.place(rank).1)).display().to_string()];
        line.extend(app_contexts(ranks, hosts.as_deref(), program, &req.worker_args));
    } else {
        let program = |_: usize| vec![req.program.display().to_string(), "worker".into(), req.build.display().to_string()];
        line.extend(app_contexts(ranks, hosts.as_deref(), program, &req.worker_args));
    }
    Ok(line)
}

/// `-np n [--host H] PROGRAM ARGS` for each run of consecutive ranks that share their
/// program and host, joined by `:`.
fn app_contexts(ranks: usize, hosts: Option<&[String]>, program: impl Fn(usize) -> Vec<String>, args: &[String]) -> Vec<String> {
    let mut runs: Vec<(Vec<String>, Option<&String>, usize)> = Vec::new();
    for rank in 0..ranks {
        let (prog, host) = (program(rank), hosts.map(|h| &h[rank]));
        match runs.last_mut() {
            Some((p, h, n)) if *p == prog && *h == host => *n += 1,
            _ => runs.push((prog, host, 1)),
        }
    }
    let mut line = Vec::new();
    for (i, (prog, host, n)) in runs.into_iter().enumerate() {
        if i > 0 {
            line.push(":".into());
        }
        line.extend(["-np".to_string(), n.to_string()]);
        if let Some(h) = host {
            line.extend(["--host".to_string(), h.clone()]);
        }
        line.extend(prog);
        line.extend(args.iter().cloned());
    }
    line
}

/// The host of each rank when every worker's stages (`schedule` runs several per worker)
/// must share one: each replica's workers, in the order of their first rank, fill the
/// hostfile's hosts in turn, a worker on the first host with slots left for all its stages.
/// Each is written `host:slots` with the hostfile's slots, as `mpirun --host` takes it:
/// Open MPI counts the slots a host gives the whole job from one app context's `--host`
/// alone, so a count of the context's ranks would leave none for the next context there.
fn worker_hosts(hostfile: &Path, layout: Layout, schedule: Schedule) -> Result<Vec<String>, DriverError> {
    let hosts = hostfile_slots(hostfile)?;
    let depth = layout.depth;
    let workers = schedule.workers(depth).map_err(DriverError::msg)?;
    let mut groups: Vec<Vec<usize>> = (0..layout.replicas)
        .flat_map(|r| (0..workers).map(move |k| schedule.stages_of(k, depth).into_iter().map(|s| layout.rank(r, s)).collect()))
        .collect();
    groups.sort_by_key(|g: &Vec<usize>| g.iter().min().copied());
    let mut left: Vec<usize> = hosts.iter().map(|(_, slots)| *slots).collect();
    let mut placed = vec![String::new(); layout.size()];
    let mut at = 0;
    for group in groups {
        while at < hosts.len() && left[at] < group.len() {
            at += 1;
        }
        let Some((host, slots)) = hosts.get(at) else {
            let slots: usize = hosts.iter().map(|(_, s)| s).sum();
            return Err(DriverError::msg(format!(
                "{}: {slots} slot(s) on {} host(s) cannot keep each worker's {} stages ({schedule}: {} worker(s) x {} replica(s)) on one host; give the hosts more slots or add hosts",
                hostfile.display(),
                hosts.len(),
                schedule.virtual_stages(),
                workers,
                layout.replicas
            )));
        };
        left[at] -= group.len();
        for rank in group {
            placed[rank] = format!("{host}:{slots}");
        }
    }
    Ok(placed)
}

/// Each host a hostfile names with its slots when the line states them (`node1 slots=8`):
/// the first word and the `slots=` word of each line that is not blank or a `#` comment.
fn hostfile_entries(hostfile: &Path) -> Result<Vec<(String, Option<usize>)>, DriverError> {
    let text = std::fs::read_to_string(hostfile).map_err(|e| DriverError::msg(format!("{}: cannot read the hostfile: {e}", hostfile.display())))?;
    let lines = text.lines().map(|l| l.split('#').next().unwrap_or("").trim());
    Ok(lines
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let host = words.next()?.to_string();
            Some((host, words.find_map(|w| w.strip_prefix("slots=")).and_then(|n| n.parse::<usize>().ok())))
        })
        .collect())
}

/// Each host of a hostfile with its slots, which keeping a worker's stages together needs
/// stated.
fn hostfile_slots(hostfile: &Path) -> Result<Vec<(String, usize)>, DriverError> {
    hostfile_entries(hostfile)?
        .into_iter()
        .map(|(host, slots)| match slots {
            Some(n) => Ok((host, n)),
            None => Err(DriverError::msg(format!(
                "{}: host {host} has no `slots=N`: give every host its slots, so that launch can place each worker's stages on one host",
                hostfile.display()
            ))),
        })
        .collect()
}

/// The hosts a hostfile names, for messages about a job that could not start on them.
pub fn hostfile_hosts(hostfile: &Path) -> Result<Vec<String>, DriverError> {
    Ok(hostfile_entries(hostfile)?.into_iter().map(|(host, _)| host).collect())
}

/// A command line as a shell would read it back (arguments quoted where needed).
pub fn shell_line(line: &[String]) -> String {
    line.iter()
        .map(|a| {
            if !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=,+@%".contains(c)) {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The variable through which `pipewright launch` tells the ranks its own command line
/// (arguments separated by U+001F), so that a job stopped early prints the exact command
/// that resumes it. mpirun passes its environment to the ranks it starts on this host.
pub const LAUNCH_ARGV_VAR: &str = "PIPEWRIGHT_LAUNCH_ARGV";

/// The `pipewright launch` command line this rank was started by, if it was.
pub fn launch_argv() -> Option<Vec<String>> {
    let v = std::env::var(LAUNCH_ARGV_VAR).ok()?;
    Some(v.split('\u{1f}').map(str::to_string).collect())
}

/// How [`run_mpirun`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MpirunExit {
    /// mpirun's exit status.
    pub code: i32,
    /// Signals forwarded to the job: 1 asked it to stop at a step boundary, more stopped
    /// it at once.
    pub forwarded: usize,
}

/// Runs the line (inheriting stdout and stderr; stdin is not forwarded to rank 0) in a
/// process group of its own, so that a Ctrl-C at the terminal reaches `launch` alone, which
/// counts it in `signals`. The first signal is forwarded as `SIGUSR1`, which mpirun passes
/// to every rank and which stops the run after the current step, saved; any later one as
/// `SIGTERM`, which mpirun turns into stopping the job at once. `argv`: this command line,
/// for the ranks' resume command.
pub fn run_mpirun(line: &[String], argv: &[String], signals: &std::sync::atomic::AtomicUsize) -> Result<MpirunExit, DriverError> {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(&line[0]);
    cmd.args(&line[1..]).stdin(std::process::Stdio::null()).process_group(0).env(LAUNCH_ARGV_VAR, argv.join("\u{1f}"));
    // SAFETY: prctl is async-signal-safe; the job ends with this process even if it is
    // killed outright (its process group no longer hears the terminal).
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| DriverError::msg(format!("cannot run {}: {e} (install Open MPI: scripts/prereqs.sh installs openmpi-bin)", line[0])))?;
    let mut forwarded = 0;
    loop {
        if let Some(status) = child.try_wait().map_err(|e| DriverError::msg(format!("waiting for {}: {e}", line[0])))? {
            return Ok(MpirunExit { code: status.code().unwrap_or(1), forwarded });
        }
        while forwarded < signals.load(std::sync::atomic::Ordering::SeqCst) {
            let sig = if forwarded == 0 { libc::SIGUSR1 } else { libc::SIGTERM };
            // SAFETY: a plain kill(2) of the child, which has not been reaped yet.
            unsafe { libc::kill(child.id() as libc::pid_t, sig) };
            forwarded += 1;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::compile;
    use crate::compile::tests::{request, stages};
    use pipewright_passes::pipeline::PlanRequest;
    use pipewright_core::{Placement, Recompute};

    fn req(build: &Path, np: Option<usize>, args: &[&str]) -> LaunchRequest {
        LaunchRequest {
            build: build.to_path_buf(),
            np,
            hostfile: None,
            executables: false,
            program: "/bin/pipewright".into(),
            worker_args: args.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn the_line_has_one_rank_per_stage_and_replica() {
        let dir = tempfile::tempdir().unwrap();
        let build = dir.path().join("build");
        compile(&request("mlp.onnx", stages(2), &build)).unwrap();
        let line = mpirun_line(&req(&build, None, &["--steps", "5"])).unwrap();
        let text = shell_line(&line);
        assert!(text.starts_with("mpirun "), "{text}");
        assert!(text.ends_with(&format!("-np 2 /bin/pipewright worker {} --steps 5", build.display())), "{text}");
        assert!(line.iter().any(|a| a == "--oversubscribe"));
        // Replicas among the worker options multiply the ranks.
        let line = mpirun_line(&req(&build, Some(4), &["--replicas=2"])).unwrap();
        assert!(shell_line(&line).contains("-np 4 "));
        let e = mpirun_line(&req(&build, Some(4), &[])).unwrap_err().to_string();
        assert!(e.contains("--np 4, but the job has 2 stage(s) x 1 replica(s) = 2 ranks") && e.contains("give --replicas 2 after --"), "{e}");
        let e = mpirun_line(&req(&build, Some(3), &[])).unwrap_err().to_string();
        assert!(e.contains("multiple of the 2 stages"), "{e}");
        // MPMD needs the stage executables.
        let e = mpirun_line(&LaunchRequest { executables: true, ..req(&build, None, &[]) }).unwrap_err().to_string();
        assert!(e.contains("compile with --executables"), "{e}");
        let h = mpirun_line(&LaunchRequest { hostfile: Some("hosts".into()), ..req(&build, None, &[]) }).unwrap();
        assert!(shell_line(&h).contains("--hostfile hosts") && !h.iter().any(|a| a == "--oversubscribe"));
        assert_eq!(shell_line(&["a b".into(), "it's".into(), "x".into()]), r"'a b' 'it'\''s' x");
    }
    /// ZB-V over two hosts: worker 0 runs stages 0 and 3, worker 1 stages 1 and 2, and
    /// each worker's ranks are given one host (one app context per run of ranks on a
    /// host), whatever the replicas; a hostfile whose slots cannot hold them so, or that
    /// does not state its slots, is refused saying what to give.
    #[test]
    fn several_stages_per_worker_keep_each_worker_on_one_host() {
        let dir = tempfile::tempdir().unwrap();
        let build = dir.path().join("build");
        let zb_v = PlanRequest::Stages { depth: 4, schedule: Schedule::ZbV, recompute: Recompute::Full, microbatch: Some(4), microbatches: None, placement: Placement::StageMajor };
        compile(&request("mlp.onnx", zb_v, &build)).unwrap();
        let hostfile = |text: &str| {
            let path = dir.path().join("hosts");
            std::fs::write(&path, text).unwrap();
            LaunchRequest { hostfile: Some(path), ..req(&build, None, &["--steps", "2"]) }
        };
        let worker = format!("/bin/pipewright worker {} --steps 2", build.display());
        let text = shell_line(&mpirun_line(&hostfile("a slots=2\nb slots=2\n")).unwrap());
        assert!(text.ends_with(&format!("-np 1 --host a:2 {worker} : -np 2 --host b:2 {worker} : -np 1 --host a:2 {worker}")), "{text}");
        // Two replicas, stage-major (rank = stage x 2 + replica): ranks 0, 1, 6 and 7 run
        // worker 0's stages.
        let mut two = hostfile("a slots=4\nb slots=4\n");
        two.worker_args = vec!["--replicas".into(), "2".into()];
        let text = shell_line(&mpirun_line(&two).unwrap());
        assert!(text.contains("-np 2 --host a:4 /bin/pipewright worker") && text.contains(": -np 4 --host b:4 ") && text.ends_with("--replicas 2"), "{text}");
        assert_eq!(text.matches(" : ").count(), 2, "{text}");
        let e = mpirun_line(&hostfile("a slots=1\nb slots=3\n")).unwrap_err().to_string();
        assert!(e.contains("4 slot(s) on 2 host(s) cannot keep each worker's 2 stages (zb-v: 2 worker(s) x 1 replica(s)) on one host"), "{e}");
        let e = mpirun_line(&hostfile("a slots=2\nb\n")).unwrap_err().to_string();
        assert!(e.contains("host b has no `slots=N`"), "{e}");
        // One stage per worker: the hostfile is Open MPI's to read, as before.
        let mut one = hostfile("a\n");
        compile(&request("mlp.onnx", stages(2), &build)).unwrap();
        one.worker_args.clear();
        assert!(!shell_line(&mpirun_line(&one).unwrap()).contains(" --host "));
    }

    /// MPMD lists each stage's executable once, on as many consecutive ranks as replicas,
    /// in stage order: the stage-major rank numbering the workers expect.
    #[test]
    fn the_mpmd_line_gives_each_stage_its_replicas_consecutive_ranks() {
        let dir = tempfile::tempdir().unwrap();
        let build = dir.path().join("build");
        compile(&request("mlp.onnx", stages(2), &build)).unwrap();
        for k in 0..2 {
            std::fs::write(build.join(format!("stage{k}")), b"").unwrap();
        }
        let line = mpirun_line(&LaunchRequest { executables: true, ..req(&build, Some(6), &["--replicas", "3", "--steps", "2"]) }).unwrap();
        let text = shell_line(&line);
        let (s0, s1) = (build.join("stage0"), build.join("stage1"));
        let want = format!("-np 3 {} --replicas 3 --steps 2 : -np 3 {} --replicas 3 --steps 2", s0.display(), s1.display());
        assert!(text.ends_with(&want), "{text}");
        assert_eq!(line.iter().filter(|a| *a == ":").count(), 1, "{text}");
    }
}
