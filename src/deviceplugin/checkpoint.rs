//! kubelet's device-manager checkpoint, `kubelet_internal_checkpoint` in the
//! device-plugins directory: every container kubelet allocated devices to,
//! regular init containers included, which the pod-resources API never
//! lists. Read-only; kubelet writes it whole (a file renamed into place) at
//! every allocation and every device list a plugin sends, not when a pod
//! goes, so a pod that ended stays in it until the next such write.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;

use serde::Deserialize;

/// The file's name in the device-plugins directory (kubelet's
/// `kubeletDeviceManagerCheckpoint`).
pub const FILE_NAME: &str = "kubelet_internal_checkpoint";

/// One container's devices of one resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub pod_uid: String,
    pub container: String,
    pub device_ids: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read kubelet's device checkpoint {path}")]
    Read {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("kubelet's device checkpoint {path} does not parse")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct File {
    data: Data,
    // `Checksum` is kubelet's hash of Go's `%#v` rendering of `Data`: not
    // reproducible here, and a reader only needs the file to parse.
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Data {
    /// `null` with no entries (Go's nil slice). Each entry is read on its
    /// own, ours only: another resource's odd entry is none of our business.
    #[serde(default)]
    pod_device_entries: Option<Vec<serde_json::Value>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawEntry {
    #[serde(rename = "PodUID")]
    pod_uid: String,
    container_name: String,
    /// `null` when kubelet recorded none.
    #[serde(rename = "DeviceIDs", default)]
    device_ids: Option<DeviceIds>,
}

/// Per NUMA node since kubelet 1.20 (`"-1"` without topology); a plain
/// list before.
#[derive(Deserialize)]
#[serde(untagged)]
enum DeviceIds {
    ByNuma(BTreeMap<String, Option<Vec<String>>>),
    Flat(Vec<String>),
}

/// The entries of `resource` in the checkpoint at `path`; none if there is
/// no file (kubelet writes it at its first allocation or device list).
pub fn read(path: &Path, resource: &str) -> Result<Vec<Entry>, CheckpointError> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(CheckpointError::Read {
                path: path.display().to_string(),
                source,
            })
        }
    };
    let file: File = serde_json::from_slice(&text).map_err(|source| CheckpointError::Parse {
        path: path.display().to_string(),
        source,
    })?;
    let mut entries = Vec::new();
    for value in file.data.pod_device_entries.unwrap_or_default() {
        if value.get("ResourceName").and_then(|r| r.as_str()) != Some(resource) {
            continue;
        }
        let entry = RawEntry::deserialize(&value).map_err(|source| CheckpointError::Parse {
            path: path.display().to_string(),
            source,
        })?;
        entries.push(Entry {
            pod_uid: entry.pod_uid,
            container: entry.container_name,
            device_ids: match entry.device_ids {
                Some(DeviceIds::ByNuma(by_node)) => {
                    by_node.into_values().flatten().flatten().collect()
                }
                Some(DeviceIds::Flat(ids)) => ids,
                None => Vec::new(),
            },
        });
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RESOURCE: &str = "aliyun.com/gpu-mem";

    fn read_text(text: &str) -> Result<Vec<Entry>, CheckpointError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        std::fs::write(&path, text).unwrap();
        read(&path, RESOURCE)
    }

    #[test]
    fn entries_of_our_resource_in_both_formats() {
        // As kubelet 1.20 and later write it (AllocResp is base64 protobuf).
        let current = r#"{"Data":{"PodDeviceEntries":[
            {"PodUID":"p1","ContainerName":"init","ResourceName":"aliyun.com/gpu-mem",
             "DeviceIDs":{"-1":["a-0","a-1"]},"AllocResp":"CgA="},
            {"PodUID":"p1","ContainerName":"main","ResourceName":"nvidia.com/gpu",
             "DeviceIDs":{"0":["GPU-1"]},"AllocResp":"CgA="},
            {"PodUID":"p2","ContainerName":"main","ResourceName":"aliyun.com/gpu-mem",
             "DeviceIDs":{"0":["b-0"],"1":["b-1"]},"AllocResp":"CgA="}],
            "RegisteredDevices":{"aliyun.com/gpu-mem":["a-0","a-1","b-0","b-1"]}},
            "Checksum":2868414553}"#;
        let entries = read_text(current).unwrap();
        assert_eq!(
            entries,
            [
                Entry {
                    pod_uid: "p1".into(),
                    container: "init".into(),
                    device_ids: vec!["a-0".into(), "a-1".into()],
                },
                Entry {
                    pod_uid: "p2".into(),
                    container: "main".into(),
                    device_ids: vec!["b-0".into(), "b-1".into()],
                },
            ]
        );
        // Before 1.20: a flat list, no NUMA nodes.
        let older = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"p3","ContainerName":"c",
            "ResourceName":"aliyun.com/gpu-mem","DeviceIDs":["c-0"],"AllocResp":"CgA="}],
            "RegisteredDevices":{}},"Checksum":1}"#;
        assert_eq!(read_text(older).unwrap()[0].device_ids, ["c-0"]);
        // Another resource's entry of another shape, and none of ours.
        let odd = r#"{"Data":{"PodDeviceEntries":[{"PodUID":"p4","ContainerName":"c",
            "ResourceName":"example.com/fpga","DeviceIDs":7},{"PodUID":"p5",
            "ContainerName":"c","ResourceName":"aliyun.com/gpu-mem","DeviceIDs":null},
            {"PodUID":"p6","ContainerName":"c","ResourceName":"aliyun.com/gpu-mem",
            "DeviceIDs":{"-1":null,"0":["d-0"]}}]},"Checksum":1}"#;
        let entries = read_text(odd).unwrap();
        assert_eq!(entries[0].device_ids, Vec::<String>::new());
        assert_eq!(entries[1].device_ids, ["d-0"]);
        // No allocation yet.
        let empty = r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":1}"#;
        assert_eq!(read_text(empty).unwrap(), []);
    }

    #[test]
    fn a_missing_file_has_no_entries_and_a_broken_one_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        assert_eq!(read(&path, RESOURCE).unwrap(), []);
        std::fs::write(&path, "{\"Data\":").unwrap();
        let err = read(&path, RESOURCE).unwrap_err().to_string();
        assert!(err.contains(FILE_NAME), "{err}");
    }
}
