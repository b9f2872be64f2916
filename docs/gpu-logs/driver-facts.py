# Exploration of real-driver facts the shim design depends on. ctypes only.
import ctypes as C, os, sys, time, subprocess, json
MIB = 1 << 20
cuda = C.CDLL("libcuda.so.1")
nvml = C.CDLL("libnvidia-ml.so.1")
u64 = C.c_uint64
def chk(name, r):
    if r != 0: print(f"  {name} -> {r}")
    return r
class ProcInfo(C.Structure):
    _fields_ = [("pid", C.c_uint), ("used", C.c_ulonglong), ("gi", C.c_uint), ("ci", C.c_uint)]
class NvmlMem(C.Structure):
    _fields_ = [("total", C.c_ulonglong), ("free", C.c_ulonglong), ("used", C.c_ulonglong)]
t = time.perf_counter(); r = nvml.nvmlInit_v2(); print("nvmlInit_v2", r, "ms %.1f" % ((time.perf_counter()-t)*1e3))
h = C.c_void_p(); nvml.nvmlDeviceGetHandleByIndex_v2(0, C.byref(h))
def procs():
    n = C.c_uint(64); arr = (ProcInfo * 64)()
    t = time.perf_counter()
    r = nvml.nvmlDeviceGetComputeRunningProcesses_v3(h, C.byref(n), arr)
    dt = (time.perf_counter()-t)*1e6
    return r, [(arr[i].pid, arr[i].used // MIB) for i in range(n.value)], dt
def devfree():
    m = NvmlMem(); nvml.nvmlDeviceGetMemoryInfo(h, C.byref(m)); return m.free // MIB
def cfree():
    f, tt = C.c_size_t(), C.c_size_t(); cuda.cuMemGetInfo_v2(C.byref(f), C.byref(tt)); return f.value
print("pid", os.getpid(), "NSpid", [l for l in open("/proc/self/status") if l.startswith("NSpid")])
print("before cuInit: procs", procs(), "devfree", devfree())
t = time.perf_counter(); r = cuda.cuInit(0); print("cuInit", r, "ms %.1f" % ((time.perf_counter()-t)*1e3))
print("after cuInit: procs", procs(), "devfree", devfree())
ctx = C.c_void_p()
flags, active = C.c_uint(), C.c_int()
cuda.cuDevicePrimaryCtxGetState(0, C.byref(flags), C.byref(active)); print("primary state before", flags.value, active.value)
f0 = devfree()
t = time.perf_counter(); r = cuda.cuDevicePrimaryCtxRetain(C.byref(ctx), 0); dt = (time.perf_counter()-t)*1e3
print("retain", r, "ms %.1f" % dt, "procs right after", procs(), "devfree delta", f0 - devfree())
cuda.cuDevicePrimaryCtxGetState(0, C.byref(flags), C.byref(active)); print("primary state after", flags.value, active.value)
time.sleep(0.2); print("procs 200ms later", procs())
cuda.cuCtxSetCurrent(ctx)
print("procs after setcurrent", procs())
# second retain: no memory
f0 = devfree(); ctx2 = C.c_void_p(); cuda.cuDevicePrimaryCtxRetain(C.byref(ctx2), 0); print("second retain delta", f0 - devfree(), "same ctx", ctx.value == ctx2.value)
cuda.cuDevicePrimaryCtxRelease_v2(0)
def delta(fn):
    b = cfree(); out = fn(); return (b - cfree()) / MIB, out
def alloc(n):
    p = u64(); r = cuda.cuMemAlloc_v2(C.byref(p), C.c_size_t(n)); return r, p.value
print("--- small allocations")
ptrs = []
for size in [MIB, MIB, MIB, 64 << 10, 64 << 10, (3 * MIB) // 2, (3 * MIB) // 2, 2 * MIB, 2 * MIB + 1, 512 << 10]:
    d, (r, p) = delta(lambda: alloc(size)); ptrs.append(p); print("  alloc", size, "r", r, "delta MiB", d)
d, _ = delta(lambda: [cuda.cuMemFree_v2(u64(p)) for p in ptrs]); print("  free all: delta MiB", d)
ptrs = []
d, _ = delta(lambda: [ptrs.append(alloc(64 << 10)[1]) for _ in range(64)]); print("  64 x 64 KiB delta MiB", d)
d, _ = delta(lambda: [cuda.cuMemFree_v2(u64(p)) for p in ptrs[:32]]); print("  free half: delta", d)
d, _ = delta(lambda: [cuda.cuMemFree_v2(u64(p)) for p in ptrs[32:]]); print("  free rest: delta", d)
ptrs = []
d, _ = delta(lambda: [ptrs.append(alloc(MIB)[1]) for _ in range(16)]); print("  16 x 1 MiB delta", d)
d, _ = delta(lambda: [cuda.cuMemFree_v2(u64(p)) for p in ptrs[::2]]); print("  free every other: delta", d)
d, _ = delta(lambda: [cuda.cuMemFree_v2(u64(p)) for p in ptrs[1::2]]); print("  free rest: delta", d)
ptrs = []
d, _ = delta(lambda: [ptrs.append(alloc(300 << 10)[1]) for _ in range(20)]); print("  20 x 300 KiB delta", d)
[cuda.cuMemFree_v2(u64(p)) for p in ptrs]
print("  NVML sees 1 GiB at once?")
r, p = alloc(1 << 30); print("  procs right after 1 GiB alloc", procs()); cuda.cuMemFree_v2(u64(p))
print("--- VMM")
class Loc(C.Structure): _fields_ = [("type", C.c_int), ("id", C.c_int)]
class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("htypes", C.c_int), ("loc", Loc), ("win32", C.c_void_p), ("flags", C.c_ubyte * 8)]
prop = Prop(); prop.type = 1; prop.loc.type = 1; prop.loc.id = 0
gran = C.c_size_t(); cuda.cuMemGetAllocationGranularity(C.byref(gran), C.byref(prop), 0); print("granularity", gran.value)
G = 1 << 30
hd = u64(); d, r = delta(lambda: cuda.cuMemCreate(C.byref(hd), C.c_size_t(G), C.byref(prop), u64(0))); print("create 1 GiB", r, "delta", d, "handle", hex(hd.value))
va = u64(); chk("reserve", cuda.cuMemAddressReserve(C.byref(va), C.c_size_t(2 * G), C.c_size_t(0), u64(0), u64(0)))
chk("map", cuda.cuMemMap(u64(va.value), C.c_size_t(G), C.c_size_t(0), hd, u64(0)))
chk("map2", cuda.cuMemMap(u64(va.value + G), C.c_size_t(G), C.c_size_t(0), hd, u64(0)))
d, r = delta(lambda: cuda.cuMemRelease(hd)); print("release while mapped twice", r, "delta", d)
h2 = u64(); r = cuda.cuMemRetainAllocationHandle(C.byref(h2), C.c_void_p(va.value + G + 4096)); print("retain handle from mapping", r, hex(h2.value), "same as original", h2.value == hd.value)
d, r = delta(lambda: cuda.cuMemUnmap(u64(va.value), C.c_size_t(G))); print("unmap first mapping", r, "delta", d)
d, r = delta(lambda: cuda.cuMemRelease(h2)); print("release retained", r, "delta", d)
d, r = delta(lambda: cuda.cuMemUnmap(u64(va.value + G), C.c_size_t(G))); print("unmap last mapping", r, "delta", d)
# unmapping a range covering two handles at once
ha, hb = u64(), u64()
cuda.cuMemCreate(C.byref(ha), C.c_size_t(64 * MIB), C.byref(prop), u64(0)); cuda.cuMemCreate(C.byref(hb), C.c_size_t(64 * MIB), C.byref(prop), u64(0))
cuda.cuMemMap(u64(va.value), C.c_size_t(64 * MIB), C.c_size_t(0), ha, u64(0)); cuda.cuMemMap(u64(va.value + 64 * MIB), C.c_size_t(64 * MIB), C.c_size_t(0), hb, u64(0))
cuda.cuMemRelease(ha); cuda.cuMemRelease(hb)
d, r = delta(lambda: cuda.cuMemUnmap(u64(va.value), C.c_size_t(128 * MIB))); print("unmap one range over two handles", r, "delta", d)
# partial unmap of a mapping
cuda.cuMemCreate(C.byref(ha), C.c_size_t(64 * MIB), C.byref(prop), u64(0)); cuda.cuMemMap(u64(va.value), C.c_size_t(64 * MIB), C.c_size_t(0), ha, u64(0)); cuda.cuMemRelease(ha)
d, r = delta(lambda: cuda.cuMemUnmap(u64(va.value), C.c_size_t(32 * MIB))); print("partial unmap", r, "delta", d)
d, r = delta(lambda: cuda.cuMemUnmap(u64(va.value + 32 * MIB), C.c_size_t(32 * MIB))); print("unmap rest", r, "delta", d)
# map at offset into a handle (sub-range of a larger allocation)
cuda.cuMemCreate(C.byref(ha), C.c_size_t(64 * MIB), C.byref(prop), u64(0))
r = cuda.cuMemMap(u64(va.value), C.c_size_t(32 * MIB), C.c_size_t(32 * MIB), ha, u64(0)); print("map at offset", r)
h3 = u64(); r = cuda.cuMemRetainAllocationHandle(C.byref(h3), C.c_void_p(va.value)); print("retain from offset map", r, h3.value == ha.value)
cuda.cuMemRelease(h3); cuda.cuMemRelease(ha); d, r = delta(lambda: cuda.cuMemUnmap(u64(va.value), C.c_size_t(32 * MIB))); print("unmap offset map", r, "delta", d)
cuda.cuMemAddressFree(u64(va.value), C.c_size_t(2 * G))
print("--- arrays")
class AD(C.Structure): _fields_ = [("w", C.c_size_t), ("h", C.c_size_t), ("fmt", C.c_int), ("ch", C.c_uint)]
class AD3(C.Structure): _fields_ = [("w", C.c_size_t), ("h", C.c_size_t), ("d", C.c_size_t), ("fmt", C.c_int), ("ch", C.c_uint), ("flags", C.c_uint)]
class Req(C.Structure): _fields_ = [("size", C.c_size_t), ("align", C.c_size_t), ("res", C.c_uint * 4)]
for (w, hh, fmt, ch) in [(1024, 1024, 0x20, 4), (8192, 8192, 0x20, 4), (1000, 1000, 0x01, 1), (100, 1, 0x01, 1), (3000, 7, 0x10, 2)]:
    arr = C.c_void_p(); desc = AD(w, hh, fmt, ch)
    d, r = delta(lambda: cuda.cuArrayCreate_v2(C.byref(arr), C.byref(desc)))
    req = Req(); rr = cuda.cuArrayGetMemoryRequirements(C.byref(req), arr, 0)
    print(f"  array {w}x{hh} fmt {fmt:#x} ch {ch}: r {r} delta {d} MiB; requirements {rr} size {req.size} ({req.size / MIB:.3f} MiB) align {req.align}; naive {w*hh*ch*(4 if fmt==0x20 else 2 if fmt==0x10 else 1)/MIB:.3f}")
    d, r = delta(lambda: cuda.cuArrayDestroy(arr)); print("   destroy delta", d)
for (w, hh, dd, fl) in [(256, 256, 256, 0), (1024, 1024, 6, 2), (512, 512, 4, 1)]:
    arr = C.c_void_p(); desc = AD3(w, hh, dd, 0x20, 1, fl)
    d, r = delta(lambda: cuda.cuArray3DCreate_v2(C.byref(arr), C.byref(desc)))
    req = Req(); rr = cuda.cuArrayGetMemoryRequirements(C.byref(req), arr, 0)
    print(f"  3D {w}x{hh}x{dd} flags {fl}: r {r} delta {d}; req {rr} {req.size / MIB:.3f} MiB naive {w*hh*dd*4/MIB:.3f}")
    cuda.cuArrayDestroy(arr)
mm = C.c_void_p(); desc = AD3(4096, 4096, 0, 0x20, 4, 0)
d, r = delta(lambda: cuda.cuMipmappedArrayCreate(C.byref(mm), C.byref(desc), 13))
req = Req(); rr = cuda.cuMipmappedArrayGetMemoryRequirements(C.byref(req), mm, 0)
print(f"  mipmapped 4096^2 float4 13 levels: r {r} delta {d}; req {rr} {req.size / MIB:.3f} MiB; base {4096*4096*16/MIB}")
d, r = delta(lambda: cuda.cuMipmappedArrayDestroy(mm)); print("   destroy delta", d)
print("--- pools")
class PoolProps(C.Structure):
    _fields_ = [("allocType", C.c_int), ("htypes", C.c_int), ("loc", Loc), ("win32", C.c_void_p), ("maxSize", C.c_size_t), ("usage", C.c_ushort), ("res", C.c_ubyte * 54)]
pp = PoolProps(); pp.allocType = 1; pp.loc.type = 1; pp.loc.id = 0
pool = C.c_void_p(); print("  pool create", cuda.cuMemPoolCreate(C.byref(pool), C.byref(pp)))
p = u64(); d, r = delta(lambda: cuda.cuMemAllocFromPoolAsync(C.byref(p), C.c_size_t(MIB), pool, None)); print("  1 MiB from pool", r, "delta", d)
v = u64(); cuda.cuMemPoolGetAttribute(pool, 5, C.byref(v)); print("  reserved", v.value / MIB)
p2 = u64(); d, r = delta(lambda: cuda.cuMemAllocFromPoolAsync(C.byref(p2), C.c_size_t(100 * MIB), pool, None)); print("  100 MiB from pool", r, "delta", d)
cuda.cuMemPoolGetAttribute(pool, 5, C.byref(v)); print("  reserved", v.value / MIB)
cuda.cuMemFreeAsync(p, None); cuda.cuMemFreeAsync(p2, None); d, r = delta(lambda: cuda.cuStreamSynchronize(None)); print("  free+sync delta", d)
dp = C.c_void_p(); print("  default pool", cuda.cuDeviceGetDefaultMemPool(C.byref(dp), 0), dp.value, "mempool", end=" ")
cp = C.c_void_p(); print(cuda.cuDeviceGetMemPool(C.byref(cp), 0), cp.value)
print("--- context create/destroy")
c2 = C.c_void_p()
b = devfree(); r = cuda.cuCtxCreate_v2(C.byref(c2), 0, 0); print("  cuCtxCreate_v2", r, "devfree delta", b - devfree(), "procs", procs())
if r == 0:
    r, pp2 = alloc(G); print("  alloc 1 GiB in ctx2", r)
    b = devfree(); r = cuda.cuCtxDestroy_v2(c2); print("  destroy ctx2", r, "returned MiB", devfree() - b)
    cuda.cuCtxSetCurrent(ctx)
r, pbig = alloc(G); b = devfree()
sys.stdout.flush()
pid = os.fork()
if pid == 0:
    p = u64(); r1 = cuda.cuMemAlloc_v2(C.byref(p), C.c_size_t(MIB)); r2 = cuda.cuInit(0); c = C.c_void_p(); r3 = cuda.cuDevicePrimaryCtxRetain(C.byref(c), 0); r4 = cuda.cuMemFree_v2(u64(pbig))
    f, tt = C.c_size_t(), C.c_size_t(); r5 = cuda.cuMemGetInfo_v2(C.byref(f), C.byref(tt))
    print("  fork child: alloc", r1, "cuInit", r2, "retain", r3, "free parent ptr", r4, "getinfo", r5, flush=True); os._exit(0)
os.waitpid(pid, 0)
print("--- primary release to zero frees allocations?")
b = devfree(); r = cuda.cuDevicePrimaryCtxRelease_v2(0); print("  release", r, "returned MiB", devfree() - b, "procs", procs())
cuda.cuDevicePrimaryCtxGetState(0, C.byref(flags), C.byref(active)); print("  state after", active.value)
