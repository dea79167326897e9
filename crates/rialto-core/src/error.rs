//! One error type for every service, one code table, one mapping to HTTP and
//! gRPC.
//!
//! Services return [`Error`] from their domain traits. The gRPC adapters
//! carry the [`ErrorCode`] across the wire in a metadata entry so the far
//! side rebuilds the same error; the gateway turns it into the spec's
//! `{"error": ...}` body in one place.

use std::fmt;

/// Metadata key carrying the [`ErrorCode`] across gRPC.
pub const GRPC_ERROR_CODE_KEY: &str = "rialto-error-code";

/// What went wrong, independent of transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The request is malformed or fails validation.
    InvalidRequest,
    /// The backend's content policy refused what the request asks for
    /// (`x-<brand>-is-content-violation: true`).
    ContentViolation,
    /// No credentials, or credentials that match nothing.
    Unauthenticated,
    /// Valid credentials without the right (an INFERENCE key on an ADMIN route).
    AdminRequired,
    /// Valid credentials that may not do this.
    Forbidden,
    /// The model named in the request does not exist.
    ModelNotFound,
    /// An API key id that matches no key of the caller's account.
    ApiKeyNotFound,
    /// A route or resource that does not exist.
    NotFound,
    /// The caller's balance cannot cover the request.
    PaymentRequired,
    /// The request body is larger than the configured limit.
    PayloadTooLarge,
    /// An endpoint the hosted API retired (410).
    Gone,
    /// The request body is not JSON.
    UnsupportedMediaType,
    /// A rate limit refused the request.
    RateLimited,
    /// Every backend of the model failed or is unreachable.
    Unavailable,
    /// The upstream answered with an error we cannot blame on the caller.
    UpstreamFailed,
    /// The upstream did not answer in time.
    Timeout,
    /// A bug or an unexpected failure on our side.
    Internal,
}

impl ErrorCode {
    /// The table: (code, HTTP status, gRPC code, wire name).
    const TABLE: &'static [(ErrorCode, u16, tonic::Code, &'static str)] = &[
        (
            Self::InvalidRequest,
            400,
            tonic::Code::InvalidArgument,
            "INVALID_REQUEST",
        ),
        (
            Self::ContentViolation,
            400,
            tonic::Code::InvalidArgument,
            "CONTENT_POLICY_VIOLATION",
        ),
        (
            Self::Unauthenticated,
            401,
            tonic::Code::Unauthenticated,
            "AUTHENTICATION_FAILED",
        ),
        (
            Self::AdminRequired,
            401,
            tonic::Code::PermissionDenied,
            "ADMIN_KEY_REQUIRED",
        ),
        (
            Self::Forbidden,
            403,
            tonic::Code::PermissionDenied,
            "UNAUTHORIZED",
        ),
        (
            Self::ModelNotFound,
            404,
            tonic::Code::NotFound,
            "MODEL_NOT_FOUND",
        ),
        (
            Self::ApiKeyNotFound,
            400,
            tonic::Code::NotFound,
            "API_KEY_NOT_FOUND",
        ),
        (Self::NotFound, 404, tonic::Code::NotFound, "NOT_FOUND"),
        (Self::Gone, 410, tonic::Code::Unimplemented, "GONE"),
        (
            Self::PaymentRequired,
            402,
            tonic::Code::FailedPrecondition,
            "INSUFFICIENT_BALANCE",
        ),
        (
            Self::PayloadTooLarge,
            413,
            tonic::Code::InvalidArgument,
            "PAYLOAD_TOO_LARGE",
        ),
        (
            Self::UnsupportedMediaType,
            415,
            tonic::Code::InvalidArgument,
            "INVALID_CONTENT_TYPE",
        ),
        (
            Self::RateLimited,
            429,
            tonic::Code::ResourceExhausted,
            "RATE_LIMIT_EXCEEDED",
        ),
        (
            Self::Unavailable,
            503,
            tonic::Code::Unavailable,
            "MODEL_OFFLINE",
        ),
        // The spec's 500 "Inference processing failed" (INFERENCE_FAILED):
        // a backend that failed, broke off or answered nonsense.
        (
            Self::UpstreamFailed,
            500,
            tonic::Code::Unavailable,
            "INFERENCE_FAILED",
        ),
        (
            Self::Timeout,
            504,
            tonic::Code::DeadlineExceeded,
            "REQUEST_TIMEOUT",
        ),
        (Self::Internal, 500, tonic::Code::Internal, "UNKNOWN_ERROR"),
    ];

    fn row(self) -> &'static (ErrorCode, u16, tonic::Code, &'static str) {
        // Every variant has a row (checked by a test), so the fallback is unreachable.
        Self::TABLE
            .iter()
            .find(|row| row.0 == self)
            .unwrap_or(&Self::TABLE[Self::TABLE.len() - 1])
    }

    pub fn http_status(self) -> u16 {
        self.row().1
    }

    pub fn grpc_code(self) -> tonic::Code {
        self.row().2
    }

    /// Stable upper-case name, used in logs and across gRPC.
    pub fn as_str(self) -> &'static str {
        self.row().3
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::TABLE
            .iter()
            .find(|row| row.3 == name)
            .map(|row| row.0)
    }

    fn from_grpc(code: tonic::Code) -> Self {
        match code {
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange => Self::InvalidRequest,
            tonic::Code::Unauthenticated => Self::Unauthenticated,
            tonic::Code::PermissionDenied => Self::Forbidden,
            tonic::Code::NotFound => Self::NotFound,
            tonic::Code::FailedPrecondition => Self::PaymentRequired,
            tonic::Code::ResourceExhausted => Self::RateLimited,
            tonic::Code::Unavailable => Self::Unavailable,
            tonic::Code::DeadlineExceeded => Self::Timeout,
            _ => Self::Internal,
        }
    }
}

