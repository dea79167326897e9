//! A built-in speech model: eSpeak NG (Debian's `espeak-ng`), a formant
//! synthesizer small and fast enough for any CPU, run as a child process
//! per request. It is what `make run` serves as `/audio/speech` with no
//! server of its own: robotic, but real speech in 100+ languages.
//!
//! A `local` backend whose `path` is the `espeak-ng` program serves OpenAI's
//! `/audio/speech`: `input` is read from stdin (never an argument, which a
//! text starting with `-` would turn into an option), `voice` is an eSpeak
//! voice (`en-us`, `de`, `fr`; letters, digits and `-` only), `speed` scales
//! its 175 words a minute, and the answer is a 22,050 Hz mono WAV (or its
//! samples alone for `pcm`). eSpeak writes a WAV for a stream, its lengths
//! unknown; they are set here so readers see its true length.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use rialto_core::{Error, ErrorCode, Result};
use serde_json::{Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::inprocess::InProcessModel;

/// The program's file name that makes a `local` backend this model.
pub const ESPEAK: &str = "espeak-ng";
/// eSpeak's words a minute at speed 1.
const WORDS_PER_MINUTE: f64 = 175.0;
/// Syntheses running at once; more wait.
const CONCURRENT: usize = 2;
/// Longest input (a queued job's).
const MAX_INPUT_CHARS: usize = 100_000;
/// The most audio one request may make (a minute of speech is ~2.6 MB).
const MAX_AUDIO_BYTES: u64 = 256 * 1024 * 1024;
/// The longest a synthesis may take.
const WALL_TIME: Duration = Duration::from_secs(120);

pub struct Espeak {
    program: PathBuf,
    slots: tokio::sync::Semaphore,
}

impl Espeak {
    /// Checks the program runs (`--version`); a missing one leaves the
    /// backend down, as a model file that fails to load does.
    pub fn start(model_id: &str, program: &Path) -> Result<Self> {
        let output = std::process::Command::new(program)
            .arg("--version")
            .env_clear()
            .output()
            .map_err(|error| {
                Error::new(
                    ErrorCode::Unavailable,
                    format!(
                        "model {model_id}: {} cannot run ({error}); install Debian's espeak-ng",
                        program.display()
                    ),
                )
            })?;
        tracing::info!(
            model = model_id,
            version = String::from_utf8_lossy(&output.stdout).trim(),
            "espeak-ng speech ready"
        );
        Ok(Self {
            program: program.to_owned(),
            slots: tokio::sync::Semaphore::new(CONCURRENT),
        })
    }

    async fn speak(&self, text: &str, voice: &str, speed: f64) -> Result<Vec<u8>> {
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| Error::new(ErrorCode::Unavailable, "speech is shutting down"))?;
        let words_per_minute = (WORDS_PER_MINUTE * speed).round().clamp(80.0, 700.0) as u32;
        let mut child = tokio::process::Command::new(&self.program)
            .args(["--stdout", "-v", voice, "-s", &words_per_minute.to_string()])
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|error| {
                tracing::warn!(%error, "espeak-ng could not start");
                Error::new(ErrorCode::Unavailable, "The speech model is not available")
            })?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Error::new(
                ErrorCode::Unavailable,
                "The speech model is not available",
            ));
        };
        let text = text.to_owned();
        let feed = async move {
            let _ = stdin.write_all(text.as_bytes()).await;
        };
        let mut wav = Vec::new();
        let read = async { stdout.take(MAX_AUDIO_BYTES).read_to_end(&mut wav).await };
        let finished = tokio::time::timeout(WALL_TIME, async {
            let ((), read) = tokio::join!(feed, read);
            read?;
            child.wait().await
        })
        .await;
        if wav.len() as u64 >= MAX_AUDIO_BYTES {
            // Cut off at the bound: refused rather than answered short.
            return Err(Error::invalid(
                "The speech would be longer than one answer may be: split the input",
            ));
        }
        match finished {
            Ok(Ok(status)) if status.success() => fixed_lengths(wav),
            Ok(Ok(status)) => {
                tracing::warn!(%status, "espeak-ng failed");
                Err(Error::new(
                    ErrorCode::UpstreamFailed,
                    "The speech model failed",
                ))
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "espeak-ng failed");
                Err(Error::new(
                    ErrorCode::UpstreamFailed,
                    "The speech model failed",
                ))
            }
            Err(_) => Err(Error::new(ErrorCode::Timeout, "The speech took too long")),
        }
    }
}

