//! Document conversion where a hostile file cannot reach the server.
//!
//! PDF, DOCX, PPTX and XLSX parsers are large and recursive: a 10 KB PDF
//! of nested arrays overflows a parser's stack, a two-cell XLSX can ask
//! for hundreds of gigabytes. Neither is a panic that could be caught: the
//! process aborts. So `rialto serve` converts each such file in a child
//! process (`rialto convert-file`, the same binary) that:
//! - runs with an address-space bound (what it has mapped plus
//!   [`MEMORY_BYTES`]), a CPU-time bound
//!   ([`CPU_SECS`]), no core dumps and no files written, set by the child
//!   on itself before it reads a byte of the file;
//! - gets the file on stdin and answers its text on stdout, or a reason on
//!   stderr with exit status 1;
//! - is killed after [`WALL_TIME`], and never inherits the environment (the
//!   secrets there are none of its business).
//!
//! At most [`CONCURRENT`] children run at once; requests beyond wait for a
//! slot. Whatever way a child ends other than with text (a crash, a limit,
//! the time limit), the request gets a 400 naming the part. Plain text
//! formats are read in process: there is nothing to parse.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

use crate::files::{self, Format};

/// Address space a conversion may add to what the child has mapped when it
/// bounds itself. The binary's mappings and mimalloc's arena, reserved at
/// start, are ~1.1 GB of virtual size (~22 MB resident) and vary from run
/// to run: a bound of 1 GiB in all, as this once was, left the child no
/// room to map anything, so that an allocation the arena could not serve
/// aborted it now and then, even for a small web page (a flaky CI run of
/// `/augment/scrape`). Measured: a 3-million-cell sheet (~100 MB of cells)
/// converts, and the 550 GB allocation fails at once.
pub const MEMORY_BYTES: u64 = 1 << 30;
/// CPU time of a conversion.
pub const CPU_SECS: u64 = 10;
/// Wall time of a conversion, from spawn to its last byte.
pub const WALL_TIME: Duration = Duration::from_secs(20);
/// Conversions running at once; more wait.
pub const CONCURRENT: usize = 2;
/// The converter's niceness (0 is the server's; 19 the lowest priority).
pub const NICENESS: i32 = 10;
/// The argument that makes the binary a converter.
pub const SUBCOMMAND: &str = "convert-file";

/// Turns documents into text, in a sandboxed child or (in tests of this
/// crate, which have no binary to run) in process.
#[derive(Clone)]
pub struct Converter {
    program: Option<PathBuf>,
    slots: Arc<Semaphore>,
    wall_time: Duration,
}

impl std::fmt::Debug for Converter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Converter")
            .field("program", &self.program)
            .finish_non_exhaustive()
    }
}

impl Converter {
    /// Conversions in children: `program convert-file --name N --media-type T`.
    pub fn subprocess(program: PathBuf) -> Self {
        Self {
            program: Some(program),
            slots: Arc::new(Semaphore::new(CONCURRENT)),
            wall_time: WALL_TIME,
        }
    }

    /// Conversions on the blocking pool of this process: no protection
    /// from a parser that aborts. For tests and tools, never for serving.
    pub fn in_process() -> Self {
        Self {
            program: None,
            slots: Arc::new(Semaphore::new(CONCURRENT)),
            wall_time: WALL_TIME,
        }
    }

    /// The same, with another time limit (tests).
    pub fn with_wall_time(mut self, wall_time: Duration) -> Self {
        self.wall_time = wall_time;
        self
    }

