//! gpumem-probe: a stand-in for PyTorch and nvidia-smi in tests. It loads
//! libcuda.so.1 and libnvidia-ml.so.1 with dlopen, finds functions with
//! dlsym or through cuGetProcAddress as the CUDA runtime does, and runs the
//! steps given on its command line, printing one line per step.
//!
//! Usage: gpumem-probe [--via dlsym|gpa|gpa11] [--ptsz] STEP...
//! Steps: alloc:MIB allocb:BYTES async:MIB pool:MIB managed:MIB pitch:W:H
//!        create:MIB createhost:MIB free:I release:I info total nvml hold
//!        stress:THREADS:ITERS:MIB:COUNTER_FILE bench:N forkalloc:MIB

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

type CUresult = c_int;
const MIB: u64 = 1 << 20;

struct Api {
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    mem_free: unsafe extern "C" fn(u64) -> CUresult,
    alloc_async: unsafe extern "C" fn(*mut u64, usize, *mut c_void) -> CUresult,
    alloc_pool: unsafe extern "C" fn(*mut u64, usize, *mut c_void, *mut c_void) -> CUresult,
    free_async: unsafe extern "C" fn(u64, *mut c_void) -> CUresult,
    managed: unsafe extern "C" fn(*mut u64, usize, c_uint) -> CUresult,
    pitch: unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, c_uint) -> CUresult,
    create: unsafe extern "C" fn(*mut u64, usize, *const Prop, u64) -> CUresult,
    release: unsafe extern "C" fn(u64) -> CUresult,
    get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult,
    total_mem: unsafe extern "C" fn(*mut usize, c_int) -> CUresult,
    retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CUresult,
    set_current: unsafe extern "C" fn(*mut c_void) -> CUresult,
}

#[repr(C)]
struct Prop {
    type_: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}

#[repr(C)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
struct NvmlMemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

fn fail(message: &str) -> ! {
    eprintln!("gpumem-probe: {message}");
    std::process::exit(100);
}

fn open(name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap();
    // SAFETY: valid C string.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a C string after a failed dlopen.
        let why = unsafe { CStr::from_ptr(libc::dlerror()) };
        fail(&format!("dlopen {name}: {}", why.to_string_lossy()));
    }
    handle
}

fn sym(handle: *mut c_void, name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap();
    // SAFETY: valid handle and C string; goes through whatever dlsym is bound.
    let f = unsafe { libc::dlsym(handle, c.as_ptr()) };
    if f.is_null() {
        fail(&format!("dlsym {name} not found"));
    }
    f
}

unsafe fn cast<F: Copy>(p: *mut c_void) -> F {
    // SAFETY: the caller names the function type of the symbol.
    unsafe { std::mem::transmute_copy(&p) }
}

type Gpa5 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;
type Gpa4 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;

enum Resolver {
    Dlsym(*mut c_void),
    Gpa5(Gpa5, u64),
    Gpa4(Gpa4, u64),
}

impl Resolver {
    /// `base` is the cuGetProcAddress name, `exported` the exact symbol.
    fn get(&self, base: &str, exported: &str) -> *mut c_void {
        match self {
            Resolver::Dlsym(h) => sym(*h, exported),
            Resolver::Gpa5(gpa, flags) => {
                let c = CString::new(base).unwrap();
                let mut f = std::ptr::null_mut();
                let mut status = -1;
                // SAFETY: cuGetProcAddress_v2 contract.
                let r = unsafe { gpa(c.as_ptr(), &mut f, 12080, *flags, &mut status) };
                if r != 0 || f.is_null() || status != 0 {
                    fail(&format!("cuGetProcAddress_v2 {base}: {r} status {status}"));
                }
                f
            }
            Resolver::Gpa4(gpa, flags) => {
                let c = CString::new(base).unwrap();
                let mut f = std::ptr::null_mut();
                // SAFETY: cuGetProcAddress contract.
                let r = unsafe { gpa(c.as_ptr(), &mut f, 11080, *flags) };
                if r != 0 || f.is_null() {
                    fail(&format!("cuGetProcAddress {base}: {r}"));
                }
                f
            }
        }
    }
}

