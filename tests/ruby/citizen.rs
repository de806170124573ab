//! Being a Sidekiq citizen, proven against real Redis and real Ruby Sidekiq 6.4: the heartbeat puts the
//! process on the Web UI's Busy page and in `Sidekiq::ProcessSet`/`Workers`/`Stats`, the UI's Quiet and
//! Stop (`Sidekiq::Process#quiet!`/`#stop!`) and the OS signals work, and TERM at any moment loses no job:
//! every unfinished payload goes back to its queue byte for byte.
use crate::support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use oxidekiq::config::{Config, QueueWeight};
use oxidekiq::error::JobResult;
use oxidekiq::launcher::Launcher;
use oxidekiq::{JobContext, JobError, Registry, Worker};
use redis::Commands;
use support::{Oxidekiq, RedisServer, RubyOutput, RubySidekiq, wait_until, web_ui_get};

/// Runs `script` with Sidekiq 6.4's client and its API (`Sidekiq::ProcessSet`, `Workers`, `Stats`).
#[track_caller]
fn ruby(script: &str, redis_url: &str) -> RubyOutput {
    support::ruby(&format!("require \"sidekiq/api\"\n{script}"), redis_url)
}

/// Presses a button of the Sidekiq 6.4 Web UI's Busy page: GETs `/busy` for the session cookie and CSRF
/// token, then POSTs the form (`identity` plus `quiet=1` or `stop=1`) as a browser would. Returns the
/// POST's status.
#[track_caller]
fn web_ui_press(redis_url: &str, identity: &str, button: &str) -> u16 {
    let out = support::ruby(
        &format!(
            r#"
require "sidekiq/web"
app = Rack::Builder.new do
  use Rack::Session::Cookie, secret: "oxidekiq-test-" + "0" * 64, same_site: true
  run Sidekiq::Web
end
req = Rack::MockRequest.new(app)
page = req.get("/busy")
cookie = page["Set-Cookie"].split(";").first
token = page.body[/name='authenticity_token' value='([^']+)'/, 1] or raise "no CSRF token"
res = req.post("/busy", "HTTP_COOKIE" => cookie,
  params: {{ "authenticity_token" => token, "identity" => "{identity}", "{button}" => "1" }})
puts res.status
"#
        ),
        redis_url,
    );
    out.trimmed().parse().unwrap()
}

/// A `HardWorker` payload as Sidekiq 6.4's client writes it, plus a few bytes a re-encoder would change
/// (a big integer, an exponent float, non-ASCII text, escaped slash) so byte-identity is a real check.
fn hard_worker(jid: &str, queue: &str, name: &str, count: i64) -> String {
    format!(
        r#"{{"retry":true,"queue":"{queue}","class":"HardWorker","args":["{name}",{count}],"jid":"{jid}","created_at":1795291260.8776562,"enqueued_at":1795291260.877818,"big":123456789012345678901234567890,"x":1.0e+20,"note":"caf\u00e9 ☕ a\/b"}}"#
    )
}

