#!/usr/bin/env python3
"""The GPU acceptance run (issue 36): one offline script that settles, in a few minutes on
a GPU machine, what CPU tests cannot, and prints a verdict table (exit status 1 on any
failure).

    python3 scripts/gpu_acceptance.py --bin pipewright --models MODELS --out OUT

MODELS holds the shared models (mlp, gpt2-tiny, bert-tiny, vit-tiny with their `.inputs`
folders); python3 needs torch and transformers (the GPU machines have a CUDA torch 2.11;
here `bash zoo/env.sh` gives one). The binary runs against that torch's libtorch, with no
LD_PRELOAD: `doctor` must find CUDA by pipewright's own loading.

Checks, each a row of the table:
  doctor            CUDA found without LD_PRELOAD
  run-forward       each shared model on the device matches its reference outputs
  train parity      gpt2-tiny at d = 1 and 2 under 2bw, flush and gpipe on the device follows
                    the CPU's losses: fp32 within 1e-3 relative, bf16 and fp16 within 5e-2;
                    at d = 2 also with --devices placements (both stages on the GPU; a CPU
                    and a GPU stage)
  host reads        every device run's kernels read nothing back per step
  step time         GPT-2 small built from its config (no download), d = 1, pipewright vs
                    PyTorch eager on the same model, fp32 and bf16 side by side (goals on a
                    GPU: pipewright fp32 <= 1.1x eager fp32; pipewright bf16 <= 0.8x its fp32)
  peak memory       the device's peak memory during pipewright's fp32 GPT-2 run (nvidia-smi,
                    process total) against the planner's prediction for that stage
  schedules         the same GPT-2 at d = 2 and 4 under 2bw, flush and gpipe (fp32) and 2bw
                    bf16, every stage on the one device: samples/s (measured, not judged)

`--checks` runs a subset (a short GPU lease: `--checks speed,schedules`).
`--device cpu --size tiny` runs the same script on the CPU with a tiny GPT-2 (CI does, so
everything but the GPU itself is tested before a GPU is lent): parity compares the CPU
with itself, and the speed goals and the memory row are reported, not judged.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

# The checks, in the order they run (`--checks` picks a subset): speed is the step-time
# and peak-memory rows, schedules reuses speed's GPT-2.
CHECKS = ["doctor", "forward", "parity", "speed", "schedules"]
PARITY_TOL = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}
SIZES = {
    # GPT-2 small (124M) at batch 16 x 128, as measured in the issue.
    "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, batch=16, seq=128, steps=12, warmup=3),
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, batch=4, seq=32, steps=5, warmup=2),
}


class Table:
    def __init__(self):
        self.rows = []

    def add(self, check, detail, verdict, figure=""):
        self.rows.append((check, detail, verdict, figure))
        print(f"[{verdict}] {check}: {detail} {figure}".rstrip(), flush=True)

    def failed(self):
        return [r for r in self.rows if r[2] == "FAIL"]

    def markdown(self, device):
        lines = [f"| check | what | verdict | figure |", "|---|---|---|---|"]
        lines += [f"| {c} | {d} | {v} | {f} |" for c, d, v, f in self.rows]
        n = len(self.failed())
        lines += ["", f"{len(self.rows)} checks on {device}: {'all passed' if n == 0 else f'{n} failed'}."]
        return "\n".join(lines) + "\n"


class Runner:
    def __init__(self, binary, env):
        self.binary, self.env = binary, env

    def run(self, args, timeout=300):
        """Runs the binary: (exit status, stdout, stderr); a timeout is status 124."""
        try:
            p = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=timeout, env=self.env)
            return p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired:
            return 124, "", f"timed out after {timeout} s"


def last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else ""


def losses(path):
    with open(path) as f:
        return [json.loads(l)["loss"] for l in f if l.strip()]


def step_seconds(path, warmup):
    with open(path) as f:
        secs = [json.loads(l)["seconds"] for l in f if l.strip()]
    return statistics.median(secs[warmup:]) if len(secs) > warmup else float("nan")


def host_reads(stdout):
    m = re.search(r"host reads of computed values per step \(device syncs on a GPU\) per stage: (.*)", stdout)
    return [float(x) for x in m.group(1).split(",")] if m else None


def check_doctor(r, table, device):
    rc, out, err = r.run(["doctor"], timeout=60)
    found = re.search(r"CUDA available: yes", out + err) is not None
    if device == "cpu":
        table.add("doctor", "runs (CPU dry run: CUDA not expected)", "pass" if rc == 0 else "FAIL", last_line(out + err)[:80])
    else:
        table.add("doctor", "CUDA found without LD_PRELOAD", "pass" if rc == 0 and found else "FAIL", "" if found else last_line(out + err)[:120])


def check_forward(r, table, device, models):
    for name in ["mlp", "gpt2-tiny", "bert-tiny", "vit-tiny"]:
        rc, out, err = r.run(["run-forward", f"{models}/{name}.onnx", "--inputs", f"{models}/{name}.inputs", "--device", device], timeout=120)
        table.add("run-forward", f"{name} on {device} matches its reference outputs", "pass" if rc == 0 else "FAIL", "" if rc == 0 else last_line(err)[:120])


def train(r, build, metrics, extra, timeout=300):
    args = ["train", build, "--steps", "4", "--microbatch", "4", "--microbatches", "2", "--optimizer", "adam", "--lr", "0.001", "--seed", "0", "--no-progress", "--metrics", metrics, *extra]
    return r.run(args, timeout=timeout)


def check_parity(r, table, device, models, out):
    reads = []
    for d in [1, 2]:
        for schedule in ["2bw", "flush", "gpipe"]:
            build = f"{out}/gpt2-tiny-d{d}-{schedule}"
            rc, _, err = r.run(["compile", f"{models}/gpt2-tiny.onnx", "--stages", str(d), "--schedule", schedule, "-o", build], timeout=120)
            if rc != 0:
                table.add("train parity", f"d={d} {schedule}: compile", "FAIL", last_line(err)[:120])
                continue
            variants = [(p, ["--device", device, "--precision", p]) for p in ["fp32", "bf16", "fp16"]]
            if d == 2:
                variants += [("fp32", ["--devices", f"{device}:0,{device}:0" if device != "cpu" else "cpu,cpu"]), ("fp32", ["--devices", f"cpu,{device}:0" if device != "cpu" else "cpu,cpu"])]
            ref_metrics = f"{build}/cpu-fp32.jsonl"
            rc, _, err = train(r, build, ref_metrics, ["--device", "cpu"])
            ref = losses(ref_metrics) if rc == 0 else None
            for i, (precision, extra) in enumerate(variants):
                metrics = f"{build}/run-{i}.jsonl"
                what = f"gpt2-tiny d={d} {schedule} {' '.join(extra)} vs the CPU"
                rc, stdout, err = train(r, build, metrics, extra)
                if rc != 0 or ref is None:
                    table.add("train parity", what, "FAIL", last_line(err)[:120])
                    continue
                # Low precision is held to the CPU's fp32 curve (the CPU's own bf16/fp16
                # kernels differ from the GPU's as much as from fp32).
                got = losses(metrics)
                gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))
                ok = len(got) == len(ref) and gap <= PARITY_TOL[precision]
                table.add("train parity", what, "pass" if ok else "FAIL", f"largest relative loss gap {gap:.2e} (limit {PARITY_TOL[precision]:g})")
                reads.append((what, host_reads(stdout)))
    bad = [(w, x) for w, x in reads if x is None or any(v != 0 for v in x)]
    table.add("host reads", f"per step and stage, over {len(reads)} device runs", "pass" if reads and not bad else "FAIL", "all 0" if not bad else f"{bad[0][0]}: {bad[0][1]}")


def export_gpt2(py, size, path, attention="sdpa"):
    """GPT-2 of `size` from its config (seed 0, random weights), exported at batch x seq
    with a dynamic batch; `attention` is transformers' attention implementation."""
    s = SIZES[size]
    code = f"""
import torch, transformers
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer={s['n_layer']}, n_embd={s['n_embd']}, n_head={s['n_head']}, vocab_size={s['vocab_size']}, n_positions={s['n_positions']}, use_cache=False, attn_implementation={attention!r})
m = transformers.GPT2LMHeadModel(cfg).eval()
class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__(); self.m = m
    def forward(self, input_ids):
        # An explicit all-ones mask: without one, recent transformers look for packed
        # sequences in the position ids with aten::diff, which the exporter lacks.
        return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
ids = torch.randint(0, {s['vocab_size']}, ({s['batch']}, {s['seq']}))
torch.onnx.export(Logits(m), (ids,), {path!r}, input_names=["input_ids"], output_names=["logits"], dynamic_axes={{"input_ids": {{0: "batch"}}, "logits": {{0: "batch"}}}}, dynamo=False, opset_version=17)
"""
    subprocess.run([py, "-c", code], check=True, timeout=600)


