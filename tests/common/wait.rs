//! Waiting for a state the code under test reaches on its own: one bounded
//! poll loop that fails naming what it waited for and what it last saw.

use std::fmt::Display;
use std::time::{Duration, Instant};

/// How often a wait looks again, where the state has no pace of its own.
pub const POLL: Duration = Duration::from_millis(50);

/// What one look found: the awaited value, or what was seen instead.
pub trait Seen {
    type Value;
    fn seen(self) -> Result<Self::Value, String>;
}

/// `None`: not there yet, nothing more to tell.
impl<T> Seen for Option<T> {
    type Value = T;
    fn seen(self) -> Result<T, String> {
        self.ok_or_else(|| "not yet".to_string())
    }
}

/// `Err`: what was seen instead.
impl<T, E: Display> Seen for Result<T, E> {
    type Value = T;
    fn seen(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// Calls `check` every `every` until it gives `Ok`, or until `timeout` has
/// passed; then gives the last `Err`, what was last seen. For waits whose
/// caller asserts on the last state itself.
pub async fn poll<T, E>(
    timeout: Duration,
    every: Duration,
    mut check: impl AsyncFnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = check().await;
        if last.is_ok() || Instant::now() >= deadline {
            return last;
        }
        tokio::time::sleep(every).await;
    }
}

/// Waits for `check` to find the value, looking every `every`; after
/// `timeout`, fails the test naming `what` and what was last seen.
pub async fn eventually<S: Seen>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: impl AsyncFnMut() -> S,
) -> S::Value {
    poll(timeout, every, async || check().await.seen())
        .await
        .unwrap_or_else(|last| panic!("timed out waiting for {what}: {last}"))
}

/// [`poll`] for tests without a runtime: sleeps the thread.
pub fn poll_blocking<T, E>(
    timeout: Duration,
    every: Duration,
    mut check: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = check();
        if last.is_ok() || Instant::now() >= deadline {
            return last;
        }
        std::thread::sleep(every);
    }
}

/// [`eventually`] for tests without a runtime.
pub fn eventually_blocking<S: Seen>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: impl FnMut() -> S,
) -> S::Value {
    poll_blocking(timeout, every, || check().seen())
        .unwrap_or_else(|last| panic!("timed out waiting for {what}: {last}"))
}
