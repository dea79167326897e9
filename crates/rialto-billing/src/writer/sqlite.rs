//! The writer on a SQLite file: a thread of its own with a connection of
//! its own (rusqlite, on the same SQLite library sqlx links).
//!
//! Through sqlx every statement is a round trip to the connection's worker
//! thread; a batch of one settlement made five, and they were most of what
//! a priced request waited for (BENCHMARKS.md). Here a batch is one hop
//! into this thread and one back: the statements run where the connection
//! is, prepared once and cached.
//!
//! The WAL is checkpointed in two steps, so that it starts over under
//! constant load without stalling the writer. SQLite starts the WAL over
//! only when a write begins with every frame copied into the database; a
//! checkpoint beside the writer's commits never catches up with them, so
//! under constant load the WAL grew without end (half a gigabyte in a
//! minute of a benchmark) and every write went to new blocks at its end.
//! A checkpoint on the writer's connection does catch up, but copying and
//! syncing a second of writes took 65-80 ms, during which no batch was
//! written. So a second thread with its own connection checkpoints once a
//! second, again and again until few frames came in meanwhile
//! ([`TAIL_FRAMES`]), and then asks the writer ([`Job::Checkpoint`]) to copy
//! those last frames between two batches: about a millisecond.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rialto_core::db::{Database, now_ms};
use rialto_core::{Error, ErrorCode, Result};
use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior, params};
use tokio::sync::mpsc;

use super::held_back::{HeldBack, Release, owner_names};
use super::log::{Log, Opened};
use super::{
    ATTEMPTS, BatchError, BatchResult, Flushed, HOLD_COLUMNS, HoldUpdate, Job, Loaded, Loading,
    MAX_BATCH, Next, Nudge, Record, Refreshed, Sorted, Stats, WriteJob, Written, after_attempt,
    backoff, give_up, hold_writes, journal_rows, journal_values, key_sums, loaded_hold, observe,
    owner_sums, refresh_owners,
};
use crate::ledger::Balance;

impl From<rusqlite::Error> for BatchError {
    fn from(error: rusqlite::Error) -> Self {
        Self::Database(database_error(error))
    }
}

fn database_error(error: rusqlite::Error) -> Error {
    Error::internal(format_args!("database: {error}"))
}

/// Starts the writer's thread and the WAL checkpointer's.
/// The writer and the ledger's log.
pub(super) enum LogState {
    /// This process's log, and what an earlier process left in it.
    Logged(Opened),
    /// No log: every record waits for its batch (the CLI; a second process
    /// on the file).
    Unlogged,
    /// The log could not be opened: every job is refused with this.
    Refused(String),
}

pub(super) fn spawn(
    db: Database,
    file: PathBuf,
    queue: mpsc::UnboundedReceiver<Job>,
    jobs: mpsc::WeakUnboundedSender<Job>,
    stats: Arc<Stats>,
    log: LogState,
    nudge: &Nudge,
) {
    let writer_file = file.clone();
    let spawned = std::thread::Builder::new()
        .name("rialto-ledger-writer".into())
        .spawn(move || run(&writer_file, queue, &stats, log));
    match spawned {
        Ok(thread) => {
            let _ = nudge.0.set(thread.thread().clone());
        }
        Err(error) => {
            // Every write then fails with "the ledger writer stopped".
            tracing::error!(%error, "cannot start the ledger writer's thread");
            return;
        }
    }
    let spawned = std::thread::Builder::new()
        .name("rialto-wal-checkpoint".into())
        .spawn(move || checkpointer(&db, &file, &jobs));
    if let Err(error) = spawned {
        // The pool's checkpointer (`Database::spawn_checkpointer`) runs.
        tracing::error!(%error, "cannot start the WAL checkpointer's thread");
    }
}

/// How often the WAL is checkpointed.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// The checkpointer hands over to the writer once fewer frames than this
/// came in during its last pass.
const TAIL_FRAMES: i64 = 512;
/// Passes of the checkpointer before it hands over whatever is left.
const PASSES: usize = 4;
/// The WAL is truncated to this after a checkpoint let it start over.
const WAL_KEPT_BYTES: i64 = 64 << 20;

