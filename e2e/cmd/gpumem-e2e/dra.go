// Scenarios with the DRA driver: `gpumem dra` as daemonset/gpumem-dra.yaml
// runs it, its DeviceClass, the claims and pods of
// daemonset/dra-example.yaml allocated by the real kube-scheduler (claims
// from templates by the real controller manager), prepared by the real
// kubelet through gpumem, and unprepared when the pods go.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
)

const draDriver = "gpumem.io"

// draScenarios run after the phase's gate, "DRA driver registers and
// publishes consumable capacity" (draRegisters).
var draScenarios = []scenario{
	{"claim from a template: allocated by the scheduler, prepared by kubelet", (*suite).draTemplate},
	{"one claim shared by two pods", (*suite).draShared},
	{"kubelet restart: slice republished, claims kept", (*suite).draKubeletRestart},
	{"GPU unhealthy: pods holding claims on it say Unhealthy in their status; recovered: Healthy", (*suite).draHealth},
	{"driver restart: claims kept, a new claim prepared", (*suite).draDriverRestart},
	{"pod deletion unprepares the claims", (*suite).draUnprepare},
	{"kubelet logs no plugin-watcher errors for the registration socket", (*suite).draQuiet},
}

func (s *suite) draRegisters() (string, error) {
	var slice *resourcev1.ResourceSlice
	err := waitFor(60*time.Second, "driver registered and slice published", func() (bool, error) {
		if s.c.gpumem.exited() {
			return false, fatal{fmt.Errorf("gpumem exited: %v", s.c.gpumem.err)}
		}
		st, err := s.gpumemStatus()
		if err != nil {
			return false, err
		}
		if st.Dra == nil || !strings.HasPrefix(st.Dra.Registration, "registered") || !ptr.Deref(st.Dra.ConsumableCapacity, false) {
			return false, fmt.Errorf("/status dra %+v", st.Dra)
		}
		slices, err := s.c.admin.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for i := range slices.Items {
			sl := &slices.Items[i]
			if sl.Spec.Driver == draDriver && ptr.Deref(sl.Spec.NodeName, "") == nodeName {
				slice = sl
				return true, nil
			}
		}
		return false, fmt.Errorf("no ResourceSlice of %s for %s among %d", draDriver, nodeName, len(slices.Items))
	})
	if err != nil {
		return "", err
	}
	if len(slice.Spec.Devices) != 1 {
		return "", fmt.Errorf("slice %s has %d devices, the fixture 1 GPU", slice.Name, len(slice.Spec.Devices))
	}
	d := slice.Spec.Devices[0]
	mem, ok := d.Capacity["memory"]
	if !ok || !ptr.Deref(d.AllowMultipleAllocations, false) || mem.RequestPolicy == nil {
		return "", fmt.Errorf("device %s: allowMultipleAllocations %v, capacity %+v: no consumable memory (the API server dropped it?)", d.Name, d.AllowMultipleAllocations, d.Capacity)
	}
	return fmt.Sprintf("gpumem /status: registered with kubelet, consumable capacity kept; slice %s: device %s, memory %s, allowMultipleAllocations, request policy default %v step %v",
		slice.Name, d.Name, mem.Value.String(), mem.RequestPolicy.Default, stepOf(mem.RequestPolicy)), nil
}

func stepOf(p *resourcev1.CapacityRequestPolicy) string {
	if p.ValidRange != nil && p.ValidRange.Step != nil {
		return p.ValidRange.Step.String()
	}
	return "-"
}

