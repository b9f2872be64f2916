// gpumem-e2e brings up a one-node cluster of upstream Kubernetes components
// on 127.0.0.1 (see cluster.go), runs gpumem as its DaemonSet runs it, and
// checks what a user would: one line per scenario, then "N passed, N
// failed", exiting non-zero on any failure.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/utils/ptr"
)

const (
	resourceName = "aliyun.com/gpu-mem"
	namespace    = "default"
)

func main() {
	repo, _ := filepath.Abs(filepath.Join(filepath.Dir(os.Args[0]), "..", "..", ".."))
	var cfg config
	var keep, noContainerd bool
	var extenderFixture string
	flag.StringVar(&cfg.bin, "bin", filepath.Dir(os.Args[0]), "directory with etcd, kube-apiserver, kube-scheduler and kubelet (e2e/build.sh)")
	flag.StringVar(&cfg.kubelet, "kubelet", "", "the kubelet binary (default: --bin's): an older release's, to check version skew")
	phaseList := flag.String("phases", "plugin,extender,dra,containerd,containerd2,autoscale", "which phases to run, comma-separated: plugin, extender, dra, containerd, containerd2, autoscale")
	flag.StringVar(&cfg.gpumem, "gpumem", filepath.Join(repo, "target/debug/gpumem"), "the gpumem binary")
	flag.StringVar(&cfg.shim, "shim", filepath.Join(repo, "target/debug/libgpumem_shim.so"), "the shim library the init container installs")
	flag.StringVar(&cfg.fixture, "fake-gpus", filepath.Join(repo, "tests/fixtures/gpus/t4.toml"), "the node's GPUs (gpumem --fake-gpus) with the default scheduler")
	flag.StringVar(&extenderFixture, "extender-fake-gpus", filepath.Join(repo, "tests/fixtures/gpus/v100x2.toml"), "the node's GPUs with gpushare's extender")
	flag.StringVar(&cfg.manifest, "manifest", filepath.Join(repo, "daemonset/gpumem.yaml"), "the DaemonSet whose RBAC, command, args and env gpumem runs with")
	flag.StringVar(&cfg.extenderManifest, "extender-manifest", filepath.Join(repo, "daemonset/extender.yaml"), "the extender's Deployment and RBAC")
	flag.StringVar(&cfg.secondScheduler, "second-scheduler-manifest", filepath.Join(repo, "daemonset/second-scheduler.yaml"), "a second kube-scheduler with the extender in its pod, chosen by schedulerName")
	flag.StringVar(&cfg.schedulerConfig, "scheduler-config", filepath.Join(repo, "daemonset/kube-scheduler-config.yaml"), "kube-scheduler's configuration with the extender")
	flag.StringVar(&cfg.probe, "probe", filepath.Join(repo, "target/debug/gpumem-probe"), "the probe the real containers run")
	flag.StringVar(&cfg.fakeDriver, "fake-driver", filepath.Join(repo, "target/debug/libgpumem_fakegpu.so"), "the fake driver the real containers load as libcuda.so.1 and libnvidia-ml.so.1")
	var containerd2 string
	flag.StringVar(&containerd2, "containerd2", "", "directory of containerd 2.x's containerd, ctr and containerd-shim-runc-v2 for the containerd2 phase (default: --bin's containerd-v2)")
	flag.StringVar(&cfg.image, "image", "", "the release image's OCI archive (.ci/build-image.py) for the containerd phase to import and run gpumem from")
	flag.BoolVar(&noContainerd, "no-containerd", false, "leave out the real containers (containerd and runc): the containerd and containerd2 phases")
	flag.BoolVar(&keep, "keep", false, "keep the run's directory (logs, configs) after the run")
	var bench benchConfig
	flag.IntVar(&bench.restarts, "bench-restarts", 0, "instead of the suite: restart kubelet this many times on the --fake-gpus node and time restart → allocatable")
	flag.StringVar(&bench.unit, "bench-unit", "GiB", "with --bench-restarts: gpumem's --memory-unit")
	flag.Int64Var(&bench.hold, "bench-hold", 0, "with --bench-restarts: units a pod holds through the restarts")
	flag.IntVar(&bench.admissions, "bench-admissions", 0, "instead of the suite: time this many pods created → container created → Running through the device plugin, then the DRA driver")
	flag.Parse()
	phaseNames := strings.Split(*phaseList, ",")
	if noContainerd {
		phaseNames = slices.DeleteFunc(phaseNames, func(n string) bool { return n == "containerd" || n == "containerd2" })
	}

	if cfg.kubelet == "" {
		cfg.kubelet = filepath.Join(cfg.bin, "kubelet")
	}
	if containerd2 == "" {
		containerd2 = filepath.Join(cfg.bin, "containerd-v2")
	}
	for _, f := range []*string{&containerd2, &cfg.bin, &cfg.kubelet, &cfg.gpumem, &cfg.shim, &cfg.fixture, &cfg.manifest, &cfg.extenderManifest, &cfg.schedulerConfig, &cfg.secondScheduler, &extenderFixture, &cfg.probe, &cfg.fakeDriver} {
		// kubelet runs in its own working directory.
		if abs, err := filepath.Abs(*f); err == nil {
			*f = abs
		}
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "gpumem-e2e: needs root (kubelet, mount namespaces)")
		os.Exit(2)
	}
	need := []string{cfg.kubelet, cfg.gpumem, cfg.shim, cfg.fixture, cfg.manifest, cfg.extenderManifest, cfg.schedulerConfig, cfg.secondScheduler, extenderFixture}
	if (slices.Contains(phaseNames, "containerd") || slices.Contains(phaseNames, "containerd2")) && bench.restarts == 0 && bench.admissions == 0 {
		need = append(need, cfg.probe, cfg.fakeDriver)
	}
	for _, f := range need {
		if _, err := os.Stat(f); err != nil {
			fmt.Fprintf(os.Stderr, "gpumem-e2e: %v\n", err)
			os.Exit(2)
		}
	}
	work, err := os.MkdirTemp("", "gpumem-e2e-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpumem-e2e: %v\n", err)
		os.Exit(2)
	}

	plugin := cfg
	plugin.extenderManifest, plugin.schedulerConfig = "", ""
	plugin.work = filepath.Join(work, "default-scheduler")
	if bench.restarts > 0 {
		plugin.memoryUnit = bench.unit
		os.Exit(runBench(plugin, bench, work, keep))
	}
	extender := cfg
	extender.fixture = extenderFixture
	extender.work = filepath.Join(work, "gpushare-extender")
	dra := cfg
	dra.extenderManifest, dra.schedulerConfig = "", ""
	dra.manifest = filepath.Join(filepath.Dir(cfg.manifest), "gpumem-dra.yaml")
	dra.work = filepath.Join(work, "dra")
	if bench.admissions > 0 {
		os.Exit(runAdmissionBench(plugin, dra, bench.admissions, work, keep))
	}
	type phase struct {
		name, title string
		cfg         config
		run         func(*suite)
	}
	real := plugin
	real.containerd = true
	real.work = filepath.Join(work, "containerd")
	// containerd 2.x with CDI: the device plugin's cdi strategy, then the
	// DRA driver, on clusters of their own (each front end owns the node's
	// state directory).
	cdi := real
	cdi.containerd2 = containerd2
	cdi.work = filepath.Join(work, "containerd2")
	cdiDRA := dra
	cdiDRA.containerd, cdiDRA.containerd2 = true, containerd2
	cdiDRA.work = filepath.Join(work, "containerd2-dra")
	// A control plane only: Karpenter launches the nodes (autoscale.go).
	autoscale := plugin
	autoscale.noNode = true
	autoscale.work = filepath.Join(work, "autoscale")
	all := []phase{
		{"plugin", "device plugin, default scheduler, " + filepath.Base(plugin.fixture), plugin, (*suite).runPlugin},
		{"extender", "gpushare extender in kube-scheduler, " + filepath.Base(extender.fixture), extender, (*suite).runExtender},
		{"dra", "DRA driver, " + filepath.Base(dra.fixture), dra, (*suite).runDRA},
		{"containerd", "real containers: containerd and runc, device plugin, " + filepath.Base(real.fixture), real, (*suite).runContainers},
		{"containerd2", "real containers: containerd 2.x with CDI and runc, device plugin, " + filepath.Base(cdi.fixture), cdi, (*suite).runCDIContainers},
		{"containerd2", "real containers: containerd 2.x with CDI and runc, DRA driver, " + filepath.Base(cdiDRA.fixture), cdiDRA, (*suite).runDRAContainers},
		{"autoscale", "Karpenter scales gpumem nodes from zero and back (its controllers, nodes of kubelet and gpumem)", autoscale, (*suite).runAutoscale},
	}
	var phases []phase
	for _, name := range phaseNames {
		n := len(phases)
		for _, p := range all {
			if p.name == name {
				phases = append(phases, p)
			}
		}
		if len(phases) == n {
			fmt.Fprintf(os.Stderr, "gpumem-e2e: --phases: no phase %q (plugin, extender, dra, containerd, containerd2, autoscale)\n", name)
			os.Exit(2)
		}
	}

	began := time.Now()
	s := &suite{}
	for _, ph := range phases {
		fmt.Printf("== %s\n", ph.title)
		phaseBegan := time.Now()
		c, err := up(ph.cfg)
		stop := stopOnSignal(c)
		if err != nil {
			s.failed++
			fmt.Printf("FAIL cluster up: %v\n", err)
		} else {
			fmt.Printf("cluster up in %.1f s (kubernetes %s, runtime: %s)\n", time.Since(phaseBegan).Seconds(), kubeletVersion(c), runtimeName(c))
			s.c, s.gateFailed = c, ""
			ph.run(s)
		}
		c.down()
		stop()
	}
	fmt.Printf("%d passed, %d failed (%.0f s)\n", s.passed, s.failed, time.Since(began).Seconds())
	code := 0
	if s.failed > 0 {
		code = 1
	}
	if keep || code != 0 {
		fmt.Printf("logs and configs kept in %s\n", work)
	} else {
		os.RemoveAll(work)
	}
	os.Exit(code)
}

