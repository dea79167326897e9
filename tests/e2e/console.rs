//! The web console (`[console] enabled`, `/console/`), one process.
//!
//! `browser`: tests/console/console.test.mjs drives Debian's Chromium
//! (playwright-core, `make browser`) through the operator's, the account
//! holder's and a wallet's flows, checks every page with axe-core and writes
//! a screenshot of each under `<target>/console-screenshots/`. With
//! `RIALTO_CONSOLE_SCREENSHOTS=<dir>` (`make console-screenshots`) the two the
//! README shows are copied there.
//!
//! The rest is the console's security, over plain HTTP without a browser:
//! forms refused without their CSRF token or from another origin, sign-in
//! forms' double-submit token, tampered, foreign and expired sessions, and no
//! console at all unless enabled.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use reqwest::{Client, RequestBuilder, Response, StatusCode};
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::{free_port, models_toml};

/// The wallet of the browser's Sign-In-With-X (the first of the usual
/// development mnemonic's accounts).
const WALLET_KEY: &str = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";
/// A priced chat model of [`models_toml`], on the mock upstream.
const CHAT_MODEL: &str = "mock-chat";
/// The policy every console page is served with (at least these directives).
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   frame-ancestors 'none'; form-action 'self'; base-uri 'none'";
/// The screenshots the README shows: (the test's, the committed file's name).
const README_SCREENSHOTS: [(&str, &str); 2] = [
    ("operator-account.png", "operator-account.png"),
    ("account-usage.png", "account-usage.png"),
];

/// A one-process sandbox serving the console with `console` appended to its
/// `[console]` section, the models of [`models_toml`] on `mock`, on a port
/// chosen here so that `[wallet] domains` can name it (a wallet's sign-in
/// message is bound to the host the browser reaches).
async fn console_sandbox(mock: &MockUpstream, console: &str) -> Sandbox {
    let port = free_port();
    let config = format!(
        "{}\n[console]\nenabled = true\n{console}\n\n[wallet]\ndomains = [\"127.0.0.1:{port}\", \"localhost:{port}\"]\n",
        models_toml(&mock.base_url())
    );
    Sandbox::builder(Topology::OneProcess)
        .config(&config)
        .env("RIALTO_GATEWAY__LISTEN", &format!("127.0.0.1:{port}"))
        .start()
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------
// The browser tests.

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The cargo target folder this test binary was built in
/// (`<target>/<profile>/deps/e2e-…`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| repo_root().join("target"))
}

/// Chromium, node and the npm packages of tests/console: fails (never skips)
/// when one is missing, naming `make browser`.
fn browser_tools() -> (PathBuf, PathBuf) {
    let chromium = std::env::var_os("E2E_CHROMIUM")
        .map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from);
    assert!(
        chromium.exists(),
        "{} is missing: run `make browser` (it installs Debian's chromium and chromium-driver, \
         and the npm packages of tests/console)",
        chromium.display()
    );
    let modules = repo_root().join("tests/console/node_modules");
    for file in [
        "playwright-core/package.json",
        "axe-core/axe.min.js",
        "viem/package.json",
    ] {
        assert!(
            modules.join(file).exists(),
            "{} is missing: run `make browser` (npm ci in tests/console)",
            modules.join(file).display()
        );
    }
    let node = std::env::var_os("E2E_NODE").map_or_else(|| PathBuf::from("node"), PathBuf::from);
    let works = std::process::Command::new(&node)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        works,
        "{} does not run: run `make browser` (it installs nodejs and npm)",
        node.display()
    );
    (chromium, node)
}

