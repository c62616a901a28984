-- The one definition of shard membership: loan `id` belongs to shard `fine_settler_shard_of(id, shards)` of
-- `shards`, in `0 .. shards - 1` for every id, negative ones included. PostgreSQL's `%` takes the sign of the
-- dividend (`-3 % 2 = -1`), so `id % shards = shard` left every negative id that is not a multiple of the count
-- to no shard, never settled nor accrued; adding `shards` and taking the remainder again maps it into range, and
-- leaves `id % shards` unchanged for every id >= 0, so no existing key changes its loans.
--
-- Every query that asks for a shard's rows calls this function; `ShardSpec::owns` (src/shard.rs) is its mirror in
-- Rust, and a test checks that the two agree. A single `select` of an immutable, non-strict SQL function is
-- inlined by the planner: the predicate costs what the expression costs and stays a filter on the index scans
-- that walk a shard's rows, as `id % shards = shard` was. The arithmetic is bigint (`id % shards` lies strictly
-- between `-shards` and `shards`), so it cannot overflow.
create or replace function fine_settler_shard_of(id bigint, shards int) returns int
language sql immutable parallel safe as $$
    select (((id % shards) + shards) % shards)::int
$$;
