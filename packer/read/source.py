"""Where a dataset's samples come from: the ``SampleSource`` interface the batch pipeline reads through.

A source holds a dataset's metadata (manifest, per-sample index, fields) and serves its payloads: the shard
store (packer.read.store: local shards), the RAM cache (packer.read.cache: ``cache="ram"``/``"ram-decoded"``)
and, next, object storage. The pipeline (packer.read.pipeline) calls these methods only, so a new source is one
more implementation; its optimisations (read-ahead, page-cache skipping, copies straight into batch memory, bulk
decoding) live behind them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from packer.images.crop import Window
    from packer.layout.fields import FieldStore
    from packer.layout.index import Index
    from packer.layout.manifest import Manifest
    from packer.read.decoding import Decoding
    from packer.read.hints import Ahead
    from packer.read.readahead import Pending


class SampleSource(ABC):
    """A dataset's samples by storage position: reads started ahead, payloads, pixels."""

    manifest: Manifest
    index: Index  # per-sample metadata in storage order: labels, sizes, source paths
    fields: FieldStore
    payload: str  # what ``payloads`` returns: "encoded" (image files), "raw" (HWC uint8 pixels) or "none"

    @abstractmethod
    def start(self, positions: np.ndarray, ahead: Sequence[Ahead] = (), skip_cached: bool = True) -> Pending:
        """Start bringing these positions' payloads into memory and return at once. The handle's items are the
        positions in file order (sorted, stable): ``arrival_order`` says in which order they come in, ``wait(k)``
        when item ``k`` is in. ``ahead``: ranges the order being iterated reads whole (packer.read.hints);
        ``skip_cached``: nothing to do for payloads in memory already."""

    @abstractmethod
    def payloads(self, positions: Sequence[int] | np.ndarray, pending: Pending | None = None,
                 into: Callable[[int], np.ndarray] | None = None,
                 places: Sequence[np.ndarray | None] | None = None) -> list:
        """The payloads at these positions, in the order asked, checked against the index. ``pending``: what
        ``start`` returned for them (each part read once its bytes are in); None: read now. ``into``: copies in
        flat uint8 memory ``into(nbytes)`` gives, never views of a mapped file (what decode threads read: a file
        truncated meanwhile is an error, not a SIGBUS); ``places``: per sample, the flat batch slot its pixels go
        to, where raw pixels may be read straight into."""

    def decode(self, positions: Sequence[int] | np.ndarray, payloads: Sequence, decoding: Decoding,
               outs: Sequence[np.ndarray] | None = None, windows: Sequence[Window] | None = None) -> list[np.ndarray]:
        """Each payload as HWC uint8 pixels as ``decoding`` says (a fused crop through its ``windows`` one), into
        its ``outs`` slot where it has that size; JPEGs with slots are decoded in bulk."""
        return decoding.pixels_many(positions, payloads, self.payload, outs, windows)

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        """``indices``, a sampler's pass over storage positions ``stored`` from ``start``, as handed out: a source
        may fetch ahead along it (a URL's). Default: nothing to do."""
        return indices

    def close(self) -> None:
        """Release what the source holds open; reading again reopens."""
