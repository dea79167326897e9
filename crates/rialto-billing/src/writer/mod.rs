//! The ledger's durable writer: one per process, writing what the
//! in-memory owners ([`book`](crate::book)) decided, in batches (group
//! commit).
//!
//! Every record waiting when the writer is free goes into one transaction
//! on the writer's own connection: journal rows (`ON CONFLICT
//! (idempotency_key) DO NOTHING`, so a replayed record applies nothing and
//! is reported as a duplicate), one `UPDATE` of each owner's balances with
//! the sum of its records (conditional on the owner's fence: a replica
//! that lost the owner writes nothing), the capped keys' spend and durable
//! holds. A settlement's journal row carries its model and tokens: it is
//! the usage history too (`usage_records` is a view of the journal), so a
//! settlement alone writes four pages (the balance, the journal, its key
//! and its owner index). A caller waits for the batch that carries its own record
//! and nothing else; on SQLite, where the ledger's [`log`] makes a record
//! durable once appended, it usually waits for nothing, and a stream's open
//! is held back until the stream ends ([`held_back`]). Loads of owners go
//! through the same queue, so an owner is read after every write queued
//! before it.
//!
//! What a batch writes is decided here, the same for every database; two
//! backends run it: [`sqlite`], a thread with its own connection to the
//! SQLite file (one hop per batch), and [`pooled`], a task over a
//! connection of the sqlx pool with multi-row statements (PostgreSQL).
//!
//! On SQLite no commit of a request runs a WAL checkpoint: connections run
//! with `wal_autocheckpoint = 0` and a task checkpoints on its own
//! ([`Database::spawn_checkpointer`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rialto_core::db::Database;
use rialto_core::hashing::HashMap;
use rialto_core::{Error, ErrorCode, Result};
use tokio::sync::{mpsc, oneshot};

use crate::book::{KeyRef, OpenHold, Owner, SettleOrder};
use crate::ledger::Balance;

mod held_back;
pub(crate) mod log;
mod pooled;
mod sqlite;

