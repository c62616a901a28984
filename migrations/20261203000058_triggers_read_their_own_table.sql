-- The two triggers that read the table they fire on name it by the trigger's own `tg_table_schema` and
-- `tg_table_name` instead of by the table's name. On one PostgreSQL server the two are the same table, and
-- nothing changes. On Citus (`database.engine = "citus"`, docs/citus.md) `fine_policies` and
-- `library_closed_days` are reference tables: a copy on every node, and a trigger fires on each copy. Named, the
-- table would be the distributed one, and a statement on it from inside a copy's trigger is a distributed query
-- nested in another, which Citus refuses ("cannot execute a distributed query from a query on a shard"); by the
-- trigger's own names each copy numbers, and checks, itself — the same rows on every node, so the same result.
create or replace function fine_settler_number_closed_days() returns trigger
language plpgsql security definer as $$
begin
    perform pg_advisory_xact_lock(1718829932, 0);
    execute format('update %1$I.%2$I c set ordinal = n.ordinal
                    from (select d.day, row_number() over (order by d.day) as ordinal from %1$I.%2$I d) n
                    where c.day = n.day and c.ordinal <> n.ordinal', tg_table_schema, tg_table_name);
    return null;
end $$;

create or replace function fine_settler_policy_is_new() returns trigger
language plpgsql as $$
declare
    first boolean;
begin
    execute format('select not exists (select 1 from %I.%I)', tg_table_schema, tg_table_name) into first;
    if first then
        if new.fine_class <> 'default' or new.effective_from <> '4714-11-24 BC'::date then
            raise exception 'the first fine policy must be the default class''s from 4714-11-24 BC, so that every loan '
                            'has one: run `fine-settler migrate`, which seeds it from the [fine] keys'
                using errcode = 'check_violation';
        end if;
    elsif new.effective_from < (now() at time zone 'UTC')::date then
        raise exception 'a fine policy version must take effect from today on (effective_from %): a new rule governs '
                        'loans falling due from then on, never loans already due', new.effective_from
            using errcode = 'check_violation';
    end if;
    return new;
end $$;

-- `create or replace` drops a function's settings: pinned again, as their first migrations pinned them.
do $$ begin
    execute format('alter function fine_settler_number_closed_days() set search_path = %I, pg_temp',
                   current_schema());
    execute format('alter function fine_settler_policy_is_new() set search_path = %I, pg_temp', current_schema());
end $$;
