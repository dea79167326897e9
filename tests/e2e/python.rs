//! Python clients against Rialto, in both topologies: the official `openai`
//! SDK (a plain chat, a streamed chat, `n = 2`; tests/python/openai_sdk_check.py)
//! and an OpenAPI conformance check of the published document against real
//! exchanges (tests/python/openapi_conformance.py).

use std::path::PathBuf;

use crate::both_topologies;
use crate::support::World;

both_topologies!(openai_python_sdk, openapi_conformance);

/// The venv's Python that `make test` prepares (or `E2E_PYTHON`).
fn python() -> PathBuf {
    if let Some(path) = std::env::var_os("E2E_PYTHON") {
        return PathBuf::from(path);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run `make test` (it creates the venv with the openai SDK)",
        python.display()
    );
    python
}

async fn openai_python_sdk(world: &World) {
    let account = world.sandbox.create_account("sdk").await.unwrap();
    let (_, key) = world
        .sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/openai_sdk_check.py");
    let output = tokio::process::Command::new(python())
        .arg(script)
        .env("RIALTO_E2E_BASE_URL", world.sandbox.api(""))
        .env("RIALTO_E2E_API_KEY", &key)
        .env("RIALTO_E2E_MODEL", "mock-chat")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "SDK check failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("plain ok") && stdout.contains("stream ok") && stdout.contains("n=2 ok"),
        "{stdout}"
    );
}

async fn openapi_conformance(world: &World) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/openapi_conformance.py");
    let output = tokio::process::Command::new(python())
        .arg(script)
        .env("RIALTO_E2E_ROOT_URL", &world.sandbox.url)
        .env("RIALTO_E2E_OPERATOR_TOKEN", &world.sandbox.operator_token)
        .env("RIALTO_E2E_MODEL", "mock-chat")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "conformance failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("conformance ok"), "{stdout}");
}
