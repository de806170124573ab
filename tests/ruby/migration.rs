//! The "canary" walkthrough of docs/migration.md, end to end against real Ruby Sidekiq 6.4 with the
//! routing middleware `ruby/oxidekiq.rb`: a Ruby `HardWorker` served by a real Sidekiq process;
//! `check`; route 10% (about 10% run in Rust); 100%; roll back to 0% (waiting jobs moved back byte for
//! byte); no job lost, none run twice, no `NameError` in the retry set at any step. Also: killing every
//! oxidekiq mid-canary keeps new jobs on Ruby within one heartbeat TTL and strands none after a roll
//! back; `--handoff` pushes jobs oxidekiq should not run to Ruby's queue unchanged.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use support::{Oxidekiq, RedisServer, RubySidekiq, ruby, wait_until};

const MIDDLEWARE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/ruby/oxidekiq.rb");

/// The Ruby app's job, as the Ruby server runs it: records its jid (Rust's runs are in oxidekiq's log).
fn server_jobs_rb() -> String {
    format!(
        r#"
require {MIDDLEWARE:?}
Sidekiq.configure_server {{ |c| c.client_middleware {{ |chain| chain.add Oxidekiq::Router }} }}
class HardWorker
  include Sidekiq::Worker
  def perform(name, count)
    Sidekiq.redis {{ |c| c.rpush("ran:ruby", jid) }}
  end
end
"#
    )
}

/// A Rails-like client with the middleware (one require, one client_middleware line) enqueuing `n`
/// `HardWorker` jobs of `count` ms; returns their jids.
fn enqueue(url: &str, n: usize, count: u64) -> Vec<String> {
    let out = ruby(
        &format!(
            r#"
require {MIDDLEWARE:?}
Sidekiq.configure_client {{ |c| c.client_middleware {{ |chain| chain.add Oxidekiq::Router }} }}
class HardWorker
  include Sidekiq::Worker
end
{n}.times {{ |i| puts HardWorker.perform_async("job-#{{i}}", {count}) }}
"#
        ),
        url,
    );
    let jids: Vec<String> = out.lines().iter().map(|l| l.trim().to_string()).collect();
    assert_eq!(jids.len(), n, "{}", out.stderr);
    jids
}

/// Runs `oxidekiq args...` to completion; (exit code, stdout and stderr).
fn oxidekiq(url: &str, args: &[&str]) -> (i32, String) {
    let (code, out, err) = support::run_cli(url, args);
    (code, out + &err)
}

fn route(url: &str, class: &str, percent: u32) -> String {
    let (code, out) = oxidekiq(url, &["route", class, &percent.to_string()]);
    assert_eq!(code, 0, "{out}");
    out
}

/// jids of the jobs oxidekiq finished, from its log (`... jid=<jid> ... INFO: done`).
fn rust_done(ox: &Oxidekiq) -> Vec<String> {
    ox.log()
        .lines()
        .filter(|l| l.ends_with("INFO: done"))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("jid="))
                .map(str::to_string)
        })
        .collect()
}

fn ruby_done(c: &mut redis::Connection) -> Vec<String> {
    redis::cmd("LRANGE")
        .arg("ran:ruby")
        .arg(0)
        .arg(-1)
        .query(c)
        .unwrap()
}

fn lrange(c: &mut redis::Connection, key: &str) -> Vec<Vec<u8>> {
    redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(c)
        .unwrap()
}

