//! The fake driver's and the shim's cost per call, measured from inside a
//! program: `cargo bench --bench shim` and shim/gpu-check.sh read its line.

use crate::cuda::{context, Api, MIB};
use crate::fail;

/// Where the benchmark runs.
#[derive(Clone, Copy)]
pub enum Threads {
    /// The main thread, which was running when the driver was loaded, as
    /// in most programs: where glibc before 2.34 takes `__tls_get_addr`'s
    /// slow path for a library's TLS (BZ #19924).
    Main,
    /// That many threads started after the driver was loaded, at once.
    Spawned(usize),
}

/// Per operation on each thread running `n` pairs (then `n` queries)
/// together, averaged over the threads: wall time (latency, including time
/// spent waiting for a CPU or a lock) and the thread's CPU time (cost,
/// including cache-line transfers; the fair measure when there are more
/// threads than CPUs).
pub fn bench(api: &Api, n: u64, threads: Threads) -> [(f64, f64); 2] {
    fn cpu_ns() -> f64 {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        t.tv_sec as f64 * 1e9 + t.tv_nsec as f64
    }
    let phase = |work: &(dyn Fn() + Sync)| {
        let threads = match threads {
            Threads::Main => {
                context(api);
                let (start, cpu) = (std::time::Instant::now(), cpu_ns());
                work();
                let per_op = n as f64;
                return (
                    start.elapsed().as_nanos() as f64 / per_op,
                    (cpu_ns() - cpu) / per_op,
                );
            }
            Threads::Spawned(threads) => threads,
        };
        let ready = std::sync::Barrier::new(threads);
        let (wall, cpu) = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        context(api);
                        ready.wait();
                        let (start, cpu) = (std::time::Instant::now(), cpu_ns());
                        work();
                        (start.elapsed().as_nanos() as f64, cpu_ns() - cpu)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap_or_else(|_| fail("bench thread panicked")))
                .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
        });
        let per_op = threads as f64 * n as f64;
        (wall / per_op, cpu / per_op)
    };
    let pair = phase(&|| {
        for _ in 0..n {
            let mut p = 0u64;
            // SAFETY: valid out-pointer; p came from the driver.
            if unsafe { (api.mem_alloc)(&mut p, MIB as usize) != 0 || (api.mem_free)(p) != 0 } {
                fail("bench allocation failed");
            }
        }
    });
    let info = phase(&|| {
        for _ in 0..n {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: valid out-pointers.
            unsafe { (api.get_info)(&mut free, &mut total) };
        }
    });
    [pair, info]
}
