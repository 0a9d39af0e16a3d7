"""A new training run on a page cache with a few pages missing: ThreadLoader's first epochs, the bytes its
read-ahead is asked for, and the CPU per image.

    python examples/measure_idle_cache.py DATASET --evict 0.01 --epochs 3
    python examples/measure_idle_cache.py DATASET --idle 60 --epochs 3

Every file of DATASET is read once by another process (its pages cached, mapped by nobody); then ``--evict F``
drops a random fraction F of each file's pages (``POSIX_FADV_DONTNEED``, seeded), or ``--idle S`` waits S seconds
(the kernel may drop idle pages: this VM drops pages no process maps within a minute, and a JPEG's pages the
decoder never touches, an EXIF thumbnail's, stay unmapped), and ``ThreadLoader`` epochs (2 threads, batch 64,
BlockShuffleSampler) read it in this process. "read ahead" is the bytes of the spans its read-ahead planned
(``packer.read.readahead.start``). Results and the command: docs/results.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import packer
from packer.read import readahead

PLANNED = [0]  # bytes of the spans read-ahead was asked for


def counted_start(requests, *args, **kwargs) -> readahead.Pending:
    """``readahead.start``, counting the bytes of the spans it plans."""
    job = START(requests, *args, **kwargs)
    PLANNED[0] += sum(end - start for _path, start, end in job.spans)
    return job


START, readahead.start = readahead.start, counted_start


def evict_pages(files: list[str], fraction: float, seed: int = 0) -> int:
    """Drop a random ``fraction`` of each file's pages from the page cache; the number of pages asked."""
    rng, page, dropped = np.random.default_rng(seed), os.sysconf("SC_PAGE_SIZE"), 0
    for f in files:
        pages = -(-os.path.getsize(f) // page)
        fd = os.open(f, os.O_RDONLY)
        try:
            for p in rng.choice(pages, int(pages * fraction), replace=False).tolist():
                os.posix_fadvise(fd, p * page, page, os.POSIX_FADV_DONTNEED)
                dropped += 1
        finally:
            os.close(fd)
    return dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--idle", type=float, default=0.0, help="seconds between the warming read and the epochs")
    ap.add_argument("--evict", type=float, default=0.0, help="fraction of each file's pages dropped after it")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    files = [str(p) for p in sorted(a.dataset.rglob("*")) if p.is_file()]
    code = "import sys\nfor f in sys.argv[1:]:\n    open(f, 'rb').read()"
    subprocess.run([sys.executable, "-c", code, *files], check=True)  # cached, mapped by nobody
    time.sleep(a.idle)
    dropped = evict_pages(files, a.evict)
    ds = packer.open_dataset(a.dataset, image="tensor")
    print(f"{a.dataset}: {len(ds)} samples, {sum(Path(f).stat().st_size for f in files) / 1e6:.1f} MB, "
          f"idle {a.idle:g} s, {dropped} pages dropped")
    for epoch in range(a.epochs):
        sampler = packer.BlockShuffleSampler(ds, batch_size=a.batch_size, seed=epoch)
        PLANNED[0], c0, t0, n = 0, time.process_time(), time.perf_counter(), 0
        for images, _labels in packer.ThreadLoader(ds, batch_size=a.batch_size, sampler=sampler, num_threads=2):
            n += len(images)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"epoch {epoch}: {n / wall:,.0f} img/s, {cpu / max(n, 1) * 1e6:,.0f} us CPU per image, "
              f"read ahead {PLANNED[0] / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
