//! fork: a child inherits the mapping but not the record lock, and every
//! lock another thread of the parent held at the fork stays held forever.
//!
//! A child of a process that used CUDA cannot use it (the driver answers
//! CUDA_ERROR_NOT_INITIALIZED to every call there), so the shim passes
//! every call straight through until the child execs. A child of a process
//! that never reached the driver (a launcher that forks its CUDA workers)
//! starts clean and claims a slot of its own.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

const UNREGISTERED: u8 = 0;
const REGISTERING: u8 = 1;
const REGISTERED: u8 = 2;
static HANDLER: AtomicU8 = AtomicU8::new(UNREGISTERED);

/// Set once a thread is about to take any of the shim's CUDA-side locks.
static ENGAGED: AtomicBool = AtomicBool::new(false);
/// Set in a child that must not touch the shim's state.
static PASS_THROUGH: AtomicBool = AtomicBool::new(false);

extern "C" fn in_child() {
    if ENGAGED.load(Ordering::Relaxed) || crate::ops::opening() {
        PASS_THROUGH.store(true, Ordering::Relaxed);
    }
    crate::ops::forget_after_fork();
}

/// Registers the fork handler before the shim first touches its state.
/// Lock-free, so no fork can catch a thread holding a lock of this.
pub fn watch() {
    if HANDLER.load(Ordering::Acquire) == REGISTERED {
        return;
    }
    match HANDLER.compare_exchange(
        UNREGISTERED,
        REGISTERING,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => {
            // SAFETY: registers a child handler that only stores to atomics,
            // which is async-signal-safe as a fork child handler must be.
            unsafe {
                libc::pthread_atfork(None, None, Some(in_child));
            }
            HANDLER.store(REGISTERED, Ordering::Release);
        }
        // Another thread is registering it: a few instructions away.
        Err(_) => {
            while HANDLER.load(Ordering::Acquire) != REGISTERED {
                std::hint::spin_loop();
            }
        }
    }
}

/// Called on every path into the CUDA-side state, before any lock.
pub fn engage() {
    if !ENGAGED.load(Ordering::Relaxed) {
        ENGAGED.store(true, Ordering::Relaxed);
    }
}

/// Whether this process is a child that must leave the shim's state alone.
pub fn passing_through() -> bool {
    PASS_THROUGH.load(Ordering::Relaxed)
}
