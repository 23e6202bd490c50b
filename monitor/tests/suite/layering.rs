//! Every dependency between the crate's modules points down, and no folder's files import each
//! other in a circle.
//!
//! Reads every line of `monitor/src` and collects, per file, the module paths its code names:
//! `use` trees (`crate::a::{b, c::{d, e}}` over as many lines as they take), `super::` and
//! `self::` paths, and inline paths (`crate::telemetry::console::error(…)`). Comments, string
//! and character literals are blanked first, so a `{` in a string or a path in a doc comment
//! counts for nothing. Test code may reach anything: an inline `mod … { … }` under `#[cfg(test)]`
//! is skipped to its closing brace (the code after it is read), and a file that a
//! `#[cfg(test)] mod name;` declaration brings in is skipped whole.
//!
//! Two checks (`docs/architecture.md` draws both):
//! - **layers**: the top-level modules by layer, bottom first ([`LAYERS`]), and the engine's
//!   own layers ([`ENGINE_LAYERS`]); an edge to a module of the same or a higher layer fails,
//!   naming the file and line. The engine never names tokio.
//! - **no circles**: inside every folder, the files and sub-folders beside each other (its
//!   `mod.rs` aside, which declares and re-exports them) import each other without a cycle.
//!
//! The reader itself is tested on small sources at the bottom of this file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules of `monitor/src`, by layer (a module may import only lower layers).
const LAYERS: &[(&str, u32)] = &[
    ("event", 0),
    ("addr", 0),
    ("duration", 0),
    ("node", 0),
    ("exit", 0),
    ("violation", 1),
    ("telemetry", 2),
    ("access", 3),
    ("engine", 3),
    ("normalize", 3),
    ("alert", 3),
    ("ingest", 4),
    ("report", 4),
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
    ("partition", 0),
    ("state", 1),
    ("identity", 2),
    ("rules", 2),
    ("check", 3),
    ("shard", 4),
];

fn rank(table: &[(&str, u32)], name: &str) -> Option<u32> {
    table.iter().find(|(n, _)| *n == name).map(|(_, r)| *r)
}

