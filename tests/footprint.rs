//! A container is held to its whole footprint as the driver counts it:
//! contexts from the moment they are made, the driver's 2 MiB chunks, VMM
//! memory for as long as it is mapped, arrays, pools on their own device.
//! Each test runs the shim in real processes against the fake driver, which
//! takes memory the way an H100 did in docs/GPU_VERIFICATION.md, and where it matters reads the
//! footprint from outside, as nvidia-smi would.

mod common;

use std::process::Stdio;

use common::{
    capped_dir, field, nth, probe, run_lines, shim_kit, FAKE_CONTEXT as CONTEXT, MIB, T4_UUID,
};

const CAP: u64 = 4308 * MIB;

/// Compiles the C program `source` (with pthreads) and runs it under the
/// shim, capped at 4308 MiB, on the fake driver set by `fake` (its
/// `FAKEGPU_*` knobs); returns its output lines once it exited cleanly.
fn run_c_capped(source: &str, fake: (&str, &str)) -> Vec<String> {
    let kit = shim_kit();
    let dir = capped_dir(4308);
    let build = tempfile::tempdir().unwrap();
    let program = common::compile_c(source, build.path());
    let (ok, lines, stderr) = run_lines(
        std::process::Command::new(&program)
            .env("LD_LIBRARY_PATH", &kit.driver_dir)
            .env("LD_PRELOAD", &kit.shim)
            .env("GPUMEM_STATE_DIR", dir.path())
            .env(fake.0, fake.1),
    );
    assert!(ok, "{stderr}");
    lines
}

/// The probe under the shim with `steps`, on two fake GPUs each capped at
/// 4308 MiB in one file; asserts it exits cleanly.
fn probe_two_gpus(steps: &[&str]) -> Vec<String> {
    probe_two_gpus_with(&[], steps)
}

/// `probe_two_gpus` with the fake driver's knobs in `fake`.
fn probe_two_gpus_with(fake: &[(&str, &str)], steps: &[&str]) -> Vec<String> {
    const SECOND: &str = "GPU-1a2b3c4d-0000-4000-8000-000000010000";
    let dir = tempfile::tempdir().unwrap();
    gpumem::isolation::accounting::prepare(
        dir.path(),
        &[T4_UUID, SECOND].map(|uuid| gpumem::isolation::accounting::Cap {
            uuid: uuid.into(),
            cap_mib: 4308,
            context_charge_mib: 0,
        }),
    )
    .unwrap();
    let (ok, lines, stderr) = run_lines(
        shim_kit()
            .probe(Some(dir.path()))
            .env("FAKEGPU_UUIDS", format!("{T4_UUID},{SECOND}"))
            .envs(fake.iter().copied())
            .args(steps),
    );
    assert!(ok, "{stderr}");
    lines
}

fn free_at(lines: &[String], n: usize) -> u64 {
    field(nth(lines, "info 0", n), "free")
}

/// Asserts that the probe printed each of `expected` as a whole line;
/// `context` says which run of the test it was.
fn assert_printed(lines: &[String], expected: &[&str], context: impl std::fmt::Display) {
    for expected in expected {
        assert!(
            lines.iter().any(|line| line == expected),
            "{context} {expected}: {lines:?}"
        );
    }
}

/// A context that does not fit is destroyed and refused, and the caller
/// is not handed the destroyed one: cleaning up what it got back would
/// destroy it twice.
#[test]
fn a_context_past_the_cap_is_refused_and_not_handed_back() {
    let dir = capped_dir(200);
    let lines = probe(dir.path(), &["ctxcreate:0"]);
    assert!(lines.contains(&"ctxcreate:0 2 #0".to_owned()), "{lines:?}");
    assert!(
        !lines.iter().any(|l| l.contains("left a context")),
        "{lines:?}"
    );
}

#[test]
fn a_context_is_charged_what_the_driver_took_when_it_is_made() {
    let dir = capped_dir(4308);
    let lines = probe(dir.path(), &["info", "nvml", "alloc:4008", "allocb:1"]);
    assert_eq!(free_at(&lines, 0), CAP - CONTEXT, "before any allocation");
    assert_eq!(field(nth(&lines, "nvml 0", 0), "used"), CONTEXT);
    assert!(lines.contains(&"alloc:4008 0 #0".into()), "{lines:?}");
    assert!(lines.contains(&"allocb:1 2 #1".into()), "{lines:?}");
}

