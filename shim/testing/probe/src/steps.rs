//! One step at a time, with what the steps made: every allocation-like step
//! pushes its pointer, handle, address range, array, pool or context on one
//! index list that later steps name by index.

use std::ffi::{c_int, c_uint, c_void};
use std::io::Write;
use std::time::{Duration, Instant};

use crate::cuda::{
    context, context_on, load, AccessDesc, Api, Array3dDesc, ArrayDesc, Location, PoolProps, Prop,
    MIB,
};
use crate::{bench, fail, nvml, stress};

const LOCATION_DEVICE: c_int = 1;
const POSIX_FD: c_int = 1;
const ACCESS_READ_WRITE: c_int = 3;

/// Something a step made, and its size where later steps need it (handles
/// and address ranges, for `map` and `unmap`).
#[derive(Clone, Copy, Default)]
struct Made {
    value: u64,
    size: u64,
}

impl Made {
    /// What has no size to remember: a context, array, pool or stream, or
    /// memory only ever freed whole.
    fn of(value: u64) -> Made {
        Made { value, size: 0 }
    }
}

/// What the steps made, in order.
#[derive(Default)]
struct Index(Vec<Made>);

impl Index {
    fn get(&self, index: Option<&str>) -> Made {
        self.0.get(num(index) as usize).copied().unwrap_or_default()
    }

    /// Prints `STEP R #K` and remembers what the step made (nothing if it failed).
    fn push(&mut self, step: &str, r: i32, made: Made) {
        println!("{step} {r} #{}", self.0.len());
        self.0.push(if r == 0 { made } else { Made::default() });
    }

    /// The size a handle was made with, for one that came back from the driver.
    fn handle_size(&self, handle: u64) -> u64 {
        self.0
            .iter()
            .find(|m| m.value == handle && m.size > 0)
            .map_or(0, |m| m.size)
    }
}

pub struct Probe {
    via: String,
    ptsz: bool,
    api: Option<Api>,
    made: Index,
}

fn num(s: Option<&str>) -> u64 {
    s.and_then(|v| v.parse().ok())
        .unwrap_or_else(|| fail("bad number in step"))
}

/// A number in decimal or 0x-hex (array formats are usually written in hex).
fn number(s: Option<&str>) -> u64 {
    match s.and_then(|v| v.strip_prefix("0x")) {
        Some(hex) => u64::from_str_radix(hex, 16).unwrap_or_else(|_| fail("bad number in step")),
        None => num(s),
    }
}

/// `CUmemAllocationType` by name.
fn pool_type(s: Option<&str>) -> c_int {
    match s {
        Some("pinned") => 1,
        Some("managed") => 2,
        _ => fail("pool type: pinned or managed"),
    }
}

/// `CUmemLocationType` by name.
fn location_type(s: Option<&str>) -> c_int {
    match s {
        Some("none") => 0,
        Some("device") => LOCATION_DEVICE,
        Some("host") => 2,
        Some("hostnuma") => 3,
        _ => fail("location: none, device, host or hostnuma"),
    }
}

/// The first failure of several calls made in order, or 0.
fn first_error(results: &[i32]) -> i32 {
    results.iter().copied().find(|&r| r != 0).unwrap_or(0)
}

impl Probe {
    pub fn new(via: String, ptsz: bool) -> Self {
        Probe {
            via,
            ptsz,
            api: None,
            made: Index::default(),
        }
    }

