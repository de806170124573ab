//! Test support shared by every integration test: a real `redis-server` per test on a random free
//! port (never 6379), killed on drop.
#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` of this test's own, on a random port, with no persistence; killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    dir: PathBuf,
}

fn free_port() -> u16 {
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
        for _attempt in 0..5 {
            let port = free_port();
            let dir =
                std::env::temp_dir().join(format!("oxidekiq-redis-{port}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let child = Command::new("redis-server")
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
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed (the test command installs it)");
            let mut server = RedisServer { child, port, dir };
            if server.wait_ready() {
                return server;
            }
            let _ = server.child.kill();
        }
        panic!("could not start redis-server");
    }

    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut c) = redis::Client::open(self.url()).and_then(|c| c.get_connection())
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return true;
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

    /// An async connection manager (what the library uses).
    pub async fn async_conn(&self) -> redis::aio::ConnectionManager {
        let client = redis::Client::open(self.url()).unwrap();
        redis::aio::ConnectionManager::new(client).await.unwrap()
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
