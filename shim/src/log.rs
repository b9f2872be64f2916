//! Logging that is safe anywhere in a foreign process: level read once,
//! one `write(2)` per line, nothing on hot paths, most messages once only.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

pub static PANICKED: AtomicBool = AtomicBool::new(false);

const UNREAD: u8 = u8::MAX;
/// 0 = off, 1 = warn (default), 2 = info, 3 = debug.
static LEVEL: AtomicU8 = AtomicU8::new(UNREAD);

fn level() -> u8 {
    let level = LEVEL.load(Ordering::Relaxed);
    if level != UNREAD {
        return level;
    }
    let level = match std::env::var("GPUMEM_SHIM_LOG").as_deref() {
        Ok("off") | Ok("none") => 0,
        Ok("info") => 2,
        Ok("debug") => 3,
        _ => 1,
    };
    LEVEL.store(level, Ordering::Relaxed);
    level
}

fn emit(message: &str) {
    let line = format!("gpumem-shim[{}]: {message}\n", std::process::id());
    // SAFETY: writes a valid buffer of the given length to fd 2; a failed
    // write is ignored on purpose (stderr may be closed).
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
    }
}

/// Whether warnings are off (`GPUMEM_SHIM_LOG=off`).
pub fn quiet() -> bool {
    level() == 0
}

pub fn warn(message: &str) {
    if level() >= 1 {
        emit(message);
    }
}

pub fn info(message: &str) {
    if level() >= 2 {
        emit(message);
    }
}

pub fn debug(message: impl FnOnce() -> String) {
    if level() >= 3 {
        emit(&message());
    }
}

/// Warns once per process for the given flag.
pub fn warn_once(flag: &AtomicBool, message: &str) {
    if !flag.swap(true, Ordering::Relaxed) {
        warn(message);
    }
}
