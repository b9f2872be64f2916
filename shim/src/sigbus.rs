//! A shrunk accounting file must not kill the process: touching a page of a
//! shared mapping past the file's new end raises SIGBUS. Our handler swaps
//! the mapping for private zero pages, so the access that faulted completes,
//! and from then on the shim passes every call through, saying so once.
//! Faults anywhere else go to whatever handler was there before.

use std::ffi::{c_int, c_void};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

static BASE: AtomicUsize = AtomicUsize::new(0);
static LEN: AtomicUsize = AtomicUsize::new(0);
static BROKEN: AtomicBool = AtomicBool::new(false);
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The disposition before ours, to pass other faults on to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
/// The warning after `gpumem-shim[PID`, built before any fault can happen:
/// the handler must not allocate.
static MESSAGE: OnceLock<Box<[u8]>> = OnceLock::new();

/// Whether the accounting file was found shrunk: the shim is off.
pub fn broken() -> bool {
    BROKEN.load(Ordering::Relaxed)
}

/// Guards `len` bytes mapped at `base` from `path` (one region a process).
pub fn protect(base: *mut c_void, len: usize, path: &Path) {
    // Read the log level now: the handler cannot read the environment.
    crate::log::quiet();
    let _ = MESSAGE.set(
        format!(
            "]: accounting file {} shrank while in use; GPU memory is NOT capped in this \
             process from now on\n",
            path.display()
        )
        .into_bytes()
        .into_boxed_slice(),
    );
    LEN.store(len, Ordering::Release);
    BASE.store(base as usize, Ordering::Release);
    if INSTALLED.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: plain sigaction calls with valid, zero-initialised structs;
    // the handler is async-signal-safe (atomics, mmap, write, sigaction).
    unsafe {
        let mut previous: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous);
        let _ = PREVIOUS.set(previous);
        let mut ours: libc::sigaction = std::mem::zeroed();
        ours.sa_sigaction = on_sigbus as *const () as usize;
        ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        libc::sigemptyset(&mut ours.sa_mask);
        libc::sigaction(libc::SIGBUS, &ours, std::ptr::null_mut());
    }
}

/// Stops guarding the region (it was unmapped).
pub fn forget() {
    BASE.store(0, Ordering::Release);
}

extern "C" fn on_sigbus(signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let address = unsafe { (*info).si_addr() } as usize;
    let (base, len) = (BASE.load(Ordering::Acquire), LEN.load(Ordering::Acquire));
    if base != 0 && (base..base + len).contains(&address) {
        // SAFETY: replaces exactly our own mapping, which nothing outside
        // the shim points into, with anonymous private pages.
        unsafe {
            libc::mmap(
                base as *mut c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            );
        }
        if !BROKEN.swap(true, Ordering::AcqRel) {
            warn();
        }
        return;
    }
    // SAFETY: as above for `info`; `pass_on` only calls sigaction, raise
    // and the previous handler with the arguments we were given.
    unsafe { pass_on(signal, info, context) };
}

/// Hands a fault that is not ours to the disposition we replaced.
unsafe fn pass_on(signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    let previous = PREVIOUS.get().map_or(libc::SIG_DFL, |p| p.sa_sigaction);
    let flags = PREVIOUS.get().map_or(0, |p| p.sa_flags);
    // SAFETY: the kernel's siginfo; si_code > 0 means the kernel raised it
    // for a fault, <= 0 that a process sent it.
    let sent = unsafe { (*info).si_code } <= 0;
    match previous {
        libc::SIG_IGN if sent => {}
        libc::SIG_DFL | libc::SIG_IGN => {
            // SAFETY: restores the default disposition; a fault then
            // re-executes and takes it, a sent signal is raised again.
            unsafe {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
                if sent {
                    libc::raise(libc::SIGBUS);
                }
            }
        }
        handler if flags & libc::SA_SIGINFO != 0 => {
            type Action = extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void);
            // SAFETY: the previous handler was installed with SA_SIGINFO.
            let action: Action = unsafe { std::mem::transmute::<usize, Action>(handler) };
            action(signal, info, context);
        }
        handler => {
            type Handler = extern "C" fn(c_int);
            // SAFETY: a plain handler, installed without SA_SIGINFO.
            let handler: Handler = unsafe { std::mem::transmute::<usize, Handler>(handler) };
            handler(signal);
        }
    }
}

/// One line on stderr without allocating: `gpumem-shim[PID]: …`.
fn warn() {
    if crate::log::quiet() {
        return;
    }
    let mut line = [0u8; 1024];
    let head = b"gpumem-shim[";
    line[..head.len()].copy_from_slice(head);
    let mut at = head.len();
    // SAFETY: getpid is async-signal-safe.
    let pid = unsafe { libc::getpid() } as u32;
    let mut digits = [0u8; 10];
    let mut n = digits.len();
    let mut rest = pid;
    loop {
        n -= 1;
        digits[n] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    line[at..at + digits.len() - n].copy_from_slice(&digits[n..]);
    at += digits.len() - n;
    let tail = MESSAGE
        .get()
        .map_or(&b"]: accounting file shrank\n"[..], |m| m);
    let take = tail.len().min(line.len() - at);
    line[at..at + take].copy_from_slice(&tail[..take]);
    at += take;
    // SAFETY: write(2) with a valid buffer; a failed write is ignored.
    unsafe {
        libc::write(2, line.as_ptr().cast(), at);
    }
}
