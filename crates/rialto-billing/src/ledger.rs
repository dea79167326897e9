//! The prepaid ledger in the database: balances, holds, and the journal of
//! every change.
//!
//! Owners are `account:<id>` (later `wallet:<address>`). Amounts are
//! integer nano-units (1e-9 USD or DIEM; 1 DIEM is worth 1 USD of credit).
//!
//! Every operation is one transaction whose first statement writes (so on
//! SQLite it takes the write lock at once instead of failing to upgrade a
//! read), and every change appends a journal row with an idempotency key
//! (`credit:<reference>`, `hold:<request id>`, `settle:<request id>`, ...):
//! repeating an operation changes nothing. Holds are conditional updates
//! (`... WHERE balance - held >= amount`) and the table's CHECKs refuse any
//! balance below zero, so concurrent requests on any number of replicas can
//! never overdraw an owner.
//!
//! A request's cost is taken from DIEM first, then USD: its hold reserves
//! DIEM up to what is available and the rest in USD; its settlement charges
//! the held DIEM first. A settlement never charges more than was held (the
//! hold is the most a request can cost); a cost above it is recorded as
//! written off, never taken from an unreserved balance.
//!
//! A key may carry a spending cap per period (the hosted API's
//! `consumptionLimit`): its holds also reserve against what the key spent
//! and holds in the period (`key_spend`), by the same kind of conditional
//! update in the same transaction, so concurrent requests cannot overrun a
//! key's cap either. DIEM the cap does not allow is taken in USD.
//!
//! A hold nobody settled in time (its gateway crashed, or billing was down)
//! expires: its reservation is released. If the request's usage record
//! arrives later (from the durable queue), the expired hold is settled
//! then, once, from what the balance has available at that time
//! ([`Ledger::settle_usage`] does both).

use rialto_core::db::{Database, now_ms};
use rialto_core::{Error, Result};
use sqlx::Row;

/// An owner's balances, in nano-units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Balance {
    pub usd: i64,
    pub diem: i64,
    pub usd_held: i64,
    pub diem_held: i64,
}

impl Balance {
    pub fn usd_available(&self) -> i64 {
        self.usd - self.usd_held
    }

    pub fn diem_available(&self) -> i64 {
        self.diem - self.diem_held
    }
}

/// An owner's ledger row as last read or written: what a ledger actor
/// caches so that a hold needs no read first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub balance: Balance,
    /// UTC day of the last staking allocation.
    pub diem_epoch: i64,
    /// DIEM per day, when the owner stakes.
    pub stake: Option<i64>,
}

impl Snapshot {
    /// Whether no staking allocation is due on UTC day `day`.
    pub fn is_current(&self, day: i64) -> bool {
        self.stake.is_none() || self.diem_epoch >= day
    }
}

/// What placing a hold did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldOutcome {
    /// Reserved; `before` is the balance before this hold.
    Placed {
        usd: i64,
        diem: i64,
        before: Balance,
    },
    /// The available balance cannot cover `amount`.
    Insufficient { before: Balance },
    /// The key's cap in `currency` (`USD` or `DIEM`) for the period cannot.
    KeyLimitReached {
        before: Balance,
        currency: &'static str,
    },
    /// A hold with this request id exists already (a retry): nothing changed.
    Duplicate,
}

/// What settling a hold did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleOutcome {
    Settled {
        usd: i64,
        diem: i64,
        written_off: i64,
    },
    /// No open hold with this request id (settled or released already).
    NotOpen,
}

/// What a settled request used, for its usage record.
#[derive(Debug, Clone, Copy)]
pub struct UsageDetail<'a> {
    pub model_id: &'a str,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
}

/// One currency's charge for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRecord {
    pub request_id: String,
    pub model_id: String,
    pub currency: String,
    pub amount_nanos: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub at_ms: i64,
}

/// One hold to place.
#[derive(Debug, Clone, Copy)]
pub struct HoldSpec<'a> {
    pub owner: &'a str,
    pub request_id: &'a str,
    /// Nano-units: the most the request can cost.
    pub amount: i64,
    pub expires_at_ms: i64,
    /// The calling key's cap, if it has one.
    pub cap: Option<&'a KeyCap>,
}

/// A key's spending cap, as a hold enforces it.
#[derive(Debug, Clone)]
pub struct KeyCap {
    pub key_id: String,
    /// The period it counts in now: `EPOCH:<UTC day>`, `MONTH:<YYYY-MM>`
    /// or `LIFETIME` ([`period_key`]).
    pub period: String,
    /// None: that currency is not capped.
    pub usd: Option<i64>,
    pub diem: Option<i64>,
}

/// The period key of a limit period (`EPOCH`, `MONTH`, `LIFETIME`) at
/// `now_ms`; None for an unknown period.
pub fn period_key(period: &str, now_ms: i64) -> Option<String> {
    let day = now_ms.div_euclid(86_400_000);
    match period {
        "EPOCH" | "" => Some(format!("EPOCH:{day}")),
        "MONTH" => {
            let date = chrono::DateTime::from_timestamp_millis(now_ms)?;
            Some(format!("MONTH:{}", date.format("%Y-%m")))
        }
        "LIFETIME" => Some("LIFETIME".to_owned()),
        _ => None,
    }
}

/// One change of an owner's USD balance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Movement {
    pub id: String,
    /// The journal kind: `credit`, `settle`, ...
    pub kind: String,
    /// Signed nano-units.
    pub amount: i64,
    pub balance_after: i64,
    pub at_ms: i64,
    pub request_id: Option<String>,
    pub model_id: Option<String>,
}

/// Which usage records to read.
#[derive(Debug, Clone, Copy)]
pub struct HistoryQuery<'a> {
    pub owner: &'a str,
    /// `USD` or `DIEM`; all when None.
    pub currency: Option<&'a str>,
    pub start_ms: i64,
    /// Exclusive.
    pub end_ms: i64,
    pub limit: i64,
    pub offset: i64,
    pub newest_first: bool,
}

#[derive(Debug, Clone)]
pub struct Ledger {
    db: Database,
}

impl Ledger {
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// The owner's balances, after today's staking allocation if it is due.
    pub async fn balance(&self, owner: &str) -> Result<Balance> {
        self.balance_on(owner, today()).await
    }

    /// The balances as of UTC day `day` (days since 1970-01-01): a stake's
    /// allocation for that day is made first if it was not yet.
    pub async fn balance_on(&self, owner: &str, day: i64) -> Result<Balance> {
        Ok(self.snapshot_on(owner, day).await?.balance)
    }

    /// The owner's row, after today's staking allocation if it is due.
    pub async fn snapshot(&self, owner: &str) -> Result<Snapshot> {
        self.snapshot_on(owner, today()).await
    }

