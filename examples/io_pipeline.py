"""How well a loader overlaps its reads with decoding on a slow disk, whatever else runs on the machine.

Under the emulated hard disk (``packer bench --emulate hdd``: the kernel's block-IO throttle, 150 IOPS,
150 MB/s; root, Linux), cold, in BlockShuffleSampler's order, each image's decode is replaced by a sleep
of ``1 / decode_rate`` seconds per worker or thread: the figure is then the IO pipeline's (how much of
min(device, decode rate) the loader reaches), not this machine's CPU load. The device's IOs and bytes
come from the throttle's cgroup counters.

    python examples/io_pipeline.py photos.memmap --loader thread --decode-rate 1600 --repeats 3
    python examples/io_pipeline.py photos.lmdb --loader dataloader --workers 2

docs/results.md quotes it for goal 3 there (>= 90 % of min(device, decode rate) in block order).
Not part of the test suite (needs root and cgroups).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import packer
from packer.diagnose.bench_sources import make_order
from packer.diagnose.measure import evict
from packer.diagnose.throttle import throttled
from packer.read.decoding import Decoding
from packer.read.hints import hinted_order


def _sleeping_decode(seconds: float):
    """``Decoding.pixels`` that touches the payload's first bytes, sleeps, and returns a 1x1 image."""

    def pixels(self, pos, payload, kind, strict=False, out=None, window=None):
        bytes(memoryview(payload)[:16])
        time.sleep(seconds)
        return np.zeros((1, 1, 3), np.uint8)

    return pixels


def one_pass(path: str, loader: str, workers: int, batch_size: int, seed: int, thr) -> tuple[float, int, int]:
    """(images/s, device IOs, device bytes) of one cold pass in block order."""
    files = [os.path.join(path, f) for f in os.listdir(path)]
    ds = packer.open_dataset(path, image="numpy")
    order = make_order("block", np.asarray(ds.index.nbytes), seed=seed, batch_size=batch_size)
    assert order.blocks is not None
    indices = hinted_order(ds.index_map.public_many(order.indices).tolist(), order.indices, order.blocks)
    ds.close()
    evict(files)
    ds = packer.open_dataset(path, image="numpy")
    ios0, bytes0 = thr.read_counters()
    t0 = time.perf_counter()
    if loader == "thread":
        it = packer.ThreadLoader(ds, batch_size=batch_size, sampler=indices, num_threads=workers,
                                 collate_fn=lambda items: items)
    else:
        it = torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=indices, num_workers=workers,
                                         collate_fn=lambda items: items, multiprocessing_context="fork")
    count = sum(len(batch) for batch in it)
    seconds = time.perf_counter() - t0
    ios1, bytes1 = thr.read_counters()
    ds.close()
    return count / seconds, ios1 - ios0, bytes1 - bytes0


def main() -> None:
    p = argparse.ArgumentParser(description="IO pipeline of a loader on the emulated hard disk, decoding as a sleep")
    p.add_argument("dataset")
    p.add_argument("--loader", choices=("thread", "dataloader"), default="thread")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers or ThreadLoader threads")
    p.add_argument("--decode-rate", type=float, default=1600.0, help="images/s of all workers together")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--read-iops", type=int, default=150)
    p.add_argument("--read-bps", type=int, default=150_000_000)
    a = p.parse_args()
    Decoding.pixels = _sleeping_decode(a.workers / a.decode_rate)  # type: ignore[method-assign]
    rates = []
    with throttled([a.dataset], read_iops=a.read_iops, read_bps=a.read_bps) as thr:
        for seed in range(a.repeats):
            rate, ios, nbytes = one_pass(a.dataset, a.loader, a.workers, a.batch_size, seed, thr)
            rates.append(rate)
            print(f"  pass {seed}: {rate:,.0f} img/s, {ios} device reads, {nbytes / 1e6:,.0f} MB")
    print(f"{a.loader} x{a.workers}, decode {a.decode_rate:,.0f} img/s, device {a.read_iops} IOPS / "
          f"{a.read_bps / 1e6:,.0f} MB/s: median {statistics.median(rates):,.0f} img/s")


if __name__ == "__main__":
    main()
