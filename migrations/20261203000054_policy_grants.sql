-- The replicas read the policies and the calendar in every settlement and accrual batch; `policy add` and
-- `calendar close/open` are operator commands run with the replicas' configuration (as `pause` is), which add
-- policies, add and remove closed days, and queue the loans a change to a past day concerns for the accrual's
-- re-check. A role given its privileges before these tables existed (deploy/sql/least-privilege.sql, run once at
-- install) gets the same rights as that script grants, so the upgrade needs no second step: every role that may
-- insert into fine_ledger.
do $$
declare
    grantee text;
begin
    for grantee in
        select distinct g.grantee from information_schema.role_table_grants g
        where g.table_schema = current_schema() and g.table_name = 'fine_ledger' and g.privilege_type = 'INSERT'
          and g.grantee <> current_user and g.grantee <> 'PUBLIC'
    loop
        execute format('grant select, insert on fine_policies to %I', grantee);
        execute format('grant select, insert, delete on library_closed_days to %I', grantee);
        execute format('grant insert on fine_loan_changes to %I', grantee);
    end loop;
end $$;
