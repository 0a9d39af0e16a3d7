"""Where packer.ThreadLoader spends CPU beyond the decode itself, on warm data: per thread, per image.

    python examples/measure_overhead.py DATASET.memmap --epochs 3

For ``full`` (whole images) and ``train224`` (RandomResizedCropDecode(224), region decode), in stored order
and in BlockShuffleSampler order, a fresh ``ThreadLoader(num_threads=2)`` per epoch (as examples/bench_peers.py
makes them) after one warm-up epoch. Reported, median over the epochs, in CPU microseconds per image: the decode
threads (which also take each chunk's payloads), the feeder thread (sampler, positions, reads started with their
residency checks and read-ahead planning, the batch's plan: memory, crops, chunks), the read-ahead thread, the
main thread and the whole process, then images/s. A first line gives bare libjpeg-turbo's CPU per image (one
thread, the same bytes) and the feeder's work alone (the feeder's body without decoding). CPU time, not wall
time: on a shared machine it is what the load bends least. Results and the command: docs/results.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import threading
import time
from collections.abc import Iterator

import numpy as np
from torch.utils.data import BatchSampler, SequentialSampler

import packer
from packer import sysinfo
from packer.read import threaded
from packer.read.hints import aheads_of
from packer.read.slots import BlockPool, Pooled

FEEDER_CPU: list[float] = []  # each feeder thread's CPU seconds, appended as it ends


def thread_cpu(native_id: int | None) -> float:
    """CPU seconds of one thread of this process so far (Linux /proc; 0 once it has ended)."""
    return sysinfo.cpu_seconds(f"self/task/{native_id}") or 0.0


def by_role() -> collections.Counter:
    """CPU seconds so far of each kind of live thread (decode, read-ahead, main), by thread name."""
    out: collections.Counter = collections.Counter()
    for t in threading.enumerate():
        role = "decode" if t.name.startswith("packer-decode") else "read-ahead" if t.name == "packer-readahead" \
            else "main" if t is threading.main_thread() else "other"
        out[role] += thread_cpu(t.native_id)
    return out


def timed_feeder(feed):
    """ThreadLoader's feeder body, with its thread's CPU time recorded when it ends."""

    def body(*args) -> Iterator:
        c0 = time.thread_time()
        try:
            yield from feed(*args)
        finally:
            FEEDER_CPU.append(time.thread_time() - c0)

    return body


def sampler_of(ds, order: str):
    return packer.BlockShuffleSampler(ds, batch_size=64, seed=0) if order == "training" else None


def loader_epoch(ds, order: str) -> dict[str, float]:
    """One epoch through a new ThreadLoader: CPU us per image by thread kind, the process's, images/s."""
    loader = packer.ThreadLoader(ds, batch_size=64, sampler=sampler_of(ds, order), num_threads=2)
    before, t0, p0, n = by_role(), time.perf_counter(), os.times(), 0
    after = before
    for k, (images, _labels) in enumerate(loader):
        n += len(images)
        if k == len(loader) - 1:
            after = by_role()  # the decode threads end with the iteration: read them before
    wall, p1 = time.perf_counter() - t0, os.times()
    row = {role: (after[role] - (0.0 if role == "decode" else before[role])) / n * 1e6 for role in after}
    row["feeder"] = FEEDER_CPU[-1] / n * 1e6
    row["process"] = (p1.user + p1.system - p0.user - p0.system) / n * 1e6
    row["images/s"] = n / wall
    return row


def feeder_alone(ds, order: str) -> float:
    """CPU us per image of the feeder's body (indices, positions, reads started, the batch planned) without
    decoding."""
    pool, payloads, pipeline = BlockPool(5), BlockPool(20), ds.pipeline
    sampler = sampler_of(ds, order) or SequentialSampler(ds)
    c0, n = time.thread_time(), 0
    for indices in BatchSampler(sampler, 64, False):
        reads = pipeline.start(pipeline.positions(list(indices)), aheads_of(indices))
        plan = pipeline.plan(reads, 2 * threaded.CHUNKS_PER_THREAD, Pooled(pool.take), copies=payloads.take_array)
        plan.pending.wait_all(range(len(indices)))
        n += len(plan.positions)
    return (time.thread_time() - c0) / n * 1e6


def bare_decode(ds) -> float:
    """CPU us per image of bare libjpeg-turbo (PyTurboJPEG, this thread) on the dataset's bytes."""
    from turbojpeg import TJPF_RGB, TurboJPEG

    tj, bufs = TurboJPEG(), [bytes(b) for b in ds.payloads_at(np.arange(len(ds)))]
    c0 = time.thread_time()
    for b in bufs:
        tj.decode(b, pixel_format=TJPF_RGB)
    return (time.thread_time() - c0) / len(bufs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--settings", default="full,train224")
    args = ap.parse_args()
    threaded._feed = timed_feeder(threaded._feed)  # type: ignore
    base = packer.open_dataset(args.dataset, image="tensor")
    print(f"bare libjpeg-turbo, 1 thread: {statistics.median(bare_decode(base) for _ in range(3)):.0f} us/img; "
          "feeder alone: " + ", ".join(f"{order} {statistics.median(feeder_alone(base, order) for _ in range(5)):.1f}"
                                       for order in ("stored", "training")) + " us/img")
    for setting in args.settings.split(","):
        crop = packer.RandomResizedCropDecode(224) if setting == "train224" else None
        ds = packer.open_dataset(args.dataset, image="tensor", crop=crop)
        for order in ("stored", "training"):
            loader_epoch(ds, order)  # warm-up: page cache, maps, batch memory
            rows = [loader_epoch(ds, order) for _ in range(args.epochs)]
            keys = ["decode", "feeder", "read-ahead", "main", "process", "images/s"]
            print(f"{setting:9s} {order:9s} " + "  ".join(
                f"{k} {statistics.median(r.get(k, 0.0) for r in rows):.0f}" for k in keys), flush=True)


if __name__ == "__main__":
    main()
