//! Streams' opening records held back from the database until the stream
//! ends (SQLite, with the ledger's [`log`](super::log)).
//!
//! A stream's hold is durable once its opening record is in the log, before
//! its first token. Written to the database as it came, a stream that
//! outlives a batch's gathering (nearly every real stream: the writer
//! gathers for 50 ms) wrote its hold twice: a row inserted into the open
//! holds' indexes with a journal row and its owner's reservation, then,
//! when it ended, the row updated out of those indexes again and the
//! reservation released. Held back here until its settlement (or expiry)
//! comes, the open goes into that batch, and the batch writes the hold once,
//! closed ([`hold_writes`](super::hold_writes)), with no reservation left
//! on its owner's row. Its checkpoints wait with it: only the last one is
//! written.
//!
//! While held back, the database does not have the open; the log does,
//! and the log keeps the open's segment until the database has it
//! ([`Log::applied`](super::log::Log::applied)), so a crash loses nothing:
//! the next start applies the segment again. Whatever reads the database
//! gets the opens first:
//! - an owner loaded in a batch has its opens written in that batch, before
//!   the load reads it;
//! - a flush (the readers of the database wait for one) writes the opens
//!   of the owner its reader reads
//!   ([`Book::caught_up_with`](crate::book::Book::caught_up_with)), or all
//!   of them for a reader of every owner
//!   ([`Book::caught_up_for`](crate::book::Book::caught_up_for));
//! - an open held for [`HOLD_BACK`], or one that would keep more than
//!   [`KEPT_SEGMENTS`](super::log::KEPT_SEGMENTS) full segments of the log,
//!   is written as it is: the log a long stream keeps, and what a restart
//!   after a crash reads and applies again, stays that small (4 MB, some
//!   25,000 records).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rialto_core::hashing::HashMap;

use super::{RecordKind, Refreshed, WriteJob, Written, complete};

/// The longest an open is held back: then it is written as it is.
pub(super) const HOLD_BACK: Duration = Duration::from_secs(30);

/// The opens held back, by their place in the log and by request.
#[derive(Default)]
pub(super) struct HeldBack {
    by_seq: BTreeMap<u64, Held>,
    by_request: HashMap<Box<str>, u64>,
}

/// One stream's open and its last checkpoint.
struct Held {
    open: WriteJob,
    checkpoint: Option<WriteJob>,
    since: Instant,
}

/// Which opens a batch must write rather than hold back.
pub(super) enum Release<'a> {
    /// Every one: the batch carries a flush for every owner (a reader of
    /// all of them waits), or the writer stops.
    All,
    /// Those of these owners, loaded in the batch or read by its flushes;
    /// those up to `through` in the log (their segments are the oldest the
    /// log keeps); those held for [`HOLD_BACK`] by `now`.
    Due {
        owners: &'a HashSet<&'a str>,
        through: u64,
        now: Instant,
    },
}

impl HeldBack {
    /// The batch's records to write now, in the log's order: the opens
    /// released (with their checkpoints), then `writes` less the opens and
    /// checkpoints held back from them.
    pub(super) fn plan(&mut self, writes: Vec<WriteJob>, release: Release<'_>) -> Vec<WriteJob> {
        let mut released = Vec::new();
        let all = matches!(release, Release::All);
        let no_owners = HashSet::new();
        let (loaded, through, now) = match release {
            Release::All => {
                self.by_request.clear();
                released.extend(std::mem::take(&mut self.by_seq).into_values());
                (&no_owners, 0, Instant::now())
            }
            Release::Due {
                owners,
                through,
                now,
            } => (owners, through, now),
        };
        for job in &writes {
            // A stream that ends here, or a record of it someone waits for.
            let record = &job.record;
            if matches!(record.kind, RecordKind::Settle | RecordKind::Expire) || job.done.is_some()
            {
                released.extend(self.take_request(&record.request_id));
            }
        }
        if !loaded.is_empty() {
            let seqs: Vec<u64> = self
                .by_seq
                .iter()
                .filter(|(_, held)| loaded.contains(&*held.open.record.owner.name))
                .map(|(&seq, _)| seq)
                .collect();
            released.extend(seqs.into_iter().filter_map(|seq| self.take(seq)));
        }
        while let Some((&seq, held)) = self.by_seq.first_key_value()
            && (seq <= through || now.saturating_duration_since(held.since) >= HOLD_BACK)
        {
            released.extend(self.take(seq));
        }
        let holds = self.holds(&writes, all, loaded);
        let mut later = Vec::with_capacity(writes.len());
        let mut superseded = Vec::new();
        for (job, hold) in writes.into_iter().zip(holds) {
            if hold {
                let seq = job.record.log_seq;
                self.by_request.insert(job.record.request_id.clone(), seq);
                let held = Held {
                    open: job,
                    checkpoint: None,
                    since: now,
                };
                self.by_seq.insert(seq, held);
            } else if let Some(held) = self.held_mut(&job) {
                superseded.extend(held.checkpoint.replace(job));
            } else {
                later.push(job);
            }
        }
        // A checkpoint a later one replaced before either reached the
        // database is done: the later one writes what it would have.
        let done = vec![Written::Applied; superseded.len()];
        complete(superseded, &done, &Refreshed::default());
        released.sort_unstable_by_key(|held| held.open.record.log_seq);
        let mut now_jobs = Vec::with_capacity(later.len() + 2 * released.len());
        for held in released {
            now_jobs.push(held.open);
            now_jobs.extend(held.checkpoint);
        }
        now_jobs.extend(later);
        now_jobs
    }