/// Most records in one batch.
const MAX_BATCH: usize = 512;

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
    /// The change in what the owner owes (settle): positive when the
    /// settlement left part of its cost unpaid, negative when it paid debt.
    owed: i64,
    /// The durable hold's reservation: placed (open) or released (close).
    held: (i64, i64),
    durable: bool,
    /// A settlement of a hold not open here.
    late: bool,
    /// The rest of an expired stream's cost (`settle-rest:<request>`).
    rest: bool,
    key: Option<KeyRef>,
    model_id: Arc<str>,
    /// The API key that made the request ("" for none).
    spent_by: Arc<str>,
    tokens: (i64, i64),
    expires_at_ms: i64,
    /// When it was decided, where the writer may write it much later (a
    /// stream's open, held back until the stream ends): its journal row's
    /// `at_ms` and its hold's `created_at_ms`. 0: when it is written.
    at_ms: i64,
    checkpoint: i64,
    day: i64,
    /// Its place in the ledger's log (SQLite), 0 when not logged.
    log_seq: u64,
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
            owed: 0,
            held: (0, 0),
            durable: false,
            late: false,
            rest: false,
            key: None,
            model_id: Arc::from(""),
            spent_by: Arc::from(""),
            tokens: (0, 0),
            expires_at_ms: 0,
            at_ms: 0,
            checkpoint: 0,
            day: 0,
            log_seq: 0,
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
            at_ms: hold.opened_at_ms,
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
        [usd, diem, owed]: [i64; 3],
        hold: Option<&OpenHold>,
    ) -> Self {
        let late = hold.is_none_or(|h| h.usd == 0 && h.diem == 0 && !h.durable);
        let durable = hold.is_some_and(|h| h.durable);
        Self {
            request_id: order.request_id.into(),
            usd,
            diem,
            owed,
            held: hold
                .filter(|h| h.durable)
                .map_or((0, 0), |h| (h.usd, h.diem)),
            durable,
            late,
            rest: order.rest,
            key: hold.and_then(|h| h.key.clone()),
            model_id: order.model_id.into(),
            spent_by: order.spent_by.into(),
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
                state.balance.owed -= self.owed;
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
            RecordKind::Settle if self.rest => {
                Some((format!("settle-rest:{}", self.request_id), "settle"))
            }
            RecordKind::Settle => Some((format!("settle:{}", self.request_id), "settle")),
            // Keyed as a settlement: a usage record arriving after the
            // expiry finds the request settled at its checkpoint, and is
            // charged only the rest (`rest`).
            RecordKind::Expire => Some((format!("settle:{}", self.request_id), "expire")),
            RecordKind::Epoch => Some((format!("epoch:{}:{}", self.owner.name, self.day), "epoch")),
            RecordKind::Checkpoint | RecordKind::Refresh => None,
        }
    }

    /// When it happened, for its rows: when it was decided, if known, else
    /// `now` (the batch's time).
    fn at_ms(&self, now: i64) -> i64 {
        if self.timed() { self.at_ms } else { now }
    }

    /// Whether it carries when it was decided.
    fn timed(&self) -> bool {
        self.at_ms > 0
    }

    /// Signed effects on (usd, diem, usd_held, diem_held, owed).
    fn effects(&self) -> [i64; 5] {
        match self.kind {
            RecordKind::Open => [0, 0, self.held.0, self.held.1, 0],
            RecordKind::Settle | RecordKind::Expire => {
                [-self.usd, -self.diem, -self.held.0, -self.held.1, self.owed]
            }
            RecordKind::Epoch => [0, self.diem, 0, 0, 0],
            RecordKind::Checkpoint | RecordKind::Refresh => [0; 5],
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

/// The columns both backends load an open durable hold from, in the order
/// of [`HoldRow`].
const HOLD_COLUMNS: &str = "request_id, usd_nanos, diem_nanos, expires_at_ms, \
    checkpoint_nanos, checkpoint_prompt_tokens, checkpoint_completion_tokens, key_id, \
    key_period, model_id";

/// An open durable hold's row: [`HOLD_COLUMNS`].
type HoldRow = (String, [i64; 6], [Option<String>; 3]);

fn loaded_hold(
    (
        request_id,
        [usd, diem, expires_at_ms, checkpoint, prompt, completion],
        [key_id, period, model_id],
    ): HoldRow,
) -> LoadedHold {
    (
        request_id,
        OpenHold {
            usd,
            diem,
            expires_at_ms,
            opened_at_ms: 0,
            key: None,
            durable: true,
            checkpoint,
            checkpoint_tokens: (prompt, completion),
            model_id: model_id.unwrap_or_default().into(),
        },
        key_id.zip(period),
    )
}

pub(crate) enum Job {
    Write {
        record: Record,
        done: Option<oneshot::Sender<Result<Written>>>,
    },
    Load {
        owner: Arc<str>,
        /// Who claims it (a billing replica of several), `None`: whoever
        /// loads it claims it.
        claim: Option<Claim>,
        done: oneshot::Sender<Result<Loaded>>,
    },
    /// The replica that held `owner` under `fence` lets it go, after
    /// every write queued before (PostgreSQL; SQLite has one process).
    Release { owner: Arc<str>, fence: i64 },
    /// Answers once every job queued before it is done and, with the
    /// ledger's log, the database has the opens held back for `owner`
    /// (every owner's when `None`): readers of the database wait for it.
    Flush {
        owner: Option<Arc<str>>,
        done: oneshot::Sender<()>,
    },
    /// The WAL's checkpointer copied all but the last few frames: the
    /// writer copies those on its own connection (SQLite only).
    Checkpoint,
}

impl Job {
    /// Whether someone waits for this job's outcome: a gathering batch
    /// stops gathering for it.
    fn waited_on(&self) -> bool {
        match self {
            Job::Write { done, .. } => done.is_some(),
            Job::Load { .. } | Job::Flush { .. } => true,
            Job::Checkpoint | Job::Release { .. } => false,
        }
    }
}

/// The queue into the writer.
#[derive(Debug, Clone)]
pub(crate) struct Handle {
    jobs: mpsc::UnboundedSender<Job>,
    stats: Arc<Stats>,
    /// The ledger's log (SQLite, when this process holds it).
    log: Option<Arc<log::Log>>,
    nudge: Arc<Nudge>,
}

/// Wakes the SQLite writer's thread from a gathering batch's sleep for a
/// job someone waits on. Nobody else wakes it while it gathers: a batch
/// sleeps once, not once per record or per step.
#[derive(Debug, Default)]
pub(crate) struct Nudge(std::sync::OnceLock<std::thread::Thread>);

impl Nudge {
    pub(crate) fn job(&self, job_waited_on: bool) {
        if job_waited_on && let Some(thread) = self.0.get() {
            thread.unpark();
        }
    }
}

#[derive(Debug, Default)]
struct Stats {
    batches: AtomicU64,
    records: AtomicU64,
}

impl Handle {
    pub(crate) fn send(&self, job: Job) -> Result<()> {
        let waited_on = job.waited_on();
        self.jobs.send(job).map_err(|_| stopped())?;
        self.nudge.job(waited_on);
        Ok(())
    }

    /// Queues `record`; `done` hears how it was written. With the ledger's
    /// log, a record is durable once appended, and `done` hears so at once
    /// unless its outcome needs the database ([`log`]).
    pub(crate) fn write(
        &self,
        record: Record,
        done: Option<oneshot::Sender<Result<Written>>>,
    ) -> Result<()> {
        match &self.log {
            Some(log) if record.kind != RecordKind::Refresh => {
                log.append(record, done, &self.jobs, &self.nudge)
            }
            _ => self.send(Job::Write { record, done }),
        }
    }

    /// Whether records are durable before the database has them: readers
    /// of the database flush the writer first.
    pub(crate) fn logs(&self) -> bool {
        self.log.is_some()
    }

    /// Records in the ledger's log the writer is not done with yet.
    #[cfg(test)]
    pub(crate) fn behind(&self) -> u64 {
        self.log.as_ref().map_or(0, |log| log.behind())
    }

    /// (batches, records) written so far.
    pub(crate) fn batches(&self) -> (u64, u64) {
        (
            self.stats.batches.load(Ordering::Relaxed),
            self.stats.records.load(Ordering::Relaxed),
        )
    }
}

/// Which billing replica loads an owner, and what it may take. An owner's
/// `ledgers.holder` names the replica that claimed it last, until that
/// replica lets it go (its view moved the owner away, or it sat idle): a
/// replica takes an owner another one holds only when it no longer hears
/// that one (the others count it dead, and it counts itself away and
/// decides nothing), so two live replicas never decide for one owner at
/// once, whatever the gateways' views.
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    /// This replica's name, as listed: written as the holder.
    pub me: Arc<str>,
    /// The other replicas it hears, as listed, joined by commas.
    pub live: String,
    /// The ready replica its view gives the owner to, when not itself:
    /// an owner nobody holds is left to that one.
    pub elsewhere: Option<Arc<str>>,
}

/// How an error that sends a call to another replica begins and ends.
const KEPT_BY: (&str, &str) = ("This ledger is kept by billing replica ", "; asked there");

/// What a call hears on a replica that may not load its owner: another
/// one holds it, or is the one to take it.
pub(crate) fn kept_by(replica: &str) -> Error {
    Error::new(
        ErrorCode::Unavailable,
        format!("{}{replica}{}", KEPT_BY.0, KEPT_BY.1),
    )
}

/// The replica `error` sends a call to ([`kept_by`]), here or across gRPC.
pub fn kept_elsewhere(error: &Error) -> Option<&str> {
    if error.code != ErrorCode::Unavailable {
        return None;
    }
    error
        .message
        .strip_prefix(KEPT_BY.0)?
        .strip_suffix(KEPT_BY.1)
}

/// What a call hears when its owner's ledger is between replicas (let go
/// by one, not yet taken by another): asked again, it finds the keeper.
const MOVING: &str = "The ledger of this account is moving between billing replicas; retry";

pub(crate) fn moving() -> Error {
    Error::new(ErrorCode::Unavailable, MOVING)
}

/// Whether `error` says the ledger is between replicas ([`moving`]).
pub fn is_moving(error: &Error) -> bool {
    error.code == ErrorCode::Unavailable && error.message == MOVING
}

/// What a call whose record was fenced out hears: another replica loaded
/// its ledger after this one decided (a hand-back, or two gateways' views
/// differing for a moment), so nothing was written, and asked again the
/// call is decided afresh on the ledger as the database has it.
const MOVED: &str = "This ledger moved to another billing replica; retry";

fn moved() -> Error {
    Error::new(ErrorCode::Unavailable, MOVED)
}

/// Whether `error` says a record was fenced out ([`moved`]), here or on a
/// replica across gRPC.
pub fn fenced_out(error: &Error) -> bool {
    error.code == ErrorCode::Unavailable && error.message.contains(MOVED)
}

pub(crate) fn stopped() -> Error {
    Error::new(ErrorCode::Unavailable, "The ledger writer stopped; retry")
}

/// Starts the process's writer: on SQLite, a thread of its own with a
/// connection of its own ([`sqlite`]); on PostgreSQL, a task over a
/// connection of the pool ([`pooled`]).
/// `logged`: on SQLite, take the ledger's log (`rialto serve`); a process
/// that only runs an operator's command (the CLI) does not.
pub(crate) fn start(db: Database, logged: bool) -> Handle {
    let (jobs, queue) = mpsc::unbounded_channel();
    let stats = Arc::new(Stats::default());
    let nudge = Arc::new(Nudge::default());
    let mut log = None;
    match db.sqlite_file() {
        Some(file) => {
            let mut refuse = None;
            let opened = match logged.then(|| log::Log::open(file)) {
                None => None,
                Some(Ok(Some(opened))) => Some(opened),
                Some(Ok(None)) => {
                    tracing::warn!(
                        file = %file.display(),
                        "another process writes this SQLite ledger: this one waits for its \
                         batches (billing replicas belong on PostgreSQL)"
                    );
                    None
                }
                Some(Err(error)) => {
                    // What an earlier process logged may not be applied:
                    // deciding on the database alone could charge twice or
                    // lend what was spent. Billing refuses until this is
                    // fixed (a folder that cannot be written, a segment
                    // that cannot be read) and the process restarted.
                    tracing::error!(
                        %error,
                        file = %file.display(),
                        "cannot open the ledger's log; billing refuses every request"
                    );
                    refuse = Some(error.to_string());
                    None
                }
            };
            log = opened.as_ref().map(|o| o.log.clone());
            sqlite::spawn(
                db.clone(),
                file.to_path_buf(),
                queue,
                jobs.downgrade(),
                stats.clone(),
                match (opened, refuse) {
                    (Some(opened), _) => sqlite::LogState::Logged(opened),
                    (None, Some(error)) => sqlite::LogState::Refused(error),
                    (None, None) => sqlite::LogState::Unlogged,
                },
                &nudge,
            );
        }
        None => {
            tokio::spawn(pooled::run(db, queue, stats.clone()));
        }
    }
    Handle {
        jobs,
        stats,
        log,
        nudge,
    }
}

pub(crate) struct WriteJob {
    record: Record,
    done: Option<oneshot::Sender<Result<Written>>>,
}

/// A batch's jobs, sorted by what they ask for.
#[derive(Default)]
struct Sorted {
    writes: Vec<WriteJob>,
    loads: Vec<(Arc<str>, Loading)>,
    /// (owner, fence) let go, after the writes.
    releases: Vec<(Arc<str>, i64)>,
    flushes: Vec<oneshot::Sender<()>>,
    /// The owners the batch's flushes read (their held opens are
    /// written), unless one reads every owner.
    flushed: Flushed,
    checkpoint: bool,
}

/// A load waiting in a batch.
struct Loading {
    claim: Option<Claim>,
    done: oneshot::Sender<Result<Loaded>>,
}

/// Whose held-back opens a batch's flushes need in the database.
enum Flushed {
    /// These owners' (none: no flush, or no owner read).
    Owners(Vec<Arc<str>>),
    /// Every owner's.
    All,
}

impl Default for Flushed {
    fn default() -> Self {
        Flushed::Owners(Vec::new())
    }
}

impl Flushed {
    /// A flush reading `owner` (every owner: `None`).
    fn add(&mut self, owner: Option<Arc<str>>) {
        match (self, owner) {
            (Flushed::Owners(owners), Some(owner)) => owners.push(owner),
            (flushed, _) => *flushed = Flushed::All,
        }
    }
}

impl Sorted {
    fn new(jobs: impl Iterator<Item = Job>) -> Self {
        let mut sorted = Self::default();
        for job in jobs {
            match job {
                Job::Write { record, done } => sorted.writes.push(WriteJob { record, done }),
                Job::Load { owner, claim, done } => {
                    sorted.loads.push((owner, Loading { claim, done }))
                }
                Job::Release { owner, fence } => sorted.releases.push((owner, fence)),
                Job::Flush { owner, done } => {
                    sorted.flushes.push(done);
                    sorted.flushed.add(owner);
                }
                Job::Checkpoint => sorted.checkpoint = true,
            }
        }
        sorted
    }
}

/// Counts a batch before it is written; call the result once it is.
fn observe(stats: &Stats, records: usize) -> impl FnOnce() + use<> {
    let metrics = rialto_core::metrics::metrics();
    stats.batches.fetch_add(1, Ordering::Relaxed);
    stats.records.fetch_add(records as u64, Ordering::Relaxed);
    metrics.ledger_batch_records.observe(records as f64);
    let started = std::time::Instant::now();
    move || {
        metrics
            .ledger_batch_seconds
            .observe(started.elapsed().as_secs_f64());
    }
}

pub(crate) enum BatchError {
    /// These (owner, fence) lost their ownership: their records fail.
    Fenced(HashSet<(Arc<str>, i64)>),
    Database(Error),
}

/// What a committed batch read back: the refreshed owners' (usd, diem,
/// fence, stake).
pub(crate) type Refreshed = HashMap<Arc<str>, (i64, i64, i64, Option<i64>)>;

type BatchResult = std::result::Result<(Vec<Written>, Refreshed), BatchError>;

/// What an attempt at a batch leaves to do.
enum Next {
    /// `lost`: some records were not written (their owner moved).
    Done { lost: bool },
    /// Write these again; `failed`: the database refused the batch, so the
    /// connection is dropped (it may still be inside the failed
    /// transaction, holding its locks) and, if several, they are written
    /// one by one, so that one bad record fails alone.
    Again {
        jobs: Vec<WriteJob>,
        failed: bool,
        lost: bool,
        /// Write them under their owners' current fences (the ledger's log).
        refence: bool,
    },
}

/// Delivers an attempt's outcome: records of an owner whose fence moved
/// fail (and the owner is dropped from memory), the rest are written again.
///
/// With the ledger's log (`logged`), a record was answered as durable
/// before this: it is never dropped. A fenced one (another process loaded
/// its owner from the same file) drops the owner from memory and is
/// written again under the owner's current fence (`refence`).
fn after_attempt(jobs: Vec<WriteJob>, result: BatchResult, attempt: u32, logged: bool) -> Next {
    match result {
        Ok((written, refreshed)) => {
            complete(jobs, &written, &refreshed);
            Next::Done { lost: false }
        }
        Err(BatchError::Fenced(fenced)) if logged => {
            for job in &jobs {
                if fenced.contains(&(job.record.owner.name.clone(), job.record.fence)) {
                    drop_owner(&job.record.owner);
                }
            }
            tracing::warn!(
                owners = fenced.len(),
                "another process loaded ledger owners this one wrote for; written under their new fence"
            );
            Next::Again {
                jobs,
                failed: false,
                lost: false,
                refence: true,
            }
        }
        Err(BatchError::Fenced(fenced)) => {
            let (fenced_out, kept): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|job| {
                fenced.contains(&(job.record.owner.name.clone(), job.record.fence))
            });
            let lost = !fenced_out.is_empty();
            for job in fenced_out {
                drop_owner(&job.record.owner);
                if let Some(done) = job.done {
                    let _ = done.send(Err(moved()));
                }
            }
            if kept.is_empty() {
                Next::Done { lost }
            } else {
                Next::Again {
                    jobs: kept,
                    failed: false,
                    lost,
                    refence: false,
                }
            }
        }
        Err(BatchError::Database(error)) => {
            tracing::warn!(%error, records = jobs.len(), attempt, "ledger batch failed");
            Next::Again {
                jobs,
                failed: true,
                lost: false,
                refence: false,
            }
        }
    }
}

