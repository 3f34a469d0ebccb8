//! Stage executables: a copy of the pipewright binary with one stage module appended, then
//! an 8-byte magic `PWSTAGEX` and the module's length as a little-endian u64. Run without
//! arguments the executable prints its module; with training options it runs its stage.
//! Codegen streams [`without_module`] of the binary, the module and its [`trailer`] into
//! the file ([`append_module`] does the same in memory); [`embedded_module`] finds the
//! module in the running executable.

use std::io::{Read, Seek, SeekFrom};

/// The trailer magic.
pub const EXE_MAGIC: [u8; 8] = *b"PWSTAGEX";
pub const TRAILER_LEN: usize = 16;

/// `binary` (a pipewright binary, or a stage executable, whose own module is dropped)
/// followed by `module` and the trailer.
pub fn append_module(binary: Vec<u8>, module: &[u8]) -> Vec<u8> {
    let mut out = without_module(&binary).to_vec();
    out.extend_from_slice(module);
    out.extend_from_slice(&trailer(module.len()));
    out
}

/// `bytes` without the module appended to it, if any: the bare pipewright binary.
pub fn without_module(bytes: &[u8]) -> &[u8] {
    match appended_len(bytes) {
        Some(len) => &bytes[..bytes.len() - TRAILER_LEN - len],
        None => bytes,
    }
}

/// What follows a module of `module_len` bytes at the end of a stage executable.
pub fn trailer(module_len: usize) -> [u8; TRAILER_LEN] {
    let mut t = [0u8; TRAILER_LEN];
    t[..8].copy_from_slice(&EXE_MAGIC);
    t[8..].copy_from_slice(&(module_len as u64).to_le_bytes());
    t
}

/// The length of a module appended to `bytes`, if there is one.
pub fn appended_len(bytes: &[u8]) -> Option<usize> {
    let n = bytes.len();
    if n < TRAILER_LEN || bytes[n - TRAILER_LEN..n - 8] != EXE_MAGIC {
        return None;
    }
    let len = usize::try_from(u64::from_le_bytes(bytes[n - 8..].try_into().ok()?)).ok()?;
    (len <= n - TRAILER_LEN).then_some(len)
}

/// The stage module appended to the running executable, if any.
pub fn embedded_module() -> Option<Vec<u8>> {
    let exe = std::env::current_exe().ok()?;
    let mut f = std::fs::File::open(exe).ok()?;
    let n = f.metadata().ok()?.len();
    if n < TRAILER_LEN as u64 {
        return None;
    }
    let mut trailer = [0u8; TRAILER_LEN];
    f.seek(SeekFrom::End(-(TRAILER_LEN as i64))).ok()?;
    f.read_exact(&mut trailer).ok()?;
    if trailer[..8] != EXE_MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(trailer[8..].try_into().ok()?);
    if len > n - TRAILER_LEN as u64 {
        return None;
    }
    let mut module = vec![0u8; usize::try_from(len).ok()?];
    f.seek(SeekFrom::Start(n - TRAILER_LEN as u64 - len)).ok()?;
    f.read_exact(&mut module).ok()?;
    Some(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_finds_and_replaces_a_module() {
        let exe = append_module(b"ELF binary".to_vec(), b"module one");
        assert_eq!(appended_len(&exe), Some(10));
        assert_eq!(&exe[10..20], b"module one");
        // Appending to a stage executable replaces its module.
        let again = append_module(exe, b"two");
        assert_eq!(&again[..10], b"ELF binary");
        assert_eq!(appended_len(&again), Some(3));
        assert_eq!(appended_len(b"ELF binary"), None);
        // A trailer claiming more bytes than the file has is not a module.
        let mut lying = b"xPWSTAGEX".to_vec();
        lying.extend_from_slice(&100u64.to_le_bytes());
        assert_eq!(appended_len(&lying), None);
    }
}
