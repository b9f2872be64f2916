// The phases: one cluster each, with its front end, fixture and runtime,
// and the scenario tables (a file per feature) run on it. A new phase is
// one entry in phases, and its name in phaseNames.
package main

import (
	"path/filepath"
)

// phase is one cluster and what runs on it.
type phase struct {
	name, title string
	cfg         config
	// gate is what every other scenario of the phase needs, gpumem
	// registered: run first, unreported when --run leaves it out, and
	// when it fails the others are counted failed without running.
	gate      scenario
	scenarios []scenario
	note      string // printed under the title, when the phase leaves something out
	// story: the scenarios are steps that build on each other, run in
	// order up to the last one --run picks, without a sweep between them.
	story bool
	// after, when set, runs once the phase's scenarios are done, before
	// its cluster goes down.
	after func()
}

// phaseNames are --phases' values, in the order they run.
var phaseNames = []string{"plugin", "extender", "dra", "containerd", "containerd2", "autoscale"}

// phases is every phase of the suite, in order, their clusters in
// directories of work.
func phases(o options, work string) []phase {
	plugin := pluginConfig(o.cfg, work)
	extender := o.cfg
	extender.fixture = o.extenderFixture
	extender.work = filepath.Join(work, "gpushare-extender")
	dra := draConfig(o.cfg, work)
	real := plugin
	real.containerd = true
	real.work = filepath.Join(work, "containerd")
	// containerd 2.x with CDI: the device plugin's cdi strategy, then the
	// DRA driver, on clusters of their own (each front end owns the node's
	// state directory).
	cdi := real
	cdi.containerd2 = o.containerd2
	cdi.work = filepath.Join(work, "containerd2")
	cdiDRA := dra
	cdiDRA.containerd, cdiDRA.containerd2 = true, o.containerd2
	cdiDRA.work = filepath.Join(work, "containerd2-dra")

	// A control plane only: Karpenter launches the nodes (autoscale.go).
	autoscale := plugin
	autoscale.noNode = true
	autoscale.work = filepath.Join(work, "autoscale")

	registers := scenario{"plugin registers with kubelet", (*suite).registers}
	draRegisters := scenario{"DRA driver registers and publishes consumable capacity", (*suite).draRegisters}
	containers, note := containerScenarios, ""
	if real.image != "" {
		containers = append(containers, releaseScenarios...)
	} else {
		note = "no release image archive (--image): build it with .ci/build-image.py to run gpumem from it"
	}
	return []phase{
		{"plugin", "device plugin, default scheduler, " + filepath.Base(plugin.fixture), plugin, registers, pluginScenarios, "", false, nil},
		{"extender", "gpushare extender in kube-scheduler, " + filepath.Base(extender.fixture), extender, registers, extenderScenarios, "", false, nil},
		{"dra", "DRA driver, " + filepath.Base(dra.fixture), dra, draRegisters, draScenarios, "", false, nil},
		{"containerd", "real containers: containerd and runc, device plugin, " + filepath.Base(real.fixture), real, registers, containers, note, false, nil},
		{"containerd2", "real containers: containerd 2.x with CDI and runc, device plugin, " + filepath.Base(cdi.fixture), cdi, registers, cdiContainerScenarios, "", false, nil},
		{"containerd2", "real containers: containerd 2.x with CDI and runc, DRA driver, " + filepath.Base(cdiDRA.fixture), cdiDRA, draRegisters, draContainerScenarios, "", false, nil},
		autoscalePhase(autoscale),
	}
}

// pluginConfig is the device plugin's cluster with the default scheduler.
func pluginConfig(cfg config, work string) config {
	cfg.extenderManifest, cfg.schedulerConfig = "", ""
	cfg.work = filepath.Join(work, "default-scheduler")
	return cfg
}

// draConfig is the DRA driver's cluster, as daemonset/gpumem-dra.yaml runs it.
func draConfig(cfg config, work string) config {
	cfg.extenderManifest, cfg.schedulerConfig = "", ""
	cfg.manifest = draManifest(cfg.manifest)
	cfg.work = filepath.Join(work, "dra")
	return cfg
}

// draManifest is daemonset/gpumem-dra.yaml beside the device plugin's
// manifest.
func draManifest(manifest string) string {
	return filepath.Join(filepath.Dir(manifest), "gpumem-dra.yaml")
}
