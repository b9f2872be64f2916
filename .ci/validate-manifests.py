"""Validates the DaemonSet manifests and the Helm chart, rendered with Helm's
own engine (helm-python-sdk binds Helm's Go SDK), against the Kubernetes
OpenAPI schemas bundled in kubernetes-validate. Offline: no cluster needed.

The DRA front end (daemonset/gpumem-dra.yaml, its example, the chart with
frontEnd: dra) is checked against resource.k8s.io/v1's releases only, and
for what no schema says: the socket, CDI and state directories its flags
name are mounted at the host's own paths, its RBAC is exactly what the
driver uses, the DeviceClass selects its driver, claims ask for memory the
slice offers, and no node matches both front ends' node selectors.

Then runs every command the manifests and the docs give gpumem's image, as
the container runtime would, on the image the Dockerfile's final stage
describes (its PATH, the files it copies in, its ENTRYPOINT and CMD): each
must reach the gpumem binary, and `install-shim --from` the shim it copies.
No Docker daemon needed.

    python3 .ci/validate-manifests.py
"""

import json
import posixpath
import re
import shlex
import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

import operator_scrape

ROOT = Path(__file__).resolve().parent.parent
# The oldest Kubernetes release the manifests target and the newest one
# the validator knows: a field missing from either fails.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
# The DRA front end: resource.k8s.io/v1 (GA) and consumable capacity
# (DRAConsumableCapacity, alpha) first came in 1.34.
DRA_VERSIONS = ["1.34.0", kubernetes_validate.latest_version()]

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
    "volume-mounts": {"deviceListStrategy": "volume-mounts"},
    "unbounded-state": {"boundedStateDirs": False},
    "cdi": {"deviceListStrategy": "cdi"},
    "kubelet-only": {"apiServer": False},
    "gpushare-extender": {"scheduler": "gpushare-extender", "extender": {"enabled": True}},
    "second-scheduler": {"scheduler": "gpushare-extender", "secondScheduler": {"enabled": True}},
    "second-scheduler-custom": {
        "scheduler": "gpushare-extender",
        "resourceName": "example.com/vram",
        "secondScheduler": {"enabled": True, "name": "gpu-scheduler", "replicas": 3, "placement": "spread",
                            "extenderPort": 23456, "image": "registry.example.com/kube-scheduler:v1.34.1"},
    },
    "dra": {"frontEnd": "dra"},
    "adopter-settings": {
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"example.com/team": "ml-platform"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "example.com/gpu", "operator": "Exists"}]}]}}},
        "logFormat": "json",
        "extraArgs": ["--status-socket=/var/lib/gpumem/status.sock"],
        "uninstall": {"unpublish": False},
    },
    # extraArgs replacing flags the chart sets (clap refuses a flag given
    # twice), metrics on loopback only (no liveness probe then), and the
    # NVIDIA runtime by RuntimeClass.
    "overrides": {
        "extraArgs": ["--placement=spread", "--reconcile-secs", "5"],
        "metricsAddress": "127.0.0.1",
        "runtimeClassName": "nvidia",
        "nodeSelector": {"gpushare": "true", "example.com/pool": "notebooks"},
    },
    "monitoring": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                               "prometheusRule": {"enabled": True},
                               "dashboard": {"namespace": "monitoring"}}},
    # The extenders' own Service and monitors.
    "monitoring-extenders": {"scheduler": "gpushare-extender", "extender": {"enabled": True},
                             "secondScheduler": {"enabled": True, "metricsPort": 9402},
                             "metrics": {"serviceMonitor": {"enabled": True}}},
    "monitoring-extenders-podmonitor": {"scheduler": "gpushare-extender", "extender": {"enabled": True},
                                        "secondScheduler": {"enabled": True},
                                        "metrics": {"podMonitor": {"enabled": True}}},
    "monitoring-podmonitor": {"frontEnd": "dra", "metrics": {"podMonitor": {"enabled": True},
                                                             "service": {"enabled": False},
                                                             "dashboard": {"enabled": False}}},
    "dra-custom": {
        "frontEnd": "dra",
        "isolation": "none",
        "memoryUnit": "MiB",
        "kubeletDir": "/data/kubelet",
        "stateDir": "/data/gpumem",
        "cdiSpecDir": "/etc/cdi",
        "dra": {
            "driverName": "gpu-mem.example.com",
            "deviceClass": {"create": False},
            "kubeletPluginsDir": "/data/kubelet/plugins",
            "kubeletRegistryDir": "/data/kubelet/plugins_registry",
            "nodeSelector": {"gpumem-front-end": "dra"},
        },
    },
}

# The chart names no image of its own: every render gives one, as a user
# must (a variant's own image.repository wins).
IMAGE = {"repository": "registry.example.com/gpumem"}


def with_image(values):
    return {**values, "image": {**IMAGE, **values.get("image", {})}}


