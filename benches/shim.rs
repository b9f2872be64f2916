//! Shim overhead (not a test): `cargo bench --bench shim`.
//!
//! Runs the probe against the fake driver (release builds) with and without
//! the shim preloaded, through dlsym and through cuGetProcAddress, and
//! prints the time per cuMemAlloc(1 MiB)+cuMemFree pair and per
//! cuMemGetInfo, and what the shim adds. The fake driver's own calls cost
//! tens of nanoseconds, so the difference is the shim's.

use std::path::{Path, PathBuf};
use std::process::Command;

const PAIRS: &str = "bench:500000";

fn build() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "-p",
            "gpumem-shim",
            "-p",
            "gpumem-fakegpu",
            "-p",
            "gpumem-probe",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success());
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release");
    let driver = out.join("bench-fake-driver");
    std::fs::create_dir_all(&driver).unwrap();
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        std::fs::copy(out.join("libgpumem_fakegpu.so"), driver.join(name)).unwrap();
    }
    out
}

fn run(out: &Path, state: Option<&Path>, via: &str) -> (f64, f64) {
    let mut cmd = Command::new(out.join("gpumem-probe"));
    cmd.env("LD_LIBRARY_PATH", out.join("bench-fake-driver"))
        .args(["--via", via, PAIRS]);
    if let Some(dir) = state {
        cmd.env("LD_PRELOAD", out.join("libgpumem_shim.so"))
            .env("GPUMEM_STATE_DIR", dir);
    }
    let text = String::from_utf8(cmd.output().unwrap().stdout).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("bench"))
        .expect("bench line");
    let field = |k: &str| -> f64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    (field("pair_ns="), field("info_ns="))
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let out = build();
    let state = tempfile::tempdir().unwrap();
    gpumem::accounting::prepare(
        state.path(),
        &[gpumem::accounting::Cap {
            uuid: "GPU-6b1c2d3e-0000-4000-8000-000000000400".into(),
            cap_mib: 4308,
            context_charge_mib: 0,
        }],
    )
    .unwrap();
    println!("# shim overhead on the fake driver, {PAIRS} (best of 5 runs each)");
    for via in ["dlsym", "gpa"] {
        let best = |state: Option<&Path>| {
            (0..5)
                .map(|_| run(&out, state, via))
                .fold((f64::MAX, f64::MAX), |a, b| (a.0.min(b.0), a.1.min(b.1)))
        };
        let (bare_pair, bare_info) = best(None);
        let (shim_pair, shim_info) = best(Some(state.path()));
        println!(
            "via {via:<5} alloc+free pair: {bare_pair:6.1} ns bare, {shim_pair:6.1} ns shimmed, +{:5.1} ns ({:.2}×); \
             cuMemGetInfo: {bare_info:5.1} ns bare, {shim_info:5.1} ns shimmed, +{:5.1} ns",
            shim_pair - bare_pair,
            shim_pair / bare_pair,
            shim_info - bare_info
        );
    }
}
