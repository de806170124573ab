//! Layers only point down: the ladder of `docs/layout.md` is checked against every `crate::` path in the
//! library code of `src/` (issue 28). Each top-level module must sit in exactly one layer of the table,
//! and may use only the modules of lower layers and those left of it on its own line; a path that points
//! anywhere else (up, or right inside its layer) fails, naming the file, the line and the path. Since
//! the ladder is a total order, this also rules out every import circle.
//!
//! What counts as a use: `crate::name` and `crate::{a, b::c}` anywhere in code (`use` or inline,
//! macros included), with names the crate root re-exports (`crate::Error`) resolved to their module.
//! Not counted: comments, string literals, and test-only code (`#[cfg(test)]` items and modules, and the
//! files they declare), which may start a whole launcher. Reads files only: no Redis, no Ruby.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A module's place: its layer (1 at the bottom) and its position on the layer's line.
type Place = (usize, usize);

/// The table of `docs/layout.md`: each row `| <n> <folder> | `a`, `b` | ... |`, bottom first. The
/// folder is where the layer's modules live under `src/` (`wiring` is the root itself; a layer whose
/// folder is also its one module, `config`, is that module's folder).
fn ladder(doc: &str) -> Result<BTreeMap<String, Place>, String> {
    ladder_and_folders(doc).map(|(places, _)| places)
}

/// [`ladder`], with each layer's folder (index 0 is layer 1).
fn ladder_and_folders(doc: &str) -> Result<(BTreeMap<String, Place>, Vec<String>), String> {
    let mut places = BTreeMap::new();
    let mut folders = Vec::new();
    let mut layers = 0;
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // ["", "1 support", "`error`, `keys`", "nothing ...", ""]
        let Some(layer) = cells
            .get(1)
            .and_then(|c| c.split_whitespace().next())
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        layers += 1;
        folders.push(cells[1].split_whitespace().nth(1).unwrap_or("").to_string());
        if layer != layers {
            return Err(format!("layer {layer} is row {layers} of the table"));
        }
        let may_use = cells.get(3).copied().unwrap_or("");
        let said = match layer {
            1 => "nothing".to_string(),
            2 => "layer 1".to_string(),
            n => format!("layers 1–{}", n - 1),
        };
        if !may_use.starts_with(&said) {
            return Err(format!(
                "layer {layer} may use `{said}`, the table says `{may_use}`"
            ));
        }
        let modules = cells.get(2).copied().unwrap_or("");
        for (pos, name) in modules.split('`').skip(1).step_by(2).enumerate() {
            if places.insert(name.to_string(), (layer, pos)).is_some() {
                return Err(format!("`{name}` is in the table twice"));
            }
        }
    }
    if places.is_empty() {
        return Err("no ladder table found".into());
    }
    Ok((places, folders))
}

