// The runner: brings up each phase's cluster, runs the scenarios --run
// picks, each on its own, and prints one line per scenario. A scenario
// creates what it needs; what it leaves (pods, claims, templates, a
// restarted gpumem's flags) is removed after it, so that it passes or fails
// the same alone as in the whole suite.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"syscall"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

var ctx = context.Background()

// scenario is one check, named as its line prints it.
type scenario struct {
	name string
	run  func(*suite) (string, error)
}

// suite is the run's tally and the cluster of the phase running now.
type suite struct {
	c              *cluster
	passed, failed int
	// units is the node's, as gpumem advertises them: what the phase's
	// registration check (its gate) found.
	units int64
	// cleanups run after the scenario that registered them, last first.
	cleanups []func() error
	// sweeps: whether what a scenario left is swept after it (not
	// between a story's steps).
	sweeps bool
}

// runPhase brings up ph's cluster and runs its scenarios that match run;
// a phase none of whose scenarios match is left out.
func (s *suite) runPhase(ph phase, run *regexp.Regexp) {
	var picked []scenario
	for i, sc := range ph.scenarios {
		if run.MatchString(sc.name) {
			if ph.story {
				// A story's steps need the ones before them.
				picked = ph.scenarios[:i+1]
			} else {
				picked = append(picked, sc)
			}
		}
	}
	gateReported := run.MatchString(ph.gate.name)
	if !gateReported && len(picked) == 0 {
		return
	}
	fmt.Printf("== %s\n", ph.title)
	began := time.Now()
	c, err := up(ph.cfg)
	stop := stopOnSignal(c)
	defer stop()
	defer c.down()
	if ph.after != nil {
		defer ph.after()
	}
	s.sweeps = !ph.story
	if err != nil {
		s.failed++
		fmt.Printf("FAIL cluster up: %v\n", err)
		return
	}
	fmt.Printf("cluster up in %.1f s (kubernetes %s, runtime: %s)\n", time.Since(began).Seconds(), kubeletVersion(c), runtimeName(c))
	if ph.note != "" {
		fmt.Println(ph.note)
	}
	s.c = c
	gateFailed := ""
	if gateReported {
		if !s.runOne(ph.gate) {
			gateFailed = ph.gate.name + " failed"
		}
	} else if _, _, err := s.attempt(ph.gate); err != nil {
		gateFailed = fmt.Sprintf("%s failed: %v", ph.gate.name, err)
	}
	for _, sc := range picked {
		if gateFailed != "" {
			s.failed++
			fmt.Printf("FAIL %s: not run: %s\n", sc.name, gateFailed)
			continue
		}
		s.runOne(sc)
	}
}

// runOne runs sc and prints its line; it reports whether sc passed.
func (s *suite) runOne(sc scenario) bool {
	detail, took, err := s.attempt(sc)
	if err != nil {
		s.failed++
		fmt.Printf("FAIL %s (%.1f s): %v\n", sc.name, took.Seconds(), err)
		return false
	}
	s.passed++
	fmt.Printf("PASS %s (%.1f s): %s\n", sc.name, took.Seconds(), detail)
	return true
}

// attempt runs sc, then its cleanups and the sweep; a scenario that
// passed but could not be cleaned up after fails. took is sc's own time.
func (s *suite) attempt(sc scenario) (detail string, took time.Duration, err error) {
	s.cleanups = nil
	began := time.Now()
	detail, err = sc.run(s)
	took = time.Since(began)
	var after []error
	for i := len(s.cleanups) - 1; i >= 0; i-- {
		after = append(after, s.cleanups[i]())
	}
	s.cleanups = nil
	if s.sweeps {
		after = append(after, s.sweep())
	}
	if left := errors.Join(after...); left != nil {
		if err == nil {
			return "", took, fmt.Errorf("cleaning up: %w", left)
		}
		err = fmt.Errorf("%w; cleaning up: %v", err, left)
	}
	return detail, took, err
}

// cleanup has fn run after the current scenario (before the sweep): for
// what the sweep does not know, such as gpumem's flags or processes the
// scenario started.
func (s *suite) cleanup(fn func() error) {
	s.cleanups = append(s.cleanups, fn)
}

// sweep removes what a scenario left in the namespace: its pods, then
// its claims and claim templates; waits for gpumem to hold nothing; and
// forgets the fake runtime's record, whose counts are per scenario.
func (s *suite) sweep() error {
	pods := s.c.admin.CoreV1().Pods(namespace)
	claims := s.c.admin.ResourceV1().ResourceClaims(namespace)
	templates := s.c.admin.ResourceV1().ResourceClaimTemplates(namespace)
	if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		return err
	}
	if err := waitFor(120*time.Second, "the scenario's pods gone", func() (bool, error) {
		list, err := pods.List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		var left []string
		for _, p := range list.Items {
			left = append(left, p.Name)
		}
		return len(left) == 0, fmt.Errorf("left: %s", strings.Join(left, ", "))
	}); err != nil {
		return err
	}
	for _, del := range []func() error{
		func() error { return templates.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}) },
		func() error { return claims.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}) },
	} {
		if err := del(); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	if err := waitFor(120*time.Second, "the scenario's claims gone", func() (bool, error) {
		list, err := claims.List(ctx, metav1.ListOptions{})
		if err != nil {
			return apierrors.IsNotFound(err), err
		}
		return len(list.Items) == 0, fmt.Errorf("%d claims left", len(list.Items))
	}); err != nil {
		return err
	}
	if err := waitFor(60*time.Second, "gpumem holding nothing", func() (bool, error) {
		st, err := s.gpumemStatus()
		if err != nil {
			return false, err
		}
		return len(st.Containers) == 0 && len(st.Claims) == 0, fmt.Errorf("/status lists %d containers, %d claims", len(st.Containers), len(st.Claims))
	}); err != nil {
		return err
	}
	if s.c.runtime != nil {
		s.c.runtime.forget()
	}
	return nil
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
	node, err := c.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
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
	node, err := c.admin.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return "?"
	}
	return node.Status.NodeInfo.KubeletVersion
}
