//! Stage module files: one self-contained file per pipeline stage.
//!
//! A module is a fixed 64-byte header, the stage [`Program`] as JSON (without weight
//! bytes), and the weights in safetensors layout. The byte layout, naming, checksum and
//! versioning policy are documented in `docs/module-format.md`.
//!
//! [`read_module`] / [`decode_module`] load a module and check it (magic, version, section
//! lengths, checksum, program, weights), in that order, with one [`ModuleErrorKind`] per
//! kind of failure. [`encode`] is the byte encoder; codegen's `write_module` wraps it with
//! an atomic file write. The encoder lives here, next to the reader, so the two cannot
//! drift, and so a runtime can re-save a stage (e.g. trained weights) without codegen.
//!
//! Plain Rust: builds without libtorch.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use safetensors::tensor::{Dtype, SafeTensors};
use pipewright_core::{Recompute, Schedule};
use serde::{Deserialize, Serialize};

use pipewright_ops::DType;
use crate::program::{Program, SlotId, Stored};

/// The first 8 bytes of every stage module.
pub const MAGIC: [u8; 8] = *b"PWMODULE";
/// The format version this crate writes, and the only one it reads. Version 3: each
/// instruction carries the IR's op (`pipewright-ops`) under `op`, not a runtime kernel.
pub const FORMAT_VERSION: u32 = 3;
/// Length of the fixed header in bytes; the program section starts right after it.
pub const HEADER_LEN: usize = 64;
/// The weights section starts at a multiple of this (zero padding before it).
pub const WEIGHTS_ALIGN: usize = 8;

// Byte offsets of the header fields (all integers little-endian).
const OFF_VERSION: usize = 8;
const OFF_STAGE: usize = 12;
const OFF_DEPTH: usize = 16;
const OFF_SCHEDULE: usize = 20;
const OFF_RECOMPUTE: usize = 21;
const OFF_CHECKSUM: usize = 24;
const OFF_PROGRAM: usize = 32;
const OFF_WEIGHTS: usize = 48;

/// The header code of a schedule (byte 20).
fn schedule_code(s: Schedule) -> u8 {
    match s {
        Schedule::TwoBw => 0,
        Schedule::Flush => 1,
        Schedule::GPipe => 2,
        Schedule::ZbH1 => 3,
        Schedule::Interleaved2 => 4,
        Schedule::Interleaved4 => 5,
        Schedule::ZbV => 6,
        Schedule::ZbH2 => 7,
    }
}

/// The header code of a recompute mode (byte 21).
fn recompute_code(r: Recompute) -> u8 {
    match r {
        Recompute::None => 0,
        Recompute::Full => 1,
        Recompute::Selective => 2,
    }
}

fn schedule_of_code(code: u8) -> Option<Schedule> {
    Schedule::ALL.iter().copied().find(|&s| schedule_code(s) == code)
}

fn recompute_of_code(code: u8) -> Option<Recompute> {
    Recompute::ALL.iter().copied().find(|&r| recompute_code(r) == code)
}

/// What the writer says about the stage: the header fields that are not layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StageParams {
    /// 0-based index of this stage in the pipeline.
    pub stage: u32,
    /// Number of stages in the pipeline (`stage < depth`).
    pub depth: u32,
    pub schedule: Schedule,
    pub recompute: Recompute,
}

/// A byte range of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Section {
    pub offset: u64,
    pub len: u64,
}

impl Section {
    /// One past the last byte; `None` on overflow.
    pub fn end(self) -> Option<u64> {
        self.offset.checked_add(self.len)
    }
}

/// The decoded fixed header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModuleHeader {
    pub version: u32,
    pub params: StageParams,
    /// CRC-32 (IEEE) of the whole file with this field read as zero.
    pub checksum: u32,
    pub program: Section,
    pub weights: Section,
}

/// A loaded stage module. `program.stored[i].bytes` are slices of the file's buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct StageModule {
    pub header: ModuleHeader,
    pub program: Program,
}

/// Why a module could not be read or written; `path` is the file when one is involved.
#[derive(Debug)]
pub struct ModuleError {
    pub path: Option<PathBuf>,
    pub kind: ModuleErrorKind,
}

