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


SHAPE = (64, 3, 224, 224)  # 64 images of 224x224 per batch, ~9.6 MB uint8


def correctness(dev: torch.device) -> list[dict]:
    """Check 1, with and without pin_memory: per-batch sums through the prefetcher against the CPU's."""
    n = 48
    ds = TensorDataset(torch.randint(0, 255, (n, *SHAPE[1:]), dtype=torch.uint8))
    rows = []
    for pin in (False, True):
        loader = DataLoader(ds, batch_size=SHAPE[0] // 16, pin_memory=pin)
        ref = [float(b[0].double().sum()) for b in loader]
        got = []
        for (x,) in CUDAPrefetcher(loader, dev):
            got.append(heavy(x, 20))  # queued; x dropped right after
        sums = [float(v) for v in got]
        bad = sum(abs(a - b) > 1e-3 * max(1.0, abs(a)) for a, b in zip(ref, sums, strict=True))
        rows.append({"pin_memory": pin, "batches": len(sums), "wrong_sums": bad})
    return rows


def overlap(dev: torch.device) -> dict:
    """Check 2: ms per batch of (copy + step) with a plain ``.to(device)`` and with the prefetcher, with and
    without pin_memory, and of the step alone (no copy): the prefetcher's should approach the step alone."""
    big = torch.randint(0, 255, (16, *SHAPE), dtype=torch.uint8)  # 16 batches of 64 images
    out: dict = {"ms_per_batch": []}
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
            out["ms_per_batch"].append({"pin_memory": pin, "loader": label,
                                        "ms": 1000 * (time.perf_counter() - t) / len(big)})
    torch.cuda.synchronize()
    t = time.perf_counter()
    x = big[0].to(dev)
    for _ in range(len(big)):
        heavy(x, 4)
    torch.cuda.synchronize()
    out["step_alone_ms"] = 1000 * (time.perf_counter() - t) / len(big)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA here: CUDAPrefetcher is a pass-through on CPU (covered by tests/read/test_loaders.py)")
        return 0
    dev = torch.device("cuda")
    checked = correctness(dev)
    for row in checked:
        print(f"correctness, pin_memory={row['pin_memory']}: {row['batches']} batches, {row['wrong_sums']} wrong sums")
    timed = overlap(dev)
    for row in timed["ms_per_batch"]:
        print(f"overlap, pin_memory={row['pin_memory']}, {row['loader']}: {row['ms']:.2f} ms per batch")
    print(f"step alone (no copy): {timed['step_alone_ms']:.2f} ms per batch")
    ok = all(row["wrong_sums"] == 0 for row in checked)
    print("OK" if ok else "FAILED: CUDAPrefetcher returned wrong data")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
