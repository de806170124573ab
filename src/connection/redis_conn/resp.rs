//! A connection that one task owns and speaks RESP on by hand: the job locks' batch task
//! (`lock_batch`) writes a whole batch of commands into one buffer and reads their replies straight
//! from the socket, and the reliable fetch sends its fetch pipelines on connections of its own
//! ([`super::resp_pool`]) whose replies (every job of a batch) are read here rather than by redis-rs.
//!
//! # Why
//!
//! On the shared connection every reply goes through redis-rs's generic parser on the connection's
//! driver task, and every command through a `Cmd`, a pipeline buffer and a channel hop to that task: for
//! a locked job's `SET` and its `+OK`, that machinery cost more than the rest of the lock's work in the
//! process (`bench/results/redis-per-job.md`, session 12). The replies a lock batch gets are few and
//! simple (`+OK`, a nil, an integer, a short bulk string) and are read here by hand. So are a fetch's:
//! redis-rs's reply parser (combine-based) cost about 1 500 instructions a job reading the bulk strings
//! of a batch, where [`Reader`] slices each one from the read buffer into the job's bytes
//! (bench/results/instructions.md, session 3). Every RESP2 reply is read here, nested arrays included
//! (a transaction's `EXEC`); an error line goes through redis-rs's own parser
//! ([`redis::parse_redis_value`]), so a caller gets the same [`redis::Value`] and the same errors
//! (`NOSCRIPT`, `EXECABORT`, `OOM`, ...) as from the shared connection.
//!
//! # What it supports
//!
//! Plain TCP and Unix sockets (`redis://`, `redis+unix://`), with the URL's user, password and
//! database. A `rediss://` URL and Sentinel have no [`Dialer`] ([`super::Target::dialer`] gives
//! `None`): their lock commands and fetches stay on the shared connection. It speaks RESP2 whatever protocol the
//! URL asks for (no `HELLO`): the replies read here are the same in both.
//!
//! # Failures
//!
//! The connection is made by its owner on first use, again after any failure, and again when it was
//! found closed before a batch ([`RespConn::is_open`]: nothing was sent on it). A failure while a
//! batch is on the wire (a write or read error, no reply within [`RESPONSE_TIMEOUT`], a reply that is
//! not RESP) fails that exchange and drops the connection, so a late reply is never read as the next
//! batch's. Errors name the connection's use (`lock`, `fetch`) and the server, never the password.

use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use redis::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::error::{Error, Result};

/// How long a connection (with its `AUTH` and `SELECT`) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the replies of one exchange may take: as long as the shared connection's response
/// timeout.
pub(crate) const RESPONSE_TIMEOUT: Duration = super::RESPONSE_TIMEOUT;

/// The deepest array [`Reader`] follows (a transaction's `EXEC` holds arrays one level down; this
/// only bounds a hostile or broken server).
const MAX_DEPTH: usize = 8;

/// The most elements an array's length may reserve room for before they arrive: a length that lies
/// (a broken server) reserves no more than this; a longer array grows as its elements come.
const MAX_RESERVED: usize = 1024;

/// Where and how to connect: the parts of a `redis://` or `redis+unix://` URL a connection needs.
#[derive(Clone)]
pub(crate) struct Dialer {
    /// The server's address.
    addr: Addr,
    /// The database to `SELECT` (0: none sent).
    db: i64,
    /// The ACL user, sent with the password.
    username: Option<String>,
    /// The password: `AUTH` is sent when there is one.
    password: Option<String>,
    /// What the connection is for, in errors (`lock`, `fetch`).
    role: &'static str,
}

/// A server address a [`Dialer`] connects to.
#[derive(Debug, Clone)]
enum Addr {
    Tcp(String, u16),
    Unix(PathBuf),
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("Dialer")
            .field("addr", &self.addr)
            .field("db", &self.db)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

impl Dialer {
    /// The dialer of a client's plain-text server; `None` for TLS (left to redis-rs, see the module
    /// documentation).
    pub(crate) fn of(client: &redis::Client) -> Option<Dialer> {
        let info = client.get_connection_info();
        let addr = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => Addr::Tcp(host.clone(), *port),
            redis::ConnectionAddr::Unix(path) => Addr::Unix(path.clone()),
            _ => return None,
        };
        let settings = info.redis_settings();
        Some(Dialer {
            addr,
            db: settings.db(),
            username: settings.username().map(str::to_string),
            password: settings.password().map(str::to_string),
            role: "lock",
        })
    }