/// The records that could not be written: their owners are reloaded.
fn give_up(jobs: Vec<WriteJob>) {
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

/// How long to wait before attempt `attempt + 1` of one record.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(20 << attempt)
}

/// Attempts per batch.
const ATTEMPTS: u32 = 3;

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

// What a batch writes, the same on every database: each backend runs these
// in one transaction, in this order.

/// 1. The journal rows: (index of the job, idempotency key, kind). A
///    record whose key the database (or an earlier record of the batch)
///    has already is a [`Written::Duplicate`] and applies nothing below.
fn journal_rows(jobs: &[WriteJob]) -> Vec<(usize, String, &'static str)> {
    jobs.iter()
        .enumerate()
        .filter_map(|(i, job)| job.record.journal().map(|(key, kind)| (i, key, kind)))
        .collect()
}

/// What a journal row holds beyond its key and kind.
struct JournalValues<'a> {
    id: String,
    request_id: Option<&'a str>,
    /// Signed effects on (usd, diem, usd_held, diem_held, owed).
    effects: [i64; 5],
    /// What a settlement or expiry was for: the usage history reads it.
    model_id: Option<&'a str>,
    /// Which API key made it (the usage analytics' breakdown by key).
    key_id: Option<&'a str>,
    tokens: (i64, i64),
}

