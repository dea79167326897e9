//! A shared bearer token on the internal gRPC interfaces.
//!
//! Services trust their callers (auth's `CreateApiKey` takes any account
//! id), so in a split deployment the gRPC port must not answer strangers. With
//! `grpc.token` set, every server refuses calls without
//! `authorization: Bearer <token>` (compared in constant time) and every
//! client sends it. The standard health service stays open for probes.

use std::sync::Arc;

use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Adds the token to outgoing calls.
#[derive(Clone, Default)]
pub struct ClientToken(Option<AsciiMetadataValue>);

/// Checks the token on incoming calls.
#[derive(Clone, Default)]
pub struct ServerToken(Option<Arc<SecretString>>);

impl ClientToken {
    pub fn new(token: Option<&SecretString>) -> Result<Self, crate::config::ConfigError> {
        token
            .map(|t| {
                MetadataValue::try_from(format!("Bearer {}", t.expose_secret())).map_err(|_| {
                    crate::config::ConfigError::Invalid("grpc.token must be printable ASCII".into())
                })
            })
            .transpose()
            .map(Self)
    }
}

impl ServerToken {
    pub fn new(token: Option<&SecretString>) -> Self {
        Self(token.map(|t| Arc::new(t.clone())))
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
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
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
        if bool::from(
            presented
                .as_bytes()
                .ct_eq(expected.expose_secret().as_bytes()),
        ) {
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
