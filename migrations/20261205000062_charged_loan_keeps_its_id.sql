-- A loan's charges are kept under its id (fine_ledger, fine_ledger_corrections: append-only). Renumbered, the
-- loan would be a new loan to every run: its overdue days owed again and charged a second time under the new id,
-- while the old id's charges stay as charged (a loan libraryd deleted is never corrected). So the renumbering of
-- a loan with charges is refused, naming the loan, in libraryd's own statement; a loan with nothing charged may
-- still change its id. The trigger fires only when the id changes (its WHEN clause), so libraryd's other updates
-- pay nothing for it. (On Citus `loans` is distributed by `id`, which Citus itself never lets change.)
set local lock_timeout = '5s';

create or replace function fine_settler_loan_keeps_its_id() returns trigger
language plpgsql security definer as $$
begin
    if exists (select 1 from fine_ledger f where f.loan_id = old.id) then
        raise exception 'loan % has charges in fine_ledger, so its id cannot change to %: under a new id its '
                        'overdue days would be charged again (fine-settler keeps a loan''s charges under its id)',
                        old.id, new.id
            using errcode = 'restrict_violation';
    end if;
    return new;
end $$;
do $$ begin
    execute format('alter function fine_settler_loan_keeps_its_id() set search_path = %I, pg_temp', current_schema());
end $$;

drop trigger if exists fine_settler_loan_keeps_its_id on loans;
create trigger fine_settler_loan_keeps_its_id before update on loans
    for each row when (old.id is distinct from new.id)
    execute function fine_settler_loan_keeps_its_id();
