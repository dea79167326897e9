//! The ledger's durable writer: one task per process that writes what the
//! in-memory owners ([`book`](crate::book)) decided, in batches (group
//! commit).
//!
//! Every record waiting when the writer is free goes into one transaction
//! on the writer's own connection: one multi-row `INSERT` of journal rows
//! (`ON CONFLICT (idempotency_key) DO NOTHING RETURNING`, so a replayed
//! record applies nothing and is reported as a duplicate), one `UPDATE` of
//! each owner's balances with the sum of its records (conditional on the
//! owner's fence: a replica that lost the owner writes nothing), one
//! multi-row upsert of the capped keys' spend, multi-row inserts of holds
//! and usage records. A caller waits for the batch that carries its own
//! record and nothing else. Loads of owners go through the same queue, so
//! an owner is read after every write queued before it.
//!
//! On SQLite no commit of a request runs a WAL checkpoint: connections run
//! with `wal_autocheckpoint = 0` and a task checkpoints on its own
//! ([`Database::spawn_checkpointer`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rialto_core::db::{Database, DatabaseKind, now_ms};
use rialto_core::{Error, ErrorCode, Result};
use sqlx::Row;
use sqlx::pool::PoolConnection;
use tokio::sync::{mpsc, oneshot};

use crate::book::{KeyRef, OpenHold, Owner, SettleOrder};
use crate::ledger::Balance;

/// Most records in one batch.
const MAX_BATCH: usize = 512;
/// Most rows in one multi-row statement.
const ROWS_PER_STATEMENT: usize = 64;

/// What a record does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecordKind {
    /// A durable (stream) hold placed.
    Open,
    /// A hold settled: the charge, the usage history.
    Settle,
    /// A hold expired: its last checkpoint charged.
    Expire,
    /// A stream's usage so far and its new lease.
    Checkpoint,
    /// A DIEM epoch started.
    Epoch,
    /// Read the owner's balance back (credits from elsewhere).
    Refresh,
}

/// One decision to make durable.
#[derive(Debug)]
pub(crate) struct Record {
    pub owner: Arc<Owner>,
    /// The ownership epoch it was decided under.
    pub fence: i64,
    pub kind: RecordKind,
    request_id: Box<str>,
    /// Charged (settle, expire), nano-units; `diem` is the DIEM epoch's
    /// change for an epoch.
    usd: i64,
    diem: i64,
    written_off: i64,
    /// The durable hold's reservation: placed (open) or released (close).
    held: (i64, i64),
    durable: bool,
    /// A settlement of a hold not open here.
    late: bool,
    key: Option<KeyRef>,
    model_id: Arc<str>,
    tokens: (i64, i64),
    expires_at_ms: i64,
    checkpoint: i64,
    day: i64,
}

impl Record {
    fn new(owner: Arc<Owner>, fence: i64, kind: RecordKind) -> Self {
        Self {
            owner,
            fence,
            kind,
            request_id: "".into(),
            usd: 0,
            diem: 0,
            written_off: 0,
            held: (0, 0),
            durable: false,
            late: false,
            key: None,
            model_id: Arc::from(""),
            tokens: (0, 0),
            expires_at_ms: 0,
            checkpoint: 0,
            day: 0,
        }
    }

    pub(crate) fn refresh(owner: Arc<Owner>, fence: i64) -> Self {
        Self::new(owner, fence, RecordKind::Refresh)
    }

    pub(crate) fn open(owner: Arc<Owner>, fence: i64, request_id: &str, hold: &OpenHold) -> Self {
        Self {
            request_id: request_id.into(),
            held: (hold.usd, hold.diem),
            durable: true,
            key: hold.key.clone(),
            model_id: hold.model_id.clone(),
            expires_at_ms: hold.expires_at_ms,
            ..Self::new(owner, fence, RecordKind::Open)
        }
    }

    pub(crate) fn checkpoint(
        owner: Arc<Owner>,
        fence: i64,
        request_id: &str,
        hold: &OpenHold,
    ) -> Self {
        Self {
            request_id: request_id.into(),
            checkpoint: hold.checkpoint,
            tokens: hold.checkpoint_tokens,
            expires_at_ms: hold.expires_at_ms,
            ..Self::new(owner, fence, RecordKind::Checkpoint)
        }
    }

