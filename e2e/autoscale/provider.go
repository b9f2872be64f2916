// The cloud provider: Karpenter's CloudProvider interface over the instance
// API gpumem-e2e serves on a unix socket. gpumem-e2e owns the instances (a
// kubelet, a container runtime and gpumem each) and the instance types,
// whose GPU capacity it takes from `gpumem node-template`; this side only
// translates between them and Karpenter's NodeClaims.
//
//	GET    /instance-types   [instanceType]
//	GET    /instances        [instance]
//	POST   /instances        launch → instance
//	GET    /instances/NAME   instance, 404 when there is none
//	DELETE /instances/NAME   stops it; 404 when there is none
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
	"unique"

	"github.com/awslabs/operatorpkg/status"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/karpenter/kwok/apis/v1alpha1"
	v1 "sigs.k8s.io/karpenter/pkg/apis/v1"
	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/controllers/nodeoverlay"
	"sigs.k8s.io/karpenter/pkg/operator/options"
	"sigs.k8s.io/karpenter/pkg/scheduling"
)

const providerPrefix = "gpumem-e2e://"

// instanceType is an instance type as gpumem-e2e describes it.
type instanceType struct {
	Name     string              `json:"name"`
	Price    float64             `json:"price"`
	Zone     string              `json:"zone"`
	Capacity corev1.ResourceList `json:"capacity"`
	// The ResourceSlice gpumem's DRA driver will publish on such a node,
	// for Karpenter's claim simulation; absent for device-plugin types.
	DRA *sliceTemplate `json:"dra,omitempty"`
}

type sliceTemplate struct {
	Driver  string              `json:"driver"`
	Pool    string              `json:"pool"`
	Devices []resourcev1.Device `json:"devices"`
}

// launch asks for an instance of a type, its Node registering with these
// labels and taints (as a cloud's user data has kubelet do).
type launch struct {
	Name         string            `json:"name"`
	InstanceType string            `json:"instanceType"`
	Labels       map[string]string `json:"labels"`
	Taints       []corev1.Taint    `json:"taints"`
}

type instance struct {
	Name         string            `json:"name"`
	ProviderID   string            `json:"providerID"`
	InstanceType string            `json:"instanceType"`
	Labels       map[string]string `json:"labels"`
	Created      time.Time         `json:"created"`
}

type provider struct {
	client *http.Client
	types  []*cloudprovider.InstanceType
	byName map[string]*cloudprovider.InstanceType
	// Karpenter's NodeOverlays, applied to the capacity a launched
	// NodeClaim reports as they are to the types Karpenter schedules on:
	// otherwise an in-flight node lacks what an overlay adds (gpumem's
	// resource), and pods still pending get a second node.
	overlays *nodeoverlay.InstanceTypeStore
}

var _ cloudprovider.CloudProvider = (*provider)(nil)

func newProvider(ctx context.Context, socket string, overlays *nodeoverlay.InstanceTypeStore) (*provider, error) {
	p := &provider{
		overlays: overlays,
		client: &http.Client{
			Timeout: 2 * time.Minute, // a launch waits for the kubelet to start
			Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", socket)
			}},
		},
		byName: map[string]*cloudprovider.InstanceType{},
	}
	var specs []instanceType
	if err := p.call(ctx, http.MethodGet, "/instance-types", nil, &specs); err != nil {
		return nil, err
	}
	for _, s := range specs {
		it := newInstanceType(s)
		p.types = append(p.types, it)
		p.byName[it.Name] = it
	}
	return p, nil
}