    /// Every record up to this one is in the database once the batch just
    /// planned is: all but the held-back opens (up to `seen`, the last
    /// record the writer was given).
    pub(super) fn written_through(&self, seen: u64) -> u64 {
        self.by_seq
            .first_key_value()
            .map_or(seen, |(&oldest, _)| oldest.saturating_sub(1).min(seen))
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_seq.is_empty()
    }

    /// Which of `writes` are opens to hold back: a durable (stream) hold
    /// logged, whose stream does not end in this batch, nobody waiting for
    /// it or for a later record of it in the batch (that record would
    /// otherwise reach the database before it), and whose owner is not
    /// loaded in the batch.
    fn holds(&self, writes: &[WriteJob], all: bool, loaded: &HashSet<&str>) -> Vec<bool> {
        let written_now: HashSet<&str> = writes
            .iter()
            .filter(|job| {
                matches!(job.record.kind, RecordKind::Settle | RecordKind::Expire)
                    || job.done.is_some()
            })
            .map(|job| &*job.record.request_id)
            .collect();
        writes
            .iter()
            .map(|job| {
                let record = &job.record;
                !all && record.kind == RecordKind::Open
                    && record.durable
                    && record.log_seq > 0
                    && !written_now.contains(&*record.request_id)
                    && !loaded.contains(&*record.owner.name)
            })
            .collect()
    }

    /// The held-back open `job` checkpoints, if `job` is a checkpoint
    /// nobody waits for.
    fn held_mut(&mut self, job: &WriteJob) -> Option<&mut Held> {
        if job.record.kind != RecordKind::Checkpoint || job.done.is_some() {
            return None;
        }
        let seq = self.by_request.get(&*job.record.request_id)?;
        self.by_seq.get_mut(seq)
    }

    fn take_request(&mut self, request_id: &str) -> Option<Held> {
        let seq = self.by_request.remove(request_id)?;
        self.by_seq.remove(&seq)
    }

    fn take(&mut self, seq: u64) -> Option<Held> {
        let held = self.by_seq.remove(&seq)?;
        self.by_request.remove(&*held.open.record.request_id);
        Some(held)
    }
}

