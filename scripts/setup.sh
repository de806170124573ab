#!/usr/bin/env bash
# Installs what oxidekiq's tests, demo and benchmark run against, when missing (Debian/Ubuntu, as root or
# via sudo): redis-server, redis-sentinel (tests/sentinel.rs), ruby with ruby-sidekiq 6.4 and ruby-activejob 6.1 (ruby-globalid comes along),
# ruby-sidekiq-cron 1.8.0 (tests/cron.rs runs the gem beside oxidekiq),
# openssl (tests/security.rs makes throwaway TLS certificates with it).
# Used by scripts/test.sh, scripts/demo.sh and bench/run.sh.
set -euo pipefail

step() { printf '\n==> %s\n' "$*"; }

packages=(redis-server redis-sentinel ruby ruby-sidekiq ruby-activejob ruby-sidekiq-cron openssl ${EXTRA_PACKAGES:-})

step() { printf '\n==> %s\n' "$*"; }

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

if ! command -v cargo >/dev/null; then
  echo "error: cargo not found; install Rust >= 1.88 with rustup (https://rustup.rs)" >&2
  exit 1
fi

