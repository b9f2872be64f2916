//! kube-scheduler's extender wire format (`k8s.io/kube-scheduler/extender/v1`),
//! whose Go types carry no json tags: the JSON keys are the Go field names.
//!
//! Go decodes keys case-insensitively, so the old lower-case spellings some
//! schedulers and tools send are accepted too; what we send is exactly what
//! `encoding/json` would write for the Go types.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// The highest score an extender may give (`MaxExtenderPriority`); the
/// scheduler multiplies it by the extender's configured weight.
pub const MAX_PRIORITY: i64 = 10;

/// The body of a filter or prioritize call.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExtenderArgs {
    /// The pod being scheduled (`*v1.Pod`).
    #[serde(rename = "Pod", alias = "pod", default)]
    pub pod: Option<Pod>,
    /// The candidate nodes, whole; set when the extender is not
    /// `nodeCacheCapable`.
    #[serde(rename = "Nodes", alias = "nodes", default)]
    pub nodes: Option<NodeList>,
    /// The candidate nodes' names; set when the extender is
    /// `nodeCacheCapable` (then `Nodes` is null).
    #[serde(
        rename = "NodeNames",
        alias = "nodenames",
        alias = "nodeNames",
        default
    )]
    pub node_names: Option<Vec<String>>,
}

/// A `v1.NodeList`. This one has json tags (core/v1): `metadata`, `items`.
/// The items stay the very text they came as, so a filter answers with the
/// objects it got, and a request's Nodes take no more memory decoded than
/// they took as text (as `Value`s they took seven times that).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeList {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub items: Vec<Box<RawValue>>,
}

/// What a node's name is read from.
#[derive(Deserialize)]
struct Named {
    metadata: Option<Metadata>,
}

#[derive(Deserialize)]
struct Metadata {
    name: Option<String>,
}

/// Nodes without a name are skipped (the API server never sends one).
pub fn node_name(node: &RawValue) -> Option<String> {
    serde_json::from_str::<Named>(node.get())
        .ok()?
        .metadata?
        .name
}

impl ExtenderArgs {
    /// The candidate nodes' names, in the order given.
    pub fn candidates(&self) -> Vec<String> {
        match (&self.node_names, &self.nodes) {
            (Some(names), _) => names.clone(),
            (None, Some(list)) => list.items.iter().filter_map(|n| node_name(n)).collect(),
            (None, None) => Vec::new(),
        }
    }
}

/// Node name → why the pod cannot go there (`FailedNodesMap`).
pub type FailedNodes = BTreeMap<String, String>;

/// The answer to a filter call.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    /// The nodes that pass, whole; answered when they came whole.
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    /// The names of the nodes that pass; answered when names came.
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
    /// Nodes that fail, where preempting pods could make room.
    #[serde(rename = "FailedNodes", default, deserialize_with = "null_as_default")]
    pub failed_nodes: FailedNodes,
    /// Nodes that fail whatever is preempted; these take precedence.
    #[serde(
        rename = "FailedAndUnresolvableNodes",
        default,
        deserialize_with = "null_as_default"
    )]
    pub failed_and_unresolvable_nodes: FailedNodes,
    /// Set, the whole call failed: the scheduler retries the pod later.
    #[serde(rename = "Error", default, deserialize_with = "null_as_default")]
    pub error: String,
}

/// One node's score, 0 to [`MAX_PRIORITY`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    #[serde(rename = "Host", alias = "host")]
    pub host: String,
    #[serde(rename = "Score", alias = "score")]
    pub score: i64,
}

/// The answer to a prioritize call.
pub type HostPriorityList = Vec<HostPriority>;

/// The body of a bind call.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingArgs {
    #[serde(rename = "PodName", alias = "podName", alias = "podname", default)]
    pub pod_name: String,
    #[serde(
        rename = "PodNamespace",
        alias = "podNamespace",
        alias = "podnamespace",
        default
    )]
    pub pod_namespace: String,
    /// `types.UID`: a string.
    #[serde(
        rename = "PodUID",
        alias = "podUID",
        alias = "podUid",
        alias = "poduid",
        default
    )]
    pub pod_uid: String,
    #[serde(rename = "Node", alias = "node", default)]
    pub node: String,
}

