"""Conversion rate vs the rate at which the same processes merely read (or decode) the files.

The issue-2 targets: with ``--validate header`` conversion runs at >= 80% of the plain read
rate of the same number of processes; with full validation at >= 90% of their plain decode
rate. Each figure is the median of ``--repeats`` runs, interleaved so load drifts hit all alike.

    python examples/measure_convert.py demo/imgs --workers 2 --repeats 3 [--cold]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from packer import convert
from packer.decode import decode
from packer.scan import scan_folder

CHUNK = 16


def _read_chunk(paths: list[str]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as fh:
            n += len(fh.read())
    return n


def _decode_chunk(paths: list[str]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as fh:
            n += decode(fh.read(), "auto").shape[0]
    return n


def plain(fn, paths: list[str], workers: int) -> float:
    chunks = [paths[i : i + CHUNK] for i in range(0, len(paths), CHUNK)]
    t = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(fn, chunks))
    return len(paths) / (time.perf_counter() - t)


def packed(src: Path, validate: str, workers: int) -> float:
    out = Path(tempfile.mkdtemp(dir=src.parent)) / "o.lmdb"
    try:
        res = convert(src, out, validate=validate, workers=workers, progress=False)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="evict the source files from the page cache before each run")
    args = ap.parse_args()
    scan = scan_folder(args.source)
    paths = [str(scan.root / r) for r in scan.rel_paths]
    runs = {
        "plain read": lambda: plain(_read_chunk, paths, args.workers),
        "convert --validate header": lambda: packed(args.source, "header", args.workers),
        "plain decode": lambda: plain(_decode_chunk, paths, args.workers),
        "convert --validate full": lambda: packed(args.source, "full", args.workers),
    }
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            if args.cold:
                evict(paths)
            rates[name].append(fn())
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{len(paths)} files, {args.workers} workers, {'cold' if args.cold else 'warm'} cache, median of {args.repeats}")
    for k, v in rates.items():
        print(f"  {k:<28} {med[k]:8.0f} files/s   (min {min(v):.0f}, max {max(v):.0f})")
    print(f"  header conversion / plain read   = {med['convert --validate header'] / med['plain read']:.0%}  (target >= 80%)")
    print(f"  full conversion / plain decode   = {med['convert --validate full'] / med['plain decode']:.0%}  (target >= 90%)")


if __name__ == "__main__":
    main()
