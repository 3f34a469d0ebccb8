//! Training data: a [`Dataset`] of named arrays whose first dimension is the sample, loaded
//! from `.npy` files, `.npz` archives or safetensors files (or made up, seeded, for
//! benchmarks), checked against the inputs the model expects, and cut into shuffled
//! batches of microbatches for the pipeline.
//!
//! The `.npy` reader is our own (format version 1, 2 and 3; little-endian `<f4 <f8 <i8 <i4`
//! and `|u1 |b1`; C order only). An `.npz` is a zip of `.npy` files (stored or deflated).
//!
//! Everything lives on the CPU; the caller moves microbatches to their devices.
//!
//! Arrays are not read into memory where the file can be mapped instead: `.npy` files,
//! `.safetensors` tensors and stored `.npz` members are views of a private mapping, so a
//! batch reads only the pages of its samples; a deflated `.npz` member is inflated once,
//! in chunks, into an unnamed scratch file (in `TMPDIR`) that is mapped the same way. An
//! array whose bytes are not aligned for its type (numpy's `savez` puts members wherever
//! the zip headers end) is kept as rows of bytes, copied into aligned memory per batch.
//!
//! Every allocation is bounded by what the file can hold: an `.npz` member is read in
//! chunks (its claimed size is never trusted: a 1 KB zip64 entry can claim 2^40 bytes),
//! and the bytes decompressed from one archive stop at a cap ([`DEFAULT_MAX_INFLATED`],
//! or [`Dataset::open_capped`]'s) so a decompression bomb is an error, not an abort.

use std::collections::BTreeMap;
use std::fmt::{Display, Write as _};
use std::io::Read;
use std::path::{Path, PathBuf};

use pipewright_core::rng::SplitMix64;
use pipewright_core::DataOrder;
use tch::{Kind, Tensor};

pub use crate::build::InputSpec;
use crate::exec::tensor_from_bytes;
use pipewright_ops::DType;

/// Data that cannot be loaded or batched; the message names the file and the array, and
/// keeps every cause (`data.npz: array `x`: dtype `>f4` is big-endian, ...`).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DataError(pub String);

type Result<T> = std::result::Result<T, DataError>;

macro_rules! bail {
    ($($t:tt)*) => { return Err(DataError(format!($($t)*))) };
}

macro_rules! anyhow {
    ($($t:tt)*) => { DataError(format!($($t)*)) };
}

/// `what: cause`, for errors from the file system, zip, safetensors and the parsers.
trait Context<T> {
    fn with_context<C: Display>(self, what: impl FnOnce() -> C) -> Result<T>;
}

impl<T, E: Display> Context<T> for std::result::Result<T, E> {
    fn with_context<C: Display>(self, what: impl FnOnce() -> C) -> Result<T> {
        self.map_err(|e| DataError(format!("{}: {e}", what())))
    }
}

/// What identifies a data file read during a run (a token stream, a mapped `.npy`): a
/// file replaced, grown, truncated or rewritten in place shows a different stamp, and is
/// refused before anything more is read from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FileStamp {
    path: PathBuf,
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileStamp {
    pub(crate) fn of(path: &Path, meta: &std::fs::Metadata) -> FileStamp {
        use std::os::unix::fs::MetadataExt;
        let mtime_ns = meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128;
        FileStamp { path: path.to_path_buf(), dev: meta.dev(), ino: meta.ino(), len: meta.len(), mtime_ns }
    }

    /// An error naming the file when its path no longer names the file as it was.
    pub(crate) fn check(&self) -> Result<()> {
        let shown = self.path.display();
        let now = match std::fs::metadata(&self.path) {
            Ok(meta) => FileStamp::of(&self.path, &meta),
            Err(e) => bail!("{shown}: the data file vanished during the run ({e}); restore it and resume from the last checkpoint (train --resume)"),
        };
        if now != *self {
            let what = if now.len != self.len { format!("its size went from {} to {} bytes", self.len, now.len) } else { "it was replaced or rewritten".to_string() };
            bail!("{shown}: the data file changed during the run ({what}); what was already read came from the old contents: restore it and resume from the last checkpoint (train --resume), or start again");
        }
        Ok(())
    }
}

/// One microbatch: the named inputs and the labels (when the data set has them).
pub type MicrobatchData = (Vec<(String, Tensor)>, Option<Tensor>);

/// How many batches [`Dataset::batches`] yields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Whole passes over the data (each reshuffled); the incomplete tail batch is dropped.
    Epochs(usize),
    /// This many batches, reshuffling at every epoch boundary.
    Steps(usize),
}

/// How [`Dataset::synthetic`] fills integer (and bool) inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntFill {
    /// All zeros: valid for any index input (token ids, positions, class ids).
    Zeros,
    /// Uniform in `[0, high)`; bool inputs are uniform true/false.
    Uniform(i64),
}

/// The most bytes read out of one `.npz` archive (all its members decompressed) unless
/// the caller gives another cap: far above any training set the 8x8 digits or the
/// corpus need, far below what inflating a crafted archive would take.
pub const DEFAULT_MAX_INFLATED: u64 = 16 << 30;

/// Named arrays sharing a first (sample) dimension.
pub struct Dataset {
    /// Input arrays `[samples, ...]`, in the order the caller asked for them.
    inputs: Vec<(String, Values)>,
    labels: Option<Values>,
    samples: usize,
    /// Where the data came from, for messages.
    source: String,
    /// The files arrays are mapped from, checked before each batch is read from them.
    mapped: Vec<FileStamp>,
}

/// A raw little-endian array read from a file.
#[derive(Clone, Debug, PartialEq)]
pub struct RawArray {
    pub elem: DType,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

/// The array a loader takes the labels from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelArray<'a> {
    /// No labels.
    None,
    /// This array (an error lists the arrays when there is none of that name).
    Named(&'a str),
    /// This array, taken because nothing named one: its absence is an error asking for
    /// `--label`.
    Default(&'a str),
}

/// The labels array taken when none is named.
pub const DEFAULT_LABEL: &str = "label";

impl<'a> From<Option<&'a str>> for LabelArray<'a> {
    fn from(label: Option<&'a str>) -> Self {
        label.map_or(LabelArray::None, LabelArray::Named)
    }
}

impl Dataset {
    /// Random data for `inputs`: floats standard normal, integers per `IntFill::Zeros`.
    /// The same `(inputs, samples, seed)` always gives the same data.
    pub fn synthetic(inputs: &[InputSpec], samples: usize, seed: u64) -> Result<Dataset> {
        Self::synthetic_with(inputs, samples, seed, IntFill::Zeros)
    }

