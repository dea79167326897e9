-- Which billing replica holds an owner's ledger in memory (issue 15).
--
-- A replica that loads an owner writes its name here (and bumps `fence`);
-- it sets it back to NULL when it lets the owner go (its view moved the
-- owner to another replica, or the owner sat idle), after handing the
-- holds it kept only in memory over as rows of `holds`. Another replica
-- takes an owner held here only once it no longer hears the holder, so
-- two live replicas never decide for one owner at once. NULL: nobody
-- holds it (a single process, SQLite, or a ledger let go).
ALTER TABLE ledgers ADD COLUMN holder TEXT;
