//! Redis Sentinel (issue 16), with a sentinel (the test server in `--sentinel` mode: Redis or Valkey, as
//! `OXIDEKIQ_TEST_SERVER` chooses) and two real servers: the binary finds the master through the
//! sentinel, keeps draining across a `SENTINEL FAILOVER` and then across the new master being SIGKILLed,
//! and every job the old master had acknowledged (and replicated) runs.
use crate::support;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use redis::Commands;
use serde_json::Value;

/// A sentinel of this test's own (the test server run with `--sentinel`) on a random port, monitoring
/// `mymaster`; killed on drop.
struct Sentinel {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Sentinel {
    fn start(master_port: u16) -> Sentinel {
        let port = support::free_port();
        let dir = support::temp_dir("sentinel");
        let conf = dir.join("sentinel.conf");
        // Quorum 1 with one sentinel; a master is down after 1 s without answers.
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor mymaster 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds mymaster 1000\n\
                 sentinel failover-timeout mymaster 2000\n\
                 sentinel parallel-syncs mymaster 1\n",
                dir.display()
            ),
        )
        .unwrap();
        // The chosen server in sentinel mode (`redis-sentinel` is `redis-server --sentinel`; Valkey
        // ships no separate name).
        let child = Command::new(support::server_binary())
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the test server must be installed (scripts/setup.sh installs it)");
        let s = Sentinel { child, port, dir };
        assert!(
            support::wait_until(Duration::from_secs(20), || s.master_port().is_some()),
            "the sentinel did not start"
        );
        s
    }

    fn conn(&self) -> Option<redis::Connection> {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port))
            .ok()?
            .get_connection_with_timeout(Duration::from_secs(2))
            .ok()
    }

    /// The port of the master the sentinel names now.
    fn master_port(&self) -> Option<u16> {
        let mut c = self.conn()?;
        let addr: Vec<String> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg("mymaster")
            .query(&mut c)
            .ok()?;
        addr.get(1)?.parse().ok()
    }

    /// How many replicas the sentinel knows in a good state.
    fn healthy_replicas(&self) -> usize {
        let Some(mut c) = self.conn() else { return 0 };
        let replicas: Vec<HashMap<String, String>> = redis::cmd("SENTINEL")
            .arg("replicas")
            .arg("mymaster")
            .query(&mut c)
            .unwrap_or_default();
        replicas
            .iter()
            .filter(|r| {
                r.get("flags").is_some_and(|f| f == "slave")
                    && r.get("master-link-status").is_some_and(|s| s == "ok")
            })
            .count()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn replica_link_up(replica: &support::RedisServer) -> bool {
    let Ok(mut c) = redis::Client::open(replica.url()).and_then(|c| c.get_connection()) else {
        return false;
    };
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query(&mut c)
        .unwrap_or_default();
    info.contains("role:slave") && info.contains("master_link_status:up")
}

/// `(jid, message)` of each job run line of a JSON log.
fn runs(log: &str) -> Vec<(String, String)> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "done" || v["message"] == "fail")
        .filter_map(|v| {
            Some((
                v["jid"].as_str()?.to_string(),
                v["message"].as_str()?.to_string(),
            ))
        })
        .collect()
}

fn done(log: &str) -> HashSet<String> {
    runs(log)
        .into_iter()
        .filter(|(_, m)| m == "done")
        .map(|(j, _)| j)
        .collect()
}