fn journal_values(record: &Record) -> JournalValues<'_> {
    let request_id = match record.kind {
        RecordKind::Epoch => None,
        _ => Some(&*record.request_id),
    };
    let usage = matches!(record.kind, RecordKind::Settle | RecordKind::Expire);
    JournalValues {
        id: rialto_core::ids::row_id(),
        request_id,
        effects: record.effects(),
        model_id: usage.then_some(&*record.model_id),
        key_id: Some(&*record.spent_by).filter(|k| usage && !k.is_empty()),
        tokens: if usage { record.tokens } else { (0, 0) },
    }
}

/// Each (owner, fence) a batch writes for.
type OwnerSums = HashMap<(Arc<str>, i64), OwnerSum>;

/// 2. Each owner's applied effects on (usd, diem, usd_held, diem_held,
///    owed) and its latest DIEM epoch day. Every owner with a record is listed,
///    applied or not, so that its fence is checked.
#[derive(Debug, Default)]
struct OwnerSum {
    effects: [i64; 5],
    day: i64,
}

fn owner_sums(jobs: &[WriteJob], written: &[Written]) -> OwnerSums {
    let mut owners = OwnerSums::default();
    for (job, outcome) in jobs.iter().zip(written) {
        let record = &job.record;
        if record.kind == RecordKind::Refresh {
            continue;
        }
        let entry = owners
            .entry((record.owner.name.clone(), record.fence))
            .or_default();
        if *outcome == Written::Applied {
            for (sum, effect) in entry.effects.iter_mut().zip(record.effects()) {
                *sum += effect;
            }
            if record.kind == RecordKind::Epoch {
                entry.day = entry.day.max(record.day);
            }
        }
    }
    owners
}

