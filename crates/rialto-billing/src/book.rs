//! The ledger decided in memory: one [`Owner`] per ledger owner (account
//! or wallet) in this process holds the authoritative balance, the open
//! holds, the capped keys' spend and the DIEM epoch, and decides holds,
//! settlements and checkpoints synchronously under its own mutex: no
//! database round trip, no await, no other owner's lock.
//!
//! What must survive a kill is handed to the [`writer`](crate::writer) as a
//! [`Record`] and made durable in batches; a caller that must not answer
//! before its record is durable (a settlement, a stream's opening hold)
//! waits for the batch carrying it, never for anyone else's statements;
//! on SQLite its record is durable once appended to the ledger's log
//! (`writer/log.rs`), and it waits for no batch at all.
//! A hold of a non-streamed request is not written at all: if the process
//! dies before its settlement, the answer it held for was never served.
//!
//! **Ownership.** An owner is loaded into memory by the writer, in order
//! with the writes queued before it, and the load bumps the owner's
//! `fence` in `ledgers`. Every batched write is conditional on the fence it
//! was decided under, so a replica that lost an owner to another (the
//! rendezvous placement moved it) cannot write for it any more: its
//! records fail, its in-memory owner is dropped, and the next request
//! loads the owner afresh.
//!
//! **Memory and the database.** The in-memory balance is the database's
//! balance plus the effects of the records queued and not yet committed
//! (`unflushed`). Credits, top-ups and stakes are written to the database
//! directly (by any process: the CLI, another replica's x402 top-up), and
//! an owner picks them up by a refresh that the writer reads inside a
//! batch, so the sum stays exact: `usd = database + unflushed`.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rialto_core::db::{Database, now_ms};
use rialto_core::hashing::{HashMap, RandomState};
use rialto_core::{Error, ErrorCode, Result};
use sqlx::Row;
use tokio::sync::oneshot;

use crate::ledger::{Balance, HoldOutcome, KeyCap, SettleOutcome, Snapshot};
use crate::writer::{self, Job, Loaded, Record, RecordKind, Written};

/// How often an owner in use reads back what changed in the database
/// without it (credits from elsewhere, stakes).
const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// An owner with nothing open is dropped from memory after this long idle.
pub(crate) const IDLE: Duration = Duration::from_secs(60);

/// A hold to place.
#[derive(Debug, Clone)]
pub struct HoldOrder<'a> {
    pub request_id: &'a str,
    /// Nano-units: the most the request can cost.
    pub amount: i64,
    pub expires_at_ms: i64,
    pub cap: Option<&'a KeyCap>,
    /// A stream's hold: durable before the caller answers.
    pub durable: bool,
    pub model_id: &'a str,
}

/// A settlement to make.
#[derive(Debug, Clone)]
pub struct SettleOrder<'a> {
    pub request_id: &'a str,
    /// Nano-units the usage costs.
    pub cost: i64,
    pub model_id: &'a str,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    /// The API key that made the request ("" for none): the usage
    /// analytics' breakdown by key reads it from the journal.
    pub spent_by: &'a str,
    /// The capped key and period the hold counted in.
    pub key: Option<(&'a str, &'a str)>,
    /// That key's caps (USD, DIEM; None: not capped in that currency): a
    /// charge beyond the hold stays within them.
    pub cap: Option<(Option<i64>, Option<i64>)>,
    /// The rest of a stream's cost, after its hold expired and was charged
    /// its checkpoint (`cost` is what the checkpoint did not cover):
    /// journaled under `settle-rest:<request>`, so it applies once.
    pub rest: bool,
}

/// An open hold in memory.
#[derive(Debug, Clone)]
pub(crate) struct OpenHold {
    pub usd: i64,
    pub diem: i64,
    pub expires_at_ms: i64,
    /// When a durable hold was placed (its row's `created_at_ms`, its
    /// journal row's `at_ms`, however late the writer writes them); 0 when
    /// not known here (not durable, or loaded from the database).
    pub opened_at_ms: i64,
    pub key: Option<KeyRef>,
    /// Written to `holds` (a stream's): its close is written too.
    pub durable: bool,
    /// What the stream used at its last checkpoint, nano-units and tokens.
    pub checkpoint: i64,
    pub checkpoint_tokens: (i64, i64),
    pub model_id: Arc<str>,
}

/// A capped key's period, as the owner's key map names it.
pub(crate) type KeyRef = Arc<(String, String)>;

/// What a capped key spent and holds in one period.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeySpend {
    pub usd: i64,
    pub diem: i64,
    pub usd_held: i64,
    pub diem_held: i64,
}

/// One owner's state. Changed only under its mutex, by synchronous code.
#[derive(Debug)]
pub(crate) struct State {
    /// False once dropped (fenced out, a write failed, idle): callers go
    /// to a fresh owner.
    pub live: bool,
    pub fence: i64,
    pub balance: Balance,
    pub diem_epoch: i64,
    pub stake: Option<i64>,
    pub holds: HashMap<Box<str>, OpenHold>,
    pub keys: HashMap<KeyRef, KeySpend>,
    /// Balance effects of records queued and not yet committed: (usd, diem).
    pub unflushed: (i64, i64),
    /// Records queued and not yet committed.
    pub pending: u32,
    refreshed_at: Instant,
    refreshing: bool,
    pub(crate) last_active: Instant,
}

/// A ledger owner in this process.
#[derive(Debug)]
pub(crate) struct Owner {
    pub name: Arc<str>,
    state: Mutex<Option<State>>,
    loading: tokio::sync::Mutex<()>,
    /// Set (under the state's lock) when the owner is dropped while it
    /// loads: the load's outcome is let go, not decided on, as it claimed
    /// the owner by a view that moved meanwhile. An entry without state is
    /// never taken out of the book's map (only flagged), so one owner never
    /// has two entries loading at once.
    dropped: AtomicBool,
    /// USD nanos settled for this owner since its entry was made (for
    /// `rialto_top_owner_spend_usd`; moved to `Shared::retired_spend`
    /// when the entry leaves memory).
    spent_nanos: AtomicI64,
}

impl Owner {
    /// An owner with no state in memory: the owner of a record read back
    /// from the ledger's log.
    pub(crate) fn detached(name: &str) -> Self {
        Self {
            name: name.into(),
            state: Mutex::new(None),
            loading: tokio::sync::Mutex::new(()),
            dropped: AtomicBool::new(false),
            spent_nanos: AtomicI64::new(0),
        }
    }

