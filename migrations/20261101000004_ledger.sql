-- The daily overdue accrual. One ledger row per (loan, day): the business key makes a repeated, concurrent or
-- taken-over run unable to charge a day twice (`on conflict do nothing`).
create table if not exists fine_ledger (
    loan_id bigint not null,
    accrual_date date not null,
    amount_cents bigint not null,
    charged_at timestamptz not null default now(),
    constraint fine_ledger_pkey primary key (loan_id, accrual_date),
    constraint fine_ledger_amount_positive check (amount_cents > 0)
);

-- Charges that failed (a constraint or trigger rejected them, a lock or statement timeout) wait here for the
-- compensation pass, which retries them with capped exponential backoff; after accrual.max_attempts a row
-- becomes DEAD and waits for an operator (`fine-settler pending retry --dead`).
create table if not exists fine_pending (
    loan_id bigint not null,
    accrual_date date not null,
    amount_cents bigint not null,
    attempts int not null default 1,
    last_error text,
    next_attempt_at timestamptz not null,
    status text not null default 'PENDING',
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now(),
    constraint fine_pending_pkey primary key (loan_id, accrual_date),
    constraint fine_pending_status_known check (status in ('PENDING', 'DEAD')),
    constraint fine_pending_amount_positive check (amount_cents > 0)
);

create index if not exists fine_pending_due_idx on fine_pending (next_attempt_at) where status = 'PENDING';
