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
//! of its own ([`DriverPolled`]), armed while watches wait. That is an
//! implementation detail Tokio's docs do not promise (actix's workers are
//! current-thread runtimes); a Tokio that woke a yield at once would give
//! the turns out at once, which is how the queue behaves outside a
//! runtime too, and nearly so on a multi-thread runtime (whose worker may
//! wake what it kept without having polled the driver): the order is
//! lost, nothing else.
//!
//! Only the order changes: no socket is read or written more than before;
//! a watch is polled once more a wake, and the driver once more for every
//! few chunks.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
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
    /// A [`DriverPolled`] waker is with the runtime.
    armed: bool,
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
    /// The watch's waker while it waits (a mutex because a waker handed
    /// to the queue must be `Send`; only the worker's thread takes it).
    waker: Mutex<Option<Waker>>,
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
                let mut waker = lock(&self.place.waker);
                if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            _ => {
                *lock(&self.place.waker) = Some(cx.waker().clone());
                self.place.state.store(WAITING, Ordering::Relaxed);
                let arm = QUEUE.with_borrow_mut(|queue| {
                    queue.waiting.push_back(Arc::downgrade(&self.place));
                    !std::mem::replace(&mut queue.armed, true)
                });
                if arm {
                    arm_driver_polled();
                }
                Poll::Pending
            }
        }
    }
}

fn lock(waker: &Mutex<Option<Waker>>) -> std::sync::MutexGuard<'_, Option<Waker>> {
    waker
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The queue's waker with the runtime: woken once its driver was polled,
/// on the thread that yielded (whose queue it gives turns from).
struct DriverPolled;

impl Wake for DriverPolled {
    fn wake(self: Arc<Self>) {
        give_turns();
    }
}

/// Hands the runtime the queue's [`DriverPolled`] waker (the queue's
/// `armed` already set). Never called while the runtime wakes what it
/// kept (a `yield_now` then would find its list borrowed): only from a
/// watch's poll.
fn arm_driver_polled() {
    static WAKER: LazyLock<Waker> = LazyLock::new(|| Waker::from(Arc::new(DriverPolled)));
    let yielding = std::pin::pin!(tokio::task::yield_now());
    let _ = std::future::Future::poll(yielding, &mut Context::from_waker(&WAKER));
}

/// The driver was polled: the first [`TURNS_PER_POLL`] watches still
/// waiting get their turn. The runtime's own wakes stay first (those of
/// the driver's poll were queued before this one). Watches still waiting
/// after are given theirs after the next poll: the first to go on arms
/// the queue again.
fn give_turns() {
    #[cfg(test)]
    GIVINGS.set(GIVINGS.get() + 1);
    let given = QUEUE.with_borrow_mut(|queue| {
        queue.armed = false;
        let mut given = Vec::with_capacity(TURNS_PER_POLL);
        while given.len() < TURNS_PER_POLL {
            let Some(place) = queue.waiting.pop_front() else {
                break;
            };
            // A watch that ended while it waited holds no place.
            if let Some(place) = place.upgrade() {
                given.push(place);
            }
        }
        given
    });
    for place in given {
        place.state.store(GIVEN, Ordering::Relaxed);
        if let Some(waker) = lock(&place.waker).take() {
            waker.wake();
        }
    }
}

/// Arms the queue if watches wait and it is not armed.
fn rearm() {
    let arm = QUEUE.with_borrow_mut(|queue| {
        !queue.waiting.is_empty() && !std::mem::replace(&mut queue.armed, true)
    });
    if arm {
        arm_driver_polled();
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
        let mut cx = Context::from_waker(Waker::noop());
        // Marked armed, the queue hands no waker to a runtime (outside one,
        // a yield is woken at once): the turn is given by hand below.
        QUEUE.with_borrow_mut(|queue| queue.armed = true);
        let mut turn = Turn::default();
        assert!(turn.poll(&mut cx).is_pending(), "asked");
        assert!(
            turn.poll(&mut cx).is_pending(),
            "woken again: still waiting"
        );
        give_turns();
        assert!(turn.poll(&mut cx).is_ready(), "its turn");
        assert!(turn.poll(&mut cx).is_pending(), "woken after: asks again");
        give_turns();
        assert!(turn.poll(&mut cx).is_ready());
    }
}
