//! The model: Redis's keys of the reliable fetch, two processes and their tasks, and every step of the
//! protocol as one transition. A Lua script or a `MULTI`/`EXEC` is one atomic transition, as Redis runs
//! it; a client round trip is split where other clients' commands can come between (the pipelined reads
//! of the batch script, a reply that is lost after Redis ran the request). Each step's doc names the code
//! it mirrors; `mirrored.rs` keeps the hash of that code.
//!
//! Abstractions (what is coarser than the code, and why it does not hide a loss):
//! - Time is not modelled. A liveness key may expire at any moment (a process killed, or one stalled past
//!   its TTL), and a recovery pass that finds a suspect mark may judge the grace passed or not: every
//!   timing of the real code is among these choices, and more (an over-approximation; the duplicates it
//!   adds are case (b) of docs/guarantees.md, and are excused as such).
//! - An ack that rides on a fetch's pipeline is an ack sent alone: its commands run at some point, and
//!   their reply may be lost (the fetch failed) so that it is sent again, which the model covers.
//! - A request that fails before Redis ran it changes nothing but the process's memory (modelled where
//!   that memory changes: a retry from the start of a sweep, a list recorded as lost).
//! - Finding a dead process's lists is one snapshot: the index of held lists (`oxidekiq:holders`,
//!   `oxidekiq:held:<identity>`), which the script or transaction that fills a batch list fills in the
//!   same step, or the keyspace walk that backs it up (a landing list is indexed at the process's own
//!   recovery passes, so one made since is found by the fleet's next walk: later, never lost; when is not
//!   modelled). The `SET NX` of the lock, the snapshot and the lock's renewal are steps of their own,
//!   and the lock may expire between any two steps. A damaged key (an acks set of the wrong type, whose
//!   batch's ack is then dropped and whose list recovery skips until it is repaired) is not modelled.
//! - Jobs do not come back from the retry set (its poller is not modelled): a job there is in a place.

use std::fmt;

/// A bug from a review, planted back into the model to show the checker finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// The model as the code is.
    None,
    /// `FETCH_LUA` trims its source before the copy, and the copy fails (a `SORT` refused by an ACL, a
    /// batch list key of the wrong type): the jobs trimmed are in no list.
    TrimBeforeCopy,
    /// `Reliable::settle` counts a place again when it is settled twice (a push-back retried whole after
    /// a later batch failed): the batch list is deleted while one of its jobs still runs.
    CountTwice,
    /// The fast path's `LTRIM` is a command of the transaction beside the `SORT`, not in `GUARD_LUA`: an
    /// ACL refusing the `SORT` when `EXEC` runs it does not stop the `LTRIM`, which removes jobs no list
    /// holds.
    TrimOutsideGuard,
}

/// The bounds of one check.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Jobs, all queued at the start (at most 8).
    pub jobs: u8,
    /// Processes (1 or 2).
    pub procs: u8,
    /// Slots (concurrency) of each process.
    pub slots: u8,
    /// Fetches (a fast-path transaction or a batch script) each process makes at most.
    pub fetches: u8,
    /// Lost replies, requests refused (an ACL), copies that fail, sweeps that give up.
    pub faults: bool,
    /// Jobs may fail (their fate then goes to the retry set through `FATE_LUA`).
    pub failures: bool,
    /// How many processes (the first ones) may be killed, stall, be stopped and meet faults; the others
    /// only fetch, run jobs and recover (their faults are the same steps, checked on the first ones).
    pub victims: u8,
    /// How many processes run recovery passes: the last ones (1: the last process recovers the others).
    pub recoverers: u8,
    /// Quiet, stop and its deadline.
    pub stops: bool,
    /// Recoveries of one payload before it goes to the dead set (`MAX_RECOVERIES`).
    pub max_recoveries: u8,
    /// A planted bug.
    pub mutation: Mutation,
}

/// The bounds CI checks exhaustively.
pub const CI: Bounds = Bounds {
    jobs: 2,
    procs: 2,
    slots: 2,
    fetches: 2,
    faults: true,
    failures: true,
    victims: 1,
    recoverers: 1,
    stops: true,
    max_recoveries: 3,
    mutation: Mutation::None,
};

/// The batch number standing for a landing list in a recovery's scan.
const LANDING: u8 = 255;

/// A batch list with its acks set (`oxidekiq:batch:<identity>:<q>:@<n>`, `oxidekiq:acks:...`). Redis
/// holds no empty list and no empty set: a list with no jobs is absent, an acks set with no member too.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct List {
    pub owner: u8,
    pub n: u8,
    /// Head first: the job its source served first.
    pub jobs: Vec<u8>,
    /// Places marked done.
    pub acks: u16,
}

/// Redis's keys for one queue.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Redis {
    /// `queue:<q>`, head first; its tail (`RPOP`'s end) is served first.
    pub queue: Vec<u8>,
    /// Batch lists and acks sets, by (owner, n).
    pub lists: Vec<List>,
    /// `oxidekiq:landing:<identity>:<q>` of each process, head first.
    pub landing: Vec<Vec<u8>>,
    /// `oxidekiq:alive:<identity>`.
    pub alive: Vec<bool>,
    /// The process's mark in `oxidekiq:suspects:batch`.
    pub suspect: Vec<bool>,
    /// `oxidekiq:recovery-lock`: 0 free, else the holder + 1.
    pub lock: u8,
    /// The retry set's jobs (sorted).
    pub retry: Vec<u8>,
    /// The dead set's jobs (sorted).
    pub dead: Vec<u8>,
    /// `oxidekiq:recovered`: recoveries of each payload.
    pub counts: Vec<u8>,
}

/// A process's phase.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Phase {
    Live,
    Quiet,
    Stopping,
    /// Left after its push-back.
    Exited,
    /// `SIGKILL`: its memory is gone.
    Dead,
}

/// A batch the process handed jobs out of (`reliable::Batch`).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Batch {
    pub n: u8,
    pub left: u8,
    /// Places counted done (`Batch::settled`).
    pub settled: u16,
}

