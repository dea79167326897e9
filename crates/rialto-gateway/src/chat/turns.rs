//! A worker's stream reads, a few between two of its looks at its sockets.
//!
//! A backend's tokens come in bursts (a batch of sequences decoded at
//! once), so many streams' chunks become readable on a worker together.
//! Read and relayed in the order they were found, a burst is one long run
//! of reads and writes, and whatever became readable meanwhile waits for
//! the run to end: a new stream's request, a backend's first chunk, both
//! waited on by actix's dispatchers. On the 512-stream bench that wait,
//! twice over (the request, then the first chunk), was most of what
//! Rialto added to a first token.
//!
//! So a stream's watch, woken with something to read, takes a [`Turn`]
//! first. It waits for its worker's next look at its sockets (Tokio wakes
//! a task that yielded only after its I/O driver was polled), so that what
//! was found readable meanwhile is served first; then at most
//! [`READS_PER_LOOK`] watches read before the worker looks again, the rest
//! waiting for a later look in the order they came. A new stream waits
//! behind a few streams' chunks, not behind a burst's, and no watch waits
//! for more than its place in the queue.
//!
//! Only the order changes: nothing is read or written more than before.
//! The order relies on how Tokio schedules a yield (an implementation
//! detail its docs do not promise); a Tokio that wakes a yield at once
//! would make a turn a no-op, not a fault, and the 512-stream row of
//! `make bench` would show it.

use std::cell::Cell;
use std::task::{Context, Poll};

/// Watches that read between two looks of a worker at its sockets. One
/// costs CPU (a look, an `epoll_wait`, for every chunk); a whole burst is
/// what turns avoid; 4 measured best between them (bench/NOTES.md,
/// session 73).
pub(super) const READS_PER_LOOK: u32 = 4;

/// The worker's looks as its watches see them: `epoch` counts the looks
/// after which a watch was woken, `reads` the watches that read since the
/// last.
#[derive(Clone, Copy)]
struct Looks {
    epoch: u64,
    reads: u32,
}

thread_local! {
    /// One per thread, so one per actix worker (each runs its own
    /// runtime): a worker's watches share its looks.
    static LOOKS: Cell<Looks> = const { Cell::new(Looks { epoch: 0, reads: 0 }) };
}

/// One watch's place in its worker's turns.
#[derive(Default)]
pub(super) struct Turn {
    /// The epoch the watch asked to wait for the next look in, while it
    /// waits.
    waiting_in: Option<u64>,
}

impl Turn {
    /// Ready when the watch may read now. Otherwise the watch has asked to
    /// be woken after the worker's next look, and `Pending`.
    pub(super) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut looks = LOOKS.get();
        if let Some(epoch) = self.waiting_in {
            // The first watch woken after a look starts its epoch: every
            // watch that waited in the one before is woken by that look.
            if epoch == looks.epoch {
                looks = Looks {
                    epoch: epoch + 1,
                    reads: 0,
                };
            }
            if looks.reads < READS_PER_LOOK {
                looks.reads += 1;
                LOOKS.set(looks);
                self.waiting_in = None;
                return Poll::Ready(());
            }
            LOOKS.set(looks);
        }
        self.waiting_in = Some(looks.epoch);
        // Tokio's yield: the waker is kept until the driver has been
        // polled (woken at once outside a runtime).
        let yielding = std::pin::pin!(tokio::task::yield_now());
        let _ = std::future::Future::poll(yielding, cx);
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ten watches woken together: none reads before a look, then at most
    /// four a look, in the order they came, and every one reads.
    #[test]
    fn a_burst_reads_a_few_a_look_in_order_and_all_of_it() {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut turns: Vec<Turn> = (0..10).map(|_| Turn::default()).collect();
        for turn in &mut turns {
            assert!(turn.poll(&mut cx).is_pending(), "read before a look");
        }
        let mut waiting: Vec<usize> = (0..10).collect();
        let mut read = Vec::new();
        let mut looks = 0;
        while !waiting.is_empty() && looks < 10 {
            looks += 1;
            // The worker looks, then wakes the waiting watches in order.
            waiting.retain(|&watch| {
                let ready = turns[watch].poll(&mut cx).is_ready();
                if ready {
                    read.push((looks, watch));
                }
                !ready
            });
        }
        let firsts = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3];
        assert_eq!(
            read,
            firsts.into_iter().zip(0..10).collect::<Vec<_>>(),
            "four a look, in order"
        );
    }

    /// A watch woken again after it read (its next chunk) waits behind
    /// those still waiting from before.
    #[test]
    fn a_watch_that_read_waits_behind_those_before_it() {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut turns: Vec<Turn> = (0..6).map(|_| Turn::default()).collect();
        for turn in &mut turns {
            assert!(turn.poll(&mut cx).is_pending());
        }
        // The first look: 0-3 read, 4 and 5 wait again.
        let first: Vec<bool> = turns
            .iter_mut()
            .map(|t| t.poll(&mut cx).is_ready())
            .collect();
        assert_eq!(first, [true, true, true, true, false, false]);
        // 0 has its next chunk before the second look: it asks behind 4, 5.
        assert!(turns[0].poll(&mut cx).is_pending());
        // The second look wakes 4, 5, then 0.
        assert!(turns[4].poll(&mut cx).is_ready());
        assert!(turns[5].poll(&mut cx).is_ready());
        assert!(turns[0].poll(&mut cx).is_ready());
    }
}
