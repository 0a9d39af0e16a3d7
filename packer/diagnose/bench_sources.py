"""What ``packer bench`` reads, and in which order: a loose folder or a packed dataset (``Source``),
read ``sequential``, uniform ``shuffle`` or in packer's locality-preserving ``block`` order (``BenchOrder``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from packer.diagnose import measure
from packer.errors import PackerError, under_way
from packer.images.decode import pil_loader

BENCH_ORDERS = ("sequential", "shuffle", "block")


# ------------------------------------------------------------------ orders


@dataclass
class BenchOrder:
    """A sample order and the chunks the read and decode levels fetch together (batches, as a DataLoader would)."""

    kind: str
    indices: np.ndarray
    chunks: list[np.ndarray]
    blocks: np.ndarray | None = None  # block order: the blocks, its indices' read hints

    def head(self, k: int) -> BenchOrder:
        first = self.indices[:k]
        return BenchOrder(self.kind, first, [first], self.blocks)


def make_order(kind: str, nbytes: np.ndarray, seed: int, block_bytes: int | None = None,
               open_blocks: int | None = None, batch_size: int = 64, cuts: Sequence[int] = (),
               run: int | None = None, blocks: np.ndarray | None = None) -> BenchOrder:
    """``sequential``, uniform ``shuffle``, or ``block``: packer.read.sampler's locality-preserving order
    (the format's own ``blocks`` unless ``block_bytes`` is given, else blocks of ``block_bytes`` cut
    at ``cuts`` (shard starts); windows of ``open_blocks`` blocks, runs of ``run`` neighbours; the
    sampler's defaults when None), exactly as BlockShuffleSampler yields it for one process in epoch 0."""
    from packer.read import sampler

    n = len(nbytes)
    bounds = None
    if kind == "sequential":
        idx = np.arange(n, dtype=np.int64)
    elif kind == "shuffle":
        idx = np.random.default_rng(seed).permutation(n).astype(np.int64)
    elif kind == "block":
        bounds = (np.asarray(blocks, dtype=np.int64) if blocks is not None and block_bytes is None else
                  sampler.block_boundaries(np.asarray(nbytes), block_bytes or sampler.DEFAULT_BLOCK_BYTES, cuts))
        idx = sampler.rank_order(bounds, 0, seed, open_blocks=open_blocks or sampler.DEFAULT_OPEN_BLOCKS,
                                 run=run or sampler.DEFAULT_RUN, batch_size=batch_size)
    else:
        raise PackerError(f"unknown order {kind!r} (choose {', '.join(BENCH_ORDERS)})")
    step = max(batch_size, 1)
    return BenchOrder(kind, idx, [idx[s:s + step] for s in range(0, n, step)], bounds)


# ------------------------------------------------------------------ sources


class FolderSamples(Dataset):
    """A loose folder read as ImageFolder reads it, returning CHW uint8 tensors (no transform)."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int]) -> None:
        self.paths, self.labels = list(paths), list(labels)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return torch.from_numpy(np.array(pil_loader(self.paths[i]))).permute(2, 0, 1), self.labels[i]


TRAIN_SIZE = 224  # the train level's RandomResizedCrop output


class FolderTrain(FolderSamples):
    """A loose folder read as torchvision trains on it: PIL decode, then RandomResizedCrop(224) (crop, BILINEAR
    resize) and a horizontal flip, as a CHW uint8 tensor (``ToTensor`` without the float scaling)."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int]) -> None:
        from packer.images.crop import RandomResizedCropDecode

        super().__init__(paths, labels)
        self.crop = RandomResizedCropDecode(TRAIN_SIZE)  # only its torchvision-equal window draws

    def __getitem__(self, i: int):
        img = pil_loader(self.paths[i])
        win = self.crop.window(img.height, img.width, i)
        box = (win.left, win.top, win.left + win.width, win.top + win.height)
        img = img.crop(box).resize((TRAIN_SIZE, TRAIN_SIZE), Image.Resampling.BILINEAR)
        if win.flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), self.labels[i]


