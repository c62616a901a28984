#!/usr/bin/env bash
# The demo, end to end: build, bring up a database, migrate, load 5,000 generated loans, settle October 2026 with
# 3 shards (two competing processes per shard), settle again, force a rerun, audit, and print a report.
# Uses the server in DATABASE_URL if set (in a database of its own, fine_settler_demo, dropped and re-created),
# otherwise a private cluster under target/pg-demo.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

echo "== building (release)"
cargo build --release --locked --quiet
bin=$root/target/release/fine-settler

server_url=${DATABASE_URL:-$(scripts/pg.sh start demo)}
server=${server_url%/*}
# psql of the PostgreSQL programs scripts/pg-bin.sh names (those of the demo cluster), else any on PATH.
psql=$(scripts/pg-bin.sh 2>/dev/null || true)/psql
[ -x "$psql" ] || psql=$(command -v psql) || { echo "demo.sh: no psql (scripts/pg-bin.sh names none, none on PATH)" >&2; exit 1; }
"$psql" "$server_url" -qX -v ON_ERROR_STOP=1 -c "drop database if exists fine_settler_demo" \
  -c "create database fine_settler_demo" 2>/dev/null
export DATABASE_URL=$server/fine_settler_demo
export FINE_SETTLER__LOG__LEVEL=${FINE_SETTLER__LOG__LEVEL:-warn}
date=2026-10-31
shards=3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== database ${server}/fine_settler_demo"
"$bin" migrate >/dev/null
"$bin" demo-data --loans 5000 --seed 42 --month 2026-10 >/dev/null
echo "   5000 demo loans loaded (seed 42)"

# field NAME JSON-LINE: a scalar field of a report line.
field() { sed -nE "s/.*\"$1\":\"?([^\",}]*)\"?.*/\1/p" <<<"$2"; }
now_ms() { date +%s%3N; }

# round NAME TWINS ARGS...: every shard TWINS times, all processes at once; reports in $work/NAME.
round() {
  local name=$1 twins=$2; shift 2
  local start end
  start=$(now_ms)
  for s in $(seq 0 $((shards - 1))); do
    for twin in $(seq 1 "$twins"); do
      "$bin" settle --business-date "$date" --shard "$s" --shards "$shards" "$@" >"$work/$name.$s.$twin" &
    done
  done
  wait
  end=$(now_ms)
  echo $((end - start)) >"$work/$name.wall_ms"
  cat "$work/$name".[0-9]*.* >"$work/$name"
}

summary() {
  local name=$1 settled skipped scanned updated
  settled=$(grep -c '"outcome":"settled"' "$work/$name" || true)
  skipped=$(grep -c '"outcome":"skipped"' "$work/$name" || true)
  scanned=0; updated=0
  while IFS= read -r line; do
    scanned=$((scanned + $(field scanned "$line")))
    updated=$((updated + $(field updated "$line")))
  done <"$work/$name"
  printf '   %-14s processes: %d settled, %d skipped   rows scanned %5d, updated %5d   (%s ms)\n' \
    "$name" "$settled" "$skipped" "$scanned" "$updated" "$(cat "$work/$name.wall_ms")"
  echo "$updated" >"$work/$name.updated"
}

echo "== settling $date with $shards shards: two competing processes per shard, twice; then one forced rerun per shard"
round first 2
round second 2
round forced 1 --force
summary first
summary second
summary forced

if grep -q '"outcome":"\(failed\|lease_lost\)"' "$work/first" "$work/second" "$work/forced"; then
  echo "a run failed:" >&2
  cat "$work/first" "$work/second" "$work/forced" >&2
  exit 1
fi

echo "== per shard, first round"
for s in $(seq 0 $((shards - 1))); do
  line=$(grep -h '"outcome":"settled"' "$work/first.$s".* | head -n 1)
  printf '   shard %d/%d  epoch %s  updated %5s rows in %4s ms\n' "$s" "$shards" \
    "$(field epoch "$line")" "$(field updated "$line")" "$(field elapsed_ms "$line")"
done
max_ms=$(grep -h '"outcome":"settled"' "$work"/first.[0-9]*.* | sed -nE 's/.*"elapsed_ms":([0-9]+).*/\1/p' | sort -n | tail -n 1)
first_updated=$(cat "$work/first.updated")
echo "   settlement took ${max_ms} ms (slowest shard); $((first_updated * 1000 / (max_ms > 0 ? max_ms : 1))) rows/s across the shards"

echo "== audit (fine-settler verify)"
"$bin" verify --business-date "$date" | sed 's/^/   /'

echo
if [ "$(cat "$work/second.updated")" = 0 ] && [ "$(cat "$work/forced.updated")" = 0 ] && "$bin" verify --business-date "$date" >/dev/null; then
  echo "RESULT: first run updated $first_updated loans; second run skipped; forced rerun updated 0; totals equal the policy."
else
  echo "RESULT: FAILED — see above" >&2
  exit 1
fi

echo
echo "== the daemon: three replicas (deploy/shard.example.toml, shards 0..2) catch up the last three months"
"$psql" "$server_url" -qX -v ON_ERROR_STOP=1 -c "drop database if exists fine_settler_demo_daemon" \
  -c "create database fine_settler_demo_daemon" 2>/dev/null
export DATABASE_URL=$server/fine_settler_demo_daemon
config=$root/deploy/shard.example.toml
"$bin" --config "$config" migrate >/dev/null
months=$("$bin" --config "$config" plan | sed -nE 's/.*"business_date":"([0-9]{4}-[0-9]{2})-[0-9]{2}".*/\1/p')
i=0
for m in $months; do
  "$bin" demo-data --loans 3000 --seed $((100 + i)) --month "$m" --first-id $((1 + i * 100000)) >/dev/null
  i=$((i + 1))
done
echo "   loaded 3000 loans around each of: $(echo $months)"
pids=()
start=$(now_ms)
for s in 0 1 2; do
  FINE_SETTLER__INSTANCE__SHARD=$s FINE_SETTLER__SCHEDULE__PERIOD=1s \
    "$bin" --config "$config" run 2>"$work/replica.$s.log" &
  pids+=($!)
done
expected=$((3 * $(echo $months | wc -w)))
for _ in $(seq 1 600); do
  done_keys=$("$bin" runs --json | grep -c '"status":"SUCCESS"' || true)
  [ "$done_keys" -ge "$expected" ] && break
  sleep 0.1
done
took=$(( $(now_ms) - start ))
kill -TERM "${pids[@]}"
codes=()
for p in "${pids[@]}"; do
  if wait "$p"; then codes+=(0); else codes+=($?); fi
done
echo "   $done_keys of $expected keys SUCCESS after ${took} ms; replicas exited with ${codes[*]} on SIGTERM"
"$bin" runs | sed 's/^/   /'
for m in $months; do
  last=$("$bin" --config "$config" plan | sed -nE "s/.*\"business_date\":\"($m-[0-9]{2})\".*/\1/p" | head -n 1)
  printf '   verify %s: ' "$last"
  "$bin" verify --business-date "$last" | sed -nE 's/.*violations +([0-9]+).*/\1 violations/p'
done
if [ "$done_keys" -lt "$expected" ] || [ "${codes[*]}" != "0 0 0" ]; then
  echo "RESULT: the replicas did not settle every key" >&2
  cat "$work"/replica.*.log >&2
  exit 1
fi
echo "RESULT: three replicas settled ${expected} keys and stopped cleanly."
