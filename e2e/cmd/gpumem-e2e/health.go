// GPU health as users see it (KEP-4680, ResourceHealthStatus): a GPU turned
// unhealthy in gpumem's fake GPU file takes its units out of the node's
// allocatable and shows Unhealthy in the status of every pod holding it,
// through the device plugin's ListAndWatch and the DRA driver's
// DRAResourceHealth stream; turned back, both recover.
package main

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// How long kubelet may take to put a health change in a pod's status: it
// hears it at once and syncs the pod's status soon after.
const healthWait = 60 * time.Second

// setGPUsHealthy writes gpumem's GPU file: the fixture, its last GPU
// healthy or not, replaced whole so that gpumem never reads half of it.
func (c *cluster) setGPUsHealthy(healthy bool) error {
	data, err := os.ReadFile(c.cfg.fixture)
	if err != nil {
		return err
	}
	text := string(data)
	if !healthy {
		text += "healthy = false\n"
	}
	staging := c.gpusFile + ".new"
	if err := os.WriteFile(staging, []byte(text), 0o644); err != nil {
		return err
	}
	return os.Rename(staging, c.gpusFile)
}

// kubeletFeatureGates is the kubelet configuration's featureGates for the
// kubelet under test: ResourceHealthStatus is on by default from 1.36 and
// must be turned on before, as a cluster that wants device health in pod
// status does.
func (c *cluster) kubeletFeatureGates() string {
	out, err := runCmd(c.cfg.kubelet, "--version")
	m := regexp.MustCompile(`v1\.(\d+)\.`).FindStringSubmatch(out)
	if err != nil || m == nil {
		return ""
	}
	if minor, _ := strconv.Atoi(m[1]); minor >= 36 {
		return ""
	}
	return "featureGates:\n  ResourceHealthStatus: true\n"
}

// resourceHealth is a container's allocatedResourcesStatus as
// "<name> <resourceID>" → health.
func resourceHealth(pod *corev1.Pod, container string) map[string]corev1.ResourceHealthStatus {
	got := map[string]corev1.ResourceHealthStatus{}
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name != container {
			continue
		}
		for _, rs := range cs.AllocatedResourcesStatus {
			for _, r := range rs.Resources {
				got[string(rs.Name)+" "+string(r.ResourceID)] = r.Health
			}
		}
	}
	return got
}

// waitResourceHealth waits until every one of want's pods shows health for
// all its resources (want: pod → the keys of resourceHealth that must be
// there, at least one) and for nothing else; main containers only.
func (s *suite) waitResourceHealth(want map[string][]string, health corev1.ResourceHealthStatus) (time.Duration, error) {
	began := time.Now()
	pods := make([]string, 0, len(want))
	for p := range want {
		pods = append(pods, p)
	}
	sort.Strings(pods)
	err := waitFor(healthWait, fmt.Sprintf("%s in the status of %s", health, strings.Join(pods, ", ")), func() (bool, error) {
		for _, name := range pods {
			pod, err := s.c.admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			got := resourceHealth(pod, pod.Spec.Containers[0].Name)
			for _, key := range want[name] {
				if got[key] != health {
					return false, fmt.Errorf("pod %s: allocatedResourcesStatus %v, want %s for %s", name, got, health, key)
				}
			}
			for _, h := range got {
				if h != health {
					return false, fmt.Errorf("pod %s: allocatedResourcesStatus %v, want all %s", name, got, health)
				}
			}
		}
		return true, nil
	})
	return time.Since(began), err
}

// gpumemCDIDevice is the CDI device gpumem prepared for a container of a
// pod with a claim: kubelet names the claim's device by it in the status.
func (s *suite) gpumemCDIDevice(pod, container string) (string, error) {
	created := s.c.runtime.createdFor(namespace, pod, container)
	if len(created) == 0 {
		return "", fmt.Errorf("no CreateContainer for %s/%s", pod, container)
	}
	for _, d := range created[len(created)-1].GetConfig().GetCDIDevices() {
		if strings.HasPrefix(d.GetName(), draDriver+"/") {
			return d.GetName(), nil
		}
	}
	return "", fmt.Errorf("%s/%s has no CDI device of %s", pod, container, draDriver)
}

// claimNamedAsItsObject says whether every claim of pod is named in the pod
// as its ResourceClaim is. Kubelet 1.34 puts a claim's health in the status
// only then (it compares the two names); 1.37 resolves the object's name.
func claimNamedAsItsObject(pod *corev1.Pod) bool {
	for _, c := range pod.Spec.ResourceClaims {
		if ptr.Deref(c.ResourceClaimName, "") != c.Name {
			return false
		}
	}
	return true
}

