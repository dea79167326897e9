//! The ledger's database side, read and credited directly: balances,
//! usage history, movements, key spend and journal sums, and the writes
//! that do not go through an owner in memory (credits, x402 payments,
//! stakes). Holds and settlements are decided in memory by
//! [`book`](crate::book) and written by [`writer`](crate::writer).
//!
//! Owners are `account:<id>` or `wallet:<address>`. Amounts are integer
//! nano-units (1e-9 USD or DIEM; 1 DIEM is worth 1 USD of credit). Every
//! change appends a journal row with an idempotency key
//! (`credit:<owner>:<reference>`, `hold:<request id>`, `settle:<request
//! id>`, `epoch:<owner>:<day>`): repeating it changes nothing, and the
//! journal's sums equal the balances. The CHECKs on `ledgers` refuse any
//! balance below zero and any hold above it: the last guard, whatever a
//! replica believes.
//!
//! A credit is one transaction that adds to the balance (a delta, so it
//! commutes with the writer's batches) and journals it; an owner in memory
//! picks it up by a refresh ([`Book::refresh_now`](crate::book::Book::refresh_now)).

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
    /// What settlements could not charge: the next request must cover it
    /// on top of its own hold, and its settlement pays it first.
    pub owed: i64,
}

impl Balance {
    pub fn usd_available(&self) -> i64 {
        self.usd - self.usd_held
    }

    pub fn diem_available(&self) -> i64 {
        self.diem - self.diem_held
    }

    /// USD as the owner sees it: the balance less what is owed (below zero
    /// when the debt is larger).
    pub fn usd_net(&self) -> i64 {
        self.usd.saturating_sub(self.owed)
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

/// What the journal says of one request's settlement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Charged in all, nano-units.
    pub usd: i64,
    pub diem: i64,
    /// Closed by its hold's expiry at the checkpoint, the rest of its cost
    /// not charged yet.
    pub expired: bool,
}

/// What settling a hold did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleOutcome {
    Settled {
        usd: i64,
        diem: i64,
        /// What the owner owes after it: the part of this cost (and of
        /// earlier debt) the balance and the key's cap could not cover.
        owed: i64,
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
    /// The journal row's id.
    pub id: String,
    pub request_id: String,
    pub model_id: String,
    pub currency: String,
    pub amount_nanos: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub at_ms: i64,
}

/// One row of [`Ledger::usage_groups`].
#[derive(Debug, Clone)]
pub struct UsageGroup {
    pub day: i64,
    pub model_id: String,
    /// "" when no API key made the requests.
    pub key_id: String,
    /// Charged in each currency.
    pub usd_nanos: i64,
    pub diem_nanos: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub requests: i64,
}

/// One x402 payment, as [`Ledger::top_ups`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopUpRecord {
    pub id: String,
    pub wallet: String,
    pub network: String,
    pub amount_nanos: i64,
    /// `settling`, `settled` or `failed`.
    pub state: String,
    /// The chain's transaction, once settled.
    pub transaction_ref: Option<String>,
    pub created_at_ms: i64,
    pub settled_at_ms: Option<i64>,
}