def eager_ms(py, size, device, precision):
    """PyTorch eager's median ms per Adam step of the same GPT-2 (same config and seed)."""
    s = SIZES[size]
    code = f"""
import statistics, time, torch, transformers
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer={s['n_layer']}, n_embd={s['n_embd']}, n_head={s['n_head']}, vocab_size={s['vocab_size']}, n_positions={s['n_positions']}, use_cache=False)
dev = torch.device({device!r})
m = transformers.GPT2LMHeadModel(cfg).to(dev).train()
opt = torch.optim.Adam(m.parameters(), lr=1e-4)
ids = torch.randint(0, {s['vocab_size']}, ({s['batch']}, {s['seq']}), device=dev)
labels = torch.randint(0, {s['vocab_size']}, ({s['batch']}, {s['seq']}), device=dev)
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
times = []
for i in range({s['warmup']} + {s['steps']}):
    sync(); t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled={precision == 'bf16'}):
        logits = m(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True); loss.item()
    sync(); times.append(time.perf_counter() - t0)
print(statistics.median(times[{s['warmup']}:]) * 1e3)
"""
    p = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True, timeout=600)
    return float(p.stdout.strip().splitlines()[-1])


class GpuMemory:
    """Peak memory of one process on the GPU, sampled with nvidia-smi while it runs."""

    def __init__(self):
        self.peak_mib, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self):
        while not self.stop.is_set():
            try:
                q = subprocess.run(["nvidia-smi", "--query-compute-apps=used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
                for line in q.stdout.split():
                    self.peak_mib = max(self.peak_mib, int(line))
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.2)


def check_gpt2_speed(r, table, device, size, py, out):
    s = SIZES[size]
    onnx = f"{out}/gpt2-{size}.onnx"
    try:
        export_gpt2(py, size, onnx)
    except subprocess.CalledProcessError:
        # Some transformers versions build the SDPA mask with ops the exporter lacks.
        export_gpt2(py, size, onnx, attention="eager")
    build = f"{out}/gpt2-{size}-d1"
    # The exporter merges identical initializers (every LayerNorm's ones and zeros); untied,
    # pipewright trains the same parameters eager does.
    rc, _, err = r.run(["compile", onnx, "--stages", "1", "--schedule", "flush", "--untie-merged", "-o", build], timeout=600)
    if rc != 0:
        table.add("step time", f"GPT-2 {size}: compile", "FAIL", last_line(err)[:120])
        return
    steps = str(s["warmup"] + s["steps"])
    ours = {}
    memory = GpuMemory() if device != "cpu" and shutil.which("nvidia-smi") else None
    for precision in ["fp32", "bf16"]:
        metrics = f"{build}/{precision}.jsonl"
        if memory and precision == "fp32":
            memory.thread.start()
        rc, stdout, err = r.run(["train", build, "--steps", steps, "--microbatch", str(s["batch"]), "--microbatches", "1", "--optimizer", "adam", "--lr", "0.0001", "--no-progress", "--device", device, "--precision", precision, "--metrics", metrics], timeout=900)
        if memory and precision == "fp32":
            memory.stop.set()
        if rc != 0:
            table.add("step time", f"pipewright GPT-2 {size} d=1 {precision}", "FAIL", last_line(err)[:120])
            return
        ours[precision] = step_seconds(metrics, s["warmup"]) * 1e3
    eager = {p: eager_ms(py, size, device, p) for p in ["fp32", "bf16"]}
    judge = device != "cpu"
    shape = f"batch {s['batch']} x {s['seq']}, Adam"
    ratio = ours["fp32"] / eager["fp32"]
    table.add("step time", f"GPT-2 {size} d=1 fp32, {shape}: pipewright {ours['fp32']:.1f} ms vs eager {eager['fp32']:.1f} ms", ("pass" if ratio <= 1.1 else "FAIL") if judge else "measured", f"{ratio:.2f}x (goal <= 1.1x)")
    bf = ours["bf16"] / ours["fp32"]
    table.add("step time", f"GPT-2 {size} d=1 bf16: pipewright {ours['bf16']:.1f} ms vs its fp32; eager bf16 autocast {eager['bf16']:.1f} ms", ("pass" if bf <= 0.8 else "FAIL") if judge else "measured", f"{bf:.2f}x (goal <= 0.8x)")
    rc, plan, err = r.run(["plan", onnx, "--workers", "1", "--memory", "1000GiB", "--batch", str(s["batch"]), "--microbatch", str(s["batch"]), "--stages", "1", "--schedule", "flush", "--recompute", "none", "--optimizer", "adam", "--json"], timeout=300)
    predicted = json.loads(plan)["chosen"]["peak_memory_per_stage"][0] / 2**20 if rc == 0 else None
    if memory:
        ratio = memory.peak_mib / predicted if predicted else float("nan")
        table.add("peak memory", f"GPT-2 {size} d=1 fp32: {memory.peak_mib} MiB on the device (process total, nvidia-smi) vs {predicted:.0f} MiB planned", "measured", f"{ratio:.2f}x the plan")
    else:
        table.add("peak memory", f"GPT-2 {size} d=1: the planner predicts {predicted:.1f} MiB; the device's own figure needs a GPU" if predicted else "plan failed", "measured" if predicted else "FAIL", "")
    return onnx


def check_schedules(r, table, device, size, onnx, out):
    """Samples/s of the same GPT-2 at d = 2 and 4 under each schedule, every stage on the
    one device (so this measures a schedule's overhead there, not pipeline speed-up);
    measured, not judged."""
    s = SIZES[size]
    steps = str(s["warmup"] + s["steps"])
    for d in [2, 4]:
        m = 2 * d
        base = None
        for schedule, precision in [("2bw", "fp32"), ("flush", "fp32"), ("gpipe", "fp32"), ("2bw", "bf16")]:
            build = f"{out}/gpt2-{size}-d{d}-{schedule}"
            what = f"GPT-2 {size} d={d} {schedule} {precision}, {m} microbatches of {s['batch']} x {s['seq']}, Adam, all stages on {device}"
            if not os.path.isdir(build):
                rc, _, err = r.run(["compile", onnx, "--stages", str(d), "--schedule", schedule, "--untie-merged", "-o", build], timeout=600)
                if rc != 0:
                    table.add("schedules", f"{what}: compile", "FAIL", last_line(err)[:120])
                    continue
            metrics = f"{build}/{precision}.jsonl"
            rc, _, err = r.run(["train", build, "--steps", steps, "--microbatch", str(s["batch"]), "--microbatches", str(m), "--optimizer", "adam", "--lr", "0.0001", "--no-progress", "--device", device, "--precision", precision, "--metrics", metrics], timeout=900)
            if rc != 0:
                table.add("schedules", what, "FAIL", last_line(err)[:120])
                continue
            rate = m * s["batch"] / step_seconds(metrics, s["warmup"])
            base = base or rate
            table.add("schedules", what, "measured", f"{rate:.0f} samples/s ({rate / base:.2f}x 2bw fp32)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--python", default=sys.executable, help="python with torch and transformers (default: this one)")
    ap.add_argument("--table", help="also write the table here (docs/gpu-acceptance.md after a GPU run)")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)} (default: all; schedules needs speed's GPT-2)")
    a = ap.parse_args()
    checks = a.checks.split(",")
    unknown = [c for c in checks if c not in CHECKS]
    if unknown or ("schedules" in checks and "speed" not in checks):
        ap.error(f"--checks {a.checks}: choose from {','.join(CHECKS)}; schedules needs speed")
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if a.device != "cpu":
        torch_lib = subprocess.run([a.python, "-c", "import torch,os; print(os.path.dirname(torch.__file__)+'/lib')"], capture_output=True, text=True, check=True).stdout.strip()
        env["LD_LIBRARY_PATH"] = ":".join(p for p in [torch_lib, env.get("LD_LIBRARY_PATH")] if p)
    r = Runner(os.path.abspath(a.bin), env)
    table = Table()
    started = time.time()
    if "doctor" in checks:
        check_doctor(r, table, a.device)
    if "forward" in checks:
        check_forward(r, table, a.device, a.models)
    if "parity" in checks:
        check_parity(r, table, a.device, a.models, a.out)
    onnx = check_gpt2_speed(r, table, a.device, a.size, a.python, a.out) if "speed" in checks else None
    if onnx and "schedules" in checks:
        check_schedules(r, table, a.device, a.size, onnx, a.out)
    subset = "" if len(checks) == len(CHECKS) else f" --checks {a.checks}"
    text = table.markdown(a.device) + f"\nRun in {time.time() - started:.0f} s by `python3 scripts/gpu_acceptance.py --device {a.device} --size {a.size}{subset}`.\n"
    for path in [f"{a.out}/acceptance.md", a.table]:
        if path:
            with open(path, "w") as f:
                f.write(text)
    print(text)
    sys.exit(1 if table.failed() else 0)


if __name__ == "__main__":
    main()
