// The release image as CI ships it (.ci/build-image.py's OCI archive):
// containerd imports the archive itself, and pods run gpumem from it as
// the DaemonSet does: its init container's install-shim and `gpumem
// --version` by the image's PATH.
package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// releaseArchive is what the suite reads from the archive, following
// index.json to the manifest and its layer, each blob checked against its
// digest and size on the way.
type releaseArchive struct {
	name    string // containerd's name for it (io.containerd.image.name)
	version string // org.opencontainers.image.ref.name
	shim    []byte // /opt/gpumem/libgpumem_shim.so
}

type ociDescriptor struct {
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations"`
}

func readReleaseArchive(path string) (*releaseArchive, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	files := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if hdr.Typeflag == tar.TypeReg {
			if files[hdr.Name], err = io.ReadAll(tr); err != nil {
				return nil, fmt.Errorf("%s: %s: %w", path, hdr.Name, err)
			}
		}
	}
	blob := func(d ociDescriptor) ([]byte, error) {
		data, ok := files["blobs/sha256/"+strings.TrimPrefix(d.Digest, "sha256:")]
		if !ok {
			return nil, fmt.Errorf("%s: no blob %s", path, d.Digest)
		}
		sum := sha256.Sum256(data)
		if got := "sha256:" + hex.EncodeToString(sum[:]); got != d.Digest || int64(len(data)) != d.Size {
			return nil, fmt.Errorf("%s: blob %s is %s, %d bytes (descriptor: %d)", path, d.Digest, got, len(data), d.Size)
		}
		return data, nil
	}
	var index struct {
		Manifests []ociDescriptor `json:"manifests"`
	}
	if err := json.Unmarshal(files["index.json"], &index); err != nil || len(index.Manifests) != 1 {
		return nil, fmt.Errorf("%s: index.json with one manifest: %v (%d)", path, err, len(index.Manifests))
	}
	data, err := blob(index.Manifests[0])
	if err != nil {
		return nil, err
	}
	var manifest struct {
		Layers []ociDescriptor `json:"layers"`
	}
	if err := json.Unmarshal(data, &manifest); err != nil || len(manifest.Layers) != 1 {
		return nil, fmt.Errorf("%s: manifest with one layer: %v", path, err)
	}
	if data, err = blob(manifest.Layers[0]); err != nil {
		return nil, err
	}
	zr, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("%s: layer: %w", path, err)
	}
	a := &releaseArchive{
		name:    index.Manifests[0].Annotations["io.containerd.image.name"],
		version: index.Manifests[0].Annotations["org.opencontainers.image.ref.name"],
	}
	lr := tar.NewReader(zr)
	for {
		hdr, err := lr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%s: layer: %w", path, err)
		}
		if hdr.Name == "opt/gpumem/libgpumem_shim.so" {
			if a.shim, err = io.ReadAll(lr); err != nil {
				return nil, err
			}
		}
	}
	if a.name == "" || a.version == "" || a.shim == nil {
		return nil, fmt.Errorf("%s: no image name, version or /opt/gpumem/libgpumem_shim.so", path)
	}
	return a, nil
}

// releaseScenarios join the containerd phase's when there is an archive
// (--image).
var releaseScenarios = []scenario{
	{"release image: containerd imports the archive; install-shim and gpumem --version run from it", (*suite).releaseImage},
}

// releaseImage imports the archive into the node's containerd, then runs
// the manifest's init container (install-shim into a host directory) and
// `gpumem --version` in pods of it.
func (s *suite) releaseImage() (string, error) {
	a, err := readReleaseArchive(s.c.cfg.image)
	if err != nil {
		return "", err
	}
	if out, err := s.c.ctr("images", "import", "--snapshotter", s.c.snapshotter, s.c.cfg.image); err != nil {
		return "", fmt.Errorf("ctr images import %s: %v: %s", s.c.cfg.image, err, out)
	}
	if len(s.c.initContainers) != 1 {
		return "", fmt.Errorf("%s: want one init container (install-shim), have %d", s.c.cfg.manifest, len(s.c.initContainers))
	}
	init := s.c.initContainers[0]
	pod := func(name string, c corev1.Container) *corev1.Pod {
		c.Name, c.Image, c.ImagePullPolicy = "main", a.name, corev1.PullNever
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
			Spec: corev1.PodSpec{
				NodeName: nodeName, HostNetwork: true, RestartPolicy: corev1.RestartPolicyNever,
				TerminationGracePeriodSeconds: ptr.To[int64](1),
				Containers:                    []corev1.Container{c},
			},
		}
		// Each of the init container's mounts from a host directory of the
		// run's, as the DaemonSet's hostPath volumes would be.
		for _, m := range c.VolumeMounts {
			p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: m.Name, VolumeSource: corev1.VolumeSource{
				HostPath: &corev1.HostPathVolumeSource{Path: s.c.path("release-image", m.Name), Type: ptr.To(corev1.HostPathDirectoryOrCreate)},
			}})
		}
		return p
	}
	log, err := s.runToCompletion(pod("release-install-shim", corev1.Container{Command: init.Command, Args: init.Args, VolumeMounts: init.VolumeMounts}))
	if err != nil {
		return "", fmt.Errorf("install-shim from %s: %w", a.name, err)
	}
	var installed string
	for _, m := range init.VolumeMounts {
		p := filepath.Join(s.c.path("release-image", m.Name), "libgpumem_shim.so")
		if data, err := os.ReadFile(p); err == nil {
			if !bytes.Equal(data, a.shim) {
				return "", fmt.Errorf("install-shim wrote %s (%d bytes), not the image's shim (%d bytes)", p, len(data), len(a.shim))
			}
			installed = p
		}
	}
	if installed == "" {
		return "", fmt.Errorf("install-shim from %s left no libgpumem_shim.so in its mounts; log: %q", a.name, log)
	}
	version, err := s.runToCompletion(pod("release-version", corev1.Container{Command: []string{"gpumem", "--version"}}))
	if err != nil {
		return "", fmt.Errorf("gpumem --version in %s: %w", a.name, err)
	}
	if !strings.HasPrefix(version, "gpumem "+a.version+" ") {
		return "", fmt.Errorf("gpumem --version in %s printed %q, want gpumem %s (…)", a.name, version, a.version)
	}
	return fmt.Sprintf("imported %s; install-shim wrote the image's shim (%d bytes) to the host; %q", a.name, len(a.shim), version), nil
}

// runToCompletion runs pod p to Succeeded and returns its log, deleting it.
func (s *suite) runToCompletion(p *corev1.Pod) (string, error) {
	if err := s.createPod(p); err != nil {
		return "", err
	}
	var pod *corev1.Pod
	err := waitFor(60*time.Second, fmt.Sprintf("pod %s Succeeded", p.Name), func() (bool, error) {
		var err error
		pod, err = s.c.admin.CoreV1().Pods(namespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if pod.Status.Phase == corev1.PodFailed {
			return false, fatal{fmt.Errorf("Failed: %s %s %s", pod.Status.Reason, pod.Status.Message, containerState(pod))}
		}
		return pod.Status.Phase == corev1.PodSucceeded, fmt.Errorf("phase %q %s", pod.Status.Phase, containerState(pod))
	})
	var log string
	if pod != nil {
		log, _ = s.containerLog(pod, "main")
	}
	if err != nil {
		return "", fmt.Errorf("%w; log: %q", err, log)
	}
	return log, s.deletePod(p.Name)
}
