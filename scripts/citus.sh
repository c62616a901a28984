#!/usr/bin/env bash
# A private Citus cluster (a coordinator and two workers: three PostgreSQL 18 servers from PyPI, see
# scripts/pg-fetch.sh), kept under the project's own target/ folder like the clusters of scripts/pg.sh.
#
#   scripts/citus.sh build    build Citus into PostgreSQL 18's folders, unless that build is there already
#   scripts/citus.sh start    build if needed, start the three servers (initialising them on first use) and
#                             print the coordinator's URL
#   scripts/citus.sh stop     stop them
#   scripts/citus.sh url      print the coordinator's URL
#   scripts/citus.sh status   say which nodes run (exit 3 unless all three do)
#   scripts/citus.sh tarball  print the Citus source tarball a build would use (exit 1 if there is none)
#   scripts/citus.sh crash-worker
#                             stop the first worker at once, as a crash does (`pg_ctl -m immediate`: no checkpoint,
#                             its connections cut, its prepared transactions kept), and start it again (recovery)
#   scripts/citus.sh crash-coordinator
#                             the same for the coordinator (its sessions cut, the two-phase commits it started
#                             left for its recovery to finish or roll back)
#
# Citus is built from the vendored, unmodified release tarball ../shared/vendor/citus-*.tar.gz beside the checkout
# — or beside the checkout this one was cloned from, for a clone made elsewhere (FINE_SETTLER_CITUS_TARBALL names
# another one), in target/citus-build-CHECKSUM/ (build.log there), and installed
# into the PyPI PostgreSQL's lib/ and share/extension/; a stamp there records the tarball's checksum, so a new
# tarball is built again. Missing build dependencies (Debian packages) are installed with apt-get.
#
# The nodes listen on 127.0.0.1 only: the coordinator on FINE_SETTLER_CITUS_PORT (54340), the workers on the next
# two ports; data in target/citus-cluster/NODE/data. A cluster keeps its ports in its metadata: to change the port,
# remove target/citus-cluster first. Like pg.sh's test cluster it trades durability for speed (fsync off).
# The coordinator reaches the workers as postgres, trusted on loopback, with the settings of citus.node_conninfo
# (by default sslmode=require: Citus turns ssl on with a self-signed certificate when its extension is created).
#
# A new database (sqlx::test makes one per test) is a Citus database once it is created on the coordinator (CREATE
# and DROP DATABASE reach the workers) and then, connected to it on the coordinator (with the default ports):
#   create extension citus;
#   select master_run_on_worker(array['127.0.0.1', '127.0.0.1'], array[54341, 54342],
#     array['create extension if not exists citus', 'create extension if not exists citus'], true);
#   select citus_set_coordinator_host('127.0.0.1', 54340);
#   select citus_add_node('127.0.0.1', 54341); select citus_add_node('127.0.0.1', 54342);
# Citus keeps its metadata, the list of nodes included, per database, and a worker can only be added once the
# extension is in its copy of the database. Without the workers, a distributed table's shards all stay on the
# coordinator.
# PostgreSQL refuses to run as root, so as root the servers run as the `postgres` user.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() { echo "citus.sh: $* (usage: citus.sh build|start|stop|url|status|tarball|crash-worker|crash-coordinator)" >&2; exit 2; }
[ $# -eq 1 ] || usage "one command expected"
cmd=$1
case "$cmd" in
  build|start|stop|url|status|tarball|crash-worker|crash-coordinator) ;;
  *) usage "unknown command '$cmd'" ;;
esac

base_port=${FINE_SETTLER_CITUS_PORT:-54340}
nodes=(coordinator worker1 worker2) # node i listens on base_port + i
url="postgres://postgres@127.0.0.1:${base_port}/postgres"
if [ "$cmd" = url ]; then echo "$url"; exit 0; fi

