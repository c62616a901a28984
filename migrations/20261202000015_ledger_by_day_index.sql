-- no-transaction
-- The ledger of one day, by loan: a run of an accrual day walks the day's charges to find those whose net is no
-- longer what is owed (the corrections), without a probe for every loan in the table. Built CONCURRENTLY so the
-- upgrade does not block charges.
create index concurrently if not exists fine_ledger_day_idx on fine_ledger (accrual_date, loan_id);
