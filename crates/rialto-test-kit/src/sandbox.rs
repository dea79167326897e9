//! Starts the real `rialto` binary on loopback ports in either topology.
//!
//! One process: `rialto serve` runs all five services. Split: each of auth,
//! limiter, billing and router runs in its own process serving gRPC, and a
//! gateway process reaches them through `RIALTO_REMOTE__*`. Replicated: two
//! gateways, two limiter replicas and two billing replicas sharing
//! principals by consistent hash, with the bus on the NATS server
//! (`E2E_NATS_URL`, default `nats://127.0.0.1:4222`) under a subject prefix
//! of their own (its JetStream streams are deleted with the sandbox). Every
//! process binds port 0 and announces its address on stdout; the sandbox
//! reads it. A killed process can be restarted on the same address.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// Where the services run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    OneProcess,
    Split,
    /// auth and router in one process; two limiter replicas; two billing
    /// replicas; two gateways; NATS as the bus.
    Replicated,
}

/// Which database backs the auth service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    Sqlite,
    /// A fresh database on the PostgreSQL server at `E2E_POSTGRES_URL`
    /// (default `postgres://postgres@127.0.0.1:5432`), dropped afterwards.
    Postgres,
}

pub struct SandboxBuilder {
    topology: Topology,
    storage: Storage,
    extra_toml: String,
    envs: Vec<(String, String)>,
    /// The gRPC and operator tokens in files (`*_token_file`) instead of
    /// the configuration, which refuses inline secrets.
    secrets_in_files: bool,
    /// TLS on the internal gRPC interfaces (split topology).
    grpc_tls: bool,
}

/// A running Rialto deployment. Dropping it stops every process and drops
/// its database.
pub struct Sandbox {
    /// Base URL of the gateway, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    /// Base URLs of every gateway (one but in the replicated topology).
    pub gateway_urls: Vec<String>,
    pub operator_token: String,
    pub topology: Topology,
    config_path: PathBuf,
    database_url: String,
    processes: Vec<Process>,
    /// service name -> `host:port` of its gRPC server (split topology).
    grpc_addrs: Vec<(String, String)>,
    postgres_database: Option<String>,
    /// The NATS bus's subject prefix (replicated topology).
    bus_prefix: Option<String>,
    http: reqwest::Client,
    dir: tempfile::TempDir,
}

struct Process {
    name: String,
    child: Child,
    /// How it was started, to start it again.
    args: Vec<String>,
    envs: Vec<(String, String)>,
    announce: String,
    /// What it announced (its listening address).
    address: String,
}

/// An account made through the operator API.
#[derive(Debug, Clone)]
pub struct Account {
    pub id: String,
    pub admin_key: String,
}

const STARTUP: Duration = Duration::from_secs(30);
const OPERATOR_TOKEN: &str = "sandbox-operator-token";
/// Credit every sandbox account starts with, so tests of other things are
/// not refused for payment.
pub const SEED_CREDIT_USD: &str = "1000";
/// The shared token of the internal gRPC interfaces in a sandbox.
pub const GRPC_TOKEN: &str = "sandbox-grpc-token";

impl SandboxBuilder {
    /// Extra TOML appended to the generated configuration (`[[models]]`, ...).
    pub fn config(mut self, toml: &str) -> Self {
        self.extra_toml.push_str(toml);
        self.extra_toml.push('\n');
        self
    }

    pub fn storage(mut self, storage: Storage) -> Self {
        self.storage = storage;
        self
    }

    /// The operator and gRPC tokens in files of the sandbox's folder
    /// ([`Sandbox::secret_file`]: `operator-token`, `grpc-token`), named by
    /// `operator.token_file` and `grpc.token_file`, with
    /// `secrets.refuse_inline` on: the Kubernetes way.
    pub fn secrets_in_files(mut self) -> Self {
        self.secrets_in_files = true;
        self
    }

