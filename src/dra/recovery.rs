//! The DRA driver's claims taken up again at its start: its checkpoint read
//! back, what a crash or a reboot left said, CDI specs nothing records removed.

use std::path::Path;
use std::sync::Arc;

use tokio::sync::watch;
use tracing::{error, warn};

use crate::dra::checkpoint::{boot_time, Checkpoint, CheckpointError};
use crate::dra::prepare::{DriverConfig, PreparedClaims};
use crate::node::inventory::Inventory;

/// Under the state dir, the DRA driver's record of prepared claims.
pub const CHECKPOINT: &str = "dra/checkpoint.json";

/// The claims prepared before this start, from the checkpoint under
/// `state_dir`: those a crash cut off or a reboot made stale are released,
/// unreadable entries said (and kept, in this boot), and CDI specs of claims
/// no longer prepared removed.
pub fn recover(
    state_dir: &Path,
    boot_id: &str,
    driver: &DriverConfig,
    client: kube::Client,
    inventory: watch::Receiver<Arc<Inventory>>,
) -> Result<PreparedClaims, CheckpointError> {
    let opened = Checkpoint::open(&state_dir.join(CHECKPOINT), boot_id)?;
    if let Some(err) = &opened.corrupt {
        error!(%err, "started a new DRA checkpoint: claims prepared before keep their CDI specs until kubelet unprepares them");
    }
    let checkpoint = opened.checkpoint.path().to_owned();
    for entry in &opened.unreadable {
        if entry.stale {
            warn!(uid = %entry.uid, error = %entry.error, checkpoint = %checkpoint.display(), "dropped an unreadable entry of the DRA checkpoint, prepared before the node rebooted");
        } else {
            error!(uid = %entry.uid, error = %entry.error, checkpoint = %checkpoint.display(), "an entry of the DRA checkpoint does not read: kept as it is; its claim keeps its CDI spec and accounting directory until kubelet unprepares it, its share of the GPU is missing from /status and metrics, and only the shim holds it to its cap");
        }
    }
    let claims = PreparedClaims::new(driver.clone(), client, inventory, opened.checkpoint);
    claims.recover(opened.interrupted, "interrupted while being prepared");
    claims.recover(opened.stale, "prepared before the node rebooted");
    // A checkpoint that did not parse, or is not there while specs are,
    // named claims whose pods may still run: kubelet reuses their CDI IDs
    // at every container restart without preparing them again, so their
    // specs stay, at this start and the next (and their directories, see
    // `live_dirs`); kubelet's Unprepare of each removes it (see `forget`).
    match boot_time() {
        Some(booted) => claims.remove_unrecorded_specs(booted),
        None => warn!("cannot read when the node booted (btime in /proc/stat): CDI specs of claims no longer prepared are left in place"),
    }
    if !opened.found {
        let kept = driver.specs.list();
        if !kept.is_empty() {
            warn!(checkpoint = %checkpoint.display(), specs = kept.len(), dir = %driver.specs.dir().display(), "no DRA checkpoint, but CDI specs of claims are there (was --state-dir changed or wiped?): kept until kubelet unprepares their claims");
        }
    }
    if let Err(err) = std::fs::create_dir_all(driver.specs.dir()) {
        warn!(dir = %driver.specs.dir().display(), %err, "--cdi-spec-dir is not usable; claims are refused until it is");
    }
    claims.refresh_specs();
    Ok(claims)
}
