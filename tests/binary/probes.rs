//! `/health` and `/ready` stay answerable while idle clients hold every connection slot of `--http`
//! (issue 43 item 7): the cap (64) was taken before a request was read, so 64 idle connections made a
//! probe wait in the backlog until one of them timed out, 10 s at a time. Through the real binary
//! (`cargo build --workspace` first).
use crate::support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// `GET path` that gives up after `within`: the status, or None.
fn probe(port: u16, path: &str, within: Duration) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(within)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split(' ').nth(1)?.parse().ok()
}

#[test]
fn probes_answer_while_idle_clients_hold_every_connection_slot() {
    let redis = support::RedisServer::start();
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let ox = support::Oxidekiq::start(&redis.url(), &["--http", &addr, "-q", "default"]);
    assert!(
        support::wait_until(Duration::from_secs(30), || probe(
            port,
            "/ready",
            Duration::from_secs(5)
        ) == Some(200)),
        "the endpoint never answered:\n{}",
        ox.log()
    );
    // Every ordinary slot held by a client that sends nothing.
    let idle: Vec<TcpStream> = (0..64)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    // Time for the server to accept them all: nothing outside it marks an accepted connection that
    // sends nothing (one accepted late only makes the probe's way easier, never a false failure).
    std::thread::sleep(Duration::from_millis(500));
    for path in ["/health", "/ready"] {
        let asked = Instant::now();
        let status = probe(port, path, Duration::from_secs(3));
        assert_eq!(
            status,
            Some(200),
            "{path} did not answer within 3 s while 64 idle clients held the slots ({:?})\n{}",
            asked.elapsed(),
            ox.log()
        );
    }
    drop(idle);
}
