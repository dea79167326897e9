//! The ledger's log on SQLite: a record is durable once it is appended
//! here, and the writer applies it to the database in its batch after.
//!
//! A settlement used to answer only once the writer's batch carrying it was
//! committed: a hop into the writer's thread, a SQLite commit of four
//! pages, and a hop back, 150 µs at best and the writer's stalls at worst
//! (BENCHMARKS.md). Appending its record to a file of our own is one
//! `write` on the caller's thread. It is as durable as the commit it
//! replaces: the database runs `synchronous = NORMAL`, whose commits reach
//! the operating system and survive a kill of the process but not a power
//! loss, and so does a `write` that returned.
//!
//! The log is a series of segment files beside the database
//! (`<file>-ledger.<n>`), each a sequence of frames (length, CRC-32,
//! record). Appending and queueing for the writer happen under one mutex,
//! so the writer applies records in the log's order; once the database has
//! every record of a segment that is full, the segment is deleted (a
//! stream's opening record the writer holds back until the stream ends,
//! [`held_back`](super::held_back), keeps its segment until then). When a
//! process starts, the writer first applies whatever segments are left
//! (idempotently: a record the database has already is a duplicate and
//! changes nothing) and only then serves any job, so no owner is loaded
//! from a database that misses a record.
//!
//! Only one process may write a ledger this way: the log is guarded by an
//! exclusive lock on `<file>-ledger.lock`. A second process on the same
//! file (a misconfiguration: billing replicas belong on PostgreSQL) finds
//! it taken and writes without a log, waiting for its batches.
//!
//! A caller whose record may be a duplicate (a settlement of a hold this
//! process does not know) still waits for its batch, to learn whether it
//! charged; so does every caller while the writer is more than
//! [`BACKLOG`] records behind, so that memory and the log stay bounded by
//! what the writer sustains.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rialto_core::{Error, ErrorCode, Result};
use tokio::sync::{mpsc, oneshot};

use super::{Job, Nudge, Record, RecordKind, Written};
use crate::book::Owner;

/// A segment is closed, and a new one begun, past this size.
const SEGMENT_BYTES: u64 = 1 << 20;
/// Records appended and not yet committed past which callers wait for
/// their batches again.
pub(crate) const BACKLOG: u64 = 8192;
/// Full segments the log keeps for records the writer holds back
/// ([`held_back`](super::held_back)): past these, the oldest are written.
pub(crate) const KEPT_SEGMENTS: usize = 4;
/// Largest frame read back: a longer length is a torn or foreign file.
const MAX_FRAME: usize = 64 << 10;

pub(crate) struct Log {
    /// `<file>-ledger`: segments are `<base>.<n>`.
    base: PathBuf,
    inner: Mutex<Inner>,
    /// The last sequence number the writer is done with (committed, or
    /// held back in its memory): what [`BACKLOG`] counts from.
    applied: AtomicU64,
    /// Every record up to this one is in the database.
    written: AtomicU64,
    /// A logged record could not be committed: keep every segment, so the
    /// next start applies it.
    keep: AtomicBool,
    /// Held for the process's life: the exclusive lock on the log.
    _lock: File,
}

struct Inner {
    file: File,
    segment: u64,
    /// The last sequence number appended.
    seq: u64,
    bytes: u64,
    /// Full segments not yet deleted: (segment, last sequence number).
    closed: VecDeque<(u64, u64)>,
    buffer: Vec<u8>,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log").field("base", &self.base).finish()
    }
}

/// What [`Log::open`] found: the log, and the records of earlier
/// processes' segments, which the writer applies before anything else,
/// then deletes `leftover`.
pub(crate) struct Opened {
    pub log: Arc<Log>,
    pub replay: Vec<Record>,
    pub leftover: Vec<PathBuf>,
}

