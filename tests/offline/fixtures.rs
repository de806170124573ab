//! Every payload a real Sidekiq wrote (Sidekiq 6.4.1, 7.3.9 and 8.1.7 clients, a 6.4.1 and a 7.3.9
//! server, Rails ActiveJob 6.1, 7.0, 7.1, 7.2, 8.0 and 8.1) parses as Ruby meant it and re-serializes to
//! the same bytes.
//!
//! The fixture folders are enumerated, and every file must have an expectation in [`expectation`]:
//! a new fixture without one fails the test rather than going unchecked. Roots: `fixtures/` (this
//! repository's recordings, `fixtures/record.sh`, plus `fixtures/shared/`, a verbatim copy of the
//! project's shared set) and, when present beside the repository, `../shared/fixtures` itself, which
//! the copy must match byte for byte.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use oxidekiq::Job;
use oxidekiq::job::{RetrySetting, timestamp_seconds};
use serde_json::{Map, Value};

/// The Sidekiq 8.1.7 iterable-job recordings (`fixtures/sidekiq-8.1.7-iterable/`).
#[path = "fixtures/iterable.rs"]
mod iterable;

/// 2020-01-01 and 2100-01-01 in epoch seconds: any timestamp a real Sidekiq wrote lies between.
const PLAUSIBLE: std::ops::Range<f64> = 1_577_836_800.0..4_102_444_800.0;

/// The Rails adapter's wrapper class (Rails' own Sidekiq adapter, ActiveJob 6.1-7.x recordings).
const AJ_WRAPPER: &str = "ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper";

/// Sidekiq's own adapter's wrapper class (Sidekiq >= 7.3.3; the ActiveJob 8.x recordings).
const SIDEKIQ_AJ_WRAPPER: &str = "Sidekiq::ActiveJob::Wrapper";

/// What one fixture file must be.
enum Expect {
    /// A job payload (Sidekiq job or ActiveJob wrapper).
    Job(JobExpect),
    /// The score of the sorted-set member in the `.json` file of the same stem.
    Score(ScoreOf),
    /// Process-level data a server wrote (heartbeat, busy workers, stats).
    Server(ServerFile),
    /// `ruby.json` of an ActiveJob 7.0-8.1 folder: what that ActiveJob read back from each recording,
    /// checked by `src/payload/activejob/tests_versions.rs`; here, that it names every job file.
    RubyFacts,
}

/// What a job payload must hold.
struct JobExpect {
    /// `class`.
    class: &'static str,
    /// What the registry dispatches on (`wrapped` for ActiveJob jobs).
    worker_class: &'static str,
    /// `queue`.
    queue: &'static str,
    /// The `args` array exactly as written; for ActiveJob, the `arguments` array inside `args[0]`.
    /// `None`: an ActiveJob 7.0-8.1 recording whose arguments differ by version, checked against what
    /// that ActiveJob read back (`ruby.json`) by `src/payload/activejob/tests_versions.rs`.
    args: Option<&'static str>,
    /// `retry` as Ruby reads it.
    retry: Option<RetrySetting>,
    /// Whether it was pushed to a queue (has `enqueued_at`) or into a sorted set by a client
    /// (`schedule`: no `enqueued_at`).
    enqueued: bool,
    /// Set on a job a server failed: `error_class`, `error_message`, `retry_count`.
    failure: Option<(&'static str, &'static str, i64)>,
}

/// Which timing rule a `.score` file follows.
#[derive(Clone, Copy)]
enum ScoreOf {
    /// `perform_in(3600)` / `set(wait: 1.hour)`: about an hour after `created_at`.
    InOneHour,
    /// A first retry: 15 to 25 seconds after `failed_at` (`count**4 + 15 + rand(10) * (count + 1)`).
    FirstRetry,
    /// `set(wait_until: ...)`: the job's own `scheduled_at` (ActiveJob >= 7.1), in the future.
    Later,
    /// A Rails 8.1 continuation's `retry_job(wait: 5.seconds)`: its `scheduled_at`, 5 s after the
    /// interrupt.
    ResumeWait,
}

