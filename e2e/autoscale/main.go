// gpumem-karpenter runs Karpenter's own controllers (provisioning, the
// NodeClaim lifecycle, disruption and consolidation, termination) with a
// cloud provider whose instances are kubelets that gpumem-e2e starts on
// this machine, each running gpumem as daemonset/gpumem.yaml runs it.
//
// It is built in a module of its own: sigs.k8s.io/karpenter pins other
// Kubernetes versions than the suite's and a newer Go (e2e/build.sh).
//
// Configuration is Karpenter's (its flags and env, e.g. IGNORE_DRA_REQUESTS)
// plus, in the env, KUBECONFIG and GPUMEM_E2E_INSTANCES: the unix socket
// where gpumem-e2e serves the instance API (provider.go).
package main

import (
	"fmt"
	"os"

	"github.com/samber/lo"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"sigs.k8s.io/karpenter/pkg/cloudprovider/overlay"
	"sigs.k8s.io/karpenter/pkg/controllers"
	"sigs.k8s.io/karpenter/pkg/controllers/node/health"
	"sigs.k8s.io/karpenter/pkg/controllers/state"
	"sigs.k8s.io/karpenter/pkg/operator"
)

func main() {
	socket := os.Getenv("GPUMEM_E2E_INSTANCES")
	if socket == "" {
		fmt.Fprintln(os.Stderr, "gpumem-karpenter: GPUMEM_E2E_INSTANCES (the runner's instance API socket) is not set")
		os.Exit(2)
	}
	ctx, op := operator.NewOperator()
	provider, err := newProvider(ctx, socket, op.InstanceTypeStore)
	if err != nil {
		log.FromContext(ctx).Error(err, "reading the instance types")
		os.Exit(1)
	}
	cloudProvider := overlay.Decorate(provider, op.GetClient(), op.InstanceTypeStore)
	repair := lo.Must(health.NewRepairPolicyMatcher(ctx, cloudProvider))
	cluster := state.NewCluster(op.Clock, op.GetClient(), cloudProvider, state.WithRepairPolicyMatcher(repair))
	op.WithControllers(ctx, controllers.NewControllers(
		ctx,
		op.Manager,
		op.Clock,
		op.GetClient(),
		op.EventRecorder,
		cloudProvider,
		provider,
		cluster,
		op.InstanceTypeStore,
		op.PredictionStore,
	)...).Start(ctx)
}
