"""Per-sample metadata of a packed dataset, as plain numpy arrays.

Layout (folder ``meta/`` inside the dataset, each file a ``.npy`` loaded with
``allow_pickle=False``; dtypes pinned little-endian):

| file              | dtype | shape  | holds                                             |
|-------------------|-------|--------|---------------------------------------------------|
| labels.npy        | <i8   | [N]    | class index, -1 for a flat folder                 |
| heights.npy       | <i4   | [N]    | image height as stored (after any resize)         |
| widths.npy        | <i4   | [N]    | image width as stored                             |
| nbytes.npy        | <i8   | [N]    | payload bytes of the sample                       |
| path_blob.npy     | u1    | [B]    | UTF-8 relative source paths, back to back         |
| path_offsets.npy  | <i8   | [N+1]  | where each path starts in path_blob               |

Arrays, not lists of dicts: forked DataLoader workers share them without copying.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from packer.errors import PackerError

META_DIR = "meta"
DTYPES = {
    "labels": "<i8",
    "heights": "<i4",
    "widths": "<i4",
    "nbytes": "<i8",
    "path_blob": "u1",
    "path_offsets": "<i8",
}


@dataclass
class Index:
    labels: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    nbytes: np.ndarray
    path_blob: np.ndarray
    path_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def build(cls, rel_paths: list[str], labels, heights, widths, nbytes) -> Index:
        encoded = [p.encode("utf-8") for p in rel_paths]
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
        )

    def rel_path(self, i: int) -> str:
        start, end = self.path_offsets[i], self.path_offsets[i + 1]
        return self.path_blob[start:end].tobytes().decode("utf-8")

    def rel_paths(self) -> list[str]:
        blob = self.path_blob.tobytes()
        off = self.path_offsets.tolist()
        return [blob[off[i] : off[i + 1]].decode("utf-8") for i in range(len(self))]

    def save(self, directory: Path) -> list[str]:
        """Write the arrays under ``directory/meta``; returns the written names (relative)."""
        meta = directory / META_DIR
        meta.mkdir(exist_ok=True)
        names = []
        for f in fields(self):
            name = f"{META_DIR}/{f.name}.npy"
            np.save(directory / name, np.ascontiguousarray(getattr(self, f.name), dtype=DTYPES[f.name]))
            names.append(name)
        return names

    @classmethod
    def load(cls, directory: Path, num_samples: int) -> Index:
        arrays = {}
        for f in fields(cls):
            path = directory / META_DIR / f"{f.name}.npy"
            try:
                arr = np.load(path, allow_pickle=False, mmap_mode=None)
            except (OSError, ValueError, EOFError) as exc:
                raise PackerError(f"{path}: cannot read sample metadata ({exc})") from exc
            if arr.ndim != 1 or arr.dtype != np.dtype(DTYPES[f.name]):
                raise PackerError(f"{path}: expected a 1-D {DTYPES[f.name]} array, found {arr.dtype} {arr.shape}")
            arrays[f.name] = arr
        index = cls(**arrays)
        index.check(directory, num_samples)
        return index

    def check(self, directory: Path, num_samples: int) -> None:
        where = directory / META_DIR
        for name in ("labels", "heights", "widths", "nbytes"):
            if len(getattr(self, name)) != num_samples:
                raise PackerError(f"{where}/{name}.npy: {len(getattr(self, name))} entries, manifest says {num_samples}")
        off = self.path_offsets
        if len(off) != num_samples + 1 or off[0] != 0 or off[-1] != len(self.path_blob) or np.any(np.diff(off) < 0):
            raise PackerError(f"{where}/path_offsets.npy: offsets do not describe path_blob.npy")
        if np.any(self.nbytes < 0) or np.any(self.heights < 0) or np.any(self.widths < 0):
            raise PackerError(f"{where}: negative sizes in sample metadata")


def shard_starts(counts: list[int]) -> np.ndarray:
    """Global index of each shard's first sample, plus the total at the end."""
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts
