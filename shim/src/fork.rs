//! fork: a child inherits the mapping but not the record lock, so it must
//! not keep charging its parent's slot.

use std::sync::Once;

static REGISTERED: Once = Once::new();

extern "C" fn in_child() {
    crate::ops::forget_after_fork();
}

/// Registers the fork handler (once, on the first slot claim, not at load).
pub fn watch() {
    REGISTERED.call_once(|| {
        // SAFETY: registers a child handler that only stores to atomics,
        // which is async-signal-safe as a fork child handler must be.
        unsafe {
            libc::pthread_atfork(None, None, Some(in_child));
        }
    });
}
