//! Removes the accounting directories of containers that are gone: never
//! one kubelet still lists, never one a live process still uses, and only
//! after it has been unused for the whole grace period.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::accounting;
use crate::inject::{container_dir_name, ShimConfig};
use crate::inventory::Inventory;
use crate::placement;
use crate::podresources::PodResources;

/// Sweeps `<state-dir>/containers` until `shutdown`.
pub async fn run(
    shim: ShimConfig,
    inventory: watch::Receiver<Arc<Inventory>>,
    pod_resources: PodResources,
    grace: Duration,
    shutdown: CancellationToken,
) {
    let every = (grace / 4).clamp(Duration::from_millis(200), Duration::from_secs(30));
    let mut unused_since: HashMap<String, Instant> = HashMap::new();
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
        let live: HashSet<String> = holdings
            .iter()
            .filter_map(|h| {
                let assignment = placement::assign(&inv, &h.device_ids).ok()?;
                Some(container_dir_name(&inv, assignment, &h.device_ids))
            })
            .collect();
        sweep(&shim.containers_dir(), &live, grace, &mut unused_since);
    }
}

fn sweep(
    dir: &Path,
    live: &HashSet<String>,
    grace: Duration,
    unused_since: &mut HashMap<String, Instant>,
) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut present = HashSet::new();
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        present.insert(name.clone());
        let path = entry.path();
        let in_use = live.contains(&name)
            || accounting::has_live_process(&path.join(gpumem_layout::FILE_NAME)).unwrap_or(false);
        if in_use {
            unused_since.remove(&name);
            continue;
        }
        let since = *unused_since
            .entry(name.clone())
            .or_insert_with(Instant::now);
        if since.elapsed() < grace {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {
                info!(dir = %path.display(), "removed the accounting state of a finished container");
                unused_since.remove(&name);
            }
            Err(err) => {
                warn!(dir = %path.display(), %err, "cannot remove finished container state")
            }
        }
    }
    unused_since.retain(|name, _| present.contains(name));
}