/// Where a handed-out job is in its process.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Us {
    /// In the feed, waiting for a processor.
    Handed,
    /// Running (it had effects).
    Running,
    /// Failed; its fate write (`FATE_LUA`) not yet answered.
    Failing,
    /// Its fate is in Redis (or it succeeded): queued for the acker.
    AckQ,
    /// In the acker's batch.
    InAck,
    /// Taken from the feed by the quiet sweep, or fetched after quiet: to be pushed back.
    Swept,
    /// Cancelled at the stop's deadline (its thread abandoned): to be pushed back.
    Cancelled,
}

/// A unit of work.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Unit {
    pub n: u8,
    pub place: u8,
    pub job: u8,
    /// It succeeded (its ack records it done) rather than failed (its fate is in the retry set).
    pub ok: bool,
    pub st: Us,
}

/// The fetch loop.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum FetchSt {
    Idle,
    /// `FETCH_LUA` ran into lists `n` (landing) and `n + 1` (queue); the pipeline's `LRANGE`s are next.
    Script(u8),
    /// The lists were read; the reply is on its way.
    Reply(Vec<(u8, Vec<u8>)>),
}

/// One batch's ack command (`AckCmd`).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct AckCmd {
    pub n: u8,
    pub places: u16,
    /// `DEL` of the list and its acks set, else `SADD` of the places.
    pub del: bool,
}

/// The acker.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum AckSt {
    Idle,
    /// Commands built from the process's table, not yet run.
    Built(Vec<AckCmd>),
    /// Run by Redis; the reply is on its way.
    Sent(Vec<AckCmd>),
}

/// The recovery loop.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum RecSt {
    Idle,
    /// The processes found by the scan, each with its keys (batch numbers; `LANDING`), still to judge.
    Scanned(Vec<(u8, Vec<u8>)>),
}

/// One process.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Proc {
    pub phase: Phase,
    /// The sweep's stage (quiet: 9-13; stop: 20-27) and the batch it is at.
    pub stage: u8,
    pub idx: u8,
    /// The stop's push-back reached Redis whole so far.
    pub ok: bool,
    /// The stop's deadline passed.
    pub deadline: bool,
    /// The fast path may be used (`Reliable::fast`).
    pub fast: bool,
    /// The next batch number (`next_batch`).
    pub next: u8,
    pub fetches: u8,
    /// `Held::open`, by batch number.
    pub open: Vec<Batch>,
    /// `Held::lost`: lists of fetches whose reply never came.
    pub lost: Vec<u8>,
    pub units: Vec<Unit>,
    pub fetch: FetchSt,
    pub ack: AckSt,
    pub rec: RecSt,
    /// Batches found done by a settle that did not delete them (`delete_emptied`).
    pub dels: Vec<u8>,
}

/// What a check knows beyond Redis and the processes, to judge duplicates.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Ghost {
    /// Runs started of each job.
    pub runs: Vec<u8>,
    /// Runs of the job beyond the first that are allowed: one more each time a process holding it
    /// died or was cancelled at the deadline after its run had started, or was presumed dead while
    /// holding it, handed out or running (docs/guarantees.md, "When a job can run twice", (a) and (b)).
    pub excused: Vec<u8>,
    /// The job's last run is recorded done in Redis (its ack marked a place that still held it).
    pub done: Vec<bool>,
}

/// The whole state.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct State {
    pub r: Redis,
    pub p: Vec<Proc>,
    pub g: Ghost,
}

/// One step, for traces.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Act {
    pub what: &'static str,
    pub p: u8,
    pub a: u8,
}

impl fmt::Debug for Act {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "P{} {}", self.p, self.what)?;
        if self.a != 0 {
            write!(f, " ({})", self.a)?;
        }
        Ok(())
    }
}

/// A successor: the step, the state after it, and a property it broke (checked in the step itself).
pub type Next = (Act, State, Option<String>);

fn bit(place: u8) -> u16 {
    1 << place
}

impl Redis {
    fn list(&self, owner: u8, n: u8) -> Option<&List> {
        self.lists.iter().find(|l| l.owner == owner && l.n == n)
    }

    fn list_mut(&mut self, owner: u8, n: u8) -> &mut List {
        if let Some(i) = self.lists.iter().position(|l| l.owner == owner && l.n == n) {
            return &mut self.lists[i];
        }
        self.lists.push(List {
            owner,
            n,
            jobs: Vec::new(),
            acks: 0,
        });
        self.lists.sort_by_key(|l| (l.owner, l.n));
        let i = self
            .lists
            .iter()
            .position(|l| l.owner == owner && l.n == n)
            .unwrap();
        &mut self.lists[i]
    }

    /// Redis holds no empty key.
    fn tidy(&mut self) {
        self.lists.retain(|l| !l.jobs.is_empty() || l.acks != 0);
        self.retry.sort_unstable();
        self.dead.sort_unstable();
    }

    /// `DEL list acks`.
    fn del(&mut self, owner: u8, n: u8) {
        self.lists.retain(|l| !(l.owner == owner && l.n == n));
    }

    /// Copies of job `j` in Redis: queue, landing lists, batch list entries not marked done, the sets.
    pub fn copies(&self, j: u8) -> usize {
        let c = |v: &Vec<u8>| v.iter().filter(|x| **x == j).count();
        c(&self.queue)
            + self.landing.iter().map(c).sum::<usize>()
            + self
                .lists
                .iter()
                .map(|l| {
                    l.jobs
                        .iter()
                        .enumerate()
                        .filter(|(i, x)| **x == j && l.acks & bit(*i as u8) == 0)
                        .count()
                })
                .sum::<usize>()
            + c(&self.retry)
            + c(&self.dead)
    }

    /// Whether entry `place` of list (owner, n) is there: the list reaches it and it is not marked
    /// done (the check of `FATE_LUA` and `PUSH_BACK_LUA`).
    fn entry(&self, owner: u8, n: u8, place: u8) -> Option<u8> {
        let l = self.list(owner, n)?;
        let j = *l.jobs.get(place as usize)?;
        (l.acks & bit(place) == 0).then_some(j)
    }

