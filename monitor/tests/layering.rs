//! Every dependency between the crate's modules points down.
//!
//! Reads `monitor/src` and collects, per module, the `crate::…` paths its code names (`use`
//! lines, grouped `use crate::{a, b}` and inline paths). Test code may reach anything, so files
//! named `tests.rs` or `*_tests.rs` and everything after a `#[cfg(test)]` module header are
//! skipped. The layers,
//! bottom first, are the README's Layout; an edge to a module of the same or a higher layer
//! fails, naming the file and line.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules of `monitor/src`, by layer (a module may import only lower layers).
const LAYERS: &[(&str, u32)] = &[
    ("event", 0),
    ("addr", 0),
    ("duration", 0),
    ("node", 0),
    ("violation", 1),
    ("telemetry", 2),
    ("access", 3),
    ("engine", 3),
    ("normalize", 3),
    ("alert", 3),
    ("ingest", 4),
    ("pipeline", 5),
    ("bus", 6),
    ("admin", 6),
    ("config", 7),
    ("run", 8),
    ("cmd", 9),
];

/// Inside `engine/`, bottom first.
const ENGINE_LAYERS: &[(&str, u32)] = &[
    ("mem", 0),
    ("matcher", 0),
    ("workload", 0),
    ("state", 1),
    ("identity", 2),
    ("rules", 2),
    ("check", 3),
];

fn rank(table: &[(&str, u32)], name: &str) -> Option<u32> {
    table.iter().find(|(n, _)| *n == name).map(|(_, r)| *r)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read monitor/src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file belongs to: its top-level module, and for `engine` its sub-module.
fn owner(rel: &Path) -> (String, Option<String>) {
    let parts: Vec<String> = rel
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    let top = parts[0].clone();
    let sub = (top == "engine" && parts.len() > 1 && parts[1] != "mod").then(|| parts[1].clone());
    (top, sub)
}

/// `crate::` paths named on one line: `crate::a::b`, and the heads of `crate::{a::x, b}`.
fn crate_paths(line: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                out.push(segments(item.trim()));
            }
        } else {
            out.push(segments(after));
        }
        rest = after;
    }
    out.retain(|p| !p.is_empty());
    out
}

fn segments(path: &str) -> Vec<String> {
    path.split("::")
        .map(|s| {
            s.chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .take_while(|s| !s.is_empty())
        .collect()
}

#[test]
fn dependencies_point_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut upward = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under src");
        // Test modules (`mod tests;`, `mod vllm_pd_tests;` behind `#[cfg(test)]`).
        if rel
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n == "tests.rs" || n.ends_with("_tests.rs"))
        {
            continue;
        }
        let (top, sub) = owner(rel);
        if rank(LAYERS, &top).is_none() {
            // lib.rs and main.rs sit above everything.
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read source");
        let mut lines = text.lines().enumerate().peekable();
        while let Some((n, line)) = lines.next() {
            if line.trim() == "#[cfg(test)]"
                && lines
                    .peek()
                    .is_some_and(|(_, next)| next.trim_start().starts_with("mod "))
            {
                break;
            }
            let code = line.split("//").next().unwrap_or("");
            for path in crate_paths(code) {
                let to = &path[0];
                let Some(to_rank) = rank(LAYERS, to) else {
                    continue;
                };
                let from_rank = rank(LAYERS, &top).expect("ranked above");
                let here = format!("{}:{}", rel.display(), n + 1);
                if *to == top {
                    if top != "engine" {
                        continue;
                    }
                    let (Some(from), Some(to_sub)) = (sub.as_deref(), path.get(1)) else {
                        continue;
                    };
                    if from == to_sub {
                        continue;
                    }
                    let (Some(f), Some(t)) =
                        (rank(ENGINE_LAYERS, from), rank(ENGINE_LAYERS, to_sub))
                    else {
                        continue;
                    };
                    edges
                        .entry(format!("engine/{from}"))
                        .or_default()
                        .insert(format!("engine/{to_sub}"));
                    if t >= f {
                        upward.push(format!("{here}: engine/{from} imports engine/{to_sub}"));
                    }
                    continue;
                }
                edges.entry(top.clone()).or_default().insert(to.clone());
                if to_rank >= from_rank {
                    upward.push(format!("{here}: {top} imports {to}"));
                }
            }
        }
    }
    let graph: Vec<String> = edges
        .iter()
        .map(|(from, to)| {
            format!(
                "{from} -> {}",
                to.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    eprintln!("module graph:\n  {}", graph.join("\n  "));
    assert!(
        upward.is_empty(),
        "imports that point up or sideways:\n  {}\nmodule graph:\n  {}",
        upward.join("\n  "),
        graph.join("\n  ")
    );
    // The engine is sans-IO: no async runtime anywhere in it.
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under src");
        if owner(rel).0 != "engine" {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read source");
        assert!(
            !text.contains("tokio"),
            "{} names tokio: the engine must stay sans-IO",
            rel.display()
        );
    }
}