    pub(crate) fn epoch(owner: Arc<Owner>, fence: i64, day: i64, delta: i64) -> Self {
        Self {
            diem: delta,
            day,
            ..Self::new(owner, fence, RecordKind::Epoch)
        }
    }

    /// A settlement of `hold` (the hold it closes; a late settlement's has
    /// nothing held and is not durable).
    pub(crate) fn close(
        owner: Arc<Owner>,
        fence: i64,
        kind: RecordKind,
        order: &SettleOrder<'_>,
        [usd, diem, written_off]: [i64; 3],
        hold: Option<&OpenHold>,
    ) -> Self {
        let late = hold.is_none_or(|h| h.usd == 0 && h.diem == 0 && !h.durable);
        let durable = hold.is_some_and(|h| h.durable);
        Self {
            request_id: order.request_id.into(),
            usd,
            diem,
            written_off,
            held: hold
                .filter(|h| h.durable)
                .map_or((0, 0), |h| (h.usd, h.diem)),
            durable,
            late,
            key: hold.and_then(|h| h.key.clone()),
            model_id: order.model_id.into(),
            tokens: (order.prompt_tokens, order.completion_tokens),
            ..Self::new(owner, fence, kind)
        }
    }

    /// The record's effect on the owner's balances (usd, diem): what is in
    /// memory before the database has it.
    pub(crate) fn balance_delta(&self) -> (i64, i64) {
        match self.kind {
            RecordKind::Settle | RecordKind::Expire => (-self.usd, -self.diem),
            RecordKind::Epoch => (0, self.diem),
            _ => (0, 0),
        }
    }

