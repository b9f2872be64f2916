//! Removes the accounting directories of containers that are gone (and
//! their CDI specs): never one kubelet still lists, never one a live process
//! still uses, and only after it has been unused for the whole grace period.
//! With CDI, also keeps a spec beside every directory a holder holds.

use crate::error_text::chain;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::isolation::cdi::SpecDir;
use crate::isolation::containers::{ContainerName, Containers};
use crate::isolation::inject::{self, ShimConfig};
use crate::node::inventory::Inventory;
use crate::node::units::MemoryUnit;

/// Since when each directory has been unused.
type UnusedSince = HashMap<ContainerName, Instant>;

/// Who holds accounting directories now, as the front end knows it: the
/// device plugin asks kubelet's pod-resources API, the DRA driver its
/// prepared claims.
#[tonic::async_trait]
pub trait Holders: Send + Sync + 'static {
    /// The directories in use; an error when unsure, and then nothing is
    /// removed.
    async fn live(&self) -> Result<HashSet<ContainerName>, String>;

    /// The directories whose containers may be started again without the
    /// front end being asked, read without its live service: after a reboot
    /// kubelet restarts containers from its cached Allocate answers, maybe
    /// before it answers pod-resources. `None` when it cannot tell; then
    /// every directory counts. Blocking.
    fn restartable(&self) -> Option<HashSet<ContainerName>> {
        None
    }

    /// Runs `remove`, the removal of `name`'s directory, unless a holder
    /// took the directory since `live` answered (`None`); on a blocking
    /// thread. A front end whose taking can race with clean-up checks again
    /// and runs `remove` under its own lock.
    fn remove_unless_taken(
        &self,
        _name: &ContainerName,
        remove: &mut dyn FnMut() -> std::io::Result<()>,
    ) -> Option<std::io::Result<()>> {
        Some(remove())
    }
}

/// Sweeps `<state-dir>/containers` (and the CDI specs in `specs`, with the
/// `cdi` device-list strategy) until `shutdown`.
pub async fn run(
    shim: ShimConfig,
    specs: Option<SpecDir>,
    inventory: watch::Receiver<Arc<Inventory>>,
    holders: impl Holders,
    grace: Duration,
    shutdown: CancellationToken,
) {
    let every = (grace / 4).clamp(Duration::from_millis(200), Duration::from_secs(30));
    let containers = Arc::new(shim.containers());
    let shim = Arc::new(shim);
    let specs = specs.map(Arc::new);
    let holders = Arc::new(holders);
    let mut unused_since = UnusedSince::new();
    let mut told = HashSet::new();
    // The specs of the directories `live` holds, or else those the holders'
    // own records say may be restarted.
    let sync = |inv: Arc<Inventory>, live: Option<HashSet<ContainerName>>| {
        let (containers, specs, shim) = (containers.clone(), specs.clone(), shim.clone());
        let holders = holders.clone();
        async move {
            let Some(specs) = specs else { return Ok(()) };
            // Reading and writing files blocks: off the async workers.
            tokio::task::spawn_blocking(move || {
                let held = live.or_else(|| holders.restartable());
                sync_specs(&containers, &specs, &shim, &inv, held.as_ref())
            })
            .await
        }
    };
    // The specs at once: after a reboot, containers kubelet restarts from its
    // cached Allocate answers need them back, and kubelet's checkpoint names
    // them. Pod-resources waits for the first sweep (its answers are cached
    // and shared with /status).
    let inv = inventory.borrow().clone();
    if let Err(err) = sync(inv, None).await {
        warn!(err = %chain(&err), "state clean-up stopped");
        return;
    }
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let inv = inventory.borrow().clone();
        let live = holders.live().await;
        if let Err(err) = sync(inv.clone(), live.as_ref().ok().cloned()).await {
            warn!(err = %chain(&err), "state clean-up stopped");
            return;
        }
        let live = match live {
            Ok(live) => live,
            Err(err) => {
                // Unsure who holds what: remove nothing.
                debug!(%err, "skipping state clean-up");
                continue;
            }
        };
        // Reading and removing directories blocks: off the async workers.
        let (containers, specs, holders) = (containers.clone(), specs.clone(), holders.clone());
        match tokio::task::spawn_blocking(move || {
            warn_of_other_units(&live, &containers, inv.unit(), &mut told);
            sweep(
                &containers,
                specs.as_deref(),
                &live,
                &*holders,
                grace,
                &mut unused_since,
            );
            (unused_since, told)
        })
        .await
        {
            Ok(kept) => (unused_since, told) = kept,
            Err(err) => {
                warn!(err = %chain(&err), "state clean-up stopped");
                return;
            }
        }
    }
}

