//! The console's sessions: a signed cookie, its CSRF token, and the checks
//! every form post passes.
//!
//! A session is a cookie holding who signed in and until when, signed with
//! HMAC-SHA256 under `console.session_key` (shared by every gateway
//! replica, so no session store and no database read). What signed the user
//! in never reaches the browser: not the operator token, not the API key.
//! The cookie is `HttpOnly` (no script reads it), `SameSite=Strict` (no
//! other site's page sends it) and `Secure` over https.
//!
//! Each form carries a CSRF token derived from the session's random id, and
//! a post is refused unless it comes from this origin (`Origin`,
//! `Sec-Fetch-Site`). An operator session also carries a fingerprint of the
//! operator token it was opened with: rotating the token ends them all.

use actix_web::HttpRequest;
use actix_web::cookie::{Cookie, SameSite};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// The session cookie.
pub const COOKIE: &str = "rialto_console";
/// The pre-session cookie the sign-in forms' CSRF token is tied to.
pub const LOGIN_COOKIE: &str = "rialto_console_login";
/// The path both cookies are scoped to.
const PATH: &str = "/console";

type HmacSha256 = Hmac<Sha256>;

/// Who a session is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "as", rename_all = "snake_case")]
pub enum Principal {
    /// Signed in with the operator token; `op` fingerprints that token.
    Operator { op: String },
    /// An account holder, signed in with one of the account's ADMIN keys.
    Key { account: String, key: String },
    /// A wallet, signed in with Sign-In-With-X.
    Wallet { address: String },
}

/// What the cookie carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    #[serde(flatten)]
    pub principal: Principal,
    /// Random per sign-in: what the CSRF token is derived from.
    pub sid: String,
    /// Unix seconds after which the session is over.
    pub exp: i64,
}

/// Why a cookie was not a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    /// No cookie at all.
    Missing,
    /// Signed by us, but its time is up.
    Expired,
    /// Not signed by this key, or not a session.
    Forged,
}

/// Signs and checks sessions and their CSRF tokens.
pub struct Sessions {
    /// HMAC-SHA256 keyed once; each use clones it.
    keyed: HmacSha256,
    ttl_secs: i64,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("ttl_secs", &self.ttl_secs)
            .finish_non_exhaustive()
    }
}

impl Sessions {
    /// Sessions signed with `key` (HMAC takes a key of any length; the
    /// error cannot happen, but is not hidden either).
    pub fn new(key: &[u8], ttl_secs: u64) -> Result<Self, hmac::digest::InvalidLength> {
        Ok(Self {
            keyed: HmacSha256::new_from_slice(key)?,
            ttl_secs: i64::try_from(ttl_secs).unwrap_or(i64::MAX),
        })
    }

    fn mac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac = self.keyed.clone();
        for part in parts {
            mac.update(part);
            // A separator no part contains, so ("ab","c") ≠ ("a","bc").
            mac.update(&[0]);
        }
        mac
    }

    fn tag(&self, parts: &[&[u8]]) -> String {
        URL_SAFE_NO_PAD.encode(self.mac(parts).finalize().into_bytes())
    }

    /// Whether `tag` is ours over `parts`, in constant time.
    fn verify(&self, parts: &[&[u8]], tag: &str) -> bool {
        URL_SAFE_NO_PAD
            .decode(tag)
            .is_ok_and(|tag| self.mac(parts).verify_slice(&tag).is_ok())
    }

    /// The fingerprint of an operator token that an operator session
    /// carries: not the token, and useless without the session key.
    pub fn operator_fingerprint(&self, token: &[u8]) -> String {
        self.tag(&[b"operator", token])[..16].to_owned()
    }

    /// A new session for `principal`, as the cookie's value.
    pub fn open(&self, principal: Principal, now_secs: i64) -> Result<String, rialto_core::Error> {
        let claims = Claims {
            principal,
            sid: hex::encode(random::<16>()?),
            exp: now_secs.saturating_add(self.ttl_secs),
        };
        let json = serde_json::to_vec(&claims).map_err(rialto_core::Error::internal)?;
        let payload = URL_SAFE_NO_PAD.encode(json);
        let tag = self.tag(&[b"session", payload.as_bytes()]);
        Ok(format!("{payload}.{tag}"))
    }

    /// The session a cookie value holds, if we signed it and it is current.
    pub fn read(&self, value: Option<&str>, now_secs: i64) -> Result<Claims, Invalid> {
        let value = value.ok_or(Invalid::Missing)?;
        let (payload, tag) = value.split_once('.').ok_or(Invalid::Forged)?;
        if !self.verify(&[b"session", payload.as_bytes()], tag) {
            return Err(Invalid::Forged);
        }
        let claims: Claims = URL_SAFE_NO_PAD
            .decode(payload)
            .ok()
            .and_then(|json| serde_json::from_slice(&json).ok())
            .ok_or(Invalid::Forged)?;
        if claims.exp <= now_secs {
            return Err(Invalid::Expired);
        }
        Ok(claims)
    }

    /// The CSRF token of a session's forms.
    pub fn csrf(&self, claims: &Claims) -> String {
        self.tag(&[b"csrf", claims.sid.as_bytes()])
    }

    pub fn csrf_ok(&self, claims: &Claims, presented: &str) -> bool {
        self.verify(&[b"csrf", claims.sid.as_bytes()], presented)
    }

    /// The CSRF token of the sign-in forms, tied to the pre-session cookie.
    pub fn login_csrf(&self, login_cookie: &str) -> String {
        self.tag(&[b"login", login_cookie.as_bytes()])
    }

    pub fn login_csrf_ok(&self, login_cookie: &str, presented: &str) -> bool {
        self.verify(&[b"login", login_cookie.as_bytes()], presented)
    }

    /// The session cookie.
    pub fn cookie(&self, value: String, secure: bool) -> Cookie<'static> {
        Cookie::build(COOKIE, value)
            .path(PATH)
            .http_only(true)
            .same_site(SameSite::Strict)
            .secure(secure)
            .max_age(actix_web::cookie::time::Duration::seconds(self.ttl_secs))
            .finish()
    }
}

