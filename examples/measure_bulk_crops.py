"""Fused crops a chunk at a time (one call of the extension per chunk) against one by one, the same pixels.

    python examples/measure_bulk_crops.py warm photos.memmap photos.lmdb --rounds 6 --threads 2
    python examples/measure_bulk_crops.py bench --one-by-one -- photos.memmap --emulate hdd --cold \
        --levels thread-train --orders block --workers 2 --repeats 5

``warm``: per dataset, whole ThreadLoader epochs of train224 (``RandomResizedCropDecode(224)``, batch 64,
BlockShuffleSampler) with the bulk path and without it, interleaved round by round (the order flipped every
round), then a DataLoader worker's batches (``__getitems__`` with shared slots, in this process) the same way.
Reported: medians of images/s and of process CPU microseconds per image. ``bench``: ``packer bench`` with the
arguments after ``--``, and with ``--one-by-one`` the bulk path switched off (what packer did before it): run
both, alternated, for an A/B under the emulated hard disk. Figures: docs/results.md, "A chunk's fused crops in
one call of the extension".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

import packer
import packer.read.slots as slots_mod
from packer.images.crop import CropDecode


def one_by_one(crop: CropDecode) -> CropDecode:
    """``crop`` with its bulk path off: every sample goes through ``from_bytes`` (packer before the bulk path)."""
    crop.from_bytes_many = lambda *args, **kwargs: None  # type: ignore[method-assign]
    return crop


def datasets(path: str) -> dict[str, packer.PackedDataset]:
    bulk = packer.open_dataset(path, image="tensor", crop=packer.RandomResizedCropDecode(224))
    single = packer.open_dataset(path, image="tensor", crop=one_by_one(packer.RandomResizedCropDecode(224)))
    return {"bulk": bulk, "one by one": single}


def thread_epoch(ds: packer.PackedDataset, threads: int) -> tuple[float, float]:
    """(images/s, process CPU us per image) of one ThreadLoader epoch."""
    sampler = packer.BlockShuffleSampler(ds, batch_size=64, seed=0)
    loader = packer.ThreadLoader(ds, batch_size=64, sampler=sampler, num_threads=threads)
    t, c, n = time.perf_counter(), time.process_time(), 0
    for images, _ in loader:
        n += len(images)
    return n / (time.perf_counter() - t), (time.process_time() - c) / n * 1e6


def worker_epoch(ds: packer.PackedDataset) -> tuple[float, float]:
    """(images/s, CPU us per image) of a DataLoader worker's batches (``__getitems__``), here in this process."""
    order = np.random.default_rng(0).permutation(len(ds)).tolist()
    torch.set_num_threads(1)  # as DataLoader sets it in each worker (else every resize starts an OpenMP team)
    t, c = time.perf_counter(), time.process_time()
    for a in range(0, len(order), 64):
        ds.__getitems__(order[a:a + 64])
    return len(order) / (time.perf_counter() - t), (time.process_time() - c) / len(order) * 1e6


def interleaved(runs: dict[str, object], measure, rounds: int) -> dict[str, list[tuple[float, float]]]:
    for obj in runs.values():
        measure(obj)  # warm-up: page cache, batch memory, scratch
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for r in range(rounds):
        for k in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            got[k].append(measure(runs[k]))
    return got


def report(title: str, got: dict[str, list[tuple[float, float]]]) -> None:
    print(title)
    for k, v in got.items():
        rate = statistics.median(x[0] for x in v)
        cpu = statistics.median(x[1] for x in v)
        print(f"  {k:11s} {rate:8,.0f} img/s  {cpu:7,.0f} us CPU/img  (rounds: {', '.join(f'{x[0]:,.0f}' for x in v)})")


def warm(args: argparse.Namespace) -> None:
    threads = torch.get_num_threads()
    for path in args.datasets:
        torch.set_num_threads(threads)
        runs = datasets(path)
        report(f"{path}: ThreadLoader, {args.threads} threads, train224, warm",
               interleaved(runs, lambda ds: thread_epoch(ds, args.threads), args.rounds))
        real = slots_mod.get_worker_info
        slots_mod.get_worker_info = lambda: object()  # as in a worker: shared slots, so __getitems__ decodes into them
        try:
            report(f"{path}: a DataLoader worker's batches, in this process",
                   interleaved(runs, worker_epoch, args.rounds))
        finally:
            slots_mod.get_worker_info = real


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        rest = argv[1:]
        if rest[:1] == ["--one-by-one"]:
            CropDecode.from_bytes_many = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
            rest = rest[1:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        from packer.cli import main as packer_main

        return packer_main(["bench", *rest])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warm", help="ThreadLoader and worker batches, bulk against one by one, warm")
    w.add_argument("datasets", nargs="+")
    w.add_argument("--rounds", type=int, default=6)
    w.add_argument("--threads", type=int, default=2)
    sub.add_parser("bench", help="packer bench [--one-by-one] -- ARGS")
    args = parser.parse_args(argv)
    warm(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
