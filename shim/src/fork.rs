//! fork: a child inherits the mapping but not the record lock, and every
//! lock another thread of the parent held at the fork stays held forever.
//!
//! A child of a process that used CUDA cannot use it (the driver answers
//! CUDA_ERROR_NOT_INITIALIZED to every call there), so the shim passes
//! every call straight through until the child execs. A child of a process
//! that never reached the driver (a launcher that forks its CUDA workers)
//! starts clean and claims a slot of its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Set once a thread is about to take any of the shim's CUDA-side locks.
static ENGAGED: AtomicBool = AtomicBool::new(false);
/// Set in a child that must not touch the shim's state.
static PASS_THROUGH: AtomicBool = AtomicBool::new(false);

extern "C" fn in_child() {
    if ENGAGED.load(Ordering::SeqCst) || crate::ops::opening() {
        PASS_THROUGH.store(true, Ordering::Relaxed);
    }
    crate::ops::forget_after_fork();
}

/// Registers the fork handler as the library is loaded, before any thread
/// can touch the shim's state. Registered lazily, a fork could catch the
/// registration half done and leave the child waiting for it forever.
/// Until the process forks this costs nothing but the registration.
extern "C" fn register() {
    // SAFETY: registers a child handler that only reads and stores atomics,
    // which is async-signal-safe as a fork child handler must be.
    unsafe {
        libc::pthread_atfork(None, None, Some(in_child));
    }
}

#[used]
#[link_section = ".init_array"]
static REGISTER: extern "C" fn() = register;

/// Called before taking any of the shim's CUDA-side locks (the allocation
/// table's shards, the VMM, array, pool and context records, the claim
/// lock). Sequentially consistent, so the flag is in memory before the
/// lock is taken and any fork that catches the lock held sees it.
pub fn engage() {
    if !ENGAGED.load(Ordering::Relaxed) {
        ENGAGED.store(true, Ordering::SeqCst);
    }
}

/// Takes one of the shim's CUDA-side mutexes, engaged first. A poisoned
/// one is taken as it is: every section leaves its data consistent before
/// anything in it can panic.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    engage();
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether this process is a child that must leave the shim's state alone.
pub fn passing_through() -> bool {
    PASS_THROUGH.load(Ordering::Relaxed)
}
