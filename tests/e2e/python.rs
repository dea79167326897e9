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

/// Runs `tests/python/<script>` with `envs`; fails the test with its output
/// unless it exits 0. Returns its stdout.
async fn run_script(script: &str, envs: &[(&str, &str)]) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    let output = tokio::process::Command::new(python())
        .arg(path)
        .envs(envs.iter().copied())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{script} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

async fn openai_python_sdk(world: &World) {
    let account = world.sandbox.create_account("sdk").await.unwrap();
    let (_, key) = world
        .sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    let base_url = world.sandbox.api("");
    let stdout = run_script(
        "openai_sdk_check.py",
        &[
            ("RIALTO_E2E_BASE_URL", &base_url),
            ("RIALTO_E2E_API_KEY", &key),
            ("RIALTO_E2E_MODEL", "mock-chat"),
        ],
    )
    .await;
    for check in ["plain ok", "stream ok", "n=2 ok", "auth error ok"] {
        assert!(stdout.contains(check), "{stdout}");
    }
}

async fn openapi_conformance(world: &World) {
    let stdout = run_script(
        "openapi_conformance.py",
        &[
            ("RIALTO_E2E_ROOT_URL", &world.sandbox.url),
            ("RIALTO_E2E_OPERATOR_TOKEN", &world.sandbox.operator_token),
            ("RIALTO_E2E_MODEL", "mock-chat"),
        ],
    )
    .await;
    assert!(stdout.contains("conformance ok"), "{stdout}");
}
