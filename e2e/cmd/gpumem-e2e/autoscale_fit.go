// The autoscale phase's per-GPU fit: Karpenter sums a node's
// aliyun.com/gpu-mem as kube-scheduler does, while gpumem places each
// container on one GPU. What a pod that fits the node's free sum but no GPU
// meets with the device plugin, and how the DRA path, whose ResourceSlice
// offers each GPU's memory as consumable capacity, gets it a node.
package main

import (
	"fmt"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func (a *autoscaler) draManifest() string {
	return draManifest(a.c.cfg.manifest)
}

// draNotebook is a pod of the pool with a ResourceClaim of its own (named
// after it) for memory of one gpumem GPU.
func (a *autoscaler) draNotebook(name, pool string, memory string) (*corev1.Pod, error) {
	claim := &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{{
			Name: "gpu",
			Exactly: &resourcev1.ExactDeviceRequest{
				DeviceClassName: draDriver,
				Capacity:        &resourcev1.CapacityRequirements{Requests: map[resourcev1.QualifiedName]resource.Quantity{"memory": resource.MustParse(memory)}},
			},
		}}}},
	}
	if _, err := a.c.admin.ResourceV1().ResourceClaims(namespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: corev1.PodSpec{
			NodeSelector:                  map[string]string{nodePoolLabel: pool},
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			ResourceClaims:                []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To(name)}},
			Containers: []corev1.Container{{
				Name: "main", Image: "registry.invalid/e2e/cuda-app:1",
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}},
			}},
		},
	}, nil
}

// deleteDRANotebook deletes the pod, then its claim, and waits for both.
func (a *autoscaler) deleteDRANotebook(name string) error {
	if err := a.deletePod(name); err != nil {
		return err
	}
	if err := a.c.admin.ResourceV1().ResourceClaims(namespace).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return err
	}
	return waitFor(60*time.Second, "claim "+name+" gone", func() (bool, error) {
		_, err := a.c.admin.ResourceV1().ResourceClaims(namespace).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), err
	})
}

// claimsByGPU waits until gpumem on node lists want claims, each capped
// at capMiB, and returns their names by GPU index.
func (a *autoscaler) claimsByGPU(node string, want int, capMiB uint64) (map[uint32][]string, error) {
	inst, err := a.cloud.node(node)
	if err != nil {
		return nil, err
	}
	byGPU := map[uint32][]string{}
	err = waitFor(60*time.Second, fmt.Sprintf("gpumem on %s lists %d claims", node, want), func() (bool, error) {
		st, err := (&suite{c: inst.c}).gpumemStatus()
		if err != nil {
			return false, err
		}
		byGPU = map[uint32][]string{}
		for _, c := range st.Claims {
			if c.CapMiB != capMiB {
				return false, fatal{fmt.Errorf("claim %s capped at %d MiB, want %d", c.Name, c.CapMiB, capMiB)}
			}
			byGPU[c.Gpu] = append(byGPU[c.Gpu], c.Name)
		}
		return len(st.Claims) == want, fmt.Errorf("%d claims: %v", len(st.Claims), byGPU)
	})
	for _, names := range byGPU {
		sort.Strings(names)
	}
	return byGPU, err
}

