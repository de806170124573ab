//! The reliable fetch protocol, checked exhaustively at small bounds (issue 44): a model of Redis's keys
//! and two processes (`fetch_model/model.rs`), every interleaving of its steps explored
//! (`fetch_model/checker.rs`), the properties of docs/guarantees.md checked in every state: no job in
//! no place, no job twice in Redis, a job run twice only in the cases listed there, a batch list deleted
//! only when every place is acked, a recovered process's lists pushed back whole and once. The code it
//! mirrors is pinned by hash (`fetch_model/mirrored.rs`); each loss the reviews found, planted back into
//! the model, is found with its trace. Needs no Redis.
//!
//! The explorer is a plain breadth-first search over hashed states (about 150 lines) rather than the
//! `stateright` crate: the model is a function from a state to its successors, which is all a search
//! needs, a shortest counterexample falls out of breadth first, and no dependency (nor its build time in
//! CI) is added for it.
//!
//! Bigger bounds by hand: `FETCH_MODEL=procs=2,fetches=2 FETCH_MODEL_PROGRESS=1 cargo test --test
//! offline fetch_model::explore_env_bounds -- --ignored --nocapture`.

#[path = "fetch_model/checker.rs"]
mod checker;
#[path = "fetch_model/mirrored.rs"]
mod mirrored;
#[path = "fetch_model/model.rs"]
mod model;

use model::{Bounds, CI, Mutation};

/// Checks `b` exhaustively; panics with the trace on a violation.
fn explore(name: &str, b: &Bounds) {
    let o = checker::check(b, 50_000_000);
    println!(
        "{name}: {b:?}: {} states, {} transitions, depth {}, {:.2?}",
        o.states, o.transitions, o.depth, o.elapsed
    );
    assert!(o.violation.is_none(), "{}", o.trace());
}

/// One process with every fault, quiet, stop and its deadline, and failing jobs: the fetch paths,
/// lost replies, refusals, sweeps retried and given up, kills anywhere.
#[test]
fn one_process_every_fault_loses_nothing() {
    explore("one process", &Bounds { procs: 1, ..CI });
}

/// Two processes: the first is killed, stalls past its liveness TTL (its key expires while it runs)
/// and meets every fault; the second fetches, runs and recovers it. (With failing jobs too: 887 063
/// states, about a minute; by hand, `FETCH_MODEL=procs=2,fetches=1,stops=0`.)
#[test]
fn two_processes_recovery_loses_nothing() {
    explore(
        "two processes",
        &Bounds {
            fetches: 1,
            failures: false,
            stops: false,
            ..CI
        },
    );
}

/// Two processes with quiet, stop and the deadline on the first, without faults, one slot each.
/// (With two slots: 1 684 038 states, about 100 s; by hand, `FETCH_MODEL=procs=2,fetches=1,faults=0,
/// failures=0`.)
#[test]
fn two_processes_stop_and_recovery_lose_nothing() {
    explore(
        "two processes, stops",
        &Bounds {
            slots: 1,
            fetches: 1,
            faults: false,
            failures: false,
            ..CI
        },
    );
}

/// A planted bug: the checker must find a violation, and say it with its trace.
fn finds(mutation: Mutation, b: Bounds, expect: &str) -> String {
    let b = Bounds { mutation, ..b };
    let o = checker::check(&b, 20_000_000);
    let trace = o.trace();
    println!(
        "{mutation:?}: {} states, {:.2?}\n{trace}",
        o.states, o.elapsed
    );
    let (what, steps, _) = o
        .violation
        .as_ref()
        .unwrap_or_else(|| panic!("{mutation:?} was not found ({} states)", o.states));
    assert!(what.contains(expect), "{mutation:?}: {what}");
    assert!(!steps.is_empty() && trace.contains("trace ("), "{trace}");
    trace
}

#[test]
fn a_trim_before_the_copy_is_found() {
    let trace = finds(
        Mutation::TrimBeforeCopy,
        Bounds {
            procs: 1,
            failures: false,
            stops: false,
            ..CI
        },
        "in no place",
    );
    assert!(trace.contains("copy fails"), "{trace}");
}