    /// TLS between the processes: a certificate authority and a server
    /// certificate for 127.0.0.1 made with `openssl` in the sandbox's
    /// folder (`ca.crt`, `tls.crt`, `tls.key`), `[grpc.tls]` naming them and
    /// `https://` remotes.
    pub fn grpc_tls(mut self) -> Self {
        self.grpc_tls = true;
        self
    }

    /// An environment variable for every process (e.g. `RIALTO_GATEWAY__MAX_BODY_BYTES`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.envs.push((key.to_owned(), value.to_owned()));
        self
    }

    pub async fn start(self) -> anyhow::Result<Sandbox> {
        let dir = tempfile::tempdir()?;
        let (database_url, postgres_database) = match self.storage {
            Storage::Sqlite => (format!("sqlite://{}/rialto.db", dir.path().display()), None),
            Storage::Postgres => {
                let name = format!("rialto_e2e_{}", uuid::Uuid::new_v4().simple());
                let server = postgres_server_url();
                postgres_admin(&server, &format!("CREATE DATABASE {name}")).await?;
                (format!("{server}/{name}"), Some(name))
            }
        };
        let (grpc_token, operator_token, secrets) = if self.secrets_in_files {
            let (grpc, operator) = (
                dir.path().join("grpc-token"),
                dir.path().join("operator-token"),
            );
            std::fs::write(&grpc, format!("{GRPC_TOKEN}\n"))?;
            std::fs::write(&operator, format!("{OPERATOR_TOKEN}\n"))?;
            (
                format!("token_file = \"{}\"", grpc.display()),
                format!("token_file = \"{}\"", operator.display()),
                "[secrets]\nrefuse_inline = true\n",
            )
        } else {
            (
                format!("token = \"{GRPC_TOKEN}\""),
                format!("token = \"{OPERATOR_TOKEN}\""),
                "",
            )
        };
        let tls = if self.grpc_tls {
            make_certificates(dir.path())?;
            let path = |name: &str| dir.path().join(name).display().to_string();
            format!(
                "[grpc.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nca_file = \"{}\"\n",
                path("tls.crt"),
                path("tls.key"),
                path("ca.crt")
            )
        } else {
            String::new()
        };
        let scheme = if self.grpc_tls { "https" } else { "http" };
        let config = format!(
            r#"brand = "rialto"
{tls}{secrets}[gateway]
listen = "127.0.0.1:0"
workers = 2
[grpc]
listen = "127.0.0.1:0"
{grpc_token}
[database]
url = "{database_url}"
max_connections = 8
[operator]
{operator_token}
[log]
level = "info"
{}
"#,
            self.extra_toml
        );
        let config_path = dir.path().join("rialto.toml");
        std::fs::File::create(&config_path)?.write_all(config.as_bytes())?;
        let mut sandbox = Sandbox {
            url: String::new(),
            gateway_urls: Vec::new(),
            operator_token: OPERATOR_TOKEN.to_owned(),
            topology: self.topology,
            config_path,
            database_url,
            processes: Vec::new(),
            grpc_addrs: Vec::new(),
            postgres_database,
            bus_prefix: None,
            http: http_client()?,
            dir,
        };
        match self.topology {
            Topology::OneProcess => {
                let addr = sandbox.spawn("all", &[], &self.envs, "gateway listening on ")?;
                sandbox.url = addr;
            }
            Topology::Split => {
                let mut envs = self.envs.clone();
                for service in ["auth", "limiter", "billing", "router"] {
                    let addr = sandbox.spawn(
                        service,
                        &["--services", service],
                        &self.envs,
                        "grpc listening on ",
                    )?;
                    let addr = addr.split(' ').next().unwrap_or_default().to_owned();
                    sandbox.grpc_addrs.push((service.to_owned(), addr.clone()));
                    envs.push((
                        format!("RIALTO_REMOTE__{}", service.to_ascii_uppercase()),
                        format!("{scheme}://{addr}"),
                    ));
                }
                sandbox.url = sandbox.spawn(
                    "gateway",
                    &["--services", "gateway"],
                    &envs,
                    "gateway listening on ",
                )?;
            }
            Topology::Replicated => {
                let nats = std::env::var("E2E_NATS_URL")
                    .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
                let prefix = format!("rialto-e2e-{}", uuid::Uuid::new_v4().simple());
                sandbox.bus_prefix = Some(prefix.clone());
                let mut common = self.envs.clone();
                common.push(("RIALTO_BUS__URL".to_owned(), nats));
                common.push(("RIALTO_BUS__SUBJECT_PREFIX".to_owned(), prefix));
                let mut envs = common.clone();
                let backend = sandbox.spawn(
                    "backend",
                    &["--services", "auth,router"],
                    &common,
                    "grpc listening on ",
                )?;
                let backend = backend.split(' ').next().unwrap_or_default().to_owned();
                for service in ["auth", "router"] {
                    sandbox
                        .grpc_addrs
                        .push((service.to_owned(), backend.clone()));
                    envs.push((
                        format!("RIALTO_REMOTE__{}", service.to_ascii_uppercase()),
                        format!("http://{backend}"),
                    ));
                }
                let mut limiters = Vec::new();
                for replica in ["limiter-0", "limiter-1"] {
                    let addr = sandbox.spawn(
                        replica,
                        &["--services", "limiter"],
                        &common,
                        "grpc listening on ",
                    )?;
                    let addr = addr.split(' ').next().unwrap_or_default().to_owned();
                    sandbox.grpc_addrs.push((replica.to_owned(), addr.clone()));
                    limiters.push(format!("http://{addr}"));
                }
                envs.push(("RIALTO_REMOTE__LIMITER".to_owned(), limiters.join(",")));
                let mut billing = Vec::new();
                for replica in ["billing-0", "billing-1"] {
                    let addr = sandbox.spawn(
                        replica,
                        &["--services", "billing"],
                        &common,
                        "grpc listening on ",
                    )?;
                    let addr = addr.split(' ').next().unwrap_or_default().to_owned();
                    sandbox.grpc_addrs.push((replica.to_owned(), addr.clone()));
                    billing.push(format!("http://{addr}"));
                }
                envs.push(("RIALTO_REMOTE__BILLING".to_owned(), billing.join(",")));
                for gateway in ["gateway-0", "gateway-1"] {
                    let url = sandbox.spawn(
                        gateway,
                        &["--services", "gateway"],
                        &envs,
                        "gateway listening on ",
                    )?;
                    sandbox.gateway_urls.push(url);
                }
                sandbox.url = sandbox.gateway_urls[0].clone();
            }
        }
        if sandbox.gateway_urls.is_empty() {
            sandbox.gateway_urls.push(sandbox.url.clone());
        }
        sandbox.wait_ready().await?;
        Ok(sandbox)
    }
}

