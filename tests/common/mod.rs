//! Shared harness: a fake node (fixture GPUs), the in-process kubelet
//! simulator on a real unix socket, and the real plugin server.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpumem::api::deviceplugin::device_plugin_client::DevicePluginClient;
use gpumem::api::deviceplugin::Device;
use gpumem::gpu::{FakeGpus, GpuSource};
use gpumem::inventory::Inventory;
use gpumem::kubelet;
use gpumem::placement::Policy;
use gpumem::plugin::{Plugin, PluginConfig, PluginError, SOCKET_NAME};
use gpumem::resource::ResourceName;
use gpumem::simulator::KubeletSim;
use gpumem::units::MemoryUnit;
use tempfile::TempDir;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

pub const RESOURCE: &str = "aliyun.com/gpu-mem";
/// Generous: these bound waits for events, they do not time anything.
pub const WAIT: Duration = Duration::from_secs(20);

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gpus")
        .join(format!("{name}.toml"))
}

pub fn inventory(name: &str, unit: MemoryUnit) -> Inventory {
    let gpus = FakeGpus::from_file(&fixture(name))
        .unwrap()
        .discover()
        .unwrap();
    Inventory::new(gpus, unit).unwrap()
}

/// A running plugin; `kubelet` is `None` until started (to test waiting).
pub struct Node {
    pub dir: TempDir,
    pub kubelet: Option<KubeletSim>,
    pub shutdown: CancellationToken,
    pub plugin: JoinHandle<Result<(), PluginError>>,
    pub inventory: watch::Sender<Arc<Inventory>>,
}

impl Node {
    pub async fn start(fixture_name: &str, unit: MemoryUnit, policy: Policy) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        let mut node = Node::without_kubelet(dir, fixture_name, unit, policy);
        node.kubelet = Some(kubelet);
        node
    }

    pub fn without_kubelet(
        dir: TempDir,
        fixture_name: &str,
        unit: MemoryUnit,
        policy: Policy,
    ) -> Node {
        let shutdown = CancellationToken::new();
        let (tx, rx) = watch::channel(Arc::new(inventory(fixture_name, unit)));
        let plugin = Plugin::new(PluginConfig {
            kubelet_dir: dir.path().to_owned(),
            resource_name: ResourceName::default(),
            policy,
        });
        let plugin = tokio::spawn(plugin.run(rx, shutdown.clone()));
        Node {
            dir,
            kubelet: None,
            shutdown,
            plugin,
            inventory: tx,
        }
    }

    pub fn kubelet(&self) -> &KubeletSim {
        self.kubelet.as_ref().expect("kubelet started")
    }

    pub async fn devices(&self) -> Vec<Device> {
        self.kubelet()
            .wait_for_devices(RESOURCE, 1, WAIT)
            .await
            .expect("plugin registered and advertised devices")
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join(SOCKET_NAME)
    }

    /// A client of the plugin socket, as kubelet dials it.
    pub async fn client(&self) -> DevicePluginClient<Channel> {
        DevicePluginClient::new(kubelet::connect(&self.socket()).await.unwrap())
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.plugin)
            .await
            .expect("plugin stops on shutdown")
            .unwrap()
            .unwrap();
        assert!(
            !self.dir.path().join(SOCKET_NAME).exists(),
            "socket removed on shutdown"
        );
    }
}
