//! sidekiq-cron without Ruby, live: schedules created with Debian's sidekiq-cron 1.8.0 (on Sidekiq 6.4)
//! run from oxidekiq processes alone, and from oxidekiq processes and the gem's own poller together,
//! each tick enqueued once, through a process killed at a tick and a Redis stall across ticks; a
//! schedule declared in Rust shows on the Web UI's Cron tab and stops when disabled from Ruby; a
//! `config/schedule.yml` is loaded into the namespaced layout of sidekiq-cron 2.x when the fleet uses
//! it.
//!
//! "Once per tick" is checked against the gem's own bookkeeping: every tick claimed in
//! `cron_job:<name>:enqueued` (by whichever process) has exactly one job in the queue, and the claims are
//! distinct instants written exactly as Ruby formats them (checked by Ruby in the same run), so a Ruby
//! poller and oxidekiq contend for the same members.

use crate::support;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use oxidekiq::launcher::Event;
use redis::Commands;
use support::{
    LoggedProcess, Oxidekiq, RedisServer, config, launch, ruby, temp_dir, wait_until,
    web_ui_get_with,
};

/// Loads the gem's job model on top of the Sidekiq client preamble.
const CRON: &str = "require \"sidekiq/cron/job\"\n";

/// Each oxidekiq fetches only a queue nobody pushes to, so the cron jobs stay in their queue to be
/// counted; and looks at the schedules every second.
const OXIDEKIQ_ARGS: &[&str] = &["-q", "idle", "--cron-poll-interval", "1"];

/// The claimed ticks of schedule hash `job_key`, as (member, score).
fn claims(conn: &mut redis::Connection, job_key: &str) -> Vec<(String, f64)> {
    conn.zrange_withscores(format!("{job_key}:enqueued"), 0, -1)
        .unwrap()
}

/// Checks "once per tick": the jobs in `queue` are exactly the ticks claimed since `before` (the
/// claims present at the start), and every claim is a distinct instant written as Ruby writes it
/// (`Time#iso8601` member, `Float#to_s` score), as Ruby itself formats it in this run. Returns the
/// number of ticks enqueued.
#[track_caller]
fn assert_once_per_tick(
    redis: &RedisServer,
    job_key: &str,
    queue: &str,
    before: &[String],
) -> usize {
    let mut conn = redis.conn();
    // The claims and the queue in one MULTI, while the schedulers keep enqueuing; and read again for
    // up to 3 s while they differ: the gem claims a tick and pushes its job in two commands, which a
    // read can fall between. A job too many or too few stays so, and fails below.
    let read = |conn: &mut redis::Connection| {
        let (claimed, jobs): (Vec<(String, f64)>, usize) = redis::pipe()
            .atomic()
            .zrange_withscores(format!("{job_key}:enqueued"), 0, -1)
            .llen(format!("queue:{queue}"))
            .query(conn)
            .unwrap();
        let claimed: Vec<(String, f64)> = claimed
            .into_iter()
            .filter(|(m, _)| !before.contains(m))
            .collect();
        (claimed, jobs)
    };
    let (mut claimed, mut jobs) = read(&mut conn);
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while jobs != claimed.len() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
        (claimed, jobs) = read(&mut conn);
    }
    assert_eq!(
        jobs,
        claimed.len(),
        "every claimed tick has one job and every job a claimed tick: {claimed:?}"
    );
    let members: Vec<&str> = claimed.iter().map(|(m, _)| m.as_str()).collect();
    let script = format!(
        "{CRON}JSON.parse(ENV.fetch('MEMBERS')).each {{ |m| t = Time.iso8601(m); puts [t.utc.iso8601, t.to_f.to_s].join(' ') }}"
    );
    let members_json = serde_json::to_string(&members).unwrap();
    let out = support::ruby_with_env(&script, &redis.url(), &[("MEMBERS", &members_json)]);
    let formatted: Vec<&str> = out.lines();
    for ((member, score), line) in claimed.iter().zip(&formatted) {
        assert_eq!(
            line.split(' ').next(),
            Some(member.as_str()),
            "member not in Ruby's format"
        );
        let ruby_score: f64 = line.split(' ').nth(1).unwrap().parse().unwrap();
        assert_eq!(*score, ruby_score, "score of {member}");
    }
    let instants: HashSet<&str> = formatted.iter().copied().collect();
    assert_eq!(instants.len(), claimed.len(), "two claims for one tick");
    jobs
}

/// Waits until `queue` holds more than `n` jobs.
#[track_caller]
fn wait_for_jobs(redis: &RedisServer, queue: &str, n: usize, what: &str) {
    let mut conn = redis.conn();
    let key = format!("queue:{queue}");
    assert!(
        wait_until(Duration::from_secs(30), || conn
            .llen::<_, usize>(&key)
            .unwrap()
            > n),
        "{what}: no more than {n} jobs in {key} after 30 s"
    );
}

