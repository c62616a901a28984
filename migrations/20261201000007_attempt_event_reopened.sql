-- A SUCCESS key whose business date still has rows to do (a return back-dated into a settled month, a row
-- libraryd kept locked) is re-opened under a new epoch; the history names that claim `reopened`.
alter table job_run_attempts drop constraint if exists job_run_attempts_event_known;
alter table job_run_attempts add constraint job_run_attempts_event_known check (
    event in ('claimed', 'takeover', 'forced', 'reopened', 'success', 'failed', 'lease_lost', 'released')
);
