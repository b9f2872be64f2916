// The autoscale phase: Karpenter's own controllers (e2e/autoscale, built
// from sigs.k8s.io/karpenter) scale a cluster of gpumem nodes from zero and
// back. The cluster starts with no node; Karpenter's cloud provider asks
// the runner for instances (autoscale_instances.go), which are real
// kubelets running gpumem as its DaemonSet does. Each scenario prints what
// a user would time: first Pending pod → all Running and capped, nodes
// launched, last pod gone → node gone.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
)

var autoscaleFlags struct {
	karpenter  string
	crds       string
	gpumemArgs string
}

func init() {
	flag.StringVar(&autoscaleFlags.karpenter, "karpenter", "", "the autoscale phase's Karpenter (e2e/autoscale; default: --bin's gpumem-karpenter)")
	flag.StringVar(&autoscaleFlags.crds, "karpenter-crds", "", "directory of Karpenter's CRDs, from its module (default: --bin's karpenter-crds)")
	flag.StringVar(&autoscaleFlags.gpumemArgs, "autoscale-gpumem-args", "", "more gpumem flags on the autoscale phase's nodes, space-separated (e.g. --startup-taint= to watch the phase fail when gpumem leaves its startup taint)")
}

const (
	startupTaintKey = "gpumem.io/not-ready"
	nodePoolLabel   = "karpenter.sh/nodepool"
	t4Type          = "gpu-t4"
	v100Type        = "gpu-v100x2"
	v100DRAType     = "gpu-v100x2-dra"
)

var (
	nodePoolGVR  = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1", Resource: "nodepools"}
	nodeClaimGVR = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1", Resource: "nodeclaims"}
	nodeClassGVR = schema.GroupVersionResource{Group: "karpenter.kwok.sh", Version: "v1alpha1", Resource: "kwoknodeclasses"}
	overlayGVR   = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1alpha1", Resource: "nodeoverlays"}
	crdGVR       = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
)

type autoscaler struct {
	*suite
	cloud     *cloud
	karpenter *proc
	dyn       dynamic.Interface
	kinds     []*instanceKind
	// The scale-up scenarios' nodes, for the scale-down one.
	firstNode, secondNode string
	firstPods             []string
	notebook              string
	// The DRA scale-up's node and pods, for the per-GPU fit.
	draNode string
	draPods []string
}

// autoscalePhase is Karpenter's story on a control plane with no node:
// its steps build on each other (the second node joins the first, the
// scale-down removes both, the fit scenarios run beside the DRA node's
// pods), so the phase is a story: --run runs it up to the last step it
// picks, and no sweep runs between steps.
func autoscalePhase(cfg config) phase {
	a := &autoscaler{}
	step := func(fn func() (string, error)) func(*suite) (string, error) {
		return func(s *suite) (string, error) {
			a.suite = s
			return fn()
		}
	}
	return phase{
		name:  "autoscale",
		title: "Karpenter scales gpumem nodes from zero and back (its controllers, nodes of kubelet and gpumem)",
		cfg:   cfg,
		gate:  scenario{"Karpenter's controllers run, instance types from gpumem node-template", step(a.up)},
		scenarios: []scenario{
			{"scale up from zero, device plugin: three 4-unit pods bring up one T4 node and run capped; Karpenter waits for gpumem's startup taint", step(a.scaleUpFromZero)},
			{"a fourth 4-unit pod brings up a second T4 node", step(a.scaleUpSecond)},
			{"scale down: the idle node is consolidated away, the node with a running notebook is not; then none is left", step(a.scaleDown)},
			{"scale up from zero, DRA: six 4Gi claims bring up one two-V100 node, packed three to a GPU", step(a.scaleUpDRA)},
			{"device plugin: 15 units fit the node's free sum but no GPU: the pod fails admission, no node is launched", step(a.fragmentedPlugin)},
			{"DRA: a 15Gi claim that fits no GPU with room stays Pending and brings up a node where it fits", step(a.fragmentedDRA)},
		},
		story: true,
		after: a.stop,
	}
}

// stop ends Karpenter first, so that it launches nothing more, then every
// instance.
func (a *autoscaler) stop() {
	a.karpenter.stop(10 * time.Second)
	if a.cloud != nil {
		a.cloud.stop()
	}
}