# The newest citus-*.tar.gz in ../shared/vendor beside this checkout, else beside the one it was cloned from.
find_tarball() {
  local dir origin
  if [ -n "${FINE_SETTLER_CITUS_TARBALL:-}" ]; then echo "$FINE_SETTLER_CITUS_TARBALL"; return; fi
  for dir in "$root/.." "$(origin=$(git -C "$root" config --get remote.origin.url 2>/dev/null) &&
                           [ -d "$origin" ] && cd "$origin/.." && pwd)"; do
    [ -n "$dir" ] || continue
    ls "$dir"/shared/vendor/citus-*.tar.gz 2>/dev/null | sort -V | tail -n 1 | grep . && return
  done
  return 0
}
if [ "$cmd" = tarball ]; then
  tarball=$(find_tarball)
  [ -n "$tarball" ] && [ -f "$tarball" ] || { echo "citus.sh: no Citus source tarball found" >&2; exit 1; }
  echo "$tarball"; exit 0
fi

dir="$root/target/citus-cluster"
if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$root" 2>/dev/null; then
  # The servers run as `postgres`, which cannot enter this checkout: keep the cluster where it can (as pg.sh does).
  dir="/tmp/fine-settler-citus-$(printf '%s' "$root" | md5sum | cut -c1-8)"
fi
# stop and status need no server binaries when there is no cluster (and should not fetch them).
if [ "$cmd" = stop ] && [ ! -d "$dir" ]; then exit 0; fi
if [ "$cmd" = status ] && [ ! -d "$dir" ]; then echo "no Citus cluster in $dir"; exit 3; fi

pgbin=$("$root/scripts/pg-fetch.sh" 18)
mkdir -p "$root/target"
as_owner=()
if [ "$(id -u)" = 0 ]; then as_owner=(runuser -u postgres --); fi
run() { "${as_owner[@]}" "$@"; }
sql() { # PORT STATEMENT: run it in the postgres database of that node, quietly
  PGOPTIONS="-c client_min_messages=warning" "$pgbin/psql" -XAtq -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres \
    -d postgres -c "$2"
}

build() {
  local tarball sum pkglibdir extdir stamp work pkg missing=()
  tarball=$(find_tarball)
  if [ ! -f "$tarball" ]; then
    echo "citus.sh: no Citus tarball ${tarball:+at $tarball }(FINE_SETTLER_CITUS_TARBALL, else the newest" \
      "$root/../shared/vendor/citus-*.tar.gz)" >&2
    exit 1
  fi
  sum=$(sha256sum "$tarball" | cut -c1-64)
  pkglibdir=$("$pgbin/pg_config" --pkglibdir)
  extdir=$("$pgbin/pg_config" --sharedir)/extension
  stamp="$pkglibdir/citus.tarball-sha256"
  # Two builds at once would write the same files: the second waits, then finds the first one's result.
  flock 9
  if [ -f "$pkglibdir/citus.so" ] && [ -f "$extdir/citus.control" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ]
  then
    return
  fi

  # A C toolchain, the compression libraries of Citus' columnar storage and the headers PostgreSQL's own headers
  # include (it was built with OpenSSL and GSSAPI). libcurl (anonymous statistics) is configured out.
  for pkg in gcc make liblz4-dev libzstd-dev libssl-dev libkrb5-dev; do
    dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "citus.sh: installing Debian packages the Citus build needs: ${missing[*]}" >&2
    if [ "$(id -u)" = 0 ]; then sudo=(); else sudo=(sudo); fi
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
      >/dev/null
  fi

  # The release tarball carries its generated configure script: no autoconf needed.
  work="$root/target/citus-build-${sum:0:12}"
  rm -rf "$root"/target/citus-build-*/ # earlier builds, of this tarball or others
  mkdir -p "$work/src"
  tar --no-same-owner -xzf "$tarball" -C "$work/src" --strip-components=1
  rm -f "$stamp" # until the new build is installed whole
  echo "citus.sh: building Citus from $tarball for $pgbin (log: $work/build.log)" >&2
  if ! (cd "$work/src" && ./configure PG_CONFIG="$pgbin/pg_config" --without-libcurl && make -j2 && make install) \
    >"$work/build.log" 2>&1; then
    tail -n 30 "$work/build.log" >&2
    echo "citus.sh: building Citus failed (log: $work/build.log)" >&2
    exit 1
  fi
  echo "$sum" >"$stamp"
} 9>"$root/target/citus-build.lock" # opened for the call only: the servers started after it must not hold it

