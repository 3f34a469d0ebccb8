//! The configuration words: each is one closed enum with one spelling, used by flags,
//! printed output, plan files, build manifests and stage-module headers alike.
//!
//! Every word type has [`Display`](std::fmt::Display) and [`FromStr`](std::str::FromStr)
//! (the same spelling both ways), serde as that string, `ALL` (every value, in order), and
//! with the `clap` feature `clap::ValueEnum` (so `--help` lists the values with a line
//! each). [`word_enum!`] generates all of that from one table per type.

use std::fmt;

/// A word that is not one of its type's values.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {given:?}: expected one of {}", .expected.join(", "))]
pub struct UnknownWord {
    /// What kind of word was expected (`schedule`, `recompute mode`, ...).
    pub what: &'static str,
    pub given: String,
    pub expected: Vec<&'static str>,
}

/// What every word type is: its values and what it is called (for generic lists).
pub trait Word: Copy + PartialEq + fmt::Display + std::str::FromStr<Err = UnknownWord> + 'static {
    const ALL: &'static [Self];
    const WHAT: &'static str;
}

/// A comma-separated list of words of one type, or `all` for every value:
/// `--schedule 2bw,flush`, `--schedule all`. The one form every list-valued flag takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WordList<T>(pub Vec<T>);

impl<T: Word> WordList<T> {
    /// Every value of the type.
    pub fn all() -> WordList<T> {
        WordList(T::ALL.to_vec())
    }
}

impl<T: Word> std::str::FromStr for WordList<T> {
    type Err = UnknownWord;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "all" {
            return Ok(Self::all());
        }
        s.split(',').map(|w| w.trim().parse::<T>()).collect::<Result<Vec<T>, UnknownWord>>().map(WordList).map_err(|mut e| {
            e.expected.push("all");
            e
        })
    }
}

impl<T: Word> fmt::Display for WordList<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.0.iter().map(|w| w.to_string()).collect();
        f.write_str(&names.join(","))
    }
}

/// Defines a word enum: variants with their one spelling and a help line.
macro_rules! word_enum {
    (
        $(#[$meta:meta])*
        $what:literal pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $word:literal, $help:literal; )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* #[doc = $help] $variant, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The one spelling of this value.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $word,)+
                }
            }

            /// One line saying what this value means.
            pub fn help(self) -> &'static str {
                match self {
                    $($name::$variant => $help,)+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl $crate::words::Word for $name {
            const ALL: &'static [$name] = $name::ALL;
            const WHAT: &'static str = $what;
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::words::UnknownWord;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $name::ALL.iter().copied().find(|v| v.name() == s).ok_or_else(|| $crate::words::UnknownWord {
                    what: $what,
                    given: s.to_string(),
                    expected: $name::ALL.iter().map(|v| v.name()).collect(),
                })
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <::std::borrow::Cow<'de, str> as ::serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(::serde::de::Error::custom)
            }
        }

        #[cfg(feature = "clap")]
        impl ::clap::ValueEnum for $name {
            fn value_variants<'a>() -> &'a [Self] {
                $name::ALL
            }

            fn to_possible_value(&self) -> Option<::clap::builder::PossibleValue> {
                Some(::clap::builder::PossibleValue::new(self.name()).help(self.help()))
            }
        }
    };
}