/// The process-level files a server set holds.
#[derive(Clone, Copy)]
enum ServerFile {
    /// `<identity>` as `hostname:pid:nonce`.
    Identity,
    /// The heartbeat's `info` JSON.
    HeartbeatInfo,
    /// The heartbeat hash as a JSON object (6.4.1 recording).
    HeartbeatHashJson,
    /// The heartbeat hash as `redis-cli` printed it (7.3.9 recording).
    HeartbeatHashText,
    /// `<identity>:workers` as a JSON object, thread id → entry (6.4.1).
    WorkersHashJson,
    /// One entry of `<identity>:workers` (6.4.1).
    WorkersEntry,
    /// `<identity>:work` as `redis-cli` printed it (7.3.9).
    WorkHashText,
    /// The `stat:*` key names.
    StatKeys,
}

/// The kinds of fixture folder, by name.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Folder {
    /// `sidekiq-<version>`: the client calls of the shared README's table.
    SidekiqClient,
    /// `sidekiq-<version>-server`: what a running server wrote.
    SidekiqServer,
    /// `activejob-<version>`: `perform_later` through Rails' Sidekiq adapter.
    ActiveJob,
}

fn folder_kind(name: &str) -> Option<Folder> {
    if name.starts_with("sidekiq-") && name.ends_with("-server") {
        Some(Folder::SidekiqServer)
    } else if name.starts_with("sidekiq-") {
        Some(Folder::SidekiqClient)
    } else if name.starts_with("activejob-") {
        Some(Folder::ActiveJob)
    } else {
        None
    }
}

const fn job(class: &'static str, queue: &'static str, args: &'static str) -> JobExpect {
    JobExpect {
        class,
        worker_class: class,
        queue,
        args: Some(args),
        retry: Some(RetrySetting::Default),
        enqueued: true,
        failure: None,
    }
}

/// The wrapper class an `activejob-<version>` folder's recordings carry.
fn aj_wrapper(folder: &str) -> &'static str {
    if folder.starts_with("activejob-8.") {
        SIDEKIQ_AJ_WRAPPER
    } else {
        AJ_WRAPPER
    }
}

fn aj(wrapper: &'static str, queue: &'static str, arguments: &'static str) -> JobExpect {
    JobExpect {
        args: Some(arguments),
        ..aj_any(wrapper, "WelcomeEmailJob", queue)
    }
}

/// An ActiveJob 7.0-8.1 recording whose arguments `tests_versions.rs` checks.
const fn aj_any(
    wrapper: &'static str,
    worker_class: &'static str,
    queue: &'static str,
) -> JobExpect {
    JobExpect {
        class: wrapper,
        worker_class,
        queue,
        args: None,
        retry: Some(RetrySetting::Default),
        enqueued: true,
        failure: None,
    }
}

