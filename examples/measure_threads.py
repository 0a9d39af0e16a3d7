"""Full decode through packer.ThreadLoader and through a DataLoader, against bare libjpeg-turbo, in one run.

    python examples/measure_threads.py DATASET.lmdb DATASET.memmap --rounds 3 --json threads.json

For each dataset and order (stored; BlockShuffleSampler's), whole epochs of ``image="tensor"`` batches of 64
through ``DataLoader(num_workers=N, collate_fn=packer.collate)`` and ``ThreadLoader(num_threads=N)`` (N: the usable
cores; ``--loaders`` picks), interleaved round by round with bare libjpeg-turbo (PyTurboJPEG into reused memory) on
the same bytes in memory, on one thread and on N threads at once; each after a whole warm-up epoch (steady state).
Reported per loader: images/s (median of the rounds), CPU ms per image of every process (this one and the
workers), the fraction of N x the bare per-core rate (the decode limit; in brackets the steady rate's, from
the first batch handed out to the last, as docs/results.md's goal 1 is stated), the fraction of the N-thread bare
rate (what N decodes at once get from this machine's shared memory and caches), and the CPU efficiency (bare CPU
per image / the loader's): on a machine shared with other work the wall-clock fraction falls with the load, the CPU
efficiency much less. Results and the command: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

import packer
from packer import sysinfo


def cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped children (DataLoader workers end with their epoch)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(epoch: Callable[[], Iterable[int]]) -> tuple[float, float, float]:
    """(images/s, CPU ms per image, steady images/s) of one whole epoch; steady: from the first batch handed out
    to the last (the "steady state" of docs/results.md's goals: a loader's start, threads and first batch, left
    out), or the whole epoch's rate where it hands out one batch."""
    c0, t0, n, first = cpu_seconds(), time.perf_counter(), 0, None
    for count in epoch():
        n += count
        if first is None:
            first = (time.perf_counter(), n)
    end = time.perf_counter()
    steady = (n - first[1]) / (end - first[0]) if first is not None and n > first[1] else n / (end - t0)
    return n / (end - t0), (cpu_seconds() - c0) / max(n, 1) * 1e3, steady


class BareDecoder:
    """PyTurboJPEG decoding into memory used again (a view of one growing buffer, as the loaders' batch memory is
    reused): a new array per image costs a page fault per 4 KiB on this VM (1.4 against 1.0 ms per photo)."""

    def __init__(self) -> None:
        from turbojpeg import TurboJPEG

        self.tj = TurboJPEG()
        self.buf = np.empty(0, np.uint8)

    def decode(self, data: bytes) -> None:
        from turbojpeg import TJPF_RGB

        width, height = self.tj.decode_header(data)[:2]
        if self.buf.size < height * width * 3:
            self.buf = np.empty(height * width * 3, np.uint8)
        self.tj.decode(data, pixel_format=TJPF_RGB, dst=self.buf[:height * width * 3].reshape(height, width, 3))


def bare_epoch(payloads: list[bytes], batch: int) -> Iterable[int]:
    """Every payload decoded by one thread, a batch at a time."""
    dec = BareDecoder()
    for k in range(0, len(payloads), batch):
        for b in payloads[k:k + batch]:
            dec.decode(b)
        yield len(payloads[k:k + batch])


def bare_threads_epoch(payloads: list[bytes], batch: int, threads: int) -> Iterable[int]:
    """The same bare decodes on ``threads`` threads at once, each with its own decoder and buffer, taking the next
    batch as it finishes one: what the cores give decodes running together (memory and caches shared)."""
    starts = iter(range(0, len(payloads), batch))
    lock = threading.Lock()

    def work() -> int:
        dec, done = BareDecoder(), 0
        while True:
            with lock:
                k = next(starts, None)
            if k is None:
                return done
            for b in payloads[k:k + batch]:
                dec.decode(b)
            done += len(payloads[k:k + batch])

    with ThreadPoolExecutor(threads) as pool:
        yield sum(pool.map(lambda _: work(), range(threads)))