// draExample creates daemonset/dra-example.yaml's objects in the default
// namespace (pods without service-account tokens, as everywhere here).
func (s *suite) draExample() ([]string, error) {
	objects, err := s.draExampleDocs()
	if err != nil {
		return nil, err
	}
	var pods []string
	for _, obj := range objects {
		switch o := obj.(type) {
		case *resourcev1.ResourceClaimTemplate:
			_, err = s.c.admin.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, o, metav1.CreateOptions{})
		case *resourcev1.ResourceClaim:
			_, err = s.c.admin.ResourceV1().ResourceClaims(namespace).Create(ctx, o, metav1.CreateOptions{})
		case *corev1.Pod:
			o.Spec.AutomountServiceAccountToken = ptr.To(false)
			o.Spec.TerminationGracePeriodSeconds = ptr.To[int64](1)
			pods = append(pods, o.Name)
			_, err = s.c.admin.CoreV1().Pods(namespace).Create(ctx, o, metav1.CreateOptions{})
		default:
			return nil, fmt.Errorf("dra-example.yaml: unexpected %T", obj)
		}
		if err != nil {
			return nil, err
		}
	}
	return pods, nil
}

// draExampleDocs decodes daemonset/dra-example.yaml, beside the manifest.
func (s *suite) draExampleDocs() ([]runtime.Object, error) {
	data, err := os.ReadFile(filepath.Join(filepath.Dir(s.c.cfg.manifest), "dra-example.yaml"))
	if err != nil {
		return nil, err
	}
	var objects []runtime.Object
	for _, doc := range strings.Split(string(data), "\n---") {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			return nil, fmt.Errorf("dra-example.yaml: %w", err)
		}
		objects = append(objects, obj)
	}
	return objects, nil
}

// podClaim returns the claim behind a pod's first resource claim.
func (s *suite) podClaim(pod *corev1.Pod) (*resourcev1.ResourceClaim, error) {
	var name string
	for _, st := range pod.Status.ResourceClaimStatuses {
		name = ptr.Deref(st.ResourceClaimName, "")
	}
	if name == "" && len(pod.Spec.ResourceClaims) > 0 {
		name = ptr.Deref(pod.Spec.ResourceClaims[0].ResourceClaimName, "")
	}
	if name == "" {
		return nil, fmt.Errorf("pod %s: no claim", pod.Name)
	}
	return s.c.admin.ResourceV1().ResourceClaims(namespace).Get(ctx, name, metav1.GetOptions{})
}

// draPrepared checks a Running pod's claim: allocated by the scheduler
// with the consumed capacity asked, and the container created with
// gpumem's CDI device for the claim, whose spec caps it.
func (s *suite) draPrepared(podName string, want resource.Quantity) (string, error) {
	// Now and then kubelet fetches a pod's claim before the API server's
	// Node authorizer has the pod's edge to it ("no relationship found
	// between node … and this object"), and retries only after its pod
	// sync backoff, 80 s in CI once: gpumem is not asked until then.
	pod, err := s.waitPhase(podName, corev1.PodRunning, 200*time.Second)
	if err != nil {
		return "", err
	}
	claim, err := s.podClaim(pod)
	if err != nil {
		return "", err
	}
	if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) != 1 {
		return "", fmt.Errorf("claim %s not allocated: %+v", claim.Name, claim.Status)
	}
	r := claim.Status.Allocation.Devices.Results[0]
	got, ok := r.ConsumedCapacity["memory"]
	if r.Driver != draDriver || !ok || got.Cmp(want) != 0 || r.ShareID == nil {
		return "", fmt.Errorf("claim %s result %+v: want driver %s, consumed memory %s and a shareID", claim.Name, r, draDriver, want.String())
	}
	created := s.c.runtime.createdFor(namespace, podName, pod.Spec.Containers[0].Name)
	if len(created) != 1 {
		return "", fmt.Errorf("%d CreateContainer requests for %s", len(created), podName)
	}
	var cdi []string
	for _, d := range created[0].GetConfig().GetCDIDevices() {
		cdi = append(cdi, d.GetName())
	}
	var ours string
	for _, n := range cdi {
		if strings.HasPrefix(n, draDriver+"/") && strings.Contains(n, string(claim.UID)) {
			ours = n
		}
	}
	if ours == "" {
		return "", fmt.Errorf("container's CDI devices %v: none of %s names claim %s", cdi, draDriver, claim.UID)
	}
	// The spec behind the name, in the CDI directory, carries the cap.
	wantCap := fmt.Sprintf("GPUMEM_LIMIT_MIB=%d", want.Value()>>20)
	specs, _ := filepath.Glob(filepath.Join(s.c.path("cdi"), "*"))
	var found string
	for _, f := range specs {
		data, err := os.ReadFile(f)
		if err == nil && strings.Contains(string(data), string(claim.UID)) && strings.Contains(string(data), wantCap) {
			found = filepath.Base(f)
		}
	}
	if found == "" {
		return "", fmt.Errorf("no CDI spec in %s for claim %s with %s", s.c.path("cdi"), claim.UID, wantCap)
	}
	return fmt.Sprintf("claim %s: consumedCapacity memory %s, shareID %s; container created with CDI device %s, spec %s has %s",
		claim.Name, got.String(), *r.ShareID, ours, found, wantCap), nil
}

