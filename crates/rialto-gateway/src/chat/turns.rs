//! A worker's stream reads, a few after each poll of its I/O driver.
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
//! So a stream's watch, woken with something to do, takes a [`Turn`]
//! first: it joins its worker's queue of waiting watches and is woken
//! again when its turn comes. Turns are given out after the worker's I/O
//! driver was polled, [`TURNS_PER_POLL`] at a time from the front of the
//! queue: the requests and first chunks found readable by that poll are
//! queued before the watches given a turn, and a new stream waits behind a
//! few streams' chunks, not behind a burst's. No watch waits for more
//! than its place in the queue.
//!
//! How the worker learns that its driver was polled: a current-thread
//! Tokio runtime keeps the waker of a task that yields
//! ([`tokio::task::yield_now`]) until it has polled its I/O driver, and
//! wakes it then, before running any task. The queue yields with a waker
//! of its own ([`DriverPolled`]) while watches wait in it. That is an
//! implementation detail Tokio's docs do not promise; a Tokio that woke a
//! yield at once would give the turns out at once: the order would be
//! lost, nothing else. Turns are given on a current-thread runtime only
//! (actix's workers are): elsewhere a watch goes on at once.
//!
//! Only the order changes: no socket is read or written more than before;
//! a watch is polled once more a wake, and the driver once more for every
//! few chunks.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};

use futures_util::task::AtomicWaker;
use std::task::{Context, Poll, Wake, Waker};

/// Watches given a turn after each poll of the driver. One costs CPU (a
/// poll of the driver, an `epoll_wait`, for every chunk); a whole burst is
/// what turns avoid; 4 read best between them (bench/NOTES.md, session
/// 73).
pub(super) const TURNS_PER_POLL: usize = 4;

/// One worker's queue of watches waiting for a turn.
#[derive(Default)]
struct Queue {
    /// In the order they asked; a watch that ended while waiting is left
    /// here and skipped.
    waiting: VecDeque<Weak<Place>>,
    /// The [`DriverPolled`] waker with the runtime, if any: armed while it
    /// lives. The runtime drops what it kept when its `block_on` ends, so
    /// a flag could outlive the waker and leave the queue armed for good.
    armed: Weak<DriverPolled>,
}

impl Queue {
    fn armed(&self) -> bool {
        self.armed.strong_count() > 0
    }
}

thread_local! {
    /// One per thread, so one per actix worker (each runs its own
    /// runtime).
    static QUEUE: RefCell<Queue> = RefCell::default();
}

#[cfg(test)]
thread_local! {
    /// The times turns were given out, for the tests.
    static GIVINGS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// A watch's place, shared with its worker's queue.
#[derive(Default)]
struct Place {
    /// [`IDLE`], [`WAITING`] or [`GIVEN`]; atomic to be `Sync`, read and
    /// written by the worker's thread only.
    state: AtomicU8,
    /// The watch's waker while it waits.
    waker: AtomicWaker,
}

/// [`Place::state`]: not in the queue.
const IDLE: u8 = 0;
/// In the queue, its turn not yet come.
const WAITING: u8 = 1;
/// Its turn came: it goes on the next time it is polled.
const GIVEN: u8 = 2;

/// One watch's turns.
#[derive(Default)]
pub(super) struct Turn {
    place: Arc<Place>,
}

impl Turn {
    /// Ready when the watch's turn has come; otherwise the watch waits in
    /// its worker's queue (a wake from anything else, a timer or its
    /// socket, keeps its place).
    pub(super) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self.place.state.load(Ordering::Relaxed) {
            GIVEN => {
                self.place.state.store(IDLE, Ordering::Relaxed);
                // The first to go on arms the queue for those still waiting.
                rearm();
                Poll::Ready(())
            }
            WAITING => {
                self.place.waker.register(cx.waker());
                // Whatever left the queue unarmed, a wake of a watch in it
                // arms it again.
                rearm();
                Poll::Pending
            }
            _ if !on_a_current_thread_runtime() => Poll::Ready(()),
            _ => {
                self.place.waker.register(cx.waker());
                self.place.state.store(WAITING, Ordering::Relaxed);
                QUEUE.with_borrow_mut(|queue| {
                    queue.waiting.push_back(Arc::downgrade(&self.place));
                });
                rearm();
                Poll::Pending
            }
        }
    }
}