def loader_epochs(path: Path, cores: int, batch: int, kinds: Sequence[str]
                  ) -> dict[tuple[str, str], Callable[[], Iterable[int]]]:
    ds = packer.open_dataset(path, image="tensor")

    def epoch(kind: str, order: str) -> Iterable[int]:
        sampler = packer.BlockShuffleSampler(ds, batch_size=batch, seed=0) if order == "block" else None
        if kind == "ThreadLoader":
            loader: Iterable = packer.ThreadLoader(ds, batch_size=batch, sampler=sampler, num_threads=cores)
        else:
            loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=cores, collate_fn=packer.collate)
        for images, _labels in loader:
            yield len(images)

    return {(kind, order): (lambda k=kind, o=order: epoch(k, o))
            for order in ("stored", "block") for kind in kinds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("datasets", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--loaders", default="DataLoader,ThreadLoader", help="comma-separated: DataLoader, ThreadLoader")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    kinds = [k for k in a.loaders.split(",") if k]
    if not kinds or set(kinds) - {"DataLoader", "ThreadLoader"}:
        ap.error(f"--loaders {a.loaders!r}: choose from DataLoader, ThreadLoader")
    torch.set_num_threads(1)
    cores = sysinfo.usable_cores()
    report: dict = {"cores": cores, "rounds": a.rounds, "batch_size": a.batch_size, "datasets": {}}
    for path in a.datasets:
        payloads = [bytes(b) for b in packer.open_dataset(path).read_payloads(range(len(packer.open_dataset(path))))]
        epochs = {("bare libjpeg-turbo, 1 thread", "-"): lambda p=payloads: bare_epoch(p, a.batch_size),
                  (f"bare libjpeg-turbo, {cores} threads", "-"): lambda p=payloads: bare_threads_epoch(
                      p, a.batch_size, cores),
                  **loader_epochs(path, cores, a.batch_size, kinds)}
        runs: dict = {key: [] for key in epochs}
        for epoch in epochs.values():  # warm-up, a whole epoch each: imports, page cache, a loader's batch memory
            for _ in epoch():
                pass
        for _ in range(a.rounds):  # interleaved: each round measures every loader once
            for key, epoch in epochs.items():
                runs[key].append(timed(epoch))
        bare_rate = statistics.median(r for r, _, _ in runs[("bare libjpeg-turbo, 1 thread", "-")])
        together = statistics.median(r for r, _, _ in runs[(f"bare libjpeg-turbo, {cores} threads", "-")])
        bare_cpu = statistics.median(c for _, c, _ in runs[("bare libjpeg-turbo, 1 thread", "-")])
        rows = report["datasets"][str(path)] = []
        print(f"\n{path} ({len(payloads)} images, {cores} cores; bare libjpeg-turbo {bare_rate:,.0f} img/s per core, "
              f"{bare_cpu:.2f} CPU ms/img)")
        for (kind, order), got in runs.items():
            rate, cpu = statistics.median(r for r, _, _ in got), statistics.median(c for _, c, _ in got)
            steady = statistics.median(s for _, _, s in got)
            row = {"loader": kind, "order": order, "images_per_s": rate, "runs": [r for r, _, _ in got],
                   "cpu_ms_per_image": cpu, "of_decode_limit": rate / (cores * bare_rate),
                   "steady_images_per_s": steady, "steady_of_decode_limit": steady / (cores * bare_rate),
                   "of_bare_threads": rate / together, "cpu_efficiency": bare_cpu / cpu}
            rows.append(row)
            print(f"  {kind:<30} {order:<7} {rate:8,.0f} img/s  {cpu:5.2f} CPU ms/img  "
                  f"{row['of_decode_limit']:5.0%} of {cores} x bare (steady {row['steady_of_decode_limit']:4.0%})  "
                  f"{row['of_bare_threads']:5.0%} of bare on {cores} threads  "
                  f"CPU efficiency {row['cpu_efficiency']:4.0%}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
