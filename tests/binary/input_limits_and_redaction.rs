//! Hostile input at every edge (issue 17), driven from outside as a user would: the real `oxidekiq`
//! binary, real `redis-server`s (an ACL user, a Unix socket), real files.
//!
//! - The password is printed nowhere, in any form a Redis URL can take: every log line, error and
//!   `--help` output these tests produce is searched for it.
//! - What a flag or a config file can cost is bounded: too much concurrency, a huge queue weight, a
//!   huge timeout, a YAML alias bomb, a huge or deeply nested file all fail with a clear error.
//! - A payload cannot forge a log line: newlines and ANSI escapes in a class, a jid or an error
//!   message are escaped.
//! - Errors say what to fix: the server named, a TLS/plain mismatch pointed out, `:redis: :url:` in
//!   `sidekiq.yml` read, `REDIS_CA_FILE=` taken as unset, `--help` showing the defaults.
//!
//! No test asserts a duration: each waits for its outcome with a generous timeout.
use crate::support;

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use redis::Commands;
use support::{Oxidekiq, RedisServer, free_port, temp_dir};

/// The ACL user's password; no output of any test here may contain it.
const PASSWORD: &str = "h0stile-Pw-5e1b";

/// Generous: a loaded 2-core machine may be slow, and nothing here is timed.
const WAIT: Duration = Duration::from_secs(60);

/// `--user app on >PASSWORD ~* &* +@all --user default off`: every connection must log in as `app`.
fn acl_args() -> Vec<String> {
    support::acl_args(PASSWORD)
}

/// A `redis-server` with the ACL user of [`acl_args`], listening on TCP and on a Unix socket.
struct AclRedis {
    server: RedisServer,
    /// The Unix socket's path.
    socket: PathBuf,
    /// Holds the socket; removed on drop.
    _dir: TempDir,
}