fn sweep(
    containers: &Containers,
    specs: Option<&SpecDir>,
    live: &HashSet<ContainerName>,
    holders: &impl Holders,
    grace: Duration,
    unused_since: &mut UnusedSince,
) {
    // Specs before directories: Allocate makes the directory first, so a
    // spec listed here whose container is new has its directory listed below.
    let spec_names = specs.map(SpecDir::list).unwrap_or_default();
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
        // The spec goes with its directory, under the front end's lock: a
        // container given the same units since `live` answered has the same
        // directory and CDI device name, and keeps both. The spec first: a
        // directory whose spec could not be removed stays and is tried
        // again, so no spec is left without its directory.
        let mut spec_failed = false;
        let mut remove = || {
            if let Some(specs) = specs {
                if let Err(err) = specs.remove(dir.name.as_str()) {
                    let spec = specs.path(dir.name.as_str());
                    warn!(spec = %spec.display(), err = %chain(&err), "cannot remove a finished container's CDI spec");
                    spec_failed = true;
                    return Ok(());
                }
            }
            dir.remove()
        };
        let removed = holders.remove_unless_taken(&dir.name, &mut remove);
        if spec_failed {
            continue;
        }
        match removed {
            Some(Ok(())) => {
                info!(dir = %dir.path.display(), "removed the accounting state of a finished container");
                unused_since.remove(&dir.name);
            }
            Some(Err(err)) => {
                warn!(dir = %dir.path.display(), err = %chain(&err), "cannot remove finished container state")
            }
            None => {
                debug!(dir = %dir.path.display(), "taken again meanwhile: kept");
                unused_since.remove(&dir.name);
            }
        }
    }
    let present: HashSet<&str> = present.iter().map(|dir| dir.name.as_str()).collect();
    if let Some(specs) = specs {
        // A spec whose directory is gone (removed by hand, or by a plugin
        // run without CDI) names a mount that no longer exists.
        let live: HashSet<&str> = live.iter().map(ContainerName::as_str).collect();
        for name in spec_names {
            if present.contains(name.as_str()) || live.contains(name.as_str()) {
                continue;
            }
            match specs.remove(&name) {
                Ok(()) => {
                    info!(spec = %specs.path(&name).display(), "removed a CDI spec without accounting state")
                }
                Err(err) => {
                    warn!(spec = %specs.path(&name).display(), err = %chain(&err), "cannot remove a stale CDI spec")
                }
            }
        }
    }
    unused_since.retain(|name, _| present.contains(name.as_str()));
}

/// Says once for each container kubelet still holds units for that were
/// allocated in GiB while the unit is now MiB: kubelet counts the device
/// IDs it holds in the unit of today, so 4 units allocated in GiB count as
/// 4 MiB, and the GPU can be handed out past its memory until the container
/// ends. (The other way nothing is handed out twice: 4096 MiB units hold
/// every GiB unit's ID.)
fn warn_of_other_units(
    live: &HashSet<ContainerName>,
    containers: &Containers,
    now: MemoryUnit,
    told: &mut HashSet<ContainerName>,
) {
    let then = MemoryUnit::GiB;
    if now != MemoryUnit::MiB {
        return;
    }
    for name in live {
        // `live` has every unit's name a holding may have: only a
        // directory made in that unit is one.
        if name.unit() == Some(then)
            && !told.contains(name)
            && containers.get(name.clone()).path.is_dir()
        {
            told.insert(name.clone());
            warn!(
                container = %name.as_str(),
                allocated_in = %then,
                counted_in = %now,
                "kubelet still holds units of a container allocated before --memory-unit changed: it now counts them in the new unit, so their GPU can be handed out past its memory until the container ends; drain the node's GPU pods before changing --memory-unit"
            );
        }
    }
}