// stopOnSignal stops c's components on SIGINT or SIGTERM, until the
// returned function is called.
func stopOnSignal(c *cluster) func() {
	ch := make(chan os.Signal, 1)
	done := make(chan struct{})
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		select {
		case <-ch:
			c.down()
			fmt.Printf("interrupted; logs in %s\n", c.logs)
			os.Exit(130)
		case <-done:
		}
	}()
	return func() {
		signal.Stop(ch)
		close(done)
	}
}

// runtimeName is the runtime as the node reports it, the snapshotter with
// containerd's.
func runtimeName(c *cluster) string {
	if c.runtime != nil {
		return "fake CRI"
	}
	node, err := c.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
	if err != nil {
		return "?"
	}
	v := node.Status.NodeInfo.ContainerRuntimeVersion
	if out, err := runCmd("runc", "--version"); err == nil {
		v += ", " + strings.SplitN(out, "\n", 2)[0]
	}
	return v + ", " + c.snapshotter + " snapshotter"
}

func kubeletVersion(c *cluster) string {
	node, err := c.admin.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
	if err != nil {
		return "?"
	}
	return node.Status.NodeInfo.KubeletVersion
}

type suite struct {
	c              *cluster
	passed, failed int
	units          int64           // the node's, as gpumem advertises them
	extenderGPU    string          // where the extender put "small"
	second         []*schedulerPod // the second scheduler's replicas
	draPods        []string
	gateFailed     string // set when a phase's first scenario failed
}

