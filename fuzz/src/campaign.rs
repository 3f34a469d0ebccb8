//! A fuzzing campaign on one target: the seeds run first, then mutants of the corpus.
//! There is no coverage instrumentation on stable Rust; as a cheap stand-in, an input
//! whose error message (digits blanked) has not been seen before joins the corpus, so
//! mutants that got further into a loader are mutated further.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::guard::{self, Outcome};
use crate::mutate;
use crate::rng::Rng;
use crate::targets::{Context, Target};

pub struct Options {
    pub target: Target,
    pub runs: u64,
    pub seed: u64,
    /// Mutants are cut to this many bytes (seeds keep their length).
    pub max_len: usize,
    pub timeout: Duration,
    /// Bytes one execution may allocate (at once or in total) before it is a finding.
    pub alloc_cap: u64,
    pub rss_limit_mib: u64,
    /// `fuzz/seeds`.
    pub seed_root: PathBuf,
    /// More seed folders (searched recursively for the target's file suffix).
    pub extra_seeds: Vec<PathBuf>,
    /// Seeds larger than this are skipped (keeps executions fast).
    pub max_seed_len: usize,
    pub crash_dir: PathBuf,
    /// Print progress every this many executions (0: never).
    pub progress_every: u64,
}

impl Options {
    pub fn new(target: Target) -> Options {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        Options {
            target,
            runs: 1_000_000,
            seed: 1,
            max_len: 64 * 1024,
            timeout: Duration::from_secs(5),
            alloc_cap: 512 << 20,
            rss_limit_mib: 4096,
            seed_root: root.join("seeds"),
            extra_seeds: Vec::new(),
            max_seed_len: 64 * 1024,
            crash_dir: root.join("crashes"),
            progress_every: 0,
        }
    }
}

/// One panic found (hangs and allocation bombs end the process instead).
#[derive(Debug)]
pub struct Crash {
    pub message: String,
    pub saved: PathBuf,
}

#[derive(Debug)]
pub struct Report {
    pub target: Target,
    pub execs: u64,
    pub accepted: u64,
    pub refused: u64,
    pub seeds: usize,
    pub corpus: usize,
    pub crashes: Vec<Crash>,
    pub elapsed: Duration,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} executions in {:.1} s ({:.0}/s), {} accepted, {} refused, {} crashes; {} seeds, corpus grew to {}",
            self.target,
            self.execs,
            self.elapsed.as_secs_f64(),
            self.execs as f64 / self.elapsed.as_secs_f64().max(1e-9),
            self.accepted,
            self.refused,
            self.crashes.len(),
            self.seeds,
            self.corpus
        )
    }
}

/// The seed files of `target`: `fuzz/seeds/DIR/*SUFFIX`, then the extra folders.
pub fn load_seeds(opts: &Options) -> Result<Vec<Vec<u8>>, String> {
    let (dir, suffix) = opts.target.seeds();
    let mut files = Vec::new();
    walk(&opts.seed_root.join(dir), suffix, false, &mut files)?;
    for extra in &opts.extra_seeds {
        walk(extra, suffix, true, &mut files)?;
    }
    files.sort();
    let mut seeds = Vec::new();
    for f in files {
        let len = std::fs::metadata(&f).map_err(|e| format!("{}: {e}", f.display()))?.len();
        if len as usize <= opts.max_seed_len {
            seeds.push(std::fs::read(&f).map_err(|e| format!("{}: cannot read: {e}", f.display()))?);
        }
    }
    if seeds.is_empty() {
        return Err(format!("no seeds for target {} ({}/{dir}/*{suffix})", opts.target, opts.seed_root.display()));
    }
    Ok(seeds)
}

fn walk(dir: &Path, suffix: &str, recurse: bool, out: &mut Vec<PathBuf>) -> Result<(), String> {
    for e in std::fs::read_dir(dir).map_err(|e| format!("{}: cannot read the seed folder: {e}", dir.display()))? {
        let p = e.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        if p.is_dir() {
            if recurse {
                walk(&p, suffix, true, out)?;
            }
        } else if p.to_str().is_some_and(|s| s.ends_with(suffix)) {
            out.push(p);
        }
    }
    Ok(())
}

