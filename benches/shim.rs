//! Shim overhead (not a test): `cargo bench --bench shim`.
//!
//! Runs the probe against the fake driver (release builds) with and without
//! the shim preloaded, through dlsym and through cuGetProcAddress, on the
//! main thread, on one thread, on two and on 16 at once, and prints the thread CPU time per
//! cuMemAlloc(1 MiB) + cuMemFree pair and per cuMemGetInfo, and what the
//! shim adds, with its spread over alternated rounds. The fake
//! driver's own calls cost tens of nanoseconds (and serialise on one lock,
//! as the real driver's do), so the difference is the shim's.
mod common;

use common::cpu_model;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Pairs per thread, and threads: the main thread (the one most programs
/// allocate on), one started later, one per CPU of a 2-CPU machine, and
/// more threads than most machines have CPUs.
const RUNS: [(u64, &str); 4] = [
    (500_000, "main"),
    (500_000, "1"),
    (500_000, "2"),
    (100_000, "16"),
];

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
fn run(out: &Path, state: Option<&Path>, via: &str, pairs: u64, threads: &str) -> [f64; 4] {
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
    gpumem::isolation::accounting::prepare(
        state.path(),
        &[gpumem::isolation::accounting::Cap {
            uuid: "GPU-6b1c2d3e-0000-4000-8000-000000000400".into(),
            cap_mib: 4308,
            context_charge_mib: 0,
        }],
    )
    .unwrap();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "# shim overhead on the fake driver; {} ({cpus} CPUs); {ROUNDS} rounds, bare and shimmed \
         alternated; thread CPU ns per operation and thread: median of each, and what the shim \
         adds: median [min, max] over the rounds",
        cpu_model()
    );
    for (pairs, threads) in RUNS {
        for via in ["dlsym", "gpa"] {
            let rounds: Vec<Round> = (0..ROUNDS)
                .map(|_| {
                    let bare = run(&out, None, via, pairs, threads);
                    (bare, run(&out, Some(state.path()), via, pairs, threads))
                })
                .collect();
            let column = |f: &dyn Fn(&Round) -> f64| -> Vec<f64> {
                let mut v: Vec<f64> = rounds.iter().map(f).collect();
                v.sort_by(f64::total_cmp);
                v
            };
            let pair_added = column(&|(b, s)| s[1] - b[1]);
            let info_added = column(&|(b, s)| s[3] - b[3]);
            println!(
                "{threads:>4} thread(s) × {pairs:<6} via {via:<5} alloc+free pair: bare {:6.1}, \
                 shimmed {:6.1}, added {:+6.1} [{:+6.1}, {:+6.1}]; cuMemGetInfo: bare {:5.1}, \
                 shimmed {:5.1}, added {:+5.1} [{:+5.1}, {:+5.1}]",
                median(&column(&|(b, _)| b[1])),
                median(&column(&|(_, s)| s[1])),
                median(&pair_added),
                pair_added[0],
                pair_added[pair_added.len() - 1],
                median(&column(&|(b, _)| b[3])),
                median(&column(&|(_, s)| s[3])),
                median(&info_added),
                info_added[0],
                info_added[info_added.len() - 1],
            );
        }
    }
}

/// One round's bare and shimmed figures (see `run`).
type Round = ([f64; 4], [f64; 4]);

/// Rounds per configuration.
const ROUNDS: usize = 7;

fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}