// draHealth: a pod of its own holds a claim on the GPU beside
// dra-example.yaml's pods; the GPU turns unhealthy, and every pod holding
// a claim on it shows Unhealthy for the claim's device, then Healthy again
// when it recovers. Its claim and pod go at the end, leaving gpumem the
// example's two claims.
func (s *suite) draHealth() (detail string, err error) {
	const claimName, podName = "gpu-health", "dra-health"
	// Gone at the end, pass or fail, the GPU well again.
	defer func() {
		gone := errors.Join(s.c.setGPUsHealthy(true), s.deletePod(podName))
		if del := s.c.admin.ResourceV1().ResourceClaims(namespace).Delete(ctx, claimName, metav1.DeleteOptions{}); del != nil && !apierrors.IsNotFound(del) {
			gone = errors.Join(gone, del)
		}
		if gone == nil {
			gone = s.draHeld(2)
		}
		if err == nil && gone != nil {
			err = fmt.Errorf("cleaning up: %w", gone)
		}
	}()
	pods, err := s.draRunning()
	if err != nil {
		return "", err
	}
	// Named in the pod as its object is, which kubelet 1.34 needs.
	if err := s.draClaimPod(claimName, podName, claimName, resource.MustParse("1Gi")); err != nil {
		return "", err
	}
	if _, err := s.draPrepared(podName, resource.MustParse("1Gi")); err != nil {
		return "", err
	}
	resolves := !strings.HasPrefix(kubeletVersion(s.c), "v1.34.")
	want := map[string][]string{}
	var claims, unreported []string
	for _, name := range append([]string{podName}, pods...) {
		pod, err := s.waitPhase(name, corev1.PodRunning, 30*time.Second)
		if err != nil {
			return "", err
		}
		if !resolves && !claimNamedAsItsObject(pod) {
			unreported = append(unreported, name)
			continue
		}
		device, err := s.gpumemCDIDevice(name, pod.Spec.Containers[0].Name)
		if err != nil {
			return "", err
		}
		for _, c := range pod.Spec.Containers[0].Resources.Claims {
			key := "claim:" + c.Name
			if c.Request != "" {
				key += "/" + c.Request
			}
			want[name] = append(want[name], key+" "+device)
		}
		claims = append(claims, name+": "+strings.Join(want[name], ", "))
	}
	// Healthy first: kubelet watches the driver's health at all.
	if _, err := s.waitResourceHealth(want, corev1.ResourceHealthStatusHealthy); err != nil {
		return "", fmt.Errorf("before any change: %w", err)
	}
	if err := s.c.setGPUsHealthy(false); err != nil {
		return "", err
	}
	sick, err := s.waitResourceHealth(want, corev1.ResourceHealthStatusUnhealthy)
	if err != nil {
		return "", err
	}
	if err := s.c.setGPUsHealthy(true); err != nil {
		return "", err
	}
	well, err := s.waitResourceHealth(want, corev1.ResourceHealthStatusHealthy)
	if err != nil {
		return "", err
	}
	// The driver offers the GPU again (it withdrew it from the slice).
	if err := waitFor(60*time.Second, "the GPU back in the slice", func() (bool, error) {
		slice, err := s.draSlice()
		return err == nil && slice != nil && len(slice.Spec.Devices) == 1, err
	}); err != nil {
		return "", err
	}
	sort.Strings(claims)
	detail = fmt.Sprintf("%d pods Unhealthy %.1f s after the GPU turned sick, Healthy %.1f s after it recovered (%s)",
		len(want), sick.Seconds(), well.Seconds(), strings.Join(claims, "; "))
	if len(unreported) > 0 {
		detail += fmt.Sprintf("; not checked: %s (kubelet %s reports only claims named in the pod as their ResourceClaim)", strings.Join(unreported, ", "), kubeletVersion(s.c))
	}
	return detail, nil
}

// pluginHealth: with a pod holding units, the GPU turns unhealthy:
// allocatable drops to 0 (capacity stays) and the pod shows its units
// Unhealthy; the GPU recovers: allocatable and the pod's status come back.
func (s *suite) pluginHealth() (detail string, err error) {
	const name = "health-2"
	if err := s.createPod(gpuPod(name, 2)); err != nil {
		return "", err
	}
	// Gone at the end, pass or fail, the GPU well again.
	defer func() {
		gone := errors.Join(s.c.setGPUsHealthy(true), s.deletePod(name))
		if err == nil && gone != nil {
			err = fmt.Errorf("cleaning up: %w", gone)
		}
	}()
	pod, err := s.waitPhase(name, corev1.PodRunning, 60*time.Second)
	if err != nil {
		return "", err
	}
	var want []string
	err = waitFor(healthWait, name+" lists its devices", func() (bool, error) {
		pod, err = s.c.admin.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		want = want[:0]
		for key := range resourceHealth(pod, "main") {
			if strings.HasPrefix(key, resourceName+" ") {
				want = append(want, key)
			}
		}
		return len(want) == 2, fmt.Errorf("allocatedResourcesStatus %v, want 2 devices of %s", resourceHealth(pod, "main"), resourceName)
	})
	if err != nil {
		return "", err
	}
	pods := map[string][]string{name: want}
	if _, err := s.waitResourceHealth(pods, corev1.ResourceHealthStatusHealthy); err != nil {
		return "", fmt.Errorf("before any change: %w", err)
	}
	if err := s.c.setGPUsHealthy(false); err != nil {
		return "", err
	}
	dropped, err := s.waitAllocatable(0, healthWait)
	if err != nil {
		return "", fmt.Errorf("after the GPU turned sick: %w", err)
	}
	capacity, _, err := s.nodeResource(resourceName)
	if err != nil {
		return "", err
	}
	if capacity != s.units {
		return "", fmt.Errorf("capacity %d while the GPU is sick, want %d (kubelet counts unhealthy devices in capacity)", capacity, s.units)
	}
	sick, err := s.waitResourceHealth(pods, corev1.ResourceHealthStatusUnhealthy)
	if err != nil {
		return "", err
	}
	if err := s.c.setGPUsHealthy(true); err != nil {
		return "", err
	}
	back, err := s.waitAllocatable(s.units, healthWait)
	if err != nil {
		return "", fmt.Errorf("after the GPU recovered: %w", err)
	}
	well, err := s.waitResourceHealth(pods, corev1.ResourceHealthStatusHealthy)
	if err != nil {
		return "", err
	}
	sort.Strings(want)
	return fmt.Sprintf("sick: allocatable 0 of capacity %d in %.1f s, %s Unhealthy in %.1f s more; recovered: allocatable %d in %.1f s, Healthy in %.1f s more (%s)",
		capacity, dropped.Seconds(), name, sick.Seconds(), s.units, back.Seconds(), well.Seconds(), strings.Join(want, "; ")), nil
}
