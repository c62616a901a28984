#!/usr/bin/env bash
# Regenerates the committed offline query data (.sqlx) against a scratch database migrated from migrations/.
#   scripts/prepare-sqlx.sh          rewrite .sqlx
#   scripts/prepare-sqlx.sh --check  fail if .sqlx differs from what the current queries need
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

base=${DATABASE_URL:-$(scripts/pg.sh start test)}
server=${base%/*}
# One scratch database per checkout, so that two checkouts sharing a server can regenerate at once.
db=fine_settler_sqlx_prepare_$(printf '%s' "$root" | md5sum | cut -c1-8)
psql "$base" -qX -v ON_ERROR_STOP=1 -c "drop database if exists $db" -c "create database $db" >/dev/null
for f in migrations/*.sql; do
  psql "$server/$db" -qX -v ON_ERROR_STOP=1 -f "$f" >/dev/null 2>&1 || { psql "$server/$db" -X -v ON_ERROR_STOP=1 -f "$f"; exit 1; }
done

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Force the query macros to expand again (they are not re-run when only the environment changes).
cargo clean -p fine-settler >/dev/null 2>&1
SQLX_OFFLINE=false SQLX_OFFLINE_DIR="$out" DATABASE_URL="$server/$db" cargo check --all-targets --quiet
psql "$base" -qX -c "drop database if exists $db" >/dev/null

if [ "${1:-}" = "--check" ]; then
  if ! diff -r "$out" .sqlx >/dev/null 2>&1; then
    echo "prepare-sqlx: .sqlx is stale; run scripts/prepare-sqlx.sh and commit the result" >&2
    diff -r "$out" .sqlx >&2 || true
    exit 1
  fi
  echo ".sqlx is fresh ($(ls "$out" | wc -l) queries)"
else
  rm -rf .sqlx && mkdir .sqlx && cp "$out"/*.json .sqlx/
  echo "wrote $(ls .sqlx | wc -l) queries to .sqlx"
fi