func newInstanceType(s instanceType) *cloudprovider.InstanceType {
	offering := scheduling.NewRequirements(
		scheduling.NewRequirement(corev1.LabelTopologyZone, corev1.NodeSelectorOpIn, s.Zone),
		scheduling.NewRequirement(v1.CapacityTypeLabelKey, corev1.NodeSelectorOpIn, v1.CapacityTypeOnDemand),
	)
	it := &cloudprovider.InstanceType{
		Name: s.Name,
		Requirements: scheduling.NewRequirements(
			scheduling.NewRequirement(corev1.LabelInstanceTypeStable, corev1.NodeSelectorOpIn, s.Name),
			scheduling.NewRequirement(corev1.LabelArchStable, corev1.NodeSelectorOpIn, "amd64"),
			scheduling.NewRequirement(corev1.LabelOSStable, corev1.NodeSelectorOpIn, string(corev1.Linux)),
			scheduling.NewRequirement(corev1.LabelTopologyZone, corev1.NodeSelectorOpIn, s.Zone),
			scheduling.NewRequirement(v1.CapacityTypeLabelKey, corev1.NodeSelectorOpIn, v1.CapacityTypeOnDemand),
		),
		Offerings: cloudprovider.Offerings{{Requirements: offering, Price: s.Price, Available: true}},
		Capacity:  s.Capacity,
		Overhead: &cloudprovider.InstanceTypeOverhead{
			KubeReserved: corev1.ResourceList{
				corev1.ResourceCPU:    resource.MustParse("100m"),
				corev1.ResourceMemory: resource.MustParse("10Mi"),
			},
		},
	}
	if s.DRA != nil {
		tmpl := &cloudprovider.ResourceSliceTemplate{
			Driver: unique.Make(s.DRA.Driver),
			Pool:   cloudprovider.ResourcePool{Name: unique.Make(s.DRA.Pool)},
		}
		for _, d := range s.DRA.Devices {
			tmpl.Devices = append(tmpl.Devices, cloudprovider.Device{
				Name:                     unique.Make(d.Name),
				Attributes:               d.Attributes,
				Capacity:                 d.Capacity,
				AllowMultipleAllocations: d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations,
			})
		}
		it.DynamicResources.ResourceSliceTemplates = []*cloudprovider.ResourceSliceTemplate{tmpl}
	}
	return it
}

// errNotFound is the runner's 404.
var errNotFound = errors.New("no such instance")

func (p *provider) call(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		data, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://gpumem-e2e"+path, body)
	if err != nil {
		return err
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return fmt.Errorf("instance API: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return errNotFound
	case resp.StatusCode/100 != 2:
		return fmt.Errorf("instance API %s %s: %s: %s", method, path, resp.Status, strings.TrimSpace(string(data)))
	case out != nil:
		return json.Unmarshal(data, out)
	}
	return nil
}

// Create launches the cheapest instance type the NodeClaim allows.
func (p *provider) Create(ctx context.Context, nodeClaim *v1.NodeClaim) (*v1.NodeClaim, error) {
	reqs := scheduling.NewNodeSelectorRequirementsWithMinValues(nodeClaim.Spec.Requirements...)
	var chosen *cloudprovider.InstanceType
	var offering *cloudprovider.Offering
	for _, name := range reqs.Get(corev1.LabelInstanceTypeStable).Values() {
		it, ok := p.byName[name]
		if !ok {
			continue
		}
		for _, o := range it.Offerings.Available().Compatible(reqs) {
			if offering == nil || o.Price < offering.Price {
				chosen, offering = it, o
			}
		}
	}
	if chosen == nil {
		return nil, cloudprovider.NewInsufficientCapacityError(fmt.Errorf("no offering of %v fits the NodeClaim's requirements", reqs.Get(corev1.LabelInstanceTypeStable).Values()))
	}
	labels := map[string]string{}
	for k, v := range nodeClaim.Labels {
		labels[k] = v
	}
	for _, r := range nodeClaim.Spec.Requirements {
		if r.Operator == corev1.NodeSelectorOpIn && len(r.Values) == 1 {
			labels[r.Key] = r.Values[0]
		}
	}
	for _, r := range append(chosen.Requirements.Values(), offering.Requirements.Values()...) {
		if r.Operator() == corev1.NodeSelectorOpIn && r.Len() == 1 {
			labels[r.Key] = r.Any()
		}
	}
	// As a cloud's user data registers kubelet: unregistered until
	// Karpenter has synced the NodeClaim onto the Node, and with the
	// NodePool's startup taints from the first moment.
	taints := append([]corev1.Taint{v1.UnregisteredNoExecuteTaint}, nodeClaim.Spec.Taints...)
	taints = append(taints, nodeClaim.Spec.StartupTaints...)
	var inst instance
	if err := p.call(ctx, http.MethodPost, "/instances", launch{Name: nodeClaim.Name, InstanceType: chosen.Name, Labels: labels, Taints: taints}, &inst); err != nil {
		return nil, cloudprovider.NewCreateError(err, "LaunchFailed", err.Error())
	}
	return p.toNodeClaim(ctx, &inst), nil
}

// withOverlays is the instance type as Karpenter's scheduling sees it in
// the NodePool: with its NodeOverlays, where the feature gate is on.
func (p *provider) withOverlays(ctx context.Context, it *cloudprovider.InstanceType, pool string) *cloudprovider.InstanceType {
	if !options.FromContext(ctx).FeatureGates.NodeOverlay || pool == "" {
		return it
	}
	applied, err := p.overlays.ApplyAll(pool, []*cloudprovider.InstanceType{it})
	if err != nil || len(applied) != 1 {
		return it
	}
	return applied[0]
}

func (p *provider) toNodeClaim(ctx context.Context, inst *instance) *v1.NodeClaim {
	nc := &v1.NodeClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name:              inst.Name,
			Labels:            inst.Labels,
			CreationTimestamp: metav1.NewTime(inst.Created),
		},
		Status: v1.NodeClaimStatus{ProviderID: inst.ProviderID},
	}
	if it, ok := p.byName[inst.InstanceType]; ok {
		it = p.withOverlays(ctx, it, inst.Labels[v1.NodePoolLabelKey])
		nc.Status.Capacity = it.Capacity
		nc.Status.Allocatable = it.Allocatable()
	}
	return nc
}