/// Blanks comments, string and character literals (newlines kept, so line numbers stay), leaving
/// only code.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let ident_before = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if (c == 'r' || (c == 'b' && next == Some('r')))
            && !ident_before
            && raw_string_start(&chars, i).is_some()
        {
            let (open_len, hashes) = raw_string_start(&chars, i).expect("checked");
            for _ in 0..open_len {
                out.push(' ');
            }
            i += open_len;
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            while i < chars.len() && !chars[i..].starts_with(&close) {
                out.push(blank(chars[i]));
                i += 1;
            }
            for _ in 0..close.len().min(chars.len() - i) {
                out.push(' ');
            }
            i += close.len();
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < chars.len() {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{1F600}'), or a lifetime ('a), left as it is.
            let len = if next == Some('\\') {
                chars[i + 2..]
                    .iter()
                    .position(|&c| c == '\'')
                    .map(|p| p + 3)
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(3)
            } else {
                None
            };
            match len {
                Some(n) => {
                    for _ in 0..n {
                        out.push(' ');
                    }
                    i += n;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `r"`, `r#"`, `br##"`…: the opening's length and its number of `#`.
fn raw_string_start(chars: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i + if chars[i] == 'b' { 2 } else { 1 };
    let mut hashes = 0;
    while chars.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (chars.get(j) == Some(&'"')).then_some((j + 1 - i, hashes))
}

/// What a file's code is, once test modules are set aside.
#[derive(Debug, Default)]
struct Scanned {
    /// Lines of code (1-based number, text), inline `#[cfg(test)] mod … { … }` blocks removed.
    code: Vec<(usize, String)>,
    /// Modules declared `#[cfg(test)] mod name;`: files of test code.
    test_modules: Vec<String>,
}

/// A `mod` item's name and whether it is inline (`{`) rather than a file (`;`).
fn mod_item(line: &str) -> Option<(String, bool)> {
    let mut rest = line.trim();
    if let Some(r) = rest.strip_prefix("pub") {
        rest = r.trim_start();
        if rest.starts_with('(') {
            rest = rest[rest.find(')')? + 1..].trim_start();
        }
    }
    let rest = rest.strip_prefix("mod ")?.trim_start();
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    let after = rest[name.len()..].trim_start();
    match after.chars().next() {
        Some('{') => Some((name, true)),
        Some(';') => Some((name, false)),
        _ => None,
    }
}

fn scan(text: &str) -> Scanned {
    let code = code_only(text);
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Scanned::default();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        if let Some(after) = line.strip_prefix("#[cfg(test)]") {
            // The item the attribute is on: on the same line, or after further attributes.
            let mut j = i;
            let mut item = after.trim().to_owned();
            while item.is_empty() || item.starts_with("#[") {
                j += 1;
                match lines.get(j) {
                    Some(l) => item = l.trim().to_owned(),
                    None => break,
                }
            }
            match mod_item(&item) {
                Some((_, true)) => {
                    // Skip to the brace that closes the module.
                    let mut depth = 0i64;
                    let mut k = j;
                    let mut opened = false;
                    while k < lines.len() {
                        let l = if k == j { item.as_str() } else { lines[k] };
                        for c in l.chars() {
                            match c {
                                '{' => {
                                    depth += 1;
                                    opened = true;
                                }
                                '}' => depth -= 1,
                                _ => {}
                            }
                        }
                        k += 1;
                        if opened && depth <= 0 {
                            break;
                        }
                    }
                    i = k;
                    continue;
                }
                Some((name, false)) => out.test_modules.push(name),
                None => {}
            }
        }
        out.code.push((i + 1, lines[i].to_owned()));
        i += 1;
    }
    out
}

/// A path named in code: the line, its anchor (`crate`, `super`, `self`) and its segments.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Named {
    line: usize,
    anchor: &'static str,
    segments: Vec<String>,
}

/// Every `crate::`/`super::`/`self::` path the code names, `use` trees expanded.
fn named_paths(code: &[(usize, String)]) -> Vec<Named> {
    // One string with a line number per character: use trees span lines.
    let mut text = String::new();
    let mut line_of = Vec::new();
    for (n, l) in code {
        for _ in l.chars() {
            line_of.push(*n);
        }
        text.push_str(l);
        text.push('\n');
        line_of.push(*n);
    }
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let ident_before = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        let anchor = ["crate", "super", "self"].into_iter().find(|a| {
            chars[i] == a.as_bytes()[0] as char
                && a.chars()
                    .chain("::".chars())
                    .enumerate()
                    .all(|(k, c)| chars.get(i + k) == Some(&c))
        });
        match anchor {
            Some(a) if !ident_before => {
                let mut j = i + a.len() + 2;
                let mut leaves = Vec::new();
                use_tree(&chars, &mut j, Vec::new(), &mut leaves);
                for (at, segments) in leaves {
                    out.push(Named {
                        line: line_of[at.min(line_of.len() - 1)],
                        anchor: a,
                        segments,
                    });
                }
                i = j.max(i + 1);
            }
            _ => i += 1,
        }
    }
    out
}

fn skip_ws(chars: &[char], j: &mut usize) {
    while *j < chars.len() && chars[*j].is_whitespace() {
        *j += 1;
    }
}

/// Reads a use tree (or an inline path) at `j`: `a::b`, `a::{b, c::d}`, `a::*`, `a as b`. Each
/// leaf comes with the position of its last segment (for the line number).
fn use_tree(
    chars: &[char],
    j: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(usize, Vec<String>)>,
) {
    skip_ws(chars, j);
    if chars.get(*j) == Some(&'{') {
        *j += 1;
        loop {
            skip_ws(chars, j);
            match chars.get(*j) {
                Some('}') => {
                    *j += 1;
                    return;
                }
                Some(',') => *j += 1,
                None => return,
                _ => {
                    let before = *j;
                    use_tree(chars, j, prefix.clone(), out);
                    if *j == before {
                        // Not a path (a stray token): move on.
                        *j += 1;
                    }
                }
            }
        }
    }
    let start = *j;
    while *j < chars.len() && (chars[*j].is_alphanumeric() || chars[*j] == '_') {
        *j += 1;
    }
    let segment: String = chars[start..*j].iter().collect();
    if segment.is_empty() {
        // `*`, or the end of the path.
        if !prefix.is_empty() {
            out.push((*j, prefix));
        }
        if chars.get(*j) == Some(&'*') {
            *j += 1;
        }
        return;
    }
    let mut path = prefix;
    if segment != "self" {
        path.push(segment);
    }
    if chars.get(*j) == Some(&':') && chars.get(*j + 1) == Some(&':') {
        *j += 2;
        if chars.get(*j) == Some(&'<') {
            // `Type::<T>`: the path ends here.
            out.push((start, path));
            return;
        }
        use_tree(chars, j, path, out);
    } else {
        out.push((start, path));
    }
}