impl ModuleError {
    pub fn new(kind: ModuleErrorKind) -> Self {
        ModuleError { path: None, kind }
    }

    /// The same error, naming `path` (kept if a path is already set).
    pub fn at(mut self, path: impl AsRef<Path>) -> Self {
        if self.path.is_none() {
            self.path = Some(path.as_ref().to_path_buf());
        }
        self
    }

    pub fn kind(&self) -> &ModuleErrorKind {
        &self.kind
    }
}

impl From<ModuleErrorKind> for ModuleError {
    fn from(kind: ModuleErrorKind) -> Self {
        ModuleError::new(kind)
    }
}

impl fmt::Display for ModuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "stage module {}: {}", p.display(), self.kind),
            None => write!(f, "stage module: {}", self.kind),
        }
    }
}

impl std::error::Error for ModuleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.kind)
    }
}

/// The kinds of [`ModuleError`]. Messages say what is wrong, not where (see `path`).
#[derive(Debug, thiserror::Error)]
pub enum ModuleErrorKind {
    /// Opening, reading, writing or renaming the file failed.
    #[error("cannot {op}: {source}")]
    Io { op: &'static str, #[source] source: std::io::Error },
    /// The file does not start with [`MAGIC`]. The message does not show what it starts
    /// with: a file that is not a module may be anything, and is not printed.
    #[error("not a pipewright stage module: it does not start with {}", show_bytes(&MAGIC))]
    NotAModule { found: Vec<u8> },
    /// The file is shorter than the header or than a section the header declares.
    #[error("truncated: the {what} needs {needed} bytes but the file has {len} bytes")]
    Truncated { what: &'static str, needed: u64, len: u64 },
    #[error(
        "unsupported format version {found} (this pipewright reads version {supported}); \
         recompile the model with this pipewright"
    )]
    UnsupportedVersion { found: u32, supported: u32 },
    /// The content does not hash to the header's checksum: the file is corrupt.
    #[error("checksum mismatch: the header says {expected:#010x} but the content hashes to {found:#010x}; the file is corrupt")]
    ChecksumMismatch { expected: u32, found: u32 },
    /// A header field is out of range or the sections are inconsistent (checksum was fine,
    /// so the writer produced it), or the stage parameters given to the writer are invalid.
    #[error("bad header: {0}")]
    BadHeader(String),
    /// The program section is not a valid program (JSON error or a dangling slot), or a
    /// program cannot be encoded faithfully.
    #[error("bad program section: {0}")]
    BadProgram(String),
    /// The weights section is not valid safetensors, or does not match the program's
    /// stored tensors (missing, extra, wrong dtype, shape or size).
    #[error("bad weights section: {0}")]
    BadWeights(String),
}

fn show_bytes(b: &[u8]) -> String {
    let mut s = String::from("b\"");
    for &c in b {
        s.extend(std::ascii::escape_default(c).map(char::from));
    }
    s.push('"');
    s
}

type Result<T> = std::result::Result<T, ModuleError>;

fn err<T>(kind: ModuleErrorKind) -> Result<T> {
    Err(ModuleError::new(kind))
}

/// Whether `path` names a stage module: a `.pwm` file, or one starting with [`MAGIC`] (or
/// a prefix of it: a truncated module, which [`read_module`] then reports).
pub fn looks_like_module(path: &Path) -> bool {
    use std::io::Read;
    if path.extension().is_some_and(|e| e == "pwm") {
        return true;
    }
    let mut head = Vec::with_capacity(8);
    let Ok(f) = std::fs::File::open(path) else { return false };
    if f.take(8).read_to_end(&mut head).is_err() {
        return false;
    }
    !head.is_empty() && MAGIC.starts_with(&head)
}

/// The safetensors dtype of an element type. safetensors has no float8: those (one byte
/// each) are stored as u8 bytes, read back by the program's element type; the packed 4/2-bit
/// types take their holder's dtype (codegen stores them unpacked).
pub fn dtype_of(e: DType) -> Dtype {
    match e {
        DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ | DType::F8E8M0 => Dtype::U8,
        DType::U4 | DType::I4 | DType::F4E2M1 | DType::U2 | DType::I2 => dtype_of(e.holder()),
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::Bf16 => Dtype::BF16,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::I16 => Dtype::I16,
        DType::I8 => Dtype::I8,
        DType::U8 => Dtype::U8,
        DType::U16 => Dtype::U16,
        DType::U32 => Dtype::U32,
        DType::U64 => Dtype::U64,
        DType::Bool => Dtype::BOOL,
    }
}

