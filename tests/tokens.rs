//! Training language models on token streams (`train --data tokens.bin --tokens u16`, or
//! a 1-D `.npy`): windows of the model's sequence length with next-token labels, resumed
//! bit for bit, bounded memory over files larger than the machine's memory (token streams
//! and mapped `.npy` arrays alike), and the bad files each refused with a message that
//! names the file and what to do.

mod common;

use std::path::{Path, PathBuf};

use common::{fails, model, ok, pw, pw_ok, python};

/// gpt2-tiny's sequence length and vocabulary (its `input_ids` [N, 32], logits [N, 32, 1000]).
const T: usize = 32;
const VOCAB: u16 = 1000;

fn compile_gpt2(dir: &Path, schedule: &str) -> PathBuf {
    let build = dir.join(format!("gpt2-{schedule}"));
    pw_ok(["compile", model("gpt2-tiny").to_str().unwrap(), "--stages", "2", "--schedule", schedule, "-o", build.to_str().unwrap()]);
    build
}

/// `n` u16 ids below the vocabulary, from a fixed sequence (a small LCG), with `bad` put
/// in at the given positions.
fn token_file(path: &Path, n: usize, bad: &[(usize, u16)]) {
    let mut x: u32 = 12345;
    let mut ids: Vec<u16> = (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            ((x >> 16) % VOCAB as u32) as u16
        })
        .collect();
    for &(at, id) in bad {
        ids[at] = id;
    }
    std::fs::write(path, ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>()).expect("write tokens");
}

fn train<'a>(build: &'a Path, data: &'a Path, steps: &'a str, extra: &[&'a str]) -> std::process::Output {
    let mut args = vec!["train", build.to_str().unwrap(), "--data", data.to_str().unwrap(), "--tokens", "u16", "--steps", steps];
    args.extend(["--microbatch", "2", "--microbatches", "2", "--optimizer", "adam", "--lr", "1e-3", "--no-progress"]);
    args.extend_from_slice(extra);
    pw(&args)
}

/// Under every schedule: the loss falls on a token stream, and a run resumed from a
/// checkpoint ends with the uninterrupted run's weights, bit for bit (the window order is
/// a function of the step).
#[test]
fn a_token_stream_trains_and_resumes_bit_identically_under_every_schedule() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("tokens.bin");
    token_file(&data, 40 * (T + 1), &[]);
    for schedule in ["2bw", "flush", "gpipe"] {
        let build = compile_gpt2(dir.path(), schedule);
        let out = ok(&train(&build, &data, "6", &["--checkpoint-every", "3"]));
        assert!(out.contains("trained 6 steps"), "{schedule}: {out}");
        let weights = build.join("weights.safetensors");
        let uninterrupted = std::fs::read(&weights).expect("weights written");
        std::fs::remove_file(&weights).expect("remove");
        let step3 = build.join("checkpoints/step-000003");
        ok(&train(&build, &data, "6", &["--resume", step3.to_str().unwrap()]));
        assert!(std::fs::read(&weights).expect("weights written") == uninterrupted, "{schedule}: the resumed run's weights differ");
        // Another order is other data: the checkpoint refuses it by name.
        let out = train(&build, &data, "6", &["--resume", step3.to_str().unwrap(), "--data-order", "sequential"]);
        fails(&out, &["this run differs from the one that wrote the checkpoint: --data", "sequential order, u16 tokens (this run)"]);
    }
}

/// A 1-D `.npy` of ids is a token stream without `--tokens`, and gives the same run as the
/// raw file of the same ids.
#[test]
fn a_one_dimensional_npy_is_the_same_stream() {
    let dir = tempfile::tempdir().expect("temp dir");
    let raw = dir.path().join("tokens.bin");
    token_file(&raw, 20 * (T + 1), &[]);
    let ids = std::fs::read(&raw).expect("read");
    let mut npy = npy_header("<u2", &[ids.len() as u64 / 2]);
    npy.extend(&ids);
    let npy_path = dir.path().join("tokens.npy");
    std::fs::write(&npy_path, npy).expect("write npy");
    let build = compile_gpt2(dir.path(), "2bw");
    let from_raw = ok(&train(&build, &raw, "3", &[]));
    let from_npy = ok(&pw(["train", build.to_str().unwrap(), "--data", npy_path.to_str().unwrap(), "--steps", "3", "--microbatch", "2", "--microbatches", "2", "--optimizer", "adam", "--lr", "1e-3", "--no-progress"]));
    let loss = |out: &str| out.lines().find(|l| l.starts_with("trained")).map(|l| l.split(": loss").nth(1).unwrap_or("").to_string()).expect("summary");
    assert_eq!(loss(&from_raw), loss(&from_npy));
}

