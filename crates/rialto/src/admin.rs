//! `rialto admin`: the operator API's command-line client.
//!
//! Every command is one call to `/admin/v1` on a running gateway, with the
//! operator token as its bearer; nothing here opens the database (`rialto
//! migrate` is the only command that does), so the CLI works the same
//! against a laptop's `rialto serve` and a Kubernetes deployment, and its
//! changes reach every gateway as the API's do.
//!
//! Where it calls: `--url`, else `RIALTO_ADMIN_URL`, else `http://` and the
//! configured `gateway.listen` (an unspecified address, `0.0.0.0` or `::`,
//! is reached on `127.0.0.1`). With which token: `--token-file`, else
//! `RIALTO_OPERATOR_TOKEN`, else the configuration's `operator.token` or
//! `operator.token_file`, else the token `rialto serve` wrote beside its
//! SQLite database (`Config::embedded_operator_token_path`).
//!
//! What it prints: `--output text` (the default) a table or `key: value`
//! lines; `--output json` the API's answer as is, pretty-printed. An API
//! error is its `{error, details}` on stderr and exit code 1.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use clap::{Args, Subcommand, ValueEnum};
use reqwest::{Method, Url};
use rialto_core::Config;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};

/// The variable naming the gateway, when `--url` does not.
const URL_ENV: &str = "RIALTO_ADMIN_URL";
/// The variable holding the operator token, when `--token-file` does not.
const TOKEN_ENV: &str = "RIALTO_OPERATOR_TOKEN";

/// `rialto admin [--url URL] [--token-file PATH] [--output json|text] ...`.
#[derive(Args)]
pub struct AdminArgs {
    /// The gateway's base URL [default: http:// and the configured gateway.listen].
    #[arg(long, global = true, value_name = "URL", env = URL_ENV)]
    url: Option<String>,
    /// A file holding the operator token. Otherwise RIALTO_OPERATOR_TOKEN,
    /// then the configuration's operator.token or operator.token_file, then
    /// the token `rialto serve` wrote beside its SQLite database.
    #[arg(long, global = true, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// `text`: a table or `key: value` lines; `json`: the API's answer, pretty-printed.
    #[arg(long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Subcommand)]
enum AdminCommand {
    /// Accounts: create, find, suspend, credit, and what they spent.
    Accounts {
        #[command(subcommand)]
        command: AccountsCommand,
    },
    /// An account's API keys.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Every model's backends: circuit (closed, half_open, open, down) and requests in flight.
    Backends,
    /// Characters stored in the database (those of the configuration stay).
    Characters {
        #[command(subcommand)]
        command: CharactersCommand,
    },
}

/// The account a command is about: `ID` or `--id ID`.
#[derive(Args)]
struct AccountId {
    /// The account id.
    #[arg(
        value_name = "ID",
        required_unless_present = "id",
        conflicts_with = "id"
    )]
    account: Option<String>,
    /// The account id (the same as ID).
    #[arg(long, value_name = "ID")]
    id: Option<String>,
}

impl AccountId {
    fn into_id(self) -> String {
        // clap requires one of the two.
        self.account.or(self.id).unwrap_or_default()
    }
}

