-- The loans libraryd changed in ways that change what is owed for days already accrued: a return recorded or
-- removed, a due date moved, a loan recorded late (already overdue when inserted), a loan deleted. The accrual
-- re-check reads this queue instead of walking every open overdue loan ever recorded, so its cost grows with what
-- changed, not with the library's history. Until the loan's ledger in the catch-up window matches what is owed,
-- the re-check re-opens the days it still needs. A row is removed only when two re-checks at least
-- `claim.batch_timeout` apart both find the loan as owed (`cleared_at`: when the first did): a batch that priced a
-- day from the loan's old row and had not committed when the first looked has committed (or failed) by the
-- second, which would see its charge.
set local lock_timeout = '5s';
create table if not exists fine_loan_changes (
    seq bigint generated always as identity,
    loan_id bigint not null,
    changed_at timestamptz not null default now(),
    cleared_at timestamptz,
    constraint fine_loan_changes_pkey primary key (seq)
);
create index if not exists fine_loan_changes_loan_idx on fine_loan_changes (loan_id);

-- Runs as its owner (security definer), so that libraryd's roles need no privilege on the queue; its search path
-- is fine-settler's schema and then pg_temp (set below), so that no session's temporary table can stand in for
-- the queue.
create or replace function fine_settler_note_loan_change() returns trigger
language plpgsql security definer as $$
begin
    if tg_op = 'INSERT' then
        insert into fine_loan_changes (loan_id) values (new.id);
    elsif tg_op = 'DELETE' then
        insert into fine_loan_changes (loan_id) values (old.id);
    else
        insert into fine_loan_changes (loan_id) values (new.id);
        if old.id <> new.id then
            insert into fine_loan_changes (loan_id) values (old.id);
        end if;
    end if;
    return null;
end $$;
do $$ begin
    execute format('alter function fine_settler_note_loan_change() set search_path = %I, pg_temp', current_schema());
end $$;

-- Only the changes that can matter: a loan inserted already overdue (a day before tomorrow, whatever the session's
-- zone), a loan deleted after it was overdue, and an update that changes a column deciding what is owed — by its
-- values, not by the statement's column list, so that a change made by one of libraryd's own BEFORE triggers is
-- seen. Settlement's own writes (fine_cents, fine_settled_at) and libraryd's other updates queue nothing.
drop trigger if exists fine_settler_loan_inserted on loans;
create trigger fine_settler_loan_inserted after insert on loans
    for each row when (new.due_on < current_date + 1)
    execute function fine_settler_note_loan_change();
drop trigger if exists fine_settler_loan_deleted on loans;
create trigger fine_settler_loan_deleted after delete on loans
    for each row when (old.returned_on is null or old.returned_on > old.due_on)
    execute function fine_settler_note_loan_change();
drop trigger if exists fine_settler_loan_changed on loans;
create trigger fine_settler_loan_changed after update on loans
    for each row when (old.id is distinct from new.id or old.due_on is distinct from new.due_on
                       or old.returned_on is distinct from new.returned_on)
    execute function fine_settler_note_loan_change();

-- A ledger charged before this upgrade was priced in the order runs happened: every loan with a charge is queued
-- once, so that the first re-checks bring those loans' days in the window to their canonical amounts (reason
-- `canonical`).
insert into fine_loan_changes (loan_id) select distinct loan_id from fine_ledger;
