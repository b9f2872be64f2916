//! The one shape every exported hook has: reentrancy guard, then
//! `catch_unwind` around the safe logic, falling back to the real function
//! on re-entry or panic (`guarded`, and `answered` for logic that only
//! reads the real answer); and the real functions (`real!`, their slots).

use std::cell::Cell;
use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::log;

/// Whether this thread is inside a hook: one byte of initial-exec TLS.
/// The shim is loaded at start-up (LD_PRELOAD, /etc/ld.so.preload), so the
/// byte sits in the static TLS block at an offset fixed at load, two
/// instructions away. `thread_local!` in a shared library costs a call to
/// `__tls_get_addr` per access instead, and glibc before 2.34 takes that
/// call's slow path every time in a thread that was running when a library
/// with TLS was dlopen'ed (BZ #19924): the main thread of every CUDA program
/// once it loads the driver. Measured under glibc 2.31 on the main thread:
/// 8 ns per alloc+free pair less than `thread_local!`; the same elsewhere
/// (docs/BENCHMARKS.md).
#[cfg(target_arch = "x86_64")]
mod inside {
    std::arch::global_asm!(
        ".pushsection .tbss.gpumem_shim_inside,\"awT\",@nobits",
        ".globl gpumem_shim_inside",
        ".hidden gpumem_shim_inside",
        ".type gpumem_shim_inside, @object",
        ".size gpumem_shim_inside, 1",
        "gpumem_shim_inside:",
        ".zero 1",
        ".popsection",
    );

    /// Sets this thread's flag to `value`; returns what it was.
    #[inline(always)]
    pub fn replace(value: bool) -> bool {
        let old: u32;
        // SAFETY: reads and writes this thread's own byte in the shim's
        // static TLS block, at the thread-pointer offset the loader wrote
        // into the GOT (the initial-exec model of the x86-64 TLS ABI).
        unsafe {
            std::arch::asm!(
                "mov {offset}, qword ptr [rip + gpumem_shim_inside@GOTTPOFF]",
                "movzx {old:e}, byte ptr fs:[{offset}]",
                "mov byte ptr fs:[{offset}], {new}",
                offset = out(reg) _,
                old = out(reg) old,
                new = in(reg_byte) u8::from(value),
                options(nostack, preserves_flags),
            );
        }
        old != 0
    }
}

/// Elsewhere, std's thread-local.
#[cfg(not(target_arch = "x86_64"))]
mod inside {
    use std::cell::Cell;

    thread_local! {
        static INSIDE: Cell<bool> = const { Cell::new(false) };
    }

    pub fn replace(value: bool) -> bool {
        INSIDE.with(|inside| inside.replace(value))
    }
}

/// Runs `logic` unless this thread is already inside a hook, or this is a
/// forked child that must leave the shim alone (then, or if `logic`
/// panics, runs `real`). `logic` gets `real` back and calls it itself when
/// it decides to, so a panic before that point never loses the call; the
/// answer is kept, so a panic after it returns that answer instead of
/// calling again (a second allocation would leak the first, a second free
/// could free an address the driver has handed out again).
pub fn guarded<R: Copy>(real: impl Fn() -> R, logic: impl FnOnce(&dyn Fn() -> R) -> R) -> R {
    if crate::fork::passing_through() {
        return real();
    }
    if inside::replace(true) {
        return real();
    }
    let answer = Cell::new(None);
    let forward = || {
        let result = real();
        answer.set(Some(result));
        result
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| logic(&forward)));
    inside::replace(false);
    match outcome {
        Ok(result) => result,
        Err(_) => {
            log::warn_once(
                &log::PANICKED,
                "internal error in a hook; passing calls through",
            );
            answer.get().unwrap_or_else(real)
        }
    }
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
    /// path has supplied it (a program or library linked against libcuda
    /// directly).
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

/// Casts a stored address to the type of `like`, a function pointer.
///
/// # Safety
/// As for [`as_fn`]: `address` points to a function with `like`'s ABI.
pub unsafe fn as_fn_like<F: Copy>(_like: F, address: usize) -> F {
    // SAFETY: the caller's guarantee, passed on.
    unsafe { as_fn(address) }
}

/// The shape of a hook that only reads or rewrites what the real function
/// answered: the real call first, so the driver's own NULL and error
/// semantics stay, then `look`, guarded, when it succeeded. On re-entry or
/// a panic the real answer stands as it is.
pub fn answered<R: PartialEq>(call: impl FnOnce() -> R, success: R, look: impl FnOnce()) -> R {
    let result = call();
    if result == success {
        guarded(|| (), |_| look());
    }
    result
}

/// `real!(let call = entry(args…) else missing);` binds `call`, a closure
/// calling the real function behind our entry point `entry` with the
/// caller's `args`; or returns `missing` from the hook when no path has
/// supplied that function and it cannot be found. The real function's type
/// is inferred from `entry`, so the signature is spelled once.
macro_rules! real {
    (let $call:ident = $entry:ident($($arg:ident),* $(,)?) else $missing:expr) => {
        let address = $crate::table::Hooked::$entry.address();
        if address == 0 {
            return $missing;
        }
        // SAFETY: the slot only ever holds the driver's function of this
        // exact variant (matched by name or identity), whose ABI is that
        // of our entry point of the same name.
        let real = unsafe {
            $crate::hook::as_fn_like(
                $entry as unsafe extern "C" fn($($crate::hook::inferred!($arg)),*) -> _,
                address,
            )
        };
        // SAFETY: forwards the caller's arguments unchanged, under the
        // contract the caller entered into by calling our entry point.
        let $call = || unsafe { real($($arg),*) };
    };
}
pub(crate) use real;

/// `_` for each argument: the parameter types of `real!`'s cast are
/// inferred from the entry point.
macro_rules! inferred {
    ($arg:ident) => {
        _
    };
}
pub(crate) use inferred;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_after_the_real_call_returns_its_answer_without_calling_again() {
        let calls = Cell::new(0);
        let real = || {
            calls.set(calls.get() + 1);
            7
        };
        let result = guarded(real, |call| {
            call();
            panic!("after the real call");
        });
        assert_eq!((result, calls.get()), (7, 1));
    }

    #[test]
    fn a_panic_before_the_real_call_still_makes_it() {
        let calls = Cell::new(0);
        let real = || {
            calls.set(calls.get() + 1);
            7
        };
        let result = guarded(real, |_| panic!("before the real call"));
        assert_eq!((result, calls.get()), (7, 1));
        // The flag is down again: the next hook runs its logic.
        assert_eq!(guarded(real, |_| 8), 8);
    }
}