/// How many `HGETALL` calls Redis has served (only the router's table reads, in these tests).
fn route_table_reads(c: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(c).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_hgetall:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn exists(c: &mut redis::Connection, key: &str) -> bool {
    redis::cmd("EXISTS").arg(key).query::<i64>(c).unwrap() > 0
}

/// Every job enqueued so far ran exactly once, in Ruby or in Rust, and the retry and dead sets hold no
/// `NameError` (nor anything else: HardWorker never fails here). Returns (ruby, rust) run counts.
#[track_caller]
fn wait_all_ran_once(
    c: &mut redis::Connection,
    ox: &Oxidekiq,
    enqueued: &[String],
) -> (usize, usize) {
    let ok = wait_until(Duration::from_secs(120), || {
        ruby_done(c).len() + rust_done(ox).len() >= enqueued.len()
    });
    let ruby = ruby_done(c);
    let rust = rust_done(ox);
    assert!(
        ok,
        "not every job ran: {} enqueued, {} in Ruby, {} in Rust",
        enqueued.len(),
        ruby.len(),
        rust.len()
    );
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for j in ruby.iter().chain(rust.iter()) {
        *seen.entry(j.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "ran twice: {twice:?}");
    let want: BTreeSet<&str> = enqueued.iter().map(String::as_str).collect();
    let got: BTreeSet<&str> = seen.keys().copied().collect();
    assert_eq!(got, want, "lost or unknown jobs");
    assert_no_name_error(c);
    (ruby.len(), rust.len())
}

#[track_caller]
fn assert_no_name_error(c: &mut redis::Connection) {
    for set in ["retry", "dead"] {
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(set)
            .arg(0)
            .arg(-1)
            .query(c)
            .unwrap();
        assert!(
            members.is_empty(),
            "{set} must stay empty (no NameError): {members:?}"
        );
    }
}

#[test]
fn walkthrough_check_canary_full_route_and_roll_back_with_real_ruby_sidekiq() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let mut all: Vec<String> = Vec::new();

    // 0. Today: Ruby runs HardWorker. Jobs Rails enqueued are waiting; `check` reads them.
    all.extend(enqueue(&url, 20, 0));
    let (code, out) = oxidekiq(&url, &["check"]);
    assert_eq!(code, 0, "check:\n{out}");
    let hard: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("HardWorker "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(hard[1..4], ["20", "20", "0"], "{out}");
    let mut sidekiq = RubySidekiq::start(&url, &server_jobs_rb(), &["default"], 5);
    assert!(
        sidekiq
            .wait_for_identity(&mut c, Duration::from_secs(30))
            .is_some()
    );

    // 1. oxidekiq serves default_rust; it registers HardWorker there with its beat.
    let ox = Oxidekiq::start(
        &url,
        &["-q", "default_rust", "-c", "2", "--beat-interval", "0.5"],
    );
    assert!(
        wait_until(Duration::from_secs(30), || exists(
            &mut c,
            "oxidekiq:serving:default_rust|HardWorker"
        )),
        "oxidekiq never registered HardWorker on default_rust"
    );
    let (ruby0, rust0) = wait_all_ran_once(&mut c, &ox, &all);
    assert_eq!((ruby0, rust0), (20, 0), "no route yet: all on Ruby");

    // 2. Canary: 10%. A loose bound: Binomial(300, 0.1) has mean 30 and sd 5.2.
    let out = route(&url, "HardWorker", 10);
    assert!(out.contains("default_rust"), "{out}");
    let reads_before = route_table_reads(&mut c);
    all.extend(enqueue(&url, 300, 0));
    // The router reads the table once per cache period, not per job (Sidekiq makes a new middleware
    // instance for every push: the cache must outlive it).
    let reads = route_table_reads(&mut c) - reads_before;
    assert!(
        (1..=20).contains(&reads),
        "300 pushes read the route table {reads} times"
    );
    let (ruby1, rust1) = wait_all_ran_once(&mut c, &ox, &all);
    let canary = rust1 - rust0;
    eprintln!("canary at 10%: {canary} of 300 ran in Rust");
    assert!(
        (8..=75).contains(&canary),
        "about 10% of 300 should run in Rust, got {canary} (Ruby {})",
        ruby1 - ruby0
    );
    let (code, routes) = oxidekiq(&url, &["routes"]);
    assert_eq!(code, 0, "{routes}");
    let line: Vec<&str> = routes
        .lines()
        .find(|l| l.starts_with("HardWorker "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(line[1], "10%", "{routes}");
    assert_eq!(line[2], "1", "one live process: {routes}");
    assert!(
        wait_until(Duration::from_secs(20), || {
            let (_, r) = oxidekiq(&url, &["routes"]);
            r.lines().any(|l| {
                l.starts_with("HardWorker ")
                    && l.split_whitespace().nth(3) == Some(canary.to_string().as_str())
            })
        }),
        "routes must count the {canary} Rust runs once flushed by the beat"
    );
    assert!(
        routes.contains("Sidekiq 6.x"),
        "say what 6.4 can show: {routes}"
    );

    // 3. Everything: 100%.
    route(&url, "HardWorker", 100);
    all.extend(enqueue(&url, 60, 0));
    let (ruby2, rust2) = wait_all_ran_once(&mut c, &ox, &all);
    assert_eq!((ruby2 - ruby1, rust2 - rust1), (0, 60), "100%: all in Rust");

    // 4. Roll back with jobs waiting on default_rust: Ruby's server is stopped so the moved jobs stay
    //    visible on `default`; Rust's jobs are slow (300 ms, 2 at a time) so most are still waiting.
    sidekiq.signal("TERM");
    assert!(sidekiq.wait_exit(Duration::from_secs(30)).is_some());
    let slow = enqueue(&url, 60, 300);
    all.extend(slow.iter().cloned());
    let before: Vec<Vec<u8>> = lrange(&mut c, "queue:default_rust");
    assert!(before.len() > 10, "jobs waiting for Rust: {}", before.len());
    let out = route(&url, "HardWorker", 0);
    let moved: usize = out
        .split("moved ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    // Two hands give the waiting jobs back, and either may be first: the command moves what is still
    // on default_rust, and the running process hands each job it fetches after the route changed to
    // `default` unrun ("class rolled back"). Together they hand back every waiting job, once.
    let handed = |ox: &Oxidekiq| ox.log().matches("class rolled back (route 0)").count();
    assert!(
        wait_until(Duration::from_secs(20), || {
            lrange(&mut c, "queue:default_rust").is_empty()
                && lrange(&mut c, "queue:default").len() == moved + handed(&ox)
        }),
        "every waiting job handed back once: {out}; the process handed {}, {} on default",
        handed(&ox),
        lrange(&mut c, "queue:default").len()
    );
    let on_ruby = lrange(&mut c, "queue:default");
    eprintln!(
        "roll back: {} were waiting on default_rust; {out}; the process handed {} back",
        before.len(),
        handed(&ox)
    );
    assert!(!on_ruby.is_empty(), "{out}");
    for job in &on_ruby {
        assert!(
            before.contains(job),
            "moved byte for byte: {}",
            String::from_utf8_lossy(job)
        );
    }
    assert!(lrange(&mut c, "queue:default_rust").is_empty(), "{out}");
    // After the roll back new jobs stay on Ruby.
    all.extend(enqueue(&url, 30, 0));
    assert_eq!(lrange(&mut c, "queue:default").len(), on_ruby.len() + 30);
    assert!(lrange(&mut c, "queue:default_rust").is_empty());

    // Ruby comes back and drains everything; nothing lost, nothing twice, no NameError.
    let sidekiq2 = RubySidekiq::start(&url, &server_jobs_rb(), &["default"], 5);
    let (ruby3, rust3) = wait_all_ran_once(&mut c, &ox, &all);
    assert_eq!(ruby3 + rust3, all.len());
    assert!(rust3 - rust2 < 60, "the moved jobs ran in Ruby");
    drop(sidekiq2);
}

#[test]
fn killing_every_oxidekiq_mid_canary_keeps_new_jobs_on_ruby_and_roll_back_strands_none() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    let mut ox = Oxidekiq::start(
        &url,
        &["-q", "default_rust", "-c", "1", "--beat-interval", "0.5"],
    );
    let key = "oxidekiq:serving:default_rust|HardWorker";
    assert!(wait_until(Duration::from_secs(30), || exists(&mut c, key)));
    route(&url, "HardWorker", 50);
    // Slow jobs (2 s, one at a time): they wait on default_rust, one is in flight at the kill.
    let mut all = enqueue(&url, 40, 2000);
    let routed = lrange(&mut c, "queue:default_rust").len();
    assert!(routed > 0, "50% should route some of 40");
    assert!(
        wait_until(Duration::from_secs(20), || ox.log().contains("INFO: start")),
        "a job in flight"
    );

    ox.kill_9();
    // Within one heartbeat TTL (Sidekiq's 60 s) the registration is gone, so Ruby stops routing.
    assert!(
        wait_until(Duration::from_secs(60), || !exists(&mut c, key)),
        "the serving key must expire once no oxidekiq is alive"
    );
    let on_rust = lrange(&mut c, "queue:default_rust").len();
    all.extend(enqueue(&url, 40, 0));
    assert_eq!(
        lrange(&mut c, "queue:default_rust").len(),
        on_rust,
        "no new job routed to a dead oxidekiq"
    );

    // Roll back: the waiting jobs and the one the dead process held all go back to Ruby's queue (a
    // dead process's jobs are recovered once its liveness key, 3 beats, has expired).
    assert!(wait_until(Duration::from_secs(60), || {
        redis::cmd("KEYS")
            .arg("oxidekiq:alive:*")
            .query::<Vec<String>>(&mut c)
            .unwrap()
            .is_empty()
    }));
    let out = route(&url, "HardWorker", 0);
    eprintln!("after the kill: {routed} routed at 50%, {on_rust} waiting on default_rust; {out}");
    assert!(out.contains("moved"), "{out}");
    assert!(lrange(&mut c, "queue:default_rust").is_empty(), "{out}");
    let held: Vec<String> = redis::cmd("KEYS")
        .arg("oxidekiq:batch:*")
        .query(&mut c)
        .unwrap();
    let held_jobs: usize = held.iter().map(|k| support::held_in(&mut c, k).len()).sum();
    assert_eq!(
        held_jobs, 0,
        "nothing stranded in a dead process's working hash: {out}"
    );
    // Every job is now on `default`, once, and Ruby would run them there.
    let mut waiting: Vec<String> = lrange(&mut c, "queue:default")
        .into_iter()
        .map(|raw| {
            let v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
            v["jid"].as_str().unwrap().to_string()
        })
        .collect();
    let done = rust_done(&ox);
    waiting.extend(done.iter().cloned());
    waiting.sort();
    all.sort();
    assert_eq!(
        waiting, all,
        "every job waiting for Ruby or done, once ({out})"
    );
    let sidekiq = RubySidekiq::start(&url, &server_jobs_rb(), &["default"], 5);
    assert!(
        wait_until(Duration::from_secs(60), || ruby_done(&mut c).len()
            + done.len()
            == all.len()),
        "Ruby runs them all"
    );
    assert_no_name_error(&mut c);
    drop(sidekiq);
}

#[test]
fn handoff_pushes_unknown_classes_and_flagged_jobs_to_ruby_unchanged() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    ruby(
        r#"
        2.times { |i| Sidekiq::Client.push("class" => "Legacy::Mailer", "args" => [i], "queue" => "shared") }
        Sidekiq::Client.push("class" => "HardWorker", "args" => ["b", 0], "queue" => "shared", "bid" => "batch-1")
        Sidekiq::Client.push("class" => "HardWorker", "args" => ["plain", 0], "queue" => "shared")
        # A sidekiq-unique-jobs lock is honoured (runs here), not handed off.
        Sidekiq::Client.push("class" => "HardWorker", "args" => ["u", 0], "queue" => "shared",
                             "lock" => "until_executing", "lock_digest" => "uniquejobs:0f0f")
        # One without its digest (as 8.1's on_conflict: reschedule pushes it): the gem's server
        # computes the digest, oxidekiq cannot, so it goes to Ruby.
        Sidekiq::Client.push("class" => "HardWorker", "args" => ["r", 0], "queue" => "shared",
                             "lock" => "while_executing")
        "#,
        &url,
    );
    let pushed = lrange(&mut c, "queue:shared");
    let ox = Oxidekiq::start(
        &url,
        &[
            "-q",
            "shared",
            "--handoff",
            "default",
            "--beat-interval",
            "0.5",
        ],
    );
    assert!(
        ox.wait_for_log(
            "no live Sidekiq process serves this queue",
            Duration::from_secs(20)
        ),
        "warns when nobody serves the hand-off queue"
    );
    assert!(wait_until(Duration::from_secs(30), || lrange(
        &mut c,
        "queue:default"
    )
    .len()
        == 4));
    let handed = lrange(&mut c, "queue:default");
    for job in &handed {
        assert!(
            pushed.contains(job),
            "unchanged: {}",
            String::from_utf8_lossy(job)
        );
    }
    assert!(wait_until(Duration::from_secs(20), || ox
        .log()
        .contains("INFO: done")));
    let counts: BTreeMap<String, u64> = redis::cmd("HGETALL")
        .arg("oxidekiq:handoff")
        .query(&mut c)
        .unwrap();
    assert_eq!(counts.get("Legacy::Mailer"), Some(&2));
    assert_eq!(counts.get("HardWorker"), Some(&2));
    // Log lines reach the file through the writer thread's buffer (flushed every 20 ms): wait for the
    // line, then give a second one, if any, several flushes to show up before counting.
    assert!(ox.wait_for_log(
        "handing off jobs of Legacy::Mailer",
        Duration::from_secs(20)
    ));
    std::thread::sleep(Duration::from_millis(300));
    let log = ox.log();
    assert_eq!(
        log.matches("handing off jobs of Legacy::Mailer").count(),
        1,
        "logged once per class:\n{log}"
    );
    assert_no_name_error(&mut c);
}

#[test]
fn roll_back_moves_a_long_queue_in_order_and_leaves_other_classes() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    // 2 500 HardWorker jobs among 500 of another class, as Ruby's client pushes them (LPUSH).
    ruby(
        r#"
        3000.times do |i|
          klass = (i % 6 == 5) ? "Other" : "HardWorker"
          Sidekiq::Client.push("class" => klass, "args" => ["n#{i}", i], "queue" => "default_rust")
        end
        "#,
        &url,
    );
    let before = lrange(&mut c, "queue:default_rust");
    let (code, out) = oxidekiq(&url, &["route", "HardWorker", "0", "--settle", "0"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("moved 2500 "), "{out}");
    let back = lrange(&mut c, "queue:default");
    let left = lrange(&mut c, "queue:default_rust");
    let is_hard = |j: &Vec<u8>| String::from_utf8_lossy(j).contains("\"class\":\"HardWorker\"");
    assert_eq!(back.len(), 2500);
    assert_eq!(left.len(), 500);
    assert!(left.iter().all(|j| !is_hard(j)));
    // Byte for byte and in order: Ruby's BRPOP (the tail) serves the oldest first, as it would have.
    let mut served: Vec<&Vec<u8>> = back.iter().collect();
    served.reverse();
    let oldest_first: Vec<&Vec<u8>> = before.iter().rev().filter(|j| is_hard(j)).collect();
    assert_eq!(served, oldest_first);
    let members: Vec<String> = redis::cmd("SMEMBERS").arg("queues").query(&mut c).unwrap();
    assert!(
        members.contains(&"default".to_string()),
        "the UI sees the queue"
    );
}

#[test]
fn routes_tells_rust_and_ruby_runs_apart_with_sidekiq_7_metrics() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    // A live Sidekiq 7.3.9 process (its recorded heartbeat info): oxidekiq writes the 7.x metrics keys.
    let info = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/shared/sidekiq-7.3.9-server/heartbeat_info.json"
    ))
    .unwrap();
    let id: String = serde_json::from_str::<serde_json::Value>(&info).unwrap()["identity"]
        .as_str()
        .unwrap()
        .to_string();
    let _: () = redis::pipe()
        .cmd("SADD")
        .arg("processes")
        .arg(&id)
        .ignore()
        .cmd("HSET")
        .arg(&id)
        .arg("info")
        .arg(info.trim())
        .arg("busy")
        .arg(0)
        .arg("beat")
        .arg(support::now())
        .arg("quiet")
        .arg("false")
        .ignore()
        .query(&mut c)
        .unwrap();
    let ox = Oxidekiq::start(&url, &["-q", "default_rust", "--beat-interval", "0.5"]);
    assert!(wait_until(Duration::from_secs(30), || exists(
        &mut c,
        "oxidekiq:serving:default_rust|HardWorker"
    )));
    route(&url, "HardWorker", 50);
    ruby(
        r#"
        6.times { |i| Sidekiq::Client.push("class" => "HardWorker", "args" => ["ok", 0], "queue" => "default_rust") }
        2.times { |i| Sidekiq::Client.push("class" => "HardWorker", "args" => ["bad", -1], "queue" => "default_rust", "retry" => false) }
        "#,
        &url,
    );
    let row = |out: &str| -> Vec<String> {
        out.lines()
            .find(|l| l.starts_with("HardWorker "))
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default()
    };
    let mut out = String::new();
    let flushed = wait_until(Duration::from_secs(30), || {
        out = oxidekiq(&url, &["routes"]).1;
        row(&out).get(3..5) == Some(&["8".to_string(), "2".to_string()][..])
    });
    assert!(flushed, "8 run in Rust, 2 failed:\n{out}\n{}", ox.log());
    // What Sidekiq 7.3.9's ExecutionTracker flush adds for 5 jobs it ran, 1 failing, into the same
    // minute hash oxidekiq wrote (`tracking.rb@v7.3.9`).
    let minute = format!("j|{}", chrono::Utc::now().format("%Y%m%d|%-H:%-M"));
    let _: () = redis::pipe()
        .cmd("HINCRBY")
        .arg(&minute)
        .arg("HardWorker|p")
        .arg(5)
        .ignore()
        .cmd("HINCRBY")
        .arg(&minute)
        .arg("HardWorker|f")
        .arg(1)
        .ignore()
        .query(&mut c)
        .unwrap();
    let (_, out) = oxidekiq(&url, &["routes"]);
    assert_eq!(row(&out)[1..], ["50%", "1", "8", "2", "5", "1"], "{out}");
    assert!(out.contains("Sidekiq 7.x execution metrics"), "{out}");
}

