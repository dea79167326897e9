//! Rialto on PostgreSQL through PgBouncer (Debian's package, 1.18 on
//! Debian 12: `make test` installs it). Each test creates a fresh database
//! on 127.0.0.1:5432, starts a pgbouncer of its own in front of it on a free
//! loopback port, and starts Rialto with `database.url` naming pgbouncer
//! and `database.migrate_on_start`.
//!
//! - Session pooling (with `ignore_startup_parameters = extra_float_digits`):
//!   accounts, keys and the ledger work as on PostgreSQL itself, in one
//!   process and split.
//! - Without `ignore_startup_parameters`, pgbouncer refuses the parameter
//!   sqlx sends at login, and Rialto exits at start saying so.
//! - Transaction pooling, which the README warns against on PgBouncer
//!   before 1.21: sqlx's named prepared statements (`sqlx_s_N`, per client
//!   connection) meet other clients' on the shared server connections.
//!   Pinned here as it behaves: in one process Rialto starts, then many
//!   requests answer 500 (the cause only in its log) and, rarely, one
//!   answers wrongly; split, a process after the first exits at start.
//!   Never a hang.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use reqwest::Method;
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use rust_decimal::Decimal;
use serde_json::{Value, json};

use crate::support::free_port;

/// The PostgreSQL server pgbouncer forwards to (trust auth, user postgres).
const POSTGRES: &str = "postgres://postgres@127.0.0.1:5432";

/// What sqlx sends at login that pgbouncer does not know.
const IGNORE_EXTRA_FLOAT_DIGITS: &str = "ignore_startup_parameters = extra_float_digits";

/// A pgbouncer process and the database behind it. Dropping it kills the
/// process and drops the database, whatever the test's outcome.
struct Bouncer {
    child: Option<Child>,
    port: u16,
    database: String,
    log: PathBuf,
    dir: tempfile::TempDir,
}

impl Bouncer {
    /// Creates a fresh database and starts pgbouncer in `pool_mode` in front
    /// of it, with `extra` lines in its `[pgbouncer]` section; returns once
    /// pgbouncer's port accepts connections.
    async fn start(pool_mode: &str, extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let database = format!("rialto_pgbouncer_{}", uuid::Uuid::new_v4().simple());
        postgres_admin(&format!("CREATE DATABASE {database}"))
            .await
            .unwrap_or_else(|e| panic!("cannot create a database on {POSTGRES}: {e}"));
        // From here on, the guard drops the database whatever happens.
        let mut bouncer = Bouncer {
            child: None,
            port: free_port(),
            database,
            log: dir.path().join("pgbouncer.log"),
            dir,
        };
        let dir = bouncer.dir.path().to_owned();
        std::fs::write(dir.join("userlist.txt"), "\"postgres\" \"\"\n").unwrap();
        // No unix socket, no pidfile (the test holds the process) and no
        // logfile: pgbouncer logs to stderr, which the test writes into the
        // folder. Run as root, pgbouncer must be told a user (`-u`), which
        // it becomes before reading anything but its configuration: the
        // folder and files need only be readable by it.
        let ini = format!(
            "[databases]\n\
             {db} = host=127.0.0.1 port=5432 dbname={db}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {auth}\n\
             pool_mode = {pool_mode}\n\
             max_client_conn = 500\n\
             default_pool_size = 100\n\
             logfile =\n\
             pidfile =\n\
             {extra}\n",
            db = bouncer.database,
            port = bouncer.port,
            auth = dir.join("userlist.txt").display(),
        );
        let ini_path = dir.join("pgbouncer.ini");
        std::fs::write(&ini_path, ini).unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            let readable = |mode| std::fs::Permissions::from_mode(mode);
            std::fs::set_permissions(&dir, readable(0o755)).unwrap();
            for file in ["pgbouncer.ini", "userlist.txt"] {
                std::fs::set_permissions(dir.join(file), readable(0o644)).unwrap();
            }
        }
        let log = std::fs::File::create(&bouncer.log).unwrap();
        let mut command = Command::new(pgbouncer_binary());
        if running_as_root() {
            // "FATAL PgBouncer should not run as root" otherwise.
            command.args(["-u", "postgres"]);
        }
        command
            .arg(&ini_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        bouncer.child = Some(command.spawn().expect("cannot start pgbouncer"));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", bouncer.port))
                .await
                .is_ok()
            {
                return bouncer;
            }
            let exited = bouncer.child.as_mut().and_then(|c| c.try_wait().ok()?);
            if let Some(status) = exited {
                panic!("pgbouncer exited ({status}); its log:\n{}", bouncer.log());
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer never listened; its log:\n{}",
                bouncer.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Rialto's `database.url`: the database through pgbouncer.
    fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            self.port, self.database
        )
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Connections pgbouncer opened to PostgreSQL so far.
    fn server_connections(&self) -> usize {
        self.log().matches("new connection to server").count()
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.database);
        // Drop may run inside the test's runtime: a thread with its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(runtime) = runtime {
                let _ = runtime.block_on(postgres_admin(&sql));
            }
        })
        .join();
    }
}

