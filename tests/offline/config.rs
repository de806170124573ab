//! Configuration from `sidekiq.yml` and the command line, as a Rails app's Sidekiq 6.4 reads them.
//!
//! No Redis here: configuration touches none. The environment is a map handed to the loader, since
//! the crate forbids the `unsafe` that `std::env::set_var` needs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use oxidekiq::cli::{self, config_from, parse_args};
use oxidekiq::config::{
    Config, FetchMode, QueueWeight, UnknownClass, normalize_weights, render_erb,
};

fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

/// The queues as the fetch weighs them: Sidekiq 6.4's expansion (`parse_queue`: a queue listed
/// `max(weight, 1)` times once any weight is above 0), which is what the tests below compare with.
/// The config itself keeps each weight as given (0 for none), as Sidekiq 7+ shows it.
fn queues(c: &Config) -> Vec<(&str, u32)> {
    weighed(&c.queues)
}

fn weighed(list: &[QueueWeight]) -> Vec<(&str, u32)> {
    let mut normalized = list.to_vec();
    normalize_weights(&mut normalized);
    list.iter()
        .zip(normalized)
        .map(|(q, n)| (q.name.as_str(), n.weight))
        .collect()
}

fn yaml(text: &str, environment: &str, vars: &[(&str, &str)]) -> Result<Config, oxidekiq::Error> {
    let mut c = Config::default();
    c.apply_yaml_with_env(text, Some(environment), &env_of(vars))?;
    Ok(c)
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "oxidekiq-config-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(dir.join("config")).unwrap();
        TempDir(dir)
    }

    fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.0.join(rel);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn args(list: &[&str]) -> Vec<String> {
    std::iter::once("oxidekiq")
        .chain(list.iter().copied())
        .map(String::from)
        .collect()
}

fn load_in(dir: &Path, list: &[&str], vars: &[(&str, &str)]) -> Result<Config, oxidekiq::Error> {
    let cli = parse_args(args(list)).unwrap();
    config_from(&cli, &env_of(vars), dir)
}

#[test]
fn defaults_are_sidekiq_64s() {
    let dir = TempDir::new();
    let c = load_in(dir.path(), &[], &[]).unwrap();
    assert_eq!(c.concurrency, 10);
    assert_eq!(c.timeout, Duration::from_secs(25));
    assert_eq!(queues(&c), vec![("default", 0)]);
    assert!(c.strict_queues());
    assert_eq!(c.fetch, FetchMode::RELIABLE);
    assert_eq!(c.unknown_class, UnknownClass::Retry);
    assert_eq!(c.millisecond_timestamps, None);
}

#[test]
fn colon_keys_and_plain_keys_mean_the_same() {
    let colon = yaml(
        ":concurrency: 5\n:timeout: 8\n:tag: app\n:queues:\n  - rust\n",
        "x",
        &[],
    )
    .unwrap();
    let plain = yaml(
        "concurrency: 5\ntimeout: 8\ntag: app\nqueues:\n  - rust\n",
        "x",
        &[],
    )
    .unwrap();
    for c in [&colon, &plain] {
        assert_eq!(c.concurrency, 5);
        assert_eq!(c.timeout, Duration::from_secs(8));
        assert_eq!(c.tag.as_deref(), Some("app"));
        assert_eq!(queues(c), vec![("rust", 0)]);
    }
}

#[test]
fn queue_pairs_carry_weights_and_a_bare_queue_then_weighs_one() {
    let c = yaml(
        ":queues:\n  - [critical, 2]\n  - default\n  - [low, 1]\n",
        "x",
        &[],
    )
    .unwrap();
    assert_eq!(
        queues(&c),
        vec![("critical", 2), ("default", 1), ("low", 1)]
    );
    assert!(!c.strict_queues());

    let flow = yaml("queues: [[critical, 2], default]", "x", &[]).unwrap();
    assert_eq!(queues(&flow), vec![("critical", 2), ("default", 1)]);
}