/// A fresh 24-hex-digit jid.
fn jid() -> String {
    let mut b = [0u8; 12];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Starts the binary with a half-second beat, on `queues`, with `extra` flags.
#[track_caller]
fn start(redis: &RedisServer, queues: &[&str], extra: &[&str]) -> Oxidekiq {
    let mut args = vec!["--beat-interval", "0.5", "--poll-interval", "0.2"];
    for q in queues {
        args.extend(["-q", q]);
    }
    args.extend_from_slice(extra);
    Oxidekiq::start(&redis.url(), &args)
}

/// The identity of the process with OS pid `pid` in `processes`, waiting up to 10 s for it.
#[track_caller]
fn identity_of(conn: &mut redis::Connection, pid: u32) -> String {
    support::identity_of(conn, pid, Duration::from_secs(10))
}

/// One field of the identity hash.
fn field(conn: &mut redis::Connection, identity: &str, name: &str) -> Option<String> {
    conn.hget(identity, name).unwrap()
}

/// Waits until the identity hash says `busy` = `n`.
#[track_caller]
fn wait_busy(conn: &mut redis::Connection, identity: &str, n: usize) {
    let want = n.to_string();
    assert!(
        wait_until(Duration::from_secs(10), || field(conn, identity, "busy")
            .as_deref()
            == Some(want.as_str())),
        "busy never became {n}"
    );
}

/// Every key of this process's reliable-fetch working lists that still holds something.
fn nonempty_working_lists(conn: &mut redis::Connection) -> Vec<String> {
    let keys: Vec<String> = conn.keys("oxidekiq:batch:*").unwrap();
    keys.into_iter()
        .filter(|k| !support::held_in(conn, k).is_empty())
        .collect()
}

fn queue_bytes(conn: &mut redis::Connection, queue: &str) -> Vec<Vec<u8>> {
    conn.lrange(format!("queue:{queue}"), 0, -1).unwrap()
}

#[test]
fn the_busy_page_shows_our_process_with_its_queues_threads_label_and_running_job() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let long = jid();
    let _: () = c
        .lpush(
            "queue:rust",
            hard_worker(&long, "rust", "busy-page", 30_000),
        )
        .unwrap();
    let mut ox = start(
        &redis,
        &["rust", "critical"],
        &["-c", "7", "-g", "billing", "-t", "1"],
    );
    let id = identity_of(&mut c, ox.pid());
    wait_busy(&mut c, &id, 1);
    let host = id.split(':').next().unwrap().to_string();

    let (status, body) = web_ui_get(&redis.url(), "/busy");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(&format!("{host}:{}", ox.pid())),
        "hostname:pid on the page"
    );
    assert!(
        body.contains(&format!(r#"value="{id}""#)),
        "identity in the Quiet/Stop form"
    );
    assert!(body.contains("rust, critical"), "queues in order");
    assert!(body.contains(r#"<span class="label label-success">billing</span>"#));
    assert!(body.contains(r#"<span class="label label-info">oxidekiq</span>"#));
    assert!(body.contains("<td>7</td>"), "threads = -c");
    assert!(body.contains("<td>1</td>"), "busy = 1");
    assert!(!body.contains("label-danger\">quiet"), "not quiet");
    assert!(body.contains(&long), "the running job's jid");
    assert!(body.contains("HardWorker"), "the running job's class");
    assert!(body.contains("busy-page"), "the running job's args");
    assert!(body.contains("/queues/rust"), "the running job's queue");

    let (status, dash) = web_ui_get(&redis.url(), "/");
    assert_eq!(status, 200, "{dash}");
    assert!(dash.contains("Processed"), "{dash}");

    ox.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(10)).unwrap().success());
    // The job shown as running was not lost by the stop, nor finished, nor failed: it is back in its
    // queue exactly once, and nowhere else.
    let done = done_jids(&ox.log());
    assert!(!done.contains(&long), "a 30 s job cannot have finished");
    let queued: Vec<String> = c.lrange("queue:rust", 0, -1).unwrap();
    assert_eq!(queued.len(), 1, "{queued:?}");
    assert!(queued[0].contains(&long), "{queued:?}");
    assert!(nonempty_working_lists(&mut c).is_empty());
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
    assert_eq!(c.zcard::<_, usize>("dead").unwrap(), 0);
}

/// The jids the binary logged as done (`... jid=<jid> ... INFO: done`), each as often as logged.
fn done_jids(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.ends_with("INFO: done"))
        .filter_map(|l| {
            l.split(' ')
                .find_map(|f| f.strip_prefix("jid="))
                .map(str::to_string)
        })
        .collect()
}

/// Accounts for every jid after a stop: each is either done (exactly once) or back in the queue
/// (exactly once, byte for byte), never neither. Both (it ran, and was pushed back) is allowed for at
/// most `max_both` jobs: a job cancelled at the deadline after its side effect (docs/guarantees.md,
/// "When a job can run twice"), which can only be one that was in flight, so at most the concurrency.
#[track_caller]
fn account_for_every_job(
    what: &str,
    payloads: &[(String, String)],
    done: &[String],
    queued: &[String],
    max_both: usize,
) {
    let mut done_set = HashSet::new();
    for j in done {
        assert!(done_set.insert(j.as_str()), "{what}: {j} ran twice");
    }
    let by_payload: std::collections::HashMap<&str, &str> = payloads
        .iter()
        .map(|(jid, raw)| (raw.as_str(), jid.as_str()))
        .collect();
    let mut queued_set = HashSet::new();
    for raw in queued {
        let jid = by_payload
            .get(raw.as_str())
            .unwrap_or_else(|| panic!("{what}: a pushed-back payload changed: {raw}"));
        assert!(
            queued_set.insert(*jid),
            "{what}: {jid} is in the queue twice"
        );
    }
    let both: Vec<&&str> = queued_set.intersection(&done_set).collect();
    assert!(
        both.len() <= max_both,
        "{what}: {} jobs both ran and were pushed back (at most {max_both} may), e.g. {:?}",
        both.len(),
        both.first()
    );
    let lost: Vec<&str> = payloads
        .iter()
        .map(|(j, _)| j.as_str())
        .filter(|j| !done_set.contains(j) && !queued_set.contains(j))
        .collect();
    assert!(
        lost.is_empty(),
        "{what}: {} lost, e.g. {:?}; done {}, queued {}",
        lost.len(),
        lost.first(),
        done.len(),
        queued.len()
    );
}

#[test]
fn ruby_process_set_workers_and_stats_report_what_we_run() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    // Five quick successes and one failure (negative count raises ArgumentError).
    for i in 0..5 {
        let _: () = c
            .lpush(
                "queue:rust",
                hard_worker(&jid(), "rust", &format!("q{i}"), 1),
            )
            .unwrap();
    }
    let _: () = c
        .lpush("queue:rust", hard_worker(&jid(), "rust", "bad", -1))
        .unwrap();
    let mut ox = start(
        &redis,
        &["rust", "low"],
        &["-c", "4", "--label", "eu", "-t", "1"],
    );
    let id = identity_of(&mut c, ox.pid());
    assert!(
        wait_until(Duration::from_secs(10), || c
            .zcard::<_, usize>("retry")
            .unwrap()
            == 1
            && c.llen::<_, usize>("queue:rust").unwrap() == 0),
        "the six jobs ran"
    );
    let long = jid();
    let _: () = c
        .lpush("queue:rust", hard_worker(&long, "rust", "long", 30_000))
        .unwrap();
    wait_busy(&mut c, &id, 1);
    // The stats of the first six are flushed by the beats since.
    assert!(wait_until(Duration::from_secs(5), || c
        .get::<_, Option<i64>>("stat:processed")
        .unwrap()
        == Some(6)));

    let out = ruby(
        &format!(
            r#"
            ps = Sidekiq::ProcessSet.new
            p = ps.find {{ |x| x.identity == "{id}" }}
            raise "our process is not in the ProcessSet" unless p
            puts p["concurrency"]
            puts p["queues"].join(",")
            puts p["busy"]
            puts p.labels.join(",")
            puts p.stopping?
            puts p["pid"]
            puts p["rss"] > 0 && p["rtt_us"].to_i > 0 && (Time.now.to_f - p["beat"]) < 2
            puts ps.size
            works = Sidekiq::Workers.new.to_a
            puts works.size
            pid, tid, work = works.first
            puts pid
            puts work["queue"]
            puts work["payload"]["class"]
            puts work["payload"]["jid"]
            puts work["payload"]["args"].to_json
            puts work["run_at"].is_a?(Integer)
            s = Sidekiq::Stats.new
            puts s.processed
            puts s.failed
            puts s.workers_size
            puts s.processes_size
            "#
        ),
        &redis.url(),
    );
    // The identity hash and both work hashes (6.4 reads `:workers`, 6.5+ `:work`) live 60 s.
    for key in [id.clone(), format!("{id}:work"), format!("{id}:workers")] {
        let ttl: i64 = c.ttl(&key).unwrap();
        assert!(ttl > 55 && ttl <= 60, "{key} ttl {ttl}");
    }
    let work: Vec<String> = c.hvals(format!("{id}:work")).unwrap();
    let legacy: Vec<String> = c.hvals(format!("{id}:workers")).unwrap();
    assert_eq!(work, legacy);
    let lines = out.lines();
    assert_eq!(
        lines,
        vec![
            "4",
            "rust,low",
            "1",
            "oxidekiq,eu",
            "false",
            &ox.pid().to_string(),
            "true",
            "1",
            "1",
            id.as_str(),
            "rust",
            "HardWorker",
            long.as_str(),
            r#"["long",30000]"#,
            "true",
            "6",
            "1",
            "1",
            "1",
        ],
        "{}",
        out.stderr
    );
    ox.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(10)).unwrap().success());
}

