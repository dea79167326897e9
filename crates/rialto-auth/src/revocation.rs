//! Revocation events: what cached principals must be dropped, announced on
//! the bus (`<prefix>.auth.revocations`) by the auth replica that made the
//! change and heard by every holder of a cache of principals (the other
//! auth replicas' [`LocalAuth`](crate::LocalAuth), the gateways'
//! [`CachedAuth`](crate::CachedAuth)).

use std::sync::Weak;

/// Subject of revocation events, after the bus prefix.
pub(crate) const REVOCATIONS_SUBJECT: &str = "auth.revocations";

/// What cached principals must be dropped: one key's, or an account's.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Revocation {
    Key(String),
    Account(String),
}

impl Revocation {
    /// Whether this revocation covers the principal of `key_id` in
    /// `account_id`.
    pub(crate) fn covers(&self, key_id: &str, account_id: &str) -> bool {
        match self {
            Revocation::Key(id) => id == key_id,
            Revocation::Account(id) => id == account_id,
        }
    }
}

/// Applies every revocation event on `bus` to `target` with `apply`, until
/// `target` is dropped (needs a Tokio runtime). Events are at most once: a
/// lost one leaves the holder's own bound (its time to live) in charge.
pub(crate) fn listen<T: Send + Sync + 'static>(
    bus: &rialto_core::bus::Bus,
    target: Weak<T>,
    apply: fn(&T, &Revocation),
) {
    let subject = bus.subject(REVOCATIONS_SUBJECT);
    let listener = bus.clone();
    tokio::spawn(async move {
        use futures_util::StreamExt;
        let mut events = match listener.subscribe(subject, None).await {
            Ok(events) => events,
            Err(error) => {
                tracing::warn!(%error, "no revocation events; the one-second re-check still applies");
                return;
            }
        };
        while let Some(payload) = events.next().await {
            let Some(target) = target.upgrade() else {
                break;
            };
            match serde_json::from_slice::<Revocation>(&payload) {
                Ok(revocation) => apply(&target, &revocation),
                Err(error) => tracing::warn!(%error, "unreadable revocation event"),
            }
        }
    });
}