    /// Undoes in memory a record the database already had (a duplicate).
    /// Returns false when it cannot be undone: the owner must be reloaded.
    fn undo(&self, state: &mut crate::book::State) -> bool {
        match self.kind {
            RecordKind::Settle if self.late => {
                state.balance.usd += self.usd;
                state.balance.diem += self.diem;
                if let Some(spend) = self.key.as_ref().and_then(|k| state.key_mut(k)) {
                    spend.usd -= self.usd;
                    spend.diem -= self.diem;
                }
                true
            }
            RecordKind::Open => {
                if let Some(hold) = state.holds.remove(&*self.request_id) {
                    state.balance.usd_held -= hold.usd;
                    state.balance.diem_held -= hold.diem;
                    if let Some(spend) = hold.key.as_ref().and_then(|k| state.key_mut(k)) {
                        spend.usd_held -= hold.usd;
                        spend.diem_held -= hold.diem;
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// The journal row's idempotency key and kind, if it has one.
    fn journal(&self) -> Option<(String, &'static str)> {
        match self.kind {
            RecordKind::Open => Some((format!("hold:{}", self.request_id), "hold")),
            RecordKind::Settle => Some((format!("settle:{}", self.request_id), "settle")),
            // Keyed as a settlement: a usage record arriving after the
            // expiry finds the request settled (at its checkpoint).
            RecordKind::Expire => Some((format!("settle:{}", self.request_id), "expire")),
            RecordKind::Epoch => Some((format!("epoch:{}:{}", self.owner.name, self.day), "epoch")),
            RecordKind::Checkpoint | RecordKind::Refresh => None,
        }
    }

    /// Signed effects on (usd, diem, usd_held, diem_held).
    fn effects(&self) -> [i64; 4] {
        match self.kind {
            RecordKind::Open => [0, 0, self.held.0, self.held.1],
            RecordKind::Settle | RecordKind::Expire => {
                [-self.usd, -self.diem, -self.held.0, -self.held.1]
            }
            RecordKind::Epoch => [0, self.diem, 0, 0],
            RecordKind::Checkpoint | RecordKind::Refresh => [0; 4],
        }
    }

    /// Effects on the key's period: (usd, diem, usd_held, diem_held).
    fn key_effects(&self) -> [i64; 4] {
        match self.kind {
            RecordKind::Open => [0, 0, self.held.0, self.held.1],
            RecordKind::Settle | RecordKind::Expire => {
                [self.usd, self.diem, -self.held.0, -self.held.1]
            }
            _ => [0; 4],
        }
    }
}

/// How a record was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    Applied,
    /// The database had its idempotency key already: nothing changed.
    Duplicate,
}

/// An owner as loaded from the database.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub fence: i64,
    pub balance: Balance,
    pub diem_epoch: i64,
    pub stake: Option<i64>,
    /// Open durable holds.
    pub holds: Vec<LoadedHold>,
}

/// An open durable hold as loaded: (request id, hold, capped key and
/// period).
pub(crate) type LoadedHold = (String, OpenHold, Option<(String, String)>);

pub(crate) enum Job {
    Write {
        record: Record,
        done: Option<oneshot::Sender<Result<Written>>>,
    },
    Load {
        owner: Arc<str>,
        done: oneshot::Sender<Result<Loaded>>,
    },
    Flush {
        done: oneshot::Sender<()>,
    },
}

/// The queue into the writer.
#[derive(Debug, Clone)]
pub(crate) struct Handle {
    jobs: mpsc::UnboundedSender<Job>,
    stats: Arc<Stats>,
}

#[derive(Debug, Default)]
struct Stats {
    batches: AtomicU64,
    records: AtomicU64,
}

impl Handle {
    pub(crate) fn send(&self, job: Job) -> Result<()> {
        self.jobs.send(job).map_err(|_| stopped())
    }

    /// (batches, records) written so far.
    pub(crate) fn batches(&self) -> (u64, u64) {
        (
            self.stats.batches.load(Ordering::Relaxed),
            self.stats.records.load(Ordering::Relaxed),
        )
    }
}

pub(crate) fn stopped() -> Error {
    Error::new(ErrorCode::Unavailable, "The ledger writer stopped; retry")
}

pub(crate) fn start(db: Database) -> Handle {
    let (jobs, queue) = mpsc::unbounded_channel();
    let stats = Arc::new(Stats::default());
    tokio::spawn(run(db, queue, stats.clone()));
    Handle { jobs, stats }
}

struct WriteJob {
    record: Record,
    done: Option<oneshot::Sender<Result<Written>>>,
}

async fn run(db: Database, mut queue: mpsc::UnboundedReceiver<Job>, stats: Arc<Stats>) {
    let mut connection: Option<PoolConnection<sqlx::Any>> = None;
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    loop {
        if queue.recv_many(&mut jobs, MAX_BATCH).await == 0 {
            return;
        }
        let mut writes = Vec::new();
        let mut loads = Vec::new();
        let mut flushes = Vec::new();
        for job in jobs.drain(..) {
            match job {
                Job::Write { record, done } => writes.push(WriteJob { record, done }),
                Job::Load { owner, done } => loads.push((owner, done)),
                Job::Flush { done } => flushes.push(done),
            }
        }
        if !writes.is_empty() {
            let metrics = rialto_core::metrics::metrics();
            stats.batches.fetch_add(1, Ordering::Relaxed);
            stats
                .records
                .fetch_add(writes.len() as u64, Ordering::Relaxed);
            metrics.ledger_batch_records.observe(writes.len() as f64);
            let started = std::time::Instant::now();
            commit(&db, &mut connection, writes).await;
            metrics
                .ledger_batch_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        // After the writes: a load sees every write queued before it.
        for (owner, done) in loads {
            let loaded = match connect(&db, &mut connection).await {
                Ok(conn) => load(conn, &owner).await,
                Err(error) => Err(error),
            };
            if let Err(error) = &loaded {
                tracing::warn!(%error, %owner, "cannot load a ledger owner");
                if let Some(conn) = connection.take() {
                    let _ = conn.close().await;
                }
            }
            let _ = done.send(loaded);
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

async fn connect<'c>(
    db: &Database,
    connection: &'c mut Option<PoolConnection<sqlx::Any>>,
) -> Result<&'c mut PoolConnection<sqlx::Any>> {
    if connection.is_none() {
        *connection = Some(db.pool().acquire().await?);
    }
    connection
        .as_mut()
        .ok_or_else(|| Error::internal("no writer connection"))
}

enum BatchError {
    /// These (owner, fence) lost their ownership: their records fail.
    Fenced(HashSet<(Arc<str>, i64)>),
    Database(Error),
}

impl From<sqlx::Error> for BatchError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error.into())
    }
}

/// What a committed batch read back: the refreshed owners' (usd, diem,
/// fence, stake).
type Refreshed = HashMap<Arc<str>, (i64, i64, i64, Option<i64>)>;

/// Writes `jobs` in one transaction, or as many as can be: records of an
/// owner whose fence moved fail (and the owner is dropped from memory); a
/// batch the database refuses is written again record by record, so one
/// bad record fails alone.
async fn commit(
    db: &Database,
    connection: &mut Option<PoolConnection<sqlx::Any>>,
    mut jobs: Vec<WriteJob>,
) {
    for attempt in 0..3 {
        let result = match connect(db, connection).await {
            Ok(conn) => write_batch(conn, db.kind(), &jobs).await,
            Err(error) => Err(BatchError::Database(error)),
        };
        match result {
            Ok((written, refreshed)) => {
                complete(jobs, &written, &refreshed);
                return;
            }
            Err(BatchError::Fenced(fenced)) => {
                let (lost, kept): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|job| {
                    fenced.contains(&(job.record.owner.name.clone(), job.record.fence))
                });
                for job in lost {
                    drop_owner(&job.record.owner);
                    if let Some(done) = job.done {
                        let _ = done.send(Err(Error::new(
                            ErrorCode::Unavailable,
                            "This ledger moved to another billing replica; retry",
                        )));
                    }
                }
                jobs = kept;
                if jobs.is_empty() {
                    return;
                }
            }
            Err(BatchError::Database(error)) => {
                tracing::warn!(%error, records = jobs.len(), attempt, "ledger batch failed");
                // Closed, not returned to the pool: it may still be inside
                // the failed transaction, holding its locks.
                if let Some(conn) = connection.take() {
                    let _ = conn.close().await;
                }
                if jobs.len() > 1 {
                    // One by one, so that one bad record fails alone.
                    for job in jobs {
                        Box::pin(commit(db, connection, vec![job])).await;
                    }
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20 << attempt)).await;
            }
        }
    }
    for job in jobs {
        tracing::error!(
            owner = %job.record.owner.name,
            request_id = %job.record.request_id,
            "ledger record not written; the owner is reloaded"
        );
        drop_owner(&job.record.owner);
        if let Some(done) = job.done {
            let _ = done.send(Err(Error::new(
                ErrorCode::Unavailable,
                "The ledger cannot be written now; retry",
            )));
        }
    }
}

