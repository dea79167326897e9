//! Secrets that change while the process runs.
//!
//! Every secret of the configuration can come from a file (`*_file`): in
//! Kubernetes a mounted Secret, which the kubelet replaces in place when the
//! Secret changes. [`LiveSecret`] holds the value now in force, and
//! [`watch`] re-reads the file every few seconds and swaps in a new value
//! when its content changed, so rotating a key needs no restart. A read that
//! fails (the file gone, empty, or not a valid value) keeps the old value,
//! logs why and counts `rialto_secret_reloads_total{outcome="refused"}`.
//!
//! Reading the value is one atomic load ([`arc_swap`]): the request path
//! takes no lock. A token that both sides of a connection hold (the gRPC
//! token) is rotated in every pod at slightly different moments, so the
//! side that checks it also accepts the value it replaced for
//! [`PREVIOUS_ACCEPTED_FOR`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;

/// How long a replaced value still opens the door: long enough for the
/// kubelet to update every pod's copy of the Secret (about a minute).
pub const PREVIOUS_ACCEPTED_FOR: Duration = Duration::from_secs(300);

/// How often [`watch`] looks at its file.
pub const WATCH_EVERY: Duration = Duration::from_secs(2);

/// A secret's value now, and the one it replaced.
#[derive(Debug)]
pub struct Rotation {
    pub current: SecretString,
    previous: Option<(SecretString, Instant)>,
}

/// A secret that may be replaced while the process runs; cheap to clone.
#[derive(Clone)]
pub struct LiveSecret(Arc<ArcSwap<Rotation>>);

impl std::fmt::Debug for LiveSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LiveSecret(..)")
    }
}

impl LiveSecret {
    pub fn new(value: SecretString) -> Self {
        Self(Arc::new(ArcSwap::from_pointee(Rotation {
            current: value,
            previous: None,
        })))
    }

    /// The value in force.
    pub fn current(&self) -> arc_swap::Guard<Arc<Rotation>> {
        self.0.load()
    }

    /// Whether `presented` is the value in force, or the one it replaced
    /// less than [`PREVIOUS_ACCEPTED_FOR`] ago; compared in constant time.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let rotation = self.0.load();
        let equal =
            |secret: &SecretString| bool::from(presented.ct_eq(secret.expose_secret().as_bytes()));
        if equal(&rotation.current) {
            return true;
        }
        match &rotation.previous {
            Some((previous, replaced_at)) => {
                replaced_at.elapsed() < PREVIOUS_ACCEPTED_FOR && equal(previous)
            }
            None => false,
        }
    }

    /// Whether `presented` is the value in force (constant time), without
    /// the grace of [`accepts`](Self::accepts): for a secret only one side
    /// holds (the operator token), rotated because it may have leaked.
    pub fn accepts_current(&self, presented: &[u8]) -> bool {
        bool::from(presented.ct_eq(self.0.load().current.expose_secret().as_bytes()))
    }

    /// Puts `value` in force; the old value stays accepted for a while.
    pub fn replace(&self, value: SecretString) {
        let old = self.0.load_full();
        self.0.store(Arc::new(Rotation {
            current: value,
            previous: Some((old.current.clone(), Instant::now())),
        }));
    }
}

/// Reads a secret file: its content without the trailing newline that
/// `echo` and editors add. An empty file is an error, not an empty secret.
pub fn read_file(path: &Path) -> std::io::Result<SecretString> {
    let text = std::fs::read_to_string(path)?;
    let value = text.trim_end_matches(['\n', '\r']);
    if value.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the file is empty",
        ));
    }
    Ok(SecretString::from(value.to_owned()))
}

