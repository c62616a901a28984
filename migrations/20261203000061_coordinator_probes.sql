-- What the statements over the coordinator's tables (`job_runs`) ask of the loans and the ledger, per key, as
-- functions: the tick's late-row probe of a SUCCESS settlement key (src/store/job_runs/tick.rs), a RUNNING key's
-- rows still to do on the status page (src/store/status.rs) and a key's corrections in `runs`
-- (src/store/job_runs/history.rs). Each is the subquery it replaces, called once per key as that subquery was
-- evaluated. Written as functions so that those statements name no distributed table beside `job_runs` on
-- Citus, where `job_runs` is a table of the coordinator and the loans and the ledger are distributed: Citus
-- refuses a statement joining the two ("direct joins between distributed and local tables are not supported",
-- Citus 14.0.1), but runs a function's query as a distributed query of its own. (A function whose body reads a
-- table is never inlined into its caller, on either engine.)
do $migration$
declare
    functions text := $functions$

create or replace function @schema.fine_settler_month_late(month_end date, shards int, shard int)
returns boolean language sql stable parallel safe as $$
    select exists (select 1 from @schema.loans l
                   where l.fine_settled_at is null and l.returned_on is not null
                     and l.returned_on between date_trunc('month', month_end)::date and month_end
                     and @schema.fine_settler_shard_of(l.id, shards) = shard and isfinite(l.due_on))
$$;

create or replace function @schema.fine_settler_settlement_to_do(month_end date, after_id bigint, shards int,
                                                                 shard int)
returns bigint language sql stable parallel safe as $$
    select count(*) from @schema.loans l
    where l.fine_settled_at is null and l.returned_on is not null
      and l.returned_on between date_trunc('month', month_end)::date and month_end
      and l.id > after_id and @schema.fine_settler_shard_of(l.id, shards) = shard and isfinite(l.due_on)
$$;

create or replace function @schema.fine_settler_accrual_to_do(the_day date, after_id bigint, shards int, shard int)
returns bigint language sql stable parallel safe as $$
    select count(*) from @schema.loans l
    cross join lateral @schema.fine_settler_policy_of(l.fine_class, l.due_on) p
    cross join lateral @schema.fine_settler_policy_day_amount(l.due_on, l.returned_on, the_day, p.daily_rate_cents,
                                                              p.grace_days, p.cap_cents, p.charge_closed_days) a
    where l.id > after_id and @schema.fine_settler_shard_of(l.id, shards) = shard
      and l.due_on < the_day and (l.returned_on is null or l.returned_on >= the_day)
      and a.amount_cents > 0
      and not exists (select 1 from @schema.fine_ledger f where f.loan_id = l.id and f.accrual_date = the_day)
      and not exists (select 1 from @schema.fine_pending q where q.loan_id = l.id and q.accrual_date = the_day)
$$;

create or replace function @schema.fine_settler_key_corrections(job text, day date, shards int, shard int)
returns bigint language sql stable parallel safe as $$
    select count(*) from @schema.fine_ledger_corrections c
    where c.business_date = day and c.job_name = job and c.shards = fine_settler_key_corrections.shards
      and c.shard = fine_settler_key_corrections.shard
$$;

$functions$;
begin
    execute replace(functions, '@schema', quote_ident(current_schema()));
end $migration$;