    /// The same dialer, its connections named `role` in errors (`lock` unless said).
    pub(crate) fn named(mut self, role: &'static str) -> Dialer {
        self.role = role;
        self
    }

    /// The server, for errors: `host:port` or the socket's path, never a password.
    fn server(&self) -> String {
        match &self.addr {
            Addr::Tcp(host, port) if host.contains(':') => format!("[{host}]:{port}"),
            Addr::Tcp(host, port) => format!("{host}:{port}"),
            Addr::Unix(path) => path.display().to_string(),
        }
    }

    /// Connects, authenticates and selects the database, within [`CONNECT_TIMEOUT`].
    pub(crate) async fn connect(&self) -> Result<RespConn> {
        match tokio::time::timeout(CONNECT_TIMEOUT, self.connect_now()).await {
            Ok(r) => r,
            Err(_) => Err(self.error(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection within {CONNECT_TIMEOUT:?}"),
            ))),
        }
    }

    async fn connect_now(&self) -> Result<RespConn> {
        let stream = match &self.addr {
            Addr::Tcp(host, port) => {
                let s = tokio::net::TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(|e| self.error(e))?;
                // Batches are written whole: nothing gains from Nagle's delay.
                s.set_nodelay(true).map_err(|e| self.error(e))?;
                Stream::Tcp(s)
            }
            Addr::Unix(path) => Stream::Unix(
                tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(|e| self.error(e))?,
            ),
        };
        let mut conn = RespConn {
            stream,
            server: self.server(),
            role: self.role,
            buf: Vec::with_capacity(4096),
            start: 0,
        };
        if self.log_in(&mut conn, true).await? == LogIn::WithoutUser {
            // Redis before 6 has no users: `AUTH <user> <password>` has one argument too many
            // there, and redis-rs (the shared connection) then logs in with the password alone.
            self.log_in(&mut conn, false).await?;
        }
        Ok(conn)
    }

    /// Sends `AUTH` (naming the URL's user when `with_user`) when the URL has a password, and
    /// `SELECT` when it names a database other than 0; one round trip.
    async fn log_in(&self, conn: &mut RespConn, with_user: bool) -> Result<LogIn> {
        let mut hello = Vec::new();
        let mut replies = 0;
        let user = self.username.as_deref().filter(|_| with_user);
        if let Some(password) = &self.password {
            match user {
                Some(user) => {
                    command(&mut hello, 3);
                    arg(&mut hello, b"AUTH");
                    arg(&mut hello, user.as_bytes());
                }
                None => {
                    command(&mut hello, 2);
                    arg(&mut hello, b"AUTH");
                }
            }
            arg(&mut hello, password.as_bytes());
            replies += 1;
        }
        if self.db != 0 {
            command(&mut hello, 2);
            arg(&mut hello, b"SELECT");
            arg_int(&mut hello, self.db);
            replies += 1;
        }
        if replies == 0 {
            return Ok(LogIn::Done);
        }
        let got = conn.exchange_now(&hello, replies).await?;
        // One reply per command sent, `AUTH`'s first.
        let commands = [(self.password.is_some(), true), (self.db != 0, false)];
        let sent = commands
            .iter()
            .filter(|(sent, _)| *sent)
            .map(|&(_, auth)| auth);
        for (auth, reply) in sent.zip(got) {
            let Value::ServerError(e) = reply else {
                continue;
            };
            // Redis before 6 (redis-rs's test for it); the `SELECT` after it failed too.
            if auth
                && user.is_some()
                && e.details()
                    .is_some_and(|d| d.contains("wrong number of arguments for 'auth' command"))
            {
                return Ok(LogIn::WithoutUser);
            }
            // `AUTH`'s error names the user at most (`WRONGPASS invalid username-password pair`),
            // never the password.
            let (kind, what) = if auth {
                (
                    redis::ErrorKind::AuthenticationFailed,
                    "the connection was refused",
                )
            } else {
                (
                    redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                    "the connection cannot select its database",
                )
            };
            return Err(Error::Redis(redis::RedisError::from((
                kind,
                what,
                format!("{} connection to {}: {e}", conn.role, conn.server),
            ))));
        }
        Ok(LogIn::Done)
    }

    /// An I/O error of connecting to this server, naming it.
    fn error(&self, e: std::io::Error) -> Error {
        io_error(self.role, &self.server(), e)
    }
}

