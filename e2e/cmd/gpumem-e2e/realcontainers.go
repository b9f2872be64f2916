// Scenarios in real containers (containerd and runc, containerd.go): the
// probe in a pod of the image built here, its allocations on the fake
// driver capped by the shim that gpumem's /etc/ld.so.preload mount alone
// loads (the pods set no LD_PRELOAD), with each device-list strategy that
// needs no runtime settings under containerd 1.6, and with the cdi strategy
// and the DRA driver, whose mounts only CDI carries, under containerd 2.x.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// probeSteps: what NVML reports, then 4000 MiB, which fits beside the fake
// driver's 300 MiB context under a 4-unit cap of a T4 (4308 MiB), and 100
// MiB more, which does not.
var probeSteps = []string{"nvml", "alloc:4000", "alloc:100"}

const cudaOutOfMemory = 2

// containerScenarios run after the phase's gate, "plugin registers with
// kubelet" (registers), under containerd 1.6; the release image's
// (release.go) join them when there is an archive.
var containerScenarios = []scenario{
	{"real container, envvar: the shim caps NVML and CUDA at 4 units", func(s *suite) (string, error) {
		return s.capped("real-envvar", "")
	}},
	{"real container, envvar: a process exec'd into it shares the cap", (*suite).execShares},
	{"real container without the request sees the whole GPU", (*suite).uncapped},
	{"real container, volume-mounts: the shim caps NVML and CUDA at 4 units", func(s *suite) (string, error) {
		return s.capped("real-vm", "volume-mounts")
	}},
}

// cdiContainerScenarios run under containerd 2.x with CDI, after the
// gate "plugin registers with kubelet".
var cdiContainerScenarios = []scenario{
	{"real container, cdi: the shim from gpumem's CDI spec caps NVML and CUDA at 4 units", func(s *suite) (string, error) {
		return s.capped("real-cdi", "cdi")
	}},
}

// draContainerScenarios run under containerd 2.x with CDI and the DRA
// driver, after the gate "DRA driver registers and publishes consumable
// capacity" (draRegisters).
var draContainerScenarios = []scenario{
	{"real container, 4Gi claim: the shim from the claim's CDI spec caps NVML and CUDA at 4096 MiB", (*suite).draCapped},
}

// nvidiaEnv is what the runner's stand-in for NVIDIA's CDI spec sets: the
// cdi strategy names nvidia.com/gpu=<UUID> too (and so does the DRA driver
// where a spec names the GPU), which containerd refuses to start a
// container with unless a spec resolves it.
const nvidiaEnv = "GPUMEM_E2E_NVIDIA_CDI"

// writeNVIDIASpec writes a CDI spec of kind nvidia.com/gpu naming the GPU
// uuid, as `nvidia-ctk cdi generate` would, beside gpumem's specs. Its only
// edit is nvidiaEnv: the image has the fake driver where the toolkit would
// mount NVIDIA's.
func (s *suite) writeNVIDIASpec(uuid string) error {
	spec := fmt.Sprintf(`cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
  - name: %s
    containerEdits:
      env:
        - %s=%s
`, uuid, nvidiaEnv, uuid)
	return os.WriteFile(filepath.Join(s.c.cdiDir(), "nvidia.yaml"), []byte(spec), 0o644)
}

