"""Creates a CUDA context and at once fills GPU memory in 256 MiB steps
(PyTorch's caching allocator, as every training job starts), then holds it
so the footprint can be read from outside. With --stack-bytes, first sets
the context's per-thread stack (cuCtxSetLimit), which the driver reserves
for every thread the GPU can hold.
Usage: fill.py [--max-mib N] [--hold SECONDS] [--stack-bytes N]"""
import argparse, ctypes, os, time
import torch

p = argparse.ArgumentParser()
p.add_argument("--max-mib", type=int, default=1 << 30)
p.add_argument("--hold", type=float, default=8)
p.add_argument("--stack-bytes", type=int)
a = p.parse_args()
torch.empty(1, device="cuda")
if a.stack_bytes is not None:
    cuda = ctypes.CDLL("libcuda.so.1")
    r = cuda.cuCtxSetLimit(0, ctypes.c_size_t(a.stack_bytes))
    print("cuCtxSetLimit(stack,", a.stack_bytes, ") ->", r, "; mem_get_info MiB",
          [v >> 20 for v in torch.cuda.mem_get_info()], flush=True)
xs = []
try:
    while (len(xs) + 1) * 256 <= a.max_mib:
        xs.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    end = "stopped at --max-mib"
except torch.cuda.OutOfMemoryError:
    end = "OutOfMemoryError"
print(f"filled {len(xs) * 256} MiB ({end}); mem_get_info MiB", [v >> 20 for v in torch.cuda.mem_get_info()], flush=True)
print("READY", os.getpid(), flush=True)
time.sleep(a.hold)