/// Runs `node console.test.mjs` with `envs`, its output streamed into the
/// test's; returns whether it exited 0.
async fn run_browser_script(node: &Path, envs: &[(&str, String)]) -> bool {
    let dir = repo_root().join("tests/console");
    let mut child = tokio::process::Command::new(node)
        .arg("console.test.mjs")
        .current_dir(&dir)
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    let run = async {
        let (mut out_open, mut err_open) = (true, true);
        while out_open || err_open {
            tokio::select! {
                line = out.next_line(), if out_open => match line.unwrap() {
                    Some(line) => println!("{line}"),
                    None => out_open = false,
                },
                line = err.next_line(), if err_open => match line.unwrap() {
                    Some(line) => println!("[stderr] {line}"),
                    None => err_open = false,
                },
            }
        }
        child.wait().await.unwrap()
    };
    match tokio::time::timeout(Duration::from_secs(300), run).await {
        Ok(status) => {
            println!("console.test.mjs: {status}");
            status.success()
        }
        Err(_) => {
            println!("console.test.mjs: still running after 300 s, killed");
            false
        }
    }
}

/// The last `n` lines of the sandbox's logs, for a failure's message.
fn log_tail(sandbox: &Sandbox, n: usize) -> String {
    let logs = sandbox.logs();
    let lines: Vec<&str> = logs.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Sign in, create an account, credit it, create a key, chat with it, see
/// the usage and the balance, revoke the key, see the chat refused; the
/// account holder's pages with its ADMIN key; a wallet's sign-in through an
/// injected EIP-1193 provider. axe-core on every page; screenshots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser() {
    let (chromium, node) = browser_tools();
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = console_sandbox(&mock, "").await;
    let out = target_dir().join("console-screenshots");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    println!("console screenshots: {}", out.display());
    let passed = run_browser_script(
        &node,
        &[
            ("RIALTO_URL", sandbox.url.clone()),
            ("OPERATOR_TOKEN", sandbox.operator_token.clone()),
            ("OUT_DIR", out.display().to_string()),
            ("CHROMIUM", chromium.display().to_string()),
            ("WALLET_KEY", WALLET_KEY.to_owned()),
            ("CHAT_MODEL", CHAT_MODEL.to_owned()),
        ],
    )
    .await;
    assert!(
        passed,
        "the console's browser tests failed (above; screenshots in {}); the gateway's last log lines:\n{}",
        out.display(),
        log_tail(&sandbox, 60)
    );
    if let Some(docs) = std::env::var_os("RIALTO_CONSOLE_SCREENSHOTS") {
        let docs = PathBuf::from(docs);
        std::fs::create_dir_all(&docs).unwrap();
        for (taken, committed) in README_SCREENSHOTS {
            std::fs::copy(out.join(taken), docs.join(committed)).unwrap();
            println!("copied {} to {}", taken, docs.join(committed).display());
        }
    }
}

// ---------------------------------------------------------------------------
// Security, over HTTP.

/// `application/x-www-form-urlencoded` of `fields`.
fn form(fields: &[(&str, &str)]) -> String {
    fn encode(text: &str) -> String {
        text.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                b' ' => "+".to_owned(),
                _ => format!("%{b:02X}"),
            })
            .collect()
    }
    fields
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// The `Set-Cookie` header setting `name`, whole (value and attributes).
fn set_cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(&format!("{name}=")))
        .map(str::to_owned)
}

/// The value of cookie `name` set by `headers`.
fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    let header = set_cookie(headers, name)?;
    let pair = header.split(';').next()?;
    Some(pair[name.len() + 1..].to_owned())
}

/// The `Cookie` header that sends back the console session `headers` set.
fn session_cookie(headers: &HeaderMap) -> String {
    format!(
        "rialto_console={}",
        cookie_value(headers, "rialto_console").expect("a console session cookie")
    )
}

