-- The fine rules with closed days, written once for SQL. The Rust mirror is `crate::policy` (src/policy/); a
-- property test against the database (tests/it/policy.rs) holds the two equal over random loans, policies and
-- calendars.
--
-- A day D is chargeable for a loan when `due_on + grace < D` (grace counts calendar days), the loan was not
-- returned before D (`returned_on is null or D <= returned_on`), and D is not closed — unless the policy charges
-- closed days. The settled fine is `min(cap, rate * chargeable days in (due_on + grace, returned_on])` (cap 0 =
-- none); the k-th chargeable day (k = 0 for the first) owes `clamp(cap - rate * k, 0, rate)` and a day that is not
-- chargeable owes 0, so a returned loan's days add up to its fine (fine_settler_day_amount's rule,
-- migrations/20261202000012, with only chargeable days counted). Dates that are not finite owe nothing.
--
-- How a batch calls them: the rule functions take the policy's values as arguments, so a batch joins the policy
-- once per loan and passes its columns, each function a one-row table joined laterally:
--
--     from loans l
--     cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
--     cross join lateral fine_settler_policy_fine(l.due_on, l.returned_on, p.daily_rate_cents, p.grace_days,
--                                                 p.cap_cents, p.charge_closed_days) f   -- f.fine_cents
--
-- They are one-row tables rather than scalars because the planner inlines a SQL table function into the calling
-- statement (a scalar function whose body has a sub-select is called, and planned, once per row): measured on
-- 200,000 loans, 22 µs a loan inlined against 85 µs called, and 400 µs called with a `set search_path` clause.
-- For the same reason their search path is not pinned with `set` (that too stops inlining); instead every table
-- and function they name is qualified with fine-settler's schema when this migration creates them (`@schema`
-- below), so that no session's search path or temporary table changes a fine. Each loan costs at most four
-- probes of a primary key (two for its policy, two for the closed days in its span), none of which grows with
-- the length of its overdue span. `fine_settler_loan_fine` and `fine_settler_loan_day_amount` are scalar
-- conveniences for one loan (an operator's query, a test), looking the policy up themselves.
--
-- Overflow: the rate is at most 10^8 cents and a day count at most 2^31, so `rate * k` fits a bigint; `due_on +
-- grace` is computed only when a later day exists, so it is a valid date.
do $migration$
declare
    functions text := $functions$

-- How many closed days there are up to and including `d`: the ordinal of the last closed day on or before it
-- (migrations/20261203000052), one backward probe of the primary key.
create or replace function @schema.fine_settler_closed_through(d date) returns table (closed bigint)
language sql stable parallel safe as $$
    select coalesce((select c.ordinal from @schema.library_closed_days c
                     where c.day <= d order by c.day desc limit 1), 0::bigint)
$$;

-- The chargeable days in `(lo, hi]` when every day in it is after the grace period and before the return: the
-- span's length less its closed days (unless closed days are charged). 0 for an empty span.
create or replace function @schema.fine_settler_chargeable_days(lo date, hi date, charge_closed boolean)
returns table (days bigint) language sql stable parallel safe as $$
    select case
        when not (isfinite(lo) and isfinite(hi)) or hi <= lo then 0::bigint
        when charge_closed then (hi - lo)::bigint
        else (hi - lo)::bigint - (select a.closed - b.closed
                                  from @schema.fine_settler_closed_through(hi) a,
                                       @schema.fine_settler_closed_through(lo) b)
    end
$$;

-- What the ledger's net for (loan, `the_day`) must be under the policy `(rate, grace, cap, charge_closed)`.
create or replace function @schema.fine_settler_policy_day_amount(due_on date, returned_on date, the_day date,
                                                                  rate bigint, grace int, cap bigint,
                                                                  charge_closed boolean)
returns table (amount_cents bigint) language sql stable parallel safe as $$
    select case
        when not (isfinite(due_on) and isfinite(the_day) and coalesce(isfinite(returned_on), true)) then 0::bigint
        when (the_day - due_on)::bigint <= grace or the_day > coalesce(returned_on, the_day) then 0::bigint
        when not charge_closed and exists (select 1 from @schema.library_closed_days c where c.day = the_day)
            then 0::bigint
        when cap = 0 then rate
        else (select greatest(0::bigint, least(rate, cap - rate * k.days))
              from @schema.fine_settler_chargeable_days(due_on + grace, the_day - 1, charge_closed) k)
    end
$$;

-- The fine settlement sets for a loan returned on `returned_on`: 0 while it is out (null) or when a date is not
-- finite.
create or replace function @schema.fine_settler_policy_fine(due_on date, returned_on date, rate bigint,
                                                            grace int, cap bigint, charge_closed boolean)
returns table (fine_cents bigint) language sql stable parallel safe as $$
    select case
        when returned_on is null or not (isfinite(due_on) and isfinite(returned_on)) then 0::bigint
        when (returned_on - due_on)::bigint <= grace then 0::bigint
        else (select case when cap = 0 then rate * k.days else least(cap, rate * k.days) end
              from @schema.fine_settler_chargeable_days(due_on + grace, returned_on, charge_closed) k)
    end
$$;

-- The policy that governs a loan of class `loan_class` due on `loan_due_on`: the row of its class with the latest
-- `effective_from <= loan_due_on`, else the `default` class's (also for a null class). No row when not even the
-- `default` class has one for that date (an empty table: `migrate` seeds it). Two probes of the primary key.
create or replace function @schema.fine_settler_policy_of(loan_class text, loan_due_on date)
returns table (fine_class text, effective_from date, daily_rate_cents bigint, grace_days int, cap_cents bigint,
               charge_closed_days boolean)
language sql stable parallel safe as $$
    select p.fine_class, p.effective_from, p.daily_rate_cents, p.grace_days, p.cap_cents, p.charge_closed_days
    from ((select 0 as pick, f.* from @schema.fine_policies f
           where f.fine_class = loan_class and f.effective_from <= loan_due_on
           order by f.effective_from desc limit 1)
          union all
          (select 1 as pick, f.* from @schema.fine_policies f
           where f.fine_class = 'default' and f.effective_from <= loan_due_on
           order by f.effective_from desc limit 1)) p
    order by p.pick
    limit 1
$$;

-- The canonical amount of `the_day` for a loan, its policy looked up; null when no policy governs it.
create or replace function @schema.fine_settler_loan_day_amount(loan_class text, due_on date, returned_on date,
                                                                the_day date)
returns bigint language sql stable parallel safe as $$
    select a.amount_cents
    from @schema.fine_settler_policy_of(loan_class, due_on) p
    cross join lateral @schema.fine_settler_policy_day_amount(due_on, returned_on, the_day, p.daily_rate_cents,
                                                              p.grace_days, p.cap_cents, p.charge_closed_days) a
$$;

-- The settled fine of a loan, its policy looked up; null when no policy governs it.
create or replace function @schema.fine_settler_loan_fine(loan_class text, due_on date, returned_on date)
returns bigint language sql stable parallel safe as $$
    select f.fine_cents
    from @schema.fine_settler_policy_of(loan_class, due_on) p
    cross join lateral @schema.fine_settler_policy_fine(due_on, returned_on, p.daily_rate_cents, p.grace_days,
                                                        p.cap_cents, p.charge_closed_days) f
$$;

$functions$;
begin
    execute replace(functions, '@schema', quote_ident(current_schema()));
end $migration$;
