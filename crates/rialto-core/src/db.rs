//! The database, chosen by URL scheme: `sqlite://` (the embedded default) or
//! `postgres://`. Migrations in `migrations/` are portable SQL, applied at
//! start by `connect` or as their own step (`rialto migrate`).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use sqlx::any::{AnyPoolOptions, install_default_drivers};
use sqlx::{AnyPool, Executor};

/// A pool over whichever backend the URL names.
#[derive(Debug, Clone)]
pub struct Database {
    pool: AnyPool,
    kind: DatabaseKind,
    /// The SQLite database's file (none on PostgreSQL).
    sqlite_file: Option<PathBuf>,
    /// When a connection outside the pool last checkpointed the WAL (ms).
    checkpointed_at_ms: Arc<AtomicI64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseKind {
    Sqlite,
    Postgres,
}

impl Database {
    /// Connects, creating a SQLite file and its folder when missing, and
    /// applies pending migrations.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, sqlx::Error> {
        let db = Self::open(url, max_connections).await?;
        db.migrate().await?;
        Ok(db)
    }

    /// Connects, creating a SQLite file and its folder when missing, and
    /// requires the schema to be this binary's: a process that must not
    /// migrate (`database.migrate_on_start = false`, `rialto admin`) refuses
    /// a database `rialto migrate` has not brought up to date.
    pub async fn connect_migrated(url: &str, max_connections: u32) -> Result<Self, sqlx::Error> {
        let db = Self::open(url, max_connections).await?;
        let missing = db.pending_migrations().await?;
        if let Some(first) = missing.first() {
            return Err(sqlx::Error::Configuration(
                format!(
                    "the database's schema is behind this binary ({} migration(s) to apply, the \
                     first {first}): run `rialto migrate`",
                    missing.len()
                )
                .into(),
            ));
        }
        Ok(db)
    }