#[derive(Subcommand)]
enum AccountsCommand {
    /// Create an account with its first ADMIN key (shown once).
    Create {
        #[arg(long)]
        name: String,
        /// Rate-limit tier: `standard` (the default), `partner`, or another of [limits.tiers].
        #[arg(long)]
        tier: Option<String>,
    },
    /// Accounts, newest first.
    List {
        /// Name or id contains this (case-insensitive).
        #[arg(long)]
        search: Option<String>,
        /// At most this many (1 to 500; the API's default is 50).
        #[arg(long)]
        limit: Option<u32>,
        /// Skip this many.
        #[arg(long)]
        offset: Option<u64>,
    },
    /// One account and its balances.
    Get(AccountId),
    /// Refuse the account's keys on every gateway until it is resumed.
    Suspend(AccountId),
    /// Accept the account's keys again.
    Resume(AccountId),
    /// Add prepaid credit, once per reference.
    Credit {
        #[command(flatten)]
        account: AccountId,
        /// USD to add, e.g. 10.00.
        #[arg(long, default_value = "0")]
        usd: String,
        /// DIEM to add.
        #[arg(long, default_value = "0")]
        diem: String,
        /// Idempotency reference: crediting the same reference twice adds once.
        #[arg(long)]
        reference: String,
    },
    /// Set the rate-limit tier (one of [limits.tiers]).
    Tier {
        #[command(flatten)]
        account: AccountId,
        #[arg(long)]
        tier: String,
    },
    /// Set the DIEM the account's stake grants every UTC day.
    Stake {
        #[command(flatten)]
        account: AccountId,
        /// DIEM per day, e.g. 25.
        #[arg(long)]
        diem_per_day: String,
    },
    /// What the account spent, by day, model and key.
    Usage {
        #[command(flatten)]
        account: AccountId,
        /// The days before now, e.g. 7d (at most 90d; the API's default is 7d).
        #[arg(long, conflicts_with_all = ["start_date", "end_date"])]
        lookback: Option<String>,
        /// First day, YYYY-MM-DD (with --end-date).
        #[arg(long, requires = "end_date")]
        start_date: Option<String>,
        /// Last day, YYYY-MM-DD (with --start-date).
        #[arg(long, requires = "start_date")]
        end_date: Option<String>,
    },
    /// The account's last 50 rate-limit hits, newest first.
    LimitHits(AccountId),
}

#[derive(Subcommand)]
enum KeysCommand {
    /// The account's keys (never their secrets).
    List {
        /// The account id.
        #[arg(long)]
        account: String,
    },
    /// Create a key for the account; its secret is shown once.
    Create {
        /// The account id.
        #[arg(long)]
        account: String,
        /// The key's type.
        #[arg(long = "type", value_name = "TYPE", default_value = "INFERENCE",
            value_parser = ["INFERENCE", "ADMIN"])]
        key_type: String,
        /// What the key is for (at most 64 characters).
        #[arg(long)]
        description: String,
        /// Expiry: YYYY-MM-DD (the day's end) or an ISO 8601 date-time.
        #[arg(long)]
        expires_at: Option<String>,
        /// Most USD the key may spend in its period.
        #[arg(long, value_name = "USD", value_parser = number)]
        limit_usd: Option<serde_json::Number>,
        /// Most DIEM the key may spend in its period.
        #[arg(long, value_name = "DIEM", value_parser = number)]
        limit_diem: Option<serde_json::Number>,
        /// The period of the limits (the API's default is EPOCH, a UTC day).
        #[arg(long, value_parser = ["EPOCH", "MONTH", "LIFETIME"])]
        limit_period: Option<String>,
        /// Models the key may use (the API's default is ALL).
        #[arg(long, value_parser = ["ALL", "PRIVATE_TEXT", "PRIVATE_ONLY"])]
        model_privacy: Option<String>,
    },
    /// Revoke a key: refused on every gateway from its next request.
    Revoke {
        /// The account id.
        #[arg(long)]
        account: String,
        /// The key's id (as `keys list` shows it), not its secret.
        #[arg(long)]
        key: String,
    },
}

#[derive(Subcommand)]
enum CharactersCommand {
    /// Create or replace a character from a JSON file ({name, system_prompt, ...}; `-` reads stdin).
    Put {
        #[arg(long)]
        slug: String,
        #[arg(long, value_name = "FILE")]
        file: PathBuf,
    },
    /// Delete a stored character.
    Delete {
        #[arg(long)]
        slug: String,
    },
}

/// A decimal amount, sent as a JSON number (the API's `consumptionLimit`).
fn number(text: &str) -> Result<serde_json::Number, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not a number such as 5 or 2.50"))
}

