//! gpumem-probe: a stand-in for PyTorch and nvidia-smi in tests. It loads
//! libcuda.so.1 and libnvidia-ml.so.1 with dlopen, finds functions with
//! dlsym or through cuGetProcAddress as the CUDA runtime does, and runs the
//! steps given on its command line, printing one line per step.
//!
//! `exec` and `fork` live here because they decide what happens to the steps
//! after them; every other step is `steps::Probe::run`.
//!
//! ```text
#![doc = include_str!("usage.txt")]
//! ```

mod bench;
mod cuda;
mod nvml;
mod steps;
mod stress;

use std::ffi::CString;
use std::io::Write;

const USAGE: &str = include_str!("usage.txt");

fn fail(message: &str) -> ! {
    eprintln!("gpumem-probe: {message}");
    std::process::exit(100);
}

/// Runs the steps after `exec` in a fresh image of this program.
fn exec(program: &str, flags: &[String], rest: &[String]) -> ! {
    println!("exec");
    std::io::stdout().flush().ok();
    let argv: Vec<CString> = std::iter::once(program)
        .chain(flags.iter().chain(rest).map(String::as_str))
        .map(|a| CString::new(a).unwrap_or_else(|_| fail("NUL in argument")))
        .collect();
    let mut pointers: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    pointers.push(std::ptr::null());
    // SAFETY: a NUL-terminated array of C strings that outlive the call.
    unsafe { libc::execv(c"/proc/self/exe".as_ptr(), pointers.as_ptr()) };
    fail(&format!("exec: {}", std::io::Error::last_os_error()));
}

/// Waits for a child running the rest of the steps, reports how it ended,
/// and exits; returns in the child.
fn fork() {
    std::io::stdout().flush().ok();
    // SAFETY: the probe is single-threaded between steps.
    let pid = unsafe { libc::fork() };
    match pid {
        0 => {}
        p if p < 0 => fail("fork failed"),
        child => {
            let mut status = 0;
            // SAFETY: valid out-pointer; child is ours.
            unsafe { libc::waitpid(child, &mut status, 0) };
            println!("fork status={}", stress::exit_code(status));
            std::io::stdout().flush().ok();
            std::process::exit(0);
        }
    }
}

fn main() {
    let mut args = std::env::args();
    let program = args.next().unwrap_or_else(|| "gpumem-probe".into());
    let mut args: Vec<String> = args.collect();
    let mut flags = Vec::new();
    let mut via = "dlsym".to_owned();
    let mut ptsz = false;
    while let Some(first) = args.first().cloned() {
        match first.as_str() {
            "--help" | "-h" => {
                print!("{USAGE}");
                return;
            }
            "--via" => {
                via = args
                    .get(1)
                    .cloned()
                    .unwrap_or_else(|| fail("--via needs a value"));
                flags.extend(args.drain(..2));
            }
            "--ptsz" => {
                ptsz = true;
                flags.push(args.remove(0));
            }
            _ => break,
        }
    }
    let mut probe = steps::Probe::new(via, ptsz);
    for (i, step) in args.iter().enumerate() {
        match step.as_str() {
            "exec" => exec(&program, &flags, &args[i + 1..]),
            "fork" => fork(),
            _ => probe.run(step),
        }
        std::io::stdout().flush().ok();
    }
}
