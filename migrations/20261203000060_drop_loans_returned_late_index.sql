-- no-transaction
-- loans_returned_late_idx (migration 20261201000009) no longer pays for itself: it was built for the daemon's
-- late-row question of an accrual day (the loans returned late on or after it, settled or not); the daemon now
-- asks the queue of the loans libraryd changed (fine_loan_changes) instead, and none of its regular statements
-- reads the index. It kept an entry for every late return of history — each late return, and each settlement of a late
-- loan, paid one (bench/RESULTS.md, "fine-settler's indexes on libraryd's loans") — for the other branch of the
-- same operator questions as loans_open_by_due_idx, which read the table instead now. Dropped CONCURRENTLY, in a
-- migration of its own.
drop index concurrently if exists loans_returned_late_idx;
