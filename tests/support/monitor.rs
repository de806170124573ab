//! [`Monitor`]: every command Redis receives (`MONITOR`), recorded from a thread until dropped, for
//! tests that count round trips or compare the commands sent with a recording of Ruby's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::RedisServer;

/// Records every command Redis receives, as `MONITOR` prints it, until dropped.
pub struct Monitor {
    lines: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// One command a monitor saw: its words (the command as sent, arguments unescaped) and whether a Lua
/// script ran it inside Redis (not a round trip of its own).
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub words: Vec<String>,
    pub lua: bool,
}

impl Monitor {
    pub fn start(redis: &RedisServer) -> Monitor {
        let mut m = redis.conn();
        redis::cmd("MONITOR").exec(&mut m).unwrap();
        m.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (l, s) = (lines.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match m.recv_response() {
                    Ok(redis::Value::SimpleString(line)) => l.lock().unwrap().push(line),
                    Ok(_) => {}
                    Err(e) if e.is_timeout() => {}
                    Err(e) => panic!("monitor: {e}"),
                }
            }
        });
        Monitor {
            lines,
            stop,
            thread: Some(thread),
        }
    }

    /// The raw lines so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The commands so far, parsed.
    pub fn commands(&self) -> Vec<Seen> {
        self.lines().iter().map(|l| parse(l)).collect()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One `MONITOR` line: `<time> [<db> <client>|lua] "word" "word" ...`, each word unescaped (`\"`,
/// `\\`, `\n`, `\r`, `\t`, `\xHH`).
pub fn parse(line: &str) -> Seen {
    let lua = line.contains(" lua]");
    let mut words = Vec::new();
    let b = line.as_bytes();
    let mut i = line.find(']').map_or(0, |p| p + 1);
    while i < b.len() {
        if b[i] != b'"' {
            i += 1;
            continue;
        }
        i += 1;
        let mut w: Vec<u8> = Vec::new();
        while i < b.len() && b[i] != b'"' {
            if b[i] == b'\\' && i + 1 < b.len() {
                i += 1;
                match b[i] {
                    b'n' => w.push(b'\n'),
                    b'r' => w.push(b'\r'),
                    b't' => w.push(b'\t'),
                    b'a' => w.push(7),
                    b'b' => w.push(8),
                    b'x' if i + 2 < b.len() => {
                        let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("00");
                        w.push(u8::from_str_radix(hex, 16).unwrap_or(0));
                        i += 2;
                    }
                    c => w.push(c),
                }
            } else {
                w.push(b[i]);
            }
            i += 1;
        }
        i += 1;
        words.push(String::from_utf8_lossy(&w).into_owned());
    }
    Seen { words, lua }
}
