//! A shrunk accounting file must not kill the process: touching a page of a
//! shared mapping past the file's new end raises SIGBUS. Our handler swaps
//! the mapping for private zero pages, so the access that faulted completes,
//! and from then on the shim passes every call through, saying so once.
//! Faults anywhere else go to whatever handler was there before.

use std::ffi::{c_int, c_void};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;

use gpumem_layout::MAX_DEVICES;

/// A guarded mapping: a base of 0 guards nothing.
struct Guarded {
    /// Taken by one `protect` at a time, until `forget`.
    taken: AtomicBool,
    base: AtomicUsize,
    len: AtomicUsize,
    /// The warning after `gpumem-shim[PID`, built before any fault can
    /// happen (the handler must not allocate) and never freed, so a
    /// handler that read the pointer can always use it.
    message: AtomicPtr<Box<[u8]>>,
}

/// One entry per accounting file a process maps (each caps a device at
/// least, so there are never more than there are devices).
static GUARDED: [Guarded; MAX_DEVICES] = [const {
    Guarded {
        taken: AtomicBool::new(false),
        base: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        message: AtomicPtr::new(std::ptr::null_mut()),
    }
}; MAX_DEVICES];
static BROKEN: AtomicBool = AtomicBool::new(false);
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The disposition before ours, to pass other faults on to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Whether the accounting file was found shrunk: the shim is off.
pub fn broken() -> bool {
    BROKEN.load(Ordering::Relaxed)
}

/// Guards `len` bytes mapped at `base` from `path`; a mapping past the
/// table's size is left unguarded (the shim opens no more files than that).
pub fn protect(base: *mut c_void, len: usize, path: &Path) {
    // Read the log level now: the handler cannot read the environment.
    crate::log::quiet();
    let message = format!(
        "]: accounting file {} shrank while in use; GPU memory is NOT capped in this \
         process from now on\n",
        path.display()
    );
    let Some(entry) = GUARDED.iter().find(|g| {
        g.taken
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }) else {
        return;
    };
    let message: &'static mut Box<[u8]> = Box::leak(Box::new(message.into_bytes().into()));
    entry.message.store(message, Ordering::Release);
    entry.len.store(len, Ordering::Release);
    entry.base.store(base as usize, Ordering::Release);
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

/// Stops guarding the mapping at `base` (it was unmapped).
pub fn forget(base: *mut c_void) {
    for entry in &GUARDED {
        if entry
            .base
            .compare_exchange(base as usize, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            entry.taken.store(false, Ordering::Release);
        }
    }
}

extern "C" fn on_sigbus(signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let (code, address) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // Only a fault the kernel raised has an address: in a signal a process
    // sent (si_code <= 0) the same bytes are its sender's pid and uid.
    let fault = code > 0;
    let faulted = GUARDED.iter().filter(|_| fault).find_map(|g| {
        let (base, len) = (
            g.base.load(Ordering::Acquire),
            g.len.load(Ordering::Acquire),
        );
        (base != 0 && (base..base + len).contains(&address)).then_some((g, base, len))
    });
    if let Some((entry, base, len)) = faulted {
        // SAFETY: replaces exactly our own mapping, which nothing outside
        // the shim points into, with anonymous private pages.
        let remapped = unsafe {
            libc::mmap(
                base as *mut c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if remapped == libc::MAP_FAILED {
            // The access would fault again, forever: the fault takes its
            // course instead.
            // SAFETY: as below.
            unsafe { pass_on(signal, info, context) };
            return;
        }
        if !BROKEN.swap(true, Ordering::AcqRel) {
            let text = entry.message.load(Ordering::Acquire);
            // SAFETY: null, or a leaked message that is never freed.
            warn(unsafe { text.as_ref() }.map(|m| &m[..]));
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
fn warn(message: Option<&[u8]>) {
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
    let tail = message.map_or(&b"]: accounting file shrank\n"[..], |m| m);
    let take = tail.len().min(line.len() - at);
    line[at..at + take].copy_from_slice(&tail[..take]);
    at += take;
    // SAFETY: write(2) with a valid buffer; a failed write is ignored.
    unsafe {
        libc::write(2, line.as_ptr().cast(), at);
    }
}
