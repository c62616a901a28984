-- One row per (job, business date, shard count, shard). Rows are kept forever: deduplication depends on them.
--
-- `shards` is part of the key on purpose. With (job_name, business_date, shard) alone, a shard that succeeded
-- under 3 shards would make shard 0 of 4 skip, and loans with id % 4 = 0 but id % 3 <> 0 would never be settled.
-- With it, a new shard count runs fresh partitions, and the conditional writes on loans make the overlap harmless.
create table if not exists job_runs (
    job_name text not null,
    business_date date not null,
    shards int not null,
    shard int not null,
    status text not null,
    owner text not null,
    epoch bigint not null,
    started_at timestamptz not null default now(),
    heartbeat_at timestamptz not null default now(),
    lease_until timestamptz not null,
    finished_at timestamptz,
    cursor bigint,
    scanned bigint not null default 0,
    updated bigint not null default 0,
    last_error text,
    constraint job_runs_pkey primary key (job_name, business_date, shards, shard),
    constraint job_runs_shard_range check (0 <= shard and shard < shards),
    constraint job_runs_status_known check (status in ('RUNNING', 'SUCCESS', 'FAILED')),
    constraint job_runs_epoch_positive check (epoch >= 1)
);

-- Append-only history: one row per claim, takeover, finish, failure, lease loss and release.
create table if not exists job_run_attempts (
    id bigint generated always as identity,
    job_name text not null,
    business_date date not null,
    shards int not null,
    shard int not null,
    epoch bigint not null,
    owner text not null,
    event text not null,
    scanned bigint,
    updated bigint,
    error text,
    at timestamptz not null default now(),
    constraint job_run_attempts_pkey primary key (id),
    constraint job_run_attempts_event_known check (
        event in ('claimed', 'takeover', 'forced', 'success', 'failed', 'lease_lost', 'released')
    )
);

create index if not exists job_run_attempts_key_idx
    on job_run_attempts (job_name, business_date, shards, shard, id);
