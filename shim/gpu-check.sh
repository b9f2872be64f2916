#!/usr/bin/env bash
# The GPU checks of docs/GPU_VERIFICATION.md in one run, by hand on a host
# with an NVIDIA GPU. Build on a Rust machine first:
#   cargo build --release -p gpumem -p gpumem-shim -p gpumem-probe -p gpumem-fakegpu
#   mkdir -p carry/fake && cp target/release/{gpumem,libgpumem_shim.so,gpumem-probe} carry/
#   for l in libcuda.so.1 libnvidia-ml.so.1; do cp target/release/libgpumem_fakegpu.so carry/fake/$l; done
# then on the GPU host, in a checkout with carry/ copied in:
#   bash shim/gpu-check.sh carry LOGDIR [checks|footprint|train|fakebench|outside|all]...
# (`checks footprint` takes under ten minutes on an H100, `train` about as
# long, `outside` under a minute).
# Every command and its output go to LOGDIR/gpu-check.log; paste the results
# into docs/GPU_VERIFICATION.md and docs/BENCHMARKS.md.
# GPU_CHECK_FAKE=1 runs `outside` without a GPU, on the fake driver in
# CARRY_DIR/fake: a rehearsal of the script, not a check of the driver.
set -u
usage="usage: shim/gpu-check.sh CARRY_DIR OUT_DIR [checks|footprint|train|fakebench|outside|all]..."
bin=${1:?$usage}
out=${2:?$usage}
shift 2
parts=" ${*:-all} "
wants() { [[ $parts == *" $1 "* || $parts == *" all "* ]]; }
mkdir -p "$out"
log="$out/gpu-check.log"
# Scratch files go to a temporary directory, so LOGDIR holds only the log.
work=$(mktemp -d)
G="$bin/gpumem"
S="--shim=$bin/libgpumem_shim.so"
cap=4308MiB

step() {
    echo "### $*" | tee -a "$log"
    timeout 300 "$@" >>"$log" 2>&1
    echo "### exit $?" | tee -a "$log"
}

py() { step "$G" exec "$S" --mem "$cap" -- python3 -c "$1"; }

probe_bench() {
    # The shim's cost per alloc+free pair and per cuMemGetInfo on the real
    # driver (1 MiB pairs cost ~114 µs, so few are needed), 1 and 16
    # threads at once.
    local threads round
    for threads in 1 16; do
        for round in 1 2 3; do
            step "$bin/gpumem-probe" bench:2000:$threads
            step "$G" exec "$S" --mem 60GiB -- "$bin/gpumem-probe" bench:2000:$threads
        done
    done
}

fake_bench() {
    # The same on the fake driver, where the driver's own cost is tens of
    # nanoseconds, with this machine's 16 cores; also on the main thread,
    # where most programs allocate. `ldd --version` says which glibc.
    step ldd --version
    local threads round
    for threads in main 1 16; do
        for round in 1 2 3; do
            step env LD_LIBRARY_PATH="$bin/fake" "$bin/gpumem-probe" bench:200000:$threads
            step env LD_LIBRARY_PATH="$bin/fake" "$G" exec "$S" --mem 4308MiB --reconcile-secs 0 -- "$bin/gpumem-probe" bench:200000:$threads
        done
    done
}

train() {
    # Training-step overhead: plain and under the shim (a cap far above the
    # model's needs), alternated so drift hits both alike; then the worst
    # case, every tensor a cuMemAlloc. TRAIN_ROUNDS and TRAIN_WORST=0 trim it.
    local model uncached round worst=PYTORCH_NO_CUDA_MEMORY_CACHING=1
    [ "${TRAIN_WORST:-1}" = 0 ] && worst=
    for model in transformer resnet; do
        # Set only for the worst case: some PyTorch versions read any value as "on".
        for uncached in "" $worst; do
            for round in $(seq "${TRAIN_ROUNDS:-3}"); do
                step env $uncached python3 benches/train_step.py --model $model
                step env $uncached "$G" exec "$S" --mem 60GiB -- python3 benches/train_step.py --model $model
            done
        done
    done
}

