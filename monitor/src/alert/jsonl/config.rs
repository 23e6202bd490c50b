use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonlConfig {
    /// File to append notifications to, one JSON object per line; `-` is standard output.
    pub path: PathBuf,
}

impl JsonlConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.path.as_os_str().is_empty() {
            return Err("alerts jsonl path is empty".into());
        }
        if self.path.as_os_str() != "-"
            && let Some(parent) = self.path.parent().filter(|p| !p.as_os_str().is_empty())
            && !parent.is_dir()
        {
            return Err(format!(
                "alerts jsonl: directory {} does not exist",
                parent.display()
            ));
        }
        Ok(())
    }
}
