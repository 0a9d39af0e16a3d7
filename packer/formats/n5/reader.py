"""N5 shards read back (layout: ``packer.formats.n5``): block files checked against the dataset's attributes and
the manifest before anything is allocated (an uncompressed block must be exactly header + elements long, a
compressed one is inflated with its size as the cap), uncompressed blocks mapped (the last ``mapped_files_limit()``
per process) and their samples handed out as read-only views, compressed ones inflated as far as the samples read
need (the last few kept partly inflated)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from packer.errors import DatasetError, PackerError
from packer.formats.base import (
    Destinations,
    ShardReader,
    Span,
    check_offsets,
    joined,
    pread_exactly,
    sample_memory,
    shard_layout,
    split_ranges,
)
from packer.formats.blob import shaped
from packer.formats.filemap import check_size, closed_on_error, map_array, open_checked
from packer.formats.n5.blocks import ATTRIBUTES, DTYPES, Array, Inflater, check_block_header, inflate, read_attributes
from packer.layout.manifest import Shard
from packer.lru import LRU
from packer.pagecache import all_of_each, mapped_files_limit
from packer.perprocess import PerProcess

_MAPPED_BLOCKS = mapped_files_limit()  # uncompressed block files a reader keeps mapped per process
_DECODED_BLOCKS = 4  # compressed blocks a reader keeps (partly) inflated per process


@dataclass
class _Open:
    images: Array
    blocks: list[str]  # path of each images block (files the manifest lists)
    block_sizes: list[int]  # their sizes, as the manifest records them
    offsets: np.ndarray | None  # N+1 (blob layouts)
    shapes: np.ndarray | None  # N x 3 (raw, mixed shapes)
    # block number -> (its descriptor, for the size checks; its elements, a view of its map)
    maps: LRU[int, tuple[int, np.ndarray]] = field(default_factory=lambda: LRU(_MAPPED_BLOCKS, drop=_close_block))
    decoded: LRU[int, Inflater] = field(default_factory=lambda: LRU(_DECODED_BLOCKS))  # block number -> inflater
    lock: threading.Lock = field(default_factory=threading.Lock)  # over maps and decoded


def _close_block(entry: tuple[int, np.ndarray]) -> None:
    os.close(entry[0])  # its map goes with its last view


class Reader(ShardReader):
    """Reads one shard container; attributes and small arrays are read and checked on first use in each process."""

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        self.directory = Path(directory)
        self.files = [f.name for f in shard.files]
        self.sizes = {f.name: f.num_bytes for f in shard.files}
        self.root_name = self.files[0].removesuffix("/" + ATTRIBUTES)
        if "/" in self.root_name or self.files[0] != f"{self.root_name}/{ATTRIBUTES}":
            raise DatasetError(f"{self.directory / self.files[0]}: an n5 shard's first file is <shard>.n5/{ATTRIBUTES}")
        self.num_samples = shard.num_samples
        self.payload = payload
        self.access = access
        self.facts = shard.facts
        self.fixed_shape = shard_layout(shard.facts, self.directory / self.files[0])
        self._h: PerProcess[_Open] = PerProcess()

    def _path(self, rel: str) -> Path:
        """The path of a file of this shard; only files the manifest lists (it checked they stay inside)."""
        if f"{self.root_name}/{rel}" not in self.sizes:
            raise DatasetError(f"{self.directory / self.root_name / rel}: needed, but the manifest does not list it")
        return self.directory / self.root_name / rel

    def _where(self, rel: str) -> Path:
        return self.directory / self.root_name / rel

    def _dataset(self, name: str) -> tuple[Array, list[str]]:
        path = self._path(f"{name}/{ATTRIBUTES}")
        arr = Array.from_attributes(read_attributes(path), path)
        if arr.num_blocks >= len(self.files):
            raise DatasetError(f"{path}: {arr.num_blocks} blocks, the manifest lists {len(self.files)} files")
        return arr, [f"{name}/{ATTRIBUTES}"] + [f"{name}/{arr.block_name(j)}" for j in range(arr.num_blocks)]

    def _small(self, arr: Array, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A one-block int64 dataset of exactly ``shape``, read whole."""
        if arr.shape != shape or arr.dtype != "int64" or arr.num_blocks > 1:
            raise DatasetError(f"{self._where(name)}: {arr.shape} {arr.dtype} in {arr.num_blocks} blocks, "
                               f"expected {shape} int64")
        if not arr.num_blocks:
            return np.zeros(shape, dtype=np.int64)
        return np.frombuffer(self._block(arr, 0, name), dtype=">i8").astype(np.int64).reshape(shape)

    def _read_block(self, arr: Array, j: int, name: str) -> tuple[memoryview, int, Path]:
        """Block ``j``'s file read whole: (its data after the header, the size the checked header gives, path)."""
        path = self._path(f"{name}/{arr.block_name(j)}")
        try:
            with open(path, "rb") as fh:
                data = fh.read(self.sizes[f"{self.root_name}/{name}/{arr.block_name(j)}"] + 1)
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read N5 block ({exc.strerror or exc})") from exc
        count = check_block_header(data, arr, j, path)
        return memoryview(data)[arr.header_bytes():], count * DTYPES[arr.dtype].itemsize, path

    def _block(self, arr: Array, j: int, name: str) -> bytes:
        """Block ``j`` of a dataset, its needed rows (header checked, inflated no further than its size)."""
        body, size, path = self._read_block(arr, j, name)
        need = arr.block_rows(j) * arr.row_bytes
        if arr.compression == "gzip":
            return inflate(arr, bytes(body), size, path)[:need]
        if len(body) != size:
            raise DatasetError(f"{path}: N5 block holds {len(body)} bytes of data, its header says {size}")
        return bytes(body[:need])

    def _inflater(self, arr: Array, j: int) -> Inflater:
        body, size, path = self._read_block(arr, j, "images")
        return Inflater(arr, bytes(body), size, path)

    def _open(self) -> _Open:
        n, shape = self.num_samples, self.fixed_shape
        root = read_attributes(self._path(ATTRIBUTES))
        if not str(root.get("n5", "")).startswith("2."):
            raise DatasetError(f"{self._path(ATTRIBUTES)}: not an N5 2.x container (n5: {root.get('n5')!r:.40})")
        images, names = self._dataset("images")
        gzip = "gzip" if images.compression == "gzip" else None
        if images.dtype != "uint8" or gzip != self.facts.get("compression") or images.rows != self.facts.get("rows"):
            raise DatasetError(f"{self._where('images')}: {images} disagrees with the manifest ({self.facts})")
        offsets = shapes = None
        if shape is not None:
            if images.shape != (n, *shape):
                raise DatasetError(f"{self._where('images')}: shape {images.shape}, the manifest says {(n, *shape)}")
        else:
            if len(images.shape) != 1:
                raise DatasetError(f"{self._where('images')}: shape {images.shape}, expected a 1-D blob")
            arr, more = self._dataset("offsets")
            names += more
            offsets = self._small(arr, "offsets", (n + 1,))
            check_offsets(offsets, n, images.shape[0], self._where("offsets"))
            if self.payload == "raw":
                arr, more = self._dataset("shapes")
                names += more
                shapes = self._small(arr, "shapes", (n, 3))
                if np.any(shapes < 0) or np.any(shapes[:, 2] != 3) or not np.array_equal(
                        shapes.prod(axis=1), np.diff(offsets)):
                    raise DatasetError(f"{self._where('shapes')}: shapes do not match the offsets")
        arr, more = self._dataset("labels")
        if arr.shape != (n,) or arr.dtype != "int64":
            raise DatasetError(f"{self._where('labels')}: shape {arr.shape} {arr.dtype}, expected ({n},) int64")
        names += more
        # Only files the manifest lists are ever opened: the attributes must name exactly those.
        if [f"{self.root_name}/{x}" for x in [ATTRIBUTES, *names]] != self.files:
            raise DatasetError(f"{self.directory / self.root_name}: the N5 attributes describe other files "
                               "than the manifest lists")
        rels = [f"images/{images.block_name(j)}" for j in range(images.num_blocks)]
        return _Open(images, [str(self._path(r)) for r in rels], [self.sizes[f"{self.root_name}/{r}"] for r in rels],
                     offsets, shapes)

    def __len__(self) -> int:
        return self.num_samples

    # ------------------------------------------------------------ the images' bytes

    def _mapped(self, h: _Open, j: int) -> tuple[int, np.ndarray]:
        """Uncompressed block ``j``: (its descriptor, valid until the block leaves the LRU; its elements, a view of its
        mapped file), the header checked when mapped and the size (the manifest's, header + elements) with every
        read. Call with ``h.lock`` held.

        The LRU holds each block's descriptor, for that size check; the maps hold none (``filemap``), so samples
        a user keeps cost no descriptor once their block has left the LRU."""
        path = h.blocks[j]
        entry = h.maps.get(j)
        if entry is None:
            arr = h.images
            with closed_on_error(open_checked(path, what="N5 block")) as fd:
                hb = arr.header_bytes()
                count = check_block_header(os.pread(fd, hb, 0), arr, j, path)
                size = os.fstat(fd).st_size
                if size != hb + count:
                    raise DatasetError(f"{path}: N5 block of {size - hb} bytes, its header says {count}")
                check_size(fd, h.block_sizes[j], path)
                entry = (fd, map_array(path, fd, self.access)[hb:])
            return h.maps.put(j, entry)
        try:
            check_size(entry[0], h.block_sizes[j], path)
        except BaseException:
            h.maps.pop(j)
            os.close(entry[0])  # out of the LRU: a changed block is mapped afresh, or refused, next time
            raise
        return entry

    def _range(self, h: _Open, j: int, a: int, b: int, used: dict) -> np.ndarray | bytes:
        """Bytes [a, b) of block ``j``'s elements: a view of the map, or inflated. Call with ``h.lock`` held;
        ``used``: the blocks this call has already found (one LRU step and one size check per block and call)."""
        block = used.get(j)
        if block is None:
            if h.images.compression == "gzip":
                block = h.decoded.get(j)
                if block is None:
                    block = h.decoded.put(j, self._inflater(h.images, j))
            else:
                block = self._mapped(h, j)[1]
            used[j] = block
        if isinstance(block, Inflater):
            return bytes(block.upto(b)[a:b])
        return block[a:b]

    def _bytes(self, h: _Open, a: int, b: int, used: dict) -> np.ndarray:
        """Bytes [a, b) of the images dataset, flat in C order, from the blocks they lie in (joined if several)."""
        if a == b:
            return np.zeros(0, np.uint8)
        step = h.images.rows * h.images.row_bytes
        if a // step == (b - 1) // step:  # one block: a view of it (most samples)
            part = self._range(h, a // step, a % step, b - a // step * step, used)
            return part if isinstance(part, np.ndarray) else np.frombuffer(part, dtype=np.uint8)
        parts = [np.frombuffer(self._range(h, j, max(a, j * step) - j * step, min(b, (j + 1) * step) - j * step,
                                           used), dtype=np.uint8) for j in range(a // step, -(-b // step))]
        return joined(parts)

    def _span(self, h: _Open, pos: int) -> tuple[int, int]:
        if h.offsets is None:
            size = h.images.row_bytes
            return pos * size, (pos + 1) * size
        return int(h.offsets[pos]), int(h.offsets[pos + 1])

    @staticmethod
    def _bounds(h: _Open, positions: Sequence[int]) -> tuple[list[int], list[int]]:
        """``_span`` of many positions at once: their first bytes and their ends in the images dataset."""
        pos = np.asarray(positions, dtype=np.int64)
        if h.offsets is None:
            size = h.images.row_bytes
            return (pos * size).tolist(), ((pos + 1) * size).tolist()
        return h.offsets[pos].tolist(), h.offsets[pos + 1].tolist()

    def _sample(self, h: _Open, pos: int, used: dict) -> np.ndarray | memoryview:
        view = self._bytes(h, *self._span(h, pos), used)
        if h.offsets is None:
            return view.reshape(cast(tuple, self.fixed_shape))
        return view.data if h.shapes is None else view.reshape(h.shapes[pos])

    def read(self, pos: int) -> np.ndarray | memoryview:
        """Read-only: (H, W, 3) pixels for raw, a memoryview of the file's bytes for encoded."""
        return self.read_many([pos])[0]

    def read_many(self, positions: Sequence[int]) -> list:
        """Views of the mapped blocks (uncompressed), bytes inflated once per block and kept (gzip)."""
        h = self._h.get(self._open)
        used: dict = {}  # block number -> its map or inflater, for this call
        with h.lock:  # readers share one LRU (and inflaters) per process, threads included
            if h.images.compression == "gzip" or h.offsets is None or h.shapes is not None:
                return [self._sample(h, p, used) for p in positions]
            return self._encoded_views(h, positions, used)

    def _encoded_views(self, h: _Open, positions: Sequence[int], used: dict) -> list:
        """``read_many`` of encoded samples in uncompressed blocks: bounds looked up for the batch at once, each
        sample a slice of its block's memoryview (docs/results.md); one across blocks is
        joined by ``_sample``. Call with ``h.lock`` held."""
        step = h.images.rows * h.images.row_bytes
        starts, ends = self._bounds(h, positions)
        views: dict[int, memoryview] = {}
        out: list = []
        for p, a, b in zip(positions, starts, ends, strict=True):
            j = a // step
            if a == b or (b - 1) // step != j:
                out.append(self._sample(h, p, used))
                continue
            view = views.get(j)
            if view is None:
                block = used.get(j)
                if block is None:
                    block = used[j] = self._mapped(h, j)[1]
                view = views[j] = block.data
            out.append(view[a - j * step : b - j * step])
        return out

    def read_into(self, positions: Sequence[int], out: np.ndarray) -> None:
        """Fixed shape only: copy samples at ascending ``positions`` into ``out[0:len]``."""
        if self.fixed_shape is None:
            raise PackerError(f"{self.directory / self.root_name}: read_into needs a fixed-shape shard")
        for k, arr in enumerate(self.read_many(positions)):
            out[k] = arr

    def read_copies(self, positions: Sequence[int], buf: Destinations = None) -> list:
        """Uncompressed: each sample's pieces read from its block files with ``pread``, joined; gzip: ``read_many``
        (blocks are inflated from reads, never mapped) (``ShardReader.read_copies``)."""
        h = self._h.get(self._open)
        arr = h.images
        if arr.compression == "gzip":
            return self.read_many(positions)
        blocks, lo, hi, owners = split_ranges(*self._bounds(h, positions), arr.rows * arr.row_bytes)
        flats, views = sample_memory((hi - lo).tolist(), owners.tolist(), len(positions), buf, self.directory)
        hb, fd, current = arr.header_bytes(), -1, -1
        with h.lock:
            # block by block: a descriptor is used only before the next block's opening can close it (the LRU's)
            for k in np.argsort(blocks, kind="stable").tolist():
                j = int(blocks[k])
                if j != current:  # its descriptor, the file's size checked (once per call), as for read_many
                    fd, current = self._mapped(h, j)[0], j
                pread_exactly(fd, [views[k].data], hb + int(lo[k]), h.blocks[j], h.block_sizes[j])
        return shaped(flats, self.fixed_shape if h.offsets is None else None, h.shapes, positions)

    def file_spans(self, positions: Sequence[int]) -> list[list[Span]]:
        """Per position, the byte ranges of the block files it is read from (see packer.read.readahead)."""
        h = self._h.get(self._open)
        arr = h.images
        blocks, lo, hi, owners = split_ranges(*self._bounds(h, positions), arr.rows * arr.row_bytes)
        out: list[list[Span]] = [[] for _ in positions]
        if arr.compression == "gzip":  # inflated whole
            for k, j in zip(owners.tolist(), blocks.tolist(), strict=True):
                out[k].append((h.blocks[j], 0, h.block_sizes[j]))
            return out
        hb = arr.header_bytes()
        for k, j, a, b in zip(owners.tolist(), blocks.tolist(), (lo + hb).tolist(), (hi + hb).tolist(), strict=True):
            out[k].append((h.blocks[j], a, b))
        return out

    def cached(self, positions: Sequence[int]) -> np.ndarray:
        """Uncompressed: the batch's ranges in each block file asked about together (``SpanResidency.ranges``),
        without building ``file_spans``' lists (docs/results.md); compressed: the default."""
        h = self._h.get(self._open)
        arr = h.images
        if arr.compression == "gzip":
            return super().cached(positions)
        blocks, lo, hi, owners = split_ranges(*self._bounds(h, positions), arr.rows * arr.row_bytes)
        hb = arr.header_bytes()
        return all_of_each(self._span_residency().ranges(h.blocks, blocks, lo + hb, hi + hb), owners, len(positions))

    def close(self) -> None:
        def closer(h: _Open) -> None:
            with h.lock:
                h.maps.clear()  # closes each block's descriptor; each map goes with its last view

        self._h.close(closer)
        super().close()