/// Starts an oxidekiq (with [`OXIDEKIQ_ARGS`]) in a directory whose `config/schedule.yml` is `yaml`.
fn start_with_schedule_file(redis: &RedisServer, yaml: &str) -> Oxidekiq {
    let dir = temp_dir("oxidekiq-cron-file");
    std::fs::create_dir_all(dir.join("config")).unwrap();
    std::fs::write(dir.join("config/schedule.yml"), yaml).unwrap();
    Oxidekiq::start_in(dir, &redis.url(), OXIDEKIQ_ARGS, &[])
}

/// Sleeps until `offset_ms` past the next whole second (the tick of a 1-second schedule is claimable
/// from one second after it, so a little past a whole second is "at the tick").
fn sleep_to_tick(offset_ms: u64) {
    let now = support::now();
    let frac = now - now.floor();
    std::thread::sleep(Duration::from_secs_f64(1.0 - frac) + Duration::from_millis(offset_ms));
}

#[test]
fn a_ruby_schedule_runs_once_per_tick_from_oxidekiq_alone_and_beside_the_gems_poller() {
    let redis = RedisServer::start();
    // Every second, and every other second: the gem's own guard (`not_enqueued_after?`) keeps its
    // poller off a 1-second schedule whose previous tick was enqueued, so the race between the gem
    // and oxidekiq is on the 2-second one.
    ruby(
        &format!(
            "{CRON}Sidekiq::Cron::Job.create(name: 'tick', cron: '* * * * * *', class: 'CronTick', \
             queue: 'cron', date_as_argument: true) or raise 'not created'
             Sidekiq::Cron::Job.create(name: 'even', cron: '*/2 * * * * *', class: 'EvenTick', \
             queue: 'even') or raise 'not created'"
        ),
        &redis.url(),
    );
    let key = "cron_job:tick";
    let (even_key, mut conn) = ("cron_job:even", redis.conn());
    let before: Vec<String> = claims(&mut conn, key).into_iter().map(|(m, _)| m).collect();
    let even_before: Vec<String> = claims(&mut conn, even_key)
        .into_iter()
        .map(|(m, _)| m)
        .collect();
    let started = support::now();

    // Only oxidekiq processes: two of them, every tick once.
    let mut a = Oxidekiq::start(&redis.url(), OXIDEKIQ_ARGS);
    let _b = Oxidekiq::start(&redis.url(), OXIDEKIQ_ARGS);
    wait_for_jobs(&redis, "cron", 5, "two oxidekiq processes");
    let n = assert_once_per_tick(&redis, key, "cron", &before);

    // The gem's poller joins: still once per tick.
    let ruby_poller = LoggedProcess::spawn(
        "ruby-cron",
        Path::new("ruby"),
        &["-e", support::CRON_RUBY_POLLER],
        &[("REDIS_URL", &redis.url())],
    );
    assert!(ruby_poller.wait_for_log("ruby cron poller up", Duration::from_secs(30)));
    wait_for_jobs(&redis, "cron", n + 4, "oxidekiq and the gem's poller");
    let n = assert_once_per_tick(&redis, key, "cron", &before);
    assert_once_per_tick(&redis, even_key, "even", &even_before);

    // A process killed at the tick: the others enqueue it, once.
    sleep_to_tick(1_010);
    a.kill_9();
    wait_for_jobs(&redis, "cron", n + 3, "after a kill at the tick");
    let n = assert_once_per_tick(&redis, key, "cron", &before);

    // Redis stalls across ticks: afterwards each tick is enqueued once (the ticks of the stall are
    // not caught up beyond the latest, as the gem's grace rule says).
    sleep_to_tick(500);
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3000)
        .query(&mut redis.conn())
        .unwrap();
    // The stall's own length.
    std::thread::sleep(Duration::from_secs(3));
    wait_for_jobs(&redis, "cron", n + 3, "after a 3 s Redis stall");
    let n = assert_once_per_tick(&redis, key, "cron", &before);

    let even = assert_once_per_tick(&redis, even_key, "even", &even_before);

    // Disabled from Ruby (what the Cron tab's Disable button does): no more jobs.
    ruby(
        &format!(
            "{CRON}Sidekiq::Cron::Job.find('tick').disable!; Sidekiq::Cron::Job.find('even').disable!"
        ),
        &redis.url(),
    );
    // A child process announces no rounds: 2.5 s lets a round that read the schedule before the
    // disable end, then three ticks that must NOT be enqueued are time passing on purpose.
    std::thread::sleep(Duration::from_millis(2_500));
    let disabled_at = assert_once_per_tick(&redis, key, "cron", &before);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        assert_once_per_tick(&redis, key, "cron", &before),
        disabled_at,
        "a disabled schedule was enqueued"
    );
    // Every tick of the run was enqueued once, save the few a stall or a loaded machine may skip:
    // the bound only catches a poller that misses most ticks.
    let seconds = (support::now() - started) as usize;
    // Who won the ticks: Sidekiq's client writes `class` before `args`, oxidekiq's after.
    let by_ruby = |queue: &str, class: &str| {
        let payloads: Vec<String> = redis
            .conn()
            .lrange(format!("queue:{queue}"), 0, -1)
            .unwrap();
        let ruby_order = format!(r#""class":"{class}","args""#);
        payloads.iter().filter(|p| p.contains(&ruby_order)).count()
    };
    let (ruby_1s, ruby_2s) = (by_ruby("cron", "CronTick"), by_ruby("even", "EvenTick"));
    assert!(
        ruby_2s >= 1,
        "the gem's poller took no tick: it did not race oxidekiq"
    );
    eprintln!(
        "1-second schedule: {n} ticks in {seconds} s, {ruby_1s} enqueued by the gem's poller; \
         2-second schedule: {even} ticks, {ruby_2s} by the gem's poller; the rest by oxidekiq"
    );
    assert!(
        n * 2 >= seconds.saturating_sub(8),
        "{n} ticks enqueued in {seconds} s"
    );
    drop(ruby_poller);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_declared_in_rust_shows_on_the_cron_tab_and_stops_when_disabled() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), &["idle"], 1);
    cfg.cron.poll_interval = Duration::from_secs(1);
    cfg.cron.jobs.push(
        oxidekiq::CronJob::new("rust report", "*/2 * * * * *", "RustReport")
            .args(("pdf", 7))
            .queue("reports")
            .description("declared in Rust"),
    );
    let handle = launch(cfg, oxidekiq::Registry::new()).await;
    let mut conn = redis.conn();
    support::wait_for(
        "a job of the Rust schedule",
        Duration::from_secs(30),
        || conn.llen::<_, usize>("queue:reports").unwrap() > 0,
    )
    .await;
    let url = redis.url();
    let (status, body) = tokio::task::block_in_place(|| {
        web_ui_get_with(
            &url,
            "/cron",
            "require \"sidekiq/web\"\nrequire \"sidekiq/cron/web\"",
        )
    });
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("rust report") && body.contains("RustReport"),
        "{body}"
    );
    // The gem reads the schedule back as its own.
    let out = tokio::task::block_in_place(|| {
        ruby(
            &format!(
                "{CRON}j = Sidekiq::Cron::Job.find('rust report'); puts [j.valid?, j.args.to_json, j.status].join(' ')"
            ),
            &url,
        )
    });
    assert_eq!(out.trimmed(), r#"true ["pdf",7] enabled"#);

    tokio::task::block_in_place(|| {
        ruby(
            &format!("{CRON}Sidekiq::Cron::Job.find('rust report').disable!"),
            &url,
        )
    });
    // Two rounds after the disable: the second began after it, so it read the schedule as disabled.
    let mut rounds = handle.events();
    assert!(
        rounds
            .wait_for(Event::CronRound, 2, Duration::from_secs(30))
            .await,
        "the cron poller made no two rounds after the disable"
    );
    let after_disable: usize = conn.llen("queue:reports").unwrap();
    // Then rounds that span more than one tick of the schedule (every 2 s) enqueue nothing more.
    let since = std::time::Instant::now();
    let mut later = 0;
    while later < 3 || since.elapsed() < Duration::from_millis(2_500) {
        assert!(
            rounds
                .wait_for(Event::CronRound, 1, Duration::from_secs(30))
                .await,
            "the cron poller stopped making rounds"
        );
        later += 1;
    }
    assert_eq!(
        conn.llen::<_, usize>("queue:reports").unwrap(),
        after_disable,
        "a disabled schedule was enqueued in {later} rounds"
    );
    handle.stop().await.unwrap();
}