/// A `ChaosJob` payload (`workers/src/lib.rs`) on `queue`.
fn chaos_job(queue: &str, mode: &str, sleep_ms: u64, jid: &str) -> String {
    format!(
        r#"{{"retry":true,"queue":"{queue}","class":"ChaosJob","args":["{mode}",{sleep_ms},"{jid}"],"jid":"{jid}","created_at":1700000000.0,"enqueued_at":1700000000.0}}"#
    )
}

/// The jids in list `key`, sorted.
fn jids_in_list(c: &mut redis::Connection, key: &str) -> Vec<String> {
    let members: Vec<String> = redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(c)
        .unwrap();
    let mut out: Vec<String> = members
        .iter()
        .map(|m| {
            let v: serde_json::Value = serde_json::from_str(m).unwrap();
            v["jid"].as_str().unwrap().to_string()
        })
        .collect();
    out.sort();
    out
}

/// Issue 26, item 4: `route CLASS 0` while the only oxidekiq on `default_rust` runs jobs of CLASS,
/// then a normal stop: the running jobs are pushed back to `default`, not to the Rust queue nobody
/// serves any more; a job of CLASS fetched from `default_rust` after the roll back is handed to
/// `default` without running; a retry of CLASS coming due toward `default_rust` goes to `default`.
#[test]
fn a_roll_back_during_a_drain_strands_nothing_on_the_rust_queue_and_starts_no_rust_run() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut c = redis.conn();
    route(&url, "ChaosJob", 100);
    for i in 0..5 {
        let p = chaos_job("default_rust", "sleep", 120_000, &format!("run{i}"));
        let _: () = redis::cmd("LPUSH")
            .arg("queue:default_rust")
            .arg(p)
            .query(&mut c)
            .unwrap();
    }
    let mut ox = Oxidekiq::start(
        &url,
        &[
            "-q",
            "default_rust",
            "-c",
            "6",
            "-t",
            "2",
            "--beat-interval",
            "1",
            "--poll-interval",
            "0.5",
        ],
    );
    let runs = |c: &mut redis::Connection| -> BTreeMap<String, u64> {
        redis::cmd("HGETALL").arg("chaos:runs").query(c).unwrap()
    };
    assert!(
        wait_until(Duration::from_secs(30), || runs(&mut c).len() == 5),
        "{}",
        ox.log()
    );
    let out = route(&url, "ChaosJob", 0);
    assert!(
        out.contains("moved 0"),
        "they are running, not waiting: {out}"
    );
    // A client that had not seen the 0 yet routes one more; a retry of the class comes due.
    let late = chaos_job("default_rust", "ok", 0, "late");
    let _: () = redis::cmd("LPUSH")
        .arg("queue:default_rust")
        .arg(&late)
        .query(&mut c)
        .unwrap();
    let retried = chaos_job("default_rust", "ok", 0, "retried").replace(
        r#""retry":true"#,
        r#""retry":true,"retry_count":0,"error_class":"ChaosError","error_message":"x""#,
    );
    let _: () = redis::cmd("ZADD")
        .arg("retry")
        .arg(1.0)
        .arg(&retried)
        .query(&mut c)
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || {
            let q = jids_in_list(&mut c, "queue:default");
            q.contains(&"late".to_string()) && q.contains(&"retried".to_string())
        }),
        "the late job and the retry were not handed to Ruby's queue:\n{}",
        ox.log()
    );
    let ran = runs(&mut c);
    assert!(
        !ran.contains_key("late") && !ran.contains_key("retried"),
        "{ran:?}"
    );
    ox.signal("TERM");
    assert!(
        ox.wait_exit(Duration::from_secs(30)).is_some(),
        "{}",
        ox.log()
    );
    assert_eq!(
        jids_in_list(&mut c, "queue:default_rust"),
        Vec::<String>::new(),
        "{}",
        ox.log()
    );
    assert_eq!(
        jids_in_list(&mut c, "queue:default"),
        ["late", "retried", "run0", "run1", "run2", "run3", "run4"]
    );
    let held: Vec<String> = redis::cmd("KEYS")
        .arg("oxidekiq:batch:*")
        .query(&mut c)
        .unwrap();
    assert!(held.is_empty(), "{held:?}");
}
