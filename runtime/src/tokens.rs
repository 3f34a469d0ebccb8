//! Token streams for language models: one flat array of token ids (the form nanoGPT's and
//! Megatron's recipes train on), cut into windows of the model's sequence length `T`.
//! Window `k` is tokens `k*T ..= k*T + T`: its first `T` are the ids fed to the model,
//! its last `T` the labels (each position predicts the next token).
//!
//! The file is a raw little-endian array of `u16` or `u32` ids (its type given), or a 1-D
//! `.npy` of unsigned or signed integers (its header says). It is never loaded or mapped
//! whole: each window is one positioned read, so memory is bounded by the batch whatever
//! the file's size, and the operating system's page cache (not the process) holds what
//! was read.
//!
//! Windows are visited in a seeded random order that is a function of the step alone (a
//! keyed bijection of the window indices, new every epoch), so no index of the file is
//! built and a resumed run continues the same order exactly; replicas and MPI ranks take
//! disjoint windows (they share each batch's microbatches). Each batch checks that the
//! file is still the one opened, and every id read that it is below the model's
//! vocabulary.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use pipewright_core::rng::SplitMix64;
use pipewright_core::{DataOrder, TokenType};
use tch::{Kind, Tensor};

use crate::build::InputSpec;
use crate::data::{npy_head, parse_npy_header, DataError, FileStamp, MicrobatchData};
use pipewright_ops::DType;

type Result<T> = std::result::Result<T, DataError>;

fn err(msg: String) -> DataError {
    DataError(msg)
}

/// How one token is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    U16,
    U32,
    I32,
    I64,
}

impl Elem {
    /// The element of a `.npy` token array's dtype string, if ids can be of that type.
    fn of_npy(descr: &str) -> Option<Elem> {
        match descr {
            "<u2" => Some(Elem::U16),
            "<u4" => Some(Elem::U32),
            "<i4" => Some(Elem::I32),
            "<i8" => Some(Elem::I64),
            _ => None,
        }
    }

    fn width(self) -> usize {
        match self {
            Elem::U16 => 2,
            Elem::U32 | Elem::I32 => 4,
            Elem::I64 => 8,
        }
    }

    fn decode(self, b: &[u8]) -> i64 {
        match self {
            Elem::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            Elem::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            Elem::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            Elem::I64 => i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
        }
    }
}

/// A token file opened for positioned reads.
pub struct TokenFile {
    path: PathBuf,
    file: File,
    /// Byte offset of the first token (a `.npy`'s header; 0 for a raw file).
    start: u64,
    elem: Elem,
    tokens: u64,
    stamp: FileStamp,
}

impl TokenFile {
    /// Opens `path`: a 1-D `.npy` of integers (its header gives the type; `given` must
    /// agree when set), or a raw file of `given` ids.
    pub fn open(path: &Path, given: Option<TokenType>) -> Result<TokenFile> {
        let shown = path.display();
        let file = File::open(path).map_err(|e| err(format!("{shown}: cannot open the token file: {e}")))?;
        let meta = file.metadata().map_err(|e| err(format!("{shown}: {e}")))?;
        let is_npy = path.extension().is_some_and(|e| e == "npy");
        let (start, elem) = if is_npy { npy_layout(&file, &shown.to_string(), given)? } else { raw_layout(&shown.to_string(), given)? };
        let bytes = meta.len().checked_sub(start).ok_or_else(|| err(format!("{shown}: shorter than its own header")))?;
        let width = elem.width() as u64;
        if bytes % width != 0 {
            return Err(err(format!(
                "{shown}: {bytes} bytes of tokens are not a whole number of {width}-byte tokens ({} left over): the file is truncated or its token type is not {}",
                bytes % width,
                type_name(elem)
            )));
        }
        Ok(TokenFile { path: path.to_path_buf(), file, start, elem, tokens: bytes / width, stamp: FileStamp::of(path, &meta) })
    }

    /// Tokens in the file.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Tokens `first .. first + n` (the caller checks [`TokenFile::stamp`] first).
    fn read(&self, first: u64, n: usize) -> Result<Vec<i64>> {
        let width = self.elem.width();
        let mut buf = vec![0u8; n * width];
        let at = self.start + first * width as u64;
        self.file.read_exact_at(&mut buf, at).map_err(|e| err(format!("{}: reading tokens {first}..{}: {e}", self.path.display(), first + n as u64)))?;
        Ok(buf.chunks_exact(width).map(|b| self.elem.decode(b)).collect())
    }
}