/// The element type of a safetensors dtype; `None` for dtypes libtorch lacks.
pub fn elem_of_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::Bf16,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        _ => return None,
    })
}

/// The safetensors tensor name of a stored slot (`s12`).
pub fn tensor_name(slot: SlotId) -> String {
    slot.to_string()
}

fn slot_name(p: &Program, slot: SlotId) -> &str {
    p.slots.get(slot.index()).map_or("?", |s| s.name.as_str())
}

fn describe(p: &Program, s: &Stored) -> String {
    format!("stored tensor {} ({:?})", s.slot, slot_name(p, s.slot))
}

/// Element count and byte size of a stored tensor, checking the dims.
fn stored_size(p: &Program, s: &Stored) -> std::result::Result<(Vec<usize>, usize), String> {
    let mut shape = Vec::with_capacity(s.dims.len());
    let mut n: usize = 1;
    for &d in &s.dims {
        let d = usize::try_from(d).map_err(|_| format!("{} has a negative dim in {:?}", describe(p, s), s.dims))?;
        n = n.checked_mul(d).ok_or_else(|| format!("{} is too large: {:?}", describe(p, s), s.dims))?;
        shape.push(d);
    }
    let size = s
        .elem
        .byte_len(n)
        .ok_or_else(|| format!("{} is too large: {:?}", describe(p, s), s.dims))?;
    Ok((shape, size))
}

fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u32(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().unwrap())
}

fn get_u64(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().unwrap())
}

/// CRC-32 of the whole file with the checksum field read as zero.
fn checksum(file: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&file[..OFF_CHECKSUM]);
    h.update(&[0; 4]);
    h.update(&file[OFF_CHECKSUM + 4..]);
    h.finalize()
}

fn check_params(p: &StageParams) -> std::result::Result<(), String> {
    if p.depth == 0 {
        return Err("pipeline depth is 0".into());
    }
    if p.stage >= p.depth {
        return Err(format!("stage index {} is not below the pipeline depth {}", p.stage, p.depth));
    }
    Ok(())
}

/// Encodes a stage module. Fails when the parameters are invalid, when a stored tensor's
/// bytes do not match its dtype and dims (or two share a slot), or when the program does
/// not survive its JSON encoding unchanged (e.g. a NaN or infinite float attribute, which
/// JSON cannot represent).
pub fn encode(params: &StageParams, program: &Program) -> Result<Vec<u8>> {
    Ok(encode_parts(params, program)?.to_vec())
}

/// A stage module ready to be written: everything before the weights, then the weights
/// themselves still borrowed from the program, so that writing a module of any size needs
/// no second copy of its weights.
#[derive(Debug)]
pub struct EncodedModule<'a> {
    /// Header, program, padding and the safetensors header, checksum filled in.
    head: Vec<u8>,
    weights: Vec<&'a [u8]>,
}

impl EncodedModule<'_> {
    /// The module's size in bytes.
    pub fn len(&self) -> usize {
        self.head.len() + self.weights.iter().map(|w| w.len()).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes the module's bytes to `out`.
    pub fn write_to(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        out.write_all(&self.head)?;
        for w in &self.weights {
            out.write_all(w)?;
        }
        Ok(())
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&self.head);
        for w in &self.weights {
            out.extend_from_slice(w);
        }
        out
    }
}