checks() {
step "$G" exec "$S" --mem "$cap" -- nvidia-smi
py 'import pynvml as n; n.nvmlInit(); h=n.nvmlDeviceGetHandleByIndex(0); m=n.nvmlDeviceGetMemoryInfo(h); print("nvml total", m.total>>20, "used", m.used>>20, "free", m.free>>20)'
py 'import torch; f,t=torch.cuda.mem_get_info(); print("mem_get_info MiB", f>>20, t>>20, "total_memory MiB", torch.cuda.get_device_properties(0).total_memory>>20)'
py 'import torch
x = torch.empty(3 << 30, dtype=torch.uint8, device="cuda"); print("3 GiB ok")
try:
    y = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); print("UNEXPECTED: 2 more GiB fit")
except torch.cuda.OutOfMemoryError as e: print("OutOfMemoryError as expected:", str(e)[:120])'
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True py 'import torch
xs = []
try:
    while True: xs.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
except torch.cuda.OutOfMemoryError: print("expandable segments: OOM after", len(xs) * 256, "MiB")'
PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync py 'import torch
xs = []
try:
    while True: xs.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
except torch.cuda.OutOfMemoryError: print("cudaMallocAsync: OOM after", len(xs) * 256, "MiB")'
py 'import cupy
xs = []
try:
    while True: xs.append(cupy.empty(256 << 20, dtype=cupy.uint8))
except cupy.cuda.memory.OutOfMemoryError: print("cupy: OOM after", len(xs) * 256, "MiB")'
py 'import jax, jax.numpy as jnp; print(jax.devices()); print(jnp.ones((1024, 1024)).sum()); print(jax.devices()[0].memory_stats())'
# Every interception path on the real driver: dlsym, CUDA 12+ and 11
# cuGetProcAddress, per-thread default stream; the debug log says whether the
# driver's answers matched its exports (Export) or the documented table.
for via in "--via dlsym" "--via gpa" "--via gpa11" "--via gpa --ptsz"; do
    step "$G" exec "$S" --mem "$cap" --reconcile-secs 0 -- env GPUMEM_SHIM_LOG=debug "$bin/gpumem-probe" $via info total alloc:3000 alloc:1000 async:100 free:0
done
# CUDA 13's pools by location, and a created stream: device 0's pool and the
# stream are charged on device 0, the pinned host pool not at all, the managed
# pool that prefers nothing in full (expected: every step 0 but the last
# poolalloc, refused with 2; info then shows about cap - context - 3000 MiB
# free).
for via in "--via dlsym" "--via gpa"; do
    step "$G" exec "$S" --mem "$cap" --reconcile-secs 0 -- "$bin/gpumem-probe" $via defpoolof:pinned:device:0 poolalloc:0:2000 stream asyncon:2:1000 defpoolof:pinned:host:0 poolalloc:4:3000 curpoolof:managed:none:0 poolalloc:6:1500 info
