-- What an owner owes (issue 16): a settlement charges a request's whole
-- cost, first from its hold, then from the balance beyond it, within the
-- key's cap; what neither covers is owed, not written off. The owner's next
-- request must cover it on top of its own hold, and its settlement pays it
-- first. Amounts are nano-units, paid DIEM first like any charge.
--
-- `ledgers.owed_nanos` is what is owed now; each journal row's `owed_nanos`
-- is its change (positive: a settlement left this unpaid; negative: paid),
-- so that the journal's sums still equal the ledger row. The old
-- `written_off_nanos` keeps its history and is no longer written.
ALTER TABLE ledgers ADD COLUMN owed_nanos BIGINT NOT NULL DEFAULT 0;
ALTER TABLE ledger_journal ADD COLUMN owed_nanos BIGINT NOT NULL DEFAULT 0;
