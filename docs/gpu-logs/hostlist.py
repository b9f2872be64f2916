import ctypes as C
nvml = C.CDLL("libnvidia-ml.so.1")
class ProcInfo(C.Structure):
    _fields_ = [("pid", C.c_uint), ("used", C.c_ulonglong), ("gi", C.c_uint), ("ci", C.c_uint)]
nvml.nvmlInit_v2(); h = C.c_void_p(); nvml.nvmlDeviceGetHandleByIndex_v2(0, C.byref(h))
n = C.c_uint(64); arr = (ProcInfo * 64)(); r = nvml.nvmlDeviceGetComputeRunningProcesses_v3(h, C.byref(n), arr)
print("host view", r, [(arr[i].pid, arr[i].used >> 20) for i in range(n.value)])
