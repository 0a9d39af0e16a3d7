"""N5: one chunked N5 container per shard (the Java/Saalfeld layout), readable by tensorstore's ``n5``
driver, zarr's N5 store, the Java N5 libraries and Fiji/BigDataViewer without packer.

| path (per shard, in shard-00000.n5/) | N5 dimensions  | dtype | holds                                       |
|--------------------------------------|----------------|-------|---------------------------------------------|
| attributes.json                      |                |       | ``{"n5": "2.0.0", "packer": {...}}``         |
| images/ (raw, ``--resize HxW``)      | [3, W, H, N]   | uint8 | RGB pixels: numpy ``(N, H, W, 3)``           |
| images/ (encoded; raw, mixed shapes) | [B]            | uint8 | the files' bytes (or HWC pixels) back to back|
| offsets/ (blob layouts)              | [N+1]          | int64 | sample i is ``images[offsets[i]:offsets[i+1]]`` |
| shapes/ (raw, mixed shapes)          | [3, N]         | int64 | numpy ``(N, 3)``: (h, w, 3) of each sample   |
| labels/                              | [N]            | int64 | class index (-1 for a flat folder)           |

Each dataset directory holds ``attributes.json`` (``dimensions``, ``blockSize``, ``dataType``,
``compression``) and one file per block at ``<dataset>/<i0>/<i1>/...`` (grid position in N5
dimension order). N5 lists dimensions fastest-varying first (F order), the reverse of numpy's
C order: an N5 ``[3, W, H, N]`` array is numpy's ``(N, H, W, 3)`` with the same bytes, which is
how tensorstore presents it. Images are blocked along N only (``images/0/0/0/<j>``, whole
images, about 1 MiB of pixels per block: a few images per file) and blobs in 1 MiB blocks
(``images/<j>``); ``--n5-block SIZE`` sets another size. The small int64 arrays are one block
each.

A block file is a big-endian header, ``mode`` uint16 (0), ``ndim`` uint16, ``ndim`` uint32
sizes of this block (the last block along N is cut to what remains, as the Java library
writes it), then the elements big-endian, raw or gzip-compressed (``--compression gzip``, raw
payloads only: the ``compressions`` of the Format, so the flag keeps the one meaning it has for
hdf5; encoded JPEG/PNG bytes would not shrink). gzip is written as the Java default
(``{"type": "gzip", "level": -1, "useZlib": false}``: gzip framing, mtime 0, so the same
samples give the same bytes).

Reading checks each block's header against the dataset's attributes (and those against the
manifest) before it allocates: an uncompressed block must be exactly header + elements long,
a compressed one is inflated with the block's size as the cap (no gzip bomb), and only the
block files the manifest lists are ever opened. Uncompressed samples are one ``pread`` of
their bytes per block they touch. A compressed block is inflated only as far as the samples
read from it need, and the last few blocks are kept partly inflated: a sequential pass
inflates each block once, a random read inflates the start of its block up to its sample
(half a block on average; ``--n5-block`` smaller for random access to gzip blocks).

One shard by default: a shard is a directory of block files, so it never is one huge file.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import cast

import numpy as np

from packer.argtypes import size_arg
from packer.errors import PackerError
from packer.formats.base import (
    Format,
    LazyHandle,
    Option,
    PreparedSample,
    ShardReader,
    ShardWriter,
    Span,
    check_addition,
    check_offsets,
    contiguous_runs,
    fixed_shape,
    shard_layout,
)
from packer.layout.manifest import Shard
from packer.units import parse_bytes

N5_VERSION = "2.0.0"
ATTRIBUTES = "attributes.json"
_BLOCK_BYTES = 1 << 20
_MAX_BLOCK_BYTES = 256 << 20  # refuse attributes promising larger blocks (a crafted file must not allocate more)
_MAX_ATTRIBUTES_BYTES = 1 << 20
_OPEN_FILES = 64  # block files a reader keeps open per process
_DECODED_BLOCKS = 4  # compressed blocks a reader keeps (partly) inflated per process
DTYPES = {"uint8": np.dtype("u1"), "int64": np.dtype(">i8")}  # N5 stores big-endian
_GZIP = {"type": "gzip", "level": -1, "useZlib": False}


def shard_dir(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.n5"


@dataclass(frozen=True)
class Array:
    """One N5 dataset as packer uses it: numpy (C) order, blocked along the first axis only."""

    shape: tuple[int, ...]  # numpy order (N5's dimensions reversed)
    rows: int  # block size along the first axis; the block spans the other axes whole
    dtype: str  # N5 dataType
    compression: str = "raw"  # raw or gzip
    use_zlib: bool = False  # gzip: zlib framing instead of gzip's (readers accept both)

    @property
    def row_bytes(self) -> int:
        return prod(self.shape[1:]) * DTYPES[self.dtype].itemsize

    @property
    def num_blocks(self) -> int:
        return -(-self.shape[0] // self.rows)

    def block_rows(self, j: int) -> int:
        return min(self.rows, self.shape[0] - j * self.rows)

    def block_name(self, j: int) -> str:
        """The block's path in its dataset directory: grid position in N5 order (ours is [0, ..., 0, j])."""
        return "/".join(["0"] * (len(self.shape) - 1) + [str(j)])

    def header_bytes(self) -> int:
        return 4 + 4 * len(self.shape)

    def attributes(self) -> dict:
        compression = dict(_GZIP) if self.compression == "gzip" else {"type": "raw"}
        return {"dimensions": list(reversed(self.shape)), "blockSize": [*reversed(self.shape[1:]), self.rows],
                "dataType": self.dtype, "compression": compression}

    @classmethod
    def from_attributes(cls, data: object, where: object) -> Array:
        """Check a dataset's attributes: plain integers, a known type and codec, whole rows, bounded blocks."""
        if not isinstance(data, dict):
            raise PackerError(f"{where}: N5 attributes are not a JSON object")
        dims, block, dtype, comp = (data.get(k) for k in ("dimensions", "blockSize", "dataType", "compression"))
        if not (isinstance(dims, list) and isinstance(block, list) and dims and len(dims) == len(block)
                and all(type(v) is int and v >= 0 for v in dims) and all(type(v) is int and v > 0 for v in block)):
            raise PackerError(f"{where}: N5 dimensions {dims!r:.80} / blockSize {block!r:.80} are not valid")
        if dtype not in DTYPES:
            raise PackerError(f"{where}: N5 dataType {dtype!r:.40}, expected one of {', '.join(DTYPES)}")
        kind, use_zlib = (comp.get("type"), comp.get("useZlib", False)) if isinstance(comp, dict) else (None, None)
        if kind not in ("raw", "gzip") or not isinstance(use_zlib, bool):
            raise PackerError(f"{where}: N5 compression {comp!r:.80} (packer reads raw and gzip)")
        shape = tuple(reversed(dims))
        if list(reversed(block[:-1])) != list(shape[1:]):
            raise PackerError(f"{where}: blocks split more than the slowest dimension (blockSize {block})")
        arr = cls(shape, block[-1], dtype, kind, use_zlib)
        if arr.rows * arr.row_bytes > _MAX_BLOCK_BYTES:
            raise PackerError(f"{where}: blocks of {arr.rows * arr.row_bytes} bytes (at most {_MAX_BLOCK_BYTES})")
        return arr


