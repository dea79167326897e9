//! Which limits apply to a request: the `[limits]` configuration resolved
//! for one caller and one model (or endpoint).
//!
//! Three kinds of window may apply, each named in `x-ratelimit-type`:
//! - `api_key`: the caller's own window, from the tier table of its
//!   account's tier and the limit class of the model, with
//!   `[[limits.overrides]]` for its account and then for the key on top;
//! - `user`: one window shared by all keys of an account, where
//!   `[[limits.user]]` configures one;
//! - `global`: one window per model for everyone (`global_rpm`/`global_tpm`
//!   on the model), protecting its backends.

use std::collections::{BTreeMap, HashMap};

use rialto_core::config::{Limit, LimitOverride, LimitsConfig, UserLimit};
use rialto_core::{Config, ModelConfig};
use rialto_proto::limiter::v1 as pb;

/// The kinds of window, as `x-ratelimit-type` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    ApiKey,
    User,
    Global,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ApiKey => "api_key",
            Self::User => "user",
            Self::Global => "global",
        }
    }
}

/// Who is asking, as the auth service resolved it.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    pub account_id: &'a str,
    pub key_id: &'a str,
    /// The account's tier (`standard`, `partner`, ...).
    pub tier: &'a str,
}

/// What a request is limited on: a model of the catalog or an endpoint.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// Window name: the model id, or `endpoint:<path>`.
    pub window: &'a str,
    /// Limit class in the tier tables (see [`ModelConfig::limit_class`]).
    pub class: &'a str,
    /// The model's id, for model-specific overrides; None for endpoints.
    pub model_id: Option<&'a str>,
}

impl<'a> Target<'a> {
    pub fn model(model: &'a ModelConfig) -> Self {
        Self {
            window: &model.id,
            class: model.limit_class(),
            model_id: Some(&model.id),
        }
    }

    /// A non-inference endpoint, limited in the `endpoint` class.
    pub fn endpoint(window: &'a str) -> Self {
        Self {
            window,
            class: "endpoint",
            model_id: None,
        }
    }
}

/// One window a request must fit in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowSpec {
    pub scope: Scope,
    pub principal: String,
    pub limit: pb::Limit,
}

#[derive(Debug)]
pub struct Policy {
    pub span_ms: i64,
    pub default_completion_tokens: u64,
    tiers: BTreeMap<String, BTreeMap<String, Limit>>,
    account_overrides: HashMap<String, Vec<LimitOverride>>,
    key_overrides: HashMap<String, Vec<LimitOverride>>,
    user: HashMap<String, Vec<UserLimit>>,
    global: HashMap<String, Limit>,
}

impl Policy {
    pub fn new(config: &Config) -> Self {
        let LimitsConfig {
            window_secs,
            default_completion_tokens,
            tiers,
            overrides,
            user,
            ..
        } = &config.limits;
        let mut account_overrides: HashMap<String, Vec<LimitOverride>> = HashMap::new();
        let mut key_overrides: HashMap<String, Vec<LimitOverride>> = HashMap::new();
        for o in overrides {
            match (&o.account, &o.key) {
                (Some(account), _) => account_overrides.entry(account.clone()),
                (None, Some(key)) => key_overrides.entry(key.clone()),
                (None, None) => continue,
            }
            .or_default()
            .push(o.clone());
        }
        // Model-specific entries after the general ones, so they win.
        for list in account_overrides
            .values_mut()
            .chain(key_overrides.values_mut())
        {
            list.sort_by_key(|o| o.model.is_some());
        }
        let mut users: HashMap<String, Vec<UserLimit>> = HashMap::new();
        for u in user {
            users.entry(u.account.clone()).or_default().push(u.clone());
        }
        let global = config
            .models
            .iter()
            .filter_map(|m| {
                let limit = Limit {
                    rpm: m.global_rpm?,
                    tpm: m.global_tpm,
                    rpd: None,
                };
                Some((m.id.clone(), limit))
            })
            .collect();
        Self {
            span_ms: (*window_secs as i64).saturating_mul(1000),
            default_completion_tokens: *default_completion_tokens,
            tiers: tiers.clone(),
            account_overrides,
            key_overrides,
            user: users,
            global,
        }
    }

