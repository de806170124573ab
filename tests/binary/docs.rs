//! The docs, checked: README.md's walkthroughs run as a newcomer types them, and every page's Rust is
//! compiled.
//!
//! `the_readme_walkthroughs_run_as_written` runs every fenced `sh` block of README.md, in order, against a
//! private `redis-server` (`REDIS_URL` points at it), with the `oxidekiq` binary of this build first on
//! `PATH`. Each block runs from the repository root under `bash -euo pipefail`, so any command that fails
//! fails the test; a `text` block that comes next after an `sh` block (prose between is fine) is what it
//! prints: each of its lines must appear in the block's output.
//! Two markers on the opening fence change that, visible in the README's source:
//!
//! - `sh slow`: not run. Only for the commands in [`SLOW`]: the demo and the test command install Debian
//!   packages and take minutes, and so does the release build. Instead of the release binary, the test
//!   puts the debug one (`cargo build --workspace`, which `scripts/test.sh` runs first) on `PATH`. Any
//!   other command in a `slow` block fails the test, so the marker cannot hide a step.
//! - `sh background`: one long-running command the README runs in a second terminal. It is started
//!   (`exec`ed, so that Ctrl-C's SIGINT reaches it), the next block waits until it logs its `starting`
//!   line, and after the last block it gets SIGINT and must exit 0.
//!
//! The Rust blocks are compiled by `cargo test --doc` (`src/doc_snippets.rs` includes every page);
//! the other tests here check that no page with a Rust block is missing from it, that none is
//! `ignore`d, and that README's `HardWorker` is the one in `workers/src/lib.rs` that the walkthrough runs.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::{LoggedProcess, Oxidekiq, RedisServer};

/// The commands a `sh slow` block may hold, and why the walkthrough test does not run them.
const SLOW: &[(&str, &str)] = &[
    (
        "bash scripts/demo.sh",
        "installs packages, builds in release, runs a minute",
    ),
    (
        "bash scripts/test.sh",
        "installs packages and runs every test: this test among them",
    ),
    (
        "cargo build --release",
        "minutes; the debug binary of this build stands in",
    ),
    (
        r#"export PATH="$PWD/target/release:$PATH""#,
        "the debug binary's directory is put on PATH instead",
    ),
];

/// How long one block may take: the longest, the roll back, waits a few seconds by design.
const BLOCK_TIMEOUT: Duration = Duration::from_secs(300);

/// A fenced code block of a Markdown page.
#[derive(Debug)]
struct Block {
    /// The first word of the info string (`sh`, `rust`, `text`; empty when there is none).
    lang: String,
    /// The other words (`slow`, `background`, `no_run`).
    tags: Vec<String>,
    /// The lines between the fences, without the fence's indentation.
    body: String,
    /// 1-based line of the opening fence, for messages.
    line: usize,
    /// 1-based line of the closing fence.
    end: usize,
}