def encode_block(arr: Array, j: int, data: bytes | memoryview) -> bytes:
    """Block ``j`` of ``arr`` as a file: the N5 header (this block's sizes), then its elements."""
    dims = [*reversed(arr.shape[1:]), arr.block_rows(j)]
    header = struct.pack(f">HH{len(dims)}I", 0, len(dims), *dims)
    if arr.compression == "gzip":
        comp = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, 15 if arr.use_zlib else 31)
        return header + comp.compress(data) + comp.flush()
    return header + bytes(data)


def write_dataset(root: Path, name: str, arr: Array, data: np.ndarray | None) -> list[str]:
    """Write an N5 dataset (attributes, and ``data``'s blocks if given); returns the file names under ``root``."""
    (root / name).mkdir(parents=True, exist_ok=True)
    names = [f"{name}/{ATTRIBUTES}"]
    _write_json(root / names[0], arr.attributes())
    if data is not None:
        flat = np.ascontiguousarray(data, dtype=DTYPES[arr.dtype]).reshape(-1).view(np.uint8)
        step = arr.rows * arr.row_bytes
        for j in range(arr.num_blocks):
            names.append(_write_block(root, name, arr, j, flat[j * step : (j + 1) * step]))
    return names


def _write_block(root: Path, name: str, arr: Array, j: int, data) -> str:
    rel = f"{name}/{arr.block_name(j)}"
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    with open(root / rel, "wb") as fh:
        fh.write(encode_block(arr, j, data))
    return rel


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, sort_keys=True) + "\n", encoding="utf-8")


