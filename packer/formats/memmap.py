"""numpy memmap: plain files that ``np.load(..., mmap_mode="r")`` maps, readable without packer.

| file (per shard)          | dtype | shape     | holds                                                 |
|---------------------------|-------|-----------|-------------------------------------------------------|
| shard-00000.pixels.npy    | u1    | [N,H,W,3] | raw, one shape (``--resize HxW``): RGB pixels, a      |
|                           |       |           | standard ``.npy``: ``np.load(p, mmap_mode="r")[i]``    |
| shard-00000.pixels.bin    | u1    | [B]       | raw, mixed shapes: HWC RGB pixels back to back        |
| shard-00000.files.bin     | u1    | [B]       | encoded: the source files' bytes back to back         |
| shard-00000.offsets.npy   | <i8   | [N+1]     | sample i is ``bin[offsets[i]:offsets[i+1]]``          |
| shard-00000.shapes.npy    | <i8   | [N,3]     | raw, mixed shapes: (h, w, 3) of each sample           |

The ``.bin`` files have no header at all (``np.fromfile``/``np.memmap`` read them); the encoded
one is the smallest possible packing of the original files. The fixed-shape ``.npy`` is
written by streaming rows after a header that numpy itself writes (same bytes as
``np.lib.format.open_memmap`` would produce), not through a writable memory map: a full disk
then raises an error instead of killing the process with SIGBUS. The header is rewritten at
close when validation dropped samples (numpy pads it so the count can change in place).

Readers map the files read-only, lazily in each process, and return zero-copy read-only
views: an ``(H, W, 3)`` array for raw, a ``memoryview`` for encoded. The only copy is made
when handing pixels to torch (``image="tensor"``, which needs writable memory) or into a
batch (``read_into``). ``access="random"`` advises the kernel not to read ahead;
``file_spans`` tells packer.read.readahead which bytes a batch needs.

One shard by default (``DEFAULT_SHARD_BYTES = None``): the formats index by offset, so a
single file costs nothing in lookups, one mapping per worker suffices, and the fixed-shape
dataset is then exactly one ``(N, H, W, 3)`` array for anyone with numpy. Use
``--shard-size`` for filesystems or transfer tools that dislike very large files.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from packer.errors import DatasetError, PackerError
from packer.formats.base import (
    BlobIndex,
    Destinations,
    Format,
    PreparedSample,
    ShardReader,
    ShardWriter,
    check_offsets,
    check_size,
    copy_runs,
    fixed_shape,
    map_readonly,
    pread_ranges,
    sample_view,
    sample_views,
    shard_layout,
)
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


def _open_file(path: Path, files: list) -> BinaryIO:
    """``path`` opened for reading and added to ``files`` (which the caller closes)."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot open ({exc.strerror or exc})") from exc
    files.append(fh)
    return fh


def load_npy(path: Path, dtype: str, access: str = "sequential", files: list | None = None) -> np.ndarray:
    """A read-only, memory-mapped ``.npy`` of exactly ``dtype`` (header parsed safely, no pickle).

    ``files``: the mapped file is left open and appended there (for size checks); else closed.
    """
    shape, offset = npy_header(path, dtype)  # shared checks: dtype, C order, size against the file
    size = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    if size == 0:
        return np.zeros(shape, dtype=dtype)
    opened: list = [] if files is None else files
    fh = _open_file(path, opened)
    try:
        return np.ndarray(shape, dtype=dtype, buffer=map_readonly(path, fh.fileno(), access), offset=offset)
    finally:
        if files is None:
            fh.close()


@dataclass
class _Maps:
    data: np.ndarray  # [N,H,W,3] (fixed) or the 1-D uint8 blob
    offsets: np.ndarray | None
    shapes: np.ndarray | None
    start: int  # where the data begin in the file (the .npy header's length)
    files: list  # the mapped files, kept open for the size checks
    data_fd: int  # the data file's descriptor (among ``files``; -1: an empty file, none opened)
    checks: list = field(default_factory=list)  # (fd, manifest size, path) per mapped file, made once