type scenario struct {
	name string
	run  func() (string, error)
}

// run runs the scenarios in order; when the first (registration) fails,
// the others are counted failed without running: they need it.
func (s *suite) run(scenarios []scenario) {
	for i, sc := range scenarios {
		if i > 0 && s.gateFailed != "" {
			s.failed++
			fmt.Printf("FAIL %s: not run: %s\n", sc.name, s.gateFailed)
			continue
		}
		began := time.Now()
		detail, err := sc.run()
		took := time.Since(began).Seconds()
		if err != nil {
			s.failed++
			if i == 0 {
				s.gateFailed = sc.name + " failed"
			}
			fmt.Printf("FAIL %s (%.1f s): %v\n", sc.name, took, err)
		} else {
			s.passed++
			fmt.Printf("PASS %s (%.1f s): %s\n", sc.name, took, detail)
		}
	}
}

func (s *suite) runPlugin() {
	s.run([]scenario{
		{"plugin registers with kubelet", s.registers},
		{"node allocatable", s.allocatable},
		{"4-unit pod admitted, container carries Allocate's answer", s.admitted},
		{"gpushare annotations on the pod", s.annotations},
		{"pod asking more than is free refused by kubelet", s.refused},
		{"kubelet restart: allocatable restored, holdings kept", s.kubeletRestart},
		{"plugin restart: allocatable restored, holdings kept", s.pluginRestart},
		{"pod deletion frees its units", s.deletion},
		{"kube-scheduler places a GPU pod by allocatable", s.scheduled},
		{"--device-list-strategy cdi: CDI devices and their spec", s.strategyCDI},
		{"--device-list-strategy volume-mounts: the device-list mount", s.strategyVolumeMounts},
		{"GPU unhealthy: allocatable drops, the pod's status says Unhealthy; recovered: both back", s.pluginHealth},
	})
}