#[test]
fn a_queue_written_as_a_mapping_item_gets_a_clear_error() {
    let e = yaml("queues:\n  - critical: 2\n", "x", &[]).unwrap_err();
    assert!(e.to_string().contains("[critical, 2]"), "{e}");
}

#[test]
fn a_bad_weight_in_the_file_is_an_error() {
    let e = yaml("queues:\n  - [critical, high]\n", "x", &[]).unwrap_err();
    assert!(e.to_string().contains("weight"), "{e}");
}

#[test]
fn the_environment_section_overrides_the_top_level() {
    let text = "\
:concurrency: 5
:queues:
  - default
production:
  :concurrency: 25
  :queues:
    - [critical, 3]
    - default
development:
  :concurrency: 2
";
    let prod = yaml(text, "production", &[]).unwrap();
    assert_eq!(prod.concurrency, 25);
    assert_eq!(queues(&prod), vec![("critical", 3), ("default", 1)]);

    let dev = yaml(text, "development", &[]).unwrap();
    assert_eq!(dev.concurrency, 2);
    assert_eq!(queues(&dev), vec![("default", 0)]);

    let other = yaml(text, "staging", &[]).unwrap();
    assert_eq!(other.concurrency, 5);
}

#[test]
fn the_section_is_picked_by_rails_env_when_no_flag_is_given() {
    let dir = TempDir::new();
    dir.write(
        "config/sidekiq.yml",
        "concurrency: 5\nproduction:\n  concurrency: 30\n",
    );
    let c = load_in(dir.path(), &[], &[("RAILS_ENV", "production")]).unwrap();
    assert_eq!(c.concurrency, 30);
    let c = load_in(
        dir.path(),
        &["-e", "development"],
        &[("RAILS_ENV", "production")],
    )
    .unwrap();
    assert_eq!(c.concurrency, 5);
}

#[test]
fn erb_env_lookups_are_evaluated_before_yaml() {
    let text = r#"
:concurrency: <%= ENV.fetch("OXT_CONC_A", 5) %>
:timeout: <%= ENV["OXT_TIMEOUT_A"].to_i %>
:tag: <%= ENV['OXT_TAG_A'] %>
:queues:
  - [<%= ENV["OXT_QUEUE_A"] || "fallback" %>, <%= ENV.fetch("OXT_WEIGHT_A") { 4 } %>]
  - default
"#;
    let c = yaml(
        text,
        "x",
        &[("OXT_TIMEOUT_A", "12"), ("OXT_TAG_A", "billing")],
    )
    .unwrap();
    assert_eq!(c.concurrency, 5);
    assert_eq!(c.timeout, Duration::from_secs(12));
    assert_eq!(c.tag.as_deref(), Some("billing"));
    assert_eq!(queues(&c), vec![("fallback", 4), ("default", 1)]);

    let c = yaml(
        text,
        "x",
        &[
            ("OXT_CONC_A", "7"),
            ("OXT_TIMEOUT_A", "3"),
            ("OXT_TAG_A", "t"),
            ("OXT_QUEUE_A", "rust"),
            ("OXT_WEIGHT_A", "2"),
        ],
    )
    .unwrap();
    assert_eq!(c.concurrency, 7);
    assert_eq!(queues(&c), vec![("rust", 2), ("default", 1)]);
}

#[test]
fn an_unset_variable_without_default_names_the_variable_and_line() {
    // `ENV.fetch` without a default raises in Ruby: an error naming it.
    let e = yaml(
        ":concurrency: 5\n:tag: <%= ENV.fetch(\"OXT_UNSET_B\") %>\n",
        "x",
        &[],
    )
    .unwrap_err();
    let m = e.to_string();
    assert!(m.contains("OXT_UNSET_B") && m.contains("line 2"), "{m}");
    // `ENV["X"]` is nil in Ruby, which ERB prints as nothing (issue 27 item 11).
    let c = yaml(
        ":concurrency: 5\n:tag: \"t<%= ENV[\"OXT_UNSET_B\"] %>\"\n",
        "x",
        &[],
    )
    .unwrap();
    assert_eq!(c.tag.as_deref(), Some("t"));
}

