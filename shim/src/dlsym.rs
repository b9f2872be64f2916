//! The `dlsym` interposer: nvidia-smi, pynvml and the CUDA runtime reach
//! NVML and the driver through dlopen + dlsym, so this is where they meet us.
//!
//! Names we do not hook are tail-called into the real `dlsym` with the
//! caller's stack untouched, so it still sees the caller's return address:
//! `dlsym(RTLD_NEXT, …)` from any library keeps its meaning.

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::hook::{as_fn, Real};
use crate::table::Hooked;

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// The real `dlsym`; read by the assembly entry point.
static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

fn real_dlsym() -> usize {
    let known = REAL_DLSYM.load(Ordering::Acquire);
    if known != 0 {
        return known;
    }
    // dlvsym is not interposed, so this cannot recurse. glibc 2.34 moved
    // dlsym into libc with a new version; older ones only have 2.2.5.
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
        // SAFETY: valid NUL-terminated strings; RTLD_NEXT is a valid handle.
        let found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !found.is_null() {
            REAL_DLSYM.store(found as usize, Ordering::Release);
            return found as usize;
        }
    }
    0
}

/// Calls the real `dlsym` from this library.
fn call_real(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let real = real_dlsym();
    if real == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: `real` is glibc's dlsym, resolved by name and version.
    unsafe { as_fn::<DlsymFn>(real)(handle, name) }
}

/// `name` as resolved after this library: the real function behind one of
/// our exports. Where nothing after us in the global scope has it, the
/// driver library's own: a library opened `RTLD_LOCAL` that links the
/// driver (a Python extension, a JNI library) keeps it in its local scope,
/// which binds its calls to our exports first but which `RTLD_NEXT` from
/// here never searches.
pub fn next(name: &CStr) -> *mut c_void {
    let found = call_real(libc::RTLD_NEXT, name.as_ptr());
    if !found.is_null() {
        return found;
    }
    library_of(name.to_bytes()).symbol(name)
}

/// The library a hooked name belongs to.
fn library_of(name: &[u8]) -> &'static Library {
    if name.starts_with(b"nvml") {
        &LIBNVML
    } else {
        &LIBCUDA
    }
}

/// What the loader knows of `address`: the object it lies in and the
/// nearest symbol at or below it; `None` where it lies in no object.
pub fn loaded_at(address: *const c_void) -> Option<libc::Dl_info> {
    // SAFETY: a zeroed Dl_info is a valid out-buffer for dladdr.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables for this address.
    (unsafe { libc::dladdr(address, &mut info) } != 0).then_some(info)
}

/// Whether `address` lies in the driver or NVML (whichever copy, by file
/// name), rather than in a program or library that defines the same name.
fn in_driver(address: *mut c_void) -> bool {
    let Some(info) = loaded_at(address).filter(|info| !info.dli_fname.is_null()) else {
        return false;
    };
    // SAFETY: dladdr set dli_fname to the object's NUL-terminated name.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes();
    let file = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
    file.starts_with(b"libcuda.so") || file.starts_with(b"libnvidia-ml.so")
}

/// A library we look up without loading it: if the process has not loaded
/// it, there is nothing to ask it.
pub struct Library {
    soname: &'static CStr,
    handle: AtomicUsize,
}

pub static LIBCUDA: Library = Library::new(c"libcuda.so.1");
pub static LIBNVML: Library = Library::new(c"libnvidia-ml.so.1");

impl Library {
    const fn new(soname: &'static CStr) -> Self {
        Library {
            soname,
            handle: AtomicUsize::new(0),
        }
    }