fn drop_owner(owner: &Arc<Owner>) {
    if let Some(state) = owner.lock().as_mut() {
        state.live = false;
    }
}

/// Tells each owner and each waiting caller how its record was written.
/// Refreshes last: the balance a refresh read includes every record of
/// its batch, so each of those must have left `unflushed` first.
fn complete(jobs: Vec<WriteJob>, written: &[Written], refreshed: &Refreshed) {
    let (refreshes, records): (Vec<_>, Vec<_>) = jobs
        .into_iter()
        .zip(written)
        .partition(|(job, _)| job.record.kind == RecordKind::Refresh);
    for (job, outcome) in records.into_iter().chain(refreshes) {
        let record = &job.record;
        {
            let mut guard = record.owner.lock();
            if let Some(state) = guard.as_mut().filter(|s| s.fence == record.fence) {
                state.pending = state.pending.saturating_sub(1);
                let (usd, diem) = record.balance_delta();
                state.unflushed.0 -= usd;
                state.unflushed.1 -= diem;
                if *outcome == Written::Duplicate && !record.undo(state) {
                    state.live = false;
                }
                if record.kind == RecordKind::Refresh {
                    match refreshed.get(&record.owner.name) {
                        Some(&(usd, diem, fence, stake)) if fence == record.fence => {
                            state.refreshed(usd, diem, stake);
                        }
                        // Another replica loaded the owner: not ours now.
                        _ => state.live = false,
                    }
                }
            }
        }
        if let Some(done) = job.done {
            let _ = done.send(Ok(*outcome));
        }
    }
}

/// Placeholders for `rows` rows of `columns` parameters: `($1, $2), ($3,
/// $4)` on PostgreSQL, `(?, ?), (?, ?)` on SQLite (bound in order; sqlx
/// looks every `$n` up by name on SQLite, which costs more than the insert
/// with hundreds of them). The only text the writer puts into its SQL
/// (hence `AssertSqlSafe`).
fn values(kind: DatabaseKind, rows: usize, columns: usize) -> String {
    let mut sql = String::with_capacity(rows * columns * 5);
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        sql.push('(');
        for column in 0..columns {
            if column > 0 {
                sql.push_str(", ");
            }
            match kind {
                DatabaseKind::Sqlite => sql.push('?'),
                DatabaseKind::Postgres => {
                    sql.push('$');
                    sql.push_str(&(row * columns + column + 1).to_string());
                }
            }
        }
        sql.push(')');
    }
    sql
}

