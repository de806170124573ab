//! Running real Ruby Sidekiq 6.4 (and Rails ActiveJob 6.1) code from a test, against the test's Redis.
//!
//! The script is fed to `ruby -` on stdin after a preamble that loads Sidekiq and points its client at
//! `REDIS_URL`, so a test writes only what a Rails app would: `Sidekiq::Client.push(...)`,
//! `SomeJob.perform_later(...)`, `Sidekiq::RetrySet.new.size`, and prints what it wants to check.

use std::io::Write;
use std::process::{Command, Stdio};

/// What a Ruby script printed.
#[derive(Debug, Clone)]
pub struct RubyOutput {
    /// Everything the script wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr (Ruby warnings land here).
    pub stderr: String,
}

impl RubyOutput {
    /// Stdout without surrounding whitespace: handy for a script that `puts` one value.
    pub fn trimmed(&self) -> &str {
        self.stdout.trim()
    }

    /// Stdout split into lines.
    pub fn lines(&self) -> Vec<&str> {
        self.stdout.lines().collect()
    }
}

/// Loads Sidekiq's client, pointed at `REDIS_URL`, quiet below errors.
///
/// Sidekiq 6.4.1 with redis-rb 4.8 prints a deprecation line for every push (`Redis#sadd will always
/// return an Integer`); `Redis.silence_deprecations` turns that off.
const SIDEKIQ_PREAMBLE: &str = r#"
$stdout.sync = true
require "json"
require "sidekiq"
Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)
Sidekiq.configure_client { |c| c.redis = { url: ENV.fetch("REDIS_URL") } }
Sidekiq.logger.level = Logger::ERROR
"#;

/// Loads ActiveJob 6.1 on top of [`SIDEKIQ_PREAMBLE`] with Rails' Sidekiq adapter, as a Rails app with
/// `config.active_job.queue_adapter = :sidekiq` and the default `UTC` time zone.
const ACTIVEJOB_PREAMBLE: &str = r#"
require "active_job"
require "globalid"
require "active_support/core_ext/numeric/time"
require "active_support/core_ext/time"
ActiveJob::Base.queue_adapter = :sidekiq
ActiveJob::Base.logger = Logger.new(nil)
GlobalID.app = "oxidekiq-test"
Time.zone = "UTC"
"#;

/// Wraps the script in a Rack app with the session middleware Sidekiq 6.x's CSRF protection needs
/// (Sidekiq ≥ 6.0 ships no session of its own) and prints the status line, then the body.
const WEB_UI_SCRIPT: &str = r#"
require "sidekiq/web"
app = Rack::Builder.new do
  use Rack::Session::Cookie, secret: "oxidekiq-test-" + "0" * 64, same_site: true
  run Sidekiq::Web
end
response = Rack::MockRequest.new(app).get(ENV.fetch("WEB_UI_PATH"))
puts response.status
print response.body
"#;

/// Runs `script` with Sidekiq 6.4's client loaded and connected to `redis_url`; returns what it
/// printed. Panics, showing stdout and stderr, if Ruby exits non-zero (a Ruby exception included).
#[track_caller]
pub fn ruby(script: &str, redis_url: &str) -> RubyOutput {
    run(&[SIDEKIQ_PREAMBLE, script], redis_url, &[])
}

/// As [`ruby`], with more environment variables for the script (`ENV.fetch("X")`).
#[track_caller]
pub fn ruby_with_env(script: &str, redis_url: &str, env: &[(&str, &str)]) -> RubyOutput {
    run(&[SIDEKIQ_PREAMBLE, script], redis_url, env)
}

/// As [`ruby`], with Rails ActiveJob 6.1 loaded too and its queue adapter set to `:sidekiq`.
/// The script defines its own job classes (`class WelcomeJob < ActiveJob::Base ... end`).
#[track_caller]
pub fn ruby_activejob(script: &str, redis_url: &str) -> RubyOutput {
    run(
        &[SIDEKIQ_PREAMBLE, ACTIVEJOB_PREAMBLE, script],
        redis_url,
        &[],
    )
}

