"""The Prometheus scrape configs prometheus-operator generates from the
chart's ServiceMonitor and PodMonitor, restated from its config generator
(pkg/prometheus/promcfg.go): the selector and port filters, the target
labels it adds (namespace, pod, container, service, endpoint, job, and node
from the endpoint's target) and honor_labels from the endpoint's
honorLabels. Without honor_labels, those target labels win over the
scraped ones, and Prometheus renames a series' own namespace/pod/container
to exported_*: tests/monitoring.rs scrapes the real plugin with these
configs to prove a per-pod series keeps its pod's.

The configs go to tests/fixtures/prometheus/operator-scrape-configs.json
without their Kubernetes service discovery (the test gives the target's
discovered labels itself); validate-manifests.py fails while the file is
not what the chart renders.

    target/ci-venv/bin/python .ci/operator_scrape.py   # rewrites the file
"""

import json
import re
import sys
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "prometheus" / "operator-scrape-configs.json"
# The chart names no image of its own: a render must give one.
IMAGE = {"image": {"repository": "registry.example.com/gpumem"}}
MONITORS = {
    "ServiceMonitor": {**IMAGE, "metrics": {"serviceMonitor": {"enabled": True}}},
    "PodMonitor": {**IMAGE, "metrics": {"podMonitor": {"enabled": True}}},
}


def sanitize(name):
    """Prometheus' label-name form of a Kubernetes label key."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def relabel(rule):
    """A monitor's relabeling (camelCase) as Prometheus' relabel_config."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {keys.get(k, k): v for k, v in rule.items()}


def selector_filters(selector, meta):
    """Keep only targets whose Service's (or Pod's) labels match."""
    rules = []
    for key in sorted(selector.get("matchLabels") or {}):
        rules.append({"action": "keep",
                      "source_labels": [f"{meta}_label_{sanitize(key)}", f"{meta}_labelpresent_{sanitize(key)}"],
                      "regex": f"({selector['matchLabels'][key]});true"})
    if selector.get("matchExpressions"):
        raise ValueError("matchExpressions: not restated here")
    return rules


# Pods that finished are not scraped.
RUNNING = {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}


def service_monitor(monitor):
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    spec = monitor["spec"]
    configs = []
    for i, ep in enumerate(spec["endpoints"]):
        target = ["__meta_kubernetes_endpoint_address_target_kind", "__meta_kubernetes_endpoint_address_target_name"]
        rules = selector_filters(spec["selector"], "__meta_kubernetes_service")
        rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                      "regex": ep["port"]})
        rules += [
            {"source_labels": target, "separator": ";", "regex": "Node;(.*)", "replacement": "${1}",
             "target_label": "node"},
            {"source_labels": target, "separator": ";", "regex": "Pod;(.*)", "replacement": "${1}",
             "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            RUNNING,
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"},
            {"target_label": "endpoint", "replacement": ep["port"]},
        ]
        rules += [relabel(r) for r in ep.get("relabelings") or []]
        configs.append(scrape_config(f"serviceMonitor/{namespace}/{name}/{i}", ep, rules))
    return configs


def pod_monitor(monitor):
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    spec = monitor["spec"]
    configs = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        rules = [RUNNING, *selector_filters(spec["selector"], "__meta_kubernetes_pod")]
        rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                      "regex": ep["port"]})
        rules += [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{namespace}/{name}"},
            {"target_label": "endpoint", "replacement": ep["port"]},
        ]
        rules += [relabel(r) for r in ep.get("relabelings") or []]
        configs.append(scrape_config(f"podMonitor/{namespace}/{name}/{i}", ep, rules))
    return configs


def scrape_config(job, ep, rules):
    config = {"job_name": job, "honor_labels": bool(ep.get("honorLabels", False))}
    if ep.get("path"):
        config["metrics_path"] = ep["path"]
    config["relabel_configs"] = rules
    return config


def generate():
    """{kind: [scrape config, …]} for the chart's monitors."""
    chart = helm.Chart.load(ROOT / "deploy" / "helm" / "gpumem")
    out = {}
    for kind, values in MONITORS.items():
        rendered = chart.render(values, name="gpumem", namespace="kube-system", is_install=True)
        monitors = [d for path, text in rendered.items() if path.endswith(".yaml")
                    for d in yaml.safe_load_all(text) if d and d.get("kind") == kind]
        if len(monitors) != 1:
            raise ValueError(f"{kind}: rendered {len(monitors)}, expected one")
        out[kind] = (service_monitor if kind == "ServiceMonitor" else pod_monitor)(monitors[0])
    return out


def text():
    return json.dumps(generate(), indent=2, sort_keys=True) + "\n"


def stale():
    """A failure message while the fixture is not what the chart renders."""
    if not FIXTURE.exists() or FIXTURE.read_text() != text():
        return (f"{FIXTURE.relative_to(ROOT)} is not what prometheus-operator makes of the chart's "
                f"monitors: run `python .ci/operator_scrape.py` and commit it")
    return None


if __name__ == "__main__":
    FIXTURE.write_text(text())
    print(f"wrote {FIXTURE.relative_to(ROOT)}")
    sys.exit(0)
