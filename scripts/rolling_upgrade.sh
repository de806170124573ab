#!/usr/bin/env bash
# Rolling upgrades (and roll backs) under faults with real older binaries (issue 44):
# tests/binary/rolling_upgrade.rs against each older release, both directions, several seeds.
#
#   bash scripts/rolling_upgrade.sh [SEEDS] [FIRST_SEED]      # default: 4 seeds from 1
#
# Builds each older release once, in a detached worktree of its own beside this one
# (`<parent>/old-<commit>`, ROLLING_OLD_DIR overrides <parent>): e9935e1, the release before the
# batch lists (working hashes `oxidekiq:working:<identity>:<q>`), and 3d24d66, the first release with
# them (batch lists under `oxidekiq:working:`). Its target/ is seeded with hard links to this
# checkout's dependency artifacts, so only what differs is compiled (debug builds). Then builds this
# release (`cargo build --workspace`) and runs, for each older release,
#
#   OXIDEKIQ_OLD_BINARY=<old>/target/debug/oxidekiq ROLLING_OLD_LABEL=<commit> \
#     ROLLING_DIRECTION=both ROLLING_SEEDS=N ROLLING_FIRST_SEED=S \
#     cargo test --test binary rolling_upgrade:: -- --ignored --nocapture
#
# and prints every seed's `ROLLING` line (bench/results/rolling-upgrade.md collects them).
# RECORD=1 also re-records fixtures/older-releases/<commit>.json from each binary (CI's guard,
# tests/binary/older_releases.rs). ROLLING_OLDS="e9935e1" limits the releases.
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
cd "$root"
seeds=${1:-4}
first=${2:-1}
olds=${ROLLING_OLDS:-"e9935e1 3d24d66"}
parent=${ROLLING_OLD_DIR:-"$(dirname "$root")"}

seed_target() { # seed_target DIR: hard links to this checkout's dependency artifacts (not oxidekiq's)
  local w=$1 src="$root/target/debug"
  [ -d "$src/deps" ] || return 0
  mkdir -p "$w/target/debug/deps" "$w/target/debug/build" "$w/target/debug/.fingerprint"
  find "$src/deps" -maxdepth 1 -type f \( -name 'lib*' -o -name '*.d' \) ! -name '*oxidekiq*' \
    -exec cp -ln {} "$w/target/debug/deps/" \; 2>/dev/null || true
  for d in build .fingerprint; do
    for e in "$src/$d"/*; do
      case "$(basename "$e")" in *oxidekiq*) continue ;; esac
      cp -rln "$e" "$w/target/debug/$d/" 2>/dev/null || true
    done
  done
}

for c in $olds; do
  w="$parent/old-$c"
  if [ ! -x "$w/target/debug/oxidekiq" ]; then
    [ -d "$w" ] || git worktree add --detach "$w" "$c"
    seed_target "$w"
    (cd "$w" && cargo build -p oxidekiq-workers --bin oxidekiq)
  fi
done
cargo build --workspace

log=$(mktemp)
status=0
for c in $olds; do
  bin="$parent/old-$c/target/debug/oxidekiq"
  if [ "${RECORD:-0}" = 1 ]; then
    bash fixtures/older-releases/record.sh "$bin" "$c"
  fi
  start=$(date +%s)
  OXIDEKIQ_OLD_BINARY="$bin" ROLLING_OLD_LABEL="$c" ROLLING_DIRECTION=both \
    ROLLING_SEEDS="$seeds" ROLLING_FIRST_SEED="$first" \
    cargo test --test binary rolling_upgrade:: -- --ignored --nocapture 2>&1 | tee -a "$log" || status=1
  echo "old=$c: $(($(date +%s) - start)) s" | tee -a "$log"
done
echo
grep -E '^(ROLLING|  FINDING|old=)' "$log" || true
rm -f "$log"
exit $status
