//! The text form of a stage module, for `pipewright inspect` and for a stage executable
//! run without arguments: the header, the stage's inputs and outputs, its stored tensors
//! with their weight versions and update rules, each slot's lifetime and every instruction
//! with its recompute/stash mark. Stored tensors are shown by name and shape, never by
//! value.

use std::fmt::Write;

use pipewright_core::Recompute;

use crate::build::extent_text;
use crate::module::StageModule;
use crate::program::{Program, SlotId};

/// The header and program of a stage module in text form; stored tensors by name and
/// shape, never their values.
pub fn module_text(m: &StageModule) -> String {
    let h = &m.header;
    let p = &m.program;
    let mut s = String::new();
    let _ = writeln!(s, "stage module: stage {} of {}", h.params.stage, h.params.depth);
    let _ = writeln!(s, "schedule:     {}", h.params.schedule);
    let _ = writeln!(s, "recompute:    {}", h.params.recompute);
    let _ = writeln!(s, "version:      {}", h.version);
    let _ = writeln!(s, "checksum:     {:#010x}", h.checksum);
    if !p.pipeline.is_empty() {
        let _ = writeln!(s, "pipeline:     {}", p.pipeline);
    }
    let _ = writeln!(
        s,
        "sections:     program {} bytes at {}, weights {} bytes at {}",
        h.program.len, h.program.offset, h.weights.len, h.weights.offset
    );
    // Recompute/stash marks only when the module was compiled with recomputation.
    s.push_str(&program_text(p, h.params.recompute != Recompute::None));
    s
}

/// A stage program in text form: inputs, outputs, stored tensors, segments, slot
/// lifetimes and instructions; `marks` adds each instruction's and slot's
/// `[recompute]`/`[stash]` mark.
pub fn program_text(p: &Program, marks: bool) -> String {
    let mut s = String::new();
    let ty = |id: SlotId| {
        let info = &p.slots[id.index()];
        let dims: Vec<String> = info.shape.iter().map(|&e| extent_text::text(e)).collect();
        format!("{}[{}]", info.elem, dims.join(","))
    };
    let slot_line = |id: SlotId| format!("{id}: {}  # {:?}", ty(id), p.slots[id.index()].name);
    let _ = writeln!(s, "inputs ({}):", p.inputs.len());
    for &id in &p.inputs {
        let _ = writeln!(s, "  {}", slot_line(id));
    }
    let _ = writeln!(s, "outputs ({}):", p.outputs.len());
    for &id in &p.outputs {
        let _ = writeln!(s, "  {}", slot_line(id));
    }
    let params: u64 = p.stored.iter().filter(|t| t.trainable).map(|t| t.dims.iter().product::<i64>().max(0) as u64).sum();
    let _ = writeln!(s, "stored ({}, {} trainable parameters):", p.stored.len(), params);
    for t in &p.stored {
        let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
        let kind = if t.trainable { "param" } else { "const" };
        let sync = if t.sync.is_empty() {
            String::new()
        } else {
            let st: Vec<String> = t.sync.iter().map(|k| k.to_string()).collect();
            format!(", sync {}", st.join("+"))
        };
        let update = format!(" ({}{sync})", t.update);
        let _ = writeln!(
            s,
            "  {}: {}[{}] {kind} x{}{update}  # {:?}",
            t.slot,
            t.elem,
            dims.join(","),
            t.versions,
            p.slots[t.slot.index()].name
        );
    }
    let stashed = p.stashed_slots();
    let recomputed = p.recompute_count();
    let _ = writeln!(
        s,
        "segments:     forward {} instrs, recompute {} instrs, stashed {} slots",
        p.instrs.len(),
        recomputed,
        stashed.len()
    );
    let first = p.first_defs();
    let outputs: std::collections::HashSet<_> = p.outputs.iter().copied().collect();
    let entry: std::collections::HashSet<_> = p.inputs.iter().copied().chain(p.stored.iter().map(|t| t.slot)).collect();
    let mut in_recompute = vec![false; p.slots.len()];
    for ins in p.instrs.iter().filter(|i| i.recompute) {
        for o in ins.outputs.iter().flatten() {
            in_recompute[o.index()] = true;
        }
    }
    let stashed_set: std::collections::HashSet<_> = stashed.iter().copied().collect();
    let _ = writeln!(s, "slots ({}):", p.slots.len());
    for k in 0..p.slots.len() {
        let id = SlotId(k as u32);
        let start = if entry.contains(&id) { "in".to_string() } else { first[k].map(|i| format!("n{i}")).unwrap_or_else(|| "-".into()) };
        let end = if outputs.contains(&id) { Some("out".to_string()) } else { p.slots[k].last_use.map(|i| format!("n{i}")) };
        let live = match end {
            Some(end) => format!("live {start}..{end}"),
            None => format!("live {start} (unused)"),
        };
        let mark = if !marks {
            ""
        } else if in_recompute[k] {
            " [recompute]"
        } else if stashed_set.contains(&id) {
            " [stash]"
        } else {
            ""
        };
        let _ = writeln!(s, "  {}  {live}{mark}", slot_line(id));
    }
    let _ = writeln!(s, "instructions ({}):", p.instrs.len());
    let opt = |x: &Option<SlotId>| x.map(|id| id.to_string()).unwrap_or_else(|| "_".into());
    for (i, ins) in p.instrs.iter().enumerate() {
        let outs: Vec<String> = ins.outputs.iter().map(opt).collect();
        let args: Vec<String> = ins.inputs.iter().map(opt).collect();
        let mark = match (marks, ins.recompute) {
            (false, _) => "",
            (true, true) => " [recompute]",
            (true, false) => " [stash]",
        };
        let _ = writeln!(s, "  n{i}: {} = {}({}){mark}  # {}", outs.join(", "), ins.op, args.join(", "), ins.name);
    }
    s
}