/// The expectation for `file` in folder `folder` (e.g. `sidekiq-7.3.9-server`); `None` if the file
/// is not known, which fails the test.
fn expectation(folder: &str, file: &str) -> Option<Expect> {
    use Expect::{Job as J, Score, Server};
    use ServerFile as S;
    let w = aj_wrapper(folder);
    let versioned = folder != "activejob-6.1";
    let server_version = folder
        .strip_prefix("sidekiq-")
        .and_then(|v| v.strip_suffix("-server"));
    Some(match (folder_kind(folder)?, file) {
        // The shared README's call table, for every client version.
        (Folder::SidekiqClient, "enqueued_plain.json") => {
            J(job("HardWorker", "default", r#"["bob",5]"#))
        }
        (Folder::SidekiqClient, "enqueued_options_unicode.json") => J(JobExpect {
            retry: Some(RetrySetting::Count(3)),
            ..job(
                "HardWorker",
                "critical",
                r#"[{"nested":{"a":[1,2.5,null,true],"big":12345678901234567890}},"ünïcode ✓ \u0000 \"quoted\""]"#,
            )
        }),
        (Folder::SidekiqClient, "enqueued_retry_false_no_args.json") => J(JobExpect {
            retry: Some(RetrySetting::Disabled),
            ..job("HardWorker", "default", "[]")
        }),
        (Folder::SidekiqClient, "enqueued_retry_queue.json") => {
            J(job("HardWorker", "default", "[1]"))
        }
        (Folder::SidekiqClient, "enqueued_namespaced_class.json") => {
            J(job("Billing::ChargeJob", "default", r#"[42,19.99,"USD"]"#))
        }
        (Folder::SidekiqClient, "scheduled.json") => J(JobExpect {
            enqueued: false,
            ..job("HardWorker", "default", r#"["later"]"#)
        }),
        (Folder::SidekiqClient, "scheduled.score") => Score(ScoreOf::InOneHour),
        (Folder::SidekiqClient, "bulk_first.json") => J(job("HardWorker", "default", "[1]")),

        // A running server (fixtures/record.rb for 6.4.1; the shared README for 7.3.9).
        (Folder::SidekiqServer, "retry_after_first_failure.json") => J(JobExpect {
            // record.rb's FailingWorker has `retry: 2`; the 7.3.9 recording's had `retry: true`.
            retry: Some(match server_version {
                Some("6.4.1") => RetrySetting::Count(2),
                _ => RetrySetting::Default,
            }),
            failure: Some(("ArgumentError", "bad input 7", 0)),
            ..job("FailingWorker", "default", "[7]")
        }),
        (Folder::SidekiqServer, "retry_after_first_failure.score") => Score(ScoreOf::FirstRetry),
        (Folder::SidekiqServer, "dead_retry_zero.json") => J(JobExpect {
            retry: Some(RetrySetting::Count(0)),
            failure: Some(("RuntimeError", "boom", 0)),
            ..job("NoRetryDeadWorker", "default", "[]")
        }),
        (Folder::SidekiqServer, "identity.txt") => Server(S::Identity),
        (Folder::SidekiqServer, "heartbeat_info.json") => Server(S::HeartbeatInfo),
        (Folder::SidekiqServer, "heartbeat_hash.json") => Server(S::HeartbeatHashJson),
        (Folder::SidekiqServer, "heartbeat_hash.txt") => Server(S::HeartbeatHashText),
        (Folder::SidekiqServer, "workers_hash.json") => Server(S::WorkersHashJson),
        (Folder::SidekiqServer, "workers_entry.json") => Server(S::WorkersEntry),
        (Folder::SidekiqServer, "work_hash.txt") => Server(S::WorkHashText),
        (Folder::SidekiqServer, "stat_keys.txt") => Server(S::StatKeys),

        // ActiveJob 6.1 (fixtures/record.rb): `WelcomeEmailJob.perform_later(...)`.
        (Folder::ActiveJob, "no_args.json") => J(aj(w, "default", "[]")),
        (Folder::ActiveJob, "scalars.json") => J(aj(
            w,
            "default",
            r#"[1,-2.5,"two",null,true,false,12345678901234567890]"#,
        )),
        (Folder::ActiveJob, "symbol_keyed_hash.json") => J(aj(
            w,
            "default",
            r#"[{"locale":"fr","count":2,"_aj_symbol_keys":["locale","count"]}]"#,
        )),
        (Folder::ActiveJob, "kwargs.json") => J(aj(
            w,
            "default",
            r#"[{"user_id":7,"notify":true,"_aj_ruby2_keywords":["user_id","notify"]}]"#,
        )),
        // Every built-in serializer of each version (fixtures/activejob-7-8/README.md).
        (Folder::ActiveJob, "serializers.json") if versioned => {
            J(aj_any(w, "WelcomeEmailJob", "default"))
        }
        (Folder::ActiveJob, "locale_timezone_priority.json") if versioned => {
            J(aj_any(w, "WelcomeEmailJob", "critical"))
        }
        (Folder::ActiveJob, "scheduled_wait_until.json") if versioned => J(JobExpect {
            enqueued: false,
            ..aj_any(w, "WelcomeEmailJob", "default")
        }),
        (Folder::ActiveJob, "scheduled_wait_until.score") if versioned => Score(ScoreOf::Later),
        (Folder::ActiveJob, "ruby.json") if versioned => Expect::RubyFacts,
        // Rails 8.1's continuations: the job, and what each interrupt pushed back (into `schedule`).
        (Folder::ActiveJob, "continuable_enqueued.json") if folder == "activejob-8.1" => {
            J(aj_any(w, "ImportRecordsJob", "default"))
        }
        (
            Folder::ActiveJob,
            "continuation_between_steps.json"
            | "continuation_mid_step.json"
            | "continuation_resumed_again.json"
            | "continuation_before_last_step.json",
        ) if folder == "activejob-8.1" => J(JobExpect {
            enqueued: false,
            ..aj_any(w, "ImportRecordsJob", "default")
        }),
        (
            Folder::ActiveJob,
            "continuation_between_steps.score"
            | "continuation_mid_step.score"
            | "continuation_resumed_again.score"
            | "continuation_before_last_step.score",
        ) if folder == "activejob-8.1" => Score(ScoreOf::ResumeWait),
        (Folder::ActiveJob, "serializers.json") => J(aj(
            w,
            "default",
            concat!(
                r#"[{"_aj_serialized":"ActiveJob::Serializers::TimeSerializer","value":"2024-01-02T03:04:05.500000000Z"},"#,
                r#"{"_aj_serialized":"ActiveJob::Serializers::DateSerializer","value":"2024-01-02"},"#,
                r#"{"_aj_serialized":"ActiveJob::Serializers::DateTimeSerializer","value":"2024-01-02T03:04:05.000000000+00:00"},"#,
                r#"{"_aj_serialized":"ActiveJob::Serializers::DurationSerializer","value":3600,"parts":[[{"_aj_serialized":"ActiveJob::Serializers::SymbolSerializer","value":"hours"},1]]},"#,
                r#"{"_aj_serialized":"ActiveJob::Serializers::SymbolSerializer","value":"sym"},"#,
                // ActiveJob 6.1 passes a BigDecimal as its string form.
                r#""1.2345678901234567890123456789","#,
                r#"{"_aj_serialized":"ActiveJob::Serializers::TimeWithZoneSerializer","value":"2024-01-02T03:04:05.000000000+01:00"}]"#,
            ),
        )),
        (Folder::ActiveJob, "globalid.json") => J(aj(
            w,
            "default",
            r#"[{"_aj_globalid":"gid://oxidekiq-fixtures/Person/7"}]"#,
        )),
        (Folder::ActiveJob, "nested.json") => J(aj(
            w,
            "default",
            r#"[[1,[2,[3,[]]]],{"a":{"b":[{"c":null,"_aj_symbol_keys":[]},{"_aj_symbol_keys":[]}],"_aj_symbol_keys":[]},"_aj_symbol_keys":[]}]"#,
        )),
        (Folder::ActiveJob, "scheduled.json") => J(JobExpect {
            enqueued: false,
            ..aj(w, "default", "[1]")
        }),
        (Folder::ActiveJob, "scheduled.score") => Score(ScoreOf::InOneHour),
        (Folder::ActiveJob, "mailers_queue.json") => J(aj(
            w,
            "mailers",
            r#"[42,{"locale":"fr","_aj_symbol_keys":[]}]"#,
        )),
        _ => return None,
    })
}

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The project's shared set, beside the repository (absent on machines that only have the repo).
fn shared_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/fixtures"))
}

/// Files allowed at the top of a root (documentation and the recorder), not fixtures themselves.
const ROOT_FILES: [&str; 4] = ["README.md", "record.sh", "record.rb", "sources.sh"];

/// Every fixture folder under `root` (one level down; `shared/` is a nested root).
fn folders(root: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if path.is_dir() {
            if name == "shared" {
                folders(&path, out);
            } else if name == "activejob-7-8" {
                // The ActiveJob 7.0-8.1 recorder (its recordings are the activejob-<version> folders).
            } else if name == "sidekiq-7-8" {
                // Metrics and retry recordings of Sidekiq 7.3.9/8.1.7: checked by tests/sidekiq_7_8.rs.
            } else if name == "unique-jobs" || name.starts_with("unique-jobs-") {
                // sidekiq-unique-jobs recordings and their recorder: checked by
                // tests/offline/unique_jobs_fixtures.rs, which also fails on a file it has no expectation for.
            } else if name == "older-releases" {
                // Keys older oxidekiq releases left when killed: checked by tests/binary/older_releases.rs.
            } else if name == "sidekiq-8.1.7-iterable" {
                // Iterable-job recordings of a Sidekiq 8.1.7 server: checked by the `iterable` module.
            } else if folder_kind(&name).is_some() {
                out.push(path);
            } else {
                panic!(
                    "unknown fixture folder {}: add it to folder_kind",
                    path.display()
                );
            }
        } else if !ROOT_FILES.contains(&name.as_str()) {
            panic!("unexpected file {} at a fixture root", path.display());
        }
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The file's text without the one trailing newline an editor might add (recorded files have none).
fn content(path: &Path) -> String {
    let text = read(path);
    text.strip_suffix('\n').map(str::to_string).unwrap_or(text)
}

fn timestamp(map: &Map<String, Value>, key: &str, path: &Path) -> f64 {
    let v = map
        .get(key)
        .unwrap_or_else(|| panic!("{}: no `{key}`", path.display()));
    let t = timestamp_seconds(v).unwrap_or_else(|| panic!("{}: `{key}` is {v}", path.display()));
    assert!(
        PLAUSIBLE.contains(&t),
        "{}: `{key}` {t} is not 2020..2100",
        path.display()
    );
    t
}

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
}

fn check_job(path: &Path, want: &JobExpect) {
    let raw = content(path);
    let job = Job::from_str(&raw).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let at = path.display();
    assert_eq!(job.raw(), raw, "{at}: raw bytes kept");
    assert_eq!(job.class(), want.class, "{at}: class");
    assert_eq!(job.worker_class(), want.worker_class, "{at}: worker class");
    assert_eq!(
        job.is_activejob(),
        want.class == AJ_WRAPPER || want.class == SIDEKIQ_AJ_WRAPPER,
        "{at}: is_activejob"
    );
    assert!(
        is_lower_hex(job.jid(), 24),
        "{at}: jid {:?} is 24 hex",
        job.jid()
    );
    assert_eq!(job.queue(), Some(want.queue), "{at}: queue");
    assert_eq!(job.retry(), want.retry, "{at}: retry");

    let map = job.to_map().unwrap();
    assert_eq!(
        serde_json::to_string(&map).unwrap(),
        raw,
        "{at}: to_map re-serializes byte for byte"
    );

    if job.is_activejob() {
        let args: Vec<Value> = serde_json::from_str(job.args_json()).unwrap();
        assert_eq!(args.len(), 1, "{at}: ActiveJob passes one hash");
        let aj = args[0].as_object().unwrap();
        if let Some(args) = want.args {
            let arguments = serde_json::to_string(&aj["arguments"]).unwrap();
            assert_eq!(arguments, args, "{at}: ActiveJob arguments");
        }
        assert_eq!(aj["job_class"], want.worker_class, "{at}: job_class");
        assert_eq!(aj["queue_name"], want.queue, "{at}: queue_name");
        let job_id = aj["job_id"].as_str().unwrap();
        let parts: Vec<&str> = job_id.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12],
            "{at}: job_id {job_id} is a UUID"
        );
        assert!(
            parts.iter().all(|p| is_lower_hex(p, p.len())),
            "{at}: job_id {job_id}"
        );
        // A continuation's interrupt counts as an execution (fixtures/activejob-7-8/README.md).
        let continued = aj.get("resumptions").is_some() && aj["provider_job_id"].is_string();
        if !continued {
            assert_eq!(aj["executions"], 0, "{at}: executions");
        }
        // Whole seconds through ActiveJob 7.0, nanoseconds from 7.1.
        let enqueued_at = aj["enqueued_at"].as_str().unwrap();
        assert!(
            (enqueued_at.len() == 20 || enqueued_at.len() == 30)
                && enqueued_at.ends_with('Z')
                && enqueued_at.starts_with("20"),
            "{at}: ActiveJob enqueued_at {enqueued_at} is ISO 8601 UTC"
        );
    } else {
        assert_eq!(Some(job.args_json()), want.args, "{at}: args");
    }

    let created = timestamp(&map, "created_at", path);
    if want.enqueued {
        let enqueued = timestamp(&map, "enqueued_at", path);
        assert!(enqueued >= created, "{at}: enqueued_at after created_at");
    } else {
        assert!(
            !map.contains_key("enqueued_at"),
            "{at}: a scheduled job has no enqueued_at yet"
        );
    }

    match want.failure {
        Some((class, message, count)) => {
            assert_eq!(map["error_class"], class, "{at}: error_class");
            assert_eq!(map["error_message"], message, "{at}: error_message");
            assert_eq!(map["retry_count"], count, "{at}: retry_count");
            assert!(
                timestamp(&map, "failed_at", path) >= created,
                "{at}: failed_at"
            );
        }
        None => assert!(
            !map.contains_key("error_class"),
            "{at}: no failure recorded"
        ),
    }

    if raw.contains("12345678901234567890") {
        let text = serde_json::to_string(&map["args"]).unwrap();
        assert!(
            text.contains("12345678901234567890"),
            "{at}: big number kept exactly"
        );
    }
}

fn check_score(path: &Path, of: ScoreOf) {
    let at = path.display();
    let text = content(path);
    let score: f64 = text
        .parse()
        .unwrap_or_else(|e| panic!("{at}: {text:?}: {e}"));
    assert!(PLAUSIBLE.contains(&score), "{at}: score {score}");
    let member = path.with_extension("json");
    let map = Job::from_str(&content(&member))
        .unwrap_or_else(|e| panic!("{}: {e}", member.display()))
        .to_map()
        .unwrap();
    match of {
        ScoreOf::InOneHour => {
            let delta = score - timestamp(&map, "created_at", &member);
            assert!(
                (3599.0..=3601.0).contains(&delta),
                "{at}: {delta} s after created_at"
            );
        }
        ScoreOf::FirstRetry => {
            let delta = score - timestamp(&map, "failed_at", &member);
            assert!(
                (15.0..=25.0).contains(&delta),
                "{at}: {delta} s after failed_at"
            );
        }
        ScoreOf::Later | ScoreOf::ResumeWait => {
            // ActiveJob 7.0 has no `scheduled_at` in `job_data`.
            let aj = &map["args"][0];
            if aj.get("scheduled_at").is_some() {
                let scheduled = iso_seconds(&aj["scheduled_at"], &member);
                assert!(
                    (score - scheduled).abs() < 1e-5,
                    "{at}: score {score} is the job's scheduled_at {scheduled}"
                );
            }
            let delta = score - timestamp(&map, "created_at", &member);
            let want = if matches!(of, ScoreOf::Later) {
                0.0..=f64::MAX
            } else {
                4.9..=5.1
            };
            assert!(want.contains(&delta), "{at}: {delta} s after created_at");
        }
    }
}

/// An ActiveJob ISO 8601 time (`enqueued_at`, `scheduled_at`) as epoch seconds.
fn iso_seconds(v: &Value, at: &Path) -> f64 {
    let text = v
        .as_str()
        .unwrap_or_else(|| panic!("{}: {v} is not a time", at.display()));
    let t = chrono::DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("{}: {text}: {e}", at.display()));
    t.timestamp() as f64 + f64::from(t.timestamp_subsec_nanos()) / 1e9
}

/// `hostname:pid:nonce`.
fn check_identity(identity: &str, at: &str) {
    let parts: Vec<&str> = identity.rsplitn(3, ':').collect();
    assert_eq!(parts.len(), 3, "{at}: identity {identity:?}");
    assert!(
        is_lower_hex(parts[0], 12),
        "{at}: identity nonce {identity:?}"
    );
    assert!(
        parts[1].parse::<u32>().is_ok(),
        "{at}: identity pid {identity:?}"
    );
    assert!(!parts[2].is_empty(), "{at}: identity hostname {identity:?}");
}

fn check_heartbeat_info(info: &Value, identity: &str, at: &str) {
    assert_eq!(info["identity"], identity, "{at}: info.identity");
    assert_eq!(info["tag"], "myapp", "{at}: info.tag");
    assert_eq!(info["concurrency"], 3, "{at}: info.concurrency");
    assert_eq!(
        info["queues"],
        serde_json::json!(["critical", "default"]),
        "{at}: info.queues"
    );
    assert!(info["pid"].is_u64(), "{at}: info.pid");
    assert!(info["hostname"].is_string(), "{at}: info.hostname");
    let started = timestamp_seconds(&info["started_at"]).unwrap();
    assert!(PLAUSIBLE.contains(&started), "{at}: info.started_at");
}

/// A `<identity>:work(ers)` entry: `{queue, payload, run_at}`, the payload a JSON string of the job.
fn check_work_entry(entry: &Value, at: &str) {
    assert_eq!(entry["queue"], "default", "{at}: entry queue");
    let payload = entry["payload"]
        .as_str()
        .unwrap_or_else(|| panic!("{at}: payload is a string"));
    let job = Job::from_str(payload).unwrap();
    assert_eq!(job.class(), "SlowWorker", "{at}: busy job class");
    assert!(
        PLAUSIBLE.contains(&timestamp_seconds(&entry["run_at"]).unwrap()),
        "{at}: run_at"
    );
}

fn check_server_file(path: &Path, kind: ServerFile) {
    let at = path.display().to_string();
    let text = content(path);
    let identity = content(&path.with_file_name("identity.txt"));
    match kind {
        ServerFile::Identity => check_identity(&text, &at),
        ServerFile::HeartbeatInfo => {
            let info: Value = serde_json::from_str(&text).unwrap();
            check_heartbeat_info(&info, &identity, &at);
        }
        ServerFile::HeartbeatHashJson => {
            let hash: Map<String, Value> = serde_json::from_str(&text).unwrap();
            let fields: BTreeSet<&str> = hash.keys().map(String::as_str).collect();
            for field in ["info", "beat", "busy", "quiet", "rss", "rtt_us"] {
                assert!(fields.contains(field), "{at}: heartbeat field {field}");
                assert!(
                    hash[field].is_string(),
                    "{at}: Redis hash values are strings"
                );
            }
            let info = hash["info"].as_str().unwrap();
            assert_eq!(
                info,
                content(&path.with_file_name("heartbeat_info.json")),
                "{at}"
            );
            assert_eq!(hash["busy"], "1", "{at}: one job was running");
            assert_eq!(hash["quiet"], "false", "{at}: quiet");
            let beat: f64 = hash["beat"].as_str().unwrap().parse().unwrap();
            assert!(PLAUSIBLE.contains(&beat), "{at}: beat");
        }
        ServerFile::HeartbeatHashText => {
            for field in ["info", "beat", "busy", "quiet", "rss", "rtt_us"] {
                assert!(
                    text.contains(&format!("\"{field}\"")),
                    "{at}: heartbeat field {field}"
                );
            }
        }
        ServerFile::WorkersHashJson => {
            let hash: Map<String, Value> = serde_json::from_str(&text).unwrap();
            assert_eq!(hash.len(), 1, "{at}: one busy thread");
            let (tid, entry) = hash.iter().next().unwrap();
            assert!(!tid.is_empty(), "{at}: thread id");
            let entry: Value = serde_json::from_str(entry.as_str().unwrap()).unwrap();
            check_work_entry(&entry, &at);
        }
        ServerFile::WorkersEntry => {
            let entry: Value = serde_json::from_str(&text).unwrap();
            check_work_entry(&entry, &at);
        }
        ServerFile::WorkHashText => {
            assert!(
                text.contains("SlowWorker") && text.contains("payload"),
                "{at}"
            );
        }
        ServerFile::StatKeys => {
            for key in ["stat:processed", "stat:failed"] {
                assert!(text.contains(key), "{at}: {key}");
            }
        }
    }
}

/// Checks every file of every folder under `root`; returns folder name → file names seen.
/// `ruby.json` names exactly the folder's job files (what each holds is checked in-crate, where the
/// decoder's typed values are: `src/payload/activejob/tests_versions.rs`).
fn check_ruby_facts(path: &Path) {
    let facts: Value = serde_json::from_str(&read(path)).unwrap();
    let named: BTreeSet<String> = facts["files"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let jobs: BTreeSet<String> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|f| f.ends_with(".json") && f != "ruby.json")
        .collect();
    assert_eq!(
        named,
        jobs,
        "{}: a fact set for every job file",
        path.display()
    );
    assert!(
        facts["recorded_by"]
            .as_str()
            .unwrap()
            .starts_with("ActiveJob "),
        "{}: recorded_by",
        path.display()
    );
}

fn check_root(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut dirs = Vec::new();
    folders(root, &mut dirs);
    let mut seen: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for dir in dirs {
        let folder = dir.file_name().unwrap().to_str().unwrap().to_string();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(
            !files.is_empty(),
            "{}: an empty fixture folder",
            dir.display()
        );
        for path in files {
            let file = path.file_name().unwrap().to_str().unwrap().to_string();
            match expectation(&folder, &file) {
                Some(Expect::Job(want)) => check_job(&path, &want),
                Some(Expect::Score(of)) => check_score(&path, of),
                Some(Expect::Server(kind)) => check_server_file(&path, kind),
                Some(Expect::RubyFacts) => check_ruby_facts(&path),
                None => panic!(
                    "{}: a fixture without an expectation: add it to `expectation` in tests/offline/fixtures.rs",
                    path.display()
                ),
            }
            seen.entry(dir.strip_prefix(root).unwrap().display().to_string())
                .or_default()
                .insert(file);
        }
    }
    seen
}

#[test]
fn every_recorded_payload_parses_as_ruby_wrote_it_and_round_trips_byte_for_byte() {
    let seen = check_root(&manifest_dir().join("fixtures"));
    // This repository's own recordings and the copy of the shared set are all there.
    for folder in [
        "sidekiq-6.4.1",
        "sidekiq-6.4.1-server",
        "activejob-6.1",
        "activejob-7.0",
        "activejob-7.1",
        "activejob-7.2",
        "activejob-8.0",
        "activejob-8.1",
        "shared/sidekiq-6.4.1",
        "shared/sidekiq-7.3.9",
        "shared/sidekiq-7.3.9-server",
        "shared/sidekiq-8.1.7",
    ] {
        assert!(
            seen.contains_key(folder),
            "fixtures/{folder} is missing: {seen:?}"
        );
    }
    // Every client version recorded the same calls.
    let client_sets: Vec<_> = seen
        .iter()
        .filter(|(f, _)| {
            folder_kind(Path::new(f).file_name().unwrap().to_str().unwrap())
                == Some(Folder::SidekiqClient)
        })
        .collect();
    assert_eq!(client_sets.len(), 4);
    for (folder, files) in &client_sets {
        assert_eq!(
            files, &client_sets[0].1,
            "{folder} records the same calls as {}",
            client_sets[0].0
        );
    }
}

#[test]
fn the_shared_fixture_set_parses_and_the_repository_copy_matches_it() {
    let copy = manifest_dir().join("fixtures").join("shared");
    // The repository's copy is what every other test reads: it must hold the whole shared set
    // (three client versions and a server recording), and parse as Ruby wrote it.
    let copied = check_root(&copy);
    for folder in [
        "sidekiq-6.4.1",
        "sidekiq-7.3.9",
        "sidekiq-7.3.9-server",
        "sidekiq-8.1.7",
    ] {
        assert!(
            copied.get(folder).is_some_and(|files| !files.is_empty()),
            "fixtures/shared/{folder} is missing or empty: {copied:?}"
        );
    }
    // Beside the repository (the project's machines), the original set: the copy must match it file
    // for file. A standalone checkout has no original; the copy was checked above.
    let shared = shared_root();
    if !shared.is_dir() {
        eprintln!(
            "{} is absent (a standalone checkout): checked the repository's copy only",
            shared.display()
        );
        return;
    }
    let seen = check_root(&shared);
    assert!(seen.len() >= 4, "{seen:?}");
    for (folder, files) in &seen {
        for file in files {
            let original = read(&shared.join(folder).join(file));
            let copied = std::fs::read_to_string(copy.join(folder).join(file))
                .unwrap_or_else(|e| panic!("fixtures/shared/{folder}/{file}: {e}: copy it over"));
            assert_eq!(
                original, copied,
                "fixtures/shared/{folder}/{file} differs from the shared set"
            );
        }
    }
}

#[test]
fn an_unknown_fixture_file_has_no_expectation() {
    assert!(expectation("sidekiq-6.4.1", "new_shape.json").is_none());
    assert!(expectation("elsewhere", "enqueued_plain.json").is_none());
    assert!(expectation("sidekiq-8.1.7", "enqueued_plain.json").is_some());
}