    /// Random data for `inputs`, seeded and deterministic (our own generator, so the data
    /// does not depend on libtorch's global RNG): floats standard normal, integers and bools
    /// per `ints`. Dynamic (`-1`) per-sample dims are not allowed here.
    pub fn synthetic_with(inputs: &[InputSpec], samples: usize, seed: u64, ints: IntFill) -> Result<Dataset> {
        if samples == 0 {
            bail!("synthetic data set: needs at least one sample");
        }
        let mut out = Vec::with_capacity(inputs.len());
        for (i, InputSpec { name, elem, per_sample: shape }) in inputs.iter().enumerate() {
            if let Some(d) = shape.iter().find(|&&d| d < 0) {
                bail!("synthetic input `{name}`: per-sample shape {shape:?} has a dynamic dimension ({d}); give a concrete size");
            }
            let mut full = vec![i64::try_from(samples).map_err(|_| anyhow!("synthetic data set: {samples} samples is too many"))?];
            full.extend_from_slice(shape);
            let count = full.iter().try_fold(1i64, |n, &d| n.checked_mul(d));
            // Reserved fallibly: an absurd sample count is an error, not an abort.
            let too_big = || anyhow!("synthetic input `{name}`: {samples} samples of per-sample shape {shape:?} cannot be allocated (too large for this machine)");
            let count = count.and_then(|c| usize::try_from(c).ok()).ok_or_else(too_big)?;
            let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F));
            let t = if elem.is_float() {
                let mut v: Vec<f32> = Vec::new();
                v.try_reserve_exact(count).map_err(|_| too_big())?;
                v.extend((0..count).map(|_| rng.normal()));
                Tensor::from_slice(&v).view(full.as_slice()).to_kind(kind(*elem)?)
            } else {
                let mut v: Vec<i64> = Vec::new();
                v.try_reserve_exact(count).map_err(|_| too_big())?;
                match ints {
                    IntFill::Zeros => v.resize(count, 0),
                    IntFill::Uniform(high) => {
                        let high = if *elem == DType::Bool { 2 } else { high };
                        if high <= 0 {
                            bail!("synthetic input `{name}`: integer range [0, {high}) is empty");
                        }
                        v.extend((0..count).map(|_| rng.below(high as u64) as i64));
                    }
                };
                Tensor::from_slice(&v).view(full.as_slice()).to_kind(kind(*elem)?)
            };
            out.push((name.clone(), Values::Typed(t)));
        }
        Ok(Dataset { inputs: out, labels: None, samples, source: "synthetic data".into(), mapped: Vec::new() })
    }

    /// Adds seeded random class labels (i64 `[samples]`, uniform in `[0, classes)`).
    pub fn with_random_labels(self, classes: i64, seed: u64) -> Result<Dataset> {
        self.with_random_labels_shaped(classes, &[], seed)
    }

    /// Adds seeded random class labels of per-sample shape `shape` (i64
    /// `[samples, ...shape]`, uniform in `[0, classes)`): `[T]` for per-token logits
    /// `[N, T, C]`.
    pub fn with_random_labels_shaped(mut self, classes: i64, shape: &[i64], seed: u64) -> Result<Dataset> {
        if classes <= 0 {
            bail!("random labels: need at least one class, got {classes}");
        }
        let per: i64 = shape.iter().product();
        let mut rng = Rng::new(seed ^ 0x005E_ED1A_BE15);
        let v: Vec<i64> = (0..self.samples as i64 * per).map(|_| rng.below(classes as u64) as i64).collect();
        let mut dims = vec![self.samples as i64];
        dims.extend_from_slice(shape);
        self.labels = Some(Values::Typed(Tensor::from_slice(&v).reshape(dims)));
        Ok(self)
    }

    /// Adds seeded standard-normal f32 targets of per-sample shape `shape` (for `mse`).
    pub fn with_random_targets(mut self, shape: &[i64], seed: u64) -> Result<Dataset> {
        let per: i64 = shape.iter().product();
        let mut rng = Rng::new(seed ^ 0x7A26_E75E_ED00);
        let v: Vec<f32> = (0..self.samples as i64 * per).map(|_| rng.normal()).collect();
        let mut dims = vec![self.samples as i64];
        dims.extend_from_slice(shape);
        self.labels = Some(Values::Typed(Tensor::from_slice(&v).reshape(dims)));
        Ok(self)
    }

    /// Checks labels are class ids for cross-entropy: float labels must hold whole numbers
    /// (a fractional label was silently truncated to a class). Whole numbers outside the
    /// classes (negative ones other than the ignore index included) are reported by the
    /// loss, which knows the class count.
    pub fn check_class_labels(&self, name: &str) -> Result<()> {
        let Some(y) = self.labels() else { return Ok(()) };
        if y.numel() == 0 {
            return Ok(());
        }
        let flat = y.flatten(0, -1);
        if y.is_floating_point() {
            let y64 = flat.to_kind(Kind::Double);
            let bad = y64.isfinite().logical_not().logical_or(&(&y64 - y64.floor()).ne(0.0));
            if bad.any().int64_value(&[]) != 0 {
                let i = bad.to_kind(Kind::Int64).argmax(0, false).int64_value(&[]);
                let v = y64.double_value(&[i]);
                bail!(
                    "{}: label array `{name}` holds {v} (element {i}), not a class id; cross-entropy needs whole numbers (integer labels, or --loss mse for real-valued targets)",
                    self.source
                );
            }
        }
        Ok(())
    }

    /// Sets (or replaces) the labels; their first dimension must be the sample count.
    pub fn with_labels(mut self, labels: Tensor) -> Result<Dataset> {
        let n = labels.size().first().copied();
        if n != Some(self.samples as i64) {
            bail!("{}: labels have shape {:?}, expected {} samples in the first dimension", self.source, labels.size(), self.samples);
        }
        self.labels = Some(Values::Typed(labels));
        Ok(self)
    }

    /// Loads by file kind (the labels from `label`, e.g. `Some("y")` or
    /// [`LabelArray::Default`]): a folder or `.npy` file ([`Dataset::from_npy`]), `.npz`, or
    /// `.safetensors`.
    pub fn open<'a>(path: &Path, inputs: &[InputSpec], label: impl Into<LabelArray<'a>>) -> Result<Dataset> {
        Self::open_capped(path, inputs, label, DEFAULT_MAX_INFLATED)
    }

    /// [`Dataset::open`] with at most `max_inflated` bytes decompressed from an `.npz`.
    pub fn open_capped<'a>(path: &Path, inputs: &[InputSpec], label: impl Into<LabelArray<'a>>, max_inflated: u64) -> Result<Dataset> {
        let label = label.into();
        if !path.exists() {
            bail!("{}: not found (give an .npz, an .npy, a folder of .npy files or a .safetensors file)", path.display());
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
        if path.is_dir() || ext == "npy" {
            Self::from_npy(&[path], inputs, label)
        } else if ext == "npz" {
            Self::from_npz_capped(path, inputs, label, max_inflated)
        } else if ext == "safetensors" {
            Self::from_safetensors(path, inputs, label)
        } else {
            bail!("{}: unknown data file kind (expected a folder of .npy files, .npy, .npz or .safetensors)", path.display())
        }
    }

    /// Loads `inputs` (by graph input name) and the `label` array from an `.npz` archive
    /// (member `NAME.npy` holds array `NAME`).
    pub fn from_npz<'a>(path: &Path, inputs: &[InputSpec], label: impl Into<LabelArray<'a>>) -> Result<Dataset> {
        Self::from_npz_capped(path, inputs, label, DEFAULT_MAX_INFLATED)
    }

    /// [`Dataset::from_npz`] reading at most `max_inflated` bytes out of the archive (all
    /// members together). Stored members are mapped from the archive; deflated ones are
    /// inflated into scratch files and mapped from there (see the module documentation).
    pub fn from_npz_capped<'a>(path: &Path, inputs: &[InputSpec], label: impl Into<LabelArray<'a>>, max_inflated: u64) -> Result<Dataset> {
        let shown = path.display().to_string();
        let file = std::fs::File::open(path).with_context(|| format!("{shown}: cannot open"))?;
        let mapped = map_file(path);
        Self::npz(&shown, file, mapped.as_ref().map(|(t, s)| (t, s)), inputs, label.into(), max_inflated)
    }

    /// [`Dataset::from_npz`] on an archive already open (or in memory, as the fuzzer
    /// feeds it), its members read (within the cap); errors name `shown`.
    pub fn from_npz_reader<'a, R: Read + std::io::Seek>(shown: &str, reader: R, inputs: &[InputSpec], label: impl Into<LabelArray<'a>>) -> Result<Dataset> {
        Self::npz(shown, reader, None, inputs, label.into(), DEFAULT_MAX_INFLATED)
    }

    /// The arrays of the `.npz` archive `reader`: with `mapped` (the archive's mapping and
    /// stamp) stored members are views of it and deflated ones go through scratch files;
    /// otherwise, and for members that cannot be mapped, members are read whole.
    fn npz<R: Read + std::io::Seek>(shown: &str, reader: R, mapped: Option<(&Tensor, &FileStamp)>, inputs: &[InputSpec], label: LabelArray<'_>, max_inflated: u64) -> Result<Dataset> {
        let mut zip = zip::ZipArchive::new(reader).map_err(|e| anyhow!("{shown}: not a valid .npz (zip) archive: {e}"))?;
        let members = npz_members(shown, &mut zip)?;
        let mut left = max_inflated;
        Self::assemble(shown, members.keys().cloned().collect(), inputs, label, |array| {
            let member = &members[array];
            let f = zip.by_name(member).map_err(|e| anyhow!("{shown}: member `{member}`: {e}"))?;
            let at = format!("{shown}: member `{member}`");
            if let Some((archive, stamp)) = mapped {
                if f.compression() != zip::CompressionMethod::Stored {
                    return inflate_member(&at, array, f, &mut left, max_inflated);
                }
                if let Some(c) = map_stored_member(archive, stamp, f.data_start(), f.size()) {
                    return Ok(c);
                }
            }
            let bytes = read_bounded(f, &mut left).map_err(|e| bounded_error(&at, max_inflated, e))?;
            column(shown, array, parse_npy(&bytes).with_context(|| format!("{shown}: array `{array}`"))?)
        })
    }

    /// Loads from `.npy` files: each path is a `.npy` file (array name = file stem) or a
    /// folder whose `*.npy` files are all taken.
    pub fn from_npy<'a, P: AsRef<Path>>(paths: &[P], inputs: &[InputSpec], label: impl Into<LabelArray<'a>>) -> Result<Dataset> {
        let label = label.into();
        let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
        let mut add = |file: PathBuf| -> Result<()> {
            let stem = file.file_stem().and_then(|s| s.to_str()).ok_or_else(|| anyhow!("{}: file name is not valid UTF-8", file.display()))?.to_string();
            if let Some(prev) = files.insert(stem.clone(), file.clone()) {
                bail!("array `{stem}` is given twice: {} and {}", prev.display(), file.display());
            }
            Ok(())
        };
        for p in paths {
            let p = p.as_ref();
            if p.is_dir() {
                let mut found: Vec<PathBuf> = std::fs::read_dir(p)
                    .with_context(|| format!("{}: cannot read folder", p.display()))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|f| f.is_file() && f.extension().is_some_and(|e| e == "npy"))
                    .collect();
                found.sort();
                for f in found {
                    add(f)?;
                }
            } else {
                add(p.to_path_buf())?;
            }
        }
        let shown = paths.iter().map(|p| p.as_ref().display().to_string()).collect::<Vec<_>>().join(", ");
        Self::assemble(&shown, files.keys().cloned().collect(), inputs, label, |array| {
            let f = &files[array];
            if let Some(mapped) = map_npy(f) {
                return Ok(mapped);
            }
            let bytes = std::fs::read(f).with_context(|| format!("{}: cannot read", f.display()))?;
            let raw = parse_npy(&bytes).with_context(|| format!("{}: array `{array}`", f.display()))?;
            column(&f.display().to_string(), array, raw)
        })
    }

    /// Loads from a safetensors file (any of its little-endian dtypes libtorch has).
    /// The file is mapped, not read, and each tensor aligned for its type is a view of the
    /// mapping (as `.npy` arrays are); the others are copied out of it.
    pub fn from_safetensors<'a>(path: &Path, inputs: &[InputSpec], label: impl Into<LabelArray<'a>>) -> Result<Dataset> {
        let label = label.into();
        let shown = path.display().to_string();
        if let Some((file, stamp)) = map_file(path) {
            // SAFETY: `file` maps the whole file (`numel` bytes) and outlives `bytes`; a
            // private mapping is never written through.
            let bytes = unsafe { std::slice::from_raw_parts(file.data_ptr() as *const u8, file.numel()) };
            return Self::from_safetensors_in(&shown, bytes, Some((&file, &stamp)), inputs, label);
        }
        let bytes = std::fs::read(path).with_context(|| format!("{shown}: cannot read"))?;
        Self::from_safetensors_bytes(&shown, &bytes, inputs, label)
    }

    /// [`Dataset::from_safetensors`] on a file's bytes; errors name `shown`.
    pub fn from_safetensors_bytes<'a>(shown: &str, bytes: &[u8], inputs: &[InputSpec], label: impl Into<LabelArray<'a>>) -> Result<Dataset> {
        Self::from_safetensors_in(shown, bytes, None, inputs, label.into())
    }

    /// `bytes`: the file's; with `mapped`, they are the mapping `mapped.0` of the file
    /// `mapped.1` stamps, which aligned tensors become views of.
    fn from_safetensors_in(shown: &str, bytes: &[u8], mapped: Option<(&Tensor, &FileStamp)>, inputs: &[InputSpec], label: LabelArray<'_>) -> Result<Dataset> {
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| anyhow!("{shown}: not a valid safetensors file: {e:?}"))?;
        let mut names: Vec<String> = st.names().into_iter().cloned().collect();
        names.sort();
        let shown = shown.to_string();
        Self::assemble(&shown, names, inputs, label, |array| {
            let view = st.tensor(array).map_err(|e| anyhow!("{shown}: array `{array}`: {e:?}"))?;
            let elem = crate::module::elem_of_dtype(view.dtype())
                .ok_or_else(|| anyhow!("{shown}: array `{array}`: dtype {:?} is not supported", view.dtype()))?;
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let data = view.data();
            if let Some((file, stamp)) = mapped {
                let offset = data.as_ptr() as usize - bytes.as_ptr() as usize;
                if let Some(values) = typed_view(file, offset as u64, data.len() as u64, elem, &shape) {
                    return Ok(Column { elem, shape, values: Values::Typed(values), stamp: Some(stamp.clone()) });
                }
            }
            column(&shown, array, RawArray { elem, shape, data: data.to_vec() })
        })
    }

    /// Shared by the loaders: picks the arrays, checks them and builds tensors.
    fn assemble(
        source: &str,
        available: Vec<String>,
        inputs: &[InputSpec],
        label: LabelArray<'_>,
        mut read: impl FnMut(&str) -> Result<Column>,
    ) -> Result<Dataset> {
        let listing = || if available.is_empty() { "none".to_string() } else { available.join(", ") };
        let mut samples: Option<(usize, String)> = None;
        let mut check_samples = |name: &str, a: &Column| -> Result<usize> {
            let Some(&n) = a.shape.first() else {
                bail!("{source}: array `{name}` is a scalar (shape []); its first dimension must be the sample");
            };
            let n = n as usize;
            match &samples {
                None => samples = Some((n, name.to_string())),
                Some((m, first)) if *m != n => bail!(
                    "{source}: arrays have different sample counts: `{first}` has {m}, `{name}` has {n}"
                ),
                _ => {}
            }
            Ok(n)
        };
        let mut out = Vec::with_capacity(inputs.len());
        let mut mapped = Vec::new();
        for InputSpec { name, elem, per_sample } in inputs {
            if !available.iter().any(|a| a == name) {
                bail!("{source}: no array for model input `{name}` (arrays: {})", listing());
            }
            let a = read(name)?;
            if a.elem != *elem {
                bail!(
                    "{source}: array `{name}` has element type {}, but the model input `{name}` is {elem} (convert the array, e.g. numpy `.astype`)",
                    a.elem
                );
            }
            check_samples(name, &a)?;
            let got = &a.shape[1..];
            let fits = got.len() == per_sample.len() && got.iter().zip(per_sample).all(|(&g, &w)| w < 0 || g == w);
            if !fits {
                bail!(
                    "{source}: array `{name}` has per-sample shape {got:?} (array shape {:?}), but the model input `{name}` expects per-sample shape {per_sample:?}",
                    a.shape
                );
            }
            mapped.extend(a.stamp);
            out.push((name.clone(), a.values));
        }
        let labels = match label {
            LabelArray::None => None,
            LabelArray::Default(name) if !available.iter().any(|a| a == name) => bail!(
                "{source}: the loss needs labels: name their array with --label NAME (there is no array `{name}` to take by default; arrays: {})",
                listing()
            ),
            LabelArray::Named(name) | LabelArray::Default(name) => {
                if !available.iter().any(|a| a == name) {
                    bail!("{source}: no label array `{name}` (arrays: {})", listing());
                }
                let a = read(name)?;
                check_samples(name, &a)?;
                mapped.extend(a.stamp);
                Some(a.values)
            }
        };
        let Some((samples, _)) = samples else {
            bail!("{source}: no arrays selected (give the model inputs and/or a label array)");
        };
        if samples == 0 {
            bail!("{source}: the arrays have no samples");
        }
        Ok(Dataset { inputs: out, labels, samples, source: source.to_string(), mapped })
    }

    pub fn samples(&self) -> usize {
        self.samples
    }

    /// The input arrays' names, in the order the caller asked for them.
    pub fn input_names(&self) -> Vec<&str> {
        self.inputs.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Input array `name`, whole (a view where it is mapped and aligned, else a copy).
    pub fn input(&self, name: &str) -> Option<Tensor> {
        self.inputs.iter().find(|(n, _)| n == name).and_then(|(_, v)| v.whole().ok())
    }

    /// The labels, whole (as [`Dataset::input`]).
    pub fn labels(&self) -> Option<Tensor> {
        self.labels.as_ref().and_then(|v| v.whole().ok())
    }

    /// Full batches of `m * microbatch` samples in one epoch.
    pub fn batches_per_epoch(&self, microbatch: usize, m: usize) -> usize {
        if microbatch == 0 || m == 0 {
            0
        } else {
            self.samples / (microbatch * m)
        }
    }

    /// Batches of `m` microbatches of `microbatch` samples each. Every epoch visits the
    /// samples in a fresh order drawn from `seed` and the epoch number (same seed, same
    /// order); the incomplete last batch of an epoch is dropped. Errors when not even one
    /// batch fits in the data set.
    pub fn batches(&self, microbatch: usize, m: usize, seed: u64, stop: Stop) -> Result<Batches<&Dataset>> {
        Batches::new(self, microbatch, m, seed, stop)
    }

    /// [`Dataset::batches`], owning the data set: batches are made as they are asked for,
    /// so memory does not grow with the number of steps.
    pub fn into_batches(self, microbatch: usize, m: usize, seed: u64, stop: Stop) -> Result<Batches<Box<Dataset>>> {
        Batches::new(Box::new(self), microbatch, m, seed, stop)
    }

    /// The sample order of epoch `epoch` under `seed` (a permutation of `0..samples`).
    pub fn epoch_order(&self, seed: u64, epoch: u64) -> Vec<i64> {
        permutation(self.samples, seed, epoch)
    }
}

