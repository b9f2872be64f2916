// Scenarios with the device plugin and the default scheduler: registration
// and the node's allocatable, Allocate's answer in the container, kubelet's
// admission, restarts of kubelet and of gpumem, and the scheduler placing
// by allocatable; the device-list strategies (strategies.go) and GPU
// health (health.go) on the same cluster.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// pluginScenarios run after the phase's gate, "plugin registers with
// kubelet" (registers).
var pluginScenarios = []scenario{
	{"node allocatable", (*suite).allocatable},
	{"4-unit pod admitted, container carries Allocate's answer", (*suite).admitted},
	{"gpushare annotations on the pod", (*suite).annotations},
	{"pod asking more than is free refused by kubelet", (*suite).refused},
	{"kubelet restart: allocatable restored, holdings kept", (*suite).kubeletRestart},
	{"plugin restart: allocatable restored, holdings kept", (*suite).pluginRestart},
	{"pod deletion frees its units", (*suite).deletion},
	{"kube-scheduler places a GPU pod by allocatable", (*suite).scheduled},
	{"--device-list-strategy cdi: CDI devices and their spec", (*suite).strategyCDI},
	{"--device-list-strategy volume-mounts: the device-list mount", (*suite).strategyVolumeMounts},
	{"GPU unhealthy: allocatable drops, the pod's status says Unhealthy; recovered: both back", (*suite).pluginHealth},
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
	if err := s.holdingFour(); err != nil {
		return "", err
	}
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
	if err := s.holdingFour(); err != nil {
		return "", err
	}
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

// holdingFour is what most scenarios here start from: pod gpu-4 Running
// with 4 units, which gpumem lists as held.
func (s *suite) holdingFour() error {
	if err := s.createPod(gpuPod("gpu-4", 4)); err != nil {
		return err
	}
	if _, err := s.waitPhase("gpu-4", corev1.PodRunning, 60*time.Second); err != nil {
		return err
	}
	return s.holds()
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
	if err := s.holdingFour(); err != nil {
		return "", err
	}
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
	if err := s.holdingFour(); err != nil {
		return "", err
	}
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
	if err := s.holdingFour(); err != nil {
		return "", err
	}
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
