"""Images/s of packer's loader, packer.dali (DALI fed by packer) and DALI's own file reader, same photos.

    python examples/measure_dali.py --workdir /tmp/dali-bench --count 2000 [--emulate hdd]

Generates ``--count`` photo-like JPEGs with ``packer sample`` (about 500x375, ~100 KB, 10 classes)
into ``WORKDIR/imgs`` and converts them to ``WORKDIR/imgs.lmdb`` (encoded payloads), once. Then, one
whole epoch per pass, batch ``--batch-size``:

- ``packer DataLoader``: ``DataLoader(open_dataset(lmdb), batch_sampler=BlockBatchSampler, 2 workers)``,
  full decode (libjpeg-turbo), no augmentation (packer has no GPU-free train224 of its own here);
- ``packer.dali``: ``packer.dali.pipeline(lmdb, device="cpu", num_threads=2)``, the source in the
  main thread, ``augment="none"`` (decoded full images) and ``"train"`` (224 random resized crop,
  flip, normalize);
- ``DALI file reader``: ``fn.readers.file`` on the loose folder (random shuffle), the same decoder
  and augmentations, 2 threads.

DALI passes time ``pipe.run()`` (DALI's CPU outputs, before any conversion to torch tensors).
"warm": a first pass fills the page cache and is not timed. ``--emulate hdd`` (root, cgroup
block-IO throttle of packer.diagnose.throttle) adds "cold" passes: each pass evicts the files from
the page cache first (fsync + posix_fadvise DONTNEED, as ``packer bench``), under the throttle.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from torch.utils.data import DataLoader

import packer
from packer.diagnose.measure import evict, tree_files
from packer.diagnose.throttle import resolve_limits, throttled
from packer.read.dali import augment_graph, import_dali
from packer.read.sampler import BlockBatchSampler
from packer.tools.sample import make_sample


def keep(batch):
    return batch  # images of varying sizes: not stacked (their batch shares one block already)


def packer_loader(lmdb: Path, batch_size: int) -> int:
    ds = packer.open_dataset(lmdb, image="tensor")  # a batch decoded into one shared-memory block
    loader = DataLoader(ds, batch_sampler=BlockBatchSampler(ds, batch_size, warn=False), num_workers=2,
                        collate_fn=keep)
    n = sum(len(b) for b in loader)
    ds.close()
    return n


def packer_dali(lmdb: Path, batch_size: int, augment: str) -> int:
    pipe = packer.dali.pipeline(lmdb, batch_size, augment=augment, num_threads=2)  # type: ignore[arg-type]
    n = 0
    while True:
        try:
            n += len(pipe.run()[1])
        except StopIteration:
            return n


def dali_file_reader(folder: Path, batch_size: int, augment: str, count: int) -> int:
    """DALI's own reader and decoder on the loose files (the graph of DALI's ResNet-50 example)."""
    dali = import_dali()
    pipe = dali.pipeline.Pipeline(batch_size=batch_size, num_threads=2, device_id=None, seed=0)
    with pipe:
        jpegs, labels = dali.fn.readers.file(file_root=str(folder), random_shuffle=True, name="reader")
        pipe.set_outputs(augment_graph(dali, jpegs, False, "cpu", augment, 224), labels)  # packer.dali's operators
    pipe.build()
    for _ in range(math.ceil(count / batch_size)):
        pipe.run()
    return math.ceil(count / batch_size) * batch_size


def rate(run: Callable[[], int], cold_files: list[str] | None) -> float:
    if cold_files is None:
        run()  # warm-up pass, untimed
    else:
        res = evict(cold_files)
        if not res.verified:
            print(f"  (eviction not verified: {res})")
    t = time.perf_counter()
    n = run()
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dali-bench"))
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--emulate", choices=["hdd", "nfs", "ssd"], default=None)
    args = ap.parse_args()
    folder, lmdb = args.workdir / "imgs", args.workdir / "imgs.lmdb"
    if not folder.exists():
        make_sample(folder, count=args.count, classes=10, progress=False)
    if not lmdb.exists():
        packer.convert(folder, lmdb, to="lmdb", progress=False)
    count = len(packer.open_dataset(lmdb))
    bs = args.batch_size
    runs: dict[str, tuple[Callable[[], int], Path]] = {
        "packer DataLoader (2 workers), full decode": (lambda: packer_loader(lmdb, bs), lmdb),
        "packer.dali cpu (2 threads), no augment": (lambda: packer_dali(lmdb, bs, "none"), lmdb),
        "DALI file reader (2 threads), no augment": (lambda: dali_file_reader(folder, bs, "none", count), folder),
        "packer.dali cpu (2 threads), train224": (lambda: packer_dali(lmdb, bs, "train"), lmdb),
        "DALI file reader (2 threads), train224": (lambda: dali_file_reader(folder, bs, "train", count), folder),
    }
    print(f"{count} images, batch {bs}; images/s; load average before: {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores (other processes share them: compare rows of one run)")
    print(f"| pipeline | warm |{' cold, ' + args.emulate + ' |' if args.emulate else ''}")
    warm = {name: rate(run, None) for name, (run, _) in runs.items()}
    cold: dict[str, float] = {}
    if args.emulate:
        iops, bps, _ = resolve_limits(args.emulate, None, None)
        with throttled([lmdb, folder], iops, bps):
            cold = {name: rate(run, tree_files(where)) for name, (run, where) in runs.items()}
    for name in runs:
        print(f"| {name} | {warm[name]:,.0f} |" + (f" {cold[name]:,.0f} |" if cold else ""))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