/// The hidden `csrf` input's value in `html`, in `form#<form_id>` when given.
fn csrf_in(html: &str, form_id: Option<&str>) -> String {
    let scope = match form_id {
        Some(id) => {
            let start = html
                .find(&format!("id=\"{id}\""))
                .unwrap_or_else(|| panic!("no form#{id} in the page:\n{html}"));
            let end = html[start..]
                .find("</form>")
                .map_or(html.len(), |e| start + e);
            &html[start..end]
        }
        None => html,
    };
    let name = scope
        .find("name=\"csrf\"")
        .unwrap_or_else(|| panic!("no csrf input in form {form_id:?}:\n{scope}"));
    let tag_start = scope[..name].rfind('<').unwrap();
    let tag_end = name + scope[name..].find('>').unwrap();
    let tag = &scope[tag_start..tag_end];
    let value = tag
        .find("value=\"")
        .unwrap_or_else(|| panic!("the csrf input has no value: {tag}"))
        + "value=\"".len();
    let value = &tag[value..value + tag[value..].find('"').unwrap()];
    assert!(!value.is_empty(), "an empty csrf: {tag}");
    value.replace("&amp;", "&")
}

/// Where a redirect points, as a path (`Location` may be absolute).
fn location(response: &Response, base: &str) -> String {
    let location = response
        .headers()
        .get(LOCATION)
        .unwrap_or_else(|| panic!("{} {}: no Location", response.status(), response.url()))
        .to_str()
        .unwrap();
    location.strip_prefix(base).unwrap_or(location).to_owned()
}

/// The console of a sandbox, through a client that follows no redirect and
/// keeps no cookie (each request says which it sends).
struct Console {
    base: String,
    http: Client,
}

/// A signed-in console session: its cookie and the CSRF token of its forms.
struct Session {
    cookie: String,
    csrf: String,
}

impl Console {
    fn new(sandbox: &Sandbox) -> Console {
        // Installs rustls's crypto provider, which reqwest needs.
        rialto_test_kit::sandbox::http_client().unwrap();
        Console {
            base: sandbox.url.clone(),
            http: Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
        }
    }

    fn get(&self, path: &str, cookie: Option<&str>) -> RequestBuilder {
        let request = self.http.get(format!("{}{path}", self.base));
        match cookie {
            Some(cookie) => request.header("cookie", cookie),
            None => request,
        }
    }

    /// A form POST from this origin (`Origin` set) with `cookie` (none
    /// when empty).
    fn post(&self, path: &str, cookie: &str, fields: &[(&str, &str)]) -> RequestBuilder {
        self.post_from(Some(&self.base), path, cookie, fields)
    }

    /// The new-account form (`name`, tier `standard`) posted from this
    /// origin with `cookie` and `csrf`: what the refusal checks forge.
    fn new_account(&self, cookie: &str, name: &str, csrf: &str) -> RequestBuilder {
        self.post(
            "/console/accounts",
            cookie,
            &[("name", name), ("tier", "standard"), ("csrf", csrf)],
        )
    }

    /// A form POST with `Origin: origin` (none when `None`).
    fn post_from(
        &self,
        origin: Option<&str>,
        path: &str,
        cookie: &str,
        fields: &[(&str, &str)],
    ) -> RequestBuilder {
        let mut request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form(fields));
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        if !cookie.is_empty() {
            request = request.header("cookie", cookie);
        }
        request
    }

    /// The login page's pre-session cookie (`name=value`) and its forms' csrf.
    async fn login_page(&self) -> (String, String) {
        let response = self.get("/console/login", None).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "GET /console/login");
        let value = cookie_value(response.headers(), "rialto_console_login")
            .expect("GET /console/login sets no rialto_console_login cookie");
        let html = response.text().await.unwrap();
        // The form's token goes with the cookie (the same value, or one
        // derived from it): a double submit.
        let csrf = csrf_in(&html, Some("operator-login"));
        (format!("rialto_console_login={value}"), csrf)
    }

    /// Signs in with the operator token; the session and its csrf (read
    /// from `/console/accounts`).
    async fn sign_in_operator(&self, token: &str) -> Session {
        let (login, csrf) = self.login_page().await;
        let response = self
            .post(
                "/console/login/operator",
                &login,
                &[("token", token), ("csrf", &csrf)],
            )
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.status(),
            StatusCode::SEE_OTHER,
            "operator sign-in: {}",
            response.text().await.unwrap()
        );
        assert_eq!(location(&response, &self.base), "/console/accounts");
        let header = set_cookie(response.headers(), "rialto_console")
            .expect("operator sign-in sets no rialto_console cookie");
        let attributes = header.to_ascii_lowercase();
        for attribute in ["httponly", "samesite=strict", "path=/console"] {
            assert!(
                attributes.split(';').any(|a| a.trim() == attribute),
                "the session cookie lacks {attribute}: {header}"
            );
        }
        let cookie = session_cookie(response.headers());
        let page = self
            .get("/console/accounts", Some(&cookie))
            .send()
            .await
            .unwrap();
        assert_eq!(page.status(), StatusCode::OK, "GET /console/accounts");
        let csrf = csrf_in(&page.text().await.unwrap(), Some("create-account"));
        Session { cookie, csrf }
    }
}