/// The iterator from [`Dataset::batches`] and [`Dataset::into_batches`]: each batch is
/// built when it is asked for.
pub struct Batches<D> {
    data: D,
    microbatch: usize,
    m: usize,
    seed: u64,
    per_epoch: usize,
    total: usize,
    step: usize,
    /// The epoch `order` is the sample order of.
    order_epoch: Option<usize>,
    order: Vec<i64>,
    /// The stored order rather than a shuffled one.
    sequential: bool,
}

impl<D: std::ops::Deref<Target = Dataset>> Batches<D> {
    fn new(data: D, microbatch: usize, m: usize, seed: u64, stop: Stop) -> Result<Batches<D>> {
        if microbatch == 0 || m == 0 {
            bail!("batches: microbatch size and microbatch count must be at least 1 (got {microbatch} x {m})");
        }
        let per_epoch = data.batches_per_epoch(microbatch, m);
        if per_epoch == 0 {
            bail!(
                "{}: {} samples are fewer than one batch ({m} microbatches of {microbatch} = {})",
                data.source,
                data.samples,
                m * microbatch
            );
        }
        let total = match stop {
            Stop::Epochs(e) => e * per_epoch,
            Stop::Steps(s) => s,
        };
        Ok(Batches { data, microbatch, m, seed, per_epoch, total, step: 0, order_epoch: None, order: Vec::new(), sequential: false })
    }