func (a *autoscaler) scaleUpDRA() (string, error) {
	// The DeviceClass (and the driver's RBAC) before any node: Karpenter
	// and kube-scheduler need the class to read a claim.
	if _, _, err := a.c.applyManifest(a.draManifest()); err != nil {
		return "", err
	}
	if err := a.nodePool("dra", v100DRAType, "dra"); err != nil {
		return "", err
	}
	launched := a.cloud.launchedCount()
	var pods []*corev1.Pod
	for i := 1; i <= 6; i++ {
		p, err := a.draNotebook(fmt.Sprintf("dra-%d", i), "dra", "4Gi")
		if err != nil {
			return "", err
		}
		pods = append(pods, p)
		a.draPods = append(a.draPods, p.Name)
	}
	tl := newTimeline()
	took, err := a.runUntilRunning(tl, pods, 5*time.Minute)
	if err != nil {
		return "", fmt.Errorf("%w (Initialized reasons seen: %v); %s", err, tl.reasons, a.podEvents(a.draPods...))
	}
	if took > 30*time.Second {
		// Why it was slow: kubelet's preparing, retried after a backoff?
		fmt.Printf("     slow (%.0f s): %s\n", took.Seconds(), a.podEvents(a.draPods...))
	}
	// Were each GPU one device for one claim, six claims would need three
	// nodes of two GPUs.
	if n := a.cloud.launchedCount() - launched; n != 1 {
		return "", fmt.Errorf("%d nodes launched for six 4Gi claims, want 1 (two GPUs of 15Gi, three claims each)", n)
	}
	node := a.nodeOf(a.draPods[0])
	for _, p := range a.draPods {
		if n := a.nodeOf(p); n != node {
			return "", fmt.Errorf("%s on %q, %s on %q: want one node", p, n, a.draPods[0], node)
		}
	}
	a.draNode = node
	byGPU, err := a.claimsByGPU(node, 6, 4096)
	if err != nil {
		return "", err
	}
	if len(byGPU[0]) != 3 || len(byGPU[1]) != 3 {
		return "", fmt.Errorf("claims per GPU %v, want three on each", byGPU)
	}
	wait, err := a.waitedForTaint(tl, node)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("first Pending → all Running capped: %.1f s; nodes launched: 1 (%s, %s); gpumem: GPU0 %s, GPU1 %s, each 4096 MiB; %s",
		took.Seconds(), node, v100DRAType, strings.Join(byGPU[0], " "), strings.Join(byGPU[1], " "), wait), nil
}

func (a *autoscaler) fragmentedPlugin() (string, error) {
	if err := a.nodePool("v100", v100Type, "true"); err != nil {
		return "", err
	}
	launched := a.cloud.launchedCount()
	sizes := map[string]int64{"frag-a": 5, "frag-b": 5, "frag-c": 8}
	var pods []*corev1.Pod
	for _, name := range []string{"frag-a", "frag-b", "frag-c"} {
		pods = append(pods, notebook(name, "v100", sizes[name]))
	}
	if _, err := a.runUntilRunning(newTimeline(), pods, 5*time.Minute); err != nil {
		return "", err
	}
	if n := a.cloud.launchedCount() - launched; n != 1 {
		return "", fmt.Errorf("%d nodes launched for 18 units, want 1", n)
	}
	node := a.nodeOf("frag-a")
	inst, err := a.cloud.node(node)
	if err != nil {
		return "", err
	}
	// Where gpumem put each (binpack, in kubelet's admission order).
	gpuOf := map[string]uint32{}
	if err := waitFor(30*time.Second, "gpumem lists the three pods", func() (bool, error) {
		st, err := (&suite{c: inst.c}).gpumemStatus()
		if err != nil {
			return false, err
		}
		for _, c := range st.Containers {
			if c.Pod != nil {
				gpuOf[*c.Pod] = c.Gpu
			}
		}
		return len(gpuOf) == 3, fmt.Errorf("containers %v", gpuOf)
	}); err != nil {
		return "", err
	}
	// End one pod so that both GPUs keep some: 17 units free, at most 10
	// on one GPU.
	var ended string
	var free [2]int64
	for _, p := range []string{"frag-a", "frag-b", "frag-c"} {
		used := [2]int64{}
		for q, g := range gpuOf {
			if q != p {
				used[g] += sizes[q]
			}
		}
		if used[0] > 0 && used[1] > 0 {
			ended, free = p, [2]int64{15 - used[0], 15 - used[1]}
			break
		}
	}
	if ended == "" {
		return "", fmt.Errorf("no pod to end that leaves both GPUs in use: %v", gpuOf)
	}
	if err := a.deletePod(ended); err != nil {
		return "", err
	}
	if free[0]+free[1] < 15 || free[0] >= 15 || free[1] >= 15 {
		return "", fmt.Errorf("free per GPU %v: not the case under test", free)
	}
	launched = a.cloud.launchedCount()
	began := time.Now()
	if err := a.createPod(notebook("frag-15", "v100", 15)); err != nil {
		return "", err
	}
	pod, err := a.waitPhase("frag-15", corev1.PodFailed, 2*time.Minute)
	if err != nil {
		return "", err
	}
	failed := time.Since(began)
	if pod.Spec.NodeName != node || pod.Status.Reason != "UnexpectedAdmissionError" || !strings.Contains(pod.Status.Message, "no single GPU has 15 free units") {
		return "", fmt.Errorf("frag-15 on %q: %s: %s; want UnexpectedAdmissionError on %s naming the GPUs' free units", pod.Spec.NodeName, pod.Status.Reason, pod.Status.Message, node)
	}
	// Karpenter saw no pending pod to launch for (its batch window is 10 s).
	if err := waitFor(15*time.Second, "no node launched for frag-15", func() (bool, error) {
		if n := a.cloud.launchedCount() - launched; n != 0 {
			return false, fatal{fmt.Errorf("%d nodes launched", n)}
		}
		return false, nil
	}); err != nil && !strings.Contains(err.Error(), "not within") {
		return "", err
	}
	for _, p := range []string{"frag-a", "frag-b", "frag-c", "frag-15"} {
		if p != ended {
			if err := a.deletePod(p); err != nil {
				return "", err
			}
		}
	}
	return fmt.Sprintf("free per GPU %d and %d (%d on the node): kube-scheduler bound it, kubelet refused it %.1f s after creation (%s: %s); nodes launched: 0",
		free[0], free[1], free[0]+free[1], failed.Seconds(), pod.Status.Reason, pod.Status.Message), nil
}

