#!/usr/bin/env python3
"""Tests .ci/build-image.py's archive as the tools that load it read it:
oci-layout and index.json → manifest → config and layer, each blob's digest
and size as its descriptor says; docker's manifest.json naming the same
blobs; the layer holding the inputs, every library the binary loads and
its interpreter; the config running what the Dockerfile runs; the SBOM
listing each file with its hash, the Debian packages with dpkg's versions
and the crates with Cargo.lock's; and the same inputs giving the same bytes.

  python3 .ci/test_build_image.py [--gpumem FILE --shim FILE --arch ARCH --expect-version V]

Without files it builds from this machine's /bin/true (any ELF of the
architecture will do: the checks are about the archive, not gpumem).
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
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

    def test_same_inputs_same_bytes(self):
        self.assertEqual(self.out.read_bytes(), self.again.read_bytes())

    def test_other_inputs_other_digest(self):
        changed = Path(self.tmp.name) / "shim-changed"
        changed.write_bytes(self.shim.read_bytes() + b"\0")
        out = Path(self.tmp.name) / "c" / "gpumem.oci.tar"
        build(out, self.gpumem, changed, ARGS.arch)
        digest = json.loads(members(out.read_bytes())["index.json"][1])["manifests"][0]["digest"]
        self.assertNotEqual(digest, self.chain()[1]["digest"])


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--gpumem", default="/bin/true")
    p.add_argument("--shim", default="/bin/true")
    p.add_argument("--arch", default="amd64")
    p.add_argument("--expect-version", help="run the image's gpumem --version and expect this version")
    ARGS, rest = p.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
