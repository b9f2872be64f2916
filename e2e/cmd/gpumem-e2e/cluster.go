// A one-node cluster on 127.0.0.1 in a temporary directory: etcd,
// kube-apiserver (RBAC, Node authorizer, NodeRestriction), kube-scheduler
// and a kubelet in its own mount namespace over the recording fake runtime
// or over containerd and runc (containerd.go); then gpumem, started as
// daemonset/gpumem.yaml starts it, with the service account's token and so
// the RBAC that manifest grants.
package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
)

const nodeName = "e2e-node"

type config struct {
	bin      string // etcd, kube-* and kubelet
	kubelet  string // the kubelet binary: bin's, or an older release's
	gpumem   string
	shim     string
	fixture  string
	manifest string // daemonset/gpumem.yaml
	work     string
	// With gpushare's extender: daemonset/extender.yaml and
	// daemonset/kube-scheduler-config.yaml; empty for the default scheduler.
	extenderManifest string
	schedulerConfig  string
	// daemonset/second-scheduler.yaml: kube-scheduler and the extender in
	// one pod, chosen by schedulerName (extender phase only).
	secondScheduler string
	memoryUnit      string // replaces the manifest's --memory-unit when set
	// containerd and runc instead of the fake runtime; the probe and the
	// fake driver go into the image its pods run (image.go).
	containerd bool
	probe      string
	fakeDriver string
	// With containerd: the directory of containerd 2.x's containerd, ctr
	// and runc shim, which run with CDI on; empty for Debian's 1.6.
	containerd2 string
	// With containerd: the release image's OCI archive (.ci/build-image.py),
	// imported and run; empty leaves that scenario out.
	image string
	// The control plane only: no runtime, kubelet or gpumem (the autoscale
	// phase starts its nodes as Karpenter asks for them, autoscale*.go).
	noNode bool
}

type cluster struct {
	cfg  config
	logs string
	pki  *pki
	node string // the Node kubelet registers and gpumem serves

	// More of kubelet's configuration (YAML) and flags, for nodes that
	// register as a cloud's instance does (autoscale_instances.go).
	kubeletConfig string
	kubeletFlags  []string
	gpumemFlags   []string // after the manifest's

	etcd, apiserver, controllers, scheduler, kubelet, gpumem, extender *proc
	extenderURL                                                        string
	extra                                                              []*proc           // started by scenarios
	runtime                                                            *recordingRuntime // nil with containerd
	containerd                                                         *proc
	snapshotter                                                        string
	stateShared                                                        bool

	server string // https://127.0.0.1:port
	// The manifest's init containers (install-shim), which run from the
	// release image too when cfg.image is set.
	initContainers []corev1.Container
	admin          *kubernetes.Clientset

	kubeletRoot   string // bound at /var/lib/kubelet in kubelet's namespace
	kubeletLogDir string // bound at /var/log
	kubeletArgv   []string
	gpumemArgv    []string
	gpumemEnv     []string
	statusSocket  string
	saKey         string
	stateDir      string
	shimDir       string
	gpusFile      string // gpumem's --fake-gpus: this run's copy of the fixture (health.go edits it)
}

// cdiDir is where gpumem writes CDI specs (the manifests' /var/run/cdi)
// and, for containerd 2.x, where it reads them.
func (c *cluster) cdiDir() string { return c.path("cdi") }

func (c *cluster) path(parts ...string) string {
	return filepath.Join(append([]string{c.cfg.work}, parts...)...)
}