/// The module tree of `monitor/src`: module path → file.
struct Tree {
    modules: BTreeMap<Vec<String>, PathBuf>,
    /// What each module re-exports (`pub use child::Item;`): item name → where it comes from.
    reexports: BTreeMap<Vec<String>, BTreeMap<String, Named>>,
}

impl Tree {
    fn read(src: &Path) -> Tree {
        let mut files = Vec::new();
        rust_files(src, &mut files);
        let mut modules = BTreeMap::new();
        for file in files {
            let rel = file.strip_prefix(src).expect("under src").to_path_buf();
            modules.insert(module_of(&rel), rel);
        }
        Tree {
            modules,
            reexports: BTreeMap::new(),
        }
    }

    /// Reads the `pub use` items of every module, so that a path through a re-export reaches
    /// the module the item is defined in (`use super::RunArgs` in `run/overlay.rs` names
    /// `run/prepare.rs`, not `run/mod.rs`).
    fn read_reexports(&mut self, scanned: &BTreeMap<Vec<String>, Scanned>) {
        for (module, s) in scanned {
            let mut map = BTreeMap::new();
            for named in reexported(&s.code) {
                if let Some(item) = named.segments.last() {
                    map.insert(item.clone(), named);
                }
            }
            self.reexports.insert(module.clone(), map);
        }
    }

    /// The module that defines what `anchor::segments`, named in module `here`, names: the
    /// deepest module on the path, or, when the next segment is an item that module re-exports,
    /// the module the re-export points at.
    fn resolve(&self, here: &[String], named: &Named) -> Option<Vec<String>> {
        self.resolve_within(here, named, 8)
    }

    fn resolve_within(&self, here: &[String], named: &Named, depth: u32) -> Option<Vec<String>> {
        let mut at: Vec<String> = match named.anchor {
            "crate" => Vec::new(),
            "self" => here.to_vec(),
            _ => here[..here.len().checked_sub(1)?].to_vec(),
        };
        for seg in &named.segments {
            if seg == "super" {
                at.pop()?;
                continue;
            }
            let mut deeper = at.clone();
            deeper.push(seg.clone());
            if self.modules.contains_key(&deeper) {
                at = deeper;
                continue;
            }
            if depth > 0
                && let Some(origin) = self.reexports.get(&at).and_then(|m| m.get(seg))
            {
                return self.resolve_within(&at, origin, depth - 1);
            }
            break;
        }
        Some(at)
    }
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

/// `a/b.rs` and `a/b/mod.rs` are module `a::b`; `lib.rs` and `main.rs` the root.
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    match last.as_str() {
        "mod.rs" | "lib.rs" | "main.rs" => {}
        other => parts.push(other.trim_end_matches(".rs").to_owned()),
    }
    parts
}

/// What the whole crate's code names: per non-test file, its module and the modules it reaches.
struct Graph {
    /// (file, line, from module, to module)
    edges: Vec<(PathBuf, usize, Vec<String>, Vec<String>)>,
    /// Files read (test files excluded).
    files: usize,
    /// Files skipped as test code.
    test_files: BTreeSet<PathBuf>,
}

/// The items a module's `pub use` lines re-export, each as a path from the module (a first
/// segment that is no anchor names a child module: `pub use prepare::RunArgs`).
fn reexported(code: &[(usize, String)]) -> Vec<Named> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let line = code[i].1.trim_start();
        let Some(rest) = ["pub use ", "pub(crate) use ", "pub(super) use "]
            .iter()
            .find_map(|p| line.strip_prefix(p))
        else {
            i += 1;
            continue;
        };
        // The statement, to its `;`.
        let mut stmt = rest.to_owned();
        while !stmt.contains(';') && i + 1 < code.len() {
            i += 1;
            stmt.push(' ');
            stmt.push_str(&code[i].1);
        }
        let chars: Vec<char> = stmt.chars().collect();
        let mut j = 0;
        let mut leaves = Vec::new();
        use_tree(&chars, &mut j, Vec::new(), &mut leaves);
        for (_, mut segments) in leaves {
            let anchor = match segments.first().map(String::as_str) {
                Some("crate") => "crate",
                Some("super") => "super",
                Some("self") => "self",
                _ => {
                    segments.insert(0, "self".to_owned());
                    "self"
                }
            };
            segments.remove(0);
            if !segments.is_empty() {
                out.push(Named {
                    line: code[i].0,
                    anchor,
                    segments,
                });
            }
        }
        i += 1;
    }
    out
}