// up starts Karpenter over an empty cluster: its CRDs from its module, a
// NodeClass, and the instance types gpumem-e2e offers.
func (a *autoscaler) up() (string, error) {
	c := a.c
	bin := c.cfg.bin
	karpenter, crds := autoscaleFlags.karpenter, autoscaleFlags.crds
	if karpenter == "" {
		karpenter = filepath.Join(bin, "gpumem-karpenter")
	}
	if crds == "" {
		crds = filepath.Join(bin, "karpenter-crds")
	}
	if _, err := os.Stat(karpenter); err != nil {
		return "", fmt.Errorf("%w (e2e/build.sh builds it from e2e/autoscale)", err)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", c.path("admin.kubeconfig"))
	if err != nil {
		return "", err
	}
	if a.dyn, err = dynamic.NewForConfig(rc); err != nil {
		return "", err
	}
	var described []string
	fixtures := filepath.Dir(c.cfg.fixture)
	for _, k := range []struct {
		name, fixture string
		price         float64
		dra           bool
	}{
		// The T4 type's GPU capacity comes from a NodeOverlay, as with a
		// cloud provider that knows only nvidia.com/gpu; the V100s' from
		// the provider itself.
		{t4Type, c.cfg.fixture, 0.526, false},
		{v100Type, filepath.Join(fixtures, "v100x2.toml"), 2.48, false},
		{v100DRAType, filepath.Join(fixtures, "v100x2.toml"), 2.48, true},
	} {
		capacity, devices, err := nodeTemplate(c.cfg.gpumem, k.fixture)
		if err != nil {
			return "", err
		}
		kind := &instanceKind{
			instanceType: instanceType{Name: k.name, Price: k.price, Zone: "e2e-zone-a", Capacity: corev1.ResourceList{}},
			fixture:      k.fixture,
			manifest:     c.cfg.manifest,
		}
		if k.dra {
			// The DRA driver advertises no extended resource: its
			// ResourceSlice, templated for Karpenter's claim simulation.
			kind.manifest = a.draManifest()
			kind.DRA = &sliceTemplate{Driver: draDriver, Pool: "template", Devices: devices}
			var each []string
			for _, d := range devices {
				m := d.Capacity["memory"]
				each = append(each, fmt.Sprintf("%s memory %s (allowMultipleAllocations %v)", d.Name, m.Value.String(), d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations))
			}
			described = append(described, fmt.Sprintf("%s slice template %s", k.name, strings.Join(each, ", ")))
		} else if k.name != t4Type {
			kind.Capacity = capacity
			described = append(described, fmt.Sprintf("%s %s=%s %s=%s", k.name,
				resourceName, capacity.Name(resourceName, "").String(), "aliyun.com/gpu-count", capacity.Name("aliyun.com/gpu-count", "").String()))
		}
		for name, q := range map[corev1.ResourceName]string{corev1.ResourceCPU: "2", corev1.ResourceMemory: "4Gi", corev1.ResourcePods: "110"} {
			kind.Capacity[name] = resource.MustParse(q)
		}
		a.kinds = append(a.kinds, kind)
	}
	if a.cloud, err = newCloud(c, a.kinds, strings.Fields(autoscaleFlags.gpumemArgs)); err != nil {
		return "", err
	}
	if err := a.applyCRDs(crds); err != nil {
		return "", err
	}
	if err := a.nodeClass(); err != nil {
		return "", err
	}
	metrics, err := freePort()
	if err != nil {
		return "", err
	}
	health, err := freePort()
	if err != nil {
		return "", err
	}
	env := []string{
		"KUBECONFIG=" + c.path("admin.kubeconfig"),
		"GPUMEM_E2E_INSTANCES=" + a.cloud.socket,
		"DISABLE_LEADER_ELECTION=true",
		fmt.Sprintf("METRICS_PORT=%d", metrics),
		fmt.Sprintf("HEALTH_PROBE_PORT=%d", health),
		// Claims are simulated from the instance types' slice templates.
		"IGNORE_DRA_REQUESTS=false",
		"FEATURE_GATES=NodeOverlay=true",
		"LOG_LEVEL=debug",
	}
	if a.karpenter, err = start(c.logs, "karpenter", "", env, karpenter); err != nil {
		return "", err
	}
	c.extra = append(c.extra, a.karpenter)
	readyz := fmt.Sprintf("http://127.0.0.1:%d/readyz", health)
	if err := waitFor(120*time.Second, "Karpenter /readyz", func() (bool, error) {
		if a.karpenter.exited() {
			return false, fatal{fmt.Errorf("exited: %v (log %s)", a.karpenter.err, filepath.Join(c.logs, "karpenter.log"))}
		}
		return httpOK(readyz)
	}); err != nil {
		return "", err
	}
	overlay, err := a.overlay(t4Type, c.cfg.fixture)
	if err != nil {
		return "", err
	}
	described = append(described, overlay)
	return fmt.Sprintf("instance types (gpumem node-template): %s", strings.Join(described, "; ")), nil
}

// overlay applies the NodeOverlay `gpumem node-template -o karpenter`
// prints for an instance type and waits for Karpenter to accept it.
func (a *autoscaler) overlay(instanceType, fixture string) (string, error) {
	out, err := runCmd(a.c.cfg.gpumem, "node-template", "--fake-gpus", fixture, "-o", "karpenter", "--instance-type", instanceType)
	if err != nil {
		return "", fmt.Errorf("gpumem node-template -o karpenter: %w: %s", err, out)
	}
	var obj unstructured.Unstructured
	if err := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(out), 4096).Decode(&obj.Object); err != nil {
		return "", fmt.Errorf("gpumem node-template -o karpenter: %w: %s", err, out)
	}
	if _, err := a.dyn.Resource(overlayGVR).Create(ctx, &obj, metav1.CreateOptions{}); err != nil {
		return "", fmt.Errorf("NodeOverlay from gpumem node-template: %w", err)
	}
	if err := waitFor(60*time.Second, "NodeOverlay "+obj.GetName()+" validated", func() (bool, error) {
		o, err := a.dyn.Resource(overlayGVR).Get(ctx, obj.GetName(), metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		st := conditionStatus(o, "ValidationSucceeded")
		return st == "True", fmt.Errorf("ValidationSucceeded=%q %v", st, condition(o, "ValidationSucceeded"))
	}); err != nil {
		return "", err
	}
	capacity, _, _ := unstructured.NestedStringMap(obj.Object, "spec", "capacity")
	return fmt.Sprintf("%s %s=%s %s=%s from NodeOverlay %s", instanceType, resourceName, capacity[resourceName],
		"aliyun.com/gpu-count", capacity["aliyun.com/gpu-count"], obj.GetName()), nil
}

// applyCRDs creates every CRD of the directory's YAML files and waits for
// each to be served.
func (a *autoscaler) applyCRDs(dir string) error {
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return fmt.Errorf("no CRDs in %s (e2e/build.sh copies them from Karpenter's module)", dir)
	}
	var names []string
	for _, f := range files {
		data, err := os.Open(f)
		if err != nil {
			return err
		}
		var obj unstructured.Unstructured
		err = utilyaml.NewYAMLOrJSONDecoder(data, 4096).Decode(&obj.Object)
		data.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		if _, err := a.dyn.Resource(crdGVR).Create(ctx, &obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("%s: %w", f, err)
		}
		names = append(names, obj.GetName())
	}
	for _, name := range names {
		if err := waitFor(60*time.Second, "CRD "+name+" established", func() (bool, error) {
			crd, err := a.dyn.Resource(crdGVR).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			return conditionStatus(crd, "Established") == "True", nil
		}); err != nil {
			return err
		}
	}
	return nil
}

