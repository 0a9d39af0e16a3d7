"""What a sample index means: the packed samples in the source's order, and each one's index in the source.

Conversion stores samples in a seeded shuffled order by default (block reading needs neighbours on
disk to be unrelated), and records in ``meta/position.npy`` where the dataset's sample ``i`` went: the
dataset's samples are the packed ones in the source's order (ImageFolder's, for a folder), dense, so
``len``, DataLoader, samplers and shuffling work unchanged. ``meta/source_index.npy`` records each packed
sample's index in the source (``ImageFolder(source)``'s, the row of a list file, the member of an archive,
the source's own numbering for a re-packed dataset). When every source record was packed the two are the
same: ``ds[i]`` is ``ImageFolder(source)[i]`` (``indexing == "imagefolder"``). When some were not (damaged
files, ``--classes``, ``--split``), ``ds[i]`` is ``ImageFolder(source)[ds.imagefolder_index(i)]`` and
``ds.from_imagefolder(j)`` maps back (``indexing == "subset"``; opening says so once, as a warning).
Every public index of a dataset (``ds[i]``, ``targets``, ``samples``, samplers' output) is the dataset's;
readers, shards, read-ahead and blocks work in storage positions. ``IndexMap`` is the one place that maps
between the three. A dataset written before ``position.npy`` existed has no map: its indices are the
storage positions, and ``ds.indexing`` says ``"stored"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from packer.errors import PackerError
from packer.layout.index import Index
from packer.layout.manifest import Manifest
from packer.perprocess import PicklesAs

IMAGEFOLDER = "imagefolder"  # ds[i] is ImageFolder(source)[i]: every source record was packed
SUBSET = "subset"  # ds[i] is ImageFolder(source)[ds.imagefolder_index(i)]: some were not
STORED = "stored"  # ds[i] is the i-th stored sample (datasets written before the map existed)


def source_item(source_type: str, j: str) -> str:
    """How a source names its record ``j``: ``ImageFolder(source)[j]`` for a folder, else ``source record j``."""
    return f"ImageFolder(source)[{j}]" if source_type in ("", "folder") else f"source record {j}"


def why_left_out(manifest: Manifest) -> str:
    """Why records of the source are not in the dataset, in a few words: errors, ``--classes``, ``--split``."""
    chosen = manifest.source_options
    parts = [f"{manifest.num_errors:,} not packed, see errors.json"] * bool(manifest.num_errors)
    parts += [f"left out by {flag}" for flag, key in (("--classes", "classes"), ("--split", "split"))
              if chosen.get(key) is not None]
    return "; ".join(parts) or "see errors.json"


class IndexMap(PicklesAs):
    """Dataset index <-> storage position (``position[i]``: where sample ``i`` is stored), and dataset index <->
    source index (``source[i]``: sample ``i``'s number in the source, increasing; ``records``: how many the source
    numbers). ``source`` None with ``records`` None: the source numbers are not known (an older dataset with
    files left out); ``source`` None with ``records`` given: the identity."""

    def __init__(self, position: np.ndarray | None, source: np.ndarray | None = None,
                 records: int | None = None) -> None:
        n = 0 if position is None else len(position)
        identity = position is None or bool(np.array_equal(position, np.arange(n)))
        # identity (--order source, or an older dataset): no arrays, no lookups
        self._stored = None if identity else np.asarray(position, dtype=np.int64)
        self._public: np.ndarray | None = None
        if self._stored is not None:
            self._public = np.empty(n, dtype=np.int64)
            self._public[self._stored] = np.arange(n, dtype=np.int64)
        if source is not None and records == len(source) and bool(np.array_equal(source, np.arange(len(source)))):
            source = None  # every record packed: the identity, no lookups
        self._source = None if source is None else np.asarray(source, dtype=np.int64)
        self.records = records
        if position is None:
            self.kind = STORED
        else:
            self.kind = IMAGEFOLDER if self._source is None and records is not None else SUBSET

    @classmethod
    def of(cls, index: Index, manifest: Manifest) -> IndexMap:
        """The map ``index`` and ``manifest`` record. A dataset written before ``source_index.npy``: the identity
        when nothing was left out (no errors, no ``--classes``/``--split``), else source indices unknown."""
        n = len(index)
        if index.source_index is not None:
            in_order = index.source_index if index.position is None else index.source_index[index.position]
            made = cls(index.position, in_order, manifest.source_records)
        else:
            chosen = any(k in manifest.source_options for k in ("classes", "split"))
            made = cls(index.position, None, n if manifest.num_errors == 0 and not chosen else None)
        made.pickle_as((IndexMap.of, (index, manifest)))  # made again where unpickled: no per-sample array in it
        return made

    @property
    def identity(self) -> bool:
        return self._stored is None

    @property
    def known(self) -> bool:
        """Whether each sample's index in the source is known (False: an older dataset with files left out)."""
        return self.records is not None

    def stored(self, i: int) -> int:
        """Storage position of dataset index ``i`` (already checked to be in range)."""
        return i if self._stored is None else int(self._stored[i])

    def stored_many(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        return idx if self._stored is None else self._stored[idx]

    def public(self, pos: int) -> int:
        """Dataset index of the sample stored at ``pos``."""
        return pos if self._public is None else int(self._public[pos])

    def public_many(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        return pos if self._public is None else self._public[pos]

    def in_public_order(self, per_stored: np.ndarray) -> np.ndarray:
        """A per-sample array kept in storage order, reordered by dataset index."""
        return per_stored if self._stored is None else per_stored[self._stored]

    def source_many(self, indices: np.ndarray) -> np.ndarray:
        """Source index of each dataset index (already checked to be in range)."""
        self._require_known()
        return indices if self._source is None else self._source[indices]

    def from_source_many(self, numbers: np.ndarray) -> np.ndarray:
        """Dataset index of each source index (checked against ``records`` by the caller), -1 where not packed."""
        self._require_known()
        if self._source is None:
            return numbers
        at = np.searchsorted(self._source, numbers)
        found = at < len(self._source)
        found[found] = self._source[at[found]] == numbers[found]
        return np.where(found, at, -1)

    def num_records(self) -> int:
        """How many records the source numbers; a PackerError where the dataset does not record it."""
        self._require_known()
        assert self.records is not None
        return self.records

    def _require_known(self) -> None:
        if not self.known:
            raise PackerError("this dataset does not record its samples' indices in the source (converted by an "
                              "older packer, with files left out): convert it again to map them")

    def __repr__(self) -> str:
        return f"IndexMap({self.kind}{', identity' if self.identity else ''})"
