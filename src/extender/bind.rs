//! The bind verb: choose the pod's GPU on the node the scheduler chose,
//! book it (an assumption) and create the pod's Binding with gpushare's
//! annotations, which the API server merges into the pod in the same step.
//!
//! The choice and the booking happen under the cache's one lock, so two
//! binds at once never get the same free units. A bind the API server
//! refuses drops its booking; one whose outcome is unknown (no answer in
//! time) keeps it until the watch shows the pod or the booking expires.

use crate::error_text::one_line;
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::Value;
use tracing::{info, warn};

use crate::cluster::gpushare::{allocation_value, annotation, placed, sole_container};
use crate::extender::api::ExtenderBindingArgs;
use crate::extender::cache::{Assume, Assumption};
use crate::extender::fit::{self, GpuFit};
use crate::extender::watch::{lock, SharedCache};
use crate::node::placement::Policy;

/// A bind's API calls (a read of the pod where the watch has not shown it,
/// and the Binding) must all answer within this: kube-scheduler waits on
/// the whole bind for its `httpTimeout` (5 s unless configured).
pub const API_CALL_BOUND: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("the extender has not listed pods and nodes yet (is the API server reachable?); the scheduler will retry")]
    NotSynced,
    #[error("bind request without PodName, PodNamespace or Node: {0:?}")]
    BadRequest(ExtenderBindingArgs),
    #[error("cannot read pod {pod}")]
    Lookup { pod: String, source: kube::Error },
    #[error("cannot read pod {pod}: no answer from the API server within {bound:?}")]
    LookupTimeout { pod: String, bound: Duration },
    #[error("pod {pod} has UID {found}, not {asked}: it was deleted and created again")]
    OtherPod {
        pod: String,
        asked: String,
        found: String,
    },
    #[error("pod {pod} is already bound to node {node}")]
    AlreadyBound { pod: String, node: String },
    #[error("cannot bind {pod} ({units} units) to node {node}: {reason}")]
    NoFit {
        pod: String,
        node: String,
        units: u64,
        reason: String,
    },
    #[error("the API server refused binding {pod} to node {node}")]
    Refused {
        pod: String,
        node: String,
        source: kube::Error,
    },
    #[error("binding {pod} to node {node}: {what}; whether it took effect is unknown")]
    Unanswered {
        pod: String,
        node: String,
        what: String,
    },
    #[error(
        "binding {pod} to node {node}: {what}; whether it took effect is unknown, so GPU {gpu}'s \
         {units} units stay booked for the pod until the watch shows it bound or {expiry:?} pass"
    )]
    Unknown {
        pod: String,
        node: String,
        what: String,
        gpu: u32,
        units: u64,
        expiry: Duration,
    },
}

impl BindError {
    /// The failure's kind, as `gpumem_extender_binds_total` labels it.
    pub fn reason(&self) -> &'static str {
        match self {
            BindError::NotSynced => "not_synced",
            BindError::BadRequest(_) => "bad_request",
            BindError::Lookup { .. } | BindError::LookupTimeout { .. } => "pod_unreadable",
            BindError::OtherPod { .. } => "other_pod",
            BindError::AlreadyBound { .. } => "already_bound",
            BindError::NoFit { .. } => "no_fit",
            BindError::Refused { .. } => "api_refused",
            BindError::Unanswered { .. } | BindError::Unknown { .. } => "unanswered",
        }
    }
}

/// Where a bind put the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// The GPU chosen, `None` for a pod that asks for no units.
    pub gpu: Option<GpuFit>,
    pub units: u64,
}

/// Binds pods for the scheduler.
pub struct Binder {
    pub client: Client,
    pub cache: SharedCache,
    pub policy: Policy,
    /// How long a booking waits for the watch to show its pod bound.
    pub assume_timeout: Duration,
}

/// What the bind needs to know of the pod.
struct Target {
    uid: String,
    units: u64,
    /// Its one container asking for units, by index in `spec.containers`.
    container: Option<usize>,
}