#[test]
fn a_process_that_fills_at_once_is_held_to_the_cap_from_outside() {
    let dir = capped_dir(4308);
    let node = tempfile::tempdir().unwrap();
    let node_file = node.path().join("node");
    // Fill in 256 MiB steps right after the context, as PyTorch does.
    let mut steps: Vec<String> = (0..20).map(|_| "alloc:256".to_owned()).collect();
    steps.push("hold".into());
    let mut filler = shim_kit()
        .probe(Some(dir.path()))
        .env("FAKEGPU_NODE_FILE", &node_file)
        .args(&steps)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = common::wait_for_line(&mut filler, "holding");
    let granted = seen.lines().filter(|l| l.contains(" 0 #")).count() as u64;
    assert_eq!(granted, (4308 - 300) / 256, "{seen}");

    // What the driver shows from outside (no shim), as nvidia-smi would.
    let (ok, lines, stderr) = run_lines(
        shim_kit()
            .probe(None)
            .env("FAKEGPU_NODE_FILE", &node_file)
            .arg("nvmlprocs"),
    );
    assert!(ok, "{stderr}");
    let outside = field(nth(&lines, "procs dev=0", 0), "sum");
    assert_eq!(outside, CONTEXT + granted * 256 * MIB);
    assert!(outside <= CAP, "{outside} > {CAP}");
    filler.kill().unwrap();
    filler.wait().unwrap();
}

#[test]
fn destroying_a_context_gives_back_it_and_its_allocations() {
    let dir = capped_dir(4308);
    let lines = probe(
        dir.path(),
        &[
            "alloc:1000",
            "ctxcreate:0",
            "alloc:1000",
            "info",
            "ctxdestroy:1",
            "ctx:0",
            "info",
            // The primary context, retained twice, released twice: it goes
            // with its 1000 MiB; retaining it again makes a new one.
            "ctxrelease:0",
            "ctxrelease:0",
            "ctx:0",
            "info",
        ],
    );
    assert_eq!(free_at(&lines, 0), CAP - 2 * CONTEXT - 2000 * MIB);
    assert_eq!(free_at(&lines, 1), CAP - CONTEXT - 1000 * MIB);
    assert_eq!(free_at(&lines, 2), CAP - CONTEXT);
}

/// A thread retains the primary context while another releases the last
/// reference to it. The retain looked and found it live (so it charges
/// nothing); the release must not destroy it under that look, or the
/// retain makes a new context nothing charges.
#[test]
fn a_release_racing_a_retain_leaves_the_context_charged() {
    let lines = run_c_capped(
        r##"#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
typedef int (*fn)();
static fn retain;
static void *theirs;
static void *retain_too(void *unused) { retain(&theirs, 0); return unused; }
int main(void) {
    if (!dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL)) return 10;
    ((fn)dlsym(RTLD_DEFAULT, "cuInit"))(0);
    retain = (fn)dlsym(RTLD_DEFAULT, "cuDevicePrimaryCtxRetain");
    fn release = (fn)dlsym(RTLD_DEFAULT, "cuDevicePrimaryCtxRelease_v2");
    void *mine = 0;
    if (retain(&mine, 0)) return 11;
    pthread_t other;
    pthread_create(&other, 0, retain_too, 0);
    usleep(100000); /* the other retain has looked, and waits for its answer */
    printf("release %d\n", release(0));
    pthread_join(other, 0);
    ((fn)dlsym(RTLD_DEFAULT, "cuCtxSetCurrent"))(theirs);
    size_t free = 0, total = 0;
    int info = ((fn)dlsym(RTLD_DEFAULT, "cuMemGetInfo_v2"))(&free, &total);
    printf("info %d free %zu\n", info, free >> 20);
    return 0;
}
"##,
        ("FAKEGPU_GET_STATE_DELAY_MS", "300"),
    );
    assert_eq!(
        lines,
        [
            "release 0",
            &format!("info 0 free {}", (CAP - CONTEXT) >> 20)
        ]
    );
}

