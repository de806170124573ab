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
        "e7f62b665d27c4c30c8e3388462e7f75173c9ac9",
    ),
    (
        "processing/fetch/reliable.rs",
        "const GUARD_LUA",
        "4b7ef066bc431ca74bf5b3f5775a8f106d1b8fcb",
    ),
    (
        "processing/fetch/reliable.rs",
        "const MOVE_BACK_LUA",
        "c15d44d94ca72814c3070621cb31fdd4d183d456",
    ),
    (
        "processing/fetch/reliable.rs",
        "const PUSH_BACK_LUA",
        "42b62f5a8fe1302a9f7f7a0d231884e41cd23280",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn fetch_fast",
        "86a8fd1d3d911fa7e706f30b0001b4cc48258334",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn fetch_batch",
        "0204bd2dbc0ed398730d88f2483b952975dbf1f7",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn settle",
        "d349084b0b777fa3a7eb110b479fd4a42a32f463",
    ),
    (
        "processing/fetch/reliable.rs",
        "fn ack",
        "d3eda7acce6e40716bcd2e8367e9c6ad2ce38989",
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
        "367e9f18c580eeaa69563a2cc94d5e945fec5e0e",
    ),
    (
        "processing/fetch/mod.rs",
        "macro_rules! lua_move_back",
        "fd7b581807b5cf51dfae6fa1b8e8a9c02c75815b",
    ),
    (
        "processing/fetch/recovery.rs",
        "const ORPHAN_LUA",
        "18cb9fb0560863ea06c564fcf7ff6363684158f3",
    ),
    (
        "processing/fetch/recovery.rs",
        "fn mark_alive",
        "b73d026441870d413deca49aa4a93155f61ddd38",
    ),
    (
        "processing/fetch/recovery.rs",
        "fn recover_orphans",
        "48cd381792d775e8c2ad86f792a8eb0f26cd5549",
    ),
    (
        "processing/fetch/recovery.rs",
        "fn recover_locked",
        "9149b1714a3bc8a18817094a11fac1610d75abb6",
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
        "233a77fc96f6e5a9f21c2da7e1fb7b965f673846",
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
