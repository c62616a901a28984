-- The two triggers that read the table they fire on name it qualified with fine-settler's schema (`@schema`,
-- as migrations/20261203000053 writes the rule functions), instead of through their pinned search path. On one
-- PostgreSQL server that is the same table, and nothing changes. On Citus (`database.engine = "citus"`,
-- docs/citus.md) `fine_policies` and `library_closed_days` are reference tables: a copy on every node, each the
-- table's one shard under the same name (`library_closed_days_<shard id>`), and a trigger fires on each copy.
-- Named by the table, a copy's trigger would reach the distributed table — a distributed query nested in a
-- shard's, which Citus refuses ("cannot execute a distributed query from a query on a shard"). `migrate` on
-- Citus binds every function whose body names these tables qualified to the shard's name, as it binds the rule
-- functions, so each copy numbers, and checks, itself: the same rows on every node, so the same result.
--
-- The bodies are those of migrations 20261203000052 and 20261203000055 otherwise; the numbering still updates
-- one fixed table (a `security definer` function must not update whatever table a caller attaches it to).
do $migration$
declare
    functions text := $functions$

create or replace function @schema.fine_settler_number_closed_days() returns trigger
language plpgsql security definer as $$
begin
    perform pg_advisory_xact_lock(1718829932, 0);
    update @schema.library_closed_days c set ordinal = n.ordinal
    from (select d.day, row_number() over (order by d.day) as ordinal from @schema.library_closed_days d) n
    where c.day = n.day and c.ordinal <> n.ordinal;
    return null;
end $$;

create or replace function @schema.fine_settler_policy_is_new() returns trigger
language plpgsql as $$
begin
    if not exists (select 1 from @schema.fine_policies) then
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

$functions$;
begin
    execute replace(functions, '@schema', quote_ident(current_schema()));
    -- `create or replace` drops a function's settings: pinned again, as their first migrations pinned them.
    execute format('alter function fine_settler_number_closed_days() set search_path = %I, pg_temp',
                   current_schema());
    execute format('alter function fine_settler_policy_is_new() set search_path = %I, pg_temp', current_schema());
end $migration$;
