//! Configuration reloads without a restart.
//!
//! The configuration file (`--config`, else `RIALTO_CONFIG`) is read every
//! [`POLL_EVERY`] and reloaded when its bytes changed: in Kubernetes a
//! mounted ConfigMap changes in place (the kubelet swaps a symlink, which
//! inotify on the file would miss). SIGHUP reloads it at once, changed or
//! not.
//!
//! A reload is validated whole ([`Config::load`], then everything a
//! service builds from it that can fail: routes, tokenizers) before
//! anything changes, then applied service by service, each swap atomic;
//! or it is refused, with the reason in the log, and the previous
//! configuration stays in force. Either way it is counted in
//! `rialto_config_reloads_total{outcome}`. In a split deployment each
//! process reloads its own part from its own file.
//!
//! What reloads: the catalog (`[[models]]`: the gateway's models, aliases,
//! headers and tokenizers; billing's prices; the router's backends, those
//! unchanged keeping their circuits; the limiter's global windows), the
//! configured `[[characters]]`, and `[limits]`' `tiers`, `overrides`,
//! `user` windows and `default_completion_tokens`. The limiter's windows
//! and billing's ledgers are never rebuilt. Every other key needs a
//! restart: a reload that changes one applies the rest and names it in a
//! warning (see [`restart_keys`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rialto_billing::BillingClient;
use rialto_core::Config;
use rialto_gateway::Gateway;
use rialto_limiter::RateLimiter;
use rialto_router::RouterClient;
use secrecy::{ExposeSecret, SecretString};

/// How often the configuration file is read to see whether it changed.
const POLL_EVERY: Duration = Duration::from_secs(2);

/// What a reload changes in this process: the services' own objects, each
/// reloaded only when it runs here.
#[derive(Clone)]
pub(crate) struct Targets {
    /// The gateway of this process, when it runs one.
    pub gateway: Option<Arc<Gateway>>,
    /// The limits the gateway resolves (its policy; the windows are the
    /// limiter replicas').
    pub limiter: RateLimiter,
    /// Billing: its prices are reloaded when it runs in this process.
    pub billing: BillingClient,
    /// The router: its routes are reloaded when it runs in this process.
    pub router: RouterClient,
}

/// Watches `path` (and SIGHUP) for the life of the process, reloading
/// `targets` from it.
pub(crate) fn spawn(path: Option<PathBuf>, targets: Targets) {
    tokio::spawn(watch(path, Arc::new(targets)));
}

