//! Device health for kubelet (KEP-4680, `ResourceHealthStatus`): the
//! `DRAResourceHealth` stream on the DRA socket, fed by the node's health
//! watcher through the inventory, which kubelet puts in pod status.
//!
//! kubelet calls `NodeWatchResources` when it registers the driver, and
//! again every 5 s while the call fails. Kubelets 1.31 to 1.36 call
//! v1alpha1 on every driver; 1.37 calls only a version our registration
//! lists (see [`SERVICES`]), v1 first. Both versions carry the same
//! messages and are served from one stream. Every message must be the
//! driver's complete list: kubelet stamps each device
//! with the time the message arrived and reads a device not heard of for
//! 30 s (its default `health_check_timeout_seconds`) as Unknown, so the list
//! is repeated well within that, changed or not.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::Stream;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::debug;

use crate::dra::api::health::{v1, v1alpha1};
use crate::dra::slice;
use crate::node::inventory::Inventory;

/// How often the complete list is sent when nothing changed: a third of
/// kubelet's 30 s timeout, so one late message costs nothing.
pub const REPEAT: Duration = Duration::from_secs(10);

/// The health service versions we serve, newest first, as registration
/// lists them: kubelet 1.37 opens the stream only for a driver that lists
/// one, and takes the first it knows.
pub const SERVICES: [&str; 2] = [v1::SERVICE, v1alpha1::SERVICE];

/// A device's health, as both API versions know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy,
    /// Nothing watches it.
    Unknown,
}

/// Each device's health, by device name, in one pool.
pub type Report = BTreeMap<String, Health>;

/// The health of every device this driver offers, by its name in the
/// ResourceSlice: every GPU big enough for one unit. An unhealthy GPU is
/// withdrawn from the slice but still reported (Unhealthy): claims
/// prepared on it before are what kubelet needs to hear about. Without a
/// health watcher (`checked` false: NVML's health checks did not start),
/// nothing watches the GPUs, so those discovery found healthy are Unknown.
pub fn report(inventory: &Inventory, checked: bool) -> Report {
    inventory
        .gpus()
        .iter()
        .filter(|g| g.units > 0)
        .map(|g| {
            let health = match (g.gpu.healthy, checked) {
                (false, _) => Health::Unhealthy,
                (true, true) => Health::Healthy,
                (true, false) => Health::Unknown,
            };
            (slice::device_name(&g.gpu), health)
        })
        .collect()
}

/// `report` as kubelet's message in API version `$version` (v1 and
/// v1alpha1 have the same fields, in their own types): pool `pool` (the
/// slice's pool, the node's name), each device's health last determined at
/// `now` (Unix seconds).
macro_rules! message {
    ($version:ident, $pool:expr, $report:expr, $now:expr) => {
        $version::NodeWatchResourcesResponse {
            devices: $report
                .iter()
                .map(|(device, health)| $version::DeviceHealth {
                    device: Some($version::DeviceIdentifier {
                        pool_name: $pool.to_owned(),
                        device_name: device.clone(),
                    }),
                    health: match health {
                        Health::Healthy => $version::HealthStatus::Healthy,
                        Health::Unhealthy => $version::HealthStatus::Unhealthy,
                        Health::Unknown => $version::HealthStatus::Unknown,
                    }
                    .into(),
                    last_updated_time: $now,
                    // kubelet's default (30 s), which REPEAT keeps well within.
                    health_check_timeout_seconds: 0,
                    message: String::new(),
                })
                .collect(),
        }
    };
}

/// `report` as kubelet 1.37's message (see [`message!`]).
pub fn message_v1(pool: &str, report: &Report, now: i64) -> v1::NodeWatchResourcesResponse {
    message!(v1, pool, report, now)
}

/// `report` as the message of kubelets before 1.37 (see [`message!`]).
pub fn message_v1alpha1(
    pool: &str,
    report: &Report,
    now: i64,
) -> v1alpha1::NodeWatchResourcesResponse {
    message!(v1alpha1, pool, report, now)
}

