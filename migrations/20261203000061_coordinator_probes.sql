-- What the statements over the coordinator's tables (`job_runs`) ask of the loans, the ledger and the queue, as
-- functions: the tick's late-row probe of a SUCCESS settlement key and its shard's queue counts
-- (src/store/job_runs/tick.rs), a RUNNING key's rows still to do and the queue counts on the status page
-- (src/store/status.rs), and a key's corrections in `runs` (src/store/job_runs/history.rs). Each is the subquery
-- it replaces, evaluated as that subquery was. Written as functions so that those statements name no distributed
-- table beside `job_runs` on Citus, where `job_runs` is a table of the coordinator and the loans, the ledger and
-- the queue are distributed: Citus refuses a statement joining the two ("direct joins between distributed and
-- local tables are not supported", Citus 14.0.1), and plans a subquery of a distributed table in a statement of
-- local tables as a result of its own, warning at each execution whose result is empty ("Query could not find
-- the intermediate result file"); it runs a function's query as a distributed query of its own. A function whose
-- body reads a table with a filter is never inlined into its caller (the scalar ones); the queue counts, a table
-- function, are inlined on PostgreSQL and kept whole on Citus (`migrate`). The bodies name their arguments by
-- position: a column of libraryd's `loans` named like an argument would otherwise take its place.
do $migration$
declare
    functions text := $functions$

create or replace function @schema.fine_settler_month_late(month_end date, shards int, shard int)
returns boolean language sql stable parallel safe as $$
    select exists (select 1 from @schema.loans l
                   where l.fine_settled_at is null and l.returned_on is not null
                     and l.returned_on between date_trunc('month', $1)::date and $1
                     and @schema.fine_settler_shard_of(l.id, $2) = $3 and isfinite(l.due_on))
$$;

create or replace function @schema.fine_settler_settlement_to_do(month_end date, after_id bigint, shards int,
                                                                 shard int)
returns bigint language sql stable parallel safe as $$
    select count(*) from @schema.loans l
    where l.fine_settled_at is null and l.returned_on is not null
      and l.returned_on between date_trunc('month', $1)::date and $1
      and l.id > $2 and @schema.fine_settler_shard_of(l.id, $3) = $4 and isfinite(l.due_on)
$$;

create or replace function @schema.fine_settler_accrual_to_do(the_day date, after_id bigint, shards int, shard int)
returns bigint language sql stable parallel safe as $$
    select count(*) from @schema.loans l
    cross join lateral @schema.fine_settler_policy_of(l.fine_class, l.due_on) p
    cross join lateral @schema.fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                              p.grace_days, p.cap_cents, p.charge_closed_days) a
    where l.id > $2 and @schema.fine_settler_shard_of(l.id, $3) = $4
      and l.due_on < $1 and (l.returned_on is null or l.returned_on >= $1)
      and a.amount_cents > 0
      and not exists (select 1 from @schema.fine_ledger f where f.loan_id = l.id and f.accrual_date = $1)
      and not exists (select 1 from @schema.fine_pending q where q.loan_id = l.id and q.accrual_date = $1)
$$;

create or replace function @schema.fine_settler_key_corrections(job text, day date, shards int, shard int)
returns bigint language sql stable parallel safe as $$
    select count(*) from @schema.fine_ledger_corrections c
    where c.business_date = $2 and c.job_name = $1 and c.shards = $3 and c.shard = $4
$$;

create or replace function @schema.fine_settler_pending_counts(shards int, shard int)
returns table (due_pending bigint, pending bigint, dead bigint) language sql stable parallel safe as $$
    select count(*) filter (where p.status = 'PENDING' and p.next_attempt_at <= now()),
           count(*) filter (where p.status = 'PENDING'),
           count(*) filter (where p.status = 'DEAD')
    from @schema.fine_pending p
    where @schema.fine_settler_shard_of(p.loan_id, $1) = $2
$$;

$functions$;
begin
    execute replace(functions, '@schema', quote_ident(current_schema()));
end $migration$;