word_enum! {
    /// How microbatches are interleaved and when weights are updated.
    "schedule" pub enum Schedule {
        TwoBw = "2bw", "PipeDream-2BW: 1F1B without flushes, two weight versions, 1-stale updates";
        Flush = "flush", "PipeDream-Flush: 1F1B within each batch, then a flush and a vanilla update";
        GPipe = "gpipe", "GPipe: all forwards of a batch, then all backwards, then a vanilla update";
        ZbH1 = "zb-h1", "zero bubble ZB-H1: 1F1B with each backward split into its input gradient and its weight gradient, the weight gradients deferred into the flush; a vanilla update";
        ZbH2 = "zb-h2", "zero bubble ZB-H2: ZB-H1 with more warm-up forwards and up to 2d - 1 microbatches held per stage, so the weight gradients fill the batch's ends; a vanilla update";
        Interleaved2 = "interleaved-2", "interleaved 1F1B (Megatron's virtual stages): each worker runs 2 stages, the pipeline's k-th and (k + d)-th, in one 1F1B order within each batch; a vanilla update";
        Interleaved4 = "interleaved-4", "interleaved 1F1B with 4 stages per worker (stages k, k + d, k + 2d, k + 3d of worker k); a vanilla update";
        ZbV = "zb-v", "zero bubble ZB-V: 2 stages per worker placed in a V (worker k runs stages k and 2p - 1 - k of 2p), each backward split into input and weight gradients; a vanilla update";
    }
}

impl Schedule {
    /// Weight versions a stage holds of each trainable weight under this schedule.
    pub fn weight_versions(self) -> u32 {
        match self {
            Schedule::TwoBw => 2,
            Schedule::Flush | Schedule::GPipe | Schedule::ZbH1 | Schedule::ZbH2 | Schedule::Interleaved2 | Schedule::Interleaved4 | Schedule::ZbV => 1,
        }
    }

    /// The update rule of trainable weights under this schedule.
    pub fn update_rule(self) -> UpdateRule {
        match self {
            Schedule::TwoBw => UpdateRule::TwoBw,
            Schedule::Flush | Schedule::GPipe | Schedule::ZbH1 | Schedule::ZbH2 | Schedule::Interleaved2 | Schedule::Interleaved4 | Schedule::ZbV => UpdateRule::Vanilla,
        }
    }

    /// Whether the schedule needs at least as many microbatches per batch as stages
    /// (1F1B: every stage must have a microbatch to work on in the steady state).
    pub fn needs_m_at_least_d(self) -> bool {
        matches!(self, Schedule::TwoBw | Schedule::Flush | Schedule::ZbH1 | Schedule::ZbH2)
    }

    /// Stages each worker runs (Megatron's virtual pipeline stages): a pipeline of `depth`
    /// stages runs on `depth / v` workers ([`Schedule::worker_of`]). 1 for every schedule
    /// but interleaved 1F1B and ZB-V.
    pub fn virtual_stages(self) -> usize {
        match self {
            Schedule::Interleaved2 | Schedule::ZbV => 2,
            Schedule::Interleaved4 => 4,
            Schedule::TwoBw | Schedule::Flush | Schedule::GPipe | Schedule::ZbH1 | Schedule::ZbH2 => 1,
        }
    }

    /// The worker that runs stage `stage` of a pipeline of `depth` stages (a multiple of
    /// [`Schedule::virtual_stages`]), of `p = depth / v`: round robin under interleaved 1F1B
    /// (`stage % p`), a V under ZB-V (worker `k` runs stages `k` and `2p - 1 - k`, so the
    /// first and the last stage share worker 0), the stage itself otherwise.
    pub fn worker_of(self, stage: usize, depth: usize) -> usize {
        let p = (depth / self.virtual_stages()).max(1);
        match self {
            Schedule::ZbV if stage >= p => (2 * p - 1).saturating_sub(stage),
            _ => stage % p,
        }
    }

    /// The worker of every stage of a pipeline of `depth` ([`Schedule::worker_of`]).
    pub fn placement(self, depth: usize) -> Vec<usize> {
        (0..depth).map(|k| self.worker_of(k, depth)).collect()
    }

    /// The stages worker `worker` runs, in pipeline order ([`Schedule::worker_of`]).
    pub fn stages_of(self, worker: usize, depth: usize) -> Vec<usize> {
        (0..depth).filter(|&k| self.worker_of(k, depth) == worker).collect()
    }

