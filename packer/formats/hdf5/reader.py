"""HDF5 shards read: h5py opens the file lazily in each process (its handles cross neither fork nor pickle) with
``locking=False`` (HDF5's file locks fail on many NFS mounts; a read-only reader needs none); uncompressed
``/images`` are read as views of the mapped file (``chunks.MappedChunks``), compressed chunks through h5py with a
small cache that keeps neighbours' shared chunks. (With h5py < 3.5 or HDF5 < 1.12.1, set
``HDF5_USE_FILE_LOCKING=FALSE`` in the environment instead.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import h5py
import numpy as np

from packer.errors import DatasetError, PackerError
from packer.formats.base import (
    Destinations,
    ShardReader,
    check_offsets,
    contiguous_runs,
    copy_runs,
    shard_layout,
)
from packer.formats.blob import shaped
from packer.formats.filemap import check_size
from packer.formats.hdf5 import writer
from packer.formats.hdf5.checks import stored_dataset
from packer.formats.hdf5.chunks import MappedChunks
from packer.images.decode import check_pixels, pixel_limit
from packer.layout.manifest import Shard
from packer.perprocess import PerProcess

_CACHE_COMPRESSED = 4 << 20  # h5py's chunk cache for compressed shards


@dataclass
class _Open:
    file: h5py.File
    images: h5py.Dataset
    offsets: np.ndarray | None  # in memory: N+1 int64
    shapes: np.ndarray | None
    fd: int  # HDF5's own descriptor of the file, for the size check with each read
    mapped: MappedChunks | None = None  # uncompressed: /images read as views of the mapped file


class Reader(ShardReader):
    """Reads one shard file; h5py opens it lazily in each process, read-only, without locking.

    The file's structure is checked when the reader is made (so ``open_dataset`` and ``packer
    verify`` refuse a crafted file) and again in each process that opens it: only the datasets
    the writer makes, stored the way it stores them (hard links, chunks and filters as written,
    no external links, external storage or virtual datasets: nothing is read from other files).

    ``access="random"`` turns the kernel's read-ahead off for the file (``POSIX_FADV_RANDOM`` on
    HDF5's own descriptor), as for the other formats: uniform random reads of a file larger than
    RAM only lose by it. Otherwise the kernel reads ahead as usual.
    """

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        self.path = directory / shard.files[0].name
        self.num_bytes = shard.files[0].num_bytes
        self.num_samples = shard.num_samples
        self.payload = payload
        self.fixed_shape = shard_layout(shard.facts, self.path)
        self.compression = shard.facts.get("compression")
        self.compressed = bool(self.compression)
        if self.compression not in writer.FILTERS or (self.compressed and payload != "raw"):
            raise DatasetError(f"{self.path}: manifest names compression {self.compression!r} for {payload} "
                               "payloads, which the writer never makes")
        self.access = access
        self._h: PerProcess[_Open] = PerProcess()
        f = self._open_file()
        try:
            self._parts(f)
        finally:
            f.close()

    def _open_file(self) -> h5py.File:
        # Uncompressed: no chunk cache, so HDF5 reads exactly the asked bytes into our array.
        cache = _CACHE_COMPRESSED if self.compressed else 0
        kw = {"rdcc_nbytes": cache, "rdcc_nslots": 1009, "rdcc_w0": 1.0}
        try:
            try:
                return h5py.File(self.path, "r", locking=False, **kw)
            except OSError as exc:
                if "locking flag" not in str(exc):
                    raise
                # This process already has the file open with other locking flags (the user's own
                # h5py.File): HDF5 shares that open file and insists the flags match, so use its.
                return h5py.File(self.path, "r", **kw)
        except (OSError, ValueError) as exc:
            raise DatasetError(f"{self.path}: cannot open HDF5 shard ({exc})") from exc

    def _parts(self, f: h5py.File) -> tuple[h5py.Dataset, h5py.Dataset | None, h5py.Dataset | None]:
        """(/images, /offsets, /shapes) after checking everything about them that bounds what a read allocates."""
        n = self.num_samples
        images = stored_dataset(f, "images", h5py.h5d.CHUNKED, self.path)
        if images.dtype != np.uint8:
            raise DatasetError(f"{self.path}: /images is {images.dtype}, expected uint8")
        if self.fixed_shape is not None:
            if images.shape != (n, *self.fixed_shape):
                raise DatasetError(f"{self.path}: /images is {images.shape}, manifest says {(n, *self.fixed_shape)}")
            check_pixels(*self.fixed_shape[:2], what=f"{self.path}: images of")
            chunk = (1, *self.fixed_shape)
        elif images.ndim != 1:
            raise DatasetError(f"{self.path}: /images is {images.shape}, expected a 1-D blob")
        else:
            chunk = (writer.BLOB_CHUNK_COMPRESSED if self.compressed else writer.BLOB_CHUNK,)  # what it makes
        plist = images.id.get_create_plist()
        filters = [plist.get_filter(k)[0] for k in range(plist.get_nfilters())]
        made = writer.FILTERS[self.compression]
        if images.chunks != chunk or filters != made:
            raise DatasetError(f"{self.path}: /images has chunks {images.chunks} and filters {filters}; the writer "
                               f"makes {chunk} and {made} ({self.compression or 'uncompressed'})")
        size = int(np.prod(images.shape, dtype=object))
        if not self.compressed and size > self.num_bytes:
            # Chunks never written read as zeros: a huge dataset could take no room in the file.
            raise DatasetError(f"{self.path}: /images of shape {images.shape} needs {size} bytes, the file has "
                               f"{self.num_bytes}")
        if self.fixed_shape is not None:
            return images, None, None
        offsets = stored_dataset(f, "offsets", h5py.h5d.CONTIGUOUS, self.path)
        shapes = stored_dataset(f, "shapes", h5py.h5d.CONTIGUOUS, self.path) if self.payload == "raw" else None
        if offsets.shape != (n + 1,) or (shapes is not None and shapes.shape != (n, 3)):
            raise DatasetError(f"{self.path}: /offsets or /shapes do not have one entry per sample ({n})")
        if offsets.dtype != np.dtype("<i8") or (shapes is not None and shapes.dtype != np.dtype("<i8")):
            raise DatasetError(f"{self.path}: /offsets or /shapes are not little-endian int64")
        return images, offsets, shapes

    def _open(self) -> _Open:
        n = self.num_samples
        f = self._open_file()
        try:
            fd = f.id.get_vfd_handle()
            if self.access == "random" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            images, offsets_ds, shapes_ds = self._parts(f)
            h = _Open(f, images, None, None, fd)
            if not self.compressed:
                h.mapped = MappedChunks(self.path, images, fd, self.num_bytes, self.access)
            if offsets_ds is None:
                return h
            offsets = np.asarray(offsets_ds[()], dtype=np.int64)
            check_offsets(offsets, n, images.shape[0], f"{self.path}:/offsets")
            shapes = None
            if shapes_ds is not None:
                shapes = np.asarray(shapes_ds[()], dtype=np.int64)
                if shapes.shape != (n, 3) or np.any(shapes < 0) or not np.array_equal(
                        shapes.prod(axis=1), np.diff(offsets)):
                    raise DatasetError(f"{self.path}: /shapes do not match /offsets")
                limit = pixel_limit()
                if limit is not None and np.any(shapes[:, 0] * shapes[:, 1] > limit):
                    raise DatasetError(f"{self.path}: /shapes hold images above the pixel limit of {limit}")
            h.offsets, h.shapes = offsets, shapes
            return h
        except BaseException:
            f.close()
            raise

    def _get(self) -> _Open:
        """The open file; mapped ones seen to have kept their size (a page past a new end kills with SIGBUS)."""
        h = self._h.get(self._open)
        if h.mapped is not None:
            check_size(h.fd, self.num_bytes, self.path)
        return h

    def _shaped(self, h: _Open, flats: list[np.ndarray], positions: Sequence[int]) -> list:
        """Samples' flat bytes as handed out: (H, W, 3) pixels for raw, memoryviews for encoded."""
        return shaped(flats, self.fixed_shape if h.offsets is None else None, h.shapes, positions)

    def _checked(self, h: _Open, read: Callable[[], Any]) -> Any:
        """``read()``, once the file is seen to have kept its size after it: past its end HDF5 reads
        zeros or fails, and a truncated file must be named as such, not returned as damaged pixels."""
        try:
            return read()
        finally:
            check_size(h.fd, self.num_bytes, self.path)  # raised here, it replaces what read() gave

    def __len__(self) -> int:
        return self.num_samples

    def _blob(self, h: _Open, start: int, stop: int) -> np.ndarray:
        # Plain slices take h5py's fast path: several times quicker than read_direct or fancy indexing.
        offsets = cast(np.ndarray, h.offsets)  # blob layout: offsets are in memory
        return h.images[int(offsets[start]) : int(offsets[stop])]

    def _split(self, h: _Open, buf: np.ndarray, start: int, stop: int) -> list:
        bounds = (cast(np.ndarray, h.offsets)[start : stop + 1] - cast(np.ndarray, h.offsets)[start]).tolist()
        return self._shaped(h, [buf[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)], range(start, stop))

    def read(self, pos: int) -> np.ndarray | memoryview:
        """(H, W, 3) pixels for raw, a memoryview of the file's bytes for encoded: read-only views of the mapped
        file when uncompressed, fresh arrays from h5py when compressed."""
        h = self._get()
        if h.mapped is not None:
            m, pos = h.mapped, int(pos)  # a numpy int32 times a chunk's bytes would overflow
            a, b = (pos * m.chunk_bytes, (pos + 1) * m.chunk_bytes) if h.offsets is None else h.offsets[[pos, pos + 1]]
            return self._shaped(h, [m.flat(int(a), int(b))], [pos])[0]
        if h.offsets is None:
            return self._checked(h, lambda: h.images[pos])
        return self._checked(h, lambda: self._split(h, self._blob(h, pos, pos + 1), pos, pos + 1)[0])

    def read_many(self, positions: list[int]) -> list:
        """Views of the map (uncompressed; one size check for the batch), else one HDF5 read per run of neighbours."""
        h = self._get()
        if h.mapped is None:
            return self._checked(h, lambda: self._read_runs(h, positions))
        return self._shaped(h, h.mapped.samples(positions, h.offsets), positions)

    def _read_runs(self, h: _Open, positions: list[int]) -> list:
        out: list = []
        for start, stop in contiguous_runs(list(positions)):
            if h.offsets is None:
                out.extend(h.images[start:stop])
            else:
                out.extend(self._split(h, self._blob(h, start, stop), start, stop))
        return out

    def read_copies(self, positions: list[int], buf: Destinations = None) -> list:
        """Uncompressed: ``MappedChunks.copies`` (``pread``, never the map); compressed: h5py's reads, which never map
        (``ShardReader.read_copies``)."""
        h = self._get()
        return self.read_many(positions) if h.mapped is None else \
            self._shaped(h, h.mapped.copies(h.fd, positions, h.offsets, buf), positions)

    def file_spans(self, positions: list[int]) -> list[list[tuple[str, int, int]]]:
        """Per position, the byte ranges of the file its chunks occupy (see packer.read.readahead)."""
        h = self._get()
        if h.mapped is not None:  # uncompressed: just the sample's bytes in each chunk
            return h.mapped.file_spans(positions, h.offsets)
        path, chunk = str(self.path), cast(tuple, h.images.chunks)[0]  # compressed chunks are inflated whole
        out = []
        for p in positions:
            coords = [(p, 0, 0, 0)] if h.offsets is None else [
                (c,) for c in range(int(h.offsets[p]) // chunk * chunk, int(h.offsets[p + 1]), chunk)]
            out.append([(path, i.byte_offset, i.byte_offset + i.size)
                        for i in map(h.images.id.get_chunk_info_by_coord, coords)])
        return out

    def cached(self, positions: list[int]) -> np.ndarray:
        """Uncompressed: from the mapped chunks' ranges at once (``MappedChunks.cached``); else as the default."""
        h = self._get()
        return super().cached(positions) if h.mapped is None else h.mapped.cached(positions, h.offsets)

    def read_into(self, positions: list[int], out: np.ndarray) -> None:
        """Fixed shape only: read samples at ascending ``positions`` into ``out[0:len]``."""
        if self.fixed_shape is None:
            raise PackerError(f"{self.path}: read_into needs a fixed-shape shard")
        h = self._get()
        if h.mapped is not None:
            for k, sample in enumerate(self._shaped(h, h.mapped.samples(positions, None), positions)):
                out[k] = sample
            return
        # A slice read per run beats read_direct per run and h5py's fancy indexing by far (docs/results.md).
        self._checked(h, lambda: copy_runs(h.images, positions, out))

    def close(self) -> None:
        self._h.close(lambda h: (h.file.close(), h.mapped and h.mapped.close()))
        super().close()

