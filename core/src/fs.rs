//! Files that appear whole or not at all: [`write_atomic`] writes to an exclusively
//! created temporary file beside the target, flushes it to disk and renames it over the
//! target. On any failure the temporary file is removed and the target is untouched, so a
//! crash or a full disk never leaves a partial file under the real name.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A file could not be written; names the target and the step that failed.
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot write ({op}): {source}", .path.display())]
pub struct WriteError {
    pub path: PathBuf,
    pub op: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// Writes `bytes` to `path` atomically (see the module docs).
pub fn write_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> Result<(), WriteError> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// Like [`write_atomic`], with the contents written by `fill` (for large outputs that are
/// produced piecewise).
pub fn write_atomic_with(path: impl AsRef<Path>, fill: impl FnOnce(&mut File) -> std::io::Result<()>) -> Result<(), WriteError> {
    let path = path.as_ref();
    let fail = |op: &'static str, source: std::io::Error| WriteError { path: path.to_path_buf(), op, source };
    let name = path
        .file_name()
        .ok_or_else(|| fail("write the file", std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (tmp, mut file) = create_temp(&dir, &name.to_string_lossy()).map_err(|e| fail("create a temporary file next to it", e))?;
    let result = fill(&mut file)
        .map_err(|e| fail("write the temporary file", e))
        .and_then(|()| file.sync_all().map_err(|e| fail("flush the temporary file to disk", e)))
        .and_then(|()| fs::rename(&tmp, path).map_err(|e| fail("rename the temporary file into place", e)));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    // Make the rename itself durable; best effort (not every platform allows it).
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// A new, exclusively created `.NAME.PID.N.tmp` in `dir`.
fn create_temp(dir: &Path, name: &str) -> std::io::Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(".tmp")).collect()
    }

    #[test]
    fn writes_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.txt");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert!(leftovers(dir.path()).is_empty());
    }

    #[test]
    fn a_failed_write_leaves_the_target_and_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.txt");
        write_atomic(&path, b"kept").unwrap();
        let e = write_atomic_with(&path, |f| {
            f.write_all(b"partial")?;
            Err(std::io::Error::other("disk full"))
        })
        .unwrap_err();
        assert_eq!(e.to_string(), format!("{}: cannot write (write the temporary file): disk full", path.display()));
        assert_eq!(fs::read(&path).unwrap(), b"kept");
        assert!(leftovers(dir.path()).is_empty());
    }

    #[test]
    fn a_failed_rename_names_the_target() {
        let dir = tempfile::tempdir().unwrap();
        // The target is a non-empty folder, so the rename fails.
        let path = dir.path().join("stage0.pwm");
        fs::create_dir_all(path.join("occupied")).unwrap();
        let e = write_atomic(&path, b"x").unwrap_err();
        assert!(e.to_string().contains("stage0.pwm: cannot write (rename the temporary file into place)"), "{e}");
        assert!(leftovers(dir.path()).is_empty());
    }
}

/// Checks that `name`, read from a manifest (`pipeline.toml`, a checkpoint's), names a
/// file inside the manifest's own folder: not empty, no path separator, not `.`/`..` or
/// hidden, not absolute. An edited manifest must not make a reader open files elsewhere.
pub fn plain_name(name: &str) -> Result<(), String> {
    let plain = !name.is_empty() && !name.contains(['/', '\\', '\0']) && !name.starts_with('.') && !Path::new(name).is_absolute();
    if plain {
        Ok(())
    } else {
        Err(format!("{name:?} is not a plain file name inside the folder"))
    }
}

/// `dir/name` for a `name` read from `dir`'s manifest: a [`plain_name`] that is not a
/// symbolic link (which could lead out of the folder).
pub fn file_in(dir: &Path, name: &str) -> Result<PathBuf, String> {
    plain_name(name)?;
    let path = dir.join(name);
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_symlink() => Err(format!("{name:?} is a symbolic link; the folder's files must be its own")),
        _ => Ok(path),
    }
}

#[cfg(test)]
mod plain_name_tests {
    use super::plain_name;

    #[test]
    fn only_names_inside_the_folder_are_plain() {
        assert!(plain_name("stage0.pwm").is_ok());
        for bad in ["", "../../etc/passwd", "/etc/passwd", "a/b", "a\\b", ".hidden", "..", "."] {
            assert_eq!(plain_name(bad).unwrap_err(), format!("{bad:?} is not a plain file name inside the folder"));
        }
    }
}