    /// The `move_back` function of `lua_move_back!` (mod.rs) for list (owner, n) of this release
    /// (`desc`: from its tail), with a recovery limit (`Some`: `ORPHAN_LUA`) or none (`MOVE_BACK_LUA`):
    /// every place not in the acks set goes to the queue's served end (or, recovered too often, to the
    /// dead set), then the list and its acks set are deleted. Returns the places moved.
    fn move_back_list(&mut self, owner: u8, n: u8, limit: Option<u8>) -> Vec<(u8, u8)> {
        let Some(l) = self.list(owner, n).cloned() else {
            self.del(owner, n);
            return Vec::new();
        };
        let mut moved = Vec::new();
        for i in (0..l.jobs.len()).rev() {
            if l.acks & bit(i as u8) != 0 {
                continue;
            }
            let j = l.jobs[i];
            match limit {
                Some(limit) if self.counts[j as usize] + 1 > limit => {
                    self.dead.push(j);
                    self.counts[j as usize] = 0;
                }
                Some(_) => {
                    self.queue.push(j);
                    self.counts[j as usize] += 1;
                }
                None => self.queue.push(j),
            }
            moved.push((i as u8, j));
        }
        self.del(owner, n);
        moved
    }

    /// `move_back` of a landing list (head to tail: it keeps its queue's order).
    fn move_back_landing(&mut self, owner: u8) {
        let jobs = std::mem::take(&mut self.landing[owner as usize]);
        self.queue.extend(jobs);
    }
}

impl State {
    /// Every job queued, every process live.
    pub fn initial(b: &Bounds) -> State {
        let np = b.procs as usize;
        let proc = Proc {
            phase: Phase::Live,
            stage: 0,
            idx: 0,
            ok: true,
            deadline: false,
            fast: true,
            next: 1,
            fetches: 0,
            open: Vec::new(),
            lost: Vec::new(),
            units: Vec::new(),
            fetch: FetchSt::Idle,
            ack: AckSt::Idle,
            rec: RecSt::Idle,
            dels: Vec::new(),
        };
        State {
            r: Redis {
                queue: (0..b.jobs).rev().collect(),
                lists: Vec::new(),
                landing: vec![Vec::new(); np],
                alive: vec![true; np],
                suspect: vec![false; np],
                lock: 0,
                retry: Vec::new(),
                dead: Vec::new(),
                counts: vec![0; b.jobs as usize],
            },
            p: vec![proc; np],
            g: Ghost {
                runs: vec![0; b.jobs as usize],
                excused: vec![0; b.jobs as usize],
                done: vec![false; b.jobs as usize],
            },
        }
    }

    /// The properties every reachable state must have.
    pub fn invariant(&self) -> Option<String> {
        for j in 0..self.g.runs.len() as u8 {
            let c = self.r.copies(j);
            let done = self.g.done[j as usize];
            if c == 0 && !done {
                return Some(format!(
                    "job {j} is in no place: not in the queue, a landing list, a batch list entry not \
                     marked done, the retry or the dead set, and not done"
                ));
            }
            if c > 1 {
                return Some(format!("job {j} is in Redis {c} times"));
            }
            if done && c > 0 {
                return Some(format!("job {j} is done and still in Redis"));
            }
        }
        None
    }

    /// Every step from this state.
    pub fn next(&self, b: &Bounds) -> Vec<Next> {
        let mut out = Vec::new();
        // The environment: a liveness key expires (its process died, or stalled past the TTL); the
        // recovery lock's 30 s pass.
        for p in 0..(b.victims as usize).min(self.p.len()) {
            if self.r.alive[p] {
                let mut s = self.clone();
                s.r.alive[p] = false;
                out.push((act("liveness key expires", p, 0), s, None));
            }
        }
        if self.r.lock != 0 && b.recoverers > 1 {
            let mut s = self.clone();
            s.r.lock = 0;
            out.push((act("recovery lock expires", 0, 0), s, None));
        }
        for p in 0..self.p.len() {
            if matches!(
                self.p[p].phase,
                Phase::Live | Phase::Quiet | Phase::Stopping
            ) {
                let mut pb = *b;
                if p >= b.victims as usize {
                    pb.faults = false;
                    pb.stops = false;
                }
                self.proc_steps(p, &pb, p < b.victims as usize, &mut out);
            }
        }
        for (_, s, _) in &mut out {
            s.r.tidy();
        }
        out
    }

    fn proc_steps(&self, p: usize, b: &Bounds, victim: bool, out: &mut Vec<Next>) {
        let me = &self.p[p];
        // SIGKILL (also: the stop's clean-up cut short by its bound, which leaves the keys as a kill
        // does). Every job whose run started and is not recorded done may run again: case (a).
        if victim {
            let mut s = self.clone();
            for u in &me.units {
                if !matches!(u.st, Us::Handed | Us::Swept) {
                    s.g.excused[u.job as usize] += 1;
                }
            }
            s.p[p] = dead_proc(Phase::Dead);
            out.push((act("killed", p, 0), s, None));
        }
        // `mark_alive` (recovery.rs): `PSETEX` of the liveness key and `HDEL` of its suspect marks.
        if !self.r.alive[p] || self.r.suspect[p] {
            let mut s = self.clone();
            s.r.alive[p] = true;
            s.r.suspect[p] = false;
            out.push((act("beat (mark_alive)", p, 0), s, None));
        }
        if b.stops {
            self.stop_steps(p, b, out);
        }
        if me.phase == Phase::Live {
            self.fetch_steps(p, b, out);
        }
        self.unit_steps(p, b, out);
        self.ack_steps(p, b, out);
        if p + b.recoverers as usize >= self.p.len() {
            self.recovery_steps(p, b, out);
        }
    }