    pub fn run(&mut self, step: &str) {
        let mut parts = step.split(':');
        let kind = parts.next().unwrap_or_default();
        match kind {
            "nvml" => nvml::memory(parts.next().map_or(0, |i| num(Some(i)) as u32)),
            "nvmlprocs" => nvml::processes(),
            "hold" => {
                println!("holding pid={}", std::process::id());
                std::io::stdout().flush().ok();
                loop {
                    // SAFETY: no arguments.
                    unsafe { libc::pause() };
                }
            }
            "wait" => {
                let path = step.split_once(':').map_or("", |(_, p)| p);
                let start = Instant::now();
                while !std::path::Path::new(path).exists() {
                    if start.elapsed() > Duration::from_secs(60) {
                        fail(&format!("{path} did not appear in 60 s"));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                println!("{step}");
            }
            "sentbus" => sent_sigbus(step),
            "closefds" => {
                for fd in 3..1024 {
                    // SAFETY: closing descriptors this program does not use.
                    unsafe { libc::close(fd) };
                }
                println!("closefds");
            }
            _ => {
                let api = self.api.get_or_insert_with(|| {
                    let api = load(&self.via, self.ptsz);
                    println!("context {}", context(&api));
                    api
                });
                // SAFETY: every call passes valid out-pointers to documented
                // functions, and handles the driver gave (or 0, which it refuses).
                unsafe { cuda(api, &mut self.made, step, kind, parts) };
            }
        }
    }
}

/// The 32-bit-era entry points (`v1alloc:MIB`, `v1pitch:W:H`, `v1free:I`),
/// which the driver must have.
///
/// # Safety
/// As for `cuda`.
unsafe fn legacy<'a>(
    api: &Api,
    made: &mut Index,
    step: &str,
    kind: &str,
    mut next: impl FnMut() -> Option<&'a str>,
) {
    let missing = || -> ! { fail(&format!("{step}: the driver has no 32-bit-era entry point")) };
    let mut p: c_uint = 0;
    // SAFETY: the caller's guarantee: functions of the documented v1 ABI,
    // out-parameters on this stack, pointers the driver returned earlier.
    unsafe {
        match kind {
            "v1alloc" => {
                let bytes = (num(next()) * MIB) as c_uint;
                let r = api.alloc_v1.unwrap_or_else(|| missing())(&mut p, bytes);
                made.push(step, r, Made::of(p.into()));
            }
            "v1pitch" => {
                let (w, h) = (num(next()) as c_uint, num(next()) as c_uint);
                let mut pitch: c_uint = 0;
                let r = api.pitch_v1.unwrap_or_else(|| missing())(&mut p, &mut pitch, w, h, 4);
                println!("{step} {r} #{} pitch={pitch}", made.0.len());
                made.0.push(Made::of(if r == 0 { p.into() } else { 0 }));
            }
            _ => {
                let p = made.get(next()).value as c_uint;
                let r = api.free_v1.unwrap_or_else(|| missing())(p);
                println!("{step} {r}");
            }
        }
    }
}

/// The steps that need the driver (loaded, with `context R` printed, at the
/// first of them).
unsafe fn cuda<'a>(
    api: &Api,
    made: &mut Index,
    step: &str,
    kind: &str,
    mut parts: impl Iterator<Item = &'a str>,
) {
    let null = std::ptr::null_mut::<c_void>();
    let mut next = || parts.next();
    // SAFETY: every call goes through a driver function the loader resolved
    // by name with its documented signature, with out-parameters that live
    // on this stack and handles the driver itself returned earlier (the
    // index list); a test that passes a bad index gets the driver's answer.
    unsafe {
        match kind {
            "alloc" | "allocb" | "async" | "pool" | "managed" => {
                let n = num(next());
                let bytes = if kind == "allocb" { n } else { n * MIB } as usize;
                let mut p = 0u64;
                let r = match kind {
                    "async" => (api.alloc_async)(&mut p, bytes, null),
                    "pool" => {
                        let mut pool = null;
                        match (api.default_pool)(&mut pool, 0) {
                            0 => (api.alloc_pool)(&mut p, bytes, pool, null),
                            r => r,
                        }
                    }
                    "managed" => (api.managed)(&mut p, bytes, 1),
                    _ => (api.mem_alloc)(&mut p, bytes),
                };
                made.push(step, r, Made::of(p));
            }
            "v1alloc" | "v1pitch" | "v1free" => legacy(api, made, step, kind, &mut next),
            "pitch" => {
                let (w, h) = (num(next()) as usize, num(next()) as usize);
                let mut p = 0u64;
                let mut pitch = 0usize;
                let r = (api.pitch)(&mut p, &mut pitch, w, h, 4);
                println!("{step} {r} #{} pitch={pitch}", made.0.len());
                made.0.push(Made::of(if r == 0 { p } else { 0 }));
            }
            "create" | "createhost" => {
                let bytes = num(next()) * MIB;
                let prop = Prop {
                    type_: 1,
                    // Exportable, for `import`.
                    handle_types: POSIX_FD,
                    location_type: if kind == "create" { LOCATION_DEVICE } else { 2 },
                    location_id: 0,
                    win32: null,
                    flags: [0; 8],
                };
                let mut h = 0u64;
                let r = (api.create)(&mut h, bytes as usize, &prop, 0);
                made.push(
                    step,
                    r,
                    Made {
                        value: h,
                        size: bytes,
                    },
                );
            }
            "free" | "freeasync" | "release" => {
                let p = made.get(next()).value;
                let r = match kind {
                    "freeasync" => (api.free_async)(p, null),
                    "release" => (api.release)(p),
                    _ => (api.mem_free)(p),
                };
                println!("{step} {r}");
            }
            "info" => {
                let (mut free, mut total) = (0usize, 0usize);
                let r = (api.get_info)(&mut free, &mut total);
                println!("info {r} free={free} total={total}");
            }
            "total" => {
                let mut total = 0usize;
                let r = (api.total_mem)(&mut total, 0);
                println!("total {r} bytes={total}");
            }
            "ctx" => {
                let r = context_on(api, num(next()) as c_int);
                println!("{step} {r}");
            }
            "ctxcreate" => {
                let mut ctx = null;
                let r = (api.ctx_create)(&mut ctx, 0, num(next()) as c_int);
                if r != 0 && !ctx.is_null() {
                    println!("{step} failed but left a context");
                }
                made.push(step, r, Made::of(ctx as u64));
            }
            "setctx" | "ctxdestroy" => {
                let ctx = made.get(next()).value as *mut c_void;
                let r = match kind {
                    "setctx" => (api.set_current)(ctx),
                    _ => (api.ctx_destroy)(ctx),
                };
                println!("{step} {r}");
            }
            "ctxrelease" | "ctxreset" => {
                let dev = num(next()) as c_int;
                let r = match kind {
                    "ctxrelease" => (api.primary_release)(dev),
                    _ => (api.primary_reset)(dev),
                };
                println!("{step} {r}");
            }
            "map" | "map2" => {
                let handles = match kind {
                    "map" => vec![made.get(next())],
                    _ => vec![made.get(next()), made.get(next())],
                };
                let size: u64 = handles.iter().map(|h| h.size).sum();
                let mut va = 0u64;
                let mut r = (api.reserve)(&mut va, size as usize, 0, 0, 0);
                let mut offset = 0;
                for h in &handles {
                    if r == 0 {
                        r = (api.map)(va + offset, h.size as usize, 0, h.value, 0);
                    }
                    offset += h.size;
                }
                if r == 0 {
                    let access = AccessDesc {
                        location_type: LOCATION_DEVICE,
                        location_id: 0,
                        flags: ACCESS_READ_WRITE,
                    };
                    r = (api.set_access)(va, size as usize, &access, 1);
                }
                made.push(step, r, Made { value: va, size });
            }
            "unmap" => {
                let range = made.get(next());
                let r = first_error(&[
                    (api.unmap)(range.value, range.size as usize),
                    (api.address_free)(range.value, range.size as usize),
                ]);
                println!("{step} {r}");
            }
            "retainh" => {
                let range = made.get(next());
                let mut h = 0u64;
                let r = (api.retain_handle)(&mut h, range.value as *mut c_void);
                let size = made.handle_size(h);
                made.push(step, r, Made { value: h, size });
            }
            "import" => {
                let handle = made.get(next());
                let mut fd: c_int = -1;
                let mut h = 0u64;
                let mut r = (api.export)((&raw mut fd).cast(), handle.value, POSIX_FD, 0);
                if r == 0 {
                    r = (api.import)(&mut h, fd as isize as *mut c_void, POSIX_FD);
                }
                made.push(
                    step,
                    r,
                    Made {
                        value: h,
                        size: handle.size,
                    },
                );
            }
            "array" => {
                let desc = ArrayDesc {
                    width: num(next()) as usize,
                    height: num(next()) as usize,
                    format: number(next()) as c_int,
                    channels: num(next()) as u32,
                };
                let mut a = null;
                let r = (api.array_create)(&mut a, &desc);
                made.push(step, r, Made::of(a as u64));
            }
            "array3d" | "mipmap" => {
                let desc = Array3dDesc {
                    width: num(next()) as usize,
                    height: num(next()) as usize,
                    depth: num(next()) as usize,
                    format: number(next()) as c_int,
                    channels: num(next()) as u32,
                    flags: if kind == "array3d" {
                        number(next()) as u32
                    } else {
                        0
                    },
                };
                let mut a = null;
                let r = match kind {
                    "array3d" => (api.array3d_create)(&mut a, &desc),
                    _ => (api.mipmap_create)(&mut a, &desc, num(next()) as u32),
                };
                made.push(step, r, Made::of(a as u64));
            }
            "adestroy" | "mdestroy" => {
                let a = made.get(next()).value as *mut c_void;
                let r = match kind {
                    "adestroy" => (api.array_destroy)(a),
                    _ => (api.mipmap_destroy)(a),
                };
                println!("{step} {r}");
            }
            "defpool" | "poolcreate" => {
                let dev = num(next()) as c_int;
                let mut pool = null;
                let r = match kind {
                    "defpool" => (api.default_pool)(&mut pool, dev),
                    _ => {
                        let props = PoolProps {
                            alloc_type: 1,
                            handle_types: 0,
                            location_type: LOCATION_DEVICE,
                            location_id: dev,
                            win32: null,
                            max_size: 0,
                            usage: 0,
                            reserved: [0; 54],
                        };
                        (api.pool_create)(&mut pool, &props)
                    }
                };
                made.push(step, r, Made::of(pool as u64));
            }
            "poolof" | "defpoolof" | "curpoolof" => {
                let (alloc_type, location_type) = (pool_type(next()), location_type(next()));
                let id = num(next()) as c_int;
                let mut pool = null;
                let r = match kind {
                    "poolof" => {
                        let props = PoolProps {
                            alloc_type,
                            handle_types: 0,
                            location_type,
                            location_id: id,
                            win32: null,
                            max_size: 0,
                            usage: 0,
                            reserved: [0; 54],
                        };
                        (api.pool_create)(&mut pool, &props)
                    }
                    _ => {
                        let getter = if kind == "defpoolof" {
                            api.location_pool
                        } else {
                            api.current_pool
                        };
                        let getter =
                            getter.unwrap_or_else(|| fail(&format!("the driver has no {kind}")));
                        getter(&mut pool, &Location { location_type, id }, alloc_type)
                    }
                };
                made.push(step, r, Made::of(pool as u64));
            }
            "limit" => {
                let limit = num(next()) as c_int;
                let r = (api.set_limit)(limit, num(next()) as usize);
                let mut value = 0usize;
                let got = (api.get_limit)(&mut value, limit);
                println!("{step} {r} now={value} ({got})");
            }
            "launch" => {
                // The fake driver's convention: the function handle is the
                // stack the kernel needs. Never on a real driver.
                let stack = num(next()) as usize as *mut c_void;
                let r = (api.launch)(stack, 1, 1, 1, 1, 1, 1, 0, null, null as _, null as _);
                println!("{step} {r}");
            }
            "stream" => {
                let mut stream = null;
                let r = (api.stream_create)(&mut stream, 0);
                made.push(step, r, Made::of(stream as u64));
            }
            "asyncon" => {
                let stream = made.get(next()).value as *mut c_void;
                let bytes = (num(next()) * MIB) as usize;
                let mut p = 0u64;
                let r = (api.alloc_async)(&mut p, bytes, stream);
                made.push(step, r, Made::of(p));
            }
            "poolalloc" => {
                let pool = made.get(next()).value as *mut c_void;
                let bytes = (num(next()) * MIB) as usize;
                let stream = next().map_or(null, |s| made.get(Some(s)).value as *mut c_void);
                let mut p = 0u64;
                let r = (api.alloc_pool)(&mut p, bytes, pool, stream);
                made.push(step, r, Made::of(p));
            }
            "forkalloc" => {
                // A child allocates and exits without freeing; its charge
                // must be its own, not its parent's.
                let bytes = (num(next()) * MIB) as usize;
                std::io::stdout().flush().ok();
                let pid = libc::fork();
                if pid == 0 {
                    context(api);
                    let mut p = 0u64;
                    let r = (api.mem_alloc)(&mut p, bytes);
                    println!("child {step} {r}");
                    std::io::stdout().flush().ok();
                    libc::_exit(0);
                }
                let mut status = 0;
                libc::waitpid(pid, &mut status, 0);
                println!("{step} forked");
            }
            "bench" => {
                // N pairs of cuMemAlloc(1 MiB) + cuMemFree, then N
                // cuMemGetInfo, on each of T threads (default 1) at once,
                // or on the main thread (`main`).
                let n = num(next());
                let (threads, label) = match next() {
                    Some("main") => (bench::Threads::Main, "main".to_owned()),
                    t => {
                        let t = t.map_or(1, |t| num(Some(t))).max(1);
                        (bench::Threads::Spawned(t as usize), t.to_string())
                    }
                };
                let [pair, info] = bench::bench(api, n, threads);
                println!(
                    "bench threads={label} pair_ns={:.1} pair_cpu_ns={:.1} info_ns={:.1} info_cpu_ns={:.1}",
                    pair.0, pair.1, info.0, info.1
                );
            }
            "stress" => {
                let threads = num(next()) as usize;
                let iters = num(next()) as usize;
                let mib = num(next());
                let file = next().unwrap_or_else(|| fail("stress needs a counter file"));
                stress::stress(api, threads, iters, mib, file);
            }
            "forkstorm" => {
                let (n, threads, mib) = (num(next()), num(next()), num(next()));
                stress::forkstorm(api, n, threads as usize, mib);
            }
            "race" => {
                let threads = num(next()) as usize;
                let rounds = num(next()) as usize;
                let mib = num(next());
                let file = next().unwrap_or_else(|| fail("race needs a file"));
                let parties = num(next());
                stress::race(api, threads, rounds, mib, file, parties);
            }
            _ => fail(&format!("unknown step {step}")),
        }
    }
}

