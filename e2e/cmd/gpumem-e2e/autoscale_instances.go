// The autoscale phase's "cloud": instances that are nodes of the phase's
// cluster on this machine, each a container runtime, a kubelet in its own
// mount namespace and gpumem started as its DaemonSet's manifest starts it
// (cluster.go), registering as a cloud's instance does for Karpenter (a
// provider ID, the NodeClaim's labels and taints). Karpenter's cloud
// provider (e2e/autoscale) reaches them through the HTTP API served here on
// a unix socket; its comment lists the calls.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

const providerPrefix = "gpumem-e2e://"

// instanceType is what the provider is told of a type. These types are the
// API's JSON, written again in e2e/autoscale/provider.go: that module pins
// Karpenter's Kubernetes versions and cannot import this one.
type instanceType struct {
	Name     string              `json:"name"`
	Price    float64             `json:"price"`
	Zone     string              `json:"zone"`
	Capacity corev1.ResourceList `json:"capacity"`
	DRA      *sliceTemplate      `json:"dra,omitempty"`
}

type sliceTemplate struct {
	Driver  string              `json:"driver"`
	Pool    string              `json:"pool"`
	Devices []resourcev1.Device `json:"devices"`
}

type launchRequest struct {
	Name         string            `json:"name"`
	InstanceType string            `json:"instanceType"`
	Labels       map[string]string `json:"labels"`
	Taints       []corev1.Taint    `json:"taints"`
}

type instanceInfo struct {
	Name         string            `json:"name"`
	ProviderID   string            `json:"providerID"`
	InstanceType string            `json:"instanceType"`
	Labels       map[string]string `json:"labels"`
	Created      time.Time         `json:"created"`
}

// instanceKind is an instance type and how its nodes run gpumem.
type instanceKind struct {
	instanceType
	fixture  string // gpumem's --fake-gpus
	manifest string // daemonset/gpumem.yaml or gpumem-dra.yaml
}

type instance struct {
	info    instanceInfo
	kind    *instanceKind
	c       *cluster
	booted  chan struct{} // closed when the boot ended
	bootErr error
}

// cloud launches and stops instances for Karpenter's provider.
type cloud struct {
	base       *cluster // the control plane's
	kinds      map[string]*instanceKind
	gpumemArgs []string // appended to every node's gpumem
	server     *http.Server
	socket     string

	boot      sync.Mutex // one boot at a time: the CA's serial numbers
	mu        sync.Mutex
	instances map[string]*instance
	launched  []string // every instance's name, in launch order
}

