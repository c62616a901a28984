-- The canonical accrual amount of `day` for a loan: what the ledger's net for (loan, day) must be, a function of
-- the loan's dates and its policy alone — never of which other days happen to be charged — so that any order of
-- runs leaves the ledger one sequential run leaves.
--
-- A day is owed when it is after the grace period (`due_on + grace < day`) and the loan was not returned before
-- it (`returned_on is null or day <= returned_on`). The k-th owed day (k = 0 for the first) is charged
-- `clamp(cap - rate * k, 0, rate)`: the earliest days in full, the day that reaches the cap the remainder, nothing
-- after (cap 0 = no cap: every owed day the rate). Summed over a returned loan's owed days this is
-- `min(cap, rate * days)`, the fine the month-end settlement sets. A loan whose dates are not finite
-- (`-infinity`/`infinity`) owes nothing here (neither job touches it; `verify` reports it).
--
-- Overflow: the rate is at most 10^8 cents and a date difference at most 2^31 days, so `rate * k` < 2.2 * 10^17
-- fits a bigint. The Rust mirror is `FinePolicy::day_amount` (src/fine.rs); a property test holds them equal.
create or replace function fine_settler_day_amount(due_on date, returned_on date, day date, rate bigint,
                                                    grace int, cap bigint)
returns bigint language sql immutable parallel safe as $$
    select case
        when not (isfinite(due_on) and isfinite(day) and coalesce(isfinite(returned_on), true)) then 0::bigint
        when (day - due_on)::bigint <= grace or day > coalesce(returned_on, day) then 0::bigint
        when cap = 0 then rate
        else greatest(0::bigint, least(rate, cap - rate * ((day - due_on)::bigint - grace - 1)))
    end
$$;

-- The accrual's old re-open question walked every open overdue loan; the re-check reads the loans libraryd
-- changed instead (fine_loan_changes, migrations/20261202000014).
drop function if exists fine_settler_uncharged_days(date, date, int, int, int, bigint);