async fn write_batch(
    conn: &mut PoolConnection<sqlx::Any>,
    kind: DatabaseKind,
    jobs: &[WriteJob],
) -> std::result::Result<(Vec<Written>, Refreshed), BatchError> {
    let now = now_ms();
    let mut tx = sqlx::Connection::begin(&mut **conn).await?;

    // 1. The journal: what applies (a replay's key exists already).
    let journaled: Vec<(usize, String, &'static str)> = jobs
        .iter()
        .enumerate()
        .filter_map(|(i, job)| job.record.journal().map(|(key, kind)| (i, key, kind)))
        .collect();
    let mut inserted: HashSet<String> = HashSet::with_capacity(journaled.len());
    for chunk in journaled.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "INSERT INTO ledger_journal (id, owner, kind, idempotency_key, usd_nanos, \
             diem_nanos, usd_held_nanos, diem_held_nanos, written_off_nanos, request_id, \
             reference, at_ms) VALUES {} ON CONFLICT (idempotency_key) DO NOTHING \
             RETURNING idempotency_key",
            values(kind, chunk.len(), 12)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (i, key, kind) in chunk {
            let record = &jobs[*i].record;
            let [usd, diem, usd_held, diem_held] = record.effects();
            let request_id = match record.kind {
                RecordKind::Epoch => None,
                _ => Some(&*record.request_id),
            };
            query = query
                .bind(crate::ledger::uuid_like())
                .bind(&*record.owner.name)
                .bind(*kind)
                .bind(key.as_str())
                .bind(usd)
                .bind(diem)
                .bind(usd_held)
                .bind(diem_held)
                .bind(record.written_off)
                .bind(request_id)
                .bind(None::<&str>)
                .bind(now);
        }
        for row in query.fetch_all(&mut *tx).await? {
            inserted.insert(row.try_get(0)?);
        }
    }
    // The first record of a key inserted it; any other (the database had
    // it, or an earlier record of this batch) is a duplicate.
    let mut written = vec![Written::Applied; jobs.len()];
    for (i, key, _) in &journaled {
        if !inserted.remove(key) {
            written[*i] = Written::Duplicate;
        }
    }
    let applied = |i: usize| written[i] == Written::Applied;

    // 2. Each owner's balances, under its fence.
    let mut owners: HashMap<(Arc<str>, i64), ([i64; 4], i64)> = HashMap::new();
    for (i, job) in jobs.iter().enumerate() {
        let record = &job.record;
        if record.kind == RecordKind::Refresh {
            continue;
        }
        let entry = owners
            .entry((record.owner.name.clone(), record.fence))
            .or_insert(([0; 4], 0));
        if applied(i) {
            for (sum, effect) in entry.0.iter_mut().zip(record.effects()) {
                *sum += effect;
            }
            if record.kind == RecordKind::Epoch {
                entry.1 = entry.1.max(record.day);
            }
        }
    }
    let mut fenced = HashSet::new();
    for ((owner, fence), ([usd, diem, usd_held, diem_held], day)) in &owners {
        let updated = sqlx::query(
            "UPDATE ledgers SET usd_nanos = usd_nanos + $2, diem_nanos = diem_nanos + $3, \
             usd_held_nanos = usd_held_nanos + $4, diem_held_nanos = diem_held_nanos + $5, \
             diem_epoch = CASE WHEN $6 > diem_epoch THEN $6 ELSE diem_epoch END, \
             updated_at_ms = $7 WHERE owner = $1 AND fence = $8",
        )
        .bind(&**owner)
        .bind(usd)
        .bind(diem)
        .bind(usd_held)
        .bind(diem_held)
        .bind(day)
        .bind(now)
        .bind(fence)
        .execute(&mut *tx)
        .await?;
        if updated.rows_affected() != 1 {
            fenced.insert((owner.clone(), *fence));
        }
    }
    if !fenced.is_empty() {
        tx.rollback().await?;
        return Err(BatchError::Fenced(fenced));
    }

    // 3. The capped keys' spend.
    let mut keys: HashMap<KeyRef, [i64; 4]> = HashMap::new();
    for (i, job) in jobs.iter().enumerate() {
        if let Some(key) = job.record.key.as_ref().filter(|_| applied(i)) {
            let sums = keys.entry(key.clone()).or_insert([0; 4]);
            for (sum, effect) in sums.iter_mut().zip(job.record.key_effects()) {
                *sum += effect;
            }
        }
    }
    let keys: Vec<_> = keys.into_iter().filter(|(_, s)| *s != [0; 4]).collect();
    for chunk in keys.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "INSERT INTO key_spend (key_id, period, usd_nanos, diem_nanos, usd_held_nanos, \
             diem_held_nanos) VALUES {} ON CONFLICT (key_id, period) DO UPDATE SET \
             usd_nanos = key_spend.usd_nanos + excluded.usd_nanos, \
             diem_nanos = key_spend.diem_nanos + excluded.diem_nanos, \
             usd_held_nanos = key_spend.usd_held_nanos + excluded.usd_held_nanos, \
             diem_held_nanos = key_spend.diem_held_nanos + excluded.diem_held_nanos",
            values(kind, chunk.len(), 6)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (key, [usd, diem, usd_held, diem_held]) in chunk {
            query = query
                .bind(key.0.as_str())
                .bind(key.1.as_str())
                .bind(*usd)
                .bind(*diem)
                .bind(*usd_held)
                .bind(*diem_held);
        }
        query.execute(&mut *tx).await?;
    }

    // 4. Durable holds: opened, checkpointed, closed.
    let opened: Vec<&Record> = jobs
        .iter()
        .enumerate()
        .filter(|(i, job)| job.record.kind == RecordKind::Open && applied(*i))
        .map(|(_, job)| &job.record)
        .collect();
    for chunk in opened.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "INSERT INTO holds (request_id, owner, usd_nanos, diem_nanos, state, \
             created_at_ms, expires_at_ms, key_id, key_period, model_id) VALUES {}",
            values(kind, chunk.len(), 10)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for record in chunk {
            query = query
                .bind(&*record.request_id)
                .bind(&*record.owner.name)
                .bind(record.held.0)
                .bind(record.held.1)
                .bind("open")
                .bind(now)
                .bind(record.expires_at_ms)
                .bind(record.key.as_ref().map(|k| k.0.as_str()))
                .bind(record.key.as_ref().map(|k| k.1.as_str()))
                .bind(&*record.model_id);
        }
        query.execute(&mut *tx).await?;
    }
    for (i, job) in jobs.iter().enumerate() {
        let record = &job.record;
        match record.kind {
            RecordKind::Checkpoint => {
                sqlx::query(
                    "UPDATE holds SET checkpoint_nanos = $2, checkpoint_prompt_tokens = $3, \
                     checkpoint_completion_tokens = $4, expires_at_ms = $5 \
                     WHERE request_id = $1 AND state = 'open'",
                )
                .bind(&*record.request_id)
                .bind(record.checkpoint)
                .bind(record.tokens.0)
                .bind(record.tokens.1)
                .bind(record.expires_at_ms)
                .execute(&mut *tx)
                .await?;
            }
            RecordKind::Settle | RecordKind::Expire if record.durable && applied(i) => {
                let state = if record.kind == RecordKind::Expire {
                    "expired"
                } else {
                    "settled"
                };
                sqlx::query("UPDATE holds SET state = $2 WHERE request_id = $1 AND state = 'open'")
                    .bind(&*record.request_id)
                    .bind(state)
                    .execute(&mut *tx)
                    .await?;
            }
            _ => {}
        }
    }

    // 5. The usage history: a row per currency that paid.
    let mut usage: Vec<(&Record, &'static str, i64)> = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let record = &job.record;
        if matches!(record.kind, RecordKind::Settle | RecordKind::Expire) && applied(i) {
            for (currency, amount) in [("DIEM", record.diem), ("USD", record.usd)] {
                if amount != 0 {
                    usage.push((record, currency, amount));
                }
            }
        }
    }
    for chunk in usage.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "INSERT INTO usage_records (id, owner, request_id, model_id, currency, \
             amount_nanos, prompt_tokens, completion_tokens, at_ms) VALUES {}",
            values(kind, chunk.len(), 9)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (record, currency, amount) in chunk {
            query = query
                .bind(crate::ledger::uuid_like())
                .bind(&*record.owner.name)
                .bind(&*record.request_id)
                .bind(&*record.model_id)
                .bind(*currency)
                .bind(*amount)
                .bind(record.tokens.0)
                .bind(record.tokens.1)
                .bind(now);
        }
        query.execute(&mut *tx).await?;
    }

    // 6. Refreshes: the balances as this batch leaves them.
    let mut refreshed = Refreshed::new();
    let wanted: Vec<&Arc<str>> = jobs
        .iter()
        .filter(|job| job.record.kind == RecordKind::Refresh)
        .map(|job| &job.record.owner.name)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    for chunk in wanted.chunks(ROWS_PER_STATEMENT) {
        let list = values(kind, 1, chunk.len());
        let sql = format!(
            "SELECT l.owner, l.usd_nanos, l.diem_nanos, l.fence, s.diem_per_day_nanos \
             FROM ledgers l LEFT JOIN stakes s ON s.owner = l.owner WHERE l.owner IN {list}"
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for owner in chunk {
            query = query.bind(&***owner);
        }
        for row in query.fetch_all(&mut *tx).await? {
            let owner: String = row.try_get(0)?;
            refreshed.insert(
                owner.into(),
                (
                    row.try_get(1)?,
                    row.try_get(2)?,
                    row.try_get(3)?,
                    row.try_get(4)?,
                ),
            );
        }
    }
    tx.commit().await?;
    Ok((written, refreshed))
}