/// A file far larger than this machine's memory (sparse: it costs no disk) trains with
/// the process's peak resident memory far below the file's size.
#[test]
fn a_token_file_larger_than_memory_trains_in_bounded_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("huge.bin");
    let size: u64 = 4 * memory_bytes().max(16 << 30);
    std::fs::File::create(&data).and_then(|f| f.set_len(size)).expect("sparse file");
    let build = compile_gpt2(dir.path(), "2bw");
    let out = ok(&train(&build, &data, "5", &[]));
    let peak = out.lines().find_map(|l| l.strip_prefix("peak resident memory of this process: ")).expect("the summary says the peak");
    let peak_bytes = parse_size(peak);
    assert!(peak_bytes < 2 << 30, "peak resident memory {peak} over a {size}-byte file");
}

/// A folder of `.npy` arrays (the digits MLP's `input` [N, 64] f32 and `label` [N] i64)
/// of several GiB, sparse, and the same in one `.safetensors` file and in one stored
/// `.npz` archive: the arrays are mapped, so the run's memory stays far below.
#[test]
fn npy_and_safetensors_arrays_larger_than_memory_train_in_bounded_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("arrays");
    std::fs::create_dir(&data).expect("folder");
    let n: u64 = 16 << 20;
    for (name, descr, shape, width) in [("input", "<f4", vec![n, 64], 4u64 * 64), ("label", "<i8", vec![n], 8)] {
        let head = npy_header(descr, &shape);
        let path = data.join(format!("{name}.npy"));
        std::fs::write(&path, &head).expect("header");
        std::fs::OpenOptions::new().write(true).open(&path).and_then(|f| f.set_len(head.len() as u64 + n * width)).expect("sparse data");
    }
    // The same arrays in one sparse .safetensors file (8-byte length, JSON header padded
    // to 8 bytes, the data).
    let st = dir.path().join("arrays.safetensors");
    let (a, b) = (n * 4 * 64, n * 4 * 64 + n * 8);
    let mut header = format!(
        r#"{{"input":{{"dtype":"F32","shape":[{n},64],"data_offsets":[0,{a}]}},"label":{{"dtype":"I64","shape":[{n}],"data_offsets":[{a},{b}]}}}}"#
    );
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut head = (header.len() as u64).to_le_bytes().to_vec();
    head.extend(header.bytes());
    std::fs::write(&st, &head).expect("header");
    std::fs::OpenOptions::new().write(true).open(&st).and_then(|f| f.set_len(head.len() as u64 + b)).expect("sparse data");
    // And as a stored .npz, written as numpy's savez writes one (zip64 entries).
    let npz = dir.path().join("arrays.npz");
    sparse_npz(&npz, &[("input.npy", npy_header("<f4", &[n, 64]), n * 4 * 64), ("label.npy", npy_header("<i8", &[n]), n * 8)]);
    let build = dir.path().join("mlp");
    pw_ok(["compile", model("mlp").to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    for data in [&data, &st, &npz] {
        let out = ok(&pw(["train", build.to_str().unwrap(), "--data", data.to_str().unwrap(), "--output", "linear_3", "--steps", "5", "--microbatch", "16", "--microbatches", "4", "--no-progress"]));
        let peak = out.lines().find_map(|l| l.strip_prefix("peak resident memory of this process: ")).expect("the summary says the peak");
        assert!(parse_size(peak) < 1536 << 20, "{}: peak resident memory {peak} over {b} bytes of arrays", data.display());
    }
}

/// A stored (uncompressed) zip of `members` (name, `.npy` header, bytes of zeros after
/// it), the data left as holes of a sparse file; zip64 entries, as numpy writes them.
fn sparse_npz(path: &Path, members: &[(&str, Vec<u8>, u64)]) {
    let (mut out, mut central) = (Vec::new(), Vec::new());
    let mut at = 0u64;
    let u16s = |v: &mut Vec<u8>, xs: &[u16]| xs.iter().for_each(|x| v.extend(x.to_le_bytes()));
    let u32s = |v: &mut Vec<u8>, xs: &[u32]| xs.iter().for_each(|x| v.extend(x.to_le_bytes()));
    let u64s = |v: &mut Vec<u8>, xs: &[u64]| xs.iter().for_each(|x| v.extend(x.to_le_bytes()));
    let file = std::fs::File::create(path).expect("create");
    for (name, head, zeros) in members {
        let size = head.len() as u64 + zeros;
        let crc = crc_of_zeros_after(head, *zeros);
        let mut local = Vec::new();
        u32s(&mut local, &[0x0403_4b50]);
        u16s(&mut local, &[45, 0, 0, 0, 0x21]);
        u32s(&mut local, &[crc, u32::MAX, u32::MAX]);
        u16s(&mut local, &[name.len() as u16, 20]);
        local.extend(name.bytes());
        u16s(&mut local, &[1, 16]);
        u64s(&mut local, &[size, size]);
        let mut entry = Vec::new();
        u32s(&mut entry, &[0x0201_4b50]);
        u16s(&mut entry, &[45, 45, 0, 0, 0, 0x21]);
        u32s(&mut entry, &[crc, u32::MAX, u32::MAX]);
        u16s(&mut entry, &[name.len() as u16, 28, 0, 0, 0]);
        u32s(&mut entry, &[0, u32::MAX]);
        entry.extend(name.bytes());
        u16s(&mut entry, &[1, 24]);
        u64s(&mut entry, &[size, size, at]);
        central.extend(entry);
        std::os::unix::fs::FileExt::write_all_at(&file, &local, at).expect("local header");
        std::os::unix::fs::FileExt::write_all_at(&file, head, at + local.len() as u64).expect(".npy header");
        at += local.len() as u64 + size;
    }
    let (cd_at, cd_len, count) = (at, central.len() as u64, members.len() as u64);
    out.extend(central);
    u32s(&mut out, &[0x0606_4b50]);
    u64s(&mut out, &[44]);
    u16s(&mut out, &[45, 45]);
    u32s(&mut out, &[0, 0]);
    u64s(&mut out, &[count, count, cd_len, cd_at]);
    u32s(&mut out, &[0x0706_4b50, 0]);
    u64s(&mut out, &[cd_at + cd_len]);
    u32s(&mut out, &[1, 0x0605_4b50]);
    u16s(&mut out, &[0, 0, u16::MAX, u16::MAX]);
    u32s(&mut out, &[u32::MAX, u32::MAX]);
    u16s(&mut out, &[0]);
    std::os::unix::fs::FileExt::write_all_at(&file, &out, at).expect("central directory");
}

/// The CRC-32 of `head` followed by `zeros` zero bytes, in time logarithmic in `zeros`.
fn crc_of_zeros_after(head: &[u8], zeros: u64) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    crc.update(head);
    let mut block = crc32fast::Hasher::new();
    block.update(&[0]);
    let mut left = zeros;
    // `block` holds the CRC of 2^k zero bytes; appended wherever bit k of `zeros` is set.
    while left > 0 {
        if left & 1 == 1 {
            crc.combine(&block);
        }
        let doubled = block.clone();
        block.combine(&doubled);
        left >>= 1;
    }
    crc.finalize()
}