func (s *suite) draTemplate() (string, error) {
	if err := s.untainted(); err != nil {
		return "", err
	}
	if _, err := s.draExample(); err != nil {
		return "", err
	}
	return s.draPrepared("dra-nvidia-smi", resource.MustParse("4Gi"))
}

// draRunning is what most scenarios here start from: dra-example.yaml's
// pods Running, gpumem holding their 2 claims. It returns the pods.
func (s *suite) draRunning() ([]string, error) {
	if err := s.untainted(); err != nil {
		return nil, err
	}
	pods, err := s.draExample()
	if err != nil {
		return nil, err
	}
	// As long as draPrepared waits: kubelet may meet the Node
	// authorizer's race.
	for _, p := range pods {
		if _, err := s.waitPhase(p, corev1.PodRunning, 200*time.Second); err != nil {
			return nil, err
		}
	}
	return pods, s.draHeld(2)
}

// draShared: the example's pods; its template's pod holds the claim
// counted beside the shared one.
func (s *suite) draShared() (string, error) {
	if err := s.untainted(); err != nil {
		return "", err
	}
	if _, err := s.draExample(); err != nil {
		return "", err
	}
	if _, err := s.waitPhase("dra-nvidia-smi", corev1.PodRunning, 200*time.Second); err != nil {
		return "", err
	}
	began := time.Now()
	a, err := s.draPrepared("dra-shared-a", resource.MustParse("8Gi"))
	if err != nil {
		return "", fmt.Errorf("%w; %s", err, s.podEvents("dra-shared-a", "dra-shared-b"))
	}
	if _, err := s.draPrepared("dra-shared-b", resource.MustParse("8Gi")); err != nil {
		return "", fmt.Errorf("%w; %s", err, s.podEvents("dra-shared-a", "dra-shared-b"))
	}
	// Usually at once; slow where kubelet met the Node authorizer's race
	// (draPrepared). Say what the pods went through when it is slow.
	if slow := time.Since(began); slow > 20*time.Second {
		fmt.Printf("     slow (%.0f s): %s\n", slow.Seconds(), s.podEvents("dra-shared-a", "dra-shared-b"))
	}
	var claims []string
	err = waitFor(20*time.Second, "gpumem lists both claims", func() (bool, error) {
		st, err := s.gpumemStatus()
		if err != nil {
			return false, err
		}
		claims = claims[:0]
		for _, c := range st.Claims {
			claims = append(claims, fmt.Sprintf("%s %d MiB on GPU%d", c.Name, c.CapMiB, c.Gpu))
		}
		return len(st.Claims) == 2, fmt.Errorf("/status claims %v", claims)
	})
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("both pods Running on one claim (%s); gpumem /status: %s", a[:strings.Index(a, ";")], strings.Join(claims, ", ")), nil
}