    /// The fetch loop (`manager::fetch_loop`, `Reliable::fetch`).
    fn fetch_steps(&self, p: usize, b: &Bounds, out: &mut Vec<Next>) {
        let me = &self.p[p];
        let pu = p as u8;
        match &me.fetch {
            FetchSt::Idle => {
                let free = b.slots.saturating_sub(me.units.len() as u8);
                if free > 0 && me.fetches < b.fetches {
                    // `Reliable::fetch_fast`: `MULTI; SORT queue BY nosort DESC LIMIT 0 n STORE list;
                    // EVAL GUARD_LUA; LRANGE list 0 -1; EXEC`, one atomic step. With faults, an ACL
                    // refuses the `SORT` when `EXEC` runs it: no copy, so the guard trims nothing (and
                    // the fetcher turns the fast path off for good). A `MULTI` refused (an ACL without
                    // it) runs the same commands one by one, and the fetcher puts the copy back at once
                    // with `MOVE_BACK_LUA` and turns the fast path off: this step, its reply lost, then
                    // the reconcile's step of that list (or, that push-back failing, its next sweep).
                    if me.fast && !self.r.queue.is_empty() {
                        for refused in [false, true] {
                            if refused && !b.faults {
                                continue;
                            }
                            let mut s = self.clone();
                            let n = s.p[p].next;
                            s.p[p].next += 1;
                            s.p[p].fetches += 1;
                            let q = &mut s.r.queue;
                            let c = (free as usize).min(q.len());
                            let copy: Vec<u8> = q[q.len() - c..].iter().rev().copied().collect();
                            let mut read = Vec::new();
                            if !refused {
                                s.r.list_mut(pu, n).jobs = copy;
                            }
                            // GUARD_LUA: trims only the jobs the copy holds.
                            let held = s.r.list(pu, n).map_or(0, |l| l.jobs.len());
                            if held > 0 {
                                let q = &mut s.r.queue;
                                q.truncate(q.len() - held);
                                read = s.r.list(pu, n).unwrap().jobs.clone();
                            } else if b.mutation == Mutation::TrimOutsideGuard {
                                // The `LTRIM` as a command of the transaction.
                                let q = &mut s.r.queue;
                                q.truncate(q.len() - c);
                            }
                            if refused {
                                s.p[p].fast = false;
                            }
                            s.p[p].fetch = FetchSt::Reply(vec![(n, read)]);
                            let what = if refused {
                                "fast fetch, SORT refused at EXEC (ACL)"
                            } else {
                                "fast fetch (MULTI/EXEC with GUARD_LUA)"
                            };
                            out.push((act(what, p, c as u8), s, None));
                        }
                    }
                    // `Reliable::fetch_batch`: `FETCH_LUA` over the landing list, then the queue, each
                    // copied into a batch list of its own, then trimmed. With faults, a source's copy
                    // fails (the `SORT` refused, the batch list key broken): it is left as it was.
                    let has_landing = !self.r.landing[p].is_empty();
                    let faults: &[(bool, bool)] = if !b.faults {
                        &[(false, false)]
                    } else if has_landing {
                        &[(false, false), (true, false), (false, true)]
                    } else {
                        &[(false, false), (false, true)]
                    };
                    for &(fail_landing, fail_queue) in faults {
                        let mut s = self.clone();
                        let n = s.p[p].next;
                        s.p[p].next += 2;
                        s.p[p].fetches += 1;
                        let mut want = free as usize;
                        for (k, fail) in [(0, fail_landing), (1, fail_queue)] {
                            let src = if k == 0 {
                                &mut s.r.landing[p]
                            } else {
                                &mut s.r.queue
                            };
                            let c = want.min(src.len());
                            let copy: Vec<u8> =
                                src[src.len() - c..].iter().rev().copied().collect();
                            if fail {
                                if b.mutation == Mutation::TrimBeforeCopy {
                                    src.truncate(src.len() - c);
                                }
                                continue;
                            }
                            src.truncate(src.len() - c);
                            want -= c;
                            if c > 0 {
                                s.r.list_mut(pu, n + k).jobs = copy;
                            }
                        }
                        s.p[p].fetch = FetchSt::Script(n);
                        let what = match (fail_landing, fail_queue) {
                            (false, false) => "batch fetch (FETCH_LUA)",
                            (true, _) => "batch fetch (FETCH_LUA), the landing list's copy fails",
                            _ => "batch fetch (FETCH_LUA), the queue's copy fails",
                        };
                        out.push((act(what, p, 0), s, None));
                    }
                    // `Reliable::wait_for_work`: `BLMOVE queue landing RIGHT LEFT`, when the queues
                    // looked empty (its reply, lost or not, changes nothing: the landing list is read
                    // by name).
                    if let Some(&j) = self.r.queue.last() {
                        let mut s = self.clone();
                        s.r.queue.pop();
                        s.r.landing[p].insert(0, j);
                        out.push((act("BLMOVE into the landing list", p, j), s, None));
                    }
                }
                // `manager::reconcile` (`Reliable::reconcile_now`): after a failed fetch, the lists
                // of fetches whose reply never came go back, each by `MOVE_BACK_LUA`.
                if let Some(&n) = me.lost.first() {
                    for &lost_reply in replies(b) {
                        let mut s = self.clone();
                        s.r.move_back_list(pu, n, None);
                        if !lost_reply {
                            s.p[p].lost.remove(0);
                        }
                        out.push((
                            act(
                                tag("reconcile: MOVE_BACK_LUA of a lost list", lost_reply),
                                p,
                                n,
                            ),
                            s,
                            None,
                        ));
                    }
                }
            }
            FetchSt::Script(n) => {
                // The `LRANGE`s of the batch script's pipeline: other clients' commands may run
                // between the script and them.
                let mut s = self.clone();
                let read = (0..2)
                    .map(|k| {
                        let jobs =
                            s.r.list(pu, n + k)
                                .map(|l| l.jobs.clone())
                                .unwrap_or_default();
                        (n + k, jobs)
                    })
                    .collect();
                s.p[p].fetch = FetchSt::Reply(read);
                out.push((act("batch fetch's LRANGEs", p, 0), s, None));
                if b.faults {
                    let mut s = self.clone();
                    s.p[p].lost.extend([*n, n + 1]);
                    s.p[p].fetch = FetchSt::Idle;
                    out.push((
                        act("batch fetch's reply lost (Reservation dropped)", p, 0),
                        s,
                        None,
                    ));
                }
            }
            FetchSt::Reply(lists) => {
                // The reply: `Reliable::open` for each list, the units handed out (`hand_out`; after
                // quiet, straight back: swept).
                let mut s = self.clone();
                for (n, jobs) in lists {
                    if jobs.is_empty() {
                        continue;
                    }
                    s.p[p].open.push(Batch {
                        n: *n,
                        left: jobs.len() as u8,
                        settled: 0,
                    });
                    for (place, &job) in jobs.iter().enumerate() {
                        s.p[p].units.push(Unit {
                            n: *n,
                            place: place as u8,
                            job,
                            ok: true,
                            st: if me.phase == Phase::Live {
                                Us::Handed
                            } else {
                                Us::Swept
                            },
                        });
                    }
                }
                s.p[p].fetch = FetchSt::Idle;
                out.push((act("fetch reply: jobs handed out", p, 0), s, None));
                if b.faults {
                    let mut s = self.clone();
                    s.p[p].lost.extend(lists.iter().map(|(n, _)| *n));
                    s.p[p].fetch = FetchSt::Idle;
                    out.push((act("fetch reply lost (Reservation dropped)", p, 0), s, None));
                }
            }
        }
    }