func up(cfg config) (*cluster, error) {
	c := &cluster{cfg: cfg, node: nodeName}
	c.logs = c.path("logs")
	for _, d := range []string{c.logs, c.path("etcd"), c.path("kubelet-cwd")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return c, err
		}
	}
	var err error
	if c.pki, err = newPKI(c.path("pki")); err != nil {
		return c, err
	}
	// kubelet's hard-coded directories, bound to these in its namespace.
	c.kubeletRoot = c.path("kubelet")
	c.kubeletLogDir = c.path("var-log")
	c.stateDir = c.path("gpumem-state")
	for _, d := range []string{filepath.Join(c.kubeletRoot, "device-plugins"), c.kubeletLogDir, "/var/lib/kubelet"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return c, err
		}
	}
	steps := []struct {
		what string
		run  func() error
	}{
		{"etcd", c.startEtcd},
		{"kube-apiserver", c.startAPIServer},
		{"kube-controller-manager", c.startControllerManager},
		{"kube-scheduler", c.startScheduler},
		{"container runtime", c.startRuntime},
		{"kubelet", c.startKubelet},
		{"gpumem", c.startGpumem},
	}
	if cfg.noNode {
		steps = steps[:4]
	}
	for _, s := range steps {
		if err := s.run(); err != nil {
			return c, fmt.Errorf("%s: %w (logs in %s)", s.what, err, c.logs)
		}
	}
	return c, nil
}

func (c *cluster) down() {
	for _, p := range append(c.extra, c.gpumem, c.kubelet, c.scheduler, c.extender, c.controllers, c.apiserver, c.etcd) {
		p.stop(10 * time.Second)
	}
	if c.runtime != nil {
		c.runtime.stop()
	}
	c.stopContainerd()
	c.unmountAll()
}

// unmountAll detaches what is still mounted under the run's directory, as
// a node's reboot would: gpumem (--bound-state-dirs) mounts a tmpfs per
// container's state directory in the namespace it runs in, this one.
func (c *cluster) unmountAll() {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var points []string
	for _, line := range strings.Split(string(data), "\n") {
		fields := strings.Fields(line)
		if len(fields) > 4 && strings.HasPrefix(fields[4], c.cfg.work+"/") {
			points = append(points, fields[4])
		}
	}
	// Deepest first.
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil {
			fmt.Fprintf(os.Stderr, "gpumem-e2e: unmount %s: %v\n", p, err)
		}
	}
}

func (c *cluster) startEtcd() error {
	client, err := freePort()
	if err != nil {
		return err
	}
	peer, err := freePort()
	if err != nil {
		return err
	}
	clientURL := fmt.Sprintf("http://127.0.0.1:%d", client)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peer)
	c.etcd, err = start(c.logs, "etcd", "", nil, filepath.Join(c.cfg.bin, "etcd"),
		"--name=e2e", "--data-dir="+c.path("etcd"),
		"--listen-client-urls="+clientURL, "--advertise-client-urls="+clientURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=e2e="+peerURL, "--unsafe-no-fsync")
	if err != nil {
		return err
	}
	c.server = clientURL // until the API server is up
	return waitFor(30*time.Second, "etcd healthy", func() (bool, error) {
		if c.etcd.exited() {
			return false, fatal{fmt.Errorf("exited: %v", c.etcd.err)}
		}
		return httpOK(clientURL + "/health")
	})
}