    /// The account tiers `[limits.tiers]` defines.
    pub fn tiers(&self) -> impl Iterator<Item = &str> {
        self.tiers.keys().map(String::as_str)
    }

    /// The caller's own limit on `target`, or None when its class is not
    /// limited.
    pub fn key_limit(&self, caller: Caller<'_>, target: Target<'_>) -> Option<Limit> {
        let table = self
            .tiers
            .get(caller.tier)
            .or_else(|| self.tiers.get("standard"));
        let mut limit = table.and_then(|t| t.get(target.class)).copied();
        let applies = |o: &&LimitOverride| match &o.model {
            None => true,
            Some(model) => Some(model.as_str()) == target.model_id,
        };
        let overrides = self
            .account_overrides
            .get(caller.account_id)
            .into_iter()
            .chain(self.key_overrides.get(caller.key_id))
            .flatten()
            .filter(applies);
        for o in overrides {
            // A class the tier table leaves free becomes limited only by an
            // override that sets its requests per window.
            if limit.is_none() {
                match o.rpm {
                    Some(rpm) => {
                        limit = Some(Limit {
                            rpm,
                            tpm: None,
                            rpd: None,
                        })
                    }
                    None => continue,
                }
            }
            let Some(base) = limit.as_mut() else {
                continue;
            };
            if let Some(rpm) = o.rpm {
                base.rpm = rpm;
            }
            if o.tpm.is_some() {
                base.tpm = o.tpm;
            }
            if o.rpd.is_some() {
                base.rpd = o.rpd;
            }
        }
        limit
    }

    /// Every window a request of `caller` on `target` must fit in, in the
    /// order they are taken: the caller's own, the account's, the model's.
    pub fn windows(&self, caller: Caller<'_>, target: Target<'_>) -> Vec<WindowSpec> {
        // Principals are joined with `concat`, not `format!`: the same text
        // without the formatting machinery, on every admission.
        let mut windows = Vec::with_capacity(1);
        if let Some(limit) = self.key_limit(caller, target) {
            windows.push(WindowSpec {
                scope: Scope::ApiKey,
                principal: ["key:", caller.key_id].concat(),
                limit: to_pb(limit),
            });
        }
        // Account-wide windows limit inference, not account management.
        if target.model_id.is_some()
            && let Some(list) = self.user.get(caller.account_id)
        {
            let specific = list
                .iter()
                .find(|u| u.model.is_some() && u.model.as_deref() == target.model_id);
            let general = list.iter().find(|u| u.model.is_none());
            if let Some(user) = specific.or(general) {
                windows.push(WindowSpec {
                    scope: Scope::User,
                    principal: ["user:", caller.account_id].concat(),
                    limit: to_pb(user.limit()),
                });
            }
        }
        if let Some(limit) = target.model_id.and_then(|id| self.global.get(id)) {
            windows.push(WindowSpec {
                scope: Scope::Global,
                principal: ["global:", target.window].concat(),
                limit: to_pb(*limit),
            });
        }
        windows
    }
}