case "$cmd" in
  build) build ;;
  start)
    build
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then chown postgres: "$dir"; fi
    for i in "${!nodes[@]}"; do
      node="$dir/${nodes[i]}"
      run mkdir -p "$node"
      if [ ! -f "$node/data/PG_VERSION" ]; then
        run "$pgbin/initdb" -D "$node/data" -U postgres --auth=trust --encoding=UTF8 --locale=C.UTF-8 \
          --no-instructions >"$node/initdb.log" 2>&1 || { cat "$node/initdb.log" >&2; exit 1; }
        # CREATE DATABASE on the coordinator is also run on the workers. Citus' own connections to the local
        # node go to citus.local_hostname: 127.0.0.1, where the server listens ("localhost" may be ::1).
        # The product connects to the coordinator only, so no distributed transaction starts on a worker and its
        # maintenance daemon need not look for distributed deadlocks or unfinished two-phase commits there. Left
        # on, it keeps connections open to every node's copy of each Citus database, and DROP DATABASE on the
        # coordinator fails ("being accessed by other users"), as when sqlx::test drops a test's database.
        {
          cat <<'EOF'

# scripts/citus.sh
shared_preload_libraries = 'citus'
citus.enable_create_database_propagation = on
citus.local_hostname = '127.0.0.1'
max_connections = 400
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
          if [ "$i" -gt 0 ]; then
            printf '%s\n' 'citus.distributed_deadlock_detection_factor = -1' 'citus.recover_2pc_interval = -1'
          fi
        } | run tee -a "$node/data/postgresql.conf" >/dev/null
      fi
      if ! run "$pgbin/pg_ctl" -D "$node/data" status >/dev/null 2>&1; then
        # Loopback TCP only, no Unix socket: nothing outside this machine can reach the cluster.
        run "$pgbin/pg_ctl" -D "$node/data" -l "$node/server.log" -w -t 60 \
          -o "-p $((base_port + i)) -c listen_addresses=127.0.0.1 -c unix_socket_directories=" \
          start >/dev/null || { tail -n 20 "$node/server.log" >&2; exit 1; }
      fi
    done
    # Every statement below is a no-op when already done: a node added again keeps its id.
    for i in 2 1 0; do sql $((base_port + i)) "create extension if not exists citus" >/dev/null; done
    sql "$base_port" "select citus_set_coordinator_host('127.0.0.1', $base_port)" >/dev/null
    for i in 1 2; do sql "$base_port" "select citus_add_node('127.0.0.1', $((base_port + i)))" >/dev/null; done
    echo "$url"
    ;;
  stop)
    for node in "${nodes[@]}"; do
      if [ -f "$dir/$node/data/PG_VERSION" ]; then
        run "$pgbin/pg_ctl" -D "$dir/$node/data" -m fast -w stop >/dev/null 2>&1 || true
      fi
    done
    ;;
  crash-worker|crash-coordinator)
    # pg_ctl restart starts the server again with the options it was started with (postmaster.opts).
    node=worker1
    if [ "$cmd" = crash-coordinator ]; then node=coordinator; fi
    run "$pgbin/pg_ctl" -D "$dir/$node/data" -l "$dir/$node/server.log" -m immediate -w -t 60 restart \
      >/dev/null || { tail -n 20 "$dir/$node/server.log" >&2; exit 1; }
    ;;
  status)
    all=0
    for i in "${!nodes[@]}"; do
      state=running
      run "$pgbin/pg_ctl" -D "$dir/${nodes[i]}/data" status >/dev/null 2>&1 || { state="not running"; all=3; }
      echo "${nodes[i]} (127.0.0.1:$((base_port + i))): $state"
    done
    exit "$all"
    ;;
esac
