#!/usr/bin/env bash
# The settlement benchmark, in one command. Builds the release binaries (fine-settler, and fine-settler-bench from
# the bench/ crate, both into target/release), starts the private bench cluster (target/pg-bench, with
# pg_stat_statements; BENCH_DATABASE_URL names another server instead), and runs fine-settler-bench, which writes
# bench/RESULTS.md. When the server is the bench cluster (FINE_SETTLER_PG_PORT chooses its port, as for pg.sh), the
# benchmark also settles through PgBouncer in transaction and in session mode, starting and stopping each bouncer
# with scripts/pgbouncer.sh (FINE_SETTLER_PGBOUNCER_PORT chooses one port for both: they run one after the other);
# on another server that leg is left out, and the report says so.
# The impact section drives a load with pgbench, from the folder scripts/pg-bin.sh names (as for the server's
# programs: FINE_SETTLER_PG_BIN, otherwise the newest of /usr/lib/postgresql/*/bin, otherwise pg_config's
# bindir); without one that leg is left out too, and the report says so.
# The accrual section (one accrual day against one set-based statement, the re-check at 1M and 5M open overdue
# loans) also measures the ledger before canonical amounts when FINE_SETTLER_BENCH_BEFORE names that version's
# fine-settler binary (built at commit 71619a5: `cargo build --release -p fine-settler` in a checkout of it).
#   scripts/bench.sh           the full run: 1M loans, impact on a load, batch-size sweep, scaling (100k, 4M, 10M;
#                              4 shards), drift, accrual
#   scripts/bench.sh --quick   a smoke run (20k loans, a short impact section, a small accrual section) that writes
#                              target/bench-smoke.md
#   scripts/bench.sh --accrual the accrual section alone, merged into bench/RESULTS.md in place of the one there
#                              (the other sections' figures kept; its header says which sections were measured when)
#   scripts/bench.sh --rules   the fine rules section alone (settlement and an accrual day under versioned policies,
#                              item classes and closed days; a loan's cost by its overdue span), merged likewise
#   scripts/bench.sh --indexes what fine-settler's four indexes on loans cost libraryd's checkouts and returns (all,
#                              none, each left out) and what each buys settlement, accrual, the daemon's idle tick
#                              and re-check, and verify, merged likewise
#   scripts/bench.sh --impact  the impact section alone (1M loans: settle beside a pgbench load with its defaults,
#                              throttled, under a commit latency budget, each against a plain writer of its WAL
#                              rate), merged likewise with its rows of the targets table
#   scripts/bench.sh --citus   the Citus section alone (the month's settlement of 1M loans on the cluster of
#                              scripts/citus.sh, which it starts: `settle` with 1 and 2 replicas against the same
#                              computation as one distributed update), merged likewise; the bench cluster is not used
#   scripts/bench.sh ARGS...   any fine-settler-bench arguments (see --help)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

cargo build --release --locked --quiet -p fine-settler -p fine-settler-bench
if [ "${1:-}" = "--citus" ]; then
  shift
  citus_url=$(scripts/citus.sh start)
  exec target/release/fine-settler-bench --citus-only "$citus_url" --merge-into bench/RESULTS.md "$@"
fi
DATABASE_URL=${BENCH_DATABASE_URL:-$(scripts/pg.sh start bench)}
export DATABASE_URL
# pgbouncer.sh fronts the bench cluster of pg.sh: only when that is the server measured.
pooler=()
if [ "${DATABASE_URL%/*}" = "$(scripts/pg.sh url bench | sed 's|/[^/]*$||')" ]; then
  pooler=(--pgbouncer "$root/scripts/pgbouncer.sh")
else
  echo "bench.sh: $DATABASE_URL is not the bench cluster of scripts/pg.sh; leaving out the PgBouncer leg" >&2
fi
pgbin=$(scripts/pg-bin.sh 2>/dev/null || true)
load=()
if [ -n "$pgbin" ] && [ -x "$pgbin/pgbench" ]; then
  load=(--pgbench "$pgbin/pgbench")
else
  echo "bench.sh: no pgbench beside the PostgreSQL programs of scripts/pg-bin.sh (${pgbin:-none found}); leaving out the impact section" >&2
fi
before=()
if [ -n "${FINE_SETTLER_BENCH_BEFORE:-}" ]; then
  before=(--before-binary "$FINE_SETTLER_BENCH_BEFORE")
fi
if [ "${1:-}" = "--quick" ]; then
  exec target/release/fine-settler-bench --loans 20000 --sweep 1000,5000 "${pooler[@]}" "${load[@]}" \
    --idle-secs 3 --warmup-secs 1 --cooldown-secs 1 "${before[@]}" --accrual-loans 20000 --accrual-rounds 1 \
    --recheck-returns 200 --recheck-loans 20000 --recheck-changed 100 --tick-secs 2 --rules-loans 20000 \
    --rules-rounds 1 --index-loans 20000 --index-ops 200 --index-plan-runs 3 --index-verify-runs 2 \
    --out target/bench-smoke.md
elif [ "${1:-}" = "--accrual" ]; then
  shift
  exec target/release/fine-settler-bench --accrual-only "${before[@]}" --merge-into bench/RESULTS.md "$@"
elif [ "${1:-}" = "--rules" ]; then
  shift
  exec target/release/fine-settler-bench --rules-only --merge-into bench/RESULTS.md "$@"
elif [ "${1:-}" = "--indexes" ]; then
  shift
  exec target/release/fine-settler-bench --indexes-only --merge-into bench/RESULTS.md "$@"
elif [ "${1:-}" = "--impact" ]; then
  shift
  if [ ${#load[@]} -eq 0 ]; then
    echo "bench.sh --impact: no pgbench to drive the load" >&2
    exit 2
  fi
  exec target/release/fine-settler-bench --impact-only "${load[@]}" --merge-into bench/RESULTS.md "$@"
elif [ $# -eq 0 ]; then
  exec target/release/fine-settler-bench --scaling --drift "${pooler[@]}" "${load[@]}" "${before[@]}" \
    --out bench/RESULTS.md
else
  exec target/release/fine-settler-bench "${pooler[@]}" "${load[@]}" "${before[@]}" "$@"
fi
