-- no-transaction
-- Loans still out, by due date: a tick asks, for each accrual day it has already run, whether some loan became
-- overdue on that day after the run (a due date shortened, a loan recorded late with an old borrowing date),
-- and that question walks only the overdue loans still out, through this index, instead of the whole table.
-- It holds only the loans not yet returned, so it stays small. Built CONCURRENTLY, in a migration of its own,
-- like the other indexes, so libraryd keeps writing while it is built.
create index concurrently if not exists loans_open_by_due_idx
    on loans (due_on, id) where returned_on is null;
