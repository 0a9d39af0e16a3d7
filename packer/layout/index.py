"""Per-sample metadata of a packed dataset, as plain numpy arrays.

Layout (folder ``meta/`` inside the dataset, each file a ``.npy`` loaded with
``allow_pickle=False``; dtypes pinned little-endian):

| file              | dtype | shape  | holds                                             |
|-------------------|-------|--------|---------------------------------------------------|
| labels.npy        | <i8   | [N]    | class index, -1 for a flat folder                 |
| heights.npy       | <i4   | [N]    | image height as stored (after any resize)         |
| widths.npy        | <i4   | [N]    | image width as stored                             |
| nbytes.npy        | <i8   | [N]    | payload bytes of the sample                       |
| path_blob.npy     | u1    | [B]    | UTF-8 relative source paths, back to back (1)     |
| path_offsets.npy  | <i8   | [N+1]  | where each path starts in path_blob               |
| position.npy      | <i8   | [N]    | storage position of the packed sample i (2)       |
| source_index.npy  | <i8   | [N]    | the sample's number in the source's numbering (3) |

(1) A name whose bytes are not UTF-8 is kept as it was on disk: in Python it reads back with
those bytes as lone surrogates (``surrogateescape``, as ``os.fsdecode``), so opening or
extracting it reaches the same file name.

(2) Samples are stored in the conversion's ``--order`` (a seeded shuffle by default), and every
array above is in that storage order; ``position`` maps the dataset's sample index ``i`` (the packed
samples in the source's order: ImageFolder's order, failed files left out) to where the sample is stored
(``packer.read.indexing``). Datasets written before it existed lack the file: their indices are the
storage positions.

(3) ``ImageFolder(source)``'s index of the sample for a folder (the row of a list file, the member of an
archive, the n-th sample given to a ``Writer``; a re-packed dataset keeps its source's numbering), so that
with files left out (damaged, ``--classes``, ``--split``) ``ds.imagefolder_index(i)`` still names the
source's record exactly. Stored samples, in the dataset's order, have strictly increasing numbers below the
manifest's ``source_records``. Datasets written before it existed lack the file.

Arrays, not lists of dicts: forked DataLoader workers share them without copying.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from packer.errors import DatasetError
from packer.layout.fsutil import naming
from packer.layout.manifest import sha256_file
from packer.layout.trust import check_offsets, inside, load_npy
from packer.perprocess import PicklesAs

META_DIR = "meta"
DTYPES = {
    "labels": "<i8",
    "heights": "<i4",
    "widths": "<i4",
    "nbytes": "<i8",
    "path_blob": "u1",
    "path_offsets": "<i8",
    "position": "<i8",
    "source_index": "<i8",
}
OPTIONAL = frozenset({"position", "source_index"})  # absent from datasets written before they existed
MAX_SIDE = 1 << 20  # no real image has a side of a million pixels: larger values are damage
_PATH_CODEC = ("utf-8", "surrogateescape")  # file names are bytes: those that are not UTF-8 survive the round trip


@dataclass
class Index(PicklesAs):
    labels: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    nbytes: np.ndarray
    path_blob: np.ndarray
    path_offsets: np.ndarray
    position: np.ndarray | None = None  # the dataset's index -> storage position; None: an older dataset
    source_index: np.ndarray | None = None  # per stored sample, its number in the source; None: an older dataset

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def build(cls, rel_paths: list[str], labels, heights, widths, nbytes,
              source_order: list[str] | None = None, source_numbers: np.ndarray | None = None) -> Index:
        """The index of samples stored in this order; ``source_order``: every source key in the source's order
        (failed ones too), from which ``position`` is recorded; ``source_numbers``: each of those keys' number in
        the source's numbering (``source_index``; None: 0, 1, ...)."""
        encoded = [p.encode(*_PATH_CODEC) for p in rel_paths]
        offsets = np.zeros(len(encoded) + 1, dtype="<i8")
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        blob = np.frombuffer(b"".join(encoded), dtype="u1").copy()
        return cls(
            labels=np.asarray(labels, dtype="<i8"),
            heights=np.asarray(heights, dtype="<i4"),
            widths=np.asarray(widths, dtype="<i4"),
            nbytes=np.asarray(nbytes, dtype="<i8"),
            path_blob=blob,
            path_offsets=offsets,
            position=None if source_order is None else imagefolder_positions(rel_paths, source_order),
            source_index=None if source_order is None else numbers_of(rel_paths, source_order, source_numbers),
        )

    def rel_path(self, i: int) -> str:
        start, end = self.path_offsets[i], self.path_offsets[i + 1]
        return self.path_blob[start:end].tobytes().decode(*_PATH_CODEC)

    def rel_paths(self) -> list[str]:
        blob = self.path_blob.tobytes()
        off = self.path_offsets.tolist()
        return [blob[off[i] : off[i + 1]].decode(*_PATH_CODEC) for i in range(len(self))]

    def save(self, directory: Path) -> list[str]:
        """Write the arrays under ``directory/meta``; returns the written names (relative).

        A failed write (disk full) raises an ``OSError`` naming the file.
        """
        meta = directory / META_DIR
        meta.mkdir(exist_ok=True)
        names = []
        for f in fields(self):
            if getattr(self, f.name) is None:
                continue
            name = f"{META_DIR}/{f.name}.npy"
            with naming(directory / name):
                np.save(directory / name, np.ascontiguousarray(getattr(self, f.name), dtype=DTYPES[f.name]))
            names.append(name)
        return names

    @classmethod
    def load(cls, directory: Path, num_samples: int, files: list | None = None,
             num_classes: int | None = None, source_records: int | None = None) -> Index:
        """Load and check ``meta/*.npy``; ``files`` (the manifest's ``meta_files``) adds size and sha256 checks;
        ``source_records``: the manifest's, which bounds ``source_index``.

        The dataset may be crafted: each file must stay inside ``directory``, match its
        checksum, and hold exactly the dtype and length expected before anything is allocated.
        """
        listed = {f.name: f for f in files} if files is not None else None
        arrays = {}
        for f in fields(cls):
            name = f"{META_DIR}/{f.name}.npy"
            if f.name in OPTIONAL and (name not in listed if listed is not None
                                       else not os.path.lexists(directory / name)):
                continue  # an older dataset
            path = listed_path(directory, name, listed)
            # Bound the length before loading: N entries per-sample array, N+1 offsets, blob <= file size.
            limit = {"path_offsets": num_samples + 1, "path_blob": None}.get(f.name, num_samples)
            arrays[f.name] = load_npy(path, DTYPES[f.name], ndim=1, max_items=limit)
        index = cls(**arrays)
        index.check(directory, num_samples, num_classes, source_records)
        return index

    def check(self, directory: Path, num_samples: int, num_classes: int | None = None,
              source_records: int | None = None) -> None:
        """Lengths match the manifest, offsets describe the path blob, values are in range."""
        where = directory / META_DIR
        for name in ("labels", "heights", "widths", "nbytes"):
            if len(getattr(self, name)) != num_samples:
                raise DatasetError(f"{where}/{name}.npy: {len(getattr(self, name))} entries, "
                                   f"manifest says {num_samples}")
        check_offsets(self.path_offsets, len(self.path_blob), f"{where}/path_offsets.npy", count=num_samples)
        if np.any(self.nbytes < 0) or np.any(self.heights < 0) or np.any(self.widths < 0):
            raise DatasetError(f"{where}: negative sizes in sample metadata")
        if np.any(self.heights > MAX_SIDE) or np.any(self.widths > MAX_SIDE):
            raise DatasetError(f"{where}: image sides above {MAX_SIDE} in sample metadata")
        if num_classes is not None and len(self.labels):
            low, high = int(self.labels.min()), int(self.labels.max())
            if low < -1 or high >= num_classes:
                raise DatasetError(f"{where}/labels.npy: labels from {low} to {high}, "
                                   f"but the dataset has {num_classes} classes")
        if self.position is not None:
            check_permutation(self.position, num_samples, f"{where}/position.npy")
        if self.source_index is not None:
            check_numbering(self.source_index if self.position is None else self.source_index[self.position],
                            num_samples, source_records, f"{where}/source_index.npy")


