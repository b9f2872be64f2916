// A benchmark, not a test: kubelet restart → the node's allocatable back,
// on the real kubelet, as the device count (GiB or MiB units) and the
// units a pod holds grow (issue 33, finding 3). Run by hand; the figures
// go to docs/BENCHMARKS.md.
package main

import (
	"fmt"
	"os"
	"time"

	corev1 "k8s.io/api/core/v1"
)

type benchConfig struct {
	restarts int
	unit     string
	hold     int64
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
