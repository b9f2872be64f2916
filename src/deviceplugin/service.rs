//! The DevicePlugin gRPC service kubelet calls: translates between protobuf
//! and the pure inventory, placement and inject functions.

use crate::error_text::{chain, one_line};
use std::pin::Pin;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::cluster::gpushare::{Extender, GpushareError};
use crate::cluster::pods::PodsError;
use crate::deviceplugin::api::deviceplugin::device_plugin_server::DevicePlugin;
use crate::deviceplugin::api::deviceplugin::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, DevicePluginOptions, Empty, ListAndWatchResponse, Mount,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use crate::deviceplugin::holders::Granted;
use crate::deviceplugin::list;
use crate::isolation::containers::ContainerName;
use crate::isolation::inject::{self, DeviceListStrategy, Grant, InjectError, Isolation};
use crate::node::inventory::Inventory;
use crate::node::placement::{self, Assignment, IdSample, PlacementError, Policy};

/// The options we register with and report from GetDevicePluginOptions.
pub fn plugin_options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

impl From<InjectError> for Status {
    fn from(err: InjectError) -> Self {
        match err {
            // The node is not set up as the flags say: tell the user.
            InjectError::ShimMissing(_) | InjectError::Cdi(_) => {
                Status::failed_precondition(one_line(&err))
            }
            InjectError::Accounting(_) => Status::internal(one_line(&err)),
        }
    }
}

impl From<PlacementError> for Status {
    fn from(err: PlacementError) -> Self {
        if err.is_bad_request() {
            Status::invalid_argument(one_line(&err))
        } else {
            Status::resource_exhausted(one_line(&err))
        }
    }
}

impl From<GpushareError> for Status {
    fn from(err: GpushareError) -> Self {
        match err {
            GpushareError::Placement(err) => err.into(),
            GpushareError::Pods(PodsError::Timeout(_)) => Status::deadline_exceeded(one_line(&err)),
            GpushareError::Pods(_) => Status::unavailable(one_line(&err)),
            _ => Status::failed_precondition(one_line(&err)),
        }
    }
}

/// Allocate outcomes since start, registered once with the metrics.
#[derive(Debug, Default)]
pub struct Counters {
    pub allocations: Counter,
    pub allocation_errors: Counter,
}

/// What ties a service's ListAndWatch streams to its socket generation.
#[derive(Clone)]
pub struct Streams {
    /// Ends them, so a graceful server shutdown does not wait for them for
    /// ever.
    pub stop: CancellationToken,
    /// Cancelled when kubelet ends one while the generation still serves.
    pub hung_up: CancellationToken,
    /// Changed to send the device list again unchanged (see
    /// `deviceplugin::holders`).
    pub resend: watch::Receiver<u64>,
}

/// One socket generation's service.
#[derive(Clone)]
pub struct DevicePluginService {
    inventory: watch::Receiver<Arc<Inventory>>,
    policy: Policy,
    isolation: Arc<Isolation>,
    device_list: Arc<DeviceListStrategy>,
    counters: Arc<Counters>,
    streams: Streams,
    /// Placement decided by gpushare's scheduler extender, if it runs.
    extender: Option<Arc<Extender>>,
    /// Where Allocate records the directories it takes, for clean-up.
    granted: Granted,
}

impl DevicePluginService {
    pub fn new(
        inventory: watch::Receiver<Arc<Inventory>>,
        policy: Policy,
        isolation: Arc<Isolation>,
        device_list: DeviceListStrategy,
        counters: Arc<Counters>,
        streams: Streams,
    ) -> Self {
        DevicePluginService {
            inventory,
            policy,
            isolation,
            device_list: Arc::new(device_list),
            counters,
            streams,
            extender: None,
            granted: Granted::default(),
        }
    }

    /// Records the directories Allocate takes in `granted`, which clean-up
    /// reads.
    pub fn with_granted(mut self, granted: Granted) -> Self {
        self.granted = granted;
        self
    }

    /// Places each container on the GPU gpushare's extender chose for it.
    pub fn with_extender(mut self, extender: Option<Arc<Extender>>) -> Self {
        self.extender = extender;
        self
    }

    fn snapshot(&self) -> Arc<Inventory> {
        self.inventory.borrow().clone()
    }
}

/// Lives in a ListAndWatch stream: dropped while its generation still
/// serves, the stream was ended by kubelet, which never calls ListAndWatch
/// again on its own (the plugin must register again).
struct HangUp {
    stop: CancellationToken,
    hung_up: CancellationToken,
}