func (s *suite) runDRA() {
	s.run([]scenario{
		{"DRA driver registers and publishes consumable capacity", s.draRegisters},
		{"claim from a template: allocated by the scheduler, prepared by kubelet", s.draTemplate},
		{"one claim shared by two pods", s.draShared},
		{"kubelet restart: slice republished, claims kept", s.draKubeletRestart},
		{"GPU unhealthy: pods holding claims on it say Unhealthy in their status; recovered: Healthy", s.draHealth},
		{"driver restart: claims kept, a new claim prepared", s.draDriverRestart},
		{"pod deletion unprepares the claims", s.draUnprepare},
		{"kubelet logs no plugin-watcher errors for the registration socket", s.draQuiet},
	})
}

func (s *suite) runExtender() {
	s.run([]scenario{
		{"plugin registers with kubelet", s.registers},
		{"pod larger than any one GPU stays Pending with the extender's reason", s.extenderFilters},
		{"extender binds a 4-unit pod, the plugin gives it the extender's GPU", s.extenderBinds},
		{"a second 4-unit pod joins the first (extender binpack, plugin spread)", s.extenderSameGPU},
		{"a whole-GPU pod goes to the other GPU", s.extenderOtherGPU},
		{"second scheduler (schedulerName): one of two holds the lease and binds through its extender; the default scheduler leaves the pod", s.secondScheduler},
		{"second scheduler: the holder killed, the other takes the lease and binds", s.secondSchedulerHandover},
	})
}

var ctx = context.Background()

// status is what gpumem's status socket answers (GET /status), the fields
// the suite reads.
type status struct {
	Registered bool `json:"registered"`
	Gpus       []struct {
		Index          uint32 `json:"index"`
		UUID           string `json:"uuid"`
		MemoryMiB      uint64 `json:"memory_mib"`
		Units          uint32 `json:"units"`
		AllocatedUnits uint32 `json:"allocated_units"`
	} `json:"gpus"`
	Containers []struct {
		Namespace *string `json:"namespace"`
		Pod       *string `json:"pod"`
		Container *string `json:"container"`
		Gpu       uint32  `json:"gpu"`
		Units     uint32  `json:"units"`
		CapMiB    uint64  `json:"cap_mib"`
	} `json:"containers"`
	PodResourcesError *string `json:"pod_resources_error"`
	Claims            []struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
		UID       string `json:"uid"`
		Gpu       uint32 `json:"gpu"`
		CapMiB    uint64 `json:"cap_mib"`
	} `json:"claims"`
	Dra *struct {
		Driver             string  `json:"driver"`
		Registration       string  `json:"registration"`
		Slice              *string `json:"slice"`
		ConsumableCapacity *bool   `json:"consumable_capacity"`
		SliceError         *string `json:"slice_error"`
	} `json:"dra"`
}

func (s *suite) gpumemStatus() (*status, error) {
	client := http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", s.c.statusSocket)
		}},
	}
	resp, err := client.Get("http://localhost/status")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != 200 {
		return nil, fmt.Errorf("gpumem /status: %s: %s", resp.Status, body)
	}
	var st status
	if err := json.Unmarshal(body, &st); err != nil {
		return nil, fmt.Errorf("gpumem /status: %w", err)
	}
	return &st, nil
}

// nodeResource returns the node's capacity and allocatable of name.
func (s *suite) nodeResource(name corev1.ResourceName) (capacity, allocatable int64, err error) {
	node, err := s.c.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return 0, 0, err
	}
	if q, ok := node.Status.Capacity[name]; ok {
		capacity = q.Value()
	}
	if q, ok := node.Status.Allocatable[name]; ok {
		allocatable = q.Value()
	}
	return capacity, allocatable, nil
}

func (s *suite) waitAllocatable(want int64, timeout time.Duration) (time.Duration, error) {
	return s.waitAllocatableSince(want, timeout, time.Time{})
}