func (c *cluster) startAPIServer() error {
	etcdURL := c.server
	port, err := freePort()
	if err != nil {
		return err
	}
	c.server = fmt.Sprintf("https://127.0.0.1:%d", port)
	serving, servingKey, err := c.pki.issue("apiserver", "kube-apiserver", nil, []string{"127.0.0.1", "localhost", "10.96.0.1"})
	if err != nil {
		return err
	}
	kubeletClient, kubeletClientKey, err := c.pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, nil)
	if err != nil {
		return err
	}
	saPub, saKey, err := c.pki.serviceAccountKey()
	c.saKey = saKey
	if err != nil {
		return err
	}
	c.apiserver, err = start(c.logs, "kube-apiserver", "", nil, filepath.Join(c.cfg.bin, "kube-apiserver"),
		"--etcd-servers="+etcdURL,
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", port), "--advertise-address=127.0.0.1",
		"--endpoint-reconciler-type=none",
		"--tls-cert-file="+serving, "--tls-private-key-file="+servingKey,
		"--client-ca-file="+c.pki.caFile(),
		"--kubelet-client-certificate="+kubeletClient, "--kubelet-client-key="+kubeletClientKey,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+saPub, "--service-account-signing-key-file="+saKey,
		"--service-cluster-ip-range=10.96.0.0/24",
		"--authorization-mode=Node,RBAC",
		"--enable-admission-plugins=NodeRestriction",
		"--cert-dir="+c.path("apiserver-certs"))
	if err != nil {
		return err
	}
	crt, key, err := c.pki.issue("admin", "e2e-admin", []string{"system:masters"}, nil)
	if err != nil {
		return err
	}
	adminConfig := c.path("admin.kubeconfig")
	if err := kubeconfig(adminConfig, c.server, c.pki.caFile(), crt, key, ""); err != nil {
		return err
	}
	rc, err := clientcmd.BuildConfigFromFlags("", adminConfig)
	if err != nil {
		return err
	}
	rc.QPS, rc.Burst = 100, 200
	if c.admin, err = kubernetes.NewForConfig(rc); err != nil {
		return err
	}
	if err := waitFor(90*time.Second, "kube-apiserver ready", func() (bool, error) {
		if c.apiserver.exited() {
			return false, fatal{fmt.Errorf("exited: %v", c.apiserver.err)}
		}
		body, err := c.admin.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		if err != nil {
			return false, err
		}
		return string(body) == "ok", nil
	}); err != nil {
		return err
	}
	// No controller-manager: the service account its controller would create.
	return waitFor(30*time.Second, "default service account", func() (bool, error) {
		_, err := c.admin.CoreV1().ServiceAccounts("default").Create(context.Background(),
			&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
		return err == nil || apierrors.IsAlreadyExists(err), err
	})
}

// componentConfig writes a kubeconfig with a client certificate for user.
func (c *cluster) componentConfig(name, user string, groups ...string) (string, error) {
	crt, key, err := c.pki.issue(name, user, groups, nil)
	if err != nil {
		return "", err
	}
	path := c.path(name + ".kubeconfig")
	return path, kubeconfig(path, c.server, c.pki.caFile(), crt, key, "")
}

// startControllerManager runs the controllers a cluster has: among them the
// node lifecycle controller, which lifts the not-ready taint kubelet
// registers the node with, and the pod garbage collector.
func (c *cluster) startControllerManager() error {
	kc, err := c.componentConfig("controller-manager", "system:kube-controller-manager")
	if err != nil {
		return err
	}
	port, err := freePort()
	if err != nil {
		return err
	}
	c.controllers, err = start(c.logs, "kube-controller-manager", "", nil, filepath.Join(c.cfg.bin, "kube-controller-manager"),
		"--kubeconfig="+kc, "--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc,
		"--leader-elect=false", "--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", port),
		"--service-account-private-key-file="+c.saKey, "--root-ca-file="+c.pki.caFile(),
		"--use-service-account-credentials=true",
		"--cert-dir="+c.path("controller-manager-certs"))
	return err
}

func (c *cluster) startScheduler() error {
	kc, err := c.componentConfig("scheduler", "system:kube-scheduler")
	if err != nil {
		return err
	}
	cfg := c.path("scheduler-config.yaml")
	body := fmt.Sprintf("apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\nclientConnection:\n  kubeconfig: %s\n", kc)
	if c.cfg.schedulerConfig != "" {
		if err := c.startExtender(); err != nil {
			return fmt.Errorf("gpumem extender: %w", err)
		}
		// The shipped configuration, its kubeconfig and the extender's
		// address (the Service's node port there) moved to this run's.
		data, err := os.ReadFile(c.cfg.schedulerConfig)
		if err != nil {
			return err
		}
		body = strings.NewReplacer("/etc/kubernetes/scheduler.conf", kc, "http://127.0.0.1:32766", c.extenderURL).Replace(string(data))
		if !strings.Contains(body, c.extenderURL) {
			return fmt.Errorf("%s: no extender at http://127.0.0.1:32766", c.cfg.schedulerConfig)
		}
	}
	body += "leaderElection:\n  leaderElect: false\n"
	if err := os.WriteFile(cfg, []byte(body), 0o644); err != nil {
		return err
	}
	port, err := freePort()
	if err != nil {
		return err
	}
	c.scheduler, err = start(c.logs, "kube-scheduler", "", nil, filepath.Join(c.cfg.bin, "kube-scheduler"),
		"--config="+cfg, "--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", port),
		"--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc,
		"--cert-dir="+c.path("scheduler-certs"), "--v=3")
	return err
}