/// Turns are given on a current-thread runtime only: on a multi-thread
/// one, a watch given its turn may run on another worker than the queue
/// it left, whose watches would be left with no one to arm it again; the
/// watch goes on at once there (and outside a runtime).
fn on_a_current_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current().is_ok_and(|runtime| {
        runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread
    })
}

/// The queue's waker with the runtime: woken once its driver was polled,
/// on the thread that yielded (whose queue it gives turns from). One a
/// time it is armed, so that the queue knows whether the runtime still
/// holds it.
struct DriverPolled;

impl Wake for DriverPolled {
    fn wake(self: Arc<Self>) {
        give_turns();
    }
}

/// Arms the queue if watches wait in it and it is not armed: hands the
/// runtime a [`DriverPolled`] waker as a yield's. Only from a watch's poll
/// or drop, never while the runtime wakes what it kept (a yield then would
/// find its list borrowed): so never from [`give_turns`].
fn rearm() {
    // At a thread's end the queue may be gone before a watch's drop.
    let Ok(Some(armed)) = QUEUE.try_with(|queue| {
        let mut queue = queue.borrow_mut();
        if queue.waiting.is_empty() || queue.armed() {
            return None;
        }
        let armed = Arc::new(DriverPolled);
        queue.armed = Arc::downgrade(&armed);
        Some(armed)
    }) else {
        return;
    };
    // Outside a runtime the yield wakes it at once: the turns are given
    // now (the queue's borrow is released above).
    let waker = Waker::from(armed);
    let yielding = std::pin::pin!(tokio::task::yield_now());
    let _ = std::future::Future::poll(yielding, &mut Context::from_waker(&waker));
}

/// The driver was polled: the first [`TURNS_PER_POLL`] watches still
/// waiting get their turn. The runtime's own wakes stay first (those of
/// the driver's poll were queued before this one). Watches still waiting
/// after are given theirs after the next poll: the first to go on arms
/// the queue again.
fn give_turns() {
    #[cfg(test)]
    GIVINGS.set(GIVINGS.get() + 1);
    // Taken out of the queue, then woken once its borrow is released.
    let mut given: [Option<Arc<Place>>; TURNS_PER_POLL] = Default::default();
    QUEUE.with_borrow_mut(|queue| {
        queue.armed = Weak::new();
        // A watch that ended while it waited holds no place.
        let living =
            std::iter::from_fn(|| queue.waiting.pop_front()).filter_map(|place| place.upgrade());
        for (slot, place) in given.iter_mut().zip(living) {
            *slot = Some(place);
        }
    });
    for place in given.into_iter().flatten() {
        place.state.store(GIVEN, Ordering::Relaxed);
        place.waker.wake();
    }
}

