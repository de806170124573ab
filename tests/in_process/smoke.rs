//! The harness itself: a test gets a private Redis.
use crate::support;

#[test]
fn each_test_gets_its_own_redis_on_a_random_port() {
    let a = support::RedisServer::start();
    let b = support::RedisServer::start();
    assert_ne!(a.port, b.port);
    assert_ne!(a.port, 6379);
    let mut c = a.conn();
    let _: () = redis::cmd("SET").arg("k").arg("v").query(&mut c).unwrap();
    let mut d = b.conn();
    let got: Option<String> = redis::cmd("GET").arg("k").query(&mut d).unwrap();
    assert_eq!(got, None);
}
