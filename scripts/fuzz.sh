#!/usr/bin/env bash
# Fuzzes the payload decoder (fuzz/fuzz_targets/payload.rs) for a bounded time, seeded with every
# recorded fixture. Stable toolchain, so no sanitizer (`-s none`).
#
#   bash scripts/fuzz.sh          # 30 s (what scripts/test.sh runs)
#   bash scripts/fuzz.sh 1800     # a long run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${1:-30}

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "==> installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

corpus=fuzz/corpus/payload
mkdir -p "$corpus"
for f in fixtures/*/*.json fixtures/shared/*/*.json; do
  [ -f "$f" ] && cp "$f" "$corpus/seed-$(echo "$f" | tr '/' '_')"
done

echo "==> fuzzing the payload decoder for ${seconds}s"
cargo fuzz run -s none payload "$corpus" -- -max_total_time="$seconds" -max_len=65536 -timeout=10 2>&1 | tail -n 25