    /// The processors (`process_loop`, the processor's fate writes).
    fn unit_steps(&self, p: usize, b: &Bounds, out: &mut Vec<Next>) {
        let me = &self.p[p];
        let pu = p as u8;
        for (i, u) in me.units.iter().enumerate() {
            match u.st {
                Us::Handed if !me.deadline => {
                    let mut s = self.clone();
                    let j = u.job as usize;
                    let bad = (s.g.runs[j] > s.g.excused[j]).then(|| {
                        format!(
                            "job {} runs a second time, in none of the cases docs/guarantees.md lists",
                            u.job
                        )
                    });
                    s.g.runs[j] += 1;
                    s.p[p].units[i].st = Us::Running;
                    out.push((act("job starts", p, u.job), s, bad));
                }
                Us::Running => {
                    let mut s = self.clone();
                    s.p[p].units[i].st = Us::AckQ;
                    out.push((act("job succeeds", p, u.job), s, None));
                    if b.failures {
                        let mut s = self.clone();
                        s.p[p].units[i].st = Us::Failing;
                        s.p[p].units[i].ok = false;
                        out.push((act("job fails", p, u.job), s, None));
                    }
                }
                Us::Failing => {
                    // `FATE_LUA` (retry.rs): writes the retry set and marks the place done, only if the
                    // entry is still there. A lost reply: written again later, finding the entry gone
                    // (the script then only reads whether its member is there, to report the fate).
                    for &lost_reply in replies(b) {
                        let mut s = self.clone();
                        if let Some(j) = s.r.entry(pu, u.n, u.place) {
                            s.r.retry.push(j);
                            s.r.list_mut(pu, u.n).acks |= bit(u.place);
                        }
                        if !lost_reply {
                            s.p[p].units[i].st = Us::AckQ;
                        }
                        out.push((
                            act(
                                tag("fate write (FATE_LUA, retry set)", lost_reply),
                                p,
                                u.job,
                            ),
                            s,
                            None,
                        ));
                    }
                }
                _ => {}
            }
        }
    }

    /// The acker (`manager::ack_loop`, `Reliable::ack`, `Reliable::settle`, `delete_emptied`).
    fn ack_steps(&self, p: usize, b: &Bounds, out: &mut Vec<Next>) {
        let me = &self.p[p];
        let pu = p as u8;
        match &me.ack {
            AckSt::Idle => {
                if me.units.iter().any(|u| u.st == Us::AckQ) {
                    // `Reliable::ack` builds its commands from the table: `DEL` when the batch's last
                    // places are acked, else `SADD`.
                    let mut s = self.clone();
                    let mut cmds = Vec::new();
                    let mut ns: Vec<u8> = me
                        .units
                        .iter()
                        .filter(|u| u.st == Us::AckQ)
                        .map(|u| u.n)
                        .collect();
                    ns.sort_unstable_by(|a, b| b.cmp(a));
                    ns.dedup();
                    for n in ns {
                        let places = me
                            .units
                            .iter()
                            .filter(|u| u.st == Us::AckQ && u.n == n)
                            .fold(0u16, |m, u| m | bit(u.place));
                        if let Some(bt) = me.open.iter().find(|bt| bt.n == n) {
                            let unsettled = if b.mutation == Mutation::CountTwice {
                                places.count_ones()
                            } else {
                                (places & !bt.settled).count_ones()
                            };
                            cmds.push(AckCmd {
                                n,
                                places,
                                del: bt.left as u32 <= unsettled,
                            });
                        }
                    }
                    for u in &mut s.p[p].units {
                        if u.st == Us::AckQ {
                            u.st = Us::InAck;
                        }
                    }
                    s.p[p].ack = AckSt::Built(cmds);
                    out.push((act("acker builds its commands", p, 0), s, None));
                }
            }
            AckSt::Built(cmds) => {
                // The ack's pipeline, run by Redis (alone or riding on a fetch's).
                let mut s = self.clone();
                let mut bad = None;
                for c in cmds {
                    for u in me.units.iter().filter(|u| u.st == Us::InAck && u.n == c.n) {
                        if u.ok && s.r.entry(pu, c.n, u.place).is_some() {
                            s.g.done[u.job as usize] = true;
                        }
                    }
                    if c.del {
                        bad = bad.or_else(|| deletes_unacked(&s.r, pu, c.n, c.places));
                        s.r.del(pu, c.n);
                    } else {
                        s.r.list_mut(pu, c.n).acks |= c.places;
                    }
                }
                s.p[p].ack = AckSt::Sent(cmds.clone());
                out.push((act("ack runs (DEL or SADD)", p, cmds.len() as u8), s, bad));
                if b.faults {
                    // Not run (the connection dropped first): sent again later.
                    let mut s = self.clone();
                    back_to_ackq(&mut s.p[p]);
                    out.push((act("ack not sent (outage)", p, 0), s, None));
                }
            }
            AckSt::Sent(cmds) => {
                // The reply: `settle`, counted only now; an emptied batch not deleted by this ack
                // goes to `delete_emptied`.
                let mut s = self.clone();
                for c in cmds {
                    if settle(&mut s.p[p], c.n, c.places, b) && !c.del {
                        s.p[p].dels.push(c.n);
                    }
                }
                s.p[p].units.retain(|u| u.st != Us::InAck);
                s.p[p].ack = AckSt::Idle;
                out.push((act("ack answered (settle)", p, 0), s, None));
                if b.faults {
                    let mut s = self.clone();
                    back_to_ackq(&mut s.p[p]);
                    out.push((act("ack reply lost: retried", p, 0), s, None));
                }
            }
        }
        if let Some(&n) = me.dels.first() {
            // `delete_emptied`: `DEL list acks`. Its failure fails the ack, which is retried with
            // nothing left to delete: the list (every place marked done) stays for a sweep.
            let mut s = self.clone();
            let bad = deletes_unacked(&s.r, pu, n, 0);
            s.r.del(pu, n);
            s.p[p].dels.remove(0);
            out.push((act("delete_emptied DEL", p, n), s, bad));
            if b.faults {
                let mut s = self.clone();
                s.p[p].dels.remove(0);
                out.push((act("delete_emptied lost", p, n), s, None));
            }
        }
    }

