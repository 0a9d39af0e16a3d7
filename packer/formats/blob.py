"""A shard whose samples are one mapped array (memmap, pth, safetensors): rows of a fixed-shape ``(N, H, W, 3)``
array, or byte ranges of a flat one that ``offsets`` bound, ``shapes`` shaping raw pixels. ``BlobReader`` reads any
such shard; a format supplies only the opening (``Blob``)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import PackerError
from packer.formats.base import Destinations, ShardReader, Span, copy_runs, pread_ranges, sample_view, sample_views


@dataclass
class Blob:
    """One process's open shard: its samples' array and where that lies in its file."""

    data: np.ndarray  # read-only: [N,H,W,3] or the flat uint8 blob
    offsets: np.ndarray | None  # N+1 (blob layouts), in memory of its own: threads look them up
    shapes: np.ndarray | None  # N x 3 (raw, mixed shapes)
    path: Path  # the file ``data`` maps
    size: int  # its size, per the manifest
    fd: int  # kept open to see that it keeps its size (-1: an empty file, none opened)
    start: int | None  # where ``data`` begins in the file (None: not known; copies then come from the map)

    def ranges(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The file's byte ranges [starts, ends) of the samples at ``positions`` (``start`` known)."""
        pos, at = np.asarray(positions, dtype=np.int64), int(self.start or 0)
        if self.offsets is None:
            size = self.data[0].nbytes if len(self.data) else 0
            return at + pos * size, at + (pos + 1) * size
        return at + self.offsets[pos], at + self.offsets[pos + 1]


def shaped(flats: Sequence[np.ndarray], shape: tuple[int, ...] | None, shapes: np.ndarray | None,
           positions: Sequence[int]) -> list[Any]:
    """Samples' flat bytes as readers hand them out: (H, W, 3) pixels of the fixed ``shape``, pixels of their own
    ``shapes`` (raw, mixed), else memoryviews of encoded bytes."""
    if shape is not None:
        return [flat.reshape(shape) for flat in flats]
    if shapes is None:
        return [flat.data for flat in flats]
    return [flat.reshape(s) for flat, s in zip(flats, shapes[np.asarray(positions, dtype=np.int64)].tolist(),
                                               strict=True)]


class BlobReader(ShardReader):
    """Reads a shard of one mapped array: zero-copy read-only views, batches copied by runs, ``read_copies`` by
    ``pread`` (or a guarded copy) from where the array lies in its file."""

    @abstractmethod
    def _blob(self) -> Blob:
        """The shard's blob, opened on first use in this process, its files seen to have kept their size (a page
        past the end of a file truncated in place would kill the process with SIGBUS)."""

    def read(self, pos: int) -> np.ndarray | memoryview:
        """Zero-copy, read-only: (H, W, 3) pixels for raw, a memoryview of the bytes for encoded."""
        b = self._blob()
        return sample_view(b.data, b.offsets, b.shapes, pos)

    def read_many(self, positions: Sequence[int]) -> list:
        b = self._blob()  # one size check for the batch
        return sample_views(b.data, b.offsets, b.shapes, positions)

    def read_into(self, positions: Sequence[int], out: np.ndarray) -> None:
        """Fixed shape only: copy samples at ascending ``positions`` into ``out[0:len]``, one copy per run."""
        b = self._blob()
        if self.fixed_shape is None:
            raise PackerError(f"{b.path}: read_into needs a fixed-shape shard")
        copy_runs(b.data, list(positions), out)

    def read_copies(self, positions: Sequence[int], buf: Destinations = None) -> list:
        """The samples' bytes read from the file, shaped as ``read_many`` gives them (``ShardReader.read_copies``);
        where the array's place in the file is not known (a file not as packer writes it), copies of the views."""
        b = self._blob()
        if b.start is None or b.fd < 0:
            views = self.read_many(positions)
            return [np.array(v) if isinstance(v, np.ndarray) else memoryview(bytes(v)) for v in views]
        starts, ends = b.ranges(positions)
        flats = pread_ranges(b.fd, starts.tolist(), ends.tolist(), buf, b.path, b.size,
                             mapped=(b.data.reshape(-1), b.start))
        return shaped(flats, b.data.shape[1:] if b.offsets is None else None, b.shapes, positions)

    def file_spans(self, positions: Sequence[int]) -> list[list[Span]]:
        """Per position, the byte range of the file it is read from (see packer.read.readahead); none where the
        array's place in the file is not known."""
        b = self._blob()
        if b.start is None:
            return [[] for _ in positions]
        path = str(b.path)
        starts, ends = b.ranges(positions)
        return [[(path, a, e)] for a, e in zip(starts.tolist(), ends.tolist(), strict=True)]