/// A refusal: 403, an HTML page with `role="alert"`.
async fn assert_refused(response: Response, what: &str) {
    let status = response.status();
    let body = response.text().await.unwrap();
    assert_eq!(status, StatusCode::FORBIDDEN, "{what}: {body}");
    assert!(
        body.contains("role=\"alert\""),
        "{what}: the 403 page has no role=\"alert\":\n{body}"
    );
}

/// `value` with one character of its middle changed.
fn tampered(value: &str) -> String {
    let mut chars: Vec<char> = value.chars().collect();
    let middle = chars.len() / 2;
    chars[middle] = if chars[middle] == 'A' { 'B' } else { 'A' };
    chars.into_iter().collect()
}

/// A form posted without its csrf, with a wrong one, from another origin
/// (`Origin`, `Sec-Fetch-Site: cross-site`) is refused and changes nothing;
/// the same form from the page is served. Sign-in forms need their
/// double-submit token; a bad operator token is a 401. Pages carry the
/// contract's Content-Security-Policy; assets are immutable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forms_need_the_csrf_token_and_this_origin() {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = console_sandbox(&mock, "").await;
    let console = Console::new(&sandbox);

    // Sign-in forms: the login cookie and the same value in the form.
    let (login, csrf) = console.login_page().await;
    let token = sandbox.operator_token.as_str();
    let refused = [
        (
            "operator sign-in without csrf",
            console.post("/console/login/operator", &login, &[("token", token)]),
        ),
        (
            "operator sign-in with another csrf",
            console.post(
                "/console/login/operator",
                &login,
                &[("token", token), ("csrf", &tampered(&csrf))],
            ),
        ),
        (
            "operator sign-in without the login cookie",
            console.post(
                "/console/login/operator",
                "",
                &[("token", token), ("csrf", &csrf)],
            ),
        ),
        (
            "operator sign-in from another origin",
            console.post_from(
                Some("http://evil.example"),
                "/console/login/operator",
                &login,
                &[("token", token), ("csrf", &csrf)],
            ),
        ),
    ];
    for (what, request) in refused {
        let response = request.send().await.unwrap();
        assert!(
            set_cookie(response.headers(), "rialto_console").is_none(),
            "{what} set a session cookie"
        );
        assert_refused(response, what).await;
    }
    let response = console
        .post(
            "/console/login/operator",
            &login,
            &[("token", "not-the-operator-token"), ("csrf", &csrf)],
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert!(set_cookie(response.headers(), "rialto_console").is_none());
    let body = response.text().await.unwrap();
    assert!(body.contains("role=\"alert\"") && body.contains("id=\"operator-login\""));

    let session = console.sign_in_operator(token).await;
    let page = console
        .get("/console/accounts", Some(&session.cookie))
        .send()
        .await
        .unwrap();
    let policy = page.headers()["content-security-policy"].to_str().unwrap();
    let directives: Vec<&str> = policy.split(';').map(str::trim).collect();
    for directive in CSP.split(';').map(str::trim) {
        assert!(
            directives.contains(&directive),
            "Content-Security-Policy {policy:?} lacks {directive:?}"
        );
    }
    let asset = console
        .get("/console/assets/app.css", None)
        .send()
        .await
        .unwrap();
    assert_eq!(asset.status(), StatusCode::OK);
    // Cached by browsers (the contract says immutable; a day is served).
    let cache = asset.headers()["cache-control"].to_str().unwrap();
    let max_age = cache
        .split(',')
        .find_map(|d| d.trim().strip_prefix("max-age=")?.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        cache.contains("immutable") || max_age >= 3600,
        "app.css: cache-control {cache}"
    );

    let create_from = |origin: Option<&str>, name: &'static str, csrf: Option<&str>| {
        let mut fields = vec![("name", name), ("tier", "standard")];
        if let Some(csrf) = csrf {
            fields.push(("csrf", csrf));
        }
        console.post_from(origin, "/console/accounts", &session.cookie, &fields)
    };
    let create =
        |name: &'static str, csrf: Option<&str>| create_from(Some(&console.base), name, csrf);
    let evil = Some("http://evil.example");
    let csrf = session.csrf.as_str();
    let refused = [
        ("a form without csrf", create("refused-1", None)),
        (
            "a form with a wrong csrf",
            create("refused-2", Some("not-the-token")),
        ),
        (
            "a form with a tampered csrf",
            create("refused-3", Some(&tampered(csrf))),
        ),
        (
            "a form with Origin: http://evil.example",
            create_from(evil, "refused-4", Some(csrf)),
        ),
        (
            "a form with Sec-Fetch-Site: cross-site",
            create("refused-5", Some(csrf)).header("sec-fetch-site", "cross-site"),
        ),
        (
            "a form with Origin: null",
            create_from(Some("null"), "refused-6", Some(csrf)),
        ),
    ];
    for (what, request) in refused {
        assert_refused(request.send().await.unwrap(), what).await;
    }
    // A form without Origin but from another site (Sec-Fetch-Site only).
    let response = create_from(None, "refused-7", Some(csrf))
        .header("sec-fetch-site", "cross-site")
        .send()
        .await
        .unwrap();
    assert_refused(
        response,
        "a form with Sec-Fetch-Site: cross-site and no Origin",
    )
    .await;

    // The same form as the browser posts it is served.
    let response = create("accepted", Some(csrf))
        .header("sec-fetch-site", "same-origin")
        .send()
        .await
        .unwrap();
    let status = response.status();
    let body = response.text().await.unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("id=\"new-key\""), "{body}");

    // None of the refused forms made an account.
    let list = console
        .get("/console/accounts?search=refused", Some(&session.cookie))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !list.contains("refused-"),
        "a refused form made an account:\n{list}"
    );
    let list = console
        .get("/console/accounts?search=accepted", Some(&session.cookie))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(list.contains(">accepted<"), "{list}");
}

