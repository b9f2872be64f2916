//! Removes the accounting directories of containers that are gone: never
//! one kubelet still lists, never one a live process still uses, and only
//! after it has been unused for the whole grace period.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::deviceplugin::podresources::PodResources;
use crate::isolation::containers::{ContainerName, Containers};
use crate::isolation::inject::ShimConfig;
use crate::node::inventory::Inventory;
use crate::node::placement;

/// Since when each directory has been unused.
type UnusedSince = HashMap<ContainerName, Instant>;

/// Sweeps `<state-dir>/containers` until `shutdown`.
pub async fn run(
    shim: ShimConfig,
    inventory: watch::Receiver<Arc<Inventory>>,
    pod_resources: PodResources,
    grace: Duration,
    shutdown: CancellationToken,
) {
    let every = (grace / 4).clamp(Duration::from_millis(200), Duration::from_secs(30));
    let containers = Arc::new(shim.containers());
    let mut unused_since = UnusedSince::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let holdings = match pod_resources.holdings().await {
            Ok(h) => h,
            Err(err) => {
                // Unsure who holds what: remove nothing.
                debug!(%err, "skipping state clean-up");
                continue;
            }
        };
        let inv = inventory.borrow().clone();
        let live: HashSet<ContainerName> = holdings
            .iter()
            .filter_map(|h| {
                let assignment = placement::assign(&inv, &h.device_ids).ok()?;
                Some(ContainerName::of(&inv, assignment, &h.device_ids))
            })
            .collect();
        // Reading and removing directories blocks: off the async workers.
        let containers = containers.clone();
        match tokio::task::spawn_blocking(move || {
            sweep(&containers, &live, grace, &mut unused_since);
            unused_since
        })
        .await
        {
            Ok(kept) => unused_since = kept,
            Err(err) => {
                warn!(%err, "state clean-up stopped");
                return;
            }
        }
    }
}

fn sweep(
    containers: &Containers,
    live: &HashSet<ContainerName>,
    grace: Duration,
    unused_since: &mut UnusedSince,
) {
    let present = containers.list();
    for dir in &present {
        let in_use = live.contains(&dir.name)
            || dir
                .accounting()
                .is_ok_and(|processes| !processes.live.is_empty());
        if in_use {
            unused_since.remove(&dir.name);
            continue;
        }
        let since = *unused_since
            .entry(dir.name.clone())
            .or_insert_with(Instant::now);
        if since.elapsed() < grace {
            continue;
        }
        match dir.remove() {
            Ok(()) => {
                info!(dir = %dir.path.display(), "removed the accounting state of a finished container");
                unused_since.remove(&dir.name);
            }
            Err(err) => {
                warn!(dir = %dir.path.display(), %err, "cannot remove finished container state")
            }
        }
    }
    let present: HashSet<&ContainerName> = present.iter().map(|dir| &dir.name).collect();
    unused_since.retain(|name, _| present.contains(name));
}