fn type_name(elem: Elem) -> &'static str {
    match elem {
        Elem::U16 => "u16",
        Elem::U32 => "u32",
        Elem::I32 => "i32 (.npy <i4)",
        Elem::I64 => "i64 (.npy <i8)",
    }
}

fn raw_layout(shown: &str, given: Option<TokenType>) -> Result<(u64, Elem)> {
    match given {
        Some(TokenType::U16) => Ok((0, Elem::U16)),
        Some(TokenType::U32) => Ok((0, Elem::U32)),
        None => Err(err(format!("{shown}: a raw token file needs its token type: give --tokens u16 or --tokens u32 (or save the ids as a 1-D .npy)"))),
    }
}

fn npy_layout(file: &File, shown: &str, given: Option<TokenType>) -> Result<(u64, Elem)> {
    let head = npy_head(file).map_err(|e| err(format!("{shown}: {e}")))?;
    let (descr, shape, start) = parse_npy_header(&head).map_err(|e| err(format!("{shown}: {e}")))?;
    if shape.len() != 1 {
        return Err(err(format!("{shown}: a token array must be 1-D (one flat run of ids), this one has shape {shape:?}")));
    }
    let elem = Elem::of_npy(&descr).ok_or_else(|| err(format!("{shown}: token ids of dtype `{descr}` are not supported (<u2, <u4, <i4, <i8 are)")))?;
    let agrees = match given {
        None => true,
        Some(TokenType::U16) => elem == Elem::U16,
        Some(TokenType::U32) => elem == Elem::U32,
    };
    if !agrees {
        return Err(err(format!("{shown}: --tokens {} but the .npy holds {}; drop --tokens (the header says the type)", given.map_or(String::new(), |t| t.to_string()), type_name(elem))));
    }
    Ok((start as u64, elem))
}

/// Whether `path` holds a token stream rather than named arrays: a `.bin` file, or a `.npy`
/// holding one 1-D array of integers (an array of per-sample inputs has a sample axis and
/// the input's own axes; a model input of one scalar per sample is the exception, so the
/// caller names those inputs in `scalar_inputs` and a `.npy` named after one is an array).
pub fn is_token_file(path: &Path, scalar_inputs: &[&str]) -> bool {
    let ext = path.extension().and_then(|e| e.to_str());
    if ext == Some("bin") {
        return true;
    }
    if ext != Some("npy") || !path.is_file() || path.file_stem().and_then(|s| s.to_str()).is_some_and(|s| scalar_inputs.contains(&s)) {
        return false;
    }
    let Ok(head) = File::open(path).and_then(|f| npy_head(&f)) else { return false };
    matches!(parse_npy_header(&head), Ok((d, shape, _)) if shape.len() == 1 && Elem::of_npy(&d).is_some())
}

/// How a stream fills one model input.
#[derive(Clone, Debug)]
enum Fill {
    /// The window's ids.
    Ids,
    /// All ones (an attention mask: every position is a real token).
    Ones,
    /// `0..T` in every row (position ids).
    Positions,
    /// All zeros (token type ids).
    Zeros,
}

/// Which input takes the ids and how every other is filled, and the sequence length.
fn plan_inputs(shown: &str, inputs: &[InputSpec]) -> Result<(Vec<(String, Kind, Fill)>, usize)> {
    let is_int = |s: &InputSpec| matches!(s.elem, DType::I64 | DType::I32);
    let ids = inputs
        .iter()
        .find(|s| s.name == "input_ids" && is_int(s))
        .or_else(|| inputs.iter().find(|s| is_int(s) && s.per_sample.len() == 1))
        .ok_or_else(|| err(format!("{shown}: a token stream feeds a model input of integer ids [batch, sequence], and this model has none (inputs: {})", names(inputs))))?;
    let seq = match ids.per_sample[..] {
        [t] if t > 0 => t as usize,
        _ => {
            return Err(err(format!(
                "{shown}: the model's input `{}` has no fixed sequence length (per sample {:?}); export it at a fixed length (the window a token stream cuts)",
                ids.name, ids.per_sample
            )))
        }
    };
    let mut plan = Vec::new();
    for s in inputs {
        let kind = crate::exec::torch_kind(s.elem).map_err(|e| err(format!("{shown}: input `{}`: {e}", s.name)))?;
        let fill = if s.name == ids.name {
            Fill::Ids
        } else if s.per_sample != [seq as i64] {
            return Err(err(format!(
                "{shown}: the model's input `{}` (per sample {:?}) is not one a token stream can fill (it fills the ids, and masks, position and token type ids of their shape [{seq}]); give the data as an .npz of named arrays instead",
                s.name, s.per_sample
            )));
        } else if s.name.contains("mask") {
            Fill::Ones
        } else if s.name.contains("position") {
            Fill::Positions
        } else if is_int(s) {
            Fill::Zeros
        } else {
            return Err(err(format!("{shown}: the model's float input `{}` is not one a token stream can fill; give the data as an .npz of named arrays instead", s.name)));
        };
        plan.push((s.name.clone(), kind, fill));
    }
    Ok((plan, seq))
}

