// Scenarios with gpushare's scheduler extender: kube-scheduler runs with
// daemonset/kube-scheduler-config.yaml and asks `gpumem extender`, which
// picks the GPU and binds; the plugin (--scheduler=gpushare-extender)
// gives each container the GPU the extender chose.
package main

import (
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// extenderScenarios run after the phase's gate, "plugin registers with
// kubelet" (registers).
var extenderScenarios = []scenario{
	{"pod larger than any one GPU stays Pending with the extender's reason", (*suite).extenderFilters},
	{"extender binds a 4-unit pod, the plugin gives it the extender's GPU", (*suite).extenderBinds},
	{"a second 4-unit pod joins the first (extender binpack, plugin spread)", (*suite).extenderSameGPU},
	{"a whole-GPU pod goes to the other GPU", (*suite).extenderOtherGPU},
	{"second scheduler (schedulerName): one of two holds the lease and binds through its extender; the default scheduler leaves the pod", (*suite).secondScheduler},
	{"second scheduler: the holder killed, the other takes the lease and binds", (*suite).secondSchedulerHandover},
}

// unscheduledMessage waits for the scheduler to mark pod Unschedulable and
// returns its message.
func (s *suite) unscheduledMessage(name string, timeout time.Duration) (string, error) {
	var msg string
	err := waitFor(timeout, name+" unschedulable", func() (bool, error) {
		p, err := s.c.admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if p.Spec.NodeName != "" {
			return false, fatal{fmt.Errorf("bound to %s", p.Spec.NodeName)}
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == "Unschedulable" {
				msg = c.Message
				return true, nil
			}
		}
		return false, nil
	})
	return msg, err
}

func (s *suite) extenderFilters() (string, error) {
	st, err := s.gpumemStatus()
	if err != nil {
		return "", err
	}
	if len(st.Gpus) < 2 {
		return "", fmt.Errorf("the extender fixture needs two GPUs, gpumem sees %d", len(st.Gpus))
	}
	// More than one GPU has, less than the node has: kube-scheduler's own
	// fit check passes, only a per-GPU view refuses it.
	units := int64(st.Gpus[0].Units) + 2
	if units > s.units {
		return "", fmt.Errorf("%d units do not fit the node's %d: pick a fixture with more GPUs", units, s.units)
	}
	if err := s.untainted(); err != nil {
		return "", err
	}
	p := gpuPod("too-big", units)
	p.Spec.NodeName = ""
	if err := s.createPod(p); err != nil {
		return "", err
	}
	msg, err := s.unscheduledMessage("too-big", 60*time.Second)
	if err != nil {
		return "", err
	}
	if strings.Contains(msg, "Insufficient") || !strings.Contains(msg, "GPU") {
		return "", fmt.Errorf("Unschedulable, but not for the extender's per-GPU reason: %q", msg)
	}
	if err := s.c.admin.CoreV1().Pods(namespace).Delete(ctx, "too-big", metav1.DeleteOptions{}); err != nil {
		return "", err
	}
	return fmt.Sprintf("%d units on a node of %d: %s", units, s.units, msg), nil
}

// extenderPlaced waits for pod name to run and checks that the GPU the
// extender wrote (ALIYUN_COM_GPU_MEM_IDX) is the one kubelet's container
// was given; it returns that GPU's index.
func (s *suite) extenderPlaced(name string, units int64) (string, error) {
	p := gpuPod(name, units)
	p.Spec.NodeName = ""
	if err := s.createPod(p); err != nil {
		return "", err
	}
	return s.extenderRan(name, units)
}

// extenderRan is extenderPlaced for a pod already created.
func (s *suite) extenderRan(name string, units int64) (string, error) {
	pod, err := s.waitPhase(name, corev1.PodRunning, 60*time.Second)
	if err != nil {
		return "", err
	}
	idx := pod.Annotations["ALIYUN_COM_GPU_MEM_IDX"]
	if idx == "" || pod.Annotations["ALIYUN_COM_GPU_MEM_ASSUME_TIME"] == "" {
		return "", fmt.Errorf("no extender annotations on %s: %v", name, pod.Annotations)
	}
	if err := waitFor(20*time.Second, name+" ASSIGNED=true", func() (bool, error) {
		pod, err = s.c.admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return pod.Annotations["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true", fmt.Errorf("ASSIGNED=%q", pod.Annotations["ALIYUN_COM_GPU_MEM_ASSIGNED"])
	}); err != nil {
		return "", err
	}
	st, err := s.gpumemStatus()
	if err != nil {
		return "", err
	}
	var uuid string
	var memMiB, gpuUnits uint64
	for _, g := range st.Gpus {
		if fmt.Sprint(g.Index) == idx {
			uuid, memMiB, gpuUnits = g.UUID, g.MemoryMiB, uint64(g.Units)
		}
	}
	if uuid == "" {
		return "", fmt.Errorf("extender chose GPU %q, which gpumem does not have", idx)
	}
	created := s.c.runtime.createdFor(namespace, name, "main")
	if len(created) != 1 {
		return "", fmt.Errorf("%d CreateContainer requests for %s", len(created), name)
	}
	env := envOf(created[0].GetConfig())
	wantCap := fmt.Sprint(uint64(units) * memMiB / gpuUnits)
	if env["NVIDIA_VISIBLE_DEVICES"] != uuid || env["ALIYUN_COM_GPU_MEM_IDX"] != idx || env["GPUMEM_LIMIT_MIB"] != wantCap {
		return "", fmt.Errorf("extender chose GPU %s (%s, cap %s MiB); the container got NVIDIA_VISIBLE_DEVICES=%s ALIYUN_COM_GPU_MEM_IDX=%s GPUMEM_LIMIT_MIB=%s",
			idx, uuid, wantCap, env["NVIDIA_VISIBLE_DEVICES"], env["ALIYUN_COM_GPU_MEM_IDX"], env["GPUMEM_LIMIT_MIB"])
	}
	return idx, nil
}

func (s *suite) extenderBinds() (string, error) {
	idx, err := s.extenderPlaced("small", 4)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("bound to %s, extender chose GPU%s; the container got that GPU's UUID, ALIYUN_COM_GPU_MEM_IDX=%s and its cap; ASSIGNED=true", nodeName, idx, idx), nil
}

// extenderSameGPU: the extender (binpack) puts a second small pod beside
// the first; the plugin, left to itself (spread), would pick the emptier
// GPU. The pod landing beside the first shows the plugin followed.
func (s *suite) extenderSameGPU() (string, error) {
	first, err := s.extenderPlaced("small", 4)
	if err != nil {
		return "", fmt.Errorf("the first pod: %w", err)
	}
	idx, err := s.extenderPlaced("small-2", 4)
	if err != nil {
		return "", err
	}
	if idx != first {
		return "", fmt.Errorf("small-2 on GPU%s, small on GPU%s: binpack puts them together", idx, first)
	}
	return fmt.Sprintf("on GPU%s with the first, the container given that GPU", idx), nil
}

func (s *suite) extenderOtherGPU() (string, error) {
	small, err := s.extenderPlaced("small", 4)
	if err != nil {
		return "", fmt.Errorf("the 4-unit pod: %w", err)
	}
	st, err := s.gpumemStatus()
	if err != nil {
		return "", err
	}
	// A GPU's every unit: only the GPU that "small" is not on has them.
	idx, err := s.extenderPlaced("whole", int64(st.Gpus[0].Units))
	if err != nil {
		return "", err
	}
	if idx == small {
		return "", fmt.Errorf("both pods on GPU%s", idx)
	}
	for _, n := range []string{"small", "small-2", "whole"} {
		if err := s.c.admin.CoreV1().Pods(namespace).Delete(ctx, n, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return "", err
		}
	}
	return fmt.Sprintf("%d units on GPU%s, beside the 4-unit pod on GPU%s", st.Gpus[0].Units, idx, small), nil
}
