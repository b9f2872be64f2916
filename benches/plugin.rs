//! Plugin benchmarks (not tests): `cargo bench --bench plugin`.
//!
//! Start-to-registered, Allocate and GetPreferredAllocation latency over the
//! real unix socket (1 and 16 concurrent callers), ListAndWatch message sizes,
//! and the pure placement function at 8 GPUs × 141 units. Results and the
//! machine they were taken on go to docs/BENCHMARKS.md.
mod common;

use common::percentile;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpumem::deviceplugin::api::deviceplugin::device_plugin_client::DevicePluginClient;
use gpumem::deviceplugin::api::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    PreferredAllocationRequest,
};
use gpumem::deviceplugin::list::{self, list_and_watch, KUBELET_MAX_MESSAGE};
use gpumem::deviceplugin::plugin::{Plugin, PluginConfig, SOCKET_NAME};
use gpumem::isolation::inject::Isolation;
use gpumem::kubelet::unix;
use gpumem::node::gpu::Gpu;
use gpumem::node::inventory::Inventory;
use gpumem::node::placement::{self, Policy};
use gpumem::node::units::MemoryUnit;
use gpumem_testkit::simulator::KubeletSim;
use prost::Message;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

fn gpus(count: u32, memory_mib: u64) -> Vec<Gpu> {
    (0..count)
        .map(|i| Gpu {
            index: i,
            uuid: format!("GPU-{i:08x}-0000-4000-8000-000000000000"),
            name: "bench".into(),
            memory_mib,
            healthy: true,
        })
        .collect()
}

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    println!(
        "{name:<48} n={:<6} p50={:>8.1?} p99={:>8.1?} max={:>8.1?}",
        samples.len(),
        percentile(&samples, 0.50),
        percentile(&samples, 0.99),
        samples[samples.len() - 1]
    );
}

fn list_and_watch_sizes() {
    println!("\n# ListAndWatch message size (kubelet limit {KUBELET_MAX_MESSAGE} bytes)");
    for (count, gib) in [(1u32, 16u64), (8, 16), (1, 141), (8, 141)] {
        for unit in [MemoryUnit::GiB, MemoryUnit::MiB] {
            let start = Instant::now();
            let outcome = Inventory::new(gpus(count, gib * 1024), unit)
                .map_err(|err| err.to_string())
                .and_then(|inv| {
                    list::check(&inv)
                        .map(|()| inv)
                        .map_err(|err| err.to_string())
                });
            let built = start.elapsed();
            match outcome {
                Ok(inv) => {
                    let start = Instant::now();
                    let bytes = list_and_watch(&inv).encode_to_vec().len();
                    println!(
                        "{count} × {gib:>3} GiB in {unit}: {:>7} devices, {bytes:>8} bytes, build+check {built:.1?}, encode {:.1?}",
                        inv.device_count(),
                        start.elapsed()
                    );
                }
                Err(err) => println!("{count} × {gib:>3} GiB in {unit}: refused at start: {err}"),
            }
        }
    }
}

fn preferred_allocation_pure() {
    println!("\n# GetPreferredAllocation logic, 8 GPUs × 141 units");
    let inv = Inventory::new(gpus(8, 141 * 1024), MemoryUnit::GiB).unwrap();
    let available: Vec<String> = list_and_watch(&inv)
        .devices
        .into_iter()
        .map(|d| d.id)
        .collect();
    let mut samples = Vec::new();
    for i in 0..2000 {
        let start = Instant::now();
        let picked =
            placement::prefer(&inv, Policy::Binpack, &available, &[], 1 + (i % 64)).unwrap();
        samples.push(start.elapsed());
        assert!(!picked.is_empty());
    }
    report("prefer(binpack, 1128 available, 1..64 units)", samples);
}