async fn watch(path: Option<PathBuf>, targets: Arc<Targets>) {
    let mut hangups = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(signal) => Some(signal),
        Err(error) => {
            tracing::warn!(%error, "cannot listen for SIGHUP; the file is still watched");
            None
        }
    };
    let Some(path) = path else {
        // Defaults and environment only: nothing can change.
        loop {
            hangup(&mut hangups).await;
            tracing::warn!(
                "SIGHUP: no configuration file to reload (start with --config or RIALTO_CONFIG)"
            );
            rialto_core::metrics::metrics().count_config_reload("refused");
        }
    };
    // What the process was started with, as far as the file goes: the keys
    // only a restart applies are compared with it.
    let (mut seen, started) = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || {
            let bytes = std::fs::read(&path).ok();
            let config = bytes.as_ref().and_then(|_| Config::load(Some(&path)).ok());
            // A file unreadable or invalid now: its first valid content is
            // a change.
            (config.as_ref().and(bytes), config)
        })
        .await
        .unwrap_or_default()
    };
    let started = Arc::new(started);
    tracing::info!(path = %path.display(), "watching the configuration file for reloads");
    let mut every = tokio::time::interval(POLL_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unreadable = false;
    loop {
        let forced = tokio::select! {
            _ = every.tick() => false,
            () = hangup(&mut hangups) => true,
        };
        let bytes = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || std::fs::read(path)).await
        };
        let bytes = match bytes {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(error)) => {
                // Logged once while it lasts (a ConfigMap swap is atomic; a
                // file being replaced by hand may vanish for a moment).
                if forced || !unreadable {
                    tracing::warn!(path = %path.display(), %error, "cannot read the configuration file; the configuration in force stays");
                }
                if forced {
                    rialto_core::metrics::metrics().count_config_reload("refused");
                }
                unreadable = true;
                continue;
            }
            Err(_) => continue,
        };
        unreadable = false;
        if !forced && seen.as_deref() == Some(bytes.as_slice()) {
            continue;
        }
        // A refused content is not tried again until it changes (or SIGHUP).
        seen = Some(bytes);
        let outcome = {
            let (path, targets, started) =
                (path.clone(), Arc::clone(&targets), Arc::clone(&started));
            tokio::task::spawn_blocking(move || reload(&path, &targets, started.as_ref().as_ref()))
                .await
                .unwrap_or_else(|error| Err(format!("the reload failed: {error}")))
        };
        let metrics = rialto_core::metrics::metrics();
        match outcome {
            Ok(restart) => {
                metrics.count_config_reload("applied");
                tracing::info!(path = %path.display(), sighup = forced, "configuration reloaded");
                if !restart.is_empty() {
                    tracing::warn!(
                        keys = %restart.join(", "),
                        "configuration keys changed that only a restart applies; they keep \
                         the values the process started with"
                    );
                }
            }
            Err(reason) => {
                metrics.count_config_reload("refused");
                tracing::warn!(path = %path.display(), %reason, "configuration reload refused; the previous configuration stays in force");
            }
        }
    }
}

/// The next SIGHUP; never, without the signal.
async fn hangup(signal: &mut Option<tokio::signal::unix::Signal>) {
    if let Some(signal) = signal
        && signal.recv().await.is_some()
    {
        return;
    }
    std::future::pending().await
}

/// Loads `path` and puts what can change without a restart in force: all
/// of it, or (on an error) none of it. Blocking (files, tokenizers, local
/// models): runs on the blocking pool. The keys that changed and need a
/// restart on success, the reason on a refusal.
fn reload(path: &Path, targets: &Targets, started: Option<&Config>) -> Result<Vec<String>, String> {
    let config = Config::load(Some(path)).map_err(|error| error.to_string())?;
    // Everything that can fail is built before anything changes.
    let router = targets.router.local();
    let routes = match router {
        Some(router) => Some(
            router
                .prepare_reload(&config.models)
                .map_err(|error| error.to_string())?,
        ),
        None => None,
    };
    let catalog = match &targets.gateway {
        Some(gateway) => Some(
            gateway
                .prepare_reload(&config)
                .map_err(|error| format!("{error:#}"))?,
        ),
        None => None,
    };
    // The gateway last: a model added is known to the router and billing
    // before the gateway admits requests for it.
    if let (Some(router), Some(routes)) = (router, routes) {
        router.apply_reload(routes);
    }
    if let Some(billing) = targets.billing.local() {
        billing.reload(&config);
    }
    targets.limiter.reload(&config);
    if let (Some(gateway), Some(catalog)) = (&targets.gateway, catalog) {
        gateway.apply_reload(catalog);
    }
    Ok(started.map_or_else(Vec::new, |started| restart_keys(started, &config)))
}

