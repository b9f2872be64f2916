"""Creates a CUDA context and at once fills GPU memory in 256 MiB steps
(PyTorch's caching allocator, as every training job starts), then holds it
so the footprint can be read from outside.
Usage: fill.py [--max-mib N] [--hold SECONDS]"""
import argparse, os, time
import torch

p = argparse.ArgumentParser()
p.add_argument("--max-mib", type=int, default=1 << 30)
p.add_argument("--hold", type=float, default=8)
a = p.parse_args()
torch.empty(1, device="cuda")
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