/// Runs one `rialto admin` command on a runtime of its own.
pub fn run(config: &Config, args: AdminArgs) -> anyhow::Result<()> {
    let call = plan(args.command)?;
    let base = base_url(args.url.as_deref(), config.gateway.listen)?;
    let token = operator_token(
        args.token_file.as_deref(),
        std::env::var(TOKEN_ENV).ok(),
        config,
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answer = runtime.block_on(send(&base, &token, &call))?;
    let shown = match args.output {
        Output::Json => serde_json::to_string_pretty(&answer)?,
        Output::Text => (call.text)(&answer),
    };
    if !shown.is_empty() {
        println!("{shown}");
    }
    Ok(())
}

/// One operator API call and how its answer reads as text.
struct Call {
    method: Method,
    /// The path's segments after `/admin/v1` (each percent-encoded when sent).
    path: Vec<String>,
    query: Vec<(&'static str, String)>,
    body: Option<Value>,
    text: Box<dyn Fn(&Value) -> String>,
}

impl Call {
    fn new(method: Method, path: &[&str]) -> Self {
        Self {
            method,
            path: path.iter().map(|s| (*s).to_owned()).collect(),
            query: Vec::new(),
            body: None,
            text: Box::new(fields),
        }
    }

    fn get(path: &[&str]) -> Self {
        Self::new(Method::GET, path)
    }

    fn body(mut self, body: Value) -> Self {
        self.body = Some(body);
        self
    }

    fn query(mut self, name: &'static str, value: Option<String>) -> Self {
        if let Some(value) = value {
            self.query.push((name, value));
        }
        self
    }

    fn text(mut self, text: impl Fn(&Value) -> String + 'static) -> Self {
        self.text = Box::new(text);
        self
    }
}

/// The call a command makes; reads `characters put`'s file.
fn plan(command: AdminCommand) -> anyhow::Result<Call> {
    Ok(match command {
        AdminCommand::Accounts { command } => plan_accounts(command),
        AdminCommand::Keys { command } => plan_keys(command),
        AdminCommand::Backends => Call::get(&["backends"]).text(|answer| {
            table(
                answer.get("data"),
                &[
                    ("MODEL", "/model"),
                    ("BACKEND", "/backend"),
                    ("STATE", "/state"),
                    ("IN FLIGHT", "/inFlight"),
                ],
                "no backends",
            )
        }),
        AdminCommand::Characters {
            command: CharactersCommand::Put { slug, file },
        } => {
            let body = read_character(&file)?;
            Call::new(Method::PUT, &["characters", &slug])
                .body(body)
                .text(|answer| fields(answer.get("data").unwrap_or(answer)))
        }
        AdminCommand::Characters {
            command: CharactersCommand::Delete { slug },
        } => {
            let message = format!("deleted character {slug}");
            Call::new(Method::DELETE, &["characters", &slug]).text(move |_| message.clone())
        }
    })
}

fn plan_accounts(command: AccountsCommand) -> Call {
    match command {
        AccountsCommand::Create { name, tier } => {
            let mut body = json!({"name": name});
            if let Some(tier) = tier {
                body["tier"] = json!(tier);
            }
            Call::new(Method::POST, &["accounts"]).body(body)
        }
        AccountsCommand::List {
            search,
            limit,
            offset,
        } => Call::get(&["accounts"])
            .query("search", search)
            .query("limit", limit.map(|n| n.to_string()))
            .query("offset", offset.map(|n| n.to_string()))
            .text(|answer| {
                let listed = table(
                    answer.get("data"),
                    &[
                        ("ID", "/id"),
                        ("NAME", "/name"),
                        ("TIER", "/tier"),
                        ("SUSPENDED", "/suspended"),
                        ("CREATED", "/createdAt"),
                        ("WALLET", "/wallet"),
                    ],
                    "no accounts",
                );
                let shown = answer["data"].as_array().map_or(0, Vec::len);
                format!(
                    "{listed}\n{shown} of {} account(s), from offset {}",
                    scalar(&answer["total"]),
                    scalar(&answer["offset"])
                )
            }),
        AccountsCommand::Get(account) => Call::get(&["accounts", &account.into_id()]),
        AccountsCommand::Suspend(account) => {
            Call::new(Method::POST, &["accounts", &account.into_id(), "suspend"])
        }
        AccountsCommand::Resume(account) => {
            Call::new(Method::POST, &["accounts", &account.into_id(), "resume"])
        }
        AccountsCommand::Credit {
            account,
            usd,
            diem,
            reference,
        } => Call::new(Method::POST, &["accounts", &account.into_id(), "credits"])
            .body(json!({"usd": usd, "diem": diem, "reference": reference})),
        AccountsCommand::Tier { account, tier } => {
            Call::new(Method::PUT, &["accounts", &account.into_id(), "tier"])
                .body(json!({"tier": tier}))
        }
        AccountsCommand::Stake {
            account,
            diem_per_day,
        } => Call::new(Method::PUT, &["accounts", &account.into_id(), "stake"])
            .body(json!({"diem_per_day": diem_per_day})),
        AccountsCommand::Usage {
            account,
            lookback,
            start_date,
            end_date,
        } => Call::get(&["accounts", &account.into_id(), "usage"])
            .query("lookback", lookback)
            .query("startDate", start_date)
            .query("endDate", end_date)
            .text(usage_text),
        AccountsCommand::LimitHits(account) => {
            Call::get(&["accounts", &account.into_id(), "limit-hits"]).text(|answer| {
                table(
                    answer.get("data"),
                    &[
                        ("TIME", "/timestamp"),
                        ("KEY", "/apiKeyId"),
                        ("MODEL", "/modelId"),
                        ("TIER", "/rateLimitTier"),
                        ("TYPE", "/rateLimitType"),
                    ],
                    "no rate-limit hits",
                )
            })
        }
    }
}

fn plan_keys(command: KeysCommand) -> Call {
    match command {
        KeysCommand::List { account } => {
            Call::get(&["accounts", &account, "keys"]).text(|answer| {
                table(
                    answer.get("data"),
                    &[
                        ("ID", "/id"),
                        ("TYPE", "/apiKeyType"),
                        ("DESCRIPTION", "/description"),
                        ("LAST 6", "/last6Chars"),
                        ("CREATED", "/createdAt"),
                        ("EXPIRES", "/expiresAt"),
                        ("LAST USED", "/lastUsedAt"),
                        ("PRIVACY", "/modelPrivacy"),
                    ],
                    "no keys",
                )
            })
        }
        KeysCommand::Create {
            account,
            key_type,
            description,
            expires_at,
            limit_usd,
            limit_diem,
            limit_period,
            model_privacy,
        } => {
            let mut body = json!({"apiKeyType": key_type, "description": description});
            if let Some(expires_at) = expires_at {
                body["expiresAt"] = json!(expires_at);
            }
            if limit_usd.is_some() || limit_diem.is_some() {
                let mut limit = serde_json::Map::new();
                if let Some(usd) = limit_usd {
                    limit.insert("usd".to_owned(), Value::Number(usd));
                }
                if let Some(diem) = limit_diem {
                    limit.insert("diem".to_owned(), Value::Number(diem));
                }
                body["consumptionLimit"] = Value::Object(limit);
            }
            if let Some(period) = limit_period {
                body["limitPeriod"] = json!(period);
            }
            if let Some(privacy) = model_privacy {
                body["modelPrivacy"] = json!(privacy);
            }
            Call::new(Method::POST, &["accounts", &account, "keys"])
                .body(body)
                .text(|answer| fields(answer.get("data").unwrap_or(answer)))
        }
        KeysCommand::Revoke { account, key } => {
            let message = format!("revoked key {key} of account {account}");
            Call::new(Method::DELETE, &["accounts", &account, "keys", &key])
                .text(move |_| message.clone())
        }
    }
}

/// A character's JSON body from `file` (`-`: stdin), checked to be a JSON
/// object before anything is sent.
fn read_character(file: &Path) -> anyhow::Result<Value> {
    let text = if file == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("reading the character from stdin")?
    } else {
        std::fs::read_to_string(file)
            .with_context(|| format!("cannot read the character file {}", file.display()))?
    };
    let body: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))?;
    ensure!(
        body.is_object(),
        "{} must hold a JSON object such as {{\"name\": ..., \"system_prompt\": ...}}",
        file.display()
    );
    Ok(body)
}