impl Binder {
    pub async fn bind(&self, args: &ExtenderBindingArgs) -> Result<Bound, BindError> {
        if args.pod_name.is_empty() || args.pod_namespace.is_empty() || args.node.is_empty() {
            return Err(BindError::BadRequest(args.clone()));
        }
        let pod = format!("{}/{}", args.pod_namespace, args.pod_name);
        let deadline = tokio::time::Instant::now() + API_CALL_BOUND;
        let target = self.target(args, &pod, deadline).await?;
        let node = args.node.as_str();
        if target.units == 0 {
            self.create_binding(args, &target.uid, BTreeMap::new(), deadline)
                .await
                .map_err(|err| match err {
                    Outcome::Refused(source) => BindError::Refused {
                        pod: pod.clone(),
                        node: node.to_owned(),
                        source,
                    },
                    Outcome::Unknown(what) => BindError::Unanswered {
                        pod: pod.clone(),
                        node: node.to_owned(),
                        what,
                    },
                })?;
            info!(pod, node, "bound (asks for no GPU memory)");
            return Ok(Bound {
                gpu: None,
                units: 0,
            });
        }
        let (gpu, assumption) = {
            let mut cache = lock(&self.cache);
            let now = Instant::now();
            for expired in cache.expire(now) {
                warn!(%expired, "a bind never showed in the pod watch; its booking expired");
            }
            let gpu = fit::choose(&cache, node, target.units, self.policy).map_err(|unfit| {
                BindError::NoFit {
                    pod: pod.clone(),
                    node: node.to_owned(),
                    units: target.units,
                    reason: unfit.reason,
                }
            })?;
            let assumption = cache.assume(
                Assume {
                    uid: &target.uid,
                    namespace: &args.pod_namespace,
                    name: &args.pod_name,
                    node,
                    gpu: gpu.index,
                    units: target.units,
                },
                now + self.assume_timeout,
            );
            (gpu, assumption)
        };
        let mut annotations = BTreeMap::new();
        for (key, value) in placed(gpu.index, target.units, gpu.size, SystemTime::now()) {
            if let Value::String(value) = value {
                annotations.insert(key, value);
            }
        }
        annotations.insert(annotation::ASSIGNED.to_owned(), "false".to_owned());
        if let Some(container) = target.container {
            let allocation =
                BTreeMap::from([(container, BTreeMap::from([(gpu.index, target.units)]))]);
            if let Value::String(value) = allocation_value(&allocation) {
                annotations.insert(annotation::ALLOCATION.to_owned(), value);
            }
        }
        match self
            .create_binding(args, &target.uid, annotations, deadline)
            .await
        {
            Ok(()) => {
                info!(pod, node, gpu = gpu.index, units = target.units, "bound");
                Ok(Bound {
                    gpu: Some(gpu),
                    units: target.units,
                })
            }
            Err(Outcome::Refused(source)) => {
                self.forget(&assumption);
                Err(BindError::Refused {
                    pod,
                    node: node.to_owned(),
                    source,
                })
            }
            Err(Outcome::Unknown(what)) => Err(BindError::Unknown {
                pod,
                node: node.to_owned(),
                what,
                gpu: gpu.index,
                units: target.units,
                expiry: self.assume_timeout,
            }),
        }
    }

    fn forget(&self, assumption: &Assumption) {
        lock(&self.cache).forget(assumption);
    }

    /// The pod's UID and units: from the watch, else from the API server
    /// (the watch may not have shown a pod created a moment ago).
    async fn target(
        &self,
        args: &ExtenderBindingArgs,
        pod: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Target, BindError> {
        {
            let cache = lock(&self.cache);
            if !cache.synced() {
                return Err(BindError::NotSynced);
            }
            if let Some(record) = cache.pod(&args.pod_uid) {
                if record.namespace == args.pod_namespace && record.name == args.pod_name {
                    if let Some(node) = &record.node {
                        return Err(BindError::AlreadyBound {
                            pod: pod.to_owned(),
                            node: node.clone(),
                        });
                    }
                    return Ok(Target {
                        uid: args.pod_uid.clone(),
                        units: record.units,
                        container: record.container,
                    });
                }
            }
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &args.pod_namespace);
        let found = tokio::time::timeout_at(deadline, api.get(&args.pod_name))
            .await
            .map_err(|_| BindError::LookupTimeout {
                pod: pod.to_owned(),
                bound: API_CALL_BOUND,
            })?
            .map_err(|source| BindError::Lookup {
                pod: pod.to_owned(),
                source,
            })?;
        let uid = found.metadata.uid.clone().unwrap_or_default();
        if !args.pod_uid.is_empty() && uid != args.pod_uid {
            return Err(BindError::OtherPod {
                pod: pod.to_owned(),
                asked: args.pod_uid.clone(),
                found: uid,
            });
        }
        if let Some(node) = found
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty())
        {
            return Err(BindError::AlreadyBound {
                pod: pod.to_owned(),
                node,
            });
        }
        let resource = lock(&self.cache).resource().to_owned();
        let units = fit::request(&found, &resource).map_err(|reason| BindError::NoFit {
            pod: pod.to_owned(),
            node: args.node.clone(),
            units: 0,
            reason,
        })?;
        let container = sole_container(&found, &resource);
        Ok(Target {
            uid,
            units,
            container,
        })
    }

    /// `POST pods/{name}/binding`, naming the pod's UID so a pod deleted
    /// and created again under the same name is not bound by mistake.
    async fn create_binding(
        &self,
        args: &ExtenderBindingArgs,
        uid: &str,
        annotations: BTreeMap<String, String>,
        deadline: tokio::time::Instant,
    ) -> Result<(), Outcome> {
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(args.pod_name.clone()),
                namespace: Some(args.pod_namespace.clone()),
                uid: Some(uid.to_owned()).filter(|u| !u.is_empty()),
                annotations: Some(annotations).filter(|a| !a.is_empty()),
                ..ObjectMeta::default()
            },
            target: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(args.node.clone()),
                ..ObjectReference::default()
            },
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &args.pod_namespace);
        let params = PostParams::default();
        let call = api.create_subresource::<_, Value>("binding", &args.pod_name, &params, &binding);
        match tokio::time::timeout_at(deadline, call).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(err @ kube::Error::Api(_))) => Err(Outcome::Refused(err)),
            Ok(Err(err)) => Err(Outcome::Unknown(one_line(&err))),
            Err(_) => Err(Outcome::Unknown(format!(
                "no answer from the API server within {API_CALL_BOUND:?}"
            ))),
        }
    }
}

/// A Binding that did not take: refused, or unknown.
enum Outcome {
    Refused(kube::Error),
    Unknown(String),
}
