//! The code the model mirrors, pinned by hash: each snippet below (a Lua script constant, the macro of
//! `move_back`, the functions holding a `MULTI` body or the bookkeeping the model copies) is cut out of
//! its source file and hashed (SHA-1 of its text). A change to any of them fails
//! `the_mirrored_code_is_the_code_the_model_was_checked_against`, naming it: look at the model's step that
//! names it (tests/offline/fetch_model/model.rs), change the model if the protocol changed, run the checker, and
//! then write the new hash here.

use sha1::{Digest, Sha1};

/// (file under src/, what to cut, the SHA-1 of its text when the model was last checked against it).
/// `const NAME` cuts a constant to its closing `"#;` or `);`; `fn NAME` a function to the `}` at its
/// own indentation; `macro_rules! NAME` a macro likewise. A `.lua` file (a script its constant loads
/// with `include_str!`) is hashed whole, `what` naming the constant.
pub const MIRRORED: &[(&str, &str, &str)] = &[
    (
        "processing/fetch/reliable/fetch.lua",
        "const FETCH_LUA",
        "d2dc758ec4426acd4bdc1dd3c945b3d110e69452",
    ),
    (
        "processing/fetch/reliable/guard.lua",
        "const GUARD_LUA",
        "778a1d9a2d9f57140ad705f97ca2e302b2450d7f",
    ),
    (
        "processing/fetch/reliable/sweeps.rs",
        "const MOVE_BACK_LUA",
        "e7cb8ce128dc22f5221fc9c8a8c7dd3c51e73ffa",
    ),
    (
        "processing/fetch/reliable/push_back.lua",
        "const PUSH_BACK_LUA",
        "f85192427c40c325975fa9c4f39dc132ab9201f8",
    ),
    (
        "processing/fetch/reliable/fast.rs",
        "fn fetch_fast",
        "e430aaea228078efa31ef96c4ab89877fefad826",
    ),
    (
        "processing/fetch/reliable/script.rs",
        "fn fetch_batch",
        "ebd2375560bdcb1e13ba952e0f320791313332f0",
    ),
    (
        "processing/fetch/reliable/batch.rs",
        "fn settle",
        "38ad53e2ea7556b3b278ed6887606d57867b4be3",
    ),
    (
        "processing/fetch/reliable/acks.rs",
        "fn ack",
        "7082b4ddcf234d91a166292ee81220e2201de850",
    ),
    (
        "processing/fetch/reliable/sweeps.rs",
        "fn requeue",
        "58fef675ba770ae81f0d626901b00cd1351472d4",
    ),
    (
        "processing/fetch/reliable/sweeps.rs",
        "fn leftovers",
        "facf6216ef179f0ae66e86e09f47b921457518cb",
    ),
    (
        "processing/fetch/reliable/sweeps.rs",
        "fn reconcile_now",
        "6aabcd58b58394d5448d5f7ddd5d01b68ad831f1",
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
        "7c8099cdfb5f19bb3d7e02503bfc2ccb9deb9422",
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
        "619ade98f95869193814e7e7869813ed4b1eedbd",
    ),
];

/// The text hashed for `what` of `file` whose text is `source`: a `.lua` file whole, else [`cut`].
pub fn snippet(file: &str, source: &str, what: &str) -> Result<String, String> {
    if file.ends_with(".lua") {
        return Ok(source.to_string());
    }
    cut(source, what)
}

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