impl Sandbox {
    pub fn builder(topology: Topology) -> SandboxBuilder {
        SandboxBuilder {
            topology,
            storage: Storage::Sqlite,
            extra_toml: String::new(),
            envs: Vec::new(),
            secrets_in_files: false,
            grpc_tls: false,
        }
    }

    /// A file of the sandbox's folder (`operator-token`, `grpc-token` with
    /// [`SandboxBuilder::secrets_in_files`]).
    pub fn secret_file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The HTTP client the sandbox uses (no pooling surprises across tests).
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// `url` + `/api/v1` + `path`.
    pub fn api(&self, path: &str) -> String {
        format!("{}/api/v1{path}", self.url)
    }

    /// `host:port` of a service's gRPC server, in the split topology.
    pub fn grpc_addr(&self, service: &str) -> Option<&str> {
        self.grpc_addrs
            .iter()
            .find(|(name, _)| name == service)
            .map(|(_, addr)| addr.as_str())
    }

    /// Sends `method` to `/api/v1<path>` with `key` as the bearer and `body`
    /// as JSON: the shape of almost every call the end-to-end tests make.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: &str,
        body: Option<&Value>,
    ) -> reqwest::Result<reqwest::Response> {
        let mut request = self.http.request(method, self.api(path)).bearer_auth(key);
        if let Some(body) = body {
            request = request.json(body);
        }
        request.send().await
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    pub fn database_url(&self) -> &str {
        &self.database_url
    }

    /// A `rialto` command with this sandbox's configuration, for CLI tests.
    pub fn command(&self) -> anyhow::Result<Command> {
        let mut command = Command::new(rialto_binary()?);
        command.arg("--config").arg(&self.config_path);
        Ok(command)
    }

    /// Creates an account through the operator API.
    pub async fn create_account(&self, name: &str) -> anyhow::Result<Account> {
        self.create_account_in_tier(name, "standard").await
    }

    /// Creates an account of a rate-limit tier (`standard`, `partner`),
    /// credited with [`SEED_CREDIT_USD`].
    pub async fn create_account_in_tier(&self, name: &str, tier: &str) -> anyhow::Result<Account> {
        let account = self.create_unfunded_account(name, tier).await?;
        self.credit(&account.id, SEED_CREDIT_USD, "sandbox-seed")
            .await?;
        Ok(account)
    }

    /// Creates an account with no credit.
    pub async fn create_unfunded_account(&self, name: &str, tier: &str) -> anyhow::Result<Account> {
        let response = self
            .http
            .post(format!("{}/admin/v1/accounts", self.url))
            .bearer_auth(&self.operator_token)
            .json(&json!({"name": name, "tier": tier}))
            .send()
            .await?;
        let status = response.status().as_u16();
        let body: Value = response.json().await?;
        if status != 201 {
            bail!("account creation answered {status}: {body}");
        }
        Ok(Account {
            id: body["id"].as_str().unwrap_or_default().to_owned(),
            admin_key: body["api_key"]["key"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        })
    }

    /// Credits an account with `usd` through the operator API (once per
    /// `reference`); returns the response body.
    pub async fn credit(
        &self,
        account_id: &str,
        usd: &str,
        reference: &str,
    ) -> anyhow::Result<Value> {
        self.credit_both(account_id, usd, "0", reference).await
    }

    /// Credits an account with `usd` and `diem`.
    pub async fn credit_both(
        &self,
        account_id: &str,
        usd: &str,
        diem: &str,
        reference: &str,
    ) -> anyhow::Result<Value> {
        let response = self
            .http
            .post(format!(
                "{}/admin/v1/accounts/{account_id}/credits",
                self.url
            ))
            .bearer_auth(&self.operator_token)
            .json(&json!({"usd": usd, "diem": diem, "reference": reference}))
            .send()
            .await?;
        let status = response.status().as_u16();
        let body: Value = response.json().await?;
        if status != 200 {
            bail!("crediting answered {status}: {body}");
        }
        Ok(body)
    }

    /// Creates a key of `key_type` (`ADMIN` or `INFERENCE`) with `admin_key`;
    /// returns (id, secret).
    pub async fn create_key(
        &self,
        admin_key: &str,
        key_type: &str,
    ) -> anyhow::Result<(String, String)> {
        let response = self
            .http
            .post(self.api("/api_keys"))
            .bearer_auth(admin_key)
            .json(&json!({"apiKeyType": key_type, "description": "sandbox"}))
            .send()
            .await?;
        let body: Value = response.json().await?;
        let id = body["data"]["id"].as_str().context("no key id")?.to_owned();
        let secret = body["data"]["apiKey"]
            .as_str()
            .context("no key")?
            .to_owned();
        Ok((id, secret))
    }

    /// The operating-system id of process `name` (`all` in the one-process
    /// topology), while it runs: for reading its memory from `/proc`.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.processes
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.child.id())
    }

    /// Everything the processes logged so far (for assertions on logs).
    pub fn logs(&self) -> String {
        self.processes
            .iter()
            .map(|p| std::fs::read_to_string(self.log_path(&p.name)).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The logs once they hold `needle`, or after 10 s without it. A
    /// process writes its lines in batches a few milliseconds after they
    /// are logged (`rialto_core::log_writer`): a test looking for a line
    /// (or for the absence of a secret in the lines of a request) waits
    /// for a line it knows comes.
    pub async fn logs_containing(&self, needle: &str) -> String {
        self.logs_when(|logs| logs.contains(needle)).await
    }

    /// The logs once `done` says so of them, or after 10 s.
    pub async fn logs_when(&self, done: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let logs = self.logs();
            if done(&logs) || std::time::Instant::now() > deadline {
                return logs;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// Starts `rialto serve` and waits for its `rialto: <announce><addr>` line.
    fn spawn(
        &mut self,
        name: &str,
        args: &[&str],
        envs: &[(String, String)],
        announce: &str,
    ) -> anyhow::Result<String> {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        self.start_process(name, args, envs.to_vec(), announce)
    }

    fn start_process(
        &mut self,
        name: &str,
        args: Vec<String>,
        envs: Vec<(String, String)>,
        announce: &str,
    ) -> anyhow::Result<String> {
        let log_path = self.log_path(name);
        // Appends: a restarted process keeps the log of its first life.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let mut command = Command::new(rialto_binary()?);
        command
            .arg("--config")
            .arg(&self.config_path)
            .arg("serve")
            .args(&args)
            .current_dir(self.dir.path())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.try_clone()?);
        for (key, value) in &envs {
            command.env(key, value);
        }
        let mut child = command.spawn().context("cannot start the rialto binary")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (lines_tx, lines_rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut log = log;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = writeln!(log, "{line}");
                if line.starts_with("rialto: ") {
                    let _ = lines_tx.send(line);
                }
            }
        });
        self.processes.retain(|p| p.name != name);
        self.processes.push(Process {
            name: name.to_owned(),
            child,
            args,
            envs,
            announce: announce.to_owned(),
            address: String::new(),
        });
        let deadline = std::time::Instant::now() + STARTUP;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match lines_rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.split_once(announce).map(|(_, rest)| rest) {
                        if let Some(process) = self.processes.last_mut() {
                            process.address = rest.to_owned();
                        }
                        return Ok(rest.to_owned());
                    }
                }
                Err(_) => {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    bail!("{name} did not announce {announce:?} in time; its log:\n{log}");
                }
            }
        }
    }

    async fn wait_ready(&self) -> anyhow::Result<()> {
        for url in &self.gateway_urls {
            let mut ready = false;
            for _ in 0..100 {
                let response = self.http.get(format!("{url}/healthz")).send().await;
                if response.is_ok_and(|r| r.status().is_success()) {
                    ready = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if !ready {
                bail!("gateway at {url} never became healthy");
            }
        }
        Ok(())
    }

    /// Stops one process of the sandbox (`limiter-1`, ...), as a crash would.
    pub fn kill(&mut self, name: &str) -> anyhow::Result<()> {
        let process = self
            .processes
            .iter_mut()
            .find(|p| p.name == name)
            .with_context(|| format!("no process named {name}"))?;
        process.child.kill()?;
        process.child.wait()?;
        Ok(())
    }

    /// Asks one process to stop as an orchestrator would (SIGTERM), and
    /// waits up to `limit` for it to exit; its exit status.
    pub async fn terminate(
        &mut self,
        name: &str,
        limit: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let process = self
            .processes
            .iter_mut()
            .find(|p| p.name == name)
            .with_context(|| format!("no process named {name}"))?;
        let status = std::process::Command::new("kill")
            .args(["-TERM", &process.child.id().to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill -TERM failed");
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = process.child.try_wait()? {
                return Ok(status);
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "{name} did not exit within {limit:?} of SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts a killed process again, as before and on the same address
    /// (its peers were configured with it).
    pub async fn restart(&mut self, name: &str) -> anyhow::Result<()> {
        let process = self
            .processes
            .iter()
            .find(|p| p.name == name)
            .with_context(|| format!("no process named {name}"))?;
        let (args, mut envs, announce) = (
            process.args.clone(),
            process.envs.clone(),
            process.announce.clone(),
        );
        let address = process.address.split(' ').next().unwrap_or_default();
        match address.strip_prefix("http://") {
            Some(http) => envs.push(("RIALTO_GATEWAY__LISTEN".to_owned(), http.to_owned())),
            None => envs.push(("RIALTO_GRPC__LISTEN".to_owned(), address.to_owned())),
        }
        self.start_process(name, args, envs, &announce)?;
        self.wait_ready().await
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for process in &mut self.processes {
            let _ = process.child.kill();
            let _ = process.child.wait();
        }
        if let Some(prefix) = self.bus_prefix.take() {
            // The JetStream streams the processes created.
            let _ = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(runtime) = runtime {
                    let _ = runtime.block_on(delete_streams(&prefix));
                }
            })
            .join();
        }
        if let Some(name) = self.postgres_database.take() {
            // Drop runs outside any async context we can rely on: use a
            // thread with its own runtime.
            let _ = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(runtime) = runtime {
                    let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                    let _ = runtime.block_on(postgres_admin(&postgres_server_url(), &sql));
                }
            })
            .join();
        }
    }
}

/// The `rialto` binary next to the test executable (`target/<profile>/rialto`),
/// or `E2E_RIALTO_BIN`. `make test` builds it before the tests run.
/// A certificate authority (`ca.crt`) and a certificate it signed for
/// 127.0.0.1 and localhost (`tls.crt`, `tls.key`), in `dir`, by `openssl`.
fn make_certificates(dir: &Path) -> anyhow::Result<()> {
    let openssl = |args: &[&str]| -> anyhow::Result<()> {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .context("cannot run openssl")?;
        anyhow::ensure!(
            output.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=rialto-test-ca",
    ])?;
    openssl(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "tls.key",
        "-out",
        "tls.csr",
        "-subj",
        "/CN=localhost",
    ])?;
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n",
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        "tls.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "tls.crt",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    ])
}

