// The second scheduler of daemonset/second-scheduler.yaml: its replicas run
// here as processes, each a kube-scheduler from the manifest's ConfigMap
// with its own `gpumem extender` on loopback (the pod's two containers),
// under the manifest's service account and RBAC. Pods that name it in
// schedulerName are its; the default scheduler leaves them alone.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
)

// schedulerPod is one replica: its scheduler and its extender.
type schedulerPod struct {
	name                string
	ns                  string // the Deployment's, where its Lease is
	scheduler, extender *proc
}

// acquired reports whether this replica's scheduler logged taking the lease.
func (r *schedulerPod) acquired(logs string) bool {
	data, err := os.ReadFile(filepath.Join(logs, r.name+".log"))
	// klog: "Successfully acquired lease" (structured) or "successfully acquired lease …".
	return err == nil && strings.Contains(strings.ToLower(string(data)), "successfully acquired lease")
}

// secondSchedulerManifest: the ConfigMap's configuration, the
// Deployment's pod and namespace, after applying the manifest's RBAC.
func (s *suite) secondSchedulerManifest() (string, string, *corev1.PodSpec, error) {
	path := s.c.cfg.secondScheduler
	ns, spec, err := s.c.applyManifest(path)
	if err != nil {
		return "", "", nil, err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return "", "", nil, err
	}
	for _, doc := range strings.Split(string(data), "\n---") {
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if cm, ok := obj.(*corev1.ConfigMap); err == nil && ok {
			return cm.Data["config.yaml"], ns, spec, nil
		}
	}
	return "", "", nil, fmt.Errorf("%s: no ConfigMap with config.yaml", path)
}

// startSecondSchedulers runs the Deployment's two replicas, stopped again
// after the scenario; each is named for a log no earlier replica of this
// cluster wrote, so that its log says what it alone did.
func (s *suite) startSecondSchedulers(config, ns string, spec *corev1.PodSpec) ([]*schedulerPod, error) {
	var replicas []*schedulerPod
	s.cleanup(func() error {
		for _, r := range replicas {
			r.extender.stop(10 * time.Second)
			r.scheduler.stop(10 * time.Second)
		}
		return nil
	})
	for i := 0; len(replicas) < 2; i++ {
		name := fmt.Sprintf("gpumem-scheduler-%d", i)
		if _, err := os.Stat(filepath.Join(s.c.logs, name+".log")); err == nil {
			continue
		}
		r, err := s.startSecondScheduler(name, config, ns, spec)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.c.cfg.secondScheduler, err)
		}
		replicas = append(replicas, r)
	}
	return replicas, nil
}

// startSecondScheduler runs replica name as the Deployment's pod runs: the
// extender's command and args (its loopback port moved to a free one),
// kube-scheduler's command with the ConfigMap's configuration, that port
// and the service account's kubeconfig.
func (s *suite) startSecondScheduler(name, config, ns string, spec *corev1.PodSpec) (*schedulerPod, error) {
	c := s.c
	r := &schedulerPod{name: name, ns: ns}
	kc, err := c.tokenConfig(ns, spec.ServiceAccountName, r.name)
	if err != nil {
		return nil, err
	}
	ext, err := containerNamed(spec, "extender")
	if err != nil {
		return nil, err
	}
	sched, err := containerNamed(spec, "kube-scheduler")
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	shipped := ""
	argv := []string{c.cfg.gpumem}
	for _, a := range append(ext.Command[1:], ext.Args...) {
		if strings.HasPrefix(a, "--listen-addr=") {
			shipped = strings.TrimPrefix(a, "--listen-addr=")
			a = fmt.Sprintf("--listen-addr=127.0.0.1:%d", port)
		}
		argv = append(argv, a)
	}
	if !strings.HasPrefix(shipped, "127.0.0.1:") {
		return nil, fmt.Errorf("the extender listens on %q, not on loopback only", shipped)
	}
	if !strings.Contains(config+"\n", "urlPrefix: http://"+shipped+"\n") {
		return nil, fmt.Errorf("the scheduler's configuration does not reach the extender at http://%s", shipped)
	}
	if strings.Contains(config, "clientConnection:") {
		return nil, fmt.Errorf("the configuration names a kubeconfig: in the pod, the service account's is used")
	}
	body := strings.Replace(strings.TrimRight(config, "\n"), "http://"+shipped, fmt.Sprintf("http://127.0.0.1:%d", port), 1) +
		fmt.Sprintf("\nclientConnection:\n  kubeconfig: %s\n", kc)
	cfgPath := c.path(r.name + "-config.yaml")
	if err := os.WriteFile(cfgPath, []byte(body), 0o644); err != nil {
		return nil, err
	}
	if r.extender, err = start(c.logs, r.name+"-extender", "", nil, append(argv, "--kubeconfig="+kc)...); err != nil {
		return nil, err
	}
	c.extra = append(c.extra, r.extender)
	secure, err := freePort()
	if err != nil {
		return nil, err
	}
	sargv := []string{filepath.Join(c.cfg.bin, "kube-scheduler")}
	for _, a := range sched.Command[1:] {
		if strings.HasPrefix(a, "--config=") {
			a = "--config=" + cfgPath
		}
		sargv = append(sargv, a)
	}
	sargv = append(sargv, "--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", secure),
		"--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc, "--v=2")
	if r.scheduler, err = start(c.logs, r.name, "", nil, sargv...); err != nil {
		return nil, err
	}
	c.extra = append(c.extra, r.scheduler)
	return r, nil
}

