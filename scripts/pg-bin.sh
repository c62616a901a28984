#!/usr/bin/env bash
# Which PostgreSQL programs the project runs: the one rule every script (pg.sh, test.sh, bench.sh) and the
# integration tests (tests/it/helpers/postgres.rs) use. Prints the folder holding them:
#
#   1. FINE_SETTLER_PG_BIN, when set and not empty (PG_BIN is its older name and still works) — taken as given;
#      whoever runs a program from it says so when the program is missing;
#   2. else the newest /usr/lib/postgresql/*/bin (by major version) that has an initdb (Debian's packages);
#   3. else `pg_config --bindir`, when pg_config is on PATH.
#
# None of them: one line on stderr naming what was looked at, exit 1.
set -euo pipefail

given=${FINE_SETTLER_PG_BIN:-${PG_BIN:-}}
if [ -n "$given" ]; then
  echo "$given"
  exit 0
fi
# Sorted by version, not by text: 9.6 < 15 < 18.
newest=
for bin in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V); do
  if [ -x "$bin/initdb" ]; then newest=$bin; fi
done
if [ -n "$newest" ]; then
  echo "$newest"
  exit 0
fi
bindir=$(pg_config --bindir 2>/dev/null || true)
if [ -n "$bindir" ] && [ -d "$bindir" ]; then
  echo "$bindir"
  exit 0
fi
echo "pg-bin.sh: no PostgreSQL programs found (FINE_SETTLER_PG_BIN is not set, no /usr/lib/postgresql/*/bin has an initdb, no pg_config on PATH); set FINE_SETTLER_PG_BIN to the folder of initdb, pg_ctl and postgres" >&2
exit 1
