-- Why a correction of (loan, day) is written, as `fine_ledger_corrections.reason` names it: written once, for the
-- correction of a run's own day and for those a run writes on the other days of a changed loan with a cap
-- (src/store/corrections.rs). `target` is the day's canonical amount (`fine_settler_day_amount`), `net` what the
-- day holds, `seq` the correction's number and `charged_at` when the day was first charged.
--   returned        nothing is owed: the loan was returned before the day (a late, back-dated return)
--   due-date-moved  nothing is owed: the day is inside the due date and its grace (the due date moved later)
--   cap             the day's amount changed (the day that reaches the cap moved), or nothing is owed past the cap
--   reinstated      a day corrected away is owed again (a return removed, a due date moved back)
--   canonical       a charge written before canonical amounts, brought to its canonical amount
create or replace function fine_settler_correction_reason(due_on date, returned_on date, day date, grace int,
                                                          target bigint, net numeric, seq int,
                                                          charged_at timestamptz)
returns text language sql stable parallel safe as $$
    select case
        when target = 0 and returned_on is not null and isfinite(returned_on) and day > returned_on then 'returned'
        when target = 0 and (not isfinite(due_on) or (day - due_on)::bigint <= grace) then 'due-date-moved'
        when target = 0 then 'cap'
        when net = 0 then 'reinstated'
        when seq = 1 and charged_at < (select m.at from fine_settler_marks m where m.name = 'canonical-amounts')
            then 'canonical'
        else 'cap'
    end
$$;

-- The marks table is read by name: pin the search path to the schema the migration runs in.
do $$
begin
    execute format('alter function fine_settler_correction_reason(date, date, date, int, bigint, numeric, int, '
                   'timestamptz) set search_path = %I, pg_temp', current_schema());
end
$$;