pub fn to_pb(limit: Limit) -> pb::Limit {
    pb::Limit {
        requests: limit.rpm,
        tokens: limit.tpm.unwrap_or(0),
        requests_per_day: limit.rpd.unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        Config::from_toml(&format!(
            r#"
[[models]]
id = "small"
tier = "XS"
[[models]]
id = "large"
tier = "L"
global_rpm = 1000
[[models]]
id = "pics"
type = "image"
[[models]]
id = "song"
type = "music"
{extra}
"#
        ))
        .unwrap()
    }

    fn caller<'a>(tier: &'a str) -> Caller<'a> {
        Caller {
            account_id: "acct",
            key_id: "key",
            tier,
        }
    }

    fn model<'a>(config: &'a Config, id: &str) -> Target<'a> {
        Target::model(config.model(id).unwrap())
    }

    #[test]
    fn defaults_follow_the_spec_tables() {
        let config = config("");
        let policy = Policy::new(&config);
        let limit = |tier, id| policy.key_limit(caller(tier), model(&config, id));
        assert_eq!(limit("standard", "small").unwrap().rpm, 500);
        assert_eq!(limit("standard", "small").unwrap().tpm, Some(1_000_000));
        assert_eq!(limit("standard", "large").unwrap().rpm, 20);
        assert_eq!(limit("partner", "large").unwrap().rpm, 60);
        assert_eq!(limit("partner", "large").unwrap().tpm, Some(1_000_000));
        assert_eq!(limit("standard", "pics").unwrap().rpm, 20);
        assert_eq!(limit("partner", "pics").unwrap().rpm, 60);
        // An unknown tier is treated as standard; an unknown class is free.
        assert_eq!(limit("gold", "small").unwrap().rpm, 500);
        assert_eq!(limit("standard", "song"), None);
        assert_eq!(policy.span_ms, 60_000);
    }

    #[test]
    fn overrides_apply_account_then_key_and_model_specific_last() {
        let config = config(
            r#"
[[limits.overrides]]
key = "key"
model = "small"
rpm = 7
[[limits.overrides]]
account = "acct"
rpm = 100
tpm = 5000
[[limits.overrides]]
key = "key"
tpm = 6000
[[limits.overrides]]
key = "k3"
tpm = 10
"#,
        );
        let policy = Policy::new(&config);
        let small = policy.key_limit(caller("standard"), model(&config, "small"));
        assert_eq!(
            small,
            Some(Limit {
                rpm: 7,
                tpm: Some(6000),
                rpd: None
            })
        );
        let large = policy.key_limit(caller("standard"), model(&config, "large"));
        assert_eq!(large.unwrap().rpm, 100);
        let other = Caller {
            account_id: "other",
            key_id: "k2",
            tier: "standard",
        };
        assert_eq!(
            policy
                .key_limit(other, model(&config, "large"))
                .unwrap()
                .rpm,
            20
        );
        // A free class (music) is limited by an override setting rpm, and
        // stays free under one without.
        let song = policy.key_limit(caller("standard"), model(&config, "song"));
        assert_eq!(song.map(|l| (l.rpm, l.tpm)), Some((100, Some(6000))));
        let lone = Caller {
            account_id: "other",
            key_id: "k3",
            tier: "standard",
        };
        assert_eq!(policy.key_limit(lone, model(&config, "song")), None);
    }

    #[test]
    fn user_and_global_windows_join_the_key_window() {
        let config = config(
            r#"
[[limits.user]]
account = "acct"
rpm = 30
[[limits.user]]
account = "acct"
model = "small"
rpm = 10
tpm = 100
"#,
        );
        let policy = Policy::new(&config);
        let windows = policy.windows(caller("standard"), model(&config, "small"));
        let scopes: Vec<_> = windows
            .iter()
            .map(|w| (w.scope, w.principal.as_str()))
            .collect();
        assert_eq!(
            scopes,
            [(Scope::ApiKey, "key:key"), (Scope::User, "user:acct")]
        );
        assert_eq!(windows[1].limit.requests, 10);
        let windows = policy.windows(caller("standard"), model(&config, "large"));
        assert_eq!(windows.len(), 3);
        assert_eq!(windows[1].limit.requests, 30);
        assert_eq!(windows[2].principal, "global:large");
        assert_eq!(windows[2].limit.requests, 1000);
        let endpoint = policy.windows(
            caller("standard"),
            Target::endpoint("endpoint:api/v1/api_keys"),
        );
        assert_eq!(endpoint.len(), 1, "account-wide windows limit models only");
        assert_eq!(endpoint[0].limit.requests, 500);
    }
}