/// A tampered cookie, a cookie another gateway signed (another origin's
/// session) and no cookie lead GETs to the login page and are refused on
/// POSTs; an account holder's session is not an operator's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_and_foreign_sessions_are_refused() {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = console_sandbox(&mock, "").await;
    let other = console_sandbox(&mock, "").await;
    let console = Console::new(&sandbox);
    let elsewhere = Console::new(&other);
    let session = console.sign_in_operator(&sandbox.operator_token).await;
    let foreign = elsewhere.sign_in_operator(&other.operator_token).await;

    let value = &session.cookie["rialto_console=".len()..];
    let cookies = [
        (
            "a tampered session cookie",
            format!("rialto_console={}", tampered(value)),
        ),
        (
            "a truncated session cookie",
            format!("rialto_console={}", &value[..value.len() - 4]),
        ),
        ("another gateway's session cookie", foreign.cookie.clone()),
    ];
    for (what, cookie) in &cookies {
        let response = console
            .get("/console/accounts", Some(cookie))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SEE_OTHER, "GET with {what}");
        let to = location(&response, &console.base);
        assert!(
            to == "/console/login" || to.starts_with("/console/login?"),
            "GET with {what}: to {to}"
        );
        for csrf in [&session.csrf, &foreign.csrf] {
            let response = console
                .new_account(cookie, "forged", csrf)
                .send()
                .await
                .unwrap();
            assert_refused(response, &format!("POST with {what}")).await;
        }
    }
    let response = console.get("/console/accounts", None).send().await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::SEE_OTHER,
        "GET without a session"
    );
    assert!(location(&response, &console.base).starts_with("/console/login"));
    let response = console
        .new_account("", "forged", &session.csrf)
        .send()
        .await
        .unwrap();
    assert_refused(response, "POST without a session").await;
    // The real session still works.
    let response = console
        .get("/console/accounts", Some(&session.cookie))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    // An account holder (ADMIN key) is no operator.
    let account = sandbox.create_account("holder").await.unwrap();
    let (login, csrf) = console.login_page().await;
    let response = console
        .post(
            "/console/login/key",
            &login,
            &[("api_key", &account.admin_key), ("csrf", &csrf)],
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(location(&response, &console.base), "/console/account");
    let holder = session_cookie(response.headers());
    let response = console
        .get("/console/account", Some(&holder))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let response = console
        .get("/console/accounts", Some(&holder))
        .send()
        .await
        .unwrap();
    assert_ne!(
        response.status(),
        StatusCode::OK,
        "an ADMIN key's session was served the operator's /console/accounts"
    );
    let response = console
        .post(
            &format!("/console/accounts/{}/credit", account.id),
            &holder,
            &[
                ("usd", "100"),
                ("diem", "0"),
                ("reference", "forged"),
                ("csrf", &session.csrf),
            ],
        )
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_client_error(),
        "an ADMIN key's session credited an account: {}",
        response.status()
    );
}