/// How [`Dialer::log_in`] went, when Redis did not refuse it.
#[derive(Debug, PartialEq, Eq)]
enum LogIn {
    /// Logged in, database selected.
    Done,
    /// Redis does not know users (before 6): log in again with the password alone.
    WithoutUser,
}

/// An I/O error on the `role` connection to `server`, as a Redis error (it reads as a dropped
/// connection, `is_connection_dropped`, for a broken pipe or a reset).
fn io_error(role: &str, server: &str, e: std::io::Error) -> Error {
    let kind = e.kind();
    Error::Redis(redis::RedisError::from(std::io::Error::new(
        kind,
        format!("{role} connection to {server}: {e}"),
    )))
}

/// A protocol error: the server sent something that is not RESP.
fn protocol_error(role: &str, server: &str, what: &str) -> Error {
    Error::Redis(redis::RedisError::from((
        redis::ErrorKind::Parse,
        "not a RESP reply",
        format!("{role} connection to {server}: {what}"),
    )))
}

/// The socket under a [`RespConn`].
#[derive(Debug)]
enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// One connection, made by [`Dialer::connect`]; its owner drops it after any error.
#[derive(Debug)]
pub(crate) struct RespConn {
    /// The socket.
    stream: Stream,
    /// The server, for errors.
    server: String,
    /// What the connection is for, in errors.
    role: &'static str,
    /// Bytes read and not yet parsed, from `start` on.
    buf: Vec<u8>,
    /// Where the next reply starts in `buf`.
    start: usize,
}

impl RespConn {
    /// False once the server closed the connection (or sent something nobody asked for) while it sat
    /// between exchanges: Redis's `timeout` closes an idle client, and so do `CLIENT KILL` and a
    /// restart. The lock connection is idle whenever no locked job runs; without this look, the
    /// first batch after a quiet spell would be written into a closed socket and fail every job in
    /// it, though a new connection would have carried it. One non-blocking `recv(MSG_PEEK)`, which
    /// reads the socket itself, not tokio's idea of its readiness (that may not have seen the close).
    pub(crate) fn is_open(&self) -> bool {
        // Every reply asked for was read: bytes left over were not asked for.
        if self.start != self.buf.len() {
            return false;
        }
        let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        let peeked = match &self.stream {
            Stream::Tcp(s) => socket2::SockRef::from(s).peek(&mut byte),
            Stream::Unix(s) => socket2::SockRef::from(s).peek(&mut byte),
        };
        // `Ok(0)` is the server's close, `Ok(_)` bytes nobody asked for, any other error a broken
        // socket: only "nothing to read yet" leaves it usable.
        matches!(peeked, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    /// Writes `commands` (RESP, built with [`command`] and [`arg`]) and reads `replies` replies, one
    /// per command, within [`RESPONSE_TIMEOUT`]. An `Err` leaves the connection unusable: drop it.
    pub(crate) async fn exchange(&mut self, commands: &[u8], replies: usize) -> Result<Vec<Value>> {
        match tokio::time::timeout(RESPONSE_TIMEOUT, self.exchange_now(commands, replies)).await {
            Ok(r) => r,
            Err(_) => Err(io_error(
                self.role,
                &self.server,
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no reply within {RESPONSE_TIMEOUT:?}"),
                ),
            )),
        }
    }

    async fn exchange_now(&mut self, commands: &[u8], replies: usize) -> Result<Vec<Value>> {
        self.stream
            .write_all(commands)
            .await
            .map_err(|e| io_error(self.role, &self.server, e))?;
        let mut out = Vec::with_capacity(replies);
        let mut reader = Reader::default();
        while out.len() < replies {
            let mut at = self.start;
            let got = reader.next(&self.buf, &mut at);
            // Whatever was read stays read (kept by `reader`), whole reply or not.
            self.start = at;
            match got {
                Ok(Some(value)) => out.push(value),
                Ok(None) => self.fill().await?,
                Err(what) => return Err(protocol_error(self.role, &self.server, what)),
            }
        }
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        Ok(out)
    }

    /// Reads more bytes after those not yet parsed (moved to the front first).
    async fn fill(&mut self) -> Result<()> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        if self.buf.capacity() - self.buf.len() < 1024 {
            self.buf.reserve(4096);
        }
        let n = self
            .stream
            .read_buf(&mut self.buf)
            .await
            .map_err(|e| io_error(self.role, &self.server, e))?;
        if n == 0 {
            return Err(io_error(
                self.role,
                &self.server,
                std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "the server closed the connection",
                ),
            ));
        }
        Ok(())
    }
}

