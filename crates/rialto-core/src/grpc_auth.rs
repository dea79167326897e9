//! A shared bearer token on the internal gRPC interfaces.
//!
//! Services trust their callers (auth's `CreateApiKey` takes any account
//! id), so in a split deployment the gRPC port must not answer strangers. With
//! `grpc.token` set, every server refuses calls without
//! `authorization: Bearer <token>` (compared in constant time) and every
//! client sends it. The standard health service stays open for probes.
//!
//! [`RemoteChannel`] is what every client of another process calls
//! through: its channel for the calling thread, with the token added.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use secrecy::{ExposeSecret, SecretString};
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::per_thread::PerThread;
use crate::secrets::LiveSecret;

/// Adds the token to outgoing calls. Clones share the value, which
/// [`ClientToken::replace`] changes when `grpc.token_file` does.
#[derive(Clone, Default)]
pub struct ClientToken(Arc<ArcSwapOption<AsciiMetadataValue>>);

/// Checks the token on incoming calls (the one in force, or the one it
/// replaced during a rotation: see [`crate::secrets`]).
#[derive(Clone, Default)]
pub struct ServerToken(Option<LiveSecret>);

fn header_value(token: &SecretString) -> Result<AsciiMetadataValue, crate::config::ConfigError> {
    MetadataValue::try_from(format!("Bearer {}", token.expose_secret())).map_err(|_| {
        crate::config::ConfigError::Invalid("grpc.token must be printable ASCII".into())
    })
}

impl ClientToken {
    pub fn new(token: Option<&SecretString>) -> Result<Self, crate::config::ConfigError> {
        let value = token.map(header_value).transpose()?;
        Ok(Self(Arc::new(ArcSwapOption::from_pointee(value))))
    }

    /// Sends `token` from the next call on; refuses one that is not a
    /// valid header value.
    pub fn replace(&self, token: &SecretString) -> Result<(), crate::config::ConfigError> {
        self.0.store(Some(Arc::new(header_value(token)?)));
        Ok(())
    }
}

/// Where a client of another process (`Remote*`) sends its calls: a
/// channel made on each calling thread ([`PerThread`]), each call carrying
/// the token.
pub struct RemoteChannel {
    channel: PerThread<Channel>,
    token: ClientToken,
}

impl RemoteChannel {
    /// A plain `Channel` converts too, shared by every thread.
    pub fn new(channel: impl Into<PerThread<Channel>>, token: ClientToken) -> Self {
        Self {
            channel: channel.into(),
            token,
        }
    }

    /// This thread's channel, adding the token to each call: what a
    /// generated client is built on.
    pub fn here(&self) -> InterceptedService<Channel, ClientToken> {
        InterceptedService::new(self.channel.get(), self.token.clone())
    }
}

impl ServerToken {
    pub fn new(token: Option<&SecretString>) -> Self {
        Self(token.map(|t| LiveSecret::new(t.clone())))
    }

    /// The secret this server checks, for a watcher of its file.
    pub fn secret(&self) -> Option<&LiveSecret> {
        self.0.as_ref()
    }
}

impl std::fmt::Debug for ClientToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientToken(..)")
    }
}

impl std::fmt::Debug for ServerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerToken(..)")
    }
}

impl Interceptor for ClientToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &*self.0.load() {
            request
                .metadata_mut()
                .insert("authorization", AsciiMetadataValue::clone(value));
        }
        // The caller's trace goes on in the service's process.
        for (name, value) in crate::telemetry::inject_current() {
            if let Ok(value) = value.parse() {
                request.metadata_mut().insert(name, value);
            }
        }
        Ok(request)
    }
}

impl Interceptor for ServerToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.0 else {
            return Ok(request);
        };
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        if !presented.is_empty() && expected.accepts(presented.as_bytes()) {
            Ok(request)
        } else {
            Err(Status::unauthenticated("missing or wrong grpc token"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(text: &str) -> SecretString {
        SecretString::from(text.to_owned())
    }

    #[test]
    fn the_client_token_opens_the_server() {
        let mut client = ClientToken::new(Some(&secret("s3cret"))).unwrap();
        let mut server = ServerToken::new(Some(&secret("s3cret")));
        let request = client.call(Request::new(())).unwrap();
        assert!(server.call(request).is_ok());
    }

    #[test]
    fn a_rotated_token_opens_at_once_and_the_old_one_for_a_while() {
        let mut old_client = ClientToken::new(Some(&secret("old"))).unwrap();
        let mut new_client = old_client.clone();
        let mut server = ServerToken::new(Some(&secret("old")));
        new_client.replace(&secret("new")).unwrap();
        assert!(
            server
                .call(new_client.call(Request::new(())).unwrap())
                .is_err()
        );
        server.secret().unwrap().replace(secret("new"));
        assert!(
            server
                .call(new_client.call(Request::new(())).unwrap())
                .is_ok()
        );
        // A clone shares the value: every channel of the process rotates.
        assert!(
            server
                .call(old_client.call(Request::new(())).unwrap())
                .is_ok()
        );
        let mut stale = ClientToken::new(Some(&secret("old"))).unwrap();
        assert!(
            server.call(stale.call(Request::new(())).unwrap()).is_ok(),
            "the grace"
        );
        assert!(new_client.replace(&secret("bad\ntoken")).is_err());
    }

    #[test]
    fn a_wrong_or_missing_token_is_refused() {
        let mut server = ServerToken::new(Some(&secret("s3cret")));
        assert!(server.call(Request::new(())).is_err());
        let mut other = ClientToken::new(Some(&secret("other"))).unwrap();
        assert!(server.call(other.call(Request::new(())).unwrap()).is_err());
    }

    #[test]
    fn without_a_token_everything_passes() {
        let mut server = ServerToken::new(None);
        assert!(server.call(Request::new(())).is_ok());
    }
}