    /// Quiet (`quiet_sweep`), stop (`Manager::push_back`) and its deadline.
    fn stop_steps(&self, p: usize, b: &Bounds, out: &mut Vec<Next>) {
        let me = &self.p[p];
        let pu = p as u8;
        match (me.phase, me.stage) {
            (Phase::Live, _) => {
                let mut s = self.clone();
                s.p[p].phase = Phase::Quiet;
                s.p[p].stage = 9;
                out.push((act("told to quiet", p, 0), s, None));
            }
            (Phase::Quiet, 9) if me.fetch == FetchSt::Idle => {
                // Every fetch loop ended: the units waiting in the feed are taken.
                let mut s = self.clone();
                for u in &mut s.p[p].units {
                    if u.st == Us::Handed {
                        u.st = Us::Swept;
                    }
                }
                s.p[p].stage = 10;
                out.push((act("quiet sweep takes the feed", p, 0), s, None));
            }
            (Phase::Quiet, 10..=12) => {
                // `with_retries(requeue_leftovers(false); bulk_requeue(waiting))`: a failure anywhere
                // starts it again from the top.
                self.sweep_step(p, b, out, 10, 13, Us::Swept, true);
            }
            (Phase::Quiet, 13) => {
                let mut s = self.clone();
                s.p[p].phase = Phase::Stopping;
                s.p[p].stage = 20;
                out.push((act("told to stop", p, 0), s, None));
            }
            (Phase::Stopping, _) => {
                if !me.deadline {
                    // The `-t` deadline: running jobs are cancelled, their threads abandoned: case (a).
                    let mut s = self.clone();
                    s.p[p].deadline = true;
                    for u in &mut s.p[p].units {
                        if matches!(u.st, Us::Running | Us::Failing) {
                            u.st = Us::Cancelled;
                            s.g.excused[u.job as usize] += 1;
                        }
                    }
                    out.push((act("stop deadline: running jobs cancelled", p, 0), s, None));
                }
                match me.stage {
                    20 => {
                        // `jobs_done`, then the acker drained.
                        let busy = me.units.iter().any(|u| {
                            matches!(u.st, Us::Running | Us::Failing | Us::AckQ | Us::InAck)
                        });
                        if !busy && me.ack == AckSt::Idle && me.dels.is_empty() {
                            let mut s = self.clone();
                            s.p[p].stage = 21;
                            out.push((act("jobs ended, acks flushed", p, 0), s, None));
                        }
                    }
                    21..=22 => self.sweep_step(p, b, out, 21, 23, Us::Swept, false),
                    23 => self.sweep_step(p, b, out, 23, 24, Us::Swept, false),
                    24..=26 => self.sweep_step(p, b, out, 24, 27, Us::Swept, false),
                    27 => {
                        // `Launcher::push_back`: all of it reached Redis: `DEL` of the liveness key.
                        let mut s = self.clone();
                        if me.ok {
                            s.r.alive[p] = false;
                        }
                        s.p[p] = dead_proc(Phase::Exited);
                        out.push((act("exits", p, me.ok as u8), s, None));
                    }
                    _ => {}
                }
            }
            _ => {}
        }
        let _ = pu;
    }