fn run(file: &Path, mut queue: mpsc::UnboundedReceiver<Job>, stats: &Stats, log: LogState) {
    let mut connection: Option<Connection> = None;
    let log = match log {
        LogState::Logged(opened) => {
            replay(file, &mut connection, opened.replay, &opened.leftover);
            Some(opened.log)
        }
        LogState::Unlogged => None,
        LogState::Refused(error) => return refuse(queue, &error),
    };
    // Streams' opens kept from the database until they end: only where
    // the log made them durable.
    let mut held = log.as_ref().map(|_| HeldBack::default());
    // The last record of the log the writer was given.
    let mut seen = 0;
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = queue.blocking_recv() {
        let since = Instant::now();
        jobs.push(first);
        drain(&mut queue, &mut jobs);
        if log.is_some() {
            gather(&mut queue, &mut jobs, since);
        }
        let Sorted {
            writes,
            loads,
            // One process holds a SQLite file: nobody to let owners go to.
            releases: _,
            flushes,
            flushed,
            checkpoint: tail,
        } = Sorted::new(jobs.drain(..));
        let logged = writes.iter().map(|job| job.record.log_seq).max();
        seen = seen.max(logged.unwrap_or(0));
        let writes = match (held.as_mut(), &log, &flushed) {
            (Some(held), Some(log), Flushed::Owners(read)) => {
                // The owners the batch loads or a flush reads.
                let mut owners = owner_names(&loads);
                owners.extend(read.iter().map(|owner| &**owner));
                let through = log.keeps_through();
                let now = Instant::now();
                let due = Release::Due {
                    owners: &owners,
                    through,
                    now,
                };
                held.plan(writes, due)
            }
            (Some(held), ..) => held.plan(writes, Release::All),
            _ => writes,
        };
        write(
            file,
            &mut connection,
            stats,
            writes,
            log.as_deref(),
            held.as_ref(),
            seen,
        );
        // After the writes: a load sees every write queued before it.
        for (owner, Loading { done, .. }) in loads {
            let loaded = connect(file, &mut connection).and_then(|conn| load(conn, &owner));
            if let Err(error) = &loaded {
                tracing::warn!(%error, %owner, "cannot load a ledger owner");
                connection = None;
            }
            let _ = done.send(loaded);
        }
        for done in flushes {
            let _ = done.send(());
        }
        // Every caller has its answer; the next batch waits for this, and
        // begins with the WAL copied, so it starts the WAL over.
        if tail && let Some(conn) = connection.as_mut() {
            let _ = checkpoint(conn, "the writer");
        }
    }
    if let Some(log) = log {
        if let Some(mut held) = held.filter(|held| !held.is_empty()) {
            let writes = held.plan(Vec::new(), Release::All);
            write(
                file,
                &mut connection,
                stats,
                writes,
                Some(&log),
                Some(&held),
                seen,
            );
        }
        log.close();
    }
}

/// Commits a batch's `writes`, if any, and tells the log how far the
/// database has it (`seen`: the last record the writer was given; `held`:
/// the opens held back from it).
fn write(
    file: &Path,
    connection: &mut Option<Connection>,
    stats: &Stats,
    writes: Vec<WriteJob>,
    log: Option<&Log>,
    held: Option<&HeldBack>,
    seen: u64,
) {
    let mut all = true;
    if !writes.is_empty() {
        let written = observe(stats, writes.len());
        all = commit(file, connection, writes, log.is_some());
        written();
    }
    if let Some(log) = log.filter(|_| seen > 0) {
        if all {
            log.applied(seen, held.map_or(seen, |held| held.written_through(seen)));
        } else {
            log.keep();
        }
    }
}

/// Refuses every job: no owner is loaded, so nothing is decided.
fn refuse(mut queue: mpsc::UnboundedReceiver<Job>, error: &str) {
    let refused = || {
        Error::new(
            ErrorCode::Unavailable,
            format!("Billing cannot open its ledger's log ({error}); see the server's log"),
        )
    };
    while let Some(job) = queue.blocking_recv() {
        match job {
            Job::Write { done, .. } => {
                if let Some(done) = done {
                    let _ = done.send(Err(refused()));
                }
            }
            Job::Load { done, .. } => {
                let _ = done.send(Err(refused()));
            }
            Job::Flush { done, .. } => {
                let _ = done.send(());
            }
            Job::Checkpoint | Job::Release { .. } => {}
        }
    }
}