/// `text` with comments and string and char literals blanked (each replaced by spaces, newlines
/// kept, so line numbers stay), for finding paths in code only.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, s: &str| {
        out.extend(s.chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
    };
    let mut i = 0;
    while i < b.len() {
        let rest = &text[i..];
        let end = if rest.starts_with("//") {
            rest.find('\n').unwrap_or(rest.len())
        } else if rest.starts_with("/*") {
            let mut depth = 0;
            let mut j = 0;
            loop {
                if j >= rest.len() {
                    break rest.len();
                }
                if rest[j..].starts_with("/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with("*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break j;
                    }
                } else {
                    j += rest[j..].chars().next().map_or(1, char::len_utf8);
                }
            }
        } else if let Some(hashes) = raw_string_start(rest).filter(|_| !preceded_by_ident(text, i))
        {
            // r"..." or r#"..."#, also br"...": up to the quote and as many hashes.
            let open = rest.find('"').unwrap_or(0) + 1;
            let close = format!("\"{}", "#".repeat(hashes));
            rest[open..]
                .find(&close)
                .map_or(rest.len(), |k| open + k + close.len())
        } else if rest.starts_with('"') {
            let mut j = 1;
            let bytes = rest.as_bytes();
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            (j + 1).min(rest.len())
        } else if rest.starts_with('\'') {
            char_literal_len(rest).unwrap_or(0)
        } else {
            0
        };
        if end > 0 {
            blank(&mut out, &rest[..end]);
            i += end;
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The number of `#` of a raw string literal starting `s` (`r"`, `r#"`, `br"`), if one does.
fn raw_string_start(s: &str) -> Option<usize> {
    let s = s.strip_prefix('b').unwrap_or(s);
    let s = s.strip_prefix('r')?;
    let hashes = s.len() - s.trim_start_matches('#').len();
    s[hashes..].starts_with('"').then_some(hashes)
}

/// True when the byte before `i` continues an identifier (so `r"` there is not a raw string start).
fn preceded_by_ident(text: &str, i: usize) -> bool {
    text[..i]
        .chars()
        .next_back()
        .is_some_and(|c| c.is_alphanumeric() || c == '_')
}

/// The length of a char literal at the start of `s` (`'x'`, `'\n'`, `'\u{1F600}'`); `None` for a
/// lifetime or label (`'a`).
fn char_literal_len(s: &str) -> Option<usize> {
    let mut chars = s.char_indices().skip(1);
    let (_, c) = chars.next()?;
    if c == '\\' {
        return s.get(3..)?.find('\'').map(|k| k + 4);
    }
    let (k, next) = chars.next()?;
    (next == '\'').then_some(k + 1)
}

/// The byte offset just past the item starting at `from` (after its attributes): its `;` at depth 0,
/// or the `}` that closes its first brace.
fn item_end(code: &str, from: usize) -> usize {
    let mut depth = 0i32;
    let mut opened = false;
    for (k, c) in code[from..].char_indices() {
        match c {
            '{' | '(' | '[' => {
                depth += 1;
                opened |= c == '{';
            }
            '}' | ')' | ']' => {
                depth -= 1;
                if depth == 0 && c == '}' && opened {
                    return from + k + 1;
                }
            }
            ';' if depth == 0 => return from + k + 1,
            _ => {}
        }
    }
    code.len()
}

/// Library code: `code` (already [`code_only`]) with every `#[cfg(test)]` item blanked; also the names
/// of the test-only modules it declares in files of their own (`#[cfg(test)] mod tests_x;`).
fn without_tests(code: &str) -> (String, Vec<String>) {
    let mut out = code.to_string();
    let mut test_files = Vec::new();
    let mut at = 0;
    while let Some(k) = code[at..].find("#[cfg(test)]") {
        let start = at + k;
        let mut item = start + "#[cfg(test)]".len();
        // Further attributes of the same item.
        loop {
            let rest = code[item..].trim_start();
            item = code.len() - rest.len();
            if rest.starts_with("#[") {
                item = closing(code, item, '[', ']');
            } else {
                break;
            }
        }
        let end = item_end(code, item);
        let decl = code[item..end].trim();
        let decl = decl
            .strip_prefix("pub(crate) ")
            .or_else(|| decl.strip_prefix("pub "))
            .unwrap_or(decl);
        if let Some(name) = decl.strip_prefix("mod ").and_then(|d| d.strip_suffix(';')) {
            test_files.push(name.trim().to_string());
        }
        let blanked: String = code[start..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        out.replace_range(start..end, &blanked);
        at = end;
    }
    (out, test_files)
}

/// Just past the bracket that closes the first `open` at or after `from` (`#[...]`, `{...}`).
fn closing(code: &str, from: usize, open: char, close: char) -> usize {
    let mut depth = 0;
    for (k, c) in code[from..].char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth -= 1;
            if depth == 0 {
                return from + k + 1;
            }
        }
    }
    code.len()
}

/// The path at the start of `s` (`keys`, `support::keys::hex`), without a trailing `::{...}`.
fn path_prefix(s: &str) -> String {
    let p: String = s
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
        .collect();
    p.trim_end_matches(':').to_string()
}

