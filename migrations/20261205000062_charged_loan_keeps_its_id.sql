-- A loan's charges are kept under its id (fine_ledger, fine_ledger_corrections: append-only; fine_pending).
-- Renumbered, the loan would be a new loan to every run: its overdue days owed again and charged a second time
-- under the new id, while the old id's charges stay as charged (a loan libraryd deleted is never corrected). So a
-- loan that may have charges cannot change its id; libraryd's statement is refused, naming the loan:
--
-- * a loan that is or was overdue, by its own row: still out and due before tomorrow (whatever the session's
--   zone, as the change capture judges a loan inserted), or returned after its due date. Judged by the row, the
--   refusal needs no charge to be committed: it holds against a batch charging the loan at that very moment and
--   whatever libraryd's isolation level (a repeatable read transaction does not see a charge committed after its
--   snapshot);
-- * any other loan with rows in fine_ledger or fine_pending (its due date moved later after it was charged),
--   after taking the loan's ledger lock (the one every charge takes while some policy has a cap,
--   src/store/ledger.rs `lock_loans`), so that a charge in flight commits before the check reads the ledger.
--
-- A loan never overdue may still be renumbered. After the row is updated, so that the id and dates judged are
-- the ones written, whatever libraryd's own BEFORE triggers did; the WHEN clause keeps libraryd's other updates
-- free of it. (On Citus `loans` is distributed by `id`, which Citus itself never lets change.)
set local lock_timeout = '5s';

create or replace function fine_settler_loan_keeps_its_id() returns trigger
language plpgsql security definer as $$
begin
    if (old.returned_on is null and old.due_on < current_date + 1) or old.returned_on > old.due_on then
        raise exception 'loan % is or was overdue, so its id cannot change to %: under a new id its overdue days '
                        'would be charged again (fine-settler keeps a loan''s charges under its id)', old.id, new.id
            using errcode = 'restrict_violation';
    end if;
    perform pg_advisory_xact_lock(1718832228, hashint8(old.id));
    if exists (select 1 from fine_ledger f where f.loan_id = old.id)
       or exists (select 1 from fine_pending q where q.loan_id = old.id) then
        raise exception 'loan % has charges (fine_ledger, fine_pending), so its id cannot change to %: under a new '
                        'id its overdue days would be charged again (fine-settler keeps a loan''s charges under its id)',
                        old.id, new.id
            using errcode = 'restrict_violation';
    end if;
    return null;
end $$;
do $$ begin
    execute format('alter function fine_settler_loan_keeps_its_id() set search_path = %I, pg_temp', current_schema());
end $$;

drop trigger if exists fine_settler_loan_keeps_its_id on loans;
create trigger fine_settler_loan_keeps_its_id after update on loans
    for each row when (old.id is distinct from new.id)
    execute function fine_settler_loan_keeps_its_id();
