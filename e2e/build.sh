#!/usr/bin/env bash
# Builds what the e2e suite runs, from Go modules (nothing vendored): the
# upstream kube-apiserver, kube-scheduler, kube-controller-manager and kubelet
# of the k8s.io/kubernetes version e2e/go.mod requires, an etcd server from
# e2e/etcd/go.mod (its own module: etcd's grpc and otel versions differ from
# kubernetes'), containerd 2.x from e2e/containerd-v2/go.mod (its own module
# too) for the real containers with CDI, and the suite's runner
# (e2e/cmd/gpumem-e2e), and for the autoscale phase Karpenter's controllers
# with the suite's cloud provider (e2e/autoscale, its own module) and
# Karpenter's CRDs from that module.
#
# Output: target/e2e/bin/ (or $GPUMEM_E2E_BIN). Go's build cache (GOCACHE)
# keeps later builds fast; docs/BENCHMARKS.md has the cold and warm times.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${GPUMEM_E2E_BIN:-$here/../target/e2e/bin}
mkdir -p "$out"
out=$(cd "$out" && pwd)

command -v go >/dev/null 2>&1 || {
    echo "e2e/build.sh: go is required (Go 1.26 or later)" >&2
    exit 1
}
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"

# What `make` in kubernetes stamps for release $1: the components report it
# (node status, /version), and feature gates follow the binary's version.
stamp() {
    local major=${1#v} minor=${1#v*.} v=k8s.io/component-base/version
    major=${major%%.*}
    minor=${minor%%.*}
    echo "-s -w -X $v.gitVersion=$1 -X $v.gitMajor=$major -X $v.gitMinor=$minor -X $v.gitTreeState=clean"
}

cd "$here"
kube=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
ldflags=$(stamp "$kube")

components=(kube-apiserver kube-scheduler kube-controller-manager kubelet)
pkgs=()
for c in "${components[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
if [ -d cmd/gpumem-e2e ]; then pkgs+=(./cmd/gpumem-e2e); fi

start=$SECONDS
go build -trimpath -ldflags "$ldflags" -o "$out/" "${pkgs[@]}"
(cd etcd && go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3)
# An older kubelet under the same control plane, from its own module (its
# staging modules pin other versions): the skew a cluster meets while it
# upgrades. v1.34 is the first kubelet of consumable capacity.
old=$(cd kubelet-v1.34 && go list -m -f '{{.Version}}' k8s.io/kubernetes)
(cd kubelet-v1.34 && go build -trimpath -ldflags "$(stamp "$old")" -o "$out/v1.34/kubelet" k8s.io/kubernetes/cmd/kubelet)
# containerd 2.x, the first with CDI (Debian 12's 1.6 has none): the daemon,
# ctr and the runc shim, which the runner puts first on containerd's PATH.
# no_btrfs: no btrfs headers to build against (the suite uses overlayfs).
ctrd=$(cd containerd-v2 && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)
ctrdpkgs=()
for c in containerd ctr containerd-shim-runc-v2; do ctrdpkgs+=("github.com/containerd/containerd/v2/cmd/$c"); done
mkdir -p "$out/containerd-v2"
(cd containerd-v2 && go build -trimpath -tags no_btrfs -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${ctrd#v}" -o "$out/containerd-v2/" "${ctrdpkgs[@]}")
# Karpenter (sigs.k8s.io/karpenter) wants a newer Go than the suite's
# 1.26: the go command fetches that toolchain from the module proxy like a
# module, for this module's build only (GOTOOLCHAIN is not exported).
karpenter_go=${GPUMEM_E2E_KARPENTER_GO:-go1.27.3}
(cd autoscale && GOTOOLCHAIN=$karpenter_go go build -trimpath -ldflags "-s -w" -o "$out/gpumem-karpenter" .)
karpenter=$(cd autoscale && GOTOOLCHAIN=$karpenter_go go list -m -f '{{.Dir}} {{.Version}}' sigs.k8s.io/karpenter)
rm -rf "$out/karpenter-crds"
mkdir -p "$out/karpenter-crds"
# Its CRDs, and the NodeClass of its own test provider (kwok), which the
# suite's provider names.
cp "${karpenter% *}"/pkg/apis/crds/*.yaml "${karpenter% *}"/kwok/apis/crds/*.yaml "$out/karpenter-crds/"
chmod u+w "$out"/karpenter-crds/*.yaml
echo "e2e/build.sh: kubernetes $kube, kubelet $old, etcd $(cd etcd && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3) containerd $ctrd and karpenter ${karpenter#* } in $out ($((SECONDS - start)) s)"
