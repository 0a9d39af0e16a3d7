"""train224 through a ThreadLoader with torch's ops in the decode threads on one OpenMP thread each, or on a team.

    python examples/measure_intraop.py photos.lmdb --rounds 3

Whole epochs (2 threads, BlockShuffleSampler, warm, RandomResizedCropDecode(224)), the two settings interleaved
round by round, the process's torch setting left at its default (all cores, as in a training script):
``serial`` is packer's (``packer.read.intraop.serial_ops`` in every decode thread), ``team`` leaves each
decode thread an OpenMP team of the process's size. Reported: images/s, and CPU microseconds per image of the
decode threads and of every other thread of the process (OpenMP's own threads among them; /proc per thread).
Figures: docs/results.md.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import packer
import packer.read.threaded as threaded
from packer import sysinfo


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread id of this process."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        seconds = sysinfo.cpu_seconds(f"self/task/{task.name}")
        if seconds is not None:  # else ended meanwhile
            out[task.name] = seconds
    return out


def epoch(ds) -> tuple[float, float, float]:
    """(images/s, decode threads' CPU us per image, other threads' CPU us per image) of one epoch."""
    loader = packer.ThreadLoader(ds, batch_size=64, sampler=packer.BlockShuffleSampler(ds, batch_size=64, seed=0),
                                 num_threads=2)
    before, n, t0 = thread_cpu(), 0, time.perf_counter()
    decode_ids: set[str] = set()
    after = before
    for k, (images, _labels) in enumerate(loader):
        n += len(images)
        if k == len(loader) - 1:  # the pool's threads end with the epoch: read them while they live
            decode_ids = {str(t.native_id) for t in threading.enumerate() if t.name.startswith("packer-decode")}
            after = thread_cpu()
    rate = n / (time.perf_counter() - t0)
    used = {tid: c - before.get(tid, 0.0) for tid, c in after.items()}
    decode = sum(c for tid, c in used.items() if tid in decode_ids)
    return rate, decode / n * 1e6, (sum(used.values()) - decode) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packed", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ds = packer.open_dataset(a.packed, image="tensor", crop=packer.RandomResizedCropDecode(224))
    serial = threaded.serial_ops
    epoch(ds)  # batch memory and page cache warm
    for r in range(a.rounds):
        for name, init in (("serial", serial), ("team", lambda: False)):
            threaded.serial_ops = init
            rate, decode, other = epoch(ds)
            print(f"round {r + 1}: {name}: {rate:,.0f} img/s, decode threads {decode:,.0f} us CPU per image, "
                  f"other threads {other:,.0f} us")
    threaded.serial_ops = serial


if __name__ == "__main__":
    main()