func (s *suite) draUnprepare() (string, error) {
	pods, err := s.draRunning()
	if err != nil {
		return "", err
	}
	for _, p := range pods {
		if err := s.c.admin.CoreV1().Pods(namespace).Delete(ctx, p, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return "", err
		}
	}
	if err := waitFor(60*time.Second, "pods gone", func() (bool, error) {
		list, err := s.c.admin.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		return len(list.Items) == 0, fmt.Errorf("%d pods left", len(list.Items))
	}); err != nil {
		return "", err
	}
	err = waitFor(60*time.Second, "claims unprepared", func() (bool, error) {
		st, err := s.gpumemStatus()
		if err != nil {
			return false, err
		}
		return len(st.Claims) == 0, fmt.Errorf("gpumem still holds %d claims", len(st.Claims))
	})
	if err != nil {
		return "", err
	}
	shared, err := s.c.admin.ResourceV1().ResourceClaims(namespace).Get(ctx, "shared-gpu-8gi", metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	if n := len(shared.Status.ReservedFor); n != 0 {
		return "", fmt.Errorf("shared-gpu-8gi still reserved for %d pods", n)
	}
	return "pods gone; gpumem /status lists no claim; shared-gpu-8gi reserved for none", nil
}

// draQuiet reads kubelet's log for the registration socket racing the
// plugin watcher, which only the log shows. (Whether kubelet watches the
// driver's health is draHealth's effect check.) First the driver registers
// again as it does in a node's life: after kubelet restarts, then after
// it restarts itself.
func (s *suite) draQuiet() (string, error) {
	if _, _, err := s.draKubeletRestarted(); err != nil {
		return "", err
	}
	s.c.gpumem.stop(30 * time.Second)
	if err := s.c.runGpumem(); err != nil {
		return "", err
	}
	if err := s.draHeld(0); err != nil {
		return "", err
	}
	data, err := os.ReadFile(filepath.Join(s.c.logs, "kubelet.log"))
	if err != nil {
		return "", err
	}
	var bad []string
	for _, line := range strings.Split(string(data), "\n") {
		if strings.Contains(line, "Error when handling create event") && strings.Contains(line, "plugins_registry") {
			bad = append(bad, line)
		}
	}
	if len(bad) > 0 {
		return "", fmt.Errorf("%d such lines in kubelet's log, the first: %s", len(bad), bad[0])
	}
	return fmt.Sprintf("no plugin-watcher create-event errors in %d log lines", strings.Count(string(data), "\n")), nil
}

// draSlice returns this node's ResourceSlice of the driver, or nil.
func (s *suite) draSlice() (*resourcev1.ResourceSlice, error) {
	slices, err := s.c.admin.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for i := range slices.Items {
		if slices.Items[i].Spec.Driver == draDriver && ptr.Deref(slices.Items[i].Spec.NodeName, "") == nodeName {
			return &slices.Items[i], nil
		}
	}
	return nil, nil
}

// draHeld waits for gpumem's /status to list n prepared claims.
func (s *suite) draHeld(n int) error {
	return waitFor(60*time.Second, fmt.Sprintf("gpumem lists %d claims", n), func() (bool, error) {
		st, err := s.gpumemStatus()
		if err != nil {
			return false, err
		}
		if st.Dra == nil || !strings.HasPrefix(st.Dra.Registration, "registered") {
			return false, fmt.Errorf("/status dra %+v", st.Dra)
		}
		return len(st.Claims) == n, fmt.Errorf("%d claims", len(st.Claims))
	})
}

// draKubeletRestart: kubelet deletes the node's slices when it starts;
// the driver registers again and publishes a new one, and the running
// pods keep their prepared claims.
func (s *suite) draKubeletRestart() (string, error) {
	pods, err := s.draRunning()
	if err != nil {
		return "", err
	}
	after, took, err := s.draKubeletRestarted()
	if err != nil {
		return "", err
	}
	if err := s.draHeld(2); err != nil {
		return "", err
	}
	for _, p := range pods {
		if _, err := s.waitPhase(p, corev1.PodRunning, 30*time.Second); err != nil {
			return "", err
		}
	}
	return fmt.Sprintf("slice %s republished (new UID) %.1f s after kubelet started; 3 pods Running, gpumem still holds 2 claims", after.Name, took.Seconds()), nil
}

// draKubeletRestarted restarts kubelet and waits for the driver to
// publish a new slice (kubelet deletes the node's when it starts), which
// it returns with the time that took.
func (s *suite) draKubeletRestarted() (*resourcev1.ResourceSlice, time.Duration, error) {
	before, err := s.draSlice()
	if err != nil || before == nil {
		return nil, 0, fmt.Errorf("no slice before the restart: %v", err)
	}
	s.c.kubelet.stop(30 * time.Second)
	if err := s.c.runKubelet(); err != nil {
		return nil, 0, err
	}
	started := time.Now()
	var after *resourcev1.ResourceSlice
	if err := waitFor(90*time.Second, "a new slice", func() (bool, error) {
		after, err = s.draSlice()
		return err == nil && after != nil && after.UID != before.UID, err
	}); err != nil {
		return nil, 0, err
	}
	return after, time.Since(started), nil
}

// draDriverRestart: the driver stops and starts again; it registers
// anew, its checkpoint keeps the prepared claims, and a new pod on the
// node is prepared.
func (s *suite) draDriverRestart() (string, error) {
	if _, err := s.draRunning(); err != nil {
		return "", err
	}
	s.c.gpumem.stop(30 * time.Second)
	if err := s.c.runGpumem(); err != nil {
		return "", err
	}
	started := time.Now()
	if err := s.draHeld(2); err != nil {
		return "", err
	}
	took := time.Since(started)
	// 12Gi of the T4's 15079Mi are claimed: 2Gi still fit.
	if err := s.draClaimPod("gpu-2gi", "dra-after-restart", "gpu", resource.MustParse("2Gi")); err != nil {
		return "", err
	}
	detail, err := s.draPrepared("dra-after-restart", resource.MustParse("2Gi"))
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("registered again with its 2 claims %.1f s after start; a new pod prepared: %s", took.Seconds(), detail[:strings.Index(detail, ";")]), nil
}

// draClaimPod creates claim `claim`, asking `memory` of the driver's device
// class, and pod `pod`, whose container holds it under the pod's claim name
// `entry`.
func (s *suite) draClaimPod(claim, pod, entry string, memory resource.Quantity) error {
	c := &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: claim, Namespace: namespace},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{{
			Name: "gpu",
			Exactly: &resourcev1.ExactDeviceRequest{
				DeviceClassName: draDriver,
				Capacity:        &resourcev1.CapacityRequirements{Requests: map[resourcev1.QualifiedName]resource.Quantity{"memory": memory}},
			},
		}}}},
	}
	if _, err := s.c.admin.ResourceV1().ResourceClaims(namespace).Create(ctx, c, metav1.CreateOptions{}); err != nil {
		return err
	}
	return s.createPod(&corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod, Namespace: namespace},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			ResourceClaims:                []corev1.PodResourceClaim{{Name: entry, ResourceClaimName: ptr.To(claim)}},
			Containers: []corev1.Container{{
				Name: "main", Image: "registry.invalid/e2e/cuda-app:1",
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: entry}}},
			}},
		},
	})
}

// podEvents lists the Events of pods, oldest first, for a failure's or a
// slow scenario's line.
func (s *suite) podEvents(pods ...string) string {
	list, err := s.c.admin.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Sprintf("events: %v", err)
	}
	var lines []string
	for _, e := range list.Items {
		if slices.Contains(pods, e.InvolvedObject.Name) {
			at := e.LastTimestamp.Time
			if at.IsZero() {
				at = e.EventTime.Time
			}
			lines = append(lines, fmt.Sprintf("%s %s %s %s: %s", at.Format("15:04:05.000"), e.InvolvedObject.Name, e.Source.Component+e.ReportingController, e.Reason, e.Message))
		}
	}
	sort.Strings(lines)
	return "events: " + strings.Join(lines, " | ")
}