# Values the chart must refuse, and a word of the message it refuses them with.
REFUSED = {
    "no-image": ({}, "image.repository is required"),
    "front-end-typo": ({"frontEnd": "DRA"}, "/frontEnd"),
    "dra-without-api-server": ({"frontEnd": "dra", "apiServer": False}, "needs apiServer"),
    "dra-with-gpushare-extender": ({"frontEnd": "dra", "scheduler": "gpushare-extender"}, "frontEnd: devicePlugin"),
    "dra-bad-driver-name": ({"frontEnd": "dra", "dra": {"driverName": "GPUmem_io"}}, "DNS subdomain"),
    "two-monitors": ({"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
                     "enable one, not both"),
    "service-monitor-without-service": ({"metrics": {"serviceMonitor": {"enabled": True},
                                                     "service": {"enabled": False}}}, "needs metrics.service"),
    "monitor-of-loopback-metrics": ({"metricsAddress": "127.0.0.1", "metrics": {"podMonitor": {"enabled": True}}},
                                    "loopback-only"),
    # values.schema.json: a misspelt key, and values gpumem would refuse at
    # start (a crash loop on every node).
    "over-cap-action-key-typo": ({"overCapaction": "report"}, "additional properties 'overCapaction' not allowed"),
    "over-cap-action-value-typo": ({"overCapAction": "reprot"}, "/overCapAction"),
    "memory-unit-kib": ({"memoryUnit": "KiB"}, "/memoryUnit"),
    "reconcile-negative": ({"reconcileSecs": -1}, "/reconcileSecs"),
    "reconcile-string": ({"reconcileSecs": "2s"}, "/reconcileSecs"),
    "nested-typo": ({"metrics": {"serviceMonitor": {"enable": True}}}, "'enable' not allowed"),
    "ignore-xids-not-numbers": ({"ignoreXids": "13;x"}, "/ignoreXids"),
    "second-scheduler-without-extender-mode": ({"secondScheduler": {"enabled": True}}, "needs scheduler: gpushare-extender"),
    "second-scheduler-named-default": ({"scheduler": "gpushare-extender",
                                        "secondScheduler": {"enabled": True, "name": "default-scheduler"}},
                                       "/secondScheduler/name"),
    "second-scheduler-key-typo": ({"secondScheduler": {"enable": True}}, "'enable' not allowed"),
}

# prometheus-operator's kinds: their CRDs are not in Kubernetes' schemas, so
# check_monitoring checks them for what they must reach instead, and the
# fields they may have (monitoring.coreos.com/v1).
MONITORING_KINDS = {
    "ServiceMonitor": {"selector", "namespaceSelector", "endpoints", "jobLabel", "podTargetLabels",
                       "targetLabels", "sampleLimit"},
    "PodMonitor": {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel", "podTargetLabels",
                   "sampleLimit"},
    "PrometheusRule": {"groups"},
}
ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings",
                   "honorLabels", "scheme"}
DASHBOARD = ROOT / "deploy" / "helm" / "gpumem" / "monitoring" / "gpumem-dashboard.json"
RULES = ROOT / "deploy" / "helm" / "gpumem" / "monitoring" / "gpumem.rules.yaml"


def check_monitoring(name, docs, failures):
    """The monitors find the metrics port, the rule is the repository's rules
    file, and the dashboard ConfigMap holds the repository's dashboard."""
    services = [d for d in docs if d.get("kind") == "Service"]
    pods = [d["spec"]["template"] for d in docs if d.get("kind") in ("DaemonSet", "Deployment")]
    for doc in docs:
        kind = doc.get("kind")
        where = f"{name}: {kind} {doc.get('metadata', {}).get('name')}"
        if kind in MONITORING_KINDS:
            if doc.get("apiVersion") != "monitoring.coreos.com/v1":
                failures.append(f"{where}: apiVersion {doc.get('apiVersion')!r}, not monitoring.coreos.com/v1")
            unknown = set(doc.get("spec", {})) - MONITORING_KINDS[kind]
            if unknown:
                failures.append(f"{where}: unknown spec fields {sorted(unknown)}")
        if kind in ("ServiceMonitor", "PodMonitor"):
            wanted = doc["spec"]["selector"].get("matchLabels", {})
            endpoints = doc["spec"].get("endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints") or []
            for endpoint in endpoints:
                if set(endpoint) - ENDPOINT_FIELDS:
                    failures.append(f"{where}: unknown endpoint fields {sorted(set(endpoint) - ENDPOINT_FIELDS)}")
            if kind == "ServiceMonitor":
                targets = [(s["metadata"].get("labels", {}), {p.get("name") for p in s["spec"].get("ports", [])})
                           for s in services]
            else:
                targets = [(t["metadata"].get("labels", {}),
                            {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])})
                           for t in pods]
            matched = [ports for labels, ports in targets if wanted.items() <= labels.items()]
            if not matched:
                failures.append(f"{where}: selects nothing the chart renders ({wanted})")
            for endpoint in endpoints:
                if matched and not any(endpoint.get("port") in ports for ports in matched):
                    failures.append(f"{where}: port {endpoint.get('port')!r} is not a port of what it selects")
        if kind == "PrometheusRule":
            if doc["spec"].get("groups") != yaml.safe_load(RULES.read_text())["groups"]:
                failures.append(f"{where}: its groups are not {RULES.relative_to(ROOT)}'s")
        if kind == "ConfigMap" and doc["metadata"].get("labels", {}).get("grafana_dashboard") == "1":
            try:
                dashboard = json.loads(doc["data"]["gpumem.json"])
            except (KeyError, ValueError) as err:
                failures.append(f"{where}: no dashboard JSON in gpumem.json: {err}")
                continue
            if dashboard != json.loads(DASHBOARD.read_text()):
                failures.append(f"{where}: not {DASHBOARD.relative_to(ROOT)}")
            targets = [t for p in dashboard.get("panels", []) for t in p.get("targets", [])]
            if not targets or not all(t.get("expr") for t in targets):
                failures.append(f"{where}: a panel target without a query")

# kube-scheduler decodes its configuration strictly: the fields of an
# extender (kubescheduler.config.k8s.io/v1 Extender) and what they hold.
EXTENDER_FIELDS = {
    "urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb",
    "enableHTTPS", "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable",
}
# The routes `gpumem extender` serves.
EXTENDER_VERBS = {"filterVerb": "filter", "prioritizeVerb": "prioritize", "bindVerb": "bind"}


