//! A CDI spec checked as the CDI specification defines it: for the specs
//! the device plugin and the DRA driver write.

#![allow(dead_code)]

use std::collections::BTreeSet;

use serde_json::Value;

/// Checks a CDI spec as cncf-tags/container-device-interface's SPEC.md
/// defines it and its Go package validates it when a runtime loads a spec
/// (`pkg/cdi/spec.go` validate, `pkg/parser`, `specs-go/version.go`); an
/// independent reading of the spec, not gpumem's code.
pub fn check_cdi_spec(spec: &Value) -> Result<(), String> {
    let top = spec.as_object().ok_or("not an object")?;
    // The Go package parses strictly: no field it does not know.
    only_keys(
        top,
        &[
            "cdiVersion",
            "kind",
            "annotations",
            "devices",
            "containerEdits",
        ],
    )?;
    let version = top["cdiVersion"]
        .as_str()
        .ok_or("cdiVersion: not a string")?;
    const RELEASED: [&str; 10] = [
        "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
    ];
    let index = RELEASED
        .iter()
        .position(|v| *v == version)
        .ok_or_else(|| format!("cdiVersion {version:?} is not a released CDI version"))?;
    let mut needs = "0.3.0"; // the earliest the Go package accepts

    let kind = top["kind"].as_str().ok_or("kind: not a string")?;
    let (vendor, class) = kind
        .split_once('/')
        .ok_or_else(|| format!("kind {kind:?}: no vendor/class"))?;
    // SPEC.md: the prefix a DNS subdomain, the name segment at most 63
    // characters, alphanumeric at both ends, '-', '_', '.' between.
    if vendor.len() > 253
        || !vendor.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
    {
        return Err(format!("kind {kind:?}: the vendor is not a DNS subdomain"));
    }
    if class.is_empty()
        || class.len() > 63
        || !class.as_bytes()[0].is_ascii_alphanumeric()
        || !class.as_bytes()[class.len() - 1].is_ascii_alphanumeric()
        || !class
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(format!("kind {kind:?}: bad name segment"));
    }
    // pkg/parser: vendor and class begin with a letter.
    if !vendor.as_bytes()[0].is_ascii_alphabetic() || !class.as_bytes()[0].is_ascii_alphabetic() {
        return Err(format!(
            "kind {kind:?}: vendor and class must begin with a letter"
        ));
    }
    if class.contains('.') {
        needs = later(needs, "0.6.0");
    }
    if top.contains_key("annotations") {
        needs = later(needs, "0.6.0");
    }

    let devices = top["devices"].as_array().ok_or("devices: not an array")?;
    if devices.is_empty() {
        return Err("devices: at least one is required".into());
    }
    let mut names = BTreeSet::new();
    for device in devices {
        let device = device.as_object().ok_or("a device is not an object")?;
        only_keys(device, &["name", "annotations", "containerEdits"])?;
        let name = device
            .get("name")
            .and_then(Value::as_str)
            .ok_or("a device has no name")?;
        let bytes = name.as_bytes();
        if bytes.is_empty()
            || !bytes[0].is_ascii_alphanumeric()
            || !bytes[bytes.len() - 1].is_ascii_alphanumeric()
            || !bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(b))
        {
            return Err(format!("device name {name:?} is not valid"));
        }
        if bytes[0].is_ascii_digit() {
            needs = later(needs, "0.5.0");
        }
        if !names.insert(name) {
            return Err(format!("device {name:?} twice"));
        }
        if device.contains_key("annotations") {
            needs = later(needs, "0.6.0");
        }
        // The schema requires containerEdits; the Go package refuses empty ones.
        let edits = device
            .get("containerEdits")
            .ok_or_else(|| format!("device {name:?}: no containerEdits"))?;
        let edits_needs = check_edits(edits)?;
        if edits.as_object().is_some_and(|e| e.is_empty()) {
            return Err(format!("device {name:?}: empty containerEdits"));
        }
        needs = later(needs, edits_needs);
    }
    if let Some(edits) = top.get("containerEdits") {
        needs = later(needs, check_edits(edits)?);
    }
    let needed = RELEASED.iter().position(|v| *v == needs).unwrap();
    if index < needed {
        return Err(format!(
            "cdiVersion {version} is older than the {needs} its content needs"
        ));
    }
    Ok(())
}

/// Env `KEY=VALUE`, mounts with hostPath and containerPath; what else this
/// spec needs no test for is refused. Returns the version the edits need.
fn check_edits(edits: &Value) -> Result<&'static str, String> {
    let edits = edits.as_object().ok_or("containerEdits: not an object")?;
    only_keys(edits, &["env", "mounts"])?;
    let mut needs = "0.3.0";
    if let Some(env) = edits.get("env") {
        for entry in env.as_array().ok_or("env: not an array")? {
            let entry = entry.as_str().ok_or("env: not a string")?;
            // pkg/cdi ValidateEnv: a '=' after a non-empty name.
            if entry.find('=').is_none_or(|at| at == 0) {
                return Err(format!("env {entry:?} is not KEY=VALUE"));
            }
        }
    }
    if let Some(mounts) = edits.get("mounts") {
        for mount in mounts.as_array().ok_or("mounts: not an array")? {
            let mount = mount.as_object().ok_or("a mount is not an object")?;
            only_keys(mount, &["hostPath", "containerPath", "type", "options"])?;
            for key in ["hostPath", "containerPath"] {
                let path = mount
                    .get(key)
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("a mount has no {key}"))?;
                if !path.starts_with('/') {
                    return Err(format!("mount {key} {path:?} is not absolute"));
                }
            }
            if let Some(options) = mount.get("options") {
                let options = options.as_array().ok_or("options: not an array")?;
                if !options.iter().all(Value::is_string) {
                    return Err("options: not strings".into());
                }
            }
            if mount.contains_key("type") {
                needs = later(needs, "0.4.0");
            }
        }
    }
    Ok(needs)
}

fn only_keys(object: &serde_json::Map<String, Value>, known: &[&str]) -> Result<(), String> {
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(format!("unknown field {key:?}")),
        None => Ok(()),
    }
}

/// The later of two versions of the form N.N.N.
fn later(a: &'static str, b: &'static str) -> &'static str {
    let parse = |v: &str| -> Vec<u32> { v.split('.').map(|p| p.parse().unwrap()).collect() };
    if parse(a) >= parse(b) {
        a
    } else {
        b
    }
}
