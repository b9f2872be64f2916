import ctypes as C, os, time
cuda = C.CDLL("libcuda.so.1"); nvml = C.CDLL("libnvidia-ml.so.1")
class ProcInfo(C.Structure):
    _fields_ = [("pid", C.c_uint), ("used", C.c_ulonglong), ("gi", C.c_uint), ("ci", C.c_uint)]
nvml.nvmlInit_v2(); h = C.c_void_p(); nvml.nvmlDeviceGetHandleByIndex_v2(0, C.byref(h))
def procs():
    n = C.c_uint(64); arr = (ProcInfo * 64)(); r = nvml.nvmlDeviceGetComputeRunningProcesses_v3(h, C.byref(n), arr)
    return r, [(arr[i].pid, arr[i].used >> 20) for i in range(n.value)]
print("ns: getpid", os.getpid(), [l.strip() for l in open("/proc/self/status") if l.startswith("NSpid")], "before", procs())
cuda.cuInit(0); c = C.c_void_p(); cuda.cuDevicePrimaryCtxRetain(C.byref(c), 0)
print("ns: after ctx", procs(), flush=True)
time.sleep(3)
