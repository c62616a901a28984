#!/usr/bin/env bash
# A PgBouncer in front of one of the private clusters of scripts/pg.sh, for the benchmark and manual trials
# (the integration tests start their own, one per test: tests/it/helpers/pgbouncer.rs).
#
#   scripts/pgbouncer.sh start NAME MODE   start it (and the cluster NAME, if it is not running), print its URL
#   scripts/pgbouncer.sh stop NAME MODE    stop it (the cluster keeps running)
#   scripts/pgbouncer.sh url NAME MODE     print its URL
#
# NAME is test, demo or bench (the cluster, on the port pg.sh gives it); MODE is transaction or session
# (PgBouncer's pool_mode). Each NAME and MODE has its own port (FINE_SETTLER_PGBOUNCER_PORT overrides it) and its
# configuration, log and pid file under target/pgbouncer-NAME-MODE. The URL is the cluster's, with the bouncer's
# address: every database of the cluster is reachable through it by name, as the same user.
#
# PgBouncer's defaults stay as they are (no ignore_startup_parameters, no max_prepared_statements): they are what
# the product has to work with. Set are only the address, the pool mode, one wildcard database, trust auth with
# an auth file naming the cluster's user (the clusters trust loopback logins; PgBouncer's trust still admits only
# users its auth file lists), a log and pid file (required to run in the background), and the pool sizes: in
# session mode a client holds a server connection for its whole session, so default_pool_size = 50 (default 20)
# lets 6 replicas of 4 + 1 connections and a test's or benchmark's own pool in at once; max_client_conn = 200
# (default 100) leaves room beyond that.
# PgBouncer refuses to run as root, so as root it runs as the `postgres` user, like the clusters.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage="usage: pgbouncer.sh start|stop|url NAME MODE"
cmd=${1:?$usage}
name=${2:?$usage}
mode=${3:?$usage}

case "$name" in
  test)  base=54429 ;;
  demo)  base=54430 ;;
  bench) base=54431 ;;
  *) echo "pgbouncer.sh: unknown cluster '$name' (test, demo or bench)" >&2; exit 2 ;;
esac
case "$mode" in
  transaction) offset=0 ;;
  session)     offset=10 ;;
  *) echo "pgbouncer.sh: unknown pool mode '$mode' (transaction or session)" >&2; exit 2 ;;
esac
case "$cmd" in
  start|stop|url) ;;
  *) echo "pgbouncer.sh: unknown command '$cmd' (start, stop or url)" >&2; exit 2 ;;
esac
port=${FINE_SETTLER_PGBOUNCER_PORT:-$((base + offset))}

# The cluster's URL, postgres://USER@HOST:PORT/DB; the bouncer's is the same with its own address.
server_url=$("$root/scripts/pg.sh" url "$name")
server=${server_url#postgres://}
user=${server%%@*}
server=${server#*@}
server_addr=${server%%/*}
database=${server#*/}
server_host=${server_addr%:*}
server_port=${server_addr##*:}
url="postgres://${user}@127.0.0.1:${port}/${database}"
if [ "$cmd" = url ]; then echo "$url"; exit 0; fi

dir="$root/target/pgbouncer-$name-$mode"
if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$root" 2>/dev/null; then
  # As in pg.sh: `postgres` cannot enter this checkout, so the files live under /tmp, named after the checkout.
  dir="/tmp/fine-settler-pgbouncer-$(printf '%s' "$root" | md5sum | cut -c1-8)-$name-$mode"
fi
pidfile="$dir/pgbouncer.pid"
# Whether process $1 is a PgBouncer started with this configuration (not a stale pid reused by another process;
# an exited one that is not reaped yet has no command line).
ours() { grep -qsF "$dir/pgbouncer.ini" "/proc/$1/cmdline"; }
running() { [ -f "$pidfile" ] && ours "$(cat "$pidfile" 2>/dev/null)"; }

case "$cmd" in
  start)
    binary=/usr/sbin/pgbouncer
    [ -x "$binary" ] || binary=$(command -v pgbouncer || true)
    if [ -z "$binary" ]; then
      echo "pgbouncer.sh: pgbouncer not found; scripts/test.sh installs it" >&2
      exit 1
    fi
    "$root/scripts/pg.sh" start "$name" >/dev/null
    if running; then echo "$url"; exit 0; fi
    accepting() { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }
    if accepting; then
      echo "pgbouncer.sh: port $port is taken by another process (FINE_SETTLER_PGBOUNCER_PORT chooses another)" >&2
      exit 1
    fi
    mkdir -p "$dir"
    # One log: PgBouncer's own, and before it opens that, what it writes to stderr (a bad setting). Created here,
    # so that it belongs to the user PgBouncer runs as.
    touch "$dir/pgbouncer.log"
    printf '"%s" ""\n' "$user" >"$dir/users.txt"
    cat >"$dir/pgbouncer.ini" <<EOF
[databases]
* = host=$server_host port=$server_port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
pool_mode = $mode
auth_type = trust
auth_file = $dir/users.txt
default_pool_size = 50
max_client_conn = 200
logfile = $dir/pgbouncer.log
pidfile = $pidfile
EOF
    as_owner=()
    if [ "$(id -u)" = 0 ]; then
      chown -R postgres: "$dir"
      as_owner=(runuser -u postgres --)
    fi
    rm -f "$pidfile"
    log_from=$(( $(stat -c %s "$dir/pgbouncer.log") + 1 ))
    this_start() { tail -c "+$log_from" "$dir/pgbouncer.log"; }
    "${as_owner[@]}" "$binary" -d "$dir/pgbouncer.ini" 2>>"$dir/pgbouncer.log" \
      || { this_start >&2; exit 1; }
    # -d returns once the process is in the background, which writes its pid file a moment later; wait (up to
    # 10 s) until it accepts connections, or has given up (FATAL: a port taken, a bad setting).
    for _ in $(seq 100); do
      if accepting && running; then echo "$url"; exit 0; fi
      if this_start | grep -q FATAL || { [ -f "$pidfile" ] && ! running; }; then break; fi
      sleep 0.1
    done
    echo "pgbouncer.sh: pgbouncer did not start listening on 127.0.0.1:$port; its log:" >&2
    this_start >&2
    exit 1
    ;;
  stop)
    if running; then
      pid=$(cat "$pidfile")
      kill -TERM "$pid"
      for _ in $(seq 100); do
        # PgBouncer removes its pid file before it exits: wait for the process itself.
        ours "$pid" || exit 0
        sleep 0.1
      done
      echo "pgbouncer.sh: pgbouncer (pid $pid) did not stop within 10 s" >&2
      exit 1
    fi
    ;;
esac
