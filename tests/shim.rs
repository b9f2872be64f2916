//! The shim loaded into real processes (the probe, /bin/true, a shell)
//! against the fake driver: what programs see and what they are refused.

mod common;

use std::process::Stdio;

use common::{capped_dir, field, run_lines, shim_kit, MIB};

const CAP: u64 = 4308 * MIB;
const FULL: u64 = 15079 * MIB;

/// Runs the probe under the shim with `steps`, asserting it exits cleanly.
fn probe(dir: &std::path::Path, args: &[&str]) -> Vec<String> {
    let (ok, lines, stderr) = run_lines(shim_kit().probe(Some(dir)).args(args));
    assert!(ok, "probe {args:?} failed: {stderr}");
    assert!(
        !stderr.contains("gpumem-shim"),
        "unexpected shim message: {stderr}"
    );
    lines
}

fn line<'a>(lines: &'a [String], prefix: &str) -> &'a str {
    lines
        .iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in {lines:?}"))
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
    assert_eq!(field(line(&lines, "info 0"), "free"), CAP);
    assert_eq!(field(line(&lines, "total 0"), "bytes"), CAP);

    let nvml = line(&lines, "nvml 0");
    assert_eq!(field(nvml, "total"), CAP);
    assert_eq!(
        field(nvml, "used"),
        0,
        "the container's own usage, not the card's"
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
    assert_eq!(field(info, "free"), CAP - 1000 * MIB);
    let v1 = after.iter().find(|l| l.starts_with("nvml 0")).unwrap();
    assert_eq!(field(v1, "used"), 1000 * MIB);
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
    let lines = probe(dir.path(), &["info", "nvml", "alloc:3709", "alloc:3708"]);
    assert_eq!(field(line(&lines, "info 0"), "free"), CAP - 600 * MIB);
    assert_eq!(field(line(&lines, "nvml 0"), "used"), 600 * MIB);
    assert!(lines.contains(&"alloc:3709 2 #0".to_owned()), "{lines:?}");
    assert!(lines.contains(&"alloc:3708 0 #1".to_owned()), "{lines:?}");

    // A daemon that died mid-update left the sequence odd: the value it
    // finished writing still counts, after a bounded wait.
    write(device::OBSERVED_EXTRA, 1000 * MIB);
    write(device::OBSERVED_SEQ, 3);
    let lines = probe(dir.path(), &["info"]);
    assert_eq!(field(line(&lines, "info 0"), "free"), CAP - 1000 * MIB);
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
        // The whole cap in one piece, one byte more, then give it back.
        args.extend([
            "allocb:4517265408",
            "allocb:1",
            "free:0",
            "allocb:1",
            "alloc:4000",
            "alloc:400",
        ]);
        let lines = probe(dir.path(), &args);
        assert!(
            lines.contains(&"allocb:4517265408 0 #0".to_owned()),
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

    let lines = probe(dir.path(), &["alloc:2000", "alloc:1000", "nvml"]);
    assert_eq!(lines[1..3], ["alloc:2000 2 #0", "alloc:1000 0 #1"]);
    assert_eq!(
        field(line(&lines, "nvml 0"), "used"),
        4000 * MIB,
        "both processes counted"
    );

    holder.kill().unwrap();
    holder.wait().unwrap();
    let lines = probe(dir.path(), &["alloc:4000"]);
    assert_eq!(
        lines[1], "alloc:4000 0 #0",
        "the SIGKILLed holder's 3000 MiB came back"
    );
}

#[test]
fn many_processes_and_threads_never_exceed_the_cap() {
    let dir = capped_dir(4308);
    let counter = dir.path().join("held");
    // 1000 MiB pieces under a 4308 MiB cap: at most 4 may be held at once.
    let step = format!("stress:16:200:1000:{}", counter.display());
    let children: Vec<_> = (0..4)
        .map(|_| {
            shim_kit()
                .probe(Some(dir.path()))
                .arg(&step)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let stress = text.lines().find(|l| l.starts_with("stress")).unwrap();
        ok += field(stress, "ok");
        refused += field(stress, "refused");
    }
    assert_eq!(ok + refused, 4 * 16 * 200);
    assert!(
        ok > 0 && refused > 0,
        "the cap was contended: ok={ok} refused={refused}"
    );
    let bytes = std::fs::read(&counter).unwrap();
    let most = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
    assert!(
        (1..=4).contains(&most),
        "at most 4 × 1000 MiB held at once, saw {most}"
    );

    let usage = gpumem::accounting::usage(&dir.path().join("accounting")).unwrap();
    assert_eq!(usage[0].used_bytes, 0, "everything was given back");
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
    let wrap_c = dir.path().join("wrap.c");
    std::fs::write(
        &wrap_c,
        "#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <unistd.h>\n\
         static int depth;\n\
         pid_t getpid(void) {\n\
           pid_t (*next)(void) = (pid_t (*)(void))dlsym(RTLD_NEXT, \"getpid\");\n\
           if (depth++ > 0 || !next) _exit(3);\n\
           pid_t p = next(); depth--; return p;\n}\n",
    )
    .unwrap();
    let main_c = dir.path().join("main.c");
    std::fs::write(&main_c, "#include <stdio.h>\n#include <unistd.h>\nint main(void) { printf(\"%d\\n\", (int)getpid()); return 0; }\n").unwrap();
    let wrap = dir.path().join("libwrap.so");
    let main = dir.path().join("main");
    for (args, what) in [
        (
            vec![
                "-shared",
                "-fPIC",
                "-o",
                wrap.to_str().unwrap(),
                wrap_c.to_str().unwrap(),
                "-ldl",
            ],
            "wrapper",
        ),
        (
            vec!["-o", main.to_str().unwrap(), main_c.to_str().unwrap()],
            "program",
        ),
    ] {
        let status = std::process::Command::new("cc")
            .args(&args)
            .status()
            .expect("a C compiler (cc) is needed");
        assert!(status.success(), "compiling the {what}");
    }
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
fn a_forked_child_charges_its_own_slot() {
    let dir = capped_dir(4308);
    let lines = probe(
        dir.path(),
        &["alloc:1000", "forkalloc:2000", "nvml", "alloc:3000"],
    );
    assert!(
        lines.contains(&"child forkalloc:2000 0".to_owned()),
        "{lines:?}"
    );
    // The child exited holding 2000 MiB; it was its own, so it is reaped and
    // the parent is back to its own 1000 MiB.
    assert_eq!(
        field(line(&lines, "nvml 0"), "used"),
        1000 * MIB,
        "{lines:?}"
    );
    assert!(lines.contains(&"alloc:3000 0 #1".to_owned()), "{lines:?}");
}
