"""numpy memmap: plain files that ``np.load(..., mmap_mode="r")`` maps, readable without packer.

| file (per shard)          | dtype | shape     | holds                                                 |
|---------------------------|-------|-----------|-------------------------------------------------------|
| shard-00000.pixels.npy    | u1    | [N,H,W,3] | raw, one shape (``--resize HxW``): RGB pixels, a      |
|                           |       |           | standard ``.npy``: ``np.load(p, mmap_mode="r")[i]``    |
| shard-00000.pixels.bin    | u1    | [B]       | raw, mixed shapes: HWC RGB pixels back to back        |
| shard-00000.files.bin     | u1    | [B]       | encoded: the source files' bytes back to back         |
| shard-00000.offsets.npy   | <i8   | [N+1]     | sample i is ``bin[offsets[i]:offsets[i+1]]``          |
| shard-00000.shapes.npy    | <i8   | [N,3]     | raw, mixed shapes: (h, w, 3) of each sample           |

The ``.bin`` files have no header (``np.fromfile``/``np.memmap`` read them). The fixed-shape ``.npy`` is written by
streaming rows after numpy's own header, not through a writable map (a full disk is an error, not a SIGBUS).
Readers map the files read-only in each process and return zero-copy read-only views. One shard by default: one
file costs nothing in lookups, and the fixed-shape dataset is then one ``(N, H, W, 3)`` array for anyone with numpy.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packer.errors import DatasetError, PackerError
from packer.formats.base import (
    BlobIndex,
    Format,
    PreparedSample,
    ShardWriter,
    check_offsets,
    fixed_shape,
    shard_layout,
)
from packer.formats.blob import Blob, BlobReader
from packer.formats.filemap import check_size, map_bytes, map_readonly, open_checked
from packer.layout.digest import StreamDigest
from packer.layout.manifest import Shard
from packer.layout.trust import npy_header
from packer.pagecache import PageCache
from packer.perprocess import PerProcess


def shard_stem(shard_id: int) -> str:
    return f"shard-{shard_id:05d}"


def _npy_header(shape: tuple[int, ...], dtype: str) -> bytes:
    """The ``.npy`` header numpy writes for an array of this shape and dtype."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": tuple(shape)})
    return buf.getvalue()


class Writer(ShardWriter):
    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> None:
        self.directory = directory
        stem = shard_stem(shard_id)
        self.shape = fixed_shape(payload, options)
        if self.shape is not None:
            self.names = [f"{stem}.pixels.npy"]
            self._header = _npy_header((num_samples, *self.shape), "|u1")
        elif payload == "raw":
            self.names = [f"{stem}.pixels.bin", f"{stem}.offsets.npy", f"{stem}.shapes.npy"]
        else:
            self.names = [f"{stem}.files.bin", f"{stem}.offsets.npy"]
        self.path = directory / self.names[0]
        self.payload = payload
        self.index = BlobIndex(self.path, num_samples, payload, self.shape)
        # OSError (disk full, I/O) propagates: the driver reports it and keeps finished shards for --resume.
        self._fh = open(self.path, "wb")
        self._digest = StreamDigest()  # the data file is written front to back: hashed as it goes
        self._digests: dict[str, str] = {}
        if self.shape is not None:
            try:
                self._write(self._header)
            except BaseException:
                self.abort()
                raise

    def _write(self, data: bytes | memoryview) -> None:
        self._fh.write(data)
        self._digest.update(data)

    def add(self, sample: PreparedSample) -> None:
        self.index.add(sample)
        data = sample.payload
        self._write(data if isinstance(data, bytes) else data.data)  # a C-contiguous uint8 array: no copy

    def close(self) -> tuple[list[str], dict]:
        n = self.index.count
        if self.shape is not None and n != self.index.planned:  # samples failed validation
            header = _npy_header((n, *self.shape), "|u1")
            if len(header) != len(self._header):
                raise PackerError(f"{self.path}: .npy header changed length ({len(self._header)} -> {len(header)})")
            self._fh.seek(0)
            self._fh.write(header)
            self._digest.cancel()  # rewritten: the journal reads the file back instead
        else:
            self._digests[self.names[0]] = self._digest.hexdigest()
        self._fh.close()
        if self.shape is None:
            np.save(self.directory / self.names[1], self.index.offsets[: n + 1])
            if self.payload == "raw":
                np.save(self.directory / self.names[2], self.index.shapes[:n])
        facts: dict = {"layout": "fixed", "shape": list(self.shape)} if self.shape else {"layout": "blob"}
        return list(self.names), facts

    def digests(self) -> dict[str, str]:
        return self._digests

    def abort(self) -> None:
        self._digest.cancel()
        try:
            self._fh.close()
        except OSError:
            pass  # flushing what is left fails again on a full disk: the files go anyway
        for name in self.names:
            (self.directory / name).unlink(missing_ok=True)


# ---------------------------------------------------------------- reading


Kept = list[tuple[int, int, Path]]  # (descriptor, the manifest's size, path) of each mapped file, for check_size


