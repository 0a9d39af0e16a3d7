"""What ThreadLoader's copies cost: a batch's payloads as views of the map (a DataLoader's reads) against copies
(``SampleSource.payloads(into=, places=)``: under the SIGBUS guard where ``packer.formats._safecopy`` is built,
else ``pread``), raw pixels placed in their batch slots either way, in one process, alternating, on warm data.

    python examples/measure_thread_copies.py DATASET.lmdb DATASET.memmap --batches 60 --rounds 5

Per dataset: CPU microseconds per sample of each (median of the rounds) and their ratio. Results: docs/results.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import packer
from packer.formats import safecopy
from packer.images.decode import copy_into
from packer.read.readahead import Pending
from packer.read.slots import BlockPool, Pooled


def _place(ds, payloads: list, slots: list) -> None:
    """Raw pixels into their slots, as decoding does (nothing to copy where they were read there)."""
    if ds.manifest.payload == "raw":
        for p, s in zip(payloads, slots, strict=True):
            copy_into(np.frombuffer(p, np.uint8).reshape(s.shape), s.numpy())


def _slots(ds, idx: np.ndarray) -> list:
    got = ds.pipeline.slots(idx, Pooled())
    assert got is not None, "slots need image='tensor' and sizes in the index"
    return got[1]


def views(ds, idx: np.ndarray, pool: BlockPool) -> None:
    slots = _slots(ds, idx)
    _place(ds, ds.payloads_at(idx, pending=Pending.ready(len(idx))), slots)


def copies(ds, idx: np.ndarray, pool: BlockPool) -> None:
    slots = _slots(ds, idx)
    flat = [s.view(-1).numpy() for s in slots]
    _place(ds, ds.payloads_at(idx, pending=Pending.ready(len(idx)), into=pool.take_array, places=flat), slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("datasets", nargs="+", type=Path)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    how = "under the SIGBUS guard" if safecopy.available() else "pread (packer.formats._safecopy not built)"
    print(f"copies: {how}")
    for path in a.datasets:
        ds = packer.open_dataset(path, image="tensor")
        pool = BlockPool(8)
        rng = np.random.default_rng(0)
        batches = [ds.positions(np.sort(rng.choice(len(ds), a.batch_size, replace=False))) for _ in range(a.batches)]
        for idx in batches:  # warm: page cache, batch memory
            views(ds, idx, pool)
            copies(ds, idx, pool)
        runs: dict[str, list[float]] = {"views": [], "copies": []}
        for _ in range(a.rounds):
            for name, fn in (("views", views), ("copies", copies)):
                t = time.process_time()
                for idx in batches:
                    fn(ds, idx, pool)
                runs[name].append((time.process_time() - t) / (len(batches) * a.batch_size) * 1e6)
        v, c = statistics.median(runs["views"]), statistics.median(runs["copies"])
        size = float(ds.index.nbytes.mean())
        print(f"{path} ({ds.manifest.payload}, {size / 1e3:.0f} KB per sample): views {v:.1f} us, copies {c:.1f} us "
              f"CPU per sample ({c - v:+.1f} us, x{c / v:.2f})")


if __name__ == "__main__":
    main()