/// Appends the header of a command of `args` arguments (`*<args>\r\n`); [`arg`] each argument next.
pub(crate) fn command(out: &mut Vec<u8>, args: usize) {
    header(out, b'*', args as u64);
}

/// Appends one argument (`$<len>\r\n<bytes>\r\n`).
pub(crate) fn arg(out: &mut Vec<u8>, bytes: &[u8]) {
    header(out, b'$', bytes.len() as u64);
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// Appends one unsigned integer argument, in decimal.
pub(crate) fn arg_u64(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    arg(out, decimal(&mut digits, n));
}

/// Appends one integer argument, in decimal.
pub(crate) fn arg_int(out: &mut Vec<u8>, n: i64) {
    let mut digits = [0u8; 21];
    let len = {
        let mut abs = [0u8; 20];
        let text = decimal(&mut abs, n.unsigned_abs());
        let start = digits.len() - text.len();
        digits[start..].copy_from_slice(text);
        text.len()
    };
    let start = digits.len() - len - usize::from(n < 0);
    if n < 0 {
        digits[start] = b'-';
    }
    arg(out, &digits[start..]);
}

/// Appends `<kind><n>\r\n` in one copy (a RESP array or bulk string header).
fn header(out: &mut Vec<u8>, kind: u8, n: u64) {
    // Lengths below 100 (nearly all) are written without the general conversion.
    if n < 10 {
        out.extend_from_slice(&[kind, b'0' + n as u8, b'\r', b'\n']);
    } else if n < 100 {
        out.extend_from_slice(&[
            kind,
            b'0' + (n / 10) as u8,
            b'0' + (n % 10) as u8,
            b'\r',
            b'\n',
        ]);
    } else {
        let mut digits = [0u8; 20];
        out.push(kind);
        out.extend_from_slice(decimal(&mut digits, n));
        out.extend_from_slice(b"\r\n");
    }
}

/// `n`'s decimal digits, written at the end of `buf`.
pub(crate) fn decimal(buf: &mut [u8; 20], mut n: u64) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// Reads RESP2 replies as their bytes arrive: a reply that came in several reads is read on from
/// where the last read stopped (the elements of its arrays read so far are kept here), never from its
/// start again, so a batch of 200 jobs costs one pass over its bytes however the socket cuts it. Every
/// RESP2 type: simple strings (`+OK` as [`Value::Okay`], as redis-rs reads it), errors (through
/// redis-rs's own parser: [`Value::ServerError`]), integers, bulk strings and nils, arrays nested up to
/// [`MAX_DEPTH`]. A bulk string is copied once, from the read buffer into its own `Vec`: a job's bytes.
#[derive(Debug, Default)]
pub(crate) struct Reader {
    /// The arrays being read, the innermost last: the elements read so far, and how many are to come.
    open: Vec<(Vec<Value>, usize)>,
}

/// One element at the start of a buffer.
enum Element {
    /// A whole value (no array, or an empty or nil one) and its length in bytes.
    Whole(Value, usize),
    /// An array's header: how many elements follow, and the header's length.
    Array(usize, usize),
}

impl Reader {
    /// Reads on from `b[*at..]`: the next whole reply, `*at` then just past it; `None` when more bytes
    /// are needed, `*at` past the elements read (kept here until their reply is whole). `Err` names what
    /// is not RESP2: the stream cannot be read on.
    pub(crate) fn next(
        &mut self,
        b: &[u8],
        at: &mut usize,
    ) -> std::result::Result<Option<Value>, &'static str> {
        loop {
            let rest = b.get(*at..).unwrap_or_default();
            let mut value = match element(rest)? {
                None => return Ok(None),
                Some(Element::Array(n, len)) => {
                    if self.open.len() >= MAX_DEPTH {
                        return Err("arrays nested too deep");
                    }
                    *at += len;
                    self.open.push((Vec::with_capacity(n.min(MAX_RESERVED)), n));
                    continue;
                }
                Some(Element::Whole(value, len)) => {
                    *at += len;
                    value
                }
            };
            // Into the arrays it ends, innermost first.
            loop {
                let Some((items, left)) = self.open.last_mut() else {
                    return Ok(Some(value));
                };
                items.push(value);
                *left -= 1;
                if *left > 0 {
                    break;
                }
                match self.open.pop() {
                    Some((items, _)) => value = Value::Array(items),
                    None => return Err("unreachable: an array ended twice"),
                }
            }
        }
    }
}

