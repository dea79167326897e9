//! Stamps the build revision (`<yyyymmdd>.<hhmmss>`, UTC) into the binary:
//! the time of the checked-out commit, or the build time outside git.

use std::path::Path;
use std::process::Command;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let git = root.join(".git");
    println!("cargo:rerun-if-changed={}", git.join("HEAD").display());
    let head = std::fs::read_to_string(git.join("HEAD")).unwrap_or_default();
    if let Some(reference) = head.strip_prefix("ref: ") {
        let reference = git.join(reference.trim());
        println!("cargo:rerun-if-changed={}", reference.display());
    }
    let commit_time = Command::new("git")
        .args(["log", "-1", "--format=%ct"])
        .current_dir(&root)
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse::<i64>().ok());
    let time = commit_time
        .and_then(|secs| chrono::DateTime::from_timestamp(secs, 0))
        .unwrap_or_else(chrono::Utc::now);
    println!(
        "cargo:rustc-env=RIALTO_REVISION={}",
        time.format("%Y%m%d.%H%M%S")
    );
}
