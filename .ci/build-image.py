#!/usr/bin/env python3
"""Builds gpumem's release image as an OCI archive, with no Docker daemon and
no base image: the files are the release binary, the shim and the shared
libraries the binary loads, taken from this machine's Debian packages.

  .ci/build-image.py --arch amd64 --gpumem target/release/gpumem \\
      --shim target/x86_64-unknown-linux-gnu/release/libgpumem_shim.so

writes target/image/gpumem-VERSION-ARCH.oci.tar (an OCI image layout:
oci-layout, index.json and blobs/, plus docker's manifest.json beside them,
so `ctr images import`, `skopeo copy oci-archive:` and `docker load` all
take it) and gpumem-VERSION-ARCH.spdx.json, an SPDX 2.3 SBOM of every file
in the image, the Debian packages they come from (with dpkg's versions) and
the Rust crates from Cargo.lock built into the binary and the shim. The SBOM
is in the image too, at /opt/gpumem/sbom.spdx.json. Prints the manifest's
digest, the one a registry will report.

  .ci/build-image.py --index target/image/gpumem-VERSION-amd64.oci.tar \\
      target/image/gpumem-VERSION-arm64.oci.tar

joins the architectures' archives into target/image/gpumem-VERSION.oci.tar:
one image whose index names each architecture's manifest, for `skopeo copy
--all` to a registry and `ctr images import --all-platforms`.

Reproducible: entries sorted, owners root, mtimes SOURCE_DATE_EPOCH (0 when
unset), gzip without name or time; the same inputs give the same digest.
The image matches the Dockerfile's final stage: /opt/gpumem/gpumem and
/opt/gpumem/libgpumem_shim.so, the same PATH, ENTRYPOINT and CMD (the test
`.ci/test_build_image.py` holds the two together).
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import posixpath
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Debian's multiarch names and the dynamic linker each architecture's
# binaries name as their interpreter.
ARCHES = {
    "amd64": {"triple": "x86_64-linux-gnu", "rust": "x86_64-unknown-linux-gnu"},
    "arm64": {"triple": "aarch64-linux-gnu", "rust": "aarch64-unknown-linux-gnu"},
}

# What the Dockerfile's final stage sets.
PREFIX = "/opt/gpumem"
PATH = "/opt/gpumem:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENTRYPOINT = ["/opt/gpumem/gpumem"]
CMD = ["plugin"]
SBOM_IN_IMAGE = PREFIX + "/sbom.spdx.json"

# A name nobody else's registry answers for: push under your own
# (README, "Deploying it").
DEFAULT_NAME = "localhost/gpumem"

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


class BuildError(Exception):
    pass


def run(*argv):
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def elf_needs(path):
    """The interpreter and the DT_NEEDED names of an ELF file (readelf reads
    any architecture's, unlike ldd)."""
    out = run("readelf", "-W", "-l", "-d", str(path))
    interp = re.search(r"\[Requesting program interpreter: ([^\]]+)\]", out)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    return (interp.group(1) if interp else None), needed


def find_lib(name, triple):
    for d in (f"/usr/lib/{triple}", f"/lib/{triple}"):
        p = Path(d) / name
        if p.exists():
            return p
    raise BuildError(f"{name} ({triple}) is not installed on this machine: install its Debian "
                     f"package (for another architecture: dpkg --add-architecture, then PACKAGE:ARCH)")


def dpkg_owner(path):
    """(package, version, architecture) of the Debian package that installed
    path. Merged /usr: the database may name /lib/… or /usr/lib/…."""
    real = os.path.realpath(path)
    candidates = [str(path), real]
    for p in list(candidates):
        if p.startswith("/usr/"):
            candidates.append(p[len("/usr"):])
        else:
            candidates.append("/usr" + p)
    for p in dict.fromkeys(candidates):
        done = subprocess.run(["dpkg-query", "-S", p], capture_output=True, text=True)
        if done.returncode == 0:
            # "libc6:amd64: /usr/lib/x86_64-linux-gnu/libc.so.6"
            pkg = done.stdout.split("\n")[0].rsplit(": ", 1)[0].split(",")[0].strip()
            fields = run("dpkg-query", "-W", "-f", "${Package}\t${Version}\t${Architecture}", pkg)
            name, version, arch = fields.split("\t")
            return name, version, arch
    raise BuildError(f"{path}: no Debian package owns it (dpkg-query -S): the SBOM must name where it comes from")


def shared_libs(elf, triple):
    """Every library elf loads, transitively, and its interpreter: {image path: host path}."""
    files = {}
    interp, needed = elf_needs(elf)
    queue = list(needed)
    seen = set()
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        host = find_lib(name, triple)
        files[f"/usr/lib/{triple}/{name}"] = host
        queue += elf_needs(host)[1]
    links = {}
    if interp:
        base = posixpath.basename(interp)
        target = f"/usr/lib/{triple}/{base}"
        if target not in files:
            files[target] = find_lib(base, triple)
        # /lib64/ld-linux-x86-64.so.2 → /usr/lib64/… through the /lib64 link.
        usr = interp if interp.startswith("/usr/") else "/usr" + interp
        if usr != target:
            links[usr] = posixpath.relpath(target, posixpath.dirname(usr))
    return files, links


def crates(package, rust_target, features):
    """name → version of the crates cargo builds into package (normal
    dependencies for that target, as Cargo.lock resolves them)."""
    argv = ["cargo", "tree", "--locked", "--offline", "--manifest-path", str(ROOT / "Cargo.toml"), "-p", package, "-e", "normal,no-proc-macro",
            "--target", rust_target, "--prefix", "none", "--format", "{p}"] + features
    out = run(*argv)
    found = set()
    for line in out.splitlines():
        m = re.match(r"^(\S+) v(\S+)", line)
        if m and "(*)" not in m.group(0):
            found.add((m.group(1), m.group(2)))
    return found


def lock_checksums():
    lock = tomllib.loads((ROOT / "Cargo.lock").read_text())
    return {(p["name"], p["version"]): (p.get("checksum"), p.get("source")) for p in lock.get("package", [])}


def spdx_id(kind, *parts):
    return "SPDXRef-" + kind + "-" + re.sub(r"[^A-Za-z0-9.-]", "-", "-".join(parts))


def build_sbom(name, version, arch, files, owners, crate_set, epoch):
    """SPDX 2.3: the image, its files, the Debian packages and the crates."""
    checks = lock_checksums()
    created = f"{_utc(epoch)}"
    image_id = "SPDXRef-Image"
    packages = [{
        "SPDXID": image_id,
        "name": "gpumem",
        "versionInfo": version,
        "downloadLocation": "NOASSERTION",
        "licenseConcluded": "NOASSERTION",
        "licenseDeclared": "Apache-2.0",
        "copyrightText": "NOASSERTION",
        "primaryPackagePurpose": "CONTAINER",
        "filesAnalyzed": False,
        "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                          "referenceLocator": f"pkg:oci/gpumem@{version}?arch={arch}"}],
    }]
    relationships = [{"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES",
                      "relatedSpdxElement": image_id}]
    spdx_files = []
    for path in sorted(files):
        data = files[path]
        fid = spdx_id("File", path.strip("/"))
        spdx_files.append({
            "SPDXID": fid,
            "fileName": "." + path,
            "checksums": [{"algorithm": "SHA1", "checksumValue": hashlib.sha1(data).hexdigest()},
                          {"algorithm": "SHA256", "checksumValue": hashlib.sha256(data).hexdigest()}],
            "licenseConcluded": "NOASSERTION",
            "copyrightText": "NOASSERTION",
        })
        relationships.append({"spdxElementId": image_id, "relationshipType": "CONTAINS",
                              "relatedSpdxElement": fid})
        if path in owners:
            pkg, pver, parch = owners[path]
            relationships.append({"spdxElementId": spdx_id("Deb", pkg, pver), "relationshipType": "CONTAINS",
                                  "relatedSpdxElement": fid})
    for pkg, pver, parch in sorted(set(owners.values())):
        pid = spdx_id("Deb", pkg, pver)
        packages.append({
            "SPDXID": pid, "name": pkg, "versionInfo": pver, "supplier": "Organization: Debian",
            "downloadLocation": "NOASSERTION", "licenseConcluded": "NOASSERTION",
            "copyrightText": "NOASSERTION", "filesAnalyzed": False,
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": f"pkg:deb/debian/{pkg}@{pver}?arch={parch}"}],
        })
        relationships.append({"spdxElementId": image_id, "relationshipType": "CONTAINS", "relatedSpdxElement": pid})
    for cname, cver in sorted(crate_set):
        pid = spdx_id("Crate", cname, cver)
        checksum, source = checks.get((cname, cver), (None, None))
        entry = {
            "SPDXID": pid, "name": cname, "versionInfo": cver,
            "downloadLocation": f"https://crates.io/api/v1/crates/{cname}/{cver}/download" if checksum else "NOASSERTION",
            "licenseConcluded": "NOASSERTION", "copyrightText": "NOASSERTION", "filesAnalyzed": False,
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": f"pkg:cargo/{cname}@{cver}"}],
        }
        if checksum:
            entry["checksums"] = [{"algorithm": "SHA256", "checksumValue": checksum}]
        packages.append(entry)
        relationships.append({"spdxElementId": image_id, "relationshipType": "CONTAINS", "relatedSpdxElement": pid})
    content = hashlib.sha256(json.dumps([spdx_files, packages], sort_keys=True).encode()).hexdigest()
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"{name}:{version}-{arch}",
        # Derived from the content, so that the same inputs give the same document.
        "documentNamespace": f"https://gpumem.invalid/spdx/{content}",
        "creationInfo": {"created": created, "creators": ["Tool: gpumem .ci/build-image.py"]},
        "packages": packages,
        "files": spdx_files,
        "relationships": relationships,
    }