fn names(inputs: &[InputSpec]) -> String {
    inputs.iter().map(|s| format!("`{}` {:?}{:?}", s.name, s.elem, s.per_sample)).collect::<Vec<_>>().join(", ")
}

/// The batches of a token stream for a model: [`TokenFile`] windows as the model's inputs
/// and next-token labels.
pub struct TokenWindows {
    file: TokenFile,
    plan: Vec<(String, Kind, Fill)>,
    seq: usize,
    /// Ids must be below this (the model's output classes), when known.
    vocab: Option<i64>,
    windows: u64,
    order: DataOrder,
    seed: u64,
    microbatch: usize,
    per_batch: usize,
    per_epoch: u64,
    total: usize,
    step: usize,
}

impl TokenWindows {
    /// The stream of `total` batches of `per_batch` microbatches of `microbatch` windows
    /// for a model with `inputs`, whose ids must be below `vocab`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(file: TokenFile, inputs: &[InputSpec], vocab: Option<i64>, order: DataOrder, seed: u64, microbatch: usize, per_batch: usize, total: usize) -> Result<TokenWindows> {
        let shown = file.path.display().to_string();
        let (plan, seq) = plan_inputs(&shown, inputs)?;
        let windows = file.tokens.saturating_sub(1) / seq as u64;
        let batch = (microbatch * per_batch) as u64;
        if batch == 0 {
            return Err(err(format!("{shown}: batches of {microbatch} x {per_batch} windows hold nothing")));
        }
        let per_epoch = windows / batch;
        if per_epoch == 0 {
            return Err(err(format!(
                "{shown}: {} tokens make {windows} window(s) of {seq} (+1 for the last label), fewer than one batch of {batch} ({per_batch} microbatches of {microbatch}); give a longer token file or a smaller --microbatch / --microbatches",
                file.tokens
            )));
        }
        Ok(TokenWindows { file, plan, seq, vocab, windows, order, seed, microbatch, per_batch, per_epoch, total, step: 0 })
    }

    /// Continues at batch `step` (a resumed run): nothing before it is read.
    pub fn starting_at(mut self, step: usize) -> Self {
        self.step = step.min(self.total);
        self
    }

    /// Windows in one epoch (each batch takes `microbatch * per_batch` of them).
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// The window at position `pos` of epoch `epoch`'s order.
    fn window_at(&self, epoch: u64, pos: u64) -> u64 {
        match self.order {
            DataOrder::Sequential => pos,
            DataOrder::Shuffle => permute(pos, self.windows, self.seed ^ epoch.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        }
    }

    /// Batch `step`'s microbatches, once the file is known to be the one opened (a stat
    /// per batch, not per window).
    fn batch(&self, step: usize) -> Result<Vec<MicrobatchData>> {
        self.file.stamp.check()?;
        let (epoch, within) = (step as u64 / self.per_epoch, step as u64 % self.per_epoch);
        let first = within * (self.microbatch * self.per_batch) as u64;
        (0..self.per_batch as u64)
            .map(|k| {
                let picks: Vec<u64> = (0..self.microbatch as u64).map(|j| self.window_at(epoch, first + k * self.microbatch as u64 + j)).collect();
                self.microbatch_of(&picks)
            })
            .collect()
    }

    /// The inputs and labels of windows `picks`.
    fn microbatch_of(&self, picks: &[u64]) -> Result<MicrobatchData> {
        let (b, t) = (picks.len() as i64, self.seq as i64);
        let mut ids = Vec::with_capacity(picks.len() * self.seq);
        let mut labels = Vec::with_capacity(picks.len() * self.seq);
        for &w in picks {
            let first = w * self.seq as u64;
            let tokens = self.file.read(first, self.seq + 1)?;
            self.check_vocab(first, &tokens)?;
            ids.extend_from_slice(&tokens[..self.seq]);
            labels.extend_from_slice(&tokens[1..]);
        }
        let ids = Tensor::from_slice(&ids).view([b, t]);
        let inputs = self
            .plan
            .iter()
            .map(|(name, kind, fill)| {
                let x = match fill {
                    Fill::Ids => ids.shallow_clone(),
                    Fill::Ones => Tensor::ones([b, t], (Kind::Int64, tch::Device::Cpu)),
                    Fill::Zeros => Tensor::zeros([b, t], (Kind::Int64, tch::Device::Cpu)),
                    Fill::Positions => Tensor::arange(t, (Kind::Int64, tch::Device::Cpu)).expand([b, t], false).contiguous(),
                };
                (name.clone(), x.to_kind(*kind))
            })
            .collect();
        Ok((inputs, Some(Tensor::from_slice(&labels).view([b, t]))))
    }

    fn check_vocab(&self, first: u64, tokens: &[i64]) -> Result<()> {
        let Some(vocab) = self.vocab else { return Ok(()) };
        match tokens.iter().position(|&x| x < 0 || x >= vocab) {
            None => Ok(()),
            Some(i) => {
                let at = first + i as u64;
                Err(err(format!(
                    "{}: token {} at offset {at} (token index; byte {}) is not an id of the model's vocabulary of {vocab}: tokenise the text with the model's own tokenizer",
                    self.file.path.display(),
                    tokens[i],
                    self.file.start + at * self.file.elem.width() as u64
                )))
            }
        }
    }
}