/// The element at the start of `b`; `None` while it is incomplete.
fn element(b: &[u8]) -> std::result::Result<Option<Element>, &'static str> {
    let Some(line) = line_end(b)? else {
        return Ok(None);
    };
    let text = &b[1..line];
    let after = line + 2;
    let value = match b[0] {
        b'$' => {
            let len = int(text)?;
            if len < 0 {
                return Ok(Some(Element::Whole(Value::Nil, after)));
            }
            let end = usize::try_from(len)
                .ok()
                .and_then(|n| after.checked_add(n))
                .filter(|end| end.checked_add(2).is_some())
                .ok_or("bulk length out of range")?;
            if b.len() < end + 2 {
                return Ok(None);
            }
            if &b[end..end + 2] != b"\r\n" {
                return Err("bulk string without its CRLF");
            }
            return Ok(Some(Element::Whole(
                Value::BulkString(b[after..end].to_vec()),
                end + 2,
            )));
        }
        b'*' => {
            let n = int(text)?;
            if n < 0 {
                Value::Nil
            } else if n == 0 {
                Value::Array(Vec::new())
            } else {
                let n = usize::try_from(n).map_err(|_| "array length out of range")?;
                return Ok(Some(Element::Array(n, after)));
            }
        }
        b'+' if text == b"OK" => Value::Okay,
        b'+' => Value::SimpleString(String::from_utf8_lossy(text).into_owned()),
        b':' => Value::Int(int(text)?),
        b'-' => redis::parse_redis_value(&b[..after]).map_err(|_| "unreadable error reply")?,
        _ => return Err("unexpected reply type"),
    };
    Ok(Some(Element::Whole(value, after)))
}

/// The first whole reply in `b` and its length; `None` while it is incomplete.
#[cfg(test)]
fn read_reply(b: &[u8]) -> std::result::Result<Option<(Value, usize)>, &'static str> {
    let mut at = 0;
    Ok(Reader::default().next(b, &mut at)?.map(|v| (v, at)))
}

/// The index of the `\r` ending the first line of `b`; `None` while it is incomplete.
fn line_end(b: &[u8]) -> std::result::Result<Option<usize>, &'static str> {
    match b.iter().position(|&c| c == b'\n') {
        None => Ok(None),
        Some(0 | 1) => Err("empty line"),
        Some(n) if b[n - 1] == b'\r' => Ok(Some(n - 1)),
        Some(_) => Err("line without CR"),
    }
}