    /// Visits the samples in `order`: shuffled per epoch (the default) or as stored.
    pub fn in_order(mut self, order: DataOrder) -> Self {
        self.sequential = order == DataOrder::Sequential;
        self
    }

    /// Continues at batch `step` (a resumed run) without building the batches before it.
    pub fn starting_at(mut self, step: usize) -> Self {
        self.step = step.min(self.total);
        self
    }
}

impl<D: std::ops::Deref<Target = Dataset>> Iterator for Batches<D> {
    /// A batch, or why its mapped files can no longer be read.
    type Item = Result<Vec<MicrobatchData>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.step >= self.total {
            return None;
        }
        // A mapped file truncated under the run would fault on access: checked first.
        if let Some(e) = self.data.mapped.iter().find_map(|m| m.check().err()) {
            self.step = self.total;
            return Some(Err(e));
        }
        let epoch = self.step / self.per_epoch;
        let within = self.step % self.per_epoch;
        if self.order_epoch != Some(epoch) {
            self.order = if self.sequential { (0..self.data.samples as i64).collect() } else { permutation(self.data.samples, self.seed, epoch as u64) };
            self.order_epoch = Some(epoch);
        }
        self.step += 1;
        let start = within * self.m * self.microbatch;
        let source = &self.data.source;
        let batch = (0..self.m)
            .map(|k| {
                let lo = start + k * self.microbatch;
                let index = Tensor::from_slice(&self.order[lo..lo + self.microbatch]);
                let pick = |(n, v): &(String, Values)| v.select(&index).map(|t| (n.clone(), t)).with_context(|| format!("{source}: array `{n}`"));
                let inputs = self.data.inputs.iter().map(pick).collect::<Result<Vec<_>>>()?;
                let labels = self.data.labels.as_ref().map(|v| v.select(&index).with_context(|| format!("{source}: the labels"))).transpose()?;
                Ok((inputs, labels))
            })
            .collect::<Result<Vec<_>>>();
        if batch.is_err() {
            self.step = self.total;
        }
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.total - self.step;
        (left, Some(left))
    }
}