    /// The workers a pipeline of `depth` stages runs on under this schedule, or why it
    /// cannot: interleaved 1F1B needs a multiple of its stages per worker.
    pub fn workers(self, depth: usize) -> Result<usize, String> {
        let v = self.virtual_stages();
        if depth == 0 || depth % v != 0 {
            return Err(format!("{self} runs {v} stages per worker, so the pipeline's depth must be a multiple of {v} (it is {depth}): compile the model with --stages {}", depth.div_ceil(v).max(1) * v));
        }
        Ok(depth / v)
    }

    /// Whether each backward runs as two ops, the input gradient first and the weight
    /// gradient later ([`crate::schedule::Op`]).
    pub fn splits_backward(self) -> bool {
        matches!(self, Schedule::ZbH1 | Schedule::ZbH2 | Schedule::ZbV)
    }

    /// Whether stage `stage` computes its backward in two halves under this schedule. The
    /// first stage's inputs are data, so it sends no input gradient and nothing waits on
    /// its input-gradient op: that op only takes the output gradients, and its
    /// weight-gradient op runs the whole backward in one pass (a split costs a second
    /// pass of the autograd engine and the kept gradients between them, for nothing).
    /// Its graph is held until that op either way.
    pub fn splits_stage_backward(self, stage: usize) -> bool {
        self.splits_backward() && stage > 0
    }

    /// Whether stage `stage`, if it holds tied weights, begins their gradient sums over
    /// the tied stages after its batch's last input gradient rather than at its step: a
    /// stage that splits its backward forms the tied weights' gradients with the input
    /// gradients, so they are complete there while its weight gradients still run. The
    /// runtime does so, and the simulator replays it.
    pub fn sums_tied_early(self, stage: usize) -> bool {
        self.splits_stage_backward(stage)
    }
}

word_enum! {
    /// How much of a stage's forward is recomputed before its backward.
    "recompute mode" pub enum Recompute {
        None = "none", "stash every activation the backward needs";
        Selective = "selective", "stash matmul/conv outputs and stage inputs, recompute the rest";
        Full = "full", "stash only stage inputs, rerun the stage's forward before its backward";
    }
}

word_enum! {
    /// The update rule of a weight: decided by the weight-versioning pass, carried in the
    /// stage modules, executed by the runtime.
    "update rule" pub enum UpdateRule {
        Constant = "constant", "never updated by the optimizer (constants, running statistics)";
        Vanilla = "vanilla", "W(t+1) = W(t) - lr * grad f(W(t)), once per batch after the flush";
        TwoBw = "2bw", "W(t+1) = W(t) - lr * grad f(W(t-1)), once per batch (double-buffered)";
    }
}

impl UpdateRule {
    /// The weight version (updates applied) microbatch `j` (0-based, global) runs its
    /// forward and backward with, for `m` microbatches per batch: 2BW `max(floor(j/m) - 1,
    /// 0)`, vanilla `floor(j/m)`, constants always 0.
    pub fn version_for(self, j: u64, m: u64) -> u64 {
        let t = j / m.max(1);
        match self {
            UpdateRule::TwoBw => t.saturating_sub(1),
            UpdateRule::Vanilla => t,
            UpdateRule::Constant => 0,
        }
    }

    /// Whether a stage under this rule lets its step's gradient sums go on in the
    /// background and defers its update to the first forward that needs it: under 2BW, a
    /// stage with replicas, or tied to a stage before it. The first stage of a tied group
    /// reaches the step last (the backward reaches it last), so it sums there. Fixed by
    /// the build, not by which member of a sum arrives last, so that where a stage updates
    /// and what it holds meanwhile do not vary from run to run. The runtime and the
    /// simulator both decide by this.
    pub fn defers_update(self, replicas: usize, tied_to_an_earlier_stage: bool) -> bool {
        self == UpdateRule::TwoBw && (replicas > 1 || tied_to_an_earlier_stage)
    }
}