// waitAllocatableSince waits for the node's allocatable to be want in a
// status that kubelet posted after since (its Ready heartbeat, which has
// whole seconds), when since is set: the node object of a kubelet that has
// just restarted still shows what the old one posted.
func (s *suite) waitAllocatableSince(want int64, timeout time.Duration, since time.Time) (time.Duration, error) {
	began := time.Now()
	var last int64 = -1
	after := since.Truncate(time.Second).Add(time.Second)
	err := waitFor(timeout, fmt.Sprintf("allocatable %s = %d", resourceName, want), func() (bool, error) {
		node, err := s.c.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		last = -1
		if q, ok := node.Status.Allocatable[resourceName]; ok {
			last = q.Value()
		}
		if !since.IsZero() {
			fresh := false
			for _, c := range node.Status.Conditions {
				if c.Type == corev1.NodeReady && !c.LastHeartbeatTime.Time.Before(after) {
					fresh = true
				}
			}
			if !fresh {
				return false, nil
			}
		}
		return last == want, nil
	})
	if err != nil {
		return 0, fmt.Errorf("%w (last seen %d)", err, last)
	}
	return time.Since(began), nil
}

func (s *suite) registers() (string, error) {
	return s.registersWithin(60 * time.Second)
}

func (s *suite) registersWithin(timeout time.Duration) (string, error) {
	var st *status
	if err := waitFor(timeout, "gpumem registered", func() (bool, error) {
		if s.c.gpumem.exited() {
			return false, fatal{fmt.Errorf("gpumem exited: %v", s.c.gpumem.err)}
		}
		var err error
		st, err = s.gpumemStatus()
		return err == nil && st.Registered, err
	}); err != nil {
		return "", err
	}
	s.units = 0
	for _, g := range st.Gpus {
		s.units += int64(g.Units)
	}
	if _, err := s.waitAllocatable(s.units, timeout); err != nil {
		return "", err
	}
	return fmt.Sprintf("gpumem /status registered=true; node lists %s", resourceName), nil
}

func (s *suite) allocatable() (string, error) {
	st, err := s.gpumemStatus()
	if err != nil {
		return "", err
	}
	if len(st.Gpus) != 1 {
		return "", fmt.Errorf("gpumem sees %d GPUs, the fixture has 1", len(st.Gpus))
	}
	g := st.Gpus[0]
	// 1 unit = 1 GiB, whole GiB only (--memory-unit=GiB).
	if want := uint32(g.MemoryMiB / 1024); g.Units != want {
		return "", fmt.Errorf("gpumem offers %d units of a %d MiB GPU, want %d", g.Units, g.MemoryMiB, want)
	}
	capacity, alloc, err := s.nodeResource(resourceName)
	if err != nil {
		return "", err
	}
	if capacity != int64(g.Units) || alloc != int64(g.Units) {
		return "", fmt.Errorf("node capacity %d, allocatable %d; want %d", capacity, alloc, g.Units)
	}
	// gpushare's GPU count, which gpumem patches into the node's status
	// (nodes/status in its ClusterRole).
	var count int64
	err = waitFor(20*time.Second, "aliyun.com/gpu-count on the node", func() (bool, error) {
		count, _, err = s.nodeResource("aliyun.com/gpu-count")
		return err == nil && count == 1, err
	})
	if err != nil {
		return "", fmt.Errorf("%w (capacity aliyun.com/gpu-count %d)", err, count)
	}
	return fmt.Sprintf("%s capacity %d, allocatable %d (%s, %d MiB); aliyun.com/gpu-count %d", resourceName, capacity, alloc, g.UUID, g.MemoryMiB, count), nil
}

func gpuPod(name string, units int64) *corev1.Pod {
	q := *resource.NewQuantity(units, resource.DecimalSI)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: corev1.PodSpec{
			NodeName:                      nodeName,
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []corev1.Container{{
				Name:  "main",
				Image: "registry.invalid/e2e/cuda-app:1",
				Resources: corev1.ResourceRequirements{
					Limits: corev1.ResourceList{resourceName: q},
				},
			}},
		},
	}
}

func (s *suite) createPod(p *corev1.Pod) error {
	_, err := s.c.admin.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{})
	return err
}

func (s *suite) waitPhase(name string, phase corev1.PodPhase, timeout time.Duration) (*corev1.Pod, error) {
	var pod *corev1.Pod
	err := waitFor(timeout, fmt.Sprintf("pod %s %s", name, phase), func() (bool, error) {
		var err error
		pod, err = s.c.admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if pod.Status.Phase == phase {
			return true, nil
		}
		return false, fmt.Errorf("phase %q reason %q message %q", pod.Status.Phase, pod.Status.Reason, pod.Status.Message)
	})
	return pod, err
}

// capFor is the cap gpumem promises for units of a GPU: floor(units ×
// memory / GPU units), from the fixture's figures as gpumem reports them.
func (s *suite) capFor(units uint64) (uint64, string, error) {
	st, err := s.gpumemStatus()
	if err != nil {
		return 0, "", err
	}
	g := st.Gpus[0]
	return units * g.MemoryMiB / uint64(g.Units), g.UUID, nil
}

