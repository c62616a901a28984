-- Corrections: when a charged day is no longer owed as charged (a return back-dated before it, a due date moved,
-- a cap boundary that moved with them, a day owed again after it was corrected away), a run appends the
-- difference here; a ledger row is never updated or deleted. The net of a (loan, day) is its first charge in
-- fine_ledger plus every correction of it (view fine_ledger_net).
--
-- `seq` numbers a day's corrections 1, 2, …: a correction is written as "the next one", computed from the net the
-- writer sees, with `on conflict do nothing` — two runs that saw the same net cannot both correct it (the second
-- waits for the first's transaction and then finds its number taken), so each cause is corrected at most once
-- whatever runs at the same time. The run that wrote it is recorded (job, business date, shards, shard, epoch):
-- it was written in that run's fenced batch transaction.
create table if not exists fine_ledger_corrections (
    loan_id bigint not null,
    accrual_date date not null,
    seq int not null,
    amount_cents bigint not null,
    reason text not null,
    corrected_at timestamptz not null default now(),
    job_name text not null,
    business_date date not null,
    shards int not null,
    shard int not null,
    epoch bigint not null,
    constraint fine_ledger_corrections_pkey primary key (loan_id, accrual_date, seq),
    constraint fine_ledger_corrections_seq_positive check (seq > 0),
    constraint fine_ledger_corrections_amount_nonzero check (amount_cents <> 0),
    constraint fine_ledger_corrections_reason_known
        check (reason in ('returned', 'due-date-moved', 'cap', 'reinstated', 'canonical'))
);

-- A run's corrections, for `runs`.
create index if not exists fine_ledger_corrections_run_idx
    on fine_ledger_corrections (business_date, job_name, shards, shard, epoch);

-- The ledger as finance reads it: one row per loan and day whose net is not zero.
create or replace view fine_ledger_net as
select loan_id, accrual_date, sum(amount_cents)::bigint as net_cents
from (select loan_id, accrual_date, amount_cents from fine_ledger
      union all
      select loan_id, accrual_date, amount_cents from fine_ledger_corrections) entries
group by loan_id, accrual_date
having sum(amount_cents) <> 0;

-- When this deployment began charging canonical amounts: a charge older than this was priced by the old rule
-- (the rate, or what was left under the cap when it ran — which depended on the order of runs), and a
-- correction of its amount says `canonical`.
create table if not exists fine_settler_marks (
    name text not null,
    at timestamptz not null default now(),
    constraint fine_settler_marks_pkey primary key (name)
);
insert into fine_settler_marks (name) values ('canonical-amounts') on conflict do nothing;