/// A decimal integer of a reply line (an optional `-`, then digits).
fn int(text: &[u8]) -> std::result::Result<i64, &'static str> {
    let (negative, digits) = match text {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, text),
    };
    if digits.is_empty() {
        return Err("not an integer");
    }
    // Accumulated negative, so that i64::MIN reads too.
    let mut n: i64 = 0;
    for &c in digits {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            return Err("not an integer");
        }
        n = n
            .checked_mul(10)
            .and_then(|n| n.checked_sub(i64::from(d)))
            .ok_or("integer out of range")?;
    }
    if negative {
        Ok(n)
    } else {
        n.checked_neg().ok_or("integer out of range")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every prefix of `bytes` is incomplete; the whole reads as `want`, `bytes.len()` long.
    fn reads_as(bytes: &[u8], want: &Value) {
        for n in 0..bytes.len() {
            assert!(
                matches!(read_reply(&bytes[..n]), Ok(None)),
                "{:?} of {:?}",
                &bytes[..n],
                bytes
            );
        }
        let mut longer = bytes.to_vec();
        longer.extend_from_slice(b"+OK\r\n");
        let (got, len) = read_reply(&longer).unwrap().unwrap();
        assert_eq!(&got, want, "{bytes:?}");
        assert_eq!(len, bytes.len());
        // What redis-rs's own parser reads from the same bytes.
        assert_eq!(&redis::parse_redis_value(bytes).unwrap(), want, "{bytes:?}");
    }

    #[test]
    fn the_replies_of_a_lock_batch_read_as_redis_rs_reads_them() {
        reads_as(b"+OK\r\n", &Value::Okay);
        reads_as(b"+QUEUED\r\n", &Value::SimpleString("QUEUED".into()));
        reads_as(b":0\r\n", &Value::Int(0));
        reads_as(b":-12\r\n", &Value::Int(-12));
        reads_as(b"$-1\r\n", &Value::Nil);
        reads_as(b"$0\r\n\r\n", &Value::BulkString(Vec::new()));
        reads_as(b"$3\r\n1\r0\r\n", &Value::BulkString(b"1\r0".to_vec()));
        reads_as(b"*-1\r\n", &Value::Nil);
        reads_as(
            b"*2\r\n:1\r\n*1\r\n$1\r\nx\r\n",
            &Value::Array(vec![
                Value::Int(1),
                Value::Array(vec![Value::BulkString(b"x".to_vec())]),
            ]),
        );
    }

    #[test]
    fn an_error_reply_is_redis_rs_s_own_error() {
        let bytes = b"-NOSCRIPT No matching script. Please use EVAL.\r\n";
        let (v, len) = read_reply(bytes).unwrap().unwrap();
        assert_eq!(len, bytes.len());
        let Value::ServerError(e) = v else {
            panic!("{v:?}")
        };
        assert_eq!(e.kind(), Some(redis::ServerErrorKind::NoScript));
        assert!(matches!(read_reply(&bytes[..10]), Ok(None)));
    }

    #[test]
    fn what_is_not_resp2_is_an_error_not_a_wait() {
        for bad in [
            &b"?what\r\n"[..],
            b"\r\n",
            b"+OK\n",
            b":x\r\n",
            b"$3\r\nabcde\r\n",
            b"$99999999999999999999\r\n",
            b"%1\r\n+a\r\n+b\r\n",
        ] {
            assert!(read_reply(bad).is_err(), "{bad:?}");
        }
        let deep = format!("{}:1\r\n", "*1\r\n".repeat(MAX_DEPTH + 2));
        assert!(read_reply(deep.as_bytes()).is_err());
    }

    /// What a fast fetch's pipeline gets back, with a riding ack refused, an `EXEC` holding a
    /// command's error and the guard's `{'over', size}`, a transaction aborted, and every other RESP2
    /// shape: nils, empty and nil arrays, a bulk string holding CRLFs, the extreme integers.
    const STREAM: &[u8] = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n\
        *3\r\n:3\r\n:450\r\n*3\r\n$5\r\njob-1\r\n$0\r\n\r\n$4\r\n\r\n\r\n\r\n\
        :1\r\n-WRONGTYPE Operation against a key holding the wrong kind of value\r\n\
        *3\r\n-NOPERM this user has no permissions to run the 'sort' command\r\n\
        *2\r\n$4\r\nover\r\n:12\r\n*0\r\n\
        -EXECABORT Transaction discarded because of previous errors.\r\n\
        $-1\r\n*-1\r\n*0\r\n:-9223372036854775808\r\n:9223372036854775807\r\n+a b\r\n\
        *2\r\n*1\r\n*1\r\n:7\r\n$1\r\nz\r\n";

    /// The replies redis-rs's own parser reads from `stream`, one after another (it buffers what it
    /// reads: the stream's end shows as an error).
    fn redis_rs_reads(stream: &[u8]) -> Vec<Value> {
        let mut cursor = std::io::Cursor::new(stream);
        let mut parser = redis::Parser::new();
        let mut out = Vec::new();
        while let Ok(v) = parser.parse_value(&mut cursor) {
            out.push(v);
        }
        out
    }

    /// Reads `stream` arriving in pieces cut at `cuts`, as [`RespConn::exchange`] reads a socket:
    /// one reader for the whole stream, the bytes read dropped from the buffer's front between reads.
    fn read_in_pieces(stream: &[u8], cuts: &[usize]) -> Vec<Value> {
        let (mut buf, mut start, mut out) = (Vec::new(), 0, Vec::new());
        let mut reader = Reader::default();
        let mut from = 0;
        for &to in cuts.iter().chain([&stream.len()]) {
            buf.drain(..start);
            start = 0;
            buf.extend_from_slice(&stream[from..to]);
            from = to;
            loop {
                let mut at = start;
                let got = reader.next(&buf, &mut at).unwrap();
                start = at;
                match got {
                    Some(v) => out.push(v),
                    None => break,
                }
            }
        }
        assert_eq!(start, buf.len(), "every byte read");
        assert!(reader.open.is_empty(), "no array left open");
        out
    }

    #[test]
    fn a_stream_cut_at_any_byte_reads_as_redis_rs_reads_it_whole() {
        let want = redis_rs_reads(STREAM);
        assert_eq!(want.len(), 16, "{want:?}");
        assert!(matches!(&want[4], Value::Array(a) if a.len() == 3));
        assert_eq!(read_in_pieces(STREAM, &[]), want);
        for cut in 0..=STREAM.len() {
            assert_eq!(read_in_pieces(STREAM, &[cut]), want, "cut at {cut}");
        }
        let every: Vec<usize> = (1..STREAM.len()).collect();
        assert_eq!(read_in_pieces(STREAM, &every), want, "a byte at a time");
    }

    #[test]
    fn an_error_inside_an_exec_is_a_value_and_an_error_outside_one_is_redis_rs_s_error() {
        let got = read_in_pieces(STREAM, &[]);
        assert!(
            matches!(&got[6], Value::ServerError(e) if e.code() == "WRONGTYPE"),
            "{:?}",
            got[6]
        );
        let Value::Array(exec) = &got[7] else {
            panic!("{:?}", got[7])
        };
        assert!(
            matches!(&exec[0], Value::ServerError(e) if e.code() == "NOPERM"),
            "{exec:?}"
        );
        let Value::ServerError(abort) = &got[8] else {
            panic!("{:?}", got[8])
        };
        assert_eq!(abort.code(), "EXECABORT");
        let e: redis::RedisError = abort.clone().into();
        assert_eq!(e.code(), Some("EXECABORT"));
    }

    #[test]
    fn a_bulk_length_that_lies_is_an_error_or_a_wait_never_a_misread() {
        // Longer than what follows: the next reply is not taken for the string's end.
        let mut r = Reader::default();
        let mut at = 0;
        assert_eq!(r.next(b"$10\r\nabc\r\n:1\r\n", &mut at), Ok(None));
        let mut at = 0;
        assert!(
            Reader::default()
                .next(b"$10\r\nabc\r\n:1\r\n+OK\r\n", &mut at)
                .is_err()
        );
        // Shorter: the bytes after it are not its CRLF.
        assert!(read_reply(b"$2\r\nabc\r\n").is_err());
        // Out of range, or not a number.
        assert!(read_reply(b"$99999999999999999999\r\n").is_err());
        assert!(read_reply(b"$-\r\n").is_err());
        assert!(read_reply(b"$1x\r\na\r\n").is_err());
        // An array's length that lies reserves no more than MAX_RESERVED before its elements come.
        let mut r = Reader::default();
        let mut at = 0;
        assert_eq!(r.next(b"*1000000000\r\n:1\r\n", &mut at), Ok(None));
        assert!(r.open[0].0.capacity() <= MAX_RESERVED);
        assert_eq!(r.open[0].1, 1000000000 - 1);
    }

    #[test]
    fn integers_read_as_redis_rs_reads_them() {
        for n in [0, 1, -1, 42, i64::MAX, i64::MIN, 1234567890123] {
            let text = format!(":{n}\r\n");
            reads_as(text.as_bytes(), &Value::Int(n));
        }
        for bad in [
            &b":\r\n"[..],
            b":-\r\n",
            b":+1\r\n",
            b":9223372036854775808\r\n",
        ] {
            assert!(read_reply(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn commands_are_written_as_resp_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        command(&mut out, 5);
        arg(&mut out, b"SET");
        arg(&mut out, b"k\r\n");
        arg_int(&mut out, 1234567890);
        arg_int(&mut out, -5);
        arg_u64(&mut out, u64::MAX);
        assert_eq!(
            out,
            b"*5\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$10\r\n1234567890\r\n$2\r\n-5\r\n\
              $20\r\n18446744073709551615\r\n"
        );
        let mut zero = Vec::new();
        arg_int(&mut zero, 0);
        assert_eq!(zero, b"$1\r\n0\r\n");
        let mut max = Vec::new();
        arg_int(&mut max, i64::MIN);
        assert_eq!(max, b"$20\r\n-9223372036854775808\r\n");
    }

    /// A front on a free port for the Redis at `port` that answers `AUTH <user> <password>` as
    /// Redis before 6 does (it has no users: the command has one argument too many) and passes every
    /// other command through, one at a time.
    async fn redis5_front(port: u16) -> (u16, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            loop {
                let (mut client, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut redis = tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .unwrap();
                    let (mut asked, mut answered) = (Vec::new(), Vec::new());
                    loop {
                        let (command, len) = loop {
                            if let Ok(Some(whole)) = read_reply(&asked) {
                                break whole;
                            }
                            if client.read_buf(&mut asked).await.unwrap_or(0) == 0 {
                                return;
                            }
                        };
                        let bytes: Vec<u8> = asked.drain(..len).collect();
                        let auth_with_user = matches!(&command, Value::Array(a)
                            if a.len() == 3
                                && matches!(&a[0], Value::BulkString(b) if b.eq_ignore_ascii_case(b"AUTH")));
                        if auth_with_user {
                            let refusal = b"-ERR wrong number of arguments for 'auth' command\r\n";
                            client.write_all(refusal).await.unwrap();
                            continue;
                        }
                        redis.write_all(&bytes).await.unwrap();
                        let len = loop {
                            if let Ok(Some((_, len))) = read_reply(&answered) {
                                break len;
                            }
                            if redis.read_buf(&mut answered).await.unwrap_or(0) == 0 {
                                return;
                            }
                        };
                        let reply: Vec<u8> = answered.drain(..len).collect();
                        client.write_all(&reply).await.unwrap();
                    }
                });
            }
        });
        (front, task)
    }

    #[tokio::test]
    async fn on_redis_before_6_a_url_with_a_user_logs_in_with_the_password_alone_as_redis_rs_does()
    {
        const PASSWORD: &str = "r5-s3cret";
        let server = crate::test_support::RedisServer::start_with(&["--requirepass", PASSWORD]);
        let (front, task) = redis5_front(server.port).await;
        // Heroku's URLs named a user (`h`) while its Redis had none.
        let url = format!("redis://h:{PASSWORD}@127.0.0.1:{front}/2");
        let client = redis::Client::open(url.as_str()).unwrap();
        // redis-rs's own connection logs in: it tries again without the user.
        let mut shared = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("SET")
            .arg("oxidekiq:lock:r5")
            .arg("t")
            .query_async(&mut shared)
            .await
            .unwrap();
        // So must the lock connection: else the shared connection works and every locked job fails.
        let mut conn = Dialer::of(&client).unwrap().connect().await.unwrap();
        let mut get = Vec::new();
        command(&mut get, 2);
        arg(&mut get, b"GET");
        arg(&mut get, b"oxidekiq:lock:r5");
        // Seen in the same database: the `SELECT` went through after the second `AUTH`.
        assert_eq!(
            conn.exchange(&get, 1).await.unwrap(),
            vec![Value::BulkString(b"t".to_vec())]
        );
        // A wrong password is still refused, and still not shown.
        let wrong = format!("redis://h:not-{PASSWORD}@127.0.0.1:{front}/2");
        let e = Dialer::of(&redis::Client::open(wrong.as_str()).unwrap())
            .unwrap()
            .connect()
            .await
            .expect_err("a wrong password is refused");
        assert!(e.to_string().contains("was refused"), "{e}");
        assert!(!format!("{e} {e:?}").contains(PASSWORD), "{e:?}");
        task.abort();
    }

    #[test]
    fn a_dialer_shows_no_password() {
        let client = redis::Client::open("redis://app:s3cret@127.0.0.1:6390/2").unwrap();
        let d = Dialer::of(&client).unwrap();
        assert_eq!(d.db, 2);
        assert_eq!(d.username.as_deref(), Some("app"));
        assert!(!format!("{d:?}").contains("s3cret"));
        assert_eq!(d.server(), "127.0.0.1:6390");
        let tls = redis::Client::open("rediss://127.0.0.1:6390#insecure").unwrap();
        assert!(Dialer::of(&tls).is_none());
    }
}