/// A deflated `.npz` (numpy's `savez_compressed`) of 2 GiB of arrays: a compressed member
/// cannot be read at random, so it is inflated in chunks into a scratch file and mapped,
/// and the run's memory stays far below the arrays' size.
#[test]
fn a_deflated_npz_of_gigabytes_trains_in_bounded_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let npz = dir.path().join("compressed.npz");
    let script = "import sys, numpy as np\nn = 8 << 20\nnp.savez_compressed(sys.argv[1], input=np.zeros((n, 64), np.float32), label=np.zeros(n, np.int64))";
    let out = std::process::Command::new(python()).arg("-c").arg(script).arg(&npz).output().expect("python runs");
    assert!(out.status.success(), "numpy: {}", String::from_utf8_lossy(&out.stderr));
    let build = dir.path().join("mlp");
    pw_ok(["compile", model("mlp").to_str().unwrap(), "--stages", "2", "-o", build.to_str().unwrap()]);
    let out = ok(&pw(["train", build.to_str().unwrap(), "--data", npz.to_str().unwrap(), "--output", "linear_3", "--steps", "5", "--microbatch", "16", "--microbatches", "4", "--no-progress"]));
    let peak = out.lines().find_map(|l| l.strip_prefix("peak resident memory of this process: ")).expect("the summary says the peak");
    assert!(parse_size(peak) < 1 << 30, "peak resident memory {peak} over 2 GiB of deflated arrays");
}

