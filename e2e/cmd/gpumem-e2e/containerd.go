// The real runtime: Debian's containerd 1.6 and runc, or containerd 2.x
// built from its module (e2e/containerd-v2) with CDI enabled over the same
// runc, in the mount namespace kubelet then joins (kubelet hands containerd
// paths under /var/lib/kubelet and /var/log/pods, and containerd keeps its
// shims' sockets and runc's state under /run/containerd: all three bound
// into the run's directory there), with one image built here and imported,
// since no registry is reachable.
package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// probeImage runs the probe in the pods and, with the probe's "hold" step,
// as the sandbox's pause process.
const probeImage = "gpumem.test/e2e/probe:1"

func (c *cluster) containerdSocket() string { return c.path("containerd.sock") }

// containerdTool is a containerd binary: containerd 2.x's own when the
// cluster runs it, else Debian's on PATH.
func (c *cluster) containerdTool(name string) string {
	if c.cfg.containerd2 != "" {
		return filepath.Join(c.cfg.containerd2, name)
	}
	return name
}

// startContainerd starts containerd in a mount namespace of its own that
// kubelet later enters (runKubelet). The namespace is a slave of the
// runner's: gpumem's tmpfs per container's state directory, mounted on the
// runner's side, must reach runc there.
func (c *cluster) startContainerd() error {
	tools, hint := []string{"containerd", "ctr", "runc", "nsenter"}, "apt-get install containerd runc"
	if c.cfg.containerd2 != "" {
		tools, hint = []string{c.containerdTool("containerd"), c.containerdTool("ctr"), c.containerdTool("containerd-shim-runc-v2"), "runc", "nsenter"}, "e2e/build.sh builds containerd 2.x; apt-get install runc"
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s: %w (%s)", tool, err, hint)
		}
	}
	root, state, cni := c.path("containerd", "root"), c.path("containerd", "run"), c.path("containerd", "cni")
	for _, d := range []string{root, state, cni, "/run/containerd", c.cdiDir()} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := c.shareStateDir(); err != nil {
		return err
	}
	// The runtime reports its network ready once a CNI network is
	// configured; hostNetwork pods never run the plugin, so none is
	// installed.
	lo := `{"cniVersion": "0.4.0", "name": "e2e-lo", "plugins": [{"type": "loopback"}]}`
	if err := os.WriteFile(filepath.Join(cni, "10-e2e-lo.conflist"), []byte(lo), 0o644); err != nil {
		return err
	}
	c.snapshotter = "overlayfs"
	if err := overlayWorks(c.path("containerd", "overlay-check")); err != nil {
		fmt.Printf("overlay mount refused (%v): containerd uses the native snapshotter\n", err)
		c.snapshotter = "native"
	}
	cfg := c.containerdConfig(root, cni)
	cfgFile := c.path("containerd", "config.toml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		return err
	}
	script := `set -e
mount --bind "$1" /var/lib/kubelet
mount --bind "$2" /var/log
mount --bind "$3" /run/containerd
shift 3
exec "$@"`
	// containerd looks for its shim on PATH before beside itself: 2.x's
	// first, not Debian's 1.6 one.
	var env []string
	if c.cfg.containerd2 != "" {
		env = []string{"PATH=" + c.cfg.containerd2 + ":" + os.Getenv("PATH")}
	}
	var err error
	c.containerd, err = start(c.logs, "containerd", "", env,
		"unshare", "-m", "--propagation", "slave", "sh", "-c", script, "runtime-ns",
		c.kubeletRoot, c.kubeletLogDir, state, c.containerdTool("containerd"), "--config", cfgFile)
	if err != nil {
		return err
	}
	if err := waitFor(60*time.Second, "containerd serving", func() (bool, error) {
		if c.containerd.exited() {
			return false, fatal{fmt.Errorf("exited: %v", c.containerd.err)}
		}
		out, err := c.ctr("version")
		if err != nil {
			return false, fmt.Errorf("%v: %s", err, out)
		}
		return true, nil
	}); err != nil {
		return err
	}
	tarball := c.path("containerd", "probe-image.tar")
	if err := buildProbeImage(tarball, probeImage, c.cfg.probe, c.cfg.fakeDriver, c.cfg.shim); err != nil {
		return fmt.Errorf("probe image: %w", err)
	}
	if out, err := c.ctr("images", "import", "--snapshotter", c.snapshotter, tarball); err != nil {
		return fmt.Errorf("ctr images import: %v: %s", err, out)
	}
	return nil
}

func (c *cluster) ctr(args ...string) (string, error) {
	return runCmd(append([]string{c.containerdTool("ctr"), "--address", c.containerdSocket(), "--namespace", "k8s.io"}, args...)...)
}

