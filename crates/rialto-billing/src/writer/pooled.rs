//! The writer on PostgreSQL: a task over a connection of the sqlx pool,
//! with multi-row statements (one round trip per 64 rows).

use std::collections::HashSet;
use std::sync::Arc;

use rialto_core::db::{Database, now_ms};
use rialto_core::{Error, Result};
use sqlx::Row;
use sqlx::pool::PoolConnection;
use tokio::sync::mpsc;

use super::{
    ATTEMPTS, BatchError, BatchResult, Claim, HOLD_COLUMNS, HoldUpdate, Job, Loaded, Loading,
    MAX_BATCH, Next, Refreshed, Sorted, Stats, WriteJob, Written, after_attempt, backoff, give_up,
    hold_writes, journal_rows, journal_values, key_sums, loaded_hold, observe, owner_sums,
    refresh_owners,
};
use crate::ledger::Balance;

/// Most rows in one multi-row statement.
const ROWS_PER_STATEMENT: usize = 64;

type Connection = PoolConnection<sqlx::Any>;

impl From<sqlx::Error> for BatchError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error.into())
    }
}

pub(super) async fn run(db: Database, mut queue: mpsc::UnboundedReceiver<Job>, stats: Arc<Stats>) {
    let mut connection: Option<Connection> = None;
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    loop {
        if queue.recv_many(&mut jobs, MAX_BATCH).await == 0 {
            return;
        }
        let Sorted {
            writes,
            loads,
            releases,
            flushes,
            // PostgreSQL has no log: nothing is held back.
            flushed: _,
            checkpoint: _,
        } = Sorted::new(jobs.drain(..));
        if !writes.is_empty() {
            let written = observe(&stats, writes.len());
            commit(&db, &mut connection, writes).await;
            written();
        }
        // After the writes: the owners let go had every record of theirs
        // written, and a load sees every write queued before it.
        if !releases.is_empty() {
            let released = match connect(&db, &mut connection).await {
                Ok(conn) => release(conn, &releases).await,
                Err(error) => Err(error),
            };
            if let Err(error) = released {
                // Still held: the next replica asked for one of them sends
                // the call here, and this replica's load lets it go then.
                tracing::warn!(%error, owners = releases.len(), "cannot let ledger owners go");
                if let Some(conn) = connection.take() {
                    let _ = conn.close().await;
                }
            }
        }
        for (owner, Loading { claim, done }) in loads {
            let loaded = match connect(&db, &mut connection).await {
                Ok(conn) => load(conn, &owner, claim.as_ref()).await,
                Err(error) => Err(error),
            };
            // Refused (another replica keeps it) is an answer, not a failure.
            if let Err(error) = &loaded
                && super::kept_elsewhere(error).is_none()
            {
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
    connection: &'c mut Option<Connection>,
) -> Result<&'c mut Connection> {
    if connection.is_none() {
        *connection = Some(db.pool().acquire().await?);
    }
    connection
        .as_mut()
        .ok_or_else(|| Error::internal("no writer connection"))
}

/// Writes `jobs` in one transaction, or as many as can be.
async fn commit(db: &Database, connection: &mut Option<Connection>, mut jobs: Vec<WriteJob>) {
    for attempt in 0..ATTEMPTS {
        let result = match connect(db, connection).await {
            Ok(conn) => write_batch(conn, &jobs).await,
            Err(error) => Err(BatchError::Database(error)),
        };
        match after_attempt(jobs, result, attempt, false) {
            Next::Done { .. } => return,
            Next::Again {
                jobs: again,
                failed,
                ..
            } => {
                if failed {
                    if let Some(conn) = connection.take() {
                        let _ = conn.close().await;
                    }
                    if again.len() > 1 {
                        for job in again {
                            Box::pin(commit(db, connection, vec![job])).await;
                        }
                        return;
                    }
                    tokio::time::sleep(backoff(attempt)).await;
                }
                jobs = again;
            }
        }
    }
    give_up(jobs);
}

/// Placeholders for `rows` rows of `columns` parameters: `($1, $2), ($3,
/// $4)`. The only text the writer puts into its SQL (hence
/// `AssertSqlSafe`).
fn values(rows: usize, columns: usize) -> String {
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
            sql.push('$');
            sql.push_str(&(row * columns + column + 1).to_string());
        }
        sql.push(')');
    }
    sql
}