fn load(via: &str, ptsz: bool) -> Api {
    let cuda = open("libcuda.so.1");
    // SAFETY: cuInit(unsigned int)'s signature. The real driver refuses
    // everything before it; its result shows in the context line.
    unsafe {
        let init: unsafe extern "C" fn(c_uint) -> CUresult = cast(sym(cuda, "cuInit"));
        init(0);
    }
    let flags = if ptsz { 2 } else { 0 };
    let resolver = match via {
        "dlsym" => Resolver::Dlsym(cuda),
        // The CUDA 12 runtime: cuGetProcAddress_v2 through dlsym, then the
        // driver's own answer for "cuGetProcAddress", then everything else.
        "gpa" => {
            // SAFETY: cuGetProcAddress_v2's signature.
            let bootstrap: Gpa5 = unsafe { cast(sym(cuda, "cuGetProcAddress_v2")) };
            let first = Resolver::Gpa5(bootstrap, 0);
            // SAFETY: for version 12080 the driver returns the 5-argument form.
            let gpa: Gpa5 = unsafe { cast(first.get("cuGetProcAddress", "cuGetProcAddress_v2")) };
            Resolver::Gpa5(gpa, flags)
        }
        // The CUDA 11.x runtime: the 4-argument cuGetProcAddress.
        "gpa11" => {
            // SAFETY: cuGetProcAddress's signature.
            let bootstrap: Gpa4 = unsafe { cast(sym(cuda, "cuGetProcAddress")) };
            let first = Resolver::Gpa4(bootstrap, 0);
            // SAFETY: for version 11080 the driver returns the 4-argument form.
            let gpa: Gpa4 = unsafe { cast(first.get("cuGetProcAddress", "cuGetProcAddress")) };
            Resolver::Gpa4(gpa, flags)
        }
        other => fail(&format!("unknown --via {other}")),
    };
    let suffix = if ptsz { "_ptsz" } else { "" };
    // SAFETY: each symbol is cast to its documented signature.
    unsafe {
        Api {
            mem_alloc: cast(resolver.get("cuMemAlloc", "cuMemAlloc_v2")),
            mem_free: cast(resolver.get("cuMemFree", "cuMemFree_v2")),
            alloc_async: cast(resolver.get("cuMemAllocAsync", &format!("cuMemAllocAsync{suffix}"))),
            alloc_pool: cast(resolver.get(
                "cuMemAllocFromPoolAsync",
                &format!("cuMemAllocFromPoolAsync{suffix}"),
            )),
            free_async: cast(resolver.get("cuMemFreeAsync", &format!("cuMemFreeAsync{suffix}"))),
            managed: cast(resolver.get("cuMemAllocManaged", "cuMemAllocManaged")),
            pitch: cast(resolver.get("cuMemAllocPitch", "cuMemAllocPitch_v2")),
            create: cast(resolver.get("cuMemCreate", "cuMemCreate")),
            release: cast(resolver.get("cuMemRelease", "cuMemRelease")),
            get_info: cast(resolver.get("cuMemGetInfo", "cuMemGetInfo_v2")),
            total_mem: cast(resolver.get("cuDeviceTotalMem", "cuDeviceTotalMem_v2")),
            retain: cast(resolver.get("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain")),
            set_current: cast(sym(cuda, "cuCtxSetCurrent")),
        }
    }
}

fn context(api: &Api) -> CUresult {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let r = unsafe { (api.retain)(&mut ctx, 0) };
    if r == 0 {
        // SAFETY: ctx came from the driver.
        unsafe { (api.set_current)(ctx) };
    }
    r
}

fn nvml() {
    let lib = open("libnvidia-ml.so.1");
    // SAFETY: documented NVML signatures.
    unsafe {
        let init: unsafe extern "C" fn() -> c_uint = cast(sym(lib, "nvmlInit_v2"));
        let by_index: unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetHandleByIndex_v2"));
        let v1: unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetMemoryInfo"));
        let v2: unsafe extern "C" fn(*mut c_void, *mut NvmlMemoryV2) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetMemoryInfo_v2"));
        init();
        let mut dev = std::ptr::null_mut();
        by_index(0, &mut dev);
        let mut m = NvmlMemory {
            total: 0,
            free: 0,
            used: 0,
        };
        let r = v1(dev, &mut m);
        println!("nvml {r} total={} used={} free={}", m.total, m.used, m.free);
        let mut m = NvmlMemoryV2 {
            version: (std::mem::size_of::<NvmlMemoryV2>() | 2 << 24) as c_uint,
            total: 0,
            reserved: 0,
            free: 0,
            used: 0,
        };
        let r = v2(dev, &mut m);
        println!(
            "nvml2 {r} total={} reserved={} used={} free={}",
            m.total, m.reserved, m.used, m.free
        );
    }
}