/// The gateway's base URL: `--url` (or `RIALTO_ADMIN_URL`, which clap reads
/// into it), else the configured listen address. A URL without a scheme is
/// `http://`; a trailing `/admin/v1` is the API's, not the base's.
fn base_url(flag: Option<&str>, listen: SocketAddr) -> anyhow::Result<Url> {
    let text = match flag.map(str::trim).filter(|u| !u.is_empty()) {
        Some(url) if url.contains("://") => url.to_owned(),
        Some(url) => format!("http://{url}"),
        None => format!("http://{}", reachable(listen)),
    };
    let mut url = Url::parse(&text).map_err(|error| anyhow!("--url {text:?}: {error}"))?;
    ensure!(
        matches!(url.scheme(), "http" | "https"),
        "--url {text:?} must be an http:// or https:// URL"
    );
    ensure!(url.has_host(), "--url {text:?} names no host");
    let path = url.path().trim_end_matches('/');
    let path = path.strip_suffix("/admin/v1").unwrap_or(path).to_owned();
    url.set_path(&path);
    url.set_query(None);
    url.set_fragment(None);
    Ok(url)
}

/// Where a client reaches a server listening on `listen`: an unspecified
/// address (all interfaces) is reached on the loopback.
fn reachable(listen: SocketAddr) -> SocketAddr {
    if listen.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], listen.port()))
    } else {
        listen
    }
}

