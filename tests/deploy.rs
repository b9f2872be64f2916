//! The deployment files stay true to the binary: every flag the DaemonSets
//! and the Helm chart pass is one `gpumem` accepts, for either front end.

use std::path::Path;
use std::process::Command;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// `- --flag=value` list items of a manifest's `args:`.
fn plugin_args(manifest: &str) -> Vec<String> {
    manifest
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- --"))
        .map(|a| format!("--{a}"))
        .collect()
}

fn gpumem(args: &[&str]) -> (bool, String) {
    gpumem_with_env(args, &[])
}

fn gpumem_with_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn the_daemonset_passes_only_flags_and_values_the_plugin_accepts() {
    let manifest = read("daemonset/gpumem.yaml");
    let args = plugin_args(&manifest);
    assert!(args.len() >= 8, "{args:?}");
    // Parse them for real: with a missing fake GPU file the plugin stops
    // right after clap accepted every flag and value.
    let mut full: Vec<&str> = vec!["plugin"];
    full.extend(args.iter().map(String::as_str));
    full.extend(["--fake-gpus", "/nonexistent/gpumem-deploy-test.toml"]);
    let (ok, text) = gpumem(&full);
    assert!(!ok);
    assert!(
        text.contains("gpumem-deploy-test.toml"),
        "clap refused the DaemonSet's args: {text}"
    );
    assert!(manifest.contains(r#"command: ["/opt/gpumem/gpumem", "plugin"]"#));

    // The init container's installer flags.
    assert_installer_flags(&manifest);
}

/// The chart's template for a DaemonSet with the flags it includes from
/// `_helpers.tpl` (`gpumem.agentArgs`, shared by both front ends, and
/// `gpumem.args`, which adds extraArgs).
fn chart_daemonset(template: &str) -> String {
    let text = read(template);
    assert!(text.contains(r#"{{ include "gpumem.agentArgs" . }}"#));
    assert!(text.contains(r#"{{- include "gpumem.args" (dict "root" . "own""#));
    text + &read("deploy/helm/gpumem/templates/_helpers.tpl")
}

#[test]
fn the_helm_chart_passes_only_flags_the_plugin_accepts() {
    let template = chart_daemonset("deploy/helm/gpumem/templates/daemonset.yaml");
    let (_, help) = gpumem(&["plugin", "--help"]);
    let args = plugin_args(&template);
    assert!(args.len() >= 8, "{args:?}");
    for arg in args {
        let flag = arg.split('=').next().unwrap();
        assert!(
            help.contains(&format!("{flag} ")),
            "{flag} is not a `gpumem plugin` flag"
        );
    }
    let values = read("deploy/helm/gpumem/values.yaml");
    for key in [
        "resourceName",
        "memoryUnit",
        "placement",
        "nodeSelector",
        "isolation",
        "image",
        "apiServer",
        "scheduler",
        "logFormat",
        "ignoreXids",
        "healthRecoverySecs",
        "stateGraceSecs",
        "extraArgs",
        "metricsAddress",
        "metricsPort",
        "runtimeClassName",
    ] {
        assert!(
            values.contains(&format!("{key}:")),
            "values.yaml lacks {key}"
        );
        assert!(
            template.contains(&format!(".Values.{key}")),
            "template ignores {key}"
        );
    }
}

#[test]
fn the_extender_deployments_pass_only_flags_the_extender_accepts() {
    let (_, help) = gpumem(&["extender", "--help"]);
    for path in [
        "daemonset/extender.yaml",
        "deploy/helm/gpumem/templates/extender.yaml",
        "daemonset/second-scheduler.yaml",
        "deploy/helm/gpumem/templates/second-scheduler.yaml",
    ] {
        let manifest = read(path);
        assert!(
            manifest.contains(r#"command: ["/opt/gpumem/gpumem", "extender"]"#),
            "{path}"
        );
        // The second scheduler's pod: kube-scheduler's --config is not ours.
        let args: Vec<String> = plugin_args(&manifest)
            .into_iter()
            .filter(|a| !a.starts_with("--config="))
            .collect();
        assert!(args.len() >= 3, "{path}: {args:?}");
        for arg in &args {
            let flag = arg.split('=').next().unwrap();
            assert!(
                help.contains(&format!("{flag} ")),
                "{path}: {flag} is not a `gpumem extender` flag"
            );
        }
    }
    // The plain manifest's values parse: the extender gets as far as the
    // kubeconfig, which does not exist.
    for path in ["daemonset/extender.yaml", "daemonset/second-scheduler.yaml"] {
        let args: Vec<String> = plugin_args(&read(path))
            .into_iter()
            .filter(|a| !a.starts_with("--config="))
            .collect();
        let mut full: Vec<&str> = vec!["extender"];
        full.extend(args.iter().map(String::as_str));
        full.extend(["--kubeconfig", "/nonexistent/gpumem-deploy-test"]);
        let (ok, text) = gpumem(&full);
        assert!(!ok);
        assert!(
            text.contains("gpumem-deploy-test"),
            "{path}: clap refused the Deployment's args: {text}"
        );
    }
}

/// Prometheus reaches each extender's /metrics: the env var is the
/// extender's, and the port it names is the pod's `metrics` port (where the
/// chart's Service and monitors look). The verbs' listener may be loopback.
#[test]
fn the_extender_deployments_serve_metrics_on_their_metrics_port() {
    let (_, help) = gpumem(&["extender", "--help"]);
    for (path, port) in [
        ("daemonset/extender.yaml", "9401"),
        ("daemonset/second-scheduler.yaml", "9401"),
        (
            "deploy/helm/gpumem/templates/extender.yaml",
            "{{ .Values.extender.metricsPort }}",
        ),
        (
            "deploy/helm/gpumem/templates/second-scheduler.yaml",
            "{{ .metricsPort }}",
        ),
    ] {
        let manifest = read(path);
        for env in env_names(&manifest) {
            assert!(
                help.contains(&format!("[env: {env}=")),
                "{path}: {env} is not a `gpumem extender` env var"
            );
        }
        let lines: Vec<&str> = manifest.lines().map(str::trim).collect();
        let value = lines
            .iter()
            .position(|l| *l == "- name: GPUMEM_EXTENDER_METRICS_ADDR")
            .and_then(|i| lines.get(i + 1))
            .and_then(|l| l.strip_prefix("value: "))
            .unwrap_or_else(|| panic!("{path}: no GPUMEM_EXTENDER_METRICS_ADDR"));
        assert!(
            value.trim_matches('"').ends_with(&format!(":{port}")),
            "{path}: {value}"
        );
        let metrics_port = lines
            .iter()
            .position(|l| *l == "- name: metrics")
            .and_then(|i| lines.get(i + 1))
            .and_then(|l| l.strip_prefix("containerPort: "));
        assert_eq!(metrics_port, Some(port), "{path}");
    }
    let values = read("deploy/helm/gpumem/values.yaml");
    assert_eq!(values.matches("\n  metricsPort: 9401\n").count(), 2);
}

/// `GPUMEM_*` names a manifest sets in a container's env.
fn env_names(manifest: &str) -> Vec<String> {
    manifest
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- name: GPUMEM_"))
        .map(|n| format!("GPUMEM_{}", n.trim()))
        .collect()
}

#[test]
fn the_dra_daemonset_passes_only_flags_and_values_the_driver_accepts() {
    let manifest = read("daemonset/gpumem-dra.yaml");
    assert!(manifest.contains(r#"command: ["/opt/gpumem/gpumem", "dra"]"#));
    let args = plugin_args(&manifest);
    assert!(args.len() >= 8, "{args:?}");
    // Parse them for real, with the node's name from the env as the
    // DaemonSet gives it: with a missing fake GPU file the driver stops right
    // after clap accepted every flag and value.
    let mut full: Vec<&str> = vec!["dra"];
    full.extend(args.iter().map(String::as_str));
    full.extend(["--fake-gpus", "/nonexistent/gpumem-deploy-test.toml"]);
    let (ok, text) = gpumem_with_env(&full, &[("GPUMEM_NODE_NAME", "deploy-test-node")]);
    assert!(!ok);
    assert!(
        text.contains("gpumem-deploy-test.toml"),
        "clap refused the DRA DaemonSet's args: {text}"
    );

    // The env it sets is the driver's.
    let (_, help) = gpumem(&["dra", "--help"]);
    let names = env_names(&manifest);
    assert!(names.contains(&"GPUMEM_NODE_NAME".to_owned()), "{names:?}");
    for name in names {
        assert!(
            help.contains(&format!("[env: {name}=")),
            "{name} is not a `gpumem dra` variable"
        );
    }

    // The same installer as the device plugin's.
    assert_installer_flags(&manifest);
}

/// The manifest passes the shim installer (`gpumem install-shim`) the
/// flags it accepts.
fn assert_installer_flags(manifest: &str) {
    let (_, help) = gpumem(&["install-shim", "--help"]);
    for flag in ["--from", "--to"] {
        assert!(
            manifest.contains(&format!("\"{flag}\"")) && help.contains(flag),
            "{flag}"
        );
    }
}

#[test]
fn the_helm_charts_dra_front_end_passes_only_flags_the_driver_accepts() {
    let template = chart_daemonset("deploy/helm/gpumem/templates/daemonset-dra.yaml");
    assert!(template.contains(r#"command: ["/opt/gpumem/gpumem", "dra"]"#));
    assert!(template.contains(r#"{{- if eq .Values.frontEnd "dra" }}"#));
    let (_, help) = gpumem(&["dra", "--help"]);
    let args = plugin_args(&template);
    assert!(args.len() >= 8, "{args:?}");
    for arg in &args {
        let flag = arg.split('=').next().unwrap();
        assert!(
            help.contains(&format!("{flag} ")),
            "{flag} is not a `gpumem dra` flag"
        );
    }
    // The chart passes what the plain manifest passes (and may pass more).
    for arg in plugin_args(&read("daemonset/gpumem-dra.yaml")) {
        let flag = arg.split('=').next().unwrap();
        assert!(
            args.iter().any(|a| a.starts_with(&format!("{flag}="))),
            "the chart's DRA DaemonSet lacks {flag}"
        );
    }
    for name in env_names(&template) {
        assert!(
            help.contains(&format!("[env: {name}=")),
            "{name} is not a `gpumem dra` variable"
        );
    }

    // The plugin's template renders only for the device plugin.
    let plugin = read("deploy/helm/gpumem/templates/daemonset.yaml");
    assert!(plugin.contains(r#"{{- if eq .Values.frontEnd "devicePlugin" }}"#));

    let values = read("deploy/helm/gpumem/values.yaml");
    assert!(
        values.contains("frontEnd: devicePlugin"),
        "the device plugin stays the default"
    );
    for (key, used) in [
        ("driverName:", ".Values.dra.driverName"),
        ("kubeletPluginsDir:", ".Values.dra.kubeletPluginsDir"),
        ("kubeletRegistryDir:", ".Values.dra.kubeletRegistryDir"),
        ("nodeSelector:", ".Values.dra.nodeSelector"),
        ("memoryUnit:", ".Values.memoryUnit"),
        ("isolation:", ".Values.isolation"),
        ("cdiSpecDir:", ".Values.cdiSpecDir"),
        ("image:", ".Values.image"),
    ] {
        assert!(values.contains(key), "values.yaml lacks {key}");
        assert!(template.contains(used), "the DRA template ignores {used}");
    }
    let class = read("deploy/helm/gpumem/templates/deviceclass.yaml");
    assert!(class.contains(".Values.dra.deviceClass.create"));
    assert!(class.contains(r#"device.driver == {{ .Values.dra.driverName | quote }}"#));
}

#[test]
fn the_uninstall_hook_runs_a_command_gpumem_accepts() {
    let hook = read("deploy/helm/gpumem/templates/uninstall.yaml");
    assert!(hook.contains(r#"command: ["/opt/gpumem/gpumem", "unpublish"]"#));
    assert!(hook.contains("- --log-format={{ .Values.logFormat }}"));
    assert!(hook.contains(r#"- --selector={{ join "," . }}"#));
    assert!(hook.contains("helm.sh/hook: post-delete"));
    // With no API server to reach, it gets as far as the kubeconfig.
    let (ok, text) = gpumem(&[
        "unpublish",
        "--log-format=text",
        "--selector=gpushare=true,example.com/pool=notebooks",
        "--kubeconfig",
        "/nonexistent/gpumem-deploy-test",
    ]);
    assert!(!ok);
    assert!(
        text.contains("gpumem-deploy-test"),
        "clap refused the hook's args: {text}"
    );
}

/// Lines after each `resources: ["nodes"]` rule: its verbs.
fn node_verbs(manifest: &str) -> Vec<String> {
    let lines: Vec<&str> = manifest.lines().map(str::trim).collect();
    lines
        .windows(2)
        .filter(|w| w[0] == r#"resources: ["nodes"]"#)
        .map(|w| w[1].to_owned())
        .collect()
}

/// A node started with the startup taint gpumem removes by default runs
/// gpumem's pod (every node daemon tolerates it), and gpumem may remove it
/// (every node daemon's ClusterRole patches Nodes).
#[test]
fn the_node_daemons_tolerate_the_startup_taint_and_may_remove_it() {
    let taint: gpumem::cluster::node::StartupTaint = gpumem::cluster::node::DEFAULT_STARTUP_TAINT
        .parse()
        .unwrap();
    let toleration = format!("- key: {}", taint.key);
    for path in [
        "daemonset/gpumem.yaml",
        "daemonset/gpumem-dra.yaml",
        "deploy/helm/gpumem/values.yaml",
    ] {
        let text = read(path);
        let at = text.lines().position(|l| l.trim() == toleration);
        let at = at.unwrap_or_else(|| panic!("{path} does not tolerate {taint}"));
        let rest: Vec<&str> = text.lines().skip(at + 1).take(2).map(str::trim).collect();
        assert_eq!(
            rest,
            ["operator: Exists", &format!("effect: {}", taint.effect)],
            "{path}"
        );
    }
    for path in ["daemonset/gpumem.yaml", "daemonset/gpumem-dra.yaml"] {
        let verbs = node_verbs(&read(path));
        assert_eq!(verbs.len(), 1, "{path}: {verbs:?}");
        assert!(verbs[0].contains(r#""patch""#), "{path}: {verbs:?}");
    }
    // The chart: one rule per front end.
    let verbs = node_verbs(&read("deploy/helm/gpumem/templates/rbac.yaml"));
    assert_eq!(verbs.len(), 2, "{verbs:?}");
    assert!(verbs.iter().all(|v| v.contains(r#""patch""#)), "{verbs:?}");
}

/// The value of a top-level `key: value` line of a YAML file, unquoted.
fn yaml_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().trim_matches('"'))
}

/// The version of a workspace crate's `Cargo.toml`.
fn crate_version(manifest: &str) -> String {
    let text = read(manifest);
    let version = text
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .unwrap_or_else(|| panic!("{manifest}: no version"));
    version.trim_matches('"').to_owned()
}

#[test]
fn the_version_is_the_changelogs_newest_release_everywhere_it_is_named() {
    let version = env!("CARGO_PKG_VERSION");

    // The crates that ship in the image carry the release's version: the
    // binary, kubelet's protos and the shim, and the accounting layout both
    // compile in.
    for manifest in [
        "proto/Cargo.toml",
        "shim/Cargo.toml",
        "shim/layout/Cargo.toml",
    ] {
        assert_eq!(crate_version(manifest), version, "{manifest}");
    }

    // The newest released section of the changelog is this version, dated,
    // below the section that collects what is not released yet.
    let changelog = read("CHANGELOG.md");
    let mut sections = changelog.lines().filter(|l| l.starts_with("## "));
    assert_eq!(sections.next(), Some("## [Unreleased]"));
    let newest = sections
        .next()
        .expect("no released section in CHANGELOG.md");
    let date = newest
        .strip_prefix(&format!("## [{version}] - "))
        .unwrap_or_else(|| {
            panic!("CHANGELOG.md's newest release is {newest:?}, not `## [{version}] - <date>`")
        });
    let digits: Vec<&str> = date.split('-').collect();
    assert!(
        digits.len() == 3 && digits.iter().all(|d| d.chars().all(|c| c.is_ascii_digit())),
        "CHANGELOG.md: {newest:?} is not dated YYYY-MM-DD"
    );

    // The chart: its own version and the app it installs.
    let chart = read("deploy/helm/gpumem/Chart.yaml");
    assert_eq!(
        yaml_value(&chart, "version"),
        Some(version),
        "Chart.yaml version"
    );
    assert_eq!(
        yaml_value(&chart, "appVersion"),
        Some(version),
        "Chart.yaml appVersion"
    );

    // Every tag that names a gpumem image, in the chart's values and the
    // manifests (an image named without a tag is left to the user).
    let values = read("deploy/helm/gpumem/values.yaml");
    let tags = values
        .lines()
        .filter_map(|l| l.trim().strip_prefix("tag:"))
        .map(|t| {
            (
                "values.yaml".to_owned(),
                t.trim().trim_matches('"').to_owned(),
            )
        });
    let mut named: Vec<(String, String)> = tags.filter(|(_, t)| !t.is_empty()).collect();
    for manifest in ["gpumem.yaml", "gpumem-dra.yaml", "extender.yaml"] {
        let text = read(&format!("daemonset/{manifest}"));
        for image in text.lines().filter_map(|l| l.trim().strip_prefix("image:")) {
            let image = image.trim();
            let name = image.rsplit('/').next().unwrap_or(image);
            if let Some((repo, tag)) = name.split_once(':') {
                if repo == "gpumem" {
                    named.push((manifest.to_owned(), tag.to_owned()));
                }
            }
        }
    }
    assert!(!named.is_empty(), "no gpumem image tag found");
    for (file, tag) in named {
        assert_eq!(tag, version, "{file}: image tag");
    }
}
