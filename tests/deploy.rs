//! The deployment files stay true to the binary: every flag the DaemonSet
//! and the Helm chart pass is one `gpumem` accepts.

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
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(args)
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
    let (_, help) = gpumem(&["install-shim", "--help"]);
    for flag in ["--from", "--to"] {
        assert!(
            manifest.contains(&format!("\"{flag}\"")) && help.contains(flag),
            "{flag}"
        );
    }
}

#[test]
fn the_helm_chart_passes_only_flags_the_plugin_accepts() {
    let template = read("deploy/helm/gpumem/templates/daemonset.yaml");
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
    ] {
        let manifest = read(path);
        assert!(
            manifest.contains(r#"command: ["/opt/gpumem/gpumem", "extender"]"#),
            "{path}"
        );
        let args = plugin_args(&manifest);
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
    let args = plugin_args(&read("daemonset/extender.yaml"));
    let mut full: Vec<&str> = vec!["extender"];
    full.extend(args.iter().map(String::as_str));
    full.extend(["--kubeconfig", "/nonexistent/gpumem-deploy-test"]);
    let (ok, text) = gpumem(&full);
    assert!(!ok);
    assert!(
        text.contains("gpumem-deploy-test"),
        "clap refused the Deployment's args: {text}"
    );
}