#[test]
fn ruby_quiet_bang_quiets_within_one_beat_and_nothing_new_is_fetched() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut ox = start(&redis, &["rust"], &["-c", "3"]);
    let id = identity_of(&mut c, ox.pid());
    // A job running when Quiet arrives finishes.
    let running = jid();
    let _: () = c
        .lpush(
            "queue:rust",
            hard_worker(&running, "rust", "finishing", 1500),
        )
        .unwrap();
    wait_busy(&mut c, &id, 1);
    ruby(
        &format!(r#"Sidekiq::ProcessSet.new.find {{ |x| x.identity == "{id}" }}.quiet!"#),
        &redis.url(),
    );
    let asked = Instant::now();
    assert!(
        wait_until(Duration::from_secs(3), || field(&mut c, &id, "quiet")
            .as_deref()
            == Some("true")),
        "quiet never became true"
    );
    assert!(
        asked.elapsed() < Duration::from_millis(1500),
        "took {:?} with a 0.5 s beat",
        asked.elapsed()
    );
    let later = hard_worker(&jid(), "rust", "after-quiet", 1);
    let _: () = c.lpush("queue:rust", &later).unwrap();
    wait_busy(&mut c, &id, 0);
    // Three beats of the quiet process later (not a time window a loaded machine may shrink), the
    // job it must NOT fetch is still queued.
    assert!(
        support::wait_beats(&mut c, &id, 3, Duration::from_secs(30)),
        "a quiet process keeps beating"
    );
    assert_eq!(
        queue_bytes(&mut c, "rust"),
        vec![later.into_bytes()],
        "a quiet process fetches nothing"
    );
    assert!(ox.try_exit().is_none(), "quiet does not stop the process");
    assert!(
        ox.log().contains(&format!("jid={running}")) && ox.log().contains("done"),
        "the running job finished"
    );
    let out = ruby(
        &format!(r#"puts Sidekiq::ProcessSet.new.find {{ |x| x.identity == "{id}" }}.stopping?"#),
        &redis.url(),
    );
    assert_eq!(out.trimmed(), "true");
    let (_, body) = web_ui_get(&redis.url(), "/busy");
    assert!(body.contains(r#"<span class="label label-danger">quiet</span>"#));
    ox.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(10)).is_some());
}

#[test]
fn the_web_ui_quiet_and_stop_buttons_quiet_then_stop_the_process() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut ox = start(&redis, &["rust"], &["-t", "1"]);
    let id = identity_of(&mut c, ox.pid());
    assert_eq!(web_ui_press(&redis.url(), &id, "quiet"), 302);
    assert!(
        wait_until(Duration::from_secs(3), || field(&mut c, &id, "quiet")
            .as_deref()
            == Some("true")),
        "the Quiet button did not quiet the process"
    );
    let (_, body) = web_ui_get(&redis.url(), "/busy");
    assert!(body.contains(r#"<span class="label label-danger">quiet</span>"#));
    assert!(ox.try_exit().is_none());
    assert_eq!(web_ui_press(&redis.url(), &id, "stop"), 302);
    let status = ox
        .wait_exit(Duration::from_secs(5))
        .expect("the Stop button stops the process");
    assert!(status.success(), "{status:?}");
    let members: Vec<String> = c.smembers("processes").unwrap();
    assert!(!members.contains(&id));
}

#[test]
fn ruby_stop_bang_stops_the_process_and_it_leaves_processes() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut ox = start(&redis, &["rust"], &["-t", "2"]);
    let id = identity_of(&mut c, ox.pid());
    let long = hard_worker(&jid(), "rust", "stopped", 30_000);
    let _: () = c.lpush("queue:rust", &long).unwrap();
    wait_busy(&mut c, &id, 1);
    ruby(
        &format!(r#"Sidekiq::ProcessSet.new.find {{ |x| x.identity == "{id}" }}.stop!"#),
        &redis.url(),
    );
    let status = ox
        .wait_exit(Duration::from_secs(10))
        .expect("the process stops");
    assert!(status.success(), "{status:?}");
    let members: Vec<String> = c.smembers("processes").unwrap();
    assert!(!members.contains(&id), "{members:?}");
    assert_eq!(queue_bytes(&mut c, "rust"), vec![long.into_bytes()]);
    let out = ruby("puts Sidekiq::ProcessSet.new.size", &redis.url());
    assert_eq!(out.trimmed(), "0");
}

#[test]
fn term_pushes_a_long_running_job_back_byte_identical_and_exits_zero_after_the_timeout() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut ox = start(&redis, &["rust"], &["-t", "2", "-c", "5"]);
    let id = identity_of(&mut c, ox.pid());
    let long = hard_worker(&jid(), "rust", "thirty-seconds", 30_000);
    let _: () = c.lpush("queue:rust", &long).unwrap();
    wait_busy(&mut c, &id, 1);
    assert!(
        c.exists::<_, bool>(format!("{id}:workers")).unwrap(),
        "the 6.4 work hash exists while the job runs"
    );
    ox.signal("TERM");
    let sent = Instant::now();
    let status = ox
        .wait_exit(Duration::from_secs(10))
        .expect("exits after TERM");
    let took = sent.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_millis(4500),
        "took {took:?} with -t 2"
    );
    assert_eq!(
        queue_bytes(&mut c, "rust"),
        vec![long.into_bytes()],
        "back in its queue, byte for byte, once"
    );
    let members: Vec<String> = c.smembers("processes").unwrap();
    assert!(!members.contains(&id));
    assert!(nonempty_working_lists(&mut c).is_empty());
    assert!(!c.exists::<_, bool>(format!("{id}:work")).unwrap());
    assert!(!c.exists::<_, bool>(format!("{id}:workers")).unwrap());
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0, "not a failure");
    assert_eq!(c.zcard::<_, usize>("dead").unwrap(), 0);
}