    /// One step of a sweep that runs from stage `from` to `to` (quiet: 10 landing, 11 lost lists, 12
    /// units; stop: 21 landing, 22 lost lists; 23 unfinished units; 24 landing, 25 lost lists, 26 every
    /// open batch). A failure (the request not run, or its reply lost) starts the sweep again at `from`,
    /// or (the stop's `with_retries` giving up) goes on to `to` with the push-back not whole.
    #[allow(clippy::too_many_arguments)]
    fn sweep_step(
        &self,
        p: usize,
        b: &Bounds,
        out: &mut Vec<Next>,
        from: u8,
        to: u8,
        _swept: Us,
        quiet: bool,
    ) {
        let me = &self.p[p];
        let pu = p as u8;
        let stage = me.stage;
        let kind = match (quiet, stage) {
            (true, 10) | (false, 21) | (false, 24) => 0,
            (true, 11) | (false, 22) | (false, 25) => 1,
            (true, 12) | (false, 23) => 2,
            _ => 3,
        };
        // The units a push-back stage moves: quiet, those taken from the feed; stop, every unfinished
        // one. By batch, the newest first.
        let pushed = |u: &Unit| {
            if quiet {
                u.st == Us::Swept
            } else {
                matches!(u.st, Us::Handed | Us::Swept | Us::Cancelled)
            }
        };
        let mut batches: Vec<u8> = me.units.iter().filter(|u| pushed(u)).map(|u| u.n).collect();
        batches.sort_unstable_by(|a, b| b.cmp(a));
        batches.dedup();
        let advance = |s: &mut State| {
            let m = &mut s.p[p];
            m.stage += 1;
            m.idx = 0;
        };
        // (what it does, whether it is done with its stage after success)
        let mut s = self.clone();
        let what: &'static str;
        match kind {
            0 => {
                // `MOVE_BACK_LUA` of the landing list.
                s.r.move_back_landing(pu);
                what = "sweep: MOVE_BACK_LUA of the landing list";
                advance(&mut s);
            }
            1 => match me.lost.first() {
                // `reconcile_now`: `MOVE_BACK_LUA` of each lost list.
                Some(&n) => {
                    s.r.move_back_list(pu, n, None);
                    s.p[p].lost.remove(0);
                    what = "sweep: MOVE_BACK_LUA of a lost list";
                }
                None => {
                    what = "sweep: no lost list";
                    advance(&mut s);
                }
            },
            2 => match batches.get(me.idx as usize) {
                // `Reliable::requeue`: `PUSH_BACK_LUA` per batch, then `settle`.
                Some(&n) => {
                    let places: Vec<u8> = {
                        let mut v: Vec<u8> = me
                            .units
                            .iter()
                            .filter(|u| pushed(u) && u.n == n)
                            .map(|u| u.place)
                            .collect();
                        v.sort_unstable_by(|a, b| b.cmp(a));
                        v
                    };
                    let mut mask = 0;
                    for &pl in &places {
                        mask |= bit(pl);
                        if let Some(j) = s.r.entry(pu, n, pl) {
                            s.r.queue.push(j);
                            s.r.list_mut(pu, n).acks |= bit(pl);
                        }
                    }
                    if settle(&mut s.p[p], n, mask, b) {
                        s.p[p].dels.push(n);
                    }
                    s.p[p].idx += 1;
                    what = "sweep: PUSH_BACK_LUA of a batch's units";
                }
                None => {
                    s.p[p].units.retain(|u| !pushed(u));
                    what = "sweep: units pushed back";
                    advance(&mut s);
                }
            },
            _ => {
                // `leftovers(true)`: every open batch, newest first, by `MOVE_BACK_LUA`; one that
                // fails is kept as lost.
                let mut ns: Vec<u8> = me.open.iter().map(|bt| bt.n).collect();
                ns.sort_unstable();
                match ns.last() {
                    Some(&n) => {
                        s.r.move_back_list(pu, n, None);
                        s.p[p].open.retain(|bt| bt.n != n);
                        what = "sweep: MOVE_BACK_LUA of an open batch";
                    }
                    None => {
                        what = "sweep: every open batch moved";
                        advance(&mut s);
                    }
                }
            }
        }
        let stage_done = s.p[p].stage != stage && s.p[p].stage == to;
        let _ = stage_done;
        out.push((act(what, p, stage), s, None));
        if !b.faults
            || matches!(
                what,
                "sweep: no lost list"
                    | "sweep: units pushed back"
                    | "sweep: every open batch moved"
            )
        {
            return;
        }
        // The reply lost after Redis ran it: the sweep starts again (the settle did not happen).
        let mut s = self.clone();
        match kind {
            0 => s.r.move_back_landing(pu),
            1 => {
                let n = me.lost[0];
                s.r.move_back_list(pu, n, None);
            }
            2 => {
                let n = batches[me.idx as usize];
                for u in me.units.iter().filter(|u| pushed(u) && u.n == n) {
                    if let Some(j) = s.r.entry(pu, n, u.place) {
                        s.r.queue.push(j);
                        s.r.list_mut(pu, n).acks |= bit(u.place);
                    }
                }
            }
            _ => {
                let n = *me
                    .open
                    .iter()
                    .map(|bt| bt.n)
                    .collect::<Vec<_>>()
                    .iter()
                    .max()
                    .unwrap();
                s.r.move_back_list(pu, n, None);
                s.p[p].open.retain(|bt| bt.n != n);
                s.p[p].lost.push(n);
            }
        }
        let retry = |s: &mut State| {
            s.p[p].stage = from;
            s.p[p].idx = 0;
        };
        let mut s2 = s.clone();
        retry(&mut s);
        out.push((act("sweep step's reply lost: retried", p, stage), s, None));
        if !quiet {
            // `with_retries` gives up: the next stage, the push-back not whole.
            s2.p[p].stage = to;
            s2.p[p].idx = 0;
            s2.p[p].ok = false;
            out.push((act("sweep step's reply lost: given up", p, stage), s2, None));
        }
        // Not run at all (the connection dropped first): started again.
        let mut s = self.clone();
        retry(&mut s);
        if s != *self {
            out.push((act("sweep step not sent: retried", p, stage), s, None));
        }
    }

