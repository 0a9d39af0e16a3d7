"""Conversion rate as a fraction of its floor, per format: ``--validate header`` and full, cold and warm.

The floor of any converter is *plain copy*: the same pool reads (or reads and decodes) the files,
this process writes every byte into one file beside the outputs, fsyncs it and takes its sha256.
The targets: ``--validate header`` at >= 90 % of plain copy (read), full validation at
>= 85 % of plain copy (decode), cold and warm. Each figure is the median of ``--repeats`` runs;
within a repeat every run of a cache state is interleaved, so load drifts hit all alike.

    python examples/measure_convert.py demo/imgs --to lmdb,hdf5,memmap --workers 2 --repeats 3 \
        [--cache cold,warm] [--scratch DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from packer import convert
from packer.images.decode import decode
from packer.write.scan import scan_folder

CHUNK = 16
TARGETS = {"header": 0.90, "full": 0.85}


def _copy_chunk(paths: list[str], validate: str) -> list[bytes]:
    out = []
    for p in paths:
        with open(p, "rb") as fh:
            data = fh.read()
        if validate == "full":
            decode(data, "auto")
        out.append(data)
    return out


def plain_copy(paths: list[str], validate: str, workers: int, scratch: Path) -> float:
    """Read (or decode) in the pool, write every byte to one file here, fsync, sha256: the floor."""
    chunks = [paths[i : i + CHUNK] for i in range(0, len(paths), CHUNK)]
    tmp = Path(tempfile.mkdtemp(dir=scratch))
    try:
        t = time.perf_counter()
        with ProcessPoolExecutor(workers) as pool, open(tmp / "copy", "wb") as fh:
            for datas in pool.map(_copy_chunk, chunks, [validate] * len(chunks)):
                for data in datas:
                    fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        with open(tmp / "copy", "rb") as fh:
            hashlib.file_digest(fh, "sha256")
        return len(paths) / (time.perf_counter() - t)
    finally:
        shutil.rmtree(tmp)


def packed(src: Path, fmt: str, validate: str, workers: int, scratch: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=scratch)) / f"o.{fmt}"
    try:
        res = convert(src, out, to=fmt, validate=validate, workers=workers, progress=False)
        return (res.num_samples + len(res.errors)) / res.seconds
    finally:
        shutil.rmtree(out.parent)


def evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the pools are joined when a run ends)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("--to", default="lmdb,hdf5,memmap", help="formats, comma-separated")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="cold,warm",
                    help="cold (source files evicted from the page cache before each run), warm, or both")
    ap.add_argument("--scratch", type=Path, help="where outputs are written (default: beside the source)")
    args = ap.parse_args()
    scratch = args.scratch or args.source.parent
    scratch.mkdir(parents=True, exist_ok=True)
    formats = [f for f in args.to.split(",") if f]
    caches = [c for c in args.cache.split(",") if c]
    scan = scan_folder(args.source)
    paths = [str(scan.root / r) for r in scan.rel_paths]
    runs: dict[tuple[str, str], Callable[[], float]] = {}
    for validate in ("header", "full"):
        runs[("floor", validate)] = lambda v=validate: plain_copy(paths, v, args.workers, scratch)
        for fmt in formats:
            runs[(fmt, validate)] = lambda f=fmt, v=validate: packed(args.source, f, v, args.workers, scratch)
    rates: dict[tuple[str, str, str], list[float]] = {}
    cpus: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.repeats):
        for cache in caches:
            for (what, validate), fn in runs.items():
                if cache == "cold":
                    evict(paths)
                else:
                    _copy_chunk(paths, "header")  # warm: every source file in the page cache
                before = cpu_seconds()
                rates.setdefault((what, validate, cache), []).append(fn())
                cpus.setdefault((what, validate, cache), []).append(cpu_seconds() - before)
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    print(f"{len(paths)} files, {args.workers} workers, median of {args.repeats} (files/s; min-max; CPU seconds of "
          f"all processes), load average {os.getloadavg()[0]:.1f}")
    for (what, validate, cache), v in rates.items():
        print(f"  {cache:<4} {validate:<6} {what:<8} {med[what, validate, cache]:7.0f}  ({min(v):.0f}-{max(v):.0f})"
              f"  {cpu[what, validate, cache]:6.2f} s CPU")
    print("\nconversion / plain copy (targets: header >= 90 %, full >= 85 %, cold and warm)")
    cols = [(v, c) for v in ("header", "full") for c in caches]
    print(f"  {'format':<8}" + "".join(f"{v + ' ' + c:>14}" for v, c in cols))
    for fmt in formats:
        cells = []
        for v, c in cols:
            ratio = med[fmt, v, c] / med["floor", v, c]
            cells.append(f"{ratio:>10.0%}{' ok ' if ratio >= TARGETS[v] else ' -- '}")
        print(f"  {fmt:<8}" + "".join(cells))
    print("\nplain copy's CPU seconds / conversion's (the rate ratio where the cores are the limit)")
    for fmt in formats:
        print(f"  {fmt:<8}" + "".join(f"{cpu['floor', v, c] / cpu[fmt, v, c]:>14.0%}" for v, c in cols))


if __name__ == "__main__":
    main()
