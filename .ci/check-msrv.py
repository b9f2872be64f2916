"""Checks the declared minimum Rust version against the locked dependencies.

Every workspace member declares the same `rust-version`; no package in the
locked dependency graph (for the Linux targets gpumem builds for) may declare
a higher one; and the Dockerfile builds with exactly that version, so every
image build is a build with the declared minimum. Reads `cargo metadata`;
installs no toolchain.

    python3 .ci/check-msrv.py
"""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# gpumem is Linux-only (device plugin, LD_PRELOAD shim): dependencies of
# other platforms (windows-sys and the like) never build.
PLATFORMS = ["x86_64-unknown-linux-gnu", "aarch64-unknown-linux-gnu"]
BUILDER = re.compile(r"^FROM\s+rust:(\d+\.\d+(?:\.\d+)?)\S*", re.MULTILINE)


def version(text):
    """'1.88' and '1.88.0' compare equal; a missing part counts as 0."""
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def metadata():
    command = ["cargo", "metadata", "--locked", "--format-version", "1"]
    for platform in PLATFORMS:
        command += ["--filter-platform", platform]
    return json.loads(subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout)


def main():
    meta = metadata()
    packages = {package["id"]: package for package in meta["packages"]}
    members = [packages[member] for member in meta["workspace_members"]]
    failures = []

    declared = {member["name"]: member.get("rust_version") for member in members}
    for name, declared_version in sorted(declared.items()):
        if not declared_version:
            failures.append(f"workspace member {name} declares no rust-version")
    versions = {v for v in declared.values() if v}
    if len({version(v) for v in versions}) > 1:
        failures.append("workspace members declare different rust-versions: "
                        + ", ".join(f"{name} {v}" for name, v in sorted(declared.items()) if v))
    if not versions:
        for failure in failures:
            print(f"check-msrv: {failure}", file=sys.stderr)
        return 1
    # The lowest one declared is the claim a dependency can break.
    ours = min(versions, key=version)

    member_ids = set(meta["workspace_members"])
    graph = [packages[node["id"]] for node in meta["resolve"]["nodes"] if node["id"] not in member_ids]
    needs = sorted(
        (p for p in graph if p.get("rust_version")),
        key=lambda p: (tuple(-part for part in version(p["rust_version"])), p["name"]),
    )
    for package in needs:
        if version(package["rust_version"]) > version(ours):
            failures.append(f"{package['name']} {package['version']} needs Rust {package['rust_version']}, "
                            f"above the workspace's rust-version {ours}")

    dockerfile = (ROOT / "Dockerfile").read_text()
    builders = BUILDER.findall(dockerfile)
    if not builders:
        failures.append("Dockerfile: no `FROM rust:X.Y` build stage found")
    for builder in builders:
        if version(builder) != version(ours):
            failures.append(f"Dockerfile builds with rust:{builder}, not the declared minimum {ours}")

    for failure in failures:
        print(f"check-msrv: {failure}", file=sys.stderr)
    highest = needs[0] if needs else None
    print(f"check-msrv: rust-version {ours} in {len(members)} workspace members; "
          f"{len(graph)} locked dependencies for {', '.join(PLATFORMS)}"
          + (f", the most demanding {highest['name']} {highest['version']} (Rust {highest['rust_version']})"
             if highest else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