/// 3. The capped keys' applied effects on their period's (usd, diem,
///    usd_held, diem_held), those that change anything.
fn key_sums(jobs: &[WriteJob], written: &[Written]) -> Vec<(KeyRef, [i64; 4])> {
    let mut keys: HashMap<KeyRef, [i64; 4]> = HashMap::default();
    for (job, outcome) in jobs.iter().zip(written) {
        if let Some(key) = job
            .record
            .key
            .as_ref()
            .filter(|_| *outcome == Written::Applied)
        {
            let sums = keys.entry(key.clone()).or_insert([0; 4]);
            for (sum, effect) in sums.iter_mut().zip(job.record.key_effects()) {
                *sum += effect;
            }
        }
    }
    keys.into_iter().filter(|(_, s)| *s != [0; 4]).collect()
}

/// 4. Durable holds: the applied opens, inserted as the batch leaves them,
///    and the updates of every other hold, in the batch's order.
#[derive(Default)]
struct HoldWrites<'a> {
    inserts: Vec<NewHold<'a>>,
    updates: Vec<HoldUpdate<'a>>,
}

/// A hold the batch opens. A stream that checkpoints or ends in the batch
/// that opened it (any stream shorter than a batch's gathering) is
/// inserted with its last checkpoint and its state: one row written once,
/// instead of an insert into the open holds' indexes and an update that
/// takes it out of them again in the same transaction.
struct NewHold<'a> {
    open: &'a Record,
    /// Its last checkpoint in the batch.
    checkpoint: Option<&'a Record>,
    state: HoldState,
}

