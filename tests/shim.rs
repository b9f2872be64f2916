//! The shim loaded into real processes (the probe, /bin/true, a shell)
//! against the fake driver: what programs see and what they are refused.

mod common;

use std::process::Stdio;

use common::wait::eventually_blocking;
use common::{
    capped_dir, field, line, nth, probe, run_lines, shim_kit, FAKE_CONTEXT as CONTEXT, MIB, T4_UUID,
};

const CAP: u64 = 4308 * MIB;
const FULL: u64 = 15079 * MIB;

/// Runs `n` probes at once under the shim, each with `step`, and returns
/// their outputs once all have exited successfully.
fn together(dir: &std::path::Path, step: &str, n: usize) -> Vec<std::process::Output> {
    let children: Vec<_> = (0..n)
        .map(|_| {
            shim_kit()
                .probe(Some(dir))
                .arg(step)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|child| {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            out
        })
        .collect()
}

/// Compiles C `source` in `dir` into a shared library (`lib<name>.so`) or a
/// program (`<name>`), and returns its path.
fn compile_c(dir: &std::path::Path, name: &str, source: &str, shared: bool) -> std::path::PathBuf {
    compile_c_with(dir, name, source, shared, &[])
}

/// As `compile_c`, with further arguments for the linker (`-l…`).
fn compile_c_with(
    dir: &std::path::Path,
    name: &str,
    source: &str,
    shared: bool,
    link: &[&std::ffi::OsStr],
) -> std::path::PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).unwrap();
    let out = dir.join(if shared {
        format!("lib{name}.so")
    } else {
        name.to_owned()
    });
    let mut cc = std::process::Command::new("cc");
    if shared {
        cc.args(["-shared", "-fPIC"]);
    }
    let status = cc
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .args(link)
        .arg("-ldl")
        .status()
        .expect("a C compiler (cc) is needed");
    assert!(status.success(), "compiling {name}");
    out
}

#[test]
fn without_the_shim_the_fake_driver_shows_the_whole_card() {
    let (ok, lines, _) = run_lines(shim_kit().probe(None).args(["info", "total", "nvml"]));
    assert!(ok);
    assert_eq!(field(line(&lines, "info 0"), "total"), FULL);
    assert_eq!(field(line(&lines, "total 0"), "bytes"), FULL);
    assert_eq!(field(line(&lines, "nvml 0"), "total"), FULL);
}

#[test]
fn cuda_and_nvml_report_the_cap() {
    let dir = capped_dir(4308);
    let lines = probe(
        dir.path(),
        &["info", "total", "nvml", "alloc:1000", "info", "nvml"],
    );
    assert_eq!(field(line(&lines, "info 0"), "total"), CAP);
    assert_eq!(field(line(&lines, "info 0"), "free"), CAP - CONTEXT);
    assert_eq!(field(line(&lines, "total 0"), "bytes"), CAP);

    let nvml = line(&lines, "nvml 0");
    assert_eq!(field(nvml, "total"), CAP);
    assert_eq!(
        field(nvml, "used"),
        CONTEXT,
        "the container's own usage (its context), not the card's"
    );
    let v2 = line(&lines, "nvml2 0");
    assert_eq!(field(v2, "total"), CAP);
    assert_eq!(field(v2, "reserved"), 0);
    assert_eq!(field(v2, "used") + field(v2, "free"), CAP);

    // After allocating 1000 MiB, every view agrees.
    let after: Vec<_> = lines
        .iter()
        .skip_while(|l| !l.starts_with("alloc"))
        .collect();
    let info = after.iter().find(|l| l.starts_with("info 0")).unwrap();
    assert_eq!(field(info, "free"), CAP - CONTEXT - 1000 * MIB);
    let v1 = after.iter().find(|l| l.starts_with("nvml 0")).unwrap();
    assert_eq!(field(v1, "used"), CONTEXT + 1000 * MIB);
    assert_eq!(field(v1, "used") + field(v1, "free"), CAP);
}

#[test]
fn untracked_usage_from_the_node_daemon_counts_in_every_view() {
    use gpumem_layout::{device, device_offset, FILE_NAME};
    use std::os::unix::fs::FileExt;
    let dir = capped_dir(4308);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(FILE_NAME))
        .unwrap();
    let write = |field: usize, value: u64| {
        file.write_all_at(&value.to_le_bytes(), (device_offset(0) + field) as u64)
            .unwrap()
    };
    write(device::OBSERVED_EXTRA, 600 * MIB);
    write(device::OBSERVED_SEQ, 2);
    let lines = probe(dir.path(), &["info", "nvml", "alloc:3410", "alloc:3408"]);
    assert_eq!(
        field(line(&lines, "info 0"), "free"),
        CAP - 600 * MIB - CONTEXT
    );
    assert_eq!(field(line(&lines, "nvml 0"), "used"), 600 * MIB + CONTEXT);
    assert!(lines.contains(&"alloc:3410 2 #0".to_owned()), "{lines:?}");
    assert!(lines.contains(&"alloc:3408 0 #1".to_owned()), "{lines:?}");

    // A daemon that died mid-update left the sequence odd: the value it
    // finished writing still counts, after a bounded wait.
    write(device::OBSERVED_EXTRA, 1000 * MIB);
    write(device::OBSERVED_SEQ, 3);
    let lines = probe(dir.path(), &["info"]);
    assert_eq!(
        field(line(&lines, "info 0"), "free"),
        CAP - 1000 * MIB - CONTEXT
    );
}