/// Threads allocating and freeing `mib` at a time; a shared counter file
/// (independent of the shim) records how many allocations were ever held
/// at once across all processes using it.
fn stress(api: &Api, threads: usize, iters: usize, mib: u64, counter: &str) {
    let c = CString::new(counter).unwrap();
    // SAFETY: plain open/mmap of a 16-byte test file shared by the probes.
    let (held, most) = unsafe {
        let fd = libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600);
        libc::ftruncate(fd, 16);
        let p = libc::mmap(
            std::ptr::null_mut(),
            16,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        if p == libc::MAP_FAILED {
            fail("mmap counter");
        }
        (
            &*(p as *const AtomicU64),
            &*((p as *const AtomicU64).add(1)),
        )
    };
    let ok = AtomicU64::new(0);
    let refused = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                context(api);
                for _ in 0..iters {
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

/// Per operation on each of `threads` threads running `n` pairs (then `n`
/// queries) together, averaged over the threads: wall time (latency,
/// including time spent waiting for a CPU or a lock) and the thread's CPU
/// time (cost, including cache-line transfers; the fair measure when there
/// are more threads than CPUs).
fn bench(api: &Api, n: u64, threads: usize) -> [(f64, f64); 2] {
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

fn num(s: Option<&str>) -> u64 {
    s.and_then(|v| v.parse().ok())
        .unwrap_or_else(|| fail("bad number in step"))
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut via = "dlsym".to_owned();
    let mut ptsz = false;
    while let Some(first) = args.first().cloned() {
        match first.as_str() {
            "--via" => {
                via = args
                    .get(1)
                    .cloned()
                    .unwrap_or_else(|| fail("--via needs a value"));
                args.drain(..2);
            }
            "--ptsz" => {
                ptsz = true;
                args.remove(0);
            }
            _ => break,
        }
    }
    let needs_cuda = args.iter().any(|a| a != "nvml" && a != "hold");
    let api = needs_cuda.then(|| {
        let api = load(&via, ptsz);
        println!("context {}", context(&api));
        api
    });
    let mut ptrs: Vec<u64> = Vec::new();
    for step in &args {
        let mut parts = step.split(':');
        let kind = parts.next().unwrap_or_default();
        let api = api.as_ref();
        // SAFETY: every call passes valid out-pointers to documented functions.
        unsafe {
            match (kind, api) {
                ("nvml", _) => nvml(),
                ("hold", _) => {
                    println!("holding pid={}", std::process::id());
                    std::io::stdout().flush().ok();
                    loop {
                        libc::pause();
                    }
                }
                ("alloc" | "allocb" | "async" | "pool" | "managed", Some(api)) => {
                    let n = num(parts.next());
                    let bytes = if kind == "allocb" { n } else { n * MIB } as usize;
                    let mut p = 0u64;
                    let r = match kind {
                        "async" => (api.alloc_async)(&mut p, bytes, std::ptr::null_mut()),
                        "pool" => (api.alloc_pool)(
                            &mut p,
                            bytes,
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                        ),
                        "managed" => (api.managed)(&mut p, bytes, 1),
                        _ => (api.mem_alloc)(&mut p, bytes),
                    };
                    println!("{step} {r} #{}", ptrs.len());
                    ptrs.push(if r == 0 { p } else { 0 });
                }
                ("pitch", Some(api)) => {
                    let (w, h) = (num(parts.next()) as usize, num(parts.next()) as usize);
                    let mut p = 0u64;
                    let mut pitch = 0usize;
                    let r = (api.pitch)(&mut p, &mut pitch, w, h, 4);
                    println!("{step} {r} #{} pitch={pitch}", ptrs.len());
                    ptrs.push(if r == 0 { p } else { 0 });
                }
                ("create" | "createhost", Some(api)) => {
                    let bytes = (num(parts.next()) * MIB) as usize;
                    let prop = Prop {
                        type_: 1,
                        handle_types: 0,
                        location_type: if kind == "create" { 1 } else { 2 },
                        location_id: 0,
                        win32: std::ptr::null_mut(),
                        flags: [0; 8],
                    };
                    let mut h = 0u64;
                    let r = (api.create)(&mut h, bytes, &prop, 0);
                    println!("{step} {r} #{}", ptrs.len());
                    ptrs.push(if r == 0 { h } else { 0 });
                }
                ("free" | "freeasync" | "release", Some(api)) => {
                    let i = num(parts.next()) as usize;
                    let p = ptrs.get(i).copied().unwrap_or(0);
                    let r = match kind {
                        "freeasync" => (api.free_async)(p, std::ptr::null_mut()),
                        "release" => (api.release)(p),
                        _ => (api.mem_free)(p),
                    };
                    println!("{step} {r}");
                }
                ("info", Some(api)) => {
                    let (mut free, mut total) = (0usize, 0usize);
                    let r = (api.get_info)(&mut free, &mut total);
                    println!("info {r} free={free} total={total}");
                }
                ("total", Some(api)) => {
                    let mut total = 0usize;
                    let r = (api.total_mem)(&mut total, 0);
                    println!("total {r} bytes={total}");
                }
                ("forkalloc", Some(api)) => {
                    // A child allocates and exits without freeing; its charge
                    // must be its own, not its parent's.
                    let bytes = (num(parts.next()) * MIB) as usize;
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
                ("bench", Some(api)) => {
                    // N pairs of cuMemAlloc(1 MiB) + cuMemFree, then N
                    // cuMemGetInfo, on each of T threads (default 1) at once.
                    let n = num(parts.next());
                    let threads = parts.next().map_or(1, |t| num(Some(t))).max(1);
                    let [pair, info] = bench(api, n, threads as usize);
                    println!(
                        "bench threads={threads} pair_ns={:.1} pair_cpu_ns={:.1} info_ns={:.1} info_cpu_ns={:.1}",
                        pair.0, pair.1, info.0, info.1
                    );
                }
                ("stress", Some(api)) => {
                    let threads = num(parts.next()) as usize;
                    let iters = num(parts.next()) as usize;
                    let mib = num(parts.next());
                    let file = parts
                        .next()
                        .unwrap_or_else(|| fail("stress needs a counter file"));
                    stress(api, threads, iters, mib, file);
                }
                _ => fail(&format!("unknown step {step}")),
            }
        }
        std::io::stdout().flush().ok();
    }
}
