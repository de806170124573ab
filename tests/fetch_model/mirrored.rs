//! The code the model mirrors, pinned by hash: each snippet below (a Lua script constant, the macro of
//! `move_back`, the functions holding a `MULTI` body or the bookkeeping the model copies) is cut out of
//! its source file and hashed (SHA-1 of its text). A change to any of them fails
//! `the_mirrored_code_is_the_code_the_model_was_checked_against`, naming it: look at the model's step that
//! names it (tests/fetch_model/model.rs), change the model if the protocol changed, run the checker, and
//! then write the new hash here.

use sha1::{Digest, Sha1};

/// (file under src/, what to cut, the SHA-1 of its text when the model was last checked against it).
/// `const NAME` cuts a constant to its closing `"#;` or `);`; `fn NAME` a function to the `}` at its
/// own indentation; `macro_rules! NAME` a macro likewise.
pub const MIRRORED: &[(&str, &str, &str)] = &[
    (
        "processing/fetch/reliable.rs",
        "const FETCH_LUA",
        "2ce255a69761d2049b6dd131244a6fa336acbd77",
    ),
    (
        "processing/fetch/reliable.rs",
        "const GUARD_LUA",
        "e6104d3a8b923ff4f12951900fd9cf57004474b2",
    ),
    (
        "processing/fetch/reliable.rs",
        "const MOVE_BACK_LUA",
        "c15d44d94ca72814c3070621cb31fdd4d183d456",
    ),
    (
        "processing/fetch/reliable.rs",
        "const PUSH_BACK_LUA",
        "c60ee92a979108315dfad84e4c1cdb7f58d665e3",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn fetch_fast",
        "d50185b0087f20f483b1ed2306c355868b9db910",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn fetch_batch",
        "26d458518c43635e6fce4f19ee7d710f631e352e",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn settle",
        "d349084b0b777fa3a7eb110b479fd4a42a32f463",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn ack",
        "31a276d67dde5c69f36e83e2382240d9e6b38225",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn requeue",
        "1c9ad8fec35b82558c6d319220b1a14189719feb",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn leftovers",
        "ecaf7592da75103133c87c65eb2007fb63045c37",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn reconcile_now",
        "0fb88d03afb4d373b3a1f9da3cef6d3bf440f2de",
    ),
    (
        "processing/fetch/mod.rs",
        "macro_rules! lua_move_back",
        "f22b8f0f02b0b7e7a007213c1cca4f7bc2922226",
    ),
    (
        "processing/fetch/recovery.rs",
        "const ORPHAN_LUA",
        "103be6e0f1038c240af9356a362f3a51a18d6c73",
    ),
    (
        "processing/fetch/recovery.rs",
        "fn mark_alive",
        "90c0b5d3faf229c8befcb86abbca526f9e8709e4",
    ),
    (
        "processing/fetch/recovery.rs",
        "fn recover_orphans",
        "6af0d11a5c39c3e3b550da8a2abf2e85ba5664f3",
    ),
    (
        "processing/fetch/recovery.rs",
        "fn recover_locked",
        "255e2830fa58edb720c1c4c06b4690e3ac3cc3b5",
    ),
    (
        "processing/manager.rs",
        "fn push_back",
        "d7047f19f33fe3c102c89b94a24ceb944cb9c91b",
    ),
    (
        "processing/manager.rs",
        "fn quiet_sweep",
        "6ba0c3d587c051151b3e725f12ae9e9ada4c9d66",
    ),
    (
        "processing/manager.rs",
        "fn ack_loop",
        "3cab181809ac22a9ecdbc85d8a60baaf0307af95",
    ),
    (
        "sidekiq/retry.rs",
        "const FATE_LUA",
        "1d85cf121cd5dc05ca80cc21975aafc7c9211d98",
    ),
];

/// The text of `what` in `source`, or why it cannot be found.
pub fn cut(source: &str, what: &str) -> Result<String, String> {
    let lines: Vec<&str> = source.lines().collect();
    let starts = |l: &str| {
        let t = l.trim_start();
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        let t = t.strip_prefix("async ").unwrap_or(t);
        t.starts_with(what)
            && t[what.len()..]
                .chars()
                .next()
                .is_some_and(|c| !c.is_alphanumeric() && c != '_')
    };
    let found: Vec<usize> = (0..lines.len()).filter(|&i| starts(lines[i])).collect();
    let [first] = found[..] else {
        return Err(format!("`{what}` found {} times", found.len()));
    };
    let indent = lines[first].len() - lines[first].trim_start().len();
    let closing = format!("{}}}", " ".repeat(indent));
    let end = (first..lines.len()).find(|&i| {
        let l = lines[i];
        if what.starts_with("const ") {
            l.trim() == "\"#;" || (i > first && l.trim() == ");")
        } else {
            i > first && l == closing
        }
    });
    let Some(end) = end else {
        return Err(format!("the end of `{what}` not found"));
    };
    Ok(lines[first..=end].join("\n"))
}

/// SHA-1 of `text`, in hex.
pub fn sha1_hex(text: &str) -> String {
    Sha1::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
