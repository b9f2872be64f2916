//! Shim overhead (not a test): `cargo bench --bench shim`.
//!
//! Runs the probe against the fake driver (release builds) with and without
//! the shim preloaded, through dlsym and through cuGetProcAddress, on one
//! thread and on 16 at once, and prints the time per cuMemAlloc(1 MiB) +
//! cuMemFree pair and per cuMemGetInfo, and what the shim adds. The fake
//! driver's own calls cost tens of nanoseconds (and serialise on one lock,
//! as the real driver's do), so the difference is the shim's.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Pairs per thread, and threads.
const RUNS: [(u64, u32); 2] = [(500_000, 1), (100_000, 16)];

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

/// One probe run: per operation, (pair wall, pair CPU, info wall, info CPU) in ns.
fn run(out: &Path, state: Option<&Path>, via: &str, pairs: u64, threads: u32) -> [f64; 4] {
    let mut cmd = Command::new(out.join("gpumem-probe"));
    cmd.env("LD_LIBRARY_PATH", out.join("bench-fake-driver"))
        .args(["--via", via, &format!("bench:{pairs}:{threads}")]);
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
    [
        field("pair_ns="),
        field("pair_cpu_ns="),
        field("info_ns="),
        field("info_cpu_ns="),
    ]
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
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "# shim overhead on the fake driver, {cpus} CPUs, best of 5 runs each; \
         per operation and thread: wall ns / thread CPU ns"
    );
    for (pairs, threads) in RUNS {
        for via in ["dlsym", "gpa"] {
            let best = |state: Option<&Path>| {
                (0..5)
                    .map(|_| run(&out, state, via, pairs, threads))
                    .fold([f64::MAX; 4], |a, b| {
                        std::array::from_fn(|i| a[i].min(b[i]))
                    })
            };
            let bare = best(None);
            let shim = best(Some(state.path()));
            println!(
                "{threads:>2} thread(s) × {pairs:<6} via {via:<5} alloc+free pair: bare {:6.1}/{:6.1}, \
                 shimmed {:6.1}/{:6.1}, +{:5.1} ns CPU; cuMemGetInfo: bare {:5.1}/{:5.1}, \
                 shimmed {:5.1}/{:5.1}, +{:5.1} ns CPU",
                bare[0],
                bare[1],
                shim[0],
                shim[1],
                shim[1] - bare[1],
                bare[2],
                bare[3],
                shim[2],
                shim[3],
                shim[3] - bare[3],
            );
        }
    }
}