done
# A larger per-thread stack (cuCtxSetLimit): measured with NVML around the
# call and charged to the context. On an H100 (132 SMs x 2048 threads) 4 KiB
# should take ~792 MiB more than the default 1 KiB and fit; 16 KiB (~4 GiB)
# should be refused with 2 and set back; 1 KiB gives it back. The debug log
# prints what each change took.
step "$G" exec "$S" --mem "$cap" --reconcile-secs 0 -- env GPUMEM_SHIM_LOG=debug "$bin/gpumem-probe" nvmlprocs limit:0:4096 info nvmlprocs limit:0:16384 info nvmlprocs limit:0:1024 info nvmlprocs
# Two processes under one state dir, watched from outside.
shared=$(mktemp -d)
"$G" exec "$S" --mem "$cap" --state-dir "$shared" -- python3 -c 'import torch, time; x = torch.empty(3 << 30, dtype=torch.uint8, device="cuda"); print("holder has 3 GiB", flush=True); time.sleep(20)' >>"$log" 2>&1 &
sleep 12
step nvidia-smi --query-compute-apps=pid,used_memory --format=csv
step "$G" exec "$S" --mem "$cap" --state-dir "$shared" -- python3 -c 'import torch
try:
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); print("UNEXPECTED: second process got 2 GiB")
except torch.cuda.OutOfMemoryError: print("second process refused as expected")'
wait
# Driver rounding: real free-memory deltas (no shim), then what the shim charges.
rounding='import ctypes
cuda = ctypes.CDLL("libcuda.so.1"); cuda.cuInit(0)
import torch; torch.cuda.init(); torch.empty(1, device="cuda")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
for size in (1 << 20, (2 << 20) + 1, 3 << 20, (64 << 20) + 1):
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)); before = free.value
    p = ctypes.c_uint64(); r = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size))
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    print("alloc", size, "result", r, "free delta MiB", (before - free.value) / 2**20)
    cuda.cuMemFree_v2(p)'
step python3 -c "$rounding"
py "$rounding"
# Untracked memory: fill the cap in 256 MiB steps after the reconciler has
# seen the context, hold, and read the process's footprint from outside. With
# reconciliation the footprint stays within the cap; without, it exceeds it
# by the context and libraries.
fill='import torch, time
torch.empty(1, device="cuda"); time.sleep(5)
xs = []
try:
    while True: xs.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
except torch.cuda.OutOfMemoryError: pass
print("filled", len(xs) * 256, "MiB; mem_get_info MiB", [v >> 20 for v in torch.cuda.mem_get_info()], flush=True)
time.sleep(15)'
for secs in 2 0; do
    echo "### reconcile-secs $secs" | tee -a "$log"
    "$G" exec "$S" --mem "$cap" --reconcile-secs $secs -- python3 -c "$fill" >>"$log" 2>&1 &
    sleep 20
    step nvidia-smi --query-compute-apps=pid,used_memory --format=csv
    wait
done
# A library opened RTLD_LOCAL that links the real driver (as Python opens an
# extension module): its direct calls reach the driver through the shim and
# are capped. Expected: retain 0, small 0, over 2, total 4308.
libdir=$(dirname "$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')")
cat >"$work/local.c" <<'C'
#include <stdio.h>
int cuInit(unsigned);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
int cuMemAlloc_v2(unsigned long long *, size_t);
int cuMemGetInfo_v2(size_t *, size_t *);
void run(void) {
    void *ctx = 0;
    unsigned long long p;
    size_t free = 0, total = 0;
    printf("init %d\n", cuInit(0));
    printf("retain %d\n", cuDevicePrimaryCtxRetain(&ctx, 0));
    printf("current %d\n", cuCtxSetCurrent(ctx));
    printf("small %d\n", cuMemAlloc_v2(&p, (size_t)100 << 20));
    printf("over %d\n", cuMemAlloc_v2(&p, (size_t)5000 << 20));
    int info = cuMemGetInfo_v2(&free, &total);
    printf("info %d total MiB %zu\n", info, total >> 20);
}
C
cat >"$work/local-main.c" <<'C'
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
    void *user = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!user) { fprintf(stderr, "%s\n", dlerror()); return 10; }
    ((void (*)(void))dlsym(user, "run"))();
    return 0;
}
C
step gcc -shared -fPIC -o "$work/liblocal.so" "$work/local.c" -L"$libdir" -l:libcuda.so.1
step gcc -o "$work/local-main" "$work/local-main.c" -ldl
step "$G" exec "$S" --mem "$cap" --reconcile-secs 0 -- "$work/local-main" "$work/liblocal.so"
}