// nodeClass creates the NodeClass every NodePool names, Ready: the
// instances need no settings, and a cloud's own controller would set its
// status.
func (a *autoscaler) nodeClass() error {
	nc := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "karpenter.kwok.sh/v1alpha1",
		"kind":       "KWOKNodeClass",
		"metadata":   map[string]any{"name": "default"},
	}}
	created, err := a.dyn.Resource(nodeClassGVR).Create(ctx, nc, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	created.Object["status"] = map[string]any{"conditions": []any{map[string]any{
		"type": "Ready", "status": "True", "reason": "Ready", "message": "",
		"lastTransitionTime": time.Now().UTC().Format(time.RFC3339), "observedGeneration": created.GetGeneration(),
	}}}
	_, err = a.dyn.Resource(nodeClassGVR).UpdateStatus(ctx, created, metav1.UpdateOptions{})
	return err
}

// nodePool creates a NodePool of one instance type whose nodes start with
// gpumem's startup taint and go when empty.
func (a *autoscaler) nodePool(name, instanceType, gpushare string) error {
	pool := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "karpenter.sh/v1",
		"kind":       "NodePool",
		"metadata":   map[string]any{"name": name},
		"spec": map[string]any{
			"template": map[string]any{
				"metadata": map[string]any{"labels": map[string]any{"gpushare": gpushare}},
				"spec": map[string]any{
					"nodeClassRef": map[string]any{"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"},
					"requirements": []any{map[string]any{
						"key": "node.kubernetes.io/instance-type", "operator": "In", "values": []any{instanceType},
					}},
					"startupTaints": []any{map[string]any{"key": startupTaintKey, "effect": "NoSchedule"}},
					"expireAfter":   "Never",
				},
			},
			// A node with a notebook stays; an empty one goes soon.
			"disruption": map[string]any{
				"consolidationPolicy": "WhenEmpty",
				"consolidateAfter":    "5s",
				"budgets":             []any{map[string]any{"nodes": "100%"}},
			},
		},
	}}
	if _, err := a.dyn.Resource(nodePoolGVR).Create(ctx, pool, metav1.CreateOptions{}); err != nil {
		return err
	}
	return waitFor(60*time.Second, "NodePool "+name+" Ready", func() (bool, error) {
		p, err := a.dyn.Resource(nodePoolGVR).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		st := conditionStatus(p, "Ready")
		return st == "True", fmt.Errorf("Ready=%q", st)
	})
}

