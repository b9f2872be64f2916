//! `gpumem demo` as a newcomer runs it: the capped process in each admitted
//! container, the request in either unit, and a node it cannot split.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{gpumem_cmd as gpumem, gpumem_cmd_at as gpumem_at};

fn run(cmd: &mut Command) -> (Output, String, String) {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// target/<profile>, where the shim, fake driver and probe are built.
fn kit_dir() -> &'static Path {
    common::shim_kit().probe.parent().unwrap()
}

#[test]
fn each_admitted_container_runs_a_process_held_to_its_cap() {
    let (out, stdout, stderr) = run(gpumem().args(["demo", "--tenant-dir"]).arg(kit_dir()));
    assert!(out.status.success(), "{stdout}{stderr}");
    // Cap 4308 MiB, a 300 MiB context: 15 steps of 256 fit, a 16th does not.
    let held = "nvidia-smi: 0MiB / 4308MiB; 3840 MiB allocated in 256 MiB steps beside its \
                context, the next 256 MiB refused: CUDA_ERROR_OUT_OF_MEMORY";
    for pod in ["tf-notebook-1", "tf-notebook-2", "tf-notebook-3"] {
        assert!(stdout.contains(&format!("  {pod}  {held}")), "{stdout}");
    }
    assert!(!stdout.contains("  tf-notebook-4  nvidia-smi"), "{stdout}");
}

#[test]
fn with_dra_each_claim_of_4gi_is_held_to_4096_mib() {
    let (out, stdout, stderr) = run(gpumem()
        .args(["demo", "--dra", "--tenant-dir"])
        .arg(kit_dir()));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("claims take 1Gi..14Gi in steps of 1Gi, shared by many claims: true"),
        "{stdout}"
    );
    // Cap 4096 MiB, a 300 MiB context: 14 steps of 256 fit, a 15th does not.
    let held = "nvidia-smi: 0MiB / 4096MiB; 3584 MiB allocated in 256 MiB steps beside its \
                context, the next 256 MiB refused: CUDA_ERROR_OUT_OF_MEMORY";
    assert_eq!(stdout.matches(held).count(), 3, "{stdout}");
    for claim in ["notebook-1", "notebook-2", "notebook-3"] {
        let line = stdout.lines().find(|l| l.contains(claim)).unwrap();
        assert!(
            line.contains("gpumem.io/claim=") && line.contains("cap 4096 MiB"),
            "{line}"
        );
    }
}

#[test]
fn the_pod_no_single_gpu_fits_is_filtered_out_by_the_extender() {
    let (out, stdout, stderr) = run(gpumem().args(["demo", "--tenant-dir"]).arg(kit_dir()));
    assert!(out.status.success(), "{stdout}{stderr}");
    let scenario = stdout
        .split_once("Scheduling by GPU:")
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("no scheduling scenario: {stdout}{stderr}"));
    for line in [
        "train-a          5 GiB: bound by the extender, admitted on GPU0",
        "train-b          5 GiB: bound by the extender, admitted on GPU1",
        "big-notebook    15 GiB: stays Pending, filtered out by the extender: no single healthy \
         GPU has 15 free units (free per GPU: GPU0 10, GPU1 10)",
        "small-notebook   4 GiB: bound by the extender, admitted on GPU0",
        "small-notebook  ALIYUN_COM_GPU_MEM_IDX=0 ALIYUN_COM_GPU_MEM_POD=4 \
         ALIYUN_COM_GPU_MEM_DEV=15 ALIYUN_COM_GPU_MEM_ASSIGNED=true",
        "big-notebook    ALIYUN_COM_GPU_MEM_IDX=- ",
        // 4 of a V100's 15 units: floor(4 × 16160 / 15) MiB.
        "In small-notebook: nvidia-smi: 0MiB / 4309MiB; 3840 MiB allocated",
    ] {
        assert!(scenario.contains(line), "missing {line:?} in:\n{scenario}");
    }
}

#[test]
fn without_the_shim_built_the_demo_says_how_to_see_it() {
    // A copy of gpumem in a directory with nothing beside it.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let alone = dir.path().join("gpumem");
    std::fs::copy(env!("CARGO_BIN_EXE_gpumem"), &alone).unwrap();
    let (out, stdout, stderr) = run(gpumem_at(&alone).arg("demo"));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("cargo build --release --workspace"),
        "{stdout}"
    );
    assert!(!stdout.contains("nvidia-smi:"), "{stdout}");

    let (out, _, stderr) = run(gpumem_at(&alone)
        .args(["demo", "--tenant-dir"])
        .arg(dir.path()));
    assert!(!out.status.success());
    assert!(
        stderr.contains("libgpumem_shim.so, libgpumem_fakegpu.so, gpumem-probe not found"),
        "{stderr}"
    );
}

#[test]
fn pods_ask_for_4_gib_in_mib_units_too() {
    let (out, stdout, stderr) = run(gpumem()
        .args(["demo", "--memory-unit", "MiB", "--tenant-dir"])
        .arg(kit_dir()));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("tf-notebook-1  admitted: GPU0, 4096 units, cap 4096 MiB"),
        "{stdout}"
    );
    assert!(
        stdout.contains("tf-notebook-4  NOT admitted: Insufficient aliyun.com/gpu-mem: requested 4096, 2791 available"),
        "{stdout}"
    );
    assert!(
        stdout.contains("nvidia-smi: 0MiB / 4096MiB; 3584 MiB allocated"),
        "{stdout}"
    );
}

#[test]
fn a_gpu_smaller_than_one_unit_is_named_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.toml");
    std::fs::write(
        &tiny,
        "[[gpu]]\nuuid = \"GPU-tiny\"\nname = \"Tiny\"\nmemory_mib = 500\n",
    )
    .unwrap();
    let started = std::time::Instant::now();
    let (out, stdout, stderr) = run(gpumem().args(["demo", "--fake-gpus"]).arg(&tiny));
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains(
            "GPU GPU-tiny (500 MiB) is smaller than one 1 GiB unit, so there is nothing to \
             advertise; use --memory-unit MiB"
        ),
        "{stderr}"
    );
    // Named at once, not after waiting for a registration that cannot come.
    assert!(started.elapsed() < std::time::Duration::from_secs(5));

    // The plugin says the same before it serves anything.
    let kubelet = tempfile::tempdir().unwrap();
    let (out, _, stderr) = run(gpumem()
        .args(["plugin", "--isolation", "none", "--kubelet-dir"])
        .arg(kubelet.path())
        .arg("--fake-gpus")
        .arg(&tiny));
    assert!(!out.status.success());
    assert!(stderr.contains("use --memory-unit MiB"), "{stderr}");

    let (out, stdout, stderr) = run(gpumem()
        .args(["demo", "--memory-unit", "MiB", "--fake-gpus"])
        .arg(&tiny));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("500 devices advertised"), "{stdout}");
}
