//! Log lines on their way to stdout: appended to a buffer by the thread
//! that logs, written out in batches by a thread of their own.
//!
//! `tracing-appender`'s non-blocking writer, used before, sends each line
//! through a channel and wakes its thread for it: a futex wake (an
//! inter-processor interrupt on a VM) and a context switch per request,
//! about a tenth of a worker's CPU at concurrency 1 (BENCHMARKS.md). Here a
//! line is a copy into a buffer under a mutex nobody holds for longer than
//! a copy; the writer's thread is woken only by the first line after it went
//! idle, then lets lines gather for [`GATHER`] before it takes them all and
//! writes them in one `write`. Under load nobody wakes it: it finds the next
//! batch waiting when it comes back from writing the last.
//!
//! Lossy, as before: while more than [`CAP`] bytes wait (stdout stalled by
//! its reader) a new line is dropped rather than memory grown or the
//! logging thread (an HTTP worker) blocked; drops are counted.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long lines gather after the first one before they are written.
const GATHER: Duration = Duration::from_millis(10);
/// Bytes waiting past which new lines are dropped.
const CAP: usize = 32 << 20;
/// A buffer grown past this by a burst is given back once written.
const KEEP: usize = 1 << 20;

/// The buffer the loggers append to and the writer's thread empties.
#[derive(Debug, Default)]
struct Queue {
    state: Mutex<Waiting>,
    wake: Condvar,
    dropped: AtomicU64,
}

#[derive(Debug, Default)]
struct Waiting {
    lines: Vec<u8>,
    /// The writer's thread waits for a line: the next one wakes it.
    idle: bool,
    /// [`LogWriterGuard::stop`]: write what is left and end.
    stopping: bool,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, line: &[u8]) {
        let mut waiting = self.lock();
        if waiting.lines.len() + line.len() > CAP {
            drop(waiting);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        waiting.lines.extend_from_slice(line);
        if waiting.idle {
            waiting.idle = false;
            drop(waiting);
            self.wake.notify_one();
        }
    }
}

/// Where a logging thread writes: the shared buffer. One `write` call is
/// one line (the formatter writes each event in one `write_all`).
#[derive(Clone, Debug)]
pub struct LogWriter(Arc<Queue>);