impl Drop for HangUp {
    fn drop(&mut self) {
        if !self.stop.is_cancelled() {
            self.hung_up.cancel();
        }
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut rx = self.inventory.clone();
        rx.mark_changed();
        let stop = self.streams.stop.clone();
        let hang_up = HangUp {
            stop: stop.clone(),
            hung_up: self.streams.hung_up.clone(),
        };
        let resend = self.streams.resend.clone();
        // The full list at once, then again on every change or when asked
        // to resend; the stream ends only when this socket generation stops
        // or kubelet hangs up.
        let stream = futures_util::stream::unfold(
            (rx, resend, stop, hang_up),
            |(mut rx, mut resend, stop, hang_up)| async move {
                tokio::select! {
                    () = stop.cancelled() => return None,
                    changed = rx.changed() => if changed.is_err() {
                        // Nobody will update the inventory again; the list stays
                        // valid, so keep the stream open rather than look dead.
                        stop.cancelled().await;
                        return None;
                    },
                    Ok(()) = resend.changed() => {}
                }
                let list = list::list_and_watch(&rx.borrow_and_update());
                Some((Ok(list), (rx, resend, stop, hang_up)))
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let inv = self.snapshot();
        let mut container_responses = Vec::new();
        for req in request.into_inner().container_requests {
            if let Some(extender) = &self.extender {
                let picked = extender
                    .prefer(
                        &inv,
                        &req.available_device_i_ds,
                        &req.must_include_device_i_ds,
                        i64::from(req.allocation_size),
                    )
                    .await
                    .inspect_err(
                        |err| warn!(size = req.allocation_size, err = %chain(err), "no preferred allocation"),
                    )?;
                container_responses.push(ContainerPreferredAllocationResponse {
                    device_i_ds: picked,
                });
                continue;
            }
            let picked = placement::prefer(
                &inv,
                self.policy,
                &req.available_device_i_ds,
                &req.must_include_device_i_ds,
                i64::from(req.allocation_size),
            )
            .inspect_err(
                |err| warn!(size = req.allocation_size, err = %chain(err), "no preferred allocation"),
            )?;
            container_responses.push(ContainerPreferredAllocationResponse {
                device_i_ds: picked,
            });
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        self.counters.allocations.inc();
        let result = self.allocate_containers(request.into_inner()).await;
        if result.is_err() {
            self.counters.allocation_errors.inc();
        }
        result.map(Response::new)
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// One container's request: the device IDs kubelet gave it and where they
/// are, resolved once for every step of Allocate.
struct Placed {
    ids: Vec<String>,
    assignment: Assignment,
}

impl DevicePluginService {
    /// Places every container before anything is written or marked: the
    /// response is all or nothing.
    async fn allocate_containers(
        &self,
        request: AllocateRequest,
    ) -> Result<AllocateResponse, Status> {
        let inv = self.snapshot();
        let placed = place_all(&inv, request)?;
        if let Some(extender) = &self.extender {
            // Each container must be where gpushare's extender put its pod;
            // confirming marks the pod assigned.
            for container in &placed {
                extender
                    .confirm(&inv, container.assignment)
                    .await
                    .inspect_err(|err| {
                        warn!(ids = %IdSample::of(&container.ids), err = %chain(err), "Allocate rejected");
                    })?;
            }
        }
        let isolation = self.isolation.clone();
        let device_list = self.device_list.clone();
        let granted = self.granted.clone();
        // Creating and syncing accounting files and CDI specs blocks: off
        // the async workers.
        tokio::task::spawn_blocking(move || {
            grant_all(&inv, placed, &isolation, &device_list, &granted)
        })
        .await
        .unwrap_or_else(|err| {
            Err(Status::internal(format!(
                "Allocate failed: {}",
                chain(&err)
            )))
        })
    }
}

/// Resolves each container's device IDs to one GPU and a unit count.
fn place_all(inv: &Inventory, request: AllocateRequest) -> Result<Vec<Placed>, Status> {
    let requests = request.container_requests;
    if requests.is_empty() {
        return Err(Status::invalid_argument(
            "Allocate request holds no container requests",
        ));
    }
    requests
        .into_iter()
        .map(|req| {
            let assignment = placement::assign(inv, &req.devices_ids).inspect_err(|err| {
                warn!(ids = %IdSample::of(&req.devices_ids), err = %chain(err), "Allocate rejected");
            })?;
            Ok(Placed {
                ids: req.devices_ids,
                assignment,
            })
        })
        .collect()
}

/// Prepares every placed container: accounting files, CDI specs, and the
/// env and mounts kubelet passes on.
fn grant_all(
    inv: &Inventory,
    placed: Vec<Placed>,
    isolation: &Isolation,
    device_list: &DeviceListStrategy,
    granted: &Granted,
) -> Result<AllocateResponse, Status> {
    let mut container_responses = Vec::with_capacity(placed.len());
    for Placed { ids, assignment } in placed {
        let gpu = &inv.gpus()[assignment.gpu];
        info!(
            gpu = gpu.gpu.index,
            uuid = %gpu.gpu.uuid,
            units = assignment.units,
            cap_mib = gpu.cap_mib(assignment.units),
            "Allocate"
        );
        let name = ContainerName::of(inv, assignment, &ids);
        let grant = granted
            .grant(name, || {
                inject::container_grant(inv, assignment, &ids, isolation, device_list)
            })
            .inspect_err(|err| warn!(err = %chain(err), "Allocate failed"))?;
        container_responses.push(container_response(grant));
    }
    Ok(AllocateResponse {
        container_responses,
    })
}

/// A grant in the device plugin's words.
fn container_response(grant: Grant) -> ContainerAllocateResponse {
    ContainerAllocateResponse {
        envs: grant.env.into_iter().collect(),
        mounts: grant
            .mounts
            .into_iter()
            .map(|(container, host, read_only)| Mount {
                container_path: container.display().to_string(),
                host_path: host.display().to_string(),
                read_only,
            })
            .collect(),
        cdi_devices: grant
            .cdi_devices
            .into_iter()
            .map(|name| CdiDevice { name })
            .collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::cdi::CdiError;

    #[test]
    fn a_status_tells_kubelet_the_cause_once() {
        let err = InjectError::Cdi(CdiError::Write {
            path: "/var/run/cdi/gpumem.json".into(),
            source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied"),
        });
        let status = Status::from(err);
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert_eq!(
            status.message(),
            "cannot write the CDI spec /var/run/cdi/gpumem.json (--cdi-spec-dir): denied"
        );
    }
}
