-- The days the library is closed: no loan is charged for them unless its policy has `charge_closed_days`.
--
-- `ordinal` numbers the closed days in order (the earliest is 1), so that the closed days in a span `(a, b]` are
-- `ordinal(last closed day <= b) - ordinal(last closed day <= a)`: two probes of the primary key, whatever the
-- span's length — a book lost five years ago costs what a week-late one does (fine_settler_closed_through,
-- migrations/20261203000053). The key includes `ordinal`, so a probe is an index-only scan (measured: 200,000
-- probes in 1.3 s index-only against 3.3 s with a heap fetch each). A statement that adds, removes or moves days renumbers the rows after it (a few
-- thousand rows at most: about 60 closed days a year). The renumbering runs under a transaction-scoped advisory
-- lock, so two concurrent changes are numbered one after the other, the second seeing the first's rows; each of
-- its statements sees every change committed before it (READ COMMITTED, which every fine-settler statement uses).
-- `ordinal` has a default, so an operator's `insert (day, reason)` works, and the trigger numbers it.
create table if not exists library_closed_days (
    day date not null,
    reason text not null default '',
    created_at timestamptz not null default now(),
    created_by text not null default current_user,
    ordinal bigint not null default 0,
    constraint library_closed_days_pkey primary key (day) include (ordinal),
    constraint library_closed_days_day_check check (isfinite(day))
);

-- Runs as its owner (security definer), so that the operator's role needs no update privilege on `ordinal`;
-- its search path is fine-settler's schema and then pg_temp, so that no session's temporary table stands in.
-- The lock's key is ASCII "fsCl" in the two-int form (namespace 0x6673_436c, 0), apart from the ledger's.
create or replace function fine_settler_number_closed_days() returns trigger
language plpgsql security definer as $$
begin
    perform pg_advisory_xact_lock(1718829932, 0);
    update library_closed_days c set ordinal = n.ordinal
    from (select d.day, row_number() over (order by d.day) as ordinal from library_closed_days d) n
    where c.day = n.day and c.ordinal <> n.ordinal;
    return null;
end $$;
do $$ begin
    execute format('alter function fine_settler_number_closed_days() set search_path = %I, pg_temp',
                   current_schema());
end $$;

-- Statement-level: one renumbering per statement, however many days it changes. The renumbering's own update
-- sets only `ordinal`, so it does not fire the `update of day` trigger again.
drop trigger if exists fine_settler_closed_days_numbered on library_closed_days;
create trigger fine_settler_closed_days_numbered after insert or delete or update of day on library_closed_days
    for each statement execute function fine_settler_number_closed_days();
