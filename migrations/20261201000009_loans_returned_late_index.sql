-- no-transaction
-- Loans returned late, by return date, settled or not: the accrual's late-row question
-- (fine_settler_uncharged_days) looks for loans returned on or after the first day of its window — a week's
-- returns — including those a settlement run has already settled, since a return recorded late can be settled
-- before its overdue days are re-accrued. Only a loan returned after its due date can have overdue days, so only
-- those are indexed: every other settled loan costs settlement no entry here. Built CONCURRENTLY, in a migration
-- of its own, like the other indexes.
create index concurrently if not exists loans_returned_late_idx
    on loans (returned_on, id) include (due_on) where returned_on > due_on;