/// Another thread of the process frees 1000 MiB while a context is made:
/// the driver's figure for the process drops by that less the context, and
/// so do its charges; the context is charged what it took, not nothing.
#[test]
fn a_free_while_a_context_is_made_does_not_hide_the_context() {
    let lines = run_c_capped(
        r##"#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
typedef int (*fn)();
static unsigned long long held;
static void *free_soon(void *unused) {
    usleep(100000); /* the context is being made */
    printf("free %d\n", ((fn)dlsym(RTLD_DEFAULT, "cuMemFree_v2"))(held));
    return unused;
}
int main(void) {
    if (!dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL)) return 10;
    ((fn)dlsym(RTLD_DEFAULT, "cuInit"))(0);
    void *primary = 0, *made = 0;
    ((fn)dlsym(RTLD_DEFAULT, "cuDevicePrimaryCtxRetain"))(&primary, 0);
    ((fn)dlsym(RTLD_DEFAULT, "cuCtxSetCurrent"))(primary);
    printf("alloc %d\n", ((fn)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"))(&held, (size_t)1000 << 20));
    pthread_t other;
    pthread_create(&other, 0, free_soon, 0);
    printf("create %d\n", ((fn)dlsym(RTLD_DEFAULT, "cuCtxCreate_v2"))(&made, 0, 0));
    pthread_join(other, 0);
    size_t free = 0, total = 0;
    int info = ((fn)dlsym(RTLD_DEFAULT, "cuMemGetInfo_v2"))(&free, &total);
    printf("info %d free %zu\n", info, free >> 20);
    return 0;
}
"##,
        ("FAKEGPU_CONTEXT_DELAY_MS", "400"),
    );
    assert_eq!(
        lines,
        [
            "alloc 0",
            "free 0",
            "create 0",
            &format!("info 0 free {}", (CAP - 2 * CONTEXT) >> 20)
        ]
    );
}

#[test]
fn small_allocations_are_charged_the_chunks_the_driver_takes() {
    let dir = capped_dir(4308);
    let lines = probe(
        dir.path(),
        &[
            "info",
            "allocb:1048576",
            "info",
            "allocb:1048576",
            "info",
            "allocb:1048576",
            "info",
            "free:0",
            "info",
            "free:1",
            "free:2",
            "info",
        ],
    );
    let base = free_at(&lines, 0);
    let charged: Vec<u64> = (1..6).map(|n| (base - free_at(&lines, n)) / MIB).collect();
    // 1 MiB opens a 2 MiB chunk, the next shares it, the third opens
    // another; the chunk stays while anything is in it.
    assert_eq!(charged, [2, 2, 4, 4, 0], "{lines:?}");
}

#[test]
fn vmm_memory_stays_charged_while_it_is_mapped() {
    let dir = capped_dir(4308);
    // The documented pattern: create, map, release the handle; the mapping
    // keeps the memory. 4 × 1000 MiB fit beside the context, not 5.
    let mut steps = Vec::new();
    for i in 0..4 {
        steps.extend([
            "create:1000".to_owned(),
            format!("map:{}", 2 * i),
            format!("release:{}", 2 * i),
        ]);
    }
    // The fifth does not fit; unmapping the first frees it, and then it does.
    steps.extend(["create:1000".into(), "unmap:1".into(), "create:1000".into()]);
    let args: Vec<&str> = steps.iter().map(String::as_str).collect();
    let lines = probe(dir.path(), &args);
    let created: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("create:1000"))
        .map(|l| l.split(' ').nth(1).unwrap())
        .collect();
    assert_eq!(created, ["0", "0", "0", "0", "2", "0"], "{lines:?}");
    assert!(lines.contains(&"unmap:1 0".to_owned()), "{lines:?}");
}

