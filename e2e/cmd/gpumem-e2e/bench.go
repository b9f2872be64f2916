// Benchmarks, not tests, on the real kubelet: kubelet restart → the node's
// allocatable back, as the device count (GiB or MiB units) and the units a
// pod holds grow (kubelet's handling of the list grows with both); and
// pod created → container created, through each front end. Run by hand; the figures go to
// docs/BENCHMARKS.md.
package main

import (
	"fmt"
	"os"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

type benchConfig struct {
	restarts   int
	unit       string
	hold       int64
	admissions int
}

func runBench(cfg config, b benchConfig, work string, keep bool) int {
	fmt.Printf("bench: kubelet restart → allocatable; %s, --memory-unit %s, a pod holding %d units, %d restarts\n", cfg.fixture, b.unit, b.hold, b.restarts)
	began := time.Now()
	c, err := up(cfg)
	stop := stopOnSignal(c)
	// Deferred calls run last first: the components stop before the
	// run's directory goes.
	defer func() {
		if keep {
			fmt.Printf("logs and configs kept in %s\n", work)
		} else {
			os.RemoveAll(work)
		}
	}()
	defer stop()
	defer c.down()
	if err != nil {
		fmt.Printf("FAIL cluster up: %v\n", err)
		return 1
	}
	s := &suite{c: c}
	if _, err := s.registersWithin(10 * time.Minute); err != nil {
		fmt.Printf("FAIL registration: %v\n", err)
		return 1
	}
	fmt.Printf("bench: cluster up and %d units allocatable %.1f s after start\n", s.units, time.Since(began).Seconds())
	if b.hold > 0 {
		t := time.Now()
		if err := s.createPod(gpuPod("holder", b.hold)); err != nil {
			fmt.Printf("FAIL holder: %v\n", err)
			return 1
		}
		if _, err := s.waitPhase("holder", corev1.PodRunning, 10*time.Minute); err != nil {
			fmt.Printf("FAIL holder: %v\n", err)
			return 1
		}
		fmt.Printf("bench: pod holding %d units created → Running in %.2f s\n", b.hold, time.Since(t).Seconds())
	}
	for i := 1; i <= b.restarts; i++ {
		c.kubelet.stop(60 * time.Second)
		if err := c.runKubelet(); err != nil {
			fmt.Printf("FAIL restart %d: %v\n", i, err)
			return 1
		}
		started := time.Now()
		took, err := s.waitAllocatableSince(s.units, 10*time.Minute, started)
		if err != nil {
			fmt.Printf("FAIL restart %d: %v\n", i, err)
			return 1
		}
		fmt.Printf("bench: restart %d: allocatable %d again %.2f s after kubelet started\n", i, s.units, took.Seconds())
	}
	return 0
}

// runAdmissionBench times, on the real kubelet and the fake runtime, pod
// created → CreateContainer at the runtime (kubelet admitted it and had its
// devices' answer) → Running: n pods of one unit through the device plugin
// (bound to the node by name, so the scheduler is not in it), then n pods
// each with a 1Gi claim from a template through the DRA driver (the
// controller-manager makes the claim, kube-scheduler allocates it, kubelet
// has the driver prepare it).
func runAdmissionBench(plugin, dra config, n int, work string, keep bool) int {
	defer func() {
		if keep {
			fmt.Printf("logs and configs kept in %s\n", work)
		} else {
			os.RemoveAll(work)
		}
	}()
	fmt.Printf("bench: pod created → container created → Running; %d pods per front end, %s\n", n, plugin.fixture)
	code := 0
	for _, fe := range []struct {
		name      string
		cfg       config
		ready     func(*suite) error
		pod       func(*suite, int) (*corev1.Pod, error)
		container string
	}{
		{"device plugin, 1 unit", plugin, func(s *suite) error { _, err := s.registersWithin(time.Minute); return err },
			func(_ *suite, i int) (*corev1.Pod, error) { return gpuPod(fmt.Sprintf("adm-%d", i), 1), nil }, "main"},
		{"DRA driver, a 1Gi claim from a template", dra, (*suite).draBenchReady, (*suite).draBenchPod, "cuda"},
	} {
		if err := benchAdmissions(fe.name, fe.cfg, n, fe.ready, fe.pod, fe.container); err != nil {
			fmt.Printf("FAIL %s: %v\n", fe.name, err)
			code = 1
		}
	}
	return code
}

func benchAdmissions(name string, cfg config, n int, ready func(*suite) error, newPod func(*suite, int) (*corev1.Pod, error), container string) error {
	c, err := up(cfg)
	stop := stopOnSignal(c)
	defer stop()
	defer c.down()
	if err != nil {
		return err
	}
	s := &suite{c: c}
	if err := ready(s); err != nil {
		return err
	}
	var toCreate, toRunning []time.Duration
	for i := 1; i <= n; i++ {
		pod, err := newPod(s, i)
		if err != nil {
			return err
		}
		began := time.Now()
		if err := s.createPod(pod); err != nil {
			return err
		}
		var created time.Duration
		for {
			if created == 0 && len(c.runtime.createdFor(namespace, pod.Name, container)) > 0 {
				created = time.Since(began)
			}
			p, err := c.admin.CoreV1().Pods(namespace).Get(ctx, pod.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if p.Status.Phase == corev1.PodRunning && created > 0 {
				toCreate, toRunning = append(toCreate, created), append(toRunning, time.Since(began))
				break
			}
			if time.Since(began) > 2*time.Minute {
				return fmt.Errorf("pod %s: phase %q after %s", pod.Name, p.Status.Phase, time.Since(began))
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	fmt.Printf("bench: %s: created → container created: %s; → Running: %s\n", name, spread(toCreate), spread(toRunning))
	return nil
}

// spread says the median, least and most of ds.
func spread(ds []time.Duration) string {
	sorted := slices.Clone(ds)
	slices.Sort(sorted)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	return fmt.Sprintf("median %.0f ms (%.0f to %.0f ms, %d pods)", ms(sorted[len(sorted)/2]), ms(sorted[0]), ms(sorted[len(sorted)-1]), len(sorted))
}

// draBenchReady waits for the driver's slice and an untainted node, and
// makes the template the bench's pods claim from.
func (s *suite) draBenchReady() error {
	if _, err := s.draRegisters(); err != nil {
		return err
	}
	if err := s.untainted(); err != nil {
		return err
	}
	template, _, err := s.draExampleObjects()
	if err != nil {
		return err
	}
	template.Name = "bench-1gi"
	template.Spec.Spec.Devices.Requests[0].Exactly.Capacity.Requests["memory"] = resource.MustParse("1Gi")
	_, err = s.c.admin.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, template, metav1.CreateOptions{})
	return err
}

// draBenchPod is dra-example.yaml's first pod, renamed, claiming from the
// bench's template.
func (s *suite) draBenchPod(i int) (*corev1.Pod, error) {
	_, pod, err := s.draExampleObjects()
	if err != nil {
		return nil, err
	}
	pod.Name = fmt.Sprintf("adm-dra-%d", i)
	pod.Namespace = namespace
	pod.Spec.AutomountServiceAccountToken = ptr.To(false)
	pod.Spec.TerminationGracePeriodSeconds = ptr.To[int64](1)
	pod.Spec.ResourceClaims[0].ResourceClaimTemplateName = ptr.To("bench-1gi")
	return pod, nil
}

// draExampleObjects is dra-example.yaml's template and first pod.
func (s *suite) draExampleObjects() (*resourcev1.ResourceClaimTemplate, *corev1.Pod, error) {
	objects, err := s.draExampleDocs()
	if err != nil {
		return nil, nil, err
	}
	var template *resourcev1.ResourceClaimTemplate
	var pod *corev1.Pod
	for _, obj := range objects {
		switch o := obj.(type) {
		case *resourcev1.ResourceClaimTemplate:
			if template == nil {
				template = o
			}
		case *corev1.Pod:
			if pod == nil {
				pod = o
			}
		}
	}
	if template == nil || pod == nil {
		return nil, nil, fmt.Errorf("dra-example.yaml: no template or no pod")
	}
	return template, pod, nil
}