#[test]
fn a_second_term_does_not_skip_the_push_back() {
    for second in ["TERM", "INT"] {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut ox = start(&redis, &["rust"], &["-t", "20"]);
        let id = identity_of(&mut c, ox.pid());
        let long = hard_worker(&jid(), "rust", "twice", 30_000);
        let _: () = c.lpush("queue:rust", &long).unwrap();
        wait_busy(&mut c, &id, 1);
        ox.signal("TERM");
        // Two TERMs sent before the first is handled are one pending signal to the kernel: wait until
        // the first has been taken.
        assert!(ox.wait_for_log("shutting down", Duration::from_secs(5)));
        ox.signal(second);
        let sent = Instant::now();
        let status = ox
            .wait_exit(Duration::from_secs(10))
            .expect("the second signal cuts the wait short");
        assert!(status.success(), "{second}: {status:?}");
        assert!(sent.elapsed() < Duration::from_secs(5), "{second}");
        assert_eq!(
            queue_bytes(&mut c, "rust"),
            vec![long.into_bytes()],
            "TERM then {second}"
        );
        assert!(nonempty_working_lists(&mut c).is_empty());
        assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0, "{second}");
    }
}

#[test]
fn tstp_quiets_the_process_and_it_keeps_beating() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut ox = start(&redis, &["rust"], &[]);
    let id = identity_of(&mut c, ox.pid());
    assert_eq!(field(&mut c, &id, "quiet").as_deref(), Some("false"));
    ox.signal("TSTP");
    assert!(
        wait_until(Duration::from_secs(3), || field(&mut c, &id, "quiet")
            .as_deref()
            == Some("true")),
        "quiet never became true"
    );
    let beat1 = field(&mut c, &id, "beat").unwrap();
    assert!(
        wait_until(Duration::from_secs(3), || field(&mut c, &id, "beat")
            .unwrap()
            != beat1),
        "a quiet process keeps beating"
    );
    let later = hard_worker(&jid(), "rust", "after-tstp", 1);
    let _: () = c.lpush("queue:rust", &later).unwrap();
    // Two beats later, the job it must NOT fetch is still queued.
    assert!(
        support::wait_beats(&mut c, &id, 2, Duration::from_secs(30)),
        "a quiet process keeps beating"
    );
    assert_eq!(queue_bytes(&mut c, "rust"), vec![later.into_bytes()]);
    assert!(ox.try_exit().is_none(), "TSTP does not stop the process");
    ox.signal("TERM");
    let status = ox.wait_exit(Duration::from_secs(10)).expect("exits");
    assert!(status.success());
}