func newCloud(base *cluster, kinds []*instanceKind, gpumemArgs []string) (*cloud, error) {
	cl := &cloud{base: base, kinds: map[string]*instanceKind{}, gpumemArgs: gpumemArgs, instances: map[string]*instance{}}
	for _, k := range kinds {
		cl.kinds[k.Name] = k
	}
	cl.socket = base.path("instances.sock")
	_ = os.Remove(cl.socket)
	l, err := net.Listen("unix", cl.socket)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /instance-types", func(w http.ResponseWriter, _ *http.Request) {
		var types []instanceType
		for _, k := range kinds {
			types = append(types, k.instanceType)
		}
		reply(w, types, nil)
	})
	mux.HandleFunc("GET /instances", func(w http.ResponseWriter, _ *http.Request) {
		reply(w, cl.list(), nil)
	})
	mux.HandleFunc("POST /instances", func(w http.ResponseWriter, r *http.Request) {
		var req launchRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		info, err := cl.launch(req)
		reply(w, info, err)
	})
	mux.HandleFunc("GET /instances/{name}", func(w http.ResponseWriter, r *http.Request) {
		cl.mu.Lock()
		inst := cl.instances[r.PathValue("name")]
		cl.mu.Unlock()
		if inst == nil {
			http.NotFound(w, r)
			return
		}
		reply(w, inst.info, nil)
	})
	mux.HandleFunc("DELETE /instances/{name}", func(w http.ResponseWriter, r *http.Request) {
		if !cl.terminate(r.PathValue("name")) {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	cl.server = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = cl.server.Serve(l) }()
	return cl, nil
}

func reply(w http.ResponseWriter, v any, err error) {
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

func (cl *cloud) list() []instanceInfo {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	out := []instanceInfo{}
	for _, inst := range cl.instances {
		out = append(out, inst.info)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out
}

// launch records the instance and boots it in the background, as a cloud
// answers a launch before the machine is up.
func (cl *cloud) launch(req launchRequest) (instanceInfo, error) {
	kind := cl.kinds[req.InstanceType]
	if kind == nil {
		return instanceInfo{}, fmt.Errorf("no instance type %q", req.InstanceType)
	}
	if req.Name == "" || strings.ContainsAny(req.Name, "/ ") {
		return instanceInfo{}, fmt.Errorf("bad instance name %q", req.Name)
	}
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if inst := cl.instances[req.Name]; inst != nil {
		return inst.info, nil // a retried launch
	}
	inst := &instance{
		info: instanceInfo{Name: req.Name, ProviderID: providerPrefix + req.Name, InstanceType: kind.Name,
			Labels: req.Labels, Created: time.Now()},
		kind:   kind,
		booted: make(chan struct{}),
	}
	cl.instances[req.Name] = inst
	cl.launched = append(cl.launched, req.Name)
	go func() {
		defer close(inst.booted)
		cl.boot.Lock()
		defer cl.boot.Unlock()
		inst.bootErr = cl.bootNode(inst, req)
		if inst.bootErr != nil {
			fmt.Fprintf(os.Stderr, "gpumem-e2e: instance %s: %v\n", req.Name, inst.bootErr)
		}
	}()
	return inst.info, nil
}

// kubeletLabels are the labels kubelet itself may set (--node-labels,
// NodeRestriction): Karpenter adds the others when the node registers.
func kubeletLabels(labels map[string]string) string {
	var out []string
	for k, v := range labels {
		domain, _, ok := strings.Cut(k, "/")
		restricted := ok && (strings.HasSuffix(domain, "kubernetes.io") || strings.HasSuffix(domain, "k8s.io"))
		if !restricted {
			out = append(out, k+"="+v)
		}
	}
	sort.Strings(out)
	return strings.Join(out, ",")
}

func (cl *cloud) bootNode(inst *instance, req launchRequest) error {
	base := cl.base
	cfg := base.cfg
	cfg.noNode = false
	cfg.fixture = inst.kind.fixture
	cfg.manifest = inst.kind.manifest
	cfg.work = base.path("instances", req.Name)
	c := &cluster{cfg: cfg, node: req.Name, pki: base.pki, server: base.server, admin: base.admin, saKey: base.saKey}
	c.logs = c.path("logs")
	c.kubeletRoot = c.path("kubelet")
	c.kubeletLogDir = c.path("var-log")
	c.stateDir = c.path("gpumem-state")
	for _, d := range []string{c.logs, c.path("kubelet-cwd"), filepath.Join(c.kubeletRoot, "device-plugins"), c.kubeletLogDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	// YAML takes JSON's arrays as they are.
	taints, err := json.Marshal(req.Taints)
	if err != nil {
		return err
	}
	c.kubeletConfig = fmt.Sprintf("providerID: %q\nregisterWithTaints: %s\n", inst.info.ProviderID, taints)
	c.gpumemFlags = cl.gpumemArgs
	if l := kubeletLabels(req.Labels); l != "" {
		c.kubeletFlags = []string{"--node-labels=" + l}
	}
	cl.mu.Lock()
	inst.c = c
	cl.mu.Unlock()
	for _, step := range []struct {
		what string
		run  func() error
	}{{"container runtime", c.startRuntime}, {"kubelet", c.startKubelet}, {"gpumem", c.startGpumem}} {
		if err := step.run(); err != nil {
			return fmt.Errorf("%s: %w (logs in %s)", step.what, err, c.logs)
		}
	}
	return nil
}

// terminate stops an instance's gpumem, kubelet and runtime; false when
// there is no such instance.
func (cl *cloud) terminate(name string) bool {
	cl.mu.Lock()
	inst := cl.instances[name]
	delete(cl.instances, name)
	cl.mu.Unlock()
	if inst == nil {
		return false
	}
	<-inst.booted
	if inst.c != nil {
		inst.c.down()
	}
	return true
}

// node is the running instance of that name, once booted.
func (cl *cloud) node(name string) (*instance, error) {
	cl.mu.Lock()
	inst := cl.instances[name]
	cl.mu.Unlock()
	if inst == nil {
		return nil, fmt.Errorf("no instance %s", name)
	}
	select {
	case <-inst.booted:
	case <-time.After(3 * time.Minute):
		return nil, fmt.Errorf("instance %s not booted in 3 min", name)
	}
	if inst.bootErr != nil {
		return nil, fmt.Errorf("instance %s: %w", name, inst.bootErr)
	}
	return inst, nil
}

func (cl *cloud) launchedCount() int {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	return len(cl.launched)
}

func (cl *cloud) bootErrors() error {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	var errs []error
	for _, inst := range cl.instances {
		select {
		case <-inst.booted:
			if inst.bootErr != nil {
				errs = append(errs, fmt.Errorf("%s: %w", inst.info.Name, inst.bootErr))
			}
		default:
		}
	}
	return errors.Join(errs...)
}

// stop terminates every instance and stops serving.
func (cl *cloud) stop() {
	_ = cl.server.Close()
	for _, info := range cl.list() {
		cl.terminate(info.Name)
	}
}

// nodeTemplate is `gpumem node-template -o json`: what a node of these GPUs
// will offer, worked out by the plugin's own code: the device plugin's
// capacity, and the devices of the DRA driver's ResourceSlice.
func nodeTemplate(gpumem, fixture string) (corev1.ResourceList, []resourcev1.Device, error) {
	out, err := runCmd(gpumem, "node-template", "--fake-gpus", fixture, "-o", "json")
	if err != nil {
		return nil, nil, fmt.Errorf("gpumem node-template --fake-gpus %s: %w: %s", fixture, err, out)
	}
	var tmpl struct {
		Capacity   map[string]string   `json:"capacity"`
		DRADevices []resourcev1.Device `json:"draDevices"`
	}
	if err := json.Unmarshal([]byte(out), &tmpl); err != nil {
		return nil, nil, fmt.Errorf("gpumem node-template -o json: %w: %s", err, out)
	}
	if len(tmpl.DRADevices) == 0 {
		return nil, nil, fmt.Errorf("gpumem node-template -o json: no draDevices: %s", out)
	}
	capacity := corev1.ResourceList{}
	for k, v := range tmpl.Capacity {
		q, err := resource.ParseQuantity(v)
		if err != nil {
			return nil, nil, fmt.Errorf("gpumem node-template: %s=%q: %w", k, v, err)
		}
		capacity[corev1.ResourceName(k)] = q
	}
	return capacity, tmpl.DRADevices, nil
}