#[test]
fn a_schedule_file_is_written_in_the_namespaced_layout_the_fleet_uses() {
    let redis = RedisServer::start();
    // A sidekiq-cron 2.x fleet: `cron_jobs:default` holds `cron_job:default:<name>` hashes.
    let mut conn = redis.conn();
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg("cron_job:default:ns tick")
        .arg(&[
            ("name", "ns tick"),
            ("namespace", "default"),
            ("cron", "* * * * * *"),
            ("klass", "NsTick"),
            ("args", "[]"),
            ("message", r#"{"queue":"ns","class":"NsTick","args":[]}"#),
            ("status", "enabled"),
        ])
        .cmd("SADD")
        .arg("cron_jobs:default")
        .arg("cron_job:default:ns tick")
        .query(&mut conn)
        .unwrap();
    let _ox = start_with_schedule_file(
        &redis,
        "from file:\n  cron: '0 3 * * *'\n  class: FromFile\n  args: [1]\n",
    );
    wait_for_jobs(&redis, "ns", 0, "the namespaced schedule");
    assert!(wait_until(Duration::from_secs(10), || {
        conn.sismember("cron_jobs:default", "cron_job:default:from file")
            .unwrap()
    }));
    let klass: String = conn.hget("cron_job:default:from file", "klass").unwrap();
    assert_eq!(klass, "FromFile");
}

/// The cron forms oxidekiq reads give fugit's own previous tick (the tick a poller claims), computed by
/// fugit 1.5 (sidekiq-cron 1.8.0's parser) in this run, at instants across months, weekdays, a
/// month's end and a daylight-saving change.
#[test]
fn cron_lines_and_natural_forms_give_fugits_previous_tick() {
    let forms = [
        "*/5 * * * *",
        "0 9 * * 1-5",
        "15,45 */2 * * *",
        "0 0 L * *",
        "0 12 * * mon#2",
        "0 0 1,15 * 0",
        "*/10 * * * * *",
        "30 2 * * * Europe/Paris",
        "0 9 * * * America/New_York",
        "@hourly",
        "@weekly",
        "every 5 minutes",
        "every 30 seconds",
        "every 2 hours",
        "every day at 5:30 pm",
        "every monday at 9am",
        "every weekday at noon",
        "every day at 9 Asia/Tokyo",
    ];
    // 2026-11-25 10:37:58.3 UTC, 2026-03-29 01:30 UTC (Paris skips 02:00-03:00), 2026-02-28 23:59:59,
    // 2026-10-25 00:45 UTC (Paris repeats 02:00-03:00), 2027-01-01 00:00:00.5.
    let instants = [
        1795603078.3,
        1774747800.0,
        1772323199.0,
        1792889100.0,
        1798761600.5,
    ];
    let script = r##"
require "fugit"
forms = JSON.parse(ENV.fetch("FORMS"))
instants = JSON.parse(ENV.fetch("INSTANTS"))
forms.each do |f|
  c = Fugit.parse(f)
  raise "#{f}: #{c.class}" unless c.is_a?(Fugit::Cron)
  instants.each { |t| puts c.previous_time(Time.at(t).utc).utc.to_i }
end
"##;
    let redis_url = "redis://127.0.0.1:1"; // not used: fugit needs no Redis
    let out = support::ruby_with_env(
        script,
        redis_url,
        &[
            ("FORMS", &serde_json::to_string(&forms).unwrap()),
            ("INSTANTS", &serde_json::to_string(&instants).unwrap()),
        ],
    );
    let expected: Vec<i64> = out.lines().iter().map(|l| l.parse().unwrap()).collect();
    let mut i = 0;
    for form in forms {
        let schedule = oxidekiq::cron::Schedule::parse(form).unwrap();
        for t in instants {
            let now = chrono::DateTime::from_timestamp_micros((t * 1e6) as i64).unwrap();
            let ours = schedule.previous_time(now).unwrap().timestamp();
            assert_eq!(ours, expected[i], "{form:?} at {now}");
            i += 1;
        }
    }
}

/// Keys of the wrong type, bytes that are not UTF-8 and a schedule that never ticks are each reported
/// once, naming the key, and stop no other schedule.
#[test]
fn a_bad_schedule_key_is_reported_once_and_stops_no_other() {
    let redis = RedisServer::start();
    ruby(
        &format!(
            "{CRON}Sidekiq::Cron::Job.create(name: 'good', cron: '* * * * * *', class: 'Good', \
             queue: 'good') or raise 'not created'"
        ),
        &redis.url(),
    );
    let mut conn = redis.conn();
    let _: () = redis::pipe()
        .cmd("SET")
        .arg("cron_job:broken")
        .arg("a string")
        .cmd("HSET")
        .arg("cron_job:never")
        .arg(&[
            ("name", "never"),
            ("cron", "0 0 31 2 *"),
            ("klass", "Never"),
        ])
        .cmd("HSET")
        .arg("cron_job:bytes")
        .arg("name")
        .arg("bytes")
        .arg("cron")
        .arg(b"\xff\xfe * * * *".as_slice())
        .arg("klass")
        .arg("Bytes")
        .cmd("SADD")
        .arg("cron_jobs")
        .arg(&["cron_job:broken", "cron_job:never", "cron_job:bytes"])
        .cmd("SET")
        .arg("cron_jobs:oops")
        .arg("not a set")
        .query(&mut conn)
        .unwrap();
    let ox = Oxidekiq::start(&redis.url(), OXIDEKIQ_ARGS);
    wait_for_jobs(&redis, "good", 2, "the good schedule beside bad keys");
    let log = ox.log();
    for needle in [
        "cron_job:broken is a string, not a cron schedule hash",
        "cron_jobs:oops is a string, not a set of cron schedules",
        "cron_job:never is not a valid sidekiq-cron schedule",
        "cron_job:bytes is not a valid sidekiq-cron schedule",
    ] {
        assert_eq!(log.matches(needle).count(), 1, "{needle:?} once in:\n{log}");
    }
}

/// Without the job's Ruby class the gem pushes `sidekiq_worker_message` (the schedule's `message` with
/// its `args`) or, for `active_job: true`, `active_job_message` (the `JobWrapper`, with the
/// `queue_name_prefix`). oxidekiq's jobs equal what Sidekiq's client makes of those two messages in
/// this run (jids, job ids and timestamps aside), and ActiveJob runs the wrapped one.
#[test]
fn cron_jobs_carry_the_payloads_the_gem_pushes_and_activejob_runs_them() {
    let redis = RedisServer::start();
    ruby(
        &format!(
            "{CRON}Sidekiq::Cron::Job.create(name: 'plain', cron: '* * * * * *', class: 'PlainWorker', \
             queue: 'plain', args: [1, {{'a' => 'b'}}]) or raise 'not created'
             Sidekiq::Cron::Job.create(name: 'aj', cron: '* * * * * *', class: 'ReportJob', \
             active_job: true, queue: 'reports', queue_name_prefix: 'app', date_as_argument: true, \
             args: ['pdf'], description: 'weekly') or raise 'not created'"
        ),
        &redis.url(),
    );
    let _ox = Oxidekiq::start(&redis.url(), OXIDEKIQ_ARGS);
    wait_for_jobs(&redis, "plain", 0, "the plain schedule");
    wait_for_jobs(
        &redis,
        "app_reports",
        0,
        "the ActiveJob schedule, on its prefixed queue",
    );
    let mut conn = redis.conn();
    let ours = |conn: &mut redis::Connection, queue: &str| -> serde_json::Value {
        let raw: String = conn.lindex(format!("queue:{queue}"), 0).unwrap();
        serde_json::from_str(&raw).unwrap()
    };
    let (plain, aj) = (ours(&mut conn, "plain"), ours(&mut conn, "app_reports"));
    let out = ruby(
        &format!(
            "{CRON}c = Sidekiq::Client.new
             puts c.send(:normalize_item, Sidekiq::Cron::Job.find('plain').sidekiq_worker_message).to_json
             puts c.send(:normalize_item, Sidekiq::Cron::Job.find('aj').active_job_message).to_json"
        ),
        &redis.url(),
    );
    let gems: Vec<serde_json::Value> = out
        .lines()
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // What differs by nature: ids, the push time, and the date argument (the enqueue time).
    let strip = |mut v: serde_json::Value| {
        let m = v.as_object_mut().unwrap();
        for k in ["jid", "created_at", "enqueued_at"] {
            m.remove(k);
        }
        if let Some(data) = m.get_mut("args").and_then(|a| a[0].as_object_mut())
            && data.contains_key("job_id")
        {
            assert!(data.remove("job_id").unwrap().is_string());
            let args = data["arguments"].as_array_mut().unwrap();
            assert!(
                args.pop().unwrap().is_f64(),
                "date_as_argument appends a float"
            );
        }
        v
    };
    assert!(plain["created_at"].is_f64() && plain["enqueued_at"].is_f64());
    assert_eq!(strip(plain), strip(gems[0].clone()));
    assert_eq!(strip(aj.clone()), strip(gems[1].clone()));
    let ran = support::ruby_activejob(
        "class ReportJob < ActiveJob::Base
           def perform(*args) = puts(args.first)
         end
         payload = JSON.parse(Sidekiq.redis { |c| c.lindex('queue:app_reports', 0) })
         ActiveJob::Base.execute(payload['args'][0])",
        &redis.url(),
    );
    assert_eq!(ran.trimmed(), "pdf");
}

/// A quiet process stops enqueuing cron jobs, as Ruby's `Launcher#quiet` stops the gem's poller (the
/// other processes of the fleet keep the schedules).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_process_stops_enqueuing_cron_jobs() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), &["idle"], 1);
    cfg.cron.poll_interval = Duration::from_secs(1);
    cfg.cron
        .jobs
        .push(oxidekiq::CronJob::new("every second", "* * * * * *", "Tick").queue("ticks"));
    let handle = launch(cfg, oxidekiq::Registry::new()).await;
    let mut conn = redis.conn();
    support::wait_for("a cron job", Duration::from_secs(30), || {
        conn.llen::<_, usize>("queue:ticks").unwrap() > 0
    })
    .await;
    handle.send(oxidekiq::launcher::Control::Quiet);
    // A round under way when quiet lands may still enqueue: let it end. A quiet poller announces no
    // more rounds, so no event marks that; and three ticks that must NOT be enqueued are time passing.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let quiet_at: usize = conn.llen("queue:ticks").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(conn.llen::<_, usize>("queue:ticks").unwrap(), quiet_at);
    handle.stop().await.unwrap();
}

