//! The vocabulary every pipewright crate shares, defined once: the configuration words
//! ([`Schedule`], [`Recompute`], [`Optimizer`], [`Loss`], [`Decay`], [`Balance`],
//! [`BatchMode`], [`PassName`], [`UpdateRule`], [`Reduction`], [`Placement`]), the [`Device`], the
//! workers' [`Layout`] and the pipeline
//! [`Decision`] (what a compile decided and how a run resolves its shape from it); plus the small
//! utilities every stage of the tool needs ([`fs::write_atomic`], [`units::human_bytes`],
//! [`format::Header`] for versioned files), and the per-stage operation order of each
//! schedule ([`schedule::stage_ops`]) and the trace format of training runs
//! ([`timeline`]: Chrome trace, SVG timeline, bubble fractions), shared by the executor and
//! the simulator.
//!
//! It depends on no other pipewright crate, so the importer, the passes, codegen and the
//! runtime (which must not depend on the importer or the passes) all speak it.

pub mod choices;
pub mod decision;
pub mod device;
pub mod format;
pub mod fs;
pub mod layout;
pub mod lock;
pub mod metrics;
pub mod rng;
pub mod schedule;
pub mod timeline;
pub mod units;
#[macro_use]
pub mod words;

pub use choices::{FoldedImage, ImportChoices, MergedInitializer};
pub use decision::{Decision, RunFlags, RunShape, Setting, Source, DEFAULT_MICROBATCH};
pub use device::{Device, UnknownDevice};
pub use layout::Layout;
pub use words::{Balance, BatchMode, DataOrder, Decay, Loss, NonFinite, Optimizer, PassName, Placement, Precision, PrintAfter, Recompute, Reduction, Schedule, Scheme, Storage, TokenType, UnknownWord, UpdateRule, Word, WordList, DEFAULT_MAX_SKIPS};
