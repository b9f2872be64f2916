#!/usr/bin/env bash
# The end-to-end suite: gpumem against upstream etcd, kube-apiserver,
# kube-scheduler and kubelet on 127.0.0.1 (README.md, "End-to-end suite").
#
#   e2e/run.sh [gpumem-e2e flags, e.g. --keep]
#
# Needs root (kubelet, a mount namespace), Go 1.26 and the Go module proxy
# (e2e/build.sh), util-linux's unshare, nsenter and mount, gpumem's debug
# build (`cargo build --workspace`; `cargo test --workspace` makes the same
# files), and for the real containers containerd and runc (Debian's: apt-get
# install containerd runc; build.sh builds containerd 2.x for CDI, over the
# same runc; --no-containerd leaves them out).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
bin=${GPUMEM_E2E_BIN:-$repo/target/e2e/bin}

if [ "$(id -u)" != 0 ]; then
    echo "e2e/run.sh: run as root: kubelet runs in its own mount namespace" >&2
    exit 2
fi
for tool in unshare nsenter mount; do
    command -v "$tool" >/dev/null 2>&1 || {
        echo "e2e/run.sh: $tool is required (apt-get install util-linux mount)" >&2
        exit 2
    }
done
case " $* " in
*" --no-containerd "*) ;;
*)
    for tool in containerd ctr runc; do
        command -v "$tool" >/dev/null 2>&1 || {
            echo "e2e/run.sh: $tool is required for the real containers (apt-get install containerd runc), or pass --no-containerd" >&2
            exit 2
        }
    done
    ;;
esac
GPUMEM_E2E_BIN=$bin "$here/build.sh"
gpumem=$repo/target/debug/gpumem
shim=$repo/target/debug/libgpumem_shim.so
probe=$repo/target/debug/gpumem-probe
fake=$repo/target/debug/libgpumem_fakegpu.so
if [ ! -x "$gpumem" ] || [ ! -f "$shim" ] || [ ! -x "$probe" ] || [ ! -f "$fake" ]; then
    (cd "$repo" && cargo build --workspace --locked)
fi
# The release image's archive, where .ci/run (or .ci/build-image.py) built
# it: the containerd phase imports it and runs gpumem from it.
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/Cargo.toml" | head -n 1)
image=()
archive=$repo/target/image/gpumem-$version-amd64.oci.tar
[ "$(uname -m)" != x86_64 ] || [ ! -f "$archive" ] || image=(--image "$archive")
run() {
    "$bin/gpumem-e2e" "${image[@]}" --bin "$bin" --gpumem "$gpumem" --shim "$shim" --probe "$probe" --fake-driver "$fake" \
        --fake-gpus "$repo/tests/fixtures/gpus/t4.toml" --manifest "$repo/daemonset/gpumem.yaml" "$@"
}
# Every phase on the release's own kubelet, then the device plugin and the
# DRA driver on the oldest kubelet gpumem supports under the same control
# plane (the extender's part is kube-scheduler's, already covered).
status=0
run "$@" || status=$?
echo "== again on kubelet $("$bin/v1.34/kubelet" --version 2>/dev/null | awk '{print $2}')"
run --kubelet "$bin/v1.34/kubelet" --phases plugin,dra "$@" || status=$?
exit $status