// env is the value of name in the container's environment, if set.
func (o *ociSpec) env(name string) (string, bool) {
	for _, e := range o.Process.Env {
		if v, ok := strings.CutPrefix(e, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// draCapped runs the probe in a pod whose 4Gi claim comes from
// dra-example.yaml's template: everything the container gets from gpumem
// (cap, shim, accounting directory) comes through the claim's CDI spec.
func (s *suite) draCapped() (string, error) {
	if err := s.untainted(); err != nil {
		return "", err
	}
	st, err := s.gpumemStatus()
	if err != nil {
		return "", err
	}
	uuid := st.Gpus[0].UUID
	if err := s.writeNVIDIASpec(uuid); err != nil {
		return "", err
	}
	template, example, err := s.draExampleObjects()
	if err != nil {
		return "", err
	}
	want := template.Spec.Spec.Devices.Requests[0].Exactly.Capacity.Requests["memory"]
	if _, err := s.c.admin.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, template, metav1.CreateOptions{}); err != nil {
		return "", err
	}
	wantCap := uint64(want.Value() >> 20)
	p := probePod("real-dra", 0)
	p.Spec.NodeName = ""
	p.Spec.ResourceClaims = example.Spec.ResourceClaims
	p.Spec.Tolerations = example.Spec.Tolerations
	c := &p.Spec.Containers[0]
	c.Resources.Claims = example.Spec.Containers[0].Resources.Claims
	// 3700 MiB fits beside the fake driver's 300 MiB context under 4096
	// MiB; 100 MiB more does not.
	c.Command = []string{imageProbe, "nvml", "alloc:3700", "alloc:100"}
	r, err := s.runProbe(p)
	if err != nil {
		return "", err
	}
	problems, err := s.heldToCap(r, wantCap)
	if err != nil {
		return "", err
	}
	if v, _ := r.spec.env("GPUMEM_LIMIT_MIB"); v != fmt.Sprint(wantCap) {
		problems = append(problems, fmt.Sprintf("GPUMEM_LIMIT_MIB=%q", v))
	}
	if v, _ := r.spec.env(nvidiaEnv); v != uuid {
		problems = append(problems, fmt.Sprintf("%s=%q: nvidia.com/gpu=%s not injected", nvidiaEnv, v, uuid))
	}
	if e := r.spec.preloadEnv(); e != "" {
		problems = append(problems, e+" in the env")
	}
	if len(problems) > 0 {
		return "", fmt.Errorf("runc's spec: %s", strings.Join(problems, "; "))
	}
	return fmt.Sprintf("probe under runc: NVML total %d MiB; 3700 MiB granted, 100 MiB more refused (CUDA %d); CDI gave GPUMEM_LIMIT_MIB=%d, /etc/ld.so.preload read-only and nvidia.com/gpu=%s", r.totalMiB, r.allocs[1], wantCap, uuid), nil
}

func probePod(name string, units int64) *corev1.Pod {
	p := gpuPod(name, units)
	if units == 0 {
		p.Spec.Containers[0].Resources = corev1.ResourceRequirements{}
	}
	// The host's network: nothing is installed to give a pod its own.
	p.Spec.HostNetwork = true
	p.Spec.RestartPolicy = corev1.RestartPolicyNever
	c := &p.Spec.Containers[0]
	c.Image = probeImage
	c.ImagePullPolicy = corev1.PullNever
	c.Command = append([]string{imageProbe}, probeSteps...)
	return p
}

// probeResult is what the probe printed: NVML's total and each
// allocation's CUDA result.
type probeResult struct {
	totalMiB uint64
	allocs   []int
	log      string
	spec     ociSpec // what runc ran the container with
}

// ociSpec is the part of a container's OCI runtime spec the suite reads.
type ociSpec struct {
	Process struct {
		Env []string `json:"env"`
	} `json:"process"`
	Mounts []struct {
		Destination string   `json:"destination"`
		Source      string   `json:"source"`
		Options     []string `json:"options"`
	} `json:"mounts"`
}

// mount returns the source of the mount at dest and whether it is
// read-only; "" when there is none.
func (o *ociSpec) mount(dest string) (string, bool) {
	for _, m := range o.Mounts {
		if m.Destination == dest {
			return m.Source, slices.Contains(m.Options, "ro")
		}
	}
	return "", false
}

// preloadEnv is any LD_PRELOAD in the container's environment.
func (o *ociSpec) preloadEnv() string {
	for _, e := range o.Process.Env {
		if strings.HasPrefix(e, "LD_PRELOAD=") {
			return e
		}
	}
	return ""
}

// runProbe runs probe pod p to completion, reads the log file containerd
// wrote where kubelet asked (the API server cannot reach a kubelet whose
// node has only a loopback address, which kubelet does not publish), and
// deletes the pod.
func (s *suite) runProbe(p *corev1.Pod) (*probeResult, error) {
	name := p.Name
	if err := s.createPod(p); err != nil {
		return nil, err
	}
	var pod *corev1.Pod
	err := waitFor(120*time.Second, fmt.Sprintf("pod %s Succeeded", name), func() (bool, error) {
		var err error
		pod, err = s.c.admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if pod.Status.Phase == corev1.PodFailed {
			return false, fatal{fmt.Errorf("Failed: %s %s %s", pod.Status.Reason, pod.Status.Message, containerState(pod))}
		}
		return pod.Status.Phase == corev1.PodSucceeded, fmt.Errorf("phase %q %s", pod.Status.Phase, containerState(pod))
	})
	var logs string
	var logErr error
	if pod != nil {
		logs, logErr = s.containerLog(pod, "main")
	}
	if err != nil {
		return nil, fmt.Errorf("%w; log: %q", err, logs)
	}
	if logErr != nil {
		return nil, logErr
	}
	r := &probeResult{log: logs}
	// Read before the pod goes: kubelet removes its containers then.
	var id string
	if cs := pod.Status.ContainerStatuses; len(cs) == 1 {
		id = strings.TrimPrefix(cs[0].ContainerID, "containerd://")
	}
	out, err := s.c.ctrStdout("containers", "info", "--spec", id)
	if err != nil {
		return nil, fmt.Errorf("spec of container %q: %w", id, err)
	}
	if err := json.Unmarshal([]byte(out), &r.spec); err != nil {
		return nil, fmt.Errorf("spec of container %s: %w: %q", id, err, out)
	}
	if err := s.deletePod(name); err != nil {
		return nil, err
	}
	for _, line := range strings.Split(r.log, "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) > 2 && f[0] == "nvml" && strings.HasPrefix(f[2], "total="):
			bytes, _ := strconv.ParseUint(strings.TrimPrefix(f[2], "total="), 10, 64)
			r.totalMiB = bytes >> 20
		case len(f) > 1 && strings.HasPrefix(f[0], "alloc:"):
			n, _ := strconv.Atoi(f[1])
			r.allocs = append(r.allocs, n)
		}
	}
	if r.totalMiB == 0 || len(r.allocs) != 2 {
		return nil, fmt.Errorf("probe's log has no NVML total or not two allocations: %q", r.log)
	}
	return r, nil
}

// containerLog is what the container's first run wrote, from kubelet's
// log directory (/var/log/pods in its namespace), less the CRI log
// format's timestamp, stream and tag.
func (s *suite) containerLog(pod *corev1.Pod, container string) (string, error) {
	file := filepath.Join(s.c.kubeletLogDir, "pods", fmt.Sprintf("%s_%s_%s", pod.Namespace, pod.Name, pod.UID), container, "0.log")
	data, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	var lines []string
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		if f := strings.SplitN(line, " ", 4); len(f) == 4 {
			lines = append(lines, f[3])
		}
	}
	return strings.Join(lines, "\n"), nil
}

