"""N5's on-disk pieces, as packer writes and checks them: the dataset attributes, the block files and
their headers, gzip inflation with a cap. ``writer`` and ``reader`` build on these.

A block file is a big-endian header, ``mode`` uint16 (0), ``ndim`` uint16, ``ndim`` uint32
sizes of this block (the last block along N is cut to what remains, as the Java library
writes it), then the elements big-endian, raw or gzip-compressed (``--compression gzip``, raw
payloads only: the ``compressions`` of the Format, so the flag keeps the one meaning it has for
hdf5; encoded JPEG/PNG bytes would not shrink). gzip is written as the Java default
(``{"type": "gzip", "level": -1, "useZlib": false}``: gzip framing, mtime 0, so the same
samples give the same bytes).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from packer.errors import DatasetError

N5_VERSION = "2.0.0"
ATTRIBUTES = "attributes.json"
BLOCK_BYTES = 960 << 10  # a block file of 241 pages: one device request where a queue takes 254 (virtio), two
# for 1 MiB (257 pages); never more requests than 1 MiB on smaller queues (docs/results.md, "LMDB's open-time
# check, no copies in the read-ahead thread, n5's block files")
MAX_BLOCK_BYTES = 256 << 20  # refuse attributes promising larger blocks (a crafted file must not allocate more)
_MAX_ATTRIBUTES_BYTES = 1 << 20
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
            raise DatasetError(f"{where}: N5 attributes are not a JSON object")
        dims, block, dtype, comp = (data.get(k) for k in ("dimensions", "blockSize", "dataType", "compression"))
        if not (isinstance(dims, list) and isinstance(block, list) and dims and len(dims) == len(block)
                and all(type(v) is int and v >= 0 for v in dims) and all(type(v) is int and v > 0 for v in block)):
            raise DatasetError(f"{where}: N5 dimensions {dims!r:.80} / blockSize {block!r:.80} are not valid")
        if dtype not in DTYPES:
            raise DatasetError(f"{where}: N5 dataType {dtype!r:.40}, expected one of {', '.join(DTYPES)}")
        kind, use_zlib = (comp.get("type"), comp.get("useZlib", False)) if isinstance(comp, dict) else (None, None)
        if kind not in ("raw", "gzip") or not isinstance(use_zlib, bool):
            raise DatasetError(f"{where}: N5 compression {comp!r:.80} (packer reads raw and gzip)")
        shape = tuple(reversed(dims))
        if list(reversed(block[:-1])) != list(shape[1:]):
            raise DatasetError(f"{where}: blocks split more than the slowest dimension (blockSize {block})")
        arr = cls(shape, block[-1], dtype, kind, use_zlib)
        if arr.rows * arr.row_bytes > MAX_BLOCK_BYTES:
            raise DatasetError(f"{where}: blocks of {arr.rows * arr.row_bytes} bytes (at most {MAX_BLOCK_BYTES})")
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
    write_json(root / names[0], arr.attributes())
    if data is not None:
        flat = np.ascontiguousarray(data, dtype=DTYPES[arr.dtype]).reshape(-1).view(np.uint8)
        step = arr.rows * arr.row_bytes
        for j in range(arr.num_blocks):
            names.append(write_block(root, name, arr, j, flat[j * step : (j + 1) * step]))
    return names


def write_block(root: Path, name: str, arr: Array, j: int, data) -> str:
    rel = f"{name}/{arr.block_name(j)}"
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    with open(root / rel, "wb") as fh:
        fh.write(encode_block(arr, j, data))
    return rel


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, sort_keys=True) + "\n", encoding="utf-8")


def read_attributes(path: Path) -> dict:
    """An ``attributes.json``, size-capped, as a dict."""
    try:
        size = os.stat(path).st_size
        if size > _MAX_ATTRIBUTES_BYTES:
            raise DatasetError(f"{path}: {size} bytes of attributes (at most {_MAX_ATTRIBUTES_BYTES})")
        with open(path, "rb") as fh:
            data = json.loads(fh.read(size + 1))
    except (OSError, ValueError, RecursionError) as exc:
        raise DatasetError(f"{path}: cannot read N5 attributes ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise DatasetError(f"{path}: N5 attributes are not a JSON object")
    return data


def check_block_header(head: bytes, arr: Array, j: int, where: object) -> int:
    """The number of elements block ``j``'s file holds, after its header is checked against ``arr``.

    The sizes must be the block's (cut at the edge, as the Java library writes) or, for the last
    block, the full block size (as tensorstore writes): the needed rows come first either way.
    """
    ndim = len(arr.shape)
    if len(head) < arr.header_bytes():
        raise DatasetError(f"{where}: N5 block shorter than its header")
    mode, nd = struct.unpack_from(">HH", head)
    if mode != 0 or nd != ndim:
        raise DatasetError(f"{where}: N5 block header mode {mode}, {nd} dimensions (expected mode 0, {ndim})")
    dims = struct.unpack_from(f">{ndim}I", head, 4)
    expected = [*reversed(arr.shape[1:]), arr.block_rows(j)]
    if list(dims) != expected and list(dims) != [*expected[:-1], arr.rows]:
        raise DatasetError(f"{where}: N5 block of sizes {list(dims)}, the attributes make it {expected}")
    return prod(dims)


class Inflater:
    """A compressed block inflated as far as reads have needed so far, never past its size.

    A random read inflates the block up to the end of its sample, a later read of the same block
    goes on from there, and a gzip bomb stops at the block's size: the stream must end exactly
    there, which is checked once the whole block has been inflated.
    """

    def __init__(self, arr: Array, data: bytes, size: int, where: object) -> None:
        if size <= 0:  # zlib reads a limit of 0 as "no limit"
            raise DatasetError(f"{where}: empty N5 block")
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
                raise DatasetError(f"{self.where}: gzip block inflates to more than its {self.size} bytes")
        except zlib.error as exc:
            raise DatasetError(f"{self.where}: damaged gzip block ({exc})") from exc
        if len(self.out) < stop or (len(self.out) == self.size and not self.d.eof):
            raise DatasetError(f"{self.where}: gzip block inflates to other than its {self.size} bytes")
        return self.out


def inflate(arr: Array, data: bytes, size: int, where: object) -> bytes:
    """A compressed block's elements: exactly ``size`` bytes (a gzip bomb stops there)."""
    return bytes(Inflater(arr, data, size, where).upto(size))
