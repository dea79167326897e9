//! Compiles `proto/` with protox (pure Rust), so no system `protoc` is needed.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "rialto/auth/v1/auth.proto",
    "rialto/limiter/v1/limiter.proto",
    "rialto/billing/v1/billing.proto",
    "rialto/router/v1/router.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    // `compile_fds` prints no rerun-if-changed lines for the protos: add them.
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let descriptors = protox::compile(PROTOS, [&root])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
