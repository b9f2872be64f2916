//! Many threads (and processes) at the driver at once: to catch a shim that
//! lets allocations past a cap, serialises them, or deadlocks a forked child.
//! Counters shared across processes live in a small mapped file, so they do
//! not depend on the shim they check.

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::cuda::{context, Api, MIB};
use crate::fail;

/// `words` u64 counters in `path`, shared by every process mapping it.
fn shared_words(path: &str, words: usize) -> &'static [AtomicU64] {
    let c = CString::new(path).unwrap_or_else(|_| fail("NUL in file name"));
    let len = words * 8;
    // SAFETY: plain open/ftruncate/mmap of a test file; the mapping is never
    // unmapped, so the slice lives as long as the process.
    unsafe {
        let fd = libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600);
        if fd < 0 || libc::ftruncate(fd, len as libc::off_t) != 0 {
            fail(&format!("open {path}"));
        }
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        libc::close(fd);
        if p == libc::MAP_FAILED {
            fail(&format!("mmap {path}"));
        }
        std::slice::from_raw_parts(p as *const AtomicU64, words)
    }
}

/// Threads allocating and freeing `mib` at a time; a shared counter file
/// records how many allocations were ever held at once across all
/// processes using it.
pub fn stress(api: &Api, threads: usize, iters: usize, mib: u64, counter: &str) {
    let words = shared_words(counter, 2);
    let (held, most) = (&words[0], &words[1]);
    let ok = AtomicU64::new(0);
    let refused = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut current = false;
                for _ in 0..iters {
                    // A context takes memory too: one that does not fit
                    // is refused with out-of-memory, as on a full GPU, and
                    // an allocation without one would get
                    // CUDA_ERROR_INVALID_CONTEXT. Try again next time.
                    if !current {
                        match context(api) {
                            0 => current = true,
                            2 => {
                                refused.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            other => fail(&format!("context returned {other}")),
                        }
                    }
                    let mut p = 0u64;
                    // SAFETY: valid out-pointer.
                    let r = unsafe { (api.mem_alloc)(&mut p, (mib * MIB) as usize) };
                    match r {
                        0 => {
                            let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            ok.fetch_add(1, Ordering::Relaxed);
                            std::thread::yield_now();
                            held.fetch_sub(1, Ordering::SeqCst);
                            // SAFETY: p came from the driver.
                            let f = unsafe { (api.mem_free)(p) };
                            assert_eq!(f, 0, "free failed");
                        }
                        2 => {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        other => fail(&format!("alloc returned {other}")),
                    }
                }
            });
        }
    });
    println!(
        "stress ok={} refused={}",
        ok.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed)
    );
}

/// Waits up to `limit` for `pid`: its exit code (128 + signal if killed by
/// one), or `None` if it is still running.
fn reap(pid: libc::pid_t, limit: Duration) -> Option<i32> {
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: valid out-pointer; pid is our child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(exit_code(status));
        }
        if r < 0 {
            fail(&format!("waitpid {pid}"));
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn exit_code(status: i32) -> i32 {
    if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        libc::WEXITSTATUS(status)
    }
}

/// Forks `n` children, one after another, while `threads` threads allocate
/// and free `mib` in batches: a child forked while one of them was inside
/// the shim must still get answers (the driver refuses a forked child, so
/// any answer will do) instead of hanging on a lock no thread will release.
/// Each child frees many allocations spread over the address space, so it
/// meets whatever lock a thread held at the fork.
pub fn forkstorm(api: &Api, n: u64, threads: usize, mib: u64) {
    const VICTIMS: usize = 64;
    const BATCH: usize = 16;
    let bytes = (mib * MIB) as usize;
    let victims: Vec<u64> = (0..VICTIMS)
        .map(|_| {
            let mut victim = 0u64;
            // SAFETY: valid out-pointer.
            let r = unsafe { (api.mem_alloc)(&mut victim, bytes) };
            if r != 0 {
                fail(&format!("forkstorm victim allocation returned {r}"));
            }
            victim
        })
        .collect();
    let stop = AtomicBool::new(false);
    let (mut ok, mut hung) = (0, 0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                context(api);
                let mut batch = [0u64; BATCH];
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: valid out-pointers; each p came from the driver.
                    unsafe {
                        for p in &mut batch {
                            if (api.mem_alloc)(p, bytes) != 0 {
                                *p = 0;
                            }
                        }
                        for p in batch.iter().filter(|&&p| p != 0) {
                            (api.mem_free)(*p);
                        }
                    }
                }
            });
        }
        for _ in 0..n {
            // SAFETY: the child only calls the driver through the function
            // pointers it already has, then _exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: the driver's own functions with its signatures, on
                // pointers it returned to the parent; in the child they are
                // expected to fail (a forked child cannot use CUDA), which
                // is what the step checks.
                unsafe {
                    for &victim in &victims {
                        (api.mem_free)(victim);
                    }
                    let mut p = 0u64;
                    (api.mem_alloc)(&mut p, bytes);
                    libc::_exit(0);
                }
            }
            if pid < 0 {
                stop.store(true, Ordering::Relaxed);
                fail("fork failed");
            }
            match reap(pid, Duration::from_secs(2)) {
                Some(0) => ok += 1,
                Some(_) => {}
                None => {
                    // SAFETY: pid is our child.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, std::ptr::null_mut(), 0);
                    }
                    hung += 1;
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    for victim in victims {
        // SAFETY: victim came from the driver.
        unsafe { (api.mem_free)(victim) };
    }
    println!("forkstorm ok={ok} hung={hung}");
}

/// `parties` threads across processes (`threads` here) race for memory in
/// lock-step rounds. `file` holds u64s: [0] counts barrier arrivals, [1 + r]
/// round r's winners, so a test can check no round let too many through.
pub fn race(api: &Api, threads: usize, rounds: usize, mib: u64, file: &str, parties: u64) {
    let words = shared_words(file, 1 + rounds);
    let arrivals = &words[0];
    let wins = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                context(api);
                let mut passed = 0u64;
                let mut barrier = || {
                    arrivals.fetch_add(1, Ordering::SeqCst);
                    passed += 1;
                    while arrivals.load(Ordering::SeqCst) < passed * parties {
                        // SAFETY: no arguments.
                        unsafe { libc::sched_yield() };
                    }
                };
                for round in &words[1..] {
                    barrier();
                    let mut p = 0u64;
                    // SAFETY: valid out-pointer.
                    let r = unsafe { (api.mem_alloc)(&mut p, (mib * MIB) as usize) };
                    match r {
                        0 => {
                            round.fetch_add(1, Ordering::SeqCst);
                            wins.fetch_add(1, Ordering::Relaxed);
                        }
                        2 => {}
                        other => eprintln!("gpumem-probe: race alloc returned {other}"),
                    }
                    barrier();
                    if r == 0 {
                        // SAFETY: p came from the driver.
                        unsafe { (api.mem_free)(p) };
                    }
                    barrier();
                }
            });
        }
    });
    println!("race wins={}", wins.load(Ordering::Relaxed));
}
