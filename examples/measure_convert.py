"""Conversion rate vs the rate at which the same processes merely read (or decode) the files.

The goals it checks: with ``--validate header`` conversion runs at >= 80% of the plain read
rate of the same number of processes; with full validation at >= 90% of their plain decode
rate. Each figure is the median of ``--repeats`` runs, interleaved so load drifts hit all alike.

"plain copy" is the physical floor of any converter: the same pool reads (or decodes) the files
and this process writes the bytes into one file beside the output, fsyncs and sha256s it.
Conversion is shown as a fraction of both: the gap to plain copy is what our code costs.

    python examples/measure_convert.py demo/imgs --workers 2 --repeats 3 [--cold] [--scratch DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from packer import convert
from packer.images.decode import decode
from packer.write.scan import scan_folder

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


def _copy_chunk(paths: list[str], validate: str) -> list[bytes]:
    out = []
    for p in paths:
        with open(p, "rb") as fh:
            data = fh.read()
        if validate == "full":
            decode(data, "auto")
        out.append(data)
    return out


def plain(fn, paths: list[str], workers: int) -> float:
    chunks = [paths[i : i + CHUNK] for i in range(0, len(paths), CHUNK)]
    t = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(fn, chunks))
    return len(paths) / (time.perf_counter() - t)


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


def packed(src: Path, validate: str, workers: int, scratch: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=scratch)) / "o.lmdb"
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
    ap.add_argument("--scratch", type=Path, help="where outputs are written (default: beside the source)")
    args = ap.parse_args()
    scratch = args.scratch or args.source.parent
    scan = scan_folder(args.source)
    paths = [str(scan.root / r) for r in scan.rel_paths]
    runs = {
        "plain read": lambda: plain(_read_chunk, paths, args.workers),
        "plain copy (read)": lambda: plain_copy(paths, "header", args.workers, scratch),
        "convert --validate header": lambda: packed(args.source, "header", args.workers, scratch),
        "plain decode": lambda: plain(_decode_chunk, paths, args.workers),
        "plain copy (decode)": lambda: plain_copy(paths, "full", args.workers, scratch),
        "convert --validate full": lambda: packed(args.source, "full", args.workers, scratch),
    }
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            if args.cold:
                evict(paths)
            rates[name].append(fn())
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{len(paths)} files, {args.workers} workers, {'cold' if args.cold else 'warm'} cache, "
          f"median of {args.repeats}")
    for k, v in rates.items():
        print(f"  {k:<28} {med[k]:8.0f} files/s   (min {min(v):.0f}, max {max(v):.0f})")
    for conv, base, copy, target in (("header", "plain read", "plain copy (read)", 80),
                                     ("full", "plain decode", "plain copy (decode)", 90)):
        rate = med[f"convert --validate {conv}"]
        print(f"  {conv:>6} conversion / {base:<12} = {rate / med[base]:4.0%}  (target >= {target}%);"
              f"  / {copy} = {rate / med[copy]:4.0%}")


if __name__ == "__main__":
    main()