def list_collate(batch):
    """Images of different sizes can't be stacked without a transform: keep them as a list."""
    return [b[0] for b in batch], torch.tensor([b[1] for b in batch])


def one_shape(dataset) -> bool:
    """Whether every image has one known size: then the loader level stacks batches (default_collate), as
    training would."""
    index = getattr(dataset, "index", None)
    if index is None or not len(index.heights):
        return False
    h, w = index.heights, index.widths
    return bool(h[0] > 0 and w[0] > 0 and np.all(h == h[0]) and np.all(w == w[0]))


@dataclass
class Source:
    """One dataset under test: a loose folder or a packed dataset, cut to ``limit`` samples."""

    path: Path
    kind: str  # "folder" or the packed format name
    payload: str  # "encoded" or "raw"
    decoder: str  # the decoder its decode level uses
    nbytes: np.ndarray  # payload bytes per sample (the first n)
    files: list[str]  # every file of the dataset: what a cold pass evicts
    paths: list[str] = field(default_factory=list)  # folder: absolute image paths
    labels: list[int] = field(default_factory=list)
    disk_bytes: int = 0  # bytes of all files of the dataset on disk
    cuts: tuple[int, ...] = ()  # shard starts after the first: blocks of the block order never span two
    blocks: np.ndarray | None = None  # the format's own blocks (one mosaic each), as BlockShuffleSampler takes them

    @property
    def n(self) -> int:
        return len(self.nbytes)

    @property
    def name(self) -> str:
        return self.path.name

    def open(self, image: Literal["pil", "numpy", "tensor"] = "numpy", crop=None):
        from packer.read.dataset import open_dataset

        return open_dataset(self.path, image=image, decoder=self.decoder, crop=crop)

    def decode_samples(self, k: int = 48) -> list[bytes]:
        """Up to ``k`` stored payloads spread over the source, to measure its decoder on."""
        return measure.load_samples(self.paths if self.kind == "folder" else self.path, k)


def _packed_source(p: Path, limit: int | None) -> Source:
    from packer.formats import get_format
    from packer.layout.index import Index
    from packer.layout.manifest import read_manifest

    m = read_manifest(p)
    idx = Index.load(p, m.num_samples, source_records=m.source_records)
    n = m.num_samples if limit is None else min(limit, m.num_samples)
    files = measure.tree_files(p)
    starts = np.cumsum([s.num_samples for s in m.shards])[:-1]
    blocks = get_format(m.format).block_boundaries(m)
    blocks = None if blocks is None else np.append(blocks[blocks < n], n)
    return Source(p, m.format, m.payload, "auto", np.asarray(idx.nbytes[:n], dtype=np.int64), files,
                  disk_bytes=sum(os.path.getsize(f) for f in files), cuts=tuple(int(c) for c in starts if c < n),
                  blocks=blocks)


def open_source(path: str | os.PathLike, limit: int | None) -> Source:
    """A packed dataset (a folder with a manifest) or a loose image folder, cut to its first ``limit`` samples."""
    from packer.layout.manifest import MANIFEST_NAME
    from packer.write.scan import scan_folder

    p = Path(path)
    if not p.exists():
        raise PackerError(f"{p}: no such folder or dataset")
    if (p / MANIFEST_NAME).exists():
        with under_way():  # a dataset failing its checks: the data is bad (exit 1), not the command line
            return _packed_source(p, limit)
    scan = scan_folder(p)
    n = len(scan.rel_paths) if limit is None else min(limit, len(scan.rel_paths))
    paths = [os.path.join(p, r) for r in scan.rel_paths[:n]]
    all_paths = [os.path.join(p, r) for r in scan.rel_paths]
    nbytes = np.array([os.path.getsize(f) for f in paths], dtype=np.int64)
    return Source(p, "folder", "encoded", "pil", nbytes, all_paths, paths=paths,
                  labels=[int(v) for v in list(scan.labels)[:n]], disk_bytes=int(nbytes.sum()))
