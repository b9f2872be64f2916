// The runner's command line: where the binaries, fixtures and manifests
// are, which phases and scenarios to run, and the benchmarks that replace
// the suite.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// options is the parsed command line.
type options struct {
	cfg             config // what every phase's cluster starts from
	extenderFixture string
	containerd2     string
	phases          []string
	run             *regexp.Regexp // the scenarios to run, by name
	keep            bool
	bench           benchConfig
}

func parseFlags() options {
	repo, _ := filepath.Abs(filepath.Join(filepath.Dir(os.Args[0]), "..", "..", ".."))
	var o options
	cfg := &o.cfg
	var noContainerd bool
	flag.StringVar(&cfg.bin, "bin", filepath.Dir(os.Args[0]), "directory with etcd, kube-apiserver, kube-scheduler and kubelet (e2e/build.sh)")
	flag.StringVar(&cfg.kubelet, "kubelet", "", "the kubelet binary (default: --bin's): an older release's, to check version skew")
	phaseList := flag.String("phases", strings.Join(phaseNames, ","), "which phases to run, comma-separated: "+strings.Join(phaseNames, ", "))
	runPattern := flag.String("run", "", "run only the scenarios whose name matches this `regexp`, as go test -run does; each sets up what it needs (the phase's registration check runs first either way)")
	flag.StringVar(&cfg.gpumem, "gpumem", filepath.Join(repo, "target/debug/gpumem"), "the gpumem binary")
	flag.StringVar(&cfg.shim, "shim", filepath.Join(repo, "target/debug/libgpumem_shim.so"), "the shim library the init container installs")
	flag.StringVar(&cfg.fixture, "fake-gpus", filepath.Join(repo, "tests/fixtures/gpus/t4.toml"), "the node's GPUs (gpumem --fake-gpus) with the default scheduler")
	flag.StringVar(&o.extenderFixture, "extender-fake-gpus", filepath.Join(repo, "tests/fixtures/gpus/v100x2.toml"), "the node's GPUs with gpushare's extender")
	flag.StringVar(&cfg.manifest, "manifest", filepath.Join(repo, "daemonset/gpumem.yaml"), "the DaemonSet whose RBAC, command, args and env gpumem runs with")
	flag.StringVar(&cfg.extenderManifest, "extender-manifest", filepath.Join(repo, "daemonset/extender.yaml"), "the extender's Deployment and RBAC")
	flag.StringVar(&cfg.secondScheduler, "second-scheduler-manifest", filepath.Join(repo, "daemonset/second-scheduler.yaml"), "a second kube-scheduler with the extender in its pod, chosen by schedulerName")
	flag.StringVar(&cfg.schedulerConfig, "scheduler-config", filepath.Join(repo, "daemonset/kube-scheduler-config.yaml"), "kube-scheduler's configuration with the extender")
	flag.StringVar(&cfg.probe, "probe", filepath.Join(repo, "target/debug/gpumem-probe"), "the probe the real containers run")
	flag.StringVar(&cfg.fakeDriver, "fake-driver", filepath.Join(repo, "target/debug/libgpumem_fakegpu.so"), "the fake driver the real containers load as libcuda.so.1 and libnvidia-ml.so.1")
	flag.StringVar(&o.containerd2, "containerd2", "", "directory of containerd 2.x's containerd, ctr and containerd-shim-runc-v2 for the containerd2 phase (default: --bin's containerd-v2)")
	flag.StringVar(&cfg.image, "image", "", "the release image's OCI archive (.ci/build-image.py) for the containerd phase to import and run gpumem from")
	flag.BoolVar(&noContainerd, "no-containerd", false, "leave out the real containers (containerd and runc): the containerd and containerd2 phases")
	flag.BoolVar(&o.keep, "keep", false, "keep the run's directory (logs, configs) after the run")
	flag.IntVar(&o.bench.restarts, "bench-restarts", 0, "instead of the suite: restart kubelet this many times on the --fake-gpus node and time restart → allocatable")
	flag.StringVar(&o.bench.unit, "bench-unit", "GiB", "with --bench-restarts: gpumem's --memory-unit")
	flag.Int64Var(&o.bench.hold, "bench-hold", 0, "with --bench-restarts: units a pod holds through the restarts")
	flag.IntVar(&o.bench.admissions, "bench-admissions", 0, "instead of the suite: time this many pods created → container created → Running through the device plugin, then the DRA driver")
	flag.Parse()

	o.phases = strings.Split(*phaseList, ",")
	for _, name := range o.phases {
		if !slices.Contains(phaseNames, name) {
			fail("--phases: no phase %q (%s)", name, strings.Join(phaseNames, ", "))
		}
	}
	if noContainerd {
		o.phases = slices.DeleteFunc(o.phases, func(n string) bool { return n == "containerd" || n == "containerd2" })
	}
	var err error
	if o.run, err = regexp.Compile(*runPattern); err != nil {
		fail("--run: %v", err)
	}
	if cfg.kubelet == "" {
		cfg.kubelet = filepath.Join(cfg.bin, "kubelet")
	}
	if o.containerd2 == "" {
		o.containerd2 = filepath.Join(cfg.bin, "containerd-v2")
	}
	for _, f := range []*string{&o.containerd2, &cfg.bin, &cfg.kubelet, &cfg.gpumem, &cfg.shim, &cfg.fixture, &cfg.manifest, &cfg.extenderManifest, &cfg.schedulerConfig, &cfg.secondScheduler, &o.extenderFixture, &cfg.probe, &cfg.fakeDriver} {
		// kubelet runs in its own working directory.
		if abs, err := filepath.Abs(*f); err == nil {
			*f = abs
		}
	}
	return o
}

// check fails unless the runner can run: root, and the files the chosen
// phases need.
func (o options) check() {
	if os.Geteuid() != 0 {
		fail("needs root (kubelet, mount namespaces)")
	}
	cfg := o.cfg
	need := []string{cfg.kubelet, cfg.gpumem, cfg.shim, cfg.fixture, cfg.manifest, cfg.extenderManifest, cfg.schedulerConfig, cfg.secondScheduler, o.extenderFixture}
	if (slices.Contains(o.phases, "containerd") || slices.Contains(o.phases, "containerd2")) && o.bench.restarts == 0 && o.bench.admissions == 0 {
		need = append(need, cfg.probe, cfg.fakeDriver)
	}
	for _, f := range need {
		if _, err := os.Stat(f); err != nil {
			fail("%v", err)
		}
	}
}

// fail ends the runner on a usage or set-up error, before any cluster.
func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "gpumem-e2e: "+format+"\n", args...)
	os.Exit(2)
}