// gpuUnits is the first GPU's units, as gpumem reports them.
func (s *suite) gpuUnits() string {
	st, err := s.gpumemStatus()
	if err != nil || len(st.Gpus) == 0 {
		return "?"
	}
	return fmt.Sprint(st.Gpus[0].Units)
}

func (s *suite) admitted() (string, error) {
	if err := s.createPod(gpuPod("gpu-4", 4)); err != nil {
		return "", err
	}
	if _, err := s.waitPhase("gpu-4", corev1.PodRunning, 60*time.Second); err != nil {
		return "", err
	}
	created := s.c.runtime.createdFor(namespace, "gpu-4", "main")
	if len(created) != 1 {
		return "", fmt.Errorf("%d CreateContainer requests for gpu-4/main, want 1", len(created))
	}
	wantCap, uuid, err := s.capFor(4)
	if err != nil {
		return "", err
	}
	cfg := created[0].GetConfig()
	env := envOf(cfg)
	want := map[string]string{
		"GPUMEM_LIMIT_MIB":             fmt.Sprint(wantCap),
		"NVIDIA_VISIBLE_DEVICES":       uuid,
		"ALIYUN_COM_GPU_MEM_IDX":       "0",
		"GPUMEM_STATE_DIR":             "/var/run/gpumem",
		"ALIYUN_COM_GPU_MEM_UNIT":      "GiB",
		"ALIYUN_COM_GPU_MEM_DEV":       s.gpuUnits(),
		"ALIYUN_COM_GPU_MEM_CONTAINER": "4",
	}
	var problems []string
	for k, v := range want {
		if env[k] != v {
			problems = append(problems, fmt.Sprintf("env %s=%q, want %q", k, env[k], v))
		}
	}
	mounts := map[string]*runtimeapi.Mount{}
	for _, m := range cfg.GetMounts() {
		mounts[m.GetContainerPath()] = m
	}
	wantMounts := map[string]string{
		"/etc/ld.so.preload":                  filepath.Join(s.c.shimDir, "ld.so.preload"),
		"/usr/local/gpumem/libgpumem_shim.so": filepath.Join(s.c.shimDir, "libgpumem_shim.so"),
	}
	for path, host := range wantMounts {
		m := mounts[path]
		switch {
		case m == nil:
			problems = append(problems, "no mount at "+path)
		case m.GetHostPath() != host || !m.GetReadonly():
			problems = append(problems, fmt.Sprintf("mount %s from %s readonly=%v, want %s readonly", path, m.GetHostPath(), m.GetReadonly(), host))
		}
		if _, err := os.Stat(host); err != nil {
			problems = append(problems, fmt.Sprintf("mount source: %v", err))
		}
	}
	// The container's accounting directory, created by gpumem before it
	// answered, under the state directory.
	var accounting string
	if m := mounts["/var/run/gpumem"]; m != nil && strings.HasPrefix(m.GetHostPath(), s.c.stateDir+"/") && !m.GetReadonly() {
		accounting = m.GetHostPath()
	}
	if accounting == "" {
		problems = append(problems, "no accounting directory of the state directory mounted writable at /var/run/gpumem")
	} else if entries, err := os.ReadDir(accounting); err != nil || len(entries) == 0 {
		problems = append(problems, fmt.Sprintf("accounting directory %s empty or unreadable: %v", accounting, err))
	}
	if len(problems) > 0 {
		sort.Strings(problems)
		var got []string
		for k, v := range env {
			got = append(got, k+"="+v)
		}
		for _, m := range cfg.GetMounts() {
			got = append(got, fmt.Sprintf("mount %s<-%s ro=%v", m.GetContainerPath(), m.GetHostPath(), m.GetReadonly()))
		}
		sort.Strings(got)
		return "", fmt.Errorf("%s (CreateContainer had: %s)", strings.Join(problems, "; "), strings.Join(got, ", "))
	}
	return fmt.Sprintf("Running; CreateContainer has GPUMEM_LIMIT_MIB=%s NVIDIA_VISIBLE_DEVICES=%s, /etc/ld.so.preload and the shim mounted read-only, accounting dir %s",
		env["GPUMEM_LIMIT_MIB"], env["NVIDIA_VISIBLE_DEVICES"], strings.TrimPrefix(accounting, s.c.cfg.work+"/")), nil
}