fn read_graph(src: &Path, tree: &mut Tree) -> Graph {
    // Which files are test code: declared `#[cfg(test)] mod name;` by their parent.
    let mut scanned = BTreeMap::new();
    let mut test_modules = BTreeSet::new();
    for (module, rel) in &tree.modules {
        let text = std::fs::read_to_string(src.join(rel)).expect("read source");
        let s = scan(&text);
        for name in &s.test_modules {
            let mut m = module.clone();
            m.push(name.clone());
            test_modules.insert(m);
        }
        scanned.insert(module.clone(), s);
    }
    tree.read_reexports(&scanned);
    let tree = &*tree;
    let is_test = |m: &Vec<String>| (1..=m.len()).any(|n| test_modules.contains(&m[..n]));
    let mut graph = Graph {
        edges: Vec::new(),
        files: 0,
        test_files: BTreeSet::new(),
    };
    for (module, s) in &scanned {
        let rel = &tree.modules[module];
        if is_test(module) {
            graph.test_files.insert(rel.clone());
            continue;
        }
        graph.files += 1;
        for named in named_paths(&s.code) {
            if let Some(to) = tree.resolve(module, &named)
                && !to.is_empty()
                && &to != module
            {
                graph
                    .edges
                    .push((rel.clone(), named.line, module.clone(), to));
            }
        }
    }
    graph
}

/// The layer check: an edge from `from` to `to` that points up or sideways, described.
fn upward(from: &[String], to: &[String]) -> Option<String> {
    let (Some(f), Some(t)) = (from.first(), to.first()) else {
        return None; // lib.rs and main.rs sit above everything.
    };
    if f == t {
        if f != "engine" {
            return None;
        }
        let (Some(fs), Some(ts)) = (from.get(1), to.get(1)) else {
            return None;
        };
        if fs == ts {
            return None;
        }
        let (Some(fr), Some(tr)) = (rank(ENGINE_LAYERS, fs), rank(ENGINE_LAYERS, ts)) else {
            panic!("engine/{fs} or engine/{ts} has no layer in ENGINE_LAYERS");
        };
        return (tr >= fr).then(|| format!("engine/{fs} imports engine/{ts}"));
    }
    let fr = rank(LAYERS, f).unwrap_or_else(|| panic!("module {f} has no layer in LAYERS"));
    let tr = rank(LAYERS, t).unwrap_or_else(|| panic!("module {t} has no layer in LAYERS"));
    (tr >= fr).then(|| format!("{f} imports {t}"))
}

/// Circles among the children of one folder: for each folder, edges between its children.
fn circles(graph: &Graph) -> Vec<String> {
    // parent module → (child → children it imports), with a witness line per edge.
    let mut by_parent: BTreeMap<Vec<String>, BTreeMap<String, BTreeMap<String, String>>> =
        BTreeMap::new();
    for (file, line, from, to) in &graph.edges {
        let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        // from is inside the parent's child from[common], to inside child to[common].
        let (Some(a), Some(b)) = (from.get(common), to.get(common)) else {
            continue; // one contains the other: a parent and its child
        };
        by_parent
            .entry(from[..common].to_vec())
            .or_default()
            .entry(a.clone())
            .or_default()
            .entry(b.clone())
            .or_insert_with(|| format!("{}:{line}", file.display()));
    }
    let mut found = Vec::new();
    for (parent, children) in &by_parent {
        let where_ = if parent.is_empty() {
            "src".to_owned()
        } else {
            parent.join("/")
        };
        for cycle in cycles(children) {
            let steps: Vec<String> = cycle
                .windows(2)
                .map(|w| format!("{} -> {} ({})", w[0], w[1], children[&w[0]][&w[1]]))
                .collect();
            found.push(format!("in {where_}: {}", steps.join(", ")));
        }
    }
    found
}

