"""Whole-batch reads vs per-sample reads on a fixed-shape raw dataset (hdf5 or memmap).

    packer convert imgs/ --to memmap --payload raw --resize 224x224 -o imgs-224.memmap
    python examples/batch_reads.py imgs-224.memmap --batch-size 256 --workers 0,2

Compares, on shuffled batches of the same indices, in one run (warm page cache: a first pass
over the data is not timed):

- ``per-sample``: what ``DataLoader(ds, batch_size=B)`` does: ``ds.__getitems__`` builds one
  CHW tensor per sample (a copy each, memmap views being read-only), ``default_collate`` stacks
  them (a second copy);
- ``get_batch``: ``ds.get_batch(indices)``, the batch read straight into one NHWC tensor in
  storage order, then put back in the order asked;
- ``get_batch sorted``: ``get_batch(indices, sort=True)``, what ``ds.batched()`` serves a
  ``BatchSampler``-driven loader: one memory copy in all for memmap.

With ``--workers N>0`` the same two paths also run through ``DataLoader`` with persistent
workers (samples/s include the transfer from worker to main process, not worker start-up).
torch runs one thread, as it does in DataLoader workers. Prints samples/s and MB/s per path and the ratio
to per-sample; timings are indicative (median of ``--repeats``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from torch.utils.data._utils.collate import default_collate

from packer import open_dataset


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: page cache, torch's thread pool, worker start-up paths
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--batches", type=int, default=20, help="batches per timed pass (default 20)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", default="0", help="comma-separated DataLoader worker counts; 0: in-process only")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in DataLoader workers; the machine's other cores stay out of it

    ds = open_dataset(args.dataset, image="tensor")
    if ds.fixed_shape is None:
        raise SystemExit(f"{args.dataset}: not a fixed-shape raw dataset (convert with --payload raw --resize HxW)")
    gen = torch.Generator().manual_seed(0)
    batches = list(BatchSampler(RandomSampler(range(len(ds)), generator=gen), args.batch_size, drop_last=True))
    batches = (batches * (1 + args.batches // max(len(batches), 1)))[: args.batches]
    n = sum(len(b) for b in batches)
    sample_mb = int(np.prod(ds.fixed_shape)) / 1e6
    for b in batches:  # warm the page cache; what is timed is memory work, not the disk
        ds.get_batch(b)

    paths = {
        "per-sample": lambda: [default_collate(ds.__getitems__(b)) for b in batches],
        "get_batch": lambda: [ds.get_batch(b) for b in batches],
        "get_batch sorted": lambda: [ds.get_batch(b, sort=True) for b in batches],
    }
    for w in [int(x) for x in args.workers.split(",") if int(x) > 0]:
        sampler = [list(b) for b in batches]
        per = DataLoader(ds, batch_sampler=sampler, num_workers=w, persistent_workers=True)
        whole = DataLoader(ds.batched(), sampler=sampler, batch_size=None, num_workers=w, persistent_workers=True)
        paths[f"DataLoader per-sample, {w} workers"] = lambda per=per: list(per)
        paths[f"DataLoader batched, {w} workers"] = lambda whole=whole: list(whole)

    print(f"{args.dataset}: {ds.manifest.format}, {len(ds)} samples of {ds.fixed_shape}, "
          f"{args.batches} shuffled batches of {args.batch_size}, median of {args.repeats}")
    base = None
    for name, fn in paths.items():
        seconds = timed(fn, args.repeats)
        rate = n / seconds
        base = base or rate
        print(f"  {name:<36} {rate:>10,.0f} samples/s {rate * sample_mb:>8,.0f} MB/s  x{rate / base:.2f}")


if __name__ == "__main__":
    main()