/// The answer to a bind call: kube-scheduler reads `Error` from an HTTP 200
/// answer (any other status becomes "failed bind with extender … code N").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingResult {
    #[serde(rename = "Error", default, deserialize_with = "null_as_default")]
    pub error: String,
}

/// Go writes a nil map, slice or (never) string as `null`.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn keys(value: &Value) -> Vec<String> {
        let mut keys: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    }

    /// The field names of the Go types in
    /// staging/src/k8s.io/kube-scheduler/extender/v1/types.go.
    #[test]
    fn answers_use_the_go_field_names() {
        let filter = serde_json::to_value(ExtenderFilterResult::default()).unwrap();
        assert_eq!(
            keys(&filter),
            [
                "Error",
                "FailedAndUnresolvableNodes",
                "FailedNodes",
                "NodeNames",
                "Nodes"
            ]
        );
        let priority = serde_json::to_value(HostPriority {
            host: "n".into(),
            score: 3,
        })
        .unwrap();
        assert_eq!(priority, json!({"Host": "n", "Score": 3}));
        let bind = serde_json::to_value(ExtenderBindingResult::default()).unwrap();
        assert_eq!(bind, json!({"Error": ""}));
        let args = serde_json::to_value(ExtenderBindingArgs::default()).unwrap();
        assert_eq!(keys(&args), ["Node", "PodName", "PodNamespace", "PodUID"]);
        let args = serde_json::to_value(ExtenderArgs::default()).unwrap();
        assert_eq!(keys(&args), ["NodeNames", "Nodes", "Pod"]);
    }

    #[test]
    fn a_cache_capable_request_from_kube_scheduler_decodes() {
        let text = include_str!("../../tests/fixtures/extender/filter-node-names.json");
        let args: ExtenderArgs = serde_json::from_str(text).unwrap();
        let pod = args.pod.as_ref().unwrap();
        assert_eq!(pod.metadata.name.as_deref(), Some("trainer-15"));
        assert!(args.nodes.is_none());
        assert_eq!(args.candidates(), ["v100-node", "a10-node", "bare-node"]);
    }

    #[test]
    fn a_node_list_request_decodes_and_keeps_each_node_whole() {
        let text = include_str!("../../tests/fixtures/extender/filter-node-list.json");
        let args: ExtenderArgs = serde_json::from_str(text).unwrap();
        assert!(args.node_names.is_none());
        assert_eq!(args.candidates(), ["v100-node", "a10-node", "bare-node"]);
        let raw: Value = serde_json::from_str(text).unwrap();
        assert_eq!(
            serde_json::to_value(args.nodes.unwrap()).unwrap()["items"],
            raw["Nodes"]["items"],
            "nodes are answered as they came"
        );
    }

    #[test]
    fn nulls_and_lower_case_keys_as_go_accepts_them() {
        let result: ExtenderFilterResult = serde_json::from_value(json!({
            "Nodes": null, "NodeNames": ["a"], "FailedNodes": null,
            "FailedAndUnresolvableNodes": null, "Error": ""
        }))
        .unwrap();
        assert_eq!(result.node_names, Some(vec!["a".to_owned()]));
        assert!(result.failed_nodes.is_empty());
        let bind: ExtenderBindingArgs = serde_json::from_value(json!({
            "podName": "p", "podNamespace": "ns", "podUID": "u", "node": "n"
        }))
        .unwrap();
        assert_eq!((bind.pod_name.as_str(), bind.pod_uid.as_str()), ("p", "u"));
        let text = include_str!("../../tests/fixtures/extender/bind.json");
        let bind: ExtenderBindingArgs = serde_json::from_str(text).unwrap();
        assert_eq!(bind.node, "v100-node");
        assert!(!bind.pod_uid.is_empty());
    }
}