/// A cookie that removes `name`.
pub fn removal(name: &'static str) -> Cookie<'static> {
    let mut cookie = Cookie::build(name, "")
        .path(PATH)
        .http_only(true)
        .same_site(SameSite::Strict)
        .finish();
    cookie.make_removal();
    cookie
}

/// A fresh pre-session cookie for the sign-in forms (valid 1 hour).
pub fn login_cookie(secure: bool) -> Result<Cookie<'static>, rialto_core::Error> {
    Ok(Cookie::build(LOGIN_COOKIE, hex::encode(random::<16>()?))
        .path(PATH)
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(secure)
        .max_age(actix_web::cookie::time::Duration::hours(1))
        .finish())
}

/// Whether the request came over https (directly, or as the proxy in front
/// says): the cookies are then `Secure`.
pub fn is_https(request: &HttpRequest) -> bool {
    request.connection_info().scheme() == "https"
}

/// Whether a post comes from a page of this origin. Browsers send `Origin`
/// on every POST and `Sec-Fetch-Site` on every request; either naming
/// another site refuses it. (A client that sends neither is not a browser,
/// and cannot hold the SameSite cookie through another site's page.)
pub fn same_origin(request: &HttpRequest) -> bool {
    let headers = request.headers();
    if let Some(site) = headers.get("sec-fetch-site")
        && !matches!(site.as_bytes(), b"same-origin" | b"none")
    {
        return false;
    }
    match headers.get(actix_web::http::header::ORIGIN) {
        None => true,
        Some(origin) => {
            let info = request.connection_info();
            let expected = format!("{}://{}", info.scheme(), info.host());
            origin.as_bytes().eq_ignore_ascii_case(expected.as_bytes())
        }
    }
}

/// `N` bytes from the operating system's generator. A machine that cannot
/// produce them cannot make sessions, so this does not fall back.
pub fn random<const N: usize>() -> Result<[u8; N], rialto_core::Error> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)
        .map_err(|e| rialto_core::Error::internal(format_args!("no random bytes: {e}")))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sessions() -> Sessions {
        Sessions::new(&b"k".repeat(32), 60).unwrap()
    }

    #[test]
    fn a_session_reads_back_until_it_expires() {
        let sessions = sessions();
        let principal = Principal::Key {
            account: "a".into(),
            key: "k1".into(),
        };
        let cookie = sessions.open(principal.clone(), 1_000).unwrap();
        let claims = sessions.read(Some(&cookie), 1_059).unwrap();
        assert_eq!(claims.principal, principal);
        assert_eq!(sessions.read(Some(&cookie), 1_060), Err(Invalid::Expired));
        assert_eq!(sessions.read(None, 1_000), Err(Invalid::Missing));
    }

    #[test]
    fn a_changed_or_foreign_cookie_is_forged() {
        let sessions = sessions();
        let cookie = sessions
            .open(Principal::Operator { op: "x".into() }, 0)
            .unwrap();
        let (payload, tag) = cookie.split_once('.').unwrap();
        // Claims rewritten by the holder: the tag no longer matches.
        let mut claims: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).unwrap()).unwrap();
        claims["exp"] = serde_json::json!(i64::MAX);
        let rewritten = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).unwrap());
        for forged in [
            format!("{rewritten}.{tag}"),
            format!("{payload}.AAAA"),
            payload.to_owned(),
            String::new(),
        ] {
            assert_eq!(sessions.read(Some(&forged), 0), Err(Invalid::Forged));
        }
        // Another deployment's key signs sessions this one refuses.
        let other = Sessions::new(&b"o".repeat(32), 60).unwrap();
        assert_eq!(other.read(Some(&cookie), 0), Err(Invalid::Forged));
    }

    #[test]
    fn csrf_tokens_belong_to_one_session() {
        let sessions = sessions();
        let first = sessions
            .read(
                Some(
                    &sessions
                        .open(Principal::Operator { op: "x".into() }, 0)
                        .unwrap(),
                ),
                0,
            )
            .unwrap();
        let second = sessions
            .read(
                Some(
                    &sessions
                        .open(Principal::Operator { op: "x".into() }, 0)
                        .unwrap(),
                ),
                0,
            )
            .unwrap();
        let token = sessions.csrf(&first);
        assert!(sessions.csrf_ok(&first, &token));
        assert!(!sessions.csrf_ok(&second, &token));
        assert!(!sessions.csrf_ok(&first, ""));
        let login = sessions.login_csrf("abc");
        assert!(sessions.login_csrf_ok("abc", &login));
        assert!(!sessions.login_csrf_ok("abd", &login));
    }
}