/// `sidekiq.yml`'s `:schedule:` is run as sidekiq-cron schedules, unless sidekiq-scheduler (whose
/// section it also is) runs it from a Ruby process: then each tick would be enqueued twice, so it is
/// left to sidekiq-scheduler, with a warning.
#[test]
fn sidekiq_yml_schedules_run_unless_sidekiq_scheduler_runs_them() {
    let yml = ":queues:\n  - idle\n:scheduler:\n  :schedule:\n    from yml:\n      cron: '* * * * * *'\n      class: FromYml\n      queue: yml\n";
    let start = |redis: &RedisServer| {
        let dir = temp_dir("oxidekiq-cron-yml");
        std::fs::write(dir.join("sidekiq.yml"), yml).unwrap();
        Oxidekiq::start_in(
            dir,
            &redis.url(),
            &["-C", "sidekiq.yml", "--cron-poll-interval", "1"],
            &[],
        )
    };
    let redis = RedisServer::start();
    let _ox = start(&redis);
    wait_for_jobs(&redis, "yml", 0, "the sidekiq.yml schedule");

    let redis = RedisServer::start();
    let _: () = redis
        .conn()
        .hset(
            "sidekiq-scheduler:next_times",
            "from yml",
            "2026-11-25 10:00:00 +0000",
        )
        .unwrap();
    let ox = start(&redis);
    assert!(ox.wait_for_log("left to sidekiq-scheduler", Duration::from_secs(30)));
    assert!(!redis.conn().exists::<_, bool>("cron_job:from yml").unwrap());
}

