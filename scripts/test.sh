#!/usr/bin/env bash
# Runs the whole test suite (unit, property and integration tests) against a real PostgreSQL.
# Uses DATABASE_URL if set (a server where this user may create databases: every test gets its own), otherwise
# starts the private test cluster under target/pg-test. Extra arguments go to `cargo test`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# The unit-file test runs `systemd-analyze verify`: install it if this machine lacks it.
if ! command -v systemd-analyze >/dev/null; then
  echo "installing systemd (for systemd-analyze)" >&2
  if [ "$(id -u)" = 0 ]; then apt_get=(apt-get); else apt_get=(sudo apt-get); fi
  DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" install -y -qq --no-install-recommends systemd >/dev/null
fi

if [ -z "${DATABASE_URL:-}" ]; then
  DATABASE_URL=$(scripts/pg.sh start test)
fi
export DATABASE_URL
echo "tests use the PostgreSQL server at ${DATABASE_URL%/*}" >&2
cargo test --locked "$@"