def listed_path(directory: Path, name: str, listed: dict | None) -> Path:
    """``directory/name`` inside the dataset; with ``listed`` (name -> the manifest's FileInfo), its size and
    sha256 checked against the manifest's entry (which must exist)."""
    path = inside(directory, name)
    if listed is None:
        return path
    info = listed.get(name)
    if info is None:
        raise DatasetError(f"{directory}: the manifest does not list {name}")
    try:
        same = path.stat().st_size == info.num_bytes and sha256_file(path) == info.sha256
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not same:
        raise DatasetError(f"{path}: size or checksum differs from the manifest (damaged or modified)")
    return path


def imagefolder_positions(stored: list[str], source_order: list[str]) -> np.ndarray:
    """For each sample in ImageFolder's order (``source_order``, the ``stored`` ones), its position in ``stored``."""
    rank = {p: k for k, p in enumerate(source_order)}
    try:
        in_source = np.fromiter((rank[p] for p in stored), dtype=np.int64, count=len(stored))
    except KeyError as exc:
        raise DatasetError(f"{exc.args[0]!r}: packed, but not among the source's files") from None
    return np.argsort(in_source, kind="stable").astype("<i8")


def numbers_of(stored: list[str], source_order: list[str], numbers: np.ndarray | None) -> np.ndarray:
    """For each stored key, its number in the source's numbering (``numbers[k]`` of ``source_order[k]``)."""
    rank = {p: k for k, p in enumerate(source_order)}
    at = np.fromiter((rank[p] for p in stored), dtype=np.int64, count=len(stored))
    return (at if numbers is None else np.asarray(numbers, dtype=np.int64)[at]).astype("<i8")


