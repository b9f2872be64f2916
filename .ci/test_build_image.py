#!/usr/bin/env python3
"""Tests .ci/build-image.py's archive as the tools that load it read it:
oci-layout and index.json → manifest → config and layer, each blob's digest
and size as its descriptor says; docker's manifest.json naming the same
blobs; the layer holding the inputs, every library the binary loads and
its interpreter; the config running what the Dockerfile runs; the SBOM
listing each file with its hash, the Debian packages with dpkg's versions
and the crates with Cargo.lock's; skopeo reading the same image from it
as a Docker archive and as an OCI archive; and the same inputs giving the
same bytes.

  python3 .ci/test_build_image.py [--gpumem FILE --shim FILE --arch ARCH --expect-version V]
  python3 .ci/test_build_image.py --index AMD64.oci.tar ARM64.oci.tar

Without files it builds from this machine's /bin/true (any ELF of the
architecture will do: the checks are about the archive, not gpumem). Each
archive is read by skopeo too (`docker-archive:`, as `docker load` reads
Docker's manifest.json, and `oci-archive:`, as a push reads it): skopeo
must be installed. With --index it tests the multi-architecture archive
build-image.py --index makes of those archives.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT / ".ci" / "build-image.py"
ARGS = None


def build(out, gpumem, shim, arch, *extra, env=None):
    done = subprocess.run([sys.executable, str(BUILDER), "--arch", arch, "--gpumem", str(gpumem),
                           "--shim", str(shim), "--out", str(out), *extra],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise AssertionError(f"build-image.py failed: {done.stderr}")
    return done.stdout


def members(data):
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        out = {}
        for m in tar.getmembers():
            out[m.name] = (m, tar.extractfile(m).read() if m.isfile() else None)
        return out


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Archive(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = Path(cls.tmp.name)
        cls.gpumem = Path(ARGS.gpumem)
        cls.shim = Path(ARGS.shim)
        cls.out = d / "a" / "gpumem.oci.tar"
        cls.again = d / "b" / "gpumem.oci.tar"
        cls.stdout = build(cls.out, cls.gpumem, cls.shim, ARGS.arch)
        build(cls.again, cls.gpumem, cls.shim, ARGS.arch)
        cls.files = members(cls.out.read_bytes())
        cls.sbom = json.loads((d / "a" / "gpumem.spdx.json").read_text())

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def blob(self, desc):
        name = "blobs/sha256/" + desc["digest"].removeprefix("sha256:")
        self.assertIn(name, self.files, f"{desc['digest']} is not in the archive")
        data = self.files[name][1]
        self.assertEqual(sha(data), desc["digest"], name)
        self.assertEqual(len(data), desc["size"], name)
        return data

    def chain(self):
        index = json.loads(self.files["index.json"][1])
        self.assertEqual(index["schemaVersion"], 2)
        self.assertEqual(len(index["manifests"]), 1)
        mdesc = index["manifests"][0]
        self.assertEqual(mdesc["mediaType"], "application/vnd.oci.image.manifest.v1+json")
        self.assertEqual(mdesc["platform"], {"architecture": ARGS.arch, "os": "linux"})
        manifest = json.loads(self.blob(mdesc))
        config = json.loads(self.blob(manifest["config"]))
        layer_gz = self.blob(manifest["layers"][0])
        return index, mdesc, manifest, config, layer_gz

    def layer(self):
        return members(gzip.decompress(self.chain()[4]))

    def test_oci_layout_index_manifest_config_layer(self):
        self.assertEqual(json.loads(self.files["oci-layout"][1]), {"imageLayoutVersion": "1.0.0"})
        index, mdesc, manifest, config, layer_gz = self.chain()
        self.assertEqual(len(manifest["layers"]), 1)
        self.assertEqual(manifest["layers"][0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip")
        # The config's diff_id is the uncompressed layer's digest.
        self.assertEqual(config["rootfs"], {"type": "layers", "diff_ids": [sha(gzip.decompress(layer_gz))]})
        self.assertEqual((config["architecture"], config["os"]), (ARGS.arch, "linux"))
        # The digest printed is the manifest's, the one a registry reports.
        self.assertIn(mdesc["digest"], self.stdout)
        self.assertIn(mdesc["annotations"]["io.containerd.image.name"], self.stdout)

    def test_docker_manifest_names_the_same_blobs(self):
        index, mdesc, manifest, config, layer_gz = self.chain()
        docker = json.loads(self.files["manifest.json"][1])
        self.assertEqual(len(docker), 1)
        self.assertEqual(self.files[docker[0]["Config"]][1], self.blob(manifest["config"]))
        self.assertEqual([self.files[p][1] for p in docker[0]["Layers"]], [layer_gz])
        self.assertEqual(docker[0]["RepoTags"], [mdesc["annotations"]["io.containerd.image.name"]])

    def test_layer_has_the_inputs_libraries_and_interpreter(self):
        layer = self.layer()
        self.assertEqual(layer["opt/gpumem/gpumem"][1], self.gpumem.read_bytes())
        self.assertEqual(layer["opt/gpumem/libgpumem_shim.so"][1], self.shim.read_bytes())
        self.assertTrue(layer["opt/gpumem/gpumem"][0].mode & 0o111)
        elf = subprocess.run(["readelf", "-W", "-l", "-d", str(self.gpumem)], capture_output=True, text=True, check=True).stdout
        interp = re.search(r"interpreter: ([^\]]+)\]", elf).group(1)
        self.assertEqual(self.resolve(layer, interp).isfile(), True, interp)
        triple = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[ARGS.arch]
        for lib in re.findall(r"Shared library: \[([^\]]+)\]", elf):
            self.assertTrue(self.resolve(layer, f"/lib/{triple}/{lib}").isfile(), lib)
        # Sorted entries, one mtime, root's: nothing of the build machine's.
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(self.chain()[4]))) as tar:
            names = tar.getnames()
            self.assertEqual(names, sorted(names))
            self.assertEqual({(m.mtime, m.uid, m.gid) for m in tar.getmembers()}, {(0, 0, 0)})

    def resolve(self, layer, path):
        """The member path reaches, following the layer's symlinks."""
        parts = path.strip("/").split("/")
        cur = []
        for _ in range(40):
            for i in range(len(parts)):
                name = "/".join(cur + parts[: i + 1])
                m = layer.get(name, (None,))[0]
                self.assertIsNotNone(m, f"{path}: {name} is not in the layer")
                if m.issym():
                    base = cur + parts[:i]
                    target = m.linkname
                    joined = os.path.normpath("/" + ("/".join(base) + "/" if base else "") + target) if not target.startswith("/") else target
                    parts = joined.strip("/").split("/") + parts[i + 1:]
                    cur = []
                    break
            else:
                return layer["/".join(parts)][0]
        self.fail(f"{path}: symlink loop")

    def test_config_runs_what_the_dockerfile_runs(self):
        config = self.chain()[3]["config"]
        text = (ROOT / "Dockerfile").read_text().split("\nFROM ")[-1]
        entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
        cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
        path = re.search(r"^ENV PATH=(\S+)$", text, re.M).group(1)
        self.assertEqual(config["Entrypoint"], entry)
        self.assertEqual(config["Cmd"], cmd)
        self.assertEqual(config["Env"], [f"PATH={path}"])
        copied = re.search(r"^COPY --from=build (.+) (\S+)$", text, re.M)
        layer = self.layer()
        for src in copied.group(1).split():
            self.assertIn(copied.group(2).strip("/") + "/" + os.path.basename(src), layer)

    def test_sbom_lists_files_packages_and_crates(self):
        layer = self.layer()
        self.assertEqual(self.sbom["spdxVersion"], "SPDX-2.3")
        self.assertEqual(json.loads(layer["opt/gpumem/sbom.spdx.json"][1]), self.sbom)
        listed = {f["fileName"]: {c["algorithm"]: c["checksumValue"] for c in f["checksums"]} for f in self.sbom["files"]}
        for name, (m, data) in layer.items():
            if m.isfile() and name != "opt/gpumem/sbom.spdx.json":
                self.assertEqual(listed.get("./" + name, {}).get("SHA256"), hashlib.sha256(data).hexdigest(), name)
        pkgs = {(p["name"], p["versionInfo"]) for p in self.sbom["packages"]}
        version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", f"libc6:{ARGS.arch}"],
                                 capture_output=True, text=True, check=True).stdout
        self.assertIn(("libc6", version), pkgs)
        lock = tomllib.loads((ROOT / "Cargo.lock").read_text())["package"]
        tokio = next(p["version"] for p in lock if p["name"] == "tokio")
        self.assertIn(("tokio", tokio), pkgs)
        self.assertIn(("gpumem-shim", next(p["version"] for p in lock if p["name"] == "gpumem-shim")), pkgs)

    def test_gpumem_runs_on_the_image_libraries(self):
        """`gpumem --version` in the image's root: chroot on this machine's
        architecture, qemu-user with the image as the sysroot on another."""
        if not ARGS.expect_version:
            self.skipTest("no --expect-version: the inputs are not gpumem")
        with tempfile.TemporaryDirectory() as root:
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(self.chain()[4]))) as tar:
                tar.extractall(root, filter="tar")
            gpumem = f"{root}/opt/gpumem/gpumem"
            host = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
            if host == ARGS.arch:
                # Nothing of this machine's: the image's root is the root
                # (a user namespace's, where this is not root).
                argv = ["unshare", "--map-root-user", "chroot", root, "/opt/gpumem/gpumem"]
            else:
                # qemu-user looks in the image first, then this machine's
                # (the arm64 libraries installed to build the image).
                argv = [{"arm64": "qemu-aarch64", "amd64": "qemu-x86_64"}[ARGS.arch], "-L", root, gpumem]
            done = subprocess.run(argv + ["--version"], capture_output=True, text=True)
            self.assertEqual(done.returncode, 0, f"{argv}: {done.stderr}")
            self.assertTrue(done.stdout.startswith(f"gpumem {ARGS.expect_version} "), done.stdout)

    def test_docker_archive_as_skopeo_reads_it(self):
        """Docker's manifest.json, read as `docker load` of Docker before 25
        reads it (skopeo's docker-archive: transport, the same format): the
        image its RepoTags name has our config, and layers whose content is
        the config's diff_ids."""
        index, mdesc, manifest, config, layer_gz = self.chain()
        name = mdesc["annotations"]["io.containerd.image.name"]
        ref = f"docker-archive:{self.out}:{name}"
        self.assertEqual(skopeo("inspect", "--config", "--raw", ref).encode(), self.blob(manifest["config"]))
        with tempfile.TemporaryDirectory() as d:
            skopeo("copy", ref, f"dir:{d}")
            copied = json.loads(Path(d, "manifest.json").read_text())
            self.assertEqual(copied["config"]["digest"], manifest["config"]["digest"])
            layers = [Path(d, l["digest"].removeprefix("sha256:")).read_bytes() for l in copied["layers"]]
        layers = [gzip.decompress(l) if l[:2] == b"\x1f\x8b" else l for l in layers]
        self.assertEqual([sha(l) for l in layers], config["rootfs"]["diff_ids"])
        # The tag is what manifest.json says, not any: another is not there.
        other = subprocess.run(["skopeo", "inspect", "--raw", f"docker-archive:{self.out}:{name}-not"],
                               capture_output=True, text=True)
        self.assertNotEqual(other.returncode, 0, other.stdout)

    def test_oci_archive_copies_with_the_digest_printed(self):
        """`skopeo copy oci-archive:`, as a push to a registry reads it: the
        manifest it writes is the one whose digest the build printed."""
        index, mdesc, manifest, config, layer_gz = self.chain()
        with tempfile.TemporaryDirectory() as d:
            skopeo("copy", "--preserve-digests", f"oci-archive:{self.out}", f"dir:{d}")
            written = Path(d, "manifest.json").read_bytes()
            self.assertEqual(sha(written), mdesc["digest"])
            self.assertIn(mdesc["digest"], self.stdout)
            for desc in [manifest["config"]] + manifest["layers"]:
                self.assertEqual(Path(d, desc["digest"].removeprefix("sha256:")).read_bytes(), self.blob(desc))

    def test_same_inputs_same_bytes(self):
        self.assertEqual(self.out.read_bytes(), self.again.read_bytes())

    def test_other_inputs_other_digest(self):
        changed = Path(self.tmp.name) / "shim-changed"
        changed.write_bytes(self.shim.read_bytes() + b"\0")
        out = Path(self.tmp.name) / "c" / "gpumem.oci.tar"
        build(out, self.gpumem, changed, ARGS.arch)
        digest = json.loads(members(out.read_bytes())["index.json"][1])["manifests"][0]["digest"]
        self.assertNotEqual(digest, self.chain()[1]["digest"])