// leaseHolder waits until exactly one running replica has taken the lease
// and the Lease names a holder; it returns that replica.
func (s *suite) leaseHolder(replicas []*schedulerPod, ns, lease string, timeout time.Duration) (*schedulerPod, error) {
	var holder *schedulerPod
	err := waitFor(timeout, "a second-scheduler replica holding the lease", func() (bool, error) {
		holder = nil
		n := 0
		running := 0
		for _, r := range replicas {
			if r.scheduler.exited() {
				continue
			}
			running++
			if r.acquired(s.c.logs) {
				holder = r
				n++
			}
		}
		if running == 0 {
			return false, fatal{fmt.Errorf("no replica runs (logs in %s)", s.c.logs)}
		}
		if n > 1 {
			return false, fatal{fmt.Errorf("%d running replicas took the lease", n)}
		}
		l, err := s.c.admin.CoordinationV1().Leases(ns).Get(ctx, lease, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if holder == nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
			return false, fmt.Errorf("no running replica holds Lease %s/%s", ns, lease)
		}
		return true, nil
	})
	return holder, err
}

func schedulerPodFor(name string, units int64) *corev1.Pod {
	p := gpuPod(name, units)
	p.Spec.NodeName = ""
	p.Spec.SchedulerName = "gpumem-scheduler"
	return p
}

func (s *suite) secondScheduler() (string, error) {
	config, ns, spec, err := s.secondSchedulerManifest()
	if err != nil {
		return "", err
	}
	if !strings.Contains(config, "schedulerName: gpumem-scheduler\n") || !strings.Contains(config, "resourceName: gpumem-scheduler\n") {
		return "", fmt.Errorf("the configuration has no profile gpumem-scheduler or no Lease of that name:\n%s", config)
	}
	// Before the second scheduler runs: the default scheduler schedules a
	// pod created after this one, and leaves this one untouched.
	if err := s.createPod(schedulerPodFor("second-1", 4)); err != nil {
		return "", err
	}
	control := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "default-control", Namespace: namespace},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers:                    []corev1.Container{{Name: "main", Image: "registry.invalid/e2e/cuda-app:1"}},
		},
	}
	if err := s.createPod(control); err != nil {
		return "", err
	}
	if err := waitFor(60*time.Second, "default-control bound by the default scheduler", func() (bool, error) {
		p, err := s.c.admin.CoreV1().Pods(namespace).Get(ctx, control.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return p.Spec.NodeName != "", nil
	}); err != nil {
		return "", err
	}
	p, err := s.c.admin.CoreV1().Pods(namespace).Get(ctx, "second-1", metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	if p.Spec.NodeName != "" || len(p.Status.Conditions) != 0 {
		return "", fmt.Errorf("the default scheduler touched a gpumem-scheduler pod: node %q, conditions %v", p.Spec.NodeName, p.Status.Conditions)
	}
	if err := s.c.admin.CoreV1().Pods(namespace).Delete(ctx, control.Name, metav1.DeleteOptions{}); err != nil {
		return "", err
	}

	replicas, err := s.startSecondSchedulers(config, ns, spec)
	if err != nil {
		return "", err
	}
	holder, err := s.leaseHolder(replicas, ns, "gpumem-scheduler", 60*time.Second)
	if err != nil {
		return "", err
	}
	idx, err := s.extenderRan("second-1", 4)
	if err != nil {
		return "", err
	}
	var waiting string
	for _, r := range replicas {
		if r != holder {
			if r.scheduler.exited() {
				return "", fmt.Errorf("%s exited: %v", r.name, r.scheduler.err)
			}
			waiting = r.name
		}
	}
	return fmt.Sprintf("%s holds Lease %s/gpumem-scheduler, %s waits; second-1 bound through the extender to GPU%s and running there; the default scheduler bound a pod created after it and left it", holder.name, ns, waiting, idx), nil
}

// secondSchedulerHandover starts the two replicas and waits for one to
// hold the lease, then kills it.
func (s *suite) secondSchedulerHandover() (string, error) {
	config, ns, spec, err := s.secondSchedulerManifest()
	if err != nil {
		return "", err
	}
	replicas, err := s.startSecondSchedulers(config, ns, spec)
	if err != nil {
		return "", err
	}
	if _, err := s.leaseHolder(replicas, ns, "gpumem-scheduler", 60*time.Second); err != nil {
		return "", err
	}
	holder, err := s.leaseHolder(replicas, ns, "gpumem-scheduler", 10*time.Second)
	if err != nil {
		return "", err
	}
	before, err := s.c.admin.CoordinationV1().Leases(ns).Get(ctx, "gpumem-scheduler", metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	// The pod dies at once, as on a lost node: its Lease is not released
	// and runs out.
	for _, p := range []*proc{holder.scheduler, holder.extender} {
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	next, err := s.leaseHolder(replicas, ns, "gpumem-scheduler", 60*time.Second)
	if err != nil {
		return "", err
	}
	after, err := s.c.admin.CoordinationV1().Leases(ns).Get(ctx, "gpumem-scheduler", metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	if *after.Spec.HolderIdentity == *before.Spec.HolderIdentity {
		return "", fmt.Errorf("the Lease still names %s", *before.Spec.HolderIdentity)
	}
	if err := s.createPod(schedulerPodFor("second-2", 4)); err != nil {
		return "", err
	}
	idx, err := s.extenderRan("second-2", 4)
	if err != nil {
		return "", err
	}
	if err := s.c.admin.CoreV1().Pods(namespace).Delete(ctx, "second-2", metav1.DeleteOptions{}); err != nil {
		return "", err
	}
	return fmt.Sprintf("%s killed; %s took the Lease (holder %s → %s) and bound second-2 to GPU%s", holder.name, next.name, *before.Spec.HolderIdentity, *after.Spec.HolderIdentity, idx), nil
}