/// Moves the jobs waiting into `jobs`, up to a batch.
fn drain(queue: &mut mpsc::UnboundedReceiver<Job>, jobs: &mut Vec<Job>) {
    while jobs.len() < MAX_BATCH {
        match queue.try_recv() {
            Ok(job) => jobs.push(job),
            Err(_) => break,
        }
    }
}

/// With the ledger's log, nobody waits for a record's commit unless a job
/// says so: the batch gathers for up to [`GATHER`] first, so that a
/// commit carries many records (fewer commits, fewer WAL pages, less of
/// the cores the requests need) instead of each its own. It sleeps once
/// for it: a job someone waits on wakes it ([`Nudge`]), and it commits then.
/// (It used to look every 250 µs: eight timer wake-ups a batch, 3% of the
/// process's CPU at 5,000 requests a second.)
fn gather(queue: &mut mpsc::UnboundedReceiver<Job>, jobs: &mut Vec<Job>, since: Instant) {
    let mut seen = 0;
    loop {
        if jobs.len() >= MAX_BATCH || jobs[seen..].iter().any(Job::waited_on) {
            return;
        }
        seen = jobs.len();
        let Some(left) = GATHER.checked_sub(since.elapsed()) else {
            return;
        };
        // Returns early when nudged (or spuriously): the jobs are looked at
        // again either way.
        std::thread::park_timeout(left);
        drain(queue, jobs);
    }
}

/// How long a batch nobody waits for gathers records. Nobody waits, so
/// longer costs no request anything, and a commit's pages are shared by
/// more records: at 512 streams the thread spent 17-21 µs of CPU a stream
/// against 32-36 at 10 ms (`bench/ab.py --by-thread`, six rounds each). A
/// crash leaves at most this much more log to replay.
const GATHER: Duration = Duration::from_millis(50);

/// Applies the records an earlier process logged (some of them, or all,
/// the database may have already: those are duplicates and change
/// nothing), then deletes their segments. Nothing else is written or
/// loaded before: until this succeeds the writer tries again.
fn replay(
    file: &Path,
    connection: &mut Option<Connection>,
    records: Vec<Record>,
    segments: &[PathBuf],
) {
    let count = records.len();
    let mut jobs: Vec<WriteJob> = records
        .into_iter()
        .map(|record| WriteJob { record, done: None })
        .collect();
    let mut attempt = 0u32;
    while !jobs.is_empty() {
        let rest = jobs.split_off(jobs.len().min(MAX_BATCH));
        let mut batch = jobs;
        jobs = rest;
        loop {
            let result = connect(file, connection)
                .map_err(BatchError::Database)
                .and_then(|conn| {
                    // Written under whatever fence the owner has now: no
                    // other process writes this ledger (the log's lock).
                    current_fences(conn, &mut batch)?;
                    write_batch(conn, &batch)
                });
            match result {
                Ok(_) => break,
                Err(error) => {
                    let error = match error {
                        BatchError::Database(error) => error.to_string(),
                        BatchError::Fenced(owners) => format!("fenced: {owners:?}"),
                    };
                    tracing::error!(%error, attempt, "cannot apply the ledger's log; trying again");
                    *connection = None;
                    std::thread::sleep(backoff(attempt.min(6)));
                    attempt += 1;
                }
            }
        }
    }
    for path in segments {
        if let Err(error) = std::fs::remove_file(path) {
            tracing::warn!(%error, path = %path.display(), "cannot delete a ledger log segment");
        }
    }
    if count > 0 {
        tracing::info!(records = count, "applied the ledger's log of the last run");
    }
}

/// Sets each record's fence to its owner's current one (creating the
/// owner's row if it has none).
fn current_fences(conn: &mut Connection, batch: &mut [WriteJob]) -> rusqlite::Result<()> {
    let mut fences = std::collections::HashMap::<Arc<str>, i64>::new();
    for job in batch.iter_mut() {
        let owner = job.record.owner.name.clone();
        let fence = match fences.get(&owner) {
            Some(&fence) => fence,
            None => {
                conn.prepare_cached(
                    "INSERT INTO ledgers (owner, updated_at_ms, fence) VALUES (?1, ?2, 1) \
                     ON CONFLICT (owner) DO NOTHING",
                )?
                .execute(params![&*owner, now_ms()])?;
                let fence: i64 = conn
                    .prepare_cached("SELECT fence FROM ledgers WHERE owner = ?1")?
                    .query_row(params![&*owner], |row| row.get(0))?;
                fences.insert(owner, fence);
                fence
            }
        };
        job.record.fence = fence;
    }
    Ok(())
}