    async fn snapshot_on(&self, owner: &str, day: i64) -> Result<Snapshot> {
        let (balance, epoch, stake) = self.read(owner).await?;
        let (balance, epoch) = match stake {
            Some(per_day) if epoch < day => {
                self.allocate(owner, day, per_day).await?;
                let (balance, epoch, _) = self.read(owner).await?;
                (balance, epoch)
            }
            _ => (balance, epoch),
        };
        Ok(Snapshot {
            balance,
            diem_epoch: epoch,
            stake,
        })
    }

    /// Balances, the day of the last allocation, and the stake per day.
    async fn read(&self, owner: &str) -> Result<(Balance, i64, Option<i64>)> {
        let row = sqlx::query(
            "SELECT l.usd_nanos, l.diem_nanos, l.usd_held_nanos, l.diem_held_nanos, \
             l.diem_epoch, s.diem_per_day_nanos \
             FROM ledgers l LEFT JOIN stakes s ON s.owner = l.owner WHERE l.owner = $1",
        )
        .bind(owner)
        .fetch_optional(self.db.pool())
        .await?;
        Ok(match row {
            Some(row) => (
                Balance {
                    usd: row.try_get(0)?,
                    diem: row.try_get(1)?,
                    usd_held: row.try_get(2)?,
                    diem_held: row.try_get(3)?,
                },
                row.try_get(4)?,
                row.try_get(5)?,
            ),
            None => (Balance::default(), 0, None),
        })
    }