#[test]
fn a_failover_mid_drain_loses_no_acknowledged_job_and_the_drain_goes_on() {
    let a = support::RedisServer::start();
    let b = support::RedisServer::start_with(&["--replicaof", "127.0.0.1", &a.port.to_string()]);
    assert!(
        support::wait_until(Duration::from_secs(30), || replica_link_up(&b)),
        "the replica did not sync"
    );
    let sentinel = Sentinel::start(a.port);
    assert!(
        support::wait_until(Duration::from_secs(30), || sentinel.healthy_replicas() == 1),
        "the sentinel did not find the replica"
    );

    // Ruby enqueues on the master; WAIT makes sure the replica has every job: these are the jobs
    // the master acknowledged and replicated, which no failover may lose.
    let first = enqueue(&a, "first");
    let mut jids = first.clone();

    // redis-rb's form: the URL's host is the master's name. The first sentinel named is down (nothing
    // listens there): every lookup goes on to the next.
    let down = format!("127.0.0.1:{}", support::free_port());
    let sentinel_addr = format!("127.0.0.1:{}", sentinel.port);
    let mut ox = support::Oxidekiq::start(
        "redis://mymaster",
        &[
            "--sentinel",
            &down,
            "--sentinel",
            &sentinel_addr,
            "-c",
            "4",
            "--log-format",
            "json",
            "--beat-interval",
            "0.5",
        ],
    );
    assert!(
        ox.wait_for_log(
            "redis master found through sentinel",
            Duration::from_secs(30)
        ),
        "{}",
        ox.log()
    );
    let ran_of = |batch: &HashSet<String>, log: &str| done(log).intersection(batch).count();

    // 1. A graceful failover (what an operator does for maintenance), mid-drain.
    assert!(
        support::wait_until(Duration::from_secs(60), || ran_of(&first, &ox.log()) >= 50),
        "{}",
        ox.log()
    );
    let mut sc = sentinel.conn().unwrap();
    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg("mymaster")
        .query(&mut sc)
        .unwrap();
    assert!(
        support::wait_until(Duration::from_secs(60), || sentinel.master_port()
            == Some(b.port)),
        "the sentinel did not promote the replica"
    );
    assert!(
        ox.wait_for_log("redis master moved", Duration::from_secs(60)),
        "the process did not follow the failover:\n{}",
        ox.log()
    );
    let at_move = ran_of(&first, &ox.log());
    assert!(
        at_move < JOBS,
        "the first batch was drained before the process moved: no test"
    );
    assert!(
        support::wait_until(Duration::from_secs(120), || ran_of(&first, &ox.log())
            == JOBS),
        "the drain did not go on after the failover:\n{}",
        ox.log()
    );

    // 2. Once the old master follows the new one, a second batch goes to the new master, which is
    // SIGKILLed mid-drain: the sentinel promotes the old master back.
    assert!(
        support::wait_until(Duration::from_secs(60), || replica_link_up(&a)
            && sentinel.healthy_replicas() == 1),
        "the old master did not become a replica"
    );
    let second = enqueue(&b, "second");
    jids.extend(second.iter().cloned());
    assert!(
        support::wait_until(Duration::from_secs(60), || ran_of(&second, &ox.log()) >= 50),
        "{}",
        ox.log()
    );
    let mut bc = b.conn();
    let queued: usize = bc.llen("queue:default").unwrap();
    assert!(
        queued > 0,
        "the second batch was drained before the kill: no test"
    );
    let status = Command::new("kill")
        .args(["-KILL", &b.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        support::wait_until(Duration::from_secs(90), || sentinel.master_port()
            == Some(a.port)),
        "the sentinel did not fail over to the old master"
    );

    // Every job ran (some maybe twice: a fetch or an ack the old master had not replicated).
    let all_ran = support::wait_until(Duration::from_secs(180), || {
        done(&ox.log()).is_superset(&jids)
    });
    let log = ox.log();
    let ran = done(&log);
    let missing: Vec<&String> = jids.difference(&ran).collect();
    assert!(
        all_ran,
        "{} jobs never ran: {:?}\n{log}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    let moves = log.matches("redis master moved").count();
    assert!(moves >= 2, "{moves} master moves logged:\n{log}");
    // Nothing is left behind in the new master.
    let mut ac = a.conn();
    assert!(support::wait_until(Duration::from_secs(30), || {
        let q: usize = ac.llen("queue:default").unwrap_or(1);
        q == 0
    }));
    let runs_total = runs(&log).len();
    eprintln!(
        "{} jobs, {runs_total} runs ({} again after a failover), {moves} master moves",
        jids.len(),
        runs_total - jids.len()
    );
    ox.signal("TERM");
    assert!(
        ox.wait_exit(Duration::from_secs(60)).is_some(),
        "{}",
        ox.log()
    );
    // The keys that hold fetched jobs (other oxidekiq keys, such as run counters, hold no job).
    let mut leftover: Vec<String> = ac.keys("oxidekiq:batch:*").unwrap_or_default();
    leftover.extend(
        ac.keys::<_, Vec<String>>("oxidekiq:landing:*")
            .unwrap_or_default(),
    );
    let mut held = 0usize;
    for k in &leftover {
        let t: String = redis::cmd("TYPE").arg(k).query(&mut ac).unwrap();
        held += match t.as_str() {
            "list" | "hash" => support::held_in(&mut ac, k).len(),
            _ => 0,
        };
    }
    assert_eq!(held, 0, "jobs left in working lists: {leftover:?}");
}

/// Jobs per batch, 40 ms each: several seconds of work at `-c 4`.
const JOBS: usize = 600;

/// Ruby pushes a batch of HardWorker jobs to `server` and WAITs until its replica has them; the jids.
fn enqueue(server: &support::RedisServer, tag: &str) -> HashSet<String> {
    let out = support::ruby(
        &format!(
            r#"
            class HardWorker; include Sidekiq::Worker; end
            jids = Sidekiq::Client.push_bulk("class" => HardWorker, "args" => Array.new({JOBS}) {{ |i| ["{tag}#{{i}}", 40] }})
            replicas = Sidekiq.redis {{ |c| c.call("WAIT", 1, 10_000) }}
            raise "not replicated" unless replicas == 1
            puts JSON.generate(jids)
            "#
        ),
        &server.url(),
    );
    let jids: HashSet<String> = serde_json::from_str::<Vec<String>>(out.trimmed())
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(jids.len(), JOBS);
    jids
}