/// Each `crate::` path in `code`: (line, the names after `crate::` up to a group or an item's end,
/// as `a::b`, and the path as written).
fn crate_paths(code: &str) -> Vec<(usize, String, String)> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(k) = code[at..].find("crate::") {
        let start = at + k;
        at = start + "crate::".len();
        if preceded_by_ident(code, start) {
            continue; // `oxidekiq_crate::`, not ours
        }
        let line = code[..start].matches('\n').count() + 1;
        let rest = &code[at..];
        if rest.starts_with('{') {
            // `crate::{a, b::{c, d}, E}`: the first name of each element at depth 1.
            let end = closing(rest, 0, '{', '}');
            let group = &rest[1..end.saturating_sub(1)];
            let written = format!("crate::{}", &rest[..end]);
            let mut depth = 0;
            let mut element = String::new();
            for c in group.chars().chain(std::iter::once(',')) {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        let name = path_prefix(element.trim());
                        if !name.is_empty() {
                            found.push((line, name, written.clone()));
                        }
                        element.clear();
                        continue;
                    }
                    _ => {}
                }
                element.push(c);
            }
        } else {
            let name = path_prefix(rest);
            let written: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            if !name.is_empty() {
                found.push((line, name, format!("crate::{written}")));
            }
        }
    }
    found
}

/// The crate's modules and the names its root re-exports (`pub use client::{Client, ..}`), each with
/// its module. A module is a `mod` item of lib.rs that is not test-only, or, for an item naming one of
/// the layer `folders`, each module that folder's `mod.rs` declares (`mods`, the text of those files)
/// and lib.rs re-exports (`pub(crate) use support::{keys, ..}`).
fn crate_root(
    lib: &str,
    folders: &BTreeSet<String>,
    mods: &dyn Fn(&str) -> String,
) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let (code, _) = without_tests(&code_only(lib));
    let mut modules = BTreeSet::new();
    let mut reexports = BTreeMap::new();
    for stmt in code.split(';') {
        let words: Vec<&str> = stmt.split_whitespace().collect();
        let Some(i) = words.iter().position(|w| *w == "mod" || *w == "use") else {
            continue;
        };
        let rest = words[i + 1..].join(" ");
        if words[i] == "mod" {
            if folders.contains(&rest) && !rest.is_empty() {
                let (inner, _) = without_tests(&code_only(&mods(&rest)));
                for st in inner.split(';') {
                    let w: Vec<&str> = st.split_whitespace().collect();
                    if let Some(k) = w.iter().position(|w| *w == "mod") {
                        modules.insert(w[k + 1..].join(" "));
                    }
                }
            } else {
                modules.insert(rest);
            }
        } else if words[..i].iter().any(|w| w.starts_with("pub")) {
            // `client::{Client,NewJob}` or `cli::run`: the module, then the names.
            let (module, names) = rest.split_once("::").unwrap_or((&rest, ""));
            if folders.contains(module) {
                continue; // the layer's modules, re-exported at their old paths
            }
            let names = names.rsplit("::").next().unwrap_or("");
            for name in names.trim_matches(|c| c == '{' || c == '}').split(',') {
                let name = name.rsplit(" as ").next().unwrap_or(name).trim();
                reexports.insert(name.to_string(), module.to_string());
            }
        }
    }
    (modules, reexports)
}

/// Every `.rs` file of the library under `dir`, minus the test-only files declared by their parent.
fn library_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            library_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The directory holding the files of the submodules `file` declares.
fn submodule_dir(file: &Path) -> PathBuf {
    let dir = file.parent().unwrap().to_path_buf();
    match file.file_stem().and_then(|s| s.to_str()) {
        Some("mod") | Some("lib") => dir,
        Some(stem) => dir.join(stem),
        None => dir,
    }
}

/// A use of one module by another, where it is written.
#[derive(Debug)]
struct Use {
    from: String,
    to: String,
    at: String,
}

/// What the tree says of the modules: every use between two different modules of `src/`, the names no
/// rule resolved, and the folder each module's code lives in (`""` for the root of `src/`).
#[derive(Debug, Default)]
struct Tree {
    modules: BTreeSet<String>,
    uses: Vec<Use>,
    unresolved: Vec<String>,
    folder_of: BTreeMap<String, String>,
}

