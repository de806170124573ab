//! Child processes a test drives from outside: the `oxidekiq` binary and a real Ruby `sidekiq` server.
//!
//! Both are a [`LoggedProcess`]: stdout and stderr go to one log file in a temp directory of their
//! own, signals are sent by name with the `kill` command (no libc needed), and the process is
//! SIGKILLed on drop. If the test is panicking when the process drops, its log is printed, so a
//! failed assertion shows what the process said.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{temp_dir, wait_until};

/// A child process whose output is captured in a log file; SIGKILLed on drop.
pub struct LoggedProcess {
    /// The process itself.
    child: Child,
    /// What to call it in messages (`oxidekiq`, `sidekiq`, ...).
    name: String,
    /// Its own temp directory (log file, files it was given), removed on drop.
    dir: PathBuf,
    /// stdout and stderr, interleaved.
    log_path: PathBuf,
    /// Set once the exit status has been collected.
    exited: Option<ExitStatus>,
}

impl LoggedProcess {
    /// Spawns `program args...` with `env` added to this process's environment, in a fresh temp
    /// directory of its own (its working directory, see [`LoggedProcess::dir`]).
    #[track_caller]
    pub fn spawn(name: &str, program: &Path, args: &[&str], env: &[(&str, &str)]) -> LoggedProcess {
        Self::spawn_in(temp_dir(name), name, program, args, env)
    }

    /// As [`LoggedProcess::spawn`], in a directory the caller made (with [`super::temp_dir`]) and
    /// may have put files in first; the directory is removed when the process drops.
    #[track_caller]
    pub fn spawn_in(
        dir: PathBuf,
        name: &str,
        program: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> LoggedProcess {
        let log_path = dir.join(format!("{name}.log"));
        let log = File::create(&log_path).unwrap();
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().copied())
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {name} ({}): {e}", program.display()));
        LoggedProcess {
            child,
            name: name.to_string(),
            dir,
            log_path,
            exited: None,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process's own temp directory (its working directory).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Sends a signal by name (`TERM`, `INT`, `TSTP`, `USR1`, `TTIN`, `KILL`, ...) with `kill -s`.
    /// Panics if `kill` fails (for instance because the process is gone and reaped).
    #[track_caller]
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args(["-s", name, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(
            status.success(),
            "kill -s {name} {} ({}) failed",
            self.pid(),
            self.name
        );
    }

    /// Waits up to `timeout` for the process to exit; `None` if it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The exit status if the process has exited, without waiting.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().unwrap();
        }
        self.exited
    }

    /// Everything the process has written to stdout and stderr so far.
    pub fn log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log_path).unwrap_or_default()).into_owned()
    }

    /// Waits up to `timeout` for `needle` to appear in the log; true if it did.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        wait_until(timeout, || self.log().contains(needle))
    }

    /// SIGKILLs the process (a hard crash) and reaps it; returns its exit status.
    pub fn kill_9(&mut self) -> ExitStatus {
        if let Some(status) = self.try_exit() {
            return status;
        }
        let _ = self.child.kill();
        let status = self.child.wait().unwrap();
        self.exited = Some(status);
        status
    }
}

