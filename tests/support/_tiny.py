"""Tiny ImageFolder datasets for the profiler, prefetcher and cache tests (real JPEGs, real LMDB)."""

from __future__ import annotations

from pathlib import Path

import packer
from support.imagesets import make_imagefolder


def make_lmdb(tmp_path: Path, count: int = 24, size=(24, 32)) -> Path:
    """An LMDB of ``count`` small photo-like JPEGs in 2 classes."""
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=count // 2, size=size)
    res = packer.convert(src, tmp_path / "imgs.lmdb", to="lmdb", workers=0, progress=False)
    return res.output


def mapped_files(needle: str) -> list[tuple[str, int]]:
    """(path, inode) of this process's memory mappings whose path contains ``needle``."""
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and needle in parts[5]:
                out.append((parts[5].strip(), int(parts[4])))
    return sorted(set(out))


class Probe:
    """Wraps a dataset: each item also says which process served it and which cache files it maps."""

    def __init__(self, ds, needle: str) -> None:
        self.ds, self.needle = ds, needle

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):
        import os

        img, label = self.ds[i]
        return i, os.getpid(), mapped_files(self.needle), img, label


def first(batch):
    """collate_fn for batch_size=1: the sample itself."""
    return batch[0]