/// [`encode`] without assembling the file: see [`EncodedModule`].
pub fn encode_parts<'a>(params: &StageParams, program: &'a Program) -> Result<EncodedModule<'a>> {
    check_params(params).map_err(|m| ModuleError::new(ModuleErrorKind::BadHeader(m)))?;
    let json = program_json(program)?;
    let tensors = checked_tensors(program)?;
    let (weights_head, order) = safetensors_head(program, &tensors);
    let weights: Vec<&[u8]> = order.iter().map(|&i| &tensors[i].0.bytes[..]).collect();
    let weights_len = weights_head.len() + weights.iter().map(|w| w.len()).sum::<usize>();
    // Layout.
    let program_off = HEADER_LEN;
    let weights_off = (program_off + json.len()).next_multiple_of(WEIGHTS_ALIGN);
    let mut head = vec![0u8; weights_off + weights_head.len()];
    head[..8].copy_from_slice(&MAGIC);
    put_u32(&mut head, OFF_VERSION, FORMAT_VERSION);
    put_u32(&mut head, OFF_STAGE, params.stage);
    put_u32(&mut head, OFF_DEPTH, params.depth);
    head[OFF_SCHEDULE] = schedule_code(params.schedule);
    head[OFF_RECOMPUTE] = recompute_code(params.recompute);
    put_u64(&mut head, OFF_PROGRAM, program_off as u64);
    put_u64(&mut head, OFF_PROGRAM + 8, json.len() as u64);
    put_u64(&mut head, OFF_WEIGHTS, weights_off as u64);
    put_u64(&mut head, OFF_WEIGHTS + 8, weights_len as u64);
    head[program_off..program_off + json.len()].copy_from_slice(&json);
    head[weights_off..].copy_from_slice(&weights_head);
    // The checksum covers the file with its own field read as zero, as it is now.
    let mut h = crc32fast::Hasher::new();
    h.update(&head);
    for w in &weights {
        h.update(w);
    }
    put_u32(&mut head, OFF_CHECKSUM, h.finalize());
    Ok(EncodedModule { head, weights })
}

/// The program section, checked to decode back to the same program.
fn program_json(program: &Program) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(program)
        .map_err(|e| ModuleError::new(ModuleErrorKind::BadProgram(format!("cannot encode as JSON: {e}"))))?;
    let mut bare = program.clone();
    for s in &mut bare.stored {
        s.bytes = Bytes::new();
    }
    match serde_json::from_slice::<Program>(&json) {
        Ok(back) if back == bare => Ok(json),
        Ok(_) => err(ModuleErrorKind::BadProgram(
            "the program does not survive JSON unchanged (a NaN or infinite float attribute?)".into(),
        )),
        Err(e) => err(ModuleErrorKind::BadProgram(format!(
            "the program does not survive JSON (a NaN or infinite float attribute?): {e}"
        ))),
    }
}

/// Every stored tensor with its shape, after checking its slot and its size.
fn checked_tensors(program: &Program) -> Result<Vec<(&Stored, Vec<usize>)>> {
    let mut seen = BTreeSet::new();
    let mut tensors = Vec::with_capacity(program.stored.len());
    for s in &program.stored {
        if s.slot.index() >= program.slots.len() {
            return err(ModuleErrorKind::BadProgram(format!(
                "stored tensor {} names a slot past the program's {} slots",
                s.slot,
                program.slots.len()
            )));
        }
        if !seen.insert(s.slot) {
            return err(ModuleErrorKind::BadWeights(format!("{} is stored twice", describe(program, s))));
        }
        let (shape, size) = stored_size(program, s).map_err(|m| ModuleError::new(ModuleErrorKind::BadWeights(m)))?;
        if s.bytes.len() != size {
            return err(ModuleErrorKind::BadWeights(format!(
                "{} has {} bytes, but {} {:?} needs {size}",
                describe(program, s),
                s.bytes.len(),
                s.elem,
                s.dims
            )));
        }
        tensors.push((s, shape));
    }
    Ok(tensors)
}