    fn handle(&self) -> *mut c_void {
        let known = self.handle.load(Ordering::Acquire);
        if known != 0 {
            return known as *mut c_void;
        }
        // SAFETY: RTLD_NOLOAD only returns a handle to an already-loaded object.
        let handle =
            unsafe { libc::dlopen(self.soname.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if !handle.is_null() {
            self.handle.store(handle as usize, Ordering::Release);
        }
        handle
    }

    /// `symbol`, remembered in `slot` once found: for driver functions the
    /// shim itself calls on hot paths.
    pub fn cached(&self, slot: &Real, name: &CStr) -> usize {
        let known = slot.load();
        if known != 0 {
            return known;
        }
        let found = self.symbol(name);
        if !found.is_null() {
            slot.store(found);
        }
        found as usize
    }

    /// The address of `name`, loading the library if the process has not:
    /// for the shim's own NVML questions.
    pub fn load(&self, name: &CStr) -> Option<usize> {
        if self.handle().is_null() {
            // SAFETY: a valid soname; the handle is kept for the process's life.
            let handle =
                unsafe { libc::dlopen(self.soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if handle.is_null() {
                return None;
            }
            self.handle.store(handle as usize, Ordering::Release);
        }
        Some(self.symbol(name) as usize).filter(|&a| a != 0)
    }

    /// The address of `name` in this library, if it is loaded and has it.
    pub fn symbol(&self, name: &CStr) -> *mut c_void {
        let handle = self.handle();
        if handle.is_null() {
            return std::ptr::null_mut();
        }
        call_real(handle, name.as_ptr())
    }
}

/// Called by the entry point for every `dlsym`: makes sure the real dlsym
/// is known and says whether `name` is one we hook. `RTLD_NEXT` lookups are
/// never ours: resolved from here they would find what comes after the
/// shim, not after the caller (an interposer preloaded after us would get
/// its own function back, and recurse). Must not allocate.
extern "C" fn classify(handle: *mut c_void, name: *const c_char) -> usize {
    catch_unwind(|| {
        real_dlsym();
        if name.is_null() || handle == libc::RTLD_NEXT {
            return 0;
        }
        // SAFETY: dlsym's contract: `name` is a NUL-terminated string.
        let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
        usize::from(Hooked::from_name(bytes).is_some())
    })
    .unwrap_or(0)
}

/// Resolves a hooked name and hands back our entry point instead, after
/// recording the real function it stands for.
extern "C" fn intercept(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    catch_unwind(AssertUnwindSafe(|| substitute(handle, name)))
        .unwrap_or_else(|_| call_real(handle, name))
}

fn substitute(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let mut found = call_real(handle, name);
    // SAFETY: classify already checked `name` is a non-null C string.
    let name = unsafe { CStr::from_ptr(name) };
    let Some(hooked) = Hooked::from_name(name.to_bytes()) else {
        return found;
    };
    let hook = hooked.hook() as *mut c_void;
    // Whether `found` is what comes after us, which our hook may call.
    let mut after_us = false;
    if found == hook {
        // RTLD_DEFAULT from here searches this library first (it is linked
        // -Bsymbolic): what the caller finds is in the program's order,
        // which may put an interposer ahead of us.
        found = call_real(program(), name.as_ptr());
        if found == hook || found.is_null() {
            found = next(name);
            after_us = true;
        }
    }
    if found.is_null() {
        return found;
    }
    if !after_us && !in_driver(found) && found != next(name) {
        // Defined ahead of us: an interposer preloaded before the shim, or
        // the program itself. Recorded as the real function, our hook would
        // call it and its own RTLD_NEXT lookup would reach our hook again,
        // without end; handed back as it is, that lookup reaches our hook
        // once, which caps the call.
        return found;
    }
    hooked.real().store(found);
    hook
}

/// The program's own handle: lookups through it follow the global scope's
/// order (the program, the preloaded libraries, then the rest).
fn program() -> *mut c_void {
    static PROGRAM: AtomicUsize = AtomicUsize::new(0);
    let known = PROGRAM.load(Ordering::Acquire);
    if known != 0 {
        return known as *mut c_void;
    }
    // SAFETY: dlopen(NULL) returns the main program's handle, never loading.
    let handle = unsafe { libc::dlopen(std::ptr::null(), libc::RTLD_LAZY) };
    PROGRAM.store(handle as usize, Ordering::Release);
    handle
}

/// The exported `dlsym`. Unhooked names jump straight into the real one.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        // Keep both arguments across the call (which takes them as they
        // are); 3 × 8 bytes re-aligns the stack to 16 for the callee.
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {classify}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2f",
        // Not ours: tail-call the real dlsym with the caller's frame.
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 3f",
        "jmp rax",
        "2:",
        "jmp {intercept}",
        "3:",
        "xor eax, eax",
        "ret",
        classify = sym classify,
        real = sym REAL_DLSYM,
        intercept = sym intercept,
    )
}

/// Portable fallback: correct for every handle except `RTLD_NEXT`, which the
/// real dlsym resolves relative to the shim instead of the caller.
#[cfg(not(target_arch = "x86_64"))]
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    if classify(handle, name) != 0 {
        intercept(handle, name)
    } else {
        call_real(handle, name)
    }
}