fn usage_record(row: &sqlx::any::AnyRow) -> std::result::Result<UsageRecord, sqlx::Error> {
    Ok(UsageRecord {
        request_id: row.try_get(0)?,
        model_id: row.try_get(1)?,
        currency: row.try_get(2)?,
        amount_nanos: row.try_get(3)?,
        prompt_tokens: row.try_get(4)?,
        completion_tokens: row.try_get(5)?,
        at_ms: row.try_get(6)?,
        id: row.try_get(7)?,
    })
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

    /// The balances as of UTC day `day` (days since 1970-01-01): when a
    /// stake's allocation for that day is due, the DIEM balance it will
    /// set (the allocation plus what durable holds reserve). A read: the
    /// allocation itself is made by the owner's first hold of the day.
    pub async fn balance_on(&self, owner: &str, day: i64) -> Result<Balance> {
        Ok(self.snapshot_on(owner, day).await?.balance)
    }

    /// The owner's row, as of today (see [`balance_on`](Self::balance_on)).
    pub async fn snapshot(&self, owner: &str) -> Result<Snapshot> {
        self.snapshot_on(owner, today()).await
    }

    async fn snapshot_on(&self, owner: &str, day: i64) -> Result<Snapshot> {
        let (mut balance, epoch, stake) = self.read(owner).await?;
        let epoch = match stake {
            Some(per_day) if epoch < day => {
                balance.diem = per_day.saturating_add(balance.diem_held);
                day
            }
            _ => epoch,
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
             l.diem_epoch, s.diem_per_day_nanos, l.owed_nanos \
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
                    owed: row.try_get(6)?,
                },
                row.try_get(4)?,
                row.try_get(5)?,
            ),
            None => (Balance::default(), 0, None),
        })
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
             completion_tokens, at_ms, id FROM usage_records WHERE owner = $1 \
             AND ($2 = '' OR currency = $2) AND at_ms >= $3 AND at_ms < $4 \
             ORDER BY at_ms DESC, id DESC, currency DESC LIMIT $5 OFFSET $6"
        } else {
            "SELECT request_id, model_id, currency, amount_nanos, prompt_tokens, \
             completion_tokens, at_ms, id FROM usage_records WHERE owner = $1 \
             AND ($2 = '' OR currency = $2) AND at_ms >= $3 AND at_ms < $4 \
             ORDER BY at_ms ASC, id ASC, currency ASC LIMIT $5 OFFSET $6"
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
            .map(usage_record)
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()?;
        Ok((records, total))
    }

    /// The usage records of up to `limit` settlements of `owner` in
    /// [start_ms, end_ms), in ascending (at_ms, id) order, after the
    /// settlement `after` names (none: from the start); one record per
    /// currency that paid (DIEM first), at most `limit` of them (a page ends
    /// on a whole settlement), and whether settlements follow. A keyset walk of the journal itself on its (owner,
    /// at_ms) index: each page costs the same however deep it is, where an
    /// offset (or the `usage_records` view, a union the planner cannot walk
    /// in order) reads every row before it. Measured on PostgreSQL with 10
    /// million settlements: about 1 ms a page of 1,000 (BENCHMARKS.md).
    pub async fn usage_walk(
        &self,
        query: &HistoryQuery<'_>,
        after: Option<(i64, &str)>,
    ) -> Result<(Vec<UsageRecord>, bool)> {
        let (after_ms, after_id) = after.unwrap_or((i64::MIN, ""));
        let rows = sqlx::query(
            "SELECT request_id, model_id, usd_nanos, diem_nanos, prompt_tokens, \
             completion_tokens, at_ms, id FROM ledger_journal WHERE owner = $1 \
             AND kind IN ('settle', 'expire') \
             AND (($2 = '' AND (usd_nanos <> 0 OR diem_nanos <> 0)) \
             OR ($2 = 'USD' AND usd_nanos <> 0) OR ($2 = 'DIEM' AND diem_nanos <> 0)) \
             AND at_ms >= $3 AND at_ms < $4 AND at_ms >= $5 AND (at_ms > $5 OR id > $6) \
             ORDER BY at_ms, id LIMIT $7",
        )
        .bind(query.owner)
        .bind(query.currency.unwrap_or(""))
        .bind(query.start_ms)
        .bind(query.end_ms)
        .bind(after_ms)
        .bind(after_id)
        .bind(query.limit + 1)
        .fetch_all(self.db.pool())
        .await?;
        let mut records = Vec::new();
        let mut taken = 0;
        for row in &rows {
            let (usd, diem): (i64, i64) = (row.try_get(2)?, row.try_get(3)?);
            let paid: Vec<(&str, i64)> = [("DIEM", diem), ("USD", usd)]
                .into_iter()
                .filter(|(currency, nanos)| {
                    *nanos != 0 && query.currency.is_none_or(|wanted| wanted == *currency)
                })
                .collect();
            if taken > 0 && records.len() + paid.len() > query.limit as usize {
                break;
            }
            for (currency, nanos) in paid {
                records.push(UsageRecord {
                    request_id: row.try_get::<Option<String>, _>(0)?.unwrap_or_default(),
                    model_id: row.try_get::<Option<String>, _>(1)?.unwrap_or_default(),
                    currency: currency.to_owned(),
                    amount_nanos: -nanos,
                    prompt_tokens: row.try_get(4)?,
                    completion_tokens: row.try_get(5)?,
                    at_ms: row.try_get(6)?,
                    id: row.try_get(7)?,
                });
            }
            taken += 1;
        }
        Ok((records, taken < rows.len()))
    }

    /// `owner`'s spend in [start_ms, end_ms), summed by UTC day, model, API
    /// key and currency, in nano-units; every owner's summed when `owner`
    /// is None (an operator's view).
    pub async fn usage_groups(
        &self,
        owner: Option<&str>,
        start_ms: i64,
        end_ms: i64,
    ) -> Result<Vec<UsageGroup>> {
        // The journal itself, not the `usage_records` view: one pass over
        // the owner's range instead of one per currency. Every owner's has
        // no index to narrow it (the journal's is on (owner, at_ms)): it
        // reads the whole range, which its caller keeps short.
        let by_owner = if owner.is_some() {
            "owner = $3 AND "
        } else {
            ""
        };
        let sql = format!(
            "SELECT at_ms / 86400000 AS day, COALESCE(model_id, '') AS model_id, \
             COALESCE(key_id, '') AS key_id, \
             CAST(SUM(-usd_nanos) AS BIGINT) AS usd, CAST(SUM(-diem_nanos) AS BIGINT) AS diem, \
             CAST(SUM(prompt_tokens) AS BIGINT) AS prompt, \
             CAST(SUM(completion_tokens) AS BIGINT) AS completion, \
             CAST(COUNT(*) AS BIGINT) AS requests \
             FROM ledger_journal WHERE {by_owner}kind IN ('settle', 'expire') \
             AND (usd_nanos <> 0 OR diem_nanos <> 0) AND at_ms >= $1 AND at_ms < $2 \
             GROUP BY at_ms / 86400000, COALESCE(model_id, ''), COALESCE(key_id, '')"
        );
        // Safe: the only part that varies is one of two constant fragments.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(start_ms)
            .bind(end_ms);
        if let Some(owner) = owner {
            query = query.bind(owner);
        }
        let rows = query.fetch_all(self.db.pool()).await?;
        Ok(rows
            .iter()
            .map(|row| {
                Ok(UsageGroup {
                    day: row.try_get("day")?,
                    model_id: row.try_get("model_id")?,
                    key_id: row.try_get("key_id")?,
                    usd_nanos: row.try_get("usd")?,
                    diem_nanos: row.try_get("diem")?,
                    prompt_tokens: row.try_get("prompt")?,
                    completion_tokens: row.try_get("completion")?,
                    requests: row.try_get("requests")?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()?)
    }

    /// A page of the x402 payments received, every wallet's, newest first,
    /// and how many there are in all. One row per top-up: a small table,
    /// read whole to sort it (its index is per wallet).
    pub async fn top_ups(&self, limit: i64, offset: i64) -> Result<(Vec<TopUpRecord>, i64)> {
        let total: i64 = sqlx::query("SELECT CAST(COUNT(*) AS BIGINT) FROM x402_payments")
            .fetch_one(self.db.pool())
            .await?
            .try_get(0)?;
        let rows = sqlx::query(
            "SELECT id, wallet, network, amount_nanos, state, transaction_ref, created_at_ms, \
             settled_at_ms FROM x402_payments ORDER BY created_at_ms DESC, id DESC \
             LIMIT $1 OFFSET $2",
        )
        .bind(limit)
        .bind(offset)
        .fetch_all(self.db.pool())
        .await?;
        let records = rows
            .iter()
            .map(|row| {
                Ok(TopUpRecord {
                    id: row.try_get(0)?,
                    wallet: row.try_get(1)?,
                    network: row.try_get(2)?,
                    amount_nanos: row.try_get(3)?,
                    state: row.try_get(4)?,
                    transaction_ref: row.try_get(5)?,
                    created_at_ms: row.try_get(6)?,
                    settled_at_ms: row.try_get(7)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()?;
        Ok((records, total))
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
            "SELECT id, kind, usd_nanos, at_ms, request_id, model_id FROM ledger_journal \
             WHERE owner = $1 AND usd_nanos <> 0 \
             ORDER BY at_ms DESC, id DESC LIMIT $2 OFFSET $3",
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
        let settled = self.settled(request_id).await?;
        Ok((settled.usd, settled.diem))
    }

    /// How request `request_id` was settled: what it was charged (its
    /// settlement, or its expiry and the rest after it), and whether an
    /// expiry closed it with no rest charged yet.
    pub async fn settled(&self, request_id: &str) -> Result<Settled> {
        let rows = sqlx::query(
            "SELECT idempotency_key, kind, usd_nanos, diem_nanos FROM ledger_journal \
             WHERE idempotency_key IN ($1, $2)",
        )
        .bind(format!("settle:{request_id}"))
        .bind(format!("settle-rest:{request_id}"))
        .fetch_all(self.db.pool())
        .await?;
        let mut settled = Settled::default();
        let mut rest = false;
        for row in rows {
            let key: String = row.try_get(0)?;
            let kind: String = row.try_get(1)?;
            settled.usd -= row.try_get::<i64, _>(2)?;
            settled.diem -= row.try_get::<i64, _>(3)?;
            rest |= key.starts_with("settle-rest:");
            settled.expired |= kind == "expire";
        }
        settled.expired &= !rest;
        Ok(settled)
    }

    /// The journal's sums for `owner`: (usd, diem, usd_held, diem_held,
    /// owed). They equal the balance at all times (tests reconcile them).
    pub async fn journal_sums(&self, owner: &str) -> Result<Balance> {
        let row = sqlx::query(
            "SELECT CAST(COALESCE(SUM(usd_nanos), 0) AS BIGINT), \
             CAST(COALESCE(SUM(diem_nanos), 0) AS BIGINT), \
             CAST(COALESCE(SUM(usd_held_nanos), 0) AS BIGINT), \
             CAST(COALESCE(SUM(diem_held_nanos), 0) AS BIGINT), \
             CAST(COALESCE(SUM(owed_nanos), 0) AS BIGINT) \
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
            owed: row.try_get(4)?,
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
    .bind(rialto_core::ids::row_id())
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
}
