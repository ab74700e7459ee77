//! Imports run one way (issue 29): the executors (`exec`) are the bottom layer, the kernel
//! specs, renders and references (`kernels`) use them, and the JIT (`jit`) uses both; none of
//! them imports a module above it. This test reads the sources of each of these modules and
//! fails, naming `file:line`, on any path into a crate-root module the layer may not use.
//!
//! A path is `crate::m` (or `$crate::m`), an item of a `crate::{..}` group, or a
//! `super::` chain that climbs to the crate root; comments, doc comments (rustdoc links
//! may point anywhere) and string and character literals do not count. Test modules count
//! too: a test needing an upper layer lives in that layer (`kernels::exec_checks`).

use std::fs;
use std::path::{Path, PathBuf};

/// Each guarded module and the crate-root modules it may import: only those below it.
/// `splitmix`, `layout` and `env` import nothing of the crate. A module missing here that
/// sits below a layer may be added to its list; one above it never.
const LAYERS: &[(&str, &[&str])] = &[
    ("exec", &["splitmix"]),
    ("kernels", &["exec", "layout", "splitmix"]),
    ("jit", &["env", "exec", "kernels", "layout", "splitmix"]),
];

#[test]
fn exec_kernels_and_jit_import_only_the_layers_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut violations = Vec::new();
    for &(module, allowed) in LAYERS {
        let mut files = Vec::new();
        rust_files(&src.join(module), &mut files);
        assert!(!files.is_empty(), "no sources under src/{module}");
        for file in files {
            let text = fs::read_to_string(&file).unwrap();
            let rel = file.strip_prefix(&src).unwrap();
            let mod_path = module_path(rel);
            for (line, target) in crate_root_paths(&text, &mod_path) {
                if target != module && !allowed.contains(&target.as_str()) {
                    violations.push(format!(
                        "src/{}:{line}: `{module}` uses `crate::{target}` ({})",
                        rel.display(),
                        text.lines().nth(line - 1).unwrap_or("").trim()
                    ));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "imports must run one way, exec <- kernels <- jit; each layer may use only these \
         crate-root modules ({}):\n{}",
        LAYERS
            .iter()
            .map(|(m, a)| format!("{m}: {}", a.join(", ")))
            .collect::<Vec<_>>()
            .join("; "),
        violations.join("\n")
    );
}

/// Inside `kernels`, the specs sit below the renders (issue 29 closed the circle between
/// them): no file of `kernels::spec` names `render`, in a path (`super::render::…`,
/// `crate::kernels::render`) or a `use` group, only as a method (`.render()`). The render
/// helpers the specs need (`render_params`) live in `spec` itself.
#[test]
fn kernel_specs_do_not_import_the_renders() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels/spec");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    assert!(!files.is_empty(), "no sources under src/kernels/spec");
    let mut violations = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        for line in render_uses(&text) {
            violations.push(format!("{}:{line}", file.display()));
        }
    }
    assert!(
        violations.is_empty(),
        "kernels::spec must not use kernels::render (specs -> render -> jit -> exec):\n{}",
        violations.join("\n")
    );
    // The check finds a path and a group item, and passes a method call and a longer name.
    let planted = "use super::render::X;\nuse super::{params, render};\n\
                   fn f() { s.render(); render_params(); } // super::render";
    assert_eq!(render_uses(planted), [1, 2]);
}

/// The lines where `text` names `render` other than as a method (`.render()`).
fn render_uses(text: &str) -> Vec<usize> {
    let toks = tokens(&code_only(text));
    (0..toks.len())
        .filter(|&i| toks[i].text == "render" && (i == 0 || toks[i - 1].text != "."))
        .map(|i| toks[i].line)
        .collect()
}

/// The scanner itself finds what it must and ignores comments and literals.
#[test]
fn the_scanner_finds_each_kind_of_path_and_nothing_in_comments_or_literals() {
    let src = r###"
//! Doc: [`x`](crate::jit::X) and crate::cluster.
use crate::exec::KernelArg;
use crate::{layout::Layout, jit::Arch};
use crate::{
    self, tuning::{a, b},
};
/* block crate::ops /* nested crate::ops */ still comment crate::ops */
fn f() -> &'static str {
    let _c = '{';
    let _s = "crate::storage {";
    let _r = r#"crate::rank "{" "#;
    let _ = crate::kernels::reference::mix64(1);
    $crate::cli::x!();
    "}"
}
mod tests {
    use super::super::workload;
    use super::super::super::hicache::H;
}
"###;
    // The file's module is `exec::foo`: `super::super` inside `tests` is `exec`, three
    // supers are the crate root.
    let found = crate_root_paths(src, &["exec".into(), "foo".into()]);
    assert_eq!(
        found,
        [
            (3, "exec".to_string()),
            (4, "layout".into()),
            (4, "jit".into()),
            (6, "tuning".into()),
            (13, "kernels".into()),
            (14, "cli".into()),
            (19, "hicache".into()),
        ]
    );
}