// ctrStdout is ctr's standard output alone, for output that is parsed:
// ctr 2.x writes more than the spec, on its standard error.
func (c *cluster) ctrStdout(args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(c.containerdTool("ctr"), append([]string{"--address", c.containerdSocket(), "--namespace", "k8s.io"}, args...)...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s %v: %w: %s", cmd.Path, args, err, stderr.String())
	}
	return stdout.String(), nil
}

// containerdConfig is containerd's configuration: 1.6's version 2 or, for
// containerd 2.x, version 3 (the CRI plugin split into images and runtime)
// with CDI on, reading the specs gpumem writes (cdiDir).
func (c *cluster) containerdConfig(root, cni string) string {
	// restrict_oom_score_adj: these machines withhold CAP_SYS_RESOURCE, and
	// runc cannot lower a container's oom_score_adj below containerd's.
	if c.cfg.containerd2 == "" {
		return fmt.Sprintf(`version = 2
root = %q
state = "/run/containerd"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = %q

[ttrpc]
  address = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = %q
  [plugins."io.containerd.grpc.v1.cri".cni]
    conf_dir = %q
    bin_dir = %q
`, root, c.containerdSocket(), c.containerdSocket()+".ttrpc", probeImage, c.snapshotter, cni, c.path("containerd", "cni-bin"))
	}
	// NRI off: it would serve a socket under the host's /var/run/nri.
	return fmt.Sprintf(`version = 3
root = %q
state = "/run/containerd"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = %q

[ttrpc]
  address = %q

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.cri.v1.images"]
  snapshotter = %q
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %q

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_cdi = true
  cdi_spec_dirs = [%q]
  [plugins."io.containerd.cri.v1.runtime".cni]
    conf_dir = %q
    bin_dirs = [%q]
`, root, c.containerdSocket(), c.containerdSocket()+".ttrpc", c.snapshotter, probeImage, c.cdiDir(), cni, c.path("containerd", "cni-bin"))
}

// shareStateDir binds gpumem's state directory onto itself as a shared
// mount, once: the manifest's state volume is mountPropagation:
// Bidirectional, so gpumem's tmpfs per container (--bound-state-dirs)
// reaches the runtime from there.
func (c *cluster) shareStateDir() error {
	if c.stateShared {
		return nil
	}
	if err := os.MkdirAll(c.stateDir, 0o755); err != nil {
		return err
	}
	if err := syscall.Mount(c.stateDir, c.stateDir, "", syscall.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", c.stateDir, err)
	}
	if err := syscall.Mount("", c.stateDir, "", syscall.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make %s shared: %w", c.stateDir, err)
	}
	c.stateShared = true
	return nil
}

// overlayWorks mounts and unmounts an overlay in dir: containerd's
// overlayfs snapshotter needs it, and some file systems (or kernels) refuse.
func overlayWorks(dir string) error {
	var dirs []string
	for _, d := range []string{"lower", "upper", "work", "merged"} {
		p := filepath.Join(dir, d)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return err
		}
		dirs = append(dirs, p)
	}
	defer os.RemoveAll(dir)
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", dirs[0], dirs[1], dirs[2])
	if err := syscall.Mount("overlay", dirs[3], "overlay", 0, opts); err != nil {
		return err
	}
	return syscall.Unmount(dirs[3], 0)
}

// stopContainerd stops containerd and then the shims it started, which
// outlive it by design (a runtime upgrade keeps containers running): by
// process id, those whose -address is this run's socket.
func (c *cluster) stopContainerd() {
	if c.containerd == nil {
		return
	}
	// Tasks kubelet left (sandboxes of pods it had no time to stop): each
	// task's shim exits once the task is deleted.
	if out, err := c.ctr("tasks", "ls", "-q"); err == nil {
		for _, id := range strings.Fields(out) {
			_, _ = c.ctr("tasks", "kill", "--all", "--signal", "SIGKILL", id)
			_, _ = c.ctr("tasks", "delete", "--force", id)
		}
	}
	c.containerd.stop(10 * time.Second)
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range procs {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		argv := strings.Split(string(data), "\x00")
		if !strings.HasPrefix(filepath.Base(argv[0]), "containerd-shim") {
			continue
		}
		for i, a := range argv {
			if a == "-address" && i+1 < len(argv) && argv[i+1] == c.containerdSocket() {
				if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(f))); err == nil {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
	}
}

// execSync runs argv in a running container through containerd's CRI
// socket, as kubelet does.
func (c *cluster) execSync(id string, argv []string) (stdout, stderr string, exit int32, err error) {
	conn, err := grpc.NewClient("unix://"+c.containerdSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return "", "", 0, err
	}
	defer conn.Close()
	callCtx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	resp, err := runtimeapi.NewRuntimeServiceClient(conn).ExecSync(callCtx, &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: argv, Timeout: 30})
	if err != nil {
		return "", "", 0, err
	}
	return string(resp.Stdout), string(resp.Stderr), resp.ExitCode, nil
}