/// Reads `src` with the layer `folders` of docs/layout.md.
fn tree(src: &Path, folders: &BTreeSet<String>) -> Tree {
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let mods =
        |folder: &str| std::fs::read_to_string(src.join(folder).join("mod.rs")).unwrap_or_default();
    let (modules, reexports) = crate_root(&lib, folders, &mods);
    let mut files = Vec::new();
    library_files(src, &mut files);
    let mut test_only = BTreeSet::new();
    let mut found = Vec::new();
    let mut out = Tree::default();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let (code, tests) = without_tests(&code_only(&text));
        for t in tests {
            test_only.insert(submodule_dir(file).join(format!("{t}.rs")));
        }
        found.push((file.clone(), code));
    }
    for (file, code) in found {
        let rel = file.strip_prefix(src).unwrap();
        let parts: Vec<String> = rel
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_string()
            })
            .collect();
        // `src/<layer>/<module>...` or `src/<module>...`.
        let (folder, top) =
            if parts.len() > 1 && folders.contains(&parts[0]) && !modules.contains(&parts[0]) {
                (parts[0].clone(), parts[1].clone())
            } else {
                (String::new(), parts[0].clone())
            };
        if test_only.contains(&file) || top == "lib" || top == "mod" || !modules.contains(&top) {
            continue;
        }
        out.folder_of.entry(top.clone()).or_insert(folder);
        for (line, path, written) in crate_paths(&code) {
            let mut segs = path.split("::");
            let first = segs.next().unwrap_or("").to_string();
            // `crate::support::keys` names the module through its folder.
            let name = if folders.contains(&first) && !modules.contains(&first) {
                segs.next().unwrap_or("").to_string()
            } else {
                first
            };
            let to = if modules.contains(&name) {
                name.clone()
            } else if let Some(m) = reexports.get(&name) {
                m.clone()
            } else {
                out.unresolved
                    .push(format!("src/{}:{line}: {written}", rel.display()));
                continue;
            };
            if to != top {
                out.uses.push(Use {
                    from: top.clone(),
                    to,
                    at: format!("src/{}:{line}: {written}", rel.display()),
                });
            }
        }
    }
    out.modules = modules;
    out
}

/// The breaches of `ladder` among `uses`: paths up the ladder, or right inside a layer.
fn breaches(ladder: &BTreeMap<String, Place>, uses: &[Use]) -> Vec<String> {
    uses.iter()
        .filter_map(|u| {
            let (from, to) = (ladder.get(&u.from)?, ladder.get(&u.to)?);
            (to >= from).then(|| {
                format!(
                    "{} (layer {}) uses {} (layer {}{}): {}",
                    u.from,
                    from.0,
                    u.to,
                    to.0,
                    if to.0 == from.0 { ", right of it" } else { "" },
                    u.at
                )
            })
        })
        .collect()
}

#[test]
fn every_module_uses_only_the_layers_below_it_in_docs_layout() {
    let doc = std::fs::read_to_string(root().join("docs/layout.md")).unwrap();
    let (ladder, folders) = ladder_and_folders(&doc).unwrap();
    let folder_set = layer_folders(&ladder, &folders);
    let t = tree(&root().join("src"), &folder_set);
    assert!(
        t.unresolved.is_empty(),
        "crate:: paths naming neither a module nor a root re-export (teach this test): {:#?}",
        t.unresolved
    );
    let placed: BTreeSet<String> = ladder.keys().cloned().collect();
    let unplaced: Vec<_> = t.modules.difference(&placed).collect();
    let gone: Vec<_> = placed.difference(&t.modules).collect();
    assert!(
        unplaced.is_empty() && gone.is_empty(),
        "docs/layout.md's table must list each module once: not listed {unplaced:?}, \
         listed but not in src/ {gone:?}"
    );
    let bad = breaches(&ladder, &t.uses);
    assert!(
        bad.is_empty(),
        "layers only point down (docs/layout.md); pass a value or a trait object instead, or move the \
         name down:\n{}",
        bad.join("\n")
    );
    // Not a vacuous pass: the library has many uses between modules.
    assert!(t.uses.len() > 100, "only {} uses found", t.uses.len());
}

