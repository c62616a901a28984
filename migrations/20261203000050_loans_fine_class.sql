-- The item class of a loan (a laptop, a DVD, a book), which picks its fine policy (fine_policies). libraryd fills
-- it at checkout; fine-settler only reads it. Null, or a class with no policy for the loan's due date, means the
-- `default` class. A nullable column without a default is a catalogue-only change, but it still needs a brief
-- ACCESS EXCLUSIVE lock on loans: lock_timeout makes the migration give up (and be retried) rather than queue
-- libraryd's writes behind it, as for the columns added before.
set local lock_timeout = '5s';
alter table loans add column if not exists fine_class text;
