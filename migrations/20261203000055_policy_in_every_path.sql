-- Every amount fine-settler writes or checks now comes from the loan's policy (fine_settler_policy_of) and the
-- closed days (migrations/20261203000053): settlement, the accrual's charges and corrections, the re-check,
-- `verify` and `backfill --dry-run`. This migration adds what that needs around the functions.
set local lock_timeout = '5s';

-- 1. A correction that takes away the charge of a day the library has since closed (the snow day recorded the
--    next morning) says so. The constraint is replaced without a long lock: added NOT VALID (a catalogue change),
--    then validated under a lock that lets libraryd and the replicas go on writing.
alter table fine_ledger_corrections drop constraint if exists fine_ledger_corrections_reason_known;
alter table fine_ledger_corrections add constraint fine_ledger_corrections_reason_known
    check (reason in ('returned', 'due-date-moved', 'closed-day', 'cap', 'reinstated', 'canonical')) not valid;
alter table fine_ledger_corrections validate constraint fine_ledger_corrections_reason_known;

-- Why a correction of (loan, `the_day`) is written, under the policy `(grace, charge_closed)` that governs the
-- loan (fine_settler_correction_reason of migrations/20261202000031 with the closed days):
--   returned        nothing is owed: the loan was returned before the day (a late, back-dated return)
--   due-date-moved  nothing is owed: the day is inside the due date and its grace (the due date moved later)
--   closed-day      nothing is owed: the library is closed that day and the policy does not charge closed days
--   cap             the day's amount changed (the day that reaches the cap moved, the loan's class changed), or
--                   nothing is owed past the cap
--   reinstated      a day corrected away is owed again (a return removed, a due date moved back, a day opened)
--   canonical       a charge written before canonical amounts, brought to its canonical amount
do $migration$
begin
    execute replace($function$
create or replace function @schema.fine_settler_correction_reason(due_on date, returned_on date, the_day date,
                                                                  grace int, charge_closed boolean,
                                                                  target bigint, net numeric, seq int,
                                                                  charged_at timestamptz)
returns text language sql stable parallel safe as $$
    select case
        when target = 0 and returned_on is not null and isfinite(returned_on) and the_day > returned_on
            then 'returned'
        when target = 0 and (not isfinite(due_on) or (the_day - due_on)::bigint <= grace) then 'due-date-moved'
        when target = 0 and not charge_closed
             and exists (select 1 from @schema.library_closed_days c where c.day = the_day) then 'closed-day'
        when target = 0 then 'cap'
        when net = 0 then 'reinstated'
        when seq = 1 and charged_at < (select m.at from @schema.fine_settler_marks m
                                       where m.name = 'canonical-amounts') then 'canonical'
        else 'cap'
    end
$$;
$function$, '@schema', quote_ident(current_schema()));
end $migration$;

-- 2. A loan whose class libraryd changes may owe other amounts for the days already charged: the change is
--    queued for the re-check like a change of its dates — once the loan is due (a day before tomorrow, whatever
--    the session's zone, as for a loan inserted): a class set after checkout concerns no charged day.
drop trigger if exists fine_settler_loan_changed on loans;
create trigger fine_settler_loan_changed after update on loans
    for each row when (old.id is distinct from new.id or old.due_on is distinct from new.due_on
                       or old.returned_on is distinct from new.returned_on
                       or (old.fine_class is distinct from new.fine_class and new.due_on < current_date + 1))
    execute function fine_settler_note_loan_change();

-- 3. A policy version is a fact the fines of loans already due rest on: it is never rewritten or removed
--    (`policy add` only appends). Without this guard an operator's `delete` of the seeded `default` row would
--    leave loans with no policy at all, and an `update` would change fines already settled.
create or replace function fine_settler_policy_is_history() returns trigger
language plpgsql as $$
begin
    raise exception 'fine_policies rows are never updated or deleted: add a version with a later effective_from '
                    '(fine-settler policy add)'
        using errcode = 'check_violation';
end $$;
drop trigger if exists fine_settler_policy_is_history on fine_policies;
create trigger fine_settler_policy_is_history before update or delete on fine_policies
    for each row execute function fine_settler_policy_is_history();
drop trigger if exists fine_settler_policy_not_truncated on fine_policies;
create trigger fine_settler_policy_not_truncated before truncate on fine_policies
    for each statement execute function fine_settler_policy_is_history();

-- 4. What a version may be when it is added, whoever adds it (`policy add` checks the same first, with the
--    configured zone, and says it in its own words):
--    - the first row of the table is the `default` class's from the earliest date (`migrate` seeds it from the
--      [fine] keys): with it every loan, whatever its class and due date, has a version, for ever (rows are never
--      removed), and no run can leave a loan unpriced;
--    - every later version takes effect from today (by UTC) on: it governs only loans not yet due, so it never
--      re-prices a day already charged or a fine already settled — and the accrual's cap guard, which takes its
--      loan locks only when some version has a cap (src/store/ledger.rs, lock_loans), can never meet a capped
--      version that governs a loan a run in flight is charging.
--    A superuser who must repair the table does so with triggers off (`set session_replication_role = replica`),
--    knowingly.
create or replace function fine_settler_policy_is_new() returns trigger
language plpgsql as $$
begin
    if not exists (select 1 from fine_policies) then
        if new.fine_class <> 'default' or new.effective_from <> '4714-11-24 BC'::date then
            raise exception 'the first fine policy must be the default class''s from 4714-11-24 BC, so that every loan '
                            'has one: run `fine-settler migrate`, which seeds it from the [fine] keys'
                using errcode = 'check_violation';
        end if;
    elsif new.effective_from < (now() at time zone 'UTC')::date then
        raise exception 'a fine policy version must take effect from today on (effective_from %): a new rule governs '
                        'loans falling due from then on, never loans already due', new.effective_from
            using errcode = 'check_violation';
    end if;
    return new;
end $$;
do $$ begin
    execute format('alter function fine_settler_policy_is_new() set search_path = %I, pg_temp', current_schema());
end $$;
drop trigger if exists fine_settler_policy_is_new on fine_policies;
create trigger fine_settler_policy_is_new before insert on fine_policies
    for each row execute function fine_settler_policy_is_new();