/// The checkpointer's thread: every [`CHECKPOINT_EVERY`], passes until
/// the WAL is nearly copied, then the writer's turn. Ends with the writer.
fn checkpointer(db: &Database, file: &Path, writer: &mpsc::WeakUnboundedSender<Job>) {
    let mut connection: Option<Connection> = None;
    loop {
        std::thread::sleep(CHECKPOINT_EVERY);
        let Some(writer) = writer.upgrade() else {
            return;
        };
        let conn = match connection.as_mut() {
            Some(conn) => conn,
            None => match open(file) {
                Ok(conn) => connection.insert(conn),
                Err(error) => {
                    tracing::warn!(%error, "the WAL checkpointer cannot connect");
                    continue;
                }
            },
        };
        let mut before = None;
        for _ in 0..PASSES {
            let Some(frames) = checkpoint(conn, "the checkpointer") else {
                connection = None;
                break;
            };
            db.note_checkpoint();
            let came_in = before.map_or(i64::MAX, |before| frames - before);
            before = Some(frames);
            // Nothing in the WAL: nothing for the writer either.
            if frames <= 0 {
                break;
            }
            if came_in < TAIL_FRAMES {
                let _ = writer.send(Job::Checkpoint);
                break;
            }
        }
    }
}

/// Copies the WAL into the database (PASSIVE: it waits for nobody; a
/// reader still on old frames keeps them, and the next checkpoint copies
/// the rest). Returns the frames in the WAL, or none if it failed.
fn checkpoint(conn: &mut Connection, by: &str) -> Option<i64> {
    let started = Instant::now();
    let result = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
        Ok((row.get::<_, i64>(1)?, row.get::<_, i64>(2)?))
    });
    match result {
        Ok((frames, copied)) => {
            tracing::debug!(
                by,
                frames,
                copied,
                micros = started.elapsed().as_micros() as u64,
                "WAL checkpoint"
            );
            Some(frames)
        }
        Err(error) => {
            tracing::warn!(%error, by, "WAL checkpoint failed");
            None
        }
    }
}

fn connect<'c>(file: &Path, connection: &'c mut Option<Connection>) -> Result<&'c mut Connection> {
    if connection.is_none() {
        *connection = Some(open(file).map_err(database_error)?);
    }
    connection
        .as_mut()
        .ok_or_else(|| Error::internal("no writer connection"))
}

/// The pool's settings (`Database::connect`): WAL, a writer that waits
/// for a busy database, no checkpoint in a commit.
pub(super) fn open(file: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        file,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    conn.pragma_update(None, "journal_size_limit", WAL_KEPT_BYTES)?;
    conn.set_prepared_statement_cache_capacity(32);
    Ok(conn)
}

/// Writes `jobs` in one transaction, or as many as can be. Returns
/// whether every record was written. With the ledger's log (`logged`)
/// every record was answered as durable already: none is given up, the
/// writer tries again (after at most a second) until the database takes
/// it, and callers wait for it once it is [`log::BACKLOG`] behind.
///
/// [`log::BACKLOG`]: super::log::BACKLOG
fn commit(
    file: &Path,
    connection: &mut Option<Connection>,
    mut jobs: Vec<WriteJob>,
    logged: bool,
) -> bool {
    let mut all = true;
    let mut attempt = 0;
    loop {
        let result = match connect(file, connection) {
            Ok(conn) => write_batch(conn, &jobs),
            Err(error) => Err(BatchError::Database(error)),
        };
        match after_attempt(jobs, result, attempt, logged) {
            Next::Done { lost } => return all && !lost,
            Next::Again {
                jobs: again,
                failed,
                lost,
                refence,
            } => {
                all &= !lost;
                jobs = again;
                if refence {
                    let refenced = connect(file, connection)
                        .map_err(|e| e.to_string())
                        .and_then(|conn| {
                            current_fences(conn, &mut jobs).map_err(|e| e.to_string())
                        });
                    if let Err(error) = refenced {
                        tracing::warn!(%error, "cannot read the ledger owners' fences");
                        *connection = None;
                        std::thread::sleep(backoff(attempt.min(5)));
                    }
                }
                if failed {
                    *connection = None;
                    if jobs.len() > 1 {
                        for job in jobs {
                            all &= commit(file, connection, vec![job], logged);
                        }
                        return all;
                    }
                    std::thread::sleep(backoff(attempt.min(5)));
                }
            }
        }
        attempt += 1;
        if attempt >= ATTEMPTS && !logged {
            give_up(jobs);
            return false;
        }
    }
}