word_enum! {
    /// The optimizer.
    "optimizer" pub enum Optimizer {
        Sgd = "sgd", "SGD, with optional momentum and weight decay";
        Adam = "adam", "Adam, weight decay added to the gradient";
        AdamW = "adamw", "AdamW, decoupled weight decay";
    }
}

impl Optimizer {
    /// State tensors kept per weight (momentum buffer; Adam's two moments).
    pub fn state_tensors(self, momentum: bool) -> u32 {
        match self {
            Optimizer::Sgd => u32::from(momentum),
            Optimizer::Adam | Optimizer::AdamW => 2,
        }
    }
}

word_enum! {
    /// The training loss, applied to one model output.
    "loss" pub enum Loss {
        CrossEntropy = "cross-entropy", "mean cross-entropy of logits [N, ..., C] against class ids [N, ...]";
        Mse = "mse", "mean squared error against targets of the output's shape";
        Output = "output", "the output is the loss itself (a scalar the model computes)";
    }
}

word_enum! {
    /// How the learning rate decays after the warm-up.
    "learning-rate decay" pub enum Decay {
        Constant = "constant", "keep the base rate";
        Linear = "linear", "linear from the base rate to 0 at the last step";
        Cosine = "cosine", "cosine from the base rate to 0 at the last step";
    }
}

word_enum! {
    /// How the planner balances stages.
    "balance" pub enum Balance {
        Optimal = "optimal", "the exact partitioner on predicted stage time, within the memory limit";
        Params = "params", "greedy split with equal parameter bytes per stage";
        Flops = "flops", "greedy split with equal forward+backward flops per stage";
        Profile = "profile", "greedy split with equal node time from a measured profile";
        Nodes = "nodes", "equal node counts per stage";
    }
}

word_enum! {
    /// How the importer treats the batch axis.
    "batch mode" pub enum BatchMode {
        Auto = "auto", "axis 0 of the graph inputs becomes the symbol N when all inputs share it";
        Fixed = "fixed", "keep every extent as exported";
    }
}

word_enum! {
    /// The passes of `pipewright compile`, in order.
    "pass" pub enum PassName {
        Import = "import", "read the ONNX file, infer shapes, fold constants, verify";
        Plan = "plan", "choose w, d, b, m, recomputation, schedule and the stage cuts";
        Partition = "partition", "assign nodes to stages and insert stage boundaries";
        Recompute = "recompute", "decide which activations are stashed or recomputed";
        WeightVersioning = "weight-versioning", "give every weight its versions and update rule";
        Lower = "lower", "lower each stage to a stage program";
    }
}

/// `--print-after PASS|all`: which pass's output a command prints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrintAfter {
    #[default]
    None,
    Pass(PassName),
    All,
}

impl std::str::FromStr for PrintAfter {
    type Err = UnknownWord;

    /// A pass name, or `all`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "all" {
            return Ok(PrintAfter::All);
        }
        s.parse::<PassName>().map(PrintAfter::Pass).map_err(|mut e| {
            e.expected.push("all");
            e
        })
    }
}

impl fmt::Display for PrintAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PrintAfter::None => f.write_str("none"),
            PrintAfter::Pass(p) => write!(f, "{p}"),
            PrintAfter::All => f.write_str("all"),
        }
    }
}

word_enum! {
    /// Where a generated model (`pipewright synth`) keeps its weights.
    "weight storage" pub enum Storage {
        Inline = "inline", "in the ONNX file (protobuf limits the file to 2 GiB)";
        External = "external", "streamed into MODEL.onnx.data beside the model, which stays small";
        ShapesOnly = "none", "declared in MODEL.onnx.data, which is not written: shapes only, for plan and simulate";
    }
}

word_enum! {
    /// The element type training computes in. Master weights and optimizer state stay
    /// fp32 whatever the choice; each forward casts the weights to it and the gradients
    /// come back to fp32 for the update.
    "precision" pub enum Precision {
        Fp32 = "fp32", "compute in fp32 (default)";
        Bf16 = "bf16", "compute in bfloat16, fp32 master weights and optimizer state";
        Fp16 = "fp16", "compute in float16 with dynamic loss scaling, fp32 master weights and optimizer state";
    }
}

