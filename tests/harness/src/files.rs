use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

/// Every line of a finished JSON Lines file (missing file: none); a line that is not JSON is
/// an error.
pub fn read_jsonl(path: &Path) -> Result<Vec<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| path.display().to_string()),
    };
    // `#` lines are comments in the replay format (the `# revenant-run` header of an
    // `--events-jsonl` recording among them).
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| serde_json::from_str(l).with_context(|| format!("{}: {l}", path.display())))
        .collect()
}

/// Every complete line of a JSON Lines file still being written (missing file: none). The
/// text after the last newline is a line being written: it is left for the next read. A
/// complete line that is not JSON is a defect of the writer and panics, naming the file.
pub fn read_jsonl_so_far(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| {
                panic!("{}: a line that is not JSON ({e}): {l}", path.display())
            })
        })
        .collect()
}

/// The last `n` lines of a log file (for error messages).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Follows a JSON Lines file as it grows, yielding complete lines only.
pub struct JsonlTail {
    path: PathBuf,
    pos: u64,
    partial: String,
}

impl JsonlTail {
    pub fn new(path: &Path) -> JsonlTail {
        JsonlTail {
            path: path.to_path_buf(),
            pos: 0,
            partial: String::new(),
        }
    }

    pub fn poll(&mut self) -> Vec<Value> {
        let Ok(mut f) = File::open(&self.path) else {
            return Vec::new();
        };
        if f.seek(SeekFrom::Start(self.pos)).is_err() {
            return Vec::new();
        }
        let mut buf = String::new();
        let n = f.read_to_string(&mut buf).unwrap_or(0);
        self.pos += n as u64;
        self.partial.push_str(&buf);
        let mut out = Vec::new();
        while let Some(i) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=i).collect();
            if let Ok(v) = serde_json::from_str(line.trim()) {
                out.push(v);
            }
        }
        out
    }
}

/// A scratch directory under the system temp dir, removed on Drop (kept with
/// `PD_SIM_KEEP_SCRATCH` set, to look at the logs).
pub struct ScratchDir(pub PathBuf);

impl ScratchDir {
    pub fn new(tag: &str) -> Result<ScratchDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let p = std::env::temp_dir().join(format!("pd-sim-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).with_context(|| p.display().to_string())?;
        Ok(ScratchDir(p))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if std::env::var_os("PD_SIM_KEEP_SCRATCH").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_yields_complete_lines_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let mut t = JsonlTail::new(&p);
        assert!(t.poll().is_empty());
        std::fs::write(&p, "{\"a\":1}\n{\"b\"").unwrap();
        assert_eq!(t.poll().len(), 1);
        std::fs::write(&p, "{\"a\":1}\n{\"b\":2}\n").unwrap();
        assert_eq!(t.poll(), vec![serde_json::json!({"b": 2})]);
    }

    #[test]
    fn strict_reader_rejects_what_the_lenient_one_skips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        assert!(read_jsonl(&p).unwrap().is_empty());
        std::fs::write(&p, "{\"a\":1}\n{\"b\"").unwrap();
        assert!(read_jsonl(&p).is_err());
        assert_eq!(read_jsonl_so_far(&p), vec![serde_json::json!({"a": 1})]);
    }

    #[test]
    fn a_line_still_being_written_is_left_for_the_next_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        // A writer caught mid-line: the prefix here happens to be JSON on its own.
        std::fs::write(&p, "{\"a\":1}\n12").unwrap();
        assert_eq!(read_jsonl_so_far(&p), vec![serde_json::json!({"a": 1})]);
        std::fs::write(&p, "{\"a\":1}\n123\n").unwrap();
        assert_eq!(read_jsonl_so_far(&p).len(), 2);
    }

    #[test]
    #[should_panic(expected = "a line that is not JSON")]
    fn a_complete_line_that_is_not_json_is_a_defect() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        std::fs::write(&p, "{\"a\":1\n").unwrap();
        read_jsonl_so_far(&p);
    }
}
