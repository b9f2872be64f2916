import ctypes as C, os, time
nvml = C.CDLL("libnvidia-ml.so.1")
class ProcInfo(C.Structure):
    _fields_ = [("pid", C.c_uint), ("used", C.c_ulonglong), ("gi", C.c_uint), ("ci", C.c_uint)]
nvml.nvmlInit_v2(); h = C.c_void_p(); nvml.nvmlDeviceGetHandleByIndex_v2(0, C.byref(h))
def mine():
    n = C.c_uint(64); arr = (ProcInfo * 64)(); nvml.nvmlDeviceGetComputeRunningProcesses_v3(h, C.byref(n), arr)
    return [arr[i].used >> 20 for i in range(n.value) if arr[i].pid == os.getpid()]
import torch
print("import", mine())
torch.cuda.init(); print("init", mine())
x = torch.empty(1, device="cuda"); print("empty(1)", mine(), torch.cuda.memory_reserved() >> 20)
y = torch.empty(256 << 20, dtype=torch.uint8, device="cuda"); print("empty 256M", mine(), torch.cuda.memory_reserved() >> 20)
z = torch.zeros(1, device="cuda"); torch.cuda.synchronize(); print("zeros (kernel)", mine())
a = torch.randn(4096, 4096, device="cuda"); b = a @ a; torch.cuda.synchronize(); print("matmul", mine(), torch.cuda.memory_reserved() >> 20)