    /// The recovery loop (`recovery_loop`, `recover_orphans`, `recover_locked`, `ORPHAN_LUA`).
    fn recovery_steps(&self, p: usize, b: &Bounds, out: &mut Vec<Next>) {
        let me = &self.p[p];
        let pu = p as u8;
        match &me.rec {
            RecSt::Idle => {
                // `SET oxidekiq:recovery-lock <identity> NX PX 30000` (the loop ends at quiet), then
                // `held_by_others` (SCAN) and `lock::extend`. One step: the lock alone changes no
                // key the other steps read, so taking it a moment later changes no outcome.
                if me.phase != Phase::Live || self.r.lock != 0 {
                    return;
                }
                let mut s = self.clone();
                if b.recoverers > 1 {
                    s.r.lock = pu + 1;
                }
                let mut targets = Vec::new();
                for t in 0..self.p.len() as u8 {
                    if t == pu {
                        continue;
                    }
                    let mut keys: Vec<u8> = self
                        .r
                        .lists
                        .iter()
                        .filter(|l| l.owner == t && !l.jobs.is_empty())
                        .map(|l| l.n)
                        .collect();
                    keys.sort_unstable_by(|a, b| b.cmp(a));
                    if !self.r.landing[t as usize].is_empty() {
                        keys.push(LANDING);
                    }
                    if !keys.is_empty() {
                        targets.push((t, keys));
                    }
                }
                if targets.is_empty() {
                    // Nothing held by another process: the pass ends, the lock released.
                    return;
                }
                s.p[p].rec = RecSt::Scanned(targets);
                out.push((act("recovery: lock taken, scan", p, 0), s, None));
            }
            RecSt::Scanned(targets) => {
                let (t, keys) = &targets[0];
                let tu = *t as usize;
                let finish = |s: &mut State| {
                    let RecSt::Scanned(ts) = &mut s.p[p].rec else {
                        unreachable!()
                    };
                    ts.remove(0);
                    if ts.is_empty() {
                        s.p[p].rec = RecSt::Idle;
                        if s.r.lock == pu + 1 {
                            s.r.lock = 0;
                        }
                    }
                };
                // ORPHAN_LUA, one atomic step.
                let mut s = self.clone();
                if self.r.alive[tu] {
                    s.r.suspect[tu] = false;
                    finish(&mut s);
                    out.push((act("ORPHAN_LUA: alive", p, *t), s, None));
                    return;
                }
                if !self.r.suspect[tu] {
                    s.r.suspect[tu] = true;
                    finish(&mut s);
                    out.push((act("ORPHAN_LUA: marked suspect", p, *t), s, None));
                    return;
                }
                // Within the grace.
                let mut s0 = s.clone();
                finish(&mut s0);
                out.push((
                    act("ORPHAN_LUA: suspect, within the grace", p, *t),
                    s0,
                    None,
                ));
                // Past it: every key passed goes back.
                let holder = &self.p[tu];
                let live = !matches!(holder.phase, Phase::Dead | Phase::Exited);
                for &n in keys {
                    if n == LANDING {
                        s.r.move_back_landing(*t);
                        continue;
                    }
                    for (place, j) in s.r.move_back_list(*t, n, Some(b.max_recoveries)) {
                        // Case (b): a live process presumed dead while holding the job (handed out,
                        // running, or in a fetch's reply on its way).
                        let in_reply = matches!(&holder.fetch, FetchSt::Reply(ls)
                            if ls.iter().any(|(m, jobs)| *m == n && jobs.len() > place as usize));
                        if live
                            && (in_reply
                                || holder.units.iter().any(|u| u.n == n && u.place == place))
                        {
                            s.g.excused[j as usize] += 1;
                        }
                    }
                }
                s.r.suspect[tu] = false;
                let bad = keys
                    .iter()
                    .find(|&&n| n != LANDING && s.r.list(*t, n).is_some_and(|l| !l.jobs.is_empty()))
                    .map(|n| format!("recovery left P{t}'s batch list {n} behind"));
                finish(&mut s);
                out.push((
                    act("ORPHAN_LUA: past the grace, keys pushed back", p, *t),
                    s,
                    bad,
                ));
            }
        }
    }
}

fn act(what: &'static str, p: usize, a: u8) -> Act {
    Act {
        what,
        p: p as u8,
        a,
    }
}

/// A reply received (false) or lost after Redis ran the request (true, with faults).
fn replies(b: &Bounds) -> &'static [bool] {
    if b.faults { &[false, true] } else { &[false] }
}

fn tag(what: &'static str, lost: bool) -> &'static str {
    if lost {
        match what {
            "reconcile: MOVE_BACK_LUA of a lost list" => "reconcile: MOVE_BACK_LUA ran, reply lost",
            "fate write (FATE_LUA, retry set)" => "fate write ran, reply lost",
            _ => "reply lost",
        }
    } else {
        what
    }
}

/// A process after `SIGKILL` or its exit: nothing in memory.
fn dead_proc(phase: Phase) -> Proc {
    Proc {
        phase,
        stage: 0,
        idx: 0,
        ok: true,
        deadline: false,
        fast: false,
        next: 0,
        fetches: 0,
        open: Vec::new(),
        lost: Vec::new(),
        units: Vec::new(),
        fetch: FetchSt::Idle,
        ack: AckSt::Idle,
        rec: RecSt::Idle,
        dels: Vec::new(),
    }
}

fn back_to_ackq(me: &mut Proc) {
    for u in &mut me.units {
        if u.st == Us::InAck {
            u.st = Us::AckQ;
        }
    }
    me.ack = AckSt::Idle;
}

/// `Reliable::settle`: counts `places` of batch `n` done, each once (the mutation: again); true when
/// the batch is emptied (forgotten; its keys to delete).
fn settle(me: &mut Proc, n: u8, places: u16, b: &Bounds) -> bool {
    let Some(i) = me.open.iter().position(|bt| bt.n == n) else {
        return false;
    };
    let bt = &mut me.open[i];
    for pl in 0..16 {
        if places & bit(pl) == 0 {
            continue;
        }
        if bt.settled & bit(pl) == 0 || b.mutation == Mutation::CountTwice {
            bt.settled |= bit(pl);
            bt.left = bt.left.saturating_sub(1);
        }
    }
    if bt.left > 0 {
        return false;
    }
    me.open.remove(i);
    true
}

/// A `DEL` of list (owner, n) with `acking` places acked by the same command: every place must be
/// marked done (the property "a batch list is deleted only when every place is acked").
fn deletes_unacked(r: &Redis, owner: u8, n: u8, acking: u16) -> Option<String> {
    let l = r.list(owner, n)?;
    let done = l.acks | acking;
    (0..l.jobs.len() as u8)
        .find(|pl| done & bit(*pl) == 0)
        .map(|pl| {
            format!(
                "P{owner}'s batch list {n} is deleted while its place {pl} (job {}) is not acked",
                l.jobs[pl as usize]
            )
        })
}
