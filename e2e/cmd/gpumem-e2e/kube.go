// What scenarios of every phase ask of the API server: pods that hold GPU
// memory, their phases and deletion, and the node's resources and taints.
package main

import (
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/utils/ptr"
)

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

// deletePod deletes pod name and waits until the API server no longer has
// it: kubelet has stopped its containers and released what it held.
func (s *suite) deletePod(name string) error {
	if err := s.c.admin.CoreV1().Pods(namespace).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return err
	}
	return waitFor(60*time.Second, name+" gone", func() (bool, error) {
		_, err := s.c.admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), err
	})
}

// envOf is a container request's env as a map.
func envOf(cfg *runtimeapi.ContainerConfig) map[string]string {
	env := map[string]string{}
	for _, kv := range cfg.GetEnvs() {
		env[kv.GetKey()] = string(kv.GetValue())
	}
	return env
}
