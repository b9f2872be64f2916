//! A child forked after `cuInit` inherits no usable CUDA state: on the real
//! driver every call there returns NOT_INITIALIZED, so here too.
//!
//! The check is one relaxed load, taken before any lock: a child forked while
//! another thread held one of the fake's locks must still get its answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

static POISONED: AtomicBool = AtomicBool::new(false);

pub(crate) fn poisoned() -> bool {
    POISONED.load(Ordering::Relaxed)
}

/// Called from `cuInit`: children forked from now on are refused.
pub(crate) fn arm() {
    static ARMED: Once = Once::new();
    // SAFETY: registers a child handler that only stores to an atomic, which is async-signal-safe
    // as a handler run in a forked child must be; `Once` registers it once.
    ARMED.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(in_child));
    });
}

extern "C" fn in_child() {
    POISONED.store(true, Ordering::Relaxed);
}