    /// The text of a file, or why it cannot be read (named by `name`).
    pub async fn to_text(
        &self,
        name: &str,
        media_type: &str,
        bytes: Vec<u8>,
    ) -> Result<String, String> {
        let format = files::format_of(name, media_type).ok_or_else(|| files::unsupported(name))?;
        if format == Format::Text {
            return files::to_text(name, media_type, &bytes);
        }
        files::precheck(name, format, &bytes)?;
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| "the converter is shutting down".to_owned())?;
        match &self.program {
            Some(program) => self.in_child(program, name, media_type, bytes).await,
            None => {
                let (name, media_type) = (name.to_owned(), media_type.to_owned());
                tokio::task::spawn_blocking(move || files::to_text(&name, &media_type, &bytes))
                    .await
                    .map_err(|_| "the file's conversion failed".to_owned())?
            }
        }
    }

    async fn in_child(
        &self,
        program: &PathBuf,
        name: &str,
        media_type: &str,
        bytes: Vec<u8>,
    ) -> Result<String, String> {
        let unreadable = |why: &str| format!("{name:?} could not be read: {why}");
        let mut child = tokio::process::Command::new(program)
            .arg(SUBCOMMAND)
            .arg("--name")
            .arg(name)
            .arg("--media-type")
            .arg(media_type)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                tracing::error!(error = %e, "cannot start the file converter");
                unreadable("the converter could not start")
            })?;
        let (Some(mut stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(unreadable("the converter could not start"));
        };
        // Feed and drain at once: a child blocked on a full pipe never ends.
        let feed = async move {
            // A child that dies early closes its stdin: its status says why.
            let _ = stdin.write_all(&bytes).await;
            drop(stdin);
        };
        // Four bytes a character at most, and a little room.
        let most_text = (files::MAX_TEXT_CHARS as u64) * 4 + 1024;
        let mut text = Vec::new();
        let mut reason = Vec::new();
        let (mut stdout, mut stderr) = (stdout.take(most_text), stderr.take(4096));
        let drain = async {
            let (out, err) = tokio::join!(
                stdout.read_to_end(&mut text),
                stderr.read_to_end(&mut reason),
            );
            out.and(err)
        };
        let finished = tokio::time::timeout(self.wall_time, async {
            let ((), drained) = tokio::join!(feed, drain);
            drained?;
            child.wait().await
        })
        .await;
        let status = match finished {
            Ok(Ok(status)) => status,
            Ok(Err(error)) => {
                tracing::warn!(%error, "file converter failed");
                return Err(unreadable("the converter failed"));
            }
            Err(_) => {
                let _ = child.kill().await;
                return Err(unreadable(&format!(
                    "reading it took longer than {} s",
                    self.wall_time.as_secs()
                )));
            }
        };
        if status.success() {
            return String::from_utf8(text).map_err(|_| unreadable("its text is not UTF-8"));
        }
        if status.code() == Some(1) {
            // The child's own reason, which names the file already.
            let reason = String::from_utf8_lossy(&reason).trim().to_owned();
            if !reason.is_empty() {
                return Err(reason);
            }
        }
        tracing::warn!(%status, file = name, "a file's converter ended abnormally");
        Err(unreadable(
            "its reader stopped (the file is malformed, or needs more memory or time than a \
             conversion has)",
        ))
    }
}