#[test]
fn other_erb_is_an_error_naming_the_line() {
    let e = yaml(":concurrency: 5\n\n:tag: <%= Rails.env %>\n", "x", &[]).unwrap_err();
    assert!(e.to_string().contains("line 3"), "{e}");
    let e = yaml("<% if true %>\n:concurrency: 5\n<% end %>\n", "x", &[]).unwrap_err();
    assert!(e.to_string().contains("line 1"), "{e}");
}

#[test]
fn render_erb_is_public_and_leaves_plain_text_alone() {
    let out = render_erb("a: 1\nb: <%= ENV['OXT_R'] %>\n", &env_of(&[("OXT_R", "x")])).unwrap();
    assert_eq!(out, "a: 1\nb: x\n");
}

#[test]
fn unknown_keys_are_ignored() {
    let c = yaml(
        ":concurrency: 4\n:pidfile: tmp/sidekiq.pid\n:max_retries: 3\n:strict: false\n",
        "x",
        &[],
    )
    .unwrap();
    assert_eq!(c.concurrency, 4);
    assert!(c.strict_queues());
}

#[test]
fn labels_verbose_and_poll_interval_come_from_the_file() {
    let c = yaml(
        ":labels:\n  - rust\n  - eu\n:verbose: true\n:average_scheduled_poll_interval: 2.5\n",
        "x",
        &[],
    )
    .unwrap();
    assert_eq!(c.labels, vec!["rust", "eu"]);
    assert!(c.verbose);
    assert_eq!(c.poll_interval_average, Duration::from_millis(2500));
}

#[test]
fn zero_concurrency_in_the_file_is_an_error() {
    let e = yaml(":concurrency: 0\n", "x", &[]).unwrap_err();
    assert!(
        e.to_string()
            .contains("concurrency: 0 is not a valid value"),
        "{e}"
    );
}

