//! Versioned files (plan files, build manifests): each starts with a `format` naming what
//! it is and a `version`. A reader first deserialises only this [`Header`] and checks it,
//! so a foreign file or one of another version is refused, naming what it is, before any
//! other field is read.

use serde::Deserialize;

/// The `format` and `version` fields of a versioned file (any other field is ignored).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Header {
    pub format: Option<String>,
    pub version: Option<u32>,
}

/// Why a header is not the expected one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// No `format` field (a file from before formats were named, or not one of ours).
    NoFormat,
    /// Another format.
    Foreign(String),
    /// The right format without a version.
    NoVersion,
    /// The right format at another version.
    Version(u32),
}

impl Header {
    /// Checks that the file is `format` at `version`.
    pub fn check(&self, format: &str, version: u32) -> Result<(), Mismatch> {
        match (self.format.as_deref(), self.version) {
            (Some(f), Some(v)) if f == format && v == version => Ok(()),
            (Some(f), Some(v)) if f == format => Err(Mismatch::Version(v)),
            (Some(f), None) if f == format => Err(Mismatch::NoVersion),
            (Some(f), _) => Err(Mismatch::Foreign(f.to_string())),
            (None, _) => Err(Mismatch::NoFormat),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_what_a_file_is() {
        let h = |format: Option<&str>, version: Option<u32>| Header { format: format.map(String::from), version };
        assert_eq!(h(Some("pipewright-plan"), Some(1)).check("pipewright-plan", 1), Ok(()));
        assert_eq!(h(Some("pipewright-plan"), Some(2)).check("pipewright-plan", 1), Err(Mismatch::Version(2)));
        assert_eq!(h(Some("pipewright-plan"), None).check("pipewright-plan", 1), Err(Mismatch::NoVersion));
        assert_eq!(h(Some("cargo"), Some(1)).check("pipewright-plan", 1), Err(Mismatch::Foreign("cargo".into())));
        assert_eq!(h(None, Some(1)).check("pipewright-plan", 1), Err(Mismatch::NoFormat));
        let parsed: Header = serde_json::from_str(r#"{"format": "pipewright-plan", "version": 1, "other": [1, 2]}"#).unwrap();
        assert_eq!(parsed, h(Some("pipewright-plan"), Some(1)));
    }
}
