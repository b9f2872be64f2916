"""PyTorch training-step time, for the shim's overhead on a real GPU.

Run it plainly and under `gpumem exec` and compare (shim/gpu-check.sh does,
alternating the two so drift hits both alike):

    python3 benches/train_step.py [--steps 200] [--model transformer|resnet]

Prints one line: `train_step model=… ms_per_step=… steps=…`. With
PYTORCH_NO_CUDA_MEMORY_CACHING=1 every tensor goes to cuMemAlloc/cuMemFree,
the worst case for the shim; with the caching allocator (the default) the
driver is rarely asked after warm-up.
"""

import argparse
import time

import torch
from torch import nn


def transformer():
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, num_layers=6), nn.Linear(512, 1000))
    batch = torch.randn(32, 128, 512, device="cuda")
    target = torch.randint(0, 1000, (32, 128), device="cuda")
    loss = lambda out: nn.functional.cross_entropy(out.reshape(-1, 1000), target.reshape(-1))
    return model, batch, loss


def resnet():
    def block(c_in, c_out, stride):
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
        )

    model = nn.Sequential(
        block(3, 64, 1), block(64, 128, 2), block(128, 256, 2), block(256, 512, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000),
    )
    batch = torch.randn(64, 3, 64, 64, device="cuda")
    target = torch.randint(0, 1000, (64,), device="cuda")
    loss = lambda out: nn.functional.cross_entropy(out, target)
    return model, batch, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--model", choices=["transformer", "resnet"], default="transformer")
    args = parser.parse_args()

    torch.manual_seed(0)
    model, batch, loss_of = {"transformer": transformer, "resnet": resnet}[args.model]()
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model(batch))
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(f"train_step model={args.model} ms_per_step={elapsed * 1000 / args.steps:.3f} steps={args.steps}")


if __name__ == "__main__":
    main()