def check_scheduler_config(name, config, extender_docs, resource, failures, url=None):
    """The KubeSchedulerConfiguration reaches the extender as deployed: at
    `url`, or at the NodePort of the Service among extender_docs."""
    if config.get("apiVersion") != "kubescheduler.config.k8s.io/v1" or config.get("kind") != "KubeSchedulerConfiguration":
        failures.append(f"{name}: not a kubescheduler.config.k8s.io/v1 KubeSchedulerConfiguration")
        return
    unknown = set(config) - {"apiVersion", "kind", "clientConnection", "extenders", "profiles",
                              "leaderElection", "parallelism", "percentageOfNodesToScore",
                              "podInitialBackoffSeconds", "podMaxBackoffSeconds", "featureGates"}
    if unknown:
        failures.append(f"{name}: unknown fields {sorted(unknown)}")
    extenders = config.get("extenders") or []
    if len(extenders) != 1:
        failures.append(f"{name}: expected one extender, found {len(extenders)}")
        return
    ext = extenders[0]
    if set(ext) - EXTENDER_FIELDS:
        failures.append(f"{name}: unknown extender fields {sorted(set(ext) - EXTENDER_FIELDS)}")
    for verb, route in EXTENDER_VERBS.items():
        if ext.get(verb) != route:
            failures.append(f"{name}: {verb} should be {route!r}, the extender's route")
    if not re.fullmatch(r"\d+(\.\d+)?(ms|s|m)", str(ext.get("httpTimeout", "5s"))):
        failures.append(f"{name}: httpTimeout {ext.get('httpTimeout')!r} is not a duration")
    managed = [m.get("name") for m in ext.get("managedResources") or []]
    if managed != [resource]:
        failures.append(f"{name}: managedResources {managed} should be [{resource!r}]")
    if not ext.get("nodeCacheCapable"):
        failures.append(f"{name}: nodeCacheCapable should be true (the extender keeps a node cache)")
    if url is not None:
        if ext.get("urlPrefix") != url:
            failures.append(f"{name}: urlPrefix {ext.get('urlPrefix')!r} does not reach the extender at {url}")
        return
    port = next((p.get("nodePort") for d in extender_docs if d.get("kind") == "Service"
                 for p in d["spec"]["ports"]), None)
    if ext.get("urlPrefix") != f"http://127.0.0.1:{port}":
        failures.append(f"{name}: urlPrefix {ext.get('urlPrefix')!r} does not reach the Service's NodePort {port}")


# The ClusterRoles any kube-scheduler needs (upstream "Configure Multiple
# Schedulers"), bound to the second scheduler's service account.
SCHEDULER_ROLES = {"system:kube-scheduler", "system:volume-scheduler"}


def check_second_scheduler(name, docs, namespace, sched_name, resource, failures):
    """The second scheduler's pod: kube-scheduler with the ConfigMap's
    configuration (profile and Lease named sched_name, leader-elected) and
    the extender it reaches on the pod's loopback, nothing exposed, and the
    RBAC a kube-scheduler, its Lease and the extender need. Returns the
    configuration and the Deployment, or (None, None)."""
    deployments = [d for d in docs if d.get("kind") == "Deployment"
                   and d["metadata"]["labels"].get("app.kubernetes.io/name") == "gpumem-scheduler"]
    if len(deployments) != 1:
        failures.append(f"{name}: {len(deployments)} second-scheduler Deployments, expected one")
        return None, None
    deployment = deployments[0]
    pod = deployment["spec"]["template"]["spec"]
    account = pod.get("serviceAccountName")
    containers = {c["name"]: c for c in pod.get("containers") or []}
    if set(containers) != {"kube-scheduler", "extender"}:
        failures.append(f"{name}: the pod's containers are {sorted(containers)}, not kube-scheduler and extender")
        return None, None
    if deployment["spec"].get("replicas", 1) < 2:
        failures.append(f"{name}: {deployment['spec'].get('replicas', 1)} replica: no other to take the Lease over")
    listen = flags(containers["extender"].get("args") or []).get("--listen-addr", "")
    if not listen.startswith("127.0.0.1:"):
        failures.append(f"{name}: the extender listens on {listen!r}, not on the pod's loopback only")
    # Only the extender's /metrics is on the pod's address, for Prometheus.
    metrics_addr = {e["name"]: e.get("value") for e in containers["extender"].get("env") or []}.get(
        "GPUMEM_EXTENDER_METRICS_ADDR", "")
    metrics_port = metrics_addr.rpartition(":")[2]
    ports = [(p.get("name"), str(p.get("containerPort"))) for p in containers["extender"].get("ports") or []]
    if ports != [("metrics", metrics_port)] or containers["kube-scheduler"].get("ports"):
        failures.append(f"{name}: container ports {ports}: only the extender's metrics port "
                        f"({metrics_addr!r}) is to be exposed")
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    exposed = [d["metadata"]["name"] for d in docs if d.get("kind") == "Service"
               and d["spec"].get("selector", {}).items() <= labels.items()
               and any(p.get("targetPort") != "metrics" for p in d["spec"].get("ports", []))]
    if exposed:
        failures.append(f"{name}: Services {exposed} expose the second scheduler beyond its metrics")
    config_flag = next((w.split("=", 1)[1] for w in containers["kube-scheduler"].get("command", [])
                        if w.startswith("--config=")), None)
    mount = next((m for m in containers["kube-scheduler"].get("volumeMounts") or []
                  if config_flag and config_flag.startswith(m["mountPath"].rstrip("/") + "/")), None)
    volume = next((v for v in pod.get("volumes") or [] if mount and v["name"] == mount["name"]), {})
    cm_name = (volume.get("configMap") or {}).get("name")
    cm = next((d for d in docs if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == cm_name), None)
    key = posixpath.basename(config_flag or "")
    if cm is None or key not in cm.get("data", {}):
        failures.append(f"{name}: kube-scheduler's --config={config_flag} is not a key of a ConfigMap it mounts")
        return None, None
    config = yaml.safe_load(cm["data"][key])
    check_scheduler_config(f"{name}: ConfigMap {cm_name}", config, [], resource, failures, url=f"http://{listen}")
    if config.get("clientConnection", {}).get("kubeconfig"):
        failures.append(f"{name}: the configuration names a kubeconfig; in a pod the service account's is used")
    profiles = [p.get("schedulerName") for p in config.get("profiles") or []]
    if profiles != [sched_name]:
        failures.append(f"{name}: profiles {profiles}, expected [{sched_name!r}]")
    election = config.get("leaderElection") or {}
    want = {"leaderElect": True, "resourceLock": "leases", "resourceNamespace": namespace, "resourceName": sched_name}
    if {k: election.get(k) for k in want} != want:
        failures.append(f"{name}: leaderElection {election}, expected {want}")
    subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    bound = {d["roleRef"]["name"] for d in docs if d.get("kind") in ("ClusterRoleBinding", "RoleBinding")
             and subject in d.get("subjects", [])}
    missing = SCHEDULER_ROLES - bound
    if missing:
        failures.append(f"{name}: {account} not bound to {sorted(missing)}")
    lease_rules = [r for d in docs if d.get("kind") == "Role" and d["metadata"].get("namespace") == namespace
                   and d["metadata"]["name"] in bound for r in d.get("rules", [])
                   if "leases" in r.get("resources", [])]
    if not any(sched_name in r.get("resourceNames", []) and {"get", "update"} <= set(r["verbs"]) for r in lease_rules):
        failures.append(f"{name}: no Role bound to {account} updates the Lease {namespace}/{sched_name}")
    binds = [r for d in docs if d.get("kind") == "ClusterRole" and d["metadata"]["name"] in bound
             for r in d.get("rules", []) if "pods/binding" in r.get("resources", [])]
    if not binds:
        failures.append(f"{name}: no ClusterRole of the extender's (pods/binding) bound to {account}")
    return config, deployment


