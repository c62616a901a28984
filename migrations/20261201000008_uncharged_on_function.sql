-- Whether a day has a loan of a shard still to charge: not settled, overdue on the day (due_on + grace < day,
-- not returned before it), neither charged nor queued for it, and under the cap (0 = none). This is the
-- accrual's re-open question; the tick's status statement asks it for each accrual day of its window that has
-- succeeded, and `accrue` for its one day, so it is written once, here.
--
-- It walks the overdue loans still out (loans_open_by_due_idx) and the unsettled loans returned on or after the
-- day (loans_unsettled_returned_idx), with one key probe of the ledger and of the queue per loan; the `offset 0`
-- fences keep those probes per loan (rather than a hash of the whole ledger) and take the cap's sum only for
-- the loans still to charge.
create or replace function fine_settler_uncharged_on(day date, shards int, shard int, grace int, cap bigint)
returns boolean language sql stable parallel safe as $$
    select exists (
               select 1 from (select l.id from loans l
                              where l.returned_on is null and l.due_on < day - grace
                                and l.id % shards = shard
                                and not exists (select 1 from fine_ledger f
                                                where f.loan_id = l.id and f.accrual_date = day offset 0)
                                and not exists (select 1 from fine_pending p
                                                where p.loan_id = l.id and p.accrual_date = day offset 0)
                              offset 0) c
               where cap = 0 or coalesce((select sum(f.amount_cents) from fine_ledger f
                                          where f.loan_id = c.id), 0) < cap)
        or exists (
               select 1 from (select l.id from loans l
                              where l.fine_settled_at is null and l.returned_on is not null
                                and l.returned_on >= day and l.due_on < day - grace
                                and l.id % shards = shard
                                and not exists (select 1 from fine_ledger f
                                                where f.loan_id = l.id and f.accrual_date = day offset 0)
                                and not exists (select 1 from fine_pending p
                                                where p.loan_id = l.id and p.accrual_date = day offset 0)
                              offset 0) c
               where cap = 0 or coalesce((select sum(f.amount_cents) from fine_ledger f
                                          where f.loan_id = c.id), 0) < cap)
$$;
