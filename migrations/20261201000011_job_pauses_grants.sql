-- The replicas read `job_pauses` in every tick and every batch fence. A role that was given its privileges before
-- the pause tables existed (deploy/sql/least-privilege.sql, run once at install) would fail every tick after this
-- upgrade; so every role that may update `job_runs` — the replicas' — gets the same rights on the pause tables as
-- that script grants, and the upgrade needs no second step.
do $$
declare
    grantee text;
begin
    for grantee in
        select distinct g.grantee from information_schema.role_table_grants g
        where g.table_schema = current_schema() and g.table_name = 'job_runs' and g.privilege_type = 'UPDATE'
          and g.grantee <> current_user and g.grantee <> 'PUBLIC'
    loop
        execute format('grant select, insert, delete on job_pauses to %I', grantee);
        execute format('grant select, insert on job_pause_events to %I', grantee);
    end loop;
end $$;