impl Precision {
    /// Bytes of one element of the compute type.
    pub fn compute_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }

    /// Bytes of an activation per byte the model's fp32 graph gives it: activations are
    /// computed, stashed and sent between stages in the compute type (each forward casts
    /// the weights and the inputs to it). The memory model, the kernels' traffic and every
    /// transfer of activations scale by it.
    pub fn activation_share(self) -> f64 {
        self.compute_bytes() as f64 / 4.0
    }

    /// Whether the weights are cast to a lower type for the forward (so a stage also
    /// holds the cast copy of the weights it computes with).
    pub fn is_mixed(self) -> bool {
        self != Precision::Fp32
    }
}

word_enum! {
    /// How a gradient sum over a group of ranks (a stage's replicas, the stages sharing a
    /// tied weight) is taken: what the MPI runtime does and what the simulator charges.
    "gradient sum" pub enum Reduction {
        Collective = "collective", "MPI's own all-reduce (a ring or tree: each rank moves about twice the payload whatever the group's size); default";
        FixedOrder = "fixed-order", "every part gathered to the group's first rank, added in the embedded executor's order and sent back (bit-identical to it; that rank moves 2 (w - 1) payloads)";
    }
}

impl Default for Reduction {
    fn default() -> Self {
        Reduction::Collective
    }
}

word_enum! {
    /// How the `w x d` workers of a data-parallel pipeline are numbered (MPI ranks,
    /// embedded devices, the planner's servers): which of a stage's replicas or a
    /// replica's stages sit on consecutive workers, and so share a server
    /// ([`crate::Layout`]).
    "placement" pub enum Placement {
        StageMajor = "stage-major", "worker stage * w + replica: a stage's replicas on consecutive workers, so their gradient sums stay in a server and the boundaries cross (default)";
        ReplicaMajor = "replica-major", "worker replica * d + stage: each pipeline on consecutive workers, so its boundaries stay in a server and the gradient sums cross";
    }
}

impl Default for Placement {
    fn default() -> Self {
        Placement::StageMajor
    }
}

impl Placement {
    /// The default numbering (what files written before placements existed mean, so
    /// serialisers leave it out).
    pub fn is_stage_major(&self) -> bool {
        *self == Placement::StageMajor
    }
}

word_enum! {
    /// What training does with a step whose loss or gradients are not finite (NaN or
    /// infinite).
    "non-finite step policy" pub enum NonFinite {
        Stop = "stop", "stop with the divergence error, nothing of the step saved (default)";
        Skip = "skip", "drop the step's update in every stage and go on (stop after --max-skips in a row)";
    }
}

word_enum! {
    /// The element type of a flat token file (`train --tokens`): little-endian unsigned ids.
    "token type" pub enum TokenType {
        U16 = "u16", "2-byte ids (vocabularies up to 65,536, GPT-2's included; nanoGPT's train.bin)";
        U32 = "u32", "4-byte ids";
    }
}

word_enum! {
    /// The order training visits the samples (or a token stream's windows) in.
    "data order" pub enum DataOrder {
        Shuffle = "shuffle", "a fresh seeded random order every epoch (default)";
        Sequential = "sequential", "the file's own order, every epoch alike";
    }
}

impl TokenType {
    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            TokenType::U16 => 2,
            TokenType::U32 => 4,
        }
    }
}

/// Skipped steps in a row after which `--on-nonfinite skip` stops (`--max-skips`).
pub const DEFAULT_MAX_SKIPS: usize = 10;

impl Default for NonFinite {
    fn default() -> Self {
        NonFinite::Stop
    }
}

impl Default for Precision {
    fn default() -> Self {
        Precision::Fp32
    }
}

