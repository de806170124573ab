//! A breadth-first explorer of every state the model reaches, with a visited set of 128-bit state hashes
//! (SipHash-1-3 and FNV-1a of each state: a collision, which would skip a state, has a probability
//! of about n²/2¹²⁹ if they are independent, under 10⁻²⁵ at the bounds CI checks). Breadth first, so a violation is
//! reported with a shortest trace, rebuilt from each state's parent and step.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use super::model::{Act, Bounds, State};

/// What a check found.
pub struct Outcome {
    /// Distinct states reached.
    pub states: usize,
    /// Steps taken (transitions explored).
    pub transitions: usize,
    /// The longest shortest path from the start.
    pub depth: usize,
    pub elapsed: Duration,
    /// The first violation: what broke, the steps from the start, and the state it broke in.
    pub violation: Option<(String, Vec<Act>, State)>,
}

impl Outcome {
    /// The violation's trace, one step a line.
    pub fn trace(&self) -> String {
        let Some((what, steps, state)) = &self.violation else {
            return "no violation".into();
        };
        let mut s = format!("violation: {what}\ntrace ({} steps):\n", steps.len());
        for (i, a) in steps.iter().enumerate() {
            s.push_str(&format!("  {:>2}. {a:?}\n", i + 1));
        }
        s.push_str(&format!("state after it:\n  redis: {:?}\n", state.r));
        for (i, p) in state.p.iter().enumerate() {
            s.push_str(&format!("  P{i}: {p:?}\n"));
        }
        s.push_str(&format!("  ghost: {:?}\n", state.g));
        s
    }
}

/// Two independent 64-bit hashes of one pass over the state: SipHash-1-3 and FNV-1a.
struct Twin(std::collections::hash_map::DefaultHasher, u64);

impl Hasher for Twin {
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
        for b in bytes {
            self.1 = (self.1 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// The visited set's own hasher: its keys are hashes already.
#[derive(Default)]
struct Same(u64);

impl Hasher for Same {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes.iter().take(8) {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }

    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type Seen = HashMap<u128, (u128, Act), std::hash::BuildHasherDefault<Same>>;

fn key(s: &State) -> u128 {
    let mut h = Twin(Default::default(), 0xcbf2_9ce4_8422_2325);
    s.hash(&mut h);
    ((h.0.finish() as u128) << 64) | h.1 as u128
}

/// Explores every state reachable under `bounds`, checking [`State::invariant`] in each and the
/// properties the steps check themselves; stops at the first violation or past `max_states`.
pub fn check(bounds: &Bounds, max_states: usize) -> Outcome {
    let start = Instant::now();
    let init = State::initial(bounds);
    // state → (parent, the step from it); the start has itself as parent.
    let mut seen: Seen = Seen::default();
    let k0 = key(&init);
    let none = Act {
        what: "start",
        p: 0,
        a: 0,
    };
    seen.insert(k0, (k0, none));
    let mut queue: VecDeque<(State, u128, usize)> = VecDeque::new();
    let mut out = Outcome {
        states: 1,
        transitions: 0,
        depth: 0,
        elapsed: Duration::ZERO,
        violation: None,
    };
    let trace = |seen: &Seen, mut k: u128| {
        let mut steps = Vec::new();
        while k != k0 {
            let (parent, a) = seen[&k];
            steps.push(a);
            k = parent;
        }
        steps.reverse();
        steps
    };
    if let Some(v) = init.invariant() {
        out.violation = Some((v, Vec::new(), init));
        return out;
    }
    queue.push_back((init, k0, 0));
    let progress = std::env::var_os("FETCH_MODEL_PROGRESS").is_some();
    while let Some((s, k, depth)) = queue.pop_front() {
        if progress && depth > out.depth {
            eprintln!(
                "depth {depth}: {} states, {} in the frontier, {:.1?}",
                seen.len(),
                queue.len() + 1,
                start.elapsed()
            );
        }
        out.depth = out.depth.max(depth);
        for (a, next, broke) in s.next(bounds) {
            out.transitions += 1;
            let nk = key(&next);
            if let Some(what) = broke {
                let mut steps = trace(&seen, k);
                steps.push(a);
                out.violation = Some((what, steps, next));
                out.states = seen.len();
                out.elapsed = start.elapsed();
                return out;
            }
            if seen.contains_key(&nk) {
                continue;
            }
            seen.insert(nk, (k, a));
            if let Some(what) = next.invariant() {
                out.violation = Some((what, trace(&seen, nk), next));
                out.states = seen.len();
                out.elapsed = start.elapsed();
                return out;
            }
            queue.push_back((next, nk, depth + 1));
        }
        if seen.len() > max_states {
            break;
        }
    }
    out.states = seen.len();
    out.elapsed = start.elapsed();
    out
}