    /// Its balances, epoch and stake, unless it was dropped meanwhile.
    fn live_snapshot(&self) -> Option<Snapshot> {
        self.lock().as_ref().filter(|s| s.live).map(State::snapshot)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Option<State>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Every owner this process holds, and the writer that makes them durable.
#[derive(Clone)]
pub struct Book {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Book {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Book").finish_non_exhaustive()
    }
}

/// Most owners whose spend is kept after they left memory (for
/// `rialto_top_owner_spend_usd`).
const RETIRED_SPEND_CAP: usize = 4096;

/// One shard of the owners in memory.
type Shard = Mutex<HashMap<Arc<str>, Arc<Owner>>>;

pub(crate) struct Shared {
    pub(crate) shards: Box<[Shard]>,
    hasher: RandomState,
    pub(crate) writer: writer::Handle,
    pub(crate) db: Database,
    /// How long a stream's hold lives after its last checkpoint.
    lease_ms: i64,
    /// This replica among several (failover): which owners are its own.
    pub(crate) membership: std::sync::OnceLock<rialto_core::membership::Membership>,
    /// Spend of owners dropped from memory since the process started, for
    /// [`Book::export_top_spenders`] (taken only when an owner is dropped
    /// and at a scrape).
    retired_spend: Mutex<HashMap<Arc<str>, i64>>,
    /// A test's replica name and view, in place of a membership's.
    #[cfg(test)]
    pub(crate) test_claim: Mutex<Option<writer::Claim>>,
}

impl Book {
    /// Starts the writer (a task on the current Tokio runtime).
    pub fn start(db: Database, lease_ms: i64) -> Self {
        Self::start_with(db, lease_ms, true)
    }

    /// A book for a process that only runs an operator's command (the CLI):
    /// it leaves the ledger's log to `rialto serve`.
    pub fn start_unlogged(db: Database, lease_ms: i64) -> Self {
        Self::start_with(db, lease_ms, false)
    }

    fn start_with(db: Database, lease_ms: i64, logged: bool) -> Self {
        let shards = std::thread::available_parallelism().map_or(1, |n| n.get()) * 8;
        let writer = writer::start(db.clone(), logged);
        Self {
            shared: Arc::new(Shared {
                shards: (0..shards)
                    .map(|_| Mutex::new(HashMap::default()))
                    .collect(),
                hasher: RandomState::default(),
                writer,
                db,
                lease_ms,
                membership: std::sync::OnceLock::new(),
                retired_spend: Mutex::new(HashMap::default()),
                #[cfg(test)]
                test_claim: Mutex::new(None),
            }),
        }
    }

    fn shard(&self, owner: &str) -> MutexGuard<'_, HashMap<Arc<str>, Arc<Owner>>> {
        let index = self.shared.hasher.hash_one(owner) as usize % self.shared.shards.len();
        self.shared.shards[index]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The owner's entry, created (not loaded) when missing.
    fn entry(&self, owner: &str) -> Arc<Owner> {
        let mut shard = self.shard(owner);
        if let Some(found) = shard.get(owner) {
            return found.clone();
        }
        let name: Arc<str> = owner.into();
        let created = Arc::new(Owner {
            name: name.clone(),
            state: Mutex::new(None),
            loading: tokio::sync::Mutex::new(()),
            dropped: AtomicBool::new(false),
            spent_nanos: AtomicI64::new(0),
        });
        shard.insert(name, created.clone());
        created
    }

    /// The owner's entry if it is in memory and loaded.
    pub(crate) fn loaded(&self, owner: &str) -> Option<Arc<Owner>> {
        let found = self.shard(owner).get(owner).cloned()?;
        let live = found.lock().as_ref().is_some_and(|s| s.live);
        live.then_some(found)
    }

    /// Drops `owner` from memory if `entry` is still its entry.
    pub(crate) fn drop_owner(shared: &Shared, entry: &Arc<Owner>) {
        let index = shared.hasher.hash_one(&*entry.name) as usize % shared.shards.len();
        let mut shard = shared.shards[index]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if shard
            .get(&entry.name)
            .is_some_and(|e| Arc::ptr_eq(e, entry))
        {
            shard.remove(&entry.name);
        }
        drop(shard);
        let spent = entry.spent_nanos.swap(0, Ordering::Relaxed);
        if spent > 0 {
            let mut retired = shared
                .retired_spend
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            *retired.entry(entry.name.clone()).or_default() += spent;
            // Bounded: past the cap only the larger half stays (a top-N
            // needs the large ones; a small spender dropped here only
            // restarts from zero).
            if retired.len() > RETIRED_SPEND_CAP {
                let mut amounts: Vec<i64> = retired.values().copied().collect();
                let half = amounts.len() / 2;
                let (_, threshold, _) = amounts.select_nth_unstable_by(half, |a, b| b.cmp(a));
                let threshold = *threshold;
                retired.retain(|_, amount| *amount >= threshold);
            }
        }
    }

    /// Sets `rialto_top_owner_spend_usd{owner}` at every scrape: the `top`
    /// owners by USD settled here since the process started (what they
    /// settled while in memory, and before, while they were dropped).
    pub fn export_top_spenders(&self, top: usize) {
        if top == 0 {
            return;
        }
        let shared = Arc::downgrade(&self.shared);
        rialto_core::metrics::metrics().on_scrape(move |m| {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let mut spend: HashMap<Arc<str>, i64> = shared
                .retired_spend
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            for shard in shared.shards.iter() {
                let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
                for (name, entry) in shard.iter() {
                    let spent = entry.spent_nanos.load(Ordering::Relaxed);
                    if spent > 0 {
                        *spend.entry(name.clone()).or_default() += spent;
                    }
                }
            }
            let mut ranked: Vec<(Arc<str>, i64)> = spend.into_iter().collect();
            ranked.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            ranked.truncate(top);
            // Owners that left the top leave the scrape.
            m.top_owner_spend_usd.clear();
            for (owner, nanos) in ranked {
                m.top_owner_spend_usd
                    .get_or_create(&rialto_core::metrics::OwnerLabels {
                        owner: owner.to_string(),
                    })
                    .set(nanos as f64 / 1e9);
            }
        });
    }

    /// How this process claims `owner` when it loads it: as one billing
    /// replica of several (failover), by name and view; `None` for a
    /// single process, which claims whatever it loads.
    fn claim_for(&self, owner: &str) -> Option<writer::Claim> {
        if !self.is_replica() {
            return None;
        }
        #[cfg(test)]
        if let Some(claim) = self.shared.test_claim.lock().unwrap().clone() {
            return Some(claim);
        }
        let view = self.shared.membership.get()?;
        let me = view.me()?;
        let mut live = String::new();
        for other in (0..view.len()).filter(|&i| i != me && view.is_live(i)) {
            if !live.is_empty() {
                live.push(',');
            }
            live.push_str(view.name(other));
        }
        let owner = view.owner(owner);
        let elsewhere = (owner != me && view.is_ready(me) && view.is_ready(owner))
            .then(|| view.name(owner).into());
        Some(writer::Claim {
            me: view.name(me).into(),
            live,
            elsewhere,
        })
    }

    /// Whether this book is one billing replica of several: it claims the
    /// owners it loads, and lets them go.
    fn is_replica(&self) -> bool {
        #[cfg(test)]
        if self.shared.test_claim.lock().unwrap().is_some() {
            return true;
        }
        self.shared
            .membership
            .get()
            .is_some_and(|view| view.me().is_some())
    }

    /// Lets a dropped owner go (its state's `live` just turned false, under
    /// its lock): the holds it kept only in memory are written as open
    /// holds, as a stream's is, and once they are written the ledger is
    /// released, so the replica that takes it next reads them from the
    /// database and settles them. A single process has nobody to let go to.
    pub(crate) fn let_go(&self, entry: &Arc<Owner>, state: &mut State) {
        if !self.is_replica() {
            return;
        }
        let fence = state.fence;
        let mut handed = Vec::new();
        let kept: Vec<(Box<str>, OpenHold)> = state
            .holds
            .iter()
            .filter(|(_, hold)| !hold.durable)
            .map(|(id, hold)| (id.clone(), hold.clone()))
            .collect();
        for (request_id, hold) in kept {
            let record = Record::open(entry.clone(), fence, &request_id, &hold);
            match queue(&self.shared.writer, state, record, true) {
                Ok(Some(written)) => handed.push(written),
                // Not written (the writer stopped): the ledger stays held
                // here until this replica is asked for it again (its load
                // lets it go then) or is no longer heard; the holds not
                // written are charged late, as a dead replica's are.
                _ => return,
            }
        }
        let release = Job::Release {
            owner: entry.name.clone(),
            fence,
        };
        if handed.is_empty() {
            let _ = self.shared.writer.send(release);
            return;
        }
        let writer = self.shared.writer.clone();
        tokio::spawn(async move {
            for written in handed {
                if !matches!(written.await, Ok(Ok(_))) {
                    return;
                }
            }
            let _ = writer.send(release);
        });
    }

    /// Drops from memory every owner `dropped` names (`live` turns false
    /// under its lock, so nothing decides on it after) and lets each go
    /// ([`let_go`](Self::let_go)); their next request loads them afresh,
    /// bumping the fence. Returns how many.
    pub(crate) fn drop_owners(&self, dropped: impl Fn(&str) -> bool) -> usize {
        let mut count = 0;
        for shard in self.shared.shards.iter() {
            let entries: Vec<Arc<Owner>> = {
                let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
                shard
                    .iter()
                    .filter(|(name, _)| dropped(name))
                    .map(|(_, entry)| entry.clone())
                    .collect()
            };
            for entry in entries {
                let mut guard = entry.lock();
                let Some(state) = guard.as_mut() else {
                    // Loading (or never loaded): it stays the owner's one
                    // entry, so that no second one loads beside it, and its
                    // load is let go once done (`with_owner`).
                    entry.dropped.store(true, Ordering::Relaxed);
                    continue;
                };
                if state.live {
                    state.live = false;
                    self.let_go(&entry, state);
                }
                drop(guard);
                Self::drop_owner(&self.shared, &entry);
                count += 1;
            }
        }
        count
    }

    /// Makes this book one replica of several: it decides only while it
    /// hears itself (see [`with_owner`](Self::with_owner)), drops every
    /// owner when it was away, drops the owners a replica back from the
    /// dead takes again, and recovers only its own owners' holds.
    pub fn join(&self, membership: rialto_core::membership::Membership) {
        let book = self.clone();
        membership.on_return(move || {
            let dropped = book.drop_owners(|_| true);
            tracing::warn!(
                dropped,
                "this billing replica was away: its ledgers are read again"
            );
        });
        let book = self.clone();
        let view = membership.clone();
        let mut changes = membership.changes();
        tokio::spawn(async move {
            let mut before = view.owners();
            while changes.changed().await.is_ok() {
                let now = view.owners();
                // Only a replica that counts itself ready lets owners go: a
                // starting one owns nothing yet in its own view, and would
                // drop what gateways already send it.
                let Some(me) = view.me().filter(|me| view.is_ready(*me)) else {
                    before = now;
                    continue;
                };
                // Not its own any more, or not its own before this change
                // (in memory from a request that reached it meanwhile: the
                // owner may have decided since, so it is read afresh).
                let dropped = book.drop_owners(|owner| {
                    view.owner_among(owner, now) != me || view.owner_among(owner, before) != me
                });
                before = now;
                if dropped > 0 {
                    tracing::info!(dropped, "ledgers moved between billing replicas");
                }
            }
        });
        let _ = self.shared.membership.set(membership);
    }

    /// Runs `decide` on the owner's loaded state, loading it first when
    /// needed (through the writer, so after every write queued before).
    pub(crate) async fn with_owner<T>(
        &self,
        owner: &str,
        mut decide: impl FnMut(&Arc<Owner>, &mut State) -> Result<T>,
    ) -> Result<T> {
        if self.shared.membership.get().is_some_and(|m| m.away()) {
            // Stopped or cut off long enough for the others to count this
            // replica dead: what it holds may have moved. It decides again
            // once it hears itself, with everything dropped (`on_return`).
            return Err(Error::new(
                ErrorCode::Unavailable,
                "This billing replica was unreachable and is taking its ledgers back; retry",
            ));
        }
        for _ in 0..3 {
            let entry = self.entry(owner);
            if entry.lock().is_none() {
                let _loading = entry.loading.lock().await;
                if entry.lock().is_none() {
                    // A drop before this load is sent needs nothing: the
                    // load claims by the view as it is now.
                    entry.dropped.store(false, Ordering::Relaxed);
                    let loaded = self.load(&entry).await?;
                    let mut guard = entry.lock();
                    let state = guard.insert(loaded);
                    if entry.dropped.load(Ordering::Relaxed) {
                        // Dropped while it loaded: the owner may have
                        // moved meanwhile, so this load is let go and the
                        // next one asks again.
                        state.live = false;
                        self.let_go(&entry, state);
                    }
                }
            }
            let mut guard = entry.lock();
            let Some(state) = guard.as_mut().filter(|s| s.live) else {
                // Dropped meanwhile: a fresh entry.
                drop(guard);
                Self::drop_owner(&self.shared, &entry);
                continue;
            };
            state.last_active = Instant::now();
            self.maybe_refresh(&entry, state);
            return decide(&entry, state);
        }
        Err(writer::moving())
    }

    async fn load(&self, entry: &Arc<Owner>) -> Result<State> {
        let (done, loaded) = oneshot::channel();
        self.shared.writer.send(Job::Load {
            owner: entry.name.clone(),
            claim: self.claim_for(&entry.name),
            done,
        })?;
        let Loaded {
            fence,
            balance,
            diem_epoch,
            stake,
            holds,
        } = loaded.await.map_err(|_| writer::stopped())??;
        let mut state = State {
            live: true,
            fence,
            balance,
            diem_epoch,
            stake,
            holds: HashMap::default(),
            keys: HashMap::default(),
            unflushed: (0, 0),
            pending: 0,
            refreshed_at: Instant::now(),
            refreshing: false,
            last_active: Instant::now(),
        };
        for (request_id, hold, key) in holds {
            let key = match key {
                Some(key) => Some(self.key_ref(&mut state, key).await?),
                None => None,
            };
            state
                .holds
                .insert(request_id.into(), OpenHold { key, ..hold });
        }
        Ok(state)
    }

    /// The owner's entry for a capped key's period, read from the database
    /// the first time (before any of its records exist in this process).
    async fn key_ref(&self, state: &mut State, key: (String, String)) -> Result<KeyRef> {
        if let Some((found, _)) = state.keys.get_key_value(&key) {
            return Ok(found.clone());
        }
        let spend = read_key_spend(&self.shared.db, &key.0, &key.1).await?;
        let key = Arc::new(key);
        state.keys.insert(key.clone(), spend);
        Ok(key)
    }

    /// Makes sure the owner's entry knows the key's spend, reading it once.
    async fn ensure_key(&self, owner: &str, key: Option<(&str, &str)>) -> Result<()> {
        let Some((key_id, period)) = key else {
            return Ok(());
        };
        let wanted = (key_id.to_owned(), period.to_owned());
        let known = self
            .with_owner(owner, |_, state| Ok(state.keys.contains_key(&wanted)))
            .await?;
        if known {
            return Ok(());
        }
        let spend = read_key_spend(&self.shared.db, key_id, period).await?;
        self.with_owner(owner, |_, state| {
            state.keys.entry(Arc::new(wanted.clone())).or_insert(spend);
            Ok(())
        })
        .await
    }

    /// Queues a refresh of the owner's balance when it is due.
    fn maybe_refresh(&self, entry: &Arc<Owner>, state: &mut State) {
        if state.refreshing || state.refreshed_at.elapsed() < REFRESH_EVERY {
            return;
        }
        state.refreshing = true;
        state.pending += 1;
        let job = Job::Write {
            record: Record::refresh(entry.clone(), state.fence),
            done: None,
        };
        if self.shared.writer.send(job).is_err() {
            state.refreshing = false;
            state.pending -= 1;
        }
    }

    /// Asks for a refresh now (a credit or stake was written), if the owner
    /// is in memory, and waits for it.
    pub async fn refresh_now(&self, owner: &str) -> Result<()> {
        let Some(entry) = self.loaded(owner) else {
            return Ok(());
        };
        let (done, written) = oneshot::channel();
        {
            let mut guard = entry.lock();
            let Some(state) = guard.as_mut().filter(|s| s.live) else {
                return Ok(());
            };
            state.refreshing = true;
            state.pending += 1;
            self.shared.writer.send(Job::Write {
                record: Record::refresh(entry.clone(), state.fence),
                done: Some(done),
            })?;
        }
        written.await.map_err(|_| writer::stopped())?.map(|_| ())
    }

    /// The owner's snapshot from memory, when it is loaded here.
    pub fn snapshot(&self, owner: &str) -> Option<Snapshot> {
        self.loaded(owner)?.live_snapshot()
    }

    /// The owner's snapshot from memory for a read a client relies on (its
    /// balance after an answer), when it is loaded here and still this
    /// process's to decide. Where other processes may decide for the ledger
    /// too (billing replicas on PostgreSQL: this process keeps no log of
    /// its own), another replica may have loaded the owner since, when the
    /// views of who owns it differed for a moment, and decided what this
    /// memory misses: the owner's fence is read first, and an owner loaded
    /// elsewhere is dropped here (its writes would be fenced out anyway),
    /// so that the caller reads the database, where everything another
    /// replica answered for is committed. One small query, on reads only;
    /// a database that cannot answer it fails the read. (A second process
    /// on one SQLite file is checked too, though what only its log holds
    /// is not in the database yet.) A hold's `before` balance is still
    /// decided from memory: a replica that lost the owner finds out at its
    /// next write.
    pub async fn current_snapshot(&self, owner: &str) -> Result<Option<Snapshot>> {
        let Some(entry) = self.loaded(owner) else {
            return Ok(None);
        };
        if self.shared.writer.logs() {
            // The only process deciding for this ledger (the log's lock).
            return Ok(entry.live_snapshot());
        }
        let fence: Option<i64> = sqlx::query_scalar("SELECT fence FROM ledgers WHERE owner = $1")
            .bind(owner)
            .fetch_optional(self.shared.db.pool())
            .await?;
        let mut guard = entry.lock();
        let Some(state) = guard.as_mut().filter(|s| s.live) else {
            return Ok(None);
        };
        if fence == Some(state.fence) {
            return Ok(Some(state.snapshot()));
        }
        tracing::info!(
            owner,
            "a ledger loaded by another billing replica is read again"
        );
        state.live = false;
        drop(guard);
        Self::drop_owner(&self.shared, &entry);
        Ok(None)
    }

    /// Places a hold, deciding from memory; a durable one is written before
    /// this returns.
    pub async fn hold(&self, owner: &str, order: &HoldOrder<'_>) -> Result<HoldOutcome> {
        let key = order.cap.map(|c| (c.key_id.as_str(), c.period.as_str()));
        self.ensure_key(owner, key).await?;
        let outcome = self.try_hold(owner, order).await?;
        if !matches!(
            outcome,
            HoldOutcome::Insufficient { .. } | HoldOutcome::KeyLimitReached { .. }
        ) {
            return Ok(outcome);
        }
        // A refusal is decided on what the database has now: a credit
        // written elsewhere a moment ago (the CLI, a top-up on another
        // replica) counts.
        self.refresh_now(owner).await?;
        self.try_hold(owner, order).await
    }

    async fn try_hold(&self, owner: &str, order: &HoldOrder<'_>) -> Result<HoldOutcome> {
        let lease_ms = self.shared.lease_ms;
        let (outcome, wait) = self
            .with_owner(owner, |entry, state| {
                start_epoch(entry, state, &self.shared.writer, today());
                let decided = decide_hold(state, order, lease_ms);
                let HoldDecision::Placed { usd, diem, before } = decided else {
                    return Ok((decided.outcome(), None));
                };
                if !order.durable || usd + diem == 0 {
                    return Ok((HoldOutcome::Placed { usd, diem, before }, None));
                }
                let hold = state
                    .holds
                    .get(order.request_id)
                    .cloned()
                    .ok_or_else(|| Error::internal("a placed hold is missing"))?;
                let record = Record::open(entry.clone(), state.fence, order.request_id, &hold);
                let done = queue(&self.shared.writer, state, record, true)?;
                Ok((HoldOutcome::Placed { usd, diem, before }, done))
            })
            .await?;
        match wait {
            None => Ok(outcome),
            Some(written) => match written.await.map_err(|_| writer::stopped())?? {
                Written::Applied => Ok(outcome),
                Written::Duplicate => Ok(HoldOutcome::Duplicate),
            },
        }
    }

    /// Settles `request_id`: charges its cost against its hold, then what
    /// the hold did not cover and what the owner owes from the rest of the
    /// balance within the key's cap, owing what neither covers
    /// ([`decide_settle`]); durably before this returns. A hold this
    /// process does not know (it restarted, or the hold expired) is settled
    /// the same way with nothing held. Once: a repeat is `NotOpen`.
    pub async fn settle(&self, owner: &str, order: &SettleOrder<'_>) -> Result<SettleOutcome> {
        self.ensure_key(owner, order.key).await?;
        let wait = self
            .with_owner(owner, |entry, state| {
                let (record, outcome) = decide_settle(entry, state, order);
                match record {
                    Some(record) => {
                        let written = queue(&self.shared.writer, state, record, true)?;
                        entry
                            .spent_nanos
                            .fetch_add(order.cost.max(0), Ordering::Relaxed);
                        Ok((outcome, written))
                    }
                    None => Ok((outcome, None)),
                }
            })
            .await?;
        match wait {
            (outcome, None) => Ok(outcome),
            (outcome, Some(written)) => match written.await.map_err(|_| writer::stopped())?? {
                Written::Applied => Ok(outcome),
                // Settled before (another process, or a retry).
                Written::Duplicate => Ok(SettleOutcome::NotOpen),
            },
        }
    }

    /// Records what a stream used so far and extends its hold's lease.
    /// Returns false when the hold is not open and durable here.
    pub async fn checkpoint(
        &self,
        owner: &str,
        request_id: &str,
        cost: i64,
        tokens: (i64, i64),
    ) -> Result<bool> {
        let lease_ms = self.shared.lease_ms;
        self.with_owner(owner, |entry, state| {
            let fence = state.fence;
            let Some(hold) = state.holds.get_mut(request_id).filter(|h| h.durable) else {
                return Ok(false);
            };
            hold.checkpoint = cost.clamp(0, hold.usd + hold.diem).max(hold.checkpoint);
            hold.checkpoint_tokens = tokens;
            hold.expires_at_ms = now_ms().saturating_add(lease_ms);
            let record = Record::checkpoint(entry.clone(), fence, request_id, hold);
            queue(&self.shared.writer, state, record, false)?;
            Ok(true)
        })
        .await
    }

    /// Waits until every record queued so far is committed, with every
    /// stream's open the writer holds back.
    pub async fn flush(&self) -> Result<()> {
        self.flush_for(None).await
    }

    /// Waits until every record queued so far is committed, with the
    /// opens held back for `owner` (every owner's: `None`).
    async fn flush_for(&self, owner: Option<Arc<str>>) -> Result<()> {
        let (done, flushed) = oneshot::channel();
        self.shared.writer.send(Job::Flush { owner, done })?;
        flushed.await.map_err(|_| writer::stopped())
    }

    /// `caught_up_for(Some(owner))`, for a reader of one owner's rows (its
    /// balance, transactions, usage): the streams' opens the writer
    /// holds back for other owners stay held, so a reader polling one
    /// account does not have every stream's hold written twice.
    pub async fn caught_up_with(&self, owner: &str) -> Result<()> {
        self.caught_up_for(Some(owner)).await
    }

    /// Waits until the database has every record decided so far, if any
    /// may be durable only in the ledger's log, with the opens held back
    /// for `owner`, or for every owner (`None`: a reader of every owner's
    /// rows, the operator's usage across owners).
    pub(crate) async fn caught_up_for(&self, owner: Option<&str>) -> Result<()> {
        if self.shared.writer.logs() {
            self.flush_for(owner.map(Arc::from)).await?;
        }
        Ok(())
    }

    /// The writer's batch sizes so far: (batches, records).
    pub fn batches(&self) -> (u64, u64) {
        self.shared.writer.batches()
    }
}

/// Today's UTC day number.
fn today() -> i64 {
    now_ms().div_euclid(86_400_000)
}

/// Queues `record` for the writer, counting it as unflushed; returns the
/// receiver of its outcome when `wait`.
pub(crate) fn queue(
    writer: &writer::Handle,
    state: &mut State,
    record: Record,
    wait: bool,
) -> Result<Option<oneshot::Receiver<Result<Written>>>> {
    let (done, written) = if wait {
        let (done, written) = oneshot::channel();
        (Some(done), Some(written))
    } else {
        (None, None)
    };
    let (usd, diem) = record.balance_delta();
    if let Err(error) = writer.write(record, done) {
        // Memory decided what is not written: it is read again.
        state.live = false;
        return Err(error);
    }
    state.pending += 1;
    state.unflushed.0 += usd;
    state.unflushed.1 += diem;
    Ok(written)
}

/// Starts `day`'s DIEM epoch if the owner stakes and it is due: the DIEM
/// balance becomes the day's allocation plus what open holds reserve of it
/// (nothing rolls over).
fn start_epoch(entry: &Arc<Owner>, state: &mut State, writer: &writer::Handle, day: i64) {
    let Some(per_day) = state.stake else {
        return;
    };
    if state.diem_epoch >= day {
        return;
    }
    let new = per_day.saturating_add(state.balance.diem_held);
    let delta = new - state.balance.diem;
    state.balance.diem = new;
    state.diem_epoch = day;
    let record = Record::epoch(entry.clone(), state.fence, day, delta);
    if let Err(error) = queue(writer, state, record, false) {
        tracing::warn!(%error, "cannot queue a DIEM epoch");
    }
}

enum HoldDecision {
    Placed {
        usd: i64,
        diem: i64,
        before: Balance,
    },
    Refused(HoldOutcome),
}

impl HoldDecision {
    fn outcome(self) -> HoldOutcome {
        match self {
            Self::Placed { usd, diem, before } => HoldOutcome::Placed { usd, diem, before },
            Self::Refused(outcome) => outcome,
        }
    }
}

/// Decides a hold: DIEM first up to what is available and what the key's
/// cap allows, the rest in USD; refuses what the balance or the cap cannot
/// cover. A placed hold is in `state.holds` when this returns.
fn decide_hold(state: &mut State, order: &HoldOrder<'_>, lease_ms: i64) -> HoldDecision {
    let before = state.balance;
    let amount = order.amount.max(0);
    if amount == 0 {
        // A free request reserves nothing, and settles to nothing.
        return HoldDecision::Placed {
            usd: 0,
            diem: 0,
            before,
        };
    }
    if state.holds.contains_key(order.request_id) {
        return HoldDecision::Refused(HoldOutcome::Duplicate);
    }
    let key = order.cap.and_then(|cap| {
        let wanted = (cap.key_id.clone(), cap.period.clone());
        state
            .keys
            .get_key_value(&wanted)
            .map(|(k, spend)| (k.clone(), *spend, cap))
    });
    let room = |cap: Option<i64>, used: i64| cap.map_or(i64::MAX, |c| c - used);
    let (usd_room, diem_room) = match &key {
        Some((_, spend, cap)) => (
            room(cap.usd, spend.usd + spend.usd_held),
            room(cap.diem, spend.diem + spend.diem_held),
        ),
        None => (i64::MAX, i64::MAX),
    };
    let diem_usable = before.diem_available().max(0);
    let diem = amount.min(diem_usable).min(diem_room.max(0));
    let usd = amount - diem;
    if usd > before.usd_available() {
        // DIEM the key may not spend would have paid: the cap refused.
        return HoldDecision::Refused(if amount.min(diem_usable) > diem {
            HoldOutcome::KeyLimitReached {
                before,
                currency: "DIEM",
            }
        } else {
            HoldOutcome::Insufficient { before }
        });
    }
    if usd > usd_room {
        return HoldDecision::Refused(HoldOutcome::KeyLimitReached {
            before,
            currency: "USD",
        });
    }
    // What the owner owes is paid by this request's settlement: the balance
    // beyond this hold must cover it.
    let spare = (diem_usable - diem).saturating_add(before.usd_available() - usd);
    if before.owed > spare {
        return HoldDecision::Refused(HoldOutcome::Insufficient { before });
    }
    state.balance.usd_held += usd;
    state.balance.diem_held += diem;
    if let Some((key, _, _)) = &key
        && let Some(spend) = state.keys.get_mut(key)
    {
        spend.usd_held += usd;
        spend.diem_held += diem;
    }
    let (opened_at_ms, expires_at_ms) = if order.durable {
        // A stream's hold lives on its lease, renewed by its checkpoints.
        let now = now_ms();
        (now, now.saturating_add(lease_ms).min(order.expires_at_ms))
    } else {
        (0, order.expires_at_ms)
    };
    state.holds.insert(
        order.request_id.into(),
        OpenHold {
            usd,
            diem,
            expires_at_ms,
            opened_at_ms,
            key: key.map(|(k, _, _)| k),
            durable: order.durable,
            checkpoint: 0,
            checkpoint_tokens: (0, 0),
            model_id: order.model_id.into(),
        },
    );
    HoldDecision::Placed { usd, diem, before }
}

/// Decides a settlement in memory; the record to write, if any.
///
/// The request's cost is charged from its hold first (DIEM first), the hold
/// is released, and what the hold did not cover, with what the owner owed
/// before, is charged from the balance beyond every other hold (DIEM first),
/// within the key's cap. What that cannot cover is owed: never written off.
/// A settlement of a hold this process does not hold open (it restarted,
/// the hold expired, or this is a repeat) is the same with nothing held; a
/// repeat is undone when the journal finds its key taken.
pub(crate) fn decide_settle(
    entry: &Arc<Owner>,
    state: &mut State,
    order: &SettleOrder<'_>,
) -> (Option<Record>, SettleOutcome) {
    let cost = order.cost.max(0);
    let hold = state.holds.remove(order.request_id);
    let key = match &hold {
        Some(hold) => hold.key.clone(),
        None => order.key.and_then(|(key_id, period)| {
            let wanted = (key_id.to_owned(), period.to_owned());
            state.keys.get_key_value(&wanted).map(|(k, _)| k.clone())
        }),
    };
    let owed_before = state.balance.owed;
    // 1. From the hold, which is released.
    let (mut diem, mut usd) = (0, 0);
    if let Some(hold) = &hold {
        diem = cost.min(hold.diem);
        usd = (cost - diem).min(hold.usd);
        state.balance.usd_held -= hold.usd;
        state.balance.diem_held -= hold.diem;
        if let Some(spend) = key.as_ref().and_then(|k| state.keys.get_mut(k)) {
            spend.usd_held -= hold.usd;
            spend.diem_held -= hold.diem;
        }
    }
    // 2. The rest, and the debt, from what no hold reserves.
    let due = (cost - diem - usd).saturating_add(owed_before);
    if due > 0 {
        let spend = key.as_ref().and_then(|k| state.keys.get(k)).copied();
        let room = |cap: Option<i64>, spent: i64, held: i64| {
            cap.map_or(i64::MAX, |cap| (cap - spent - held).max(0))
        };
        let (usd_cap, diem_cap) = order.cap.unwrap_or((None, None));
        let (usd_room, diem_room) = match spend {
            Some(s) => (
                room(usd_cap, s.usd + usd, s.usd_held),
                room(diem_cap, s.diem + diem, s.diem_held),
            ),
            None => (i64::MAX, i64::MAX),
        };
        let more_diem = due
            .min((state.balance.diem_available() - diem).max(0))
            .min(diem_room);
        let more_usd = (due - more_diem)
            .min((state.balance.usd_available() - usd).max(0))
            .min(usd_room);
        diem += more_diem;
        usd += more_usd;
        state.balance.owed = due - more_diem - more_usd;
    }
    let owed_change = state.balance.owed - owed_before;
    if hold.is_none() && usd == 0 && diem == 0 && owed_change == 0 {
        // Nothing to take (a free request, or settled before): the caller
        // reads what the journal has.
        return (None, SettleOutcome::NotOpen);
    }
    state.balance.usd -= usd;
    state.balance.diem -= diem;
    if let Some(spend) = key.as_ref().and_then(|k| state.keys.get_mut(k)) {
        spend.usd += usd;
        spend.diem += diem;
    }
    let outcome = SettleOutcome::Settled {
        usd,
        diem,
        owed: state.balance.owed,
    };
    let durable = hold.as_ref().is_some_and(|h| h.durable);
    if !durable && usd == 0 && diem == 0 && owed_change == 0 {
        // Nothing was ever written and nothing is charged.
        return (None, outcome);
    }
    let closed = hold.unwrap_or_else(|| OpenHold {
        usd: 0,
        diem: 0,
        expires_at_ms: 0,
        opened_at_ms: 0,
        key,
        durable: false,
        checkpoint: 0,
        checkpoint_tokens: (0, 0),
        model_id: order.model_id.into(),
    });
    let record = Record::close(
        entry.clone(),
        state.fence,
        RecordKind::Settle,
        order,
        [usd, diem, owed_change],
        Some(&closed),
    );
    (Some(record), outcome)
}

/// What a capped key spent and holds in `period`, from the database.
async fn read_key_spend(db: &Database, key_id: &str, period: &str) -> Result<KeySpend> {
    let row = sqlx::query(
        "SELECT usd_nanos, diem_nanos, usd_held_nanos, diem_held_nanos FROM key_spend \
         WHERE key_id = $1 AND period = $2",
    )
    .bind(key_id)
    .bind(period)
    .fetch_optional(db.pool())
    .await?;
    Ok(match row {
        Some(row) => KeySpend {
            usd: row.try_get(0)?,
            diem: row.try_get(1)?,
            usd_held: row.try_get(2)?,
            diem_held: row.try_get(3)?,
        },
        None => KeySpend::default(),
    })
}

impl State {
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            balance: self.balance,
            diem_epoch: self.diem_epoch,
            stake: self.stake,
        }
    }
}