/// The process's virtual size now (`VmSize` of `/proc/self/status`).
fn mapped_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmSize:"))?;
    let kib: u64 = line
        .trim_start_matches("VmSize:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// `rialto convert-file`: bounds itself, reads a file on stdin, writes its
/// text on stdout. Exit status 0 with text, 1 with a reason on stderr.
pub fn child_main(name: &str, media_type: &str) -> std::process::ExitCode {
    use rlimit::Resource;
    use std::io::{Read, Write};
    // Before any byte of the file: a parser that runs away meets these.
    let Some(mapped) = mapped_bytes() else {
        eprintln!("{name:?} could not be read: the converter cannot see its own size");
        return std::process::ExitCode::from(2);
    };
    let limits = [
        (Resource::AS, mapped.saturating_add(MEMORY_BYTES)),
        (Resource::CPU, CPU_SECS),
        (Resource::CORE, 0),
        (Resource::FSIZE, 0),
    ];
    for (resource, limit) in limits {
        if let Err(error) = rlimit::setrlimit(resource, limit, limit) {
            eprintln!("{name:?} could not be read: the converter cannot bound itself ({error})");
            return std::process::ExitCode::from(2);
        }
    }
    // Below the server's requests: a conversion is batch work, and on a
    // small machine it would otherwise take a core from the request path
    // (issue 16's soak: a DOCX bomb a second put the valid requests' p99 at
    // 2-4× its figure alone). Lowering one's own priority needs no right.
    let _ = rustix::process::setpriority_process(None, NICENESS);
    let mut bytes = Vec::new();
    let limit = files::MAX_FILE_BYTES as u64 + 1;
    if std::io::stdin()
        .lock()
        .take(limit)
        .read_to_end(&mut bytes)
        .is_err()
    {
        eprintln!("{name:?} could not be read");
        return std::process::ExitCode::from(1);
    }
    if bytes.len() > files::MAX_FILE_BYTES {
        eprintln!("the file is larger than {} bytes", files::MAX_FILE_BYTES);
        return std::process::ExitCode::from(1);
    }
    match files::to_text(name, media_type, &bytes) {
        Ok(text) => {
            let mut stdout = std::io::stdout().lock();
            if stdout
                .write_all(text.as_bytes())
                .and_then(|()| stdout.flush())
                .is_err()
            {
                return std::process::ExitCode::from(2);
            }
            std::process::ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("{why}");
            std::process::ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in converter: a shell script that does `body` whatever it
    /// is asked. Written by a shell of its own, not by this process: a
    /// file this process held open for writing could be inherited by a
    /// child another test forks at that moment, and running the script
    /// before that child starts its own program fails (`ETXTBSY`, "the
    /// converter could not start").
    fn script(dir: &tempfile::TempDir, body: &str) -> PathBuf {
        let path = dir.path().join(format!("converter-{}.sh", body.len()));
        let written = std::process::Command::new("/bin/sh")
            .args([
                "-c",
                "printf '%s' \"$1\" > \"$2\" && chmod 755 \"$2\"",
                "sh",
            ])
            .arg(format!("#!/bin/sh\ncat > /dev/null\n{body}\n"))
            .arg(&path)
            .status()
            .unwrap();
        assert!(written.success());
        path
    }

    fn pdf_bytes() -> Vec<u8> {
        b"%PDF-1.5\n1 0 obj << /Type /Catalog >> endobj\n".to_vec()
    }

    #[tokio::test]
    async fn a_child_that_crashes_is_a_reason_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let converter = Converter::subprocess(script(&dir, "kill -SEGV $$"));
        let why = converter
            .to_text("report.pdf", "", pdf_bytes())
            .await
            .unwrap_err();
        assert!(
            why.contains("\"report.pdf\"") && why.contains("stopped"),
            "{why}"
        );
    }

    #[tokio::test]
    async fn a_child_that_hangs_is_killed_at_the_time_limit() {
        let dir = tempfile::tempdir().unwrap();
        let converter = Converter::subprocess(script(&dir, "exec sleep 60"))
            .with_wall_time(Duration::from_millis(500));
        let started = std::time::Instant::now();
        let why = converter
            .to_text("report.pdf", "", pdf_bytes())
            .await
            .unwrap_err();
        assert!(why.contains("longer than"), "{why}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_childs_text_and_reason_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let converter = Converter::subprocess(script(&dir, "printf 'page one'"));
        assert_eq!(
            converter.to_text("a.pdf", "", pdf_bytes()).await.unwrap(),
            "page one"
        );
        let refusing = Converter::subprocess(script(&dir, "echo 'not a PDF' >&2; exit 1"));
        assert_eq!(
            refusing
                .to_text("a.pdf", "", pdf_bytes())
                .await
                .unwrap_err(),
            "not a PDF"
        );
    }

    #[tokio::test]
    async fn the_child_sees_none_of_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let converter = Converter::subprocess(script(&dir, "printf '%s' \"${HOME:-none}\""));
        assert_eq!(
            converter.to_text("a.pdf", "", pdf_bytes()).await.unwrap(),
            "none"
        );
    }
}