#[test]
fn each_module_lives_in_its_layers_folder() {
    let doc = std::fs::read_to_string(root().join("docs/layout.md")).unwrap();
    let (ladder, folders) = ladder_and_folders(&doc).unwrap();
    let folder_set = layer_folders(&ladder, &folders);
    let t = tree(&root().join("src"), &folder_set);
    let misplaced = misplaced(&ladder, &folders, &t.folder_of);
    assert!(
        misplaced.is_empty(),
        "src/ must show the ladder: each module in its layer's folder (docs/layout.md):\n{}",
        misplaced.join("\n")
    );
    // The root holds the wiring and nothing else but the layer folders.
    let mut root_entries: Vec<String> = std::fs::read_dir(root().join("src"))
        .unwrap()
        .map(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    root_entries.sort();
    for e in &root_entries {
        assert!(
            e == "lib"
                || folder_set.contains(e)
                || ladder.contains_key(e) && folders[ladder[e].0 - 1] == *e
                || ladder.get(e).is_some_and(|p| folders[p.0 - 1] == "wiring"),
            "src/{e} is neither a layer's folder nor a module of the wiring"
        );
    }
    assert!(
        root_entries.len() <= 16,
        "src/ has {} entries",
        root_entries.len()
    );
}

/// The folders that hold a layer's modules: each layer's, less `wiring` (the root) and a folder that is
/// a module's own (`config`).
fn layer_folders(ladder: &BTreeMap<String, Place>, folders: &[String]) -> BTreeSet<String> {
    folders
        .iter()
        .filter(|f| *f != "wiring" && !ladder.contains_key(*f))
        .cloned()
        .collect()
}

/// The modules whose code is not in their layer's folder: `wiring` means the root of `src/`, and a
/// layer whose folder is its module's own (`config`) counts as the root too.
fn misplaced(
    ladder: &BTreeMap<String, Place>,
    folders: &[String],
    folder_of: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (module, place) in ladder {
        let want = folders[place.0 - 1].as_str();
        let want = if want == "wiring" || want == module {
            ""
        } else {
            want
        };
        match folder_of.get(module) {
            Some(f) if f == want => {}
            Some(f) => out.push(format!(
                "{module} (layer {}) is in src/{f}, not src/{want}",
                place.0
            )),
            None => {} // no library code (cfg-only modules): nothing to place
        }
    }
    out
}

#[test]
fn the_scanner_sees_every_form_of_path_and_skips_comments_strings_and_tests() {
    let text = r##"
use crate::error::{Error, Result};
use crate::{keys, job::{self, Job}, Launcher};
// crate::commented
/* crate::blocked /* nested */ crate::still */
const S: &str = "crate::in_string redis://h";
const R: &str = r#"crate::raw "quoted""#;
fn f<'a>(c: char) -> bool { c == '"' && crate::time::now() > 0.0 }
#[cfg(test)]
use crate::testonly::X;
#[cfg(test)]
#[allow(dead_code)]
fn t() { crate::testfn::y() }
#[cfg(test)]
mod tests_file;
#[cfg(test)]
mod tests { use crate::inner_test; }
fn g() { crate::lua::lua_common!(); }
"##;
    let (code, test_files) = without_tests(&code_only(text));
    let names: Vec<String> = crate_paths(&code)
        .into_iter()
        .map(|(_, n, _)| n.split("::").next().unwrap_or("").to_string())
        .collect();
    assert_eq!(
        names,
        ["error", "keys", "job", "Launcher", "time", "lua"],
        "{code}"
    );
    assert_eq!(test_files, ["tests_file"]);
    let lib = "pub mod a;\npub(crate) mod b;\nmod layer;\n#[cfg(test)]\nmod t;\npub use a::x::{Y, Z};\npub use b::w;\npub(crate) use layer::{c, d};\n";
    let folders: BTreeSet<String> = ["layer".to_string()].into();
    let mods = |f: &str| {
        assert_eq!(f, "layer");
        "pub mod c;\npub(crate) mod d;\n#[cfg(test)]\nmod tests_e;\n".to_string()
    };
    let (modules, reexports) = crate_root(lib, &folders, &mods);
    assert_eq!(
        modules.into_iter().collect::<Vec<_>>(),
        ["a", "b", "c", "d"]
    );
    assert!(
        !reexports.contains_key("c"),
        "a layer's modules are modules, not items"
    );
    assert_eq!(reexports.get("Y").map(String::as_str), Some("a"));
    assert_eq!(reexports.get("w").map(String::as_str), Some("b"));
}

#[test]
fn a_use_up_the_ladder_or_right_inside_a_layer_is_a_breach() {
    let doc = "| layer | modules | may use |\n|---|---|---|\n| 1 low | `a`, `b` | nothing |\n| 2 high | `c` | layer 1 |\n";
    let places = ladder(doc).unwrap();
    let u = |from: &str, to: &str| Use {
        from: from.into(),
        to: to.into(),
        at: "here".into(),
    };
    assert!(breaches(&places, &[u("c", "a"), u("b", "a")]).is_empty());
    assert_eq!(breaches(&places, &[u("a", "c")]).len(), 1, "up a layer");
    assert_eq!(
        breaches(&places, &[u("a", "b")]).len(),
        1,
        "right inside a layer"
    );
    assert!(
        ladder("| 2 x | `a` | layer 1 |").is_err(),
        "layers are numbered from the bottom"
    );
    assert!(
        ladder("| 1 x | `a` | layer 2 |").is_err(),
        "what a layer may use is said right"
    );
}

#[test]
fn a_module_outside_its_layers_folder_is_named() {
    let doc = "| layer | modules | may use |\n|---|---|---|\n| 1 low | `a`, `b` | nothing |\n| 2 wiring | `c` | layer 1 |\n";
    let (places, folders) = ladder_and_folders(doc).unwrap();
    assert_eq!(folders, ["low", "wiring"]);
    let at = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(m, f)| (m.to_string(), f.to_string()))
            .collect()
    };
    assert!(
        misplaced(
            &places,
            &folders,
            &at(&[("a", "low"), ("b", "low"), ("c", "")])
        )
        .is_empty()
    );
    assert_eq!(
        misplaced(
            &places,
            &folders,
            &at(&[("a", ""), ("b", "low"), ("c", "")])
        )
        .len(),
        1,
        "a at the root"
    );
    assert_eq!(
        misplaced(
            &places,
            &folders,
            &at(&[("a", "low"), ("b", "low"), ("c", "low")])
        )
        .len(),
        1,
        "wiring in a folder"
    );
}