def _utc(epoch):
    import datetime
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def tar_bytes(entries, epoch):
    """A tar of entries (path → bytes, or ("link", target), or None for a
    directory), sorted, owned by root, every mtime epoch."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(entries):
            value = entries[path]
            info = tarfile.TarInfo(path.lstrip("/"))
            info.mtime = epoch
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if value is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o1777 if path == "/tmp" else 0o755
                tar.addfile(info)
            elif value[0] == "link":
                info.type = tarfile.SYMTYPE
                info.linkname = value[1]
                info.mode = 0o777
                tar.addfile(info)
            else:
                data, mode = value
                info.size = len(data)
                info.mode = mode
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def with_parents(entries):
    for path in list(entries):
        d = posixpath.dirname(path)
        while d not in ("/", ""):
            entries.setdefault(d, None)
            d = posixpath.dirname(d)
    return entries


def build(args):
    spec = ARCHES[args.arch]
    triple = spec["triple"]
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    version = args.version or tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    name = f"{args.name}:{version}"

    gpumem = Path(args.gpumem).read_bytes()
    shim = Path(args.shim).read_bytes()
    for label, path, data in (("--gpumem", args.gpumem, gpumem), ("--shim", args.shim, shim)):
        machine = {b"\x3e\x00": "amd64", b"\xb7\x00": "arm64"}.get(data[18:20])
        if data[:4] != b"\x7fELF" or machine != args.arch:
            raise BuildError(f"{label} {path}: not an {args.arch} ELF file (machine {machine})")

    libs, links = shared_libs(args.gpumem, triple)
    files = {  # image path → bytes
        PREFIX + "/gpumem": gpumem,
        PREFIX + "/libgpumem_shim.so": shim,
        # Who the process is, for anything that looks its user up.
        "/etc/passwd": b"root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n",
        "/etc/group": b"root:x:0:\nnogroup:x:65534:\n",
    }
    owners = {}
    for path, host in sorted(libs.items()):
        files[path] = Path(host).read_bytes()
        owners[path] = dpkg_owner(host)

    crate_set = crates("gpumem", spec["rust"], ["--no-default-features"]) | crates("gpumem-shim", spec["rust"], [])
    sbom = build_sbom(args.name, version, args.arch, files, owners, crate_set, epoch)
    sbom_bytes = (json.dumps(sbom, indent=1, sort_keys=True) + "\n").encode()

    entries = {p: (d, 0o644 if p.startswith("/etc/") else 0o755) for p, d in files.items()}
    entries[SBOM_IN_IMAGE] = (sbom_bytes, 0o644)
    # Merged /usr, as Debian has it: the interpreter's /lib64 or /lib path
    # reaches /usr's.
    entries["/lib"] = ("link", "usr/lib")
    if any(link.startswith("/usr/lib64/") for link in links):
        entries["/lib64"] = ("link", "usr/lib64")
    for path, target in links.items():
        entries[path] = ("link", target)
    for d in ("/tmp", "/etc", "/proc", "/sys", "/dev", "/root"):
        entries[d] = None
    with_parents(entries)
    layer = tar_bytes(entries, epoch)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    gz = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=gz, mtime=0, compresslevel=6) as z:
        z.write(layer)
    layer_gz = gz.getvalue()

    revision = args.revision
    labels = {"org.opencontainers.image.title": "gpumem",
              "org.opencontainers.image.version": version,
              "org.opencontainers.image.licenses": "Apache-2.0"}
    if revision:
        labels["org.opencontainers.image.revision"] = revision
    config = canonical({
        "architecture": args.arch,
        "os": "linux",
        "created": _utc(epoch),
        "config": {"Env": [f"PATH={PATH}"], "Entrypoint": ENTRYPOINT, "Cmd": CMD, "Labels": labels},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": _utc(epoch), "created_by": ".ci/build-image.py"}],
    })
    blobs = {}

    def blob(data, media):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media, "digest": digest, "size": len(data)}

    config_desc = blob(config, MEDIA_CONFIG)
    layer_desc = blob(layer_gz, MEDIA_LAYER)
    manifest = canonical({"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "config": config_desc,
                          "layers": [layer_desc], "annotations": labels})
    manifest_desc = blob(manifest, MEDIA_MANIFEST)
    manifest_desc["platform"] = {"architecture": args.arch, "os": "linux"}
    manifest_desc["annotations"] = {
        # containerd's name for it on import; OCI's tag for skopeo and docker.
        "io.containerd.image.name": name,
        "org.opencontainers.image.ref.name": version,
    }
    index = canonical({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [manifest_desc]})
    # Docker's own archive format, read by `docker load` before Docker 25
    # (which reads index.json): the same blobs, by path.
    docker_manifest = canonical([{
        "Config": "blobs/sha256/" + config_desc["digest"].split(":")[1],
        "RepoTags": [name],
        "Layers": ["blobs/sha256/" + layer_desc["digest"].split(":")[1]],
    }])
    archive = {
        "oci-layout": (canonical({"imageLayoutVersion": "1.0.0"}), 0o644),
        "index.json": (index, 0o644),
        "manifest.json": (docker_manifest, 0o644),
    }
    for digest, data in blobs.items():
        archive["blobs/sha256/" + digest.split(":")[1]] = (data, 0o644)
    with_parents(archive)
    out = Path(args.out or ROOT / "target" / "image" / f"gpumem-{version}-{args.arch}.oci.tar")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(tar_bytes(archive, epoch))
    tmp.replace(out)
    sbom_out = Path(str(out).removesuffix(".oci.tar") + ".spdx.json")
    sbom_out.write_bytes(sbom_bytes)
    return out, sbom_out, manifest_desc["digest"], name


def read_archive(path):
    """An archive's members: name → bytes (directories left out)."""
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def build_index(args):
    """One archive naming every architecture's image: the per-architecture
    archives' blobs, and an image index of their manifests (each with its
    platform) as the one image index.json names. A registry and
    containerd then give each node its architecture's from one tag, which
    a chart with one image setting needs on a cluster of both. Docker's
    manifest.json is left out: `docker load` takes one architecture's
    image, from its own archive."""
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    blobs, manifests, names = {}, [], set()
    for path in args.index:
        members = read_archive(path)
        try:
            index = json.loads(members["index.json"])
        except (KeyError, ValueError) as e:
            raise BuildError(f"{path}: not an OCI archive of .ci/build-image.py: no index.json ({e})")
        for desc in index.get("manifests", []):
            if desc.get("mediaType") != MEDIA_MANIFEST or "platform" not in desc:
                raise BuildError(f"{path}: index.json names {desc.get('mediaType')} without a platform: "
                                 f"build each architecture's archive first (--arch)")
            platform = desc["platform"]
            if any(m["platform"] == platform for m in manifests):
                raise BuildError(f"{path}: a second image for {platform['os']}/{platform['architecture']}")
            names.add(desc.get("annotations", {}).get("io.containerd.image.name"))
            manifests.append({k: desc[k] for k in ("mediaType", "digest", "size", "platform")})
        for name, data in members.items():
            if name.startswith("blobs/sha256/"):
                if "sha256:" + hashlib.sha256(data).hexdigest() != "sha256:" + name.rsplit("/", 1)[1]:
                    raise BuildError(f"{path}: {name} does not match its digest")
                blobs[name] = data
    if len(names) != 1 or None in names:
        raise BuildError(f"the archives name different images ({', '.join(sorted(map(str, names)))}): "
                         f"build them with the same --name and --version")
    name = names.pop()
    manifests.sort(key=lambda m: (m["platform"]["os"], m["platform"]["architecture"]))
    image_index = canonical({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": manifests})
    digest = "sha256:" + hashlib.sha256(image_index).hexdigest()
    blobs["blobs/sha256/" + digest.split(":")[1]] = image_index
    top = canonical({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [{
        "mediaType": MEDIA_INDEX, "digest": digest, "size": len(image_index),
        "annotations": {"io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]},
    }]})
    archive = {
        "oci-layout": (canonical({"imageLayoutVersion": "1.0.0"}), 0o644),
        "index.json": (top, 0o644),
    }
    for member, data in blobs.items():
        archive[member] = (data, 0o644)
    with_parents(archive)
    version = name.rsplit(":", 1)[1]
    out = Path(args.out or ROOT / "target" / "image" / f"gpumem-{version}.oci.tar")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(tar_bytes(archive, epoch))
    tmp.replace(out)
    arches = ", ".join(m["platform"]["architecture"] for m in manifests)
    return out, digest, name, arches


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHES))
    p.add_argument("--gpumem", help="the release gpumem binary for --arch")
    p.add_argument("--shim", help="libgpumem_shim.so as it ships (glibc 2.17, shim/check-abi)")
    p.add_argument("--index", nargs="+", metavar="ARCHIVE",
                   help="instead: join per-architecture archives into one multi-architecture "
                        "image (default out target/image/gpumem-VERSION.oci.tar)")
    p.add_argument("--out", help="the archive (default target/image/gpumem-VERSION-ARCH.oci.tar)")
    p.add_argument("--name", default=DEFAULT_NAME, help=f"the repository the archive names (default {DEFAULT_NAME})")
    p.add_argument("--version", help="the tag (default: Cargo.toml's version)")
    p.add_argument("--revision", help="the commit, for the org.opencontainers.image.revision label")
    args = p.parse_args()
    if args.index:
        if args.arch or args.gpumem or args.shim:
            p.error("--index joins archives already built: without --arch, --gpumem and --shim")
    elif not (args.arch and args.gpumem and args.shim):
        p.error("--arch, --gpumem and --shim are required (or --index ARCHIVE...)")
    try:
        if args.index:
            out, digest, name, arches = build_index(args)
            print(f"{out}: {name} {digest} ({arches})")
            return 0
        out, sbom, digest, name = build(args)
    except (BuildError, OSError) as e:
        print(f"build-image: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {name} {digest}")
    print(f"{sbom}: SBOM (SPDX 2.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