    /// Starts `day`'s DIEM epoch: the DIEM balance becomes the stake's daily
    /// allocation (what was left of the day before does not roll over), plus
    /// what open holds still reserve of it. Once per owner and day.
    async fn allocate(&self, owner: &str, day: i64, per_day: i64) -> Result<()> {
        let now = now_ms();
        let mut tx = self.db.pool().begin().await?;
        let claimed = sqlx::query(
            "UPDATE ledgers SET diem_epoch = $2, updated_at_ms = $3 \
             WHERE owner = $1 AND diem_epoch < $2",
        )
        .bind(owner)
        .bind(day)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if claimed.rows_affected() != 1 {
            // Another request started the epoch first.
            tx.rollback().await?;
            return Ok(());
        }
        let row = sqlx::query("SELECT diem_nanos, diem_held_nanos FROM ledgers WHERE owner = $1")
            .bind(owner)
            .fetch_one(&mut *tx)
            .await?;
        let (old, held): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
        let new = per_day.saturating_add(held);
        sqlx::query("UPDATE ledgers SET diem_nanos = $2 WHERE owner = $1")
            .bind(owner)
            .bind(new)
            .execute(&mut *tx)
            .await?;
        insert_journal(
            &mut tx,
            Entry {
                owner,
                kind: "epoch",
                key: &format!("epoch:{owner}:{day}"),
                usd: 0,
                diem: new - old,
                usd_held: 0,
                diem_held: 0,
                written_off: 0,
                request_id: None,
                reference: None,
                at_ms: now,
            },
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Sets the owner's stake: `per_day` DIEM every UTC day from the next
    /// allocation (today's, when it has not been made yet).
    pub async fn set_stake(&self, owner: &str, per_day: i64) -> Result<()> {
        if per_day < 0 {
            return Err(Error::invalid("a stake must not be negative"));
        }
        let now = now_ms();
        let mut tx = self.db.pool().begin().await?;
        sqlx::query(
            "INSERT INTO stakes (owner, diem_per_day_nanos, updated_at_ms) VALUES ($1, $2, $3) \
             ON CONFLICT (owner) DO UPDATE SET diem_per_day_nanos = excluded.diem_per_day_nanos, \
             updated_at_ms = excluded.updated_at_ms",
        )
        .bind(owner)
        .bind(per_day)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO ledgers (owner, updated_at_ms) VALUES ($1, $2) \
             ON CONFLICT (owner) DO NOTHING",
        )
        .bind(owner)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The owner's stake per day, 0 without one.
    pub async fn stake(&self, owner: &str) -> Result<i64> {
        Ok(self.read(owner).await?.2.unwrap_or(0))
    }

    /// Adds credit, once per `reference` of this owner: a repeated
    /// reference changes nothing and answers `false`.
    pub async fn credit(&self, owner: &str, usd: i64, diem: i64, reference: &str) -> Result<bool> {
        self.credit_inner(owner, usd, diem, reference, None).await
    }

    /// Credits a settled x402 payment and marks its claim settled (with the
    /// chain's `transaction`) in the same transaction: a crash leaves either
    /// both or neither. Once per `reference`.
    pub async fn credit_payment(
        &self,
        owner: &str,
        usd: i64,
        reference: &str,
        payment_key: &str,
        transaction: &str,
    ) -> Result<bool> {
        self.credit_inner(owner, usd, 0, reference, Some((payment_key, transaction)))
            .await
    }

    async fn credit_inner(
        &self,
        owner: &str,
        usd: i64,
        diem: i64,
        reference: &str,
        payment: Option<(&str, &str)>,
    ) -> Result<bool> {
        if usd < 0 || diem < 0 {
            return Err(Error::invalid("credits must not be negative"));
        }
        let now = now_ms();
        let mut tx = self.db.pool().begin().await?;
        let journal = insert_journal(
            &mut tx,
            Entry {
                owner,
                kind: "credit",
                key: &format!("credit:{owner}:{reference}"),
                usd,
                diem,
                usd_held: 0,
                diem_held: 0,
                written_off: 0,
                request_id: None,
                reference: Some(reference),
                at_ms: now,
            },
        )
        .await;
        if let Err(error) = journal {
            return if is_unique_violation(&error) {
                Ok(false)
            } else {
                Err(error.into())
            };
        }
        sqlx::query(
            "INSERT INTO ledgers (owner, usd_nanos, diem_nanos, updated_at_ms) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (owner) DO UPDATE SET \
             usd_nanos = ledgers.usd_nanos + excluded.usd_nanos, \
             diem_nanos = ledgers.diem_nanos + excluded.diem_nanos, \
             updated_at_ms = excluded.updated_at_ms",
        )
        .bind(owner)
        .bind(usd)
        .bind(diem)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if let Some((payment_key, transaction)) = payment {
            sqlx::query(
                "UPDATE x402_payments SET state = 'settled', transaction_ref = $2, \
                 settled_at_ms = $3 WHERE payment_key = $1",
            )
            .bind(payment_key)
            .bind(transaction)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Reserves up to `amount` nano-units for `request_id`, DIEM first,
    /// until `expires_at_ms`.
    pub async fn hold(
        &self,
        owner: &str,
        request_id: &str,
        amount: i64,
        expires_at_ms: i64,
    ) -> Result<HoldOutcome> {
        self.hold_for_key(owner, request_id, amount, expires_at_ms, None)
            .await
    }

    /// Like [`hold`](Self::hold), also within the calling key's cap.
    pub async fn hold_for_key(
        &self,
        owner: &str,
        request_id: &str,
        amount: i64,
        expires_at_ms: i64,
        cap: Option<&KeyCap>,
    ) -> Result<HoldOutcome> {
        let hold = HoldSpec {
            owner,
            request_id,
            amount,
            expires_at_ms,
            cap,
        };
        Ok(self.hold_from(&hold, None).await?.0)
    }

    /// Places `hold`, deciding the first time from `known` (a ledger actor's
    /// snapshot) rather than a read: a stale snapshot costs a retry, never
    /// money (the update is conditional), and a refusal is only made on a
    /// fresh read. Also returns the balance after, when the hold wrote.
    pub async fn hold_from(
        &self,
        hold: &HoldSpec<'_>,
        known: Option<Snapshot>,
    ) -> Result<(HoldOutcome, Option<Balance>)> {
        let HoldSpec {
            owner,
            request_id,
            amount,
            expires_at_ms,
            cap,
        } = *hold;
        let mut known = known.filter(|s| s.is_current(today()));
        let amount = amount.max(0);
        if amount == 0 {
            // A free request reserves nothing, and settles to nothing.
            let before = match known {
                Some(snapshot) => snapshot.balance,
                None => self.balance(owner).await?,
            };
            let placed = HoldOutcome::Placed {
                usd: 0,
                diem: 0,
                before,
            };
            return Ok((placed, None));
        }
        // The split is computed from a read; the update only applies if the
        // balance still allows it, else we read again.
        for _ in 0..5 {
            let cached = known.take();
            let before = match cached {
                Some(snapshot) => snapshot.balance,
                None => self.balance(owner).await?,
            };
            // Refusals are decided on a fresh read only.
            let refuse = |outcome: HoldOutcome| {
                if cached.is_some() {
                    None
                } else {
                    Some((outcome, None))
                }
            };
            let (usd_room, diem_room) = match cap {
                Some(cap) => self.key_room(cap).await?,
                None => (i64::MAX, i64::MAX),
            };
            let diem_usable = before.diem_available().max(0);
            let diem = amount.min(diem_usable).min(diem_room.max(0));
            let usd = amount - diem;
            if usd > before.usd_available() {
                // DIEM the key may not spend would have paid: the cap refused.
                let outcome = if amount.min(diem_usable) > diem {
                    HoldOutcome::KeyLimitReached {
                        before,
                        currency: "DIEM",
                    }
                } else {
                    HoldOutcome::Insufficient { before }
                };
                match refuse(outcome) {
                    Some(refused) => return Ok(refused),
                    None => continue,
                }
            }
            if usd > usd_room {
                let outcome = HoldOutcome::KeyLimitReached {
                    before,
                    currency: "USD",
                };
                match refuse(outcome) {
                    Some(refused) => return Ok(refused),
                    None => continue,
                }
            }
            let now = now_ms();
            let mut tx = self.db.pool().begin().await?;
            let reserved = sqlx::query(
                "UPDATE ledgers SET usd_held_nanos = usd_held_nanos + $2, \
                 diem_held_nanos = diem_held_nanos + $3, updated_at_ms = $4 \
                 WHERE owner = $1 AND usd_nanos - usd_held_nanos >= $2 \
                 AND diem_nanos - diem_held_nanos >= $3 \
                 RETURNING usd_nanos, diem_nanos, usd_held_nanos, diem_held_nanos",
            )
            .bind(owner)
            .bind(usd)
            .bind(diem)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(after) = reserved else {
                // Someone else took the balance meanwhile (or the owner has
                // no ledger row yet): decide again on a fresh read.
                tx.rollback().await?;
                if before == Balance::default() && cached.is_none() {
                    return Ok((HoldOutcome::Insufficient { before }, None));
                }
                continue;
            };
            let after = balance_of(&after)?;
            if let Some(cap) = cap
                && !reserve_key_room(&mut tx, cap, usd, diem).await?
            {
                // The key's other requests took the room meanwhile.
                tx.rollback().await?;
                continue;
            }
            let inserted = sqlx::query(
                "INSERT INTO holds (request_id, owner, usd_nanos, diem_nanos, state, \
                 created_at_ms, expires_at_ms, key_id, key_period) \
                 VALUES ($1, $2, $3, $4, 'open', $5, $6, $7, $8)",
            )
            .bind(request_id)
            .bind(owner)
            .bind(usd)
            .bind(diem)
            .bind(now)
            .bind(expires_at_ms)
            .bind(cap.map(|c| c.key_id.as_str()))
            .bind(cap.map(|c| c.period.as_str()))
            .execute(&mut *tx)
            .await;
            if let Err(error) = inserted {
                tx.rollback().await?;
                return if is_unique_violation(&error) {
                    Ok((HoldOutcome::Duplicate, None))
                } else {
                    Err(error.into())
                };
            }
            insert_journal(
                &mut tx,
                Entry {
                    owner,
                    kind: "hold",
                    key: &format!("hold:{request_id}"),
                    usd: 0,
                    diem: 0,
                    usd_held: usd,
                    diem_held: diem,
                    written_off: 0,
                    request_id: Some(request_id),
                    reference: None,
                    at_ms: now,
                },
            )
            .await?;
            tx.commit().await?;
            return Ok((HoldOutcome::Placed { usd, diem, before }, Some(after)));
        }
        Err(Error::new(
            rialto_core::ErrorCode::Unavailable,
            "The balance is changing too fast to place a hold; retry",
        ))
    }

    /// Charges `cost` nano-units against the open hold of `request_id` and
    /// releases the rest. Once only: a second settlement is `NotOpen`.
    pub async fn settle(&self, request_id: &str, cost: i64) -> Result<SettleOutcome> {
        match self
            .close(request_id, "settled", "settle", cost.max(0), None)
            .await?
        {
            SettleOutcome::NotOpen => self.settle_expired(request_id, cost.max(0), None).await,
            settled => Ok(settled),
        }
    }

    /// Like [`settle`](Self::settle), also recording the usage history
    /// (one row per currency that paid) in the same transaction.
    pub async fn settle_usage(
        &self,
        request_id: &str,
        cost: i64,
        usage: &UsageDetail<'_>,
    ) -> Result<SettleOutcome> {
        match self
            .close(request_id, "settled", "settle", cost.max(0), Some(usage))
            .await?
        {
            SettleOutcome::NotOpen => {
                self.settle_expired(request_id, cost.max(0), Some(usage))
                    .await
            }
            settled => Ok(settled),
        }
    }

    /// Settles a hold that expired before its usage arrived: charges what
    /// the balance has available now, DIEM first, at most what the hold
    /// reserved; the rest is written off. Once: the hold becomes settled.
    async fn settle_expired(
        &self,
        request_id: &str,
        cost: i64,
        usage: Option<&UsageDetail<'_>>,
    ) -> Result<SettleOutcome> {
        for _ in 0..5 {
            let now = now_ms();
            let mut tx = self.db.pool().begin().await?;
            let claimed = sqlx::query(
                "UPDATE holds SET state = 'settled' WHERE request_id = $1 AND state = 'expired'",
            )
            .bind(request_id)
            .execute(&mut *tx)
            .await?;
            if claimed.rows_affected() != 1 {
                tx.rollback().await?;
                return Ok(SettleOutcome::NotOpen);
            }
            let row = sqlx::query(
                "SELECT h.owner, h.usd_nanos + h.diem_nanos, \
                 l.usd_nanos - l.usd_held_nanos, l.diem_nanos - l.diem_held_nanos, \
                 h.key_id, h.key_period \
                 FROM holds h JOIN ledgers l ON l.owner = h.owner WHERE h.request_id = $1",
            )
            .bind(request_id)
            .fetch_one(&mut *tx)
            .await?;
            let owner: String = row.try_get(0)?;
            let most: i64 = row.try_get(1)?;
            let (usd_available, diem_available): (i64, i64) = (row.try_get(2)?, row.try_get(3)?);
            let chargeable = cost.min(most);
            let diem = chargeable.min(diem_available.max(0));
            let usd = (chargeable - diem).min(usd_available.max(0));
            let charged = sqlx::query(
                "UPDATE ledgers SET usd_nanos = usd_nanos - $2, diem_nanos = diem_nanos - $3, \
                 updated_at_ms = $4 WHERE owner = $1 \
                 AND usd_nanos - usd_held_nanos >= $2 AND diem_nanos - diem_held_nanos >= $3",
            )
            .bind(&owner)
            .bind(usd)
            .bind(diem)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            if charged.rows_affected() != 1 {
                // The balance moved since the read (PostgreSQL): again.
                tx.rollback().await?;
                continue;
            }
            let written_off = cost - diem - usd;
            if let Some((key_id, period)) = &key_of(&row, 4)? {
                count_key_spend(&mut tx, key_id, period, [usd, diem, 0, 0]).await?;
            }
            insert_journal(
                &mut tx,
                Entry {
                    owner: &owner,
                    kind: "settle",
                    key: &format!("settle:{request_id}"),
                    usd: -usd,
                    diem: -diem,
                    usd_held: 0,
                    diem_held: 0,
                    written_off,
                    request_id: Some(request_id),
                    reference: None,
                    at_ms: now,
                },
            )
            .await?;
            if let Some(usage) = usage {
                insert_usage_records(&mut tx, &owner, request_id, usage, usd, diem, now).await?;
            }
            tx.commit().await?;
            return Ok(SettleOutcome::Settled {
                usd,
                diem,
                written_off,
            });
        }
        Err(Error::new(
            rialto_core::ErrorCode::Unavailable,
            "The balance is changing too fast to settle; retry",
        ))
    }

    /// A page of an owner's usage history and the number of records that
    /// match in all.
    pub async fn usage_history(&self, query: &HistoryQuery<'_>) -> Result<(Vec<UsageRecord>, i64)> {
        let currency = query.currency.unwrap_or("");
        let total: i64 = sqlx::query(
            "SELECT CAST(COUNT(*) AS BIGINT) FROM usage_records WHERE owner = $1 \
             AND ($2 = '' OR currency = $2) AND at_ms >= $3 AND at_ms < $4",
        )
        .bind(query.owner)
        .bind(currency)
        .bind(query.start_ms)
        .bind(query.end_ms)
        .fetch_one(self.db.pool())
        .await?
        .try_get(0)?;
        let sql = if query.newest_first {
            "SELECT request_id, model_id, currency, amount_nanos, prompt_tokens, \
             completion_tokens, at_ms FROM usage_records WHERE owner = $1 \
             AND ($2 = '' OR currency = $2) AND at_ms >= $3 AND at_ms < $4 \
             ORDER BY at_ms DESC, id DESC LIMIT $5 OFFSET $6"
        } else {
            "SELECT request_id, model_id, currency, amount_nanos, prompt_tokens, \
             completion_tokens, at_ms FROM usage_records WHERE owner = $1 \
             AND ($2 = '' OR currency = $2) AND at_ms >= $3 AND at_ms < $4 \
             ORDER BY at_ms ASC, id ASC LIMIT $5 OFFSET $6"
        };
        let rows = sqlx::query(sql)
            .bind(query.owner)
            .bind(currency)
            .bind(query.start_ms)
            .bind(query.end_ms)
            .bind(query.limit)
            .bind(query.offset)
            .fetch_all(self.db.pool())
            .await?;
        let records = rows
            .iter()
            .map(|row| {
                Ok(UsageRecord {
                    request_id: row.try_get(0)?,
                    model_id: row.try_get(1)?,
                    currency: row.try_get(2)?,
                    amount_nanos: row.try_get(3)?,
                    prompt_tokens: row.try_get(4)?,
                    completion_tokens: row.try_get(5)?,
                    at_ms: row.try_get(6)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()?;
        Ok((records, total))
    }

    /// Releases the open hold of `request_id` without charging.
    pub async fn release(&self, request_id: &str) -> Result<SettleOutcome> {
        self.close(request_id, "released", "release", 0, None).await
    }

    /// Releases open holds past their expiry; returns how many.
    pub async fn expire(&self, now_ms: i64) -> Result<usize> {
        let rows = sqlx::query(
            "SELECT request_id FROM holds WHERE state = 'open' AND expires_at_ms <= $1 LIMIT 1000",
        )
        .bind(now_ms)
        .fetch_all(self.db.pool())
        .await?;
        let mut expired = 0;
        for row in rows {
            let request_id: String = row.try_get(0)?;
            if let SettleOutcome::Settled { .. } = self
                .close(&request_id, "expired", "expire", 0, None)
                .await?
            {
                expired += 1;
            }
        }
        Ok(expired)
    }

    async fn close(
        &self,
        request_id: &str,
        state: &'static str,
        kind: &'static str,
        cost: i64,
        usage: Option<&UsageDetail<'_>>,
    ) -> Result<SettleOutcome> {
        Ok(self
            .close_tracked(request_id, state, kind, cost, usage)
            .await?
            .0)
    }

    /// Like `close`, also returning the owner's balance after, when it wrote.
    async fn close_tracked(
        &self,
        request_id: &str,
        state: &'static str,
        kind: &'static str,
        cost: i64,
        usage: Option<&UsageDetail<'_>>,
    ) -> Result<(SettleOutcome, Option<Balance>)> {
        let now = now_ms();
        let mut tx = self.db.pool().begin().await?;
        // Write first: claims the hold, and on SQLite the write lock.
        let claimed = sqlx::query(
            "UPDATE holds SET state = $2 WHERE request_id = $1 AND state = 'open' \
             RETURNING owner, usd_nanos, diem_nanos, key_id, key_period",
        )
        .bind(request_id)
        .bind(state)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(hold) = claimed else {
            tx.rollback().await?;
            return Ok((SettleOutcome::NotOpen, None));
        };
        let owner: String = hold.try_get(0)?;
        let held_usd: i64 = hold.try_get(1)?;
        let held_diem: i64 = hold.try_get(2)?;
        let key = key_of(&hold, 3)?;
        let diem = cost.min(held_diem);
        let usd = (cost - diem).min(held_usd);
        let written_off = cost - diem - usd;
        if let Some((key_id, period)) = &key {
            count_key_spend(&mut tx, key_id, period, [usd, diem, held_usd, held_diem]).await?;
        }
        let after = sqlx::query(
            "UPDATE ledgers SET usd_nanos = usd_nanos - $2, diem_nanos = diem_nanos - $3, \
             usd_held_nanos = usd_held_nanos - $4, diem_held_nanos = diem_held_nanos - $5, \
             updated_at_ms = $6 WHERE owner = $1 \
             RETURNING usd_nanos, diem_nanos, usd_held_nanos, diem_held_nanos",
        )
        .bind(&owner)
        .bind(usd)
        .bind(diem)
        .bind(held_usd)
        .bind(held_diem)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let after = balance_of(&after)?;
        insert_journal(
            &mut tx,
            Entry {
                owner: &owner,
                kind,
                key: &format!("{kind}:{request_id}"),
                usd: -usd,
                diem: -diem,
                usd_held: -held_usd,
                diem_held: -held_diem,
                written_off,
                request_id: Some(request_id),
                reference: None,
                at_ms: now,
            },
        )
        .await?;
        if let Some(usage) = usage {
            insert_usage_records(&mut tx, &owner, request_id, usage, usd, diem, now).await?;
        }
        tx.commit().await?;
        let settled = SettleOutcome::Settled {
            usd,
            diem,
            written_off,
        };
        Ok((settled, Some(after)))
    }

    /// Like [`settle_usage`](Self::settle_usage), also returning the
    /// owner's balance after, when it changed (for a ledger actor's cache).
    pub async fn settle_tracked(
        &self,
        request_id: &str,
        cost: i64,
        usage: &UsageDetail<'_>,
    ) -> Result<(SettleOutcome, Option<Balance>)> {
        match self
            .close_tracked(request_id, "settled", "settle", cost.max(0), Some(usage))
            .await?
        {
            (SettleOutcome::NotOpen, _) => {
                let late = self
                    .settle_expired(request_id, cost.max(0), Some(usage))
                    .await?;
                Ok((late, None))
            }
            settled => Ok(settled),
        }
    }

    /// Room left under a key's cap in its period: (usd, diem), `i64::MAX`
    /// for a currency without a cap.
    async fn key_room(&self, cap: &KeyCap) -> Result<(i64, i64)> {
        let row = sqlx::query(
            "SELECT usd_nanos + usd_held_nanos, diem_nanos + diem_held_nanos FROM key_spend \
             WHERE key_id = $1 AND period = $2",
        )
        .bind(&cap.key_id)
        .bind(&cap.period)
        .fetch_optional(self.db.pool())
        .await?;
        let (usd_used, diem_used) = match row {
            Some(row) => (row.try_get(0)?, row.try_get(1)?),
            None => (0, 0),
        };
        let room = |cap: Option<i64>, used: i64| cap.map_or(i64::MAX, |c| c - used);
        Ok((room(cap.usd, usd_used), room(cap.diem, diem_used)))
    }

    /// What a key was charged in `period` (settled requests): (usd, diem).
    pub async fn key_spent(&self, key_id: &str, period: &str) -> Result<(i64, i64)> {
        let row = sqlx::query(
            "SELECT usd_nanos, diem_nanos FROM key_spend WHERE key_id = $1 AND period = $2",
        )
        .bind(key_id)
        .bind(period)
        .fetch_optional(self.db.pool())
        .await?;
        Ok(match row {
            Some(row) => (row.try_get(0)?, row.try_get(1)?),
            None => (0, 0),
        })
    }

    /// A page of an owner's USD movements, newest first: (entries, more
    /// after them). Each entry's balance after it is the current balance
    /// less every newer movement.
    pub async fn usd_movements(
        &self,
        owner: &str,
        limit: i64,
        offset: i64,
    ) -> Result<(Vec<Movement>, bool)> {
        let current = self.balance(owner).await?.usd;
        let newer: i64 = sqlx::query(
            "SELECT CAST(COALESCE(SUM(usd_nanos), 0) AS BIGINT) FROM (SELECT usd_nanos FROM \
             ledger_journal WHERE owner = $1 AND usd_nanos <> 0 \
             ORDER BY at_ms DESC, id DESC LIMIT $2) newer",
        )
        .bind(owner)
        .bind(offset)
        .fetch_one(self.db.pool())
        .await?
        .try_get(0)?;
        let rows = sqlx::query(
            "SELECT j.id, j.kind, j.usd_nanos, j.at_ms, j.request_id, u.model_id \
             FROM ledger_journal j LEFT JOIN usage_records u \
             ON u.request_id = j.request_id AND u.currency = 'USD' AND j.kind = 'settle' \
             WHERE j.owner = $1 AND j.usd_nanos <> 0 \
             ORDER BY j.at_ms DESC, j.id DESC LIMIT $2 OFFSET $3",
        )
        .bind(owner)
        .bind(limit + 1)
        .bind(offset)
        .fetch_all(self.db.pool())
        .await?;
        let more = rows.len() as i64 > limit;
        let mut after = current - newer;
        let mut movements = Vec::new();
        for row in rows.iter().take(usize::try_from(limit).unwrap_or(0)) {
            let amount: i64 = row.try_get(2)?;
            movements.push(Movement {
                id: row.try_get(0)?,
                kind: row.try_get(1)?,
                amount,
                balance_after: after,
                at_ms: row.try_get(3)?,
                request_id: row.try_get(4)?,
                model_id: row.try_get(5)?,
            });
            after -= amount;
        }
        Ok((movements, more))
    }

    /// What the settlement of `request_id` charged: (usd, diem), zeros when
    /// it was never settled.
    pub async fn charged(&self, request_id: &str) -> Result<(i64, i64)> {
        let row = sqlx::query(
            "SELECT usd_nanos, diem_nanos FROM ledger_journal WHERE idempotency_key = $1",
        )
        .bind(format!("settle:{request_id}"))
        .fetch_optional(self.db.pool())
        .await?;
        Ok(match row {
            Some(row) => (-row.try_get::<i64, _>(0)?, -row.try_get::<i64, _>(1)?),
            None => (0, 0),
        })
    }

    /// The journal's sums for `owner`: (usd, diem, usd_held, diem_held).
    /// They equal the balance at all times (tests reconcile them).
    pub async fn journal_sums(&self, owner: &str) -> Result<Balance> {
        let row = sqlx::query(
            "SELECT CAST(COALESCE(SUM(usd_nanos), 0) AS BIGINT), \
             CAST(COALESCE(SUM(diem_nanos), 0) AS BIGINT), \
             CAST(COALESCE(SUM(usd_held_nanos), 0) AS BIGINT), \
             CAST(COALESCE(SUM(diem_held_nanos), 0) AS BIGINT) \
             FROM ledger_journal WHERE owner = $1",
        )
        .bind(owner)
        .fetch_one(self.db.pool())
        .await?;
        Ok(Balance {
            usd: row.try_get(0)?,
            diem: row.try_get(1)?,
            usd_held: row.try_get(2)?,
            diem_held: row.try_get(3)?,
        })
    }
}

/// Today's UTC day number.
fn today() -> i64 {
    now_ms().div_euclid(86_400_000)
}

struct Entry<'a> {
    owner: &'a str,
    kind: &'a str,
    key: &'a str,
    usd: i64,
    diem: i64,
    usd_held: i64,
    diem_held: i64,
    written_off: i64,
    request_id: Option<&'a str>,
    reference: Option<&'a str>,
    at_ms: i64,
}

async fn insert_journal(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    entry: Entry<'_>,
) -> std::result::Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO ledger_journal (id, owner, kind, idempotency_key, usd_nanos, diem_nanos, \
         usd_held_nanos, diem_held_nanos, written_off_nanos, request_id, reference, at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
    )
    .bind(uuid_like())
    .bind(entry.owner)
    .bind(entry.kind)
    .bind(entry.key)
    .bind(entry.usd)
    .bind(entry.diem)
    .bind(entry.usd_held)
    .bind(entry.diem_held)
    .bind(entry.written_off)
    .bind(entry.request_id)
    .bind(entry.reference)
    .bind(entry.at_ms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A `RETURNING usd_nanos, diem_nanos, usd_held_nanos, diem_held_nanos` row.
fn balance_of(row: &sqlx::any::AnyRow) -> std::result::Result<Balance, sqlx::Error> {
    Ok(Balance {
        usd: row.try_get(0)?,
        diem: row.try_get(1)?,
        usd_held: row.try_get(2)?,
        diem_held: row.try_get(3)?,
    })
}

/// The (key id, period) a hold row counts against, from columns `at` and
/// `at + 1`.
fn key_of(row: &sqlx::any::AnyRow, at: usize) -> Result<Option<(String, String)>> {
    let key_id: Option<String> = row.try_get(at)?;
    let period: Option<String> = row.try_get(at + 1)?;
    Ok(key_id.zip(period))
}

/// Reserves `usd` and `diem` of a key's room in its period, if the cap
/// still allows it (a conditional update: concurrent holds cannot overrun).
async fn reserve_key_room(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    cap: &KeyCap,
    usd: i64,
    diem: i64,
) -> std::result::Result<bool, sqlx::Error> {
    sqlx::query(
        "INSERT INTO key_spend (key_id, period) VALUES ($1, $2) \
         ON CONFLICT (key_id, period) DO NOTHING",
    )
    .bind(&cap.key_id)
    .bind(&cap.period)
    .execute(&mut **tx)
    .await?;
    let reserved = sqlx::query(
        "UPDATE key_spend SET usd_held_nanos = usd_held_nanos + $3, \
         diem_held_nanos = diem_held_nanos + $4 WHERE key_id = $1 AND period = $2 \
         AND ($5 < 0 OR usd_nanos + usd_held_nanos + $3 <= $5) \
         AND ($6 < 0 OR diem_nanos + diem_held_nanos + $4 <= $6)",
    )
    .bind(&cap.key_id)
    .bind(&cap.period)
    .bind(usd)
    .bind(diem)
    .bind(cap.usd.unwrap_or(-1))
    .bind(cap.diem.unwrap_or(-1))
    .execute(&mut **tx)
    .await?;
    Ok(reserved.rows_affected() == 1)
}

/// A closed hold's effect on its key's period: `[usd, diem]` charged,
/// `[held_usd, held_diem]` no longer reserved.
async fn count_key_spend(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    key_id: &str,
    period: &str,
    [usd, diem, held_usd, held_diem]: [i64; 4],
) -> std::result::Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE key_spend SET usd_nanos = usd_nanos + $3, diem_nanos = diem_nanos + $4, \
         usd_held_nanos = usd_held_nanos - $5, diem_held_nanos = diem_held_nanos - $6 \
         WHERE key_id = $1 AND period = $2",
    )
    .bind(key_id)
    .bind(period)
    .bind(usd)
    .bind(diem)
    .bind(held_usd)
    .bind(held_diem)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The usage history rows of one settlement: one per currency that paid.
async fn insert_usage_records(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    owner: &str,
    request_id: &str,
    usage: &UsageDetail<'_>,
    usd: i64,
    diem: i64,
    at_ms: i64,
) -> std::result::Result<(), sqlx::Error> {
    for (currency, amount) in [("DIEM", diem), ("USD", usd)] {
        if amount == 0 {
            continue;
        }
        sqlx::query(
            "INSERT INTO usage_records (id, owner, request_id, model_id, currency, \
             amount_nanos, prompt_tokens, completion_tokens, at_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(uuid_like())
        .bind(owner)
        .bind(request_id)
        .bind(usage.model_id)
        .bind(currency)
        .bind(amount)
        .bind(usage.prompt_tokens)
        .bind(usage.completion_tokens)
        .bind(at_ms)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

pub(crate) fn uuid_like() -> String {
    hex::encode(rialto_core::ids::random_bytes::<16>())
}

fn is_unique_violation(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.is_unique_violation())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NANO: i64 = 1_000_000_000;

    async fn sqlite() -> (tempfile::TempDir, Ledger) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/ledger.db", dir.path().display());
        let db = Database::connect(&url, 8).await.unwrap();
        (dir, Ledger::new(db))
    }

    #[tokio::test]
    async fn credits_are_idempotent_on_their_reference() {
        let (_dir, ledger) = sqlite().await;
        assert!(
            ledger
                .credit("account:a", 10 * NANO, 0, "r1")
                .await
                .unwrap()
        );
        assert!(
            !ledger
                .credit("account:a", 10 * NANO, 0, "r1")
                .await
                .unwrap()
        );
        assert!(ledger.credit("account:a", 0, 2 * NANO, "r2").await.unwrap());
        let balance = ledger.balance("account:a").await.unwrap();
        assert_eq!((balance.usd, balance.diem), (10 * NANO, 2 * NANO));
        assert_eq!(ledger.journal_sums("account:a").await.unwrap(), balance);
    }

    #[tokio::test]
    async fn holds_take_diem_first_and_settle_once() {
        let (_dir, ledger) = sqlite().await;
        ledger
            .credit("account:a", 10 * NANO, NANO, "seed")
            .await
            .unwrap();
        let placed = ledger
            .hold("account:a", "req", 3 * NANO, i64::MAX)
            .await
            .unwrap();
        assert!(
            matches!(placed, HoldOutcome::Placed { usd, diem, .. } if usd == 2 * NANO && diem == NANO)
        );
        assert_eq!(
            ledger
                .hold("account:a", "req", NANO, i64::MAX)
                .await
                .unwrap(),
            HoldOutcome::Duplicate
        );
        // The request cost 1.5: 1 DIEM, then 0.5 USD; the rest is released.
        let settled = ledger.settle("req", 3 * NANO / 2).await.unwrap();
        assert_eq!(
            settled,
            SettleOutcome::Settled {
                usd: NANO / 2,
                diem: NANO,
                written_off: 0
            }
        );
        assert_eq!(
            ledger.settle("req", 3 * NANO / 2).await.unwrap(),
            SettleOutcome::NotOpen
        );
        let balance = ledger.balance("account:a").await.unwrap();
        assert_eq!(
            balance,
            Balance {
                usd: 9 * NANO + NANO / 2,
                diem: 0,
                usd_held: 0,
                diem_held: 0
            }
        );
        assert_eq!(ledger.journal_sums("account:a").await.unwrap(), balance);
    }

    #[tokio::test]
    async fn a_cost_above_the_hold_is_written_off_not_overdrawn() {
        let (_dir, ledger) = sqlite().await;
        ledger.credit("account:a", NANO, 0, "seed").await.unwrap();
        ledger
            .hold("account:a", "req", NANO, i64::MAX)
            .await
            .unwrap();
        let settled = ledger.settle("req", 2 * NANO).await.unwrap();
        assert_eq!(
            settled,
            SettleOutcome::Settled {
                usd: NANO,
                diem: 0,
                written_off: NANO
            }
        );
        assert_eq!(
            ledger.balance("account:a").await.unwrap(),
            Balance::default()
        );
    }

    #[tokio::test]
    async fn nothing_is_held_for_an_owner_without_credit() {
        let (_dir, ledger) = sqlite().await;
        let outcome = ledger
            .hold("account:none", "req", 1, i64::MAX)
            .await
            .unwrap();
        assert!(matches!(outcome, HoldOutcome::Insufficient { .. }));
    }

    #[tokio::test]
    async fn free_requests_hold_nothing() {
        let (_dir, ledger) = sqlite().await;
        let outcome = ledger
            .hold("account:none", "req", 0, i64::MAX)
            .await
            .unwrap();
        assert!(matches!(
            outcome,
            HoldOutcome::Placed {
                usd: 0,
                diem: 0,
                ..
            }
        ));
        assert_eq!(
            ledger.settle("req", 0).await.unwrap(),
            SettleOutcome::NotOpen
        );
    }

    #[tokio::test]
    async fn a_stake_grants_diem_each_day_without_roll_over() {
        let (_dir, ledger) = sqlite().await;
        let owner = "account:staker";
        ledger.set_stake(owner, 25 * NANO).await.unwrap();
        // Days ahead of the real clock, so holds (which read today) do not
        // start epochs of their own.
        let day = today() + 1;
        let first = ledger.balance_on(owner, day).await.unwrap();
        assert_eq!(first.diem, 25 * NANO);
        // Spend 10 of today's 25.
        ledger.hold(owner, "r1", 10 * NANO, i64::MAX).await.unwrap();
        ledger.settle("r1", 10 * NANO).await.unwrap();
        assert_eq!(ledger.balance_on(owner, day).await.unwrap().diem, 15 * NANO);
        // A hold open across midnight keeps its reservation.
        ledger.hold(owner, "r2", 5 * NANO, i64::MAX).await.unwrap();
        // The next day: 25 again, not 25 + 15 (no roll-over), plus the
        // 5 still held; the epoch starts once however often it is read.
        let next = ledger.balance_on(owner, day + 1).await.unwrap();
        assert_eq!((next.diem, next.diem_held), (30 * NANO, 5 * NANO));
        assert_eq!(ledger.balance_on(owner, day + 1).await.unwrap(), next);
        ledger.settle("r2", 5 * NANO).await.unwrap();
        let settled = ledger.balance_on(owner, day + 1).await.unwrap();
        assert_eq!((settled.diem, settled.diem_held), (25 * NANO, 0));
        assert_eq!(ledger.journal_sums(owner).await.unwrap(), settled);
    }

    #[tokio::test]
    async fn expired_holds_are_released() {
        let (_dir, ledger) = sqlite().await;
        ledger.credit("account:a", NANO, 0, "seed").await.unwrap();
        ledger.hold("account:a", "req", NANO, 1_000).await.unwrap();
        assert_eq!(
            ledger.balance("account:a").await.unwrap().usd_available(),
            0
        );
        assert_eq!(ledger.expire(999).await.unwrap(), 0);
        assert_eq!(ledger.expire(1_000).await.unwrap(), 1);
        assert_eq!(
            ledger.balance("account:a").await.unwrap().usd_available(),
            NANO
        );
        // Its usage arrives late (the durable queue, after a crash): the
        // expired hold is settled once, from what is available now.
        ledger
            .credit("account:a", 0, NANO / 4, "diem")
            .await
            .unwrap();
        assert_eq!(
            ledger.settle("req", NANO / 2).await.unwrap(),
            SettleOutcome::Settled {
                usd: NANO / 4,
                diem: NANO / 4,
                written_off: 0
            }
        );
        assert_eq!(
            ledger.settle("req", NANO / 2).await.unwrap(),
            SettleOutcome::NotOpen
        );
        let balance = ledger.balance("account:a").await.unwrap();
        assert_eq!((balance.usd, balance.diem), (3 * NANO / 4, 0));
        assert_eq!(ledger.journal_sums("account:a").await.unwrap(), balance);
        // Never more than the balance has: the rest is written off.
        ledger
            .hold("account:a", "big", NANO / 2, 1_000)
            .await
            .unwrap();
        assert_eq!(ledger.expire(1_000).await.unwrap(), 1);
        ledger
            .hold("account:a", "other", NANO / 2, i64::MAX)
            .await
            .unwrap();
        assert_eq!(
            ledger.settle("big", NANO / 2).await.unwrap(),
            SettleOutcome::Settled {
                usd: NANO / 4,
                diem: 0,
                written_off: NANO / 4
            }
        );
        let balance = ledger.balance("account:a").await.unwrap();
        assert_eq!((balance.usd, balance.usd_held), (NANO / 2, NANO / 2));
        assert_eq!(ledger.journal_sums("account:a").await.unwrap(), balance);
    }

    /// A balance that covers exactly 10 holds, 1,000 concurrent requests:
    /// 10 are placed, the balance never goes below zero, the journal
    /// reconciles.
    async fn exactly_ten_of_a_thousand(ledger: Ledger) {
        ledger
            .credit("account:race", 10 * NANO, 0, "seed")
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for i in 0..1000 {
            let ledger = ledger.clone();
            tasks.push(tokio::spawn(async move {
                ledger
                    .hold("account:race", &format!("r{i}"), NANO, i64::MAX)
                    .await
                    .unwrap()
            }));
        }
        let mut placed = Vec::new();
        for (i, task) in tasks.into_iter().enumerate() {
            if let HoldOutcome::Placed { .. } = task.await.unwrap() {
                placed.push(i);
            }
        }
        assert_eq!(placed.len(), 10);
        let mut settles = Vec::new();
        for i in placed {
            let ledger = ledger.clone();
            // Each settled twice at once: charged once.
            for _ in 0..2 {
                let ledger = ledger.clone();
                settles.push(tokio::spawn(async move {
                    let usage = UsageDetail {
                        model_id: "m",
                        prompt_tokens: 1,
                        completion_tokens: 2,
                    };
                    ledger
                        .settle_usage(&format!("r{i}"), NANO, &usage)
                        .await
                        .unwrap()
                }));
            }
        }
        let mut settled = 0;
        for task in settles {
            if let SettleOutcome::Settled { .. } = task.await.unwrap() {
                settled += 1;
            }
        }
        assert_eq!(settled, 10);
        let balance = ledger.balance("account:race").await.unwrap();
        assert_eq!(balance, Balance::default());
        assert_eq!(ledger.journal_sums("account:race").await.unwrap(), balance);
        // One usage record per settled request, none for the duplicates.
        let query = |currency| HistoryQuery {
            owner: "account:race",
            currency,
            start_ms: 0,
            end_ms: i64::MAX,
            limit: 4,
            offset: 8,
            newest_first: true,
        };
        let (page, total) = ledger.usage_history(&query(Some("USD"))).await.unwrap();
        assert_eq!((page.len(), total), (2, 10));
        assert_eq!(page[0].amount_nanos, NANO);
        let (_, diem) = ledger.usage_history(&query(Some("DIEM"))).await.unwrap();
        assert_eq!(diem, 0);
    }

    /// A key capped at 1 DIEM and 3 USD a day, 100 concurrent requests of 1
    /// each: 4 placed (DIEM first), the rest refused by the cap though the
    /// balance could pay; settlements count in the period; the next period
    /// starts afresh.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_cap_holds_under_concurrency_and_per_period() {
        let (_dir, ledger) = sqlite().await;
        ledger
            .credit("account:k", 100 * NANO, 2 * NANO, "seed")
            .await
            .unwrap();
        let cap = |period: &str| KeyCap {
            key_id: "key-1".into(),
            period: period.into(),
            usd: Some(3 * NANO),
            diem: Some(NANO),
        };
        let mut tasks = Vec::new();
        for i in 0..100 {
            let ledger = ledger.clone();
            let cap = cap("EPOCH:1");
            tasks.push(tokio::spawn(async move {
                let id = format!("k{i}");
                let outcome = ledger
                    .hold_for_key("account:k", &id, NANO, i64::MAX, Some(&cap))
                    .await
                    .unwrap();
                (id, outcome)
            }));
        }
        let (mut placed, mut usd_refusals) = (Vec::new(), 0);
        for task in tasks {
            match task.await.unwrap() {
                (id, HoldOutcome::Placed { usd, diem, .. }) => placed.push((id, usd, diem)),
                (_, HoldOutcome::KeyLimitReached { currency, .. }) => {
                    assert_eq!(currency, "USD");
                    usd_refusals += 1;
                }
                (_, other) => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!((placed.len(), usd_refusals), (4, 96));
        let diem_held: i64 = placed.iter().map(|(_, _, diem)| diem).sum();
        assert_eq!(diem_held, NANO);
        for (id, _, _) in &placed {
            ledger.settle(id, NANO / 2).await.unwrap();
        }
        // Half of each hold charged: 0.5 DIEM and 1.5 USD this period.
        assert_eq!(
            ledger.key_spent("key-1", "EPOCH:1").await.unwrap(),
            (3 * NANO / 2, NANO / 2)
        );
        // 1.5 USD of room left: a hold of 2 takes 0.5 DIEM and 1.5 USD.
        let next = ledger
            .hold_for_key("account:k", "n1", 2 * NANO, i64::MAX, Some(&cap("EPOCH:1")))
            .await
            .unwrap();
        assert!(
            matches!(next, HoldOutcome::Placed { usd, diem, .. } if usd == 3 * NANO / 2 && diem == NANO / 2),
            "{next:?}"
        );
        ledger.release("n1").await.unwrap();
        // A new period: the cap's whole room again.
        let fresh = ledger
            .hold_for_key("account:k", "n2", 4 * NANO, i64::MAX, Some(&cap("EPOCH:2")))
            .await
            .unwrap();
        assert!(matches!(fresh, HoldOutcome::Placed { .. }), "{fresh:?}");
        let balance = ledger.balance("account:k").await.unwrap();
        assert_eq!(ledger.journal_sums("account:k").await.unwrap(), balance);
        assert_eq!(period_key("MONTH", 0).unwrap(), "MONTH:1970-01");
        assert_eq!(period_key("EPOCH", 86_400_000).unwrap(), "EPOCH:1");
        assert!(period_key("WEEK", 0).is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn exactly_ten_of_a_thousand_on_sqlite() {
        let (_dir, ledger) = sqlite().await;
        exactly_ten_of_a_thousand(ledger).await;
    }

    /// On the PostgreSQL server of the machine (`E2E_POSTGRES_URL`), in a
    /// database of its own, dropped afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn exactly_ten_of_a_thousand_on_postgres() {
        let server = std::env::var("E2E_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let name = format!("rialto_ledger_{}", uuid_like());
        let admin = |sql: String| {
            let server = server.clone();
            async move {
                use sqlx::Connection;
                let mut conn = sqlx::postgres::PgConnection::connect(&format!("{server}/postgres"))
                    .await
                    .unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut conn)
                    .await
                    .unwrap();
                conn.close().await.unwrap();
            }
        };
        admin(format!("CREATE DATABASE {name}")).await;
        let db = Database::connect(&format!("{server}/{name}"), 8)
            .await
            .unwrap();
        exactly_ten_of_a_thousand(Ledger::new(db.clone())).await;
        db.pool().close().await;
        admin(format!("DROP DATABASE {name} WITH (FORCE)")).await;
    }
}
