"""CPU per DataLoader batch of ``ds.__getitems__``: the batch loop's cost, in the main process and as in a worker.

    python examples/measure_getitems.py DATASET [--passes 2]

Each ``BlockShuffleSampler`` batch of 64 of ``open_dataset(DATASET, image="tensor")``, warm (one pass first), timed
with ``time.process_time``; "worker": ``get_worker_info`` answers as inside a DataLoader worker, so the batch goes
into one shared block as there. Prints the median wall and CPU ms per batch. Runs on the tree before the batch
pipeline too (its worker check lived in packer.read.batch), to compare builds: docs/results.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch.utils.data import BatchSampler, get_worker_info

import packer

try:
    from packer.read import slots as memory
except ImportError:  # the tree before the batch pipeline
    from packer.read import batch as memory  # type: ignore[no-redef]


def main() -> None:
    ap = argparse.ArgumentParser(description="CPU per batch of ds.__getitems__ (see the module docstring)")
    ap.add_argument("dataset")
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    ds = packer.open_dataset(args.dataset, image="tensor")
    batches = list(BatchSampler(packer.BlockShuffleSampler(ds, batch_size=64, seed=0), 64, False))
    for mode in ("main", "worker"):
        memory.get_worker_info = (lambda: object()) if mode == "worker" else get_worker_info  # type: ignore[attr-defined]
        for b in batches:  # warm
            ds.__getitems__(b)
        wall, cpu = [], []
        for _ in range(args.passes):
            for b in batches:
                t0, c0 = time.perf_counter(), time.process_time()
                ds.__getitems__(b)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        print(f"{mode}: {statistics.median(wall) * 1e3:.3f} ms wall, {statistics.median(cpu) * 1e3:.3f} ms CPU per "
              f"batch of 64 ({len(wall)} batches)")


if __name__ == "__main__":
    main()