func containerState(pod *corev1.Pod) string {
	for _, c := range pod.Status.ContainerStatuses {
		switch {
		case c.State.Waiting != nil:
			return fmt.Sprintf("waiting: %s %s", c.State.Waiting.Reason, c.State.Waiting.Message)
		case c.State.Terminated != nil:
			return fmt.Sprintf("terminated: exit %d %s %s", c.State.Terminated.ExitCode, c.State.Terminated.Reason, c.State.Terminated.Message)
		}
	}
	return ""
}

// capped runs a 4-unit probe pod, after restarting gpumem with strategy
// when one is given (and with the manifest's again after the scenario).
func (s *suite) capped(name, strategy string) (string, error) {
	if strategy != "" {
		if err := s.useStrategy(strategy); err != nil {
			return "", err
		}
	}
	wantCap, uuid, err := s.capFor(4)
	if err != nil {
		return "", err
	}
	if strategy == "cdi" {
		if err := s.writeNVIDIASpec(uuid); err != nil {
			return "", err
		}
	}
	r, err := s.runProbe(probePod(name, 4))
	if err != nil {
		return "", err
	}
	// The cap came through the preload list Allocate mounted, not the env.
	problems, err := s.heldToCap(r, wantCap)
	if err != nil {
		return "", err
	}
	if src, _ := r.spec.mount("/var/run/gpumem"); !strings.HasPrefix(src, s.c.stateDir+"/") {
		problems = append(problems, fmt.Sprintf("/var/run/gpumem from %q", src))
	}
	if e := r.spec.preloadEnv(); e != "" {
		problems = append(problems, e+" in the env")
	}
	how := "/etc/ld.so.preload mounted read-only, no LD_PRELOAD"
	if strategy == "cdi" {
		// kubelet got only CDI names from Allocate: the mounts above and
		// the cap came from gpumem's spec, and NVIDIA's name resolved.
		if v, _ := r.spec.env("GPUMEM_LIMIT_MIB"); v != fmt.Sprint(wantCap) {
			problems = append(problems, fmt.Sprintf("GPUMEM_LIMIT_MIB=%q", v))
		}
		if v, _ := r.spec.env(nvidiaEnv); v != uuid {
			problems = append(problems, fmt.Sprintf("%s=%q: nvidia.com/gpu=%s not injected", nvidiaEnv, v, uuid))
		}
		if v, ok := r.spec.env("NVIDIA_VISIBLE_DEVICES"); ok {
			problems = append(problems, "NVIDIA_VISIBLE_DEVICES="+v)
		}
		how = "CDI devices gpumem.io/container (GPUMEM_LIMIT_MIB, /etc/ld.so.preload read-only, no LD_PRELOAD) and nvidia.com/gpu=" + uuid
	}
	if strategy == "volume-mounts" {
		at := "/var/run/nvidia-container-devices/" + uuid
		if src, _ := r.spec.mount(at); src != "/dev/null" {
			problems = append(problems, fmt.Sprintf("%s from %q, want /dev/null", at, src))
		}
		how += ", /dev/null at /var/run/nvidia-container-devices/<uuid>"
	}
	if len(problems) > 0 {
		return "", fmt.Errorf("runc's spec: %s", strings.Join(problems, "; "))
	}
	return fmt.Sprintf("probe under runc: NVML total %d MiB; 4000 MiB granted, 100 MiB more refused (CUDA %d); %s", r.totalMiB, r.allocs[1], how), nil
}

