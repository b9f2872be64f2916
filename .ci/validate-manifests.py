"""Validates the DaemonSet manifest and the Helm chart, rendered with Helm's
own engine (helm-python-sdk binds Helm's Go SDK), against the Kubernetes
OpenAPI schemas bundled in kubernetes-validate. Offline: no cluster needed.

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
    "volume-mounts": {"deviceListStrategy": "volume-mounts"},
    "cdi": {"deviceListStrategy": "cdi"},
    "kubelet-only": {"apiServer": False},
    "gpushare-extender": {"scheduler": "gpushare-extender", "extender": {"enabled": True}},
}

# kube-scheduler decodes its configuration strictly: the fields of an
# extender (kubescheduler.config.k8s.io/v1 Extender) and what they hold.
EXTENDER_FIELDS = {
    "urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb",
    "enableHTTPS", "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable",
}
# The routes `gpumem extender` serves.
EXTENDER_VERBS = {"filterVerb": "filter", "prioritizeVerb": "prioritize", "bindVerb": "bind"}


def check_scheduler_config(name, config, extender_docs, resource, failures):
    """The KubeSchedulerConfiguration reaches the extender as deployed."""
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
    port = next((p.get("nodePort") for d in extender_docs if d.get("kind") == "Service"
                 for p in d["spec"]["ports"]), None)
    if ext.get("urlPrefix") != f"http://127.0.0.1:{port}":
        failures.append(f"{name}: urlPrefix {ext.get('urlPrefix')!r} does not reach the Service's NodePort {port}")


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


def main():
    failures = []
    checked = 0
    image = Image((ROOT / "Dockerfile").read_text())
    image_failures = list(image.problems)
    commands = [False] * len(image.problems)
    commands.append(check_argv(image, "Dockerfile ENTRYPOINT + CMD", image.argv(None, None), image_failures))
    commands += check_docs(image, image_failures)

    for file in ("gpumem.yaml", "extender.yaml"):
        manifest = ROOT / "daemonset" / file
        for name, doc in documents(str(manifest.relative_to(ROOT)), manifest.read_text()):
            validate(name, doc, failures)
            checked += 1
            commands += check_containers(image, name, doc, image_failures)
    extender_docs = [doc for _, doc in documents("extender", (ROOT / "daemonset" / "extender.yaml").read_text())]
    config = ROOT / "daemonset" / "kube-scheduler-config.yaml"
    check_scheduler_config(str(config.relative_to(ROOT)), yaml.safe_load(config.read_text()),
                           extender_docs, "aliyun.com/gpu-mem", failures)
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
                commands += check_containers(image, name, doc, image_failures)
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
    for failure in image_failures:
        print(f"image: {failure}", file=sys.stderr)
    print(f"validate-manifests: {checked} documents checked against Kubernetes {', '.join(VERSIONS)}; "
          f"{len(commands)} commands run in the image (PATH={image.env['PATH']})")
    bad = len({f.split(" ", 1)[0] for f in failures})
    passed = checked - min(bad, checked) + commands.count(True)
    print(f"{passed} passed, {bad + commands.count(False)} failed")
    return 1 if failures or image_failures else 0


if __name__ == "__main__":
    sys.exit(main())