/// The operator token and where it came from (named when it is refused).
struct Token {
    secret: SecretString,
    source: String,
}

/// The token: `--token-file`, else `env` (`RIALTO_OPERATOR_TOKEN`), else the
/// configuration's `operator.token` or `operator.token_file`, else the file
/// `rialto serve` writes on the embedded SQLite default.
fn operator_token(
    flag: Option<&Path>,
    env: Option<String>,
    config: &Config,
) -> anyhow::Result<Token> {
    if let Some(path) = flag {
        return token_from_file(path, "--token-file");
    }
    if let Some(token) = env.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()) {
        return Ok(Token {
            secret: token.into(),
            source: TOKEN_ENV.to_owned(),
        });
    }
    if let Some(token) = config
        .operator
        .token
        .as_ref()
        .filter(|t| !t.expose_secret().is_empty())
    {
        return Ok(Token {
            secret: token.clone(),
            source: "operator.token".to_owned(),
        });
    }
    if let Some(path) = &config.operator.token_file {
        return token_from_file(path, "operator.token_file");
    }
    let embedded = config.embedded_operator_token_path();
    if let Some(path) = embedded.as_deref().filter(|p| p.exists()) {
        return token_from_file(path, "the token `rialto serve` wrote");
    }
    let written = match embedded {
        Some(path) => format!(
            "start `rialto serve` with no token configured, which writes one to {} \
             (there is none yet)",
            path.display()
        ),
        None => "on SQLite, `rialto serve` with no token configured writes one beside \
                 the database"
            .to_owned(),
    };
    bail!(
        "no operator token: pass --token-file PATH, set {TOKEN_ENV}, set operator.token or \
         operator.token_file in the configuration (RIALTO_OPERATOR__TOKEN, \
         RIALTO_OPERATOR__TOKEN_FILE), or {written}"
    )
}

fn token_from_file(path: &Path, source: &str) -> anyhow::Result<Token> {
    // Read as the server reads it (only the trailing newline dropped), so
    // both sides hold the same token.
    let secret = rialto_core::secrets::read_file(path).with_context(|| {
        format!(
            "cannot read the operator token from {} ({source})",
            path.display()
        )
    })?;
    Ok(Token {
        secret,
        source: format!("{source} {}", path.display()),
    })
}

/// Sends `call` and answers its JSON body, or an error with the API's
/// message.
async fn send(base: &Url, token: &Token, call: &Call) -> anyhow::Result<Value> {
    // reqwest is built without a TLS provider; https needs ring's.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(120))
        .build()?;
    let url = endpoint(base, call)?;
    let mut request = client
        .request(call.method.clone(), url.clone())
        .bearer_auth(token.secret.expose_secret());
    if let Some(body) = &call.body {
        request = request.json(body);
    }
    let response = request
        .send()
        .await
        .map_err(|error| unreachable(base, &error))?;
    let status = response.status();
    let bytes = response
        .bytes()
        .await
        .with_context(|| format!("reading the answer of {} {url}", call.method))?;
    let answer: Option<Value> = serde_json::from_slice(&bytes).ok();
    if status.is_success() {
        return answer.with_context(|| {
            format!(
                "{} {url} answered {status} with no JSON: {}",
                call.method,
                excerpt(&bytes)
            )
        });
    }
    let message = match &answer {
        Some(body) => api_error(body),
        None => excerpt(&bytes),
    };
    let refused = if status == reqwest::StatusCode::UNAUTHORIZED {
        format!(" (the operator token from {})", token.source)
    } else {
        String::new()
    };
    bail!(
        "the operator API answered {} to {} {}{refused}: {message}",
        status.as_u16(),
        call.method,
        url.path()
    )
}