/// Every fenced block of `markdown`, fences possibly indented (inside a list item).
fn blocks(markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(usize, Block)> = None;
    for (i, raw) in markdown.lines().enumerate() {
        let trimmed = raw.trim_start();
        let indent = raw.len() - trimmed.len();
        match open.take() {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    let mut words = info.split([' ', ',']).filter(|w| !w.is_empty());
                    let lang = words.next().unwrap_or("").to_string();
                    let tags = words.map(str::to_string).collect();
                    let block = Block {
                        lang,
                        tags,
                        body: String::new(),
                        line: i + 1,
                        end: 0,
                    };
                    open = Some((indent, block));
                }
            }
            Some((fence_indent, mut block)) => {
                if trimmed == "```" {
                    block.end = i + 1;
                    out.push(block);
                } else {
                    let cut = raw.len() - raw.trim_start().len();
                    block.body.push_str(&raw[cut.min(fence_indent)..]);
                    block.body.push('\n');
                    open = Some((fence_indent, block));
                }
            }
        }
    }
    assert!(open.is_none(), "a code fence is never closed");
    out
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// README.md and every `docs/*.md`.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The commands of a shell block: its lines without comments, blank lines dropped.
fn commands(body: &str) -> Vec<&str> {
    body.lines()
        .map(|l| l.split(" #").next().unwrap_or("").trim())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

#[test]
fn the_readme_walkthroughs_run_as_written() {
    let bin = Oxidekiq::binary();
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --workspace` first",
        bin.display()
    );
    let redis = RedisServer::start();
    let url = redis.url();
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let env = [("REDIS_URL", url.as_str()), ("PATH", path.as_str())];
    let cd = format!("cd '{}'", root().display());

    let all = blocks(&read(&root().join("README.md")));
    let (mut ran, mut skipped) = (0, 0);
    let mut background: Vec<(usize, LoggedProcess)> = Vec::new();
    for (i, block) in all.iter().enumerate() {
        if block.lang != "sh" {
            continue;
        }
        let at = format!("README.md:{}", block.line);
        // A starting background process must be serving before the steps that rely on it.
        for (line, process) in &background {
            assert!(
                process.wait_for_log(" starting", Duration::from_secs(60)),
                "the background command of README.md:{line} did not log its start line"
            );
        }
        match block.tags.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            ["slow"] => {
                for command in commands(&block.body) {
                    assert!(
                        SLOW.iter().any(|(slow, _)| *slow == command),
                        "{at}: `{command}` is in a `sh slow` block, which the test does not run; \
                         only the commands of SLOW may be (mark the block `sh` so it runs)"
                    );
                }
                skipped += 1;
            }
            ["background"] => {
                let command = commands(&block.body);
                assert_eq!(command.len(), 1, "{at}: a background block is one command");
                let script = format!("{cd} && exec {}", command[0]);
                let process = LoggedProcess::spawn(
                    "walkthrough-background",
                    Path::new("bash"),
                    &["-c", &script],
                    &env,
                );
                background.push((block.line, process));
                ran += 1;
            }
            [] => {
                let script = format!("{cd}\n{}", block.body);
                let mut process = LoggedProcess::spawn(
                    "walkthrough",
                    Path::new("bash"),
                    &["-euo", "pipefail", "-c", &script],
                    &env,
                );
                let status = process.wait_exit(BLOCK_TIMEOUT);
                let log = process.log();
                assert!(
                    status.is_some_and(|s| s.success()),
                    "{at} failed ({status:?}):\n{}\n--- output ---\n{log}",
                    block.body
                );
                if let Some(next) = all.get(i + 1).filter(|n| n.lang == "text") {
                    for expected in next.body.lines().filter(|l| !l.trim().is_empty()) {
                        assert!(
                            log.contains(expected),
                            "{at} did not print `{expected}` (README.md:{}):\n{log}",
                            next.line
                        );
                    }
                }
                ran += 1;
            }
            ref other => panic!("{at}: unknown marker {other:?} (known: slow, background)"),
        }
    }
    for (line, mut process) in background {
        process.signal("INT");
        let status = process.wait_exit(Duration::from_secs(60));
        assert!(
            status.is_some_and(|s| s.success()),
            "the background command of README.md:{line} did not stop cleanly on Ctrl-C: {status:?}\n{}",
            process.log()
        );
    }
    // The README's walkthroughs: the first worker (1 block), migrating one worker (4).
    assert!(ran >= 5, "only {ran} shell blocks ran");
    assert!(skipped <= 2, "{skipped} blocks are marked slow");
}

#[test]
fn every_page_with_rust_is_compiled_by_the_doctests() {
    let listed = read(&root().join("src/doc_snippets.rs"));
    for page in pages() {
        let name = page.strip_prefix(root()).unwrap().display().to_string();
        let text = read(&page);
        // rustdoc compiles a block with no language, or `rust`, as Rust.
        let rust: Vec<Block> = blocks(&text)
            .into_iter()
            .filter(|b| b.lang.is_empty() || b.lang == "rust")
            .collect();
        if rust.is_empty() {
            continue;
        }
        assert!(
            listed.contains(&format!("include_str!(\"../{name}\")")),
            "{name} holds Rust blocks but src/doc_snippets.rs does not include it"
        );
        for block in rust {
            assert!(
                !block.tags.iter().any(|t| t == "ignore"),
                "{name}:{}: an `ignore`d block is not compiled: use `no_run`",
                block.line
            );
            assert!(
                !block.lang.is_empty(),
                "{name}:{}: a block without a language is compiled as Rust: say `rust` or `text`",
                block.line
            );
        }
    }
}

#[test]
fn the_readme_hard_worker_is_the_one_the_walkthrough_runs() {
    let readme = read(&root().join("README.md"));
    let lib = read(&root().join("workers/src/lib.rs"));
    let block = blocks(&readme)
        .into_iter()
        .find(|b| b.lang == "rust" && b.body.contains("pub struct HardWorker;"))
        .expect("README.md shows HardWorker");
    let from = block.body.find("#[derive").unwrap();
    assert!(
        lib.contains(&block.body[from..]),
        "README.md:{}: HardWorker differs from workers/src/lib.rs's:\n{}",
        block.line,
        &block.body[from..]
    );
}
