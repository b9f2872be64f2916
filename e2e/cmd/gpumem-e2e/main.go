// gpumem-e2e brings up a one-node cluster of upstream Kubernetes components
// on 127.0.0.1 (see cluster.go) per phase (phases.go), runs gpumem as its
// DaemonSet runs it, and checks what a user would (runner.go): one line per
// scenario, then "N passed, N failed", exiting non-zero on any failure.
// --run picks scenarios by name; each sets up what it needs itself.
package main

import (
	"fmt"
	"os"
	"time"
)

const (
	resourceName = "aliyun.com/gpu-mem"
	namespace    = "default"
)

func main() {
	o := parseFlags()
	o.check()
	work, err := os.MkdirTemp("", "gpumem-e2e-")
	if err != nil {
		fail("%v", err)
	}
	if o.bench.restarts > 0 {
		plugin := pluginConfig(o.cfg, work)
		plugin.memoryUnit = o.bench.unit
		os.Exit(runBench(plugin, o.bench, work, o.keep))
	}
	if o.bench.admissions > 0 {
		os.Exit(runAdmissionBench(pluginConfig(o.cfg, work), draConfig(o.cfg, work), o.bench.admissions, work, o.keep))
	}

	began := time.Now()
	s := &suite{}
	for _, name := range o.phases {
		for _, ph := range phases(o, work) {
			if ph.name == name {
				s.runPhase(ph, o.run)
			}
		}
	}
	fmt.Printf("%d passed, %d failed (%.0f s)\n", s.passed, s.failed, time.Since(began).Seconds())
	code := 0
	if s.failed > 0 {
		code = 1
	}
	if o.keep || code != 0 {
		fmt.Printf("logs and configs kept in %s\n", work)
	} else {
		os.RemoveAll(work)
	}
	os.Exit(code)
}