/// The keys of `now` that differ from `started` and only a restart
/// applies (listen addresses, the database, the services, the bus, the
/// remote addresses, `[router]`, ...): every key but the catalog
/// (`models`, `characters`) and `limits`' `tiers`, `overrides`, `user` and
/// `default_completion_tokens`. Named to the second level (`database.url`);
/// values are never shown (some are credentials).
fn restart_keys(started: &Config, now: &Config) -> Vec<String> {
    const RELOADED: [&str; 6] = [
        "models",
        "characters",
        "limits.tiers",
        "limits.overrides",
        "limits.user",
        "limits.default_completion_tokens",
    ];
    let (Ok(before), Ok(after)) = (serde_json::to_value(started), serde_json::to_value(now)) else {
        return Vec::new();
    };
    let mut keys = Vec::new();
    differences("", &before, &after, 2, &mut keys);
    // What a file supplies is re-read by its own watcher (rotations).
    let from_file = |key: &str| match key {
        "database.url" => now.database.url_file.is_some(),
        "database.migrate_url" => now.database.migrate_url_file.is_some(),
        _ => false,
    };
    keys.retain(|key| !RELOADED.contains(&key.as_str()) && !from_file(key));
    // Secrets are not serialized: compared here, unless a file supplies them.
    let changed = |old: &Option<SecretString>, new: &Option<SecretString>| {
        old.as_ref().map(ExposeSecret::expose_secret)
            != new.as_ref().map(ExposeSecret::expose_secret)
    };
    if now.grpc.token_file.is_none() && changed(&started.grpc.token, &now.grpc.token) {
        keys.push("grpc.token".to_owned());
    }
    if now.operator.token_file.is_none() && changed(&started.operator.token, &now.operator.token) {
        keys.push("operator.token".to_owned());
    }
    keys.sort();
    keys
}

/// The paths (`section.key`, at most `depth` deep) where `before` and
/// `after` differ.
fn differences(
    prefix: &str,
    before: &serde_json::Value,
    after: &serde_json::Value,
    depth: usize,
    keys: &mut Vec<String>,
) {
    use serde_json::Value;
    if before == after {
        return;
    }
    match (before, after) {
        (Value::Object(old), Value::Object(new)) if depth > 0 => {
            let names: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
            for name in names {
                let path = if prefix.is_empty() {
                    name.clone()
                } else {
                    format!("{prefix}.{name}")
                };
                let missing = Value::Null;
                differences(
                    &path,
                    old.get(name).unwrap_or(&missing),
                    new.get(name).unwrap_or(&missing),
                    depth - 1,
                    keys,
                );
            }
        }
        _ => keys.push(prefix.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        Config::from_toml(text).unwrap()
    }

    #[test]
    fn only_what_a_reload_cannot_apply_is_named() {
        let started = config(
            "[gateway]\nlisten = \"127.0.0.1:8080\"\n[limits]\nwindow_secs = 60\n\
             [[models]]\nid = \"a\"\n",
        );
        let same = config(
            "[gateway]\nlisten = \"127.0.0.1:8080\"\n[limits]\nwindow_secs = 60\n\
             default_completion_tokens = 7\n[[limits.overrides]]\naccount = \"x\"\nrpm = 3\n\
             [[models]]\nid = \"b\"\ninput_usd_per_mtok = 9\n\
             [[characters]]\nslug = \"s\"\nname = \"S\"\nsystem_prompt = \"p\"\n",
        );
        assert_eq!(restart_keys(&started, &same), Vec::<String>::new());
        let moved = config(
            "[gateway]\nlisten = \"127.0.0.1:9090\"\n[limits]\nwindow_secs = 30\n\
             [database]\nurl = \"sqlite://other.db\"\n[grpc]\ntoken = \"new\"\n\
             [router]\nmax_retries = 5\n[[models]]\nid = \"a\"\n",
        );
        assert_eq!(
            restart_keys(&started, &moved),
            [
                "database.url",
                "gateway.listen",
                "grpc.token",
                "limits.window_secs",
                "router.max_retries"
            ]
        );
    }

    #[test]
    fn a_database_url_from_its_file_is_not_named() {
        let started = config("[database]\nurl = \"sqlite://a.db\"\n");
        let mut rotated = config("[database]\nurl = \"sqlite://b.db\"\n");
        rotated.database.url_file = Some(PathBuf::from("/run/secrets/url"));
        assert_eq!(restart_keys(&started, &rotated), ["database.url_file"]);
    }
}