/// The jobs in `queue` and the ticks claimed in each of the two claim sets `sets`, read in one
/// `MULTI`.
fn jobs_and_ticks(
    conn: &mut redis::Connection,
    queue: &str,
    sets: [&str; 2],
) -> (usize, [HashSet<String>; 2]) {
    let (jobs, a, b): (usize, Vec<String>, Vec<String>) = redis::pipe()
        .atomic()
        .llen(format!("queue:{queue}"))
        .zrange(sets[0], 0, -1)
        .zrange(sets[1], 0, -1)
        .query(conn)
        .unwrap();
    (jobs, [a.into_iter().collect(), b.into_iter().collect()])
}

/// A schedule file loaded by oxidekiq into an empty Redis goes to sidekiq-cron 1.x's layout
/// (`cron_job:<name>`); a sidekiq-cron 2.x process started later with the same file writes
/// `cron_job:default:<name>` and never reads the first. The two hashes are one schedule: each tick is
/// enqueued once, and claimed in both claim sets, so a Ruby poller of either layout sees it taken.
#[test]
fn a_schedule_in_both_layouts_is_enqueued_once_per_tick() {
    let redis = RedisServer::start();
    let _ox = start_with_schedule_file(
        &redis,
        "report:\n  cron: '* * * * * *'\n  class: Report\n  queue: twin\n",
    );
    let mut conn = redis.conn();
    assert!(wait_until(Duration::from_secs(30), || {
        conn.sismember("cron_jobs", "cron_job:report").unwrap()
    }));
    // What sidekiq-cron 2.x's `save` writes for the same schedule.yml entry (`to_hash`, the set, and
    // the tick before now claimed).
    let fields: std::collections::HashMap<String, String> =
        conn.hgetall("cron_job:report").unwrap();
    let mut fields: Vec<(String, String)> = fields.into_iter().collect();
    fields.push(("namespace".into(), "default".into()));
    fields.push(("source".into(), "schedule".into()));
    let _: () = redis::pipe()
        .atomic()
        .cmd("HSET")
        .arg("cron_job:default:report")
        .arg(&fields)
        .cmd("SADD")
        .arg("cron_jobs:default")
        .arg("cron_job:default:report")
        .query(&mut conn)
        .unwrap();
    let sets = [
        "cron_job:report:enqueued",
        "cron_job:default:report:enqueued",
    ];
    let (jobs_before, before) = jobs_and_ticks(&mut conn, "twin", sets);
    let old: HashSet<String> = before.into_iter().flatten().collect();
    wait_for_jobs(
        &redis,
        "twin",
        jobs_before + 6,
        "the schedule in both layouts",
    );
    let (jobs, claimed) = jobs_and_ticks(&mut conn, "twin", sets);
    let new: Vec<HashSet<String>> = claimed
        .into_iter()
        .map(|c| c.difference(&old).cloned().collect())
        .collect();
    let ticks: HashSet<&String> = new.iter().flatten().collect();
    assert_eq!(
        jobs - jobs_before,
        ticks.len(),
        "one job per tick, whichever layout's hash claimed it: {new:?}"
    );
    assert_eq!(new[0], new[1], "each tick is claimed in both claim sets");
}

