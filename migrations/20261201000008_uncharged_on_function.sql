-- The accrual days from `first` to `last` that have a loan of a shard still to charge: a loan overdue on the day
-- (due_on + grace < day, not returned before it), neither charged nor queued for it, and under the cap (0 = none).
-- This is the accrual's re-open question; the tick's status statement asks it once for the days of its window,
-- and `accrue` for its one day, so it is written once, here.
--
-- One pass over the candidates answers for every day at once: the overdue loans still out
-- (loans_open_by_due_idx) and the loans returned on or after `first` (loans_returned_late_idx — settled ones
-- too: a return recorded late may be settled before its days are re-accrued), each with its span of overdue days
-- in the window; a loan whose span has as many days charged or queued as days is done (two key-range probes per
-- loan; a queued day that is also charged counts once). Only for the few loans that are not are the missing days
-- listed. The `offset 0` fences keep the counts per loan and take the cap's sum only for the loans short of rows.
create or replace function fine_settler_uncharged_days(first date, last date, shards int, shard int, grace int,
                                                       cap bigint)
returns setof date language sql stable parallel safe as $$
    with candidates as (
        select l.id, l.due_on, l.returned_on from loans l
        where first <= last and l.returned_on is null and l.due_on < last - grace and l.id % shards = shard
        union all
        select l.id, l.due_on, l.returned_on from loans l
        where first <= last and l.returned_on > l.due_on
          and l.returned_on >= first and l.due_on < last - grace and l.id % shards = shard
    ), spans as (
        select id, greatest(first, due_on + grace + 1) as d0, least(last, coalesce(returned_on, last)) as d1
        from candidates
    ), short as (
        select s.id, s.d0, s.d1 from spans s
        where s.d0 <= s.d1
          and (select count(*) from fine_ledger f
               where f.loan_id = s.id and f.accrual_date between s.d0 and s.d1)
            + (select count(*) from fine_pending p
               where p.loan_id = s.id and p.accrual_date between s.d0 and s.d1
                 and not exists (select 1 from fine_ledger f
                                 where f.loan_id = p.loan_id and f.accrual_date = p.accrual_date))
              < s.d1 - s.d0 + 1
        offset 0
    ), owed as (
        select s.* from short s
        where cap = 0 or coalesce((select sum(f.amount_cents) from fine_ledger f where f.loan_id = s.id), 0) < cap
        offset 0
    )
    select distinct d::date from owed s
    cross join generate_series(s.d0, s.d1, interval '1 day') d
    where not exists (select 1 from fine_ledger f where f.loan_id = s.id and f.accrual_date = d::date)
      and not exists (select 1 from fine_pending p where p.loan_id = s.id and p.accrual_date = d::date)
$$;