/// What the stream reads: the inventory the health watcher keeps current.
#[derive(Clone)]
pub struct HealthFeed {
    /// The slice's pool name: the node's name.
    pub pool: String,
    pub inventory: watch::Receiver<Arc<Inventory>>,
    /// Whether a health watcher runs (see [`report`]).
    pub checked: bool,
}

/// The `DRAResourceHealth` service, in both versions: one stream per call,
/// each ending when `stop` is cancelled, so the server drains at shutdown.
#[derive(Clone)]
pub struct HealthService {
    feed: HealthFeed,
    stop: CancellationToken,
    repeat: Duration,
}

impl HealthService {
    pub fn new(feed: HealthFeed, stop: CancellationToken) -> Self {
        HealthService {
            feed,
            stop,
            repeat: REPEAT,
        }
    }

    /// The stream of one call, each message made by `to`.
    fn watch<M: Send + 'static>(&self, to: fn(&str, &Report, i64) -> M) -> HealthStream<M> {
        let mut repeat = tokio::time::interval_at(Instant::now() + self.repeat, self.repeat);
        repeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let watching = Watching {
            feed: self.feed.clone(),
            stop: self.stop.clone(),
            repeat,
            sent: None,
        };
        let stream = futures_util::stream::unfold(watching, move |mut watching| async move {
            let (report, now) = watching.next().await?;
            let message = to(&watching.feed.pool, &report, now);
            Some((Ok(message), watching))
        });
        Box::pin(stream)
    }
}

type HealthStream<M> = Pin<Box<dyn Stream<Item = Result<M, Status>> + Send + 'static>>;

/// One stream's state between messages.
struct Watching {
    feed: HealthFeed,
    stop: CancellationToken,
    repeat: tokio::time::Interval,
    sent: Option<Report>,
}

impl Watching {
    /// The next report and its time: at once for the first, then on a
    /// change of health or when it is time to repeat; `None` at shutdown or
    /// when the inventory is gone (the daemon is stopping).
    async fn next(&mut self) -> Option<(Report, i64)> {
        loop {
            let current = report(&self.feed.inventory.borrow_and_update(), self.feed.checked);
            if self.sent.as_ref() != Some(&current) {
                if self.sent.is_some() {
                    debug!(pool = %self.feed.pool, health = ?current, "device health changed; telling kubelet");
                }
                self.repeat.reset();
                return Some(self.send(current));
            }
            tokio::select! {
                () = self.stop.cancelled() => return None,
                changed = self.feed.inventory.changed() => changed.ok()?,
                _ = self.repeat.tick() => return Some(self.send(current)),
            }
        }
    }