/// A schedule hash whose `status` is empty (written by a tool, or by a client that saved a `nil`
/// status) is enabled or not as the gem reads it (`status == "enabled"`, asked of the gem in this
/// run): the Cron tab shows it as the gem reads it, and oxidekiq must not run a schedule the tab
/// shows disabled.
#[test]
fn a_schedule_with_an_empty_status_runs_only_if_the_gem_reads_it_enabled() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    for (name, status) in [("blank", ""), ("on", "enabled")] {
        let key = format!("cron_job:{name}");
        let message = format!(r#"{{"queue":"{name}","class":"K","args":[]}}"#);
        let _: () = redis::pipe()
            .cmd("HSET")
            .arg(&key)
            .arg(&[
                ("name", name),
                ("cron", "* * * * * *"),
                ("klass", "K"),
                ("args", "[]"),
                ("message", message.as_str()),
                ("status", status),
            ])
            .cmd("SADD")
            .arg("cron_jobs")
            .arg(&key)
            .query(&mut conn)
            .unwrap();
    }
    let gem = ruby(
        &format!("{CRON}puts Sidekiq::Cron::Job.all.find {{ |j| j.name == 'blank' }}.enabled?"),
        &redis.url(),
    );
    let gem_enabled = match gem.trimmed() {
        "true" => true,
        "false" => false,
        other => panic!("the gem answered {other:?}"),
    };
    let _ox = Oxidekiq::start(&redis.url(), OXIDEKIQ_ARGS);
    // The enabled schedule shows the poller ran over several ticks.
    wait_for_jobs(&redis, "on", 3, "the enabled schedule");
    let blank: usize = conn.llen("queue:blank").unwrap();
    assert_eq!(
        blank > 0,
        gem_enabled,
        "the gem reads an empty status as enabled: {gem_enabled}; oxidekiq pushed {blank} jobs"
    );
}

