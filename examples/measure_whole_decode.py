"""Whole-JPEG decodes into given memory: PyTurboJPEG against packer's compiled extension, alone and in a ThreadLoader.

    python examples/measure_whole_decode.py PHOTOS/ photos.memmap --rounds 3

Part 1, one thread, 100 of the folder's JPEGs in memory decoded into arrays reused each pass: CPU microseconds
per image of PyTurboJPEG's ``decode(dst=)`` alone (what ``packer bench`` calls the bare decode), packer's
``decode(out=)`` through PyTurboJPEG (a header read, then the decode: two handles and two header parses per
image) and through the extension (one call without the GIL). Part 2: whole ThreadLoader epochs (2 threads,
BlockShuffleSampler, warm) of the packed copy interleaved: each decode thread's chunk decoded by one call of the
extension (``decode_many``), one call per image, and PyTurboJPEG; images/s, as a fraction of the decode limit
(usable cores x the bare rate of part 1), and the CPU each decode thread spent per image (/proc).
Figures: docs/results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

import packer
import packer.images.decode as dec
from packer import sysinfo
from packer.images.headers import jpeg_size
from packer.read.decoding import Decoding

TICK = os.sysconf("SC_CLK_TCK")


def per_image_us(fn, n: int, repeats: int = 5) -> float:
    """Median CPU microseconds per image over ``repeats`` passes of ``fn`` (which decodes ``n`` images)."""
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append((time.process_time() - t) / n * 1e6)
    return statistics.median(times)


def single_thread(folder: Path, rounds: int) -> float:
    """Prints part 1; returns the decode limit: usable cores x PyTurboJPEG's images per CPU-second alone."""
    datas = [f.read_bytes() for f in sorted(folder.rglob("*.jpg"))[:100]]
    outs = [np.empty((*jpeg_size(d), 3), np.uint8) for d in datas]
    tj, native = dec.turbojpeg_handle(), dec._native
    if tj is None or native is None:
        raise SystemExit("needs PyTurboJPEG's library and the compiled extension (pip install -e .)")

    def bare() -> None:
        for d, o in zip(datas, outs):
            tj.decode(d, pixel_format=0, dst=o)

    def packer_decode() -> None:
        for d, o in zip(datas, outs):
            dec.decode(d, out=o)

    bare_us: list[float] = []
    for r in range(rounds):
        row = {"PyTurboJPEG decode(dst=) alone": per_image_us(bare, len(datas))}
        dec._native = None
        row["packer decode(out=), PyTurboJPEG"] = per_image_us(packer_decode, len(datas))
        dec._native = native
        row["packer decode(out=), extension"] = per_image_us(packer_decode, len(datas))
        print(f"round {r + 1}: " + "; ".join(f"{k} {v:,.0f} us" for k, v in row.items()))
        bare_us.append(row["PyTurboJPEG decode(dst=) alone"])
    limit = sysinfo.usable_cores() * 1e6 / statistics.median(bare_us)
    print(f"decode limit: {sysinfo.usable_cores()} cores x the bare rate = {limit:,.0f} img/s")
    return limit


def thread_cpu(tid: int) -> float | None:
    """CPU seconds thread ``tid`` of this process has used (None once it has ended)."""
    return sysinfo.cpu_seconds(f"self/task/{tid}")


def epoch(ds) -> tuple[float, float]:
    """(images/s, CPU seconds per image of the decode threads) of one ThreadLoader epoch."""
    loader = packer.ThreadLoader(ds, batch_size=64, sampler=packer.BlockShuffleSampler(ds, batch_size=64, seed=0),
                                 num_threads=2)
    n, decode_cpu, t0 = 0, 0.0, time.perf_counter()
    for k, (images, _labels) in enumerate(loader):
        n += len(images)
        if k == len(loader) - 1:  # the pool's threads end with the epoch: read their CPU while they live
            decode_cpu = sum(thread_cpu(t.native_id) or 0.0 for t in threading.enumerate()
                             if t.name.startswith("packer-decode") and t.native_id is not None)
    return n / (time.perf_counter() - t0), decode_cpu / n


def threads(path: Path, rounds: int, limit: float) -> None:
    ds = packer.open_dataset(path, image="tensor")
    native, bulk = dec._native, Decoding._in_bulk
    epoch(ds)  # batch memory and page cache warm
    settings = (("extension, chunks in one call", native, bulk), ("extension, one call per image", native, None),
                ("PyTurboJPEG", None, None))
    try:
        for r in range(rounds):
            for name, ext, many in settings:
                dec._native = ext
                Decoding._in_bulk = many or (lambda *args: None)  # type: ignore[method-assign]  # None: one by one
                rate, cpu = epoch(ds)
                print(f"round {r + 1}: ThreadLoader, {name}: {rate:,.0f} img/s ({rate / limit:.1%} of the limit), "
                      f"decode threads {cpu * 1e6:,.0f} us CPU per image")
    finally:
        dec._native, Decoding._in_bulk = native, bulk  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("packed", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    limit = single_thread(a.folder, a.rounds)
    threads(a.packed, a.rounds, limit)


if __name__ == "__main__":
    main()