impl Drop for Turn {
    /// A watch that ends after its turn was given, before it went on, would
    /// leave the watches after it unarmed: it arms the queue instead.
    fn drop(&mut self) {
        if self.place.state.load(Ordering::Relaxed) == GIVEN {
            rearm();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    async fn take_turn(turn: &mut Turn) {
        std::future::poll_fn(|cx| turn.poll(cx)).await
    }

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    }

    /// Ten watches asking at once: they go on in the order they asked, at
    /// most four a poll of the driver, and every one goes on.
    #[test]
    fn a_burst_goes_on_a_few_a_poll_in_order_and_all_of_it() {
        let runtime = current_thread();
        let local = tokio::task::LocalSet::new();
        let went_on = Rc::new(std::cell::RefCell::new(Vec::new()));
        local.block_on(&runtime, async {
            let watches: Vec<_> = (0..10)
                .map(|watch| {
                    let went_on = Rc::clone(&went_on);
                    tokio::task::spawn_local(async move {
                        let mut turn = Turn::default();
                        take_turn(&mut turn).await;
                        went_on.borrow_mut().push((watch, GIVINGS.get()));
                    })
                })
                .collect();
            let all = futures_util::future::join_all(watches);
            tokio::time::timeout(std::time::Duration::from_secs(5), all)
                .await
                .expect("every watch went on");
        });
        let went_on = went_on.borrow();
        let order: Vec<usize> = went_on.iter().map(|&(watch, _)| watch).collect();
        assert_eq!(
            order,
            (0..10).collect::<Vec<_>>(),
            "in the order they asked"
        );
        let mut per_poll = std::collections::BTreeMap::new();
        for &(_, giving) in went_on.iter() {
            *per_poll.entry(giving).or_insert(0) += 1;
        }
        assert!(
            per_poll.values().all(|&n| n <= TURNS_PER_POLL),
            "at most {TURNS_PER_POLL} a poll: {per_poll:?}"
        );
        assert!(
            per_poll.len() >= 3,
            "ten over three polls at least: {per_poll:?}"
        );
    }

    /// Watches that end while they wait give up their places: the one after
    /// them still goes on.
    #[test]
    fn watches_that_ended_waiting_leave_no_one_stuck() {
        let runtime = current_thread();
        let local = tokio::task::LocalSet::new();
        local.block_on(&runtime, async {
            let ended: Vec<_> = (0..6)
                .map(|_| {
                    tokio::task::spawn_local(async {
                        let mut turn = Turn::default();
                        take_turn(&mut turn).await;
                        std::future::pending::<()>().await
                    })
                })
                .collect();
            let last = tokio::task::spawn_local(async {
                let mut turn = Turn::default();
                take_turn(&mut turn).await;
            });
            // Each is polled once and asks for its turn; then the six
            // before the last end, waiting or given theirs.
            tokio::task::yield_now().await;
            for watch in &ended {
                watch.abort();
            }
            tokio::time::timeout(std::time::Duration::from_secs(5), last)
                .await
                .expect("the last watch went on")
                .expect("it did not panic");
        });
    }

    /// A watch woken by something else while it waits (its timer, its
    /// socket) keeps its place: it does not go on before its turn.
    #[test]
    fn a_wake_while_waiting_keeps_the_place() {
        current_thread().block_on(std::future::poll_fn(|cx| {
            let mut turn = Turn::default();
            assert!(turn.poll(cx).is_pending(), "asked");
            assert!(turn.poll(cx).is_pending(), "woken again: still waiting");
            give_turns();
            assert!(turn.poll(cx).is_ready(), "its turn");
            assert!(turn.poll(cx).is_pending(), "woken after: asks again");
            Poll::Ready(())
        }));
    }

    /// A runtime's `block_on` that ends while the queue is armed drops the
    /// waker it kept: the next one on the thread arms the queue again.
    #[test]
    fn a_queue_armed_by_an_ended_block_on_is_armed_again() {
        let runtime = current_thread();
        runtime.block_on(std::future::poll_fn(|cx| {
            let mut turn = Turn::default();
            assert!(turn.poll(cx).is_pending(), "asked, then left");
            Poll::Ready(())
        }));
        runtime.block_on(async {
            let mut turn = Turn::default();
            tokio::time::timeout(std::time::Duration::from_secs(5), take_turn(&mut turn))
                .await
                .expect("the next watch went on");
        });
    }

    /// A watch left waiting in a queue whose waker the runtime dropped
    /// arms it again when anything wakes it.
    #[test]
    fn a_wake_of_a_watch_in_an_unarmed_queue_arms_it() {
        let runtime = current_thread();
        let mut turn = Turn::default();
        runtime.block_on(std::future::poll_fn(|cx| {
            assert!(turn.poll(cx).is_pending(), "asked");
            Poll::Ready(())
        }));
        runtime.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(5), take_turn(&mut turn))
                .await
                .expect("the watch went on");
        });
    }

    /// On a multi-thread runtime and outside one, a watch goes on at once.
    #[test]
    fn off_a_current_thread_runtime_a_watch_goes_on_at_once() {
        let mut turn = Turn::default();
        let mut cx = Context::from_waker(Waker::noop());
        assert!(turn.poll(&mut cx).is_ready(), "outside a runtime");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let watches: Vec<_> = (0..10)
                .map(|_| {
                    tokio::spawn(async {
                        let mut turn = Turn::default();
                        take_turn(&mut turn).await;
                    })
                })
                .collect();
            for watch in watches {
                tokio::time::timeout(std::time::Duration::from_secs(5), watch)
                    .await
                    .expect("every watch went on")
                    .expect("none panicked");
            }
        });
    }
}
