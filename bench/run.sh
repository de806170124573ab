#!/usr/bin/env bash
# The benchmark: oxidekiq side by side with Ruby Sidekiq 6.4 and rusty-sidekiq 0.15 on one private Redis.
#
#   bash bench/run.sh                                    # everything: 100 000 jobs, 3 rounds (~25 min on 2 CPUs)
#   JOBS=10000 ROUNDS=1 SCENARIOS=drain,io bash bench/run.sh   # a quick look
#
# Scenarios (SCENARIOS, comma-separated; default all): drain, defaults, activejob, io, latency, latency_ratio,
# locks, schedule, rss, scaleout, quiet, payloads. Sizes: JOBS (100000), ROUNDS (3), IO_JOBS (JOBS/5), LOCK_JOBS
# and SCHEDULE_JOBS (JOBS), SCALE_PROCS (1,2,4 oxidekiq processes) and SCALE_CONC (200 each), LATENCY_RATE (5000),
# LATENCY_SECS (10), LATENCY_RATIO_RATE (1000), LATENCY_RUNS (5), LATENCY_OXIDEKIQ_CONC (200), LATENCY_RUBY_CONC (25),
# DEFAULTS_JOBS (JOBS; Ruby at most DEFAULTS_RUBY_JOBS, 30000), OXIDEKIQ_LOG_OFF (oxidekiq's "logging off"
# arguments; default --log-level warn if its --help lists it), PAYLOAD_SIZES (0.2,1,4,16 KB), PAYLOAD_JOBS
# (min(JOBS, 100000)), PAYLOAD_CONC (200), RUN_TIMEOUT (600 s per drain); SYSTEMS (oxidekiq,ruby,rusty) limits who runs.
# SKIP_SETUP=1 skips the package check, SKIP_BUILD=1 the builds.
# Prints jobs/s and CPU µs per job (the drainer's and Redis's) per system, the same-concurrency and
# best-against-best ratios, the default command lines (logging on and off), the latency ratio run by run, the
# scale-out table, the fleet's ceiling, the quiet check, and at the end issue 42's targets 4-7 (figure,
# threshold, met or not); writes bench/results/results.md, results.json and drain.png. Method: bench/README.md.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

step() { printf '\n==> %s\n' "$*" >&2; }

if [ -z "${SKIP_SETUP:-}" ]; then
  step "checking packages"
  # The locks scenario's Ruby peer loads sidekiq-unique-jobs from source, which needs thor and concurrent-ruby.
  extra="gnuplot-nox"
  [ -n "${UNIQUE_JOBS_LIB:-}" ] && extra="$extra ruby-thor ruby-concurrent"
  EXTRA_PACKAGES="${EXTRA_PACKAGES:-} $extra" bash scripts/setup.sh >&2
fi

if [ -z "${SKIP_BUILD:-}" ]; then
  step "building oxidekiq (release)"
  cargo build --release -p oxidekiq-workers >&2
  step "building rusty-sidekiq-bench (release)"
  cargo build --release --manifest-path bench/rusty/Cargo.toml >&2
fi
export OXIDEKIQ_BIN="${OXIDEKIQ_BIN:-$root/target/release/oxidekiq}"
export RUSTY_BIN="$root/bench/rusty/target/release/rusty-sidekiq-bench"
needed=("$OXIDEKIQ_BIN")
# rusty-sidekiq's binary only when it runs (SYSTEMS=oxidekiq with SKIP_BUILD=1 needs no build of it).
systems="${SYSTEMS:-oxidekiq,ruby,rusty}"
case ",${systems// /}," in *,rusty,*) needed+=("$RUSTY_BIN") ;; esac
for bin in "${needed[@]}"; do
  [ -x "$bin" ] || { echo "error: $bin is missing (run without SKIP_BUILD)" >&2; exit 1; }
done

# A thousand concurrent jobs means a thousand-odd Redis connections for the peers that hold one per worker.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

work="$(mktemp -d "${TMPDIR:-/tmp}/oxidekiq-bench.XXXXXX")"
export WORK_DIR="$work"
redis_pid=""
cleanup() {
  if [ -n "$redis_pid" ]; then
    kill "$redis_pid" 2>/dev/null || true
    wait "$redis_pid" 2>/dev/null || true
  fi
  echo "bench: logs of the last round of each run in $work" >&2
}
trap cleanup EXIT

# A free port that is not 6379 (the kernel picks it).
port=6379
while [ "$port" = 6379 ]; do
  port="$(ruby -rsocket -e 's = TCPServer.new("127.0.0.1", 0); puts s.addr[1]; s.close')"
done

step "starting redis-server on 127.0.0.1:$port (no persistence)"
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
  --dir "$work" --logfile "$work/redis.log" &
redis_pid=$!
for _ in $(seq 1 200); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.05
done
redis-cli -p "$port" ping >/dev/null

export REDIS_URL="redis://127.0.0.1:$port/0"
export BENCH_COMMAND="${BENCH_COMMAND:-$(env | grep -E '^(JOBS|ROUNDS|SCENARIOS|SYSTEMS|IO_JOBS|LOCK_JOBS|SCHEDULE_JOBS|SCALE_PROCS|SCALE_CONC|LATENCY_RATE|LATENCY_SECS|LATENCY_RATIO_RATE|LATENCY_RUNS|LATENCY_OXIDEKIQ_CONC|LATENCY_RUBY_CONC|DEFAULTS_JOBS|DEFAULTS_RUBY_JOBS|OXIDEKIQ_LOG_OFF|OXIDEKIQ_THREADS|PAYLOAD_SIZES|PAYLOAD_JOBS|PAYLOAD_CONC)=' | sort | tr '\n' ' ')bash bench/run.sh}"
step "running the scenarios (progress on stderr, table on stdout)"
ruby "$root/bench/driver.rb"