/// With `session_ttl_secs = 1`, a session 2.5 s old leads a GET to the login
/// page (which says it expired) and has its POSTs refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_session_is_refused() {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = console_sandbox(&mock, "session_ttl_secs = 1").await;
    let console = Console::new(&sandbox);
    let session = console.sign_in_operator(&sandbox.operator_token).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let response = console
        .get("/console/accounts", Some(&session.cookie))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let to = location(&response, &console.base);
    assert_eq!(to, "/console/login?expired=1");
    let page = console.get(&to, None).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let html = page.text().await.unwrap();
    assert!(
        html.contains("role=\"alert\"") && html.contains("Your session has expired"),
        "{html}"
    );

    let response = console
        .new_account(&session.cookie, "too-late", &session.csrf)
        .send()
        .await
        .unwrap();
    assert_refused(response, "a POST with an expired session").await;
}

/// Without `[console] enabled`, there is no console.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_off_unless_enabled() {
    let mock = MockUpstream::start().await.unwrap();
    for config in ["", "[console]\nenabled = false\n"] {
        let sandbox = Sandbox::builder(Topology::OneProcess)
            .config(&format!("{}\n{config}", models_toml(&mock.base_url())))
            .start()
            .await
            .unwrap();
        let console = Console::new(&sandbox);
        for path in [
            "/console/login",
            "/console/",
            "/console/accounts",
            "/console/account",
            "/console/assets/app.css",
        ] {
            let response = console.get(path, None).send().await.unwrap();
            assert_eq!(
                response.status(),
                StatusCode::NOT_FOUND,
                "GET {path} with {config:?}"
            );
        }
        let response = console
            .post(
                "/console/login/operator",
                "",
                &[("token", &sandbox.operator_token), ("csrf", "x")],
            )
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "{config:?}");
    }
}