/// Whether account `id` is in `database`, asked of PostgreSQL directly.
async fn account_exists(database: &str, id: &str) -> bool {
    use sqlx::Connection;
    let mut conn = sqlx::postgres::PgConnection::connect(&format!("{POSTGRES}/{database}"))
        .await
        .unwrap();
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM accounts WHERE id = $1")
        .bind(id)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    count == 1
}

async fn postgres_admin(sql: &str) -> Result<(), sqlx::Error> {
    use sqlx::Connection;
    let mut conn = sqlx::postgres::PgConnection::connect(&format!("{POSTGRES}/postgres")).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut conn)
        .await?;
    conn.close().await
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").unwrap().uid() == 0
}

/// `pgbouncer` on the PATH, or Debian's `/usr/sbin/pgbouncer` (not on a
/// user's PATH).
fn pgbouncer_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|candidate| candidate.is_file())
        .expect("pgbouncer is not installed: `make pgbouncer` installs Debian's package")
}

/// A sandbox whose every process reaches the database through `bouncer`
/// only (`RIALTO_DATABASE__URL` replaces the sandbox's own database); the
/// error, if it does not start, with the log of the process that failed.
async fn start_rialto(
    topology: Topology,
    mock: &MockUpstream,
    bouncer: &Bouncer,
) -> Result<Sandbox, String> {
    Sandbox::builder(topology)
        .config(&crate::support::models_toml(&mock.base_url()))
        .env("RIALTO_DATABASE__URL", &bouncer.url())
        .env("RIALTO_DATABASE__MIGRATE_ON_START", "true")
        .start()
        .await
        .map_err(|e| format!("{e:#}"))
}

async fn balance_usd(sandbox: &Sandbox, admin: &str) -> Decimal {
    let response = sandbox
        .call(Method::GET, "/billing/balance", admin, None)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    body["balances"]["usd"].to_string().parse().unwrap()
}