pub(super) fn write_batch(conn: &mut Connection, jobs: &[WriteJob]) -> BatchResult {
    let now = now_ms();
    // IMMEDIATE: the write lock first (a deferred transaction that another
    // connection's write overtakes fails instead of waiting).
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;

    // 1. The journal: what applies (a replay's key exists already).
    let mut written = vec![Written::Applied; jobs.len()];
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO ledger_journal (id, owner, kind, idempotency_key, usd_nanos, \
             diem_nanos, usd_held_nanos, diem_held_nanos, owed_nanos, request_id, \
             reference, model_id, prompt_tokens, completion_tokens, at_ms, key_id) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, NULL, ?11, ?12, ?13, ?14, ?15) \
             ON CONFLICT (idempotency_key) DO NOTHING",
        )?;
        for (i, key, kind) in journal_rows(jobs) {
            let record = &jobs[i].record;
            let row = journal_values(record);
            let [usd, diem, usd_held, diem_held, owed] = row.effects;
            let inserted = insert.execute(params![
                row.id,
                &*record.owner.name,
                kind,
                key,
                usd,
                diem,
                usd_held,
                diem_held,
                owed,
                row.request_id,
                row.model_id,
                row.tokens.0,
                row.tokens.1,
                record.at_ms(now),
                row.key_id
            ])?;
            if inserted == 0 {
                written[i] = Written::Duplicate;
            }
        }
    }

    // 2. Each owner's balances, under its fence.
    let mut fenced = std::collections::HashSet::new();
    {
        let mut update = tx.prepare_cached(
            "UPDATE ledgers SET usd_nanos = usd_nanos + ?2, diem_nanos = diem_nanos + ?3, \
             usd_held_nanos = usd_held_nanos + ?4, diem_held_nanos = diem_held_nanos + ?5, \
             diem_epoch = MAX(diem_epoch, ?6), updated_at_ms = ?7, owed_nanos = owed_nanos + ?9 \
             WHERE owner = ?1 AND fence = ?8",
        )?;
        for ((owner, fence), sum) in &owner_sums(jobs, &written) {
            let [usd, diem, usd_held, diem_held, owed] = sum.effects;
            let updated = update.execute(params![
                &**owner, usd, diem, usd_held, diem_held, sum.day, now, fence, owed
            ])?;
            if updated != 1 {
                fenced.insert((owner.clone(), *fence));
            }
        }
    }
    if !fenced.is_empty() {
        // Dropping `tx` rolls it back.
        return Err(BatchError::Fenced(fenced));
    }

    // 3. The capped keys' spend.
    {
        let mut upsert = tx.prepare_cached(
            "INSERT INTO key_spend (key_id, period, usd_nanos, diem_nanos, usd_held_nanos, \
             diem_held_nanos) VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
             ON CONFLICT (key_id, period) DO UPDATE SET \
             usd_nanos = key_spend.usd_nanos + excluded.usd_nanos, \
             diem_nanos = key_spend.diem_nanos + excluded.diem_nanos, \
             usd_held_nanos = key_spend.usd_held_nanos + excluded.usd_held_nanos, \
             diem_held_nanos = key_spend.diem_held_nanos + excluded.diem_held_nanos",
        )?;
        for (key, [usd, diem, usd_held, diem_held]) in key_sums(jobs, &written) {
            upsert.execute(params![key.0, key.1, usd, diem, usd_held, diem_held])?;
        }
    }

    // 4. Durable holds: opened (a stream that ended in this batch already
    // closed), checkpointed, closed.
    let holds = hold_writes(jobs, &written);
    if !holds.inserts.is_empty() {
        let mut insert = tx.prepare_cached(
            "INSERT INTO holds (request_id, owner, usd_nanos, diem_nanos, state, \
             created_at_ms, expires_at_ms, key_id, key_period, model_id, checkpoint_nanos, \
             checkpoint_prompt_tokens, checkpoint_completion_tokens) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
        )?;
        for hold in &holds.inserts {
            let record = hold.open;
            let (checkpoint, prompt, completion, expires_at_ms) = hold.checkpointed();
            insert.execute(params![
                &*record.request_id,
                &*record.owner.name,
                record.held.0,
                record.held.1,
                hold.state.as_str(),
                record.at_ms(now),
                expires_at_ms,
                record.key.as_ref().map(|k| k.0.as_str()),
                record.key.as_ref().map(|k| k.1.as_str()),
                &*record.model_id,
                checkpoint,
                prompt,
                completion
            ])?;
        }
    }
    for update in holds.updates {
        match update {
            HoldUpdate::Checkpoint(record) => {
                tx.prepare_cached(
                    "UPDATE holds SET checkpoint_nanos = ?2, checkpoint_prompt_tokens = ?3, \
                     checkpoint_completion_tokens = ?4, expires_at_ms = ?5 \
                     WHERE request_id = ?1 AND state = 'open'",
                )?
                .execute(params![
                    &*record.request_id,
                    record.checkpoint,
                    record.tokens.0,
                    record.tokens.1,
                    record.expires_at_ms
                ])?;
            }
            HoldUpdate::Close(record, state) => {
                tx.prepare_cached(
                    "UPDATE holds SET state = ?2 WHERE request_id = ?1 AND state = 'open'",
                )?
                .execute(params![&*record.request_id, state.as_str()])?;
            }
        }
    }

    // 5. Refreshes: the balances as this batch leaves them.
    let mut refreshed = Refreshed::default();
    {
        let mut select = tx.prepare_cached(
            "SELECT l.usd_nanos, l.diem_nanos, l.fence, s.diem_per_day_nanos \
             FROM ledgers l LEFT JOIN stakes s ON s.owner = l.owner WHERE l.owner = ?1",
        )?;
        for owner in refresh_owners(jobs) {
            let row = select
                .query_row(params![&**owner], |row| {
                    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
                })
                .optional()?;
            if let Some(row) = row {
                refreshed.insert(owner.clone(), row);
            }
        }
    }
    tx.commit()?;
    Ok((written, refreshed))
}