func (c *cluster) startRuntime() error {
	if c.cfg.containerd {
		return c.startContainerd()
	}
	var err error
	c.runtime, err = startRuntime(c.criSocket())
	return err
}

func (c *cluster) criSocket() string {
	if c.cfg.containerd {
		return c.containerdSocket()
	}
	return c.path("cri.sock")
}

func (c *cluster) startKubelet() error {
	kc, err := c.componentConfig("kubelet-"+c.node, "system:node:"+c.node, "system:nodes")
	if err != nil {
		return err
	}
	serving, servingKey, err := c.pki.issue("kubelet-serving-"+c.node, "system:node:"+c.node, []string{"system:nodes"}, []string{"127.0.0.1", "localhost", c.node})
	if err != nil {
		return err
	}
	port, err := freePort()
	if err != nil {
		return err
	}
	healthz, err := freePort()
	if err != nil {
		return err
	}
	cfg := c.path("kubelet-config.yaml")
	// cgroup v1 on the machines this runs on; no QoS cgroups, nothing to
	// enforce; node status every 2 s so that changes show quickly.
	body := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
tlsCertFile: %s
tlsPrivateKeyFile: %s
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: %s
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failCgroupV1: false
failSwapOn: false
resolvConf: ""
nodeStatusUpdateFrequency: 2s
evictionHard:
  memory.available: 1Mi
  nodefs.available: 1%%
  imagefs.available: 1%%
%s%s`, port, healthz, serving, servingKey, c.pki.caFile(), c.criSocket(), c.kubeletFeatureGates(), c.kubeletConfig)
	if err := os.WriteFile(cfg, []byte(body), 0o644); err != nil {
		return err
	}
	// kubelet hard-codes /var/lib/kubelet/device-plugins and /var/log/pods:
	// its own mount namespace with both bound to this run's directory.
	script := `set -e
mount --bind "$1" /var/lib/kubelet
mount --bind "$2" /var/log
shift 2
exec "$@"`
	c.kubeletArgv = []string{"unshare", "-m", "--propagation", "private", "sh", "-c", script, "kubelet-ns",
		c.kubeletRoot, c.kubeletLogDir}
	if c.cfg.containerd {
		// containerd's namespace, where both are bound already: the two
		// must see the same paths.
		c.kubeletArgv = []string{"nsenter", "--target", fmt.Sprint(c.containerd.cmd.Process.Pid), "--mount", "--wd=" + c.path("kubelet-cwd")}
	}
	c.kubeletArgv = append(c.kubeletArgv, c.cfg.kubelet, "--config="+cfg, "--kubeconfig="+kc,
		"--hostname-override="+c.node, "--node-ip=127.0.0.1", "--v=2")
	c.kubeletArgv = append(c.kubeletArgv, c.kubeletFlags...)
	if err := c.runKubelet(); err != nil {
		return err
	}
	return waitFor(90*time.Second, "node Ready", func() (bool, error) {
		if c.kubelet.exited() {
			return false, fatal{fmt.Errorf("kubelet exited: %v", c.kubelet.err)}
		}
		node, err := c.admin.CoreV1().Nodes().Get(context.Background(), c.node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue, fmt.Errorf("Ready=%s: %s", cond.Status, cond.Message)
			}
		}
		return false, nil
	})
}

// runKubelet starts kubelet in an empty working directory: with a runtime
// that reports no log path, its log clean-up deletes files in it.
func (c *cluster) runKubelet() error {
	var err error
	c.kubelet, err = start(c.logs, "kubelet", c.path("kubelet-cwd"), nil, c.kubeletArgv...)
	return err
}

// startGpumem applies the ServiceAccount and RBAC of daemonset/gpumem.yaml,
// gets the service account a token, runs the init container's command and
// then the plugin with the container's command, args and env, the host
// paths moved into this run's directory.
// applyManifest creates the ServiceAccount and RBAC objects of a manifest
// (Roles, ConfigMaps too) and returns its workload's namespace and pod spec
// (a DaemonSet's or a Deployment's); Services are left out: the runner
// connects directly.
func (c *cluster) applyManifest(path string) (string, *corev1.PodSpec, error) {
	ctx := context.Background()
	data, err := os.ReadFile(path)
	if err != nil {
		return "", nil, err
	}
	var ns string
	var spec *corev1.PodSpec
	for _, doc := range strings.Split(string(data), "\n---") {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			return "", nil, fmt.Errorf("%s: %w", path, err)
		}
		switch o := obj.(type) {
		case *appsv1.DaemonSet:
			ns, spec = o.Namespace, &o.Spec.Template.Spec
		case *appsv1.Deployment:
			ns, spec = o.Namespace, &o.Spec.Template.Spec
		case *corev1.Service:
		case *corev1.ServiceAccount:
			_, err = c.admin.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = c.admin.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = c.admin.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.Role:
			_, err = c.admin.RbacV1().Roles(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.RoleBinding:
			_, err = c.admin.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *corev1.ConfigMap:
			_, err = c.admin.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *resourcev1.DeviceClass:
			_, err = c.admin.ResourceV1().DeviceClasses().Create(ctx, o, metav1.CreateOptions{})
		default:
			return "", nil, fmt.Errorf("%s: unexpected %T", path, obj)
		}
		// Applied again (a second scenario running what the manifest
		// deploys, or each node of the autoscale phase): the objects are
		// the same.
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return "", nil, err
		}
	}
	if spec == nil {
		return "", nil, fmt.Errorf("%s: no DaemonSet or Deployment", path)
	}
	return ns, spec, nil
}

// tokenConfig writes a kubeconfig holding a token of the service account.
func (c *cluster) tokenConfig(ns, account, name string) (string, error) {
	token, err := c.admin.CoreV1().ServiceAccounts(ns).CreateToken(context.Background(), account,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](4 * 3600)}},
		metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("token for %s/%s: %w", ns, account, err)
	}
	kc := c.path(name + ".kubeconfig")
	return kc, kubeconfig(kc, c.server, c.pki.caFile(), "", "", token.Status.Token)
}

func containerNamed(spec *corev1.PodSpec, name string) (*corev1.Container, error) {
	for i := range spec.Containers {
		if spec.Containers[i].Name == name {
			return &spec.Containers[i], nil
		}
	}
	return nil, fmt.Errorf("no container %q", name)
}

// startExtender runs `gpumem extender` as daemonset/extender.yaml runs it,
// with that file's RBAC, listening on loopback where the scheduler's
// configuration points (the manifest's Service stands between them in a
// cluster).
func (c *cluster) startExtender() error {
	ns, spec, err := c.applyManifest(c.cfg.extenderManifest)
	if err != nil {
		return err
	}
	kc, err := c.tokenConfig(ns, spec.ServiceAccountName, "gpumem-extender")
	if err != nil {
		return err
	}
	ctr, err := containerNamed(spec, "extender")
	if err != nil {
		return fmt.Errorf("%s: %w", c.cfg.extenderManifest, err)
	}
	port, err := freePort()
	if err != nil {
		return err
	}
	c.extenderURL = fmt.Sprintf("http://127.0.0.1:%d", port)
	argv := []string{c.cfg.gpumem}
	for _, a := range append(ctr.Command[1:], ctr.Args...) {
		if strings.HasPrefix(a, "--listen-addr=") {
			a = fmt.Sprintf("--listen-addr=127.0.0.1:%d", port)
		}
		argv = append(argv, a)
	}
	argv = append(argv, "--kubeconfig="+kc)
	if c.extender, err = start(c.logs, "gpumem-extender", "", nil, argv...); err != nil {
		return err
	}
	return waitFor(30*time.Second, "extender /healthz", func() (bool, error) {
		if c.extender.exited() {
			return false, fatal{fmt.Errorf("exited: %v", c.extender.err)}
		}
		return httpOK(c.extenderURL + "/healthz")
	})
}

func (c *cluster) startGpumem() error {
	ns, spec, err := c.applyManifest(c.cfg.manifest)
	if err != nil {
		return err
	}
	kc, err := c.tokenConfig(ns, spec.ServiceAccountName, "gpumem")
	if err != nil {
		return err
	}

	metrics, err := freePort()
	if err != nil {
		return err
	}
	c.shimDir = c.path("usr-local-gpumem")
	hostPaths := strings.NewReplacer(
		"/var/lib/kubelet", c.kubeletRoot,
		"/var/lib/gpumem", c.stateDir,
		"/usr/local/gpumem", c.shimDir,
		"/var/run/cdi", c.cdiDir(),
	)
	rewrite := func(arg string) string {
		if arg == "--metrics-addr=:9400" {
			return fmt.Sprintf("--metrics-addr=127.0.0.1:%d", metrics)
		}
		return hostPaths.Replace(arg)
	}
	c.initContainers = spec.InitContainers
	for _, init := range spec.InitContainers {
		argv := []string{c.cfg.gpumem}
		for _, a := range append(init.Command[1:], init.Args...) {
			argv = append(argv, rewrite(a))
		}
		for i, a := range argv {
			if a == "/opt/gpumem/libgpumem_shim.so" {
				argv[i] = c.cfg.shim
			}
		}
		out, err := runCmd(argv...)
		if err != nil {
			return fmt.Errorf("init container %s: %w: %s", init.Name, err, out)
		}
	}
	ctr, err := containerNamed(spec, "gpumem")
	if err != nil {
		return fmt.Errorf("%s: %w", c.cfg.manifest, err)
	}
	c.gpumemArgv = []string{c.cfg.gpumem}
	for _, a := range append(ctr.Command[1:], ctr.Args...) {
		if c.cfg.extenderManifest != "" {
			switch a {
			case "--scheduler=default":
				// The manifest's comment names the other value.
				a = "--scheduler=gpushare-extender"
			case "--placement=binpack":
				// Following the extender, the plugin's own placement must
				// not matter: the other policy shows that it does not.
				a = "--placement=spread"
			}
		}
		if c.cfg.memoryUnit != "" && strings.HasPrefix(a, "--memory-unit=") {
			a = "--memory-unit=" + c.cfg.memoryUnit
		}
		c.gpumemArgv = append(c.gpumemArgv, rewrite(a))
	}
	c.gpusFile = c.path("gpus.toml")
	if err := c.setGPUsHealthy(true); err != nil {
		return err
	}
	c.gpumemArgv = append(c.gpumemArgv, "--fake-gpus="+c.gpusFile, "--kubeconfig="+kc)
	c.gpumemArgv = append(c.gpumemArgv, c.gpumemFlags...)
	c.gpumemEnv = nil
	for _, e := range ctr.Env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName":
			c.gpumemEnv = append(c.gpumemEnv, e.Name+"="+c.node)
		case e.ValueFrom == nil:
			c.gpumemEnv = append(c.gpumemEnv, e.Name+"="+rewrite(e.Value))
		}
		if e.Name == "GPUMEM_STATUS_SOCKET" {
			c.statusSocket = rewrite(e.Value)
		}
	}
	if err := os.MkdirAll(c.cdiDir(), 0o755); err != nil {
		return err
	}
	if err := c.shareStateDir(); err != nil {
		return err
	}
	return c.runGpumem()
}

func (c *cluster) runGpumem() error {
	var err error
	c.gpumem, err = start(c.logs, "gpumem", "", c.gpumemEnv, c.gpumemArgv...)
	return err
}

func runCmd(argv ...string) (string, error) {
	var out bytes.Buffer
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	return out.String(), err
}

// httpOK is whether GET url answers 200; the error says what it answered
// instead.
func httpOK(url string) (bool, error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		return false, err
	}
	resp.Body.Close()
	return resp.StatusCode == 200, fmt.Errorf("%s: %s", url, resp.Status)
}
