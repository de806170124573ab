//! Races between a stop and a fetch that is still under way: a job a fetch brings back after the stop
//! began is pushed back to its queue whatever happens, even by a fetch that keeps no copy in Redis.

use crate::support;

use std::time::Duration;

use oxidekiq::Registry;
use oxidekiq::config::{Config, FetchMode};
use oxidekiq::launcher::{Control, Phase};
use redis::Commands;
use support::RedisServer;

/// Basic fetch's `BRPOP` is never cut short. A double stop (the deadline at once) while it waits, and a
/// job arriving just then: the `BRPOP` takes it out of Redis after the deadline, and it must go back to
/// its queue (it was dropped: the push-back lost its race with the deadline and nothing kept the job).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_basic_fetch_takes_after_the_deadline_goes_back_to_its_queue() {
    for fetch in [FetchMode::BASIC, FetchMode::RELIABLE] {
        let redis = RedisServer::start();
        let mut c = redis.conn();
        let config = Config {
            fetch,
            ..support::config(&redis.url(), &["default"], 2)
        };
        let handle = support::launch(config, Registry::new()).await;
        assert!(
            support::wait_blocked(&mut c, 1, Duration::from_secs(30)),
            "{fetch:?}: the fetch never reached its blocking wait"
        );
        handle.send(Control::Stop);
        handle.send(Control::Stop);
        support::wait_for("the deadline", Duration::from_secs(30), || {
            handle.phase() == Phase::Cancelled
        })
        .await;
        let job = r#"{"class":"NobodyHere","args":[],"jid":"0123456789abcdef01234567","queue":"default"}"#;
        let _: () = c.lpush("queue:default", job).unwrap();
        handle.join().await.unwrap();
        let queued: Vec<String> = c.lrange("queue:default", 0, -1).unwrap();
        assert_eq!(
            queued,
            [job],
            "{fetch:?}: the job is back in its queue, once"
        );
        assert_eq!(c.zcard::<_, usize>("retry").unwrap(), 0, "{fetch:?}");
        assert_eq!(c.zcard::<_, usize>("dead").unwrap(), 0, "{fetch:?}");
    }
}
