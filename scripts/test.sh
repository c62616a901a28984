#!/usr/bin/env bash
# Runs the whole test suite (unit, property and integration tests) against a real PostgreSQL.
# Uses DATABASE_URL if set (a server where this user may create databases: every test gets its own), otherwise
# starts the private test cluster under target/pg-test. Extra arguments go to `cargo test`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# Tools some tests run, from Debian's packages, installed when missing: `systemd-analyze verify` (the unit-file
# test), libfaketime (a test runs the binary with its host clock shifted), `promtool` (the alert-rule tests,
# from the prometheus package), a headless Chromium (the status page test loads the page in it) and PgBouncer (the
# tests that run the product through a connection pooler; its binary is in /usr/sbin, often not on PATH).
missing=()
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v faketime >/dev/null || missing+=(faketime)
command -v promtool >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages the tests need: ${missing[*]}" >&2
  if [ "$(id -u)" = 0 ]; then sudo=(); else sudo=(sudo); fi
  apt_get=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get)
  # The prometheus and pgbouncer packages start their servers when they are installed (invoke-rc.d; the install
  # fails where the server cannot start). Only the programs are wanted (the tests start pgbouncer with a
  # configuration of their own): unless the machine has a policy-rc.d of its own (containers often do), one that
  # denies every service start is in place for the duration of the install.
  policy=/usr/sbin/policy-rc.d
  own_policy=
  if [ ! -e "$policy" ]; then
    own_policy=1
    trap '"${sudo[@]}" rm -f "$policy"' EXIT
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
    "${sudo[@]}" chmod 755 "$policy"
  fi
  "${apt_get[@]}" update -qq
  "${apt_get[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ -n "$own_policy" ]; then
    "${sudo[@]}" rm -f "$policy"
    trap - EXIT
  fi
fi

if [ -z "${DATABASE_URL:-}" ]; then
  DATABASE_URL=$(scripts/pg.sh start test)
fi
export DATABASE_URL
echo "tests use the PostgreSQL server at ${DATABASE_URL%/*}" >&2
cargo test --locked "$@"
