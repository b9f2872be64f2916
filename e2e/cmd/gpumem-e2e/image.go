// The image the real containers run, built here as a docker-archive
// tarball for `ctr images import` (no registry is reachable): the probe, the
// fake driver where the NVIDIA toolkit would mount libcuda.so.1 and
// libnvidia-ml.so.1, and the host's shared libraries that they and the shim
// (mounted in by Allocate, loaded through /etc/ld.so.preload) link.
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"regexp"
	"sort"
	"strings"
	"time"
)

const (
	imageProbe   = "/usr/local/bin/gpumem-probe"
	imageLibDir  = "/usr/lib/x86_64-linux-gnu"
	imageModTime = 1
)

// buildProbeImage writes a one-layer docker-archive of probe, the fake
// driver under both of the driver's names, and what ldd says the three
// ELF files (shim included) load.
func buildProbeImage(out, name, probe, fakeDriver, shim string) error {
	files := map[string]string{ // image path → host file
		imageProbe:                         probe,
		imageLibDir + "/libcuda.so.1":      fakeDriver,
		imageLibDir + "/libnvidia-ml.so.1": fakeDriver,
	}
	for _, elf := range []string{probe, fakeDriver, shim} {
		libs, err := sharedLibs(elf)
		if err != nil {
			return err
		}
		for _, l := range libs {
			files[l] = l
		}
	}
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	dirs := map[string]bool{}
	var paths []string
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	// The dynamic linker searches its multiarch directories when the
	// image has no /etc/ld.so.cache; /tmp for anything that writes there.
	for _, d := range []string{"/etc", "/tmp", "/proc", "/sys", "/dev", "/var/run"} {
		if err := tarDir(tw, dirs, d); err != nil {
			return err
		}
	}
	for _, p := range paths {
		if err := tarDir(tw, dirs, path.Dir(p)); err != nil {
			return err
		}
		data, err := os.ReadFile(files[p])
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: strings.TrimPrefix(p, "/"), Mode: 0o755, Size: int64(len(data)), ModTime: time.Unix(imageModTime, 0), Typeflag: tar.TypeReg}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if _, err := tw.Write(data); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	diffID := sha256.Sum256(layer.Bytes())
	config, err := json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		// What the sandbox runs, as a pause image would: the probe waiting
		// for its signal. Pods give their own command.
		"config": map[string]any{"Cmd": []string{imageProbe, "hold"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + hex.EncodeToString(diffID[:])}},
	})
	if err != nil {
		return err
	}
	manifest, err := json.Marshal([]map[string]any{{
		"Config":   "config.json",
		"RepoTags": []string{name},
		"Layers":   []string{"layer.tar"},
	}})
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	archive := tar.NewWriter(f)
	for _, e := range []struct {
		name string
		data []byte
	}{{"layer.tar", layer.Bytes()}, {"config.json", config}, {"manifest.json", manifest}} {
		if err := archive.WriteHeader(&tar.Header{Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: time.Unix(imageModTime, 0)}); err != nil {
			return err
		}
		if _, err := archive.Write(e.data); err != nil {
			return err
		}
	}
	if err := archive.Close(); err != nil {
		return err
	}
	return f.Close()
}

// tarDir writes dir and its parents once each.
func tarDir(tw *tar.Writer, done map[string]bool, dir string) error {
	if dir == "/" || done[dir] {
		return nil
	}
	if err := tarDir(tw, done, path.Dir(dir)); err != nil {
		return err
	}
	done[dir] = true
	return tw.WriteHeader(&tar.Header{Name: strings.TrimPrefix(dir, "/") + "/", Mode: 0o755, ModTime: time.Unix(imageModTime, 0), Typeflag: tar.TypeDir})
}

// lddPath is a library ldd resolved ("libc.so.6 => /lib/…/libc.so.6
// (0x…)") or the dynamic linker ("/lib64/ld-linux-x86-64.so.2 (0x…)").
var lddPath = regexp.MustCompile(`(?m)^\s*(?:\S+ => )?(/\S+) \(0x`)

// sharedLibs returns the absolute paths ldd lists for elf, in the image at
// the same paths as on the host.
func sharedLibs(elf string) ([]string, error) {
	out, err := runCmd("ldd", elf)
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %v: %s", elf, err, out)
	}
	if strings.Contains(out, "not found") {
		return nil, fmt.Errorf("ldd %s: %s", elf, out)
	}
	var libs []string
	for _, m := range lddPath.FindAllStringSubmatch(out, -1) {
		libs = append(libs, m[1])
	}
	return libs, nil
}