#[test]
fn retained_and_imported_handles_keep_vmm_memory_charged() {
    let dir = capped_dir(4308);
    let lines = probe(
        dir.path(),
        &[
            "create:2000",
            "map:0",
            "retainh:1",
            "import:0",
            "release:0",
            "unmap:1",
            "release:2",
            // One reference (the import) is left: still charged.
            "info",
            "release:3",
            "info",
        ],
    );
    assert!(
        lines
            .iter()
            .filter(|l| l.starts_with("re") || l.starts_with("import") || l.starts_with("unmap"))
            .all(|l| l.split(' ').nth(1) == Some("0")),
        "{lines:?}"
    );
    assert_eq!(free_at(&lines, 0), CAP - CONTEXT - 2000 * MIB);
    assert_eq!(free_at(&lines, 1), CAP - CONTEXT);
}

#[test]
fn arrays_are_charged_until_destroyed() {
    let dir = capped_dir(4308);
    // 8192 × 8192 float4: 1 GiB each; three fit beside the context.
    let lines = probe(
        dir.path(),
        &[
            "array:8192:8192:0x20:4",
            "array:8192:8192:0x20:4",
            "array:8192:8192:0x20:4",
            "array:8192:8192:0x20:4",
            "adestroy:0",
            "array:8192:8192:0x20:4",
            "info",
            "mipmap:4096:4096:0:0x20:4:13",
            "info",
            "mdestroy:5",
            "info",
        ],
    );
    let results: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("array:"))
        .map(|l| l.split(' ').nth(1).unwrap())
        .collect();
    assert_eq!(results, ["0", "0", "0", "2", "0"], "{lines:?}");
    assert_eq!(free_at(&lines, 0), CAP - CONTEXT - 3 * 1024 * MIB);
    // What an H100 took for a 4096² float4 chain of 13 levels (docs/GPU_VERIFICATION.md).
    assert_eq!(free_at(&lines, 0) - free_at(&lines, 1), 342 * MIB);
    assert_eq!(free_at(&lines, 2), free_at(&lines, 0));
}

/// Stream-ordered memory belongs to no context (cuCtxDestroy "will not
/// destroy memory allocations by cuMemCreate(), cuMemAllocAsync() and
/// cuMemAllocFromPoolAsync()"): tearing down the context current when it
/// was made leaves it allocated, and charged, until it is freed.
#[test]
fn stream_ordered_memory_outlives_the_context_it_was_made_in() {
    let lines = probe_two_gpus(&[
        "ctx:1",
        "ctx:0",
        // Device 1's pool, from device 0's primary context.
        "poolcreate:1",
        "poolalloc:0:3000",
        // Device 0's default pool, from a context of its own.
        "ctxcreate:0",
        "async:1000",
        "ctxdestroy:2",
        "ctxrelease:0",
        "ctx:1",
        "info",
        "ctx:0",
        "info",
        "freeasync:3",
        "info",
    ]);
    assert!(lines.contains(&"async:1000 0 #3".to_owned()), "{lines:?}");
    assert_eq!(free_at(&lines, 0), CAP - CONTEXT - 3000 * MIB, "device 1");
    assert_eq!(free_at(&lines, 1), CAP - CONTEXT - 1000 * MIB, "device 0");
    assert_eq!(free_at(&lines, 2), CAP - CONTEXT, "device 0, freed");
}

#[test]
fn pool_allocations_are_charged_on_the_pools_device() {
    let lines = probe_two_gpus(&[
        "ctx:1",
        "ctx:0",
        "poolcreate:1",
        "poolalloc:0:3000",
        "poolalloc:0:1100",
        "info",
        "ctx:1",
        "info",
    ]);
    // The current context is on device 0; the pool's memory is on device 1.
    assert!(
        lines.contains(&"poolalloc:0:3000 0 #1".to_owned()),
        "{lines:?}"
    );
    assert!(
        lines.contains(&"poolalloc:0:1100 2 #2".to_owned()),
        "{lines:?}"
    );
    assert_eq!(free_at(&lines, 0), CAP - CONTEXT);
    assert_eq!(free_at(&lines, 1), CAP - CONTEXT - 3000 * MIB);
}