/// The keyspace `SCAN` for sidekiq-cron 2.x namespaces (every key walked, about 0.8 s per million keys)
/// holds up no tick: a process starting on a Redis with many keys enqueues a due tick of `cron_jobs`
/// before that scan ends. The declared schedules wait for the scan (their layout depends on it), so
/// the order is read from the process's own clock: the job's `enqueued_at` is earlier than the score
/// `save` gives the declared schedule's first claim.
#[test]
fn the_namespace_scan_holds_up_no_tick() {
    let redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let mut conn = redis.conn();
    let _: () = redis::cmd("DEBUG")
        .arg("POPULATE")
        .arg(500_000)
        .query(&mut conn)
        .unwrap();
    // No claimed tick yet: the tick before now is due at the first look.
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg("cron_job:now")
        .arg(&[
            ("name", "now"),
            ("cron", "* * * * * *"),
            ("klass", "Now"),
            ("message", r#"{"queue":"now","class":"Now","args":[]}"#),
        ])
        .cmd("SADD")
        .arg("cron_jobs")
        .arg("cron_job:now")
        .query(&mut conn)
        .unwrap();
    let _ox = start_with_schedule_file(
        &redis,
        "declared:\n  cron: '0 3 * * *'\n  class: Declared\n",
    );
    assert!(
        wait_until(Duration::from_secs(60), || conn
            .exists::<_, bool>("cron_job:declared:enqueued")
            .unwrap()),
        "the declared schedule was not written"
    );
    wait_for_jobs(&redis, "now", 0, "the due tick");
    let first: String = conn.lindex("queue:now", -1).unwrap();
    let job: serde_json::Value = serde_json::from_str(&first).unwrap();
    let secs = |t: f64| if t > 1e11 { t / 1000.0 } else { t };
    let enqueued_at = secs(job["enqueued_at"].as_f64().unwrap());
    let claims = claims(&mut conn, "cron_job:declared");
    let declared_at = secs(claims[0].1);
    assert!(
        enqueued_at < declared_at,
        "the first tick was enqueued at {enqueued_at}, after the scan ended (declared at {declared_at})"
    );
}

/// A Redis whose ACL refuses `SCAN` (a common hardening) still runs every schedule of `cron_jobs` and
/// gets the declared ones written: the refusal is reported once, and only the usual sets are read.
#[test]
fn a_redis_refusing_scan_still_gets_the_declared_schedules() {
    let redis = RedisServer::start_with(&[
        "--user", "default", "on", "nopass", "~*", "&*", "+@all", "-scan",
    ]);
    let mut conn = redis.conn();
    let refused: redis::RedisResult<(u64, Vec<String>)> =
        redis::cmd("SCAN").arg(0).query(&mut conn);
    assert!(refused.is_err(), "the ACL lets SCAN through");
    let ox = start_with_schedule_file(
        &redis,
        "declared:\n  cron: '* * * * * *'\n  class: Declared\n  queue: declared\n",
    );
    wait_for_jobs(&redis, "declared", 1, "the declared schedule");
    let log = ox.log();
    assert_eq!(
        log.matches("could not be scanned").count(),
        1,
        "the refused SCAN is reported once:\n{log}"
    );
}

/// How many `HGETALL` calls Redis has served (`INFO commandstats`).
fn hgetalls(conn: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_hgetall:calls="))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Issue 43 item 5: every round read every schedule (`SMEMBERS` and one `HGETALL` each), and a
/// schedule ticking every second made a round every second: 2 000 schedules cost 2 000 `HGETALL` a
/// second. Between whole reads (one per poll interval, as the gem polls) a round now reads only the
/// schedules due; every tick still runs.
#[test]
fn a_round_reads_only_the_due_schedules_between_whole_reads() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut pipe = redis::pipe();
    for i in 0..2000 {
        let key = format!("cron_job:hourly{i}");
        pipe.cmd("HSET")
            .arg(&key)
            .arg(&[
                ("name", format!("hourly{i}").as_str()),
                ("cron", "0 * * * *"),
                ("klass", "Hourly"),
                (
                    "message",
                    r#"{"queue":"hourly","class":"Hourly","args":[]}"#,
                ),
            ])
            .ignore()
            .cmd("SADD")
            .arg("cron_jobs")
            .arg(&key)
            .ignore();
    }
    pipe.cmd("HSET")
        .arg("cron_job:every")
        .arg(&[
            ("name", "every"),
            ("cron", "* * * * * *"),
            ("klass", "Every"),
            ("message", r#"{"queue":"every","class":"Every","args":[]}"#),
        ])
        .ignore()
        .cmd("SADD")
        .arg("cron_jobs")
        .arg("cron_job:every")
        .ignore();
    let _: () = pipe.query(&mut conn).unwrap();
    let ox = Oxidekiq::start(&redis.url(), &["-q", "idle", "--cron-poll-interval", "30"]);
    wait_for_jobs(&redis, "every", 0, "the first tick");
    let (before, jobs) = (
        hgetalls(&mut conn),
        conn.llen::<_, usize>("queue:every").unwrap(),
    );
    // A rate: reads and ticks per five seconds of wall clock, so the window is the measure.
    std::thread::sleep(Duration::from_secs(5));
    let read = hgetalls(&mut conn) - before;
    let ticks = conn.llen::<_, usize>("queue:every").unwrap() - jobs;
    assert!(ticks >= 3, "{ticks} ticks in 5 s:\n{}", ox.log());
    assert!(
        read < 100,
        "{read} HGETALL in 5 s of a 1-second schedule beside 2 000 hourly ones (a whole read is 2 001)"
    );
}

/// Review of issue 43: between whole reads a round re-reads the schedules its cached copy finds due; the
/// cached copy keeps the tick each round enqueued (or found claimed), so after a minute's tick the
/// minutely schedules are not "due" again until their next tick. Without it every round (every second,
/// for a schedule ticking every second) read all of them again until the next whole read: measured with
/// 2 000 minutely schedules, 2 000 `HGETALL` a second for about 25 s of every minute.
#[test]
fn a_round_after_a_minutely_tick_does_not_read_every_minutely_schedule_again() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut pipe = redis::pipe();
    let n = 500;
    for i in 0..n {
        let key = format!("cron_job:minutely{i}");
        pipe.cmd("HSET")
            .arg(&key)
            .arg(&[
                ("name", format!("minutely{i}").as_str()),
                ("cron", "* * * * *"),
                ("klass", "Minutely"),
                (
                    "message",
                    r#"{"queue":"minutely","class":"Minutely","args":[]}"#,
                ),
            ])
            .ignore()
            .cmd("SADD")
            .arg("cron_jobs")
            .arg(&key)
            .ignore();
    }
    pipe.cmd("HSET")
        .arg("cron_job:every")
        .arg(&[
            ("name", "every"),
            ("cron", "* * * * * *"),
            ("klass", "Every"),
            ("message", r#"{"queue":"every","class":"Every","args":[]}"#),
        ])
        .ignore()
        .cmd("SADD")
        .arg("cron_jobs")
        .arg("cron_job:every")
        .ignore();
    let _: () = pipe.query(&mut conn).unwrap();
    let ox = Oxidekiq::start(&redis.url(), &["-q", "idle", "--cron-poll-interval", "300"]);
    // The first whole read enqueues the minute's ticks (all due within their 60 s grace); wait for the
    // next minute's, which a round between whole reads enqueues from the cache. The next whole read
    // comes 300 s after the first, past the end of this test: every read counted below is a round's.
    let ticked = wait_until(Duration::from_secs(90), || {
        conn.llen::<_, usize>("queue:minutely").unwrap() >= 2 * n
    });
    assert!(ticked, "no second minutely tick:\n{}", ox.log());
    let before = hgetalls(&mut conn);
    // A rate: reads per three seconds of wall clock, so the window is the measure.
    std::thread::sleep(Duration::from_secs(3));
    let read = hgetalls(&mut conn) - before;
    assert!(
        read < 100,
        "{read} HGETALL in 3 s after a minutely tick of {n} schedules beside one ticking every second"
    );
}