func (p *provider) Delete(ctx context.Context, nodeClaim *v1.NodeClaim) error {
	err := p.call(ctx, http.MethodDelete, "/instances/"+instanceName(nodeClaim.Status.ProviderID), nil, nil)
	if errors.Is(err, errNotFound) {
		return cloudprovider.NewNodeClaimNotFoundError(err)
	}
	return err
}

func instanceName(providerID string) string { return strings.TrimPrefix(providerID, providerPrefix) }

func (p *provider) Get(ctx context.Context, providerID string) (*v1.NodeClaim, error) {
	var inst instance
	err := p.call(ctx, http.MethodGet, "/instances/"+instanceName(providerID), nil, &inst)
	if errors.Is(err, errNotFound) {
		return nil, cloudprovider.NewNodeClaimNotFoundError(err)
	}
	if err != nil {
		return nil, err
	}
	return p.toNodeClaim(ctx, &inst), nil
}

func (p *provider) List(ctx context.Context) ([]*v1.NodeClaim, error) {
	var all []instance
	if err := p.call(ctx, http.MethodGet, "/instances", nil, &all); err != nil {
		return nil, err
	}
	out := make([]*v1.NodeClaim, 0, len(all))
	for i := range all {
		out = append(out, p.toNodeClaim(ctx, &all[i]))
	}
	return out, nil
}

func (p *provider) GetInstanceTypes(context.Context, *v1.NodePool) ([]*cloudprovider.InstanceType, error) {
	return p.types, nil
}

func (p *provider) IsDrifted(context.Context, *v1.NodeClaim) (cloudprovider.DriftReason, error) {
	return "", nil
}

func (p *provider) Reboot(context.Context, *v1.NodeClaim, string) error {
	return cloudprovider.NewNodeRebootNotImplementedError()
}

// RepairPolicies: a node whose kubelet stopped reporting is replaced (the
// one default Karpenter requires).
func (p *provider) RepairPolicies() []cloudprovider.RepairPolicy {
	return []cloudprovider.RepairPolicy{
		{ConditionType: corev1.NodeReady, ConditionStatus: corev1.ConditionFalse, TolerationDuration: 10 * time.Minute, Action: cloudprovider.ReplaceNode},
	}
}

func (p *provider) Name() string { return "gpumem-e2e" }

// GetSupportedNodeClasses: Karpenter's own test provider's class (kwok's),
// from the karpenter module: the instances need no settings of their own,
// and a NodePool must name some NodeClass.
func (p *provider) GetSupportedNodeClasses() []status.Object {
	return []status.Object{&v1alpha1.KWOKNodeClass{}}
}