/// Re-reads `path` every [`WATCH_EVERY`] on the current Tokio runtime and,
/// when its content changed and `accept` takes it (a check that the value
/// is usable: a valid header, a URL that parses), puts it in `secret` and
/// calls `accept`'s side effects. `name` labels the log and the metric
/// (`operator.token_file`). The task ends with the runtime.
pub fn watch<F>(name: &'static str, path: PathBuf, secret: LiveSecret, accept: F)
where
    F: Fn(&SecretString) -> Result<(), String> + Send + 'static,
{
    watch_while(name, path, secret, || true, accept);
}

/// [`watch`], ending once `alive` says false (what the secret serves was
/// dropped: a backend a configuration reload replaced).
pub fn watch_while<A, F>(name: &'static str, path: PathBuf, secret: LiveSecret, alive: A, accept: F)
where
    A: Fn() -> bool + Send + 'static,
    F: Fn(&SecretString) -> Result<(), String> + Send + 'static,
{
    tokio::spawn(async move {
        let mut every = tokio::time::interval(WATCH_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // What was last refused (a value, or a read error's text): said
        // once, not every tick while it stays.
        let mut refused: Option<String> = None;
        loop {
            every.tick().await;
            if !alive() {
                return;
            }
            let read = {
                let path = path.clone();
                tokio::task::spawn_blocking(move || read_file(&path)).await
            };
            let outcome = match read {
                Ok(Ok(value)) => {
                    let unchanged =
                        value.expose_secret() == secret.current().current.expose_secret();
                    if unchanged {
                        refused = None;
                        continue;
                    }
                    if refused.as_deref() == Some(value.expose_secret()) {
                        continue;
                    }
                    match accept(&value) {
                        Ok(()) => {
                            refused = None;
                            secret.replace(value);
                            tracing::info!(secret = name, path = %path.display(), "secret reloaded from its file");
                            "applied"
                        }
                        Err(reason) => {
                            refused = Some(value.expose_secret().to_owned());
                            tracing::warn!(secret = name, path = %path.display(), %reason, "secret file changed to an unusable value; the old value stays");
                            "refused"
                        }
                    }
                }
                Ok(Err(error)) => {
                    let text = error.to_string();
                    if refused.as_deref() == Some(text.as_str()) {
                        continue;
                    }
                    tracing::warn!(secret = name, path = %path.display(), %error, "cannot read the secret file; the old value stays");
                    refused = Some(text);
                    "refused"
                }
                Err(_) => continue,
            };
            crate::metrics::metrics().count_secret_reload(name, outcome);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(text: &str) -> SecretString {
        SecretString::from(text.to_owned())
    }

    #[test]
    fn the_replaced_value_is_accepted_for_a_while_only() {
        let live = LiveSecret::new(secret("old"));
        assert!(live.accepts(b"old"));
        assert!(!live.accepts(b"new"));
        live.replace(secret("new"));
        assert!(live.accepts(b"new"));
        assert!(live.accepts(b"old"), "the old value during the rotation");
        assert!(!live.accepts(b"other"));
        live.replace(secret("newer"));
        assert!(!live.accepts(b"old"), "only the last replaced value");
    }

    #[test]
    fn a_file_is_read_without_its_newline_and_an_empty_one_is_refused() {
        let folder = std::env::temp_dir().join(format!("rialto-secret-{}", std::process::id()));
        std::fs::create_dir_all(&folder).unwrap();
        let path = folder.join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        assert_eq!(read_file(&path).unwrap().expose_secret(), "s3cret");
        std::fs::write(&path, "\n").unwrap();
        assert!(read_file(&path).is_err());
        std::fs::remove_dir_all(&folder).unwrap();
    }

    #[tokio::test(start_paused = false)]
    async fn a_changed_file_is_put_in_force() {
        let folder = std::env::temp_dir().join(format!("rialto-watch-{}", std::process::id()));
        std::fs::create_dir_all(&folder).unwrap();
        let path = folder.join("token");
        std::fs::write(&path, "first").unwrap();
        let live = LiveSecret::new(read_file(&path).unwrap());
        watch("test.token_file", path.clone(), live.clone(), |value| {
            if value.expose_secret().contains(' ') {
                Err("spaces".into())
            } else {
                Ok(())
            }
        });
        std::fs::write(&path, "has space").unwrap();
        tokio::time::sleep(WATCH_EVERY * 2).await;
        assert_eq!(live.current().current.expose_secret(), "first", "refused");
        std::fs::write(&path, "second").unwrap();
        let deadline = Instant::now() + WATCH_EVERY * 3;
        while live.current().current.expose_secret() != "second" {
            assert!(Instant::now() < deadline, "the new value was not read");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        std::fs::remove_dir_all(&folder).unwrap();
    }
}
