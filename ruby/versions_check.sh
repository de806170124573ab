#!/usr/bin/env bash
# Local only: runs ruby/versions_check.rb with the client of Sidekiq 7.3.9 and 8.1.7 (unpacked from the
# machine's git mirrors by fixtures/sidekiq-7-8/env.sh) and Debian's 6.4.1, on a throwaway redis-server.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source fixtures/sidekiq-7-8/env.sh
port=$(ruby -rsocket -e 's = TCPServer.new("127.0.0.1", 0); puts s.addr[1]; s.close')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null &
pid=$!
trap 'kill $pid 2>/dev/null || true; [ -n "${SK78_OWNED:-}" ] && rm -rf "$SK78"' EXIT
sleep 0.5
for args in "$RUBY_739" "$RUBY_817" ""; do
  # shellcheck disable=SC2086
  REDIS_URL="redis://127.0.0.1:$port" MW="$PWD/ruby/oxidekiq.rb" ruby $args ruby/versions_check.rb 2>&1 | grep -v "deprecat\|Redis#sadd"
  redis-cli -p "$port" config resetstat >/dev/null
done