/// The summary of a stage module as JSON (`pipewright inspect stage.pwm --json`): the
/// header, inputs and outputs, stored tensors (name, type, shape, kind, versions, update
/// rule; never values) and the instructions by name and op.
pub fn module_json(m: &StageModule) -> serde_json::Value {
    use serde_json::json;
    let (h, p) = (&m.header, &m.program);
    let slot = |id: SlotId| {
        let info = &p.slots[id.index()];
        let shape: Vec<String> = info.shape.iter().map(|&e| extent_text::text(e)).collect();
        json!({ "slot": id.to_string(), "name": info.name, "elem": info.elem.to_string(), "shape": shape })
    };
    let stored: Vec<serde_json::Value> = p
        .stored
        .iter()
        .map(|t| {
            json!({
                "slot": t.slot.to_string(),
                "name": p.slots[t.slot.index()].name,
                "elem": t.elem.to_string(),
                "dims": t.dims,
                "trainable": t.trainable,
                "versions": t.versions,
                "update": t.update.to_string(),
            })
        })
        .collect();
    let params: u64 = p.stored.iter().filter(|t| t.trainable).map(|t| t.dims.iter().product::<i64>().max(0) as u64).sum();
    let instrs: Vec<serde_json::Value> =
        p.instrs.iter().map(|i| json!({ "name": i.name, "op": i.op.name(), "recompute": i.recompute })).collect();
    json!({
        "stage": h.params.stage,
        "depth": h.params.depth,
        "schedule": h.params.schedule.to_string(),
        "recompute": h.params.recompute.to_string(),
        "version": h.version,
        "checksum": format!("{:#010x}", h.checksum),
        "pipeline": p.pipeline,
        "sections": { "program": { "offset": h.program.offset, "len": h.program.len }, "weights": { "offset": h.weights.offset, "len": h.weights.len } },
        "inputs": p.inputs.iter().map(|&id| slot(id)).collect::<Vec<_>>(),
        "outputs": p.outputs.iter().map(|&id| slot(id)).collect::<Vec<_>>(),
        "trainable_parameters": params,
        "stored": stored,
        "stashed_slots": p.stashed_slots().len(),
        "instructions": instrs,
    })
}
