//! Connections of one part's own ([`RespConn`]s made by a [`Dialer`]) for pipelines that several of
//! its tasks send at once: the reliable fetch's loops (up to four a capsule) send their fetch
//! pipelines here rather than on the shared connection, and their replies (every job of a batch) are
//! read by [`super::resp::Reader`], not by redis-rs's parser (bench/results/instructions.md,
//! session 3).
//!
//! # Why a pool
//!
//! A [`RespConn`] carries one exchange at a time. Each exchange takes an idle connection, or makes
//! one, and gives it back only once its replies were all read: a pool holds at most as many
//! connections as exchanges ran at once, and a connection on which anything went wrong (a write or a
//! read failed, no reply within the response timeout, a reply not RESP, the exchange dropped midway)
//! is never used again, so a late reply is never read as another exchange's. An idle connection the
//! server closed (Redis's `timeout`, `CLIENT KILL`, a restart) is found closed before anything is
//! written on it ([`RespConn::is_open`]) and replaced.
//!
//! # What Redis sees
//!
//! The bytes redis-rs would write for the same pipeline ([`redis::Pipeline::get_packed_pipeline`];
//! the fetch's fast path packs its own, the same bytes: its tests compare them), after an `AUTH` and a `SELECT` when the connection is made. The replies come back as the shared
//! connection gives them to a pipeline with `ignore_errors` ([`RespPool::query_each`]), and each failure
//! of the connection is counted for `/metrics` as the shared connection counts its own
//! ([`crate::prom::count_error`]).

use std::sync::Mutex;

use redis::{RedisResult, Value};

use super::resp::{Dialer, RespConn};
use crate::error::Error;

/// The connections of one part, made by its dialer; see the module documentation.
#[derive(Debug)]
pub(crate) struct RespPool {
    /// How a connection is made (plain TCP or a Unix socket, the URL's credentials and database).
    dialer: Dialer,
    /// Connections between exchanges, each with every reply it was asked for read.
    idle: Mutex<Vec<RespConn>>,
}

impl RespPool {
    /// A pool of connections made by `dialer` (none made yet).
    pub(crate) fn new(dialer: Dialer) -> RespPool {
        RespPool {
            dialer,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Sends `pipe` and reads one reply per command, each as a pipeline with `ignore_errors` gives it
    /// on the shared connection: `Err` for an error reply, the other replies (an `EXEC`'s array with
    /// its commands' errors inside) as values. The outer `Err` is the connection's failure (counted
    /// for `/metrics`): nothing says which commands Redis ran.
    pub(crate) async fn query_each(
        &self,
        pipe: &redis::Pipeline,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        self.query_each_packed(&pipe.get_packed_pipeline(), pipe.len())
            .await
    }

    /// [`RespPool::query_each`] for commands packed by the caller: `commands` as RESP, `replies` of
    /// them (a fetch builds its bytes itself, its fixed parts once: bench/results/instructions.md,
    /// session 3).
    pub(crate) async fn query_each_packed(
        &self,
        commands: &[u8],
        replies: usize,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        let replies = self.query_packed(commands, replies).await?;
        Ok(replies
            .into_iter()
            .map(|v| match v {
                Value::ServerError(e) => Err(e.into()),
                v => Ok(v),
            })
            .collect())
    }

    /// Sends `commands` (RESP, `replies` commands) and reads one reply per command, error replies as
    /// values.
    async fn query_packed(&self, commands: &[u8], replies: usize) -> RedisResult<Vec<Value>> {
        let got = self.query_now(commands, replies).await;
        if let Err(e) = &got {
            crate::prom::count_error(e);
        }
        got
    }

    async fn query_now(&self, commands: &[u8], replies: usize) -> RedisResult<Vec<Value>> {
        let mut conn = match self.take_open() {
            Some(c) => c,
            None => self.dialer.connect().await.map_err(redis_error)?,
        };
        // The connection is this exchange's alone until it goes back: a failure, or this future
        // dropped midway, drops it with whatever is still on its wire.
        let got = conn
            .exchange(commands, replies)
            .await
            .map_err(redis_error)?;
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(conn);
        }
        Ok(got)
    }

    /// An idle connection the server has not closed; the closed ones are dropped.
    fn take_open(&self) -> Option<RespConn> {
        let mut idle = self.idle.lock().ok()?;
        while let Some(c) = idle.pop() {
            if c.is_open() {
                return Some(c);
            }
        }
        None
    }

    /// How many connections are idle now (for tests).
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.idle.lock().map_or(0, |i| i.len())
    }
}

/// A [`RespConn`] error as the Redis error it carries (every one of them is one).
fn redis_error(e: Error) -> redis::RedisError {
    match e {
        Error::Redis(e) => e,
        other => redis::RedisError::from((
            redis::ErrorKind::Client,
            "own connection",
            other.to_string(),
        )),
    }
}