class Reader(ShardReader):
    """Reads one shard through read-only memory maps, opened lazily in each process.

    Before each read the mapped files' sizes are checked against the manifest (``base.check_size``):
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
        files: list = []
        try:
            m = self._open_maps(files)
            m.checks = [(fh.fileno(), self.sizes[Path(fh.name)], fh.name) for fh in m.files]
            return m
        except BaseException:
            for fh in files:
                fh.close()
            raise

    def _open_maps(self, files: list) -> _Maps:
        n = self.num_samples
        if self.fixed_shape is not None:
            data = load_npy(self.paths[0], "|u1", self.access, files)
            if data.shape != (n, *self.fixed_shape):
                raise DatasetError(f"{self.paths[0]}: shape {data.shape}, manifest says {(n, *self.fixed_shape)}")
            start = os.path.getsize(self.paths[0]) - data.nbytes
            return _Maps(data, None, None, start, files, files[0].fileno() if files else -1)
        # offsets and shapes in memory of our own (copies of their maps, read whole by the checks anyway): they are
        # looked up by read_copies and file_spans in threads that a file truncated meanwhile must not kill
        offsets = np.array(load_npy(self.paths[1], "<i8", files=files))
        size = os.path.getsize(self.paths[0])
        check_offsets(offsets, n, size, self.paths[1])
        data, data_fd = np.zeros(0, np.uint8), -1
        if size:
            fh = _open_file(self.paths[0], files)
            data_fd = fh.fileno()
            data = np.ndarray((size,), np.uint8, buffer=map_readonly(self.paths[0], fh.fileno(), self.access))
        shapes = None
        if self.payload == "raw":
            shapes = np.array(load_npy(self.paths[2], "<i8", files=files))
            if shapes.shape != (n, 3) or np.any(shapes[:, 2] != 3) or np.any(shapes < 0) or not np.array_equal(
                    shapes.prod(axis=1), np.diff(offsets)):
                raise DatasetError(f"{self.paths[2]}: shapes do not match the offsets")
        return _Maps(data, offsets, shapes, 0, files, data_fd)

    def _get(self) -> _Maps:
        """The maps, every mapped file seen to have kept the manifest's size."""
        m = self._maps.get(self._open)
        for fd, expected, name in m.checks:
            check_size(fd, expected, name)
        return m

    def __len__(self) -> int:
        return self.num_samples

    def read(self, pos: int) -> np.ndarray | memoryview:
        """Zero-copy, read-only: (H, W, 3) pixels for raw, a memoryview of the bytes for encoded."""
        m = self._get()
        return sample_view(m.data, m.offsets, m.shapes, pos)

    def read_many(self, positions: list[int]) -> list:
        m = self._get()  # one size check for the batch
        return sample_views(m.data, m.offsets, m.shapes, positions)

    def read_copies(self, positions: list[int], buf: Destinations = None) -> list:
        """The samples' bytes read from the data file with ``pread``, shaped as ``read_many`` gives them
        (``ShardReader.read_copies``)."""
        m = self._get()
        pos = np.asarray(positions, dtype=np.int64)
        if m.offsets is None:
            size = m.data[0].nbytes if len(m.data) else 0
            starts, ends = m.start + pos * size, m.start + (pos + 1) * size
        else:
            starts, ends = m.offsets[pos], m.offsets[pos + 1]
        if m.data_fd < 0:  # an empty data file: every sample is empty
            return sample_views(m.data, m.offsets, m.shapes, positions)
        flats = pread_ranges(m.data_fd, starts.tolist(), ends.tolist(), buf, self.paths[0], self.sizes[self.paths[0]],
                             mapped=(m.data.reshape(-1), m.start))
        if m.offsets is None:
            return [f.reshape(m.data.shape[1:]) for f in flats]
        if m.shapes is None:
            return [f.data for f in flats]
        return [f.reshape(shape) for f, shape in zip(flats, m.shapes[pos].tolist(), strict=True)]

    def file_spans(self, positions: list[int]) -> list[list[tuple[str, int, int]]]:
        """Per position, the byte range of the data file it is read from (see packer.read.readahead)."""
        m = self._get()
        path = str(self.paths[0])
        if m.offsets is None:
            size = m.data[0].nbytes if len(m.data) else 0
            return [[(path, m.start + p * size, m.start + (p + 1) * size)] for p in positions]
        return [[(path, int(m.offsets[p]), int(m.offsets[p + 1]))] for p in positions]

    def _page_cache(self) -> PageCache:
        return PageCache(self.paths[0])

    def cached(self, positions: list[int]) -> np.ndarray:
        m = self._get()
        pos = np.asarray(positions, dtype=np.int64)
        if m.offsets is None:
            size = m.data[0].nbytes if len(m.data) else 0
            return self._cache.get(self._page_cache).resident_each(m.start + pos * size, m.start + (pos + 1) * size)
        return self._cache.get(self._page_cache).resident_each(m.offsets[pos], m.offsets[pos + 1])

    def read_into(self, positions: list[int], out: np.ndarray) -> None:
        """Fixed shape only: copy samples at ascending ``positions`` into ``out[0:len]``, one copy per run."""
        if self.fixed_shape is None:
            raise PackerError(f"{self.paths[0]}: read_into needs a fixed-shape shard")
        copy_runs(self._get().data, positions, out)

    def close(self) -> None:
        self._cache.close(PageCache.close)
        self._maps.close(lambda m: [fh.close() for fh in m.files])  # the mappings go with their last view


FORMAT = Format(
    name="memmap", dataset_class="MemmapDataset", payloads=frozenset({"encoded", "raw", "none"}),
    Writer=Writer, Reader=Reader,
    default_shard_bytes=None,
)
