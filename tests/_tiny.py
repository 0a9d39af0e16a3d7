"""Tiny ImageFolder datasets for the profiler, prefetcher and cache tests (real JPEGs, real LMDB)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

import packer


def make_folder(root: Path, count: int = 24, classes: int = 2, size: tuple[int, int] = (24, 32), seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for n in range(count):
        d = root / f"c{n % classes}"
        d.mkdir(parents=True, exist_ok=True)
        h, w = size[0] + int(rng.integers(0, 5)), size[1] + int(rng.integers(0, 5))
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(arr).save(d / f"img{n:03d}.jpg", quality=90)
    return root


def make_lmdb(tmp_path: Path, count: int = 24, **kw) -> Path:
    src = make_folder(tmp_path / "imgs", count=count, **kw)
    res = packer.convert(src, tmp_path / "imgs.lmdb", to="lmdb", workers=1, progress=False)
    return res.output