/// One cycle per strongly connected component of more than one node (or a self loop), as the
/// list of its nodes with the first repeated at the end.
fn cycles(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = graph
        .iter()
        .flat_map(|(a, to)| std::iter::once(a).chain(to.keys()))
        .collect();
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(n) = stack.pop() {
            for next in graph.get(&n).into_iter().flat_map(|t| t.keys()) {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut out = Vec::new();
    for n in nodes {
        if done.contains(n) || !reach(n).contains(n) {
            continue;
        }
        // A shortest way back to n (breadth first), for the message.
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([n.clone()]);
        let mut last = None;
        'bfs: while let Some(x) = queue.pop_front() {
            for next in graph.get(&x).into_iter().flat_map(|t| t.keys()) {
                if next == n {
                    last = Some(x.clone());
                    break 'bfs;
                }
                if !prev.contains_key(next) {
                    prev.insert(next.clone(), x.clone());
                    queue.push_back(next.clone());
                }
            }
        }
        let mut at = last.expect("n reaches itself");
        let mut back = vec![n.clone(), at.clone()];
        while &at != n {
            at = prev[&at].clone();
            back.push(at.clone());
        }
        back.reverse();
        let forward = back;
        let component: BTreeSet<String> = reach(n)
            .into_iter()
            .filter(|m| reach(m).contains(n))
            .collect();
        done.extend(component);
        out.push(forward);
    }
    out
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn dependencies_point_down() {
    let src = src();
    let mut tree = Tree::read(&src);
    let graph = read_graph(&src, &mut tree);
    let mut modules: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for (file, line, from, to) in &graph.edges {
        let name = |m: &[String]| match m.first().map(String::as_str) {
            Some("engine") if m.len() > 1 => format!("engine/{}", m[1]),
            Some(top) => top.to_owned(),
            None => "crate".to_owned(),
        };
        if from.first() != to.first() || from.first().is_some_and(|t| t == "engine") {
            let (f, t) = (name(from), name(to));
            if f != t {
                modules.entry(f).or_default().insert(t);
            }
        }
        if let Some(why) = upward(from, to) {
            wrong.push(format!("{}:{line}: {why}", file.display()));
        }
    }
    let graph_text: Vec<String> = modules
        .iter()
        .map(|(from, to)| {
            format!(
                "{from} -> {}",
                to.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    eprintln!(
        "{} files read ({} test files skipped); module graph:\n  {}",
        graph.files,
        graph.test_files.len(),
        graph_text.join("\n  ")
    );
    assert!(
        wrong.is_empty(),
        "imports that point up or sideways:\n  {}\nmodule graph:\n  {}",
        wrong.join("\n  "),
        graph_text.join("\n  ")
    );
    // Test files are only the ones declared as such.
    for f in &graph.test_files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        assert!(
            name == "tests.rs" || name.ends_with("_tests.rs") || name == "mod.rs",
            "{} is skipped as test code: name it tests.rs or *_tests.rs",
            f.display()
        );
    }
    // The engine is sans-IO: no async runtime anywhere in it.
    for rel in tree.modules.values() {
        if !rel.starts_with("engine") {
            continue;
        }
        let text = code_only(&std::fs::read_to_string(src.join(rel)).expect("read source"));
        assert!(
            !text.contains("tokio"),
            "{} names tokio: the engine must stay sans-IO",
            rel.display()
        );
    }
}

#[test]
fn no_folder_imports_itself_in_a_circle() {
    let src = src();
    let mut tree = Tree::read(&src);
    let graph = read_graph(&src, &mut tree);
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "files that import each other in a circle (move what both need below them):\n  {}",
        found.join("\n  ")
    );
}

// The reader, on small sources.

fn paths_of(text: &str) -> Vec<(usize, String)> {
    named_paths(&scan(text).code)
        .into_iter()
        .map(|n| (n.line, format!("{}::{}", n.anchor, n.segments.join("::"))))
        .collect()
}

#[test]
fn reads_past_a_test_module_declaration() {
    // `#[cfg(test)] mod tests;` near the top: the code after it is code, not tests.
    let text = "#[cfg(test)]\nmod tests;\n\nuse crate::run::Thing;\n";
    assert_eq!(paths_of(text), [(4, "crate::run::Thing".to_owned())]);
    assert_eq!(scan(text).test_modules, ["tests"]);
    // With another attribute between, and `pub(crate)`.
    let text = "#[cfg(test)]\n#[path = \"t.rs\"]\npub(crate) mod t;\nfn f() { crate::cmd::x(); }\n";
    assert_eq!(paths_of(text), [(4, "crate::cmd::x".to_owned())]);
}

#[test]
fn skips_only_the_inline_test_module() {
    let text = "\
use crate::event::Stage;
#[cfg(test)]
mod tests {
    use crate::run::Anything;
    const BRACE: &str = \"{\";
    const C: char = '}';
    fn f() { if true { crate::cmd::x(); } }
}
fn after() { crate::telemetry::console::error(\"}\"); }
";
    assert_eq!(
        paths_of(text),
        [
            (1, "crate::event::Stage".to_owned()),
            (9, "crate::telemetry::console::error".to_owned())
        ]
    );
    // The attribute on the module's own line, and a lifetime that is not a character.
    let text = "#[cfg(test)] mod tests { use crate::run::X; }\nfn g<'a>(x: &'a str) { crate::cmd::y(x) }\n";
    assert_eq!(paths_of(text), [(2, "crate::cmd::y".to_owned())]);
}

#[test]
fn expands_use_trees_over_lines_and_ignores_comments_and_strings() {
    let text = "\
use crate::{
    alert::{AlertConfig, sink::{self, Sink}},
    event::*,
};
use super::{server::error, timeline};
// use crate::run::Commented;
/// [`crate::cmd::Doc`]
const S: &str = \"crate::run::InAString\";
const R: &str = r#\"crate::run::\"Raw\"\"#;
fn f() -> crate::violation::Violation { self::helper::<u8>() }
";
    assert_eq!(
        paths_of(text),
        [
            (2, "crate::alert::AlertConfig".to_owned()),
            (2, "crate::alert::sink".to_owned()),
            (2, "crate::alert::sink::Sink".to_owned()),
            (3, "crate::event".to_owned()),
            (5, "super::server::error".to_owned()),
            (5, "super::timeline".to_owned()),
            (10, "crate::violation::Violation".to_owned()),
            (10, "self::helper".to_owned()),
        ]
    );
}

#[test]
fn resolves_paths_to_files_and_finds_circles() {
    let tree = Tree {
        modules: [
            (vec![], "lib.rs"),
            (vec!["admin"], "admin/mod.rs"),
            (vec!["admin", "server"], "admin/server.rs"),
            (vec!["admin", "violations"], "admin/violations.rs"),
        ]
        .into_iter()
        .map(|(m, f)| (m.into_iter().map(String::from).collect(), PathBuf::from(f)))
        .collect(),
        reexports: BTreeMap::new(),
    };
    let here: Vec<String> = vec!["admin".into(), "violations".into()];
    let named = |anchor, segs: &[&str]| Named {
        line: 1,
        anchor,
        segments: segs.iter().map(|s| s.to_string()).collect(),
    };
    assert_eq!(
        tree.resolve(&here, &named("super", &["server", "error"])),
        Some(vec!["admin".to_owned(), "server".to_owned()])
    );
    assert_eq!(
        tree.resolve(&here, &named("crate", &["admin", "AdminState"])),
        Some(vec!["admin".to_owned()])
    );
    let edge = |from: &[&str], to: &[&str]| {
        (
            PathBuf::from("x.rs"),
            1,
            from.iter().map(|s| s.to_string()).collect(),
            to.iter().map(|s| s.to_string()).collect(),
        )
    };
    let graph = Graph {
        edges: vec![
            edge(&["admin", "server"], &["admin", "violations"]),
            edge(&["admin", "violations"], &["admin", "server"]),
            // A child naming its parent and the parent re-exporting it is no circle.
            edge(&["admin", "server"], &["admin"]),
            edge(&["admin"], &["admin", "server"]),
        ],
        files: 3,
        test_files: BTreeSet::new(),
    };
    let found = circles(&graph);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("in admin: server -> violations"),
        "{found:?}"
    );
    assert!(upward(&["telemetry".into()], &["admin".into()]).is_some());
    assert!(upward(&["admin".into()], &["telemetry".into()]).is_none());
    assert!(
        upward(
            &["engine".into(), "identity".into()],
            &["engine".into(), "rules".into()]
        )
        .is_some()
    );
}