impl NewHold<'_> {
    /// (checkpoint nano-units, prompt tokens, completion tokens, end of
    /// its lease).
    fn checkpointed(&self) -> (i64, i64, i64, i64) {
        match self.checkpoint {
            Some(at) => (at.checkpoint, at.tokens.0, at.tokens.1, at.expires_at_ms),
            None => (0, 0, 0, self.open.expires_at_ms),
        }
    }
}

/// A durable hold's `state` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HoldState {
    Open,
    Settled,
    Expired,
}

impl HoldState {
    fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Settled => "settled",
            Self::Expired => "expired",
        }
    }
}

/// An update of a hold the batch did not open: opened in an earlier batch
/// (or its open here a replay of one the database has). Every record of a
/// hold comes after its open, in the log's order and so in the batch's:
/// no update here is meant for a hold inserted after it.
enum HoldUpdate<'a> {
    Checkpoint(&'a Record),
    /// Closed: settled or expired.
    Close(&'a Record, HoldState),
}

fn hold_writes<'a>(jobs: &'a [WriteJob], written: &[Written]) -> HoldWrites<'a> {
    let mut writes = HoldWrites::default();
    // The batch's own holds, by request id.
    let mut new: HashMap<&str, usize> = HashMap::default();
    for (job, outcome) in jobs.iter().zip(written) {
        let record = &job.record;
        let applied = *outcome == Written::Applied;
        let closed = match record.kind {
            RecordKind::Open if applied => {
                new.insert(&record.request_id, writes.inserts.len());
                writes.inserts.push(NewHold {
                    open: record,
                    checkpoint: None,
                    state: HoldState::Open,
                });
                continue;
            }
            RecordKind::Checkpoint => None,
            RecordKind::Settle if record.durable && applied => Some(HoldState::Settled),
            RecordKind::Expire if record.durable && applied => Some(HoldState::Expired),
            _ => continue,
        };
        match new
            .get(&*record.request_id)
            .map(|&i| &mut writes.inserts[i])
        {
            // As the update's `WHERE state = 'open'`: a closed hold stays
            // as it closed.
            Some(hold) if hold.state != HoldState::Open => {}
            Some(hold) => match closed {
                None => hold.checkpoint = Some(record),
                Some(state) => hold.state = state,
            },
            None => writes.updates.push(match closed {
                None => HoldUpdate::Checkpoint(record),
                Some(state) => HoldUpdate::Close(record, state),
            }),
        }
    }
    writes
}