    /// Applies the migrations this binary has and the database lacks
    /// (PostgreSQL serialises concurrent migrators with a lock).
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        sqlx::migrate!("./migrations").run(&self.pool).await?;
        Ok(())
    }

    /// The migrations (`<version>_<description>`) this binary has that the
    /// database has not applied, oldest first.
    pub async fn pending_migrations(&self) -> Result<Vec<String>, sqlx::Error> {
        use sqlx::migrate::Migrate;
        let migrator = sqlx::migrate!("./migrations");
        let mut conn = self.pool.acquire().await?;
        // Read only: a database never migrated has no table yet (and the
        // serving user may not be allowed to create one), so nothing is
        // applied.
        let applied: std::collections::HashSet<i64> =
            match conn.list_applied_migrations(&migrator.table_name).await {
                Ok(applied) => applied.into_iter().map(|m| m.version).collect(),
                Err(sqlx::migrate::MigrateError::Execute(sqlx::Error::Database(_))) => {
                    Default::default()
                }
                Err(error) => return Err(sqlx::Error::Migrate(Box::new(error))),
            };
        Ok(migrator
            .iter()
            .filter(|m| !applied.contains(&m.version))
            .map(|m| format!("{}_{}", m.version, m.description))
            .collect())
    }

    /// Connects without touching or checking the schema (`rialto migrate`).
    pub async fn open_unmigrated(url: &str, max_connections: u32) -> Result<Self, sqlx::Error> {
        Self::open(url, max_connections).await
    }

    /// Connects without touching the schema.
    async fn open(url: &str, max_connections: u32) -> Result<Self, sqlx::Error> {
        install_default_drivers();
        let (kind, url, sqlite_file) = if url.starts_with("sqlite:") {
            let (url, file) = prepare_sqlite_url(url)?;
            (DatabaseKind::Sqlite, url, Some(file))
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            (DatabaseKind::Postgres, url.to_owned(), None)
        } else {
            return Err(sqlx::Error::Configuration(
                format!(
                    "database url must start with sqlite: or postgres:// (got {:?})",
                    redacted(url)
                )
                .into(),
            ));
        };
        let pool = AnyPoolOptions::new()
            .max_connections(max_connections.max(1))
            .acquire_timeout(Duration::from_secs(10))
            // No ping per acquire: a broken connection fails its statement
            // and is dropped, and the request path saves a round trip.
            .test_before_acquire(false)
            .after_connect(move |conn, _meta| {
                Box::pin(async move {
                    if kind == DatabaseKind::Sqlite {
                        // WAL lets readers run beside the one writer; a busy
                        // writer waits instead of failing.
                        // busy_timeout first: switching to WAL itself
                        // needs the lock another process may hold.
                        conn.execute("PRAGMA busy_timeout = 5000").await?;
                        conn.execute("PRAGMA journal_mode = WAL").await?;
                        conn.execute("PRAGMA foreign_keys = ON").await?;
                        conn.execute("PRAGMA synchronous = NORMAL").await?;
                        // No commit runs a WAL checkpoint: the checkpointer
                        // task does (`spawn_checkpointer`).
                        conn.execute("PRAGMA wal_autocheckpoint = 0").await?;
                    } else {
                        // A process stopped (SIGSTOP, a frozen VM) inside a
                        // transaction would hold its rows' locks until it
                        // runs again: the billing replica taking its
                        // ledgers over would wait as long. The server ends
                        // such a session after 2 s; the stopped process
                        // finds its transaction gone and nothing of it
                        // committed.
                        conn.execute("SET idle_in_transaction_session_timeout = 2000")
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        Ok(Self {
            pool,
            kind,
            sqlite_file,
            checkpointed_at_ms: Arc::default(),
        })
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Opens new connections with `url` from now on (a rotated password,
    /// `database.url_file`); open connections stay until they close. Only
    /// on PostgreSQL: a SQLite database cannot move while it serves.
    pub fn set_url(&self, url: &str) -> Result<(), sqlx::Error> {
        let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
        if self.kind != DatabaseKind::Postgres || !postgres {
            return Err(sqlx::Error::Configuration(
                "only a PostgreSQL database's URL can change while serving".into(),
            ));
        }
        self.pool
            .set_connect_options(sqlx::any::AnyConnectOptions::from_str(url)?);
        Ok(())
    }

    /// Sets `rialto_db_pool_connections{pool, state}` and
    /// `rialto_db_pool_max_connections{pool}` from the pool at every scrape.
    pub fn export_pool_metrics(&self, name: &'static str) {
        use crate::metrics::{PoolLabels, PoolNameLabels};
        let pool = self.pool.clone();
        crate::metrics::metrics().on_scrape(move |m| {
            let size = i64::from(pool.size());
            let idle = i64::try_from(pool.num_idle()).unwrap_or(i64::MAX);
            let state = |state| PoolLabels { pool: name, state };
            m.db_pool_connections
                .get_or_create(&state("in_use"))
                .set((size - idle).max(0));
            m.db_pool_connections
                .get_or_create(&state("idle"))
                .set(idle);
            m.db_pool_max_connections
                .get_or_create(&PoolNameLabels { pool: name })
                .set(i64::from(pool.options().get_max_connections()));
        });
    }

    pub fn kind(&self) -> DatabaseKind {
        self.kind
    }

    /// The SQLite database's file, for a component that opens a connection
    /// of its own outside the pool (the ledger's writer); none on
    /// PostgreSQL.
    pub fn sqlite_file(&self) -> Option<&Path> {
        self.sqlite_file.as_deref()
    }

    /// Tells [`spawn_checkpointer`](Self::spawn_checkpointer) that a
    /// connection outside the pool checkpointed the WAL just now (the
    /// ledger writer's checkpointer thread does, once a second).
    pub fn note_checkpoint(&self) {
        self.checkpointed_at_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// On SQLite, checkpoints the WAL every `every` from a task of its own
    /// (connections never checkpoint in a commit), unless another
    /// checkpointed within the last two periods ([`note_checkpoint`]: two
    /// at once would leave one of them busy); nothing on PostgreSQL.
    ///
    /// [`note_checkpoint`]: Self::note_checkpoint
    pub fn spawn_checkpointer(&self, every: Duration) {
        if self.kind != DatabaseKind::Sqlite {
            return;
        }
        let pool = self.pool.clone();
        let noted = self.checkpointed_at_ms.clone();
        let skip_ms = (every.as_millis() as i64).saturating_mul(2);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                if now_ms() - noted.load(Ordering::Relaxed) < skip_ms {
                    continue;
                }
                // PASSIVE: copies what no reader needs, never waits for one.
                if let Err(error) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
                    .fetch_all(&pool)
                    .await
                {
                    tracing::warn!(%error, "WAL checkpoint failed");
                }
            }
        });
    }
}

/// Adds `mode=rwc` so SQLite creates the file, and creates its folder.
/// Returns the URL and the database's file.
fn prepare_sqlite_url(url: &str) -> Result<(String, PathBuf), sqlx::Error> {
    let path = url
        .trim_start_matches("sqlite:")
        .trim_start_matches("//")
        .split('?')
        .next()
        .unwrap_or_default();
    // Every component has connections of its own (the pool's, the ledger
    // writer's), and a database in memory is one connection's alone.
    if path == ":memory:" || url.contains("mode=memory") {
        return Err(sqlx::Error::Configuration(
            "a SQLite database in memory is not supported: give a file (sqlite://path/to/file.db)"
                .into(),
        ));
    }
    if let Some(parent) = Path::new(path)
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
    {
        std::fs::create_dir_all(parent)?;
    }
    // Validate the URL now, with a clear error, rather than at first use.
    let file = sqlx::sqlite::SqliteConnectOptions::from_str(url)?
        .get_filename()
        .to_path_buf();
    let url = if url.contains('?') {
        url.to_owned()
    } else {
        format!("{url}?mode=rwc")
    };
    Ok((url, file))
}

/// `scheme://user:password@host/db` -> `scheme://***@host/db`, for messages.
pub fn redacted(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, _)), Some(at)) => format!("{scheme}://***{}", &url[at..]),
        _ => url.to_owned(),
    }
}

