//! The extended resource name we register, validated the way kubelet's
//! `IsExtendedResourceName` does so a bad name fails at start, not in Register.

use std::fmt;
use std::str::FromStr;

/// gpushare's name, so existing manifests and `arena` keep working.
pub const DEFAULT_RESOURCE_NAME: &str = "aliyun.com/gpu-mem";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceName(String);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid resource name {name:?}: {reason}")]
pub struct InvalidResourceName {
    pub name: String,
    pub reason: &'static str,
}

/// What NVIDIA's device plugin registers: whole GPUs.
pub const NVIDIA_RESOURCE_NAME: &str = "nvidia.com/gpu";

impl ResourceName {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is NVIDIA's device plugin's name. kubelet keeps one
    /// plugin per name, so the two would replace each other at every
    /// registration, and pods asking for a GPU would get memory units. A
    /// node without NVIDIA's plugin may still want it, so it is allowed.
    pub fn is_nvidias(&self) -> bool {
        self.0 == NVIDIA_RESOURCE_NAME
    }
}

impl Default for ResourceName {
    fn default() -> Self {
        ResourceName(DEFAULT_RESOURCE_NAME.to_owned())
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for ResourceName {
    type Err = InvalidResourceName;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let fail = |reason| {
            Err(InvalidResourceName {
                name: name.to_owned(),
                reason,
            })
        };
        let Some((prefix, local)) = name.split_once('/') else {
            return fail("must be <domain>/<name>, e.g. aliyun.com/gpu-mem");
        };
        if name.contains("kubernetes.io/") {
            return fail("the kubernetes.io domains are reserved for Kubernetes");
        }
        if name.starts_with("requests.") {
            return fail("must not start with \"requests.\"");
        }
        // kubelet validates "requests.<name>" as a qualified name.
        if !is_dns_subdomain(&format!("requests.{prefix}")) {
            return fail("domain must be a lower-case DNS subdomain");
        }
        if !is_qualified_local_name(local) {
            return fail(
                "name after '/' must be 1-63 characters of [A-Za-z0-9._-], starting and ending \
                 with a letter or digit",
            );
        }
        Ok(ResourceName(name.to_owned()))
    }
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

fn is_dns_label(label: &str) -> bool {
    let bytes = label.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-'))
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}

fn is_qualified_local_name(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_extended_names() {
        for ok in [
            "aliyun.com/gpu-mem",
            "example.com/GPU_mem.v2",
            "gpumem.io/mem",
        ] {
            assert!(ok.parse::<ResourceName>().is_ok(), "{ok}");
        }
    }

    #[test]
    fn knows_nvidias_name() {
        assert!(NVIDIA_RESOURCE_NAME
            .parse::<ResourceName>()
            .unwrap()
            .is_nvidias());
        assert!(!ResourceName::default().is_nvidias());
        assert!(!"nvidia.com/gpu-mem"
            .parse::<ResourceName>()
            .unwrap()
            .is_nvidias());
    }

    #[test]
    fn rejects_what_kubelet_rejects() {
        for bad in [
            "gpu-mem",
            "kubernetes.io/gpu-mem",
            "foo.kubernetes.io/gpu-mem",
            "requests.example.com/mem",
            "Example.com/mem",
            "example.com/",
            "example.com/-mem",
            "example.com/a/b",
            "/mem",
            "ex_ample.com/mem",
        ] {
            assert!(bad.parse::<ResourceName>().is_err(), "{bad}");
        }
        let err = "gpu-mem".parse::<ResourceName>().unwrap_err();
        assert!(err
            .to_string()
            .starts_with("invalid resource name \"gpu-mem\""));
    }
}