/// The names of the owners a batch loads, for [`Release::Due`].
pub(super) fn owner_names<T>(loads: &[(Arc<str>, T)]) -> HashSet<&str> {
    loads.iter().map(|(owner, _)| &**owner).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::book::{OpenHold, Owner};
    use crate::writer::Record;
    use crate::writer::tests::{settle_order, stream_hold};

    /// Records of streams, logged in the order made: `seq` numbers them.
    struct Streams {
        seq: u64,
        hold: OpenHold,
    }

    impl Streams {
        fn new() -> Self {
            Self {
                seq: 0,
                hold: stream_hold(),
            }
        }

        fn logged(&mut self, mut record: Record) -> WriteJob {
            self.seq += 1;
            record.log_seq = self.seq;
            WriteJob { record, done: None }
        }

        fn open(&mut self, owner: &str, request_id: &str) -> WriteJob {
            let owner = Arc::new(Owner::detached(owner));
            let record = Record::open(owner, 1, request_id, &self.hold);
            self.logged(record)
        }

        fn checkpoint(&mut self, owner: &str, request_id: &str, nanos: i64) -> WriteJob {
            self.hold.checkpoint = nanos;
            let owner = Arc::new(Owner::detached(owner));
            let record = Record::checkpoint(owner, 1, request_id, &self.hold);
            self.logged(record)
        }

        fn settle(&mut self, owner: &str, request_id: &str) -> WriteJob {
            let order = settle_order(request_id);
            let owner = Arc::new(Owner::detached(owner));
            let kind = RecordKind::Settle;
            let record = Record::close(owner, 1, kind, &order, [12, 0, 0], Some(&self.hold));
            self.logged(record)
        }
    }

    /// What a planned batch writes: (request, kind, checkpoint) in order.
    fn written(jobs: &[WriteJob]) -> Vec<(String, RecordKind, i64)> {
        jobs.iter()
            .map(|job| {
                let record = &job.record;
                (
                    record.request_id.to_string(),
                    record.kind,
                    record.checkpoint,
                )
            })
            .collect()
    }

    /// Nothing due but what `at` makes due.
    fn due<'a>(owners: &'a HashSet<&'a str>, through: u64, at: Instant) -> Release<'a> {
        Release::Due {
            owners,
            through,
            now: at,
        }
    }

    #[test]
    fn an_open_waits_for_its_stream_to_end_with_its_last_checkpoint() {
        let (mut streams, mut held, at) = (Streams::new(), HeldBack::default(), Instant::now());
        let none = HashSet::new();
        let first = vec![
            streams.open("account:a", "s"),
            streams.open("account:a", "t"),
        ];
        assert!(held.plan(first, due(&none, 0, at)).is_empty());
        assert_eq!(held.written_through(2), 0);
        let second = vec![
            streams.checkpoint("account:a", "s", 5),
            streams.checkpoint("account:a", "s", 9),
        ];
        assert!(held.plan(second, due(&none, 0, at)).is_empty());
        let third = vec![streams.settle("account:a", "s")];
        let planned = held.plan(third, due(&none, 0, at));
        assert_eq!(
            written(&planned),
            [
                ("s".into(), RecordKind::Open, 0),
                ("s".into(), RecordKind::Checkpoint, 9),
                ("s".into(), RecordKind::Settle, 0),
            ]
        );
        // "t" (log record 2) is still held back: only record 1 is written.
        assert_eq!(held.written_through(6), 1);
        let planned = held.plan(vec![], due(&none, 0, at + HOLD_BACK));
        assert_eq!(written(&planned), [("t".into(), RecordKind::Open, 0)]);
        // An open in one of the oldest segments the log keeps.
        let opens = vec![
            streams.open("account:a", "u"),
            streams.open("account:a", "v"),
        ];
        assert!(held.plan(opens, due(&none, 0, at)).is_empty());
        let planned = held.plan(vec![], due(&none, 6, at));
        assert_eq!(written(&planned), [("u".into(), RecordKind::Open, 0)]);
        assert_eq!(held.written_through(8), 6);
        held.plan(vec![], Release::All);
        assert!(held.is_empty());
        assert_eq!(held.written_through(6), 6);
    }

    #[test]
    fn a_load_writes_its_owners_opens_and_a_flush_writes_all() {
        let (mut streams, mut held, at) = (Streams::new(), HeldBack::default(), Instant::now());
        let none = HashSet::new();
        let opens = vec![
            streams.open("account:a", "a1"),
            streams.open("account:b", "b1"),
            streams.open("account:a", "a2"),
        ];
        assert!(held.plan(opens, due(&none, 0, at)).is_empty());
        let loaded = held.plan(vec![], due(&HashSet::from(["account:a"]), 0, at));
        assert_eq!(
            written(&loaded),
            [
                ("a1".into(), RecordKind::Open, 0),
                ("a2".into(), RecordKind::Open, 0)
            ]
        );
        // An owner loaded in the batch that opens its stream: written now.
        let open = vec![streams.open("account:c", "c1")];
        assert_eq!(
            held.plan(open, due(&HashSet::from(["account:c"]), 0, at))
                .len(),
            1
        );
        let flushed = held.plan(vec![streams.open("account:a", "a3")], Release::All);
        assert_eq!(
            written(&flushed),
            [
                ("b1".into(), RecordKind::Open, 0),
                ("a3".into(), RecordKind::Open, 0)
            ]
        );
        assert!(held.is_empty());
    }

    #[test]
    fn opens_that_must_be_written_now_are() {
        let (mut streams, mut held, at) = (Streams::new(), HeldBack::default(), Instant::now());
        let none = HashSet::new();
        // Ends in the batch that opened it: the batch writes it once.
        let short = vec![
            streams.open("account:a", "s"),
            streams.settle("account:a", "s"),
        ];
        assert_eq!(held.plan(short, due(&none, 0, at)).len(), 2);
        // Someone waits for it (the writer was far behind).
        let mut waited = streams.open("account:a", "w");
        let (done, _answer) = tokio::sync::oneshot::channel();
        waited.done = Some(done);
        assert_eq!(held.plan(vec![waited], due(&none, 0, at)).len(), 1);
        // Someone waits for a later record of it in the same batch.
        let open = streams.open("account:a", "x");
        let mut checkpoint = streams.checkpoint("account:a", "x", 7);
        let (done, _answer) = tokio::sync::oneshot::channel();
        checkpoint.done = Some(done);
        let planned = held.plan(vec![open, checkpoint], due(&none, 0, at));
        assert_eq!(
            written(&planned),
            [
                ("x".into(), RecordKind::Open, 0),
                ("x".into(), RecordKind::Checkpoint, 7)
            ]
        );
        // Not in the log (a process without it): only the database has it.
        let mut unlogged = streams.open("account:a", "u");
        unlogged.record.log_seq = 0;
        assert_eq!(held.plan(vec![unlogged], due(&none, 0, at)).len(), 1);
        assert!(held.is_empty());
    }
}