/// Loads an owner and claims it: the fence moves on, so whichever replica
/// held it before can no longer write for it.
async fn load(conn: &mut PoolConnection<sqlx::Any>, owner: &str) -> Result<Loaded> {
    let mut tx = sqlx::Connection::begin(&mut **conn).await?;
    let row = sqlx::query(
        "INSERT INTO ledgers (owner, updated_at_ms, fence) VALUES ($1, $2, 1) \
         ON CONFLICT (owner) DO UPDATE SET fence = ledgers.fence + 1 \
         RETURNING usd_nanos, diem_nanos, usd_held_nanos, diem_held_nanos, diem_epoch, fence",
    )
    .bind(owner)
    .bind(now_ms())
    .fetch_one(&mut *tx)
    .await?;
    let balance = Balance {
        usd: row.try_get(0)?,
        diem: row.try_get(1)?,
        usd_held: row.try_get(2)?,
        diem_held: row.try_get(3)?,
    };
    let (diem_epoch, fence): (i64, i64) = (row.try_get(4)?, row.try_get(5)?);
    let stake: Option<i64> = sqlx::query("SELECT diem_per_day_nanos FROM stakes WHERE owner = $1")
        .bind(owner)
        .fetch_optional(&mut *tx)
        .await?
        .map(|row| row.try_get(0))
        .transpose()?;
    let rows = sqlx::query(
        "SELECT request_id, usd_nanos, diem_nanos, expires_at_ms, key_id, key_period, \
         model_id, checkpoint_nanos, checkpoint_prompt_tokens, checkpoint_completion_tokens \
         FROM holds WHERE owner = $1 AND state = 'open'",
    )
    .bind(owner)
    .fetch_all(&mut *tx)
    .await?;
    let mut holds = Vec::with_capacity(rows.len());
    for row in rows {
        let key_id: Option<String> = row.try_get(4)?;
        let period: Option<String> = row.try_get(5)?;
        let model_id: Option<String> = row.try_get(6)?;
        holds.push((
            row.try_get::<String, _>(0)?,
            OpenHold {
                usd: row.try_get(1)?,
                diem: row.try_get(2)?,
                expires_at_ms: row.try_get(3)?,
                key: None,
                durable: true,
                checkpoint: row.try_get(7)?,
                checkpoint_tokens: (row.try_get(8)?, row.try_get(9)?),
                model_id: model_id.unwrap_or_default().into(),
            },
            key_id.zip(period),
        ));
    }
    tx.commit().await?;
    Ok(Loaded {
        fence,
        balance,
        diem_epoch,
        stake,
        holds,
    })
}

#[cfg(test)]
mod tests {
    use super::values;

    #[test]
    fn placeholders_number_every_row() {
        use rialto_core::db::DatabaseKind;
        assert_eq!(
            values(DatabaseKind::Postgres, 2, 3),
            "($1, $2, $3), ($4, $5, $6)"
        );
        assert_eq!(values(DatabaseKind::Sqlite, 1, 2), "(?, ?)");
    }
}