/// Sends this process a SIGBUS as another process could with sigqueue(3),
/// its bytes where a fault's address goes naming the start of the first
/// accounting file mapped here; prints `sentbus survived R` if the process
/// lives on.
fn sent_sigbus(step: &str) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let start = maps
        .lines()
        .find(|l| l.ends_with("/accounting"))
        .and_then(|l| l.split('-').next())
        .and_then(|a| u64::from_str_radix(a, 16).ok())
        .unwrap_or_else(|| fail("no accounting file is mapped"));
    // SAFETY: a zeroed siginfo is valid.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    info.si_signo = libc::SIGBUS;
    info.si_code = libc::SI_QUEUE;
    // SAFETY: the fault address is the first field of the siginfo's union,
    // 16 bytes in on every 64-bit Linux; setrlimit with a valid struct.
    unsafe {
        (&raw mut info)
            .cast::<u8>()
            .add(16)
            .cast::<u64>()
            .write_unaligned(start);
        // No core file from a test.
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
    }
    // SAFETY: rt_sigqueueinfo(pid, signal, info) to this process, with
    // si_code < 0 as the kernel requires of a sender.
    let r = unsafe {
        libc::syscall(
            libc::SYS_rt_sigqueueinfo,
            libc::getpid(),
            libc::SIGBUS,
            &raw const info,
        )
    };
    println!("{step} survived {r}");
}