/// Gives every container directory present that `held` holds (every one
/// when `None`: unsure) and whose spec is missing the spec Allocate wrote
/// for it. Specs under /var/run are gone after a reboot, while kubelet
/// restarts containers from its cached Allocate answers without asking
/// again; a spec removed by hand would stay gone too. A directory no holder
/// holds is a container's that ended, waiting out its grace period: its
/// spec would name it to the runtime again, so it is left without one. A
/// spec that is there is left as Allocate wrote it, even if the flags
/// changed since (a container keeps what it was given).
fn sync_specs(
    containers: &Containers,
    specs: &SpecDir,
    shim: &ShimConfig,
    inv: &Inventory,
    held: Option<&HashSet<ContainerName>>,
) {
    for dir in containers.list() {
        if specs.path(dir.name.as_str()).exists() {
            continue;
        }
        if held.is_some_and(|held| !held.contains(&dir.name)) {
            debug!(dir = %dir.path.display(), "no spec written for a container kubelet no longer holds");
            continue;
        }
        let Some(spec) = inject::cdi_spec(inv, shim, &dir) else {
            continue;
        };
        match specs.write(&spec) {
            Ok(_) => {
                info!(spec = %specs.path(dir.name.as_str()).display(), "wrote the missing CDI spec of a container")
            }
            Err(err) => warn!(err = %chain(&err), "cannot write a container's CDI spec"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A front end that took `taken` again after answering `live`.
    struct TookAgain {
        taken: ContainerName,
    }

    #[tonic::async_trait]
    impl Holders for TookAgain {
        async fn live(&self) -> Result<HashSet<ContainerName>, String> {
            Ok(HashSet::new())
        }

        fn remove_unless_taken(
            &self,
            name: &ContainerName,
            remove: &mut dyn FnMut() -> std::io::Result<()>,
        ) -> Option<std::io::Result<()>> {
            (*name != self.taken).then(remove)
        }
    }

    /// Two clean-up passes with no grace, nothing live, and `taken` taken
    /// again before each removal.
    fn sweep_taken_again(containers: &Containers, specs: Option<&SpecDir>, taken: &ContainerName) {
        let holders = TookAgain {
            taken: taken.clone(),
        };
        let mut unused_since = UnusedSince::new();
        for _ in 0..2 {
            sweep(
                containers,
                specs,
                &HashSet::new(),
                &holders,
                Duration::ZERO,
                &mut unused_since,
            );
        }
    }

    /// A directory the live set left out, but that its holder took again
    /// before the removal, stays; the others past their grace go.
    #[test]
    fn a_directory_taken_again_before_its_removal_stays() {
        let state = tempfile::tempdir().unwrap();
        let containers = Containers::in_state_dir(state.path());
        let (kept, gone) = (
            ContainerName::of_claim("11111111-aaaa").unwrap(),
            ContainerName::of_claim("22222222-bbbb").unwrap(),
        );
        for name in [&kept, &gone] {
            std::fs::create_dir_all(containers.get(name.clone()).path).unwrap();
        }
        sweep_taken_again(&containers, None, &kept);
        assert!(containers.get(kept).path.is_dir());
        assert!(!containers.get(gone).path.exists());
    }

    /// A container given an ended one's units gets its directory and the
    /// same CDI device name; a clean-up that found the directory unused
    /// just before must leave the new container's spec, or the runtime
    /// cannot resolve the device Allocate answered.
    #[test]
    fn a_spec_taken_again_before_its_removal_stays_with_its_directory() {
        let state = tempfile::tempdir().unwrap();
        let containers = Containers::in_state_dir(state.path());
        let specs = SpecDir::new(state.path().join("cdi"));
        let (kept, gone) = (
            ContainerName::of_claim("11111111-aaaa").unwrap(),
            ContainerName::of_claim("22222222-bbbb").unwrap(),
        );
        for name in [&kept, &gone] {
            std::fs::create_dir_all(containers.get(name.clone()).path).unwrap();
            let spec = crate::isolation::cdi::container_spec(
                name.as_str(),
                crate::isolation::cdi::ContainerEdits::default(),
            )
            .unwrap();
            specs.write(&spec).unwrap();
        }
        sweep_taken_again(&containers, Some(&specs), &kept);
        assert!(
            specs.read(kept.as_str()).is_ok(),
            "the new container's spec went"
        );
        assert!(containers.get(kept).path.is_dir());
        assert!(!specs.path(gone.as_str()).exists());
        assert!(!containers.get(gone).path.exists());
    }
}
