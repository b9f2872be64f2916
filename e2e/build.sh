#!/usr/bin/env bash
# Builds what the e2e suite runs, from Go modules (nothing vendored): the
# upstream kube-apiserver, kube-scheduler, kube-controller-manager and kubelet
# of the k8s.io/kubernetes version e2e/go.mod requires, an etcd server from
# e2e/etcd/go.mod (its own module: etcd's grpc and otel versions differ from
# kubernetes'), and the suite's runner (e2e/cmd/gpumem-e2e).
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

cd "$here"
kube=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
major=${kube#v}
major=${major%%.*}
minor=${kube#v*.}
minor=${minor%%.*}
# What `make` in kubernetes stamps: the components report it (node status,
# /version), and feature gates follow the binary's version.
v=k8s.io/component-base/version
ldflags="-s -w -X $v.gitVersion=$kube -X $v.gitMajor=$major -X $v.gitMinor=$minor -X $v.gitTreeState=clean"

components=(kube-apiserver kube-scheduler kube-controller-manager kubelet)
pkgs=()
for c in "${components[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
if [ -d cmd/gpumem-e2e ]; then pkgs+=(./cmd/gpumem-e2e); fi

start=$SECONDS
go build -trimpath -ldflags "$ldflags" -o "$out/" "${pkgs[@]}"
(cd etcd && go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3)
echo "e2e/build.sh: kubernetes $kube and etcd $(cd etcd && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3) in $out ($((SECONDS - start)) s)"
