-- Pauses an operator set with `fine-settler pause` (and lifted with `resume`): while a job has a pause that
-- covers a shard, no replica claims that shard's keys of the job, and a run in progress hands its key back after
-- its current batch. `shards = 0` (with `shard = 0`) is a pause of the whole job, every shard of every shard
-- count; otherwise the pause covers shard `shard` of `shards` only. One row per scope: pausing again changes
-- nothing.
create table if not exists job_pauses (
    job_name text not null,
    shards int not null,
    shard int not null,
    paused_by text not null,
    reason text not null,
    paused_at timestamptz not null default now(),
    constraint job_pauses_pkey primary key (job_name, shards, shard),
    constraint job_pauses_scope check ((shards = 0 and shard = 0) or (0 <= shard and shard < shards))
);

-- Every pause and resume, append-only: who, why, when, and for a resume how long the job had been paused.
create table if not exists job_pause_events (
    id bigint generated always as identity,
    job_name text not null,
    shards int not null,
    shard int not null,
    event text not null,
    by text not null,
    reason text,
    paused_at timestamptz,
    at timestamptz not null default now(),
    constraint job_pause_events_pkey primary key (id),
    constraint job_pause_events_event_known check (event in ('paused', 'resumed'))
);
