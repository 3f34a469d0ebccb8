//! Filetests: small IR texts in `tests/filetests/*.pwir`, each run through one pass and
//! compared with the expected text that follows it.
//!
//! A file is a `// run: PASS ARGS` line, the input graph in the IR text form (verified
//! after parsing), then `// ----- expect -----` and the pass's output exactly:
//!
//! - `partition cut=NODE,...`: stages start at the named nodes (in text order); prints
//!   the graph with its stage boundaries and `stage=K` marks.
//! - `recompute MODE b=B`: the input carries `stage=K` marks (a partitioned graph);
//!   prints the stash/recompute marks and the per-stage summary.
//! - `weight-versioning SCHEDULE m=M`: same input; prints versions, rules, sync groups.
//! - `plan stages=D [b=B]`: prints the plan pass's result (no cluster: the cuts only).
//!
//! `UPDATE_FILETESTS=1 cargo test -p pipewright-passes --test filetests` rewrites the
//! expected texts (read the diff before committing).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use pipewright_core::{Recompute, Schedule};
use pipewright_ir::{parse_graph_annotated, verify, Graph, NodeId, StageMap};
use pipewright_passes::boundaries::insert_stage_boundaries;
use pipewright_passes::cost::{CostModel, Roofline};
use pipewright_passes::manager::PassOutput;
use pipewright_passes::pipeline::{annotated_text, plan_stages, Imported, PlanRequest};
use pipewright_passes::recompute::decide_recomputation;
use pipewright_passes::versioning::version_weights;

const EXPECT: &str = "// ----- expect -----\n";

fn files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/filetests");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir).expect("tests/filetests").map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "pwir")).collect();
    v.sort();
    v
}

/// `key=value` arguments of the run line.
fn args(words: &[&str]) -> HashMap<String, String> {
    words.iter().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The `stage=K` marks of a parsed graph.
fn stages_of(g: &Graph, notes: &[(NodeId, String)]) -> StageMap {
    let stage = |note: &str| note.split_whitespace().find_map(|w| w.strip_prefix("stage=")).map(|s| s.parse::<u32>().expect("stage number"));
    let d = notes.iter().filter_map(|(_, n)| stage(n)).max().expect("the input has stage=K marks") + 1;
    let mut map = StageMap::new(d);
    for (n, note) in notes {
        map.set(*n, stage(note).unwrap_or_else(|| panic!("node {:?} has no stage mark", g.node(*n).name)));
    }
    map
}

fn run(path: &Path, input: &str) -> String {
    let run = input.lines().find_map(|l| l.strip_prefix("// run: ")).unwrap_or_else(|| panic!("{}: no `// run:` line", path.display()));
    let words: Vec<&str> = run.split_whitespace().collect();
    let a = args(&words);
    let (mut g, notes) = parse_graph_annotated(input).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    verify(&g).unwrap_or_else(|e| panic!("{}: the input does not verify: {e:?}", path.display()));
    let num = |k: &str| a.get(k).map(|v| v.parse::<u64>().expect("a number"));
    match words[0] {
        "partition" => {
            let cuts: Vec<&str> = a["cut"].split(',').collect();
            let order: Vec<NodeId> = notes.iter().map(|(n, _)| *n).collect();
            let mut map = StageMap::new(cuts.len() as u32 + 1);
            let mut stage = 0;
            for n in order {
                if cuts.contains(&g.node(n).name.as_str()) {
                    stage += 1;
                }
                map.set(n, stage);
            }
            let stages = insert_stage_boundaries(&mut g, &map).unwrap();
            verify(&g).unwrap();
            annotated_text(&g, &stages, None, None)
        }
        "recompute" => {
            let mode: Recompute = words[1].parse().unwrap();
            let stages = stages_of(&g, &notes);
            let cost = CostModel::new(&g, Roofline::default()).unwrap();
            let plan = decide_recomputation(&g, &stages, &cost, mode, None, num("b").unwrap_or(1));
            annotated_text(&g, &stages, Some(&plan), None) + &plan.text()
        }
        "weight-versioning" => {
            let schedule: Schedule = words[1].parse().unwrap();
            let stages = stages_of(&g, &notes);
            let v = version_weights(&g, &stages, schedule, stages.num_stages, num("m").unwrap_or(u64::from(stages.num_stages)) as u32).unwrap();
            annotated_text(&g, &stages, None, Some(&v)) + &v.text()
        }
        "plan" => {
            let depth = num("stages").expect("plan stages=D") as u32;
            let request = PlanRequest::Stages { depth, schedule: Schedule::TwoBw, recompute: Recompute::None, microbatch: num("b"), microbatches: None, placement: pipewright_core::Placement::StageMajor };
            plan_stages(Imported { graph: g }, &request).unwrap().text()
        }
        other => panic!("{}: unknown pass {other:?}", path.display()),
    }
}

#[test]
fn filetests() {
    let files = files();
    assert!(files.len() >= 8, "only {} filetests", files.len());
    let update = std::env::var_os("UPDATE_FILETESTS").is_some();
    let mut failed = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let (input, expected) = text.split_once(EXPECT).unwrap_or((&text, ""));
        let got = run(&path, input);
        if got == expected {
            continue;
        }
        if update {
            std::fs::write(&path, format!("{input}{EXPECT}{got}")).unwrap();
        } else {
            failed.push(format!("{}:\n--- expected\n{expected}--- got\n{got}", path.display()));
        }
    }
    assert!(failed.is_empty(), "{} filetest(s) differ (UPDATE_FILETESTS=1 rewrites them):\n{}", failed.len(), failed.join("\n"));
}