func (s *suite) annotations() (string, error) {
	var pod *corev1.Pod
	want := map[string]string{
		"ALIYUN_COM_GPU_MEM_IDX":      "0",
		"ALIYUN_COM_GPU_MEM_DEV":      s.gpuUnits(),
		"ALIYUN_COM_GPU_MEM_ASSIGNED": "true",
	}
	err := waitFor(20*time.Second, "gpushare annotations on gpu-4", func() (bool, error) {
		var err error
		pod, err = s.c.admin.CoreV1().Pods(namespace).Get(ctx, "gpu-4", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for k, v := range want {
			if pod.Annotations[k] != v {
				return false, fmt.Errorf("%s=%q, want %q", k, pod.Annotations[k], v)
			}
		}
		return true, nil
	})
	if err != nil {
		return "", err
	}
	// Per container: {"<container index>": {"<GPU index>": units}}.
	var alloc map[string]map[string]int
	raw := pod.Annotations["scheduler.framework.gpushare.allocation"]
	if err := json.Unmarshal([]byte(raw), &alloc); err != nil {
		return "", fmt.Errorf("scheduler.framework.gpushare.allocation %q: %v", raw, err)
	}
	if len(alloc) != 1 || alloc["0"]["0"] != 4 || len(alloc["0"]) != 1 {
		return "", fmt.Errorf("scheduler.framework.gpushare.allocation %s, want {\"0\":{\"0\":4}}", raw)
	}
	return fmt.Sprintf("IDX=0 POD=4 DEV=%s ASSIGNED=true, allocation %s", pod.Annotations["ALIYUN_COM_GPU_MEM_DEV"], raw), nil
}

func (s *suite) refused() (string, error) {
	// One unit more than is free beside gpu-4.
	if err := s.createPod(gpuPod("gpu-over", s.units-4+1)); err != nil {
		return "", err
	}
	pod, err := s.waitPhase("gpu-over", corev1.PodFailed, 60*time.Second)
	if err != nil {
		return "", err
	}
	if pod.Status.Reason == "" || !strings.Contains(pod.Status.Message, resourceName) {
		return "", fmt.Errorf("Failed with reason %q message %q: no reason naming %s", pod.Status.Reason, pod.Status.Message, resourceName)
	}
	if n := len(s.c.runtime.createdFor(namespace, "gpu-over", "main")); n != 0 {
		return "", fmt.Errorf("%d containers created for a refused pod", n)
	}
	if err := s.c.admin.CoreV1().Pods(namespace).Delete(ctx, "gpu-over", metav1.DeleteOptions{}); err != nil {
		return "", err
	}
	return fmt.Sprintf("Failed, %s: %s", pod.Status.Reason, pod.Status.Message), nil
}

// holds checks gpumem's view: pod gpu-4's container on GPU0 with 4 units.
func (s *suite) holds() error {
	return waitFor(20*time.Second, "gpumem lists gpu-4 holding 4 units", func() (bool, error) {
		st, err := s.gpumemStatus()
		if err != nil {
			return false, err
		}
		if st.PodResourcesError != nil {
			return false, fmt.Errorf("pod-resources: %s", *st.PodResourcesError)
		}
		for _, c := range st.Containers {
			if c.Pod != nil && *c.Pod == "gpu-4" && c.Units == 4 && st.Gpus[0].AllocatedUnits == 4 {
				return true, nil
			}
		}
		return false, fmt.Errorf("containers %+v, GPU0 allocated %d", st.Containers, st.Gpus[0].AllocatedUnits)
	})
}

func (s *suite) kubeletRestart() (string, error) {
	s.c.kubelet.stop(30 * time.Second)
	stopped := time.Now()
	if err := s.c.runKubelet(); err != nil {
		return "", err
	}
	started := time.Now()
	took, err := s.waitAllocatableSince(s.units, 120*time.Second, started)
	if err != nil {
		return "", err
	}
	if err := s.holds(); err != nil {
		return "", err
	}
	if _, err := s.waitPhase("gpu-4", corev1.PodRunning, 10*time.Second); err != nil {
		return "", err
	}
	if n := len(s.c.runtime.createdFor(namespace, "gpu-4", "main")); n != 1 {
		return "", fmt.Errorf("gpu-4/main created %d times, want once (kubelet keeps running containers)", n)
	}
	return fmt.Sprintf("allocatable %d again %.1f s after kubelet was started (%.1f s after it stopped); gpu-4 still Running, created once, its 4 units held", s.units, took.Seconds(), took.Seconds()+started.Sub(stopped).Seconds()), nil
}

func (s *suite) pluginRestart() (string, error) {
	s.c.gpumem.stop(30 * time.Second)
	// kubelet sees the stream end: the resource is unhealthy, allocatable 0.
	if _, err := s.waitAllocatable(0, 30*time.Second); err != nil {
		return "", fmt.Errorf("after gpumem stopped: %w", err)
	}
	if err := s.c.runGpumem(); err != nil {
		return "", err
	}
	took, err := s.waitAllocatable(s.units, 60*time.Second)
	if err != nil {
		return "", err
	}
	if err := s.holds(); err != nil {
		return "", err
	}
	return fmt.Sprintf("allocatable 0 while stopped, %d again %.1f s after start; gpumem lists gpu-4 with 4 units", s.units, took.Seconds()), nil
}

func (s *suite) deletion() (string, error) {
	if err := s.deletePod("gpu-4"); err != nil {
		return "", err
	}
	if err := waitFor(30*time.Second, "gpumem frees gpu-4's units", func() (bool, error) {
		st, err := s.gpumemStatus()
		if err != nil {
			return false, err
		}
		return st.Gpus[0].AllocatedUnits == 0 && len(st.Containers) == 0, fmt.Errorf("GPU0 allocated %d, containers %d", st.Gpus[0].AllocatedUnits, len(st.Containers))
	}); err != nil {
		return "", err
	}
	// Every unit is free again: a pod takes the whole GPU.
	if err := s.createPod(gpuPod("gpu-all", s.units)); err != nil {
		return "", err
	}
	if _, err := s.waitPhase("gpu-all", corev1.PodRunning, 60*time.Second); err != nil {
		return "", err
	}
	created := s.c.runtime.createdFor(namespace, "gpu-all", "main")
	if len(created) != 1 {
		return "", fmt.Errorf("%d CreateContainer requests for gpu-all", len(created))
	}
	wantCap, _, err := s.capFor(uint64(s.units))
	if err != nil {
		return "", err
	}
	var got string
	for _, kv := range created[0].GetConfig().GetEnvs() {
		if kv.GetKey() == "GPUMEM_LIMIT_MIB" {
			got = string(kv.GetValue())
		}
	}
	if got != fmt.Sprint(wantCap) {
		return "", fmt.Errorf("gpu-all GPUMEM_LIMIT_MIB=%q, want %d", got, wantCap)
	}
	if err := s.deletePod("gpu-all"); err != nil {
		return "", err
	}
	return fmt.Sprintf("gone from the API, gpumem shows 0 units held; then a %d-unit pod admitted with GPUMEM_LIMIT_MIB=%s", s.units, got), nil
}

// untainted waits for the node lifecycle controller to lift the not-ready
// taint kubelet registers the node with; until then nothing is scheduled.
func (s *suite) untainted() error {
	return waitFor(60*time.Second, "node untainted", func() (bool, error) {
		node, err := s.c.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return len(node.Spec.Taints) == 0, fmt.Errorf("taints %v", node.Spec.Taints)
	})
}

func (s *suite) scheduled() (string, error) {
	if err := s.untainted(); err != nil {
		return "", err
	}
	pod := gpuPod("sched-big", s.units+1)
	pod.Spec.NodeName = ""
	if err := s.createPod(pod); err != nil {
		return "", err
	}
	fits := gpuPod("sched-6", 6)
	fits.Spec.NodeName = ""
	if err := s.createPod(fits); err != nil {
		return "", err
	}
	if _, err := s.waitPhase("sched-6", corev1.PodRunning, 60*time.Second); err != nil {
		return "", err
	}
	var msg string
	err := waitFor(30*time.Second, "sched-big unschedulable", func() (bool, error) {
		p, err := s.c.admin.CoreV1().Pods(namespace).Get(ctx, "sched-big", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == "Unschedulable" {
				msg = c.Message
				return p.Spec.NodeName == "" && strings.Contains(c.Message, resourceName), nil
			}
		}
		return false, nil
	})
	if err != nil {
		return "", err
	}
	for _, n := range []string{"sched-6", "sched-big"} {
		if err := s.c.admin.CoreV1().Pods(namespace).Delete(ctx, n, metav1.DeleteOptions{}); err != nil {
			return "", err
		}
	}
	return fmt.Sprintf("6-unit pod bound to %s and Running; %d-unit pod Pending: %s", nodeName, s.units+1, msg), nil
}