pub(super) async fn write_batch(conn: &mut Connection, jobs: &[WriteJob]) -> BatchResult {
    let now = now_ms();
    let mut tx = sqlx::Connection::begin(&mut **conn).await?;

    // 1. The journal: what applies (a replay's key exists already).
    let journaled = journal_rows(jobs);
    let mut inserted: HashSet<String> = HashSet::with_capacity(journaled.len());
    for chunk in journaled.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "INSERT INTO ledger_journal (id, owner, kind, idempotency_key, usd_nanos, \
             diem_nanos, usd_held_nanos, diem_held_nanos, owed_nanos, request_id, \
             reference, model_id, prompt_tokens, completion_tokens, at_ms, key_id) VALUES {} \
             ON CONFLICT (idempotency_key) DO NOTHING RETURNING idempotency_key",
            values(chunk.len(), 16)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (i, key, kind) in chunk {
            let record = &jobs[*i].record;
            let row = journal_values(record);
            let [usd, diem, usd_held, diem_held, owed] = row.effects;
            query = query
                .bind(row.id)
                .bind(&*record.owner.name)
                .bind(*kind)
                .bind(key.as_str())
                .bind(usd)
                .bind(diem)
                .bind(usd_held)
                .bind(diem_held)
                .bind(owed)
                .bind(row.request_id)
                .bind(None::<&str>)
                .bind(row.model_id)
                .bind(row.tokens.0)
                .bind(row.tokens.1)
                .bind(record.at_ms(now))
                .bind(row.key_id);
        }
        for row in query.fetch_all(&mut *tx).await? {
            inserted.insert(row.try_get(0)?);
        }
    }
    let written = duplicates(jobs.len(), &journaled, inserted);

    // 2. Each owner's balances, under its fence.
    let owners: Vec<_> = owner_sums(jobs, &written).into_iter().collect();
    let mut fenced: HashSet<(Arc<str>, i64)> = HashSet::new();
    // One statement per 64 owners: the owners it did not update lost their
    // fence.
    for chunk in owners.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "UPDATE ledgers l SET usd_nanos = l.usd_nanos + v.usd, \
             diem_nanos = l.diem_nanos + v.diem, \
             usd_held_nanos = l.usd_held_nanos + v.usd_held, \
             diem_held_nanos = l.diem_held_nanos + v.diem_held, \
             diem_epoch = GREATEST(l.diem_epoch, v.day), updated_at_ms = v.now, \
             owed_nanos = l.owed_nanos + v.owed \
             FROM (VALUES {}) AS v(owner, fence, usd, diem, usd_held, diem_held, day, now, owed) \
             WHERE l.owner = v.owner AND l.fence = v.fence RETURNING l.owner, l.fence",
            values(chunk.len(), 9)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for ((owner, fence), sum) in chunk {
            let [usd, diem, usd_held, diem_held, owed] = sum.effects;
            query = query
                .bind(&**owner)
                .bind(*fence)
                .bind(usd)
                .bind(diem)
                .bind(usd_held)
                .bind(diem_held)
                .bind(sum.day)
                .bind(now)
                .bind(owed);
        }
        let mut updated = HashSet::with_capacity(chunk.len());
        for row in query.fetch_all(&mut *tx).await? {
            updated.insert((row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)?));
        }
        for ((owner, fence), _) in chunk {
            if !updated.contains(&(owner.to_string(), *fence)) {
                fenced.insert((owner.clone(), *fence));
            }
        }
    }
    if !fenced.is_empty() {
        tx.rollback().await?;
        return Err(BatchError::Fenced(fenced));
    }

    // 3. The capped keys' spend.
    let keys = key_sums(jobs, &written);
    for chunk in keys.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "INSERT INTO key_spend (key_id, period, usd_nanos, diem_nanos, usd_held_nanos, \
             diem_held_nanos) VALUES {} ON CONFLICT (key_id, period) DO UPDATE SET \
             usd_nanos = key_spend.usd_nanos + excluded.usd_nanos, \
             diem_nanos = key_spend.diem_nanos + excluded.diem_nanos, \
             usd_held_nanos = key_spend.usd_held_nanos + excluded.usd_held_nanos, \
             diem_held_nanos = key_spend.diem_held_nanos + excluded.diem_held_nanos",
            values(chunk.len(), 6)
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

    // 4. Durable holds: opened (a stream that ended in this batch already
    // closed), checkpointed, closed.
    let holds = hold_writes(jobs, &written);
    for chunk in holds.inserts.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "INSERT INTO holds (request_id, owner, usd_nanos, diem_nanos, state, \
             created_at_ms, expires_at_ms, key_id, key_period, model_id, checkpoint_nanos, \
             checkpoint_prompt_tokens, checkpoint_completion_tokens) VALUES {}",
            values(chunk.len(), 13)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for hold in chunk {
            let record = hold.open;
            let (checkpoint, prompt, completion, expires_at_ms) = hold.checkpointed();
            query = query
                .bind(&*record.request_id)
                .bind(&*record.owner.name)
                .bind(record.held.0)
                .bind(record.held.1)
                .bind(hold.state.as_str())
                .bind(record.at_ms(now))
                .bind(expires_at_ms)
                .bind(record.key.as_ref().map(|k| k.0.as_str()))
                .bind(record.key.as_ref().map(|k| k.1.as_str()))
                .bind(&*record.model_id)
                .bind(checkpoint)
                .bind(prompt)
                .bind(completion);
        }
        query.execute(&mut *tx).await?;
    }
    for update in holds.updates {
        match update {
            HoldUpdate::Checkpoint(record) => {
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
            HoldUpdate::Close(record, state) => {
                sqlx::query("UPDATE holds SET state = $2 WHERE request_id = $1 AND state = 'open'")
                    .bind(&*record.request_id)
                    .bind(state.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
        }
    }

    // 5. Refreshes: the balances as this batch leaves them.
    let mut refreshed = Refreshed::default();
    for chunk in refresh_owners(jobs).chunks(ROWS_PER_STATEMENT) {
        let list = values(1, chunk.len());
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

/// Lets each (owner, fence) go: nobody holds it, unless another replica
/// claimed it since (the fence moved on). One statement per 64 owners.
async fn release(conn: &mut Connection, releases: &[(Arc<str>, i64)]) -> Result<()> {
    for chunk in releases.chunks(ROWS_PER_STATEMENT) {
        let sql = format!(
            "UPDATE ledgers l SET holder = NULL FROM (VALUES {}) AS v(owner, fence) \
             WHERE l.owner = v.owner AND l.fence = v.fence",
            values(chunk.len(), 2)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (owner, fence) in chunk {
            query = query.bind(&**owner).bind(*fence);
        }
        query.execute(&mut **conn).await?;
    }
    Ok(())
}

/// Loads an owner and claims it: the fence moves on, so whichever replica
/// held it before can no longer write for it. With a `claim` (a billing
/// replica of several): only an owner that no other replica it hears
/// holds, and that its view does not give to another ready replica;
/// otherwise the load is refused, naming the replica to ask
/// ([`kept_by`](super::kept_by)), and an owner this replica still holds
/// without having it in memory (its let-go in flight, or a past run's) is
/// let go here.
async fn load(conn: &mut Connection, owner: &str, claim: Option<&Claim>) -> Result<Loaded> {
    let mut tx = sqlx::Connection::begin(&mut **conn).await?;
    let row = sqlx::query(
        "INSERT INTO ledgers (owner, updated_at_ms, fence, holder) VALUES ($1, $2, 1, $3) \
         ON CONFLICT (owner) DO UPDATE SET fence = ledgers.fence + 1, holder = excluded.holder \
         WHERE excluded.holder IS NULL \
         OR ($4 AND (ledgers.holder IS NULL OR ledgers.holder = excluded.holder \
             OR NOT (ledgers.holder = ANY (string_to_array($5, ','))))) \
         RETURNING usd_nanos, diem_nanos, usd_held_nanos, diem_held_nanos, diem_epoch, fence, \
         owed_nanos",
    )
    .bind(owner)
    .bind(now_ms())
    .bind(claim.map(|c| &*c.me))
    .bind(claim.is_none_or(|c| c.elsewhere.is_none()))
    .bind(claim.map_or("", |c| c.live.as_str()))
    .fetch_optional(&mut *tx)
    .await?;
    let row = match (row, claim) {
        (Some(row), _) => row,
        (None, None) => return Err(Error::internal("a ledger load without a claim was refused")),
        (None, Some(claim)) => {
            let holder: Option<String> =
                sqlx::query_scalar("SELECT holder FROM ledgers WHERE owner = $1")
                    .bind(owner)
                    .fetch_one(&mut *tx)
                    .await?;
            let heard = |name: &str| claim.live.split(',').any(|live| live == name);
            let keeper = match holder.as_deref() {
                Some(holder) if holder != &*claim.me && heard(holder) => Some(holder.to_owned()),
                held => {
                    if held == Some(&*claim.me) {
                        sqlx::query(
                            "UPDATE ledgers SET holder = NULL WHERE owner = $1 AND holder = $2",
                        )
                        .bind(owner)
                        .bind(&*claim.me)
                        .execute(&mut *tx)
                        .await?;
                    }
                    claim.elsewhere.as_deref().map(str::to_owned)
                }
            };
            tx.commit().await?;
            return Err(keeper.map_or_else(super::moving, |keeper| super::kept_by(&keeper)));
        }
    };
    let balance = Balance {
        usd: row.try_get(0)?,
        diem: row.try_get(1)?,
        usd_held: row.try_get(2)?,
        diem_held: row.try_get(3)?,
        owed: row.try_get(6)?,
    };
    let (diem_epoch, fence): (i64, i64) = (row.try_get(4)?, row.try_get(5)?);
    let stake: Option<i64> = sqlx::query("SELECT diem_per_day_nanos FROM stakes WHERE owner = $1")
        .bind(owner)
        .fetch_optional(&mut *tx)
        .await?
        .map(|row| row.try_get(0))
        .transpose()?;
    let sql = format!("SELECT {HOLD_COLUMNS} FROM holds WHERE owner = $1 AND state = 'open'");
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(owner)
        .fetch_all(&mut *tx)
        .await?;
    let mut holds = Vec::with_capacity(rows.len());
    for row in rows {
        let mut numbers = [0; 6];
        for (i, number) in numbers.iter_mut().enumerate() {
            *number = row.try_get(1 + i)?;
        }
        holds.push(loaded_hold((
            row.try_get(0)?,
            numbers,
            [row.try_get(7)?, row.try_get(8)?, row.try_get(9)?],
        )));
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

/// Marks as duplicates the journal rows the database did not insert
/// (`inserted` holds the keys it did, each once).
fn duplicates(
    jobs: usize,
    journaled: &[(usize, String, &'static str)],
    mut inserted: HashSet<String>,
) -> Vec<Written> {
    // The first record of a key inserted it; any other (the database had
    // it, or an earlier record of this batch) is a duplicate.
    let mut written = vec![Written::Applied; jobs];
    for (i, key, _) in journaled {
        if !inserted.remove(key) {
            written[*i] = Written::Duplicate;
        }
    }
    written
}

#[cfg(test)]
mod tests {
    use super::values;

    #[test]
    fn placeholders_number_every_row() {
        assert_eq!(values(2, 3), "($1, $2, $3), ($4, $5, $6)");
    }
}
