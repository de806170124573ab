#!/usr/bin/env bash
# Redis CPU a minute of an idle fleet of oxidekiq processes beside unrelated keys (issue 43 item 3).
#
#   bash bench/idle_fleet.sh [BIN] [PROCS...] -- [KEYS...]
#   bash bench/idle_fleet.sh target/debug/oxidekiq 1 4 -- 0 1000000
#   SETTLE=120 bash bench/idle_fleet.sh target/release/oxidekiq 1 4 20 -- 5000000
#
# For each count of unrelated keys (DEBUG POPULATE, a Rails cache's worth) and each fleet size: a private
# redis-server on a free port (never 6379, no persistence), that many processes started with the default
# beat (5 s; recovery every two beats), 20 s to settle (the start's first recovery pass and fleet
# survey), then Redis's own CPU (INFO cpu, used_cpu_sys + used_cpu_user) over MINUTE seconds (60).
# Prints one line per run: keys, processes, Redis CPU seconds in that minute. A count of keys the
# machine's free memory cannot hold (about 200 bytes a key with DEBUG POPULATE's values, checked
# against MemAvailable) is refused before Redis starts. With millions of keys, raise SETTLE: a fleet's
# start walks the keyspace (cron's look for namespaces, once per fleet; a first recovery pass), about
# 0.55 s of Redis CPU per million keys each, and those walks must end before the minute starts.
set -euo pipefail
BIN=${1:-target/debug/oxidekiq}; shift || true
PROCS=(); KEYS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do PROCS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
while [ $# -gt 0 ]; do KEYS+=("$1"); shift; done
[ ${#PROCS[@]} -gt 0 ] || PROCS=(1 4)
[ ${#KEYS[@]} -gt 0 ] || KEYS=(0 1000000)
MINUTE=${MINUTE:-60}
SETTLE=${SETTLE:-20}

cpu() { redis-cli -p "$PORT" info cpu | tr -d '\r' | awk -F: '/^used_cpu_(sys|user):/ {s += $2} END {printf "%.3f", s}'; }

avail_kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
for keys in "${KEYS[@]}"; do
  if [ $((keys / 5)) -gt "$avail_kb" ]; then
    echo "keys=$keys needs about $((keys / 5 / 1024)) MB; only $((avail_kb / 1024)) MB available" >&2; exit 1
  fi
  for n in "${PROCS[@]}"; do
    PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    DIR=$(mktemp -d)
    redis-server --port "$PORT" --save '' --appendonly no --dir "$DIR" --daemonize yes --logfile "$DIR/redis.log" \
      --enable-debug-command local
    until redis-cli -p "$PORT" ping >/dev/null 2>&1; do sleep 0.1; done
    if [ "$keys" -gt 0 ]; then redis-cli -p "$PORT" debug populate "$keys" cache >/dev/null; fi
    size=$(redis-cli -p "$PORT" dbsize)
    [ "$size" -ge "$keys" ] || { echo "DEBUG POPULATE made $size keys, not $keys" >&2; exit 1; }
    PIDS=()
    for i in $(seq "$n"); do
      REDIS_URL="redis://127.0.0.1:$PORT" "$BIN" -q default -c 10 >"$DIR/ox$i.log" 2>&1 &
      PIDS+=($!)
    done
    sleep "$SETTLE"
    a=$(cpu); sleep "$MINUTE"; b=$(cpu)
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true
    rm -rf "$DIR"
    echo "keys=$keys processes=$n redis_cpu_s_per_${MINUTE}s=$(python3 -c "print(round($b - $a, 3))")"
  done
done