impl Default for BatchMode {
    /// Import finds the batch axis unless told to keep the exported extents.
    fn default() -> Self {
        BatchMode::Auto
    }
}

word_enum! {
    /// A way of training on many workers that `pipewright simulate` compares: the pipeline
    /// schedules and the three baselines without pipelining.
    "scheme" pub enum Scheme {
        TwoBw = "2bw", "PipeDream-2BW (the 2bw schedule)";
        Flush = "flush", "PipeDream-Flush (the flush schedule)";
        GPipe = "gpipe", "GPipe (the gpipe schedule)";
        ZbH1 = "zb-h1", "zero bubble ZB-H1 (the zb-h1 schedule)";
        ZbH2 = "zb-h2", "zero bubble ZB-H2 (the zb-h2 schedule)";
        Interleaved2 = "interleaved-2", "interleaved 1F1B, 2 stages per worker (the interleaved-2 schedule)";
        Interleaved4 = "interleaved-4", "interleaved 1F1B, 4 stages per worker (the interleaved-4 schedule)";
        ZbV = "zb-v", "zero bubble ZB-V, 2 stages per worker in a V (the zb-v schedule)";
        ModelParallel = "model-parallel", "inter-layer model parallelism without pipelining: one microbatch in the pipeline at a time";
        DataParallel = "data-parallel", "data parallelism alone: every worker holds the whole model (where it fits)";
        TensorParallel = "tensor-parallel", "tensor model parallelism (Megatron): each layer split over t GPUs of a server, data parallelism across the groups";
    }
}

impl Scheme {
    /// The pipeline schedule this scheme runs, for those that are schedules.
    pub fn schedule(self) -> Option<Schedule> {
        match self {
            Scheme::TwoBw => Some(Schedule::TwoBw),
            Scheme::Flush => Some(Schedule::Flush),
            Scheme::GPipe => Some(Schedule::GPipe),
            Scheme::ZbH1 => Some(Schedule::ZbH1),
            Scheme::ZbH2 => Some(Schedule::ZbH2),
            Scheme::Interleaved2 => Some(Schedule::Interleaved2),
            Scheme::Interleaved4 => Some(Schedule::Interleaved4),
            Scheme::ZbV => Some(Schedule::ZbV),
            Scheme::ModelParallel | Scheme::DataParallel | Scheme::TensorParallel => None,
        }
    }
}

impl From<Schedule> for Scheme {
    fn from(s: Schedule) -> Scheme {
        match s {
            Schedule::TwoBw => Scheme::TwoBw,
            Schedule::Flush => Scheme::Flush,
            Schedule::GPipe => Scheme::GPipe,
            Schedule::ZbH1 => Scheme::ZbH1,
            Schedule::ZbH2 => Scheme::ZbH2,
            Schedule::Interleaved2 => Scheme::Interleaved2,
            Schedule::Interleaved4 => Scheme::Interleaved4,
            Schedule::ZbV => Scheme::ZbV,
        }
    }
}