impl<D: std::ops::Deref<Target = Dataset>> ExactSizeIterator for Batches<D> {}

/// Why [`read_bounded`] stopped.
enum Bounded {
    /// More than the bytes left under the cap.
    Cap,
    /// The allocator refused this many bytes.
    Alloc(usize),
    /// Reading failed (a damaged archive).
    Io(std::io::Error),
    /// Writing what was read failed ([`inflate_member`]).
    Write(std::io::Error),
}

/// Reads `r` to its end in chunks, never holding more than `left` bytes (which it lowers
/// by what was read) and never reserving more than was actually read plus one chunk: the
/// size a zip entry claims is not trusted, and a refused allocation is an error, not an
/// abort.
fn read_bounded(r: impl Read, left: &mut u64) -> std::result::Result<Vec<u8>, Bounded> {
    let mut out: Vec<u8> = Vec::new();
    copy_bounded(r, left, |chunk| {
        // Grow geometrically (amortized), but through try_reserve so a refusal reports.
        if out.capacity() - out.len() < chunk.len() {
            let want = out.len().max(chunk.len());
            out.try_reserve(want).map_err(|_| Bounded::Alloc(out.len() + want))?;
        }
        out.extend_from_slice(chunk);
        Ok(())
    })?;
    Ok(out)
}

/// The message for a member [`copy_bounded`] stopped reading; `at`
/// names the archive and member.
fn bounded_error(at: &str, max_inflated: u64, e: Bounded) -> DataError {
    match e {
        Bounded::Cap => anyhow!(
            "{at}: the archive decompresses to more than {max_inflated} bytes (the cap on data read from one .npz, --max-data-size; a decompression bomb, or a data set that needs a higher cap)"
        ),
        Bounded::Alloc(n) => anyhow!("{at}: cannot allocate {n} bytes for it"),
        Bounded::Io(e) => anyhow!("{at}: {e}"),
        Bounded::Write(e) => anyhow!("{at}: cannot write it: {e}"),
    }
}

/// An archive's members by array name (`x.npy` holds `x`).
fn npz_members<R: Read + std::io::Seek>(shown: &str, zip: &mut zip::ZipArchive<R>) -> Result<BTreeMap<String, String>> {
    let mut members = BTreeMap::new();
    for i in 0..zip.len() {
        let name = zip.by_index(i).map_err(|e| anyhow!("{shown}: {e}"))?.name().to_string();
        let array = name.strip_suffix(".npy").unwrap_or(&name).to_string();
        members.insert(array, name);
    }
    Ok(members)
}

