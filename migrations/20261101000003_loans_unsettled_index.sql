-- no-transaction
-- The settlement scan walks a shard's unsettled returned loans in id order (keyset by id). This partial index
-- holds exactly those rows, so it shrinks as months are settled. It is built CONCURRENTLY so that libraryd keeps
-- writing to loans while it is built; that cannot run inside a transaction, hence a migration of its own with a
-- single statement (a multi-statement string would run as one implicit transaction). If a build is interrupted it
-- leaves an INVALID index behind; `fine-settler migrate` drops such a leftover before applying migrations.
create index concurrently if not exists loans_unsettled_returned_idx
    on loans (id) where fine_settled_at is null and returned_on is not null;