def check_numbering(in_order: np.ndarray, n: int, source_records: int | None, where: str) -> None:
    """The samples' source numbers, in the dataset's order: ``n`` of them, strictly increasing (the dataset keeps
    the source's order), below ``source_records`` (a crafted file could map a sample anywhere)."""
    if len(in_order) != n:
        raise DatasetError(f"{where}: {len(in_order)} entries, manifest says {n}")
    if source_records is None:
        raise DatasetError(f"{where}: present, but the manifest records no source_records")
    if n and (int(in_order[0]) < 0 or int(in_order[-1]) >= source_records or bool(np.any(np.diff(in_order) <= 0))):
        raise DatasetError(f"{where}: not increasing numbers from 0 to {source_records - 1} (damaged or crafted)")


def check_permutation(values: np.ndarray, n: int, where: str) -> None:
    """``values`` hold each of ``0 .. n-1`` exactly once (a crafted file could repeat or skip samples)."""
    if len(values) != n:
        raise DatasetError(f"{where}: {len(values)} entries, manifest says {n}")
    if n and (int(values.min()) < 0 or int(values.max()) >= n):
        raise DatasetError(f"{where}: positions outside 0..{n - 1}")
    seen = np.zeros(n, dtype=bool)
    seen[values] = True
    if not seen.all():
        raise DatasetError(f"{where}: not a permutation of the samples (some repeat, {int((~seen).sum())} missing)")


def shard_starts(counts: list[int]) -> np.ndarray:
    """Global index of each shard's first sample, plus the total at the end."""
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def normalize_index(i: int, n: int) -> int:
    """``i`` as a position in ``range(n)``, negative counting from the end, like a list; else IndexError
    (TypeError for what a list refuses as an index: floats, strings, slices)."""
    try:
        i = operator.index(i)
    except TypeError:
        raise TypeError(f"sample indices must be integers, not {type(i).__name__}") from None
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample index {i} out of range for a dataset of {n}")
    return i


def normalize_indices(indices: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """``normalize_index`` of each (int64), in one vectorized step where they are integers already (a list of
    ints, an integer array or tensor): per index, that check costs as much as reading a warm sample."""
    try:
        arr = np.asarray(indices)
    except (TypeError, ValueError, RuntimeError):  # e.g. a CUDA tensor: each index on its own, as a list does
        arr = np.asarray(None)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.size and arr.max() >= n):
        return np.fromiter((normalize_index(i, n) for i in indices), dtype=np.int64, count=len(indices))
    out = arr.astype(np.int64)
    out[out < 0] += n
    bad = np.flatnonzero((out < 0) | (out >= n))
    if len(bad):
        raise IndexError(f"sample index {int(out[bad[0]])} out of range for a dataset of {n}")
    return out