/// A stored member (`len` bytes at `start` of the mapped `archive`, a `.npy` file) as a
/// column of the mapping: typed where its data is aligned for its type, rows of bytes
/// where not; `None` where the member is to be read and its faults reported (a header or
/// size the parser must explain; bool, whose bytes must be checked; no data).
fn map_stored_member(archive: &Tensor, stamp: &FileStamp, start: u64, len: u64) -> Option<Column> {
    let end = start.checked_add(len)?;
    if end > archive.numel() as u64 || len == 0 {
        return None;
    }
    // SAFETY: `archive` maps the whole file (`numel` bytes), `start + len` lies within it,
    // and a private mapping is never written through.
    let member = unsafe { std::slice::from_raw_parts((archive.data_ptr() as *const u8).add(start as usize), len as usize) };
    let (descr, shape, header) = parse_npy_header(&member[..member.len().min(1 << 16)]).ok()?;
    let elem = npy_elem(&descr).ok()?;
    let data = shape.iter().try_fold(elem.size() as u64, |acc, &d| acc.checked_mul(d))?;
    if elem == DType::Bool || data == 0 || data != len - header as u64 {
        return None;
    }
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let at = start + header as u64;
    let values = match typed_view(archive, at, data, elem, &dims) {
        Some(t) => Values::Typed(t),
        None => {
            let samples = *dims.first()?;
            let rows = archive.f_narrow(0, at as i64, data as i64).and_then(|t| t.f_view([samples, data as i64 / samples.max(1)])).ok()?;
            Values::Rows { rows, kind: kind(elem).ok()?, per_sample: dims[1..].to_vec() }
        }
    };
    Some(Column { elem, shape: dims, values, stamp: Some(stamp.clone()) })
}

/// A deflated member inflated in chunks into an unnamed scratch file under the
/// temporary folder (`TMPDIR`), which is then mapped as a `.npy` file is: memory stays
/// bounded whatever the member's size, and the file is gone when the process is. The
/// inflated bytes count against `left` (the archive's cap). `at` names archive and member.
fn inflate_member(at: &str, array: &str, member: impl Read, left: &mut u64, max_inflated: u64) -> Result<Column> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let folder = std::env::temp_dir();
    let place = || format!("a scratch file in {} (TMPDIR)", folder.display());
    let mut scratch = tempfile::tempfile_in(&folder).with_context(|| format!("{at}: cannot create {} to inflate it into", place()))?;
    // A file is written through at once (no buffer to flush).
    copy_bounded(member, left, |chunk| scratch.write_all(chunk).map_err(Bounded::Write)).map_err(|e| match e {
        Bounded::Write(e) => anyhow!("{at}: inflating it into {}: {e} (set TMPDIR to a folder with room, or store the archive uncompressed: numpy.savez)", place()),
        e => bounded_error(at, max_inflated, e),
    })?;
    // The unnamed file is reached through this process's descriptor for it.
    let path = PathBuf::from(format!("/proc/self/fd/{}", scratch.as_raw_fd()));
    if let Some(mut c) = map_npy(&path) {
        // Nobody else can reach the file, and its descriptor closes below: no stamp.
        c.stamp = None;
        return Ok(c);
    }
    let mut bytes = Vec::new();
    std::io::Seek::rewind(&mut scratch).and_then(|_| scratch.read_to_end(&mut bytes)).with_context(|| format!("{at}: reading it back from {}", place()))?;
    column(at, array, parse_npy(&bytes).with_context(|| format!("{at}: array `{array}`"))?)
}

/// Reads `r` to its end in 1 MiB chunks, handing each to `take`, at most `left` bytes
/// (which it lowers by what was read).
fn copy_bounded(mut r: impl Read, left: &mut u64, mut take: impl FnMut(&[u8]) -> std::result::Result<(), Bounded>) -> std::result::Result<(), Bounded> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Bounded::Io(e)),
        };
        if n as u64 > *left {
            return Err(Bounded::Cap);
        }
        *left -= n as u64;
        take(&buf[..n])?;
    }
}

fn kind(elem: DType) -> Result<Kind> {
    crate::exec::torch_kind(elem).map_err(|e| anyhow!("{e}"))
}

/// An array of a data set: its element type, its shape and its values, built from bytes
/// read or mapped from the file.
struct Column {
    elem: DType,
    shape: Vec<i64>,
    values: Values,
    /// The file it is mapped from.
    stamp: Option<FileStamp>,
}

/// An array's samples: typed, or (mapped bytes not aligned for the type) each sample's
/// bytes as a row, given the type when a batch copies its rows out.
enum Values {
    Typed(Tensor),
    Rows {
        /// `u8 [samples, bytes per sample]`.
        rows: Tensor,
        kind: Kind,
        per_sample: Vec<i64>,
    },
}

impl Values {
    /// The samples at `index` (`i64 [n]`), of the array's type, in fresh memory.
    fn select(&self, index: &Tensor) -> std::result::Result<Tensor, tch::TchError> {
        match self {
            Values::Typed(t) => t.f_index_select(0, index),
            Values::Rows { rows, kind, per_sample } => {
                // A fresh tensor is aligned for any type, where the mapped rows were not.
                let picked = rows.f_index_select(0, index)?;
                let mut shape = vec![picked.size()[0]];
                shape.extend_from_slice(per_sample);
                picked.f_view_dtype(*kind)?.f_reshape(shape)
            }
        }
    }

    /// Every sample: the tensor itself when typed, else a copy.
    fn whole(&self) -> std::result::Result<Tensor, tch::TchError> {
        match self {
            Values::Typed(t) => Ok(t.shallow_clone()),
            Values::Rows { rows, .. } => self.select(&Tensor::f_arange(rows.size()[0], (Kind::Int64, tch::Device::Cpu))?),
        }
    }
}

/// The array `a` read from `source` as a column.
fn column(source: &str, name: &str, a: RawArray) -> Result<Column> {
    let values = tensor_from_bytes(a.elem, &a.shape, &a.data).map_err(|e| anyhow!("{source}: array `{name}`: {e}"))?;
    Ok(Column { elem: a.elem, shape: a.shape, values: Values::Typed(values), stamp: None })
}

