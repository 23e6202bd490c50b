use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonlConfig {
    /// File to append notifications to, one JSON object per line; `-` is standard output.
    pub path: PathBuf,
}

/// A JSON Lines path that cannot be written.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JsonlConfigError {
    #[error("alerts jsonl path is empty")]
    EmptyPath,
    #[error("alerts jsonl: directory {} does not exist", dir.display())]
    MissingDirectory { dir: PathBuf },
}

impl JsonlConfig {
    pub fn validate(&self) -> Result<(), JsonlConfigError> {
        if self.path.as_os_str().is_empty() {
            return Err(JsonlConfigError::EmptyPath);
        }
        if self.path.as_os_str() != "-"
            && let Some(parent) = self.path.parent().filter(|p| !p.as_os_str().is_empty())
            && !parent.is_dir()
        {
            return Err(JsonlConfigError::MissingDirectory {
                dir: parent.to_path_buf(),
            });
        }
        Ok(())
    }
}