impl Log {
    /// Takes the log of the ledger in `database` (a SQLite file). `None`
    /// when another process holds it.
    pub(crate) fn open(database: &Path) -> io::Result<Option<Opened>> {
        let mut base = database.as_os_str().to_owned();
        base.push("-ledger");
        let base = PathBuf::from(base);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(suffixed(&base, "lock"))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Ok(None),
            Err(TryLockError::Error(error)) => return Err(error),
        }
        let mut segments = existing_segments(&base)?;
        segments.sort_unstable();
        let mut replay = Vec::new();
        let mut leftover = Vec::new();
        for &segment in &segments {
            let path = segment_path(&base, segment);
            read_segment(&path, &mut replay)?;
            leftover.push(path);
        }
        let segment = segments.last().map_or(1, |last| last + 1);
        let file = create_segment(&base, segment)?;
        let log = Arc::new(Self {
            base,
            inner: Mutex::new(Inner {
                file,
                segment,
                seq: 0,
                bytes: 0,
                closed: VecDeque::new(),
                buffer: Vec::with_capacity(512),
            }),
            applied: AtomicU64::new(0),
            written: AtomicU64::new(0),
            keep: AtomicBool::new(false),
            _lock: lock,
        });
        Ok(Some(Opened {
            log,
            replay,
            leftover,
        }))
    }

    /// Appends `record` and queues it for the writer, in one step so that
    /// the writer sees records in the log's order. `done` hears
    /// [`Written::Applied`] at once when the append made the record
    /// durable and its outcome is known; otherwise it goes with the job
    /// and hears the batch's outcome.
    pub(crate) fn append(
        &self,
        mut record: Record,
        done: Option<oneshot::Sender<Result<Written>>>,
        jobs: &mpsc::UnboundedSender<Job>,
        nudge: &Nudge,
    ) -> Result<()> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let seq = inner.seq + 1;
        record.log_seq = seq;
        let Inner { file, buffer, .. } = &mut *inner;
        buffer.clear();
        encode(&record, buffer);
        if buffer.len() > 8 + MAX_FRAME {
            return Err(Error::invalid("A ledger record is too large to write"));
        }
        if let Err(error) = file.write_all(buffer) {
            tracing::error!(%error, "cannot append to the ledger log");
            // Part of the frame may be in the file: cut it off, so that
            // the frames appended next are read back; failing that, they
            // go to a new segment, and this one ends at the torn frame.
            let good = inner.bytes;
            if inner.file.set_len(good).is_err() {
                self.rotate(&mut inner);
            }
            return Err(Error::new(
                ErrorCode::Unavailable,
                "The ledger cannot be written now; retry",
            ));
        }
        inner.seq = seq;
        inner.bytes += inner.buffer.len() as u64;
        // A duplicate is only known once the database is asked; and a
        // writer far behind makes its callers wait for it.
        let settled_now =
            !record.late && seq.saturating_sub(self.applied.load(Ordering::Relaxed)) < BACKLOG;
        let done = match done {
            Some(done) if settled_now => {
                let _ = done.send(Ok(Written::Applied));
                None
            }
            done => done,
        };
        let waited_on = done.is_some();
        jobs.send(Job::Write { record, done })
            .map_err(|_| super::stopped())?;
        nudge.job(waited_on);
        if inner.bytes >= SEGMENT_BYTES {
            self.rotate(&mut inner);
        }
        Ok(())
    }

    fn rotate(&self, inner: &mut Inner) {
        match create_segment(&self.base, inner.segment + 1) {
            Ok(file) => {
                let full = (inner.segment, inner.seq);
                inner.closed.push_back(full);
                inner.file = file;
                inner.segment += 1;
                inner.bytes = 0;
            }
            // The segment grows on; the next append tries again.
            Err(error) => tracing::warn!(%error, "cannot begin a new ledger log segment"),
        }
    }

    /// The writer is done with every record up to `seq`: each is committed
    /// or held back in its memory ([`held_back`](super::held_back)), and
    /// every record up to `written` is in the database. Full segments all
    /// of whose records are in the database are deleted; a held-back
    /// record's segment stays, for the next start to apply it.
    pub(crate) fn applied(&self, seq: u64, written: u64) {
        self.applied.fetch_max(seq, Ordering::Relaxed);
        let written = written.min(seq);
        self.written.fetch_max(written, Ordering::Relaxed);
        if self.keep.load(Ordering::Relaxed) {
            return;
        }
        let mut done = Vec::new();
        {
            let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            while let Some(&(segment, last)) = inner.closed.front() {
                if last > written {
                    break;
                }
                inner.closed.pop_front();
                done.push(segment_path(&self.base, segment));
            }
        }
        for path in done {
            if let Err(error) = std::fs::remove_file(&path) {
                tracing::warn!(%error, path = %path.display(), "cannot delete a ledger log segment");
            }
        }
    }

    /// The records up to this one must reach the database now: the log
    /// keeps more than [`KEPT_SEGMENTS`] full segments, and these are in
    /// the oldest (0 when it does not).
    pub(crate) fn keeps_through(&self) -> u64 {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let closed = inner.closed.len();
        match closed.checked_sub(KEPT_SEGMENTS + 1) {
            Some(past) => inner.closed[past].1,
            None => 0,
        }
    }

    /// Records appended that the writer has not committed yet.
    #[cfg(test)]
    pub(crate) fn behind(&self) -> u64 {
        let seq = self.inner.lock().unwrap_or_else(|e| e.into_inner()).seq;
        seq.saturating_sub(self.applied.load(Ordering::Relaxed))
    }

    /// A logged record was not committed: every segment stays, so that the
    /// next start applies it.
    pub(crate) fn keep(&self) {
        if !self.keep.swap(true, Ordering::Relaxed) {
            tracing::error!(
                "a ledger record in the log could not be committed; the log is kept until the next start applies it"
            );
        }
    }

    /// The writer stopped with every job done: a log fully committed is
    /// deleted.
    pub(crate) fn close(&self) {
        if self.keep.load(Ordering::Relaxed) {
            return;
        }
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if self.written.load(Ordering::Relaxed) < inner.seq {
            return;
        }
        let segments = inner.closed.iter().map(|&(segment, _)| segment);
        for segment in segments.chain([inner.segment]) {
            let _ = std::fs::remove_file(segment_path(&self.base, segment));
        }
    }
}