/// A `.npy` file's array mapped from the file (its pages are read as batches touch them,
/// so a file larger than memory trains in bounded memory), or `None` where it is not (a
/// header or size the parser must explain, or what [`typed_view`] and [`map_file`] refuse):
/// the caller reads it whole, and reports what is wrong with it.
fn map_npy(path: &Path) -> Option<Column> {
    let file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let (descr, shape, start) = parse_npy_header(&npy_head(&file).ok()?).ok()?;
    let elem = npy_elem(&descr).ok()?;
    let data = shape.iter().try_fold(elem.size() as u64, |acc, &d| acc.checked_mul(d))?;
    if data != len - start as u64 {
        return None;
    }
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let (file, stamp) = map_file(path)?;
    let values = typed_view(&file, start as u64, data, elem, &dims)?;
    Some(Column { elem, shape: dims, values: Values::Typed(values), stamp: Some(stamp) })
}

/// The whole file at `path` as a private, read-only mapping (a `u8` tensor libtorch maps),
/// with its stamp; `None` for an empty file or a path that is not UTF-8.
fn map_file(path: &Path) -> Option<(Tensor, FileStamp)> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.len() == 0 {
        return None;
    }
    let file = Tensor::f_from_file(path.to_str()?, false, Some(meta.len() as i64), (Kind::Uint8, tch::Device::Cpu)).ok()?;
    Some((file, FileStamp::of(path, &meta)))
}

/// Bytes `at .. at + len` of a mapped file as an array of `elem` and `shape`, without a
/// copy; `None` where they cannot be viewed so (bool, whose bytes must be checked; data not
/// aligned for its type; nothing to view).
fn typed_view(file: &Tensor, at: u64, len: u64, elem: DType, shape: &[i64]) -> Option<Tensor> {
    if elem == DType::Bool || len == 0 || at % elem.size() as u64 != 0 {
        return None;
    }
    let kind = kind(elem).ok()?;
    file.f_narrow(0, at as i64, len as i64).and_then(|t| t.f_view_dtype(kind)).and_then(|t| t.f_reshape(shape)).ok()
}

/// A Fisher–Yates permutation of `0..n` from `(seed, epoch)`.
fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<i64> {
    let mut rng = Rng::new(seed ^ epoch.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut order: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// The data's draws over the workspace's seeded generator (the same on every platform).
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(SplitMix64::new(seed))
    }

    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `[0, n)` (n > 0), without modulo bias.
    fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Uniform in `(0, 1]`.
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.unit(), self.unit());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

// ---------------------------------------------------------------------------------------
// .npy

const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// The first bytes of a `.npy` file, enough for any header (a few KiB at most) and no
/// more of the data, for [`parse_npy_header`].
pub(crate) fn npy_head(file: &std::fs::File) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let len = file.metadata()?.len();
    let mut head = vec![0u8; len.min(1 << 16) as usize];
    file.read_exact_at(&mut head, 0)?;
    Ok(head)
}

/// A `.npy` file's header (versions 1.0, 2.0, 3.0; C order): its dtype string, its shape
/// and where the data starts. `bytes` need only hold the header.
pub(crate) fn parse_npy_header(bytes: &[u8]) -> Result<(String, Vec<u64>, usize)> {
    if bytes.len() < 10 || &bytes[..6] != NPY_MAGIC {
        bail!("not a .npy file (no \\x93NUMPY magic)");
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (header_len, start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                bail!("truncated .npy header");
            }
            (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12)
        }
        _ => bail!(".npy format version {major}.{minor} is not supported (1.0, 2.0, 3.0 are)"),
    };
    let end = start + header_len;
    if bytes.len() < end {
        bail!("truncated .npy header ({} bytes, header says {header_len})", bytes.len() - start);
    }
    let header = std::str::from_utf8(&bytes[start..end]).map_err(|_| anyhow!(".npy header is not text"))?;
    let dict = parse_header(header).with_context(|| format!("bad .npy header {:?}", header.trim_end()))?;
    let descr = match dict.get("descr") {
        Some(Value::Str(s)) => s.clone(),
        Some(_) => bail!(".npy header: `descr` is not a plain dtype string (structured arrays are not supported)"),
        None => bail!(".npy header has no `descr`"),
    };
    match dict.get("fortran_order") {
        Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => bail!(
            "array is stored in Fortran (column-major) order, which is not supported; save it C-ordered (numpy.ascontiguousarray)"
        ),
        _ => bail!(".npy header has no boolean `fortran_order`"),
    }
    let shape = match dict.get("shape") {
        Some(Value::Tuple(v)) => v.clone(),
        _ => bail!(".npy header has no `shape` tuple"),
    };
    Ok((descr, shape, end))
}

/// The element type of a `.npy` dtype string.
fn npy_elem(descr: &str) -> Result<DType> {
    Ok(match descr {
        "<f4" => DType::F32,
        "<f8" => DType::F64,
        "<i8" => DType::I64,
        "<i4" => DType::I32,
        "|u1" | "<u1" => DType::U8,
        "|i1" | "<i1" => DType::I8,
        "|b1" | "<b1" => DType::Bool,
        d if d.starts_with('>') => bail!(
            "dtype `{d}` is big-endian, which is not supported; convert it to little-endian (e.g. arr.astype('<{}'))",
            &d[1..]
        ),
        d => bail!("dtype `{d}` is not supported (supported: <f4 <f8 <i8 <i4 |u1 |b1)"),
    })
}

/// Parses a `.npy` file: versions 1.0, 2.0 and 3.0, little-endian `<f4 <f8 <i8 <i4`, `|u1`,
/// `|b1` (and `<u1`/`<b1`/`|i1`), C order.
pub fn parse_npy(bytes: &[u8]) -> Result<RawArray> {
    let (descr, shape, end) = parse_npy_header(bytes)?;
    let elem = npy_elem(&descr)?;
    // The shape is checked against the bytes the file holds before anything is
    // allocated for it (with checked products: `count * size` overflowed for shape
    // (2^64-1,) of <i4, found by pipewright-fuzz, fuzz/crashes/npy-099c2c0f26a45e3c.bin).
    let data = &bytes[end..];
    let want = shape.iter().try_fold(elem.size(), |acc, &d| acc.checked_mul(d as usize));
    if want != Some(data.len()) {
        let want = want.map_or("more than 2^64".to_string(), |w| w.to_string());
        bail!("the header's shape {shape:?} of {descr} needs {want} bytes of data, but the file holds {}", data.len());
    }
    if elem == DType::Bool {
        if let Some(b) = data.iter().find(|&&b| b > 1) {
            bail!("bool array holds byte {b} (expected 0 or 1)");
        }
    }
    Ok(RawArray { elem, shape: shape.iter().map(|&d| d as i64).collect(), data: data.to_vec() })
}