/// Renders one page of the Sidekiq 6.4 Web UI in-process (`Rack::MockRequest`, no server) against
/// `redis_url`; returns the HTTP status and the body. `path` is as mounted at the root: `/`, `/busy`,
/// `/queues`, `/queues/default`, `/retries`, `/scheduled`, `/morgue` (6.x names the dead set
/// `morgue`; `/dead` is a 404 there).
#[track_caller]
pub fn web_ui_get(redis_url: &str, path: &str) -> (u16, String) {
    web_ui_get_with(redis_url, path, "")
}

/// As [`web_ui_get`], with `extension` (Ruby, such as `require "sidekiq/cron/web"`) run before the
/// app is built, for a gem that adds a tab.
#[track_caller]
pub fn web_ui_get_with(redis_url: &str, path: &str, extension: &str) -> (u16, String) {
    let out = run(
        &[SIDEKIQ_PREAMBLE, extension, WEB_UI_SCRIPT],
        redis_url,
        &[("WEB_UI_PATH", path)],
    );
    let (status, body) = out
        .stdout
        .split_once('\n')
        .unwrap_or_else(|| panic!("no status line from the web UI script:\n{}", out.stdout));
    let status = status
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("bad status line from the web UI script: {status:?}"));
    (status, body.to_string())
}

#[track_caller]
fn run(parts: &[&str], redis_url: &str, env: &[(&str, &str)]) -> RubyOutput {
    let mut child = Command::new("ruby")
        .arg("-")
        .env("REDIS_URL", redis_url)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ruby must be installed (scripts/test.sh installs it)");
    {
        let mut stdin = child.stdin.take().unwrap();
        for part in parts {
            stdin.write_all(part.as_bytes()).unwrap();
            stdin.write_all(b"\n").unwrap();
        }
    }
    let output = child.wait_with_output().unwrap();
    let out = RubyOutput {
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    };
    if !output.status.success() {
        panic!(
            "ruby failed ({}):\n--- script ---\n{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            output.status,
            parts.last().unwrap_or(&""),
            out.stdout,
            out.stderr
        );
    }
    out
}

/// As [`ruby`] with Sidekiq's API (`sidekiq/api`) loaded, from async test code: the runtime's other
/// tasks (a launcher under test) keep running meanwhile (`block_in_place`: a multi-thread runtime).
/// Returns what the script printed.
#[track_caller]
pub fn ruby_api(script: &str, redis_url: &str) -> String {
    let script = format!("require \"sidekiq/api\"\n{script}");
    tokio::task::block_in_place(|| ruby(&script, redis_url).stdout)
}

/// As [`ruby_api`] for a script whose last line of output is JSON; returns it parsed.
#[track_caller]
pub fn ruby_api_json(script: &str, redis_url: &str) -> serde_json::Value {
    let out = ruby_api(script, redis_url);
    let last = out.lines().last().unwrap_or("");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The gem's poller (`Sidekiq::Cron::Poller#enqueue`, the body of its loop) run from a plain Ruby
/// process, as a Ruby Sidekiq server with the gem would run it (no job is processed). It polls just
/// after each whole second, when a tick becomes claimable, so it races oxidekiq for every tick rather
/// than arriving after it.
pub const CRON_RUBY_POLLER: &str = r#"
$stdout.sync = true
require "sidekiq"
Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)
Sidekiq.configure_client { |c| c.redis = { url: ENV.fetch("REDIS_URL") } }
Sidekiq.configure_server { |c| c.redis = { url: ENV.fetch("REDIS_URL") } }
require "sidekiq/cron/job"
require "sidekiq/cron/poller"
Sidekiq.logger.level = Logger::WARN
poller = Sidekiq::Cron::Poller.new(cron_poll_interval: 1)
puts "ruby cron poller up"
loop do
  sleep(1.005 - (Time.now.to_f % 1))
  poller.enqueue
end
"#;
