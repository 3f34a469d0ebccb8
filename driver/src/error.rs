//! The one error type of the commands: each variant carries the library error it wraps,
//! which already names the file, node or stage.

use std::path::PathBuf;

use pipewright_codegen::build::WriteBuildError;
use pipewright_core::fs::WriteError;
use pipewright_ir::ModelError;
use pipewright_passes::manager::ManagerError;
use pipewright_passes::plan_file::PlanFileError;
use pipewright_runtime::build::BuildError;
use pipewright_runtime::module::ModuleError;

/// A command failed.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A pass failed; `model` names the model compiled.
    #[error("{}: {source}", .model.display())]
    Pass { model: PathBuf, source: ManagerError },
    #[error(transparent)]
    PlanFile(#[from] PlanFileError),
    #[error(transparent)]
    WriteBuild(#[from] WriteBuildError),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Module(#[from] ModuleError),
    #[error(transparent)]
    Write(#[from] WriteError),
    #[cfg(feature = "torch")]
    #[error(transparent)]
    Data(#[from] pipewright_runtime::data::DataError),
    #[cfg(feature = "torch")]
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[cfg(feature = "torch")]
    #[error(transparent)]
    Kernel(#[from] pipewright_runtime::exec::KernelError),
    #[cfg(feature = "torch")]
    #[error(transparent)]
    Interp(#[from] pipewright_runtime::interp::InterpError),
    #[error(transparent)]
    Lower(#[from] pipewright_codegen::LowerError),
    #[error("{}: cannot read: {source}", .path.display())]
    Read { path: PathBuf, source: std::io::Error },
    /// Anything else, with its context in the message.
    #[error("{0}")]
    Message(String),
}

impl DriverError {
    pub(crate) fn msg(text: impl Into<String>) -> DriverError {
        DriverError::Message(text.into())
    }
}
