-- libraryd's loans table. On a fresh database it is created here; on an existing libraryd database only the
-- columns fine-settler writes are added. Neither `add column` below rewrites the table (a nullable column, and a
-- constant default, are catalogue-only changes since PostgreSQL 11), but each still needs a brief ACCESS EXCLUSIVE
-- lock: lock_timeout makes the migration give up (and be retried) rather than queue libraryd's writes behind it.
set local lock_timeout = '5s';

create table if not exists loans (
    id bigint not null,
    member_id bigint not null,
    book_id bigint not null,
    borrowed_on date not null,
    due_on date not null,
    returned_on date,
    fine_cents bigint not null default 0,
    fine_settled_at timestamptz,
    constraint loans_pkey primary key (id)
);

alter table loans add column if not exists fine_cents bigint not null default 0;
alter table loans add column if not exists fine_settled_at timestamptz;