impl LogWriter {
    /// Lines dropped so far because too many waited.
    pub fn dropped_lines(&self) -> u64 {
        self.0.dropped.load(Ordering::Relaxed)
    }
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writing through a shared reference: the subscriber's writer for one
/// event borrows the process's writer rather than cloning its `Arc`.
impl Write for &LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.push(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Keeps the writer's thread: [`LogWriterGuard::stop`] (or dropping it)
/// writes out every line appended before and ends the thread.
#[derive(Debug)]
pub struct LogWriterGuard {
    queue: Arc<Queue>,
    thread: Option<JoinHandle<()>>,
}

impl LogWriterGuard {
    /// Writes out what waits and ends the writer's thread.
    pub fn stop(mut self) {
        self.finish();
    }

    fn finish(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.queue.lock().stopping = true;
        self.queue.wake.notify_one();
        let _ = thread.join();
    }
}

impl Drop for LogWriterGuard {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Starts the thread `name` that writes the lines to `sink`.
pub fn spawn<W: Write + Send + 'static>(
    sink: W,
    name: &str,
) -> std::io::Result<(LogWriter, LogWriterGuard)> {
    let queue = Arc::new(Queue::default());
    let thread = std::thread::Builder::new().name(name.to_owned()).spawn({
        let queue = queue.clone();
        move || write_out(&queue, sink)
    })?;
    Ok((
        LogWriter(queue.clone()),
        LogWriterGuard {
            queue,
            thread: Some(thread),
        },
    ))
}

/// The writer's thread: wait for a line, let more gather, write them all.
fn write_out(queue: &Queue, mut sink: impl Write) {
    let mut batch = Vec::new();
    loop {
        let mut waiting = queue.lock();
        while waiting.lines.is_empty() && !waiting.stopping {
            waiting.idle = true;
            waiting = queue.wake.wait(waiting).unwrap_or_else(|e| e.into_inner());
        }
        waiting.idle = false;
        if !waiting.stopping {
            drop(waiting);
            std::thread::sleep(GATHER);
            waiting = queue.lock();
        }
        let stopping = waiting.stopping;
        std::mem::swap(&mut waiting.lines, &mut batch);
        drop(waiting);
        // A stdout nobody reads any more (a closed pipe) loses the lines,
        // as a failed write lost them before; the process goes on.
        let _ = sink.write_all(&batch).and_then(|()| sink.flush());
        batch.clear();
        if batch.capacity() > KEEP {
            batch.shrink_to(KEEP);
        }
        if stopping && queue.lock().lines.is_empty() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// A sink that keeps every `write` call.
    #[derive(Clone, Default)]
    struct Calls(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Write for Calls {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn every_line_is_written_in_order_and_a_burst_in_few_writes() {
        let sink = Calls::default();
        let (writer, guard) = spawn(sink.clone(), "log-test").unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let mut writer = writer.clone();
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        writer
                            .write_all(format!("thread {t} line {i}\n").as_bytes())
                            .unwrap();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        guard.stop();
        let calls = sink.0.lock().unwrap();
        let text = String::from_utf8(calls.concat()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4000);
        for t in 0..4 {
            let mine: Vec<&str> = lines
                .iter()
                .copied()
                .filter(|l| l.starts_with(&format!("thread {t} ")))
                .collect();
            let expected: Vec<String> = (0..1000).map(|i| format!("thread {t} line {i}")).collect();
            assert_eq!(mine, expected, "thread {t}'s lines, in its order");
        }
        assert!(calls.len() < 100, "{} writes for 4,000 lines", calls.len());
        assert_eq!(writer.dropped_lines(), 0);
    }

    #[test]
    fn a_line_after_idle_is_written_without_another_line() {
        let sink = Calls::default();
        let (mut writer, guard) = spawn(sink.clone(), "log-test").unwrap();
        for round in 0..3 {
            writer
                .write_all(format!("line {round}\n").as_bytes())
                .unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while sink.0.lock().unwrap().len() <= round {
                assert!(
                    std::time::Instant::now() < deadline,
                    "line {round} never written"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        drop(guard);
        assert_eq!(sink.0.lock().unwrap().concat(), b"line 0\nline 1\nline 2\n");
    }

    #[test]
    fn lines_past_the_cap_are_dropped_and_counted() {
        /// A stdout whose reader stalled until told; `entered` says a
        /// write began (the first line left the buffer).
        struct Stalled(Arc<(Mutex<bool>, Condvar)>, Calls, Arc<AtomicBool>);
        impl Write for Stalled {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.2.store(true, Ordering::SeqCst);
                let (open, turn) = &*self.0;
                let mut open = open.lock().unwrap();
                while !*open {
                    open = turn.wait(open).unwrap();
                }
                self.1.write(buf)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let sink = Calls::default();
        let entered = Arc::new(AtomicBool::new(false));
        let stalled = Stalled(gate.clone(), sink.clone(), entered.clone());
        let (mut writer, guard) = spawn(stalled, "log-test").unwrap();
        // The first line is taken and its write stalls; then the buffer fills.
        writer.write_all(b"first\n").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !entered.load(Ordering::SeqCst) {
            assert!(
                std::time::Instant::now() < deadline,
                "the first line was never written"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let line = vec![b'x'; 1 << 20];
        for _ in 0..40 {
            writer.write_all(&line).unwrap();
        }
        assert_eq!(writer.dropped_lines(), 40 - (CAP >> 20) as u64);
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        guard.stop();
        let written: usize = sink.0.lock().unwrap().iter().map(Vec::len).sum();
        assert_eq!(written, 6 + CAP);
    }
}