class Index(unittest.TestCase):
    """The multi-architecture archive (--index): one image, named as its
    parts name theirs, whose image index names each part's manifest with
    its platform; every blob of the parts; and what skopeo copies from it
    (`skopeo copy --all`, as a push of every architecture) and picks for
    each architecture."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.out = Path(cls.tmp.name) / "gpumem.oci.tar"
        cls.stdout = index(cls.out, ARGS.parts)
        cls.files = members(cls.out.read_bytes())
        cls.parts = [members(Path(p).read_bytes()) for p in ARGS.parts]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def nested(self):
        top = json.loads(self.files["index.json"][1])
        self.assertEqual(len(top["manifests"]), 1)
        desc = top["manifests"][0]
        self.assertEqual(desc["mediaType"], "application/vnd.oci.image.index.v1+json")
        data = self.files["blobs/sha256/" + desc["digest"].removeprefix("sha256:")][1]
        self.assertEqual((sha(data), len(data)), (desc["digest"], desc["size"]))
        return desc, json.loads(data)

    def test_one_image_naming_each_parts_manifest(self):
        desc, nested = self.nested()
        wanted = []
        for part in self.parts:
            (mdesc,) = json.loads(part["index.json"][1])["manifests"]
            self.assertEqual(desc["annotations"]["io.containerd.image.name"],
                             mdesc["annotations"]["io.containerd.image.name"])
            wanted.append({k: mdesc[k] for k in ("mediaType", "digest", "size", "platform")})
        self.assertEqual(nested["manifests"], sorted(wanted, key=lambda m: m["platform"]["architecture"]))
        self.assertEqual({m["platform"]["architecture"] for m in nested["manifests"]}, {"amd64", "arm64"})
        self.assertIn(desc["digest"], self.stdout)
        # Every blob of the parts, as they are.
        for part in self.parts:
            for name, (m, data) in part.items():
                if name.startswith("blobs/sha256/"):
                    self.assertEqual(self.files[name][1], data, name)
        for name, (m, data) in self.files.items():
            if name.startswith("blobs/sha256/") and m.isfile():
                self.assertEqual(sha(data), "sha256:" + name.rsplit("/", 1)[1], name)

    def test_skopeo_copies_every_architecture_and_picks_each(self):
        desc, nested = self.nested()
        with tempfile.TemporaryDirectory() as d:
            skopeo("copy", "--all", "--preserve-digests", f"oci-archive:{self.out}", f"oci:{d}:copied")
            copied = json.loads(Path(d, "index.json").read_text())
            self.assertEqual([m["digest"] for m in copied["manifests"]], [desc["digest"]])
            for m in nested["manifests"]:
                self.assertTrue(Path(d, "blobs/sha256", m["digest"].removeprefix("sha256:")).is_file(), m)
        # A node of each architecture gets its own image's config.
        for m in nested["manifests"]:
            arch = m["platform"]["architecture"]
            manifest = json.loads(self.files["blobs/sha256/" + m["digest"].removeprefix("sha256:")][1])
            config = self.files["blobs/sha256/" + manifest["config"]["digest"].removeprefix("sha256:")][1]
            seen = skopeo("inspect", "--config", "--raw", "--override-arch", arch, f"oci-archive:{self.out}")
            self.assertEqual(seen.encode(), config, arch)
            self.assertEqual(json.loads(config)["architecture"], arch)

    def test_containerd_imports_every_platform(self):
        """`ctr images import --all-platforms`, into a containerd of the
        test's own (root, containerd and ctr needed: .ci/run runs this
        after installing the end-to-end suite's containerd)."""
        tools = [shutil.which(t) for t in ("containerd", "ctr")]
        if os.geteuid() != 0 or None in tools:
            self.skipTest("needs root, containerd and ctr (apt-get install containerd)")
        desc, nested = self.nested()
        with tempfile.TemporaryDirectory() as d:
            sock = f"{d}/containerd.sock"
            Path(d, "config.toml").write_text(
                f'version = 2\nroot = "{d}/root"\nstate = "{d}/state"\n'
                f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "{sock}"\n')
            with open(Path(d, "containerd.log"), "wb") as log:
                daemon = subprocess.Popen([tools[0], "--config", f"{d}/config.toml"], stdout=log, stderr=log)
            try:
                ctr = [tools[1], "--address", sock, "--namespace", "gpumem-test"]
                for _ in range(100):
                    if subprocess.run(ctr + ["version"], capture_output=True).returncode == 0:
                        break
                    time.sleep(0.1)
                done = subprocess.run(ctr + ["images", "import", "--all-platforms", "--snapshotter", "native",
                                             str(self.out)], capture_output=True, text=True)
                self.assertEqual(done.returncode, 0, done.stdout + done.stderr + Path(d, "containerd.log").read_text())
                listed = subprocess.run(ctr + ["images", "ls"], capture_output=True, text=True, check=True).stdout
            finally:
                daemon.terminate()
                daemon.wait(timeout=30)
        name = desc["annotations"]["io.containerd.image.name"]
        row = next((l.split() for l in listed.splitlines() if l.startswith(name + " ")), None)
        self.assertIsNotNone(row, listed)
        self.assertIn(desc["digest"], row, listed)
        self.assertIn("linux/amd64,linux/arm64", row, listed)

    def test_same_parts_same_bytes(self):
        again = Path(self.tmp.name) / "again.oci.tar"
        index(again, ARGS.parts)
        self.assertEqual(again.read_bytes(), self.out.read_bytes())

    def test_parts_of_one_architecture_are_refused(self):
        done = subprocess.run([sys.executable, str(BUILDER), "--index", ARGS.parts[0], ARGS.parts[0],
                               "--out", str(Path(self.tmp.name) / "twice.oci.tar")],
                              capture_output=True, text=True)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("a second image for linux/", done.stderr)


def index(out, parts):
    done = subprocess.run([sys.executable, str(BUILDER), "--index", *parts, "--out", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"build-image.py --index failed: {done.stderr}")
    return done.stdout


def skopeo(*argv):
    """skopeo's output; skopeo reads the archive as `skopeo copy` and
    registries do, and the tests fail without it, saying how to get it."""
    try:
        done = subprocess.run(["skopeo", *argv], capture_output=True, text=True)
    except FileNotFoundError:
        raise AssertionError("skopeo is not installed: the archive is checked as skopeo reads it "
                             "(Debian and Ubuntu: apt-get install skopeo)")
    if done.returncode != 0:
        raise AssertionError(f"skopeo {' '.join(argv)}: exit {done.returncode}: {done.stderr}")
    return done.stdout


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--gpumem", default="/bin/true")
    p.add_argument("--shim", default="/bin/true")
    p.add_argument("--arch", default="amd64")
    p.add_argument("--expect-version", help="run the image's gpumem --version and expect this version")
    p.add_argument("--index", nargs="+", dest="parts", metavar="ARCHIVE",
                   help="instead: test --index's archive of these per-architecture archives")
    ARGS, rest = p.parse_known_args()
    tests = "Index" if ARGS.parts else "Archive"
    unittest.main(argv=[sys.argv[0]] + rest, defaultTest=tests, verbosity=2)


if __name__ == "__main__":
    main()
