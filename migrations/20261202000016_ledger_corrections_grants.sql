-- The replicas append corrections and work through the change queue. A role given its privileges before these
-- tables existed (deploy/sql/least-privilege.sql, run once at install) gets the same rights on them as that script
-- grants, so the upgrade needs no second step: every role that may insert into fine_ledger.
do $$
declare
    grantee text;
begin
    for grantee in
        select distinct g.grantee from information_schema.role_table_grants g
        where g.table_schema = current_schema() and g.table_name = 'fine_ledger' and g.privilege_type = 'INSERT'
          and g.grantee <> current_user and g.grantee <> 'PUBLIC'
    loop
        execute format('grant select, insert on fine_ledger_corrections to %I', grantee);
        execute format('grant select on fine_ledger_net to %I', grantee);
        execute format('grant select on fine_settler_marks to %I', grantee);
        execute format('grant select, delete on fine_loan_changes to %I', grantee);
    end loop;
end $$;