impl Iterator for TokenWindows {
    type Item = Result<Vec<MicrobatchData>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.step >= self.total {
            return None;
        }
        let out = self.batch(self.step);
        self.step += 1;
        Some(out)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.total - self.step;
        (left, Some(left))
    }
}

/// A keyed bijection of `0..n`: a 4-round Feistel network on the smallest even-bit domain
/// holding `n`, walked until it lands inside (at most 4 domain points per index, so a few
/// rounds on average). Nothing is stored: position `i` maps to its window directly.
fn permute(i: u64, n: u64, key: u64) -> u64 {
    let bits = (64 - (n.max(4) - 1).leading_zeros()).div_ceil(2) * 2;
    let half = bits / 2;
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = SplitMix64::new(r ^ key.rotate_left(16 * round as u32) ^ round).next_u64() & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_is_a_bijection_for_every_size() {
        for n in [1u64, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            for key in [0u64, 1, 0xdead_beef] {
                let mut seen = vec![false; n as usize];
                for i in 0..n {
                    let j = permute(i, n, key);
                    assert!(j < n && !seen[j as usize], "n {n} key {key}: {i} -> {j}");
                    seen[j as usize] = true;
                }
            }
        }
        // Different keys give different orders.
        let a: Vec<u64> = (0..100).map(|i| permute(i, 100, 1)).collect();
        let b: Vec<u64> = (0..100).map(|i| permute(i, 100, 2)).collect();
        assert_ne!(a, b);
    }

    const T: usize = 8;

    fn ids_input() -> Vec<InputSpec> {
        vec![
            InputSpec { name: "input_ids".into(), elem: DType::I64, per_sample: vec![T as i64] },
            InputSpec { name: "attention_mask".into(), elem: DType::I64, per_sample: vec![T as i64] },
            InputSpec { name: "position_ids".into(), elem: DType::I64, per_sample: vec![T as i64] },
        ]
    }

    /// A raw u32 file whose token at position i is i: a window's first id names it.
    fn counting_file(dir: &Path, tokens: u32) -> PathBuf {
        let path = dir.join("count.bin");
        let bytes: Vec<u8> = (0..tokens).flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(&path, bytes).expect("write tokens");
        path
    }

    fn stream(path: &Path, order: DataOrder, microbatch: usize, per_batch: usize, total: usize) -> TokenWindows {
        let file = TokenFile::open(path, Some(TokenType::U32)).expect("open");
        TokenWindows::new(file, &ids_input(), None, order, 5, microbatch, per_batch, total).expect("windows")
    }

    fn first_ids(batch: &[MicrobatchData]) -> Vec<i64> {
        batch.iter().flat_map(|(inputs, _)| (0..inputs[0].1.size()[0]).map(move |r| inputs[0].1.int64_value(&[r, 0]))).collect()
    }

    /// Over an epoch every window is drawn once (so replicas, which share each batch's
    /// microbatches, never see the same window); labels are the ids shifted by one; the
    /// mask is ones and the positions count; epochs differ in order; and a stream started
    /// at step k gives exactly the batches an uninterrupted one gives from k.
    #[test]
    fn windows_cover_the_file_once_per_epoch_and_resume_exactly() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = counting_file(dir.path(), 8 * 24 + 5);
        let (microbatch, per_batch) = (2, 3);
        let all: Vec<Vec<MicrobatchData>> = stream(&path, DataOrder::Shuffle, microbatch, per_batch, 8).map(|b| b.expect("batch")).collect();
        let windows = 24;
        let per_epoch = windows / (microbatch * per_batch);
        for epoch in all.chunks(per_epoch) {
            let mut firsts: Vec<i64> = epoch.iter().flat_map(|b| first_ids(b)).collect();
            firsts.sort();
            assert_eq!(firsts, (0..windows as i64).map(|w| w * T as i64).collect::<Vec<_>>());
        }
        assert_ne!(first_ids(&all[0]), first_ids(&all[per_epoch]), "a new order each epoch");
        let (inputs, labels) = &all[1][0];
        assert!(labels.as_ref().expect("labels").equal(&(&inputs[0].1 + 1)), "labels are the next tokens");
        assert_eq!(inputs[1].1.sum(Kind::Int64).int64_value(&[]), (microbatch * T) as i64, "mask of ones");
        assert_eq!(inputs[2].1.int64_value(&[1, 5]), 5, "positions");
        let resumed: Vec<Vec<MicrobatchData>> = stream(&path, DataOrder::Shuffle, microbatch, per_batch, 8).starting_at(5).map(|b| b.expect("batch")).collect();
        assert_eq!(resumed.len(), 3);
        for (a, b) in all[5..].iter().zip(&resumed) {
            assert_eq!(first_ids(a), first_ids(b));
        }
        let sequential: Vec<i64> = stream(&path, DataOrder::Sequential, microbatch, per_batch, 1).flat_map(|b| first_ids(&b.expect("batch"))).collect();
        assert_eq!(sequential, (0..6).map(|w| w * T as i64).collect::<Vec<_>>());
    }

    #[test]
    fn a_file_changed_or_vanished_during_the_run_stops_it_naming_the_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = counting_file(dir.path(), 8 * 24 + 5);
        let mut s = stream(&path, DataOrder::Shuffle, 2, 3, 8);
        s.next().expect("one").expect("first batch reads");
        std::fs::OpenOptions::new().append(true).open(&path).and_then(|mut f| std::io::Write::write_all(&mut f, &[0; 4])).expect("append");
        let e = s.next().expect("two").err().expect("the grown file is refused").to_string();
        assert!(e.contains("count.bin: the data file changed during the run (its size went from 788 to 792 bytes)") && e.contains("--resume"), "{e}");
        std::fs::remove_file(&path).expect("remove");
        let e = s.next().expect("three").err().expect("the vanished file is refused").to_string();
        assert!(e.contains("count.bin: the data file vanished during the run") && e.contains("restore it"), "{e}");
    }

    #[test]
    fn inputs_a_stream_cannot_fill_are_refused_by_name() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = counting_file(dir.path(), 1000);
        let file = || TokenFile::open(&path, Some(TokenType::U32)).expect("open");
        let pixels = vec![InputSpec { name: "pixels".into(), elem: DType::F32, per_sample: vec![3, 4, 4] }];
        let e = TokenWindows::new(file(), &pixels, None, DataOrder::Shuffle, 0, 1, 1, 1).err().expect("no ids input").to_string();
        assert!(e.contains("a token stream feeds a model input of integer ids [batch, sequence], and this model has none (inputs: `pixels`"), "{e}");
        let dynamic = vec![InputSpec { name: "input_ids".into(), elem: DType::I64, per_sample: vec![-1] }];
        let e = TokenWindows::new(file(), &dynamic, None, DataOrder::Shuffle, 0, 1, 1, 1).err().expect("no length").to_string();
        assert!(e.contains("the model's input `input_ids` has no fixed sequence length"), "{e}");
        let mut extra = ids_input();
        extra.push(InputSpec { name: "pixel_values".into(), elem: DType::F32, per_sample: vec![T as i64] });
        let e = TokenWindows::new(file(), &extra, None, DataOrder::Shuffle, 0, 1, 1, 1).err().expect("float input").to_string();
        assert!(e.contains("the model's float input `pixel_values` is not one a token stream can fill"), "{e}");
    }
}