/// `base` + `/admin/v1/` + the call's path (each segment percent-encoded:
/// an id or slug never changes the route) + its query.
fn endpoint(base: &Url, call: &Call) -> anyhow::Result<Url> {
    let mut url = base.clone();
    url.path_segments_mut()
        .map_err(|()| anyhow!("--url {base} cannot take a path"))?
        .pop_if_empty()
        .extend(["admin", "v1"])
        .extend(&call.path);
    if !call.query.is_empty() {
        url.query_pairs_mut().extend_pairs(&call.query);
    }
    Ok(url)
}

/// An error of the request itself: a gateway that does not answer is named,
/// with how to point at another.
fn unreachable(base: &Url, error: &reqwest::Error) -> anyhow::Error {
    let mut cause = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(inner) = source {
        cause = inner.to_string();
        source = inner.source();
    }
    if error.is_connect() || error.is_timeout() {
        anyhow!(
            "the gateway at {base} is not reachable ({cause}): is `rialto serve` running? \
             Point --url (or {URL_ENV}) at its address, e.g. --url http://127.0.0.1:8080"
        )
    } else {
        anyhow!("calling the gateway at {base}: {cause}")
    }
}

/// The API's `{error, details}` as lines: the message, then each field's
/// complaints (`details` is `{"_errors": [...], "<field>": {...}}`, nested).
fn api_error(body: &Value) -> String {
    let mut message = match body.get("error") {
        Some(Value::String(error)) => error.clone(),
        // An in-band error object (`{"error": {"message": ...}}`).
        Some(Value::Object(error)) => error
            .get("message")
            .map_or_else(|| Value::Object(error.clone()).to_string(), scalar),
        _ => body.to_string(),
    };
    let mut lines = Vec::new();
    if let Some(details) = body.get("details") {
        detail_lines("", details, &mut lines);
    }
    for line in lines {
        message.push_str("\n  ");
        message.push_str(&line);
    }
    message
}

fn detail_lines(path: &str, details: &Value, lines: &mut Vec<String>) {
    let Some(object) = details.as_object() else {
        return;
    };
    for (key, value) in object {
        if key == "_errors" {
            for error in value.as_array().into_iter().flatten() {
                let error = scalar(error);
                lines.push(if path.is_empty() {
                    error
                } else {
                    format!("{path}: {error}")
                });
            }
        } else {
            let inner = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            detail_lines(&inner, value, lines);
        }
    }
}

/// The start of a body that is not JSON, for an error message.
fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    match text.char_indices().nth(300) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None if text.is_empty() => "(an empty body)".to_owned(),
        None => text.to_owned(),
    }
}

/// A JSON value as one cell: strings bare, nothing as `-`, a list of
/// scalars joined.
fn scalar(value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::String(text) => text.clone(),
        Value::Array(items) if items.is_empty() => "-".to_owned(),
        Value::Array(items) if items.iter().all(|i| !i.is_object() && !i.is_array()) => {
            items.iter().map(scalar).collect::<Vec<_>>().join(", ")
        }
        other => other.to_string(),
    }
}

/// An object as aligned `key: value` lines, nested members as `a.b`.
fn fields(value: &Value) -> String {
    let mut lines = Vec::new();
    flatten("", value, &mut lines);
    let width = lines
        .iter()
        .map(|(key, _)| key.chars().count() + 1)
        .max()
        .unwrap_or(0);
    lines
        .iter()
        .map(|(key, value)| format!("{:width$} {value}", format!("{key}:")))
        .collect::<Vec<_>>()
        .join("\n")
}

fn flatten(prefix: &str, value: &Value, lines: &mut Vec<(String, String)>) {
    let join = |key: &str| {
        if prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{prefix}.{key}")
        }
    };
    match value {
        Value::Object(object) if !object.is_empty() => {
            // A member's own values first, then its nested ones.
            let nested = |member: &Value| match member {
                Value::Object(inner) => !inner.is_empty(),
                Value::Array(items) => items.iter().any(|i| i.is_object() || i.is_array()),
                _ => false,
            };
            let (inner, own): (Vec<_>, Vec<_>) = object.iter().partition(|(_, m)| nested(m));
            for (key, member) in own.into_iter().chain(inner) {
                flatten(&join(key), member, lines);
            }
        }
        Value::Array(items) if items.iter().any(|i| i.is_object() || i.is_array()) => {
            for (index, item) in items.iter().enumerate() {
                flatten(&format!("{prefix}[{index}]"), item, lines);
            }
        }
        other if prefix.is_empty() => lines.push(("value".to_owned(), scalar(other))),
        other => lines.push((prefix.to_owned(), scalar(other))),
    }
}

