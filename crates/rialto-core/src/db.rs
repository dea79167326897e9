//! The database, chosen by URL scheme: `sqlite://` (the embedded default) or
//! `postgres://`. Migrations in `migrations/` are portable SQL applied at start.

use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyPoolOptions, install_default_drivers};
use sqlx::{AnyPool, Executor};

/// A pool over whichever backend the URL names.
#[derive(Debug, Clone)]
pub struct Database {
    pool: AnyPool,
    kind: DatabaseKind,
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
        install_default_drivers();
        let (kind, url) = if url.starts_with("sqlite:") {
            (DatabaseKind::Sqlite, prepare_sqlite_url(url)?)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            (DatabaseKind::Postgres, url.to_owned())
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
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        Ok(Self { pool, kind })
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    pub fn kind(&self) -> DatabaseKind {
        self.kind
    }

    /// On SQLite, checkpoints the WAL every `every` from a task of its own
    /// (connections never checkpoint in a commit); nothing on PostgreSQL.
    pub fn spawn_checkpointer(&self, every: Duration) {
        if self.kind != DatabaseKind::Sqlite {
            return;
        }
        let pool = self.pool.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
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
fn prepare_sqlite_url(url: &str) -> Result<String, sqlx::Error> {
    let path = url
        .trim_start_matches("sqlite:")
        .trim_start_matches("//")
        .split('?')
        .next()
        .unwrap_or_default();
    let parent = std::path::Path::new(path).parent();
    if path != ":memory:"
        && let Some(parent) = parent.filter(|p| !p.as_os_str().is_empty())
    {
        std::fs::create_dir_all(parent)?;
    }
    // Validate the URL now, with a clear error, rather than at first use.
    sqlx::sqlite::SqliteConnectOptions::from_str(url)?;
    Ok(if url.contains('?') {
        url.to_owned()
    } else {
        format!("{url}?mode=rwc")
    })
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
    }

    #[tokio::test]
    async fn unknown_schemes_are_refused() {
        let error = Database::connect("mysql://localhost/x", 1)
            .await
            .unwrap_err();
        assert!(error.to_string().contains("sqlite: or postgres://"));
    }
}