/// eSpeak's streamed WAV with its RIFF and `data` lengths set to what it
/// holds.
fn fixed_lengths(mut wav: Vec<u8>) -> Result<Vec<u8>> {
    let broken = || Error::new(ErrorCode::UpstreamFailed, "The speech model made no WAV");
    if wav.len() < 12 || &wav[..4] != b"RIFF" || &wav[8..12] != b"WAVE" {
        return Err(broken());
    }
    let riff = u32::try_from(wav.len() - 8).map_err(|_| broken())?;
    wav[4..8].copy_from_slice(&riff.to_le_bytes());
    let mut at = 12;
    while at + 8 <= wav.len() {
        let size =
            u32::from_le_bytes([wav[at + 4], wav[at + 5], wav[at + 6], wav[at + 7]]) as usize;
        if &wav[at..at + 4] == b"data" {
            let data = u32::try_from(wav.len() - at - 8).map_err(|_| broken())?;
            wav[at + 4..at + 8].copy_from_slice(&data.to_le_bytes());
            return Ok(wav);
        }
        at += 8 + size + size % 2;
    }
    Err(broken())
}

/// The samples of a WAV (its `data` chunk), for `pcm`.
fn samples(wav: &[u8]) -> &[u8] {
    let mut at = 12;
    while at + 8 <= wav.len() {
        let size =
            u32::from_le_bytes([wav[at + 4], wav[at + 5], wav[at + 6], wav[at + 7]]) as usize;
        if &wav[at..at + 4] == b"data" {
            return &wav[at + 8..(at + 8 + size).min(wav.len())];
        }
        at += 8 + size + size % 2;
    }
    &[]
}

/// An eSpeak voice name: what can go on its command line.
fn voice_name(voice: &str) -> Option<&str> {
    (!voice.is_empty()
        && voice.len() <= 64
        && !voice.starts_with('-')
        && voice
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'+'))
    .then_some(voice)
}

#[async_trait]
impl InProcessModel for Espeak {
    async fn media(&self, path: &str, body: &Map<String, Value>) -> Result<(Vec<u8>, String)> {
        if path != "/audio/speech" {
            return Err(Error::invalid(format!("This model does not serve {path}")));
        }
        let text = body
            .get("input")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if text.trim().is_empty() || text.chars().count() > MAX_INPUT_CHARS {
            return Err(Error::invalid(format!(
                "input must be 1 to {MAX_INPUT_CHARS} characters"
            )));
        }
        let voice = body.get("voice").and_then(Value::as_str).unwrap_or("en-us");
        let voice =
            voice_name(voice).ok_or_else(|| Error::invalid(format!("{voice} is not a voice")))?;
        let speed = body.get("speed").and_then(Value::as_f64).unwrap_or(1.0);
        let wav = self.speak(text, voice, speed).await?;
        match body.get("response_format").and_then(Value::as_str) {
            None | Some("wav") => Ok((wav, "audio/wav".to_owned())),
            Some("pcm") => Ok((samples(&wav).to_vec(), "audio/pcm".to_owned())),
            Some(other) => Err(Error::invalid(format!(
                "espeak-ng makes wav and pcm, not {other}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed_wav(samples: &[u8]) -> Vec<u8> {
        let mut wav = b"RIFF\x24\xf0\xff\x7fWAVEfmt ".to_vec();
        wav.extend_from_slice(&16u32.to_le_bytes());
        wav.extend_from_slice(&[1, 0, 1, 0, 0x22, 0x56, 0, 0, 0x44, 0xac, 0, 0, 2, 0, 16, 0]);
        wav.extend_from_slice(b"data\x00\xf0\xff\x7f");
        wav.extend_from_slice(samples);
        wav
    }

    #[test]
    fn a_streamed_wav_gets_its_true_lengths() {
        let wav = fixed_lengths(streamed_wav(&[1, 0, 2, 0])).unwrap();
        assert_eq!(u32::from_le_bytes(wav[4..8].try_into().unwrap()), 40);
        assert_eq!(u32::from_le_bytes(wav[40..44].try_into().unwrap()), 4);
        assert_eq!(samples(&wav), &[1, 0, 2, 0]);
        assert!(fixed_lengths(b"not a wav".to_vec()).is_err());
    }

    #[test]
    fn only_voice_names_reach_the_command_line() {
        assert_eq!(voice_name("en-us"), Some("en-us"));
        assert_eq!(voice_name("en+f3"), Some("en+f3"));
        for bad in ["", "--help", "a b", "../x", "en;rm"] {
            assert!(voice_name(bad).is_none(), "{bad}");
        }
    }
}
