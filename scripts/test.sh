#!/usr/bin/env bash
# Runs the whole test suite (unit, property and integration tests) against a real PostgreSQL.
# Uses DATABASE_URL if set (a server where this user may create databases: every test gets its own), otherwise
# starts the private test cluster under target/pg-test. Extra arguments go to `cargo test`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# Tools some tests run, from Debian's packages, installed when missing: `systemd-analyze verify` (the unit-file
# test) and libfaketime (a test runs the binary with its host clock shifted).
missing=()
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v faketime >/dev/null || missing+=(faketime)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages the tests need: ${missing[*]}" >&2
  if [ "$(id -u)" = 0 ]; then apt_get=(apt-get); else apt_get=(sudo apt-get); fi
  DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ -z "${DATABASE_URL:-}" ]; then
  DATABASE_URL=$(scripts/pg.sh start test)
fi
export DATABASE_URL
echo "tests use the PostgreSQL server at ${DATABASE_URL%/*}" >&2
cargo test --locked "$@"