/// cuMemAllocAsync takes from "the memory pool of the device associated
/// with the stream": a stream of device 1 used while device 0's context is
/// current puts the memory on device 1, and is charged there; learnt from
/// `cuStreamGetDevice`, and on drivers without it (before CUDA 12.8) from
/// the stream's context.
#[test]
fn stream_ordered_memory_is_charged_on_the_streams_device() {
    for fake in [&[][..], &[("FAKEGPU_NO_STREAM_GET_DEVICE", "1")]] {
        stream_on_device_1(fake);
    }
}

fn stream_on_device_1(fake: &[(&str, &str)]) {
    let lines = probe_two_gpus_with(
        fake,
        &[
            "ctx:1",
            "stream",
            "ctx:0",
            "asyncon:0:3000",
            "asyncon:0:1100",
            "async:1000",
            "info",
            "ctx:1",
            "info",
            "freeasync:1",
            "info",
        ],
    );
    assert_printed(
        &lines,
        &[
            "stream 0 #0",
            "asyncon:0:3000 0 #1",
            "asyncon:0:1100 2 #2",
            "async:1000 0 #3",
        ],
        format_args!("{fake:?}"),
    );
    assert_eq!(
        free_at(&lines, 0),
        CAP - CONTEXT - 1000 * MIB,
        "{fake:?}: device 0"
    );
    assert_eq!(
        free_at(&lines, 1),
        CAP - CONTEXT - 3000 * MIB,
        "{fake:?}: device 1"
    );
    assert_eq!(
        free_at(&lines, 2),
        CAP - CONTEXT,
        "{fake:?}: device 1, freed"
    );
}

/// CUDA 13 hands out pools by location and allocation type: a device
/// pool is charged on its device, a pinned host pool nowhere, and managed
/// pools that prefer no device (or the host) in full on the current
/// context's device, as cuMemAllocManaged is. Through dlsym and through
/// cuGetProcAddress as a CUDA 13 runtime asks.
#[test]
fn cuda_13_pools_are_charged_where_their_memory_goes() {
    for via in ["dlsym", "gpa"] {
        let lines = probe_two_gpus(&[
            "--via",
            via,
            "ctx:1",
            "ctx:0",
            "defpoolof:pinned:device:1",
            "poolalloc:0:3000",
            "poolalloc:0:1100",
            "defpoolof:pinned:host:0",
            "poolalloc:3:3000",
            "curpoolof:managed:none:0",
            "poolalloc:5:1000",
            "poolof:managed:none:0",
            "poolalloc:7:2000",
            "poolof:managed:host:0",
            "poolalloc:9:1100",
            "info",
            "ctx:1",
            "info",
        ]);
        assert_printed(
            &lines,
            &[
                "poolalloc:0:3000 0 #1",
                "poolalloc:0:1100 2 #2",
                "poolalloc:3:3000 0 #4",
                "poolalloc:5:1000 0 #6",
                "poolalloc:7:2000 0 #8",
                "poolalloc:9:1100 2 #10",
            ],
            via,
        );
        assert_eq!(
            free_at(&lines, 0),
            CAP - CONTEXT - 3000 * MIB,
            "{via}: device 0"
        );
        assert_eq!(
            free_at(&lines, 1),
            CAP - CONTEXT - 3000 * MIB,
            "{via}: device 1"
        );
    }
}

/// A larger per-thread stack (`cuCtxSetLimit(CU_LIMIT_STACK_SIZE)`) is
/// device memory the context reserves for every resident thread at once:
/// charged to the context when set, refused and set back when it does not
/// fit, given back when the stack shrinks and with the context.
#[test]
fn a_larger_stack_is_charged_to_its_context() {
    // The fake reserves a stack for 65536 threads: 16 KiB costs 960 MiB
    // more than the default 1 KiB, 64 KiB 4032 MiB, 8 KiB 448 MiB.
    for via in ["dlsym", "gpa"] {
        let dir = capped_dir(4308);
        let lines = probe(
            dir.path(),
            &[
                "--via",
                via,
                "limit:0:16384",
                "info",
                "alloc:3100",
                "limit:0:65536",
                "info",
                "limit:0:1024",
                "info",
                "limit:0:8192",
                "info",
                "ctxrelease:0",
                "ctx:0",
                "info",
            ],
        );
        assert_printed(
            &lines,
            &[
                "limit:0:16384 0 now=16384 (0)",
                "alloc:3100 2 #0",
                "limit:0:65536 2 now=16384 (0)",
                "limit:0:1024 0 now=1024 (0)",
                "limit:0:8192 0 now=8192 (0)",
            ],
            via,
        );
        assert_eq!(free_at(&lines, 0), CAP - CONTEXT - 960 * MIB, "{via}");
        assert_eq!(
            free_at(&lines, 1),
            CAP - CONTEXT - 960 * MIB,
            "{via}: refused, set back"
        );
        assert_eq!(free_at(&lines, 2), CAP - CONTEXT, "{via}: shrunk");
        assert_eq!(free_at(&lines, 3), CAP - CONTEXT - 448 * MIB, "{via}");
        assert_eq!(
            free_at(&lines, 4),
            CAP - CONTEXT,
            "{via}: a new primary context"
        );
    }
}