func (a *autoscaler) fragmentedDRA() (string, error) {
	if a.draNode == "" {
		return "", fmt.Errorf("needs the DRA node of the DRA scale-up scenario")
	}
	byGPU, err := a.claimsByGPU(a.draNode, 6, 4096)
	if err != nil {
		return "", err
	}
	// Two of GPU0's three claims and one of GPU1's end: 11Gi and 7Gi free,
	// 18Gi on the node.
	for _, name := range append(byGPU[0][:2], byGPU[1][0]) {
		if err := a.deleteDRANotebook(name); err != nil {
			return "", err
		}
	}
	if _, err := a.claimsByGPU(a.draNode, 3, 4096); err != nil {
		return "", err
	}
	launched := a.cloud.launchedCount()
	pod, err := a.draNotebook("dra-15", "dra", "15Gi")
	if err != nil {
		return "", err
	}
	tl := newTimeline()
	var pendingOnOld bool
	began := time.Now()
	if err := a.createPod(pod); err != nil {
		return "", err
	}
	var reason string
	err = waitFor(5*time.Minute, "dra-15 Running", func() (bool, error) {
		if err := a.observe(tl, []string{"dra-15"}); err != nil {
			return false, err
		}
		p, err := a.c.admin.CoreV1().Pods(namespace).Get(ctx, "dra-15", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if p.Spec.NodeName == a.draNode {
			pendingOnOld = true
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && reason == "" {
				reason = c.Message
			}
		}
		return p.Status.Phase == corev1.PodRunning, fmt.Errorf("%s on %q; %s", p.Status.Phase, p.Spec.NodeName, a.claimStates())
	})
	if err != nil {
		return "", err
	}
	took := time.Since(began)
	if pendingOnOld {
		return "", fmt.Errorf("dra-15 was bound to %s, where no GPU has 15Gi free", a.draNode)
	}
	if n := a.cloud.launchedCount() - launched; n != 1 {
		return "", fmt.Errorf("%d nodes launched for dra-15, want 1", n)
	}
	node := a.nodeOf("dra-15")
	if _, err := a.claimsByGPU(node, 1, 15360); err != nil {
		return "", err
	}
	wait, err := a.waitedForTaint(tl, node)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("Pending (%q) → Running on a new node %s, capped at 15360 MiB: %.1f s; nodes launched: 1; %s", reason, node, took.Seconds(), wait), nil
}