# The over-cap action (docs/ISOLATION.md, "Untracked memory"): a process
# that does not load the shim fills the GPU inside an emulated container and
# is SIGKILLed within the grace period and a reconcile period, while its
# capped neighbour keeps running. `gpumem plugin` runs on the real NVML with
# no kubelet (it keeps serving while Register fails). The container's
# directory is named as Allocate names one holding units 0-3 of GPU 0, so the
# plugin holds it to the cap its name grants; `gpumem exec --state-dir` makes
# its accounting file and runs the neighbour under the shim there. The
# container is a mount namespace with that directory at /var/run/gpumem, as
# Allocate mounts it, or where that is refused a cgroup named like a pod's
# container (the hog is then found through the neighbour's container ID);
# OUTSIDE_VIA=cgroup asks for the second.
over_cap_outside() (
    local grace=5 every=1 slack=3 held=4
    local dir cdir uuid total name cap via cgroup="" made_cgroup="" made_mount_point=""
    local port=$((20000 + RANDOM % 20000)) neighbour hog plugin
    dir=$(mktemp -d "$work/outside.XXXX")
    echo "### outside: over-cap action kill, grace ${grace}s, reconcile every ${every}s" | tee -a "$log"
    local neighbour_py='import os, sys, time, torch
x = torch.ones(256 << 20, device="cuda")  # 1 GiB
torch.cuda.synchronize()
print("READY pid=%d" % os.getpid(), flush=True)
start = time.time()
while not os.path.exists(sys.argv[1]):
    if time.time() - start > 120: sys.exit("no stop file in 120 s")
    time.sleep(0.2)
x.add_(1); torch.cuda.synchronize()  # in place: nothing new to charge
print("neighbour still computes:", x[0].item(), flush=True)'
    local hog_py='import os, sys, time, torch
x = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
x.fill_(1); torch.cuda.synchronize()
print("holding pid=%d mib=%s" % (os.getpid(), sys.argv[1]), flush=True)
time.sleep(60)
print("UNEXPECTED: alive after 60 s", flush=True)'
    local -a neighbour_cmd hog_cmd
    if [ "${GPU_CHECK_FAKE:-0}" = 1 ]; then
        export LD_LIBRARY_PATH="$bin/fake${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export FAKEGPU_NODE_FILE="$dir/fake-node" FAKEGPU_MEMORY_MIB=81559 FAKEGPU_CONTEXT_MIB=518
        export FAKEGPU_UUIDS=GPU-3c1f6a2e-8d4b-4e7a-9f10-5b2c8d7e6a41
        uuid=$FAKEGPU_UUIDS total=$FAKEGPU_MEMORY_MIB
        echo "### outside: GPU_CHECK_FAKE=1: the fake driver in $bin/fake, gpumem-probe for PyTorch" | tee -a "$log"
    else
        IFS=', ' read -r uuid total < <(nvidia-smi -i 0 --query-gpu=uuid,memory.total --format=csv,noheader,nounits)
    fi
    # ContainerName::of: the GPU key (FNV-1a 32 of the UUID), the units, and
    # FNV-1a 64 of the sorted device IDs; units::cap_mib for the cap.
    read -r name cap < <(python3 - "$uuid" "$total" "$held" <<'EOF'
import sys
uuid, total, held = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def fnv(text, h, prime, bits):
    for b in text.encode():
        h = ((h ^ b) * prime) % (1 << bits)
    return h
key = "%08x" % fnv(uuid, 0x811C9DC5, 0x01000193, 32)
ids = ",".join(sorted("%s-%d" % (key, u) for u in range(held)))
name = "%s-%du-%016x" % (key, held, fnv(ids, 0xCBF29CE484222325, 0x100000001B3, 64))
print(name, held * total // (total // 1024))
EOF
)
    cdir="$dir/state/containers/$name"
    if [ "${GPU_CHECK_FAKE:-0}" = 1 ]; then
        neighbour_cmd=("$bin/gpumem-probe" alloc:1024 "wait:$dir/stop" free:0)
        hog_cmd=("$bin/gpumem-probe" "alloc:$((cap + 2048))" hold)
    else
        neighbour_cmd=(python3 -c "$neighbour_py" "$dir/stop")
        hog_cmd=(python3 -c "$hog_py" "$((cap + 2048))")
    fi
    echo "### outside: GPU $uuid ($total MiB), container $name, cap $cap MiB" | tee -a "$log"

    # How a container is emulated here: a mount namespace, else a cgroup.
    mkdir -p "$cdir"
    if [ ! -e /var/run/gpumem ]; then
        mkdir -p /var/run/gpumem && made_mount_point=/var/run/gpumem
    fi
    if [ "${OUTSIDE_VIA:-mount}" = mount ] &&
        unshare -m bash -c 'mount --bind "$0" /var/run/gpumem' "$cdir" 2>>"$log"; then
        via=mount
    else
        local pod cid
        pod=$(python3 -c 'import uuid; print(uuid.uuid4())')
        cid=$(python3 -c 'import os; print(os.urandom(32).hex())')
        if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
            cgroup="/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod${pod//-/_}.slice/cri-containerd-$cid.scope"
        else
            cgroup="/sys/fs/cgroup/pids/kubepods/burstable/pod$pod/$cid"
        fi
        # The outermost directory made here, for the clean-up.
        made_cgroup=$cgroup
        while [ ! -e "$(dirname "$made_cgroup")" ]; do made_cgroup=$(dirname "$made_cgroup"); done
        if mkdir -p "$cgroup" 2>>"$log" && bash -c 'echo $$ >"$0/cgroup.procs"' "$cgroup" 2>>"$log"; then
            via=cgroup
        else
            echo "OUTSIDE SKIPPED: neither a mount namespace (unshare -m) nor a cgroup ($cgroup) could be made here" | tee -a "$log"
            rmdir "$made_cgroup" $made_mount_point 2>/dev/null
            return 1
        fi
    fi
    echo "### outside: the container is a $via (${cgroup:-$cdir at /var/run/gpumem})" | tee -a "$log"
    # emulate OUT COMMAND...: COMMAND in the container, in the background.
    emulate() {
        local out=$1
        shift
        case $via in
        mount) unshare -m bash -c 'mount --bind "$0" /var/run/gpumem && exec "$@"' "$cdir" "$@" >"$out" 2>&1 & ;;
        cgroup) bash -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cgroup" "$@" >"$out" 2>&1 & ;;
        esac
    }
    kills() {
        python3 -c 'import sys, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=2).read().decode()
print(next(l.split()[-1] for l in text.splitlines() if l.startswith("gpumem_over_cap_kills_total ")))' "$port" 2>/dev/null
    }
    # wait_for FILE PATTERN: up to 60 s for a line.
    wait_for() {
        local i
        for i in $(seq 600); do
            grep -q "$2" "$1" 2>/dev/null && return 0
            sleep 0.1
        done
        return 1
    }

    mkdir -p "$dir/kubelet"
    step "$G" install-shim --from "$bin/libgpumem_shim.so" --to "$dir/host"
    echo "### $G plugin ... --over-cap-action kill --over-cap-grace-secs $grace --reconcile-secs $every" | tee -a "$log"
    "$G" plugin --kubelet-dir "$dir/kubelet" --pod-resources-socket "$dir/kubelet/pod-resources.sock" \
        --shim-host-dir "$dir/host" --state-dir "$dir/state" --metrics-addr "127.0.0.1:$port" \
        --over-cap-action kill --over-cap-grace-secs $grace --reconcile-secs $every >"$dir/plugin.log" 2>&1 &
    plugin=$!
    local i before="" after
    for i in $(seq 100); do
        before=$(kills) && break
        sleep 0.3
    done
    echo "### outside: plugin $plugin up, gpumem_over_cap_kills_total ${before:-missing}" | tee -a "$log"

    emulate "$dir/neighbour.out" "$G" exec "$S" --state-dir "$cdir" --mem "${cap}MiB" --reconcile-secs 0 -- "${neighbour_cmd[@]}"
    neighbour=$!
    wait_for "$dir/neighbour.out" '^READY\|^alloc:1024 0 ' ||
        echo "### outside: the neighbour never got its memory" | tee -a "$log"
    step "$G" inspect -d --metrics-addr "127.0.0.1:$port"
    emulate "$dir/hog.out" env -u LD_PRELOAD -u GPUMEM_STATE_DIR "${hog_cmd[@]}"
    hog=$!
    local t0 t1 hog_rc neighbour_rc alive=no maps
    wait_for "$dir/hog.out" '^holding' || echo "### outside: the hog never got its memory" | tee -a "$log"
    t0=$(date +%s.%N)
    maps=$(grep -c libgpumem_shim "/proc/$hog/maps" 2>/dev/null)
    echo "### outside: hog $hog holds $((cap + 2048)) MiB without the shim (maps it ${maps:-?} times); its mounts and cgroup:" | tee -a "$log"
    { grep gpumem "/proc/$hog/mountinfo"; head -3 "/proc/$hog/cgroup"; } >>"$log" 2>&1
    [ "${GPU_CHECK_FAKE:-0}" = 1 ] || step nvidia-smi --query-compute-apps=pid,used_memory --format=csv
    # Killed, or still there a minute later (then it is stopped here).
    for i in $(seq 600); do
        kill -0 "$hog" 2>/dev/null || break
        sleep 0.1
    done
    t1=$(date +%s.%N)
    kill "$hog" 2>/dev/null
    wait "$hog"
    hog_rc=$?
    kill -0 "$neighbour" 2>/dev/null && alive=yes
    touch "$dir/stop"
    wait "$neighbour"
    neighbour_rc=$?
    after=$(kills)
    local elapsed limit=$((grace + every + slack)) verdict=OK
    elapsed=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    if [ "$hog_rc" != 137 ] || awk -v e="$elapsed" -v l="$limit" 'BEGIN { exit !(e > l) }' ||
        [ $alive != yes ] || [ "$neighbour_rc" != 0 ] || [ "${after:-0}" -le "${before:-0}" ]; then
        verdict=FAIL
    fi
    kill "$plugin" 2>/dev/null
    wait "$plugin"
    for f in neighbour.out hog.out plugin.log; do
        echo "### outside: $f" >>"$log"
        cat "$dir/$f" >>"$log" 2>&1
    done
    # The plugin's health watch on the real NVML: which GPUs give XID events.
    local xids
    xids=$(grep -o 'watching XID events.*\|only polling this GPU.*' "$dir/plugin.log" | head -3 | tr '\n' ' ')
    echo "HEALTH ${xids:-no XID event registration logged (see plugin.log)}" | tee -a "$log"
    local d=$cgroup
    while [ -n "$made_cgroup" ] && rmdir "$d" 2>/dev/null && [ "$d" != "$made_cgroup" ]; do d=$(dirname "$d"); done
    [ -n "$made_mount_point" ] && rmdir "$made_mount_point" 2>/dev/null
    echo "OUTSIDE via=$via hog exit=$hog_rc ${elapsed}s after it held the memory (limit ${limit}s)" \
        "neighbour alive=$alive exit=$neighbour_rc gpumem_over_cap_kills_total ${before:-missing} -> ${after:-missing} $verdict" |
        tee -a "$log"
    [ $verdict = OK ]
)

