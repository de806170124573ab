#!/usr/bin/env bash
# A flame graph of one warm oxidekiq drain, as bench/run.sh times it: JOBS jobs enqueued by Ruby Sidekiq's
# client and parked, oxidekiq started and warmed up with one probe job, then `perf record` attached to it
# while the queue is released and drained.
#
#   bash bench/flame.sh                 # no-op drain, 100 000 NoopJob, -c 200
#   KIND=activejob bash bench/flame.sh  # the ActiveJob no-op drain
#   THREADS=cpus bash bench/flame.sh    # oxidekiq's default runtime (a thread per CPU less one); default 1, as
#                                       # bench/run.sh runs it (OXIDEKIQ_THREADS there)
#
# Needs perf (Debian: linux-perf) and inferno (`cargo install inferno`: inferno-collapse-perf,
# inferno-flamegraph on PATH, or INFERNO_BIN=dir). Writes bench/results/flame-<kind>.svg and
# flame-<kind>.txt (where the CPU goes by component and by kind of work, bench/flame_summary.rb, then the
# hottest functions, self time). Uses target/release/oxidekiq (built with debuginfo).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
KIND="${KIND:-noop}"
JOBS="${JOBS:-100000}"
CONC="${CONC:-200}"
THREADS="${THREADS:-1}"
threads_flag=()
[ "$THREADS" = cpus ] || threads_flag=(--threads "$THREADS")
OXIDEKIQ_BIN="${OXIDEKIQ_BIN:-$root/target/release/oxidekiq}"
export PATH="${INFERNO_BIN:+$INFERNO_BIN:}$PATH"
for tool in perf inferno-collapse-perf inferno-flamegraph; do
  command -v "$tool" >/dev/null || { echo "error: $tool is missing (see the header of $0)" >&2; exit 1; }
done

work="$(mktemp -d "${TMPDIR:-/tmp}/oxidekiq-flame.XXXXXX")"
redis_pid="" ox_pid=""
cleanup() {
  for pid in $ox_pid $redis_pid; do
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  # perf.data and the log are large: kept only on request.
  if [ -n "${KEEP_WORK:-}" ]; then echo "flame: work files in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

port=6379
while [ "$port" = 6379 ]; do
  port="$(ruby -rsocket -e 's = TCPServer.new("127.0.0.1", 0); puts s.addr[1]; s.close')"
done
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
  --dir "$work" --logfile "$work/redis.log" &
redis_pid=$!
for _ in $(seq 1 200); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
export REDIS_URL="redis://127.0.0.1:$port/0"
rc() { redis-cli -p "$port" "$@"; }

echo "flame: enqueueing $JOBS $KIND jobs" >&2
ruby -r "$root/bench/jobs.rb" -e '
  Sidekiq.configure_client { |c| c.redis = { url: ENV.fetch("REDIS_URL") } }
  n = Integer(ARGV[0])
  (0...n).each_slice(1000) do |idx|
    if ARGV[1] == "activejob"
      Sidekiq::Client.push_bulk("class" => ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper, "wrapped" => NoopActiveJob,
        "queue" => "default", "args" => idx.map { |i| [NoopActiveJob.new(i).serialize] })
    else
      Sidekiq::Client.push_bulk("class" => NoopJob, "args" => idx.map { |i| [i] })
    end
  end' "$JOBS" "$KIND"
rc rename queue:default bench:staging >/dev/null

"$OXIDEKIQ_BIN" -q default -c "$CONC" "${threads_flag[@]}" >"$work/oxidekiq.log" 2>&1 &
ox_pid=$!
rc lpush queue:default '{"class":"NoopJob","args":[0],"jid":"0123456789abcdef01234567","queue":"default","retry":true,"created_at":1.0,"enqueued_at":1.0}' >/dev/null
until [ "$(rc llen queue:default)" = 0 ]; do sleep 0.05; done
sleep 0.3

echo "flame: recording the drain" >&2
perf record -q -F 1999 --call-graph dwarf,32768 -p "$ox_pid" -o "$work/perf.data" 2>"$work/perf.log" &
perf_pid=$!
sleep 0.5 # perf attaches
rc rename bench:staging queue:default >/dev/null
until [ "$(rc exists queue:default)" = 0 ]; do sleep 0.05; done
sleep 0.1
kill -INT "$perf_pid"
wait "$perf_pid" || true

mkdir -p bench/results
perf script -i "$work/perf.data" 2>/dev/null | inferno-collapse-perf >"$work/folded"
inferno-flamegraph --minwidth 0.5 --title "oxidekiq $KIND drain: $JOBS jobs, -c $CONC, threads $THREADS ($(git rev-parse --short HEAD))" \
  <"$work/folded" >"bench/results/flame-$KIND.svg"
{
  echo "oxidekiq $KIND drain: $JOBS jobs, -c $CONC, threads $THREADS, commit $(git rev-parse --short HEAD), $(date -u +%FT%TZ)," \
    "load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  ruby "$root/bench/flame_summary.rb" "$work/folded"
  echo
  echo "Hottest functions (self time):"
  perf report -i "$work/perf.data" --no-children --sort symbol --stdio 2>/dev/null |
    grep -E '^ +[0-9.]+%' | sed -E 's/ +$//; s/ {2,}-.*$//' | head -25 || true # head closes the pipe early
} >"bench/results/flame-$KIND.txt"
echo "flame: wrote bench/results/flame-$KIND.svg and flame-$KIND.txt" >&2