/// Writes a `.npy` (version 1.0) file's bytes for a little-endian array: the inverse of
/// [`parse_npy`].
pub fn encode_npy(a: &RawArray) -> Result<Vec<u8>> {
    let descr = match a.elem {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::I64 => "<i8",
        DType::I32 => "<i4",
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::Bool => "|b1",
        e => bail!("cannot write {e} arrays to .npy"),
    };
    let mut shape = String::from("(");
    for d in &a.shape {
        write!(shape, "{d}, ").unwrap();
    }
    if a.shape.len() > 1 {
        shape.truncate(shape.len() - 2);
    } else if a.shape.len() == 1 {
        shape.truncate(shape.len() - 1);
    }
    shape.push(')');
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Pad with spaces so the data starts on a 64-byte boundary; the header ends in '\n'.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + a.data.len());
    out.extend_from_slice(NPY_MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&a.data);
    Ok(out)
}

#[derive(Clone, Debug, PartialEq)]
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<u64>),
    Other,
}

/// The header's Python dict literal: string keys; values strings, True/False, tuples of
/// ints (anything else, e.g. a structured descr list, parses as `Other`).
fn parse_header(s: &str) -> Result<BTreeMap<String, Value>> {
    let b = s.trim().as_bytes();
    let mut p = 0usize;
    let skip_ws = |p: &mut usize| {
        while *p < b.len() && (b[*p] as char).is_whitespace() {
            *p += 1;
        }
    };
    let expect = |p: &mut usize, c: u8| -> Result<()> {
        skip_ws(p);
        if *p < b.len() && b[*p] == c {
            *p += 1;
            Ok(())
        } else {
            bail!("expected `{}` at offset {}", c as char, *p)
        }
    };
    fn string(b: &[u8], p: &mut usize) -> Result<String> {
        let q = b[*p];
        *p += 1;
        let st = *p;
        while *p < b.len() && b[*p] != q {
            *p += 1;
        }
        if *p >= b.len() {
            bail!("unterminated string");
        }
        let v = String::from_utf8(b[st..*p].to_vec()).map_err(|_| anyhow!("a string that is not UTF-8"))?;
        *p += 1;
        Ok(v)
    }
    let mut out = BTreeMap::new();
    expect(&mut p, b'{')?;
    loop {
        skip_ws(&mut p);
        if p < b.len() && b[p] == b'}' {
            break;
        }
        if p >= b.len() || (b[p] != b'\'' && b[p] != b'"') {
            bail!("expected a string key at offset {p}");
        }
        let key = string(b, &mut p)?;
        expect(&mut p, b':')?;
        skip_ws(&mut p);
        let value = if p < b.len() && (b[p] == b'\'' || b[p] == b'"') {
            Value::Str(string(b, &mut p)?)
        } else if b[p..].starts_with(b"True") {
            p += 4;
            Value::Bool(true)
        } else if b[p..].starts_with(b"False") {
            p += 5;
            Value::Bool(false)
        } else if p < b.len() && b[p] == b'(' {
            p += 1;
            let mut dims = Vec::new();
            loop {
                skip_ws(&mut p);
                if p < b.len() && b[p] == b')' {
                    p += 1;
                    break;
                }
                let st = p;
                while p < b.len() && b[p].is_ascii_digit() {
                    p += 1;
                }
                let txt = std::str::from_utf8(&b[st..p]).unwrap();
                // numpy may write `2L` in old Python 2 files.
                if p < b.len() && b[p] == b'L' {
                    p += 1;
                }
                dims.push(txt.parse::<u64>().map_err(|_| anyhow!("bad shape entry at offset {st}"))?);
                skip_ws(&mut p);
                if p < b.len() && b[p] == b',' {
                    p += 1;
                }
            }
            Value::Tuple(dims)
        } else {
            // Skip an unsupported value (e.g. a list descr) up to the next top-level comma.
            let mut depth = 0i32;
            while p < b.len() {
                match b[p] {
                    b'[' | b'(' | b'{' => depth += 1,
                    b']' | b')' => depth -= 1,
                    b'}' if depth == 0 => break,
                    b'}' => depth -= 1,
                    b',' if depth == 0 => break,
                    _ => {}
                }
                p += 1;
            }
            Value::Other
        };
        out.insert(key, value);
        skip_ws(&mut p);
        if p < b.len() && b[p] == b',' {
            p += 1;
        }
    }
    Ok(out)
}

/// numpy's dtype string for an element type `.npz` files can hold (`None`: numpy has none).
fn npy_descr(elem: DType) -> Option<&'static str> {
    Some(match elem {
        DType::F32 => "<f4",
        DType::F16 => "<f2",
        DType::F64 => "<f8",
        DType::I64 => "<i8",
        DType::I32 => "<i4",
        DType::I16 => "<i2",
        DType::I8 => "|i1",
        DType::U8 => "|u1",
        DType::Bool => "|b1",
        _ => return None,
    })
}

/// One `.npy` file (format 1.0): the magic, a header padded so the data starts at a
/// multiple of 64 bytes, then the little-endian data.
fn npy_bytes(descr: &str, shape: &[i64], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // magic (6) + version (2) + header length (2) + header + '\n'
    let pad = (64 - (10 + header.len() + 1) % 64) % 64;
    header.push_str(&" ".repeat(pad));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// An `.npz` archive (stored, not compressed) of the named tensors, readable by
/// `numpy.load` and by [`Dataset::from_npz`]. bfloat16 tensors are written as float32
/// (numpy has no bfloat16); element types numpy lacks otherwise are an error naming the
/// array.
pub fn npz_bytes(arrays: &[(String, Tensor)]) -> Result<Vec<u8>> {
    use std::io::Write as _;
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored).large_file(true);
    for (name, t) in arrays {
        let t = if t.kind() == Kind::BFloat16 { t.to_kind(Kind::Float) } else { t.shallow_clone() };
        let (elem, shape, data) = crate::exec::tensor_to_bytes(&t).map_err(|e| anyhow!("array `{name}`: {e}"))?;
        let descr = npy_descr(elem).ok_or_else(|| anyhow!("array `{name}`: element type {elem} has no numpy dtype"))?;
        zip.start_file(format!("{name}.npy"), opts).map_err(|e| anyhow!("array `{name}`: {e}"))?;
        zip.write_all(&npy_bytes(descr, &shape, &data)).map_err(|e| anyhow!("array `{name}`: {e}"))?;
    }
    Ok(zip.finish().map_err(|e| anyhow!("{e}"))?.into_inner())
}