def read_attributes(path: Path) -> dict:
    """An ``attributes.json``, size-capped, as a dict."""
    try:
        size = os.stat(path).st_size
        if size > _MAX_ATTRIBUTES_BYTES:
            raise PackerError(f"{path}: {size} bytes of attributes (at most {_MAX_ATTRIBUTES_BYTES})")
        with open(path, "rb") as fh:
            data = json.loads(fh.read(size + 1))
    except (OSError, ValueError, RecursionError) as exc:
        raise PackerError(f"{path}: cannot read N5 attributes ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise PackerError(f"{path}: N5 attributes are not a JSON object")
    return data


def check_block_header(head: bytes, arr: Array, j: int, where: object) -> int:
    """The number of elements block ``j``'s file holds, after its header is checked against ``arr``.

    The sizes must be the block's (cut at the edge, as the Java library writes) or, for the last
    block, the full block size (as tensorstore writes): the needed rows come first either way.
    """
    ndim = len(arr.shape)
    if len(head) < arr.header_bytes():
        raise PackerError(f"{where}: N5 block shorter than its header")
    mode, nd = struct.unpack_from(">HH", head)
    if mode != 0 or nd != ndim:
        raise PackerError(f"{where}: N5 block header mode {mode}, {nd} dimensions (expected mode 0, {ndim})")
    dims = struct.unpack_from(f">{ndim}I", head, 4)
    expected = [*reversed(arr.shape[1:]), arr.block_rows(j)]
    if list(dims) != expected and list(dims) != [*expected[:-1], arr.rows]:
        raise PackerError(f"{where}: N5 block of sizes {list(dims)}, the attributes make it {expected}")
    return prod(dims)


class Inflater:
    """A compressed block inflated as far as reads have needed so far, never past its size.

    A random read inflates the block up to the end of its sample, a later read of the same block
    goes on from there, and a gzip bomb stops at the block's size: the stream must end exactly
    there, which is checked once the whole block has been inflated.
    """

    def __init__(self, arr: Array, data: bytes, size: int, where: object) -> None:
        if size <= 0:  # zlib reads a limit of 0 as "no limit"
            raise PackerError(f"{where}: empty N5 block")
        self.d = zlib.decompressobj(15 if arr.use_zlib else 31)
        self.tail, self.size, self.where = data, size, where
        self.out = bytearray()

    def upto(self, stop: int) -> bytearray:
        """The block's elements, at least its first ``stop`` bytes inflated."""
        try:
            while len(self.out) < stop and not self.d.eof:
                before = len(self.tail)
                chunk = self.d.decompress(self.tail, min(self.size - len(self.out), max(stop - len(self.out), 1 << 16)))
                self.tail = self.d.unconsumed_tail
                self.out += chunk
                if not chunk and len(self.tail) == before:
                    break  # no input left before the stream's end
            if len(self.out) == self.size and not self.d.eof and self.d.decompress(self.tail, 1):
                raise PackerError(f"{self.where}: gzip block inflates to more than its {self.size} bytes")
        except zlib.error as exc:
            raise PackerError(f"{self.where}: damaged gzip block ({exc})") from exc
        if len(self.out) < stop or (len(self.out) == self.size and not self.d.eof):
            raise PackerError(f"{self.where}: gzip block inflates to other than its {self.size} bytes")
        return self.out


def inflate(arr: Array, data: bytes, size: int, where: object) -> bytes:
    """A compressed block's elements: exactly ``size`` bytes (a gzip bomb stops there)."""
    return bytes(Inflater(arr, data, size, where).upto(size))


# ---------------------------------------------------------------- writing


def block_bytes(options: Mapping) -> int | None:
    """``--n5-block`` in bytes (a number, or a size such as ``64KiB`` from the Python API), else None."""
    value = options.get("n5_block")
    if value is None:
        return None
    try:
        size = value if type(value) is int else parse_bytes(str(value))
    except ValueError as exc:  # argparse.ArgumentTypeError is a ValueError
        raise PackerError(f"--n5-block {value!r}: {exc}") from None
    if not 1 <= size <= _MAX_BLOCK_BYTES:
        raise PackerError(f"--n5-block {value}: must be between 1 byte and {_MAX_BLOCK_BYTES >> 20} MiB")
    return size


class N5Format(Format):
    def check_options(self, options: Mapping) -> None:
        block_bytes(options)


class Writer(ShardWriter):
    """Streams images into blocks as they fill; the small arrays and all attributes are written at close."""

    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: Mapping) -> None:
        super().__init__(directory, shard_id, num_samples, payload, options)
        self.shape = fixed_shape(payload, options)
        self.compression = options.get("compression") or "raw"
        self.name = shard_dir(shard_id)
        self.root = self.directory / self.name
        target = block_bytes(options) or _BLOCK_BYTES
        if self.shape is not None:  # whole images per block
            self.rows = max(1, target // prod(self.shape))
            self.step = self.rows * prod(self.shape)
        else:
            self.rows = self.step = target
        self._count = 0
        self._offsets = np.zeros(num_samples + 1, dtype=np.int64)
        self._labels = np.zeros(num_samples, dtype=np.int64)
        self._shapes = np.zeros((num_samples, 3), dtype=np.int64)
        self._pending = bytearray()
        self._blocks: list[str] = []
        (self.root / "images").mkdir(parents=True, exist_ok=True)  # OSError propagates: the driver reports it

    def _images(self, total: int) -> Array:
        if self.shape is not None:
            return Array((total // prod(self.shape), *self.shape), self.rows, "uint8", self.compression)
        return Array((total,), self.rows, "uint8", self.compression)

    def add(self, sample: PreparedSample) -> None:
        check_addition(self.root, self._count, self.planned, sample, self.shape)
        data = sample.payload
        if self.payload == "raw":
            self._shapes[self._count] = cast(np.ndarray, data).shape
        self._labels[self._count] = sample.label
        self._count += 1
        self._offsets[self._count] = self._offsets[self._count - 1] + sample.nbytes
        self._pending += data if isinstance(data, bytes) else data.data.cast("B")
        while len(self._pending) >= self.step:
            self._flush(self.step)

    def _flush(self, n: int) -> None:
        j = len(self._blocks)
        # The block's edge sizes come from the total so far: a full block is never an edge.
        arr = self._images(j * self.step + n)
        head, self._pending = self._pending[:n], self._pending[n:]
        self._blocks.append(_write_block(self.root, "images", arr, j, head))

    def close(self) -> tuple[list[str], dict]:
        if self._pending:
            self._flush(len(self._pending))
        n = self._count
        images = self._images(int(self._offsets[n]))
        names = [ATTRIBUTES, *write_dataset(self.root, "images", images, None), *self._blocks]
        layout = "fixed" if self.shape is not None else "blob"
        if self.shape is None:
            names += write_dataset(self.root, "offsets", Array((n + 1,), n + 1, "int64"), self._offsets[: n + 1])
            if self.payload == "raw":
                names += write_dataset(self.root, "shapes", Array((n, 3), max(n, 1), "int64"), self._shapes[:n])
        names += write_dataset(self.root, "labels", Array((n,), max(n, 1), "int64"), self._labels[:n])
        _write_json(self.root / ATTRIBUTES, {"n5": N5_VERSION, "packer": {
            "format": "n5", "payload": self.payload, "layout": layout, "num_samples": n,
            "description": _DESCRIBE[(self.payload, layout)]}})
        facts: dict = {"layout": layout, "rows": self.rows,
                       "compression": None if self.compression == "raw" else "gzip"}
        if self.shape is not None:
            facts["shape"] = list(self.shape)
        return [f"{self.name}/{x}" for x in names], facts

    def abort(self) -> None:
        for dirpath, _dirnames, filenames in os.walk(self.root, topdown=False):
            for f in filenames:
                os.unlink(os.path.join(dirpath, f))
            os.rmdir(dirpath)


_DESCRIBE = {
    ("encoded", "blob"): "original image files back to back; image i is images[offsets[i]:offsets[i+1]]",
    ("raw", "blob"): "decoded RGB pixels back to back; image i is images[offsets[i]:offsets[i+1]] "
    "reshaped to shapes[i] (height, width, 3)",
    ("raw", "fixed"): "decoded RGB pixels: images is (N, height, width, 3) uint8 in numpy order",
}


# ---------------------------------------------------------------- reading


@dataclass
class _Open:
    images: Array
    blocks: list[str]  # path of each images block (files the manifest lists)
    block_sizes: list[int]  # their sizes, as the manifest records them
    offsets: np.ndarray | None  # N+1 (blob layouts)
    shapes: np.ndarray | None  # N x 3 (raw, mixed shapes)
    fds: OrderedDict = field(default_factory=OrderedDict)  # block number -> open descriptor (LRU)
    checked: set = field(default_factory=set)  # raw blocks whose header and size were checked
    decoded: OrderedDict = field(default_factory=OrderedDict)  # block number -> its Inflater (LRU)


class Reader(ShardReader):
    """Reads one shard container; attributes and small arrays are read and checked on first use in each process."""

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        self.directory = Path(directory)
        self.files = [f.name for f in shard.files]
        self.sizes = {f.name: f.num_bytes for f in shard.files}
        self.root_name = self.files[0].removesuffix("/" + ATTRIBUTES)
        if "/" in self.root_name or self.files[0] != f"{self.root_name}/{ATTRIBUTES}":
            raise PackerError(f"{self.directory / self.files[0]}: an n5 shard's first file is <shard>.n5/{ATTRIBUTES}")
        self.num_samples = shard.num_samples
        self.payload = payload
        self.access = access
        self.facts = shard.facts
        self.fixed_shape = shard_layout(shard.facts, self.directory / self.files[0])
        self._h: LazyHandle[_Open] = LazyHandle()

    def _path(self, rel: str) -> Path:
        """The path of a file of this shard; only files the manifest lists (it checked they stay inside)."""
        if f"{self.root_name}/{rel}" not in self.sizes:
            raise PackerError(f"{self.directory / self.root_name / rel}: needed, but the manifest does not list it")
        return self.directory / self.root_name / rel

    def _where(self, rel: str) -> Path:
        return self.directory / self.root_name / rel

    def _dataset(self, name: str) -> tuple[Array, list[str]]:
        path = self._path(f"{name}/{ATTRIBUTES}")
        arr = Array.from_attributes(read_attributes(path), path)
        if arr.num_blocks >= len(self.files):
            raise PackerError(f"{path}: {arr.num_blocks} blocks, the manifest lists {len(self.files)} files")
        return arr, [f"{name}/{ATTRIBUTES}"] + [f"{name}/{arr.block_name(j)}" for j in range(arr.num_blocks)]

    def _small(self, arr: Array, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A one-block int64 dataset of exactly ``shape``, read whole."""
        if arr.shape != shape or arr.dtype != "int64" or arr.num_blocks > 1:
            raise PackerError(f"{self._where(name)}: {arr.shape} {arr.dtype} in {arr.num_blocks} blocks, "
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
            raise PackerError(f"{path}: cannot read N5 block ({exc.strerror or exc})") from exc
        count = check_block_header(data, arr, j, path)
        return memoryview(data)[arr.header_bytes():], count * DTYPES[arr.dtype].itemsize, path

    def _block(self, arr: Array, j: int, name: str) -> bytes:
        """Block ``j`` of a dataset, its needed rows (header checked, inflated no further than its size)."""
        body, size, path = self._read_block(arr, j, name)
        need = arr.block_rows(j) * arr.row_bytes
        if arr.compression == "gzip":
            return inflate(arr, bytes(body), size, path)[:need]
        if len(body) != size:
            raise PackerError(f"{path}: N5 block holds {len(body)} bytes of data, its header says {size}")
        return bytes(body[:need])

    def _inflater(self, arr: Array, j: int) -> Inflater:
        body, size, path = self._read_block(arr, j, "images")
        return Inflater(arr, bytes(body), size, path)

    def _open(self) -> _Open:
        n, shape = self.num_samples, self.fixed_shape
        root = read_attributes(self._path(ATTRIBUTES))
        if not str(root.get("n5", "")).startswith("2."):
            raise PackerError(f"{self._path(ATTRIBUTES)}: not an N5 2.x container (n5: {root.get('n5')!r:.40})")
        images, names = self._dataset("images")
        gzip = "gzip" if images.compression == "gzip" else None
        if images.dtype != "uint8" or gzip != self.facts.get("compression") or images.rows != self.facts.get("rows"):
            raise PackerError(f"{self._where('images')}: {images} disagrees with the manifest ({self.facts})")
        offsets = shapes = None
        if shape is not None:
            if images.shape != (n, *shape):
                raise PackerError(f"{self._where('images')}: shape {images.shape}, the manifest says {(n, *shape)}")
        else:
            if len(images.shape) != 1:
                raise PackerError(f"{self._where('images')}: shape {images.shape}, expected a 1-D blob")
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
                    raise PackerError(f"{self._where('shapes')}: shapes do not match the offsets")
        arr, more = self._dataset("labels")
        if arr.shape != (n,) or arr.dtype != "int64":
            raise PackerError(f"{self._where('labels')}: shape {arr.shape} {arr.dtype}, expected ({n},) int64")
        names += more
        # Only files the manifest lists are ever opened: the attributes must name exactly those.
        if [f"{self.root_name}/{x}" for x in [ATTRIBUTES, *names]] != self.files:
            raise PackerError(f"{self.directory / self.root_name}: the N5 attributes describe other files "
                              "than the manifest lists")
        rels = [f"images/{images.block_name(j)}" for j in range(images.num_blocks)]
        return _Open(images, [str(self._path(r)) for r in rels], [self.sizes[f"{self.root_name}/{r}"] for r in rels],
                     offsets, shapes)

    def __len__(self) -> int:
        return self.num_samples

    # ------------------------------------------------------------ the images' bytes

    def _fd(self, h: _Open, j: int) -> int:
        fd = h.fds.pop(j, None)
        if fd is None:
            path = h.blocks[j]
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise PackerError(f"{path}: cannot open N5 block ({exc.strerror or exc})") from exc
            if self.access == "random" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            while len(h.fds) >= _OPEN_FILES:
                os.close(h.fds.popitem(last=False)[1])
        h.fds[j] = fd
        return fd

    def _range(self, h: _Open, j: int, a: int, b: int) -> bytes:
        """Bytes [a, b) of block ``j``'s elements."""
        arr = h.images
        if arr.compression == "gzip":
            block = h.decoded.pop(j, None)
            if block is None:
                block = self._inflater(arr, j)
                while len(h.decoded) >= _DECODED_BLOCKS:
                    h.decoded.popitem(last=False)
            h.decoded[j] = block
            return bytes(block.upto(b)[a:b])
        fd, where = self._fd(h, j), h.blocks[j]
        hb = arr.header_bytes()
        if j not in h.checked:
            count = check_block_header(os.pread(fd, hb, 0), arr, j, where)
            if os.fstat(fd).st_size != hb + count:
                raise PackerError(f"{where}: N5 block of {os.fstat(fd).st_size - hb} bytes, its header says {count}")
            h.checked.add(j)
        data = os.pread(fd, b - a, hb + a)
        if len(data) != b - a:
            raise PackerError(f"{where}: truncated while reading")
        return data

    def _bytes(self, h: _Open, a: int, b: int) -> bytes:
        """Bytes [a, b) of the images dataset, flat in C order, from the blocks they lie in."""
        if a == b:
            return b""
        step = h.images.rows * h.images.row_bytes
        parts = [self._range(h, j, max(a, j * step) - j * step, min(b, (j + 1) * step) - j * step)
                 for j in range(a // step, -(-b // step))]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _span(self, h: _Open, pos: int) -> tuple[int, int]:
        if h.offsets is None:
            size = h.images.row_bytes
            return pos * size, (pos + 1) * size
        return int(h.offsets[pos]), int(h.offsets[pos + 1])

    def _split(self, h: _Open, data: bytes, start: int, stop: int) -> list:
        base, out = self._span(h, start)[0], []
        view = np.frombuffer(data, dtype=np.uint8)
        for pos in range(start, stop):
            a, b = self._span(h, pos)
            part = view[a - base : b - base]
            if h.offsets is None:
                out.append(part.reshape(self.fixed_shape))
            else:
                out.append(part.data if h.shapes is None else part.reshape(h.shapes[pos]))
        return out

    def read(self, pos: int) -> np.ndarray | memoryview:
        """Read-only: (H, W, 3) pixels for raw, a memoryview of the file's bytes for encoded."""
        return self.read_many([pos])[0]

    def read_many(self, positions: Sequence[int]) -> list:
        """One read per block touched by each run of neighbouring positions."""
        h = self._h.get(self._open)
        out: list = []
        for start, stop in contiguous_runs(list(positions)):
            out += self._split(h, self._bytes(h, self._span(h, start)[0], self._span(h, stop - 1)[1]), start, stop)
        return out

    def read_into(self, positions: Sequence[int], out: np.ndarray) -> None:
        """Fixed shape only: copy samples at ascending ``positions`` into ``out[0:len]``."""
        if self.fixed_shape is None:
            raise PackerError(f"{self.directory / self.root_name}: read_into needs a fixed-shape shard")
        for k, arr in enumerate(self.read_many(positions)):
            out[k] = arr

    def file_spans(self, positions: Sequence[int]) -> list[list[Span]]:
        """Per position, the byte ranges of the block files it is read from (see packer.read.readahead)."""
        h = self._h.get(self._open)
        arr = h.images
        step, hb = arr.rows * arr.row_bytes, arr.header_bytes()
        out = []
        for p in positions:
            a, b = self._span(h, p)
            spans = []
            for j in range(a // step, -(-b // step)):
                if arr.compression == "gzip":  # inflated whole
                    spans.append((h.blocks[j], 0, h.block_sizes[j]))
                else:
                    lo, hi = max(a, j * step) - j * step, min(b, (j + 1) * step) - j * step
                    spans.append((h.blocks[j], hb + lo, hb + hi))
            out.append(spans)
        return out

    def close(self) -> None:
        def closer(h: _Open) -> None:
            for fd in h.fds.values():
                os.close(fd)

        self._h.close(closer)


FORMAT = N5Format(
    name="n5", dataset_class="N5Dataset", payloads=frozenset({"encoded", "raw"}), Writer=Writer, Reader=Reader,
    default_shard_bytes=None,
    compressions=frozenset({"gzip"}),
    options=(Option("n5_block", "n5: bytes of images per block file (default 1MiB); "
                    "whole images with --resize HxW", metavar="SIZE", type=size_arg),),
)
