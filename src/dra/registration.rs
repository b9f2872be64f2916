//! kubelet's plugin registration for the DRA driver: the `Registration`
//! server kubelet's plugin watcher calls, and what kubelet answered.

use serde::Serialize;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{debug, error, info};

use crate::dra::api::pluginregistration::registration_server;
use crate::dra::api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse, DRA_PLUGIN,
};
use crate::dra::api::{v1, v1beta1};
use crate::dra::health;

/// The gRPC services we serve on the DRA socket, as kubelet names them:
/// the DRAPlugin versions, newest first (kubelet takes the first it
/// knows), then the DRAResourceHealth versions, newest first. Kubelet 1.37
/// watches device health only through a service listed here; older
/// kubelets skip names they do not know, and call v1alpha1 regardless.
pub const SUPPORTED_VERSIONS: [&str; 4] = [
    v1::SERVICE,
    v1beta1::SERVICE,
    health::SERVICES[0],
    health::SERVICES[1],
];

/// Where registration with kubelet stands, for `/status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(tag = "state", content = "reason", rename_all = "lowercase")]
pub enum Registration {
    /// kubelet has not yet said how our registration went.
    #[default]
    Waiting,
    Registered,
    /// kubelet refused us, for this reason (its words).
    Refused(String),
}

/// Answers kubelet's plugin watcher on the registration socket.
pub struct RegistrationService {
    info: PluginInfo,
    state: watch::Sender<Registration>,
}

impl RegistrationService {
    /// Registers `driver_name`, whose DRA socket is `endpoint` (an absolute
    /// path, as kubelet dials it), and reports kubelet's answers to `state`.
    pub fn new(driver_name: &str, endpoint: &str, state: watch::Sender<Registration>) -> Self {
        RegistrationService {
            info: PluginInfo {
                r#type: DRA_PLUGIN.to_owned(),
                name: driver_name.to_owned(),
                endpoint: endpoint.to_owned(),
                supported_versions: SUPPORTED_VERSIONS.map(str::to_owned).to_vec(),
            },
            state,
        }
    }
}

#[tonic::async_trait]
impl registration_server::Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        debug!(driver = %self.info.name, endpoint = %self.info.endpoint, "kubelet asked for our plugin info");
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let outcome = if status.plugin_registered {
            info!(driver = %self.info.name, endpoint = %self.info.endpoint, "registered with kubelet");
            Registration::Registered
        } else {
            error!(
                driver = %self.info.name,
                reason = %status.error,
                "kubelet refused to register the DRA driver; pods with its claims will not start on this node"
            );
            Registration::Refused(status.error)
        };
        self.state.send_replace(outcome);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use registration_server::Registration as _;

    fn service() -> (RegistrationService, watch::Receiver<Registration>) {
        let (state, seen) = watch::channel(Registration::Waiting);
        let service = RegistrationService::new(
            "gpumem.io",
            "/var/lib/kubelet/plugins/gpumem.io/dra.sock",
            state,
        );
        (service, seen)
    }

    #[tokio::test]
    async fn get_info_names_the_driver_its_socket_and_its_services_newest_first() {
        let (service, _) = service();
        let info = service
            .get_info(Request::new(InfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            info,
            PluginInfo {
                r#type: "DRAPlugin".into(),
                name: "gpumem.io".into(),
                endpoint: "/var/lib/kubelet/plugins/gpumem.io/dra.sock".into(),
                supported_versions: vec![
                    "v1.DRAPlugin".into(),
                    "v1beta1.DRAPlugin".into(),
                    "v1.DRAResourceHealth".into(),
                    "v1alpha1.DRAResourceHealth".into()
                ],
            }
        );
    }

    #[tokio::test]
    async fn kubelets_answers_become_the_state() {
        let (service, seen) = service();
        assert_eq!(*seen.borrow(), Registration::Waiting);
        let notify = |plugin_registered, error: &str| {
            Request::new(RegistrationStatus {
                plugin_registered,
                error: error.to_owned(),
            })
        };
        service
            .notify_registration_status(notify(false, "endpoint already registered"))
            .await
            .unwrap();
        assert_eq!(
            *seen.borrow(),
            Registration::Refused("endpoint already registered".into())
        );
        // A kubelet restart registers us again.
        service
            .notify_registration_status(notify(true, ""))
            .await
            .unwrap();
        assert_eq!(*seen.borrow(), Registration::Registered);
    }

    #[test]
    fn the_state_serializes_for_status() {
        let json = |r: Registration| serde_json::to_value(r).unwrap();
        assert_eq!(
            json(Registration::Waiting),
            serde_json::json!({"state": "waiting"})
        );
        assert_eq!(
            json(Registration::Registered),
            serde_json::json!({"state": "registered"})
        );
        assert_eq!(
            json(Registration::Refused("no".into())),
            serde_json::json!({"state": "refused", "reason": "no"})
        );
    }
}