func (s *suite) uncapped() (string, error) {
	st, err := s.gpumemStatus()
	if err != nil {
		return "", err
	}
	whole := st.Gpus[0].MemoryMiB
	r, err := s.runProbe(probePod("real-plain", 0))
	if err != nil {
		return "", err
	}
	if r.totalMiB != whole || r.allocs[0] != 0 || r.allocs[1] != 0 {
		return "", fmt.Errorf("NVML total %d MiB, allocations %v; want %d MiB, [0 0]; log: %q", r.totalMiB, r.allocs, whole, r.log)
	}
	if src, _ := r.spec.mount("/etc/ld.so.preload"); src != "" {
		return "", fmt.Errorf("/etc/ld.so.preload mounted from %s without the request", src)
	}
	return fmt.Sprintf("probe under runc: NVML total %d MiB; 4000 and 100 MiB granted", r.totalMiB), nil
}

// execShares holds 2000 MiB in a 4-unit container, then runs a second probe
// in it through the CRI's ExecSync (as kubelet runs an exec probe; kubectl
// exec's process joins the container the same way): that process sees the
// first one's memory as used and is refused 2000 MiB more.
func (s *suite) execShares() (string, error) {
	wantCap, _, err := s.capFor(4)
	if err != nil {
		return "", err
	}
	p := probePod("real-exec", 4)
	p.Spec.Containers[0].Command = []string{imageProbe, "alloc:2000", "hold"}
	if err := s.createPod(p); err != nil {
		return "", err
	}
	var pod *corev1.Pod
	err = waitFor(120*time.Second, "real-exec holding its 2000 MiB", func() (bool, error) {
		var err error
		pod, err = s.c.admin.CoreV1().Pods(namespace).Get(ctx, "real-exec", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if pod.Status.Phase != corev1.PodRunning {
			return false, fmt.Errorf("phase %q %s", pod.Status.Phase, containerState(pod))
		}
		log, err := s.containerLog(pod, "main")
		return strings.Contains(log, "holding"), fmt.Errorf("log %q: %v", log, err)
	})
	if err != nil {
		return "", err
	}
	id := strings.TrimPrefix(pod.Status.ContainerStatuses[0].ContainerID, "containerd://")
	stdout, stderr, code, err := s.c.execSync(id, []string{imageProbe, "nvml", "alloc:2000"})
	if err != nil {
		return "", fmt.Errorf("ExecSync: %w", err)
	}
	if err := s.deletePod("real-exec"); err != nil {
		return "", err
	}
	var total, used uint64
	alloc := -1
	for _, line := range strings.Split(stdout, "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) > 3 && f[0] == "nvml":
			total, _ = strconv.ParseUint(strings.TrimPrefix(f[2], "total="), 10, 64)
			used, _ = strconv.ParseUint(strings.TrimPrefix(f[3], "used="), 10, 64)
		case len(f) > 1 && f[0] == "alloc:2000":
			alloc, _ = strconv.Atoi(f[1])
		}
	}
	// The holder's 2000 MiB and its context, at least.
	if code != 0 || total>>20 != wantCap || used>>20 < 2000 || alloc != cudaOutOfMemory {
		return "", fmt.Errorf("exec'd probe: exit %d, NVML total %d MiB used %d MiB, alloc:2000 %d; want total %d MiB, used ≥ 2000 MiB, alloc refused (%d); stdout %q stderr %q",
			code, total>>20, used>>20, alloc, wantCap, cudaOutOfMemory, stdout, stderr)
	}
	return fmt.Sprintf("beside a process holding 2000 MiB, an exec'd probe sees NVML total %d MiB, used %d MiB, and is refused 2000 MiB more (CUDA %d)", total>>20, used>>20, alloc), nil
}

// heldToCap checks a probe that asked for its cap's worth less its
// context, then 100 MiB more: NVML showed the cap, the first was granted
// and the second refused. What runc was told that is wrong comes back as
// problems, starting with gpumem's preload list not mounted read-only.
func (s *suite) heldToCap(r *probeResult, wantCap uint64) ([]string, error) {
	if r.totalMiB != wantCap || r.allocs[0] != 0 || r.allocs[1] != cudaOutOfMemory {
		return nil, fmt.Errorf("NVML total %d MiB, allocations %v; want %d MiB, [0 %d]; log: %q", r.totalMiB, r.allocs, wantCap, cudaOutOfMemory, r.log)
	}
	var problems []string
	if src, ro := r.spec.mount("/etc/ld.so.preload"); src != filepath.Join(s.c.shimDir, "ld.so.preload") || !ro {
		problems = append(problems, fmt.Sprintf("/etc/ld.so.preload from %q read-only=%v", src, ro))
	}
	return problems, nil
}
