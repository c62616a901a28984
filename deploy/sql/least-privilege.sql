-- A login role for fine-settler replicas that can do their work and nothing else. Run it with psql as the owner
-- of libraryd's tables (or a superuser), after `fine-settler migrate` has created fine-settler's tables:
--
--   psql "$OWNER_URL" -v role=fine_settler -v password='…' -f deploy/sql/least-privilege.sql
--
-- Running it again is harmless: it creates the role only if it is missing and re-grants the same privileges.
-- Migrations themselves need the owner's rights (they create tables and indexes): run `fine-settler migrate`
-- with the owner's URL, e.g. as the Kubernetes migration Job, and the replicas with this role.
\set ON_ERROR_STOP on

select format('create role %I login password %L', :'role', :'password')
where not exists (select 1 from pg_roles where rolname = :'role')
\gexec

select format('grant connect on database %I to %I', current_database(), :'role') \gexec
select format('grant usage on schema %I to %I', current_schema(), :'role') \gexec

-- libraryd's loans: read every column the jobs filter on; write only the two fine columns.
select format('grant select on loans to %I', :'role') \gexec
select format('grant update (fine_cents, fine_settled_at) on loans to %I', :'role') \gexec

-- The claim table: claims, takeovers, progress and finishes are inserts and updates; rows are never deleted.
select format('grant select, insert, update on job_runs to %I', :'role') \gexec
-- The history is append-only, except that the daemon prunes rows older than claim.history_retention.
select format('grant select, insert, delete on job_run_attempts to %I', :'role') \gexec

-- Pauses: the tick reads them; `pause` and `resume` (operator commands, run with the replicas' configuration as
-- `release` is) add and remove them and append to their history.
select format('grant select, insert, delete on job_pauses to %I', :'role') \gexec
select format('grant select, insert on job_pause_events to %I', :'role') \gexec

-- The ledger is append-only; the compensation queue is worked through (rows updated, then deleted).
select format('grant select, insert on fine_ledger to %I', :'role') \gexec
select format('grant select, insert, update, delete on fine_pending to %I', :'role') \gexec
-- Corrections are append-only too; the change queue is read and worked through (rows deleted once the re-check
-- finds the loan's ledger as owed).
select format('grant select, insert on fine_ledger_corrections to %I', :'role') \gexec
select format('grant select on fine_ledger_net to %I', :'role') \gexec
select format('grant select on fine_settler_marks to %I', :'role') \gexec
select format('grant select, delete on fine_loan_changes to %I', :'role') \gexec

-- The fine rules: every batch reads the policies and the closed days; `policy add` and `calendar close/open`
-- (operator commands, run with the replicas' configuration) add versions, add and remove closed days, and queue
-- the loans a change to a past day concerns for the re-check.
select format('grant select, insert on fine_policies to %I', :'role') \gexec
select format('grant select, insert, delete on library_closed_days to %I', :'role') \gexec
select format('grant insert on fine_loan_changes to %I', :'role') \gexec

-- Optional, for throttle.max_replica_lag: with `-v monitor=on`, the role may read the standbys' replay positions
-- in pg_stat_replication (pg_read_all_stats, the part of pg_monitor the throttle needs). Granting it takes a
-- superuser (or, from PostgreSQL 16, a role holding pg_read_all_stats with the admin option). Without it a
-- replica with a lag limit warns once at start and runs without that limit.
\if :{?monitor}
select format('grant pg_read_all_stats to %I', :'role') \gexec
\endif
