"""Validates the DaemonSet manifest and the Helm chart, rendered with Helm's
own engine (helm-python-sdk binds Helm's Go SDK), against the Kubernetes
OpenAPI schemas bundled in kubernetes-validate. Offline: no cluster needed.

    python3 .ci/validate-manifests.py
"""

import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
# The oldest Kubernetes release the manifests target and the newest one
# the validator knows: a field missing from either fails.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]

VARIANTS = {
    "defaults": {},
    "reconcile-off": {"reconcileSecs": 0},
    "cgpu-enforced": {
        "isolation": "none",
        "memoryUnit": "MiB",
        "placement": "spread",
        "resourceName": "example.com/vram",
        "nodeSelector": {"cgpu": "true"},
        "image": {"repository": "registry.example.com/gpumem", "tag": "dev", "pullPolicy": "Always"},
    },
}


def documents(name, text):
    for doc in yaml.safe_load_all(text):
        if doc:
            yield name, doc


def validate(name, doc, failures):
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            failures.append(f"{name} ({doc.get('kind')}, Kubernetes {version}): {err.message} at {list(err.path)}")
        except kubernetes_validate.SchemaNotFoundError as err:
            failures.append(f"{name}: no schema for {err}")


def main():
    failures = []
    checked = 0
    manifest = ROOT / "daemonset" / "gpumem.yaml"
    for name, doc in documents(str(manifest.relative_to(ROOT)), manifest.read_text()):
        validate(name, doc, failures)
        checked += 1

    chart = helm.Chart.load(ROOT / "deploy" / "helm" / "gpumem")
    for variant, values in VARIANTS.items():
        rendered = chart.render(values, name="gpumem", namespace="kube-system", is_install=True)
        for path, text in sorted(rendered.items()):
            if not path.endswith((".yaml", ".yml")):
                continue
            for name, doc in documents(f"chart[{variant}]:{path}", text):
                validate(name, doc, failures)
                checked += 1
        # The variant's values must reach the manifest.
        for expected in values.get("nodeSelector", {}):
            if not any(expected in text for text in rendered.values()):
                failures.append(f"chart[{variant}]: nodeSelector {expected} not rendered")
        # The host's PID namespace only where reconciliation needs it.
        wants = values.get("isolation", "shim") == "shim" and values.get("reconcileSecs", 2) > 0
        if any("hostPID: true" in text for text in rendered.values()) != wants:
            failures.append(f"chart[{variant}]: hostPID should be {str(wants).lower()}")

    for failure in failures:
        print(f"invalid: {failure}", file=sys.stderr)
    print(f"validate-manifests: {checked} documents checked against Kubernetes {', '.join(VERSIONS)}")
    bad = len({f.split(" ", 1)[0] for f in failures})
    print(f"{checked - min(bad, checked)} passed, {bad} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
