//! A value made once on each thread that asks for it.
//!
//! A client whose connections are tasks (a `reqwest::Client`'s pool, a
//! tonic `Channel`) drives them on the runtime it was made on. actix-web
//! runs each HTTP worker on a single-threaded runtime of its own, so a
//! request on one worker that calls through a client made on another
//! runtime waits for two cross-thread wake-ups: the other thread writes the
//! request and reads the answer. Where a few cores are shared by several
//! processes (the split topology on one machine, a pod with a CPU limit of
//! one), each is a sleeping thread woken and a context switch. Made on the
//! calling thread, the client's connections are tasks of that thread's
//! runtime and the call stays there.
//!
//! A thread's values are dropped when the thread ends, and the calling
//! thread's when the [`PerThread`] is. A thread must not outlive the
//! runtime it first asked on (actix's workers and Tokio's worker threads do
//! not).

use std::any::Any;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

/// One `T` per thread, each made by the same function on first use.
pub struct PerThread<T> {
    /// Tells this one's values from others' in a thread's list.
    id: u64,
    make: Box<dyn Fn() -> T + Send + Sync>,
}

/// Gives each [`PerThread`] its id.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's values, by [`PerThread::id`]: a handful per process
    /// (a client per remote service, one per router), so a list.
    static MADE: RefCell<Vec<(u64, Box<dyn Any>)>> = const { RefCell::new(Vec::new()) };
}

impl<T: Clone + 'static> PerThread<T> {
    /// `make` runs on each thread the first time it asks: it must not block.
    pub fn new(make: impl Fn() -> T + Send + Sync + 'static) -> Self {
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            make: Box::new(make),
        }
    }

    /// This thread's value, made now if it has none.
    pub fn get(&self) -> T {
        let mine = MADE.with_borrow(|made| {
            made.iter()
                .find(|(id, _)| *id == self.id)
                .and_then(|(_, value)| value.downcast_ref::<T>())
                .cloned()
        });
        if let Some(value) = mine {
            return value;
        }
        // Made outside the borrow: `make` may itself ask a `PerThread`.
        let value = (self.make)();
        MADE.with_borrow_mut(|made| made.push((self.id, Box::new(value.clone()))));
        value
    }
}

impl<T: Clone + Send + Sync + 'static> From<T> for PerThread<T> {
    /// One value for every thread: each keeps a clone of it (for a client
    /// that is already shared, such as a channel made elsewhere).
    fn from(value: T) -> Self {
        Self::new(move || value.clone())
    }
}

impl<T> Drop for PerThread<T> {
    fn drop(&mut self) {
        // This thread's value; other threads' go when they end.
        let _ = MADE.try_with(|made| {
            if let Ok(mut made) = made.try_borrow_mut() {
                made.retain(|(id, _)| *id != self.id);
            }
        });
    }
}

impl<T> std::fmt::Debug for PerThread<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerThread").field("id", &self.id).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    fn values_here() -> usize {
        MADE.with_borrow(|made| made.len())
    }

    #[test]
    fn each_thread_makes_its_value_once_and_each_per_thread_its_own() {
        let count = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&count);
        let numbers = Arc::new(PerThread::new(move || {
            counter.fetch_add(1, Ordering::Relaxed) + 100
        }));
        let before = values_here();
        assert_eq!(numbers.get(), 100);
        assert_eq!(numbers.get(), 100, "the same thread's value again");
        assert_eq!(values_here(), before + 1);
        let elsewhere = {
            let numbers = Arc::clone(&numbers);
            std::thread::spawn(move || (numbers.get(), numbers.get()))
                .join()
                .expect("the other thread")
        };
        assert_eq!(elsewhere, (101, 101), "another thread makes its own");
        assert_eq!(numbers.get(), 100);
        let words = PerThread::new(|| String::from("mine"));
        assert_eq!(words.get(), "mine");
        assert_eq!(values_here(), before + 2);
        drop(words);
        assert_eq!(values_here(), before + 1, "dropped with its owner");
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_value_may_be_made_from_another_per_thread_value() {
        let inner = Arc::new(PerThread::new(|| 7));
        let of_inner = Arc::clone(&inner);
        let outer = PerThread::new(move || of_inner.get() * 6);
        assert_eq!(outer.get(), 42);
        assert_eq!(inner.get(), 7);
        let shared = PerThread::from(String::from("same"));
        assert_eq!(shared.get(), "same");
    }
}
