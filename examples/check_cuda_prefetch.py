"""Verify packer.CUDAPrefetcher on a GPU machine: correct results, and the copy hidden behind compute.

    python examples/check_cuda_prefetch.py            # about 20 s on one GPU; exit 1 on a wrong result

1. Correctness under stress: large batches, a long kernel reading each batch on the compute
   stream, and each batch dropped as soon as its kernel is queued, so the allocator would hand
   its memory to the next copy at once if ``record_stream`` were missing, and the kernel would
   read the next batch if ``wait_stream`` were missing. Every per-batch sum is checked against
   the CPU's. Run with and without ``pin_memory``.
2. Overlap: per-iteration time of (copy + step) with a plain ``.to(device)`` against the
   prefetcher; with pinned memory the prefetcher's iteration should approach the step alone.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from packer.read.loaders import CUDAPrefetcher


def heavy(x: torch.Tensor, reps: int) -> torch.Tensor:
    y = x.float()
    for _ in range(reps):
        y = torch.sin(y) + y  # keeps the compute stream busy while the next copy runs
    return x.float().sum()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA here: CUDAPrefetcher is a pass-through on CPU (covered by tests/test_prefetch.py)")
        return 0
    dev = torch.device("cuda")
    n, shape = 48, (64, 3, 224, 224)  # 64 images of 224x224 per batch, ~9.6 MB uint8
    data = torch.randint(0, 255, (n, *shape[1:]), dtype=torch.uint8)
    ds = TensorDataset(data)
    ok = True
    for pin in (False, True):
        loader = DataLoader(ds, batch_size=shape[0] // 16, pin_memory=pin)
        ref = [float(b[0].double().sum()) for b in loader]
        got = []
        for (x,) in CUDAPrefetcher(loader, dev):
            got.append(heavy(x, 20))  # queued; x dropped right after
        got = [float(v) for v in got]
        bad = sum(abs(a - b) > 1e-3 * max(1.0, abs(a)) for a, b in zip(ref, got, strict=True))
        print(f"correctness, pin_memory={pin}: {len(got)} batches, {bad} wrong sums")
        ok &= bad == 0

    big = torch.randint(0, 255, (16, *shape), dtype=torch.uint8)  # 16 batches of 64 images
    for pin in (False, True):
        loader = DataLoader(TensorDataset(big), batch_size=None, pin_memory=pin)
        for label, it in (("plain .to(device)", lambda ld: ((x.to(dev, non_blocking=True),) for (x,) in ld)),
                          ("CUDAPrefetcher", lambda ld: CUDAPrefetcher(ld, dev))):
            for _ in it(loader):  # warm-up
                pass
            torch.cuda.synchronize()
            t = time.perf_counter()
            for (x,) in it(loader):
                heavy(x, 4)
            torch.cuda.synchronize()
            print(f"overlap, pin_memory={pin}, {label}: {1000 * (time.perf_counter() - t) / len(big):.2f} ms per batch")
    torch.cuda.synchronize()
    t = time.perf_counter()
    x = big[0].to(dev)
    for _ in range(len(big)):
        heavy(x, 4)
    torch.cuda.synchronize()
    print(f"step alone (no copy): {1000 * (time.perf_counter() - t) / len(big):.2f} ms per batch")
    print("OK" if ok else "FAILED: CUDAPrefetcher returned wrong data")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