impl Drop for LoggedProcess {
    fn drop(&mut self) {
        let _ = self.kill_9();
        if std::thread::panicking() {
            eprintln!(
                "--- log of {} (pid {}) ---\n{}--- end of log ---",
                self.name,
                self.pid(),
                self.log()
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `oxidekiq` binary (the `workers` crate's), run as a child process.
///
/// It must have been built first: `scripts/test.sh` runs `cargo build --workspace` before
/// `cargo test`, because `cargo test` alone does not build another package's binary.
pub struct Oxidekiq(LoggedProcess);

impl Oxidekiq {
    /// Where the binary is: `$OXIDEKIQ_BIN` if set, else `oxidekiq` in the directory the running
    /// test executable was built into (`target/debug/`, since test executables live in
    /// `target/debug/deps/`), else `$CARGO_TARGET_DIR/debug` or `<workspace>/target/debug`.
    /// Does not check that it exists.
    pub fn binary() -> PathBuf {
        if let Some(bin) = std::env::var_os("OXIDEKIQ_BIN") {
            return PathBuf::from(bin);
        }
        let beside_test = std::env::current_exe().ok().and_then(|exe| {
            let profile_dir = exe.parent()?.parent()?.to_path_buf();
            let bin = profile_dir.join("oxidekiq");
            bin.exists().then_some(bin)
        });
        if let Some(bin) = beside_test {
            return bin;
        }
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let target = match std::env::var_os("CARGO_TARGET_DIR") {
            Some(dir) => manifest.join(dir),
            None => manifest.join("target"),
        };
        target.join("debug").join("oxidekiq")
    }

    /// Starts `oxidekiq args...` with `REDIS_URL=redis_url`. Panics, saying to build it, if the
    /// binary is missing.
    #[track_caller]
    pub fn start(redis_url: &str, args: &[&str]) -> Oxidekiq {
        Self::start_with_env(redis_url, args, &[])
    }

    /// As [`Oxidekiq::start`], with more environment variables (`RUST_LOG`, ...).
    #[track_caller]
    pub fn start_with_env(redis_url: &str, args: &[&str], env: &[(&str, &str)]) -> Oxidekiq {
        Self::start_in(temp_dir("oxidekiq"), redis_url, args, env)
    }

    /// As [`Oxidekiq::start_with_env`], in a directory the caller made with [`super::temp_dir`]
    /// and may have put files in (a config file); it is the working directory, removed on drop.
    #[track_caller]
    pub fn start_in(
        dir: PathBuf,
        redis_url: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Oxidekiq {
        let bin = Self::binary();
        assert!(
            bin.is_file(),
            "the oxidekiq binary is missing at {}: run `cargo build --workspace` first \
             (scripts/test.sh does), or set OXIDEKIQ_BIN",
            bin.display()
        );
        let mut all_env = vec![("REDIS_URL", redis_url)];
        all_env.extend_from_slice(env);
        Oxidekiq(LoggedProcess::spawn_in(
            dir, "oxidekiq", &bin, args, &all_env,
        ))
    }
}

impl std::ops::Deref for Oxidekiq {
    type Target = LoggedProcess;
    fn deref(&self) -> &LoggedProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Oxidekiq {
    fn deref_mut(&mut self) -> &mut LoggedProcess {
        &mut self.0
    }
}

/// A real Ruby Sidekiq 6.4 server (Debian's `/usr/bin/sidekiq`), loading job classes from Ruby
/// source the test supplies.
pub struct RubySidekiq(LoggedProcess);

impl RubySidekiq {
    /// Starts `sidekiq -r <jobs.rb> -c <concurrency> -q <queue>... -t 5` against `redis_url`.
    /// `jobs_rb` is Ruby source defining the job classes (Sidekiq is already loaded when it runs);
    /// a queue may carry a weight (`"critical,2"`). The 5-second shutdown timeout keeps tests short
    /// (Sidekiq's default is 25); use [`RubySidekiq::start_with_args`] for other options.
    #[track_caller]
    pub fn start(redis_url: &str, jobs_rb: &str, queues: &[&str], concurrency: u32) -> RubySidekiq {
        let concurrency = concurrency.to_string();
        let mut args = vec!["-c", concurrency.as_str(), "-t", "5"];
        for q in queues {
            args.extend(["-q", q]);
        }
        Self::start_with_args(redis_url, jobs_rb, &args)
    }

    /// Starts `sidekiq -r <jobs.rb> args...` against `redis_url`, args given as on the command line.
    #[track_caller]
    pub fn start_with_args(redis_url: &str, jobs_rb: &str, args: &[&str]) -> RubySidekiq {
        let dir = temp_dir("sidekiq");
        let jobs_path = dir.join("jobs.rb");
        // Sidekiq 6.4.1 with redis-rb 4.8 warns on every SADD; the test log is easier to read without.
        let source = format!(
            "Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)\n{jobs_rb}\n"
        );
        std::fs::write(&jobs_path, source).unwrap();
        let jobs_path = jobs_path.to_str().unwrap().to_string();
        let mut full_args = vec!["-r", jobs_path.as_str()];
        full_args.extend_from_slice(args);
        RubySidekiq(LoggedProcess::spawn_in(
            dir,
            "sidekiq",
            Path::new("sidekiq"),
            &full_args,
            &[("REDIS_URL", redis_url)],
        ))
    }

    /// Waits up to `timeout` for this process's heartbeat: its identity (`hostname:pid:nonce`) in
    /// the `processes` set. Returns the identity, or `None` on timeout.
    pub fn wait_for_identity(
        &self,
        conn: &mut redis::Connection,
        timeout: Duration,
    ) -> Option<String> {
        let needle = format!(":{}:", self.pid());
        let mut found = None;
        wait_until(timeout, || {
            let members: Vec<String> = redis::cmd("SMEMBERS")
                .arg("processes")
                .query(conn)
                .unwrap_or_default();
            found = members.into_iter().find(|m| m.contains(&needle));
            found.is_some()
        });
        found
    }
}

impl std::ops::Deref for RubySidekiq {
    type Target = LoggedProcess;
    fn deref(&self) -> &LoggedProcess {
        &self.0
    }
}

impl std::ops::DerefMut for RubySidekiq {
    fn deref_mut(&mut self) -> &mut LoggedProcess {
        &mut self.0
    }
}
