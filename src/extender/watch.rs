//! Keeps the extender's cache current: one watch on every pod and one on
//! every node (kube-runtime watchers, which relist after a 410 or a lost
//! connection), each change applied to the cache as it comes.
//!
//! The watchers' events are applied directly rather than through a
//! reflector store: the cache keeps only what it needs of each object (a
//! pod's units, node and GPU; a node's GPU list), and a relist replaces it
//! whole, so pods deleted while the watch was down stop counting.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::cluster::backoff::{backed_off, relisting};
use crate::cluster::client::describe_watch;
use crate::cluster::gpushare::requested_units;
use crate::extender::cache::Cache;
use crate::sync::LockExt;

/// The cache, shared by the watches and the verbs. Held briefly, never
/// across an await.
pub type SharedCache = Arc<Mutex<Cache>>;

pub fn lock(cache: &Mutex<Cache>) -> MutexGuard<'_, Cache> {
    cache.lock_unpoisoned()
}

/// How one kind's events change the cache.
trait Kept: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static {
    const WHAT: &'static str;
    /// Whether a relist must keep the object until it completes.
    fn wanted(_resource: &str, _object: &Self) -> bool {
        true
    }
    fn apply(cache: &mut Cache, object: &Self);
    fn remove(cache: &mut Cache, object: &Self);
    fn replace(cache: &mut Cache, all: &[Self]);
}

impl Kept for Pod {
    const WHAT: &'static str = "pods";
    /// A relist lists every pod in the cluster; only those asking for the
    /// resource are kept until it completes.
    fn wanted(resource: &str, pod: &Pod) -> bool {
        requested_units(pod, resource) > 0
    }
    fn apply(cache: &mut Cache, pod: &Pod) {
        if let Some(confirmed) = cache.apply_pod(pod) {
            debug!(%confirmed, "the pod watch shows the bind; booking confirmed");
        }
    }
    fn remove(cache: &mut Cache, pod: &Pod) {
        cache.remove_pod(pod);
    }
    fn replace(cache: &mut Cache, all: &[Pod]) {
        cache.replace_pods(all);
    }
}

impl Kept for Node {
    const WHAT: &'static str = "nodes";
    fn apply(cache: &mut Cache, node: &Node) {
        cache.apply_node(node);
    }
    fn remove(cache: &mut Cache, node: &Node) {
        if let Some(name) = &node.metadata.name {
            cache.remove_node(name);
        }
    }
    fn replace(cache: &mut Cache, all: &[Node]) {
        cache.replace_nodes(all);
    }
}

/// Starts both watches; they run until `stop`.
pub fn spawn(client: Client, cache: SharedCache, stop: CancellationToken) -> [JoinHandle<()>; 2] {
    [
        tokio::spawn(follow::<Pod>(
            Api::all(client.clone()),
            cache.clone(),
            stop.clone(),
        )),
        tokio::spawn(follow::<Node>(Api::all(client), cache, stop)),
    ]
}

async fn follow<K>(api: Api<K>, cache: SharedCache, stop: CancellationToken)
where
    K: Kept,
    K::DynamicType: Default,
{
    let resource = lock(&cache).resource().to_owned();
    let stream = backed_off(relisting(api, watcher::Config::default()));
    let mut stream = std::pin::pin!(stream);
    // A relist's objects, applied together once it is complete.
    let mut listing: Vec<K> = Vec::new();
    loop {
        let next = tokio::select! {
            () = stop.cancelled() => return,
            next = stream.next() => next,
        };
        let Some((next, wait)) = next else { return };
        match &next {
            // Init only says a list is about to be tried: it proves nothing.
            Ok(Event::Init) => {}
            Ok(_) => lock(&cache).watch_delivered(K::WHAT),
            Err(err) => lock(&cache).watch_failed(K::WHAT, describe_watch(err), Instant::now()),
        }
        match next {
            Ok(Event::Init) => listing.clear(),
            Ok(Event::InitApply(object)) => {
                if K::wanted(&resource, &object) {
                    listing.push(object);
                }
            }
            Ok(Event::InitDone) => {
                K::replace(&mut lock(&cache), &listing);
                info!(kept = listing.len(), "listed {}", K::WHAT);
                listing = Vec::new();
            }
            Ok(Event::Apply(object)) => {
                debug!(
                    name = object.meta().name.as_deref().unwrap_or(""),
                    "{} changed",
                    K::WHAT
                );
                K::apply(&mut lock(&cache), &object);
            }
            Ok(Event::Delete(object)) => K::remove(&mut lock(&cache), &object),
            // The watcher relists and rewatches (410 Gone included) when
            // polled again, after the wait. One that keeps failing turns
            // /healthz to 503 (`Cache::stale`).
            Err(err) => warn!(
                err = %describe_watch(&err),
                retry_in = ?wait.unwrap_or_default(),
                "watching {}", K::WHAT
            ),
        }
    }
}