/// A version 1.0 `.npy` header for an array of `descr` and `shape` (data to follow),
/// padded as numpy pads it.
fn npy_header(descr: &str, shape: &[u64]) -> Vec<u8> {
    let dims = match shape {
        [one] => format!("{one},"),
        _ => shape.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
    };
    let header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({dims}), }}");
    let pad = 64 - (10 + header.len() + 1) % 64;
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend(((header.len() + pad + 1) as u16).to_le_bytes());
    out.extend(header.bytes().chain(std::iter::repeat_n(b' ', pad)).chain([b'\n']));
    out
}

fn memory_bytes() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    info.lines().find_map(|l| l.strip_prefix("MemTotal:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).map_or(0, |k| k * 1024)
}

/// A size as the summary prints it (`312.5 MiB`).
fn parse_size(s: &str) -> u64 {
    pipewright_core::units::parse_bytes(s).unwrap_or_else(|e| panic!("{e}"))
}

/// Each bad token file is refused with a message naming it and what to do; an id out of
/// the vocabulary found mid-run stops the run before that step's update, leaving the
/// checkpoints already written whole (a resume from one runs up to the bad window again).
#[test]
fn bad_token_files_are_refused_naming_the_file_and_what_to_do() {
    let dir = tempfile::tempdir().expect("temp dir");
    let build = compile_gpt2(dir.path(), "2bw");
    let good = dir.path().join("good.bin");
    token_file(&good, 40 * (T + 1), &[]);
    let out = pw(["train", build.to_str().unwrap(), "--data", good.to_str().unwrap(), "--steps", "2"]);
    fails(&out, &["good.bin: a raw token file needs its token type: give --tokens u16 or --tokens u32"]);

    let odd = dir.path().join("odd.bin");
    std::fs::write(&odd, vec![0u8; 2 * 40 * T + 1]).expect("write");
    fails(&train(&build, &odd, "2", &[]), &["odd.bin: 2561 bytes of tokens are not a whole number of 2-byte tokens (1 left over)"]);

    let short = dir.path().join("short.bin");
    token_file(&short, 3 * T, &[]);
    fails(&train(&build, &short, "2", &[]), &["short.bin: 96 tokens make 2 window(s) of 32", "fewer than one batch of 4", "give a longer token file"]);

    fails(&train(&build, &good, "2", &["--label", "y"]), &["--label y: a token stream's labels are its next tokens; drop --label"]);

    // Sequential order: steps 0-5 read windows 0-23; window 25 (step 6) holds id 1000.
    // The data is read at most two steps ahead, so the checkpoints of steps 2 and 4 are
    // written before the bad window is met.
    let bad = dir.path().join("bad.bin");
    let at = 25 * T + 5;
    token_file(&bad, 40 * (T + 1), &[(at, VOCAB)]);
    let ckpts = dir.path().join("ck");
    let out = train(&build, &bad, "8", &["--data-order", "sequential", "--checkpoint-every", "2", "--checkpoint-dir", ckpts.to_str().unwrap()]);
    fails(&out, &[&format!("bad.bin: token 1000 at offset {at} (token index; byte {})", 2 * at), "vocabulary of 1000", "tokenise the text with the model's own tokenizer"]);
    assert!(!build.join("weights.safetensors").exists(), "a failed run wrote weights");
    let mut steps: Vec<String> = std::fs::read_dir(&ckpts).expect("checkpoints").flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| !n.starts_with(".pipewright")).collect();
    steps.sort();
    assert!(steps.starts_with(&["step-000002".to_string(), "step-000004".to_string()]) && steps.len() <= 3, "checkpoints {steps:?}");
    for step in &steps {
        assert!(ckpts.join(step).join("checkpoint.json").is_file(), "{step} is whole");
    }
    let out = train(&build, &bad, "8", &["--data-order", "sequential", "--resume", ckpts.join("step-000004").to_str().unwrap()]);
    fails(&out, &["bad.bin: token 1000 at offset"]);
}
