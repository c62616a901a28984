-- no-transaction
-- The keys in progress of each shard: a replica's status statement asks whether another shard of its count has
-- a live owner for any key (its replica is busy with a long run — a month-end settlement, a throttled or waiting
-- run — and has not claimed the newer keys yet), so that such a shard is never counted as one nobody runs. A few
-- rows at any time, whatever the table's history. Built CONCURRENTLY so the upgrade blocks no claim.
create index concurrently if not exists job_runs_running_idx on job_runs (shards, shard) where status = 'RUNNING';
