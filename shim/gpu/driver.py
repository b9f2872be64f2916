"""Driver-API loops the frameworks' allocators do not show: the VMM
create-map-release pattern and CUDA arrays, 1 GiB at a time until refused,
then hold so the footprint can be read from outside. Also small allocations,
comparing what the shim charged with what NVML says this process holds.
Usage: driver.py vmm|arrays|small [--hold SECONDS]"""
import ctypes as C, os, sys, time

cuda = C.CDLL("libcuda.so.1")
GIB, MIB = 1 << 30, 1 << 20
u64 = C.c_uint64


class Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("htypes", C.c_int), ("loc", Loc), ("win32", C.c_void_p), ("flags", C.c_ubyte * 8)]


class Access(C.Structure):
    _fields_ = [("loc", Loc), ("flags", C.c_int)]


class ArrayDesc(C.Structure):
    _fields_ = [("w", C.c_size_t), ("h", C.c_size_t), ("fmt", C.c_int), ("ch", C.c_uint)]


def context():
    assert cuda.cuInit(0) == 0
    ctx = C.c_void_p()
    assert cuda.cuDevicePrimaryCtxRetain(C.byref(ctx), 0) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0


def vmm():
    prop = Prop(type=1, loc=Loc(1, 0))
    access = Access(loc=Loc(1, 0), flags=3)
    got = 0
    for _ in range(16):
        h = u64()
        r = cuda.cuMemCreate(C.byref(h), C.c_size_t(GIB), C.byref(prop), u64(0))
        if r != 0:
            print("cuMemCreate refused:", r)
            break
        va = u64()
        assert cuda.cuMemAddressReserve(C.byref(va), C.c_size_t(GIB), C.c_size_t(0), u64(0), u64(0)) == 0
        assert cuda.cuMemMap(va, C.c_size_t(GIB), C.c_size_t(0), h, u64(0)) == 0
        assert cuda.cuMemSetAccess(va, C.c_size_t(GIB), C.byref(access), C.c_size_t(1)) == 0
        # The documented pattern: the mapping keeps the memory.
        assert cuda.cuMemRelease(h) == 0
        got += 1
    print(f"vmm create-map-release: {got} GiB mapped", flush=True)


def arrays():
    desc = ArrayDesc(8192, 8192, 0x20, 4)  # 1 GiB of float4
    got = 0
    for _ in range(16):
        a = C.c_void_p()
        r = cuda.cuArrayCreate_v2(C.byref(a), C.byref(desc))
        if r != 0:
            print("cuArrayCreate_v2 refused:", r)
            break
        got += 1
    print(f"arrays: {got} GiB", flush=True)


def small():
    import pynvml as n
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    me = os.getpid()

    def nvml_mib():
        return sum(p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == me) / MIB

    free, total = C.c_size_t(), C.c_size_t()

    def charged_mib():
        cuda.cuMemGetInfo_v2(C.byref(free), C.byref(total))
        return (total.value - free.value) / MIB

    base_nvml, base_charged = nvml_mib(), charged_mib()
    ptrs = []
    for label, sizes in [("1 MiB", [MIB]), ("1 MiB", [MIB]), ("1 MiB", [MIB]), ("64 x 64 KiB", [64 << 10] * 64),
                         ("2 MiB + 1", [2 * MIB + 1]), ("20 x 300 KiB", [300 << 10] * 20), ("64 MiB + 1", [64 * MIB + 1])]:
        for s in sizes:
            p = u64()
            assert cuda.cuMemAlloc_v2(C.byref(p), C.c_size_t(s)) == 0
            ptrs.append(p.value)
        print(f"after {label:>12}: driver (NVML) +{nvml_mib() - base_nvml:6.1f} MiB, shim charged +{charged_mib() - base_charged:6.1f} MiB")
    for p in ptrs[::2]:
        cuda.cuMemFree_v2(u64(p))
    print(f"after freeing every other: driver +{nvml_mib() - base_nvml:6.1f} MiB, shim charged +{charged_mib() - base_charged:6.1f} MiB")
    for p in ptrs[1::2]:
        cuda.cuMemFree_v2(u64(p))
    print(f"after freeing the rest:   driver +{nvml_mib() - base_nvml:6.1f} MiB, shim charged +{charged_mib() - base_charged:6.1f} MiB")


context()
{"vmm": vmm, "arrays": arrays, "small": small}[sys.argv[1]]()
print("READY", os.getpid(), flush=True)
if sys.argv[1] != "small":
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--hold" else 8)