def documents(name, text):
    for doc in yaml.safe_load_all(text):
        if doc:
            yield name, doc


def validate(name, doc, failures, versions=VERSIONS):
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            failures.append(f"{name} ({doc.get('kind')}, Kubernetes {version}): {err.message} at {list(err.path)}")
        except kubernetes_validate.SchemaNotFoundError as err:
            failures.append(f"{name}: no schema for {err}")


# `gpumem dra`'s defaults, for flags a manifest leaves out.
DRA_DEFAULTS = {
    "--driver-name": "gpumem.io",
    "--kubelet-plugins-dir": "/var/lib/kubelet/plugins",
    "--kubelet-registry-dir": "/var/lib/kubelet/plugins_registry",
    "--pod-resources-socket": "/var/lib/kubelet/pod-resources/kubelet.sock",
    "--memory-unit": "GiB",
    "--isolation": "shim",
    "--shim-host-dir": "/usr/local/gpumem",
    "--state-dir": "/var/lib/gpumem",
    "--cdi-spec-dir": "/var/run/cdi",
    "--metrics-addr": ":9400",
}
# Where the driver looks for NVIDIA's CDI spec besides --cdi-spec-dir.
NVIDIA_CDI_DIR = "/etc/cdi"
# What the driver does with the API server, and nothing more: (group,
# resource) -> verbs.
DRA_RULES = {
    ("resource.k8s.io", "resourceslices"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("resource.k8s.io", "resourceclaims"): {"get"},
    # get: the slice's owner; patch: the startup taint (--startup-taint).
    ("", "nodes"): {"get", "patch"},
    ("", "pods"): {"list", "watch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
# A driver name as the API server takes it (a DNS subdomain).
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUANTITY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                     "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}
UNIT_BYTES = {"GiB": 2**30, "MiB": 2**20}


def quantity_bytes(text):
    """A Kubernetes quantity in bytes, or None (no exponents or fractions)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(text))
    return int(m.group(1)) * QUANTITY_SUFFIXES[m.group(2)] if m else None


def flags(argv):
    """`--flag=value` words of an argv, as a dict."""
    return dict(word.split("=", 1) for word in argv if word.startswith("--") and "=" in word)


def host_path(spec, container, path):
    """The host path behind `path` in the container, and whether it is
    writable; (None, False) where no hostPath volume covers it."""
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    best = None
    for mount in container.get("volumeMounts") or []:
        root = mount["mountPath"].rstrip("/") or "/"
        if path == root or path.startswith(root.rstrip("/") + "/"):
            if best is None or len(root) > len(best[0]):
                best = (root, mount)
    if best is None:
        return None, False
    root, mount = best
    volume = volumes.get(mount["name"], {})
    if "hostPath" not in volume:
        return None, False
    return volume["hostPath"]["path"].rstrip("/") + path[len(root):], not mount.get("readOnly", False)


def check_dra(name, docs, image, failures, device_class_expected):
    """What no schema checks in a DRA driver's objects: `docs` is every
    object of one install (the plain manifest, or one chart rendering).
    Returns the driver's name and the DaemonSet's nodeSelector."""
    daemonsets = [d for d in docs if d.get("kind") == "DaemonSet"]
    if len(daemonsets) != 1:
        failures.append(f"{name}: expected one DaemonSet, found {len(daemonsets)}")
        return None, {}
    ds = daemonsets[0]
    spec = ds["spec"]["template"]["spec"]
    containers = [c for c in spec.get("containers") or [] if is_ours(c.get("image", ""))]
    argv = image.argv(containers[0].get("command"), containers[0].get("args")) if containers else []
    if argv[1:2] != ["dra"]:
        failures.append(f"{name}: the DaemonSet's container does not run `gpumem dra` ({argv[:2]})")
        return None, {}
    container = containers[0]
    args = {**DRA_DEFAULTS, **flags(argv)}
    driver = args["--driver-name"]
    if not DNS_SUBDOMAIN.fullmatch(driver):
        failures.append(f"{name}: --driver-name {driver!r} is not a DNS subdomain")

    # --node-name is required; the DaemonSet gives it from the downward API.
    env = {e["name"]: e for e in container.get("env") or []}
    node_env = env.get("GPUMEM_NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if "--node-name" not in args and node_env != "spec.nodeName":
        failures.append(f"{name}: GPUMEM_NODE_NAME must come from spec.nodeName (--node-name is required)")

    # Every path the driver hands to kubelet or the runtime, or reads from
    # the host, is mounted at the host's own path.
    needed = [
        (posixpath.join(args["--kubelet-plugins-dir"], driver), True, "the DRA socket's directory"),
        (args["--kubelet-registry-dir"], True, "kubelet's plugin registry"),
        (posixpath.dirname(args["--pod-resources-socket"]), True, "kubelet's pod-resources socket"),
        (args["--state-dir"], True, "the state directory (checkpoint, accounting)"),
        (args["--cdi-spec-dir"], True, "the claims' CDI specs"),
        (NVIDIA_CDI_DIR, False, "NVIDIA's CDI spec"),
    ]
    if args["--isolation"] == "shim":
        needed.append((args["--shim-host-dir"], False, "the shim"))
    for path, writable, what in needed:
        found, can_write = host_path(spec, container, path)
        if found != path:
            failures.append(f"{name}: {path} ({what}) is not mounted from the same host path (found {found})")
        elif writable and not can_write:
            failures.append(f"{name}: {path} ({what}) is mounted read-only")
    # Other drivers' sockets stay out of reach: only the driver's own
    # directory of kubelet's plugins.
    for mount in container.get("volumeMounts") or []:
        if mount["mountPath"].rstrip("/") == args["--kubelet-plugins-dir"].rstrip("/") and not mount.get("readOnly"):
            failures.append(f"{name}: mounts all of {mount['mountPath']} writable; mount only "
                            f"{posixpath.join(args['--kubelet-plugins-dir'], driver)}")
    port = args["--metrics-addr"].rsplit(":", 1)[-1]
    probe = (container.get("livenessProbe") or {}).get("httpGet") or {}
    ports = {p.get("name"): str(p.get("containerPort")) for p in container.get("ports") or []}
    if probe.get("path") != "/healthz" or ports.get(probe.get("port"), str(probe.get("port"))) != port:
        failures.append(f"{name}: the liveness probe should be /healthz on the metrics port {port}")

    # RBAC: exactly what the driver uses, bound to the DaemonSet's account.
    account = spec.get("serviceAccountName")
    namespace = ds["metadata"].get("namespace")
    if not any(d.get("kind") == "ServiceAccount" and d["metadata"]["name"] == account for d in docs):
        failures.append(f"{name}: no ServiceAccount {account!r} for the DaemonSet")
    roles = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ClusterRole"}
    bindings = [d for d in docs if d.get("kind") == "ClusterRoleBinding"
                and {"kind": "ServiceAccount", "name": account, "namespace": namespace} in d.get("subjects", [])]
    if len(bindings) != 1 or bindings[0]["roleRef"]["name"] not in roles:
        failures.append(f"{name}: expected one ClusterRoleBinding of a ClusterRole here to {namespace}/{account}")
    else:
        granted = {}
        for rule in roles[bindings[0]["roleRef"]["name"]].get("rules") or []:
            for group in rule.get("apiGroups") or []:
                for resource in rule.get("resources") or []:
                    granted.setdefault((group, resource), set()).update(rule.get("verbs") or [])
        if granted != DRA_RULES:
            extra = {k: sorted(v - DRA_RULES.get(k, set())) for k, v in granted.items() if v - DRA_RULES.get(k, set())}
            missing = {k: sorted(v - granted.get(k, set())) for k, v in DRA_RULES.items() if v - granted.get(k, set())}
            failures.append(f"{name}: ClusterRole grants more than the driver uses {extra} or less {missing}")

    # The DeviceClass claims name selects this driver's devices.
    classes = [d for d in docs if d.get("kind") == "DeviceClass"]
    if device_class_expected and not classes:
        failures.append(f"{name}: no DeviceClass for driver {driver}")
    if not device_class_expected and classes:
        failures.append(f"{name}: a DeviceClass was rendered where none was asked for")
    for cls in classes:
        expressions = [s.get("cel", {}).get("expression", "") for s in cls["spec"].get("selectors") or []]
        drivers = {m for e in expressions for m in re.findall(r'device\.driver\s*==\s*"([^"]*)"', e)}
        if drivers != {driver}:
            failures.append(f"{name}: DeviceClass {cls['metadata']['name']} selects driver(s) {sorted(drivers)}, "
                            f"not {driver!r}")
    return driver, {"selector": spec.get("nodeSelector") or {}, "classes": classes,
                    "unit": args["--memory-unit"]}


def check_claims(name, docs, classes, unit, failures):
    """The example's claims name a DeviceClass of the driver and ask memory
    the slice offers; its pods use the claims they declare."""
    class_names = {c["metadata"]["name"] for c in classes}
    step = UNIT_BYTES.get(unit, 2**30)
    claims = {}
    for doc in docs:
        kind = doc.get("kind")
        if kind not in ("ResourceClaim", "ResourceClaimTemplate"):
            continue
        claim_spec = doc["spec"]["spec"] if kind == "ResourceClaimTemplate" else doc["spec"]
        claims[(kind, doc["metadata"]["name"])] = doc
        for request in claim_spec.get("devices", {}).get("requests") or []:
            exactly = request.get("exactly") or {}
            where = f"{name}: {kind} {doc['metadata']['name']} request {request.get('name')}"
            if exactly.get("deviceClassName") not in class_names:
                failures.append(f"{where}: deviceClassName {exactly.get('deviceClassName')!r} is not "
                                f"the driver's DeviceClass ({', '.join(sorted(class_names))})")
            memory = (exactly.get("capacity") or {}).get("requests", {}).get("memory")
            size = quantity_bytes(memory)
            if size is None or size < step or size % step:
                failures.append(f"{where}: memory {memory!r} is not a whole number of {unit} (the slice's step)")
    used = set()
    for doc in docs:
        if doc.get("kind") != "Pod":
            continue
        pod = doc["metadata"]["name"]
        declared = set()
        for claim in doc["spec"].get("resourceClaims") or []:
            declared.add(claim["name"])
            ref = (("ResourceClaimTemplate", claim["resourceClaimTemplateName"]) if "resourceClaimTemplateName" in claim
                   else ("ResourceClaim", claim.get("resourceClaimName")))
            if ref not in claims:
                failures.append(f"{name}: Pod {pod} refers to {ref[0]} {ref[1]!r}, which the file lacks")
            used.add(ref)
        referenced = {c["name"] for ct in doc["spec"]["containers"] for c in (ct.get("resources") or {}).get("claims") or []}
        if referenced - declared or declared - referenced:
            failures.append(f"{name}: Pod {pod}: containers use claims {sorted(referenced)}, "
                            f"the pod declares {sorted(declared)}")
    for ref in set(claims) - used:
        failures.append(f"{name}: {ref[0]} {ref[1]} is used by no Pod")


def disjoint(a, b):
    """No node's labels match both node selectors."""
    return any(key in b and b[key] != value for key, value in a.items())


# What the runtime uses when an image sets no PATH (and what `$PATH` in an
# ENV line stands for: the distroless base sets the same).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BINARY = "gpumem"
SHIM = "libgpumem_shim.so"


class Image:
    """The final stage of the Dockerfile, as far as running a command goes."""

    def __init__(self, text):
        stages = []
        for line in re.sub(r"\\\n", " ", text).splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            word, _, rest = line.partition(" ")
            word = word.upper()
            if word == "FROM":
                stages.append([])
            elif stages:
                stages[-1].append((word, rest.strip()))
        self.env = {"PATH": DEFAULT_PATH}
        self.files = set()
        self.entrypoint = []
        self.cmd = []
        self.problems = []
        workdir = "/"
        for word, rest in stages[-1] if stages else []:
            if word == "ENV":
                self._env(rest)
            elif word == "WORKDIR":
                workdir = posixpath.join(workdir, rest)
            elif word in ("COPY", "ADD"):
                self._copy(rest, workdir)
            elif word in ("ENTRYPOINT", "CMD"):
                argv = self._exec_form(word, rest)
                if word == "ENTRYPOINT":
                    # A new ENTRYPOINT drops an inherited CMD.
                    self.entrypoint, self.cmd = argv, []
                else:
                    self.cmd = argv
        if not stages:
            self.problems.append("Dockerfile: no FROM")

    def _env(self, rest):
        words = shlex.split(rest)
        pairs = [w.split("=", 1) for w in words] if "=" in words[0] else [[words[0], " ".join(words[1:])]]
        for key, value in pairs:
            self.env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: self.env.get(m.group(1), ""), value)

    def _copy(self, rest, workdir):
        words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        words = [w for w in words if not w.startswith("--")]
        *sources, dest = words
        dest = posixpath.join(workdir, dest)
        if dest.endswith("/") or len(sources) > 1:
            self.files.update(posixpath.join(dest, posixpath.basename(s.rstrip("/"))) for s in sources)
        else:
            self.files.add(dest)

    def _exec_form(self, word, rest):
        if not rest.startswith("["):
            # The shell form needs /bin/sh, which the distroless image lacks.
            self.problems.append(f"Dockerfile: {word} {rest}: not the exec (JSON) form")
            return []
        return json.loads(rest)

    def which(self, program):
        """Where the runtime finds argv[0], or None."""
        if "/" in program:
            return program if program in self.files else None
        for directory in self.env["PATH"].split(":"):
            candidate = posixpath.join(directory or "/", program)
            if candidate in self.files:
                return candidate
        return None

    def argv(self, command, args):
        """A container's argv: `command` replaces ENTRYPOINT (and CMD),
        `args` replaces CMD."""
        if command:
            return list(command) + list(args or [])
        return self.entrypoint + (list(args) if args is not None else self.cmd)


def check_argv(image, where, argv, failures):
    """Appends what is wrong with running argv in the image; True if nothing."""
    before = len(failures)
    if not argv:
        failures.append(f"{where}: nothing to run")
        return False
    found = image.which(argv[0])
    if found is None or posixpath.basename(found) != BINARY:
        failures.append(f"{where}: {argv[0]!r} does not resolve to the {BINARY} binary in the image "
                        f"(PATH={image.env['PATH']}, copied: {', '.join(sorted(image.files))})")
    for flag, value in zip(argv, argv[1:]):
        if flag == "--from" and (value not in image.files or posixpath.basename(value) != SHIM):
            failures.append(f"{where}: install-shim --from {value}: the image has no {SHIM} there "
                            f"(copied: {', '.join(sorted(image.files))})")
    return len(failures) == before


def is_ours(image_ref):
    """gpumem's own image, whatever the registry and tag (sidecars are not)."""
    name = image_ref.rsplit("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[0] == BINARY


def check_containers(image, name, doc, failures):
    results = []
    spec = (doc.get("spec") or {}).get("template", {}).get("spec") or {}
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            if not is_ours(container.get("image", "")):
                continue
            argv = image.argv(container.get("command"), container.get("args"))
            results.append(check_argv(image, f"{name} {kind}[{container.get('name')}]", argv, failures))
    return results


def check_state_mounts(name, docs, wants, failures):
    """The node daemon mounts a bounded tmpfs for each container's state
    directory (`wants`) only with the state volume's mounts propagating to
    the host (Bidirectional), which the API server allows to a privileged
    container only, and one that does not also refuse privilege escalation;
    without them it gets no privilege. The schemas check none of this."""
    for doc in docs:
        if doc.get("kind") != "DaemonSet":
            continue
        for container in doc["spec"]["template"]["spec"].get("containers") or []:
            context = container.get("securityContext") or {}
            privileged = context.get("privileged", False)
            bidirectional = any(m.get("mountPropagation") == "Bidirectional"
                                for m in container.get("volumeMounts") or [])
            where = f"{name} containers[{container.get('name')}]"
            if bidirectional != wants or privileged != wants:
                failures.append(f"{where}: privileged {privileged} and Bidirectional state volume "
                                f"{bidirectional}; bounded state directories want both {wants}")
            flag = flags(container.get("args") or []).get("--bound-state-dirs")
            if flag != ("require" if wants else "off"):
                failures.append(f"{where}: --bound-state-dirs={flag}; the privileges granted want "
                                f"{'require' if wants else 'off'}")
            if privileged and context.get("allowPrivilegeEscalation") is False:
                failures.append(f"{where}: privileged with allowPrivilegeEscalation: false, "
                                "which the API server refuses")


# `kubectl [flags] exec [flags] TARGET [flags] -- PROGRAM ARGS...` in the docs.
EXEC_FLAGS_WITH_VALUE = {"-n", "--namespace", "-c", "--container", "--context", "--kubeconfig", "--pod-running-timeout"}


def documented_execs(text):
    for line in text.splitlines():
        # A console line (`$ kubectl …`) or an inline code span in prose.
        candidates = re.findall(r"`(kubectl [^`]*)`", line)
        line = line.strip().lstrip("$").strip()
        if line.startswith("kubectl "):
            candidates.append(line)
        for candidate in candidates:
            yield from exec_argv(candidate)


def exec_argv(line):
    if " exec " not in line or " -- " not in line:
        return
    try:
        words = shlex.split(line)
    except ValueError:
        return
    if "exec" in words and "--" in words:
        before, after = words[: words.index("--")], words[words.index("--") + 1 :]
        targets, skip = [], False
        for word in before[before.index("exec") + 1 :]:
            if skip:
                skip = False
            elif word in EXEC_FLAGS_WITH_VALUE:
                skip = True
            elif not word.startswith("-"):
                targets.append(word)
        if targets and targets[0].rsplit("/", 1)[-1].startswith(BINARY) and after:
            yield line, after


def check_docs(image, failures):
    results = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line, argv in documented_execs(doc.read_text()):
            results.append(check_argv(image, f"{doc.relative_to(ROOT)}: {line}", argv, failures))
    if not results:
        failures.append("docs: no `kubectl exec ds/gpumem -- gpumem …` command found to check")
        results.append(False)
    return results


def check_pod_settings(name, values, docs, failures):
    """The pod-level values reach the node agent, and the uninstall hook
    renders exactly when it can run (it needs the API server)."""
    agent = next((d for d in docs if d.get("kind") == "DaemonSet"), None)
    if agent is None:
        failures.append(f"{name}: no DaemonSet rendered")
        return
    pod = agent["spec"]["template"]
    spec = pod["spec"]
    expected = {
        "imagePullSecrets": (spec.get("imagePullSecrets"), values.get("imagePullSecrets")),
        "affinity": (spec.get("affinity"), values.get("affinity")),
        "podAnnotations": (pod["metadata"].get("annotations"), values.get("podAnnotations")),
    }
    for key, (rendered, wanted) in expected.items():
        if rendered != (wanted or None):
            failures.append(f"{name}: {key} rendered as {rendered!r}, values say {wanted!r}")
    if spec.get("runtimeClassName") != (values.get("runtimeClassName") or None):
        failures.append(f"{name}: runtimeClassName rendered as {spec.get('runtimeClassName')!r}, "
                        f"values say {values.get('runtimeClassName')!r}")
    container = next(c for c in spec["containers"] if c["name"] == "gpumem")
    args = container.get("args") or []
    extra = values.get("extraArgs", [])
    if args[len(args) - len(extra):] != extra:
        failures.append(f"{name}: the agent's args do not end with extraArgs {extra}: {args}")
    if extra == [] and f"--log-format={values.get('logFormat', 'text')}" not in args:
        failures.append(f"{name}: the agent's args lack --log-format")
    # clap refuses a flag given twice: extraArgs must replace the chart's.
    given = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    twice = sorted({f for f in given if given.count(f) > 1})
    if twice:
        failures.append(f"{name}: the agent's args give {twice} twice, which gpumem refuses")
    address = values.get("metricsAddress", "")
    if f"--metrics-addr={address}:{values.get('metricsPort', 9400)}" not in args and not any(
            a.startswith("--metrics-addr") for a in extra):
        failures.append(f"{name}: --metrics-addr is not {address}:{values.get('metricsPort', 9400)}")
    loopback = address in ("127.0.0.1", "localhost", "[::1]")
    if bool(container.get("livenessProbe")) == loopback:
        failures.append(f"{name}: a liveness probe on /healthz {'at' if loopback else 'missing for'} "
                        f"metrics address {address!r} (kubelet cannot reach the pod's loopback)")
    wants_hook = (values.get("apiServer", True) and values.get("uninstall", {}).get("unpublish", True)
                  and values.get("frontEnd", "devicePlugin") == "devicePlugin")
    hooks = [d for d in docs if d.get("kind") == "Job"
             and d["metadata"].get("annotations", {}).get("helm.sh/hook") == "post-delete"]
    if bool(hooks) != bool(wants_hook):
        failures.append(f"{name}: the uninstall hook Job should {'' if wants_hook else 'not '}render")
    # The hook cleans the Nodes this release serves only: its nodeSelector.
    selector = spec.get("nodeSelector") or {}
    for hook in hooks:
        hook_args = hook["spec"]["template"]["spec"]["containers"][0].get("args") or []
        rendered = {a.split("=", 1)[1] for a in hook_args if a.startswith("--selector=")}
        wanted = set(",".join(f"{k}={v}" for k, v in sorted(selector.items())).split(",")) - {""}
        got = {term for r in rendered for term in r.split(",")}
        if got != wanted:
            failures.append(f"{name}: the uninstall hook selects Nodes by {sorted(got)}, "
                            f"not the release's nodeSelector {sorted(wanted)}")


def main():
    failures = []
    checked = 0
    image = Image((ROOT / "Dockerfile").read_text())
    image_failures = list(image.problems)
    commands = [False] * len(image.problems)
    commands.append(check_argv(image, "Dockerfile ENTRYPOINT + CMD", image.argv(None, None), image_failures))
    commands += check_docs(image, image_failures)

    loaded = {}
    for file, versions in (("gpumem.yaml", VERSIONS), ("extender.yaml", VERSIONS), ("second-scheduler.yaml", VERSIONS),
                           ("gpumem-dra.yaml", DRA_VERSIONS), ("dra-example.yaml", DRA_VERSIONS)):
        manifest = ROOT / "daemonset" / file
        loaded[file] = []
        for name, doc in documents(str(manifest.relative_to(ROOT)), manifest.read_text()):
            validate(name, doc, failures, versions)
            checked += 1
            commands += check_containers(image, name, doc, image_failures)
            loaded[file].append(doc)
    driver, dra = check_dra("daemonset/gpumem-dra.yaml", loaded["gpumem-dra.yaml"], image, failures, True)
    if driver:
        check_claims("daemonset/dra-example.yaml", loaded["dra-example.yaml"], dra["classes"], dra["unit"], failures)
        plugin_selector = next(d for d in loaded["gpumem.yaml"] if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]["nodeSelector"]
        if not disjoint(plugin_selector, dra["selector"]):
            failures.append(f"daemonset/gpumem-dra.yaml: nodeSelector {dra['selector']} can match the same node as "
                            f"daemonset/gpumem.yaml's {plugin_selector}: a node runs one front end")
    for file in ("gpumem.yaml", "gpumem-dra.yaml"):
        check_state_mounts(f"daemonset/{file}", loaded[file], True, failures)
    extender_docs = [doc for _, doc in documents("extender", (ROOT / "daemonset" / "extender.yaml").read_text())]
    config = ROOT / "daemonset" / "kube-scheduler-config.yaml"
    check_scheduler_config(str(config.relative_to(ROOT)), yaml.safe_load(config.read_text()),
                           extender_docs, "aliyun.com/gpu-mem", failures)
    checked += 1
    plain_second = check_second_scheduler("daemonset/second-scheduler.yaml", loaded["second-scheduler.yaml"],
                                          "kube-system", "gpumem-scheduler", "aliyun.com/gpu-mem", failures)

    chart = helm.Chart.load(ROOT / "deploy" / "helm" / "gpumem")
    selectors = {}
    for variant, values in VARIANTS.items():
        rendered = chart.render(with_image(values), name="gpumem", namespace="kube-system", is_install=True)
        is_dra = values.get("frontEnd") == "dra"
        docs = []
        for path, text in sorted(rendered.items()):
            if not path.endswith((".yaml", ".yml")):
                continue
            for name, doc in documents(f"chart[{variant}]:{path}", text):
                if doc.get("kind") not in MONITORING_KINDS:
                    validate(name, doc, failures, DRA_VERSIONS if is_dra else VERSIONS)
                checked += 1
                commands += check_containers(image, name, doc, image_failures)
                docs.append(doc)
        check_monitoring(f"chart[{variant}]", docs, failures)
        # Each of the chart's monitoring documents is there exactly when on.
        wanted = {"ServiceMonitor": ("serviceMonitor", False), "PodMonitor": ("podMonitor", False),
                  "PrometheusRule": ("prometheusRule", False), "Service": ("service", True),
                  "ConfigMap": ("dashboard", True)}
        for kind, (key, default) in wanted.items():
            want = values.get("metrics", {}).get(key, {}).get("enabled", default)
            ours = [d for d in docs if d.get("kind") == kind
                    and (kind != "Service" or d["metadata"]["name"].endswith("-metrics"))
                    and (kind != "ConfigMap" or d["metadata"].get("labels", {}).get("grafana_dashboard"))]
            if bool(ours) != want:
                failures.append(f"chart[{variant}]: metrics.{key}.enabled is {want}, but a {kind} is "
                                f"{'missing' if want else 'rendered'}")
        if is_dra:
            wants_class = values.get("dra", {}).get("deviceClass", {}).get("create", True)
            _, dra = check_dra(f"chart[{variant}]", docs, image, failures, wants_class)
            # (check_dra: one DaemonSet, the driver's; no device plugin beside it.)
            selectors[variant] = dra.get("selector", {})
        else:
            selectors[variant] = next((d["spec"]["template"]["spec"].get("nodeSelector") or {}
                                       for d in docs if d.get("kind") == "DaemonSet"), {})
        # The variant's values must reach the manifest.
        node_selector = values.get("dra", {}) if is_dra else values
        for expected in node_selector.get("nodeSelector", {}):
            if not any(expected in text for text in rendered.values()):
                failures.append(f"chart[{variant}]: nodeSelector {expected} not rendered")
        second = values.get("secondScheduler", {})
        if second.get("enabled"):
            config, deployment = check_second_scheduler(
                f"chart[{variant}]", docs, "kube-system", second.get("name", "gpumem-scheduler"),
                values.get("resourceName", "aliyun.com/gpu-mem"), failures)
            # The plain manifest is the chart's defaults.
            if set(second) == {"enabled"} and config is not None and plain_second[0] is not None:
                if config != plain_second[0]:
                    failures.append(f"chart[{variant}]: the scheduler's configuration is not "
                                    f"daemonset/second-scheduler.yaml's")
                ours, plain = (d["spec"]["template"]["spec"]["containers"] for d in (deployment, plain_second[1]))
                strip = [{k: v for k, v in c.items() if k not in ("image", "imagePullPolicy")} for c in ours]
                if strip != [{k: v for k, v in c.items() if k != "image"} for c in plain]:
                    failures.append(f"chart[{variant}]: the second scheduler's containers are not "
                                    f"daemonset/second-scheduler.yaml's")
            if deployment is not None:
                images = {c["name"]: c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
                if images["kube-scheduler"] != second.get("image", "registry.k8s.io/kube-scheduler:v1.37.2"):
                    failures.append(f"chart[{variant}]: kube-scheduler image {images['kube-scheduler']}")
                if deployment["spec"]["replicas"] != second.get("replicas", 2):
                    failures.append(f"chart[{variant}]: {deployment['spec']['replicas']} replicas")
        elif any(d.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/name") == "gpumem-scheduler"
                 for d in docs):
            failures.append(f"chart[{variant}]: second-scheduler objects rendered with secondScheduler off")
        check_pod_settings(f"chart[{variant}]", values, docs, failures)
        bounded = values.get("isolation", "shim") == "shim" and values.get("boundedStateDirs", True)
        check_state_mounts(f"chart[{variant}]", docs, bounded, failures)
        # The host's PID namespace only where reconciliation needs it.
        wants = values.get("isolation", "shim") == "shim" and values.get("reconcileSecs", 2) > 0
        if any("hostPID: true" in text for text in rendered.values()) != wants:
            failures.append(f"chart[{variant}]: hostPID should be {str(wants).lower()}")

    # Installed side by side with their defaults, the two front ends never
    # share a node.
    if not disjoint(selectors["defaults"], selectors["dra"]):
        failures.append(f"chart: dra.nodeSelector {selectors['dra']} can match the same node as "
                        f"nodeSelector {selectors['defaults']}: a node runs one front end")
    for variant, (values, message) in REFUSED.items():
        try:
            chart.render(with_image(values) if variant != "no-image" else values,
                         name="gpumem", namespace="kube-system", is_install=True)
            failures.append(f"chart[{variant}]: rendered {values}, which it should refuse")
        except (helm.HelmRenderError, helm.HelmValuesError) as err:
            if message not in str(err):
                failures.append(f"chart[{variant}]: refused {values}, but not saying {message!r}: {err}")
        checked += 1

    # tests/monitoring.rs scrapes with what prometheus-operator makes of the
    # chart's monitors: the file must be what the chart renders today.
    stale = operator_scrape.stale()
    if stale:
        failures.append(f"chart: {stale}")
    checked += 1

    for failure in failures:
        print(f"invalid: {failure}", file=sys.stderr)
    for failure in image_failures:
        print(f"image: {failure}", file=sys.stderr)
    print(f"validate-manifests: {checked} documents checked against Kubernetes {', '.join(VERSIONS)} "
          f"(the DRA front end: {', '.join(DRA_VERSIONS)}); "
          f"{len(commands)} commands run in the image (PATH={image.env['PATH']})")
    bad = len({f.split(" ", 1)[0] for f in failures})
    passed = checked - min(bad, checked) + commands.count(True)
    print(f"{passed} passed, {bad + commands.count(False)} failed")
    return 1 if failures or image_failures else 0


if __name__ == "__main__":
    sys.exit(main())