/// An error any service can return: a code from the table and a message
/// that is safe to show the caller (it never carries a secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub code: ErrorCode,
    pub message: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    pub fn unauthenticated() -> Self {
        Self::new(ErrorCode::Unauthenticated, "Authentication failed")
    }

    /// An internal failure: the detail goes to the log, the caller gets a
    /// generic message.
    pub fn internal(detail: impl fmt::Display) -> Self {
        tracing::error!(%detail, "internal error");
        Self::new(ErrorCode::Internal, "An unknown error occurred")
    }

    pub fn http_status(&self) -> u16 {
        self.code.http_status()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for Error {}

impl From<sqlx::Error> for Error {
    fn from(error: sqlx::Error) -> Self {
        Self::internal(format_args!("database: {error}"))
    }
}

impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        let mut status = tonic::Status::new(error.code.grpc_code(), error.message);
        if let Ok(value) = error.code.as_str().parse() {
            status.metadata_mut().insert(GRPC_ERROR_CODE_KEY, value);
        }
        status
    }
}

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Self {
        let code = status
            .metadata()
            .get(GRPC_ERROR_CODE_KEY)
            .and_then(|v| v.to_str().ok())
            .and_then(ErrorCode::from_name);
        match code {
            Some(code) => Self::new(code, status.message()),
            // Not one of ours: a transport failure or a peer that is down.
            // A connection that breaks mid-call (a replica killed) comes
            // back as Unknown with the transport error as its source,
            // raised here, not by the peer.
            None if status.code() == tonic::Code::Unavailable
                || (status.code() == tonic::Code::Unknown
                    && std::error::Error::source(&status).is_some()) =>
            {
                tracing::warn!(message = status.message(), "service unreachable over grpc");
                Self::new(ErrorCode::Unavailable, "A required service is unavailable")
            }
            // The channel's own deadline (a hung peer: SIGSTOP, a frozen
            // node) is Cancelled with the transport's timeout as source.
            None if status.code() == tonic::Code::Cancelled
                && std::error::Error::source(&status).is_some() =>
            {
                tracing::warn!(
                    message = status.message(),
                    "service did not answer over grpc"
                );
                Self::new(
                    ErrorCode::Unavailable,
                    "A required service did not answer in time",
                )
            }
            None => {
                let code = ErrorCode::from_grpc(status.code());
                if code == ErrorCode::Internal {
                    Self::internal(format_args!("grpc: {status}"))
                } else {
                    Self::new(code, status.message())
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_does_not_answer_in_time_is_unavailable_not_internal() {
        let timeout = std::io::Error::new(std::io::ErrorKind::TimedOut, "Timeout expired");
        let mut status = tonic::Status::cancelled("Timeout expired");
        status.set_source(std::sync::Arc::new(timeout));
        assert_eq!(Error::from(status).code, ErrorCode::Unavailable);
        // A cancellation the peer reports stays what it was.
        assert_eq!(
            Error::from(tonic::Status::cancelled("cancelled")).code,
            ErrorCode::Internal
        );
    }

    #[test]
    fn a_broken_connection_is_unavailable_not_internal() {
        let broken = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "connection reset");
        let mut status = tonic::Status::unknown("transport error");
        status.set_source(std::sync::Arc::new(broken));
        assert_eq!(Error::from(status).code, ErrorCode::Unavailable);
        // An Unknown the peer sent (no local source) stays internal.
        assert_eq!(
            Error::from(tonic::Status::unknown("peer")).code,
            ErrorCode::Internal
        );
    }

    const ALL: &[ErrorCode] = &[
        ErrorCode::InvalidRequest,
        ErrorCode::ContentViolation,
        ErrorCode::Unauthenticated,
        ErrorCode::AdminRequired,
        ErrorCode::Forbidden,
        ErrorCode::ModelNotFound,
        ErrorCode::ApiKeyNotFound,
        ErrorCode::NotFound,
        ErrorCode::PaymentRequired,
        ErrorCode::PayloadTooLarge,
        ErrorCode::Gone,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::RateLimited,
        ErrorCode::Unavailable,
        ErrorCode::UpstreamFailed,
        ErrorCode::Timeout,
        ErrorCode::Internal,
    ];

    #[test]
    fn every_code_has_its_own_row() {
        assert_eq!(ALL.len(), ErrorCode::TABLE.len());
        for code in ALL {
            assert_eq!(ErrorCode::from_name(code.as_str()), Some(*code));
        }
    }

    #[test]
    fn errors_survive_a_grpc_round_trip() {
        for code in ALL {
            let sent = Error::new(*code, "because");
            let status: tonic::Status = sent.clone().into();
            let received: Error = status.into();
            assert_eq!(received, sent);
        }
    }

    #[test]
    fn key_not_found_is_a_400_as_in_the_hosted_api() {
        assert_eq!(ErrorCode::ApiKeyNotFound.http_status(), 400);
        assert_eq!(ErrorCode::ModelNotFound.http_status(), 404);
    }
}