/// The kind of an error message: its letters and spaces only, up to the first quote or
/// bracket (what follows is quoted data), first 60 of them, so
/// messages that differ in an offset, a count, a quoted name or the bytes found are one
/// kind (otherwise every mutant of a JSON file is "new" and the corpus fills with noise).
fn signature(message: &str) -> u64 {
    let quoted = message.find(['"', '\'', '`', '{', '[', '(']).unwrap_or(message.len());
    let kind: Vec<u8> = message[..quoted].bytes().filter(|b| b.is_ascii_alphabetic() || *b == b' ').take(60).collect();
    guard::hash(&kind)
}

/// The corpus stops growing here (keeps memory and the choice of bases bounded).
const MAX_CORPUS: usize = 4096;

pub fn run(opts: &Options) -> Result<Report, String> {
    let ctx = Context::new(&opts.seed_root)?;
    let seeds = load_seeds(opts)?;
    guard::install(opts.timeout);
    guard::set_alloc_cap(opts.alloc_cap);
    let mut dict = Vec::new();
    for s in &seeds {
        mutate::words_of(s, &mut dict);
    }
    let mut rng = Rng::new(opts.seed);
    let mut corpus = seeds.clone();
    let mut seen: HashSet<u64> = HashSet::new();
    let mut crashed: HashSet<u64> = HashSet::new();
    let mut report = Report {
        target: opts.target,
        execs: 0,
        accepted: 0,
        refused: 0,
        seeds: seeds.len(),
        corpus: 0,
        crashes: Vec::new(),
        elapsed: Duration::ZERO,
    };
    let start = Instant::now();
    let target = opts.target;
    for i in 0..opts.runs {
        let input = if (i as usize) < seeds.len() {
            seeds[i as usize].clone()
        } else {
            // Half the time a seed: mutants of mutants drift far from anything valid.
            let base = if rng.chance(1, 2) { &seeds[rng.below(seeds.len())] } else { &corpus[rng.below(corpus.len())] };
            let other = &corpus[rng.below(corpus.len())];
            mutate::mutate(target, base, other, &dict, opts.max_len, &mut rng)
        };
        let outcome = guard::execute(target.name(), &opts.crash_dir, &input, |d| ctx.execute(target, d));
        report.execs += 1;
        let sig = match outcome {
            Outcome::Accepted => {
                report.accepted += 1;
                signature("accepted")
            }
            Outcome::Refused(m) => {
                report.refused += 1;
                signature(&m)
            }
            Outcome::Panicked(m) => {
                // Report each kind of panic once (by message, numbers blanked).
                if crashed.insert(signature(&m)) {
                    let saved = guard::save(&opts.crash_dir, target.name(), &input)
                        .map_err(|e| format!("{}: cannot save a crashing input: {e}", opts.crash_dir.display()))?;
                    eprintln!("pipewright-fuzz: {target}: PANIC {m}; input saved as {}", saved.display());
                    report.crashes.push(Crash { message: m, saved });
                }
                continue;
            }
        };
        if seen.insert(sig) && (i as usize) >= seeds.len() && corpus.len() < MAX_CORPUS {
            corpus.push(input);
        }
        if i % 256 == 255 {
            guard::check_rss(opts.rss_limit_mib);
        }
        if opts.progress_every > 0 && (i + 1) % opts.progress_every == 0 {
            eprintln!(
                "pipewright-fuzz: {target}: {} executions, {:.0}/s, corpus {}, crashes {}",
                i + 1,
                (i + 1) as f64 / start.elapsed().as_secs_f64().max(1e-9),
                corpus.len(),
                report.crashes.len()
            );
        }
    }
    report.corpus = corpus.len();
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Runs one saved input through `target` (the reproduce step): how it ended, as text.
pub fn replay(target: Target, seed_root: &Path, crash_dir: &Path, input: &[u8], timeout: Duration, alloc_cap: u64) -> Result<String, String> {
    let ctx = Context::new(seed_root)?;
    guard::install(timeout);
    guard::set_alloc_cap(alloc_cap);
    Ok(match guard::execute(target.name(), crash_dir, input, |d| ctx.execute(target, d)) {
        Outcome::Accepted => "accepted".to_string(),
        Outcome::Refused(m) => format!("refused: {m}"),
        Outcome::Panicked(m) => format!("PANIC: {m}"),
    })
}