async fn socket_latency() {
    println!("\n# Over the unix socket (T4 node, in-process kubelet simulator)");
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let inv = Inventory::new(gpus(1, 15079), MemoryUnit::GiB).unwrap();
    let (_tx, rx) = watch::channel(Arc::new(inv.clone()));
    let shutdown = CancellationToken::new();
    let start = Instant::now();
    let plugin = Plugin::new(PluginConfig {
        kubelet_dir: dir.path().to_owned(),
        resource_name: Default::default(),
        policy: Policy::Binpack,
        isolation: Isolation::None,
        device_list: Default::default(),
    });
    let task = tokio::spawn(plugin.run(rx, shutdown.clone()));
    kubelet
        .wait_for_devices("aliyun.com/gpu-mem", 1, Duration::from_secs(10))
        .await
        .unwrap();
    println!(
        "start to registered and devices received: {:.1?}",
        start.elapsed()
    );

    let ids: Vec<String> = list_and_watch(&inv)
        .devices
        .into_iter()
        .map(|d| d.id)
        .collect();
    let socket = dir.path().join(SOCKET_NAME);
    for callers in [1usize, 16] {
        let mut handles = Vec::new();
        for _ in 0..callers {
            let socket = socket.clone();
            let ids = ids.clone();
            handles.push(tokio::spawn(async move {
                let mut client = DevicePluginClient::new(unix::connect(&socket).await.unwrap());
                let (mut alloc, mut prefer) = (Vec::new(), Vec::new());
                for i in 0..2000usize {
                    let request = AllocateRequest {
                        container_requests: vec![ContainerAllocateRequest {
                            devices_ids: ids[i % 10..i % 10 + 4].to_vec(),
                        }],
                    };
                    let start = Instant::now();
                    client.allocate(request).await.unwrap();
                    alloc.push(start.elapsed());
                    let request = PreferredAllocationRequest {
                        container_requests: vec![ContainerPreferredAllocationRequest {
                            available_device_i_ds: ids.clone(),
                            must_include_device_i_ds: vec![],
                            allocation_size: 4,
                        }],
                    };
                    let start = Instant::now();
                    client.get_preferred_allocation(request).await.unwrap();
                    prefer.push(start.elapsed());
                }
                (alloc, prefer)
            }));
        }
        let (mut alloc, mut prefer) = (Vec::new(), Vec::new());
        for h in handles {
            let (a, p) = h.await.unwrap();
            alloc.extend(a);
            prefer.extend(p);
        }
        report(&format!("Allocate, {callers} concurrent caller(s)"), alloc);
        report(
            &format!("GetPreferredAllocation, {callers} concurrent caller(s)"),
            prefer,
        );
    }
    shutdown.cancel();
    let _ = task.await;
    kubelet.stop().await;
}

/// VmRSS and VmHWM of a process, KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The real `gpumem plugin` binary: memory idle and after Allocate load.
async fn daemon_memory() {
    println!("\n# gpumem plugin process memory (release binary, T4 fake node, shim isolation)");
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpus/t4.toml");
    let host = dir.path().join("shim");
    std::fs::create_dir_all(&host).unwrap();
    std::fs::write(
        host.join("libgpumem_shim.so"),
        b"placeholder: only its presence is checked",
    )
    .unwrap();
    std::fs::write(
        host.join("ld.so.preload"),
        b"/usr/local/gpumem/libgpumem_shim.so\n",
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .arg("plugin")
        .arg("--kubelet-dir")
        .arg(dir.path())
        .arg("--fake-gpus")
        .arg(&node)
        .arg("--shim-host-dir")
        .arg(&host)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--pod-resources-socket")
        .arg(kubelet.pod_resources_socket())
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    kubelet
        .wait_for_devices("aliyun.com/gpu-mem", 1, Duration::from_secs(10))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (idle, _) = rss_kib(child.id());
    println!(
        "idle after registration: RSS {:.1} MiB",
        idle as f64 / 1024.0
    );
    let socket = dir.path().join(SOCKET_NAME);
    let mut handles = Vec::new();
    for _ in 0..16 {
        let socket = socket.clone();
        handles.push(tokio::spawn(async move {
            let mut client = DevicePluginClient::new(unix::connect(&socket).await.unwrap());
            let ids: Vec<String> = (0..4)
                .map(|u| {
                    format!(
                        "{}-{u}",
                        gpumem::node::inventory::GpuKey::of(
                            "GPU-6b1c2d3e-0000-4000-8000-000000000400"
                        )
                    )
                })
                .collect();
            for _ in 0..1000 {
                let request = AllocateRequest {
                    container_requests: vec![ContainerAllocateRequest {
                        devices_ids: ids.clone(),
                    }],
                };
                client.allocate(request).await.unwrap();
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let (now, peak) = rss_kib(child.id());
    println!(
        "after 16 × 1000 Allocate calls (shim isolation, accounting files written): RSS {:.1} MiB, peak {:.1} MiB",
        now as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    let _ = child.kill();
    let _ = child.wait();
    kubelet.stop().await;
}

fn main() {
    // `cargo test --benches` runs this with --bench absent: keep that quick.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    list_and_watch_sizes();
    preferred_allocation_pure();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            socket_latency().await;
            daemon_memory().await;
        });
}