func conditionStatus(obj *unstructured.Unstructured, kind string) string {
	c := condition(obj, kind)
	if c == nil {
		return ""
	}
	s, _ := c["status"].(string)
	return s
}

func condition(obj *unstructured.Unstructured, kind string) map[string]any {
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		if m, ok := c.(map[string]any); ok && m["type"] == kind {
			return m
		}
	}
	return nil
}

// notebook is a 4-unit (or any) GPU pod for the pool's nodes, placed by
// kube-scheduler (no nodeName) and not tolerating the startup taint.
func notebook(name, pool string, units int64) *corev1.Pod {
	p := gpuPod(name, units)
	p.Spec.NodeName = ""
	p.Spec.NodeSelector = map[string]string{nodePoolLabel: pool}
	return p
}

// timeline follows a scale-up: for each node, when it was first seen and
// with which taints, when gpumem's startup taint went and when Karpenter
// called the NodeClaim initialized; and whether anything broke the order a
// user relies on (a pod bound, or the NodeClaim initialized, while the
// taint was still there).
type timeline struct {
	firstSeen, untainted, initialized map[string]time.Time
	taintedAtFirst                    map[string]bool
	reasons                           map[string][]string // Initialized's reasons, as they changed
	violations                        []string
}

func newTimeline() *timeline {
	return &timeline{firstSeen: map[string]time.Time{}, untainted: map[string]time.Time{}, initialized: map[string]time.Time{},
		taintedAtFirst: map[string]bool{}, reasons: map[string][]string{}}
}

func hasTaint(n *corev1.Node, key string) bool {
	for _, t := range n.Spec.Taints {
		if t.Key == key {
			return true
		}
	}
	return false
}

// observe takes one look at nodes, NodeClaims and pods.
func (a *autoscaler) observe(tl *timeline, pods []string) error {
	nodes, err := a.c.admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	now := time.Now()
	tainted := map[string]bool{}
	for i := range nodes.Items {
		n := &nodes.Items[i]
		t := hasTaint(n, startupTaintKey)
		tainted[n.Name] = t
		if _, ok := tl.firstSeen[n.Name]; !ok {
			tl.firstSeen[n.Name], tl.taintedAtFirst[n.Name] = now, t
		}
		if _, ok := tl.untainted[n.Name]; !ok && !t {
			tl.untainted[n.Name] = now
		}
	}
	claims, err := a.dyn.Resource(nodeClaimGVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for i := range claims.Items {
		nc := &claims.Items[i]
		node, _, _ := unstructured.NestedString(nc.Object, "status", "nodeName")
		c := condition(nc, "Initialized")
		if node == "" || c == nil {
			continue
		}
		reason, _ := c["reason"].(string)
		if r := tl.reasons[node]; len(r) == 0 || r[len(r)-1] != reason {
			tl.reasons[node] = append(tl.reasons[node], reason)
		}
		if c["status"] == "True" {
			if _, ok := tl.initialized[node]; !ok {
				tl.initialized[node] = now
				if tainted[node] {
					tl.violations = append(tl.violations, fmt.Sprintf("NodeClaim %s initialized while node %s still had %s", nc.GetName(), node, startupTaintKey))
				}
			}
		}
	}
	for _, name := range pods {
		p, err := a.c.admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			continue
		}
		if n := p.Spec.NodeName; n != "" && tainted[n] {
			tl.violations = append(tl.violations, fmt.Sprintf("pod %s bound to %s while it had %s", name, n, startupTaintKey))
		}
	}
	return nil
}