/// Milliseconds since the Unix epoch, the unit of every stored time.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sqlite_file_and_folder_are_created_and_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/nested/test.db", dir.path().display());
        let db = Database::connect(&url, 2).await.unwrap();
        let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM api_keys")
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert_eq!(count, 0);
        assert!(dir.path().join("nested/test.db").exists());
        assert!(db.sqlite_file().unwrap().ends_with("nested/test.db"));
    }

    /// The migration that moved the usage history into the journal
    /// carries a database's rows over: each settlement's model and tokens
    /// join its journal row, and the view gives back the rows the table had.
    async fn usage_moves_into_the_journal(url: &str) {
        install_default_drivers();
        let pool = AnyPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .unwrap();
        let migrator = sqlx::migrate!("./migrations");
        migrator.run_to(20261123000007, &pool).await.unwrap();
        let journal = "INSERT INTO ledger_journal (id, owner, kind, idempotency_key, usd_nanos, \
                       diem_nanos, usd_held_nanos, diem_held_nanos, request_id, at_ms) \
                       VALUES ($1, 'account:a', $2, $3, $4, $5, 0, 0, $6, $7)";
        for (id, kind, key, usd, diem, request, at) in [
            ("j1", "credit", "credit:account:a:seed", 100, 0, None, 1),
            ("j2", "settle", "settle:r1", -7, -3, Some("r1"), 2),
            ("j3", "settle", "settle:r2", -5, 0, Some("r2"), 3),
        ] {
            sqlx::query(journal)
                .bind(id)
                .bind(kind)
                .bind(key)
                .bind(usd as i64)
                .bind(diem as i64)
                .bind(request)
                .bind(at as i64)
                .execute(&pool)
                .await
                .unwrap();
        }
        let usage = "INSERT INTO usage_records (id, owner, request_id, model_id, currency, \
                     amount_nanos, prompt_tokens, completion_tokens, at_ms) \
                     VALUES ($1, 'account:a', $2, 'm', $3, $4, 11, 22, $5)";
        for (id, request, currency, amount, at) in [
            ("u1", "r1", "DIEM", 3, 2),
            ("u2", "r1", "USD", 7, 2),
            ("u3", "r2", "USD", 5, 3),
        ] {
            sqlx::query(usage)
                .bind(id)
                .bind(request)
                .bind(currency)
                .bind(amount as i64)
                .bind(at as i64)
                .execute(&pool)
                .await
                .unwrap();
        }
        migrator.run(&pool).await.unwrap();
        let rows: Vec<(String, String, String, i64, i64, i64)> = sqlx::query_as(
            "SELECT request_id, model_id, currency, amount_nanos, prompt_tokens, \
             completion_tokens FROM usage_records ORDER BY at_ms, currency",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let expected = [("r1", "DIEM", 3), ("r1", "USD", 7), ("r2", "USD", 5)];
        assert_eq!(rows.len(), expected.len(), "{rows:?}");
        for (row, (request, currency, amount)) in rows.iter().zip(expected) {
            assert_eq!(
                (
                    row.0.as_str(),
                    row.1.as_str(),
                    row.2.as_str(),
                    row.3,
                    row.4,
                    row.5
                ),
                (request, "m", currency, amount, 11, 22)
            );
        }
        // The credit kept its row and has no usage.
        let (credits, sum): (i64, i64) = sqlx::query_as(
            "SELECT CAST(COUNT(*) AS BIGINT), CAST(SUM(usd_nanos) AS BIGINT) FROM ledger_journal",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((credits, sum), (3, 88));
        // The idempotency key is still unique.
        let again = sqlx::query(journal)
            .bind("j4")
            .bind("settle")
            .bind("settle:r1")
            .bind(-1_i64)
            .bind(0_i64)
            .bind(Some("r1"))
            .bind(4_i64)
            .execute(&pool)
            .await;
        assert!(again.is_err());
        pool.close().await;
    }

    #[tokio::test]
    async fn usage_moves_into_the_journal_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/old.db?mode=rwc", dir.path().display());
        usage_moves_into_the_journal(&url).await;
    }

    #[tokio::test]
    async fn usage_moves_into_the_journal_on_postgres() {
        use futures_util::FutureExt;
        use sqlx::Connection;
        let server = std::env::var("E2E_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let name = format!(
            "rialto_migration_{}",
            hex::encode(crate::ids::random_bytes::<6>())
        );
        let admin = |sql: String| {
            let server = server.clone();
            async move {
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
        // Dropped whether the test passes or fails, then its failure
        // raised again: the shared server is left clean either way.
        let ran =
            std::panic::AssertUnwindSafe(usage_moves_into_the_journal(&format!("{server}/{name}")))
                .catch_unwind()
                .await;
        admin(format!("DROP DATABASE {name} WITH (FORCE)")).await;
        if let Err(failure) = ran {
            std::panic::resume_unwind(failure);
        }
    }

    #[tokio::test]
    async fn a_database_in_memory_is_refused() {
        for url in ["sqlite::memory:", "sqlite://x.db?mode=memory"] {
            let error = Database::connect(url, 1).await.unwrap_err();
            assert!(error.to_string().contains("in memory"), "{error}");
        }
    }

    #[tokio::test]
    async fn unknown_schemes_are_refused() {
        let error = Database::connect("mysql://localhost/x", 1)
            .await
            .unwrap_err();
        assert!(error.to_string().contains("sqlite: or postgres://"));
    }
}