/// `rows` (a JSON array) as a table of `columns` (header, JSON pointer into
/// each row); `empty` when there are none.
fn table(rows: Option<&Value>, columns: &[(&str, &str)], empty: &str) -> String {
    let rows = rows
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    if rows.is_empty() {
        return empty.to_owned();
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            columns
                .iter()
                .map(|(_, pointer)| row.pointer(pointer).map_or_else(|| "-".to_owned(), scalar))
                .collect()
        })
        .collect();
    let headers: Vec<String> = columns.iter().map(|(h, _)| (*h).to_owned()).collect();
    let widths: Vec<usize> = (0..columns.len())
        .map(|c| {
            std::iter::once(&headers)
                .chain(&cells)
                .map(|row| row[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    std::iter::once(&headers)
        .chain(&cells)
        .map(|row| {
            let line: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(cell, width)| format!("{cell:width$}"))
                .collect();
            line.join("  ").trim_end().to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `accounts usage` as text: the range, then spend by day, model and key.
fn usage_text(answer: &Value) -> String {
    [
        format!("lookback: {}", scalar(&answer["lookback"])),
        format!(
            "\n\nby day:\n{}",
            table(
                answer.get("byDate"),
                &[("DATE", "/date"), ("USD", "/USD"), ("DIEM", "/DIEM")],
                "no spend",
            )
        ),
        format!(
            "\n\nby model:\n{}",
            table(
                answer.get("byModel"),
                &[
                    ("MODEL", "/modelName"),
                    ("TYPE", "/modelType"),
                    ("USD", "/totalUsd"),
                    ("DIEM", "/totalDiem"),
                    ("UNITS", "/totalUnits"),
                    ("UNIT", "/unitType"),
                ],
                "no spend",
            )
        ),
        format!(
            "\n\nby key:\n{}",
            table(
                answer.get("byKey"),
                &[
                    ("KEY", "/apiKeyId"),
                    ("DESCRIPTION", "/description"),
                    ("USD", "/totalUsd"),
                    ("DIEM", "/totalDiem"),
                    ("UNITS", "/totalUnits"),
                ],
                "no spend",
            )
        ),
    ]
    .concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_defaults_to_the_listen_address_reached_on_the_loopback() {
        let listen = |s: &str| s.parse::<SocketAddr>().unwrap();
        let url = |flag, addr| base_url(flag, listen(addr)).unwrap().to_string();
        assert_eq!(url(None, "0.0.0.0:8080"), "http://127.0.0.1:8080/");
        assert_eq!(url(None, "[::]:8080"), "http://127.0.0.1:8080/");
        assert_eq!(url(None, "10.1.2.3:9000"), "http://10.1.2.3:9000/");
        assert_eq!(url(None, "[::1]:8080"), "http://[::1]:8080/");
        assert_eq!(
            url(Some("https://api.example.com/"), "0.0.0.0:8080"),
            "https://api.example.com/"
        );
        assert_eq!(
            url(Some("gw.internal:8080/admin/v1/"), "0.0.0.0:8080"),
            "http://gw.internal:8080/"
        );
        assert_eq!(
            url(Some("https://example.com/rialto"), "0.0.0.0:8080"),
            "https://example.com/rialto"
        );
        assert!(base_url(Some("ftp://example.com"), listen("0.0.0.0:1")).is_err());
    }

    /// A folder of its own under the system's temporary one, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let path = std::env::temp_dir().join(format!(
                "rialto-admin-{name}-{}-{nanos}",
                std::process::id()
            ));
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_token_comes_from_the_flag_the_environment_the_configuration_or_serve() {
        let dir = TempDir::new("token");
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let db = format!("sqlite://{}/rialto.db", dir.path().display());
        let config = |extra: &str| {
            Config::from_toml(&format!("[database]\nurl = \"{db}\"\n{extra}")).unwrap()
        };
        let token = |flag: Option<&Path>, env: Option<&str>, config: &Config| {
            operator_token(flag, env.map(str::to_owned), config)
                .map(|t| t.secret.expose_secret().to_owned())
        };
        let bare = config("");
        let message = token(None, None, &bare).unwrap_err().to_string();
        for way in [
            "--token-file",
            "RIALTO_OPERATOR_TOKEN",
            "operator.token",
            "operator.token_file",
            "rialto serve",
        ] {
            assert!(message.contains(way), "{message} lacks {way}");
        }
        // What `rialto serve` wrote beside the database.
        write("operator-token", "from-serve\n");
        assert_eq!(token(None, None, &bare).unwrap(), "from-serve");
        // Read as the server reads it: only the trailing newline goes.
        let file = write("token", "from-file\n");
        let configured = config(&format!(
            "[operator]\ntoken_file = \"{}\"\n",
            file.display()
        ));
        assert_eq!(token(None, None, &configured).unwrap(), "from-file");
        let inline = config("[operator]\ntoken = \"inline\"\n");
        assert_eq!(token(None, None, &inline).unwrap(), "inline");
        assert_eq!(token(None, Some("env"), &inline).unwrap(), "env");
        let flag = write("flag", "flagged");
        assert_eq!(token(Some(&flag), Some("env"), &inline).unwrap(), "flagged");
        let empty = write("empty", "\n");
        assert!(token(Some(&empty), None, &bare).is_err());
        assert!(token(Some(&dir.path().join("none")), None, &bare).is_err());
    }

    #[test]
    fn calls_go_under_admin_v1_with_their_segments_encoded() {
        let base = |url: &str| base_url(Some(url), "127.0.0.1:1".parse().unwrap()).unwrap();
        let call = plan_keys(KeysCommand::Revoke {
            account: "a/../b".to_owned(),
            key: "k?x".to_owned(),
        });
        assert_eq!(
            endpoint(&base("http://gw:8080"), &call).unwrap().as_str(),
            "http://gw:8080/admin/v1/accounts/a%2F..%2Fb/keys/k%3Fx"
        );
        let call = plan_accounts(AccountsCommand::List {
            search: Some("a&b c".to_owned()),
            limit: Some(5),
            offset: None,
        });
        assert_eq!(
            endpoint(&base("https://example.com/rialto/"), &call)
                .unwrap()
                .as_str(),
            "https://example.com/rialto/admin/v1/accounts?search=a%26b+c&limit=5"
        );
    }

    #[test]
    fn errors_read_as_the_message_and_each_field() {
        let body = json!({
            "error": "Invalid request parameters",
            "details": {"_errors": [], "tier": {"_errors": ["Unknown tier; expected one of: standard"]},
                "consumptionLimit": {"_errors": [], "usd": {"_errors": ["Too much"]}}}
        });
        let text = api_error(&body);
        assert!(text.starts_with("Invalid request parameters\n"), "{text}");
        assert!(text.contains("\n  tier: Unknown tier; expected one of: standard"));
        assert!(text.contains("\n  consumptionLimit.usd: Too much"));
        assert_eq!(api_error(&json!({"error": "Not found"})), "Not found");
    }

    #[test]
    fn answers_read_as_fields_and_tables() {
        let created =
            json!({"id": "a1", "api_key": {"id": "k1", "key": "SECRET", "type": "ADMIN"}});
        assert_eq!(
            fields(&created),
            "id:           a1\napi_key.id:   k1\napi_key.key:  SECRET\napi_key.type: ADMIN"
        );
        let rows = json!([{"model": "m", "backend": "long-name", "inFlight": 0, "state": null}]);
        assert_eq!(
            table(
                Some(&rows),
                &[
                    ("MODEL", "/model"),
                    ("BACKEND", "/backend"),
                    ("STATE", "/state"),
                    ("IN FLIGHT", "/inFlight")
                ],
                "none"
            ),
            "MODEL  BACKEND    STATE  IN FLIGHT\nm      long-name  -      0"
        );
        assert_eq!(table(Some(&json!([])), &[("A", "/a")], "none"), "none");
    }
}
