"""Warm reads, in one run: CPU per sample of batched payload reads, and whole-batch bandwidth vs a memory copy.

    python examples/measure_batch_reads.py photos.lmdb photos.memmap r64.lmdb r64.memmap --folder photos

Everything is read once first (warm page cache); what is timed is memory work. Two tables:

- ``cpu``: microseconds of CPU (this process, all threads) per sample for batches of ``--batch-size``
  (default 64) read with ``payloads_at`` in the ``sequential``, uniform ``shuffle`` and ``block``
  (BlockShuffleSampler's) orders, one byte of each 4 KiB page of each payload touched (zero-copy
  views are read only then), as ``packer bench``'s read level does; ``--folder``: ImageFolder's open +
  read per file in the same orders. Median of ``--repeats`` passes.
- ``batch``: MB per CPU-second (this process, all threads: what a shared machine's load bends least) of
  whole batches of 256 (``--batch``): ``read_payloads views`` (the call alone: zero-copy views, nothing
  read; its bytes over its CPU time), ``read_payloads`` (its payloads joined into one new
  ``bytes``: views are read only when used) and ``read_payloads out`` (copied into one buffer reused
  batch after batch, like the reference copy); for fixed-shape raw
  datasets ``get_batch`` (a new uint8 tensor each time) and ``get_batch(out=)`` (a batch tensor reused,
  as a training loop with pinned memory would); for raw ones ``__getitems__`` with ``image="tensor"``
  (per sample, for comparison). Against ``np.copyto`` of the same number of bytes (source and
  destination warm in the CPU cache: ``%``) and ``packer bench``'s memory-copy ceiling (128 MiB, one
  core: ``% ceiling``). Sequential windows of public indices (``range(k, k+256)``) and shuffled batches.

Timings on a shared machine move with its load: compare ratios within one run (docs/results.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import packer
from packer.diagnose.bench_sources import make_order
from packer.read.hints import aheads_of, hinted_order
from packer.write.scan import scan_folder

ORDERS = ("sequential", "shuffle", "block")


def touch(buf) -> int:
    """Bytes of one payload, one byte of each 4 KiB page read (a view is only read then)."""
    arr = buf.reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.size:
        _ = int(arr[::4096].sum()) + int(arr[-1])
    return int(arr.nbytes)


def median_of(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    fn()  # warm-up: page cache, first opens
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def cpu_table(paths: list[Path], folder: Path | None, batch: int, repeats: int) -> None:
    print(f"\nus CPU per sample, batches of {batch}, warm (median of {repeats})")
    print(f"{'dataset':<28}" + "".join(f"{o:>12}" for o in ORDERS))
    if folder is not None:
        files = [folder / rel for rel in scan_folder(folder).rel_paths]
        sizes = np.array([f.stat().st_size for f in files], dtype=np.int64)
        row = []
        for kind in ORDERS:
            idx = make_order(kind, sizes, seed=0, batch_size=batch).indices.tolist()

            def folder_pass(idx=idx) -> None:
                for i in idx:
                    with open(files[i], "rb") as fh:
                        fh.read()

            row.append(median_of(folder_pass, repeats, time.process_time) / len(files) * 1e6)
        print(f"{'folder (open + read)':<28}" + "".join(f"{v:>12.1f}" for v in row))
    for path in paths:
        ds = packer.open_dataset(path)
        row = [packed_cpu(ds, kind, batch, repeats) for kind in ORDERS]
        print(f"{path.name:<28}" + "".join(f"{v:>12.1f}" for v in row))
        ds.close()


def packed_cpu(ds, kind: str, batch: int, repeats: int) -> float:
    """us CPU per sample of a pass in ``kind`` order, batches through ``payloads_at`` as ``packer bench`` reads."""
    order = make_order(kind, ds.index.nbytes, seed=0, batch_size=batch, cuts=ds.store.starts[1:-1].tolist(),
                       blocks=ds.block_boundaries())
    public = ds.index_map.public_many(order.indices).tolist()
    if order.blocks is not None:  # hinted as BlockShuffleSampler's indices are (read-ahead of the next window)
        public = hinted_order(public, order.indices, order.blocks)

    def packed_pass() -> None:
        k = 0
        for chunk in order.chunks:
            for b in ds.payloads_at(chunk, aheads_of([public[j] for j in range(k, k + len(chunk))])):
                touch(b)
            k += len(chunk)

    return median_of(packed_pass, repeats, time.process_time) / len(ds) * 1e6


def copy_ceiling(repeats: int) -> float:
    """MB per CPU-second of ``packer bench``'s memory-copy ceiling (a 128 MiB numpy copy, one core)."""
    src = np.random.default_rng(0).integers(0, 255, 128 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    return src.nbytes / median_of(lambda: np.copyto(dst, src), repeats, time.process_time) / 1e6


def batch_table(paths: list[Path], batch: int, repeats: int) -> None:
    ceiling = copy_ceiling(repeats)
    print(f"\nMB per CPU-second of whole batches of {batch}, warm (median of {repeats}); memory-copy ceiling "
          f"(128 MiB, one core): {ceiling:,.0f} MB/s; % = of np.copyto of the same bytes")
    print(f"{'dataset':<22}{'order':<12}{'path':<16}{'MB/s':>10}{'copy MB/s':>11}{'%':>6}{'% ceiling':>10}")
    for path in paths:
        ds = packer.open_dataset(path, image="tensor")
        n = len(ds)
        rng = np.random.default_rng(0)
        orders = {"sequential": [list(range(k, k + batch)) for k in range(0, n - batch + 1, batch)],
                  "shuffle": [rng.permutation(n)[:batch].tolist() for _ in range(max(n // batch, 1))]}
        for oname, batches in orders.items():
            read_files(path)
            batch_rows(ds, f"{path.name:<22}{oname:<12}", batches, repeats, ceiling)
        ds.close()


def read_files(root: Path) -> None:
    """Every file of the dataset read once more: some machines page out cache idle for seconds (these VMs run a
    DAMON ``pageout`` scheme on memory unused for ~6 s), and a batch with an evicted page takes the read-ahead path."""
    for f in sorted(root.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def batch_rows(ds, head: str, batches: list[list[int]], repeats: int, ceiling: float) -> None:
    """One line per batch path: MB/s, the same-size copy's MB/s, and the fractions."""
    nbytes = int(sum(int(ds.index.nbytes[ds.positions(b)].sum()) for b in batches))
    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes // len(batches)), np.uint8).copy()
    dst = np.empty_like(src)
    copy_s = median_of(lambda: [np.copyto(dst, src) for _ in batches], repeats, time.process_time)
    reused = np.empty(max(int(ds.index.nbytes[ds.positions(b)].sum()) for b in batches), np.uint8)
    runs: dict[str, Callable[[], object]] = {
        "read_payloads views": lambda: [ds.read_payloads(b) for b in batches],
        "read_payloads": lambda: [b"".join(ds.read_payloads(b)) for b in batches],
        "read_payloads out": lambda: [gather(ds.read_payloads(b), reused) for b in batches]}
    if ds.fixed_shape is not None:
        out = torch.empty((len(batches[0]), *ds.fixed_shape), dtype=torch.uint8)
        runs["get_batch"] = lambda: [ds.get_batch(b) for b in batches]
        runs["get_batch out="] = lambda: [ds.get_batch(b, out=out) for b in batches]
    if ds.manifest.payload == "raw":
        runs["__getitems__"] = lambda: [ds.__getitems__(b) for b in batches]
    for name, fn in runs.items():
        secs = median_of(fn, repeats, time.process_time)
        mbs = nbytes / secs / 1e6
        print(f"{head}{name:<16}{mbs:>10,.0f}{nbytes / copy_s / 1e6:>11,.0f}{100 * copy_s / secs:>6.0f}"
              f"{100 * mbs / ceiling:>10.0f}")


def gather(payloads: list, out: np.ndarray) -> memoryview:
    """The payloads' bytes copied back to back into ``out`` (memory reused batch after batch, as ``np.copyto``'s
    reference copy reuses its destination; a fresh ``bytes`` per batch pays a page fault per 4 KiB). Memoryview
    slice assignment: a memcpy each, with less Python around it than numpy's slice assignment."""
    dst, k = memoryview(out), 0
    for p in payloads:
        b = memoryview(p).cast("B") if isinstance(p, np.ndarray) else p
        n = len(b)
        dst[k : k + n] = b
        k += n
    return dst[:k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("datasets", nargs="+", type=Path)
    ap.add_argument("--folder", type=Path, help="the source folder, for the CPU table's open + read row")
    ap.add_argument("--batch-size", type=int, default=64, help="cpu table's batch (default 64)")
    ap.add_argument("--batch", type=int, default=256, help="batch table's batch (default 256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("cpu", "batch"), help="one table only")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"pid {os.getpid()}, load average {os.getloadavg()[0]:.1f}")
    if a.only != "batch":
        cpu_table(a.datasets, a.folder, a.batch_size, a.repeats)
    if a.only != "cpu":
        batch_table(a.datasets, a.batch, a.repeats)


if __name__ == "__main__":
    main()
