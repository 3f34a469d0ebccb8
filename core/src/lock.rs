//! One job per folder: the advisory lock `train`, `worker` (rank 0 of a job) and `export`
//! hold on a build folder (and on a separate checkpoint folder) while they run.
//!
//! The lock is the operating system's (`flock` on the file `.pipewright.lock`): it ends
//! with its process however that process ends, so a crashed job never leaves a folder
//! locked. The file also says who holds it (host, pid, start time, command), for the
//! refusal of a second job to name the holder; a holder that ended without clearing it
//! (killed) left those words behind, and the next job takes the folder over with a note.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file inside a locked folder.
pub const LOCK_FILE: &str = ".pipewright.lock";

/// A held folder lock; dropping it clears the holder's words and releases the lock.
#[derive(Debug)]
pub struct FolderLock {
    file: File,
    path: PathBuf,
    /// The words a holder that ended without clearing them left behind.
    pub stale: Option<String>,
}

/// Why a folder could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{folder} is in use by another job ({holder}); wait for it to end, or give this job its own folder (a copy of the build, or another --checkpoint-dir)")]
    Held { folder: PathBuf, holder: String },
    #[error("cannot lock {path}: {source}")]
    Io { path: PathBuf, #[source] source: std::io::Error },
}

impl FolderLock {
    /// Locks `folder` for this process, `what` saying what it does (`train`, `export`).
    pub fn acquire(folder: &Path, what: &str) -> Result<FolderLock, LockError> {
        let path = folder.join(LOCK_FILE);
        let io = |source| LockError::Io { path: path.clone(), source };
        let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io)?;
        let mut previous = String::new();
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                // The holder writes its words right after taking the lock; they may not be
                // there yet.
                let _ = file.read_to_string(&mut previous);
                let holder = if previous.trim().is_empty() { "its holder is starting".to_string() } else { previous.trim().to_string() };
                return Err(LockError::Held { folder: folder.to_path_buf(), holder });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        file.read_to_string(&mut previous).map_err(io)?;
        let stale = Some(previous.trim().to_string()).filter(|p| !p.is_empty());
        let words = format!("{what}: host {}, pid {}, started {} (Unix time)", host(), std::process::id(), unix_now());
        file.set_len(0).and_then(|()| file.seek(SeekFrom::Start(0))).and_then(|_| file.write_all(words.as_bytes())).map_err(io)?;
        Ok(FolderLock { file, path, stale })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        // Cleared words mean "ended cleanly"; the lock itself ends with the file.
        let _ = self.file.set_len(0);
    }
}

/// This machine's name, for the holder's words.
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "unknown".into())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_a_dropped_one_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let first = FolderLock::acquire(dir.path(), "train").unwrap();
        assert!(first.stale.is_none());
        let e = FolderLock::acquire(dir.path(), "export").unwrap_err().to_string();
        assert!(e.contains(&format!("{} is in use by another job (train: host ", dir.path().display())), "{e}");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(first);
        let again = FolderLock::acquire(dir.path(), "export").unwrap();
        assert!(again.stale.is_none(), "a lock released cleanly leaves no words");
    }

    #[test]
    fn words_left_by_a_killed_holder_are_taken_over_with_a_note() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), "train: host h, pid 1, started 0 (Unix time)").unwrap();
        let lock = FolderLock::acquire(dir.path(), "train").unwrap();
        assert_eq!(lock.stale.as_deref(), Some("train: host h, pid 1, started 0 (Unix time)"));
    }
}