def load_npy(path: Path, dtype: str, access: str = "sequential", kept: Kept | None = None,
             expected: int | None = None) -> np.ndarray:
    """A read-only, memory-mapped ``.npy`` of exactly ``dtype`` (header parsed safely, no pickle), its file of the
    manifest's ``expected`` size where given. ``kept``: the mapped file is left open and added there (for the size
    checks before each read; the caller closes it); else closed."""
    shape, offset = npy_header(path, dtype)  # shared checks: dtype, C order, size against the file
    size = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    if size == 0:
        return np.zeros(shape, dtype=dtype)
    fd = open_checked(path, expected)
    if kept is not None:
        kept.append((fd, -1 if expected is None else expected, path))
    try:
        return np.ndarray(shape, dtype=dtype, buffer=map_readonly(path, fd, access), offset=offset)
    finally:
        if kept is None:
            os.close(fd)


@dataclass
class _Maps:
    blob: Blob
    kept: Kept  # the mapped files, kept open for the size checks


class Reader(BlobReader):
    """Reads one shard through read-only memory maps, opened lazily in each process.

    Before each read the mapped files' sizes are checked against the manifest (``filemap.check_size``):
    touching a page past the end of a file truncated in place would kill the process (SIGBUS).
    """

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        self.paths = [directory / f.name for f in shard.files]
        self.sizes = {directory / f.name: f.num_bytes for f in shard.files}
        self.num_samples = shard.num_samples
        self.payload = payload
        self.access = access
        self.fixed_shape = shard_layout(shard.facts, self.paths[0] if self.paths else directory)
        if len(self.paths) != (1 if self.fixed_shape else 2 + (payload == "raw")):
            raise DatasetError(f"{directory}: a memmap shard of this layout has other files than {self.paths}")
        self._maps: PerProcess[_Maps] = PerProcess()
        self._cache: PerProcess[PageCache] = PerProcess(inherited=PageCache.close)

    def _open(self) -> _Maps:
        kept: Kept = []
        try:
            return self._open_maps(kept)
        except BaseException:
            for fd, _size, _path in kept:
                os.close(fd)
            raise

    def _map(self, k: int, dtype: str, kept: Kept, access: str = "sequential") -> np.ndarray:
        return load_npy(self.paths[k], dtype, access, kept, self.sizes[self.paths[k]])

    def _open_maps(self, kept: Kept) -> _Maps:
        n = self.num_samples
        if self.fixed_shape is not None:
            data = self._map(0, "|u1", kept, self.access)
            if data.shape != (n, *self.fixed_shape):
                raise DatasetError(f"{self.paths[0]}: shape {data.shape}, manifest says {(n, *self.fixed_shape)}")
            size = self.sizes[self.paths[0]]
            return _Maps(Blob(data, None, None, self.paths[0], size, kept[0][0] if kept else -1, size - data.nbytes),
                         kept)
        # offsets and shapes in memory of our own (copies of their maps, read whole by the checks anyway): they are
        # looked up by read_copies and file_spans in threads that a file truncated meanwhile must not kill
        offsets = np.array(self._map(1, "<i8", kept))
        size = self.sizes[self.paths[0]]
        check_offsets(offsets, n, size, self.paths[1])
        data, data_fd = np.zeros(0, np.uint8), -1
        if size:
            data_fd = open_checked(self.paths[0], size)
            kept.append((data_fd, size, self.paths[0]))
            data = map_bytes(self.paths[0], data_fd, size, self.access)
        shapes = None
        if self.payload == "raw":
            shapes = np.array(self._map(2, "<i8", kept))
            if shapes.shape != (n, 3) or np.any(shapes[:, 2] != 3) or np.any(shapes < 0) or not np.array_equal(
                    shapes.prod(axis=1), np.diff(offsets)):
                raise DatasetError(f"{self.paths[2]}: shapes do not match the offsets")
        return _Maps(Blob(data, offsets, shapes, self.paths[0], size, data_fd, 0), kept)

    def _blob(self) -> Blob:
        m = self._maps.get(self._open)
        for fd, expected, name in m.kept:
            check_size(fd, expected, name)
        return m.blob

    def __len__(self) -> int:
        return self.num_samples

    def _page_cache(self) -> PageCache:
        return PageCache(self.paths[0])

    def cached(self, positions: list[int]) -> np.ndarray:
        """From the samples' byte ranges in the data file, one question to this process's ``PageCache`` of it."""
        return self._cache.get(self._page_cache).resident_each(*self._blob().ranges(positions))

    def close(self) -> None:
        self._cache.close(PageCache.close)
        self._maps.close(lambda m: [os.close(fd) for fd, _size, _path in m.kept])  # maps go with their last view


FORMAT = Format(
    name="memmap", dataset_class="MemmapDataset", payloads=frozenset({"encoded", "raw", "none"}),
    Writer=Writer, Reader=Reader,
    default_shard_bytes=None,
)