fn suffixed(base: &Path, suffix: &str) -> PathBuf {
    let mut path = base.as_os_str().to_owned();
    path.push(".");
    path.push(suffix);
    PathBuf::from(path)
}

fn segment_path(base: &Path, segment: u64) -> PathBuf {
    suffixed(base, &format!("{segment:08}"))
}

fn create_segment(base: &Path, segment: u64) -> io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(segment_path(base, segment))
}

/// The numbers of the segments beside `base`.
fn existing_segments(base: &Path) -> io::Result<Vec<u64>> {
    let folder = match base.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let Some(prefix) = base.file_name().and_then(|n| n.to_str()) else {
        return Ok(Vec::new());
    };
    let mut segments = Vec::new();
    for entry in std::fs::read_dir(folder)? {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        let number = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('.'))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u64>().ok());
        segments.extend(number);
    }
    Ok(segments)
}

/// Reads a segment's records into `records`, up to its end or a frame
/// that is torn (a power loss during an append): what follows a torn
/// frame was never acknowledged.
fn read_segment(path: &Path, records: &mut Vec<Record>) -> io::Result<()> {
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        match decode_frame(rest) {
            Some((record, used)) => {
                records.push(record);
                rest = &rest[used..];
            }
            None => {
                tracing::warn!(
                    path = %path.display(),
                    bytes = rest.len(),
                    "the ledger log ends in a torn record; it is ignored"
                );
                break;
            }
        }
    }
    Ok(())
}

// A frame: length (u32), CRC-32 of the payload (u32), payload; little
// endian. The payload: kind, flags, eleven i64 and the strings, each a u32
// length and its bytes, then `at_ms` (an i64) when flagged `TIMED`.

const DURABLE: u8 = 1;
const LATE: u8 = 2;
const KEYED: u8 = 4;
const REST: u8 = 8;
/// The record names the API key that made the request (a log written
/// before this flag existed has none).
const ATTRIBUTED: u8 = 16;
/// The record carries when it was decided (`at_ms`, 8 bytes after the
/// strings; a log written before this flag existed has none).
const TIMED: u8 = 32;

