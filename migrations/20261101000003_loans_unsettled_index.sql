-- no-transaction
-- The settlement scan walks a shard's unsettled returned loans in id order (keyset by id). This partial index
-- holds exactly those rows, so it shrinks as months are settled; with returned_on as a key column and due_on
-- included, finding the next batch is an index-only scan (see bench/RESULTS.md for the measurements behind it).
-- It is built CONCURRENTLY so that libraryd keeps writing to loans while it is built; that cannot run inside a
-- transaction, hence a migration of its own with a single statement (a multi-statement string would run as one
-- implicit transaction). If a build is interrupted it leaves an INVALID index behind; `fine-settler migrate`
-- drops such a leftover before applying migrations.
create index concurrently if not exists loans_unsettled_returned_idx
    on loans (id, returned_on) include (due_on) where fine_settled_at is null and returned_on is not null;