# The footprint checks: each container is held to its cap as the GPU sees it
# from outside (nvidia-smi's per-process memory, summed over the
# container's processes), read while the processes hold what they got.
outside() {
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits |
        awk -F', *' -v pids=" $* " 'index(pids, " " $1 " ") { s += $2 } END { print s + 0 }'
}

# ready FILE COUNT: waits for COUNT "READY pid" lines; prints the pids.
ready() {
    local i
    for i in $(seq 900); do
        [ "$(grep -c '^READY' "$1")" -ge "$2" ] && break
        sleep 0.1
    done
    grep '^READY' "$1" | awk '{ printf "%s ", $2 }'
}

# judge NAME CAP_MIB PIDS...: one summary line, OK when outside <= cap.
judge() {
    local name=$1 cap=$2; shift 2
    local used verdict=OK
    used=$(outside "$@")
    [ "$used" -le "$cap" ] || verdict=OVER
    echo "FOOTPRINT $name cap=${cap}MiB outside=${used}MiB $verdict" | tee -a "$log"
}

# alone NAME CAP_MIB ARGS...: one container, one process.
alone() {
    local name=$1 cap=$2; shift 2
    local file="$work/$name.out" pids
    echo "### $name: gpumem exec --mem ${cap}MiB $*" | tee -a "$log"
    "$G" exec "$S" --mem "${cap}MiB" "$@" >"$file" 2>&1 &
    pids=$(ready "$file" 1)
    judge "$name" "$cap" $pids
    wait
    cat "$file" >>"$log"
}