/// The driver also grows the stack by itself, at a launch that needs more
/// ("isn't reset back to the original value after each launch"); that
/// growth is not charged (reconciliation finds it), so a shrink that frees
/// it must not give back the context's own charge.
#[test]
fn a_stack_shrink_gives_back_only_what_was_charged_for_it() {
    let dir = capped_dir(4308);
    let lines = probe(
        dir.path(),
        &[
            // A kernel needing 8 KiB of stack: 448 MiB more, taken by the driver.
            "launch:8192",
            "info",
            "limit:0:1024",
            "info",
            "limit:0:4096",
            "info",
            "limit:0:1024",
            "info",
        ],
    );
    assert_printed(
        &lines,
        &[
            "launch:8192 0",
            "limit:0:1024 0 now=1024 (0)",
            "limit:0:4096 0 now=4096 (0)",
        ],
        "",
    );
    assert_eq!(
        free_at(&lines, 0),
        CAP - CONTEXT,
        "the launch's growth is not seen"
    );
    assert_eq!(
        free_at(&lines, 1),
        CAP - CONTEXT,
        "the context stays charged"
    );
    assert_eq!(
        free_at(&lines, 2),
        CAP - CONTEXT - 192 * MIB,
        "4 KiB charged"
    );
    assert_eq!(free_at(&lines, 3), CAP - CONTEXT, "and given back");
}

/// Managed memory from a pool that prefers no device is charged where it
/// is asked for: on the stream's device.
#[test]
fn a_managed_pool_is_charged_on_the_streams_device() {
    let lines = probe_two_gpus(&[
        "ctx:1",
        "stream",
        "ctx:0",
        "curpoolof:managed:none:0",
        "poolalloc:1:3000:0",
        "poolalloc:1:1100:0",
        "info",
        "ctx:1",
        "info",
    ]);
    assert_printed(
        &lines,
        &["poolalloc:1:3000:0 0 #2", "poolalloc:1:1100:0 2 #3"],
        "",
    );
    assert_eq!(free_at(&lines, 0), CAP - CONTEXT, "device 0");
    assert_eq!(free_at(&lines, 1), CAP - CONTEXT - 3000 * MIB, "device 1");
}

/// Only limits that reserve memory are measured, and only when they
/// change: the rest pass straight through (the debug log names each
/// measurement).
#[test]
fn only_memory_limits_that_change_are_measured() {
    let dir = capped_dir(4308);
    let (ok, lines, stderr) = run_lines(
        shim_kit()
            .probe(Some(dir.path()))
            .env("GPUMEM_SHIM_LOG", "debug")
            .args([
                "limit:5:128",
                "limit:6:0",
                "limit:0:1024",
                "limit:0:2048",
                "limit:3:4",
            ]),
    );
    assert!(ok, "{stderr}");
    for expected in [
        "limit:5:128 0",
        "limit:0:1024 0",
        "limit:0:2048 0",
        "limit:3:4 0",
    ] {
        assert!(
            lines.iter().any(|l| l.starts_with(expected)),
            "{expected}: {lines:?}"
        );
    }
    let measured: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.split_once("limit ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split_once(" set:").map(|(limit, _)| limit))
        .collect();
    assert_eq!(measured, ["0", "3"], "{stderr}");
}