#[test]
fn an_ltrim_beside_a_refused_sort_in_the_transaction_is_found() {
    let trace = finds(
        Mutation::TrimOutsideGuard,
        Bounds {
            procs: 1,
            failures: false,
            stops: false,
            ..CI
        },
        "in no place",
    );
    assert!(trace.contains("SORT refused at EXEC"), "{trace}");
}

#[test]
fn a_place_counted_twice_is_found() {
    // A batch of two (one running, one waiting in the feed) and an older batch of one: the quiet
    // sweep pushes the waiting jobs back batch by batch, and retried whole after the second batch's
    // reply is lost, counts the first batch's place again.
    let trace = finds(
        Mutation::CountTwice,
        Bounds {
            jobs: 3,
            procs: 1,
            slots: 3,
            fetches: 2,
            failures: false,
            ..CI
        },
        "not acked",
    );
    assert!(trace.contains("retried"), "{trace}");
}

/// The model at the real code: every snippet it mirrors hashes as when it was last checked.
#[test]
fn the_mirrored_code_is_the_code_the_model_was_checked_against() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut changed = Vec::new();
    for (file, what, want) in mirrored::MIRRORED {
        let text =
            std::fs::read_to_string(src.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let snippet =
            mirrored::snippet(file, &text, what).unwrap_or_else(|e| panic!("{file}: {e}"));
        let got = mirrored::sha1_hex(&snippet);
        if got != *want {
            changed.push(format!("    (\"{file}\", \"{what}\", \"{got}\"),"));
        }
    }
    assert!(
        changed.is_empty(),
        "code the fetch model mirrors changed: look at the model's steps that name it \
         (tests/offline/fetch_model/model.rs), change the model if the protocol changed, run \
         `cargo test --test offline fetch_model::`, then update these rows of MIRRORED in \
         tests/offline/fetch_model/mirrored.rs:\n{}",
        changed.join("\n")
    );
}

/// Bounds from `FETCH_MODEL` (`jobs=3,procs=2,slots=2,fetches=2,faults=1,failures=1,victims=1,
/// recoverers=1,stops=1`) over the CI ones, for runs by hand.
fn env_bounds() -> Bounds {
    let mut b = CI;
    if let Ok(spec) = std::env::var("FETCH_MODEL") {
        for kv in spec.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').expect("key=value");
            let n: u8 = v.parse().expect("a number");
            match k {
                "jobs" => b.jobs = n,
                "procs" => b.procs = n,
                "slots" => b.slots = n,
                "fetches" => b.fetches = n,
                "faults" => b.faults = n != 0,
                "failures" => b.failures = n != 0,
                "victims" => b.victims = n,
                "recoverers" => b.recoverers = n,
                "stops" => b.stops = n != 0,
                _ => panic!("unknown bound {k}"),
            }
        }
    }
    b
}

#[test]
#[ignore = "by hand: FETCH_MODEL=... cargo test --test offline fetch_model::explore_env_bounds -- --ignored --nocapture"]
fn explore_env_bounds() {
    explore("by hand", &env_bounds());
}

/// The guard can fail: a change inside a mirrored script gives another hash than the pinned one.
#[test]
fn a_changed_script_fails_the_guard() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (file, what, pinned) = mirrored::MIRRORED
        .iter()
        .find(|(_, w, _)| *w == "const GUARD_LUA")
        .expect("GUARD_LUA is mirrored");
    let text = std::fs::read_to_string(src.join(file)).expect("guard.lua");
    let moved = text.replacen("redis.pcall('LTRIM', q", "redis.pcall('LTRIM',  q", 1);
    assert_ne!(moved, text, "the guard's LTRIM was found");
    let snippet = mirrored::snippet(file, &moved, what).expect("cut");
    assert_ne!(mirrored::sha1_hex(&snippet), *pinned);
}