/// The backticked names of `doc` that read as a path (`chain/worker.rs`, `fetch/`) or a test function
/// (`a_b_c`, or `module::a_b_c`), for [`the_architecture_page_names_only_files_and_tests_that_exist`].
fn cited(doc: &str) -> (Vec<String>, Vec<String>) {
    let mut paths = Vec::new();
    let mut tests = Vec::new();
    for name in doc.split('`').skip(1).step_by(2) {
        let name = name.split_whitespace().next().unwrap_or("");
        let ident = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        };
        if (name.ends_with(".rs") || name.ends_with('/'))
            && !name.contains("::")
            && !name.starts_with("..")
        {
            paths.push(name.to_string());
        } else if let Some(last) = name
            .rsplit("::")
            .next()
            .filter(|l| ident(l) && l.matches('_').count() >= 4)
        {
            tests.push(last.to_string());
        }
    }
    (paths, tests)
}

/// The architecture page matches the code: every file or folder it names exists (under `src/`, or from
/// the repository's root for `tests/` and `scripts/` paths, or as the tail of a path under `src/`), and
/// every test it cites as keeping an invariant is a function of `src/` or `tests/`.
#[test]
fn the_architecture_page_names_only_files_and_tests_that_exist() {
    let doc = std::fs::read_to_string(root().join("docs/layout.md")).unwrap();
    let (paths, tests) = cited(&doc);
    assert!(paths.len() > 10 && tests.len() > 5, "{paths:?} {tests:?}");
    let mut files = Vec::new();
    library_files(&root().join("src"), &mut files);
    library_files(&root().join("tests"), &mut files);
    let rel: Vec<String> = files
        .iter()
        .map(|f| {
            f.strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/")
        })
        .collect();
    let mut missing = Vec::new();
    for p in &paths {
        let found = root().join(p).exists()
            || root().join("src").join(p).exists()
            || rel
                .iter()
                .any(|r| r.ends_with(&format!("/{p}")) || r.contains(&format!("/{p}")));
        if !found {
            missing.push(format!("file {p}"));
        }
    }
    let bodies: Vec<String> = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect();
    for t in &tests {
        if !bodies.iter().any(|b| b.contains(&format!("fn {t}("))) {
            missing.push(format!("test {t}"));
        }
    }
    assert!(
        missing.is_empty(),
        "docs/layout.md names what the code does not have:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_page_check_sees_paths_and_test_names() {
    let (paths, tests) = cited(
        "`chain/worker.rs`, `fetch/`, `keys::tests::no_key_literal_outside_keys`, `a_b`, `x`",
    );
    assert_eq!(paths, ["chain/worker.rs", "fetch/"]);
    assert_eq!(tests, ["no_key_literal_outside_keys"]);
}
