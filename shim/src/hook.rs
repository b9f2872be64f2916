//! The one shape every exported hook has: reentrancy guard, then
//! `catch_unwind` around the safe logic, falling back to the real function
//! on re-entry or panic. Also the slots that hold the real functions.

use std::cell::Cell;
use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::log;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `logic` unless this thread is already inside a hook, or this is a
/// forked child that must leave the shim alone (then, or if `logic`
/// panics, runs `real`). `logic` calls the real function itself when it
/// decides to, so a panic before that point never loses the call.
pub fn guarded<R>(real: impl FnOnce() -> R, logic: impl FnOnce() -> R) -> R {
    if crate::fork::passing_through() {
        return real();
    }
    // One thread-local lookup per call (each costs a `__tls_get_addr` in a
    // shared library): the flag is read, set and cleared through it.
    INSIDE.with(|inside| {
        if inside.replace(true) {
            return real();
        }
        let outcome = catch_unwind(AssertUnwindSafe(logic));
        inside.set(false);
        match outcome {
            Ok(result) => result,
            Err(_) => {
                log::warn_once(
                    &log::PANICKED,
                    "internal error in a hook; passing calls through",
                );
                real()
            }
        }
    })
}

/// Address of the real function behind one hook, filled by whichever path
/// first sees it (dlsym, cuGetProcAddress, or RTLD_NEXT for direct links).
pub struct Real(AtomicUsize);

impl Real {
    pub const fn new() -> Self {
        Real(AtomicUsize::new(0))
    }

    pub fn store(&self, address: *mut c_void) {
        self.0.store(address as usize, Ordering::Release);
    }

    pub fn load(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// The real function, resolving `name` after this library when no other
    /// path has supplied it (a program linked against libcuda directly).
    pub fn get_or_next(&self, name: &CStr) -> usize {
        let known = self.load();
        if known != 0 {
            return known;
        }
        let found = crate::dlsym::next(name);
        if !found.is_null() {
            self.store(found);
        }
        found as usize
    }
}

/// Casts a stored address to the function type `F`.
///
/// # Safety
/// `address` must be non-zero and point to a function with `F`'s ABI.
pub unsafe fn as_fn<F: Copy>(address: usize) -> F {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<usize>()) };
    // SAFETY: the caller guarantees `address` is a function of type F, and
    // F is a function pointer of the same size as usize.
    unsafe { std::mem::transmute_copy(&address) }
}

/// The real function of a hooked variant, or return `$missing` from the
/// hook when no path has supplied it and it cannot be found.
macro_rules! real {
    ($hooked:expr, $ty:ty, $missing:expr) => {{
        let address = $hooked.address();
        if address == 0 {
            return $missing;
        }
        // SAFETY: the slot only ever holds the driver's function of this
        // exact variant (matched by name or identity), whose ABI is $ty.
        unsafe { $crate::hook::as_fn::<$ty>(address) }
    }};
}
pub(crate) use real;