/// The writer's side of an owner: called with the batch committed.
impl State {
    /// A refresh read the database's balance inside a batch: the memory is
    /// that plus what is still queued.
    pub(crate) fn refreshed(&mut self, usd: i64, diem: i64, stake: Option<i64>) {
        self.balance.usd = usd + self.unflushed.0;
        self.balance.diem = diem + self.unflushed.1;
        self.stake = stake;
        self.refreshing = false;
        self.refreshed_at = Instant::now();
    }

    pub(crate) fn key_mut(&mut self, key: &KeyRef) -> Option<&mut KeySpend> {
        self.keys.get_mut(key)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ledger::Ledger;

    const NANO: i64 = 1_000_000_000;

    async fn sqlite() -> (tempfile::TempDir, Database) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/book.db", dir.path().display());
        (dir, Database::connect(&url, 8).await.unwrap())
    }

    /// A SQLite ledger where `owner` was credited `usd` and `diem`, and a
    /// book over it whose streams' leases last `lease_ms`.
    async fn funded(
        owner: &str,
        usd: i64,
        diem: i64,
        lease_ms: i64,
    ) -> (tempfile::TempDir, Database, Ledger, Book) {
        let (dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        ledger.credit(owner, usd, diem, "seed").await.unwrap();
        let book = Book::start(db.clone(), lease_ms);
        (dir, db, ledger, book)
    }

    /// A fresh PostgreSQL database on the shared server, and the guard that
    /// drops it: at the test's end, or as the test panics (a failed test
    /// leaves the server clean too).
    pub(crate) async fn postgres() -> (Database, ScratchDatabase) {
        let server = std::env::var("E2E_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let name = format!("rialto_book_{}", rialto_core::ids::row_id());
        postgres_admin(&server, &format!("CREATE DATABASE {name}")).await;
        let db = Database::connect(&format!("{server}/{name}"), 8)
            .await
            .unwrap();
        (db, ScratchDatabase { server, name })
    }

    async fn postgres_admin(server: &str, sql: &str) {
        use sqlx::Connection;
        let mut conn = sqlx::postgres::PgConnection::connect(&format!("{server}/postgres"))
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut conn)
            .await
            .unwrap();
        conn.close().await.unwrap();
    }

    /// A test's own PostgreSQL database ([`postgres`]), dropped with this
    /// guard (its pool's connections too: `WITH (FORCE)`).
    pub(crate) struct ScratchDatabase {
        server: String,
        name: String,
    }

    impl Drop for ScratchDatabase {
        fn drop(&mut self) {
            // Drop may run inside the test's runtime: a thread with its own.
            // (rialto-test-kit's sandbox does the same; it depends on this
            // crate, so its helper cannot be called from here.)
            let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
            let server = std::mem::take(&mut self.server);
            let _ = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(runtime) = runtime {
                    runtime.block_on(postgres_admin(&server, &sql));
                }
            })
            .join();
        }
    }

    fn hold(request_id: &str, amount: i64, durable: bool) -> HoldOrder<'_> {
        HoldOrder {
            request_id,
            amount,
            expires_at_ms: now_ms() + 60_000,
            cap: None,
            durable,
            model_id: "m",
        }
    }

    fn settle(request_id: &str, cost: i64) -> SettleOrder<'_> {
        SettleOrder {
            spent_by: "",
            request_id,
            cost,
            model_id: "m",
            prompt_tokens: 10,
            completion_tokens: 20,
            key: None,
            cap: None,
            rest: false,
        }
    }

    /// What a settlement reports: charged (USD, DIEM) and owed after it.
    fn charged(usd: i64, diem: i64, owed: i64) -> SettleOutcome {
        SettleOutcome::Settled { usd, diem, owed }
    }

    /// The database agrees with itself and with memory: balance = journal.
    async fn reconcile(book: &Book, ledger: &Ledger, owner: &str) -> Balance {
        book.flush().await.unwrap();
        let stored = ledger.balance(owner).await.unwrap();
        assert_eq!(stored, ledger.journal_sums(owner).await.unwrap());
        stored
    }

    /// 1,000 holds at once from two threads against a balance for 10: ten
    /// placed; each settled twice at once, charged once.
    async fn ten_of_a_thousand(db: Database) {
        let ledger = Ledger::new(db.clone());
        let book = Book::start(db, 30_000);
        ledger
            .credit("account:a", 10 * NANO, 0, "seed")
            .await
            .unwrap();
        let tasks: Vec<_> = (0..1000)
            .map(|i| {
                let book = book.clone();
                tokio::spawn(async move {
                    let id = format!("r{i}");
                    let placed = book.hold("account:a", &hold(&id, NANO, i % 2 == 0)).await;
                    (id, placed.unwrap())
                })
            })
            .collect();
        let mut placed = Vec::new();
        for task in tasks {
            let (id, outcome) = task.await.unwrap();
            if matches!(outcome, HoldOutcome::Placed { .. }) {
                placed.push(id);
            }
        }
        assert_eq!(placed.len(), 10);
        let settles: Vec<_> = placed
            .iter()
            .flat_map(|id| [id.clone(), id.clone()])
            .map(|id| {
                let book = book.clone();
                tokio::spawn(async move { book.settle("account:a", &settle(&id, NANO / 2)).await })
            })
            .collect();
        let mut charged = 0;
        for task in settles {
            if let SettleOutcome::Settled { usd, .. } = task.await.unwrap().unwrap() {
                charged += usd;
            }
        }
        assert_eq!(charged, 5 * NANO, "each hold charged exactly once");
        let stored = reconcile(&book, &ledger, "account:a").await;
        assert_eq!((stored.usd, stored.usd_held), (5 * NANO, 0));
        assert_eq!(book.snapshot("account:a").unwrap().balance, stored);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_of_a_thousand_on_sqlite() {
        let (_dir, db) = sqlite().await;
        assert!(db.sqlite_file().is_some(), "the writer's own connection");
        ten_of_a_thousand(db).await;
    }

    /// The writer stalled (another connection holds SQLite's write lock):
    /// 32 tasks settle until the log is [`BACKLOG`](crate::writer::log::BACKLOG)
    /// records ahead of it, then wait for their batches, each with one
    /// record past the line at most; once the lock is let go every
    /// settlement is charged once, and memory, balance and journal agree.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_backlog_callers_wait_and_every_settlement_counts_once() {
        use crate::writer::log::BACKLOG;
        use std::sync::atomic::AtomicU64;
        const TASKS: u64 = 32;
        const PAIRS: u64 = 400;
        let owners = ["account:a", "account:b", "account:c"];
        let (dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        for owner in owners {
            ledger.credit(owner, 1_000 * NANO, 0, "seed").await.unwrap();
        }
        let book = Book::start(db, 30_000);
        for owner in owners {
            // Loaded before the writer stalls: a load waits for it.
            let id = format!("warm-{owner}");
            book.hold(owner, &hold(&id, NANO, false)).await.unwrap();
            book.settle(owner, &settle(&id, 0)).await.unwrap();
        }
        book.flush().await.unwrap();
        let blocker = rusqlite::Connection::open(dir.path().join("book.db")).unwrap();
        blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
        let settled = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let (book, settled) = (book.clone(), settled.clone());
                tokio::spawn(async move {
                    let mut charged = 0;
                    for i in 0..PAIRS {
                        let owner = owners[((task + i) % 3) as usize];
                        let id = format!("b{task}-{i}");
                        book.hold(owner, &hold(&id, NANO, false)).await.unwrap();
                        if let SettleOutcome::Settled { usd, .. } =
                            book.settle(owner, &settle(&id, 3)).await.unwrap()
                        {
                            charged += usd;
                        }
                        settled.fetch_add(1, Ordering::Relaxed);
                    }
                    charged
                })
            })
            .collect();
        // The tasks run ahead of the stalled writer up to the line, and
        // wait there.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut most = 0;
        loop {
            let behind = book.shared.writer.behind();
            most = most.max(behind);
            let before = settled.load(Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(200)).await;
            if behind >= BACKLOG && settled.load(Ordering::Relaxed) == before {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "never stopped: {behind} behind, {before} settled"
            );
        }
        assert!(settled.load(Ordering::Relaxed) < TASKS * PAIRS);
        let waiting = book.shared.writer.behind();
        assert!(
            (BACKLOG..BACKLOG + TASKS).contains(&waiting),
            "{waiting} records behind the writer, the line {BACKLOG}, {TASKS} tasks"
        );
        blocker.execute_batch("ROLLBACK").unwrap();
        let mut charged = 0;
        for task in tasks {
            charged += task.await.unwrap();
        }
        assert_eq!(
            charged,
            (TASKS * PAIRS) as i64 * 3,
            "each settlement charged once"
        );
        let mut spent = 0;
        for owner in owners {
            let stored = reconcile(&book, &ledger, owner).await;
            assert_eq!(book.snapshot(owner).unwrap().balance, stored);
            spent += 1_000 * NANO - stored.usd;
        }
        assert_eq!(spent, charged);
        assert!(most < BACKLOG + TASKS, "{most} behind at most");
        assert_eq!(book.shared.writer.behind(), 0);
    }

    /// Under constant load the WAL starts over about once a second (the
    /// checkpointer copies it, the writer copies the last frames between
    /// two batches): it holds the last second's commits, not all of them.
    /// Each commit of a settlement writes at least 4 pages (the ledger
    /// row, the journal and its 2 indexes).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wal_starts_over_under_constant_load() {
        let (dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        let book = Book::start(db, 30_000);
        ledger
            .credit("account:a", 1_000_000 * NANO, 0, "seed")
            .await
            .unwrap();
        let started = Instant::now();
        let mut i = 0;
        while started.elapsed() < Duration::from_millis(3500) {
            let id = format!("w{i}");
            i += 1;
            book.hold("account:a", &hold(&id, NANO, false))
                .await
                .unwrap();
            book.settle("account:a", &settle(&id, NANO / 2))
                .await
                .unwrap();
            // One settlement a commit, as when each waited for its batch
            // (the ledger's log would gather many into one).
            book.flush().await.unwrap();
        }
        let (commits, _) = book.batches();
        let conn = rusqlite::Connection::open(dir.path().join("book.db")).unwrap();
        let frames: i64 = conn
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get(1))
            .unwrap();
        assert!(commits > 100, "{commits} commits");
        assert!(
            frames < commits as i64 * 4,
            "{frames} frames in the WAL after {commits} commits of 8 pages or more"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_of_a_thousand_on_postgres() {
        let (db, scratch) = postgres().await;
        ten_of_a_thousand(db).await;
        drop(scratch);
    }

    /// A closed hold is deleted a month after its stream began, a thousand
    /// a statement; a younger one stays, and so does an open one, however
    /// old (it is still to be charged).
    async fn closed_holds_are_forgotten_after_a_month(db: Database) {
        use crate::recovery::CLOSED_HOLD_RETENTION_MS as MONTH;
        let ledger = Ledger::new(db.clone());
        ledger
            .credit("account:f", 10 * NANO, 0, "seed")
            .await
            .unwrap();
        let book = Book::start(db.clone(), 30_000);
        // A real stream: held durably, settled, its hold closed.
        let placed = book.hold("account:f", &hold("f1", NANO, true)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        book.caught_up_for(None).await.unwrap();
        let settled = book.settle("account:f", &settle("f1", NANO)).await;
        assert_eq!(settled.unwrap(), charged(NANO, 0, 0));
        book.flush().await.unwrap();
        let later = now_ms() + MONTH + 1_000;
        // 2,500 more closed over a month before `later` (three batches).
        sqlx::query(
            "INSERT INTO holds (request_id, owner, usd_nanos, diem_nanos, state, created_at_ms, \
             expires_at_ms) \
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2500) \
             SELECT 'old-' || i, 'account:f', 0, 0, \
             CASE WHEN i % 2 = 0 THEN 'settled' ELSE 'expired' END, $1 - i, $1 - i FROM n",
        )
        .bind(later - MONTH - 1)
        .execute(db.pool())
        .await
        .unwrap();
        for (request_id, state, age) in [
            ("young", "settled", 86_400_000),
            ("open", "open", 2 * MONTH),
        ] {
            sqlx::query(
                "INSERT INTO holds (request_id, owner, usd_nanos, diem_nanos, state, \
                 created_at_ms, expires_at_ms) VALUES ($1, 'account:f', 0, 0, $2, $3, $4)",
            )
            .bind(request_id)
            .bind(state)
            .bind(later - age)
            .bind(later + 60_000)
            .execute(db.pool())
            .await
            .unwrap();
        }
        assert_eq!(book.forget_closed_holds(later).await.unwrap(), 2_501);
        let left: Vec<String> =
            sqlx::query_scalar("SELECT request_id FROM holds ORDER BY request_id")
                .fetch_all(db.pool())
                .await
                .unwrap();
        assert_eq!(left, ["open", "young"]);
        assert_eq!(book.forget_closed_holds(later).await.unwrap(), 0);
        // The charge's record stays in the journal.
        assert_eq!(ledger.charged("f1").await.unwrap(), (NANO, 0));
    }

    #[tokio::test]
    async fn closed_holds_are_forgotten_after_a_month_on_sqlite() {
        let (_dir, db) = sqlite().await;
        // Found by the index of closed holds, not by reading every hold.
        let explain = format!(
            "EXPLAIN QUERY PLAN {}",
            crate::recovery::FORGET_CLOSED_HOLDS
        );
        let plan: Vec<String> = sqlx::query(sqlx::AssertSqlSafe(explain))
            .bind(1_i64)
            .bind(1_000_i64)
            .fetch_all(db.pool())
            .await
            .unwrap()
            .iter()
            .map(|row| row.get::<String, _>("detail"))
            .collect();
        assert!(
            plan.iter()
                .any(|step| step.contains("USING INDEX holds_closed")),
            "{plan:?}"
        );
        closed_holds_are_forgotten_after_a_month(db).await;
    }

    #[tokio::test]
    async fn closed_holds_are_forgotten_after_a_month_on_postgres() {
        let (db, scratch) = postgres().await;
        closed_holds_are_forgotten_after_a_month(db).await;
        drop(scratch);
    }

    /// A stream's hold is durable; the process dies; after a restart its
    /// hold is charged its last checkpoint once its lease ends, and a usage
    /// record arriving afterwards charges nothing more.
    #[tokio::test]
    async fn a_stream_cut_by_a_crash_is_charged_its_last_checkpoint() {
        let (_dir, db, ledger, book) = funded("account:s", 10 * NANO, 0, 200).await;
        let placed = book.hold("account:s", &hold("s1", 4 * NANO, true)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { usd, .. } if usd == 4 * NANO));
        // Durable before the first token (in the ledger's log); the
        // database has the hold once the writer caught up.
        book.caught_up_for(None).await.unwrap();
        assert_eq!(
            ledger.balance("account:s").await.unwrap().usd_held,
            4 * NANO
        );
        assert!(
            book.checkpoint("account:s", "s1", NANO, (5, 7))
                .await
                .unwrap()
        );
        book.flush().await.unwrap();
        // The process dies: nothing of it survives but the database.
        drop(book);
        let book = Book::start(db.clone(), 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(book.recover(now_ms()).await.unwrap(), 1);
        assert_eq!(book.sweep(now_ms()), 1);
        let stored = reconcile(&book, &ledger, "account:s").await;
        assert_eq!((stored.usd, stored.usd_held), (9 * NANO, 0));
        assert_eq!(ledger.charged("s1").await.unwrap(), (NANO, 0));
        // The stream's real usage arrives late: settled already.
        let late = book
            .settle("account:s", &settle("s1", 3 * NANO))
            .await
            .unwrap();
        assert!(matches!(late, SettleOutcome::NotOpen));
        let stored = reconcile(&book, &ledger, "account:s").await;
        assert_eq!(stored.usd, 9 * NANO);
    }

    /// With the ledger's log, a stream that outlives the writer's batches
    /// has its open held back: the database has its hold only once it ends
    /// (written once, closed) or once a reader asks. A crash before then
    /// loses nothing: the next start applies the open from the log, and
    /// the hold is charged its last checkpoint once its lease ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_longer_than_a_batch_is_written_when_it_ends_or_from_the_log() {
        let (dir, db, ledger, book) = funded("account:h", 10 * NANO, 0, 200).await;
        let placed_from = now_ms();
        for id in ["h1", "h2"] {
            let placed = book.hold("account:h", &hold(id, 4 * NANO, true)).await;
            assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        }
        let placed_by = now_ms();
        // Each hold's rows say it opened while it was placed: its
        // `created_at_ms` and its open's journal row.
        let opened_when_placed = |db: Database| async move {
            let opened = sqlx::query_as::<_, (String, i64, i64)>(
                "SELECT h.request_id, h.created_at_ms, j.at_ms FROM holds h \
                 JOIN ledger_journal j ON j.idempotency_key = 'hold:' || h.request_id \
                 ORDER BY 1",
            )
            .fetch_all(db.pool())
            .await
            .unwrap();
            for (id, created, at) in &opened {
                assert!(
                    (placed_from..=placed_by).contains(created) && at == created,
                    "{id}: {created} {at}, placed in {placed_from}..={placed_by}"
                );
            }
            opened.len()
        };
        assert!(
            book.checkpoint("account:h", "h2", NANO, (5, 7))
                .await
                .unwrap()
        );
        // Batches later (the writer gathers for 50 ms), the database has
        // neither hold.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let holds = |db: Database| async move {
            sqlx::query_as::<_, (String, String)>(
                "SELECT request_id, state FROM holds ORDER BY request_id",
            )
            .fetch_all(db.pool())
            .await
            .unwrap()
        };
        assert_eq!(holds(db.clone()).await, []);
        assert_eq!(ledger.balance("account:h").await.unwrap().usd_held, 0);
        // The process dies now: what it leaves on disk is copied as it is
        // (the WAL's index and the log's lock are the living process's).
        let crashed = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            if !name.ends_with("-shm") && !name.ends_with(".lock") {
                std::fs::copy(&path, crashed.path().join(name)).unwrap();
            }
        }
        // This process goes on: "h1" ends, and its batch writes the hold,
        // closed, with the journal's rows of its open and its settlement.
        book.settle("account:h", &settle("h1", 3 * NANO))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(holds(db.clone()).await, [("h1".into(), "settled".into())]);
        let journal: Vec<String> = sqlx::query_scalar(
            "SELECT idempotency_key FROM ledger_journal WHERE request_id = 'h1' ORDER BY 1",
        )
        .fetch_all(db.pool())
        .await
        .unwrap();
        assert_eq!(journal, ["hold:h1", "settle:h1"]);
        // Written at the stream's end, its rows keep when it opened.
        assert_eq!(opened_when_placed(db.clone()).await, 1);
        let settled_at: i64 = sqlx::query_scalar(
            "SELECT at_ms FROM ledger_journal WHERE idempotency_key = 'settle:h1'",
        )
        .fetch_one(db.pool())
        .await
        .unwrap();
        assert!(settled_at >= placed_by + 300, "{settled_at} {placed_by}");
        // A reader of the database gets "h2" too.
        let stored = reconcile(&book, &ledger, "account:h").await;
        assert_eq!((stored.usd, stored.usd_held), (7 * NANO, 4 * NANO));
        let open = [
            ("h1".into(), "settled".into()),
            ("h2".into(), "open".into()),
        ];
        assert_eq!(holds(db.clone()).await, open);

        // The crashed process's next start: both opens from the log; once
        // their leases (200 ms) end, each is charged its last checkpoint
        // ("h1" had none).
        let url = format!("sqlite://{}/book.db", crashed.path().display());
        let db = Database::connect(&url, 8).await.unwrap();
        let (ledger, book) = (Ledger::new(db.clone()), Book::start(db.clone(), 200));
        let loaded = book
            .with_owner("account:h", |_, state| Ok(state.holds.len()))
            .await
            .unwrap();
        assert_eq!(loaded, 2);
        let open = [("h1".into(), "open".into()), ("h2".into(), "open".into())];
        assert_eq!(holds(db.clone()).await, open);
        // The log kept when each opened.
        assert_eq!(opened_when_placed(db.clone()).await, 2);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(book.sweep(now_ms()), 2);
        let stored = reconcile(&book, &ledger, "account:h").await;
        assert_eq!((stored.usd, stored.usd_held), (9 * NANO, 0));
        assert_eq!(ledger.charged("h1").await.unwrap(), (0, 0));
        assert_eq!(ledger.charged("h2").await.unwrap(), (NANO, 0));
    }

    /// A reader of one owner's rows has that owner's held-back opens
    /// written, and only those: other owners' streams stay held until
    /// they end (or a reader of every owner comes).
    #[tokio::test]
    async fn a_reader_of_one_owner_writes_only_its_held_opens() {
        let (_dir, db, ledger, book) = funded("account:a", 10 * NANO, 0, 30_000).await;
        ledger
            .credit("account:b", 10 * NANO, 0, "seed")
            .await
            .unwrap();
        for (owner, id) in [("account:a", "a1"), ("account:b", "b1")] {
            let placed = book.hold(owner, &hold(id, 4 * NANO, true)).await;
            assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        }
        let holds = || async {
            sqlx::query_scalar::<_, String>("SELECT request_id FROM holds ORDER BY request_id")
                .fetch_all(db.pool())
                .await
                .unwrap()
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(holds().await.is_empty());
        book.caught_up_with("account:a").await.unwrap();
        assert_eq!(holds().await, ["a1"]);
        assert_eq!(
            ledger.balance("account:a").await.unwrap().usd_held,
            4 * NANO
        );
        assert_eq!(ledger.balance("account:b").await.unwrap().usd_held, 0);
        book.caught_up_for(None).await.unwrap();
        assert_eq!(holds().await, ["a1", "b1"]);
        assert_eq!(
            ledger.balance("account:b").await.unwrap().usd_held,
            4 * NANO
        );
        // Opens queued just before the reader's flush (in its batch, or
        // held back by one before it) are in the database when it answers.
        for (owner, id) in [("account:b", "b2"), ("account:a", "a2")] {
            let placed = book.hold(owner, &hold(id, NANO, true)).await;
            assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        }
        book.caught_up_with("account:a").await.unwrap();
        assert_eq!(holds().await, ["a1", "a2", "b1"]);
    }

    /// A settlement of a hold this process never knew (billing restarted
    /// between the hold and the settlement) charges what was used, once.
    #[tokio::test]
    async fn a_settlement_after_a_restart_charges_what_was_used() {
        let (_dir, _db, ledger, book) = funded("account:r", 10 * NANO, 0, 30_000).await;
        let order = settle("r1", 3 * NANO);
        let settled = book.settle("account:r", &order).await.unwrap();
        assert_eq!(settled, charged(3 * NANO, 0, 0));
        // Again (a redelivered record): nothing more.
        assert_eq!(
            book.settle("account:r", &order).await.unwrap(),
            SettleOutcome::NotOpen
        );
        let stored = reconcile(&book, &ledger, "account:r").await;
        assert_eq!(stored.usd, 7 * NANO);
        assert_eq!(book.snapshot("account:r").unwrap().balance.usd, 7 * NANO);
    }

    /// Issue 16, finding 2: what the balance cannot cover is owed, not
    /// written off: it survives a restart, the owner's next hold must cover
    /// it on top of its own, and that request's settlement pays it first.
    #[tokio::test]
    async fn what_the_balance_cannot_cover_is_owed_and_paid_first() {
        let (_dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        ledger.credit("account:o", NANO, 0, "seed").await.unwrap();
        let book = Book::start(db.clone(), 30_000);
        let placed = book.hold("account:o", &hold("o1", NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        // The backend did three times what the hold assumed.
        let settled = book.settle("account:o", &settle("o1", 3 * NANO)).await;
        assert_eq!(settled.unwrap(), charged(NANO, 0, 2 * NANO));
        let stored = reconcile(&book, &ledger, "account:o").await;
        assert_eq!((stored.usd, stored.owed), (0, 2 * NANO));
        // A restart forgets nothing.
        drop(book);
        let book = Book::start(db.clone(), 30_000);
        let small = hold("o2", NANO / 10, false);
        let refused = book.hold("account:o", &small).await.unwrap();
        assert!(
            matches!(refused, HoldOutcome::Insufficient { .. }),
            "{refused:?}"
        );
        assert_eq!(book.snapshot("account:o").unwrap().balance.owed, 2 * NANO);
        // $2.05 more: not enough for $2 owed and a $0.10 hold.
        ledger
            .credit("account:o", 2 * NANO + NANO / 20, 0, "top-up-1")
            .await
            .unwrap();
        let refused = book.hold("account:o", &small).await.unwrap();
        assert!(
            matches!(refused, HoldOutcome::Insufficient { .. }),
            "{refused:?}"
        );
        ledger
            .credit("account:o", NANO, 0, "top-up-2")
            .await
            .unwrap();
        let placed = book.hold("account:o", &small).await.unwrap();
        assert!(matches!(placed, HoldOutcome::Placed { .. }), "{placed:?}");
        let settled = book.settle("account:o", &settle("o2", NANO / 10)).await;
        assert_eq!(settled.unwrap(), charged(2 * NANO + NANO / 10, 0, 0));
        let stored = reconcile(&book, &ledger, "account:o").await;
        assert_eq!((stored.usd, stored.owed), (NANO - NANO / 20, 0));
    }

    /// Issue 16, finding 5: a charge beyond the hold stays within the key's
    /// cap, on the hold's settlement and on a late one (the hold unknown
    /// here); what the cap keeps back is owed by the account, and another
    /// key's request pays it.
    #[tokio::test]
    async fn a_charge_beyond_the_hold_stays_within_the_keys_cap() {
        let (_dir, _db, ledger, book) = funded("account:c", 10 * NANO, 0, 30_000).await;
        let cap = KeyCap {
            key_id: "key-c".into(),
            period: "EPOCH:1".into(),
            usd: Some(NANO),
            diem: None,
        };
        let capped = |request_id, cost| SettleOrder {
            spent_by: "",
            key: Some(("key-c", "EPOCH:1")),
            cap: Some((Some(NANO), None)),
            ..settle(request_id, cost)
        };
        let order = HoldOrder {
            cap: Some(&cap),
            ..hold("c1", NANO / 2, false)
        };
        assert!(matches!(
            book.hold("account:c", &order).await.unwrap(),
            HoldOutcome::Placed { .. }
        ));
        // $3 used against a $0.50 hold under a $1 cap: $1 charged.
        let settled = book.settle("account:c", &capped("c1", 3 * NANO)).await;
        assert_eq!(settled.unwrap(), charged(NANO, 0, 2 * NANO));
        // A late settlement of the same key: nothing more within its cap.
        let late = book.settle("account:c", &capped("c2", NANO)).await;
        assert_eq!(late.unwrap(), charged(0, 0, 3 * NANO));
        book.flush().await.unwrap();
        let spend = read_key_spend(&book.shared.db, "key-c", "EPOCH:1").await;
        assert_eq!(spend.unwrap().usd, NANO, "the key spent its cap, no more");
        // The capped key is refused; an uncapped one pays the debt first.
        let order = HoldOrder {
            cap: Some(&cap),
            ..hold("c3", NANO / 10, false)
        };
        assert!(matches!(
            book.hold("account:c", &order).await.unwrap(),
            HoldOutcome::KeyLimitReached { .. }
        ));
        book.hold("account:c", &hold("c4", NANO / 10, false))
            .await
            .unwrap();
        let settled = book.settle("account:c", &settle("c4", NANO / 10)).await;
        assert_eq!(settled.unwrap(), charged(3 * NANO + NANO / 10, 0, 0));
        let stored = reconcile(&book, &ledger, "account:c").await;
        assert_eq!((stored.usd, stored.owed), (6 * NANO - NANO / 10, 0));
    }

    /// A process killed after answering, with settlements in the ledger's
    /// log that the writer had not committed yet: the next start applies
    /// them, once each (the log also holds one twice, as a replay would),
    /// before it loads any owner; then the log is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_the_log_holds_is_charged_once_at_the_next_start() {
        use crate::writer::log::Log;
        let (_dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        ledger
            .credit("account:l", 10 * NANO, 0, "seed")
            .await
            .unwrap();
        let file = db.sqlite_file().unwrap().to_path_buf();
        {
            let opened = Log::open(&file).unwrap().unwrap();
            let (jobs, _queue) = tokio::sync::mpsc::unbounded_channel();
            let owner = Arc::new(Owner::detached("account:l"));
            let held = OpenHold {
                usd: 2 * NANO,
                diem: 0,
                expires_at_ms: 0,
                opened_at_ms: 0,
                key: None,
                durable: false,
                checkpoint: 0,
                checkpoint_tokens: (0, 0),
                model_id: "m".into(),
            };
            for id in ["l1", "l2", "l3", "l2"] {
                let record = Record::close(
                    owner.clone(),
                    1,
                    RecordKind::Settle,
                    &settle(id, NANO),
                    [NANO, 0, 0],
                    Some(&held),
                );
                opened
                    .log
                    .append(record, None, &jobs, &Default::default())
                    .unwrap();
            }
        }
        let book = Book::start(db.clone(), 30_000);
        // The first load waits for the log to be applied.
        let snapshot = book
            .with_owner("account:l", |_, state| Ok(state.balance))
            .await
            .unwrap();
        assert_eq!(snapshot.usd, 7 * NANO);
        let stored = reconcile(&book, &ledger, "account:l").await;
        assert_eq!(stored.usd, 7 * NANO);
        for id in ["l1", "l2", "l3"] {
            assert_eq!(ledger.charged(id).await.unwrap(), (NANO, 0), "{id}");
        }
        // The process goes on: a settlement is durable once logged, and
        // the database has it once the writer catches up.
        book.hold("account:l", &hold("l4", 2 * NANO, false))
            .await
            .unwrap();
        book.settle("account:l", &settle("l4", NANO)).await.unwrap();
        book.caught_up_for(None).await.unwrap();
        assert_eq!(ledger.charged("l4").await.unwrap(), (NANO, 0));
        drop(book);
        // Once its writer stops, the next process takes the log: empty.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(opened) = Log::open(&file).unwrap() {
                assert!(opened.replay.is_empty());
                break;
            }
            assert!(Instant::now() < deadline, "the log stayed locked");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// With the ledger's log a settlement is answered before it is
    /// committed: if another process loaded its owner from the same file
    /// meanwhile (the fence moved on), it is still written, under the new
    /// fence, and this process reads the owner again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_logged_settlement_is_written_after_another_process_loaded_its_owner() {
        let (_dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        ledger
            .credit("account:g", 10 * NANO, 0, "seed")
            .await
            .unwrap();
        let first = Book::start(db.clone(), 30_000);
        // The log is taken: the second writes without one.
        let second = Book::start(db.clone(), 30_000);
        assert!(first.shared.writer.logs() && !second.shared.writer.logs());
        first
            .hold("account:g", &hold("g1", 2 * NANO, false))
            .await
            .unwrap();
        second
            .hold("account:g", &hold("g2", NANO, false))
            .await
            .unwrap();
        let settled = first.settle("account:g", &settle("g1", NANO)).await;
        assert!(matches!(settled.unwrap(), SettleOutcome::Settled { usd, .. } if usd == NANO));
        first.flush().await.unwrap();
        assert_eq!(ledger.charged("g1").await.unwrap(), (NANO, 0));
        assert!(
            first.snapshot("account:g").is_none(),
            "the owner is read again"
        );
        assert_eq!(ledger.balance("account:g").await.unwrap().usd, 9 * NANO);
    }

    /// A ledger's log that cannot be opened (here its lock is a folder):
    /// billing refuses, rather than decide on a database that may miss what
    /// the log holds.
    #[tokio::test]
    async fn billing_refuses_while_its_log_cannot_be_opened() {
        let (dir, db) = sqlite().await;
        std::fs::create_dir(dir.path().join("book.db-ledger.lock")).unwrap();
        let book = Book::start(db, 30_000);
        let refused = book
            .hold("account:x", &hold("x1", NANO, false))
            .await
            .unwrap_err();
        assert_eq!(refused.code, ErrorCode::Unavailable);
        assert!(
            refused.message.contains("ledger's log"),
            "{}",
            refused.message
        );
    }

    /// Credits written to the database by someone else (the CLI, another
    /// replica's top-up) reach the owner in memory.
    #[tokio::test]
    async fn credits_from_elsewhere_reach_memory() {
        let (_dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        let book = Book::start(db.clone(), 30_000);
        let refused = book.hold("account:c", &hold("c1", NANO, false)).await;
        assert!(matches!(refused.unwrap(), HoldOutcome::Insufficient { .. }));
        ledger
            .credit("account:c", 2 * NANO, 0, "cli")
            .await
            .unwrap();
        book.refresh_now("account:c").await.unwrap();
        let placed = book.hold("account:c", &hold("c2", NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        // And with no refresh asked for: within a second of use.
        ledger
            .credit("account:c", 5 * NANO, 0, "cli-2")
            .await
            .unwrap();
        tokio::time::sleep(REFRESH_EVERY + Duration::from_millis(50)).await;
        let _ = book.hold("account:c", &hold("c3", 0, false)).await.unwrap();
        book.flush().await.unwrap();
        assert_eq!(book.snapshot("account:c").unwrap().balance.usd, 7 * NANO);
    }

    /// Two replicas believe they own one ledger: the one that loaded it
    /// last holds the fence, and the other can no longer write for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_that_lost_an_owner_cannot_write_for_it() {
        let (db, scratch, ledger) = credited_postgres("account:f").await;
        let first = Book::start(db.clone(), 30_000);
        let second = Book::start(db.clone(), 30_000);
        let placed = first.hold("account:f", &hold("f1", 2 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        // Ownership moves: the second replica loads the owner.
        let placed = second.hold("account:f", &hold("f2", 2 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        // The first replica's settlement is fenced out, not written.
        let fenced = first.settle("account:f", &settle("f1", NANO)).await;
        assert_eq!(fenced.unwrap_err().code, ErrorCode::Unavailable);
        assert_eq!(ledger.charged("f1").await.unwrap(), (0, 0));
        // The second one's goes through.
        second
            .settle("account:f", &settle("f2", NANO))
            .await
            .unwrap();
        assert_eq!(ledger.charged("f2").await.unwrap(), (NANO, 0));
        // Requests racing on both replicas: whichever writes, nothing is
        // lost or doubled, and the balance stays the journal's.
        let mut tasks = Vec::new();
        for i in 0..40 {
            let book = if i % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            tasks.push(tokio::spawn(async move {
                let id = format!("x{i}");
                match book.hold("account:f", &hold(&id, NANO / 10, false)).await {
                    Ok(HoldOutcome::Placed { .. }) => {
                        book.settle("account:f", &settle(&id, NANO / 20)).await.ok()
                    }
                    _ => None,
                }
            }));
        }
        let mut charged = 0;
        for task in tasks {
            if let Some(SettleOutcome::Settled { usd, .. }) = task.await.unwrap() {
                charged += usd;
            }
        }
        first.flush().await.unwrap();
        second.flush().await.unwrap();
        let stored = ledger.balance("account:f").await.unwrap();
        assert_eq!(stored, ledger.journal_sums("account:f").await.unwrap());
        assert_eq!(stored.usd, 9 * NANO - charged);
        // The writers give their connections back when their books go.
        drop((first, second));
        drop(scratch);
    }

    /// A PostgreSQL ledger ([`postgres`]) where `owner` was credited 10
    /// USD.
    async fn credited_postgres(owner: &str) -> (Database, ScratchDatabase, Ledger) {
        let (db, scratch) = postgres().await;
        let ledger = Ledger::new(db.clone());
        ledger.credit(owner, 10 * NANO, 0, "seed").await.unwrap();
        (db, scratch, ledger)
    }

    /// A book that claims owners as billing replica `me`, hearing the
    /// replicas `hears` (comma-separated) and giving no owner away by view.
    fn replica(db: &Database, me: &str, hears: &str) -> Book {
        let book = Book::start(db.clone(), 30_000);
        *book.shared.test_claim.lock().unwrap() = Some(writer::Claim {
            me: me.into(),
            live: hears.into(),
            elsewhere: None,
        });
        book
    }

    /// [`replica`], whose view gives every owner to `elsewhere`.
    fn viewing(db: &Database, me: &str, hears: &str, elsewhere: &str) -> Book {
        let book = replica(db, me, hears);
        if let Some(claim) = book.shared.test_claim.lock().unwrap().as_mut() {
            claim.elsewhere = Some(elsewhere.into());
        }
        book
    }

    /// Waits until nobody holds `owner`'s ledger (a replica let it go).
    async fn released(db: &Database, owner: &str) {
        let started = Instant::now();
        loop {
            let holder: Option<String> =
                sqlx::query_scalar("SELECT holder FROM ledgers WHERE owner = $1")
                    .bind(owner)
                    .fetch_one(db.pool())
                    .await
                    .unwrap();
            if holder.is_none() {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "held by {holder:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A live replica keeps the ledgers it loaded: another one it hears may
    /// not load them (and names the keeper) until it lets them go, handing
    /// the holds it kept only in memory over; the next keeper counts them
    /// and settles them, and the first may not load the ledger back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_replica_keeps_its_ledger_until_it_lets_it_go_with_its_holds() {
        let (db, scratch, ledger) = credited_postgres("account:k").await;
        let (a, b) = (replica(&db, "a", "b"), replica(&db, "b", "a"));
        let placed = a.hold("account:k", &hold("k1", 4 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        let refused = b.hold("account:k", &hold("k2", NANO, false)).await;
        assert_eq!(writer::kept_elsewhere(&refused.unwrap_err()), Some("a"));

        assert_eq!(a.drop_owners(|_| true), 1);
        released(&db, "account:k").await;
        // b counts a's hold: 6 of the 10 are free.
        let over = b.hold("account:k", &hold("k3", 7 * NANO, false)).await;
        assert!(matches!(over.unwrap(), HoldOutcome::Insufficient { .. }));
        let placed = b.hold("account:k", &hold("k4", 6 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        // a's request settles where the ledger is now (the gateway follows
        // the keeper's name); a itself may not take it back.
        let again = a.settle("account:k", &settle("k1", 3 * NANO)).await;
        assert_eq!(writer::kept_elsewhere(&again.unwrap_err()), Some("b"));
        let settled = b.settle("account:k", &settle("k1", 3 * NANO)).await;
        assert_eq!(settled.unwrap(), charged(3 * NANO, 0, 0));
        let settled = b.settle("account:k", &settle("k4", 6 * NANO)).await;
        assert_eq!(settled.unwrap(), charged(6 * NANO, 0, 0));

        b.flush().await.unwrap();
        let stored = ledger.balance("account:k").await.unwrap();
        assert_eq!(stored, ledger.journal_sums("account:k").await.unwrap());
        assert_eq!((stored.usd, stored.usd_held, stored.owed), (NANO, 0, 0));
        drop((a, b));
        drop(scratch);
    }

    /// A replica no longer heard (counted dead) is taken from: the taker
    /// cannot see what it held in memory, and it can no longer write.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_no_longer_heard_is_taken_from_and_fenced_out() {
        let (db, scratch, ledger) = credited_postgres("account:d").await;
        let (a, b) = (replica(&db, "a", "b"), replica(&db, "b", ""));
        let placed = a.hold("account:d", &hold("d1", 4 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        let placed = b.hold("account:d", &hold("d2", 10 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        let fenced = a.settle("account:d", &settle("d1", NANO)).await;
        assert!(writer::fenced_out(&fenced.unwrap_err()));
        assert_eq!(ledger.charged("d1").await.unwrap(), (0, 0));
        drop((a, b));
        drop(scratch);
    }

    /// A ledger is left to the replica the asking one's view gives it to
    /// (so a replica that handed an owner back does not take it again from
    /// a gateway that has not heard yet), and a claim the asking one still
    /// has from a past run is let go; that one takes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ledger_nobody_holds_goes_to_the_replica_the_view_names() {
        let (db, scratch, _) = credited_postgres("account:v").await;
        // b held it in a past run (a restart: nothing of it in memory).
        let past = replica(&db, "b", "a");
        let placed = past.hold("account:v", &hold("v0", NANO, true)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        past.flush().await.unwrap();
        drop(past);
        let (a, b) = (replica(&db, "a", "b"), viewing(&db, "b", "a", "a"));
        // b's view gives the ledger to a: b lets its past claim go and
        // names a, which takes it (with the stream's hold of b's past run).
        let refused = b.hold("account:v", &hold("v1", NANO, false)).await;
        assert_eq!(writer::kept_elsewhere(&refused.unwrap_err()), Some("a"));
        let over = a.hold("account:v", &hold("v1", 10 * NANO, false)).await;
        assert!(matches!(over.unwrap(), HoldOutcome::Insufficient { .. }));
        let placed = a.hold("account:v", &hold("v1", 9 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        drop((a, b));
        drop(scratch);
    }

    /// Calls `call` on the book keeping the ledger, starting at `at`, as
    /// the gateway's billing client does: after the named keeper, and again
    /// when fenced out or the ledger is moving.
    async fn on_keeper<T, Fut>(
        books: &[Book; 2],
        mut at: usize,
        call: impl Fn(Book) -> Fut,
    ) -> Result<T>
    where
        Fut: std::future::Future<Output = Result<T>>,
    {
        for _ in 0..2000 {
            let error = match call(books[at].clone()).await {
                Err(error) => error,
                answered => return answered,
            };
            if let Some(keeper) = writer::kept_elsewhere(&error) {
                at = usize::from(keeper == "b");
            } else if !writer::fenced_out(&error) && !writer::is_moving(&error) {
                return Err(error);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("no replica answered")
    }

    /// 1,000 requests over two live replicas at once against a balance for
    /// 10, while the ledger is let go again and again by whichever replica
    /// keeps it: exactly 10 are placed, each settled once at its cost, and
    /// the balance ends at zero, matching the journal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_of_a_thousand_while_the_ledger_moves_between_live_replicas() {
        let (db, scratch, ledger) = credited_postgres("account:m").await;
        let books = Arc::new([replica(&db, "a", "b"), replica(&db, "b", "a")]);
        let mover = {
            let books = books.clone();
            tokio::spawn(async move {
                let mut moves = 0;
                for round in 0..200 {
                    moves += books[round % 2].drop_owners(|_| true);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                moves
            })
        };
        let tasks: Vec<_> = (0..1000)
            .map(|i| {
                let books = books.clone();
                tokio::spawn(async move {
                    let id = format!("m{i}");
                    let placed = on_keeper(&books, i % 2, |book| {
                        let id = id.clone();
                        async move { book.hold("account:m", &hold(&id, NANO, false)).await }
                    })
                    .await
                    .unwrap();
                    if !matches!(placed, HoldOutcome::Placed { .. }) {
                        return None;
                    }
                    // The upstream answers meanwhile: the ledger may move.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let settled = on_keeper(&books, i % 2, |book| {
                        let id = id.clone();
                        async move { book.settle("account:m", &settle(&id, NANO)).await }
                    })
                    .await
                    .unwrap();
                    Some(settled)
                })
            })
            .collect();
        let mut served = 0;
        for task in tasks {
            if let Some(settled) = task.await.unwrap() {
                assert_eq!(settled, charged(NANO, 0, 0));
                served += 1;
            }
        }
        let moves = mover.await.unwrap();
        assert_eq!(served, 10, "{moves} moves");
        for book in books.iter() {
            book.flush().await.unwrap();
        }
        let stored = ledger.balance("account:m").await.unwrap();
        assert_eq!(stored, ledger.journal_sums("account:m").await.unwrap());
        assert_eq!((stored.usd, stored.usd_held, stored.owed), (0, 0, 0));
        assert!(moves > 1, "the ledger never moved");
        drop(books);
        drop(scratch);
    }

    /// A replica whose views differed from the gateways' for a moment
    /// (another replica loaded and charged the owner meanwhile) does not
    /// answer a balance from its memory, which misses that charge: it
    /// reads the fence, lets the owner go and reads the database.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_that_lost_an_owner_reads_its_balance_afresh() {
        let (db, scratch, ledger) = credited_postgres("account:r").await;
        let first = Book::start(db.clone(), 30_000);
        let second = Book::start(db.clone(), 30_000);
        let placed = first.hold("account:r", &hold("r1", 2 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        first
            .settle("account:r", &settle("r1", NANO))
            .await
            .unwrap();
        let read = first.current_snapshot("account:r").await.unwrap();
        assert_eq!(read.unwrap().balance.usd, 9 * NANO, "its own, from memory");
        // The second replica takes the owner and charges it.
        let placed = second.hold("account:r", &hold("r2", 2 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        second
            .settle("account:r", &settle("r2", NANO))
            .await
            .unwrap();
        // The first one's memory is stale, and it knows.
        assert_eq!(first.snapshot("account:r").unwrap().balance.usd, 9 * NANO);
        assert!(first.current_snapshot("account:r").await.unwrap().is_none());
        assert!(first.snapshot("account:r").is_none(), "let go");
        assert_eq!(
            ledger.snapshot("account:r").await.unwrap().balance.usd,
            8 * NANO
        );
        // The owner's replica still answers from memory.
        let read = second.current_snapshot("account:r").await.unwrap();
        assert_eq!(read.unwrap().balance.usd, 8 * NANO);
        drop((first, second));
        drop(scratch);
    }

    /// A staking owner's DIEM is allocated once per day, from memory.
    #[tokio::test]
    async fn a_stake_allocates_diem_once_a_day() {
        let (_dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        ledger.set_stake("account:d", 3 * NANO).await.unwrap();
        let book = Book::start(db.clone(), 30_000);
        let placed = book.hold("account:d", &hold("d1", 2 * NANO, false)).await;
        assert!(
            matches!(placed.unwrap(), HoldOutcome::Placed { usd: 0, diem, .. } if diem == 2 * NANO)
        );
        let placed = book.hold("account:d", &hold("d2", 2 * NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Insufficient { .. }));
        book.settle("account:d", &settle("d1", NANO)).await.unwrap();
        let stored = reconcile(&book, &ledger, "account:d").await;
        assert_eq!(stored.diem, 2 * NANO);
    }

    /// A key's cap holds exactly under a race, counts settled spend, and
    /// the database agrees.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_cap_holds_exactly_under_a_race() {
        let (_dir, _db, _ledger, book) = funded("account:k", 10 * NANO, 0, 30_000).await;
        let cap = KeyCap {
            key_id: "key-1".into(),
            period: "EPOCH:1".into(),
            usd: Some(NANO),
            diem: None,
        };
        let race = |prefix: &'static str| {
            let tasks: Vec<_> = (0..100)
                .map(|i| {
                    let (book, cap) = (book.clone(), cap.clone());
                    tokio::spawn(async move {
                        let id = format!("{prefix}{i}");
                        let order = HoldOrder {
                            cap: Some(&cap),
                            ..hold(&id, NANO / 10, false)
                        };
                        (id.clone(), book.hold("account:k", &order).await.unwrap())
                    })
                })
                .collect::<Vec<_>>();
            async move {
                let mut placed = Vec::new();
                for task in tasks {
                    match task.await.unwrap() {
                        (id, HoldOutcome::Placed { .. }) => placed.push(id),
                        (_, HoldOutcome::KeyLimitReached { currency, .. }) => {
                            assert_eq!(currency, "USD");
                        }
                        (_, other) => panic!("{other:?}"),
                    }
                }
                placed
            }
        };
        let placed = race("a").await;
        assert_eq!(placed.len(), 10, "$1 of $0.10 holds");
        for id in &placed {
            let order = SettleOrder {
                spent_by: "",
                key: Some(("key-1", "EPOCH:1")),
                ..settle(id, NANO / 20)
            };
            book.settle("account:k", &order).await.unwrap();
        }
        // $0.50 spent: room for five more.
        assert_eq!(race("b").await.len(), 5);
        book.flush().await.unwrap();
        let spend = read_key_spend(&book.shared.db, "key-1", "EPOCH:1").await;
        let spend = spend.unwrap();
        assert_eq!((spend.usd, spend.usd_held), (NANO / 2, 0));
    }

    /// DIEM pays first, from the hold and then beyond it: a cost above the
    /// hold is charged from the balance no other hold reserves.
    #[tokio::test]
    async fn diem_pays_first_and_a_cost_above_the_hold_is_charged_from_the_rest() {
        let (_dir, _db, ledger, book) = funded("account:w", 2 * NANO, NANO, 30_000).await;
        let placed = book
            .hold("account:w", &hold("w1", 3 * NANO / 2, false))
            .await
            .unwrap();
        assert!(matches!(placed, HoldOutcome::Placed { usd, diem, .. }
            if usd == NANO / 2 && diem == NANO));
        // Another request's hold is not touched.
        let other = book.hold("account:w", &hold("w2", NANO, false)).await;
        assert!(matches!(other.unwrap(), HoldOutcome::Placed { usd, .. } if usd == NANO));
        let settled = book.settle("account:w", &settle("w1", 2 * NANO)).await;
        assert_eq!(settled.unwrap(), charged(NANO, NANO, 0));
        let stored = reconcile(&book, &ledger, "account:w").await;
        assert_eq!((stored.usd, stored.diem), (NANO, 0));
        // w2's hold (in memory: a plain request's hold is not written).
        assert_eq!(book.snapshot("account:w").unwrap().balance.usd_held, NANO);
    }

    /// A day later the stake allocates again: no roll-over, and what open
    /// holds reserve stays reserved.
    #[tokio::test]
    async fn a_new_day_allocates_again_without_roll_over() {
        let (_dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        ledger.set_stake("account:n", 25 * NANO).await.unwrap();
        let book = Book::start(db, 30_000);
        book.hold("account:n", &hold("n1", 10 * NANO, false))
            .await
            .unwrap();
        book.settle("account:n", &settle("n1", 10 * NANO))
            .await
            .unwrap();
        book.hold("account:n", &hold("n2", 5 * NANO, false))
            .await
            .unwrap();
        assert_eq!(book.snapshot("account:n").unwrap().balance.diem, 15 * NANO);
        // Midnight: 25 again (not 25 + 15), plus the 5 still held.
        let entry = book.loaded("account:n").unwrap();
        {
            let mut guard = entry.lock();
            let state = guard.as_mut().unwrap();
            start_epoch(&entry, state, &book.shared.writer, today() + 1);
            assert_eq!(
                (state.balance.diem, state.balance.diem_held),
                (30 * NANO, 5 * NANO)
            );
        }
        book.settle("account:n", &settle("n2", 5 * NANO))
            .await
            .unwrap();
        let stored = reconcile(&book, &ledger, "account:n").await;
        assert_eq!((stored.diem, stored.diem_held), (25 * NANO, 0));
    }

    /// A plain hold nobody settles is dropped when its time is up, charging
    /// nothing; a free request holds nothing at all.
    #[tokio::test]
    async fn plain_holds_expire_free_of_charge() {
        let (_dir, db) = sqlite().await;
        let ledger = Ledger::new(db.clone());
        ledger.credit("account:e", NANO, 0, "seed").await.unwrap();
        let book = Book::start(db, 30_000);
        let order = HoldOrder {
            expires_at_ms: now_ms() + 50,
            ..hold("e1", NANO, false)
        };
        book.hold("account:e", &order).await.unwrap();
        let refused = book.hold("account:e", &hold("e2", NANO, false)).await;
        assert!(matches!(refused.unwrap(), HoldOutcome::Insufficient { .. }));
        assert_eq!(book.sweep(now_ms() + 100), 1);
        let free = book.hold("account:e", &hold("e3", 0, false)).await.unwrap();
        assert!(matches!(
            free,
            HoldOutcome::Placed {
                usd: 0,
                diem: 0,
                ..
            }
        ));
        let placed = book.hold("account:e", &hold("e4", NANO, false)).await;
        assert!(matches!(placed.unwrap(), HoldOutcome::Placed { .. }));
        let stored = reconcile(&book, &ledger, "account:e").await;
        assert_eq!((stored.usd, stored.usd_held), (NANO, 0));
        // The expired request was served after all: its usage record
        // arrives late (its settlement took the durable queue) and is
        // charged, not found settled by the expiry.
        book.settle("account:e", &settle("e4", NANO)).await.unwrap();
        let late = book.settle("account:e", &settle("e1", NANO / 2)).await;
        assert!(matches!(late.unwrap(), SettleOutcome::Settled { .. }));
        let ledger_charged = ledger.charged("e1").await.unwrap();
        assert_eq!(ledger_charged, (0, 0), "nothing left to pay it from");
        let stored = reconcile(&book, &ledger, "account:e").await;
        assert_eq!((stored.usd, stored.owed), (0, NANO / 2));
    }

    /// A refresh in the same batch as a settlement queued after it reads a
    /// balance that already has the charge: memory must not count it twice.
    #[tokio::test]
    async fn a_refresh_batched_with_a_settlement_counts_it_once() {
        let (_dir, _db, ledger, book) = funded("account:o", 10 * NANO, 0, 30_000).await;
        book.hold("account:o", &hold("o1", 2 * NANO, false))
            .await
            .unwrap();
        // One thread: both are queued before the writer runs.
        let order = settle("o1", NANO);
        let (refreshed, settled) = tokio::join!(
            book.refresh_now("account:o"),
            book.settle("account:o", &order)
        );
        refreshed.unwrap();
        settled.unwrap();
        let stored = reconcile(&book, &ledger, "account:o").await;
        assert_eq!(stored.usd, 9 * NANO);
        assert_eq!(book.snapshot("account:o").unwrap().balance, stored);
    }
}

/// Properties of the deciders: under any sequence of holds and settlements,
/// plain or late, no balance goes below zero or below what is held (the
/// database's CHECKs), debt is never negative, and every settlement
/// accounts for its whole cost: what it charged plus what the debt grew by.
#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Hold(i64),
        /// Settles the n-th placed hold (or an id never held, past the end).
        Settle(usize, i64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0..3_000i64).prop_map(Step::Hold),
            (0..12usize, 0..6_000i64).prop_map(|(n, cost)| Step::Settle(n, cost)),
        ]
    }

    fn state(usd: i64, diem: i64, owed: i64) -> State {
        State {
            live: true,
            fence: 1,
            balance: Balance {
                usd,
                diem,
                owed,
                ..Balance::default()
            },
            diem_epoch: 0,
            stake: None,
            holds: HashMap::default(),
            keys: HashMap::default(),
            unflushed: (0, 0),
            pending: 0,
            refreshed_at: Instant::now(),
            refreshing: false,
            last_active: Instant::now(),
        }
    }

    proptest! {
        #[test]
        fn every_settlement_accounts_for_its_cost(
            usd in 0..10_000i64,
            diem in 0..10_000i64,
            owed in 0..5_000i64,
            steps in proptest::collection::vec(step(), 1..40),
        ) {
            let entry = Arc::new(Owner::detached("account:p"));
            let mut state = state(usd, diem, owed);
            let mut placed: Vec<String> = Vec::new();
            for (i, step) in steps.into_iter().enumerate() {
                match step {
                    Step::Hold(amount) => {
                        let id = format!("h{i}");
                        let order = HoldOrder {
                            request_id: &id,
                            amount,
                            expires_at_ms: i64::MAX,
                            cap: None,
                            durable: false,
                            model_id: "m",
                        };
                        if let HoldDecision::Placed { .. } = decide_hold(&mut state, &order, 30_000) {
                            placed.push(id);
                        }
                    }
                    Step::Settle(n, cost) => {
                        let id = placed.get(n).cloned().unwrap_or_else(|| format!("late{i}"));
                        let order = SettleOrder {
                            spent_by: "",
                            request_id: &id,
                            cost,
                            model_id: "m",
                            prompt_tokens: 1,
                            completion_tokens: 1,
                            key: None,
                            cap: None,
                            rest: false,
                        };
                        let before = state.balance.owed;
                        match decide_settle(&entry, &mut state, &order).1 {
                            SettleOutcome::Settled { usd, diem, owed } => {
                                prop_assert_eq!(owed, state.balance.owed);
                                prop_assert_eq!(usd + diem + (owed - before), cost);
                            }
                            SettleOutcome::NotOpen => {
                                prop_assert_eq!(cost, 0);
                                prop_assert_eq!(state.balance.owed, before);
                            }
                        }
                    }
                }
                let b = state.balance;
                prop_assert!(b.usd_held >= 0 && b.diem_held >= 0, "{b:?}");
                prop_assert!(b.usd >= b.usd_held && b.diem >= b.diem_held, "{b:?}");
                prop_assert!(b.owed >= 0, "{b:?}");
            }
        }
    }
}