/// The weights section's header in safetensors layout (its length, then its JSON) and the
/// order the tensors follow it in. Written here rather than by `safetensors::serialize` so
/// that the output is deterministic (that function writes `__metadata__` in hash order):
/// JSON keys sorted, tensors laid out by descending element size, then by slot (every
/// tensor 8-byte aligned when the section is), header padded with spaces to 8 bytes.
fn safetensors_head(program: &Program, tensors: &[(&Stored, Vec<usize>)]) -> (Vec<u8>, Vec<usize>) {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(tensors[i].0.elem.size()), tensors[i].0.slot));
    let mut header = serde_json::Map::new();
    let names: serde_json::Map<String, serde_json::Value> = tensors
        .iter()
        .map(|(s, _)| (tensor_name(s.slot), slot_name(program, s.slot).into()))
        .collect();
    header.insert("__metadata__".into(), names.into());
    let mut offset = 0usize;
    for &i in &order {
        let (s, shape) = &tensors[i];
        let end = offset + s.bytes.len();
        header.insert(
            tensor_name(s.slot),
            serde_json::json!({
                "dtype": dtype_of(s.elem),
                "shape": shape,
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&header).expect("a JSON map always serialises");
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    (out, order)
}

/// Reads and checks a stage module file. Errors name `path`. The weights are slices of
/// the one buffer the file is read into (no copy per tensor).
pub fn read_module(path: impl AsRef<Path>) -> Result<StageModule> {
    let path = path.as_ref();
    let data = std::fs::read(path)
        .map_err(|source| ModuleError::new(ModuleErrorKind::Io { op: "read the file", source }).at(path))?;
    decode_module_bytes(Bytes::from(data)).map_err(|e| e.at(path))
}

/// Decodes a stage module from a borrowed buffer (copied once into a shared buffer that
/// the stored tensors then slice).
pub fn decode_module(data: &[u8]) -> Result<StageModule> {
    decode_module_bytes(Bytes::copy_from_slice(data))
}

/// Checks the envelope of a whole module (magic, version, lengths, checksum, header
/// fields) and returns its header without parsing the sections.
pub fn decode_header(data: &[u8]) -> Result<ModuleHeader> {
    check_envelope(data)
}

/// Decodes a stage module; the stored tensors' bytes are slices of `data` (zero-copy).
///
/// Checks, in order: magic, version, header length, that the declared sections lie in the
/// file, checksum, header fields, program JSON, weights.
pub fn decode_module_bytes(data: Bytes) -> Result<StageModule> {
    let header = check_envelope(&data)?;

    // Program.
    let (po, pl) = (header.program.offset as usize, header.program.len as usize);
    let mut program: Program = serde_json::from_slice(&data[po..po + pl])
        .map_err(|e| ModuleError::new(ModuleErrorKind::BadProgram(format!("invalid JSON: {e}"))))?;
    check_program(&program).map_err(|m| ModuleError::new(ModuleErrorKind::BadProgram(m)))?;

    // Weights.
    let (wo, wl) = (header.weights.offset as usize, header.weights.len as usize);
    let section = data.slice(wo..wo + wl);
    let bad = |m: String| ModuleError::new(ModuleErrorKind::BadWeights(m));
    let st = SafeTensors::deserialize(&section).map_err(|e| bad(format!("not valid safetensors: {e}")))?;
    let mut wanted = BTreeSet::new();
    let mut filled = Vec::with_capacity(program.stored.len());
    for s in &program.stored {
        let name = tensor_name(s.slot);
        if !wanted.insert(name.clone()) {
            return Err(bad(format!("{} is stored twice", describe(&program, s))));
        }
        let (shape, size) = stored_size(&program, s).map_err(bad)?;
        let t = st
            .tensor(&name)
            .map_err(|_| bad(format!("{} has no tensor {name:?} in the weights section", describe(&program, s))))?;
        if t.dtype() != dtype_of(s.elem) {
            return Err(bad(format!(
                "{} is {} in the program but {:?} in the weights section",
                describe(&program, s),
                s.elem,
                t.dtype()
            )));
        }
        if t.shape() != shape.as_slice() {
            return Err(bad(format!(
                "{} has dims {:?} in the program but {:?} in the weights section",
                describe(&program, s),
                s.dims,
                t.shape()
            )));
        }
        let bytes = t.data();
        if bytes.len() != size {
            return Err(bad(format!("{} has {} bytes, expected {size}", describe(&program, s), bytes.len())));
        }
        // `bytes` borrows `section`; slice the shared buffer at the same place.
        let start = bytes.as_ptr() as usize - section.as_ptr() as usize;
        filled.push(section.slice(start..start + size));
    }
    let mut extra: Vec<_> = st.names().into_iter().filter(|n| !wanted.contains(*n)).cloned().collect();
    if !extra.is_empty() {
        extra.sort();
        return Err(bad(format!("tensors {extra:?} are not stored tensors of the program")));
    }
    for (s, b) in program.stored.iter_mut().zip(filled) {
        s.bytes = b;
    }
    Ok(StageModule { header, program })
}

/// Magic, version, lengths, checksum and header fields.
fn check_envelope(data: &[u8]) -> Result<ModuleHeader> {
    let len = data.len() as u64;
    let truncated = |what, needed: u64| ModuleError::new(ModuleErrorKind::Truncated { what, needed, len });
    if data.len() < MAGIC.len() {
        return if MAGIC.starts_with(data) {
            Err(truncated("header", HEADER_LEN as u64))
        } else {
            err(ModuleErrorKind::NotAModule { found: data.to_vec() })
        };
    }
    if data[..8] != MAGIC {
        return err(ModuleErrorKind::NotAModule { found: data[..8].to_vec() });
    }
    if data.len() < OFF_VERSION + 4 {
        return Err(truncated("header", HEADER_LEN as u64));
    }
    // The version comes before anything else: a later version may lay out the rest
    // differently, and must say "version", not "checksum" or "truncated".
    let version = get_u32(data, OFF_VERSION);
    if version != FORMAT_VERSION {
        return err(ModuleErrorKind::UnsupportedVersion { found: version, supported: FORMAT_VERSION });
    }
    if data.len() < HEADER_LEN {
        return Err(truncated("header", HEADER_LEN as u64));
    }
    let program = Section { offset: get_u64(data, OFF_PROGRAM), len: get_u64(data, OFF_PROGRAM + 8) };
    let weights = Section { offset: get_u64(data, OFF_WEIGHTS), len: get_u64(data, OFF_WEIGHTS + 8) };
    let bad = |m: String| ModuleError::new(ModuleErrorKind::BadHeader(m));
    let program_end = program.end().ok_or_else(|| bad(format!("program section {program:?} overflows")))?;
    let weights_end = weights.end().ok_or_else(|| bad(format!("weights section {weights:?} overflows")))?;
    if program_end > len {
        return Err(truncated("program section", program_end));
    }
    if weights_end > len {
        return Err(truncated("weights section", weights_end));
    }
    let expected = get_u32(data, OFF_CHECKSUM);
    let found = checksum(data);
    if expected != found {
        return err(ModuleErrorKind::ChecksumMismatch { expected, found });
    }
    // The checksum matched, so what follows is how the writer made it.
    let schedule = schedule_of_code(data[OFF_SCHEDULE])
        .ok_or_else(|| bad(format!("unknown schedule code {}", data[OFF_SCHEDULE])))?;
    let recompute = recompute_of_code(data[OFF_RECOMPUTE])
        .ok_or_else(|| bad(format!("unknown recompute code {}", data[OFF_RECOMPUTE])))?;
    let params = StageParams { stage: get_u32(data, OFF_STAGE), depth: get_u32(data, OFF_DEPTH), schedule, recompute };
    check_params(&params).map_err(bad)?;
    if program.offset < HEADER_LEN as u64 || weights.offset < program_end {
        return Err(bad(format!(
            "sections overlap: header 0..{HEADER_LEN}, program {}..{program_end}, weights {}..{weights_end}",
            program.offset, weights.offset
        )));
    }
    if weights_end != len {
        return Err(bad(format!("{} bytes after the weights section", len - weights_end)));
    }
    Ok(ModuleHeader { version, params, checksum: expected, program, weights })
}

/// Slot references within range.
fn check_program(p: &Program) -> std::result::Result<(), String> {
    let n = p.slots.len();
    let check = |s: SlotId, what: &str| {
        if s.index() < n {
            Ok(())
        } else {
            Err(format!("{what} refers to slot {s}, but the program has {n} slots"))
        }
    };
    for &s in &p.inputs {
        check(s, "an input")?;
    }
    for &s in &p.outputs {
        check(s, "an output")?;
    }
    for s in &p.stored {
        check(s.slot, "a stored tensor")?;
    }
    for ins in &p.instrs {
        for s in ins.inputs.iter().chain(&ins.outputs).flatten() {
            check(*s, &format!("node {:?}", ins.name))?;
        }
    }
    Ok(())
}
