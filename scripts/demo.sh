#!/usr/bin/env bash
# The demo: Ruby enqueues a mix of jobs (plain Sidekiq, ActiveJob, a failing one, a scheduled one, one
# with no Rust worker) and oxidekiq drains them with the Rust workers in workers/, then prints what
# happened through Sidekiq's own API.
#
#   bash scripts/demo.sh                 # starts its own redis-server on a free port
#   OXIDEKIQ_TEST_SERVER=valkey bash scripts/demo.sh   # its own valkey-server (or a path to a server binary)
#   REDIS_URL=redis://host:6379/3 bash scripts/demo.sh   # or uses yours (it adds jobs to it!)
#   DEMO_JOBS=100000 bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n==> %s\n' "$*"; }

bash scripts/setup.sh
step "building oxidekiq (release)"
cargo build --release -p oxidekiq-workers
bin=${CARGO_TARGET_DIR:-target}/release/oxidekiq

work=$(mktemp -d "${TMPDIR:-/tmp}/oxidekiq-demo.XXXXXX")
cleanup() {
  [ -n "${ox_pid:-}" ] && kill -TERM "$ox_pid" 2>/dev/null && wait "$ox_pid" 2>/dev/null || true
  [ -n "${redis_pid:-}" ] && kill "$redis_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

if [ -z "${REDIS_URL:-}" ]; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null \
    || ruby -rsocket -e 's=TCPServer.new("127.0.0.1",0); puts s.addr[1]')
  # The server the tests choose, by the same variable (tests/support/mod.rs): redis, valkey or a path.
  case "${OXIDEKIQ_TEST_SERVER:-redis}" in
    redis) server=redis-server ;;
    valkey) server=valkey-server ;;
    *) server=$OXIDEKIQ_TEST_SERVER ;;
  esac
  "$server" --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" >"$work/redis.log" 2>&1 &
  redis_pid=$!
  export REDIS_URL="redis://127.0.0.1:$port"
  for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  step "started $("$server" --version | cut -d' ' -f1-3) on port $port"
fi

step "enqueueing with Ruby Sidekiq $(ruby -e 'require "sidekiq"; print Sidekiq::VERSION') and ActiveJob"
ruby demo/enqueue.rb

step "running oxidekiq until the queues are empty (log: $work/oxidekiq.log)"
start=$(date +%s.%N)
"$bin" -q default -q mailers -c 25 --poll-interval 0.5 >"$work/oxidekiq.log" 2>&1 &
ox_pid=$!
queued() { ruby -e 'require "sidekiq/api"; Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=); Sidekiq.configure_client { |c| c.redis = { url: ENV["REDIS_URL"] } }; s = Sidekiq::Stats.new; print s.enqueued + s.scheduled_size + Sidekiq::Workers.new.size' 2>/dev/null; }
sleep 1
for _ in $(seq 120); do
  [ "$(queued)" = "0" ] && break
  sleep 0.5
done
sleep 1 # one more beat so the stats are flushed
kill -TERM "$ox_pid"; wait "$ox_pid" || true; ox_pid=
end=$(date +%s.%N)
grep -E "INFO: (done|fail)" "$work/oxidekiq.log" | tail -n 3 || true
grep -E "WelcomeEmailJob.*welcome email sent" "$work/oxidekiq.log" | head -n 2 || true

step "what happened (read through Sidekiq::API)"
ruby demo/report.rb
printf 'wall time: %.1f s\n' "$(echo "$end - $start" | bc 2>/dev/null || python3 -c "print($end-$start)")"