pub fn rialto_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("E2E_RIALTO_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().context("test executable has no folder")?;
    if dir.ends_with("deps") {
        dir = dir.parent().context("no profile folder")?;
    }
    let binary = dir.join("rialto");
    if !binary.exists() {
        bail!(
            "{} does not exist: build it first with `cargo build --workspace --all-targets` (make test does)",
            binary.display()
        );
    }
    Ok(binary)
}

/// The HTTP client tests use. reqwest is built without a bundled crypto
/// provider; install ring's once.
pub fn http_client() -> anyhow::Result<reqwest::Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?)
}

async fn delete_streams(prefix: &str) -> anyhow::Result<()> {
    let nats = std::env::var("E2E_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let bus = tokio::time::timeout(
        Duration::from_secs(5),
        rialto_core::bus::Bus::nats(&nats, prefix),
    )
    .await??;
    bus.delete_queue(rialto_billing::usage_queue::USAGE_QUEUE)
        .await?;
    Ok(())
}

fn postgres_server_url() -> String {
    std::env::var("E2E_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
        .trim_end_matches('/')
        .to_owned()
}

async fn postgres_admin(server: &str, sql: &str) -> anyhow::Result<()> {
    use sqlx::Connection;
    let mut conn = sqlx::postgres::PgConnection::connect(&format!("{server}/postgres"))
        .await
        .with_context(|| format!("cannot reach PostgreSQL at {server}"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    Ok(())
}