#[test]
fn ttin_logs_the_running_jobs() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let mut ox = start(&redis, &["rust"], &["-t", "1"]);
    let id = identity_of(&mut c, ox.pid());
    let long = jid();
    let _: () = c
        .lpush("queue:rust", hard_worker(&long, "rust", "dumped", 30_000))
        .unwrap();
    wait_busy(&mut c, &id, 1);
    let before = ox.log().matches(&long).count();
    ox.signal("TTIN");
    assert!(
        wait_until(Duration::from_secs(3), || ox.log().matches(&long).count()
            > before),
        "TTIN did not log the running job"
    );
    let log = ox.log();
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains(&long))
        .unwrap()
        .to_string();
    assert!(line.contains("running"), "{line}");
    assert!(line.contains("rust"), "{line}");
    assert!(ox.try_exit().is_none(), "TTIN does not stop the process");
    ox.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(10)).is_some());
}

#[test]
fn a_ruby_sidekiq_and_oxidekiq_share_one_redis_on_different_queues() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let jobs_rb = r#"
class RubyJob
  include Sidekiq::Worker
  def perform(key)
    Sidekiq.redis { |c| c.set(key, "ruby ran") }
  end
end
"#;
    let mut rb = RubySidekiq::start(&redis.url(), jobs_rb, &["ruby"], 2);
    let mut ox = start(&redis, &["rust"], &["-c", "3"]);
    let ox_id = identity_of(&mut c, ox.pid());
    let rb_id = rb
        .wait_for_identity(&mut c, Duration::from_secs(30))
        .expect("the Ruby process registers");

    // Each process's jobs on its own queue; each would fail on the other's (no such class): any
    // cross-fetch would land in the retry set.
    let mut rust_jids = Vec::new();
    for i in 0..10 {
        let j = jid();
        let _: () = c
            .lpush("queue:rust", hard_worker(&j, "rust", &format!("r{i}"), 5))
            .unwrap();
        rust_jids.push(j);
    }
    ruby(
        r#"10.times { |i| Sidekiq::Client.push("class" => "RubyJob", "queue" => "ruby", "args" => ["ruby-ran-#{i}"]) }"#,
        &redis.url(),
    );
    assert!(
        wait_until(Duration::from_secs(20), || (0..10)
            .all(|i| c.exists::<_, bool>(format!("ruby-ran-{i}")).unwrap())),
        "Ruby ran its jobs"
    );
    assert!(
        wait_until(Duration::from_secs(10), || {
            let log = ox.log();
            rust_jids.iter().all(|j| {
                log.lines()
                    .any(|l| l.contains(&format!("jid={j}")) && l.contains("done"))
            })
        }),
        "oxidekiq ran its jobs"
    );
    assert_eq!(c.llen::<_, usize>("queue:rust").unwrap(), 0);
    assert_eq!(c.llen::<_, usize>("queue:ruby").unwrap(), 0);
    assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0, "no cross-fetch");
    assert_eq!(c.zcard::<_, usize>("dead").unwrap(), 0);

    let out = ruby(
        r##"Sidekiq::ProcessSet.new.sort_by(&:identity).each { |p| puts "#{p.identity} #{p["queues"].join(",")} #{p.labels.join(",")}" }"##,
        &redis.url(),
    );
    let mut expected = [format!("{ox_id} rust oxidekiq"), format!("{rb_id} ruby")];
    expected.sort();
    let got: Vec<&str> = out.lines().iter().map(|l| l.trim_end()).collect();
    assert_eq!(got, expected);
    let (status, body) = web_ui_get(&redis.url(), "/busy");
    assert_eq!(status, 200);
    assert!(body.contains(&format!(r#"value="{ox_id}""#)));
    assert!(body.contains(&format!(r#"value="{rb_id}""#)));

    ox.signal("TERM");
    rb.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(10)).unwrap().success());
    assert!(rb.wait_exit(Duration::from_secs(15)).is_some());
    let members: Vec<String> = c.smembers("processes").unwrap();
    assert!(members.is_empty(), "{members:?}");
}

#[test]
fn daily_stats_keys_carry_the_five_year_ttl() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = c
        .lpush("queue:rust", hard_worker(&jid(), "rust", "one", 1))
        .unwrap();
    let _: () = c
        .lpush("queue:rust", hard_worker(&jid(), "rust", "bad", -1))
        .unwrap();
    let mut ox = start(&redis, &["rust"], &[]);
    assert!(wait_until(Duration::from_secs(10), || c
        .get::<_, Option<i64>>("stat:processed")
        .unwrap()
        == Some(2)));
    let date = chrono::Utc::now().format("%Y-%m-%d").to_string();
    for (key, n) in [("stat:processed", 2), ("stat:failed", 1)] {
        let daily = format!("{key}:{date}");
        let v: Option<i64> = c.get(&daily).unwrap();
        assert_eq!(v, Some(n), "{daily}");
        let ttl: i64 = c.ttl(&daily).unwrap();
        assert!(
            ttl > 157_680_000 - 60 && ttl <= 157_680_000,
            "{daily} ttl {ttl}"
        );
        let total_ttl: i64 = c.ttl(key).unwrap();
        assert_eq!(total_ttl, -1, "{key} never expires");
    }
    let out = ruby(
        "h = Sidekiq::Stats::History.new(1); puts h.processed.values.first; puts h.failed.values.first",
        &redis.url(),
    );
    assert_eq!(out.lines(), vec!["2", "1"]);
    ox.signal("TERM");
    assert!(ox.wait_exit(Duration::from_secs(10)).is_some());
}

/// The in-process twin of `HardWorker`: sleeps `count` ms, stops early at the shutdown deadline, and
/// records its jid in `done` when it completes.
#[derive(Debug)]
struct RecordingHardWorker;

impl Worker for RecordingHardWorker {
    const CLASS: &'static str = "HardWorker";
    type Args = (String, i64);

    async fn perform(&self, ctx: &JobContext, (_name, count): Self::Args) -> JobResult {
        let mut shutdown = ctx.shutdown();
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(count as u64)) => {}
            _ = shutdown.cancelled() => return Err(JobError::msg("interrupted by shutdown")),
        }
        let mut c = ctx.redis();
        let _: () = redis::AsyncCommands::rpush(&mut c, "done", ctx.jid()).await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_lost_when_stop_arrives_at_random_moments_mid_drain() {
    const JOBS: usize = 2000;
    // Alternate a timeout long enough for running jobs to finish with one that cancels them at once.
    for round in 0..6 {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let mut jids = Vec::with_capacity(JOBS);
        let mut payloads = Vec::with_capacity(JOBS);
        for i in 0..JOBS {
            let j = jid();
            let count = rand::random_range(1..=20);
            payloads.push(hard_worker(&j, "rust", &format!("n{i}"), count));
            jids.push(j);
        }
        let _: () = c.lpush("queue:rust", &payloads).unwrap();
        let timeout = if round % 2 == 0 {
            Duration::from_secs(3)
        } else {
            Duration::ZERO
        };
        let cfg = Config {
            redis_url: Some(redis.url()),
            concurrency: 20,
            queues: vec![QueueWeight {
                name: "rust".into(),
                weight: 0,
            }],
            timeout,
            beat_interval: Duration::from_millis(200),
            poll_interval_average: Duration::from_millis(100),
            ..Config::default()
        };
        let mut registry = Registry::new();
        registry.register(RecordingHardWorker);
        let handle = Launcher::new(cfg, registry).start().await.unwrap();
        let identity = handle.identity().to_string();
        // A random moment to stop at: the race itself.
        let wait = rand::random_range(50..1500);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        handle.stop().await.unwrap();

        let done: Vec<String> = c.lrange("done", 0, -1).unwrap();
        let queued: Vec<String> = c.lrange("queue:rust", 0, -1).unwrap();
        let what = format!("round {round} (stop after {wait} ms, timeout {timeout:?})");
        let pairs: Vec<(String, String)> =
            jids.iter().cloned().zip(payloads.iter().cloned()).collect();
        // With time to finish (3 s for jobs of at most 20 ms) nothing is cancelled after its side
        // effect: no job may both run and be pushed back. Cancelled at once: at most the in-flight ones.
        let max_both = if timeout.is_zero() { 20 } else { 0 };
        account_for_every_job(&what, &pairs, &done, &queued, max_both);
        assert_eq!(
            c.zcard::<_, usize>("retry").unwrap(),
            0,
            "round {round}: an interrupted job is not a failure"
        );
        assert!(nonempty_working_lists(&mut c).is_empty(), "round {round}");
        let members: Vec<String> = c.smembers("processes").unwrap();
        assert!(!members.contains(&identity));
        let processed: i64 = c
            .get::<_, Option<i64>>("stat:processed")
            .unwrap()
            .unwrap_or(0);
        assert!(
            processed as usize >= done.len(),
            "round {round}: stat:processed {processed} < {} done",
            done.len()
        );
    }
}

#[test]
fn term_at_random_moments_leaves_every_unrun_payload_byte_identical_in_the_queue() {
    for _round in 0..3 {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let pairs: Vec<(String, String)> = (0..2000)
            .map(|i| {
                let j = jid();
                let raw = hard_worker(&j, "rust", &format!("b{i}"), rand::random_range(1..=20));
                (j, raw)
            })
            .collect();
        let payloads: Vec<&String> = pairs.iter().map(|(_, raw)| raw).collect();
        let _: () = c.lpush("queue:rust", &payloads).unwrap();
        let mut ox = start(&redis, &["rust"], &["-c", "20", "-t", "2"]);
        let id = identity_of(&mut c, ox.pid());
        // A random moment to stop at: the race itself.
        std::thread::sleep(Duration::from_millis(rand::random_range(50..1500)));
        ox.signal("TERM");
        let status = ox.wait_exit(Duration::from_secs(10)).expect("exits");
        assert!(status.success(), "{status:?}");
        // Each jid exactly once: in the log's `done` lines or in the queue. (A sum of stat:processed
        // and the queue length would let a job run and also pushed back hide a lost one.)
        let queued: Vec<String> = c.lrange("queue:rust", 0, -1).unwrap();
        let done = done_jids(&ox.log());
        // -t 2 for jobs of at most 20 ms: none is cancelled, so none may both run and be pushed back.
        account_for_every_job("binary TERM", &pairs, &done, &queued, 0);
        let processed: i64 = c
            .get::<_, Option<i64>>("stat:processed")
            .unwrap()
            .unwrap_or(0);
        assert!(
            processed as usize >= done.len(),
            "stat:processed {processed} < {} done",
            done.len()
        );
        assert!(nonempty_working_lists(&mut c).is_empty());
        assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0);
        let members: Vec<String> = c.smembers("processes").unwrap();
        assert!(!members.contains(&id));
    }
}