// runUntilRunning creates pods and waits, observing, until each is Running;
// it returns the time from the first creation.
func (a *autoscaler) runUntilRunning(tl *timeline, pods []*corev1.Pod, timeout time.Duration) (time.Duration, error) {
	var names []string
	began := time.Now()
	for _, p := range pods {
		if err := a.createPod(p); err != nil {
			return 0, err
		}
		names = append(names, p.Name)
	}
	var took time.Duration
	err := waitFor(timeout, "pods "+strings.Join(names, ", ")+" Running", func() (bool, error) {
		if err := a.cloud.bootErrors(); err != nil {
			return false, fatal{err}
		}
		if err := a.observe(tl, names); err != nil {
			return false, err
		}
		for _, n := range names {
			p, err := a.c.admin.CoreV1().Pods(namespace).Get(ctx, n, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if p.Status.Phase != corev1.PodRunning {
				return false, fmt.Errorf("pod %s %s on %q; %s", n, p.Status.Phase, p.Spec.NodeName, a.claimStates())
			}
		}
		took = time.Since(began)
		return true, nil
	})
	return took, err
}

// claimStates says where each NodeClaim stands, for failure messages.
func (a *autoscaler) claimStates() string {
	claims, err := a.dyn.Resource(nodeClaimGVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	if len(claims.Items) == 0 {
		return "no NodeClaims"
	}
	var out []string
	for i := range claims.Items {
		nc := &claims.Items[i]
		var conds []string
		for _, kind := range []string{"Launched", "Registered", "Initialized"} {
			c := condition(nc, kind)
			if c == nil {
				continue
			}
			conds = append(conds, fmt.Sprintf("%s=%v(%v)", kind, c["status"], c["reason"]))
		}
		out = append(out, fmt.Sprintf("NodeClaim %s: %s", nc.GetName(), strings.Join(conds, " ")))
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}

// capped checks what gpumem gave a pod's container on its node: the
// GPUMEM_LIMIT_MIB kubelet passed to the runtime and the cap gpumem lists.
func (a *autoscaler) capped(pod string, units uint64) (uint64, error) {
	p, err := a.c.admin.CoreV1().Pods(namespace).Get(ctx, pod, metav1.GetOptions{})
	if err != nil {
		return 0, err
	}
	inst, err := a.cloud.node(p.Spec.NodeName)
	if err != nil {
		return 0, err
	}
	node := &suite{c: inst.c}
	want, _, err := node.capFor(units)
	if err != nil {
		return 0, err
	}
	created := inst.c.runtime.createdFor(namespace, pod, "main")
	if len(created) != 1 {
		return 0, fmt.Errorf("%d CreateContainer requests for %s/main on %s, want 1", len(created), pod, p.Spec.NodeName)
	}
	if got := envOf(created[0].GetConfig())["GPUMEM_LIMIT_MIB"]; got != fmt.Sprint(want) {
		return 0, fmt.Errorf("%s: GPUMEM_LIMIT_MIB=%q, want %d", pod, got, want)
	}
	// gpumem lists containers from kubelet's pod-resources, which it polls.
	err = waitFor(30*time.Second, "gpumem on "+p.Spec.NodeName+" lists "+pod, func() (bool, error) {
		st, err := node.gpumemStatus()
		if err != nil {
			return false, err
		}
		for _, ctr := range st.Containers {
			if ctr.Pod != nil && *ctr.Pod == pod {
				if ctr.CapMiB != want || uint64(ctr.Units) != units {
					return false, fatal{fmt.Errorf("gpumem on %s lists %s with %d units capped at %d MiB, want %d at %d", p.Spec.NodeName, pod, ctr.Units, ctr.CapMiB, units, want)}
				}
				return true, nil
			}
		}
		return false, nil
	})
	return want, err
}

func (a *autoscaler) nodeOf(pod string) string {
	p, err := a.c.admin.CoreV1().Pods(namespace).Get(ctx, pod, metav1.GetOptions{})
	if err != nil {
		return ""
	}
	return p.Spec.NodeName
}

func (a *autoscaler) scaleUpFromZero() (string, error) {
	if err := a.nodePool("t4", t4Type, "true"); err != nil {
		return "", err
	}
	tl := newTimeline()
	var pods []*corev1.Pod
	for i := 1; i <= 3; i++ {
		p := notebook(fmt.Sprintf("notebook-%d", i), "t4", 4)
		pods = append(pods, p)
		a.firstPods = append(a.firstPods, p.Name)
	}
	took, err := a.runUntilRunning(tl, pods, 5*time.Minute)
	if err != nil {
		return "", fmt.Errorf("%w (Initialized reasons seen: %v)", err, tl.reasons)
	}
	if n := a.cloud.launchedCount(); n != 1 {
		return "", fmt.Errorf("%d nodes launched for three 4-unit pods, want 1 (one T4: 14 units)", n)
	}
	node := a.nodeOf("notebook-1")
	for _, p := range a.firstPods {
		if n := a.nodeOf(p); n != node {
			return "", fmt.Errorf("%s on %q, notebook-1 on %q: want one node", p, n, node)
		}
	}
	a.firstNode = node
	var caps []string
	for _, p := range a.firstPods {
		capMiB, err := a.capped(p, 4)
		if err != nil {
			return "", err
		}
		caps = append(caps, fmt.Sprint(capMiB))
	}
	wait, err := a.waitedForTaint(tl, node)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("first Pending → all Running capped: %.1f s; nodes launched: 1 (%s, %s); caps %s MiB; %s",
		took.Seconds(), node, t4Type, strings.Join(caps, ", "), wait), nil
}

// waitedForTaint checks that node came up with gpumem's startup taint,
// that gpumem removed it, and that Karpenter called the node initialized
// and pods landed only after.
func (a *autoscaler) waitedForTaint(tl *timeline, node string) (string, error) {
	if len(tl.violations) > 0 {
		return "", fmt.Errorf("%s", strings.Join(tl.violations, "; "))
	}
	if !tl.taintedAtFirst[node] {
		return "", fmt.Errorf("node %s was first seen without %s", node, startupTaintKey)
	}
	untainted, ok := tl.untainted[node]
	if !ok {
		return "", fmt.Errorf("node %s still has %s", node, startupTaintKey)
	}
	// kube-scheduler binds once the taints are gone; Karpenter may call
	// the NodeClaim initialized a moment later.
	if err := waitFor(60*time.Second, "NodeClaim of "+node+" initialized", func() (bool, error) {
		if err := a.observe(tl, nil); err != nil {
			return false, err
		}
		_, ok := tl.initialized[node]
		return ok, fmt.Errorf("Initialized reasons %v", tl.reasons[node])
	}); err != nil {
		return "", err
	}
	if len(tl.violations) > 0 {
		return "", fmt.Errorf("%s", strings.Join(tl.violations, "; "))
	}
	initialized := tl.initialized[node]
	inst, err := a.cloud.node(node)
	if err != nil {
		return "", err
	}
	log, err := os.ReadFile(filepath.Join(inst.c.logs, "gpumem.log"))
	if err != nil {
		return "", err
	}
	if !strings.Contains(string(log), "removed the startup taint") {
		return "", fmt.Errorf("gpumem on %s did not log that it removed the startup taint", node)
	}
	return fmt.Sprintf("node registered with %s, gpumem removed it %.1f s after, Karpenter initialized the NodeClaim %.1f s after (Initialized reasons: %s)",
		startupTaintKey, untainted.Sub(tl.firstSeen[node]).Seconds(), initialized.Sub(tl.firstSeen[node]).Seconds(), strings.Join(tl.reasons[node], " → ")), nil
}

func (a *autoscaler) scaleUpSecond() (string, error) {
	tl := newTimeline()
	launched := a.cloud.launchedCount()
	a.notebook = "notebook-4"
	took, err := a.runUntilRunning(tl, []*corev1.Pod{notebook(a.notebook, "t4", 4)}, 5*time.Minute)
	if err != nil {
		return "", err
	}
	if n := a.cloud.launchedCount() - launched; n != 1 {
		return "", fmt.Errorf("%d nodes launched for the fourth pod, want 1", n)
	}
	node := a.nodeOf(a.notebook)
	if node == a.firstNode {
		return "", fmt.Errorf("%s landed on the first node %s, which has 2 units free", a.notebook, node)
	}
	a.secondNode = node
	for _, p := range a.firstPods {
		if n := a.nodeOf(p); n != a.firstNode {
			return "", fmt.Errorf("%s moved to %q", p, n)
		}
	}
	capMiB, err := a.capped(a.notebook, 4)
	if err != nil {
		return "", err
	}
	wait, err := a.waitedForTaint(tl, node)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("Pending → Running capped (%d MiB): %.1f s; nodes launched: 1 more (%s), 2 in all; %s", capMiB, took.Seconds(), node, wait), nil
}

// nodeGone waits until the node, its NodeClaim and its instance are gone.
func (a *autoscaler) nodeGone(node string, timeout time.Duration, keep func() error) error {
	return waitFor(timeout, "node "+node+" consolidated away", func() (bool, error) {
		if keep != nil {
			if err := keep(); err != nil {
				return false, fatal{err}
			}
		}
		_, err := a.c.admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err == nil {
			return false, fmt.Errorf("node %s still there; %s", node, a.claimStates())
		}
		if !apierrors.IsNotFound(err) {
			return false, err
		}
		for _, inst := range a.cloud.list() {
			if inst.Name == node {
				return false, fmt.Errorf("instance %s still running", node)
			}
		}
		return true, nil
	})
}

func (a *autoscaler) scaleDown() (string, error) {
	if a.firstNode == "" || a.secondNode == "" {
		return "", fmt.Errorf("needs the two nodes of the scale-up scenarios")
	}
	for _, p := range a.firstPods {
		if err := a.deletePod(p); err != nil {
			return "", err
		}
	}
	idle := time.Now()
	// The notebook must keep running on its node the whole time.
	notebookRuns := func() error {
		p, err := a.c.admin.CoreV1().Pods(namespace).Get(ctx, a.notebook, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("notebook %s: %w", a.notebook, err)
		}
		if p.Spec.NodeName != a.secondNode || p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
			return fmt.Errorf("notebook %s: %s on %s (deleting: %v), want Running on %s", a.notebook, p.Status.Phase, p.Spec.NodeName, p.DeletionTimestamp != nil, a.secondNode)
		}
		if _, err := a.c.admin.CoreV1().Nodes().Get(ctx, a.secondNode, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("node %s of the running notebook: %w", a.secondNode, err)
		}
		return nil
	}
	if err := a.nodeGone(a.firstNode, 5*time.Minute, notebookRuns); err != nil {
		return "", err
	}
	idleGone := time.Since(idle)
	// Two more of Karpenter's disruption passes (every 10 s) with the
	// notebook's node as a candidate.
	if err := waitFor(25*time.Second, "the notebook's node kept", func() (bool, error) {
		if err := notebookRuns(); err != nil {
			return false, fatal{err}
		}
		return false, nil
	}); err != nil && !strings.Contains(err.Error(), "not within") {
		return "", err
	}
	if err := a.deletePod(a.notebook); err != nil {
		return "", err
	}
	last := time.Now()
	if err := a.nodeGone(a.secondNode, 5*time.Minute, nil); err != nil {
		return "", err
	}
	lastGone := time.Since(last)
	nodes, err := a.c.admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return "", err
	}
	if len(nodes.Items) != 0 {
		return "", fmt.Errorf("%d nodes left, want 0", len(nodes.Items))
	}
	return fmt.Sprintf("pods gone → idle node %s gone: %.1f s (consolidateAfter 5s), %s and its notebook kept 25 s more; notebook gone → %s gone: %.1f s; 0 nodes",
		a.firstNode, idleGone.Seconds(), a.secondNode, a.secondNode, lastGone.Seconds()), nil
}
