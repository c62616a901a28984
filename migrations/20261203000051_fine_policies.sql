-- The library's fine rules, versioned: one row per (class, first due date it governs). The policy of a loan is
-- the row of its class with the latest `effective_from <= due_on`, and the `default` class when the loan has no
-- class or its class has no row for that date (fine_settler_policy_of, migrations/20261203000053). Rate, grace,
-- cap and the closed-day rule all come from that one row, so a row added later never changes the fine of a loan
-- already due: `fine-settler policy add` accepts only an `effective_from` after today.
--
-- Rows are never updated or deleted by fine-settler. The bounds are those of src/fine.rs: a rate of at most
-- 10^8 cents a day keeps `rate * days` inside a bigint for any date difference, and a grace of at most 36,525
-- days (about 100 years). Every column but the six rule columns has a default, and so do all of those but the
-- class, the date and the rate, so an operator's `insert` naming only the rule columns works.
create table if not exists fine_policies (
    fine_class text not null,
    effective_from date not null,
    daily_rate_cents bigint not null,
    grace_days int not null default 0,
    cap_cents bigint not null default 0,
    charge_closed_days boolean not null default false,
    created_at timestamptz not null default now(),
    created_by text not null default current_user,
    reason text not null default '',
    constraint fine_policies_pkey primary key (fine_class, effective_from),
    constraint fine_policies_class_check check (char_length(fine_class) between 1 and 64),
    constraint fine_policies_from_check check (isfinite(effective_from)),
    constraint fine_policies_rate_check check (daily_rate_cents between 0 and 100000000),
    constraint fine_policies_grace_check check (grace_days between 0 and 36525),
    constraint fine_policies_cap_check check (cap_cents >= 0)
);
