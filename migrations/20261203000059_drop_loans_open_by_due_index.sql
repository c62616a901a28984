-- no-transaction
-- loans_open_by_due_idx (migration 20261201000006) no longer pays for itself: it was built for the daemon's
-- question, at every tick, whether an accrual day it had run gained overdue loans; the daemon now asks the queue
-- of the loans libraryd changed (fine_loan_changes) instead, and none of the daemon's regular statements reads the
-- index (it asks a done day's question only when a claim finds the key a peer just finished). Every
-- checkout of libraryd's paid an entry in it (about a third more WAL per `insert`, bench/RESULTS.md, "fine-settler's
-- indexes on libraryd's loans") for operator commands — `verify`, `accrue`/`backfill` of a day already done,
-- `calendar close`/`open` — that read the table instead now, a second or so longer at 1,000,000 loans. Dropped
-- CONCURRENTLY, in a migration of its own, so libraryd keeps writing meanwhile.
drop index concurrently if exists loans_open_by_due_idx;
