"""A new training run on a page cache left idle: ThreadLoader's first epochs, the bytes its read-ahead copies, and
the CPU per image.

    python examples/measure_idle_cache.py DATASET --idle 60 --epochs 3

Every file of DATASET is read once by another process (its pages cached, mapped by nobody), left idle ``--idle``
seconds, then read by ``ThreadLoader`` epochs (2 threads, batch 64, BlockShuffleSampler) in this process. The kernel
may drop idle pages (this VM does, within a minute, pages no process maps) and a JPEG's pages the decoder never
touches (an EXIF thumbnail's) are dropped first: a batch with such a sample then needs reading again. "read ahead" is
what this process read with ``read``/``pread`` in the epoch (``/proc/self/io`` rchar: the read-ahead thread's copies;
decoding reads the cache through maps). Results and the command: docs/results.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

import packer


def read_chars() -> int:
    """Bytes this process has read through read-like calls (Linux ``/proc/self/io``); 0 where not available."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--idle", type=float, default=60.0, help="seconds between the warming read and the epochs")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    files = [str(p) for p in sorted(a.dataset.rglob("*")) if p.is_file()]
    code = "import sys\nfor f in sys.argv[1:]:\n    open(f, 'rb').read()"
    subprocess.run([sys.executable, "-c", code, *files], check=True)  # cached, mapped by nobody
    time.sleep(a.idle)
    ds = packer.open_dataset(a.dataset, image="tensor")
    print(f"{a.dataset}: {len(ds)} samples, {sum(Path(f).stat().st_size for f in files) / 1e6:.1f} MB, "
          f"idle {a.idle:g} s")
    for epoch in range(a.epochs):
        sampler = packer.BlockShuffleSampler(ds, batch_size=a.batch_size, seed=epoch)
        r0, c0, t0, n = read_chars(), time.process_time(), time.perf_counter(), 0
        for images, _labels in packer.ThreadLoader(ds, batch_size=a.batch_size, sampler=sampler, num_threads=2):
            n += len(images)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"epoch {epoch}: {n / wall:,.0f} img/s, {cpu / max(n, 1) * 1e6:,.0f} us CPU per image, "
              f"read ahead {(read_chars() - r0) / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
