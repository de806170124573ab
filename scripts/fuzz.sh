#!/usr/bin/env bash
# Fuzzes the payload decoder (fuzz/fuzz_targets/payload.rs) for a bounded time, seeded with every
# recorded fixture. Stable toolchain, so no sanitizer: coverage-guided libFuzzer only.
#
#   bash scripts/fuzz.sh               # 30 s (what scripts/test.sh runs)
#   bash scripts/fuzz.sh 1800          # a long run
#   bash scripts/fuzz.sh --build-only  # build the target and stop (scripts/test.sh builds it while the
#                                      # tests run)
#
# It builds the target as `cargo fuzz build -s none` does (release, libFuzzer's sancov instrumentation,
# `--cfg fuzzing`, an explicit --target so build scripts stay uninstrumented) with plain cargo, so a fresh
# machine need not compile cargo-fuzz first; `cargo fuzz run -s none payload` works the same where
# cargo-fuzz is installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${1:-30}

host=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions"
# The same directory cargo-fuzz uses, so either builds on the other's work.
export CARGO_TARGET_DIR=fuzz/target
echo "==> building the fuzz target (fuzz/target/$host/release/payload)"
cargo build --manifest-path fuzz/Cargo.toml --release --target "$host" --bin payload
[ "$seconds" = "--build-only" ] && exit 0

corpus=fuzz/corpus/payload
mkdir -p "$corpus"
for f in fixtures/*/*.json fixtures/shared/*/*.json; do
  [ -f "$f" ] && cp "$f" "$corpus/seed-$(echo "$f" | tr '/' '_')"
done

mkdir -p fuzz/artifacts/payload
echo "==> fuzzing the payload decoder for ${seconds}s"
set +e
"fuzz/target/$host/release/payload" -artifact_prefix=fuzz/artifacts/payload/ \
  -max_total_time="$seconds" -max_len=65536 -timeout=10 "$corpus" >fuzz/target/fuzz.log 2>&1
status=$?
set -e
tail -n 25 fuzz/target/fuzz.log
exit $status