    fn send(&mut self, report: Report) -> (Report, i64) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.sent = Some(report.clone());
        (report, now)
    }
}

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream<v1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        debug!("NodeWatchResources (v1): kubelet watches device health");
        Ok(Response::new(self.watch(message_v1)))
    }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream<v1alpha1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        debug!("NodeWatchResources (v1alpha1): kubelet watches device health");
        Ok(Response::new(self.watch(message_v1alpha1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::gpu::{test_gpu, Gpu};
    use crate::node::units::MemoryUnit;
    use futures_util::StreamExt;
    use prost::Message as _;
    use v1::dra_resource_health_server::DraResourceHealth as _;

    fn gpu(index: u32, memory_mib: u64) -> Gpu {
        test_gpu(index, &format!("GPU-{index}"), memory_mib)
    }

    fn inventory(gpus: Vec<Gpu>) -> Inventory {
        Inventory::new(gpus, MemoryUnit::GiB).unwrap()
    }

    #[test]
    fn every_gpu_the_slice_can_offer_is_reported_sick_or_not() {
        let inv = inventory(vec![gpu(0, 15079), gpu(1, 15079), gpu(2, 512)]);
        let inv = inv.with_health("GPU-1", false).unwrap();
        let want = Report::from([
            ("gpu-0".into(), Health::Healthy),
            ("gpu-1".into(), Health::Unhealthy),
        ]);
        // gpu-2 holds no whole GiB: never in the slice, so not reported.
        assert_eq!(report(&inv, true), want);
        // Nobody watches: what looked healthy at start is Unknown.
        assert_eq!(
            report(&inv, false),
            Report::from([
                ("gpu-0".into(), Health::Unknown),
                ("gpu-1".into(), Health::Unhealthy),
            ])
        );
        let message = message_v1("node-a", &want, 1_700_000_000);
        let first = &message.devices[0];
        let id = first.device.as_ref().unwrap();
        assert_eq!(
            (id.pool_name.as_str(), id.device_name.as_str()),
            ("node-a", "gpu-0")
        );
        assert_eq!(first.health(), v1::HealthStatus::Healthy);
        assert_eq!(first.last_updated_time, 1_700_000_000);
        assert_eq!(message.devices[1].health(), v1::HealthStatus::Unhealthy);
        // The older version: the same message, field for field.
        let alpha = message_v1alpha1("node-a", &want, 1_700_000_000);
        assert_eq!(alpha.encode_to_vec(), message.encode_to_vec());
    }

    async fn next(
        stream: &mut HealthStream<v1::NodeWatchResourcesResponse>,
    ) -> Option<Result<v1::NodeWatchResourcesResponse, Status>> {
        tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await
            .expect("a message within a minute")
    }

    fn health_of(message: &v1::NodeWatchResourcesResponse) -> Vec<v1::HealthStatus> {
        message.devices.iter().map(|d| d.health()).collect()
    }

    fn watched(gpus: usize) -> (watch::Sender<Arc<Inventory>>, HealthFeed) {
        let gpus = (0..gpus).map(|i| gpu(i as u32, 15079)).collect();
        let (tx, rx) = watch::channel(Arc::new(inventory(gpus)));
        let feed = HealthFeed {
            pool: "node-a".into(),
            inventory: rx,
            checked: true,
        };
        (tx, feed)
    }

    async fn watch(service: &HealthService) -> HealthStream<v1::NodeWatchResourcesResponse> {
        service
            .node_watch_resources(Request::new(v1::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner()
    }

    #[tokio::test]
    async fn the_list_comes_at_once_then_on_every_change_of_health_until_shutdown() {
        use v1::HealthStatus::{Healthy, Unhealthy};
        let (tx, feed) = watched(2);
        let stop = CancellationToken::new();
        // No repeat within the test: every message is the first or a change.
        let service = HealthService {
            repeat: Duration::from_secs(3600),
            ..HealthService::new(feed, stop.clone())
        };
        let mut stream = watch(&service).await;
        let first = next(&mut stream).await.unwrap().unwrap();
        assert_eq!(health_of(&first), [Healthy, Healthy]);

        // A change that leaves health as it was sends nothing.
        tx.send_modify(|_| {});
        let sick = Arc::new(tx.borrow().with_health("GPU-1", false).unwrap());
        tx.send_replace(sick);
        let changed = next(&mut stream).await.unwrap().unwrap();
        assert_eq!(health_of(&changed), [Healthy, Unhealthy]);

        stop.cancel();
        assert!(
            next(&mut stream).await.is_none(),
            "the stream ends at shutdown"
        );
    }

    #[tokio::test]
    async fn the_list_is_repeated_unchanged_so_kubelet_does_not_time_it_out() {
        let (_tx, feed) = watched(1);
        let service = HealthService {
            repeat: Duration::from_millis(20),
            ..HealthService::new(feed, CancellationToken::new())
        };
        let mut stream = watch(&service).await;
        for _ in 0..3 {
            let message = next(&mut stream).await.unwrap().unwrap();
            assert_eq!(health_of(&message), [v1::HealthStatus::Healthy]);
        }
        assert!(
            REPEAT * 3 <= Duration::from_secs(30),
            "kubelet's default timeout"
        );
    }
}