#[test]
fn flags_override_the_file() {
    let dir = TempDir::new();
    let file = dir.write(
        "custom.yml",
        ":concurrency: 5\n:timeout: 9\n:tag: from-file\n:labels: [a]\n:queues:\n  - [critical, 2]\n  - default\n",
    );
    let c = load_in(dir.path(), &["-C", file.to_str().unwrap()], &[]).unwrap();
    assert_eq!(c.concurrency, 5);
    assert_eq!(c.tag.as_deref(), Some("from-file"));
    assert_eq!(queues(&c), vec![("critical", 2), ("default", 1)]);

    let c = load_in(
        dir.path(),
        &[
            "-C",
            "custom.yml",
            "-c",
            "2",
            "-t",
            "3",
            "-g",
            "flag",
            "--label",
            "b",
            "-q",
            "rust",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(c.concurrency, 2);
    assert_eq!(c.timeout, Duration::from_secs(3));
    assert_eq!(c.tag.as_deref(), Some("flag"));
    assert_eq!(c.labels, vec!["b"]);
    assert_eq!(queues(&c), vec![("rust", 0)]);
}

#[test]
fn config_sidekiq_yml_is_read_when_present() {
    let dir = TempDir::new();
    dir.write("config/sidekiq.yml", ":queues:\n  - rust\n");
    let c = load_in(dir.path(), &[], &[]).unwrap();
    assert_eq!(queues(&c), vec![("rust", 0)]);
}

#[test]
fn a_missing_config_file_given_with_dash_c_is_an_error() {
    let dir = TempDir::new();
    let e = load_in(dir.path(), &["-C", "nope.yml"], &[]).unwrap_err();
    assert!(e.to_string().contains("nope.yml"), "{e}");
}

#[test]
fn errors_in_a_file_name_the_file() {
    let dir = TempDir::new();
    let file = dir.write("bad.yml", ":concurrency: <%= Rails.env %>\n");
    let e = load_in(dir.path(), &["-C", file.to_str().unwrap()], &[]).unwrap_err();
    let m = e.to_string();
    assert!(m.contains("bad.yml") && m.contains("line 1"), "{m}");
}

#[test]
fn repeated_queue_flags_take_weights_and_a_bare_one_weighs_one() {
    let dir = TempDir::new();
    let c = load_in(dir.path(), &["-q", "a,2", "-q", "b"], &[]).unwrap();
    assert_eq!(queues(&c), vec![("a", 2), ("b", 1)]);
    assert!(!c.strict_queues());

    let c = load_in(dir.path(), &["-q", "a", "-q", "b"], &[]).unwrap();
    assert_eq!(queues(&c), vec![("a", 0), ("b", 0)]);
    assert!(c.strict_queues());
}

#[test]
fn the_same_queue_flag_twice_is_an_error() {
    let dir = TempDir::new();
    let e = load_in(dir.path(), &["-q", "a", "-q", "a,2"], &[]).unwrap_err();
    assert!(e.to_string().contains("cannot be defined twice"), "{e}");
}

#[test]
fn zero_or_too_much_concurrency_is_an_error_from_a_flag_the_file_or_the_environment() {
    for c in ["0", "10001", "100000000"] {
        let e = parse_args(args(&["-c", c])).unwrap_err().to_string();
        assert!(e.contains("--concurrency"), "{e}");
    }
    let dir = TempDir::new();
    let e = load_in(dir.path(), &[], &[("RAILS_MAX_THREADS", "10001")]).unwrap_err();
    assert!(e.to_string().contains("at most 10000"), "{e}");
    std::fs::write(dir.path().join("big.yml"), "concurrency: 10001\n").unwrap();
    let e = load_in(dir.path(), &["-C", "big.yml"], &[]).unwrap_err();
    assert!(e.to_string().contains("at most 10000"), "{e}");
    assert_eq!(
        load_in(dir.path(), &["-c", "10000"], &[])
            .unwrap()
            .concurrency,
        10000
    );
}

#[test]
fn the_redis_url_flag_wins_over_the_file() {
    let dir = TempDir::new();
    std::fs::write(
        dir.path().join("s.yml"),
        ":redis:\n  :url: redis://file:1/0\n",
    )
    .unwrap();
    let from_file = load_in(dir.path(), &["-C", "s.yml"], &[]).unwrap();
    // Unless REDIS_URL is set in this test process (clap reads it for `--redis-url`).
    if std::env::var_os("REDIS_URL").is_none() {
        assert_eq!(from_file.redis_url.as_deref(), Some("redis://file:1/0"));
    }
    let flagged = load_in(
        dir.path(),
        &["-C", "s.yml", "--redis-url", "redis://flag:2/0"],
        &[],
    )
    .unwrap();
    assert_eq!(flagged.redis_url.as_deref(), Some("redis://flag:2/0"));
}

#[test]
fn bad_queue_weights_and_empty_names_are_usage_errors() {
    for q in ["a,x", ",2", "a,-1"] {
        assert!(parse_args(args(&["-q", q])).is_err(), "{q}");
    }
}

#[test]
fn oxidekiq_flags_set_their_fields() {
    let dir = TempDir::new();
    let c = load_in(
        dir.path(),
        &[
            "--fetch",
            "basic",
            "--unknown-class",
            "dead",
            "--max-payload-bytes",
            "1024",
            "--beat-interval",
            "0.5",
            "--poll-interval",
            "0.25",
            "--timestamps",
            "milliseconds",
            "--redis-url",
            "redis://127.0.0.1:7777/2",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(c.fetch, FetchMode::BASIC);
    assert_eq!(c.unknown_class, UnknownClass::Dead);
    assert_eq!(c.max_payload_bytes, 1024);
    assert_eq!(c.beat_interval, Duration::from_millis(500));
    assert_eq!(c.poll_interval_average, Duration::from_millis(250));
    assert_eq!(c.millisecond_timestamps, Some(true));
    assert_eq!(c.redis_url(), "redis://127.0.0.1:7777/2");
}

#[test]
fn rails_max_threads_sets_concurrency_only_when_nothing_else_does() {
    let dir = TempDir::new();
    let c = load_in(dir.path(), &[], &[("RAILS_MAX_THREADS", "6")]).unwrap();
    assert_eq!(c.concurrency, 6);
    let c = load_in(dir.path(), &["-c", "3"], &[("RAILS_MAX_THREADS", "6")]).unwrap();
    assert_eq!(c.concurrency, 3);
    dir.write("config/sidekiq.yml", ":concurrency: 4\n");
    let c = load_in(dir.path(), &[], &[("RAILS_MAX_THREADS", "6")]).unwrap();
    assert_eq!(c.concurrency, 4);
}

#[test]
fn debug_of_config_never_shows_the_redis_password() {
    let c = Config {
        redis_url: Some("redis://user:hunter2-secret@redis.internal:6379/0".into()),
        ..Config::default()
    };
    let shown = format!("{c:?}");
    assert!(!shown.contains("hunter2-secret"), "{shown}");
    assert!(shown.contains("redis.internal"), "{shown}");
    let pretty = format!("{c:#?}");
    assert!(!pretty.contains("hunter2-secret"), "{pretty}");
}

#[test]
fn help_shows_examples_and_the_flags() {
    let help = cli::help();
    assert!(help.contains("Examples:"), "{help}");
    assert!(help.contains("oxidekiq -q critical,3"), "{help}");
    for flag in [
        "--queue",
        "--concurrency",
        "--timeout",
        "--config",
        "--redis-url",
        "--fetch",
    ] {
        assert!(help.contains(flag), "{flag} missing from help");
    }
    assert!(!help.contains("--beat-interval"), "hidden flag shown");
    let e = parse_args(args(&["--help"])).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp);
}

#[test]
fn version_names_the_crate_version() {
    assert_eq!(
        cli::version_string(),
        format!("oxidekiq {}", env!("CARGO_PKG_VERSION"))
    );
    let e = parse_args(args(&["--version"])).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::DisplayVersion);
}

/// The environment cannot be changed inside this process, so a child run of this test binary gets
/// `REDIS_URL` set and prints the help.
#[test]
fn help_never_prints_the_redis_url_from_the_environment() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // The test's path in this binary (`config::print_help_for_parent`).
            concat!(module_path!(), "::print_help_for_parent")
                .split_once("::")
                .unwrap()
                .1,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("REDIS_URL", "redis://:topsecret-pw@redis.internal:6379/0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("HELP-BEGIN"), "{stdout}");
    assert!(stdout.contains("REDIS_URL"), "{stdout}");
    assert!(!stdout.contains("topsecret-pw"), "{stdout}");
    assert!(stdout.contains("PARSED-REDACTED"), "{stdout}");
}

#[test]
#[ignore = "run as a child by help_never_prints_the_redis_url_from_the_environment"]
fn print_help_for_parent() {
    println!("HELP-BEGIN\n{}", cli::help());
    let cli = parse_args(args(&[])).unwrap();
    let c = config_from(&cli, &env_of(&[]), Path::new("/nonexistent-dir")).unwrap();
    let shown = format!("{cli:?} {c:?}");
    if shown.contains("REDACTED") {
        println!("PARSED-REDACTED");
    }
    println!("{shown}");
}

#[test]
fn queue_weight_is_the_shared_type() {
    let q = oxidekiq::config::parse_queue_arg("rust,3").unwrap();
    assert_eq!(
        q,
        QueueWeight {
            name: "rust".into(),
            weight: 3
        }
    );
}

/// The expected values are what Sidekiq 6.4.1's `CLI#parse_config` returns for this file (checked
/// with Ruby 3.1): `{concurrency: 3, timeout: 9, queues: ["a","a","a","b"], strict: false}` in
/// production and `{concurrency: 5, queues: ["critical","critical","default","sym"]}` in development.
#[test]
fn a_file_reads_as_sidekiq_641_reads_it() {
    let text = "\
base: &base
  concurrency: 3
:concurrency: 5
queues:
  - [critical, 2]
  - default
  - :sym
production:
  <<: *base
  :timeout: 9
  queues: [[a, 3], b]
";
    let prod = yaml(text, "production", &[]).unwrap();
    assert_eq!(prod.concurrency, 3);
    assert_eq!(prod.timeout, Duration::from_secs(9));
    assert_eq!(queues(&prod), vec![("a", 3), ("b", 1)]);

    let dev = yaml(text, "development", &[]).unwrap();
    assert_eq!(dev.concurrency, 5);
    assert_eq!(dev.timeout, Duration::from_secs(25));
    assert_eq!(
        queues(&dev),
        vec![("critical", 2), ("default", 1), ("sym", 1)]
    );
}

#[tokio::test]
async fn a_config_built_by_hand_gets_the_same_bounds_at_start() {
    // No Redis is needed: the launcher refuses the value before it connects (the URL points nowhere).
    let c = Config {
        redis_url: Some("redis://127.0.0.1:1/0".into()),
        queues: vec![QueueWeight {
            name: "default".into(),
            weight: u32::MAX,
        }],
        ..Config::default()
    };
    let e = oxidekiq::launcher::Launcher::new(c, oxidekiq::Registry::new())
        .start()
        .await
        .map(|_| ())
        .expect_err("refused")
        .to_string();
    assert!(e.contains("weight") && e.contains("too large"), "{e}");
}

#[test]
fn cron_runs_by_default_and_the_flags_turn_it_off_or_set_its_interval() {
    let dir = TempDir::new();
    let c = load_in(dir.path(), &[], &[]).unwrap();
    assert!(c.cron.enabled);
    assert_eq!(c.cron.poll_interval, Duration::from_secs(30));
    let c = load_in(dir.path(), &["--no-cron", "--cron-poll-interval", "5"], &[]).unwrap();
    assert!(!c.cron.enabled);
    assert_eq!(c.cron.poll_interval, Duration::from_secs(5));
    assert!(parse_args(args(&["--cron-poll-interval", "0"])).is_err());
}

#[tokio::test]
async fn a_config_built_by_hand_with_zero_or_too_many_job_threads_is_refused_at_start() {
    // The launcher builds the job runtime from `threads`: refused before it is built or Redis is asked.
    for threads in [0, oxidekiq::config::MAX_THREADS + 1] {
        let c = Config {
            redis_url: Some("redis://127.0.0.1:1/0".into()),
            threads: Some(threads),
            ..Config::default()
        };
        let e = oxidekiq::launcher::Launcher::new(c, oxidekiq::Registry::new())
            .start()
            .await
            .map(|_| ())
            .expect_err("refused")
            .to_string();
        assert!(
            e.contains("threads") && e.contains("not a valid value"),
            "{e}"
        );
    }
}

/// A capsule as (name, concurrency, queues with weights).
type CapsuleView<'a> = (&'a str, usize, Vec<(&'a str, u32)>);

fn capsules(c: &Config) -> Vec<CapsuleView<'_>> {
    c.capsules
        .iter()
        .map(|cap| (cap.name.as_str(), cap.concurrency, weighed(&cap.queues)))
        .collect()
}

#[test]
fn capsules_are_read_from_sidekiq_yml_as_sidekiq_7_reads_them() {
    let c = yaml(
        ":concurrency: 5\n:queues: [default]\n:capsules:\n  :single:\n    :concurrency: 1\n    :queues: [single]\n  heavy:\n    concurrency: 3\n    queues: [[a, 3], b, \"c,2\"]\n",
        "x",
        &[],
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(queues(&c), vec![("default", 0)]);
    assert_eq!(
        capsules(&c),
        vec![
            ("single", 1, vec![("single", 0)]),
            ("heavy", 3, vec![("a", 3), ("b", 1), ("c", 2)]),
        ]
    );
    let all: Vec<(String, usize)> = c
        .all_capsules()
        .into_iter()
        .map(|cap| (cap.name, cap.concurrency))
        .collect();
    assert_eq!(
        all,
        vec![
            ("default".into(), 5),
            ("single".into(), 1),
            ("heavy".into(), 3)
        ]
    );
    // The environment's section replaces the capsules whole, as it does `queues`.
    let c = yaml(
        "capsules: { a: { concurrency: 1, queues: [a] } }\nproduction:\n  capsules: { b: { concurrency: 2, queues: [b] } }\n",
        "production",
        &[],
    )
    .unwrap();
    assert_eq!(capsules(&c), vec![("b", 2, vec![("b", 0)])]);
}

#[test]
fn a_capsule_that_cannot_run_as_written_is_refused() {
    for (text, why) in [
        ("capsules: [a]\n", "mapping"),
        ("capsules: { a: { queues: [a] } }\n", "no `concurrency:`"),
        ("capsules: { a: { concurrency: 1 } }\n", "no `queues:`"),
        (
            "capsules: { a: { concurrency: -1, queues: [a] } }\n",
            "concurrency",
        ),
        (
            "capsules: { a: { concurrency: 1, queues: [a, a] } }\n",
            "twice",
        ),
        (
            "capsules: { default: { concurrency: 1, queues: [a] } }\n",
            "name the others",
        ),
        (
            "capsules: { \"a b\": { concurrency: 1, queues: [a] } }\n",
            "may hold only",
        ),
        (
            "capsules: { a: { concurrency: 6000, queues: [a] } }\nconcurrency: 5000\n",
            "over every capsule",
        ),
    ] {
        let e = yaml(text, "x", &[])
            .and_then(|c| c.validate())
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{text}: {e}");
    }
}

#[test]
fn the_capsule_flag_declares_capsules_and_replaces_the_files() {
    let dir = TempDir::new();
    dir.write(
        "config/sidekiq.yml",
        "capsules: { fromfile: { concurrency: 1, queues: [f] } }\n",
    );
    let c = load_in(dir.path(), &[], &[]).unwrap();
    assert_eq!(capsules(&c), vec![("fromfile", 1, vec![("f", 0)])]);
    let c = load_in(
        dir.path(),
        &[
            "--capsule",
            "single:1:single",
            "--capsule",
            "heavy:2:a,3 b",
            "--capsule",
            "heavy:2:c:@x",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        capsules(&c),
        vec![
            ("single", 1, vec![("single", 0)]),
            ("heavy", 2, vec![("a", 3), ("b", 1), ("c:@x", 1)]),
        ]
    );
    for (bad, why) in [
        (
            vec!["--capsule", "x:1:a", "--capsule", "x:2:b"],
            "concurrency 1 and 2",
        ),
        (vec!["--capsule", "x:1:a", "--capsule", "x:1:a"], "twice"),
        (vec!["--capsule", "default:1:a"], "name the others"),
    ] {
        let e = load_in(dir.path(), &bad, &[]).unwrap_err().to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
    for bad in ["x", "x:1", ":1:a", "x:y:a", "x:1:", "x:1:a,y", "x:20000:a"] {
        assert!(
            parse_args(args(&["--capsule", bad])).is_err(),
            "--capsule {bad} accepted"
        );
    }
}

#[test]
fn a_config_built_by_hand_gets_the_capsule_rules_at_start() {
    let bad = Config {
        capsules: vec![oxidekiq::config::Capsule {
            name: "empty".into(),
            concurrency: 1,
            queues: vec![],
        }],
        ..Config::default()
    };
    let e = bad.check_bounds().unwrap_err().to_string();
    assert!(e.contains("capsule empty: no queue"), "{e}");
}

#[test]
fn a_handoff_queue_a_capsule_serves_is_refused() {
    let c = yaml(
        "capsules: { a: { concurrency: 1, queues: [ruby] } }\n",
        "x",
        &[],
    )
    .unwrap();
    let c = Config {
        handoff: Some("ruby".into()),
        ..c
    };
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .contains("--handoff ruby")
    );
}
