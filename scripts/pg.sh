#!/usr/bin/env bash
# A private PostgreSQL cluster for the demo, the tests and the benchmark, kept under the project's own
# target/ folder and never touching the system cluster.
#
#   scripts/pg.sh start NAME   start (initialising on first use) cluster NAME, print its URL
#   scripts/pg.sh stop NAME    stop it
#   scripts/pg.sh url NAME     print its URL
#
# NAME is test, demo or bench; each has its own data folder and port (FINE_SETTLER_PG_PORT overrides it).
# The server binaries are those scripts/pg-bin.sh names (FINE_SETTLER_PG_BIN, a folder with initdb, pg_ctl and
# postgres, when set; otherwise the newest of /usr/lib/postgresql/*/bin, …). A data folder belongs to one major
# version: it is target/pg-NAME-MAJOR, and each major version has its own ports, 10 apart (15: test 54329, demo
# 54330, bench 54331; 18: 54359, 54360, 54361), so clusters of two versions can run side by side.
# The test cluster trades durability for speed (fsync off): it holds nothing worth keeping.
# PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cmd=${1:?usage: pg.sh start|stop|url NAME}
name=${2:?usage: pg.sh start|stop|url NAME}

case "$name" in
  test)  base_port=54329; extra=(-c fsync=off -c synchronous_commit=off -c full_page_writes=off) ;;
  demo)  base_port=54330; extra=() ;;
  bench) base_port=54331; extra=(-c shared_preload_libraries=pg_stat_statements -c shared_buffers=1GB -c max_wal_size=4GB
               -c max_locks_per_transaction=256) ;; # room for batches of 10,000 loan locks (store::lock_table)
  *) echo "pg.sh: unknown cluster '$name' (test, demo or bench)" >&2; exit 2 ;;
esac
case "$cmd" in
  start|stop|url) ;;
  *) echo "pg.sh: unknown command '$cmd' (start, stop or url)" >&2; exit 2 ;;
esac

pgbin=$("$root/scripts/pg-bin.sh")
for tool in initdb pg_ctl postgres; do
  if [ ! -x "$pgbin/$tool" ]; then
    echo "pg.sh: $pgbin (from scripts/pg-bin.sh) has no executable $tool" >&2
    exit 2
  fi
done
# "pg_ctl (PostgreSQL) 18.6" -> 18 (the major version decides the data folder and the ports).
major=$("$pgbin/pg_ctl" --version | awk 'NR == 1 { print $3 }' | sed 's/[^0-9].*//')
if [ -z "$major" ]; then
  echo "pg.sh: cannot tell the version of $pgbin/pg_ctl ($("$pgbin/pg_ctl" --version 2>&1 | head -n 1))" >&2
  exit 1
fi

port=${FINE_SETTLER_PG_PORT:-$((base_port + 10 * (major - 15)))}
url="postgres://postgres@127.0.0.1:${port}/postgres"
if [ "$cmd" = url ]; then echo "$url"; exit 0; fi

dir="$root/target/pg-$name-$major"
if [ -f "$root/target/pg-$name/data/PG_VERSION" ] && [ "$(cat "$root/target/pg-$name/data/PG_VERSION")" = "$major" ]; then
  dir="$root/target/pg-$name" # a cluster made before the folders carried the version: keep using it
fi
if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$root" 2>/dev/null; then
  # The server runs as `postgres`, which cannot enter this checkout (e.g. one under /root): keep the cluster in
  # a folder of its own under /tmp instead, named after the checkout so that two checkouts never share one.
  dir="/tmp/fine-settler-pg-$(printf '%s' "$root" | md5sum | cut -c1-8)-$name-$major"
  echo "pg.sh: postgres cannot enter $root; the $name cluster lives in $dir" >&2
fi
# A data folder is never handed to binaries of another major version (the server would refuse it, less clearly).
if [ -f "$dir/data/PG_VERSION" ] && [ "$(cat "$dir/data/PG_VERSION")" != "$major" ]; then
  echo "pg.sh: $dir/data is a PostgreSQL $(cat "$dir/data/PG_VERSION") cluster but $pgbin is PostgreSQL $major; remove the folder or use binaries of $(cat "$dir/data/PG_VERSION")" >&2
  exit 2
fi
as_owner=()
if [ "$(id -u)" = 0 ]; then
  as_owner=(runuser -u postgres --)
  if ! runuser -u postgres -- "$pgbin/postgres" --version >/dev/null 2>&1; then
    echo "pg.sh: user postgres cannot run $pgbin/postgres (make it, its libraries and their folders readable and executable by others)" >&2
    exit 1
  fi
fi

run() { "${as_owner[@]}" "$@"; }

case "$cmd" in
  start)
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then
      chown postgres: "$dir"
      if ! runuser -u postgres -- test -w "$dir"; then
        echo "pg.sh: user postgres cannot reach $dir (a parent folder is not searchable by others)" >&2
        exit 1
      fi
    fi
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      run "$pgbin/initdb" -D "$dir/data" -U postgres --auth=trust --encoding=UTF8 --locale=C.UTF-8 \
        --no-instructions >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    if ! run "$pgbin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
      # Loopback TCP only, no Unix socket: nothing outside this machine can reach the cluster.
      run "$pgbin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c max_connections=400 ${extra[*]:-}" \
        start >/dev/null || { tail -n 20 "$dir/server.log" >&2; exit 1; }
    fi
    echo "$url"
    ;;
  stop)
    if [ -f "$dir/data/PG_VERSION" ]; then
      run "$pgbin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
    fi
    ;;
esac