/// 5. The owners whose balances are read back as the batch leaves them.
fn refresh_owners(jobs: &[WriteJob]) -> Vec<&Arc<str>> {
    jobs.iter()
        .filter(|job| job.record.kind == RecordKind::Refresh)
        .map(|job| &job.record.owner.name)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use sqlx::Row;

    use super::*;
    use crate::book::{OpenHold, SettleOrder};

    /// When [`stream_hold`] was placed: long before any batch writes it.
    const OPENED_AT_MS: i64 = 500;

    /// A stream's durable hold of 40 nano-USD, before any checkpoint.
    pub(super) fn stream_hold() -> OpenHold {
        OpenHold {
            usd: 40,
            diem: 0,
            expires_at_ms: 1_000,
            opened_at_ms: OPENED_AT_MS,
            key: None,
            durable: true,
            checkpoint: 0,
            checkpoint_tokens: (0, 0),
            model_id: "m".into(),
        }
    }

    /// The settlement of `request_id` at a cost of 12 nano-USD.
    pub(super) fn settle_order(request_id: &str) -> SettleOrder<'_> {
        SettleOrder {
            spent_by: "",
            request_id,
            cost: 12,
            model_id: "m",
            prompt_tokens: 3,
            completion_tokens: 8,
            key: None,
            cap: None,
            rest: false,
        }
    }

    /// A stream's records: its hold opened, two checkpoints, and its end,
    /// settled or expired.
    fn stream(owner: &Arc<Owner>, request_id: &str, end: RecordKind) -> Vec<Record> {
        let mut hold = stream_hold();
        let open = Record::open(owner.clone(), 1, request_id, &hold);
        let mut checkpoint = |nanos, tokens, expires_at_ms| {
            hold.checkpoint = nanos;
            hold.checkpoint_tokens = tokens;
            hold.expires_at_ms = expires_at_ms;
            Record::checkpoint(owner.clone(), 1, request_id, &hold)
        };
        let first = checkpoint(7, (3, 4), 2_000);
        let second = checkpoint(9, (3, 6), 3_000);
        let order = settle_order(request_id);
        // An expiry charges the last checkpoint; a settlement the cost.
        let charged = if end == RecordKind::Expire { 9 } else { 12 };
        let close = Record::close(owner.clone(), 1, end, &order, [charged, 0, 0], Some(&hold));
        vec![open, first, second, close]
    }

    fn settled(owner: &Arc<Owner>, request_id: &str) -> Vec<Record> {
        stream(owner, request_id, RecordKind::Settle)
    }

    fn jobs(records: impl IntoIterator<Item = Record>) -> Vec<WriteJob> {
        records
            .into_iter()
            .map(|record| WriteJob { record, done: None })
            .collect()
    }

    fn owner() -> Arc<Owner> {
        Arc::new(Owner::detached("account:t"))
    }

    /// What each planned write says: (request, state or "checkpoint",
    /// checkpoint nano-units).
    fn plan(jobs: &[WriteJob], written: &[Written]) -> Vec<(String, &'static str, i64)> {
        let writes = hold_writes(jobs, written);
        let inserts = writes.inserts.iter().map(|hold| {
            let request = hold.open.request_id.to_string();
            (request, hold.state.as_str(), hold.checkpointed().0)
        });
        let updates = writes.updates.iter().map(|update| match update {
            HoldUpdate::Checkpoint(at) => (at.request_id.to_string(), "checkpoint", at.checkpoint),
            HoldUpdate::Close(at, state) => (at.request_id.to_string(), state.as_str(), 0),
        });
        inserts.chain(updates).collect()
    }

    #[test]
    fn a_stream_that_ends_in_the_batch_that_opened_it_is_inserted_closed() {
        let owner = owner();
        let mut records = settled(&owner, "a");
        // After its close, a checkpoint changes nothing (as `state = 'open'`
        // in the update).
        records.push(settled(&owner, "a").remove(1));
        records.extend(settled(&owner, "b").into_iter().take(2));
        records.extend(stream(&owner, "c", RecordKind::Expire));
        let jobs = jobs(records);
        let written = vec![Written::Applied; jobs.len()];
        assert_eq!(
            plan(&jobs, &written),
            [
                ("a".into(), "settled", 9),
                ("b".into(), "open", 7),
                ("c".into(), "expired", 9)
            ]
        );
        let writes = hold_writes(&jobs, &written);
        assert_eq!(writes.inserts[0].checkpointed(), (9, 3, 6, 3_000));
        let open = hold_writes(&jobs[..1], &written[..1]).inserts[0].checkpointed();
        assert_eq!(open, (0, 0, 0, 1_000));
    }

    #[test]
    fn holds_the_batch_did_not_open_are_updated() {
        let owner = owner();
        // Opened in an earlier batch.
        let earlier = jobs(settled(&owner, "a").into_iter().skip(1));
        let written = vec![Written::Applied; earlier.len()];
        assert_eq!(
            plan(&earlier, &written),
            [
                ("a".into(), "checkpoint", 7),
                ("a".into(), "checkpoint", 9),
                ("a".into(), "settled", 0)
            ]
        );
        // Its open a replay of one the database has: the row is not this
        // batch's.
        let replayed = jobs(settled(&owner, "a"));
        let mut written = vec![Written::Applied; replayed.len()];
        written[0] = Written::Duplicate;
        let planned = plan(&replayed, &written);
        assert_eq!(planned.len(), 3);
        assert_eq!(planned[0], ("a".into(), "checkpoint", 7));
        // A settlement the database had already closes nothing.
        written[3] = Written::Duplicate;
        assert_eq!(plan(&replayed, &written).len(), 2);
    }

    /// A hold's row, with its `created_at_ms` and its open's journal
    /// `at_ms` last.
    type HoldColumns = (
        String,
        i64,
        i64,
        String,
        i64,
        Option<String>,
        Option<String>,
        String,
        [i64; 3],
        [i64; 2],
    );

    async fn hold_row(db: &Database, request_id: &str) -> HoldColumns {
        let row = sqlx::query(
            "SELECT owner, usd_nanos, diem_nanos, state, expires_at_ms, key_id, key_period, \
             model_id, checkpoint_nanos, checkpoint_prompt_tokens, checkpoint_completion_tokens, \
             created_at_ms, (SELECT at_ms FROM ledger_journal \
             WHERE idempotency_key = 'hold:' || holds.request_id) \
             FROM holds WHERE request_id = $1",
        )
        .bind(request_id)
        .fetch_one(db.pool())
        .await
        .unwrap();
        (
            row.get(0),
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
            row.get(5),
            row.get(6),
            row.get(7),
            [row.get(8), row.get(9), row.get(10)],
            [row.get(11), row.get(12)],
        )
    }

    /// The row a stream of [`stream`] leaves in `state`: opened when its
    /// hold was placed, whichever batch wrote it.
    fn row(state: &str, lease: i64, checkpoint: [i64; 3]) -> HoldColumns {
        let owner = "account:t".to_string();
        (
            owner,
            40,
            0,
            state.into(),
            lease,
            None,
            None,
            "m".into(),
            checkpoint,
            [OPENED_AT_MS; 2],
        )
    }

    /// Writes streams with `write`, their records cut into batches in every
    /// way that matters, and checks each leaves the row and the balance that
    /// one statement a record leaves.
    async fn every_batching_leaves_the_same_rows<W, F>(db: &Database, mut write: W)
    where
        W: FnMut(Vec<WriteJob>) -> F,
        F: std::future::Future<Output = ()>,
    {
        sqlx::query(
            "INSERT INTO ledgers (owner, usd_nanos, updated_at_ms, fence) \
             VALUES ('account:t', 100000, 0, 1)",
        )
        .execute(db.pool())
        .await
        .unwrap();
        let owner = owner();
        let last_checkpoint = [9, 3, 6];
        let closed = row("settled", 3_000, last_checkpoint);
        let splits: [&[usize]; 4] = [&[4], &[1, 1, 1, 1], &[1, 3], &[3, 1]];
        for (i, split) in splits.iter().enumerate() {
            let request_id = format!("s{i}");
            let mut records = settled(&owner, &request_id).into_iter();
            for &batch in *split {
                write(jobs(records.by_ref().take(batch))).await;
                if batch == 3 && records.len() == 1 {
                    // Still open, as a loaded owner or the sweeper reads it.
                    let open = row("open", 3_000, last_checkpoint);
                    assert_eq!(hold_row(db, &request_id).await, open);
                }
            }
            assert_eq!(hold_row(db, &request_id).await, closed, "{split:?}");
        }
        write(jobs(stream(&owner, "e", RecordKind::Expire))).await;
        let expired = row("expired", 3_000, last_checkpoint);
        assert_eq!(hold_row(db, "e").await, expired);
        // Closed with no checkpoint: the open's lease, nothing checkpointed.
        let mut records = settled(&owner, "n");
        records.drain(1..3);
        write(jobs(records)).await;
        assert_eq!(hold_row(db, "n").await, row("settled", 1_000, [0; 3]));
        // More holds than one of PostgreSQL's multi-row statements carries.
        let count = 70;
        let records = (0..count).flat_map(|i| settled(&owner, &format!("m{i}")));
        write(jobs(records)).await;
        for i in 0..count {
            assert_eq!(hold_row(db, &format!("m{i}")).await, closed);
        }
        let balance = sqlx::query("SELECT usd_nanos, usd_held_nanos FROM ledgers")
            .fetch_one(db.pool())
            .await
            .unwrap();
        let charged = 12 * (splits.len() + 1 + count) as i64 + 9;
        assert_eq!((balance.get(0), balance.get(1)), (100_000 - charged, 0));
    }

    /// Panics with what failed unless the batch was written.
    fn written(result: BatchResult) {
        match result {
            Ok(_) => {}
            Err(BatchError::Database(error)) => panic!("{error:?}"),
            Err(BatchError::Fenced(owners)) => panic!("fenced: {owners:?}"),
        }
    }

    #[tokio::test]
    async fn every_batching_of_a_stream_leaves_the_same_row_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("writer.db");
        let db = Database::connect(&format!("sqlite://{}", file.display()), 2)
            .await
            .unwrap();
        let mut conn = sqlite::open(&file).unwrap();
        every_batching_leaves_the_same_rows(&db, |jobs| {
            written(sqlite::write_batch(&mut conn, &jobs));
            std::future::ready(())
        })
        .await;
    }

    #[tokio::test]
    async fn every_batching_of_a_stream_leaves_the_same_row_on_postgres() {
        let (db, scratch) = crate::book::tests::postgres().await;
        let pool = db.pool().clone();
        every_batching_leaves_the_same_rows(&db, |jobs| {
            let pool = pool.clone();
            async move {
                let mut conn = pool.acquire().await.unwrap();
                written(pooled::write_batch(&mut conn, &jobs).await);
            }
        })
        .await;
        drop(scratch);
    }
}