impl AclRedis {
    fn start() -> AclRedis {
        let dir = TempDir(temp_dir("sock"));
        let socket = dir.0.join("redis.sock");
        let mut args = vec![
            "--unixsocket".to_string(),
            socket.to_str().unwrap().to_string(),
            "--unixsocketperm".to_string(),
            "700".to_string(),
        ];
        args.extend(acl_args());
        let server = RedisServer::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
        AclRedis {
            server,
            socket,
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        format!("redis://app:{PASSWORD}@127.0.0.1:{}/0", self.server.port)
    }
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the binary until it exits by itself (a start-up error, `--help`); returns its status and
/// output. `files` are written into its working directory first.
#[track_caller]
fn run_to_exit(
    redis_url: &str,
    args: &[&str],
    env: &[(&str, &str)],
    files: &[(&str, &[u8])],
) -> (ExitStatus, String) {
    let dir = temp_dir("hostile");
    for (name, content) in files {
        std::fs::write(dir.join(name), content).unwrap();
    }
    let mut ox = Oxidekiq::start_in(dir, redis_url, args, env);
    let status = ox
        .wait_exit(WAIT)
        .unwrap_or_else(|| panic!("oxidekiq {args:?} did not exit:\n{}", ox.log()));
    (status, ox.log())
}

/// Runs the binary until its start line, then TERM; returns the output. Panics if it never starts.
#[track_caller]
fn run_started(
    redis_url: &str,
    args: &[&str],
    env: &[(&str, &str)],
    files: &[(&str, &[u8])],
) -> String {
    let dir = temp_dir("hostile");
    for (name, content) in files {
        std::fs::write(dir.join(name), content).unwrap();
    }
    let mut ox = Oxidekiq::start_in(dir, redis_url, args, env);
    assert!(
        ox.wait_for_log("starting", WAIT),
        "oxidekiq {args:?} did not start:\n{}",
        ox.log()
    );
    ox.signal("TERM");
    assert!(ox.wait_exit(WAIT).is_some(), "no exit after TERM");
    ox.log()
}

#[test]
fn no_log_line_error_or_help_output_holds_the_password_in_any_url_form() {
    let acl = AclRedis::start();
    let plain = RedisServer::start();
    let sock = acl.socket.to_str().unwrap().to_string();
    let port = acl.server.port;
    // Every output of this test, with what it had to say for the run to count.
    let mut outputs: Vec<(String, String)> = Vec::new();
    let mut expect = |what: &str, log: String, needle: &str| {
        assert!(
            log.contains(needle),
            "{what}: the output does not say `{needle}`:\n{log}"
        );
        outputs.push((what.to_string(), log));
    };

    // Forms that connect: the start line shows the URL, redacted. `-v` logs at every level.
    for (url, shown) in [
        (acl.url(), "redis://app:REDACTED@127.0.0.1:".to_string()),
        (
            format!("redis+unix://{sock}?user=app&pass={PASSWORD}"),
            "?user=app&pass=REDACTED".to_string(),
        ),
        (
            format!("unix://{sock}?db=0&user=app&pass={PASSWORD}"),
            "&user=app&pass=REDACTED".to_string(),
        ),
        (
            format!("redis://127.0.0.1:{}/0?password={PASSWORD}", plain.port),
            "?password=REDACTED".to_string(),
        ),
        (
            format!("redis://{PASSWORD}@127.0.0.1:{}/0", plain.port),
            "redis://REDACTED@127.0.0.1:".to_string(),
        ),
    ] {
        let log = run_started(&url, &["-q", "default", "-v"], &[], &[]);
        expect(&url, log, &shown);
    }

    // Forms that fail: the error names the server or the URL, redacted.
    let (status, log) = run_to_exit(
        &format!("app:{PASSWORD}@127.0.0.1:{port}"),
        &["-q", "default"],
        &[],
        &[],
    );
    assert!(!status.success());
    expect("no scheme", log, "app:REDACTED@127.0.0.1");
    let (status, log) = run_to_exit(
        &format!("unix://{sock}?user=app&pass=wrong-{PASSWORD}"),
        &["-q", "default", "-v"],
        &[],
        &[],
    );
    assert!(!status.success());
    expect("unix, wrong password", log, "refused the password");
    let dead = free_port();
    let (status, log) = run_to_exit(
        "",
        &[
            "--redis-url",
            &format!("redis://app:{PASSWORD}@127.0.0.1:{dead}/0"),
            "-q",
            "default",
        ],
        &[],
        &[],
    );
    assert!(!status.success());
    expect("refused", log, &format!("127.0.0.1:{dead}"));
    let (status, log) = run_to_exit(
        &format!("rediss://app:{PASSWORD}@127.0.0.1:{port}/0"),
        &["-q", "default", "-v"],
        &[],
        &[],
    );
    assert!(!status.success());
    expect("rediss:// to a plain port", log, "is this a TLS port?");

    // Config values read from ENV through ERB are never echoed.
    let (status, log) = run_to_exit(
        &acl.url(),
        &["-C", "sidekiq.yml"],
        &[],
        &[("sidekiq.yml", b"concurrency: <%= ENV[\"REDIS_URL\"] %>\n")],
    );
    assert_eq!(status.code(), Some(2));
    expect("ERB concurrency", log, "concurrency:");
    let (status, log) = run_to_exit(
        &acl.url(),
        &["-C", "sidekiq.yml"],
        &[],
        &[(
            "sidekiq.yml",
            b"queues:\n  - [default, <%= ENV[\"REDIS_URL\"] %>]\n",
        )],
    );
    assert_eq!(status.code(), Some(2));
    expect("ERB weight", log, "weight");
    // And a URL in the file, from ERB, reaches the start line redacted.
    let log = run_started(
        "",
        &["-C", "sidekiq.yml", "-v"],
        &[("OXT_HOSTILE_URL", &acl.url())],
        &[(
            "sidekiq.yml",
            b":redis:\n  :url: <%= ENV[\"OXT_HOSTILE_URL\"] %>\n:queues: [default]\n",
        )],
    );
    expect("URL from sidekiq.yml", log, "app:REDACTED@127.0.0.1");

    // `--help`, with the URL in the environment.
    for url in [
        acl.url(),
        format!("redis+unix://{sock}?pass={PASSWORD}"),
        format!("app:{PASSWORD}@h:1"),
    ] {
        let (status, log) = run_to_exit(&url, &["--help"], &[], &[]);
        assert!(status.success());
        expect("--help", log, "--redis-url");
    }

    for (what, log) in &outputs {
        assert!(
            !log.contains(PASSWORD),
            "{what}: the password is in the output:\n{log}"
        );
    }
}

#[test]
fn flags_and_files_past_their_bounds_are_refused_and_the_bounds_themselves_run() {
    let redis = RedisServer::start();
    let url = redis.url();
    for (args, env, files, says) in [
        (
            &["-c", "100000000"][..],
            &[][..],
            &[][..],
            "must be at most 10000",
        ),
        (&["-q", "a,4294967295"], &[], &[], "must be at most 1000"),
        (&["-q", "a,1000001"], &[], &[], "must be at most 1000"),
        (&["-t", "1e15"], &[], &[], "at most 86400"),
        (
            &["-q", "a"],
            &[("RAILS_MAX_THREADS", "100000000")],
            &[],
            "at most 10000",
        ),
        (
            &["-C", "big.yml"],
            &[],
            &[("big.yml", &b"concurrency: 100000000\n"[..])],
            "at most 10000",
        ),
        (
            &["-C", "big.yml"],
            &[],
            &[("big.yml", &b"queues:\n  - [a, 4294967295]\n"[..])],
            "at most 1000",
        ),
        (
            &["-C", "big.yml"],
            &[],
            &[("big.yml", &b"timeout: 1e15\n"[..])],
            "at most 86400",
        ),
    ] {
        let (status, log) = run_to_exit(&url, args, env, files);
        assert_eq!(status.code(), Some(2), "{args:?} {env:?}:\n{log}");
        assert!(log.contains(says), "{args:?} {env:?}:\n{log}");
    }
    // The bounds are allowed.
    let log = run_started(
        &url,
        &["-c", "10000", "-q", "a,1000", "-q", "b", "-t", "86400"],
        &[],
        &[],
    );
    assert!(log.contains("concurrency=10000"), "{log}");
}

/// A YAML "billion laughs": 9 levels of 9 aliases, a few hundred bytes that expand to 9^9 strings.
fn alias_bomb() -> String {
    let mut text = String::from(
        "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];
    for pair in names.windows(2) {
        let refs = vec![format!("*{}", pair[0]); 9].join(",");
        text.push_str(&format!("{}: &{} [{refs}]\n", pair[1], pair[1]));
    }
    text
}

#[test]
fn an_alias_bomb_a_huge_file_and_deep_nesting_are_refused_with_a_clear_error() {
    let bomb = alias_bomb();
    assert!(bomb.len() < 1024, "{} bytes", bomb.len());
    let huge = format!("tag: app\n#{}\n", "x".repeat(2 << 20));
    let deep = format!("queues: {}{}\n", "[".repeat(200), "]".repeat(200));
    for (file, says) in [
        (bomb.as_str(), "aliases"),
        (huge.as_str(), "at most 1048576 bytes"),
        (deep.as_str(), "levels deep"),
    ] {
        let (status, log) = run_to_exit(
            "redis://127.0.0.1:1",
            &["-C", "sidekiq.yml"],
            &[],
            &[("sidekiq.yml", file.as_bytes())],
        );
        assert_eq!(status.code(), Some(2), "{log}");
        assert!(
            log.contains("configuration:") && log.contains(says),
            "{log}"
        );
    }
}

#[test]
fn newlines_and_escapes_in_a_payload_cannot_forge_a_log_line() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let fake = "2001-01-01T00:00:00.000Z pid=1 tid=x";
    let jobs = [
        // An unknown class: its failure is logged with the class.
        serde_json::json!({"class": format!("NoSuchJob\n{fake} class=Fake INFO: forged-by-class"),
            "args": [], "jid": "00000000000000000000000a", "queue": "default", "retry": true,
            "created_at": 1.7e9, "enqueued_at": 1.7e9}),
        // A job failing with a message built from its argument.
        serde_json::json!({"class": "HardWorker",
            "args": [format!("\u{1b}[31mred\u{1b}[0m\r\n{fake} INFO: forged-by-message"), -1],
            "jid": "00000000000000000000000b", "queue": "default", "retry": true,
            "created_at": 1.7e9, "enqueued_at": 1.7e9}),
        // A jid with a line in it.
        serde_json::json!({"class": "HardWorker", "args": ["ok", 1],
            "jid": format!("c\n{fake} INFO: forged-by-jid\u{2028}\u{202e}"), "queue": "default",
            "retry": true, "created_at": 1.7e9, "enqueued_at": 1.7e9}),
    ];
    for job in &jobs {
        let _: () = c.lpush("queue:default", job.to_string()).unwrap();
    }
    let mut ox = Oxidekiq::start(&redis.url(), &["-q", "default"]);
    assert!(
        support::wait_until(WAIT, || c.zcard::<_, usize>("retry").unwrap() == 2
            && ox.log().contains("forged-by-jid")
            && ox.log().contains(" done")),
        "the jobs did not reach their fate"
    );
    ox.signal("TERM");
    assert!(ox.wait_exit(WAIT).is_some());
    let log = ox.log();
    for line in log.lines() {
        assert!(!line.starts_with(fake), "a forged line: {line}\n{log}");
    }
    assert!(!log.contains('\u{1b}'), "a raw ESC:\n{log}");
    assert!(!log.contains('\r'), "a raw CR:\n{log}");
    assert!(
        !log.contains('\u{2028}') && !log.contains('\u{202e}'),
        "{log}"
    );
    for forged in ["forged-by-class", "forged-by-message", "forged-by-jid"] {
        let line = log
            .lines()
            .find(|l| l.contains(forged))
            .unwrap_or_else(|| panic!("{forged} is not logged at all:\n{log}"));
        assert!(line.contains(&format!("\\n{fake}")), "{line}");
    }
    assert!(log.contains("\\u{1b}[31mred"), "{log}");
}

#[test]
fn the_redis_url_is_read_from_sidekiq_yml_and_redis_url_wins_over_it() {
    let redis = RedisServer::start();
    let dead = format!("redis://127.0.0.1:{}/0", free_port());
    let live = redis.url();
    for file in [
        format!(":redis:\n  :url: {live}\n:queues: [default]\n"),
        format!("redis:\n  url: {live}\n  network_timeout: 5\nqueues: [default]\n"),
        format!("redis_url: {live}\nqueues: [default]\n"),
        format!("production:\n  redis_url: {live}\n"),
    ] {
        // REDIS_URL empty: unset.
        let log = run_started(
            "",
            &["-C", "sidekiq.yml", "-e", "production"],
            &[],
            &[("sidekiq.yml", file.as_bytes())],
        );
        assert!(log.contains(&format!("redis={live}")), "{file}\n{log}");
    }
    // REDIS_URL, then the flag, win over the file.
    let file = format!("redis_url: {dead}\n");
    let log = run_started(
        &live,
        &["-C", "sidekiq.yml"],
        &[],
        &[("sidekiq.yml", file.as_bytes())],
    );
    assert!(log.contains(&format!("redis={live}")), "{log}");
    let log = run_started(
        &dead,
        &["-C", "sidekiq.yml", "--redis-url", &live],
        &[],
        &[("sidekiq.yml", file.as_bytes())],
    );
    assert!(log.contains(&format!("redis={live}")), "{log}");
    // Not a string: an error naming the key, not the value.
    let (status, log) = run_to_exit(
        "",
        &["-C", "sidekiq.yml"],
        &[],
        &[("sidekiq.yml", b"redis:\n  url: [x]\n")],
    );
    assert_eq!(status.code(), Some(2));
    assert!(log.contains("redis: url: must be a Redis URL"), "{log}");
}

#[test]
fn connection_errors_name_the_server_and_point_at_a_tls_mismatch() {
    let redis = RedisServer::start();
    let dead = free_port();
    let (status, log) = run_to_exit(
        &format!("redis://127.0.0.1:{dead}/0"),
        &["-q", "default"],
        &[],
        &[],
    );
    assert!(!status.success());
    assert!(
        log.contains(&format!("redis://127.0.0.1:{dead}")) && log.contains("refused"),
        "{log}"
    );
    // TLS to a plain-text port.
    let (status, log) = run_to_exit(
        &format!("rediss://127.0.0.1:{}/0", redis.port),
        &["-q", "default"],
        &[],
        &[],
    );
    assert!(!status.success());
    assert!(
        log.contains("is this a TLS port?")
            && log.contains(&format!("rediss://127.0.0.1:{}", redis.port)),
        "{log}"
    );
}

#[test]
fn help_shows_the_defaults_and_an_empty_redis_ca_file_means_unset() {
    let (status, help) = run_to_exit("", &["--help"], &[], &[]);
    assert!(status.success());
    let line_of = |flag: &str| {
        let at = help.find(flag).unwrap_or_else(|| panic!("{flag}:\n{help}"));
        help[at..].split("\n\n").next().unwrap_or("").to_string()
    };
    assert!(line_of("--concurrency").contains("[default: 10"), "{help}");
    assert!(line_of("--timeout").contains("[default: 25]"), "{help}");

    let redis = RedisServer::start();
    let log = run_started(
        &redis.url(),
        &["-q", "default"],
        &[("REDIS_CA_FILE", "")],
        &[],
    );
    assert!(log.contains("starting"), "{log}");
}