footprints() {
    local py="python3 shim/gpu"
    alone torch-fill-at-once "${cap%MiB}" -- $py/fill.py
    alone torch-fill-at-once-no-reconcile "${cap%MiB}" --reconcile-secs 0 -- $py/fill.py
    # A 4 KiB stack (~792 MiB on an H100) set before filling.
    alone torch-fill-after-stack "${cap%MiB}" --reconcile-secs 0 -- $py/fill.py --stack-bytes 4096
    alone vmm-create-map-release "${cap%MiB}" --reconcile-secs 0 -- $py/driver.py vmm
    alone arrays "${cap%MiB}" --reconcile-secs 0 -- $py/driver.py arrays
    alone jax-default-prealloc "${cap%MiB}" -- $py/jax_prealloc.py
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True alone torch-expandable "${cap%MiB}" -- $py/fill.py
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync alone torch-cudamallocasync "${cap%MiB}" -- $py/fill.py

    # Two processes of one container: the second fills what the first left.
    local shared file pids
    shared=$(mktemp -d)
    file="$work/two-processes.out"
    echo "### two processes, one container (${cap})" | tee -a "$log"
    "$G" exec "$S" --mem "$cap" --state-dir "$shared" -- $py/fill.py --max-mib 2048 --hold 20 >"$file" 2>&1 &
    ready "$file" 1 >/dev/null
    "$G" exec "$S" --mem "$cap" --state-dir "$shared" -- $py/fill.py --hold 8 >>"$file" 2>&1 &
    pids=$(ready "$file" 2)
    judge two-processes-one-container "${cap%MiB}" $pids
    wait
    cat "$file" >>"$log"

    # Two containers splitting the GPU as the plugin would (79 units of an
    # 81559 MiB H100: 39 + 39, then 40 + 39), both filling at once: each
    # must stop at its own cap, and neither may meet the driver's OOM first.
    local units caps a b
    for units in "39 39" "40 39"; do
        set -- $units
        a=$(( $1 * 81559 / 79 )); b=$(( $2 * 81559 / 79 ))
        echo "### two containers: $1 + $2 units, caps $a + $b MiB" | tee -a "$log"
        "$G" exec "$S" --mem "${a}MiB" -- $py/fill.py --hold 10 >"$work/left.out" 2>&1 &
        "$G" exec "$S" --mem "${b}MiB" -- $py/fill.py --hold 10 >"$work/right.out" 2>&1 &
        pids=$(ready "$work/left.out" 1)
        judge "container-$1-units" "$a" $pids
        pids=$(ready "$work/right.out" 1)
        judge "container-$2-units" "$b" $pids
        wait
        cat "$work/left.out" "$work/right.out" >>"$log"
    done

    # What small allocations cost: the driver's 2 MiB chunks, and the charge.
    step "$G" exec "$S" --mem 60GiB --reconcile-secs 0 -- $py/driver.py small
    grep '^FOOTPRINT' "$log"
}

: >"$log"
step nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
wants checks && checks
wants footprint && footprints
wants train && { probe_bench; train; }
wants fakebench && fake_bench
wants outside && over_cap_outside
echo "done: $log"