/// Loads an owner and claims it: the fence moves on, so whichever replica
/// held it before can no longer write for it.
fn load(conn: &mut Connection, owner: &str) -> Result<Loaded> {
    load_in(conn, owner).map_err(database_error)
}

fn load_in(conn: &mut Connection, owner: &str) -> rusqlite::Result<Loaded> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let (balance, diem_epoch, fence) = tx
        .prepare_cached(
            "INSERT INTO ledgers (owner, updated_at_ms, fence) VALUES (?1, ?2, 1) \
             ON CONFLICT (owner) DO UPDATE SET fence = ledgers.fence + 1 \
             RETURNING usd_nanos, diem_nanos, usd_held_nanos, diem_held_nanos, diem_epoch, \
             fence, owed_nanos",
        )?
        .query_row(params![owner, now_ms()], |row| {
            Ok((
                Balance {
                    usd: row.get(0)?,
                    diem: row.get(1)?,
                    usd_held: row.get(2)?,
                    diem_held: row.get(3)?,
                    owed: row.get(6)?,
                },
                row.get::<_, i64>(4)?,
                row.get::<_, i64>(5)?,
            ))
        })?;
    let stake: Option<i64> = tx
        .prepare_cached("SELECT diem_per_day_nanos FROM stakes WHERE owner = ?1")?
        .query_row(params![owner], |row| row.get(0))
        .optional()?;
    let holds = tx
        .prepare_cached(&format!(
            "SELECT {HOLD_COLUMNS} FROM holds WHERE owner = ?1 AND state = 'open'"
        ))?
        .query_map(params![owner], |row| {
            let mut numbers = [0; 6];
            for (i, number) in numbers.iter_mut().enumerate() {
                *number = row.get(1 + i)?;
            }
            Ok(loaded_hold((
                row.get(0)?,
                numbers,
                [row.get(7)?, row.get(8)?, row.get(9)?],
            )))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    tx.commit()?;
    Ok(Loaded {
        fence,
        balance,
        diem_epoch,
        stake,
        holds,
    })
}