fn encode(record: &Record, out: &mut Vec<u8>) {
    out.extend_from_slice(&[0; 8]);
    out.push(kind_byte(record.kind));
    let mut flags = 0;
    if record.durable {
        flags |= DURABLE;
    }
    if record.late {
        flags |= LATE;
    }
    if record.key.is_some() {
        flags |= KEYED;
    }
    if record.rest {
        flags |= REST;
    }
    if !record.spent_by.is_empty() {
        flags |= ATTRIBUTED;
    }
    if record.timed() {
        flags |= TIMED;
    }
    out.push(flags);
    for number in [
        record.fence,
        record.usd,
        record.diem,
        record.owed,
        record.held.0,
        record.held.1,
        record.tokens.0,
        record.tokens.1,
        record.expires_at_ms,
        record.checkpoint,
        record.day,
    ] {
        out.extend_from_slice(&number.to_le_bytes());
    }
    put_str(out, &record.owner.name);
    put_str(out, &record.request_id);
    put_str(out, &record.model_id);
    if let Some(key) = &record.key {
        put_str(out, &key.0);
        put_str(out, &key.1);
    }
    if !record.spent_by.is_empty() {
        put_str(out, &record.spent_by);
    }
    if record.timed() {
        out.extend_from_slice(&record.at_ms.to_le_bytes());
    }
    let payload = &out[8..];
    let length = payload.len() as u32;
    let crc = crc32fast::hash(payload);
    out[..4].copy_from_slice(&length.to_le_bytes());
    out[4..8].copy_from_slice(&crc.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

fn kind_byte(kind: RecordKind) -> u8 {
    match kind {
        RecordKind::Open => 1,
        RecordKind::Settle => 2,
        RecordKind::Expire => 3,
        RecordKind::Checkpoint => 4,
        RecordKind::Epoch => 5,
        RecordKind::Refresh => 6,
    }
}

fn kind_of(byte: u8) -> Option<RecordKind> {
    Some(match byte {
        1 => RecordKind::Open,
        2 => RecordKind::Settle,
        3 => RecordKind::Expire,
        4 => RecordKind::Checkpoint,
        5 => RecordKind::Epoch,
        6 => RecordKind::Refresh,
        _ => return None,
    })
}

/// One frame at the start of `bytes`: the record and the bytes it took.
fn decode_frame(bytes: &[u8]) -> Option<(Record, usize)> {
    let length = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    if length > MAX_FRAME {
        return None;
    }
    let payload = bytes.get(8..8 + length)?;
    if crc32fast::hash(payload) != crc {
        return None;
    }
    Some((decode(payload)?, 8 + length))
}

fn decode(payload: &[u8]) -> Option<Record> {
    let mut reader = Reader(payload);
    let kind = kind_of(reader.byte()?)?;
    let flags = reader.byte()?;
    let mut numbers = [0i64; 11];
    for number in &mut numbers {
        *number = reader.i64()?;
    }
    let [
        fence,
        usd,
        diem,
        owed,
        held_usd,
        held_diem,
        prompt,
        completion,
        expires_at_ms,
        checkpoint,
        day,
    ] = numbers;
    let owner = reader.str()?;
    let request_id = reader.str()?;
    let model_id = reader.str()?;
    let key = if flags & KEYED != 0 {
        Some(Arc::new((
            reader.str()?.to_owned(),
            reader.str()?.to_owned(),
        )))
    } else {
        None
    };
    let spent_by = if flags & ATTRIBUTED != 0 {
        reader.str()?
    } else {
        ""
    };
    let at_ms = if flags & TIMED != 0 { reader.i64()? } else { 0 };
    if !reader.0.is_empty() {
        return None;
    }
    Some(Record {
        owner: Arc::new(Owner::detached(owner)),
        fence,
        kind,
        request_id: request_id.into(),
        usd,
        diem,
        owed,
        held: (held_usd, held_diem),
        durable: flags & DURABLE != 0,
        late: flags & LATE != 0,
        rest: flags & REST != 0,
        key,
        model_id: model_id.into(),
        spent_by: spent_by.into(),
        tokens: (prompt, completion),
        expires_at_ms,
        at_ms,
        checkpoint,
        day,
        log_seq: 0,
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(taken)
    }

    fn byte(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn i64(&mut self) -> Option<i64> {
        Some(i64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn str(&mut self) -> Option<&'a str> {
        let length = u32::from_le_bytes(self.take(4)?.try_into().ok()?) as usize;
        std::str::from_utf8(self.take(length)?).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settlement() -> Record {
        let mut record = Record::new(
            Arc::new(Owner::detached("account:a")),
            7,
            RecordKind::Settle,
        );
        record.request_id = "0123456789abcdef".into();
        record.usd = 1_500;
        record.diem = 20;
        record.owed = 3;
        record.held = (4_000, 100);
        record.durable = true;
        record.key = Some(Arc::new(("key-1".to_owned(), "2026-11-24".to_owned())));
        record.model_id = "m".into();
        record.spent_by = "key-1".into();
        record.tokens = (10, 20);
        record
    }

    fn same(a: &Record, b: &Record) -> bool {
        format!(
            "{:?}",
            (a.kind, &a.request_id, a.usd, a.diem, a.owed, a.held)
        ) == format!(
            "{:?}",
            (b.kind, &b.request_id, b.usd, b.diem, b.owed, b.held)
        ) && (
            a.durable,
            a.late,
            a.rest,
            &a.key,
            &a.model_id,
            &a.spent_by,
            a.tokens,
            a.fence,
            a.at_ms,
        ) == (
            b.durable,
            b.late,
            b.rest,
            &b.key,
            &b.model_id,
            &b.spent_by,
            b.tokens,
            b.fence,
            b.at_ms,
        ) && a.owner.name == b.owner.name
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let record = settlement();
        let mut bytes = Vec::new();
        encode(&record, &mut bytes);
        let (read, used) = decode_frame(&bytes).unwrap();
        assert_eq!(used, bytes.len());
        assert!(same(&record, &read));
    }

    #[test]
    fn a_record_keeps_when_it_was_decided_and_an_older_frame_reads_without_it() {
        let mut opened = settlement();
        opened.kind = RecordKind::Open;
        opened.at_ms = 1_800_000_000_123;
        let mut bytes = Vec::new();
        encode(&opened, &mut bytes);
        let (read, _) = decode_frame(&bytes).unwrap();
        assert_eq!(read.at_ms, 1_800_000_000_123);
        assert!(same(&opened, &read));
        // A frame from before the flag: no `TIMED`, nothing after the
        // strings; it reads as "when written" (0).
        let untimed = settlement();
        let mut bytes = Vec::new();
        encode(&untimed, &mut bytes);
        assert_eq!(bytes[9] & TIMED, 0);
        assert_eq!(decode_frame(&bytes).unwrap().0.at_ms, 0);
    }

    #[test]
    fn a_torn_or_damaged_frame_reads_as_nothing() {
        let mut timed = settlement();
        timed.at_ms = 1_800_000_000_123;
        for record in [settlement(), timed] {
            let mut bytes = Vec::new();
            encode(&record, &mut bytes);
            for cut in 0..bytes.len() {
                assert!(decode_frame(&bytes[..cut]).is_none(), "cut at {cut}");
            }
            for i in 0..bytes.len() {
                let mut damaged = bytes.clone();
                damaged[i] ^= 0x40;
                assert!(decode_frame(&damaged).is_none(), "byte {i} damaged");
            }
        }
    }

    #[test]
    fn only_one_process_takes_the_log_and_a_torn_tail_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let database = dir.path().join("ledger.db");
        let first = Log::open(&database).unwrap().unwrap();
        assert!(first.replay.is_empty());
        assert!(Log::open(&database).unwrap().is_none());
        let (jobs, mut queue) = mpsc::unbounded_channel();
        for _ in 0..3 {
            first
                .log
                .append(settlement(), None, &jobs, &Nudge::default())
                .unwrap();
        }
        // A power loss in the middle of a fourth append.
        let mut torn = Vec::new();
        encode(&settlement(), &mut torn);
        {
            let mut inner = first.log.inner.lock().unwrap();
            inner.file.write_all(&torn[..torn.len() / 2]).unwrap();
        }
        let mut queued = 0;
        while let Ok(Job::Write { record, .. }) = queue.try_recv() {
            queued += 1;
            assert_eq!(record.log_seq, queued);
        }
        assert_eq!(queued, 3);
        drop(first);
        let second = Log::open(&database).unwrap().unwrap();
        assert_eq!(second.replay.len(), 3);
        assert!(second.replay.iter().all(|r| same(r, &settlement())));
        assert_eq!(second.leftover.len(), 1);
    }

    #[test]
    fn full_segments_go_once_committed() {
        let dir = tempfile::tempdir().unwrap();
        let database = dir.path().join("ledger.db");
        let Opened { log, .. } = Log::open(&database).unwrap().unwrap();
        let (jobs, _queue) = mpsc::unbounded_channel();
        let mut appended = 0;
        while log.inner.lock().unwrap().closed.is_empty() {
            log.append(settlement(), None, &jobs, &Nudge::default())
                .unwrap();
            appended += 1;
        }
        let count = || existing_segments(&log.base).unwrap().len();
        assert_eq!(count(), 2);
        log.applied(appended - 1, appended - 1);
        assert_eq!(count(), 2, "a segment with a record not committed stays");
        log.applied(appended, 3);
        assert_eq!(count(), 2, "a segment with a record held back stays");
        assert_eq!(log.keeps_through(), 0);
        assert_eq!(log.behind(), 0, "a record held back is not behind");
        log.applied(appended, appended);
        assert_eq!(count(), 1);
        log.close();
        assert_eq!(count(), 0);
    }

    #[test]
    fn past_its_kept_segments_the_oldest_records_are_due() {
        let dir = tempfile::tempdir().unwrap();
        let database = dir.path().join("ledger.db");
        let Opened { log, .. } = Log::open(&database).unwrap().unwrap();
        let (jobs, _queue) = mpsc::unbounded_channel();
        let closed = || log.inner.lock().unwrap().closed.clone();
        while closed().len() <= KEPT_SEGMENTS {
            assert_eq!(log.keeps_through(), 0);
            log.append(settlement(), None, &jobs, &Nudge::default())
                .unwrap();
        }
        let oldest = closed()[0].1;
        assert_eq!(log.keeps_through(), oldest);
        // Once the database has the oldest segment's records, it goes.
        log.applied(oldest + 1, oldest);
        assert_eq!(closed().len(), KEPT_SEGMENTS);
        assert_eq!(log.keeps_through(), 0);
    }
}