/// Joins the spellings of `values` for messages: `2bw, flush, gpipe`.
pub fn spellings<T: fmt::Display>(values: &[T]) -> String {
    values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_round_trips_through_text_and_serde() {
        fn check<T>(all: &[T])
        where
            T: Copy + PartialEq + fmt::Debug + fmt::Display + std::str::FromStr + serde::Serialize + serde::de::DeserializeOwned,
            T::Err: fmt::Debug,
        {
            for &v in all {
                assert_eq!(v.to_string().parse::<T>().unwrap(), v);
                let json = serde_json::to_string(&v).unwrap();
                assert_eq!(json, format!("{:?}", v.to_string()));
                assert_eq!(serde_json::from_str::<T>(&json).unwrap(), v);
            }
        }
        check(Schedule::ALL);
        check(Recompute::ALL);
        check(UpdateRule::ALL);
        check(Optimizer::ALL);
        check(Loss::ALL);
        check(Decay::ALL);
        check(Balance::ALL);
        check(BatchMode::ALL);
        check(PassName::ALL);
        check(Precision::ALL);
        check(Reduction::ALL);
        check(Placement::ALL);
        check(Scheme::ALL);
        check(NonFinite::ALL);
        check(TokenType::ALL);
        check(DataOrder::ALL);
        check(Storage::ALL);
    }

    /// Lists take `a,b` or `all`; an unknown word names the type and offers `all`;
    /// `--print-after` takes a pass or `all`.
    #[test]
    fn lists_and_print_after_parse_one_way() {
        assert_eq!("2bw,gpipe".parse::<WordList<Schedule>>(), Ok(WordList(vec![Schedule::TwoBw, Schedule::GPipe])));
        assert_eq!("all".parse::<WordList<Schedule>>(), Ok(WordList::all()));
        assert_eq!(WordList(vec![Schedule::Flush, Schedule::TwoBw]).to_string(), "flush,2bw");
        let e = "2bw,zigzag".parse::<WordList<Schedule>>().unwrap_err().to_string();
        assert_eq!(e, "unknown schedule \"zigzag\": expected one of 2bw, flush, gpipe, zb-h1, zb-h2, interleaved-2, interleaved-4, zb-v, all");
        assert_eq!("all".parse::<PrintAfter>(), Ok(PrintAfter::All));
        assert_eq!("plan".parse::<PrintAfter>(), Ok(PrintAfter::Pass(PassName::Plan)));
        assert!("shape-inference".parse::<PrintAfter>().unwrap_err().to_string().contains("weight-versioning, lower, all"));
    }

    #[test]
    fn tensor_parallelism_is_a_scheme_without_a_schedule() {
        assert_eq!("tensor-parallel".parse::<Scheme>(), Ok(Scheme::TensorParallel));
        assert_eq!(Scheme::TensorParallel.schedule(), None);
        assert_eq!(Scheme::ALL.last(), Some(&Scheme::TensorParallel));
    }

    #[test]
    fn one_spelling_only() {
        assert_eq!("2bw".parse::<Schedule>(), Ok(Schedule::TwoBw));
        let e = "2BW".parse::<Schedule>().unwrap_err();
        assert_eq!(e.to_string(), "unknown schedule \"2BW\": expected one of 2bw, flush, gpipe, zb-h1, zb-h2, interleaved-2, interleaved-4, zb-v");
        // The old aliases of the planner are gone: one spelling everywhere.
        assert_eq!("on".parse::<Recompute>().unwrap_err().to_string(), "unknown recompute mode \"on\": expected one of none, selective, full");
        assert_eq!("off".parse::<Recompute>().unwrap_err().to_string(), "unknown recompute mode \"off\": expected one of none, selective, full");
        let e = serde_json::from_str::<Recompute>("\"on\"").unwrap_err();
        assert!(e.to_string().contains("expected one of none, selective, full"), "{e}");
    }

    #[test]
    fn update_rules_pick_the_documented_versions() {
        // m = 4: microbatches 0..3 are batch 0, 4..7 batch 1, 8..11 batch 2.
        let versions = |r: UpdateRule| (0..12).map(|j| r.version_for(j, 4)).collect::<Vec<_>>();
        assert_eq!(versions(UpdateRule::Vanilla), [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]);
        assert_eq!(versions(UpdateRule::TwoBw), [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(versions(UpdateRule::Constant), [0; 12]);
        assert_eq!(Schedule::TwoBw.update_rule(), UpdateRule::TwoBw);
        assert_eq!(Schedule::GPipe.weight_versions(), 1);
    }

    #[test]
    fn optimizer_state() {
        assert_eq!(Optimizer::Sgd.state_tensors(false), 0);
        assert_eq!(Optimizer::Sgd.state_tensors(true), 1);
        assert_eq!(Optimizer::AdamW.state_tensors(false), 2);
    }
}