/// Every `.rs` file under `dir`, in a stable order.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file under `src/` defines: `exec/host/mod.rs` is `exec::host`,
/// `exec/launch.rs` is `exec::launch`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

/// The source with comments and the contents of string and character literals blanked
/// (newlines kept, so lines keep their numbers).
fn code_only(text: &str) -> Vec<char> {
    let c: Vec<char> = text.chars().collect();
    let mut out = c.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for ch in &mut out[from..to] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
    };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            let end = (i..c.len()).find(|&j| c[j] == '\n').unwrap_or(c.len());
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '/' && next == Some('*') {
            let (mut depth, mut j) = (1, i + 2);
            while j < c.len() && depth > 0 {
                if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if c[i] == 'r'
            && (i == 0 || !ident(c[i - 1]) || (c[i - 1] == 'b' && (i < 2 || !ident(c[i - 2]))))
            && matches!(next, Some('"') | Some('#'))
        {
            let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
            if c.get(i + 1 + hashes) != Some(&'"') {
                i += 1;
                continue;
            }
            let open = i + 1 + hashes;
            let mut j = open + 1;
            while j < c.len()
                && !(c[j] == '"'
                    && c[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes)
            {
                j += 1;
            }
            blank(&mut out, open + 1, j.min(c.len()));
            i = (j + 1 + hashes).min(c.len());
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i + 1, j.min(c.len()));
            i = j + 1;
        } else if c[i] == '\'' && (next == Some('\\') || c.get(i + 2) == Some(&'\'')) {
            // A character literal (a lifetime or label has no closing quote).
            let mut j = i + 1;
            while j < c.len() && c[j] != '\'' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i + 1, j.min(c.len()));
            i = j + 1;
        } else {
            i += 1;
        }
    }
    out
}

/// One token of blanked source: an identifier, `::`, or a single punctuation character,
/// with its line (from 1).
#[derive(Debug, PartialEq)]
struct Token {
    text: String,
    line: usize,
}

fn tokens(code: &[char]) -> Vec<Token> {
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < code.len() {
        let ch = code[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < code.len() && (code[i].is_alphanumeric() || code[i] == '_') {
                i += 1;
            }
            out.push(Token {
                text: code[start..i].iter().collect(),
                line,
            });
        } else if ch == ':' && code.get(i + 1) == Some(&':') {
            out.push(Token {
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                text: ch.to_string(),
                line,
            });
            i += 1;
        }
    }
    out
}

/// Every crate-root module the source names in a path, with the line, for a file defining
/// module `mod_path` (inline `mod x { .. }` blocks extend it, for `super::` chains).
fn crate_root_paths(text: &str, mod_path: &[String]) -> Vec<(usize, String)> {
    let toks = tokens(&code_only(text));
    let is = |i: usize, s: &str| toks.get(i).is_some_and(|t| t.text == s);
    let is_ident = |i: usize| {
        toks.get(i)
            .is_some_and(|t| t.text.chars().all(|c| c.is_alphanumeric() || c == '_'))
    };
    let mut found = Vec::new();
    // Inline modules open at brace depths.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        match toks[i].text.as_str() {
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|&(_, d)| d > depth) {
                    inline.pop();
                }
            }
            "mod" if is_ident(i + 1) && is(i + 2, "{") => {
                inline.push((toks[i + 1].text.clone(), depth + 1));
            }
            _ => {}
        }
        // The index just after a path's `::` that reaches the crate root, if one starts here.
        let root = if is(i, "crate") && is(i + 1, "::") && !(i > 0 && is(i - 1, "::")) {
            Some(i + 2)
        } else if is(i, "super") && !(i > 0 && is(i - 1, "::")) {
            let mut n = 0;
            let mut j = i;
            while is(j, "super") && is(j + 1, "::") {
                n += 1;
                j += 2;
            }
            let here = mod_path.len() + inline.len();
            (n > 0 && n >= here).then_some(j)
        } else {
            None
        };
        if let Some(j) = root {
            if is(j, "{") {
                // A group: the first segment of each item at its top level.
                let (mut d, mut k, mut item_start) = (0usize, j, true);
                while k < toks.len() {
                    match toks[k].text.as_str() {
                        "{" => {
                            d += 1;
                            item_start = d == 1;
                        }
                        "}" => {
                            d -= 1;
                            if d == 0 {
                                break;
                            }
                        }
                        "," if d == 1 => item_start = true,
                        t if item_start && d == 1 && is_ident(k) => {
                            if t != "self" {
                                found.push((toks[k].line, t.to_string()));
                            }
                            item_start = false;
                        }
                        _ => item_start = false,
                    }
                    k += 1;
                }
            } else if is_ident(j) {
                found.push((toks[j].line, toks[j].text.clone()));
            }
        }
        i += 1;
    }
    found
}
