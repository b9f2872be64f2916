// The device-list strategies other than the manifest's envvar: gpumem
// restarted with --device-list-strategy cdi or volume-mounts, and what
// kubelet then asks the runtime for.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// withStrategy restarts gpumem with another device-list strategy (the
// manifest's again after the scenario), runs a 4-unit pod and returns its
// CreateContainer request; the pod is deleted again before it returns.
func (s *suite) withStrategy(strategy, pod string) (*runtimeapi.ContainerConfig, error) {
	if err := s.useStrategy(strategy); err != nil {
		return nil, err
	}
	if err := s.createPod(gpuPod(pod, 4)); err != nil {
		return nil, err
	}
	if _, err := s.waitPhase(pod, corev1.PodRunning, 60*time.Second); err != nil {
		return nil, err
	}
	created := s.c.runtime.createdFor(namespace, pod, "main")
	if len(created) != 1 {
		return nil, fmt.Errorf("%d CreateContainer requests for %s", len(created), pod)
	}
	if err := s.deletePod(pod); err != nil {
		return nil, err
	}
	return created[0].GetConfig(), nil
}

// useStrategy restarts gpumem with --device-list-strategy=strategy for
// the rest of the scenario, and with the one it had after it.
func (s *suite) useStrategy(strategy string) error {
	var before string
	for _, a := range s.c.gpumemArgv {
		if v, ok := strings.CutPrefix(a, "--device-list-strategy="); ok {
			before = v
		}
	}
	if before == "" {
		return fmt.Errorf("the manifest's args have no --device-list-strategy")
	}
	s.cleanup(func() error { return s.restartWithStrategy(before) })
	return s.restartWithStrategy(strategy)
}

// restartWithStrategy restarts gpumem with --device-list-strategy=strategy
// and waits for kubelet to offer every unit again.
func (s *suite) restartWithStrategy(strategy string) error {
	s.c.gpumem.stop(30 * time.Second)
	if _, err := s.waitAllocatable(0, 30*time.Second); err != nil {
		return fmt.Errorf("after gpumem stopped: %w", err)
	}
	found := false
	for i, a := range s.c.gpumemArgv {
		if strings.HasPrefix(a, "--device-list-strategy=") {
			s.c.gpumemArgv[i] = "--device-list-strategy=" + strategy
			found = true
		}
	}
	if !found {
		return fmt.Errorf("the manifest's args have no --device-list-strategy")
	}
	if err := s.c.runGpumem(); err != nil {
		return err
	}
	_, err := s.waitAllocatable(s.units, 60*time.Second)
	return err
}

func (s *suite) strategyCDI() (string, error) {
	wantCap, uuid, err := s.capFor(4)
	if err != nil {
		return "", err
	}
	cfg, err := s.withStrategy("cdi", "cdi-4")
	if err != nil {
		return "", err
	}
	var names []string
	for _, d := range cfg.GetCDIDevices() {
		names = append(names, d.GetName())
	}
	var gpu, own string
	for _, n := range names {
		switch {
		case n == "nvidia.com/gpu="+uuid:
			gpu = n
		case strings.HasPrefix(n, "gpumem.io/container="):
			own = n
		}
	}
	if gpu == "" || own == "" {
		return "", fmt.Errorf("CDI devices %v: want nvidia.com/gpu=%s and a gpumem.io/container device", names, uuid)
	}
	if v, ok := envOf(cfg)["NVIDIA_VISIBLE_DEVICES"]; ok {
		return "", fmt.Errorf("NVIDIA_VISIBLE_DEVICES=%s in the env with cdi", v)
	}
	name := strings.TrimPrefix(own, "gpumem.io/container=")
	want := fmt.Sprintf("GPUMEM_LIMIT_MIB=%d", wantCap)
	specs, _ := filepath.Glob(filepath.Join(s.c.path("cdi"), "*"))
	for _, f := range specs {
		data, err := os.ReadFile(f)
		if err == nil && strings.Contains(string(data), name) && strings.Contains(string(data), want) {
			return fmt.Sprintf("container given CDI devices %s; spec %s has %s", strings.Join(names, ", "), filepath.Base(f), want), nil
		}
	}
	return "", fmt.Errorf("no CDI spec in %s names %s with %s", s.c.path("cdi"), name, want)
}

func (s *suite) strategyVolumeMounts() (string, error) {
	wantCap, uuid, err := s.capFor(4)
	if err != nil {
		return "", err
	}
	cfg, err := s.withStrategy("volume-mounts", "vm-4")
	if err != nil {
		return "", err
	}
	at := "/var/run/nvidia-container-devices/" + uuid
	var m *runtimeapi.Mount
	for _, x := range cfg.GetMounts() {
		if x.GetContainerPath() == at {
			m = x
		}
	}
	if m == nil || m.GetHostPath() != "/dev/null" {
		return "", fmt.Errorf("no /dev/null mount at %s: %v", at, cfg.GetMounts())
	}
	env := envOf(cfg)
	if env["NVIDIA_VISIBLE_DEVICES"] != "/var/run/nvidia-container-devices" || env["GPUMEM_LIMIT_MIB"] != fmt.Sprint(wantCap) {
		return "", fmt.Errorf("env NVIDIA_VISIBLE_DEVICES=%q GPUMEM_LIMIT_MIB=%q", env["NVIDIA_VISIBLE_DEVICES"], env["GPUMEM_LIMIT_MIB"])
	}
	return fmt.Sprintf("/dev/null mounted at %s, NVIDIA_VISIBLE_DEVICES=%s, GPUMEM_LIMIT_MIB=%s", at, env["NVIDIA_VISIBLE_DEVICES"], env["GPUMEM_LIMIT_MIB"]), nil
}