#[test]
fn a_slot_is_only_ever_claimed_under_its_lock() {
    use gpumem_layout::{slot, slot_offset, state, FILE_NAME};
    let dir = capped_dir(4308);
    let file = dir.path().join(FILE_NAME);
    let slot_state = |index: usize| {
        let bytes = std::fs::read(&file).unwrap();
        let at = slot_offset(1, index);
        (
            gpumem_layout::get_u64(&bytes, at + slot::STATE) & 0xff,
            gpumem_layout::get_u64(&bytes, at + slot::PID),
        )
    };
    // A claimer paused between taking slot 0's lock and publishing it.
    let mut claimer = common::hold_record_lock(&file, slot_offset(1, 0));
    let lines = probe(dir.path(), &["alloc:100"]);
    assert_eq!(lines[1], "alloc:100 0 #0");
    assert_eq!(
        slot_state(0),
        (state::FREE, 0),
        "the locked slot was left alone"
    );
    assert_eq!(slot_state(1).0, state::ALIVE, "the probe took the next one");

    // Killed mid-claim: the kernel drops the lock and the slot is free again.
    claimer.kill().unwrap();
    claimer.wait().unwrap();
    let mut holder = shim_kit()
        .probe(Some(dir.path()))
        .args(["alloc:100", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut holder, "holding");
    assert_eq!(slot_state(0), (state::ALIVE, u64::from(holder.id())));
    holder.kill().unwrap();
    holder.wait().unwrap();
}

/// A reaper killed between taking a dead process's slot and freeing it
/// left it REAPING with 3000 MiB still counted: while a process holds the
/// slot's lock (a reaper at work) it stays counted; once none does, the
/// next memory query finishes it.
#[test]
fn a_slot_whose_reaper_died_is_finished_by_the_next() {
    use gpumem_layout::{header, slot, slot_offset, state, FILE_NAME};
    use std::os::unix::fs::FileExt;
    let dir = capped_dir(4308);
    let path = dir.path().join(FILE_NAME);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let at = slot_offset(1, 2);
    let put = |offset: usize, value: u64| {
        file.write_all_at(&value.to_le_bytes(), offset as u64)
            .unwrap()
    };
    put(at + slot::USED, 3000 * MIB);
    put(at + slot::PID, 999_999);
    put(at + slot::STATE, 1 << 8 | state::REAPING);
    file.write_all_at(&3u32.to_le_bytes(), header::SLOT_HWM as u64)
        .unwrap();
    let slot_now = || {
        let bytes = std::fs::read(&path).unwrap();
        (
            gpumem_layout::get_u64(&bytes, at + slot::STATE),
            gpumem_layout::get_u64(&bytes, at + slot::USED),
        )
    };

    let mut reaper = common::hold_record_lock(&path, at);
    let lines = probe(dir.path(), &["info"]);
    assert_eq!(
        field(line(&lines, "info 0"), "free"),
        CAP - CONTEXT - 3000 * MIB
    );
    assert_eq!(slot_now(), (1 << 8 | state::REAPING, 3000 * MIB));

    reaper.kill().unwrap();
    reaper.wait().unwrap();
    let lines = probe(dir.path(), &["info"]);
    assert_eq!(field(line(&lines, "info 0"), "free"), CAP - CONTEXT);
    assert_eq!(slot_now(), (1 << 8 | state::FREE, 0));
}

/// A driver newer than the shim hands out a variant the shim does not
/// know (an export of its own, with its own arguments): the caller gets it
/// untouched, not a hook for the variant the documentation names.
#[test]
fn an_exported_variant_the_shim_does_not_know_is_left_alone() {
    let kit = shim_kit();
    let dir = capped_dir(4308);
    let build = tempfile::tempdir().unwrap();
    let main = compile_c(
        build.path(),
        "newer",
        r##"#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
typedef int (*gpa_fn)(const char *, void **, int, unsigned long long, int *);
int main(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) return 10;
    ((int (*)(unsigned))dlsym(cuda, "cuInit"))(0);
    gpa_fn gpa = (gpa_fn)dlsym(cuda, "cuGetProcAddress_v2");
    void *got = 0;
    int status = 0;
    int r = gpa("cuMemAlloc", &got, 14000, 0, &status);
    printf("lookup %d untouched %d\n", r, got == dlsym(cuda, "cuMemAlloc_v3"));
    r = gpa("cuMemAlloc", &got, 12080, 0, &status);
    printf("lookup %d hooked %d\n", r, got == dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"));
    return 0;
}
"##,
        false,
    );
    let (ok, lines, stderr) = run_lines(
        std::process::Command::new(&main)
            .env("LD_LIBRARY_PATH", &kit.driver_dir)
            .env("LD_PRELOAD", &kit.shim)
            .env("GPUMEM_STATE_DIR", dir.path()),
    );
    assert!(ok, "{stderr}");
    assert_eq!(
        lines,
        ["lookup 0 untouched 1", "lookup 0 hooked 1"],
        "{stderr}"
    );
}

#[test]
fn the_drivers_answers_are_matched_to_its_exports_by_identity() {
    let dir = capped_dir(4308);
    let (ok, _, stderr) = run_lines(
        shim_kit()
            .probe(Some(dir.path()))
            .env("GPUMEM_SHIM_LOG", "debug")
            .args(["--via", "gpa", "--ptsz", "async:1"]),
    );
    assert!(ok, "{stderr}");
    for expected in [
        "cuGetProcAddress(cuGetProcAddress, 12080, 0) -> cuGetProcAddress_v2 (Export)",
        "cuGetProcAddress(cuMemAlloc, 12080, 2) -> cuMemAlloc_v2 (Export)",
        // The per-thread default stream variant is its own hook.
        "cuGetProcAddress(cuMemAllocAsync, 12080, 2) -> cuMemAllocAsync_ptsz (Export)",
        // Asked as CUDA 2.0, the 32-bit-era functions are hooks of their own.
        "cuGetProcAddress(cuMemAlloc, 2000, 2) -> cuMemAlloc (Export)",
        "cuGetProcAddress(cuMemAllocPitch, 2000, 2) -> cuMemAllocPitch (Export)",
        "cuGetProcAddress(cuMemFree, 2000, 2) -> cuMemFree (Export)",
    ] {
        assert!(stderr.contains(expected), "missing {expected}:\n{stderr}");
    }
}

#[test]
fn the_allocation_that_would_pass_the_cap_fails_on_every_path() {
    let dir = capped_dir(4308);
    for via in [
        &["--via", "dlsym"][..],
        &["--via", "gpa"],
        &["--via", "gpa11"],
        &["--via", "gpa", "--ptsz"],
    ] {
        let mut args = via.to_vec();
        // All the context left in one piece, one byte more, then give it back.
        args.extend([
            "allocb:4202692608",
            "allocb:1",
            "free:0",
            "allocb:1",
            "alloc:4000",
            "alloc:400",
        ]);
        let lines = probe(dir.path(), &args);
        assert!(
            lines.contains(&"allocb:4202692608 0 #0".to_owned()),
            "{via:?}: {lines:?}"
        );
        assert!(
            lines.contains(&"allocb:1 2 #1".to_owned()),
            "{via:?}: over the cap is OOM (2): {lines:?}"
        );
        assert!(lines.contains(&"free:0 0".to_owned()), "{via:?}: {lines:?}");
        assert!(
            lines.contains(&"allocb:1 0 #2".to_owned()),
            "{via:?}: free returned budget: {lines:?}"
        );
        assert!(
            lines.contains(&"alloc:4000 0 #3".to_owned()),
            "{via:?}: {lines:?}"
        );
        assert!(
            lines.contains(&"alloc:400 2 #4".to_owned()),
            "{via:?}: {lines:?}"
        );
    }
}

/// The 32-bit-era entry points (`cuMemAlloc`, `cuMemAllocPitch`,
/// `cuMemFree` before CUDA 3.2: an `unsigned int` pointer) are still
/// exported, and `cuGetProcAddress` hands them out to a caller asking as
/// CUDA 2.0: an allocation through them is charged like one through `_v2`,
/// refused past the cap, and given back by a free of either ABI.
#[test]
fn the_32_bit_era_allocations_are_capped_by_name_and_by_old_version() {
    // Small enough that the cap, not the 4 GiB those pointers reach, refuses.
    let cap = 2154 * MIB;
    let dir = capped_dir(2154);
    let left = |charged_mib: u64| {
        format!(
            "info 0 free={} total={cap}",
            cap - CONTEXT - charged_mib * MIB
        )
    };
    for via in ["dlsym", "gpa", "gpa11"] {
        let lines = probe(
            dir.path(),
            &[
                "--via",
                via,
                "v1alloc:1500",
                "info",
                // 1854 MiB are left after the context: neither fits.
                "v1alloc:400",
                "v1pitch:1048576:400",
                "v1free:0",
                "info",
                "v1pitch:1048576:1000",
                "info",
                "v1free:3",
                "v1alloc:1800",
                "info",
                // A v1 allocation freed through cuMemFree_v2.
                "free:4",
                "info",
            ],
        );
        assert_eq!(
            lines,
            [
                "context 0".to_owned(),
                "v1alloc:1500 0 #0".to_owned(),
                left(1500),
                "v1alloc:400 2 #1".to_owned(),
                "v1pitch:1048576:400 2 #2 pitch=0".to_owned(),
                "v1free:0 0".to_owned(),
                left(0),
                "v1pitch:1048576:1000 0 #3 pitch=1048576".to_owned(),
                left(1000),
                "v1free:3 0".to_owned(),
                "v1alloc:1800 0 #4".to_owned(),
                left(1800),
                "free:4 0".to_owned(),
                left(0),
            ],
            "--via {via}"
        );
    }
}

/// A driver whose exports call one another through the dynamic symbol
/// table reaches the shim's hook from inside a hook: the fake's pitched
/// allocation, made through the process's `cuMemAlloc_v2` (the driver in
/// the global scope, as for a program linked with `-lcuda`). The inner
/// call passes straight through, so the allocation is charged once.
#[test]
fn an_allocation_the_driver_makes_through_a_hooked_export_is_charged_once() {
    let dir = capped_dir(4308);
    let kit = shim_kit();
    let preload = format!(
        "{} {}",
        kit.shim.display(),
        kit.driver_dir.join("libcuda.so.1").display()
    );
    for via in ["dlsym", "gpa"] {
        let mut probe = kit.probe(Some(dir.path()));
        probe.env("LD_PRELOAD", &preload);
        probe.env("FAKEGPU_PITCH_VIA_EXPORT", "1").args([
            "--via",
            via,
            "pitch:1048576:1500",
            "info",
            "pitch:1048576:1500",
        ]);
        let (ok, lines, stderr) = run_lines(&mut probe);
        assert!(ok, "{via}: {stderr}");
        assert!(
            nth(&lines, "pitch:", 0).starts_with("pitch:1048576:1500 0 #0"),
            "{via}: {lines:?}"
        );
        // The cap less the 300 MiB context and one 1500 MiB allocation.
        let free = (4308 - 1500) * MIB - CONTEXT;
        assert!(
            lines.contains(&format!("info 0 free={free} total={}", 4308 * MIB)),
            "{via}: charged more than once: {lines:?}"
        );
        assert!(
            nth(&lines, "pitch:", 1).starts_with("pitch:1048576:1500 0 #1"),
            "{via}: {lines:?}"
        );
    }
}

#[test]
fn stream_ordered_managed_pitched_and_vmm_allocations_are_charged() {
    let dir = capped_dir(4308);
    for (first, over) in [
        ("async:4000", "async:400"),
        ("pool:4000", "pool:400"),
        ("managed:4000", "managed:400"),
        ("create:4000", "create:400"),
        ("pitch:1048576:4000", "pitch:1048576:400"),
    ] {
        for via in ["gpa", "dlsym"] {
            let lines = probe(dir.path(), &["--via", via, first, over]);
            assert!(
                lines.iter().any(|l| l.starts_with(&format!("{first} 0 "))),
                "{via}: {lines:?}"
            );
            assert!(
                lines.iter().any(|l| l.starts_with(&format!("{over} 2 "))),
                "{via}: {lines:?}"
            );
        }
    }
    // Per-thread-stream variants are hooked separately and freed likewise.
    let lines = probe(
        dir.path(),
        &[
            "--via",
            "gpa",
            "--ptsz",
            "async:4000",
            "freeasync:0",
            "async:4000",
        ],
    );
    assert_eq!(
        lines[1..],
        ["async:4000 0 #0", "freeasync:0 0", "async:4000 0 #1"]
    );
    // Host-located VMM memory (NCCL, ggml) is not device memory.
    let lines = probe(
        dir.path(),
        &["create:4000", "createhost:8000", "release:0", "create:4000"],
    );
    assert_eq!(
        lines[1..],
        [
            "create:4000 0 #0",
            "createhost:8000 0 #1",
            "release:0 0",
            "create:4000 0 #2"
        ]
    );
}

#[test]
fn processes_share_one_cap_and_a_killed_one_gives_its_share_back() {
    let dir = capped_dir(4308);
    let mut holder = shim_kit()
        .probe(Some(dir.path()))
        .args(["alloc:3000", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = common::wait_for_line(&mut holder, "holding");
    assert!(seen.contains("alloc:3000 0 #0"), "{seen}");

    // 3000 MiB and a context there, a context here: 700 MiB are left.
    let lines = probe(dir.path(), &["alloc:1000", "alloc:700", "nvml"]);
    assert_eq!(lines[1..3], ["alloc:1000 2 #0", "alloc:700 0 #1"]);
    assert_eq!(
        field(line(&lines, "nvml 0"), "used"),
        3700 * MIB + 2 * CONTEXT,
        "both processes counted"
    );

    holder.kill().unwrap();
    holder.wait().unwrap();
    let lines = probe(dir.path(), &["alloc:4000"]);
    assert_eq!(
        lines[1], "alloc:4000 0 #0",
        "the SIGKILLed holder's 3000 MiB and context came back"
    );
}

#[test]
fn many_processes_and_threads_never_exceed_the_cap() {
    let dir = capped_dir(4308);
    let counter = dir.path().join("held");
    // 1000 MiB pieces under a 4308 MiB cap (less the contexts): at most 4
    // may be held at once.
    let step = format!("stress:16:200:1000:{}", counter.display());
    let (mut ok, mut refused) = (0, 0);
    for out in together(dir.path(), &step, 4) {
        let text = String::from_utf8_lossy(&out.stdout);
        let stress = text.lines().find(|l| l.starts_with("stress")).unwrap();
        ok += field(stress, "ok");
        refused += field(stress, "refused");
    }
    assert_eq!(ok + refused, 4 * 16 * 200);
    // Near the cap, a charge that does not fit retries in turn for a few
    // milliseconds: pieces held for an instant are mostly waited for, not
    // refused. The cap was contended all the same: it was full.
    let bytes = std::fs::read(&counter).unwrap();
    let most = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
    assert!(
        (3..=4).contains(&most),
        "3 × 1000 MiB fit beside 4 contexts (4 before all exist); never more: saw {most}, \
         ok={ok} refused={refused}"
    );

    let usage = gpumem::isolation::accounting::usage(&dir.path().join("accounting")).unwrap();
    assert_eq!(usage[0].used_bytes, 0, "everything was given back");
}

/// Under load the stress processes start far apart, and one may fill the
/// cap before another has its context. That context is refused with
/// out-of-memory, as a driver refuses one on a full GPU; a thread that went
/// on without it got `CUDA_ERROR_INVALID_CONTEXT` from the driver.
#[test]
fn a_stress_thread_without_room_for_a_context_sees_only_out_of_memory() {
    let dir = capped_dir(4308);
    let mut holder = shim_kit()
        .probe(Some(dir.path()))
        .args(["alloc:3900", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut holder, "holding");
    // 3900 MiB and a context there: no room for another context here.
    let counter = dir.path().join("held");
    let (ok, lines, stderr) = run_lines(
        shim_kit()
            .probe(Some(dir.path()))
            .arg(format!("stress:2:5:1000:{}", counter.display())),
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(ok, "{stderr}");
    assert_eq!(line(&lines, "context"), "context 2", "{lines:?}");
    assert_eq!(line(&lines, "stress"), "stress ok=0 refused=10");
}

#[test]
fn missing_or_broken_config_passes_through_with_one_line() {
    let empty = tempfile::tempdir().unwrap();
    let truncated = capped_dir(4308);
    let file = truncated.path().join("accounting");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let garbage = tempfile::tempdir().unwrap();
    std::fs::write(garbage.path().join("accounting"), vec![0xAB; 4096]).unwrap();

    for dir in [empty.path(), truncated.path(), garbage.path()] {
        let (ok, lines, stderr) =
            run_lines(
                shim_kit()
                    .probe(Some(dir))
                    .args(["info", "alloc:8000", "nvml"]),
            );
        assert!(ok, "{stderr}");
        assert_eq!(field(line(&lines, "info 0"), "total"), FULL, "uncapped");
        assert!(lines.contains(&"alloc:8000 0 #0".to_owned()));
        assert_eq!(stderr.lines().count(), 1, "exactly one line: {stderr}");
        assert!(
            stderr.contains("NOT capped") && stderr.contains(&dir.display().to_string()),
            "{stderr}"
        );
    }
}

#[test]
fn programs_that_never_touch_cuda_are_unaffected() {
    let dir = capped_dir(4308);
    let kit = shim_kit();
    for args in [
        &["/bin/true"][..],
        &["/bin/sh", "-c", "echo hello; ls / >/dev/null"],
    ] {
        let out = std::process::Command::new(args[0])
            .args(&args[1..])
            .env("LD_PRELOAD", &kit.shim)
            .env("GPUMEM_STATE_DIR", dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        assert!(
            out.stderr.is_empty(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Python resolves thousands of symbols through dlsym (ctypes, extension
    // modules) and must see each one unchanged.
    if let Ok(out) = std::process::Command::new("python3")
        .args([
            "-c",
            "import ctypes, json, ssl; print(ctypes.CDLL(None).getpid() > 0)",
        ])
        .env("LD_PRELOAD", &kit.shim)
        .env("GPUMEM_STATE_DIR", dir.path())
        .output()
    {
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "True",
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stderr.is_empty());
    }
    // Not one slot was claimed: the accounting file was not even mapped.
    let bytes = std::fs::read(dir.path().join("accounting")).unwrap();
    assert_eq!(
        gpumem_layout::get_u32(&bytes, gpumem_layout::header::SLOT_HWM),
        0
    );
}

#[test]
fn rtld_next_lookups_keep_their_meaning() {
    // A preloaded wrapper after the shim resolves "the next getpid" through
    // our dlsym. Resolved relative to the shim instead of the wrapper, it
    // would find the wrapper itself and recurse.
    let kit = shim_kit();
    let dir = tempfile::tempdir().unwrap();
    let wrap = compile_c(
        dir.path(),
        "wrap",
        "#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <unistd.h>\n\
         static int depth;\n\
         pid_t getpid(void) {\n\
           pid_t (*next)(void) = (pid_t (*)(void))dlsym(RTLD_NEXT, \"getpid\");\n\
           if (depth++ > 0 || !next) _exit(3);\n\
           pid_t p = next(); depth--; return p;\n}\n",
        true,
    );
    let main = compile_c(
        dir.path(),
        "main",
        "#include <stdio.h>\n#include <unistd.h>\nint main(void) { printf(\"%d\\n\", (int)getpid()); return 0; }\n",
        false,
    );
    let preload = format!("{}:{}", kit.shim.display(), wrap.display());
    let out = std::process::Command::new(&main)
        .env("LD_PRELOAD", preload)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "exit {:?}: RTLD_NEXT resolved relative to the shim",
        out.status.code()
    );
    let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(pid > 0);
}

#[test]
fn a_forked_child_of_a_cuda_process_passes_through() {
    let dir = capped_dir(4308);
    let lines = probe(
        dir.path(),
        &["alloc:1000", "forkalloc:2000", "nvml", "alloc:3000"],
    );
    // CUDA is unusable after a fork (the driver answers 3 to everything,
    // as the H100 did), and the shim leaves the child alone.
    assert!(
        lines.contains(&"child forkalloc:2000 3".to_owned()),
        "{lines:?}"
    );
    assert_eq!(
        field(line(&lines, "nvml 0"), "used"),
        CONTEXT + 1000 * MIB,
        "{lines:?}"
    );
    assert!(lines.contains(&"alloc:3000 0 #1".to_owned()), "{lines:?}");
}

#[test]
fn a_forked_child_never_waits_on_a_lock_its_parent_held() {
    let dir = capped_dir(4308);
    // Threads allocate and free without pause while the main thread forks;
    // each child frees and allocates through the shim.
    let lines = probe(dir.path(), &["forkstorm:100:4:1"]);
    assert_eq!(line(&lines, "forkstorm"), "forkstorm ok=100 hung=0");
}

#[test]
fn a_child_forked_before_cuda_is_capped_on_its_own_slot() {
    let dir = capped_dir(4308);
    // A launcher that looked at NVML, then forked a CUDA worker.
    let lines = probe(dir.path(), &["nvml", "fork", "alloc:4000", "alloc:400"]);
    assert!(lines.contains(&"alloc:4000 0 #0".to_owned()), "{lines:?}");
    assert!(lines.contains(&"alloc:400 2 #1".to_owned()), "{lines:?}");
    assert!(lines.contains(&"fork status=0".to_owned()), "{lines:?}");
}

#[test]
fn an_execed_process_leaves_no_charge_behind() {
    let dir = capped_dir(4308);
    // The new image charges afresh: what the old one held is gone.
    let lines = probe(dir.path(), &["alloc:3000", "exec", "alloc:3000", "info"]);
    let granted = lines.iter().filter(|l| *l == "alloc:3000 0 #0").count();
    assert_eq!(granted, 2, "{lines:?}");
    assert_eq!(
        field(line(&lines, "info 0"), "free"),
        CAP - CONTEXT - 3000 * MIB,
        "{lines:?}"
    );

    // An image that never touches CUDA again: its pid lives on, its
    // charge does not.
    let mut quiet = shim_kit()
        .probe(Some(dir.path()))
        .args(["alloc:3000", "exec", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut quiet, "holding");
    let lines = probe(dir.path(), &["alloc:3000"]);
    assert_eq!(lines[1], "alloc:3000 0 #0");
    quiet.kill().unwrap();
    quiet.wait().unwrap();

    // One that only closed its descriptors still has the file mapped and
    // the memory allocated: it keeps its charge.
    let mut closer = shim_kit()
        .probe(Some(dir.path()))
        .args(["alloc:3000", "closefds", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut closer, "holding");
    let lines = probe(dir.path(), &["alloc:3000"]);
    assert_eq!(lines[1], "alloc:3000 2 #0");
    closer.kill().unwrap();
    closer.wait().unwrap();
}

#[test]
fn a_file_shrunk_under_a_running_process_is_an_error_not_a_crash() {
    let own = capped_dir(4308);
    shrink_under_a_running_probe(own.path(), &own.path().join("accounting"));
    // A container with two claims: the file mapped first.
    let claims = claims_dir(&[
        ("claim-a", &[(T4_UUID, 4308)], SLOTS),
        ("claim-b", &[(SECOND_UUID, 4308)], SLOTS),
    ]);
    let file = claims.path().join("claim-a").join("accounting");
    shrink_under_a_running_probe(claims.path(), &file);
}

/// Shrinks `file`, which caps the first GPU, to nothing while a probe under
/// the shim with `dir` holds memory there, and checks the probe says so in
/// one line and goes on uncapped.
fn shrink_under_a_running_probe(dir: &std::path::Path, file: &std::path::Path) {
    let go = dir.join("go");
    let output = dir.join("output");
    let child = shim_kit()
        .probe(Some(dir))
        .env("FAKEGPU_UUIDS", format!("{T4_UUID},{SECOND_UUID}"))
        .args([
            "alloc:100",
            &format!("wait:{}", go.display()),
            "alloc:100",
            "alloc:5000",
        ])
        .stdout(std::fs::File::create(&output).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let every = std::time::Duration::from_millis(10);
    eventually_blocking("the probe's allocation", common::WAIT, every, || {
        std::fs::read_to_string(&output)
            .unwrap()
            .contains("alloc:100 0")
            .then_some(())
            .ok_or("the probe never allocated")
    });
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(0)
        .unwrap();
    std::fs::write(&go, "").unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(
        stderr.contains("shrank while in use")
            && stderr.contains("NOT capped")
            && stderr.contains(&file.display().to_string()),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    // Uncapped from then on, as with a file missing from the start.
    let stdout = std::fs::read_to_string(&output).unwrap();
    assert!(stdout.contains("alloc:5000 0 #2"), "{stdout}");
}

/// A SIGBUS another process sends (sigqueue can set the bytes where a
/// fault's address goes to anything) is not a fault on the accounting file:
/// it goes to the handler before the shim's (here Rust's, which lets it
/// pass), and the shim stays on.
#[test]
fn a_sigbus_sent_by_a_process_is_not_taken_for_a_shrunk_file() {
    let dir = capped_dir(4308);
    let (_, lines, stderr) =
        run_lines(
            shim_kit()
                .probe(Some(dir.path()))
                .args(["alloc:100", "sentbus", "alloc:5000"]),
        );
    assert_eq!(
        lines[1..],
        ["alloc:100 0 #0", "sentbus survived 0", "alloc:5000 2 #1"],
        "{stderr}"
    );
    assert!(!stderr.contains("shrank"), "{stderr}");
}

#[test]
fn racers_for_the_last_bytes_are_never_all_refused() {
    let dir = capped_dir(4308);
    let rounds = 60;
    let file = dir.path().join("race");
    // Two processes of 4 threads each: every round they all ask for 3000
    // MiB at once, and exactly one of them fits.
    together(
        dir.path(),
        &format!("race:4:{rounds}:3000:{}:8", file.display()),
        2,
    );
    let bytes = std::fs::read(&file).unwrap();
    let wins: Vec<u64> = (0..rounds)
        .map(|r| u64::from_le_bytes(bytes[8 * (1 + r)..8 * (2 + r)].try_into().unwrap()))
        .collect();
    assert!(wins.iter().all(|&w| w == 1), "winners per round: {wins:?}");
}

#[test]
fn a_charge_near_the_cap_outlasts_a_racer_that_backs_out() {
    use gpumem_layout::{header, slot, slot_offset, state, FILE_NAME};
    let dir = capped_dir(4308);
    let file = dir.path().join(FILE_NAME);
    let len = std::fs::metadata(&file).unwrap().len();
    // Another process in the middle of a charge that will not fit: it has
    // added 4000 MiB to its slot and backs out only once someone is
    // waiting for the charge lock (the byte after the file's end + 1).
    let racer = std::process::Command::new("python3")
        .arg("-c")
        .arg(format!(
            r#"import fcntl, os, struct, time
f = open({file:?}, "r+b")
at = {slot_at}
fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, at, 0)
def put(offset, fmt, value):
    f.seek(offset); f.write(struct.pack(fmt, value)); f.flush()
put(at + {used}, "<Q", 4000 << 20)
put(at + {pid}, "<Q", os.getpid())
put(at + {state}, "<Q", (1 << 8) | {alive})
put({hwm}, "<I", 6)
print("racing", flush=True)
probe = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, {charge_lock}, 1, 0)
deadline = time.time() + 60
while struct.unpack("hhqqi4x", fcntl.fcntl(f, fcntl.F_GETLK, probe))[0] == fcntl.F_UNLCK:
    assert time.time() < deadline, "nobody waited for the charge lock"
put(at + {used}, "<Q", 0)
print("backed out", flush=True)
time.sleep(60)"#,
            slot_at = slot_offset(1, 5),
            used = slot::USED,
            pid = slot::PID,
            state = slot::STATE,
            alive = state::ALIVE,
            hwm = header::SLOT_HWM,
            charge_lock = len + 1,
        ))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut racer = racer;
    common::wait_for_line(&mut racer, "racing");
    // 300 MiB of context and 3000 MiB fit once the racer has backed out.
    let lines = probe(dir.path(), &["alloc:3000"]);
    racer.kill().unwrap();
    racer.wait().unwrap();
    assert_eq!(lines[1], "alloc:3000 0 #0");
}

/// Runs `command` to its end; its stdout, once it exited cleanly.
fn stdout_of(command: &mut std::process::Command) -> String {
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{:?} {stdout} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A library that wraps cuMemAlloc_v2, finds the next one with
/// dlsym(RTLD_NEXT) and counts its calls (`wrapped()`); a chain that leads
/// back to it ends with 999 after 100 levels instead of a stack overflow.
const INTERPOSER: &str = r##"#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
typedef int (*alloc_fn)(unsigned long long *, size_t);
static int calls, depth;
int wrapped(void) { return calls; }
int cuMemAlloc_v2(unsigned long long *p, size_t n) {
    alloc_fn next = (alloc_fn)dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    calls++;
    if (++depth > 100 || !next) { fprintf(stderr, "recursed\n"); return 999; }
    int r = next(p, n);
    depth--;
    return r;
}
"##;

/// C that loads the driver and makes device 0's primary context current
/// (`with_context()`, 0 on success), with `fn` for any driver function.
const WITH_CONTEXT: &str = r##"#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
typedef int (*fn)();
static int with_context(void) {
    if (!dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL)) return 1;
    void *ctx = 0;
    ((fn)dlsym(RTLD_DEFAULT, "cuInit"))(0);
    ((fn)dlsym(RTLD_DEFAULT, "cuDevicePrimaryCtxRetain"))(&ctx, 0);
    return ((fn)dlsym(RTLD_DEFAULT, "cuCtxSetCurrent"))(ctx);
}
"##;

/// Runs the C program `main` (after `WITH_CONTEXT`) with the shim and
/// `INTERPOSER` preloaded, the shim first or not, capped at 4308 MiB;
/// returns what it printed.
fn run_with_interposer(main: &str, shim_first: bool) -> String {
    let kit = shim_kit();
    let dir = capped_dir(4308);
    let build = tempfile::tempdir().unwrap();
    let wrap = compile_c(build.path(), "wrap", INTERPOSER, true);
    let main = compile_c(
        build.path(),
        "main",
        &format!("{WITH_CONTEXT}{main}"),
        false,
    );
    let (first, second) = if shim_first {
        (kit.shim.clone(), wrap)
    } else {
        (wrap, kit.shim.clone())
    };
    let mut command = std::process::Command::new(&main);
    command
        .env("LD_LIBRARY_PATH", &kit.driver_dir)
        .env(
            "LD_PRELOAD",
            format!("{}:{}", first.display(), second.display()),
        )
        .env("GPUMEM_STATE_DIR", dir.path());
    stdout_of(&mut command)
}

#[test]
fn an_interposer_after_the_shim_reaches_the_driver_not_itself() {
    // Another preloaded library wraps cuMemAlloc_v2 and finds the next one
    // with dlsym(RTLD_NEXT): it must get the driver's, not ours again.
    let stdout = run_with_interposer(
        r##"int main(void) {
    if (with_context()) return 10;
    fn alloc = (fn)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    unsigned long long p;
    printf("small %d\n", alloc(&p, (size_t)100 << 20));
    printf("over %d\n", alloc(&p, (size_t)5000 << 20));
    return 0;
}
"##,
        true,
    );
    assert_eq!(
        stdout, "small 0\nover 2\n",
        "through the interposer, still capped"
    );
}

/// Links `source` (a library with a `run` function) against the fake
/// driver or NVML (`links`, one `-l:` argument: the two are one file, and
/// the linker would keep only the first), has a program open it `RTLD_LOCAL` (as Python opens an
/// extension module) and call `run`, under the shim capped at 4308 MiB;
/// returns what it printed.
fn run_local_library(source: &str, links: &str) -> String {
    let kit = shim_kit();
    let dir = capped_dir(4308);
    let build = tempfile::tempdir().unwrap();
    let driver_dir = format!("-L{}", kit.driver_dir.display());
    let user = compile_c_with(
        build.path(),
        "user",
        source,
        true,
        &[driver_dir.as_ref(), links.as_ref()],
    );
    let main = compile_c(
        build.path(),
        "main",
        &format!(
            r##"#include <dlfcn.h>
#include <stdio.h>
int main(void) {{
    void *user = dlopen("{}", RTLD_NOW | RTLD_LOCAL);
    if (!user) {{ fprintf(stderr, "%s\n", dlerror()); return 10; }}
    ((void (*)(void))dlsym(user, "run"))();
    return 0;
}}
"##,
            user.display()
        ),
        false,
    );
    let mut command = std::process::Command::new(&main);
    command
        .env("LD_LIBRARY_PATH", &kit.driver_dir)
        .env("LD_PRELOAD", &kit.shim)
        .env("GPUMEM_STATE_DIR", dir.path());
    stdout_of(&mut command)
}

/// A library opened RTLD_LOCAL that links the driver keeps it in its own
/// scope: its direct calls bind to the shim's exports, which must still
/// reach the driver (they answered errors), and cap.
#[test]
fn a_library_opened_locally_that_links_the_driver_is_served_and_capped() {
    let printed = run_local_library(
        r##"#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int cuInit(unsigned);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
int cuMemAlloc_v2(unsigned long long *, size_t);
int cuMemGetInfo_v2(size_t *, size_t *);
typedef int (*alloc_fn)(unsigned long long *, size_t);
void run(void) {
    void *ctx = 0;
    unsigned long long p;
    size_t free = 0, total = 0;
    printf("init %d\n", cuInit(0));
    printf("retain %d\n", cuDevicePrimaryCtxRetain(&ctx, 0));
    printf("current %d\n", cuCtxSetCurrent(ctx));
    printf("small %d\n", cuMemAlloc_v2(&p, (size_t)100 << 20));
    printf("over %d\n", cuMemAlloc_v2(&p, (size_t)5000 << 20));
    int info = cuMemGetInfo_v2(&free, &total);
    printf("info %d total %zu\n", info, total >> 20);
    alloc_fn looked = (alloc_fn)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    printf("looked up %d\n", looked ? looked(&p, (size_t)5000 << 20) : -1);
}
"##,
        "-l:libcuda.so.1",
    );
    assert_eq!(
        printed,
        "init 0\nretain 0\ncurrent 0\nsmall 0\nover 2\ninfo 0 total 4308\nlooked up 2\n"
    );
}

#[test]
fn a_library_opened_locally_that_links_nvml_sees_the_cap() {
    let printed = run_local_library(
        r##"#include <stdio.h>
typedef struct { unsigned long long total, free, used; } memory_t;
int nvmlInit_v2(void);
int nvmlDeviceGetHandleByIndex_v2(unsigned, void **);
int nvmlDeviceGetMemoryInfo(void *, memory_t *);
void run(void) {
    void *device = 0;
    memory_t memory = {0, 0, 0};
    printf("init %d\n", nvmlInit_v2());
    printf("handle %d\n", nvmlDeviceGetHandleByIndex_v2(0, &device));
    int got = nvmlDeviceGetMemoryInfo(device, &memory);
    printf("memory %d total %llu\n", got, memory.total >> 20);
}
"##,
        "-l:libnvidia-ml.so.1",
    );
    assert_eq!(printed, "init 0\nhandle 0\nmemory 0 total 4308\n");
}

/// An interposer preloaded ahead of the shim wraps cuMemAlloc_v2 and finds
/// the next one with dlsym(RTLD_NEXT), which is the shim's: a program that
/// looks the name up (through the program's handle, or the default scope)
/// gets the interposer's function, which reaches the driver once, capped,
/// instead of looping between the two.
#[test]
fn an_interposer_ahead_of_the_shim_is_called_once_and_capped() {
    let stdout = run_with_interposer(
        r##"int main(void) {
    if (with_context()) return 10;
    fn wrapped = (fn)dlsym(RTLD_DEFAULT, "wrapped");
    unsigned long long p;
    fn own = (fn)dlsym(dlopen(NULL, RTLD_NOW), "cuMemAlloc_v2");
    printf("own small %d\n", own(&p, (size_t)100 << 20));
    printf("own over %d\n", own(&p, (size_t)5000 << 20));
    fn dflt = (fn)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    printf("default over %d\n", dflt(&p, (size_t)5000 << 20));
    printf("wrapped %d\n", wrapped());
    return 0;
}
"##,
        false,
    );
    assert_eq!(
        stdout,
        "own small 0\nown over 2\ndefault over 2\nwrapped 3\n"
    );
}

const SECOND_UUID: &str = "GPU-1a2b3c4d-0000-4000-8000-000000010000";

const THIRD_UUID: &str = "GPU-1a2b3c4d-0000-4000-8000-000000010001";

/// A claim's directory name, its (GPU, cap in MiB) and its slots.
type Claim<'a> = (&'a str, &'a [(&'a str, u64)], u32);

/// A state directory as a container with DRA claims has it: each claim's
/// CDI spec mounts its accounting directory inside the state directory,
/// under the claim directory's own name.
fn claims_dir(claims: &[Claim]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for &(name, caps, slots) in claims {
        let devices: Vec<_> = caps
            .iter()
            .map(|&(uuid, cap_mib)| gpumem_layout::DeviceSpec {
                uuid: gpumem_layout::parse_uuid(uuid).unwrap(),
                cap_bytes: cap_mib * MIB,
                context_charge_bytes: 0,
            })
            .collect();
        std::fs::create_dir(dir.path().join(name)).unwrap();
        let file = dir.path().join(name).join("accounting");
        std::fs::write(file, gpumem_layout::encode(&devices, slots)).unwrap();
    }
    dir
}

const SLOTS: u32 = gpumem_layout::DEFAULT_SLOTS;

/// A probe under the shim with `dir` on the fake GPUs `uuids` that has run
/// `steps` and holds what it made until killed.
fn holding(dir: &std::path::Path, uuids: &str, steps: &[&str]) -> std::process::Child {
    let mut child = shim_kit()
        .probe(Some(dir))
        .env("FAKEGPU_UUIDS", uuids)
        .args(steps)
        .arg("hold")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut child, "holding");
    child
}

/// Claim A caps GPUs 0 and 2, claim B GPU 1: the shim numbers devices
/// across files (A's two, then B's), so each ordinal must find its own
/// file and record there.
#[test]
fn a_container_with_two_claims_is_held_to_each_claims_cap_on_its_gpu() {
    let dir = claims_dir(&[
        ("claim-a", &[(T4_UUID, 4308), (THIRD_UUID, 1000)], SLOTS),
        ("claim-b", &[(SECOND_UUID, 2000)], SLOTS),
    ]);
    let (ok, lines, stderr) = run_lines(
        shim_kit()
            .probe(Some(dir.path()))
            .env(
                "FAKEGPU_UUIDS",
                format!("{T4_UUID},{SECOND_UUID},{THIRD_UUID}"),
            )
            .args([
                "ctx:0",
                "alloc:3900",
                "alloc:200",
                "ctx:1",
                "info",
                "alloc:1600",
                "alloc:200",
                "ctx:2",
                "alloc:600",
                "alloc:200",
                "nvml",
                "nvml:1",
                "nvml:2",
            ]),
    );
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("NOT capped"), "{stderr}");
    // Each cap less the 300 MiB context on its GPU.
    let results: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("alloc"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        results,
        [
            "alloc:3900 0 #0",
            "alloc:200 2 #1",
            "alloc:1600 0 #2",
            "alloc:200 2 #3",
            "alloc:600 0 #4",
            "alloc:200 2 #5"
        ]
    );
    assert_eq!(field(line(&lines, "info 0"), "total"), 2000 * MIB);
    assert_eq!(field(line(&lines, "nvml 0"), "total"), CAP);
    assert_eq!(field(line(&lines, "nvml:1 0"), "total"), 2000 * MIB);
    assert_eq!(field(line(&lines, "nvml:2 0"), "total"), 1000 * MIB);

    // Each claim's file holds what was charged on its own GPUs.
    let usage = |name: &str| {
        gpumem::isolation::accounting::usage(&dir.path().join(name).join("accounting")).unwrap()
    };
    let a = usage("claim-a");
    assert_eq!(a[0].peak_bytes, CONTEXT + 3900 * MIB);
    assert_eq!(a[1].peak_bytes, CONTEXT + 600 * MIB);
    assert_eq!(usage("claim-b")[0].peak_bytes, CONTEXT + 1600 * MIB);
}

/// Claim B's one slot is held by another process: this one is capped on
/// its own on B's GPU, still at B's cap, and says which file was full.
#[test]
fn a_full_claim_file_caps_a_process_on_its_own_on_that_claims_gpu() {
    let dir = claims_dir(&[
        ("claim-a", &[(T4_UUID, 4308), (THIRD_UUID, 1000)], SLOTS),
        ("claim-b", &[(SECOND_UUID, 2000)], 1),
    ]);
    let uuids = format!("{T4_UUID},{SECOND_UUID},{THIRD_UUID}");
    let mut holder = holding(dir.path(), &uuids, &["ctx:1"]);
    let (ok, lines, stderr) = run_lines(
        shim_kit()
            .probe(Some(dir.path()))
            .env("FAKEGPU_UUIDS", &uuids)
            .args(["ctx:1", "alloc:1000", "alloc:800", "ctx:2", "alloc:600"]),
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(ok, "{stderr}");
    // The holder's context and this one's: 2000 - 600 leaves 1400.
    assert_eq!(line(&lines, "alloc:1000"), "alloc:1000 0 #0");
    assert_eq!(line(&lines, "alloc:800"), "alloc:800 2 #1");
    assert_eq!(line(&lines, "alloc:600"), "alloc:600 0 #2");
    let b = dir.path().join("claim-b").join("accounting");
    assert!(
        stderr.contains(&b.display().to_string()) && stderr.contains("capped on its own"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
}

/// A process used both claims' GPUs, then exec'd a program that uses only
/// the first: what it held on the second is given back, though the new
/// image maps that claim's file too.
#[test]
fn an_execed_process_leaves_no_charge_behind_in_any_claims_file() {
    let dir = claims_dir(&[
        ("claim-a", &[(T4_UUID, 4308)], SLOTS),
        ("claim-b", &[(SECOND_UUID, 4308)], SLOTS),
    ]);
    let uuids = format!("{T4_UUID},{SECOND_UUID}");
    let mut execed = holding(
        dir.path(),
        &uuids,
        &["ctx:1", "alloc:3000", "exec", "ctx:0", "alloc:100"],
    );
    let (ok, lines, stderr) = run_lines(
        shim_kit()
            .probe(Some(dir.path()))
            .env("FAKEGPU_UUIDS", &uuids)
            .args(["ctx:1", "alloc:3000"]),
    );
    execed.kill().unwrap();
    execed.wait().unwrap();
    assert!(ok, "{stderr}");
    assert_eq!(line(&lines, "alloc:3000"), "alloc:3000 0 #0");
}

#[test]
fn a_gpu_in_two_claims_of_one_container_is_held_to_the_first_claims_cap() {
    let dir = claims_dir(&[
        ("claim-a", &[(T4_UUID, 1000)], SLOTS),
        ("claim-b", &[(T4_UUID, 3000)], SLOTS),
    ]);
    let (ok, lines, stderr) =
        run_lines(
            shim_kit()
                .probe(Some(dir.path()))
                .args(["info", "alloc:800", "alloc:800"]),
        );
    assert!(ok, "{stderr}");
    assert_eq!(field(line(&lines, "info 0"), "total"), 1000 * MIB);
    assert_eq!(nth(&lines, "alloc:800", 1), "alloc:800 2 #1");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains(T4_UUID) && stderr.contains("claim-b"),
        "the second file's cap is named as unused: {stderr}"
    );
}

#[test]
fn a_broken_claim_file_costs_only_its_own_gpu_its_cap() {
    // A directory no claim's spec mounts is not read, though it sorts first.
    let dir = claims_dir(&[
        ("a-stray", &[(T4_UUID, 500)], SLOTS),
        ("claim-b", &[(T4_UUID, 1000)], SLOTS),
    ]);
    std::fs::create_dir(dir.path().join("claim-a")).unwrap();
    let broken = dir.path().join("claim-a").join("accounting");
    std::fs::write(&broken, vec![0xAB; 4096]).unwrap();
    let (ok, lines, stderr) = run_lines(shim_kit().probe(Some(dir.path())).args(["info"]));
    assert!(ok, "{stderr}");
    assert_eq!(field(line(&lines, "info 0"), "total"), 1000 * MIB);
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains(&broken.display().to_string()) && stderr.contains("on its devices"),
        "{stderr}"
    );
}