/// Accounts, keys, credit and concurrent priced chats through pgbouncer:
/// the balance falls by exactly the sum of the answers' costs, and a
/// deleted key is refused.
async fn ledger_and_auth(sandbox: &Sandbox) {
    let account = sandbox
        .create_unfunded_account("pgbouncer", "standard")
        .await
        .unwrap();
    sandbox
        .credit(&account.id, "10", "pgbouncer-seed")
        .await
        .unwrap();
    let (key_id, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    let unknown = sandbox
        .call(Method::GET, "/api_keys/rate_limits", "not-a-key", None)
        .await
        .unwrap();
    assert_eq!(unknown.status(), 401);
    assert_eq!(
        balance_usd(sandbox, &account.admin_key).await,
        Decimal::from(10)
    );

    let chats = (0..12u32).map(|i| {
        let body = json!({"model": "mock-chat", "max_tokens": 100,
            "messages": [{"role": "user", "content": "hello through pgbouncer"}],
            "mock": {"words": 5 + i}});
        let key = key.clone();
        async move {
            sandbox
                .call(Method::POST, "/chat/completions", &key, Some(&body))
                .await
                .unwrap()
        }
    });
    let mut spent = Decimal::ZERO;
    for response in join_all(chats).await {
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert_eq!(status, 200, "{body}");
        let cost: Decimal = body["cost"]["usd"].to_string().parse().unwrap();
        assert!(cost > Decimal::ZERO, "{body}");
        spent += cost;
    }
    // Settlement may trail the answers by a moment.
    let expected = Decimal::from(10) - spent;
    let mut now = balance_usd(sandbox, &account.admin_key).await;
    for _ in 0..100 {
        if now == expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        now = balance_usd(sandbox, &account.admin_key).await;
    }
    assert_eq!(
        now,
        expected,
        "charged {} for answers costing {spent}",
        Decimal::from(10) - now
    );

    let deleted = sandbox
        .call(
            Method::DELETE,
            &format!("/api_keys?id={key_id}"),
            &account.admin_key,
            None,
        )
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    let refused = sandbox
        .call(Method::GET, "/api_keys/rate_limits", &key, None)
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
}

async fn through_session_pooling(topology: Topology) {
    let bouncer = Bouncer::start("session", IGNORE_EXTRA_FLOAT_DIGITS).await;
    let mock = MockUpstream::start().await.unwrap();
    let started = Instant::now();
    let sandbox = start_rialto(topology, &mock, &bouncer).await.unwrap();
    let startup = started.elapsed();
    ledger_and_auth(&sandbox).await;
    assert!(
        bouncer
            .log()
            .contains(&format!("login attempt: db={}", bouncer.database)),
        "Rialto did not go through pgbouncer; its log:\n{}",
        bouncer.log()
    );
    eprintln!(
        "{topology:?} through session pooling: started in {startup:?}, scenario in {:?}, \
         {} server connections",
        started.elapsed() - startup,
        bouncer.server_connections()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_pooling_one_process() {
    through_session_pooling(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_pooling_split() {
    through_session_pooling(Topology::Split).await;
}

/// pgbouncer's default refuses a client sending `extra_float_digits` at
/// login, as sqlx does: Rialto exits at start, naming the parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_ignore_startup_parameters_rialto_exits_at_start() {
    let bouncer = Bouncer::start("session", "").await;
    let mock = MockUpstream::start().await.unwrap();
    let started = Instant::now();
    let error = start_rialto(Topology::OneProcess, &mock, &bouncer)
        .await
        .err()
        .expect("Rialto started through a pgbouncer refusing extra_float_digits");
    assert!(
        error.contains(
            "cannot open the database (database.url): error returned from database: \
             unsupported startup parameter: extra_float_digits"
        ),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "{error}");
    assert!(
        bouncer
            .log()
            .contains("unsupported startup parameter: extra_float_digits")
    );
}

/// The operator API's writes, one at a time, through transaction pooling:
/// 20 accounts made and each credited. Every answer comes quickly, but
/// many are 500s with the generic body, their cause only in Rialto's log:
/// sqlx's prepared statements meeting other connections' on pgbouncer's
/// server connections. Now and then (a few runs in a hundred) a statement
/// runs under another's name and answers wrongly: the credit of an account
/// just made answers 404 "Account not found" though the account is in the
/// database.
async fn transaction_pooling_breaks_requests(sandbox: &Sandbox, database: &str) {
    let operator = |path: String, body: Value| async move {
        let started = Instant::now();
        let response = sandbox
            .http()
            .post(format!("{}/admin/v1{path}", sandbox.url))
            .bearer_auth(&sandbox.operator_token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(5), "{path} took {took:?}");
        (status, body)
    };
    let (mut writes, mut failed, mut wrong) = (0, 0, Vec::new());
    for i in 0..20 {
        let (status, body) = operator(
            "/accounts".to_owned(),
            json!({"name": format!("tx-{i}"), "tier": "standard"}),
        )
        .await;
        writes += 1;
        match status {
            201 => {}
            500 => {
                assert_eq!(body, json!({"error": "An unknown error occurred"}));
                failed += 1;
                continue;
            }
            _ => panic!("account creation: {status} {body}"),
        }
        let id = body["id"].as_str().unwrap();
        let (status, body) = operator(
            format!("/accounts/{id}/credits"),
            json!({"usd": "1", "reference": "seed"}),
        )
        .await;
        writes += 1;
        match status {
            200 => {}
            500 => {
                assert_eq!(body, json!({"error": "An unknown error occurred"}));
                failed += 1;
            }
            404 => {
                assert_eq!(body, json!({"error": "Account not found"}));
                wrong.push(format!(
                    "a credit answered 404 for an account {}",
                    if account_exists(database, id).await {
                        "in the database"
                    } else {
                        "missing from the database, though its creation answered 201"
                    }
                ));
            }
            _ => panic!("credit: {status} {body}"),
        }
    }
    assert!(
        failed > 0,
        "transaction pooling broke nothing: the README can stop warning"
    );
    let logs = sandbox
        .logs_containing("prepared statement \"sqlx_s_")
        .await;
    let causes = logs
        .lines()
        .filter(|line| {
            line.contains("prepared statement \"sqlx_s_")
                && (line.contains("already exists") || line.contains("does not exist"))
        })
        .count();
    assert!(causes > 0, "{logs}");
    eprintln!(
        "transaction pooling: {failed} of {writes} operator writes answered 500, \
         {causes} log lines name a prepared statement; wrong answers: {wrong:?}"
    );
}

/// One process starts (its migrations run on its first connection, alone
/// on a fresh pgbouncer), then many of its requests fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_pooling_one_process_starts_then_answers_500s() {
    let bouncer = Bouncer::start("transaction", IGNORE_EXTRA_FLOAT_DIGITS).await;
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = start_rialto(Topology::OneProcess, &mock, &bouncer)
        .await
        .unwrap();
    transaction_pooling_breaks_requests(&sandbox, &bouncer.database).await;
}

/// Split, the processes start one after the other: the first one's
/// statements are left on pgbouncer's server connections, and a later
/// process's (its migrations') meet them and it exits at start. (Should every
/// later process land on a fresh server connection, it starts; then its
/// requests must fail as in one process.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_pooling_split_exits_at_start() {
    let bouncer = Bouncer::start("transaction", IGNORE_EXTRA_FLOAT_DIGITS).await;
    let mock = MockUpstream::start().await.unwrap();
    let started = Instant::now();
    match start_rialto(Topology::Split, &mock, &bouncer).await {
        Err(error) => {
            assert!(
                error.contains("cannot open the database (database.url)")
                    && error.contains("prepared statement \"sqlx_s_")
                    && (error.contains("already exists") || error.contains("does not exist")),
                "{error}"
            );
            assert!(started.elapsed() < Duration::from_secs(10), "{error}");
            eprintln!(
                "split through transaction pooling: exited at start after {:?}: {}",
                started.elapsed(),
                error.lines().take(2).collect::<Vec<_>>().join(" / ")
            );
        }
        Ok(sandbox) => {
            eprintln!("split through transaction pooling: started this time");
            transaction_pooling_breaks_requests(&sandbox, &bouncer.database).await;
        }
    }
}
