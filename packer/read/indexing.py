"""What a sample index means: ImageFolder's sample index, mapped once to where the sample is stored.

Conversion stores samples in a seeded shuffled order by default (block reading needs neighbours on
disk to be unrelated), and records in ``meta/position.npy`` where ImageFolder's sample ``i`` went.
Every public index of a dataset (``ds[i]``, ``targets``, ``samples``, samplers' output) is
ImageFolder's; readers, shards, read-ahead and blocks work in storage positions. ``IndexMap`` is the
one place that maps between the two. A dataset written before the file existed has no map: its
indices are the storage positions, and ``ds.indexing`` says ``"stored"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from packer.layout.index import Index

IMAGEFOLDER = "imagefolder"  # ds[i] is ImageFolder(source)[i] (among the packed samples)
STORED = "stored"  # ds[i] is the i-th stored sample (datasets written before the map existed)


class IndexMap:
    """Public sample index <-> storage position (``position[i]``: where ImageFolder's sample ``i`` is stored)."""

    def __init__(self, position: np.ndarray | None) -> None:
        self.kind = STORED if position is None else IMAGEFOLDER
        n = 0 if position is None else len(position)
        identity = position is None or bool(np.array_equal(position, np.arange(n)))
        # identity (--order source, or an older dataset): no arrays, no lookups
        self._stored = None if identity else np.asarray(position, dtype=np.int64)
        self._public: np.ndarray | None = None
        if self._stored is not None:
            self._public = np.empty(n, dtype=np.int64)
            self._public[self._stored] = np.arange(n, dtype=np.int64)

    @classmethod
    def of(cls, index: Index) -> IndexMap:
        return cls(index.position)

    @property
    def identity(self) -> bool:
        return self._stored is None

    def stored(self, i: int) -> int:
        """Storage position of public index ``i`` (already checked to be in range)."""
        return i if self._stored is None else int(self._stored[i])

    def stored_many(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        return idx if self._stored is None else self._stored[idx]

    def public(self, pos: int) -> int:
        """Public index of the sample stored at ``pos``."""
        return pos if self._public is None else int(self._public[pos])

    def public_many(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        return pos if self._public is None else self._public[pos]

    def in_public_order(self, per_stored: np.ndarray) -> np.ndarray:
        """A per-sample array kept in storage order, reordered by public index."""
        return per_stored if self._stored is None else per_stored[self._stored]

    def __repr__(self) -> str:
        return f"IndexMap({self.kind}{', identity' if self.identity else ''})"
