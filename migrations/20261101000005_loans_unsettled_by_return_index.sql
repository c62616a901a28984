-- no-transaction
-- The same rows as loans_unsettled_returned_idx, ordered by return date: a run first asks through this index
-- whether its month has any unsettled loan at all; a settled month has no entries here, so a rerun or a forced
-- rerun finishes at once instead of walking every other month's unsettled loans. Built CONCURRENTLY, in a
-- migration of its own, like the other index.
create index concurrently if not exists loans_unsettled_by_return_idx
    on loans (returned_on, id) where fine_settled_at is null and returned_on is not null;
