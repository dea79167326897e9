//! Rialto's gRPC interfaces, generated from `proto/` at build time.
//!
//! Each service lives in its own versioned package (`rialto.<service>.v1`).
//! This crate holds generated code only; the domain traits and the adapters
//! between them and tonic live in the service crates.

#![allow(clippy::all, missing_docs)]

pub mod auth {
    pub mod v1 {
        tonic::include_proto!("rialto.auth.v1");
    }
}

pub mod limiter {
    pub mod v1 {
        tonic::include_proto!("rialto.limiter.v1");
    }
}

pub mod billing {
    pub mod v1 {
        tonic::include_proto!("rialto.billing.v1");
    }
}

pub mod router {
    pub mod v1 {
        tonic::include_proto!("rialto.router.v1");
    }
}
